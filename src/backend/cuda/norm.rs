//! LayerNorm: forward and backward, by the register-resident kernels where the width has a
//! compiled instance (`layernorm_{fwd,bwd}_{c,v,s}{J}`) and the generic kernels elsewhere; the
//! backward's parameter gradients (and, where asked, the next layer's bias gradient) arrive as
//! partial rows (`partials`).

use cudarc::driver::sys::CUdeviceptr;

use super::device::{check_f32, check_len, check_span, kargs, CudaBuf, THREADS};
use super::gemm::Ty;
use super::Cuda;
use crate::backend::{BResult, BackendError, Span};
use crate::core::LN_EPS;

/// Widest `layernorm_bwd_s{J}` with its accumulator rows in static shared memory (C = 32·J ≤
/// 768: three rows per warp fit in 48 KiB); the wider instances (J 32, 40, 44) take them in
/// dynamic shared memory, 4 warps × 3 rows × C f32 a block.
const LN_SUM_STATIC_MAX_J: usize = 24;

/// J (= C/32) of the register-resident LayerNorm kernels, when they apply: bf16 tensors,
/// f32 statistics and a width with a compiled instance.
fn ln_fast_j(c: usize, bf16s: &[&CudaBuf], f32s: &[&CudaBuf]) -> Option<usize> {
    let j = c / 32;
    let ok = c % 32 == 0
        && [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 44].contains(&j)
        && bf16s.iter().all(|b| b.ty == Ty::Half)
        && f32s.iter().all(|b| b.ty == Ty::F32);
    ok.then_some(j)
}

/// The vectorized LayerNorm kernels (`layernorm_{fwd,bwd}_v{J}`): even J, and every row
/// pointer aligned to the vector width the kernel uses for that J (0 = absent is fine).
fn ln_vec_ok(j: usize, ptrs: &[CUdeviceptr]) -> bool {
    let vw = if j % 8 == 0 { 8 } else if j % 4 == 0 { 4 } else { 2 };
    j % 2 == 0 && [2, 4, 6, 8, 12, 16, 24, 32, 40, 44].contains(&j) && ptrs.iter().all(|&p| p % (2 * vw) as u64 == 0)
}

impl Cuda {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layernorm_forward_impl(&self, out: &mut CudaBuf, mean: &mut CudaBuf, rstd: &mut CudaBuf, inp: &CudaBuf, params: &CudaBuf, w: Span, b: Span, rows: usize, c: usize) -> BResult<()> {
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

    /// `layernorm_backward`: with `dinp_sum`, the vectorized kernels sum dinp's columns in the
    /// same pass; elsewhere a separate column sum over dinp follows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layernorm_backward_impl(&self, dinp: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, dresidual: Option<&CudaBuf>, inp: &CudaBuf, mean: &CudaBuf, rstd: &CudaBuf, params: &CudaBuf, w: Span, b: Span, rows: usize, c: usize, dinp_sum: Option<Span>) -> BResult<()> {
        const OP: &str = "layernorm_backward";
        if let Some(s) = dinp_sum {
            check_span(OP, "dinp_sum", dparams, s)?;
            if s.len != c {
                return Err(BackendError::Shape { op: OP, msg: format!("dinp_sum span has {} elements, dinp has {c} columns", s.len) });
            }
        }
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
        let dres_bf16 = dresidual.is_none_or(|d| d.ty == Ty::Half);
        if let (Some(j), true) = (ln_fast_j(c, &[&*dinp, dout, inp, params], &[mean, rstd]), dres_bf16) {
            if ln_vec_ok(j, &[dinp.ptr, dout.ptr, inp.ptr, dres]) {
                let (wo, bo, r) = (w.off as i64, b.off as i64, rows as i64);
                // with dinp_sum (C ≤ 768): dinp's column sums as a third partial row
                let (kernel, na, dsum) = match dinp_sum {
                    Some(s) => ("s", 3, Some(dparams.at(s.off))),
                    None => ("v", 2, None),
                };
                let name = format!("layernorm_bwd_{kernel}{j}");
                let smem = if dsum.is_some() && j > LN_SUM_STATIC_MAX_J { (4 * 3 * c * 4) as u32 } else { 0 };
                // 4 warps per block, one row per warp at a time; as many blocks as fit at once
                // (4 per SM at 128 registers, 2 for the widest rows; the limit on dynamic shared
                // memory raised first, or the count would be for none)
                self.allow_dynamic_smem(&name, smem)?;
                let per_sm = self.kernels.get(&name)?.occupancy_max_active_blocks_per_multiprocessor(128, smem as usize, None).unwrap_or(4).max(1);
                let grid = (rows.div_ceil(4 * 8) as u32).min(self.info.multiprocessors * per_sm).max(1);
                let partial = self.partial_rows(grid as usize * na * c)?;
                self.launch_dyn(&name, (grid, 1, 1), (128, 1, 1), smem, &mut kargs![dinp.ptr, partial, dout.ptr, dres, inp.ptr, mean.ptr, rstd.ptr, params.ptr, wo, bo, r])?;
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
}
