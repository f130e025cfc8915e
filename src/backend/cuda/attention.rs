//! Attention: the path choice (gemm, fused, and within fused the small-head, whole-head,
//! short-sequence, wgmma and key-block kernels, each with the shared memory its kernel in
//! `kernels/flash.cu`, `kernels/hopper.cu`, `kernels/hopper_flash_fwd.cu` or
//! `kernels/hopper_flash_bwd.cu` expects), the forward and backward of every path, and the
//! class-token attention of a pooled last block.

use cudarc::driver::sys::CUdeviceptr;

use super::device::{check_bf16, check_f32, check_len, check_span, kargs, CudaBuf, THREADS};
use super::gemm::{GemmShape, Ty};
use super::linear::{tensor_map_3d, tensor_map_3d_cols16};
use super::options::AttentionPath;
use super::partials::ARENA_LIMIT;
use super::Cuda;
use crate::backend::{BResult, Backend, BackendError, Span};

/// Opt-in shared memory per block on sm_90 (227 KiB).
const SHORT_BWD_SMEM_MAX: usize = 227 * 1024;

/// Head dims the tiled fused attention kernels (`FA_PIPE` in flash.cu) are compiled for: any
/// N, any head of a timm ViT up to 128 wide that is a multiple of 16.
const PIPE_HEAD_DIMS: [usize; 5] = [32, 64, 80, 96, 128];

/// Above this many tokens the tiled forward takes 128-query blocks (`flash_fwd_d{d}_pipe128`).
const LONG_QUERY_BLOCK_FROM: usize = 1024;

/// Keys per block of the tiled backward `flash_bwd_d{d}_pipe` (2 threads a key). Mirrors
/// fa_bwd_keys in flash.cu: 128 where half the head dim is a multiple of 16, else 64.
fn pipe_keys(d: usize) -> usize {
    if (d / 2) % 16 == 0 {
        128
    } else {
        64
    }
}

/// Head dims of the whole-head kernels for short sequences (`FA_SMALL`, `flash_bwd_short`).
const SHORT_HEAD_DIMS: [usize; 2] = [32, 64];

/// Dynamic shared memory of the class-token attention kernels (f32: scores, the scaled query,
/// four warps' partial rows, the reductions; the backward adds dout and dS), within the
/// 227 KiB a block may have.
fn class_attention_smem(op: &'static str, n: usize, d: usize, backward: bool, v8: bool, threads: u32) -> BResult<u32> {
    let floats = if v8 {
        // p | qs | res | acc (8 per thread) | red (32), the backward adds ds and g
        n + 2 * d + 8 * threads as usize + 32 + if backward { n + d } else { 0 }
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

/// Threads a block of the class-token attention's 16-byte kernels: 128, or 512 where the
/// sequence is long (N ≥ 512) and the B·H blocks are too few for 4 on each of `sms`
/// multiprocessors: one block then walks thousands of keys, and its latency decides.
fn class_attention_threads(v8: bool, n: usize, bh: usize, sms: usize) -> u32 {
    if v8 && n >= 512 && bh < 4 * sms {
        512
    } else {
        128
    }
}

/// Whether the class-token attention takes its 16-byte kernels: D a multiple of 8 up to 1024
/// (rows of whole 16-byte chunks, at most 128 chunks for the 128 threads) and aligned buffers.
fn class_attention_v8(d: usize, ptrs: &[CUdeviceptr]) -> bool {
    d % 8 == 0 && d <= 1024 && ptrs.iter().all(|p| p % 16 == 0)
}

/// The first keys that the delta pass takes from the wgmma key-block backward
/// (`flash_bwd_pre_fold` in flash.cu): `keys` = N mod 128 where that is 1 or 2, so that every
/// key block holds 128 keys; the pass runs `splits` blocks a head of `rows_per_split` query rows
/// (about 8 blocks an SM, and about 64 rows or more each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FoldKeys {
    keys: usize,
    splits: usize,
    rows_per_split: usize,
}

impl FoldKeys {
    /// The fold for `heads` heads of N = `n` on `sms` SMs; `None` where N mod 128 is not 1 or 2.
    fn for_shape(n: usize, heads: usize, sms: usize) -> Option<FoldKeys> {
        let keys = n % 128;
        if n < 128 || !(1..=2).contains(&keys) {
            return None;
        }
        let splits = (8 * sms).div_ceil(heads.max(1)).clamp(1, (n / 64).max(1));
        let rows_per_split = n.div_ceil(splits);
        Some(FoldKeys { keys, splits: n.div_ceil(rows_per_split), rows_per_split })
    }
}

/// The fused attention kernels put B·H on grid.y (at most 65535 blocks).
fn check_grid(op: &'static str, bh: usize) -> BResult<()> {
    if bh > 65535 {
        return Err(BackendError::Shape { op, msg: format!("B·H = {bh} exceeds the 65535 the fused attention grid supports") });
    }
    Ok(())
}

impl Cuda {
    /// Kernel-name suffix of the fused attention for head dim `d` and the dynamic shared
    /// memory (bytes) of its (forward, backward) kernels; None = the GEMM path.
    fn fused_attention(&self, d: usize) -> Option<(String, u32, u32)> {
        if !PIPE_HEAD_DIMS.contains(&d) {
            return None;
        }
        // Mirrors fa_fwd_pipe_smem / fa_bwd_pipe_smem in flash.cu (64-row tiles, rows padded by 8).
        let (ld, bc) = ((d + 8) * 2, pipe_keys(d));
        let (fwd, bwd) = ((64 + 4 * 64) * ld, (2 * bc + 4 * 64) * ld + bc * (64 + 8) * 2 + 4 * 64 * 4);
        match self.attention_path() {
            AttentionPath::Gemm => None,
            AttentionPath::Fused | AttentionPath::FusedPipe => Some((format!("d{d}_pipe"), fwd as u32, bwd as u32)),
        }
    }

    /// Warps per block W and the dynamic shared memory (bytes) of the small-head kernels
    /// `flash_{fwd,bwd}_small_d{d}_w{W}` (the whole head in one block, N ≤ 16·W), when they
    /// apply: path `fused`, head dim 32 or 64, N ≤ 80. Mirrors fa_small_{fwd,bwd}_smem in flash.cu.
    fn small_attention(&self, n: usize, d: usize) -> Option<(usize, u32, u32)> {
        if self.attention_path() != AttentionPath::Fused || !SHORT_HEAD_DIMS.contains(&d) || n > 80 {
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

    /// The long-sequence wgmma forward `flash_fwd_wg_long_d{d}` (hopper_flash_fwd.cu, sm_90 only:
    /// 64·CW queries per block of CW consumer warpgroups against key tiles of 128 with an online
    /// softmax; CW = 3 at D = 64, 2 at D = 80), when it applies: path `fused`, D = 64 or 80,
    /// N > 256, switched on and compiled. Gives CW and the dynamic shared memory, which mirrors
    /// FL_SMEM(CW, D) (CW Q tiles, a 2-stage ring of K and V tiles, at D = 80 the same again for
    /// columns 64…79 in rows of 32 bytes, 7 mbarriers).
    fn wgmma_long_attention_forward(&self, n: usize, d: usize) -> Option<(usize, u32)> {
        let applies = self.attention_path() == AttentionPath::Fused && (d == 64 || d == 80) && n > 256 && self.wgmma_attention() && self.has_wgmma_long_attention(d);
        let cw = if d == 80 { 2 } else { 3 };
        let cols16 = if d == 80 { cw * 64 * 32 + 2 * 2 * 128 * 32 } else { 0 };
        applies.then_some((cw, (cw * 64 * 128 + 2 * 2 * 128 * 128 + cols16 + 8 * 7 + 1024) as u32))
    }

    /// Whether the long-sequence wgmma forward for head dim `d` is compiled (sm_90; its module
    /// may fail on its own).
    pub fn has_wgmma_long_attention(&self, d: usize) -> bool {
        self.kernels.get(&format!("flash_fwd_wg_long_d{d}")).is_ok()
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

    /// Whether the long-sequence wgmma backward `flash_bwd_wg_long_d{d}` (hopper_flash_bwd.cu, its
    /// own module) is compiled and loaded.
    pub fn has_wgmma_long_backward(&self, d: usize) -> bool {
        self.kernels.get(&format!("flash_bwd_wg_long_d{d}")).is_ok()
    }

    /// Dynamic shared memory of `flash_bwd_wg_long_d{d}` (128 keys a block, query tiles of 64),
    /// when it replaces the tiled backward: path `fused`, wgmma attention on, D = 64 or 80,
    /// N > 256 (below, the whole-head kernels run at D = 64). Mirrors FlBwdSmem<D>::BYTES: K, V
    /// (128 rows), a 3-stage ring of Q and dO tiles (64 rows; at D = 80 with their columns 64…79
    /// in rows of 32 bytes), two dSᵀ buffers and the dK, dV staging (128 rows each), at D = 80 K's
    /// and V's columns 64…79, the ring's lse2 and delta (64 pairs of f32 a stage), 11 mbarriers,
    /// 1 KiB of alignment slack.
    fn wgmma_long_backward(&self, n: usize, d: usize) -> Option<u32> {
        let applies = self.attention_path() == AttentionPath::Fused && (d == 64 || d == 80) && n > 256 && self.wgmma_attention() && self.has_wgmma_long_backward(d);
        let (stage, cols16) = if d == 80 { (2 * 64 * 128 + 2 * 64 * 32, 2 * 128 * 32) } else { (2 * 64 * 128, 0) };
        applies.then_some((2 * 128 * 128 + 3 * stage + 2 * 128 * 128 + 2 * 128 * 128 + cols16 + 3 * 64 * 8 + 8 * 11 + 8 * d * 4 + 1024) as u32)
    }

    /// Dynamic shared memory of `flash_bwd_short_d{d}` for sequence length `n`, when the
    /// short-sequence backward applies (path `fused`, head dim 32 or 64, N ≤ 256, fits the
    /// block's shared memory).
    /// Mirrors fa_short_smem in flash.cu.
    fn short_backward_smem(&self, n: usize, d: usize) -> Option<u32> {
        if self.attention_path() != AttentionPath::Fused || !SHORT_HEAD_DIMS.contains(&d) || n > 256 {
            return None;
        }
        let nqp = n.div_ceil(64) * 64;
        let ld = d + 8;
        let bytes = 2 * nqp * ld * 2 + 2 * nqp * 4 + nqp * ld * 4 + 2 * 128 * ld * 2 + 128 * (64 + 8) * 2;
        (bytes <= SHORT_BWD_SMEM_MAX).then_some(bytes as u32)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_forward_impl(&self, out: &mut CudaBuf, probs: &mut CudaBuf, qkv: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
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
            if let (Some((cw, smem)), true) = (self.wgmma_long_attention_forward(n, d), qkv.ptr % 16 == 0 && out.ptr % 16 == 0) {
                let c = h * d;
                let tm_kv = tensor_map_3d(qkv.ptr, 3 * c, n, b, 128)?;
                let tm_q = tensor_map_3d(qkv.ptr, 3 * c, n, b, 64)?;
                let tm_out = tensor_map_3d(out.ptr, c, n, b, 64)?;
                let grid = (n.div_ceil(64 * cw) as u32, (b * h) as u32, 1);
                let block = (128 * (cw as u32 + 1), 1, 1);
                if d == 80 {
                    // columns 64…79 of each head through maps of their own (32-byte swizzle)
                    let tm_kvt = tensor_map_3d_cols16(qkv.ptr, 3 * c, n, b, 128)?;
                    let tm_qt = tensor_map_3d_cols16(qkv.ptr, 3 * c, n, b, 64)?;
                    return self.launch_dyn("flash_fwd_wg_long_d80", grid, block, smem, &mut kargs![tm_kv, tm_q, tm_out, tm_kvt, tm_qt, out.ptr, probs.ptr, nn, hh, scale_log2]);
                }
                return self.launch_dyn("flash_fwd_wg_long_d64", grid, block, smem, &mut kargs![tm_kv, tm_q, tm_out, probs.ptr, nn, hh, scale_log2]);
            }
            if let Some((w, smem, _)) = self.small_attention(n, d) {
                let block = (32 * w as u32, 1, 1);
                return self.launch_dyn(&format!("flash_fwd_small_d{d}_w{w}"), ((b * h) as u32, 1, 1), block, smem, &mut kargs![out.ptr, probs.ptr, qkv.ptr, nn, hh, scale_log2]);
            }
            // Long sequences: 128-query blocks (each K, V tile fetched once for twice the
            // queries); up to 1024 tokens the 64-query blocks waste less of the last tile.
            let (br, name, smem) = if n > LONG_QUERY_BLOCK_FROM {
                (128, format!("flash_fwd_{sfx}128"), smem + (64 * (d + 8) * 2) as u32)
            } else {
                (64, format!("flash_fwd_{sfx}"), smem)
            };
            let grid = (n.div_ceil(br) as u32, (b * h) as u32, 1);
            return self.launch_dyn(&name, grid, (2 * br as u32, 1, 1), smem, &mut kargs![out.ptr, probs.ptr, qkv.ptr, nn, hh, scale_log2]);
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
            a_ty: Ty::Half, b_ty: Ty::Half, d_ty: Ty::Half,
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
            a_ty: Ty::Half, b_ty: Ty::Half, d_ty: Ty::Half,
            lda: d as i64, ldb: ld as i64, ldd: d as i64,
            batch, stride_a: nd, stride_b: nld, stride_d: nd,
            bias: false, accumulate: false, align: 0,
        };
        self.gemm("attention_forward (p·v)", s, v, sp, oh, 0, 1.0, 0.0)?;
        self.move_heads(false, out.ptr, oh, b, n, 1, h, d)
    }

    /// `attention_backward`, plus the qkv bias gradient into `dbias` (an f32 device address of
    /// 3·H·D values) when given: summed inside the small-head kernel, else a column sum of dqkv.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_backward_impl(&self, dqkv: &mut CudaBuf, dbias: Option<CUdeviceptr>, dout: &CudaBuf, qkv: &CudaBuf, out: &CudaBuf, probs: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
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
            let (bb, nn, hh) = (b as i32, n as i32, h as i32);
            // On Hopper the key blocks run on wgmma (TMA copies: 16-byte aligned bases; 16-byte
            // dQ reductions).
            let long = self.wgmma_long_backward(n, d).filter(|_| tma_ok && dq_acc % 16 == 0);
            // With N mod 128 = 1 or 2 the delta pass takes those first keys (`FoldKeys`), the
            // key blocks the 128·m after them.
            let fold = long.filter(|_| self.fold_keys()).and_then(|_| FoldKeys::for_shape(n, b * h, self.info.multiprocessors as usize));
            let koff = fold.map_or(0, |f| f.keys);
            // the folded keys' partial dK, dV sums (f32, in bf16-sized slots)
            let fold_part = match fold {
                Some(f) => {
                    let part = self.scratch("flash_fold_part", 2 * b * h * f.splits * f.keys * 2 * d)?;
                    let rps = f.rows_per_split as i32;
                    self.launch(&format!("flash_bwd_pre_fold_d{d}_r{}", f.keys), (f.splits as u32, (b * h) as u32, 1), (256, 1, 1), 0, &mut kargs![delta, dq_acc, part, dout.ptr, out.ptr, qkv.ptr, probs.ptr, nn, hh, rps, scale, scale_log2])?;
                    part
                }
                None => {
                    // 32 (token, head) rows a block and step, 32·D/8 threads; the pass also
                    // zeroes the dQ accumulator (each thread the 8 values of its 16-byte chunk
                    // of dout)
                    let grid = (b * n * h).div_ceil(32).clamp(1, self.info.multiprocessors as usize * 8) as u32;
                    self.launch(&format!("flash_bwd_pre_d{d}"), (grid, 1, 1), (32 * (d / 8) as u32, 1, 1), 0, &mut kargs![delta, dq_acc, dout.ptr, out.ptr, bb, nn, hh])?;
                    0
                }
            };
            if let Some(lsmem) = long {
                let c = h * d;
                let nkb = (n - koff).div_ceil(128);
                // with a bias: a row of Σ dV per (image, key block) and per image for the folded
                // keys, and the rows of Σ dQ the store pass writes, reduced into the q and v
                // slots below; where those rows would outgrow the partial-sum arena, the
                // column-sum pass
                let dv_rows = b * nkb + if fold.is_some() { b } else { 0 };
                let splits = (b * n).div_ceil(64).clamp(1, 256);
                let sums = dbias.filter(|_| (dv_rows + splits) * c <= ARENA_LIMIT);
                // (one region: taking a second could flush the queue and reuse the first)
                let (dv_part, dq_part) = match sums {
                    Some(_) => {
                        let part = self.partial_rows((dv_rows + splits) * c)?;
                        (part, part + (dv_rows * c * 4) as u64)
                    }
                    None => (0, 0),
                };
                let tm_kv = tensor_map_3d(qkv.ptr, 3 * c, n, b, 128)?;
                let tm_q = tensor_map_3d(qkv.ptr, 3 * c, n, b, 64)?;
                let tm_do = tensor_map_3d(dout.ptr, c, n, b, 64)?;
                let tm_dqkv = tensor_map_3d(dqkv.ptr, 3 * c, n, b, 64)?;
                let g = (nkb as u32, (b * h) as u32, 1);
                let koff_i = koff as i32;
                if d == 80 {
                    // columns 64…79 of each head through maps of their own (32-byte swizzle)
                    let tm_kvt = tensor_map_3d_cols16(qkv.ptr, 3 * c, n, b, 128)?;
                    let tm_qt = tensor_map_3d_cols16(qkv.ptr, 3 * c, n, b, 64)?;
                    let tm_dot = tensor_map_3d_cols16(dout.ptr, c, n, b, 64)?;
                    self.launch_dyn("flash_bwd_wg_long_d80", g, (512, 1, 1), lsmem, &mut kargs![tm_kv, tm_q, tm_do, tm_dqkv, tm_kvt, tm_qt, tm_dot, dqkv.ptr, probs.ptr, delta, dq_acc, dv_part, nn, hh, scale, scale_log2, koff_i])?;
                } else {
                    self.launch_dyn("flash_bwd_wg_long_d64", g, (512, 1, 1), lsmem, &mut kargs![tm_kv, tm_q, tm_do, tm_dqkv, probs.ptr, delta, dq_acc, dv_part, nn, hh, scale, scale_log2, koff_i])?;
                }
                if let Some(f) = fold {
                    // the folded keys' dK, dV from the delta pass's partial sums, and their
                    // v bias rows after the key blocks'
                    let vsum = if dv_part == 0 { 0 } else { dv_part + (b * nkb * c * 4) as u64 };
                    let (di, ri, si) = (d as i32, f.keys as i32, f.splits as i32);
                    self.launch("flash_fold_keys_store", ((b * h) as u32, 1, 1), (2 * d as u32, 1, 1), 0, &mut kargs![dqkv.ptr, vsum, fold_part, nn, hh, di, ri, si])?;
                }
                if let Some(db) = sums {
                    let (rows, cc) = ((b * n) as i64, c as i32);
                    self.launch("flash_dq_store_sums", (c.div_ceil(256) as u32, splits as u32, 1), (32, 8, 1), 0, &mut kargs![dqkv.ptr, dq_acc, dq_part, rows, cc])?;
                    // q bias += Σ dQ, v bias += Σ dV; the k bias's gradient is zero
                    self.reduce_partials(db, db, db, c, dq_part, splits, c)?;
                    let dv = db + (2 * c * 4) as u64;
                    return self.reduce_partials(dv, dv, dv, c, dv_part, dv_rows, c).map(|_| true);
                }
            } else {
                let bc = pipe_keys(d);
                let g = (n.div_ceil(bc) as u32, (b * h) as u32, 1);
                self.launch_dyn(&format!("flash_bwd_{sfx}"), g, (2 * bc as u32, 1, 1), smem, &mut kargs![dqkv.ptr, dq_acc, dout.ptr, qkv.ptr, probs.ptr, delta, nn, hh, scale, scale_log2])?;
            }
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
            a_ty: Ty::Half, b_ty: Ty::Half, d_ty: Ty::Half,
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_backward_bias_impl(&self, dqkv: &mut CudaBuf, dparams: &mut CudaBuf, bias: Span, dout: &CudaBuf, qkv: &CudaBuf, out: &CudaBuf, probs: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        const OP: &str = "attention_backward_bias";
        check_f32(OP, "dparams", dparams)?;
        check_span(OP, "dbias", dparams, bias)?;
        if bias.len != 3 * h * d {
            return Err(BackendError::Shape { op: OP, msg: format!("bias span has {} elements, qkv has {} columns", bias.len, 3 * h * d) });
        }
        self.attention_backward_impl(dqkv, Some(dparams.at(bias.off)), dout, qkv, out, probs, b, n, h, d)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn class_attention_forward_impl(&self, out: &mut CudaBuf, q: &CudaBuf, kv: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
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
        let threads = class_attention_threads(v8, n, b * h, self.info.multiprocessors as usize);
        let smem = class_attention_smem(OP, n, d, false, v8, threads)?;
        let (nn, hh, dd, scale) = (n as i32, h as i32, d as i32, 1.0 / (d as f32).sqrt());
        let name = if v8 { "class_attention_fwd_v8" } else { "class_attention_fwd" };
        self.launch_dyn(name, ((b * h) as u32, 1, 1), (threads, 1, 1), smem, &mut kargs![out.ptr, q.ptr, kv.ptr, nn, hh, dd, scale])
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn class_attention_backward_impl(&self, dq: &mut CudaBuf, dkv: &mut CudaBuf, dparams: &mut CudaBuf, kv_bias: Option<Span>, dout: &CudaBuf, q: &CudaBuf, kv: &CudaBuf, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
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
        let threads = class_attention_threads(v8, n, b * h, self.info.multiprocessors as usize);
        let smem = class_attention_smem(OP, n, d, true, v8, threads)?;
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
        self.launch_dyn("class_attention_bwd_v8", ((b * h) as u32, 1, 1), (threads, 1, 1), smem, &mut kargs![dq.ptr, dkv.ptr, dout.ptr, q.ptr, kv.ptr, nn, hh, dd, scale, part])?;
        match kv_bias {
            // v bias += Σ dout; the k bias's gradient is zero
            Some(s) => {
                let dv = dparams.at(s.off) + (c * 4) as u64;
                self.reduce_partials(dv, dv, dv, c, part, b, c)
            }
            None => Ok(()),
        }
    }

    pub(super) fn add_class_rows_impl(&self, dst: &mut CudaBuf, src: &CudaBuf, b: usize, n: usize, c: usize) -> BResult<()> {
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

    pub(super) fn attention_saved_len_impl(&self, b: usize, n: usize, h: usize, d: usize) -> usize {
        if self.fused_attention(d).is_some() {
            // log-sum-exp per row: B·H·N f32 = 2·B·H·N bf16 slots (≤ B·H·N·N once N ≥ 2).
            (2 * b * h * n).min(b * h * n * n.max(2))
        } else {
            b * h * n * n
        }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold_keys_takes_one_or_two_ragged_keys_and_covers_every_query() {
        for (n, keys) in [(257, Some(1)), (258, Some(2)), (4097, Some(1)), (1025, Some(1)), (259, None), (256, None), (577, None), (384, None), (129, Some(1)), (1, None), (2, None)] {
            for (heads, sms) in [(1024, 132), (192, 132), (1, 132), (8, 16)] {
                let f = FoldKeys::for_shape(n, heads, sms);
                assert_eq!(f.map(|f| f.keys), keys, "N {n}");
                if let Some(f) = f {
                    // every query row in exactly one split, none empty, and a full block of keys after
                    assert!(f.splits >= 1 && f.splits * f.rows_per_split >= n && (f.splits - 1) * f.rows_per_split < n, "{f:?} N {n}");
                    assert_eq!((n - f.keys) % 128, 0);
                    assert!(f.rows_per_split >= 64 || f.splits == 1, "{f:?}");
                }
            }
        }
    }
}
