//! `vitscale sweep`: runs every point of a spec as a subprocess of this same binary
//! (`vitscale train`, through `vitscale launch --nproc-per-node N` when a point has several
//! ranks), each in its own directory, and appends one line per point to `DIR/sweep.jsonl`.
//!
//! Layout of `DIR`: `spec.json` (the spec as resolved), `sweep.jsonl`, and per point
//! `points/<id>/point.json` (its configuration), `stdout.log`, `stderr.log` and `run/` (its
//! run directory). A point that fails (non-zero exit, a signal, out of memory, its timeout) is
//! recorded with the reason and the sweep goes on; `--resume` skips the points `sweep.jsonl`
//! already holds (failed ones too, unless `--retry-failed`). Each point runs in a process
//! group of its own, so a timeout or Ctrl-C stops its launcher and every worker together.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::spec::{Point, SweepSpec};
use super::summary::{read_point, PointFigures};

/// One line of `sweep.jsonl`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PointRecord {
    pub id: String,
    pub index: usize,
    pub keys: Map<String, Value>,
    /// Which run of the point (0-based; the spec's `repeats` runs each point several times).
    #[serde(default)]
    pub repeat: usize,
    /// "ok" or "failed".
    pub status: String,
    /// Why a point failed: exit code, signal, timeout or out-of-memory text.
    pub reason: Option<String>,
    pub exit_code: Option<i32>,
    pub wall_s: f64,
    /// The point's run directory, relative to the sweep directory.
    pub run_dir: String,
    /// The command that reproduces the point, as run from the sweep's working directory.
    pub command: String,
    pub figures: Option<PointFigures>,
}

impl SweepError {
    /// 128 + signal after SIGINT/SIGTERM (130 / 143), as a shell reports a command the signal
    /// ended; else 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            SweepError::Interrupted { signal, .. } => 128 + signal,
            _ => 1,
        }
    }
}

impl PointRecord {
    pub fn ok(&self) -> bool {
        self.status == "ok"
    }
}

#[derive(Clone, Debug)]
pub struct SweepOptions {
    pub out: PathBuf,
    pub resume: bool,
    pub retry_failed: bool,
    /// The program each point runs (this executable).
    pub exe: PathBuf,
    /// Print nothing but the progress bar / one line per point when false.
    pub quiet: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error(transparent)]
    Spec(#[from] super::spec::SpecError),
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{0}")]
    Usage(String),
    #[error("sweep stopped by signal {signal} during point {point}; the finished points are in {dir}/sweep.jsonl: continue with --resume")]
    Interrupted { signal: i32, point: String, dir: String },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SweepError + '_ {
    move |source| SweepError::Io { path: path.display().to_string(), source }
}

/// Reads `sweep.jsonl` (the last line per point id wins). A missing file is an empty sweep.
pub fn read_records(dir: &Path) -> Result<Vec<PointRecord>, String> {
    let path = dir.join("sweep.jsonl");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let mut out: Vec<PointRecord> = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let r: PointRecord = serde_json::from_str(line).map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))?;
        match out.iter_mut().find(|o| o.id == r.id) {
            Some(o) => *o = r,
            None => out.push(r),
        }
    }
    out.sort_by_key(|r| r.index);
    Ok(out)
}

/// What a sweep did.
#[derive(Clone, Debug, Serialize)]
pub struct SweepOutcome {
    pub points: usize,
    pub ran: usize,
    pub skipped: usize,
    pub ok: usize,
    pub failed: usize,
    pub wall_s: f64,
    pub dir: String,
}

static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);
extern "C" fn on_signal(sig: libc::c_int) {
    STOP_SIGNAL.store(sig, Ordering::SeqCst);
}

/// Runs the sweep `spec` into `opts.out`.
pub fn run(spec: &SweepSpec, opts: &SweepOptions) -> Result<SweepOutcome, SweepError> {
    let t0 = Instant::now();
    let dir = &opts.out;
    let jsonl = dir.join("sweep.jsonl");
    if dir.exists() && !dir.is_dir() {
        return Err(SweepError::Usage(format!("--out {}: this is a file, not a directory: the sweep directory holds sweep.jsonl and a folder per point; choose another --out", dir.display())));
    }
    spec.check_keys()?;
    if jsonl.exists() && !opts.resume {
        return Err(SweepError::Usage(format!(
            "{} already holds a sweep: continue it with --resume, or choose another --out",
            dir.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    // one runner per sweep directory: a second one would run the same points again
    let _lock = SweepLock::take(dir)?;
    let spec_value = serde_json::to_value(spec).map_err(|e| SweepError::Usage(e.to_string()))?;
    if opts.resume {
        check_same_spec(dir, &spec_value)?;
    }
    let spec_bytes = serde_json::to_vec_pretty(&spec_value).map_err(|e| SweepError::Usage(e.to_string()))?;
    crate::util::write_atomic(&dir.join("spec.json"), &spec_bytes).map_err(io(dir))?;

    let done = read_records(dir).map_err(SweepError::Usage)?;
    let points = spec.points();
    let todo: Vec<&Point> = points
        .iter()
        .filter(|p| match done.iter().find(|r| r.id == p.id) {
            Some(r) => !r.ok() && opts.retry_failed,
            None => true,
        })
        .collect();
    let skipped = points.len() - todo.len();
    if skipped > 0 && !opts.quiet {
        crate::errln!("sweep: {skipped} of {} points already in {} (skipped)", points.len(), jsonl.display());
    }
    let mut out = std::fs::OpenOptions::new().create(true).append(true).open(&jsonl).map_err(io(&jsonl))?;

    let bar = indicatif::ProgressBar::new(todo.len() as u64);
    if opts.quiet {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} points | {msg} | elapsed {elapsed} | ETA {eta}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    STOP_SIGNAL.store(0, Ordering::SeqCst);
    let _handlers = crate::util::SignalHandlers::install(&[libc::SIGINT, libc::SIGTERM], on_signal);
    let (mut ok, mut failed) = (0, 0);
    for p in &todo {
        bar.set_message(p.id.clone());
        let rec = run_point(spec, p, opts)?;
        let line = match rec.ok() {
            true => {
                ok += 1;
                let ips = rec.figures.as_ref().map_or(0.0, |f| f.images_per_s);
                format!("{} ok: {ips:.1} img/s ({:.1} s)", rec.id, rec.wall_s)
            }
            false => {
                failed += 1;
                format!("{} FAILED: {}", rec.id, rec.reason.clone().unwrap_or_default())
            }
        };
        let mut text = serde_json::to_string(&rec).map_err(|e| SweepError::Usage(e.to_string()))?;
        text.push('\n');
        out.write_all(text.as_bytes()).and_then(|_| out.flush()).map_err(io(&jsonl))?;
        if !opts.quiet {
            if bar.is_hidden() { crate::errln!("{line}") } else { bar.println(line) }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(SweepOutcome { points: points.len(), ran: todo.len(), skipped, ok, failed, wall_s: t0.elapsed().as_secs_f64(), dir: dir.display().to_string() })
}

/// `DIR/sweep.lock`: the PID of the process running the sweep in `DIR`, removed when it ends.
/// A lock whose process is gone (killed, the machine restarted) is stale and taken over.
struct SweepLock {
    path: PathBuf,
}

impl SweepLock {
    fn take(dir: &Path) -> Result<SweepLock, SweepError> {
        let path = dir.join("sweep.lock");
        for _ in 0..2 {
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(mut f) => {
                    f.write_all(format!("{}\n", std::process::id()).as_bytes()).map_err(io(&path))?;
                    return Ok(SweepLock { path });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    match text.trim().parse::<i32>() {
                        Ok(pid) if pid > 0 && process_alive(pid) => {
                            return Err(SweepError::Usage(format!(
                                "{} is being run by process {pid} ({}): wait for it to finish, or stop it, before running or resuming this sweep",
                                dir.display(),
                                path.display()
                            )));
                        }
                        _ => {
                            crate::errln!("sweep: {} names no running process ({:?}): a stale lock, taken over", path.display(), text.trim());
                            std::fs::remove_file(&path).map_err(io(&path))?;
                        }
                    }
                }
                Err(e) => return Err(SweepError::Io { path: path.display().to_string(), source: e }),
            }
        }
        Err(SweepError::Usage(format!("{}: another runner took the lock while this one removed a stale one", path.display())))
    }
}

impl Drop for SweepLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether process `pid` exists (signal 0 checks without sending; EPERM: it exists, as
/// another user's).
fn process_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 sends nothing.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Spec fields a resume may change: they do not change what a point measures.
/// (`base_source` is where the base was read from, as a path relative to where the sweep was
/// started; the base itself is compared.)
const RESUMABLE_CHANGES: &[&str] = &["name", "description", "timeout_s", "base_source"];

/// Refuses `--resume` with a spec other than the one `DIR/spec.json` recorded: old and new
/// points would be mixed in one sweep.jsonl. Names every field that changed.
fn check_same_spec(dir: &Path, new: &Value) -> Result<(), SweepError> {
    let path = dir.join("spec.json");
    let old: Value = match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| SweepError::Usage(format!("{}: not valid JSON ({e}); it records the spec this sweep ran", path.display())))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(SweepError::Io { path: path.display().to_string(), source: e }),
    };
    let mut changed = Vec::new();
    diff_values("", &grid_as_object(&old), &grid_as_object(new), &mut changed);
    changed.retain(|c| !RESUMABLE_CHANGES.iter().any(|k| c.starts_with(&format!("{k}:"))));
    if changed.is_empty() {
        return Ok(());
    }
    Err(SweepError::Usage(format!(
        "--resume: the spec differs from the one this sweep ran ({}), and resuming would mix their points:\n  {}\nrun the new spec into another --out, or restore the old one",
        path.display(),
        changed.join("\n  ")
    )))
}

/// A recorded spec with its grid (a list of [key, values] pairs) as an object, so a change is
/// named by its key.
fn grid_as_object(spec: &Value) -> Value {
    let mut v = spec.clone();
    if let Some(pairs) = spec.get("grid").and_then(Value::as_array) {
        let obj: Map<String, Value> = pairs.iter().filter_map(|p| Some((p.get(0)?.as_str()?.to_string(), p.get(1)?.clone()))).collect();
        v["grid"] = Value::Object(obj);
    }
    v
}

/// The dotted paths where `a` and `b` differ, as `path: old → new`.
fn diff_values(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                diff_values(&p, x.get(k).unwrap_or(&Value::Null), y.get(k).unwrap_or(&Value::Null), out);
            }
        }
        _ if a != b => out.push(format!("{path}: {a} → {b}")),
        _ => {}
    }
}

/// A point's command line without its `--run-dir DIR`: the point's run directory holds the
/// run, so a rerun naming it would be refused; without it each rerun writes a fresh one.
/// `command` is words as `shell_word` quotes them (single quotes around any with spaces).
pub fn without_run_dir(command: &str) -> String {
    let mut words: Vec<String> = Vec::new();
    let (mut word, mut quoted, mut started) = (String::new(), false, false);
    for c in command.chars() {
        match c {
            '\'' => {
                quoted = !quoted;
                started = true;
                word.push(c);
            }
            c if c.is_whitespace() && !quoted => {
                if started {
                    words.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            c => {
                started = true;
                word.push(c);
            }
        }
    }
    if started {
        words.push(word);
    }
    let mut out = Vec::with_capacity(words.len());
    let mut it = words.into_iter();
    while let Some(w) = it.next() {
        if w == "--run-dir" {
            it.next();
        } else if !w.starts_with("--run-dir=") {
            out.push(w);
        }
    }
    out.join(" ")
}

/// Quotes an argument for the reproducing command line when it needs it.
fn shell_word(s: &str) -> String {
    crate::util::shell_quote(s)
}

/// The arguments after the program for `point`.
pub fn point_args(spec: &SweepSpec, point: &Point, config: &Path, run_dir: &Path) -> Vec<String> {
    let mut args = Vec::new();
    let n = point.nproc();
    if n > 1 || point.one_gpu() {
        args.extend(["launch".to_string(), "--nproc-per-node".into(), n.to_string()]);
        if point.one_gpu() || spec.device == "cuda" && n > 1 && point.keys.get(super::spec::ONE_GPU_KEY).is_none() && one_visible_gpu() {
            args.push("--one-gpu".into());
        }
        args.push("--".into());
    }
    args.extend([
        "train".to_string(),
        "--config".into(),
        config.display().to_string(),
        "--run-dir".into(),
        run_dir.display().to_string(),
        "--device".into(),
        spec.device.clone(),
        "--json".into(),
    ]);
    args
}

/// Whether the ranks must share GPU 0: only one GPU is visible (`CUDA_VISIBLE_DEVICES` names
/// one, or the driver reports one).
fn one_visible_gpu() -> bool {
    if let Ok(v) = std::env::var("CUDA_VISIBLE_DEVICES") {
        return v.split(',').filter(|s| !s.trim().is_empty()).count() <= 1;
    }
    static COUNT: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    COUNT.get_or_init(|| crate::backend::cuda::probe(0).ok().map(|d| d.device_count)).is_none_or(|n| n <= 1)
}

fn run_point(spec: &SweepSpec, p: &Point, opts: &SweepOptions) -> Result<PointRecord, SweepError> {
    let pdir = opts.out.join("points").join(&p.id);
    let run_dir = pdir.join("run");
    // a rerun (retry, or an interrupted point) starts from a clean run directory
    if run_dir.exists() {
        std::fs::remove_dir_all(&run_dir).map_err(io(&run_dir))?;
    }
    std::fs::create_dir_all(&pdir).map_err(io(&pdir))?;
    let cfg = spec.point_config(p)?;
    let cfg_path = pdir.join("point.json");
    let cfg_bytes = serde_json::to_vec_pretty(&cfg).map_err(|e| SweepError::Usage(e.to_string()))?;
    crate::util::write_atomic(&cfg_path, &cfg_bytes).map_err(io(&cfg_path))?;
    let args = point_args(spec, p, &cfg_path, &run_dir);
    let command = without_run_dir(&std::iter::once("vitscale".to_string()).chain(args.iter().map(|a| shell_word(a))).collect::<Vec<_>>().join(" "));
    let (stdout_path, stderr_path) = (pdir.join("stdout.log"), pdir.join("stderr.log"));
    let stdout = std::fs::File::create(&stdout_path).map_err(io(&stdout_path))?;
    let stderr = std::fs::File::create(&stderr_path).map_err(io(&stderr_path))?;

    let t = Instant::now();
    let mut cmd = Command::new(&opts.exe);
    cmd.args(&args).stdin(Stdio::null()).stdout(stdout).stderr(stderr);
    {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
    }
    let mut child = cmd.spawn().map_err(|e| SweepError::Io { path: opts.exe.display().to_string(), source: e })?;
    let pgid = child.id() as i32;
    let timeout = Duration::from_secs_f64(spec.timeout_s);
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait().map_err(io(&opts.exe))? {
            break s;
        }
        let sig = STOP_SIGNAL.load(Ordering::SeqCst);
        if sig != 0 || t.elapsed() > timeout {
            timed_out = sig == 0;
            stop_group(pgid, &mut child);
            if sig != 0 {
                return Err(SweepError::Interrupted { signal: sig, point: p.id.clone(), dir: opts.out.display().to_string() });
            }
            break child.wait().map_err(io(&opts.exe))?;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let wall_s = t.elapsed().as_secs_f64();
    let stderr_text = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    let exit_code = status.code();
    let reason = if timed_out {
        Some(format!("timeout: still running after {:.0} s (timeout_s), stopped", spec.timeout_s))
    } else if !status.success() {
        let how = match (exit_code, std::os::unix::process::ExitStatusExt::signal(&status)) {
            (Some(c), _) => format!("exit code {c}"),
            (None, Some(s)) => format!("killed by signal {s}"),
            _ => "failed".to_string(),
        };
        Some(match oom_line(&stderr_text) {
            Some(line) => format!("out of memory ({how}): {line}"),
            None => format!("{how}: {}", last_error_line(&stderr_text)),
        })
    } else {
        None
    };
    let rel = run_dir.strip_prefix(&opts.out).unwrap_or(&run_dir).display().to_string();
    let (status_text, reason, figures) = match reason {
        Some(r) => ("failed", Some(r), None),
        None => match read_point(&run_dir, if spec.full_training { 0 } else { spec.warmup_steps }) {
            Ok(f) => ("ok", None, Some(f)),
            Err(e) => ("failed", Some(format!("exited 0 but its run directory cannot be summarized: {e}")), None),
        },
    };
    Ok(PointRecord { id: p.id.clone(), index: p.index, keys: p.keys.clone(), repeat: p.repeat, status: status_text.into(), reason, exit_code, wall_s, run_dir: rel, command, figures })
}

/// SIGTERM to the point's process group, SIGKILL after 5 s.
fn stop_group(pgid: i32, child: &mut std::process::Child) {
    // SAFETY: signals a process group this sweep created (the child is its leader).
    unsafe { libc::kill(-pgid, libc::SIGTERM) };
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if let Ok(Some(_)) = child.try_wait() {
            // the leader is gone; workers that outlive it are killed below
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: as above.
    unsafe { libc::kill(-pgid, libc::SIGKILL) };
}

/// The first stderr line that reports running out of memory (host or device).
fn oom_line(stderr: &str) -> Option<String> {
    const NEEDLES: &[&str] = &["out of memory", "CUDA_ERROR_OUT_OF_MEMORY", "memory allocation of", "Cannot allocate memory", "OOM"];
    stderr.lines().find(|l| NEEDLES.iter().any(|n| l.contains(n) || l.to_lowercase().contains(&n.to_lowercase()))).map(|l| l.trim().chars().take(300).collect())
}

/// The most telling lines of a failed point's stderr: the first `error` line (under the
/// launcher, the failing worker's own message comes before the launcher's summary) and the
/// last one when it differs, else the last line.
fn last_error_line(stderr: &str) -> String {
    let lines: Vec<&str> = stderr.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    let errors: Vec<&str> = lines.iter().copied().filter(|l| l.contains("error")).collect();
    let text = match (errors.first(), errors.last()) {
        (Some(a), Some(b)) if a != b => format!("{a} ({b})"),
        (Some(a), _) => a.to_string(),
        _ => lines.last().copied().unwrap_or("(no output on stderr)").to_string(),
    };
    text.chars().take(400).collect()
}
