//! Stochastic depth (timm's `drop_path_rate`): in training, each block's attention and MLP
//! branch is dropped for a whole image with the block's probability, and kept branches are
//! scaled by 1/keep so the expected output is unchanged (timm's `DropPath` with
//! `scale_by_keep`). The probability grows linearly over depth from 0 at the first block to
//! the configured rate at the last (timm's `torch.linspace(0, drop_path_rate, depth)`).
//!
//! The draw for (image, block, branch) depends only on the seed and the image's sample key
//! (its dataset index and epoch, `data::Batch::keys`): the same images get the same masks
//! whatever the rank count, micro-batch split or pass size, so N ranks train exactly as one.

use crate::backend::{BResult, Backend};

/// The drop probabilities of one model and the seed of their draws.
#[derive(Clone, Debug, PartialEq)]
pub struct DropPath {
    /// Per block, the probability of dropping each of its two branches for an image.
    pub rates: Vec<f64>,
    seed: u64,
}

impl DropPath {
    /// timm's schedule for `depth` blocks at `rate` (the last block's probability); None when
    /// nothing would ever be dropped.
    pub fn new(rate: f64, depth: usize, seed: u64) -> Option<DropPath> {
        if rate <= 0.0 || depth < 2 {
            // linspace(0, rate, 1) = [0]: a one-block model drops nothing, as in timm
            return None;
        }
        let rates = (0..depth).map(|i| rate * i as f64 / (depth - 1) as f64).collect();
        Some(DropPath { rates, seed })
    }

    /// Whether block `i` can drop anything.
    pub fn active(&self, i: usize) -> bool {
        self.rates.get(i).is_some_and(|&r| r > 0.0)
    }

    /// The branch factors of the images with these sample keys, laid out
    /// `[block][branch (attention, MLP)][image]`: 0 where the branch is dropped, 1/(1 − p)
    /// where it is kept.
    pub fn scales(&self, keys: &[u64]) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rates.len() * 2 * keys.len());
        for (block, &p) in self.rates.iter().enumerate() {
            let kept = (1.0 / (1.0 - p)) as f32;
            for branch in 0..2u64 {
                out.extend(keys.iter().map(|&k| if uniform(self.seed, k, block as u64 * 2 + branch) < p { 0.0 } else { kept }));
            }
        }
        out
    }
}

/// A uniform draw in [0, 1) from (seed, sample key, stream): SplitMix64's finalizer over the
/// three mixed together, 53 bits.
fn uniform(seed: u64, key: u64, stream: u64) -> f64 {
    let mut z = seed ^ key.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The factors of the next training pass on the device, and the scratch the scaled branches
/// pass through (`Vit::set_branch_scales`).
pub(crate) struct BranchScales<B: Backend> {
    /// Images of the pass the factors are for.
    pub n: usize,
    /// Per block, whether any of its factors is not 1 (a block at probability 0 runs the
    /// unscaled path).
    pub active: Vec<bool>,
    /// f32, `[block][branch][image]`.
    pub scales: B::Buf,
    /// One branch's output or output gradient (rows × C, compute dtype).
    pub branch: B::Buf,
}

impl<B: Backend> BranchScales<B> {
    /// Offset of (block, branch)'s factors in `scales`.
    pub fn offset(&self, block: usize, branch: usize) -> usize {
        (block * 2 + branch) * self.n
    }

    /// Uploads `host` (laid out as `DropPath::scales`) for a pass of `n` images whose rows of
    /// width `c` number `rows`, growing the buffers when needed.
    pub fn set(slot: &mut Option<Self>, be: &B, host: &[f32], active: Vec<bool>, n: usize, rows: usize) -> BResult<()> {
        match slot.as_mut().filter(|s| be.len(&s.scales) >= host.len() && be.len(&s.branch) >= rows) {
            Some(s) => {
                s.n = n;
                s.active = active;
            }
            None => {
                *slot = None; // the old buffers go before the larger ones are allocated
                *slot = Some(BranchScales { n, active, scales: be.alloc_f32(host.len().max(1))?, branch: be.alloc(rows.max(1))? });
            }
        }
        if let Some(s) = slot.as_mut() {
            be.upload(&mut s.scales, 0, host)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_follow_timms_linspace() {
        let d = DropPath::new(0.1, 5, 0).unwrap();
        let want = [0.0, 0.025, 0.05, 0.075, 0.1];
        assert!(d.rates.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-15), "{:?}", d.rates);
        assert!(!d.active(0) && d.active(4));
        assert!(DropPath::new(0.0, 12, 0).is_none() && DropPath::new(0.3, 1, 0).is_none());
    }

    /// Each branch of the last block drops a fraction p of the images (binomial within 5σ),
    /// kept ones carry 1/(1 − p), the mean factor is 1, and the two branches and the blocks
    /// draw independently.
    #[test]
    fn masks_drop_at_the_rate_and_keep_the_expectation() {
        let seed = rand::random();
        let d = DropPath::new(0.4, 3, seed).unwrap();
        let n = 20_000;
        let keys: Vec<u64> = (0..n as u64).map(|i| i * 7 + 3).collect();
        let s = d.scales(&keys);
        assert_eq!(s.len(), 3 * 2 * n);
        assert!(s[..2 * n].iter().all(|&v| v == 1.0), "block 0 drops nothing (seed {seed})");
        for (block, p) in [(1usize, 0.2f64), (2, 0.4)] {
            let kept = (1.0 / (1.0 - p)) as f32;
            let attn = &s[(block * 2) * n..(block * 2 + 1) * n];
            let mlp = &s[(block * 2 + 1) * n..(block * 2 + 2) * n];
            for branch in [attn, mlp] {
                assert!(branch.iter().all(|&v| v == 0.0 || v == kept));
                let dropped = branch.iter().filter(|&&v| v == 0.0).count() as f64;
                let sd = (n as f64 * p * (1.0 - p)).sqrt();
                assert!((dropped - n as f64 * p).abs() < 5.0 * sd, "block {block}: {dropped} of {n} dropped at p {p} (seed {seed})");
                let mean: f64 = branch.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
                assert!((mean - 1.0).abs() < 5.0 * sd / n as f64 / (1.0 - p), "mean factor {mean} (seed {seed})");
            }
            let both = attn.iter().zip(mlp).filter(|(a, m)| **a == 0.0 && **m == 0.0).count() as f64;
            let sd = (n as f64 * p * p * (1.0 - p * p)).sqrt();
            assert!((both - n as f64 * p * p).abs() < 5.0 * sd, "branches not independent: {both} both dropped (seed {seed})");
        }
    }

    /// The factors of an image depend on its key alone: any subset, in any order, gets the
    /// same ones (how N ranks reproduce one).
    #[test]
    fn an_images_factors_do_not_depend_on_its_batch() {
        let d = DropPath::new(0.5, 4, 11).unwrap();
        let keys: Vec<u64> = (100..164).collect();
        let all = d.scales(&keys);
        let picked = [5usize, 63, 0, 17];
        let sub: Vec<u64> = picked.iter().map(|&i| keys[i]).collect();
        let part = d.scales(&sub);
        for row in 0..8 {
            for (j, &i) in picked.iter().enumerate() {
                assert_eq!(part[row * 4 + j], all[row * 64 + i]);
            }
        }
        assert_ne!(DropPath::new(0.5, 4, 12).unwrap().scales(&keys), all, "another seed draws other masks");
    }
}
