//! Determinism on the CPU: train → save weights → reload → train gives bit-identical losses
//! every time, the saved file round-trips exactly, and the thread count does not change the
//! numbers (every parallel reduction sums fixed-size chunks in a fixed order).

use vitscale::backend::cpu::Cpu;
use vitscale::config;
use vitscale::model::weights;
use vitscale::train::evaluate;
use vitscale::train::trainer::{self, TrainOptions};

mod common;
use common::{metrics, tmp};

fn cfg(steps: u64) -> vitscale::config::RunConfig {
    let v = serde_json::json!({
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.05}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 12, "warmup_num_steps": 3}},
        "gradient_clipping": 1.0,
        "data": {"train_size": 640, "val_size": 128},
        "train": {"steps": steps, "seed": 3, "log_every": 1, "label_smoothing": 0.1}
    });
    config::resolve(&v, 1).unwrap()
}

/// Per-step training losses from a run directory's metrics.jsonl.
fn losses(run: &std::path::Path) -> Vec<f64> {
    metrics(run, None).iter().map(|v| v["loss"].as_f64().unwrap()).collect()
}

fn run(dir: &std::path::Path, name: &str, steps: u64, init: Option<&std::path::Path>, save: Option<&std::path::Path>) -> (Vec<f64>, f64) {
    let opts = TrainOptions {
        run_dir: dir.join(name),
        init: init.map(|p| p.to_path_buf()),
        save_weights: save.map(|p| p.to_path_buf()),
        progress_bar: false,
        quiet: true,
        ..Default::default()
    };
    let s = trainer::train(&Cpu::new(), &cfg(steps), &opts).unwrap();
    (losses(&opts.run_dir), s.val_loss)
}

#[test]
fn save_reload_train_is_bit_identical() {
    let tmp = tmp();
    let w = tmp.path().join("w.safetensors");
    let (first, val_a) = run(tmp.path(), "a", 6, None, Some(&w));
    assert_eq!(first.len(), 6);

    // The saved file holds exactly the trained weights: evaluating it reproduces the run's
    // final validation loss to the bit.
    let c = cfg(6);
    let be = Cpu::new();
    let mut vit = evaluate::build_model(&be, &c, Some(&w)).unwrap();
    let sets = vitscale::data::open(&c.data, c.model.image_size, c.model.num_classes, c.train.seed).unwrap();
    let ev = evaluate::evaluate(&be, &mut vit, &sets.val, &c, c.train.eval_batch_size).unwrap();
    assert_eq!(ev.loss.to_bits(), val_a.to_bits(), "reloaded weights evaluate differently");

    // Two continuations from the checkpoint: identical loss sequences.
    let (b, _) = run(tmp.path(), "b", 6, Some(&w), None);
    let (c2, _) = run(tmp.path(), "c", 6, Some(&w), None);
    assert_eq!(b, c2);
    assert!(b.iter().all(|l| l.is_finite()));
    // And training moved: the continuation is not a replay of the first run.
    assert_ne!(b, first);
    // Weights written again after reloading are byte-identical to the file read.
    let table = vitscale::model::ParamTable::new(&c.model);
    let host = weights::load(&w, &table).unwrap();
    let w2 = tmp.path().join("w2.safetensors");
    weights::save(&w2, &table, &c.model, &host).unwrap();
    assert_eq!(weights::load(&w2, &table).unwrap(), host);
}

#[test]
fn thread_count_does_not_change_the_numbers() {
    let tmp = tmp();
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let three = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let a = one.install(|| run(tmp.path(), "t1", 4, None, None));
    let b = three.install(|| run(tmp.path(), "t3", 4, None, None));
    assert_eq!(a, b);
}

/// Regenerating the LayerNorm and GELU outputs in the backward (`Recompute::Always`) gives the
/// same logits and bit-identical gradients as keeping them, on fresh random weights and images.
#[test]
fn recompute_policy_does_not_change_gradients() {
    use rand::{Rng, SeedableRng};
    use vitscale::backend::Backend;
    use vitscale::model::vit::{smoothed_targets, Recompute, Vit};
    use vitscale::model::{GlobalPool, ModelConfig, ParamTable};
    let seed: u64 = rand::random();
    let cfg = ModelConfig { image_size: 16, patch_size: 4, in_chans: 3, embed_dim: 32, depth: 2, num_heads: 2, mlp_ratio: 4.0, num_classes: 5, qkv_bias: true, class_token: true, global_pool: GlobalPool::Token };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let b = 6;
    let img: Vec<f32> = (0..b * 3 * 16 * 16).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
    let labels: Vec<u32> = (0..b).map(|_| rng.gen_range(0..5)).collect();
    let targets = smoothed_targets(&labels, 5, 0.1);
    let init = vitscale::model::init::init_params(&ParamTable::new(&cfg), seed);
    let be = Cpu::new();
    let grads = |policy: Recompute| {
        let mut m = Vit::new(&be, cfg.clone()).unwrap();
        m.set_recompute(policy);
        m.set_params(&be, &init).unwrap();
        m.zero_grads(&be).unwrap();
        let out = m.forward(&be, &img, &targets, b, Some(1.0 / b as f32)).unwrap();
        m.backward(&be).unwrap();
        assert_eq!(m.recomputing(), Some(policy == Recompute::Always), "seed {seed}");
        (out.logits, be.download(&m.grads).unwrap())
    };
    let (logits_keep, g_keep) = grads(Recompute::Never);
    let (logits_regen, g_regen) = grads(Recompute::Always);
    assert_eq!(logits_keep, logits_regen, "seed {seed}");
    assert!(g_keep.iter().any(|&g| g != 0.0), "seed {seed}: no gradient at all");
    let differing = g_keep.iter().zip(&g_regen).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert_eq!(differing, 0, "seed {seed}: {differing} of {} gradients differ", g_keep.len());
}

/// Evaluating between steps does not touch training: the per-step losses with an evaluation
/// after every step equal those with evaluations only at the end (the next micro-batch, staged
/// while the backward runs, must not be replaced by evaluation inputs).
#[test]
fn evaluation_between_steps_leaves_training_unchanged() {
    let tmp = tmp();
    let train = |name: &str, eval_every: u64| {
        let mut c = cfg(6);
        c.train.eval_every = eval_every;
        c.train.eval_batch_size = 48; // a different batch size than training's 32
        let opts = TrainOptions { run_dir: tmp.path().join(name), progress_bar: false, quiet: true, ..Default::default() };
        trainer::train(&Cpu::new(), &c, &opts).unwrap();
        losses(&opts.run_dir)
    };
    let often = train("often", 1);
    let rarely = train("rarely", 100);
    assert_eq!(often.len(), 6);
    assert_eq!(often, rarely, "evaluations changed the training losses");
}
