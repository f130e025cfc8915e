//! The optimizer step (Adam and SGD kernels over decay segments, clipping by the global norm
//! on the device, writing the 16-bit compute copy as they go), and the whole-buffer reductions
//! around it (`sum_squares`, `scale`).

use cudarc::driver::result as dr;

use super::device::{check_f32, check_len, check_span, dev, kargs, CudaBuf, THREADS};
use super::gemm::Ty;
use super::Cuda;
use crate::backend::{BResult, Backend, BackendError, ParamGroups, ShardPiece, Span, StepHyper};
use crate::core::{optimizer_state_len, OptimizerConfig};

/// Parameters per block of the optimizer kernels (8 rounds of their 4-element loads).
const OPT_CHUNK: usize = 8 * 4 * THREADS as usize;
/// Uploaded segment tables kept at once (one per decay grouping seen: the whole buffer, or
/// each piece of a ZeRO shard).
const SEGMENT_TABLES: usize = 256;

impl Cuda {
    pub(super) fn sum_squares_impl(&self, buf: &CudaBuf, inf_from: f32) -> BResult<f64> {
        self.flush_partial_sums()?;
        self.sum_squares_async(buf, inf_from)?;
        self.synchronize()?;
        let mut h = [0f64; 1];
        // SAFETY: 8 bytes from `acc` into an f64; the stream is idle.
        unsafe { dr::memcpy_dtoh_sync(&mut h, self.acc.ptr) }.map_err(dev("sum_squares"))?;
        Ok(h[0])
    }

    pub(super) fn scale_impl(&self, buf: &mut CudaBuf, s: f32) -> BResult<()> {
        self.flush_partial_sums()?;
        let n = buf.len as i64;
        self.launch1("scale_kernel", buf.len, &mut kargs![buf.ptr, buf.dt(), n, s])
    }

    /// Σ buf² into the f64 `acc` on the stream (zeroed first), `inf_from` as in
    /// `Backend::sum_squares`; no waiting.
    fn sum_squares_async(&self, buf: &CudaBuf, inf_from: f32) -> BResult<()> {
        // SAFETY: `acc` holds 8 bytes.
        unsafe { dr::memset_d8_async(self.acc.ptr, 0, 8, self.stream.cu_stream()) }.map_err(dev("sum_squares"))?;
        let n = buf.len as i64;
        let grid = self.grid(buf.len).min(self.info.multiprocessors * 4);
        self.launch("sum_squares_kernel", (grid, 1, 1), (THREADS, 1, 1), 0, &mut kargs![self.acc.ptr, buf.ptr, buf.dt(), n, inf_from])
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn optimizer_step_cast_impl(&self, params: &mut CudaBuf, grads: &CudaBuf, state: &mut CudaBuf, compute: &mut CudaBuf, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        if compute.ty != Ty::Half {
            self.optimizer_step_impl(params, grads, state, None, opt, decay, hyper)?;
            return self.cast(compute, params);
        }
        self.optimizer_step_impl(params, grads, state, Some(compute), opt, decay, hyper)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn optimizer_step_impl(&self, params: &mut CudaBuf, grads: &CudaBuf, state: &mut CudaBuf, compute: Option<&mut CudaBuf>, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        self.flush_partial_sums()?;
        const OP: &str = "optimizer_step";
        check_f32(OP, "params", params)?;
        check_f32(OP, "grads", grads)?;
        check_f32(OP, "state", state)?;
        let p = params.len;
        check_len(OP, "grads", grads, p)?;
        check_len(OP, "state", state, optimizer_state_len(opt, p))?;
        let pc = match compute {
            Some(c) => {
                check_len(OP, "compute copy", c, p)?;
                c.ptr
            }
            None => 0,
        };
        // clipping by the global norm: its square summed into `acc` just before the update
        let (norm2, clip) = if hyper.clip_norm > 0.0 {
            self.sum_squares_async(grads, f32::INFINITY)?;
            (self.acc.ptr, hyper.clip_norm as f32)
        } else {
            (0, 0.0f32)
        };
        self.optimizer_launch(params.ptr, grads.ptr, state.ptr, state.at(p), pc, p, opt, decay, hyper, norm2, clip)
    }

    /// `optimizer_step` over pieces of the flat buffers, each with its own state (see
    /// `Backend::optimizer_step_pieces`): one launch per piece at offset pointers, so every
    /// element gets exactly the update a whole-buffer step would give it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn optimizer_step_pieces_impl(&self, params: &mut CudaBuf, grads: &CudaBuf, state: &mut CudaBuf, pieces: &[(Span, usize)], opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        self.flush_partial_sums()?;
        const OP: &str = "optimizer_step_pieces";
        check_f32(OP, "params", params)?;
        check_f32(OP, "grads", grads)?;
        check_f32(OP, "state", state)?;
        check_len(OP, "grads", grads, params.len)?;
        if hyper.clip_norm > 0.0 {
            return Err(BackendError::Shape { op: OP, msg: "clips nothing itself: fold the global clipping factor into grad_scale".into() });
        }
        for &(span, soff) in pieces {
            check_span(OP, "piece", params, span)?;
            let slen = optimizer_state_len(opt, span.len);
            check_len(OP, "state", state, soff + slen)?;
            let v = state.at(soff + span.len);
            self.optimizer_launch(params.at(span.off), grads.at(span.off), state.at(soff), v, 0, span.len, opt, &decay.restrict(span), hyper, 0, 0.0)?;
        }
        Ok(())
    }

    /// `Backend::optimizer_step_shard`: per piece, the update kernel with its master weights
    /// and state at offsets of the compact buffer, writing the 16-bit weights into the compute
    /// copy at the piece's span as it goes (the same kernel, so the same values, as stage 0).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn optimizer_step_shard_impl(&self, state: &mut CudaBuf, grads: &CudaBuf, compute: &mut CudaBuf, pieces: &[ShardPiece], opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        const OP: &str = "optimizer_step_shard";
        if compute.ty != Ty::Half {
            return Err(BackendError::Shape { op: OP, msg: "the compute copy must be a compute-dtype (16-bit) buffer".into() });
        }
        check_len(OP, "compute copy", compute, grads.len)?;
        self.step_pieces(OP, None, grads, state, Some(compute), pieces, opt, decay, hyper)
    }

    /// `Backend::optimizer_step_master` (ZeRO-3): per piece, the update kernel with its f32
    /// weights and its gradients at `master_off` of `master` and of `grads` (the partitioned
    /// gradients) and its state at `state_off`; nothing else is
    /// written (the partition's gathers make the compute-dtype weights from `master`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn optimizer_step_master_impl(&self, master: &mut CudaBuf, grads: &CudaBuf, state: &mut CudaBuf, pieces: &[ShardPiece], opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        check_f32("optimizer_step_master", "master", master)?;
        self.step_pieces("optimizer_step_master", Some(master), grads, state, None, pieces, opt, decay, hyper)
    }

    /// The update kernel per piece: master weights at `master_off` of `master` (None: of
    /// `state`), state at `state_off` of `state`, the 16-bit weights into `compute` at the
    /// piece's span when given. Clipping must already be folded into `grad_scale`.
    #[allow(clippy::too_many_arguments)]
    fn step_pieces(&self, op: &'static str, master: Option<&CudaBuf>, grads: &CudaBuf, state: &CudaBuf, compute: Option<&CudaBuf>, pieces: &[ShardPiece], opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        self.flush_partial_sums()?;
        check_f32(op, "grads", grads)?;
        check_f32(op, "state", state)?;
        if hyper.clip_norm > 0.0 {
            return Err(BackendError::Shape { op, msg: "clips nothing itself: fold the global clipping factor into grad_scale".into() });
        }
        let (weights, what) = match master {
            Some(m) => (m, "master"),
            None => (state, "state (master weights)"),
        };
        for p in pieces {
            // ZeRO-3's gradients are partitioned as its master weights (`optimizer_step_master`)
            let g_off = if master.is_some() { p.master_off } else { p.span.off };
            check_len(op, "grads", grads, g_off + p.span.len)?;
            check_len(op, "state", state, p.state_off + optimizer_state_len(opt, p.span.len))?;
            check_len(op, what, weights, p.master_off + p.span.len)?;
            let v = state.at(p.state_off + p.span.len);
            let pc = compute.map_or(0, |c| c.at(p.span.off));
            self.optimizer_launch(weights.at(p.master_off), grads.at(g_off), state.at(p.state_off), v, pc, p.span.len, opt, &decay.restrict(p.span), hyper, 0, 0.0)?;
        }
        Ok(())
    }

    /// Σ g² of several spans, summed into `acc` on the stream, then read back (one wait).
    pub(super) fn sum_squares_spans_impl(&self, buf: &CudaBuf, spans: &[Span], inf_from: f32) -> BResult<f64> {
        self.flush_partial_sums()?;
        // SAFETY: `acc` holds 8 bytes.
        unsafe { dr::memset_d8_async(self.acc.ptr, 0, 8, self.stream.cu_stream()) }.map_err(dev("sum_squares_spans"))?;
        for &s in spans {
            check_span("sum_squares_spans", "span", buf, s)?;
            if s.len == 0 {
                continue;
            }
            let n = s.len as i64;
            let grid = self.grid(s.len).min(self.info.multiprocessors * 4);
            self.launch("sum_squares_kernel", (grid, 1, 1), (THREADS, 1, 1), 0, &mut kargs![self.acc.ptr, buf.at(s.off), buf.dt(), n, inf_from])?;
        }
        self.synchronize()?;
        let mut h = [0f64; 1];
        // SAFETY: 8 bytes from `acc` into an f64; the stream is idle.
        unsafe { dr::memcpy_dtoh_sync(&mut h, self.acc.ptr) }.map_err(dev("sum_squares_spans"))?;
        Ok(h[0])
    }

    /// The update kernels over `p` elements at these addresses (`v`: Adam's second moment;
    /// `pc`: the 16-bit compute copy or 0), decay groups in the coordinates of `params`.
    #[allow(clippy::too_many_arguments)]
    fn optimizer_launch(&self, params: u64, grads: u64, m: u64, v: u64, pc: u64, p: usize, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper, norm2: u64, clip: f32) -> BResult<()> {
        const OP: &str = "optimizer_step";
        // Merge neighbouring groups with the same decay flag and learning-rate factor into
        // segments; a segment's third slot carries both (`segment_code`).
        let mut segs: Vec<i64> = Vec::new();
        for g in &decay.groups {
            let s = g.span;
            if s.off + s.len > p {
                return Err(BackendError::Shape { op: OP, msg: format!("parameter group {}..{} exceeds the {p} parameters", s.off, s.off + s.len) });
            }
            let code = segment_code(g.decays, g.lr_scale);
            let n = segs.len();
            if n >= 3 && segs[n - 2] == s.off as i64 && segs[n - 1] == code {
                segs[n - 2] = (s.off + s.len) as i64;
            } else {
                segs.extend([s.off as i64, (s.off + s.len) as i64, code]);
            }
        }
        if segs.is_empty() {
            segs.extend([0, p as i64, segment_code(true, 1.0)]);
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
            match cache.iter().find(|(v, _)| *v == segs) {
                Some((_, b)) => b.ptr,
                None => {
                    // A ZeRO shard launches once per piece, each with its own table: keep them
                    // all (a few dozen). Past the cap, start over (freeing waits for the device).
                    if cache.len() >= SEGMENT_TABLES {
                        cache.clear();
                    }
                    // Stored as f32-sized pairs: i64 = 2 f32 slots.
                    let mut buf = self.raw_alloc(segs.len() * 2, Ty::F32)?;
                    // SAFETY: buf holds segs.len() i64 values; synchronized below.
                    unsafe { dr::memcpy_htod_async(buf.ptr, &segs, self.stream.cu_stream()) }.map_err(dev(OP))?;
                    self.synchronize()?;
                    buf.len = segs.len() * 2;
                    let ptr = buf.ptr;
                    cache.push((segs.clone(), buf));
                    ptr
                }
            }
        };
        let grid = (1, nseg as u32, 1);
        match *opt {
            OptimizerConfig::Adam { beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, .. } => {
                let t = hyper.step.max(1) as i32;
                let (bc1, bc2) = if bias_correction { (1.0 - beta1.powi(t), 1.0 - beta2.powi(t)) } else { (1.0, 1.0) };
                let (lr, b1, b2, e, wd, aw) = (hyper.lr, beta1 as f32, beta2 as f32, eps as f32, weight_decay as f32, adam_w_mode as i32);
                let (c1, c2, gs) = (bc1 as f32, bc2 as f32, hyper.grad_scale);
                self.launch("adam_kernel", grid, (THREADS, 1, 1), 0, &mut kargs![params, grads, m, v, seg_ptr, lr, b1, b2, e, wd, aw, c1, c2, gs, pc, norm2, clip])
            }
            OptimizerConfig::Sgd { momentum, dampening, weight_decay, nesterov, .. } => {
                let (lr, mo, da, wd, ne, first, gs) = (hyper.lr, momentum as f32, dampening as f32, weight_decay as f32, nesterov as i32, (hyper.step <= 1) as i32, hyper.grad_scale);
                self.launch("sgd_kernel", grid, (THREADS, 1, 1), 0, &mut kargs![params, grads, m, seg_ptr, lr, mo, da, wd, ne, first, gs, pc, norm2, clip])
            }
        }
    }
}

/// A segment's third slot in the kernels' table: bit 0 says whether weight decay applies, bits
/// 1..33 hold the f32 bits of the learning-rate factor (`segment_lr_scale` in optim.cu reads
/// them back).
fn segment_code(decays: bool, lr_scale: f32) -> i64 {
    ((lr_scale.to_bits() as i64) << 1) | decays as i64
}

#[cfg(test)]
mod tests {
    use super::segment_code;

    /// The kernels read the flag from bit 0 and the factor from the bits above: both come back
    /// exactly, for factors down to layer decay's smallest.
    #[test]
    fn segment_codes_keep_the_flag_and_the_factor() {
        for (d, f) in [(true, 1.0f32), (false, 1.0), (true, 0.75f32.powi(25)), (false, 0.5), (true, 0.0)] {
            let c = segment_code(d, f);
            assert!(c >= 0);
            assert_eq!(c & 1 == 1, d);
            assert_eq!(f32::from_bits((c >> 1) as u32), f);
        }
    }
}
