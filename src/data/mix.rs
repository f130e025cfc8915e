//! Mixup and CutMix with soft targets (timm's `Mixup`, mode "batch").
//!
//! Per *global* batch, keyed by (seed, epoch, step): with probability `mixup_prob` the batch
//! is mixed; with both mixup and cutmix on, cutmix is chosen with probability
//! `mixup_switch_prob`; λ ~ Beta(α, α) of the chosen method. Mixup blends two images as
//! `λ·a + (1−λ)·b`; CutMix pastes a box of `b` into `a` (side `√(1−λ)` of the image, centre
//! uniform, clipped at the border) and corrects λ to the area actually kept, as timm's
//! `correct_lam=True`. Targets are `λ·y_a + (1−λ)·y_b` with label smoothing folded in (timm's
//! `mixup_target`: `off = ε/K`, `on = 1 − ε + off`), so each row sums to 1.
//!
//! **Pairing (differs from timm on purpose).** timm mixes image i with image B−1−i of the
//! loader's batch (`flip(0)`), which depends on how the global batch is cut into ranks and
//! micro-batches. Here image at global position 2k is paired with 2k+1 (and vice versa). The
//! global order is a random permutation, so each image still gets a uniformly random partner,
//! and because micro-batches are contiguous slices of even length (checked when the config is
//! read) a pair never straddles two ranks: N ranks produce exactly the batch of 1 rank.

use super::rng::{hash, stream, SplitMix};
use super::Batch;
use crate::config::AugmentOptions;

/// What one global batch does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MixDraw {
    /// Weight of the image's own target (1 = unmixed).
    pub lam: f64,
    /// CutMix box `(y0, y1, x0, x1)` in pixels (half-open); `None` for mixup / no mixing.
    pub cut: Option<(usize, usize, usize, usize)>,
}

/// Draws the mixing of global batch (`epoch`, `step`) for images of `side` px.
pub fn draw(opts: &AugmentOptions, seed: u64, epoch: u64, step: usize, side: usize) -> MixDraw {
    let mut rng = SplitMix::new(hash(&[seed, stream::MIX, epoch, step as u64]));
    let none = MixDraw { lam: 1.0, cut: None };
    if !opts.mixes() || rng.f64() >= opts.mixup_prob {
        return none;
    }
    let use_cutmix = match (opts.mixup > 0.0, opts.cutmix > 0.0) {
        (true, true) => rng.f64() < opts.mixup_switch_prob,
        (false, true) => true,
        _ => false,
    };
    let alpha = if use_cutmix { opts.cutmix } else { opts.mixup };
    let lam = rng.beta(alpha, alpha);
    if !use_cutmix {
        return MixDraw { lam, cut: None };
    }
    // timm `rand_bbox`: cut side = int(S·√(1−λ)), centre uniform in [0, S), clipped.
    let s = side as i64;
    let cut = (side as f64 * (1.0 - lam).sqrt()) as i64;
    let cy = rng.below(side as u64) as i64;
    let cx = rng.below(side as u64) as i64;
    let (y0, y1) = ((cy - cut / 2).clamp(0, s), (cy + cut / 2).clamp(0, s));
    let (x0, x1) = ((cx - cut / 2).clamp(0, s), (cx + cut / 2).clamp(0, s));
    let area = ((y1 - y0) * (x1 - x0)) as f64;
    MixDraw { lam: 1.0 - area / (s * s) as f64, cut: Some((y0 as usize, y1 as usize, x0 as usize, x1 as usize)) }
}

/// Mixes `batch` — a slice of the global batch that starts at an even position and has even
/// length, (B, 3, S, S) — in place as `d` says, and sets its soft targets (B, K) with label
/// smoothing `eps`. Unmixed batches (λ = 1) get smoothed one-hot targets.
pub fn apply(batch: &mut Batch, d: MixDraw, side: usize, num_classes: usize, eps: f32) {
    let b = batch.len();
    let per = 3 * side * side;
    debug_assert_eq!(b % 2, 0, "mixing needs an even batch");
    debug_assert_eq!(batch.images.len(), b * per);
    let lam = d.lam as f32;
    if lam < 1.0 {
        for pair in batch.images.chunks_exact_mut(2 * per) {
            let (a, bb) = pair.split_at_mut(per);
            match d.cut {
                None => {
                    for (x, y) in a.iter_mut().zip(bb.iter_mut()) {
                        let (xa, yb) = (*x, *y);
                        *x = lam * xa + (1.0 - lam) * yb;
                        *y = lam * yb + (1.0 - lam) * xa;
                    }
                }
                Some((y0, y1, x0, x1)) => {
                    // Swapping the boxes gives each image its partner's box.
                    for c in 0..3 {
                        for y in y0..y1 {
                            let row = c * side * side + y * side;
                            a[row + x0..row + x1].swap_with_slice(&mut bb[row + x0..row + x1]);
                        }
                    }
                }
            }
        }
    }
    let k = num_classes;
    let off = eps / k as f32;
    let on = 1.0 - eps + off;
    let mut t = batch.targets.take().unwrap_or_default();
    t.clear();
    t.resize(b * k, off);
    for (i, row) in t.chunks_mut(k).enumerate() {
        let own = batch.labels[i] as usize;
        // An odd last image (never produced by a checked config) is its own partner.
        let partner = batch.labels[if i ^ 1 < b { i ^ 1 } else { i }] as usize;
        // y = λ·onehot(own) + (1−λ)·onehot(partner), both smoothed: off + (on−off)·(…).
        if own < k {
            row[own] += (on - off) * lam;
        }
        if partner < k {
            row[partner] += (on - off) * (1.0 - lam);
        }
    }
    batch.targets = Some(t);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(mixup: f64, cutmix: f64) -> AugmentOptions {
        AugmentOptions { mixup, cutmix, ..Default::default() }
    }

    fn batch(b: usize, side: usize) -> Batch {
        let per = 3 * side * side;
        Batch {
            images: (0..b * per).map(|i| (i / per) as f32).collect(),
            labels: (0..b as u32).map(|i| i % 3).collect(),
            targets: None,
        }
    }

    #[test]
    fn mixup_hand_checked_pair() {
        let mut bt = batch(2, 2);
        apply(&mut bt, MixDraw { lam: 0.75, cut: None }, 2, 3, 0.0);
        // Image 0 was all 0, image 1 all 1.
        assert!(bt.images[..12].iter().all(|&v| (v - 0.25).abs() < 1e-6));
        assert!(bt.images[12..].iter().all(|&v| (v - 0.75).abs() < 1e-6));
        assert_eq!(bt.targets.as_deref(), Some(&[0.75, 0.25, 0.0, 0.25, 0.75, 0.0][..]));
        // Smoothing 0.3 over 3 classes: off 0.1, on 0.8.
        let mut bt = batch(2, 2);
        apply(&mut bt, MixDraw { lam: 0.5, cut: None }, 2, 3, 0.3);
        let t = bt.targets.unwrap();
        let want = [0.45, 0.45, 0.1, 0.45, 0.45, 0.1];
        for (a, b) in t.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{t:?}");
        }
    }

    #[test]
    fn cutmix_swaps_the_box_and_lambda_is_the_kept_area() {
        let side = 4;
        let mut bt = batch(2, side);
        apply(&mut bt, MixDraw { lam: 0.75, cut: Some((1, 3, 0, 2)) }, side, 3, 0.0);
        for c in 0..3 {
            for y in 0..side {
                for x in 0..side {
                    let inside = (1..3).contains(&y) && x < 2;
                    let i = c * 16 + y * 4 + x;
                    assert_eq!(bt.images[i], if inside { 1.0 } else { 0.0 });
                    assert_eq!(bt.images[48 + i], if inside { 0.0 } else { 1.0 });
                }
            }
        }
        // Drawn boxes: λ equals the fraction of the image outside the box.
        for step in 0..200 {
            let d = draw(&opts(0.0, 1.0), 3, 0, step, 224);
            let (y0, y1, x0, x1) = d.cut.unwrap();
            let kept = 1.0 - ((y1 - y0) * (x1 - x0)) as f64 / (224.0 * 224.0);
            assert!((d.lam - kept).abs() < 1e-12);
        }
    }

    #[test]
    fn targets_sum_to_one_and_draws_are_keyed() {
        let o = opts(0.8, 1.0);
        let mut cut = 0;
        for step in 0..400 {
            let d = draw(&o, 1, 2, step, 16);
            assert_eq!(d, draw(&o, 1, 2, step, 16));
            assert!((0.0..=1.0).contains(&d.lam));
            cut += usize::from(d.cut.is_some());
            let mut bt = batch(6, 16);
            apply(&mut bt, d, 16, 5, 0.1);
            for row in bt.targets.unwrap().chunks(5) {
                assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            }
        }
        // switch prob 0.5 → about half the batches use cutmix.
        assert!((150..250).contains(&cut), "{cut} cutmix batches of 400");
        assert_ne!(draw(&o, 1, 2, 0, 16), draw(&o, 1, 3, 0, 16));
        // mixup_prob 0: never mixed, targets still set (smoothed one-hot).
        let never = AugmentOptions { mixup_prob: 0.0, ..opts(0.8, 0.0) };
        assert_eq!(draw(&never, 1, 2, 0, 16), MixDraw { lam: 1.0, cut: None });
    }

    #[test]
    fn split_independent() {
        // Mixing the global batch at once == mixing each even slice of it.
        let d = MixDraw { lam: 0.3, cut: None };
        let mut whole = batch(8, 4);
        let parts: Vec<Batch> = (0..4)
            .map(|r| {
                let per = 48;
                let mut p = Batch {
                    images: whole.images[r * 2 * per..(r + 1) * 2 * per].to_vec(),
                    labels: whole.labels[r * 2..(r + 1) * 2].to_vec(),
                    targets: None,
                };
                apply(&mut p, d, 4, 3, 0.1);
                p
            })
            .collect();
        apply(&mut whole, d, 4, 3, 0.1);
        let imgs: Vec<f32> = parts.iter().flat_map(|p| p.images.clone()).collect();
        let tg: Vec<f32> = parts.iter().flat_map(|p| p.targets.clone().unwrap()).collect();
        assert_eq!(imgs, whole.images);
        assert_eq!(tg, whole.targets.unwrap());
    }
}
