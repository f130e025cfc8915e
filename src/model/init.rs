//! Random initialization as timm's `VisionTransformer` does it by default: dense weights
//! truncated-normal with std 0.02 and zero bias, LayerNorms at (1, 0), `pos_embed` std 0.02,
//! `cls_token` std 1e-6, and the patch-embedding convolution with PyTorch's default
//! `Conv2d` init (uniform ±1/√fan_in for weight and bias).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal, Uniform};

use super::params::{ParamKind, ParamTable};

/// Normal(0, std) truncated to ±2·std (the cut timm's `trunc_normal_` makes is at ±2 in
/// absolute value, which for std 0.02 is never reached; cutting at 2σ keeps outliers out).
fn trunc_normal(rng: &mut impl Rng, std: f32) -> f32 {
    let Ok(normal) = Normal::new(0.0f32, std) else {
        return 0.0; // only for a non-finite std, which the callers never pass
    };
    loop {
        let v = normal.sample(rng);
        if v.abs() <= 2.0 * std {
            return v;
        }
    }
}

/// Fresh weights for `table`, deterministic in `seed`.
pub fn init_params(table: &ParamTable, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_1417);
    let mut out = vec![0.0f32; table.total];
    for e in &table.entries {
        let dst = &mut out[e.span.range()];
        let is_patch = e.name.starts_with("patch_embed.");
        match e.kind {
            ParamKind::Weight if is_patch => {
                let fan_in: usize = e.shape[1..].iter().product();
                let bound = 1.0 / (fan_in as f32).sqrt();
                let u = Uniform::new_inclusive(-bound, bound);
                dst.iter_mut().for_each(|v| *v = u.sample(&mut rng));
            }
            ParamKind::Bias if is_patch => {
                let fan_in = table.entries.iter().find(|w| w.name == "patch_embed.proj.weight")
                    .map_or(1, |w| w.shape[1..].iter().product::<usize>());
                let bound = 1.0 / (fan_in as f32).sqrt();
                let u = Uniform::new_inclusive(-bound, bound);
                dst.iter_mut().for_each(|v| *v = u.sample(&mut rng));
            }
            ParamKind::Weight | ParamKind::PosEmbed => dst.iter_mut().for_each(|v| *v = trunc_normal(&mut rng, 0.02)),
            ParamKind::ClsToken => dst.iter_mut().for_each(|v| *v = trunc_normal(&mut rng, 1e-6)),
            ParamKind::NormWeight => dst.fill(1.0),
            ParamKind::Bias | ParamKind::NormBias => dst.fill(0.0),
        }
    }
    out
}
