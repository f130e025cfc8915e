//! The synthetic dataset: uniformly random pixels and labels, for benchmarks that must not
//! touch the disk; and synthetic ImageNet-size JPEG files, for benchmarks and tests of the
//! decode path. Deterministic from the seed; nothing in either is learnable.

use std::path::{Path, PathBuf};

use rayon::prelude::*;

use super::rng::{hash, stream as tag, SplitMix};
use super::{DataError, ImageSet};

/// `n` random images of side `side` with labels uniform in `0..num_classes`, from `stream`.
pub fn generate(n: usize, side: usize, num_classes: usize, seed: u64, stream: u64) -> ImageSet {
    let img = side * side * 3;
    let mut images = vec![0u8; n * img];
    images.par_chunks_mut(img.max(1)).enumerate().for_each(|(i, out)| {
        let mut rng = SplitMix::new(hash(&[seed, stream, i as u64]));
        for chunk in out.chunks_mut(8) {
            let bytes = rng.next_u64().to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    });
    let mut rng = SplitMix::new(hash(&[seed, stream, tag::LABELS]));
    let labels = (0..n).map(|_| rng.below(num_classes as u64) as u16).collect();
    ImageSet::in_memory(images, labels, side, num_classes)
}

/// Writes `n` synthetic 500×375 JPEGs (quality 90) into `dir`.
pub fn write_jpegs(dir: &Path, n: usize, seed: u64) -> Result<Vec<PathBuf>, DataError> {
    let (w, h) = (500u32, 375u32);
    std::fs::create_dir_all(dir).map_err(|source| DataError::Io { path: dir.to_path_buf(), source })?;
    let mut files = Vec::with_capacity(n);
    for i in 0..n {
        let mut rng = SplitMix::new(hash(&[seed, i as u64]));
        let (a, b, c) = (rng.f32() * 255.0, rng.f32() * 6.0, rng.f32() * 6.0);
        let mut img = image::RgbImage::new(w, h);
        for (x, y, p) in img.enumerate_pixels_mut() {
            let (fx, fy) = (x as f32 / w as f32, y as f32 / h as f32);
            let noise = rng.f32() * 40.0;
            let r = (a + 80.0 * (b * fx).sin() + noise).clamp(0.0, 255.0) as u8;
            let g = (128.0 + 90.0 * (c * fy).cos() + noise).clamp(0.0, 255.0) as u8;
            let bl = (255.0 * fx * fy + noise).clamp(0.0, 255.0) as u8;
            *p = image::Rgb([r, g, bl]);
        }
        let path = dir.join(format!("img_{i:05}.jpg"));
        let mut out = std::io::BufWriter::new(std::fs::File::create(&path).map_err(|source| DataError::Io { path: path.clone(), source })?);
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 90)
            .encode_image(&img)
            .map_err(|e| DataError::Decode { path: path.clone(), msg: e.to_string() })?;
        files.push(path);
    }
    Ok(files)
}
