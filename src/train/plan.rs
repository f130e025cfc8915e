//! The plan of a run, derived once before training from the configuration and the device: how
//! many images each rank feeds per micro-batch (and under `train.balance`, each rank's starting
//! share), how a micro-batch is cut into forward/backward passes, whether the backward
//! regenerates activations, how gradients are bucketed and sharded (ZeRO), the memory one rank
//! needs, and what the device chose for its kernels. The trainer, the pre-flight memory check,
//! the planner and the run directory's `config.json` (its `"plan"` section) all read this one
//! value; nothing below it re-derives a batch size.

use serde::Serialize;

use crate::backend::Backend;
use crate::config::RunConfig;
use crate::model::{ModelConfig, Recompute};
use crate::train::shares;
use crate::train::memory::{self, DeviceMemory, Estimate, RankBatch};
use crate::train::sync::{DEFAULT_BUCKET_ELEMS, FIRST_BUCKET_ELEMS};

/// Images one pass takes when `train.pass_images` is "auto": it bounds the activation memory of
/// one pass on every backend (a ViT-B/16 pass of 512 images keeps ~40 GB of bf16 activations).
pub const AUTO_PASS_IMAGES: usize = 512;

/// The most images one pass takes under `train.pass_images` (None = "auto").
pub fn pass_images_cap(configured: Option<usize>) -> usize {
    configured.unwrap_or(AUTO_PASS_IMAGES).max(1)
}

/// What the plan needs to know of the device it runs on (a backend's answers, or a profile's
/// for the planner's hypothetical runs).
pub struct DeviceTraits<'a> {
    /// Activation bytes, compute copy and saved attention: what the memory estimate needs.
    pub memory: DeviceMemory<'a>,
    /// `Recompute::Auto` regenerates activations when a pass's images × tokens × MLP width is
    /// at most this (`Backend::recompute_below`).
    pub recompute_below: usize,
    /// What the device chose for its kernels, as it reports it.
    pub choices: serde_json::Map<String, serde_json::Value>,
}

impl<'a> DeviceTraits<'a> {
    /// `be`'s traits; `attention_saved` must be `|b, n, h, d| be.attention_saved_len(b, n, h, d)`
    /// (a closure the caller owns, so the traits can borrow it).
    pub fn of<B: Backend>(be: &B, attention_saved: &'a dyn Fn(usize, usize, usize, usize) -> usize) -> Self {
        DeviceTraits {
            memory: DeviceMemory { compute_bytes: if be.needs_compute_copy() { 2.0 } else { 4.0 }, compute_copy: be.needs_compute_copy(), attention_saved },
            recompute_below: be.recompute_below(),
            choices: be.choices(),
        }
    }
}

/// How gradients are reduced and the state sharded (`zero_optimization`, resolved).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ZeroPlan {
    /// 0, 1 or 2 (a configured 3 runs as 2).
    pub stage: u8,
    pub reduce_scatter: bool,
    pub overlap_comm: bool,
    /// Stages 1/2 where the forward reads a compute copy: each rank keeps only its shard of
    /// the f32 master weights.
    pub master_shard: bool,
    /// Gradient buckets: a small first one, then `bucket_elems` each (`train::sync`).
    pub first_bucket_elems: usize,
    pub bucket_elems: usize,
}

/// How one rank runs each optimizer step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// Every rank of the job: `data_parallel × sequence_parallel`.
    pub world_size: usize,
    /// Ranks per sequence-parallel group (`sequence_parallel_size`): consecutive ranks that
    /// split each image's tokens and feed the same images (`model::seq_parallel`).
    pub sequence_parallel: usize,
    /// Groups that feed different images: the batch triple's world size.
    pub data_parallel: usize,
    /// Images per rank per micro-batch (`train_micro_batch_size_per_gpu`; under
    /// `train.balance` the equal split's).
    pub micro_batch: usize,
    pub gradient_accumulation_steps: usize,
    /// `train_batch_size` = micro × GAS × data-parallel degree: the loss is the mean over
    /// these images.
    pub global_batch: usize,
    /// Each rank's micro-batch at the run's start: the equal split, or `train.balance`'s fixed
    /// shares (`auto` starts equal and re-splits as it measures, `train::balance`).
    pub rank_micro_batches: Vec<usize>,
    /// Images per share unit of a split (2 when mixing pairs neighbours, else 1).
    pub split_unit: usize,
    /// Images per forward/backward pass: a micro-batch runs as `passes_per_micro` passes of at
    /// most this many images, whose gradients add up (same result, bounded memory).
    pub pass_images: usize,
    pub passes_per_micro: usize,
    /// Whether the backward regenerates LayerNorm/GELU outputs (`train.recompute` resolved for
    /// the pass size on this device).
    pub recompute: bool,
    /// Whether the backward runs each block's forward again from its saved input
    /// (`train.recompute = "blocks"` or `"blocks_full"`, DeepSpeed's `activation_checkpointing`).
    pub checkpointing: bool,
    /// Under checkpointing, whether that rerun computes the attention core again too, keeping
    /// no block's attention output (`"blocks_full"`).
    pub checkpoint_full: bool,
    pub zero: ZeroPlan,
    /// The memory one rank needs (`train::memory`): the pre-flight check, `config.json`'s
    /// `"memory"` prediction and the planner read this. None for a bare step shape
    /// (`Plan::new`: bench and selftest, which run no configured data or optimizer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory: Option<Estimate>,
    /// What the device chose for its kernels (attention path, GEMM tiles…), as it reports it.
    pub device: serde_json::Map<String, serde_json::Value>,
}

impl Plan {
    /// The plan of a training run of `cfg` on `be`.
    pub fn for_run<B: Backend>(be: &B, cfg: &RunConfig) -> Plan {
        let attention = |b, n, h, d| be.attention_saved_len(b, n, h, d);
        Plan::for_config(cfg, DeviceTraits::of(be, &attention))
    }

    /// The plan of a run of `cfg` on a device with `dev`'s traits. The one place a run's batch
    /// split is derived from the configuration.
    pub fn for_config(cfg: &RunConfig, dev: DeviceTraits<'_>) -> Plan {
        let b = &cfg.batch;
        // (the batch is split over the data-parallel degree; a sequence-parallel group's ranks
        // feed the same images)
        let (micro, gas, world, sp) = (b.micro_batch_per_gpu.max(1), b.gradient_accumulation_steps, b.world_size, b.sequence_parallel_size);
        let unit = shares::unit(cfg);
        let rank_micro_batches = shares::initial_split(&cfg.train.balance, world, micro, unit);
        // under train.balance a rank's micro-batch may be larger: passes are sized for the
        // largest it can be given (memory is still bounded by train.pass_images)
        let widest = shares::widest_micro(&cfg.train.balance, world, micro, unit).unwrap_or(micro);
        let pass_images = pass_images_cap(cfg.train.pass_images).min(widest);
        let recompute = resolve_recompute(&cfg.model, pass_images, cfg.train.recompute, dev.recompute_below);
        let bucket_elems = cfg.reduce_bucket_size.unwrap_or(DEFAULT_BUCKET_ELEMS);
        let zero = ZeroPlan {
            stage: cfg.zero_stage,
            reduce_scatter: cfg.zero_reduce_scatter,
            overlap_comm: cfg.zero_overlap_comm,
            // (stage 3's partition keeps the f32 pieces itself: no master shard in the state)
            master_shard: (1..=2).contains(&cfg.zero_stage) && dev.memory.compute_copy,
            first_bucket_elems: FIRST_BUCKET_ELEMS.min(bucket_elems),
            bucket_elems,
        };
        let cap = pass_images_cap(cfg.train.pass_images);
        let shape = RankBatch { micro: widest, pass_images, eval_images: cfg.train.eval_batch_size.min(cap), world: world * sp };
        let checkpointing = cfg.train.recompute.checkpoints();
        let memory = memory::estimate(cfg, shape, &dev.memory, recompute, checkpointing);
        Plan {
            world_size: world * sp,
            sequence_parallel: sp,
            data_parallel: world,
            micro_batch: micro,
            gradient_accumulation_steps: gas,
            global_batch: micro * gas * world,
            rank_micro_batches,
            split_unit: unit,
            pass_images,
            passes_per_micro: micro.div_ceil(pass_images),
            recompute,
            checkpointing,
            checkpoint_full: cfg.train.recompute == Recompute::BlocksFull,
            zero,
            memory: Some(memory),
            device: dev.choices,
        }
    }

    /// The plan of a bare step shape: `micro` images per micro-batch, `gas` micro-batches per
    /// step on each of `world` ranks, stage 0; `pass_images` None = `AUTO_PASS_IMAGES`.
    pub fn new<B: Backend>(be: &B, model: &ModelConfig, micro: usize, gas: usize, world: usize, pass_images: Option<usize>, recompute: Recompute) -> Plan {
        let micro = micro.max(1);
        let pass_images = pass_images_cap(pass_images).min(micro);
        Plan {
            world_size: world,
            sequence_parallel: 1,
            data_parallel: world,
            micro_batch: micro,
            gradient_accumulation_steps: gas,
            global_batch: micro * gas * world,
            rank_micro_batches: vec![micro; world],
            split_unit: 1,
            pass_images,
            passes_per_micro: micro.div_ceil(pass_images),
            recompute: resolve_recompute(model, pass_images, recompute, be.recompute_below()),
            checkpointing: recompute.checkpoints(),
            checkpoint_full: recompute == Recompute::BlocksFull,
            zero: ZeroPlan { stage: 0, reduce_scatter: true, overlap_comm: true, master_shard: false, first_bucket_elems: FIRST_BUCKET_ELEMS, bucket_elems: DEFAULT_BUCKET_ELEMS },
            memory: None,
            device: be.choices(),
        }
    }

    /// The recompute policy that makes the model do what this plan says.
    pub fn recompute_policy(&self) -> Recompute {
        if self.checkpoint_full {
            Recompute::BlocksFull
        } else if self.checkpointing {
            Recompute::Blocks
        } else if self.recompute {
            Recompute::Always
        } else {
            Recompute::Never
        }
    }

    /// The (start, images) of each pass over a micro-batch of `b` images.
    pub fn passes(&self, b: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..b).step_by(self.pass_images).map(move |start| (start, (b - start).min(self.pass_images)))
    }
}

/// The model's own rule (`Vit`), decided once for the pass size.
fn resolve_recompute(model: &ModelConfig, pass_images: usize, recompute: Recompute, recompute_below: usize) -> bool {
    match recompute {
        Recompute::Always => true,
        // a checkpointed block keeps its LayerNorm and GELU outputs while it is the one held
        Recompute::Never | Recompute::Blocks | Recompute::BlocksFull => false,
        Recompute::Auto => pass_images * model.num_tokens() * model.mlp_hidden() <= recompute_below,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;

    #[test]
    fn a_micro_batch_is_cut_into_equal_passes_and_a_rest() {
        let m = ModelConfig::preset("vit_tiny_patch4_32").unwrap();
        let p = Plan::new(&Cpu::new(), &m, 1100, 2, 4, None, Recompute::Auto);
        assert_eq!((p.pass_images, p.passes_per_micro, p.global_batch), (512, 3, 8800));
        assert_eq!(p.passes(1100).collect::<Vec<_>>(), vec![(0, 512), (512, 512), (1024, 76)]);
        // the CPU never regenerates under auto
        assert!(!p.recompute);
        let small = Plan::new(&Cpu::new(), &m, 8, 1, 1, Some(3), Recompute::Always);
        assert_eq!(small.passes(8).collect::<Vec<_>>(), vec![(0, 3), (3, 3), (6, 2)]);
        assert!(small.recompute);
        // a pass never exceeds the micro-batch
        assert_eq!(Plan::new(&Cpu::new(), &m, 16, 1, 1, Some(100), Recompute::Never).pass_images, 16);
    }

    /// The one estimate knows the ZeRO stage: at stage 2 on 4 ranks a rank holds a quarter of
    /// the optimizer state (and, with a compute copy, of the f32 weights); nothing else moves.
    #[test]
    fn the_memory_estimate_shards_the_state_as_the_zero_stage_does() {
        let att = |b: usize, n: usize, h: usize, _d: usize| b * h * n * n;
        let traits = |compute_copy: bool| DeviceTraits {
            memory: DeviceMemory { compute_bytes: if compute_copy { 2.0 } else { 4.0 }, compute_copy, attention_saved: &att },
            recompute_below: 0,
            choices: Default::default(),
        };
        let cfg = |stage: u8| crate::config::resolve(&serde_json::json!({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage}}), 4).expect("config");
        for compute_copy in [false, true] {
            let whole = Plan::for_config(&cfg(0), traits(compute_copy)).memory.expect("estimate");
            let shard = Plan::for_config(&cfg(2), traits(compute_copy)).memory.expect("estimate");
            let p = crate::model::ParamTable::new(&cfg(0).model).total as f64;
            // AdamW: 8 bytes of state per parameter, a quarter of it (rounded up) per rank
            assert_eq!(whole.optimizer, 8.0 * p);
            assert_eq!(shard.optimizer, (8.0 * p / 4.0).ceil());
            let weights = if compute_copy { 4.0 * p - (4.0 * p / 4.0).ceil() } else { 0.0 };
            assert_eq!(whole.params - shard.params, weights, "compute copy {compute_copy}");
            assert_eq!((whole.grads, whole.activations, whole.data), (shard.grads, shard.activations, shard.data));
            assert_eq!(whole.total - shard.total, 8.0 * p - shard.optimizer + weights);
            assert_eq!(shard.state.optimizer_state as f64, shard.optimizer);
        }
    }
}
