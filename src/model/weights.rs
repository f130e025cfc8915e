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

/// A position embedding that `load_for_fine_tuning` resampled from the file's patch grid
/// (patches per side) to the model's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResampledGrid {
    pub from: usize,
    pub to: usize,
}

/// What `load_for_fine_tuning` changed on the way from the file to the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FineTuneChanges {
    pub new_head: Option<NewHead>,
    pub pos_embed: Option<ResampledGrid>,
}

/// `load` for starting a training run from pretrained weights, as timm's `create_model(...,
/// num_classes=K, img_size=S)` does:
/// - when the file's classifier head has another class count than the model (and the same
///   width), `head.weight` and `head.bias` take their values from `fresh()` (the run's
///   initialization, made only then);
/// - when the file's position embedding covers another patch grid than the model's (another
///   image size at the same patch size), it is resampled to the model's grid as timm's
///   `resample_abs_pos_embed` does (bicubic, antialiased; the class token's row kept).
///
/// The rest is loaded. Every other difference is an error, a patch size other than the
/// model's included (timm resamples patch-embedding weights only when asked).
pub fn load_for_fine_tuning(path: &Path, table: &ParamTable, fresh: impl FnOnce() -> Vec<f32>) -> Result<(Vec<f32>, FineTuneChanges), WeightsError> {
    load_impl(path, table, Some(Box::new(fresh)))
}

/// Whether `entry` is a classifier-head tensor whose stored shape differs from the model's in
/// its class count only.
fn other_class_count(entry: &crate::model::params::ParamEntry, stored: &[usize]) -> bool {
    matches!(entry.name.as_str(), "head.weight" | "head.bias") && stored.len() == entry.shape.len() && stored[1..] == entry.shape[1..] && stored[0] != entry.shape[0]
}

/// Side of a square number of patch positions, if it is one (and not empty).
fn square_side(positions: usize) -> Option<usize> {
    let side = (positions as f64).sqrt().round() as usize;
    (side > 0 && side * side == positions).then_some(side)
}

/// The patch size a `patch_embed.proj.weight` of shape [C, in_chans, P, P] stands for.
fn patch_side(shape: &[usize]) -> Option<usize> {
    (shape.len() == 4 && shape[2] == shape[3]).then_some(shape[2])
}

fn load_impl(path: &Path, table: &ParamTable, mut fresh: Option<Box<dyn FnOnce() -> Vec<f32> + '_>>) -> Result<(Vec<f32>, FineTuneChanges), WeightsError> {
    let bytes = read_file(path)?;
    let st = parse(path, &bytes)?;
    let (keys, format) = key_map(path, &st)?;
    let mut out = vec![0.0f32; table.total];
    let mut missing = Vec::new();
    let mut changes = FineTuneChanges::default();
    let fine_tuning = fresh.is_some();
    let mut fresh_values: Option<Vec<f32>> = None;
    let tensor_err = |key: &str, msg: String| WeightsError::Tensor { path: path.to_path_buf(), key: key.to_string(), msg };
    // Another patch size alone (same width and channels) changes both the patch embedding and
    // the grid: refused before either is reported as a bare shape mismatch. A file of another
    // width is another model, left to the shape check.
    if let (Some(e), Some(stored)) = (table.get("patch_embed.proj.weight"), keys.get("patch_embed.proj.weight")) {
        let view = st.tensor(stored).map_err(|err| WeightsError::Format { path: path.to_path_buf(), msg: err.to_string() })?;
        if let (Some(file_p), Some(model_p)) = (patch_side(view.shape()), patch_side(&e.shape)) {
            if file_p != model_p && view.shape()[..2] == e.shape[..2] {
                return Err(tensor_err(
                    "patch_embed.proj.weight",
                    format!("is for {file_p}×{file_p} patches and this model's model.patch_size is {model_p}: vitscale does not resample patch-embedding weights (timm does only when asked); use model.patch_size={file_p}"),
                ));
            }
        }
    }
    let prefix = usize::from(table.get("cls_token").is_some());
    let file_prefix = usize::from(keys.contains_key("cls_token"));
    for e in &table.entries {
        let Some(stored) = keys.get(&e.name) else {
            missing.push(format.file_key(&e.name));
            continue;
        };
        let view = st.tensor(stored).map_err(|err| WeightsError::Format { path: path.to_path_buf(), msg: err.to_string() })?;
        if fine_tuning && other_class_count(e, view.shape()) {
            let values = fresh_values.get_or_insert_with(|| fresh.take().map_or_else(Vec::new, |f| f()));
            out[e.span.range()].copy_from_slice(&values[e.span.range()]);
            changes.new_head = Some(NewHead { file_classes: view.shape()[0], model_classes: e.shape[0] });
            continue;
        }
        // a position embedding for another patch grid of the same width and prefix tokens
        let grids = match (e.name.as_str(), view.shape()) {
            ("pos_embed", [1, n, c]) if view.shape() != e.shape.as_slice() && *c == e.shape[2] && prefix == file_prefix => {
                square_side(n.saturating_sub(prefix)).zip(square_side(e.shape[1].saturating_sub(prefix)))
            }
            _ => None,
        };
        if let Some((from, to)) = grids {
            if !fine_tuning {
                let p = table.get("patch_embed.proj.weight").and_then(|p| patch_side(&p.shape)).unwrap_or(0);
                return Err(tensor_err(
                    "pos_embed",
                    format!("is for a {from}×{from} patch grid ({} px) and this model's is {to}×{to} (model.image_size {}): weights load here as they are, so use model.image_size={}; `train --init` resamples it to the run's grid as timm does", from * p, to * p, from * p),
                ));
            }
            let values = to_f32(path, &e.name, &view)?;
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Err(tensor_err(&e.name, format!("holds a non-finite value ({} at element {i}): these weights are damaged", values[i])));
            }
            let resampled = super::resample::resample_pos_embed(&values, e.shape[2], prefix, (from, from), (to, to), super::resample::TIMM_ANTIALIAS)
                .map_err(|msg| tensor_err(&e.name, msg))?;
            out[e.span.range()].copy_from_slice(&resampled);
            changes.pos_embed = Some(ResampledGrid { from, to });
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
    Ok((out, changes))
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

/// Widths at which every timm `VisionTransformer` (timm 1.0.31's registry) has 16 heads that
/// are not 64 wide: SigLIP So400m (1152, head 72), ViT-H/14 (1280, 80), ViT-g/14 (1408, 88),
/// ViT-G/14 (1664, 104). `width / 64` would guess 18, 20, 22 and 26 heads: the same shapes, so
/// the weights would load, and another model.
const TIMM_16_HEAD_WIDTHS: [usize; 4] = [1152, 1280, 1408, 1664];

/// The head count timm's ViTs have at width `c`: 16 at the widths above, else `c / 64` when
/// 64 divides `c`.
fn guess_num_heads(c: usize) -> Option<usize> {
    if TIMM_16_HEAD_WIDTHS.contains(&c) {
        return Some(16);
    }
    (c % 64 == 0).then_some(c / 64)
}

/// Architecture fields read off a timm weights file's shapes. `num_heads` cannot be read from
/// shapes: a file vitscale wrote carries it in its `vitscale_model` metadata (`num_heads`);
/// otherwise it is guessed as timm's ViTs have it (`guess_num_heads`: 16 at the widths of
/// ViT-H, ViT-g, ViT-G and So400m, else `width / 64` when the width is a multiple of 64), else
/// left to the user.
#[derive(Clone, Debug, PartialEq)]
pub struct InferredModel {
    pub fields: serde_json::Map<String, serde_json::Value>,
    /// The head count recorded by vitscale when it saved the file.
    pub num_heads: Option<usize>,
    pub guessed_num_heads: Option<usize>,
}

/// The MLP ratio whose `int(width · ratio)` (timm's, and `ModelConfig::mlp_hidden`) is
/// `hidden`: `hidden / width` rounded, or the next double up where the product of that
/// rounds to just below `hidden` (e.g. width 14, hidden 61).
fn mlp_ratio_for(width: usize, hidden: usize) -> f64 {
    let r = hidden as f64 / width as f64;
    if (width as f64 * r) as usize == hidden {
        r
    } else {
        f64::from_bits(r.to_bits() + 1)
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
    fields.insert("mlp_ratio".into(), mlp_ratio_for(c, fc1[0]).into());
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
        let (got, changes) = load_for_fine_tuning(&path, &t3, || fresh.clone()).expect("fine-tune load");
        assert_eq!(changes, FineTuneChanges { new_head: Some(NewHead { file_classes: 10, model_classes: 3 }), pos_embed: None });
        for e in &t3.entries {
            let want: &[f32] = if e.name.starts_with("head.") { &fresh[e.span.range()] } else { &stored[t10.get(&e.name).expect("entry").span.range()] };
            assert_eq!(&got[e.span.range()], want, "{}", e.name);
        }
        let err = load(&path, &t3).expect_err("evaluation must refuse another head").to_string();
        assert!(err.contains("head.weight") && err.contains("[10, 192]"), "{err}");
        let (same, none) = load_for_fine_tuning(&path, &t10, || panic!("a matching head needs no fresh init")).expect("same class count");
        assert_eq!((same, none), (stored, FineTuneChanges::default()));
        // another width is no fine-tuning case: refused, naming the tensor
        let wide = ModelConfig { embed_dim: 256, num_heads: 4, ..model(3) };
        let tw = ParamTable::new(&wide);
        let err = load_for_fine_tuning(&path, &tw, || vec![0.0; tw.total]).expect_err("another width").to_string();
        assert!(err.contains("has shape"), "{err}");
    }

    /// The inferred MLP ratio gives back the file's MLP width, also where `hidden / width`
    /// times `width` rounds below it, and for giant's 1408 → 6144.
    #[test]
    fn inferred_mlp_ratio_gives_the_files_width() {
        for (c, f) in [(14, 61), (11, 30), (22, 49), (1408, 6144), (1664, 8192), (1280, 5120), (24, 60)] {
            let m = ModelConfig { embed_dim: c, mlp_ratio: mlp_ratio_for(c, f), ..model(10) };
            assert_eq!(m.mlp_hidden(), f, "width {c}");
        }
    }

    /// The guessed head count is timm's: 16 for ViT-H/14 (head dim 80) and ViT-g/14 (88), not
    /// width / 64.
    #[test]
    fn guessed_head_counts_are_timms() {
        for (c, h) in [(192, 3), (384, 6), (768, 12), (1024, 16), (1152, 16), (1280, 16), (1408, 16), (1664, 16)] {
            assert_eq!(guess_num_heads(c), Some(h), "width {c}");
        }
        assert_eq!(guess_num_heads(48), None);
        for name in ["vit_huge_patch14_224", "vit_giant_patch14_224", "vit_large_patch16_384"] {
            let m = ModelConfig::preset(name).expect("preset");
            assert_eq!(guess_num_heads(m.embed_dim), Some(m.num_heads), "{name}");
        }
    }

    /// A file saved at another image size (same patch): fine-tuning resamples its position
    /// embedding (class token's row kept, the patch rows as `resample::resample_pos_embed`
    /// gives them, whose values tests/resample.rs checks against timm) and loads the rest;
    /// evaluation refuses it naming both grids; another patch size is refused either way.
    #[test]
    fn another_grid_is_resampled_for_fine_tuning_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w32.safetensors");
        let m32 = model(10);
        let m48 = ModelConfig { image_size: 48, ..m32.clone() };
        let (t32, t48) = (ParamTable::new(&m32), ParamTable::new(&m48));
        let stored: Vec<f32> = (0..t32.total).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect();
        save(&path, &t32, &m32, &stored).expect("save");
        let (got, changes) = load_for_fine_tuning(&path, &t48, || panic!("the head matches")).expect("fine-tune load");
        assert_eq!(changes, FineTuneChanges { new_head: None, pos_embed: Some(ResampledGrid { from: 8, to: 12 }) });
        let c = m32.embed_dim;
        let file_pos = &stored[t32.get("pos_embed").expect("pos_embed").span.range()];
        let want = crate::model::resample::resample_pos_embed(file_pos, c, 1, (8, 8), (12, 12), true).expect("resample");
        let got_pos = &got[t48.get("pos_embed").expect("pos_embed").span.range()];
        assert_eq!(got_pos, want.as_slice());
        assert_eq!(&got_pos[..c], &file_pos[..c], "the class token's row is kept");
        for e in t48.entries.iter().filter(|e| e.name != "pos_embed") {
            assert_eq!(&got[e.span.range()], &stored[t32.get(&e.name).expect("entry").span.range()], "{}", e.name);
        }
        let err = load(&path, &t48).expect_err("evaluation must refuse another grid").to_string();
        assert!(err.contains("pos_embed") && err.contains("8×8") && err.contains("12×12") && err.contains("model.image_size=32"), "{err}");
        let p8 = ModelConfig { patch_size: 8, ..m48 };
        let tp = ParamTable::new(&p8);
        for err in [load(&path, &tp).expect_err("patch 8").to_string(), load_for_fine_tuning(&path, &tp, || vec![0.0; tp.total]).expect_err("patch 8").to_string()] {
            assert!(err.contains("patch_embed.proj.weight") && err.contains("4×4 patches") && err.contains("model.patch_size is 8"), "{err}");
        }
    }
}
