//! Activation checkpointing per block (`train.recompute = "blocks"`, DeepSpeed's
//! `activation_checkpointing` block): the same losses and gradients bit for bit on the CPU as
//! keeping every block's activations (every pooling layout, the class token tail, stochastic
//! depth), the same trained weights end to end, the DeepSpeed block's keys honoured or warned
//! by name, and the memory estimate that knows one block's activations are held at a time.
//! Both recomputes are covered: the whole block's (the CPU's probabilities are larger than the
//! attention output) and the one that reuses each block's kept attention output (a model whose
//! tokens are no more than its head dim, where the CPU's probabilities are no larger).

use rand::Rng;
use vitscale::backend::cpu::Cpu;
use vitscale::backend::Backend;
use vitscale::model::{GlobalPool, ModelConfig, Recompute, Vit};

mod common;
use common::{fresh_rng, ok, tmp, vitscale};

/// (per-image losses, gradients, logits, whether each block kept its attention output) of one
/// forward + backward under `policy`.
fn pass(cfg: &ModelConfig, weights: &[f32], imgs: &[f32], targets: &[f32], b: usize, policy: Recompute, scales: Option<&[f32]>) -> (Vec<f32>, Vec<f32>, Vec<f32>, bool) {
    let be = Cpu::new();
    let mut vit = Vit::new(&be, cfg.clone()).unwrap();
    vit.set_params(&be, weights).unwrap();
    vit.set_recompute(policy);
    if let Some(s) = scales {
        vit.set_branch_scales(&be, Some((s, vec![true; cfg.depth])), b).unwrap();
    }
    // two passes: the second one runs on activations the first left behind
    vit.forward(&be, imgs, targets, b, Some(1.0 / b as f32)).unwrap();
    vit.backward(&be).unwrap();
    vit.zero_grads(&be).unwrap();
    let out = vit.forward(&be, imgs, targets, b, Some(1.0 / b as f32)).unwrap();
    vit.backward(&be).unwrap();
    let kept = vit.checkpoint_kept_attention().expect("activations after a forward");
    (out.losses, be.download(&vit.grads).unwrap(), out.logits, kept)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn checkpointed_blocks_give_the_same_gradients_bit_for_bit() {
    let (mut rng, seed) = fresh_rng();
    let layouts = [(GlobalPool::Token, true), (GlobalPool::Avg, true), (GlobalPool::Avg, false)];
    // 12 px: 9 or 10 tokens over head dim 8 (the whole block recomputed); 8 px: 4 or 5 tokens
    // (each block's attention output kept)
    for (image_size, (pool, class_token)) in [12, 8].into_iter().flat_map(|px| layouts.map(|l| (px, l))) {
        let cfg = ModelConfig { image_size, patch_size: 4, in_chans: 3, embed_dim: 24, depth: 3, num_heads: 3, mlp_ratio: 2.0, num_classes: 5, qkv_bias: true, class_token, global_pool: pool };
        let total = vitscale::model::ParamTable::new(&cfg).total;
        let weights: Vec<f32> = (0..total).map(|_| rng.gen_range(-0.2f32..0.2)).collect();
        let b = 3;
        let imgs: Vec<f32> = (0..b * 3 * image_size * image_size).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let mut targets = vec![0.0f32; b * 5];
        (0..b).for_each(|i| targets[i * 5 + rng.gen_range(0..5)] = 1.0);
        let scales: Vec<f32> = (0..cfg.depth * 2 * b).map(|_| if rng.gen_bool(0.3) { 0.0 } else { 1.0 / 0.7 }).collect();
        for drop in [None, Some(&scales[..])] {
            let kept = pass(&cfg, &weights, &imgs, &targets, b, Recompute::Never, drop);
            let regen = pass(&cfg, &weights, &imgs, &targets, b, Recompute::Always, drop);
            let ckpt = pass(&cfg, &weights, &imgs, &targets, b, Recompute::Blocks, drop);
            let full = pass(&cfg, &weights, &imgs, &targets, b, Recompute::BlocksFull, drop);
            let what = format!("{image_size} px, {pool:?}, class token {class_token}, drop path {} (seed {seed})", drop.is_some());
            assert_eq!(ckpt.3, image_size == 8, "attention output kept: {what}");
            assert!(!kept.3 && !regen.3, "kept attention without checkpointing: {what}");
            assert_eq!(bits(&ckpt.0), bits(&kept.0), "losses: {what}");
            assert_eq!(bits(&ckpt.2), bits(&kept.2), "logits: {what}");
            assert_eq!(bits(&ckpt.1), bits(&kept.1), "gradients: {what}");
            assert_eq!(bits(&regen.1), bits(&kept.1), "regenerated LayerNorm/GELU: {what}");
            assert_eq!((bits(&full.0), bits(&full.1)), (bits(&kept.0), bits(&kept.1)), "blocks_full: {what}");
            assert!(!full.3, "blocks_full kept an attention output: {what}");
            assert!(kept.1.iter().any(|&g| g != 0.0));
        }
    }
}

/// `activation_checkpointing: {}` turns per-block checkpointing on (the run's config says
/// `train.recompute: "blocks"`) and trains to the same weights hash as without; a key it does
/// not implement is warned by name; `train.recompute` given says otherwise.
#[test]
fn the_deepspeed_block_checkpoints_every_block_and_trains_the_same() {
    let t = tmp();
    let run = |name: &str, extra: &[&str]| {
        let mut a: Vec<String> = ["train", "--device", "cpu", "--set", "data.train_size=128", "--set", "data.val_size=32", "--set", "train.steps=3", "--json"]
            .iter().map(|s| s.to_string()).collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a.extend(["--run-dir".to_string(), t.path().join(name).display().to_string()]);
        let out = vitscale(t.path(), &a);
        ok(&out, name);
        (common::last_json(&out), String::from_utf8_lossy(&out.stderr).into_owned(), common::read_json(&t.path().join(name).join("config.json")))
    };
    let (plain, _, plain_cfg) = run("plain", &[]);
    let (ckpt, err, ckpt_cfg) = run("ckpt", &["--set", "activation_checkpointing={\"partition_activations\": false, \"cpu_checkpointing\": true}"]);
    assert_eq!(ckpt_cfg["train"]["recompute"], "blocks", "{}", ckpt_cfg["train"]);
    assert_ne!(plain_cfg["train"]["recompute"], "blocks");
    assert_eq!(plain["weights_hash"], ckpt["weights_hash"], "checkpointing changed the trained weights");
    assert!(err.contains("activation_checkpointing.cpu_checkpointing") && !err.contains("activation_checkpointing.partition_activations"), "{err}");
    let (_, _, explicit) = run("explicit", &["--set", "activation_checkpointing={}", "--set", "train.recompute=never"]);
    assert_eq!(explicit["train"]["recompute"], "never");
    let (full, _, full_cfg) = run("full", &["--set", "train.recompute=blocks_full"]);
    assert_eq!(full_cfg["train"]["recompute"], "blocks_full");
    assert_eq!(plain["weights_hash"], full["weights_hash"], "blocks_full changed the trained weights");
    let bad = vitscale(t.path(), &["train", "--device", "cpu", "--set", "activation_checkpointing={\"number_checkpoint\": 4}"]);
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("activation_checkpointing.number_checkpoint"));
}

/// The estimate of a pass under checkpointing holds one block's activations and every block's
/// output: for ViT-L/16 at 1024 px (4 097 tokens, the attention's saved probabilities on the
/// GEMM path) micro 16 on a bf16 device it falls from several hundred GB to what one H200
/// holds, and it never exceeds the estimate without checkpointing.
#[test]
fn the_memory_estimate_holds_one_block_under_checkpointing() {
    use vitscale::train::memory::{estimate, DeviceMemory, RankBatch};
    let v = serde_json::json!({
        "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
        "model": {"preset": "vit_large_patch16_224", "image_size": 1024, "num_classes": 10},
        "data": {"dataset": "synthetic", "train_size": 64, "val_size": 16}
    });
    let cfg = vitscale::config::resolve(&v, 1).expect("config");
    let attention = |b: usize, n: usize, h: usize, _d: usize| b * h * n * n;
    let dev = DeviceMemory { compute_bytes: 2.0, compute_copy: true, attention_saved: &attention };
    let shape = RankBatch { micro: 16, pass_images: 16, eval_images: 16, world: 1 };
    let full = estimate(&cfg, shape, &dev, false, false);
    let ckpt = estimate(&cfg, shape, &dev, false, true);
    let gb = |x: f64| x / 1e9;
    eprintln!("ViT-L/16 1024 px micro 16: {:.0} GB of activations kept, {:.1} GB checkpointed", gb(full.activations), gb(ckpt.activations));
    assert!(ckpt.activations < full.activations / 10.0);
    assert!(ckpt.total < 140e9 && full.total > 200e9, "{:.1} GB / {:.1} GB", gb(ckpt.total), gb(full.total));
    // one block: the saved attention of one (16 × 16 heads × 4097²) at 2 bytes is within it
    let one_attention = 16.0 * 16.0 * 4097.0 * 4097.0 * 2.0;
    assert!(ckpt.activations > one_attention && ckpt.activations < 3.0 * one_attention);

    // the fused attention's state (a log-sum-exp per row: 2·B·H·N slots) is smaller than the
    // attention output, so each checkpointed block keeps both: 24 × (B·N·C + 2·B·H·N) more
    // elements than one block's state alone, the probabilities' (B·H·N²) gone
    let lse = |b: usize, n: usize, h: usize, _d: usize| 2 * b * h * n;
    let fused = DeviceMemory { compute_bytes: 2.0, compute_copy: true, attention_saved: &lse };
    let kept = estimate(&cfg, shape, &fused, false, true);
    let (b, n, h, c) = (16.0, 4097.0, 16.0, 1024.0);
    let (state, probs) = (2.0 * b * h * n, b * h * n * n);
    let expected = ckpt.activations + 2.0 * (state - probs + 24.0 * (b * n * c + state));
    assert!((kept.activations - expected).abs() < 1e-9 * expected, "{} against {expected}", kept.activations);
    eprintln!("with the fused attention: {:.1} GB of activations checkpointed, {:.1} GB in all", gb(kept.activations), gb(kept.total));
    // "blocks_full" keeps no attention output: one block's state in place of the probabilities
    let mut full_cfg = v.clone();
    full_cfg["train"] = serde_json::json!({"recompute": "blocks_full"});
    let full_cfg = vitscale::config::resolve(&full_cfg, 1).expect("config");
    let full = estimate(&full_cfg, shape, &fused, false, true);
    let expected = ckpt.activations + 2.0 * (state - probs);
    assert!((full.activations - expected).abs() < 1e-9 * expected, "{} against {expected}", full.activations);
}

/// Bias gradients handed to the weight products (as the CUDA backend does with its
/// weight-gradient kernel on) instead of to the LayerNorm and attention backwards: the same
/// gradients to f32 rounding (the sums run in another order), with and without stochastic depth
/// and the class-token tail.
#[test]
fn bias_gradients_from_the_weight_products_match_the_default_routing() {
    let (mut rng, seed) = fresh_rng();
    for (pool, class_token) in [(GlobalPool::Token, true), (GlobalPool::Avg, false)] {
        let cfg = ModelConfig { image_size: 12, patch_size: 4, in_chans: 3, embed_dim: 24, depth: 3, num_heads: 3, mlp_ratio: 2.0, num_classes: 5, qkv_bias: true, class_token, global_pool: pool };
        let total = vitscale::model::ParamTable::new(&cfg).total;
        let weights: Vec<f32> = (0..total).map(|_| rng.gen_range(-0.2f32..0.2)).collect();
        let b = 3;
        let imgs: Vec<f32> = (0..b * 3 * 12 * 12).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let mut targets = vec![0.0f32; b * 5];
        (0..b).for_each(|i| targets[i * 5 + rng.gen_range(0..5)] = 1.0);
        let scales: Vec<f32> = (0..cfg.depth * 2 * b).map(|_| if rng.gen_bool(0.3) { 0.0 } else { 1.0 / 0.7 }).collect();
        for drop in [None, Some(&scales[..])] {
            let grads = |be: Cpu| {
                let mut vit = Vit::new(&be, cfg.clone()).unwrap();
                vit.set_params(&be, &weights).unwrap();
                if let Some(s) = drop {
                    vit.set_branch_scales(&be, Some((s, vec![true; cfg.depth])), b).unwrap();
                }
                vit.forward(&be, &imgs, &targets, b, Some(1.0 / b as f32)).unwrap();
                vit.backward(&be).unwrap();
                be.download(&vit.grads).unwrap()
            };
            let (want, got) = (grads(Cpu::new()), grads(Cpu::with_bias_grads_in_products()));
            let what = format!("{pool:?}, class token {class_token}, drop path {} (seed {seed})", drop.is_some());
            assert_eq!(want.len(), got.len());
            let scale = want.iter().fold(0f32, |m, g| m.max(g.abs()));
            assert!(scale > 0.0, "{what}");
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                assert!((w - g).abs() <= 1e-5 * scale, "gradient {i}: {g} against {w}: {what}");
            }
        }
    }
}
