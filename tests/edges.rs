//! Rough edges a new user hits through the binary: output into a pipe whose reader went away,
//! errors that must name what is wrong (checkpoints, sweep directories, weights, traces),
//! device defaults, sweep specs and their directories, the planner's inputs and the report's
//! figures. Every test drives `vitscale` the way a user does, on tiny CPU runs.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::EXE;

/// The binary in a scratch working directory, no launcher variables inherited.
fn vitscale(cwd: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(EXE);
    cmd.args(args).current_dir(cwd).stdin(Stdio::null());
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "VITSCALE_RUN_ID", "VITSCALE_JOB_ID"] {
        cmd.env_remove(k);
    }
    cmd.output().expect("the vitscale binary runs")
}

/// The binary with its stdout a pipe whose reader closed before anything was written
/// (`vitscale … | head -0`); stderr is captured.
fn vitscale_closed_stdout(cwd: &Path, args: &[&str]) -> Output {
    let mut cmd = Command::new(EXE);
    cmd.args(args).current_dir(cwd).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "VITSCALE_RUN_ID", "VITSCALE_JOB_ID"] {
        cmd.env_remove(k);
    }
    let mut child = cmd.spawn().expect("the vitscale binary runs");
    drop(child.stdout.take());
    child.wait_with_output().expect("vitscale ends")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(o: &Output, what: &str) {
    assert!(o.status.success(), "{what} failed ({:?}): {}\n{}", o.status, String::from_utf8_lossy(&o.stdout), stderr(o));
}

/// A failure (status 1) whose stderr holds every one of `needles`.
fn fails_saying(o: &Output, what: &str, needles: &[&str]) -> String {
    let e = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{what}: expected status 1, got {:?}\n{e}", o.status);
    assert!(!e.contains("panicked"), "{what} panicked: {e}");
    for n in needles {
        assert!(e.contains(n), "{what}: stderr lacks {n:?}:\n{e}");
    }
    e
}

/// A small, quick CPU run on the built-in data.
const SMALL: &[&str] = &["--device", "cpu", "--set", "data.train_size=128", "--set", "data.val_size=32", "--set", "train.steps=2"];

fn train<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["train"];
    a.extend_from_slice(SMALL);
    a.extend_from_slice(extra);
    a
}

/// A sweep spec of `points` tiny CPU points (micro sizes) named `name`.
fn write_spec(dir: &Path, name: &str, grid: serde_json::Value) -> PathBuf {
    let spec = serde_json::json!({
        "name": name,
        "base": {
            "model": {"preset": "vit_builtin_default"},
            "data": {"dataset": "builtin", "train_size": 128, "val_size": 32, "num_workers": 1},
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}}
        },
        "grid": grid,
        "device": "cpu", "steps": 2, "warmup_steps": 1, "timeout_s": 120
    });
    let path = dir.join(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(&spec).expect("json")).expect("write spec");
    path
}

fn jsonl_lines(path: &Path) -> usize {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter(|l| !l.trim().is_empty()).count()
}

// ---- 13: a closed stdout ---------------------------------------------------------------------

/// Every command that prints results into a pipe whose reader closed finishes its work and
/// exits 0 without a panic: a run writes its run directory, a sweep runs and records every
/// point, the planner and the report print their tables.
#[test]
fn a_closed_stdout_neither_panics_nor_stops_the_work() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    let o = vitscale_closed_stdout(cwd, &train(&["--run-dir", "r", "--save-weights", "w.safetensors", "--json"]));
    ok(&o, "train --json into a closed pipe");
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    assert!(cwd.join("r").join("summary.json").is_file(), "the run directory is complete");

    let o = vitscale_closed_stdout(cwd, &["eval", "--device", "cpu", "--weights", "w.safetensors", "--set", "data.val_size=32", "--json"]);
    ok(&o, "eval --json into a closed pipe");

    let spec = write_spec(cwd, "pipe", serde_json::json!({"train_micro_batch_size_per_gpu": [8, 16, 32]}));
    let o = vitscale_closed_stdout(cwd, &["sweep", spec.to_str().expect("utf-8"), "--out", "sw", "--json"]);
    ok(&o, "sweep --json into a closed pipe");
    assert_eq!(jsonl_lines(&cwd.join("sw").join("sweep.jsonl")), 3, "every point recorded");

    let o = vitscale_closed_stdout(cwd, &["report", "sw", "--json"]);
    ok(&o, "report --json into a closed pipe");

    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs").join("data").join("profile_h200_vit_small_patch4_32.json");
    let cluster = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs").join("clusters").join("h200_8_nvlink.json");
    let o = vitscale_closed_stdout(cwd, &["plan", "--profile", data.to_str().expect("utf-8"), "--cluster", cluster.to_str().expect("utf-8"), "--recommend", "--global-batch", "1024"]);
    ok(&o, "plan --recommend into a closed pipe");
}
