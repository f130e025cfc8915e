//! Fine-tuning at another resolution, against timm: `tests/fixtures/resample_pos_embed.safetensors`
//! (made by `reference/make_resample_fixture.py` with torch/timm) holds random position
//! embeddings with timm's `resample_abs_pos_embed` of each to another grid, antialiased (timm's
//! default) and not, and a tiny timm model saved at 32 px with the position embedding timm's
//! `checkpoint_filter_fn` gives it at 48 px.
//!
//! Tolerance: 1e-5 absolute on values of order 1 (f64 here against f32 in PyTorch).

use std::collections::HashMap;
use std::path::Path;

use safetensors::SafeTensors;
use vitscale::model::resample::{resample_pos_embed, TIMM_ANTIALIAS};
use vitscale::model::weights;

mod common;
use common::{fixtures, tmp, write_weights};

const TOL: f32 = 1e-5;

struct Fixture {
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
    meta: HashMap<String, String>,
}

fn fixture() -> Fixture {
    let path = fixtures().join("resample_pos_embed.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (_, md) = SafeTensors::read_metadata(&bytes).expect("metadata");
    let meta = md.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    let tensors = st.tensors().into_iter().map(|(k, v)| (k.clone(), (v.shape().to_vec(), weights::to_f32(&path, &k, &v).expect("f32")))).collect();
    Fixture { tensors, meta }
}

impl Fixture {
    fn get(&self, k: &str) -> &[f32] {
        &self.tensors.get(k).unwrap_or_else(|| panic!("fixture lacks {k}")).1
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn resampling_matches_timm_with_and_without_antialiasing() {
    let fx = fixture();
    let cases: Vec<(usize, usize, usize)> = serde_json::from_str(&fx.meta["cases"]).expect("cases");
    assert!(cases.len() >= 10);
    for (i, &(from, to, prefix)) in cases.iter().enumerate() {
        let pos = fx.get(&format!("posemb.{i}"));
        let c = fx.tensors[&format!("posemb.{i}")].0[2];
        for (name, antialias) in [("aa", true), ("noaa", false)] {
            let want = fx.get(&format!("{name}.{i}"));
            let got = resample_pos_embed(pos, c, prefix, (from, from), (to, to), antialias).expect("resample");
            let d = max_abs_diff(&got, want);
            assert!(d <= TOL, "{from}→{to} (prefix {prefix}, antialias {antialias}): max |Δ| {d:.2e}");
            assert_eq!(&got[..prefix * c], &pos[..prefix * c], "prefix rows kept");
        }
    }
    assert!(TIMM_ANTIALIAS, "timm's resample_abs_pos_embed antialiases by default");
}

/// The fixture's 32 px timm weights as a plain timm file (no vitscale metadata).
fn timm_file(fx: &Fixture, dir: &Path) -> std::path::PathBuf {
    let path = dir.join("timm32.safetensors");
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> =
        fx.tensors.iter().filter_map(|(k, (shape, data))| Some((k.strip_prefix("param.")?.to_string(), shape.clone(), data.clone()))).collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    write_weights(&tensors, &path);
    path
}

fn run(dir: &Path, args: &[String]) -> std::process::Output {
    common::vitscale_env(dir, args, &[])
}

fn builtin_args(extra: &[&str]) -> Vec<String> {
    // width 16 is no multiple of 64: the head count is given
    let mut v: Vec<String> = ["--device", "cpu", "--set", "model.num_heads=2", "--set", "data.train_size=64", "--set", "data.val_size=32", "--set", "train_batch_size=16"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for s in extra {
        v.extend(["--set".to_string(), s.to_string()]);
    }
    v
}

fn saved_tensors(path: &Path) -> HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).expect("safetensors");
    st.tensors().into_iter().map(|(k, v)| (k.clone(), weights::to_f32(path, &k, &v).expect("f32"))).collect()
}

/// `train --init` of a file saved at 32 px into a run at 48 px: the notice names both grids,
/// the position embedding starts as timm's `checkpoint_filter_fn` makes it (checked with the
/// learning rate at 0, so the saved weights are the start), the class token's row is the
/// file's, every other weight is the file's; with a learning rate the run trains.
#[test]
fn init_at_another_image_size_resamples_pos_embed_as_timm() {
    let fx = fixture();
    let t = tmp();
    let w = timm_file(&fx, t.path());
    let saved = t.path().join("start48.safetensors");
    let mut args: Vec<String> = ["train", "--init", w.to_str().unwrap(), "--save-weights", saved.to_str().unwrap(), "--run-dir", t.path().join("run0").to_str().unwrap()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(builtin_args(&["model.image_size=48", "train.steps=1", r#"optimizer={"type":"SGD","params":{"lr":0.0,"momentum":0}}"#]));
    let out = run(t.path(), &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed: {stderr}");
    assert!(stderr.contains("pos_embed resampled from 4×4 to 6×6"), "no resampling notice: {stderr}");
    assert!(!stderr.contains("initialized anew"), "the head fits: {stderr}");

    let got = saved_tensors(&saved);
    let pos = &got["pos_embed"];
    let want = fx.get("pos_embed_48");
    let d = max_abs_diff(pos, want);
    assert!(d <= TOL, "pos_embed vs timm's checkpoint_filter_fn: max |Δ| {d:.2e}");
    let c = 16;
    assert_eq!(&pos[..c], &fx.get("param.pos_embed")[..c], "the class token's row is the file's");
    for (k, v) in &got {
        if k != "pos_embed" {
            assert_eq!(v.as_slice(), fx.get(&format!("param.{k}")), "{k} is the file's");
        }
    }

    let trained = t.path().join("trained48.safetensors");
    let mut args: Vec<String> = ["train", "--json", "--init", w.to_str().unwrap(), "--save-weights", trained.to_str().unwrap(), "--run-dir", t.path().join("run1").to_str().unwrap()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(builtin_args(&["model.image_size=48", "train.steps=3", r#"optimizer={"type":"SGD","params":{"lr":0.1,"momentum":0}}"#]));
    let out = run(t.path(), &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "train failed: {stderr}");
    assert!(stderr.contains("pos_embed resampled from 4×4 to 6×6"), "no resampling notice: {stderr}");
    let j = common::last_json(&out);
    assert!(j["train_loss"].as_f64().is_some_and(f64::is_finite), "{j}");
    let after = saved_tensors(&trained);
    assert_eq!(after["pos_embed"].len(), 37 * c);
    assert!(max_abs_diff(&after["pos_embed"], want) > 0.0, "training moved the position embedding");
}

/// Evaluation loads weights as they are: another grid is an error naming both grids and the
/// image size that fits; another patch size is refused by `--init` too, naming both sizes.
#[test]
fn eval_at_another_grid_and_init_at_another_patch_are_errors() {
    let fx = fixture();
    let t = tmp();
    let w = timm_file(&fx, t.path());
    let mut args: Vec<String> = vec!["eval".into(), "--weights".into(), w.display().to_string()];
    args.extend(builtin_args(&["model.image_size=48"]));
    let out = run(t.path(), &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "eval at another grid must fail");
    assert!(stderr.contains("pos_embed") && stderr.contains("4×4") && stderr.contains("6×6") && stderr.contains("model.image_size=32"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let mut args: Vec<String> = vec!["train".into(), "--init".into(), w.display().to_string(), "--run-dir".into(), t.path().join("run").display().to_string()];
    args.extend(builtin_args(&["model.patch_size=4", "train.steps=1"]));
    let out = run(t.path(), &args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "another patch size must fail");
    assert!(stderr.contains("patch_embed.proj.weight") && stderr.contains("8×8 patches") && stderr.contains("model.patch_size is 4"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
