//! timm-compatible weights: safetensors files with timm `state_dict` key names, read into and
//! written from the flat parameter buffer, plus inference of the architecture from a file's
//! shapes (so `--init` of an unseen timm model needs at most `model.num_heads`). Files in
//! torchvision's layout are read and written too, renamed by [`super::torchvision`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

use super::params::ParamTable;
use super::spec::ModelConfig;
pub use super::torchvision::WeightsFormat;

#[derive(Debug, thiserror::Error)]
pub enum WeightsError {
    #[error("cannot read weights file {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a valid safetensors file: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error("{path}: tensor `{key}` {msg}")]
    Tensor { path: PathBuf, key: String, msg: String },
    #[error("{path}: missing tensors for this model: {keys}")]
    Missing { path: PathBuf, keys: String },
    #[error("{path}: tensors this model does not have: {keys} (is the `model` config right?)")]
    Unexpected { path: PathBuf, keys: String },
    #[error("{path}: cannot infer the architecture: {msg}")]
    Infer { path: PathBuf, msg: String },
    #[error("{path}: {msg}")]
    Layout { path: PathBuf, msg: String },
}

/// Prefixes that wrappers put before timm keys (DDP `module.`, timm checkpoints' `model.`).
const STRIP_PREFIXES: &[&str] = &["module.", "model."];

fn read_file(path: &Path) -> Result<Vec<u8>, WeightsError> {
    std::fs::read(path).map_err(|source| WeightsError::Io { path: path.to_path_buf(), source })
}

fn parse<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>, WeightsError> {
    SafeTensors::deserialize(bytes).map_err(|e| WeightsError::Format { path: path.to_path_buf(), msg: e.to_string() })
}

/// The tensor names of a file with wrapper prefixes removed (and torchvision's names renamed to
/// timm's), mapped to the stored names, and the file's layout.
fn key_map(path: &Path, st: &SafeTensors<'_>) -> Result<(BTreeMap<String, String>, WeightsFormat), WeightsError> {
    let stripped = st
        .names()
        .into_iter()
        .map(|name| {
            let mut key = name.as_str();
            for p in STRIP_PREFIXES {
                if let Some(rest) = key.strip_prefix(p) {
                    key = rest;
                }
            }
            (key.to_string(), name.clone())
        })
        .collect();
    super::torchvision::to_timm_keys(stripped).map_err(|msg| WeightsError::Layout { path: path.to_path_buf(), msg })
}

/// Converts a stored tensor (f32, f16, bf16, f64) to f32.
pub fn to_f32(path: &Path, key: &str, view: &TensorView<'_>) -> Result<Vec<f32>, WeightsError> {
    let data = view.data();
    let bad = |msg: String| WeightsError::Tensor { path: path.to_path_buf(), key: key.to_string(), msg };
    let out = match view.dtype() {
        Dtype::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::F16 => data.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::BF16 => data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::F64 => data
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32)
            .collect(),
        other => return Err(bad(format!("has dtype {other:?}; expected F32, F16, BF16 or F64"))),
    };
    Ok(out)
}

/// Loads a timm weights file into a flat host vector laid out by `table`. Every table key must
/// be present with its exact shape, and no other key may be (timm's `strict=True`).
pub fn load(path: &Path, table: &ParamTable) -> Result<Vec<f32>, WeightsError> {
    load_impl(path, table, None).map(|(params, _)| params)
}

/// A classifier head that `load_for_fine_tuning` left at its fresh initialization: the file's
/// class count and the model's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NewHead {
    pub file_classes: usize,
    pub model_classes: usize,
}

/// `load` for starting a training run from pretrained weights, as timm's `create_model(...,
/// num_classes=K)` does: when the file's classifier head has another class count than the
/// model (and the same width), `head.weight` and `head.bias` take their values from `fresh()`
/// (the run's initialization, made only then) and the rest is loaded. Every other difference
/// is an error.
pub fn load_for_fine_tuning(path: &Path, table: &ParamTable, fresh: impl FnOnce() -> Vec<f32>) -> Result<(Vec<f32>, Option<NewHead>), WeightsError> {
    load_impl(path, table, Some(Box::new(fresh)))
}

/// Whether `entry` is a classifier-head tensor whose stored shape differs from the model's in
/// its class count only.
fn other_class_count(entry: &crate::model::params::ParamEntry, stored: &[usize]) -> bool {
    matches!(entry.name.as_str(), "head.weight" | "head.bias") && stored.len() == entry.shape.len() && stored[1..] == entry.shape[1..] && stored[0] != entry.shape[0]
}

fn load_impl(path: &Path, table: &ParamTable, mut fresh: Option<Box<dyn FnOnce() -> Vec<f32> + '_>>) -> Result<(Vec<f32>, Option<NewHead>), WeightsError> {
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let (keys, format) = key_map(path, &st)?;
    let mut out = vec![0.0f32; table.total];
    let mut missing = Vec::new();
    let mut new_head = None;
    let fine_tuning = fresh.is_some();
    let mut fresh_values: Option<Vec<f32>> = None;
    for e in &table.entries {
        let Some(stored) = keys.get(&e.name) else {
            missing.push(format.file_key(&e.name));
            continue;
        };
        let view = st.tensor(stored).map_err(|err| WeightsError::Format { path: path.to_path_buf(), msg: err.to_string() })?;
        if fine_tuning && other_class_count(e, view.shape()) {
            let values = fresh_values.get_or_insert_with(|| fresh.take().map_or_else(Vec::new, |f| f()));
            out[e.span.range()].copy_from_slice(&values[e.span.range()]);
            new_head = Some(NewHead { file_classes: view.shape()[0], model_classes: e.shape[0] });
            continue;
        }
        if view.shape() != e.shape.as_slice() {
            return Err(WeightsError::Tensor {
                path: path.to_path_buf(),
                key: e.name.clone(),
                msg: format!("has shape {:?}; the configured model needs {:?}", view.shape(), e.shape),
            });
        }
        let values = to_f32(path, &e.name, &view)?;
        // a NaN or an infinity would evaluate to a loss of NaN and a chance top-1, not an error
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(WeightsError::Tensor { path: path.to_path_buf(), key: e.name.clone(), msg: format!("holds a non-finite value ({} at element {i}): these weights are damaged", values[i]) });
        }
        out[e.span.range()].copy_from_slice(&values);
    }
    if !missing.is_empty() {
        return Err(WeightsError::Missing { path: path.to_path_buf(), keys: missing.join(", ") });
    }
    let unexpected: Vec<&str> = keys.keys().filter(|k| table.get(k).is_none()).map(String::as_str).collect();
    if !unexpected.is_empty() {
        return Err(WeightsError::Unexpected { path: path.to_path_buf(), keys: unexpected.join(", ") });
    }
    Ok((out, new_head))
}

/// Writes the flat weights as an f32 safetensors file with timm keys, atomically (temporary
/// file, fsync, rename), with the model config as metadata.
pub fn save(path: &Path, table: &ParamTable, cfg: &ModelConfig, params: &[f32]) -> Result<(), WeightsError> {
    save_as(path, table, cfg, params, WeightsFormat::Timm)
}

/// `save` with the key names of `format`; torchvision's layout refuses a model its
/// `VisionTransformer` cannot hold.
pub fn save_as(path: &Path, table: &ParamTable, cfg: &ModelConfig, params: &[f32], format: WeightsFormat) -> Result<(), WeightsError> {
    let io = |source| WeightsError::Io { path: path.to_path_buf(), source };
    if format == WeightsFormat::Torchvision {
        super::torchvision::check_exportable(cfg).map_err(|msg| WeightsError::Layout { path: path.to_path_buf(), msg })?;
    }
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = table
        .entries
        .iter()
        .map(|e| (format.file_key(&e.name), e.shape.clone(), bytemuck::cast_slice(&params[e.span.range()]).to_vec()))
        .collect();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(name, shape, data)| {
            TensorView::new(Dtype::F32, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| WeightsError::Format { path: path.to_path_buf(), msg: e.to_string() })
        })
        .collect::<Result<_, _>>()?;
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let (k, v) = model_metadata(cfg);
    meta.insert(k.to_string(), v);
    let bytes = safetensors::serialize(views, &Some(meta))
        .map_err(|e| WeightsError::Format { path: path.to_path_buf(), msg: e.to_string() })?;
    crate::util::write_atomic(path, &bytes).map_err(io)
}

/// Safetensors metadata key holding the model config of a file vitscale wrote.
pub const MODEL_METADATA_KEY: &str = "vitscale_model";

/// The (key, value) metadata entry that records `cfg` in a weights file: every weights file
/// vitscale writes (`--save-weights`, checkpoints) carries it, so `eval --weights` and
/// `--init` rebuild the exact model (its head count cannot be read off the shapes).
pub fn model_metadata(cfg: &ModelConfig) -> (&'static str, String) {
    (MODEL_METADATA_KEY, serde_json::to_string(cfg).unwrap_or_default())
}

/// Architecture fields read off a timm weights file's shapes. `num_heads` cannot be read from
/// shapes: a file vitscale wrote carries it in its `vitscale_model` metadata (`num_heads`);
/// otherwise it is guessed by [`guess_num_heads`], else left to the user.
#[derive(Clone, Debug, PartialEq)]
pub struct InferredModel {
    pub fields: serde_json::Map<String, serde_json::Value>,
    /// The head count recorded by vitscale when it saved the file.
    pub num_heads: Option<usize>,
    pub guessed_num_heads: Option<usize>,
}

/// A head count for a width whose file does not record one: ViT-H/14 (timm's and
/// torchvision's) has 16 heads of width 80; the other standard ViTs have heads of width 64.
pub fn guess_num_heads(width: usize) -> Option<usize> {
    match width {
        1280 => Some(16),
        _ => width.is_multiple_of(64).then_some(width / 64),
    }
}

pub fn infer(path: &Path) -> Result<InferredModel, WeightsError> {
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let (keys, _) = key_map(path, &st)?;
    let fail = |msg: String| WeightsError::Infer { path: path.to_path_buf(), msg };
    let shape = |key: &str| -> Result<Vec<usize>, WeightsError> {
        let stored = keys.get(key).ok_or_else(|| fail(format!("no `{key}` tensor")))?;
        st.tensor(stored).map(|v| v.shape().to_vec()).map_err(|e| fail(e.to_string()))
    };
    let pw = shape("patch_embed.proj.weight")?;
    if pw.len() != 4 || pw[2] != pw[3] {
        return Err(fail(format!("patch_embed.proj.weight has shape {pw:?}; expected [C, 3, P, P]")));
    }
    let (c, in_chans, p) = (pw[0], pw[1], pw[2]);
    let class_token = keys.contains_key("cls_token");
    let pos = shape("pos_embed")?;
    let n = *pos.get(1).ok_or_else(|| fail(format!("pos_embed has shape {pos:?}")))?;
    let np = n.checked_sub(usize::from(class_token)).ok_or_else(|| fail("pos_embed has no patch positions".into()))?;
    let grid = (np as f64).sqrt().round() as usize;
    if grid * grid != np {
        return Err(fail(format!("pos_embed holds {np} patch positions, not a square grid")));
    }
    let depth = (0..).take_while(|i| keys.contains_key(&format!("blocks.{i}.norm1.weight"))).count();
    if depth == 0 {
        return Err(fail("no `blocks.0.*` tensors".into()));
    }
    let fc1 = shape("blocks.0.mlp.fc1.weight")?;
    let head = shape("head.weight")?;
    let global_pool = if keys.contains_key("fc_norm.weight") { "avg" } else { "token" };
    let mut fields = serde_json::Map::new();
    fields.insert("image_size".into(), (grid * p).into());
    fields.insert("patch_size".into(), p.into());
    fields.insert("in_chans".into(), in_chans.into());
    fields.insert("embed_dim".into(), c.into());
    fields.insert("depth".into(), depth.into());
    fields.insert("mlp_ratio".into(), (fc1[0] as f64 / c as f64).into());
    fields.insert("num_classes".into(), head[0].into());
    fields.insert("qkv_bias".into(), keys.contains_key("blocks.0.attn.qkv.bias").into());
    fields.insert("class_token".into(), class_token.into());
    fields.insert("global_pool".into(), global_pool.into());
    let guessed_num_heads = guess_num_heads(c);
    // A head count from the metadata counts only if the rest of that record agrees with the
    // shapes (a file edited by other tools keeps stale metadata).
    let num_heads = SafeTensors::read_metadata(&bytes)
        .ok()
        .and_then(|(_, m)| m.metadata().as_ref().and_then(|m| m.get(MODEL_METADATA_KEY).cloned()))
        .and_then(|json| serde_json::from_str::<serde_json::Value>(&json).ok())
        .filter(|saved| saved.get("embed_dim").and_then(|v| v.as_u64()) == Some(c as u64) && saved.get("depth").and_then(|v| v.as_u64()) == Some(depth as u64))
        .and_then(|saved| saved.get("num_heads").and_then(|v| v.as_u64()))
        .map(|h| h as usize)
        .filter(|&h| h > 0 && c % h == 0);
    Ok(InferredModel { fields, num_heads, guessed_num_heads })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;

    fn model(classes: usize) -> ModelConfig {
        ModelConfig { num_classes: classes, ..ModelConfig::preset("vit_tiny_patch4_32").expect("preset") }
    }

    /// Fine-tuning keeps the fresh head when the class count differs and loads every other
    /// tensor from the file; evaluation (`load`) refuses the same file, and a file with the
    /// same class count loads whole either way.
    #[test]
    fn a_head_of_another_class_count_stays_fresh_for_fine_tuning_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w10.safetensors");
        let (m10, m3) = (model(10), model(3));
        let (t10, t3) = (ParamTable::new(&m10), ParamTable::new(&m3));
        let mut rng = crate::data::rng::SplitMix::new(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64));
        let stored: Vec<f32> = (0..t10.total).map(|_| rng.f32() - 0.5).collect();
        save(&path, &t10, &m10, &stored).expect("save");
        // a fresh init the file's values cannot be mistaken for
        let fresh: Vec<f32> = (0..t3.total).map(|i| 10.0 + i as f32).collect();
        let (got, head) = load_for_fine_tuning(&path, &t3, || fresh.clone()).expect("fine-tune load");
        assert_eq!(head, Some(NewHead { file_classes: 10, model_classes: 3 }));
        for e in &t3.entries {
            let want: &[f32] = if e.name.starts_with("head.") { &fresh[e.span.range()] } else { &stored[t10.get(&e.name).expect("entry").span.range()] };
            assert_eq!(&got[e.span.range()], want, "{}", e.name);
        }
        let err = load(&path, &t3).expect_err("evaluation must refuse another head").to_string();
        assert!(err.contains("head.weight") && err.contains("[10, 192]"), "{err}");
        let (same, none) = load_for_fine_tuning(&path, &t10, || panic!("a matching head needs no fresh init")).expect("same class count");
        assert_eq!((same, none), (stored, None));
        // another width is no fine-tuning case: refused, naming the tensor
        let wide = ModelConfig { embed_dim: 256, num_heads: 4, ..model(3) };
        let tw = ParamTable::new(&wide);
        let err = load_for_fine_tuning(&path, &tw, || vec![0.0; tw.total]).expect_err("another width").to_string();
        assert!(err.contains("has shape"), "{err}");
    }
}
