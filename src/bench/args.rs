//! The flags of `vitscale bench` (`BenchArgs`) and the defaults that depend on the device:
//! what every benchmark in this folder runs from.

/// Command-line options of `vitscale bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Model preset (timm name). Default: vit_base_patch16_224 on cuda, vit_tiny_patch4_32 on
    /// cpu (a ViT-B/16 step at micro 256 needs about 24 GB on the CPU).
    #[arg(long = "model", value_name = "PRESET")]
    pub model_arg: Option<String>,
    /// Image size (pixels per side) the preset runs at, as timm's `img_size=` (the patch must
    /// divide it). Default: the preset's.
    #[arg(long = "img", value_name = "PX")]
    pub img: Option<usize>,
    /// Micro-batch size (images per step). Default: 256 on cuda, 32 on cpu.
    #[arg(long = "micro", value_name = "N")]
    pub micro_arg: Option<usize>,
    /// The preset measured (`--model` or the device's default).
    #[arg(skip)]
    pub model: String,
    /// The micro-batch measured (`--micro` or the device's default).
    #[arg(skip)]
    pub micro: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// cuda, cpu, or auto (a GPU when one is usable, else the CPU, saying so).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// GPU index.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Override the preset's class count (the peer script uses 10).
    #[arg(long)]
    pub classes: Option<usize>,
    /// Capture forward+backward into a CUDA graph: on, off, or auto (on).
    #[arg(long, default_value = "auto")]
    pub graph: String,
    /// Skip measuring the bf16 GEMM ceiling (MFU then uses 794 TFLOP/s, the H200's dense bf16
    /// rate under its power cap).
    #[arg(long)]
    pub no_ceiling: bool,
    /// After timing, run one eager step with every kernel and GEMM timed and print the table.
    #[arg(long)]
    pub profile: bool,
    /// CUDA attention path: fused, fused-pipe or gemm (default: $VITSCALE_ATTENTION, else fused).
    #[arg(long)]
    pub attention: Option<String>,
    /// Activation memory policy (`train.recompute`): auto (regenerate LayerNorm/GELU outputs in
    /// the backward when the backend says it is nearly free), never, always, blocks (checkpoint
    /// every block, keeping its attention output where the attention's state allows),
    /// blocks_full (checkpoint every block, the attention recomputed too).
    #[arg(long, default_value = "auto")]
    pub recompute: String,
    /// Compute the last block for every token, as timm does, instead of the class token alone
    /// after its keys and values (same results; for comparing the two).
    #[arg(long)]
    pub full_last_block: bool,
    /// Micro-batches per optimizer step (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    pub gas: usize,
    /// Under a launcher (several ranks): the gradient reduction's data type, fp32 or bf16.
    #[arg(long, default_value = "fp32")]
    pub comm_dtype: String,
    /// Under a launcher: elements per gradient bucket (default: train::sync's, 25 MiB of f32).
    #[arg(long)]
    pub bucket_elems: Option<usize>,
    /// Under a launcher: the data-parallel step at this ZeRO stage (0, 1 or 2): sharded
    /// optimizer state (and on a GPU master weights), stage 2 reduce-scatters the gradients;
    /// the updated weights are all-gathered after the update, as `train` does.
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// Print one JSON object as the last line.
    #[arg(long)]
    pub json: bool,
    /// Measure the data loader instead of the model (`bench::data`): CIFAR 32-px crop+flip,
    /// 224-px JPEG RandomResizedCrop+flip, and the same + RandAugment, at 1 thread and at
    /// --threads; on a GPU (--device cuda, or auto finding one) also the GPU decode
    /// (`data.decode = "gpu"`). Model options are ignored.
    #[arg(long)]
    pub data: bool,
    /// With --data: loader threads for the parallel points (0 = every core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// With --data: read the `.jpg` files of this folder instead of generated ones.
    #[arg(long)]
    pub jpeg_dir: Option<std::path::PathBuf>,
    /// With --data: seconds per measured point.
    #[arg(long, default_value_t = 3.0)]
    pub secs: f64,
    /// Write this device's compute profile for `vitscale plan` (`plan::profile`) to this file:
    /// per-group forward/backward and optimizer times of one rank at each `--profile-micros`
    /// size (`--warmup` untimed steps and `--steps` timed repetitions each), instead of the
    /// throughput benchmark. Under `vitscale launch` (CPU), every rank profiles its own step
    /// at the same time and rank 0 writes the file: one rank as K launched ranks run.
    #[arg(long, value_name = "P.json")]
    pub profile_out: Option<std::path::PathBuf>,
    /// With --profile-out: the micro-batch sizes, comma-separated (default 4,8,16,32 on cpu,
    /// 16,32,64,128,256 on cuda).
    #[arg(long, value_name = "N,N,…", value_delimiter = ',')]
    pub profile_micros: Option<Vec<usize>>,
    #[command(flatten)]
    pub comm: crate::bench::comm::CommBenchArgs,
}

/// The micro-batch sizes `--profile-out` measures when `--profile-micros` is not given.
pub fn default_profile_micros(device: &str) -> Vec<usize> {
    match device {
        "cpu" => vec![4, 8, 16, 32],
        _ => vec![16, 32, 64, 128, 256],
    }
}

/// The preset and micro-batch `bench` measures when not given: a training-sized step on a
/// GPU, one that fits a laptop's memory and finishes in seconds on a CPU.
pub fn default_model_and_micro(device: &str) -> (&'static str, usize) {
    match device {
        "cpu" => ("vit_tiny_patch4_32", 32),
        _ => ("vit_base_patch16_224", 256),
    }
}
