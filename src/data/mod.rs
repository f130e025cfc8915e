//! Datasets and batches: what the training loop feeds the model.
//!
//! - [`open`] turns the `data` section into a train and a val [`ImageSet`]: in memory as HWC u8
//!   (built-in and synthetic sets are generated; CIFAR is read from any of its distributed
//!   forms) or, for image folders, as a file list decoded per batch (for tar shards made by
//!   `vitscale data pack`, the same list as offsets into the shards: [`shards`]).
//! - [`Sampler`] plans which dataset indices form each *global* batch, independent of the world
//!   size; [`shard`] cuts out one rank's micro-batch.
//! - [`try_make_batch`] decodes, augments and normalizes the chosen images in parallel into the
//!   model's (B, 3, S, S) f32 input; [`Loader`] does it ahead of the training step on its own
//!   threads. Augmentation randomness is keyed by (seed, epoch, dataset index) only, so an image
//!   looks the same whichever rank or micro-batch it lands in: N ranks see exactly the images
//!   1 rank would.
//!
//! Transforms (timm/torchvision semantics, `data.augment=default`, training batches):
//! stored side == model side (CIFAR at 32, built-in) → CIFAR: pad-4 random crop + flip,
//! built-in: flip; otherwise (folders, CIFAR at 224) → RandomResizedCrop(`data.scale`,
//! `data.ratio`) + flip. Evaluation (or `augment=none`): as stored, or resize the shorter side to
//! `side / data.crop_pct` and center-crop; both resamplings use `data.interpolation` (PIL's
//! antialiased bilinear, the default, or bicubic, [`resize`]). Optional, timm-named, off by
//! default (training only): RandAugment after crop + flip (`data.auto_augment`, [`randaug`]),
//! random erasing after normalization (`data.reprob`, [`erase`]), and mixup / CutMix with soft targets per global
//! batch, pair or image (`data.mixup`, `data.cutmix`, `data.mixup_mode`, [`mix`], applied by
//! the [`Loader`]). Evaluation batches are built ahead by a [`Loader`] too.

pub mod augment;
pub mod builtin;
pub mod cifar;
pub mod erase;
pub mod folder;
pub mod jpeg;
pub mod loader;
pub mod mix;
pub mod pickle;
pub mod randaug;
pub mod resize;
pub mod rng;
pub mod sampler;
pub mod shards;
pub mod split;
pub mod synthetic;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rayon::prelude::*;

use crate::config::{Augment, DataConfig, DatasetKind, Decode, DecodeScale, Interpolation, LabelKind};
use crate::core::encoded::{EncodedBatch, EncodedImage, Encoding};
use resize::Region;

pub use augment::{Normalizer, Policy};
pub use loader::{Loader, LoaderPlan, MixTargets, Prepared};
pub use sampler::{shard, shard_sized, EpochPlan, Sampler};

/// Errors from opening a dataset or building a batch. Each names the key, file and byte offset
/// involved.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("data.path is required for data.dataset={dataset}")]
    MissingPath { dataset: &'static str },
    #[error("{}: {source}", .path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("no {dataset} {split} files in {}: expected {expected}", .dir.display())]
    NotFound { dataset: &'static str, split: &'static str, dir: PathBuf, expected: String },
    #[error(
        "{}: truncated record at byte offset {offset}: the file is {file_len} bytes, not a multiple of the {record_len}-byte record",
        .path.display()
    )]
    Truncated { path: PathBuf, offset: u64, file_len: u64, record_len: usize },
    #[error("{}: label {label} at byte offset {offset} is out of range (dataset has {num_classes} classes)", .path.display())]
    LabelOutOfRange { path: PathBuf, offset: u64, label: usize, num_classes: usize },
    /// A file whose content is not what its name promises (a pickle without `data`, …).
    #[error("{}: {msg}", .path.display())]
    Format { path: PathBuf, msg: String },
    /// A shard member that is not what the index says (see `data.dataset=shards`).
    #[error("{}: member {member} at byte offset {offset}: {msg}", .path.display())]
    Member { path: PathBuf, offset: u64, member: String, msg: String },
    /// An image file that could not be decoded (see `data.skip_bad`).
    #[error("{}: cannot decode image: {msg} (set data.skip_bad=true to skip such files)", .path.display())]
    Decode { path: PathBuf, msg: String },
    #[error(
        "data.dataset={dataset} has {dataset_classes} classes but model.num_classes is {model_classes} \
         (set model.num_classes={dataset_classes})"
    )]
    ClassMismatch { dataset: &'static str, dataset_classes: usize, model_classes: usize },
    #[error("{key}: {msg}")]
    Invalid { key: &'static str, msg: String },
    #[error("data.skip_bad: no readable image found in {tried} tries starting at {}", .first.display())]
    NothingReadable { first: PathBuf, tried: usize },
    /// A split without images: training would do nothing, evaluation would report 0.
    #[error("{dataset}: the {split} split has no images ({detail})")]
    EmptySplit { dataset: String, split: &'static str, detail: String },
}

/// One split: `len` images and their labels, either decoded in memory or as files decoded per
/// batch.
#[derive(Debug)]
pub struct ImageSet {
    /// In-memory sets: (len, S, S, 3) HWC u8. Empty for file-backed sets.
    pub images: Vec<u8>,
    /// (len,) class index per image, each `< num_classes`.
    pub labels: Vec<u16>,
    /// S: stored image side in pixels (in-memory sets; 0 for file-backed sets).
    pub side: usize,
    pub num_classes: usize,
    /// File-backed sets: one image file per label. Empty for in-memory sets.
    pub files: Vec<PathBuf>,
    /// Side of the batches made from this set (`model.image_size`); equal to `side` unless the
    /// images are resampled.
    pub batch_side: usize,
    /// Files replaced by a neighbour because they could not be decoded (`data.skip_bad`).
    pub skipped: AtomicUsize,
    /// Shard-backed sets (`data.dataset=shards`): where each image lies in the tar files.
    pub shards: Option<Arc<shards::ShardSet>>,
}

impl Clone for ImageSet {
    fn clone(&self) -> Self {
        ImageSet {
            images: self.images.clone(),
            labels: self.labels.clone(),
            side: self.side,
            num_classes: self.num_classes,
            files: self.files.clone(),
            batch_side: self.batch_side,
            skipped: AtomicUsize::new(self.skipped.load(Ordering::Relaxed)),
            shards: self.shards.clone(),
        }
    }
}

impl PartialEq for ImageSet {
    /// Same content (the skip counter is bookkeeping, not content).
    fn eq(&self, o: &Self) -> bool {
        self.images == o.images
            && self.labels == o.labels
            && self.side == o.side
            && self.num_classes == o.num_classes
            && self.files == o.files
            && self.batch_side == o.batch_side
            && self.shards == o.shards
    }
}

impl ImageSet {
    /// An in-memory set of (len, side, side, 3) HWC images, batched at `side`.
    pub fn in_memory(images: Vec<u8>, labels: Vec<u16>, side: usize, num_classes: usize) -> Self {
        ImageSet { images, labels, side, num_classes, files: Vec::new(), batch_side: side, skipped: AtomicUsize::new(0), shards: None }
    }

    /// A file-backed set batched at `batch_side`.
    pub fn from_files(files: Vec<PathBuf>, labels: Vec<u16>, batch_side: usize, num_classes: usize) -> Self {
        ImageSet { images: Vec::new(), labels, side: 0, num_classes, files, batch_side, skipped: AtomicUsize::new(0), shards: None }
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Decoded per batch: image files, or images in tar shards.
    pub fn is_file_backed(&self) -> bool {
        !self.files.is_empty() || self.shards.is_some()
    }

    /// Bytes of one stored image (S·S·3; in-memory sets).
    pub fn image_len(&self) -> usize {
        self.side * self.side * 3
    }

    /// Image `i` as (S, S, 3) HWC u8 (in-memory sets).
    pub fn image(&self, i: usize) -> &[u8] {
        let n = self.image_len();
        &self.images[i * n..(i + 1) * n]
    }

    /// Images per class.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut c = vec![0; self.num_classes];
        for &l in &self.labels {
            c[l as usize] += 1;
        }
        c
    }
}

/// Both splits of an opened dataset.
#[derive(Clone, Debug)]
pub struct Datasets {
    pub train: Arc<ImageSet>,
    pub val: Arc<ImageSet>,
    pub num_classes: usize,
    /// Name of each class index (folder: sorted subfolder names; CIFAR-10 and built-in: their
    /// class names; otherwise the index as text). Written to the run directory.
    pub class_names: Vec<String>,
    /// One line for logs: what was loaded, from where, how many images.
    pub description: String,
    /// What the run should know about the data but that does not stop it (training files of
    /// the official set that are missing): printed with the run's other warnings.
    pub warnings: Vec<String>,
}

/// Refuses an empty split, for every dataset kind: a run that trains on nothing, or an
/// evaluation that reports 0 of 0, hides the problem. Training and `eval` call it; `open`
/// itself returns what it found (a caller may want the training split alone).
pub fn check_splits(train: &ImageSet, val: &ImageSet, cfg: &DataConfig) -> Result<(), DataError> {
    {
        let name = cfg.dataset.as_str();
        for (split, set, hint) in [
            ("training", train, "the files hold no records"),
            ("validation", val, match cfg.dataset {
                DatasetKind::Folder => "add a val/ folder beside train/, or set data.val_split to a fraction of the images",
                DatasetKind::Builtin | DatasetKind::Synthetic => "set data.val_size",
                DatasetKind::Shards => "pack a folder with a val/ folder, or with --val-split above 0",
                _ => "the test file holds no records",
            }),
        ] {
            if set.len() == 0 {
                let at = cfg.path.as_ref().map_or(String::new(), |p| format!(" at {}", p.display()));
                return Err(DataError::EmptySplit { dataset: format!("{name}{at}"), split, detail: hint.to_string() });
            }
        }
        Ok(())
    }
}

/// CIFAR-10's class names in label order.
pub const CIFAR10_CLASSES: [&str; 10] =
    ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"];

/// A model input batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Batch {
    /// (B, 3, S, S) CHW f32, normalized.
    pub images: Vec<f32>,
    /// (B,) class indices.
    pub labels: Vec<u32>,
    /// (B, K) soft targets, rows summing to 1, when mixup / CutMix made them (label smoothing
    /// folded in); `None` = one-hot `labels` (the trainer smooths them).
    pub targets: Option<Vec<f32>>,
    /// (B,) what identifies each image's visit: [`sample_key`] of its dataset index and epoch.
    /// Per-image randomness of the step (stochastic depth) is drawn from it, so it does not
    /// depend on how the global batch was split over ranks and micro-batches.
    pub keys: Vec<u64>,
    /// `data.decode = "gpu"`: the images still encoded, with their crops and flips drawn
    /// (`images` is then empty); the backend decodes them into its input.
    pub encoded: Option<EncodedBatch>,
}

/// The key of dataset image `index` seen in `epoch` (`Batch::keys`): unique per visit for
/// datasets of up to 2^40 images.
pub fn sample_key(index: usize, epoch: u64) -> u64 {
    (epoch << 40) ^ index as u64
}

impl Batch {
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

fn check_classes(name: &'static str, dataset_classes: usize, model_classes: usize) -> Result<(), DataError> {
    if dataset_classes != model_classes {
        return Err(DataError::ClassMismatch { dataset: name, dataset_classes, model_classes });
    }
    Ok(())
}

/// Opens the dataset `cfg` describes, for a model of `image_size` px and `num_classes` classes.
/// `seed` (the run seed) makes the generated datasets and the folder split deterministic.
pub fn open(cfg: &DataConfig, image_size: usize, num_classes: usize, seed: u64) -> Result<Datasets, DataError> {
    use rng::stream;
    let name = cfg.dataset.as_str();
    if let Some(k) = cfg.num_classes() {
        check_classes(name, k, num_classes)?;
    }
    if cfg.label == LabelKind::Coarse && cfg.dataset != DatasetKind::Cifar100 {
        return Err(DataError::Invalid { key: "data.label", msg: format!("coarse labels exist only in cifar100, not {name}") });
    }
    let mut class_names: Option<Vec<String>> = None;
    let mut warnings = Vec::new();
    let (mut train, mut val, description) = match cfg.dataset {
        DatasetKind::Builtin | DatasetKind::Synthetic => {
            for (key, n) in [("data.train_size", cfg.train_size), ("data.val_size", cfg.val_size)] {
                if n == 0 {
                    return Err(DataError::Invalid { key, msg: format!("must be positive for data.dataset={name}") });
                }
            }
            let (train, val) = if cfg.dataset == DatasetKind::Builtin {
                if image_size < builtin::MIN_SIDE {
                    return Err(DataError::Invalid {
                        key: "model.image_size",
                        msg: format!("the built-in dataset needs at least {} px, got {image_size}", builtin::MIN_SIDE),
                    });
                }
                (
                    builtin::generate(cfg.train_size, image_size, seed, stream::TRAIN),
                    builtin::generate(cfg.val_size, image_size, seed, stream::VAL),
                )
            } else {
                if num_classes == 0 || num_classes > u16::MAX as usize + 1 {
                    return Err(DataError::Invalid {
                        key: "model.num_classes",
                        msg: format!("synthetic labels need 1..=65536 classes, got {num_classes}"),
                    });
                }
                (
                    synthetic::generate(cfg.train_size, image_size, num_classes, seed, stream::TRAIN),
                    synthetic::generate(cfg.val_size, image_size, num_classes, seed, stream::VAL),
                )
            };
            if cfg.dataset == DatasetKind::Builtin {
                class_names = Some(builtin::CLASS_NAMES.iter().map(|s| s.to_string()).collect());
            }
            let what = if cfg.dataset == DatasetKind::Builtin { "built-in shapes" } else { "synthetic random pixels" };
            let d = format!(
                "{name} ({what}, seed {seed}): {} train / {} val, {image_size} px, {} classes",
                train.len(),
                val.len(),
                train.num_classes
            );
            (train, val, d)
        }
        DatasetKind::Cifar10 | DatasetKind::Cifar100 => {
            let v = if cfg.dataset == DatasetKind::Cifar10 { cifar::Variant::Cifar10 } else { cifar::Variant::Cifar100 };
            let path = cfg.path.as_ref().ok_or(DataError::MissingPath { dataset: name })?;
            let l = cifar::load(path, v, cfg.label, cfg.skip_bad)?;
            let skipped = l.train.skipped.load(Ordering::Relaxed) + l.val.skipped.load(Ordering::Relaxed);
            let skipped = if skipped > 0 { format!(", {skipped} bad record(s) skipped (data.skip_bad)") } else { String::new() };
            let resized = if image_size == cifar::SIDE { String::new() } else { format!(", resampled to {image_size} px") };
            let d = format!(
                "{name} ({}, {}): {} train from {} file(s) / {} val, {} px{resized}, {} classes ({} labels){skipped}",
                l.form.name(),
                l.source.display(),
                l.train.len(),
                l.train_files.len(),
                l.val.len(),
                cifar::SIDE,
                v.num_classes(cfg.label),
                if cfg.label == LabelKind::Coarse { "coarse" } else { "fine" }
            );
            if cfg.dataset == DatasetKind::Cifar10 {
                class_names = Some(CIFAR10_CLASSES.iter().map(|s| s.to_string()).collect());
            }
            if !l.missing_train_files.is_empty() {
                warnings.push(format!(
                    "{name} at {}: {} of the official training files missing ({}): training on {} images from {} file(s)",
                    l.source.display(),
                    l.missing_train_files.len(),
                    l.missing_train_files.join(", "),
                    l.train.len(),
                    l.train_files.len()
                ));
            }
            (l.train, l.val, d)
        }
        DatasetKind::Folder => {
            let path = cfg.path.as_ref().ok_or(DataError::MissingPath { dataset: name })?;
            let l = folder::load(path, image_size, cfg.val_split, seed)?;
            check_classes(name, l.classes.len(), num_classes)?;
            let d = format!(
                "folder ({}): {} train / {} val, decoded per batch at {image_size} px, {} classes ({}{})",
                l.layout,
                l.train.len(),
                l.val.len(),
                l.classes.len(),
                l.classes.iter().take(3).cloned().collect::<Vec<_>>().join(", "),
                if l.classes.len() > 3 { ", …" } else { "" }
            );
            class_names = Some(l.classes.clone());
            (l.train, l.val, d)
        }
        DatasetKind::Shards => {
            let path = cfg.path.as_ref().ok_or(DataError::MissingPath { dataset: name })?;
            let l = shards::load(path, image_size)?;
            check_classes(name, l.classes.len(), num_classes)?;
            let d = format!(
                "shards ({}): {} train in {} / {} val in {}, decoded per batch at {image_size} px, {} classes ({}{})",
                path.display(),
                l.train.len(),
                crate::util::plural(l.shard_counts[0], "shard", "shards"),
                l.val.len(),
                crate::util::plural(l.shard_counts[1], "shard", "shards"),
                l.classes.len(),
                l.classes.iter().take(3).cloned().collect::<Vec<_>>().join(", "),
                if l.classes.len() > 3 { ", …" } else { "" }
            );
            class_names = Some(l.classes.clone());
            (l.train, l.val, d)
        }
    };
    // In-memory sets of another size are resampled per batch (CIFAR fine-tuning at 224 px).
    train.batch_side = image_size;
    val.batch_side = image_size;
    let num_classes = train.num_classes;
    let class_names = class_names.unwrap_or_else(|| (0..num_classes).map(|i| i.to_string()).collect());
    Ok(Datasets { num_classes, class_names, train: Arc::new(train), val: Arc::new(val), description, warnings })
}

/// Training images `open` will produce, computed cheaply (no decoding), for planning runs
/// without opening the dataset (a sweep's or planner's step counts): the configured size for generated
/// sets, the record count of CIFAR binary files (50 000 for the python and archive forms, where
/// counting means unpacking), the listed files for folders. `data.skip_bad` can make the real
/// count smaller.
pub fn train_len(cfg: &DataConfig, seed: u64) -> Result<usize, DataError> {
    match cfg.dataset {
        DatasetKind::Builtin | DatasetKind::Synthetic => Ok(cfg.train_size),
        DatasetKind::Cifar10 | DatasetKind::Cifar100 => {
            let path = cfg.path.as_ref().ok_or(DataError::MissingPath { dataset: cfg.dataset.as_str() })?;
            let v = if cfg.dataset == DatasetKind::Cifar10 { cifar::Variant::Cifar10 } else { cifar::Variant::Cifar100 };
            cifar::count_train(path, v)
        }
        DatasetKind::Folder => {
            let path = cfg.path.as_ref().ok_or(DataError::MissingPath { dataset: "folder" })?;
            folder::count_train(path, cfg.val_split, seed)
        }
        DatasetKind::Shards => {
            let path = cfg.path.as_ref().ok_or(DataError::MissingPath { dataset: "shards" })?;
            shards::count_train(path)
        }
    }
}

/// The augmentation `cfg` asks for on a same-size in-memory set for a training (`train`) or
/// eval batch. (Sets batched at another size use RandomResizedCrop / center crop instead.)
pub fn policy(cfg: &DataConfig, train: bool) -> Policy {
    if !train || cfg.augment == Augment::None {
        return Policy::None;
    }
    match cfg.dataset {
        // timm/torchvision CIFAR recipe: RandomCrop(32, padding=4) + RandomHorizontalFlip.
        DatasetKind::Cifar10 | DatasetKind::Cifar100 => Policy::CropFlip { pad: 4 },
        // Every built-in shape is mirror-symmetric; a crop could cut the shape off.
        DatasetKind::Builtin | DatasetKind::Folder | DatasetKind::Shards => Policy::Flip,
        DatasetKind::Synthetic => Policy::None,
    }
}

/// What the training device offers the image decode ([`resolve_decode`]).
pub enum DecodeDevice<'a> {
    /// No GPU.
    Cpu,
    /// A GPU, and how to find out how many hardware JPEG engines its decoder has (0: nvJPEG
    /// decodes on the SMs; an error: nvJPEG cannot be loaded), asked only when `auto` decides.
    Gpu { engines: &'a dyn Fn() -> Result<u32, String> },
}

/// Where this run decodes its images (`data.decode`), with warnings: why `auto` stayed on the
/// CPU where a GPU was there to take it, and a `data.decode_cpu_share` that the CPU path leaves
/// unused. `auto` becomes `gpu` when the images come from files, no augmentation that works on
/// decoded pixels on the CPU is on (RandAugment, random erasing, mixup, CutMix) and the GPU has
/// JPEG engines; else `cpu`. Without engines nvJPEG decodes on the SMs, beside the step, and
/// that costs the step more than the loader's threads take to decode on the CPU
/// (docs/data.md). An explicit `gpu` that cannot run is an error naming why.
pub fn resolve_decode(cfg: &DataConfig, device: DecodeDevice) -> Result<(Decode, Vec<String>), DataError> {
    let cpu_only = cpu_only_augmentations(cfg);
    let files = matches!(cfg.dataset, DatasetKind::Folder | DatasetKind::Shards);
    let mut warnings = Vec::new();
    let decode = match (cfg.decode, device) {
        (Decode::Cpu, _) => Decode::Cpu,
        (Decode::Auto, DecodeDevice::Gpu { engines }) if files && cpu_only.is_empty() => match engines() {
            Ok(n) if n > 0 => Decode::Gpu,
            Ok(_) => {
                warnings.push("data.decode = \"auto\" decodes on the CPU: nvJPEG has no JPEG engines to use here (the GPU has none, or VITSCALE_NVJPEG_BATCHED=gpu_hybrid), and its decode on the SMs would slow the step more (set \"gpu\" to use it anyway)".into());
                Decode::Cpu
            }
            Err(e) => {
                warnings.push(format!("data.decode = \"auto\" decodes on the CPU: nvJPEG cannot be used ({e})"));
                Decode::Cpu
            }
        },
        (Decode::Auto, _) => Decode::Cpu,
        (Decode::Gpu, DecodeDevice::Cpu) => return Err(DataError::Invalid { key: "data.decode", msg: "\"gpu\" decodes on the training GPU: it needs --device cuda (use \"cpu\" or \"auto\")".into() }),
        (Decode::Gpu, _) if !cpu_only.is_empty() => {
            return Err(DataError::Invalid {
                key: "data.decode",
                msg: format!("\"gpu\" cannot apply {} (they work on decoded pixels on the CPU): use \"cpu\", or \"auto\" to decode on the GPU only when nothing needs the CPU", cpu_only.join(", ")),
            })
        }
        (Decode::Gpu, _) => if files { Decode::Gpu } else { Decode::Cpu },
    };
    if decode == Decode::Cpu && cfg.decode_cpu_share > 0.0 {
        warnings.push(format!("data.decode_cpu_share = {} has no effect: this run decodes no image on the GPU", cfg.decode_cpu_share));
    }
    Ok((decode, warnings))
}

/// The keys of the training augmentations that are on and work on decoded pixels on the
/// CPU, so cannot follow a decode on the GPU.
fn cpu_only_augmentations(cfg: &DataConfig) -> Vec<&'static str> {
    if cfg.augment != Augment::Default {
        return Vec::new();
    }
    [
        ("data.auto_augment", cfg.aug.auto_augment.is_some()),
        ("data.reprob", cfg.aug.reprob > 0.0),
        ("data.mixup", cfg.aug.mixup > 0.0),
        ("data.cutmix", cfg.aug.cutmix > 0.0),
    ]
    .into_iter()
    .filter(|&(_, on)| on)
    .map(|(k, _)| k)
    .collect()
}

/// Builds the batch of dataset `indices` from an in-memory set (the sets of every dataset but
/// `folder`). Kept infallible for the training loop of in-memory datasets; for file-backed sets
/// use [`try_make_batch`] or a [`Loader`], which report unreadable files as errors.
pub fn make_batch(set: &ImageSet, indices: &[usize], cfg: &DataConfig, train: bool, epoch: u64, seed: u64) -> Batch {
    let mut batch = Batch::default();
    if let Err(e) = fill_batch(&mut batch, set, indices, cfg, train, epoch, seed) {
        // Only file-backed sets can fail; reaching this is a caller bug, said plainly.
        panic!("make_batch on a file-backed set failed ({e}); use try_make_batch or Loader for data.dataset=folder or shards");
    }
    batch
}

/// Builds the batch of dataset `indices`: each image is decoded (file-backed sets), augmented
/// (when `train`) and normalized, in parallel on the current rayon pool. Deterministic in
/// (seed, epoch, indices); independent of thread count and of how the global batch was split.
pub fn try_make_batch(set: &ImageSet, indices: &[usize], cfg: &DataConfig, train: bool, epoch: u64, seed: u64) -> Result<Batch, DataError> {
    let mut batch = Batch::default();
    fill_batch(&mut batch, set, indices, cfg, train, epoch, seed)?;
    Ok(batch)
}

/// [`try_make_batch`] into an existing batch, reusing its buffers.
#[allow(clippy::too_many_arguments)]
pub fn fill_batch(batch: &mut Batch, set: &ImageSet, indices: &[usize], cfg: &DataConfig, train: bool, epoch: u64, seed: u64) -> Result<(), DataError> {
    fill_batches(std::slice::from_mut(batch), &[(indices, epoch)], set, cfg, train, seed)
}

/// Fills several batches — `jobs[k]` = (dataset indices, epoch) of `batches[k]` — in one
/// parallel pass over all their images. One pass instead of one per batch removes the barrier
/// at the end of each batch, where threads would idle behind the slowest image (224-px JPEG
/// decode times vary by several ×); the loader uses it to build its prefetch window at once.
pub fn fill_batches(batches: &mut [Batch], jobs: &[(&[usize], u64)], set: &ImageSet, cfg: &DataConfig, train: bool, seed: u64) -> Result<(), DataError> {
    assert_eq!(batches.len(), jobs.len(), "fill_batches: one job per batch");
    if cfg.decode == Decode::Gpu && set.is_file_backed() {
        return fill_encoded(batches, jobs, set, cfg, train, seed);
    }
    let side = set.batch_side;
    let per = (3 * side * side).max(1);
    let mut tasks: Vec<(&mut [f32], &mut u32, usize, u64)> = Vec::new();
    for (b, &(indices, epoch)) in batches.iter_mut().zip(jobs) {
        b.images.resize(indices.len() * per, 0.0);
        b.labels.clear();
        b.labels.resize(indices.len(), 0);
        b.targets = None;
        b.encoded = None;
        b.keys.clear();
        // an evaluation batch is the same whatever the epoch (nothing per-image is drawn)
        b.keys.extend(indices.iter().map(|&i| sample_key(i, if train { epoch } else { 0 })));
        let Batch { images, labels, .. } = b;
        for ((out, label), &i) in images.chunks_mut(per).zip(labels.iter_mut()).zip(indices) {
            tasks.push((out, label, i, epoch));
        }
    }
    let extra = train && cfg.augment == Augment::Default;
    let ra = cfg.aug.auto_augment.as_ref().filter(|_| extra);
    let reprob = if extra { cfg.aug.reprob } else { 0.0 };
    let norm = Normalizer::new(cfg.mean, cfg.std);
    let fill = [0, 1, 2].map(|c| (cfg.mean[c] * 255.0).round().clamp(0.0, 255.0) as u8);
    let erase = |out: &mut [f32], i: usize, epoch: u64| {
        if reprob > 0.0 {
            erase::apply(out, side, reprob, cfg.aug.remode, cfg.aug.recount, seed, epoch, i);
        }
    };
    if !set.is_file_backed() && set.side == side {
        // Same size: pad-crop / flip / identity through a lookup table; with RandAugment, crop
        // to bytes, augment, then the table.
        let policy = policy(cfg, train);
        tasks.into_par_iter().for_each(|(out, label, i, epoch)| {
            let d = policy.draw(seed, epoch, i);
            match ra {
                None => augment::transform(set.image(i), side, policy.pad(), d, &norm, out),
                Some(ra) => with_buffers(|b| {
                    b.pixels.resize(per, 0);
                    augment::transform_u8(set.image(i), side, policy.pad(), d, &mut b.pixels);
                    randaug::apply(ra, &mut b.pixels, side, fill, seed, epoch, i, &mut b.scratch);
                    augment::normalize_hwc(&b.pixels, side, &norm, out);
                }),
            }
            erase(out, i, epoch);
            *label = set.labels[i] as u32;
        });
        return Ok(());
    }
    tasks.into_par_iter().try_for_each(|(out, label, i, epoch)| {
        with_buffers(|b| {
            let Buffers { file, decoded, pixels, scratch } = b;
            // Randomness is keyed by the index asked for, not the replacement, so skipping a bad
            // file does not shift the augmentation of any other image.
            let window = |w: usize, h: usize| {
                if extra {
                    resize::draw_rrc(seed, epoch, i, w, h, cfg.scale, cfg.ratio)
                } else {
                    (resize::center_crop(w, h, side, cfg.crop_pct), false)
                }
            };
            let (j, Decoded { width: w, height: h, region, flip }) = if set.is_file_backed() {
                decode_source(set, i, cfg, side, &window, file, decoded)?
            } else {
                let (region, flip) = window(set.side, set.side);
                (i, Decoded { width: set.side, height: set.side, region, flip })
            };
            let src: &[u8] = if set.is_file_backed() { &decoded[..w * h * 3] } else { set.image(i) };
            match ra {
                None => resize::resample(src, w, h, region, side, flip, cfg.interpolation, cfg.mean, cfg.std, out),
                Some(ra) => {
                    // RandAugment works on bytes: resample to bytes, augment, then the table.
                    pixels.resize(per, 0);
                    resize::resample_u8(src, w, h, region, side, flip, cfg.interpolation, pixels);
                    randaug::apply(ra, pixels, side, fill, seed, epoch, i, scratch);
                    augment::normalize_hwc(pixels, side, &norm, out);
                }
            }
            erase(out, i, epoch);
            *label = set.labels[j] as u32;
            Ok(())
        })
    })
}

/// [`fill_batches`] for `data.decode = "gpu"`: each image's file is read (a JPEG's header
/// parsed for its size; another format decoded here to RGB) and its crop and flip drawn exactly
/// as the CPU path draws them, so the device produces the same images up to decoding and
/// resampling differences. The share `data.decode_cpu_share` of the JPEGs ([`cpu_decodes`]) is
/// decoded here instead, as the CPU path decodes it. Augmentations on decoded pixels
/// (`cpu_only_augmentations`) are not available here (`resolve_decode` refuses them before a
/// loader starts).
fn fill_encoded(batches: &mut [Batch], jobs: &[(&[usize], u64)], set: &ImageSet, cfg: &DataConfig, train: bool, seed: u64) -> Result<(), DataError> {
    let extra = train && cfg.augment == Augment::Default;
    let cpu_only = cpu_only_augmentations(cfg);
    if extra && !cpu_only.is_empty() {
        return Err(DataError::Invalid { key: "data.decode", msg: format!("\"gpu\" does not run {}; use \"cpu\"", cpu_only.join(", ")) });
    }
    let side = set.batch_side;
    let mut tasks: Vec<(&mut EncodedImage, &mut u32, usize, u64)> = Vec::new();
    for (b, &(indices, epoch)) in batches.iter_mut().zip(jobs) {
        b.images.clear();
        b.labels.clear();
        b.labels.resize(indices.len(), 0);
        b.targets = None;
        b.keys.clear();
        b.keys.extend(indices.iter().map(|&i| sample_key(i, if train { epoch } else { 0 })));
        let mut enc = b.encoded.take().unwrap_or_default();
        enc.images.resize_with(indices.len(), || EncodedImage { bytes: Vec::new(), encoding: Encoding::Jpeg, width: 0, height: 0, crop: [0.0; 4], flip: false, source: String::new() });
        enc.side = side;
        enc.bicubic = cfg.interpolation == Interpolation::Bicubic;
        enc.mean = cfg.mean;
        enc.std = cfg.std;
        b.encoded = Some(enc);
        let Batch { labels, encoded, .. } = b;
        let images = &mut encoded.as_mut().expect("just set").images;
        for ((img, label), &i) in images.iter_mut().zip(labels.iter_mut()).zip(indices) {
            tasks.push((img, label, i, epoch));
        }
    }
    tasks.into_par_iter().try_for_each(|(img, label, i, epoch)| {
        // Randomness is keyed by the index asked for (as on the CPU path), not a replacement's.
        let window = |w: usize, h: usize| if extra { resize::draw_rrc(seed, epoch, i, w, h, cfg.scale, cfg.ratio) } else { (resize::center_crop(w, h, side, cfg.crop_pct), false) };
        let cpu = cpu_decodes(cfg.decode_cpu_share, seed, epoch, i).then_some((cfg.decode_scale, side));
        let (j, ()) = first_readable(set, i, cfg.skip_bad, |j| read_encoded(set, j, img, &window, cpu))?;
        *label = set.labels[j] as u32;
        Ok(())
    })
}

/// Whether the loader decodes image `index` of `epoch` on the CPU when `data.decode = "gpu"`
/// (`data.decode_cpu_share` = `share` of the JPEGs, drawn from a hash so that the same images
/// go to the CPU in every run, whatever the thread count or batch split).
pub fn cpu_decodes(share: f64, seed: u64, epoch: u64, index: usize) -> bool {
    // the hash's top 53 bits as a uniform draw in [0, 1): 0 never, 1 always
    let draw = (rng::hash(&[seed, rng::stream::DECODE, epoch, index as u64]) >> 11) as f64 / (1u64 << 53) as f64;
    share > 0.0 && draw < share
}

/// Reads image `j` of the file-backed `set` into `img` (bytes, encoding, size, source, and the
/// crop and flip `window` draws on its size) for the device to decode. A JPEG is only parsed up
/// to its frame header here, unless `cpu` = (decode scale, output side) says to decode it here
/// as the CPU path does (`decode_window`: the device then gets the window's RGB pixels and the
/// crop in them). A file the header parser or the decoder rejects is reported (or skipped) like
/// an undecodable one.
fn read_encoded(set: &ImageSet, j: usize, img: &mut EncodedImage, window: &dyn Fn(usize, usize) -> (Region, bool), cpu: Option<(DecodeScale, usize)>) -> Result<(), DataError> {
    let (range, source, fail): (std::ops::Range<usize>, String, Box<dyn Fn(String) -> DataError>) = match &set.shards {
        Some(sh) => {
            let (range, name) = shards::read_image(sh, j, set.labels[j], set.num_classes, &mut img.bytes)?;
            let m = sh.members[j];
            let path = sh.files[m.shard as usize].clone();
            let source = format!("{} (member {name} at byte offset {})", path.display(), m.offset);
            let fail = Box::new(move |msg: String| member_decode_err(&path, m.offset, &name, msg));
            (range, source, fail)
        }
        None => {
            use std::io::Read;
            let path = set.files[j].clone();
            img.bytes.clear();
            std::fs::File::open(&path).and_then(|mut f| f.read_to_end(&mut img.bytes)).map_err(|source| DataError::Io { path: path.clone(), source })?;
            let n = img.bytes.len();
            let source = path.display().to_string();
            (0..n, source, Box::new(move |msg: String| DataError::Decode { path: path.clone(), msg }))
        }
    };
    if range.start > 0 || range.end < img.bytes.len() {
        img.bytes.copy_within(range.clone(), 0);
        img.bytes.truncate(range.len());
    }
    img.source = source;
    let jpeg = img.bytes.starts_with(&[0xff, 0xd8, 0xff]);
    // (width, height) of what the device gets, and the crop and flip when already drawn
    let ((w, h), drawn) = match cpu {
        Some((scale, side)) if jpeg => {
            let d = with_buffers(|b| {
                let d = decode_window(&img.bytes, scale, side, window, &mut b.decoded).map_err(&fail)?;
                img.bytes.clear();
                img.bytes.extend_from_slice(&b.decoded[..d.width * d.height * 3]);
                Ok::<_, DataError>(d)
            })?;
            img.encoding = Encoding::Rgb;
            ((d.width, d.height), Some((d.region, d.flip)))
        }
        _ if jpeg => {
            img.encoding = Encoding::Jpeg;
            (crate::core::encoded::jpeg_size(&img.bytes).map_err(&fail)?, None)
        }
        _ => {
            img.encoding = Encoding::Rgb;
            let mut px = Vec::new();
            let (w, h) = decode_bytes(&img.bytes, &mut px).map_err(&fail)?;
            px.truncate(w * h * 3);
            img.bytes = px;
            ((w, h), None)
        }
    };
    if w == 0 || h == 0 {
        return Err(fail(format!("empty image ({w}×{h})")));
    }
    let (region, flip) = drawn.unwrap_or_else(|| window(w, h));
    img.width = w;
    img.height = h;
    img.crop = [region.x0, region.y0, region.w, region.h];
    img.flip = flip;
    Ok(())
}

/// Per-thread buffers reused across images: file bytes, decoded pixels, augmented pixels,
/// RandAugment scratch.
#[derive(Default)]
struct Buffers {
    file: Vec<u8>,
    decoded: Vec<u8>,
    pixels: Vec<u8>,
    scratch: Vec<u8>,
}

thread_local! {
    static BUFFERS: std::cell::RefCell<Buffers> = std::cell::RefCell::new(Buffers::default());
}

/// Runs `f` with this thread's buffers (taken out for the call, so a nested call on the same
/// thread gets fresh ones instead of a borrow conflict). A buffer grown past 32 MiB by an
/// unusually large image is freed afterwards rather than kept by every worker.
fn with_buffers<R>(f: impl FnOnce(&mut Buffers) -> R) -> R {
    const KEEP: usize = 32 << 20;
    let mut b = BUFFERS.with(|c| std::mem::take(&mut *c.borrow_mut()));
    let r = f(&mut b);
    for v in [&mut b.file, &mut b.decoded, &mut b.pixels, &mut b.scratch] {
        if v.capacity() > KEEP {
            *v = Vec::new();
        }
    }
    BUFFERS.with(|c| *c.borrow_mut() = b);
    r
}

/// Decodes one image file to RGB8.
pub fn decode(path: &Path) -> Result<image::RgbImage, DataError> {
    let (mut file, mut px) = (Vec::new(), Vec::new());
    let (w, h) = decode_into(path, &mut file, &mut px)?;
    px.truncate(w * h * 3);
    image::RgbImage::from_raw(w as u32, h as u32, px).ok_or_else(|| DataError::Decode { path: path.to_path_buf(), msg: "decoded size mismatch".into() })
}

/// Reads `path` into `file` and decodes it to (height, width, 3) RGB8 at the start of `pixels`
/// (which may be longer), returning (width, height). Both buffers are reused across calls.
/// JPEG goes straight through zune-jpeg (the decoder the image crate wraps, with the image
/// crate's options) into the reused buffer; other formats through the image crate.
pub fn decode_into(path: &Path, file: &mut Vec<u8>, pixels: &mut Vec<u8>) -> Result<(usize, usize), DataError> {
    read_file(path, file)?;
    decode_bytes(file, pixels).map_err(|msg| DataError::Decode { path: path.to_path_buf(), msg })
}

/// The bytes of `path` into `file` (cleared first).
pub fn read_file(path: &Path, file: &mut Vec<u8>) -> Result<(), DataError> {
    use std::io::Read;
    file.clear();
    std::fs::File::open(path).and_then(|mut f| f.read_to_end(file)).map(|_| ()).map_err(|source| DataError::Io { path: path.to_path_buf(), source })
}

/// Decodes the image file bytes `file` as [`decode_into`] does; the error is the decoder's
/// message, for the caller to say where the bytes came from.
fn decode_bytes(file: &[u8], pixels: &mut Vec<u8>) -> Result<(usize, usize), String> {
    crate::core::encoded::decode_rgb(file, pixels)
}

/// A decoded image ready to resample: `width` × `height` RGB8 pixels, the crop window in them
/// and the flip.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decoded {
    pub width: usize,
    pub height: usize,
    pub region: Region,
    pub flip: bool,
}

/// Decodes the image file bytes `bytes` into `pixels` for resampling to `side` px through the
/// window and flip `window(width, height)` draws on the full-size image. With
/// `data.decode_scale = "auto"` a JPEG is decoded by [`jpeg::decode`], only where the window's
/// resampling reads and at a reduced DCT scale when the window allows; any other file, and a
/// JPEG libjpeg-turbo rejects or warns about, is decoded whole by [`decode_bytes`] (whose error
/// is the one reported).
pub fn decode_window(bytes: &[u8], scale: DecodeScale, side: usize, window: impl Fn(usize, usize) -> (Region, bool), pixels: &mut Vec<u8>) -> Result<Decoded, String> {
    if scale == DecodeScale::Auto && bytes.starts_with(&[0xff, 0xd8, 0xff]) {
        let mut flip = false;
        let drawn = jpeg::decode(
            bytes,
            |w, h| {
                let (region, f) = window(w, h);
                flip = f;
                Some((region, side))
            },
            pixels,
        );
        if let Ok(p) = drawn {
            return Ok(Decoded { width: p.width, height: p.height, region: p.region, flip });
        }
    }
    let (width, height) = decode_bytes(bytes, pixels)?;
    let (region, flip) = window(width, height);
    Ok(Decoded { width, height, region, flip })
}

/// A shard member `name` (at byte `offset` of `path`) that cannot be decoded.
fn member_decode_err(path: &Path, offset: u64, name: &str, msg: String) -> DataError {
    DataError::Member { path: path.to_path_buf(), offset, member: name.to_string(), msg: format!("cannot decode image: {msg} (set data.skip_bad=true to skip such images)") }
}

/// Reads image `i` of the file-backed `set` (or, with `skip_bad`, the next readable one after
/// it) and decodes it into `decoded` for resampling to `side` px ([`decode_window`]); returns
/// the index it came from and what was decoded.
fn decode_source(set: &ImageSet, i: usize, cfg: &DataConfig, side: usize, window: &dyn Fn(usize, usize) -> (Region, bool), file: &mut Vec<u8>, decoded: &mut Vec<u8>) -> Result<(usize, Decoded), DataError> {
    first_readable(set, i, cfg.skip_bad, |j| match &set.shards {
        Some(sh) => {
            let (range, name) = shards::read_image(sh, j, set.labels[j], set.num_classes, file)?;
            let m = sh.members[j];
            decode_window(&file[range], cfg.decode_scale, side, window, decoded).map_err(|msg| member_decode_err(&sh.files[m.shard as usize], m.offset, &name, msg))
        }
        None => {
            read_file(&set.files[j], file)?;
            decode_window(file, cfg.decode_scale, side, window, decoded).map_err(|msg| DataError::Decode { path: set.files[j].clone(), msg })
        }
    })
}

/// `read(i)`, or with `skip_bad` the first of `read(i + 1)`, `read(i + 2)`, … (wrapping) that
/// succeeds, counting the skipped images; returns the index read and what `read` gave.
fn first_readable<T>(set: &ImageSet, i: usize, skip_bad: bool, mut read: impl FnMut(usize) -> Result<T, DataError>) -> Result<(usize, T), DataError> {
    // Bounded so a folder of unreadable files fails instead of spinning.
    const TRIES: usize = 64;
    let mut first_err = None;
    for k in 0..TRIES.min(set.len()) {
        let j = (i + k) % set.len();
        match read(j) {
            Ok(v) => {
                if k > 0 {
                    set.skipped.fetch_add(k, Ordering::Relaxed);
                }
                return Ok((j, v));
            }
            Err(e) if skip_bad => {
                first_err.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    match first_err {
        Some(_) => {
            let first = match &set.shards {
                Some(sh) => sh.files[sh.members[i].shard as usize].clone(),
                None => set.files[i].clone(),
            };
            Err(DataError::NothingReadable { first, tried: TRIES.min(set.len()) })
        }
        None => Err(DataError::Invalid { key: "data", msg: "empty file-backed set".into() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn cfg(dataset: DatasetKind) -> DataConfig {
        DataConfig { train_size: 500, val_size: 100, ..DataConfig::for_dataset(dataset, None, [0.5; 3], [0.25; 3]) }
    }

    #[test]
    fn builtin_is_deterministic_balanced_and_split_streams_differ() {
        let c = cfg(DatasetKind::Builtin);
        let a = open(&c, 16, 10, 7).unwrap();
        let b = open(&c, 16, 10, 7).unwrap();
        assert_eq!(a.train, b.train);
        assert_eq!(a.val, b.val);
        assert_eq!(a.train.len(), 500);
        assert_eq!(a.train.class_counts(), vec![50; 10]);
        assert_eq!(a.val.class_counts(), vec![10; 10]);
        // Val is a different stream, not a prefix of train.
        assert_ne!(a.val.image(0), a.train.image(0));
        let other = open(&c, 16, 10, 8).unwrap();
        assert_ne!(other.train.images, a.train.images);
        // Works at 32 px too.
        let big = open(&c, 32, 10, 7).unwrap();
        assert_eq!(big.train.images.len(), 500 * 32 * 32 * 3);
    }

    #[test]
    fn builtin_mean_colour_is_not_the_label() {
        // Colour is drawn independently of the class; only the shape's area leaks into the
        // image's mean brightness. A nearest-centroid classifier on the mean colour must stay
        // far from the accuracy a ViT reaches (> 95 %).
        let mean_rgb = |set: &ImageSet, i: usize| -> [f64; 3] {
            let mut m = [0f64; 3];
            for p in set.image(i).chunks_exact(3) {
                for c in 0..3 {
                    m[c] += p[c] as f64 / (255.0 * (set.side * set.side) as f64);
                }
            }
            m
        };
        let train = builtin::generate(5000, 16, 1, rng::stream::TRAIN);
        let mut centroids = vec![[0f64; 3]; 10];
        for i in 0..train.len() {
            let m = mean_rgb(&train, i);
            for c in 0..3 {
                centroids[train.labels[i] as usize][c] += m[c] / 500.0;
            }
        }
        let val = builtin::generate(2000, 16, 1, rng::stream::VAL);
        let correct = (0..val.len())
            .filter(|&i| {
                let m = mean_rgb(&val, i);
                let d = |k: usize| (0..3).map(|c| (m[c] - centroids[k][c]).powi(2)).sum::<f64>();
                let best = (0..10).min_by(|&a, &b| d(a).total_cmp(&d(b))).unwrap_or(0);
                best == val.labels[i] as usize
            })
            .count();
        let acc = correct as f64 / val.len() as f64;
        eprintln!("nearest-centroid on mean colour: {acc:.3}");
        assert!(acc < 0.35, "mean colour predicts the class {acc:.3} of the time");
    }

    #[test]
    fn builtin_generation_is_fast() {
        let t = std::time::Instant::now();
        let set = builtin::generate(12_000, 16, 0, rng::stream::TRAIN);
        let secs = t.elapsed().as_secs_f64();
        assert_eq!(set.len(), 12_000);
        // Generous bound for a loaded 2-core CI box; the target is 1 s.
        assert!(secs < 5.0, "builtin generation took {secs:.2}s");
    }

    #[test]
    fn synthetic_is_deterministic_and_in_range() {
        let c = cfg(DatasetKind::Synthetic);
        let a = open(&c, 8, 37, 3).unwrap();
        assert_eq!(a.train.images, open(&c, 8, 37, 3).unwrap().train.images);
        assert!(a.train.labels.iter().all(|&l| l < 37));
        assert_eq!(a.num_classes, 37);
    }

    #[test]
    fn make_batch_is_deterministic_and_split_independent() {
        let c = cfg(DatasetKind::Builtin);
        let d = open(&c, 16, 10, 1).unwrap();
        let sampler = Sampler::new(d.train.len(), 32, true, 1, true);
        let global = sampler.global_batch(3, 2);
        let whole = make_batch(&d.train, &global, &c, true, 3, 1);
        assert_eq!(whole, make_batch(&d.train, &global, &c, true, 3, 1));
        assert_eq!(whole.images.len(), 32 * 3 * 16 * 16);
        // 2 ranks × 2 micro-batches concatenated == the 1-rank batch, bit for bit.
        let mut images = Vec::new();
        let mut labels = Vec::new();
        for rank in 0..2 {
            for micro in 0..2 {
                let b = make_batch(&d.train, shard(&global, rank, 2, micro, 2), &c, true, 3, 1);
                images.extend(b.images);
                labels.extend(b.labels);
            }
        }
        assert_eq!(images, whole.images);
        assert_eq!(labels, whole.labels);
        // Different epoch: different flips somewhere.
        assert_ne!(make_batch(&d.train, &global, &c, true, 4, 1).images, whole.images);
        // Eval batches are not augmented: identical across epochs.
        assert_eq!(make_batch(&d.val, &[0, 1, 2], &c, false, 0, 1), make_batch(&d.val, &[0, 1, 2], &c, false, 9, 1));
    }

    #[test]
    fn randaugment_and_erasing_are_keyed_per_image_and_off_for_eval() {
        let mut c = cfg(DatasetKind::Builtin);
        let d = open(&c, 16, 10, 1).unwrap();
        let idx: Vec<usize> = (0..24).collect();
        let plain = make_batch(&d.train, &idx, &c, true, 0, 1);
        c.aug.auto_augment = crate::config::parse_rand_augment("rand-m9-mstd0.5-inc1").unwrap();
        c.aug.reprob = 0.5;
        let aug = make_batch(&d.train, &idx, &c, true, 0, 1);
        assert_eq!(aug, make_batch(&d.train, &idx, &c, true, 0, 1));
        assert_eq!(aug.labels, plain.labels);
        let per = 3 * 16 * 16;
        let changed = (0..24).filter(|&i| aug.images[i * per..(i + 1) * per] != plain.images[i * per..(i + 1) * per]).count();
        assert!(changed >= 12, "only {changed} of 24 images changed");
        // Split-independent: the second half alone is the second half of the whole.
        let half = make_batch(&d.train, &idx[12..], &c, true, 0, 1);
        assert_eq!(half.images, aug.images[12 * per..]);
        // Evaluation batches ignore the training augmentations.
        assert_eq!(make_batch(&d.val, &idx, &c, false, 0, 1), make_batch(&d.val, &idx, &cfg(DatasetKind::Builtin), false, 0, 1));
    }

    /// The direct JPEG decode gives the image crate's pixels exactly (colour, greyscale, odd
    /// sizes), PNG still goes through the image crate, buffers are reused across sizes, and a
    /// broken file is an error that names it.
    #[test]
    fn decode_into_matches_image_crate() {
        let dir = std::env::temp_dir().join(format!("vitscale-decode-{}", std::process::id()));
        let mut files = synthetic::write_jpegs(&dir, 2, 3).unwrap();
        let grey = image::GrayImage::from_fn(33, 17, |x, y| image::Luma([(x * 7 + y * 13) as u8]));
        let p = dir.join("grey.jpg");
        grey.save_with_format(&p, image::ImageFormat::Jpeg).unwrap();
        files.push(p);
        let small = image::RgbImage::from_fn(9, 5, |x, y| image::Rgb([(x * 20) as u8, (y * 40) as u8, 7]));
        let p = dir.join("small.jpg");
        small.save_with_format(&p, image::ImageFormat::Jpeg).unwrap();
        files.push(p);
        let p = dir.join("small.png");
        small.save_with_format(&p, image::ImageFormat::Png).unwrap();
        files.push(p);
        let (mut file, mut px) = (Vec::new(), Vec::new());
        for f in files.iter().chain(files.iter().rev()) {
            let want = image::load_from_memory(&std::fs::read(f).unwrap()).unwrap().into_rgb8();
            let (w, h) = decode_into(f, &mut file, &mut px).unwrap();
            assert_eq!((w as u32, h as u32), want.dimensions(), "{}", f.display());
            assert!(px[..w * h * 3] == want.as_raw()[..], "{}", f.display());
            assert_eq!(decode(f).unwrap(), want);
        }
        let bad = dir.join("bad.jpg");
        let mut bytes = std::fs::read(&files[0]).unwrap();
        bytes.truncate(600);
        std::fs::write(&bad, &bytes[..600]).unwrap();
        std::fs::write(dir.join("junk.jpg"), [0xffu8, 0xd8, 0xff, 0x00, 1, 2, 3]).unwrap();
        for name in ["junk.jpg", "missing.jpg"] {
            let e = decode_into(&dir.join(name), &mut file, &mut px).unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
        // A truncated JPEG either decodes (zune pads missing data, as through the image crate)
        // or names the file.
        match (decode_into(&bad, &mut file, &mut px), image::load_from_memory(&bytes)) {
            (Ok(_), Ok(_)) => {}
            (Err(e), Err(_)) => assert!(e.to_string().contains("bad.jpg"), "{e}"),
            (a, b) => panic!("direct decode {:?} vs image crate {:?}", a.map(|_| ()), b.map(|_| ())),
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The RandAugment path (bytes → ops → tables) with every op skipped (`p0`) is the plain
    /// float path rounded to bytes: within half a level, for files and for in-memory sets; with
    /// ops on, it is deterministic and changes images.
    #[test]
    fn randaugment_byte_path_is_the_float_path_rounded() {
        let dir = std::env::temp_dir().join(format!("vitscale-ra-path-{}", std::process::id()));
        let files = synthetic::write_jpegs(&dir, 6, 5).unwrap();
        let files_set = ImageSet::from_files(files, vec![0; 6], 40, 1);
        let mut mem = builtin::generate(6, 16, 1, rng::stream::TRAIN);
        mem.batch_side = 16;
        let idx: Vec<usize> = (0..6).collect();
        for (set, dataset) in [(&files_set, DatasetKind::Folder), (&mem, DatasetKind::Builtin)] {
            let plain = cfg(dataset);
            let mut skip = plain.clone();
            skip.aug.auto_augment = crate::config::parse_rand_augment("rand-m9-p0").unwrap();
            let a = try_make_batch(set, &idx, &plain, true, 2, 7).unwrap();
            let b = try_make_batch(set, &idx, &skip, true, 2, 7).unwrap();
            // std 0.25: half a level is 0.5 / 255 / 0.25.
            let tol = 0.5 / 255.0 / 0.25 + 1e-5;
            let worst = a.images.iter().zip(&b.images).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(worst <= tol, "{dataset:?}: {worst} > {tol}");
            let mut on = plain.clone();
            on.aug.auto_augment = crate::config::parse_rand_augment("rand-m9-mstd0.5-inc1-p1").unwrap();
            let c = try_make_batch(set, &idx, &on, true, 2, 7).unwrap();
            assert_eq!(c, try_make_batch(set, &idx, &on, true, 2, 7).unwrap());
            assert_ne!(c.images, b.images);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn train_len_without_opening() {
        let c = cfg(DatasetKind::Builtin);
        assert_eq!(train_len(&c, 0).unwrap(), 500);
        let dir = std::env::temp_dir().join(format!("vitscale-train-len-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("data_batch_1.bin"), vec![0u8; 3073 * 3]).unwrap();
        std::fs::write(dir.join("data_batch_4.bin"), vec![0u8; 3073 * 2]).unwrap();
        std::fs::write(dir.join("test_batch.bin"), vec![0u8; 3073]).unwrap();
        let mut c10 = cfg(DatasetKind::Cifar10);
        c10.path = Some(dir.clone());
        assert_eq!(train_len(&c10, 0).unwrap(), 5);
        assert_eq!(open(&c10, 32, 10, 0).unwrap().train.len(), 5);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn class_mismatch_and_missing_path_are_errors() {
        let c = cfg(DatasetKind::Builtin);
        let e = open(&c, 16, 1000, 0).unwrap_err();
        assert!(e.to_string().contains("model.num_classes=10"), "{e}");
        let mut c10 = cfg(DatasetKind::Cifar10);
        let e = open(&c10, 32, 10, 0).unwrap_err();
        assert!(matches!(e, DataError::MissingPath { .. }), "{e}");
        c10.path = Some(PathBuf::from("/nonexistent"));
        let e = open(&c10, 32, 10, 0).unwrap_err();
        assert!(e.to_string().contains("/nonexistent"), "{e}");
        let mut c100 = cfg(DatasetKind::Cifar100);
        c100.label = LabelKind::Coarse;
        let e = open(&c100, 32, 100, 0).unwrap_err();
        assert!(e.to_string().contains("model.num_classes=20"), "{e}");
        let mut bad = cfg(DatasetKind::Cifar10);
        bad.label = LabelKind::Coarse;
        assert!(open(&bad, 32, 10, 0).unwrap_err().to_string().contains("data.label"));
    }
}
