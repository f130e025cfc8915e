//! Interop with torchvision's `VisionTransformer` (`vit_b_16` and its siblings), both ways.
//!
//! `tests/fixtures/torchvision/` (made by `reference/make_torchvision_fixture.py`):
//! - `tv_<name>.safetensors`: state dicts of small torchvision ViTs with seeded random values,
//!   as torchvision names them (`legacy` with the pre-0.13 MLP names `mlp.linear_1/2`), and
//!   `tv_<name>_logits.safetensors`: torchvision's logits on a seeded input, with the
//!   constructor arguments in the metadata. vitscale, loading the file, must give those logits.
//! - `vitscale_export.safetensors`: what `weights::save_as(.., Torchvision)` wrote for seeded
//!   values; torchvision loaded it with `load_state_dict(strict=True)` and stored its logits as
//!   `vitscale_export_torchvision.safetensors`. Today's export must write the very tensors
//!   torchvision read, and vitscale's logits on them must be torchvision's.
//!
//! Logits tolerance, as `tests/interop.rs`: max |Δ| / max |torchvision| ≤ 1e-4 (f32 both sides,
//! CPU).
//!
//! Regenerate the export (only when the architecture changes):
//! `VITSCALE_TV_DIR=tests/fixtures/torchvision cargo test --release --test torchvision_interop --
//! --ignored`, then on a machine with torchvision
//! `python3 reference/make_torchvision_fixture.py tests/fixtures/torchvision`.

use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use vitscale::backend::cpu::Cpu;
use vitscale::model::weights::{self, WeightsFormat};
use vitscale::model::{smoothed_targets, GlobalPool, ModelConfig, ParamKind, ParamTable, Vit};

mod common;
use common::{fixtures, last_json, tmp, vitscale};

const TOL: f64 = 1e-4;

fn dir() -> PathBuf {
    fixtures().join("torchvision")
}

/// The model torchvision's `VisionTransformer(**args)` is, read from the fixture's metadata.
fn model_of_args(args: &serde_json::Value) -> ModelConfig {
    let u = |k: &str| args[k].as_u64().unwrap_or_else(|| panic!("torchvision_args.{k}")) as usize;
    ModelConfig {
        image_size: u("image_size"),
        patch_size: u("patch_size"),
        in_chans: 3,
        embed_dim: u("hidden_dim"),
        depth: u("num_layers"),
        num_heads: u("num_heads"),
        mlp_ratio: u("mlp_dim") as f64 / u("hidden_dim") as f64,
        num_classes: u("num_classes"),
        qkv_bias: true,
        class_token: true,
        global_pool: GlobalPool::Token,
    }
}

/// (input, logits, torchvision's arguments) of a `*_logits` / `*_torchvision` fixture.
fn reference(path: &Path) -> (Vec<f32>, Vec<f32>, serde_json::Value) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let get = |k: &str| weights::to_f32(path, k, &st.tensor(k).unwrap()).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let args = meta.metadata().as_ref().and_then(|m| m.get("torchvision_args")).expect("torchvision_args metadata");
    (get("input"), get("logits"), serde_json::from_str(args).unwrap())
}

/// Checks vitscale's logits for `weights_file` against torchvision's in `reference_file`.
fn check_logits(weights_file: &Path, reference_file: &Path) {
    let (input, want, args) = reference(reference_file);
    let cfg = model_of_args(&args);
    let be = Cpu::new();
    let mut vit = Vit::new(&be, cfg.clone()).unwrap();
    let host = weights::load(weights_file, &vit.table).unwrap();
    vit.set_params(&be, &host).unwrap();
    let b = input.len() / (3 * cfg.image_size * cfg.image_size);
    assert_eq!(want.len(), b * cfg.num_classes, "{}: fixture shapes", reference_file.display());
    let out = vit.forward(&be, &input, &smoothed_targets(&vec![0; b], cfg.num_classes, 0.0), b, None).unwrap();
    let max_abs = out.logits.iter().zip(&want).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
    let scale = want.iter().map(|v| v.abs() as f64).fold(0.0, f64::max);
    assert!(scale > 0.1, "{}: torchvision's logits are degenerate ({scale})", reference_file.display());
    assert!(
        max_abs / scale <= TOL,
        "{}: logits differ from torchvision's: max |Δ| {max_abs:.3e} of max |torchvision| {scale:.3e}",
        weights_file.display()
    );
}

#[test]
fn vitscale_gives_torchvisions_logits_on_torchvision_files() {
    for name in ["small", "legacy"] {
        check_logits(&dir().join(format!("tv_{name}.safetensors")), &dir().join(format!("tv_{name}_logits.safetensors")));
    }
}

/// What `--init` and `eval --weights` read off a torchvision file's shapes is the model
/// torchvision was built as (the head count aside: it is not in the shapes).
#[test]
fn the_architecture_is_read_off_torchvision_files() {
    for name in ["small", "legacy"] {
        let (_, _, args) = reference(&dir().join(format!("tv_{name}_logits.safetensors")));
        let want = serde_json::to_value(model_of_args(&args)).unwrap();
        let got = weights::infer(&dir().join(format!("tv_{name}.safetensors"))).unwrap();
        for (k, v) in &got.fields {
            assert_eq!(Some(v), want.get(k), "{name}: model.{k}");
        }
        assert_eq!(got.fields.len() + 1, want.as_object().unwrap().len(), "{name}: every field but num_heads");
        assert_eq!(got.num_heads, None);
    }
}

/// Seeded values with every path non-trivial (as `tests/interop.rs`).
fn seeded_params(table: &ParamTable, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut out = vec![0.0f32; table.total];
    for e in &table.entries {
        let fan_in: usize = e.shape.iter().skip(1).product::<usize>().max(1);
        let (centre, half_width) = match e.kind {
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

/// The exported model: 16 patches, 4 heads of width 8, MLP ratio 2, 5 classes.
fn export_model() -> ModelConfig {
    ModelConfig {
        image_size: 16,
        patch_size: 4,
        in_chans: 3,
        embed_dim: 32,
        depth: 2,
        num_heads: 4,
        mlp_ratio: 2.0,
        num_classes: 5,
        qkv_bias: true,
        class_token: true,
        global_pool: GlobalPool::Token,
    }
}

fn export(path: &Path) {
    let cfg = export_model();
    let table = ParamTable::new(&cfg);
    weights::save_as(path, &table, &cfg, &seeded_params(&table, 3000), WeightsFormat::Torchvision).unwrap();
}

type Tensors = Vec<(String, Vec<usize>, safetensors::Dtype, Vec<u8>)>;

fn tensors(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Tensors = st.tensors().into_iter().map(|(k, v)| (k, v.shape().to_vec(), v.dtype(), v.data().to_vec())).collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn assert_same_tensors(now: &Path, committed: &Path, what: &str) {
    let (a, b) = (tensors(now), tensors(committed));
    let keys = |t: &Tensors| t.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
    assert_eq!(keys(&a), keys(&b), "{what}: the keys differ");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((&x.1, x.2), (&y.1, y.2), "{what}: {} shape/dtype", x.0);
        assert!(x.3 == y.3, "{what}: {} holds other values", x.0);
    }
}

#[test]
fn the_torchvision_export_writes_what_torchvision_read() {
    let tmp = tmp();
    let now = tmp.path().join("export.safetensors");
    export(&now);
    assert_same_tensors(&now, &dir().join("vitscale_export.safetensors"), "the export against the file torchvision loaded");
}

#[test]
fn vitscale_logits_of_its_torchvision_export_match_torchvision() {
    let tmp = tmp();
    let path = tmp.path().join("export.safetensors");
    export(&path);
    let (_, _, args) = reference(&dir().join("vitscale_export_torchvision.safetensors"));
    assert_eq!(model_of_args(&args), export_model(), "the model torchvision built from the export");
    check_logits(&path, &dir().join("vitscale_export_torchvision.safetensors"));
}

/// A torchvision file read and written back in torchvision's layout is the same file's tensors
/// (current names: a `legacy` file comes back with `mlp.0` / `mlp.3`).
#[test]
fn torchvision_files_round_trip() {
    let tmp = tmp();
    for name in ["small", "legacy"] {
        let src = dir().join(format!("tv_{name}.safetensors"));
        let (_, _, args) = reference(&dir().join(format!("tv_{name}_logits.safetensors")));
        let cfg = model_of_args(&args);
        let table = ParamTable::new(&cfg);
        let host = weights::load(&src, &table).unwrap();
        let out = tmp.path().join(format!("{name}.safetensors"));
        weights::save_as(&out, &table, &cfg, &host, WeightsFormat::Torchvision).unwrap();
        let renamed: Tensors = tensors(&src)
            .into_iter()
            .map(|(k, s, d, v)| (k.replace(".mlp.linear_1.", ".mlp.0.").replace(".mlp.linear_2.", ".mlp.3."), s, d, v))
            .collect();
        let got = tensors(&out);
        let keys = |t: &Tensors| t.iter().map(|x| x.0.clone()).collect::<Vec<_>>();
        let mut want = renamed;
        want.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(keys(&got), keys(&want), "{name}");
        assert!(got == want, "{name}: values or shapes changed on the way through");
    }
}

/// A file's f32 tensors as (name, shape, bytes), for editing.
type Raw = Vec<(String, Vec<usize>, Vec<u8>)>;
type Edit = Box<dyn FnOnce(&mut Raw)>;

/// `src`'s tensors with `edit` applied, written to `dst`.
fn rewrite(src: &Path, dst: &Path, edit: impl FnOnce(&mut Raw)) {
    let mut t: Raw = tensors(src).into_iter().map(|(k, s, _, v)| (k, s, v)).collect();
    edit(&mut t);
    let views: Vec<(String, TensorView<'_>)> = t.iter().map(|(k, s, v)| (k.clone(), TensorView::new(safetensors::Dtype::F32, s.clone(), v).unwrap())).collect();
    std::fs::write(dst, safetensors::serialize(views, &None).unwrap()).unwrap();
}

/// Files timm's ViT cannot hold are refused with the file and the offending key named, by
/// the loader and by the architecture inference `--init` / `eval` run first.
#[test]
fn torchvision_files_vitscale_cannot_hold_are_refused_by_name() {
    let tmp = tmp();
    let src = dir().join("tv_small.safetensors");
    let (_, _, args) = reference(&dir().join("tv_small_logits.safetensors"));
    let table = ParamTable::new(&model_of_args(&args));
    let c = 32;
    let zeros = |n: usize| vec![0u8; 4 * n];
    let cases: Vec<(&str, Edit, &[&str])> = vec![
        (
            "representation_size",
            Box::new(move |t| {
                t.push(("heads.pre_logits.weight".into(), vec![16, c], zeros(16 * c)));
                t.push(("heads.pre_logits.bias".into(), vec![16], zeros(16)));
                for x in t.iter_mut().filter(|x| x.0 == "heads.head.weight") {
                    *x = (x.0.clone(), vec![10, 16], zeros(160));
                }
            }),
            &["heads.pre_logits.weight", "representation_size"],
        ),
        ("mixed", Box::new(move |t| t.push(("blocks.0.norm1.weight".into(), vec![c], zeros(c)))), &["blocks.0.norm1.weight", "torchvision", "timm"]),
        ("conv_stem", Box::new(move |t| t.push(("conv_proj.conv_last.weight".into(), vec![c, c, 1, 1], zeros(c * c)))), &["conv_proj.conv_last.weight", "conv_stem_configs"]),
        ("unknown", Box::new(move |t| t.push(("encoder.layers.encoder_layer_0.ln_3.weight".into(), vec![c], zeros(c)))), &["encoder_layer_0.ln_3.weight"]),
        (
            "missing",
            Box::new(|t| t.retain(|x| x.0 != "encoder.layers.encoder_layer_1.mlp.3.bias")),
            &["missing", "encoder.layers.encoder_layer_1.mlp.3.bias"],
        ),
    ];
    for (name, edit, needles) in cases {
        let path = tmp.path().join(format!("{name}.safetensors"));
        rewrite(&src, &path, edit);
        let err = weights::load(&path, &table).expect_err(name).to_string();
        assert!(err.contains(&path.display().to_string()), "{name}: {err}");
        for n in needles {
            assert!(err.contains(n), "{name}: `{n}` not in: {err}");
        }
        if name != "missing" {
            let err = weights::infer(&path).expect_err(name).to_string();
            assert!(err.contains(needles[0]), "{name}: infer: {err}");
        }
    }
}

/// The commands: `eval --weights` and `train --init` take a torchvision file as they take a timm
/// one, and `--weights-format torchvision` writes torchvision's key set (that of the file that
/// came in); a model torchvision cannot hold is refused before training starts.
#[test]
fn commands_read_and_write_torchvision_files() {
    let tmp = tmp();
    let src = dir().join("tv_small.safetensors");
    let data = ["--device", "cpu", "--set", "data.dataset=synthetic", "--set", "data.train_size=32", "--set", "data.val_size=16", "--set", "train_batch_size=16"];
    let cmd = |head: &[&str]| -> std::process::Output {
        let args: Vec<&str> = head.iter().chain(data.iter()).copied().collect();
        vitscale(tmp.path(), &args)
    };
    let stderr = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).into_owned();

    // 32 wide: the head count is not the guessable width / 64
    let o = cmd(&["eval", "--json", "--weights", src.to_str().unwrap(), "--set", "model.num_heads=2"]);
    assert!(o.status.success(), "eval: {}", stderr(&o));
    assert_eq!(last_json(&o)["images"].as_u64(), Some(16));

    let out = tmp.path().join("tuned.safetensors");
    let o = cmd(&[
        "train", "--json", "--run-dir", "run", "--init", src.to_str().unwrap(), "--set", "model.num_heads=2", "--set", "train.steps=1",
        "--save-weights", out.to_str().unwrap(), "--weights-format", "torchvision",
    ]);
    assert!(o.status.success(), "train: {}", stderr(&o));
    let keys = |p: &Path| tensors(p).into_iter().map(|t| (t.0, t.1)).collect::<Vec<_>>();
    assert_eq!(keys(&out), keys(&src), "--weights-format torchvision: key names and shapes");
    // and the file it wrote evaluates with no config: its metadata records the head count
    let o = cmd(&["eval", "--json", "--weights", out.to_str().unwrap()]);
    assert!(o.status.success(), "eval of the written file: {}", stderr(&o));

    let o = cmd(&[
        "train", "--run-dir", "run2", "--set", "model.global_pool=\"avg\"", "--set", "train.steps=1",
        "--save-weights", "w.safetensors", "--weights-format", "torchvision",
    ]);
    assert!(!o.status.success(), "an average-pooled model was written in torchvision's layout");
    assert!(stderr(&o).contains("--weights-format torchvision") && stderr(&o).contains("model.global_pool"), "{}", stderr(&o));
    assert!(!tmp.path().join("run2").join("metrics.jsonl").exists(), "refused only after training");
}

/// Writes `vitscale_export.safetensors` for `reference/make_torchvision_fixture.py`.
#[test]
#[ignore = "regenerates tests/fixtures/torchvision/vitscale_export.safetensors; needs VITSCALE_TV_DIR"]
fn write_torchvision_export() {
    let out = PathBuf::from(std::env::var_os("VITSCALE_TV_DIR").expect("set VITSCALE_TV_DIR"));
    std::fs::create_dir_all(&out).unwrap();
    export(&out.join("vitscale_export.safetensors"));
}
