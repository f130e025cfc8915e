//! `vitscale bench`: its flags, and the report of one measurement — training-step throughput,
//! MFU and peak memory (`crate::bench`), with `--data` the loader's (`data::bench`), with `--comm`
//! the collectives' (`lab::comm_bench`).

/// Command-line options of `vitscale bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// Model preset (timm name). Default: vit_base_patch16_224 on cuda, vit_tiny_patch4_32 on
    /// cpu (a ViT-B/16 step at micro 256 needs about 24 GB on the CPU).
    #[arg(long = "model", value_name = "PRESET")]
    pub model_arg: Option<String>,
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
    /// Activation memory policy: auto (regenerate LayerNorm/GELU outputs in the backward when
    /// the backend says it is nearly free), never, always.
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
    /// Measure the data loader instead of the model (`data::bench`): CIFAR 32-px crop+flip,
    /// 224-px JPEG RandomResizedCrop+flip, and the same + RandAugment, at 1 thread and at
    /// --threads. Model options are ignored.
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
    /// throughput benchmark.
    #[arg(long, value_name = "P.json")]
    pub profile_out: Option<std::path::PathBuf>,
    /// With --profile-out: the micro-batch sizes, comma-separated (default 4,8,16,32 on cpu,
    /// 16,32,64,128,256 on cuda).
    #[arg(long, value_name = "N,N,…", value_delimiter = ',')]
    pub profile_micros: Option<Vec<usize>>,
    #[command(flatten)]
    pub comm: crate::lab::comm_bench::CommBenchArgs,
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

/// On the CPU, refuses a step that cannot fit in memory (`train::memory`), before allocating.
fn check_cpu_memory(args: &BenchArgs) -> anyhow::Result<()> {
    let v = serde_json::json!({
        "model": {"preset": args.model},
        "train_micro_batch_size_per_gpu": args.micro,
        "train": {"pass_images": args.micro.max(1), "eval_batch_size": 1},
        "data": {"train_size": 1, "val_size": 1}
    });
    // An unknown preset or a zero micro-batch is reported by the benchmark itself.
    let Ok(cfg) = crate::config::resolve(&v, 1) else { return Ok(()) };
    super::common::check_memory(&cfg, &super::common::Device::Cpu(crate::backend::cpu::Cpu::new()), &format!("bench --model {} --micro {}", args.model, args.micro))
}

/// `vitscale bench`.
pub fn run(mut args: BenchArgs) -> anyhow::Result<()> {
    args.device = super::common::resolve_device_name(&args.device, args.gpu);
    if args.comm.comm {
        return crate::lab::comm_bench::command(&args.comm, &args.device, args.warmup, args.json);
    }
    if args.data {
        return crate::data::bench::command(args.threads, args.secs, args.jpeg_dir.as_deref(), args.json);
    }
    let (model, micro) = default_model_and_micro(&args.device);
    args.model = args.model_arg.clone().unwrap_or_else(|| model.to_string());
    args.micro = args.micro_arg.unwrap_or(micro);
    if args.gas == 0 {
        anyhow::bail!("--gas must be at least 1");
    }
    let env = crate::comm::DistEnv::detect()?;
    if args.zero > 2 {
        anyhow::bail!("--zero must be 0, 1 or 2, got {}", args.zero);
    }
    if args.zero > 0 && env.world_size == 1 {
        anyhow::bail!("--zero {} shards across ranks: run it under a launcher (vitscale launch --nproc-per-node N -- bench --zero {})", args.zero, args.zero);
    }
    if args.zero > 0 && args.comm_dtype != "fp32" && args.device == "cpu" {
        anyhow::bail!("--comm-dtype {}: CPU ranks reduce-scatter in fp32 (the bf16 wire applies at --zero 0, and at every stage on GPUs)", args.comm_dtype);
    }
    if args.device == "cpu" {
        check_cpu_memory(&args)?;
    }
    if let Some(path) = args.profile_out.clone() {
        if env.world_size > 1 {
            anyhow::bail!("--profile-out measures one rank: run it without a launcher");
        }
        let micros = args.profile_micros.clone().unwrap_or_else(|| default_profile_micros(&args.device));
        if args.device == "cpu" {
            if let Some(&largest) = micros.iter().max() {
                check_cpu_memory(&BenchArgs { micro: largest, ..args.clone() })?;
            }
        }
        let p = crate::bench::profile::measure_profile(&args, &micros)?;
        p.save(&path).map_err(|e| anyhow::anyhow!("--profile-out {e}"))?;
        println!("profile of {} on {} ({} micro sizes) written to {}", p.model, p.device, p.points.len(), path.display());
        if args.json {
            println!("{}", serde_json::to_string(&p)?);
        }
        return Ok(());
    }
    if env.world_size > 1 {
        let gpu = if args.device == "cpu" { 0 } else { super::train::gpu_index(&env)? };
        let r = crate::bench::measure_data_parallel(&args, &env, gpu)?;
        if env.rank == 0 {
            println!("{} on {} ranks (--device {}):", args.model, r.world, args.device);
            println!("{r}");
            if args.json {
                println!("{}", serde_json::to_string(&r)?);
            }
        }
        return Ok(());
    }
    let r = crate::bench::measure(&args)?;
    // The CPU has no measured matrix ceiling, so no MFU.
    let mfu = if r.ceiling_tflops > 0.0 {
        format!("{:.1} TFLOP/s of {:.0} measured ceiling = MFU {:.1}%", r.achieved_tflops, r.ceiling_tflops, r.mfu * 100.0)
    } else {
        format!("{:.3} TFLOP/s (no MFU: no measured ceiling on this device)", r.achieved_tflops)
    };
    // the CPU backend has no device memory to measure: its figure would print as 0.00
    let peak = match (r.device.as_str(), crate::util::peak_rss_gib()) {
        ("cpu", Some(rss)) => format!("peak mem n/a on the CPU (no device memory; process peak RSS {rss:.2} GiB)"),
        ("cpu", None) => "peak mem n/a on the CPU (no device memory)".to_string(),
        _ => format!("peak mem {:.2} GiB", r.peak_mem_gib),
    };
    println!(
        "{} on {}: micro {} | {:.2} ms/step | {:.1} img/s | {mfu} | {peak} | graph {} | recompute {} | loss {:.4}",
        r.model, r.device, r.micro, r.step_ms, r.img_per_s, r.graph, r.recomputed, r.loss
    );
    if r.executed_share < 1.0 {
        println!(
            "MFU counts the model's {} GFLOP per trained image; the step executes {:.1} % of them (the last block's queries, projection and MLP on the class token alone): {} TFLOP/s executed",
            crate::util::fmt_sig(r.train_gflop_per_img, 3),
            r.executed_share * 100.0,
            crate::util::fmt_sig(r.achieved_tflops * r.executed_share, 3)
        );
    }
    if let Some(p) = &r.gpu_power {
        println!("GPU during the timed steps: {p}");
    }
    if let Some(p) = &r.ceiling_gpu_power {
        println!("GPU during the ceiling GEMM: {p}");
    }
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(())
}
