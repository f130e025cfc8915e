//! fp16 loss scaling (`train::loss_scale`) against DeepSpeed's meaning.
//!
//! - The state machine is checked against DeepSpeed 0.19.8's own `DynamicLossScaler` and
//!   `LossScaler`, fed overflow patterns by `reference/make_loss_scale_fixture.py`
//!   (`tests/fixtures/loss_scale/scaler.json`).
//! - The engine is checked through `vitscale train` on the CPU (f32 compute, the scaler
//!   running): runs whose every step sees the same batch (one batch of training images, no
//!   shuffle, no augmentation), so a skipped step must be exactly a step that never happened.
//!   Scaling by a power of two is exact in binary floating point (every gradient is linear in
//!   the loss gradient; no value here under- or overflows at the scales used), so the
//!   references are bitwise: a run without fp16, of as many steps as the fp16 run applied.

use std::path::{Path, PathBuf};

use serde_json::Value;

mod common;
use common::{launch_args, max_rel_diff, metrics, read_json, repo_path, run, run_dir_args, tmp, weights, EXE};
use vitscale::train::loss_scale::{DynamicLossScaler, LossScaling, Scaler, Verdict};

// ---- the state machine against DeepSpeed's -----------------------------------------------

fn fixture() -> Value {
    read_json(&repo_path("tests/fixtures/loss_scale/scaler.json"))
}

#[test]
fn the_dynamic_scaler_matches_deepspeeds_own() {
    let fx = fixture();
    let cases = fx["dynamic"].as_array().expect("dynamic cases");
    assert!(cases.len() >= 15);
    let (mut errors_seen, mut doublings_seen) = (0, 0);
    for case in cases {
        let name = case["name"].as_str().unwrap_or("?");
        let a = &case["args"];
        // the scaler as the engine builds it from the fp16 block (through the config parser)
        let block = serde_json::json!({"fp16": {
            "enabled": true,
            "initial_scale_power": a["initial_scale_power"],
            "loss_scale_window": a["loss_scale_window"],
            "hysteresis": a["hysteresis"],
            "consecutive_hysteresis": a["consecutive_hysteresis"],
            "min_loss_scale": a["min_loss_scale"],
        }});
        let cfg = vitscale::config::resolve(&block, 1).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut ls = LossScaling::for_precision(&cfg.precision).expect("fp16 scaling");
        let overflows: Vec<bool> = case["overflows"].as_str().unwrap_or("").chars().map(|c| c == 'o').collect();
        let after = case["after"].as_array().expect("after");
        let mut prev_scale = ls.scale();
        for (i, (&o, want)) in overflows.iter().zip(after).enumerate() {
            let got = ls.at_boundary(if o { f64::INFINITY } else { 1.0 });
            if want.get("error").is_some() {
                let e = got.expect_err(&format!("{name}[{i}]: DeepSpeed raised, vitscale went on")).to_string();
                assert!(e.contains("min_loss_scale"), "{name}[{i}]: {e}");
                errors_seen += 1;
                break;
            }
            let v = got.unwrap_or_else(|e| panic!("{name}[{i}]: {e}"));
            assert_eq!(v == Verdict::Skip, o, "{name}[{i}]");
            let Scaler::Dynamic(d) = &ls.scaler else { panic!("{name}: not dynamic") };
            assert_eq!(d.cur_scale, want["cur_scale"].as_f64().unwrap(), "{name}[{i}] cur_scale");
            assert_eq!(d.cur_hysteresis as i64, want["cur_hysteresis"].as_i64().unwrap(), "{name}[{i}] cur_hysteresis");
            assert_eq!(d.last_overflow_iter, want["last_overflow_iter"].as_i64().unwrap(), "{name}[{i}] last_overflow_iter");
            assert_eq!(d.cur_iter as i64, want["cur_iter"].as_i64().unwrap(), "{name}[{i}] cur_iter");
            if let Verdict::Apply { grad_scale, .. } = v {
                // unscaled by the scale after the update, as DeepSpeed's ZeRO step does
                assert_eq!(grad_scale, (1.0 / d.cur_scale) as f32, "{name}[{i}]");
            }
            doublings_seen += (d.cur_scale > prev_scale) as usize;
            prev_scale = d.cur_scale;
        }
        assert_eq!(ls.skipped_steps as usize, overflows.iter().zip(after).filter(|(&o, w)| o && w.get("error").is_none()).count(), "{name}");
    }
    // the fixture exercises what it is for
    assert!(errors_seen >= 2 && doublings_seen >= 10, "errors {errors_seen}, doublings {doublings_seen}");
}

#[test]
fn the_static_scale_never_changes_but_overflows_still_skip() {
    for case in fixture()["static"].as_array().expect("static cases") {
        let scale = case["loss_scale"].as_f64().unwrap();
        let cfg = vitscale::config::resolve(&serde_json::json!({"fp16": {"enabled": true, "loss_scale": scale}}), 1).expect("config");
        let mut ls = LossScaling::for_precision(&cfg.precision).expect("fp16 scaling");
        assert!(matches!(ls.scaler, Scaler::Static { .. }));
        for (c, want) in case["overflows"].as_str().unwrap_or("").chars().zip(case["after"].as_array().expect("after")) {
            let v = ls.at_boundary(if c == 'o' { f64::NAN } else { 4.0 }).expect("static scalers never fail");
            assert_eq!(ls.scale(), want["cur_scale"].as_f64().unwrap());
            assert_eq!(v == Verdict::Skip, c == 'o');
        }
    }
}

#[test]
fn the_scaler_is_built_with_deepspeeds_defaults() {
    let cfg = vitscale::config::resolve(&serde_json::json!({"fp16": {"enabled": true}}), 1).expect("config");
    let ls = LossScaling::for_precision(&cfg.precision).expect("fp16 scaling");
    assert_eq!(ls.scaler, Scaler::Dynamic(DynamicLossScaler::new(65536.0, 1000, 1.0, 2, false)));
    let fp32 = vitscale::config::resolve(&serde_json::json!({}), 1).expect("config");
    assert!(LossScaling::for_precision(&fp32.precision).is_none());
}

// ---- the engine ----------------------------------------------------------------------------

/// Every step trains on the same 16 images (one batch, no shuffle, no augmentation), with
/// AdamW (bias correction counts the applied steps) and a warm-up (the schedule counts them
/// too): a skipped step that touched either would show in the weights.
fn same_batch(steps: u64) -> Vec<String> {
    [
        "--device=cpu".to_string(),
        format!("--set=train.steps={steps}"),
        "--set=train_batch_size=16".into(),
        "--set=data.train_size=16".into(),
        "--set=data.val_size=16".into(),
        "--set=data.shuffle=false".into(),
        "--set=data.augment=none".into(),
        "--set=train.log_every=1".into(),
        "--set=optimizer={\"type\":\"AdamW\",\"params\":{\"lr\":0.001,\"weight_decay\":0.05}}".into(),
        "--set=scheduler={\"type\":\"WarmupLR\",\"params\":{\"warmup_min_lr\":0.0001,\"warmup_max_lr\":0.001,\"warmup_num_steps\":6}}".into(),
    ]
    .into()
}

fn fp16(block: &str) -> String {
    format!("--set=fp16={{\"enabled\":true,{block}}}")
}

/// `vitscale [launch -- ] train <base> <extra> --run-dir dir --save-weights dir/w.safetensors`.
fn train(nproc: usize, base: &[String], extra: &[&str], dir: &Path) -> Value {
    let mut args = launch_args(nproc);
    args.push("train".into());
    args.extend(base.iter().cloned());
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(run_dir_args(dir));
    run(&args);
    read_json(&dir.join("summary.json"))
}

/// Per step record: (loss_scale, skipped_steps, lr).
fn scale_log(dir: &Path) -> Vec<(f64, u64, f64)> {
    metrics(dir, None).iter().map(|r| (r["loss_scale"].as_f64().unwrap_or(f64::NAN), r["skipped_steps"].as_u64().unwrap_or(u64::MAX), r["lr"].as_f64().unwrap_or(f64::NAN))).collect()
}

fn same_weights(a: &Path, b: &Path) -> bool {
    weights(a) == weights(b)
}

/// 2^23 overflows at once: the loss gradient itself is 2^19 per image, past fp16's range, which
/// the overflow check applies on every backend (a gradient DeepSpeed's fp16 tensors could not
/// hold). The first steps are skipped while the hysteresis (2) is spent and the scale halves,
/// until the scaled gradients fit (and again when they grow past the range later). After them the run trains exactly like a run
/// without fp16 of the remaining steps: no weight, no Adam moment, no step count and no
/// learning rate moved during the skips.
// mutation checks: advancing the schedule on skipped steps, or counting skipped steps in
// Adam's bias correction, or applying the update on an overflow, each fails this.
#[test]
fn overflowing_steps_are_skipped_and_then_training_proceeds_as_if_they_never_were() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    let n = 12u64;
    let s = train(1, &same_batch(n), &[&fp16("\"initial_scale_power\":23,\"hysteresis\":2")], &p("fp16"));
    let k = s["skipped_steps"].as_u64().expect("skipped_steps in the summary");
    assert_eq!(s["steps"].as_u64(), Some(n), "skipped steps count as steps (DeepSpeed's global_steps)");
    assert!((4..n - 3).contains(&k), "{k} of {n} steps skipped");
    let log = scale_log(&p("fp16"));
    assert_eq!(log.len() as u64, n);
    // the run opens with overflows; a later one may come as the gradients grow. DeepSpeed's
    // rule, written out (the window of 1000 never expires here): the first overflow spends the
    // hysteresis, each further one halves the scale
    let mut prev_skipped = 0;
    let mut overflows = 0;
    for (i, &(scale, skipped, _)) in log.iter().enumerate() {
        assert!(skipped == prev_skipped || skipped == prev_skipped + 1, "step {}: skipped_steps {skipped}", i + 1);
        overflows += skipped - prev_skipped;
        prev_skipped = skipped;
        // 2^23, 2^23, 2^22, 2^21: the loss gradient alone (scale / 16) is past fp16's range
        if i < 4 {
            assert_eq!(skipped, i as u64 + 1, "step {}: must overflow", i + 1);
        }
        assert_eq!(scale, 2f64.powi(23 - overflows.saturating_sub(1) as i32), "step {}: loss_scale", i + 1);
    }
    assert_eq!(prev_skipped, k);
    // the same run without fp16, n − k steps long: the same weights, and the same learning rate
    // at each applied step
    train(1, &same_batch(n - k), &[], &p("fp32"));
    assert!(same_weights(&p("fp16"), &p("fp32")), "max relative difference {:e}", max_rel_diff(&p("fp16"), &p("fp32")));
    let lr32: Vec<f64> = metrics(&p("fp32"), None).iter().map(|r| r["lr"].as_f64().unwrap_or(f64::NAN)).collect();
    // each applied step's lr is the one the fp32 run used at the same count of applied steps
    let applied: Vec<f64> = log.iter().zip(std::iter::once(0).chain(log.iter().map(|l| l.1))).filter(|(l, before)| l.1 == *before).map(|(l, _)| l.2).collect();
    assert_eq!(applied, lr32, "the schedule advanced on skipped steps");
}

/// Without overflow the scaling is neutral: a dynamic scale of 2^16 and a static one of 1024,
/// with GAS 2 and clipping by the global norm (applied to the unscaled gradients, as
/// DeepSpeed does), give the weights of the same run without fp16. Power-of-two scaling is
/// exact, so the tolerance is none (a non-neutral clip, e.g. on the scaled norm, fails).
#[test]
fn scaling_without_overflow_gives_the_weights_of_fp32_training() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    let extra = ["--set=train_micro_batch_size_per_gpu=8", "--set=gradient_clipping=0.05"];
    fn with<'a>(extra: &[&'a str], more: &'a str) -> Vec<&'a str> {
        extra.iter().copied().chain([more]).collect()
    }
    train(1, &same_batch(5), &extra, &p("fp32"));
    let dynamic = fp16("\"initial_scale_power\":16");
    let s = train(1, &same_batch(5), &with(&extra, &dynamic), &p("dynamic"));
    let stat = fp16("\"loss_scale\":1024");
    let s2 = train(1, &same_batch(5), &with(&extra, &stat), &p("static"));
    assert_eq!((s["skipped_steps"].as_u64(), s["loss_scale"].as_f64()), (Some(0), Some(65536.0)));
    assert_eq!((s2["skipped_steps"].as_u64(), s2["loss_scale"].as_f64()), (Some(0), Some(1024.0)));
    // the clip was active (else this would not test clipping of unscaled gradients)
    let norms: Vec<f64> = metrics(&p("fp32"), None).iter().map(|r| r["grad_norm"].as_f64().unwrap_or(0.0)).collect();
    assert!(norms.iter().all(|&g| g > 0.05), "{norms:?}");
    // the logged norm is the unscaled one
    let norms16: Vec<f64> = metrics(&p("dynamic"), None).iter().map(|r| r["grad_norm"].as_f64().unwrap_or(0.0)).collect();
    assert_eq!(norms16, norms);
    for d in ["dynamic", "static"] {
        assert!(same_weights(&p(d), &p("fp32")), "{d}: max relative difference {:e}", max_rel_diff(&p(d), &p("fp32")));
    }
}

/// Two ranks (and ZeRO 1 and 2 on two ranks) skip the same steps as one process and end with
/// its weights (within the split tolerance of `tests/dist_train.rs`: SGD, the per-sample
/// gradients summed in another order).
#[test]
fn two_ranks_and_zero_skip_the_same_steps_as_one_process() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    let mut base = same_batch(8);
    base.push("--set=optimizer={\"type\":\"SGD\",\"params\":{\"lr\":0.05,\"momentum\":0.9}}".into());
    base.push("--set=train_micro_batch_size_per_gpu=8".into());
    let f = fp16("\"initial_scale_power\":132,\"hysteresis\":2");
    let one = train(1, &base, &[&f], &p("one"));
    let k = one["skipped_steps"].as_u64().expect("skipped_steps");
    assert!(k >= 3, "{k}");
    for (name, extra) in [("two", None), ("zero1", Some("1")), ("zero2", Some("2"))] {
        let z = extra.map(|s| format!("--set=zero_optimization={{\"stage\":{s}}}"));
        let mut args: Vec<&str> = vec![&f];
        if let Some(z) = &z {
            args.push(z);
        }
        let two = train(2, &base, &args, &p(name));
        assert_eq!(two["skipped_steps"].as_u64(), Some(k), "{name}");
        assert_eq!(two["loss_scale"], one["loss_scale"], "{name}");
        assert_eq!(scale_log(&p(name)), scale_log(&p("one")), "{name}");
        // rank 1 logged the same scale and skips
        assert_eq!(read_json(&p(name).join("rank1/summary.json"))["skipped_steps"].as_u64(), Some(k), "{name}");
        let d = max_rel_diff(&p(name), &p("one"));
        assert!(d < 1e-6, "{name}: {d:e}");
    }
}

/// A checkpoint inside the skipped steps (hysteresis 3, so the resumed scaler must know how
/// much of it is spent) and one after them, with a window of 3 (so it must know when the last
/// overflow was): resuming either continues bitwise like the straight run.
// mutation check: not restoring the scaler (a fresh 2^130 on resume) fails this.
#[test]
fn resume_continues_the_scaler_exactly() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    let f = fp16("\"initial_scale_power\":132,\"hysteresis\":3,\"loss_scale_window\":3");
    let every = "--set=train.checkpoint_every=2";
    let straight = train(1, &same_batch(12), &[&f, every], &p("straight"));
    for stop in [2u64, 8] {
        let dir = p(&format!("stop{stop}"));
        train(1, &same_batch(stop), &[&f, every], &dir);
        let state = read_json(&dir.join(format!("checkpoints/step_{stop:06}/state.json")));
        assert!(state["loss_scaling"]["scaler"]["cur_scale"].is_number(), "{state}");
        let resumed = train(1, &same_batch(12), &[&f, every, "--resume", "latest"], &dir);
        assert_eq!(resumed["skipped_steps"], straight["skipped_steps"], "stop at {stop}");
        assert_eq!(resumed["loss_scale"], straight["loss_scale"], "stop at {stop}");
        assert!(same_weights(&dir, &p("straight")), "stop at {stop}: resumed weights differ from the straight run's");
    }
}

/// An overflow at the minimum scale with no hysteresis left ends the run with an error naming
/// the key, where DeepSpeed raises (here the minimum is 2^200, past f32: the first step
/// overflows at it).
#[test]
fn an_overflow_at_the_minimum_scale_ends_the_run_naming_the_key() {
    let t = tmp();
    let mut args = vec!["train".to_string()];
    args.extend(same_batch(3));
    args.push(fp16("\"initial_scale_power\":200,\"min_loss_scale\":1.6069380442589903e60,\"hysteresis\":1"));
    args.extend(["--run-dir".to_string(), t.path().join("run").display().to_string()]);
    let out = std::process::Command::new(EXE).args(&args).current_dir(t.path()).output().expect("run vitscale");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("fp16.min_loss_scale") && err.contains("cannot decrease scale"), "{err}");
}

/// Bad values in the fp16 block fail with an error naming the key.
#[test]
fn bad_fp16_values_are_refused_naming_the_key() {
    let cases = [
        (r#"{"enabled": true, "hysteresis": 0}"#, "fp16.hysteresis"),
        (r#"{"enabled": true, "loss_scale_window": 0}"#, "fp16.loss_scale_window"),
        (r#"{"enabled": true, "min_loss_scale": 0}"#, "fp16.min_loss_scale"),
        (r#"{"enabled": true, "loss_scale": -1}"#, "fp16.loss_scale"),
        (r#"{"enabled": true, "initial_scale_power": 5000}"#, "fp16.initial_scale_power"),
        (r#"{"enabled": true, "initial_scale_power": -1}"#, "fp16.initial_scale_power"),
        (r#"{"enabled": true, "consecutive_hysteresis": "yes"}"#, "fp16.consecutive_hysteresis"),
        (r#"{"enabled": true, "scale_window": 10}"#, "scale_window"),
    ];
    for (block, key) in cases {
        let v: Value = serde_json::from_str(&format!(r#"{{"fp16": {block}}}"#)).expect("json");
        let e = vitscale::config::resolve(&v, 1).err().unwrap_or_else(|| panic!("{block} was accepted")).to_string();
        assert!(e.contains(key), "{block}: {e}");
    }
    // through the binary: exit status 1 and the key named, no panic
    let t = tmp();
    let out = std::process::Command::new(EXE)
        .args(["train", "--device=cpu", "--set=fp16={\"enabled\":true,\"hysteresis\":0}", "--run-dir"])
        .arg(t.path().join("run"))
        .current_dir(t.path())
        .output()
        .expect("run vitscale");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("fp16.hysteresis"), "{}", String::from_utf8_lossy(&out.stderr));
}
