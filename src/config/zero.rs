//! DeepSpeed's `zero_optimization` block: the ZeRO stage (0-2; 3 runs as 2) and the gradient
//! buckets' size and schedule. DeepSpeed's many tuning and offload keys are accepted and
//! listed in one warning.

use serde_json::{json, Map, Value};

use super::key_def::*;
use super::types::RunConfig;
use super::value::*;

pub(super) const ZERO_OPTIMIZATION: KeyDef = key("zero_optimization", Ty::Section, Dflt::Unset, "DeepSpeed ZeRO block: stages 0-2 are honoured (3 runs as 2, warned); see the keys below.");

// The stage, the buckets and their schedule leave the reduced gradient, and so the
// trajectory, as it was (tests/dist_zero.rs): a resume may change them.
pub(super) const ZERO_STAGE: KeyDef = key("stage", Ty::Int { lo: 0, hi: 3 }, Dflt::Int(0),
    "0 = plain data parallel, 1 = shard the optimizer state (all-reduced gradients), 2 = + reduce-scatter the gradients so each rank gets only its shard; 3 (partitioned parameters) is not implemented and runs as 2.")
    .resume_free();
const ZERO_BUCKET: KeyDef = key(
    "reduce_bucket_size",
    POS_INT,
    Dflt::Derived("6553600 (25 MiB of f32, PyTorch DDP's bucket_cap_mb; DeepSpeed's 5e8 would make a ViT-B one bucket)"),
    "Elements per gradient bucket after the first (1 MiB) one: each bucket is all-reduced as soon as the backward has finished it, while the backward goes on.",
)
.resume_free();
const ZERO_REDUCE_SCATTER: KeyDef = key("reduce_scatter", Ty::Bool, Dflt::Bool(true),
    "Stage 2: reduce-scatter each bucket so a rank receives only its shard of the reduced gradient (false: all-reduce it, as stage 1 does). No effect at stages 0 and 1.")
    .resume_free();
const ZERO_OVERLAP: KeyDef = key("overlap_comm", Ty::Bool, Dflt::Bool(true),
    "Start each bucket's reduction during the last micro-batch's backward (false: all of them after it). vitscale's default is true, unlike DeepSpeed's false for stages 1/2: overlapping is what the buckets are for.")
    .resume_free();
// Typed, unlike other warn-only keys: a value is validated before the warning.
const ZERO_ALLGATHER_BUCKET: KeyDef = key(
    "allgather_bucket_size",
    POS_INT,
    Dflt::Unset,
    "Elements per all-gather of the updated weights; vitscale gathers each reduce bucket's shards (the buckets of reduce_bucket_size), so a value here is validated and warned about.",
)
.support(Support::Warn);
const ZERO_CONTIGUOUS: KeyDef = key("contiguous_gradients", Ty::Bool, Dflt::Bool(true), "Gradients always live in one flat contiguous buffer in vitscale.")
    .support(Support::NoEffect);
/// The `zero_optimization` keys vitscale reads.
pub(super) const ZERO_KEYS: &[KeyDef] = &[ZERO_STAGE, ZERO_BUCKET, ZERO_REDUCE_SCATTER, ZERO_OVERLAP, ZERO_ALLGATHER_BUCKET, ZERO_CONTIGUOUS];
/// `zero_optimization` tuning keys (DeepSpeed names, current and legacy): accepted, not
/// implemented; listed in the warnings when present.
pub(super) const ZERO_TUNING: &[&str] = &[
    "allgather_partitions", "load_from_fp32_weights", "elastic_checkpoint", "offload_param", "offload_optimizer",
    "sub_group_size", "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory", "prefetch_bucket_size",
    "stage3_prefetch_bucket_size", "param_persistence_threshold", "stage3_param_persistence_threshold",
    "model_persistence_threshold", "stage3_model_persistence_threshold", "max_live_parameters",
    "stage3_max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size", "mics_hierarchical_params_gather",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "use_all_reduce_for_fetch_params", "log_trace_cache_warnings", "module_granularity_threshold",
    "use_multi_rank_bucket_allreduce", "allgather_sequential", "stage3_use_all_reduce_for_fetch_params",
    "save_muon_momentum_buffer_in_memory", "cpu_offload_pin_memory",
];

/// `zero_optimization`, resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Zero {
    pub(super) stage: u8,
    pub(super) bucket: Option<usize>,
    pub(super) reduce_scatter: bool,
    pub(super) overlap_comm: bool,
}

/// `zero_optimization`: the stage, the bucket size if given, and the keys of the sharded
/// update; stage 3 resolves to stage 2 (warned).
pub(super) fn parse(v: Option<&Value>, cx: &mut Cx) -> Result<Zero> {
    let block = match v {
        None | Some(Value::Null) => return Ok(Zero { stage: 0, bucket: None, reduce_scatter: true, overlap_comm: true }),
        // Legacy form: `"zero_optimization": true` meant stage 1.
        Some(Value::Bool(b)) => {
            cx.warn("zero_optimization = true/false is DeepSpeed's deprecated form; use {\"stage\": N}".into());
            return Ok(Zero { stage: u8::from(*b), bucket: None, reduce_scatter: true, overlap_comm: true });
        }
        Some(Value::Object(m)) => m,
        Some(other) => return Err(key_err(ZERO_OPTIMIZATION.name, format!("expected an object, got {}", kind_of(other)))),
    };
    let p = ZERO_OPTIMIZATION.name;
    check_keys(p, block, ZERO_KEYS, ZERO_TUNING)?;
    let stage = get_int(Some(block), p, &ZERO_STAGE, cx)? as u8;
    let bucket = opt_int(Some(block), p, &ZERO_BUCKET, cx)?.map(|n| n as usize);
    let reduce_scatter = get_bool(Some(block), p, &ZERO_REDUCE_SCATTER, cx)?;
    let overlap_comm = get_bool(Some(block), p, &ZERO_OVERLAP, cx)?;
    get_bool(Some(block), p, &ZERO_CONTIGUOUS, cx)?;
    if let Some(n) = opt_int(Some(block), p, &ZERO_ALLGATHER_BUCKET, cx)? {
        cx.warn(format!("zero_optimization.allgather_bucket_size = {n}: the updated weights are all-gathered per reduce bucket (reduce_bucket_size); this value is not used"));
    }
    // the resolved stage is the one that runs
    let stage = if stage == 3 {
        cx.warn("zero_optimization.stage 3: partitioned parameters (ZeRO-3) are not implemented; running stage 2 (optimizer state and gradients partitioned, every rank keeps the whole weights)".into());
        2
    } else {
        stage
    };
    // In the file's order, so the warning reads like the config.
    let present: Vec<&str> = block
        .iter()
        .filter(|(k, v)| ZERO_TUNING.contains(&k.as_str()) && !v.is_null())
        .map(|(k, _)| k.as_str())
        .collect();
    for off in ["offload_optimizer", "offload_param"] {
        if let Some(dev) = block.get(off).and_then(|o| o.get("device")).and_then(Value::as_str) {
            if dev != "none" {
                cx.warn(format!("zero_optimization.{off}.device = \"{dev}\": ZeRO-Offload is not implemented; everything stays on the GPU"));
            }
        }
    }
    if block.get("cpu_offload").is_some_and(active) {
        cx.warn("zero_optimization.cpu_offload: ZeRO-Offload is not implemented; everything stays on the GPU".into());
    }
    if !present.is_empty() {
        cx.warn(format!(
            "zero_optimization: {} accepted but not implemented (gradients are reduced in buckets of reduce_bucket_size elements during the backward)",
            present.join(", ")
        ));
    }
    Ok(Zero { stage, bucket, reduce_scatter, overlap_comm })
}

/// The stage that runs and the bucket schedule; the bucket size only when given (absent
/// keeps the engine's default).
pub(super) fn write(cfg: &RunConfig) -> Value {
    let mut block = Map::new();
    put(&mut block, &ZERO_STAGE, json!(cfg.zero_stage));
    put(&mut block, &ZERO_REDUCE_SCATTER, json!(cfg.zero_reduce_scatter));
    put(&mut block, &ZERO_OVERLAP, json!(cfg.zero_overlap_comm));
    if let Some(n) = cfg.reduce_bucket_size {
        put(&mut block, &ZERO_BUCKET, json!(n));
    }
    Value::Object(block)
}
