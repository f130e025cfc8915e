//! DeepSpeed's top-level keys: the batch triple (and DeepSpeed's rules deriving one from the
//! other two), gradient clipping, the print interval and the gradient reduction's settings,
//! plus [`TOP_KEYS`], the table of everything allowed at the top level: these keys, every
//! section's own key (defined in the section's file), and the DeepSpeed keys that are accepted
//! without effect or with a warning.

use serde_json::{json, Map, Value};

use super::key_def::*;
use super::types::{BatchConfig, CommDtype, GradComm, Precision};
use super::value::*;
use super::{data, model, monitor, optimizer, precision, scheduler, train, zero};

pub(super) const TRAIN_BATCH_SIZE: KeyDef = key("train_batch_size", NONNEG_INT, Dflt::Derived("micro × GAS × world size"),
    "Images per optimizer step over all ranks. Any two of the batch triple derive the third (DeepSpeed rules).");
// The micro-batch and GAS only split the same global batch (a resume on another world size
// re-derives them: `keep_global_batch`).
pub(super) const MICRO_BATCH: KeyDef = key("train_micro_batch_size_per_gpu", NONNEG_INT, Dflt::Derived("64 when no batch key is given (vitscale extension), else derived"),
    "Images per forward/backward on one rank.")
    .resume_free();
pub(super) const GAS: KeyDef = key("gradient_accumulation_steps", NONNEG_INT, Dflt::Derived("1 when only one batch key is given, else derived"),
    "Micro-batches accumulated per optimizer step.")
    .resume_free();
pub(super) const SEQUENCE_PARALLEL_SIZE: KeyDef = key("sequence_parallel_size", POS_INT, Dflt::Int(1),
    "DeepSpeed-Ulysses sequence parallelism: each image's tokens are split over this many consecutive ranks, which trade tokens for attention heads by all-to-all around every attention. The data-parallel degree is the world size ÷ this, and the batch triple counts it (as DeepSpeed does). Must divide the world size and model.num_heads.")
    .resume_free();
pub(super) const GRADIENT_CLIPPING: KeyDef = key("gradient_clipping", NONNEG, Dflt::Num(0.0),
    "Clip the global gradient L2 norm to this value; 0 disables.");
pub(super) const STEPS_PER_PRINT: KeyDef = key("steps_per_print", POS_INT, Dflt::Int(10),
    "DeepSpeed's print interval: the default of train.log_every, which sets how often a progress line, a metrics.jsonl line and the monitors' records are written.");
const COMM_DTYPE: KeyDef = key("communication_data_type", Ty::Str, Dflt::Derived("bf16 when bf16 is enabled, else fp32 (DeepSpeed's rule; with fp16 training, fp32)"),
    "Data type of the gradient reduction (the all-reduce at ZeRO stage 0; on GPUs also ZeRO's reduce-scatter): fp32 or bf16 (case-insensitive); fp16 is accepted and reduced in fp32 with a warning.");
const PRESCALE: KeyDef = key("prescale_gradients", Ty::Bool, Dflt::Bool(false),
    "Divide each rank's gradient by the world size before the all-reduce instead of after it.");
const PREDIVIDE: KeyDef = key("gradient_predivide_factor", POSITIVE, Dflt::Num(1.0),
    "Without prescale_gradients: divide by this before the all-reduce and by world size / this after it.");

/// Every key allowed at the top level.
pub const TOP_KEYS: &[KeyDef] = &[
    TRAIN_BATCH_SIZE,
    MICRO_BATCH,
    GAS,
    SEQUENCE_PARALLEL_SIZE,
    optimizer::OPTIMIZER,
    scheduler::SCHEDULER,
    GRADIENT_CLIPPING,
    precision::FP16,
    precision::BF16,
    precision::BFLOAT16,
    zero::ZERO_OPTIMIZATION,
    STEPS_PER_PRINT,
    monitor::WALL_CLOCK,
    monitor::TENSORBOARD,
    monitor::CSV_MONITOR,
    model::MODEL,
    data::DATA,
    train::TRAIN,
    // Both describe how the run went (its memory, the plan derived from the batch), not the
    // run, so a resume may find them changed.
    ds_noop("memory", "Written by vitscale into a run directory's config.json: the memory each rank holds by kind against the prediction for its ZeRO stage. Ignored on input.").resume_free(),
    ds_noop("plan", "Written by vitscale into a run directory's config.json: the batch plan the run derived (passes per micro-batch, device). Ignored on input: the plan is derived again, so a run directory's config.json is a valid --config.").resume_free(),
    ds_noop("zero_allow_untested_optimizer", "Only concerns client optimizers; every vitscale optimizer supports ZeRO."),
    ds_noop("zero_force_ds_cpu_optimizer", "Only concerns ZeRO-Offload, which is not implemented (warned there)."),
    ds_noop("aio", "Async I/O settings, used only by NVMe offload (not implemented, warned there)."),
    ds_noop("seq_parallel_communication_data_type", "The all-to-alls of sequence parallelism move the activations in their own type (f32 on CPU ranks, bf16 on GPUs)."),
    ds_noop("timers", "Timer settings of DeepSpeed's own engine; vitscale's timers are always on."),
    COMM_DTYPE,
    PRESCALE,
    PREDIVIDE,
    ds_warn("sparse_gradients", Dflt::Bool(false), "Sparse gradient all-reduce; not implemented."),
    ds_warn("amp", Dflt::Unset, "NVIDIA Apex AMP; not implemented (use bf16 or fp16)."),
    ds_warn("flops_profiler", Dflt::Unset, "DeepSpeed's FLOPs profiler; not implemented (vitscale reports MFU in metrics.jsonl)."),
    ds_warn("wandb", Dflt::Unset, "Weights & Biases monitor; not implemented (metrics go to metrics.jsonl)."),
    ds_warn("comet", Dflt::Unset, "Comet monitor; not implemented."),
    ds_warn("comms_logger", Dflt::Unset, "Communication logger; not implemented (bytes and bus bandwidth are in metrics.jsonl)."),
    super::train::ACTIVATION_CHECKPOINTING,
    ds_warn("checkpoint", Dflt::Unset, "DeepSpeed checkpoint options; not implemented (vitscale writes its own checkpoints)."),
    ds_warn("data_types", Dflt::Unset, "grad_accum_dtype; not implemented (gradients accumulate in fp32)."),
    ds_warn("memory_breakdown", Dflt::Bool(false), "Memory breakdown logging; not implemented (peak memory is in metrics.jsonl)."),
    ds_warn("dump_state", Dflt::Bool(false), "Dump engine state; not implemented."),
    ds_warn("disable_allgather", Dflt::Bool(false), "Not implemented."),
    ds_warn("elasticity", Dflt::Unset, "Elastic training; not implemented."),
    ds_warn("autotuning", Dflt::Unset, "DeepSpeed autotuner; not implemented."),
    ds_warn("pipeline", Dflt::Unset, "Pipeline parallelism; not implemented."),
    ds_warn("sparse_attention", Dflt::Unset, "Sparse attention; not implemented."),
    ds_warn("curriculum_learning", Dflt::Unset, "Curriculum learning; not implemented."),
    ds_warn("data_efficiency", Dflt::Unset, "Data efficiency library; not implemented."),
    ds_warn("compression_training", Dflt::Unset, "Compression training; not implemented."),
    ds_warn("quantize_training", Dflt::Unset, "Quantized training; not implemented."),
    ds_warn("progressive_layer_drop", Dflt::Unset, "Progressive layer drop; not implemented."),
    ds_warn("eigenvalue", Dflt::Unset, "Eigenvalue computation; not implemented."),
    ds_warn("hybrid_engine", Dflt::Unset, "RLHF hybrid engine; not implemented."),
    ds_warn("compile", Dflt::Unset, "torch.compile settings; not applicable, not implemented."),
    ds_warn("tensor_parallel", Dflt::Unset, "Tensor parallelism; not implemented."),
    ds_warn("weight_quantization", Dflt::Unset, "Weight quantization; not implemented."),
    ds_warn("nebula", Dflt::Unset, "Nebula checkpointing; not implemented."),
    ds_warn("load_universal_checkpoint", Dflt::Bool(false), "Universal checkpoints; not implemented."),
    ds_warn("use_node_local_storage", Dflt::Bool(false), "Not implemented."),
    ds_warn("graph_harvesting", Dflt::Bool(false), "Not implemented."),
];

/// Top-level keys nobody knows: DeepSpeed ignores them, so a config it runs must run here
/// too; each is a warning naming the key (and the closest known key, for typos).
pub(super) fn warn_unknown_top_level(root: &Map<String, Value>, cx: &mut Cx) {
    for k in root.keys() {
        if TOP_KEYS.iter().any(|d| d.name == k) {
            continue;
        }
        let hint = suggest(k, TOP_KEYS.iter().map(|d| d.name));
        cx.warn(format!("{k}: unknown key at the top level{hint}, ignored (as DeepSpeed ignores it)"));
    }
}

// ---- batch --------------------------------------------------------------------------------

fn batch_key(root: &Map<String, Value>, def: &KeyDef, cx: &mut Cx) -> Result<Option<usize>> {
    Ok(opt_int(Some(root), "", def, cx)?.map(|i| i as usize))
}

/// The batch triple as given at the top level, resolved for `world_size` ranks: for their
/// data-parallel degree, the ranks ÷ `sequence_parallel_size`, which must divide them.
pub(super) fn resolve_batch_keys(root: &Map<String, Value>, world_size: usize, cx: &mut Cx) -> Result<BatchConfig> {
    let sp = get_int(Some(root), "", &SEQUENCE_PARALLEL_SIZE, cx)? as usize;
    if world_size > 0 && !world_size.is_multiple_of(sp) {
        return Err(key_err(
            SEQUENCE_PARALLEL_SIZE.name,
            format!("{sp} does not divide the world size {world_size}: the ranks form groups of sequence_parallel_size consecutive ranks (data-parallel degree = world size ÷ {sp})"),
        ));
    }
    let train = batch_key(root, &TRAIN_BATCH_SIZE, cx)?;
    let micro = batch_key(root, &MICRO_BATCH, cx)?;
    let gas = batch_key(root, &GAS, cx)?;
    let mut batch = resolve_batch(train, micro, gas, world_size / sp)?;
    batch.sequence_parallel_size = sp;
    Ok(batch)
}

/// Micro batch used when none of the three batch keys is given (vitscale extension).
pub const DEFAULT_MICRO_BATCH: usize = 64;

/// DeepSpeed's batch triple rules (`_set_batch_related_parameters` then `_batch_assertion`),
/// with one extension: none given → micro 64, GAS 1.
///
/// - all three given: checked as given;
/// - train + micro: GAS = train / micro / world (integer division, then checked);
/// - train + GAS: micro = train / world / GAS;
/// - micro + GAS: train = micro × GAS × world;
/// - only train: GAS = 1, micro = train / world; only micro: GAS = 1, train = micro × world;
/// - only GAS: DeepSpeed's error.
pub fn resolve_batch(train: Option<usize>, micro: Option<usize>, gas: Option<usize>, world_size: usize) -> Result<BatchConfig> {
    if world_size == 0 {
        return Err(key_err("world_size", "must be at least 1"));
    }
    let w = world_size;
    // Zero inputs would divide by zero below where DeepSpeed's assertions would fire first.
    let positive = |k: &str, v: Option<usize>, what: &str| match v {
        Some(0) => Err(key_err(k, format!("{what}: 0 has to be greater than 0"))),
        _ => Ok(()),
    };
    positive(MICRO_BATCH.name, micro, "Micro batch size per gpu")?;
    positive(GAS.name, gas, "Gradient accumulation steps")?;
    let (t, m, g) = match (train, micro, gas) {
        (Some(t), Some(m), Some(g)) => (t, m, g),
        (Some(t), Some(m), None) => (t, m, t / m / w),
        (Some(t), None, Some(g)) => (t, t / w / g, g),
        (None, Some(m), Some(g)) => (m * g * w, m, g),
        (Some(t), None, None) => (t, t / w, 1),
        (None, Some(m), None) => (m * w, m, 1),
        (None, None, None) => (DEFAULT_MICRO_BATCH * w, DEFAULT_MICRO_BATCH, 1),
        (None, None, Some(_)) => {
            return Err(key_err(
                TRAIN_BATCH_SIZE.name,
                "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",
            ))
        }
    };
    // DeepSpeed's own words first, then the triple as given and derived, so the user sees
    // which two values left no whole third one.
    let triple = |derived: &str| -> String {
        let shown = |name: &str, given: Option<usize>, v: usize| match given {
            Some(x) => format!("{name} {x}"),
            None => format!("{name} {v} (derived)"),
        };
        format!(
            " [{} = {} × {} × world size {w}{}]",
            shown(TRAIN_BATCH_SIZE.name, train, t),
            shown(MICRO_BATCH.name, micro, m),
            shown(GAS.name, gas, g),
            if derived.is_empty() { String::new() } else { format!("; {derived}") }
        )
    };
    let need_multiple = |of: &str, by: usize| {
        format!("train_batch_size {} must be a positive multiple of {of} = {by}", train.unwrap_or(t), )
    };
    if t == 0 {
        return Err(key_err(TRAIN_BATCH_SIZE.name, format!("Train batch size: {t} has to be greater than 0{}", triple(""))));
    }
    if m == 0 {
        let hint = need_multiple("gradient_accumulation_steps × world size", g * w);
        return Err(key_err(MICRO_BATCH.name, format!("Micro batch size per gpu: {m} has to be greater than 0{}", triple(&hint))));
    }
    if g == 0 {
        let hint = need_multiple("train_micro_batch_size_per_gpu × world size", m * w);
        return Err(key_err(GAS.name, format!("Gradient accumulation steps: {g} has to be greater than 0{}", triple(&hint))));
    }
    if t != m * g * w {
        let hint = match (micro, gas) {
            (Some(_), Some(_)) => String::new(),
            (Some(_), None) => need_multiple("train_micro_batch_size_per_gpu × world size", m * w),
            (None, Some(_)) => need_multiple("gradient_accumulation_steps × world size", g * w),
            (None, None) => need_multiple("the world size", w),
        };
        return Err(key_err(
            TRAIN_BATCH_SIZE.name,
            format!(
                "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size {t} != {m} * {g} * {w}{}",
                triple(&hint)
            ),
        ));
    }
    Ok(BatchConfig { train_batch_size: t, micro_batch_per_gpu: m, gradient_accumulation_steps: g, world_size: w, sequence_parallel_size: 1 })
}

/// What sequence parallelism needs of the model and the run: whole heads per rank (the
/// all-to-all gives each rank H ÷ SP of them), at least one token per rank, and one rank per
/// data-parallel slot for the features that split the batch by rank.
pub(super) fn check_sequence_parallel(batch: &BatchConfig, model: &crate::model::ModelConfig, train: &super::TrainConfig) -> Result<()> {
    let sp = batch.sequence_parallel_size;
    if sp == 1 {
        return Ok(());
    }
    let name = SEQUENCE_PARALLEL_SIZE.name;
    if !model.num_heads.is_multiple_of(sp) {
        return Err(key_err(name, format!("{sp} does not divide model.num_heads ({}): each rank of a sequence-parallel group attends with num_heads ÷ {sp} whole heads", model.num_heads)));
    }
    if model.num_tokens() < sp {
        return Err(key_err(name, format!("{sp} ranks for {} tokens per image: every rank of a group needs at least one token", model.num_tokens())));
    }
    if !train.balance.is_off() || !train.emulate_slowdown.is_empty() {
        let key = if train.balance.is_off() { "train.emulate_slowdown" } else { "train.balance" };
        return Err(key_err(name, format!("{sp} with {key}: measuring and splitting the batch by rank is not implemented for sequence-parallel groups (leave {key} out)")));
    }
    Ok(())
}

// ---- gradient reduction -------------------------------------------------------------------

/// `communication_data_type`, `prescale_gradients`, `gradient_predivide_factor`: how the
/// gradient all-reduce runs, with DeepSpeed's default dtype (that of the compute precision).
pub(super) fn parse_grad_comm(root: &Map<String, Value>, precision: &Precision, zero_stage: u8, cx: &mut Cx) -> Result<GradComm> {
    let given = opt_str(Some(root), "", &COMM_DTYPE, cx)?.map(str::to_ascii_lowercase);
    let dtype = match given.as_deref() {
        Some("fp32") => CommDtype::Fp32,
        Some("bf16") => CommDtype::Bf16,
        Some("fp16") => {
            cx.warn("communication_data_type = \"fp16\": fp16 reductions are not implemented; gradients are reduced in fp32".into());
            CommDtype::Fp32
        }
        Some(other) => return Err(key_err(COMM_DTYPE.name, format!("unknown value \"{other}\"; expected one of \"fp32\", \"bf16\", \"fp16\""))),
        None => match precision {
            Precision::Bf16 => CommDtype::Bf16,
            // DeepSpeed would reduce in fp16; fp32 is what vitscale has, and only more exact
            Precision::Fp16 { .. } | Precision::Fp32 => CommDtype::Fp32,
        },
    };
    let prescale = get_bool(Some(root), "", &PRESCALE, cx)?;
    let predivide = get_num(Some(root), "", &PREDIVIDE, cx)?;
    let grad_comm = GradComm { dtype, prescale, predivide };
    let asked = [COMM_DTYPE, PRESCALE, PREDIVIDE].iter().any(|k| root.contains_key(k.name));
    if zero_stage > 0 && asked && grad_comm != GradComm::default() {
        cx.warn(format!(
            "communication_data_type {} / prescale_gradients / gradient_predivide_factor: at ZeRO stage {} they shape the gradient reduce-scatter on GPUs (NCCL); CPU ranks reduce-scatter in fp32, unscaled",
            grad_comm.dtype.as_str(), zero_stage
        ));
    }
    Ok(grad_comm)
}

// ---- writing --------------------------------------------------------------------------------

/// The batch triple as resolved: all three keys, so the file states the split it ran.
pub(super) fn write_batch(batch: &BatchConfig, out: &mut Map<String, Value>) {
    put(out, &TRAIN_BATCH_SIZE, json!(batch.train_batch_size));
    put(out, &MICRO_BATCH, json!(batch.micro_batch_per_gpu));
    put(out, &GAS, json!(batch.gradient_accumulation_steps));
    put(out, &SEQUENCE_PARALLEL_SIZE, json!(batch.sequence_parallel_size));
}

pub(super) fn write_clipping(gradient_clipping: f64, out: &mut Map<String, Value>) {
    put(out, &GRADIENT_CLIPPING, json!(gradient_clipping));
}

/// The reduction's settings, with the dtype DeepSpeed's default chose written out.
pub(super) fn write_grad_comm(grad_comm: &GradComm, out: &mut Map<String, Value>) {
    put(out, &COMM_DTYPE, json!(grad_comm.dtype.as_str()));
    put(out, &PRESCALE, json!(grad_comm.prescale));
    put(out, &PREDIVIDE, json!(grad_comm.predivide));
}
