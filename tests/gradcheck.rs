//! Finite-difference gradient checks for every CPU op and for the whole model on a tiny
//! config. Inputs are fresh random numbers each run (the seed is printed on failure).
//!
//! Each op is checked through a scalar probe L = Σ out ⊙ R with a random R: the analytic
//! gradient of L (from the op's backward with dout = R) is compared with central differences
//! (eps 1e-2 on f32, computed in f64 from the f32 outputs) at every input element; tolerance:
//! |fd − an| ≤ 5e-3 × the largest |analytic| element of that gradient per op, 2e-2 for the
//! whole model.

use vitscale::backend::cpu::Cpu;
use vitscale::backend::{Backend, GeluSaved, Span};
use vitscale::model::{GlobalPool, ModelConfig, Vit};

use rand::Rng;
use rand_chacha::ChaCha8Rng;

mod common;
use common::fresh_rng;

fn randn(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.gen::<f32>() * 2.0 - 1.0) * scale).collect()
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

/// Compares an analytic gradient with central differences of `probe` at every element of `x`.
fn compare(name: &str, seed: u64, x: &mut [f32], analytic: &[f32], probe: &mut dyn FnMut(&[f32]) -> f64) {
    compare_tol(name, seed, x, analytic, probe, 5e-3)
}

fn compare_tol(name: &str, seed: u64, x: &mut [f32], analytic: &[f32], probe: &mut dyn FnMut(&[f32]) -> f64, tol: f32) {
    let eps = 1e-2f32;
    let scale = analytic.iter().map(|v| v.abs()).fold(0.0f32, f32::max).max(1e-3);
    let mut worst = 0.0f32;
    for i in 0..x.len() {
        let orig = x[i];
        x[i] = orig + eps;
        let lp = probe(x);
        x[i] = orig - eps;
        let lm = probe(x);
        x[i] = orig;
        let fd = ((lp - lm) / (2.0 * eps as f64)) as f32;
        assert!(fd.is_finite() && analytic[i].is_finite(), "{name}: non-finite gradient at {i} (seed {seed})");
        let err = (fd - analytic[i]).abs() / scale;
        worst = worst.max(err);
        assert!(err < tol, "{name}[{i}]: finite difference {fd} vs analytic {} (scale {scale}, seed {seed})", analytic[i]);
    }
    eprintln!("{name}: worst relative error {worst:.2e}");
}

#[test]
fn matmul_with_and_without_gelu() {
    let be = Cpu::new();
    let (mut rng, seed) = fresh_rng();
    let (rows, ic, oc) = (6, 5, 4);
    let w = Span { off: 3, len: oc * ic };
    let bias = Span { off: 3 + oc * ic, len: oc };
    // no GELU, and the GELU with either form of saved state (the backward must agree)
    for saved in [None, Some(GeluSaved::Pre), Some(GeluSaved::Grad)] {
        let gelu = saved.is_some();
        let mut params = randn(&mut rng, 3 + oc * ic + oc, 1.0);
        let mut inp = randn(&mut rng, rows * ic, 1.0);
        let r = randn(&mut rng, rows * oc, 1.0);
        let fwd = |params: &[f32], inp: &[f32]| -> Vec<f32> {
            let mut out = vec![0.0; rows * oc];
            let mut pre = vec![0.0; rows * oc];
            be.matmul_forward(&mut out, gelu.then_some((&mut pre, GeluSaved::Pre)), &inp.to_vec(), &params.to_vec(), w, Some(bias), rows, ic, oc).unwrap();
            out
        };
        // With the GELU, the backward op sees d(out) already multiplied through gelu' by the
        // caller's fused path; here we check it as the next layer would: a matmul (identity
        // weights) whose GELU gradient reads our pre-activation.
        let mut pre = vec![0.0; rows * oc];
        let mut out = vec![0.0; rows * oc];
        be.matmul_forward(&mut out, saved.map(|what| (&mut pre, what)), &inp, &params, w, Some(bias), rows, ic, oc).unwrap();
        let dpre = if gelu {
            // d pre = R ⊙ gelu'(pre + bias) (`pre` excludes the bias), via the fused backward of
            // an identity layer whose parameter vector also carries this layer's bias.
            let mut eye_b: Vec<f32> = (0..oc * oc).map(|i| if i / oc == i % oc { 1.0 } else { 0.0 }).collect();
            eye_b.extend_from_slice(&params[bias.range()]);
            let mut d = vec![0.0; rows * oc];
            let mut dummy = vec![0.0; eye_b.len()];
            let pre_bias = Span { off: oc * oc, len: oc };
            be.matmul_backward_gelu_bias(&mut d, &mut dummy, &r, &out, &pre, saved.unwrap_or(GeluSaved::Pre), pre_bias, &eye_b, Span { off: 0, len: oc * oc }, None, rows, oc, oc).unwrap();
            d
        } else {
            r.clone()
        };
        let mut dinp = vec![0.0; rows * ic];
        let mut dparams = vec![0.0; params.len()];
        be.matmul_backward(&mut dinp, &mut dparams, &dpre, &inp, None, &params, w, Some(bias), rows, ic, oc).unwrap();
        let name = match saved {
            None => "matmul",
            Some(GeluSaved::Pre) => "matmul+gelu",
            Some(GeluSaved::Grad) => "matmul+gelu (saved gelu')",
        };
        let p2 = params.clone();
        compare(&format!("{name} dinp"), seed, &mut inp.clone(), &dinp, &mut |x| dot(&fwd(&p2, x), &r));
        let inp2 = inp.clone();
        let mut dp = dparams.clone();
        dp[..3].fill(0.0);
        compare(&format!("{name} dparams"), seed, &mut params, &dp, &mut |p| dot(&fwd(p, &inp2), &r));
        inp.clear();
    }
}

#[test]
fn layernorm_with_residual() {
    let be = Cpu::new();
    let (mut rng, seed) = fresh_rng();
    let (rows, c) = (5, 8);
    let w = Span { off: 0, len: c };
    let b = Span { off: c, len: c };
    let mut params: Vec<f32> = randn(&mut rng, 2 * c, 0.5);
    params[..c].iter_mut().for_each(|v| *v += 1.0);
    let mut inp = randn(&mut rng, rows * c, 2.0);
    let r = randn(&mut rng, rows * c, 1.0);
    let res = randn(&mut rng, rows * c, 1.0);
    let fwd = |params: &[f32], inp: &[f32]| -> Vec<f32> {
        let (mut out, mut m, mut s) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
        be.layernorm_forward(&mut out, &mut m, &mut s, &inp.to_vec(), &params.to_vec(), w, b, rows, c).unwrap();
        out
    };
    let (mut out, mut m, mut s) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
    be.layernorm_forward(&mut out, &mut m, &mut s, &inp, &params, w, b, rows, c).unwrap();
    let mut dinp = vec![0.0; rows * c];
    let mut dparams = vec![0.0; 2 * c];
    be.layernorm_backward(&mut dinp, &mut dparams, &r, Some(&res), &inp, &m, &s, &params, w, b, rows, c, None).unwrap();
    // With dinp_sum the same call also adds dinp's column sums into a third span.
    let mut dinp3 = vec![0.0; rows * c];
    let mut dparams3 = vec![0.5; 3 * c];
    dparams3[..2 * c].fill(0.0);
    be.layernorm_backward(&mut dinp3, &mut dparams3, &r, Some(&res), &inp, &m, &s, &params, w, b, rows, c, Some(Span { off: 2 * c, len: c })).unwrap();
    assert_eq!(dinp3, dinp, "dinp_sum changed dinp (seed {seed})");
    assert_eq!(&dparams3[..2 * c], &dparams[..], "dinp_sum changed dw, db (seed {seed})");
    for j in 0..c {
        let want = 0.5 + (0..rows).map(|i| dinp[i * c + j]).sum::<f32>();
        assert!((dparams3[2 * c + j] - want).abs() <= 1e-5 * (1.0 + want.abs()), "column {j}: {} vs {want} (seed {seed})", dparams3[2 * c + j]);
    }
    // dinp folds in the residual gradient: subtract it to compare with the LN alone.
    let dln: Vec<f32> = dinp.iter().zip(&res).map(|(a, b)| a - b).collect();
    let p2 = params.clone();
    compare("layernorm dinp", seed, &mut inp.clone(), &dln, &mut |x| dot(&fwd(&p2, x), &r));
    let i2 = inp.clone();
    compare("layernorm dparams", seed, &mut params, &dparams, &mut |p| dot(&fwd(p, &i2), &r));
    inp.clear();
}

#[test]
fn attention_core() {
    let be = Cpu::new();
    let (mut rng, seed) = fresh_rng();
    let (b, n, h, d) = (2, 5, 2, 3);
    let c = h * d;
    let mut qkv = randn(&mut rng, b * n * 3 * c, 1.5);
    let r = randn(&mut rng, b * n * c, 1.0);
    let fwd = |qkv: &[f32]| -> Vec<f32> {
        let (mut out, mut p) = (vec![0.0; b * n * c], vec![0.0; b * h * n * n]);
        be.attention_forward(&mut out, &mut p, &qkv.to_vec(), b, n, h, d).unwrap();
        out
    };
    let (mut out, mut p) = (vec![0.0; b * n * c], vec![0.0; b * h * n * n]);
    be.attention_forward(&mut out, &mut p, &qkv, b, n, h, d).unwrap();
    for row in p.chunks(n) {
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5, "softmax rows sum to 1");
    }
    let mut dqkv = vec![0.0; b * n * 3 * c];
    be.attention_backward(&mut dqkv, &r, &qkv, &out, &p, b, n, h, d).unwrap();
    compare("attention dqkv", seed, &mut qkv, &dqkv, &mut |x| dot(&fwd(x), &r));
}

/// The class token's attention equals row 0 of the full attention, and its backward is the
/// gradient of that row with respect to the query and to every key and value (finite
/// differences), on fresh random inputs.
#[test]
fn class_token_attention() {
    let be = Cpu::new();
    let (mut rng, seed) = fresh_rng();
    let (b, n, h, d) = (3, 6, 2, 4);
    let c = h * d;
    let qkv = randn(&mut rng, b * n * 3 * c, 1.5);
    // the class tokens' queries and every token's keys and values, as the tail splits them
    let mut q: Vec<f32> = (0..b).flat_map(|bi| qkv[bi * n * 3 * c..][..c].to_vec()).collect();
    let mut kv: Vec<f32> = qkv.chunks(3 * c).flat_map(|row| row[c..].to_vec()).collect();
    let r = randn(&mut rng, b * c, 1.0);
    let fwd = |q: &[f32], kv: &[f32]| -> Vec<f32> {
        let mut out = vec![0.0; b * c];
        be.class_attention_forward(&mut out, &q.to_vec(), &kv.to_vec(), b, n, h, d).unwrap();
        out
    };
    let (mut full, mut p) = (vec![0.0; b * n * c], vec![0.0; b * h * n * n]);
    be.attention_forward(&mut full, &mut p, &qkv, b, n, h, d).unwrap();
    let cls = fwd(&q, &kv);
    for bi in 0..b {
        for (x, y) in cls[bi * c..(bi + 1) * c].iter().zip(&full[bi * n * c..bi * n * c + c]) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "seed {seed}: image {bi}: {x} vs {y}");
        }
    }
    let (mut dq, mut dkv) = (vec![0.0; b * c], vec![0.0; b * n * 2 * c]);
    let mut dbias = vec![0.0f32; 2 * c + 2];
    let span = Span { off: 1, len: 2 * c };
    be.class_attention_backward(&mut dq, &mut dkv, &mut dbias, Some(span), &r, &q, &kv, b, n, h, d).unwrap();
    // the bias gradient is the column sums of dkv: for k zero in exact arithmetic
    // (Σ_j dS_j = 0), for v the sum of dout over images (Σ_j P_j = 1)
    for e in 0..c {
        let v: f32 = (0..b).map(|bi| r[bi * c + e]).sum();
        assert!(dbias[1 + e].abs() < 1e-5, "seed {seed}: k bias gradient {}", dbias[1 + e]);
        assert!((dbias[1 + c + e] - v).abs() < 1e-5, "seed {seed}: v bias gradient {} vs {v}", dbias[1 + c + e]);
    }
    assert!(dbias[0] == 0.0 && dbias[2 * c + 1] == 0.0, "seed {seed}: outside the span");
    let kv0 = kv.clone();
    compare("class attention dq", seed, &mut q, &dq, &mut |x| dot(&fwd(x, &kv0), &r));
    let q0 = q.clone();
    compare("class attention dkv", seed, &mut kv, &dkv, &mut |x| dot(&fwd(&q0, x), &r));
    // add_class_rows: token 0 of each image gets the row, the others are untouched
    let src = randn(&mut rng, b * c, 1.0);
    let mut dst = randn(&mut rng, b * n * c, 1.0);
    let before = dst.clone();
    be.add_class_rows(&mut dst, &src, b, n, c).unwrap();
    for (i, (x, y)) in dst.iter().zip(&before).enumerate() {
        let (row, e) = (i / c, i % c);
        let want = if row % n == 0 { y + src[(row / n) * c + e] } else { *y };
        assert_eq!(*x, want, "seed {seed}: element {i}");
    }
}

#[test]
fn embedding_and_pooling() {
    let be = Cpu::new();
    let (mut rng, seed) = fresh_rng();
    let (b, np, c) = (3, 4, 5);
    for cls in [true, false] {
        let n = np + usize::from(cls);
        let pos = Span { off: 0, len: n * c };
        let cls_span = cls.then_some(Span { off: n * c, len: c });
        let mut params = randn(&mut rng, n * c + c, 1.0);
        let mut patches = randn(&mut rng, b * np * c, 1.0);
        let r = randn(&mut rng, b * n * c, 1.0);
        let fwd = |params: &[f32], patches: &[f32]| {
            let mut out = vec![0.0; b * n * c];
            be.embed_forward(&mut out, &patches.to_vec(), &params.to_vec(), pos, cls_span, b, np, c).unwrap();
            out
        };
        let mut dpatches = vec![0.0; b * np * c];
        let mut dparams = vec![0.0; params.len()];
        be.embed_backward(&mut dpatches, &mut dparams, &r, pos, cls_span, b, np, c).unwrap();
        let p2 = params.clone();
        compare("embed dpatches", seed, &mut patches.clone(), &dpatches, &mut |x| dot(&fwd(&p2, x), &r));
        let x2 = patches.clone();
        compare("embed dparams", seed, &mut params, &dparams, &mut |p| dot(&fwd(p, &x2), &r));
        patches.clear();

        let prefix = usize::from(cls);
        for avg in [false, true] {
            if !avg && !cls {
                continue;
            }
            let mut inp = randn(&mut rng, b * n * c, 1.0);
            let rp = randn(&mut rng, b * c, 1.0);
            let pf = |x: &[f32]| {
                let mut out = vec![0.0; b * c];
                be.pool_forward(&mut out, &x.to_vec(), b, n, c, prefix, avg).unwrap();
                out
            };
            let mut dinp = vec![7.0; b * n * c]; // poisoned: pool_backward must write every element
            be.pool_backward(&mut dinp, &rp, b, n, c, prefix, avg).unwrap();
            compare("pool dinp", seed, &mut inp, &dinp, &mut |x| dot(&pf(x), &rp));
        }
    }
}

#[test]
fn cross_entropy_soft_targets() {
    let be = Cpu::new();
    let (mut rng, seed) = fresh_rng();
    let (b, k) = (4, 6);
    let mut logits = randn(&mut rng, b * k, 3.0);
    let mut targets = vec![0.0f32; b * k];
    for row in targets.chunks_mut(k) {
        let raw = randn(&mut rng, k, 1.0).iter().map(|v| v.exp()).collect::<Vec<_>>();
        let s: f32 = raw.iter().sum();
        row.iter_mut().zip(raw).for_each(|(t, v)| *t = v / s);
    }
    let loss = |x: &[f32]| {
        let mut l = vec![0.0; b];
        be.cross_entropy(&mut l, None, &x.to_vec(), &targets, b, k, 0.0).unwrap();
        l.iter().map(|v| *v as f64).sum::<f64>()
    };
    let mut l = vec![0.0; b];
    let mut dl = vec![0.0; b * k];
    be.cross_entropy(&mut l, Some(&mut dl), &logits, &targets, b, k, 1.0).unwrap();
    compare("cross_entropy dlogits", seed, &mut logits, &dl, &mut |x| loss(x));
}

/// The whole model: every parameter element of a tiny ViT, both pooling modes.
#[test]
fn whole_model_gradients() {
    let be = Cpu::new();
    let (mut rng, seed) = fresh_rng();
    for (pool, cls, qkv_bias) in [(GlobalPool::Token, true, true), (GlobalPool::Avg, false, false), (GlobalPool::Avg, true, true)] {
        let cfg = ModelConfig {
            image_size: 8,
            patch_size: 4,
            in_chans: 3,
            embed_dim: 8,
            depth: 2,
            num_heads: 2,
            mlp_ratio: 2.0,
            num_classes: 3,
            qkv_bias,
            class_token: cls,
            global_pool: pool,
        };
        let b = 2;
        let mut vit = Vit::new(&be, cfg.clone()).unwrap();
        // Larger-than-init weights so every path carries signal.
        let mut params = randn(&mut rng, vit.table.total, 0.5);
        for e in &vit.table.entries {
            if e.name.ends_with("norm1.weight") || e.name.ends_with("norm2.weight") || e.name.contains("norm.weight") {
                params[e.span.range()].iter_mut().for_each(|v| *v += 1.0);
            }
        }
        let images = randn(&mut rng, b * 3 * 64, 1.0);
        let mut targets = vec![0.0f32; b * 3];
        targets[0] = 1.0;
        targets[3 + 2] = 1.0;
        vit.set_params(&be, &params).unwrap();
        vit.zero_grads(&be).unwrap();
        vit.forward(&be, &images, &targets, b, Some(1.0)).unwrap();
        vit.backward(&be).unwrap();
        let grads = be.download(&vit.grads).unwrap();
        let mut probe = |p: &[f32]| {
            vit.set_params(&be, p).unwrap();
            let out = vit.forward(&be, &images, &targets, b, None).unwrap();
            out.losses.iter().map(|v| *v as f64).sum::<f64>()
        };
        // A whole f32 forward is a long chain: central differences of its loss carry more rounding
        // (seen worst ≈ 7e-4, rare outliers higher), so the whole-model bound is looser.
        compare_tol(&format!("model {:?} cls={cls}", pool), seed, &mut params, &grads, &mut probe, 2e-2);
    }
}

/// Running the last block on the class token alone (the default under token pooling) gives the
/// logits and gradients of computing every token, on fresh random weights and images, for
/// both activation policies.
#[test]
fn class_token_tail_matches_every_token() {
    use vitscale::model::init::init_params;
    use vitscale::model::vit::Recompute;
    let be = Cpu::new();
    let (mut rng, seed) = fresh_rng();
    let cfg = ModelConfig {
        image_size: 16,
        patch_size: 4,
        in_chans: 3,
        embed_dim: 16,
        depth: 2,
        num_heads: 2,
        mlp_ratio: 4.0,
        num_classes: 5,
        qkv_bias: true,
        class_token: true,
        global_pool: GlobalPool::Token,
    };
    let b = 3;
    let images = randn(&mut rng, b * 3 * 16 * 16, 1.0);
    let mut targets = vec![0.0f32; b * 5];
    for (i, row) in targets.chunks_mut(5).enumerate() {
        row[(i * 2) % 5] = 1.0;
    }
    let init = init_params(&vitscale::model::ParamTable::new(&cfg), seed);
    let run = |tail: bool, policy: Recompute| {
        let mut vit = Vit::new(&be, cfg.clone()).unwrap();
        vit.set_class_token_tail(tail);
        vit.set_recompute(policy);
        vit.set_params(&be, &init).unwrap();
        vit.zero_grads(&be).unwrap();
        let out = vit.forward(&be, &images, &targets, b, Some(1.0 / b as f32)).unwrap();
        vit.backward(&be).unwrap();
        (out.logits, be.download(&vit.grads).unwrap())
    };
    let (logits_all, grads_all) = run(false, Recompute::Never);
    assert!(grads_all.iter().any(|&g| g != 0.0), "seed {seed}: no gradient at all");
    for policy in [Recompute::Never, Recompute::Always] {
        let (logits, grads) = run(true, policy);
        for (x, y) in logits.iter().zip(&logits_all) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "seed {seed} {policy:?}: logit {x} vs {y}");
        }
        let scale = grads_all.iter().fold(0.0f32, |m, g| m.max(g.abs()));
        for (i, (x, y)) in grads.iter().zip(&grads_all).enumerate() {
            assert!((x - y).abs() <= 1e-5 * scale, "seed {seed} {policy:?}: gradient {i}: {x} vs {y} (largest {scale})");
        }
    }
}
