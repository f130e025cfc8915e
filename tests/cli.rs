//! The command line as a user drives it: the `vitscale` binary on a CIFAR-10-format directory
//! with timm weights of a shape the defaults know nothing about (fixture made by
//! `reference/make_cifar_fixture.py`), the run directory, and clear errors for bad input.
//!
//! Tolerances: 1e-4 relative (f32 against timm in f32).

use std::process::Output;

use safetensors::SafeTensors;
use vitscale::model::weights;

mod common;
use common::{fixture_tensors, fixtures, last_json, metrics, read_json, tmp, write_weights};

/// Runs the binary in a fresh empty directory (every path handed to it is absolute), so that a
/// command without `--run-dir`, which writes `runs/<time>-<pid>` under the current directory,
/// leaves nothing in the checkout.
fn vitscale(args: &[&str]) -> Output {
    vitscale_env(args, &[])
}

fn vitscale_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    common::vitscale_env(tmp().path(), args, env)
}

fn fixture_scalar(name: &str) -> f64 {
    let bytes = std::fs::read(fixtures().join("timm_cifar.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let v = st.tensor(name).unwrap();
    f32::from_le_bytes(v.data()[..4].try_into().unwrap()) as f64
}

fn cifar_args(dir: &str) -> Vec<String> {
    // num_heads cannot be read off the weights (width 48 is not a multiple of 64).
    ["--set", "data.dataset=cifar10", "--set", &format!("data.path={dir}"), "--set", "model.num_heads=3", "--device", "cpu", "--json"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

#[test]
fn eval_of_unseen_timm_model_matches_timm_loss() {
    let tmp = tmp();
    let w = tmp.path().join("init.safetensors");
    write_weights(&fixture_tensors("param"), &w);
    let data = fixtures().join("cifar_tiny");
    let mut args = vec!["eval".to_string(), "--weights".into(), w.display().to_string()];
    args.extend(cifar_args(&data.display().to_string()));
    let out = vitscale(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.status.success(), "eval failed: {}", String::from_utf8_lossy(&out.stderr));
    let j = last_json(&out);
    let loss = j["loss"].as_f64().unwrap();
    let want = fixture_scalar("eval_loss");
    assert!(((loss - want) / want).abs() < 1e-4, "eval loss {loss} vs timm {want}");
    assert_eq!(j["images"].as_u64(), Some(30));
    assert!(j["top1"].as_f64().is_some());
}

#[test]
fn one_sgd_step_over_the_whole_train_split_matches_torch() {
    let tmp = tmp();
    let w = tmp.path().join("init.safetensors");
    let saved = tmp.path().join("after.safetensors");
    write_weights(&fixture_tensors("param"), &w);
    let data = fixtures().join("cifar_tiny");
    let mut args: Vec<String> = vec!["train".into(), "--init".into(), w.display().to_string(), "--save-weights".into(), saved.display().to_string()];
    args.extend(["--run-dir".into(), tmp.path().join("run").display().to_string()]);
    for s in [
        r#"optimizer={"type":"SGD","params":{"lr":0.1,"momentum":0}}"#,
        "gradient_clipping=0",
        "train_batch_size=40",
        "data.shuffle=false",
        "data.augment=none",
        "train.steps=1",
    ] {
        args.extend(["--set".into(), s.into()]);
    }
    args.extend(cifar_args(&data.display().to_string()));
    let out = vitscale(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.status.success(), "train failed: {}", String::from_utf8_lossy(&out.stderr));
    let j = last_json(&out);
    for key in ["val_top1", "val_loss", "train_loss", "images", "wall_s", "images_per_s"] {
        assert!(j.get(key).is_some_and(|v| v.is_number()), "--json lacks {key}: {j}");
    }
    assert_eq!(j["images"].as_u64(), Some(40));

    let ours = std::fs::read(&saved).unwrap();
    let st = SafeTensors::deserialize(&ours).unwrap();
    for (key, shape, want) in fixture_tensors("sgd1") {
        let v = st.tensor(&key).unwrap_or_else(|_| panic!("saved weights lack {key}"));
        assert_eq!(v.shape(), shape.as_slice(), "{key}");
        let got = weights::to_f32(&saved, &key, &v).unwrap();
        let num: f64 = got.iter().zip(&want).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt();
        let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
        assert!(num / den < 1e-4, "{key}: rel err {:.2e}", num / den);
    }
}

#[test]
fn default_training_writes_the_run_directory() {
    let tmp = tmp();
    let run = tmp.path().join("run");
    let out = vitscale(&[
        "train", "--json", "--run-dir", run.to_str().unwrap(),
        "--set", "data.train_size=512", "--set", "data.val_size=128", "--set", "train.steps=12", "--set", "train.log_every=4",
    ]);
    assert!(out.status.success(), "train failed: {}", String::from_utf8_lossy(&out.stderr));
    let j = last_json(&out);
    let top1 = j["val_top1"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&top1));
    assert_eq!(j["images"].as_u64(), Some(12 * 64));
    let steps = metrics(&run, None);
    assert_eq!(steps.len(), 3, "one line every 4 steps");
    for rec in &steps {
        for key in ["step", "epoch", "lr", "loss", "grad_norm", "images_per_s", "data_s", "forward_s", "backward_s", "optimizer_s"] {
            assert!(rec.get(key).is_some(), "metrics line lacks {key}: {rec}");
        }
    }
    let summary = read_json(&run.join("summary.json"));
    assert_eq!(summary["val_top1"], j["val_top1"]);
    let resolved = read_json(&run.join("config.json"));
    assert!(resolved.get("model").is_some());
}

/// The images/s of a metrics line leaves out the state agreement and the checkpoint writes
/// (`checkpoint_s`): they happen on the checkpoint steps and the last step only, and the line's
/// training time plus them is the wall time between the lines.
#[test]
fn checkpoint_time_is_logged_apart_from_images_per_s() {
    let tmp = tmp();
    let run = tmp.path().join("run");
    let out = vitscale(&[
        "train", "--json", "--run-dir", run.to_str().unwrap(),
        "--set", "data.train_size=512", "--set", "data.val_size=64", "--set", "train.steps=5", "--set", "train.log_every=1",
        "--set", "train.checkpoint_every=2",
    ]);
    assert!(out.status.success(), "train failed: {}", String::from_utf8_lossy(&out.stderr));
    let steps = metrics(&run, None);
    assert_eq!(steps.len(), 5);
    let mut prev_wall: Option<f64> = None;
    for rec in &steps {
        let step = rec["step"].as_u64().unwrap();
        let ckpt = rec["checkpoint_s"].as_f64().unwrap();
        // steps 2 and 4 checkpoint; step 5 is the last, which checks the state and checkpoints
        if [2, 4, 5].contains(&step) {
            assert!(ckpt > 0.0, "step {step} checkpointed, checkpoint_s {ckpt}");
        } else {
            assert_eq!(ckpt, 0.0, "step {step} wrote no checkpoint");
        }
        let wall = rec["wall_s"].as_f64().unwrap();
        if let Some(prev) = prev_wall {
            let trained = 64.0 / rec["images_per_s"].as_f64().unwrap();
            let between = wall - prev;
            assert!((trained + ckpt - between).abs() < 0.05 + 0.1 * between, "step {step}: {trained} s training + {ckpt} s checkpoint against {between} s between the lines");
        }
        prev_wall = Some(wall);
    }
}

/// Evaluation is not training: its time is logged as `eval_s` in the next metrics line and
/// left out of that window's img/s, so training + checkpoint + evaluation time add up to the
/// wall time between two lines.
#[test]
fn evaluation_time_is_logged_apart_from_images_per_s() {
    let tmp = tmp();
    let run = tmp.path().join("run");
    // a validation set large enough that its evaluation outweighs a training step
    let out = vitscale(&[
        "train", "--json", "--run-dir", run.to_str().unwrap(),
        "--set", "data.train_size=512", "--set", "data.val_size=2048", "--set", "train.steps=6", "--set", "train.log_every=1",
        "--set", "train.eval_every=2",
    ]);
    assert!(out.status.success(), "train failed: {}", String::from_utf8_lossy(&out.stderr));
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let evals: Vec<u64> = lines.iter().filter(|v| v["kind"] == "eval").map(|v| v["step"].as_u64().unwrap()).collect();
    assert_eq!(evals, vec![2, 4, 6]);
    let steps: Vec<&serde_json::Value> = lines.iter().filter(|v| v.get("kind").is_none()).collect();
    assert_eq!(steps.len(), 6);
    let mut prev_wall: Option<f64> = None;
    for rec in steps {
        let step = rec["step"].as_u64().unwrap();
        let eval = rec["eval_s"].as_f64().unwrap();
        // the evaluation after steps 2 and 4 runs after their lines: it lands in the next one
        if [3, 5].contains(&step) {
            assert!(eval > 0.0, "an evaluation ran before step {step}'s line, eval_s {eval}");
        } else {
            assert_eq!(eval, 0.0, "no evaluation ran in step {step}'s window");
        }
        let wall = rec["wall_s"].as_f64().unwrap();
        if let Some(prev) = prev_wall {
            let trained = 64.0 / rec["images_per_s"].as_f64().unwrap();
            let ckpt = rec["checkpoint_s"].as_f64().unwrap();
            let between = wall - prev;
            assert!((trained + ckpt + eval - between).abs() < 0.05 + 0.1 * between, "step {step}: {trained} s training + {ckpt} s checkpoint + {eval} s evaluation against {between} s between the lines");
            if eval > 0.0 {
                // left out: counted in, the window's img/s would fall by the evaluation's share
                assert!(trained < between - 0.5 * eval, "step {step}: {trained} s of training in a window of {between} s with {eval} s of evaluation");
            }
        }
        prev_wall = Some(wall);
    }
}

/// Weights saved by `train` evaluate to the same accuracy with `eval --weights` and no config:
/// the head count (4 heads of width 16 in the default model, not timm's width-64 guess) comes
/// from the metadata vitscale writes into the file.
#[test]
fn saved_weights_evaluate_like_the_run_that_saved_them() {
    let tmp = tmp();
    let run = tmp.path().join("run");
    let w = tmp.path().join("w.safetensors");
    let out = vitscale(&[
        "train", "--json", "--device", "cpu", "--run-dir", run.to_str().unwrap(), "--save-weights", w.to_str().unwrap(),
        "--set", "data.train_size=512", "--set", "data.val_size=256", "--set", "train.steps=24",
    ]);
    assert!(out.status.success(), "train failed: {}", String::from_utf8_lossy(&out.stderr));
    let trained = last_json(&out)["val_top1"].as_f64().unwrap();
    let out = vitscale(&["eval", "--json", "--device", "cpu", "--weights", w.to_str().unwrap(), "--set", "data.train_size=512", "--set", "data.val_size=256"]);
    assert!(out.status.success(), "eval failed: {}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("num_heads not given"), "the head count was guessed: {stderr}");
    let evaluated = last_json(&out)["top1"].as_f64().unwrap();
    assert_eq!(evaluated, trained, "eval of the saved weights disagrees with the run");
}

/// Every bad input: non-zero exit, one message naming the culprit, never a panic.
#[test]
fn bad_input_gives_one_clear_error() {
    let tmp = tmp();
    let garbage = tmp.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file at all").unwrap();
    let bad_json = tmp.path().join("bad.json");
    // (a trailing comma is Hjson, which DeepSpeed reads: an unclosed object is neither)
    std::fs::write(&bad_json, b"{\"train_batch_size\": 32,\n \"optimizer\": {\"type\": \"AdamW\"").unwrap();
    let empty_dir = tmp.path().join("empty");
    std::fs::create_dir(&empty_dir).unwrap();
    let w = tmp.path().join("w.safetensors");
    write_weights(&fixture_tensors("param"), &w);
    let cases: Vec<(Vec<String>, &str)> = vec![
        // Unknown keys inside a section are errors (at the top level DeepSpeed ignores them: a warning).
        (vec!["train".into(), "--set".into(), "train.epoch=3".into()], "train.epoch"),
        (vec!["train".into(), "--set".into(), "optimizer.type=Lamb".into()], "optimizer.type"),
        (vec!["train".into(), "--set".into(), "train_batch_size=100".into(), "--set".into(), "train_micro_batch_size_per_gpu=3".into(), "--set".into(), "gradient_accumulation_steps=33".into()], "train_batch_size"),
        (vec!["train".into(), "--config".into(), bad_json.display().to_string()], "bad.json"),
        (vec!["train".into(), "--set".into(), "data.dataset=cifar10".into()], "data.path"),
        (vec!["train".into(), "--set".into(), "data.dataset=cifar10".into(), "--set".into(), format!("data.path={}", empty_dir.display())], "empty"),
        (vec!["train".into(), "--set".into(), "model.num_heads=5".into()], "model.num_heads"),
        (vec!["eval".into(), "--weights".into(), garbage.display().to_string()], "garbage.safetensors"),
        (vec!["eval".into(), "--weights".into(), tmp.path().join("missing.safetensors").display().to_string()], "missing.safetensors"),
        // Weights of another shape than the named preset: the tensor is named.
        (vec!["eval".into(), "--weights".into(), w.display().to_string(), "--set".into(), "model.preset=vit_tiny_patch4_32".into(), "--set".into(), "data.dataset=cifar10".into(), "--set".into(), format!("data.path={}", fixtures().join("cifar_tiny").display())], "shape"),
        (vec!["train".into(), "--device".into(), "tpu".into()], "tpu"),
        // A head of another class count than the dataset: the message says it came from the weights.
        (vec!["eval".into(), "--weights".into(), w.display().to_string(), "--set".into(), "model.num_heads=3".into(), "--set".into(), "data.dataset=cifar100".into(), "--set".into(), format!("data.path={}", fixtures().join("cifar_tiny").display())], "head has 10 outputs"),
    ];
    for (args, needle) in cases {
        let out = vitscale(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: error does not name `{needle}`: {stderr}");
    }
}

/// An image folder whose config names no class count trains with one class per subfolder.
#[test]
fn folder_class_count_defaults_to_the_subfolders() {
    let tmp = tmp();
    for (class, rgb) in [("ants", [200u8, 30, 30]), ("bees", [30, 30, 200]), ("wasps", [30, 200, 30])] {
        std::fs::create_dir_all(tmp.path().join("data").join(class)).unwrap();
        for i in 0..6 {
            image::RgbImage::from_pixel(12, 10, image::Rgb(rgb)).save(tmp.path().join("data").join(class).join(format!("{i}.png"))).unwrap();
        }
    }
    let data = tmp.path().join("data");
    let run = tmp.path().join("run");
    let out = vitscale(&[
        "train", "--device", "cpu", "--json", "--run-dir", run.to_str().unwrap(),
        "--set", "data.dataset=folder", "--set", &format!("data.path={}", data.display()),
        "--set", "model.preset=vit_builtin_default", "--set", "train_batch_size=4", "--set", "train.steps=2",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("3 class folders"), "{stderr}");
    let resolved = read_json(&run.join("config.json"));
    assert_eq!(resolved["model"]["num_classes"], 3);
    // Class index order = sorted folder names, recorded in the run directory.
    let classes: Vec<String> = serde_json::from_slice(&std::fs::read(run.join("classes.json")).unwrap()).unwrap();
    assert_eq!(classes, ["ants", "bees", "wasps"]);
}

/// Without a usable GPU, `--device cuda` fails with one message that says why (the library it
/// could not load and how to get it, or the driver's reason) and `--device auto` says it falls
/// back, then trains on the CPU. The commands run with `CUDA_VISIBLE_DEVICES` empty, so on a
/// machine with GPUs the driver shows them none and the test runs there too.
#[test]
fn without_a_gpu_cuda_is_refused_clearly_and_auto_falls_back() {
    let no_gpu = [("CUDA_VISIBLE_DEVICES", "")];
    let tmp = tmp();
    let out = vitscale_env(&["train", "--device", "cuda", "--run-dir", tmp.path().join("cuda").to_str().unwrap(), "--set", "train.steps=1"], &no_gpu);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "--device cuda without a GPU should fail");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("--device cuda: no usable GPU 0: "), "{stderr}");
    if stderr.contains("cannot load") {
        assert!(stderr.contains("install") && stderr.contains("VITSCALE_CUDA_LIB_DIR"), "no remedy named: {stderr}");
    }
    let out = vitscale_env(
        &[
            "train", "--device", "auto", "--json", "--run-dir", tmp.path().join("auto").to_str().unwrap(),
            "--set", "train.steps=2", "--set", "data.train_size=64", "--set", "data.val_size=32",
        ],
        &no_gpu,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "--device auto should fall back: {stderr}");
    assert!(stderr.contains("notice: no usable GPU (") && stderr.contains("running on the CPU"), "{stderr}");
    assert!(last_json(&out)["val_top1"].as_f64().is_some());
}

/// `selftest --only`: only the parts named run, the report says so, and a name that is not a
/// part (or a GPU part on the CPU) is refused naming the parts.
#[test]
fn selftest_only_runs_the_parts_named() {
    let out = vitscale(&["selftest", "--device", "cpu", "--only", "optimizer", "--json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let r = last_json(&out);
    assert_eq!(r["parts"], serde_json::json!(["optimizer"]), "{r}");
    let checks = r["checks"].as_array().cloned().unwrap_or_default();
    assert!(!checks.is_empty() && checks.iter().all(|c| c["name"].as_str().is_some_and(|n| n.starts_with("optimizer_step") || n.starts_with("sum_squares"))), "{r}");
    assert!(stdout.contains("failed: PASS (only optimizer)"), "{stdout}");
    for (only, want) in [("jpeg", "\"jpeg\" is not a part of the checks; the parts are ops, optimizer"), ("decode", "--only decode: GPU parts, checked with --device cuda")] {
        let out = vitscale(&["selftest", "--device", "cpu", "--only", only]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(want), "--only {only}: {stderr}");
    }
}

/// `vitscale selftest --device cpu` in one process: every op and the single-process
/// communicator pass, and the JSON says so check by check.
#[test]
fn selftest_passes_in_one_cpu_process() {
    let out = vitscale(&["selftest", "--device", "cpu", "--json"]);
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let r = last_json(&out);
    assert_eq!(r["pass"].as_bool(), Some(true), "{r}");
    let checks = r["checks"].as_array().cloned().unwrap_or_default();
    assert!(checks.len() > 100 && checks.iter().all(|c| c["pass"].as_bool() == Some(true)), "{} checks", checks.len());
    assert!(checks.iter().any(|c| c["name"].as_str().is_some_and(|n| n.starts_with("comm all_reduce sum f32 [single"))), "no communicator check");
}
