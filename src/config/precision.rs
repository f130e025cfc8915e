//! Compute precision: DeepSpeed's `fp16` block (static or dynamic loss scaling) and `bf16`
//! block (also under its older spelling `bfloat16`); neither enabled means fp32.

use serde_json::{json, Map, Value};

use super::key_def::*;
use super::types::Precision;
use super::value::*;

pub(super) const FP16: KeyDef = key("fp16", Ty::Section, Dflt::Unset, "DeepSpeed fp16 block: fp16 compute on GPUs with DeepSpeed's loss scaling (dynamic when loss_scale is 0), overflowing steps skipped; the CPU computes in f32 and scales alike. Without a bf16 or fp16 block a GPU before Ampere (sm_75, sm_70) computes in fp16 with this block's defaults (docs/precision.md).");
pub(super) const BF16: KeyDef = key("bf16", Ty::Section, Dflt::Unset, "DeepSpeed bf16 block: {\"enabled\": true} computes in bf16 on GPUs from Ampere (sm_80) on; an error on older GPUs, which have no bf16 arithmetic (use fp16).");
pub(super) const BFLOAT16: KeyDef = key("bfloat16", Ty::Section, Dflt::Unset, "Older DeepSpeed spelling of bf16.");

const FP_ENABLED: KeyDef = key("enabled", Ty::Bool, Dflt::Bool(false), "Turn the mode on.");
const FP16_LOSS_SCALE: KeyDef = key("loss_scale", NONNEG, Dflt::Num(0.0), "Static loss scale; 0 = dynamic.");
const FP16_INIT_POWER: KeyDef = key("initial_scale_power", Ty::Int { lo: 0, hi: 1000 }, Dflt::Int(16), "Dynamic scaling starts at 2^power.");
const FP16_WINDOW: KeyDef = key("loss_scale_window", POS_INT, Dflt::Int(1000), "Steps without overflow before the scale doubles.");
const FP16_HYSTERESIS: KeyDef = key("hysteresis", POS_INT, Dflt::Int(2), "Overflows tolerated before the scale halves.");
const FP16_MIN_SCALE: KeyDef = key("min_loss_scale", POSITIVE, Dflt::Num(1.0), "Lower bound of the dynamic scale.");
const FP16_CONSECUTIVE: KeyDef = key("consecutive_hysteresis", Ty::Bool, Dflt::Bool(false), "Refill the hysteresis on every step without overflow (else only when the window doubles the scale).");
pub(super) const FP16_KEYS: &[KeyDef] = &[
    FP_ENABLED, FP16_LOSS_SCALE, FP16_INIT_POWER, FP16_WINDOW, FP16_HYSTERESIS, FP16_MIN_SCALE, FP16_CONSECUTIVE,
    ds_warn("auto_cast", Dflt::Bool(false), "Cast module inputs to fp16; not implemented."),
    ds_warn("fp16_master_weights_and_grads", Dflt::Bool(false), "fp16 master weights; not implemented (masters are fp32)."),
];
pub(super) const BF16_KEYS: &[KeyDef] = &[
    FP_ENABLED,
    ds_warn("immediate_grad_update", Dflt::Unset, "Not implemented (gradients are reduced at the accumulation boundary)."),
    ds_warn("check_grad_overflow", Dflt::Bool(false), "Overflow checks in bf16; not implemented."),
    ds_warn("bf16_master_weights_and_grads", Dflt::Bool(false), "bf16 master weights; not implemented (masters are fp32)."),
    ds_warn("bf16_optimizer_states", Dflt::Bool(false), "bf16 optimizer states; not implemented (states are fp32)."),
    ds_noop("auto_cast", "Inputs are always cast to the compute dtype."),
];

/// The compute precision from the `bf16` (or `bfloat16`) and `fp16` blocks, at most one of
/// them enabled.
pub(super) fn parse(root: &Map<String, Value>, cx: &mut Cx) -> Result<Precision> {
    let bf16_key = if root.contains_key(BF16.name) { BF16.name } else { BFLOAT16.name };
    if root.contains_key(BF16.name) && root.contains_key(BFLOAT16.name) {
        return Err(key_err(BFLOAT16.name, "give either bf16 or its older spelling bfloat16, not both"));
    }
    let fp16_key = FP16.name;
    let bf16 = section(root.get(bf16_key), bf16_key)?;
    let fp16 = section(root.get(fp16_key), fp16_key)?;
    if let Some(b) = bf16 {
        check_keys(bf16_key, b, BF16_KEYS, &[])?;
    }
    if let Some(f) = fp16 {
        check_keys(fp16_key, f, FP16_KEYS, &[])?;
    }
    let bf16_on = get_bool(bf16, bf16_key, &FP_ENABLED, cx)?;
    let fp16_on = get_bool(fp16, fp16_key, &FP_ENABLED, cx)?;
    if bf16_on && fp16_on {
        return Err(key_err(full(fp16_key, FP_ENABLED.name), "bfloat16 and fp16 modes cannot be simultaneously enabled"));
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
            note_unimplemented(fp16_key, m, FP16_KEYS, cx);
        }
        return Ok(Precision::Fp16 {
            loss_scale: get_num(f, fp16_key, &FP16_LOSS_SCALE, cx)?,
            initial_scale_power: get_int(f, fp16_key, &FP16_INIT_POWER, cx)? as u32,
            loss_scale_window: get_int(f, fp16_key, &FP16_WINDOW, cx)?,
            hysteresis: get_int(f, fp16_key, &FP16_HYSTERESIS, cx)? as u32,
            min_loss_scale: get_num(f, fp16_key, &FP16_MIN_SCALE, cx)?,
            consecutive_hysteresis: get_bool(f, fp16_key, &FP16_CONSECUTIVE, cx)?,
        });
    }
    Ok(Precision::Fp32)
}

/// What `{"fp16": {"enabled": true}}` means: DeepSpeed's defaults for every key of the block
/// (dynamic scaling from 2^16, window 1000, hysteresis 2, minimum scale 1), as a run without a
/// precision block on a GPU before Ampere computes (`backend::half::choose`).
pub fn fp16_defaults() -> Precision {
    let mut root = Map::new();
    root.insert(FP16.name.into(), json!({ FP_ENABLED.name: true }));
    // the keys' defaults pass their own checks, so the block parses
    parse(&root, &mut Cx::default()).unwrap_or(Precision::Fp32)
}

/// The enabled mode's block under its current name (`bf16`, also when given as `bfloat16`);
/// fp32 writes neither.
pub(super) fn write(precision: &Precision, out: &mut Map<String, Value>) {
    match *precision {
        Precision::Fp32 => {}
        Precision::Bf16 => {
            let mut block = Map::new();
            put(&mut block, &FP_ENABLED, json!(true));
            put(out, &BF16, Value::Object(block));
        }
        Precision::Fp16 { loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale, consecutive_hysteresis } => {
            let mut block = Map::new();
            put(&mut block, &FP_ENABLED, json!(true));
            put(&mut block, &FP16_LOSS_SCALE, json!(loss_scale));
            put(&mut block, &FP16_INIT_POWER, json!(initial_scale_power));
            put(&mut block, &FP16_WINDOW, json!(loss_scale_window));
            put(&mut block, &FP16_HYSTERESIS, json!(hysteresis));
            put(&mut block, &FP16_MIN_SCALE, json!(min_loss_scale));
            put(&mut block, &FP16_CONSECUTIVE, json!(consecutive_hysteresis));
            put(out, &FP16, Value::Object(block));
        }
    }
}
