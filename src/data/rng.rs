//! Counter-based randomness for the data pipeline.
//!
//! Everything random in `data` (dataset generation, shuffling, augmentation) is derived by
//! hashing a small tuple of integers — (seed, stream, epoch, dataset index) — rather than by
//! drawing from a shared generator. That is what makes a batch independent of thread count,
//! rank count and position in the batch: the same image in the same epoch always gets the same
//! crop and flip. SplitMix64 is used because it is tiny, fast, well-mixed and will never change
//! under us the way a library generator's algorithm can between versions.

/// The SplitMix64 finalizer: a bijective, well-mixing hash of one u64.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Hash of an ordered tuple of u64s (order matters: `hash(&[a, b]) != hash(&[b, a])`).
#[inline]
pub fn hash(parts: &[u64]) -> u64 {
    let mut h = 0x6a09_e667_f3bc_c908u64;
    for &p in parts {
        h = mix64(h ^ mix64(p.wrapping_add(0x9e37_79b9_7f4a_7c15)));
    }
    h
}

/// Stream tags, so that e.g. the train split and the val split never share randomness.
pub mod stream {
    pub const TRAIN: u64 = 0x74_7261_696e;
    pub const VAL: u64 = 0x76_616c;
    pub const SHUFFLE: u64 = 0x7368_7566;
    pub const AUGMENT: u64 = 0x6175_676d;
    pub const LABELS: u64 = 0x6c61_6265;
    pub const SPLIT: u64 = 0x7370_6c74;
    pub const RANDAUG: u64 = 0x7261_6e64;
    pub const ERASE: u64 = 0x6572_6173;
    pub const MIX: u64 = 0x006d_6978;
    pub const DECODE: u64 = 0x6465_636f;
}

/// A SplitMix64 generator.
#[derive(Clone, Debug)]
pub struct SplitMix {
    state: u64,
}

impl SplitMix {
    pub fn new(seed: u64) -> Self {
        SplitMix { state: seed }
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.state)
    }

    /// Uniform in [0, 1) with 24 bits of precision.
    #[inline]
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in [lo, hi).
    #[inline]
    pub fn range_f32(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.f32()
    }

    /// Uniform integer in [0, n) (n > 0), by Lemire's multiply-shift (bias < 2^-32 for our n).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        (((self.next_u64() >> 32) * n) >> 32).min(n - 1)
    }

    /// Uniform integer in [0, n) for any n up to 2^64, exactly unbiased enough for shuffling
    /// datasets of any size (128-bit multiply-shift).
    #[inline]
    pub fn below_usize(&mut self, n: usize) -> usize {
        debug_assert!(n > 0);
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    #[inline]
    pub fn coin(&mut self) -> bool {
        self.next_u64() >> 63 == 1
    }

    /// Uniform in [0, 1) with 53 bits of precision.
    #[inline]
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal (Box–Muller; one of the pair is used).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.f64(); // (0, 1]
        let u2 = self.f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// Gamma(shape, 1) by Marsaglia–Tsang (shape < 1 through the `U^(1/shape)` boost).
    pub fn gamma(&mut self, shape: f64) -> f64 {
        if shape < 1.0 {
            let u = 1.0 - self.f64();
            return self.gamma(shape + 1.0) * u.powf(1.0 / shape);
        }
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.normal();
            let v = (1.0 + c * x).powi(3);
            if v <= 0.0 {
                continue;
            }
            let u = 1.0 - self.f64();
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return d * v;
            }
        }
    }

    /// Beta(a, b) from two gamma draws.
    pub fn beta(&mut self, a: f64, b: f64) -> f64 {
        let x = self.gamma(a);
        let y = self.gamma(b);
        if x + y > 0.0 { x / (x + y) } else { 0.5 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_order_sensitive_and_stable() {
        assert_ne!(hash(&[1, 2]), hash(&[2, 1]));
        assert_eq!(hash(&[7, 8, 9]), hash(&[7, 8, 9]));
        // Pinned value: changing the hash changes every dataset and augmentation.
        assert_eq!(mix64(0), 0);
        assert_eq!(SplitMix::new(0).next_u64(), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn uniform_ranges() {
        let mut r = SplitMix::new(3);
        for _ in 0..10_000 {
            let x = r.f32();
            assert!((0.0..1.0).contains(&x));
            assert!(r.below(9) < 9);
            assert!(r.below_usize(5) < 5);
        }
    }

    #[test]
    fn normal_and_beta_moments() {
        let mut r = SplitMix::new(11);
        let n = 40_000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "normal mean {mean} var {var}");
        // Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1)); a = 0.8 → 0.0962, a = 0.2 → 0.1786.
        for (a, want) in [(0.8, 1.0 / (4.0 * 2.6)), (0.2, 1.0 / (4.0 * 1.4))] {
            let bs: Vec<f64> = (0..n).map(|_| r.beta(a, a)).collect();
            assert!(bs.iter().all(|b| (0.0..=1.0).contains(b)));
            let m = bs.iter().sum::<f64>() / n as f64;
            let v = bs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / n as f64;
            assert!((m - 0.5).abs() < 0.01 && (v - want).abs() < 0.01, "beta({a}) mean {m} var {v}, want var {want}");
        }
    }
}
