//! The model's two ends and its residual stream: patchify, the token embedding (class token,
//! position embedding) and its backward, pooling, the softmax cross-entropy loss, and the
//! elementwise residual add.

use super::device::{check_f32, check_len, check_span, kargs, v8_ok, CudaBuf, THREADS};
use super::gemm::Ty;
use super::Cuda;
use crate::backend::{BResult, BackendError, Span, StridedCopy};

impl Cuda {
    pub(super) fn patchify_impl(&self, out: &mut CudaBuf, img: &CudaBuf, b: usize, chans: usize, size: usize, patch: usize) -> BResult<()> {
        if patch == 0 || size % patch != 0 {
            return Err(BackendError::Shape { op: "patchify", msg: format!("patch {patch} does not divide image size {size}") });
        }
        let n = b * chans * size * size;
        check_len("patchify", "img", img, n)?;
        // the first read of the input: a batch decoded on the GPU must be there by now
        self.order_decoded_input()?;
        check_len("patchify", "out", out, n)?;
        let (bb, c, s, p) = (b as i32, chans as i32, size as i32, patch as i32);
        // (the 8-output groups stay within one channel's patch when P·P is a multiple of 8)
        if (patch * patch) % 8 == 0 && v8_ok(8, n, &[out, img], &[out.ptr]) {
            return self.launch1("patchify_v8", n / 8, &mut kargs![out.ptr, img.ptr, bb, c, s, p]);
        }
        self.launch1("patchify_kernel", n, &mut kargs![out.ptr, out.dt(), img.ptr, img.dt(), bb, c, s, p])
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn embed_forward_impl(&self, out: &mut CudaBuf, patches: &CudaBuf, params: &CudaBuf, pos: Span, cls: Option<Span>, b: usize, np: usize, c: usize) -> BResult<()> {
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn embed_backward_impl(&self, dpatches: &mut CudaBuf, dparams: &mut CudaBuf, dout: &CudaBuf, pos: Span, cls: Option<Span>, b: usize, np: usize, c: usize) -> BResult<()> {
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn pool_forward_impl(&self, out: &mut CudaBuf, inp: &CudaBuf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        check_len("pool_forward", "inp", inp, b * n * c)?;
        check_len("pool_forward", "out", out, b * c)?;
        let (bb, nn, cc, pp, a) = (b as i32, n as i32, c as i32, prefix as i32, avg as i32);
        self.launch1("pool_fwd_kernel", b * c, &mut kargs![out.ptr, out.dt(), inp.ptr, inp.dt(), bb, nn, cc, pp, a])
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn pool_backward_impl(&self, dinp: &mut CudaBuf, dout: &CudaBuf, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        check_len("pool_backward", "dinp", dinp, b * n * c)?;
        check_len("pool_backward", "dout", dout, b * c)?;
        let (bb, nn, cc, pp, a) = (b as i32, n as i32, c as i32, prefix as i32, avg as i32);
        if v8_ok(c, b * n * c, &[dinp, dout], &[dinp.ptr, dout.ptr]) {
            let (rows, c8) = ((b * n) as i32, (c / 8) as i32);
            return self.launch1("pool_bwd_v8", b * n * c / 8, &mut kargs![dinp.ptr, dout.ptr, rows, nn, pp, c8, a]);
        }
        self.launch1("pool_bwd_kernel", b * n * c, &mut kargs![dinp.ptr, dinp.dt(), dout.ptr, dout.dt(), bb, nn, cc, pp, a])
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn cross_entropy_impl(&self, losses: &mut CudaBuf, dlogits: Option<&mut CudaBuf>, logits: &CudaBuf, targets: &CudaBuf, b: usize, k: usize, dloss_scale: f32) -> BResult<()> {
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

    #[allow(clippy::too_many_arguments)]
    pub(super) fn scale_rows_impl(&self, out: &mut CudaBuf, residual: Option<&CudaBuf>, y: &CudaBuf, scales: &CudaBuf, scale_off: usize, rows: usize, rows_per_image: usize, c: usize) -> BResult<()> {
        const OP: &str = "scale_rows";
        let len = rows * c;
        check_len(OP, "out", out, len)?;
        check_len(OP, "y", y, len)?;
        let rpi = rows_per_image.max(1);
        check_len(OP, "scales", scales, scale_off + rows.div_ceil(rpi))?;
        if scales.ty != Ty::F32 {
            return Err(BackendError::Shape { op: OP, msg: "scales must be an f32 buffer".into() });
        }
        let (res_ptr, res_dt) = match residual {
            Some(r) => {
                check_len(OP, "residual", r, len)?;
                (r.ptr, r.dt())
            }
            None => (0, out.dt()),
        };
        let (s_ptr, rpi, cc, n) = (scales.at(scale_off), rpi as i64, c as i64, len as i64);
        self.launch1("scale_rows_kernel", len, &mut kargs![out.ptr, out.dt(), res_ptr, res_dt, y.ptr, y.dt(), s_ptr, rpi, cc, n])
    }

    pub(super) fn lerp_impl(&self, dst: &mut CudaBuf, dst_off: usize, src: &CudaBuf, src_off: usize, len: usize, weight: f32) -> BResult<()> {
        const OP: &str = "lerp";
        check_len(OP, "dst", dst, dst_off + len)?;
        check_len(OP, "src", src, src_off + len)?;
        if dst.ty != Ty::F32 || src.ty != Ty::F32 {
            return Err(BackendError::Shape { op: OP, msg: "both buffers must be f32".into() });
        }
        let (d, s, n) = (dst.at(dst_off), src.at(src_off), len as i64);
        self.launch1("lerp_kernel", len, &mut kargs![d, s, n, weight])
    }

    /// `Backend::copy_span` between buffers of any dtypes (f32 → bf16 rounds, as `cast`):
    /// ZeRO-3's gathers copy a rank's f32 pieces into a compute-dtype slot. The deferred
    /// gradient sums are flushed first, since a span copied out of the gradient slot must hold
    /// them.
    pub(super) fn copy_span_impl(&self, dst: &mut CudaBuf, dst_off: usize, src: &CudaBuf, src_off: usize, len: usize) -> BResult<()> {
        const OP: &str = "copy_span";
        check_len(OP, "dst", dst, dst_off + len)?;
        check_len(OP, "src", src, src_off + len)?;
        if len == 0 {
            return Ok(());
        }
        self.flush_partial_sums()?;
        let (d, s, n) = (dst.at(dst_off), src.at(src_off), len as i64);
        self.launch1("scaled_cast_kernel", len, &mut kargs![d, dst.dt(), s, src.dt(), n, 1.0f32])
    }

    /// `Backend::copy_strided`: 16-byte moves where both buffers have one dtype and every
    /// offset, stride and length (in bytes) and both base addresses divide by 16, else one
    /// element a thread with `cast`'s conversion.
    pub(super) fn copy_strided_impl(&self, dst: &mut CudaBuf, src: &CudaBuf, c: &StridedCopy) -> BResult<()> {
        c.check(dst.len, src.len)?;
        if c.rows() == 0 || c.len == 0 {
            return Ok(());
        }
        self.flush_partial_sums()?;
        let es = dst.ty.size();
        let unit = 16 / es;
        let all = [c.len, c.src_off, c.dst_off, c.src_stride[0], c.src_stride[1], c.src_stride[2], c.dst_stride[0], c.dst_stride[1], c.dst_stride[2]];
        let (c1, c2) = (c.count[1] as i64, c.count[2] as i64);
        let [ss0, ss1, ss2] = c.src_stride.map(|v| v as i64);
        let [ds0, ds1, ds2] = c.dst_stride.map(|v| v as i64);
        if dst.ty == src.ty && dst.ptr % 16 == 0 && src.ptr % 16 == 0 && all.iter().all(|v| v % unit == 0) {
            let u = unit as i64;
            let (len, total) = (c.len as i64 / u, (c.rows() * c.len / unit) as i64);
            let (so, dof) = (c.src_off as i64 / u, c.dst_off as i64 / u);
            let (ss0, ss1, ss2, ds0, ds1, ds2) = (ss0 / u, ss1 / u, ss2 / u, ds0 / u, ds1 / u, ds2 / u);
            return self.launch1("copy_strided_u4", c.rows() * c.len / unit, &mut kargs![dst.ptr, src.ptr, len, c1, c2, total, so, ss0, ss1, ss2, dof, ds0, ds1, ds2]);
        }
        let (len, total, so, dof) = (c.len as i64, (c.rows() * c.len) as i64, c.src_off as i64, c.dst_off as i64);
        self.launch1("copy_strided_kernel", c.rows() * c.len, &mut kargs![dst.ptr, dst.dt(), src.ptr, src.dt(), len, c1, c2, total, so, ss0, ss1, ss2, dof, ds0, ds1, ds2])
    }

    /// `Backend::add_span` (f32): `add_kernel` at offset pointers, in place (each element read
    /// before it is written by the same thread). The deferred gradient sums are flushed first:
    /// ZeRO-3 adds a span of the gradient slot the backward just wrote.
    pub(super) fn add_span_impl(&self, dst: &mut CudaBuf, dst_off: usize, src: &CudaBuf, src_off: usize, len: usize) -> BResult<()> {
        const OP: &str = "add_span";
        check_len(OP, "dst", dst, dst_off + len)?;
        check_len(OP, "src", src, src_off + len)?;
        if dst.ty != Ty::F32 || src.ty != Ty::F32 {
            return Err(BackendError::Shape { op: OP, msg: "both buffers must be f32".into() });
        }
        if len == 0 {
            return Ok(());
        }
        self.flush_partial_sums()?;
        let (d, s, n) = (dst.at(dst_off), src.at(src_off), len as i64);
        let (dtd, dts) = (dst.dt(), src.dt());
        self.launch1("add_kernel", len, &mut kargs![d, dtd, d, dtd, s, dts, n])
    }

    pub(super) fn add_impl(&self, out: &mut CudaBuf, a: &CudaBuf, b: &CudaBuf) -> BResult<()> {
        let n = a.len.min(b.len);
        check_len("add", "out", out, n)?;
        if a.len != b.len {
            return Err(BackendError::Shape { op: "add", msg: format!("operands differ in length: {} vs {}", a.len, b.len) });
        }
        if n % 8 == 0 && [out.ty, a.ty, b.ty].iter().all(|&t| t == Ty::Half) && [out.ptr, a.ptr, b.ptr].iter().all(|&p| p % 16 == 0) {
            let n8 = (n / 8) as i64;
            return self.launch1("add_v8", n / 8, &mut kargs![out.ptr, a.ptr, b.ptr, n8]);
        }
        let nn = n as i64;
        self.launch1("add_kernel", n, &mut kargs![out.ptr, out.dt(), a.ptr, a.dt(), b.ptr, b.dt(), nn])
    }
}
