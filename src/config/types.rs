//! The validated, typed run configuration that the rest of the crate consumes.
//!
//! Everything here is already checked: each section's file in `config` turns its part of a
//! DeepSpeed JSON (plus the `model` / `data` / `train` sections) into these types or into an
//! error naming the key. Nothing downstream re-validates user input.

use std::path::PathBuf;

use serde::Serialize;

use crate::model::ModelConfig;

// Defined below the config (`crate::core`) so that a backend can take them without depending on it.
pub use crate::core::{DecaySkip, OptimizerConfig};

/// The DeepSpeed batch triple, resolved for a world size:
/// `train_batch_size = micro_batch_per_gpu × gradient_accumulation_steps × world_size`.
/// As in DeepSpeed, the triple's world size is the data-parallel degree: the ranks ÷
/// `sequence_parallel_size` (a sequence-parallel group feeds the same images).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BatchConfig {
    pub train_batch_size: usize,
    pub micro_batch_per_gpu: usize,
    pub gradient_accumulation_steps: usize,
    /// The data-parallel degree (every rank of the job when `sequence_parallel_size` is 1).
    pub world_size: usize,
    /// Ranks per sequence-parallel group (DeepSpeed's `sequence_parallel_size`).
    pub sequence_parallel_size: usize,
}

impl BatchConfig {
    /// Every rank of the job: data-parallel degree × sequence-parallel size.
    pub fn ranks(&self) -> usize {
        self.world_size * self.sequence_parallel_size
    }
}

/// DeepSpeed's `warmup_type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmupType {
    Log,
    Linear,
}

/// A schedule's `total_num_steps`. The run's length depends on the training set's size, which
/// is known only once the dataset is opened, so the config keeps `"auto"` as `RunLength` and
/// the training loop supplies the number (`train::schedule::lr_at`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TotalSteps {
    /// `"auto"`: as many optimizer steps as the run takes.
    RunLength,
    /// A number of optimizer steps given in the config.
    Fixed(u64),
}

impl TotalSteps {
    /// The schedule length in optimizer steps for a run of `run_steps` optimizer steps.
    pub fn resolve(self, run_steps: u64) -> u64 {
        match self {
            TotalSteps::RunLength => run_steps,
            TotalSteps::Fixed(n) => n,
        }
    }
}

/// Written as the config spells it (a number, or `"auto"`), so a written config reads back the same.
impl Serialize for TotalSteps {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            TotalSteps::RunLength => s.serialize_str("auto"),
            TotalSteps::Fixed(n) => s.serialize_u64(*n),
        }
    }
}

/// `scheduler.type` with DeepSpeed's parameter names and defaults. No scheduler = constant LR.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum SchedulerConfig {
    WarmupLR {
        warmup_min_lr: f64,
        warmup_max_lr: f64,
        warmup_num_steps: u64,
        warmup_type: WarmupType,
    },
    WarmupDecayLR {
        warmup_min_lr: f64,
        warmup_max_lr: f64,
        warmup_num_steps: u64,
        warmup_type: WarmupType,
        total_num_steps: TotalSteps,
    },
    WarmupCosineLR {
        total_num_steps: TotalSteps,
        warmup_min_ratio: f64,
        warmup_num_steps: u64,
        cos_min_ratio: f64,
        warmup_type: WarmupType,
    },
}

/// Numeric format for compute (DeepSpeed `bf16` / `fp16` blocks). CPU always computes in f32.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Bf16,
    /// DeepSpeed `fp16` block: `loss_scale` 0 = dynamic.
    Fp16 {
        loss_scale: f64,
        initial_scale_power: u32,
        loss_scale_window: u64,
        hysteresis: u32,
        min_loss_scale: f64,
        /// Refill the hysteresis on every step without overflow (DeepSpeed's key).
        consecutive_hysteresis: bool,
    },
}

/// `communication_data_type`: the element type gradients travel in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CommDtype {
    Fp32,
    Bf16,
}

impl CommDtype {
    pub fn as_str(self) -> &'static str {
        match self {
            CommDtype::Fp32 => "fp32",
            CommDtype::Bf16 => "bf16",
        }
    }
}

/// How the gradient all-reduce runs (DeepSpeed's `communication_data_type`,
/// `prescale_gradients`, `gradient_predivide_factor`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct GradComm {
    pub dtype: CommDtype,
    pub prescale: bool,
    pub predivide: f64,
}

impl Default for GradComm {
    fn default() -> Self {
        GradComm { dtype: CommDtype::Fp32, prescale: false, predivide: 1.0 }
    }
}

/// `data.dataset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DatasetKind {
    /// Procedurally generated, deterministic, learnable, 10 classes, no files.
    Builtin,
    /// Random tensors (benchmarks).
    Synthetic,
    Cifar10,
    Cifar100,
    /// An image folder: `path/<class>/*.jpg|png|webp` (or `path/train/<class>/…` + `path/val/<class>/…`).
    Folder,
    /// An image folder packed into tar shards by `vitscale data pack` (`data::shards`).
    Shards,
}

impl DatasetKind {
    pub const NAMES: &'static [&'static str] = &["builtin", "synthetic", "cifar10", "cifar100", "folder", "shards"];
    pub fn as_str(self) -> &'static str {
        match self {
            DatasetKind::Builtin => "builtin",
            DatasetKind::Synthetic => "synthetic",
            DatasetKind::Cifar10 => "cifar10",
            DatasetKind::Cifar100 => "cifar100",
            DatasetKind::Folder => "folder",
            DatasetKind::Shards => "shards",
        }
    }
    /// Classes in the dataset (synthetic: taken from the model; folder: one per subfolder,
    /// known once listed; CIFAR-100 with `data.label=coarse`: see [`DataConfig::num_classes`]).
    pub fn num_classes(self) -> Option<usize> {
        match self {
            DatasetKind::Builtin | DatasetKind::Cifar10 => Some(10),
            DatasetKind::Cifar100 => Some(100),
            DatasetKind::Synthetic | DatasetKind::Folder | DatasetKind::Shards => None,
        }
    }
}

/// `data.label`: which CIFAR-100 label to train on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LabelKind {
    /// The 100 fine classes (the usual CIFAR-100 task; the only label CIFAR-10 has).
    Fine,
    /// The 20 coarse superclasses (CIFAR-100 only).
    Coarse,
}

/// `data.augment`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Augment {
    /// No augmentation: images go to the model as stored (normalized).
    None,
    /// The dataset's usual training augmentation (CIFAR: random crop with 4-px padding +
    /// horizontal flip; built-in: horizontal flip).
    Default,
}

/// `data.interpolation`: the filter that resamples images whose size is not the model's
/// (RandomResizedCrop and the evaluation resize), with timm's names; both are PIL's
/// antialiased filters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Interpolation {
    Bilinear,
    Bicubic,
}

impl Interpolation {
    pub const NAMES: &'static [&'static str] = &["bilinear", "bicubic"];
    pub fn as_str(self) -> &'static str {
        match self {
            Interpolation::Bilinear => "bilinear",
            Interpolation::Bicubic => "bicubic",
        }
    }
}

/// `data.decode`: where JPEG files are decoded and resampled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Decode {
    /// On the loader's CPU threads.
    Cpu,
    /// On the GPU (nvJPEG, then the crop, flip and normalization as kernels); the loader's
    /// threads only read files.
    Gpu,
    /// The GPU where it can run (a CUDA device, images from files, no CPU-only augmentation),
    /// else the CPU.
    Auto,
}

impl Decode {
    pub const NAMES: &'static [&'static str] = &["cpu", "gpu", "auto"];
    pub fn as_str(self) -> &'static str {
        match self {
            Decode::Cpu => "cpu",
            Decode::Gpu => "gpu",
            Decode::Auto => "auto",
        }
    }
}

/// `data.decode_scale`: how much of a JPEG the CPU path decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DecodeScale {
    /// libjpeg-turbo decodes only the rows and columns the crop's resampling reads, at the
    /// largest DCT reduction (1/2, 1/4, 1/8) that leaves the crop at least the output size.
    Auto,
    /// The whole image at full size (zune-jpeg).
    Full,
}

impl DecodeScale {
    pub const NAMES: &'static [&'static str] = &["auto", "full"];
    pub fn as_str(self) -> &'static str {
        match self {
            DecodeScale::Auto => "auto",
            DecodeScale::Full => "full",
        }
    }
}

/// The `data` section.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DataConfig {
    pub dataset: DatasetKind,
    pub path: Option<PathBuf>,
    /// Per-channel normalization applied after scaling pixels to [0, 1].
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub augment: Augment,
    pub shuffle: bool,
    /// Loader worker threads (0 = all cores).
    pub num_workers: usize,
    /// Images in the built-in / synthetic training split.
    pub train_size: usize,
    /// Images in the built-in / synthetic validation split.
    pub val_size: usize,
    /// `data.label` (default `fine`; `coarse` only with cifar100).
    pub label: LabelKind,
    /// `data.skip_bad` (default false): an image file that cannot be read or decoded is replaced
    /// by the next good image of the split (and counted) instead of stopping the run.
    pub skip_bad: bool,
    /// `data.val_split` (default 0.1, in [0, 1)): for a folder with no `train/`+`val/`
    /// subfolders, the fraction of each class held out (seeded) as the validation split.
    pub val_split: f64,
    /// `data.crop_pct` (default 0.875, in (0, 1]): eval resizes the shorter side to
    /// `image_size / crop_pct` and center-crops `image_size` (timm's `crop_pct`).
    pub crop_pct: f64,
    /// `data.scale` (default [0.08, 1.0], 0 < lo ≤ hi ≤ 1): RandomResizedCrop area range.
    pub scale: [f64; 2],
    /// `data.ratio` (default [0.75, 1.3333], 0 < lo ≤ hi): RandomResizedCrop aspect range.
    pub ratio: [f64; 2],
    /// `data.interpolation` (default bilinear): the resampling filter of RandomResizedCrop and
    /// the evaluation resize.
    pub interpolation: Interpolation,
    /// `data.prefetch` (default 2, ≥ 1): batches the loader prepares ahead of the training step.
    pub prefetch: usize,
    /// `data.decode` (default cpu): where images are decoded. The trainer resolves `auto`
    /// before the loaders start; a loader seeing `gpu` builds encoded batches.
    pub decode: Decode,
    /// `data.decode_scale` (default auto): on the CPU path, decode a JPEG only where its crop
    /// reads, at a reduced DCT scale when the crop is large enough (`data::jpeg`).
    pub decode_scale: DecodeScale,
    /// `data.decode_cpu_share` (default 0, in [0, 1]): with `decode = gpu`, the share of JPEG
    /// images the loader's threads decode on the CPU instead (drawn per image from seed, epoch
    /// and index; `data::cpu_decodes`).
    pub decode_cpu_share: f64,
    /// Extra training augmentations with timm names (all off by default).
    pub aug: AugmentOptions,
}

/// `data.auto_augment` parsed from a timm string such as `"rand-m9-mstd0.5-inc1"`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RandAugmentConfig {
    /// The string as given (written back into the resolved config).
    pub spec: String,
    /// `m`: magnitude on timm's 0..10 scale (default 10 when the string names none).
    pub magnitude: f64,
    /// `n`: ops applied per image (default 2).
    pub num_layers: usize,
    /// `mstd`: std of the Gaussian noise on the magnitude per op (inf = uniform in [0, m]).
    pub magnitude_std: f64,
    /// `mmax`: upper clip of the noisy magnitude (default 10).
    pub magnitude_max: f64,
    /// `inc`: the "increasing" op set, whose strength grows with the magnitude.
    pub increasing: bool,
    /// `p`: probability that each chosen op is applied (default 0.5).
    pub prob: f64,
}

/// `data.mixup_mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MixMode {
    /// One λ (and one box) per global batch, as timm's `Mixup(mode="batch")`.
    Batch,
    /// One λ (and box) per pair of partners, both mixed with each other (timm's "pair").
    Pair,
    /// One λ (and box) per image, mixed with its partner's unmixed pixels (timm's "elem").
    Elem,
}

impl MixMode {
    pub const NAMES: &'static [&'static str] = &["batch", "pair", "elem"];
    pub fn as_str(self) -> &'static str {
        match self {
            MixMode::Batch => "batch",
            MixMode::Pair => "pair",
            MixMode::Elem => "elem",
        }
    }
}

/// `data.remode`: what random erasing fills the box with (timm names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EraseMode {
    /// Per-pixel normal(0, 1) noise (in normalized units).
    Pixel,
    /// Zeros, i.e. the dataset mean.
    Const,
    /// One normal(0, 1) value per channel.
    Rand,
}

/// RandAugment, mixup/cutmix and random erasing (timm's names and meanings). `Default` is
/// every one off, which keeps `data.augment = "default"` to crop + flip.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AugmentOptions {
    pub auto_augment: Option<RandAugmentConfig>,
    /// `data.mixup`: Beta(α, α) of mixup; 0 = off.
    pub mixup: f64,
    /// `data.cutmix`: Beta(α, α) of cutmix; 0 = off.
    pub cutmix: f64,
    /// `data.mixup_prob`: probability a batch is mixed at all.
    pub mixup_prob: f64,
    /// `data.mixup_switch_prob`: with both on, probability of cutmix instead of mixup.
    pub mixup_switch_prob: f64,
    pub mixup_mode: MixMode,
    /// `data.reprob`: probability an image gets random erasing; 0 = off.
    pub reprob: f64,
    pub remode: EraseMode,
    /// `data.recount`: erased boxes per image, at most (drawn in 1..=recount).
    pub recount: usize,
}

impl Default for AugmentOptions {
    fn default() -> Self {
        AugmentOptions {
            auto_augment: None,
            mixup: 0.0,
            cutmix: 0.0,
            mixup_prob: 1.0,
            mixup_switch_prob: 0.5,
            mixup_mode: MixMode::Batch,
            reprob: 0.0,
            remode: EraseMode::Pixel,
            recount: 1,
        }
    }
}

impl AugmentOptions {
    /// Whether batches carry soft targets (mixup or cutmix on).
    pub fn mixes(&self) -> bool {
        self.mixup > 0.0 || self.cutmix > 0.0
    }
}

impl DataConfig {
    pub const DEFAULT_VAL_SPLIT: f64 = 0.1;
    pub const DEFAULT_CROP_PCT: f64 = 0.875;
    pub const DEFAULT_SCALE: [f64; 2] = [0.08, 1.0];
    pub const DEFAULT_RATIO: [f64; 2] = [3.0 / 4.0, 4.0 / 3.0];
    pub const DEFAULT_PREFETCH: usize = 2;

    /// A `data` section for `dataset` with the given normalization and every other option at
    /// its default (the constants above, augmentation "default", no extra augmentations,
    /// shuffling on, loader threads = cores) and no built-in/synthetic split sizes: the start
    /// for code that opens data without a config file (benchmarks, tests).
    pub fn for_dataset(dataset: DatasetKind, path: Option<PathBuf>, mean: [f32; 3], std: [f32; 3]) -> Self {
        DataConfig {
            dataset,
            path,
            mean,
            std,
            augment: Augment::Default,
            shuffle: true,
            num_workers: 0,
            train_size: 0,
            val_size: 0,
            label: LabelKind::Fine,
            skip_bad: false,
            val_split: Self::DEFAULT_VAL_SPLIT,
            crop_pct: Self::DEFAULT_CROP_PCT,
            scale: Self::DEFAULT_SCALE,
            ratio: Self::DEFAULT_RATIO,
            interpolation: Interpolation::Bilinear,
            prefetch: Self::DEFAULT_PREFETCH,
            decode: Decode::Cpu,
            decode_scale: DecodeScale::Auto,
            decode_cpu_share: 0.0,
            aug: Default::default(),
        }
    }

    /// Classes the labels range over, when known without reading files (CIFAR-100 coarse: 20).
    pub fn num_classes(&self) -> Option<usize> {
        match (self.dataset, self.label) {
            (DatasetKind::Cifar100, LabelKind::Coarse) => Some(20),
            (d, _) => d.num_classes(),
        }
    }
}

/// One of DeepSpeed's file monitors (`tensorboard`, `csv_monitor`), when enabled: its files
/// go to `<output_path>/<job_name>/` (`output_path` "" = the run directory).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MonitorTarget {
    pub output_path: String,
    pub job_name: String,
}

/// DeepSpeed's monitoring keys.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MonitorConfig {
    pub tensorboard: Option<MonitorTarget>,
    pub csv_monitor: Option<MonitorTarget>,
    /// `wall_clock_breakdown`: print the phases of each logged step.
    pub wall_clock_breakdown: bool,
}

/// The `train` section.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TrainConfig {
    /// Length of the run: whole epochs, or optimizer steps when `steps` is set (wins).
    pub epochs: usize,
    pub steps: Option<u64>,
    pub seed: u64,
    /// Evaluate every this many optimizer steps (0 = at the end of each epoch only).
    pub eval_every: u64,
    /// Write a checkpoint every this many optimizer steps (0 = never).
    pub checkpoint_every: u64,
    pub label_smoothing: f32,
    pub weight_decay_skip: DecaySkip,
    /// Print / log a metrics line every this many optimizer steps.
    pub log_every: u64,
    /// Batch size for evaluation (defaults to the micro batch).
    pub eval_batch_size: usize,
    /// SIGINT / SIGTERM: stop every rank after the same optimizer step, checkpoint it, exit
    /// with 128 + signal (default: on when `checkpoint_every > 0`).
    pub checkpoint_on_signal: bool,
    /// How long a collective waits for the other ranks (seconds); `VITSCALE_COMM_TIMEOUT`
    /// overrides it.
    pub comm_timeout_s: f64,
    /// Whether the backward regenerates LayerNorm/GELU outputs instead of keeping them per block.
    pub recompute: crate::model::Recompute,
    /// Most images per forward/backward pass (None = "auto": `train::plan::AUTO_PASS_IMAGES`).
    pub pass_images: Option<usize>,
    /// `train.emulate_slowdown`: (rank, factor ≥ 1) in rank order, the ranks that emulate a
    /// slower device (`train::balance`); empty = none.
    pub emulate_slowdown: Vec<(usize, f64)>,
    /// `train.balance`: how the global batch is split over the ranks.
    pub balance: Balance,
    /// `train.balance_every`: under `balance = "auto"`, steps between re-estimates.
    pub balance_every: u64,
    /// `train.ema`: an exponential moving average of the weights (None = off).
    pub ema: Option<EmaConfig>,
}

/// `train.ema`: timm's `ModelEmaV3` of the f32 weights, updated after every optimizer step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EmaConfig {
    /// The decay once warmed up (timm's `decay`).
    pub decay: f64,
    /// Lower bound of the warm-up's decay (`min_decay`).
    pub min_decay: f64,
    /// Optimizer steps during which the average just copies the weights (`update_after_step`).
    pub update_after_step: u64,
    /// Decay 1 − (1 + t/γ)^−power over the steps t after the first (`use_warmup`), capped at
    /// `decay`.
    pub warmup: bool,
    pub warmup_gamma: f64,
    pub warmup_power: f64,
}

impl EmaConfig {
    /// The decay of the update after optimizer step `step` (1-based count of updates, as
    /// timm's training script passes `num_updates`): 0 — a copy of the weights — for the first
    /// update and the `update_after_step` after it, then `decay` or the warm-up's value.
    pub fn decay_at(&self, step: u64) -> f64 {
        let t = step.saturating_sub(self.update_after_step + 1);
        if t == 0 {
            return 0.0;
        }
        if !self.warmup {
            return self.decay;
        }
        let d = 1.0 - (1.0 + t as f64 / self.warmup_gamma).powf(-self.warmup_power);
        d.min(self.decay).max(self.min_decay)
    }
}

/// How the global batch is split over the ranks (`train.balance`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Balance {
    /// Equal micro-batches (DeepSpeed's split).
    Off,
    /// Micro-batches proportional to these positive shares, one per rank.
    Shares(Vec<f64>),
    /// Micro-batches proportional to each rank's measured speed, re-estimated every
    /// `balance_every` steps.
    Auto,
}

impl Balance {
    pub fn is_off(&self) -> bool {
        matches!(self, Balance::Off)
    }
}

/// `zero_optimization.stage3_*`: how ZeRO stage 3 gathers the partitioned weights
/// (`model::partition`), with DeepSpeed's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Stage3Config {
    /// The next block's gather starts while the current one computes when the block has at
    /// most this many elements (0: no prefetch).
    pub prefetch_bucket_size: usize,
    /// Blocks of at most this many elements stay whole on every rank.
    pub param_persistence_threshold: usize,
    /// Gathered elements a rank may hold at once: two blocks' worth allows the prefetch.
    pub max_live_parameters: usize,
}

impl Default for Stage3Config {
    fn default() -> Self {
        Stage3Config { prefetch_bucket_size: 50_000_000, param_persistence_threshold: 100_000, max_live_parameters: 1_000_000_000 }
    }
}

/// A complete, validated run configuration.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunConfig {
    pub batch: BatchConfig,
    pub optimizer: OptimizerConfig,
    /// `optimizer.params.layer_decay`: timm's layer-wise learning-rate decay (None = off).
    pub layer_decay: Option<f64>,
    pub scheduler: Option<SchedulerConfig>,
    /// Clip the global gradient norm to this value (0 disables), DeepSpeed `gradient_clipping`.
    pub gradient_clipping: f64,
    pub precision: Precision,
    /// DeepSpeed `zero_optimization.stage`: 0, 1, 2 or 3.
    pub zero_stage: u8,
    /// `zero_optimization.reduce_bucket_size`: elements per gradient bucket (None = the
    /// default of `train::sync`).
    pub reduce_bucket_size: Option<usize>,
    /// The gradient all-reduce's dtype and scaling.
    pub grad_comm: GradComm,
    /// `zero_optimization.reduce_scatter`: stage 2 reduce-scatters its buckets (else all-reduces).
    pub zero_reduce_scatter: bool,
    /// `zero_optimization.overlap_comm`: bucket reductions start during the last backward.
    pub zero_overlap_comm: bool,
    /// `zero_optimization.stage3_*` (used at stage 3).
    pub zero3: Stage3Config,
    pub model: ModelConfig,
    /// `model.drop_path_rate`: stochastic depth's probability at the last block (0 = off).
    pub drop_path_rate: f64,
    pub data: DataConfig,
    pub train: TrainConfig,
    /// `tensorboard`, `csv_monitor`, `wall_clock_breakdown`.
    pub monitor: MonitorConfig,
    /// Keys that were accepted but whose feature is not implemented (yet), one line each.
    #[serde(skip)]
    pub warnings: Vec<String>,
}
