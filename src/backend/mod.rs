//! The `Backend` trait: every operation the ViT needs, with explicit shapes, implemented once
//! per device. `cpu` (f32, threaded) is always built and is the reference every other backend
//! is tested against.
//!
//! Conventions, for every method:
//! - Buffers are row-major; shapes are given in the doc comment with the glossary of
//!   `model::spec` (B batch, N tokens, C width, H heads, D head dim, F MLP width, K classes).
//! - **Parameter gradients accumulate (`+=`); activation gradients overwrite (`=`).** So one
//!   zeroing of the flat gradient buffer per optimizer step makes gradient accumulation over
//!   micro-batches free.
//! - Parameters live in one flat buffer and are addressed by a [`Span`] (offset, length) into
//!   it; their gradients live at the same spans in the flat gradient buffer.
//! - Methods return `Result` so device backends can report failed launches; the CPU backend
//!   only fails on shape mismatches, which are bugs, reported as errors rather than panics.

pub mod cpu;
pub mod cuda;
pub mod half;

use crate::core::OptimizerConfig;
// The shared vocabulary the trait's signatures use, under the paths callers know.
pub use crate::core::{optimizer_state_len, ParamGroup, ParamGroups, Span, StepHyper};

/// The smallest magnitude an f32 value rounds to infinity at in fp16 (round to nearest even:
/// 65504 is fp16's largest finite value, 65520 lies halfway to the next power of two). The fp16
/// overflow check counts a gradient this large as infinite, as DeepSpeed's fp16 engine, whose
/// gradients are fp16 tensors, would hold it.
pub const FP16_INF_FROM: f32 = 65520.0;

/// What the MLP's fc1 forward keeps for the GELU backward (`matmul_forward` with a GELU,
/// `matmul_backward_gelu_bias`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GeluSaved {
    /// The product without the bias (`pre`): the backward evaluates gelu'(pre + bias), and the
    /// GELU output can be regenerated from it (`gelu_forward`).
    Pre,
    /// The derivative gelu'(pre + bias) itself, evaluated in the forward next to the GELU: the
    /// backward only multiplies, and the output cannot be regenerated. On a bf16 device the
    /// derivative is rounded to bf16 before the product is (one more rounding than `Pre`).
    Grad,
}

/// Errors a backend reports.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{op}: {msg}")]
    Shape { op: &'static str, msg: String },
    #[error("{0}")]
    Device(String),
}

pub type BResult<T> = Result<T, BackendError>;

/// One piece of a ZeRO rank's shard whose master weights the rank keeps apart from the
/// whole buffers (`Backend::optimizer_step_shard`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardPiece {
    /// Its span of the flat gradient and compute-copy buffers.
    pub span: Span,
    /// Offset of its optimizer state in the compact state (laid out as `optimizer_step_pieces`).
    pub state_off: usize,
    /// Offset of its f32 master weights in the same compact buffer.
    pub master_off: usize,
}

/// A strided copy of rows of `len` values, for every index `(i0, i1, i2)` below `count`:
/// `dst[dst_off + Σ ik·dst_stride[k] ..][..len] = src[src_off + Σ ik·src_stride[k] ..][..len]`
/// (`Backend::copy_strided`; sequence parallelism's token/head permutations).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StridedCopy {
    pub count: [usize; 3],
    pub len: usize,
    pub src_off: usize,
    pub src_stride: [usize; 3],
    pub dst_off: usize,
    pub dst_stride: [usize; 3],
}

impl StridedCopy {
    /// Rows copied (`count`'s product).
    pub fn rows(&self) -> usize {
        self.count.iter().product()
    }

    /// One past the last element read (`src`) or written (`dst`); 0 when nothing is copied.
    pub fn extent(&self, off: usize, stride: [usize; 3]) -> usize {
        if self.rows() == 0 || self.len == 0 {
            return 0;
        }
        off + (0..3).map(|k| (self.count[k] - 1) * stride[k]).sum::<usize>() + self.len
    }

    /// Checks both extents against the buffers' lengths (`Backend::copy_strided`'s error).
    pub fn check(&self, dst_len: usize, src_len: usize) -> BResult<()> {
        let (d, s) = (self.extent(self.dst_off, self.dst_stride), self.extent(self.src_off, self.src_stride));
        if d > dst_len || s > src_len {
            return Err(BackendError::Shape { op: "copy_strided", msg: format!("{self:?} reaches {s} of src ({src_len} values) and {d} of dst ({dst_len} values)") });
        }
        Ok(())
    }

    /// Every row as (src offset, dst offset), in order.
    pub fn row_offsets(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let [c0, c1, c2] = self.count;
        (0..c0).flat_map(move |i0| (0..c1).flat_map(move |i1| (0..c2).map(move |i2| {
            let at = |off: usize, st: [usize; 3]| off + i0 * st[0] + i1 * st[1] + i2 * st[2];
            (at(self.src_off, self.src_stride), at(self.dst_off, self.dst_stride))
        })))
    }

    /// The copy over host slices (the CPU backend, and the fallback of backends without a
    /// kernel for it).
    pub fn apply(&self, dst: &mut [f32], src: &[f32]) -> BResult<()> {
        self.check(dst.len(), src.len())?;
        if self.len > 0 {
            for (s, d) in self.row_offsets() {
                dst[d..d + self.len].copy_from_slice(&src[s..s + self.len]);
            }
        }
        Ok(())
    }
}

/// One device's implementation of every op. See the module doc for the conventions.
pub trait Backend: Send + Sync {
    /// A device buffer of elements (f32 on the CPU).
    type Buf: Send + Sync;

    /// A point on the device's timeline (`train::timeline`): a timing event on a GPU's compute
    /// stream, the host clock on the CPU (whose ops are done when they return).
    type Mark: Send;

    /// Short name for logs ("cpu", "cuda:0 NVIDIA H200").
    fn name(&self) -> String;

    // ---- the device timeline ------------------------------------------------------------
    /// A new mark, not yet recorded.
    fn new_mark(&self) -> BResult<Self::Mark>;
    /// Records `mark` after the work enqueued so far (the device reaches it when that work is done).
    fn record_mark(&self, mark: &mut Self::Mark) -> BResult<()>;
    /// Seconds from `a` to `b` on the device's timeline (both recorded, `a` first); waits until
    /// the device has reached `b`.
    fn seconds_between(&self, a: &Self::Mark, b: &Self::Mark) -> BResult<f64>;
    /// The device's dense matrix rate in TFLOP/s, the MFU ceiling (`vitscale bench` measures the
    /// same one): measured once per process. None where MFU is not reported (the CPU).
    fn matrix_ceiling_tflops(&self) -> BResult<Option<f64>> {
        Ok(None)
    }

    // ---- memory -------------------------------------------------------------------------
    /// A zero-filled buffer of `len` elements in the compute dtype (activations, their
    /// gradients, the compute copy of the weights): f32 on the CPU, bf16 or fp16 on a GPU
    /// (`half`).
    fn alloc(&self, len: usize) -> BResult<Self::Buf>;
    /// A zero-filled f32 buffer: master weights, parameter gradients, optimizer state, losses,
    /// targets.
    fn alloc_f32(&self, len: usize) -> BResult<Self::Buf>;
    /// Whether this backend computes in fp16 although the run has no fp16 block (a GPU before
    /// Ampere, `backend::half::choose`): the trainer then runs DeepSpeed's default dynamic loss
    /// scaler, as `"fp16": {"enabled": true}` would.
    fn implicit_fp16(&self) -> bool {
        false
    }
    /// Whether the forward pass needs a compute-dtype copy of the f32 master weights (false
    /// when the compute dtype is f32: the master buffer is used directly).
    fn needs_compute_copy(&self) -> bool {
        false
    }
    /// `dst = src` converting between the buffers' dtypes (master → compute copy).
    fn cast(&self, dst: &mut Self::Buf, src: &Self::Buf) -> BResult<()>;
    fn len(&self, buf: &Self::Buf) -> usize;
    /// Peak bytes of memory this backend has held and what the figure counts, for the step
    /// metrics; None when the backend keeps no count (the metrics then report the process's
    /// peak resident set).
    fn peak_memory(&self) -> Option<(u64, &'static str)> {
        None
    }
    /// Copies host f32 data into `dst[off..off + src.len()]`.
    fn upload(&self, dst: &mut Self::Buf, off: usize, src: &[f32]) -> BResult<()>;
    /// Copies a batch input (images, targets) into `dst[..src.len()]` without waiting for it:
    /// a device backend converts into pinned staging memory and copies on its own stream,
    /// ordered before every kernel launched afterwards, while earlier work keeps running. The
    /// caller guarantees that no queued work still reads `dst` (the model's inputs are read
    /// only by the forward, whose loss was read back before the next batch is staged).
    fn upload_input(&self, dst: &mut Self::Buf, src: &[f32]) -> BResult<()> {
        self.upload(dst, 0, src)
    }
    /// Decodes images `range` of an encoded batch (`data.decode = "gpu"`) into `dst` as
    /// (B, 3, S, S) normalized images, under `upload_input`'s contract (no waiting, ordered
    /// before later kernels). A backend without a decoder refuses.
    fn decode_input(&self, _dst: &mut Self::Buf, batch: &crate::core::encoded::EncodedBatch, range: std::ops::Range<usize>) -> BResult<()> {
        let first = batch.images.get(range.start).map_or("(none)", |i| i.source.as_str());
        Err(BackendError::Device(format!(
            "data.decode = \"gpu\": the {} backend has no image decoder ({} images, the first {first}); set data.decode = \"cpu\" or \"auto\"",
            self.name(),
            range.len()
        )))
    }
    /// Starts decoding images `range` of an encoded batch that is staged after the next one,
    /// so that the decode has a whole step to run beside the device's work; `decode_input` of
    /// the same images then only finishes it. Any other `decode_input` in between drops it
    /// (the batch is then decoded in full when it is staged). A backend that decodes nothing
    /// ahead ignores it.
    fn decode_ahead(&self, _batch: &crate::core::encoded::EncodedBatch, _range: std::ops::Range<usize>) -> BResult<()> {
        Ok(())
    }
    /// Whether `decode_ahead` does anything: the trainer then takes one micro-batch more from
    /// the loader ahead of the step.
    fn decodes_ahead(&self) -> BResult<bool> {
        Ok(false)
    }
    /// Times each later `upload_input` copy on the device where it runs (a GPU's copy stream),
    /// for traces; off by default (the timing events cost a little per copy).
    fn time_input_copies(&self, _on: bool) -> BResult<()> {
        Ok(())
    }
    /// The input copies timed since the last call: (what, start, end) in seconds since `epoch`
    /// on the host clock (waits for the last of them). Empty where copies are not timed or are
    /// the host's own (the CPU).
    fn take_input_copies(&self, _epoch: std::time::Instant) -> BResult<Vec<(String, f64, f64)>> {
        Ok(Vec::new())
    }
    /// Copies the whole buffer to the host as f32.
    fn download(&self, src: &Self::Buf) -> BResult<Vec<f32>>;
    /// The buffer's values in place, where the backend keeps them as f32 in this process's
    /// memory (the CPU backend); `None` for device memory. Host-side code (the
    /// sequence-parallel exchanges) then reads and writes them without `download`/`upload`
    /// copies.
    fn host_view<'a>(&self, _buf: &'a Self::Buf) -> Option<&'a [f32]> {
        None
    }
    /// `host_view`, writable.
    fn host_view_mut<'a>(&self, _buf: &'a mut Self::Buf) -> Option<&'a mut [f32]> {
        None
    }
    fn fill(&self, buf: &mut Self::Buf, value: f32) -> BResult<()>;
    /// `dst = src` (same length).
    fn copy(&self, dst: &mut Self::Buf, src: &Self::Buf) -> BResult<()>;
    /// Waits for all queued work (no-op on the CPU).
    fn synchronize(&self) -> BResult<()>;

    /// Brackets a model backward: while `defer` is set the backend may hold back part of the
    /// gradient accumulation and issue it later in fewer launches (the CUDA backend queues its
    /// bias and LayerNorm-parameter reductions); `false` issues what was held back. Whatever
    /// reads or overwrites a buffer (download, copy, fill, scale, the optimizer…) issues it too.
    fn defer_gradient_sums(&self, _defer: bool) -> BResult<()> {
        Ok(())
    }
    /// The forward has enqueued its last read of the staged inputs (images, targets): a later
    /// `upload_input` may overwrite them once the device gets there. A device whose compute
    /// runs behind the host orders the next upload after this point.
    fn inputs_consumed(&self) -> BResult<()> {
        Ok(())
    }

    // ---- embedding ----------------------------------------------------------------------
    /// Cuts images into flattened patches, each in (channel, row, col) order so that a patch
    /// times the conv weight `[C, 3, P, P]` read as `(C, 3·P·P)` is the convolution.
    /// `img` (B, 3, S, S) → `out` (B·NP, 3·P·P).
    fn patchify(&self, out: &mut Self::Buf, img: &Self::Buf, b: usize, chans: usize, size: usize, patch: usize) -> BResult<()>;

    /// Builds the token sequence: `out[b, 0] = cls + pos[0]` (when `cls` is given), then
    /// `out[b, prefix + p] = patches[b, p] + pos[prefix + p]`.
    /// `patches` (B·NP, C), `pos` (N, C), `cls` (C) → `out` (B·N, C).
    #[allow(clippy::too_many_arguments)]
    fn embed_forward(&self, out: &mut Self::Buf, patches: &Self::Buf, params: &Self::Buf, pos: Span, cls: Option<Span>, b: usize, np: usize, c: usize) -> BResult<()>;
    /// Backward of `embed_forward`: `dpatches =`, `dpos +=`, `dcls +=`.
    #[allow(clippy::too_many_arguments)]
    fn embed_backward(&self, dpatches: &mut Self::Buf, dparams: &mut Self::Buf, dout: &Self::Buf, pos: Span, cls: Option<Span>, b: usize, np: usize, c: usize) -> BResult<()>;

    // ---- dense layers -------------------------------------------------------------------
    /// `out = inp · Wᵀ + bias`, W (OC, IC) as stored by timm's `nn.Linear`.
    /// `inp` (R, IC) → `out` (R, OC). With `gelu = Some((saved, what))`, `out = gelu(pre +
    /// bias)` (erf GELU): the MLP's fc1, where pre is the product *without* the bias, and
    /// `saved` receives pre (`GeluSaved::Pre`) or gelu'(pre + bias) (`GeluSaved::Grad`) for
    /// the backward. The bias joins in the GELU passes (`gelu_forward`,
    /// `matmul_backward_gelu_bias` take its span) because a device GEMM with a bias epilogue
    /// runs slower than the plain product on cuBLASLt.
    #[allow(clippy::too_many_arguments)]
    fn matmul_forward(&self, out: &mut Self::Buf, gelu: Option<(&mut Self::Buf, GeluSaved)>, inp: &Self::Buf, params: &Self::Buf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()>;
    /// `out = residual + inp · Wᵀ + bias`: a block's projection and its residual add in one
    /// pass (a device backend folds the add into the GEMM epilogue, saving a read and a write
    /// of the residual stream). Its backward is `matmul_backward`; the residual's gradient is
    /// `dout` itself.
    #[allow(clippy::too_many_arguments)]
    fn matmul_forward_residual(&self, out: &mut Self::Buf, residual: &Self::Buf, inp: &Self::Buf, params: &Self::Buf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()>;
    /// `out = gelu(pre + params[pre_bias])` (erf GELU, the bias broadcast over the `rows`
    /// rows of `cols` columns; no bias with None): regenerates the MLP's activation in the
    /// backward when the forward did not keep it.
    #[allow(clippy::too_many_arguments)]
    fn gelu_forward(&self, out: &mut Self::Buf, pre: &Self::Buf, params: &Self::Buf, pre_bias: Option<Span>, rows: usize, cols: usize) -> BResult<()>;
    /// Largest MLP activation (rows × hidden elements) for which the model recomputes
    /// LayerNorm outputs and the GELU output in the backward instead of keeping them per
    /// block (`model::Recompute::Auto`). 0 = never: recomputing costs the CPU real time, while
    /// a GPU running kernels this small is bound by launches, not bandwidth.
    fn recompute_below(&self) -> usize {
        0
    }
    /// What this device chose for its kernels (attention path, GEMM tiles…), named for the
    /// run's plan (`config.json`'s `"plan"."device"`). Nothing on the CPU.
    fn choices(&self) -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }
    /// Whether the MLP's forward should save gelu'(pre + bias) rather than pre
    /// (`GeluSaved::Grad`) when it keeps the GELU output, for fc1 of (rows × ic)·(oc × ic)ᵀ:
    /// on the GPU that turns the backward's erf evaluation into a multiply.
    fn gelu_saves_grad(&self, _rows: usize, _ic: usize, _oc: usize) -> bool {
        false
    }
    /// Whether `matmul_backward`'s bias gradient (`Σ_rows dout`) rides along with the weight
    /// gradient of a layer of this shape, from the operands its product reads anyway: then a
    /// model hands its bias gradients to the products rather than to another pass (a LayerNorm
    /// or attention backward's column sums). False where it would be a pass of its own.
    fn bias_grads_in_products(&self, _rows: usize, _ic: usize, _oc: usize) -> bool {
        false
    }
    /// Backward of `matmul_forward` (without the GELU; see `dgelu_pre`):
    /// `dinp = dout · W` (then `dinp *= gelu'(pre)` when `dgelu_pre` is given: the backward of
    /// the GELU that produced `inp`), `dW += doutᵀ · inp`, `dbias += Σ_rows dout`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward(&self, dinp: &mut Self::Buf, dparams: &mut Self::Buf, dout: &Self::Buf, inp: &Self::Buf, dgelu_pre: Option<&Self::Buf>, params: &Self::Buf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()>;
    /// `matmul_backward` without the input gradient: `dW += doutᵀ · inp`, `dbias += Σ_rows
    /// dout`. For a layer whose input needs none (the patch embedding reads the images).
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward_weights(&self, dparams: &mut Self::Buf, dout: &Self::Buf, inp: &Self::Buf, params: &Self::Buf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()>;
    /// `matmul_backward` with the GELU gradient of the pre-activation `pre + params[pre_bias]`
    /// (`saved` as `matmul_forward` left it: pre without the bias, or the derivative itself,
    /// as `what` says) that also adds `Σ_rows dinp` (after the GELU gradient) into
    /// `dparams[pre_bias]`: the bias gradient of the layer that produced pre (the MLP's fc1),
    /// taken from the same pass over `dinp` instead of a second read by that layer's backward
    /// (which is then called without a bias).
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward_gelu_bias(&self, dinp: &mut Self::Buf, dparams: &mut Self::Buf, dout: &Self::Buf, inp: &Self::Buf, saved: &Self::Buf, what: GeluSaved, pre_bias: Span, params: &Self::Buf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()>;

    // ---- normalization ------------------------------------------------------------------
    /// LayerNorm over the last dim (eps = `core::LN_EPS`), saving per-row mean and 1/std.
    /// `inp` (R, C) → `out` (R, C), `mean` (R), `rstd` (R).
    #[allow(clippy::too_many_arguments)]
    fn layernorm_forward(&self, out: &mut Self::Buf, mean: &mut Self::Buf, rstd: &mut Self::Buf, inp: &Self::Buf, params: &Self::Buf, w: Span, b: Span, rows: usize, c: usize) -> BResult<()>;
    /// Backward of LayerNorm: `dinp = dresidual + ∂LN/∂inp · dout` (the residual-stream
    /// gradient is folded in; `None` means zero), `dw +=`, `db +=`. With `dinp_sum`, also
    /// `dparams[dinp_sum] += Σ_rows dinp`: the bias gradient of the layer whose output gradient
    /// `dinp` is (a block's attention projection, the previous block's fc2), from the same
    /// pass instead of a second read of `dinp` by that layer's backward.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward(&self, dinp: &mut Self::Buf, dparams: &mut Self::Buf, dout: &Self::Buf, dresidual: Option<&Self::Buf>, inp: &Self::Buf, mean: &Self::Buf, rstd: &Self::Buf, params: &Self::Buf, w: Span, b: Span, rows: usize, c: usize, dinp_sum: Option<Span>) -> BResult<()>;

    // ---- attention ----------------------------------------------------------------------
    /// Multi-head self-attention core: `qkv` (B, N, 3, H, D) as timm lays it out →
    /// `out` (B, N, H·D) = softmax(q·kᵀ/√D)·v per head. `probs` is backend-defined saved
    /// state for the backward, at most max(B·H·N·N, 2·B·H·N) elements (`attention_saved_len` says how many
    /// the backend uses): the CPU backend and the CUDA GEMM path keep the probabilities
    /// (B, H, N, N); the CUDA fused path keeps only the per-row log-sum-exp (B·H·N f32).
    #[allow(clippy::too_many_arguments)]
    fn attention_forward(&self, out: &mut Self::Buf, probs: &mut Self::Buf, qkv: &Self::Buf, b: usize, n: usize, h: usize, d: usize) -> BResult<()>;
    /// Backward of `attention_forward`: `dqkv =` from `dout` (B, N, H·D), given the forward's
    /// inputs `qkv`, its output `out` (B, N, H·D) and its saved state `probs`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(&self, dqkv: &mut Self::Buf, dout: &Self::Buf, qkv: &Self::Buf, out: &Self::Buf, probs: &Self::Buf, b: usize, n: usize, h: usize, d: usize) -> BResult<()>;
    /// `attention_backward` that also adds the bias gradient of the qkv projection that produced
    /// `qkv`: `dparams[bias] += Σ_rows dqkv` (3·H·D wide), from the attention backward's own pass
    /// where the backend can (the CUDA small-head kernel sums dQ's rows and, for v, dO's rows —
    /// equal to dV's since each query's probabilities sum to 1 — and adds nothing for k, whose
    /// gradient is exactly zero) instead of a second read of dqkv by the projection's backward.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_bias(&self, dqkv: &mut Self::Buf, dparams: &mut Self::Buf, bias: Span, dout: &Self::Buf, qkv: &Self::Buf, out: &Self::Buf, probs: &Self::Buf, b: usize, n: usize, h: usize, d: usize) -> BResult<()>;
    /// Attention for the class token's query alone: `out` (B, H·D) = softmax(q·kᵀ/√D)·v per
    /// head, with `q` (B, H·D) the class tokens' queries and `kv` (B, N, 2, H, D) every token's
    /// keys and values. Under token pooling the last block's output is read at the class token
    /// alone, so that block needs no other query (the model then runs its query projection,
    /// output projection and MLP on B rows instead of B·N). Saves nothing: the backward
    /// recomputes the N scores of each head.
    #[allow(clippy::too_many_arguments)]
    fn class_attention_forward(&self, out: &mut Self::Buf, q: &Self::Buf, kv: &Self::Buf, b: usize, n: usize, h: usize, d: usize) -> BResult<()>;
    /// Backward of `class_attention_forward`: `dq =` (B, H·D) and `dkv =` (B, N, 2, H, D) from
    /// `dout` (B, H·D). With `kv_bias`, also `dparams[kv_bias] += Σ_rows dkv` (2·H·D: the key
    /// and value part of the qkv projection's bias gradient).
    #[allow(clippy::too_many_arguments)]
    fn class_attention_backward(&self, dq: &mut Self::Buf, dkv: &mut Self::Buf, dparams: &mut Self::Buf, kv_bias: Option<Span>, dout: &Self::Buf, q: &Self::Buf, kv: &Self::Buf, b: usize, n: usize, h: usize, d: usize) -> BResult<()>;
    /// `dst[i·N] += src[i]` for every image i: adds (B, C) rows into the class token's rows of
    /// `dst` (B·N, C) (the query projection's input gradient into the LayerNorm's).
    fn add_class_rows(&self, dst: &mut Self::Buf, src: &Self::Buf, b: usize, n: usize, c: usize) -> BResult<()>;
    /// Elements of the compute-dtype `probs` buffer that `attention_forward` needs for these
    /// shapes (never more than B·H·N·N). The probabilities themselves by default.
    fn attention_saved_len(&self, b: usize, n: usize, h: usize, _d: usize) -> usize {
        b * h * n * n
    }

    // ---- residual, pooling ----------------------------------------------------------------
    /// `out = a + b`, elementwise.
    fn add(&self, out: &mut Self::Buf, a: &Self::Buf, b: &Self::Buf) -> BResult<()>;
    /// Stochastic depth's per-image factor on a residual branch: for `rows` rows of width `c`,
    /// `out[r] = residual[r] + s[r / rows_per_image] · y[r]` (`s · y` without a residual), with
    /// `s` the f32 buffer `scales` read from `scale_off` (0 for a dropped image's branch, 1/keep
    /// for a kept one). `out` is distinct from both inputs.
    #[allow(clippy::too_many_arguments)]
    fn scale_rows(&self, out: &mut Self::Buf, residual: Option<&Self::Buf>, y: &Self::Buf, scales: &Self::Buf, scale_off: usize, rows: usize, rows_per_image: usize, c: usize) -> BResult<()>;
    /// `dst[dst_off + i] += weight · (src[src_off + i] − dst[dst_off + i])` for `i < len`, over f32
    /// buffers (torch's `lerp_`: the weight EMA's update, `weight` = 1 − decay).
    fn lerp(&self, dst: &mut Self::Buf, dst_off: usize, src: &Self::Buf, src_off: usize, len: usize, weight: f32) -> BResult<()>;
    /// `dst[dst_off..][..len] = src[src_off..][..len]` between f32 buffers (ZeRO-3's gathers
    /// and gradient slot). By default a `lerp` of weight 1, which returns `src` exactly for
    /// finite values.
    fn copy_span(&self, dst: &mut Self::Buf, dst_off: usize, src: &Self::Buf, src_off: usize, len: usize) -> BResult<()> {
        if len == 0 {
            return Ok(());
        }
        self.lerp(dst, dst_off, src, src_off, len, 1.0)
    }
    /// `dst[dst_off..][..len] += src[src_off..][..len]` between f32 buffers: ZeRO-3 adds a
    /// group's reduced gradient shard from the gradient slot into this rank's partitioned
    /// gradients (`model::partition`). Flushes deferred gradient sums first, as `copy_span`.
    fn add_span(&self, _dst: &mut Self::Buf, _dst_off: usize, _src: &Self::Buf, _src_off: usize, _len: usize) -> BResult<()> {
        Err(BackendError::Shape { op: "add_span", msg: format!("ZeRO stage 3 is not available on {}", self.name()) })
    }
    /// `copy`'s rows (`StridedCopy`) from `src` into `dst`, buffers of the same dtype or
    /// converted as `cast`; the rows of one call must not overlap in `dst`. By default through
    /// host views, or a download of both buffers and an upload of `dst` where the backend has
    /// none (correct, not fast: a device backend overrides it with a kernel).
    fn copy_strided(&self, dst: &mut Self::Buf, src: &Self::Buf, copy: &StridedCopy) -> BResult<()> {
        copy.check(self.len(dst), self.len(src))?;
        if let Some(s) = self.host_view(src) {
            if let Some(d) = self.host_view_mut(dst) {
                return copy.apply(d, s);
            }
        }
        let s = self.download(src)?;
        let mut d = self.download(dst)?;
        copy.apply(&mut d, &s)?;
        self.upload(dst, 0, &d)
    }
    /// Pools the token sequence `inp` (B, N, C) into `out` (B, C): token 0 (`avg = false`) or
    /// the mean of tokens `prefix..N` (`avg = true`).
    #[allow(clippy::too_many_arguments)]
    fn pool_forward(&self, out: &mut Self::Buf, inp: &Self::Buf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()>;
    /// Backward of `pool_forward`: `dinp =` (zero where the pool did not read).
    #[allow(clippy::too_many_arguments)]
    fn pool_backward(&self, dinp: &mut Self::Buf, dout: &Self::Buf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()>;

    // ---- loss ---------------------------------------------------------------------------
    /// Softmax cross-entropy against soft targets: `logits` (B, K), `targets` (B, K) rows
    /// summing to 1 (one-hot, label-smoothed or mixed). Writes `losses` (B) per row, and
    /// `dlogits = (softmax − targets) · dloss_scale` (the caller passes 1/global-batch).
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy(&self, losses: &mut Self::Buf, dlogits: Option<&mut Self::Buf>, logits: &Self::Buf, targets: &Self::Buf, b: usize, k: usize, dloss_scale: f32) -> BResult<()>;

    // ---- optimizer ----------------------------------------------------------------------
    /// Σ g² over the whole gradient buffer (for the global norm; f64 accumulation on CPU).
    /// A value of magnitude ≥ `inf_from` counts as infinite (the fp16 overflow check passes
    /// [`FP16_INF_FROM`]: a gradient that fp16 cannot hold); `f32::INFINITY` for the plain sum.
    /// Non-finite exactly when some value is inf, NaN or that large.
    fn sum_squares(&self, buf: &Self::Buf, inf_from: f32) -> BResult<f64>;
    /// `buf *= s`.
    fn scale(&self, buf: &mut Self::Buf, s: f32) -> BResult<()>;
    /// One optimizer step over the flat f32 buffers: master `params` updated in place from
    /// `grads` (each gradient multiplied by `hyper.grad_scale` first), `state` holds the
    /// optimizer's moments (see `optimizer_state_len`; zero-initialized, and for SGD the
    /// momentum buffer is set to the gradient on step 1 as torch does). Weight decay applies
    /// only to spans flagged in `decay`.
    #[allow(clippy::too_many_arguments)]
    fn optimizer_step(&self, params: &mut Self::Buf, grads: &Self::Buf, state: &mut Self::Buf, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()>;
    /// Σ g² over several spans of `buf` (f64): the gradient norm of a ZeRO shard, whose
    /// pieces are spans of the flat buffer.
    /// `inf_from` as in `sum_squares`.
    fn sum_squares_spans(&self, buf: &Self::Buf, spans: &[Span], inf_from: f32) -> BResult<f64>;
    /// `optimizer_step` restricted to pieces of the flat buffers (ZeRO: the pieces this rank
    /// owns). Each piece is (span of `params`/`grads`, offset into `state`): the piece's own
    /// optimizer state, `optimizer_state_len(opt, span.len)` elements laid out as
    /// `optimizer_step` lays out a whole buffer's (Adam: m then v of the piece). `decay` is in
    /// the coordinates of `params`. No clipping here: `hyper.clip_norm` must be 0, the caller
    /// folds the global factor into `hyper.grad_scale` (the norm spans every rank's shard).
    #[allow(clippy::too_many_arguments)]
    fn optimizer_step_pieces(&self, params: &mut Self::Buf, grads: &Self::Buf, state: &mut Self::Buf, pieces: &[(Span, usize)], opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()>;
    /// ZeRO with sharded master weights (a backend whose forward reads a compute copy): the
    /// update of `optimizer_step_pieces`, except that each piece's f32 master weights are in
    /// `state` at `master_off` instead of in a whole `params` buffer, and the updated weights
    /// are written in the compute dtype into `compute` at the piece's span (the copy every
    /// rank's forward reads, all-gathered afterwards). A backend whose forward reads the f32
    /// master weights keeps them whole and does not provide this.
    #[allow(clippy::too_many_arguments)]
    fn optimizer_step_shard(&self, _state: &mut Self::Buf, _grads: &Self::Buf, _compute: &mut Self::Buf, _pieces: &[ShardPiece], _opt: &OptimizerConfig, _decay: &ParamGroups, _hyper: StepHyper) -> BResult<()> {
        Err(BackendError::Shape { op: "optimizer_step_shard", msg: format!("{} keeps whole master weights (its forward reads them)", self.name()) })
    }
    /// ZeRO-3 (partitioned weights and gradients): the update of `optimizer_step_pieces`, with
    /// each piece's f32 weights at `master_off` of `master` (this rank's pieces back to back)
    /// instead of in a whole `params` buffer, and its gradients at the same `master_off` of
    /// `grads` (the partitioned gradients, laid out as `master`); `state_off` is into `state`.
    /// The piece's `span` (flat coordinates) says which weight-decay group it is in.
    #[allow(clippy::too_many_arguments)]
    fn optimizer_step_master(&self, _master: &mut Self::Buf, _grads: &Self::Buf, _state: &mut Self::Buf, _pieces: &[ShardPiece], _opt: &OptimizerConfig, _decay: &ParamGroups, _hyper: StepHyper) -> BResult<()> {
        Err(BackendError::Shape { op: "optimizer_step_master", msg: format!("ZeRO stage 3 is not available on {}", self.name()) })
    }
    /// Peak bytes of device memory this backend has allocated so far, where it counts them
    /// (the CUDA backend); None where memory is the host's (the CPU backend).
    fn peak_bytes(&self) -> Option<u64> {
        None
    }
    /// Starts `peak_bytes` again from what is held now (a benchmark phase's own peak).
    fn reset_peak_bytes(&self) {}
    /// `optimizer_step`, then `compute` ← `cast` of the updated weights (the compute-dtype
    /// copy the forward reads). A backend may do both in one pass over the weights.
    #[allow(clippy::too_many_arguments)]
    fn optimizer_step_cast(&self, params: &mut Self::Buf, grads: &Self::Buf, state: &mut Self::Buf, compute: &mut Self::Buf, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        self.optimizer_step(params, grads, state, opt, decay, hyper)?;
        self.cast(compute, params)
    }
}
