//! The built-in dataset: ten shape classes drawn procedurally, so `vitscale train` works with
//! no files and still learns something real.
//!
//! Each image is one shape — the class — on a background. Everything else is nuisance drawn per
//! image: background colour and a linear gradient across it, shape colour (dark on light or
//! light on dark at random, hue random), centre, size, and per-pixel noise.
//! Colour is independent of class, so the mean colour says nothing about the label and a linear
//! classifier on raw pixels is far from perfect (softmax regression: 35 % val top-1,
//! `tests/data_builtin.rs`; with one fixed polarity the same kind of probe reached 85–100 % in a
//! PyTorch prototype, which is why the polarity is random); shape is visible at 16 px, so
//! `vitscale train` with its defaults (`vit_builtin_default`, 6000 images, 10 epochs) reaches
//! ≈ 94–99 % val top-1 after 2–3 epochs and ≈ 99.9 % after 10 (configs/README.md has the
//! measured run).
//!
//! Shapes are rendered with 3×3 supersampling (anti-aliased coverage), which keeps small shapes
//! from turning into a handful of class-ambiguous pixels.
//!
//! Every image is a pure function of (seed, split stream, index): generation is parallel and
//! the result does not depend on the thread count.

use rayon::prelude::*;

use super::rng::{hash, SplitMix};
use super::ImageSet;

/// Classes of the built-in dataset, in label order.
pub const CLASS_NAMES: [&str; 10] = [
    "disc",
    "square",
    "ring",
    "frame",
    "plus",
    "cross",
    "triangle_up",
    "triangle_down",
    "h_stripes",
    "v_stripes",
];

pub const NUM_CLASSES: usize = 10;

/// Smallest side at which the shapes are still distinguishable.
pub const MIN_SIDE: usize = 8;

/// Whether the point (u, v) — shape coordinates, the shape's box is [−1, 1]², v down — is inside
/// shape `class`.
#[inline]
fn inside(class: usize, u: f32, v: f32) -> bool {
    let (au, av) = (u.abs(), v.abs());
    match class {
        0 => u * u + v * v <= 1.0,
        1 => au.max(av) <= 0.85,
        2 => {
            let r2 = u * u + v * v;
            (0.3..=1.0).contains(&r2) // inner radius ≈ 0.55
        }
        3 => {
            let m = au.max(av);
            (0.45..=0.9).contains(&m)
        }
        4 => (au <= 0.3 && av <= 1.0) || (av <= 0.3 && au <= 1.0),
        5 => {
            // The plus rotated by 45°; clipped to the box so it stays inside.
            let (p, q) = ((u + v).abs() * std::f32::consts::FRAC_1_SQRT_2, (u - v).abs() * std::f32::consts::FRAC_1_SQRT_2);
            au <= 0.95 && av <= 0.95 && (p <= 0.25 || q <= 0.25)
        }
        6 => (-0.9..=0.9).contains(&v) && au <= (v + 0.9) / 1.8,
        7 => (-0.9..=0.9).contains(&v) && au <= (0.9 - v) / 1.8,
        8 => au.max(av) <= 0.9 && (((v + 0.9) / 0.36) as i32) % 2 == 0,
        9 => au.max(av) <= 0.9 && (((u + 0.9) / 0.36) as i32) % 2 == 0,
        _ => false,
    }
}

/// Renders image `index` of a split into `out` (S, S, 3) HWC and returns its label.
fn render(rng_seed: u64, index: usize, side: usize, out: &mut [u8]) -> u16 {
    // Exactly balanced classes; the sampler shuffles for training.
    let class = index % NUM_CLASSES;
    let mut rng = SplitMix::new(rng_seed);
    let s = side as f32;

    // Colours: one of the pair is dark (every channel in [0, 0.35]), the other light (every
    // channel in [0.65, 1]); which one is the shape is a coin flip. The luminance gap keeps the
    // shape visible after patch embedding (fully random colour pairs left a small ViT at ~65 %
    // after 10 epochs), the random polarity and hue keep colour useless for the label.
    let dark = [rng.f32() * 0.35, rng.f32() * 0.35, rng.f32() * 0.35];
    let light = [1.0 - rng.f32() * 0.35, 1.0 - rng.f32() * 0.35, 1.0 - rng.f32() * 0.35];
    let (bg0, fg) = if rng.coin() { (dark, light) } else { (light, dark) };
    // A linear gradient of random direction and strength across the background.
    let angle = rng.range_f32(0.0, std::f32::consts::TAU);
    let (gx, gy) = (angle.cos(), angle.sin());
    let strength = rng.range_f32(0.0, 0.35);
    let grad = [rng.range_f32(-1.0, 1.0) * strength, rng.range_f32(-1.0, 1.0) * strength, rng.range_f32(-1.0, 1.0) * strength];
    // Shape half-size and centre: the [−1, 1]² box always fits inside the image; the centre
    // moves by up to half the free room (more jitter slowed learning at 16 px markedly).
    let r = s * rng.range_f32(0.35, 0.48);
    let room = 0.5 * (s * 0.5 - r);
    let cx = s * 0.5 + rng.range_f32(-1.0, 1.0) * room;
    let cy = s * 0.5 + rng.range_f32(-1.0, 1.0) * room;
    let noise = rng.range_f32(0.01, 0.06);

    const SUB: usize = 3;
    let inv_r = 1.0 / r;
    for y in 0..side {
        for x in 0..side {
            let mut hits = 0u32;
            for sy in 0..SUB {
                let py = y as f32 + (sy as f32 + 0.5) / SUB as f32;
                let v = (py - cy) * inv_r;
                for sx in 0..SUB {
                    let px = x as f32 + (sx as f32 + 0.5) / SUB as f32;
                    let u = (px - cx) * inv_r;
                    hits += u32::from(inside(class, u, v));
                }
            }
            let cov = hits as f32 / (SUB * SUB) as f32;
            // Gradient coordinate in [−1, 1] across the image.
            let t = ((x as f32 + 0.5) / s - 0.5) * gx + ((y as f32 + 0.5) / s - 0.5) * gy;
            let o = (y * side + x) * 3;
            for c in 0..3 {
                let bg = bg0[c] + grad[c] * t;
                // Approximately Gaussian noise: sum of three uniforms, centred, σ ≈ noise.
                let n = (rng.f32() + rng.f32() + rng.f32() - 1.5) * 2.0 * noise;
                let val = bg * (1.0 - cov) + fg[c] * cov + n;
                out[o + c] = (val.clamp(0.0, 1.0) * 255.0 + 0.5) as u8;
            }
        }
    }
    class as u16
}

/// Generates `n` images of side `side` from stream `stream` of `seed`.
pub fn generate(n: usize, side: usize, seed: u64, stream: u64) -> ImageSet {
    let img = side * side * 3;
    let mut images = vec![0u8; n * img];
    let labels: Vec<u16> = images
        .par_chunks_mut(img.max(1))
        .enumerate()
        .map(|(i, out)| render(hash(&[seed, stream, i as u64]), i, side, out))
        .collect();
    ImageSet::in_memory(images, labels, side, NUM_CLASSES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_is_mirror_symmetric() {
        // The horizontal-flip augmentation relies on this.
        for (class, name) in CLASS_NAMES.iter().enumerate() {
            for i in 0..200 {
                for j in 0..200 {
                    let u = -1.0 + 2.0 * (i as f32 + 0.5) / 200.0;
                    let v = -1.0 + 2.0 * (j as f32 + 0.5) / 200.0;
                    assert_eq!(inside(class, u, v), inside(class, -u, v), "{name} at ({u}, {v})");
                }
            }
        }
    }

    #[test]
    fn shapes_are_distinct_and_non_empty() {
        let grid = |class: usize| -> Vec<bool> {
            (0..64 * 64).map(|k| inside(class, -1.0 + 2.0 * ((k % 64) as f32 + 0.5) / 64.0, -1.0 + 2.0 * ((k / 64) as f32 + 0.5) / 64.0)).collect()
        };
        let grids: Vec<Vec<bool>> = (0..NUM_CLASSES).map(grid).collect();
        for a in 0..NUM_CLASSES {
            let area = grids[a].iter().filter(|&&b| b).count();
            assert!(area > 64 * 64 / 6, "{} too small: {area}", CLASS_NAMES[a]);
            for b in a + 1..NUM_CLASSES {
                let diff = grids[a].iter().zip(&grids[b]).filter(|(x, y)| x != y).count();
                assert!(diff > 64 * 64 / 10, "{} vs {} differ in {diff} cells", CLASS_NAMES[a], CLASS_NAMES[b]);
            }
        }
    }
}
