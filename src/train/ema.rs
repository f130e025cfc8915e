//! The weight EMA (`train.ema`, timm's `ModelEmaV3`): an f32 exponential moving average of the
//! master weights, `ema ← lerp(ema, weights, 1 − decay)` on the device after every optimizer
//! step, with timm's decay schedule (`EmaConfig::decay_at`).
//!
//! Each rank averages the weights it updates: the whole flat buffer where the rank keeps whole
//! master weights (one rank, ZeRO on the CPU, stage 0 on a GPU), or only its own pieces where
//! ZeRO shards the master weights (GPU ranks: `ZeroLayout::master_shard`; stage 3: the
//! partition's own pieces, `model::partition`), so the average costs
//! each rank what its master weights cost. Every rank's average is of identical weights, so the
//! pieces put together are the one-rank average. Evaluating or saving it gathers the pieces (a
//! collective) and runs a model of its own, leaving the training model untouched.

use std::path::{Path, PathBuf};

use crate::backend::Backend;
use crate::comm::Comm;
use crate::config::EmaConfig;
use crate::model::Vit;
use crate::train::error::TrainError;
use crate::train::zero::ZeroLayout;

/// The average on the device, and where its source weights live.
pub struct Ema<B: Backend> {
    pub cfg: EmaConfig,
    /// f32: the whole flat buffer, or this rank's owned pieces back to back.
    buf: B::Buf,
    /// Under a master shard, the offset of the owned master weights in the optimizer's compact
    /// buffer (`ZeroLayout::state_len`); None when the source is the model's whole `params`.
    shard_master_off: Option<usize>,
    /// ZeRO-3: the source is the model's partition (`Partition::owned`, laid out as `buf`).
    partitioned: bool,
}

impl<B: Backend> Ema<B> {
    /// An average starting at `weights` (whole, `table.total` values): the training model's
    /// current weights, or a checkpoint's average.
    pub fn new(be: &B, cfg: EmaConfig, weights: &[f32], zero: Option<&ZeroLayout>) -> Result<Self, TrainError> {
        let sharded = zero.filter(|z| z.master_shard || z.stage == 3);
        let own: Vec<f32> = match sharded {
            Some(z) => z.shard_master(weights)?,
            None => weights.to_vec(),
        };
        let mut buf = be.alloc_f32(own.len().max(1))?;
        be.upload(&mut buf, 0, &own)?;
        let partitioned = sharded.is_some_and(|z| z.stage == 3);
        Ok(Ema { cfg, buf, shard_master_off: sharded.filter(|_| !partitioned).map(|z| z.state_len), partitioned })
    }

    /// The update after optimizer step `step` (1-based count of updates), from the weights that
    /// step wrote: the model's master weights, or this rank's master shard in `opt_state`.
    pub fn update(&mut self, be: &B, step: u64, vit: &Vit<B>, opt_state: &B::Buf) -> Result<(), TrainError> {
        let weight = (1.0 - self.cfg.decay_at(step)) as f32;
        let len = be.len(&self.buf);
        match (self.shard_master_off, vit.partitioned().filter(|_| self.partitioned)) {
            (_, Some(p)) => be.lerp(&mut self.buf, 0, &p.owned, 0, len, weight)?,
            (Some(off), None) => be.lerp(&mut self.buf, 0, opt_state, off, len, weight)?,
            (None, None) if self.partitioned => return Err(TrainError::Config("the weight EMA follows partitioned weights the model does not have".into())),
            (None, None) => be.lerp(&mut self.buf, 0, &vit.params, 0, len, weight)?,
        }
        Ok(())
    }

    /// Whether each rank holds only its pieces of the average (gathering it is a collective).
    pub fn is_sharded(&self) -> bool {
        self.shard_master_off.is_some() || self.partitioned
    }

    /// The whole average on the host: every rank's pieces gathered under a master shard (a
    /// collective: every rank calls it at the same point).
    pub fn full(&self, be: &B, comm: &mut dyn Comm<B::Buf>, zero: Option<&ZeroLayout>) -> Result<Vec<f32>, TrainError> {
        let own = be.download(&self.buf)?;
        match (self.is_sharded(), zero) {
            (true, Some(z)) => z.gather_owned(be, comm, &own),
            (true, None) => Err(TrainError::Config("the weight EMA is sharded but the run has no ZeRO layout".into())),
            (false, _) => Ok(own),
        }
    }
}

/// `NAME_ema.safetensors` beside `NAME.safetensors` (`--save-weights`): where the average goes.
pub fn weights_path(save_weights: &Path) -> PathBuf {
    let stem = save_weights.file_stem().map_or_else(|| "weights".into(), |s| s.to_string_lossy().into_owned());
    let ext = save_weights.extension().map_or_else(|| "safetensors".into(), |s| s.to_string_lossy().into_owned());
    save_weights.with_file_name(format!("{stem}_ema.{ext}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(warmup: bool, after: u64) -> EmaConfig {
        EmaConfig { decay: 0.999, min_decay: 0.1, update_after_step: after, warmup, warmup_gamma: 1.0, warmup_power: 2.0 / 3.0 }
    }

    /// timm's `ModelEmaV3.get_decay(step)`: 0 (a copy) at the first update and the
    /// `update_after_step` after it, then `decay`, or with warm-up 1 − (1 + t)^(−2/3) for the
    /// t-th step after those, within [min_decay, decay].
    #[test]
    fn decay_follows_timms_schedule() {
        assert_eq!(cfg(false, 0).decay_at(1), 0.0);
        assert_eq!(cfg(false, 0).decay_at(2), 0.999);
        assert_eq!(cfg(false, 3).decay_at(4), 0.0);
        assert_eq!(cfg(false, 3).decay_at(5), 0.999);
        let w = cfg(true, 0);
        assert_eq!(w.decay_at(1), 0.0);
        // t = 1: 1 − 2^(−2/3) = 0.370; t = 7: 1 − 8^(−2/3) = 0.75; never above decay
        assert!((w.decay_at(2) - (1.0 - 2f64.powf(-2.0 / 3.0))).abs() < 1e-15);
        assert!((w.decay_at(8) - 0.75).abs() < 1e-12);
        assert_eq!(w.decay_at(10_000_000), 0.999);
        let floor = EmaConfig { min_decay: 0.5, ..w };
        assert_eq!(floor.decay_at(2), 0.5);
    }

    #[test]
    fn the_average_is_saved_beside_the_weights() {
        assert_eq!(weights_path(Path::new("out/tuned.safetensors")), Path::new("out/tuned_ema.safetensors"));
        assert_eq!(weights_path(Path::new("w")), Path::new("w_ema.safetensors"));
    }
}
