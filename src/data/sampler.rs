//! Which dataset indices go into which step, rank and micro-batch.
//!
//! The plan is made for the *global* batch (`train_batch_size`), so it is the same whatever the
//! world size and gradient-accumulation split: a 1-rank run and a 4-rank run with the same global
//! batch see the same images in the same steps. Each rank then takes a contiguous shard of the
//! global batch and cuts it into `gas` contiguous micro-batches (DeepSpeed's
//! `train_batch_size = micro × GAS × world`).

use super::rng::{hash, stream, SplitMix};

/// Sampling plan over a dataset of `len` items in global batches of `global_batch`.
#[derive(Clone, Debug)]
pub struct Sampler {
    len: usize,
    global_batch: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
}

/// The order of one epoch, materialized once so each step is a slice.
#[derive(Clone, Debug)]
pub struct EpochPlan {
    order: Vec<usize>,
    global_batch: usize,
    steps: usize,
}

impl Sampler {
    /// `global_batch` must be positive. With `drop_last` the final partial batch of an epoch is
    /// skipped (training); without it the last batch is shorter (evaluation).
    pub fn new(len: usize, global_batch: usize, shuffle: bool, seed: u64, drop_last: bool) -> Self {
        assert!(global_batch > 0, "Sampler: global batch must be positive");
        Sampler { len, global_batch, shuffle, seed, drop_last }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn global_batch_size(&self) -> usize {
        self.global_batch
    }

    pub fn steps_per_epoch(&self) -> usize {
        if self.drop_last {
            self.len / self.global_batch
        } else {
            self.len.div_ceil(self.global_batch)
        }
    }

    /// The dataset order of `epoch`: identity without shuffle, else a Fisher–Yates permutation
    /// seeded by (seed, epoch).
    pub fn order(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = SplitMix::new(hash(&[self.seed, stream::SHUFFLE, epoch]));
            for i in (1..order.len()).rev() {
                let j = rng.below_usize(i + 1);
                order.swap(i, j);
            }
        }
        order
    }

    /// The whole plan of one epoch (compute once per epoch, then slice per step).
    pub fn epoch(&self, epoch: u64) -> EpochPlan {
        EpochPlan { order: self.order(epoch), global_batch: self.global_batch, steps: self.steps_per_epoch() }
    }

    /// Dataset indices of global batch `step` in `epoch`. Recomputes the epoch order: use
    /// [`Sampler::epoch`] in loops.
    pub fn global_batch(&self, epoch: u64, step: usize) -> Vec<usize> {
        self.epoch(epoch).batch(step).to_vec()
    }
}

impl EpochPlan {
    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Dataset indices of global batch `step` (panics past the end: a caller bug).
    pub fn batch(&self, step: usize) -> &[usize] {
        assert!(step < self.steps, "step {step} past the end of the epoch ({} steps)", self.steps);
        let start = step * self.global_batch;
        let end = (start + self.global_batch).min(self.order.len());
        &self.order[start..end]
    }
}

/// Bounds of part `i` of `parts` near-equal contiguous parts of `0..len` (the first `len % parts`
/// parts get one more). Exact `len / parts` when it divides, as it does for full batches.
fn part_bounds(len: usize, parts: usize, i: usize) -> (usize, usize) {
    let base = len / parts;
    let extra = len % parts;
    let start = i * base + i.min(extra);
    let size = base + usize::from(i < extra);
    (start, start + size)
}

/// The part of a global batch that rank `rank` of `world` feeds as micro-batch `micro` (of
/// `gas`): the global batch is split into `world` contiguous shards, each shard into `gas`
/// contiguous micro-batches. With a full batch every micro-batch has `len / (world × gas)`
/// items; a short final batch (no `drop_last`) is spread as evenly as possible.
pub fn shard(global: &[usize], rank: usize, world: usize, micro: usize, gas: usize) -> &[usize] {
    assert!(rank < world && micro < gas, "shard: rank {rank}/{world}, micro {micro}/{gas}");
    let (s0, s1) = part_bounds(global.len(), world, rank);
    let rank_part = &global[s0..s1];
    let (m0, m1) = part_bounds(rank_part.len(), gas, micro);
    &rank_part[m0..m1]
}

/// The part of a full global batch that rank `rank` feeds as micro-batch `micro` (of `gas`)
/// when rank q feeds `sizes[q]` images per micro-batch (`train.balance`): rank q's shard is
/// the `gas × sizes[q]` images that follow those of ranks 0..q, cut into `gas` contiguous
/// micro-batches. Equal sizes give [`shard`]'s split; every split partitions the batch.
pub fn shard_sized<'a>(global: &'a [usize], sizes: &[usize], rank: usize, micro: usize, gas: usize) -> &'a [usize] {
    assert!(rank < sizes.len() && micro < gas, "shard_sized: rank {rank}/{}, micro {micro}/{gas}", sizes.len());
    assert_eq!(sizes.iter().sum::<usize>() * gas, global.len(), "shard_sized: the sizes do not add up to the batch");
    let start = gas * sizes[..rank].iter().sum::<usize>() + micro * sizes[rank];
    &global[start..start + sizes[rank]]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn epoch_is_a_permutation_and_batches_are_disjoint() {
        let s = Sampler::new(103, 10, true, 5, true);
        assert_eq!(s.steps_per_epoch(), 10);
        let plan = s.epoch(0);
        let mut seen = HashSet::new();
        for step in 0..plan.steps() {
            let b = plan.batch(step);
            assert_eq!(b.len(), 10);
            for &i in b {
                assert!(i < 103);
                assert!(seen.insert(i), "index {i} twice in one epoch");
            }
        }
        let mut all = s.order(0);
        all.sort_unstable();
        assert_eq!(all, (0..103).collect::<Vec<_>>());
    }

    #[test]
    fn reshuffles_per_epoch_and_is_deterministic() {
        let s = Sampler::new(1000, 64, true, 1, true);
        assert_eq!(s.order(3), Sampler::new(1000, 64, true, 1, true).order(3));
        assert_ne!(s.order(0), s.order(1));
        assert_ne!(s.order(0), Sampler::new(1000, 64, true, 2, true).order(0));
        assert_eq!(s.global_batch(2, 4), s.epoch(2).batch(4));
    }

    #[test]
    fn no_shuffle_is_identity_and_keeps_last() {
        let s = Sampler::new(25, 10, false, 0, false);
        assert_eq!(s.steps_per_epoch(), 3);
        assert_eq!(s.global_batch(7, 2), vec![20, 21, 22, 23, 24]);
        assert_eq!(Sampler::new(25, 10, false, 0, true).steps_per_epoch(), 2);
    }

    #[test]
    fn shards_partition_the_global_batch() {
        let global: Vec<usize> = (100..124).collect(); // 24 = micro 3 × gas 2 × world 4
        let mut union = Vec::new();
        for rank in 0..4 {
            for micro in 0..2 {
                let m = shard(&global, rank, 4, micro, 2);
                assert_eq!(m.len(), 3);
                union.extend_from_slice(m);
            }
        }
        assert_eq!(union, global, "rank-major, micro-minor concatenation is the global batch");
        // Rank 1 owns the contiguous second quarter.
        assert_eq!(shard(&global, 1, 4, 0, 2), &[106, 107, 108]);
        assert_eq!(shard(&global, 1, 4, 1, 2), &[109, 110, 111]);
    }

    #[test]
    fn sized_shards_partition_the_batch_and_equal_sizes_are_the_equal_split() {
        let global: Vec<usize> = (0..48).map(|i| 1000 + i).collect(); // world 3, gas 2, Σ sizes 24
        for sizes in [vec![8, 8, 8], vec![14, 4, 6], vec![1, 1, 22]] {
            let mut union = Vec::new();
            for rank in 0..3 {
                for micro in 0..2 {
                    let m = shard_sized(&global, &sizes, rank, micro, 2);
                    assert_eq!(m.len(), sizes[rank]);
                    union.extend_from_slice(m);
                }
            }
            assert_eq!(union, global, "{sizes:?}: rank-major, micro-minor concatenation is the global batch");
        }
        for rank in 0..3 {
            for micro in 0..2 {
                assert_eq!(shard_sized(&global, &[8, 8, 8], rank, micro, 2), shard(&global, rank, 3, micro, 2));
            }
        }
    }

    #[test]
    fn short_batch_shards_cover_everything() {
        for len in 0..20 {
            let global: Vec<usize> = (0..len).collect();
            let mut union = Vec::new();
            for rank in 0..3 {
                for micro in 0..2 {
                    union.extend_from_slice(shard(&global, rank, 3, micro, 2));
                }
            }
            assert_eq!(union, global);
        }
    }
}
