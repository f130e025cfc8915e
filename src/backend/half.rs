//! The GPU's 16-bit compute format — bf16 or IEEE fp16 — and how a run chooses it from its
//! precision blocks and the GPU's architecture.
//!
//! A CUDA backend holds one format for all its 16-bit buffers: its kernels are compiled for it
//! (`-DVITSCALE_HALF_F16`), and cuBLASLt, NCCL and the host conversions read it from here.
//! bf16 needs Ampere (sm_80) or newer: older GPUs (T4 = sm_75, V100 = sm_70) have fp16 tensor
//! cores but no bf16 arithmetic, and cuBLASLt has no bf16 GEMMs there. This file has no CUDA in
//! it, so the choice and the conversions are tested on machines without a GPU.

use crate::config::Precision;

/// The 16-bit format of a GPU backend's compute buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HalfFormat {
    /// bfloat16: f32's range, 8 mantissa bits.
    Bf16,
    /// IEEE binary16: 11 significant bits, largest finite value 65504 (needs loss scaling).
    F16,
}

impl HalfFormat {
    /// "bf16" or "fp16", as the config and the messages spell them.
    pub fn name(self) -> &'static str {
        match self {
            HalfFormat::Bf16 => "bf16",
            HalfFormat::F16 => "fp16",
        }
    }

    /// The 16-bit word holding `x`, rounded to nearest even; NaN stays NaN and values beyond
    /// the range become ±inf (fp16: |x| ≥ 65520), as the device's conversions do.
    pub fn to_bits(self, x: f32) -> u16 {
        match self {
            HalfFormat::Bf16 => half::bf16::from_f32(x).to_bits(),
            HalfFormat::F16 => half::f16::from_f32(x).to_bits(),
        }
    }

    /// The value of a 16-bit word, exactly.
    pub fn from_bits(self, b: u16) -> f32 {
        match self {
            HalfFormat::Bf16 => half::bf16::from_bits(b).to_f32(),
            HalfFormat::F16 => half::f16::from_bits(b).to_f32(),
        }
    }
}

/// First compute capability with bf16 arithmetic (Ampere).
pub const BF16_MIN_CC: (i32, i32) = (8, 0);

/// A run's compute format on a GPU of compute capability `cc` (the forced one when
/// `VITSCALE_CUDA_ARCH` names an older architecture), and the one-line notice that goes with
/// an automatic choice.
#[derive(Clone, Debug, PartialEq)]
pub struct HalfChoice {
    pub format: HalfFormat,
    /// The run has no fp16 block but computes in fp16 (a GPU before Ampere): the trainer runs
    /// DeepSpeed's default dynamic loss scaler, as an `fp16: {enabled: true}` block would.
    pub implicit_fp16: bool,
    /// Said once, as a notice, when the format was chosen for the run rather than asked for.
    pub notice: Option<String>,
}

/// The compute format for `precision` on a GPU of compute capability `cc`:
/// - `fp16.enabled` → fp16 on every GPU (the scaler runs as configured);
/// - `bf16.enabled` → bf16 from Ampere on; before Ampere an error naming the key (there is no
///   bf16 arithmetic to honour it with, and quietly training in another format would change
///   the run's numerics behind the user's back);
/// - neither → bf16 from Ampere on (as before); before Ampere fp16 with DeepSpeed's default
///   dynamic loss scaling, said in a notice.
pub fn choose(precision: &Precision, cc: (i32, i32), gpu: &str) -> Result<HalfChoice, String> {
    let old = cc < BF16_MIN_CC;
    let arch = format!("sm_{}{}", cc.0, cc.1);
    match precision {
        Precision::Fp16 { .. } => Ok(HalfChoice { format: HalfFormat::F16, implicit_fp16: false, notice: None }),
        Precision::Bf16 if old => Err(format!(
            "bf16.enabled: {gpu} ({arch}) has no bf16 arithmetic (bf16 needs sm_80, Ampere, or newer); use \"fp16\": {{\"enabled\": true}}, or remove the bf16 block and vitscale computes in fp16 with DeepSpeed's default dynamic loss scaling"
        )),
        Precision::Bf16 => Ok(HalfChoice { format: HalfFormat::Bf16, implicit_fp16: false, notice: None }),
        Precision::Fp32 if old => Ok(HalfChoice {
            format: HalfFormat::F16,
            implicit_fp16: true,
            notice: Some(format!(
                "{gpu} ({arch}) has no bf16 arithmetic: computing in fp16 with DeepSpeed's default dynamic loss scaling (initial scale 2^16, window 1000, hysteresis 2); give an fp16 block to set the scaler (docs/precision.md)"
            )),
        }),
        Precision::Fp32 => Ok(HalfChoice { format: HalfFormat::Bf16, implicit_fp16: false, notice: None }),
    }
}
