//! DeepSpeed's `scheduler` block: WarmupLR, WarmupDecayLR and WarmupCosineLR with DeepSpeed's
//! parameter names, defaults and quirks (an unknown warmup_type falls back to log); no block
//! means a constant learning rate.

use serde_json::{json, Map, Value};

use super::key_def::*;
use super::types::{OptimizerConfig, SchedulerConfig, TotalSteps, WarmupType};
use super::value::*;

pub(super) const SCHEDULER: KeyDef = key("scheduler", Ty::Section, Dflt::Unset, "DeepSpeed LR scheduler block: WarmupLR, WarmupDecayLR or WarmupCosineLR; absent = constant LR.");

/// `scheduler.type` values we implement (case-sensitive, as DeepSpeed).
pub const SCHEDULER_TYPES: &[&str] = &["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"];
const SCHED_TYPE: KeyDef = key("type", Ty::Choice(SCHEDULER_TYPES), Dflt::Required, "LR schedule.");
pub(super) const SCHED_PARAMS: KeyDef = key("params", Ty::Section, Dflt::Unset, "Schedule arguments (DeepSpeed names).");
pub(super) const SCHED_BLOCK_KEYS: &[KeyDef] = &[SCHED_TYPE, SCHED_PARAMS];
const WARMUP_TYPES: &[&str] = &["log", "linear"];
const W_MIN_LR: KeyDef = key("warmup_min_lr", NONNEG, Dflt::Num(0.0), "LR at the start of warmup.");
const W_MAX_LR_WLR: KeyDef = key("warmup_max_lr", NONNEG, Dflt::Derived("the optimizer lr"), "LR at the end of warmup (replaces the optimizer lr).");
const W_MAX_LR_WDLR: KeyDef = key("warmup_max_lr", NONNEG, Dflt::Num(0.001), "LR at the end of warmup (replaces the optimizer lr).");
const W_NUM_STEPS: KeyDef = key("warmup_num_steps", POS_INT, Dflt::Int(1000), "Warmup length in optimizer steps (at least 2 are used, as DeepSpeed).");
const W_TYPE: KeyDef = key("warmup_type", Ty::Str, Dflt::Str("log"), "\"log\" or \"linear\"; anything else falls back to log with a warning (DeepSpeed behaviour).");
const TOTAL_STEPS: KeyDef = key("total_num_steps", POS_INT, Dflt::Required, "Schedule length in optimizer steps; \"auto\" = the run's length.");
const W_MIN_RATIO: KeyDef = key("warmup_min_ratio", UNIT, Dflt::Num(0.0), "Warmup start as a fraction of the optimizer lr.");
const COS_MIN_RATIO: KeyDef = key("cos_min_ratio", UNIT, Dflt::Num(0.0001), "Final LR as a fraction of the optimizer lr.");
pub(super) const WARMUP_LR_KEYS: &[KeyDef] = &[W_MIN_LR, W_MAX_LR_WLR, W_NUM_STEPS, W_TYPE];
pub(super) const WARMUP_DECAY_KEYS: &[KeyDef] = &[TOTAL_STEPS, W_MIN_LR, W_MAX_LR_WDLR, W_NUM_STEPS, W_TYPE];
pub(super) const WARMUP_COSINE_KEYS: &[KeyDef] = &[TOTAL_STEPS, W_MIN_RATIO, W_NUM_STEPS, COS_MIN_RATIO, W_TYPE];

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
/// size, which the training loop knows once it has opened the dataset. (Documented usage, so
/// no warning.)
fn total_steps(params: Option<&Map<String, Value>>, path: &str, cx: &mut Cx) -> Result<TotalSteps> {
    let raw = params.and_then(|p| p.get(TOTAL_STEPS.name));
    if raw.is_some_and(is_auto) {
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

/// The `scheduler` block (no block: a constant learning rate); `opt` gives WarmupLR's default
/// maximum.
pub(super) fn parse(block: Option<&Map<String, Value>>, opt: &OptimizerConfig, cx: &mut Cx) -> Result<Option<SchedulerConfig>> {
    let Some(block) = block else { return Ok(None) };
    check_keys(SCHEDULER.name, block, SCHED_BLOCK_KEYS, &[])?;
    let type_key = full(SCHEDULER.name, SCHED_TYPE.name);
    let ty_v = block.get(SCHED_TYPE.name).ok_or_else(|| key_err(&type_key, format!("is required; expected one of {}", quoted(SCHEDULER_TYPES))))?;
    let ty = ty_v.as_str().ok_or_else(|| key_err(&type_key, format!("expected one of {}, got {}", quoted(SCHEDULER_TYPES), kind_of(ty_v))))?;
    let path = &full(SCHEDULER.name, SCHED_PARAMS.name);
    let params = section(block.get(SCHED_PARAMS.name), path)?;
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
                type_key,
                format!("\"{ty}\" is a DeepSpeed schedule vitscale does not implement; supported: {}", quoted(SCHEDULER_TYPES)),
            ))
        }
        other => {
            let hint = suggest(other, SCHEDULER_TYPES.iter().copied());
            return Err(key_err(type_key, format!("unknown schedule \"{other}\"{hint}; supported: {}", quoted(SCHEDULER_TYPES))));
        }
    };
    Ok(Some(sched))
}

/// `{"type", "params"}` with every parameter explicit, `total_num_steps` as given (a number,
/// or `"auto"` for the run's length).
pub(super) fn write(scheduler: &SchedulerConfig) -> Value {
    let warmup_type = |w: WarmupType| match w {
        WarmupType::Log => "log",
        WarmupType::Linear => "linear",
    };
    let mut params = Map::new();
    let ty = match *scheduler {
        SchedulerConfig::WarmupLR { warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type: w } => {
            put(&mut params, &W_MIN_LR, json!(warmup_min_lr));
            put(&mut params, &W_MAX_LR_WLR, json!(warmup_max_lr));
            put(&mut params, &W_NUM_STEPS, json!(warmup_num_steps));
            put(&mut params, &W_TYPE, json!(warmup_type(w)));
            "WarmupLR"
        }
        SchedulerConfig::WarmupDecayLR { warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type: w, total_num_steps } => {
            put(&mut params, &TOTAL_STEPS, json!(total_num_steps));
            put(&mut params, &W_MIN_LR, json!(warmup_min_lr));
            put(&mut params, &W_MAX_LR_WDLR, json!(warmup_max_lr));
            put(&mut params, &W_NUM_STEPS, json!(warmup_num_steps));
            put(&mut params, &W_TYPE, json!(warmup_type(w)));
            "WarmupDecayLR"
        }
        SchedulerConfig::WarmupCosineLR { total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type: w } => {
            put(&mut params, &TOTAL_STEPS, json!(total_num_steps));
            put(&mut params, &W_MIN_RATIO, json!(warmup_min_ratio));
            put(&mut params, &W_NUM_STEPS, json!(warmup_num_steps));
            put(&mut params, &COS_MIN_RATIO, json!(cos_min_ratio));
            put(&mut params, &W_TYPE, json!(warmup_type(w)));
            "WarmupCosineLR"
        }
    };
    let mut block = Map::new();
    put(&mut block, &SCHED_TYPE, json!(ty));
    put(&mut block, &SCHED_PARAMS, Value::Object(params));
    Value::Object(block)
}
