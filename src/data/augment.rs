//! Per-image transforms from stored HWC u8 pixels to the model's normalized CHW f32 input.
//!
//! A transform is chosen once per batch ([`Policy`]) and drawn per image ([`Draw`]) from a
//! generator keyed by (seed, epoch, dataset index) only, so the augmented pixels of an image do
//! not depend on which rank, micro-batch or thread processes it.
//!
//! Semantics follow torchvision as timm uses it for CIFAR: `RandomCrop(S, padding=p)` pads with
//! black (pixel value 0, *before* normalization), picks the window uniformly, then
//! `RandomHorizontalFlip()` mirrors the crop with probability ½. `ToTensor` + `Normalize` become
//! a per-channel lookup table of the 256 possible byte values.

use super::rng::{hash, stream, SplitMix};

/// What a batch does to each image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Pixels as stored.
    None,
    /// Horizontal flip with probability ½.
    Flip,
    /// Random crop of the zero-padded image (padding `pad` on every side), then flip.
    CropFlip { pad: usize },
}

/// The random choices for one image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Draw {
    /// Window origin in padded coordinates, in `0..=2·pad`.
    pub dy: usize,
    pub dx: usize,
    pub flip: bool,
}

impl Policy {
    /// Draws this image's transform from (seed, epoch, dataset index). The crop offsets are
    /// drawn before the flip, as torchvision applies them.
    pub fn draw(self, seed: u64, epoch: u64, index: usize) -> Draw {
        let mut rng = SplitMix::new(hash(&[seed, stream::AUGMENT, epoch, index as u64]));
        match self {
            Policy::None => Draw::default(),
            Policy::Flip => Draw { dy: 0, dx: 0, flip: rng.coin() },
            Policy::CropFlip { pad } => {
                let n = 2 * pad as u64 + 1;
                let dy = rng.below(n) as usize;
                let dx = rng.below(n) as usize;
                Draw { dy, dx, flip: rng.coin() }
            }
        }
    }

    pub fn pad(self) -> usize {
        match self {
            Policy::CropFlip { pad } => pad,
            _ => 0,
        }
    }
}

/// `(pixel / 255 − mean[c]) / std[c]` for every byte value and channel.
#[derive(Clone, Debug)]
pub struct Normalizer {
    lut: [[f32; 256]; 3],
}

impl Normalizer {
    pub fn new(mean: [f32; 3], std: [f32; 3]) -> Self {
        let mut lut = [[0f32; 256]; 3];
        for c in 0..3 {
            for (v, out) in lut[c].iter_mut().enumerate() {
                *out = (v as f32 / 255.0 - mean[c]) / std[c];
            }
        }
        Normalizer { lut }
    }

    #[inline]
    pub fn get(&self, c: usize, v: u8) -> f32 {
        self.lut[c][v as usize]
    }
}

/// Writes one image: `src` is (S, S, 3) HWC u8, `out` is (3, S, S) CHW f32. The output pixel
/// (y, x) reads padded pixel (y + dy, x' + dx) with x' = S−1−x when flipped; padded pixels
/// outside the stored image are black (0).
pub fn transform(src: &[u8], side: usize, pad: usize, d: Draw, norm: &Normalizer, out: &mut [f32]) {
    debug_assert_eq!(src.len(), side * side * 3);
    debug_assert_eq!(out.len(), side * side * 3);
    let plane = side * side;
    let (out_r, rest) = out.split_at_mut(plane);
    let (out_g, out_b) = rest.split_at_mut(plane);
    for y in 0..side {
        // Source row in stored coordinates (may fall in the padding).
        let sy = (y + d.dy) as isize - pad as isize;
        let row = y * side;
        if sy < 0 || sy >= side as isize {
            for x in 0..side {
                out_r[row + x] = norm.get(0, 0);
                out_g[row + x] = norm.get(1, 0);
                out_b[row + x] = norm.get(2, 0);
            }
            continue;
        }
        let src_row = &src[sy as usize * side * 3..(sy as usize + 1) * side * 3];
        for x in 0..side {
            let xc = if d.flip { side - 1 - x } else { x };
            let sx = (xc + d.dx) as isize - pad as isize;
            let (r, g, b) = if sx < 0 || sx >= side as isize {
                (0, 0, 0)
            } else {
                let p = &src_row[sx as usize * 3..sx as usize * 3 + 3];
                (p[0], p[1], p[2])
            };
            out_r[row + x] = norm.get(0, r);
            out_g[row + x] = norm.get(1, g);
            out_b[row + x] = norm.get(2, b);
        }
    }
}

/// [`transform`] without the normalization: the cropped, flipped (S, S, 3) HWC bytes (padding
/// black), for augmentations that work on pixels (RandAugment).
pub fn transform_u8(src: &[u8], side: usize, pad: usize, d: Draw, out: &mut [u8]) {
    debug_assert_eq!(src.len(), side * side * 3);
    debug_assert_eq!(out.len(), side * side * 3);
    let w = side * 3;
    for y in 0..side {
        let sy = (y + d.dy) as isize - pad as isize;
        let row = &mut out[y * w..(y + 1) * w];
        if sy < 0 || sy >= side as isize {
            row.fill(0);
            continue;
        }
        let src_row = &src[sy as usize * w..(sy as usize + 1) * w];
        if !d.flip && d.dx == pad {
            row.copy_from_slice(src_row);
            continue;
        }
        for (x, px) in row.chunks_exact_mut(3).enumerate() {
            let xc = if d.flip { side - 1 - x } else { x };
            let sx = (xc + d.dx) as isize - pad as isize;
            if sx < 0 || sx >= side as isize {
                px.fill(0);
            } else {
                px.copy_from_slice(&src_row[sx as usize * 3..sx as usize * 3 + 3]);
            }
        }
    }
}

/// (S, S, 3) HWC bytes to the model's (3, S, S) CHW f32 through the normalizer's tables.
pub fn normalize_hwc(px: &[u8], side: usize, norm: &Normalizer, out: &mut [f32]) {
    let plane = side * side;
    debug_assert_eq!(px.len(), 3 * plane);
    let (out_r, rest) = out[..3 * plane].split_at_mut(plane);
    let (out_g, out_b) = rest.split_at_mut(plane);
    let [lr, lg, lb] = &norm.lut;
    for (((r, g), b), p) in out_r.iter_mut().zip(out_g.iter_mut()).zip(out_b.iter_mut()).zip(px.chunks_exact(3)) {
        *r = lr[p[0] as usize];
        *g = lg[p[1] as usize];
        *b = lb[p[2] as usize];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity_norm() -> Normalizer {
        // pixel/255 * 255 = pixel: mean 0, std 1/255.
        Normalizer::new([0.0; 3], [1.0 / 255.0; 3])
    }

    fn img(side: usize) -> Vec<u8> {
        (0..side * side * 3).map(|i| (i % 251) as u8 + 1).collect()
    }

    fn px(out: &[f32], side: usize, c: usize, y: usize, x: usize) -> u8 {
        out[c * side * side + y * side + x].round() as u8
    }

    #[test]
    fn none_is_hwc_to_chw() {
        let side = 5;
        let src = img(side);
        let mut out = vec![0f32; side * side * 3];
        transform(&src, side, 0, Draw::default(), &identity_norm(), &mut out);
        for y in 0..side {
            for x in 0..side {
                for c in 0..3 {
                    assert_eq!(px(&out, side, c, y, x), src[(y * side + x) * 3 + c]);
                }
            }
        }
    }

    #[test]
    fn crop_and_flip_match_torchvision_semantics() {
        let side = 6;
        let pad = 2;
        let src = img(side);
        let mut out = vec![0f32; side * side * 3];
        // Window at the top-left corner of the padded image: the first 2 rows/cols are black.
        transform(&src, side, pad, Draw { dy: 0, dx: 0, flip: false }, &identity_norm(), &mut out);
        assert_eq!(px(&out, side, 0, 1, 3), 0);
        assert_eq!(px(&out, side, 1, 3, 1), 0);
        assert_eq!(px(&out, side, 2, 2, 2), src[2]);
        assert_eq!(px(&out, side, 0, 5, 5), src[(3 * side + 3) * 3]);
        // Flip mirrors the crop: output column x reads cropped column side-1-x.
        let mut flipped = vec![0f32; side * side * 3];
        transform(&src, side, pad, Draw { dy: 0, dx: 0, flip: true }, &identity_norm(), &mut flipped);
        for y in 0..side {
            for x in 0..side {
                assert_eq!(px(&flipped, side, 0, y, x), px(&out, side, 0, y, side - 1 - x));
            }
        }
        // Centered window (dy = dx = pad) is the identity.
        transform(&src, side, pad, Draw { dy: pad, dx: pad, flip: false }, &identity_norm(), &mut out);
        let mut plain = vec![0f32; side * side * 3];
        transform(&src, side, 0, Draw::default(), &identity_norm(), &mut plain);
        assert_eq!(out, plain);
    }

    #[test]
    fn draws_cover_the_range_and_are_keyed() {
        let p = Policy::CropFlip { pad: 4 };
        let mut seen = [false; 9];
        let mut flips = 0;
        for i in 0..2000 {
            let d = p.draw(1, 0, i);
            seen[d.dy] = true;
            assert!(d.dx <= 8);
            flips += usize::from(d.flip);
        }
        assert!(seen.iter().all(|&s| s));
        assert!((800..1200).contains(&flips));
        assert_eq!(p.draw(1, 2, 3), p.draw(1, 2, 3));
        assert_eq!(Policy::None.draw(1, 2, 3), Draw::default());
    }

    /// The byte path (crop/flip to HWC, then the tables) gives exactly the float path.
    #[test]
    fn transform_u8_then_normalize_equals_transform() {
        let side = 7;
        let src = img(side);
        let norm = Normalizer::new([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
        for d in [Draw::default(), Draw { dy: 0, dx: 3, flip: true }, Draw { dy: 4, dx: 1, flip: false }, Draw { dy: 2, dx: 2, flip: true }] {
            let pad = if d == Draw::default() { 0 } else { 2 };
            let mut want = vec![0f32; side * side * 3];
            transform(&src, side, pad, d, &norm, &mut want);
            let mut px = vec![0u8; side * side * 3];
            transform_u8(&src, side, pad, d, &mut px);
            let mut got = vec![0f32; side * side * 3];
            normalize_hwc(&px, side, &norm, &mut got);
            assert_eq!(got, want, "{d:?}");
        }
    }

    #[test]
    fn normalizer_values() {
        let n = Normalizer::new([0.5, 0.25, 0.0], [0.5, 0.25, 2.0]);
        assert!((n.get(0, 255) - 1.0).abs() < 1e-6);
        assert!((n.get(1, 0) + 1.0).abs() < 1e-6);
        assert!((n.get(2, 255) - 0.5).abs() < 1e-6);
    }
}
