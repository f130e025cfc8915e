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
//! leaves the range). PIL also *rounds* to bytes in between and computes in fixed point; this
//! keeps f32, which stays within one level of PIL's bytes (tested against a transcription of
//! PIL's `ImagingResample`).

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

/// Clamps a row of resampled values to the byte range (bicubic; see the module doc).
#[inline]
fn clip_row(row: &mut [f32]) {
    row.iter_mut().for_each(|v| *v = v.clamp(0.0, 255.0));
}

thread_local! {
    // Scratch buffers per worker thread (one source row as f32 pixels, horizontal-pass rows, one
    // accumulator row), reused across images.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Pixels are handled as 4 f32 lanes (R, G, B, unused) so that one pixel is one SIMD vector.
const LANES: usize = 4;

/// Source pixels `srow` (3 bytes each) to 4-lane f32 pixels. The fourth lane is unused: the
/// vector path fills it with the next byte, the scalar one leaves it; it never reaches an output.
fn convert_row(srow: &[u8], conv: &mut [f32]) {
    let n = srow.len() / 3;
    debug_assert!(conv.len() >= n * LANES);
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    #[cfg(target_arch = "x86_64")]
    let done = {
        use std::arch::x86_64::*;
        // Pixels whose 4-byte load stays inside `srow`.
        let vec_n = if srow.len() >= 4 { (srow.len() - 4) / 3 + 1 } else { 0 }.min(n);
        // SAFETY: SSE2 is baseline on x86-64; pixel j reads bytes 3j..3j+4 ≤ srow.len() (by
        // vec_n) and writes floats 4j..4j+4 ≤ conv.len().
        unsafe {
            let zero = _mm_setzero_si128();
            for j in 0..vec_n {
                let v = _mm_cvtsi32_si128(std::ptr::read_unaligned(srow.as_ptr().add(3 * j) as *const i32));
                let v = _mm_unpacklo_epi16(_mm_unpacklo_epi8(v, zero), zero);
                _mm_storeu_ps(conv.as_mut_ptr().add(LANES * j), _mm_cvtepi32_ps(v));
            }
        }
        vec_n
    };
    for (c, p) in conv[done * LANES..n * LANES].chunks_exact_mut(LANES).zip(srow[done * 3..].chunks_exact(3)) {
        c[0] = p[0] as f32;
        c[1] = p[1] as f32;
        c[2] = p[2] as f32;
    }
}

/// One output column's horizontal taps: first source pixel (relative to the converted span),
/// tap count, offset of its weights.
#[derive(Clone, Copy)]
struct Col {
    start: usize,
    len: usize,
    w: usize,
}

/// Horizontal pass of one source row: `trow[ox] = Σ_k w_k · conv[start + k]` (4 lanes), the
/// taps added in order from 0.
fn hpass_row(conv: &[f32], cols: &[Col], weights: &[f32], trow: &mut [f32]) {
    debug_assert!(trow.len() >= cols.len() * LANES);
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        for c in cols {
            assert!((c.start + c.len) * LANES <= conv.len() && c.w + c.len <= weights.len());
        }
        // SAFETY: SSE2 is baseline on x86-64; every read is within the bounds asserted above,
        // every write within trow (debug-asserted; cols.len() == side == trow.len() / 4).
        unsafe {
            let (cp, wp, tp) = (conv.as_ptr(), weights.as_ptr(), trow.as_mut_ptr());
            for (ox, c) in cols.iter().enumerate() {
                let mut a = _mm_setzero_ps();
                let (p, w) = (cp.add(c.start * LANES), wp.add(c.w));
                for k in 0..c.len {
                    a = _mm_add_ps(a, _mm_mul_ps(_mm_set1_ps(*w.add(k)), _mm_loadu_ps(p.add(k * LANES))));
                }
                _mm_storeu_ps(tp.add(ox * LANES), a);
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    for (t, c) in trow.chunks_exact_mut(LANES).zip(cols) {
        let mut a = [0f32; LANES];
        for (&wk, p) in weights[c.w..c.w + c.len].iter().zip(conv[c.start * LANES..].chunks_exact(LANES)) {
            for l in 0..LANES {
                a[l] += wk * p[l];
            }
        }
        t.copy_from_slice(&a);
    }
}

/// [`hpass_row`] two output pixels per 256-bit vector (AVX): `pairs` holds, per pair of output
/// columns and tap k < `n`, the 8 weights (left column's ×4, right column's ×4), zero past each
/// column's tap count, and `conv` ends in at least `n` zero pixels so the extra taps read
/// something finite. Adding 0·p changes no sum, so the result is bit-identical to
/// [`hpass_row`]'s.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn hpass_row_avx(conv: &[f32], cols: &[Col], weights: &[f32], pairs: &[f32], n: usize, trow: &mut [f32]) {
    use std::arch::x86_64::*;
    let half = cols.len() / 2;
    assert!(pairs.len() >= half * n * 8 && trow.len() >= cols.len() * LANES);
    for pr in 0..half {
        let (c0, c1) = (cols[2 * pr], cols[2 * pr + 1]);
        let len = c0.len.max(c1.len);
        assert!(len <= n && (c0.start + len) * LANES <= conv.len() && (c1.start + len) * LANES <= conv.len());
        // SAFETY: AVX is enabled for this function (the caller checked the CPU); the reads are
        // within the bounds asserted above, the write within trow.
        unsafe {
            let (p0, p1, w) = (conv.as_ptr().add(c0.start * LANES), conv.as_ptr().add(c1.start * LANES), pairs.as_ptr().add(pr * n * 8));
            let mut a = _mm256_setzero_ps();
            for k in 0..len {
                let v = _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(_mm_loadu_ps(p0.add(k * LANES))), _mm_loadu_ps(p1.add(k * LANES)));
                a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(w.add(k * 8)), v));
            }
            _mm256_storeu_ps(trow.as_mut_ptr().add(2 * pr * LANES), a);
        }
    }
    if cols.len() % 2 == 1 {
        let last = cols.len() - 1;
        hpass_row(conv, &cols[last..], weights, &mut trow[last * LANES..]);
    }
}

/// `acc[i] += w · row[i]`.
#[inline(always)]
fn axpy(acc: &mut [f32], row: &[f32], w: f32) {
    for (a, &t) in acc.iter_mut().zip(row) {
        *a += w * t;
    }
}

/// [`axpy`] compiled for AVX (8 lanes; the same operations per element).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn axpy_avx(acc: &mut [f32], row: &[f32], w: f32) {
    axpy(acc, row, w)
}

/// Whether the AVX code paths may run.
fn has_avx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx")
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
/// Per channel the arithmetic is one f32 multiply and add per tap in tap order, horizontal
/// pass first, whichever code path runs (SIMD lanes are the channels); the code paths only see
/// taps and weights, so they serve both filters.
#[allow(clippy::too_many_arguments)]
pub fn resample_rows(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, sink: impl FnMut(usize, &[f32])) {
    resample_rows_on(src, width, height, region, side, flip, filter, has_avx(), sink)
}

/// [`resample_rows`] with the AVX paths on or off (`avx` only where the CPU has it).
#[allow(clippy::too_many_arguments)]
fn resample_rows_on(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, avx: bool, mut sink: impl FnMut(usize, &[f32])) {
    debug_assert_eq!(src.len(), width * height * 3);
    let tx = taps(width, region.x0, region.w, side, filter);
    let ty = taps(height, region.y0, region.h, side, filter);
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
    let row_len = side * LANES;
    // Horizontal-pass rows live in a ring of `ring` rows: output rows read consecutive source
    // rows whose start never decreases, so the last `ty.n` computed rows are all that is ever
    // needed (a few KiB that stay in L1, instead of the whole window). Should the starts not be
    // monotonic, the ring holds every row.
    let monotonic = ty.start.windows(2).all(|w| w[0] <= w[1]);
    let ring = if monotonic { ty.n.min(rows).max(1) } else { rows };
    // For the AVX horizontal pass: the weights of each pair of output columns, interleaved.
    let n = tx.n;
    let pairs: Vec<f32> = if avx {
        let wt = |c: Col, k: usize| if k < c.len { tx.weights[c.w + k] } else { 0.0 };
        (0..side / 2)
            .flat_map(|pr| (0..n).flat_map(move |k| (0..8).map(move |l| (pr, k, l))))
            .map(|(pr, k, l)| wt(cols[2 * pr + l / 4], k))
            .collect()
    } else {
        Vec::new()
    };
    SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let (conv, tmp, acc) = &mut *guard;
        conv.clear();
        // n zero pixels past the span: the AVX pass's padded taps read them.
        conv.resize((col_hi - col_lo + n) * LANES, 0.0);
        tmp.clear();
        tmp.resize(ring * row_len, 0.0);
        acc.clear();
        acc.resize(row_len, 0.0);
        let mut next = row_lo;
        for oy in 0..side {
            let (s0, len) = (ty.start[oy], ty.len[oy]);
            // Horizontal pass of the source rows this output row needs and has not got yet.
            while next < (s0 + len).min(row_hi) {
                convert_row(&src[(next * width + col_lo) * 3..(next * width + col_hi) * 3], conv);
                let r = (next - row_lo) % ring;
                let trow = &mut tmp[r * row_len..(r + 1) * row_len];
                #[cfg(target_arch = "x86_64")]
                if avx {
                    // SAFETY: has_avx() checked the CPU.
                    unsafe { hpass_row_avx(conv, &cols, &tx.weights, &pairs, n, trow) };
                } else {
                    hpass_row(conv, &cols, &tx.weights, trow);
                }
                #[cfg(not(target_arch = "x86_64"))]
                hpass_row(conv, &cols, &tx.weights, trow);
                if clip {
                    clip_row(trow);
                }
                next += 1;
            }
            // Vertical pass: a weighted sum of whole rows (contiguous, vectorizable).
            let w = &ty.weights[oy * ty.n..oy * ty.n + len];
            acc.iter_mut().for_each(|v| *v = 0.0);
            for (kk, &wk) in w.iter().enumerate() {
                let r = (s0 + kk - row_lo) % ring;
                let row = &tmp[r * row_len..(r + 1) * row_len];
                #[cfg(target_arch = "x86_64")]
                if avx {
                    // SAFETY: has_avx() checked the CPU.
                    unsafe { axpy_avx(acc, row, wk) };
                } else {
                    axpy(acc, row, wk);
                }
                #[cfg(not(target_arch = "x86_64"))]
                axpy(acc, row, wk);
            }
            if clip {
                clip_row(acc);
            }
            sink(oy, acc);
        }
    });
}

/// Resamples `region` of the (height, width, 3) HWC image `src` with `filter` to `out`
/// (3, side, side) CHW, mirrored when `flip`, normalized as `(v / 255 − mean) / std`.
#[allow(clippy::too_many_arguments)]
pub fn resample(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, mean: [f32; 3], std: [f32; 3], out: &mut [f32]) {
    debug_assert_eq!(out.len(), 3 * side * side);
    let plane = side * side;
    let k = [1.0 / (255.0 * std[0]), 1.0 / (255.0 * std[1]), 1.0 / (255.0 * std[2])];
    let off = [mean[0] / std[0], mean[1] / std[1], mean[2] / std[2]];
    let (out_r, rest) = out.split_at_mut(plane);
    let (out_g, out_b) = rest.split_at_mut(plane);
    resample_rows(src, width, height, region, side, flip, filter, |oy, row| {
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
                let (k0, k1, k2) = (_mm_set1_ps(k[0]), _mm_set1_ps(k[1]), _mm_set1_ps(k[2]));
                let (o0, o1, o2) = (_mm_set1_ps(off[0]), _mm_set1_ps(off[1]), _mm_set1_ps(off[2]));
                let p = row.as_ptr();
                while done + 4 <= side {
                    let q = p.add(done * LANES);
                    let (mut a, mut b_, mut c, mut d) = (_mm_loadu_ps(q), _mm_loadu_ps(q.add(4)), _mm_loadu_ps(q.add(8)), _mm_loadu_ps(q.add(12)));
                    _MM_TRANSPOSE4_PS(&mut a, &mut b_, &mut c, &mut d);
                    _mm_storeu_ps(r.as_mut_ptr().add(done), _mm_sub_ps(_mm_mul_ps(a, k0), o0));
                    _mm_storeu_ps(g.as_mut_ptr().add(done), _mm_sub_ps(_mm_mul_ps(b_, k1), o1));
                    _mm_storeu_ps(b.as_mut_ptr().add(done), _mm_sub_ps(_mm_mul_ps(c, k2), o2));
                    done += 4;
                }
            }
        }
        for ox in done..side {
            let px = &row[ox * LANES..ox * LANES + 3];
            r[ox] = px[0] * k[0] - off[0];
            g[ox] = px[1] * k[1] - off[1];
            b[ox] = px[2] * k[2] - off[2];
        }
    });
}

/// [`resample`] to (side, side, 3) HWC bytes, each value rounded half up and clamped to
/// 0..=255 (what RandAugment works on).
#[allow(clippy::too_many_arguments)]
pub fn resample_u8(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, filter: Interpolation, out: &mut [u8]) {
    debug_assert_eq!(out.len(), 3 * side * side);
    resample_rows(src, width, height, region, side, flip, filter, |oy, row| {
        let o = &mut out[oy * side * 3..(oy + 1) * side * 3];
        #[allow(unused_mut)]
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::*;
            // SAFETY: SSE2 is baseline on x86-64; pixel ox reads floats 4ox..4ox+4 of `row` and
            // writes bytes 3ox..3ox+4 of `o`, which stays inside while ox + 1 < side.
            unsafe {
                let (zero, half, max) = (_mm_setzero_ps(), _mm_set1_ps(0.5), _mm_set1_ps(255.0));
                while done + 1 < side {
                    let v = _mm_loadu_ps(row.as_ptr().add(done * LANES));
                    // Same as the scalar path: (max(v, 0) + 0.5) min 255, truncated.
                    let i = _mm_cvttps_epi32(_mm_min_ps(_mm_add_ps(_mm_max_ps(v, zero), half), max));
                    let b = _mm_packus_epi16(_mm_packs_epi32(i, i), _mm_setzero_si128());
                    std::ptr::write_unaligned(o.as_mut_ptr().add(done * 3) as *mut i32, _mm_cvtsi128_si32(b));
                    done += 1;
                }
            }
        }
        for (q, px) in o[done * 3..].chunks_exact_mut(3).zip(row[done * LANES..].chunks_exact(LANES)) {
            for c in 0..3 {
                // max/min, then a truncating cast: round half up without a library call.
                q[c] = (px[c].max(0.0) + 0.5).min(255.0) as u8;
            }
        }
    });
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

    /// With and without the AVX paths, the rows are bit-identical (zero-weight padding taps and
    /// 8-lane sums change nothing), for both filters.
    #[test]
    fn avx_and_sse_paths_agree_bitwise() {
        if !has_avx() {
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
                    resample_rows_on(&src, w, h, region, side, flip, filter, avx, |_, row| rows[k].extend(row.chunks_exact(LANES).flat_map(|p| p[..3].iter().map(|v| v.to_bits()))));
                }
                assert_eq!(rows[0], rows[1], "{w}x{h} -> {side}, {region:?}");
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

    /// FNV-1a over the output bits of a fixed set of resamplings: bilinear output is pinned to
    /// the value it had before the filter became a choice (bicubic was added), on both the
    /// f32 and the byte path.
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
        assert_eq!(h, 1_255_401_191_373_502_608, "bilinear resampling changed");
    }

    /// PIL's `ImagingResample` (Pillow's libImaging/Resample.c) for 8-bit RGB with a box,
    /// transcribed: f64 coefficients (`precompute_coeffs`), converted to 22-bit fixed point
    /// (`normalize_coeffs_8bpc`), horizontal pass into a byte image (rounded, clipped), then the
    /// vertical pass into bytes; a pass is skipped where PIL skips it. Returns (side, side, 3)
    /// HWC bytes.
    fn pil_resample(src: &[u8], width: usize, height: usize, bx: [f64; 4], side: usize, filter: fn(f64) -> f64, support: f64) -> Vec<u8> {
        const PRECISION_BITS: u32 = 32 - 8 - 2;
        let coeffs = |in_size: usize, in0: f64, in1: f64| -> (Vec<(usize, usize)>, Vec<Vec<i64>>) {
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
                let one = (1i64 << PRECISION_BITS) as f64;
                kk.push(k.iter().map(|&v| if v < 0.0 { (-0.5 + v * one) as i64 } else { (0.5 + v * one) as i64 }).collect());
                bounds.push((xmin, xmax));
            }
            (bounds, kk)
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

    /// Bicubic against the transcription of PIL above (which is what torchvision's
    /// `Resize(..., BICUBIC)` runs on PIL images) on random images — the case where bicubic
    /// overshoots most — down- and upscaling, odd sizes, integer (RandomResizedCrop) and
    /// fractional (center crop) windows, flips: the bytes within one level of PIL's
    /// everywhere, the f32 output within one level plus PIL's rounding in between. Bilinear is
    /// checked against PIL's bilinear the same way (it was built to match it).
    #[test]
    fn bicubic_matches_pil() {
        // Pillow's `bilinear_filter` and `bicubic_filter`, written out here rather than taken
        // from the code under test.
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
