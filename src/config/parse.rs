//! From JSON to a validated [`RunConfig`]: reading the file, applying `--set key.path=JSON`
//! overrides, and resolving every key with DeepSpeed's meaning.
//!
//! **One definition per option.** Every key we read is a [`KeyDef`] (name, type and accepted
//! values, default, doc, support level) in one of the tables below ([`TOP_KEYS`],
//! [`ADAM_KEYS`], [`MODEL_KEYS`], [`DATA_KEYS`], …). The getters take the definition, so the
//! default applied, the error text ("expected …") and the help text ([`help_text`]) all come
//! from the same place. To add a key: add a `KeyDef` constant, put it in its section's table,
//! and read it with the getter of its type.
//!
//! Rules that are not DeepSpeed's own, all documented on their keys:
//! - no batch key at all → `train_micro_batch_size_per_gpu = 64`, `gradient_accumulation_steps = 1`;
//! - no `optimizer` block → AdamW, lr 1e-3, weight_decay 0.05 (training from scratch);
//! - `"auto"` (as Hugging Face writes it) counts as "not given", with a warning;
//! - DeepSpeed keys whose feature we do not implement are accepted and listed in
//!   `RunConfig::warnings` (never silently dropped);
//! - unknown keys follow DeepSpeed: at the top level (which DeepSpeed ignores) they are a
//!   warning naming the key and the closest known one, so a config DeepSpeed runs also runs
//!   here; inside a section (DeepSpeed's sections forbid extras; ours do too) they are errors;
//! - a key given twice in one JSON object is an error naming it (DeepSpeed refuses duplicate
//!   keys too), rather than the last one silently winning.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::types::*;
use crate::model::spec::{GlobalPool, ModelConfig, PRESET_NAMES};
use crate::model::Recompute;

// ---- errors -------------------------------------------------------------------------------

/// Why a configuration was rejected. Every message names the file, the `--set` argument or
/// the dotted key, and what would have been accepted.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path} is not valid JSON: {msg} (line {line}, column {column})")]
    Json { path: String, line: usize, column: usize, msg: String },
    #[error("--set {arg}: {msg}")]
    Set { arg: String, msg: String },
    #[error("{key}: {msg}")]
    Key { key: String, msg: String },
}

type Result<T> = std::result::Result<T, ConfigError>;

fn key_err(key: impl Into<String>, msg: impl Into<String>) -> ConfigError {
    ConfigError::Key { key: key.into(), msg: msg.into() }
}

// ---- key definitions ----------------------------------------------------------------------

/// The type of a key's value, and so the values it accepts.
#[derive(Clone, Copy, Debug)]
pub enum Ty {
    Bool,
    /// An integer in `[lo, hi]`.
    Int { lo: u64, hi: u64 },
    /// A number in the interval; `lo_open` / `hi_open` exclude the bound.
    Num { lo: f64, hi: f64, lo_open: bool, hi_open: bool },
    Str,
    /// One of these strings.
    Choice(&'static [&'static str]),
    /// A list of exactly `n` numbers.
    Nums(usize),
    /// A list of distinct strings, each one of these.
    StrList(&'static [&'static str]),
    /// A JSON object read by its own table.
    Section,
    /// Any JSON value (a DeepSpeed key we accept but do not interpret).
    Any,
}

impl Ty {
    /// "expected …" text for error messages.
    pub fn describe(&self) -> String {
        fn bound(x: f64) -> String {
            if x.is_infinite() { if x > 0.0 { "inf".into() } else { "-inf".into() } } else { format!("{x}") }
        }
        match self {
            Ty::Bool => "true or false".into(),
            Ty::Int { lo, hi } if *hi == u64::MAX => format!("an integer >= {lo}"),
            Ty::Int { lo, hi } => format!("an integer in [{lo}, {hi}]"),
            Ty::Num { lo, hi, lo_open, hi_open } => format!(
                "a number in {}{}, {}{}",
                if *lo_open { "(" } else { "[" },
                bound(*lo),
                bound(*hi),
                if *hi_open { ")" } else { "]" }
            ),
            Ty::Str => "a string".into(),
            Ty::Choice(c) => format!("one of {}", quoted(c)),
            Ty::Nums(n) => format!("a list of {n} numbers"),
            Ty::StrList(c) => format!("a list of distinct strings from {}", quoted(c)),
            Ty::Section => "an object".into(),
            Ty::Any => "any value".into(),
        }
    }
}

/// A key's default, typed, so the value applied is the value documented.
#[derive(Clone, Copy, Debug)]
pub enum Dflt {
    Bool(bool),
    Int(u64),
    Num(f64),
    Str(&'static str),
    Nums(&'static [f64]),
    StrList(&'static [&'static str]),
    /// Computed from other keys; the text says how.
    Derived(&'static str),
    /// Must be given.
    Required,
    /// Absent means off / not used.
    Unset,
}

impl Dflt {
    fn describe(&self) -> String {
        match self {
            Dflt::Bool(b) => b.to_string(),
            Dflt::Int(i) => i.to_string(),
            Dflt::Num(x) => format!("{x}"),
            Dflt::Str(s) => format!("\"{s}\""),
            Dflt::Nums(v) => format!("{v:?}"),
            Dflt::StrList(v) => format!("[{}]", quoted(v)),
            Dflt::Derived(d) => (*d).to_string(),
            Dflt::Required => "required".into(),
            Dflt::Unset => "unset".into(),
        }
    }
}

/// How far vitscale implements a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Support {
    /// Read and honoured.
    Yes,
    /// A DeepSpeed feature we do not implement: accepted, and a warning is recorded whenever
    /// the value asks for the feature (differs from the default / block not disabled).
    Warn,
    /// Accepted, and has no effect in vitscale for the reason in the doc (no warning).
    NoEffect,
}

/// One configuration key: the single place its name, type, default and doc live.
#[derive(Clone, Copy, Debug)]
pub struct KeyDef {
    pub name: &'static str,
    pub ty: Ty,
    pub default: Dflt,
    pub doc: &'static str,
    pub support: Support,
}

const fn key(name: &'static str, ty: Ty, default: Dflt, doc: &'static str) -> KeyDef {
    KeyDef { name, ty, default, doc, support: Support::Yes }
}
const fn ds_warn(name: &'static str, default: Dflt, doc: &'static str) -> KeyDef {
    KeyDef { name, ty: Ty::Any, default, doc, support: Support::Warn }
}
const fn ds_noop(name: &'static str, doc: &'static str) -> KeyDef {
    KeyDef { name, ty: Ty::Any, default: Dflt::Unset, doc, support: Support::NoEffect }
}

const POS_INT: Ty = Ty::Int { lo: 1, hi: u64::MAX };
const NONNEG_INT: Ty = Ty::Int { lo: 0, hi: u64::MAX };
const NONNEG: Ty = Ty::Num { lo: 0.0, hi: f64::INFINITY, lo_open: false, hi_open: true };
const POSITIVE: Ty = Ty::Num { lo: 0.0, hi: f64::INFINITY, lo_open: true, hi_open: true };
const UNIT_HALF_OPEN: Ty = Ty::Num { lo: 0.0, hi: 1.0, lo_open: false, hi_open: true };
const UNIT: Ty = Ty::Num { lo: 0.0, hi: 1.0, lo_open: false, hi_open: false };

// -- top level (DeepSpeed keys plus our three sections) --

const TRAIN_BATCH_SIZE: KeyDef = key("train_batch_size", NONNEG_INT, Dflt::Derived("micro × GAS × world size"),
    "Images per optimizer step over all ranks. Any two of the batch triple derive the third (DeepSpeed rules).");
const MICRO_BATCH: KeyDef = key("train_micro_batch_size_per_gpu", NONNEG_INT, Dflt::Derived("64 when no batch key is given (vitscale extension), else derived"),
    "Images per forward/backward on one rank.");
const GAS: KeyDef = key("gradient_accumulation_steps", NONNEG_INT, Dflt::Derived("1 when only one batch key is given, else derived"),
    "Micro-batches accumulated per optimizer step.");
const GRADIENT_CLIPPING: KeyDef = key("gradient_clipping", NONNEG, Dflt::Num(0.0),
    "Clip the global gradient L2 norm to this value; 0 disables.");
const STEPS_PER_PRINT: KeyDef = key("steps_per_print", POS_INT, Dflt::Int(10),
    "DeepSpeed's print interval: the default of train.log_every, which sets how often a progress line, a metrics.jsonl line and the monitors' records are written.");
const WALL_CLOCK: KeyDef = key("wall_clock_breakdown", Ty::Bool, Dflt::Bool(false),
    "Print the time of each phase (data wait, forward, backward, exposed and total gradient reduction, optimizer) per step on rank 0 at every logged step, as DeepSpeed prints its timers. The phases are measured and written to metrics.jsonl and the monitors either way.");
const TENSORBOARD: KeyDef = key("tensorboard", Ty::Section, Dflt::Unset,
    "DeepSpeed's TensorBoard monitor {enabled, output_path, job_name}: rank 0 writes an event file (events.out.tfevents.*) under <output_path>/<job_name>/ with Train/Samples/train_loss, lr, images_per_s and the step phases (elapsed_time_ms_*), against the global sample count, at every logged step.");
const CSV_MONITOR: KeyDef = key("csv_monitor", Ty::Section, Dflt::Unset,
    "DeepSpeed's CSV monitor {enabled, output_path, job_name}: the same records as the TensorBoard monitor, one file per tag (Train_Samples_train_loss.csv, …) with the header `step,<name>`, under <output_path>/<job_name>/.");

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
    key("optimizer", Ty::Section, Dflt::Derived("AdamW, lr 1e-3, weight_decay 0.05"), "DeepSpeed optimizer block: {\"type\": Adam|AdamW|SGD, \"params\": {...}}."),
    key("scheduler", Ty::Section, Dflt::Unset, "DeepSpeed LR scheduler block: WarmupLR, WarmupDecayLR or WarmupCosineLR; absent = constant LR."),
    GRADIENT_CLIPPING,
    key("fp16", Ty::Section, Dflt::Unset, "DeepSpeed fp16 block (dynamic loss scaling when loss_scale is 0)."),
    key("bf16", Ty::Section, Dflt::Unset, "DeepSpeed bf16 block: {\"enabled\": true} computes in bf16 on GPUs."),
    key("bfloat16", Ty::Section, Dflt::Unset, "Older DeepSpeed spelling of bf16."),
    key("zero_optimization", Ty::Section, Dflt::Unset, "DeepSpeed ZeRO block: stages 0-2 are honoured (3 runs as 2, warned); see the keys below."),
    STEPS_PER_PRINT,
    WALL_CLOCK,
    TENSORBOARD,
    CSV_MONITOR,
    key("model", Ty::Section, Dflt::Derived("preset chosen from the dataset"), "The ViT: a timm preset and/or fields."),
    key("data", Ty::Section, Dflt::Derived("built-in dataset"), "The dataset and its preprocessing."),
    key("train", Ty::Section, Dflt::Derived("10 epochs"), "Run length, seed, evaluation and logging."),
    ds_noop("memory", "Written by vitscale into a run directory's config.json: the memory each rank holds by kind against the prediction for its ZeRO stage. Ignored on input."),
    ds_noop("plan", "Written by vitscale into a run directory's config.json: the batch plan the run derived (passes per micro-batch, device). Ignored on input: the plan is derived again, so a run directory's config.json is a valid --config."),
    ds_noop("zero_allow_untested_optimizer", "Only concerns client optimizers; every vitscale optimizer supports ZeRO."),
    ds_noop("zero_force_ds_cpu_optimizer", "Only concerns ZeRO-Offload, which is not implemented (warned there)."),
    ds_noop("aio", "Async I/O settings, used only by NVMe offload (not implemented, warned there)."),
    ds_noop("seq_parallel_communication_data_type", "Sequence parallelism is not used by a ViT trainer."),
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
    ds_warn("activation_checkpointing", Dflt::Unset, "Activation checkpointing; not implemented."),
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

// -- monitoring --

const MON_ENABLED: KeyDef = key("enabled", Ty::Bool, Dflt::Bool(false), "Write this monitor's files (rank 0 only, as DeepSpeed).");
const MON_OUTPUT: KeyDef = key("output_path", Ty::Str, Dflt::Str(""),
    "Directory under which the monitor's `job_name` folder is made; \"\" = the run directory (DeepSpeed: the launch directory).");
const MON_JOB: KeyDef = key("job_name", Ty::Str, Dflt::Str("DeepSpeedJobName"), "Folder of this job under output_path (a name, not a path).");
/// Keys of the `tensorboard` and `csv_monitor` blocks.
pub const MONITOR_KEYS: &[KeyDef] = &[MON_ENABLED, MON_OUTPUT, MON_JOB];

fn parse_monitor_block(root: &Map<String, Value>, def: &KeyDef, cx: &mut Cx) -> Result<Option<MonitorTarget>> {
    let Some(sec) = section(root.get(def.name), def.name)? else { return Ok(None) };
    check_keys(def.name, sec, MONITOR_KEYS, &[])?;
    let output_path = get_str(Some(sec), def.name, &MON_OUTPUT, cx)?.to_string();
    let job_name = get_str(Some(sec), def.name, &MON_JOB, cx)?.to_string();
    if job_name.is_empty() || job_name.contains('/') || job_name == "." || job_name == ".." {
        return Err(key_err(full(def.name, MON_JOB.name), format!("\"{job_name}\" is not a folder name (no '/', not empty)")));
    }
    Ok(get_bool(Some(sec), def.name, &MON_ENABLED, cx)?.then_some(MonitorTarget { output_path, job_name }))
}

fn parse_monitor(root: &Map<String, Value>, cx: &mut Cx) -> Result<MonitorConfig> {
    Ok(MonitorConfig {
        tensorboard: parse_monitor_block(root, &TENSORBOARD, cx)?,
        csv_monitor: parse_monitor_block(root, &CSV_MONITOR, cx)?,
        wall_clock_breakdown: get_bool(Some(root), "", &WALL_CLOCK, cx)?,
    })
}

// -- optimizer --

/// `optimizer.type` values we implement (compared case-insensitively).
pub const OPTIMIZER_TYPES: &[&str] = &["Adam", "AdamW", "SGD"];

const OPT_TYPE: KeyDef = key("type", Ty::Choice(OPTIMIZER_TYPES), Dflt::Derived("vitscale's default optimizer (AdamW, lr 1e-3, weight_decay 0.05), with the block's params applied over it"),
    "Optimizer (case-insensitive, as DeepSpeed). A block without a type (`--set optimizer.params.lr=3e-4` on a config without an optimizer block) adjusts vitscale's default optimizer, with a warning.");
const OPT_BLOCK_KEYS: &[KeyDef] = &[
    OPT_TYPE,
    key("params", Ty::Section, Dflt::Unset, "Optimizer arguments (DeepSpeed / torch names)."),
    ds_noop("legacy_fusion", "Selects DeepSpeed's fp16 optimizer wrapper; the update is the same."),
];

const ADAM_LR: KeyDef = key("lr", NONNEG, Dflt::Num(1e-3), "Learning rate (the schedule's base).");
const ADAM_BETAS: KeyDef = key("betas", Ty::Nums(2), Dflt::Nums(&[0.9, 0.999]), "Adam (beta1, beta2), each in [0, 1).");
const ADAM_EPS: KeyDef = key("eps", POSITIVE, Dflt::Num(1e-8), "Added to the denominator.");
const ADAM_WD: KeyDef = key("weight_decay", NONNEG, Dflt::Derived("0 (FusedAdam); 0.01 for AdamW with torch_adam=true (torch's default)"), "Weight decay: decoupled (AdamW) or L2 (Adam with adam_w_mode=false).");
const ADAM_W_MODE: KeyDef = key("adam_w_mode", Ty::Bool, Dflt::Bool(true), "true = decoupled weight decay (AdamW). Type AdamW forces true, as DeepSpeed does.");
const ADAM_BIAS_CORR: KeyDef = key("bias_correction", Ty::Bool, Dflt::Bool(true), "Adam bias correction (FusedAdam).");
const ADAM_TORCH: KeyDef = key("torch_adam", Ty::Bool, Dflt::Bool(false), "Use torch.optim.Adam/AdamW in DeepSpeed: same update, torch's defaults.");
const ADAM_AMSGRAD: KeyDef = key("amsgrad", Ty::Bool, Dflt::Bool(false), "Not supported (FusedAdam rejects it too); must be false.");
/// Keys of `optimizer.params` for Adam / AdamW.
pub const ADAM_KEYS: &[KeyDef] = &[ADAM_LR, ADAM_BETAS, ADAM_EPS, ADAM_WD, ADAM_W_MODE, ADAM_BIAS_CORR, ADAM_TORCH, ADAM_AMSGRAD];

const SGD_LR: KeyDef = key("lr", NONNEG, Dflt::Num(1e-3), "Learning rate (torch.optim.SGD's default since torch 2.0).");
const SGD_MOMENTUM: KeyDef = key("momentum", NONNEG, Dflt::Num(0.0), "Momentum factor.");
const SGD_DAMPENING: KeyDef = key("dampening", NONNEG, Dflt::Num(0.0), "Dampening for momentum.");
const SGD_WD: KeyDef = key("weight_decay", NONNEG, Dflt::Num(0.0), "L2 penalty added to the gradient (torch semantics).");
const SGD_NESTEROV: KeyDef = key("nesterov", Ty::Bool, Dflt::Bool(false), "Nesterov momentum; needs momentum > 0 and dampening = 0.");
/// Keys of `optimizer.params` for SGD.
pub const SGD_KEYS: &[KeyDef] = &[SGD_LR, SGD_MOMENTUM, SGD_DAMPENING, SGD_WD, SGD_NESTEROV];

/// Weight decay used when the config has no `optimizer` block.
pub const DEFAULT_WEIGHT_DECAY: f64 = 0.05;

// -- scheduler --

/// `scheduler.type` values we implement (case-sensitive, as DeepSpeed).
pub const SCHEDULER_TYPES: &[&str] = &["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"];
const SCHED_BLOCK_KEYS: &[KeyDef] = &[
    key("type", Ty::Choice(SCHEDULER_TYPES), Dflt::Required, "LR schedule."),
    key("params", Ty::Section, Dflt::Unset, "Schedule arguments (DeepSpeed names)."),
];
const WARMUP_TYPES: &[&str] = &["log", "linear"];
const W_MIN_LR: KeyDef = key("warmup_min_lr", NONNEG, Dflt::Num(0.0), "LR at the start of warmup.");
const W_MAX_LR_WLR: KeyDef = key("warmup_max_lr", NONNEG, Dflt::Derived("the optimizer lr"), "LR at the end of warmup (replaces the optimizer lr).");
const W_MAX_LR_WDLR: KeyDef = key("warmup_max_lr", NONNEG, Dflt::Num(0.001), "LR at the end of warmup (replaces the optimizer lr).");
const W_NUM_STEPS: KeyDef = key("warmup_num_steps", POS_INT, Dflt::Int(1000), "Warmup length in optimizer steps (at least 2 are used, as DeepSpeed).");
const W_TYPE: KeyDef = key("warmup_type", Ty::Str, Dflt::Str("log"), "\"log\" or \"linear\"; anything else falls back to log with a warning (DeepSpeed behaviour).");
const TOTAL_STEPS: KeyDef = key("total_num_steps", POS_INT, Dflt::Required, "Schedule length in optimizer steps; \"auto\" = the run's length.");
const W_MIN_RATIO: KeyDef = key("warmup_min_ratio", UNIT, Dflt::Num(0.0), "Warmup start as a fraction of the optimizer lr.");
const COS_MIN_RATIO: KeyDef = key("cos_min_ratio", UNIT, Dflt::Num(0.0001), "Final LR as a fraction of the optimizer lr.");
const WARMUP_LR_KEYS: &[KeyDef] = &[W_MIN_LR, W_MAX_LR_WLR, W_NUM_STEPS, W_TYPE];
const WARMUP_DECAY_KEYS: &[KeyDef] = &[TOTAL_STEPS, W_MIN_LR, W_MAX_LR_WDLR, W_NUM_STEPS, W_TYPE];
const WARMUP_COSINE_KEYS: &[KeyDef] = &[TOTAL_STEPS, W_MIN_RATIO, W_NUM_STEPS, COS_MIN_RATIO, W_TYPE];

// -- precision --

const FP_ENABLED: KeyDef = key("enabled", Ty::Bool, Dflt::Bool(false), "Turn the mode on.");
const FP16_LOSS_SCALE: KeyDef = key("loss_scale", NONNEG, Dflt::Num(0.0), "Static loss scale; 0 = dynamic.");
const FP16_INIT_POWER: KeyDef = key("initial_scale_power", Ty::Int { lo: 0, hi: 63 }, Dflt::Int(16), "Dynamic scaling starts at 2^power.");
const FP16_WINDOW: KeyDef = key("loss_scale_window", POS_INT, Dflt::Int(1000), "Steps without overflow before the scale doubles.");
const FP16_HYSTERESIS: KeyDef = key("hysteresis", POS_INT, Dflt::Int(2), "Overflows tolerated before the scale halves.");
const FP16_MIN_SCALE: KeyDef = key("min_loss_scale", POSITIVE, Dflt::Num(1.0), "Lower bound of the dynamic scale.");
const FP16_KEYS: &[KeyDef] = &[
    FP_ENABLED, FP16_LOSS_SCALE, FP16_INIT_POWER, FP16_WINDOW, FP16_HYSTERESIS, FP16_MIN_SCALE,
    ds_warn("auto_cast", Dflt::Bool(false), "Cast module inputs to fp16; not implemented."),
    ds_warn("consecutive_hysteresis", Dflt::Bool(false), "Refill hysteresis on non-overflow steps; not implemented."),
    ds_warn("fp16_master_weights_and_grads", Dflt::Bool(false), "fp16 master weights; not implemented (masters are fp32)."),
];
const BF16_KEYS: &[KeyDef] = &[
    FP_ENABLED,
    ds_warn("immediate_grad_update", Dflt::Unset, "Not implemented (gradients are reduced at the accumulation boundary)."),
    ds_warn("check_grad_overflow", Dflt::Bool(false), "Overflow checks in bf16; not implemented."),
    ds_warn("bf16_master_weights_and_grads", Dflt::Bool(false), "bf16 master weights; not implemented (masters are fp32)."),
    ds_warn("bf16_optimizer_states", Dflt::Bool(false), "bf16 optimizer states; not implemented (states are fp32)."),
    ds_noop("auto_cast", "Inputs are always cast to the compute dtype."),
];

// -- zero --

const ZERO_STAGE: KeyDef = key("stage", Ty::Int { lo: 0, hi: 3 }, Dflt::Int(0),
    "0 = plain data parallel, 1 = shard the optimizer state (all-reduced gradients), 2 = + reduce-scatter the gradients so each rank gets only its shard; 3 (partitioned parameters) is not implemented and runs as 2.");
const ZERO_BUCKET: KeyDef = key(
    "reduce_bucket_size",
    POS_INT,
    Dflt::Derived("6553600 (25 MiB of f32, PyTorch DDP's bucket_cap_mb; DeepSpeed's 5e8 would make a ViT-B one bucket)"),
    "Elements per gradient bucket after the first (1 MiB) one: each bucket is all-reduced as soon as the backward has finished it, while the backward goes on.",
);
const ZERO_REDUCE_SCATTER: KeyDef = key("reduce_scatter", Ty::Bool, Dflt::Bool(true),
    "Stage 2: reduce-scatter each bucket so a rank receives only its shard of the reduced gradient (false: all-reduce it, as stage 1 does). No effect at stages 0 and 1.");
const ZERO_OVERLAP: KeyDef = key("overlap_comm", Ty::Bool, Dflt::Bool(true),
    "Start each bucket's reduction during the last micro-batch's backward (false: all of them after it). vitscale's default is true, unlike DeepSpeed's false for stages 1/2: overlapping is what the buckets are for.");
const ZERO_ALLGATHER_BUCKET: KeyDef = KeyDef {
    name: "allgather_bucket_size",
    ty: POS_INT,
    default: Dflt::Unset,
    doc: "Elements per all-gather of the updated weights; vitscale gathers each reduce bucket's shards (the buckets of reduce_bucket_size), so a value here is validated and warned about.",
    support: Support::Warn,
};
const ZERO_CONTIGUOUS: KeyDef = KeyDef {
    name: "contiguous_gradients",
    ty: Ty::Bool,
    default: Dflt::Bool(true),
    doc: "Gradients always live in one flat contiguous buffer in vitscale.",
    support: Support::NoEffect,
};
/// The `zero_optimization` keys vitscale reads.
const ZERO_KEYS: &[KeyDef] = &[ZERO_STAGE, ZERO_BUCKET, ZERO_REDUCE_SCATTER, ZERO_OVERLAP, ZERO_ALLGATHER_BUCKET, ZERO_CONTIGUOUS];
/// `zero_optimization` tuning keys (DeepSpeed names, current and legacy): accepted, not
/// implemented; listed in the warnings when present.
const ZERO_TUNING: &[&str] = &[
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

// -- model --

const M_PRESET: KeyDef = key("preset", Ty::Choice(PRESET_NAMES),
    Dflt::Derived("\"vit_builtin_default\" for builtin/synthetic data, \"vit_tiny_patch4_32\" for cifar10/cifar100, \"vit_tiny_patch16_224\" for folder"),
    "A timm ViT name; the fields below override it.");
const M_IMAGE: KeyDef = key("image_size", POS_INT, Dflt::Derived("from the preset"), "Input resolution (square).");
const M_PATCH: KeyDef = key("patch_size", POS_INT, Dflt::Derived("from the preset"), "Patch side; must divide image_size.");
const M_CHANS: KeyDef = key("in_chans", Ty::Int { lo: 3, hi: 3 }, Dflt::Int(3), "Input channels (datasets are RGB).");
const M_WIDTH: KeyDef = key("embed_dim", POS_INT, Dflt::Derived("from the preset"), "Token width C.");
const M_DEPTH: KeyDef = key("depth", POS_INT, Dflt::Derived("from the preset"), "Transformer blocks.");
const M_HEADS: KeyDef = key("num_heads", POS_INT, Dflt::Derived("from the preset"), "Attention heads; must divide embed_dim.");
const M_MLP: KeyDef = key("mlp_ratio", POSITIVE, Dflt::Derived("from the preset (4.0)"), "MLP hidden width / embed_dim.");
const M_CLASSES: KeyDef = key("num_classes", POS_INT, Dflt::Derived("the dataset's class count"), "Classifier outputs; must equal the dataset's class count.");
const M_QKV_BIAS: KeyDef = key("qkv_bias", Ty::Bool, Dflt::Derived("from the preset (true)"), "Bias on the qkv projection.");
const M_CLS: KeyDef = key("class_token", Ty::Bool, Dflt::Derived("from the preset (true)"), "Prepend a class token.");
const M_POOL: KeyDef = key("global_pool", Ty::Choice(&["token", "avg"]), Dflt::Derived("from the preset (\"token\")"), "Head input: the class token or the mean of patch tokens.");
/// Keys of the `model` section.
pub const MODEL_KEYS: &[KeyDef] = &[M_PRESET, M_IMAGE, M_PATCH, M_CHANS, M_WIDTH, M_DEPTH, M_HEADS, M_MLP, M_CLASSES, M_QKV_BIAS, M_CLS, M_POOL];

// -- data --

const D_DATASET: KeyDef = key("dataset", Ty::Choice(DatasetKind::NAMES), Dflt::Str("builtin"),
    "Which dataset: builtin (generated shapes), synthetic (random pixels), cifar10 / cifar100 (any of their distributed forms under data.path), folder (an image folder: path/<class>/*.jpg|png|webp, or path/train/<class>/… + path/val/<class>/…).");
const D_PATH: KeyDef = key("path", Ty::Str, Dflt::Derived("required for cifar10/cifar100/folder, not used otherwise"), "Dataset directory.");
const D_MEAN: KeyDef = key("mean", Ty::Nums(3), Dflt::Derived("builtin/synthetic 0.5; cifar10 (0.4914, 0.4822, 0.4465); cifar100 (0.5071, 0.4865, 0.4409); folder ImageNet (0.485, 0.456, 0.406)"), "Per-channel mean subtracted after scaling to [0, 1].");
const D_STD: KeyDef = key("std", Ty::Nums(3), Dflt::Derived("builtin/synthetic 0.5; cifar10 (0.2470, 0.2435, 0.2616); cifar100 (0.2673, 0.2564, 0.2762); folder ImageNet (0.229, 0.224, 0.225)"), "Per-channel std divided by; each > 0.");
const D_AUGMENT: KeyDef = key("augment", Ty::Choice(&["none", "default"]), Dflt::Str("default"),
    "Training augmentation: default = CIFAR pad-4 crop + flip, built-in flip, resampled sets RandomResizedCrop(scale, ratio) + flip; none = as stored / center crop. The options below add to it.");
const D_SHUFFLE: KeyDef = key("shuffle", Ty::Bool, Dflt::Bool(true), "Shuffle the training set every epoch.");
const D_WORKERS: KeyDef = key("num_workers", NONNEG_INT, Dflt::Int(0), "Loader threads (training and evaluation batches); 0 = all cores.");
const D_TRAIN_SIZE: KeyDef = key("train_size", POS_INT, Dflt::Int(6000), "Training images (builtin/synthetic only).");
const D_VAL_SIZE: KeyDef = key("val_size", POS_INT, Dflt::Int(2000), "Validation images (builtin/synthetic only).");
const D_LABEL: KeyDef = key("label", Ty::Choice(&["fine", "coarse"]), Dflt::Str("fine"),
    "CIFAR-100 label: the 100 fine classes or the 20 coarse superclasses (coarse only with cifar100; model.num_classes follows).");
const D_SKIP_BAD: KeyDef = key("skip_bad", Ty::Bool, Dflt::Bool(false),
    "Replace an image file that cannot be read or decoded by the next good one of its split and count it (summary.json `skipped`), instead of stopping with an error naming the file.");
const D_VAL_SPLIT: KeyDef = key("val_split", UNIT_HALF_OPEN, Dflt::Num(0.1),
    "Folder without train/ + val/ subfolders: fraction of each class held out (seeded) for validation.");
const D_CROP_PCT: KeyDef = key("crop_pct", Ty::Num { lo: 0.0, hi: 1.0, lo_open: true, hi_open: false }, Dflt::Num(0.875),
    "Evaluation of resampled sets: resize the shorter side to image_size / crop_pct, center-crop image_size (timm's crop_pct).");
const D_SCALE: KeyDef = key("scale", Ty::Nums(2), Dflt::Nums(&[0.08, 1.0]), "RandomResizedCrop area range [lo, hi], 0 < lo <= hi <= 1.");
const D_RATIO: KeyDef = key("ratio", Ty::Nums(2), Dflt::Nums(&[0.75, 1.3333333333333333]), "RandomResizedCrop aspect-ratio range [lo, hi], 0 < lo <= hi.");
const D_INTERPOLATION: KeyDef = key("interpolation", Ty::Choice(Interpolation::NAMES), Dflt::Str("bilinear"),
    "Resampling filter of RandomResizedCrop and the evaluation resize (resampled sets only), PIL's antialiased filters as torchvision applies them. timm's ViT recipes evaluate (and its ImageNet ones train) with bicubic: set \"bicubic\" to match them.");
const D_PREFETCH: KeyDef = key("prefetch", POS_INT, Dflt::Int(2), "Batches the loader builds ahead of the training step, and of the evaluation forward (bounded queue).");
const D_AUTO_AUGMENT: KeyDef = key("auto_augment", Ty::Str, Dflt::Str("none"),
    "RandAugment as a timm string, e.g. \"rand-m9-mstd0.5-inc1\": m magnitude (0-10), n ops per image (2), mstd magnitude noise, mmax clip (10), inc1 increasing ops, p op probability (0.5); \"none\" = off. Training batches only, after crop + flip.");
const D_MIXUP: KeyDef = key("mixup", NONNEG, Dflt::Num(0.0), "Mixup Beta(α, α) parameter (timm --mixup); 0 = off. Needs an even micro batch.");
const D_CUTMIX: KeyDef = key("cutmix", NONNEG, Dflt::Num(0.0), "CutMix Beta(α, α) parameter (timm --cutmix); 0 = off. Needs an even micro batch.");
const D_MIXUP_PROB: KeyDef = key("mixup_prob", UNIT, Dflt::Num(1.0), "Probability a global batch (a pair, an image: see mixup_mode) is mixed (timm --mixup-prob).");
const D_MIXUP_SWITCH: KeyDef = key("mixup_switch_prob", UNIT, Dflt::Num(0.5), "With mixup and cutmix both on: probability of cutmix, per mixing draw (timm --mixup-switch-prob).");
const D_MIXUP_MODE: KeyDef = key("mixup_mode", Ty::Choice(MixMode::NAMES), Dflt::Str("batch"),
    "What one mixing draw (mixed or not, mixup or cutmix, λ, box) covers, timm's --mixup-mode: batch = the whole global batch; pair = each pair of partners, mixed with each other; elem = each image, mixed with its partner's unmixed pixels. Partners are neighbours in the global batch order (0↔1, 2↔3, …), so the result does not depend on the rank split. train.label_smoothing is folded into the mixed targets.");
const D_REPROB: KeyDef = key("reprob", UNIT, Dflt::Num(0.0), "Random erasing probability per training image (timm --reprob); 0 = off.");
const D_REMODE: KeyDef = key("remode", Ty::Choice(&["pixel", "const", "rand"]), Dflt::Str("pixel"),
    "Random erasing fill: pixel = per-pixel normal noise, const = 0 (the mean), rand = one normal value per channel (timm --remode).");
const D_RECOUNT: KeyDef = key("recount", POS_INT, Dflt::Int(1), "Random erasing: up to this many boxes per image (timm --recount).");
/// Keys of the `data` section (extend here).
pub const DATA_KEYS: &[KeyDef] = &[
    D_DATASET, D_PATH, D_MEAN, D_STD, D_AUGMENT, D_SHUFFLE, D_WORKERS, D_TRAIN_SIZE, D_VAL_SIZE, D_LABEL, D_SKIP_BAD, D_VAL_SPLIT,
    D_CROP_PCT, D_SCALE, D_RATIO, D_INTERPOLATION, D_PREFETCH, D_AUTO_AUGMENT, D_MIXUP, D_CUTMIX, D_MIXUP_PROB, D_MIXUP_SWITCH, D_MIXUP_MODE,
    D_REPROB, D_REMODE, D_RECOUNT,
];

/// Parses a timm RandAugment string (`rand-m9-n2-mstd0.5-mmax10-inc1-p0.5`; sections in any
/// order after `rand`). `none` or `""` = off.
pub fn parse_rand_augment(spec: &str) -> std::result::Result<Option<RandAugmentConfig>, String> {
    if spec.is_empty() || spec == "none" {
        return Ok(None);
    }
    let mut parts = spec.split('-');
    if parts.next() != Some("rand") {
        return Err(format!("\"{spec}\" is not supported: expected a RandAugment string starting with \"rand\" (e.g. \"rand-m9-mstd0.5-inc1\") or \"none\""));
    }
    let mut c = RandAugmentConfig {
        spec: spec.to_string(),
        magnitude: 10.0,
        num_layers: 2,
        magnitude_std: 0.0,
        magnitude_max: 10.0,
        increasing: false,
        prob: 0.5,
    };
    for part in parts {
        let (name, val) = ["mstd", "mmax", "inc", "m", "n", "p"]
            .iter()
            .find(|n| part.starts_with(**n))
            .map_or((part, ""), |n| (*n, &part[n.len()..]));
        let num = || val.parse::<f64>().ok().filter(|x| x.is_finite());
        let bad = || format!("section \"{part}\" of \"{spec}\" is not a valid number for `{name}`");
        match name {
            "m" => c.magnitude = num().filter(|x| (0.0..=30.0).contains(x)).ok_or_else(bad)?,
            "n" => c.num_layers = val.parse::<usize>().ok().filter(|n| (1..=16).contains(n)).ok_or_else(bad)?,
            // timm: mstd > 100 (or inf) means a uniform magnitude in [0, m].
            "mstd" if val == "inf" => c.magnitude_std = f64::INFINITY,
            "mstd" => {
                let x = num().filter(|x| *x >= 0.0).ok_or_else(bad)?;
                c.magnitude_std = if x > 100.0 { f64::INFINITY } else { x };
            }
            "mmax" => c.magnitude_max = num().filter(|x| *x > 0.0).ok_or_else(bad)?,
            "inc" => c.increasing = val.parse::<u32>().map_err(|_| bad())? != 0,
            "p" => c.prob = num().filter(|x| (0.0..=1.0).contains(x)).ok_or_else(bad)?,
            _ => return Err(format!("unknown section \"{part}\" in \"{spec}\"; expected m<magnitude>, n<layers>, mstd<std>, mmax<max>, inc<0|1>, p<prob>")),
        }
    }
    Ok(Some(c))
}

// -- train --

const SKIP_KINDS: &[&str] = &["bias", "norm", "pos_embed", "cls_token"];
const T_EPOCHS: KeyDef = key("epochs", POS_INT, Dflt::Int(10), "Run length in epochs (ignored when steps is set).");
const T_STEPS: KeyDef = key("steps", POS_INT, Dflt::Unset, "Run length in optimizer steps; wins over epochs.");
const T_SEED: KeyDef = key("seed", NONNEG_INT, Dflt::Int(0), "Seed for initialization, shuffling and augmentation.");
const T_RECOMPUTE: KeyDef = key("recompute", Ty::Choice(Recompute::NAMES), Dflt::Str("auto"),
    "Activation memory: \"always\" regenerates every block's LayerNorm and GELU outputs in the backward instead of keeping them (saves 2·C + F values per token and block), \"never\" keeps them, \"auto\" regenerates only where the backend says it is nearly free (small batches on a GPU; never on the CPU).");
const T_EVAL_EVERY: KeyDef = key("eval_every", NONNEG_INT, Dflt::Int(0), "Evaluate every N optimizer steps; 0 = at the end of each epoch.");
const T_CKPT_EVERY: KeyDef = key("checkpoint_every", NONNEG_INT, Dflt::Int(0), "Checkpoint every N optimizer steps; 0 = never.");
const T_SMOOTHING: KeyDef = key("label_smoothing", UNIT_HALF_OPEN, Dflt::Num(0.0), "Label smoothing of the cross-entropy targets.");
const T_DECAY_SKIP: KeyDef = key("weight_decay_skip", Ty::StrList(SKIP_KINDS), Dflt::StrList(SKIP_KINDS), "Parameter kinds without weight decay; [] decays everything.");
const T_LOG_EVERY: KeyDef = key("log_every", POS_INT, Dflt::Derived("steps_per_print (10)"), "Log a metrics line every N optimizer steps.");
const T_PASS_IMAGES: KeyDef = key(
    "pass_images",
    POS_INT,
    Dflt::Derived("512"),
    "Most images one forward/backward pass takes: a larger micro-batch runs as several passes whose gradients add up (the same result with bounded activation memory).",
);
const T_EVAL_BATCH: KeyDef = key("eval_batch_size", POS_INT, Dflt::Derived("train_micro_batch_size_per_gpu"), "Evaluation batch size.");
const T_CKPT_ON_SIGNAL: KeyDef = key(
    "checkpoint_on_signal",
    Ty::Bool,
    Dflt::Derived("true when checkpoint_every > 0, else false"),
    "On SIGINT/SIGTERM, finish the current optimizer step on every rank, write a checkpoint of it (rank 0) and exit with 130/143; false = the signal ends the process at once.",
);
const T_COMM_TIMEOUT: KeyDef = key(
    "comm_timeout_s",
    POSITIVE,
    Dflt::Num(300.0),
    "Seconds the rendezvous and each collective wait for the other ranks before failing with an error naming the missing rank(s); the variables VITSCALE_RENDEZVOUS_TIMEOUT (rendezvous) and VITSCALE_COMM_TIMEOUT (collectives) override it.",
);
const T_SLOWDOWN: KeyDef = key(
    "emulate_slowdown",
    Ty::Section,
    Dflt::Unset,
    "Straggler emulation: {\"<rank>\": factor, …} with factor >= 1 makes that rank take factor × its measured compute time per micro-batch, as a slower device would (docs/balance.md says how).",
);
const BALANCE_CHOICES: &[&str] = &["off", "auto"];
const T_BALANCE: KeyDef = key(
    "balance",
    Ty::Choice(BALANCE_CHOICES),
    Dflt::Str("off"),
    "Split of the global batch over the ranks: \"off\" = equal micro-batches; [s0, s1, …] = one positive share per rank, micro-batches proportional to them; \"auto\" = proportional to each rank's measured speed, re-estimated every train.balance_every steps. The global batch, its loss and its gradient stay those of the equal split; every rank gets at least one image per micro-batch (two when mixing).",
);
const T_BALANCE_EVERY: KeyDef = key("balance_every", POS_INT, Dflt::Int(5), "Under train.balance = \"auto\": steps of measured compute time between re-estimates of the shares.");
/// Keys of the `train` section.
pub const TRAIN_KEYS: &[KeyDef] = &[
    T_EPOCHS, T_STEPS, T_SEED, T_RECOMPUTE, T_PASS_IMAGES, T_EVAL_EVERY, T_CKPT_EVERY, T_SMOOTHING, T_DECAY_SKIP, T_LOG_EVERY, T_EVAL_BATCH, T_CKPT_ON_SIGNAL, T_COMM_TIMEOUT,
    T_SLOWDOWN, T_BALANCE, T_BALANCE_EVERY,
];

/// Help text for every key, generated from the tables.
pub fn help_text() -> String {
    let mut out = String::new();
    let sections: &[(&str, &[KeyDef])] = &[
        ("", TOP_KEYS),
        ("optimizer", OPT_BLOCK_KEYS),
        ("optimizer.params (Adam, AdamW)", ADAM_KEYS),
        ("optimizer.params (SGD)", SGD_KEYS),
        ("scheduler", SCHED_BLOCK_KEYS),
        ("scheduler.params (WarmupLR)", WARMUP_LR_KEYS),
        ("scheduler.params (WarmupDecayLR)", WARMUP_DECAY_KEYS),
        ("scheduler.params (WarmupCosineLR)", WARMUP_COSINE_KEYS),
        ("fp16", FP16_KEYS),
        ("bf16", BF16_KEYS),
        ("zero_optimization", ZERO_KEYS),
        ("model", MODEL_KEYS),
        ("data", DATA_KEYS),
        ("train", TRAIN_KEYS),
        ("tensorboard, csv_monitor", MONITOR_KEYS),
    ];
    for (name, table) in sections {
        out.push_str(if name.is_empty() { "[top level]\n" } else { "" });
        if !name.is_empty() {
            out.push_str(&format!("[{name}]\n"));
        }
        for d in *table {
            let support = match d.support {
                Support::Yes => "",
                Support::Warn => " (accepted, not implemented: warns)",
                Support::NoEffect => " (accepted, no effect)",
            };
            out.push_str(&format!("  {:<32} {}{}\n", d.name, d.doc, support));
            if !matches!(d.ty, Ty::Section | Ty::Any) {
                out.push_str(&format!("  {:<32} {}; default {}\n", "", d.ty.describe(), d.default.describe()));
            }
        }
    }
    let tuning: Vec<&str> = ZERO_TUNING.iter().copied().filter(|k| !ZERO_KEYS.iter().any(|d| d.name == *k)).collect();
    out.push_str(&format!("[zero_optimization] also accepts (not implemented: warns): {}\n", tuning.join(", ")));
    out
}

// ---- reading the file and --set ----------------------------------------------------------

/// Parses JSON text into a `Value`, refusing an object that names a key twice (serde_json
/// alone keeps the last one): the error names the dotted key.
pub fn parse_json_strict(text: &str) -> std::result::Result<Value, serde_json::Error> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_str(text);
    let v = StrictValue { path: String::new() }.deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

/// A `Value` seed that remembers where it is, for the duplicate-key error.
struct StrictValue {
    path: String,
}

impl<'de> serde::de::DeserializeSeed<'de> for StrictValue {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for StrictValue {
    type Value = Value;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> std::result::Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> std::result::Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(StrictValue { path: format!("{}[{}]", self.path, out.len()) })? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> std::result::Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            let path = full(&self.path, &k);
            if out.contains_key(&k) {
                return Err(serde::de::Error::custom(format!("duplicate key `{path}` (each key may appear once per object)")));
            }
            let v = map.next_value_seed(StrictValue { path })?;
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }
}

/// Reads the config file (or starts from `{}`) and applies `--set key.path=JSON` overrides in
/// order. A value that is not valid JSON is taken as a plain string
/// (`--set data.dataset=cifar10`).
pub fn load_json(path: Option<&Path>, sets: &[String]) -> Result<Value> {
    let mut root = match path {
        None => Value::Object(Map::new()),
        Some(p) => {
            let shown = p.display().to_string();
            let text = std::fs::read_to_string(p).map_err(|source| ConfigError::Read { path: shown.clone(), source })?;
            let v: Value = parse_json_strict(&text).map_err(|e| ConfigError::Json {
                path: shown.clone(),
                line: e.line(),
                column: e.column(),
                // serde_json appends the position, which the error prints once itself.
                msg: e.to_string().trim_end_matches(&format!(" at line {} column {}", e.line(), e.column())).to_string(),
            })?;
            if !v.is_object() {
                return Err(ConfigError::Json { path: shown, line: 1, column: 1, msg: "the top level must be a JSON object".into() });
            }
            v
        }
    };
    for arg in sets {
        apply_set(&mut root, arg)?;
    }
    Ok(root)
}

/// Applies one `key.path=value` override to `root`.
pub fn apply_set(root: &mut Value, arg: &str) -> Result<()> {
    let set_err = |msg: String| ConfigError::Set { arg: arg.to_string(), msg };
    let (path, raw) = arg
        .split_once('=')
        .ok_or_else(|| set_err("expected key.path=value (e.g. --set optimizer.params.lr=3e-4)".into()))?;
    let parts: Vec<&str> = path.trim().split('.').collect();
    if parts.iter().any(|p| p.is_empty()) {
        return Err(set_err(format!("`{path}` is not a dotted key path (e.g. data.dataset)")));
    }
    // A duplicate key is an error, not a reason to read the value as a string.
    let value = match parse_json_strict(raw) {
        Ok(v) => v,
        Err(e) if e.to_string().contains("duplicate key") => return Err(set_err(e.to_string())),
        Err(_) => Value::String(raw.to_string()),
    };
    let mut node = root;
    for (i, part) in parts.iter().enumerate() {
        let here = parts[..i].join(".");
        let obj = match node {
            Value::Object(m) => m,
            other => {
                return Err(set_err(format!("`{here}` holds {}, not an object, so `{path}` cannot be set", kind_of(other))))
            }
        };
        if i + 1 == parts.len() {
            obj.insert(part.to_string(), value);
            return Ok(());
        }
        node = obj.entry(part.to_string()).or_insert_with(|| Value::Object(Map::new()));
    }
    Ok(())
}

// ---- resolving ----------------------------------------------------------------------------

/// Resolution context: collects warnings.
#[derive(Default)]
struct Cx {
    warnings: Vec<String>,
}

impl Cx {
    fn warn(&mut self, w: String) {
        self.warnings.push(w);
    }
}

fn full(path: &str, name: &str) -> String {
    if path.is_empty() { name.to_string() } else { format!("{path}.{name}") }
}

fn quoted(c: &[&str]) -> String {
    c.iter().map(|s| format!("\"{s}\"")).collect::<Vec<_>>().join(", ")
}

fn kind_of(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => format!("\"{s}\""),
        Value::Array(_) => "a list".into(),
        Value::Object(_) => "an object".into(),
    }
}

fn is_auto(v: &Value) -> bool {
    v.as_str() == Some("auto")
}

/// Edit distance with adjacent transpositions counting one (optimal string alignment), for
/// "did you mean" suggestions: `trian` is one edit from `train`.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for j in 0..=b.len() {
        d[0][j] = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1).min(d[i][j - 1] + 1).min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

/// The largest edit distance that still reads as a typo of a word of `len` characters: one
/// edit for short words (`foo` is not a typo of `aio`), about one in four for longer ones.
fn typo_budget(len: usize) -> usize {
    (len / 4).max(1)
}

/// ` (did you mean "k"?)` for the known name `word` most likely mistypes, else "".
pub fn suggest<'a>(word: &str, known: impl IntoIterator<Item = &'a str>) -> String {
    let lw = word.to_lowercase();
    let known: Vec<&str> = known.into_iter().collect();
    // A key that extends the word (`checkpoint` → `checkpoint_every`) is the likeliest meaning.
    if let Some(k) = known.iter().find(|k| lw.len() >= 4 && k.to_lowercase().starts_with(&lw)) {
        return format!(" (did you mean \"{k}\"?)");
    }
    let best = known
        .into_iter()
        .map(|k| (edit_distance(&lw, &k.to_lowercase()), k))
        .min_by_key(|(d, _)| *d);
    match best {
        Some((d, k)) if d <= typo_budget(word.chars().count().min(k.chars().count())) => format!(" (did you mean \"{k}\"?)"),
        _ => String::new(),
    }
}

/// Rejects keys of `obj` that are neither in `table` nor in `extra`.
fn check_keys(path: &str, obj: &Map<String, Value>, table: &[KeyDef], extra: &[&str]) -> Result<()> {
    for k in obj.keys() {
        if table.iter().any(|d| d.name == k) || extra.contains(&k.as_str()) {
            continue;
        }
        let names = table.iter().map(|d| d.name).chain(extra.iter().copied());
        let hint = suggest(k, names);
        let known: Vec<&str> = table.iter().map(|d| d.name).collect();
        let where_ = if path.is_empty() { "at the top level".to_string() } else { format!("in `{path}`") };
        let list = if known.len() <= 16 { format!("; known keys: {}", known.join(", ")) } else { String::new() };
        return Err(key_err(full(path, k), format!("unknown key {where_}{hint}{list}")));
    }
    Ok(())
}

/// Top-level keys nobody knows: DeepSpeed ignores them, so a config it runs must run here
/// too; each is a warning naming the key (and the closest known key, for typos).
fn warn_unknown_top_level(root: &Map<String, Value>, cx: &mut Cx) {
    for k in root.keys() {
        if TOP_KEYS.iter().any(|d| d.name == k) {
            continue;
        }
        let hint = suggest(k, TOP_KEYS.iter().map(|d| d.name));
        cx.warn(format!("{k}: unknown key at the top level{hint}, ignored (as DeepSpeed ignores it)"));
    }
}

/// An optional JSON object at `path` (absent or null = None).
fn section<'v>(v: Option<&'v Value>, path: &str) -> Result<Option<&'v Map<String, Value>>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => Ok(Some(m)),
        Some(other) => Err(key_err(path, format!("expected an object, got {}", kind_of(other)))),
    }
}

/// The value of `def` in `obj`, or None when absent, null or `"auto"` (warned).
fn given<'v>(obj: Option<&'v Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Option<&'v Value> {
    let v = obj?.get(def.name)?;
    if v.is_null() {
        return None;
    }
    if is_auto(v) && !def_accepts_auto(def) {
        cx.warn(format!("{}: \"auto\" taken as not given (default: {})", full(path, def.name), def.default.describe()));
        return None;
    }
    Some(v)
}

fn def_accepts_auto(def: &KeyDef) -> bool {
    matches!(def.ty, Ty::Choice(c) if c.contains(&"auto"))
}

fn bad(path: &str, def: &KeyDef, v: &Value) -> ConfigError {
    key_err(full(path, def.name), format!("expected {}, got {}", def.ty.describe(), kind_of(v)))
}

fn num_in(def: &KeyDef, x: f64) -> bool {
    match def.ty {
        Ty::Num { lo, hi, lo_open, hi_open } => {
            x.is_finite() && (if lo_open { x > lo } else { x >= lo }) && (if hi_open { x < hi } else { x <= hi })
        }
        _ => x.is_finite(),
    }
}

fn parse_bool(path: &str, def: &KeyDef, v: &Value) -> Result<bool> {
    v.as_bool().ok_or_else(|| bad(path, def, v))
}

fn parse_int(path: &str, def: &KeyDef, v: &Value) -> Result<u64> {
    // Accept 64.0 as 64 (JSON writers differ), reject 64.5.
    let i = v
        .as_u64()
        .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f < 1.8e19).map(|f| f as u64))
        .ok_or_else(|| bad(path, def, v))?;
    if let Ty::Int { lo, hi } = def.ty {
        if i < lo || i > hi {
            return Err(bad(path, def, v));
        }
    }
    Ok(i)
}

fn parse_num(path: &str, def: &KeyDef, v: &Value) -> Result<f64> {
    let x = v.as_f64().ok_or_else(|| bad(path, def, v))?;
    if !num_in(def, x) {
        return Err(bad(path, def, v));
    }
    Ok(x)
}

fn get_bool(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<bool> {
    match given(obj, path, def, cx) {
        Some(v) => parse_bool(path, def, v),
        None => match def.default {
            Dflt::Bool(b) => Ok(b),
            _ => Err(key_err(full(path, def.name), "is required")),
        },
    }
}

fn opt_bool(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<Option<bool>> {
    given(obj, path, def, cx).map(|v| parse_bool(path, def, v)).transpose()
}

fn opt_int(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<Option<u64>> {
    given(obj, path, def, cx).map(|v| parse_int(path, def, v)).transpose()
}

fn get_int(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<u64> {
    match opt_int(obj, path, def, cx)? {
        Some(i) => Ok(i),
        None => match def.default {
            Dflt::Int(i) => Ok(i),
            _ => Err(key_err(full(path, def.name), format!("is required ({})", def.ty.describe()))),
        },
    }
}

fn opt_num(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<Option<f64>> {
    given(obj, path, def, cx).map(|v| parse_num(path, def, v)).transpose()
}

fn get_num(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<f64> {
    match opt_num(obj, path, def, cx)? {
        Some(x) => Ok(x),
        None => match def.default {
            Dflt::Num(x) => Ok(x),
            Dflt::Int(i) => Ok(i as f64),
            _ => Err(key_err(full(path, def.name), format!("is required ({})", def.ty.describe()))),
        },
    }
}

fn opt_str<'v>(obj: Option<&'v Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<Option<&'v str>> {
    let Some(v) = given(obj, path, def, cx) else { return Ok(None) };
    let s = v.as_str().ok_or_else(|| bad(path, def, v))?;
    if let Ty::Choice(c) = def.ty {
        if !c.contains(&s) {
            let hint = suggest(s, c.iter().copied());
            return Err(key_err(full(path, def.name), format!("unknown value \"{s}\"{hint}; expected {}", def.ty.describe())));
        }
    }
    Ok(Some(s))
}

fn get_str<'v>(obj: Option<&'v Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<&'v str> {
    match opt_str(obj, path, def, cx)? {
        Some(s) => Ok(s),
        None => match def.default {
            Dflt::Str(s) => Ok(s),
            _ => Err(key_err(full(path, def.name), format!("is required ({})", def.ty.describe()))),
        },
    }
}

fn opt_nums(obj: Option<&Map<String, Value>>, path: &str, def: &KeyDef, cx: &mut Cx) -> Result<Option<Vec<f64>>> {
    let Some(v) = given(obj, path, def, cx) else { return Ok(None) };
    let n = match def.ty {
        Ty::Nums(n) => n,
        _ => 0,
    };
    let arr = v.as_array().filter(|a| a.len() == n).ok_or_else(|| bad(path, def, v))?;
    let xs: Option<Vec<f64>> = arr.iter().map(|x| x.as_f64().filter(|f| f.is_finite())).collect();
    xs.map(Some).ok_or_else(|| bad(path, def, v))
}

/// Whether a value asks for a feature: null/false/0/""/{}/[] and `{"enabled": false}` do not.
fn active(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty() && s != "none",
        Value::Array(a) => !a.is_empty(),
        Value::Object(m) => match m.get("enabled") {
            Some(e) => e.as_bool().unwrap_or(false) || e.as_str() == Some("true"),
            None => m.values().any(active),
        },
    }
}

/// Whether `v` differs from the documented default of a warn-only key.
fn asks_for_feature(def: &KeyDef, v: &Value) -> bool {
    match def.default {
        Dflt::Bool(b) => !v.is_null() && v.as_bool() != Some(b),
        Dflt::Num(x) => v.as_f64() != Some(x),
        Dflt::Int(i) => v.as_u64() != Some(i),
        _ => active(v),
    }
}

fn note_unimplemented(path: &str, obj: &Map<String, Value>, table: &[KeyDef], cx: &mut Cx) {
    for def in table.iter().filter(|d| d.support == Support::Warn) {
        if let Some(v) = obj.get(def.name) {
            if asks_for_feature(def, v) {
                let shown = serde_json::to_string(v).unwrap_or_default();
                let shown = if shown.len() > 60 { format!("{}…", &shown[..shown.char_indices().nth(57).map(|(i, _)| i).unwrap_or(57)]) } else { shown };
                cx.warn(format!("{} = {shown}: accepted but not implemented, no effect. {}", full(path, def.name), def.doc));
            }
        }
    }
}

/// Parses a whole configuration (as returned by [`load_json`]) for `world_size` data-parallel
/// ranks into a validated [`RunConfig`].
pub fn resolve(value: &Value, world_size: usize) -> Result<RunConfig> {
    let root = value
        .as_object()
        .ok_or_else(|| key_err("(top level)", format!("expected a JSON object, got {}", kind_of(value))))?;
    let mut cx = Cx::default();
    warn_unknown_top_level(root, &mut cx);
    note_unimplemented("", root, TOP_KEYS, &mut cx);

    let batch = resolve_batch_keys(root, world_size, &mut cx)?;
    let gradient_clipping = get_num(Some(root), "", &GRADIENT_CLIPPING, &mut cx)?;
    let precision = parse_precision(root, &mut cx)?;
    let zero = parse_zero(root.get("zero_optimization"), &mut cx)?;
    let grad_comm = parse_grad_comm(root, &precision, &mut cx)?;
    let asked = [COMM_DTYPE, PRESCALE, PREDIVIDE].iter().any(|k| root.contains_key(k.name));
    if zero.stage > 0 && asked && grad_comm != GradComm::default() {
        cx.warn(format!(
            "communication_data_type {} / prescale_gradients / gradient_predivide_factor: at ZeRO stage {} they shape the gradient reduce-scatter on GPUs (NCCL); CPU ranks reduce-scatter in fp32, unscaled",
            grad_comm.dtype.as_str(), zero.stage
        ));
    }
    let data = parse_data(section(root.get("data"), "data")?, &mut cx)?;
    let model = parse_model(section(root.get("model"), "model")?, &data, &mut cx)?;
    let steps_per_print = get_int(Some(root), "", &STEPS_PER_PRINT, &mut cx)?;
    let train = parse_train(section(root.get("train"), "train")?, &batch, steps_per_print, &mut cx)?;
    let optimizer = parse_optimizer(section(root.get("optimizer"), "optimizer")?, &mut cx)?;
    if data.aug.mixes() && batch.micro_batch_per_gpu % 2 != 0 {
        let key = if data.aug.mixup > 0.0 { "data.mixup" } else { "data.cutmix" };
        return Err(key_err(
            key,
            format!("mixing pairs neighbouring images, so train_micro_batch_size_per_gpu must be even (got {})", batch.micro_batch_per_gpu),
        ));
    }
    let scheduler = parse_scheduler(section(root.get("scheduler"), "scheduler")?, &optimizer, &mut cx)?;
    let monitor = parse_monitor(root, &mut cx)?;

    Ok(RunConfig {
        batch,
        optimizer,
        scheduler,
        gradient_clipping,
        precision,
        zero_stage: zero.stage,
        reduce_bucket_size: zero.bucket,
        zero_reduce_scatter: zero.reduce_scatter,
        zero_overlap_comm: zero.overlap_comm,
        grad_comm,
        model,
        data,
        train,
        monitor,
        warnings: cx.warnings,
    })
}

// -- batch --

fn batch_key(root: &Map<String, Value>, def: &KeyDef, cx: &mut Cx) -> Result<Option<usize>> {
    Ok(opt_int(Some(root), "", def, cx)?.map(|i| i as usize))
}

fn resolve_batch_keys(root: &Map<String, Value>, world_size: usize, cx: &mut Cx) -> Result<BatchConfig> {
    let train = batch_key(root, &TRAIN_BATCH_SIZE, cx)?;
    let micro = batch_key(root, &MICRO_BATCH, cx)?;
    let gas = batch_key(root, &GAS, cx)?;
    resolve_batch(train, micro, gas, world_size)
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
    positive("train_micro_batch_size_per_gpu", micro, "Micro batch size per gpu")?;
    positive("gradient_accumulation_steps", gas, "Gradient accumulation steps")?;
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
                "train_batch_size",
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
            shown("train_batch_size", train, t),
            shown("train_micro_batch_size_per_gpu", micro, m),
            shown("gradient_accumulation_steps", gas, g),
            if derived.is_empty() { String::new() } else { format!("; {derived}") }
        )
    };
    let need_multiple = |of: &str, by: usize| {
        format!("train_batch_size {} must be a positive multiple of {of} = {by}", train.unwrap_or(t), )
    };
    if t == 0 {
        return Err(key_err("train_batch_size", format!("Train batch size: {t} has to be greater than 0{}", triple(""))));
    }
    if m == 0 {
        let hint = need_multiple("gradient_accumulation_steps × world size", g * w);
        return Err(key_err("train_micro_batch_size_per_gpu", format!("Micro batch size per gpu: {m} has to be greater than 0{}", triple(&hint))));
    }
    if g == 0 {
        let hint = need_multiple("train_micro_batch_size_per_gpu × world size", m * w);
        return Err(key_err("gradient_accumulation_steps", format!("Gradient accumulation steps: {g} has to be greater than 0{}", triple(&hint))));
    }
    if t != m * g * w {
        let hint = match (micro, gas) {
            (Some(_), Some(_)) => String::new(),
            (Some(_), None) => need_multiple("train_micro_batch_size_per_gpu × world size", m * w),
            (None, Some(_)) => need_multiple("gradient_accumulation_steps × world size", g * w),
            (None, None) => need_multiple("the world size", w),
        };
        return Err(key_err(
            "train_batch_size",
            format!(
                "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size {t} != {m} * {g} * {w}{}",
                triple(&hint)
            ),
        ));
    }
    Ok(BatchConfig { train_batch_size: t, micro_batch_per_gpu: m, gradient_accumulation_steps: g, world_size: w })
}

// -- optimizer --

fn parse_optimizer(block: Option<&Map<String, Value>>, cx: &mut Cx) -> Result<OptimizerConfig> {
    let Some(block) = block else {
        return Ok(OptimizerConfig::Adam {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: DEFAULT_WEIGHT_DECAY,
            adam_w_mode: true,
            bias_correction: true,
        });
    };
    check_keys("optimizer", block, OPT_BLOCK_KEYS, &[])?;
    // No type: the block adjusts the default optimizer (what a config without an optimizer
    // block trains with), so `--set optimizer.params.lr=…` works on any config.
    let untyped = block.get("type").is_none_or(Value::is_null);
    if untyped {
        cx.warn(format!(
            "optimizer.type not given: adjusting vitscale's default optimizer (AdamW, lr 1e-3, weight_decay {DEFAULT_WEIGHT_DECAY}) with optimizer.params"
        ));
    }
    let ty_v = block.get("type").filter(|v| !v.is_null()).cloned().unwrap_or_else(|| Value::String("AdamW".into()));
    let ty = ty_v.as_str().ok_or_else(|| bad("optimizer", &OPT_TYPE, &ty_v))?;
    let params = section(block.get("params"), "optimizer.params")?;
    let path = "optimizer.params";
    if params.is_some_and(|p| p.contains_key("max_grad_norm")) {
        // DeepSpeed raises here too rather than silently clipping twice.
        return Err(key_err(
            "optimizer.params.max_grad_norm",
            "is not supported as an optimizer parameter; use the top-level `gradient_clipping`",
        ));
    }
    match ty.to_ascii_lowercase().as_str() {
        "adam" | "adamw" => {
            check_keys(path, params.unwrap_or(&Map::new()), ADAM_KEYS, &[])?;
            let is_adamw = ty.eq_ignore_ascii_case("adamw");
            let lr = get_num(params, path, &ADAM_LR, cx)?;
            let betas = opt_nums(params, path, &ADAM_BETAS, cx)?.unwrap_or_else(|| vec![0.9, 0.999]);
            if betas.iter().any(|b| !(0.0..1.0).contains(b)) {
                return Err(key_err(full(path, "betas"), format!("each beta must be in [0, 1), got {betas:?}")));
            }
            let eps = get_num(params, path, &ADAM_EPS, cx)?;
            let adam_w_mode_given = get_bool(params, path, &ADAM_W_MODE, cx)?;
            let adam_w_mode = is_adamw || adam_w_mode_given;
            if is_adamw && !adam_w_mode_given {
                cx.warn("optimizer.params.adam_w_mode = false has no effect with type AdamW (DeepSpeed forces decoupled weight decay)".into());
            }
            let torch_adam = get_bool(params, path, &ADAM_TORCH, cx)?;
            if get_bool(params, path, &ADAM_AMSGRAD, cx)? {
                return Err(key_err(full(path, "amsgrad"), "amsgrad is not supported; expected false"));
            }
            let bias_correction = get_bool(params, path, &ADAM_BIAS_CORR, cx)?;
            if torch_adam && !bias_correction {
                return Err(key_err(full(path, "bias_correction"), "torch.optim.Adam/AdamW (torch_adam=true) always bias-correct; expected true"));
            }
            // torch.optim.AdamW's own default weight decay is 0.01; FusedAdam's is 0.
            let wd_default = if untyped { DEFAULT_WEIGHT_DECAY } else if torch_adam && adam_w_mode { 0.01 } else { 0.0 };
            let weight_decay = opt_num(params, path, &ADAM_WD, cx)?.unwrap_or(wd_default);
            Ok(OptimizerConfig::Adam { lr, beta1: betas[0], beta2: betas[1], eps, weight_decay, adam_w_mode, bias_correction })
        }
        "sgd" => {
            check_keys(path, params.unwrap_or(&Map::new()), SGD_KEYS, &[])?;
            let lr = get_num(params, path, &SGD_LR, cx)?;
            let momentum = get_num(params, path, &SGD_MOMENTUM, cx)?;
            let dampening = get_num(params, path, &SGD_DAMPENING, cx)?;
            let weight_decay = get_num(params, path, &SGD_WD, cx)?;
            let nesterov = get_bool(params, path, &SGD_NESTEROV, cx)?;
            if nesterov && (momentum <= 0.0 || dampening != 0.0) {
                return Err(key_err(
                    full(path, "nesterov"),
                    format!("Nesterov momentum requires a momentum > 0 and zero dampening (got momentum {momentum}, dampening {dampening})"),
                ));
            }
            Ok(OptimizerConfig::Sgd { lr, momentum, dampening, weight_decay, nesterov })
        }
        _ => {
            let known_ds = ["OneBitAdam", "OneBitLamb", "ZeroOneAdam", "Lamb", "Adagrad", "Lion", "Muon", "MuAdam", "MuAdamW", "MuSGD"];
            let why = if known_ds.iter().any(|k| k.eq_ignore_ascii_case(ty)) {
                "is a DeepSpeed optimizer vitscale does not implement".to_string()
            } else {
                format!("is not a known optimizer{}", suggest(ty, OPTIMIZER_TYPES.iter().copied()))
            };
            Err(key_err("optimizer.type", format!("\"{ty}\" {why}; supported: {}", quoted(OPTIMIZER_TYPES))))
        }
    }
}

// -- scheduler --

fn warmup_type(params: Option<&Map<String, Value>>, path: &str, cx: &mut Cx) -> Result<WarmupType> {
    let s = get_str(params, path, &W_TYPE, cx)?;
    Ok(match s {
        "linear" => WarmupType::Linear,
        "log" => WarmupType::Log,
        other => {
            // DeepSpeed logs a warning and falls back to log; we keep its behaviour.
            cx.warn(format!("{path}.warmup_type = \"{other}\" is unknown (expected {}); using \"log\" as DeepSpeed does", quoted(WARMUP_TYPES)));
            WarmupType::Log
        }
    })
}

/// `total_num_steps`, with `"auto"` kept as the run's length: that needs the training set's
/// size, which the training loop knows once it has opened the dataset.
fn total_steps(params: Option<&Map<String, Value>>, path: &str, cx: &mut Cx) -> Result<TotalSteps> {
    let raw = params.and_then(|p| p.get("total_num_steps"));
    if raw.is_some_and(is_auto) {
        cx.warn(format!("{path}.total_num_steps = \"auto\": using the run's length"));
        return Ok(TotalSteps::RunLength);
    }
    Ok(TotalSteps::Fixed(get_int(params, path, &TOTAL_STEPS, cx)?))
}

/// Warns about a fixed schedule that ends before its warmup does (the run's length is not
/// known here, so `"auto"` is not checked).
fn warn_short_schedule(path: &str, total: TotalSteps, warmup_num_steps: u64, cx: &mut Cx) {
    if let TotalSteps::Fixed(total) = total {
        if total < warmup_num_steps.max(2) {
            cx.warn(format!("{path}.total_num_steps {total} is less than warmup_num_steps {warmup_num_steps}"));
        }
    }
}

fn parse_scheduler(block: Option<&Map<String, Value>>, opt: &OptimizerConfig, cx: &mut Cx) -> Result<Option<SchedulerConfig>> {
    let Some(block) = block else { return Ok(None) };
    check_keys("scheduler", block, SCHED_BLOCK_KEYS, &[])?;
    let ty_v = block.get("type").ok_or_else(|| key_err("scheduler.type", format!("is required; expected one of {}", quoted(SCHEDULER_TYPES))))?;
    let ty = ty_v.as_str().ok_or_else(|| key_err("scheduler.type", format!("expected one of {}, got {}", quoted(SCHEDULER_TYPES), kind_of(ty_v))))?;
    let params = section(block.get("params"), "scheduler.params")?;
    let path = "scheduler.params";
    let empty = Map::new();
    let sched = match ty {
        "WarmupLR" => {
            check_keys(path, params.unwrap_or(&empty), WARMUP_LR_KEYS, &[])?;
            SchedulerConfig::WarmupLR {
                warmup_min_lr: get_num(params, path, &W_MIN_LR, cx)?,
                // Current DeepSpeed: WarmupLR's max defaults to the optimizer's lr.
                warmup_max_lr: opt_num(params, path, &W_MAX_LR_WLR, cx)?.unwrap_or(opt.lr()),
                warmup_num_steps: get_int(params, path, &W_NUM_STEPS, cx)?,
                warmup_type: warmup_type(params, path, cx)?,
            }
        }
        "WarmupDecayLR" => {
            check_keys(path, params.unwrap_or(&empty), WARMUP_DECAY_KEYS, &[])?;
            let total_num_steps = total_steps(params, path, cx)?;
            let warmup_num_steps = get_int(params, path, &W_NUM_STEPS, cx)?;
            warn_short_schedule(path, total_num_steps, warmup_num_steps, cx);
            SchedulerConfig::WarmupDecayLR {
                warmup_min_lr: get_num(params, path, &W_MIN_LR, cx)?,
                warmup_max_lr: get_num(params, path, &W_MAX_LR_WDLR, cx)?,
                warmup_num_steps,
                warmup_type: warmup_type(params, path, cx)?,
                total_num_steps,
            }
        }
        "WarmupCosineLR" => {
            check_keys(path, params.unwrap_or(&empty), WARMUP_COSINE_KEYS, &[])?;
            let total_num_steps = total_steps(params, path, cx)?;
            let warmup_num_steps = get_int(params, path, &W_NUM_STEPS, cx)?;
            warn_short_schedule(path, total_num_steps, warmup_num_steps, cx);
            SchedulerConfig::WarmupCosineLR {
                total_num_steps,
                warmup_min_ratio: get_num(params, path, &W_MIN_RATIO, cx)?,
                warmup_num_steps,
                cos_min_ratio: get_num(params, path, &COS_MIN_RATIO, cx)?,
                warmup_type: warmup_type(params, path, cx)?,
            }
        }
        "OneCycle" | "LRRangeTest" => {
            return Err(key_err(
                "scheduler.type",
                format!("\"{ty}\" is a DeepSpeed schedule vitscale does not implement; supported: {}", quoted(SCHEDULER_TYPES)),
            ))
        }
        other => {
            let hint = suggest(other, SCHEDULER_TYPES.iter().copied());
            return Err(key_err("scheduler.type", format!("unknown schedule \"{other}\"{hint}; supported: {}", quoted(SCHEDULER_TYPES))));
        }
    };
    Ok(Some(sched))
}

// -- precision --

fn parse_precision(root: &Map<String, Value>, cx: &mut Cx) -> Result<Precision> {
    let bf16_key = if root.contains_key("bf16") { "bf16" } else { "bfloat16" };
    if root.contains_key("bf16") && root.contains_key("bfloat16") {
        return Err(key_err("bfloat16", "give either bf16 or its older spelling bfloat16, not both"));
    }
    let bf16 = section(root.get(bf16_key), bf16_key)?;
    let fp16 = section(root.get("fp16"), "fp16")?;
    if let Some(b) = bf16 {
        check_keys(bf16_key, b, BF16_KEYS, &[])?;
    }
    if let Some(f) = fp16 {
        check_keys("fp16", f, FP16_KEYS, &[])?;
    }
    let bf16_on = get_bool(bf16, bf16_key, &FP_ENABLED, cx)?;
    let fp16_on = get_bool(fp16, "fp16", &FP_ENABLED, cx)?;
    if bf16_on && fp16_on {
        return Err(key_err("fp16.enabled", "bfloat16 and fp16 modes cannot be simultaneously enabled"));
    }
    if bf16_on {
        if let Some(b) = bf16 {
            note_unimplemented(bf16_key, b, BF16_KEYS, cx);
        }
        return Ok(Precision::Bf16);
    }
    if fp16_on {
        let f = fp16;
        if let Some(m) = f {
            note_unimplemented("fp16", m, FP16_KEYS, cx);
        }
        return Ok(Precision::Fp16 {
            loss_scale: get_num(f, "fp16", &FP16_LOSS_SCALE, cx)?,
            initial_scale_power: get_int(f, "fp16", &FP16_INIT_POWER, cx)? as u32,
            loss_scale_window: get_int(f, "fp16", &FP16_WINDOW, cx)?,
            hysteresis: get_int(f, "fp16", &FP16_HYSTERESIS, cx)? as u32,
            min_loss_scale: get_num(f, "fp16", &FP16_MIN_SCALE, cx)?,
        });
    }
    Ok(Precision::Fp32)
}

// -- zero --

/// `communication_data_type`, `prescale_gradients`, `gradient_predivide_factor`: how the
/// gradient all-reduce runs, with DeepSpeed's default dtype (that of the compute precision).
fn parse_grad_comm(root: &Map<String, Value>, precision: &Precision, cx: &mut Cx) -> Result<GradComm> {
    let given = opt_str(Some(root), "", &COMM_DTYPE, cx)?.map(str::to_ascii_lowercase);
    let dtype = match given.as_deref() {
        Some("fp32") => CommDtype::Fp32,
        Some("bf16") => CommDtype::Bf16,
        Some("fp16") => {
            cx.warn("communication_data_type = \"fp16\": fp16 reductions are not implemented; gradients are reduced in fp32".into());
            CommDtype::Fp32
        }
        Some(other) => return Err(key_err("communication_data_type", format!("unknown value \"{other}\"; expected one of \"fp32\", \"bf16\", \"fp16\""))),
        None => match precision {
            Precision::Bf16 => CommDtype::Bf16,
            // DeepSpeed would reduce in fp16; fp32 is what vitscale has, and only more exact
            Precision::Fp16 { .. } | Precision::Fp32 => CommDtype::Fp32,
        },
    };
    let prescale = get_bool(Some(root), "", &PRESCALE, cx)?;
    let predivide = get_num(Some(root), "", &PREDIVIDE, cx)?;
    Ok(GradComm { dtype, prescale, predivide })
}

/// `zero_optimization`, resolved.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Zero {
    stage: u8,
    bucket: Option<usize>,
    reduce_scatter: bool,
    overlap_comm: bool,
}

/// `zero_optimization`: the stage, the bucket size if given, and the keys of the sharded
/// update; stage 3 resolves to stage 2 (warned).
fn parse_zero(v: Option<&Value>, cx: &mut Cx) -> Result<Zero> {
    let block = match v {
        None | Some(Value::Null) => return Ok(Zero { stage: 0, bucket: None, reduce_scatter: true, overlap_comm: true }),
        // Legacy form: `"zero_optimization": true` meant stage 1.
        Some(Value::Bool(b)) => {
            cx.warn("zero_optimization = true/false is DeepSpeed's deprecated form; use {\"stage\": N}".into());
            return Ok(Zero { stage: u8::from(*b), bucket: None, reduce_scatter: true, overlap_comm: true });
        }
        Some(Value::Object(m)) => m,
        Some(other) => return Err(key_err("zero_optimization", format!("expected an object, got {}", kind_of(other)))),
    };
    let p = "zero_optimization";
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

// -- model --

fn parse_model(sec: Option<&Map<String, Value>>, data: &DataConfig, cx: &mut Cx) -> Result<ModelConfig> {
    let p = "model";
    let dataset = data.dataset;
    if let Some(s) = sec {
        check_keys(p, s, MODEL_KEYS, &[])?;
    }
    let preset_name = match opt_str(sec, p, &M_PRESET, cx)? {
        Some(n) => n,
        None => match dataset {
            DatasetKind::Cifar10 | DatasetKind::Cifar100 => "vit_tiny_patch4_32",
            DatasetKind::Builtin | DatasetKind::Synthetic => crate::model::spec::DEFAULT_PRESET,
            DatasetKind::Folder => "vit_tiny_patch16_224",
        },
    };
    let mut m = ModelConfig::preset(preset_name)
        .ok_or_else(|| key_err("model.preset", format!("unknown preset \"{preset_name}\"; expected one of {}", quoted(PRESET_NAMES))))?;
    let int = |def: &KeyDef, cx: &mut Cx| opt_int(sec, p, def, cx).map(|o| o.map(|i| i as usize));
    if let Some(v) = int(&M_IMAGE, cx)? { m.image_size = v; }
    if let Some(v) = int(&M_PATCH, cx)? { m.patch_size = v; }
    if let Some(v) = int(&M_CHANS, cx)? { m.in_chans = v; }
    if let Some(v) = int(&M_WIDTH, cx)? { m.embed_dim = v; }
    if let Some(v) = int(&M_DEPTH, cx)? { m.depth = v; }
    if let Some(v) = int(&M_HEADS, cx)? { m.num_heads = v; }
    if let Some(v) = opt_num(sec, p, &M_MLP, cx)? { m.mlp_ratio = v; }
    if let Some(v) = opt_bool(sec, p, &M_QKV_BIAS, cx)? { m.qkv_bias = v; }
    if let Some(v) = opt_bool(sec, p, &M_CLS, cx)? { m.class_token = v; }
    if let Some(v) = opt_str(sec, p, &M_POOL, cx)? {
        m.global_pool = if v == "avg" { GlobalPool::Avg } else { GlobalPool::Token };
    }
    let given_classes = int(&M_CLASSES, cx)?;
    m.num_classes = match (given_classes, data.num_classes()) {
        (Some(k), Some(d)) if k != d => {
            return Err(key_err(
                "model.num_classes",
                format!(
                    "is {k} but data.dataset \"{}\"{} has {d} classes; leave it out or set it to {d}",
                    dataset.as_str(),
                    if data.label == LabelKind::Coarse { " with data.label \"coarse\"" } else { "" }
                ),
            ))
        }
        (Some(k), _) => k,
        (None, Some(d)) => d,
        (None, None) => m.num_classes,
    };
    m.validate().map_err(|msg| {
        let key: String = msg.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '.').collect();
        let key = if key.starts_with("model.") { key } else { "model".into() };
        key_err(key, msg)
    })?;
    Ok(m)
}

// -- data --

fn parse_data(sec: Option<&Map<String, Value>>, cx: &mut Cx) -> Result<DataConfig> {
    let p = "data";
    if let Some(s) = sec {
        check_keys(p, s, DATA_KEYS, &[])?;
    }
    let dataset = match get_str(sec, p, &D_DATASET, cx)? {
        "synthetic" => DatasetKind::Synthetic,
        "cifar10" => DatasetKind::Cifar10,
        "cifar100" => DatasetKind::Cifar100,
        "folder" => DatasetKind::Folder,
        _ => DatasetKind::Builtin,
    };
    let is_cifar = matches!(dataset, DatasetKind::Cifar10 | DatasetKind::Cifar100 | DatasetKind::Folder);
    let path = opt_str(sec, p, &D_PATH, cx)?.map(std::path::PathBuf::from);
    match (&path, is_cifar) {
        (None, true) => {
            return Err(key_err("data.path", format!("is required for data.dataset \"{}\" (the directory holding the dataset)", dataset.as_str())))
        }
        (Some(_), false) => {
            return Err(key_err("data.path", format!("is only used by cifar10/cifar100/folder; data.dataset \"{}\" reads no files", dataset.as_str())))
        }
        _ => {}
    }
    let (dmean, dstd): ([f32; 3], [f32; 3]) = match dataset {
        DatasetKind::Builtin | DatasetKind::Synthetic => ([0.5; 3], [0.5; 3]),
        DatasetKind::Cifar10 => ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]),
        DatasetKind::Cifar100 => ([0.5071, 0.4865, 0.4409], [0.2673, 0.2564, 0.2762]),
        // timm's IMAGENET_DEFAULT_MEAN / _STD.
        DatasetKind::Folder => ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    };
    let to3 = |v: Vec<f64>| [v[0] as f32, v[1] as f32, v[2] as f32];
    let mean = opt_nums(sec, p, &D_MEAN, cx)?.map(to3).unwrap_or(dmean);
    let std = opt_nums(sec, p, &D_STD, cx)?.map(to3).unwrap_or(dstd);
    if std.iter().any(|s| *s <= 0.0) {
        return Err(key_err("data.std", format!("each value must be > 0, got {std:?}")));
    }
    let augment = match get_str(sec, p, &D_AUGMENT, cx)? {
        "none" => Augment::None,
        _ => Augment::Default,
    };
    let shuffle = get_bool(sec, p, &D_SHUFFLE, cx)?;
    let num_workers = get_int(sec, p, &D_WORKERS, cx)? as usize;
    if is_cifar {
        for def in [&D_TRAIN_SIZE, &D_VAL_SIZE] {
            if sec.is_some_and(|s| s.contains_key(def.name)) {
                return Err(key_err(full(p, def.name), format!("is only used by the builtin and synthetic datasets (\"{}\" has its own splits)", dataset.as_str())));
            }
        }
    }
    let train_size = get_int(sec, p, &D_TRAIN_SIZE, cx)? as usize;
    let val_size = get_int(sec, p, &D_VAL_SIZE, cx)? as usize;
    let label = match get_str(sec, p, &D_LABEL, cx)? {
        "coarse" => LabelKind::Coarse,
        _ => LabelKind::Fine,
    };
    if label == LabelKind::Coarse && dataset != DatasetKind::Cifar100 {
        return Err(key_err("data.label", format!("\"coarse\" labels exist only in cifar100, not \"{}\"", dataset.as_str())));
    }
    let pair = |def: &KeyDef, dflt: [f64; 2], hi: f64, cx: &mut Cx| -> Result<[f64; 2]> {
        match opt_nums(sec, p, def, cx)? {
            None => Ok(dflt),
            Some(v) if v[0] > 0.0 && v[0] <= v[1] && v[1] <= hi => Ok([v[0], v[1]]),
            Some(v) => Err(key_err(full(p, def.name), format!("expected 0 < lo <= hi{}, got {v:?}", if hi.is_finite() { " <= 1" } else { "" }))),
        }
    };
    let scale = pair(&D_SCALE, DataConfig::DEFAULT_SCALE, 1.0, cx)?;
    let ratio = pair(&D_RATIO, DataConfig::DEFAULT_RATIO, f64::INFINITY, cx)?;
    let auto_augment = parse_rand_augment(get_str(sec, p, &D_AUTO_AUGMENT, cx)?).map_err(|m| key_err("data.auto_augment", m))?;
    let aug = AugmentOptions {
        auto_augment,
        mixup: get_num(sec, p, &D_MIXUP, cx)?,
        cutmix: get_num(sec, p, &D_CUTMIX, cx)?,
        mixup_prob: get_num(sec, p, &D_MIXUP_PROB, cx)?,
        mixup_switch_prob: get_num(sec, p, &D_MIXUP_SWITCH, cx)?,
        mixup_mode: match get_str(sec, p, &D_MIXUP_MODE, cx)? {
            "pair" => MixMode::Pair,
            "elem" => MixMode::Elem,
            _ => MixMode::Batch,
        },
        reprob: get_num(sec, p, &D_REPROB, cx)?,
        remode: match get_str(sec, p, &D_REMODE, cx)? {
            "const" => EraseMode::Const,
            "rand" => EraseMode::Rand,
            _ => EraseMode::Pixel,
        },
        recount: get_int(sec, p, &D_RECOUNT, cx)? as usize,
    };
    if augment == Augment::None && (aug.auto_augment.is_some() || aug.reprob > 0.0 || aug.mixes()) {
        cx.warn("data.augment = \"none\": data.auto_augment, data.reprob, data.mixup and data.cutmix are not applied".into());
    }
    Ok(DataConfig {
        dataset,
        path,
        mean,
        std,
        augment,
        shuffle,
        num_workers,
        train_size,
        val_size,
        label,
        skip_bad: get_bool(sec, p, &D_SKIP_BAD, cx)?,
        val_split: get_num(sec, p, &D_VAL_SPLIT, cx)?,
        crop_pct: get_num(sec, p, &D_CROP_PCT, cx)?,
        scale,
        ratio,
        interpolation: match get_str(sec, p, &D_INTERPOLATION, cx)? {
            "bicubic" => Interpolation::Bicubic,
            _ => Interpolation::Bilinear,
        },
        prefetch: get_int(sec, p, &D_PREFETCH, cx)? as usize,
        aug,
    })
}

// -- train --

fn parse_train(sec: Option<&Map<String, Value>>, batch: &BatchConfig, steps_per_print: u64, cx: &mut Cx) -> Result<TrainConfig> {
    let p = "train";
    if let Some(s) = sec {
        check_keys(p, s, TRAIN_KEYS, &[])?;
    }
    let skip = match given(sec, p, &T_DECAY_SKIP, cx) {
        None => SKIP_KINDS.to_vec(),
        Some(v) => {
            let arr = v.as_array().ok_or_else(|| bad(p, &T_DECAY_SKIP, v))?;
            let mut out = Vec::new();
            for item in arr {
                let s = item.as_str().filter(|s| SKIP_KINDS.contains(s)).ok_or_else(|| {
                    key_err("train.weight_decay_skip", format!("unknown entry {}; expected entries from {}", kind_of(item), quoted(SKIP_KINDS)))
                })?;
                if out.contains(&s) {
                    return Err(key_err("train.weight_decay_skip", format!("\"{s}\" is listed twice")));
                }
                out.push(s);
            }
            out
        }
    };
    let checkpoint_every = get_int(sec, p, &T_CKPT_EVERY, cx)?;
    Ok(TrainConfig {
        epochs: get_int(sec, p, &T_EPOCHS, cx)? as usize,
        steps: opt_int(sec, p, &T_STEPS, cx)?,
        seed: get_int(sec, p, &T_SEED, cx)?,
        eval_every: get_int(sec, p, &T_EVAL_EVERY, cx)?,
        checkpoint_every,
        label_smoothing: get_num(sec, p, &T_SMOOTHING, cx)? as f32,
        weight_decay_skip: DecaySkip {
            bias: skip.contains(&"bias"),
            norm: skip.contains(&"norm"),
            pos_embed: skip.contains(&"pos_embed"),
            cls_token: skip.contains(&"cls_token"),
        },
        log_every: opt_int(sec, p, &T_LOG_EVERY, cx)?.unwrap_or(steps_per_print),
        eval_batch_size: opt_int(sec, p, &T_EVAL_BATCH, cx)?.map(|i| i as usize).unwrap_or(batch.micro_batch_per_gpu),
        checkpoint_on_signal: opt_bool(sec, p, &T_CKPT_ON_SIGNAL, cx)?.unwrap_or(checkpoint_every > 0),
        comm_timeout_s: get_num(sec, p, &T_COMM_TIMEOUT, cx)?,
        recompute: Recompute::parse(get_str(sec, p, &T_RECOMPUTE, cx)?).unwrap_or_default(),
        pass_images: opt_int(sec, p, &T_PASS_IMAGES, cx)?.map(|i| i as usize),
        emulate_slowdown: parse_slowdown(sec, p, batch.world_size)?,
        balance: parse_balance(sec, p, batch.world_size, cx)?,
        balance_every: get_int(sec, p, &T_BALANCE_EVERY, cx)?,
    })
}

/// `train.emulate_slowdown`: an object of rank (decimal string) → factor >= 1, ranks below
/// the world size.
fn parse_slowdown(sec: Option<&Map<String, Value>>, p: &str, world: usize) -> Result<Vec<(usize, f64)>> {
    let name = full(p, T_SLOWDOWN.name);
    let Some(v) = sec.and_then(|s| s.get(T_SLOWDOWN.name)).filter(|v| !v.is_null()) else { return Ok(Vec::new()) };
    let obj = v.as_object().ok_or_else(|| key_err(&name, format!("expected an object {{\"<rank>\": factor}}, got {}", kind_of(v))))?;
    let mut out = Vec::new();
    for (k, f) in obj {
        let rank: usize = k.parse().map_err(|_| key_err(&name, format!("\"{k}\" is not a rank; expected a decimal rank such as \"1\"")))?;
        if rank >= world {
            return Err(key_err(&name, format!("rank {rank} does not exist: the job has {world} rank(s), 0..{}", world.saturating_sub(1))));
        }
        let factor = f.as_f64().filter(|x| x.is_finite() && *x >= 1.0).ok_or_else(|| {
            key_err(&name, format!("rank {rank}: expected a factor >= 1 (how many times slower), got {}", kind_of(f)))
        })?;
        out.push((rank, factor));
    }
    out.sort_by_key(|&(r, _)| r);
    Ok(out)
}

/// `train.balance`: "off", "auto" or one positive share per rank.
fn parse_balance(sec: Option<&Map<String, Value>>, p: &str, world: usize, cx: &mut Cx) -> Result<Balance> {
    let name = full(p, T_BALANCE.name);
    let expected = || format!("expected \"off\", \"auto\" or a list of {world} positive shares (one per rank)");
    match sec.and_then(|s| s.get(T_BALANCE.name)).filter(|v| !v.is_null()) {
        None => Ok(Balance::Off),
        Some(Value::Array(items)) => {
            if items.len() != world {
                return Err(key_err(&name, format!("{} shares for {world} rank(s); {}", items.len(), expected())));
            }
            let shares = items
                .iter()
                .enumerate()
                .map(|(r, x)| x.as_f64().filter(|x| x.is_finite() && *x > 0.0).ok_or_else(|| key_err(&name, format!("share of rank {r}: {}, got {}", expected(), kind_of(x)))))
                .collect::<Result<Vec<f64>>>()?;
            Ok(Balance::Shares(shares))
        }
        Some(v) => match get_str(sec, p, &T_BALANCE, cx).map_err(|_| key_err(&name, format!("{}, got {}", expected(), kind_of(v))))? {
            "auto" => Ok(Balance::Auto),
            "off" => Ok(Balance::Off),
            other => Err(key_err(&name, format!("{}, got \"{other}\"", expected()))),
        },
    }
}

// ---- writing ------------------------------------------------------------------------------

/// The resolved configuration as a DeepSpeed-shaped JSON with every value explicit but
/// `total_num_steps: "auto"` (the run's length, known only to the training loop): written
/// into run directories, and loadable again with [`resolve`] (same world size) to the same
/// `RunConfig`.
pub fn resolved_json(cfg: &RunConfig) -> Value {
    let optimizer = match &cfg.optimizer {
        OptimizerConfig::Adam { lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction } => json!({
            "type": if *adam_w_mode { "AdamW" } else { "Adam" },
            "params": {
                "lr": lr, "betas": [beta1, beta2], "eps": eps, "weight_decay": weight_decay,
                "adam_w_mode": adam_w_mode, "bias_correction": bias_correction
            }
        }),
        OptimizerConfig::Sgd { lr, momentum, dampening, weight_decay, nesterov } => json!({
            "type": "SGD",
            "params": { "lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay, "nesterov": nesterov }
        }),
    };
    let wt = |w: WarmupType| match w {
        WarmupType::Log => "log",
        WarmupType::Linear => "linear",
    };
    let scheduler = cfg.scheduler.as_ref().map(|s| match s {
        SchedulerConfig::WarmupLR { warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type } => json!({
            "type": "WarmupLR",
            "params": { "warmup_min_lr": warmup_min_lr, "warmup_max_lr": warmup_max_lr,
                        "warmup_num_steps": warmup_num_steps, "warmup_type": wt(*warmup_type) }
        }),
        SchedulerConfig::WarmupDecayLR { warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, total_num_steps } => json!({
            "type": "WarmupDecayLR",
            "params": { "total_num_steps": total_num_steps, "warmup_min_lr": warmup_min_lr, "warmup_max_lr": warmup_max_lr,
                        "warmup_num_steps": warmup_num_steps, "warmup_type": wt(*warmup_type) }
        }),
        SchedulerConfig::WarmupCosineLR { total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type } => json!({
            "type": "WarmupCosineLR",
            "params": { "total_num_steps": total_num_steps, "warmup_min_ratio": warmup_min_ratio,
                        "warmup_num_steps": warmup_num_steps, "cos_min_ratio": cos_min_ratio, "warmup_type": wt(*warmup_type) }
        }),
    });
    let m = &cfg.model;
    let d = &cfg.data;
    let t = &cfg.train;
    let mut zero = json!({ "stage": cfg.zero_stage, "reduce_scatter": cfg.zero_reduce_scatter, "overlap_comm": cfg.zero_overlap_comm });
    if let Some(n) = cfg.reduce_bucket_size {
        zero["reduce_bucket_size"] = json!(n);
    }
    let mut out = json!({
        "train_batch_size": cfg.batch.train_batch_size,
        "train_micro_batch_size_per_gpu": cfg.batch.micro_batch_per_gpu,
        "gradient_accumulation_steps": cfg.batch.gradient_accumulation_steps,
        "optimizer": optimizer,
        "gradient_clipping": cfg.gradient_clipping,
        "zero_optimization": zero,
        "model": {
            "image_size": m.image_size, "patch_size": m.patch_size, "in_chans": m.in_chans, "embed_dim": m.embed_dim,
            "depth": m.depth, "num_heads": m.num_heads, "mlp_ratio": m.mlp_ratio, "num_classes": m.num_classes,
            "qkv_bias": m.qkv_bias, "class_token": m.class_token, "global_pool": m.global_pool.as_str()
        },
        "data": {
            "dataset": d.dataset.as_str(), "mean": d.mean, "std": d.std,
            "augment": match d.augment { Augment::None => "none", Augment::Default => "default" },
            "shuffle": d.shuffle, "num_workers": d.num_workers,
            "label": match d.label { LabelKind::Fine => "fine", LabelKind::Coarse => "coarse" },
            "skip_bad": d.skip_bad, "val_split": d.val_split, "crop_pct": d.crop_pct, "scale": d.scale, "ratio": d.ratio,
            "interpolation": d.interpolation.as_str(), "prefetch": d.prefetch,
            "auto_augment": d.aug.auto_augment.as_ref().map_or("none", |r| r.spec.as_str()),
            "mixup": d.aug.mixup, "cutmix": d.aug.cutmix, "mixup_prob": d.aug.mixup_prob,
            "mixup_switch_prob": d.aug.mixup_switch_prob, "mixup_mode": d.aug.mixup_mode.as_str(),
            "reprob": d.aug.reprob,
            "remode": match d.aug.remode { EraseMode::Pixel => "pixel", EraseMode::Const => "const", EraseMode::Rand => "rand" },
            "recount": d.aug.recount
        },
        "train": {
            "epochs": t.epochs, "seed": t.seed, "eval_every": t.eval_every, "checkpoint_every": t.checkpoint_every,
            "label_smoothing": t.label_smoothing,
            "weight_decay_skip": SKIP_KINDS.iter().copied().filter(|k| match *k {
                "bias" => t.weight_decay_skip.bias,
                "norm" => t.weight_decay_skip.norm,
                "pos_embed" => t.weight_decay_skip.pos_embed,
                _ => t.weight_decay_skip.cls_token,
            }).collect::<Vec<_>>(),
            "log_every": t.log_every, "eval_batch_size": t.eval_batch_size,
            "checkpoint_on_signal": t.checkpoint_on_signal, "comm_timeout_s": t.comm_timeout_s,
            "recompute": t.recompute.as_str(),
            "emulate_slowdown": t.emulate_slowdown.iter().map(|(r, f)| (r.to_string(), json!(f))).collect::<Map<String, Value>>(),
            "balance": match &t.balance {
                Balance::Off => json!("off"),
                Balance::Auto => json!("auto"),
                Balance::Shares(s) => json!(s),
            },
            "balance_every": t.balance_every
        }
    });
    if let (Some(n), Some(train)) = (t.pass_images, out.get_mut("train").and_then(|v| v.as_object_mut())) {
        train.insert("pass_images".into(), n.into());
    }
    // `json!` always yields an object here; the if-lets only avoid an unwrap.
    if let Some(o) = out.as_object_mut() {
        if let Some(s) = scheduler {
            o.insert("scheduler".into(), s);
        }
        o.insert("communication_data_type".into(), json!(cfg.grad_comm.dtype.as_str()));
        o.insert("prescale_gradients".into(), json!(cfg.grad_comm.prescale));
        o.insert("gradient_predivide_factor".into(), json!(cfg.grad_comm.predivide));
        match &cfg.precision {
            Precision::Fp32 => {}
            Precision::Bf16 => {
                o.insert("bf16".into(), json!({ "enabled": true }));
            }
            Precision::Fp16 { loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale } => {
                o.insert("fp16".into(), json!({
                    "enabled": true, "loss_scale": loss_scale, "initial_scale_power": initial_scale_power,
                    "loss_scale_window": loss_scale_window, "hysteresis": hysteresis, "min_loss_scale": min_loss_scale
                }));
            }
        }
        if let Some(data) = o.get_mut("data").and_then(Value::as_object_mut) {
            match &d.path {
                Some(path) => {
                    data.insert("path".into(), json!(path.display().to_string()));
                }
                None => {
                    data.insert("train_size".into(), json!(d.train_size));
                    data.insert("val_size".into(), json!(d.val_size));
                }
            }
        }
        if let (Some(steps), Some(train)) = (t.steps, o.get_mut("train").and_then(Value::as_object_mut)) {
            train.insert("steps".into(), json!(steps));
        }
        o.insert("wall_clock_breakdown".into(), json!(cfg.monitor.wall_clock_breakdown));
        for (name, target) in [("tensorboard", &cfg.monitor.tensorboard), ("csv_monitor", &cfg.monitor.csv_monitor)] {
            if let Some(t) = target {
                o.insert(name.into(), json!({ "enabled": true, "output_path": t.output_path, "job_name": t.job_name }));
            }
        }
    }
    out
}

// ---- resuming -----------------------------------------------------------------------------

/// Keys a resumed run may change: the run's length, how often it logs, evaluates and
/// checkpoints, and how the same global batch is split and scheduled (micro-batch, GAS,
/// passes, workers, timeouts, where the same dataset lies). Every other key shapes the
/// trajectory, and a resume continues the run exactly, so it must match the checkpoint.
pub const RESUME_FREE_KEYS: &[&str] = &[
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "plan",
    "zero_optimization.reduce_bucket_size",
    // the ZeRO stage and its schedule, the split over ranks and an emulated slowdown leave
    // the reduced gradient, and so the trajectory, as they were (tests/dist_zero.rs, balance.rs)
    "zero_optimization.stage",
    "zero_optimization.reduce_scatter",
    "zero_optimization.overlap_comm",
    "memory",
    "train.balance",
    "train.balance_every",
    "train.emulate_slowdown",
    "train.epochs",
    "train.steps",
    "train.eval_every",
    "train.log_every",
    "train.checkpoint_every",
    "train.checkpoint_on_signal",
    "train.comm_timeout_s",
    "train.eval_batch_size",
    "train.pass_images",
    "train.recompute",
    "data.path",
    "data.num_workers",
    "data.prefetch",
];

fn flatten(prefix: &str, v: &Value, out: &mut std::collections::BTreeMap<String, Value>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                flatten(&full(prefix, k), x, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.clone());
        }
    }
}

/// The keys where the configuration `now` (as [`resolved_json`] writes it) differs from the
/// `saved` one of a checkpoint, other than [`RESUME_FREE_KEYS`]: one `key: checkpoint X,
/// now Y` line each.
pub fn resume_differences(saved: &Value, now: &Value) -> Vec<String> {
    let (mut a, mut b) = (std::collections::BTreeMap::new(), std::collections::BTreeMap::new());
    flatten("", saved, &mut a);
    flatten("", now, &mut b);
    let free = |k: &str| RESUME_FREE_KEYS.iter().any(|f| k == *f || k.starts_with(&format!("{f}.")));
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let show = |v: Option<&Value>| v.map_or("(absent)".to_string(), |v| v.to_string());
    keys.into_iter()
        .filter(|k| !free(k))
        .filter(|k| match (a.get(*k), b.get(*k)) {
            // 0.1 written by an f32 field and read back as f64 compares equal in f32.
            (Some(Value::Number(x)), Some(Value::Number(y))) => match (x.as_f64(), y.as_f64()) {
                (Some(x), Some(y)) => x != y && (x as f32) != (y as f32),
                _ => x != y,
            },
            (x, y) => x != y,
        })
        .map(|k| format!("{k}: checkpoint {}, now {}", show(a.get(k)), show(b.get(k))))
        .collect()
}

/// For a run resumed on another world size than its checkpoint's (`saved_world`): sets the
/// batch keys of `value` so the global batch stays the checkpoint's `global`, keeping the
/// micro-batch the config gives when it divides (else its GAS, else neither). A
/// `train_batch_size` the config gives must equal `global`. Returns the note saying what was
/// derived.
pub fn keep_global_batch(value: &mut Value, global: usize, saved_world: usize, world: usize) -> Result<String> {
    let root = value.as_object_mut().ok_or_else(|| key_err("(top level)", "expected a JSON object"))?;
    let num = |k: &str| root.get(k).and_then(Value::as_u64).map(|x| x as usize);
    let (t, m, g) = (num(TRAIN_BATCH_SIZE.name), num(MICRO_BATCH.name), num(GAS.name));
    if let Some(t) = t.filter(|&t| t != global) {
        return Err(key_err(
            TRAIN_BATCH_SIZE.name,
            format!("is {t}, but the checkpoint was trained with a global batch of {global}; a resumed run keeps its global batch (leave train_batch_size out or set it to {global})"),
        ));
    }
    let mut last = None;
    for (cm, cg) in [(m, g), (m, None), (None, g), (None, None)] {
        match resolve_batch(Some(global), cm, cg, world) {
            Ok(b) => {
                root.insert(TRAIN_BATCH_SIZE.name.into(), global.into());
                root.insert(MICRO_BATCH.name.into(), b.micro_batch_per_gpu.into());
                root.insert(GAS.name.into(), b.gradient_accumulation_steps.into());
                return Ok(format!(
                    "resuming a checkpoint of {saved_world} rank(s) on {world}: train_batch_size {global} kept = micro {} × GAS {} × {world} ranks",
                    b.micro_batch_per_gpu, b.gradient_accumulation_steps
                ));
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| key_err(TRAIN_BATCH_SIZE.name, "cannot be kept")))
}
