//! CPU optimizer kernels: one Adam/AdamW/SGD step over the flat f32 buffers, and the f64
//! sum of squares behind the global gradient norm. Both run on all cores (rayon) over
//! fixed-size chunks, and both are deterministic: every element is updated independently,
//! and partial sums are added in chunk order, whatever the thread schedule.
//!
//! The Adam update is DeepSpeed FusedAdam's (`multi_tensor_adam.cu`), in f32:
//! `m̂ = m / (1 − β1ᵗ)`, `v̂ = v / (1 − β2ᵗ)`, `update = m̂ / (√v̂ + ε)`, plus `wd·p` in AdamW
//! mode (decoupled decay, the same as torch's `p *= 1 − lr·wd` before the step), or with
//! `wd·p` added to the gradient in L2 mode; `p −= lr·update`. SGD is `torch.optim.SGD`.

use rayon::prelude::*;

use crate::backend::{optimizer_state_len, BResult, BackendError, ParamGroups, ShardPiece, Span, StepHyper};
use crate::core::OptimizerConfig;

/// Elements per parallel work item: large enough to amortize scheduling, small enough to
/// spread a ViT-Tiny's parameters over many cores.
const CHUNK: usize = 1 << 14;

fn shape_err(msg: String) -> BackendError {
    BackendError::Shape { op: "optimizer_step", msg }
}

/// Cuts `0..n` into pieces of at most `CHUNK` elements that never straddle a parameter-group
/// boundary: (length, decays, lr factor). Elements not covered by any group are updated
/// without decay at factor 1.
fn pieces(n: usize, groups: &ParamGroups) -> BResult<Vec<(usize, bool, f32)>> {
    let mut spans: Vec<_> = groups.groups.iter().filter(|g| g.span.len > 0).copied().collect();
    spans.sort_by_key(|g| g.span.off);
    let mut out = Vec::new();
    let mut push = |mut len: usize, decays: bool, lr_scale: f32| {
        while len > 0 {
            let l = len.min(CHUNK);
            out.push((l, decays, lr_scale));
            len -= l;
        }
    };
    let mut at = 0;
    for g in spans {
        let span = g.span;
        if span.off < at || span.off + span.len > n {
            return Err(shape_err(format!(
                "parameter group {}..{} overlaps another group or exceeds the {n} parameters",
                span.off,
                span.off + span.len
            )));
        }
        push(span.off - at, false, 1.0);
        push(span.len, g.decays, g.lr_scale);
        at = span.off + span.len;
    }
    push(n - at, false, 1.0);
    Ok(out)
}

/// Splits `s` into consecutive mutable pieces of the given lengths.
fn split_mut<'a, T>(mut s: &'a mut [T], lens: &[(usize, bool, f32)]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(lens.len());
    for &(len, _, _) in lens {
        let (head, tail) = std::mem::take(&mut s).split_at_mut(len);
        out.push(head);
        s = tail;
    }
    out
}

fn split<'a, T>(mut s: &'a [T], lens: &[(usize, bool, f32)]) -> Vec<&'a [T]> {
    let mut out = Vec::with_capacity(lens.len());
    for &(len, _, _) in lens {
        let (head, tail) = s.split_at(len);
        out.push(head);
        s = tail;
    }
    out
}

/// One optimizer step (see `Backend::optimizer_step`): `params` updated in place from
/// `grads · hyper.grad_scale`; `state` is Adam's m then v, or SGD's momentum buffer
/// (zero-initialized; SGD sets it to the gradient when `hyper.step == 1`, as torch does on
/// its first step). Weight decay applies only to spans flagged in `decay`.
pub fn optimizer_step(
    params: &mut [f32],
    grads: &[f32],
    state: &mut [f32],
    opt: &OptimizerConfig,
    decay: &ParamGroups,
    hyper: StepHyper,
) -> BResult<()> {
    let n = params.len();
    if grads.len() != n {
        return Err(shape_err(format!("{} gradients for {n} parameters", grads.len())));
    }
    let want = optimizer_state_len(opt, n);
    if state.len() != want {
        return Err(shape_err(format!("optimizer state has {} elements, expected {want}", state.len())));
    }
    if hyper.step == 0 {
        return Err(shape_err("hyper.step is 1-based; got 0".into()));
    }
    let lens = pieces(n, decay)?;
    let gs = if hyper.clip_norm > 0.0 {
        // fixed chunks summed in order: the same norm whatever the thread count
        let parts: Vec<f64> = grads.par_chunks(1 << 16).map(|c| c.iter().map(|&g| (g as f64) * (g as f64)).sum()).collect();
        let ss: f64 = parts.iter().sum();
        hyper.effective_grad_scale(ss.sqrt())
    } else {
        hyper.grad_scale
    };
    let lr = hyper.lr;
    let ps = split_mut(params, &lens);
    let gr = split(grads, &lens);
    match *opt {
        OptimizerConfig::Adam { beta1, beta2, eps, weight_decay, adam_w_mode, bias_correction, .. } => {
            let (m, v) = state.split_at_mut(n);
            let ms = split_mut(m, &lens);
            let vs = split_mut(v, &lens);
            // Corrections in f64 (as the host computes them), applied in f32.
            let (bc1, bc2) = if bias_correction {
                let t = hyper.step as i32;
                ((1.0 - beta1.powi(t)) as f32, (1.0 - beta2.powi(t)) as f32)
            } else {
                (1.0, 1.0)
            };
            let (b1, b2, eps) = (beta1 as f32, beta2 as f32, eps as f32);
            ps.into_par_iter().zip(gr).zip(ms).zip(vs).zip(lens.par_iter()).for_each(|((((p, g), m), v), &(_, decays, lr_scale))| {
                let wd = if decays { weight_decay as f32 } else { 0.0 };
                let lr = lr * lr_scale;
                for i in 0..p.len() {
                    let mut gi = g[i] * gs;
                    if !adam_w_mode {
                        gi += wd * p[i];
                    }
                    m[i] = b1 * m[i] + (1.0 - b1) * gi;
                    v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                    let denom = (v[i] / bc2).sqrt() + eps;
                    let mut update = (m[i] / bc1) / denom;
                    if adam_w_mode {
                        update += wd * p[i];
                    }
                    p[i] -= lr * update;
                }
            });
        }
        OptimizerConfig::Sgd { momentum, dampening, weight_decay, nesterov, .. } => {
            let bufs = split_mut(state, &lens);
            let (mom, damp) = (momentum as f32, dampening as f32);
            let first = hyper.step == 1;
            ps.into_par_iter().zip(gr).zip(bufs).zip(lens.par_iter()).for_each(|(((p, g), buf), &(_, decays, lr_scale))| {
                let wd = if decays { weight_decay as f32 } else { 0.0 };
                let lr = lr * lr_scale;
                for i in 0..p.len() {
                    let mut d = g[i] * gs + wd * p[i];
                    if mom != 0.0 {
                        buf[i] = if first { d } else { mom * buf[i] + (1.0 - damp) * d };
                        d = if nesterov { d + mom * buf[i] } else { buf[i] };
                    }
                    p[i] -= lr * d;
                }
            });
        }
    }
    Ok(())
}

/// `optimizer_step` over pieces of the flat buffers, each with its own state at the given
/// offset (see `Backend::optimizer_step_pieces`): every piece is updated exactly as the same
/// elements would be by a step over the whole buffer.
pub fn optimizer_step_pieces(
    params: &mut [f32],
    grads: &[f32],
    state: &mut [f32],
    pieces: &[(Span, usize)],
    opt: &OptimizerConfig,
    decay: &ParamGroups,
    hyper: StepHyper,
) -> BResult<()> {
    if hyper.clip_norm > 0.0 {
        return Err(shape_err("optimizer_step_pieces clips nothing itself: fold the global clipping factor into grad_scale".into()));
    }
    let n = params.len().min(grads.len());
    for &(span, soff) in pieces {
        let slen = optimizer_state_len(opt, span.len);
        if span.off + span.len > n || soff + slen > state.len() {
            return Err(shape_err(format!(
                "piece {}..{} (state {soff}..{}) outside {n} parameters / {} state elements",
                span.off,
                span.off + span.len,
                soff + slen,
                state.len()
            )));
        }
        optimizer_step(&mut params[span.range()], &grads[span.range()], &mut state[soff..soff + slen], opt, &decay.restrict(span), hyper)?;
    }
    Ok(())
}

/// `optimizer_step_pieces` with each piece's weights at `master_off` of `master` (ZeRO-3: a
/// rank's own pieces back to back) rather than at its span of a whole buffer.
pub fn optimizer_step_master(
    master: &mut [f32],
    grads: &[f32],
    state: &mut [f32],
    pieces: &[ShardPiece],
    opt: &OptimizerConfig,
    decay: &ParamGroups,
    hyper: StepHyper,
) -> BResult<()> {
    if hyper.clip_norm > 0.0 {
        return Err(shape_err("optimizer_step_master clips nothing itself: fold the global clipping factor into grad_scale".into()));
    }
    for p in pieces {
        let (span, slen) = (p.span, optimizer_state_len(opt, p.span.len));
        if p.master_off + span.len > grads.len() || p.state_off + slen > state.len() || p.master_off + span.len > master.len() {
            return Err(shape_err(format!(
                "piece {}..{} (state at {}, weights at {}) outside {} gradients / {} state / {} weights",
                span.off,
                span.off + span.len,
                p.state_off,
                p.master_off,
                grads.len(),
                state.len(),
                master.len()
            )));
        }
        optimizer_step(&mut master[p.master_off..p.master_off + span.len], &grads[p.master_off..p.master_off + span.len], &mut state[p.state_off..p.state_off + slen], opt, &decay.restrict(span), hyper)?;
    }
    Ok(())
}

/// Σ x² accumulated in f64, a value of magnitude ≥ `inf_from` counted as infinite (see
/// `Backend::sum_squares`); partial sums are added in chunk order so the result does not
/// depend on the thread schedule.
pub fn sum_squares(x: &[f32], inf_from: f32) -> f64 {
    let sq = |v: f32| if v.abs() >= inf_from { f64::INFINITY } else { (v as f64) * (v as f64) };
    let parts: Vec<f64> = x.par_chunks(CHUNK).map(|c| c.iter().map(|&v| sq(v)).sum()).collect();
    parts.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{ParamGroup, Span};
    use rand::{Rng, SeedableRng};

    fn random(n: usize, rng: &mut impl Rng) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
    }

    /// Parameter groups over `n` elements: several spans of both decay kinds and learning-rate
    /// factors, one larger than CHUNK, and an uncovered tail (no decay, factor 1). Returns the
    /// groups and each element's decay flag and factor.
    fn groups(n: usize) -> (ParamGroups, Vec<bool>, Vec<f64>) {
        let cuts = [0, 7, 300, 301, 300 + CHUNK + 5, n - 11];
        let factors = [0.75f32 * 0.75, 1.0, 0.75, 0.3, 1.0];
        let mut groups = Vec::new();
        let mut flags = vec![false; n];
        let mut scales = vec![1.0f64; n];
        for (i, w) in cuts.windows(2).enumerate() {
            let decays = i % 2 == 0;
            groups.push(ParamGroup { span: Span { off: w[0], len: w[1] - w[0] }, decays, lr_scale: factors[i] });
            flags[w[0]..w[1]].iter_mut().for_each(|f| *f = decays);
            scales[w[0]..w[1]].iter_mut().for_each(|f| *f = factors[i] as f64);
        }
        (ParamGroups { groups }, flags, scales)
    }

    /// torch.optim.Adam / AdamW as in the torch docs' pseudo-code, in f64.
    #[allow(clippy::too_many_arguments)]
    fn adam_ref(p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64], t: i32, lrs: &[f64], b1: f64, b2: f64, eps: f64, wd: &[f64], adamw: bool, bc: bool) {
        for i in 0..p.len() {
            let lr = lrs[i];
            let mut gi = g[i];
            if adamw {
                p[i] -= lr * wd[i] * p[i];
            } else {
                gi += wd[i] * p[i];
            }
            m[i] = b1 * m[i] + (1.0 - b1) * gi;
            v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
            let (mh, vh) = if bc { (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t))) } else { (m[i], v[i]) };
            p[i] -= lr * mh / (vh.sqrt() + eps);
        }
    }

    /// torch.optim.SGD as in the torch docs' pseudo-code, in f64.
    #[allow(clippy::too_many_arguments)]
    fn sgd_ref(p: &mut [f64], g: &[f64], b: &mut [f64], t: u64, lrs: &[f64], mu: f64, tau: f64, wd: &[f64], nesterov: bool) {
        for i in 0..p.len() {
            let lr = lrs[i];
            let mut gi = g[i] + wd[i] * p[i];
            if mu != 0.0 {
                b[i] = if t > 1 { mu * b[i] + (1.0 - tau) * gi } else { gi };
                gi = if nesterov { gi + mu * b[i] } else { b[i] };
            }
            p[i] -= lr * gi;
        }
    }

    fn assert_close(got: &[f32], want: &[f64], what: &str) {
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            // Relative f32 error, plus an absolute floor for values that cancel to near zero
            // from operands of order 1.
            let tol = 2e-5 * b.abs() + 2e-6;
            assert!(a.is_finite() && ((*a as f64) - b).abs() <= tol, "{what}[{i}]: {a} vs {b}");
        }
    }

    fn run_adam(adamw: bool, bc: bool, seed: u64) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = 2 * CHUNK + 777;
        let (decay, flags, scales) = groups(n);
        let (lr, b1, b2, eps, wd) = (1e-2, 0.9, 0.95, 1e-6, 0.1);
        let lrs: Vec<f64> = scales.iter().map(|s| lr * s).collect();
        let opt = OptimizerConfig::Adam { lr, beta1: b1, beta2: b2, eps, weight_decay: wd, adam_w_mode: adamw, bias_correction: bc };
        let mut p = random(n, &mut rng);
        let mut state = vec![0.0f32; 2 * n];
        let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let (mut mr, mut vr) = (vec![0.0; n], vec![0.0; n]);
        let wdv: Vec<f64> = flags.iter().map(|&f| if f { wd } else { 0.0 }).collect();
        let scale = 0.5f32;
        for t in 1..=4u64 {
            let g = random(n, &mut rng);
            let gr: Vec<f64> = g.iter().map(|&x| (x * scale) as f64).collect();
            optimizer_step(&mut p, &g, &mut state, &opt, &decay, StepHyper { lr: lr as f32, step: t, grad_scale: scale, clip_norm: 0.0 }).unwrap();
            adam_ref(&mut pr, &gr, &mut mr, &mut vr, t as i32, &lrs, b1, b2, eps, &wdv, adamw, bc);
            assert_close(&p, &pr, "params");
            assert_close(&state[..n], &mr, "m");
            assert_close(&state[n..], &vr, "v");
        }
    }

    /// Pieces with their own state, updated for 3 steps, equal the whole-buffer update on
    /// those elements bitwise (each element's update is independent of the others), for
    /// AdamW and SGD with decay groups cutting through the pieces; the rest stays untouched.
    #[test]
    fn pieces_update_like_the_whole_buffer() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        let n = 2 * CHUNK + 333;
        let (decay, _, _) = groups(n);
        let pieces_at = [Span { off: 5, len: 290 }, Span { off: 301 + CHUNK, len: CHUNK + 10 }, Span { off: n - 20, len: 20 }];
        let adam = OptimizerConfig::Adam { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1, adam_w_mode: true, bias_correction: true };
        let sgd = OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.01, nesterov: true };
        for opt in [adam, sgd] {
            let p0 = random(n, &mut rng);
            let (mut whole_p, mut whole_s) = (p0.clone(), vec![0.0; optimizer_state_len(&opt, n)]);
            let mut piece_p = p0.clone();
            let mut pieces = Vec::new();
            let mut soff = 0;
            for s in pieces_at {
                pieces.push((s, soff));
                soff += optimizer_state_len(&opt, s.len);
            }
            let mut piece_s = vec![0.0; soff];
            for t in 1..=3 {
                let g = random(n, &mut rng);
                let hyper = StepHyper { lr: 1e-2, step: t, grad_scale: 0.5, clip_norm: 0.0 };
                optimizer_step(&mut whole_p, &g, &mut whole_s, &opt, &decay, hyper).unwrap();
                optimizer_step_pieces(&mut piece_p, &g, &mut piece_s, &pieces, &opt, &decay, hyper).unwrap();
            }
            let mut inside = vec![false; n];
            for s in pieces_at {
                let bad = s.range().find(|&i| piece_p[i] != whole_p[i]);
                assert!(bad.is_none(), "{opt:?} piece {s:?}: element {bad:?}: {:?} vs {:?}", bad.map(|i| piece_p[i]), bad.map(|i| whole_p[i]));
                inside[s.range()].iter_mut().for_each(|f| *f = true);
            }
            assert!((0..n).filter(|&i| !inside[i]).all(|i| piece_p[i] == p0[i]), "elements outside the pieces changed");
            let clip = StepHyper { lr: 1e-2, step: 4, grad_scale: 1.0, clip_norm: 1.0 };
            assert!(optimizer_step_pieces(&mut piece_p, &p0, &mut piece_s, &pieces, &opt, &decay, clip).is_err());
        }
    }

    #[test]
    fn adamw_matches_reference() {
        run_adam(true, true, 1);
    }

    #[test]
    fn adam_l2_matches_reference() {
        run_adam(false, true, 2);
    }

    #[test]
    fn adam_without_bias_correction_matches_reference() {
        run_adam(true, false, 3);
    }

    fn run_sgd(mu: f64, tau: f64, nesterov: bool, seed: u64) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let n = CHUNK + 1234;
        let (decay, flags, scales) = groups(n);
        let (lr, wd) = (0.05, 0.01);
        let lrs: Vec<f64> = scales.iter().map(|s| lr * s).collect();
        let opt = OptimizerConfig::Sgd { lr, momentum: mu, dampening: tau, weight_decay: wd, nesterov };
        let mut p = random(n, &mut rng);
        let mut buf = vec![0.0f32; n];
        let mut pr: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let mut br = vec![0.0; n];
        let wdv: Vec<f64> = flags.iter().map(|&f| if f { wd } else { 0.0 }).collect();
        for t in 1..=4u64 {
            let g = random(n, &mut rng);
            let gr: Vec<f64> = g.iter().map(|&x| (x * 2.0) as f64).collect();
            optimizer_step(&mut p, &g, &mut buf, &opt, &decay, StepHyper { lr: lr as f32, step: t, grad_scale: 2.0, clip_norm: 0.0 }).unwrap();
            sgd_ref(&mut pr, &gr, &mut br, t, &lrs, mu, tau, &wdv, nesterov);
            assert_close(&p, &pr, "params");
            if mu != 0.0 {
                assert_close(&buf, &br, "momentum buffer");
            }
        }
    }

    #[test]
    fn sgd_plain_matches_reference() {
        run_sgd(0.0, 0.0, false, 4);
    }

    #[test]
    fn sgd_momentum_dampening_matches_reference() {
        run_sgd(0.9, 0.1, false, 5);
    }

    #[test]
    fn sgd_nesterov_matches_reference() {
        run_sgd(0.9, 0.0, true, 6);
    }

    #[test]
    fn first_adam_step_moves_by_lr() {
        // With bias correction, step 1 gives m̂/√v̂ = sign(g): every weight moves by ~lr.
        let opt = OptimizerConfig::Adam { lr: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, adam_w_mode: true, bias_correction: true };
        let mut p = vec![1.0f32, 1.0, 1.0];
        let g = vec![3.0f32, -0.5, 1e-3];
        let mut s = vec![0.0f32; 6];
        let d = ParamGroups { groups: vec![] };
        optimizer_step(&mut p, &g, &mut s, &opt, &d, StepHyper { lr: 0.1, step: 1, grad_scale: 1.0, clip_norm: 0.0 }).unwrap();
        assert!((p[0] - 0.9).abs() < 1e-6 && (p[1] - 1.1).abs() < 1e-6 && (p[2] - 0.9).abs() < 1e-4, "{p:?}");
    }

    /// Plain SGD makes the update visible: clip_norm 1 on gradients of norm 5 (3-4-0) scales
    /// them by 1/5, while a bound above the norm leaves them alone.
    #[test]
    fn clip_norm_scales_by_the_global_norm() {
        let opt = OptimizerConfig::Sgd { lr: 1.0, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false };
        let d = ParamGroups { groups: vec![] };
        let g = vec![3.0f32, -4.0, 0.0];
        let mut p = vec![0.0f32; 3];
        optimizer_step(&mut p, &g, &mut [0.0; 3], &opt, &d, StepHyper { lr: 1.0, step: 1, grad_scale: 1.0, clip_norm: 1.0 }).unwrap();
        assert!((p[0] + 0.6).abs() < 1e-6 && (p[1] - 0.8).abs() < 1e-6 && p[2] == 0.0, "{p:?}");
        // grad_scale 0.5 first: norm 2.5, clipped to 2 → factor 0.4 overall
        let mut p = vec![0.0f32; 3];
        optimizer_step(&mut p, &g, &mut [0.0; 3], &opt, &d, StepHyper { lr: 1.0, step: 1, grad_scale: 0.5, clip_norm: 2.0 }).unwrap();
        assert!((p[0] + 1.2).abs() < 1e-5 && (p[1] - 1.6).abs() < 1e-5, "{p:?}");
        let mut p = vec![0.0f32; 3];
        optimizer_step(&mut p, &g, &mut [0.0; 3], &opt, &d, StepHyper { lr: 1.0, step: 1, grad_scale: 1.0, clip_norm: 10.0 }).unwrap();
        assert_eq!(p, vec![-3.0, 4.0, 0.0]);
    }

    #[test]
    fn mismatched_lengths_are_errors() {
        let opt = OptimizerConfig::Sgd { lr: 0.1, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false };
        let d = ParamGroups { groups: vec![] };
        let h = StepHyper { lr: 0.1, step: 1, grad_scale: 1.0, clip_norm: 0.0 };
        assert!(optimizer_step(&mut [0.0; 4], &[0.0; 3], &mut [0.0; 4], &opt, &d, h).is_err());
        assert!(optimizer_step(&mut [0.0; 4], &[0.0; 4], &mut [0.0; 3], &opt, &d, h).is_err());
        let bad = ParamGroups::from_spans([(Span { off: 2, len: 5 }, true)]);
        assert!(optimizer_step(&mut [0.0; 4], &[0.0; 4], &mut [0.0; 4], &opt, &bad, h).is_err());
    }

    #[test]
    fn sum_squares_is_exact_in_f64() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let x = random(3 * CHUNK + 17, &mut rng);
        let want: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let got = sum_squares(&x, f32::INFINITY);
        assert!((got - want).abs() <= 1e-12 * want, "{got} vs {want}");
        assert_eq!(sum_squares(&[], f32::INFINITY), 0.0);
        assert_eq!(sum_squares(&[3.0, 4.0], f32::INFINITY), 25.0);
        // Same result every call (chunk-ordered reduction).
        assert_eq!(got.to_bits(), sum_squares(&x, f32::INFINITY).to_bits());
    }

    /// The fp16 overflow check's bound: 65504 (fp16's largest value) and 65519.99 stay finite,
    /// 65520 (rounds to inf in fp16) does not, in any chunk; inf and NaN stay non-finite.
    #[test]
    fn sum_squares_counts_values_past_the_bound_as_infinite() {
        use crate::backend::FP16_INF_FROM;
        assert_eq!(half::f16::from_f32(65519.99).to_f32(), 65504.0);
        assert!(half::f16::from_f32(FP16_INF_FROM).is_infinite());
        let mut x = vec![0.5f32; 2 * CHUNK + 3];
        x[CHUNK + 1] = -65504.0;
        x[7] = 65519.99;
        assert!(sum_squares(&x, FP16_INF_FROM).is_finite());
        for (i, v) in [(2 * CHUNK + 2, 65520.0f32), (0, -7.0e4), (CHUNK, f32::INFINITY)] {
            let mut y = x.clone();
            y[i] = v;
            assert_eq!(sum_squares(&y, FP16_INF_FROM), f64::INFINITY, "{v} at {i}");
            assert!(sum_squares(&y, f32::INFINITY).is_finite() || v.is_infinite());
        }
        x[3] = f32::NAN;
        assert!(sum_squares(&x, FP16_INF_FROM).is_nan());
    }
}
