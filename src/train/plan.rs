//! The plan of a run's batch, resolved once before training from the configuration and the
//! device: how many images each rank feeds per micro-batch, how a micro-batch is cut into
//! forward/backward passes, whether the backward regenerates activations, and what the device
//! chose for its kernels. The training loop, `vitscale bench` and the run directory's
//! `config.json` (its `"plan"` section) all read this one value; nothing below it re-derives a
//! batch size.

use serde::Serialize;

use crate::backend::Backend;
use crate::config::RunConfig;
use crate::model::{ModelConfig, Recompute};

/// Images one pass takes when `train.pass_images` is "auto": it bounds the activation memory of
/// one pass on every backend (a ViT-B/16 pass of 512 images keeps ~40 GB of bf16 activations).
pub const AUTO_PASS_IMAGES: usize = 512;

/// The most images one pass takes under `train.pass_images` (None = "auto").
pub fn pass_images_cap(configured: Option<usize>) -> usize {
    configured.unwrap_or(AUTO_PASS_IMAGES).max(1)
}

/// How one rank runs each optimizer step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    pub world_size: usize,
    /// Images per rank per micro-batch (`train_micro_batch_size_per_gpu`; under
    /// `train.balance` the equal split's, each rank's own comes from `train::balance`).
    pub micro_batch: usize,
    pub gradient_accumulation_steps: usize,
    /// `train_batch_size` = micro × GAS × world: the loss is the mean over these images.
    pub global_batch: usize,
    /// Images per forward/backward pass: a micro-batch runs as `passes_per_micro` passes of at
    /// most this many images, whose gradients add up (same result, bounded memory).
    pub pass_images: usize,
    pub passes_per_micro: usize,
    /// Whether the backward regenerates LayerNorm/GELU outputs (`train.recompute` resolved for
    /// the pass size on this device).
    pub recompute: bool,
    /// What the device chose for its kernels (attention path, GEMM tiles…), as it reports it.
    pub device: serde_json::Map<String, serde_json::Value>,
}

impl Plan {
    /// The plan of a training run of `cfg` on `be`.
    pub fn for_run<B: Backend>(be: &B, cfg: &RunConfig) -> Plan {
        let b = &cfg.batch;
        let mut plan = Plan::new(be, &cfg.model, b.micro_batch_per_gpu, b.gradient_accumulation_steps, b.world_size, cfg.train.pass_images, cfg.train.recompute);
        // under train.balance a rank's micro-batch may be larger: passes are sized for the
        // largest it can be given (memory is still bounded by train.pass_images)
        if let Some(widest) = crate::train::balance::widest_micro(cfg) {
            let wide = Plan::new(be, &cfg.model, widest, b.gradient_accumulation_steps, b.world_size, cfg.train.pass_images, cfg.train.recompute);
            (plan.pass_images, plan.recompute) = (wide.pass_images, wide.recompute);
            plan.passes_per_micro = plan.micro_batch.div_ceil(plan.pass_images);
        }
        plan
    }

    /// The plan for `micro` images per micro-batch, `gas` micro-batches per step on each of
    /// `world` ranks; `pass_images` None = `AUTO_PASS_IMAGES`.
    pub fn new<B: Backend>(be: &B, model: &ModelConfig, micro: usize, gas: usize, world: usize, pass_images: Option<usize>, recompute: Recompute) -> Plan {
        let micro = micro.max(1);
        let pass_images = pass_images_cap(pass_images).min(micro);
        // the model's own rule (`Vit`), decided here once for the pass size
        let regenerate = match recompute {
            Recompute::Always => true,
            Recompute::Never => false,
            Recompute::Auto => pass_images * model.num_tokens() * model.mlp_hidden() <= be.recompute_below(),
        };
        Plan {
            world_size: world,
            micro_batch: micro,
            gradient_accumulation_steps: gas,
            global_batch: micro * gas * world,
            pass_images,
            passes_per_micro: micro.div_ceil(pass_images),
            recompute: regenerate,
            device: be.choices(),
        }
    }

    /// The recompute policy that makes the model do what this plan says.
    pub fn recompute_policy(&self) -> Recompute {
        if self.recompute {
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
}
