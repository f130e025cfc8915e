//! Data parallelism end to end through the `vitscale` binary: N ranks under `vitscale launch`
//! train the same weights as one process with the same global batch; gradient accumulation
//! is equivalent to a larger micro-batch; checkpoints resume exactly, also on another world
//! size; the launcher reports and stops failing or interrupted runs.
//!
//! Runs are tiny (default model, 16-px built-in images, 4 steps of 32 images, 200 validation
//! images): each takes about a second.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_vitscale");

/// Weights may differ between splits of the same global batch only by the order in which
/// per-sample gradients are summed (f32 rounding). Measured after 4 SGD steps: ~1.5e-8
/// relative (2 and 4 ranks, GAS 4×8 vs 1×32); AdamW, whose normalization amplifies rounding
/// on near-zero gradients, gives ~5e-6, which is why these runs use SGD.
const SPLIT_TOL: f32 = 1e-6;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("loopback port")
}

/// The settings every run here shares: 4 steps of a 32-image global batch, SGD with momentum
/// (Adam would amplify rounding differences on near-zero gradients), checkpoints every 2.
fn common(steps: u64) -> Vec<String> {
    [
        "--device=cpu".to_string(),
        format!("--set=train.steps={steps}"),
        "--set=train_batch_size=32".into(),
        "--set=data.val_size=200".into(),
        "--set=train.checkpoint_every=2".into(),
        "--set=optimizer={\"type\":\"SGD\",\"params\":{\"lr\":0.05,\"momentum\":0.9}}".into(),
    ]
    .into()
}

fn run(args: &[String]) -> Output {
    let out = Command::new(EXE).args(args).env_remove("VITSCALE_RUN_ID").stdin(Stdio::null()).output().expect("run vitscale");
    if !out.status.success() {
        panic!("vitscale {args:?} failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    out
}

/// `vitscale [launch --nproc-per-node n --] train <common> <extra> --run-dir dir`.
fn train(nproc: usize, steps: u64, extra: &[&str], dir: &Path) -> Output {
    let mut args = Vec::new();
    if nproc > 1 {
        args.extend(["launch".to_string(), format!("--nproc-per-node={nproc}"), format!("--master-port={}", free_port()), "--".into()]);
    }
    args.push("train".into());
    args.extend(common(steps));
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--run-dir".into(), dir.display().to_string(), "--save-weights".into(), dir.join("w.safetensors").display().to_string()]);
    run(&args)
}

fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("w.safetensors")).expect("weights written");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Largest |a − b| / (1 + |b|) over all weights.
fn max_rel_diff(a: &Path, b: &Path) -> f32 {
    let (wa, wb) = (weights(a), weights(b));
    assert_eq!(wa.len(), wb.len());
    let mut worst = 0f32;
    for ((na, va), (nb, vb)) in wa.iter().zip(&wb) {
        assert_eq!(na, nb);
        for (x, y) in va.iter().zip(vb) {
            assert!(x.is_finite() && y.is_finite(), "{na}: non-finite weight");
            worst = worst.max((x - y).abs() / (1.0 + y.abs()));
        }
    }
    worst
}

fn json_line(out: &Output) -> serde_json::Value {
    let s = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(s.lines().last().expect("a --json line")).expect("last stdout line is JSON")
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

#[test]
fn ranks_match_one_process_with_the_same_global_batch() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    // One process: GAS 4 × micro 8. Two ranks: GAS 2 × micro 8. Four ranks: GAS 1 × micro 8.
    let one = train(1, 4, &["--set=train_micro_batch_size_per_gpu=8", "--json"], &p("one"));
    let two = train(2, 4, &["--set=train_micro_batch_size_per_gpu=8", "--json"], &p("two"));
    train(4, 4, &["--set=train_micro_batch_size_per_gpu=8"], &p("four"));
    let d2 = max_rel_diff(&p("two"), &p("one"));
    let d4 = max_rel_diff(&p("four"), &p("one"));
    eprintln!("max relative weight difference vs 1 process: 2 ranks {d2:e}, 4 ranks {d4:e}");
    assert!(d2 < SPLIT_TOL && d4 < SPLIT_TOL, "2 ranks: {d2:e}, 4 ranks: {d4:e}");
    // The launcher passes rank 0's --json line through untouched, and the loss is global.
    let (l1, l2) = (json_line(&one)["train_loss"].as_f64().unwrap_or(f64::NAN), json_line(&two)["train_loss"].as_f64().unwrap_or(0.0));
    assert!((l1 - l2).abs() < 1e-5, "train_loss {l1} vs {l2}");
    // Rank 0 owns the run directory; other ranks log beside it.
    assert!(p("two").join("metrics.jsonl").is_file() && p("two").join("rank1").join("metrics.jsonl").is_file());
}

#[test]
fn gradient_accumulation_equals_a_larger_micro_batch() {
    let t = tmp();
    train(1, 4, &["--set=train_micro_batch_size_per_gpu=8", "--set=gradient_accumulation_steps=4"], &t.path().join("gas4"));
    train(1, 4, &["--set=train_micro_batch_size_per_gpu=32", "--set=gradient_accumulation_steps=1"], &t.path().join("gas1"));
    let d = max_rel_diff(&t.path().join("gas4"), &t.path().join("gas1"));
    eprintln!("max relative weight difference GAS 4 x 8 vs GAS 1 x 32: {d:e}");
    assert!(d < SPLIT_TOL, "{d:e}");
}

#[test]
fn resume_continues_exactly_and_on_another_world_size() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    let micro = "--set=train_micro_batch_size_per_gpu=16";
    train(1, 4, &[micro], &p("straight"));
    // Stop after 2 steps (a checkpoint is written at step 2), then continue to step 4.
    train(1, 2, &[micro], &p("first"));
    assert_eq!(std::fs::read_to_string(p("first").join("checkpoints/latest")).unwrap_or_default().trim(), "step_000002");
    let first = p("first");
    train(1, 4, &[micro, "--resume", "latest"], &first);
    // Same process count: bitwise the same weights as the uninterrupted run.
    assert_eq!(weights(&first), weights(&p("straight")), "1 → 1 resume is not exact");
    // Two ranks resume the 1-process checkpoint: the global batch is kept (GAS 2 → 1).
    let ck = p("first").join("checkpoints").join("step_000002");
    train(2, 4, &[micro, "--resume", &ck.display().to_string()], &p("two"));
    let d = max_rel_diff(&p("two"), &p("straight"));
    eprintln!("max relative weight difference, resumed on 2 ranks vs straight: {d:e}");
    assert!(d < SPLIT_TOL, "1 → 2 ranks resume: {d:e}");
    // keep-last: steps 2 and 4 of the resumed run are both there (3 kept by default).
    assert!(p("first").join("checkpoints/step_000004/manifest.json").is_file());
}

#[test]
fn a_failing_rank_fails_the_launch_naming_it() {
    let t = tmp();
    let t0 = Instant::now();
    // An unknown key fails every rank at config time, before rendezvous.
    let out = Command::new(EXE)
        .args(["launch", "--nproc-per-node=2", &format!("--master-port={}", free_port()), "--", "train", "--set=train.no_such_key=1"])
        .arg(format!("--run-dir={}", t.path().display()))
        .stdin(Stdio::null())
        .output()
        .expect("run vitscale");
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no_such_key"), "{err}");
    assert!(err.contains("error: rank ") && err.contains("failed with exit status 1"), "{err}");
}

#[test]
fn the_launcher_forwards_sigterm_and_stops_its_workers() {
    let t = tmp();
    let pids = t.path().join("pids");
    let script = format!("echo $$ >> '{}'; exec sleep 60", pids.display());
    let mut child = Command::new(EXE)
        .args(["launch", "--nproc-per-node=2", "--worker-program=/bin/sh", "--", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn launcher");
    // Wait until both workers are up.
    let t0 = Instant::now();
    while std::fs::read_to_string(&pids).map(|s| s.lines().count()).unwrap_or(0) < 2 {
        assert!(t0.elapsed() < Duration::from_secs(10), "workers did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill(2) on the launcher we spawned.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let t1 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        assert!(t1.elapsed() < Duration::from_secs(10), "launcher did not stop");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
    // Every worker is gone (kill(pid, 0) fails for a pid that no longer exists).
    for line in std::fs::read_to_string(&pids).unwrap_or_default().lines() {
        let pid: libc::pid_t = line.trim().parse().expect("pid");
        // SAFETY: signal 0 only checks existence.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        assert!(!alive, "worker {pid} survived");
    }
}
