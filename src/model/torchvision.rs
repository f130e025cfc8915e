//! torchvision's `VisionTransformer` weights (`torchvision.models.vit_b_16` and its siblings) as
//! a second file layout: its `state_dict` key names mapped to timm's and back.
//!
//! The two models compute the same function with tensors of the same shapes, so a file is read
//! or written by renaming its tensors only:
//! - `conv_proj` is timm's `patch_embed.proj` (a P×P stride-P conv whose output is flattened
//!   row-major into the patch sequence, as timm's `flatten(2)`);
//! - `class_token` is prepended before `encoder.pos_embedding` is added, position 0 being the
//!   class token's, as timm's `cls_token` / `pos_embed`;
//! - each `encoder.layers.encoder_layer_N` is a pre-norm block: `ln_1`, `nn.MultiheadAttention`
//!   whose `in_proj_weight` stacks q, k, v rows and splits each into heads of contiguous
//!   columns scaled by 1/√D (timm's `attn.qkv`), `out_proj` (`attn.proj`), `ln_2`, and an MLP
//!   of Linear (`mlp.0`, `mlp.linear_1` before torchvision 0.13), exact-erf GELU, Linear
//!   (`mlp.3`, `mlp.linear_2`);
//! - `encoder.ln` normalizes every token and the class token is taken: timm's `norm` with token
//!   pooling; `heads.head` is `head`.
//!
//! Both use LayerNorm eps 1e-6. torchvision's attention always has biases, so its files map to
//! `qkv_bias = true`, `class_token = true`, `global_pool = "token"`, 3 input channels. What
//! timm's ViT cannot express is refused: the `representation_size` layer (`heads.pre_logits`
//! with a tanh) and the convolutional stem (`conv_stem_configs`).

use std::collections::BTreeMap;

use super::spec::{GlobalPool, ModelConfig};

/// The key layout of a weights file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightsFormat {
    /// timm's `VisionTransformer` `state_dict` names (vitscale's own).
    #[default]
    Timm,
    /// torchvision's `VisionTransformer` `state_dict` names.
    Torchvision,
}

impl WeightsFormat {
    pub const NAMES: &'static [&'static str] = &["timm", "torchvision"];

    pub fn as_str(self) -> &'static str {
        match self {
            WeightsFormat::Timm => "timm",
            WeightsFormat::Torchvision => "torchvision",
        }
    }

    /// The name a file in this layout gives the tensor vitscale calls `timm_key`.
    pub fn file_key(self, timm_key: &str) -> String {
        match self {
            WeightsFormat::Timm => timm_key.to_string(),
            WeightsFormat::Torchvision => torchvision_key(timm_key).unwrap_or_else(|| timm_key.to_string()),
        }
    }
}

impl std::str::FromStr for WeightsFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "timm" => Ok(WeightsFormat::Timm),
            "torchvision" => Ok(WeightsFormat::Torchvision),
            _ => Err(format!("unknown weights format `{s}`; expected one of: {}", WeightsFormat::NAMES.join(", "))),
        }
    }
}

impl std::fmt::Display for WeightsFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a (prefix-stripped) key belongs to torchvision's layout.
fn is_torchvision(key: &str) -> bool {
    key == "class_token" || ["conv_proj.", "encoder.", "heads."].iter().any(|p| key.starts_with(p))
}

/// Whether a key belongs to timm's layout.
fn is_timm(key: &str) -> bool {
    matches!(key, "cls_token" | "pos_embed" | "reg_token") || ["patch_embed.", "blocks.", "norm.", "fc_norm.", "head."].iter().any(|p| key.starts_with(p))
}

/// Per-block torchvision names (after `encoder.layers.encoder_layer_N.`) and timm's (after
/// `blocks.N.`); the first torchvision name of a pair is the one written.
const BLOCK_KEYS: &[(&str, &str)] = &[
    ("ln_1.weight", "norm1.weight"),
    ("ln_1.bias", "norm1.bias"),
    ("self_attention.in_proj_weight", "attn.qkv.weight"),
    ("self_attention.in_proj_bias", "attn.qkv.bias"),
    ("self_attention.out_proj.weight", "attn.proj.weight"),
    ("self_attention.out_proj.bias", "attn.proj.bias"),
    ("ln_2.weight", "norm2.weight"),
    ("ln_2.bias", "norm2.bias"),
    ("mlp.0.weight", "mlp.fc1.weight"),
    ("mlp.0.bias", "mlp.fc1.bias"),
    ("mlp.3.weight", "mlp.fc2.weight"),
    ("mlp.3.bias", "mlp.fc2.bias"),
    // torchvision before 0.13 (its `MLPBlock` version 1)
    ("mlp.linear_1.weight", "mlp.fc1.weight"),
    ("mlp.linear_1.bias", "mlp.fc1.bias"),
    ("mlp.linear_2.weight", "mlp.fc2.weight"),
    ("mlp.linear_2.bias", "mlp.fc2.bias"),
];

const TOP_KEYS: &[(&str, &str)] = &[
    ("class_token", "cls_token"),
    ("encoder.pos_embedding", "pos_embed"),
    ("conv_proj.weight", "patch_embed.proj.weight"),
    ("conv_proj.bias", "patch_embed.proj.bias"),
    ("encoder.ln.weight", "norm.weight"),
    ("encoder.ln.bias", "norm.bias"),
    ("heads.head.weight", "head.weight"),
    ("heads.head.bias", "head.bias"),
];

const LAYER_PREFIX: &str = "encoder.layers.encoder_layer_";

/// timm's name of a torchvision key; `Err` says why the key has none.
fn timm_key(key: &str) -> Result<String, String> {
    if let Some((_, t)) = TOP_KEYS.iter().find(|(tv, _)| *tv == key) {
        return Ok(t.to_string());
    }
    if key.starts_with("heads.pre_logits.") {
        return Err(format!(
            "`{key}`: this torchvision ViT was built with `representation_size` (a Linear + tanh layer before the head), which timm's ViT and vitscale do not have"
        ));
    }
    if key.starts_with("conv_proj.") {
        return Err(format!("`{key}`: this torchvision ViT has a convolutional stem (`conv_stem_configs`), which timm's ViT and vitscale do not have"));
    }
    if let Some(rest) = key.strip_prefix(LAYER_PREFIX) {
        if let Some((n, sub)) = rest.split_once('.') {
            if let (Ok(i), Some((_, t))) = (n.parse::<usize>(), BLOCK_KEYS.iter().find(|(tv, _)| *tv == sub)) {
                if i.to_string() == n {
                    return Ok(format!("blocks.{i}.{t}"));
                }
            }
        }
    }
    Err(format!("`{key}` is no tensor of torchvision's VisionTransformer"))
}

/// torchvision's name (as current torchvision writes it) of a timm key.
fn torchvision_key(key: &str) -> Option<String> {
    if let Some((tv, _)) = TOP_KEYS.iter().find(|(_, t)| *t == key) {
        return Some(tv.to_string());
    }
    let rest = key.strip_prefix("blocks.")?;
    let (n, sub) = rest.split_once('.')?;
    let i: usize = n.parse().ok()?;
    BLOCK_KEYS.iter().find(|(_, t)| *t == sub).map(|(tv, _)| format!("{LAYER_PREFIX}{i}.{tv}"))
}

/// Detects a file's layout from its (prefix-stripped) keys and, for torchvision's, renames them
/// to timm's. `keys` maps the stripped key to the stored name; so does the result. A file with
/// keys of both layouts, or torchvision keys timm's ViT has no place for, is refused.
pub fn to_timm_keys(keys: BTreeMap<String, String>) -> Result<(BTreeMap<String, String>, WeightsFormat), String> {
    let tv: Vec<&str> = keys.keys().map(String::as_str).filter(|k| is_torchvision(k)).collect();
    if tv.is_empty() {
        return Ok((keys, WeightsFormat::Timm));
    }
    let timm: Vec<&str> = keys.keys().map(String::as_str).filter(|k| is_timm(k)).collect();
    if !timm.is_empty() {
        return Err(format!(
            "holds keys of both timm's layout ({}) and torchvision's ({}): one file must use one of them",
            sample(&timm),
            sample(&tv)
        ));
    }
    let mut out = BTreeMap::new();
    let mut bad = Vec::new();
    for (key, stored) in keys {
        match timm_key(&key) {
            Ok(t) => {
                // `mlp.0` and `mlp.linear_1` of one block would both become `mlp.fc1`
                if let Some(other) = out.insert(t.clone(), stored.clone()) {
                    return Err(format!("`{other}` and `{stored}` are the same tensor ({t}) under torchvision's new and old names: keep one"));
                }
            }
            Err(msg) => bad.push(msg),
        }
    }
    if !bad.is_empty() {
        return Err(format!("torchvision ViT weights (found `encoder.*`/`conv_proj.*` keys) that cannot be loaded: {}", bad.join("; ")));
    }
    Ok((out, WeightsFormat::Torchvision))
}

fn sample(keys: &[&str]) -> String {
    let shown: Vec<String> = keys.iter().take(3).map(|k| format!("`{k}`")).collect();
    if keys.len() > 3 {
        format!("{}, … {} in all", shown.join(", "), keys.len())
    } else {
        shown.join(", ")
    }
}

/// Whether `m` can be written in torchvision's layout; the error names the `model.*` key that
/// torchvision's `VisionTransformer` cannot take.
pub fn check_exportable(m: &ModelConfig) -> Result<(), String> {
    let why = if !m.class_token {
        "model.class_token=false (torchvision's ViT always has a class token)"
    } else if m.global_pool != GlobalPool::Token {
        "model.global_pool=\"avg\" (torchvision's ViT classifies from the class token)"
    } else if !m.qkv_bias {
        "model.qkv_bias=false (torchvision's attention always has biases)"
    } else if m.in_chans != 3 {
        "model.in_chans other than 3 (torchvision's patch convolution takes 3 channels)"
    } else {
        return Ok(());
    };
    Err(format!("torchvision's VisionTransformer cannot hold this model: {why}; write it in timm's layout instead"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ParamTable;

    fn stripped(keys: &[&str]) -> BTreeMap<String, String> {
        keys.iter().map(|k| (k.to_string(), format!("module.{k}"))).collect()
    }

    /// Every timm key of a model torchvision can hold has a torchvision name, and that name
    /// reads back as the same timm key; the old MLP names read as the new ones.
    #[test]
    fn names_round_trip() {
        let m = ModelConfig { depth: 12, ..ModelConfig::preset("vit_tiny_patch16_224").unwrap() };
        check_exportable(&m).unwrap();
        for e in &ParamTable::new(&m).entries {
            let tv = WeightsFormat::Torchvision.file_key(&e.name);
            assert_ne!(tv, e.name, "{} has no torchvision name", e.name);
            assert_eq!(timm_key(&tv).unwrap(), e.name, "{tv}");
        }
        assert_eq!(WeightsFormat::Torchvision.file_key("blocks.11.mlp.fc2.bias"), "encoder.layers.encoder_layer_11.mlp.3.bias");
        assert_eq!(timm_key("encoder.layers.encoder_layer_3.mlp.linear_1.weight").unwrap(), "blocks.3.mlp.fc1.weight");
        assert_eq!(timm_key("encoder.layers.encoder_layer_3.mlp.linear_2.bias").unwrap(), "blocks.3.mlp.fc2.bias");
        assert!(timm_key("encoder.layers.encoder_layer_03.ln_1.weight").is_err());
    }

    #[test]
    fn timm_files_are_left_alone() {
        let keys = stripped(&["cls_token", "pos_embed", "blocks.0.norm1.weight", "head.weight"]);
        let (out, f) = to_timm_keys(keys.clone()).unwrap();
        assert_eq!((out, f), (keys, WeightsFormat::Timm));
    }

    #[test]
    fn torchvision_keys_are_renamed_and_keep_their_stored_names() {
        let (out, f) = to_timm_keys(stripped(&["class_token", "encoder.pos_embedding", "encoder.layers.encoder_layer_0.mlp.0.weight", "heads.head.bias"])).unwrap();
        assert_eq!(f, WeightsFormat::Torchvision);
        assert_eq!(out.get("blocks.0.mlp.fc1.weight").map(String::as_str), Some("module.encoder.layers.encoder_layer_0.mlp.0.weight"));
        assert_eq!(out.get("cls_token").map(String::as_str), Some("module.class_token"));
        assert_eq!(out.len(), 4);
    }

    #[test]
    fn what_timm_cannot_hold_is_refused_by_name() {
        let err = to_timm_keys(stripped(&["class_token", "heads.pre_logits.weight", "heads.pre_logits.bias", "heads.head.weight"])).unwrap_err();
        assert!(err.contains("heads.pre_logits.weight") && err.contains("representation_size"), "{err}");
        let err = to_timm_keys(stripped(&["class_token", "conv_proj.conv_last.weight"])).unwrap_err();
        assert!(err.contains("conv_proj.conv_last.weight") && err.contains("conv_stem_configs"), "{err}");
        let err = to_timm_keys(stripped(&["class_token", "encoder.layers.encoder_layer_0.ln_3.weight"])).unwrap_err();
        assert!(err.contains("ln_3"), "{err}");
        let err = to_timm_keys(stripped(&["class_token", "encoder.ln.weight", "blocks.0.norm1.weight"])).unwrap_err();
        assert!(err.contains("both") && err.contains("blocks.0.norm1.weight") && err.contains("class_token"), "{err}");
        let err = to_timm_keys(stripped(&["class_token", "encoder.layers.encoder_layer_0.mlp.0.weight", "encoder.layers.encoder_layer_0.mlp.linear_1.weight"])).unwrap_err();
        assert!(err.contains("mlp.linear_1.weight") && err.contains("mlp.0.weight"), "{err}");
    }

    #[test]
    fn only_torchvision_shaped_models_export() {
        let base = ModelConfig::preset("vit_tiny_patch4_32").unwrap();
        check_exportable(&base).unwrap();
        let avg = ModelConfig { global_pool: GlobalPool::Avg, ..base.clone() };
        assert!(check_exportable(&avg).unwrap_err().contains("model.global_pool"));
        let no_bias = ModelConfig { qkv_bias: false, ..base.clone() };
        assert!(check_exportable(&no_bias).unwrap_err().contains("model.qkv_bias"));
        let no_cls = ModelConfig { class_token: false, global_pool: GlobalPool::Avg, ..base };
        assert!(check_exportable(&no_cls).unwrap_err().contains("model.class_token"));
    }

    #[test]
    fn format_names() {
        assert_eq!("torchvision".parse::<WeightsFormat>(), Ok(WeightsFormat::Torchvision));
        assert!("tv".parse::<WeightsFormat>().unwrap_err().contains("timm, torchvision"));
    }
}
