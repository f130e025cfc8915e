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
        Op::Posterize => {
            // timm: `int(4·l)` bits kept (increasing: 4 minus that, negative past level 12.5);
            // 8 or more keep the image, none or fewer leave no bits (PIL's mask is then 0).
            let bits = if increasing { 4 - (l * 4.0) as i64 } else { (l * 4.0) as i64 };
            let mask = if bits >= 8 { 0xff } else if bits <= 0 { 0u8 } else { 0xffu8 << (8 - bits) };
            img.iter_mut().for_each(|v| *v &= mask);
        }
        Op::Solarize => {
            let t = (l * 256.0) as i32;
            let thresh = if increasing { 256 - t } else { t };
            if thresh <= 255 {
                let t = thresh.max(0) as u8;
                img.iter_mut().for_each(|v| *v = if *v >= t { 255 - *v } else { *v });
            }
        }
        Op::SolarizeAdd => {
            let add = (l * 110.0).min(255.0) as u8;
            img.iter_mut().for_each(|v| *v = if *v < 128 { v.saturating_add(add) } else { *v });
        }
        Op::Color => {
            let f = enhance(rng);
            color(img, f as f32);
        }
        Op::Contrast => {
            let f = enhance(rng);
            blend_const(img, f, mean_grey(img));
        }
        Op::Brightness => {
            let f = enhance(rng);
            blend_const(img, f, 0.0);
        }
        Op::Sharpness => {
            let f = enhance(rng);
            sharpness(img, side, f as f32, scratch);
        }
        Op::Rotate | Op::ShearX | Op::ShearY | Op::TranslateXRel | Op::TranslateYRel => {
            let m = geometric(op, l, rng, side);
            affine(img, side, fill, scratch, m);
        }
    }
}

/// The inverse affine map (PIL's `AFFINE` data) of a geometric op at level fraction `l`;
/// draws the sign from `rng`.
fn geometric(op: Op, l: f64, rng: &mut SplitMix, side: usize) -> [f64; 6] {
    match op {
        Op::Rotate => {
            let deg = negate(rng, l * 30.0);
            let (s, c) = deg.to_radians().sin_cos();
            // Counter-clockwise on screen: output offset (dx, dy) reads input (c·dx − s·dy, s·dx + c·dy).
            let h = side as f64 / 2.0;
            [c, -s, h - c * h + s * h, s, c, h - s * h - c * h]
        }
        Op::ShearX => [1.0, negate(rng, l * 0.3), 0.0, 0.0, 1.0, 0.0],
        Op::ShearY => [1.0, 0.0, 0.0, negate(rng, l * 0.3), 1.0, 0.0],
        Op::TranslateXRel => [1.0, 0.0, negate(rng, l * 0.45) * side as f64, 0.0, 1.0, 0.0],
        Op::TranslateYRel => [1.0, 0.0, 0.0, 0.0, 1.0, negate(rng, l * 0.45) * side as f64],
        _ => [1.0, 0.0, 0.0, 0.0, 1.0, 0.0],
    }
}

/// PIL's "L" conversion scaled by 1000, exactly: 299 R + 587 G + 114 B.
#[inline]
fn luma1000(r: u8, g: u8, b: u8) -> u32 {
    r as u32 * 299 + g as u32 * 587 + b as u32 * 114
}

/// `ImageEnhance.Color`: blend with the image's grey version, `l + f·(c − l)` per channel with
/// `l = (299 R + 587 G + 114 B) / 1000`, in f32, rounded half up and clipped.
fn color(img: &mut [u8], f: f32) {
    for px in img.chunks_exact_mut(3) {
        let l = luma1000(px[0], px[1], px[2]) as f32 * 0.001;
        for c in px {
            *c = to_u8(l + f * (*c as f32 - l));
        }
    }
}

/// [`color`]'s blend for a uniform degenerate image of value `g`, through a 256-entry table.
fn blend_const(img: &mut [u8], f: f64, g: f32) {
    let f = f as f32;
    let lut: [u8; 256] = std::array::from_fn(|v| to_u8(g + f * (v as f32 - g)));
    img.iter_mut().for_each(|v| *v = lut[*v as usize]);
}

/// Bytes per block in the channel-aware loops below: 48 = 16 pixels, so byte j of every block
/// is channel j % 3 and the per-byte loops vectorize.
const BLOCK: usize = 48;

/// Per-channel minimum and maximum in one pass.
fn channel_min_max(img: &[u8]) -> ([u8; 3], [u8; 3]) {
    let (mut mn, mut mx) = ([255u8; BLOCK], [0u8; BLOCK]);
    let blocks = img.chunks_exact(BLOCK);
    let rest = blocks.remainder();
    for b in blocks {
        for j in 0..BLOCK {
            mn[j] = mn[j].min(b[j]);
            mx[j] = mx[j].max(b[j]);
        }
    }
    for (j, &v) in rest.iter().enumerate() {
        mn[j] = mn[j].min(v);
        mx[j] = mx[j].max(v);
    }
    let (mut lo, mut hi) = ([255u8; 3], [0u8; 3]);
    for j in 0..BLOCK {
        lo[j % 3] = lo[j % 3].min(mn[j]);
        hi[j % 3] = hi[j % 3].max(mx[j]);
    }
    (lo, hi)
}

/// Maps every byte through its channel's table.
fn apply_luts(img: &mut [u8], luts: &[[u8; 256]; 3]) {
    for px in img.chunks_exact_mut(3) {
        px[0] = luts[0][px[0] as usize];
        px[1] = luts[1][px[1] as usize];
        px[2] = luts[2][px[2] as usize];
    }
}

/// `ImageOps.autocontrast` (no cutoff): stretch each channel's [min, max] to [0, 255].
fn auto_contrast(img: &mut [u8]) {
    let (lo, hi) = channel_min_max(img);
    if (0..3).all(|c| hi[c] <= lo[c]) {
        return;
    }
    let luts: [[u8; 256]; 3] = std::array::from_fn(|c| {
        if hi[c] <= lo[c] {
            return std::array::from_fn(|v| v as u8);
        }
        // In f64, as PIL computes the table in Python floats.
        let scale = 255.0 / (hi[c] - lo[c]) as f64;
        let offset = -(lo[c] as f64) * scale;
        std::array::from_fn(|v| (v as f64 * scale + offset).clamp(0.0, 255.0) as u8)
    });
    apply_luts(img, &luts);
}

/// `ImageOps.equalize`: per channel, the histogram-equalizing lookup table PIL builds.
fn equalize(img: &mut [u8]) {
    // One pass; two histogram copies per channel so that runs of equal values do not serialize
    // on one counter.
    let mut h = [[[0u32; 256]; 3]; 2];
    let pairs = img.chunks_exact(6);
    let rest = pairs.remainder();
    for p in pairs {
        h[0][0][p[0] as usize] += 1;
        h[0][1][p[1] as usize] += 1;
        h[0][2][p[2] as usize] += 1;
        h[1][0][p[3] as usize] += 1;
        h[1][1][p[4] as usize] += 1;
        h[1][2][p[5] as usize] += 1;
    }
    for p in rest.chunks_exact(3) {
        for c in 0..3 {
            h[0][c][p[c] as usize] += 1;
        }
    }
    let mut luts = [[0u8; 256]; 3];
    let mut any = false;
    for c in 0..3 {
        let hist: [usize; 256] = std::array::from_fn(|v| (h[0][c][v] + h[1][c][v]) as usize);
        luts[c] = std::array::from_fn(|v| v as u8);
        let nonzero: Vec<usize> = hist.iter().copied().filter(|&x| x > 0).collect();
        if nonzero.len() <= 1 {
            continue;
        }
        let step = (nonzero.iter().sum::<usize>() - nonzero[nonzero.len() - 1]) / 255;
        if step == 0 {
            continue;
        }
        let mut n = step / 2;
        for i in 0..256 {
            luts[c][i] = (n / step).min(255) as u8;
            n += hist[i];
        }
        any = true;
    }
    if any {
        apply_luts(img, &luts);
    }
}

/// `ImageEnhance.Contrast`'s grey level: the mean of the "L" image, rounded half up.
fn mean_grey(img: &[u8]) -> f32 {
    let n = (img.len() / 3).max(1) as f64;
    let sum: u64 = img.chunks_exact(3).map(|p| luma1000(p[0], p[1], p[2]) as u64).sum();
    (sum as f64 / 1000.0 / n + 0.5) as u8 as f32
}

/// `ImageEnhance.Sharpness`: blend with PIL's SMOOTH filter (3×3, centre 5, others 1, /13);
/// the one-pixel border keeps its values in the degenerate image. The 3×3 sums come from
/// per-row vertical sums; the blend is `d + f·(v − d)` in f32, rounded half up and clipped.
fn sharpness(img: &mut [u8], side: usize, f: f32, scratch: &mut Vec<u8>) {
    if side < 3 {
        return;
    }
    let w = side * 3;
    scratch.clear();
    scratch.extend_from_slice(img);
    let mut vsum = vec![0u16; w];
    for y in 1..side - 1 {
        let (up, mid, down) = (&scratch[(y - 1) * w..y * w], &scratch[y * w..(y + 1) * w], &scratch[(y + 1) * w..(y + 2) * w]);
        for i in 0..w {
            vsum[i] = up[i] as u16 + mid[i] as u16 + down[i] as u16;
        }
        let out = &mut img[y * w + 3..(y + 1) * w - 3];
        let (left, centre, right, m) = (&vsum[..w - 6], &vsum[3..w - 3], &vsum[6..], &mid[3..w - 3]);
        for i in 0..w - 6 {
            // 3×3 sum + 4 more of the centre = the SMOOTH kernel's 13-weighted sum.
            let acc = left[i] as i32 + centre[i] as i32 + right[i] as i32 + 4 * m[i] as i32;
            // round(acc / 13), ties up
            let d = ((2 * acc + 13) / 26) as f32;
            out[i] = to_u8(d + f * (m[i] as i32 as f32 - d));
        }
    }
}

/// PIL `Image.transform(AFFINE, (a, b, c, d, e, f))`: output pixel centre (x, y) reads input
/// (a·x + b·y + c, d·x + e·y + f), bilinearly, with neighbours past the edge clamped to it;
/// points outside the image take `fill`. Which output pixels are inside is decided in f64 from
/// that formula (as PIL does, in double); the sampling runs in integer arithmetic along each row,
/// with a special case for each shape the ops produce: a per-row horizontal shift (TranslateX,
/// ShearX), a blend of two whole rows (TranslateY), a per-column vertical shift (ShearY), and
/// the general map (Rotate).
fn affine(img: &mut [u8], side: usize, fill: [u8; 3], scratch: &mut Vec<u8>, m: [f64; 6]) {
    if side == 0 {
        return;
    }
    let [a, b, c, d, e, f] = m;
    if a == 1.0 && d == 0.0 && e == 1.0 && f == 0.0 {
        shift_rows(img, side, fill, scratch, b, c);
    } else if a == 1.0 && b == 0.0 && c == 0.0 && d == 0.0 && e == 1.0 {
        shift_vertical(img, side, fill, scratch, f);
    } else if a == 1.0 && b == 0.0 && c == 0.0 && e == 1.0 && f == 0.0 {
        shear_columns(img, side, fill, scratch, d);
    } else {
        affine_general(img, side, fill, scratch, m);
    }
}

/// Output columns `lo..hi` of one row whose centres map inside the source, where column x maps
/// to (a·(x+½) + rx, d·(x+½) + ry): the exact f64 test, solved for x and checked at the ends.
fn inside_range(a: f64, rx: f64, d: f64, ry: f64, side: usize) -> (usize, usize) {
    let s = side as f64;
    let inside = |x: usize| {
        let ox = x as f64 + 0.5;
        let (ix, iy) = (a * ox + rx, d * ox + ry);
        (0.0..s).contains(&ix) && (0.0..s).contains(&iy)
    };
    // Each coordinate constrains ox to an interval.
    let (mut lo, mut hi) = (f64::NEG_INFINITY, f64::INFINITY);
    for (k, r) in [(a, rx), (d, ry)] {
        if k.abs() < 1e-9 {
            if !(-1e-6..s + 1e-6).contains(&r) {
                return (0, 0);
            }
        } else {
            let (t0, t1) = (-r / k, (s - r) / k);
            lo = lo.max(t0.min(t1));
            hi = hi.min(t0.max(t1));
        }
    }
    let to_col = |v: f64| if v.is_nan() { 0.0 } else { v.clamp(0.0, s) };
    let mut x0 = to_col((lo - 0.5).ceil()) as usize;
    let mut x1 = (to_col((hi - 0.5).floor() + 1.0) as usize).max(x0);
    // The solution is within a rounding error of the exact set, which is an interval.
    while x0 > 0 && inside(x0 - 1) {
        x0 -= 1;
    }
    while x0 < x1 && !inside(x0) {
        x0 += 1;
    }
    if x0 == x1 {
        // Empty as solved: either truly empty or a single column at x0 the solve rounded away.
        while x1 < side && inside(x1) {
            x1 += 1;
        }
        return (x0, x1);
    }
    while x1 < side && inside(x1) {
        x1 += 1;
    }
    while x1 > x0 && !inside(x1 - 1) {
        x1 -= 1;
    }
    (x0, x1)
}

/// Fills whole pixels of `row` with `fill`.
fn fill_px(row: &mut [u8], fill: [u8; 3]) {
    for px in row.chunks_exact_mut(3) {
        px.copy_from_slice(&fill);
    }
}

/// `dst[i] = round(p[i]·(1 − w) + q[i]·w)` with `w = w16 / 65536`, `w16` in 1..65536, as
/// `(p·256)·(65536 − w16) >> 16` + `(q·256)·w16 >> 16` in 16-bit lanes: within 0.01 of a level
/// of the exact blend before the rounding. SSE2 (every x86-64) does 16 bytes per step with
/// the same integer arithmetic as the scalar loop, so results do not depend on the machine.
#[inline]
fn lerp_bytes(dst: &mut [u8], p: &[u8], q: &[u8], w16: u32) {
    debug_assert!((1..65536).contains(&w16));
    let (w1, w0) = (w16 as u16, (65536 - w16) as u16);
    let n = dst.len();
    let (p, q) = (&p[..n], &q[..n]);
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        // SAFETY: SSE2 is part of the x86-64 baseline; loads and stores are unaligned and stay
        // within the first `n / 16 · 16` bytes of slices of length `n`.
        unsafe {
            let (vw0, vw1) = (_mm_set1_epi16(w0 as i16), _mm_set1_epi16(w1 as i16));
            let (bias, zero) = (_mm_set1_epi16(129), _mm_setzero_si128());
            while done + 16 <= n {
                let a = _mm_loadu_si128(p.as_ptr().add(done) as *const __m128i);
                let b = _mm_loadu_si128(q.as_ptr().add(done) as *const __m128i);
                let lo = _mm_add_epi16(
                    _mm_add_epi16(_mm_mulhi_epu16(_mm_unpacklo_epi8(zero, a), vw0), _mm_mulhi_epu16(_mm_unpacklo_epi8(zero, b), vw1)),
                    bias,
                );
                let hi = _mm_add_epi16(
                    _mm_add_epi16(_mm_mulhi_epu16(_mm_unpackhi_epi8(zero, a), vw0), _mm_mulhi_epu16(_mm_unpackhi_epi8(zero, b), vw1)),
                    bias,
                );
                let r = _mm_packus_epi16(_mm_srli_epi16(lo, 8), _mm_srli_epi16(hi, 8));
                _mm_storeu_si128(dst.as_mut_ptr().add(done) as *mut __m128i, r);
                done += 16;
            }
        }
    }
    for i in done..n {
        let a = ((((p[i] as u16) << 8) as u32 * w0 as u32) >> 16) as u16;
        let b = ((((q[i] as u16) << 8) as u32 * w1 as u32) >> 16) as u16;
        // Each product is truncated (error in (−1, 0] of 1/256 level): +129 centres the sum.
        dst[i] = ((a + b + 129) >> 8) as u8;
    }
}

/// Splits a source offset `t` (pixels) into its integer part and a 16-bit fraction.
fn split_offset(t: f64) -> (isize, u32) {
    let k = t.floor();
    let w = ((t - k) * 65536.0).round() as u32;
    if w >= 65536 {
        (k as isize + 1, 0)
    } else {
        (k as isize, w)
    }
}

/// Pixels of edge padding on each side of the per-row source copies below: sampling reads at
/// most one pixel past the edge (clamped), plus one for rounding of the offsets.
const PAD: usize = 2;

/// `a = 1, d = 0, e = 1, f = 0`: row y reads its own source row shifted by
/// `t = b·(y+½) + c` pixels, one constant fraction per row (TranslateX, ShearX).
fn shift_rows(img: &mut [u8], side: usize, fill: [u8; 3], scratch: &mut Vec<u8>, b: f64, c: f64) {
    let w = side * 3;
    scratch.clear();
    scratch.resize((side + 2 * PAD) * 3, 0);
    for (y, row) in img.chunks_exact_mut(w).enumerate() {
        let oy = y as f64 + 0.5;
        let rx = b * oy + c;
        let (lo, hi) = inside_range(1.0, rx, 0.0, oy, side);
        shift_row(row, scratch, fill, rx, lo, hi);
    }
}

/// One row of [`shift_rows`] in place: pixels `lo..hi` read the row shifted by `rx` pixels
/// (column x samples at x + rx, edge pixels clamped), the rest take `fill`. `padded` holds
/// (side + 2·PAD) pixels of scratch.
fn shift_row(row: &mut [u8], padded: &mut [u8], fill: [u8; 3], rx: f64, lo: usize, hi: usize) {
    let side = row.len() / 3;
    let w = side * 3;
    if lo >= hi {
        fill_px(row, fill);
        return;
    }
    // Edge-padded copy of the source row (which is this very row).
    padded[PAD * 3..PAD * 3 + w].copy_from_slice(row);
    for p in 0..PAD {
        padded.copy_within(PAD * 3..PAD * 3 + 3, p * 3);
        padded.copy_within(PAD * 3 + w - 3..PAD * 3 + w, (PAD + side + p) * 3);
    }
    // Column x reads source pixels floor(x + rx) and the next: padded x + k + PAD.
    let (k, w16) = split_offset(rx);
    let first = (lo as isize + k + PAD as isize).clamp(0, (side + PAD) as isize) as usize;
    let src = &padded[first * 3..(side + 2 * PAD) * 3];
    let n = (hi - lo).min(src.len() / 3 - 1);
    let out = &mut row[lo * 3..(lo + n) * 3];
    if w16 == 0 {
        out.copy_from_slice(&src[..n * 3]);
    } else {
        lerp_bytes(out, &src[..n * 3], &src[3..n * 3 + 3], w16);
    }
    fill_px(&mut row[..lo * 3], fill);
    fill_px(&mut row[(lo + n) * 3..], fill);
}

/// Transposes the (side, side, 3) pixel grid `src` into `dst`, in tiles that stay in cache.
fn transpose(src: &[u8], dst: &mut [u8], side: usize) {
    const T: usize = 16;
    let w = side * 3;
    for by in (0..side).step_by(T) {
        for bx in (0..side).step_by(T) {
            for y in by..(by + T).min(side) {
                let srow = &src[y * w..(y + 1) * w];
                for x in bx..(bx + T).min(side) {
                    dst[x * w + y * 3..x * w + y * 3 + 3].copy_from_slice(&srow[x * 3..x * 3 + 3]);
                }
            }
        }
    }
}

/// `a = 1, b = c = d = 0, e = 1`: row y is the blend of source rows floor(y + f) and the next
/// (TranslateY).
fn shift_vertical(img: &mut [u8], side: usize, fill: [u8; 3], scratch: &mut Vec<u8>, f: f64) {
    let w = side * 3;
    scratch.clear();
    scratch.extend_from_slice(img);
    let (k, w16) = split_offset(f);
    let src_row = |r: isize| {
        let r = r.clamp(0, side as isize - 1) as usize;
        &scratch[r * w..(r + 1) * w]
    };
    let s = side as f64;
    for y in 0..side {
        let row = &mut img[y * w..(y + 1) * w];
        let iy = (y as f64 + 0.5) + f;
        if !(0.0..s).contains(&iy) {
            fill_px(row, fill);
            continue;
        }
        let r = y as isize + k;
        if w16 == 0 {
            row.copy_from_slice(src_row(r));
        } else {
            lerp_bytes(row, src_row(r), src_row(r + 1), w16);
        }
    }
}

/// `a = 1, b = c = 0, e = 1, f = 0`: column x reads its own source column shifted by
/// `d·(x+½)` pixels (ShearY): transposed, shifted row by row as in [`shift_rows`], transposed
/// back.
fn shear_columns(img: &mut [u8], side: usize, fill: [u8; 3], scratch: &mut Vec<u8>, d: f64) {
    let n = side * side * 3;
    scratch.clear();
    scratch.resize(n + (side + 2 * PAD) * 3, 0);
    let (t, padded) = scratch.split_at_mut(n);
    transpose(img, t, side);
    for (x, col) in t.chunks_exact_mut(side * 3).enumerate() {
        let ox = x as f64 + 0.5;
        let ry = d * ox;
        // Output row y of this column maps to (ox, d·ox + (y+½)).
        let (lo, hi) = inside_range(1.0, ry, 0.0, ox, side);
        shift_row(col, padded, fill, ry, lo, hi);
    }
    transpose(t, img, side);
}

/// The general map (Rotate): per row, the inside columns step through the source in 32.32
/// fixed point from an exact f64 start, and sample an edge-padded copy with 11-bit weights.
fn affine_general(img: &mut [u8], side: usize, fill: [u8; 3], scratch: &mut Vec<u8>, m: [f64; 6]) {
    let [a, b, c, d, e, f] = m;
    let ps = side + 2;
    let pw = ps * 3;
    scratch.clear();
    scratch.resize(ps * pw, 0);
    for y in 0..side {
        let dst = &mut scratch[(y + 1) * pw..(y + 2) * pw];
        dst[3..pw - 3].copy_from_slice(&img[y * side * 3..(y + 1) * side * 3]);
        dst.copy_within(3..6, 0);
        dst.copy_within(pw - 6..pw - 3, pw - 3);
    }
    scratch.copy_within(pw..2 * pw, 0);
    scratch.copy_within(side * pw..(side + 1) * pw, (side + 1) * pw);
    let src = &scratch[..];
    const ONE: f64 = 4294967296.0;
    const HALF_W: i64 = 1 << 20; // rounds the position to the 11-bit weight grid
    let (dx, dy) = ((a * ONE).round() as i64, (d * ONE).round() as i64);
    let w = side * 3;
    for y in 0..side {
        let oy = y as f64 + 0.5;
        let (rx, ry) = (b * oy + c, e * oy + f);
        let (lo, hi) = inside_range(a, rx, d, ry, side);
        let row = &mut img[y * w..(y + 1) * w];
        fill_px(&mut row[..lo * 3], fill);
        fill_px(&mut row[hi.max(lo) * 3..], fill);
        if lo >= hi {
            continue;
        }
        let ox = lo as f64 + 0.5;
        // Padded pixel-index coordinates: (i − ½) + 1.
        let mut fx = ((a * ox + rx + 0.5) * ONE).round() as i64 + HALF_W;
        let mut fy = ((d * ox + ry + 0.5) * ONE).round() as i64 + HALF_W;
        for out in row[lo * 3..hi * 3].chunks_exact_mut(3) {
            // Inside pixels sample at padded coordinates in [½, side + ½): xi, yi ≤ side.
            let (xi, yi) = ((fx >> 32) as usize, (fy >> 32) as usize);
            let wx = ((fx >> 21) & 0x7ff) as i32;
            let wy = ((fy >> 21) & 0x7ff) as i32;
            let p = yi * pw + xi * 3;
            let t: &[u8; 6] = src[p..p + 6].try_into().unwrap();
            let u: &[u8; 6] = src[p + pw..p + pw + 6].try_into().unwrap();
            let mut v = [0u8; 3];
            for ch in 0..3 {
                let top = ((t[ch] as i32) << 11) + (t[ch + 3] as i32 - t[ch] as i32) * wx;
                let bot = ((u[ch] as i32) << 11) + (u[ch + 3] as i32 - u[ch] as i32) * wx;
                let s = (top << 11) + (bot - top) * wy;
                v[ch] = ((s + (1 << 21)) >> 22) as u8;
            }
            out.copy_from_slice(&v);
            fx += dx;
            fy += dy;
        }
    }
}

/// Round half up and saturate to a byte (what `.round().clamp(0, 255)` gives for these values,
/// without the library call, and in a form the compiler vectorizes).
#[inline]
fn to_u8(v: f32) -> u8 {
    let v = (v.max(0.0) + 0.5).min(255.0);
    // SAFETY: `max` maps NaN to 0, so v is finite and in [0.5, 255]: the truncation fits an i32.
    unsafe { v.to_int_unchecked::<i32>() as u8 }
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

    fn random_image(side: usize, seed: u64) -> Vec<u8> {
        let mut rng = SplitMix::new(seed);
        (0..side * side * 3).map(|_| rng.below(256) as u8).collect()
    }

    /// Smooth random image: a few random gradients plus mild noise (closer to a photo than
    /// white noise, and exercises the rounding of every op).
    fn photo_like(side: usize, seed: u64) -> Vec<u8> {
        let mut rng = SplitMix::new(seed);
        let k: Vec<f64> = (0..9).map(|_| rng.f64() * 6.0).collect();
        let s = side as f64;
        (0..side * side)
            .flat_map(|i| {
                let (x, y) = ((i % side) as f64 / s, (i / side) as f64 / s);
                let mut px = [0u8; 3];
                for c in 0..3 {
                    let v = 128.0 + 100.0 * (k[3 * c] * x + k[3 * c + 1] * y + k[3 * c + 2]).sin() + 20.0 * (rng.f64() - 0.5);
                    px[c] = v.clamp(0.0, 255.0) as u8;
                }
                px
            })
            .collect()
    }

    /// Reference PIL bilinear AFFINE: per pixel in f64, straight from the definition.
    fn affine_reference(img: &[u8], side: usize, fill: [u8; 3], m: [f64; 6]) -> Vec<u8> {
        let [a, b, c, d, e, f] = m;
        let s = side as f64;
        let last = side as i64 - 1;
        let mut out = vec![0u8; img.len()];
        for y in 0..side {
            for x in 0..side {
                let (ox, oy) = (x as f64 + 0.5, y as f64 + 0.5);
                let (ix, iy) = (a * ox + (b * oy + c), d * ox + (e * oy + f));
                let o = (y * side + x) * 3;
                if !(0.0..s).contains(&ix) || !(0.0..s).contains(&iy) {
                    out[o..o + 3].copy_from_slice(&fill);
                    continue;
                }
                let (fx, fy) = (ix - 0.5, iy - 0.5);
                let (xi, yi) = (fx.floor() as i64, fy.floor() as i64);
                let (wx, wy) = (fx - xi as f64, fy - yi as f64);
                let at = |yy: i64, xx: i64, ch: usize| img[((yy.clamp(0, last) * side as i64 + xx.clamp(0, last)) * 3) as usize + ch] as f64;
                for ch in 0..3 {
                    let top = at(yi, xi, ch) * (1.0 - wx) + at(yi, xi + 1, ch) * wx;
                    let bot = at(yi + 1, xi, ch) * (1.0 - wx) + at(yi + 1, xi + 1, ch) * wx;
                    out[o + ch] = (top * (1.0 - wy) + bot * wy + 0.5).floor().clamp(0.0, 255.0) as u8;
                }
            }
        }
        out
    }

    fn max_diff(a: &[u8], b: &[u8]) -> (u8, usize) {
        let d = a.iter().zip(b).map(|(x, y)| x.abs_diff(*y));
        (d.clone().max().unwrap_or(0), d.filter(|&v| v > 0).count())
    }

    /// The fast geometric ops against the f64 reference: every byte within 1 level, on random
    /// noise (the worst case for interpolation error) and smooth images, at random magnitudes,
    /// signs and several sides (odd ones included).
    #[test]
    fn geometric_ops_match_reference() {
        let fill = [124, 116, 104];
        let mut scratch = Vec::new();
        let mut rng = SplitMix::new(11);
        for (t, side) in [224usize, 31, 8, 1, 2, 100, 224, 57].into_iter().enumerate() {
            for op in [Op::Rotate, Op::ShearX, Op::ShearY, Op::TranslateXRel, Op::TranslateYRel] {
                for k in 0..4 {
                    let img = if k % 2 == 0 { random_image(side, t as u64 * 100 + k) } else { photo_like(side, t as u64 * 100 + k) };
                    // Random level in [0, 10], a few exact ones for integral/zero offsets.
                    let m = match k {
                        0 => 10.0,
                        1 => 0.0,
                        _ => rng.f64() * 10.0,
                    };
                    let seed = rng.next_u64();
                    let matrix = geometric(op, m / 10.0, &mut SplitMix::new(seed), side);
                    let want = affine_reference(&img, side, fill, matrix);
                    let mut got = img.clone();
                    apply_op(op, m, false, &mut SplitMix::new(seed), &mut got, side, fill, &mut scratch);
                    let (d, n) = max_diff(&got, &want);
                    assert!(d <= 1, "{op:?} m={m:.3} side={side}: max diff {d} ({n} bytes differ), matrix {matrix:?}");
                }
            }
        }
        // Exact matrices that put pixel centres on the boundary, half-pixel and integral shifts.
        for m in [
            [1.0, 0.0, 3.0, 0.0, 1.0, 0.0],
            [1.0, 0.0, -2.5, 0.0, 1.0, 0.0],
            [1.0, 0.0, 0.0, 0.0, 1.0, 0.5],
            [1.0, 0.0, 0.0, 0.0, 1.0, -7.0],
            [1.0, 0.25, 0.0, 0.0, 1.0, 0.0],
            [1.0, 0.0, 0.0, -0.25, 1.0, 0.0],
            [0.0, -1.0, 16.0, 1.0, 0.0, 0.0],
            [1.0, 0.0, 1.5, 0.0, 1.0, -1.5],
        ] {
            let side = 16;
            let img = random_image(side, 3);
            let want = affine_reference(&img, side, fill, m);
            let mut got = img.clone();
            affine(&mut got, side, fill, &mut scratch, m);
            let (d, n) = max_diff(&got, &want);
            assert!(d <= 1, "{m:?}: max diff {d} ({n} bytes differ)");
        }
    }

    /// Applies `op` at level `m` to a copy of `img` and returns it.
    fn applied(op: Op, m: f64, inc: bool, img: &[u8], side: usize) -> Vec<u8> {
        let mut out = img.to_vec();
        run(op, m, inc, &mut out, side);
        out
    }

    /// Posterize, Solarize and SolarizeAdd on every byte value, at levels whose arguments are
    /// written here from timm's level mappings (`int(4·m/10)` bits kept, increasing `4 −` that;
    /// threshold `int(256·m/10)`, increasing `256 −` that; `int(110·m/10)` added below 128) and
    /// PIL's tables (`ImageOps.posterize` keeps the high bits; `ImageOps.solarize` inverts
    /// values ≥ the threshold).
    #[test]
    fn posterize_and_solarize_follow_timms_levels_on_every_byte() {
        let ramp: Vec<u8> = (0..=255).collect();
        // (level, increasing, bits kept)
        for (m, inc, bits) in [(0.0, false, 0), (2.6, false, 1), (5.0, false, 2), (7.6, false, 3), (10.0, false, 4), (0.0, true, 4), (2.6, true, 3), (7.6, true, 1), (10.0, true, 0), (20.0, false, 8)] {
            let want: Vec<u8> = ramp.iter().map(|&v| if bits == 0 { 0 } else { v - v % (1u16 << (8 - bits)) as u8 }).collect();
            assert_eq!(applied(Op::Posterize, m, inc, &ramp, 0), want, "Posterize m={m} inc={inc}: {bits} bits");
        }
        // (level, increasing, threshold)
        for (m, inc, t) in [(0.0, false, 0u16), (2.5, false, 64), (5.0, false, 128), (10.0, false, 256), (0.0, true, 256), (2.5, true, 192), (10.0, true, 0)] {
            let want: Vec<u8> = ramp.iter().map(|&v| if (v as u16) < t { v } else { 255 - v }).collect();
            assert_eq!(applied(Op::Solarize, m, inc, &ramp, 0), want, "Solarize m={m} inc={inc}: threshold {t}");
        }
        // (level, amount added); the same either way for `inc`.
        for (m, add) in [(0.0, 0u16), (5.0, 55), (10.0, 110), (12.0, 132)] {
            let want: Vec<u8> = ramp.iter().map(|&v| if v < 128 { (v as u16 + add).min(255) as u8 } else { v }).collect();
            for inc in [false, true] {
                assert_eq!(applied(Op::SolarizeAdd, m, inc, &ramp, 0), want, "SolarizeAdd m={m}: +{add}");
            }
        }
        // Invert twice is the identity; once, every value v becomes 255 − v.
        let once = applied(Op::Invert, 3.0, false, &ramp, 0);
        assert!(once.iter().zip(&ramp).all(|(&a, &v)| a == 255 - v));
        assert_eq!(applied(Op::Invert, 3.0, false, &once, 0), ramp);
    }

    /// `ImageOps.autocontrast` and `ImageOps.equalize`, per channel, worked out by hand.
    #[test]
    fn autocontrast_and_equalize_by_hand() {
        // AutoContrast: channel 0 spans [1, 86] (scale 255/85 = 3, offset −3), channel 1
        // [10, 61] (scale 5, offset −50), channel 2 is constant (left alone).
        let px = [1u8, 10, 200, 43, 35, 200, 86, 61, 200];
        assert_eq!(applied(Op::AutoContrast, 5.0, false, &px, 0), [0, 0, 200, 126, 125, 200, 255, 255, 200]);
        // Equalize on 900 pixels. PIL: step = (count − count of the last value) // 255, and
        // value i maps to (step//2 + pixels below i) // step, at most 255.
        // Channel 0: 300 each of 0, 100, 200: step 600//255 = 2; 0 → 1//2 = 0, 100 → 301//2 = 150,
        // 200 → 601//2 = 300 → 255. Channel 1: one value, unchanged. Channel 2: 225 each of
        // 10, 20, 30, 40: step 675//255 = 2; → 0, 226//2 = 113, 451//2 = 225, 676//2 → 255.
        let img: Vec<u8> = (0..900).flat_map(|i| [[0u8, 100, 200][i % 3], 77, [10u8, 20, 30, 40][i % 4]]).collect();
        let got = applied(Op::Equalize, 5.0, false, &img, 30);
        for (i, px) in got.chunks_exact(3).enumerate() {
            assert_eq!(px, [[0u8, 150, 255][i % 3], 77, [0u8, 113, 225, 255][i % 4]], "pixel {i}");
        }
        // Fewer than 255 pixels besides those of the last value: step 0, the identity.
        let small = [5u8, 9, 200, 60, 10, 201, 7, 11, 3, 250, 12, 9];
        assert_eq!(applied(Op::Equalize, 5.0, false, &small, 2), small);
    }

    /// The `ImageEnhance` ops: `Image.blend(degenerate, img, f)` = d + f·(v − d), clipped,
    /// with factor f = 0.1 + 1.8·m/10 (timm): 0.1 at m = 0, 1.9 at m = 10, 1 (the image) at
    /// m = 5 and at m = 0 when increasing (1 ± 0). Degenerate images: black (Brightness), the
    /// mean of the "L" image (299 R + 587 G + 114 B) / 1000 rounded (Contrast), each pixel's
    /// L (Color), PIL's SMOOTH filter rounded, border kept (Sharpness). PIL's `Image.blend`
    /// truncates where this module rounds half up (up to one level apart): every value below has
    /// an exact result whose fraction lies in [0.1, 0.4], where the two agree.
    #[test]
    fn enhance_ops_by_hand() {
        // Brightness: f·v.
        let v = [0u8, 11, 22, 33, 44, 61, 72, 83, 94, 111, 122, 133];
        assert_eq!(applied(Op::Brightness, 0.0, false, &v, 2), [0, 1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13]);
        let v = [0u8, 16, 27, 38, 49, 66, 77, 88, 99, 116, 127, 137];
        assert_eq!(applied(Op::Brightness, 10.0, false, &v, 2), [0, 30, 51, 72, 93, 125, 146, 167, 188, 220, 241, 255]);
        // Contrast: lumas 208, 118, 165, 125 → mean 154; 154 + 0.1·(196 − 154) = 158.2 → 158, …
        let px = [196u8, 238, 85, 215, 75, 85, 56, 238, 75, 16, 198, 35];
        assert_eq!(applied(Op::Contrast, 0.0, false, &px, 2), [158, 162, 147, 160, 146, 147, 144, 162, 146, 140, 158, 142]);
        // lumas 69, 98, 62, 96 → mean 81.25 → 81; 81 + 1.9·(100 − 81) = 117.1 → 117, 81 − 1.9·61 → 0, …
        let px = [100u8, 20, 240, 120, 100, 30, 129, 37, 15, 119, 67, 185];
        assert_eq!(applied(Op::Contrast, 10.0, false, &px, 2), [117, 0, 255, 155, 117, 0, 172, 0, 0, 153, 54, 255]);
        // Color: (0, 140, 130) has L 97 → 97 + 0.1·(0 − 97) = 87.3 → 87, 101.3, 100.3; (5, 145, 135)
        // has L 102.
        assert_eq!(applied(Op::Color, 0.0, false, &[0, 140, 130, 5, 145, 135], 1), [87, 101, 100, 92, 106, 105]);
        // (0, 20, 90): L 22 → 22 − 1.9·22 → 0, 22 − 1.9·2 = 18.2, 22 + 1.9·68 = 151.2; (0, 40, 180): L 44.
        assert_eq!(applied(Op::Color, 10.0, false, &[0, 20, 90, 0, 40, 180], 1), [0, 18, 151, 0, 36, 255]);
        // Sharpness on 3×3: the centre's SMOOTH value (8 neighbours + 5 × centre) / 13, rounded,
        // e.g. channel 0: (1128 + 5·226) / 13 = 173.7 → 174, then 174 + 0.1·(226 − 174) = 179.2.
        let img = [86u8, 104, 210, 42, 209, 177, 246, 72, 40, 157, 218, 167, 226, 246, 162, 252, 120, 139, 162, 227, 228, 47, 155, 184, 136, 199, 9];
        let mut want = img;
        want[12..15].copy_from_slice(&[179, 200, 152]);
        assert_eq!(applied(Op::Sharpness, 0.0, false, &img, 3), want);
        let img = [37u8, 70, 0, 64, 184, 12, 243, 212, 180, 158, 2, 173, 73, 119, 135, 28, 142, 119, 198, 195, 75, 193, 213, 143, 68, 208, 155];
        let mut want = img;
        want[12..15].copy_from_slice(&[45, 100, 150]);
        assert_eq!(applied(Op::Sharpness, 10.0, false, &img, 3), want);
        // Factor 1: every enhance op returns the image, on a fresh random one.
        let seed = hash(&[std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)]);
        let img = random_image(9, seed);
        for op in [Op::Brightness, Op::Contrast, Op::Color, Op::Sharpness] {
            assert_eq!(applied(op, 5.0, false, &img, 9), img, "{op:?} at factor 1 (seed {seed})");
            assert_eq!(applied(op, 0.0, true, &img, 9), img, "{op:?} increasing at level 0 (seed {seed})");
        }
    }

    /// The affine map of each geometric op, against PIL's `Image.rotate` matrix (centre
    /// (S/2, S/2), counter-clockwise degrees) and timm's level mappings: ±30°·m/10, shear
    /// ±0.3·m/10, translate ±0.45·m/10 of the side, each sign drawn.
    #[test]
    fn geometric_matrices_follow_pil_and_timm() {
        // Rotate 30° on side 8: [cos, −sin, 4 − 4 cos + 4 sin, sin, cos, 4 − 4 sin − 4 cos].
        let c = 0.866_025_403_784_438_6;
        let cases: [(Op, f64, usize, [[f64; 6]; 2]); 5] = [
            (Op::Rotate, 1.0, 8, [[c, -0.5, 2.535_898_384_862_245_6, 0.5, c, -1.464_101_615_137_754_4], [c, 0.5, -1.464_101_615_137_754_4, -0.5, c, 2.535_898_384_862_245_6]]),
            (Op::ShearX, 0.5, 8, [[1.0, 0.15, 0.0, 0.0, 1.0, 0.0], [1.0, -0.15, 0.0, 0.0, 1.0, 0.0]]),
            (Op::ShearY, 0.5, 8, [[1.0, 0.0, 0.0, 0.15, 1.0, 0.0], [1.0, 0.0, 0.0, -0.15, 1.0, 0.0]]),
            (Op::TranslateXRel, 1.0, 8, [[1.0, 0.0, 3.6, 0.0, 1.0, 0.0], [1.0, 0.0, -3.6, 0.0, 1.0, 0.0]]),
            (Op::TranslateYRel, 0.5, 10, [[1.0, 0.0, 0.0, 0.0, 1.0, 2.25], [1.0, 0.0, 0.0, 0.0, 1.0, -2.25]]),
        ];
        for (op, l, side, want) in cases {
            let mut seen = [0usize; 2];
            for seed in 0..64 {
                let m = geometric(op, l, &mut SplitMix::new(seed), side);
                let k = want.iter().position(|w| w.iter().zip(&m).all(|(a, b)| (a - b).abs() < 1e-12));
                let k = k.unwrap_or_else(|| panic!("{op:?} l={l}: {m:?} is neither of {want:?}"));
                seen[k] += 1;
            }
            assert!(seen[0] > 10 && seen[1] > 10, "{op:?}: signs drawn {seen:?} times of 64");
        }
    }

    /// PIL's bilinear `AFFINE` on 3×3 images, by hand: output pixel centre (x + ½, y + ½) reads
    /// input (a·x' + b·y' + c, d·x' + e·y' + f) between the two nearest pixel centres, past the
    /// edge the edge pixel; outside the image, the fill. Rows of [10, 110, 50] (channel k adds
    /// 20·k): a quarter-pixel shift right reads ¾·10 + ¼·110 = 35, ¾·110 + ¼·50 = 95, then 50.
    #[test]
    fn affine_by_hand() {
        let fill = [1u8, 2, 3];
        let px = |v: u8| [v, v + 20, v + 40];
        let rows = |r: [[u8; 3]; 3]| -> Vec<u8> { r.iter().flat_map(|row| row.iter().flat_map(|&v| if v == 0 { fill } else { px(v) })).collect() };
        let transposed = |r: [[u8; 3]; 3]| rows(std::array::from_fn(|y| std::array::from_fn(|x| r[x][y])));
        let src = rows([[10, 110, 50]; 3]);
        let mut scratch = Vec::new();
        let warp = |img: &[u8], m: [f64; 6], scratch: &mut Vec<u8>| {
            let mut out = img.to_vec();
            affine(&mut out, 3, fill, scratch, m);
            out
        };
        // 0 marks the fill.
        assert_eq!(warp(&src, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0], &mut scratch), rows([[110, 50, 0]; 3]));
        assert_eq!(warp(&src, [1.0, 0.0, -1.0, 0.0, 1.0, 0.0], &mut scratch), rows([[0, 10, 110]; 3]));
        assert_eq!(warp(&src, [1.0, 0.0, 0.25, 0.0, 1.0, 0.0], &mut scratch), rows([[35, 95, 50]; 3]));
        assert_eq!(warp(&src, [1.0, 0.0, -0.25, 0.0, 1.0, 0.0], &mut scratch), rows([[10, 85, 65]; 3]));
        // ShearX 0.5: row y shifts by 0.5·(y + ½) = ¼, ¾, 1¼.
        let sheared = rows([[35, 95, 50], [85, 65, 0], [95, 50, 0]]);
        assert_eq!(warp(&src, [1.0, 0.5, 0.0, 0.0, 1.0, 0.0], &mut scratch), sheared);
        // The same down the columns: TranslateY and ShearY.
        let src_t = transposed([[10, 110, 50]; 3]);
        assert_eq!(warp(&src_t, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0], &mut scratch), transposed([[110, 50, 0]; 3]));
        assert_eq!(warp(&src_t, [1.0, 0.0, 0.0, 0.0, 1.0, -1.0], &mut scratch), transposed([[0, 10, 110]; 3]));
        assert_eq!(warp(&src_t, [1.0, 0.0, 0.0, 0.0, 1.0, 0.25], &mut scratch), transposed([[35, 95, 50]; 3]));
        assert_eq!(warp(&src_t, [1.0, 0.0, 0.0, 0.5, 1.0, 0.0], &mut scratch), transposed([[35, 95, 50], [85, 65, 0], [95, 50, 0]]));
        // Rotations by 90° (PIL's matrix for +90°: [0, −1, 3, 1, 0, 0]), −90° and 180° move
        // whole pixels: counter-clockwise, output (y, x) is input (x, 2 − y).
        let img: Vec<u8> = (0..9u8).flat_map(|i| px(10 * i + 5)).collect();
        let at = |r: usize, c: usize| px(10 * (3 * r + c) as u8 + 5);
        let moved = |f: &dyn Fn(usize, usize) -> (usize, usize)| -> Vec<u8> { (0..9).flat_map(|i| { let (r, c) = f(i / 3, i % 3); at(r, c) }).collect() };
        assert_eq!(warp(&img, [0.0, -1.0, 3.0, 1.0, 0.0, 0.0], &mut scratch), moved(&|y, x| (x, 2 - y)));
        assert_eq!(warp(&img, [0.0, 1.0, 0.0, -1.0, 0.0, 3.0], &mut scratch), moved(&|y, x| (2 - x, y)));
        assert_eq!(warp(&img, [-1.0, 0.0, 3.0, 0.0, -1.0, 3.0], &mut scratch), moved(&|y, x| (2 - y, 2 - x)));
    }

    /// The SSE2 blend and its scalar tail are the same arithmetic: byte-identical results.
    #[test]
    fn lerp_bytes_vector_equals_scalar() {
        let n = 16 * 9 + 7;
        let (p, q) = (random_image(8, 1), random_image(8, 2));
        let (p, q) = (&p[..n], &q[..n]);
        for w16 in [1u32, 2, 255, 256, 32767, 32768, 40000, 65535] {
            let mut got = vec![0u8; n];
            lerp_bytes(&mut got, p, q, w16);
            for i in 0..n {
                let a = ((p[i] as u32 * 256) * (65536 - w16)) >> 16;
                let b = ((q[i] as u32 * 256) * w16) >> 16;
                assert_eq!(got[i] as u32, (a + b + 129) >> 8, "w16={w16} i={i}");
                let exact = (p[i] as f64 * (65536 - w16) as f64 + q[i] as f64 * w16 as f64) / 65536.0;
                assert!((got[i] as f64 - exact).abs() <= 0.51, "w16={w16} i={i}: {} vs {exact}", got[i]);
            }
        }
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
        // AutoContrast stretches [50, 150] to [0, 255] per channel.
        let mut px = vec![50u8, 50, 50, 150, 150, 150, 100, 100, 100];
        run(Op::AutoContrast, 0.0, false, &mut px, 0);
        assert_eq!(px, [0, 0, 0, 255, 255, 255, 127, 127, 127]);
    }

    /// Increasing Posterize keeps `4 − int(4·m/10)` bits (timm), which is negative past level
    /// 12.5 (reachable with `mmax` above it): PIL's mask then clears every bit.
    #[test]
    fn increasing_posterize_past_level_12_5_keeps_no_bits() {
        let ramp: Vec<u8> = (0..=255).collect();
        for m in [12.5, 15.0, 20.0] {
            let mut px = ramp.clone();
            run(Op::Posterize, m, true, &mut px, 0);
            assert!(px.iter().all(|&v| v == 0), "m={m}: {px:?}");
        }
        // The non-increasing mapping at level 20 keeps int(4·2) = 8 bits: the image.
        let mut px = ramp.clone();
        run(Op::Posterize, 20.0, false, &mut px, 0);
        assert_eq!(px, ramp);
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

    /// Per-op cost on a 224-px image, the best of 7 rounds of 20 calls (less sensitive to
    /// other load on the machine) (`cargo test --release --lib op_timings -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn op_timings() {
        let side = 224;
        let src: Vec<u8> = (0..side * side * 3).map(|i| (i * 31 % 251) as u8).collect();
        let mut scratch = Vec::new();
        for op in OPS {
            let mut best = f64::INFINITY;
            for round in 0..7 {
                let mut img = src.clone();
                let t = std::time::Instant::now();
                for k in 0..20 {
                    let mut rng = SplitMix::new(round * 100 + k);
                    apply_op(op, 9.0, true, &mut rng, &mut img, side, [124, 116, 104], &mut scratch);
                }
                best = best.min(t.elapsed().as_secs_f64() * 1e3 / 20.0);
            }
            eprintln!("{op:?}: {best:.3} ms");
        }
    }
}
