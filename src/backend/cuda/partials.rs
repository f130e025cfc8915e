//! Column sums of partial rows: how the CUDA backend finishes bias and LayerNorm-parameter
//! gradients.
//!
//! The kernels that see a gradient's rows (LayerNorm backward, the fused GELU-gradient GEMM,
//! the attention backward, the bias-gradient pass) write one f32 partial row per block or per
//! image into a region from `partial_rows`; `reduce_partials` then adds the rows into the
//! gradient spans. Each reduction alone is a launch of a few dozen blocks that spends a few
//! microseconds on latency, and a ViT block's backward has four of them, so while the model
//! runs a backward (`Backend::defer_gradient_sums`) they are queued and go out together in
//! `reduce_partials_batch` launches: whenever `ARENA_LIMIT` of partial rows (about one ViT-B
//! block at micro 256) or `MAX_SEGS` reductions have gathered, and when the backward ends.
//!
//! The queue is flushed before anything could read or overwrite a gradient: `download`,
//! `synchronize`, `fill`, `copy`, `cast`, `upload`, `scale`, `sum_squares` and `optimizer_step`
//! all flush first. The sums are the same, in the same order, whether queued or not.
//!
//! The partial rows live in an arena that grows to what a backward needs, up to `ARENA_LIMIT`:
//! growing waits for the stream, so it happens in the first step, never in a captured (CUDA
//! graph) one.

use std::ffi::c_void;

use cudarc::driver::sys::CUdeviceptr;

use super::device::kargs;
use super::gemm::Ty;
use super::{Cuda, CudaBuf};
use crate::backend::{BResult, BackendError};

/// Reductions per launch; mirrors `RED_MAX_SEGS` in kernels/elementwise.cu (the batch goes as
/// one kernel parameter, within the 4 KiB a parameter list may take).
const MAX_SEGS: usize = 64;
/// Most f32 values the arena holds (16 MiB): about one ViT-B block's partial rows at micro 256,
/// so they are summed while still in L2 (a whole step's, read back from memory at the end,
/// would gain nothing over one launch per reduction).
pub(super) const ARENA_LIMIT: usize = 4 << 20;

/// One reduction, laid out as the kernel's `RedSeg`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct RedSeg {
    d1: u64,
    d2: u64,
    d3: u64,
    partial: u64,
    split: i32,
    nparts: i32,
    width: i32,
    block0: i32,
}

/// The kernel's `RedBatch` parameter.
#[repr(C)]
struct RedBatch {
    seg: [RedSeg; MAX_SEGS],
    count: i32,
    _pad: i32,
}

/// Queued reductions and the arena their partial rows live in.
#[derive(Default)]
pub(super) struct PendingSums {
    /// Queue reductions (inside a model backward) rather than launching each at once.
    defer: bool,
    segs: Vec<RedSeg>,
    /// Blocks the queued reductions need (32 columns each).
    blocks: usize,
    /// f32 values of the arena taken by the queued reductions.
    used: usize,
    /// f32 values taken since deferral began: the arena one whole backward wants.
    since_defer: usize,
    arena: Option<CudaBuf>,
}

impl PendingSums {
    fn capacity(&self) -> usize {
        self.arena.as_ref().map_or(0, |a| a.len)
    }
}

fn poisoned() -> BackendError {
    BackendError::Device("partial-sum queue lock poisoned".into())
}

impl Cuda {
    /// A region of `len` f32 values for one reduction's partial rows, valid until that
    /// reduction has run (the caller queues it with `reduce_partials` right after the kernel
    /// that writes the rows). Regions start 16-byte aligned (kernels store the rows four
    /// values at a time; a bias of 10 classes would otherwise shift every later region).
    pub(super) fn partial_rows(&self, len: usize) -> BResult<CUdeviceptr> {
        let len = len.next_multiple_of(4);
        let mut p = self.partial_sums.lock().map_err(|_| poisoned())?;
        if p.used + len > p.capacity() || p.segs.len() == MAX_SEGS {
            let demand = p.used + len;
            self.flush_locked(&mut p)?;
            if p.capacity() < len || p.capacity() < demand.min(ARENA_LIMIT) {
                // geometric growth: the first backward grows the arena a handful of times
                let want = demand.max(2 * p.capacity()).min(ARENA_LIMIT).max(len);
                self.grow_locked(&mut p, want)?;
            }
        }
        let arena = p.arena.as_ref().ok_or_else(|| BackendError::Device("partial-sum arena missing".into()))?;
        let ptr = arena.at(p.used);
        p.used += len;
        p.since_defer += len;
        Ok(ptr)
    }

    /// dst1[i] += Σ_p partial[p·width + i] for i < split, dst2[i − split] likewise up to
    /// 2·split, dst3[i − 2·split] after (width ≤ 3·split); `partial` from `partial_rows`.
    /// Queued while a backward defers them, else launched now.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reduce_partials(&self, dst1: CUdeviceptr, dst2: CUdeviceptr, dst3: CUdeviceptr, split: usize, partial: CUdeviceptr, nparts: usize, width: usize) -> BResult<()> {
        if width == 0 || nparts == 0 {
            return Ok(());
        }
        let to_i32 = |v: usize, what: &str| i32::try_from(v).map_err(|_| BackendError::Device(format!("reduce_partials: {what} {v} exceeds i32")));
        let mut p = self.partial_sums.lock().map_err(|_| poisoned())?;
        if p.segs.len() == MAX_SEGS {
            self.flush_locked(&mut p)?;
        }
        let seg = RedSeg {
            d1: dst1,
            d2: dst2,
            d3: dst3,
            partial,
            split: to_i32(split, "split")?,
            nparts: to_i32(nparts, "nparts")?,
            width: to_i32(width, "width")?,
            block0: to_i32(p.blocks, "block index")?,
        };
        p.segs.push(seg);
        p.blocks += width.div_ceil(32);
        if !p.defer {
            self.flush_locked(&mut p)?;
        }
        Ok(())
    }

    /// dst[j] += Σ_rows src[row, j] over a row-major (rows, cols) bf16 buffer: a bias gradient.
    pub(super) fn add_column_sums(&self, dst: CUdeviceptr, src: &CudaBuf, rows: usize, cols: usize) -> BResult<()> {
        let splits = (rows.div_ceil(64)).clamp(1, 256) as u32;
        let (r, o) = (rows as i64, cols as i32);
        let partial = self.partial_rows(splits as usize * cols)?;
        if cols % 8 == 0 && src.ptr % 16 == 0 && src.ty == Ty::Half {
            self.launch("bias_grad_v8", (cols.div_ceil(256) as u32, splits, 1), (32, 8, 1), 0, &mut kargs![partial, src.ptr, r, o])?;
        } else {
            self.launch("bias_grad_kernel", (cols.div_ceil(32) as u32, splits, 1), (32, 8, 1), 0, &mut kargs![partial, src.ptr, src.dt(), r, o])?;
        }
        self.reduce_partials(dst, dst, dst, cols, partial, splits as usize, cols)
    }

    /// Launches every queued reduction.
    pub(super) fn flush_partial_sums(&self) -> BResult<()> {
        let mut p = self.partial_sums.lock().map_err(|_| poisoned())?;
        self.flush_locked(&mut p)
    }

    /// Starts (`true`) or ends (`false`) queueing; ending flushes, and grows the arena to what
    /// the span since the start took, so the next backward queues everything.
    pub(super) fn set_defer_partial_sums(&self, defer: bool) -> BResult<()> {
        let mut p = self.partial_sums.lock().map_err(|_| poisoned())?;
        if !defer {
            self.flush_locked(&mut p)?;
            let want = p.since_defer.min(ARENA_LIMIT);
            if p.defer && want > p.capacity() {
                self.grow_locked(&mut p, want)?;
            }
        }
        p.defer = defer;
        p.since_defer = 0;
        Ok(())
    }

    fn flush_locked(&self, p: &mut PendingSums) -> BResult<()> {
        if p.segs.is_empty() {
            p.used = 0;
            return Ok(());
        }
        let mut batch = RedBatch { seg: [RedSeg::default(); MAX_SEGS], count: p.segs.len() as i32, _pad: 0 };
        batch.seg[..p.segs.len()].copy_from_slice(&p.segs);
        let grid = u32::try_from(p.blocks).map_err(|_| BackendError::Device(format!("reduce_partials_batch: {} blocks", p.blocks)))?;
        p.segs.clear();
        p.blocks = 0;
        p.used = 0;
        // The parameter block is copied at launch (and into a graph node when capturing).
        let mut args = [&batch as *const RedBatch as *mut c_void];
        self.launch("reduce_partials_batch", (grid, 1, 1), (32, 32, 1), 0, &mut args)
    }

    /// Replaces the (empty) arena with one of `len` f32 values; waits for the stream first,
    /// since a launched reduction may still read the old one.
    fn grow_locked(&self, p: &mut PendingSums, len: usize) -> BResult<()> {
        debug_assert!(p.segs.is_empty());
        if p.arena.is_some() {
            self.stream.synchronize().map_err(|e| BackendError::Device(format!("growing the partial-sum arena: {e}")))?;
            p.arena = None;
        }
        p.arena = Some(self.raw_alloc(len, Ty::F32)?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batch parameter must match the kernel's struct: 48-byte segments, `count` after the
    /// array, within the 4 KiB parameter limit.
    #[test]
    fn batch_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<RedSeg>(), 48);
        assert_eq!(std::mem::offset_of!(RedBatch, count), 48 * MAX_SEGS);
        assert!(std::mem::size_of::<RedBatch>() <= 4096);
        let cu = include_str!("kernels/elementwise.cu");
        assert!(cu.contains(&format!("#define RED_MAX_SEGS {MAX_SEGS}")), "RED_MAX_SEGS differs from MAX_SEGS");
    }
}
