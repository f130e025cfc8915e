//! fp16 training with dynamic loss scaling against the real DeepSpeed engine in fp16: the loss
//! scale after every step and the skipped steps must be DeepSpeed's exactly, the losses and the
//! final weights within the stated tolerances.
//!
//! The fixtures `tests/fixtures/train_ref/fp16_zero{1,2}.safetensors` were made by
//! `reference/make_fp16_train_fixture.py` (DeepSpeed 0.19.8 with `"fp16": {"enabled": true}`
//! on an H100, one rank, ZeRO stage 1 and 2; the metadata names the versions): the training
//! of `tests/train_reference.rs` (`timm_cifar.safetensors`'s model from its `param.*` weights,
//! `cifar_tiny/` in file order, micro 4 × GAS 2, AdamW, WarmupLR, clipping, label smoothing)
//! for 16 steps, starting from a scale of 2^20 with `hysteresis` 2 and `loss_scale_window` 4:
//! DeepSpeed's fp16 gradients overflow on steps 1–4 and 6 (skipped; the scale halves from the
//! second overflow on, once the hysteresis is spent), and the window doubles the scale twice.
//!
//! Here the run is on the CPU, which computes in f32: its gradients overflow where DeepSpeed's
//! fp16 gradient tensors would, because the overflow check counts a gradient of magnitude ≥
//! 65520 (`FP16_INF_FROM`) as infinite. Tolerances (f32 against fp16 compute, with fp16's
//! 2^-11 relative step): loss per step 3e-3 relative, weights after 16 steps ‖Δ‖ / ‖ref‖ ≤ 3e-3
//! per tensor; the learning rate per step 1e-9 (both f64 formulas; a skipped step does not
//! advance DeepSpeed's scheduler).
//!
//! Each scaler setting must matter: the same case with `hysteresis` 1 or `loss_scale_window` 8
//! must give another scale sequence, and one with the scale held at 2^20 (`loss_scale`
//! 1048576, static) another skip sequence.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::SafeTensors;
use vitscale::model::weights;

mod common;
use common::{fixture_tensors, fixtures, metrics, rel_l2, tmp, train_fixture, train_fixture_case, write_weights};

const TOL_LOSS: f64 = 3e-3;
const TOL_WEIGHTS: f64 = 3e-3;
const TOL_LR: f64 = 1e-9;

struct Reference {
    sets: serde_json::Map<String, serde_json::Value>,
    finals: BTreeMap<String, Vec<f32>>,
    lr: Vec<f64>,
    loss: Vec<f64>,
    scale_after: Vec<f64>,
    skipped_steps: Vec<u64>,
}

fn load(stage: u8) -> Reference {
    let f = train_fixture(&format!("fp16_zero{stage}"), &["lr", "loss", "loss_scale_after", "skipped_steps"]);
    let [lr, loss, scale_after, skipped] = ["lr", "loss", "loss_scale_after", "skipped_steps"].map(|k| f.series[k].clone());
    Reference { sets: f.sets, finals: f.finals, lr, loss, scale_after, skipped_steps: skipped.into_iter().map(|v| v as u64).collect() }
}

/// What one run logged per step, and its saved weights.
struct Run {
    lr: Vec<f64>,
    loss: Vec<f64>,
    scale_after: Vec<f64>,
    skipped_steps: Vec<u64>,
    saved: std::path::PathBuf,
}

/// Trains the fixture's case on the CPU with `fp16` block changes applied over its settings.
fn train(r: &Reference, fp16_changes: &[(&str, serde_json::Value)], tmp: &Path, tag: &str) -> Run {
    let init = tmp.join("init.safetensors");
    if !init.exists() {
        write_weights(&fixture_tensors("param"), &init);
    }
    let (saved, run_dir) = (tmp.join(format!("{tag}.safetensors")), tmp.join(tag));
    let mut sets = r.sets.clone();
    sets.insert("data.path".into(), fixtures().join("cifar_tiny").display().to_string().into());
    for (k, v) in fp16_changes {
        sets["fp16"][*k] = v.clone();
    }
    train_fixture_case(tmp, &sets, &init, &saved, &run_dir, tag);
    let (mut lr, mut loss, mut scale_after, mut skipped_steps) = (vec![], vec![], vec![], vec![]);
    for rec in metrics(&run_dir, None) {
        assert_eq!(rec["step"].as_u64(), Some(lr.len() as u64 + 1), "{tag}: one metrics line per step (train.log_every = 1)");
        lr.push(rec["lr"].as_f64().unwrap());
        loss.push(rec["loss"].as_f64().unwrap());
        scale_after.push(rec["loss_scale"].as_f64().unwrap_or_else(|| panic!("{tag}: no loss_scale in {rec}")));
        skipped_steps.push(rec["skipped_steps"].as_u64().unwrap_or_else(|| panic!("{tag}: no skipped_steps in {rec}")));
    }
    Run { lr, loss, scale_after, skipped_steps, saved }
}

fn series_err(ours: &[f64], theirs: &[f64]) -> f64 {
    if ours.len() != theirs.len() {
        return f64::INFINITY;
    }
    ours.iter().zip(theirs).map(|(a, b)| (a - b).abs() / b.abs().max(1e-12)).fold(0.0, f64::max)
}

fn check_stage(stage: u8) {
    let r = load(stage);
    assert_eq!(r.sets["zero_optimization"]["stage"].as_u64(), Some(stage as u64));
    // the fixture exercises the scaler: overflows that are skipped, a halving, a doubling
    assert!(*r.skipped_steps.last().unwrap() > 0, "the fixture never overflows");
    assert!(r.scale_after.windows(2).any(|w| w[1] < w[0]) && r.scale_after.windows(2).any(|w| w[1] > w[0]), "the fixture's scale must fall and rise: {:?}", r.scale_after);
    let tmp = tmp();
    let run = train(&r, &[], tmp.path(), "ref");
    assert_eq!(run.scale_after, r.scale_after, "zero {stage}: the loss scale after each step against DeepSpeed's");
    assert_eq!(run.skipped_steps, r.skipped_steps, "zero {stage}: skipped steps after each step against DeepSpeed's");
    let e_lr = series_err(&run.lr, &r.lr);
    assert!(e_lr <= TOL_LR, "zero {stage}: learning rates {:?} vs DeepSpeed {:?}", run.lr, r.lr);
    let e_loss = series_err(&run.loss, &r.loss);
    assert!(e_loss <= TOL_LOSS, "zero {stage}: losses {:?} vs DeepSpeed {:?} (rel err {e_loss:.2e})", run.loss, r.loss);
    let bytes = std::fs::read(&run.saved).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut worst = (0.0f64, String::new());
    for (k, want) in &r.finals {
        let got = weights::to_f32(&run.saved, k, &st.tensor(k).unwrap_or_else(|_| panic!("saved weights lack {k}"))).unwrap();
        let e = rel_l2(&got, want);
        if e > worst.0 {
            worst = (e, k.clone());
        }
    }
    assert!(worst.0 <= TOL_WEIGHTS, "zero {stage}: weights after {} steps: {} rel err {:.2e}", r.lr.len(), worst.1, worst.0);
    eprintln!("zero {stage}: scale and skips exact, lr {e_lr:.1e}, loss {e_loss:.1e}, weights {:.1e} ({})", worst.0, worst.1);

    // each scaler setting moves the schedule: a loop that ignored it would fail above
    for (what, changes) in [("hysteresis 1", vec![("hysteresis", 1.into())]), ("loss_scale_window 8", vec![("loss_scale_window", 8.into())])] {
        let m = train(&r, &changes, tmp.path(), &what.replace(' ', "_"));
        assert_ne!(m.scale_after, r.scale_after, "zero {stage}: with {what} the scale sequence is the reference's: the case does not test that setting");
    }
    let m = train(&r, &[("loss_scale", 1048576.into())], tmp.path(), "static");
    assert_ne!(m.skipped_steps, r.skipped_steps, "zero {stage}: a static scale of 2^20 skips as the dynamic one does");
}

#[test]
fn fp16_zero1_matches_deepspeed() {
    check_stage(1);
}

#[test]
fn fp16_zero2_matches_deepspeed() {
    check_stage(2);
}
