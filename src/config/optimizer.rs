//! DeepSpeed's `optimizer` block: Adam, AdamW and SGD with DeepSpeed's (FusedAdam's) and
//! torch's parameter names and defaults; no block means vitscale's default, AdamW with
//! lr 1e-3 and weight_decay 0.05 (training from scratch).

use serde_json::{json, Map, Value};

use super::key_def::*;
use super::types::OptimizerConfig;
use super::value::*;

pub(super) const OPTIMIZER: KeyDef = key("optimizer", Ty::Section, Dflt::Derived("AdamW, lr 1e-3, weight_decay 0.05"), "DeepSpeed optimizer block: {\"type\": Adam|AdamW|SGD, \"params\": {...}}.");

/// `optimizer.type` values we implement (compared case-insensitively).
pub const OPTIMIZER_TYPES: &[&str] = &["Adam", "AdamW", "SGD"];

const OPT_TYPE: KeyDef = key("type", Ty::Choice(OPTIMIZER_TYPES), Dflt::Derived("vitscale's default optimizer (AdamW, lr 1e-3, weight_decay 0.05), with the block's params applied over it"),
    "Optimizer (case-insensitive, as DeepSpeed). A block without a type (`--set optimizer.params.lr=3e-4` on a config without an optimizer block) adjusts vitscale's default optimizer, with a warning.");
pub(super) const OPT_PARAMS: KeyDef = key("params", Ty::Section, Dflt::Unset, "Optimizer arguments (DeepSpeed / torch names).");
pub(super) const OPT_BLOCK_KEYS: &[KeyDef] = &[
    OPT_TYPE,
    OPT_PARAMS,
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
/// timm's layer-wise learning-rate decay (`--layer-decay`, `param_groups_layer_decay`): not a
/// DeepSpeed key, read from the same block as the optimizer's other arguments.
const LAYER_DECAY: KeyDef = key("layer_decay", Ty::Num { lo: 0.0, hi: 1.0, lo_open: true, hi_open: false }, Dflt::Unset,
    "Layer-wise learning-rate decay as timm's: block i of D trains at lr · layer_decay^(D − i), the patch embedding, class token and position embedding at lr · layer_decay^(D + 1), the final norm at lr · layer_decay, fc_norm and the head at lr. Fine-tuning recipes use 0.65–0.75.");
/// Keys of `optimizer.params` for Adam / AdamW.
pub const ADAM_KEYS: &[KeyDef] = &[ADAM_LR, ADAM_BETAS, ADAM_EPS, ADAM_WD, ADAM_W_MODE, ADAM_BIAS_CORR, ADAM_TORCH, ADAM_AMSGRAD, LAYER_DECAY];

const SGD_LR: KeyDef = key("lr", NONNEG, Dflt::Num(1e-3), "Learning rate (torch.optim.SGD's default since torch 2.0).");
const SGD_MOMENTUM: KeyDef = key("momentum", NONNEG, Dflt::Num(0.0), "Momentum factor.");
const SGD_DAMPENING: KeyDef = key("dampening", NONNEG, Dflt::Num(0.0), "Dampening for momentum.");
const SGD_WD: KeyDef = key("weight_decay", NONNEG, Dflt::Num(0.0), "L2 penalty added to the gradient (torch semantics).");
const SGD_NESTEROV: KeyDef = key("nesterov", Ty::Bool, Dflt::Bool(false), "Nesterov momentum; needs momentum > 0 and dampening = 0.");
/// Keys of `optimizer.params` for SGD.
pub const SGD_KEYS: &[KeyDef] = &[SGD_LR, SGD_MOMENTUM, SGD_DAMPENING, SGD_WD, SGD_NESTEROV, LAYER_DECAY];

/// Weight decay used when the config has no `optimizer` block.
pub const DEFAULT_WEIGHT_DECAY: f64 = 0.05;

/// The `optimizer` block (no block is vitscale's default AdamW) and its `layer_decay`.
pub(super) fn parse(block: Option<&Map<String, Value>>, cx: &mut Cx) -> Result<(OptimizerConfig, Option<f64>)> {
    let layer_decay = match block.map(|b| section(b.get(OPT_PARAMS.name), &full(OPTIMIZER.name, OPT_PARAMS.name))).transpose()?.flatten() {
        Some(params) => opt_num(Some(params), &full(OPTIMIZER.name, OPT_PARAMS.name), &LAYER_DECAY, cx)?,
        None => None,
    };
    Ok((parse_update(block, cx)?, layer_decay))
}

fn parse_update(block: Option<&Map<String, Value>>, cx: &mut Cx) -> Result<OptimizerConfig> {
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
    check_keys(OPTIMIZER.name, block, OPT_BLOCK_KEYS, &[])?;
    // No type: the block adjusts the default optimizer (what a config without an optimizer
    // block trains with), so `--set optimizer.params.lr=…` works on any config.
    let untyped = block.get(OPT_TYPE.name).is_none_or(Value::is_null);
    if untyped {
        cx.warn(format!(
            "optimizer.type not given: adjusting vitscale's default optimizer (AdamW, lr 1e-3, weight_decay {DEFAULT_WEIGHT_DECAY}) with optimizer.params"
        ));
    }
    let ty_v = block.get(OPT_TYPE.name).filter(|v| !v.is_null()).cloned().unwrap_or_else(|| Value::String("AdamW".into()));
    let ty = ty_v.as_str().ok_or_else(|| bad(OPTIMIZER.name, &OPT_TYPE, &ty_v))?;
    let path = &full(OPTIMIZER.name, OPT_PARAMS.name);
    let params = section(block.get(OPT_PARAMS.name), path)?;
    if params.is_some_and(|p| p.contains_key("max_grad_norm")) {
        // DeepSpeed raises here too rather than silently clipping twice.
        return Err(key_err(
            full(path, "max_grad_norm"),
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
                return Err(key_err(full(path, ADAM_BETAS.name), format!("each beta must be in [0, 1), got {betas:?}")));
            }
            let eps = get_num(params, path, &ADAM_EPS, cx)?;
            let adam_w_mode_given = get_bool(params, path, &ADAM_W_MODE, cx)?;
            let adam_w_mode = is_adamw || adam_w_mode_given;
            if is_adamw && !adam_w_mode_given {
                cx.warn("optimizer.params.adam_w_mode = false has no effect with type AdamW (DeepSpeed forces decoupled weight decay)".into());
            }
            let torch_adam = get_bool(params, path, &ADAM_TORCH, cx)?;
            if get_bool(params, path, &ADAM_AMSGRAD, cx)? {
                return Err(key_err(full(path, ADAM_AMSGRAD.name), "amsgrad is not supported; expected false"));
            }
            let bias_correction = get_bool(params, path, &ADAM_BIAS_CORR, cx)?;
            if torch_adam && !bias_correction {
                return Err(key_err(full(path, ADAM_BIAS_CORR.name), "torch.optim.Adam/AdamW (torch_adam=true) always bias-correct; expected true"));
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
                    full(path, SGD_NESTEROV.name),
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
            Err(key_err(full(OPTIMIZER.name, OPT_TYPE.name), format!("\"{ty}\" {why}; supported: {}", quoted(OPTIMIZER_TYPES))))
        }
    }
}

/// `{"type", "params"}` with every parameter the update uses (torch_adam and amsgrad are
/// folded into them) and the layer decay when there is one, so the file reads back to the same
/// optimizer.
pub(super) fn write(optimizer: &OptimizerConfig, layer_decay: Option<f64>) -> Value {
    let mut params = Map::new();
    let ty = match *optimizer {
        OptimizerConfig::Adam { lr, beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction } => {
            put(&mut params, &ADAM_LR, json!(lr));
            put(&mut params, &ADAM_BETAS, json!([beta1, beta2]));
            put(&mut params, &ADAM_EPS, json!(eps));
            put(&mut params, &ADAM_WD, json!(weight_decay));
            put(&mut params, &ADAM_W_MODE, json!(adam_w_mode));
            put(&mut params, &ADAM_BIAS_CORR, json!(bias_correction));
            if adam_w_mode { "AdamW" } else { "Adam" }
        }
        OptimizerConfig::Sgd { lr, momentum, dampening, weight_decay, nesterov } => {
            put(&mut params, &SGD_LR, json!(lr));
            put(&mut params, &SGD_MOMENTUM, json!(momentum));
            put(&mut params, &SGD_DAMPENING, json!(dampening));
            put(&mut params, &SGD_WD, json!(weight_decay));
            put(&mut params, &SGD_NESTEROV, json!(nesterov));
            "SGD"
        }
    };
    if let Some(ld) = layer_decay {
        put(&mut params, &LAYER_DECAY, json!(ld));
    }
    let mut block = Map::new();
    put(&mut block, &OPT_TYPE, json!(ty));
    put(&mut block, &OPT_PARAMS, Value::Object(params));
    Value::Object(block)
}
