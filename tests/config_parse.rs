//! The config parser against its contract: every default, DeepSpeed's batch rules and error
//! texts, `--set`, unknown keys, invalid values, and real DeepSpeed configs (committed under
//! tests/fixtures/deepspeed/) loading with the expected warnings.

use std::path::PathBuf;

use serde_json::{json, Value};
use vitscale::config::*;
use vitscale::model::spec::GlobalPool;

mod common;
use common::{fixtures, tmp};

fn ok(v: Value) -> RunConfig {
    match resolve(&v, 1) {
        Ok(c) => c,
        Err(e) => panic!("config {v} was rejected: {e}"),
    }
}

/// Resolves and returns the error text, asserting it names `key`.
fn err_names(v: Value, key: &str) -> String {
    let e = match resolve(&v, 1) {
        Ok(_) => panic!("config {v} was accepted, expected an error naming {key}"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains(key), "error `{e}` does not name `{key}`");
    e
}

fn fixture(name: &str) -> PathBuf {
    fixtures().join("deepspeed").join(name)
}

fn load_fixture(name: &str, world: usize) -> RunConfig {
    let v = load_json(Some(&fixture(name)), &[]).unwrap();
    resolve(&v, world).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn has_warning(c: &RunConfig, needle: &str) -> bool {
    c.warnings.iter().any(|w| w.contains(needle))
}

// ---- defaults -------------------------------------------------------------------------------

#[test]
fn empty_config_gives_every_default() {
    let c = ok(json!({}));
    assert_eq!(c.batch, BatchConfig { train_batch_size: 64, micro_batch_per_gpu: 64, gradient_accumulation_steps: 1, world_size: 1, sequence_parallel_size: 1 });
    assert_eq!(
        c.optimizer,
        OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.05, adam_w_mode: true, bias_correction: true }
    );
    assert_eq!(c.scheduler, None);
    assert_eq!(c.gradient_clipping, 0.0);
    assert_eq!(c.precision, Precision::Fp32);
    assert_eq!(c.zero_stage, 0);
    assert_eq!(c.model, vitscale::model::ModelConfig::preset("vit_builtin_default").unwrap());
    assert_eq!(
        c.data,
        DataConfig {
            dataset: DatasetKind::Builtin,
            path: None,
            mean: [0.5; 3],
            std: [0.5; 3],
            augment: Augment::Default,
            shuffle: true,
            num_workers: 0,
            train_size: 6000,
            val_size: 2000,
            label: LabelKind::Fine,
            skip_bad: false,
            val_split: 0.1,
            crop_pct: 0.875,
            scale: [0.08, 1.0],
            ratio: [0.75, 4.0 / 3.0],
            interpolation: Interpolation::Bilinear,
            prefetch: 2,
            decode: Decode::Cpu,
            decode_scale: DecodeScale::Auto,
            decode_cpu_share: 0.0,
            aug: Default::default(),
        }
    );
    assert_eq!(
        c.train,
        TrainConfig {
            epochs: 10,
            steps: None,
            seed: 0,
            eval_every: 0,
            checkpoint_every: 0,
            label_smoothing: 0.0,
            weight_decay_skip: DecaySkip { bias: true, norm: true, pos_embed: true, cls_token: true },
            log_every: 10,
            eval_batch_size: 64,
            checkpoint_on_signal: false,
            comm_timeout_s: 300.0,
            recompute: vitscale::model::Recompute::Auto,
            pass_images: None,
            emulate_slowdown: Vec::new(),
            balance: Balance::Off,
            balance_every: 5,
            ema: None,
        }
    );
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn cifar_defaults() {
    let c = ok(json!({"data": {"dataset": "cifar10", "path": "x"}}));
    assert_eq!(c.data.mean, [0.4914, 0.4822, 0.4465]);
    assert_eq!(c.data.std, [0.2470, 0.2435, 0.2616]);
    assert_eq!(c.data.path, Some(PathBuf::from("x")));
    let mut want = vitscale::model::ModelConfig::preset("vit_tiny_patch4_32").unwrap();
    assert_eq!(c.model, want);
    let c = ok(json!({"data": {"dataset": "cifar100", "path": "x"}}));
    assert_eq!(c.data.mean, [0.5071, 0.4865, 0.4409]);
    assert_eq!(c.data.std, [0.2673, 0.2564, 0.2762]);
    want.num_classes = 100;
    assert_eq!(c.model, want);
    let c = ok(json!({"data": {"dataset": "synthetic"}}));
    assert_eq!((c.data.mean, c.data.std), ([0.5; 3], [0.5; 3]));
    assert_eq!(c.model.num_classes, 10);
}

#[test]
fn optimizer_block_defaults_are_deepspeeds() {
    // FusedAdam defaults: weight_decay 0 (not our no-block 0.05).
    let c = ok(json!({"optimizer": {"type": "Adam"}}));
    assert_eq!(
        c.optimizer,
        OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, adam_w_mode: true, bias_correction: true }
    );
    let c = ok(json!({"optimizer": {"type": "adam", "params": {"adam_w_mode": false, "weight_decay": 0.1}}}));
    assert!(matches!(c.optimizer, OptimizerConfig::Adam { adam_w_mode: false, weight_decay, .. } if weight_decay == 0.1));
    // AdamW forces decoupled decay, with a warning when told otherwise.
    let c = ok(json!({"optimizer": {"type": "ADAMW", "params": {"adam_w_mode": false}}}));
    assert!(matches!(c.optimizer, OptimizerConfig::Adam { adam_w_mode: true, .. }));
    assert!(has_warning(&c, "adam_w_mode"));
    // torch_adam uses torch.optim.AdamW's default weight decay.
    let c = ok(json!({"optimizer": {"type": "AdamW", "params": {"torch_adam": true}}}));
    assert!(matches!(c.optimizer, OptimizerConfig::Adam { weight_decay, .. } if weight_decay == 0.01));
    let c = ok(json!({"optimizer": {"type": "SGD"}}));
    assert_eq!(c.optimizer, OptimizerConfig::Sgd { lr: 1e-3, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false });
}

#[test]
fn scheduler_defaults_are_deepspeeds() {
    let c = ok(json!({"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}, "scheduler": {"type": "WarmupLR"}}));
    assert_eq!(
        c.scheduler,
        Some(SchedulerConfig::WarmupLR { warmup_min_lr: 0.0, warmup_max_lr: 5e-4, warmup_num_steps: 1000, warmup_type: WarmupType::Log })
    );
    let c = ok(json!({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5000}}}));
    assert_eq!(
        c.scheduler,
        Some(SchedulerConfig::WarmupDecayLR {
            warmup_min_lr: 0.0, warmup_max_lr: 0.001, warmup_num_steps: 1000, warmup_type: WarmupType::Log, total_num_steps: TotalSteps::Fixed(5000)
        })
    );
    let c = ok(json!({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000}}}));
    assert_eq!(
        c.scheduler,
        Some(SchedulerConfig::WarmupCosineLR {
            total_num_steps: TotalSteps::Fixed(5000), warmup_min_ratio: 0.0, warmup_num_steps: 1000, cos_min_ratio: 0.0001, warmup_type: WarmupType::Log
        })
    );
    err_names(json!({"scheduler": {"type": "WarmupDecayLR"}}), "scheduler.params.total_num_steps");
    // "auto" = the run's length, which the training loop supplies: the parser keeps it, also
    // when train.steps is given.
    let c = ok(json!({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}}));
    assert!(matches!(c.scheduler, Some(SchedulerConfig::WarmupCosineLR { total_num_steps: TotalSteps::RunLength, .. })));
    // documented usage: the run's length, without a warning
    assert!(!has_warning(&c, "total_num_steps"), "{:?}", c.warnings);
    let c = ok(json!({"train": {"steps": 77}, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 7}}}));
    assert!(matches!(c.scheduler, Some(SchedulerConfig::WarmupDecayLR { total_num_steps: TotalSteps::RunLength, .. })));
    // A fixed schedule that ends inside its warmup is warned about.
    let c = ok(json!({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5, "warmup_num_steps": 10}}}));
    assert!(has_warning(&c, "scheduler.params.total_num_steps 5 is less than warmup_num_steps 10"), "{:?}", c.warnings);
    // Unknown warmup_type: DeepSpeed's fallback to log, with a warning.
    let c = ok(json!({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}}));
    assert!(matches!(c.scheduler, Some(SchedulerConfig::WarmupLR { warmup_type: WarmupType::Log, .. })));
    assert!(has_warning(&c, "warmup_type"));
}

#[test]
fn precision_blocks() {
    let c = ok(json!({"fp16": {"enabled": true}}));
    assert_eq!(
        c.precision,
        Precision::Fp16 { loss_scale: 0.0, initial_scale_power: 16, loss_scale_window: 1000, hysteresis: 2, min_loss_scale: 1.0, consecutive_hysteresis: false }
    );
    assert_eq!(ok(json!({"bf16": {"enabled": true}})).precision, Precision::Bf16);
    assert_eq!(ok(json!({"bfloat16": {"enabled": true}})).precision, Precision::Bf16);
    assert_eq!(ok(json!({"fp16": {"enabled": false, "loss_scale": 128}})).precision, Precision::Fp32);
    let e = err_names(json!({"fp16": {"enabled": true}, "bf16": {"enabled": true}}), "fp16");
    assert!(e.contains("cannot be simultaneously enabled"), "{e}");
    err_names(json!({"fp16": {"enabled": true, "hysteresis": 0}}), "fp16.hysteresis");
    err_names(json!({"fp16": {"enabled": true, "loss_scal": 0}}), "fp16.loss_scal");
}

#[test]
fn zero_stage() {
    // ZeRO-3 runs as itself, with DeepSpeed's stage-3 defaults and no warning
    let c = ok(json!({"zero_optimization": {"stage": 3}}));
    assert_eq!(c.zero_stage, 3);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert_eq!(c.zero3, vitscale::config::Stage3Config { prefetch_bucket_size: 50_000_000, param_persistence_threshold: 100_000, max_live_parameters: 1_000_000_000 });
    assert_eq!(ok(json!({"zero_optimization": {"stage": 2}})).zero_stage, 2);
    assert!(ok(json!({"zero_optimization": {"stage": 2}})).warnings.is_empty());
    let e = err_names(json!({"zero_optimization": {"stage": 4}}), "zero_optimization.stage");
    assert!(e.contains("[0, 3]"), "{e}");
    let c = ok(json!({"zero_optimization": true}));
    assert_eq!(c.zero_stage, 1);
    assert!(has_warning(&c, "deprecated"));
    // the sharded update's keys: honoured, validated, and named when wrong
    let c = ok(json!({"zero_optimization": {"stage": 2, "reduce_scatter": false, "overlap_comm": false, "contiguous_gradients": true}}));
    assert!(!c.zero_reduce_scatter && !c.zero_overlap_comm);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let d = ok(json!({"zero_optimization": {"stage": 1}}));
    assert!(d.zero_reduce_scatter && d.zero_overlap_comm, "defaults");
    for (bad, key) in [
        (json!({"stage": -1}), "zero_optimization.stage"),
        (json!({"stage": "two"}), "zero_optimization.stage"),
        (json!({"stage": 2, "reduce_scatter": "yes"}), "zero_optimization.reduce_scatter"),
        (json!({"stage": 2, "overlap_comm": 1}), "zero_optimization.overlap_comm"),
        (json!({"stage": 2, "contiguous_gradients": "on"}), "zero_optimization.contiguous_gradients"),
        (json!({"stage": 2, "allgather_bucket_size": 0}), "zero_optimization.allgather_bucket_size"),
        (json!({"stage": 2, "allgather_bucket_size": "big"}), "zero_optimization.allgather_bucket_size"),
        (json!({"stage": 2, "reduce_bucket_size": 0}), "zero_optimization.reduce_bucket_size"),
        (json!({"stage": 2, "reduce_scater": true}), "zero_optimization.reduce_scater"),
    ] {
        err_names(json!({"zero_optimization": bad}), key);
    }
    let e = err_names(json!({"zero_optimization": {"stage": 2, "reduce_scater": true}}), "zero_optimization.reduce_scater");
    assert!(e.contains("reduce_scatter"), "the closest key is suggested: {e}");
    assert!(err_names(json!({"zero_optimization": 2}), "zero_optimization").contains("expected an object"));
    let e = err_names(json!({"zero_optimization": {"stage": 2, "overlap_com": true}}), "zero_optimization.overlap_com");
    assert!(e.contains("overlap_comm"), "{e}");
}

#[test]
fn train_section_values() {
    let c = ok(json!({
        "train_micro_batch_size_per_gpu": 32,
        "steps_per_print": 50,
        "train": {"epochs": 3, "steps": 100, "seed": 7, "eval_every": 20, "checkpoint_every": 50, "label_smoothing": 0.1,
                  "weight_decay_skip": []}
    }));
    assert_eq!(c.train.steps, Some(100));
    assert_eq!(c.train.seed, 7);
    assert_eq!(c.train.log_every, 50, "steps_per_print is the default of log_every");
    assert_eq!(c.train.eval_batch_size, 32);
    assert_eq!(c.train.weight_decay_skip, DecaySkip { bias: false, norm: false, pos_embed: false, cls_token: false });
    let c = ok(json!({"train": {"log_every": 3, "eval_batch_size": 500, "weight_decay_skip": ["norm"]}}));
    assert_eq!((c.train.log_every, c.train.eval_batch_size), (3, 500));
    assert_eq!(c.train.weight_decay_skip, DecaySkip { bias: false, norm: true, pos_embed: false, cls_token: false });
}

#[test]
fn signal_checkpoint_and_comm_timeout_keys() {
    // checkpoint_on_signal follows checkpoint_every unless given.
    let c = ok(json!({"train": {"checkpoint_every": 5}}));
    assert!(c.train.checkpoint_on_signal);
    assert_eq!(c.train.comm_timeout_s, 300.0);
    let c = ok(json!({"train": {"checkpoint_every": 5, "checkpoint_on_signal": false, "comm_timeout_s": 2.5}}));
    assert!(!c.train.checkpoint_on_signal);
    assert_eq!(c.train.comm_timeout_s, 2.5);
    assert!(ok(json!({"train": {"checkpoint_on_signal": true}})).train.checkpoint_on_signal);
    let e = err_names(json!({"train": {"comm_timeout_s": 0}}), "train.comm_timeout_s");
    assert!(e.contains("(0, inf)"), "{e}");
    err_names(json!({"train": {"checkpoint_on_signal": "yes"}}), "train.checkpoint_on_signal");
}

#[test]
fn model_fields_override_the_preset() {
    let c = ok(json!({"model": {"preset": "vit_small_patch16_224", "depth": 2, "global_pool": "avg", "class_token": false,
                               "qkv_bias": false, "mlp_ratio": 2.0, "image_size": 32, "patch_size": 8}}));
    let m = &c.model;
    assert_eq!((m.embed_dim, m.num_heads, m.depth, m.image_size, m.patch_size), (384, 6, 2, 32, 8));
    assert_eq!((m.global_pool, m.class_token, m.qkv_bias, m.mlp_ratio), (GlobalPool::Avg, false, false, 2.0));
    assert_eq!(m.num_classes, 10, "num_classes follows the dataset, not the ImageNet preset");
    let c = ok(json!({"data": {"dataset": "synthetic"}, "model": {"num_classes": 37}}));
    assert_eq!(c.model.num_classes, 37);
}

// ---- the batch triple -------------------------------------------------------------------------

fn batch(t: Option<usize>, m: Option<usize>, g: Option<usize>, w: usize) -> Result<(usize, usize, usize), String> {
    resolve_batch(t, m, g, w).map(|b| (b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps)).map_err(|e| e.to_string())
}

#[test]
fn batch_triple_follows_deepspeed() {
    assert_eq!(batch(Some(256), Some(16), Some(4), 4), Ok((256, 16, 4)));
    assert_eq!(batch(Some(256), Some(16), None, 4), Ok((256, 16, 4)));
    assert_eq!(batch(Some(256), None, Some(4), 4), Ok((256, 16, 4)));
    assert_eq!(batch(None, Some(16), Some(4), 4), Ok((256, 16, 4)));
    assert_eq!(batch(Some(256), None, None, 4), Ok((256, 64, 1)));
    assert_eq!(batch(None, Some(16), None, 4), Ok((64, 16, 1)));
    // vitscale extension: none given.
    assert_eq!(batch(None, None, None, 2), Ok((128, 64, 1)));
}

#[test]
fn batch_errors_are_deepspeeds_text() {
    let e = batch(Some(100), Some(16), Some(2), 2).unwrap_err();
    assert!(e.contains("Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 100 != 16 * 2 * 2"), "{e}");
    // Derivation by integer division, then the assertion (as DeepSpeed).
    let e = batch(Some(100), Some(3), None, 1).unwrap_err();
    assert!(e.contains("100 != 3 * 33 * 1"), "{e}");
    let e = batch(Some(8), Some(16), None, 1).unwrap_err();
    assert!(e.contains("Gradient accumulation steps: 0 has to be greater than 0"), "{e}");
    let e = batch(Some(2), None, None, 4).unwrap_err();
    assert!(e.contains("Micro batch size per gpu: 0 has to be greater than 0"), "{e}");
    let e = batch(None, None, Some(4), 1).unwrap_err();
    assert!(e.contains("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided"), "{e}");
    let e = batch(Some(0), Some(1), Some(1), 1).unwrap_err();
    assert!(e.contains("Train batch size: 0 has to be greater than 0"), "{e}");
}

#[test]
fn batch_keys_in_json_and_auto() {
    let c = resolve(&json!({"train_batch_size": 64, "gradient_accumulation_steps": 2}), 4).unwrap();
    assert_eq!(c.batch, BatchConfig { train_batch_size: 64, micro_batch_per_gpu: 8, gradient_accumulation_steps: 2, world_size: 4, sequence_parallel_size: 1 });
    let c = ok(json!({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 32}));
    assert_eq!((c.batch.train_batch_size, c.batch.micro_batch_per_gpu), (32, 32));
    assert!(has_warning(&c, "train_batch_size: \"auto\""));
    err_names(json!({"train_batch_size": -4}), "train_batch_size");
    err_names(json!({"gradient_accumulation_steps": 1.5, "train_batch_size": 8}), "gradient_accumulation_steps");
}

// ---- unknown keys and invalid values ------------------------------------------------------------

#[test]
fn unknown_keys_are_named_with_a_suggestion() {
    // At the top level DeepSpeed ignores unknown keys: a warning with the suggestion.
    let c = ok(json!({"train_batch_sise": 8}));
    assert!(has_warning(&c, "train_batch_sise: unknown key at the top level (did you mean \"train_batch_size\"?)"), "{:?}", c.warnings);
    let e = err_names(json!({"model": {"embed_dims": 8}}), "model.embed_dims");
    assert!(e.contains("embed_dim"), "{e}");
    let e = err_names(json!({"data": {"datset": "cifar10"}}), "data.datset");
    assert!(e.contains("dataset"), "{e}");
    err_names(json!({"train": {"epoch": 3}}), "train.epoch");
    let e = err_names(json!({"train": {"checkpoint": 3}}), "train.checkpoint");
    assert!(e.contains("did you mean \"checkpoint_every\""), "{e}");
    err_names(json!({"optimizer": {"type": "AdamW", "params": {"beta": [0.9, 0.99]}}}), "optimizer.params.beta");
    err_names(json!({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}), "optimizer.params.betas");
    err_names(json!({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 10}}}), "scheduler.params.total_num_steps");
    err_names(json!({"optimizer": {"type": "AdamW", "parms": {}}}), "optimizer.parms");
}

#[test]
fn invalid_values_name_their_key() {
    let cases = [
        (json!({"optimizer": {"type": "Adam", "params": {"betas": [0.9, 1.0]}}}), "optimizer.params.betas"),
        (json!({"optimizer": {"type": "Adam", "params": {"betas": [0.9]}}}), "optimizer.params.betas"),
        (json!({"optimizer": {"type": "Adam", "params": {"eps": 0}}}), "optimizer.params.eps"),
        (json!({"optimizer": {"type": "Adam", "params": {"lr": -1}}}), "optimizer.params.lr"),
        (json!({"optimizer": {"type": "Adam", "params": {"amsgrad": true}}}), "optimizer.params.amsgrad"),
        (json!({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}), "optimizer.params.max_grad_norm"),
        (json!({"optimizer": {"type": "SGD", "params": {"nesterov": true}}}), "optimizer.params.nesterov"),
        (json!({"optimizer": {"type": "SGD", "params": {"nesterov": true, "momentum": 0.9, "dampening": 0.1}}}), "optimizer.params.nesterov"),
        (json!({"optimizer": {"type": null, "params": {"lr": -1}}}), "optimizer.params.lr"),
        (json!({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}), "scheduler.params.warmup_num_steps"),
        (json!({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": 2}}}), "scheduler.params.cos_min_ratio"),
        (json!({"gradient_clipping": -1}), "gradient_clipping"),
        (json!({"model": {"preset": "vit_huge"}}), "model.preset"),
        (json!({"model": {"num_heads": 5}}), "model.num_heads"),
        (json!({"model": {"patch_size": 5}}), "model.patch_size"),
        (json!({"model": {"in_chans": 1}}), "model.in_chans"),
        (json!({"model": {"global_pool": "max"}}), "model.global_pool"),
        (json!({"model": {"num_classes": 100}}), "model.num_classes"),
        (json!({"model": {"class_token": false}}), "model.global_pool"),
        (json!({"data": {"dataset": "imagenet"}}), "data.dataset"),
        (json!({"data": {"dataset": "cifar10"}}), "data.path"),
        (json!({"data": {"path": "somewhere"}}), "data.path"),
        (json!({"data": {"dataset": "cifar10", "path": "x", "train_size": 5}}), "data.train_size"),
        (json!({"data": {"std": [0.5, 0.0, 0.5]}}), "data.std"),
        (json!({"data": {"mean": [0.5, 0.5]}}), "data.mean"),
        (json!({"data": {"augment": "randaug"}}), "data.augment"),
        (json!({"data": {"shuffle": "yes"}}), "data.shuffle"),
        (json!({"train": {"label_smoothing": 1.0}}), "train.label_smoothing"),
        (json!({"train": {"epochs": 0}}), "train.epochs"),
        (json!({"train": {"weight_decay_skip": ["bias", "head"]}}), "train.weight_decay_skip"),
        (json!({"train": {"weight_decay_skip": ["bias", "bias"]}}), "train.weight_decay_skip"),
        (json!({"model": 3}), "model"),
    ];
    for (v, key) in cases {
        err_names(v, key);
    }
    // Accepted values are listed.
    let e = err_names(json!({"data": {"augment": "randaug"}}), "data.augment");
    assert!(e.contains("\"none\"") && e.contains("\"default\""), "{e}");
    let e = err_names(json!({"model": {"preset": "vit_huge"}}), "model.preset");
    assert!(e.contains("vit_base_patch16_224") && e.contains("vit_builtin_default"), "{e}");
}

#[test]
fn unsupported_optimizers_and_schedules_list_the_supported_ones() {
    for t in ["OneBitAdam", "Lamb", "Adagrad", "RMSprop"] {
        let e = err_names(json!({"optimizer": {"type": t}}), "optimizer.type");
        assert!(e.contains("\"Adam\", \"AdamW\", \"SGD\""), "{e}");
    }
    for t in ["OneCycle", "LRRangeTest", "Cosine"] {
        let e = err_names(json!({"scheduler": {"type": t}}), "scheduler.type");
        assert!(e.contains("\"WarmupLR\", \"WarmupDecayLR\", \"WarmupCosineLR\""), "{e}");
    }
}

#[test]
fn unimplemented_deepspeed_features_warn_and_disabled_ones_do_not() {
    let c = ok(json!({
        "wandb": {"enabled": true, "project": "p"},
        "csv_monitor": {"enabled": false},
        "comms_logger": {"enabled": true},
        "wall_clock_breakdown": true,
        "zero_allow_untested_optimizer": true
    }));
    assert!(has_warning(&c, "wandb"));
    assert!(has_warning(&c, "comms_logger"));
    assert!(!has_warning(&c, "csv_monitor"));
    assert!(!has_warning(&c, "wall_clock_breakdown"));
    assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
}

#[test]
fn gradient_communication_keys_follow_deepspeed() {
    use vitscale::config::CommDtype;
    // the dtype defaults to the compute precision's, as DeepSpeed's engine does
    assert_eq!(ok(json!({})).grad_comm.dtype, CommDtype::Fp32);
    assert_eq!(ok(json!({"bf16": {"enabled": true}})).grad_comm.dtype, CommDtype::Bf16);
    assert_eq!(ok(json!({"bf16": {"enabled": true}, "communication_data_type": "fp32"})).grad_comm.dtype, CommDtype::Fp32);
    assert_eq!(ok(json!({"communication_data_type": "BF16"})).grad_comm.dtype, CommDtype::Bf16);
    let c = ok(json!({"prescale_gradients": true, "gradient_predivide_factor": 2.5}));
    assert!(c.grad_comm.prescale && c.grad_comm.predivide == 2.5 && c.warnings.is_empty(), "{:?}", c.warnings);
    // fp16 reductions are not implemented: accepted with a warning, reduced in fp32
    let c = ok(json!({"communication_data_type": "fp16"}));
    assert!(has_warning(&c, "communication_data_type") && c.grad_comm.dtype == CommDtype::Fp32);
    let e = err_names(json!({"communication_data_type": "int8"}), "communication_data_type");
    assert!(e.contains("\"bf16\""), "{e}");
    err_names(json!({"communication_data_type": 16}), "communication_data_type");
    for bad in [json!(0.0), json!(-1.0), json!("2")] {
        err_names(json!({"gradient_predivide_factor": bad}), "gradient_predivide_factor");
    }
    err_names(json!({"prescale_gradients": "yes"}), "prescale_gradients");
}

// ---- files and --set ------------------------------------------------------------------------------

#[test]
fn set_overrides() {
    let sets: Vec<String> = [
        "data.dataset=cifar10",
        "data.path=/data/cifar-10",
        "data.mean=[0.5,0.5,0.5]",
        "optimizer.type=SGD",
        "optimizer.params.lr=0.05",
        "train.steps=12",
        "model.qkv_bias=false",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let v = load_json(None, &sets).unwrap();
    assert_eq!(v["data"]["dataset"], json!("cifar10"));
    assert_eq!(v["optimizer"]["params"]["lr"], json!(0.05));
    assert_eq!(v["train"]["steps"], json!(12));
    let c = ok(v);
    assert_eq!(c.data.dataset, DatasetKind::Cifar10);
    assert_eq!(c.data.mean, [0.5; 3]);
    assert_eq!(c.optimizer.lr(), 0.05);
    assert!(!c.model.qkv_bias);
    // A later --set wins; a --set over a file value replaces it.
    let v = load_json(Some(&fixture("cifar_tutorial.json")), &["train_batch_size=32".into(), "train_batch_size=48".into()]).unwrap();
    assert_eq!(v["train_batch_size"], json!(48));
}

#[test]
fn set_errors_name_the_argument() {
    let e = load_json(None, &["data.dataset".into()]).unwrap_err().to_string();
    assert!(e.contains("--set data.dataset"), "{e}");
    let e = load_json(None, &["data..x=1".into()]).unwrap_err().to_string();
    assert!(e.contains("--set data..x=1"), "{e}");
    let e = load_json(None, &["train_batch_size=8".into(), "train_batch_size.x=1".into()]).unwrap_err().to_string();
    assert!(e.contains("--set train_batch_size.x=1") && e.contains("not an object"), "{e}");
}

#[test]
fn file_errors_name_the_file_and_position() {
    let dir = tmp();
    let p = dir.path().join("bad.json");
    std::fs::write(&p, "{\n  \"train_batch_size\": 8,\n  \"optimizer\": {\"type\": }\n}\n").unwrap();
    let e = load_json(Some(&p), &[]).unwrap_err().to_string();
    assert!(e.contains("bad.json") && e.contains("line 3"), "{e}");
    let e = load_json(Some(&dir.path().join("missing.json")), &[]).unwrap_err().to_string();
    assert!(e.contains("missing.json"), "{e}");
    std::fs::write(&p, "[1, 2]").unwrap();
    let e = load_json(Some(&p), &[]).unwrap_err().to_string();
    assert!(e.contains("bad.json") && e.contains("object"), "{e}");
}

// ---- real DeepSpeed configs ----------------------------------------------------------------------

#[test]
fn deepspeed_cifar_tutorial_config() {
    let c = load_fixture("cifar_tutorial.json", 1);
    assert_eq!(c.batch, BatchConfig { train_batch_size: 16, micro_batch_per_gpu: 16, gradient_accumulation_steps: 1, world_size: 1, sequence_parallel_size: 1 });
    assert_eq!(
        c.optimizer,
        OptimizerConfig::Adam { lr: 0.001, beta1: 0.8, beta2: 0.999, eps: 1e-8, weight_decay: 3e-7, adam_w_mode: true, bias_correction: true }
    );
    assert_eq!(
        c.scheduler,
        Some(SchedulerConfig::WarmupLR { warmup_min_lr: 0.0, warmup_max_lr: 0.001, warmup_num_steps: 1000, warmup_type: WarmupType::Log })
    );
    assert_eq!(c.gradient_clipping, 1.0);
    assert_eq!(
        c.precision,
        Precision::Fp16 { loss_scale: 0.0, initial_scale_power: 15, loss_scale_window: 500, hysteresis: 2, min_loss_scale: 1.0, consecutive_hysteresis: false }
    );
    assert_eq!(c.train.log_every, 2000);
    assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
    assert!(has_warning(&c, "zero_optimization: allgather_partitions, cpu_offload accepted but not implemented"));
    // reduce_scatter, overlap_comm are honoured; allgather_bucket_size is validated and warned
    assert!(has_warning(&c, "zero_optimization.allgather_bucket_size = 50000000: the updated weights are all-gathered per reduce bucket"));
    // reduce_bucket_size is honoured: the gradient buckets' size in elements
    assert_eq!(c.reduce_bucket_size, Some(50_000_000));
    // On 4 ranks the micro batch shrinks to 4, as in DeepSpeed.
    assert_eq!(load_fixture("cifar_tutorial.json", 4).batch.micro_batch_per_gpu, 4);
}

#[test]
fn hf_bf16_zero2_with_auto_values() {
    let c = load_fixture("hf_bf16_zero2_auto.json", 2);
    assert_eq!(c.precision, Precision::Bf16);
    assert_eq!(c.zero_stage, 2);
    assert_eq!(c.batch, BatchConfig { train_batch_size: 128, micro_batch_per_gpu: 64, gradient_accumulation_steps: 1, world_size: 2, sequence_parallel_size: 1 });
    assert_eq!(
        c.optimizer,
        OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, adam_w_mode: true, bias_correction: true }
    );
    // "auto" total_num_steps stays the run's length (known once the dataset is opened).
    assert_eq!(
        c.scheduler,
        Some(SchedulerConfig::WarmupDecayLR {
            warmup_min_lr: 0.0, warmup_max_lr: 0.001, warmup_num_steps: 1000, warmup_type: WarmupType::Log, total_num_steps: TotalSteps::RunLength
        })
    );
    for key in [
        "optimizer.params.lr: \"auto\"",
        "optimizer.params.betas: \"auto\"",
        "optimizer.params.eps: \"auto\"",
        "optimizer.params.weight_decay: \"auto\"",
        "scheduler.params.warmup_max_lr: \"auto\"",
        "gradient_clipping: \"auto\"",
        "train_batch_size: \"auto\"",
        "train_micro_batch_size_per_gpu: \"auto\"",
        "gradient_accumulation_steps: \"auto\"",
        "zero_optimization: offload_optimizer, allgather_partitions accepted",
        "zero_optimization.allgather_bucket_size = 200000000: the updated weights are all-gathered per reduce bucket",
        "zero_optimization.reduce_bucket_size: \"auto\" taken as not given",
    ] {
        assert!(has_warning(&c, key), "missing warning {key}: {:#?}", c.warnings);
    }
    assert!(!has_warning(&c, "total_num_steps"), "documented usage warned: {:?}", c.warnings);
    // The run's length is not known while parsing, so an auto schedule is not compared with the warmup.
    assert!(!has_warning(&c, "is less than warmup_num_steps"), "{:#?}", c.warnings);
    // offload device "none" is not an offload.
    assert!(!has_warning(&c, "ZeRO-Offload"));
}

#[test]
fn fp16_dynamic_loss_scale_with_warmuplr() {
    let c = load_fixture("fp16_dynamic_warmuplr.json", 2);
    assert_eq!(c.batch, BatchConfig { train_batch_size: 64, micro_batch_per_gpu: 8, gradient_accumulation_steps: 4, world_size: 2, sequence_parallel_size: 1 });
    assert_eq!(
        c.optimizer,
        OptimizerConfig::Adam { lr: 3e-4, beta1: 0.9, beta2: 0.98, eps: 1e-6, weight_decay: 0.01, adam_w_mode: false, bias_correction: true }
    );
    assert_eq!(
        c.scheduler,
        Some(SchedulerConfig::WarmupLR { warmup_min_lr: 0.0, warmup_max_lr: 3e-4, warmup_num_steps: 500, warmup_type: WarmupType::Linear })
    );
    assert_eq!(
        c.precision,
        Precision::Fp16 { loss_scale: 0.0, initial_scale_power: 16, loss_scale_window: 1000, hysteresis: 2, min_loss_scale: 1.0, consecutive_hysteresis: false }
    );
    assert_eq!(c.train.log_every, 100);
    // tensorboard is honoured (not warned), as is the disabled flops profiler.
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert_eq!(c.monitor.tensorboard, Some(MonitorTarget { output_path: "logs/".into(), job_name: "vit_fp16".into() }));
}

#[test]
fn monitor_blocks_follow_deepspeed_and_bad_values_name_the_key() {
    let c = ok(json!({"csv_monitor": {"enabled": true, "job_name": "j"}, "tensorboard": {"enabled": false, "output_path": "x"}, "wall_clock_breakdown": true}));
    assert_eq!(c.monitor.csv_monitor, Some(MonitorTarget { output_path: String::new(), job_name: "j".into() }));
    assert_eq!(c.monitor.tensorboard, None);
    assert!(c.monitor.wall_clock_breakdown);
    let d = ok(json!({"tensorboard": {"enabled": true}}));
    assert_eq!(d.monitor.tensorboard.map(|t| t.job_name), Some("DeepSpeedJobName".to_string()));
    assert_eq!(RunConfig { warnings: vec![], ..c.clone() }, resolve(&resolved_json(&c), 1).expect("round trip"));
    err_names(json!({"tensorboard": {"enabled": true, "job": "x"}}), "tensorboard.job");
    err_names(json!({"csv_monitor": {"enabled": "yes"}}), "csv_monitor.enabled");
    err_names(json!({"csv_monitor": {"enabled": true, "job_name": "a/b"}}), "csv_monitor.job_name");
    err_names(json!({"tensorboard": true}), "tensorboard");
    err_names(json!({"wall_clock_breakdown": 3}), "wall_clock_breakdown");
}

#[test]
fn zero3_keys_are_honoured_or_warned_by_name() {
    // the keys with a meaning here, by DeepSpeed's names and its unprefixed aliases; "auto"
    // keeps the default
    let c = ok(json!({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0, "param_persistence_threshold": 5e3, "stage3_max_live_parameters": "auto"}}));
    assert_eq!((c.zero3.prefetch_bucket_size, c.zero3.param_persistence_threshold, c.zero3.max_live_parameters), (0, 5000, 1_000_000_000));
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    assert_eq!(RunConfig { warnings: vec![], ..c.clone() }, resolve(&resolved_json(&c), 1).expect("round trip"));
    // DeepSpeed stage-3 keys without a meaning here: warned, each by name
    let c = ok(json!({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": true, "stage3_model_persistence_threshold": 10}}));
    for k in ["stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save", "stage3_model_persistence_threshold"] {
        assert!(has_warning(&c, k), "{k}: {:?}", c.warnings);
    }
    // stage 3's buckets are the parameter groups
    let c = ok(json!({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1000}}));
    assert!(has_warning(&c, "reduce_bucket_size = 1000: at stage 3"), "{:?}", c.warnings);
    // the honoured ones below stage 3: no effect, said by name
    let c = ok(json!({"zero_optimization": {"stage": 2, "stage3_param_persistence_threshold": 0}}));
    assert!(has_warning(&c, "stage3_param_persistence_threshold only apply at stage 3"), "{:?}", c.warnings);
    // a key DeepSpeed does not have either is an error naming it; so is a key given twice
    err_names(json!({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 1}}), "zero_optimization.stage3_prefetch_bucket_sise");
    err_names(json!({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 2}}), "zero_optimization.stage3_prefetch_bucket_size");
    err_names(json!({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0}}), "zero_optimization.stage3_max_live_parameters");
}

#[test]
fn hf_zero3_with_offload() {
    let c = load_fixture("hf_zero3_offload.json", 8);
    // stage 3 runs as itself; the "auto" stage-3 keys keep their defaults, the live-parameter
    // limit is honoured
    assert_eq!(c.zero_stage, 3);
    assert_eq!(c.zero3.max_live_parameters, 1_000_000_000);
    assert!(!has_warning(&c, "ZeRO-3"));
    // fp16.enabled "auto" is not given → off.
    assert_eq!(c.precision, Precision::Fp32);
    assert!(has_warning(&c, "fp16.enabled: \"auto\""));
    assert!(has_warning(&c, "zero_optimization.offload_optimizer.device = \"cpu\""));
    assert!(has_warning(&c, "zero_optimization.offload_param.device = \"cpu\""));
    assert!(!has_warning(&c, "stage3_max_live_parameters"));
    assert!(has_warning(&c, "stage3_max_reuse_distance"));
    assert!(has_warning(&c, "stage3_gather_16bit_weights_on_model_save"));
    assert_eq!(c.batch.train_batch_size, 512);
    // WarmupLR with an "auto" max takes the optimizer lr.
    assert!(matches!(c.scheduler, Some(SchedulerConfig::WarmupLR { warmup_max_lr, warmup_num_steps: 1000, .. }) if warmup_max_lr == 1e-3));
}

#[test]
fn vitscale_cifar_recipe() {
    let c = load_fixture("vit_cifar10_sgd_cosine.json", 2);
    assert_eq!(c.batch, BatchConfig { train_batch_size: 512, micro_batch_per_gpu: 128, gradient_accumulation_steps: 2, world_size: 2, sequence_parallel_size: 1 });
    assert_eq!(c.optimizer, OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 5e-4, nesterov: true });
    assert_eq!(c.model.embed_dim, 384);
    assert_eq!(c.model.global_pool, GlobalPool::Avg);
    assert_eq!(c.data.dataset, DatasetKind::Cifar10);
    assert_eq!(c.data.num_workers, 4);
    assert_eq!(c.train.weight_decay_skip, DecaySkip { bias: true, norm: true, pos_embed: false, cls_token: false });
    assert_eq!(c.zero_stage, 1);
    // All-false activation_checkpointing asks for nothing: no warning.
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn resolved_json_round_trips() {
    let names = ["cifar_tutorial.json", "hf_bf16_zero2_auto.json", "fp16_dynamic_warmuplr.json", "hf_zero3_offload.json", "vit_cifar10_sgd_cosine.json"];
    for name in names {
        let c = load_fixture(name, 2);
        let again = resolve(&resolved_json(&c), 2).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(RunConfig { warnings: vec![], ..c }, RunConfig { warnings: vec![], ..again.clone() }, "{name}");
        // Only total_num_steps stays "auto" (the run's length is the training loop's to count).
        // (total_num_steps stays "auto", the run's length, which is documented and silent)
        assert!(!again.warnings.iter().any(|w| w.contains("auto") || w.contains("not implemented")), "{name}: {:?}", again.warnings);
    }
    let c = load_fixture("hf_bf16_zero2_auto.json", 2);
    assert_eq!(resolved_json(&c)["scheduler"]["params"]["total_num_steps"], json!("auto"));
    let c = ok(json!({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 12}}}));
    assert_eq!(resolved_json(&c)["scheduler"]["params"]["total_num_steps"], json!(12));
    let c = ok(json!({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}, "train": {"steps": 5}}));
    assert_eq!(RunConfig { warnings: vec![], ..c.clone() }, resolve(&resolved_json(&c), 1).unwrap());
}

#[test]
fn help_text_covers_every_key() {
    let h = help_text();
    for key in ["train_batch_size", "gradient_clipping", "adam_w_mode", "nesterov", "warmup_num_steps", "cos_min_ratio",
                "initial_scale_power", "preset", "global_pool", "num_workers", "label_smoothing", "weight_decay_skip", "tensorboard",
                "reduce_bucket_size"] {
        assert!(h.contains(key), "help text lacks {key}");
    }
    assert!(h.contains("default 0.0001") || h.contains("default 0.0001\n"), "cos_min_ratio default shown");
}

// ---- data pipeline keys ---------------------------------------------------------------------

#[test]
fn data_pipeline_keys_defaults_values_and_errors() {
    let c = ok(json!({}));
    let d = &c.data;
    assert_eq!((d.label, d.skip_bad, d.val_split, d.crop_pct, d.scale, d.ratio, d.prefetch), (LabelKind::Fine, false, 0.1, 0.875, [0.08, 1.0], [0.75, 4.0 / 3.0], 2));
    assert_eq!(d.aug, AugmentOptions::default());
    assert!(!d.aug.mixes() && d.aug.auto_augment.is_none() && d.aug.reprob == 0.0);

    let c = ok(json!({"data": {"dataset": "cifar100", "path": "x", "label": "coarse", "skip_bad": true, "crop_pct": 0.9,
        "scale": [0.35, 1.0], "ratio": [0.5, 2.0], "prefetch": 6}}));
    assert_eq!(c.data.label, LabelKind::Coarse);
    assert_eq!(c.model.num_classes, 20, "coarse CIFAR-100 has 20 classes");
    assert!(c.data.skip_bad);
    assert_eq!((c.data.crop_pct, c.data.scale, c.data.ratio, c.data.prefetch), (0.9, [0.35, 1.0], [0.5, 2.0], 6));
    let e = err_names(json!({"data": {"dataset": "cifar100", "path": "x", "label": "coarse"}, "model": {"num_classes": 100}}), "model.num_classes");
    assert!(e.contains("20"), "{e}");
    err_names(json!({"data": {"dataset": "cifar10", "path": "x", "label": "coarse"}}), "data.label");
    err_names(json!({"data": {"label": "medium"}}), "data.label");
    for (v, key) in [
        (json!({"data": {"val_split": 1.0}}), "data.val_split"),
        (json!({"data": {"val_split": -0.1}}), "data.val_split"),
        (json!({"data": {"crop_pct": 0.0}}), "data.crop_pct"),
        (json!({"data": {"crop_pct": 1.2}}), "data.crop_pct"),
        (json!({"data": {"scale": [0.5, 0.2]}}), "data.scale"),
        (json!({"data": {"scale": [0.0, 1.0]}}), "data.scale"),
        (json!({"data": {"scale": [0.5, 1.5]}}), "data.scale"),
        (json!({"data": {"ratio": [2.0, 1.0]}}), "data.ratio"),
        (json!({"data": {"ratio": [0.0, 1.0]}}), "data.ratio"),
        (json!({"data": {"prefetch": 0}}), "data.prefetch"),
        (json!({"data": {"skip_bad": "yes"}}), "data.skip_bad"),
        (json!({"data": {"dataset": "folder", "path": "x", "train_size": 5}}), "data.train_size"),
        (json!({"data": {"dataset": "folder", "path": "x", "val_size": 5}}), "data.val_size"),
        (json!({"data": {"auto_augment": "augmix-m5"}}), "data.auto_augment"),
        (json!({"data": {"auto_augment": "rand-m9-zz"}}), "data.auto_augment"),
        (json!({"data": {"mixup": -1}}), "data.mixup"),
        (json!({"data": {"mixup_prob": 1.5}}), "data.mixup_prob"),
        (json!({"data": {"mixup_mode": "pairs"}}), "data.mixup_mode"),
        (json!({"data": {"interpolation": "lanczos"}}), "data.interpolation"),
        (json!({"data": {"remode": "zeros"}}), "data.remode"),
        (json!({"data": {"recount": 0}}), "data.recount"),
        (json!({"data": {"reprob": 2}}), "data.reprob"),
        (json!({"data": {"cutmix": 1.0}, "train_micro_batch_size_per_gpu": 7}), "data.cutmix"),
        (json!({"data": {"prefetchh": 2}}), "data.prefetchh"),
    ] {
        err_names(v, key);
    }
}

#[test]
fn folder_defaults_and_timm_augment_keys() {
    let c = ok(json!({"data": {"dataset": "folder", "path": "x"}}));
    assert_eq!((c.data.mean, c.data.std), ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]));
    assert_eq!(c.model.image_size, 224);
    assert_eq!(c.model, vitscale::model::ModelConfig { num_classes: c.model.num_classes, ..vitscale::model::ModelConfig::preset("vit_tiny_patch16_224").unwrap() });
    assert_eq!((c.data.interpolation, c.data.aug.mixup_mode), (Interpolation::Bilinear, MixMode::Batch));
    let c = ok(json!({"data": {"auto_augment": "rand-m9-mstd0.5-inc1", "mixup": 0.8, "cutmix": 1.0, "mixup_prob": 0.9,
        "mixup_switch_prob": 0.4, "mixup_mode": "elem", "reprob": 0.25, "remode": "const", "recount": 2, "interpolation": "bicubic"}}));
    assert_eq!((c.data.interpolation, c.data.aug.mixup_mode), (Interpolation::Bicubic, MixMode::Elem));
    assert_eq!(ok(json!({"data": {"mixup_mode": "pair"}})).data.aug.mixup_mode, MixMode::Pair);
    let a = &c.data.aug;
    let ra = a.auto_augment.as_ref().unwrap();
    assert_eq!((ra.magnitude, ra.num_layers, ra.magnitude_std, ra.increasing), (9.0, 2, 0.5, true));
    assert_eq!((a.mixup, a.cutmix, a.mixup_prob, a.mixup_switch_prob), (0.8, 1.0, 0.9, 0.4));
    assert_eq!((a.reprob, a.remode, a.recount), (0.25, EraseMode::Const, 2));
    // The resolved config reads back to the same options.
    assert_eq!(RunConfig { warnings: vec![], ..c.clone() }, resolve(&resolved_json(&c), 1).unwrap());
    let c = ok(json!({"data": {"augment": "none", "mixup": 0.8}}));
    assert!(has_warning(&c, "not applied"), "{:?}", c.warnings);
    let h = help_text();
    for key in ["label", "skip_bad", "val_split", "crop_pct", "scale", "ratio", "prefetch", "auto_augment", "mixup_switch_prob", "mixup_mode", "interpolation", "bicubic", "reprob", "remode", "recount", "folder"] {
        assert!(h.contains(key), "help text lacks {key}");
    }
}

#[test]
fn total_num_steps_auto_is_left_to_the_training_loop() {
    // The parser does not open the dataset for "auto": a folder or CIFAR path that does not
    // exist still parses, to the run's length.
    let missing = tmp().path().join("not-there");
    let c = ok(json!({"train_batch_size": 4, "data": {"dataset": "folder", "path": missing, "val_split": 0.2}, "model": {"num_classes": 2},
        "train": {"epochs": 3}, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 2}}}));
    assert!(matches!(c.scheduler, Some(SchedulerConfig::WarmupCosineLR { total_num_steps: TotalSteps::RunLength, .. })), "{:?}", c.scheduler);
    let c = ok(json!({"train_batch_size": 4, "data": {"dataset": "cifar10", "path": missing}, "train": {"epochs": 5},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 2}}}));
    assert!(matches!(c.scheduler, Some(SchedulerConfig::WarmupDecayLR { total_num_steps: TotalSteps::RunLength, .. })), "{:?}", c.scheduler);
}

#[test]
fn total_num_steps_auto_schedules_like_the_run_length() {
    use vitscale::train::schedule::lr_at;
    // For a run of N optimizer steps, "auto" gives the learning rates of total_num_steps = N.
    for ty in ["WarmupDecayLR", "WarmupCosineLR"] {
        let sched = |total: Value| {
            ok(json!({"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                "scheduler": {"type": ty, "params": {"total_num_steps": total, "warmup_num_steps": 4, "warmup_type": "linear"}}}))
        };
        let auto = sched(json!("auto"));
        for n in [2u64, 9, 250] {
            let fixed = sched(json!(n));
            for step in 0..n + 3 {
                let a = lr_at(auto.scheduler.as_ref(), auto.optimizer.lr(), step, n);
                // The run length passed with a fixed total is ignored: any other value gives the same.
                let f = lr_at(fixed.scheduler.as_ref(), fixed.optimizer.lr(), step, n + 1000);
                assert_eq!(a, f, "{ty}, run of {n} steps, step {step}");
            }
        }
    }
}

#[test]
fn train_recompute_policy() {
    use vitscale::model::Recompute;
    assert_eq!(ok(json!({})).train.recompute, Recompute::Auto);
    assert_eq!(ok(json!({"train": {"recompute": "always"}})).train.recompute, Recompute::Always);
    assert_eq!(ok(json!({"train": {"recompute": "never"}})).train.recompute, Recompute::Never);
    let e = err_names(json!({"train": {"recompute": "sometimes"}}), "train.recompute");
    assert!(e.contains("\"auto\""), "{e}");
}

#[test]
fn resume_free_keys_are_the_run_length_logging_and_batch_split() {
    let mut free = resume_free_keys();
    free.sort();
    let mut want = vec![
        "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "sequence_parallel_size", "plan", "memory",
        "zero_optimization.stage", "zero_optimization.reduce_bucket_size", "zero_optimization.reduce_scatter", "zero_optimization.overlap_comm",
        "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_max_live_parameters",
        "train.epochs", "train.steps", "train.recompute", "train.pass_images", "train.eval_every", "train.checkpoint_every", "train.log_every",
        "train.eval_batch_size", "train.checkpoint_on_signal", "train.comm_timeout_s", "train.emulate_slowdown", "train.balance", "train.balance_every",
        "data.path", "data.num_workers", "data.prefetch", "data.decode", "data.decode_scale",
        "data.decode_cpu_share",
    ];
    want.sort();
    assert_eq!(free, want);

    let saved = resolved_json(&ok(json!({"train": {"steps": 10, "seed": 1}})));
    let now = resolved_json(&ok(json!({"train": {"steps": 20, "seed": 2}, "train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 2})));
    assert_eq!(resume_differences(&saved, &now), vec!["train.seed: checkpoint 1, now 2".to_string()]);
}

#[test]
fn resolved_json_keeps_its_key_order() {
    let cfg = ok(json!({
        "scheduler": {"type": "WarmupLR"}, "bf16": {"enabled": true}, "csv_monitor": {"enabled": true},
        "zero_optimization": {"reduce_bucket_size": 1000}, "train": {"steps": 5, "pass_images": 8}
    }));
    let v = resolved_json(&cfg);
    let order = |v: &Value| v.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>()).unwrap_or_default();
    assert_eq!(
        order(&v),
        [
            "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "sequence_parallel_size", "optimizer", "gradient_clipping",
            "zero_optimization", "model", "data", "train", "scheduler", "communication_data_type", "prescale_gradients",
            "gradient_predivide_factor", "bf16", "wall_clock_breakdown", "csv_monitor",
        ]
    );
    assert_eq!(order(&v["zero_optimization"]), ["stage", "reduce_scatter", "overlap_comm", "reduce_bucket_size"]);
    let train = order(&v["train"]);
    assert_eq!(train[..2], ["epochs", "seed"]);
    assert_eq!(train[train.len() - 2..], ["pass_images", "steps"]);
    assert_eq!(order(&v["data"]).last().map(String::as_str), Some("val_size"));
}

#[test]
fn config_builder_sets_keys_by_their_paths() {
    assert_eq!(keys::ZERO_STAGE.dotted(), "zero_optimization.stage");
    assert_eq!(keys::ZERO_STAGE.name(), "stage");
    assert!(keys::ZERO_STAGE.is("zero_optimization.stage"));
    assert!(!keys::ZERO_STAGE.is("stage") && !keys::ZERO_STAGE.is("zero_optimizationstage"));
    assert!(keys::MICRO_BATCH.is("train_micro_batch_size_per_gpu"));
    let v = ConfigBuilder::new()
        .set(keys::MODEL_PRESET, "vit_tiny_patch4_32")
        .set(keys::MICRO_BATCH, 8)
        .set(keys::TRAIN_PASS_IMAGES, 8)
        .set(keys::TRAIN_EVAL_BATCH_SIZE, 1)
        .build();
    assert_eq!(
        v,
        json!({"model": {"preset": "vit_tiny_patch4_32"}, "train_micro_batch_size_per_gpu": 8, "train": {"pass_images": 8, "eval_batch_size": 1}})
    );
    let cfg = ok(v);
    assert_eq!((cfg.batch.micro_batch_per_gpu, cfg.train.pass_images, cfg.train.eval_batch_size), (8, Some(8), 1));
}
