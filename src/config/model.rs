//! The `model` section (vitscale's own): a timm ViT preset, chosen from the dataset when not
//! given, with any of its fields overridden; the class count follows the dataset.

use serde_json::{json, Map, Value};

use super::key_def::*;
use super::types::{DataConfig, DatasetKind, LabelKind};
use super::value::*;
use crate::model::spec::{GlobalPool, ModelConfig, PRESET_NAMES};

pub(super) const MODEL: KeyDef = key("model", Ty::Section, Dflt::Derived("preset chosen from the dataset"), "The ViT: a timm preset and/or fields.");

pub(super) const M_PRESET: KeyDef = key("preset", Ty::Choice(PRESET_NAMES),
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
const M_DROP_PATH: KeyDef = key("drop_path_rate", Ty::Num { lo: 0.0, hi: 1.0, lo_open: false, hi_open: true }, Dflt::Num(0.0),
    "Stochastic depth as timm's: in training each block's attention and MLP branch is dropped per image with a probability rising linearly from 0 (first block) to this value (last block); kept branches are scaled by 1/keep. DeiT uses 0.1. Not part of the architecture: weight files do not record it.");
/// Keys of the `model` section.
pub const MODEL_KEYS: &[KeyDef] = &[M_PRESET, M_IMAGE, M_PATCH, M_CHANS, M_WIDTH, M_DEPTH, M_HEADS, M_MLP, M_CLASSES, M_QKV_BIAS, M_CLS, M_POOL, M_DROP_PATH];

/// The `model.drop_path_rate` given in the section (0 when absent).
pub(super) fn parse_drop_path(sec: Option<&Map<String, Value>>, cx: &mut Cx) -> Result<f64> {
    Ok(opt_num(sec, MODEL.name, &M_DROP_PATH, cx)?.unwrap_or(0.0))
}

/// The `model` section applied over its preset; the class count must be the dataset's.
pub(super) fn parse(sec: Option<&Map<String, Value>>, data: &DataConfig, cx: &mut Cx) -> Result<ModelConfig> {
    let p = MODEL.name;
    let dataset = data.dataset;
    if let Some(s) = sec {
        check_keys(p, s, MODEL_KEYS, &[])?;
    }
    let preset_name = match opt_str(sec, p, &M_PRESET, cx)? {
        Some(n) => n,
        None => match dataset {
            DatasetKind::Cifar10 | DatasetKind::Cifar100 => "vit_tiny_patch4_32",
            DatasetKind::Builtin | DatasetKind::Synthetic => crate::model::spec::DEFAULT_PRESET,
            DatasetKind::Folder | DatasetKind::Shards => "vit_tiny_patch16_224",
        },
    };
    let mut m = ModelConfig::preset(preset_name)
        .ok_or_else(|| key_err(full(p, M_PRESET.name), format!("unknown preset \"{preset_name}\"; expected one of {}", quoted(PRESET_NAMES))))?;
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
                full(p, M_CLASSES.name),
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

/// Every field of the model that was built, so the file does not depend on the preset's
/// definition (the preset itself is not written), and the training-only `drop_path_rate`.
pub(super) fn write(m: &ModelConfig, drop_path_rate: f64) -> Value {
    let mut out = Map::new();
    put(&mut out, &M_IMAGE, json!(m.image_size));
    put(&mut out, &M_PATCH, json!(m.patch_size));
    put(&mut out, &M_CHANS, json!(m.in_chans));
    put(&mut out, &M_WIDTH, json!(m.embed_dim));
    put(&mut out, &M_DEPTH, json!(m.depth));
    put(&mut out, &M_HEADS, json!(m.num_heads));
    put(&mut out, &M_MLP, json!(m.mlp_ratio));
    put(&mut out, &M_CLASSES, json!(m.num_classes));
    put(&mut out, &M_QKV_BIAS, json!(m.qkv_bias));
    put(&mut out, &M_CLS, json!(m.class_token));
    put(&mut out, &M_POOL, json!(m.global_pool.as_str()));
    put(&mut out, &M_DROP_PATH, json!(drop_path_rate));
    Value::Object(out)
}
