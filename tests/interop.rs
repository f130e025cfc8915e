//! Interop both ways: timm loads what vitscale writes.
//!
//! `tests/fixtures/interop/<name>_export.safetensors` are weights files that `weights::save`
//! wrote (seeded random values for every parameter, three architectures: class token with token
//! pooling and qkv bias; no class token with average pooling; class token with average pooling
//! and `fc_norm`). `reference/make_interop_fixture.py` loaded each into timm with
//! `load_state_dict(strict=True)` and stored timm's logits on a seeded input as
//! `<name>_timm.safetensors`. Here:
//! - today's `weights::save` must write the very tensors timm read (same keys, shapes, dtypes and
//!   bytes), so a change to the export's key names or layout fails this test;
//! - vitscale's forward on those weights, loaded back through `weights::load`, must give timm's
//!   logits: max |Δ| / max |timm| ≤ 1e-4 (f32 against timm in f32 on the CPU).
//!
//! Regenerate (only when the architecture set changes): `VITSCALE_INTEROP_DIR=tests/fixtures/interop
//! cargo test --release --test interop -- --ignored`, then on a machine with timm
//! `python3 reference/make_interop_fixture.py tests/fixtures/interop`.

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use safetensors::SafeTensors;
use vitscale::backend::cpu::Cpu;
use vitscale::model::{smoothed_targets, weights, GlobalPool, ModelConfig, ParamKind, ParamTable, Vit};

mod common;
use common::{fixtures, tmp};

const TOL: f64 = 1e-4;

fn dir() -> PathBuf {
    fixtures().join("interop")
}

fn model(name: &str) -> ModelConfig {
    let base = ModelConfig {
        image_size: 16,
        patch_size: 4,
        in_chans: 3,
        embed_dim: 32,
        depth: 2,
        num_heads: 4,
        mlp_ratio: 4.0,
        num_classes: 5,
        qkv_bias: true,
        class_token: true,
        global_pool: GlobalPool::Token,
    };
    match name {
        "cls_token" => base,
        "avg_no_cls" => ModelConfig { image_size: 12, patch_size: 3, embed_dim: 24, num_heads: 3, mlp_ratio: 2.5, num_classes: 7, qkv_bias: false, class_token: false, global_pool: GlobalPool::Avg, ..base },
        "cls_avg_fc_norm" => ModelConfig { depth: 3, num_heads: 2, qkv_bias: false, global_pool: GlobalPool::Avg, ..base },
        _ => unreachable!("unknown interop model {name}"),
    }
}

const NAMES: [&str; 3] = ["cls_token", "avg_no_cls", "cls_avg_fc_norm"];

/// Seeded weights with every path non-trivial: dense weights of std 1/sqrt(fan in), LayerNorm
/// weights near 1, biases and tokens small but non-zero.
fn seeded_params(table: &ParamTable, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut out = vec![0.0f32; table.total];
    for e in &table.entries {
        let fan_in: usize = e.shape.iter().skip(1).product::<usize>().max(1);
        let (centre, half_width) = match e.kind {
            // uniform(-a, a) has std a / sqrt(3)
            ParamKind::Weight => (0.0, 3f32.sqrt() / (fan_in as f32).sqrt()),
            ParamKind::NormWeight => (1.0, 0.2),
            _ => (0.0, 0.1),
        };
        for v in &mut out[e.span.range()] {
            *v = centre + half_width * rng.gen_range(-1.0f32..1.0);
        }
    }
    out
}

fn export(name: &str, path: &Path) {
    let cfg = model(name);
    let table = ParamTable::new(&cfg);
    weights::save(path, &table, &cfg, &seeded_params(&table, 1000 + NAMES.iter().position(|n| *n == name).unwrap() as u64)).unwrap();
}

/// (shape, dtype, bytes) per key.
fn tensors(bytes: &[u8]) -> Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)> {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let mut out: Vec<_> = st.tensors().into_iter().map(|(k, v)| (k, v.shape().to_vec(), v.dtype(), v.data().to_vec())).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn the_export_writes_what_timm_read() {
    let tmp = tmp();
    for name in NAMES {
        let now = tmp.path().join(format!("{name}.safetensors"));
        export(name, &now);
        let committed = dir().join(format!("{name}_export.safetensors"));
        let (a, b) = (tensors(&std::fs::read(&now).unwrap()), tensors(&std::fs::read(&committed).unwrap()));
        let keys = |t: &[(String, Vec<usize>, safetensors::Dtype, Vec<u8>)]| t.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
        assert_eq!(keys(&a), keys(&b), "{name}: the export's keys differ from the file timm loaded");
        for (x, y) in a.iter().zip(&b) {
            assert_eq!((&x.1, x.2), (&y.1, y.2), "{name}: {} shape/dtype", x.0);
            assert!(x.3 == y.3, "{name}: {} holds other values than the file timm loaded", x.0);
        }
    }
}

#[test]
fn vitscale_logits_of_its_export_match_timm() {
    let be = Cpu::new();
    let tmp = tmp();
    for name in NAMES {
        let cfg = model(name);
        let path = tmp.path().join(format!("{name}.safetensors"));
        export(name, &path);
        let mut vit = Vit::new(&be, cfg.clone()).unwrap();
        let host = weights::load(&path, &vit.table).unwrap();
        vit.set_params(&be, &host).unwrap();

        let fx_path = dir().join(format!("{name}_timm.safetensors"));
        let bytes = std::fs::read(&fx_path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let get = |k: &str| weights::to_f32(&fx_path, k, &st.tensor(k).unwrap()).unwrap();
        let (input, want) = (get("input"), get("logits"));
        let b = input.len() / (3 * cfg.image_size * cfg.image_size);
        assert_eq!(want.len(), b * cfg.num_classes, "{name}: fixture shapes");
        let targets = smoothed_targets(&vec![0; b], cfg.num_classes, 0.0);
        let out = vit.forward(&be, &input, &targets, b, None).unwrap();
        assert!(out.logits.iter().all(|v| v.is_finite()), "{name}: non-finite logits");
        let max_abs = out.logits.iter().zip(&want).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
        let scale = want.iter().map(|v| v.abs() as f64).fold(0.0, f64::max);
        assert!(scale > 0.1, "{name}: timm's logits are degenerate ({scale})");
        assert!(max_abs / scale <= TOL, "{name}: logits differ from timm's: max |Δ| {max_abs:.3e} of max |timm| {scale:.3e}");
    }
}

/// Writes the export files for `reference/make_interop_fixture.py` (see the module doc).
#[test]
#[ignore = "regenerates tests/fixtures/interop/*_export.safetensors; needs VITSCALE_INTEROP_DIR"]
fn write_interop_exports() {
    let out = PathBuf::from(std::env::var_os("VITSCALE_INTEROP_DIR").expect("set VITSCALE_INTEROP_DIR"));
    std::fs::create_dir_all(&out).unwrap();
    for name in NAMES {
        export(name, &out.join(format!("{name}_export.safetensors")));
    }
}
