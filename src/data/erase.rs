//! Random erasing (timm's `RandomErasing`, `data.reprob` / `data.remode` / `data.recount`) on a
//! normalized (3, S, S) image.
//!
//! With probability `reprob` an image gets `count` boxes (`count` uniform in 1..=recount), each
//! found in up to 10 attempts: area uniform in [0.02, 1/3] of the image divided by `count`,
//! log-uniform aspect ratio in [0.3, 1/0.3], `h = round(√(area·ratio))`, `w = round(√(area/ratio))`,
//! accepted when it fits (`w < S`, `h < S`), placed uniformly. The box is filled with per-pixel
//! N(0, 1) noise (`pixel`), zeros — the mean colour after normalization — (`const`) or one
//! N(0, 1) value per channel (`rand`). Keyed by (seed, epoch, dataset index), like every other
//! per-image draw.

use super::rng::{hash, stream, SplitMix};
use crate::config::EraseMode;

/// Erases boxes of `img` ((3, side, side) CHW f32) in place.
#[allow(clippy::too_many_arguments)]
pub fn apply(img: &mut [f32], side: usize, prob: f64, mode: EraseMode, recount: usize, seed: u64, epoch: u64, index: usize) {
    let mut rng = SplitMix::new(hash(&[seed, stream::ERASE, epoch, index as u64]));
    if rng.f64() >= prob {
        return;
    }
    let count = if recount <= 1 { 1 } else { 1 + rng.below(recount as u64) as usize };
    let area = (side * side) as f64;
    let (lr0, lr1) = (0.3f64.ln(), (1.0f64 / 0.3).ln());
    for _ in 0..count {
        for _attempt in 0..10 {
            let target = (0.02 + rng.f64() * (1.0 / 3.0 - 0.02)) * area / count as f64;
            let ratio = (lr0 + rng.f64() * (lr1 - lr0)).exp();
            let h = (target * ratio).sqrt().round() as usize;
            let w = (target / ratio).sqrt().round() as usize;
            if w < side && h < side {
                let top = rng.below((side - h + 1) as u64) as usize;
                let left = rng.below((side - w + 1) as u64) as usize;
                let per_channel = [rng.normal() as f32, rng.normal() as f32, rng.normal() as f32];
                for c in 0..3 {
                    for y in top..top + h {
                        let row = &mut img[c * side * side + y * side + left..c * side * side + y * side + left + w];
                        for v in row {
                            *v = match mode {
                                EraseMode::Pixel => rng.normal() as f32,
                                EraseMode::Const => 0.0,
                                EraseMode::Rand => per_channel[c],
                            };
                        }
                    }
                }
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fresh draws: one box per image, a rectangle of zeros in every channel, whose size fits
    /// timm's ranges (area in [0.02, 1/3] of the image, aspect h/w in [0.3, 1/0.3]) up to the
    /// rounding of h = round(√(area·ratio)) and w = round(√(area/ratio)); the mean area is that of
    /// a uniform fraction in [0.02, 1/3], 0.177 (200 draws: standard error 0.007).
    #[test]
    fn const_box_is_a_rectangle_of_zeros_in_range() {
        let side = 32;
        let seed = hash(&[std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)]);
        let mut sizes = Vec::new();
        for i in 0..200 {
            let mut img = vec![1.0f32; 3 * side * side];
            apply(&mut img, side, 1.0, EraseMode::Const, 1, seed, 0, i);
            let zeros: Vec<usize> = (0..side * side).filter(|&p| img[p] == 0.0).collect();
            assert!(!zeros.is_empty(), "image {i} was not erased");
            // A rectangle: the count equals its bounding box, in every channel.
            let (ys, xs): (Vec<usize>, Vec<usize>) = zeros.iter().map(|p| (p / side, p % side)).unzip();
            let h = ys.iter().max().unwrap() - ys.iter().min().unwrap() + 1;
            let w = xs.iter().max().unwrap() - xs.iter().min().unwrap() + 1;
            assert_eq!(zeros.len(), h * w);
            for c in 1..3 {
                assert_eq!((0..side * side).filter(|&p| img[c * side * side + p] == 0.0).count(), h * w);
            }
            let (hf, wf, s2) = (h as f64, w as f64, (side * side) as f64);
            assert!((hf + 0.5) * (wf + 0.5) >= 0.02 * s2 && (hf - 0.5) * (wf - 0.5) <= s2 / 3.0, "seed {seed} image {i}: {h}×{w} box");
            assert!((hf + 0.5) / (wf - 0.5) >= 0.3 && (hf - 0.5) / (wf + 0.5) <= 1.0 / 0.3, "seed {seed} image {i}: {h}×{w} box");
            sizes.push(h * w);
        }
        let mean = sizes.iter().sum::<usize>() as f64 / (sizes.len() * side * side) as f64;
        assert!((mean - (0.02 + 1.0 / 3.0) / 2.0).abs() < 0.03, "seed {seed}: mean box fraction {mean}");
    }

    #[test]
    fn probability_determinism_and_modes() {
        let side = 16;
        let erased = (0..1000)
            .filter(|&i| {
                let mut img = vec![1.0f32; 3 * side * side];
                apply(&mut img, side, 0.25, EraseMode::Pixel, 1, 1, 0, i);
                img.iter().any(|&v| v != 1.0)
            })
            .count();
        assert!((200..300).contains(&erased), "{erased} of 1000 erased at p=0.25");
        let mut a = vec![1.0f32; 3 * side * side];
        let mut b = a.clone();
        apply(&mut a, side, 1.0, EraseMode::Rand, 1, 1, 2, 7);
        apply(&mut b, side, 1.0, EraseMode::Rand, 1, 1, 2, 7);
        assert_eq!(a, b);
        // `rand`: one value per channel inside the boxes.
        let vals: std::collections::BTreeSet<u32> = a[..side * side].iter().filter(|&&v| v != 1.0).map(|v| v.to_bits()).collect();
        assert_eq!(vals.len(), 1);
        let mut z = vec![1.0f32; 3 * side * side];
        apply(&mut z, side, 0.0, EraseMode::Pixel, 1, 1, 2, 7);
        assert!(z.iter().all(|&v| v == 1.0));
    }
}
