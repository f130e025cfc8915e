//! The CPU backend: f32, all cores (rayon), GEMMs through the `gemm` crate. The reference
//! every other backend is tested against, and the device of the embedded default run.
//!
//! Parallel loops split outputs by rows (or by image for attention), so every thread writes a
//! disjoint chunk; parameter gradients are reduced from per-chunk partial sums.

mod gemm;
pub mod optim;

use rayon::prelude::*;

use self::gemm::{matmul, Mat, MatMut};
use super::{BResult, Backend, BackendError, ParamGroups, GeluSaved, ShardPiece, Span, StepHyper};
use crate::core::{OptimizerConfig, LN_EPS};

/// The CPU backend. Threads come from the global rayon pool.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu {
    /// What `bias_grads_in_products` answers (false: `Cpu::new`).
    bias_in_products: bool,
}

impl Cpu {
    pub fn new() -> Self {
        Cpu::default()
    }

    /// A CPU backend whose `bias_grads_in_products` says yes, as the CUDA backend's does with
    /// its weight-gradient kernel on: a model then hands every bias gradient to the weight
    /// products instead of to LayerNorm and attention backwards, which the CPU computes alike.
    /// For checking that routing against the default one.
    pub fn with_bias_grads_in_products() -> Self {
        Cpu { bias_in_products: true }
    }
}

fn check(op: &'static str, what: &str, buf: &[f32], need: usize) -> BResult<()> {
    if buf.len() < need {
        return Err(BackendError::Shape { op, msg: format!("{what} holds {} elements, needs {need}", buf.len()) });
    }
    Ok(())
}

/// torch's `lerp(start, end, weight)`: from the nearer end, so weight 1 gives `end` exactly.
fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    if weight.abs() < 0.5 {
        start + weight * (end - start)
    } else {
        end - (end - start) * (1.0 - weight)
    }
}

/// `dst[j] += Σ_rows data[row][j]` over row-major `data` with `cols` columns: fixed row chunks
/// summed in parallel, then combined in chunk order (deterministic for any thread count).
fn add_column_sums(dst: &mut [f32], data: &[f32], cols: usize) {
    let rows = data.len() / cols.max(1);
    let chunk = rows_per_task(rows, cols);
    let parts: Vec<Vec<f32>> = data
        .par_chunks(chunk * cols)
        .map(|rows_chunk| {
            let mut acc = vec![0.0f32; cols];
            for row in rows_chunk.chunks(cols) {
                for (a, g) in acc.iter_mut().zip(row) {
                    *a += g;
                }
            }
            acc
        })
        .collect();
    reduce_into(dst, parts);
}

fn check_span(op: &'static str, what: &str, buf: &[f32], span: Span, need: usize) -> BResult<()> {
    if span.len != need || span.off + span.len > buf.len() {
        return Err(BackendError::Shape {
            op,
            msg: format!("{what} span {}+{} (buffer {}) does not hold {need} elements", span.off, span.len, buf.len()),
        });
    }
    Ok(())
}

/// Rows per parallel task: large enough to amortize scheduling, small enough to balance.
fn rows_per_task(rows: usize, cols: usize) -> usize {
    let target = (1 << 14) / cols.max(1);
    target.clamp(1, rows.max(1))
}

const SQRT_2_INV: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π)
const INV_SQRT_2PI: f32 = 0.398_942_3;

#[inline]
fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * SQRT_2_INV))
}

#[inline]
fn gelu_grad(x: f32) -> f32 {
    0.5 * (1.0 + libm::erff(x * SQRT_2_INV)) + x * INV_SQRT_2PI * (-0.5 * x * x).exp()
}

/// Adds per-chunk partial sums `parts` (each `len` long) into `dst`.
fn reduce_into(dst: &mut [f32], parts: Vec<Vec<f32>>) {
    for p in parts {
        for (d, v) in dst.iter_mut().zip(p) {
            *d += v;
        }
    }
}

impl Backend for Cpu {
    type Buf = Vec<f32>;
    type Mark = std::time::Instant;

    fn new_mark(&self) -> BResult<std::time::Instant> {
        Ok(std::time::Instant::now())
    }
    fn record_mark(&self, mark: &mut std::time::Instant) -> BResult<()> {
        *mark = std::time::Instant::now();
        Ok(())
    }
    fn seconds_between(&self, a: &std::time::Instant, b: &std::time::Instant) -> BResult<f64> {
        Ok(b.saturating_duration_since(*a).as_secs_f64())
    }
    fn bias_grads_in_products(&self, _rows: usize, _ic: usize, _oc: usize) -> bool {
        self.bias_in_products
    }

    fn name(&self) -> String {
        format!("cpu ({})", crate::util::plural(rayon::current_num_threads(), "thread", "threads"))
    }

    fn alloc(&self, len: usize) -> BResult<Vec<f32>> {
        Ok(vec![0.0; len])
    }
    fn alloc_f32(&self, len: usize) -> BResult<Vec<f32>> {
        Ok(vec![0.0; len])
    }
    fn cast(&self, dst: &mut Vec<f32>, src: &Vec<f32>) -> BResult<()> {
        self.copy(dst, src)
    }
    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }
    fn upload(&self, dst: &mut Vec<f32>, off: usize, src: &[f32]) -> BResult<()> {
        check("upload", "dst", dst, off + src.len())?;
        dst[off..off + src.len()].copy_from_slice(src);
        Ok(())
    }
    fn download(&self, src: &Vec<f32>) -> BResult<Vec<f32>> {
        Ok(src.clone())
    }
    fn host_view<'a>(&self, buf: &'a Vec<f32>) -> Option<&'a [f32]> {
        Some(buf)
    }
    fn host_view_mut<'a>(&self, buf: &'a mut Vec<f32>) -> Option<&'a mut [f32]> {
        Some(buf)
    }
    fn fill(&self, buf: &mut Vec<f32>, value: f32) -> BResult<()> {
        buf.fill(value);
        Ok(())
    }
    fn copy(&self, dst: &mut Vec<f32>, src: &Vec<f32>) -> BResult<()> {
        if dst.len() != src.len() {
            return Err(BackendError::Shape { op: "copy", msg: format!("{} != {}", dst.len(), src.len()) });
        }
        dst.copy_from_slice(src);
        Ok(())
    }
    fn synchronize(&self) -> BResult<()> {
        Ok(())
    }

    fn patchify(&self, out: &mut Vec<f32>, img: &Vec<f32>, b: usize, chans: usize, size: usize, patch: usize) -> BResult<()> {
        let g = size / patch;
        let np = g * g;
        let pd = chans * patch * patch;
        check("patchify", "img", img, b * chans * size * size)?;
        check("patchify", "out", out, b * np * pd)?;
        out[..b * np * pd].par_chunks_mut(pd).enumerate().for_each(|(row, dst)| {
            let (bi, p) = (row / np, row % np);
            let (gy, gx) = (p / g, p % g);
            for c in 0..chans {
                for py in 0..patch {
                    let src = ((bi * chans + c) * size + gy * patch + py) * size + gx * patch;
                    let d = (c * patch + py) * patch;
                    dst[d..d + patch].copy_from_slice(&img[src..src + patch]);
                }
            }
        });
        Ok(())
    }

    fn embed_forward(&self, out: &mut Vec<f32>, patches: &Vec<f32>, params: &Vec<f32>, pos: Span, cls: Option<Span>, b: usize, np: usize, c: usize) -> BResult<()> {
        let prefix = usize::from(cls.is_some());
        let n = np + prefix;
        check_span("embed_forward", "pos", params, pos, n * c)?;
        if let Some(s) = cls {
            check_span("embed_forward", "cls", params, s, c)?;
        }
        check("embed_forward", "patches", patches, b * np * c)?;
        check("embed_forward", "out", out, b * n * c)?;
        let pos_v = &params[pos.range()];
        out[..b * n * c].par_chunks_mut(n * c).enumerate().for_each(|(bi, img)| {
            if let Some(s) = cls {
                for (j, o) in img[..c].iter_mut().enumerate() {
                    *o = params[s.off + j] + pos_v[j];
                }
            }
            let src = &patches[bi * np * c..(bi + 1) * np * c];
            for ((o, p), e) in img[prefix * c..].iter_mut().zip(&pos_v[prefix * c..]).zip(src) {
                *o = e + p;
            }
        });
        Ok(())
    }

    fn embed_backward(&self, dpatches: &mut Vec<f32>, dparams: &mut Vec<f32>, dout: &Vec<f32>, pos: Span, cls: Option<Span>, b: usize, np: usize, c: usize) -> BResult<()> {
        let prefix = usize::from(cls.is_some());
        let n = np + prefix;
        check_span("embed_backward", "pos", dparams, pos, n * c)?;
        check("embed_backward", "dout", dout, b * n * c)?;
        check("embed_backward", "dpatches", dpatches, b * np * c)?;
        dpatches[..b * np * c].par_chunks_mut(np * c).enumerate().for_each(|(bi, dst)| {
            dst.copy_from_slice(&dout[(bi * n + prefix) * c..(bi + 1) * n * c]);
        });
        // Σ over the batch, position by position: dpos covers the class token's slot too.
        let dpos = &mut dparams[pos.range()];
        for bi in 0..b {
            for (d, g) in dpos.iter_mut().zip(&dout[bi * n * c..(bi + 1) * n * c]) {
                *d += g;
            }
        }
        if let Some(s) = cls {
            check_span("embed_backward", "cls", dparams, s, c)?;
            for bi in 0..b {
                for j in 0..c {
                    dparams[s.off + j] += dout[bi * n * c + j];
                }
            }
        }
        Ok(())
    }

    fn matmul_forward(&self, out: &mut Vec<f32>, gelu: Option<(&mut Vec<f32>, GeluSaved)>, inp: &Vec<f32>, params: &Vec<f32>, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        check_span("matmul_forward", "weight", params, w, oc * ic)?;
        check("matmul_forward", "inp", inp, rows * ic)?;
        check("matmul_forward", "out", out, rows * oc)?;
        // With a GELU epilogue the product (without the bias) lands in `saved`, and `out` gets
        // gelu(pre + bias); with GeluSaved::Grad `saved` then becomes gelu'(pre + bias).
        let target: &mut Vec<f32> = match gelu {
            Some((saved, what)) => {
                check("matmul_forward", "gelu saved", saved, rows * oc)?;
                matmul_bias(saved, inp, params, w, None, rows, ic, oc)?;
                self.gelu_forward(out, saved, params, bias, rows, oc)?;
                if what == GeluSaved::Grad {
                    let bv = bias.map(|bs| &params[bs.range()]);
                    saved[..rows * oc].par_chunks_mut(oc.max(1)).for_each(|row| {
                        for (j, x) in row.iter_mut().enumerate() {
                            *x = gelu_grad(*x + bv.map_or(0.0, |b| b[j]));
                        }
                    });
                }
                return Ok(());
            }
            None => out,
        };
        matmul_bias(target, inp, params, w, bias, rows, ic, oc)
    }

    fn matmul_forward_residual(&self, out: &mut Vec<f32>, residual: &Vec<f32>, inp: &Vec<f32>, params: &Vec<f32>, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        check("matmul_forward_residual", "residual", residual, rows * oc)?;
        self.matmul_forward(out, None, inp, params, w, bias, rows, ic, oc)?;
        out[..rows * oc].par_iter_mut().zip(&residual[..rows * oc]).for_each(|(o, &r)| *o += r);
        Ok(())
    }

    fn gelu_forward(&self, out: &mut Vec<f32>, pre: &Vec<f32>, params: &Vec<f32>, pre_bias: Option<Span>, rows: usize, cols: usize) -> BResult<()> {
        let n = rows * cols;
        check("gelu_forward", "pre", pre, n)?;
        check("gelu_forward", "out", out, n)?;
        match pre_bias {
            Some(bs) => {
                check_span("gelu_forward", "pre_bias", params, bs, cols)?;
                let bv = &params[bs.range()];
                out[..n].par_chunks_mut(cols.max(1)).zip(pre[..n].par_chunks(cols.max(1))).for_each(|(o, x)| {
                    for ((o, &x), &b) in o.iter_mut().zip(x).zip(bv) {
                        *o = gelu(x + b);
                    }
                });
            }
            None => out[..n].par_iter_mut().zip(&pre[..n]).for_each(|(o, &x)| *o = gelu(x)),
        }
        Ok(())
    }

    fn matmul_backward(&self, dinp: &mut Vec<f32>, dparams: &mut Vec<f32>, dout: &Vec<f32>, inp: &Vec<f32>, dgelu_pre: Option<&Vec<f32>>, params: &Vec<f32>, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        check_span("matmul_backward", "weight", params, w, oc * ic)?;
        check_span("matmul_backward", "dweight", dparams, w, oc * ic)?;
        check("matmul_backward", "dout", dout, rows * oc)?;
        check("matmul_backward", "inp", inp, rows * ic)?;
        check("matmul_backward", "dinp", dinp, rows * ic)?;
        // dinp (R, IC) = dout (R, OC) · W (OC, IC)
        let wv = &params[w.range()];
        matmul(MatMut::rows(&mut dinp[..rows * ic], rows, ic), Mat::rows(dout, rows, oc), Mat::rows(wv, oc, ic), false, true)?;
        if let Some(pre) = dgelu_pre {
            check("matmul_backward", "dgelu_pre", pre, rows * ic)?;
            dinp[..rows * ic].par_iter_mut().zip(&pre[..rows * ic]).for_each(|(d, &x)| *d *= gelu_grad(x));
        }
        self.matmul_backward_weights(dparams, dout, inp, params, w, bias, rows, ic, oc)
    }

    fn matmul_backward_weights(&self, dparams: &mut Vec<f32>, dout: &Vec<f32>, inp: &Vec<f32>, params: &Vec<f32>, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        check_span("matmul_backward", "weight", params, w, oc * ic)?;
        check_span("matmul_backward", "dweight", dparams, w, oc * ic)?;
        check("matmul_backward", "dout", dout, rows * oc)?;
        check("matmul_backward", "inp", inp, rows * ic)?;
        // dW (OC, IC) += doutᵀ (OC, R) · inp (R, IC)
        matmul(MatMut::rows(&mut dparams[w.range()], oc, ic), Mat::rows_t(dout, rows, oc), Mat::rows(inp, rows, ic), true, true)?;
        if let Some(bs) = bias {
            check_span("matmul_backward", "dbias", dparams, bs, oc)?;
            add_column_sums(&mut dparams[bs.range()], &dout[..rows * oc], oc);
        }
        Ok(())
    }

    fn matmul_backward_gelu_bias(&self, dinp: &mut Vec<f32>, dparams: &mut Vec<f32>, dout: &Vec<f32>, inp: &Vec<f32>, saved: &Vec<f32>, what: GeluSaved, pre_bias: Span, params: &Vec<f32>, w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
        check_span("matmul_backward_gelu_bias", "pre_bias", dparams, pre_bias, ic)?;
        check_span("matmul_backward_gelu_bias", "pre_bias", params, pre_bias, ic)?;
        check("matmul_backward_gelu_bias", "gelu saved", saved, rows * ic)?;
        self.matmul_backward(dinp, dparams, dout, inp, None, params, w, bias, rows, ic, oc)?;
        let n = rows * ic;
        match what {
            // the pre-activation is pre + bias (the forward kept pre without it)
            GeluSaved::Pre => {
                let bv = &params[pre_bias.range()];
                dinp[..n].par_chunks_mut(ic.max(1)).zip(saved[..n].par_chunks(ic.max(1))).for_each(|(d, x)| {
                    for ((d, &x), &b) in d.iter_mut().zip(x).zip(bv) {
                        *d *= gelu_grad(x + b);
                    }
                });
            }
            GeluSaved::Grad => dinp[..n].par_iter_mut().zip(&saved[..n]).for_each(|(d, &g)| *d *= g),
        }
        add_column_sums(&mut dparams[pre_bias.range()], &dinp[..rows * ic], ic);
        Ok(())
    }

    fn layernorm_forward(&self, out: &mut Vec<f32>, mean: &mut Vec<f32>, rstd: &mut Vec<f32>, inp: &Vec<f32>, params: &Vec<f32>, w: Span, b: Span, rows: usize, c: usize) -> BResult<()> {
        check_span("layernorm_forward", "weight", params, w, c)?;
        check_span("layernorm_forward", "bias", params, b, c)?;
        check("layernorm_forward", "inp", inp, rows * c)?;
        check("layernorm_forward", "out", out, rows * c)?;
        check("layernorm_forward", "mean", mean, rows)?;
        check("layernorm_forward", "rstd", rstd, rows)?;
        let (wv, bv) = (&params[w.range()], &params[b.range()]);
        out[..rows * c]
            .par_chunks_mut(c)
            .zip(mean[..rows].par_iter_mut())
            .zip(rstd[..rows].par_iter_mut())
            .enumerate()
            .for_each(|(r, ((o, m), s))| {
                let x = &inp[r * c..(r + 1) * c];
                let mu = x.iter().sum::<f32>() / c as f32;
                let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / c as f32;
                let rs = 1.0 / (var + LN_EPS).sqrt();
                for j in 0..c {
                    o[j] = (x[j] - mu) * rs * wv[j] + bv[j];
                }
                *m = mu;
                *s = rs;
            });
        Ok(())
    }

    fn layernorm_backward(&self, dinp: &mut Vec<f32>, dparams: &mut Vec<f32>, dout: &Vec<f32>, dresidual: Option<&Vec<f32>>, inp: &Vec<f32>, mean: &Vec<f32>, rstd: &Vec<f32>, params: &Vec<f32>, w: Span, b: Span, rows: usize, c: usize, dinp_sum: Option<Span>) -> BResult<()> {
        check_span("layernorm_backward", "weight", params, w, c)?;
        check_span("layernorm_backward", "dweight", dparams, w, c)?;
        check_span("layernorm_backward", "dbias", dparams, b, c)?;
        for (what, buf) in [("dout", dout), ("inp", inp)] {
            check("layernorm_backward", what, buf, rows * c)?;
        }
        if let Some(r) = dresidual {
            check("layernorm_backward", "dresidual", r, rows * c)?;
        }
        check("layernorm_backward", "dinp", dinp, rows * c)?;
        let wv = &params[w.range()];
        let chunk = rows_per_task(rows, c);
        // Each task owns a run of rows of dinp and returns its partial dw, db.
        let parts: Vec<(Vec<f32>, Vec<f32>)> = dinp[..rows * c]
            .par_chunks_mut(chunk * c)
            .enumerate()
            .map(|(t, dst)| {
                let mut dw = vec![0.0f32; c];
                let mut db = vec![0.0f32; c];
                for (i, drow) in dst.chunks_mut(c).enumerate() {
                    let r = t * chunk + i;
                    let x = &inp[r * c..(r + 1) * c];
                    let g = &dout[r * c..(r + 1) * c];
                    let (mu, rs) = (mean[r], rstd[r]);
                    let mut mean_dxhat = 0.0f32;
                    let mut mean_dxhat_xhat = 0.0f32;
                    for j in 0..c {
                        let xhat = (x[j] - mu) * rs;
                        let dxhat = g[j] * wv[j];
                        mean_dxhat += dxhat;
                        mean_dxhat_xhat += dxhat * xhat;
                        dw[j] += g[j] * xhat;
                        db[j] += g[j];
                    }
                    mean_dxhat /= c as f32;
                    mean_dxhat_xhat /= c as f32;
                    for j in 0..c {
                        let xhat = (x[j] - mu) * rs;
                        let dxhat = g[j] * wv[j];
                        let res = dresidual.map_or(0.0, |d| d[r * c + j]);
                        drow[j] = res + rs * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat);
                    }
                }
                (dw, db)
            })
            .collect();
        let (dws, dbs): (Vec<_>, Vec<_>) = parts.into_iter().unzip();
        reduce_into(&mut dparams[w.range()], dws);
        reduce_into(&mut dparams[b.range()], dbs);
        if let Some(s) = dinp_sum {
            check_span("layernorm_backward", "dinp_sum", dparams, s, c)?;
            add_column_sums(&mut dparams[s.range()], &dinp[..rows * c], c);
        }
        Ok(())
    }

    fn attention_forward(&self, out: &mut Vec<f32>, probs: &mut Vec<f32>, qkv: &Vec<f32>, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        let c = h * d;
        check("attention_forward", "qkv", qkv, b * n * 3 * c)?;
        check("attention_forward", "out", out, b * n * c)?;
        check("attention_forward", "probs", probs, b * h * n * n)?;
        let scale = 1.0 / (d as f32).sqrt();
        out[..b * n * c]
            .par_chunks_mut(n * c)
            .zip(probs[..b * h * n * n].par_chunks_mut(h * n * n))
            .enumerate()
            .try_for_each(|(bi, (o, p))| -> BResult<()> {
                let base = bi * n * 3 * c;
                for hi in 0..h {
                    let q = Mat { data: qkv, off: base + hi * d, rows: n, cols: d, rs: 3 * c, cs: 1 };
                    // kᵀ as a (D, N) view of the key rows.
                    let kt = Mat { data: qkv, off: base + c + hi * d, rows: d, cols: n, rs: 1, cs: 3 * c };
                    let v = Mat { data: qkv, off: base + 2 * c + hi * d, rows: n, cols: d, rs: 3 * c, cs: 1 };
                    let ph = &mut p[hi * n * n..(hi + 1) * n * n];
                    matmul(MatMut::rows(ph, n, n), q, kt, false, false)?;
                    for row in ph.chunks_mut(n) {
                        let mut mx = f32::NEG_INFINITY;
                        for s in row.iter_mut() {
                            *s *= scale;
                            mx = mx.max(*s);
                        }
                        let mut sum = 0.0f32;
                        for s in row.iter_mut() {
                            *s = (*s - mx).exp();
                            sum += *s;
                        }
                        let inv = 1.0 / sum;
                        row.iter_mut().for_each(|s| *s *= inv);
                    }
                    let dst = MatMut { data: &mut *o, off: hi * d, rows: n, cols: d, rs: c, cs: 1 };
                    matmul(dst, Mat::rows(ph, n, n), v, false, false)?;
                }
                Ok(())
            })
    }

    fn attention_backward_bias(&self, dqkv: &mut Vec<f32>, dparams: &mut Vec<f32>, bias: Span, dout: &Vec<f32>, qkv: &Vec<f32>, out: &Vec<f32>, probs: &Vec<f32>, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        let c3 = 3 * h * d;
        check_span("attention_backward_bias", "dbias", dparams, bias, c3)?;
        self.attention_backward(dqkv, dout, qkv, out, probs, b, n, h, d)?;
        add_column_sums(&mut dparams[bias.range()], &dqkv[..b * n * c3], c3);
        Ok(())
    }

    fn attention_backward(&self, dqkv: &mut Vec<f32>, dout: &Vec<f32>, qkv: &Vec<f32>, _out: &Vec<f32>, probs: &Vec<f32>, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        let c = h * d;
        check("attention_backward", "qkv", qkv, b * n * 3 * c)?;
        check("attention_backward", "dqkv", dqkv, b * n * 3 * c)?;
        check("attention_backward", "dout", dout, b * n * c)?;
        check("attention_backward", "probs", probs, b * h * n * n)?;
        let scale = 1.0 / (d as f32).sqrt();
        dqkv[..b * n * 3 * c].par_chunks_mut(n * 3 * c).enumerate().try_for_each(|(bi, dst)| -> BResult<()> {
            let base = bi * n * 3 * c;
            let mut ds = vec![0.0f32; n * n];
            for hi in 0..h {
                let p = &probs[(bi * h + hi) * n * n..(bi * h + hi + 1) * n * n];
                let dout_h = Mat { data: dout, off: bi * n * c + hi * d, rows: n, cols: d, rs: c, cs: 1 };
                let vt = Mat { data: qkv, off: base + 2 * c + hi * d, rows: d, cols: n, rs: 1, cs: 3 * c };
                // dP (N, N) = dout_h · vᵀ
                matmul(MatMut::rows(&mut ds, n, n), dout_h, vt, false, false)?;
                // dv (N, D) = Pᵀ · dout_h
                let dv = MatMut { data: &mut *dst, off: 2 * c + hi * d, rows: n, cols: d, rs: 3 * c, cs: 1 };
                matmul(dv, Mat::rows_t(p, n, n), dout_h, false, false)?;
                // dS = P ⊙ (dP − Σ_j dP·P), with the 1/√D of the scores folded in.
                for (drow, prow) in ds.chunks_mut(n).zip(p.chunks(n)) {
                    let dot: f32 = drow.iter().zip(prow).map(|(a, b)| a * b).sum();
                    for (g, &pv) in drow.iter_mut().zip(prow) {
                        *g = pv * (*g - dot) * scale;
                    }
                }
                // dq (N, D) = dS · k ; dk (N, D) = dSᵀ · q
                let k = Mat { data: qkv, off: base + c + hi * d, rows: n, cols: d, rs: 3 * c, cs: 1 };
                let q = Mat { data: qkv, off: base + hi * d, rows: n, cols: d, rs: 3 * c, cs: 1 };
                let dq = MatMut { data: &mut *dst, off: hi * d, rows: n, cols: d, rs: 3 * c, cs: 1 };
                matmul(dq, Mat::rows(&ds, n, n), k, false, false)?;
                let dk = MatMut { data: &mut *dst, off: c + hi * d, rows: n, cols: d, rs: 3 * c, cs: 1 };
                matmul(dk, Mat::rows_t(&ds, n, n), q, false, false)?;
            }
            Ok(())
        })
    }

    fn class_attention_forward(&self, out: &mut Vec<f32>, q: &Vec<f32>, kv: &Vec<f32>, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        let c = h * d;
        check("class_attention_forward", "q", q, b * c)?;
        check("class_attention_forward", "kv", kv, b * n * 2 * c)?;
        check("class_attention_forward", "out", out, b * c)?;
        out[..b * c].par_chunks_mut(c).enumerate().for_each(|(bi, o)| {
            let mut p = vec![0.0f32; n];
            for hi in 0..h {
                class_probs(&mut p, q, kv, bi, n, h, d, hi);
                let oh = &mut o[hi * d..(hi + 1) * d];
                oh.fill(0.0);
                for (j, &pj) in p.iter().enumerate() {
                    let v = &kv[(bi * n + j) * 2 * c + c + hi * d..][..d];
                    oh.iter_mut().zip(v).for_each(|(a, &x)| *a += pj * x);
                }
            }
        });
        Ok(())
    }

    fn class_attention_backward(&self, dq: &mut Vec<f32>, dkv: &mut Vec<f32>, dparams: &mut Vec<f32>, kv_bias: Option<Span>, dout: &Vec<f32>, q: &Vec<f32>, kv: &Vec<f32>, b: usize, n: usize, h: usize, d: usize) -> BResult<()> {
        const OP: &str = "class_attention_backward";
        let c = h * d;
        if let Some(s) = kv_bias {
            check_span(OP, "dbias", dparams, s, 2 * c)?;
        }
        check(OP, "q", q, b * c)?;
        check(OP, "kv", kv, b * n * 2 * c)?;
        check(OP, "dq", dq, b * c)?;
        check(OP, "dkv", dkv, b * n * 2 * c)?;
        check(OP, "dout", dout, b * c)?;
        let scale = 1.0 / (d as f32).sqrt();
        dq[..b * c].par_chunks_mut(c).zip(dkv[..b * n * 2 * c].par_chunks_mut(n * 2 * c)).enumerate().for_each(|(bi, (dqi, dst))| {
            let mut p = vec![0.0f32; n];
            let mut ds = vec![0.0f32; n];
            for hi in 0..h {
                class_probs(&mut p, q, kv, bi, n, h, d, hi);
                let g = &dout[bi * c + hi * d..][..d];
                // this image's row j of kv / dkv, key (0) or value (1) part of head hi
                let row = |j: usize, part: usize| j * 2 * c + part * c + hi * d;
                let kvi = &kv[bi * n * 2 * c..];
                // dP_j = g·v_j, dS_j = P_j (dP_j − Σ_i P_i dP_i) with the 1/√D folded in
                for (j, dsj) in ds.iter_mut().enumerate() {
                    *dsj = g.iter().zip(&kvi[row(j, 1)..][..d]).map(|(a, x)| a * x).sum();
                }
                let dot: f32 = ds.iter().zip(&p).map(|(a, b)| a * b).sum();
                ds.iter_mut().zip(&p).for_each(|(g, &pj)| *g = pj * (*g - dot) * scale);
                let qh = &q[bi * c + hi * d..][..d];
                let dqh = &mut dqi[hi * d..(hi + 1) * d];
                dqh.fill(0.0);
                for j in 0..n {
                    // dq = Σ_j dS_j k_j ; dk_j = dS_j q ; dv_j = P_j g
                    dqh.iter_mut().zip(&kvi[row(j, 0)..][..d]).for_each(|(a, &x)| *a += ds[j] * x);
                    dst[row(j, 0)..][..d].iter_mut().zip(qh).for_each(|(a, &x)| *a = ds[j] * x);
                    dst[row(j, 1)..][..d].iter_mut().zip(g).for_each(|(a, &x)| *a = p[j] * x);
                }
            }
        });
        if let Some(s) = kv_bias {
            add_column_sums(&mut dparams[s.range()], &dkv[..b * n * 2 * c], 2 * c);
        }
        Ok(())
    }

    fn add_class_rows(&self, dst: &mut Vec<f32>, src: &Vec<f32>, b: usize, n: usize, c: usize) -> BResult<()> {
        check("add_class_rows", "dst", dst, b * n * c)?;
        check("add_class_rows", "src", src, b * c)?;
        for (bi, s) in src[..b * c].chunks(c.max(1)).enumerate() {
            dst[bi * n * c..][..c].iter_mut().zip(s).for_each(|(a, &x)| *a += x);
        }
        Ok(())
    }

    fn add(&self, out: &mut Vec<f32>, a: &Vec<f32>, b: &Vec<f32>) -> BResult<()> {
        let len = out.len();
        check("add", "a", a, len)?;
        check("add", "b", b, len)?;
        out.par_iter_mut().zip(&a[..len]).zip(&b[..len]).for_each(|((o, x), y)| *o = x + y);
        Ok(())
    }

    fn scale_rows(&self, out: &mut Vec<f32>, residual: Option<&Vec<f32>>, y: &Vec<f32>, scales: &Vec<f32>, scale_off: usize, rows: usize, rows_per_image: usize, c: usize) -> BResult<()> {
        let len = rows * c;
        check("scale_rows", "out", out, len)?;
        check("scale_rows", "y", y, len)?;
        if let Some(r) = residual {
            check("scale_rows", "residual", r, len)?;
        }
        let rpi = rows_per_image.max(1);
        check("scale_rows", "scales", scales, scale_off + rows.div_ceil(rpi))?;
        out[..len].par_chunks_mut(c.max(1)).enumerate().for_each(|(r, o)| {
            let s = scales[scale_off + r / rpi];
            let yr = &y[r * c..(r + 1) * c];
            match residual {
                Some(res) => o.iter_mut().zip(&res[r * c..(r + 1) * c]).zip(yr).for_each(|((o, x), v)| *o = x + s * v),
                None => o.iter_mut().zip(yr).for_each(|(o, v)| *o = s * v),
            }
        });
        Ok(())
    }

    fn copy_span(&self, dst: &mut Vec<f32>, dst_off: usize, src: &Vec<f32>, src_off: usize, len: usize) -> BResult<()> {
        check("copy_span", "dst", dst, dst_off + len)?;
        check("copy_span", "src", src, src_off + len)?;
        dst[dst_off..dst_off + len].copy_from_slice(&src[src_off..src_off + len]);
        Ok(())
    }

    fn add_span(&self, dst: &mut Vec<f32>, dst_off: usize, src: &Vec<f32>, src_off: usize, len: usize) -> BResult<()> {
        check("add_span", "dst", dst, dst_off + len)?;
        check("add_span", "src", src, src_off + len)?;
        dst[dst_off..dst_off + len].par_iter_mut().zip(&src[src_off..src_off + len]).for_each(|(d, &s)| *d += s);
        Ok(())
    }

    fn lerp(&self, dst: &mut Vec<f32>, dst_off: usize, src: &Vec<f32>, src_off: usize, len: usize, weight: f32) -> BResult<()> {
        check("lerp", "dst", dst, dst_off + len)?;
        check("lerp", "src", src, src_off + len)?;
        dst[dst_off..dst_off + len].par_iter_mut().zip(&src[src_off..src_off + len]).for_each(|(d, &s)| *d = lerp(*d, s, weight));
        Ok(())
    }

    fn pool_forward(&self, out: &mut Vec<f32>, inp: &Vec<f32>, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        check("pool_forward", "inp", inp, b * n * c)?;
        check("pool_forward", "out", out, b * c)?;
        for bi in 0..b {
            let o = &mut out[bi * c..(bi + 1) * c];
            if avg {
                o.fill(0.0);
                for t in prefix..n {
                    for (d, x) in o.iter_mut().zip(&inp[(bi * n + t) * c..(bi * n + t + 1) * c]) {
                        *d += x;
                    }
                }
                let inv = 1.0 / (n - prefix) as f32;
                o.iter_mut().for_each(|d| *d *= inv);
            } else {
                o.copy_from_slice(&inp[bi * n * c..bi * n * c + c]);
            }
        }
        Ok(())
    }

    fn pool_backward(&self, dinp: &mut Vec<f32>, dout: &Vec<f32>, b: usize, n: usize, c: usize, prefix: usize, avg: bool) -> BResult<()> {
        check("pool_backward", "dinp", dinp, b * n * c)?;
        check("pool_backward", "dout", dout, b * c)?;
        dinp[..b * n * c].fill(0.0);
        for bi in 0..b {
            let g = &dout[bi * c..(bi + 1) * c];
            if avg {
                let inv = 1.0 / (n - prefix) as f32;
                for t in prefix..n {
                    for (d, x) in dinp[(bi * n + t) * c..(bi * n + t + 1) * c].iter_mut().zip(g) {
                        *d = x * inv;
                    }
                }
            } else {
                dinp[bi * n * c..bi * n * c + c].copy_from_slice(g);
            }
        }
        Ok(())
    }

    fn cross_entropy(&self, losses: &mut Vec<f32>, dlogits: Option<&mut Vec<f32>>, logits: &Vec<f32>, targets: &Vec<f32>, b: usize, k: usize, dloss_scale: f32) -> BResult<()> {
        check("cross_entropy", "logits", logits, b * k)?;
        check("cross_entropy", "targets", targets, b * k)?;
        check("cross_entropy", "losses", losses, b)?;
        let mut dl = dlogits;
        if let Some(d) = dl.as_deref() {
            check("cross_entropy", "dlogits", d, b * k)?;
        }
        for r in 0..b {
            let x = &logits[r * k..(r + 1) * k];
            let t = &targets[r * k..(r + 1) * k];
            let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = x.iter().map(|v| (v - mx).exp()).sum();
            let lse = mx + sum.ln();
            losses[r] = x.iter().zip(t).map(|(v, tv)| tv * (lse - v)).sum();
            if let Some(d) = dl.as_deref_mut() {
                for j in 0..k {
                    d[r * k + j] = ((x[j] - lse).exp() - t[j]) * dloss_scale;
                }
            }
        }
        Ok(())
    }

    fn sum_squares(&self, buf: &Vec<f32>, inf_from: f32) -> BResult<f64> {
        Ok(optim::sum_squares(buf, inf_from))
    }

    fn sum_squares_spans(&self, buf: &Vec<f32>, spans: &[Span], inf_from: f32) -> BResult<f64> {
        let mut total = 0.0;
        for s in spans {
            check("sum_squares_spans", "buf", buf, s.off + s.len)?;
            total += optim::sum_squares(&buf[s.range()], inf_from);
        }
        Ok(total)
    }

    fn optimizer_step_master(&self, master: &mut Vec<f32>, grads: &Vec<f32>, state: &mut Vec<f32>, pieces: &[ShardPiece], opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        optim::optimizer_step_master(master, grads, state, pieces, opt, decay, hyper)
    }

    fn optimizer_step_pieces(&self, params: &mut Vec<f32>, grads: &Vec<f32>, state: &mut Vec<f32>, pieces: &[(Span, usize)], opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        check("optimizer_step_pieces", "grads", grads, params.len())?;
        optim::optimizer_step_pieces(params, grads, state, pieces, opt, decay, hyper)
    }

    fn scale(&self, buf: &mut Vec<f32>, s: f32) -> BResult<()> {
        buf.par_iter_mut().for_each(|v| *v *= s);
        Ok(())
    }

    fn optimizer_step(&self, params: &mut Vec<f32>, grads: &Vec<f32>, state: &mut Vec<f32>, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper) -> BResult<()> {
        let n = params.len();
        check("optimizer_step", "grads", grads, n)?;
        check("optimizer_step", "state", state, super::optimizer_state_len(opt, n))?;
        optim::optimizer_step(params, grads, state, opt, decay, hyper)
    }
}

/// `out (R, OC) = inp (R, IC) · Wᵀ + bias`.
#[allow(clippy::too_many_arguments)]
fn matmul_bias(out: &mut [f32], inp: &[f32], params: &[f32], w: Span, bias: Option<Span>, rows: usize, ic: usize, oc: usize) -> BResult<()> {
    let out = &mut out[..rows * oc];
    let accumulate = match bias {
        Some(bs) => {
            check_span("matmul_forward", "bias", params, bs, oc)?;
            let bv = &params[bs.range()];
            out.par_chunks_mut(oc).for_each(|row| row.copy_from_slice(bv));
            true
        }
        None => false,
    };
    matmul(MatMut::rows(out, rows, oc), Mat::rows(inp, rows, ic), Mat::rows_t(&params[w.range()], oc, ic), accumulate, true)
}

/// Softmax probabilities of image `bi`'s class-token query, head `hi`, over its N keys: `q`
/// (B, H·D), `kv` (B, N, 2, H, D), into `p` (N).
#[allow(clippy::too_many_arguments)]
fn class_probs(p: &mut [f32], q: &[f32], kv: &[f32], bi: usize, n: usize, h: usize, d: usize, hi: usize) {
    let c = h * d;
    let scale = 1.0 / (d as f32).sqrt();
    let qh = &q[bi * c + hi * d..][..d];
    let mut mx = f32::NEG_INFINITY;
    for (j, pj) in p.iter_mut().enumerate().take(n) {
        let k = &kv[(bi * n + j) * 2 * c + hi * d..][..d];
        *pj = qh.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
        mx = mx.max(*pj);
    }
    let mut sum = 0.0f32;
    p.iter_mut().for_each(|pj| {
        *pj = (*pj - mx).exp();
        sum += *pj;
    });
    let inv = 1.0 / sum;
    p.iter_mut().for_each(|pj| *pj *= inv);
}
