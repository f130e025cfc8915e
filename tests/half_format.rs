//! The GPU's 16-bit compute format without a GPU: how a run's precision blocks and the GPU's
//! architecture choose it (`backend::half::choose`), the host conversions uploads and downloads
//! use, and the kernel sources keeping every bf16 bit trick inside common.cuh (an fp16 module
//! would silently misread a shift-by-16 conversion elsewhere).

use serde_json::json;
use vitscale::backend::half::{choose, HalfFormat};
use vitscale::config::{fp16_defaults, resolve, Precision};

const AMPERE: (i32, i32) = (8, 0);
const HOPPER: (i32, i32) = (9, 0);
const T4: (i32, i32) = (7, 5);
const V100: (i32, i32) = (7, 0);

#[test]
fn fp16_block_gives_fp16_on_every_generation() {
    let p = fp16_defaults();
    for cc in [V100, T4, AMPERE, HOPPER] {
        let c = choose(&p, cc, "gpu").unwrap();
        assert_eq!(c.format, HalfFormat::F16, "{cc:?}");
        assert!(!c.implicit_fp16 && c.notice.is_none(), "{cc:?}: an asked-for format needs no notice");
    }
}

#[test]
fn no_block_gives_bf16_from_ampere_and_fp16_with_a_notice_before() {
    for cc in [AMPERE, HOPPER, (12, 0)] {
        let c = choose(&Precision::Fp32, cc, "gpu").unwrap();
        assert_eq!((c.format, c.implicit_fp16, c.notice.is_none()), (HalfFormat::Bf16, false, true), "{cc:?}");
    }
    for cc in [V100, T4] {
        let c = choose(&Precision::Fp32, cc, "Tesla T4").unwrap();
        assert_eq!(c.format, HalfFormat::F16);
        assert!(c.implicit_fp16, "the trainer must run the default scaler");
        let n = c.notice.expect("an automatic fp16 is said");
        assert!(n.contains("fp16") && n.contains(&format!("sm_{}{}", cc.0, cc.1)) && n.contains("Tesla T4") && !n.contains('\n'), "{n}");
    }
}

#[test]
fn bf16_block_before_ampere_is_an_error_naming_the_key() {
    assert_eq!(choose(&Precision::Bf16, AMPERE, "gpu").unwrap().format, HalfFormat::Bf16);
    for cc in [V100, T4] {
        let e = choose(&Precision::Bf16, cc, "Tesla T4").unwrap_err();
        assert!(e.starts_with("bf16.enabled") && e.contains("fp16") && e.contains("sm_"), "{e}");
    }
}

/// The scaler an implicit fp16 run gets is exactly what `{"fp16": {"enabled": true}}` parses to,
/// and that is DeepSpeed's documented default block.
#[test]
fn implicit_scaler_is_the_fp16_blocks_defaults() {
    let deepspeed = Precision::Fp16 { loss_scale: 0.0, initial_scale_power: 16, loss_scale_window: 1000, hysteresis: 2, min_loss_scale: 1.0, consecutive_hysteresis: false };
    assert_eq!(fp16_defaults(), deepspeed);
    let c = resolve(&json!({"fp16": {"enabled": true}}), 1).unwrap();
    assert_eq!(c.precision, fp16_defaults());
}

#[test]
fn host_conversions_round_to_nearest_even_and_keep_inf_and_nan() {
    let f = HalfFormat::F16;
    assert_eq!(f.from_bits(f.to_bits(65504.0)), 65504.0);
    assert_eq!(f.from_bits(f.to_bits(65519.0)), 65504.0, "below the halfway point to 65536 rounds down");
    assert_eq!(f.from_bits(f.to_bits(65520.0)), f32::INFINITY, "from the halfway point on: inf");
    assert_eq!(f.from_bits(f.to_bits(-1e5)), f32::NEG_INFINITY);
    assert!(f.from_bits(f.to_bits(f32::NAN)).is_nan());
    assert_eq!(f.from_bits(f.to_bits(1.0 + 2f32.powi(-11))), 1.0, "a tie goes to even");
    assert_eq!(f.from_bits(f.to_bits(1.0 + 3.0 * 2f32.powi(-11))), 1.0 + 2f32.powi(-9), "a tie goes to even");
    assert_eq!(f.from_bits(f.to_bits(2f32.powi(-24))), 2f32.powi(-24), "the smallest subnormal is kept");
    assert_eq!(f.from_bits(0x3c00), 1.0);
    let b = HalfFormat::Bf16;
    assert_eq!(b.from_bits(b.to_bits(1e5)), 99840.0, "bf16 has f32's range");
    assert_eq!(b.from_bits(b.to_bits(f32::INFINITY)), f32::INFINITY);
    assert!(b.from_bits(b.to_bits(f32::NAN)).is_nan());
    assert_eq!(b.from_bits(0x3f80), 1.0);
    // relative rounding error within half a step: 2^-11 for fp16 (its normal range), 2^-8 for bf16
    for i in 0..10_000 {
        let x = (1.0 + i as f32 / 10_000.0) * 2f32.powi(i % 29 - 14);
        assert!((f.from_bits(f.to_bits(x)) - x).abs() <= x * 2f32.powi(-11), "fp16 {x}");
        assert!((b.from_bits(b.to_bits(x)) - x).abs() <= x * 2f32.powi(-8), "bf16 {x}");
    }
    assert_eq!((f.name(), b.name()), ("fp16", "bf16"));
}

/// Only common.cuh may know how a 16-bit word encodes its value: the other kernel files read
/// and write through bf2f / f2bf / lo16 / hi16 / pk16, which follow the module's format.
/// (hopper.cu is built for bf16 only.)
#[test]
fn kernel_sources_leave_the_bit_layout_to_common_cuh() {
    use vitscale::backend::cuda::compile::{OPTIONAL, SOURCES};
    for (name, src) in SOURCES.iter().chain(OPTIONAL.iter()) {
        for bad in ["0xffff0000", "cvt.rn.bf16", ".bf16.bf16", "__uint_as_float(((unsigned)"] {
            assert!(!src.contains(bad), "{name} contains {bad:?}: a bf16-only conversion; use common.cuh's helpers");
        }
        for (i, line) in src.lines().enumerate() {
            assert!(!(line.contains("__uint_as_float(") && line.contains("<< 16")), "{name}:{}: a bf16-only conversion: {line}", i + 1);
        }
    }
}
