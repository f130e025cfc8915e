//! DeepSpeed's `zero_optimization` block: the ZeRO stage (0-3), the gradient buckets' size and
//! schedule, and the `stage3_*` keys that have a meaning for vitscale's stage 3 (prefetch,
//! persistence, live parameters). DeepSpeed's other tuning and offload keys are accepted and
//! listed by name in one warning.

use serde_json::{json, Map, Value};

use super::key_def::*;
use super::types::{RunConfig, Stage3Config};
use super::value::*;

pub(super) const ZERO_OPTIMIZATION: KeyDef = key("zero_optimization", Ty::Section, Dflt::Unset, "DeepSpeed ZeRO block: stages 0-3 are honoured; see the keys below.");

// The stage, the buckets and their schedule leave the reduced gradient, and so the
// trajectory, as it was (tests/dist_zero.rs): a resume may change them.
pub(super) const ZERO_STAGE: KeyDef = key("stage", Ty::Int { lo: 0, hi: 3 }, Dflt::Int(0),
    "0 = plain data parallel, 1 = shard the optimizer state (all-reduced gradients), 2 = + reduce-scatter the gradients so each rank gets only its shard, 3 = + partition the weights: each block's gathered just before its forward and backward (on a GPU in bf16, the dtype the forward reads).")
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
// Stage 3's gathers change when the weights travel, never their values: a resume may change them.
const ZERO3_PREFETCH: KeyDef = key(
    "stage3_prefetch_bucket_size",
    NONNEG_INT,
    Dflt::Int(50_000_000),
    "Stage 3: the next block's weights are gathered while the current block computes when the block has at most this many elements (0: no prefetch; DeepSpeed's default). Alias: prefetch_bucket_size.",
)
.resume_free();
const ZERO3_PERSIST: KeyDef = key(
    "stage3_param_persistence_threshold",
    NONNEG_INT,
    Dflt::Int(100_000),
    "Stage 3: a transformer block of at most this many elements stays whole on every rank (gathered once per step, after the update); the embedding and the head always do. Alias: param_persistence_threshold.",
)
.resume_free();
const ZERO3_LIVE: KeyDef = key(
    "stage3_max_live_parameters",
    POS_INT,
    Dflt::Int(1_000_000_000),
    "Stage 3: gathered elements a rank holds at once; the prefetch needs two blocks' worth (below that one block is gathered at a time). Alias: max_live_parameters.",
)
.resume_free();
/// The `zero_optimization` keys vitscale reads.
pub(super) const ZERO_KEYS: &[KeyDef] = &[ZERO_STAGE, ZERO_BUCKET, ZERO_REDUCE_SCATTER, ZERO_OVERLAP, ZERO_ALLGATHER_BUCKET, ZERO_CONTIGUOUS, ZERO3_PREFETCH, ZERO3_PERSIST, ZERO3_LIVE];
/// DeepSpeed's unprefixed names of the stage-3 keys (its config accepts both).
const ZERO3_ALIASES: &[(&str, &KeyDef)] = &[("prefetch_bucket_size", &ZERO3_PREFETCH), ("param_persistence_threshold", &ZERO3_PERSIST), ("max_live_parameters", &ZERO3_LIVE)];
/// `zero_optimization` tuning keys (DeepSpeed names, current and legacy): accepted, not
/// implemented; listed in the warnings when present.
pub(super) const ZERO_TUNING: &[&str] = &[
    "allgather_partitions", "load_from_fp32_weights", "elastic_checkpoint", "offload_param", "offload_optimizer",
    "sub_group_size", "cpu_offload", "cpu_offload_params", "cpu_offload_use_pin_memory", "prefetch_bucket_size",
    "param_persistence_threshold", "model_persistence_threshold", "stage3_model_persistence_threshold",
    "max_live_parameters", "max_reuse_distance", "stage3_max_reuse_distance",
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
    pub(super) stage3: Stage3Config,
}

/// `zero_optimization`: the stage, the bucket size if given, and the keys of the sharded
/// update; stage 3 resolves to stage 2 (warned).
pub(super) fn parse(v: Option<&Value>, cx: &mut Cx) -> Result<Zero> {
    let block = match v {
        None | Some(Value::Null) => return Ok(Zero { stage: 0, bucket: None, reduce_scatter: true, overlap_comm: true, stage3: Stage3Config::default() }),
        // Legacy form: `"zero_optimization": true` meant stage 1.
        Some(Value::Bool(b)) => {
            cx.warn("zero_optimization = true/false is DeepSpeed's deprecated form; use {\"stage\": N}".into());
            return Ok(Zero { stage: u8::from(*b), bucket: None, reduce_scatter: true, overlap_comm: true, stage3: Stage3Config::default() });
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
    let stage3 = parse_stage3(block, stage, cx)?;
    if let (3, Some(n)) = (stage, bucket) {
        cx.warn(format!("zero_optimization.reduce_bucket_size = {n}: at stage 3 each parameter group (a transformer block, the embedding, the head) is its own bucket, the unit its weights are partitioned and gathered by; not used"));
    }
    // In the file's order, so the warning reads like the config (the honoured aliases aside).
    let present: Vec<&str> = block
        .iter()
        .filter(|(k, v)| ZERO_TUNING.contains(&k.as_str()) && !ZERO3_ALIASES.iter().any(|(a, _)| a == k) && !v.is_null())
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
    Ok(Zero { stage, bucket, reduce_scatter, overlap_comm, stage3 })
}

/// The `stage3_*` keys (or DeepSpeed's unprefixed aliases; "auto", as the Hugging Face
/// integration writes, keeps the default). Below stage 3 they have no effect: warned by name.
fn parse_stage3(block: &Map<String, Value>, stage: u8, cx: &mut Cx) -> Result<Stage3Config> {
    let p = ZERO_OPTIMIZATION.name;
    let mut vals = [0usize; 3];
    let mut given = Vec::new();
    for (i, def) in [&ZERO3_PREFETCH, &ZERO3_PERSIST, &ZERO3_LIVE].into_iter().enumerate() {
        let alias = ZERO3_ALIASES.iter().find(|(_, d)| d.name == def.name).map(|(a, _)| *a).unwrap_or(def.name);
        let name = match (block.get(def.name).filter(|v| !v.is_null()), block.get(alias).filter(|v| !v.is_null())) {
            (Some(_), Some(_)) => return Err(key_err(format!("{p}.{}", def.name), format!("given twice (also as {alias})"))),
            (Some(_), None) => def.name,
            (None, Some(_)) => alias,
            (None, None) => "",
        };
        let v = block.get(name);
        vals[i] = match v {
            None => get_int(None, p, def, cx)? as usize,
            Some(Value::String(a)) if a == "auto" => get_int(None, p, def, cx)? as usize,
            Some(v) => {
                given.push(name);
                let mut one = Map::new();
                one.insert(def.name.to_string(), v.clone());
                get_int(Some(&one), p, def, cx)? as usize
            }
        };
    }
    if stage < 3 && !given.is_empty() {
        cx.warn(format!("zero_optimization: {} only apply at stage 3 (this run is stage {stage}); not used", given.join(", ")));
    }
    Ok(Stage3Config { prefetch_bucket_size: vals[0], param_persistence_threshold: vals[1], max_live_parameters: vals[2] })
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
    let (z, d) = (cfg.zero3, Stage3Config::default());
    for (def, v, dv) in [(&ZERO3_PREFETCH, z.prefetch_bucket_size, d.prefetch_bucket_size), (&ZERO3_PERSIST, z.param_persistence_threshold, d.param_persistence_threshold), (&ZERO3_LIVE, z.max_live_parameters, d.max_live_parameters)] {
        if v != dv {
            put(&mut block, def, json!(v));
        }
    }
    Value::Object(block)
}
