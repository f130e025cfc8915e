//! Resampling for images whose stored size is not the model's: RandomResizedCrop (training) and
//! resize + center crop (evaluation), as timm builds them with torchvision, fused with the
//! flip, HWC→CHW and normalization so each output pixel is written once.
//!
//! The filters are PIL's antialiased ones, whose support widens with the downscale factor, as
//! torchvision's `Resize` applies them to PIL images (`data.interpolation`): bilinear (a
//! triangle of radius 1) or bicubic (Keys' cubic with a = −0.5, radius 2); plain 2-tap
//! bilinear would alias badly when a 500-px photo becomes 224 px. Weights are computed per
//! output row/column once per image and the filter runs as two separable passes. Bicubic's
//! negative lobes can overshoot 0..=255; PIL stores the horizontal pass and the result as
//! bytes, clipping both, so the bicubic path clamps at the same two points (bilinear never
//! leaves the range). Both passes run in fixed point, as PIL's do, but PIL *rounds* to bytes in
//! between while this keeps 7 fractional bits there and hands f32 rows out: within a fortieth of
//! a level of the exact filter and within one level of PIL's bytes (tested against an exact
//! evaluation and against a transcription of PIL's `ImagingResample`).

use std::cell::RefCell;
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::__m256i;

use super::rng::{hash, stream, SplitMix};
use crate::config::Interpolation;

/// A crop window in source pixels (may be fractional).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Region {
    pub x0: f32,
    pub y0: f32,
    pub w: f32,
    pub h: f32,
}

/// torchvision's `RandomResizedCrop.get_params`: up to 10 tries of a random area fraction in
/// `scale` and log-uniform aspect ratio in `ratio` that fits; else a center crop clamped to the
/// ratio range. Integer window, as torchvision returns.
pub fn random_resized_crop(rng: &mut SplitMix, width: usize, height: usize, scale: [f64; 2], ratio: [f64; 2]) -> Region {
    let (wf, hf) = (width as f64, height as f64);
    let area = wf * hf;
    let (lr0, lr1) = (ratio[0].ln(), ratio[1].ln());
    for _ in 0..10 {
        let target = area * (scale[0] + (scale[1] - scale[0]) * rng.f32() as f64);
        let aspect = (lr0 + (lr1 - lr0) * rng.f32() as f64).exp();
        let w = (target * aspect).sqrt().round();
        let h = (target / aspect).sqrt().round();
        if w > 0.0 && h > 0.0 && w <= wf && h <= hf {
            let (w, h) = (w as usize, h as usize);
            let y0 = rng.below((height - h + 1) as u64) as usize;
            let x0 = rng.below((width - w + 1) as u64) as usize;
            return Region { x0: x0 as f32, y0: y0 as f32, w: w as f32, h: h as f32 };
        }
    }
    let in_ratio = wf / hf;
    let (w, h) = if in_ratio < ratio[0] {
        (wf, (wf / ratio[0]).round())
    } else if in_ratio > ratio[1] {
        ((hf * ratio[1]).round(), hf)
    } else {
        (wf, hf)
    };
    let (w, h) = (w.clamp(1.0, wf), h.clamp(1.0, hf));
    Region { x0: ((wf - w) / 2.0).floor() as f32, y0: ((hf - h) / 2.0).floor() as f32, w: w as f32, h: h as f32 }
}

/// timm's eval transform, `Resize(floor(side / crop_pct))` + `CenterCrop(side)`, with
/// torchvision's whole-pixel geometry, as one window of the source: the shorter side is resized
/// to S = floor(side / crop_pct) and the longer to int(S · long / short) (each axis its own
/// scale), and the crop starts at round((resized − side) / 2) (Python's round: halves to even).
/// Resampling that window to side × side reads the source where resizing the whole image and
/// cropping would.
pub fn center_crop(width: usize, height: usize, side: usize, crop_pct: f64) -> Region {
    let s = (side as f64 / crop_pct).floor().max(side as f64);
    let (short, long) = (width.min(height) as f64, width.max(height) as f64);
    let long_resized = (s * long / short).floor().max(side as f64);
    let (rw, rh) = if width <= height { (s, long_resized) } else { (long_resized, s) };
    let left = ((rw - side as f64) / 2.0).round_ties_even();
    let top = ((rh - side as f64) / 2.0).round_ties_even();
    let (sx, sy) = (width as f64 / rw, height as f64 / rh);
    Region { x0: (left * sx) as f32, y0: (top * sy) as f32, w: (side as f64 * sx) as f32, h: (side as f64 * sy) as f32 }
}

/// The random draws of a training image from a non-native size: window and flip, keyed like
/// every augmentation by (seed, epoch, dataset index).
pub fn draw_rrc(seed: u64, epoch: u64, index: usize, width: usize, height: usize, scale: [f64; 2], ratio: [f64; 2]) -> (Region, bool) {
    let mut rng = SplitMix::new(hash(&[seed, stream::AUGMENT, epoch, index as u64]));
    let r = random_resized_crop(&mut rng, width, height, scale, ratio);
    (r, rng.coin())
}

/// PIL's bicubic kernel (Keys' cubic convolution, a = −0.5; zero from |x| = 2 on).
#[inline(always)]
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Fractional bits of the horizontal pass's output (a byte value ·2^7 in an i16), and its
/// largest value: 255 at that scale. 1/128 of a level is far below what the filters resolve.
const MID_BITS: u32 = 7;
const MID_MAX: i32 = 255 << MID_BITS;

/// Filter taps of one axis in fixed point, for the integer passes: output i reads source
/// indices `start[i]..start[i] + len[i]` with weights `weights[i * n..][..len[i]]` (zero past
/// len), each a weight times 2^`bits` rounded to an i16, with the rounding residual added to the
/// output's largest weight so that every output's weights still sum to exactly 2^`bits` (a flat
/// image stays flat). `n` is the widest tap count rounded up to even (the vector passes take
/// taps in pairs). Zero-weight taps at the ends are trimmed so the inner loops do no useless work.
struct FixedTaps {
    start: Vec<usize>,
    len: Vec<usize>,
    n: usize,
    bits: u32,
    weights: Vec<i16>,
}

/// Outputs whose weights [`fixed_taps`] computes side by side, tap by tap: loops over a group's
/// lanes that the compiler turns into vector instructions.
const GROUP: usize = 8;

/// The filter of [`fixed_taps`] on one axis: output i is centred at r0 + (i + ½)·scale and
/// reads the pixels within `support` of it.
#[derive(Clone, Copy)]
struct Axis {
    src_len: usize,
    r0: f32,
    rlen: f32,
    out_len: usize,
    /// The widest tap count: 2·ceil(support) + 1.
    n: usize,
}

/// The pixels lo..hi an output reads, from the floor of its window's start and the ceiling of its
/// end: `lo = min(max(start, 0) as usize, src_len − 1)`, `hi = min(clamp(max(end, 0) as usize,
/// lo + 1, src_len), lo + n)`, the casts saturating. In i32, clamped as floats first (NaN to 0,
/// as the casts take it), so that the compiler vectorizes the conversions; `fixed_taps` keeps
/// `src_len` below 2^31.
#[inline(always)]
fn window(axis: Axis, start: f64, end: f64) -> (i32, i32) {
    let (len, n) = (axis.src_len as i32, axis.n as i32);
    // SAFETY: max maps NaN to 0 and min bounds the value: both are numbers in 0..=src_len.
    let (a, b) = unsafe { (start.max(0.0).min((len - 1) as f64).to_int_unchecked::<i32>(), end.max(0.0).min(len as f64).to_int_unchecked::<i32>()) };
    (a, b.max(a + 1).min(len).min(a + n))
}

/// Bilinear weights of outputs i0..i0 + GROUP, normalized in f32 (what the bilinear outputs are
/// pinned to): `w[k · GROUP + l]` is tap k of output i0 + l (zero from its tap count m on),
/// which reads pixel lo + k. Returns lo and m per output.
#[inline(always)]
fn bilinear_group(axis: Axis, i0: usize, w: &mut [f32]) -> ([i32; GROUP], [i32; GROUP]) {
    let scale = axis.rlen / axis.out_len as f32;
    let fscale = scale.max(1.0);
    let support = fscale;
    let (mut center, mut lo, mut m) = ([0f32; GROUP], [0i32; GROUP], [0i32; GROUP]);
    for l in 0..GROUP {
        let c = axis.r0 + ((i0 + l) as i32 as f32 + 0.5) * scale;
        let (a, b) = window(axis, (c - support).floor() as f64, (c + support).ceil() as f64);
        (center[l], lo[l], m[l]) = (c, a, b - a);
    }
    let mut sum = [0f32; GROUP];
    for (k, row) in w.chunks_exact_mut(GROUP).enumerate() {
        for l in 0..GROUP {
            // (lo + k as f32 is the pixel index's own conversion: the same integer below 2^31.)
            let x = (1.0 - (((lo[l] + k as i32) as f32 + 0.5 - center[l]) / fscale).abs()).max(0.0);
            row[l] = if (k as i32) < m[l] { x } else { 0.0 };
            sum[l] += row[l];
        }
    }
    for l in 0..GROUP {
        if sum[l] <= 0.0 {
            // Window entirely outside the image (can't happen for valid regions): nearest pixel.
            w[l] = 1.0;
            sum[l] = 1.0;
        }
    }
    for row in w.chunks_exact_mut(GROUP) {
        for l in 0..GROUP {
            row[l] /= sum[l];
        }
    }
    (lo, m)
}

/// Bicubic weights of outputs i0..i0 + GROUP as [`bilinear_group`]'s, following PIL's
/// `precompute_coeffs` in f64 (`k64`: n · GROUP scratch values) and stored as f32.
#[inline(always)]
fn bicubic_group(axis: Axis, i0: usize, w: &mut [f32], k64: &mut [f64]) -> ([i32; GROUP], [i32; GROUP]) {
    let scale = axis.rlen as f64 / axis.out_len as f64;
    let fscale = scale.max(1.0);
    let (support, ss) = (2.0 * fscale, 1.0 / fscale);
    let (mut center, mut lo, mut m) = ([0f64; GROUP], [0i32; GROUP], [0i32; GROUP]);
    for l in 0..GROUP {
        let c = axis.r0 as f64 + ((i0 + l) as i32 as f64 + 0.5) * scale;
        let (a, b) = window(axis, (c - support).floor(), (c + support).ceil());
        (center[l], lo[l], m[l]) = (c, a, b - a);
    }
    let mut sum = [0f64; GROUP];
    for (k, row) in k64.chunks_exact_mut(GROUP).enumerate() {
        for l in 0..GROUP {
            let x = bicubic(((lo[l] + k as i32) as f64 + 0.5 - center[l]) * ss);
            row[l] = if (k as i32) < m[l] { x } else { 0.0 };
            sum[l] += row[l];
        }
    }
    for l in 0..GROUP {
        if sum[l] == 0.0 {
            // Window entirely outside the image (can't happen for valid regions).
            k64[l] = 1.0;
            sum[l] = 1.0;
        }
    }
    for (row, kr) in w.chunks_exact_mut(GROUP).zip(k64.chunks_exact(GROUP)) {
        for l in 0..GROUP {
            row[l] = (kr[l] / sum[l]) as f32;
        }
    }
    (lo, m)
}

/// The taps of `out_len` outputs over the window [r0, r0 + rlen) of an axis of `src_len` pixels
/// with `filter`: PIL's antialiased filters (the kernel of radius 1 (bilinear) or 2 (bicubic)
/// output pixels, widened by the downscale factor), normalized per output, then quantized with
/// the most fractional bits (at most `max_bits`, at least `min_bits`) for which every weight,
/// after the residual, fits an i16 and no output's sum of |weight| × `input_max` can leave an
/// i32: the precision adapts to the filter, so a strong downscale (many small weights) keeps as
/// many significant bits per weight as a copy does.
#[allow(clippy::too_many_arguments)]
fn fixed_taps(src_len: usize, r0: f32, rlen: f32, out_len: usize, filter: Interpolation, max_bits: u32, min_bits: u32, input_max: f64) -> FixedTaps {
    #[cfg(target_arch = "x86_64")]
    if simd() != Simd::Scalar {
        #[target_feature(enable = "avx2")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn wide(src_len: usize, r0: f32, rlen: f32, out_len: usize, filter: Interpolation, max_bits: u32, min_bits: u32, input_max: f64) -> FixedTaps {
            fixed_taps_on(src_len, r0, rlen, out_len, filter, max_bits, min_bits, input_max)
        }
        // SAFETY: simd() checked the CPU for AVX2.
        return unsafe { wide(src_len, r0, rlen, out_len, filter, max_bits, min_bits, input_max) };
    }
    fixed_taps_on(src_len, r0, rlen, out_len, filter, max_bits, min_bits, input_max)
}

/// [`fixed_taps`], inlined into its callers so that each compiles it for its own target
/// features: the same arithmetic, elementwise IEEE operations in the same order, either way.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn fixed_taps_on(src_len: usize, r0: f32, rlen: f32, out_len: usize, filter: Interpolation, max_bits: u32, min_bits: u32, input_max: f64) -> FixedTaps {
    let scale = rlen / out_len as f32;
    let support = match filter {
        Interpolation::Bilinear => scale.max(1.0),
        Interpolation::Bicubic => 2.0 * scale.max(1.0),
    };
    let n = (support.ceil() as usize) * 2 + 1;
    assert!(src_len > 0 && src_len < 1 << 31, "an axis of {src_len} pixels");
    let axis = Axis { src_len, r0, rlen, out_len, n };
    let groups = out_len.div_ceil(GROUP);
    // Each group's weights, tap-major, its outputs' first pixels, and the range of taps kept
    // when zero weights at the ends are trimmed.
    let mut w = vec![0f32; groups * n * GROUP];
    let mut k64 = vec![0f64; if filter == Interpolation::Bicubic { n * GROUP } else { 0 }];
    let (mut lo, mut first, mut last) = (vec![0i32; groups * GROUP], vec![0i32; groups * GROUP], vec![0i32; groups * GROUP]);
    // The largest |weight| (in f32, exactly the f64 of the largest) and the largest sum of one
    // output's |weights|, summed in f64 in tap order.
    let (mut max_w, mut max_abs_sum) = (0f32, 0f64);
    for g in 0..groups {
        let wg = &mut w[g * n * GROUP..(g + 1) * n * GROUP];
        let (lo_g, _) = match filter {
            Interpolation::Bilinear => bilinear_group(axis, g * GROUP, wg),
            Interpolation::Bicubic => bicubic_group(axis, g * GROUP, wg, &mut k64),
        };
        let valid = (out_len - g * GROUP).min(GROUP);
        let (mut abs_sum, mut big) = ([0f64; GROUP], [0f32; GROUP]);
        let (mut lo_nz, mut hi_nz) = ([i32::MAX; GROUP], [0i32; GROUP]);
        for (k, row) in wg.chunks_exact(GROUP).enumerate() {
            for l in 0..GROUP {
                let a = row[l].abs();
                // (A comparison keeps the maximum where f64::max did: a NaN never replaces it.)
                big[l] = if a > big[l] { a } else { big[l] };
                abs_sum[l] += a as f64;
                let nonzero = row[l] != 0.0;
                lo_nz[l] = if nonzero { lo_nz[l].min(k as i32) } else { lo_nz[l] };
                hi_nz[l] = if nonzero { k as i32 + 1 } else { hi_nz[l] };
            }
        }
        for l in 0..valid {
            max_w = if big[l] > max_w { big[l] } else { max_w };
            max_abs_sum = if abs_sum[l] > max_abs_sum { abs_sum[l] } else { max_abs_sum };
            let i = g * GROUP + l;
            lo[i] = lo_g[l];
            // Without a nonzero weight, one tap is kept.
            (first[i], last[i]) = if lo_nz[l] == i32::MAX { (0, 1) } else { (lo_nz[l], hi_nz[l]) };
        }
    }
    let max_w = max_w as f64;
    let fits = |bits: u32| {
        let s = (1u64 << bits) as f64;
        // Margins: the residual moves one weight by at most n/2 units, and the vector passes add
        // pairs of products, which the i32 bound covers.
        max_w * s + n as f64 <= i16::MAX as f64 && (max_abs_sum * s + n as f64) * input_max <= i32::MAX as f64 * 0.99
    };
    let mut bits = max_bits;
    while bits > min_bits && !fits(bits) {
        bits -= 1;
    }
    let scale = (1u64 << bits) as f64;
    let stride = n + (n & 1);
    let (mut start, mut len) = (vec![0usize; out_len], vec![0usize; out_len]);
    let mut weights = vec![0i16; out_len * stride];
    let mut q = vec![0i16; n * GROUP];
    for g in 0..groups {
        let i0 = g * GROUP;
        let (first, last) = (&first[i0..i0 + GROUP], &last[i0..i0 + GROUP]);
        // Each weight rounded half away from zero, as f64::round, without its library call (the
        // cast truncates; in range by `fits`: |x|·2^bits + n ≤ i16::MAX, unless even min_bits
        // does not fit, where the cast saturates); per output the sum and the first of the kept
        // taps with the largest magnitude.
        let (mut sum, mut big, mut best) = ([0i32; GROUP], [0i32; GROUP], [-1i32; GROUP]);
        for (k, (qr, wr)) in q.chunks_exact_mut(GROUP).zip(w[g * n * GROUP..].chunks_exact(GROUP)).enumerate() {
            let k = k as i32;
            let mut v = [0f64; GROUP];
            for l in 0..GROUP {
                let x = wr[l] as f64 * scale;
                v[l] = x + 0.5f64.copysign(x);
            }
            // `v as i16`, which saturates and takes NaN to 0, in steps the compiler vectorizes.
            let mut qk = [0i32; GROUP];
            for l in 0..GROUP {
                let c = v[l].clamp(i16::MIN as f64, i16::MAX as f64);
                let c = if v[l].is_nan() { 0.0 } else { c };
                // SAFETY: c is a number within i16's range, so the truncation is too.
                qk[l] = unsafe { c.to_int_unchecked::<i32>() };
            }
            for l in 0..GROUP {
                qr[l] = qk[l] as i16;
                sum[l] += qk[l];
                let a = qk[l].abs();
                let larger = (k >= first[l]) & (k < last[l]) & (a > best[l]);
                big[l] = if larger { k } else { big[l] };
                best[l] = if larger { a } else { best[l] };
            }
        }
        for l in 0..(out_len - i0).min(GROUP) {
            let i = i0 + l;
            let (f, t) = (first[l] as usize, last[l] as usize);
            start[i] = lo[i] as usize + f;
            len[i] = t - f;
            let row = &mut weights[i * stride..i * stride + t - f];
            for (k, o) in row.iter_mut().enumerate() {
                *o = q[(f + k) * GROUP + l];
            }
            row[big[l] as usize - f] += ((1i32 << bits) - sum[l]) as i16;
        }
    }
    FixedTaps { start, len, n: stride, bits, weights }
}

thread_local! {
    // Scratch buffers per worker thread, reused across images.
    static SCRATCH: RefCell<Scratch> = const { RefCell::new(Scratch::new()) };
}

/// [`resample_rows_on`]'s buffers: a padded copy of a source row where reading in place could
/// run past the image, the vector horizontal pass's expanded source row, the horizontal-pass
/// rows, the scalar vertical pass's pixel row, and one output row as three planes where the
/// destination is not a CHW buffer.
struct Scratch {
    padded: Vec<u8>,
    expanded: Vec<i16>,
    tmp: Vec<i16>,
    acc: Vec<f32>,
    planes: Vec<f32>,
}

impl Scratch {
    const fn new() -> Self {
        Scratch { padded: Vec::new(), expanded: Vec::new(), tmp: Vec::new(), acc: Vec::new(), planes: Vec::new() }
    }
}

/// `len` values of `buf` from a 64-byte boundary on, so that fewer of the vector passes' loads
/// and stores straddle two cache lines. `buf` only grows: values it held stay (zero where it
/// grew), so a buffer that is written before it is read costs no clearing per image.
fn aligned(buf: &mut Vec<i16>, len: usize) -> &mut [i16] {
    if buf.len() < len + 32 {
        buf.resize(len + 32, 0);
    }
    let at = buf.as_ptr().align_offset(64).min(32);
    &mut buf[at..at + len]
}

/// Pixels of the scalar passes' horizontal-pass rows and vertical-pass output are 4 lanes (R, G,
/// B and an unused 0).
const LANES: usize = 4;

/// One output column's horizontal taps: first source pixel (relative to the row span), tap
/// count, offset of its weights.
#[derive(Clone, Copy)]
struct Col {
    start: usize,
    len: usize,
    w: usize,
}

/// Horizontal pass of one source row `row` (RGB bytes from the span's first column):
/// `out[4j + c] = clamp(round(Σ_k w_k · row[3(start + k) + c] / 2^(bits − MID_BITS)), 0,
/// MID_MAX)` for output column j, and `out[4j + 3] = 0`. Integer arithmetic, so every code path
/// gives the same values.
fn hpass_fixed(row: &[u8], cols: &[Col], weights: &[i16], bits: u32, out: &mut [i16]) {
    let shift = bits - MID_BITS;
    let half = 1i32 << (shift - 1);
    for (px, c) in out.chunks_exact_mut(LANES).zip(cols) {
        let mut acc = [0i32; 3];
        for (k, &wk) in weights[c.w..c.w + c.len].iter().enumerate() {
            let p = &row[3 * (c.start + k)..3 * (c.start + k) + 3];
            for ch in 0..3 {
                acc[ch] += wk as i32 * p[ch] as i32;
            }
        }
        for ch in 0..3 {
            px[ch] = ((acc[ch] + half) >> shift).clamp(0, MID_MAX) as i16;
        }
        px[3] = 0;
    }
}

/// The code paths the CPU allows: the scalar passes, AVX2, or AVX2 with AVX-512 (F, BW, VL and
/// VNNI), which expands source rows four pixels per shuffle and multiplies and accumulates in
/// one instruction (`vpdpwssd`, on 256-bit vectors). All give the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Simd {
    Scalar,
    Avx2,
    Avx512,
}

/// The fastest [`Simd`] level of this CPU.
fn simd() -> Simd {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx512vnni")
        {
            return Simd::Avx512;
        }
        if std::is_x86_feature_detected!("avx2") {
            return Simd::Avx2;
        }
    }
    Simd::Scalar
}

/// Output pixels per block of the vector passes' horizontal-pass rows. A block is 48 i16 values,
/// three 256-bit vectors: (R0..R3, G0..G3 | R4..R7, G4..G7) of its pixels 0–7, the same of
/// pixels 8–15, then (B0..B3, B8..B11 | B4..B7, B12..B15). The vertical pass's unpacking within
/// 128-bit lanes turns each of the three into two vectors of one channel's 8 consecutive pixels,
/// ready for the CHW planes: neither pass computes an unused fourth lane, and the output needs
/// no transposition.
const BLOCK: usize = 16;
const BLOCK_VALUES: usize = 3 * BLOCK;

/// i16 values per source pixel of the expanded rows ([`expand_avx2`]): (R_s, R_s+1, G_s,
/// G_s+1, B_s, B_s+1, 0, 0) for pixel s, so that a 128-bit load at pixel s holds a pair of taps
/// of all three channels, ready for a multiply-add.
const ENTRY: usize = 8;

/// Expands the source bytes `row` (RGB from the span's first column) into `e.len() / ENTRY`
/// entries, an even count, of the layout above: one shuffle per two entries.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn expand_avx2(row: &[u8], e: &mut [i16]) {
    use std::arch::x86_64::*;
    let count = e.len() / ENTRY;
    // The last two entries start at pixel count − 2 and load 16 bytes from there.
    assert!(e.len().is_multiple_of(2 * ENTRY) && (count == 0 || row.len() >= 3 * count + 10));
    // 16 bytes from pixel s in both lanes: entry s from the low lane, s + 1 from the high one.
    let ctrl = _mm256_setr_epi8(0, -128, 3, -128, 1, -128, 4, -128, 2, -128, 5, -128, -128, -128, -128, -128, 3, -128, 6, -128, 4, -128, 7, -128, 5, -128, 8, -128, -128, -128, -128, -128);
    let mut s = 0;
    while s < count {
        // SAFETY: bytes 3s..3s + 16 are inside `row` and values ENTRY·s..ENTRY·(s + 2) inside
        // `e` (assertion above); AVX2 is enabled for this function.
        unsafe {
            let v = _mm256_broadcastsi128_si256(_mm_loadu_si128(row.as_ptr().add(3 * s) as *const __m128i));
            _mm256_storeu_si256(e.as_mut_ptr().add(ENTRY * s) as *mut __m256i, _mm256_shuffle_epi8(v, ctrl));
        }
        s += 2;
    }
}

/// [`expand_avx2`] with AVX-512: four entries per shuffle, from one 16-byte load; the entry
/// count is a multiple of four.
///
/// # Safety
/// The CPU has AVX-512F and AVX-512BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn expand_avx512(row: &[u8], e: &mut [i16]) {
    use std::arch::x86_64::*;
    let count = e.len() / ENTRY;
    // The last four entries start at pixel count − 4 and load 16 bytes from there.
    assert!(e.len().is_multiple_of(4 * ENTRY) && (count == 0 || row.len() >= 3 * count + 4));
    // 16 bytes from pixel s in all four lanes: entry s + j from lane j (pixels s + j and
    // s + j + 1, bytes 3j..3j + 6).
    let ctrl = _mm512_set_epi8(
        -128, -128, -128, -128, -128, 14, -128, 11, -128, 13, -128, 10, -128, 12, -128, 9, //
        -128, -128, -128, -128, -128, 11, -128, 8, -128, 10, -128, 7, -128, 9, -128, 6, //
        -128, -128, -128, -128, -128, 8, -128, 5, -128, 7, -128, 4, -128, 6, -128, 3, //
        -128, -128, -128, -128, -128, 5, -128, 2, -128, 4, -128, 1, -128, 3, -128, 0,
    );
    let mut s = 0;
    while s < count {
        // SAFETY: bytes 3s..3s + 16 are inside `row` and values ENTRY·s..ENTRY·(s + 4) inside
        // `e` (assertion above); AVX-512F and BW are enabled for this function.
        unsafe {
            let v = _mm512_broadcast_i32x4(_mm_loadu_si128(row.as_ptr().add(3 * s) as *const __m128i));
            _mm512_storeu_si512(e.as_mut_ptr().add(ENTRY * s) as *mut __m512i, _mm512_shuffle_epi8(v, ctrl));
        }
        s += 4;
    }
}

/// The vector passes' multiply-accumulate, `acc + madd(a, b)`: pairs of i16 products summed
/// into i32 lanes, added with wrapping. [`Madd`] takes a multiply-add and an add (AVX2),
/// [`Vnni`] one `vpdpwssd`; the sums are the same bits.
#[cfg(target_arch = "x86_64")]
trait Dot {
    /// Whether the accumulation is free, so that a sum may as well start from a bias.
    const FUSED: bool;
    /// # Safety
    /// The CPU has the instructions (the caller's target features).
    unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;
}

#[cfg(target_arch = "x86_64")]
struct Madd;

#[cfg(target_arch = "x86_64")]
impl Dot for Madd {
    const FUSED: bool = false;
    #[inline(always)]
    unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        use std::arch::x86_64::*;
        // SAFETY: AVX2 is the caller's part.
        unsafe { _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)) }
    }
}

#[cfg(target_arch = "x86_64")]
struct Vnni;

#[cfg(target_arch = "x86_64")]
impl Dot for Vnni {
    const FUSED: bool = true;
    #[inline(always)]
    unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
        // SAFETY: AVX-512 VNNI and VL are the caller's part.
        unsafe { std::arch::x86_64::_mm256_dpwssd_epi32(acc, a, b) }
    }
}

/// [`hpass_fixed`] with 256-bit vectors on a source row expanded by [`expand_avx2`], into
/// [`BLOCK`] layout. Columns j and j + 4 of each eight share a vector, one per lane, so that a
/// multiply-add takes a pair of taps of two columns and the lanes need no adding up. Each such
/// pair of columns is a record in `records`, in the order the loop takes them ([`PAIR_HEAD`]
/// values, then `p` tap pairs of 16): the two columns' first pixels in the expanded row as
/// pointers, then for tap pair t, (w_2t, w_2t+1) three times and two zeros for column j, the
/// same for column j + 4 (zero past a column's tap count). One pointer walks the records, so that
/// every load addresses memory from one register and stays a single micro-op. Eight columns'
/// sums are then transposed to channel vectors and rounded to MID_BITS as the scalar pass does,
/// clamped to 0..=MID_MAX when `CLAMP` (without negative weights the sums cannot leave that
/// range). `P` is `p` when known at compile time, else 0. Called through [`hpass_avx2`] and
/// [`hpass_avx512`].
///
/// # Safety
/// The CPU has AVX2 and what `D` needs; `records` starts 8-byte aligned, and each record's
/// pointers point at ENTRY · (2p − 1) values that may be read (the last tap pair starts 2p − 2
/// pixels on).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hpass_vec<D: Dot, const P: usize, const CLAMP: bool>(records: &[i16], p: usize, bits: u32, out: &mut [i16]) {
    use std::arch::x86_64::*;
    let p = if P > 0 { P } else { p };
    let record = PAIR_HEAD + 16 * p;
    let blocks = records.len() / (BLOCK / 2 * record);
    assert!(p > 0 && records.len().is_multiple_of(BLOCK / 2 * record) && out.len() >= blocks * BLOCK_VALUES);
    // SAFETY: AVX2 is the caller's part (and so in each block below).
    let (shift, round) = unsafe { (_mm256_set1_epi32((bits - MID_BITS) as i32), _mm256_set1_epi32(1 << (bits - MID_BITS - 1))) };
    // SAFETY: as above.
    let (zero, max) = unsafe { (_mm256_setzero_si256(), _mm256_set1_epi32(MID_MAX)) };
    // Where the accumulation is free, the sums start from the rounding term.
    let init = if D::FUSED { round } else { zero };
    let mut r = records.as_ptr();
    for blk in 0..blocks {
        // Each half block's eight columns as R, G and B vectors in column order.
        let mut rgb = [[zero; 3]; 2];
        for rgb in rgb.iter_mut() {
            // Columns i and i + 4: (R, G, B, 0) sums (i | i + 4).
            let mut pair = [zero; 4];
            for sum in pair.iter_mut() {
                // SAFETY: D's instructions and the loads through the record's pointers are the
                // caller's part; the record is inside `records` (assertion above).
                unsafe {
                    let (a, b) = (r.cast::<*const i16>().read(), r.add(4).cast::<*const i16>().read());
                    let w = r.add(PAIR_HEAD);
                    for t in 0..p {
                        let v = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(_mm_loadu_si128(a.add(2 * ENTRY * t) as *const __m128i)), _mm_loadu_si128(b.add(2 * ENTRY * t) as *const __m128i));
                        *sum = D::dot(if t == 0 { init } else { *sum }, v, _mm256_loadu_si256(w.add(16 * t) as *const __m256i));
                    }
                    r = r.add(record);
                }
            }
            // A 4 × 4 transposition within each lane, then the rounding.
            // SAFETY: AVX2.
            unsafe {
                let (rg01, b01) = (_mm256_unpacklo_epi32(pair[0], pair[1]), _mm256_unpackhi_epi32(pair[0], pair[1]));
                let (rg23, b23) = (_mm256_unpacklo_epi32(pair[2], pair[3]), _mm256_unpackhi_epi32(pair[2], pair[3]));
                let sums = [_mm256_unpacklo_epi64(rg01, rg23), _mm256_unpackhi_epi64(rg01, rg23), _mm256_unpacklo_epi64(b01, b23)];
                for (o, v) in rgb.iter_mut().zip(sums) {
                    let v = if D::FUSED { v } else { _mm256_add_epi32(v, round) };
                    let v = _mm256_srav_epi32(v, shift);
                    *o = if CLAMP { _mm256_min_epi32(_mm256_max_epi32(v, zero), max) } else { v };
                }
            }
        }
        let [[r0, g0, b0], [r1, g1, b1]] = rgb;
        // SAFETY: AVX2; the block's values are inside `out` (assertion above).
        unsafe {
            let o = out.as_mut_ptr().add(BLOCK_VALUES * blk);
            _mm256_storeu_si256(o as *mut __m256i, _mm256_packs_epi32(r0, g0));
            _mm256_storeu_si256(o.add(16) as *mut __m256i, _mm256_packs_epi32(r1, g1));
            _mm256_storeu_si256(o.add(32) as *mut __m256i, _mm256_packs_epi32(b0, b1));
        }
    }
}

/// i16 values at the head of a record of [`hpass_vec`]: two pointers, padded to 32 bytes so that
/// the weights after them start on a 32-byte boundary.
const PAIR_HEAD: usize = 16;

/// [`hpass_vec`] with AVX2.
///
/// # Safety
/// As [`hpass_vec`]'s, with AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn hpass_avx2<const P: usize, const CLAMP: bool>(records: &[i16], p: usize, bits: u32, out: &mut [i16]) {
    // SAFETY: the caller's part.
    unsafe { hpass_vec::<Madd, P, CLAMP>(records, p, bits, out) }
}

/// [`hpass_vec`] with AVX-512 VNNI.
///
/// # Safety
/// As [`hpass_vec`]'s, with AVX2, AVX-512 VL and VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
unsafe fn hpass_avx512<const P: usize, const CLAMP: bool>(records: &[i16], p: usize, bits: u32, out: &mut [i16]) {
    // SAFETY: the caller's part.
    unsafe { hpass_vec::<Vnni, P, CLAMP>(records, p, bits, out) }
}

/// The horizontal-pass rows of one output row: `len` consecutive source rows starting at ring
/// slot `first`, in a ring of `ring` rows of `row_len` values (`tmp`).
#[derive(Clone, Copy)]
struct RingRows<'a> {
    tmp: &'a [i16],
    row_len: usize,
    ring: usize,
    first: usize,
}

impl RingRows<'_> {
    fn row(&self, k: usize) -> &[i16] {
        let r = (self.first + k) % self.ring;
        &self.tmp[r * self.row_len..(r + 1) * self.row_len]
    }
}

/// What the vertical pass does with its exact sums: clamp them to 0..=`clamp` (bicubic's clip
/// to the byte range, at the sums' scale), then per lane of a pixel `v · mul[lane] − sub[lane]`
/// (the fixed-point scale, and the normalization folded in).
#[derive(Clone, Copy)]
struct Finish {
    clamp: Option<i32>,
    mul: [f32; LANES],
    sub: [f32; LANES],
}

/// Vertical pass of one output row: `out[j] = finish(Σ_k w_k · row_k[j])` over the
/// horizontal-pass rows (i32 sums, exact, then f32), for j < out.len().
fn vpass_fixed(rows: RingRows, w: &[i16], finish: Finish, out: &mut [f32]) {
    let mut acc = vec![0i32; out.len()];
    for (k, &wk) in w.iter().enumerate() {
        for (a, &v) in acc.iter_mut().zip(rows.row(k)) {
            *a += wk as i32 * v as i32;
        }
    }
    for (j, (o, a)) in out.iter_mut().zip(acc).enumerate() {
        let a = finish.clamp.map_or(a, |m| a.clamp(0, m));
        *o = a as f32 * finish.mul[j % LANES] - finish.sub[j % LANES];
    }
}

/// [`vpass_fixed`] with 256-bit vectors on rows in [`BLOCK`] layout, into the three planes (R,
/// G, B) of one output row, `dst`, `side` values each: per block, two rows per multiply-add (the
/// rows' values interleaved in pairs) for each of its three vectors, the sums kept in registers
/// over all taps, then `finish` with plane c's `mul[c]` and `sub[c]`. Called through
/// [`vpass_avx2`] and [`vpass_avx512`].
///
/// # Safety
/// The CPU has AVX2 and what `D` needs.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn vpass_vec<D: Dot>(rows: RingRows, w: &[i16], finish: Finish, mut dst: [&mut [f32]; 3]) {
    use std::arch::x86_64::*;
    let side = dst[0].len();
    let blocks = side.div_ceil(BLOCK);
    assert!(!w.is_empty() && dst.iter().all(|d| d.len() == side) && blocks * BLOCK_VALUES <= rows.row_len);
    // The rows' addresses and the weights by pairs (an odd last tap is paired with its own row
    // at weight 0), on the stack for the usual tap counts.
    let pairs = w.len().div_ceil(2);
    let (mut ptr_stack, mut w_stack) = ([std::ptr::null::<i16>(); 32], [0i32; 16]);
    let (mut ptr_heap, mut w_heap): (Vec<*const i16>, Vec<i32>);
    let (ptrs, wpair): (&mut [*const i16], &mut [i32]) = if pairs <= w_stack.len() {
        (&mut ptr_stack[..2 * pairs], &mut w_stack[..pairs])
    } else {
        (ptr_heap, w_heap) = (vec![std::ptr::null(); 2 * pairs], vec![0; pairs]);
        (&mut ptr_heap, &mut w_heap)
    };
    for (k, p) in ptrs.iter_mut().enumerate() {
        *p = rows.row(k.min(w.len() - 1)).as_ptr();
    }
    for (i, wp) in wpair.iter_mut().enumerate() {
        let b = w.get(2 * i + 1).copied().unwrap_or(0);
        *wp = (w[2 * i] as u16 as u32 | (b as u16 as u32) << 16) as i32;
    }
    let [m0, m1, m2, _] = finish.mul;
    let [s0, s1, s2, _] = finish.sub;
    // SAFETY: AVX2 is the caller's part (and so in each block below).
    let mul = unsafe { [_mm256_set1_ps(m0), _mm256_set1_ps(m1), _mm256_set1_ps(m2)] };
    // SAFETY: as above.
    let sub = unsafe { [_mm256_set1_ps(s0), _mm256_set1_ps(s1), _mm256_set1_ps(s2)] };
    // SAFETY: as above.
    let (zero, top) = unsafe { (_mm256_setzero_si256(), _mm256_set1_epi32(finish.clamp.unwrap_or(i32::MAX))) };
    let clamp = finish.clamp.is_some();
    // (Helpers rather than closures: a closure here would not get the caller's target
    // features.)
    // Multiply, then subtract (no fused multiply-add, as the scalar path).
    #[inline(always)]
    unsafe fn convert(v: __m256i, clamp: bool, zero: __m256i, top: __m256i, mul: __m256, sub: __m256) -> __m256 {
        // SAFETY: AVX2 is the caller's part.
        unsafe {
            let v = if clamp { _mm256_min_epi32(_mm256_max_epi32(v, zero), top) } else { v };
            _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), mul), sub)
        }
    }
    // A block's six sums with a pair of rows (`a`, `b`, at the block) and its weights added.
    #[inline(always)]
    unsafe fn accumulate<D: Dot>(mut acc: [__m256i; 6], a: *const i16, b: *const i16, wv: __m256i) -> [__m256i; 6] {
        // SAFETY: AVX2 and D's instructions, and BLOCK_VALUES values at `a` and `b`, are the
        // caller's part.
        unsafe {
            for v in 0..3 {
                let x = _mm256_loadu_si256(a.add(16 * v) as *const __m256i);
                let y = _mm256_loadu_si256(b.add(16 * v) as *const __m256i);
                acc[2 * v] = D::dot(acc[2 * v], _mm256_unpacklo_epi16(x, y), wv);
                acc[2 * v + 1] = D::dot(acc[2 * v + 1], _mm256_unpackhi_epi16(x, y), wv);
            }
        }
        acc
    }
    // The plane and the pixel offset in the block of each of a block's six sums: the low and
    // high halves of its three vectors' values.
    const AT: [(usize, usize); 6] = [(0, 0), (1, 0), (0, 8), (1, 8), (2, 0), (2, 8)];
    let mut spare = [0f32; BLOCK_VALUES];
    for blk in 0..blocks {
        let base = BLOCK_VALUES * blk;
        // The first pair on its own: with Madd its sums need no add.
        // SAFETY: D's instructions are the caller's part; every row holds row_len ≥ base +
        // BLOCK_VALUES values (assertion above).
        let mut acc = unsafe { accumulate::<D>([zero; 6], ptrs[0].add(base), ptrs[1].add(base), _mm256_set1_epi32(wpair[0])) };
        for i in 1..pairs {
            // SAFETY: as above.
            acc = unsafe { accumulate::<D>(acc, ptrs[2 * i].add(base), ptrs[2 * i + 1].add(base), _mm256_set1_epi32(wpair[i])) };
        }
        let x = BLOCK * blk;
        if x + BLOCK <= side {
            for (&v, &(c, o)) in acc.iter().zip(&AT) {
                // SAFETY: x + o + 8 ≤ side, the planes' length.
                unsafe { _mm256_storeu_ps(dst[c].as_mut_ptr().add(x + o), convert(v, clamp, zero, top, mul[c], sub[c])) };
            }
        } else {
            // A last, partial block: through `spare`.
            for (&v, &(c, o)) in acc.iter().zip(&AT) {
                // SAFETY: BLOCK · c + o + 8 ≤ BLOCK_VALUES.
                unsafe { _mm256_storeu_ps(spare.as_mut_ptr().add(BLOCK * c + o), convert(v, clamp, zero, top, mul[c], sub[c])) };
            }
            for (c, d) in dst.iter_mut().enumerate() {
                d[x..].copy_from_slice(&spare[BLOCK * c..BLOCK * c + side - x]);
            }
        }
    }
}

/// [`vpass_vec`] with AVX2.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn vpass_avx2(rows: RingRows, w: &[i16], finish: Finish, dst: [&mut [f32]; 3]) {
    // SAFETY: the caller's part.
    unsafe { vpass_vec::<Madd>(rows, w, finish, dst) }
}

/// [`vpass_vec`] with AVX-512 VNNI.
///
/// # Safety
/// The CPU has AVX2, AVX-512 VL and VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
unsafe fn vpass_avx512(rows: RingRows, w: &[i16], finish: Finish, dst: [&mut [f32]; 3]) {
    // SAFETY: the caller's part.
    unsafe { vpass_vec::<Vnni>(rows, w, finish, dst) }
}

/// The separable antialiased resampling with `filter` of `region` of the (height, width, 3)
/// HWC image `src` to `side` × `side`, mirrored when `flip`: hands each output row, as its three
/// channels' rows (R, G, B) of `side` f32 in source units (0..=255), to `sink(row_index, rows)`.
///
/// The passes run in fixed point (as PIL's and Pillow-SIMD's do): weights as i16 with as many
/// fractional bits as the filter allows ([`fixed_taps`]), the horizontal pass from the source
/// bytes into i16 values with 7 fractional bits (rounded; clamped to 0..=255 for bicubic, as
/// PIL clips its intermediate image), the vertical pass into exact i32 sums, converted to f32
/// once. Integer sums do not depend on their order, so the vector and the scalar paths give the
/// same bits on every machine. Against an exact evaluation of the same filter the error is
/// a small fraction of a level (tested).
#[allow(clippy::too_many_arguments)]
pub fn resample_rows(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, mut sink: impl FnMut(usize, [&[f32]; 3])) {
    resample_rows_on(src, width, height, region, side, flip, filter, IDENTITY, simd(), Dest::Rows(&mut sink))
}

/// Per-channel `v · mul − sub` applied to the resampled values (source units) as the rows are
/// finished: [`resample`]'s normalization, or the identity.
#[derive(Clone, Copy)]
struct Affine {
    mul: [f32; 3],
    sub: [f32; 3],
}

const IDENTITY: Affine = Affine { mul: [1.0; 3], sub: [0.0; 3] };

/// Where [`resample_rows_on`] puts the output rows.
enum Dest<'a> {
    /// (3, side, side) CHW planes, each row written in place.
    Chw(&'a mut [f32]),
    /// A function handed each row as its three channels' rows.
    Rows(&'a mut dyn FnMut(usize, [&[f32]; 3])),
}

/// [`resample_rows`] with `affine` applied to the values, on the code paths of `simd` (at most
/// the CPU's level), into `dest`. Folding `affine` into the vertical pass's conversion gives the
/// same bits as applying it to the rows afterwards: the fixed-point scale is a power of two.
#[allow(clippy::too_many_arguments)]
fn resample_rows_on(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, affine: Affine, simd: Simd, mut dest: Dest) {
    debug_assert_eq!(src.len(), width * height * 3);
    let vector = simd != Simd::Scalar;
    let tx = fixed_taps(width, region.x0, region.w, side, filter, 22, MID_BITS + 1, 255.0);
    let ty = fixed_taps(height, region.y0, region.h, side, filter, 22, 1, MID_MAX as f64);
    let clip = filter == Interpolation::Bicubic;
    // Source rows the vertical pass touches, source columns the horizontal pass touches.
    let row_lo = ty.start.iter().copied().min().unwrap_or(0);
    let row_hi = (0..side).map(|i| ty.start[i] + ty.len[i]).max().unwrap_or(row_lo + 1).min(height);
    let rows = row_hi - row_lo;
    let col_lo = tx.start.iter().copied().min().unwrap_or(0);
    let col_hi = (0..side).map(|i| tx.start[i] + tx.len[i]).max().unwrap_or(col_lo + 1).min(width);
    // Output columns in output order; the flip reads column side-1-ox's taps.
    let cols: Vec<Col> = (0..side)
        .map(|ox| {
            let sx = if flip { side - 1 - ox } else { ox };
            Col { start: tx.start[sx] - col_lo, len: tx.len[sx], w: sx * tx.n }
        })
        .collect();
    // The vector horizontal pass's columns, padded to whole blocks with columns of no taps (they
    // give 0): offsets of their first pixels in the expanded row, and its records (hpass_vec)
    // but for the pointers, which wait for the expanded row: pair m takes columns j and j + 4,
    // j = 8·(m / 4) + m % 4.
    let p = cols.iter().map(|c| c.len).max().unwrap_or(1).div_ceil(2).max(1);
    let record = PAIR_HEAD + 16 * p;
    // (A fresh buffer: zero where no weight is written.)
    let (mut starts, mut records_buf) = (Vec::new(), Vec::new());
    let records = aligned(&mut records_buf, if vector { side.next_multiple_of(BLOCK) / 2 * record } else { 0 });
    if vector {
        starts.resize(side.next_multiple_of(BLOCK), 0);
        for (j, c) in cols.iter().enumerate() {
            starts[j] = ENTRY * c.start;
            let (m, lane) = ((j / 8) * 4 + j % 4, (j / 4) % 2);
            for (k, &w) in tx.weights[c.w..c.w + c.len].iter().enumerate() {
                let at = record * m + PAIR_HEAD + 16 * (k / 2) + 8 * lane + k % 2;
                for ch in 0..3 {
                    records[at + 2 * ch] = w;
                }
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    let hclamp = tx.weights.iter().any(|&w| w < 0);
    // Expanded source pixels the vector pass loads (a multiple of four, for either expansion),
    // and bytes a row's pass may read from its span's start: the span and the widest column's
    // padding taps, or the expansion's 16-byte loads.
    let entries = (starts.iter().max().unwrap_or(&0) / ENTRY + 2 * p - 1).next_multiple_of(4);
    let span_bytes = (3 * (col_hi - col_lo + tx.n) + 16).max(3 * entries + 10);
    // What hpass_vec needs of every expanded row (each is `entries` long).
    assert!(starts.iter().all(|&s| s + ENTRY * (2 * p - 1) <= entries * ENTRY));
    // Values per horizontal-pass row: whole blocks, or side pixels of LANES values.
    let row_len = if vector { side.div_ceil(BLOCK) * BLOCK_VALUES } else { side * LANES };
    // Horizontal-pass rows live in a ring of `ring` rows: output rows read consecutive source
    // rows whose start never decreases, so the last `ty.n` computed rows are all that is ever
    // needed (a few KiB that stay in L1, instead of the whole window). Should the starts not be
    // monotonic, the ring holds every row.
    let monotonic = ty.start.windows(2).all(|w| w[0] <= w[1]);
    let ring = if monotonic { ty.n.min(rows).max(1) } else { rows };
    let scale = 1.0 / (1u64 << (MID_BITS + ty.bits)) as f32;
    let finish = Finish {
        clamp: clip.then(|| (255i64 << (MID_BITS + ty.bits)).min(i32::MAX as i64) as i32),
        mul: [affine.mul[0] * scale, affine.mul[1] * scale, affine.mul[2] * scale, 0.0],
        sub: [affine.sub[0], affine.sub[1], affine.sub[2], 0.0],
    };
    SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let Scratch { padded, expanded, tmp, acc, planes } = &mut *guard;
        // (Every horizontal-pass row and expanded row is written whole before it is read.)
        let tmp = aligned(tmp, ring * row_len);
        let expanded = aligned(expanded, if vector { entries * ENTRY } else { 0 });
        // The expanded row is written through `e_base` and read through pointers derived from
        // it, the records' pointers to each column's first pixel in it.
        let e_base = expanded.as_mut_ptr();
        #[cfg(target_arch = "x86_64")]
        let e_len = expanded.len();
        for (m, head) in records.chunks_exact_mut(record).enumerate() {
            let j = 8 * (m / 4) + m % 4;
            // SAFETY: every start is inside the expanded row (asserted above), and each record
            // starts 8-byte aligned (the buffer starts on a cache line, and a record is a
            // multiple of 32 bytes long).
            unsafe {
                head.as_mut_ptr().cast::<*const i16>().write(e_base.add(starts[j]));
                head.as_mut_ptr().add(4).cast::<*const i16>().write(e_base.add(starts[j + 4]));
            }
        }
        if !vector {
            acc.clear();
            acc.resize(side * LANES, 0.0);
        }
        if let Dest::Rows(_) = dest {
            planes.clear();
            planes.resize(3 * side, 0.0);
        }
        // The vertical pass of one output row into its three planes.
        let mut vertical = |rows: RingRows, w: &[i16], dst: [&mut [f32]; 3]| {
            #[cfg(target_arch = "x86_64")]
            match simd {
                // SAFETY: simd() checked the CPU.
                Simd::Avx512 => return unsafe { vpass_avx512(rows, w, finish, dst) },
                Simd::Avx2 => return unsafe { vpass_avx2(rows, w, finish, dst) },
                Simd::Scalar => {}
            }
            vpass_fixed(rows, w, finish, acc);
            let [r, g, b] = dst;
            for (x, px) in acc.chunks_exact(LANES).enumerate() {
                (r[x], g[x], b[x]) = (px[0], px[1], px[2]);
            }
        };
        let mut next = row_lo;
        for oy in 0..side {
            let (s0, len) = (ty.start[oy], ty.len[oy]);
            // Horizontal pass of the source rows this output row needs and has not got yet.
            while next < (s0 + len).min(row_hi) {
                let at = (next * width + col_lo) * 3;
                let row: &[u8] = if at + span_bytes <= src.len() {
                    &src[at..at + span_bytes]
                } else {
                    // Near the image's end: a zero-padded copy, so the vector loads stay inside.
                    padded.clear();
                    padded.extend_from_slice(&src[at..]);
                    padded.resize(span_bytes, 0);
                    padded
                };
                // The source row two ahead on its way to the cache while this one is filtered
                // (where the image was decoded long ago, the rows come from memory).
                #[cfg(target_arch = "x86_64")]
                if next + 2 < row_hi {
                    let ahead = ((next + 2) * width + col_lo) * 3;
                    for off in (0..3 * (col_hi - col_lo)).step_by(64) {
                        // SAFETY: ahead + off is inside row next + 2 of `src`; prefetching reads
                        // nothing.
                        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(src.as_ptr().add(ahead + off) as *const i8) };
                    }
                }
                let r = (next - row_lo) % ring;
                let trow = &mut tmp[r * row_len..(r + 1) * row_len];
                next += 1;
                #[cfg(target_arch = "x86_64")]
                if vector {
                    // The pass `$f` (hpass_avx2 or hpass_avx512) for this image's tap pairs and
                    // clamping.
                    macro_rules! hpass {
                        ($f:ident) => {
                            match (p, hclamp) {
                                (1, false) => $f::<1, false>(records, p, tx.bits, trow),
                                (2, false) => $f::<2, false>(records, p, tx.bits, trow),
                                (3, false) => $f::<3, false>(records, p, tx.bits, trow),
                                (_, false) => $f::<0, false>(records, p, tx.bits, trow),
                                (2, true) => $f::<2, true>(records, p, tx.bits, trow),
                                (3, true) => $f::<3, true>(records, p, tx.bits, trow),
                                (4, true) => $f::<4, true>(records, p, tx.bits, trow),
                                (5, true) => $f::<5, true>(records, p, tx.bits, trow),
                                (_, true) => $f::<0, true>(records, p, tx.bits, trow),
                            }
                        };
                    }
                    // SAFETY: simd() checked the CPU; `row` is span_bytes ≥ 3 · entries + 10 long,
                    // the expanded row `entries` long, and every column's reach inside it is
                    // asserted above; `e` is the only reference to the expanded row while it is
                    // written.
                    unsafe {
                        let e = std::slice::from_raw_parts_mut(e_base, e_len);
                        if simd == Simd::Avx512 {
                            expand_avx512(row, e);
                            hpass!(hpass_avx512);
                        } else {
                            expand_avx2(row, e);
                            hpass!(hpass_avx2);
                        }
                    }
                    continue;
                }
                hpass_fixed(row, &cols, &tx.weights, tx.bits, trow);
            }
            // Vertical pass: a weighted sum of whole rows (contiguous, vectorizable).
            let w = &ty.weights[oy * ty.n..oy * ty.n + len];
            let rows = RingRows { tmp: &*tmp, row_len, ring, first: (s0 - row_lo) % ring };
            match &mut dest {
                Dest::Chw(out) => {
                    let (plane, o) = (side * side, oy * side);
                    let (r, rest) = out.split_at_mut(plane);
                    let (g, b) = rest.split_at_mut(plane);
                    vertical(rows, w, [&mut r[o..o + side], &mut g[o..o + side], &mut b[o..o + side]]);
                }
                Dest::Rows(sink) => {
                    let (r, rest) = planes.split_at_mut(side);
                    let (g, b) = rest.split_at_mut(side);
                    vertical(rows, w, [&mut *r, &mut *g, &mut *b]);
                    sink(oy, [r, g, b]);
                }
            }
        }
    });
}

/// Resamples `region` of the (height, width, 3) HWC image `src` with `filter` to `out`
/// (3, side, side) CHW, mirrored when `flip`, normalized as `(v / 255 − mean) / std`.
#[allow(clippy::too_many_arguments)]
pub fn resample(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, mean: [f32; 3], std: [f32; 3], out: &mut [f32]) {
    assert_eq!(out.len(), 3 * side * side);
    let affine = Affine { mul: [0, 1, 2].map(|c| 1.0 / (255.0 * std[c])), sub: [0, 1, 2].map(|c| mean[c] / std[c]) };
    resample_rows_on(src, width, height, region, side, flip, filter, affine, simd(), Dest::Chw(out));
}

/// [`resample`] to (side, side, 3) HWC bytes, each value rounded half up and clamped to
/// 0..=255 (what RandAugment works on).
#[allow(clippy::too_many_arguments)]
pub fn resample_u8(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, out: &mut [u8]) {
    resample_u8_on(src, width, height, region, side, flip, filter, simd(), out)
}

/// [`resample_u8`] on the code paths of `simd` (at most the CPU's level).
#[allow(clippy::too_many_arguments)]
fn resample_u8_on(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, simd: Simd, out: &mut [u8]) {
    assert_eq!(out.len(), 3 * side * side);
    resample_rows_on(src, width, height, region, side, flip, filter, IDENTITY, simd, Dest::Rows(&mut |oy, [r, g, b]| {
        let o = &mut out[oy * side * 3..(oy + 1) * side * 3];
        #[allow(unused_mut)]
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if simd != Simd::Scalar {
            // SAFETY: simd() checked the CPU for AVX2.
            done = unsafe { planes_to_bytes_avx2([r, g, b], o) };
        }
        for (x, q) in o.chunks_exact_mut(3).enumerate().skip(done) {
            for (c, plane) in [r, g, b].into_iter().enumerate() {
                // max/min, then a truncating cast: round half up without a library call.
                q[c] = (plane[x].max(0.0) + 0.5).min(255.0) as u8;
            }
        }
    }));
}

/// The leading pixels of one row's three planes as RGB bytes, rounded as [`resample_u8`]'s
/// scalar loop (`(max(v, 0) + 0.5) min 255`, truncated), eight pixels per step; returns how
/// many it wrote. Stops while the step's two 16-byte stores still fit in `out`.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn planes_to_bytes_avx2(planes: [&[f32]; 3], out: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let pixels = planes.iter().map(|p| p.len()).min().unwrap_or(0).min(out.len() / 3);
    // Per lane, bytes (R0..R3, G0..G3, B0..B3, 0 × 4) to (R G B) × 4, then four unused bytes.
    let interleave = _mm256_setr_epi8(0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, -128, -128, -128, -128, 0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11, -128, -128, -128, -128);
    let (zero, half, max) = (_mm256_setzero_ps(), _mm256_set1_ps(0.5), _mm256_set1_ps(255.0));
    let round = |v: __m256| _mm256_cvttps_epi32(_mm256_min_ps(_mm256_add_ps(_mm256_max_ps(v, zero), half), max));
    let mut done = 0;
    while done + 8 <= pixels && 3 * done + 28 <= out.len() {
        // SAFETY: pixels done..done + 8 are inside the planes and the bytes written inside `out`
        // (loop condition); AVX2 is enabled for this function.
        unsafe {
            let [r, g, b] = planes.map(|p| round(_mm256_loadu_ps(p.as_ptr().add(done))));
            // Per lane (pixels 0–3 | 4–7): R, G as words, then B and zeros; then bytes.
            let bytes = _mm256_packus_epi16(_mm256_packs_epi32(r, g), _mm256_packs_epi32(b, _mm256_setzero_si256()));
            let v = _mm256_shuffle_epi8(bytes, interleave);
            let o = out.as_mut_ptr().add(3 * done);
            _mm_storeu_si128(o as *mut __m128i, _mm256_castsi256_si128(v));
            _mm_storeu_si128(o.add(12) as *mut __m128i, _mm256_extracti128_si256::<1>(v));
        }
        done += 8;
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID_MEAN: [f32; 3] = [0.0; 3];
    const ID_STD: [f32; 3] = [1.0 / 255.0; 3];

    /// An (h, w, 3) image whose value at (y, x) is `col[x] + row[y] + 10·c` in channel c: the
    /// separable filters act on the column and row terms apart (their weights sum to 1).
    fn additive(col: &[u8], row: &[u8]) -> Vec<u8> {
        row.iter().flat_map(|&b| col.iter().flat_map(move |&a| [a + b, a + b + 10, a + b + 20])).collect()
    }

    /// PIL's antialiased bilinear filter worked out by hand on tiny images. Output pixel i of a
    /// window [r0, r0 + len) resampled to n pixels is centred at r0 + (i + ½)·len/n; source pixel
    /// j (centre j + ½) weighs max(0, 1 − |j + ½ − centre| / max(1, len/n)), normalized over the
    /// pixels inside the image.
    #[test]
    fn bilinear_by_hand() {
        let run = |src: &[u8], w: usize, h: usize, region: Region, side: usize, flip: bool| {
            let mut out = vec![0f32; 3 * side * side];
            resample(src, w, h, region, side, flip, Interpolation::Bilinear, ID_MEAN, ID_STD, &mut out);
            let mut bytes = vec![0u8; 3 * side * side];
            resample_u8(src, w, h, region, side, flip, Interpolation::Bilinear, &mut bytes);
            (out, bytes)
        };
        let check = |(out, bytes): (Vec<f32>, Vec<u8>), side: usize, col: &[f32], row: &[f32], what: &str| {
            for y in 0..side {
                for x in 0..side {
                    for c in 0..3 {
                        let want = col[x] + row[y] + 10.0 * c as f32;
                        let got = out[c * side * side + y * side + x];
                        assert!((got - want).abs() < 1e-3, "{what}: ({y}, {x}) channel {c}: {got} vs {want}");
                        assert_eq!(bytes[(y * side + x) * 3 + c] as f32, want.round(), "{what}: byte ({y}, {x}) channel {c}");
                    }
                }
            }
        };
        // 4 → 2 (scale 2, support 2): centres 1 and 3; weights ¾, ¾, ¼ over pixels 0..3, then
        // ¼, ¾, ¾ over 1..4: [0, 70, 140, 210] → (0·3 + 70·3 + 140) / 7 = 50 and (70 + 140·3 +
        // 210·3) / 7 = 160; [0, 7, 14, 21] → 5 and 16.
        let src = additive(&[0, 70, 140, 210], &[0, 7, 14, 21]);
        let full = Region { x0: 0.0, y0: 0.0, w: 4.0, h: 4.0 };
        check(run(&src, 4, 4, full, 2, false), 2, &[50.0, 160.0], &[5.0, 16.0], "4 → 2");
        check(run(&src, 4, 4, full, 2, true), 2, &[160.0, 50.0], &[5.0, 16.0], "4 → 2 flipped");
        // 2 → 4 (scale ½, support 1): centres ¼, ¾, 1¼, 1¾: [20, 120] → 20 (pixel 1 is a full
        // pixel away), ¾·20 + ¼·120 = 45, 95, 120 (pixel 2 would lie outside).
        let src = additive(&[20, 120], &[0, 40]);
        check(run(&src, 2, 2, Region { x0: 0.0, y0: 0.0, w: 2.0, h: 2.0 }, 4, false), 4, &[20.0, 45.0, 95.0, 120.0], &[0.0, 10.0, 30.0, 40.0], "2 → 4");
        // A window at scale 1 copies its pixels: columns 1..3 and rows 1..3 of a 4×3 image.
        let src = additive(&[0, 70, 140, 210], &[0, 7, 14]);
        check(run(&src, 4, 3, Region { x0: 1.0, y0: 1.0, w: 2.0, h: 2.0 }, 2, false), 2, &[70.0, 140.0], &[7.0, 14.0], "window");
        // Normalization: (v / 255 − mean) / std.
        let src = additive(&[0, 70, 140, 210], &[0, 7, 14, 21]);
        let mut out = vec![0f32; 12];
        resample(&src, 4, 4, full, 2, false, Interpolation::Bilinear, [0.5, 0.25, 0.0], [0.25, 0.5, 2.0], &mut out);
        for (c, (mean, std)) in [(0.5f32, 0.25f32), (0.25, 0.5), (0.0, 2.0)].into_iter().enumerate() {
            let want = ((50.0 + 5.0 + 10.0 * c as f32) / 255.0 - mean) / std;
            assert!((out[c * 4] - want).abs() < 1e-5, "channel {c}: {} vs {want}", out[c * 4]);
        }
    }

    /// The byte path is the float path (identity normalization) rounded half up, for both
    /// filters, on fresh random images, windows and flips.
    #[test]
    fn byte_output_is_the_float_output_rounded() {
        let seed = hash(&[std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)]);
        let mut rng = SplitMix::new(seed);
        for &(w, h, side) in &[(500, 375, 224), (37, 29, 16), (2, 3, 4), (5, 1, 3), (16, 16, 31)] {
            let src: Vec<u8> = (0..w * h * 3).map(|_| rng.below(256) as u8).collect();
            for filter in [Interpolation::Bilinear, Interpolation::Bicubic] {
                let region = random_resized_crop(&mut rng, w, h, [0.08, 1.0], [0.75, 4.0 / 3.0]);
                let flip = rng.coin();
                let mut raw = vec![0f32; 3 * side * side];
                resample(&src, w, h, region, side, flip, filter, ID_MEAN, ID_STD, &mut raw);
                let mut bytes = vec![0u8; 3 * side * side];
                resample_u8(&src, w, h, region, side, flip, filter, &mut bytes);
                let plane = side * side;
                for p in 0..plane {
                    for c in 0..3 {
                        // The identity normalization is v·(1/255·255) − 0: within 1e-4 of the
                        // resampled value, so the two agree except at exact ties.
                        let (v, b) = (raw[c * plane + p], bytes[p * 3 + c] as f32);
                        assert!((b - v.clamp(0.0, 255.0)).abs() <= 0.5 + 1e-3, "seed {seed} {filter:?} {w}x{h} -> {side}: pixel {p} channel {c}: {b} vs {v}");
                    }
                }
            }
        }
    }

    /// The code paths this CPU can run: the scalar one first.
    fn levels() -> Vec<Simd> {
        match simd() {
            Simd::Scalar => vec![Simd::Scalar],
            Simd::Avx2 => vec![Simd::Scalar, Simd::Avx2],
            Simd::Avx512 => vec![Simd::Scalar, Simd::Avx2, Simd::Avx512],
        }
    }

    /// On every code path the rows are bit-identical (integer sums, zero-weight padding taps
    /// and columns, the pixel order inside blocks), for both filters and odd sizes.
    #[test]
    fn vector_and_scalar_paths_agree_bitwise() {
        let mut rng = SplitMix::new(4);
        for &(w, h, side) in &[(500, 375, 224), (37, 29, 15), (3, 2, 9), (640, 480, 33)] {
            let src: Vec<u8> = (0..w * h * 3).map(|_| rng.below(256) as u8).collect();
            for filter in [Interpolation::Bilinear, Interpolation::Bicubic, Interpolation::Bilinear, Interpolation::Bicubic] {
                let region = random_resized_crop(&mut rng, w, h, [0.08, 1.0], [0.75, 4.0 / 3.0]);
                let flip = rng.coin();
                let mut rows = vec![Vec::new(); levels().len()];
                for (k, simd) in levels().into_iter().enumerate() {
                    resample_rows_on(&src, w, h, region, side, flip, filter, IDENTITY, simd, Dest::Rows(&mut |_, planes| rows[k].extend(planes.iter().flat_map(|p| p.iter().map(|v| v.to_bits())))));
                }
                for (k, simd) in levels().into_iter().enumerate() {
                    assert_eq!(rows[0], rows[k], "{w}x{h} -> {side}, {region:?}: {simd:?}");
                }
            }
        }
    }

    /// Tiny and odd shapes (1-px images and outputs, windows narrower than a pixel at fractional
    /// offsets, strong up- and downscales): every code path gives the same bits, every value in
    /// the byte range, and a flat image stays exactly flat (each output's fixed-point weights
    /// sum to one).
    #[test]
    fn odd_shapes_agree_across_paths_and_keep_flat_images_flat() {
        let mut rng = SplitMix::new(hash(&[std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)]));
        for case in 0..300 {
            let (w, h) = (1 + rng.below(40) as usize, 1 + rng.below(40) as usize);
            let side = 1 + rng.below(40) as usize;
            let rw = (rng.f32() * w as f32).max(0.25);
            let rh = (rng.f32() * h as f32).max(0.25);
            let region = Region { x0: rng.f32() * (w as f32 - rw), y0: rng.f32() * (h as f32 - rh), w: rw, h: rh };
            let flip = rng.coin();
            let flat = case % 3 == 0;
            let level = rng.below(256) as u8;
            let src: Vec<u8> = (0..w * h * 3).map(|_| if flat { level } else { rng.below(256) as u8 }).collect();
            for filter in [Interpolation::Bilinear, Interpolation::Bicubic] {
                let mut rows = vec![Vec::new(); levels().len()];
                for (k, simd) in levels().into_iter().enumerate() {
                    resample_rows_on(&src, w, h, region, side, flip, filter, IDENTITY, simd, Dest::Rows(&mut |_, planes| rows[k].extend(planes.iter().flat_map(|p| p.iter().copied()))));
                }
                let what = format!("{w}x{h} -> {side}, {region:?}, {filter:?}");
                assert_eq!(rows[0].len(), 3 * side * side, "{what}");
                for (k, simd) in levels().into_iter().enumerate() {
                    assert!(rows[0].iter().zip(&rows[k]).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: {simd:?} and scalar differ");
                }
                for &v in &rows[0] {
                    assert!((0.0..=255.0).contains(&v), "{what}: {v} outside the byte range");
                    if flat {
                        assert_eq!(v, level as f32, "{what}: a flat image of {level} gave {v}");
                    }
                }
            }
        }
    }

    /// On every code path, on fresh random images, sizes, windows (integer and fractional, some
    /// reaching past the image), flips and both filters: the rows handed out, the normalized CHW
    /// planes written in place and the bytes are bit-identical to the scalar path's.
    #[test]
    fn vector_and_scalar_paths_agree_on_random_inputs() {
        let seed = hash(&[std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)]);
        let mut rng = SplitMix::new(seed);
        for case in 0..60 {
            let (w, h) = (1 + rng.below(700) as usize, 1 + rng.below(700) as usize);
            let side = 1 + rng.below(300) as usize;
            let src: Vec<u8> = (0..w * h * 3).map(|_| rng.below(256) as u8).collect();
            let region = match case % 3 {
                0 => random_resized_crop(&mut rng, w, h, [0.08, 1.0], [0.75, 4.0 / 3.0]),
                1 => center_crop(w, h, side, 0.875),
                _ => {
                    let (rw, rh) = ((rng.f32() * 1.2 * w as f32).max(0.25), (rng.f32() * 1.2 * h as f32).max(0.25));
                    Region { x0: rng.f32() * w as f32 - 0.1 * rw, y0: rng.f32() * h as f32 - 0.1 * rh, w: rw, h: rh }
                }
            };
            let flip = rng.coin();
            for filter in [Interpolation::Bilinear, Interpolation::Bicubic] {
                let what = format!("seed {seed}: {w}x{h} -> {side}, {region:?}, flip {flip}, {filter:?}");
                let affine = Affine { mul: [0.0172, 0.0175, 0.0174], sub: [2.118, 2.036, 1.804] };
                let n = levels().len();
                let (mut rows, mut chw, mut bytes) = (vec![Vec::new(); n], vec![vec![0f32; 3 * side * side]; n], vec![vec![0u8; 3 * side * side]; n]);
                for (k, simd) in levels().into_iter().enumerate() {
                    resample_rows_on(&src, w, h, region, side, flip, filter, IDENTITY, simd, Dest::Rows(&mut |_, planes| rows[k].extend(planes.iter().flat_map(|p| p.iter().map(|v| v.to_bits())))));
                    resample_rows_on(&src, w, h, region, side, flip, filter, affine, simd, Dest::Chw(&mut chw[k]));
                    resample_u8_on(&src, w, h, region, side, flip, filter, simd, &mut bytes[k]);
                }
                assert_eq!(rows[0].len(), 3 * side * side, "{what}");
                for (k, simd) in levels().into_iter().enumerate() {
                    assert!(rows[0] == rows[k], "{what}: the rows of {simd:?} differ");
                    assert!(chw[0].iter().zip(&chw[k]).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: the CHW planes of {simd:?} differ");
                    assert!(bytes[0] == bytes[k], "{what}: the bytes of {simd:?} differ");
                }
            }
        }
    }

    /// The fixed-point taps against a plain transcription of their definition (the f32 or f64
    /// weights per output, normalized, trimmed, then quantized), on fresh random axes and
    /// windows (down- and upscales, fractional offsets, windows reaching past the image): the
    /// same starts, lengths, fractional bits and weights.
    #[test]
    fn fixed_taps_match_their_definition() {
        let seed = hash(&[std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)]);
        let mut rng = SplitMix::new(seed);
        for case in 0..3000 {
            let src_len = 1 + rng.below(if case % 2 == 0 { 40 } else { 3000 }) as usize;
            let out_len = 1 + rng.below(if case % 3 == 0 { 30 } else { 400 }) as usize;
            let rlen = (rng.f32() * 1.3 * src_len as f32).max(0.01);
            let r0 = rng.f32() * src_len as f32 - 0.15 * rlen;
            let (r0, rlen) = if case % 4 == 0 { (r0.round(), rlen.round().max(1.0)) } else { (r0, rlen) };
            for filter in [Interpolation::Bilinear, Interpolation::Bicubic] {
                for (max_bits, min_bits, input_max) in [(22, MID_BITS + 1, 255.0), (22, 1, MID_MAX as f64)] {
                    let want = reference::fixed_taps(reference::taps(src_len, r0, rlen, out_len, filter), max_bits, min_bits, input_max);
                    let what = format!("seed {seed}: {src_len} px, window {r0} + {rlen} -> {out_len}, {filter:?}, bits {max_bits}..{min_bits}");
                    // As dispatched (with AVX2 where the CPU has it) and compiled for the baseline.
                    for got in [fixed_taps(src_len, r0, rlen, out_len, filter, max_bits, min_bits, input_max), fixed_taps_on(src_len, r0, rlen, out_len, filter, max_bits, min_bits, input_max)] {
                        assert_eq!((&got.start, &got.len, got.n, got.bits), (&want.start, &want.len, want.n, want.bits), "{what}");
                        assert!(got.weights == want.weights, "{what}: the weights differ");
                    }
                }
            }
        }
    }

    /// The weights as first written: per output in a plain loop, normalized, trimmed, then
    /// quantized ([`fixed_taps`] computes the same values eight outputs at a time).
    mod reference {
        use super::super::{bicubic, Interpolation};

        pub struct Taps {
            start: Vec<usize>,
            len: Vec<usize>,
            n: usize,
            weights: Vec<f32>,
        }

        pub struct FixedTaps {
            pub start: Vec<usize>,
            pub len: Vec<usize>,
            pub n: usize,
            pub bits: u32,
            pub weights: Vec<i16>,
        }

        pub fn taps(src_len: usize, r0: f32, rlen: f32, out_len: usize, filter: Interpolation) -> Taps {
            let scale = rlen / out_len as f32;
            let fscale = scale.max(1.0);
            let support = match filter {
                Interpolation::Bilinear => fscale,
                Interpolation::Bicubic => 2.0 * fscale,
            };
            let n = (support.ceil() as usize) * 2 + 1;
            let (scale64, fscale64) = (rlen as f64 / out_len as f64, (rlen as f64 / out_len as f64).max(1.0));
            let mut start = Vec::with_capacity(out_len);
            let mut len = Vec::with_capacity(out_len);
            let mut weights = vec![0f32; out_len * n];
            let mut k64 = vec![0f64; if filter == Interpolation::Bicubic { n } else { 0 }];
            for i in 0..out_len {
                let w = &mut weights[i * n..(i + 1) * n];
                let (lo, hi) = match filter {
                    Interpolation::Bilinear => {
                        let center = r0 + (i as f32 + 0.5) * scale;
                        let lo = ((center - support).floor().max(0.0) as usize).min(src_len - 1);
                        let hi = ((center + support).ceil().max(0.0) as usize).clamp(lo + 1, src_len).min(lo + n);
                        let mut sum = 0.0;
                        for (k, j) in (lo..hi).enumerate() {
                            w[k] = (1.0 - ((j as f32 + 0.5 - center) / fscale).abs()).max(0.0);
                            sum += w[k];
                        }
                        if sum <= 0.0 {
                            w[0] = 1.0;
                            sum = 1.0;
                        }
                        w.iter_mut().for_each(|x| *x /= sum);
                        (lo, hi)
                    }
                    Interpolation::Bicubic => {
                        let center = r0 as f64 + (i as f64 + 0.5) * scale64;
                        let support = 2.0 * fscale64;
                        let lo = ((center - support).floor().max(0.0) as usize).min(src_len - 1);
                        let hi = ((center + support).ceil().max(0.0) as usize).clamp(lo + 1, src_len).min(lo + n);
                        let ss = 1.0 / fscale64;
                        let k64 = &mut k64[..hi - lo];
                        let mut sum = 0.0;
                        for (k, j) in (lo..hi).enumerate() {
                            k64[k] = bicubic((j as f64 + 0.5 - center) * ss);
                            sum += k64[k];
                        }
                        if sum == 0.0 {
                            k64[0] = 1.0;
                            sum = 1.0;
                        }
                        for (wk, &k) in w.iter_mut().zip(k64.iter()) {
                            *wk = (k / sum) as f32;
                        }
                        (lo, hi)
                    }
                };
                let mut first = 0;
                let mut last = hi - lo;
                while last > first + 1 && w[last - 1] == 0.0 {
                    last -= 1;
                }
                while first + 1 < last && w[first] == 0.0 {
                    first += 1;
                }
                w.copy_within(first..last, 0);
                start.push(lo + first);
                len.push(last - first);
            }
            Taps { start, len, n, weights }
        }

        pub fn fixed_taps(t: Taps, max_bits: u32, min_bits: u32, input_max: f64) -> FixedTaps {
            let outputs = t.start.len();
            let (mut max_w, mut max_abs_sum) = (0f64, 0f64);
            for i in 0..outputs {
                let w = &t.weights[i * t.n..i * t.n + t.len[i]];
                max_w = w.iter().fold(max_w, |m, &x| m.max((x as f64).abs()));
                max_abs_sum = max_abs_sum.max(w.iter().map(|&x| (x as f64).abs()).sum());
            }
            let fits = |bits: u32| {
                let s = (1u64 << bits) as f64;
                max_w * s + t.n as f64 <= i16::MAX as f64 && (max_abs_sum * s + t.n as f64) * input_max <= i32::MAX as f64 * 0.99
            };
            let mut bits = max_bits;
            while bits > min_bits && !fits(bits) {
                bits -= 1;
            }
            let n = t.n + (t.n & 1);
            let scale = (1u64 << bits) as f64;
            let mut weights = vec![0i16; outputs * n];
            for i in 0..outputs {
                let (src, dst) = (&t.weights[i * t.n..i * t.n + t.len[i]], &mut weights[i * n..i * n + t.len[i]]);
                let (mut sum, mut big) = (0i32, 0);
                for (k, &x) in src.iter().enumerate() {
                    let v = x as f64 * scale;
                    dst[k] = (v + 0.5f64.copysign(v)) as i16;
                    sum += dst[k] as i32;
                    if dst[k].unsigned_abs() > dst[big].unsigned_abs() {
                        big = k;
                    }
                }
                if !dst.is_empty() {
                    dst[big] += ((1i32 << bits) - sum) as i16;
                }
            }
            FixedTaps { start: t.start, len: t.len, n, bits, weights }
        }
    }

    /// A centered square of side · shorter / floor(side / 0.875) source pixels, fractional
    /// offsets: a fixed window for the pinned resampling below (the evaluation crop's own
    /// geometry is `center_crop`'s, tested against torchvision apart).
    fn centered_square(w: usize, h: usize, side: usize) -> Region {
        let win = (side as f64 * w.min(h) as f64 / (side as f64 / 0.875).floor().max(side as f64)) as f32;
        Region { x0: (w as f32 - win) / 2.0, y0: (h as f32 - win) / 2.0, w: win, h: win }
    }

    /// FNV-1a over the output bits of a fixed set of resamplings: bilinear output (the default
    /// filter) is pinned, on both the f32 and the byte path, so that a change to what training
    /// sees is a deliberate one. The value is the fixed-point passes' (bit-identical with and
    /// without AVX2); their accuracy is tested against the exact filter above.
    #[test]
    fn bilinear_output_is_pinned() {
        let mut rng = SplitMix::new(77);
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut eat = |x: u32| {
            for b in x.to_le_bytes() {
                h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
        };
        for &(w, h_, side) in &[(500, 375, 224), (37, 29, 15), (3, 2, 9), (64, 48, 64), (17, 40, 33)] {
            let src: Vec<u8> = (0..w * h_ * 3).map(|_| rng.below(256) as u8).collect();
            for k in 0..3 {
                let (region, flip) = if k == 0 { (centered_square(w, h_, side), false) } else { (random_resized_crop(&mut rng, w, h_, [0.08, 1.0], [0.75, 4.0 / 3.0]), rng.coin()) };
                let mut out = vec![0f32; 3 * side * side];
                resample(&src, w, h_, region, side, flip, Interpolation::Bilinear, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], &mut out);
                out.iter().for_each(|v| eat(v.to_bits()));
                let mut bytes = vec![0u8; 3 * side * side];
                resample_u8(&src, w, h_, region, side, flip, Interpolation::Bilinear, &mut bytes);
                bytes.iter().for_each(|&b| eat(b as u32));
            }
        }
        assert_eq!(h, 11_953_730_176_010_735_525, "bilinear resampling changed");
    }

    /// Pillow's `precompute_coeffs` in f64: for each of `side` outputs over [in0, in1) of an axis
    /// of `in_size` pixels, the first source pixel and the count, and the normalized weights.
    fn pil_coeffs(in_size: usize, in0: f64, in1: f64, side: usize, filter: fn(f64) -> f64, support: f64) -> (Vec<(usize, usize)>, Vec<Vec<f64>>) {
        let scale = (in1 - in0) / side as f64;
        let filterscale = scale.max(1.0);
        let support = support * filterscale;
        let mut bounds = Vec::new();
        let mut kk = Vec::new();
        for xx in 0..side {
            let center = in0 + (xx as f64 + 0.5) * scale;
            let ss = 1.0 / filterscale;
            // C's (int) truncates toward zero; negatives are clamped to 0 anyway.
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize - xmin;
            let mut k: Vec<f64> = (0..xmax).map(|x| filter((x as f64 + xmin as f64 - center + 0.5) * ss)).collect();
            let ww: f64 = k.iter().sum();
            if ww != 0.0 {
                k.iter_mut().for_each(|v| *v /= ww);
            }
            kk.push(k);
            bounds.push((xmin, xmax));
        }
        (bounds, kk)
    }

    /// The same separable filter as [`pil_resample`] evaluated exactly in f64, no rounding in
    /// between (the intermediate and the result clipped to 0..=255 when `clip`): what the fixed
    /// point approximates. Returns (side, side, 3) HWC values.
    fn exact_resample(src: &[u8], width: usize, height: usize, bx: [f64; 4], side: usize, filter: fn(f64) -> f64, support: f64, clip: bool) -> Vec<f64> {
        let (bh, kh) = pil_coeffs(width, bx[0], bx[2], side, filter, support);
        let (bv, kv) = pil_coeffs(height, bx[1], bx[3], side, filter, support);
        let c = |v: f64| if clip { v.clamp(0.0, 255.0) } else { v };
        let mut tmp = vec![0f64; height * side * 3];
        for y in 0..height {
            for xx in 0..side {
                let (xmin, xmax) = bh[xx];
                for ch in 0..3 {
                    let s: f64 = (0..xmax).map(|x| src[(y * width + xmin + x) * 3 + ch] as f64 * kh[xx][x]).sum();
                    tmp[(y * side + xx) * 3 + ch] = c(s);
                }
            }
        }
        let mut out = vec![0f64; side * side * 3];
        for yy in 0..side {
            let (ymin, ymax) = bv[yy];
            for xx in 0..side {
                for ch in 0..3 {
                    let s: f64 = (0..ymax).map(|y| tmp[((ymin + y) * side + xx) * 3 + ch] * kv[yy][y]).sum();
                    out[(yy * side + xx) * 3 + ch] = c(s);
                }
            }
        }
        out
    }

    /// PIL's `ImagingResample` (Pillow's libImaging/Resample.c) for 8-bit RGB with a box,
    /// transcribed: f64 coefficients (`precompute_coeffs`), converted to 22-bit fixed point
    /// (`normalize_coeffs_8bpc`), horizontal pass into a byte image (rounded, clipped), then the
    /// vertical pass into bytes; a pass is skipped where PIL skips it. Returns (side, side, 3)
    /// HWC bytes.
    fn pil_resample(src: &[u8], width: usize, height: usize, bx: [f64; 4], side: usize, filter: fn(f64) -> f64, support: f64) -> Vec<u8> {
        const PRECISION_BITS: u32 = 32 - 8 - 2;
        let coeffs = |in_size: usize, in0: f64, in1: f64| -> (Vec<(usize, usize)>, Vec<Vec<i64>>) {
            let (bounds, k) = pil_coeffs(in_size, in0, in1, side, filter, support);
            let one = (1i64 << PRECISION_BITS) as f64;
            (bounds, k.iter().map(|k| k.iter().map(|&v| if v < 0.0 { (-0.5 + v * one) as i64 } else { (0.5 + v * one) as i64 }).collect()).collect())
        };
        let clip8 = |v: i64| (v >> PRECISION_BITS).clamp(0, 255) as u8;
        let (bh, kh) = coeffs(width, bx[0], bx[2]);
        let (bv, kv) = coeffs(height, bx[1], bx[3]);
        let need_h = side != width || bx[0] != 0.0 || bx[2] != side as f64;
        let need_v = side != height || bx[1] != 0.0 || bx[3] != side as f64;
        // Horizontal pass over the rows the vertical pass reads.
        let (y_first, y_last) = (bv[0].0, bv[side - 1].0 + bv[side - 1].1);
        let (tmp, tw, y_off) = if need_h {
            let mut tmp = vec![0u8; (y_last - y_first) * side * 3];
            for y in y_first..y_last {
                for xx in 0..side {
                    let (xmin, xmax) = bh[xx];
                    for c in 0..3 {
                        let mut ss = 1i64 << (PRECISION_BITS - 1);
                        for x in 0..xmax {
                            ss += src[(y * width + xmin + x) * 3 + c] as i64 * kh[xx][x];
                        }
                        tmp[((y - y_first) * side + xx) * 3 + c] = clip8(ss);
                    }
                }
            }
            (tmp, side, y_first)
        } else {
            (src.to_vec(), width, 0)
        };
        if !need_v {
            return tmp;
        }
        let mut out = vec![0u8; side * side * 3];
        for yy in 0..side {
            let (ymin, ymax) = bv[yy];
            for xx in 0..tw {
                for c in 0..3 {
                    let mut ss = 1i64 << (PRECISION_BITS - 1);
                    for y in 0..ymax {
                        ss += tmp[((ymin - y_off + y) * tw + xx) * 3 + c] as i64 * kv[yy][y];
                    }
                    out[(yy * side + xx) * 3 + c] = clip8(ss);
                }
            }
        }
        out
    }

    // Pillow's `bilinear_filter` and `bicubic_filter`, written out here rather than taken from
    // the code under test.
    fn bilinear(x: f64) -> f64 {
        let x = x.abs();
        if x < 1.0 {
            1.0 - x
        } else {
            0.0
        }
    }
    fn pil_bicubic(x: f64) -> f64 {
        let a = -0.5;
        let x = x.abs();
        if x < 1.0 {
            ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
        } else if x < 2.0 {
            (((x - 5.0) * x + 8.0) * x - 4.0) * a
        } else {
            0.0
        }
    }

    /// The fixed-point passes against the exact evaluation of the same filter, on fresh random
    /// images and windows, down- and upscaling (to 1/30), both filters: the f32 output within
    /// 0.05 of a level everywhere (the tolerance the GPU's f32 resampling is held to against
    /// this path in `selftest`) and within 0.01 on average.
    #[test]
    fn fixed_point_is_within_a_twentieth_of_a_level_of_exact() {
        let seed = hash(&[std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)]);
        let mut rng = SplitMix::new(seed);
        let sizes = [(500, 375, 224), (640, 480, 224), (2000, 1500, 64), (37, 29, 16), (7, 5, 23), (301, 199, 7), (160, 120, 224)];
        for (filter, kernel, support) in [(Interpolation::Bicubic, pil_bicubic as fn(f64) -> f64, 2.0), (Interpolation::Bilinear, bilinear as fn(f64) -> f64, 1.0)] {
            let (mut worst, mut sum, mut count) = (0f64, 0f64, 0usize);
            for &(w, h, side) in &sizes {
                let src: Vec<u8> = (0..w * h * 3).map(|_| rng.below(256) as u8).collect();
                for k in 0..3 {
                    let region = if k == 0 { center_crop(w, h, side, 0.875) } else { random_resized_crop(&mut rng, w, h, [0.08, 1.0], [0.75, 4.0 / 3.0]) };
                    let (x0, y0) = (region.x0 as f64, region.y0 as f64);
                    let want = exact_resample(&src, w, h, [x0, y0, x0 + region.w as f64, y0 + region.h as f64], side, kernel, support, filter == Interpolation::Bicubic);
                    let mut got = vec![0f32; 3 * side * side];
                    resample(&src, w, h, region, side, false, filter, ID_MEAN, ID_STD, &mut got);
                    let plane = side * side;
                    for p in 0..plane {
                        for c in 0..3 {
                            let d = (got[c * plane + p] as f64 - want[p * 3 + c]).abs();
                            assert!(d <= 0.05, "seed {seed} {filter:?} {w}x{h} -> {side}, {region:?}: pixel {p} channel {c}: {} vs exact {}", got[c * plane + p], want[p * 3 + c]);
                            worst = worst.max(d);
                            sum += d;
                            count += 1;
                        }
                    }
                }
            }
            let mean = sum / count as f64;
            eprintln!("{filter:?} fixed point vs exact: mean |Δ| {mean:.5}, max {worst:.4} levels");
            assert!(mean <= 0.01, "seed {seed} {filter:?}: mean |Δ| {mean} levels");
        }
    }

    /// Bicubic against the transcription of PIL above (which is what torchvision's
    /// `Resize(..., BICUBIC)` runs on PIL images) on random images — the case where bicubic
    /// overshoots most — down- and upscaling, odd sizes, integer (RandomResizedCrop) and
    /// fractional (center crop) windows, flips: the bytes within one level of PIL's
    /// everywhere, the f32 output within one level plus PIL's rounding in between. Bilinear is
    /// checked against PIL's bilinear the same way (it was built to match it).
    #[test]
    fn bicubic_matches_pil() {
        let mut rng = SplitMix::new(21);
        let sizes = [(500, 375, 224), (375, 500, 224), (37, 29, 16), (7, 5, 23), (16, 16, 31), (64, 64, 64), (301, 199, 7), (3, 2, 9), (33, 47, 33)];
        for (filter, kernel, support) in [(Interpolation::Bicubic, pil_bicubic as fn(f64) -> f64, 2.0), (Interpolation::Bilinear, bilinear as fn(f64) -> f64, 1.0)] {
            let (mut worst, mut worst_f, mut differ, mut total) = (0i32, 0f32, 0usize, 0usize);
            for &(w, h, side) in &sizes {
                let src: Vec<u8> = (0..w * h * 3).map(|_| rng.below(256) as u8).collect();
                for k in 0..5 {
                    let (region, flip) = if k == 0 { (center_crop(w, h, side, 0.875), false) } else { (random_resized_crop(&mut rng, w, h, [0.08, 1.0], [0.75, 4.0 / 3.0]), k % 2 == 0) };
                    let (x0, y0) = (region.x0 as f64, region.y0 as f64);
                    let want = pil_resample(&src, w, h, [x0, y0, x0 + region.w as f64, y0 + region.h as f64], side, kernel, support);
                    let mut got = vec![0u8; 3 * side * side];
                    resample_u8(&src, w, h, region, side, flip, filter, &mut got);
                    let mut raw = vec![0f32; 3 * side * side];
                    resample(&src, w, h, region, side, flip, filter, ID_MEAN, ID_STD, &mut raw);
                    let plane = side * side;
                    for y in 0..side {
                        for x in 0..side {
                            let sx = if flip { side - 1 - x } else { x };
                            for c in 0..3 {
                                let p = want[(y * side + sx) * 3 + c];
                                let (g, r) = (got[(y * side + x) * 3 + c], raw[c * plane + y * side + x]);
                                let (d, df) = ((g as i32 - p as i32).abs(), (r - p as f32).abs());
                                assert!(d <= 1 && df <= 1.5, "{filter:?} {w}x{h} -> {side}, {region:?}, pixel ({y}, {x}) channel {c}: {g} / {r} vs PIL {p}");
                                worst = worst.max(d);
                                worst_f = worst_f.max(df);
                                differ += usize::from(d != 0);
                                total += 1;
                            }
                        }
                    }
                }
            }
            eprintln!("{filter:?} vs PIL: {differ} of {total} bytes differ (by at most {worst}); f32 output within {worst_f:.3}");
        }
    }

    #[test]
    fn identity_region_is_exact() {
        let (w, h) = (7, 7);
        let src: Vec<u8> = (0..w * h * 3).map(|i| (i * 5 % 256) as u8).collect();
        for filter in [Interpolation::Bilinear, Interpolation::Bicubic] {
            let mut out = vec![0f32; 3 * 49];
            resample(&src, w, h, Region { x0: 0.0, y0: 0.0, w: 7.0, h: 7.0 }, 7, false, filter, ID_MEAN, ID_STD, &mut out);
            for y in 0..7 {
                for x in 0..7 {
                    for c in 0..3 {
                        assert!((out[c * 49 + y * 7 + x] - src[(y * 7 + x) * 3 + c] as f32).abs() < 1e-3);
                    }
                }
            }
            let mut flipped = vec![0f32; 3 * 49];
            resample(&src, w, h, Region { x0: 0.0, y0: 0.0, w: 7.0, h: 7.0 }, 7, true, filter, ID_MEAN, ID_STD, &mut flipped);
            assert!((flipped[3 * 7] - out[3 * 7 + 6]).abs() < 1e-3);
        }
    }

    #[test]
    fn downscale_averages_and_constant_stays_constant() {
        // 2× downscale of a checkerboard is flat grey (antialiased), not aliased stripes.
        let (w, h) = (16, 16);
        let src: Vec<u8> = (0..w * h).flat_map(|i| if (i % w + i / w) % 2 == 0 { [0u8; 3] } else { [200u8; 3] }).collect();
        for filter in [Interpolation::Bilinear, Interpolation::Bicubic] {
            let mut out = vec![0f32; 3 * 64];
            resample(&src, w, h, Region { x0: 0.0, y0: 0.0, w: 16.0, h: 16.0 }, 8, false, filter, ID_MEAN, ID_STD, &mut out);
            for v in &out {
                assert!((v - 100.0).abs() < 15.0, "{filter:?}: {v}");
            }
            // Constant images stay constant, down- and upscaled.
            let flat = vec![77u8; 30 * 20 * 3];
            for side in [10, 45] {
                let mut out = vec![0f32; 3 * side * side];
                resample(&flat, 30, 20, center_crop(30, 20, side, 0.875), side, true, filter, ID_MEAN, ID_STD, &mut out);
                assert!(out.iter().all(|v| (v - 77.0).abs() < 1e-3), "{filter:?} {side}");
            }
        }
    }

    #[test]
    fn rrc_windows_are_inside_and_follow_the_ranges() {
        let mut rng = SplitMix::new(1);
        for _ in 0..500 {
            let r = random_resized_crop(&mut rng, 500, 375, [0.08, 1.0], [0.75, 4.0 / 3.0]);
            assert!(r.x0 >= 0.0 && r.y0 >= 0.0 && r.x0 + r.w <= 500.0 && r.y0 + r.h <= 375.0, "{r:?}");
            assert!(r.w * r.h >= 0.07 * 500.0 * 375.0 || r.w == 500.0 || r.h == 375.0);
        }
        // Impossible ratio: falls back to a centered, clamped crop.
        let r = random_resized_crop(&mut rng, 100, 10, [0.9, 1.0], [1.0, 1.0]);
        assert_eq!(r, Region { x0: 45.0, y0: 0.0, w: 10.0, h: 10.0 });
    }

    #[test]
    fn center_crop_matches_timm() {
        // 512 × 384 at 224, crop_pct 0.875: torchvision resizes to 341 × 256 (int(256 · 512 /
        // 384)) and crops at left round(58.5) = 58 (half to even), top 16; in source pixels
        // x scales by 512/341, y by 384/256 = 1.5.
        let r = center_crop(512, 384, 224, 0.875);
        let sx = 512.0 / 341.0;
        let want = Region { x0: (58.0 * sx) as f32, y0: 24.0, w: (224.0 * sx) as f32, h: 336.0 };
        assert!((r.x0 - want.x0).abs() < 1e-4 && (r.y0 - want.y0).abs() < 1e-4 && (r.w - want.w).abs() < 1e-4 && (r.h - want.h).abs() < 1e-4, "{r:?} vs {want:?}");
        // portrait, an odd margin rounded up to even: 375 × 500 at 64 → 73 × 97, left round(4.5) = 4,
        // top round(16.5) = 16
        let r = center_crop(375, 500, 64, 0.875);
        let (sx, sy) = (375.0 / 73.0, 500.0 / 97.0);
        assert!((r.x0 - (4.0 * sx) as f32).abs() < 1e-4 && (r.y0 - (16.0 * sy) as f32).abs() < 1e-4 && (r.w - (64.0 * sx) as f32).abs() < 1e-4, "{r:?}");
    }
}
