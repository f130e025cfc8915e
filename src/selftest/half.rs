//! The GPU's 16-bit format at its edges (`backend::half`), beside the op checks that every
//! format runs: the device's f32 → 16-bit conversion against the host's (`HalfFormat::to_bits`,
//! what uploads use) bit for bit, over ordinary values and the range's ends (fp16: 65504, the
//! rounding to ±inf from 65520, subnormals; NaN stays NaN), and an overflow in a 16-bit buffer
//! reaching the global sum of squares as non-finite — the loss scaler's overflow check — on its
//! way through the f32 cast.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::Check;
use crate::backend::cuda::Cuda;
use crate::backend::{BResult, Backend};

/// The checks for `be`'s 16-bit format (named after it); fresh random values from `seed`.
pub fn half_format_checks(be: &Cuda, seed: u64) -> BResult<Vec<Check>> {
    let half = be.half_format();
    let name = half.name();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x4a1f);
    let mut vals: Vec<f32> = vec![0.0, -0.0, 1.0, 65504.0, -65504.0, 65519.0, 65520.0, -1e5, 1e5, 3e38, f32::INFINITY, f32::NEG_INFINITY, 6e-8, 3e-8, 1e-5, -2.5e-6, f32::NAN];
    // every binade from 2^-30 to 2^20, either sign
    vals.extend((0..4000).map(|_| {
        let m: f32 = rng.gen_range(1.0..2.0);
        let e: i32 = rng.gen_range(-30..=20);
        if rng.gen() { m * 2f32.powi(e) } else { -m * 2f32.powi(e) }
    }));
    let mut f = be.alloc_f32(vals.len())?;
    be.upload(&mut f, 0, &vals)?;
    let mut h = be.alloc(vals.len())?;
    be.cast(&mut h, &f)?;
    let dev = be.download(&h)?;
    let same = |a: f32, b: f32| (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits();
    let host: Vec<f32> = vals.iter().map(|&x| half.from_bits(half.to_bits(x))).collect();
    let wrong = dev.iter().zip(&host).filter(|(a, b)| !same(**a, **b)).count();
    let mut out = vec![Check {
        name: format!("{name}: device f32→{name} conversion equals the host's bit for bit ({} values incl. range ends, inf, NaN)", vals.len()),
        rel_err: wrong as f64 / vals.len() as f64,
        tol: 0.0,
        pass: wrong == 0,
    }];
    // an overflowing value in a 16-bit buffer (fp16: 1e5 is +inf there) cast to f32 and summed
    let mut g = be.alloc_f32(vals.len())?;
    let spike: Vec<f32> = (0..vals.len()).map(|i| if i == 17 { 1e5 } else { 0.5 }).collect();
    be.upload(&mut f, 0, &spike)?;
    be.cast(&mut h, &f)?;
    be.cast(&mut g, &h)?;
    let s = be.sum_squares(&g, f32::INFINITY)?;
    let overflows = half.to_bits(1e5) == half.to_bits(f32::INFINITY);
    let pass = if overflows { !s.is_finite() } else { s.is_finite() };
    out.push(Check {
        name: format!("{name}: 1e5 in a {name} buffer gives a {} sum of squares through the f32 cast (the loss scaler's overflow check)", if overflows { "non-finite" } else { "finite" }),
        rel_err: if pass { 0.0 } else { 1.0 },
        tol: 0.0,
        pass,
    });
    Ok(out)
}
