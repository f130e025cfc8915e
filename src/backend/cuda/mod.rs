//! The CUDA backend: the `Backend` trait on one NVIDIA GPU.
//!
//! - Libraries are found at run time (`libs`): the binary builds and runs without CUDA.
//! - Compute dtype is 16-bit (`alloc`): bf16, or fp16 (`backend::half`: an fp16 block, or a GPU
//!   before Ampere), one format for the whole backend, chosen when it is opened
//!   (`for_precision`); the kernels are compiled for it. Master weights, gradients, optimizer
//!   state and losses are f32 (`alloc_f32`). A buffer carries its dtype, and kernels that touch
//!   parameters, statistics or losses accept either, so the model may choose.
//! - GEMMs go through cuBLASLt (`gemm`): 16-bit operands, fp32 accumulation, bias in the
//!   epilogue; weight gradients accumulate into the f32 gradient buffer with beta = 1 (`+=`).
//! - Every other op is a CUDA C kernel in `kernels/*.cu`, compiled by NVRTC for the device's
//!   architecture and cached on disk (`compile`).
//! - All work goes to one non-blocking stream, so a training step can be captured into a
//!   CUDA graph (`begin_capture` / `end_capture`); nothing on the op paths synchronizes except
//!   `download`, `upload` and `sum_squares`, which must.
//!
//! Attention has two paths, chosen at run time (`CudaOptions::attention`, default fused;
//! `set_attention`):
//! - gemm: materializes `probs` (B, H, N, N): per-head layout copies, strided-batched cuBLASLt
//!   GEMMs for q·kᵀ and p·v, and a row-softmax kernel.
//! - fused (`kernels/flash.cu`, head dims 32, 64, 80, 96 and 128): flash-attention-2 style
//!   tensor-core kernels that read q, k, v from the interleaved qkv layout, keep only the
//!   per-row log-sum-exp (B·H·N f32) in `probs`, and recompute the probabilities in the
//!   backward. Other head dims, and every head where flash.cu did not load (sm_75), take the
//!   gemm path. At D 32 and 64, for N ≤ 80 (CIFAR's 65 tokens) forward and backward hold a
//!   whole head in one small block of ≤ 5 warps, several blocks per SM; for N ≤ 256 the
//!   backward keeps a whole head in one 8-warp block (no dQ atomics); `fused-pipe` uses the
//!   tiled forward and the key-block backward for every N (to compare; it is what longer
//!   sequences and the other head dims get anyway).
//! - On Hopper (`kernels/hopper.cu`, compiled for sm_90a on sm_90 devices only) the MLP's first
//!   layer is one persistent wgmma/TMA kernel with the erf GELU in its epilogue (cuBLASLt's GELU
//!   epilogue is the tanh approximation), and the second layer's input gradient another with the
//!   GELU backward and the first layer's bias sums in its epilogue; `CudaOptions::fused_gemm`
//!   chooses.
//! - Batch inputs (`upload_input`) are converted into pinned staging memory and copied on a
//!   second stream; the compute stream waits on an event, the host does not wait.
//! - Bias and LayerNorm-parameter gradients arrive as f32 partial rows from the passes that see
//!   the gradient's rows; `partials` queues their column sums during a backward and adds them
//!   up in batched launches.
//! - The optimizer kernels clip by the global norm (its square summed on the device just
//!   before) and write the 16-bit compute copy of the weights as they update them.
//!
//! The host code is split by layer, as the kernels are: `device` (buffers, launches, capture,
//! the memory ops), `linear`, `attention`, `norm`, `embed` (patches, embedding, pooling, loss,
//! the residual add), `optim`, with `partials` (gradient column sums), `profile` (per-launch
//! timing) and `options` (the kernel choices, `CudaOptions`) beside them. This file holds the
//! backend itself and its `Backend` implementation, which hands each op to its layer.

mod attention;
pub mod compile;
mod device;
mod embed;
mod gemm;
mod jpeg;
pub mod libs;
pub mod nccl;
mod linear;
mod norm;
mod optim;
mod options;
mod partials;
mod profile;
pub mod telemetry;

pub use device::{cuda_available, probe, CudaBuf, DeviceInfo, Graph, MemStats};
pub use options::{parse_attention, AttentionPath, CudaOptions, GemmRing, GemmTune, WideTiles, ATTENTION_ENV, FUSED_GEMM_ENV, GEMM_TUNE_ENV, WGMMA_ATTENTION_ENV, WIDE_GEMM_ENV};
pub use profile::{profile_by_name, ProfiledLaunch};

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream};

use self::device::{dev, Scratch, Staging};
use self::gemm::{Gemm, Ty};
use super::half::{HalfChoice, HalfFormat};
use super::{BResult, Backend, BackendError, ParamGroups, GeluSaved, ShardPiece, Span, StepHyper, StridedCopy};
use crate::core::OptimizerConfig;

/// One GPU behind the `Backend` trait (see the module doc).
pub struct Cuda {
    // Fields drop in declaration order: the staging buffers (pinned memory, events) and the
    // copy stream go while the context is certainly alive.
    /// Two pinned staging buffers used in turn, so converting batch k + 1 never waits for
    /// the copy of batch k.
    staging: Mutex<[Staging; 2]>,
    next_staging: AtomicUsize,
    /// The GPU image decoder (`data.decode = "gpu"`), opened on first use.
    jpeg: Arc<Mutex<Option<jpeg::JpegDecoder>>>,
    /// The batch being decoded into the input buffer: the decode thread still enqueuing it, or
    /// the event it recorded on the decode stream. The compute stream waits for it just before
    /// it reads the input (`patchify`) or synchronizes, not when the decode is enqueued (that
    /// would hold back the current step's optimizer).
    decoded_input: Mutex<Option<jpeg::PendingDecode>>,
    /// The batch after it, its decode started ahead (`decode_ahead`) up to the last pass.
    decode_ahead: Mutex<Option<jpeg::AheadDecode>>,
    /// The latest decode thread's `Finished`, which the next one waits for.
    decode_chain: Mutex<Option<Arc<jpeg::Finished>>>,
    /// Batches `decode_input` finished from a start ahead (the selftest checks the path ran),
    /// and of those, the ones whose last pass it left to their still-running thread.
    decoded_ahead: std::sync::atomic::AtomicU64,
    ahead_handed_over: std::sync::atomic::AtomicU64,
    /// `VITSCALE_DECODE_AHEAD`, once read (`decodes_ahead`).
    decode_ahead_on: std::sync::OnceLock<Result<bool, String>>,
    /// Stream for batch-input copies (`upload_input`), so they overlap the compute stream.
    copy_stream: Arc<CudaStream>,
    /// When traced (`time_input_copies`): each input copy's start and end events on the copy
    /// stream and its bytes, until `take_input_copies`.
    copy_timing: Mutex<Option<Vec<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent, usize)>>>,
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: compile::Kernels,
    gemm: Gemm,
    _workspace: CudaBuf,
    mem: Arc<MemStats>,
    scratch: Mutex<Scratch>,
    /// How many clusters of each clustered kernel fit on the device at once (by kernel name and
    /// cluster size), for the persistent grids (`max_active_clusters`).
    cluster_fit: Mutex<std::collections::HashMap<(String, u32), u32>>,
    /// Bias and LayerNorm-parameter gradient reductions waiting for one launch (`partials`).
    partial_sums: Mutex<partials::PendingSums>,
    /// Uploaded optimizer segments (start, end, code), one table per grouping seen.
    segments: Mutex<Vec<(Vec<i64>, CudaBuf)>>,
    /// One f64 accumulator for `sum_squares`.
    acc: CudaBuf,
    /// The measured matrix rate in the backend's 16-bit format (`matrix_ceiling_tflops`), once measured.
    ceiling_tflops: std::sync::OnceLock<f64>,
    /// When set, every kernel and GEMM is bracketed by events (see `set_profiling`).
    profile: Mutex<Option<Vec<(String, cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>>>,
    /// The kernel choices that may change between calls (`options`: `set_attention`,
    /// `set_fused_gemm`, `set_wgmma_attention`, `set_wide_gemm`).
    knobs: options::Knobs,
    /// Recorded on the compute stream after each forward's last read of the staged inputs;
    /// `upload_input`'s copy waits for it, so a batch staged ahead never overwrites inputs
    /// that a queued forward has yet to read.
    inputs_read: Arc<Mutex<Option<cudarc::driver::CudaEvent>>>,
    /// The 16-bit compute format and why (`backend::half::choose`).
    half: HalfChoice,
}

impl Drop for Cuda {
    /// A decode thread still enqueuing a batch (the next one's, or one decoded ahead) uses the
    /// context and the decoder: let it finish before they go.
    fn drop(&mut self) {
        if let Ok(mut slot) = self.decoded_input.lock() {
            if let Some(p) = slot.take() {
                let _ = p.settle();
            }
        }
        let ahead = self.decode_ahead.lock().ok().and_then(|mut slot| slot.take());
        if let Some(a) = ahead {
            let _ = self.drop_ahead(a);
        }
    }
}

impl Cuda {
    /// Opens GPU `index` as a run without a bf16 or fp16 block would (bf16, fp16 before
    /// Ampere), with the kernel choices of the `VITSCALE_*` variables
    /// (`CudaOptions::from_env`; a value it does not accept is an error).
    pub fn new(index: usize) -> BResult<Cuda> {
        Self::for_precision(index, &crate::config::Precision::Fp32)
    }

    /// Opens GPU `index` for a run of `precision`: its 16-bit compute format follows
    /// `backend::half::choose` (an error for a bf16 block on a GPU before Ampere).
    pub fn for_precision(index: usize, precision: &crate::config::Precision) -> BResult<Cuda> {
        Self::with_options(index, CudaOptions::from_env().map_err(BackendError::Device)?, precision)
    }

    /// Opens GPU `index`: loads libraries, creates the context and stream, compiles (or loads
    /// from the cache) every kernel for the compute format `precision` gets on this GPU (or on
    /// the architecture `VITSCALE_CUDA_ARCH` forces), creates the cuBLASLt handle and workspace.
    pub fn with_options(index: usize, options: CudaOptions, precision: &crate::config::Precision) -> BResult<Cuda> {
        let info = probe(index).map_err(BackendError::Device)?;
        let forced = compile::forced_capability()?;
        let gpu = if forced.is_some() { format!("{} under VITSCALE_CUDA_ARCH", info.name) } else { info.name.clone() };
        let half = super::half::choose(precision, forced.unwrap_or(info.compute_capability), &gpu).map_err(BackendError::Device)?;
        let ctx = CudaContext::new(index).map_err(dev("cuCtxCreate"))?;
        // One stream and raw allocations: cudarc's per-slice event tracking is not needed.
        // SAFETY: no CudaSlice of this context is shared across streams.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(dev("cuStreamCreate"))?;
        let copy_stream = ctx.new_stream().map_err(dev("cuStreamCreate"))?;
        let staging = Mutex::new([Staging::new()?, Staging::new()?]);
        let kernels = compile::Kernels::load(&ctx, &info.arch(), half.format)?;
        let mem = Arc::new(MemStats::default());
        let ws_size = 32usize << 20;
        let workspace = Self::raw_alloc_with(&ctx, &stream, &mem, ws_size, Ty::Half)?;
        // the tuner's choices beside the compiled kernels, keyed by card (name and multiprocessors)
        let card = format!("{} ({} SMs)", info.name, info.multiprocessors);
        let sustained = options.gemm_tune == GemmTune::Sustained;
        let gemm = Gemm::new(workspace.ptr, ws_size, &card, compile::cache_dir().map(|d| d.join("gemm-choices.tsv")), sustained, half.format)?;
        let acc = Self::raw_alloc_with(&ctx, &stream, &mem, 2, Ty::F32)?;
        Ok(Cuda {
            info,
            ctx,
            stream,
            kernels,
            gemm,
            _workspace: workspace,
            mem,
            scratch: Mutex::new(Scratch::default()),
            cluster_fit: Mutex::new(std::collections::HashMap::new()),
            partial_sums: Mutex::new(partials::PendingSums::default()),
            segments: Mutex::new(Vec::new()),
            acc,
            ceiling_tflops: std::sync::OnceLock::new(),
            profile: Mutex::new(None),
            knobs: options::Knobs::new(&options),
            inputs_read: Arc::new(Mutex::new(None)),
            copy_stream,
            copy_timing: Mutex::new(None),
            staging,
            next_staging: AtomicUsize::new(0),
            jpeg: Arc::new(Mutex::new(None)),
            decoded_input: Mutex::new(None),
            decode_ahead: Mutex::new(None),
            decode_chain: Mutex::new(None),
            decoded_ahead: std::sync::atomic::AtomicU64::new(0),
            ahead_handed_over: std::sync::atomic::AtomicU64::new(0),
            decode_ahead_on: std::sync::OnceLock::new(),
            half,
        })
    }

    /// The 16-bit compute format of this backend's buffers and kernels.
    pub fn half_format(&self) -> HalfFormat {
        self.half.format
    }

    /// What runs slower on this device and format than on a bf16 GPU from Ampere on, one line
    /// each (docs/precision.md's table): the run's warnings say it.
    pub fn slower_paths(&self) -> Vec<String> {
        let mut out = Vec::new();
        let arch = self.kernels.forced.clone().unwrap_or_else(|| self.info.arch());
        if !self.has_flash_attention() {
            out.push(format!(
                "fused attention (kernels/flash.cu) is not available for {arch} (it needs sm_80: cp.async, mma.m16n8k16): attention materializes the (N, N) scores through cuBLASLt and a softmax kernel, slower and with more memory at long sequences"
            ));
        }
        if self.half.format == HalfFormat::F16 && self.info.compute_capability.0 == 9 && self.kernels.forced.is_none() {
            out.push("fp16 on Hopper: the wgmma kernels (fused MLP GEMMs, N = 197 attention) are bf16 only; cuBLASLt and flash.cu run instead, slower than bf16 here".into());
        }
        out
    }

    /// " [fp16]" in the device's name when it computes in fp16 (bf16, the usual, goes unsaid).
    fn half_tag(&self) -> &'static str {
        if self.half.format == HalfFormat::F16 { " [fp16]" } else { "" }
    }

    /// The one-line notice of an automatic format choice (fp16 before Ampere), if any.
    pub fn half_notice(&self) -> Option<&str> {
        self.half.notice.as_deref()
    }
}

impl Backend for Cuda {
    type Buf = CudaBuf;
    type Mark = cudarc::driver::CudaEvent;

    fn new_mark(&self) -> BResult<cudarc::driver::CudaEvent> {
        // a timing event (`None` would create one without timing)
        self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(dev("cuEventCreate"))
    }
    fn record_mark(&self, mark: &mut cudarc::driver::CudaEvent) -> BResult<()> {
        mark.record(&self.stream).map_err(dev("cuEventRecord"))
    }
    fn seconds_between(&self, a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent) -> BResult<f64> {
        b.synchronize().map_err(dev("cuEventSynchronize"))?;
        Ok(a.elapsed_ms(b).map_err(dev("cuEventElapsedTime"))? as f64 * 1e-3)
    }
    fn matrix_ceiling_tflops(&self) -> BResult<Option<f64>> {
        if let Some(&t) = self.ceiling_tflops.get() {
            return Ok(Some(t));
        }
        // bench's measurement: the median of 10 16-bit 8192³ products on random data; its
        // operands are freed again and stay out of the run's peak memory
        let peak = self.mem.peak.load(std::sync::atomic::Ordering::Relaxed);
        let t = self.matmul_tflops(8192, 10)?;
        let live = self.mem.live.load(std::sync::atomic::Ordering::Relaxed);
        self.mem.peak.store(peak.max(live), std::sync::atomic::Ordering::Relaxed);
        Ok(Some(*self.ceiling_tflops.get_or_init(|| t)))
    }

    fn name(&self) -> String {
        match &self.kernels.forced {
            // said wherever the device is named: the kernels are another architecture's
            Some(arch) => format!("cuda:{} {} (kernels for {arch}, VITSCALE_CUDA_ARCH){}", self.info.index, self.info.name, self.half_tag()),
            None => format!("cuda:{} {}{}", self.info.index, self.info.name, self.half_tag()),
        }
    }

    fn alloc(&self, len: usize) -> BResult<CudaBuf> {
        self.raw_alloc(len, Ty::Half)
    }

    fn implicit_fp16(&self) -> bool {
        self.half.implicit_fp16
    }

    fn alloc_f32(&self, len: usize) -> BResult<CudaBuf> {
        self.raw_alloc(len, Ty::F32)
    }

    fn peak_memory(&self) -> Option<(u64, &'static str)> {
        Some((self.peak_bytes() as u64, "device memory held by the backend's buffers"))
    }

    fn needs_compute_copy(&self) -> bool {
        true
    }

    fn cast(&self, dst: &mut CudaBuf, src: &CudaBuf) -> BResult<()> {
        self.cast_impl(dst, src)
    }

    fn len(&self, buf: &CudaBuf) -> usize {
        buf.len
    }

    fn upload(&self, dst: &mut CudaBuf, off: usize, src: &[f32]) -> BResult<()> {
        self.upload_impl(dst, off, src)
    }

    fn time_input_copies(&self, on: bool) -> BResult<()> {
        let mut t = self.copy_timing.lock().map_err(|_| BackendError::Device("copy timing lock poisoned".into()))?;
        *t = on.then(Vec::new);
        Ok(())
    }

    fn take_input_copies(&self, epoch: std::time::Instant) -> BResult<Vec<(String, f64, f64)>> {
        self.take_input_copies_impl(epoch)
    }

    fn upload_input(&self, dst: &mut CudaBuf, src: &[f32]) -> BResult<()> {
        self.upload_input_impl(dst, src)
    }

    fn decode_input(&self, dst: &mut CudaBuf, batch: &crate::core::encoded::EncodedBatch, range: std::ops::Range<usize>) -> BResult<()> {
        self.decode_input_impl(dst, batch, range)
    }

    fn decode_ahead(&self, batch: &crate::core::encoded::EncodedBatch, range: std::ops::Range<usize>) -> BResult<()> {
        self.decode_ahead_impl(batch, range)
    }

    fn decodes_ahead(&self) -> BResult<bool> {
        self.decodes_ahead_impl()
    }

    fn download(&self, src: &CudaBuf) -> BResult<Vec<f32>> {
        self.download_impl(src)
    }

    fn fill(&self, buf: &mut CudaBuf, value: f32) -> BResult<()> {
        self.fill_impl(buf, value)
    }

    fn copy(&self, dst: &mut CudaBuf, src: &CudaBuf) -> BResult<()> {
        self.copy_impl(dst, src)
    }

    fn synchronize(&self) -> BResult<()> {
        self.synchronize_impl()
    }

    fn defer_gradient_sums(&self, defer: bool) -> BResult<()> {
        self.set_defer_partial_sums(defer)
    }

    fn bias_grads_in_products(&self, rows: usize, ic: usize, oc: usize) -> bool {
        self.wgrad_kernel_applies(rows, ic, oc)
    }

    fn inputs_consumed(&self) -> BResult<()> {
        self.mark_inputs_read()
    }

    fn patchify(&self, out: &mut CudaBuf, img: &CudaBuf, b: usize, chans: usize, size: usize, patch: usize) -> BResult<()> {
        self.patchify_impl(out, img, b, chans, size, patch)
    }

    fn embed_forward(&self, out: &mut CudaBuf, patches: &CudaBuf, params: &CudaBuf, pos: Span, cls: Option<Span>, b: usize, np: usize, c: usize) -> BResult<()> {
        self.embed_forward_impl(out, patches, params, pos, cls, b, np, c)
    }

    fn embed_backward(&self, dpatches: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, pos: Span, cls: Option<Span>, b: usize, np: usize, c: usize) -> BResult<()> {
        self.embed_backward_impl(dpatches, dparams, dout, pos, cls, b, np, c)
    }

    fn matmul_forward(&self, out: &mut CudaBuf, gelu: Option<(&mut CudaBuf, GeluSaved)>, inp: &CudaBuf, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        self.matmul_forward_impl(out, gelu, inp, params, w, bias, rows, ic, oc)
    }

    fn matmul_forward_residual(&self, out: &mut CudaBuf, residual: &CudaBuf, inp: &CudaBuf, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        self.matmul_forward_residual_impl(out, residual, inp, params, w, bias, rows, ic, oc)
    }

    fn gelu_forward(&self, out: &mut CudaBuf, pre: &CudaBuf, params: &CudaBuf, pre_bias: Option<Span>, rows: usize, cols: usize) -> BResult<()> {
        self.gelu_forward_impl(out, pre, params, pre_bias, rows, cols)
    }

    fn recompute_below(&self) -> usize {
        // 16 Mi elements (32 MiB of bf16): at and below this an elementwise kernel takes a few
        // microseconds on an H200, so regenerating an activation costs less than a launch gap.
        1 << 24
    }

    fn choices(&self) -> serde_json::Map<String, serde_json::Value> {
        let (fc1, fc2_dgrad) = self.fused_gemm();
        let (wide_fwd, wide_bwd) = self.wide_gemm();
        let mut m = serde_json::Map::new();
        m.insert("attention".into(), self.attention_path().name().into());
        m.insert("wgmma_attention".into(), (self.wgmma_attention() && self.has_wgmma_attention()).into());
        m.insert("fused_gemm_fc1".into(), (fc1 && self.has_fused_gemm()).into());
        m.insert("fused_gemm_fc2_dgrad".into(), (fc2_dgrad && self.has_fused_gemm()).into());
        m.insert("wide_tiles".into(), format!("{wide_fwd:?}/{wide_bwd:?}").to_lowercase().into());
        m.insert("gemm_ring".into(), self.gemm_ring().name().into());
        m.insert("fold_keys".into(), self.fold_keys().into());
        m
    }

    fn gelu_saves_grad(&self, rows: usize, ic: usize, oc: usize) -> bool {
        self.gelu_saves_grad_impl(rows, ic, oc)
    }

    fn matmul_backward(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, inp: &CudaBuf, dgelu_pre: Option<&CudaBuf>, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        self.matmul_backward_impl(dinp, dparams, dout, inp, dgelu_pre.map(|p| (p, None, GeluSaved::Pre)), params, w, bias, rows, ic, oc)
    }

    fn matmul_backward_weights(&self, dparams: &mut CudaBuf, dout: &CudaBuf, inp: &CudaBuf, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        self.matmul_backward_weights_impl(dparams, dout, inp, params, w, bias, rows, ic, oc)
    }

    fn matmul_backward_gelu_bias(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, inp: &CudaBuf, saved: &CudaBuf, what: GeluSaved, pre_bias: Span, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        self.matmul_backward_impl(dinp, dparams, dout, inp, Some((saved, Some(pre_bias), what)), params, w, bias, rows, ic, oc)
    }

    fn layernorm_forward(&self, out: &mut CudaBuf, mean: &mut CudaBuf, rstd: &mut CudaBuf, inp: &CudaBuf, params: &CudaBuf, w: Span, b: Span, rows: usize, c: usize) -> BResult<()> {
        self.layernorm_forward_impl(out, mean, rstd, inp, params, w, b, rows, c)
    }

    fn layernorm_backward(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, dresidual: Option<&CudaBuf>, inp: &CudaBuf, mean: &CudaBuf, rstd: &CudaBuf, params: &CudaBuf, w: Span, b: Span, rows: usize, c: usize, dinp_sum: Option<Span>) -> BResult<()> {
        self.layernorm_backward_impl(dinp, dparams, dout, dresidual, inp, mean, rstd, params, w, b, rows, c, dinp_sum)
    }

    fn attention_forward(&self, out: &mut CudaBuf, probs: &mut CudaBuf, qkv: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        self.attention_forward_impl(out, probs, qkv, b, n, h, d)
    }

    fn attention_backward(&self, dqkv: &mut CudaBuf, dout: &CudaBuf, qkv: &CudaBuf, out: &CudaBuf, probs: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        self.attention_backward_impl(dqkv, None, dout, qkv, out, probs, b, n, h, d)
    }

    fn attention_backward_bias(&self, dqkv: &mut CudaBuf, dparams: &mut CudaBuf, bias: Span, dout: &CudaBuf, qkv: &CudaBuf, out: &CudaBuf, probs: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        self.attention_backward_bias_impl(dqkv, dparams, bias, dout, qkv, out, probs, b, n, h, d)
    }

    fn class_attention_forward(&self, out: &mut CudaBuf, q: &CudaBuf, kv: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        self.class_attention_forward_impl(out, q, kv, b, n, h, d)
    }

    fn class_attention_backward(&self, dq: &mut CudaBuf, dkv: &mut CudaBuf, dparams: &mut CudaBuf, kv_bias: Option<Span>, dout: &CudaBuf, q: &CudaBuf, kv: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        self.class_attention_backward_impl(dq, dkv, dparams, kv_bias, dout, q, kv, b, n, h, d)
    }

    fn add_class_rows(&self, dst: &mut CudaBuf, src: &CudaBuf, b: usize, n: usize, c: usize) -> BResult<()> {
        self.add_class_rows_impl(dst, src, b, n, c)
    }

    fn attention_saved_len(&self, b: usize, n: usize, h: usize, d: usize) -> usize {
        self.attention_saved_len_impl(b, n, h, d)
    }

    fn add(&self, out: &mut CudaBuf, a: &CudaBuf, b: &CudaBuf) -> BResult<()> {
        self.add_impl(out, a, b)
    }

    fn scale_rows(&self, out: &mut CudaBuf, residual: Option<&CudaBuf>, y: &CudaBuf, scales: &CudaBuf, scale_off: usize, rows: usize, rows_per_image: usize, c: usize) -> BResult<()> {
        self.scale_rows_impl(out, residual, y, scales, scale_off, rows, rows_per_image, c)
    }

    fn lerp(&self, dst: &mut CudaBuf, dst_off: usize, src: &CudaBuf, src_off: usize, len: usize, weight: f32) -> BResult<()> {
        self.lerp_impl(dst, dst_off, src, src_off, len, weight)
    }

    fn copy_span(&self, dst: &mut CudaBuf, dst_off: usize, src: &CudaBuf, src_off: usize, len: usize) -> BResult<()> {
        self.copy_span_impl(dst, dst_off, src, src_off, len)
    }

    fn copy_strided(&self, dst: &mut CudaBuf, src: &CudaBuf, copy: &StridedCopy) -> BResult<()> {
        self.copy_strided_impl(dst, src, copy)
    }

    fn add_span(&self, dst: &mut CudaBuf, dst_off: usize, src: &CudaBuf, src_off: usize, len: usize) -> BResult<()> {
        self.add_span_impl(dst, dst_off, src, src_off, len)
    }

    fn pool_forward(&self, out: &mut CudaBuf, inp: &CudaBuf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        self.pool_forward_impl(out, inp, b, n, c, prefix, avg)
    }

    fn pool_backward(&self, dinp: &mut CudaBuf, dout: &CudaBuf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        self.pool_backward_impl(dinp, dout, b, n, c, prefix, avg)
    }

    fn cross_entropy(&self, losses: &mut CudaBuf, dlogits: Option<&mut CudaBuf>, logits: &CudaBuf, targets: &CudaBuf, b: usize, k: usize, dloss_scale: f32) -> BResult<()> {
        self.cross_entropy_impl(losses, dlogits, logits, targets, b, k, dloss_scale)
    }

    fn sum_squares(&self, buf: &CudaBuf, inf_from: f32) -> BResult<f64> {
        self.sum_squares_impl(buf, inf_from)
    }

    fn sum_squares_spans(&self, buf: &CudaBuf, spans: &[Span], inf_from: f32) -> BResult<f64> {
        self.sum_squares_spans_impl(buf, spans, inf_from)
    }

    fn optimizer_step_pieces(&self, params: &mut CudaBuf, grads: &CudaBuf, state: &mut CudaBuf, pieces: &[(Span, usize)], opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        self.optimizer_step_pieces_impl(params, grads, state, pieces, opt, decay, hyper)
    }

    fn optimizer_step_shard(&self, state: &mut CudaBuf, grads: &CudaBuf, compute: &mut CudaBuf, pieces: &[ShardPiece], opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        self.optimizer_step_shard_impl(state, grads, compute, pieces, opt, decay, hyper)
    }

    fn optimizer_step_master(&self, master: &mut CudaBuf, grads: &CudaBuf, state: &mut CudaBuf, pieces: &[ShardPiece], opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        self.optimizer_step_master_impl(master, grads, state, pieces, opt, decay, hyper)
    }

    fn peak_bytes(&self) -> Option<u64> {
        Some(Cuda::peak_bytes(self) as u64)
    }

    fn reset_peak_bytes(&self) {
        self.reset_peak();
    }

    fn scale(&self, buf: &mut CudaBuf, s: f32) -> BResult<()> {
        self.scale_impl(buf, s)
    }

    fn optimizer_step(&self, params: &mut CudaBuf, grads: &CudaBuf, state: &mut CudaBuf, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        self.optimizer_step_impl(params, grads, state, None, opt, decay, hyper)
    }

    /// The update kernels write the 16-bit compute copy as they go: no separate cast pass.
    fn optimizer_step_cast(&self, params: &mut CudaBuf, grads: &CudaBuf, state: &mut CudaBuf, compute: &mut CudaBuf, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        self.optimizer_step_cast_impl(params, grads, state, compute, opt, decay, hyper)
    }
}
