//! Dense layers: the linear forward (plain, with the residual add, with the GELU), its three
//! backward forms, the GELU passes, the Hopper fused GEMM kernels (`kernels/hopper.cu`) and
//! the TMA tensor maps they read through, and the cuBLASLt calls every layer's products go
//! through (`gemm`, `gemm_c`).

use std::ffi::c_void;
use std::sync::atomic::Ordering;

use cudarc::driver::sys::CUdeviceptr;

use super::device::{check_bf16, check_f32, check_len, check_span, dev, kargs, CudaBuf};
use super::gemm::{alignment, GemmShape, Ty};
use super::options::WideTiles;
use super::Cuda;
use crate::backend::{BResult, Backend, BackendError, GeluSaved, Span};

/// Dynamic shared memory of the Hopper GEMM kernels (HW_SMEM in hopper.cu: a 4-stage ring of two
/// 128×64 bf16 tiles, two 128×136 bf16 staging tiles, 2 × 8 × 128 f32 column sums, 12 barriers,
/// 1 KiB of alignment slack).
const HOPPER_GEMM_SMEM: u32 = 4 * 32768 + 2 * 128 * 136 * 2 + 2 * 8 * 128 * 4 + 96 + 1024;

/// The same for the 128×256-tile kernels (HX_SMEM: a 3-stage ring of a 128×64 and a 256×64
/// tile, the rest as above).
const HOPPER_GEMM_SMEM_WIDE: u32 = 3 * 49152 + 2 * 128 * 136 * 2 + 2 * 8 * 128 * 4 + 96 + 1024;

/// The same for the 128×256-tile kernels with the deep ring (HX4_SMEM: a 4-stage ring of a
/// 128×64 and a 256×64 tile, one 128×128 bf16 staging tile, 12 barriers, 1 KiB of alignment
/// slack).
const HOPPER_GEMM_SMEM_WIDE4: u32 = 4 * 49152 + 128 * 128 * 2 + 96 + 1024;

/// Dynamic shared memory of the weight-gradient kernel (WGR_SMEM in hopper_wgrad.cu: a 4-stage
/// ring of a 128×64 and a 256×64 bf16 tile, 1 KiB of ones, 8 barriers, 1 KiB of alignment
/// slack).
const WGRAD_SMEM: u32 = 4 * 49152 + 1024 + 64 + 1024;

/// How many chunks `gemm_wgrad_tt` cuts the K range of each of its `tiles` output tiles into
/// (`kt` K steps of 64 rows each), on `sms` SMs: the count that makes the busiest block's
/// work least, counted in K steps plus two per unit for its reduction into dW (the smallest
/// count among equals: fewer reductions). ViT-H/14 at micro 64, fc1's dW: 200 tiles of 257
/// steps on 132 SMs take 2 × 259 steps as they are, 11 × 39 in 7 chunks.
fn wgrad_splits(tiles: usize, kt: usize, sms: usize) -> usize {
    let sms = sms.max(1);
    (1..=kt.clamp(1, 64)).min_by_key(|&s| (tiles * s).div_ceil(sms) * (kt.div_ceil(s) + 2)).unwrap_or(1)
}

/// How a Hopper GEMM kernel is launched: the kernel (`base`, with `_w` for 128×256 tiles), its
/// grid (persistent: one block per SM at most, or as many clusters as run at once), block size,
/// dynamic shared memory, tile width, cluster size (2: the wide kernels' blocks in pairs
/// sharing their B tile; 1: none) and how many rows of column partial sums the input-gradient
/// kernel writes per 128-row tile (4 with the deep ring: one per epilogue warp).
struct HopperLaunch {
    name: String,
    grid: u32,
    threads: u32,
    smem: u32,
    bn: usize,
    cluster: u32,
    partial_rows_per_tile: usize,
}

/// A linear layer's forward product. Row-major out(R, OC) = inp(R, IC)·Wᵀ  ⇔  column-major
/// outᵀ(OC×R) = Wᵀ·inpᵀ with W read as column-major IC×OC (ld IC) transposed, inp as IC×R
/// (ld IC). `accumulate`: beta = 1 (C read from the residual buffer).
fn linear_shape(rows: usize, ic: usize, oc: usize, bias: bool, accumulate: bool) -> GemmShape {
    GemmShape {
        ta: true, tb: false, m: oc as u64, n: rows as u64, k: ic as u64,
        a_ty: Ty::Half, b_ty: Ty::Half, d_ty: Ty::Half,
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
pub(super) fn tensor_map_3d(ptr: CUdeviceptr, cols: usize, rows: usize, batches: usize, box_rows: u32) -> BResult<cudarc::driver::sys::CUtensorMap> {
    tensor_map(ptr, &[cols, rows, batches], &[64, box_rows, 1])
}

/// `tensor_map_3d` with boxes of 16 columns (32 bytes) and the 32-byte swizzle: the columns
/// past 64 of a head of 80, which the wgmma kernels keep in tiles of their own.
pub(super) fn tensor_map_3d_cols16(ptr: CUdeviceptr, cols: usize, rows: usize, batches: usize, box_rows: u32) -> BResult<cudarc::driver::sys::CUtensorMap> {
    tensor_map_swizzled(ptr, &[cols, rows, batches], &[16, box_rows, 1], cudarc::driver::sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_32B)
}

/// A tensor map over a dense bf16 tensor of `dims` (innermost first), boxes of `boxes`, 128-byte
/// swizzle, elements outside the tensor read as zeros.
fn tensor_map<const R: usize>(ptr: CUdeviceptr, dims: &[usize; R], boxes: &[u32; R]) -> BResult<cudarc::driver::sys::CUtensorMap> {
    tensor_map_swizzled(ptr, dims, boxes, cudarc::driver::sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B)
}

/// `tensor_map` with the given swizzle (the box's row of bytes at most its width).
fn tensor_map_swizzled<const R: usize>(ptr: CUdeviceptr, dims: &[usize; R], boxes: &[u32; R], swizzle: cudarc::driver::sys::CUtensorMapSwizzle) -> BResult<cudarc::driver::sys::CUtensorMap> {
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
            swizzle,
            cu::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != cu::CUresult::CUDA_SUCCESS {
        return Err(BackendError::Device(format!("cuTensorMapEncodeTiled (bf16 {dims:?}, boxes {boxes:?}): {r:?}")));
    }
    Ok(map)
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

impl Cuda {
    /// Whether the Hopper GEMM kernel (`kernels/hopper.cu`) takes a (rows × ic)·(oc × ic)ᵀ
    /// product: chosen (`set_fused_gemm`), compiled (sm_90), oc % 128 == 0,
    /// ic % 64 == 0, 16-byte aligned operands (`ptrs`) and bias (0 = none).
    fn fused_gemm_ok(&self, rows: usize, ic: usize, oc: usize, ptrs: &[CUdeviceptr], bias: CUdeviceptr) -> bool {
        self.knobs.fused_gemm.load(Ordering::Relaxed)
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

    /// Launch shape of a Hopper GEMM kernel for `rows` × `n` outputs of depth `k` (`HopperLaunch`).
    fn hopper_gemm_shape(&self, base: &'static str, rows: usize, n: usize, k: usize, bwd: bool) -> BResult<HopperLaunch> {
        let mode = self.knobs.wide_tiles(bwd);
        // Each block walks its tiles in turn, so a kernel lasts about ceil(tiles / SMs) tiles;
        // a 128×256 tile costs less than two 128×128 ones, but with few row tiles (micro 16:
        // 2.3 waves of wide tiles against 4.5) the last wave's idle blocks cost more than the
        // wide tiles save.
        let waves = |bn: usize| (rows.div_ceil(128) * (n / bn)).div_ceil(self.info.multiprocessors.max(1) as usize);
        let wide = n % 256 == 0
            && match mode {
                WideTiles::Off => false,
                WideTiles::Always => true,
                WideTiles::Auto => 18 * waves(256) < 10 * waves(128),
            };
        let deep = wide && self.knobs.gemm_ring().deep_at(k);
        let partial_rows_per_tile = if deep { 4 } else { 1 };
        let (name, threads, smem, bn) = if deep {
            (format!("{base}_w4"), 512, HOPPER_GEMM_SMEM_WIDE4, 256)
        } else if wide {
            // (the input gradient's wide kernel has one epilogue warpgroup, the forward's two)
            (format!("{base}_w"), if bwd { 512 } else { 640 }, HOPPER_GEMM_SMEM_WIDE, 256)
        } else {
            (base.to_string(), 544, HOPPER_GEMM_SMEM, 128)
        };
        let tiles = rows.div_ceil(128) * (n / bn);
        if wide && self.gemm_cluster() {
            // clusters of two: one per pair of row tiles and column tile, as many as run at once
            let fit = self.max_active_clusters(&name, threads, smem, 2)? as usize;
            if fit > 0 {
                let clusters = fit.min(rows.div_ceil(256) * (n / bn)).max(1);
                return Ok(HopperLaunch { name, grid: 2 * clusters as u32, threads, smem, bn, cluster: 2, partial_rows_per_tile });
            }
        }
        let grid = (self.info.multiprocessors as usize).min(tiles).max(1) as u32;
        Ok(HopperLaunch { name, grid, threads, smem, bn, cluster: 1, partial_rows_per_tile })
    }

    /// Launches a Hopper GEMM kernel as `hopper_gemm_shape` chose.
    fn launch_hopper_gemm(&self, l: &HopperLaunch, args: &mut [*mut c_void]) -> BResult<()> {
        self.launch_clustered(&l.name, (l.grid, 1, 1), (l.threads, 1, 1), l.smem, l.cluster, args)
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
            a_ty: Ty::Half, b_ty: Ty::Half, d_ty: Ty::Half,
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_forward_impl(&self, out: &mut CudaBuf, gelu: Option<(&mut CudaBuf, GeluSaved)>, inp: &CudaBuf, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
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
                    let l = self.hopper_gemm_shape(base, rows, oc, ic, false)?;
                    let ta = tensor_map_2d(inp.ptr, ic, rows, 128)?;
                    // (in a cluster each block copies its share of the B tile's rows)
                    let tb = tensor_map_2d(w_ptr, ic, oc, (l.bn / l.cluster as usize) as u32)?;
                    return self.launch_hopper_gemm(&l, &mut kargs![out.ptr, pre.ptr, ta, tb, bias_ptr, m, n, k]);
                }
                // the plain product (no bias epilogue: faster), the bias joins in the GELU pass
                self.gemm(OP, linear_shape(rows, ic, oc, false, false), params.at(w.off), inp.ptr, pre.ptr, 0, 1.0, 0.0)?;
                self.gelu_fwd_launch(out.ptr, pre.ptr, bias_ptr, rows, oc, what == GeluSaved::Grad)
            }
            None => self.gemm(OP, linear_shape(rows, ic, oc, bias.is_some(), false), params.at(w.off), inp.ptr, out.ptr, bias_ptr, 1.0, 0.0),
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_forward_residual_impl(&self, out: &mut CudaBuf, residual: &CudaBuf, inp: &CudaBuf, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        const OP: &str = "matmul_forward_residual";
        let bias_ptr = self.check_linear(OP, out, inp, params, w, bias, rows, ic, oc)?;
        check_bf16(OP, "residual", residual)?;
        check_len(OP, "residual", residual, rows * oc)?;
        // beta = 1 with C = the residual (out's layout): cuBLASLt adds it before the bias
        // epilogue, in f32, and rounds once to bf16.
        self.gemm_c(OP, linear_shape(rows, ic, oc, bias.is_some(), true), params.at(w.off), inp.ptr, residual.ptr, out.ptr, bias_ptr, 1.0, 1.0)
    }

    pub(super) fn gelu_forward_impl(&self, out: &mut CudaBuf, pre: &CudaBuf, params: &CudaBuf, pre_bias: Option<Span>, rows: usize, cols: usize) -> BResult<()> {
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

    pub(super) fn gelu_saves_grad_impl(&self, rows: usize, ic: usize, oc: usize) -> bool {
        // Where both Hopper kernels run (the shape and alignment tests of fused_gemm_ok, with
        // the model's 16-byte aligned buffers): the forward's epilogue evaluates the derivative
        // beside the GELU almost for free, and the input-gradient kernel, whose epilogue set its
        // pace, only multiplies.
        // fc2's input gradient is the same (rows × ic)·(oc × ic)ᵀ shape seen from the other side,
        // so one test covers both. The generic path gains nothing from it and keeps pre.
        self.knobs.fused_gemm_bwd.load(Ordering::Relaxed) && self.fused_gemm_ok(rows, ic, oc, &[], 0)
    }

    /// `matmul_backward`; `dgelu = Some((saved, pre_bias, what))` applies the GELU gradient to
    /// dinp from what the forward saved (pre, or the derivative itself: `what`) and, with
    /// `pre_bias`, adds dinp's column sums into that span from the same pass.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_backward_impl(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, inp: &CudaBuf, dgelu: Option<(&CudaBuf, Option<Span>, GeluSaved)>, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        const OP: &str = "matmul_backward";
        check_bf16(OP, "dinp", dinp)?;
        check_bf16(OP, "params (the compute copy)", params)?;
        check_len(OP, "dinp", dinp, rows * ic)?;
        check_weight_grads(OP, dparams, dout, inp, params, w, rows, ic, oc)?;
        // dinp(R, IC) = dout(R, OC)·W(OC, IC)  ⇔  dinpᵀ(IC×R) = W(IC×OC, ld IC)·doutᵀ(OC×R, ld OC).
        let s = GemmShape {
            ta: false, tb: false, m: ic as u64, n: rows as u64, k: oc as u64,
            a_ty: Ty::Half, b_ty: Ty::Half, d_ty: Ty::Half,
            lda: ic as i64, ldb: oc as i64, ldd: ic as i64,
            batch: 1, stride_a: 0, stride_b: 0, stride_d: 0,
            bias: false, accumulate: false, align: 0,
        };
        if let Some((_, None, GeluSaved::Grad)) = dgelu {
            return Err(BackendError::Shape { op: OP, msg: "a saved GELU derivative needs the pre-activation's bias span".into() });
        }
        let fused = match dgelu {
            Some((pre, Some(pb), _)) if pb.len == ic && pre.len >= rows * ic && self.knobs.fused_gemm_bwd.load(Ordering::Relaxed) => self.fused_gemm_ok(rows, oc, ic, &[dinp.ptr, pre.ptr, dout.ptr, params.at(w.off)], params.at(pb.off)),
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul_backward_weights_impl(&self, dparams: &mut CudaBuf, dout: &CudaBuf, inp: &CudaBuf, params: &CudaBuf, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        check_weight_grads("matmul_backward_weights", dparams, dout, inp, params, w, rows, ic, oc)?;
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
            a_ty: Ty::Half, b_ty: Ty::Half, d_ty: Ty::F32,
            lda: ic as i64, ldb: oc as i64, ldd: ic as i64,
            batch: 1, stride_a: 0, stride_b: 0, stride_d: 0,
            bias: false, accumulate: true, align: 0,
        };
        let dw = dparams.at(w.off);
        if let Some(bs) = bias {
            check_span(OP, "bias gradient", dparams, bs)?;
            if bs.len < oc {
                return Err(BackendError::Shape { op: OP, msg: format!("bias gradient span has {} elements, the layer {oc} outputs", bs.len) });
            }
        }
        if self.wgrad_kernel_ok(rows, ic, oc, &[dw, dout.ptr, inp.ptr]) {
            // (the kernel adds the bias gradient from the dout tiles it multiplies)
            return self.wgrad_kernel(dw, bias.map_or(0, |bs| dparams.at(bs.off)), dout, inp, rows, ic, oc);
        }
        self.gemm("matmul_backward (dW)", s, inp.ptr, dout.ptr, dw, 0, 1.0, 1.0)?;
        if let Some(bs) = bias {
            self.add_column_sums(dparams.at(bs.off), dout, rows, oc)?;
        }
        Ok(())
    }

    /// Whether `gemm_wgrad_tt` (`kernels/hopper_wgrad.cu`) takes dW(oc × ic) += doutᵀ·inp over
    /// `rows` rows: chosen (`set_wgrad_gemm`), compiled (sm_90), both widths multiples of 64,
    /// 16-byte aligned operands and dW (`ptrs`).
    fn wgrad_kernel_ok(&self, rows: usize, ic: usize, oc: usize, ptrs: &[CUdeviceptr]) -> bool {
        self.wgrad_kernel_applies(rows, ic, oc) && ptrs.iter().all(|&p| p % 16 == 0)
    }

    /// `wgrad_kernel_ok` before the operands are known (`Backend::bias_grads_in_products`).
    pub(super) fn wgrad_kernel_applies(&self, rows: usize, ic: usize, oc: usize) -> bool {
        self.knobs.wgrad_gemm.load(Ordering::Relaxed)
            && rows > 0
            && ic > 0
            && oc > 0
            && ic % 64 == 0
            && oc % 64 == 0
            && rows.div_ceil(64) <= i32::MAX as usize
            && oc.div_ceil(128) * ic.div_ceil(256) * 64 <= i32::MAX as usize
            && self.kernels.get("gemm_wgrad_tt").is_ok()
    }

    /// dW (f32 at `dw`, oc × ic) += doutᵀ·inp through `gemm_wgrad_tt` (`wgrad_kernel_ok` holds),
    /// and with `dbias` (f32, oc values; 0: none) dbias += dout's column sums.
    #[allow(clippy::too_many_arguments)]
    fn wgrad_kernel(&self, dw: CUdeviceptr, dbias: CUdeviceptr, dout: &CudaBuf, inp: &CudaBuf, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        let tm_dout = tensor_map_2d(dout.ptr, oc, rows, 64)?;
        let tm_inp = tensor_map_2d(inp.ptr, ic, rows, 64)?;
        let sms = self.info.multiprocessors.max(1) as usize;
        let (tiles, kt) = (oc.div_ceil(128) * ic.div_ceil(256), rows.div_ceil(64));
        let splits = wgrad_splits(tiles, kt, sms);
        let grid = sms.min(tiles * splits) as u32;
        let (oc_i, ic_i, kt_i, splits_i) = (oc as i32, ic as i32, kt as i32, splits as i32);
        self.launch_dyn("gemm_wgrad_tt", (grid, 1, 1), (288, 1, 1), WGRAD_SMEM, &mut kargs![dw, dbias, tm_dout, tm_inp, oc_i, ic_i, kt_i, splits_i])
    }

    /// fc2's input gradient through the Hopper kernel: dinp = (dout·W) ⊙ gelu'(pre + bias) (or
    /// ⊙ the saved derivative) and the bias span `pb` of dparams += the column sums of dinp; W
    /// (oc × ic) is read as stored, an MN-major B operand.
    #[allow(clippy::too_many_arguments)]
    fn dgelu_gemm_fused(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, pre: &CudaBuf, what: GeluSaved, params: &CudaBuf, w: Span, pb: Span, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        let base = match what {
            GeluSaved::Pre => "gemm_dgelu_bwd_ws",
            GeluSaved::Grad => "gemm_dgelu_mul_ws",
        };
        let l = self.hopper_gemm_shape(base, rows, ic, oc, true)?;
        // f32 partial rows of the column sums: one or four per 128-row tile
        let parts = rows.div_ceil(128) * l.partial_rows_per_tile;
        let partial = self.partial_rows(parts * ic)?;
        let ta = tensor_map_2d(dout.ptr, oc, rows, 128)?;
        let tb = tensor_map_2d(params.at(w.off), ic, oc, 64)?;
        let (m, n, k) = (rows as i32, ic as i32, oc as i32);
        match what {
            GeluSaved::Pre => {
                let bias_ptr = params.at(pb.off);
                self.launch_hopper_gemm(&l, &mut kargs![dinp.ptr, pre.ptr, partial, ta, tb, bias_ptr, m, n, k])?;
            }
            // the saved derivative already holds the bias
            GeluSaved::Grad => self.launch_hopper_gemm(&l, &mut kargs![dinp.ptr, pre.ptr, partial, ta, tb, m, n, k])?,
        }
        let dst = dparams.at(pb.off);
        self.reduce_partials(dst, dst, dst, ic, partial, parts, ic)
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

    pub(super) fn gemm(&self, op: &str, s: GemmShape, a: CUdeviceptr, b: CUdeviceptr, d: CUdeviceptr, bias: CUdeviceptr, alpha: f32, beta: f32) -> BResult<()> {
        self.gemm_c(op, s, a, b, d, d, bias, alpha, beta)
    }

    /// `gemm` with C read from its own buffer (D's type and layout): D = alpha·A·B + beta·C + bias.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_c(&self, op: &str, mut s: GemmShape, a: CUdeviceptr, b: CUdeviceptr, c: CUdeviceptr, d: CUdeviceptr, bias: CUdeviceptr, alpha: f32, beta: f32) -> BResult<()> {
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

#[cfg(test)]
mod tests {
    use super::wgrad_splits;

    #[test]
    fn wgrad_splits_even_out_the_blocks() {
        // ViT-H/14 micro 64, fc1's dW on 132 SMs: 200 tiles of 257 K steps. Whole tiles take
        // two waves (2 × 259); 7 chunks take 11 rounds of 39 (the least of every count).
        assert_eq!(wgrad_splits(200, 257, 132), 7);
        let cost = |s: usize| (200 * s).div_ceil(132) * (257usize.div_ceil(s) + 2);
        assert!((1..=64).all(|s| cost(7) <= cost(s)));
        // more tiles than SMs and one K step: no split
        assert_eq!(wgrad_splits(288, 1, 132), 1);
        // never more chunks than K steps, and at least one
        for (tiles, kt) in [(1, 1), (1, 3), (9, 16), (50, 257), (5000, 2)] {
            let s = wgrad_splits(tiles, kt, 132);
            assert!((1..=kt).contains(&s), "{tiles} tiles, {kt} steps: {s}");
        }
        // a single tile of many steps is spread over the SMs
        assert!(wgrad_splits(1, 1000, 132) >= 32);
        assert_eq!(wgrad_splits(3, 10, 0), wgrad_splits(3, 10, 1));
    }
}
