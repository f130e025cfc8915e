//! Resampling for images whose stored size is not the model's: RandomResizedCrop (training) and
//! resize + center crop (evaluation), as timm builds them with torchvision, fused with the
//! flip, HWC→CHW and normalization so each output pixel is written once.
//!
//! The filter is PIL's antialiased bilinear ("triangle" whose support widens with the
//! downscale factor), which is what torchvision's `Resize` applies to PIL images; plain
//! 2-tap bilinear would alias badly when a 500-px photo becomes 224 px. Weights are computed per
//! output row/column once per image and the filter runs as two separable passes.

use std::cell::RefCell;

use super::rng::{hash, stream, SplitMix};

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

/// timm's eval transform as one window: resize the shorter side to `floor(side / crop_pct)`,
/// then center-crop `side` × `side`. In source pixels that is a centered square of
/// `side / scale` where `scale = floor(side / crop_pct) / shorter`.
pub fn center_crop(width: usize, height: usize, side: usize, crop_pct: f64) -> Region {
    let short = width.min(height) as f64;
    let resized = (side as f64 / crop_pct).floor().max(side as f64);
    let win = (side as f64 * short / resized) as f32;
    Region { x0: (width as f32 - win) / 2.0, y0: (height as f32 - win) / 2.0, w: win, h: win }
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

fn taps(src_len: usize, r0: f32, rlen: f32, out_len: usize) -> Taps {
    let scale = rlen / out_len as f32;
    // Triangle of radius 1 output pixel, widened by the downscale factor (antialiasing).
    let fscale = scale.max(1.0);
    let support = fscale;
    let n = (support.ceil() as usize) * 2 + 1;
    let mut start = Vec::with_capacity(out_len);
    let mut len = Vec::with_capacity(out_len);
    let mut weights = vec![0f32; out_len * n];
    for i in 0..out_len {
        let center = r0 + (i as f32 + 0.5) * scale;
        let lo = ((center - support).floor().max(0.0) as usize).min(src_len - 1);
        let hi = ((center + support).ceil().max(0.0) as usize).clamp(lo + 1, src_len).min(lo + n);
        let w = &mut weights[i * n..(i + 1) * n];
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

thread_local! {
    // Scratch buffers per worker thread (horizontal-pass rows, one accumulator row), reused
    // across images.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Resamples `region` of the (height, width, 3) HWC image `src` to `out` (3, side, side) CHW,
/// mirrored when `flip`, normalized as `(v / 255 − mean) / std`.
#[allow(clippy::too_many_arguments)]
pub fn resample(src: &[u8], width: usize, height: usize, region: Region, side: usize, flip: bool, mean: [f32; 3], std: [f32; 3], out: &mut [f32]) {
    debug_assert_eq!(src.len(), width * height * 3);
    debug_assert_eq!(out.len(), 3 * side * side);
    let tx = taps(width, region.x0, region.w, side);
    let ty = taps(height, region.y0, region.h, side);
    // Source rows the vertical pass touches.
    let row_lo = ty.start[0];
    let row_hi = (0..side).map(|i| ty.start[i] + ty.len[i]).max().unwrap_or(row_lo + 1).min(height);
    let rows = row_hi - row_lo;
    let row_len = side * 3;
    SCRATCH.with(|cell| {
        let mut guard = cell.borrow_mut();
        let (tmp, acc) = &mut *guard;
        tmp.clear();
        tmp.resize(rows * row_len, 0.0);
        acc.clear();
        acc.resize(row_len, 0.0);
        // Horizontal pass into (rows, side, 3); the flip is applied here by reading output
        // column side-1-ox's taps.
        for (r, y) in (row_lo..row_hi).enumerate() {
            let srow = &src[y * width * 3..(y + 1) * width * 3];
            let trow = &mut tmp[r * row_len..(r + 1) * row_len];
            for ox in 0..side {
                let sx = if flip { side - 1 - ox } else { ox };
                let s0 = tx.start[sx];
                let w = &tx.weights[sx * tx.n..sx * tx.n + tx.len[sx]];
                let px = &srow[s0 * 3..(s0 + w.len()) * 3];
                let (mut a, mut b, mut c) = (0f32, 0f32, 0f32);
                for (wk, p) in w.iter().zip(px.chunks_exact(3)) {
                    a += wk * p[0] as f32;
                    b += wk * p[1] as f32;
                    c += wk * p[2] as f32;
                }
                trow[ox * 3] = a;
                trow[ox * 3 + 1] = b;
                trow[ox * 3 + 2] = c;
            }
        }
        // Vertical pass, one output row at a time as a weighted sum of whole rows (contiguous,
        // vectorizable), then normalization and HWC→CHW.
        let plane = side * side;
        let k = [1.0 / (255.0 * std[0]), 1.0 / (255.0 * std[1]), 1.0 / (255.0 * std[2])];
        let off = [mean[0] / std[0], mean[1] / std[1], mean[2] / std[2]];
        for oy in 0..side {
            let s0 = ty.start[oy] - row_lo;
            let w = &ty.weights[oy * ty.n..oy * ty.n + ty.len[oy]];
            acc.iter_mut().for_each(|v| *v = 0.0);
            for (kk, &wk) in w.iter().enumerate() {
                let row = &tmp[(s0 + kk) * row_len..(s0 + kk + 1) * row_len];
                for (a, &t) in acc.iter_mut().zip(row) {
                    *a += wk * t;
                }
            }
            let o = oy * side;
            for (ox, px) in acc.chunks_exact(3).enumerate() {
                out[o + ox] = px[0] * k[0] - off[0];
                out[plane + o + ox] = px[1] * k[1] - off[1];
                out[2 * plane + o + ox] = px[2] * k[2] - off[2];
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID_MEAN: [f32; 3] = [0.0; 3];
    const ID_STD: [f32; 3] = [1.0 / 255.0; 3];

    #[test]
    fn identity_region_is_exact() {
        let (w, h) = (7, 7);
        let src: Vec<u8> = (0..w * h * 3).map(|i| (i * 5 % 256) as u8).collect();
        let mut out = vec![0f32; 3 * 49];
        resample(&src, w, h, Region { x0: 0.0, y0: 0.0, w: 7.0, h: 7.0 }, 7, false, ID_MEAN, ID_STD, &mut out);
        for y in 0..7 {
            for x in 0..7 {
                for c in 0..3 {
                    assert!((out[c * 49 + y * 7 + x] - src[(y * 7 + x) * 3 + c] as f32).abs() < 1e-3);
                }
            }
        }
        let mut flipped = vec![0f32; 3 * 49];
        resample(&src, w, h, Region { x0: 0.0, y0: 0.0, w: 7.0, h: 7.0 }, 7, true, ID_MEAN, ID_STD, &mut flipped);
        assert!((flipped[3 * 7] - out[3 * 7 + 6]).abs() < 1e-3);
    }

    #[test]
    fn downscale_averages_and_constant_stays_constant() {
        // 2× downscale of a checkerboard is flat grey (antialiased), not aliased stripes.
        let (w, h) = (16, 16);
        let src: Vec<u8> = (0..w * h).flat_map(|i| if (i % w + i / w) % 2 == 0 { [0u8; 3] } else { [200u8; 3] }).collect();
        let mut out = vec![0f32; 3 * 64];
        resample(&src, w, h, Region { x0: 0.0, y0: 0.0, w: 16.0, h: 16.0 }, 8, false, ID_MEAN, ID_STD, &mut out);
        for v in &out {
            assert!((v - 100.0).abs() < 15.0, "{v}");
        }
        let flat = vec![77u8; 30 * 20 * 3];
        let mut out = vec![0f32; 3 * 100];
        resample(&flat, 30, 20, center_crop(30, 20, 10, 0.875), 10, true, ID_MEAN, ID_STD, &mut out);
        assert!(out.iter().all(|v| (v - 77.0).abs() < 1e-3));
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
        // 224 at crop_pct 0.875: shorter side → 256, crop 224 → source window 224/256 of it.
        let r = center_crop(512, 384, 224, 0.875);
        assert!((r.w - 336.0).abs() < 1e-3 && (r.x0 - 88.0).abs() < 1e-3 && (r.y0 - 24.0).abs() < 1e-3, "{r:?}");
    }
}
