//! Sequence parallelism (`sequence_parallel_size`, DeepSpeed-Ulysses' scheme) on CPU ranks:
//! N ranks equal one process with the same global batch — per-step losses, the evaluation and
//! the final weights — for SP 2, SP 4 and DP 2 × SP 2, with GAS 2, ZeRO 1, 2 and 3, token pooling
//! over 17 tokens (class token + 16 patches: split unevenly over 2 and 4 ranks) and average
//! pooling over 16 patch tokens (split evenly), activation checkpointing, regenerated
//! activations in several passes per micro-batch, stochastic depth, evaluation and resuming
//! across layouts; plus the config's
//! rules (the batch triple counts the data-parallel degree; bad sizes are errors naming the key).
//!
//! Runs are the built-in preset (16-px images, 4 heads, 3 blocks), 3 steps of 16 images, a
//! fraction of a second each.

use std::path::{Path, PathBuf};

mod common;
use common::{last_json, launch_args, max_rel_diff, metrics, read_json, run, run_dir_args, tmp};

/// SGD with momentum: an update proportional to the gradient, so the weights compare the
/// gradients themselves. (AdamW divides by √v: on the key bias, whose gradient is zero up to
/// rounding — softmax ignores a shift shared by every key — it turns rounding noise of either
/// run into full steps of ±lr, and no tolerance tells anything there.)
const SGD: &str = "--set=optimizer={\"type\":\"SGD\",\"params\":{\"lr\":0.05,\"momentum\":0.9}}";
/// Final weights, largest |a − b| / (1 + |b|): the patch embedding's and every replicated
/// weight's gradient is summed over the group's tokens in another order than one process sums
/// it, and the pool's mean is a sum of the ranks' partial sums. Measured ≤ 2.8e-8 after 3 steps.
const WEIGHTS_TOL: f32 = 1e-6;
/// Per-step training loss and the evaluation's loss, relative. Measured ≤ 2e-8.
const LOSS_TOL: f64 = 1e-6;

fn train(nproc: usize, extra: &[&str], dir: &Path) {
    let mut args = launch_args(nproc);
    args.push("train".into());
    args.extend(
        [
            "--device=cpu",
            "--set=train.steps=3",
            "--set=train_batch_size=16",
            "--set=gradient_accumulation_steps=2",
            "--set=data.val_size=64",
            "--set=train.log_every=1",
            SGD,
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(run_dir_args(dir));
    run(&args);
}

fn losses(dir: &Path) -> Vec<f64> {
    metrics(dir, None).iter().map(|r| r["loss"].as_f64().unwrap_or(f64::NAN)).collect()
}

/// `dir`'s run against one process's `one`: the plan it ran, per-step losses, evaluation,
/// final weights, and every rank ending with rank 0's weights.
fn check_against_one(dir: &Path, one: &Path, world: usize, sp: usize, what: &str) {
    let cfg = read_json(&dir.join("config.json"));
    // the global batch of 16 in 2 micro-batches per data-parallel slot (not per rank)
    assert_eq!(cfg["sequence_parallel_size"], sp, "{what}");
    assert_eq!(cfg["train_micro_batch_size_per_gpu"], 8 / (world / sp), "{what}: the batch triple counts the data-parallel degree");
    assert_eq!((cfg["plan"]["sequence_parallel"].as_u64(), cfg["plan"]["data_parallel"].as_u64()), (Some(sp as u64), Some((world / sp) as u64)), "{what}");
    let (ours, theirs) = (losses(dir), losses(one));
    assert_eq!(ours.len(), 3, "{what}");
    for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!(((a - b) / b).abs() < LOSS_TOL, "{what}: step {} loss {a} vs one process {b}", step + 1);
    }
    let worst = ours.iter().zip(&theirs).map(|(a, b)| ((a - b) / b).abs()).fold(0.0, f64::max);
    eprintln!("{what}: per-step losses vs one process: {worst:e}");
    let val = |d: &Path| read_json(&d.join("summary.json"))["val_loss"].as_f64().unwrap_or(f64::NAN);
    assert!(((val(dir) - val(one)) / val(one)).abs() < LOSS_TOL, "{what}: val_loss {} vs {}", val(dir), val(one));
    let d = max_rel_diff(dir, one);
    eprintln!("{what}: final weights vs one process: {d:e}");
    assert!(d < WEIGHTS_TOL, "{what}: final weights differ from one process's by {d:e}");
    let h0 = read_json(&dir.join("summary.json"))["weights_hash"].clone();
    for r in 1..world {
        assert_eq!(read_json(&dir.join(format!("rank{r}/summary.json")))["weights_hash"], h0, "{what}: rank {r}");
    }
}

fn layouts_equal_one_process(model: &[&str], name: &str) {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    train(1, model, &p("one"));
    // (world, SP): SP 2, SP 4, and 2 data-parallel groups of SP 2
    for (world, sp) in [(2usize, 2usize), (4, 4), (4, 2)] {
        let dir = p(&format!("w{world}sp{sp}"));
        let mut extra = model.to_vec();
        let set = format!("--set=sequence_parallel_size={sp}");
        extra.push(&set);
        train(world, &extra, &dir);
        check_against_one(&dir, &p("one"), world, sp, &format!("{name}, {world} ranks SP {sp}"));
    }
}

#[test]
fn token_pooling_with_a_class_token_equals_one_process() {
    // 17 tokens: ranks hold 9 + 8 (SP 2) or 5 + 4 + 4 + 4 (SP 4), the class token on the first
    layouts_equal_one_process(&[], "token pool, 17 tokens");
}

#[test]
fn eval_of_a_sequence_parallel_run_ignores_the_key_and_matches_the_run() {
    let t = tmp();
    let dir = t.path().join("sp2");
    train(2, &["--set=sequence_parallel_size=2"], &dir);
    let w = dir.join("w.safetensors").display().to_string();
    let out = run(&["eval", "--device=cpu", "--weights", &w, "--set=data.val_size=64", "--set=sequence_parallel_size=2", "--json"].map(String::from));
    let loss = last_json(&out)["loss"].as_f64().expect("loss");
    let val = read_json(&dir.join("summary.json"))["val_loss"].as_f64().expect("val_loss");
    assert!(((loss - val) / val).abs() < LOSS_TOL, "eval {loss} vs the run's val_loss {val}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("sequence_parallel_size = 2 ignored"));
}

#[test]
fn average_pooling_without_a_class_token_equals_one_process() {
    layouts_equal_one_process(&["--set=model.class_token=false", "--set=model.global_pool=\"avg\""], "avg pool, 16 tokens");
}

#[test]
fn zero_stages_and_checkpointing_compose_with_sequence_parallelism() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    train(1, &[], &p("one"));
    for stage in [1, 2, 3] {
        let z = format!("--set=zero_optimization.stage={stage}");
        for (world, sp) in [(4usize, 2usize), (4, 4)] {
            let dir = p(&format!("z{stage}w{world}sp{sp}"));
            train(world, &[&z, &format!("--set=sequence_parallel_size={sp}")], &dir);
            check_against_one(&dir, &p("one"), world, sp, &format!("ZeRO {stage}, {world} ranks SP {sp}"));
        }
    }
    // activation checkpointing runs each block's forward again, exchanges included
    let dir = p("blocks");
    train(2, &["--set=sequence_parallel_size=2", "--set=train.recompute=\"blocks\""], &dir);
    check_against_one(&dir, &p("one"), 2, 2, "checkpointed blocks, SP 2");
    // regenerated LayerNorm/GELU outputs, and micro-batches of 8 run as passes of 3, 3 and 2
    let dir = p("regen");
    train(4, &["--set=sequence_parallel_size=4", "--set=train.recompute=\"always\"", "--set=train.pass_images=3"], &dir);
    check_against_one(&dir, &p("one"), 4, 4, "regenerated activations in passes of 3, SP 4");
    // stochastic depth: each image's branch factors scale its rows on every rank of the group
    let drop = "--set=model.drop_path_rate=0.2";
    train(1, &[drop], &p("drop_one"));
    let dir = p("drop");
    train(4, &[drop, "--set=sequence_parallel_size=2"], &dir);
    check_against_one(&dir, &p("drop_one"), 4, 2, "stochastic depth, 4 ranks SP 2");
}

#[test]
fn checkpoints_resume_across_sequence_parallel_layouts() {
    // one process's step-2 checkpoint continued by 4 ranks as DP 2 × SP 2 (the batch triple
    // re-derived for 2 data-parallel slots), and a DP 2 × SP 2 checkpoint continued by one
    // process: both end with the uninterrupted run's weights
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    let ck = |d: &str| p(d).join("checkpoints/step_000002").display().to_string();
    let every = "--set=train.checkpoint_every=2";
    train(1, &[every], &p("straight"));
    train(4, &[every, "--set=sequence_parallel_size=2", "--resume", &ck("straight")], &p("one_to_sp"));
    train(4, &[every, "--set=sequence_parallel_size=2"], &p("sp"));
    train(1, &[every, "--resume", &ck("sp")], &p("sp_to_one"));
    // ZeRO-3 under DP 2 × SP 2 writes the whole weights, gathered; 2 ranks as one SP group of 2
    // at stage 3 continue them
    let s3 = "--set=zero_optimization.stage=3";
    train(4, &[every, s3, "--set=sequence_parallel_size=2"], &p("sp_s3"));
    train(2, &[every, s3, "--set=sequence_parallel_size=2", "--resume", &ck("sp_s3")], &p("sp_s3_to_sp2"));
    for name in ["one_to_sp", "sp_to_one", "sp_s3", "sp_s3_to_sp2"] {
        let d = max_rel_diff(&p(name), &p("straight"));
        eprintln!("resumed {name} vs straight: {d:e}");
        assert!(d < WEIGHTS_TOL, "{name}: {d:e}");
    }
    assert!(std::fs::read_to_string(p("one_to_sp").join("metrics.jsonl")).unwrap_or_default().contains("\"kind\":\"resume\""));
}

// ---- the configuration ---------------------------------------------------------------------

fn resolve(v: serde_json::Value, world: usize) -> Result<vitscale::config::RunConfig, String> {
    vitscale::config::resolve(&v, world).map_err(|e| e.to_string())
}

#[test]
fn the_batch_triple_counts_the_data_parallel_degree() {
    let c = resolve(serde_json::json!({"sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}), 4).expect("config");
    assert_eq!((c.batch.train_batch_size, c.batch.world_size, c.batch.sequence_parallel_size, c.batch.ranks()), (32, 2, 2, 4));
    // DeepSpeed's check, against the data-parallel degree
    let e = resolve(serde_json::json!({"sequence_parallel_size": 2, "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}), 4).unwrap_err();
    assert!(e.contains("64 != 8 * 2 * 2"), "{e}");
    // the default is 1: every rank is data parallel
    let c = resolve(serde_json::json!({"train_micro_batch_size_per_gpu": 8}), 4).expect("config");
    assert_eq!((c.batch.train_batch_size, c.batch.sequence_parallel_size), (32, 1));
}

#[test]
fn bad_sizes_are_errors_naming_the_key() {
    // not a divisor of the world size
    let e = resolve(serde_json::json!({"sequence_parallel_size": 4}), 6).unwrap_err();
    assert!(e.contains("sequence_parallel_size") && e.contains("world size 6"), "{e}");
    // not a divisor of the heads (the built-in preset has 4)
    let e = resolve(serde_json::json!({"sequence_parallel_size": 3}), 3).unwrap_err();
    assert!(e.contains("sequence_parallel_size") && e.contains("model.num_heads (4)") && e.contains('3'), "{e}");
    // more ranks than tokens: 2×2 patches + class token, 8 heads
    let tiny = serde_json::json!({"sequence_parallel_size": 8, "model": {"image_size": 8, "patch_size": 4, "embed_dim": 64, "num_heads": 8, "depth": 1}});
    let e = resolve(tiny, 8).unwrap_err();
    assert!(e.contains("sequence_parallel_size") && e.contains("5 tokens"), "{e}");
    let e = resolve(serde_json::json!({"sequence_parallel_size": 0}), 2).unwrap_err();
    assert!(e.contains("sequence_parallel_size"), "{e}");
    // a batch split by rank has no meaning inside a group
    let e = resolve(serde_json::json!({"sequence_parallel_size": 2, "train": {"balance": "auto"}}), 4).unwrap_err();
    assert!(e.contains("sequence_parallel_size") && e.contains("train.balance"), "{e}");
}

#[test]
fn the_memory_estimate_divides_the_activations_by_the_group() {
    let be = vitscale::backend::cpu::Cpu::new();
    let plan = |sp: usize| {
        let c = resolve(serde_json::json!({"sequence_parallel_size": sp, "train_micro_batch_size_per_gpu": 8}), 4).expect("config");
        vitscale::train::plan::Plan::for_run(&be, &c).memory.expect("estimate")
    };
    let (one, two) = (plan(1), plan(2));
    assert!((one.activations / two.activations - 2.0).abs() < 1e-9, "{} vs {}", one.activations, two.activations);
    assert_eq!((one.params, one.grads, one.optimizer), (two.params, two.grads, two.optimizer));
}

#[test]
fn a_world_the_group_does_not_divide_fails_before_training() {
    // 3 ranks, groups of 2: every rank stops at the configuration with the key named
    let t = tmp();
    let mut args = launch_args(3);
    args.extend(["train", "--device=cpu", "--set=train.steps=1", "--set=sequence_parallel_size=2", "--run-dir"].iter().map(|s| s.to_string()));
    args.push(t.path().join("r").display().to_string());
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vitscale")).args(&args).output().expect("run vitscale");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sequence_parallel_size") && err.contains("world size 3"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
