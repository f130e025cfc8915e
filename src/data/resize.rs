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

/// Filter taps of one axis: output i reads source indices `start[i]..start[i] + len[i]` with
/// weights `weights[i * n..][..len[i]]` (rows padded to the widest tap count `n`). Zero-weight
/// taps at the ends are trimmed so the inner loops do no useless work.
struct Taps {
    start: Vec<usize>,
    len: Vec<usize>,
    n: usize,
    weights: Vec<f32>,
}

/// PIL's bicubic kernel (Keys' cubic convolution, a = −0.5; zero from |x| = 2 on).
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

fn taps(src_len: usize, r0: f32, rlen: f32, out_len: usize, filter: Interpolation) -> Taps {
    let scale = rlen / out_len as f32;
    // Kernel of radius 1 (bilinear) or 2 (bicubic) output pixels, widened by the downscale
    // factor (antialiasing).
    let fscale = scale.max(1.0);
    let support = match filter {
        Interpolation::Bilinear => fscale,
        Interpolation::Bicubic => 2.0 * fscale,
    };
    let n = (support.ceil() as usize) * 2 + 1;
    // Bicubic follows PIL's `precompute_coeffs` in f64 (bilinear keeps its f32 arithmetic,
    // which its outputs are pinned to).
    let (scale64, fscale64) = (rlen as f64 / out_len as f64, (rlen as f64 / out_len as f64).max(1.0));
    let mut start = Vec::with_capacity(out_len);
    let mut len = Vec::with_capacity(out_len);
    let mut weights = vec![0f32; out_len * n];
    // f64 weights of one output (bicubic), normalized before they are stored as f32.
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
                    // Window entirely outside the image (can't happen for valid regions): nearest pixel.
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
                    // Window entirely outside the image (can't happen for valid regions).
                    k64[0] = 1.0;
                    sum = 1.0;
                }
                for (wk, &k) in w.iter_mut().zip(k64.iter()) {
                    *wk = (k / sum) as f32;
                }
                (lo, hi)
            }
        };
        // Trim zero weights at both ends.
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

/// Fractional bits of the horizontal pass's output (a byte value ·2^7 in an i16), and its
/// largest value: 255 at that scale. 1/128 of a level is far below what the filters resolve.
const MID_BITS: u32 = 7;
const MID_MAX: i32 = 255 << MID_BITS;

/// [`Taps`] in fixed point for the integer passes: each weight times 2^`bits`, rounded to an
/// i16, with the rounding residual added to the output's largest weight so that every output's
/// weights still sum to exactly 2^`bits` (a flat image stays flat); `n` is the tap stride,
/// rounded up to even because the vector passes take taps in pairs (the padding weighs 0).
struct FixedTaps {
    start: Vec<usize>,
    len: Vec<usize>,
    n: usize,
    bits: u32,
    weights: Vec<i16>,
}

/// Quantizes `t` to the most fractional bits (at most `max_bits`, at least `min_bits`) for
/// which every weight, after the residual, fits an i16 and no output's sum of |weight| ×
/// `input_max` can leave an i32: the precision adapts to the filter, so a strong downscale
/// (many small weights) keeps as many significant bits per weight as a copy does.
fn fixed_taps(t: Taps, max_bits: u32, min_bits: u32, input_max: f64) -> FixedTaps {
    let outputs = t.start.len();
    let (mut max_w, mut max_abs_sum) = (0f64, 0f64);
    for i in 0..outputs {
        let w = &t.weights[i * t.n..i * t.n + t.len[i]];
        max_w = w.iter().fold(max_w, |m, &x| m.max((x as f64).abs()));
        max_abs_sum = max_abs_sum.max(w.iter().map(|&x| (x as f64).abs()).sum());
    }
    let fits = |bits: u32| {
        let s = (1u64 << bits) as f64;
        // Margins: the residual moves one weight by at most n/2 units, and the vector passes add
        // pairs of products, which the i32 bound covers.
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
            // Rounded half away from zero, as f64::round, without its library call (the cast
            // truncates); in range by `fits`: |x|·2^bits + n ≤ i16::MAX.
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

thread_local! {
    // Scratch buffers per worker thread (a padded copy of a source row where reading in place
    // could run past the image, the horizontal-pass rows, one f32 output row), reused across
    // images.
    static SCRATCH: RefCell<(Vec<u8>, Vec<i16>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Pixels of the horizontal-pass rows and of the rows handed to the sink are 4 lanes (R, G, B
/// and an unused 0), so that one pixel is one SIMD lane group.
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

/// The slot of pixel j of a group of four in the AVX2 passes' horizontal-pass rows (pixels 1
/// and 2 swapped; the order is its own inverse). [`hpass_fixed_avx2`] stores two column pairs
/// with one pack, which interleaves them this way, and [`vpass_fixed_avx2`]'s unpacking of
/// lanes undoes it, so neither pass spends a lane-crossing shuffle on order.
const GROUP_SLOT: [usize; 4] = [0, 2, 1, 3];

/// [`hpass_fixed`] with AVX2, two output columns per 256-bit vector and two taps per
/// multiply-add: for column pair `pr` and tap pair `kk`, `pairs[(pr · n/2 + kk) · 16..][..16]`
/// holds (w_2kk, w_2kk+1) three times and two zeros, for the left column and then the right one
/// (zero past a column's tap count). Pixels are stored in groups of four in [`GROUP_SLOT`]
/// order, which only [`vpass_fixed_avx2`] reads.
///
/// # Safety
/// The CPU has AVX2, and every column's tap pairs read inside `row`: `c.len ≤ n` and
/// `3(c.start + n) + 10 ≤ row.len()` (the last pair starts at 3(start + n − 2) and reads 16
/// bytes). The caller checks this once per image rather than once per row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn hpass_fixed_avx2(row: &[u8], cols: &[Col], weights: &[i16], pairs: &[i16], n: usize, bits: u32, out: &mut [i16]) {
    use std::arch::x86_64::*;
    let groups = cols.len() / 4;
    assert!(n % 2 == 0 && pairs.len() >= cols.len() / 2 * n * 8 && out.len() >= cols.len().next_multiple_of(4) * LANES);
    // Bytes (R_k G_k B_k R_k+1 G_k+1 B_k+1) to words (R_k R_k+1 G_k G_k+1 B_k B_k+1 0 0).
    let shuffle = _mm256_setr_epi8(0, -128, 3, -128, 1, -128, 4, -128, 2, -128, 5, -128, -128, -128, -128, -128, 0, -128, 3, -128, 1, -128, 4, -128, 2, -128, 5, -128, -128, -128, -128, -128);
    let shift = _mm256_set1_epi32((bits - MID_BITS) as i32);
    let round = _mm256_set1_epi32(1 << (bits - MID_BITS - 1));
    let (zero, max) = (_mm256_setzero_si256(), _mm256_set1_epi32(MID_MAX));
    // One column pair's four sums per lane, rounded to MID_BITS and clamped.
    let pair = |pr: usize| {
        let (c0, c1) = (cols[2 * pr], cols[2 * pr + 1]);
        let len = c0.len.max(c1.len);
        // SAFETY: AVX2 and the reads inside `row` are the caller's part (see above); the
        // weights are inside `pairs` by the assertion above.
        unsafe {
            let (p0, p1) = (row.as_ptr().add(3 * c0.start), row.as_ptr().add(3 * c1.start));
            let w = pairs.as_ptr().add(pr * n * 8);
            let mut acc = zero;
            let mut k = 0;
            while k < len {
                let a = _mm_loadu_si128(p0.add(3 * k) as *const __m128i);
                let b = _mm_loadu_si128(p1.add(3 * k) as *const __m128i);
                let v = _mm256_shuffle_epi8(_mm256_set_m128i(b, a), shuffle);
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(v, _mm256_loadu_si256(w.add(8 * k) as *const __m256i)));
                k += 2;
            }
            _mm256_min_epi32(_mm256_max_epi32(_mm256_srav_epi32(_mm256_add_epi32(acc, round), shift), zero), max)
        }
    };
    for g in 0..groups {
        let (t01, t23) = (pair(2 * g), pair(2 * g + 1));
        // SAFETY: the 16 words of group g are inside `out` by the assertion above.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr().add(16 * g) as *mut __m256i, _mm256_packs_epi32(t01, t23)) };
    }
    // The last cols.len() % 4 pixels, in the same slots.
    let first = 4 * groups;
    let mut tail = [0i16; 4 * LANES];
    hpass_fixed(row, &cols[first..], weights, bits, &mut tail);
    for j in 0..cols.len() - first {
        let at = (first + GROUP_SLOT[j]) * LANES;
        out[at..at + LANES].copy_from_slice(&tail[j * LANES..(j + 1) * LANES]);
    }
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

/// [`vpass_fixed`] with AVX2 on rows in [`GROUP_SLOT`] order, giving `out` in pixel order: 16
/// values (four pixels) per step, two rows per multiply-add (the rows' values interleaved in
/// pairs), the sums kept in registers over all taps. `out.len()` is a multiple of 16, at most
/// the rows' length.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn vpass_fixed_avx2(rows: RingRows, w: &[i16], finish: Finish, out: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(out.len() % 16 == 0 && out.len() <= rows.row_len);
    let len = w.len();
    // The rows' addresses, on the stack for the usual tap counts.
    let mut stack = [std::ptr::null::<i16>(); 64];
    let heap: Vec<*const i16>;
    let ptrs: &[*const i16] = if len <= stack.len() {
        stack.iter_mut().enumerate().take(len).for_each(|(k, p)| *p = rows.row(k).as_ptr());
        &stack[..len]
    } else {
        heap = (0..len).map(|k| rows.row(k).as_ptr()).collect();
        &heap
    };
    let [m0, m1, m2, m3] = finish.mul;
    let [s0, s1, s2, s3] = finish.sub;
    let (mul, sub) = (_mm256_setr_ps(m0, m1, m2, m3, m0, m1, m2, m3), _mm256_setr_ps(s0, s1, s2, s3, s0, s1, s2, s3));
    let (zero, top) = (_mm256_setzero_si256(), _mm256_set1_epi32(finish.clamp.unwrap_or(i32::MAX)));
    let clamp = finish.clamp.is_some();
    let mut i = 0;
    while i < out.len() {
        // SAFETY: AVX2 is enabled for this function; every row holds row_len ≥ out.len() values
        // and i + 16 ≤ out.len().
        unsafe {
            let (mut lo, mut hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            let mut k = 0;
            while k < len {
                // An odd last tap is paired with itself at weight 0.
                let (kb, wb) = if k + 1 < len { (k + 1, w[k + 1]) } else { (k, 0) };
                let wv = _mm256_set1_epi32((w[k] as u16 as u32 | (wb as u16 as u32) << 16) as i32);
                let a = _mm256_loadu_si256(ptrs[k].add(i) as *const __m256i);
                let b = _mm256_loadu_si256(ptrs[kb].add(i) as *const __m256i);
                // Per 128-bit lane: values 0–3 (lo) and 4–7 (hi) of the lane's eight.
                lo = _mm256_add_epi32(lo, _mm256_madd_epi16(_mm256_unpacklo_epi16(a, b), wv));
                hi = _mm256_add_epi32(hi, _mm256_madd_epi16(_mm256_unpackhi_epi16(a, b), wv));
                k += 2;
            }
            if clamp {
                lo = _mm256_min_epi32(_mm256_max_epi32(lo, zero), top);
                hi = _mm256_min_epi32(_mm256_max_epi32(hi, zero), top);
            }
            // In GROUP_SLOT order the lanes hold pixels (0, 2 | 1, 3): lo is pixels 0 and 1, hi
            // pixels 2 and 3. Multiply, then subtract (no fused multiply-add, as the scalar path).
            _mm256_storeu_ps(out.as_mut_ptr().add(i), _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(lo), mul), sub));
            _mm256_storeu_ps(out.as_mut_ptr().add(i + 8), _mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(hi), mul), sub));
        }
        i += 16;
    }
}

/// Whether the AVX2 code paths may run.
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The separable antialiased resampling with `filter` of `region` of the (height, width, 3)
/// HWC image `src` to `side` × `side`, mirrored when `flip`: hands each output row, as `side`
/// pixels of 4 f32 (R, G, B, unused) in source units (0..=255), to `sink(row_index, row)`.
///
/// The passes run in fixed point (as PIL's and Pillow-SIMD's do): weights as i16 with as many
/// fractional bits as the filter allows ([`fixed_taps`]), the horizontal pass from the source
/// bytes into i16 values with 7 fractional bits (rounded; clamped to 0..=255 for bicubic, as
/// PIL clips its intermediate image), the vertical pass into exact i32 sums, converted to f32
/// once. Integer sums do not depend on their order, so the AVX2 and the scalar paths give the
/// same bits on every machine. Against an exact evaluation of the same filter the error is
/// a small fraction of a level (tested).
#[allow(clippy::too_many_arguments)]
pub fn resample_rows(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, sink: impl FnMut(usize, &[f32])) {
    resample_rows_on(src, width, height, region, side, flip, filter, IDENTITY, has_avx2(), sink)
}

/// Per-channel `v · mul − sub` applied to the resampled values (source units) as the rows are
/// finished: [`resample`]'s normalization, or the identity.
#[derive(Clone, Copy)]
struct Affine {
    mul: [f32; 3],
    sub: [f32; 3],
}

const IDENTITY: Affine = Affine { mul: [1.0; 3], sub: [0.0; 3] };

/// [`resample_rows`] with `affine` applied to the values and the AVX2 paths on or off (`avx2`
/// only where the CPU has it). Folding `affine` into the vertical pass's conversion gives the
/// same bits as applying it to the rows afterwards: the fixed-point scale is a power of two.
#[allow(clippy::too_many_arguments)]
fn resample_rows_on(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, affine: Affine, avx2: bool, mut sink: impl FnMut(usize, &[f32])) {
    debug_assert_eq!(src.len(), width * height * 3);
    let tx = fixed_taps(taps(width, region.x0, region.w, side, filter), 22, MID_BITS + 1, 255.0);
    let ty = fixed_taps(taps(height, region.y0, region.h, side, filter), 22, 1, MID_MAX as f64);
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
    // Values per horizontal-pass row: side pixels, padded to the vertical pass's 16.
    let row_len = (side * LANES).next_multiple_of(16);
    // Horizontal-pass rows live in a ring of `ring` rows: output rows read consecutive source
    // rows whose start never decreases, so the last `ty.n` computed rows are all that is ever
    // needed (a few KiB that stay in L1, instead of the whole window). Should the starts not be
    // monotonic, the ring holds every row.
    let monotonic = ty.start.windows(2).all(|w| w[0] <= w[1]);
    let ring = if monotonic { ty.n.min(rows).max(1) } else { rows };
    // For the AVX2 horizontal pass: each column pair's weights, tap pair by tap pair.
    let n = tx.n;
    let mut pairs = Vec::new();
    if avx2 {
        pairs.resize(side / 2 * n * 8, 0i16);
        for (pr, chunk) in pairs.chunks_exact_mut(n * 8).enumerate() {
            for (kk, block) in chunk.chunks_exact_mut(16).enumerate() {
                for (half, c) in [cols[2 * pr], cols[2 * pr + 1]].into_iter().enumerate() {
                    for (j, k) in [2 * kk, 2 * kk + 1].into_iter().enumerate() {
                        let w = if k < c.len { tx.weights[c.w + k] } else { 0 };
                        for ch in 0..3 {
                            block[8 * half + 2 * ch + j] = w;
                        }
                    }
                }
            }
        }
    }
    // Bytes a row's horizontal pass may read from its span's start: the span, the widest
    // column's padding taps, and the 16-byte loads' overhang.
    let span_bytes = 3 * (col_hi - col_lo + n) + 16;
    // What hpass_fixed_avx2 needs of every row handed to it (each is span_bytes long).
    assert!(cols.iter().all(|c| c.len <= n && 3 * (c.start + n) + 10 <= span_bytes));
    let scale = 1.0 / (1u64 << (MID_BITS + ty.bits)) as f32;
    let finish = Finish {
        clamp: clip.then(|| (255i64 << (MID_BITS + ty.bits)).min(i32::MAX as i64) as i32),
        mul: [affine.mul[0] * scale, affine.mul[1] * scale, affine.mul[2] * scale, 0.0],
        sub: [affine.sub[0], affine.sub[1], affine.sub[2], 0.0],
    };
    SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let (padded, tmp, acc) = &mut *guard;
        tmp.clear();
        tmp.resize(ring * row_len, 0);
        acc.clear();
        acc.resize(row_len, 0.0);
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
                let r = (next - row_lo) % ring;
                let trow = &mut tmp[r * row_len..(r + 1) * row_len];
                #[cfg(target_arch = "x86_64")]
                if avx2 {
                    // SAFETY: has_avx2() checked the CPU, the columns' reach is asserted above
                    // and `row` is span_bytes long.
                    unsafe { hpass_fixed_avx2(row, &cols, &tx.weights, &pairs, n, tx.bits, trow) };
                } else {
                    hpass_fixed(row, &cols, &tx.weights, tx.bits, trow);
                }
                #[cfg(not(target_arch = "x86_64"))]
                hpass_fixed(row, &cols, &tx.weights, tx.bits, trow);
                next += 1;
            }
            // Vertical pass: a weighted sum of whole rows (contiguous, vectorizable).
            let w = &ty.weights[oy * ty.n..oy * ty.n + len];
            let rows = RingRows { tmp: &tmp[..], row_len, ring, first: (s0 - row_lo) % ring };
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: has_avx2() checked the CPU; `acc` is row_len (a multiple of 16) long.
                unsafe { vpass_fixed_avx2(rows, w, finish, acc) };
            } else {
                vpass_fixed(rows, w, finish, acc);
            }
            #[cfg(not(target_arch = "x86_64"))]
            vpass_fixed(rows, w, finish, acc);
            sink(oy, &acc[..side * LANES]);
        }
    });
}

/// Resamples `region` of the (height, width, 3) HWC image `src` with `filter` to `out`
/// (3, side, side) CHW, mirrored when `flip`, normalized as `(v / 255 − mean) / std`.
#[allow(clippy::too_many_arguments)]
pub fn resample(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, mean: [f32; 3], std: [f32; 3], out: &mut [f32]) {
    debug_assert_eq!(out.len(), 3 * side * side);
    let plane = side * side;
    let affine = Affine { mul: [0, 1, 2].map(|c| 1.0 / (255.0 * std[c])), sub: [0, 1, 2].map(|c| mean[c] / std[c]) };
    let (out_r, rest) = out.split_at_mut(plane);
    let (out_g, out_b) = rest.split_at_mut(plane);
    // The rows come normalized; what is left is pixels (4 lanes) to planes.
    resample_rows_on(src, width, height, region, side, flip, filter, affine, has_avx2(), |oy, row| {
        let o = oy * side;
        let (r, g, b) = (&mut out_r[o..o + side], &mut out_g[o..o + side], &mut out_b[o..o + side]);
        #[allow(unused_mut)]
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;
            // SAFETY: SSE2 is baseline on x86-64; reads 4 pixels (16 floats) of `row` (side
            // pixels) and writes 4 floats of r, g, b (side each) per step, while done + 4 ≤ side.
            unsafe {
                let p = row.as_ptr();
                while done + 4 <= side {
                    let q = p.add(done * LANES);
                    let (mut a, mut b_, mut c, mut d) = (_mm_loadu_ps(q), _mm_loadu_ps(q.add(4)), _mm_loadu_ps(q.add(8)), _mm_loadu_ps(q.add(12)));
                    _MM_TRANSPOSE4_PS(&mut a, &mut b_, &mut c, &mut d);
                    _mm_storeu_ps(r.as_mut_ptr().add(done), a);
                    _mm_storeu_ps(g.as_mut_ptr().add(done), b_);
                    _mm_storeu_ps(b.as_mut_ptr().add(done), c);
                    done += 4;
                }
            }
        }
        for ox in done..side {
            r[ox] = row[ox * LANES];
            g[ox] = row[ox * LANES + 1];
            b[ox] = row[ox * LANES + 2];
        }
    });
}

/// [`resample`] to (side, side, 3) HWC bytes, each value rounded half up and clamped to
/// 0..=255 (what RandAugment works on).
#[allow(clippy::too_many_arguments)]
pub fn resample_u8(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, out: &mut [u8]) {
    debug_assert_eq!(out.len(), 3 * side * side);
    let avx2 = has_avx2();
    resample_rows_on(src, width, height, region, side, flip, filter, IDENTITY, avx2, |oy, row| {
        let o = &mut out[oy * side * 3..(oy + 1) * side * 3];
        #[allow(unused_mut)]
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: has_avx2() checked the CPU.
            done = unsafe { row_to_bytes_avx2(row, o) };
        }
        for (q, px) in o[done * 3..].chunks_exact_mut(3).zip(row[done * LANES..].chunks_exact(LANES)) {
            for c in 0..3 {
                // max/min, then a truncating cast: round half up without a library call.
                q[c] = (px[c].max(0.0) + 0.5).min(255.0) as u8;
            }
        }
    });
}

/// The leading pixels of a 4-lane row as RGB bytes, rounded as [`resample_u8`]'s scalar loop
/// (`(max(v, 0) + 0.5) min 255`, truncated), four pixels per step; returns how many it wrote.
/// Stops while a 16-byte store still fits in `out`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_to_bytes_avx2(row: &[f32], out: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let pixels = (row.len() / LANES).min(out.len() / 3);
    // Bytes (R G B 0) × 4 to (R G B) × 4, then four unused bytes.
    let compact = _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -128, -128, -128, -128);
    let (zero, half, max) = (_mm_setzero_ps(), _mm_set1_ps(0.5), _mm_set1_ps(255.0));
    let round = |v: __m128| _mm_cvttps_epi32(_mm_min_ps(_mm_add_ps(_mm_max_ps(v, zero), half), max));
    let mut done = 0;
    while done + 4 <= pixels && 3 * done + 16 <= out.len() {
        // SAFETY: pixels done..done + 4 are inside `row` and the 16 bytes written inside `out`
        // (loop condition); AVX2 (so SSSE3) is enabled for this function.
        unsafe {
            let p = row.as_ptr().add(done * LANES);
            let (a, b) = (round(_mm_loadu_ps(p)), round(_mm_loadu_ps(p.add(4))));
            let (c, d) = (round(_mm_loadu_ps(p.add(8))), round(_mm_loadu_ps(p.add(12))));
            let bytes = _mm_packus_epi16(_mm_packs_epi32(a, b), _mm_packs_epi32(c, d));
            _mm_storeu_si128(out.as_mut_ptr().add(3 * done) as *mut __m128i, _mm_shuffle_epi8(bytes, compact));
        }
        done += 4;
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

    /// With and without the AVX2 paths, the rows are bit-identical (integer sums, zero-weight
    /// padding taps, the pixel order inside groups of four), for both filters and odd sizes.
    #[test]
    fn avx2_and_scalar_paths_agree_bitwise() {
        if !has_avx2() {
            return;
        }
        let mut rng = SplitMix::new(4);
        for &(w, h, side) in &[(500, 375, 224), (37, 29, 15), (3, 2, 9), (640, 480, 33)] {
            let src: Vec<u8> = (0..w * h * 3).map(|_| rng.below(256) as u8).collect();
            for filter in [Interpolation::Bilinear, Interpolation::Bicubic, Interpolation::Bilinear, Interpolation::Bicubic] {
                let region = random_resized_crop(&mut rng, w, h, [0.08, 1.0], [0.75, 4.0 / 3.0]);
                let flip = rng.coin();
                let mut rows = [Vec::new(), Vec::new()];
                for (k, avx) in [false, true].into_iter().enumerate() {
                    resample_rows_on(&src, w, h, region, side, flip, filter, IDENTITY, avx, |_, row| rows[k].extend(row.chunks_exact(LANES).flat_map(|p| p[..3].iter().map(|v| v.to_bits()))));
                }
                assert_eq!(rows[0], rows[1], "{w}x{h} -> {side}, {region:?}");
            }
        }
    }

    /// Tiny and odd shapes (1-px images and outputs, windows narrower than a pixel at fractional
    /// offsets, strong up- and downscales): both code paths give the same bits, every value in
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
                let mut rows = [Vec::new(), Vec::new()];
                let paths: &[bool] = if has_avx2() { &[false, true] } else { &[false] };
                for (k, &avx2) in paths.iter().enumerate() {
                    resample_rows_on(&src, w, h, region, side, flip, filter, IDENTITY, avx2, |_, row| rows[k].extend(row.chunks_exact(LANES).flat_map(|p| p[..3].to_vec())));
                }
                let what = format!("{w}x{h} -> {side}, {region:?}, {filter:?}");
                assert_eq!(rows[0].len(), 3 * side * side, "{what}");
                if has_avx2() {
                    assert!(rows[0].iter().zip(&rows[1]).all(|(a, b)| a.to_bits() == b.to_bits()), "{what}: AVX2 and scalar differ");
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
