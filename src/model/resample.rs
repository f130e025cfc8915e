//! Resampling a position embedding to another patch grid, as timm's `resample_abs_pos_embed`
//! does when weights trained at one resolution start a model at another: the prefix tokens'
//! rows (the class token) are kept, the patch rows are read as a (C, H, W) image and resized
//! with PyTorch's `F.interpolate(mode='bicubic', align_corners=False)`, with or without
//! `antialias`. Both of PyTorch's bicubic kernels are reproduced here:
//!
//! - `antialias=False` (`upsample_bicubic2d`): Keys' cubic with A = -0.75 over the four input
//!   pixels around the source coordinate `scale·(i + ½) − ½` (`scale` = input / output), the
//!   indices clamped to the border;
//! - `antialias=True` (`_upsample_bicubic2d_aa`, PIL's filter): Keys' cubic with A = -0.5,
//!   stretched by the scale when shrinking, over the input pixels within its support around
//!   `scale·(i + ½)`, truncated at the border and normalised to sum 1.
//!
//! timm's own default (`resample_abs_pos_embed`, `checkpoint_filter_fn`, `set_input_size`) is
//! `antialias=True`, which is what `--init` uses ([`TIMM_ANTIALIAS`]).

/// Whether timm antialiases when it resamples a position embedding (its default).
pub const TIMM_ANTIALIAS: bool = true;

/// Keys' cubic convolution kernel with coefficient `a`, at distance `x`.
fn cubic(x: f64, a: f64) -> f64 {
    let x = x.abs();
    if x < 1.0 {
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    } else {
        0.0
    }
}

/// For each output index along one axis, the input indices and weights that make it.
fn axis_weights(input: usize, output: usize, antialias: bool) -> Vec<Vec<(usize, f64)>> {
    let scale = input as f64 / output as f64;
    (0..output)
        .map(|i| {
            if antialias {
                let support = if scale >= 1.0 { 2.0 * scale } else { 2.0 };
                let invscale = if scale >= 1.0 { 1.0 / scale } else { 1.0 };
                let center = scale * (i as f64 + 0.5);
                // PyTorch truncates toward zero (an int64 cast), then clips to the input
                let lo = ((center - support + 0.5) as i64).max(0) as usize;
                let hi = ((center + support + 0.5) as i64).clamp(0, input as i64) as usize;
                let mut taps: Vec<(usize, f64)> = (lo..hi).map(|j| (j, cubic((j as f64 - center + 0.5) * invscale, -0.5))).collect();
                let total: f64 = taps.iter().map(|t| t.1).sum();
                if total != 0.0 {
                    for t in &mut taps {
                        t.1 /= total;
                    }
                }
                taps
            } else {
                const A: f64 = -0.75;
                let real = scale * (i as f64 + 0.5) - 0.5;
                let floor = real.floor();
                let t = real - floor;
                let weights = [cubic(t + 1.0, A), cubic(t, A), cubic(1.0 - t, A), cubic(2.0 - t, A)];
                (0..4)
                    .map(|k| {
                        let j = (floor as i64 - 1 + k as i64).clamp(0, input as i64 - 1) as usize;
                        (j, weights[k])
                    })
                    .collect()
            }
        })
        .collect()
}

/// Resizes a (H, W, C) grid, row-major with the channels innermost (the token layout of a
/// position embedding), to (H', W', C).
pub fn resize_grid(src: &[f32], channels: usize, from: (usize, usize), to: (usize, usize), antialias: bool) -> Result<Vec<f32>, String> {
    let (h, w) = from;
    let (h2, w2) = to;
    if h == 0 || w == 0 || h2 == 0 || w2 == 0 {
        return Err(format!("cannot resample a {h}×{w} grid to {h2}×{w2}: every side must be at least 1"));
    }
    if src.len() != h * w * channels {
        return Err(format!("a {h}×{w} grid of width {channels} has {} values, not {}", h * w * channels, src.len()));
    }
    let (wy, wx) = (axis_weights(h, h2, antialias), axis_weights(w, w2, antialias));
    // rows first (H → H'), then columns, in f64
    let mut rows = vec![0.0f64; h2 * w * channels];
    for (y2, taps) in wy.iter().enumerate() {
        let out = &mut rows[y2 * w * channels..(y2 + 1) * w * channels];
        for &(y, wt) in taps {
            for (o, s) in out.iter_mut().zip(&src[y * w * channels..(y + 1) * w * channels]) {
                *o += wt * *s as f64;
            }
        }
    }
    let mut out = vec![0.0f32; h2 * w2 * channels];
    for y2 in 0..h2 {
        for (x2, taps) in wx.iter().enumerate() {
            let dst = &mut out[(y2 * w2 + x2) * channels..(y2 * w2 + x2 + 1) * channels];
            for (c, d) in dst.iter_mut().enumerate() {
                *d = taps.iter().map(|&(x, wt)| wt * rows[(y2 * w + x) * channels + c]).sum::<f64>() as f32;
            }
        }
    }
    Ok(out)
}

/// timm's `resample_abs_pos_embed` on a (1, prefix + H·W, C) position embedding: the first
/// `prefix` rows are kept as they are, the H·W patch rows resized to `to`.
pub fn resample_pos_embed(pos: &[f32], channels: usize, prefix: usize, from: (usize, usize), to: (usize, usize), antialias: bool) -> Result<Vec<f32>, String> {
    let want = (prefix + from.0 * from.1) * channels;
    if pos.len() != want {
        return Err(format!("a position embedding of {prefix} prefix tokens and a {}×{} grid of width {channels} has {want} values, not {}", from.0, from.1, pos.len()));
    }
    let (head, grid) = pos.split_at(prefix * channels);
    let mut out = head.to_vec();
    out.extend(resize_grid(grid, channels, from, to, antialias)?);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each output's weights sum to 1 in both kernels (a constant grid stays constant), and
    /// the same size is the identity.
    #[test]
    fn constant_grids_stay_constant_and_same_size_is_identity() {
        for antialias in [false, true] {
            for (from, to) in [(3, 7), (7, 3), (14, 24), (24, 14), (5, 5), (1, 4), (4, 1)] {
                for taps in axis_weights(from, to, antialias) {
                    let s: f64 = taps.iter().map(|t| t.1).sum();
                    assert!((s - 1.0).abs() < 1e-12, "{from}→{to} aa={antialias}: {s}");
                }
            }
            let src: Vec<f32> = (0..5 * 4 * 3).map(|i| (i as f32 * 0.37).sin()).collect();
            assert_eq!(resize_grid(&src, 3, (5, 4), (5, 4), antialias).unwrap(), src);
        }
    }

    #[test]
    fn bad_lengths_and_empty_grids_are_errors() {
        assert!(resize_grid(&[0.0; 11], 3, (2, 2), (3, 3), false).unwrap_err().contains("12"));
        assert!(resize_grid(&[], 3, (0, 2), (3, 3), false).is_err());
        assert!(resample_pos_embed(&[0.0; 12], 3, 1, (2, 2), (3, 3), true).unwrap_err().contains("15"));
    }
}
