//! The planner behind `vitscale plan`: a model of the training step that explains the lab's
//! measurements and predicts clusters we do not have. Pure functions of its inputs (a compute
//! profile, a cluster, comm bench fits, a run configuration); it never touches an engine.
//!
//! - `profile`   — the compute profile format (`bench --profile-out`), checked and interpolated.
//! - `comm_fit`  — α and β per collective fitted from a `bench --comm --comm-out` file.
//! - `cluster`   — cluster files: nodes, devices, ranks per device, levels.
//! - `model`     — the step-time model (compute, bucketed communication, optimizer, data) and memory.
//! - `validate`  — every measured point of a sweep predicted from the one-rank inputs.
//! - `recommend` — the micro/GAS/ZeRO/bucket/wire choices that reach a global batch, ranked.
//! - `project`   — a cluster's prediction over node counts and micro sizes, as table and chart.

pub mod cluster;
pub mod comm_fit;
pub mod model;
pub mod profile;
pub mod project;
pub mod recommend;
pub mod validate;

use crate::config::{Balance, CommDtype, RunConfig};
use crate::core::Span;
use crate::train::memory::DeviceMemory;
use crate::train::plan::{DeviceTraits, Plan};
use cluster::Cluster;
use model::{Network, Scenario};
use profile::Profile;

/// The network of `c`.
pub fn network(c: &Cluster) -> Network {
    Network { ranks_per_node: c.ranks_per_node(), nodes: c.nodes, intra: c.intra.clone(), inter: c.inter.clone() }
}

/// The run's plan (`train::plan::Plan`) of `cfg` on the profiled device: its activation dtype
/// and saved attention, and the profile's recompute where the configuration says "auto". The
/// batch split, ZeRO layout and memory estimate the planner reads come from it.
pub fn run_plan(profile: &Profile, cfg: &RunConfig) -> Plan {
    let att = profile.attention_saved_per_image;
    let attention = move |b: usize, _n: usize, _h: usize, _d: usize| att * b;
    let dev = DeviceTraits {
        memory: DeviceMemory { compute_bytes: profile.compute_bytes, compute_copy: profile.compute_bytes < 4.0, attention_saved: &attention },
        recompute_below: if profile.recompute { usize::MAX } else { 0 },
        choices: Default::default(),
    };
    Plan::for_config(cfg, dev)
}

/// The scenario of a run of `cfg` with `plan` (its batch, ZeRO stage, buckets, wire dtype,
/// balance and emulated slowdowns).
pub fn scenario(cfg: &RunConfig, plan: &Plan) -> Scenario {
    let world = plan.world_size;
    let mut s = Scenario::new(plan.micro_batch, plan.gradient_accumulation_steps);
    s.zero_stage = plan.zero.stage;
    s.stage3 = cfg.zero3;
    s.reduce_scatter = plan.zero.reduce_scatter;
    s.bucket_elems = plan.zero.bucket_elems;
    s.overlap = plan.zero.overlap_comm;
    s.comm_bf16 = cfg.grad_comm.dtype == CommDtype::Bf16;
    s.sequence_parallel = plan.sequence_parallel;
    let mut slow = vec![1.0; world];
    for &(r, f) in &cfg.train.emulate_slowdown {
        if let Some(x) = slow.get_mut(r) {
            *x = f;
        }
    }
    s.shares = match &cfg.train.balance {
        Balance::Off => None,
        Balance::Shares(sh) => Some(sh.clone()),
        // the balancer converges to shares proportional to each rank's speed
        Balance::Auto => Some(slow.iter().map(|f| 1.0 / f).collect()),
    };
    s.slowdown = if slow.iter().all(|f| *f == 1.0) { Vec::new() } else { slow };
    s
}

/// The gradient groups of the profiled model (the order the backward finishes them).
pub fn groups(profile: &Profile) -> Vec<Span> {
    crate::model::ParamTable::new(&profile.model_config).gradient_groups()
}

/// The run configuration the planner assumes without `--config`: the profiled model with
/// the benchmark's optimizer (AdamW), everything else the engine's defaults.
pub fn default_config_value(profile: &Profile) -> serde_json::Value {
    serde_json::json!({
        "model": profile.model_config,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.05}},
        "data": {"dataset": "synthetic", "train_size": 1, "val_size": 1}
    })
}

/// Resolves `v` with micro, GAS and world given (the batch keys of `v` are replaced).
pub fn resolve_with(v: &serde_json::Value, micro: usize, gas: usize, world: usize) -> Result<RunConfig, String> {
    let mut v = v.clone();
    let obj = v.as_object_mut().ok_or("the configuration must be a JSON object")?;
    obj.remove("train_batch_size");
    obj.insert("train_micro_batch_size_per_gpu".into(), micro.into());
    obj.insert("gradient_accumulation_steps".into(), gas.into());
    crate::config::resolve(&v, world).map_err(|e| e.to_string())
}

/// The loader's images/s per core from a `bench --data --json` line saved to `path`: the
/// one-thread point of `pipeline` (default: `cifar32_crop_flip` for images up to 64 px, else
/// `jpeg224_rrc_flip_loader`).
pub fn loader_rate(path: &std::path::Path, pipeline: Option<&str>, image_size: usize) -> Result<(String, f64), String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("data bench {shown}: {e}"))?;
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{')).ok_or_else(|| format!("data bench {shown}: no JSON line (save the output of `vitscale bench --data --json`)"))?;
    let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("data bench {shown}: {e}"))?;
    let points = v.get("points").and_then(|p| p.as_array()).ok_or_else(|| format!("data bench {shown}: no `points`"))?;
    let want = pipeline.unwrap_or(if image_size <= 64 { "cifar32_crop_flip" } else { "jpeg224_rrc_flip_loader" });
    let rate = points
        .iter()
        .filter(|p| p.get("pipeline").and_then(|x| x.as_str()) == Some(want))
        .min_by_key(|p| p.get("threads").and_then(|x| x.as_u64()).unwrap_or(u64::MAX))
        .and_then(|p| p.get("images_per_s_per_core").and_then(|x| x.as_f64()))
        .filter(|r| r.is_finite() && *r > 0.0)
        .ok_or_else(|| format!("data bench {shown}: no positive images_per_s_per_core for pipeline `{want}`"))?;
    Ok((want.to_string(), rate))
}

/// Checks that a configuration's model is the profiled one.
pub fn check_model(profile: &Profile, cfg: &RunConfig, what: &str) -> Result<(), String> {
    if cfg.model != profile.model_config {
        return Err(format!(
            "{what} trains {:?} but the profile is of {} ({:?}): profile that model with `vitscale bench --profile-out`",
            cfg.model, profile.model, profile.model_config
        ));
    }
    Ok(())
}
