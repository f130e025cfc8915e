//! The checks behind `vitscale selftest` (`cmd::selftest`) and `tests/cuda_parity.rs`: every
//! backend op, and a short training run, against the CPU reference.
//!
//! Each check draws fresh random inputs (the seed is printed, `--seed` repeats a run), runs the
//! same op on the device backend and on `backend::cpu::Cpu`, and compares the outputs by
//! relative norm error ‖dev − cpu‖ / ‖cpu‖. Inputs that live in compute-dtype buffers are read
//! back from the device first, so both backends see exactly the same (bf16-rounded) values and
//! the error measures the op alone. Outputs written with `=` are poisoned with NaN first, so an
//! element the device forgets to write fails; outputs accumulated with `+=` start random.
//!
//! Tolerances: outputs in the compute dtype, when that is bf16 or fp16: 1e-2; f32 outputs: 1e-5,
//! except f32 values derived from 16-bit GEMMs with long reductions (documented per check). NaN
//! never passes. The GPU runs every check once per 16-bit format (`vitscale selftest`; the
//! header names an fp16 pass `[fp16]`) with the same tolerances: fp16's relative step (2^-11)
//! is 8× finer than bf16's and the random inputs (unit scale) stay far inside its range, so the
//! bf16 bounds hold for it with margin; `half` checks the format's range ends exactly.
//! The optimizer is checked against a float64 reference with torch semantics written here.
//! The model check trains a small ViT for 20 SGD steps on both backends from the same weights
//! and data, with a static loss scale of 1024 (exact in f32 and bf16; what fp16 needs), and
//! compares the loss sequences (16-bit tolerance: 2e-2 relative per step).

pub mod comm;
pub mod decode;
pub mod half;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::cpu::Cpu;
use crate::backend::{optimizer_state_len, BResult, Backend, GeluSaved, ParamGroup, ParamGroups, Span, StepHyper};
use crate::train::error::TrainError;
use crate::train::plan::Plan;
use crate::train::step::{MicroBatch, Step};
use crate::train::sync::LocalGrads;
use crate::config::{DecaySkip, OptimizerConfig};
use crate::model::vit::{Recompute, Vit};
use crate::model::{GlobalPool, ModelConfig, ParamTable};

/// The parts of the checks, which `vitscale selftest --only` picks by name (every part when not
/// given): so that a change to one area can be checked on a GPU in seconds of device time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parts {
    /// Every backend op and the buffer copies.
    pub ops: bool,
    /// The optimizer kernels against the float64 reference, and their shard forms.
    pub optimizer: bool,
    /// The short training runs (losses against the CPU; regenerated activations bitwise).
    pub training: bool,
    /// The opt-in Hopper GEMM kernels (GPU).
    pub gemm: bool,
    /// Every attention path at every head dim and length (GPU).
    pub attention: bool,
    /// The 16-bit format's range ends (GPU).
    pub half: bool,
    /// JPEG decode on the GPU against the CPU pipeline (GPU).
    pub decode: bool,
    /// The communicator's collectives.
    pub comm: bool,
}

impl Parts {
    /// The parts' names, in the order they run.
    pub const NAMES: [&'static str; 8] = ["ops", "optimizer", "training", "gemm", "attention", "half", "decode", "comm"];
    pub const ALL: Parts = Parts { ops: true, optimizer: true, training: true, gemm: true, attention: true, half: true, decode: true, comm: true };
    const NONE: Parts = Parts { ops: false, optimizer: false, training: false, gemm: false, attention: false, half: false, decode: false, comm: false };

    fn slot(&mut self, name: &str) -> Option<&mut bool> {
        Some(match name {
            "ops" => &mut self.ops,
            "optimizer" => &mut self.optimizer,
            "training" => &mut self.training,
            "gemm" => &mut self.gemm,
            "attention" => &mut self.attention,
            "half" => &mut self.half,
            "decode" => &mut self.decode,
            "comm" => &mut self.comm,
            _ => return None,
        })
    }

    /// A comma-separated list of part names (`--only`'s value).
    pub fn parse(list: &str) -> Result<Parts, String> {
        let mut parts = Parts::NONE;
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            *parts.slot(&name.to_ascii_lowercase()).ok_or_else(|| format!("{name:?} is not a part of the checks; the parts are {}", Parts::NAMES.join(", ")))? = true;
        }
        if parts == Parts::NONE {
            return Err(format!("names no part; the parts are {}", Parts::NAMES.join(", ")));
        }
        Ok(parts)
    }

    /// These parts less the GPU-only ones (`gemm`, `attention`, `half`, `decode`): what the
    /// CPU backend has to check.
    pub fn on_cpu(self) -> Parts {
        Parts { gemm: false, attention: false, half: false, decode: false, ..self }
    }

    /// The names of the parts picked.
    pub fn names(&self) -> Vec<&'static str> {
        let mut copy = *self;
        Parts::NAMES.into_iter().filter(|n| copy.slot(n).is_some_and(|b| *b)).collect()
    }
}

/// One comparison.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Check {
    pub name: String,
    pub rel_err: f64,
    pub tol: f64,
    pub pass: bool,
}

/// ‖a − b‖ / ‖b‖ (NaN if either holds a NaN or the lengths differ).
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return f64::NAN;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        if x.is_nan() || y.is_nan() {
            return f64::NAN;
        }
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

struct Ctx<'a, B: Backend> {
    be: &'a B,
    cpu: Cpu,
    rng: ChaCha8Rng,
    checks: Vec<Check>,
    /// Tolerance for compute-dtype outputs.
    tol_c: f64,
    /// CPU results kept across passes over the same inputs (`cpu_ref`).
    memo: ReferenceMemo,
}

/// CPU reference outputs by (seed, op and shape): the attention checks run once per attention
/// path on the same inputs, and the reference of a 16k-token head costs seconds on the CPU.
#[derive(Default)]
pub struct ReferenceMemo {
    seed: u64,
    outputs: std::collections::HashMap<String, Vec<Vec<f32>>>,
}

impl ReferenceMemo {
    /// The memo for a pass drawing its inputs from `seed`: what it holds if that was its seed,
    /// else emptied.
    fn for_seed(self, seed: u64) -> ReferenceMemo {
        if self.seed == seed {
            self
        } else {
            ReferenceMemo { seed, ..Default::default() }
        }
    }
}

/// A buffer on both backends.
struct Both<B: Backend> {
    d: B::Buf,
    c: Vec<f32>,
    compute: bool,
}

impl<'a, B: Backend> Ctx<'a, B> {
    fn randn(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                // Box–Muller
                let u1: f32 = self.rng.gen_range(1e-7f32..1.0);
                let u2: f32 = self.rng.gen();
                scale * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
            })
            .collect()
    }

    /// Uploads `data` to a compute (`compute = true`) or f32 buffer on the device and gives the
    /// CPU the values the device actually holds.
    fn buf(&mut self, data: &[f32], compute: bool) -> BResult<Both<B>> {
        let mut d = if compute { self.be.alloc(data.len())? } else { self.be.alloc_f32(data.len())? };
        self.be.upload(&mut d, 0, data)?;
        let c = self.be.download(&d)?;
        Ok(Both { d, c, compute })
    }
    fn rand(&mut self, n: usize, scale: f32, compute: bool) -> BResult<Both<B>> {
        let v = self.randn(n, scale);
        self.buf(&v, compute)
    }
    /// An output buffer: NaN on the device (must be overwritten), zeros on the CPU.
    fn out(&mut self, n: usize, compute: bool) -> BResult<Both<B>> {
        let mut d = if compute { self.be.alloc(n)? } else { self.be.alloc_f32(n)? };
        self.be.fill(&mut d, f32::NAN)?;
        Ok(Both { d, c: vec![0.0; n], compute })
    }
    /// The CPU reference `op` writing `outs`, or its outputs from an earlier pass whose rng
    /// drew the same inputs: `key` names the op and shape, the memo's seed the draws.
    fn cpu_ref(&mut self, key: &str, outs: &mut [&mut Vec<f32>], op: impl FnOnce(&Cpu, &mut [&mut Vec<f32>]) -> BResult<()>) -> BResult<()> {
        if let Some(kept) = self.memo.outputs.get(key) {
            for (o, k) in outs.iter_mut().zip(kept) {
                o.clone_from(k);
            }
            return Ok(());
        }
        op(&self.cpu, outs)?;
        self.memo.outputs.insert(key.to_string(), outs.iter().map(|o| o.to_vec()).collect());
        Ok(())
    }
    fn compare(&mut self, name: &str, b: &Both<B>, tol_f32: f64) -> BResult<()> {
        let dev = self.be.download(&b.d)?;
        let tol = if b.compute { self.tol_c.max(tol_f32) } else { tol_f32 };
        let e = rel_err(&dev, &b.c);
        self.checks.push(Check { name: name.to_string(), rel_err: e, tol, pass: e.is_finite() && e <= tol });
        Ok(())
    }

    /// `compare` of a gradient buffer in two parts: the elements of `span` (a bias gradient
    /// summed from bf16 activations on the device, f32 on the CPU: the compute tolerance) and
    /// everything else (`tol_f32`), so the bias sums' rounding does not swamp the rest.
    fn compare_split(&mut self, name: &str, b: &Both<B>, span: Span, span_name: &str, tol_f32: f64) -> BResult<()> {
        let mut dev = self.be.download(&b.d)?;
        let mut cpu = b.c.clone();
        let e = rel_err(&dev[span.range()], &cpu[span.range()]);
        let tol = self.tol_c.max(F32_TOL);
        self.checks.push(Check { name: format!("{name} {span_name}"), rel_err: e, tol, pass: e.is_finite() && e <= tol });
        dev[span.range()].fill(0.0);
        cpu[span.range()].fill(0.0);
        let e = rel_err(&dev, &cpu);
        self.checks.push(Check { name: name.to_string(), rel_err: e, tol: tol_f32, pass: e.is_finite() && e <= tol_f32 });
        Ok(())
    }
}

const F32_TOL: f64 = 1e-5;

/// Stochastic depth's row factors (`scale_rows`, with and without the residual, several rows
/// per image and one, factors read from an offset) and the weight EMA's `lerp` (at offsets, a
/// weight either side of 1/2) against the CPU. Outputs start as NaN on the device.
fn regularizer_checks<B: Backend>(cx: &mut Ctx<B>) -> BResult<()> {
    let cpu = cx.cpu;
    let (images, c) = (5usize, 96usize);
    for rows_per_image in [7usize, 1] {
        let rows = images * rows_per_image;
        let y = cx.rand(rows * c, 1.0, true)?;
        let res = cx.rand(rows * c, 1.0, true)?;
        let factors: Vec<f32> = (0..images + 3).map(|i| [0.0, 1.25, 2.0][i % 3]).collect();
        let scales = cx.buf(&factors, false)?;
        for with_residual in [false, true] {
            let mut out = cx.out(rows * c, true)?;
            let r = with_residual.then_some(&res);
            cx.be.scale_rows(&mut out.d, r.map(|r| &r.d), &y.d, &scales.d, 3, rows, rows_per_image, c)?;
            cpu.scale_rows(&mut out.c, r.map(|r| &r.c), &y.c, &scales.c, 3, rows, rows_per_image, c)?;
            cx.compare(&format!("scale_rows {rows_per_image} rows an image, residual {with_residual}"), &out, F32_TOL)?;
        }
    }
    for weight in [0.1f32, 0.9] {
        let src = cx.rand(5000, 1.0, false)?;
        let mut dst = cx.rand(4000, 1.0, false)?;
        cx.be.lerp(&mut dst.d, 100, &src.d, 777, 3333, weight)?;
        cpu.lerp(&mut dst.c, 100, &src.c, 777, 3333, weight)?;
        cx.compare(&format!("lerp weight {weight}"), &dst, 1e-6)?;
    }
    Ok(())
}

fn op_checks<B: Backend>(cx: &mut Ctx<B>) -> BResult<()> {
    let cpu = cx.cpu;
    regularizer_checks(cx)?;
    // ---- memory ops
    {
        let src = cx.rand(1000, 1.0, false)?;
        let mut dst = cx.out(1000, true)?;
        cx.be.cast(&mut dst.d, &src.d)?;
        dst.c = src.c.clone();
        // bf16 rounding of f32 values: relative error ≤ 2⁻⁹.
        cx.compare("cast f32→compute", &dst, 4e-3)?;
        let mut back = cx.out(1000, false)?;
        cx.be.cast(&mut back.d, &dst.d)?;
        back.c = cx.be.download(&dst.d)?;
        cx.compare("cast compute→f32", &back, F32_TOL)?;
        let mut f = cx.out(777, true)?;
        cx.be.fill(&mut f.d, 0.375)?;
        f.c = vec![0.375; 777];
        cx.compare("fill", &f, F32_TOL)?;
        // batch inputs through the pinned staging buffers: three rounds reuse both buffers
        for round in 0..3 {
            for compute in [true, false] {
                // a batch of images, then one the size of a small batch's targets
                let n = if round == 2 { 300 } else { 70_000 + 1000 * round };
                let host = cx.randn(n, 1.0);
                let mut dst = cx.out(n, compute)?;
                cx.be.upload_input(&mut dst.d, &host)?;
                dst.c = host;
                let what = if compute { "compute" } else { "f32" };
                cx.compare(&format!("upload_input {what} round {round}"), &dst, F32_TOL)?;
            }
        }
        let mut cp = cx.out(1000, false)?;
        cx.be.copy(&mut cp.d, &src.d)?;
        cp.c = src.c.clone();
        cx.compare("copy", &cp, F32_TOL)?;
        let mut s = cx.rand(1001, 1.0, false)?;
        cx.be.scale(&mut s.d, 0.7)?;
        cpu.scale(&mut s.c, 0.7)?;
        cx.compare("scale", &s, F32_TOL)?;
        let g = cx.rand(100_003, 1.0, false)?;
        let ss_d = cx.be.sum_squares(&g.d, f32::INFINITY)?;
        let ss_c = cpu.sum_squares(&g.c, f32::INFINITY)?;
        let e = ((ss_d - ss_c) / ss_c).abs();
        cx.checks.push(Check { name: "sum_squares".into(), rel_err: e, tol: F32_TOL, pass: e.is_finite() && e <= F32_TOL });
    }

    // ---- the general embedding kernels: C = 20 is not a whole number of 16-byte groups and
    // P = 3 makes P·P odd, so the 16-byte kernels (every shape below) do not apply
    {
        let (b, n_img, p, c) = (2usize, 9usize, 3usize, 20usize);
        let (np, pd) = ((n_img / p) * (n_img / p), 3 * p * p);
        let nt = np + 1;
        let tag = format!("[B{b} C{c} P{p}]");
        let img = cx.rand(b * 3 * n_img * n_img, 1.0, true)?;
        let mut patches = cx.out(b * np * pd, true)?;
        cx.be.patchify(&mut patches.d, &img.d, b, 3, n_img, p)?;
        cpu.patchify(&mut patches.c, &img.c, b, 3, n_img, p)?;
        cx.compare(&format!("patchify {tag}"), &patches, F32_TOL)?;
        let (pos, cls) = (Span { off: 0, len: nt * c }, Span { off: nt * c, len: c });
        let params_host = cx.randn(nt * c + c, 0.05);
        let params = cx.buf(&params_host, true)?;
        let pe = cx.rand(b * np * c, 1.0, true)?;
        let mut x = cx.out(b * nt * c, true)?;
        cx.be.embed_forward(&mut x.d, &pe.d, &params.d, pos, Some(cls), b, np, c)?;
        cpu.embed_forward(&mut x.c, &pe.c, &params.c, pos, Some(cls), b, np, c)?;
        cx.compare(&format!("embed_forward {tag}"), &x, F32_TOL)?;
        let dout = cx.rand(b * nt * c, 1.0, true)?;
        let mut dpe = cx.out(b * np * c, true)?;
        let grads_init = cx.randn(nt * c + c, 0.01);
        let mut dparams = cx.buf(&grads_init, false)?;
        cx.be.embed_backward(&mut dpe.d, &mut dparams.d, &dout.d, pos, Some(cls), b, np, c)?;
        cpu.embed_backward(&mut dpe.c, &mut dparams.c, &dout.c, pos, Some(cls), b, np, c)?;
        cx.compare(&format!("embed_backward dpatches {tag}"), &dpe, F32_TOL)?;
        cx.compare(&format!("embed_backward dparams(+=) {tag}"), &dparams, F32_TOL)?;
        for avg in [false, true] {
            let dp = cx.rand(b * c, 1.0, true)?;
            let mut dx = cx.out(b * nt * c, true)?;
            cx.be.pool_backward(&mut dx.d, &dp.d, b, nt, c, 1, avg)?;
            cpu.pool_backward(&mut dx.c, &dp.c, b, nt, c, 1, avg)?;
            cx.compare(&format!("pool_backward avg={avg} {tag}"), &dx, F32_TOL)?;
        }
    }

    // ---- shapes: a small odd one, a ViT-S/4 CIFAR block (C = 384: the 8-byte vector
    // LayerNorm path), a ViT-B/16 block at batch 2 (C = 768: the 16-byte path), ViT-L/16's
    // width on a 4×4 grid (C = 1024: the LayerNorm backward's column sums in dynamic shared
    // memory), and ViT-H/14's and ViT-g/14's widths on a 4×4 grid (C = 1280 and 1408: the wide
    // LayerNorm rows; head dims 80 and 88)
    for &(b, n_img, p, c, h, f, k) in &[(3usize, 12usize, 4usize, 48usize, 3usize, 96usize, 10usize), (3, 32, 4, 384, 6, 1536, 10), (2, 224, 16, 768, 12, 3072, 1000), (2, 64, 16, 1024, 16, 4096, 10), (2, 56, 14, 1280, 16, 5120, 10), (1, 56, 14, 1408, 16, 6144, 10)] {
        let tag = format!("[B{b} C{c}]");
        let np = (n_img / p) * (n_img / p);
        let n = np + 1;
        let d = c / h;
        let bn = b * n;
        let pd = 3 * p * p;
        // params: a flat compute buffer with every weight we use
        let spans = {
            let mut off = 0;
            let mut take = |len: usize| {
                let s = Span { off, len };
                off += len;
                s
            };
            (take(pd * c), take(c), take(n * c), take(c), take(c * c * 3), take(3 * c), take(f * c), take(f), take(c), take(c), off)
        };
        let (w_patch, b_patch, pos, cls, w_qkv, b_qkv, w_fc1, b_fc1, ln_w, ln_b, total) = spans;
        let mut params_host = cx.randn(total, 0.05);
        for i in 0..c {
            params_host[ln_w.off + i] = 1.0 + 0.1 * params_host[ln_w.off + i];
        }
        let params = cx.buf(&params_host, true)?;
        let grads_init = cx.randn(total, 0.01);

        // patchify + embed
        let img = cx.rand(b * 3 * n_img * n_img, 1.0, true)?;
        let mut patches = cx.out(b * np * pd, true)?;
        cx.be.patchify(&mut patches.d, &img.d, b, 3, n_img, p)?;
        cpu.patchify(&mut patches.c, &img.c, b, 3, n_img, p)?;
        cx.compare(&format!("patchify {tag}"), &patches, F32_TOL)?;
        let pe = cx.rand(b * np * c, 1.0, true)?;
        for with_cls in [true, false] {
            let clsopt = with_cls.then_some(cls);
            let nt = np + usize::from(with_cls);
            let mut x = cx.out(b * nt * c, true)?;
            cx.be.embed_forward(&mut x.d, &pe.d, &params.d, Span { off: pos.off, len: nt * c }, clsopt, b, np, c)?;
            cpu.embed_forward(&mut x.c, &pe.c, &params.c, Span { off: pos.off, len: nt * c }, clsopt, b, np, c)?;
            cx.compare(&format!("embed_forward cls={with_cls} {tag}"), &x, F32_TOL)?;
            let dout = cx.rand(b * nt * c, 1.0, true)?;
            let mut dpe = cx.out(b * np * c, true)?;
            let mut dparams = cx.buf(&grads_init, false)?;
            cx.be.embed_backward(&mut dpe.d, &mut dparams.d, &dout.d, Span { off: pos.off, len: nt * c }, clsopt, b, np, c)?;
            cpu.embed_backward(&mut dpe.c, &mut dparams.c, &dout.c, Span { off: pos.off, len: nt * c }, clsopt, b, np, c)?;
            cx.compare(&format!("embed_backward dpatches cls={with_cls} {tag}"), &dpe, F32_TOL)?;
            cx.compare(&format!("embed_backward dparams(+=) cls={with_cls} {tag}"), &dparams, F32_TOL)?;
        }

        // dense layers: patch embedding (bias), qkv (bias), fc1 (bias + GELU)
        let x = cx.rand(bn * c, 1.0, true)?;
        for (name, w, bias, rows, ic, oc, gelu) in [
            ("patch_embed", w_patch, Some(b_patch), b * np, pd, c, false),
            ("qkv", w_qkv, Some(b_qkv), bn, c, 3 * c, false),
            ("qkv (no bias)", w_qkv, None, bn, c, 3 * c, false),
            ("fc1+gelu", w_fc1, Some(b_fc1), bn, c, f, true),
        ] {
            let inp = if ic == c { Both { d: { let mut t = cx.be.alloc(bn * c)?; cx.be.copy(&mut t, &x.d)?; t }, c: x.c.clone(), compute: true } } else { cx.rand(rows * ic, 1.0, true)? };
            let mut out = cx.out(rows * oc, true)?;
            let mut pre = cx.out(rows * oc, true)?;
            cx.be.matmul_forward(&mut out.d, gelu.then_some((&mut pre.d, GeluSaved::Pre)), &inp.d, &params.d, w, bias, rows, ic, oc)?;
            cpu.matmul_forward(&mut out.c, gelu.then_some((&mut pre.c, GeluSaved::Pre)), &inp.c, &params.c, w, bias, rows, ic, oc)?;
            cx.compare(&format!("matmul_forward {name} {tag}"), &out, F32_TOL)?;
            if gelu {
                cx.compare(&format!("matmul_forward {name} pre {tag}"), &pre, F32_TOL)?;
                // the same forward saving gelu'(pre + bias) instead of pre
                let mut out2 = cx.out(rows * oc, true)?;
                let mut grad = cx.out(rows * oc, true)?;
                cx.be.matmul_forward(&mut out2.d, Some((&mut grad.d, GeluSaved::Grad)), &inp.d, &params.d, w, bias, rows, ic, oc)?;
                cpu.matmul_forward(&mut out2.c, Some((&mut grad.c, GeluSaved::Grad)), &inp.c, &params.c, w, bias, rows, ic, oc)?;
                cx.compare(&format!("matmul_forward {name} (saving gelu') {tag}"), &out2, F32_TOL)?;
                cx.compare(&format!("matmul_forward {name} gelu' {tag}"), &grad, F32_TOL)?;
            }
            // backward (with the GELU of the layer below when `gelu`: reuse `pre` as its input)
            let dout = cx.rand(rows * oc, 1.0, true)?;
            let mut dinp = cx.out(rows * ic, true)?;
            let mut dparams = cx.buf(&grads_init, false)?;
            let dg = if gelu { Some(cx.rand(rows * ic, 1.0, true)?) } else { None };
            cx.be.matmul_backward(&mut dinp.d, &mut dparams.d, &dout.d, &inp.d, dg.as_ref().map(|g| &g.d), &params.d, w, bias, rows, ic, oc)?;
            cpu.matmul_backward(&mut dinp.c, &mut dparams.c, &dout.c, &inp.c, dg.as_ref().map(|g| &g.c), &params.c, w, bias, rows, ic, oc)?;
            cx.compare(&format!("matmul_backward {name} dinp {tag}"), &dinp, F32_TOL)?;
            // dW/dbias are f32 sums over up to 400 bf16 products per row: the device sums in
            // another order, so allow 1e-4.
            cx.compare(&format!("matmul_backward {name} dW,dbias(+=) {tag}"), &dparams, 1e-4)?;
            // the weight gradients alone (no input gradient: the patch embedding)
            let mut dparams_w = cx.buf(&grads_init, false)?;
            cx.be.matmul_backward_weights(&mut dparams_w.d, &dout.d, &inp.d, &params.d, w, bias, rows, ic, oc)?;
            cpu.matmul_backward_weights(&mut dparams_w.c, &dout.c, &inp.c, &params.c, w, bias, rows, ic, oc)?;
            cx.compare(&format!("matmul_backward_weights {name} dW,dbias(+=) {tag}"), &dparams_w, 1e-4)?;
            if gelu {
                // the same backward adding dinp's column sums into a bias span of width IC
                let pre_bias = Span { off: ln_b.off, len: c };
                let mut dinp2 = cx.out(rows * ic, true)?;
                let mut dparams2 = cx.buf(&grads_init, false)?;
                let Some(g) = dg.as_ref() else { continue };
                cx.be.matmul_backward_gelu_bias(&mut dinp2.d, &mut dparams2.d, &dout.d, &inp.d, &g.d, GeluSaved::Pre, pre_bias, &params.d, w, bias, rows, ic, oc)?;
                cpu.matmul_backward_gelu_bias(&mut dinp2.c, &mut dparams2.c, &dout.c, &inp.c, &g.c, GeluSaved::Pre, pre_bias, &params.c, w, bias, rows, ic, oc)?;
                cx.compare(&format!("matmul_backward_gelu_bias {name} dinp {tag}"), &dinp2, F32_TOL)?;
                cx.compare_split(&format!("matmul_backward_gelu_bias {name} dW,dbias(+=) {tag}"), &dparams2, pre_bias, "dpre_bias(+=)", 1e-4)?;
                // with `g` taken as a saved derivative (GeluSaved::Grad): dinp ⊙ g
                let mut dinp3 = cx.out(rows * ic, true)?;
                let mut dparams3 = cx.buf(&grads_init, false)?;
                cx.be.matmul_backward_gelu_bias(&mut dinp3.d, &mut dparams3.d, &dout.d, &inp.d, &g.d, GeluSaved::Grad, pre_bias, &params.d, w, bias, rows, ic, oc)?;
                cpu.matmul_backward_gelu_bias(&mut dinp3.c, &mut dparams3.c, &dout.c, &inp.c, &g.c, GeluSaved::Grad, pre_bias, &params.c, w, bias, rows, ic, oc)?;
                cx.compare(&format!("matmul_backward_gelu_bias (saved gelu') {name} dinp {tag}"), &dinp3, F32_TOL)?;
                cx.compare_split(&format!("matmul_backward_gelu_bias (saved gelu') {name} dW,dbias(+=) {tag}"), &dparams3, pre_bias, "dpre_bias(+=)", 1e-4)?;
            }
        }

        // projections with the residual add folded in (attention proj C→C, MLP fc2 F→C; the
        // weights reuse the qkv/fc1 spans), and the GELU regenerated in the backward
        for (name, w, bias, ic) in [
            ("proj", Span { off: w_qkv.off, len: c * c }, Span { off: b_qkv.off, len: c }, c),
            ("fc2", w_fc1, Span { off: b_qkv.off, len: c }, f),
        ] {
            let inp = cx.rand(bn * ic, 1.0, true)?;
            let res = cx.rand(bn * c, 1.0, true)?;
            let mut out = cx.out(bn * c, true)?;
            cx.be.matmul_forward_residual(&mut out.d, &res.d, &inp.d, &params.d, w, Some(bias), bn, ic, c)?;
            cpu.matmul_forward_residual(&mut out.c, &res.c, &inp.c, &params.c, w, Some(bias), bn, ic, c)?;
            cx.compare(&format!("matmul_forward_residual {name} {tag}"), &out, F32_TOL)?;
        }
        for (label, pre_bias) in [("", None), (" + fc1 bias", Some(b_fc1))] {
            let pre = cx.rand(bn * f, 3.0, true)?;
            let mut act = cx.out(bn * f, true)?;
            cx.be.gelu_forward(&mut act.d, &pre.d, &params.d, pre_bias, bn, f)?;
            cpu.gelu_forward(&mut act.c, &pre.c, &params.c, pre_bias, bn, f)?;
            cx.compare(&format!("gelu_forward{label} {tag}"), &act, F32_TOL)?;
        }
        {
            // the GELU passes' unaligned fallbacks: 12 columns (not a multiple of 8) and a bias
            // at an odd element offset (2-byte aligned)
            let (rows, ic, oc) = (7usize, 12usize, 16usize);
            let pb = Span { off: b_fc1.off + 1, len: ic };
            let pre = cx.rand(rows * ic, 3.0, true)?;
            let mut act = cx.out(rows * ic, true)?;
            cx.be.gelu_forward(&mut act.d, &pre.d, &params.d, Some(pb), rows, ic)?;
            cpu.gelu_forward(&mut act.c, &pre.c, &params.c, Some(pb), rows, ic)?;
            cx.compare(&format!("gelu_forward + bias (12 columns, unaligned bias) {tag}"), &act, F32_TOL)?;
            let dout = cx.rand(rows * oc, 1.0, true)?;
            let w = Span { off: w_fc1.off, len: oc * ic };
            // dW's input drawn afresh: the two backends' `act` differ by bf16 rounding
            let inp = cx.rand(rows * ic, 1.0, true)?;
            for (label, what) in [("", GeluSaved::Pre), (" (saved gelu')", GeluSaved::Grad)] {
                let mut dinp = cx.out(rows * ic, true)?;
                let mut dparams = cx.buf(&grads_init, false)?;
                cx.be.matmul_backward_gelu_bias(&mut dinp.d, &mut dparams.d, &dout.d, &inp.d, &pre.d, what, pb, &params.d, w, None, rows, ic, oc)?;
                cpu.matmul_backward_gelu_bias(&mut dinp.c, &mut dparams.c, &dout.c, &inp.c, &pre.c, what, pb, &params.c, w, None, rows, ic, oc)?;
                cx.compare(&format!("matmul_backward_gelu_bias{label} (12 columns, unaligned bias) dinp {tag}"), &dinp, F32_TOL)?;
                cx.compare_split(&format!("matmul_backward_gelu_bias{label} (12 columns, unaligned bias) dW(+=) {tag}"), &dparams, pb, "dpre_bias(+=)", 1e-4)?;
            }
            // the forward saving the derivative at this width: fc1 (ic → 12 outputs) with the bias at pb
            let x12 = cx.rand(rows * oc, 1.0, true)?;
            let mut act12 = cx.out(rows * ic, true)?;
            let mut grad12 = cx.out(rows * ic, true)?;
            let w12 = Span { off: w_fc1.off, len: ic * oc };
            cx.be.matmul_forward(&mut act12.d, Some((&mut grad12.d, GeluSaved::Grad)), &x12.d, &params.d, w12, Some(pb), rows, oc, ic)?;
            cpu.matmul_forward(&mut act12.c, Some((&mut grad12.c, GeluSaved::Grad)), &x12.c, &params.c, w12, Some(pb), rows, oc, ic)?;
            cx.compare(&format!("matmul_forward fc1+gelu (12 columns, unaligned bias, saving gelu') {tag}"), &act12, F32_TOL)?;
            cx.compare(&format!("matmul_forward fc1+gelu gelu' (12 columns, unaligned bias) {tag}"), &grad12, F32_TOL)?;
        }

        // layernorm
        let mut ln = cx.out(bn * c, true)?;
        let mut mean = cx.out(bn, false)?;
        let mut rstd = cx.out(bn, false)?;
        let xs = cx.rand(bn * c, 2.0, true)?;
        cx.be.layernorm_forward(&mut ln.d, &mut mean.d, &mut rstd.d, &xs.d, &params.d, ln_w, ln_b, bn, c)?;
        cpu.layernorm_forward(&mut ln.c, &mut mean.c, &mut rstd.c, &xs.c, &params.c, ln_w, ln_b, bn, c)?;
        cx.compare(&format!("layernorm_forward out {tag}"), &ln, F32_TOL)?;
        cx.compare(&format!("layernorm_forward mean {tag}"), &mean, F32_TOL)?;
        cx.compare(&format!("layernorm_forward rstd {tag}"), &rstd, F32_TOL)?;
        // (with the residual gradient, with dinp's column sums into a bias span)
        for (with_res, with_sum) in [(true, false), (false, false), (true, true), (false, true)] {
            let dout = cx.rand(bn * c, 1.0, true)?;
            let dres = cx.rand(bn * c, 1.0, true)?;
            let mut dx = cx.out(bn * c, true)?;
            let mut dparams = cx.buf(&grads_init, false)?;
            let sum = with_sum.then_some(Span { off: b_qkv.off, len: c });
            cx.be.layernorm_backward(&mut dx.d, &mut dparams.d, &dout.d, with_res.then_some(&dres.d), &xs.d, &mean.d, &rstd.d, &params.d, ln_w, ln_b, bn, c, sum)?;
            cpu.layernorm_backward(&mut dx.c, &mut dparams.c, &dout.c, with_res.then_some(&dres.c), &xs.c, &mean.c, &rstd.c, &params.c, ln_w, ln_b, bn, c, sum)?;
            let label = if with_sum { " +Σdinp" } else { "" };
            cx.compare(&format!("layernorm_backward dinp res={with_res}{label} {tag}"), &dx, F32_TOL)?;
            // The device sums the bf16 dinp it wrote (what the GEMMs read), the CPU its f32
            // values: bf16 rounding (≤ 2⁻⁹ per element), so the sums get the compute tolerance.
            match sum {
                Some(s) => cx.compare_split(&format!("layernorm_backward dw,db(+=) res={with_res}{label} {tag}"), &dparams, s, "Σdinp(+=)", 1e-4)?,
                None => cx.compare(&format!("layernorm_backward dw,db(+=) res={with_res}{label} {tag}"), &dparams, 1e-4)?,
            }
        }

        // attention
        attention_check(cx, b, n, h, d, "")?;

        // residual add, pooling
        let a1 = cx.rand(bn * c, 1.0, true)?;
        let a2 = cx.rand(bn * c, 1.0, true)?;
        let mut sum = cx.out(bn * c, true)?;
        cx.be.add(&mut sum.d, &a1.d, &a2.d)?;
        cpu.add(&mut sum.c, &a1.c, &a2.c)?;
        cx.compare(&format!("add {tag}"), &sum, F32_TOL)?;
        for avg in [false, true] {
            let mut pooled = cx.out(b * c, true)?;
            cx.be.pool_forward(&mut pooled.d, &a1.d, b, n, c, 1, avg)?;
            cpu.pool_forward(&mut pooled.c, &a1.c, b, n, c, 1, avg)?;
            cx.compare(&format!("pool_forward avg={avg} {tag}"), &pooled, F32_TOL)?;
            let dp = cx.rand(b * c, 1.0, true)?;
            let mut dx = cx.out(bn * c, true)?;
            cx.be.pool_backward(&mut dx.d, &dp.d, b, n, c, 1, avg)?;
            cpu.pool_backward(&mut dx.c, &dp.c, b, n, c, 1, avg)?;
            cx.compare(&format!("pool_backward avg={avg} {tag}"), &dx, F32_TOL)?;
        }

        // loss with soft targets
        let logits = cx.rand(b * k, 3.0, true)?;
        let mut t = cx.randn(b * k, 1.0).iter().map(|v| v.exp()).collect::<Vec<_>>();
        for row in t.chunks_mut(k) {
            let s: f32 = row.iter().sum();
            row.iter_mut().for_each(|v| *v /= s);
        }
        let targets = cx.buf(&t, false)?;
        let mut losses = cx.out(b, false)?;
        let mut dlogits = cx.out(b * k, true)?;
        cx.be.cross_entropy(&mut losses.d, Some(&mut dlogits.d), &logits.d, &targets.d, b, k, 1.0 / b as f32)?;
        cpu.cross_entropy(&mut losses.c, Some(&mut dlogits.c), &logits.c, &targets.c, b, k, 1.0 / b as f32)?;
        cx.compare(&format!("cross_entropy losses {tag}"), &losses, F32_TOL)?;
        cx.compare(&format!("cross_entropy dlogits {tag}"), &dlogits, F32_TOL)?;
    }
    Ok(())
}

/// Attention forward and backward at one shape against the CPU. The saved state is compared
/// only when the device keeps the probabilities; each backward reads its own forward's state
/// and output.
fn attention_check<B: Backend>(cx: &mut Ctx<B>, b: usize, n: usize, h: usize, d: usize, path: &str) -> BResult<()> {
    let c = h * d;
    let bn = b * n;
    let shape = format!("[B{b} N{n} H{h} D{d}]");
    let tag = format!("{shape}{path}");
    let qkv = cx.rand(bn * 3 * c, 1.0, true)?;
    let mut att = cx.out(bn * c, true)?;
    let saved = cx.be.attention_saved_len(b, n, h, d);
    // the saved state can exceed B·H·N·N (an f32 log-sum-exp per row when N = 1)
    let mut probs = cx.out(saved.max(b * h * n * n), true)?;
    cx.be.attention_forward(&mut att.d, &mut probs.d, &qkv.d, b, n, h, d)?;
    cx.cpu_ref(&format!("attention_forward {shape}"), &mut [&mut att.c, &mut probs.c], |cpu, o| {
        let [att, probs] = o else { unreachable!() };
        cpu.attention_forward(att, probs, &qkv.c, b, n, h, d)
    })?;
    cx.compare(&format!("attention_forward out {tag}"), &att, F32_TOL)?;
    if saved == b * h * n * n {
        cx.compare(&format!("attention_forward probs {tag}"), &probs, F32_TOL)?;
    }
    // Each backward reads its own forward's output and saved state.
    let datt = cx.rand(bn * c, 1.0, true)?;
    let mut dqkv = cx.out(bn * 3 * c, true)?;
    cx.be.attention_backward(&mut dqkv.d, &datt.d, &qkv.d, &att.d, &probs.d, b, n, h, d)?;
    cx.cpu_ref(&format!("attention_backward {shape}"), &mut [&mut dqkv.c], |cpu, o| cpu.attention_backward(o[0], &datt.c, &qkv.c, &att.c, &probs.c, b, n, h, d))?;
    cx.compare(&format!("attention_backward dqkv {tag}"), &dqkv, F32_TOL)?;
    // with the qkv bias gradient added into a span of a larger f32 buffer (+=; the rest untouched)
    let span = Span { off: 4, len: 3 * c };
    let mut dparams = cx.rand(3 * c + 8, 0.1, false)?;
    let mut dqkv2 = cx.out(bn * 3 * c, true)?;
    cx.be.attention_backward_bias(&mut dqkv2.d, &mut dparams.d, span, &datt.d, &qkv.d, &att.d, &probs.d, b, n, h, d)?;
    cx.cpu_ref(&format!("attention_backward_bias {shape}"), &mut [&mut dqkv2.c, &mut dparams.c], |cpu, o| {
        let [dqkv2, dparams] = o else { unreachable!() };
        cpu.attention_backward_bias(dqkv2, dparams, span, &datt.c, &qkv.c, &att.c, &probs.c, b, n, h, d)
    })?;
    cx.compare(&format!("attention_backward_bias dqkv {tag}"), &dqkv2, F32_TOL)?;
    cx.compare_split(&format!("attention_backward_bias rest {tag}"), &dparams, span, "dbias(+=)", F32_TOL)?;
    class_attention_check(cx, b, n, h, d, &tag)
}

/// The class token's attention (the last block under token pooling: the class tokens' queries
/// (B, C) against every token's keys and values (B, N, 2C)) against the CPU, with and without
/// the key/value bias gradient, and the query projection's input gradient added into the class
/// rows (`add_class_rows`). Outputs start as NaN on the device, so every element must be written.
fn class_attention_check<B: Backend>(cx: &mut Ctx<B>, b: usize, n: usize, h: usize, d: usize, tag: &str) -> BResult<()> {
    let cpu = cx.cpu;
    let c = h * d;
    let bn = b * n;
    let q = cx.rand(b * c, 1.0, true)?;
    let kv = cx.rand(bn * 2 * c, 1.0, true)?;
    let mut cls = cx.out(b * c, true)?;
    cx.be.class_attention_forward(&mut cls.d, &q.d, &kv.d, b, n, h, d)?;
    cpu.class_attention_forward(&mut cls.c, &q.c, &kv.c, b, n, h, d)?;
    cx.compare(&format!("class_attention_forward out {tag}"), &cls, F32_TOL)?;
    let dcls = cx.rand(b * c, 1.0, true)?;
    let span = Span { off: 4, len: 2 * c };
    for with_bias in [false, true] {
        let mut dq = cx.out(b * c, true)?;
        let mut dkv = cx.out(bn * 2 * c, true)?;
        let mut dparams = cx.rand(2 * c + 8, 0.1, false)?;
        let bias = with_bias.then_some(span);
        cx.be.class_attention_backward(&mut dq.d, &mut dkv.d, &mut dparams.d, bias, &dcls.d, &q.d, &kv.d, b, n, h, d)?;
        cpu.class_attention_backward(&mut dq.c, &mut dkv.c, &mut dparams.c, bias, &dcls.c, &q.c, &kv.c, b, n, h, d)?;
        cx.compare(&format!("class_attention_backward dq bias={with_bias} {tag}"), &dq, F32_TOL)?;
        cx.compare(&format!("class_attention_backward dkv bias={with_bias} {tag}"), &dkv, F32_TOL)?;
        cx.compare_split(&format!("class_attention_backward rest bias={with_bias} {tag}"), &dparams, span, "dbias(+=)", F32_TOL)?;
    }
    let mut dst = cx.rand(bn * c, 1.0, true)?;
    cx.be.add_class_rows(&mut dst.d, &dcls.d, b, n, c)?;
    cpu.add_class_rows(&mut dst.c, &dcls.c, b, n, c)?;
    cx.compare(&format!("add_class_rows {tag}"), &dst, F32_TOL)
}

/// Attention shapes that matter for the fused kernels: CIFAR ViT-S/4 (N 65), 224-px/16
/// (N 197), odd N (50, 17), D 32 and 64, long sequences (N 1025, past the short-sequence
/// backward), a batch large enough to fill the GPU (B·H = 384 heads × 4 query blocks), and the
/// short backward's edges (N 256: two full key passes; N 129: a second pass of one key), the
/// small-head kernels' (N ≤ 80: 65 at a GPU-filling batch, 80 and 64 with no padding, 1, and
/// 81, the first N past them), and the 13-warp whole-head backward's (D 64, N 193–208: 197,
/// 193 and 208 at its ends, 209 past it); the tiled kernels' other head dims (80: ViT-H/14 at
/// 257 tokens and a ragged 50; 96; 128 short, at 1025 and long) and long sequences (4097:
/// ViT-B/16 at 1024 px; 16384; past 1024 tokens the forward's 128-query blocks, every head dim),
/// and the long wgmma forward's first key tile (N mod 128 = 1, 2, 16: the short tile of 16
/// keys; 17, 65: a masked whole tile; 0: none masked). `path` labels the checks.
pub fn attention_checks<B: Backend>(be: &B, seed: u64, path: &str) -> BResult<Vec<Check>> {
    attention_checks_memo(be, seed, path, &mut ReferenceMemo::default())
}

/// `attention_checks` keeping the CPU references in `memo` for another pass with the same
/// seed (a pass with another seed clears it).
pub fn attention_checks_memo<B: Backend>(be: &B, seed: u64, path: &str, memo: &mut ReferenceMemo) -> BResult<Vec<Check>> {
    let tol_c = if be.needs_compute_copy() { 1e-2 } else { F32_TOL };
    let mut cx = Ctx { be, cpu: Cpu::new(), rng: ChaCha8Rng::seed_from_u64(seed), checks: Vec::new(), tol_c, memo: std::mem::take(memo).for_seed(seed) };
    for &(b, n, h, d) in &[(2usize, 65usize, 6usize, 64usize), (3, 197, 4, 64), (3, 50, 5, 64), (2, 17, 3, 32), (2, 65, 3, 32), (1, 1025, 2, 64), (32, 197, 12, 64), (2, 256, 2, 64), (2, 129, 3, 32), (64, 65, 6, 64), (2, 80, 2, 64), (2, 64, 3, 32), (3, 1, 2, 64), (2, 81, 2, 64), (2, 193, 2, 64), (2, 208, 3, 64), (2, 209, 2, 64),
        (2, 257, 4, 80), (2, 50, 3, 80), (2, 197, 2, 96), (2, 65, 2, 128), (1, 1025, 2, 128), (1, 4097, 2, 64), (1, 4097, 1, 80), (1, 16384, 1, 64), (1, 1090, 2, 32), (1, 1030, 2, 96), (2, 577, 2, 64),
        (1, 272, 2, 80), (1, 384, 2, 80), (1, 258, 2, 64), (1, 273, 3, 64)] {
        attention_check(&mut cx, b, n, h, d, path)?;
    }
    // a head dim that is no multiple of 8: the class-token attention's element-wise kernels
    let (b, n, h, d) = (2, 9, 3, 12);
    let tail = class_attention_check(&mut cx, b, n, h, d, &format!("[B{b} N{n} H{h} D{d}]{path}"));
    *memo = cx.memo;
    tail?;
    Ok(cx.checks)
}

/// Float64 optimizer reference with torch semantics (AdamW / Adam+L2 / SGD).
fn optimizer_reference(p: &mut [f64], g: &[f64], st: &mut [f64], opt: &OptimizerConfig, decays: &[bool], lr_scales: &[f64], hyper: StepHyper) {
    let np = p.len();
    let norm = g.iter().map(|v| v * v).sum::<f64>().sqrt();
    let gs = if hyper.clip_norm > 0.0 { hyper.grad_scale as f64 * (hyper.clip_norm / (norm * hyper.grad_scale.abs() as f64 + 1e-6)).min(1.0) } else { hyper.grad_scale as f64 };
    match *opt {
        OptimizerConfig::Adam { beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, .. } => {
            let t = hyper.step as i32;
            let (bc1, bc2) = if bias_correction { (1.0 - beta1.powi(t), 1.0 - beta2.powi(t)) } else { (1.0, 1.0) };
            for i in 0..np {
                let lr = hyper.lr as f64 * lr_scales[i];
                let wd = if decays[i] { weight_decay } else { 0.0 };
                let mut gi = g[i] * gs;
                if !adam_w_mode {
                    gi += wd * p[i];
                }
                st[i] = beta1 * st[i] + (1.0 - beta1) * gi;
                st[np + i] = beta2 * st[np + i] + (1.0 - beta2) * gi * gi;
                let upd = (st[i] / bc1) / ((st[np + i] / bc2).sqrt() + eps);
                if adam_w_mode {
                    p[i] -= lr * wd * p[i];
                }
                p[i] -= lr * upd;
            }
        }
        OptimizerConfig::Sgd { momentum, dampening, weight_decay, nesterov, .. } => {
            for i in 0..np {
                let lr = hyper.lr as f64 * lr_scales[i];
                let wd = if decays[i] { weight_decay } else { 0.0 };
                let mut gi = g[i] * gs + wd * p[i];
                if momentum != 0.0 {
                    let b = if hyper.step <= 1 { gi } else { momentum * st[i] + (1.0 - dampening) * gi };
                    st[i] = b;
                    gi = if nesterov { gi + momentum * b } else { b };
                }
                p[i] -= lr * gi;
            }
        }
    }
}

fn optimizer_checks<B: Backend>(cx: &mut Ctx<B>) -> BResult<()> {
    // width 64: the MLP weights (16 384 values) span more than one of the CUDA kernels'
    // 8192-parameter blocks (OPT_CHUNK), the bias and LayerNorm segments less than one
    let cfg = ModelConfig { image_size: 8, patch_size: 4, in_chans: 3, embed_dim: 64, depth: 2, num_heads: 2, mlp_ratio: 4.0, num_classes: 10, qkv_bias: true, class_token: true, global_pool: GlobalPool::Token };
    let table = ParamTable::new(&cfg);
    let model_groups = ParamGroups::new(&table, &DecaySkip { bias: true, norm: true, pos_embed: true, cls_token: true });
    // Segments of odd starts and lengths, one of a single value at each end, over an even and an
    // odd count (the second moments at an even or odd offset): blocks that start mid-segment at
    // odd offsets, and the unaligned edges any vectorized form of the kernels must handle;
    // learning-rate factors of their own (layer-wise decay), one of them below 1e-3.
    let odd_groups = |n: usize| {
        let cuts = [0, 1, 8194, n - 1, n];
        let factors = [0.5f32, 1.0, 0.75f32.powi(25), 0.9];
        let groups = cuts.windows(2).enumerate().map(|(i, w)| ParamGroup { span: Span { off: w[0], len: w[1] - w[0] }, decays: i % 2 == 0, lr_scale: factors[i] }).collect();
        ParamGroups { groups }
    };
    let layouts = [("model spans", table.total, model_groups), ("odd spans, even count", 18_002, odd_groups(18_002)), ("odd spans, odd count", 18_001, odd_groups(18_001))];
    let opts = [
        ("adamw", OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.05, adam_w_mode: true, bias_correction: true }),
        ("adam+l2", OptimizerConfig::Adam { lr: 1e-3, beta1: 0.8, beta2: 0.99, eps: 1e-6, weight_decay: 0.01, adam_w_mode: false, bias_correction: true }),
        ("sgd nesterov", OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 1e-4, nesterov: true }),
        ("sgd dampened", OptimizerConfig::Sgd { lr: 0.05, momentum: 0.9, dampening: 0.1, weight_decay: 0.0, nesterov: false }),
    ];
    for ((name, opt), (layout, n, decay)) in opts.iter().flat_map(|o| layouts.iter().map(move |l| (o, l))) {
        let (opt, n) = (opt.clone(), *n);
        let mut decays = vec![true; n];
        let mut lr_scales = vec![1.0f64; n];
        for g in &decay.groups {
            decays[g.span.range()].iter_mut().for_each(|x| *x = g.decays);
            lr_scales[g.span.range()].iter_mut().for_each(|x| *x = g.lr_scale as f64);
        }
        let p0 = cx.randn(n, 0.1);
        let mut pd = cx.be.alloc_f32(n)?;
        cx.be.upload(&mut pd, 0, &p0)?;
        let mut sd = cx.be.alloc_f32(optimizer_state_len(&opt, n))?;
        let mut pr: Vec<f64> = p0.iter().map(|&v| v as f64).collect();
        let mut sr = vec![0f64; optimizer_state_len(&opt, n)];
        // the same steps through optimizer_step_cast, which writes the compute copy as well
        let mut pd_cast = cx.be.alloc_f32(n)?;
        cx.be.upload(&mut pd_cast, 0, &p0)?;
        let mut sd_cast = cx.be.alloc_f32(optimizer_state_len(&opt, n))?;
        let mut copy = cx.be.alloc(n)?;
        // the same steps over three pieces with gaps between them (a ZeRO shard), each with
        // its own state, clipped by a factor computed from the global norm on the host
        let pieces_at = [Span { off: 0, len: n / 3 }, Span { off: n / 3 + 7, len: n / 3 }, Span { off: 2 * (n / 3) + 11, len: n - 2 * (n / 3) - 11 }];
        let mut pieces = Vec::new();
        let mut soff = 0;
        for s in pieces_at {
            pieces.push((s, soff));
            soff += optimizer_state_len(&opt, s.len);
        }
        let mut pd_pieces = cx.be.alloc_f32(n)?;
        cx.be.upload(&mut pd_pieces, 0, &p0)?;
        let mut sd_pieces = cx.be.alloc_f32(soff)?;
        // the same pieces with their master weights after the state in one compact buffer,
        // writing a compute copy (where the backend has one: a ZeRO master shard)
        let shard_check = cx.be.needs_compute_copy();
        let mut shard_pieces = Vec::new();
        let mut moff = soff;
        for &(span, state_off) in &pieces {
            shard_pieces.push(crate::backend::ShardPiece { span, state_off, master_off: moff });
            moff += span.len;
        }
        let mut compact = cx.be.alloc_f32(if shard_check { moff } else { 1 })?;
        let mut copy_shard = cx.be.alloc(n)?;
        if shard_check {
            let masters: Vec<f32> = pieces_at.iter().flat_map(|s| p0[s.range()].to_vec()).collect();
            cx.be.upload(&mut compact, soff, &masters)?;
            cx.be.cast(&mut copy_shard, &pd)?;
        }
        // ZeRO-3's update: the pieces' f32 weights back to back in a buffer of their own
        let mut master_pieces = Vec::new();
        let mut master_off = 0;
        for &(span, state_off) in &pieces {
            master_pieces.push(crate::backend::ShardPiece { span, state_off, master_off });
            master_off += span.len;
        }
        let mut master = cx.be.alloc_f32(master_off.max(1))?;
        let owned: Vec<f32> = pieces_at.iter().flat_map(|s| p0[s.range()].to_vec()).collect();
        cx.be.upload(&mut master, 0, &owned)?;
        let mut sd_master = cx.be.alloc_f32(soff.max(1))?;
        let mut ss_err = 0f64;
        for step in 1..=3u64 {
            let g = cx.randn(n, 1.0);
            let mut gd = cx.be.alloc_f32(n)?;
            cx.be.upload(&mut gd, 0, &g)?;
            let ss_dev = cx.be.sum_squares_spans(&gd, &pieces_at, f32::INFINITY)?;
            let ss_ref: f64 = pieces_at.iter().flat_map(|s| &g[s.range()]).map(|&v| (v as f64) * (v as f64)).sum();
            ss_err = ss_err.max((ss_dev - ss_ref).abs() / ss_ref.max(f64::MIN_POSITIVE));
            // step 2 clips by the global norm (‖0.5·g‖ ≈ 0.5·√n, so a bound of 0.25·√n halves
            // it), step 3 has a bound the norm stays under
            let clip_norm = match step {
                2 => 0.25 * (n as f64).sqrt(),
                3 => (n as f64).sqrt(),
                _ => 0.0,
            };
            let hyper = StepHyper { lr: opt.lr() as f32 * (1.0 + 0.1 * step as f32), step, grad_scale: 0.5, clip_norm };
            cx.be.optimizer_step(&mut pd, &gd, &mut sd, &opt, decay, hyper)?;
            cx.be.optimizer_step_cast(&mut pd_cast, &gd, &mut sd_cast, &mut copy, &opt, decay, hyper)?;
            let full_norm = cx.be.sum_squares_spans(&gd, &[Span { off: 0, len: n }], f32::INFINITY)?.sqrt();
            let sharded = StepHyper { grad_scale: hyper.effective_grad_scale(full_norm), clip_norm: 0.0, ..hyper };
            cx.be.optimizer_step_pieces(&mut pd_pieces, &gd, &mut sd_pieces, &pieces, &opt, decay, sharded)?;
            if shard_check {
                cx.be.optimizer_step_shard(&mut compact, &gd, &mut copy_shard, &shard_pieces, &opt, decay, sharded)?;
            }
            // (its gradients partitioned as its weights: the pieces' back to back)
            let g_master: Vec<f32> = pieces_at.iter().flat_map(|s| g[s.range()].to_vec()).collect();
            let mut gd_master = cx.be.alloc_f32(g_master.len().max(1))?;
            cx.be.upload(&mut gd_master, 0, &g_master)?;
            cx.be.optimizer_step_master(&mut master, &gd_master, &mut sd_master, &master_pieces, &opt, decay, sharded)?;
            let g64: Vec<f64> = g.iter().map(|&v| v as f64).collect();
            optimizer_reference(&mut pr, &g64, &mut sr, &opt, &decays, &lr_scales, hyper);
        }
        let got = cx.be.download(&pd)?;
        let want: Vec<f32> = pr.iter().map(|&v| v as f32).collect();
        // Compare the update (p − p0), which is what the optimizer computes.
        let du: Vec<f32> = got.iter().zip(&p0).map(|(a, b)| a - b).collect();
        let dw: Vec<f32> = want.iter().zip(&p0).map(|(a, b)| a - b).collect();
        let e = rel_err(&du, &dw);
        // Update relative error: f32 arithmetic on values near p: 1e-4 of the update.
        cx.checks.push(Check { name: format!("optimizer_step {name}, {layout} (3 steps, vs f64 torch semantics)"), rel_err: e, tol: 1e-4, pass: e.is_finite() && e <= 1e-4 });
        // Writing the compute copy in the same pass changes nothing else, and the copy is what
        // the separate cast writes: both exact.
        let got_cast = cx.be.download(&pd_cast)?;
        let mut cast_ref = cx.be.alloc(n)?;
        cx.be.cast(&mut cast_ref, &pd_cast)?;
        let (copy_got, copy_want) = (cx.be.download(&copy)?, cx.be.download(&cast_ref)?);
        let diff = got_cast.iter().zip(&got).chain(copy_got.iter().zip(&copy_want)).map(|(a, b)| if a.to_bits() == b.to_bits() { 0.0 } else { (a - b).abs().max(f32::MIN_POSITIVE) }).fold(0f32, f32::max);
        cx.checks.push(Check { name: format!("optimizer_step_cast {name}, {layout}: weights as optimizer_step, copy as cast"), rel_err: diff as f64, tol: 0.0, pass: diff == 0.0 });
        // pieces: the whole-buffer step's update on their elements (the clip factor comes from
        // the host's f64 norm instead of the device's: f32 rounding of the factor), and the gaps
        // between them untouched
        let got_pieces = cx.be.download(&pd_pieces)?;
        let (mut dp, mut dwhole) = (Vec::new(), Vec::new());
        for s in pieces_at {
            dp.extend(s.range().map(|i| got_pieces[i] - p0[i]));
            dwhole.extend(s.range().map(|i| got[i] - p0[i]));
        }
        let e = rel_err(&dp, &dwhole);
        let mut covered = vec![false; n];
        pieces_at.iter().for_each(|s| covered[s.range()].iter_mut().for_each(|c| *c = true));
        let gaps_kept = (0..n).filter(|&i| !covered[i]).all(|i| got_pieces[i].to_bits() == p0[i].to_bits());
        cx.checks.push(Check { name: format!("optimizer_step_pieces {name}, {layout}: as optimizer_step on three pieces, gaps untouched"), rel_err: e, tol: 1e-5, pass: e.is_finite() && e <= 1e-5 && gaps_kept });
        if shard_check {
            // the same kernel on the same values: master pieces, state and compute copy exact;
            // the compute copy's gaps keep what they held
            let (c, copy, p0_copy) = (cx.be.download(&compact)?, cx.be.download(&copy_shard)?, {
                let mut b = cx.be.alloc(n)?;
                let mut p0d = cx.be.alloc_f32(n)?;
                cx.be.upload(&mut p0d, 0, &p0)?;
                cx.be.cast(&mut b, &p0d)?;
                cx.be.download(&b)?
            });
            let mut want_copy = cx.be.alloc(n)?;
            cx.be.cast(&mut want_copy, &pd_pieces)?;
            let want_copy = cx.be.download(&want_copy)?;
            let st = cx.be.download(&sd_pieces)?;
            let mut exact = c[..soff] == st[..];
            for q in &shard_pieces {
                exact &= c[q.master_off..q.master_off + q.span.len].iter().zip(&got_pieces[q.span.range()]).all(|(a, b)| a.to_bits() == b.to_bits());
                exact &= copy[q.span.range()].iter().zip(&want_copy[q.span.range()]).all(|(a, b)| a.to_bits() == b.to_bits());
            }
            exact &= (0..n).filter(|&i| !covered[i]).all(|i| copy[i].to_bits() == p0_copy[i].to_bits());
            cx.checks.push(Check { name: format!("optimizer_step_shard {name}, {layout}: master, state and compute copy as optimizer_step_pieces"), rel_err: if exact { 0.0 } else { 1.0 }, tol: 0.0, pass: exact });
        }
        {
            // the same kernel on the same values: weights and state exact
            let (m, st_m, st) = (cx.be.download(&master)?, cx.be.download(&sd_master)?, cx.be.download(&sd_pieces)?);
            let mut exact = st_m[..soff] == st[..soff];
            for q in &master_pieces {
                exact &= m[q.master_off..q.master_off + q.span.len].iter().zip(&got_pieces[q.span.range()]).all(|(a, b)| a.to_bits() == b.to_bits());
            }
            cx.checks.push(Check { name: format!("optimizer_step_master {name}, {layout}: pieces and their gradients back to back, state as optimizer_step_pieces"), rel_err: if exact { 0.0 } else { 1.0 }, tol: 0.0, pass: exact });
        }
        cx.checks.push(Check { name: format!("sum_squares_spans {name}, {layout} (vs f64 on the host)"), rel_err: ss_err, tol: 1e-6, pass: ss_err.is_finite() && ss_err <= 1e-6 });
    }
    Ok(())
}

/// `copy_span` as ZeRO-3's gathers and gradient slot use it, on fresh random values at odd
/// offsets: f32 → f32 and compute → compute exact, f32 → compute dtype as `cast` rounds it
/// (exact too), and every element outside the span untouched; `add_span` (ZeRO-3's gradient
/// accumulation) exact against the host's f32 sums.
fn copy_span_checks<B: Backend>(cx: &mut Ctx<B>) -> BResult<()> {
    let (n, off_s, off_d, len) = (3001, 17, 233, 2021);
    let src = cx.randn(n, 1.0);
    let before = cx.randn(n, 1.0);
    let mut s32 = cx.be.alloc_f32(n)?;
    cx.be.upload(&mut s32, 0, &src)?;
    // the reference of the dtype conversion: the backend's own whole-buffer cast
    let mut s_c = cx.be.alloc(n)?;
    cx.be.cast(&mut s_c, &s32)?;
    let src_c = cx.be.download(&s_c)?;
    for (what, to_compute, from_compute) in [("f32 -> f32", false, false), ("f32 -> compute dtype", true, false), ("compute dtype -> compute dtype", true, true)] {
        let mut dst = if to_compute { cx.be.alloc(n)? } else { cx.be.alloc_f32(n)? };
        cx.be.upload(&mut dst, 0, &before)?;
        let old = cx.be.download(&dst)?;
        let from = if from_compute { &s_c } else { &s32 };
        cx.be.copy_span(&mut dst, off_d, from, off_s, len)?;
        let got = cx.be.download(&dst)?;
        let want_src = if to_compute { &src_c } else { &src };
        let inside = (0..len).all(|i| got[off_d + i].to_bits() == want_src[off_s + i].to_bits());
        let outside = (0..n).filter(|&i| i < off_d || i >= off_d + len).all(|i| got[i].to_bits() == old[i].to_bits());
        let ok = inside && outside;
        cx.checks.push(Check { name: format!("copy_span {what}: the span exact, the rest untouched"), rel_err: if ok { 0.0 } else { 1.0 }, tol: 0.0, pass: ok });
    }
    // add_span, as ZeRO-3 adds a reduced gradient shard into the partitioned gradients: each
    // element of the span the f32 sum (exact: one rounding, the host's), the rest untouched
    let mut dst = cx.be.alloc_f32(n)?;
    cx.be.upload(&mut dst, 0, &before)?;
    cx.be.add_span(&mut dst, off_d, &s32, off_s, len)?;
    let got = cx.be.download(&dst)?;
    let inside = (0..len).all(|i| got[off_d + i].to_bits() == (before[off_d + i] + src[off_s + i]).to_bits());
    let outside = (0..n).filter(|&i| i < off_d || i >= off_d + len).all(|i| got[i].to_bits() == before[i].to_bits());
    let ok = inside && outside;
    cx.checks.push(Check { name: "add_span f32: the span the exact f32 sum, the rest untouched".into(), rel_err: if ok { 0.0 } else { 1.0 }, tol: 0.0, pass: ok });
    Ok(())
}

/// `copy_strided` as sequence parallelism packs and unpacks its all-to-alls, on fresh random
/// values: every copied row exact and every other element untouched, against a host loop over
/// the same indices; shapes that take the 16-byte path on a GPU (compute dtype, multiples of
/// 8 values) and the element path (odd lengths and offsets, f32 → compute dtype as `cast`).
fn copy_strided_checks<B: Backend>(cx: &mut Ctx<B>) -> BResult<()> {
    use crate::backend::StridedCopy;
    // (what, copy, src in f32, dst in f32): an SP pack of 2 ranks' blocks (B 3, 5 tokens × 3
    // parts, head slice of 64 of 128), its unpack, and an unaligned copy
    let cases = [
        ("pack, 16-byte rows", StridedCopy { count: [2, 3, 15], len: 64, src_off: 0, src_stride: [64, 15 * 128, 128], dst_off: 0, dst_stride: [3 * 16 * 64, 16 * 64, 64] }, false, false),
        ("unpack, 16-byte rows", StridedCopy { count: [1, 3, 5], len: 3 * 64, src_off: 1024, src_stride: [0, 16 * 64, 3 * 64], dst_off: 5 * 192, dst_stride: [0, 11 * 192, 192] }, false, false),
        ("odd offsets and length", StridedCopy { count: [3, 2, 7], len: 13, src_off: 5, src_stride: [301, 97, 13], dst_off: 3, dst_stride: [200, 99, 14] }, false, false),
        ("f32 -> compute dtype", StridedCopy { count: [2, 2, 6], len: 24, src_off: 8, src_stride: [400, 150, 24], dst_off: 16, dst_stride: [320, 160, 24] }, true, false),
    ];
    for (what, c, src_f32, dst_f32) in cases {
        let (ns, nd) = (c.extent(c.src_off, c.src_stride) + 11, c.extent(c.dst_off, c.dst_stride) + 11);
        let (sv, dv) = (cx.randn(ns, 1.0), cx.randn(nd, 1.0));
        let mut src = if src_f32 { cx.be.alloc_f32(ns)? } else { cx.be.alloc(ns)? };
        let mut dst = if dst_f32 { cx.be.alloc_f32(nd)? } else { cx.be.alloc(nd)? };
        cx.be.upload(&mut src, 0, &sv)?;
        cx.be.upload(&mut dst, 0, &dv)?;
        // the values as the buffers hold them; a converted copy rounds as the backend's cast
        let held = cx.be.download(&src)?;
        let want_from = if src_f32 && !dst_f32 {
            let mut as_dst = cx.be.alloc(ns)?;
            cx.be.cast(&mut as_dst, &src)?;
            cx.be.download(&as_dst)?
        } else {
            held
        };
        let mut want = cx.be.download(&dst)?;
        for i0 in 0..c.count[0] {
            for i1 in 0..c.count[1] {
                for i2 in 0..c.count[2] {
                    let s0 = c.src_off + i0 * c.src_stride[0] + i1 * c.src_stride[1] + i2 * c.src_stride[2];
                    let d0 = c.dst_off + i0 * c.dst_stride[0] + i1 * c.dst_stride[1] + i2 * c.dst_stride[2];
                    for e in 0..c.len {
                        want[d0 + e] = want_from[s0 + e];
                    }
                }
            }
        }
        cx.be.copy_strided(&mut dst, &src, &c)?;
        let got = cx.be.download(&dst)?;
        let ok = got.len() == want.len() && got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
        cx.checks.push(Check { name: format!("copy_strided {what}: the rows exact, the rest untouched"), rel_err: if ok { 0.0 } else { 1.0 }, tol: 0.0, pass: ok });
    }
    // a copy reaching past a buffer is an error, not a write
    let small = cx.be.alloc(10)?;
    let mut big = cx.be.alloc(100)?;
    let refused = cx.be.copy_strided(&mut big, &small, &StridedCopy { count: [1, 1, 2], len: 8, src_off: 0, src_stride: [0, 0, 8], dst_off: 0, dst_stride: [0, 0, 8] }).is_err();
    cx.checks.push(Check { name: "copy_strided past the end of src: an error".into(), rel_err: if refused { 0.0 } else { 1.0 }, tol: 0.0, pass: refused });
    Ok(())
}

/// Trains a small ViT for `steps` SGD steps on both backends; returns (device, cpu) losses.
pub fn training_losses<B: Backend>(be: &B, seed: u64, steps: usize) -> BResult<(Vec<f32>, Vec<f32>)> {
    let (cfg, init, batches, opt, decay, b) = small_training_setup(seed);
    let dev = train_small(be, &cfg, &init, &batches, &opt, &decay, b, steps, Recompute::Auto)?;
    let cpu = train_small(&Cpu::new(), &cfg, &init, &batches, &opt, &decay, b, steps, Recompute::Auto)?;
    Ok((dev, cpu))
}

/// The memory policies the training checks compare with keeping every activation, and what
/// each does: regenerating LayerNorm/GELU outputs, checkpointing every block (the attention
/// output kept where the backend's state allows), checkpointing with the attention recomputed.
const OTHER_POLICIES: [(Recompute, &str); 3] = [
    (Recompute::Always, "regenerating LayerNorm/GELU outputs"),
    (Recompute::Blocks, "checkpointing every block"),
    (Recompute::BlocksFull, "checkpointing every block, attention recomputed"),
];

/// The same training on `be` keeping every activation, then under each of `OTHER_POLICIES`:
/// (kept, each policy's losses), which must be identical (the same kernels on the same inputs).
pub fn recompute_losses<B: Backend>(be: &B, seed: u64, steps: usize) -> BResult<(Vec<f32>, Vec<Vec<f32>>)> {
    let (cfg, init, batches, opt, decay, b) = small_training_setup(seed);
    let never = train_small(be, &cfg, &init, &batches, &opt, &decay, b, steps, Recompute::Never)?;
    let others = OTHER_POLICIES.iter().map(|&(p, _)| train_small(be, &cfg, &init, &batches, &opt, &decay, b, steps, p)).collect::<BResult<Vec<_>>>()?;
    Ok((never, others))
}

type Batches = Vec<(Vec<f32>, Vec<f32>)>;

fn small_training_setup(seed: u64) -> (ModelConfig, Vec<f32>, Batches, OptimizerConfig, ParamGroups, usize) {
    let cfg = ModelConfig { image_size: 32, patch_size: 4, in_chans: 3, embed_dim: 96, depth: 3, num_heads: 3, mlp_ratio: 4.0, num_classes: 10, qkv_bias: true, class_token: true, global_pool: GlobalPool::Token };
    let b = 16;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let init = crate::model::init::init_params(&ParamTable::new(&cfg), seed);
    let opt = OptimizerConfig::Sgd { lr: 0.05, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false };
    let decay = ParamGroups::new(&ParamTable::new(&cfg), &DecaySkip { bias: true, norm: true, pos_embed: true, cls_token: true });
    // A fixed set of 4 batches, cycled: learnable, so the loss moves.
    let batches: Batches = (0..4)
        .map(|_| {
            let img: Vec<f32> = (0..b * 3 * 32 * 32).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            let labels: Vec<u32> = (0..b).map(|_| rng.gen_range(0..10)).collect();
            (img, crate::model::vit::smoothed_targets(&labels, 10, 0.1))
        })
        .collect();
    (cfg, init, batches, opt, decay, b)
}

/// `steps` optimizer steps of the training step (`train::step::Step`, one pass per step, no
/// clipping) on `be`; returns each step's mean loss.
#[allow(clippy::too_many_arguments)]
fn train_small<B2: Backend>(be: &B2, cfg: &ModelConfig, init: &[f32], batches: &[(Vec<f32>, Vec<f32>)], opt: &OptimizerConfig, decay: &ParamGroups, b: usize, steps: usize, policy: Recompute) -> BResult<Vec<f32>> {
    let as_backend = |e: TrainError| match e {
        TrainError::Backend(e) => e,
        other => crate::backend::BackendError::Device(other.to_string()),
    };
    let mut m = Vit::new(be, cfg.clone())?;
    m.set_params(be, init)?;
    let plan = Plan::new(be, cfg, b, 1, 1, Some(b), policy);
    let mut st = Step::new(be, m, opt.clone(), decay.clone(), 0.0, plan).map_err(as_backend)?;
    // A static loss scale of 1024 on every backend, as an fp16 block would set it: a power of
    // two, so f32 and bf16 training are unchanged by it, and it keeps an fp16 device's
    // activation gradients out of fp16's subnormal range (the loss gradient, at most
    // 1024 / 16 = 64, stays far below 65504, so no step is skipped).
    st.loss_scaling = crate::train::loss_scale::LossScaling::for_precision(&crate::config::Precision::Fp16 {
        loss_scale: 1024.0,
        initial_scale_power: 16,
        loss_scale_window: 1000,
        hysteresis: 2,
        min_loss_scale: 1.0,
        consecutive_hysteresis: false,
    });
    let mut out = Vec::new();
    for step in 0..steps {
        let (img, t) = &batches[step % batches.len()];
        let targets = |start: usize, n: usize| t[start * cfg.num_classes..(start + n) * cfg.num_classes].to_vec();
        let mb = MicroBatch { images: img, encoded: None, b, targets: &targets, keys: &[] };
        st.micro_batch(be, &mb, step as u64, false, None).map_err(as_backend)?;
        st.boundary(be, &mut LocalGrads, opt.lr(), step as u64, false).map_err(as_backend)?;
        let (_, sum) = st.take_losses(be).map_err(as_backend)?.pop().ok_or_else(|| crate::backend::BackendError::Device("no loss kept".into()))?;
        out.push((sum / b as f64) as f32);
    }
    Ok(out)
}

/// Runs every check on `be` against the CPU backend. `seed = None` draws a fresh seed.
pub fn run_checks<B: Backend>(be: &B, seed: Option<u64>) -> BResult<(u64, Vec<Check>, Vec<f32>, Vec<f32>)> {
    run_parts(be, seed, Parts::ALL)
}

/// [`run_checks`] of the backend-independent parts picked (`ops`, `optimizer`, `training`);
/// without `training` the two loss sequences are empty.
pub fn run_parts<B: Backend>(be: &B, seed: Option<u64>, parts: Parts) -> BResult<(u64, Vec<Check>, Vec<f32>, Vec<f32>)> {
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    let tol_c = if be.needs_compute_copy() { 1e-2 } else { F32_TOL };
    let mut cx = Ctx { be, cpu: Cpu::new(), rng: ChaCha8Rng::seed_from_u64(seed), checks: Vec::new(), tol_c, memo: ReferenceMemo::default() };
    // the inputs each part draws depend on the parts before it: a part alone draws others
    if parts.ops {
        op_checks(&mut cx)?;
    }
    if parts.optimizer {
        optimizer_checks(&mut cx)?;
    }
    if parts.ops {
        copy_span_checks(&mut cx)?;
        copy_strided_checks(&mut cx)?;
    }
    if !parts.training {
        return Ok((seed, cx.checks, Vec::new(), Vec::new()));
    }
    let (dev, cpu) = training_losses(be, seed, 20)?;
    let tol = if be.needs_compute_copy() { 2e-2 } else { 1e-4 };
    let worst = dev.iter().zip(&cpu).map(|(a, b)| if a.is_nan() { f64::NAN } else { ((a - b) / b).abs() as f64 }).fold(0f64, |m, e| if e.is_nan() || m.is_nan() { f64::NAN } else { m.max(e) });
    cx.checks.push(Check { name: "training: 20 SGD steps, small ViT (32px/4, C96, depth 3), per-step loss".into(), rel_err: worst, tol, pass: worst.is_finite() && worst <= tol && dev.len() == cpu.len() });
    let (never, others) = recompute_losses(be, seed, 5)?;
    for ((_, what), other) in OTHER_POLICIES.iter().zip(&others) {
        let same = never.len() == 5 && other.len() == 5 && never.iter().zip(other).all(|(a, b)| a.to_bits() == b.to_bits());
        let diff = never.iter().zip(other).map(|(a, b)| ((a - b) / b).abs() as f64).fold(0f64, f64::max);
        cx.checks.push(Check { name: format!("training: 5 steps keeping every activation vs {what}, bitwise"), rel_err: diff, tol: 0.0, pass: same });
    }
    Ok((seed, cx.checks, dev, cpu))
}

/// The opt-in Hopper GEMM kernels (`kernels/hopper.cu`) against the default cuBLASLt product
/// plus GELU passes, at the CIFAR ViT-S, ViT-B/16 and ViT-H/14 MLP shapes, 40 CIFAR images (252
/// tiles, so every block walks two or more and the epilogue's reads a tile ahead are exercised),
/// 120, and a small one, each with a partial last row tile (fresh random inputs) — the widths
/// that allow it (a multiple of 256) with 128×256 tiles in clusters of two blocks and as single
/// blocks, each with the 3- and 4-stage rings, and again with 128×128 — with either
/// saved form
/// (`GeluSaved`): fc1's forward (pre or gelu', and the GELU output) and fc2's input gradient with the GELU backward (dinp, and the weight and fc1-bias gradients
/// accumulated into random f32 values). Both paths round to bf16 from f32 sums (possibly in
/// different orders): relative error ≤ 1e-2 for bf16 outputs, 1e-4 for the f32 gradients; NaN
/// fails; a failed check too when the launch table shows the other path ran. On an H200 the
/// bf16 outputs agreed bit for bit. None when the kernels are not compiled (not sm_90).
pub fn hopper_gemm_checks(be: &crate::backend::cuda::Cuda, seed: u64) -> BResult<Option<Vec<Check>>> {
    if !be.has_fused_gemm() {
        return Ok(None);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6e11);
    let mut checks = Vec::new();
    let chosen = be.fused_gemm();
    let wide_chosen = be.wide_gemm();
    let cluster_chosen = be.gemm_cluster();
    let ring_chosen = be.gemm_ring();
    // runs `f` with the Hopper kernels on or off and records whether `kernel` ran as chosen
    // (and, with `clustered`, whether it ran in clusters: the launch table's name ends in "/c2")
    // (and, with `deep`, whether its 4-stage-ring form `_w4` ran)
    let run = |fused: bool, clustered: bool, deep: bool, kernel: &str, shape: &str, checks: &mut Vec<Check>, f: &mut dyn FnMut() -> BResult<()>| -> BResult<()> {
        be.set_fused_gemm(fused, fused);
        be.set_profiling(true);
        let r = f();
        be.set_fused_gemm(chosen.0, chosen.1);
        let launched = be.take_profile();
        be.set_profiling(false);
        r?;
        // (the 128×256-tile forms of a kernel are its name with `_w`, and `_w4` for the deep ring)
        let launched = launched?;
        let ours = |name: &str| name == kernel || name.strip_suffix("_w") == Some(kernel) || name.strip_suffix("_w4") == Some(kernel);
        let ran = launched.iter().any(|(name, _, _)| ours(name.strip_suffix("/c2").unwrap_or(name)));
        if ran != fused {
            checks.push(Check { name: format!("{kernel} chosen = {fused} but it {} [{shape}]", if ran { "ran" } else { "did not run" }), rel_err: f64::NAN, tol: 0.0, pass: false });
        }
        let in_clusters = launched.iter().any(|(name, _, _)| name.strip_suffix("/c2").is_some_and(ours));
        if ran && in_clusters != clustered {
            checks.push(Check { name: format!("{kernel} clusters chosen = {clustered} but it ran {} [{shape}]", if in_clusters { "in clusters" } else { "as single blocks" }), rel_err: f64::NAN, tol: 0.0, pass: false });
        }
        let ring4 = launched.iter().any(|(name, _, _)| name.strip_suffix("/c2").unwrap_or(name).strip_suffix("_w4") == Some(kernel));
        if ran && ring4 != deep {
            checks.push(Check { name: format!("{kernel} 4-stage ring chosen = {deep} but it ran with {} [{shape}]", if ring4 { "4 stages" } else { "3" }), rel_err: f64::NAN, tol: 0.0, pass: false });
        }
        Ok(())
    };
    // every shape with 128×256 tiles where the width allows (f % 256 == 0), in clusters of two
    // and as single blocks, each with the 3- and 4-stage rings, and with 128×128
    // tiles. 120 CIFAR images: 61 row tiles, so the last cluster's second block is past the
    // rows, and every cluster walks two or more units. 1 280 → 5 120 (ViT-H/14's MLP) has 20
    // K steps, so the 4-stage ring wraps five times a tile.
    let shapes = [(3 * 65, 384, 1536), (40 * 65, 384, 1536), (120 * 65, 384, 1536), (2 * 197, 768, 3072), (3 * 257, 1280, 5120), (5, 64, 128)];
    let variants = [(true, true, false), (true, false, false), (true, true, true), (true, false, true), (false, false, false)];
    for ((wide, cluster, ring4), &(rows, c, f)) in variants.into_iter().flat_map(|w| shapes.iter().map(move |s| (w, s))) {
        if (!wide || !cluster || ring4) && f % 256 != 0 {
            continue;  // the same kernels as with `wide` and `cluster` and the 3-stage ring
        }
        let tiles = if wide { crate::backend::cuda::WideTiles::Always } else { crate::backend::cuda::WideTiles::Off };
        be.set_wide_gemm(tiles, tiles);
        be.set_gemm_cluster(cluster);
        be.set_gemm_ring(if ring4 { crate::backend::cuda::GemmRing::Four } else { crate::backend::cuda::GemmRing::Three });
        let wide_here = wide && f % 256 == 0;
        let ring = if ring4 { ", 4-stage ring" } else { "" };
        let shape = format!("{rows}×{c}·{f}{}{ring}", if wide_here && cluster { ", 128×256 tiles in clusters of 2" } else if wide_here { ", 128×256 tiles" } else { "" });
        let mut r = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-s..s)).collect() };
        // one flat compute buffer: fc1 (f × c), its bias (f), fc2 (c × f)
        let (w1, b1, w2) = (Span { off: 0, len: f * c }, Span { off: f * c, len: f }, Span { off: f * c + f, len: c * f });
        let mut params = be.alloc(2 * f * c + f)?;
        be.upload(&mut params, 0, &r(2 * f * c + f, 0.1))?;
        let mut x = be.alloc(rows * c)?;
        be.upload(&mut x, 0, &r(rows * c, 1.0))?;
        let mut dout = be.alloc(rows * c)?;
        be.upload(&mut dout, 0, &r(rows * c, 1.0))?;
        let grads0 = r(2 * f * c + f, 0.01);
        // the fused results per saved form, to compare the two forms with each other below
        let mut fused_bwd = Vec::new();
        for (label, saved, fwd_kernel, bwd_kernel) in [("pre", GeluSaved::Pre, "gemm_gelu_fwd_ws", "gemm_dgelu_bwd_ws"), ("gelu'", GeluSaved::Grad, "gemm_gelu_fwd_grad_ws", "gemm_dgelu_mul_ws")] {
            let mut fwd = Vec::new();
            let mut bwd = Vec::new();
            for fused in [false, true] {
                let (mut act, mut pre) = (be.alloc(rows * f)?, be.alloc(rows * f)?);
                run(fused, wide_here && cluster, wide_here && ring4, fwd_kernel, &shape, &mut checks, &mut || be.matmul_forward(&mut act, Some((&mut pre, saved)), &x, &params, w1, Some(b1), rows, c, f))?;
                let mut dinp = be.alloc(rows * f)?;
                let mut grads = be.alloc_f32(2 * f * c + f)?;
                be.upload(&mut grads, 0, &grads0)?;
                run(fused, wide_here && cluster, wide_here && ring4, bwd_kernel, &shape, &mut checks, &mut || be.matmul_backward_gelu_bias(&mut dinp, &mut grads, &dout, &act, &pre, saved, b1, &params, w2, None, rows, f, c))?;
                fwd.push((be.download(&act)?, be.download(&pre)?));
                bwd.push((be.download(&dinp)?, be.download(&grads)?));
            }
            for (what, e, tol) in [
                (format!("fc1+gelu act (saving {label})"), rel_err(&fwd[1].0, &fwd[0].0), 1e-2),
                (format!("fc1+gelu {label}"), rel_err(&fwd[1].1, &fwd[0].1), 1e-2),
                (format!("fc2 dinp·gelu' (from {label})"), rel_err(&bwd[1].0, &bwd[0].0), 1e-2),
                (format!("fc2 dW, fc1 dbias (+=) (from {label})"), rel_err(&bwd[1].1, &bwd[0].1), 1e-4),
            ] {
                checks.push(Check { name: format!("hopper GEMM {what} vs cuBLASLt [{shape}]"), rel_err: e, tol, pass: e.is_finite() && e <= tol });
            }
            fused_bwd.push(bwd.pop().expect("two runs"));
        }
        // What saving the derivative costs in accuracy: it is rounded to bf16 before the product
        // is, so dinp and fc1's bias gradient move by about one bf16 step (compute tolerance).
        let b1r = b1.range();
        for (what, e) in [
            ("fc2 dinp·gelu'", rel_err(&fused_bwd[1].0, &fused_bwd[0].0)),
            ("fc1 dbias", rel_err(&fused_bwd[1].1[b1r.clone()], &fused_bwd[0].1[b1r.clone()])),
        ] {
            checks.push(Check { name: format!("hopper GEMM {what} from gelu' vs from pre [{shape}]"), rel_err: e, tol: 1e-2, pass: e.is_finite() && e <= 1e-2 });
        }
    }
    be.set_wide_gemm(wide_chosen.0, wide_chosen.1);
    be.set_gemm_cluster(cluster_chosen);
    be.set_gemm_ring(ring_chosen);
    Ok(Some(checks))
}

/// The weight-gradient kernel `gemm_wgrad_tt` (kernels/hopper_wgrad.cu) and cuBLASLt, each
/// against an f64 sum on the host: `matmul_backward_weights` with fresh random bf16 dout and
/// inp and dW and bias spans of random f32 values it adds into (dW += doutᵀ·inp, dbias +=
/// Σ_rows dout; half the shapes without a bias). The shapes give K
/// cut into many chunks (few tiles), one chunk (more tiles than SMs), edge tiles in both
/// dimensions (widths not multiples of 128 and 256), rows not a multiple of 64 and a single
/// K step; the last puts dW at an offset that is not 16-byte aligned, where cuBLASLt must run
/// instead. Relative error ≤ 1e-5 (f32 sums of exact bf16 products); a failed check too when
/// the launch table shows the other path ran. None when the kernel is not compiled.
pub fn hopper_wgrad_checks(be: &crate::backend::cuda::Cuda, seed: u64) -> BResult<Option<Vec<Check>>> {
    use rayon::prelude::*;
    if !be.has_fused_gemm() {
        return Ok(None);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x3a7d);
    let mut checks = Vec::new();
    let chosen = be.wgrad_gemm();
    // (rows, ic, oc, offset of dW in the gradient buffer, with a bias, whether the kernel takes it)
    let shapes = [(1000, 768, 384, 64, true, true), (257, 320, 192, 4, true, true), (2050, 512, 1024, 0, false, true), (3, 64, 64, 8, true, true), (64, 2304, 4096, 0, false, true), (100, 128, 128, 2, true, false)];
    for (rows, ic, oc, off, with_bias, ours) in shapes {
        let shape = format!("{rows} rows, {oc}×{ic}, dW at {off}{}", if with_bias { ", bias" } else { "" });
        let mut r = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-s..s)).collect() };
        // dW, then the bias gradient (oc values) right after it
        let w = Span { off, len: oc * ic };
        let bias = with_bias.then_some(Span { off: off + oc * ic, len: oc });
        let total = off + oc * ic + oc;
        let params = be.alloc(total)?;
        let mut dout = be.alloc(rows * oc)?;
        be.upload(&mut dout, 0, &r(rows * oc, 1.0))?;
        let mut inp = be.alloc(rows * ic)?;
        be.upload(&mut inp, 0, &r(rows * ic, 1.0))?;
        let grads0 = r(total, 0.5);
        // the reference from the operands as the device holds them (rounded to bf16): dW, and
        // the bias gradient where there is one (else the span stays as it was)
        let (dh, ih) = (be.download(&dout)?, be.download(&inp)?);
        let mut want: Vec<f32> = (0..oc * ic)
            .into_par_iter()
            .map(|e| {
                let (o, i) = (e / ic, e % ic);
                let sum: f64 = (0..rows).map(|k| dh[k * oc + o] as f64 * ih[k * ic + i] as f64).sum();
                (grads0[off + e] as f64 + sum) as f32
            })
            .collect();
        want.extend((0..oc).map(|o| {
            let sum: f64 = if with_bias { (0..rows).map(|k| dh[k * oc + o] as f64).sum() } else { 0.0 };
            (grads0[off + oc * ic + o] as f64 + sum) as f32
        }));
        for kernel in [true, false] {
            let mut grads = be.alloc_f32(total)?;
            be.upload(&mut grads, 0, &grads0)?;
            be.set_wgrad_gemm(kernel);
            be.set_profiling(true);
            let res = be.matmul_backward_weights(&mut grads, &dout, &inp, &params, w, bias, rows, ic, oc);
            be.set_wgrad_gemm(chosen);
            let launched = be.take_profile();
            be.set_profiling(false);
            res?;
            let ran = launched?.iter().any(|(name, _, _)| name == "gemm_wgrad_tt");
            if ran != (kernel && ours) {
                checks.push(Check { name: format!("gemm_wgrad_tt expected {} but it {} [{shape}]", kernel && ours, if ran { "ran" } else { "did not run" }), rel_err: f64::NAN, tol: 0.0, pass: false });
            }
            let got = be.download(&grads)?;
            let untouched = got[..off] == grads0[..off];
            let path = if ran { "gemm_wgrad_tt" } else { "cuBLASLt" };
            let (dw_got, db_got) = got[off..].split_at(oc * ic);
            let (dw_want, db_want) = want.split_at(oc * ic);
            let e = rel_err(dw_got, dw_want);
            checks.push(Check { name: format!("weight gradient dW(+=) {path} vs f64 [{shape}]"), rel_err: e, tol: 1e-5, pass: e.is_finite() && e <= 1e-5 && untouched });
            let e = rel_err(db_got, db_want);
            checks.push(Check { name: format!("weight gradient dbias(+=) {path} vs f64 [{shape}]"), rel_err: e, tol: 1e-5, pass: e.is_finite() && e <= 1e-5 });
        }
    }
    Ok(Some(checks))
}

/// Which kernels the `fused` attention checks launched (the profile's launch table): each of
/// the shapes' two backward calls (plain and with the bias) picks the whole-head 13-warp kernel
/// at D 64, N 193–208 (4 shapes in `attention_checks`) and the short-sequence kernel at 81–192
/// and 209–256 (N 81, 129, 209, 256); at D 64, N 193–208 the wgmma kernels replace the
/// 13-warp backward and the tiled forward when chosen (`wgmma`: compiled, sm_90, and switched
/// on); at D 64, N > 256 (N 577, 1025, 4097, 16384, 258, 273) the long-sequence wgmma forward
/// replaces the tiled one when chosen and its module loaded (`long_fwd`), and
/// `flash_bwd_wg_long_d64` the tiled backward `flash_bwd_d64_pipe` likewise (`long_bwd`); at D
/// 80, N > 256 (N 257, 4097, 272, 384) `flash_fwd_wg_long_d80` replaces `flash_fwd_d80_pipe`
/// (`long_fwd80`) and `flash_bwd_wg_long_d80` `flash_bwd_d80_pipe` (`long_bwd80`; the pipe
/// kernel still takes N 50); before the long wgmma backward, with `fold` (`fold_keys`), the
/// delta pass takes the first key or two where N mod 128 is 1 or 2. A count off by one fails:
/// the selection would have changed under the checks.
#[allow(clippy::too_many_arguments)]
fn attention_kernel_choice(launched: &[(String, f64, usize)], wgmma: bool, long_fwd: bool, long_fwd80: bool, long_bwd: bool, long_bwd80: bool, fold: bool, label: &str) -> Vec<Check> {
    let count = |kernel: &str| launched.iter().filter(|(name, _, _)| name == kernel).map(|&(_, _, c)| c).sum::<usize>();
    let (wg, w13) = if wgmma { (8, 0) } else { (0, 8) };
    let long_fwd = if wgmma && long_fwd { 6 } else { 0 };
    let long_fwd80 = if wgmma && long_fwd80 { 4 } else { 0 };
    // each shape's backward runs twice (without and with the qkv bias gradient)
    let (long_wg, long_pipe) = if wgmma && long_bwd { (12, 0) } else { (0, 12) };
    let (long_wg80, pipe80) = if wgmma && long_bwd80 { (8, 2) } else { (0, 10) };
    // the delta pass takes the first keys where N mod 128 is 1 (D 64: N 1025, 4097; D 80: 257,
    // 4097) or 2 (D 64: N 258), and a pass after the key blocks stores their dK, dV
    let fold64 = if wgmma && long_bwd && fold { (4, 2) } else { (0, 0) };
    let fold80 = if wgmma && long_bwd80 && fold { 4 } else { 0 };
    [("flash_bwd_pre_fold_d64_r1", fold64.0), ("flash_bwd_pre_fold_d64_r2", fold64.1), ("flash_bwd_pre_fold_d80_r1", fold80), ("flash_fold_keys_store", fold64.0 + fold64.1 + fold80), ("flash_bwd_wg_d64", wg), ("flash_bwd_small_d64_w13", w13), ("flash_bwd_short_d64", 6), ("flash_bwd_short_d32", 2), ("flash_fwd_wg_d64", wg / 2), ("flash_fwd_wg_long_d64", long_fwd), ("flash_fwd_wg_long_d80", long_fwd80), ("flash_bwd_wg_long_d64", long_wg), ("flash_bwd_d64_pipe", long_pipe), ("flash_bwd_wg_long_d80", long_wg80), ("flash_bwd_d80_pipe", pipe80)]
        .into_iter()
        .map(|(kernel, want)| {
            let got = count(kernel);
            Check { name: format!("attention{label}: {kernel} launched {got}× (want {want}×)"), rel_err: (got as f64 - want as f64).abs(), tol: 0.0, pass: got == want }
        })
        .collect()
}

/// The attention checks on every attention path, whatever `VITSCALE_ATTENTION` chose (restored
/// after): the fused path twice where the wgmma kernels exist, with them and with flash.cu's,
/// and on the fused path which kernels ran (`attention_kernel_choice`). Every path gets the
/// same inputs (drawn from `seed`) and one CPU reference; `progress` hears each run's label as
/// it starts.
pub fn attention_path_checks(be: &crate::backend::cuda::Cuda, seed: u64, progress: &dyn Fn(&str)) -> BResult<Vec<Check>> {
    let chosen = be.chosen_attention_path();
    let mut checks = Vec::new();
    let wgmma_chosen = be.wgmma_attention();
    let mut runs = Vec::new();
    for path in crate::backend::cuda::AttentionPath::ALL {
        if path != crate::backend::cuda::AttentionPath::Gemm && !be.has_flash_attention() {
            crate::outln!("attention path {}: kernels/flash.cu did not load on this architecture, its checks skipped (the gemm path runs)", path.name());
            continue;
        }
        let fused = path == crate::backend::cuda::AttentionPath::Fused;
        runs.push((path, fused && be.has_wgmma_attention()));
        if fused && be.has_wgmma_attention() {
            runs.push((path, false));
        }
    }
    // every path draws the same inputs, so the CPU computes each reference once
    let mut memo = ReferenceMemo::default();
    for (path, wgmma) in runs {
        be.set_attention(path);
        be.set_wgmma_attention(wgmma);
        let fused = path == crate::backend::cuda::AttentionPath::Fused;
        let label = if fused && be.has_wgmma_attention() { format!(" {}{}", path.name(), if wgmma { " wgmma" } else { " mma.sync" }) } else { format!(" {}", path.name()) };
        be.set_profiling(fused);
        progress(&format!("attention checks,{label} path"));
        let result = attention_checks_memo(be, seed.wrapping_add(1), &label, &mut memo);
        let launched = if fused { be.take_profile() } else { Ok(Vec::new()) };
        be.set_profiling(false);
        match result {
            Ok(cs) => checks.extend(cs),
            Err(e) => checks.push(Check { name: format!("attention checks{label}: {e}"), rel_err: f64::NAN, tol: 0.0, pass: false }),
        }
        if fused {
            checks.extend(attention_kernel_choice(&launched?, wgmma, be.has_wgmma_long_attention(64), be.has_wgmma_long_attention(80), be.has_wgmma_long_backward(64), be.has_wgmma_long_backward(80), be.fold_keys(), &label));
        }
    }
    be.set_wgmma_attention(wgmma_chosen);
    be.set_attention(chosen);
    Ok(checks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--only`'s list: names in any case and order, blanks ignored; an unknown name or an
    /// empty list is an error naming the parts.
    #[test]
    fn parts_parse_by_name() {
        let p = Parts::parse("decode, Optimizer,").unwrap();
        assert_eq!(p, Parts { optimizer: true, decode: true, ..Parts::NONE });
        assert_eq!(p.names(), vec!["optimizer", "decode"]);
        assert_eq!(Parts::ALL.names(), Parts::NAMES.to_vec());
        let e = Parts::parse("ops,jpeg").unwrap_err();
        assert!(e.contains("\"jpeg\"") && e.contains("ops, optimizer, training, gemm, attention, half, decode, comm"), "{e}");
        assert!(Parts::parse(" , ").unwrap_err().contains("names no part"));
    }

    /// Only the picked parts run: the optimizer alone gives optimizer checks and no losses.
    #[test]
    fn run_parts_runs_only_the_picked_parts() {
        let (_, checks, dev, cpu) = run_parts(&Cpu::new(), Some(3), Parts { optimizer: true, ..Parts::NONE }).unwrap();
        assert!(!checks.is_empty() && checks.iter().all(|c| c.name.starts_with("optimizer_step") || c.name.starts_with("sum_squares")), "{:?}", checks.iter().map(|c| &c.name).collect::<Vec<_>>());
        assert!(dev.is_empty() && cpu.is_empty());
    }

    fn ctx(be: &Cpu, memo: ReferenceMemo) -> Ctx<'_, Cpu> {
        Ctx { be, cpu: Cpu::new(), rng: ChaCha8Rng::seed_from_u64(1), checks: Vec::new(), tol_c: F32_TOL, memo }
    }

    #[test]
    fn a_reference_is_computed_once_per_seed_op_and_shape() {
        let be = Cpu::new();
        let mut memo = ReferenceMemo::default().for_seed(7);
        let mut calls = 0;
        let mut runs = Vec::new();
        for pass in 0..2 {
            let mut cx = ctx(&be, memo);
            let (mut a, mut b) = (vec![0.0f32; 3], vec![0.0f32; 2]);
            cx.cpu_ref("op [N3]", &mut [&mut a, &mut b], |_, o| {
                calls += 1;
                o[0].copy_from_slice(&[1.0, 2.0, 3.0 + pass as f32]);
                o[1].copy_from_slice(&[4.0, 5.0]);
                Ok(())
            })
            .unwrap();
            // another shape under the same op is its own reference
            let mut c = vec![0.0f32; 1];
            cx.cpu_ref("op [N1]", &mut [&mut c], |_, o| {
                calls += 1;
                o[0][0] = 9.0;
                Ok(())
            })
            .unwrap();
            runs.push((a, b, c));
            memo = cx.memo;
        }
        assert_eq!(calls, 2, "the second pass must reuse both references");
        assert_eq!(runs[0], runs[1], "the second pass gets the first pass's outputs");
        assert_eq!(runs[1].0, vec![1.0, 2.0, 3.0]);
        // a pass with the same seed keeps them, one with another seed starts empty
        let same = memo.for_seed(7);
        assert_eq!(same.outputs.len(), 2);
        let other = same.for_seed(8);
        assert!(other.outputs.is_empty());
        assert_eq!(other.seed, 8);
    }
}
