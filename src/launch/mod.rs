//! `vitscale launch`: starts the worker processes of a data-parallel run, like torchrun on one
//! node and like DeepSpeed's launcher over a hostfile.
//!
//! - **One node** (`--nproc-per-node N`, optionally `--nnodes M --node-rank R` run by hand on
//!   each node): spawns N copies of this executable with the arguments after `--`, each with
//!   torchrun's variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!   `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`), which `comm::DistEnv::detect` reads.
//! - **Hostfile** (`--hostfile F`, DeepSpeed's `host slots=N` format, with DeepSpeed's
//!   `--include` / `--exclude host:0,1@host2` filters): one `ssh` per host runs this same
//!   launcher there for that host's slots (`CUDA_VISIBLE_DEVICES` = the chosen slots), with
//!   the working directory, the `NCCL_*` and `VITSCALE_*` variables and the `KEY=VALUE` lines
//!   of `.vitscale_env` (home, then the working directory) carried over, as DeepSpeed does
//!   with `.deepspeed_env`. A hostfile that leaves only this machine runs without ssh.
//!
//! Supervision: SIGINT / SIGTERM / SIGHUP are forwarded to every worker (each worker is in
//! its own process group, so a terminal's Ctrl-C reaches them once, through us). When a worker
//! exits non-zero or dies from a signal, the others get SIGTERM, then SIGKILL after
//! `--kill-grace` seconds (after a forwarded signal: `--stop-grace`, time for the workers to
//! checkpoint), and `run` returns an error naming the rank and its status — well
//! within 10 s. Output: rank 0's stdout is passed through untouched (so `--json` still ends
//! stdout with its JSON line); every rank's stderr is shown with a `[rank N] ` prefix; other
//! ranks' stdout is shown only with `--output all`, prefixed. Each rank's full log is written
//! to the run directory by the engine.

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::comm::env::{DEFAULT_MASTER_PORT, DEVICE_INDEX_VAR, DEVICE_READY_VAR};
use crate::util::shell_quote;
pub mod args;
// The launcher runs from the command's flags; the hostfile launcher renders them again for
// each remote node.
pub use args::LaunchArgs;

/// Which workers' stdout reaches the launcher's stdout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputMode {
    /// Rank 0's stdout verbatim; other ranks' stdout is dropped (their stderr is shown).
    Rank0,
    /// Every rank's stdout, prefixed `[rank N] ` (rank 0's stays unprefixed).
    All,
}

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExitDesc {
    Code(i32),
    Signal(i32),
}

impl ExitDesc {
    fn of(s: ExitStatus) -> Self {
        match (s.code(), s.signal()) {
            (Some(c), _) => ExitDesc::Code(c),
            (None, Some(sig)) => ExitDesc::Signal(sig),
            (None, None) => ExitDesc::Code(-1),
        }
    }
    /// The shell's convention: the code, or 128 + signal.
    pub fn shell_code(self) -> i32 {
        match self {
            ExitDesc::Code(0) => 1,
            ExitDesc::Code(c) => c,
            ExitDesc::Signal(s) => 128 + s,
        }
    }
}

impl std::fmt::Display for ExitDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            ExitDesc::Code(c) => write!(f, "exit status {c}"),
            ExitDesc::Signal(s) => write!(f, "signal {s} ({})", signal_name(s)),
        }
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => "signal",
    }
}

/// Errors of the launcher; each names the file, line, host or rank concerned.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("launch: {0}")]
    Usage(String),
    #[error("cannot read {what} {path}: {source}")]
    Read { what: &'static str, path: PathBuf, source: io::Error },
    #[error("{path}:{line}: {msg}")]
    Hostfile { path: PathBuf, line: usize, msg: String },
    #[error("--{flag} {spec:?}: {msg}")]
    Filter { flag: &'static str, spec: String, msg: String },
    #[error("cannot start {what} ({program}): {source}")]
    Spawn { what: String, program: String, source: io::Error },
    #[error("rank {rank} (pid {pid}) failed with {status}; the other workers were stopped")]
    WorkerFailed { rank: usize, pid: u32, status: ExitDesc },
    #[error("node {node} ({host}) failed with {status} (its ranks' errors are above); the other nodes were stopped")]
    NodeFailed { node: usize, host: String, status: ExitDesc },
    #[error("interrupted by {}; workers were stopped", signal_name(*signal))]
    Interrupted { signal: i32 },
    #[error("cannot find this executable to start workers: {0}")]
    CurrentExe(io::Error),
}

impl LaunchError {
    /// The exit code `vitscale launch` should end with.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::WorkerFailed { status, .. } | LaunchError::NodeFailed { status, .. } => status.shell_code(),
            LaunchError::Interrupted { signal } => 128 + signal,
            _ => 1,
        }
    }
}

/// Runs the launch; `Ok(0)` when every worker exited 0.
pub fn run(args: LaunchArgs) -> Result<i32, LaunchError> {
    if !(args.kill_grace >= 0.0 && args.kill_grace.is_finite()) {
        return Err(LaunchError::Usage(format!("--kill-grace {} must be a non-negative number of seconds", args.kill_grace)));
    }
    if !(args.stop_grace >= 0.0 && args.stop_grace.is_finite()) {
        return Err(LaunchError::Usage(format!("--stop-grace {} must be a non-negative number of seconds", args.stop_grace)));
    }
    if args.nproc_per_node == Some(0) || args.nnodes == Some(0) {
        return Err(LaunchError::Usage("--nproc-per-node and --nnodes must be at least 1".into()));
    }
    match &args.hostfile {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| LaunchError::Read { what: "hostfile", path: path.clone(), source: e })?;
            let hosts = parse_hostfile(&text, path)?;
            let hosts = filter_hosts(hosts, args.include.as_deref(), args.exclude.as_deref())?;
            let hosts = limit_hosts(hosts, args.nnodes, args.nproc_per_node);
            if hosts.is_empty() {
                return Err(LaunchError::Usage("the hostfile and filters leave no slots to run on".into()));
            }
            if hosts.len() == 1 && is_local_host(&hosts[0].name) {
                let mut local = args.clone();
                local.hostfile = None;
                local.nproc_per_node = Some(hosts[0].slots.len());
                local.nnodes = Some(1);
                local.visible_devices = Some(join_slots(&hosts[0].slots));
                return run_local(&local);
            }
            run_hosts(&args, &hosts)
        }
        None => run_local(&args),
    }
}

// ---- local workers ------------------------------------------------------------------------

/// One supervised child: a worker (rank) or, with a hostfile, the ssh to one node.
struct Proc {
    label: Label,
    child: Child,
    status: Option<ExitStatus>,
    /// SIGTERM already sent: a worker's graceful shutdown must not be interrupted by repeats.
    termed: bool,
}

#[derive(Clone, Debug)]
enum Label {
    Rank(usize),
    Node(usize, String),
}

fn run_local(args: &LaunchArgs) -> Result<i32, LaunchError> {
    let nproc = args.nproc_per_node.unwrap_or(1);
    let nnodes = args.nnodes.unwrap_or(1);
    if args.node_rank >= nnodes {
        return Err(LaunchError::Usage(format!("--node-rank {} must be below --nnodes {nnodes}", args.node_rank)));
    }
    let world = args.world_size.unwrap_or(nproc * nnodes);
    let offset = args.rank_offset.unwrap_or(args.node_rank * nproc);
    if offset + nproc > world {
        return Err(LaunchError::Usage(format!("ranks {offset}..{} do not fit a world of {world}", offset + nproc)));
    }
    let program = match &args.worker_program {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(LaunchError::CurrentExe)?,
    };
    let master_addr = args.master_addr.clone().unwrap_or_else(|| "127.0.0.1".into());
    let master_port = match args.master_port {
        Some(p) => p,
        // Single node: any free loopback port (rank 0 binds it moments later).
        None if nnodes == 1 && args.rank_offset.is_none() => free_port().unwrap_or(DEFAULT_MASTER_PORT),
        None => DEFAULT_MASTER_PORT,
    };
    let run_id = run_id();
    // Workers share the cores: give each an equal share unless the user chose.
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).div_ceil(nproc).max(1);

    let signals = SignalGuard::install();
    let stop_on_eof = args.exit_on_stdin_eof.then(watch_stdin);
    // Ranks sharing one GPU are started one after another, each once the one before has
    // opened the device: the ranks then take their turns on the GPU in rank order, the order
    // of NCCL's ring, and a run's speed stops depending on which process happened to start
    // first (launched together, the same run's step time changed from launch to launch).
    let ready_dir = (args.one_gpu && nproc > 1).then(|| std::env::temp_dir().join(format!("vitscale-ready-{run_id}")));
    if let Some(d) = &ready_dir {
        std::fs::create_dir_all(d).map_err(|e| LaunchError::Usage(format!("--one-gpu: cannot create {}: {e}", d.display())))?;
    }
    let mut procs = Vec::new();
    let mut outputs = Vec::new();
    for local in 0..nproc {
        let rank = offset + local;
        let mut cmd = Command::new(&program);
        cmd.args(&args.command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("ROLE_RANK", rank.to_string())
            .env("ROLE_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", &master_addr)
            .env("MASTER_PORT", master_port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            cmd.env("RAYON_NUM_THREADS", threads.to_string());
        }
        cmd.env(RUN_ID_VAR, &run_id);
        // The job's identity for the rendezvous, where every rank gets the same one: one
        // node, or the nodes of a hostfile launch (which forwards the run id). Nodes started
        // by hand each have their own launcher and run id, so they name no job.
        if nnodes == 1 || args.rank_offset.is_some() {
            cmd.env(JOB_ID_VAR, &run_id);
        } else {
            cmd.env_remove(JOB_ID_VAR);
        }
        if let Some(v) = &args.visible_devices {
            cmd.env("CUDA_VISIBLE_DEVICES", v);
        }
        if args.one_gpu {
            // each rank its own NCCL host on the one device (see `LaunchArgs::one_gpu`)
            cmd.env(DEVICE_INDEX_VAR, "0").env("NCCL_HOSTID", format!("vitscale-{run_id}-rank{rank}"));
            if std::env::var_os("NCCL_SOCKET_IFNAME").is_none() {
                cmd.env("NCCL_SOCKET_IFNAME", "lo");
            }
        }
        if let Some(d) = &ready_dir {
            cmd.env(DEVICE_READY_VAR, d.join(format!("rank{rank}")));
        }
        let spawned = cmd.spawn().map_err(|e| LaunchError::Spawn {
            what: format!("rank {rank}"),
            program: program.display().to_string(),
            source: e,
        });
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut procs, libc::SIGKILL);
                return Err(e);
            }
        };
        outputs.extend(forward_output(&mut child, rank, args.output));
        if let Some(d) = ready_dir.as_ref().filter(|_| local + 1 < nproc) {
            wait_until_ready(&mut child, &d.join(format!("rank{rank}")), rank);
        }
        procs.push(Proc { label: Label::Rank(rank), child, status: None, termed: false });
    }
    let code = supervise(procs, outputs, (args.kill_grace, args.stop_grace), &signals, stop_on_eof);
    if let Some(d) = &ready_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    code
}

/// How long the launcher waits for a worker's device before starting the next anyway (a
/// worker program that never signals, or a device that takes that long to open).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Waits until `child` has created `path`, has exited (its failure is the supervisor's to
/// report), a signal is pending, or `READY_TIMEOUT` has passed.
fn wait_until_ready(child: &mut Child, path: &Path, rank: usize) {
    let t = Instant::now();
    while !path.exists() {
        if !matches!(child.try_wait(), Ok(None)) || PENDING_SIGNAL.load(Ordering::SeqCst) != 0 {
            return;
        }
        if t.elapsed() > READY_TIMEOUT {
            eprintln!("launch: rank {rank} has not opened its device after {} s; starting the next rank", READY_TIMEOUT.as_secs());
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Starts threads copying a worker's stdout / stderr to ours, per the output mode.
fn forward_output(child: &mut Child, rank: usize, mode: OutputMode) -> Vec<std::thread::JoinHandle<()>> {
    let mut hs = Vec::new();
    let prefix = format!("[rank {rank}] ");
    if let Some(out) = child.stdout.take() {
        let (show, pre) = match (rank, mode) {
            (0, _) => (true, String::new()),
            (_, OutputMode::All) => (true, prefix.clone()),
            (_, OutputMode::Rank0) => (false, String::new()),
        };
        hs.push(std::thread::spawn(move || copy_lines(out, show.then_some(pre), false)));
    }
    if let Some(err) = child.stderr.take() {
        hs.push(std::thread::spawn(move || copy_lines(err, Some(prefix), true)));
    }
    hs
}

/// Copies lines (bytes, not necessarily UTF-8) with a prefix; `None` reads and drops them so
/// the worker never blocks on a full pipe.
fn copy_lines(src: impl Read, prefix: Option<String>, to_stderr: bool) {
    let mut r = BufReader::new(src);
    let mut line = Vec::new();
    loop {
        line.clear();
        match r.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let Some(p) = &prefix else { continue };
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        // One write per line under the lock: lines of different ranks never interleave.
        let _ = if to_stderr {
            let mut e = io::stderr().lock();
            e.write_all(p.as_bytes()).and_then(|_| e.write_all(&line))
        } else {
            let mut o = io::stdout().lock();
            o.write_all(p.as_bytes()).and_then(|_| o.write_all(&line)).and_then(|_| o.flush())
        };
    }
}

/// Waits for every child; stops the rest on the first failure or on a signal. `graces`:
/// seconds until SIGKILL after a failure, and after a forwarded signal.
fn supervise(
    mut procs: Vec<Proc>,
    outputs: Vec<std::thread::JoinHandle<()>>,
    graces: (f64, f64),
    signals: &SignalGuard,
    stdin_closed: Option<Arc<AtomicBool>>,
) -> Result<i32, LaunchError> {
    let (grace, stop_grace) = (Duration::from_secs_f64(graces.0), Duration::from_secs_f64(graces.1));
    let mut failure: Option<(Label, u32, ExitDesc)> = None;
    let mut interrupted: Option<i32> = None;
    let mut kill_at: Option<Instant> = None;
    loop {
        let mut sig = signals.take();
        if sig == 0 && stdin_closed.as_ref().is_some_and(|f| f.load(Ordering::SeqCst)) && interrupted.is_none() {
            sig = libc::SIGTERM;
        }
        if sig != 0 {
            // Forward every signal (a second Ctrl-C is forwarded too), then insist later.
            stop_all(&mut procs, sig);
            interrupted.get_or_insert(sig);
            kill_at.get_or_insert(Instant::now() + stop_grace);
        }
        // Workers that died since the last look. When several failed at once, one killed by a
        // signal is named first: the others usually exited because it went away (a peer's
        // collective fails at once when its connection closes).
        let mut failed_now: Option<(Label, u32, ExitDesc)> = None;
        for p in procs.iter_mut().filter(|p| p.status.is_none()) {
            if let Ok(Some(st)) = p.child.try_wait() {
                p.status = Some(st);
                let desc = ExitDesc::of(st);
                let by_signal = matches!(desc, ExitDesc::Signal(_));
                if !st.success() && (failed_now.is_none() || (by_signal && !matches!(failed_now, Some((_, _, ExitDesc::Signal(_)))))) {
                    failed_now = Some((p.label.clone(), p.child.id(), desc));
                }
            }
        }
        if failure.is_none() && interrupted.is_none() && failed_now.is_some() {
            failure = failed_now;
            kill_at = Some(Instant::now() + grace);
        }
        if failure.is_some() {
            stop_all(&mut procs, libc::SIGTERM);
        }
        if procs.iter().all(|p| p.status.is_some()) {
            break;
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            stop_all(&mut procs, libc::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Output threads end when the pipes close; a grandchild that kept a pipe open must not
    // hold the launcher, so give them a moment and move on.
    let until = Instant::now() + Duration::from_millis(500);
    for h in outputs {
        while !h.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        if h.is_finished() {
            let _ = h.join();
        }
    }
    if let Some((label, pid, status)) = failure {
        return Err(match label {
            Label::Rank(rank) => LaunchError::WorkerFailed { rank, pid, status },
            Label::Node(node, host) => LaunchError::NodeFailed { node, host, status },
        });
    }
    if let Some(signal) = interrupted {
        return Err(LaunchError::Interrupted { signal });
    }
    Ok(0)
}

/// Sends `sig` to every running child's process group (the worker and anything it started).
/// SIGTERM is sent once per child; other signals every time they are asked for.
fn stop_all(procs: &mut [Proc], sig: i32) {
    for p in procs.iter_mut().filter(|p| p.status.is_none()) {
        if let Ok(Some(st)) = p.child.try_wait() {
            p.status = Some(st);
            continue;
        }
        if sig == libc::SIGTERM {
            if p.termed {
                continue;
            }
            p.termed = true;
        }
        let pid = p.child.id() as libc::pid_t;
        // SAFETY: kill(2) with a process group id we created (process_group(0) makes the
        // child's pid its group id); it touches no memory of ours.
        unsafe {
            libc::kill(-pid, sig);
        }
    }
}

/// A free loopback port for rank 0's rendezvous, drawn below the kernel's ephemeral range
/// (`ip_local_port_range`): a port from that range, which `bind(0)` hands out, can be taken by
/// any outgoing connection (another run's ring) between this check and rank 0's bind moments
/// later. Falls back to `bind(0)` where the range leaves no room below it.
pub fn free_port() -> Option<u16> {
    let bindable = |p: u16| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok();
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u32>().ok()))
        .unwrap_or(32768);
    let (lo, hi) = (10_000u32, ephemeral_low.min(32_768));
    if hi >= lo + 1000 {
        use rand::Rng;
        let mut rng = rand::thread_rng();
        // random draws, so concurrent launchers pick different ports
        if let Some(p) = (0..64).map(|_| rng.gen_range(lo..hi) as u16).find(|&p| bindable(p)) {
            return Some(p);
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).ok()
}

/// Names the run for every worker, so all ranks choose the same default run directory.
pub const RUN_ID_VAR: &str = "VITSCALE_RUN_ID";
/// The job's identity the rendezvous checks (`comm::env::JOB_ID_VARS`), set by the launcher.
pub const JOB_ID_VAR: &str = "VITSCALE_JOB_ID";

fn run_id() -> String {
    if let Some(id) = std::env::var(RUN_ID_VAR).ok().filter(|s| !s.is_empty()) {
        return id;
    }
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format!("{secs}-{}", std::process::id())
}

// ---- signals --------------------------------------------------------------------------------

/// The last signal received and not yet handled (0 = none). A static because a signal
/// handler can reach nothing else.
static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    PENDING_SIGNAL.store(sig, Ordering::SeqCst);
}

const FORWARDED: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Catches the forwarded signals while alive; restores the previous handlers on drop (the
/// launcher may run inside a test process).
struct SignalGuard {
    _handlers: crate::util::SignalHandlers,
}

impl SignalGuard {
    fn install() -> Self {
        SignalGuard { _handlers: crate::util::SignalHandlers::install(&FORWARDED, on_signal) }
    }

    fn take(&self) -> i32 {
        PENDING_SIGNAL.swap(0, Ordering::SeqCst)
    }
}

/// A flag raised when stdin reaches end of file (the remote side of an ssh went away).
fn watch_stdin() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    std::thread::spawn(move || {
        let mut sink = [0u8; 256];
        let mut stdin = io::stdin();
        loop {
            match stdin.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        f.store(true, Ordering::SeqCst);
    });
    flag
}

// ---- hostfile -------------------------------------------------------------------------------

/// A host of the hostfile and the slots (GPU indices) used on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Host {
    pub name: String,
    pub slots: Vec<usize>,
}

/// Parses DeepSpeed's hostfile: `hostname slots=N` per line; `#` starts a comment.
pub fn parse_hostfile(text: &str, path: &Path) -> Result<Vec<Host>, LaunchError> {
    let mut hosts: Vec<Host> = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let err = |msg: String| LaunchError::Hostfile { path: path.to_path_buf(), line: i + 1, msg };
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let (Some(name), Some(slots), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(err(format!("expected `hostname slots=N`, found {line:?}")));
        };
        let n = slots
            .strip_prefix("slots=")
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .ok_or_else(|| err(format!("expected slots=N with N ≥ 1, found {slots:?}")))?;
        if hosts.iter().any(|h| h.name == name) {
            return Err(err(format!("host {name} is listed twice")));
        }
        hosts.push(Host { name: name.to_string(), slots: (0..n).collect() });
    }
    if hosts.is_empty() {
        return Err(LaunchError::Hostfile { path: path.to_path_buf(), line: 0, msg: "no hosts".into() });
    }
    Ok(hosts)
}

/// Parses `host1:0,1@host2`: hosts and, optionally, their slots.
fn parse_filter(flag: &'static str, spec: &str) -> Result<BTreeMap<String, Option<Vec<usize>>>, LaunchError> {
    let err = |msg: String| LaunchError::Filter { flag, spec: spec.to_string(), msg };
    let mut out = BTreeMap::new();
    for part in spec.split('@').map(str::trim) {
        if part.is_empty() {
            return Err(err("empty host".into()));
        }
        let (host, slots) = match part.split_once(':') {
            Some((h, s)) => {
                let slots: Result<Vec<usize>, _> = s.split(',').map(|x| x.trim().parse::<usize>()).collect();
                (h, Some(slots.map_err(|_| err(format!("bad slot list {s:?}")))?))
            }
            None => (part, None),
        };
        if out.insert(host.to_string(), slots).is_some() {
            return Err(err(format!("host {host} appears twice")));
        }
    }
    Ok(out)
}

/// DeepSpeed's `--include` / `--exclude` semantics: include keeps only the named hosts (and
/// slots); exclude drops named hosts, or only the named slots of them. Naming a host or slot
/// the hostfile lacks is an error.
pub fn filter_hosts(hosts: Vec<Host>, include: Option<&str>, exclude: Option<&str>) -> Result<Vec<Host>, LaunchError> {
    let (flag, spec) = match (include, exclude) {
        (Some(_), Some(_)) => return Err(LaunchError::Usage("--include and --exclude are mutually exclusive".into())),
        (Some(s), None) => ("include", s),
        (None, Some(s)) => ("exclude", s),
        (None, None) => return Ok(hosts),
    };
    let filter = parse_filter(flag, spec)?;
    for (name, slots) in &filter {
        let err = |msg: String| LaunchError::Filter { flag, spec: spec.to_string(), msg };
        let host = hosts.iter().find(|h| &h.name == name).ok_or_else(|| err(format!("host {name} is not in the hostfile")))?;
        for s in slots.iter().flatten() {
            if !host.slots.contains(s) {
                return Err(err(format!("host {name} has no slot {s} (slots 0..{})", host.slots.len())));
            }
        }
    }
    let include = flag == "include";
    Ok(hosts
        .into_iter()
        .filter_map(|mut h| {
            let f = filter.get(&h.name);
            h.slots = match (include, f) {
                (true, None) => return None,
                (true, Some(None)) => h.slots,
                (true, Some(Some(keep))) => h.slots.into_iter().filter(|s| keep.contains(s)).collect(),
                (false, None) => h.slots,
                (false, Some(None)) => return None,
                (false, Some(Some(drop))) => h.slots.into_iter().filter(|s| !drop.contains(s)).collect(),
            };
            (!h.slots.is_empty()).then_some(h)
        })
        .collect())
}

/// `--nnodes` keeps the first N hosts, `--nproc-per-node` the first N slots of each.
fn limit_hosts(mut hosts: Vec<Host>, nnodes: Option<usize>, nproc: Option<usize>) -> Vec<Host> {
    if let Some(n) = nnodes {
        hosts.truncate(n);
    }
    if let Some(n) = nproc {
        for h in &mut hosts {
            h.slots.truncate(n);
        }
    }
    hosts
}

fn join_slots(slots: &[usize]) -> String {
    slots.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(",")
}

fn is_local_host(name: &str) -> bool {
    if matches!(name, "localhost" | "127.0.0.1" | "::1") {
        return true;
    }
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `len` bytes into our buffer.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } == 0;
    let me = String::from_utf8_lossy(buf.split(|&b| b == 0).next().unwrap_or(&[])).to_string();
    ok && (me == name || me.split('.').next() == Some(name))
}

/// Variables carried to remote nodes: `NCCL_*` and `VITSCALE_*` from our environment, then
/// `.vitscale_env` in the home directory, then in the working directory (later wins).
pub fn forwarded_env(vars: impl Iterator<Item = (String, String)>, env_files: &[PathBuf]) -> Result<Vec<(String, String)>, LaunchError> {
    let mut out: BTreeMap<String, String> =
        vars.filter(|(k, _)| k.starts_with("NCCL_") || k.starts_with("VITSCALE_")).collect();
    for path in env_files {
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(LaunchError::Read { what: "environment file", path: path.clone(), source: e }),
        };
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let line = line.strip_prefix("export ").unwrap_or(line);
            let Some((k, v)) = line.split_once('=') else {
                return Err(LaunchError::Hostfile { path: path.clone(), line: i + 1, msg: format!("expected KEY=VALUE, found {line:?}") });
            };
            let k = k.trim();
            if k.is_empty() || !k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(LaunchError::Hostfile { path: path.clone(), line: i + 1, msg: format!("bad variable name {k:?}") });
            }
            out.insert(k.to_string(), v.trim().to_string());
        }
    }
    Ok(out.into_iter().collect())
}

/// The command one node runs over ssh: this launcher for that node's slots.
#[allow(clippy::too_many_arguments)]
fn remote_command(args: &LaunchArgs, exe: &Path, cwd: &Path, env: &[(String, String)], node: usize, nnodes: usize, host: &Host, offset: usize, world: usize, master: &str) -> String {
    let mut s = format!("cd {} && ", shell_quote(&cwd.display().to_string()));
    if !env.is_empty() {
        s += "export";
        for (k, v) in env {
            s += &format!(" {k}={}", shell_quote(v));
        }
        s += " && ";
    }
    let mut argv: Vec<String> = vec![
        exe.display().to_string(),
        "launch".into(),
        "--nproc-per-node".into(),
        host.slots.len().to_string(),
        "--nnodes".into(),
        nnodes.to_string(),
        "--node-rank".into(),
        node.to_string(),
        "--master-addr".into(),
        master.to_string(),
        "--master-port".into(),
        args.master_port.unwrap_or(DEFAULT_MASTER_PORT).to_string(),
        "--rank-offset".into(),
        offset.to_string(),
        "--world-size".into(),
        world.to_string(),
        "--visible-devices".into(),
        join_slots(&host.slots),
        "--output".into(),
        match args.output {
            OutputMode::Rank0 => "rank0".into(),
            OutputMode::All => "all".into(),
        },
        "--kill-grace".into(),
        args.kill_grace.to_string(),
        "--stop-grace".into(),
        args.stop_grace.to_string(),
        "--exit-on-stdin-eof".into(),
    ];
    if let Some(p) = &args.worker_program {
        argv.extend(["--worker-program".into(), p.display().to_string()]);
    }
    argv.push("--".into());
    argv.extend(args.command.iter().cloned());
    s += &argv.iter().map(|a| shell_quote(a)).collect::<Vec<_>>().join(" ");
    s
}

/// One ssh per host, each running this launcher there; supervised like local workers.
fn run_hosts(args: &LaunchArgs, hosts: &[Host]) -> Result<i32, LaunchError> {
    let exe = std::env::current_exe().map_err(LaunchError::CurrentExe)?;
    let cwd = std::env::current_dir().map_err(|e| LaunchError::Read { what: "working directory", path: ".".into(), source: e })?;
    let mut files = Vec::new();
    if let Some(home) = std::env::var_os("HOME") {
        files.push(PathBuf::from(home).join(".vitscale_env"));
    }
    files.push(cwd.join(".vitscale_env"));
    let mut env = forwarded_env(std::env::vars(), &files)?;
    if !env.iter().any(|(k, _)| k == RUN_ID_VAR) {
        env.push((RUN_ID_VAR.to_string(), run_id()));
    }
    let master = args.master_addr.clone().unwrap_or_else(|| hosts[0].name.clone());
    let world: usize = hosts.iter().map(|h| h.slots.len()).sum();
    let ssh: Vec<&str> = args.ssh.split_whitespace().collect();
    let Some((ssh_prog, ssh_args)) = ssh.split_first() else {
        return Err(LaunchError::Usage("--ssh is empty".into()));
    };

    let signals = SignalGuard::install();
    let mut procs = Vec::new();
    let mut outputs = Vec::new();
    let mut offset = 0;
    for (node, host) in hosts.iter().enumerate() {
        let remote = remote_command(args, &exe, &cwd, &env, node, hosts.len(), host, offset, world, &master);
        offset += host.slots.len();
        let spawned = Command::new(ssh_prog)
            .args(ssh_args)
            .arg(&host.name)
            .arg(&remote)
            // Kept open: the remote launcher stops its workers when this pipe closes.
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut procs, libc::SIGKILL);
                return Err(LaunchError::Spawn { what: format!("node {node} ({})", host.name), program: args.ssh.clone(), source: e });
            }
        };
        // The remote launcher already prefixes its ranks' lines and filters stdout.
        if let Some(out) = child.stdout.take() {
            outputs.push(std::thread::spawn(move || copy_lines(out, Some(String::new()), false)));
        }
        if let Some(err) = child.stderr.take() {
            outputs.push(std::thread::spawn(move || copy_lines(err, Some(String::new()), true)));
        }
        procs.push(Proc { label: Label::Node(node, host.name.clone()), child, status: None, termed: false });
    }
    supervise(procs, outputs, (args.kill_grace, args.stop_grace), &signals, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(text: &str) -> Result<Vec<Host>, LaunchError> {
        parse_hostfile(text, Path::new("hosts"))
    }

    #[test]
    fn hostfile_format_and_errors() {
        let h = hosts("# cluster\nworker-1 slots=4\n\nworker-2 slots=2  # spare\n").unwrap();
        assert_eq!(h, vec![Host { name: "worker-1".into(), slots: vec![0, 1, 2, 3] }, Host { name: "worker-2".into(), slots: vec![0, 1] }]);
        let e = hosts("a slots=2\nb slots=x\n").unwrap_err().to_string();
        assert!(e.starts_with("hosts:2:") && e.contains("slots=x"), "{e}");
        let e = hosts("a slots=2\na slots=1\n").unwrap_err().to_string();
        assert!(e.contains("hosts:2") && e.contains("listed twice"), "{e}");
        assert!(hosts("a\n").unwrap_err().to_string().contains("hostname slots=N"));
    }

    #[test]
    fn include_exclude_like_deepspeed() {
        let all = hosts("w1 slots=4\nw2 slots=4\nw3 slots=2\n").unwrap();
        let inc = filter_hosts(all.clone(), Some("w1:0,2@w3"), None).unwrap();
        assert_eq!(inc, vec![Host { name: "w1".into(), slots: vec![0, 2] }, Host { name: "w3".into(), slots: vec![0, 1] }]);
        let exc = filter_hosts(all.clone(), None, Some("w2@w3:1")).unwrap();
        assert_eq!(exc, vec![Host { name: "w1".into(), slots: vec![0, 1, 2, 3] }, Host { name: "w3".into(), slots: vec![0] }]);
        let e = filter_hosts(all.clone(), Some("w9"), None).unwrap_err().to_string();
        assert!(e.contains("--include \"w9\"") && e.contains("not in the hostfile"), "{e}");
        let e = filter_hosts(all.clone(), None, Some("w3:5")).unwrap_err().to_string();
        assert!(e.contains("no slot 5"), "{e}");
        assert!(filter_hosts(all.clone(), Some("w1"), Some("w2")).is_err());
        let lim = limit_hosts(all, Some(2), Some(1));
        assert_eq!(lim, vec![Host { name: "w1".into(), slots: vec![0] }, Host { name: "w2".into(), slots: vec![0] }]);
    }

    #[test]
    fn env_forwarding_and_quoting() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home_env");
        let cwd = dir.path().join("cwd_env");
        std::fs::write(&home, "# comment\nFOO=home\nBAR=1\n").unwrap();
        std::fs::write(&cwd, "export FOO=it's cwd\n").unwrap();
        let vars = vec![("NCCL_DEBUG".into(), "INFO".into()), ("HOME".into(), "/x".into()), ("VITSCALE_COMM_TIMEOUT".into(), "30".into())];
        let env = forwarded_env(vars.into_iter(), &[home, cwd.clone(), dir.path().join("missing")]).unwrap();
        let m: BTreeMap<_, _> = env.into_iter().collect();
        assert_eq!(m.get("FOO").map(String::as_str), Some("it's cwd"));
        assert_eq!(m.get("NCCL_DEBUG").map(String::as_str), Some("INFO"));
        assert!(m.contains_key("BAR") && m.contains_key("VITSCALE_COMM_TIMEOUT") && !m.contains_key("HOME"));
        std::fs::write(&cwd, "NOEQUALS\n").unwrap();
        let e = forwarded_env(std::iter::empty(), &[cwd]).unwrap_err().to_string();
        assert!(e.contains("cwd_env:1") && e.contains("KEY=VALUE"), "{e}");
        use crate::util::shell_quote;
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(shell_quote("--set"), "--set");
        assert_eq!(shell_quote("a b"), "'a b'");
    }

    #[test]
    fn remote_command_carries_layout_and_env() {
        let args = LaunchArgs::local(1, vec!["train".into(), "--set".into(), "data.mean=[0.5, 0.5]".into()]);
        let host = Host { name: "w2".into(), slots: vec![1, 3] };
        let env = vec![("NCCL_IB_DISABLE".to_string(), "1".to_string())];
        let c = remote_command(&args, Path::new("/opt/vitscale"), Path::new("/work dir"), &env, 1, 2, &host, 4, 6, "w1");
        assert!(c.starts_with("cd '/work dir' && export NCCL_IB_DISABLE=1 && /opt/vitscale launch --nproc-per-node 2 --nnodes 2 --node-rank 1 --master-addr w1"), "{c}");
        assert!(c.contains("--rank-offset 4 --world-size 6 --visible-devices 1,3 "), "{c}");
        assert!(c.ends_with("-- train --set 'data.mean=[0.5, 0.5]'"), "{c}");
    }
}
