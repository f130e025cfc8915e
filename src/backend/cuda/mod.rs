//! The CUDA backend: the `Backend` trait on one NVIDIA GPU.
//!
//! - Libraries are found at run time (`libs`): the binary builds and runs without CUDA.
//! - Compute dtype is bf16 (`alloc`); master weights, gradients, optimizer state and losses
//!   are f32 (`alloc_f32`). A buffer carries its dtype, and kernels that touch parameters,
//!   statistics or losses accept either, so the model may choose.
//! - GEMMs go through cuBLASLt (`gemm`): bf16 operands, fp32 accumulation, bias in the
//!   epilogue; weight gradients accumulate into the f32 gradient buffer with beta = 1 (`+=`).
//! - Every other op is a CUDA C kernel in `kernels/*.cu`, compiled by NVRTC for the device's
//!   architecture and cached on disk (`compile`).
//! - All work goes to one non-blocking stream, so a training step can be captured into a
//!   CUDA graph (`begin_capture` / `end_capture`); nothing on the op paths synchronizes except
//!   `download`, `upload` and `sum_squares`, which must.
//!
//! Attention has two paths, chosen at run time (`VITSCALE_ATTENTION=fused|fused-pipe|gemm`,
//! default fused; `set_attention`):
//! - gemm: materializes `probs` (B, H, N, N): per-head layout copies, strided-batched cuBLASLt
//!   GEMMs for q·kᵀ and p·v, and a row-softmax kernel.
//! - fused (`kernels/flash.cu`, head dims 32 and 64): flash-attention-2 style tensor-core
//!   kernels that read q, k, v from the interleaved qkv layout, keep only the per-row
//!   log-sum-exp (B·H·N f32) in `probs`, and recompute the probabilities in the backward.
//!   Other head dims take the gemm path. For N ≤ 80 (CIFAR's 65 tokens) forward and backward
//!   hold a whole head in one small block of ≤ 5 warps, several blocks per SM; for N ≤ 256 the
//!   backward keeps a whole head in one 8-warp block (no dQ atomics); `fused-pipe` uses the
//!   tiled forward and the key-block backward for every N (to compare; it is what N > 256
//!   gets anyway).
//! - On Hopper (`kernels/hopper.cu`, compiled for sm_90a on sm_90 devices only) the MLP's first
//!   layer is one persistent wgmma/TMA kernel with the erf GELU in its epilogue (cuBLASLt's GELU
//!   epilogue is the tanh approximation), and the second layer's input gradient another with the
//!   GELU backward and the first layer's bias sums in its epilogue; `FUSED_GEMM_ENV` chooses.
//! - Batch inputs (`upload_input`) are converted into pinned staging memory and copied on a
//!   second stream; the compute stream waits on an event, the host does not wait.
//! - Bias and LayerNorm-parameter gradients arrive as f32 partial rows from the passes that see
//!   the gradient's rows; `partials` queues their column sums during a backward and adds them
//!   up in batched launches.
//! - The optimizer kernels clip by the global norm (its square summed on the device just
//!   before) and write the bf16 compute copy of the weights as they update them.

mod compile;
mod gemm;
pub mod libs;
mod partials;
pub mod telemetry;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr, CUstream};
use cudarc::driver::{result as dr, CudaContext, CudaStream};
use rayon::prelude::*;

use self::gemm::{alignment, Gemm, GemmShape, Ty};
use super::{BResult, Backend, BackendError, DecayGroups, GeluSaved, Span, StepHyper};
use crate::core::OptimizerConfig;
use crate::core::LN_EPS;

/// What the probe found about a GPU.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_mem: usize,
    pub multiprocessors: u32,
    pub device_count: usize,
    /// `domain:bus:device.function` (hex), how NVML names the same GPU (`telemetry`).
    pub pci_bus_id: String,
}

impl DeviceInfo {
    /// NVRTC target, e.g. "sm_90".
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

fn dev<E: std::fmt::Display>(op: &str) -> impl FnOnce(E) -> BackendError + '_ {
    move |e| BackendError::Device(format!("{op}: {e}"))
}

fn probe_inner(index: usize) -> Result<DeviceInfo, String> {
    libs::ensure_loaded()?;
    let count = CudaContext::device_count().map_err(|e| format!("CUDA driver: {e}"))? as usize;
    if count == 0 {
        return Err("the CUDA driver reports no GPU".into());
    }
    if index >= count {
        return Err(format!("GPU index {index} out of range: {count} GPU(s) present"));
    }
    let ctx = CudaContext::new(index).map_err(|e| format!("creating a context on GPU {index}: {e}"))?;
    let name = ctx.name().map_err(|e| e.to_string())?;
    let cc = ctx.compute_capability().map_err(|e| e.to_string())?;
    let total_mem = ctx.total_mem().map_err(|e| e.to_string())?;
    let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(|e| e.to_string())?;
    let pci = |a| ctx.attribute(a).map_err(|e| e.to_string());
    let pci_bus_id = format!(
        "{:x}:{:x}:{:x}.0",
        pci(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
        pci(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
        pci(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
    );
    Ok(DeviceInfo { index, name, compute_capability: cc, total_mem, multiprocessors: sms as u32, device_count: count, pci_bus_id })
}

/// Whether GPU `index` is usable: loads the libraries and opens a context. Never panics
/// (cudarc's loader panics on a missing library; that is caught and reported by name).
pub fn probe(index: usize) -> Result<DeviceInfo, String> {
    match std::panic::catch_unwind(|| probe_inner(index)) {
        Ok(r) => r,
        Err(p) => Err(p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "CUDA initialization panicked".into())),
    }
}

/// `probe(0)`: the check behind `--device auto`.
pub fn cuda_available() -> Result<DeviceInfo, String> {
    probe(0)
}

/// One launch of a profiled step (`Cuda::take_profile_timeline`).
#[derive(Clone, Debug)]
pub struct ProfiledLaunch {
    pub name: String,
    pub ms: f64,
    /// From the end of the previous profiled launch to the start of this one.
    pub gap_before_ms: f64,
}

/// A profiled step's launches summed by name: (name, total ms, launches), largest first.
pub fn profile_by_name(timeline: &[ProfiledLaunch]) -> Vec<(String, f64, usize)> {
    let mut sum: HashMap<&str, (f64, usize)> = HashMap::new();
    for l in timeline {
        let e = sum.entry(&l.name).or_insert((0.0, 0));
        e.0 += l.ms;
        e.1 += 1;
    }
    let mut v: Vec<(String, f64, usize)> = sum.into_iter().map(|(k, (t, n))| (k.to_string(), t, n)).collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

/// Live and peak bytes of device memory this backend allocated.
#[derive(Default, Debug)]
pub struct MemStats {
    pub live: AtomicUsize,
    pub peak: AtomicUsize,
}

/// A device buffer: raw allocation, element count and dtype. Freed on drop.
pub struct CudaBuf {
    ptr: CUdeviceptr,
    len: usize,
    ty: Ty,
    ctx: Arc<CudaContext>,
    mem: Arc<MemStats>,
}

// SAFETY: a device address is plain data; the allocation is only freed by Drop.
unsafe impl Send for CudaBuf {}
unsafe impl Sync for CudaBuf {}

impl CudaBuf {
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    pub fn is_bf16(&self) -> bool {
        self.ty == Ty::Bf16
    }
    fn bytes(&self) -> usize {
        self.len * self.ty.size()
    }
    fn dt(&self) -> i32 {
        match self.ty {
            Ty::F32 => 0,
            Ty::Bf16 => 1,
        }
    }
    /// Address of element `off`.
    fn at(&self, off: usize) -> CUdeviceptr {
        self.ptr + (off * self.ty.size()) as u64
    }
}

impl Drop for CudaBuf {
    fn drop(&mut self) {
        if self.ptr != 0 {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: `ptr` came from cuMemAlloc in `Cuda::raw_alloc` and is freed once. The
            // driver waits for work using it when freeing (cuMemFree synchronizes).
            let _ = unsafe { dr::free_sync(self.ptr) };
            self.mem.live.fetch_sub(self.bytes(), Ordering::Relaxed);
        }
    }
}

/// Kernel arguments: pointers to each value, which must live until the launch returns
/// (temporaries in the launching statement do).
macro_rules! kargs {
    ($($a:expr),* $(,)?) => { [$( &$a as *const _ as *mut c_void ),*] };
}

/// A captured CUDA graph, ready to replay on the backend's stream.
pub struct Graph {
    exec: cudarc::driver::sys::CUgraphExec,
    graph: cudarc::driver::sys::CUgraph,
    stream: CUstream,
    ctx: Arc<CudaContext>,
}

impl Graph {
    pub fn launch(&self) -> BResult<()> {
        // SAFETY: exec was instantiated from a graph captured on this stream.
        unsafe { dr::graph::launch(self.exec, self.stream) }.map_err(dev("cuGraphLaunch"))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: created in end_capture, destroyed once.
        unsafe {
            let _ = dr::graph::exec_destroy(self.exec);
            let _ = dr::graph::destroy(self.graph);
        }
    }
}

/// Pinned host memory a batch input is converted into before its copy (`upload_input`), and
/// the event recorded on the copy stream once that copy is done (the buffer may be reused
/// after it).
struct Staging {
    host: *mut c_void,
    bytes: usize,
    done: cudarc::driver::sys::CUevent,
    in_flight: bool,
}

// SAFETY: the pinned pointer and the event are plain handles, used under the staging lock.
unsafe impl Send for Staging {}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: the event was created in `Cuda::new`; the host memory (if any) by
        // cuMemHostAlloc in `upload_input`; both are released once. Waiting on the event first
        // keeps an in-flight copy from reading freed memory.
        unsafe {
            if self.in_flight {
                let _ = cudarc::driver::result::event::synchronize(self.done);
            }
            if !self.host.is_null() {
                let _ = dr::free_host(self.host);
            }
            let _ = cudarc::driver::result::event::destroy(self.done);
        }
    }
}

/// Scratch buffers the attention ops reuse between calls, grown on demand.
#[derive(Default)]
struct Scratch {
    slots: HashMap<&'static str, CudaBuf>,
}

pub struct Cuda {
    // Fields drop in declaration order: the staging buffers (pinned memory, events) and the
    // copy stream go while the context is certainly alive.
    /// Two pinned staging buffers used in turn, so converting batch k + 1 never waits for
    /// the copy of batch k.
    staging: Mutex<[Staging; 2]>,
    next_staging: AtomicUsize,
    /// Stream for batch-input copies (`upload_input`), so they overlap the compute stream.
    copy_stream: Arc<CudaStream>,
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: compile::Kernels,
    gemm: Gemm,
    _workspace: CudaBuf,
    mem: Arc<MemStats>,
    scratch: Mutex<Scratch>,
    /// Bias and LayerNorm-parameter gradient reductions waiting for one launch (`partials`).
    partial_sums: Mutex<partials::PendingSums>,
    /// Uploaded optimizer segments (start, end, decays) for the last decay grouping seen.
    segments: Mutex<Option<(Vec<i64>, CudaBuf)>>,
    /// One f64 accumulator for `sum_squares`.
    acc: CudaBuf,
    /// When set, every kernel and GEMM is bracketed by events (see `set_profiling`).
    profile: Mutex<Option<Vec<(String, cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>>>,
    /// Attention path (`AttentionPath as u8`).
    attention: AtomicU8,
    /// Whether the Hopper GEMM kernels are used where they apply (`set_fused_gemm`): fc1's
    /// forward, fc2's input gradient.
    fused_gemm: std::sync::atomic::AtomicBool,
    fused_gemm_bwd: std::sync::atomic::AtomicBool,
    /// Whether the wgmma attention kernels are used where they apply (`set_wgmma_attention`).
    wgmma_attention: std::sync::atomic::AtomicBool,
    /// Where the Hopper GEMM kernels take 128×256 tiles (`WideTiles as u8`, `set_wide_gemm`):
    /// fc1's forward, fc2's input gradient.
    wide_gemm: AtomicU8,
    wide_gemm_bwd: AtomicU8,
}

/// Environment variable that picks the attention path: `fused` (default), `fused-pipe` or `gemm`.
pub const ATTENTION_ENV: &str = "VITSCALE_ATTENTION";

/// How the CUDA backend computes attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    /// Materialized probabilities through cuBLASLt batched GEMMs and a softmax kernel.
    Gemm = 0,
    /// Fused tensor-core kernels (the default): for N ≤ 80 small whole-head blocks both ways;
    /// else the pipelined forward, and for N ≤ 256 the backward that keeps a whole head in one
    /// block (the key-block backward beyond).
    Fused = 1,
    /// As `Fused` with the key-block backward (dQ through f32 atomics) for every N.
    FusedPipe = 2,
}

impl AttentionPath {
    pub const ALL: [AttentionPath; 3] = [AttentionPath::Gemm, AttentionPath::Fused, AttentionPath::FusedPipe];
    pub fn name(self) -> &'static str {
        match self {
            AttentionPath::Gemm => "gemm",
            AttentionPath::Fused => "fused",
            AttentionPath::FusedPipe => "fused-pipe",
        }
    }
    fn from_u8(v: u8) -> AttentionPath {
        match v {
            1 => AttentionPath::Fused,
            2 => AttentionPath::FusedPipe,
            _ => AttentionPath::Gemm,
        }
    }
}

/// Parses an attention path name (`gemm`, `fused`, `fused-pipe`; empty = the default, fused).
pub fn parse_attention(v: &str) -> Result<AttentionPath, String> {
    match v {
        "" => Ok(AttentionPath::Fused),
        other => AttentionPath::ALL
            .into_iter()
            .find(|p| p.name() == other)
            .ok_or_else(|| format!("attention path must be gemm, fused or fused-pipe, got {other:?}")),
    }
}

/// Environment variable choosing the Hopper GEMM kernels (`kernels/hopper.cu`, sm_90 only):
/// unset (or anything else) — fc1's forward with its GELU and fc2's input gradient with the
/// GELU backward and fc1's bias sums (each ≈ 1 % off a CIFAR ViT-S step against cuBLASLt and
/// the separate pass; the second ≈ 0.4 % at ViT-B/16; BENCHMARKS.md); `fwd` — the forward
/// kernel only; `0` or `off` — cuBLASLt and the separate passes everywhere.
pub const FUSED_GEMM_ENV: &str = "VITSCALE_FUSED_GEMM";

/// Environment variable turning the wgmma attention kernels (`flash_{fwd,bwd}_wg_d64` in
/// hopper.cu: ViT-B/16's 197 tokens on sm_90) off (`0` or `off`); the mma.sync kernels of
/// flash.cu run instead.
pub const WGMMA_ATTENTION_ENV: &str = "VITSCALE_WGMMA_ATTENTION";

/// Environment variable choosing where the Hopper GEMM kernels take 128×256 tiles (the `_w`
/// kernels, where the output width is a multiple of 256): unset (or anything else) — fc1's
/// forward and fc2's input gradient where the tile count favours them (`WideTiles::Auto`;
/// ViT-B/16 micro 256 ≈ 1.5 % faster per step than with 128×128 tiles, CIFAR ViT-S ≈ 0.5 %;
/// BENCHMARKS.md); `fwd` — the forward only; `always` — wherever the width allows; `0` or
/// `off` — 128×128 tiles everywhere.
pub const WIDE_GEMM_ENV: &str = "VITSCALE_WIDE_GEMM";

/// Where the Hopper GEMM kernels take 128×256 tiles (the width must be a multiple of 256).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WideTiles {
    /// 128×128 tiles.
    Off = 0,
    /// Where fewer waves of wide tiles are expected to finish first (`hopper_gemm_shape`).
    Auto = 1,
    /// Wherever the width allows (the selftest).
    Always = 2,
}

impl WideTiles {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => WideTiles::Off,
            2 => WideTiles::Always,
            _ => WideTiles::Auto,
        }
    }
}

/// (fc1 forward, fc2 input gradient) from WIDE_GEMM_ENV.
fn wide_tiles_from_env() -> (WideTiles, WideTiles) {
    match std::env::var(WIDE_GEMM_ENV).as_deref().map(str::trim) {
        Ok("0") | Ok("off") => (WideTiles::Off, WideTiles::Off),
        Ok("fwd") => (WideTiles::Auto, WideTiles::Off),
        Ok("always") => (WideTiles::Always, WideTiles::Always),
        _ => (WideTiles::Auto, WideTiles::Auto),
    }
}

/// Dynamic shared memory of the Hopper GEMM kernels (HW_SMEM in hopper.cu: a 4-stage ring of two
/// 128×64 bf16 tiles, two 128×136 bf16 staging tiles, 2 × 8 × 128 f32 column sums, 12 barriers,
/// 1 KiB of alignment slack).
const HOPPER_GEMM_SMEM: u32 = 4 * 32768 + 2 * 128 * 136 * 2 + 2 * 8 * 128 * 4 + 96 + 1024;
/// The same for the 128×256-tile kernels (HX_SMEM: a 3-stage ring of a 128×64 and a 256×64
/// tile, the rest as above).
const HOPPER_GEMM_SMEM_WIDE: u32 = 3 * 49152 + 2 * 128 * 136 * 2 + 2 * 8 * 128 * 4 + 96 + 1024;

/// Opt-in shared memory per block on sm_90 (227 KiB).
const SHORT_BWD_SMEM_MAX: usize = 227 * 1024;

/// Widest `layernorm_bwd_s{J}` (C = 32·J ≤ 768): three accumulator rows per warp must fit
/// in 48 KiB of static shared memory.
const LN_SUM_MAX_J: usize = 24;

/// Head dims the fused attention kernels are compiled for.
const FUSED_HEAD_DIMS: [usize; 2] = [32, 64];

const THREADS: u32 = 256;
/// Parameters per block of the optimizer kernels (8 rounds of their 4-element loads).
const OPT_CHUNK: usize = 8 * 4 * THREADS as usize;

impl Cuda {
    /// Opens GPU `index`: loads libraries, creates the context and stream, compiles (or loads
    /// from the cache) every kernel, creates the cuBLASLt handle and workspace.
    pub fn new(index: usize) -> BResult<Cuda> {
        let info = probe(index).map_err(BackendError::Device)?;
        let ctx = CudaContext::new(index).map_err(dev("cuCtxCreate"))?;
        // One stream and raw allocations: cudarc's per-slice event tracking is not needed.
        // SAFETY: no CudaSlice of this context is shared across streams.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(dev("cuStreamCreate"))?;
        let copy_stream = ctx.new_stream().map_err(dev("cuStreamCreate"))?;
        let new_staging = || -> BResult<Staging> {
            let done = cudarc::driver::result::event::create(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(dev("cuEventCreate"))?;
            Ok(Staging { host: std::ptr::null_mut(), bytes: 0, done, in_flight: false })
        };
        let staging = Mutex::new([new_staging()?, new_staging()?]);
        let kernels = compile::Kernels::load(&ctx, &info.arch())?;
        let mem = Arc::new(MemStats::default());
        let ws_size = 32usize << 20;
        let workspace = Self::raw_alloc_with(&ctx, &stream, &mem, ws_size, Ty::Bf16)?;
        // the tuner's choices beside the compiled kernels, keyed by card (name and multiprocessors)
        let card = format!("{} ({} SMs)", info.name, info.multiprocessors);
        let gemm = Gemm::new(workspace.ptr, ws_size, &card, compile::cache_dir().map(|d| d.join("gemm-choices.tsv")))?;
        let acc = Self::raw_alloc_with(&ctx, &stream, &mem, 2, Ty::F32)?;
        let attention = match std::env::var(ATTENTION_ENV) {
            Ok(v) => parse_attention(v.trim()).map_err(|e| BackendError::Device(format!("{ATTENTION_ENV}: {e}")))?,
            // Fused by default: parity and a 1.24× step at ViT-B/16 micro 256 (BENCHMARKS.md).
            Err(_) => AttentionPath::Fused,
        };
        let (wide_fwd, wide_bwd) = wide_tiles_from_env();
        Ok(Cuda {
            info,
            ctx,
            stream,
            kernels,
            gemm,
            _workspace: workspace,
            mem,
            scratch: Mutex::new(Scratch::default()),
            partial_sums: Mutex::new(partials::PendingSums::default()),
            segments: Mutex::new(None),
            acc,
            profile: Mutex::new(None),
            attention: AtomicU8::new(attention as u8),
            fused_gemm: std::sync::atomic::AtomicBool::new(!matches!(std::env::var(FUSED_GEMM_ENV).as_deref().map(str::trim), Ok("0") | Ok("off"))),
            fused_gemm_bwd: std::sync::atomic::AtomicBool::new(!matches!(std::env::var(FUSED_GEMM_ENV).as_deref().map(str::trim), Ok("0") | Ok("off") | Ok("fwd"))),
            wgmma_attention: std::sync::atomic::AtomicBool::new(!matches!(std::env::var(WGMMA_ATTENTION_ENV).as_deref().map(str::trim), Ok("0") | Ok("off"))),
            wide_gemm: AtomicU8::new(wide_fwd as u8),
            wide_gemm_bwd: AtomicU8::new(wide_bwd as u8),
            copy_stream,
            staging,
            next_staging: AtomicUsize::new(0),
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
    /// Seconds NVRTC spent compiling at start-up (0 when the disk cache had everything).
    pub fn compile_seconds(&self) -> f64 {
        self.kernels.compile_s
    }
    /// Peak bytes of device memory held by this backend's buffers (workspace included).
    pub fn peak_bytes(&self) -> usize {
        self.mem.peak.load(Ordering::Relaxed)
    }
    pub fn reset_peak(&self) {
        self.mem.peak.store(self.mem.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    /// (free, total) bytes on the device as the driver reports them.
    pub fn mem_info(&self) -> BResult<(usize, usize)> {
        self.ctx.mem_get_info().map_err(dev("cuMemGetInfo"))
    }

    /// Whether the Hopper GEMM kernel (`kernels/hopper.cu`) takes a (rows × ic)·(oc × ic)ᵀ
    /// product: chosen (`set_fused_gemm`), compiled (sm_90), oc % 128 == 0,
    /// ic % 64 == 0, 16-byte aligned operands (`ptrs`) and bias (0 = none).
    fn fused_gemm_ok(&self, rows: usize, ic: usize, oc: usize, ptrs: &[CUdeviceptr], bias: CUdeviceptr) -> bool {
        self.fused_gemm.load(Ordering::Relaxed)
            && rows > 0
            && oc % 128 == 0
            && ic % 64 == 0
            && ic > 0
            && rows.div_ceil(128) * (oc / 128) <= i32::MAX as usize
            && ptrs.iter().all(|&p| p % 16 == 0)
            && bias % 16 == 0
            && self.kernels.get("gemm_gelu_fwd_ws").is_ok()
    }

    /// Whether the Hopper GEMM kernel was compiled (an sm_90 device).
    pub fn has_fused_gemm(&self) -> bool {
        self.kernels.get("gemm_gelu_fwd_ws").is_ok()
    }

    /// Whether the Hopper GEMM kernels are chosen (`set_fused_gemm`): (fc1 forward, fc2 input
    /// gradient).
    pub fn fused_gemm(&self) -> (bool, bool) {
        (self.fused_gemm.load(Ordering::Relaxed), self.fused_gemm_bwd.load(Ordering::Relaxed))
    }

    /// Uses the Hopper GEMM kernels where they apply — fc1's forward (`fwd`; the default), fc2's
    /// input gradient (`bwd`) — or cuBLASLt plus the separate GELU passes (FUSED_GEMM_ENV).
    pub fn set_fused_gemm(&self, fwd: bool, bwd: bool) {
        self.fused_gemm.store(fwd, Ordering::Relaxed);
        self.fused_gemm_bwd.store(bwd, Ordering::Relaxed);
    }

    /// Where the Hopper GEMM kernels take 128×256 tiles (`set_wide_gemm`): (fc1 forward, fc2
    /// input gradient).
    pub fn wide_gemm(&self) -> (WideTiles, WideTiles) {
        (WideTiles::from_u8(self.wide_gemm.load(Ordering::Relaxed)), WideTiles::from_u8(self.wide_gemm_bwd.load(Ordering::Relaxed)))
    }

    /// Where the Hopper GEMM kernels take 128×256 tiles: in fc1's forward (`fwd`) and fc2's
    /// input gradient (`bwd`); `WideTiles::Auto` for both by default (WIDE_GEMM_ENV).
    pub fn set_wide_gemm(&self, fwd: WideTiles, bwd: WideTiles) {
        self.wide_gemm.store(fwd as u8, Ordering::Relaxed);
        self.wide_gemm_bwd.store(bwd as u8, Ordering::Relaxed);
    }

    /// Launch shape of a Hopper GEMM kernel for `rows` × `n` outputs: the kernel name (`base`,
    /// with `_w` for 128×256 tiles), its grid (one block per SM at most: the kernels are
    /// persistent), block size, dynamic shared memory and tile width.
    fn hopper_gemm_shape(&self, base: &'static str, rows: usize, n: usize, bwd: bool) -> (String, u32, u32, u32, usize) {
        let mode = WideTiles::from_u8(if bwd { &self.wide_gemm_bwd } else { &self.wide_gemm }.load(Ordering::Relaxed));
        // Each block walks its tiles in turn, so a kernel lasts about ceil(tiles / SMs) tiles;
        // a 128×256 tile took ≈ 0.9 of two 128×128 ones (H200, ViT-B/16 micro 256 profiles:
        // 5.02–5.47 against 5.62–6.13 ms for the forward's twelve). At micro 16 (25 row tiles)
        // the wide forward has 2.3 waves of tiles against 4.5: the last wave's idle blocks cost
        // more than the wide tiles save.
        let waves = |bn: usize| (rows.div_ceil(128) * (n / bn)).div_ceil(self.info.multiprocessors.max(1) as usize);
        let wide = n % 256 == 0
            && match mode {
                WideTiles::Off => false,
                WideTiles::Always => true,
                WideTiles::Auto => 18 * waves(256) < 10 * waves(128),
            };
        let (name, threads, smem, bn) = if wide {
            // (the input gradient's wide kernel has one epilogue warpgroup, the forward's two)
            (format!("{base}_w"), if bwd { 512 } else { 640 }, HOPPER_GEMM_SMEM_WIDE, 256)
        } else {
            (base.to_string(), 544, HOPPER_GEMM_SMEM, 128)
        };
        let grid = (self.info.multiprocessors as usize).min(rows.div_ceil(128) * (n / bn)).max(1) as u32;
        (name, grid, threads, smem, bn)
    }

    /// Chooses the attention path for later calls. Buffers sized by `attention_saved_len`
    /// under the gemm path are large enough for the fused paths, not the other way round.
    pub fn set_attention(&self, path: AttentionPath) {
        self.attention.store(path as u8, Ordering::Relaxed);
    }

    /// The chosen attention path (head dims the fused kernels lack still take the gemm path).
    pub fn attention_path(&self) -> AttentionPath {
        AttentionPath::from_u8(self.attention.load(Ordering::Relaxed))
    }

    /// Kernel-name suffix of the fused attention for head dim `d` and the dynamic shared
    /// memory (bytes) of its (forward, backward) kernels; None = the GEMM path.
    fn fused_attention(&self, d: usize) -> Option<(String, u32, u32)> {
        if !FUSED_HEAD_DIMS.contains(&d) {
            return None;
        }
        // Mirrors fa_fwd_pipe_smem / fa_bwd_pipe_smem in flash.cu (64-row tiles, rows padded by 8).
        let ld = (d + 8) * 2;
        let (fwd, bwd) = ((64 + 4 * 64) * ld, (2 * 64 + 4 * 64) * ld + 64 * (64 + 8) * 2 + 4 * 64 * 4);
        match self.attention_path() {
            AttentionPath::Gemm => None,
            AttentionPath::Fused | AttentionPath::FusedPipe => Some((format!("d{d}_pipe"), fwd as u32, bwd as u32)),
        }
    }

    /// Warps per block W and the dynamic shared memory (bytes) of the small-head kernels
    /// `flash_{fwd,bwd}_small_d{d}_w{W}` (the whole head in one block, N ≤ 16·W), when they
    /// apply: path `fused`, a fused head dim, N ≤ 80. Mirrors fa_small_{fwd,bwd}_smem in flash.cu.
    fn small_attention(&self, n: usize, d: usize) -> Option<(usize, u32, u32)> {
        if self.attention_path() != AttentionPath::Fused || !FUSED_HEAD_DIMS.contains(&d) || n > 80 {
            return None;
        }
        let w = if n <= 64 { 4 } else { 5 };
        let (np, ld) = (16 * w, (d + 8) * 2);
        Some((w, (3 * np * ld) as u32, (5 * np * ld + np * (np + 8) * 2 + 2 * np * 4) as u32))
    }

    /// Warps per block W and the dynamic shared memory (bytes) of the whole-head backward
    /// `flash_bwd_small_d{d}_w{W}`: the small heads' (N ≤ 80), and W = 13 at D = 64 for
    /// 192 < N ≤ 208 (224 px / 16), where O is not staged in shared memory (the block would need
    /// 235 KiB). Mirrors fa_small_bwd_smem in flash.cu.
    fn small_backward(&self, n: usize, d: usize) -> Option<(usize, u32)> {
        if let Some((w, _, smem)) = self.small_attention(n, d) {
            return Some((w, smem));
        }
        if !self.head_of_197(n, d) {
            return None;
        }
        let (w, np, ld) = (13, 208, (d + 8) * 2);
        Some((w, (4 * np * ld + np * (np + 8) * 2 + 2 * np * 4) as u32))
    }

    /// Dynamic shared memory of the wgmma attention forward `flash_fwd_wg_d64` (hopper.cu, sm_90
    /// only: a head per block, 64 queries at a time against every key in one accumulator), when it applies:
    /// path `fused`, D = 64, 193 ≤ N ≤ 208. Mirrors FW_SMEM.
    fn wgmma_attention_forward(&self, n: usize, d: usize) -> Option<u32> {
        self.wgmma_attention_applies(n, d).then_some((2 * 64 * 128 + 2 * 208 * 128 + 16 + 1024) as u32)
    }

    /// Dynamic shared memory of the wgmma attention backward `flash_bwd_wg_d64` (hopper.cu: a
    /// whole head per block of four warpgroups), when it applies (as the forward). Mirrors
    /// FB_SMEM.
    fn wgmma_attention_backward(&self, n: usize, d: usize) -> Option<u32> {
        self.wgmma_attention_applies(n, d).then_some((2 * 208 * 128 + 2 * 224 * 128 + 4 * 208 * 128 + 2 * 224 * 4 + 16 + 1024) as u32)
    }

    fn wgmma_attention_applies(&self, n: usize, d: usize) -> bool {
        self.head_of_197(n, d) && self.wgmma_attention() && self.has_wgmma_attention()
    }

    /// Path `fused`, D = 64 and 193 ≤ N ≤ 208 (224 px / 16: 197 tokens; 13 rows of 16): where
    /// the whole-head kernels for ViT-B/16's heads apply (wgmma, or the 13-warp backward).
    fn head_of_197(&self, n: usize, d: usize) -> bool {
        self.attention_path() == AttentionPath::Fused && d == 64 && (193..=208).contains(&n)
    }

    /// Whether the wgmma attention kernels are compiled (sm_90).
    pub fn has_wgmma_attention(&self) -> bool {
        self.kernels.get("flash_fwd_wg_d64").is_ok() && self.kernels.get("flash_bwd_wg_d64").is_ok()
    }

    /// Whether the wgmma attention kernels are chosen where they apply (WGMMA_ATTENTION_ENV).
    pub fn wgmma_attention(&self) -> bool {
        self.wgmma_attention.load(Ordering::Relaxed)
    }

    /// Chooses the wgmma attention kernels (where compiled and the shape fits) or flash.cu's.
    pub fn set_wgmma_attention(&self, on: bool) {
        self.wgmma_attention.store(on, Ordering::Relaxed);
    }

    /// Dynamic shared memory of `flash_bwd_short_d{d}` for sequence length `n`, when the
    /// short-sequence backward applies (path `fused`, N ≤ 256, fits the block's shared memory).
    /// Mirrors fa_short_smem in flash.cu.
    fn short_backward_smem(&self, n: usize, d: usize) -> Option<u32> {
        if self.attention_path() != AttentionPath::Fused || n > 256 {
            return None;
        }
        let nqp = n.div_ceil(64) * 64;
        let ld = d + 8;
        let bytes = 2 * nqp * ld * 2 + 2 * nqp * 4 + nqp * ld * 4 + 2 * 128 * ld * 2 + 128 * (64 + 8) * 2;
        (bytes <= SHORT_BWD_SMEM_MAX).then_some(bytes as u32)
    }

    /// `launch` for a kernel using `smem` bytes of dynamic shared memory, raising the kernel's
    /// limit above the default 48 KiB first (a function attribute, not a stream operation, so
    /// it is allowed during graph capture).
    fn launch_dyn(&self, name: &str, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, args: &mut [*mut c_void]) -> BResult<()> {
        if smem > 48 * 1024 {
            let f = self.kernels.get(name)?;
            f.set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .map_err(|e| BackendError::Device(format!("{name}: raising dynamic shared memory to {smem} bytes: {e}")))?;
        }
        self.launch(name, grid, block, smem, args)
    }

    /// Turns per-launch timing on or off (benchmark diagnostics; never while capturing).
    pub fn set_profiling(&self, on: bool) {
        if let Ok(mut p) = self.profile.lock() {
            *p = if on { Some(Vec::new()) } else { None };
        }
    }

    /// Per-launch times recorded since `set_profiling(true)`, summed by name:
    /// (name, total ms, launches), largest first. Synchronizes.
    pub fn take_profile(&self) -> BResult<Vec<(String, f64, usize)>> {
        Ok(profile_by_name(&self.take_profile_timeline()?))
    }

    /// The launches recorded since `set_profiling(true)` in queue order, each with its time and
    /// the time since the previous launch ended (what the GPU spent between the two: memsets,
    /// copies, or the launch itself). Synchronizes.
    pub fn take_profile_timeline(&self) -> BResult<Vec<ProfiledLaunch>> {
        self.synchronize()?;
        let recs = match self.profile.lock() {
            Ok(mut p) => p.as_mut().map(std::mem::take).unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        let mut out = Vec::with_capacity(recs.len());
        let mut prev_end: Option<&cudarc::driver::CudaEvent> = None;
        for (name, e0, e1) in &recs {
            let ms = e0.elapsed_ms(e1).map_err(dev("cuEventElapsedTime"))? as f64;
            let gap_before_ms = match prev_end {
                Some(p) => p.elapsed_ms(e0).map_err(dev("cuEventElapsedTime"))? as f64,
                None => 0.0,
            };
            out.push(ProfiledLaunch { name: name.clone(), ms, gap_before_ms });
            prev_end = Some(e1);
        }
        Ok(out)
    }

    /// Runs `f` between two timing events when profiling is on.
    fn timed(&self, name: &str, f: impl FnOnce() -> BResult<()>) -> BResult<()> {
        let on = self.profile.lock().map(|p| p.is_some()).unwrap_or(false);
        if !on {
            return f();
        }
        let ev = || self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(dev("cuEventCreate"));
        let (e0, e1) = (ev()?, ev()?);
        e0.record(&self.stream).map_err(dev("cuEventRecord"))?;
        f()?;
        e1.record(&self.stream).map_err(dev("cuEventRecord"))?;
        if let Ok(mut p) = self.profile.lock() {
            if let Some(v) = p.as_mut() {
                v.push((name.to_string(), e0, e1));
            }
        }
        Ok(())
    }

    /// Starts capturing every op queued on the backend's stream into a graph.
    pub fn begin_capture(&self) -> BResult<()> {
        self.ctx.bind_to_thread().map_err(dev("begin_capture"))?;
        // SAFETY: the stream is ours and not already capturing.
        unsafe { dr::stream::begin_capture(self.stream.cu_stream(), cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
            .map_err(dev("cuStreamBeginCapture"))
    }

    /// Ends the capture begun by `begin_capture` and instantiates the graph.
    pub fn end_capture(&self) -> BResult<Graph> {
        // SAFETY: the stream is capturing (begin_capture succeeded).
        let graph = unsafe { dr::stream::end_capture(self.stream.cu_stream()) }.map_err(dev("cuStreamEndCapture"))?;
        // SAFETY: graph was just captured.
        let exec = unsafe { dr::graph::instantiate(graph, cudarc::driver::sys::CUgraphInstantiate_flags(0)) }.map_err(dev("cuGraphInstantiate"))?;
        Ok(Graph { exec, graph, stream: self.stream.cu_stream(), ctx: self.ctx.clone() })
    }

    /// Fills `buf` with deterministic pseudo-random values in [-scale, scale).
    pub fn fill_random(&self, buf: &mut CudaBuf, seed: u32, scale: f32) -> BResult<()> {
        let n = buf.len as i64;
        self.launch1("fill_random_kernel", buf.len, &mut kargs![buf.ptr, buf.dt(), n, seed, scale])
    }

    /// Measures the bf16 GEMM ceiling: median TFLOP/s of `reps` n×n×n products on random data.
    pub fn matmul_tflops(&self, n: usize, reps: usize) -> BResult<f64> {
        let mut a = self.alloc(n * n)?;
        let mut b = self.alloc(n * n)?;
        let d = self.alloc(n * n)?;
        self.fill_random(&mut a, 1, 1.0)?;
        self.fill_random(&mut b, 2, 1.0)?;
        let s = GemmShape {
            ta: true, tb: false, m: n as u64, n: n as u64, k: n as u64,
            a_ty: Ty::Bf16, b_ty: Ty::Bf16, d_ty: Ty::Bf16,
            lda: n as i64, ldb: n as i64, ldd: n as i64,
            batch: 1, stride_a: 0, stride_b: 0, stride_d: 0,
            bias: false, accumulate: false, align: 0,
        };
        let ev = |op: &str| self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(|e| BackendError::Device(format!("{op}: {e}")));
        // The first call tunes the algorithm (16 candidates × 8 runs of 8192³ back to back).
        // Measured right after that the ceiling once read 700 instead of the usual 794–819
        // TFLOP/s (overstating MFU); after a pause it read 798 and 819. So pause first.
        self.gemm("matmul_tflops", s, a.ptr, b.ptr, d.ptr, 0, 1.0, 0.0)?;
        self.synchronize()?;
        std::thread::sleep(std::time::Duration::from_millis(500));
        for _ in 0..3 {
            self.gemm("matmul_tflops", s, a.ptr, b.ptr, d.ptr, 0, 1.0, 0.0)?;
        }
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps {
            let (e0, e1) = (ev("event")?, ev("event")?);
            e0.record(&self.stream).map_err(dev("cuEventRecord"))?;
            self.gemm("matmul_tflops", s, a.ptr, b.ptr, d.ptr, 0, 1.0, 0.0)?;
            e1.record(&self.stream).map_err(dev("cuEventRecord"))?;
            e1.synchronize().map_err(dev("cuEventSynchronize"))?;
            times.push(e0.elapsed_ms(&e1).map_err(dev("cuEventElapsedTime"))? as f64);
        }
        times.sort_by(|x, y| x.total_cmp(y));
        let ms = times[times.len() / 2];
        Ok(2.0 * (n as f64).powi(3) / (ms * 1e-3) / 1e12)
    }

    fn raw_alloc_with(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, mem: &Arc<MemStats>, len: usize, ty: Ty) -> BResult<CudaBuf> {
        ctx.bind_to_thread().map_err(dev("alloc"))?;
        let bytes = (len * ty.size()).max(1);
        // SAFETY: plain device allocation, zeroed on our stream before any use.
        let ptr = unsafe { dr::malloc_sync(bytes) }.map_err(|e| BackendError::Device(format!("allocating {bytes} bytes on the GPU: {e}")))?;
        // SAFETY: ptr points to `bytes` bytes just allocated.
        unsafe { dr::memset_d8_async(ptr, 0, bytes, stream.cu_stream()) }.map_err(dev("cuMemsetD8Async"))?;
        let live = mem.live.fetch_add(len * ty.size(), Ordering::Relaxed) + len * ty.size();
        mem.peak.fetch_max(live, Ordering::Relaxed);
        Ok(CudaBuf { ptr, len, ty, ctx: ctx.clone(), mem: mem.clone() })
    }

    fn raw_alloc(&self, len: usize, ty: Ty) -> BResult<CudaBuf> {
        Self::raw_alloc_with(&self.ctx, &self.stream, &self.mem, len, ty)
    }

    /// Address of a scratch buffer of at least `len` bf16 elements (contents undefined).
    fn scratch(&self, name: &'static str, len: usize) -> BResult<CUdeviceptr> {
        let mut s = self.scratch.lock().map_err(|_| BackendError::Device("scratch lock poisoned".into()))?;
        if s.slots.get(name).is_none_or(|b| b.len < len) {
            // The old buffer may still be read by queued kernels: drain the stream first.
            if s.slots.contains_key(name) {
                self.synchronize()?;
            }
            s.slots.remove(name);
            let b = self.raw_alloc(len, Ty::Bf16)?;
            s.slots.insert(name, b);
        }
        Ok(s.slots[name].ptr)
    }

    fn grid(&self, n: usize) -> u32 {
        let blocks = n.div_ceil(THREADS as usize).max(1);
        blocks.min(self.info.multiprocessors as usize * 16) as u32
    }

    fn launch(&self, name: &str, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, args: &mut [*mut c_void]) -> BResult<()> {
        let f = self.kernels.get(name)?;
        self.timed(name, || {
            // SAFETY: every launch site passes arguments whose types and order match the
            // kernel's signature in kernels/*.cu, device pointers to live buffers whose lengths
            // the caller checked against the shapes, and values that outlive this call.
            unsafe { dr::launch_kernel(f.cu_function(), grid, block, smem, self.stream.cu_stream(), args) }
                .map_err(|e| BackendError::Device(format!("launching {name}: {e}")))
        })
    }

    /// dst[j] += Σ_rows src[row, j] over a row-major (rows, cols) bf16 buffer: a bias gradient.
    fn add_column_sums(&self, dst: CUdeviceptr, src: &CudaBuf, rows: usize, cols: usize) -> BResult<()> {
        let splits = (rows.div_ceil(64)).clamp(1, 256) as u32;
        let (r, o) = (rows as i64, cols as i32);
        let partial = self.partial_rows(splits as usize * cols)?;
        if cols % 8 == 0 && src.ptr % 16 == 0 && src.ty == Ty::Bf16 {
            self.launch("bias_grad_v8", (cols.div_ceil(256) as u32, splits, 1), (32, 8, 1), 0, &mut kargs![partial, src.ptr, r, o])?;
        } else {
            self.launch("bias_grad_kernel", (cols.div_ceil(32) as u32, splits, 1), (32, 8, 1), 0, &mut kargs![partial, src.ptr, src.dt(), r, o])?;
        }
        self.reduce_partials(dst, dst, dst, cols, partial, splits as usize, cols)
    }

    /// `layernorm_backward`: with `dinp_sum`, the fast kernels for C ≤ 768 sum dinp's columns
    /// in the same pass; elsewhere a separate column sum over dinp follows.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward_impl(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, dresidual: Option<&CudaBuf>, inp: &CudaBuf, mean: &CudaBuf, rstd: &CudaBuf, params: &CudaBuf, w: Span, b: Span, rows: usize, c: usize, dinp_sum: Option<Span>) -> BResult<()> {
        const OP: &str = "layernorm_backward";
        let sum_after = |this: &Self, dinp: &CudaBuf| -> BResult<()> {
            match dinp_sum {
                Some(s) => this.add_column_sums(dparams.at(s.off), dinp, rows, c),
                None => Ok(()),
            }
        };
        check_len(OP, "dinp", dinp, rows * c)?;
        check_len(OP, "dout", dout, rows * c)?;
        check_len(OP, "inp", inp, rows * c)?;
        check_len(OP, "mean", mean, rows)?;
        check_f32(OP, "dparams", dparams)?;
        check_span(OP, "weight", params, w)?;
        check_span(OP, "dweight", dparams, w)?;
        check_span(OP, "dbias", dparams, b)?;
        let (dres, dtr) = match dresidual {
            Some(d) => {
                check_len(OP, "dresidual", d, rows * c)?;
                (d.ptr, d.dt())
            }
            None => (0u64, 0i32),
        };
        let dres_bf16 = dresidual.is_none_or(|d| d.ty == Ty::Bf16);
        if let (Some(j), true) = (ln_fast_j(c, &[&*dinp, dout, inp, params], &[mean, rstd]), dres_bf16) {
            if ln_vec_ok(j, &[dinp.ptr, dout.ptr, inp.ptr, dres]) {
                // 4 warps per block, one row per warp at a time; 4 blocks per SM fit (128 registers).
                let grid = (rows.div_ceil(4 * 8) as u32).min(self.info.multiprocessors * 4).max(1);
                let (wo, bo, r) = (w.off as i64, b.off as i64, rows as i64);
                // with dinp_sum (C ≤ 768): dinp's column sums as a third partial row
                let (kernel, na, dsum) = match dinp_sum {
                    Some(s) if j <= LN_SUM_MAX_J => ("s", 3, Some(dparams.at(s.off))),
                    _ => ("v", 2, None),
                };
                let partial = self.partial_rows(grid as usize * na * c)?;
                self.launch(&format!("layernorm_bwd_{kernel}{j}"), (grid, 1, 1), (128, 1, 1), 0, &mut kargs![dinp.ptr, partial, dout.ptr, dres, inp.ptr, mean.ptr, rstd.ptr, params.ptr, wo, bo, r])?;
                let (dw, db) = (dparams.at(w.off), dparams.at(b.off));
                self.reduce_partials(dw, db, dsum.unwrap_or(db), c, partial, grid as usize, na * c)?;
                return if dsum.is_some() { Ok(()) } else { sum_after(self, dinp) };
            }
            let grid = (rows.div_ceil(8) as u32).min(self.info.multiprocessors * 4).max(1);
            let (wo, bo, r) = (w.off as i64, b.off as i64, rows as i64);
            let partial = self.partial_rows(grid as usize * 2 * c)?;
            self.launch(&format!("layernorm_bwd_c{j}"), (grid, 1, 1), (THREADS, 1, 1), 0, &mut kargs![dinp.ptr, partial, dout.ptr, dres, inp.ptr, mean.ptr, rstd.ptr, params.ptr, wo, bo, r])?;
            let (dw, db) = (dparams.at(w.off), dparams.at(b.off));
            self.reduce_partials(dw, db, db, c, partial, grid as usize, 2 * c)?;
            return sum_after(self, dinp);
        }
        // Warps per block so that each warp's two C-wide accumulator rows fit in 48 KiB.
        let warps = (48 * 1024 / (2 * c * 4)).clamp(1, 8) as u32;
        if 2 * c * 4 > 48 * 1024 {
            return Err(BackendError::Shape { op: OP, msg: format!("width {c} exceeds the 6144 this kernel supports") });
        }
        let grid = (rows.div_ceil(warps as usize * 8) as u32).min(self.info.multiprocessors * 4).max(1);
        let smem = warps * (2 * c * 4) as u32;
        let (wo, bo, r, cc) = (w.off as i64, b.off as i64, rows as i64, c as i32);
        self.launch("layernorm_bwd_kernel", (grid, 1, 1), (32 * warps, 1, 1), smem, &mut kargs![dinp.ptr, dinp.dt(), dparams.ptr, dout.ptr, dout.dt(), dres, dtr, inp.ptr, inp.dt(), mean.ptr, rstd.ptr, mean.dt(), params.ptr, params.dt(), wo, bo, r, cc])?;
        sum_after(self, dinp)
    }

    /// `attention_backward`, plus the qkv bias gradient into `dbias` (an f32 device address of
    /// 3·H·D values) when given: summed inside the small-head kernel, else a column sum of dqkv.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_impl(&self, dqkv: &mut CudaBuf, dbias: Option<CUdeviceptr>, dout: &CudaBuf, qkv: &CudaBuf, out: &CudaBuf, probs: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        let summed = self.attention_backward_kernels(dqkv, dbias, dout, qkv, out, probs, b, n, h, d)?;
        match dbias {
            Some(db) if !summed => self.add_column_sums(db, dqkv, b * n, 3 * h * d),
            _ => Ok(()),
        }
    }

    /// The attention backward's kernels. The small-head kernel also sums the qkv bias gradient
    /// into `dbias` when given; the return value says whether it did.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_kernels(&self, dqkv: &mut CudaBuf, dbias: Option<CUdeviceptr>, dout: &CudaBuf, qkv: &CudaBuf, out: &CudaBuf, probs: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<bool> {
        const OP: &str = "attention_backward";
        check_bf16(OP, "dqkv", dqkv)?;
        check_bf16(OP, "dout", dout)?;
        check_bf16(OP, "qkv", qkv)?;
        check_bf16(OP, "probs", probs)?;
        let bhnd = b * h * n * d;
        check_len(OP, "dqkv", dqkv, 3 * bhnd)?;
        check_len(OP, "dout", dout, bhnd)?;
        check_len(OP, "qkv", qkv, 3 * bhnd)?;
        check_len(OP, "probs", probs, self.attention_saved_len(b, n, h, d))?;
        if let Some((sfx, _, smem)) = self.fused_attention(d) {
            check_bf16(OP, "out", out)?;
            check_len(OP, "out", out, bhnd)?;
            if n == 0 || b * h == 0 {
                return Ok(true);
            }
            check_grid(OP, b * h)?;
            let scale = 1.0 / (d as f32).sqrt();
            let scale_log2 = std::f32::consts::LOG2_E * scale;
            // The whole-head kernels (wgmma, or flash.cu's small ones) sum the qkv bias gradient.
            // The wgmma one copies through tensor maps: 16-byte aligned bases.
            let tma_ok = [dqkv.ptr, dout.ptr, qkv.ptr, out.ptr].iter().all(|p| p % 16 == 0);
            let wgmma = self.wgmma_attention_backward(n, d).filter(|_| tma_ok);
            let small = if wgmma.is_none() { self.small_backward(n, d) } else { None };
            if wgmma.is_some() || small.is_some() {
                let (nn, hh, c) = (n as i32, h as i32, h * d);
                // with a bias: per-image [Σ dQ | Σ dV] rows (f32, 2·H·D each), reduced below
                let part = match dbias {
                    Some(_) => self.partial_rows(b * 2 * c)?,
                    None => 0,
                };
                if let Some(smem) = wgmma {
                    let tm_kv = tensor_map_3d(qkv.ptr, 3 * c, n, b, 208)?;
                    let tm_q = tensor_map_3d(qkv.ptr, 3 * c, n, b, 224)?;
                    let tm_do = tensor_map_3d(dout.ptr, c, n, b, 224)?;
                    let tm_o = tensor_map_3d(out.ptr, c, n, b, 224)?;
                    let tm_dqkv = tensor_map_3d(dqkv.ptr, 3 * c, n, b, 64)?;
                    self.launch_dyn("flash_bwd_wg_d64", ((b * h) as u32, 1, 1), (512, 1, 1), smem, &mut kargs![tm_kv, tm_q, tm_do, tm_o, tm_dqkv, probs.ptr, nn, hh, scale, scale_log2, part])?;
                } else if let Some((w, smem)) = small {
                    let name = format!("flash_bwd_small_d{d}_w{w}");
                    self.launch_dyn(&name, ((b * h) as u32, 1, 1), (32 * w as u32, 1, 1), smem, &mut kargs![dqkv.ptr, out.ptr, dout.ptr, qkv.ptr, probs.ptr, nn, hh, scale, scale_log2, part])?;
                }
                if let Some(db) = dbias {
                    // q bias += Σ dQ, v bias += Σ dV; the k bias's gradient is zero
                    let dv = db + (2 * c * 4) as u64;
                    self.reduce_partials(db, dv, dv, c, part, b, 2 * c)?;
                }
                return Ok(true);
            }
            if let Some(smem) = self.short_backward_smem(n, d) {
                // One block per (b, h): delta, dQ accumulation and the dQ store happen inside.
                let (nn, hh) = (n as i32, h as i32);
                return self.launch_dyn(&format!("flash_bwd_short_d{d}"), ((b * h) as u32, 1, 1), (256, 1, 1), smem, &mut kargs![dqkv.ptr, out.ptr, dout.ptr, qkv.ptr, probs.ptr, nn, hh, scale, scale_log2]).map(|_| false);
            }
            // f32 scratch: dQ accumulator (B, N, H·D) and delta (B·H, N), in bf16-sized slots.
            let dq_acc = self.scratch("flash_dq_acc", 2 * bhnd)?;
            let delta = self.scratch("flash_delta", 2 * b * h * n)?;
            // SAFETY: dq_acc holds 2·bhnd bf16 slots = bhnd f32 values.
            unsafe { dr::memset_d8_async(dq_acc, 0, bhnd * 4, self.stream.cu_stream()) }.map_err(dev("cuMemsetD8Async"))?;
            let (bb, nn, hh) = (b as i32, n as i32, h as i32);
            let rows = b * n * h;
            let grid = rows.div_ceil(THREADS as usize).clamp(1, self.info.multiprocessors as usize * 16) as u32;
            self.launch(&format!("flash_bwd_pre_d{d}"), (grid, 1, 1), (THREADS, 1, 1), 0, &mut kargs![delta, dout.ptr, out.ptr, bb, nn, hh])?;
            let g = (n.div_ceil(64) as u32, (b * h) as u32, 1);
            self.launch_dyn(&format!("flash_bwd_{sfx}"), g, (128, 1, 1), smem, &mut kargs![dqkv.ptr, dq_acc, dout.ptr, qkv.ptr, probs.ptr, delta, nn, hh, scale, scale_log2])?;
            let (brows, hd8) = ((b * n) as i64, (h * d / 8) as i32);
            return self.launch1("flash_dq_store", bhnd / 8, &mut kargs![dqkv.ptr, dq_acc, brows, hd8]).map(|_| false);
        }
        let heads = self.scratch("qkv_heads", 3 * bhnd)?;
        let dheads = self.scratch("dqkv_heads", 3 * bhnd)?;
        let doh = self.scratch("o_heads", bhnd)?;
        let ld = n.div_ceil(8) * 8;
        let dp = self.scratch("dprobs", b * h * n * ld)?;
        let pp = self.scratch("scores", b * h * n * ld)?;
        let nn = n as i32;
        let ldi = ld as i32;
        self.move_heads(true, heads, qkv.ptr, b, n, 3, h, d)?;
        self.move_heads(true, doh, dout.ptr, b, n, 1, h, d)?;
        let rows = (b * h * n) as i64;
        self.launch1("pad_rows", b * h * n * ld, &mut kargs![pp, ldi, probs.ptr, rows, nn])?;
        let off = |base: u64, i: usize| base + (2 * i * bhnd) as u64;
        let (q, k, v) = (off(heads, 0), off(heads, 1), off(heads, 2));
        let (dq, dk, dv) = (off(dheads, 0), off(dheads, 1), off(dheads, 2));
        let nd = (n * d) as i64;
        let nld = (n * ld) as i64;
        let batch = (b * h) as i32;
        let scale = 1.0 / (d as f32).sqrt();
        let base = GemmShape {
            ta: false, tb: false, m: 0, n: 0, k: 0,
            a_ty: Ty::Bf16, b_ty: Ty::Bf16, d_ty: Ty::Bf16,
            lda: 0, ldb: 0, ldd: 0, batch, stride_a: 0, stride_b: 0, stride_d: 0,
            bias: false, accumulate: false, align: 0,
        };
        // dP(N, N) = dO·Vᵀ  (same form as q·kᵀ), rows padded to `ld`.
        let s = GemmShape { ta: true, m: n as u64, n: n as u64, k: d as u64, lda: d as i64, ldb: d as i64, ldd: ld as i64, stride_a: nd, stride_b: nd, stride_d: nld, ..base };
        self.gemm("attention_backward (dO·vᵀ)", s, v, doh, dp, 0, 1.0, 0.0)?;
        // dV(N, D) = Pᵀ·dO  ⇔  dVᵀ(D×N) = dOᵀ(D×N)·P(N×N): P read transposed.
        let s = GemmShape { tb: true, m: d as u64, n: n as u64, k: n as u64, lda: d as i64, ldb: ld as i64, ldd: d as i64, stride_a: nd, stride_b: nld, stride_d: nd, ..base };
        self.gemm("attention_backward (pᵀ·dO)", s, doh, pp, dv, 0, 1.0, 0.0)?;
        let grid = (rows as usize).div_ceil(8).min(self.info.multiprocessors as usize * 16) as u32;
        self.launch("softmax_bwd_pad", (grid, 1, 1), (THREADS, 1, 1), 0, &mut kargs![dp, pp, ldi, rows, nn])?;
        // dQ(N, D) = dS·K/√D  (same form as p·v).
        let s = GemmShape { m: d as u64, n: n as u64, k: n as u64, lda: d as i64, ldb: ld as i64, ldd: d as i64, stride_a: nd, stride_b: nld, stride_d: nd, ..base };
        self.gemm("attention_backward (dS·k)", s, k, dp, dq, 0, scale, 0.0)?;
        // dK(N, D) = dSᵀ·Q/√D  (same form as pᵀ·dO).
        let s = GemmShape { tb: true, m: d as u64, n: n as u64, k: n as u64, lda: d as i64, ldb: ld as i64, ldd: d as i64, stride_a: nd, stride_b: nld, stride_d: nd, ..base };
        self.gemm("attention_backward (dSᵀ·q)", s, q, dp, dk, 0, scale, 0.0)?;
        self.move_heads(false, dqkv.ptr, dheads, b, n, 3, h, d).map(|_| false)
    }

    /// 1-D grid-stride launch over `n` elements.
    fn launch1(&self, name: &str, n: usize, args: &mut [*mut c_void]) -> BResult<()> {
        self.launch(name, (self.grid(n), 1, 1), (THREADS, 1, 1), 0, args)
    }

    /// Moves heads between (B, N, S, H, D) and [S][B][H][N][D] (`to_heads` picks the direction).
    #[allow(clippy::too_many_arguments)]
    fn move_heads(&self, to_heads: bool, dst: CUdeviceptr, src: CUdeviceptr, b: usize, n: usize, s: usize, h: usize, d: usize) -> BResult<()> {
        let total = b * n * s * h * d;
        let (bb, nn, ss, hh) = (b as i32, n as i32, s as i32, h as i32);
        if d % 8 == 0 && dst % 16 == 0 && src % 16 == 0 && total / 8 < u32::MAX as usize {
            let d8 = (d / 8) as i32;
            let name = if to_heads { "tokens_to_heads_v8" } else { "heads_to_tokens_v8" };
            self.launch1(name, total / 8, &mut kargs![dst, src, bb, nn, ss, hh, d8])
        } else {
            let dd = d as i32;
            let name = if to_heads { "tokens_to_heads" } else { "heads_to_tokens" };
            self.launch1(name, total, &mut kargs![dst, src, bb, nn, ss, hh, dd])
        }
    }

    /// `matmul_backward`; `dgelu = Some((saved, pre_bias, what))` applies the GELU gradient to
    /// dinp from what the forward saved (pre, or the derivative itself: `what`) and, with
    /// `pre_bias`, adds dinp's column sums into that span from the same pass.
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward_impl(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, inp: &CudaBuf, dgelu: Option<(&CudaBuf, Option<Span>, GeluSaved)>, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        const OP: &str = "matmul_backward";
        check_bf16(OP, "dinp", dinp)?;
        check_bf16(OP, "params (the compute copy)", params)?;
        check_len(OP, "dinp", dinp, rows * ic)?;
        check_weight_grads(OP, dparams, dout, inp, params, w, rows, ic, oc)?;
        // dinp(R, IC) = dout(R, OC)·W(OC, IC)  ⇔  dinpᵀ(IC×R) = W(IC×OC, ld IC)·doutᵀ(OC×R, ld OC).
        let s = GemmShape {
            ta: false, tb: false, m: ic as u64, n: rows as u64, k: oc as u64,
            a_ty: Ty::Bf16, b_ty: Ty::Bf16, d_ty: Ty::Bf16,
            lda: ic as i64, ldb: oc as i64, ldd: ic as i64,
            batch: 1, stride_a: 0, stride_b: 0, stride_d: 0,
            bias: false, accumulate: false, align: 0,
        };
        if let Some((_, None, GeluSaved::Grad)) = dgelu {
            return Err(BackendError::Shape { op: OP, msg: "a saved GELU derivative needs the pre-activation's bias span".into() });
        }
        let fused = match dgelu {
            Some((pre, Some(pb), _)) if pb.len == ic && pre.len >= rows * ic && self.fused_gemm_bwd.load(Ordering::Relaxed) => self.fused_gemm_ok(rows, oc, ic, &[dinp.ptr, pre.ptr, dout.ptr, params.at(w.off)], params.at(pb.off)),
            _ => false,
        };
        if let (true, Some((pre, Some(pb), what))) = (fused, dgelu) {
            check_bf16(OP, "dgelu saved", pre)?;
            check_span(OP, "pre_bias", dparams, pb)?;
            check_span(OP, "pre_bias", params, pb)?;
            self.dgelu_gemm_fused(dinp, dparams, dout, pre, what, params, w, pb, rows, ic, oc)?;
        } else {
            self.gemm("matmul_backward (dinp)", s, params.at(w.off), dout.ptr, dinp.ptr, 0, 1.0, 0.0)?;
        }
        if let (false, Some((pre, pre_bias, what))) = (fused, dgelu) {
            check_bf16(OP, "dgelu saved", pre)?;
            check_len(OP, "dgelu saved", pre, rows * ic)?;
            let n = rows * ic;
            let saved = (what == GeluSaved::Grad) as i32;
            if let Some(pb) = pre_bias {
                check_span(OP, "pre_bias", dparams, pb)?;
                check_span(OP, "pre_bias", params, pb)?;
                if pb.len != ic {
                    return Err(BackendError::Shape { op: OP, msg: format!("pre_bias span has {} elements, dinp has {ic} columns", pb.len) });
                }
                // the pre-activation is pre + params[pb] (matmul_forward left the bias out)
                let bias_ptr = params.at(pb.off);
                if ic % 8 == 0 && dinp.ptr % 16 == 0 && pre.ptr % 16 == 0 && bias_ptr % 16 == 0 {
                    // GELU gradient and the column partial sums of its bf16 result in one pass.
                    let splits = (rows.div_ceil(64)).clamp(1, 256) as u32;
                    let (r, o) = (rows as i64, ic as i32);
                    let partial = self.partial_rows(splits as usize * ic)?;
                    self.launch("gelu_bwd_bias_v8", (ic.div_ceil(256) as u32, splits, 1), (32, 8, 1), 0, &mut kargs![dinp.ptr, pre.ptr, bias_ptr, partial, r, o, saved])?;
                    let dst = dparams.at(pb.off);
                    self.reduce_partials(dst, dst, dst, ic, partial, splits as usize, ic)?;
                } else {
                    self.matmul_backward_impl_gelu_then_bias(dinp, dparams, pre, saved, bias_ptr, pb, rows, ic)?;
                }
            } else if n % 8 == 0 && dinp.ptr % 16 == 0 && pre.ptr % 16 == 0 {
                let n8 = (n / 8) as i64;
                self.launch1("gelu_bwd_v8", n / 8, &mut kargs![dinp.ptr, pre.ptr, n8])?;
            } else if n % 2 == 0 {
                let n2 = (n / 2) as i64;
                self.launch1("gelu_bwd_bf16", n / 2, &mut kargs![dinp.ptr, pre.ptr, n2])?;
            } else {
                let nn = n as i64;
                self.launch1("gelu_bwd", n, &mut kargs![dinp.ptr, 1i32, pre.ptr, 1i32, nn])?;
            }
        }
        self.weight_grads(dparams, dout, inp, w, bias, rows, ic, oc)
    }

    /// `dW += doutᵀ·inp` and `dbias += Σ_rows dout` (the checks of matmul_backward done).
    #[allow(clippy::too_many_arguments)]
    fn weight_grads(&self, dparams: &mut CudaBuf, dout: &CudaBuf, inp: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        const OP: &str = "matmul_backward";
        // dW(OC, IC) += doutᵀ·inp  ⇔  dWᵀ(IC×OC, ld IC) += inpᵀ(IC×R, ld IC)·dout(R×OC), dout read
        // as column-major OC×R (ld OC) transposed. fp32 output, beta = 1.
        let s = GemmShape {
            ta: false, tb: true, m: ic as u64, n: oc as u64, k: rows as u64,
            a_ty: Ty::Bf16, b_ty: Ty::Bf16, d_ty: Ty::F32,
            lda: ic as i64, ldb: oc as i64, ldd: ic as i64,
            batch: 1, stride_a: 0, stride_b: 0, stride_d: 0,
            bias: false, accumulate: true, align: 0,
        };
        self.gemm("matmul_backward (dW)", s, inp.ptr, dout.ptr, dparams.at(w.off), 0, 1.0, 1.0)?;
        if let Some(bs) = bias {
            check_span(OP, "bias gradient", dparams, bs)?;
            self.add_column_sums(dparams.at(bs.off), dout, rows, oc)?;
        }
        Ok(())
    }


    /// fc2's input gradient through the Hopper kernel: dinp = (dout·W) ⊙ gelu'(pre + bias) (or
    /// ⊙ the saved derivative) and the bias span `pb` of dparams += the column sums of dinp; W
    /// (oc × ic) is read as stored, an MN-major B operand.
    #[allow(clippy::too_many_arguments)]
    fn dgelu_gemm_fused(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, pre: &CudaBuf, what: GeluSaved, params: &CudaBuf, w: Span, pb: Span, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        let row_tiles = rows.div_ceil(128);
        // one f32 partial row per 128-row tile
        let partial = self.partial_rows(row_tiles * ic)?;
        let ta = tensor_map_2d(dout.ptr, oc, rows, 128)?;
        let tb = tensor_map_2d(params.at(w.off), ic, oc, 64)?;
        let (m, n, k) = (rows as i32, ic as i32, oc as i32);
        let base = match what {
            GeluSaved::Pre => "gemm_dgelu_bwd_ws",
            GeluSaved::Grad => "gemm_dgelu_mul_ws",
        };
        let (name, grid, threads, smem, _) = self.hopper_gemm_shape(base, rows, ic, true);
        match what {
            GeluSaved::Pre => {
                let bias_ptr = params.at(pb.off);
                self.launch_dyn(&name, (grid, 1, 1), (threads, 1, 1), smem, &mut kargs![dinp.ptr, pre.ptr, partial, ta, tb, bias_ptr, m, n, k])?;
            }
            // the saved derivative already holds the bias
            GeluSaved::Grad => self.launch_dyn(&name, (grid, 1, 1), (threads, 1, 1), smem, &mut kargs![dinp.ptr, pre.ptr, partial, ta, tb, m, n, k])?,
        }
        let dst = dparams.at(pb.off);
        self.reduce_partials(dst, dst, dst, ic, partial, row_tiles, ic)
    }

    /// Unaligned fallback of the fused GELU-gradient + bias-sum pass: the two kernels apart
    /// (`bias_ptr`: the bias of the pre-activation, the compute copy of `params[pb]`).
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward_impl_gelu_then_bias(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, pre: &CudaBuf, saved: i32, bias_ptr: CUdeviceptr, pb: Span, rows: usize, ic: usize) -> BResult<()> {
        let n = rows * ic;
        if n == 0 {
            return Ok(());
        }
        let (nn, o) = (n as i64, ic as i32);
        self.launch1("gelu_bwd_bias", n, &mut kargs![dinp.ptr, pre.ptr, bias_ptr, nn, o, saved])?;
        self.add_column_sums(dparams.at(pb.off), dinp, rows, ic)
    }

    /// Checks of a linear layer's forward (`out = inp · Wᵀ + bias`); returns the bias address
    /// (0 without a bias).
    #[allow(clippy::too_many_arguments)]
    fn check_linear(&self, op: &'static str, out: &CudaBuf, inp: &CudaBuf, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<CUdeviceptr> {
        check_bf16(op, "inp", inp)?;
        check_bf16(op, "out", out)?;
        check_bf16(op, "params (the compute copy)", params)?;
        check_len(op, "inp", inp, rows * ic)?;
        check_len(op, "out", out, rows * oc)?;
        check_span(op, "weight", params, w)?;
        if w.len != ic * oc {
            return Err(BackendError::Shape { op, msg: format!("weight span has {} elements, expected {oc}×{ic}", w.len) });
        }
        match bias {
            Some(s) => {
                check_span(op, "bias", params, s)?;
                Ok(params.at(s.off))
            }
            None => Ok(0),
        }
    }

    /// out = gelu(pre + bias) over rows × cols bf16 elements (bias: one bf16 per column, 0 =
    /// none), by the widest vector kernel the width and alignment allow; with `save_grad`
    /// (GeluSaved::Grad) pre is then overwritten in place by gelu'(pre + bias).
    fn gelu_fwd_launch(&self, out: CUdeviceptr, pre: CUdeviceptr, bias: CUdeviceptr, rows: usize, cols: usize, save_grad: bool) -> BResult<()> {
        let n = rows * cols;
        if n == 0 {
            return Ok(());
        }
        if bias != 0 || save_grad {
            let (o, sg) = (cols as i32, save_grad as i32);
            if cols % 8 == 0 && out % 16 == 0 && pre % 16 == 0 && bias % 16 == 0 {
                let (n8, oc8) = ((n / 8) as i64, (cols / 8) as i32);
                return self.launch1("gelu_fwd_bias_v8", n / 8, &mut kargs![out, pre, bias, n8, oc8, sg]);
            }
            let nn = n as i64;
            return self.launch1("gelu_fwd_bias", n, &mut kargs![out, pre, bias, nn, o, sg]);
        }
        if n % 8 == 0 && pre % 16 == 0 && out % 16 == 0 {
            let n8 = (n / 8) as i64;
            self.launch1("gelu_fwd_v8", n / 8, &mut kargs![out, pre, n8])
        } else if n % 2 == 0 && pre % 4 == 0 && out % 4 == 0 {
            let n2 = (n / 2) as i64;
            self.launch1("gelu_fwd_bf16", n / 2, &mut kargs![out, pre, n2])
        } else {
            let nn = n as i64;
            self.launch1("gelu_fwd", n, &mut kargs![out, 1i32, pre, 1i32, nn])
        }
    }

    fn gemm(&self, op: &str, s: GemmShape, a: CUdeviceptr, b: CUdeviceptr, d: CUdeviceptr, bias: CUdeviceptr, alpha: f32, beta: f32) -> BResult<()> {
        self.gemm_c(op, s, a, b, d, d, bias, alpha, beta)
    }

    /// `gemm` with C read from its own buffer (D's type and layout): D = alpha·A·B + beta·C + bias.
    #[allow(clippy::too_many_arguments)]
    fn gemm_c(&self, op: &str, mut s: GemmShape, a: CUdeviceptr, b: CUdeviceptr, c: CUdeviceptr, d: CUdeviceptr, bias: CUdeviceptr, alpha: f32, beta: f32) -> BResult<()> {
        let sz = |t: Ty| t.size() as u64;
        let mut addrs = vec![a, b, c, d, s.lda as u64 * sz(s.a_ty), s.ldb as u64 * sz(s.b_ty), s.ldd as u64 * sz(s.d_ty)];
        if s.batch > 1 {
            addrs.extend([s.stride_a as u64 * sz(s.a_ty), s.stride_b as u64 * sz(s.b_ty), s.stride_d as u64 * sz(s.d_ty)]);
        }
        s.align = alignment(&addrs);
        s.accumulate = beta != 0.0;
        let label = format!("gemm {op} m{} n{} k{} b{}", s.m, s.n, s.k, s.batch);
        self.timed(&label, || self.gemm.run(op, &s, a, b, c, d, bias, alpha, beta, self.stream.cu_stream()))
    }
}

/// A linear layer's forward product. Row-major out(R, OC) = inp(R, IC)·Wᵀ  ⇔  column-major
/// outᵀ(OC×R) = Wᵀ·inpᵀ with W read as column-major IC×OC (ld IC) transposed, inp as IC×R
/// (ld IC). `accumulate`: beta = 1 (C read from the residual buffer).
fn linear_shape(rows: usize, ic: usize, oc: usize, bias: bool, accumulate: bool) -> GemmShape {
    GemmShape {
        ta: true, tb: false, m: oc as u64, n: rows as u64, k: ic as u64,
        a_ty: Ty::Bf16, b_ty: Ty::Bf16, d_ty: Ty::Bf16,
        lda: ic as i64, ldb: ic as i64, ldd: oc as i64,
        batch: 1, stride_a: 0, stride_b: 0, stride_d: 0,
        bias, accumulate, align: 0,
    }
}

/// A TMA descriptor of a row-major bf16 matrix (`rows` rows of `cols` contiguous elements at
/// `ptr`) read in boxes of `box_rows` rows × 64 columns with the 128-byte swizzle (the layout
/// the Hopper kernels' wgmma descriptors name); rows past the end read as zeros.
fn tensor_map_2d(ptr: CUdeviceptr, cols: usize, rows: usize, box_rows: u32) -> BResult<cudarc::driver::sys::CUtensorMap> {
    tensor_map(ptr, &[cols, rows], &[64, box_rows])
}

/// A tensor map over a bf16 tensor (batches, rows, cols) with `cols` contiguous: boxes of 64
/// columns × `box_rows` rows of one batch, 128-byte swizzle. Rows ≥ `rows` load as zeros and are
/// never stored, so a box may run past the end of each batch's rows.
fn tensor_map_3d(ptr: CUdeviceptr, cols: usize, rows: usize, batches: usize, box_rows: u32) -> BResult<cudarc::driver::sys::CUtensorMap> {
    tensor_map(ptr, &[cols, rows, batches], &[64, box_rows, 1])
}

/// A tensor map over a dense bf16 tensor of `dims` (innermost first), boxes of `boxes`, 128-byte
/// swizzle, elements outside the tensor read as zeros.
fn tensor_map<const R: usize>(ptr: CUdeviceptr, dims: &[usize; R], boxes: &[u32; R]) -> BResult<cudarc::driver::sys::CUtensorMap> {
    use cudarc::driver::sys as cu;
    // SAFETY: a plain-old-data struct the driver fills in below.
    let mut map: cu::CUtensorMap = unsafe { std::mem::zeroed() };
    let sizes = dims.map(|d| d as u64);
    // byte strides of dimensions 1… (dimension 0 is contiguous)
    let mut strides = [0u64; R];
    let mut stride = 2u64;
    for i in 1..R {
        stride *= sizes[i - 1];
        strides[i - 1] = stride;
    }
    let elem = [1u32; R];
    // SAFETY: out-pointer to a live CUtensorMap; the arrays hold rank (R) entries, of which the
    // driver reads R − 1 strides; ptr is a 16-byte aligned device address (the caller checked)
    // valid for the whole tensor.
    let r = unsafe {
        cu::cuTensorMapEncodeTiled(
            &mut map,
            cu::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            R as u32,
            ptr as *mut c_void,
            sizes.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem.as_ptr(),
            cu::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            cu::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != cu::CUresult::CUDA_SUCCESS {
        return Err(BackendError::Device(format!("cuTensorMapEncodeTiled (bf16 {dims:?}, boxes {boxes:?}): {r:?}")));
    }
    Ok(map)
}

/// Whether the 16-byte (8 × bf16) kernel variants apply: every buffer bf16, rows of `c` in
/// whole 16-byte groups, every address 16-byte aligned, and `total / 8` within 32-bit indices.
fn v8_ok(c: usize, total: usize, bufs: &[&CudaBuf], ptrs: &[CUdeviceptr]) -> bool {
    c % 8 == 0 && total / 8 <= i32::MAX as usize && bufs.iter().all(|b| b.ty == Ty::Bf16) && ptrs.iter().all(|p| p % 16 == 0)
}

/// The operands of a weight gradient `dparams[w] += doutᵀ·inp` (bf16 activations, f32 gradients).
#[allow(clippy::too_many_arguments)]
fn check_weight_grads(op: &'static str, dparams: &CudaBuf, dout: &CudaBuf, inp: &CudaBuf, params: &CudaBuf, w: Span, rows: usize, ic: usize, oc: usize) -> BResult<()> {
    for (what, buf, len) in [("dout", dout, rows * oc), ("inp", inp, rows * ic)] {
        check_bf16(op, what, buf)?;
        check_len(op, what, buf, len)?;
    }
    check_f32(op, "dparams", dparams)?;
    check_span(op, "weight", params, w)?;
    check_span(op, "weight gradient", dparams, w)
}

fn check_len(op: &'static str, what: &str, buf: &CudaBuf, want: usize) -> BResult<()> {
    if buf.len < want {
        return Err(BackendError::Shape { op, msg: format!("{what} holds {} elements, needs {want}", buf.len) });
    }
    Ok(())
}

/// Dynamic shared memory of the class-token attention kernels (f32: scores, the scaled query,
/// four warps' partial rows, the reductions; the backward adds dout and dS), within the
/// 227 KiB a block may have.
fn class_attention_smem(op: &'static str, n: usize, d: usize, backward: bool, v8: bool) -> BResult<u32> {
    let floats = if v8 {
        // p | qs | res | acc (1024) | red (32), the backward adds ds and g
        n + 2 * d + 1024 + 32 + if backward { n + d } else { 0 }
    } else {
        // p | qs | acc (4·d) | red (32), the backward adds g and ds
        n + 5 * d + 32 + if backward { d + n } else { 0 }
    };
    let bytes = 4 * floats;
    if bytes > 227 * 1024 {
        return Err(BackendError::Shape { op, msg: format!("{n} tokens of head dim {d} need {bytes} bytes of shared memory, more than 227 KiB") });
    }
    Ok(bytes as u32)
}

/// Whether the class-token attention takes its 16-byte kernels: D a multiple of 8 up to 1024
/// (rows of whole 16-byte chunks, at most 128 chunks for the 128 threads) and aligned buffers.
fn class_attention_v8(d: usize, ptrs: &[CUdeviceptr]) -> bool {
    d % 8 == 0 && d <= 1024 && ptrs.iter().all(|p| p % 16 == 0)
}

/// The fused attention kernels put B·H on grid.y (at most 65535 blocks).
fn check_grid(op: &'static str, bh: usize) -> BResult<()> {
    if bh > 65535 {
        return Err(BackendError::Shape { op, msg: format!("B·H = {bh} exceeds the 65535 the fused attention grid supports") });
    }
    Ok(())
}

fn check_bf16(op: &'static str, what: &str, buf: &CudaBuf) -> BResult<()> {
    if buf.ty != Ty::Bf16 {
        return Err(BackendError::Shape { op, msg: format!("{what} must be a compute-dtype (bf16) buffer") });
    }
    Ok(())
}

fn check_f32(op: &'static str, what: &str, buf: &CudaBuf) -> BResult<()> {
    if buf.ty != Ty::F32 {
        return Err(BackendError::Shape { op, msg: format!("{what} must be an f32 buffer (alloc_f32)") });
    }
    Ok(())
}

fn check_span(op: &'static str, what: &str, buf: &CudaBuf, s: Span) -> BResult<()> {
    if s.off + s.len > buf.len {
        return Err(BackendError::Shape { op, msg: format!("{what} span {}..{} outside a buffer of {}", s.off, s.off + s.len, buf.len) });
    }
    Ok(())
}

/// J (= C/32) of the register-resident LayerNorm kernels, when they apply: bf16 tensors,
/// f32 statistics and a width with a compiled instance.
fn ln_fast_j(c: usize, bf16s: &[&CudaBuf], f32s: &[&CudaBuf]) -> Option<usize> {
    let j = c / 32;
    let ok = c % 32 == 0
        && [1, 2, 3, 4, 6, 8, 12, 16, 24, 32].contains(&j)
        && bf16s.iter().all(|b| b.ty == Ty::Bf16)
        && f32s.iter().all(|b| b.ty == Ty::F32);
    ok.then_some(j)
}

/// The vectorized LayerNorm kernels (`layernorm_{fwd,bwd}_v{J}`): even J, and every row
/// pointer aligned to the vector width the kernel uses for that J (0 = absent is fine).
fn ln_vec_ok(j: usize, ptrs: &[CUdeviceptr]) -> bool {
    let vw = if j % 8 == 0 { 8 } else if j % 4 == 0 { 4 } else { 2 };
    j % 2 == 0 && [2, 4, 6, 8, 12, 16, 24, 32].contains(&j) && ptrs.iter().all(|&p| p % (2 * vw) as u64 == 0)
}

fn bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

impl Backend for Cuda {
    type Buf = CudaBuf;

    fn name(&self) -> String {
        format!("cuda:{} {}", self.info.index, self.info.name)
    }

    fn alloc(&self, len: usize) -> BResult<CudaBuf> {
        self.raw_alloc(len, Ty::Bf16)
    }

    fn alloc_f32(&self, len: usize) -> BResult<CudaBuf> {
        self.raw_alloc(len, Ty::F32)
    }

    fn needs_compute_copy(&self) -> bool {
        true
    }

    fn cast(&self, dst: &mut CudaBuf, src: &CudaBuf) -> BResult<()> {
        self.flush_partial_sums()?;
        check_len("cast", "dst", dst, src.len)?;
        let n = src.len as i64;
        self.launch1("cast_kernel", src.len, &mut kargs![dst.ptr, dst.dt(), src.ptr, src.dt(), n])
    }

    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    fn upload(&self, dst: &mut CudaBuf, off: usize, src: &[f32]) -> BResult<()> {
        self.flush_partial_sums()?;
        check_len("upload", "dst", dst, off + src.len())?;
        self.ctx.bind_to_thread().map_err(dev("upload"))?;
        let s = self.stream.cu_stream();
        // SAFETY: the destination range was checked; the host slice outlives the copy because
        // the stream is synchronized before returning.
        unsafe {
            match dst.ty {
                Ty::F32 => dr::memcpy_htod_async(dst.at(off), src, s).map_err(dev("upload"))?,
                Ty::Bf16 => {
                    let h: Vec<u16> = src.iter().map(|&x| bf16_bits(x)).collect();
                    dr::memcpy_htod_async(dst.at(off), &h, s).map_err(dev("upload"))?;
                    return self.synchronize();
                }
            }
        }
        self.synchronize()
    }

    fn upload_input(&self, dst: &mut CudaBuf, src: &[f32]) -> BResult<()> {
        check_len("upload_input", "dst", dst, src.len())?;
        // Small inputs (the targets) take the same path: the plain `upload` would make the host
        // wait for every queued kernel. During graph capture nothing may synchronize, so the
        // plain copy is the only choice there (the bench stages before capturing).
        if gemm::capturing_stream(self.stream.cu_stream()) {
            return self.upload(dst, 0, src);
        }
        self.ctx.bind_to_thread().map_err(dev("upload_input"))?;
        let bytes = src.len() * dst.ty.size();
        let i = self.next_staging.fetch_add(1, Ordering::Relaxed) % 2;
        let mut slots = self.staging.lock().map_err(|_| BackendError::Device("upload_input: staging lock poisoned".into()))?;
        let slot = &mut slots[i];
        // SAFETY: `done` is a live event; waiting on it means the copy that last read this
        // pinned buffer has finished, so it may be freed or rewritten.
        unsafe {
            if slot.in_flight {
                cudarc::driver::result::event::synchronize(slot.done).map_err(dev("cuEventSynchronize"))?;
                slot.in_flight = false;
            }
            if slot.bytes < bytes {
                if !slot.host.is_null() {
                    dr::free_host(slot.host).map_err(dev("cuMemFreeHost"))?;
                    slot.host = std::ptr::null_mut();
                    slot.bytes = 0;
                }
                slot.host = dr::malloc_host(bytes, 0).map_err(|e| BackendError::Device(format!("allocating {bytes} bytes of pinned host memory: {e}")))?;
                slot.bytes = bytes;
            }
        }
        let (copy, compute) = (self.copy_stream.cu_stream(), self.stream.cu_stream());
        // SAFETY: `host` holds `slot.bytes ≥ bytes` bytes of pinned memory that nothing else
        // touches until `done` fires; the destination range was checked; the compute stream
        // waits for `done` before any later kernel, and the caller guarantees no queued kernel
        // reads `dst` (the trait's contract).
        unsafe {
            match dst.ty {
                Ty::Bf16 => {
                    let h = std::slice::from_raw_parts_mut(slot.host as *mut u16, src.len());
                    h.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(o, i)| {
                        for (o, &x) in o.iter_mut().zip(i) {
                            *o = bf16_bits(x);
                        }
                    });
                    dr::memcpy_htod_async(dst.ptr, &h[..], copy).map_err(dev("upload_input"))?;
                }
                Ty::F32 => {
                    let h = std::slice::from_raw_parts_mut(slot.host as *mut f32, src.len());
                    h.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(o, i)| o.copy_from_slice(i));
                    dr::memcpy_htod_async(dst.ptr, &h[..], copy).map_err(dev("upload_input"))?;
                }
            }
            cudarc::driver::result::event::record(slot.done, copy).map_err(dev("cuEventRecord"))?;
            cudarc::driver::result::stream::wait_event(compute, slot.done, cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).map_err(dev("cuStreamWaitEvent"))?;
        }
        slot.in_flight = true;
        Ok(())
    }

    fn download(&self, src: &CudaBuf) -> BResult<Vec<f32>> {
        self.synchronize()?;
        // SAFETY: the host vectors have exactly the buffer's byte size; the stream is idle.
        unsafe {
            match src.ty {
                Ty::F32 => {
                    let mut h = vec![0f32; src.len];
                    dr::memcpy_dtoh_sync(&mut h, src.ptr).map_err(dev("download"))?;
                    Ok(h)
                }
                Ty::Bf16 => {
                    let mut h = vec![0u16; src.len];
                    dr::memcpy_dtoh_sync(&mut h, src.ptr).map_err(dev("download"))?;
                    Ok(h.into_iter().map(|b| half::bf16::from_bits(b).to_f32()).collect())
                }
            }
        }
    }

    fn fill(&self, buf: &mut CudaBuf, value: f32) -> BResult<()> {
        self.flush_partial_sums()?;
        if value == 0.0 {
            // SAFETY: the whole allocation of `buf`.
            return unsafe { dr::memset_d8_async(buf.ptr, 0, buf.bytes(), self.stream.cu_stream()) }.map_err(dev("fill"));
        }
        let n = buf.len as i64;
        self.launch1("fill_kernel", buf.len, &mut kargs![buf.ptr, buf.dt(), n, value])
    }

    fn copy(&self, dst: &mut CudaBuf, src: &CudaBuf) -> BResult<()> {
        self.flush_partial_sums()?;
        check_len("copy", "dst", dst, src.len)?;
        if dst.ty == src.ty {
            // SAFETY: both ranges hold src.bytes() bytes.
            return unsafe { dr::memcpy_dtod_async(dst.ptr, src.ptr, src.bytes(), self.stream.cu_stream()) }.map_err(dev("copy"));
        }
        self.cast(dst, src)
    }

    fn synchronize(&self) -> BResult<()> {
        self.flush_partial_sums()?;
        self.stream.synchronize().map_err(dev("synchronize"))
    }

    fn defer_gradient_sums(&self, defer: bool) -> BResult<()> {
        self.set_defer_partial_sums(defer)
    }

    fn patchify(&self, out: &mut CudaBuf, img: &CudaBuf, b: usize, chans: usize, size: usize, patch: usize) -> BResult<()> {
        if patch == 0 || size % patch != 0 {
            return Err(BackendError::Shape { op: "patchify", msg: format!("patch {patch} does not divide image size {size}") });
        }
        let n = b * chans * size * size;
        check_len("patchify", "img", img, n)?;
        check_len("patchify", "out", out, n)?;
        let (bb, c, s, p) = (b as i32, chans as i32, size as i32, patch as i32);
        // (the 8-output groups stay within one channel's patch when P·P is a multiple of 8)
        if (patch * patch) % 8 == 0 && v8_ok(8, n, &[out, img], &[out.ptr]) {
            return self.launch1("patchify_v8", n / 8, &mut kargs![out.ptr, img.ptr, bb, c, s, p]);
        }
        self.launch1("patchify_kernel", n, &mut kargs![out.ptr, out.dt(), img.ptr, img.dt(), bb, c, s, p])
    }

    fn embed_forward(&self, out: &mut CudaBuf, patches: &CudaBuf, params: &CudaBuf, pos: Span, cls: Option<Span>, b: usize, np: usize, c: usize) -> BResult<()> {
        let n_tok = np + usize::from(cls.is_some());
        check_len("embed_forward", "patches", patches, b * np * c)?;
        check_len("embed_forward", "out", out, b * n_tok * c)?;
        check_span("embed_forward", "pos", params, pos)?;
        if let Some(s) = cls {
            check_span("embed_forward", "cls", params, s)?;
        }
        let (pos_ptr, cls_ptr) = (params.at(pos.off), cls.map_or(0, |s| params.at(s.off)));
        if v8_ok(c, b * n_tok * c, &[out, patches, params], &[out.ptr, patches.ptr, pos_ptr, cls_ptr]) {
            let (rows, nt, pre, c8) = ((b * n_tok) as i32, n_tok as i32, (n_tok - np) as i32, (c / 8) as i32);
            return self.launch1("embed_fwd_v8", b * n_tok * c / 8, &mut kargs![out.ptr, patches.ptr, pos_ptr, cls_ptr, rows, nt, pre, c8]);
        }
        let cls_off = cls.map_or(-1i64, |s| s.off as i64);
        let (pos_off, bb, npp, cc) = (pos.off as i64, b as i32, np as i32, c as i32);
        self.launch1("embed_fwd_kernel", b * n_tok * c, &mut kargs![out.ptr, out.dt(), patches.ptr, patches.dt(), params.ptr, params.dt(), pos_off, cls_off, bb, npp, cc])
    }

    fn embed_backward(&self, dpatches: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, pos: Span, cls: Option<Span>, b: usize, np: usize, c: usize) -> BResult<()> {
        let prefix = usize::from(cls.is_some());
        let n_tok = np + prefix;
        check_len("embed_backward", "dout", dout, b * n_tok * c)?;
        check_len("embed_backward", "dpatches", dpatches, b * np * c)?;
        check_f32("embed_backward", "dparams", dparams)?;
        check_span("embed_backward", "pos", dparams, pos)?;
        if let Some(s) = cls {
            check_span("embed_backward", "cls", dparams, s)?;
        }
        let (bb, npp, pre, cc, nt) = (b as i32, np as i32, prefix as i32, c as i32, n_tok as i32);
        if !v8_ok(c, b * n_tok * c, &[dpatches, dout], &[dpatches.ptr, dout.ptr]) {
            self.launch1("embed_bwd_patches", b * np * c, &mut kargs![dpatches.ptr, dpatches.dt(), dout.ptr, dout.dt(), bb, npp, pre, cc])?;
            let cls_off = cls.map_or(-1i64, |s| s.off as i64);
            let pos_off = pos.off as i64;
            return self.launch1("embed_bwd_params", n_tok * c, &mut kargs![dparams.ptr, dout.ptr, dout.dt(), pos_off, cls_off, bb, nt, cc]);
        }
        if b * n_tok * c == 0 {
            return Ok(());
        }
        let c8 = (c / 8) as i32;
        self.launch1("embed_bwd_patches_v8", b * np * c / 8, &mut kargs![dpatches.ptr, dout.ptr, bb, npp, pre, c8])?;
        // Position (and class-token) gradient: partial sums over slices of the batch, enough
        // blocks to fill the GPU, then one (deferred) reduction into both spans.
        let groups = n_tok * c / 8;
        let xblocks = groups.div_ceil(THREADS as usize);
        let want_splits = (4 * self.info.multiprocessors as usize).div_ceil(xblocks).clamp(1, b);
        let per = b.div_ceil(want_splits);  // images per split
        let splits = b.div_ceil(per);
        let width = n_tok * c + prefix * c;
        let partial = self.partial_rows(splits * width)?;
        let (pp, cls_copy) = (per as i32, prefix as i32);
        self.launch("embed_bwd_params_part", (xblocks as u32, splits as u32, 1), (THREADS, 1, 1), 0, &mut kargs![partial, dout.ptr, bb, pp, nt, c8, cls_copy])?;
        let dpos = dparams.at(pos.off);
        let dcls = cls.map_or(dpos, |s| dparams.at(s.off));
        self.reduce_partials(dpos, dcls, dcls, n_tok * c, partial, splits, width)
    }

    fn matmul_forward(&self, out: &mut CudaBuf, gelu: Option<(&mut CudaBuf, GeluSaved)>, inp: &CudaBuf, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        const OP: &str = "matmul_forward";
        let bias_ptr = self.check_linear(OP, out, inp, params, w, bias, rows, ic, oc)?;
        match gelu {
            Some((pre, what)) => {
                check_bf16(OP, "gelu saved", pre)?;
                check_len(OP, "gelu saved", pre, rows * oc)?;
                let w_ptr = params.at(w.off);
                if self.fused_gemm_ok(rows, ic, oc, &[out.ptr, pre.ptr, inp.ptr, w_ptr], bias_ptr) {
                    // one Hopper kernel: the product, pre (or the derivative) and the GELU
                    // output from its epilogue
                    let (m, n, k) = (rows as i32, oc as i32, ic as i32);
                    let base = match what {
                        GeluSaved::Pre => "gemm_gelu_fwd_ws",
                        GeluSaved::Grad => "gemm_gelu_fwd_grad_ws",
                    };
                    let (name, grid, threads, smem, bn) = self.hopper_gemm_shape(base, rows, oc, false);
                    let ta = tensor_map_2d(inp.ptr, ic, rows, 128)?;
                    let tb = tensor_map_2d(w_ptr, ic, oc, bn as u32)?;
                    return self.launch_dyn(&name, (grid, 1, 1), (threads, 1, 1), smem, &mut kargs![out.ptr, pre.ptr, ta, tb, bias_ptr, m, n, k]);
                }
                // the plain product (no bias epilogue: faster), the bias joins in the GELU pass
                self.gemm(OP, linear_shape(rows, ic, oc, false, false), params.at(w.off), inp.ptr, pre.ptr, 0, 1.0, 0.0)?;
                self.gelu_fwd_launch(out.ptr, pre.ptr, bias_ptr, rows, oc, what == GeluSaved::Grad)
            }
            None => self.gemm(OP, linear_shape(rows, ic, oc, bias.is_some(), false), params.at(w.off), inp.ptr, out.ptr, bias_ptr, 1.0, 0.0),
        }
    }

    fn matmul_forward_residual(&self, out: &mut CudaBuf, residual: &CudaBuf, inp: &CudaBuf, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        const OP: &str = "matmul_forward_residual";
        let bias_ptr = self.check_linear(OP, out, inp, params, w, bias, rows, ic, oc)?;
        check_bf16(OP, "residual", residual)?;
        check_len(OP, "residual", residual, rows * oc)?;
        // beta = 1 with C = the residual (out's layout): cuBLASLt adds it before the bias
        // epilogue, in f32, and rounds once to bf16.
        self.gemm_c(OP, linear_shape(rows, ic, oc, bias.is_some(), true), params.at(w.off), inp.ptr, residual.ptr, out.ptr, bias_ptr, 1.0, 1.0)
    }

    fn gelu_forward(&self, out: &mut CudaBuf, pre: &CudaBuf, params: &CudaBuf, pre_bias: Option<Span>, rows: usize, cols: usize) -> BResult<()> {
        const OP: &str = "gelu_forward";
        let n = rows * cols;
        check_bf16(OP, "out", out)?;
        check_bf16(OP, "pre", pre)?;
        check_len(OP, "pre", pre, n)?;
        check_len(OP, "out", out, n)?;
        let bias_ptr = match pre_bias {
            Some(bs) => {
                check_bf16(OP, "params (the compute copy)", params)?;
                check_span(OP, "pre_bias", params, bs)?;
                if bs.len != cols {
                    return Err(BackendError::Shape { op: OP, msg: format!("pre_bias span has {} elements, pre has {cols} columns", bs.len) });
                }
                params.at(bs.off)
            }
            None => 0,
        };
        self.gelu_fwd_launch(out.ptr, pre.ptr, bias_ptr, rows, cols, false)
    }

    fn recompute_below(&self) -> usize {
        // 16 Mi elements (32 MiB of bf16): at and below this an elementwise kernel takes a few
        // microseconds on an H200, so regenerating an activation costs less than a launch gap.
        1 << 24
    }

    fn gelu_saves_grad(&self, rows: usize, ic: usize, oc: usize) -> bool {
        // Where both Hopper kernels run (the shape and alignment tests of fused_gemm_ok, with
        // the model's 16-byte aligned buffers): the forward's epilogue evaluates the derivative
        // beside the GELU almost for free, and the input-gradient kernel, whose epilogue set its
        // pace, only multiplies (CIFAR ViT-S/4 micro 512 on an H200: 12.02 → 11.74 ms a step).
        // fc2's input gradient is the same (rows × ic)·(oc × ic)ᵀ shape seen from the other side,
        // so one test covers both. The generic path gains nothing from it and keeps pre.
        self.fused_gemm_bwd.load(Ordering::Relaxed) && self.fused_gemm_ok(rows, ic, oc, &[], 0)
    }

    fn matmul_backward(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, inp: &CudaBuf, dgelu_pre: Option<&CudaBuf>, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        self.matmul_backward_impl(dinp, dparams, dout, inp, dgelu_pre.map(|p| (p, None, GeluSaved::Pre)), params, w, bias, rows, ic, oc)
    }

    fn matmul_backward_weights(&self, dparams: &mut CudaBuf, dout: &CudaBuf, inp: &CudaBuf, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        check_weight_grads("matmul_backward_weights", dparams, dout, inp, params, w, rows, ic, oc)?;
        self.weight_grads(dparams, dout, inp, w, bias, rows, ic, oc)
    }

    fn matmul_backward_gelu_bias(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, inp: &CudaBuf, saved: &CudaBuf, what: GeluSaved, pre_bias: Span, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        self.matmul_backward_impl(dinp, dparams, dout, inp, Some((saved, Some(pre_bias), what)), params, w, bias, rows, ic, oc)
    }

    fn layernorm_forward(&self, out: &mut CudaBuf, mean: &mut CudaBuf, rstd: &mut CudaBuf, inp: &CudaBuf, params: &CudaBuf, w: Span, b: Span, rows: usize, c: usize) -> BResult<()> {
        const OP: &str = "layernorm_forward";
        check_len(OP, "inp", inp, rows * c)?;
        check_len(OP, "out", out, rows * c)?;
        check_len(OP, "mean", mean, rows)?;
        check_len(OP, "rstd", rstd, rows)?;
        check_span(OP, "weight", params, w)?;
        check_span(OP, "bias", params, b)?;
        if mean.ty != rstd.ty {
            return Err(BackendError::Shape { op: OP, msg: "mean and rstd must share a dtype".into() });
        }
        let grid = (rows.div_ceil(8) as u32).min(self.info.multiprocessors * 16).max(1);
        if let Some(j) = ln_fast_j(c, &[&*out, inp, params], &[&*mean, &*rstd]) {
            let (wo, bo, r, eps) = (w.off as i64, b.off as i64, rows as i64, LN_EPS);
            if ln_vec_ok(j, &[out.ptr, inp.ptr]) {
                // Rows in flight = resident warps × 2, so as many blocks as fit at once (2–4
                // per SM by registers, asked of the driver); more would queue a second wave
                // behind the grid-stride loop's evenly split rows.
                let name = format!("layernorm_fwd_v{j}");
                let per_sm = self.kernels.get(&name)?.occupancy_max_active_blocks_per_multiprocessor(256, 0, None).unwrap_or(2).max(1);
                let grid = (rows.div_ceil(8) as u32).min(self.info.multiprocessors * per_sm).max(1);
                return self.launch(&name, (grid, 1, 1), (256, 1, 1), 0, &mut kargs![out.ptr, mean.ptr, rstd.ptr, inp.ptr, params.ptr, wo, bo, r, eps]);
            }
            return self.launch(&format!("layernorm_fwd_c{j}"), (grid, 1, 1), (THREADS, 1, 1), 0, &mut kargs![out.ptr, mean.ptr, rstd.ptr, inp.ptr, params.ptr, wo, bo, r, eps]);
        }
        let (wo, bo, r, cc, eps) = (w.off as i64, b.off as i64, rows as i64, c as i32, LN_EPS);
        self.launch("layernorm_fwd_kernel", (grid, 1, 1), (THREADS, 1, 1), 0, &mut kargs![out.ptr, out.dt(), mean.ptr, rstd.ptr, mean.dt(), inp.ptr, inp.dt(), params.ptr, params.dt(), wo, bo, r, cc, eps])
    }

    fn layernorm_backward(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, dresidual: Option<&CudaBuf>, inp: &CudaBuf, mean: &CudaBuf, rstd: &CudaBuf, params: &CudaBuf, w: Span, b: Span, rows: usize, c: usize, dinp_sum: Option<Span>) -> BResult<()> {
        const OP: &str = "layernorm_backward";
        if let Some(s) = dinp_sum {
            check_span(OP, "dinp_sum", dparams, s)?;
            if s.len != c {
                return Err(BackendError::Shape { op: OP, msg: format!("dinp_sum span has {} elements, dinp has {c} columns", s.len) });
            }
        }
        self.layernorm_backward_impl(dinp, dparams, dout, dresidual, inp, mean, rstd, params, w, b, rows, c, dinp_sum)
    }

    fn attention_forward(&self, out: &mut CudaBuf, probs: &mut CudaBuf, qkv: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        const OP: &str = "attention_forward";
        check_bf16(OP, "qkv", qkv)?;
        check_bf16(OP, "out", out)?;
        check_bf16(OP, "probs", probs)?;
        let bhnd = b * h * n * d;
        check_len(OP, "qkv", qkv, 3 * bhnd)?;
        check_len(OP, "out", out, bhnd)?;
        check_len(OP, "probs", probs, self.attention_saved_len(b, n, h, d))?;
        if let Some((sfx, smem, _)) = self.fused_attention(d) {
            if n == 0 || b * h == 0 {
                return Ok(());
            }
            check_grid(OP, b * h)?;
            let scale_log2 = std::f32::consts::LOG2_E / (d as f32).sqrt();
            let (nn, hh) = (n as i32, h as i32);
            // (the wgmma kernel copies through tensor maps: 16-byte aligned bases)
            if let (Some(smem), true) = (self.wgmma_attention_forward(n, d), qkv.ptr % 16 == 0 && out.ptr % 16 == 0) {
                let c = h * d;
                let tm_kv = tensor_map_3d(qkv.ptr, 3 * c, n, b, 208)?;
                let tm_q = tensor_map_3d(qkv.ptr, 3 * c, n, b, 64)?;
                let tm_out = tensor_map_3d(out.ptr, c, n, b, 64)?;
                return self.launch_dyn("flash_fwd_wg_d64", ((b * h) as u32, 1, 1), (128, 1, 1), smem, &mut kargs![tm_kv, tm_q, tm_out, probs.ptr, nn, hh, scale_log2]);
            }
            if let Some((w, smem, _)) = self.small_attention(n, d) {
                let block = (32 * w as u32, 1, 1);
                return self.launch_dyn(&format!("flash_fwd_small_d{d}_w{w}"), ((b * h) as u32, 1, 1), block, smem, &mut kargs![out.ptr, probs.ptr, qkv.ptr, nn, hh, scale_log2]);
            }
            let name = format!("flash_fwd_{sfx}");
            let grid = (n.div_ceil(64) as u32, (b * h) as u32, 1);
            return self.launch_dyn(&name, grid, (128, 1, 1), smem, &mut kargs![out.ptr, probs.ptr, qkv.ptr, nn, hh, scale_log2]);
        }
        let heads = self.scratch("qkv_heads", 3 * bhnd)?;
        let oh = self.scratch("o_heads", bhnd)?;
        let nn = n as i32;
        self.move_heads(true, heads, qkv.ptr, b, n, 3, h, d)?;
        let (q, k, v) = (heads, heads + 2 * bhnd as u64, heads + 4 * bhnd as u64);
        // Scores in rows padded to a multiple of 8 so every GEMM operand is 16-byte aligned.
        let ld = n.div_ceil(8) * 8;
        let sp = self.scratch("scores", b * h * n * ld)?;
        let nd = (n * d) as i64;
        let nld = (n * ld) as i64;
        let batch = (b * h) as i32;
        // S(N, N) = q·kᵀ/√D per head  ⇔  Sᵀ = K(D×N)ᵀ·Q(D×N), column-major.
        let s = GemmShape {
            ta: true, tb: false, m: n as u64, n: n as u64, k: d as u64,
            a_ty: Ty::Bf16, b_ty: Ty::Bf16, d_ty: Ty::Bf16,
            lda: d as i64, ldb: d as i64, ldd: ld as i64,
            batch, stride_a: nd, stride_b: nd, stride_d: nld,
            bias: false, accumulate: false, align: 0,
        };
        self.gemm("attention_forward (q·kᵀ)", s, k, q, sp, 0, 1.0 / (d as f32).sqrt(), 0.0)?;
        let rows = (b * h * n) as i64;
        let grid = (rows as usize).div_ceil(8).min(self.info.multiprocessors as usize * 16) as u32;
        let ldi = ld as i32;
        self.launch("softmax_fwd_pad", (grid, 1, 1), (THREADS, 1, 1), 0, &mut kargs![sp, ldi, probs.ptr, rows, nn])?;
        // O(N, D) = P·V  ⇔  Oᵀ(D×N) = Vᵀ(D×N)·Pᵀ(N×N), column-major.
        let s = GemmShape {
            ta: false, tb: false, m: d as u64, n: n as u64, k: n as u64,
            a_ty: Ty::Bf16, b_ty: Ty::Bf16, d_ty: Ty::Bf16,
            lda: d as i64, ldb: ld as i64, ldd: d as i64,
            batch, stride_a: nd, stride_b: nld, stride_d: nd,
            bias: false, accumulate: false, align: 0,
        };
        self.gemm("attention_forward (p·v)", s, v, sp, oh, 0, 1.0, 0.0)?;
        self.move_heads(false, out.ptr, oh, b, n, 1, h, d)
    }

    fn attention_backward(&self, dqkv: &mut CudaBuf, dout: &CudaBuf, qkv: &CudaBuf, out: &CudaBuf, probs: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        self.attention_backward_impl(dqkv, None, dout, qkv, out, probs, b, n, h, d)
    }

    fn attention_backward_bias(&self, dqkv: &mut CudaBuf, dparams: &mut CudaBuf, bias: Span, dout: &CudaBuf, qkv: &CudaBuf, out: &CudaBuf, probs: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        const OP: &str = "attention_backward_bias";
        check_f32(OP, "dparams", dparams)?;
        check_span(OP, "dbias", dparams, bias)?;
        if bias.len != 3 * h * d {
            return Err(BackendError::Shape { op: OP, msg: format!("bias span has {} elements, qkv has {} columns", bias.len, 3 * h * d) });
        }
        self.attention_backward_impl(dqkv, Some(dparams.at(bias.off)), dout, qkv, out, probs, b, n, h, d)
    }

    fn class_attention_forward(&self, out: &mut CudaBuf, q: &CudaBuf, kv: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        const OP: &str = "class_attention_forward";
        let c = h * d;
        for (what, buf, len) in [("q", q, b * c), ("kv", kv, b * n * 2 * c), ("out", &*out, b * c)] {
            check_bf16(OP, what, buf)?;
            check_len(OP, what, buf, len)?;
        }
        if b * h == 0 || n == 0 {
            return Ok(());
        }
        let v8 = class_attention_v8(d, &[out.ptr, q.ptr, kv.ptr]);
        let smem = class_attention_smem(OP, n, d, false, v8)?;
        let (nn, hh, dd, scale) = (n as i32, h as i32, d as i32, 1.0 / (d as f32).sqrt());
        let name = if v8 { "class_attention_fwd_v8" } else { "class_attention_fwd" };
        self.launch_dyn(name, ((b * h) as u32, 1, 1), (128, 1, 1), smem, &mut kargs![out.ptr, q.ptr, kv.ptr, nn, hh, dd, scale])
    }

    fn class_attention_backward(&self, dq: &mut CudaBuf, dkv: &mut CudaBuf, dparams: &mut CudaBuf, kv_bias: Option<Span>, dout: &CudaBuf, q: &CudaBuf, kv: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        const OP: &str = "class_attention_backward";
        let c = h * d;
        if let Some(s) = kv_bias {
            check_f32(OP, "dparams", dparams)?;
            check_span(OP, "dbias", dparams, s)?;
            if s.len != 2 * c {
                return Err(BackendError::Shape { op: OP, msg: format!("key/value bias span has {} elements, kv has {} columns", s.len, 2 * c) });
            }
        }
        for (what, buf, len) in [("q", q, b * c), ("kv", kv, b * n * 2 * c), ("dout", dout, b * c), ("dq", &*dq, b * c), ("dkv", &*dkv, b * n * 2 * c)] {
            check_bf16(OP, what, buf)?;
            check_len(OP, what, buf, len)?;
        }
        if b * h == 0 || n == 0 {
            return Ok(());
        }
        let v8 = class_attention_v8(d, &[dq.ptr, dkv.ptr, dout.ptr, q.ptr, kv.ptr]);
        let smem = class_attention_smem(OP, n, d, true, v8)?;
        let (nn, hh, dd, scale) = (n as i32, h as i32, d as i32, 1.0 / (d as f32).sqrt());
        if !v8 {
            self.launch_dyn("class_attention_bwd", ((b * h) as u32, 1, 1), (128, 1, 1), smem, &mut kargs![dq.ptr, dkv.ptr, dout.ptr, q.ptr, kv.ptr, nn, hh, dd, scale])?;
            return match kv_bias {
                Some(s) => self.add_column_sums(dparams.at(s.off), dkv, b * n, 2 * c),
                None => Ok(()),
            };
        }
        // with a bias: per-image dout rows (f32, H·D each), the v bias's terms, reduced below
        let part = match kv_bias {
            Some(_) => self.partial_rows(b * c)?,
            None => 0,
        };
        self.launch_dyn("class_attention_bwd_v8", ((b * h) as u32, 1, 1), (128, 1, 1), smem, &mut kargs![dq.ptr, dkv.ptr, dout.ptr, q.ptr, kv.ptr, nn, hh, dd, scale, part])?;
        match kv_bias {
            // v bias += Σ dout; the k bias's gradient is zero
            Some(s) => {
                let dv = dparams.at(s.off) + (c * 4) as u64;
                self.reduce_partials(dv, dv, dv, c, part, b, c)
            }
            None => Ok(()),
        }
    }

    fn add_class_rows(&self, dst: &mut CudaBuf, src: &CudaBuf, b: usize, n: usize, c: usize) -> BResult<()> {
        const OP: &str = "add_class_rows";
        check_bf16(OP, "dst", dst)?;
        check_bf16(OP, "src", src)?;
        check_len(OP, "dst", dst, b * n * c)?;
        check_len(OP, "src", src, b * c)?;
        let (bb, nn) = (b as i32, n as i32);
        if c % 8 == 0 && dst.ptr % 16 == 0 && src.ptr % 16 == 0 {
            let c8 = (c / 8) as i32;
            return self.launch1("add_class_rows_v8", b * c / 8, &mut kargs![dst.ptr, src.ptr, bb, nn, c8]);
        }
        let cc = c as i32;
        self.launch1("add_class_rows", b * c, &mut kargs![dst.ptr, src.ptr, bb, nn, cc])
    }

    fn attention_saved_len(&self, b: usize, n: usize, h: usize, d: usize) -> usize {
        if self.fused_attention(d).is_some() {
            // log-sum-exp per row: B·H·N f32 = 2·B·H·N bf16 slots (≤ B·H·N·N once N ≥ 2).
            (2 * b * h * n).min(b * h * n * n.max(2))
        } else {
            b * h * n * n
        }
    }

    fn add(&self, out: &mut CudaBuf, a: &CudaBuf, b: &CudaBuf) -> BResult<()> {
        let n = a.len.min(b.len);
        check_len("add", "out", out, n)?;
        if a.len != b.len {
            return Err(BackendError::Shape { op: "add", msg: format!("operands differ in length: {} vs {}", a.len, b.len) });
        }
        if n % 8 == 0 && [out.ty, a.ty, b.ty].iter().all(|&t| t == Ty::Bf16) && [out.ptr, a.ptr, b.ptr].iter().all(|&p| p % 16 == 0) {
            let n8 = (n / 8) as i64;
            return self.launch1("add_v8", n / 8, &mut kargs![out.ptr, a.ptr, b.ptr, n8]);
        }
        let nn = n as i64;
        self.launch1("add_kernel", n, &mut kargs![out.ptr, out.dt(), a.ptr, a.dt(), b.ptr, b.dt(), nn])
    }

    fn pool_forward(&self, out: &mut CudaBuf, inp: &CudaBuf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        check_len("pool_forward", "inp", inp, b * n * c)?;
        check_len("pool_forward", "out", out, b * c)?;
        let (bb, nn, cc, pp, a) = (b as i32, n as i32, c as i32, prefix as i32, avg as i32);
        self.launch1("pool_fwd_kernel", b * c, &mut kargs![out.ptr, out.dt(), inp.ptr, inp.dt(), bb, nn, cc, pp, a])
    }

    fn pool_backward(&self, dinp: &mut CudaBuf, dout: &CudaBuf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        check_len("pool_backward", "dinp", dinp, b * n * c)?;
        check_len("pool_backward", "dout", dout, b * c)?;
        let (bb, nn, cc, pp, a) = (b as i32, n as i32, c as i32, prefix as i32, avg as i32);
        if v8_ok(c, b * n * c, &[dinp, dout], &[dinp.ptr, dout.ptr]) {
            let (rows, c8) = ((b * n) as i32, (c / 8) as i32);
            return self.launch1("pool_bwd_v8", b * n * c / 8, &mut kargs![dinp.ptr, dout.ptr, rows, nn, pp, c8, a]);
        }
        self.launch1("pool_bwd_kernel", b * n * c, &mut kargs![dinp.ptr, dinp.dt(), dout.ptr, dout.dt(), bb, nn, cc, pp, a])
    }

    fn cross_entropy(&self, losses: &mut CudaBuf, dlogits: Option<&mut CudaBuf>, logits: &CudaBuf, targets: &CudaBuf, b: usize, k: usize, dloss_scale: f32) -> BResult<()> {
        check_len("cross_entropy", "losses", losses, b)?;
        check_len("cross_entropy", "logits", logits, b * k)?;
        check_len("cross_entropy", "targets", targets, b * k)?;
        let (dptr, ddt) = match dlogits {
            Some(d) => {
                check_len("cross_entropy", "dlogits", d, b * k)?;
                (d.ptr, d.dt())
            }
            None => (0u64, 0i32),
        };
        let grid = b.div_ceil(8).max(1) as u32;
        let (bb, kk) = (b as i32, k as i32);
        self.launch("cross_entropy_kernel", (grid, 1, 1), (THREADS, 1, 1), 0, &mut kargs![losses.ptr, losses.dt(), dptr, ddt, logits.ptr, logits.dt(), targets.ptr, targets.dt(), bb, kk, dloss_scale])
    }

    fn sum_squares(&self, buf: &CudaBuf) -> BResult<f64> {
        self.flush_partial_sums()?;
        self.sum_squares_async(buf)?;
        self.synchronize()?;
        let mut h = [0f64; 1];
        // SAFETY: 8 bytes from `acc` into an f64; the stream is idle.
        unsafe { dr::memcpy_dtoh_sync(&mut h, self.acc.ptr) }.map_err(dev("sum_squares"))?;
        Ok(h[0])
    }

    fn scale(&self, buf: &mut CudaBuf, s: f32) -> BResult<()> {
        self.flush_partial_sums()?;
        let n = buf.len as i64;
        self.launch1("scale_kernel", buf.len, &mut kargs![buf.ptr, buf.dt(), n, s])
    }

    fn optimizer_step(&self, params: &mut CudaBuf, grads: &CudaBuf, state: &mut CudaBuf, opt: &OptimizerConfig, decay: &DecayGroups, hyper: StepHyper) -> BResult<()> {
        self.optimizer_step_impl(params, grads, state, None, opt, decay, hyper)
    }

    /// The update kernels write the bf16 compute copy as they go: no separate cast pass.
    fn optimizer_step_cast(&self, params: &mut CudaBuf, grads: &CudaBuf, state: &mut CudaBuf, compute: &mut CudaBuf, opt: &OptimizerConfig, decay: &DecayGroups, hyper: StepHyper) -> BResult<()> {
        if compute.ty != Ty::Bf16 {
            self.optimizer_step_impl(params, grads, state, None, opt, decay, hyper)?;
            return self.cast(compute, params);
        }
        self.optimizer_step_impl(params, grads, state, Some(compute), opt, decay, hyper)
    }
}

impl Cuda {
    /// Σ buf² into the f64 `acc` on the stream (zeroed first); no waiting.
    fn sum_squares_async(&self, buf: &CudaBuf) -> BResult<()> {
        // SAFETY: `acc` holds 8 bytes.
        unsafe { dr::memset_d8_async(self.acc.ptr, 0, 8, self.stream.cu_stream()) }.map_err(dev("sum_squares"))?;
        let n = buf.len as i64;
        let grid = self.grid(buf.len).min(self.info.multiprocessors * 4);
        self.launch("sum_squares_kernel", (grid, 1, 1), (THREADS, 1, 1), 0, &mut kargs![self.acc.ptr, buf.ptr, buf.dt(), n])
    }

    #[allow(clippy::too_many_arguments)]
    fn optimizer_step_impl(&self, params: &mut CudaBuf, grads: &CudaBuf, state: &mut CudaBuf, compute: Option<&mut CudaBuf>, opt: &OptimizerConfig, decay: &DecayGroups, hyper: StepHyper) -> BResult<()> {
        self.flush_partial_sums()?;
        const OP: &str = "optimizer_step";
        check_f32(OP, "params", params)?;
        check_f32(OP, "grads", grads)?;
        check_f32(OP, "state", state)?;
        let p = params.len;
        check_len(OP, "grads", grads, p)?;
        check_len(OP, "state", state, super::optimizer_state_len(opt, p))?;
        let pc = match compute {
            Some(c) => {
                check_len(OP, "compute copy", c, p)?;
                c.ptr
            }
            None => 0,
        };
        // clipping by the global norm: its square summed into `acc` just before the update
        let (norm2, clip) = if hyper.clip_norm > 0.0 {
            self.sum_squares_async(grads)?;
            (self.acc.ptr, hyper.clip_norm)
        } else {
            (0, 0.0f32)
        };
        // Merge neighbouring spans with the same decay flag into segments.
        let mut segs: Vec<i64> = Vec::new();
        for &(s, d) in &decay.spans {
            check_span(OP, "decay group", params, s)?;
            let n = segs.len();
            if n >= 3 && segs[n - 2] == s.off as i64 && (segs[n - 1] != 0) == d {
                segs[n - 2] = (s.off + s.len) as i64;
            } else {
                segs.extend([s.off as i64, (s.off + s.len) as i64, d as i64]);
            }
        }
        if segs.is_empty() {
            segs.extend([0, p as i64, 1]);
        }
        // One block per chunk of at most OPT_CHUNK parameters (grid.y): a grid sized for the
        // longest segment left most blocks of the short ones (biases, LayerNorm) with nothing to
        // do. Each segment adds at most one partial chunk, so chunks of ⌈P / (65 535 − segments)⌉
        // or more keep the grid within its 65 535 rows.
        let room = 65_535usize.saturating_sub(segs.len() / 3).max(1);
        let chunk = OPT_CHUNK.max(p.div_ceil(room)) as i64;
        let segs: Vec<i64> = segs
            .chunks(3)
            .flat_map(|c| {
                let (start, end, decay) = (c[0], c[1], c[2]);
                (start..end).step_by(chunk as usize).flat_map(move |a| [a, (a + chunk).min(end), decay])
            })
            .collect();
        let nseg = segs.len() / 3;
        if nseg == 0 {
            return Ok(());  // no parameters
        }
        if nseg > 65_535 {
            return Err(BackendError::Shape { op: OP, msg: format!("{nseg} optimizer blocks (decay segments split into chunks) exceed the grid's 65 535") });
        }
        let seg_ptr = {
            let mut cache = self.segments.lock().map_err(|_| BackendError::Device("segment cache poisoned".into()))?;
            if cache.as_ref().is_none_or(|(v, _)| *v != segs) {
                // Stored as f32-sized pairs: i64 = 2 f32 slots.
                let mut buf = self.raw_alloc(segs.len() * 2, Ty::F32)?;
                // SAFETY: buf holds segs.len() i64 values; synchronized below.
                unsafe { dr::memcpy_htod_async(buf.ptr, &segs, self.stream.cu_stream()) }.map_err(dev(OP))?;
                self.synchronize()?;
                buf.len = segs.len() * 2;
                *cache = Some((segs.clone(), buf));
            }
            cache.as_ref().map(|(_, b)| b.ptr).unwrap_or(0)
        };
        let grid = (1, nseg as u32, 1);
        let m = state.ptr;
        match *opt {
            OptimizerConfig::Adam { beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, .. } => {
                let t = hyper.step.max(1) as i32;
                let (bc1, bc2) = if bias_correction { (1.0 - beta1.powi(t), 1.0 - beta2.powi(t)) } else { (1.0, 1.0) };
                let v = state.at(p);
                let (lr, b1, b2, e, wd, aw) = (hyper.lr, beta1 as f32, beta2 as f32, eps as f32, weight_decay as f32, adam_w_mode as i32);
                let (c1, c2, gs) = (bc1 as f32, bc2 as f32, hyper.grad_scale);
                self.launch("adam_kernel", grid, (THREADS, 1, 1), 0, &mut kargs![params.ptr, grads.ptr, m, v, seg_ptr, lr, b1, b2, e, wd, aw, c1, c2, gs, pc, norm2, clip])
            }
            OptimizerConfig::Sgd { momentum, dampening, weight_decay, nesterov, .. } => {
                let (lr, mo, da, wd, ne, first, gs) = (hyper.lr, momentum as f32, dampening as f32, weight_decay as f32, nesterov as i32, (hyper.step <= 1) as i32, hyper.grad_scale);
                self.launch("sgd_kernel", grid, (THREADS, 1, 1), 0, &mut kargs![params.ptr, grads.ptr, m, seg_ptr, lr, mo, da, wd, ne, first, gs, pc, norm2, clip])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_sums_by_name_largest_first() {
        let l = |name: &str, ms: f64| ProfiledLaunch { name: name.into(), ms, gap_before_ms: 0.0 };
        let timeline = [l("ln", 0.5), l("gemm", 2.0), l("ln", 0.75), l("adam", 1.0)];
        let got = profile_by_name(&timeline);
        assert_eq!(got, vec![("gemm".to_string(), 2.0, 1), ("ln".to_string(), 1.25, 2), ("adam".to_string(), 1.0, 1)]);
        assert!(profile_by_name(&[]).is_empty());
    }
}
