//! End-to-end training against the real DeepSpeed engine: the whole loop (micro-batches and
//! gradient accumulation, label smoothing, the global-norm clip, the scheduler's per-step
//! learning rate, weight-decay groups, the optimizer update) must reproduce, on the CPU,
//! `deepspeed.initialize` training the same timm ViT on the same images.
//!
//! The fixtures in `tests/fixtures/train_ref/` were made by `reference/make_train_fixtures.py`
//! (DeepSpeed 0.19.8 in fp32 on an H200 with TF32 off, one rank; its metadata names the
//! versions). Each trains `timm_cifar.safetensors`'s model (no qkv bias: Adam would turn the key
//! bias's zero gradient into rounding noise) from its `param.*` weights on `cifar_tiny/` in file
//! order for 8 steps of 8 images (micro 4 × GAS 2), with AdamW under each of DeepSpeed's three
//! schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR) or SGD with Nesterov momentum,
//! `gradient_clipping` below the gradient norm of every step, and label smoothing 0.1. The
//! fixture's metadata holds the `--set` overrides that make `vitscale train` run the same case.
//!
//! Tolerances (vitscale's f32 CPU against DeepSpeed's f32 GPU run, which agree to 1e-7–4e-7):
//! learning rate per step 1e-9 relative (both are f64 formulas); loss and pre-clip gradient norm
//! per step 1e-5 relative; weights after 8 steps ‖Δ‖ / ‖ref‖ ≤ 1e-5 per tensor.
//!
//! Each setting must matter: the same case with clipping off, smoothing off, the scheduler
//! removed, (AdamW) every parameter decayed or (SGD) plain momentum must miss the reference by more than 10× the
//! tolerance, so a loop that ignored the setting would fail here. `scripts/mutation_check.sh`
//! breaks the loop itself in those ways and checks that this test fails.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::SafeTensors;
use vitscale::model::weights;

mod common;
use common::{fixture_tensors, fixtures, metrics, rel_l2, tmp, train_fixture, train_fixture_case, write_weights};

const TOL_WEIGHTS: f64 = 1e-5;
const TOL_STEP: f64 = 1e-5;
const TOL_LR: f64 = 1e-9;
/// How far a case with one setting turned off must land from the reference.
const MATTERS: f64 = 10.0;

struct Reference {
    name: String,
    sets: serde_json::Map<String, serde_json::Value>,
    finals: BTreeMap<String, Vec<f32>>,
    lr: Vec<f64>,
    loss: Vec<f64>,
    grad_norm: Vec<f64>,
}

fn load(name: &str) -> Reference {
    let f = train_fixture(name, &["lr", "loss", "grad_norm"]);
    let [lr, loss, grad_norm] = ["lr", "loss", "grad_norm"].map(|k| f.series[k].clone());
    Reference { name: name.to_string(), sets: f.sets, finals: f.finals, lr, loss, grad_norm }
}

/// The fixture's initial weights as a plain timm weights file.
fn write_init(path: &Path) {
    write_weights(&fixture_tensors("param"), path);
}

/// What one `vitscale train` run produced.
struct Run {
    finals: BTreeMap<String, Vec<f32>>,
    lr: Vec<f64>,
    loss: Vec<f64>,
    grad_norm: Vec<f64>,
}

/// Trains the reference's case with `changes` applied over its settings (`None` removes a key).
fn train(r: &Reference, changes: &[(&str, Option<serde_json::Value>)], tmp: &Path, tag: &str) -> Run {
    let init = tmp.join("init.safetensors");
    if !init.exists() {
        write_init(&init);
    }
    let (saved, run_dir) = (tmp.join(format!("{tag}.safetensors")), tmp.join(tag));
    let mut sets = r.sets.clone();
    sets.insert("data.path".into(), fixtures().join("cifar_tiny").display().to_string().into());
    for (k, v) in changes {
        match v {
            Some(v) => sets.insert(k.to_string(), v.clone()),
            None => sets.remove(*k),
        };
    }
    train_fixture_case(tmp, &sets, &init, &saved, &run_dir, &format!("{} ({tag})", r.name));

    let bytes = std::fs::read(&saved).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let finals = st.tensors().into_iter().map(|(k, v)| (k.clone(), weights::to_f32(&saved, &k, &v).unwrap())).collect();
    let (mut lr, mut loss, mut grad_norm) = (vec![], vec![], vec![]);
    for rec in metrics(&run_dir, None) {
        assert_eq!(rec["step"].as_u64(), Some(lr.len() as u64 + 1), "{}: one metrics line per step (train.log_every = 1)", r.name);
        lr.push(rec["lr"].as_f64().unwrap());
        loss.push(rec["loss"].as_f64().unwrap());
        grad_norm.push(rec["grad_norm"].as_f64().unwrap());
    }
    Run { finals, lr, loss, grad_norm }
}

/// The largest per-tensor relative error of the final weights, and its tensor.
fn weights_err(r: &Reference, run: &Run) -> (f64, String) {
    assert_eq!(run.finals.keys().collect::<Vec<_>>(), r.finals.keys().collect::<Vec<_>>(), "{}: saved keys", r.name);
    r.finals.iter().map(|(k, want)| (rel_l2(&run.finals[k], want), k.clone())).fold((0.0, String::new()), |a, b| if b.0 > a.0 { b } else { a })
}

fn series_err(ours: &[f64], theirs: &[f64]) -> f64 {
    if ours.len() != theirs.len() {
        return f64::INFINITY;
    }
    ours.iter().zip(theirs).map(|(a, b)| if a.is_finite() { (a - b).abs() / b.abs().max(1e-12) } else { f64::INFINITY }).fold(0.0, f64::max)
}

fn check_case(name: &str) {
    let r = load(name);
    let tmp = tmp();
    let run = train(&r, &[], tmp.path(), "ref");

    assert_eq!(run.lr.len(), r.lr.len(), "{name}: steps");
    let e_lr = series_err(&run.lr, &r.lr);
    assert!(e_lr <= TOL_LR, "{name}: learning rates {:?} vs DeepSpeed {:?}", run.lr, r.lr);
    let e_norm = series_err(&run.grad_norm, &r.grad_norm);
    assert!(e_norm <= TOL_STEP, "{name}: gradient norms {:?} vs DeepSpeed {:?} (rel err {e_norm:.2e})", run.grad_norm, r.grad_norm);
    let e_loss = series_err(&run.loss, &r.loss);
    assert!(e_loss <= TOL_STEP, "{name}: losses {:?} vs DeepSpeed {:?} (rel err {e_loss:.2e})", run.loss, r.loss);
    let clip = r.sets["gradient_clipping"].as_f64().unwrap();
    assert!(r.grad_norm.iter().all(|n| *n > clip), "{name}: the fixture's clipping must act on every step");
    let (e_w, worst) = weights_err(&r, &run);
    assert!(e_w <= TOL_WEIGHTS, "{name}: weights after {} steps: {worst} rel err {e_w:.2e}", r.lr.len());
    eprintln!("{name}: lr {e_lr:.1e}, grad norm {e_norm:.1e}, loss {e_loss:.1e}, weights {e_w:.1e} ({worst})");

    // every setting the case exercises must move the result well past the tolerance
    let adam = r.sets["optimizer"]["type"].as_str() == Some("AdamW");
    let mut off: Vec<(&str, Vec<(&str, Option<serde_json::Value>)>)> = vec![
        ("gradient_clipping off", vec![("gradient_clipping", Some(0.into()))]),
        ("label smoothing off", vec![("train.label_smoothing", Some(0.into()))]),
        ("no scheduler", vec![("scheduler", None)]),
    ];
    if adam {
        off.push(("weight_decay_skip empty", vec![("train.weight_decay_skip", Some(serde_json::json!([])))]));
    } else {
        let mut plain = r.sets["optimizer"].clone();
        plain["params"]["nesterov"] = false.into();
        off.push(("nesterov off", vec![("optimizer", Some(plain))]));
    }
    for (i, (what, changes)) in off.iter().enumerate() {
        let m = train(&r, changes, tmp.path(), &format!("off{i}"));
        let (e_w, e_lr) = (weights_err(&r, &m).0, series_err(&m.lr, &r.lr));
        eprintln!("{name}: {what}: weights miss by {e_w:.1e}, learning rates by {e_lr:.1e}");
        assert!(
            e_w > MATTERS * TOL_WEIGHTS || e_lr > MATTERS * TOL_LR,
            "{name}: with {what} the weights are within {e_w:.1e} of the reference and the learning rates within {e_lr:.1e}: the case does not test that setting"
        );
    }
}

#[test]
fn adamw_warmup_lr_matches_deepspeed() {
    check_case("adamw_warmup_lr");
}

#[test]
fn adamw_warmup_decay_lr_matches_deepspeed() {
    check_case("adamw_warmup_decay_lr");
}

#[test]
fn adamw_warmup_cosine_lr_matches_deepspeed() {
    check_case("adamw_warmup_cosine_lr");
}

#[test]
fn sgd_nesterov_matches_deepspeed() {
    check_case("sgd_nesterov_warmup_lr");
}
