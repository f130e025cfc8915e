//! Helpers the integration tests share: paths in the checkout, a free loopback port, running
//! the `vitscale` binary and reading what it prints and writes (JSON lines, run directories,
//! safetensors weights), and comparing two sets of weights.
// Each tests/*.rs is its own crate and uses only some of these; the rest would warn.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

pub const EXE: &str = env!("CARGO_BIN_EXE_vitscale");

/// `rel` below the checkout's root.
pub fn repo_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// `tests/fixtures`.
pub fn fixtures() -> PathBuf {
    repo_path("tests/fixtures")
}

/// A fresh scratch directory, removed when dropped.
pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// A seed for fresh random inputs, different every run (a test states it on failure).
pub fn fresh_seed() -> u64 {
    rand::random()
}

/// A generator seeded with a [`fresh_seed`], and the seed.
pub fn fresh_rng() -> (rand_chacha::ChaCha8Rng, u64) {
    let seed = fresh_seed();
    (rand::SeedableRng::seed_from_u64(seed), seed)
}

/// A port that was free a moment ago (each run takes its own, so tests run in parallel).
pub fn free_port() -> u16 {
    vitscale::launch::free_port().expect("loopback port")
}

/// The variables a launcher hands its workers: a test's binary must not inherit them.
const LAUNCHER_VARS: [&str; 7] = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "VITSCALE_RUN_ID", "VITSCALE_JOB_ID"];

/// `vitscale args…` in `cwd` with `env` set, no launcher variables inherited, stdin closed;
/// the output whatever the exit status.
pub fn vitscale_env<S: AsRef<OsStr>>(cwd: &Path, args: &[S], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(EXE);
    cmd.args(args).current_dir(cwd).stdin(Stdio::null());
    for k in LAUNCHER_VARS {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("the vitscale binary runs")
}

/// [`vitscale_env`] with no variables set.
pub fn vitscale<S: AsRef<OsStr>>(cwd: &Path, args: &[S]) -> Output {
    vitscale_env(cwd, args, &[])
}

/// Asserts that `out` is a success, showing its stdout and stderr otherwise.
pub fn ok(out: &Output, what: &str) {
    assert!(out.status.success(), "{what} failed ({:?}): {}\n{}", out.status, String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}

/// Runs `vitscale args…` (outside any launcher's run id) and panics with its stderr on failure.
pub fn run(args: &[String]) -> Output {
    let out = Command::new(EXE).args(args).env_remove("VITSCALE_RUN_ID").stdin(Stdio::null()).output().expect("run vitscale");
    if !out.status.success() {
        panic!("vitscale {args:?} failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    out
}

/// `launch --nproc-per-node=n --master-port=<free> --` ahead of a worker command when
/// `nproc` > 1; nothing for one process.
pub fn launch_args(nproc: usize) -> Vec<String> {
    launch_args_with(nproc, &[])
}

/// [`launch_args`] with more launcher options before the `--`.
pub fn launch_args_with(nproc: usize, opts: &[&str]) -> Vec<String> {
    if nproc <= 1 {
        return Vec::new();
    }
    let mut args = vec!["launch".to_string(), format!("--nproc-per-node={nproc}"), format!("--master-port={}", free_port())];
    args.extend(opts.iter().map(|s| s.to_string()));
    args.push("--".into());
    args
}

/// `--run-dir dir --save-weights dir/w.safetensors` (what [`weights`] and [`max_rel_diff`] read).
pub fn run_dir_args(dir: &Path) -> Vec<String> {
    vec!["--run-dir".into(), dir.display().to_string(), "--save-weights".into(), dir.join("w.safetensors").display().to_string()]
}

/// The last stdout line as JSON (the `--json` contract).
pub fn last_json(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or_else(|| panic!("no stdout; stderr: {}", String::from_utf8_lossy(&out.stderr)));
    serde_json::from_str(line).unwrap_or_else(|e| panic!("last line is not JSON ({e}): {line}"))
}

/// A JSON file.
pub fn read_json(path: &Path) -> Value {
    let s = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every line of a JSON-lines file.
pub fn jsonl(path: &Path) -> Vec<Value> {
    let s = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    s.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: not a JSON line ({e}): {l}", path.display()))).collect()
}

/// The records of `dir/metrics.jsonl` with this `kind` (None: the step records, which have none).
pub fn metrics(dir: &Path, kind: Option<&str>) -> Vec<Value> {
    jsonl(&dir.join("metrics.jsonl")).into_iter().filter(|v| v["kind"].as_str() == kind).collect()
}

/// A recognizable CIFAR pixel: depends on (image, channel, y, x).
pub fn cifar_pixel(img: usize, c: usize, y: usize, x: usize) -> u8 {
    ((img * 7 + c * 50 + y * 3 + x) % 256) as u8
}

/// The 3072 bytes of CHW planes of CIFAR image `img` ([`cifar_pixel`]s).
pub fn cifar_planes(img: usize) -> Vec<u8> {
    (0..3).flat_map(|c| (0..32).flat_map(move |y| (0..32).map(move |x| cifar_pixel(img, c, y, x)))).collect()
}

/// Every f32 tensor of a safetensors file, by name.
pub fn tensors(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The tensors of `tests/fixtures/timm_cifar.safetensors` named `prefix.<key>`, as
/// (key, shape, data), sorted by key.
pub fn fixture_tensors(prefix: &str) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let path = fixtures().join("timm_cifar.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut out: Vec<_> = st
        .tensors()
        .into_iter()
        .filter_map(|(k, v)| {
            let key = k.strip_prefix(&format!("{prefix}."))?.to_string();
            Some((key, v.shape().to_vec(), vitscale::model::weights::to_f32(&path, &k, &v).expect("f32 tensor")))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Writes (key, shape, data) tensors as a plain f32 safetensors file (a timm weights file).
pub fn write_weights(tensors: &[(String, Vec<usize>, Vec<f32>)], path: &Path) {
    let views: Vec<_> = tensors
        .iter()
        .map(|(k, shape, data)| {
            (k.clone(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytemuck::cast_slice(data)).expect("tensor view"))
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, &None).expect("serialize")).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// ‖ours − theirs‖₂ / ‖theirs‖₂ in f64; infinite when `ours` holds a non-finite value.
pub fn rel_l2(ours: &[f32], theirs: &[f32]) -> f64 {
    assert_eq!(ours.len(), theirs.len());
    if ours.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = ours.iter().zip(theirs).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>().sqrt();
    let den: f64 = theirs.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt();
    num / den.max(1e-30)
}

/// Largest |a − b| / (1 + |b|) over every tensor of two files with the same tensors.
pub fn max_rel_diff_files(a: &Path, b: &Path) -> f32 {
    let (ta, tb) = (tensors(a), tensors(b));
    assert_eq!(ta.len(), tb.len(), "{} and {} hold different tensors", a.display(), b.display());
    let mut worst = 0f32;
    for ((na, va), (nb, vb)) in ta.iter().zip(&tb) {
        assert_eq!(na, nb);
        assert_eq!(va.len(), vb.len(), "{na}");
        for (x, y) in va.iter().zip(vb) {
            assert!(x.is_finite() && y.is_finite(), "{na}: non-finite value");
            worst = worst.max((x - y).abs() / (1.0 + y.abs()));
        }
    }
    worst
}

/// The weights a run directory saved (`w.safetensors`).
pub fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    tensors(&dir.join("w.safetensors"))
}

/// `max_rel_diff_files` of the `w.safetensors` two run directories saved.
pub fn max_rel_diff(a: &Path, b: &Path) -> f32 {
    max_rel_diff_files(&a.join("w.safetensors"), &b.join("w.safetensors"))
}

/// The largest per-tensor [`rel_l2`] of the `w.safetensors` two run directories saved.
pub fn max_rel_l2(a: &Path, b: &Path) -> f64 {
    let (ta, tb) = (weights(a), weights(b));
    assert_eq!(ta.len(), tb.len(), "{} and {} hold different tensors", a.display(), b.display());
    ta.iter().zip(&tb).map(|((na, va), (nb, vb))| {
        assert_eq!(na, nb);
        rel_l2(va, vb)
    })
    .fold(0.0, f64::max)
}

/// A DeepSpeed-engine fixture, `tests/fixtures/train_ref/NAME.safetensors`: the case's `--set`
/// overrides (the metadata's "vitscale" entry), the final weights (tensors `final.*`, keyed
/// without the prefix) and the per-step f64 series named in `series`.
pub struct TrainFixture {
    pub sets: serde_json::Map<String, Value>,
    pub finals: std::collections::BTreeMap<String, Vec<f32>>,
    pub series: std::collections::BTreeMap<String, Vec<f64>>,
}

pub fn train_fixture(name: &str, series: &[&str]) -> TrainFixture {
    let path = fixtures().join("train_ref").join(format!("{name}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let (_, md) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = md.metadata().clone().unwrap_or_default();
    let sets: Value = serde_json::from_str(&meta["vitscale"]).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let finals = st.tensors().into_iter().filter_map(|(k, v)| k.strip_prefix("final.").map(|key| (key.to_string(), vitscale::model::weights::to_f32(&path, &k, &v).unwrap()))).collect();
    let f64s = |key: &str| {
        let v = st.tensor(key).unwrap_or_else(|_| panic!("{name} lacks {key}"));
        assert_eq!(v.dtype(), safetensors::Dtype::F64, "{name}: {key}");
        v.data().chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
    };
    TrainFixture { sets: sets.as_object().unwrap().clone(), finals, series: series.iter().map(|&k| (k.to_string(), f64s(k))).collect() }
}

/// Trains a DeepSpeed-engine fixture's case on the CPU: `vitscale train` from the weights file
/// `init` with every key of `sets` as a `--set` override (`data.path` included), the weights
/// saved to `saved` and the run written to `run_dir`; panics naming `tag` when the run fails.
pub fn train_fixture_case(cwd: &Path, sets: &serde_json::Map<String, Value>, init: &Path, saved: &Path, run_dir: &Path, tag: &str) {
    let mut args: Vec<String> = ["train", "--device", "cpu", "--json", "--init"].map(String::from).into();
    args.push(init.display().to_string());
    args.extend(["--save-weights".into(), saved.display().to_string(), "--run-dir".into(), run_dir.display().to_string()]);
    for (k, v) in sets {
        let v = match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        args.extend(["--set".into(), format!("{k}={v}")]);
    }
    let out = vitscale(cwd, &args);
    assert!(out.status.success(), "{tag}: train failed: {}", String::from_utf8_lossy(&out.stderr));
}

/// The optimizers and clipping the ZeRO equality tests train with.
pub const SGD: &str = "--set=optimizer={\"type\":\"SGD\",\"params\":{\"lr\":0.05,\"momentum\":0.9}}";
pub const ADAMW: &str = "--set=optimizer={\"type\":\"AdamW\",\"params\":{\"lr\":0.001}}";
/// Far below the gradient norms of those runs (2.4–3.9), so every step is clipped.
pub const CLIP: &str = "--set=gradient_clipping=0.05";

/// The ZeRO tests' tiny run on CPU ranks: `steps` steps of 32 images in 4 micro-batches, a
/// checkpoint every 2 steps, a metrics line every step.
pub fn zero_run_args(steps: u64) -> Vec<String> {
    [
        "--device=cpu".to_string(),
        format!("--set=train.steps={steps}"),
        "--set=train_batch_size=32".into(),
        "--set=gradient_accumulation_steps=4".into(),
        "--set=data.val_size=200".into(),
        "--set=train.checkpoint_every=2".into(),
        "--set=train.log_every=1".into(),
    ]
    .into()
}

/// `vitscale [launch --nproc-per-node n --] train <args> --set=zero_optimization.stage=<stage> <extra>`
/// with its run directory in `dir`.
pub fn train_at_stage(nproc: usize, stage: u8, args: Vec<String>, extra: &[&str], dir: &Path) -> Output {
    let mut all = launch_args(nproc);
    all.push("train".into());
    all.extend(args);
    all.push(format!("--set=zero_optimization.stage={stage}"));
    all.extend(extra.iter().map(|s| s.to_string()));
    all.extend(run_dir_args(dir));
    run(&all)
}

/// A TCP ring that counts the collectives it starts, by kind: `counts[i]` for `CountingComm::ALL_REDUCE`,
/// `REDUCE_SCATTER`, `ALL_GATHER` and `OTHER` (broadcasts, all-to-alls).
pub struct CountingComm {
    pub inner: vitscale::comm::TcpComm,
    pub counts: std::sync::Arc<[std::sync::atomic::AtomicUsize; 4]>,
}

impl CountingComm {
    pub const ALL_REDUCE: usize = 0;
    pub const REDUCE_SCATTER: usize = 1;
    pub const ALL_GATHER: usize = 2;
    pub const OTHER: usize = 3;

    /// How many of kind `i` were started since the last call, resetting that count.
    pub fn take(counts: &[std::sync::atomic::AtomicUsize; 4], i: usize) -> usize {
        counts[i].swap(0, std::sync::atomic::Ordering::Relaxed)
    }
}

impl vitscale::comm::Comm<Vec<f32>> for CountingComm {
    fn rank(&self) -> usize {
        vitscale::comm::Comm::<Vec<f32>>::rank(&self.inner)
    }
    fn world_size(&self) -> usize {
        vitscale::comm::Comm::<Vec<f32>>::world_size(&self.inner)
    }
    fn describe(&self) -> String {
        "counting tcp ring".into()
    }
    fn start(&mut self, op: vitscale::comm::Collective, buf: &mut Vec<f32>, span: vitscale::comm::Span) -> vitscale::comm::CResult<vitscale::comm::Work> {
        use vitscale::comm::Collective;
        let i = match op {
            Collective::AllReduce(_) => Self::ALL_REDUCE,
            Collective::ReduceScatter(_) => Self::REDUCE_SCATTER,
            Collective::AllGather => Self::ALL_GATHER,
            Collective::Broadcast { .. } | Collective::AllToAll => Self::OTHER,
        };
        self.counts[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.inner.start(op, buf, span)
    }
    fn wait(&mut self, work: vitscale::comm::Work, buf: &mut Vec<f32>) -> vitscale::comm::CResult<()> {
        self.inner.wait(work, buf)
    }
    fn barrier(&mut self) -> vitscale::comm::CResult<()> {
        vitscale::comm::Comm::<Vec<f32>>::barrier(&mut self.inner)
    }
    fn all_reduce_host(&mut self, vals: &mut [f64]) -> vitscale::comm::CResult<()> {
        vitscale::comm::Comm::<Vec<f32>>::all_reduce_host(&mut self.inner, vals)
    }
}
