//! RandAugment on (S, S, 3) HWC u8 images, with timm's op set, level mapping and magnitude
//! noise (`data.auto_augment = "rand-m9-mstd0.5-inc1"` etc.).
//!
//! Per image, keyed by (seed, epoch, dataset index): `n` ops are drawn uniformly with
//! replacement from the 15 ops (`_RAND_TRANSFORMS`, or `_RAND_INCREASING_TRANSFORMS` with
//! `inc1`); each is applied with probability `p`, at a magnitude `m` perturbed by N(0, mstd)
//! (uniform in [0, m] when mstd is inf) and clipped to [0, mmax]. Levels map to arguments as
//! timm does on its 0..10 scale: rotate ±30°·m/10, shear ±0.3·m/10, translate ±0.45·m/10 of
//! the side, posterize `int(4·m/10)` bits kept (increasing: `4 − int(4·m/10)`), solarize
//! threshold `int(256·m/10)` (increasing: `256 −` that), solarize-add `int(110·m/10)` below 128,
//! enhance factors `0.1 + 1.8·m/10` (increasing: `1 ± 0.9·m/10`, at least 0.1). Geometric ops
//! fill with the dataset mean colour, as timm's `img_mean` hparam, and sample bilinearly
//! (timm picks bilinear or bicubic at random; one fixed filter keeps this simple). Pixel ops
//! follow PIL's `ImageOps` / `ImageEnhance` formulas.

use super::rng::{hash, stream, SplitMix};
use crate::config::RandAugmentConfig;

/// The ops, in timm's list order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    AutoContrast,
    Equalize,
    Invert,
    Rotate,
    Posterize,
    Solarize,
    SolarizeAdd,
    Color,
    Contrast,
    Brightness,
    Sharpness,
    ShearX,
    ShearY,
    TranslateXRel,
    TranslateYRel,
}

pub const OPS: [Op; 15] = [
    Op::AutoContrast,
    Op::Equalize,
    Op::Invert,
    Op::Rotate,
    Op::Posterize,
    Op::Solarize,
    Op::SolarizeAdd,
    Op::Color,
    Op::Contrast,
    Op::Brightness,
    Op::Sharpness,
    Op::ShearX,
    Op::ShearY,
    Op::TranslateXRel,
    Op::TranslateYRel,
];

/// With probability ½ the value is negated (timm `_randomly_negate`).
fn negate(rng: &mut SplitMix, v: f64) -> f64 {
    if rng.f64() > 0.5 { -v } else { v }
}

/// Applies RandAugment to `img` ((side, side, 3) HWC u8) in place. `fill` is the mean colour
/// for pixels that geometric ops uncover; `scratch` is reused between calls.
#[allow(clippy::too_many_arguments)]
pub fn apply(cfg: &RandAugmentConfig, img: &mut [u8], side: usize, fill: [u8; 3], seed: u64, epoch: u64, index: usize, scratch: &mut Vec<u8>) {
    let mut rng = SplitMix::new(hash(&[seed, stream::RANDAUG, epoch, index as u64]));
    for _ in 0..cfg.num_layers {
        let op = OPS[rng.below(OPS.len() as u64) as usize];
        if cfg.prob < 1.0 && rng.f64() > cfg.prob {
            continue;
        }
        let mut m = cfg.magnitude;
        if cfg.magnitude_std.is_infinite() {
            m *= rng.f64();
        } else if cfg.magnitude_std > 0.0 {
            m += cfg.magnitude_std * rng.normal();
        }
        let m = m.clamp(0.0, cfg.magnitude_max);
        apply_op(op, m, cfg.increasing, &mut rng, img, side, fill, scratch);
    }
}

/// One op at level `m` (0..10 scale).
#[allow(clippy::too_many_arguments)]
pub fn apply_op(op: Op, m: f64, increasing: bool, rng: &mut SplitMix, img: &mut [u8], side: usize, fill: [u8; 3], scratch: &mut Vec<u8>) {
    let l = m / 10.0;
    let enhance = |rng: &mut SplitMix| if increasing { (1.0 + negate(rng, l * 0.9)).max(0.1) } else { l * 1.8 + 0.1 };
    match op {
        Op::AutoContrast => auto_contrast(img),
        Op::Equalize => equalize(img),
        Op::Invert => img.iter_mut().for_each(|v| *v = 255 - *v),
        Op::Rotate => {
            let deg = negate(rng, l * 30.0);
            let (s, c) = deg.to_radians().sin_cos();
            // Counter-clockwise on screen: output offset (dx, dy) reads input (c·dx − s·dy, s·dx + c·dy).
            let h = side as f64 / 2.0;
            affine(img, side, fill, scratch, [c, -s, h - c * h + s * h, s, c, h - s * h - c * h]);
        }
        Op::Posterize => {
            let bits = if increasing { 4 - (l * 4.0) as u32 } else { (l * 4.0) as u32 }.min(8);
            let mask = if bits == 0 { 0u8 } else { !((1u16 << (8 - bits)) as u8).wrapping_sub(1) };
            img.iter_mut().for_each(|v| *v &= mask);
        }
        Op::Solarize => {
            let t = (l * 256.0) as i32;
            let thresh = if increasing { 256 - t } else { t };
            img.iter_mut().for_each(|v| {
                if *v as i32 >= thresh {
                    *v = 255 - *v
                }
            });
        }
        Op::SolarizeAdd => {
            let add = (l * 110.0) as u16;
            img.iter_mut().for_each(|v| {
                if *v < 128 {
                    *v = (*v as u16 + add).min(255) as u8
                }
            });
        }
        Op::Color => {
            let f = enhance(rng);
            blend_with(img, f, |px| {
                let g = luma(px[0], px[1], px[2]);
                [g, g, g]
            });
        }
        Op::Contrast => {
            let f = enhance(rng);
            let n = (img.len() / 3).max(1) as f64;
            let mean = img.chunks_exact(3).map(|p| luma(p[0], p[1], p[2]) as f64).sum::<f64>() / n;
            let g = (mean + 0.5) as u8 as f32;
            blend_const(img, f, g);
        }
        Op::Brightness => {
            let f = enhance(rng);
            blend_const(img, f, 0.0);
        }
        Op::Sharpness => {
            let f = enhance(rng);
            sharpness(img, side, f as f32, scratch);
        }
        Op::ShearX => {
            let sh = negate(rng, l * 0.3);
            affine(img, side, fill, scratch, [1.0, sh, 0.0, 0.0, 1.0, 0.0]);
        }
        Op::ShearY => {
            let sh = negate(rng, l * 0.3);
            affine(img, side, fill, scratch, [1.0, 0.0, 0.0, sh, 1.0, 0.0]);
        }
        Op::TranslateXRel => {
            let px = negate(rng, l * 0.45) * side as f64;
            affine(img, side, fill, scratch, [1.0, 0.0, px, 0.0, 1.0, 0.0]);
        }
        Op::TranslateYRel => {
            let px = negate(rng, l * 0.45) * side as f64;
            affine(img, side, fill, scratch, [1.0, 0.0, 0.0, 0.0, 1.0, px]);
        }
    }
}

/// PIL's "L" conversion as a float: (299 R + 587 G + 114 B) / 1000.
fn luma(r: u8, g: u8, b: u8) -> f32 {
    (r as f32 * 299.0 + g as f32 * 587.0 + b as f32 * 114.0) / 1000.0
}

/// PIL `Image.blend(degenerate, img, f)` = degenerate + f·(img − degenerate), clipped.
fn blend_with(img: &mut [u8], f: f64, degenerate: impl Fn(&[u8]) -> [f32; 3]) {
    let f = f as f32;
    for px in img.chunks_exact_mut(3) {
        let d = degenerate(px);
        for c in 0..3 {
            px[c] = to_u8(d[c] + f * (px[c] as f32 - d[c]));
        }
    }
}

/// [`blend_with`] for a uniform degenerate image of value `g`, through a 256-entry table.
fn blend_const(img: &mut [u8], f: f64, g: f32) {
    let f = f as f32;
    let lut: [u8; 256] = std::array::from_fn(|v| to_u8(g + f * (v as f32 - g)));
    img.iter_mut().for_each(|v| *v = lut[*v as usize]);
}

/// `ImageOps.autocontrast` (no cutoff): stretch each channel's [min, max] to [0, 255].
fn auto_contrast(img: &mut [u8]) {
    for c in 0..3 {
        let (mut lo, mut hi) = (255u8, 0u8);
        for px in img.chunks_exact(3) {
            lo = lo.min(px[c]);
            hi = hi.max(px[c]);
        }
        if hi <= lo {
            continue;
        }
        // In f64, as PIL computes the table in Python floats.
        let scale = 255.0 / (hi - lo) as f64;
        let offset = -(lo as f64) * scale;
        let lut: [u8; 256] = std::array::from_fn(|v| (v as f64 * scale + offset).clamp(0.0, 255.0) as u8);
        for px in img.chunks_exact_mut(3) {
            px[c] = lut[px[c] as usize];
        }
    }
}

/// `ImageOps.equalize`: per channel, the histogram-equalizing lookup table PIL builds.
fn equalize(img: &mut [u8]) {
    for c in 0..3 {
        let mut h = [0usize; 256];
        for px in img.chunks_exact(3) {
            h[px[c] as usize] += 1;
        }
        let nonzero: Vec<usize> = h.iter().copied().filter(|&x| x > 0).collect();
        if nonzero.len() <= 1 {
            continue;
        }
        let step = (nonzero.iter().sum::<usize>() - nonzero[nonzero.len() - 1]) / 255;
        if step == 0 {
            continue;
        }
        let mut lut = [0u8; 256];
        let mut n = step / 2;
        for i in 0..256 {
            lut[i] = (n / step).min(255) as u8;
            n += h[i];
        }
        for px in img.chunks_exact_mut(3) {
            px[c] = lut[px[c] as usize];
        }
    }
}

/// `ImageEnhance.Sharpness`: blend with PIL's SMOOTH filter (3×3, centre 5, others 1, /13);
/// the one-pixel border keeps its values in the degenerate image.
fn sharpness(img: &mut [u8], side: usize, f: f32, scratch: &mut Vec<u8>) {
    scratch.clear();
    scratch.extend_from_slice(img);
    if side < 3 {
        return;
    }
    let w = side * 3;
    for y in 1..side - 1 {
        let (up, mid, down) = (&scratch[(y - 1) * w..y * w], &scratch[y * w..(y + 1) * w], &scratch[(y + 1) * w..(y + 2) * w]);
        let out = &mut img[y * w..(y + 1) * w];
        for i in 3..w - 3 {
            let acc = up[i - 3] as u32 + up[i] as u32 + up[i + 3] as u32 + mid[i - 3] as u32 + 5 * mid[i] as u32 + mid[i + 3] as u32
                + down[i - 3] as u32 + down[i] as u32 + down[i + 3] as u32;
            // round(acc / 13), ties up
            let d = ((2 * acc + 13) / 26) as f32;
            out[i] = to_u8(d + f * (mid[i] as f32 - d));
        }
    }
}

/// PIL `Image.transform(AFFINE, (a, b, c, d, e, f))`: output pixel centre (x, y) reads input
/// (a·x + b·y + c, d·x + e·y + f), bilinearly; points outside the image take `fill`.
fn affine(img: &mut [u8], side: usize, fill: [u8; 3], scratch: &mut Vec<u8>, m: [f64; 6]) {
    scratch.clear();
    scratch.extend_from_slice(img);
    let src = &scratch[..];
    let s = side as f32;
    let last = side - 1;
    let [a, b, c, d, e, f] = m.map(|v| v as f32);
    for y in 0..side {
        let oy = y as f32 + 0.5;
        let (rx, ry) = (b * oy + c, e * oy + f);
        let row = &mut img[y * side * 3..(y + 1) * side * 3];
        for (x, out) in row.chunks_exact_mut(3).enumerate() {
            let ox = x as f32 + 0.5;
            let (ix, iy) = (a * ox + rx, d * ox + ry);
            if !(0.0..s).contains(&ix) || !(0.0..s).contains(&iy) {
                out.copy_from_slice(&fill);
                continue;
            }
            // Pixel-index coordinates (≥ −0.5); a cast instead of floor(), which is a library
            // call without SSE4.1.
            let (fx, fy) = (ix - 0.5, iy - 0.5);
            let xi = if fx < 0.0 { -1 } else { fx as i64 };
            let yi = if fy < 0.0 { -1 } else { fy as i64 };
            let (wx, wy) = (fx - xi as f32, fy - yi as f32);
            let (xa, ya) = (xi.max(0) as usize, yi.max(0) as usize);
            let (xb, yb) = (((xi + 1) as usize).min(last), ((yi + 1) as usize).min(last));
            let (p00, p01) = ((ya * side + xa) * 3, (ya * side + xb) * 3);
            let (p10, p11) = ((yb * side + xa) * 3, (yb * side + xb) * 3);
            let (w00, w01, w10, w11) = ((1.0 - wx) * (1.0 - wy), wx * (1.0 - wy), (1.0 - wx) * wy, wx * wy);
            for ch in 0..3 {
                let v = src[p00 + ch] as f32 * w00 + src[p01 + ch] as f32 * w01 + src[p10 + ch] as f32 * w10 + src[p11 + ch] as f32 * w11;
                out[ch] = to_u8(v);
            }
        }
    }
}

/// Round half up and saturate to a byte (what `.round().clamp(0, 255)` gives for these values,
/// without the library call).
#[inline]
fn to_u8(v: f32) -> u8 {
    (v.max(0.0) + 0.5).min(255.0) as u8
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_rand_augment;

    fn gradient(side: usize) -> Vec<u8> {
        (0..side * side).flat_map(|i| [(i * 7 % 200) as u8 + 20, (i * 3 % 250) as u8, 100]).collect()
    }

    fn run(op: Op, m: f64, inc: bool, img: &mut [u8], side: usize) {
        let mut rng = SplitMix::new(5);
        apply_op(op, m, inc, &mut rng, img, side, [124, 116, 104], &mut Vec::new());
    }

    #[test]
    fn parses_timm_strings() {
        let c = parse_rand_augment("rand-m9-mstd0.5-inc1").unwrap().unwrap();
        assert_eq!((c.magnitude, c.num_layers, c.magnitude_std, c.increasing, c.prob, c.magnitude_max), (9.0, 2, 0.5, true, 0.5, 10.0));
        let c = parse_rand_augment("rand-n3-m7-mmax12-p1").unwrap().unwrap();
        assert_eq!((c.magnitude, c.num_layers, c.increasing, c.prob, c.magnitude_max), (7.0, 3, false, 1.0, 12.0));
        assert!(parse_rand_augment("rand-m9-mstdinf").unwrap().unwrap().magnitude_std.is_infinite());
        assert_eq!(parse_rand_augment("none").unwrap(), None);
        assert!(parse_rand_augment("augmix-m5").unwrap_err().contains("rand"));
        assert!(parse_rand_augment("rand-q3").unwrap_err().contains("q3"));
        assert!(parse_rand_augment("rand-mx").is_err());
    }

    #[test]
    fn pixel_ops_hand_checked() {
        let mut px = vec![0u8, 100, 200, 255, 127, 128];
        run(Op::Invert, 5.0, false, &mut px, 0);
        assert_eq!(px, [255, 155, 55, 0, 128, 127]);
        // Posterize m=5: int(4·0.5) = 2 bits kept → mask 0b1100_0000.
        let mut px = vec![0u8, 100, 200, 255, 127, 128];
        run(Op::Posterize, 5.0, false, &mut px, 0);
        assert_eq!(px, [0, 64, 192, 192, 64, 128]);
        // Solarize m=5: threshold 128; increasing m=5 too (256 − 128).
        let mut px = vec![0u8, 100, 200, 255, 127, 128];
        run(Op::Solarize, 5.0, false, &mut px, 0);
        assert_eq!(px, [0, 100, 55, 0, 127, 127]);
        // SolarizeAdd m=10: +110 below 128, saturating.
        let mut px = vec![0u8, 100, 200, 255, 127, 128];
        run(Op::SolarizeAdd, 10.0, false, &mut px, 0);
        assert_eq!(px, [110, 210, 200, 255, 237, 128]);
        // Brightness m=0 (non-increasing): factor 0.1.
        let mut px = vec![0u8, 100, 200, 255, 127, 128];
        run(Op::Brightness, 0.0, false, &mut px, 0);
        assert_eq!(px, [0, 10, 20, 26, 13, 13]);
        // AutoContrast stretches [50, 150] to [0, 255] per channel.
        let mut px = vec![50u8, 50, 50, 150, 150, 150, 100, 100, 100];
        run(Op::AutoContrast, 0.0, false, &mut px, 0);
        assert_eq!(px, [0, 0, 0, 255, 255, 255, 127, 127, 127]);
    }

    #[test]
    fn geometric_ops() {
        let side = 8;
        let src = gradient(side);
        // Translating by 0 or shearing by 0 is the identity.
        let mut img = src.clone();
        run(Op::TranslateXRel, 0.0, false, &mut img, side);
        assert_eq!(img, src);
        // Translate m=10: 0.45·8 = 3.6 px left or right; the uncovered columns take the fill.
        let mut img = src.clone();
        run(Op::TranslateXRel, 10.0, false, &mut img, side);
        let filled = (0..side).filter(|&x| img[x * 3..x * 3 + 3] == [124, 116, 104]).count();
        assert_eq!(filled, 4, "{img:?}");
        // Rotating by 0 is the identity; by 30° it moves pixels and fills the corners.
        let mut img = src.clone();
        run(Op::Rotate, 0.0, false, &mut img, side);
        assert_eq!(img, src);
        let mut img = src.clone();
        run(Op::Rotate, 10.0, false, &mut img, side);
        assert_eq!(&img[..3], &[124, 116, 104]);
        assert_ne!(img, src);
    }

    #[test]
    fn deterministic_keyed_and_changes_images() {
        let cfg = parse_rand_augment("rand-m9-mstd0.5-inc1").unwrap().unwrap();
        let side = 16;
        let src = gradient(side);
        let mut scratch = Vec::new();
        let mut changed = 0;
        for i in 0..50 {
            let mut a = src.clone();
            let mut b = src.clone();
            apply(&cfg, &mut a, side, [124, 116, 104], 1, 0, i, &mut scratch);
            apply(&cfg, &mut b, side, [124, 116, 104], 1, 0, i, &mut scratch);
            assert_eq!(a, b);
            changed += usize::from(a != src);
        }
        // p = 0.5 per op, 2 ops: about 3/4 of images change.
        assert!((25..50).contains(&changed), "{changed} of 50 changed");
    }
}

#[cfg(test)]
mod timing {
    use super::*;

    /// Per-op cost on a 224-px image (`cargo test --lib op_timings -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn op_timings() {
        let side = 224;
        let src: Vec<u8> = (0..side * side * 3).map(|i| (i * 31 % 251) as u8).collect();
        let mut scratch = Vec::new();
        for op in OPS {
            let mut img = src.clone();
            let t = std::time::Instant::now();
            for k in 0..50 {
                let mut rng = SplitMix::new(k);
                apply_op(op, 9.0, true, &mut rng, &mut img, side, [124, 116, 104], &mut scratch);
            }
            eprintln!("{op:?}: {:.3} ms", t.elapsed().as_secs_f64() * 1e3 / 50.0);
        }
    }
}
