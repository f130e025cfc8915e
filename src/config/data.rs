//! The `data` section (vitscale's own): which dataset, where it lies, its normalization, and
//! the training augmentation with timm's names (RandAugment, mixup/cutmix, random erasing).

use serde_json::{json, Map, Value};

use super::key_def::*;
use super::types::*;
use super::value::*;

pub(super) const DATA: KeyDef = key("data", Ty::Section, Dflt::Derived("built-in dataset"), "The dataset and its preprocessing.");

const D_DATASET: KeyDef = key("dataset", Ty::Choice(DatasetKind::NAMES), Dflt::Str("builtin"),
    "Which dataset: builtin (generated shapes), synthetic (random pixels), cifar10 / cifar100 (any of their distributed forms under data.path), folder (an image folder: path/<class>/*.jpg|png|webp, or path/train/<class>/… + path/val/<class>/…), shards (such a folder packed into WebDataset-layout .tar shards by `vitscale data pack`; read by offset, same order, batches and augmentation as the folder).");
// Where the same dataset lies and how the loader is run do not change what it yields: a
// resume may change them.
const D_PATH: KeyDef = key("path", Ty::Str, Dflt::Derived("required for cifar10/cifar100/folder/shards, not used otherwise"), "Dataset directory.").resume_free();
const D_MEAN: KeyDef = key("mean", Ty::Nums(3), Dflt::Derived("builtin/synthetic 0.5; cifar10 (0.4914, 0.4822, 0.4465); cifar100 (0.5071, 0.4865, 0.4409); folder/shards ImageNet (0.485, 0.456, 0.406)"), "Per-channel mean subtracted after scaling to [0, 1].");
const D_STD: KeyDef = key("std", Ty::Nums(3), Dflt::Derived("builtin/synthetic 0.5; cifar10 (0.2470, 0.2435, 0.2616); cifar100 (0.2673, 0.2564, 0.2762); folder/shards ImageNet (0.229, 0.224, 0.225)"), "Per-channel std divided by; each > 0.");
const D_AUGMENT: KeyDef = key("augment", Ty::Choice(&["none", "default"]), Dflt::Str("default"),
    "Training augmentation: default = CIFAR pad-4 crop + flip, built-in flip, resampled sets RandomResizedCrop(scale, ratio) + flip; none = as stored / center crop. The options below add to it.");
const D_SHUFFLE: KeyDef = key("shuffle", Ty::Bool, Dflt::Bool(true), "Shuffle the training set every epoch.");
const D_WORKERS: KeyDef = key("num_workers", NONNEG_INT, Dflt::Int(0), "Loader threads (training and evaluation batches); 0 = all cores.")
    .resume_free();
pub(super) const D_TRAIN_SIZE: KeyDef = key("train_size", POS_INT, Dflt::Int(6000), "Training images (builtin/synthetic only).");
pub(super) const D_VAL_SIZE: KeyDef = key("val_size", POS_INT, Dflt::Int(2000), "Validation images (builtin/synthetic only).");
const D_LABEL: KeyDef = key("label", Ty::Choice(&["fine", "coarse"]), Dflt::Str("fine"),
    "CIFAR-100 label: the 100 fine classes or the 20 coarse superclasses (coarse only with cifar100; model.num_classes follows).");
const D_SKIP_BAD: KeyDef = key("skip_bad", Ty::Bool, Dflt::Bool(false),
    "Replace an image file that cannot be read or decoded by the next good one of its split and count it (summary.json `skipped`), instead of stopping with an error naming the file.");
const D_VAL_SPLIT: KeyDef = key("val_split", UNIT_HALF_OPEN, Dflt::Num(0.1),
    "Folder without train/ + val/ subfolders: fraction of each class held out (seeded) for validation. Shards were split when packed (`vitscale data pack --val-split`): not used.");
const D_CROP_PCT: KeyDef = key("crop_pct", Ty::Num { lo: 0.0, hi: 1.0, lo_open: true, hi_open: false }, Dflt::Num(0.875),
    "Evaluation of resampled sets: resize the shorter side to image_size / crop_pct, center-crop image_size (timm's crop_pct).");
const D_SCALE: KeyDef = key("scale", Ty::Nums(2), Dflt::Nums(&[0.08, 1.0]), "RandomResizedCrop area range [lo, hi], 0 < lo <= hi <= 1.");
const D_RATIO: KeyDef = key("ratio", Ty::Nums(2), Dflt::Nums(&[0.75, 1.3333333333333333]), "RandomResizedCrop aspect-ratio range [lo, hi], 0 < lo <= hi.");
const D_INTERPOLATION: KeyDef = key("interpolation", Ty::Choice(Interpolation::NAMES), Dflt::Str("bilinear"),
    "Resampling filter of RandomResizedCrop and the evaluation resize (resampled sets only), PIL's antialiased filters as torchvision applies them. timm's ViT recipes evaluate (and its ImageNet ones train) with bicubic: set \"bicubic\" to match them.");
const D_PREFETCH: KeyDef = key("prefetch", POS_INT, Dflt::Int(2), "Batches the loader builds ahead of the training step, and of the evaluation forward (bounded queue).")
    .resume_free();
const D_AUTO_AUGMENT: KeyDef = key("auto_augment", Ty::Str, Dflt::Str("none"),
    "RandAugment as a timm string, e.g. \"rand-m9-mstd0.5-inc1\": m magnitude (0-10), n ops per image (2), mstd magnitude noise, mmax clip (10), inc1 increasing ops, p op probability (0.5); \"none\" = off. Training batches only, after crop + flip.");
const D_MIXUP: KeyDef = key("mixup", NONNEG, Dflt::Num(0.0), "Mixup Beta(α, α) parameter (timm --mixup); 0 = off. Needs an even micro batch.");
const D_CUTMIX: KeyDef = key("cutmix", NONNEG, Dflt::Num(0.0), "CutMix Beta(α, α) parameter (timm --cutmix); 0 = off. Needs an even micro batch.");
const D_MIXUP_PROB: KeyDef = key("mixup_prob", UNIT, Dflt::Num(1.0), "Probability a global batch (a pair, an image: see mixup_mode) is mixed (timm --mixup-prob).");
const D_MIXUP_SWITCH: KeyDef = key("mixup_switch_prob", UNIT, Dflt::Num(0.5), "With mixup and cutmix both on: probability of cutmix, per mixing draw (timm --mixup-switch-prob).");
const D_MIXUP_MODE: KeyDef = key("mixup_mode", Ty::Choice(MixMode::NAMES), Dflt::Str("batch"),
    "What one mixing draw (mixed or not, mixup or cutmix, λ, box) covers, timm's --mixup-mode: batch = the whole global batch; pair = each pair of partners, mixed with each other; elem = each image, mixed with its partner's unmixed pixels. Partners are neighbours in the global batch order (0↔1, 2↔3, …), so the result does not depend on the rank split. train.label_smoothing is folded into the mixed targets.");
const D_REPROB: KeyDef = key("reprob", UNIT, Dflt::Num(0.0), "Random erasing probability per training image (timm --reprob); 0 = off.");
const D_REMODE: KeyDef = key("remode", Ty::Choice(&["pixel", "const", "rand"]), Dflt::Str("pixel"),
    "Random erasing fill: pixel = per-pixel normal noise, const = 0 (the mean), rand = one normal value per channel (timm --remode).");
const D_RECOUNT: KeyDef = key("recount", POS_INT, Dflt::Int(1), "Random erasing: up to this many boxes per image (timm --recount).");
const D_DECODE: KeyDef = key("decode", Ty::Choice(Decode::NAMES), Dflt::Str("cpu"),
    "Where JPEG files are decoded: cpu = the loader's threads; gpu = nvJPEG on the training GPU (its hardware JPEG engines where it has them), with RandomResizedCrop, flip and normalization as kernels, the loader's threads only reading files; auto = gpu where that can run and pays (CUDA device with JPEG engines, image files, no RandAugment, random erasing, mixup or CutMix), else cpu. docs/data.md says which augmentation runs where.")
    .resume_free();
const D_DECODE_SCALE: KeyDef = key("decode_scale", Ty::Choice(DecodeScale::NAMES), Dflt::Str("auto"),
    "How much of each JPEG the CPU decodes (data.decode = cpu, and data.decode_cpu_share of data.decode = gpu): auto = libjpeg-turbo decodes only the rows and columns the crop's resampling reads, at the largest DCT reduction 1/2, 1/4 or 1/8 that still leaves the crop at least image_size px both ways (training crops and the evaluation resize alike), so the images equal a full decode's up to resampling differences (docs/data.md); full = the whole image at full size (zune-jpeg). Other formats, and JPEGs libjpeg-turbo rejects or warns about, are always decoded whole; a binary built without the turbojpeg cargo feature decodes whole under auto too.")
    .resume_free();
const D_DECODE_CPU_SHARE: KeyDef = key("decode_cpu_share", UNIT, Dflt::Num(0.0),
    "With data.decode = gpu: the share of JPEG images (0 to 1) the loader's threads decode on the CPU, as data.decode_scale says, instead of nvJPEG; the GPU resamples them like the rest. Which images is drawn from seed, epoch and index, so a rerun decodes the same ones. It moves decode work from the GPU, where it slows the step beside it, to loader cores that would otherwise wait; more than those cores can decode in a step makes the run wait for data. It pays where nvJPEG decodes on the SMs (a GPU without JPEG engines), not on the engines (docs/data.md, measured). Not used by the CPU path.")
    .resume_free();
/// Keys of the `data` section (extend here).
pub const DATA_KEYS: &[KeyDef] = &[
    D_DATASET, D_PATH, D_MEAN, D_STD, D_AUGMENT, D_SHUFFLE, D_WORKERS, D_TRAIN_SIZE, D_VAL_SIZE, D_LABEL, D_SKIP_BAD, D_VAL_SPLIT,
    D_CROP_PCT, D_SCALE, D_RATIO, D_INTERPOLATION, D_PREFETCH, D_AUTO_AUGMENT, D_MIXUP, D_CUTMIX, D_MIXUP_PROB, D_MIXUP_SWITCH, D_MIXUP_MODE,
    D_REPROB, D_REMODE, D_RECOUNT, D_DECODE, D_DECODE_SCALE, D_DECODE_CPU_SHARE,
];

/// Parses a timm RandAugment string (`rand-m9-n2-mstd0.5-mmax10-inc1-p0.5`; sections in any
/// order after `rand`). `none` or `""` = off.
pub fn parse_rand_augment(spec: &str) -> std::result::Result<Option<RandAugmentConfig>, String> {
    if spec.is_empty() || spec == "none" {
        return Ok(None);
    }
    let mut parts = spec.split('-');
    if parts.next() != Some("rand") {
        return Err(format!("\"{spec}\" is not supported: expected a RandAugment string starting with \"rand\" (e.g. \"rand-m9-mstd0.5-inc1\") or \"none\""));
    }
    let mut c = RandAugmentConfig {
        spec: spec.to_string(),
        magnitude: 10.0,
        num_layers: 2,
        magnitude_std: 0.0,
        magnitude_max: 10.0,
        increasing: false,
        prob: 0.5,
    };
    for part in parts {
        let (name, val) = ["mstd", "mmax", "inc", "m", "n", "p"]
            .iter()
            .find(|n| part.starts_with(**n))
            .map_or((part, ""), |n| (*n, &part[n.len()..]));
        let num = || val.parse::<f64>().ok().filter(|x| x.is_finite());
        let bad = || format!("section \"{part}\" of \"{spec}\" is not a valid number for `{name}`");
        match name {
            "m" => c.magnitude = num().filter(|x| (0.0..=30.0).contains(x)).ok_or_else(bad)?,
            "n" => c.num_layers = val.parse::<usize>().ok().filter(|n| (1..=16).contains(n)).ok_or_else(bad)?,
            // timm: mstd > 100 (or inf) means a uniform magnitude in [0, m].
            "mstd" if val == "inf" => c.magnitude_std = f64::INFINITY,
            "mstd" => {
                let x = num().filter(|x| *x >= 0.0).ok_or_else(bad)?;
                c.magnitude_std = if x > 100.0 { f64::INFINITY } else { x };
            }
            "mmax" => c.magnitude_max = num().filter(|x| *x > 0.0).ok_or_else(bad)?,
            "inc" => c.increasing = val.parse::<u32>().map_err(|_| bad())? != 0,
            "p" => c.prob = num().filter(|x| (0.0..=1.0).contains(x)).ok_or_else(bad)?,
            _ => return Err(format!("unknown section \"{part}\" in \"{spec}\"; expected m<magnitude>, n<layers>, mstd<std>, mmax<max>, inc<0|1>, p<prob>")),
        }
    }
    Ok(Some(c))
}

/// The `data` section: the dataset, its normalization (the dataset's own by default) and the
/// augmentation options, checked against each other.
pub(super) fn parse(sec: Option<&Map<String, Value>>, cx: &mut Cx) -> Result<DataConfig> {
    let p = DATA.name;
    if let Some(s) = sec {
        check_keys(p, s, DATA_KEYS, &[])?;
    }
    let dataset = match get_str(sec, p, &D_DATASET, cx)? {
        "synthetic" => DatasetKind::Synthetic,
        "cifar10" => DatasetKind::Cifar10,
        "cifar100" => DatasetKind::Cifar100,
        "folder" => DatasetKind::Folder,
        "shards" => DatasetKind::Shards,
        _ => DatasetKind::Builtin,
    };
    // datasets read from data.path
    let is_cifar = matches!(dataset, DatasetKind::Cifar10 | DatasetKind::Cifar100 | DatasetKind::Folder | DatasetKind::Shards);
    let path = opt_str(sec, p, &D_PATH, cx)?.map(std::path::PathBuf::from);
    match (&path, is_cifar) {
        (None, true) => {
            return Err(key_err(full(p, D_PATH.name), format!("is required for data.dataset \"{}\" (the directory holding the dataset)", dataset.as_str())))
        }
        (Some(_), false) => {
            return Err(key_err(full(p, D_PATH.name), format!("is only used by cifar10/cifar100/folder/shards; data.dataset \"{}\" reads no files", dataset.as_str())))
        }
        _ => {}
    }
    let (dmean, dstd): ([f32; 3], [f32; 3]) = match dataset {
        DatasetKind::Builtin | DatasetKind::Synthetic => ([0.5; 3], [0.5; 3]),
        DatasetKind::Cifar10 => ([0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]),
        DatasetKind::Cifar100 => ([0.5071, 0.4865, 0.4409], [0.2673, 0.2564, 0.2762]),
        // timm's IMAGENET_DEFAULT_MEAN / _STD.
        DatasetKind::Folder | DatasetKind::Shards => ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    };
    let to3 = |v: Vec<f64>| [v[0] as f32, v[1] as f32, v[2] as f32];
    let mean = opt_nums(sec, p, &D_MEAN, cx)?.map(to3).unwrap_or(dmean);
    let std = opt_nums(sec, p, &D_STD, cx)?.map(to3).unwrap_or(dstd);
    if std.iter().any(|s| *s <= 0.0) {
        return Err(key_err(full(p, D_STD.name), format!("each value must be > 0, got {std:?}")));
    }
    let augment = match get_str(sec, p, &D_AUGMENT, cx)? {
        "none" => Augment::None,
        _ => Augment::Default,
    };
    let shuffle = get_bool(sec, p, &D_SHUFFLE, cx)?;
    let num_workers = get_int(sec, p, &D_WORKERS, cx)? as usize;
    if is_cifar {
        for def in [&D_TRAIN_SIZE, &D_VAL_SIZE] {
            if sec.is_some_and(|s| s.contains_key(def.name)) {
                return Err(key_err(full(p, def.name), format!("is only used by the builtin and synthetic datasets (\"{}\" has its own splits)", dataset.as_str())));
            }
        }
    }
    let train_size = get_int(sec, p, &D_TRAIN_SIZE, cx)? as usize;
    let val_size = get_int(sec, p, &D_VAL_SIZE, cx)? as usize;
    let label = match get_str(sec, p, &D_LABEL, cx)? {
        "coarse" => LabelKind::Coarse,
        _ => LabelKind::Fine,
    };
    if label == LabelKind::Coarse && dataset != DatasetKind::Cifar100 {
        return Err(key_err(full(p, D_LABEL.name), format!("\"coarse\" labels exist only in cifar100, not \"{}\"", dataset.as_str())));
    }
    let pair = |def: &KeyDef, dflt: [f64; 2], hi: f64, cx: &mut Cx| -> Result<[f64; 2]> {
        match opt_nums(sec, p, def, cx)? {
            None => Ok(dflt),
            Some(v) if v[0] > 0.0 && v[0] <= v[1] && v[1] <= hi => Ok([v[0], v[1]]),
            Some(v) => Err(key_err(full(p, def.name), format!("expected 0 < lo <= hi{}, got {v:?}", if hi.is_finite() { " <= 1" } else { "" }))),
        }
    };
    let scale = pair(&D_SCALE, DataConfig::DEFAULT_SCALE, 1.0, cx)?;
    let ratio = pair(&D_RATIO, DataConfig::DEFAULT_RATIO, f64::INFINITY, cx)?;
    let auto_augment = parse_rand_augment(get_str(sec, p, &D_AUTO_AUGMENT, cx)?).map_err(|m| key_err(full(p, D_AUTO_AUGMENT.name), m))?;
    let aug = AugmentOptions {
        auto_augment,
        mixup: get_num(sec, p, &D_MIXUP, cx)?,
        cutmix: get_num(sec, p, &D_CUTMIX, cx)?,
        mixup_prob: get_num(sec, p, &D_MIXUP_PROB, cx)?,
        mixup_switch_prob: get_num(sec, p, &D_MIXUP_SWITCH, cx)?,
        mixup_mode: match get_str(sec, p, &D_MIXUP_MODE, cx)? {
            "pair" => MixMode::Pair,
            "elem" => MixMode::Elem,
            _ => MixMode::Batch,
        },
        reprob: get_num(sec, p, &D_REPROB, cx)?,
        remode: match get_str(sec, p, &D_REMODE, cx)? {
            "const" => EraseMode::Const,
            "rand" => EraseMode::Rand,
            _ => EraseMode::Pixel,
        },
        recount: get_int(sec, p, &D_RECOUNT, cx)? as usize,
    };
    if augment == Augment::None && (aug.auto_augment.is_some() || aug.reprob > 0.0 || aug.mixes()) {
        cx.warn("data.augment = \"none\": data.auto_augment, data.reprob, data.mixup and data.cutmix are not applied".into());
    }
    Ok(DataConfig {
        dataset,
        path,
        mean,
        std,
        augment,
        shuffle,
        num_workers,
        train_size,
        val_size,
        label,
        skip_bad: get_bool(sec, p, &D_SKIP_BAD, cx)?,
        val_split: get_num(sec, p, &D_VAL_SPLIT, cx)?,
        crop_pct: get_num(sec, p, &D_CROP_PCT, cx)?,
        scale,
        ratio,
        interpolation: match get_str(sec, p, &D_INTERPOLATION, cx)? {
            "bicubic" => Interpolation::Bicubic,
            _ => Interpolation::Bilinear,
        },
        prefetch: get_int(sec, p, &D_PREFETCH, cx)? as usize,
        decode: match get_str(sec, p, &D_DECODE, cx)? {
            "gpu" => Decode::Gpu,
            "auto" => Decode::Auto,
            _ => Decode::Cpu,
        },
        decode_scale: match get_str(sec, p, &D_DECODE_SCALE, cx)? {
            "full" => DecodeScale::Full,
            _ => DecodeScale::Auto,
        },
        decode_cpu_share: get_num(sec, p, &D_DECODE_CPU_SHARE, cx)?,
        aug,
    })
}

/// Mixing pairs neighbouring images, so it needs an even micro-batch.
pub(super) fn check_mixing_batch(data: &DataConfig, batch: &BatchConfig) -> Result<()> {
    if data.aug.mixes() && batch.micro_batch_per_gpu % 2 != 0 {
        let def = if data.aug.mixup > 0.0 { &D_MIXUP } else { &D_CUTMIX };
        return Err(key_err(
            full(DATA.name, def.name),
            format!("mixing pairs neighbouring images, so train_micro_batch_size_per_gpu must be even (got {})", batch.micro_batch_per_gpu),
        ));
    }
    Ok(())
}

/// Every option as resolved (the dataset's own defaults written out); then where the data
/// comes from: the directory of a dataset read from files, the split sizes of a generated one.
pub(super) fn write(d: &DataConfig) -> Value {
    let mut out = Map::new();
    put(&mut out, &D_DATASET, json!(d.dataset.as_str()));
    put(&mut out, &D_MEAN, json!(d.mean));
    put(&mut out, &D_STD, json!(d.std));
    put(&mut out, &D_AUGMENT, json!(match d.augment { Augment::None => "none", Augment::Default => "default" }));
    put(&mut out, &D_SHUFFLE, json!(d.shuffle));
    put(&mut out, &D_WORKERS, json!(d.num_workers));
    put(&mut out, &D_LABEL, json!(match d.label { LabelKind::Fine => "fine", LabelKind::Coarse => "coarse" }));
    put(&mut out, &D_SKIP_BAD, json!(d.skip_bad));
    put(&mut out, &D_VAL_SPLIT, json!(d.val_split));
    put(&mut out, &D_CROP_PCT, json!(d.crop_pct));
    put(&mut out, &D_SCALE, json!(d.scale));
    put(&mut out, &D_RATIO, json!(d.ratio));
    put(&mut out, &D_INTERPOLATION, json!(d.interpolation.as_str()));
    put(&mut out, &D_PREFETCH, json!(d.prefetch));
    put(&mut out, &D_DECODE, json!(d.decode.as_str()));
    put(&mut out, &D_DECODE_SCALE, json!(d.decode_scale.as_str()));
    put(&mut out, &D_DECODE_CPU_SHARE, json!(d.decode_cpu_share));
    put(&mut out, &D_AUTO_AUGMENT, json!(d.aug.auto_augment.as_ref().map_or("none", |r| r.spec.as_str())));
    put(&mut out, &D_MIXUP, json!(d.aug.mixup));
    put(&mut out, &D_CUTMIX, json!(d.aug.cutmix));
    put(&mut out, &D_MIXUP_PROB, json!(d.aug.mixup_prob));
    put(&mut out, &D_MIXUP_SWITCH, json!(d.aug.mixup_switch_prob));
    put(&mut out, &D_MIXUP_MODE, json!(d.aug.mixup_mode.as_str()));
    put(&mut out, &D_REPROB, json!(d.aug.reprob));
    let remode = match d.aug.remode {
        EraseMode::Pixel => "pixel",
        EraseMode::Const => "const",
        EraseMode::Rand => "rand",
    };
    put(&mut out, &D_REMODE, json!(remode));
    put(&mut out, &D_RECOUNT, json!(d.aug.recount));
    match &d.path {
        Some(path) => put(&mut out, &D_PATH, json!(path.display().to_string())),
        None => {
            put(&mut out, &D_TRAIN_SIZE, json!(d.train_size));
            put(&mut out, &D_VAL_SIZE, json!(d.val_size));
        }
    }
    Value::Object(out)
}
