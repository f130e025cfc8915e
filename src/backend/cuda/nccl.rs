//! The NCCL communicator: the `Comm` trait on device buffers, for GPU ranks.
//!
//! - The library is opened by us, not by cudarc's loader, which looks for `libnccl.so` and
//!   CUDA-versioned names but not `libnccl.so.2`, the name pip's `nvidia-nccl` wheel and most
//!   packages ship; we try the loader path first, then the same folders as the other CUDA
//!   libraries (`libs::candidate_dirs`). The types are cudarc's NCCL bindings'.
//! - The unique id travels from rank 0 through the rendezvous (`TcpComm::connect_sharing`),
//!   whose TCP ring also carries the host-side values (`all_reduce_host`, `barrier`).
//! - Collectives run on a stream of their own. `start` makes that stream wait for an event
//!   recorded on the compute stream (the gradients are written), enqueues the collective and
//!   records a completion event; `wait` makes the compute stream wait for that event. Neither
//!   blocks the host, so buckets reduce while the backward's kernels run.
//! - Device timing: each collective is bracketed by timing events on the communication stream
//!   (its duration), and the boundary's waits by events on the compute stream (the exposed
//!   part, `begin_waits` / `end_waits`); `take_device_timing` reads them after a host
//!   synchronization.
//! - `all_to_all` is NCCL's grouped `ncclSend`/`ncclRecv`, one pair per peer, from a copy of
//!   the span (send and receive buffers must not overlap). `split_groups` makes each group's
//!   communicator with `ncclCommSplit` (NCCL 2.18+), else from a unique id the group's first
//!   rank hands the others over the group's host ring; the group has its own stream, host ring
//!   and watchdog, so its collectives and the world's run independently.
//! - A watchdog thread polls the completion events: a collective outstanding for longer than
//!   the communicator's timeout is aborted (`ncclCommAbort`) and every later call fails with
//!   an error naming the collective, its span and this rank; NCCL's own asynchronous errors
//!   (a peer that vanished) are caught the same way.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUevent_flags, CUresult, CUstream};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::sys::ncclUniqueId;

use super::device::{kargs, MemStats, THREADS};
use super::gemm::Ty;
use crate::backend::half::HalfFormat;
use super::{libs, Cuda, CudaBuf};
use crate::comm::{check_args, check_group, Arrivals, CResult, Collective, Comm, CommError, CommOptions, DeviceTiming, DistEnv, ReduceOp, SingleComm, Span, TcpComm, Wire, Work};

type RawComm = *mut c_void;
// NCCL's result, data type and operation codes (nccl.h), as plain integers: a value this
// build does not know must not be read into a Rust enum.
const NCCL_SUCCESS: c_int = 0;
const NCCL_IN_PROGRESS: c_int = 7;
const NCCL_FLOAT16: c_int = 6;
const NCCL_FLOAT32: c_int = 7;
const NCCL_BFLOAT16: c_int = 9;
/// `scaled_cast_kernel`'s code for bf16 whatever the kernels' 16-bit format (common.cuh): the
/// bf16 wire stays bf16 in an fp16 run, where loss-scaled gradient sums may pass fp16's 65504.
const DT_BF16: i32 = 2;
const NCCL_SUM: c_int = 0;
const NCCL_AVG: c_int = 4;

/// The NCCL functions we call, resolved once per process.
struct Lib {
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, ncclUniqueId, c_int) -> c_int,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, CUstream) -> c_int,
    reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, CUstream) -> c_int,
    all_gather: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, CUstream) -> c_int,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, CUstream) -> c_int,
    comm_abort: unsafe extern "C" fn(RawComm) -> c_int,
    comm_destroy: unsafe extern "C" fn(RawComm) -> c_int,
    async_error: unsafe extern "C" fn(RawComm, *mut c_int) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    send: unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, CUstream) -> c_int,
    recv: unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, CUstream) -> c_int,
    group_start: unsafe extern "C" fn() -> c_int,
    group_end: unsafe extern "C" fn() -> c_int,
    /// `ncclCommSplit` (NCCL 2.18 and later; None before): a group's communicator made from
    /// the world's without another unique id.
    comm_split: Option<unsafe extern "C" fn(RawComm, c_int, c_int, *mut RawComm, *mut c_void) -> c_int>,
    _lib: libloading::Library,
}

const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

fn open_lib() -> Result<Lib, String> {
    libs::ensure_loaded()?;
    let symbols = [
        "ncclGetUniqueId", "ncclCommInitRank", "ncclAllReduce", "ncclReduceScatter", "ncclAllGather", "ncclBroadcast",
        "ncclCommAbort", "ncclCommDestroy", "ncclCommGetAsyncError", "ncclGetErrorString", "ncclGetVersion", "ncclSend", "ncclRecv",
        "ncclGroupStart", "ncclGroupEnd",
    ];
    let (lib, p) = libs::open_with_symbols(&NAMES, &symbols).map_err(|tried| {
        format!(
            "cannot load libnccl.so.2 (NCCL, the GPU collectives): not on the loader path and not found in the CUDA library folders ({}); install NCCL or `pip install nvidia-nccl-cu13`, or set VITSCALE_CUDA_LIB_DIR to the folder that holds it",
            if tried.is_empty() { "no candidate file".to_string() } else { tried.join("; ") }
        )
    })?;
    // SAFETY: looking up an optional symbol of the library just opened.
    let split = unsafe { lib.get::<*const c_void>(b"ncclCommSplit") }.ok().map(|s| *s).filter(|p| !p.is_null());
    // SAFETY: each address is the named NCCL function (nccl.h, NCCL 2.x stable ABI),
    // transmuted to its type; `lib` moves into the table that keeps it loaded.
    Ok(unsafe {
        Lib {
            get_unique_id: std::mem::transmute::<*const c_void, _>(p[0]),
            comm_init_rank: std::mem::transmute::<*const c_void, _>(p[1]),
            all_reduce: std::mem::transmute::<*const c_void, _>(p[2]),
            reduce_scatter: std::mem::transmute::<*const c_void, _>(p[3]),
            all_gather: std::mem::transmute::<*const c_void, _>(p[4]),
            broadcast: std::mem::transmute::<*const c_void, _>(p[5]),
            comm_abort: std::mem::transmute::<*const c_void, _>(p[6]),
            comm_destroy: std::mem::transmute::<*const c_void, _>(p[7]),
            async_error: std::mem::transmute::<*const c_void, _>(p[8]),
            error_string: std::mem::transmute::<*const c_void, _>(p[9]),
            get_version: std::mem::transmute::<*const c_void, _>(p[10]),
            send: std::mem::transmute::<*const c_void, _>(p[11]),
            recv: std::mem::transmute::<*const c_void, _>(p[12]),
            group_start: std::mem::transmute::<*const c_void, _>(p[13]),
            group_end: std::mem::transmute::<*const c_void, _>(p[14]),
            comm_split: split.map(|a| std::mem::transmute::<*const c_void, _>(a)),
            _lib: lib,
        }
    })
}

fn lib() -> Result<&'static Lib, String> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(open_lib).as_ref().map_err(|e| e.clone())
}

/// NCCL's version as "2.28.9", or why it could not be loaded.
pub fn version() -> Result<String, String> {
    let l = lib()?;
    let mut v: c_int = 0;
    // SAFETY: writes one int.
    unsafe { (l.get_version)(&mut v) };
    Ok(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

fn nccl_text(l: &Lib, r: c_int) -> String {
    // SAFETY: NCCL returns a static NUL-terminated string for any code.
    let s = unsafe { (l.error_string)(r) };
    if s.is_null() {
        format!("NCCL error {r}")
    } else {
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}

/// The communicator handle, shared with the watchdog (abort is thread-safe in NCCL).
struct Handle(RawComm);
// SAFETY: an NCCL communicator may be aborted or queried from another thread.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

struct InFlight {
    id: u64,
    done: Arc<CudaEvent>,
    since: Instant,
    what: String,
}

/// What the watchdog shares with the communicator.
struct Shared {
    in_flight: Mutex<Vec<InFlight>>,
    /// Set once the communicator failed: the reason every later call reports.
    failed: Mutex<Option<String>>,
    stop: AtomicBool,
}

pub struct NcclComm {
    rank: usize,
    world: usize,
    lib: &'static Lib,
    comm: Arc<Handle>,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    stream: Arc<CudaStream>,
    host: TcpComm,
    shared: Arc<Shared>,
    watchdog: Option<std::thread::JoinHandle<()>>,
    next_id: u64,
    pending: HashMap<u64, (Arc<CudaEvent>, Arc<CudaEvent>, String)>,
    /// (start, done, what) of collectives waited on since the last `take_device_timing`.
    timed: Vec<(Arc<CudaEvent>, Arc<CudaEvent>, String)>,
    /// The compute stream's events around each boundary's waits.
    waits: Vec<(CudaEvent, CudaEvent)>,
    open_wait: Option<CudaEvent>,
    /// `scaled_cast_kernel` and its grid cap: the wire's scaling and bf16 conversion run on
    /// the communication stream, so they overlap the backward like the collective itself.
    scaled_cast: (cudarc::driver::CudaFunction, u32),
    mem: Arc<MemStats>,
    /// bf16 copy of the reduced buffer's spans for a bf16 wire (grown on first use; bf16 also
    /// on an fp16 backend, the tag `Ty::Half` only gives its element size).
    wire_bf16: Option<CudaBuf>,
    /// The backend's 16-bit compute format: the NCCL type of its 16-bit buffers.
    half: HalfFormat,
    /// Each collective's arrival, reported to rank 0 through the host ring's control link.
    arrivals: Arrivals,
    /// The caller's name for the next collective (`label_next`).
    label: Option<String>,
    /// The collectives' timeout (a group's communicator made by `split_groups` inherits it).
    timeout: Duration,
    /// The all-to-all's copy of its input: NCCL's send and receive buffers must not overlap,
    /// and every block of the span is both sent and received (grown on first use).
    a2a_scratch: Option<CudaBuf>,
    /// Rank in the world communicator (errors name it); `rank` is the rank in a group.
    world_rank: usize,
}

/// What a communicator takes from the backend (a group's communicator, from the world's).
struct Parts {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    scaled_cast: (cudarc::driver::CudaFunction, u32),
    mem: Arc<MemStats>,
    timeout: Duration,
    /// The backend's 16-bit format (what NCCL is told a 16-bit buffer holds).
    half: HalfFormat,
}

/// Set (to anything but 0) to make `split_groups` build its communicators from a fresh unique
/// id even where NCCL has `ncclCommSplit`: the fallback's path, for checking it.
pub const ENV_NO_SPLIT: &str = "VITSCALE_NCCL_NO_SPLIT";

/// `ncclCommInitRank` for rank `rank` of `world` with `id`; blocks until every rank has joined.
fn init_rank(l: &Lib, world_rank: usize, id: ncclUniqueId, world: usize, rank: usize) -> CResult<RawComm> {
    let mut comm: RawComm = std::ptr::null_mut();
    // SAFETY: every rank of the communicator calls this once with the same id.
    let r = unsafe { (l.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) };
    if r != NCCL_SUCCESS {
        return Err(CommError::Device { rank: world_rank, msg: format!("ncclCommInitRank (rank {rank} of {world}): {}", nccl_text(l, r)) });
    }
    Ok(comm)
}

fn cu(rank: usize, what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CommError + '_ {
    move |e| CommError::Device { rank, msg: format!("{what}: {e}") }
}

impl NcclComm {
    /// Joins the job `env` describes on the GPU of `be`: rendezvous (rank 0's unique id goes
    /// to every rank), then `ncclCommInitRank`. Collectives wait at most `opts.timeout`.
    pub fn connect(env: &DistEnv, opts: &CommOptions, config_hash: &str, be: &Cuda) -> CResult<NcclComm> {
        let rank = env.rank;
        let l = lib().map_err(|msg| CommError::Device { rank, msg })?;
        let mut id = ncclUniqueId { internal: [0; 128] };
        if rank == 0 {
            // SAFETY: fills the 128-byte id.
            let r = unsafe { (l.get_unique_id)(&mut id) };
            if r != NCCL_SUCCESS {
                return Err(CommError::Device { rank, msg: format!("ncclGetUniqueId: {}", nccl_text(l, r)) });
            }
        }
        let blob: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        let (host, blob) = TcpComm::connect_sharing(env, opts, config_hash, blob)?;
        if blob.len() != 128 {
            return Err(CommError::Device { rank, msg: format!("the NCCL unique id from rank 0 has {} bytes, expected 128", blob.len()) });
        }
        for (d, s) in id.internal.iter_mut().zip(&blob) {
            *d = *s as c_char;
        }
        let ctx = be.context().clone();
        ctx.bind_to_thread().map_err(cu(rank, "binding the CUDA context"))?;
        let comm = init_rank(l, rank, id, env.world_size, rank)?;
        let scaled_cast = be.kernel_for_stream("scaled_cast_kernel").map_err(|e| CommError::Device { rank, msg: e.to_string() })?;
        let parts = Parts { ctx, compute: be.stream().clone(), scaled_cast, mem: be.mem_stats().clone(), timeout: opts.timeout, half: be.half_format() };
        Self::assemble(l, comm, rank, rank, env.world_size, host, parts)
    }

    /// The communicator around an initialized NCCL handle `comm` (rank `rank` of `world`,
    /// `world_rank` in the job): its stream, its watchdog, `host` for host-side values.
    fn assemble(l: &'static Lib, comm: RawComm, world_rank: usize, rank: usize, world: usize, host: TcpComm, parts: Parts) -> CResult<NcclComm> {
        let Parts { ctx, compute, scaled_cast, mem, timeout, half } = parts;
        let stream = match ctx.new_stream() {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: the handle was just made and nothing was enqueued on it.
                unsafe { (l.comm_destroy)(comm) };
                return Err(cu(world_rank, "creating the communication stream")(e));
            }
        };
        let shared = Arc::new(Shared { in_flight: Mutex::new(Vec::new()), failed: Mutex::new(None), stop: AtomicBool::new(false) });
        let handle = Arc::new(Handle(comm));
        let arrivals = host.arrivals();
        let watchdog = {
            let (shared, handle, ctx, arrivals) = (shared.clone(), handle.clone(), ctx.clone(), arrivals.clone());
            std::thread::Builder::new()
                .name(format!("vitscale-nccl-watchdog-{world_rank}"))
                .spawn(move || watch(l, world_rank, &shared, &handle, &ctx, timeout, &arrivals))
                .map_err(|e| CommError::Device { rank: world_rank, msg: format!("starting the NCCL watchdog: {e}") })?
        };
        Ok(NcclComm {
            rank,
            world,
            lib: l,
            comm: handle,
            ctx,
            compute,
            stream,
            host,
            shared,
            watchdog: Some(watchdog),
            next_id: 0,
            pending: HashMap::new(),
            timed: Vec::new(),
            waits: Vec::new(),
            open_wait: None,
            scaled_cast,
            mem,
            wire_bf16: None,
            half,
            arrivals,
            label: None,
            timeout,
            a2a_scratch: None,
            world_rank,
        })
    }

    /// This rank's communicator of its group of `size` consecutive ranks (`Comm::split_groups`):
    /// `ncclCommSplit` where the library has it (and `VITSCALE_NCCL_NO_SPLIT` is unset), else
    /// `ncclCommInitRank` with a unique id the group's first rank makes and hands the others
    /// over the group's host ring. The group gets its own host ring, stream and watchdog.
    fn group(&mut self, size: usize) -> CResult<NcclComm> {
        let (l, me) = (self.lib, self.world_rank);
        // every rank of the world opens its group's host ring first: that is collective over
        // the world ring, so it also lines the ranks up before NCCL's own bootstrap
        let mut host = self.host.group_ring(size)?;
        let (color, key) = (self.rank / size, self.rank % size);
        self.ctx.bind_to_thread().map_err(cu(me, "binding the CUDA context"))?;
        let use_split = l.comm_split.filter(|_| std::env::var_os(ENV_NO_SPLIT).is_none_or(|v| v.is_empty() || v == "0"));
        let comm = match use_split {
            Some(split) => {
                let mut comm: RawComm = std::ptr::null_mut();
                // SAFETY: every rank of the world communicator calls this once, in the same
                // order with respect to its other collectives; a null config inherits the
                // parent's.
                let r = unsafe { split(self.comm.0, color as c_int, key as c_int, &mut comm, std::ptr::null_mut()) };
                if r != NCCL_SUCCESS || comm.is_null() {
                    return Err(CommError::Device { rank: me, msg: format!("ncclCommSplit into groups of {size} (group {color}, rank {key}): {}", nccl_text(l, r)) });
                }
                comm
            }
            None => {
                let mut id = ncclUniqueId { internal: [0; 128] };
                if key == 0 {
                    // SAFETY: fills the 128-byte id.
                    let r = unsafe { (l.get_unique_id)(&mut id) };
                    if r != NCCL_SUCCESS {
                        return Err(CommError::Device { rank: me, msg: format!("ncclGetUniqueId for group {color}: {}", nccl_text(l, r)) });
                    }
                }
                // the group's first rank holds the id, every other rank zeros: the sum is the id
                let mut bytes: Vec<f64> = id.internal.iter().map(|&c| f64::from(c as u8)).collect();
                Comm::<Vec<f32>>::all_reduce_host(&mut host, &mut bytes)?;
                for (d, s) in id.internal.iter_mut().zip(&bytes) {
                    *d = *s as u8 as c_char;
                }
                init_rank(l, me, id, size, key)?
            }
        };
        let parts = Parts { ctx: self.ctx.clone(), compute: self.compute.clone(), scaled_cast: self.scaled_cast.clone(), mem: self.mem.clone(), timeout: self.timeout, half: self.half };
        Self::assemble(l, comm, me, key, size, host, parts)
    }

    fn check_failed(&self) -> CResult<()> {
        match self.shared.failed.lock().map(|f| f.clone()) {
            Ok(None) => Ok(()),
            Ok(Some(cause)) => Err(CommError::Poisoned { rank: self.world_rank, cause }),
            Err(_) => Err(CommError::Poisoned { rank: self.world_rank, cause: "the NCCL watchdog panicked".into() }),
        }
    }

    /// dst[..n] = src[..n] × s on the communication stream (device addresses, types by code:
    /// 0 f32, 1 the backend's 16-bit format, as `CudaBuf::dt`; 2 bf16 in either case).
    fn scaled_cast_on_stream(&self, dst: u64, dtd: i32, src: u64, dts: i32, n: usize, s: f32) -> CResult<()> {
        let (f, cap) = &self.scaled_cast;
        let grid = (n.div_ceil(THREADS as usize).max(1) as u32).min(*cap);
        let n = n as i64;
        let mut args = kargs![dst, dtd, src, dts, n, s];
        // SAFETY: the kernel's signature is (void*, int, const void*, int, i64, float); both
        // addresses lie inside live buffers for n elements of their types (checked by the caller).
        unsafe { cudarc::driver::result::launch_kernel(f.cu_function(), (grid, 1, 1), (THREADS, 1, 1), 0, self.stream.cu_stream(), &mut args) }
            .map_err(cu(self.world_rank, "scaling a gradient bucket"))
    }

    fn event(&self, timing: bool) -> CResult<CudaEvent> {
        let flags = if timing { CUevent_flags::CU_EVENT_DEFAULT } else { CUevent_flags::CU_EVENT_DISABLE_TIMING };
        self.ctx.new_event(Some(flags)).map_err(cu(self.world_rank, "creating an event"))
    }
}

/// Who is to blame for stalled collective `seq`, from what rank 0 knows of every rank (the
/// last collective it entered, milliseconds since it was last heard from): the ranks that
/// never entered it; else the ranks whose process went silent (stopped or hung: a stopped
/// process keeps its enqueued collectives, but NCCL's network progress needs its host
/// threads); else the ranks furthest behind.
fn blame(seq: u64, ranks: Option<Vec<(u64, u64)>>) -> String {
    let Some(ranks) = ranks else { return "rank 0 could not be asked which ranks entered it".into() };
    let names = |rs: &[usize]| if rs.len() == 1 { format!("rank {}", rs[0]) } else { format!("ranks {rs:?}") };
    let missing: Vec<usize> = (0..ranks.len()).filter(|&r| ranks[r].0 < seq).collect();
    if !missing.is_empty() {
        return format!("{} never entered it", names(&missing));
    }
    let silent: Vec<usize> = (0..ranks.len()).filter(|&r| ranks[r].1 > SILENT_MS).collect();
    if !silent.is_empty() {
        let secs = silent.iter().map(|&r| ranks[r].1).min().unwrap_or(0) as f64 / 1e3;
        return format!("every rank entered it; {} went silent {secs:.0} s ago: that process is stopped or hung", names(&silent));
    }
    let (lo, hi) = (ranks.iter().map(|r| r.0).min().unwrap_or(0), ranks.iter().map(|r| r.0).max().unwrap_or(0));
    if lo == hi {
        return format!("every rank entered it and is alive, none issued another (last #{hi}): the network stalled inside it");
    }
    let behind: Vec<usize> = (0..ranks.len()).filter(|&r| ranks[r].0 == lo).collect();
    format!("every rank entered it; {} issued nothing after #{lo} while others reached #{hi}", names(&behind))
}

/// A rank not heard from for this long (its watchdog reports every second) is silent.
const SILENT_MS: u64 = 3000;

/// The watchdog: every 50 ms, retire completed collectives, abort one outstanding past the
/// timeout (naming the ranks that never entered it), and catch NCCL's asynchronous errors.
fn watch(l: &'static Lib, rank: usize, shared: &Shared, comm: &Handle, ctx: &Arc<CudaContext>, timeout: Duration, arrivals: &Arrivals) {
    let _ = ctx.bind_to_thread();
    let mut told = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(50));
        if told.elapsed() > Duration::from_secs(1) {
            arrivals.alive();
            told = Instant::now();
        }
        let mut stalled = None;
        let mut overdue = None;
        if let Ok(mut list) = shared.in_flight.lock() {
            // SAFETY: querying an event that the list keeps alive.
            list.retain(|f| unsafe { cudarc::driver::sys::cuEventQuery(f.done.cu_event()) } == CUresult::CUDA_ERROR_NOT_READY);
            overdue = list.iter().find(|f| f.since.elapsed() > timeout).map(|f| (f.id, f.what.clone()));
        }
        if let Some((id, what)) = overdue {
            let last = arrivals.last_entered(id, Duration::from_secs(5));
            stalled = Some(format!("rank {rank}: {what} (collective #{id}) did not complete within {timeout:.0?}: {}; NCCL was aborted", blame(id, last)));
        }
        let mut async_err: c_int = NCCL_SUCCESS;
        // SAFETY: the communicator is alive until the watchdog has stopped.
        unsafe { (l.async_error)(comm.0, &mut async_err) };
        if stalled.is_none() && async_err != NCCL_SUCCESS && async_err != NCCL_IN_PROGRESS {
            stalled = Some(format!("rank {rank}: NCCL reported an asynchronous error: {} (a peer rank exited or its connection broke); NCCL was aborted", nccl_text(l, async_err)));
        }
        if let Some(msg) = stalled {
            eprintln!("error: {msg}");
            if let Ok(mut f) = shared.failed.lock() {
                f.get_or_insert(msg);
            }
            // SAFETY: aborting from another thread is what ncclCommAbort is for; it makes the
            // outstanding kernels return, so the host's next synchronization does not hang.
            unsafe { (l.comm_abort)(comm.0) };
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::blame;

    #[test]
    fn the_stall_names_the_ranks_that_never_entered_or_fell_behind() {
        assert_eq!(blame(7, Some(vec![(9, 0), (6, 0), (8, 0)])), "rank 1 never entered it");
        assert_eq!(blame(7, Some(vec![(9, 0), (6, 9000), (5, 0)])), "ranks [1, 2] never entered it");
        assert!(blame(7, Some(vec![(9, 0), (9, 12000)])).contains("rank 1 went silent 12 s ago"));
        assert!(blame(7, Some(vec![(9, 0), (7, 100), (9, 0)])).contains("rank 1 issued nothing after #7 while others reached #9"));
        assert!(blame(7, Some(vec![(7, 0), (7, 0)])).contains("none issued another"));
        assert!(blame(7, None).contains("could not be asked"));
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        let failed = self.shared.failed.lock().map(|f| f.is_some()).unwrap_or(true);
        if !failed {
            let _ = self.stream.synchronize();
            // SAFETY: no collective is outstanding (the stream is idle) and the watchdog ended.
            unsafe { (self.lib.comm_destroy)(self.comm.0) };
        }
    }
}

/// The NCCL element type of `buf` on a backend whose 16-bit format is `half`.
fn nccl_type(buf: &CudaBuf, half: HalfFormat) -> c_int {
    match (buf.is_half(), half) {
        (true, HalfFormat::Bf16) => NCCL_BFLOAT16,
        (true, HalfFormat::F16) => NCCL_FLOAT16,
        (false, _) => NCCL_FLOAT32,
    }
}

/// A detached collective (`Comm::detach`): ordering makes the compute stream wait for its end.
struct StreamFence {
    compute: Arc<CudaStream>,
    done: Arc<CudaEvent>,
    rank: usize,
}

impl crate::core::Fence for StreamFence {
    fn order(&self) -> Result<(), String> {
        self.compute.wait(&self.done).map_err(|e| format!("rank {}: ordering the compute stream after a collective: {e}", self.rank))
    }
}

impl Comm<CudaBuf> for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn describe(&self) -> String {
        format!("NCCL {}, rank {} of {}", version().unwrap_or_default(), self.rank, self.world)
    }

    fn start(&mut self, op: Collective, buf: &mut CudaBuf, span: Span) -> CResult<Work> {
        self.start_as(op, buf, span, Wire::PLAIN)
    }

    fn start_as(&mut self, op: Collective, buf: &mut CudaBuf, span: Span, wire: Wire) -> CResult<Work> {
        self.check_failed()?;
        check_args(op, span, buf.len, self.world)?;
        // `rank` places the shards; errors name the rank in the job
        let (rank, me) = (self.rank, self.world_rank);
        // a reduce-scatter's result is the rank's own shard: only that comes back from the wire
        let own = match op {
            Collective::ReduceScatter(_) => {
                let n = span.len / self.world;
                (rank * n, n)
            }
            _ => (0, span.len),
        };
        if !wire.is_plain() && !(matches!(op, Collective::AllReduce(_) | Collective::ReduceScatter(_)) && buf.ty == Ty::F32) {
            return Err(CommError::Unsupported { what: format!("{} of a {} buffer with {wire:?} on NCCL", op.name(), if buf.is_half() { self.half.name() } else { "f32" }) });
        }
        if wire.bf16 && self.wire_bf16.as_ref().is_none_or(|b| b.len < buf.len) {
            // allocated (and zeroed) on the communication stream, before any kernel uses it
            self.wire_bf16 = None;
            let b = Cuda::raw_alloc_with(&self.ctx, &self.stream, &self.mem, buf.len, Ty::Half).map_err(|e| CommError::Device { rank: me, msg: format!("allocating the bf16 gradient wire: {e}") })?;
            self.wire_bf16 = Some(b);
        }
        if op == Collective::AllToAll && self.a2a_scratch.as_ref().is_none_or(|b| b.bytes() < span.len * buf.ty.size()) {
            self.a2a_scratch = None;
            let b = Cuda::raw_alloc_with(&self.ctx, &self.stream, &self.mem, span.len, buf.ty).map_err(|e| CommError::Device { rank: me, msg: format!("allocating the all-to-all's copy: {e}") })?;
            self.a2a_scratch = Some(b);
        }
        // the collective may read the span once the compute stream has written it
        let ready = self.event(false)?;
        ready.record(&self.compute).map_err(cu(me, "recording the gradients' event"))?;
        self.stream.wait(&ready).map_err(cu(me, "ordering the communication stream"))?;
        let start = Arc::new(self.event(true)?);
        start.record(&self.stream).map_err(cu(me, "recording a collective's start"))?;
        let (l, c, s) = (self.lib, self.comm.0, self.stream.cu_stream());
        let (mut ty, mut elem, mut base) = (nccl_type(buf, self.half), buf.bytes() / buf.len.max(1), buf.at(span.off) as *mut c_void);
        let grads = buf.at(span.off);
        if wire.bf16 {
            let w = self.wire_bf16.as_ref().map(|b| b.at(span.off)).unwrap_or_default();
            self.scaled_cast_on_stream(w, DT_BF16, grads, 0, span.len, wire.pre)?;
            (ty, elem, base) = (NCCL_BFLOAT16, 2, w as *mut c_void);
        } else if wire.pre != 1.0 {
            self.scaled_cast_on_stream(grads, 0, grads, 0, span.len, wire.pre)?;
        }
        let red = |o: ReduceOp| if o == ReduceOp::Avg { NCCL_AVG } else { NCCL_SUM };
        // SAFETY: every pointer is inside `buf` (span checked above); in-place forms as nccl.h
        // documents them (reduce-scatter's output is its own shard of the input, all-gather's
        // input its own shard of the output).
        let r = unsafe {
            match op {
                Collective::AllReduce(o) => (l.all_reduce)(base, base, span.len, ty, red(o), c, s),
                Collective::ReduceScatter(o) => {
                    let n = span.len / self.world;
                    (l.reduce_scatter)(base, base.byte_add(rank * n * elem), n, ty, red(o), c, s)
                }
                Collective::AllGather => {
                    let n = span.len / self.world;
                    (l.all_gather)(base.byte_add(rank * n * elem), base, n, ty, c, s)
                }
                Collective::Broadcast { root } => (l.broadcast)(base, base, span.len, ty, root as c_int, c, s),
                Collective::AllToAll => {
                    // block j goes to rank j and block j comes from rank j: the blocks leave
                    // from a copy of the span, so a block received never overwrites one still
                    // to be sent; the own block stays where it is
                    let n = span.len / self.world;
                    let copy = self.a2a_scratch.as_ref().map(|b| b.ptr()).unwrap_or_default();
                    cudarc::driver::result::memcpy_dtod_async(copy, base as u64, span.len * elem, s).map_err(cu(me, "copying the all-to-all's input"))?;
                    let copy = copy as *const c_void;
                    let mut r = (l.group_start)();
                    for j in (0..self.world).filter(|&j| j != rank) {
                        if r != NCCL_SUCCESS {
                            break;
                        }
                        r = (l.send)(copy.byte_add(j * n * elem), n, ty, j as c_int, c, s);
                        if r == NCCL_SUCCESS {
                            r = (l.recv)(base.byte_add(j * n * elem), n, ty, j as c_int, c, s);
                        }
                    }
                    // the group is closed whatever failed inside it
                    let end = (l.group_end)();
                    if r == NCCL_SUCCESS {
                        end
                    } else {
                        r
                    }
                }
            }
        };
        if r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS {
            return Err(CommError::Device { rank: me, msg: format!("nccl {} of elements {}..{}: {}", op.name(), span.off, span.off + span.len, nccl_text(l, r)) });
        }
        let (own_f32, own_wire) = (grads + (own.0 * 4) as u64, base as u64 + (own.0 * elem) as u64);
        if wire.bf16 {
            self.scaled_cast_on_stream(own_f32, 0, own_wire, DT_BF16, own.1, wire.post)?;
        } else if wire.post != 1.0 {
            self.scaled_cast_on_stream(own_f32, 0, own_f32, 0, own.1, wire.post)?;
        }
        let done = Arc::new(self.event(true)?);
        done.record(&self.stream).map_err(cu(me, "recording a collective's end"))?;
        self.next_id += 1;
        let id = self.next_id;
        self.arrivals.arrive(id);
        let what = format!("{} of elements {}..{} ({} values)", op.name(), span.off, span.off + span.len, span.len);
        let what = match self.label.take() {
            Some(l) => format!("{l}: {what}"),
            None => what,
        };
        if let Ok(mut list) = self.shared.in_flight.lock() {
            list.push(InFlight { id, done: done.clone(), since: Instant::now(), what });
        }
        self.pending.insert(id, (start, done, format!("{} {}..{}", op.name(), span.off, span.off + span.len)));
        Ok(Work { id, op, span })
    }

    fn label_next(&mut self, label: &str) {
        self.label = Some(label.to_string());
    }

    fn wait(&mut self, work: Work, _buf: &mut CudaBuf) -> CResult<()> {
        self.check_failed()?;
        let (start, done, what) = self.pending.remove(&work.id).ok_or(CommError::UnknownWork { id: work.id })?;
        // the compute stream goes on once the collective is done; the host does not wait
        self.compute.wait(&done).map_err(cu(self.world_rank, "ordering the compute stream"))?;
        self.timed.push((start, done, what));
        Ok(())
    }

    fn can_detach(&self) -> bool {
        true
    }

    fn detach(&mut self, work: Work) -> CResult<Box<dyn crate::core::Fence>> {
        self.check_failed()?;
        let (start, done, what) = self.pending.remove(&work.id).ok_or(CommError::UnknownWork { id: work.id })?;
        self.timed.push((start, done.clone(), what));
        Ok(Box::new(StreamFence { compute: self.compute.clone(), done, rank: self.world_rank }))
    }

    fn begin_waits(&mut self) -> CResult<()> {
        let e = self.event(true)?;
        e.record(&self.compute).map_err(cu(self.world_rank, "recording the backward's end"))?;
        self.open_wait = Some(e);
        Ok(())
    }

    fn end_waits(&mut self) -> CResult<()> {
        if let Some(begin) = self.open_wait.take() {
            let e = self.event(true)?;
            e.record(&self.compute).map_err(cu(self.world_rank, "recording the waits' end"))?;
            self.waits.push((begin, e));
        }
        Ok(())
    }

    fn take_device_timing(&mut self, epoch: Instant) -> CResult<Option<DeviceTiming>> {
        self.check_failed()?;
        let rank = self.world_rank;
        let ms = |a: &CudaEvent, b: &CudaEvent| -> CResult<f64> {
            b.synchronize().map_err(cu(rank, "waiting for a timing event"))?;
            Ok(a.elapsed_ms(b).map_err(cu(rank, "reading a timing event"))? as f64 * 1e-3)
        };
        let mut t = DeviceTiming::default();
        for (a, b) in std::mem::take(&mut self.waits) {
            t.exposed_s += ms(&a, &b)?;
        }
        // a probe after the last collective, reached as soon as the stream is idle: the host's
        // clock when it is seen reached places every event before it
        let probe = self.event(true)?;
        probe.record(&self.stream).map_err(cu(rank, "recording the timing probe"))?;
        probe.synchronize().map_err(cu(rank, "waiting for the timing probe"))?;
        let now = epoch.elapsed().as_secs_f64();
        for (a, b, what) in std::mem::take(&mut self.timed) {
            let secs = ms(&a, &b)?;
            t.total_s += secs;
            let end = now - ms(&b, &probe)?;
            t.spans.push((what, end - secs, end));
        }
        Ok(Some(t))
    }

    fn barrier(&mut self) -> CResult<()> {
        self.check_failed()?;
        self.compute.synchronize().map_err(cu(self.world_rank, "synchronizing before a barrier"))?;
        Comm::<Vec<f32>>::barrier(&mut self.host)
    }

    fn all_reduce_host(&mut self, vals: &mut [f64]) -> CResult<()> {
        self.check_failed()?;
        Comm::<Vec<f32>>::all_reduce_host(&mut self.host, vals)
    }

    fn split_groups(&mut self, size: usize) -> CResult<Box<dyn Comm<CudaBuf>>> {
        check_group(size, self.world)?;
        self.check_failed()?;
        if size == 1 {
            return Ok(Box::new(SingleComm::new()));
        }
        Ok(Box::new(self.group(size)?))
    }
}
