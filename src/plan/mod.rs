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
use cluster::Cluster;
use model::{Network, Scenario};
use profile::Profile;

/// The network of `c`.
pub fn network(c: &Cluster) -> Network {
    Network { ranks_per_node: c.ranks_per_node(), nodes: c.nodes, intra: c.intra.clone(), inter: c.inter.clone() }
}

/// The scenario of a run configuration over `world` ranks (its batch, ZeRO stage, buckets,
/// wire dtype, balance and emulated slowdowns).
pub fn scenario(cfg: &RunConfig, world: usize) -> Scenario {
    let mut s = Scenario::new(cfg.batch.micro_batch_per_gpu, cfg.batch.gradient_accumulation_steps);
    s.zero_stage = cfg.zero_stage;
    s.reduce_scatter = cfg.zero_reduce_scatter;
    s.bucket_elems = cfg.reduce_bucket_size.unwrap_or(crate::train::sync::DEFAULT_BUCKET_ELEMS);
    s.overlap = cfg.zero_overlap_comm;
    s.comm_bf16 = cfg.grad_comm.dtype == CommDtype::Bf16;
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
