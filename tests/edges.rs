//! Rough edges a new user hits through the binary: output into a pipe whose reader went away,
//! errors that must name what is wrong (checkpoints, sweep directories, weights, traces),
//! device defaults, sweep specs and their directories, the planner's inputs and the report's
//! figures. Every test drives `vitscale` the way a user does, on tiny CPU runs.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{vitscale, vitscale_env, EXE};

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

/// `vitscale sweep … 2>&1 | head -1`: with stdout and stderr both a closed pipe, the sweep still
/// runs and records every point and exits 0 (its progress lines go nowhere).
#[test]
fn a_sweep_whose_output_pipe_closed_runs_every_point() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    let spec = write_spec(cwd, "both", serde_json::json!({"train_micro_batch_size_per_gpu": [8, 16, 32]}));
    let mut cmd = Command::new(EXE);
    cmd.args(["sweep", spec.to_str().expect("utf-8"), "--out", "sw", "--json"]).current_dir(cwd).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).env_remove("VITSCALE_RUN_ID");
    let mut child = cmd.spawn().expect("spawn");
    drop(child.stdout.take());
    drop(child.stderr.take());
    let status = child.wait().expect("the sweep ends");
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert_eq!(jsonl_lines(&cwd.join("sw").join("sweep.jsonl")), 3, "every point recorded");
    assert!(!cwd.join("sw").join("sweep.lock").exists());
}

// ---- 14: errors that say what is wrong ----------------------------------------------------

/// A `latest` pointer naming a step directory that is gone, or one that is empty, says the
/// checkpoint is incomplete or missing and names the directory; `--resume latest` on a run
/// without checkpoints says the run directory has none.
#[test]
fn every_broken_checkpoint_is_named_as_incomplete_or_missing() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    let o = vitscale(cwd, &train(&["--run-dir", "plain"]));
    ok(&o, "a run without checkpoints");
    let o = vitscale(cwd, &train(&["--run-dir", "plain", "--resume", "latest"]));
    fails_saying(&o, "--resume latest without checkpoints", &["no checkpoints", "plain"]);

    let o = vitscale(cwd, &train(&["--run-dir", "ck", "--set", "train.checkpoint_every=1"]));
    ok(&o, "a run with checkpoints");
    let root = cwd.join("ck").join("checkpoints");
    let latest = std::fs::read_to_string(root.join("latest")).expect("latest").trim().to_string();
    assert!(latest.starts_with("step_"), "{latest}");
    // the pointer names a step that is gone
    std::fs::write(root.join("latest"), "step_000099\n").expect("write latest");
    let o = vitscale(cwd, &train(&["--run-dir", "ck", "--resume", "latest"]));
    let e = fails_saying(&o, "latest naming a missing step", &["incomplete", "missing", "step_000099"]);
    assert!(!e.contains("No such file"), "{e}");
    // the pointer names an empty step directory
    std::fs::create_dir(root.join("step_000099")).expect("mkdir");
    let o = vitscale(cwd, &train(&["--run-dir", "ck", "--resume", "latest"]));
    let e = fails_saying(&o, "latest naming an empty step", &["incomplete", "missing", "step_000099"]);
    assert!(!e.contains("No such file"), "{e}");
    // a step directory whose state is gone, given directly
    std::fs::remove_file(root.join(&latest).join("state.json")).expect("rm state");
    let step = root.join(&latest);
    let o = vitscale(cwd, &train(&["--run-dir", "ck", "--resume", step.to_str().expect("utf-8")]));
    let e = fails_saying(&o, "a step without state.json", &["incomplete", "state.json", "missing", &latest]);
    assert!(!e.contains("No such file"), "{e}");
}

/// `sweep --out` naming a file says it is a file, not a directory.
#[test]
fn a_sweep_out_that_is_a_file_is_named() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    std::fs::write(cwd.join("afile"), "x").expect("write");
    let spec = write_spec(cwd, "onto-file", serde_json::json!({"train_micro_batch_size_per_gpu": [8]}));
    let o = vitscale(cwd, &["sweep", spec.to_str().expect("utf-8"), "--out", "afile"]);
    let e = fails_saying(&o, "sweep --out AFILE", &["afile", "not a directory"]);
    assert!(!e.contains("File exists"), "{e}");
}

/// Weights holding a NaN (or an infinity) in any tensor are refused naming that tensor,
/// instead of evaluating to a loss of NaN and a chance top-1.
#[test]
fn weights_holding_a_nan_are_refused_naming_the_tensor() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    ok(&vitscale(cwd, &train(&["--run-dir", "r", "--save-weights", "w.safetensors"])), "train");
    let tensors = common::tensors(&cwd.join("w.safetensors"));
    let bytes = std::fs::read(cwd.join("w.safetensors")).expect("weights");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    for (victim, bad) in [(tensors[0].0.clone(), f32::NAN), (tensors[tensors.len() - 1].0.clone(), f32::INFINITY)] {
        let mut owned: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
        for (name, values) in &tensors {
            let mut v = values.clone();
            if *name == victim {
                let mid = v.len() / 2;
                v[mid] = bad;
            }
            owned.push((name.clone(), st.tensor(name).expect("tensor").shape().to_vec(), v));
        }
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
            .iter()
            .map(|(n, s, v)| (n.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), bytemuck::cast_slice(v)).expect("view")))
            .collect();
        let path = cwd.join("bad.safetensors");
        std::fs::write(&path, safetensors::serialize(views, &None).expect("serialize")).expect("write");
        let o = vitscale(cwd, &["eval", "--device", "cpu", "--weights", "bad.safetensors", "--set", "data.val_size=32"]);
        fails_saying(&o, "eval of damaged weights", &["bad.safetensors", &victim, "non-finite"]);
    }
}

/// `train --trace DIR` refuses a DIR that already holds this rank's trace, naming the file,
/// before training.
#[test]
fn a_trace_is_never_written_over() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    ok(&vitscale(cwd, &train(&["--run-dir", "a", "--trace", "tr"])), "train --trace");
    let file = cwd.join("tr").join("trace-rank0.json");
    let first = std::fs::read(&file).expect("the trace");
    let o = vitscale(cwd, &train(&["--run-dir", "b", "--trace", "tr"]));
    fails_saying(&o, "a second trace into the same directory", &["trace-rank0.json", "already"]);
    assert!(!cwd.join("b").join("summary.json").exists(), "refused before training");
    assert_eq!(std::fs::read(&file).expect("the trace"), first, "the first trace is kept");
}

// ---- 9: device defaults and the CPU bench's figures ---------------------------------------

/// Without a usable GPU, plain `bench` and `selftest` run on the CPU (as `train` does), saying
/// so; the CPU bench prints no figure that only looks measured (a peak memory of 0.00 GiB, 0.0
/// GFLOP per image, 0.0 TFLOP/s).
#[test]
fn bench_and_selftest_default_to_auto_and_print_real_figures() {
    let tmp = tempfile::tempdir().expect("scratch");
    let no_gpu = [("CUDA_VISIBLE_DEVICES", "")];
    let o = vitscale_env(tmp.path(), &["bench", "--model", "vit_builtin_default", "--steps", "2", "--warmup", "1"], &no_gpu);
    ok(&o, "plain bench without a GPU");
    assert!(stderr(&o).contains("running on the CPU"), "{}", stderr(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("on cpu"), "{s}");
    for shown_as_zero in ["0.00 GiB", " 0.0 GFLOP", " 0.0 TFLOP/s"] {
        assert!(!s.contains(shown_as_zero), "{shown_as_zero:?} in {s}");
    }
    assert!(s.contains("peak mem n/a on the CPU"), "{s}");
    let o = vitscale_env(tmp.path(), &["selftest"], &no_gpu);
    ok(&o, "plain selftest without a GPU");
    assert!(stderr(&o).contains("running on the CPU"), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("PASS"));
}

/// The bench result names both recompute settings: a run with `--recompute blocks` says its
/// blocks were checkpointed (line and JSON), and whether they kept their attention outputs
/// (never under `blocks_full`); one without says they were not.
#[test]
fn bench_says_whether_blocks_were_checkpointed() {
    let tmp = tempfile::tempdir().expect("scratch");
    // (the built-in model at 16 px: 17 tokens over head dim 16, so the CPU's probabilities are
    // larger than the attention output and the whole block runs again; at 12 px, 10 tokens,
    // each block keeps its attention output)
    let cases: [(&[&str], bool, bool); 4] = [
        (&["--recompute", "blocks"], true, false),
        (&["--recompute", "blocks", "--img", "12"], true, true),
        (&["--recompute", "blocks_full", "--img", "12"], true, false),
        (&[], false, false),
    ];
    for (extra, want, kept) in cases {
        let mut args = vec!["bench", "--device", "cpu", "--model", "vit_builtin_default", "--micro", "4", "--steps", "1", "--warmup", "0", "--json"];
        args.extend_from_slice(extra);
        let o = vitscale(tmp.path(), &args);
        ok(&o, "bench");
        let s = String::from_utf8_lossy(&o.stdout);
        let line = format!("blocks checkpointed {want}{} |", if kept { " (attention outputs kept)" } else { "" });
        assert!(s.contains(&line), "{extra:?}: {s}");
        let json: serde_json::Value = serde_json::from_str(s.lines().rev().find(|l| l.starts_with('{')).expect("a JSON line")).expect("JSON");
        assert_eq!(json["checkpointed"], serde_json::Value::Bool(want), "{s}");
        assert_eq!(json["attention_kept"], serde_json::Value::Bool(kept), "{s}");
    }
}

// ---- 12: sweeps ---------------------------------------------------------------------------

/// A grid (or set) key the configuration does not know is an error before any point runs,
/// naming the key and the nearest known one, at the top level and inside a section.
#[test]
fn an_unknown_grid_key_is_refused_before_any_point_runs() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    let spec = write_spec(cwd, "typo", serde_json::json!({"train_micro_batch_sise_per_gpu": [8, 16]}));
    let o = vitscale(cwd, &["sweep", spec.to_str().expect("utf-8"), "--out", "sw"]);
    fails_saying(&o, "a top-level typo", &["train_micro_batch_sise_per_gpu", "did you mean \"train_micro_batch_size_per_gpu\""]);
    assert!(!cwd.join("sw").join("points").exists(), "no point ran");
    let spec = write_spec(cwd, "typo2", serde_json::json!({"train.stpes": [2], "nproc": [1]}));
    let o = vitscale(cwd, &["sweep", spec.to_str().expect("utf-8"), "--out", "sw2"]);
    fails_saying(&o, "a typo in a section", &["train.stpes", "did you mean \"steps\""]);
    assert!(!cwd.join("sw2").join("points").exists(), "no point ran");
    // a known key passes the check (and its points run)
    let spec = write_spec(cwd, "fine", serde_json::json!({"train_micro_batch_size_per_gpu": [8]}));
    ok(&vitscale(cwd, &["sweep", spec.to_str().expect("utf-8"), "--out", "sw3"]), "a known key");
}

/// A grid value listed twice, and a spec name that is not one plain path component, are
/// refused before anything is written.
#[test]
fn duplicate_grid_values_and_names_outside_sweeps_are_refused() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    let spec = write_spec(cwd, "dup", serde_json::json!({"train_micro_batch_size_per_gpu": [8, 16, 8]}));
    let o = vitscale(cwd, &["sweep", spec.to_str().expect("utf-8"), "--out", "sw"]);
    fails_saying(&o, "a duplicate grid value", &["grid.train_micro_batch_size_per_gpu", "8", "twice"]);
    assert!(!cwd.join("sw").exists());
    let work = cwd.join("a").join("b");
    std::fs::create_dir_all(&work).expect("mkdir");
    for name in ["../../x", "x/y", ".."] {
        let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(write_spec(&work, "named", serde_json::json!({"train_micro_batch_size_per_gpu": [8]}))).expect("spec")).expect("json");
        v["name"] = serde_json::json!(name);
        std::fs::write(work.join("named.json"), v.to_string()).expect("write");
        let o = vitscale(&work, &["sweep", "named.json"]);
        fails_saying(&o, &format!("name {name:?}"), &["name", name]);
    }
    assert!(!work.join("x").exists() && !cwd.join("a").join("x").exists() && !cwd.join("x").exists(), "nothing written outside sweeps/");
}

/// A sweep directory another live process runs is refused naming that process; a lock left
/// by a process that is gone is taken over; the lock is gone when the sweep ends.
#[test]
fn one_runner_per_sweep_directory() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    let spec = write_spec(cwd, "locked", serde_json::json!({"train_micro_batch_size_per_gpu": [8, 16]}));
    let spec = spec.to_str().expect("utf-8");
    std::fs::create_dir(cwd.join("sw")).expect("mkdir");
    let live = std::process::id().to_string();
    std::fs::write(cwd.join("sw").join("sweep.lock"), format!("{live}\n")).expect("lock");
    let o = vitscale(cwd, &["sweep", spec, "--out", "sw", "--resume"]);
    fails_saying(&o, "a sweep another process runs", &["sw", &live, "sweep.lock"]);
    assert_eq!(jsonl_lines(&cwd.join("sw").join("sweep.jsonl")), 0, "no point ran");

    let mut gone = Command::new("true").spawn().expect("spawn true");
    let dead = gone.id().to_string();
    gone.wait().expect("true ends");
    std::fs::write(cwd.join("sw").join("sweep.lock"), format!("{dead}\n")).expect("lock");
    let o = vitscale(cwd, &["sweep", spec, "--out", "sw", "--resume"]);
    ok(&o, "a stale lock");
    assert!(stderr(&o).contains("stale"), "{}", stderr(&o));
    assert_eq!(jsonl_lines(&cwd.join("sw").join("sweep.jsonl")), 2);
    assert!(!cwd.join("sw").join("sweep.lock").exists(), "the lock is removed at the end");
}

/// `--resume` with a spec whose grid or base changed is refused naming each change; the same
/// spec resumes.
#[test]
fn a_resume_with_another_spec_is_refused_naming_the_change() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    let path = write_spec(cwd, "changing", serde_json::json!({"train_micro_batch_size_per_gpu": [8, 16]}));
    let spec = path.to_str().expect("utf-8");
    ok(&vitscale(cwd, &["sweep", spec, "--out", "sw"]), "the first run");
    ok(&vitscale(cwd, &["sweep", spec, "--out", "sw", "--resume"]), "a resume of the same spec");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).expect("spec")).expect("json");
    v["grid"]["train_micro_batch_size_per_gpu"] = serde_json::json!([8, 32]);
    v["base"]["optimizer"]["params"]["lr"] = serde_json::json!(0.1);
    std::fs::write(&path, v.to_string()).expect("write");
    let o = vitscale(cwd, &["sweep", spec, "--out", "sw", "--resume"]);
    fails_saying(&o, "a resume of a changed spec", &["spec differs", "grid", "32", "base.optimizer.params.lr", "0.1"]);
    assert_eq!(jsonl_lines(&cwd.join("sw").join("sweep.jsonl")), 2, "nothing ran");
    let o = vitscale(cwd, &["sweep", spec, "--out", "sw", "--resume", "--set", "train.seed=7"]);
    fails_saying(&o, "a resume with another --set", &["set.train.seed"]);
}

/// SIGINT and SIGTERM stop a sweep with 128 + the signal, as a shell reports it.
#[test]
fn a_signal_stops_a_sweep_with_128_plus_the_signal() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(write_spec(cwd, "long", serde_json::json!({"train_micro_batch_size_per_gpu": [8, 16]}))).expect("spec")).expect("json");
    v["steps"] = serde_json::json!(100000);
    std::fs::write(cwd.join("long.json"), v.to_string()).expect("write");
    for (sig, code, out) in [(libc::SIGINT, 130, "a"), (libc::SIGTERM, 143, "b")] {
        let child = Command::new(EXE)
            .args(["sweep", "long.json", "--out", out])
            .current_dir(cwd)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .env_remove("VITSCALE_RUN_ID")
            .spawn()
            .expect("spawn");
        let first = cwd.join(out).join("points");
        let t = std::time::Instant::now();
        while !std::fs::read_dir(&first).map(|mut d| d.next().is_some()).unwrap_or(false) {
            assert!(t.elapsed().as_secs() < 60, "no point started");
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
        // SAFETY: signals the child this test started.
        unsafe { libc::kill(child.id() as i32, sig) };
        let o = child.wait_with_output().expect("the sweep ends");
        assert_eq!(o.status.code(), Some(code), "signal {sig}: {}", stderr(&o));
        assert!(stderr(&o).contains("--resume"), "{}", stderr(&o));
        assert!(!cwd.join(out).join("sweep.lock").exists(), "the lock is removed");
    }
}

// ---- 11: the report's figures and text ----------------------------------------------------

/// A point's bus bandwidth is its total bytes over its total reduction time, not a mean of
/// per-record ratios (a short fast window would weigh like a long slow one).
#[test]
fn bus_bandwidth_is_total_bytes_over_total_time() {
    let tmp = tempfile::tempdir().expect("scratch");
    let run = tmp.path();
    let cfg = serde_json::json!({"plan": {"world_size": 2, "micro_batch": 8, "gradient_accumulation_steps": 1, "global_batch": 16}});
    std::fs::write(run.join("config.json"), cfg.to_string()).expect("config");
    let line = |rank: usize, step: u64, bytes: f64, secs: f64| {
        let bus = bytes * 2.0 * 1.0 / 2.0 / secs / 1e9;
        serde_json::json!({"step": step, "rank": rank, "images_per_s": 100.0, "loss": 1.0, "comm_s": secs, "comm_total_s": secs, "comm_bytes": bytes, "bus_gb_s": bus, "forward_s": 0.01, "backward_s": 0.02}).to_string()
    };
    for rank in 0..2 {
        let dir = if rank == 0 { run.to_path_buf() } else { run.join("rank1") };
        std::fs::create_dir_all(&dir).expect("mkdir");
        // one long slow window and one short fast one: 2e9 bytes in 1.01 s in all
        let text = [line(rank, 1, 1e9, 1.0), line(rank, 2, 1e9, 0.01)].join("\n");
        std::fs::write(dir.join("metrics.jsonl"), text).expect("metrics");
    }
    let f = vitscale::lab::summary::read_point(run, 0).expect("the point reads");
    let want = 2e9 / 1.01 / 1e9;
    let got = f.bus_gb_s.expect("a bus bandwidth");
    assert!((got - want).abs() < 1e-9, "bus GB/s {got}, total bytes over total time {want}");
    for r in &f.ranks {
        assert!((r.bus_gb_s.expect("per rank") - want).abs() < 1e-9);
    }
}

/// The report's reproduce commands run as printed (a fresh run directory each), its text says
/// where the figures come from (a point whose run directory is gone keeps sweep.jsonl's and is
/// named), and the table's two communication columns say what each counts.
#[test]
fn the_report_commands_work_and_its_text_is_true() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    let spec = write_spec(cwd, "rep", serde_json::json!({"train_micro_batch_size_per_gpu": [8, 16]}));
    ok(&vitscale(cwd, &["sweep", spec.to_str().expect("utf-8"), "--out", "sw"]), "sweep");
    ok(&vitscale(cwd, &["report", "sw"]), "report");
    let md = std::fs::read_to_string(cwd.join("sw").join("report.md")).expect("report.md");
    assert!(md.contains("recomputed from the finished points' run directories") && md.contains("read from sweep.jsonl"), "{md}");
    assert!(md.contains("bucket comm") && md.contains("agreement on stop signals"), "the columns are explained");
    let commands: Vec<String> = md
        .lines()
        .filter_map(|l| l.split('`').nth(1).filter(|c| c.starts_with("vitscale train")).map(str::to_string))
        .collect();
    assert_eq!(commands.len(), 2, "{md}");
    for c in &commands {
        let line = c.replacen("vitscale", &format!("'{EXE}'"), 1);
        let o = Command::new("sh").arg("-c").arg(&line).current_dir(cwd).stdin(Stdio::null()).env_remove("VITSCALE_RUN_ID").output().expect("sh");
        ok(&o, &format!("the printed command {c}"));
    }
    // a point whose run directory is gone: its figures are sweep.jsonl's, and the text says so
    let first = std::fs::read_dir(cwd.join("sw").join("points")).expect("points").filter_map(Result::ok).map(|e| e.file_name().to_string_lossy().to_string()).min().expect("a point");
    std::fs::remove_dir_all(cwd.join("sw").join("points").join(&first).join("run")).expect("rm run");
    ok(&vitscale(cwd, &["report", "sw"]), "report without a run directory");
    let md = std::fs::read_to_string(cwd.join("sw").join("report.md")).expect("report.md");
    assert!(md.contains(&format!("except for 1 point whose run directory is missing or unreadable ({first})")), "{md}");
    assert!(!md.contains("Every figure below is read from the points' run directories"));
}

/// The projection's table prints throughput with thousands separators.
#[test]
fn the_projection_prints_large_numbers_with_separators() {
    let tmp = tempfile::tempdir().expect("scratch");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let prof = root.join("docs").join("data").join("profile_h200_vit_small_patch4_32.json");
    let cluster = root.join("configs").join("clusters").join("study_32_nodes_h200.json");
    let o = vitscale(tmp.path(), &["plan", "--profile", prof.to_str().expect("utf-8"), "--cluster", cluster.to_str().expect("utf-8"), "--project", "proj"]);
    ok(&o, "plan --project");
    let md = std::fs::read_to_string(tmp.path().join("proj").join("projection.md")).expect("projection.md");
    let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| ") && !l.starts_with("| nodes")).collect();
    assert!(!rows.is_empty(), "{md}");
    for row in rows {
        let ips = row.split('|').nth(4).expect("images/s").trim();
        assert!(ips.len() < 4 || ips.contains(','), "images/s {ips:?} without separators: {row}");
        let digits: String = ips.chars().filter(|c| *c != ',').collect();
        assert!(digits.parse::<f64>().is_ok(), "{ips}");
    }
}

// ---- 10: the planner's inputs -------------------------------------------------------------

/// A CPU profile of the built-in model (quick), at `path` under `cwd`.
fn cpu_profile(cwd: &Path, path: &str) {
    let o = vitscale(cwd, &["bench", "--device", "cpu", "--model", "vit_builtin_default", "--profile-out", path, "--profile-micros", "8,16", "--steps", "2", "--warmup", "1"]);
    ok(&o, "bench --profile-out");
}

fn cluster_file(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("configs").join("clusters").join(name).to_str().expect("utf-8").to_string()
}

/// A profile measured on another device than the cluster's is refused naming both (and the
/// way to predict anyway); a cluster whose compute_scale converts it predicts with a warning.
#[test]
fn a_profile_of_another_device_is_refused_or_flagged() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    cpu_profile(cwd, "cpu.json");
    let h200 = cluster_file("h200_8_nvlink.json");
    let o = vitscale(cwd, &["plan", "--profile", "cpu.json", "--cluster", &h200, "--set", "train_micro_batch_size_per_gpu=16"]);
    fails_saying(&o, "a CPU profile for H200s", &["measured on cpu", "H200", "--allow-device-mismatch"]);
    assert!(o.stdout.is_empty(), "no prediction printed: {}", String::from_utf8_lossy(&o.stdout));
    for extra in [&["--recommend", "--global-batch", "1024"][..], &["--project", "proj"][..]] {
        let mut a = vec!["plan", "--profile", "cpu.json", "--cluster", &h200];
        a.extend_from_slice(extra);
        fails_saying(&vitscale(cwd, &a), &format!("{extra:?}"), &["measured on cpu", "H200"]);
    }
    let o = vitscale(cwd, &["plan", "--profile", "cpu.json", "--cluster", &h200, "--set", "train_micro_batch_size_per_gpu=16", "--allow-device-mismatch"]);
    ok(&o, "--allow-device-mismatch");
    assert!(stderr(&o).contains("warning:") && stderr(&o).contains("H200"), "{}", stderr(&o));
    let o = vitscale(cwd, &["plan", "--profile", "cpu.json", "--cluster", &cluster_file("a100_8x4_ib200.json"), "--set", "train_micro_batch_size_per_gpu=16"]);
    ok(&o, "a cluster with a compute_scale");
    assert!(stderr(&o).contains("warning:") && stderr(&o).contains("compute_scale"), "{}", stderr(&o));
    // the committed H200 profile on the H200 cluster: no warning
    let prof = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs").join("data").join("profile_h200_vit_small_patch4_32.json");
    let o = vitscale(cwd, &["plan", "--profile", prof.to_str().expect("utf-8"), "--cluster", &h200, "--set", "train_micro_batch_size_per_gpu=128"]);
    ok(&o, "an H200 profile on H200s");
    assert!(!stderr(&o).contains("warning"), "{}", stderr(&o));
}

/// A bandwidth given in bytes/s where GB/s is meant, or a latency in nanoseconds, is refused
/// naming the key and the unit, at every level and per collective.
#[test]
fn implausible_link_figures_are_refused_naming_key_and_unit() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    let prof = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs").join("data").join("profile_h200_vit_small_patch4_32.json");
    let base = serde_json::json!({"source": "test", "device": "H200", "gpus_per_node": 8, "nodes": 2,
        "intra": {"bandwidth_gb_s": 450, "latency_us": 2}, "inter": {"bandwidth_gb_s": 360, "latency_us": 6}});
    std::fs::write(cwd.join("good.json"), base.to_string()).expect("write");
    ok(&vitscale(cwd, &["plan", "--profile", prof.to_str().expect("utf-8"), "--cluster", "good.json"]), "plausible figures");
    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        ("intra", serde_json::json!({"bandwidth_gb_s": 4.5e11, "latency_us": 2}), "intra.bandwidth_gb_s"),
        ("inter", serde_json::json!({"all_reduce": {"bandwidth_gb_s": 3.6e11, "latency_us": 6}, "bandwidth_gb_s": 360, "latency_us": 6}), "inter.all_reduce.bandwidth_gb_s"),
        ("inter", serde_json::json!({"bandwidth_gb_s": 360, "latency_us": 6000000}), "inter.latency_us"),
    ];
    for (level, value, key) in cases {
        let mut v = base.clone();
        v[level] = value;
        std::fs::write(cwd.join("bad.json"), v.to_string()).expect("write");
        let o = vitscale(cwd, &["plan", "--profile", prof.to_str().expect("utf-8"), "--cluster", "bad.json"]);
        let unit = if key.ends_with("latency_us") { "microseconds" } else { "GB/s" };
        fails_saying(&o, key, &["bad.json", key, "not plausible", unit]);
    }
}

/// `--recommend` shows choices that differ only in a bucket size predicted alike as one row.
#[test]
fn recommend_collapses_bucket_sizes_predicted_alike() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    cpu_profile(cwd, "cpu.json");
    let o = vitscale(cwd, &["plan", "--profile", "cpu.json", "--cluster", &cluster_file("a100_8x4_ib200.json"), "--recommend", "--global-batch", "2048", "--top", "1000", "--json"]);
    ok(&o, "plan --recommend");
    let out = String::from_utf8_lossy(&o.stdout);
    let j: serde_json::Value = serde_json::from_str(out.lines().last().expect("json")).expect("json");
    let choices = j["choices"].as_array().expect("choices");
    let mut seen = std::collections::HashSet::new();
    for c in choices {
        let key = (c["micro"].to_string(), c["gas"].to_string(), c["zero_stage"].to_string(), c["comm_dtype"].to_string(), c["images_per_s"].to_string(), c["memory_per_rank_bytes"].to_string());
        assert!(seen.insert(key), "two rows differ only in their bucket size: {c}");
    }
    // the built-in model's gradients fit one bucket of every size tried
    assert!(choices.iter().all(|c| !c["same_with_buckets"].as_array().expect("list").is_empty()), "{}", j);
    assert!(out.contains("alike"), "{out}");
}

/// `plan --validate` on a run directory says it is a run directory, not a sweep.
#[test]
fn validate_on_a_run_directory_says_so() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    ok(&vitscale(cwd, &train(&["--run-dir", "run"])), "train");
    cpu_profile(cwd, "cpu.json");
    let o = vitscale(cwd, &["plan", "--validate", "run", "--profile", "cpu.json"]);
    fails_saying(&o, "--validate RUN_DIR", &["run", "run directory", "not a sweep"]);
}

// ---- 15: messages on documented usage -----------------------------------------------------

/// A warm-up that outlasts the run is warned about, naming both lengths; documented usage (an
/// image folder without model.num_classes) gets a notice, not a warning; counts of one read
/// in the singular.
#[test]
fn messages_fit_what_the_user_did() {
    let tmp = tempfile::tempdir().expect("scratch");
    let cwd = tmp.path();
    let o = vitscale(cwd, &train(&["--run-dir", "w", "--set", "scheduler.type=WarmupLR", "--set", "scheduler.params.warmup_num_steps=1000"]));
    ok(&o, "a long warm-up");
    let e = stderr(&o);
    assert!(e.contains("warning: scheduler.params.warmup_num_steps 1000") && e.contains("the run (2 steps)"), "{e}");
    // a run given in epochs is warned too, once its length is known
    let o = vitscale(cwd, &["train", "--device", "cpu", "--run-dir", "w3", "--set", "data.train_size=128", "--set", "data.val_size=32", "--set", "train_micro_batch_size_per_gpu=64", "--set", "train.epochs=1", "--set", "scheduler.type=WarmupLR", "--set", "scheduler.params.warmup_num_steps=1000"]);
    ok(&o, "a long warm-up over one epoch");
    assert!(stderr(&o).contains("warmup_num_steps 1000 is not shorter than the run (2 steps)"), "{}", stderr(&o));
    let o = vitscale(cwd, &train(&["--run-dir", "w2", "--set", "scheduler.type=WarmupLR", "--set", "scheduler.params.warmup_num_steps=1"]));
    ok(&o, "a short warm-up");
    assert!(!stderr(&o).contains("warmup_num_steps"), "{}", stderr(&o));

    for (class, rgb) in [("ants", [200u8, 30, 30]), ("bees", [30, 30, 200])] {
        std::fs::create_dir_all(cwd.join("data").join(class)).expect("mkdir");
        for i in 0..6 {
            image::RgbImage::from_pixel(12, 10, image::Rgb(rgb)).save(cwd.join("data").join(class).join(format!("{i}.png"))).expect("png");
        }
    }
    let o = vitscale(cwd, &["train", "--device", "cpu", "--run-dir", "f", "--set", "data.dataset=folder", "--set", "data.path=data", "--set", "model.preset=vit_builtin_default", "--set", "train_batch_size=4", "--set", "train.steps=1"]);
    ok(&o, "a folder without num_classes");
    let e = stderr(&o);
    assert!(e.contains("2 class folders") && !e.lines().any(|l| l.starts_with("warning:") && l.contains("num_classes")), "{e}");

    let o = vitscale_env(cwd, &train(&["--run-dir", "t1"]), &[("RAYON_NUM_THREADS", "1")]);
    ok(&o, "one thread");
    assert!(stderr(&o).contains("cpu (1 thread)"), "{}", stderr(&o));
    let prof = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs").join("data").join("profile_h200_vit_small_patch4_32.json");
    let o = vitscale(cwd, &["plan", "--profile", prof.to_str().expect("utf-8"), "--cluster", &cluster_file("h200_8_nvlink.json"), "--set", "train_micro_batch_size_per_gpu=128"]);
    ok(&o, "plan on one node");
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("(1 node × 8 devices × 1 rank = 8 ranks)"), "{s}");
    let o = vitscale(cwd, &["plan", "--profile", prof.to_str().expect("utf-8"), "--cluster", &cluster_file("study_32_nodes_h200.json"), "--project", "proj", "--micros", "128"]);
    ok(&o, "plan --project");
    let md = std::fs::read_to_string(cwd.join("proj").join("projection.md")).expect("projection.md");
    assert!(!md.contains(".."), "a doubled full stop: {md}");
}

/// `--init` from weights with another class count starts a fine-tune as timm does (the head
/// initialized anew, said in a notice, every other weight from the file); `eval` of the same
/// file against that class count is still refused, naming the head.
#[test]
fn init_from_another_class_count_reinitializes_the_head_and_eval_still_refuses_it() {
    let tmp = common::tmp();
    let small = ["--set", "data.dataset=synthetic", "--set", "train.steps=2", "--set", "data.train_size=256", "--set", "data.val_size=64"];
    let saved = vitscale(tmp.path(), &[&["train", "--device", "cpu", "--set", "model.num_classes=10", "--run-dir", "a", "--save-weights", "w10.safetensors"][..], &small].concat());
    common::ok(&saved, "training the 10-class model");
    let tuned = vitscale(tmp.path(), &[&["train", "--device", "cpu", "--set", "model.num_classes=3", "--init", "w10.safetensors", "--run-dir", "b", "--json"][..], &small].concat());
    common::ok(&tuned, "fine-tuning it with 3 classes");
    let err = String::from_utf8_lossy(&tuned.stderr);
    assert!(err.contains("head for 10 classes and this run has 3: the head is initialized anew"), "{err}");
    let eval = vitscale(tmp.path(), &["eval", "--device", "cpu", "--weights", "w10.safetensors", "--set", "data.dataset=synthetic", "--set", "model.num_classes=3", "--set", "data.val_size=64"]);
    assert!(!eval.status.success());
    let err = String::from_utf8_lossy(&eval.stderr);
    assert!(err.contains("head.weight") && err.contains("[3, 64]"), "{err}");
}

/// The README's resume recipe keeps what the first command set: a resume that does not give
/// `train.checkpoint_every` or the run's length takes them from the checkpoint's run, so it
/// goes on checkpointing and a second `--resume latest` continues from the newest checkpoint;
/// a resume with nothing left to train is refused and leaves the finished run's summary alone.
#[test]
fn a_resume_keeps_the_first_commands_settings_and_loses_no_work() {
    let tmp = common::tmp();
    let cwd = tmp.path();
    let base = ["train", "--device", "cpu", "--run-dir", "r", "--set", "data.train_size=256", "--set", "data.val_size=32", "--set", "train_micro_batch_size_per_gpu=32"];
    let first = vitscale(cwd, &[&base[..], &["--set", "train.steps=4", "--set", "train.checkpoint_every=2"]].concat());
    ok(&first, "the first run");
    let latest = || std::fs::read_to_string(cwd.join("r/checkpoints/latest")).expect("latest").trim().to_string();
    assert!(latest().ends_with("step_000004"), "{}", latest());
    // a longer run, checkpoint interval not given again
    let longer = vitscale(cwd, &[&base[..], &["--resume", "latest", "--set", "train.steps=8"]].concat());
    ok(&longer, "the resumed run");
    assert!(stderr(&longer).contains("train.checkpoint_every = 2"), "{}", stderr(&longer));
    assert!(cwd.join("r/checkpoints/step_000006").is_dir() && latest().ends_with("step_000008"), "{}", latest());
    // the length carries over too: the next resume starts at step 8, not 4, and says it is done
    let summary = std::fs::read(cwd.join("r/summary.json")).expect("summary");
    let again = vitscale(cwd, &[&base[..], &["--resume", "latest"]].concat());
    assert_eq!(again.status.code(), Some(1), "{}", stderr(&again));
    assert!(stderr(&again).contains("is at step 8, and this run has 8 steps: nothing is left to train"), "{}", stderr(&again));
    assert_eq!(std::fs::read(cwd.join("r/summary.json")).expect("summary"), summary, "the finished run's summary was replaced");
    // given a longer run, it goes on from the newest checkpoint
    let more = vitscale(cwd, &[&base[..], &["--resume", "latest", "--set", "train.steps=10", "--json"]].concat());
    ok(&more, "resuming again");
    assert!(stderr(&more).contains("step_000008 at step 8"), "{}", stderr(&more));
}
