//! The synthetic dataset: uniformly random pixels and labels, for benchmarks that must not
//! touch the disk. Deterministic from the seed; nothing in it is learnable.

use rayon::prelude::*;

use super::rng::{hash, stream as tag, SplitMix};
use super::ImageSet;

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
