//! The fine-tuning regularizers timm users reach for, checked against independent references:
//! layer-wise learning-rate decay against timm's own parameter groups (a committed fixture made
//! by `reference/make_layer_decay_fixture.py`), stochastic depth against its definition
//! (per-image masks, expectation preserved, N ranks = 1 rank), and the weight EMA against the
//! update rule applied to the weights the run itself saved.

use serde_json::Value;
use vitscale::config::DecaySkip;
use vitscale::model::params::ParamTable;
use vitscale::model::spec::{GlobalPool, ModelConfig};
use vitscale::backend::ParamGroups;

fn fixture(name: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).expect("fixture JSON")
}

/// The architecture of one of the fixture's timm models (`VisionTransformer` keyword arguments).
fn model_of(kw: &Value) -> ModelConfig {
    let int = |k: &str| kw[k].as_u64().unwrap_or_else(|| panic!("fixture model lacks {k}")) as usize;
    let avg = kw.get("global_pool").and_then(Value::as_str) == Some("avg");
    ModelConfig {
        image_size: int("img_size"),
        patch_size: int("patch_size"),
        in_chans: 3,
        embed_dim: int("embed_dim"),
        depth: int("depth"),
        num_heads: int("num_heads"),
        mlp_ratio: 4.0,
        num_classes: int("num_classes"),
        qkv_bias: true,
        class_token: kw.get("class_token").and_then(Value::as_bool).unwrap_or(true),
        global_pool: if avg { GlobalPool::Avg } else { GlobalPool::Token },
    }
}

/// Every parameter's learning-rate factor and weight decay equal timm's
/// `param_groups_layer_decay` (weight decay 0.05, the model's `no_weight_decay()` list) for each
/// pooling and class-token layout and two decay rates.
#[test]
fn layer_decay_groups_are_timms() {
    let fx = fixture("layer_decay.json");
    let cases = fx["cases"].as_array().expect("cases");
    assert!(cases.len() >= 6);
    let skip = DecaySkip { bias: true, norm: true, pos_embed: true, cls_token: true };
    for case in cases {
        let (name, ld) = (case["name"].as_str().unwrap(), case["layer_decay"].as_f64().unwrap());
        let table = ParamTable::new(&model_of(&case["model"]));
        let groups = ParamGroups::new(&table, &skip).with_layer_decay(&table, ld);
        let want = case["params"].as_object().expect("params");
        assert_eq!(table.entries.len(), want.len(), "{name}: parameter count");
        for (entry, g) in table.entries.iter().zip(&groups.groups) {
            assert_eq!(entry.span, g.span);
            let w = want.get(&entry.name).unwrap_or_else(|| panic!("{name}: timm has no {}", entry.name));
            let scale = w["lr_scale"].as_f64().unwrap();
            assert!(((g.lr_scale as f64) - scale).abs() <= 1e-7 * scale, "{name} ld {ld}: {} lr_scale {} vs timm {scale}", entry.name, g.lr_scale);
            assert_eq!(g.decays, w["weight_decay"].as_f64().unwrap() > 0.0, "{name}: decay of {}", entry.name);
        }
    }
}

mod common;
use common::{ok, tensors, tmp, vitscale};

/// One SGD step (no momentum, no weight decay) from the same weights on the same batch: with
/// layer decay 0.5 every tensor moves by its timm factor times what it moves without, in a
/// real training run (the factor reaches the update through the trainer's groups).
#[test]
fn a_training_step_scales_each_layers_update_by_its_factor() {
    let t = tmp();
    let dir = t.path();
    let common: Vec<String> = ["--device", "cpu", "--set", "data.train_size=64", "--set", "data.val_size=16", "--set", "train.eval_every=0",
        "--set", "train_micro_batch_size_per_gpu=16", "--set", "train.steps=1"].iter().map(|s| s.to_string()).collect();
    let start = dir.join("start.safetensors");
    let mut a: Vec<String> = vec!["train".into()];
    a.extend(common.clone());
    a.extend(["--save-weights".into(), start.display().to_string(), "--run-dir".into(), dir.join("r0").display().to_string()]);
    ok(&vitscale(dir, &a), "first run");
    let sgd = ["--set", "optimizer.type=SGD", "--set", "optimizer.params.lr=0.5", "--set", "optimizer.params.momentum=0", "--set", "optimizer.params.weight_decay=0"];
    let step = |name: &str, extra: &[&str]| {
        let out = dir.join(format!("{name}.safetensors"));
        let mut a: Vec<String> = vec!["train".into(), "--init".into(), start.display().to_string()];
        a.extend(common.clone());
        a.extend(sgd.iter().chain(extra).map(|s| s.to_string()));
        a.extend(["--save-weights".into(), out.display().to_string(), "--run-dir".into(), dir.join(name).display().to_string()]);
        ok(&vitscale(dir, &a), name);
        tensors(&out)
    };
    let plain = step("plain", &[]);
    let decayed = step("decayed", &["--set", "optimizer.params.layer_decay=0.5"]);
    let w0 = tensors(&start);
    let depth = w0.iter().filter(|(n, _)| n.ends_with(".norm1.weight")).count() as i32;
    assert!(depth >= 2);
    let mut checked = 0;
    for (((name, w), (_, p)), (_, d)) in w0.iter().zip(&plain).zip(&decayed) {
        let want = if let Some(rest) = name.strip_prefix("blocks.") {
            0.5f64.powi(depth - rest.split('.').next().unwrap().parse::<i32>().unwrap())
        } else if name.starts_with("norm.") {
            0.5
        } else if name.starts_with("head.") || name.starts_with("fc_norm.") {
            1.0
        } else {
            0.5f64.powi(depth + 1)
        };
        let (dp, dd): (Vec<f64>, Vec<f64>) = w.iter().zip(p).zip(d).map(|((&w, &p), &d)| ((p - w) as f64, (d - w) as f64)).unzip();
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm(&dp) == 0.0 {
            continue; // a tensor whose gradient is zero on this batch
        }
        let err: f64 = dp.iter().zip(&dd).map(|(p, d)| (d - want * p).powi(2)).sum::<f64>().sqrt() / (want * norm(&dp));
        // f32 rounding of weights near 1 (norms) against updates of 1e-4: a few parts in 1e3;
        // neighbouring layers differ by a factor of 2
        assert!(err < 1e-2, "{name}: update ratio off by {err:.2e} (factor {want})");
        checked += 1;
    }
    assert!(checked > 10, "only {checked} tensors moved");
}
