//! `vitscale plan --recommend --global-batch B [--memory-limit GiB]`: every split of B into
//! micro × GAS × ranks on the cluster, crossed with ZeRO stage 0/1/2, a few bucket sizes and
//! both gradient wire dtypes, predicted (`plan::model`) and ranked by throughput; choices whose
//! memory per rank exceeds the limit are dropped.

use serde::Serialize;

use super::cluster::Cluster;
use super::model;
use super::profile::Profile;

/// One ranked choice.
#[derive(Clone, Debug, Serialize)]
pub struct Choice {
    pub micro: usize,
    pub gas: usize,
    pub zero_stage: u8,
    pub bucket_elems: usize,
    pub comm_dtype: &'static str,
    /// The other bucket sizes predicted exactly alike (a model whose gradients fit one bucket
    /// of each): one row stands for them all.
    pub same_with_buckets: Vec<usize>,
    pub images_per_s: f64,
    pub step_s: f64,
    pub comm_exposed_s: f64,
    pub memory_per_rank_bytes: u64,
}

/// The choices reaching `global_batch` on `cluster` that fit `memory_limit` bytes per rank,
/// fastest first (throughput in steps of 0.5 %; within one, less memory first).
pub fn recommend(profile: &Profile, cluster: &Cluster, base: &serde_json::Value, global_batch: usize, memory_limit: Option<f64>) -> Result<Vec<Choice>, String> {
    let world = cluster.world();
    if global_batch == 0 || !global_batch.is_multiple_of(world) {
        return Err(format!("--global-batch {global_batch} is not a positive multiple of the cluster's {}", crate::util::plural(world, "rank", "ranks")));
    }
    let per_rank = global_batch / world;
    let groups = super::groups(profile);
    let net = super::network(cluster);
    let default = crate::train::sync::DEFAULT_BUCKET_ELEMS;
    let mut buckets = vec![default / 4, default, default * 4, profile.params.max(1)];
    buckets.sort_unstable();
    buckets.dedup();
    let mut all = Vec::new();
    for micro in (1..=per_rank).filter(|m| per_rank.is_multiple_of(*m)) {
        let gas = per_rank / micro;
        for stage in 0u8..=2 {
            let mut v = base.clone();
            v["zero_optimization"] = serde_json::json!({"stage": stage});
            let cfg = super::resolve_with(&v, micro, gas, world)?;
            let plan = super::run_plan(profile, &cfg);
            let mem = model::memory(&plan)?;
            if memory_limit.is_some_and(|l| mem.total as f64 > l) {
                continue;
            }
            for &bucket in &buckets {
                for bf16 in [false, true] {
                    let mut s = super::scenario(&cfg, &plan);
                    s.bucket_elems = bucket;
                    s.comm_bf16 = bf16;
                    s.ranks_per_device = cluster.ranks_per_device;
                    s.compute_scale = cluster.compute_scale;
                    s.loader = cluster.loader_images_per_s_per_core.map(|r| (r, cluster.loader_cores_per_rank));
                    let p = model::predict(profile, &groups, &s, &net)?;
                    all.push(Choice {
                        micro,
                        gas,
                        zero_stage: stage,
                        bucket_elems: bucket,
                        comm_dtype: if bf16 { "bf16" } else { "fp32" },
                        same_with_buckets: Vec::new(),
                        images_per_s: p.images_per_s,
                        step_s: p.step_s,
                        comm_exposed_s: p.comm_exposed_s,
                        memory_per_rank_bytes: mem.total,
                    });
                }
            }
        }
    }
    let mut out = collapse_buckets(all);
    // throughput in steps of 0.5 % (a total order), then less memory, then faster
    let step = |c: &Choice| (c.images_per_s.max(1e-300).ln() / 1.005f64.ln()).floor() as i64;
    out.sort_by(|a, b| step(b).cmp(&step(a)).then(a.memory_per_rank_bytes.cmp(&b.memory_per_rank_bytes)).then(b.images_per_s.total_cmp(&a.images_per_s)));
    Ok(out)
}

/// Merges choices that differ only in bucket size and are predicted alike (same throughput,
/// step, exposed communication and memory): the first bucket size stays, the others are
/// listed in `same_with_buckets`.
fn collapse_buckets(choices: Vec<Choice>) -> Vec<Choice> {
    let same = |a: f64, b: f64| (a - b).abs() <= 1e-9 * a.abs().max(b.abs());
    let mut out: Vec<Choice> = Vec::with_capacity(choices.len());
    for c in choices {
        let twin = out.iter_mut().find(|o| {
            o.micro == c.micro
                && o.gas == c.gas
                && o.zero_stage == c.zero_stage
                && o.comm_dtype == c.comm_dtype
                && o.memory_per_rank_bytes == c.memory_per_rank_bytes
                && same(o.images_per_s, c.images_per_s)
                && same(o.step_s, c.step_s)
                && same(o.comm_exposed_s, c.comm_exposed_s)
        });
        match twin {
            Some(o) => o.same_with_buckets.push(c.bucket_elems),
            None => out.push(c),
        }
    }
    out
}
