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
