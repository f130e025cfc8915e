//! The command implementations behind `src/main.rs`: argument structs (clap) and what each
//! subcommand does. Every failure comes back as an error naming its source, never a panic.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use crate::backend::cpu::Cpu;
use crate::backend::cuda::{self, Cuda};
use crate::backend::Backend;
use crate::comm::SingleComm;
use crate::config::{self, RunConfig};
use crate::model::weights;
use crate::train::engine::{self, TrainOptions};

/// `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// A GPU when one is usable, else the CPU (with a notice).
    Auto,
    Cpu,
    Cuda,
}

/// Options shared by commands that take a run configuration.
#[derive(Args, Debug, Clone)]
pub struct ConfigArgs {
    /// DeepSpeed JSON config plus `model` / `data` / `train` sections.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one key: `--set key.path=JSON` (repeatable), e.g. `--set data.mean=[0.5,0.5,0.5]`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    #[arg(long, value_enum, default_value = "auto")]
    pub device: DeviceArg,
    /// Print one machine-readable JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    pub common: ConfigArgs,
    /// Directory for config.json, metrics.jsonl and summary.json (default runs/<time>-<pid>).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Start from these weights (safetensors, timm key names).
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Write the final weights here (safetensors, timm key names).
    #[arg(long)]
    pub save_weights: Option<PathBuf>,
    /// Resume from a checkpoint: a step directory, a checkpoint root, or `latest` (the newest
    /// under `<run dir>/checkpoints`; needs --run-dir). Checkpoints are written every
    /// `train.checkpoint_every` steps.
    #[arg(long, value_name = "DIR|latest")]
    pub resume: Option<String>,
    /// Checkpoint step directories to keep (0 = all).
    #[arg(long, default_value_t = 3)]
    pub keep_checkpoints: usize,
    /// Write each rank's timeline (forward, backward, finished gradients, bucket reductions)
    /// as `DIR/trace-rank<r>.json` in the Chrome trace format (chrome://tracing, Perfetto).
    #[arg(long, value_name = "DIR")]
    pub trace: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    pub common: ConfigArgs,
    /// Weights to evaluate (safetensors, timm key names).
    #[arg(long)]
    pub weights: PathBuf,
    /// Which split to evaluate.
    #[arg(long, value_enum, default_value = "val")]
    pub split: SplitArg,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SplitArg {
    Train,
    Val,
}

/// Loads the run configuration. With a weights file, architecture fields the config does not
/// give are read off the file's shapes (a named `model.preset` is kept as is and checked
/// against the file when the weights load).
pub fn load_config(args: &ConfigArgs, weights_path: Option<&Path>, world_size: usize) -> anyhow::Result<RunConfig> {
    let mut value = config::load_json(args.config.as_deref(), &args.sets)?;
    let mut notes = Vec::new();
    let mut classes_from_weights: Option<(std::path::PathBuf, u64)> = None;
    if let Some(path) = weights_path {
        let inferred = weights::infer(path)?;
        let root = value.as_object_mut().ok_or_else(|| anyhow::anyhow!("the config must be a JSON object"))?;
        let model = root.entry("model").or_insert_with(|| serde_json::json!({}));
        let model = model.as_object_mut().ok_or_else(|| anyhow::anyhow!("`model` must be a JSON object"))?;
        if !model.contains_key("preset") {
            if !model.contains_key("num_classes") {
                classes_from_weights = inferred.fields.get("num_classes").and_then(|v| v.as_u64()).map(|k| (path.to_path_buf(), k));
            }
            for (k, v) in inferred.fields {
                model.entry(k).or_insert(v);
            }
            if !model.contains_key("num_heads") {
                if let Some(h) = inferred.num_heads {
                    model.insert("num_heads".into(), h.into());
                }
            }
            if !model.contains_key("num_heads") {
                match inferred.guessed_num_heads {
                    Some(h) => {
                        model.insert("num_heads".into(), h.into());
                        notes.push(format!("model.num_heads not given: using {h} (head width 64, timm's convention); set it if the weights use another"));
                    }
                    None => anyhow::bail!(
                        "{}: model.num_heads cannot be read from the weights (width {} is not a multiple of 64); give it with --set model.num_heads=H",
                        path.display(),
                        model.get("embed_dim").map(|v| v.to_string()).unwrap_or_default()
                    ),
                }
            }
        }
    }
    default_folder_classes(&mut value, &mut notes)?;
    let resolved = config::resolve(&value, world_size);
    let mut cfg = match (resolved, classes_from_weights) {
        (Err(e), Some((path, k))) if e.to_string().contains("model.num_classes") => {
            // The class count was read from the weights, not written by the user: say so.
            return Err(anyhow::Error::new(e).context(format!(
                "{}: the weights' head has {k} outputs, so model.num_classes was read as {k} from them",
                path.display()
            )));
        }
        (r, _) => r?,
    };
    cfg.warnings.extend(notes);
    Ok(cfg)
}

/// For an image-folder dataset whose config (and weights) leave `model.num_classes` out, the
/// class count is the number of class subfolders, as a user of timm's ImageFolder expects.
fn default_folder_classes(value: &mut serde_json::Value, notes: &mut Vec<String>) -> anyhow::Result<()> {
    if value["data"]["dataset"].as_str() != Some("folder") || !value["model"]["num_classes"].is_null() {
        return Ok(());
    }
    let Some(path) = value["data"]["path"].as_str().map(str::to_string) else {
        return Ok(()); // the config check reports the missing data.path
    };
    let classes = crate::data::folder::class_names(Path::new(&path))?;
    if classes.is_empty() {
        return Ok(()); // opening the dataset names the empty folder
    }
    let root = value.as_object_mut().ok_or_else(|| anyhow::anyhow!("the config must be a JSON object"))?;
    let model = root.entry("model").or_insert_with(|| serde_json::json!({}));
    if let Some(model) = model.as_object_mut() {
        model.insert("num_classes".into(), classes.len().into());
        notes.push(format!("model.num_classes not given: {} class folders in {path}", classes.len()));
    }
    Ok(())
}

/// Settings the configuration accepts but the chosen device does not honour (yet): each
/// becomes a warning, never a silent no-op.
fn engine_warnings(cfg: &RunConfig, device: &Device) -> Vec<String> {
    let mut w = Vec::new();
    match (&cfg.precision, device) {
        (config::Precision::Bf16, Device::Cuda(_)) => {}
        (config::Precision::Fp32, Device::Cpu(_)) => {}
        (config::Precision::Fp32, Device::Cuda(_)) => w.push(
            "no bf16/fp16 block: the CUDA backend computes in bf16 with f32 master weights, optimizer state and gradient accumulation (f32 compute is CPU-only)".into(),
        ),
        (config::Precision::Fp16 { .. }, Device::Cuda(_)) => w.push(
            "fp16.enabled: the CUDA backend computes in bf16 (no loss scaling needed); fp16 with dynamic loss scaling is not implemented".into(),
        ),
        (config::Precision::Bf16, Device::Cpu(_)) => w.push("bf16.enabled: the CPU backend computes in f32; bf16 applies on GPUs".into()),
        (config::Precision::Fp16 { .. }, Device::Cpu(_)) => {
            w.push("fp16.enabled: the CPU backend computes in f32 (no loss scaling); fp16 applies on GPUs".into())
        }
    }
    if cfg.zero_stage > 0 {
        w.push(format!(
            "zero_optimization.stage {}: ZeRO partitioning is not implemented yet; every rank keeps the full optimizer state and gradients (stage 0)",
            cfg.zero_stage
        ));
    }
    w
}

/// The backend a command runs on.
pub enum Device {
    Cpu(Cpu),
    Cuda(Cuda),
}

/// Resolves `--device`: `cuda` must find a usable GPU (the error says which library or driver
/// call failed); `auto` takes the GPU of this process's local rank when there is one and
/// otherwise says why it falls back to the CPU.
pub fn open_device(arg: DeviceArg, local_rank: usize) -> anyhow::Result<Device> {
    match arg {
        DeviceArg::Cpu => Ok(Device::Cpu(Cpu::new())),
        DeviceArg::Cuda => {
            cuda::probe(local_rank).map_err(|e| anyhow::anyhow!("--device cuda: no usable GPU {local_rank}: {e}"))?;
            Ok(Device::Cuda(Cuda::new(local_rank).map_err(|e| anyhow::anyhow!("--device cuda: GPU {local_rank}: {e}"))?))
        }
        DeviceArg::Auto => match cuda::probe(local_rank) {
            Ok(_) => Ok(Device::Cuda(Cuda::new(local_rank).map_err(|e| anyhow::anyhow!("GPU {local_rank}: {e}"))?)),
            Err(why) => {
                eprintln!("notice: using the CPU (no usable GPU: {why})");
                Ok(Device::Cpu(Cpu::new()))
            }
        },
    }
}

fn default_run_dir(env: &crate::comm::DistEnv) -> PathBuf {
    // every rank must pick the same directory without talking: `vitscale launch` sets
    // VITSCALE_RUN_ID; under other launchers use what the ranks share.
    if let Some(id) = std::env::var("VITSCALE_RUN_ID").ok().filter(|s| !s.is_empty()) {
        return PathBuf::from("runs").join(id);
    }
    if env.is_distributed() {
        let id = match std::env::var("SLURM_JOB_ID") {
            Ok(job) => format!("slurm-{job}"),
            Err(_) => format!("dist-{}-{}", env.master_addr, env.master_port),
        };
        return PathBuf::from("runs").join(id);
    }
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    PathBuf::from("runs").join(format!("{secs}-{}", std::process::id()))
}

pub fn train_cmd(args: TrainArgs) -> anyhow::Result<()> {
    // this process's place in the job (one process when no launcher variables are set);
    // the config resolves the DeepSpeed batch triple for that world size.
    let env = crate::comm::DistEnv::detect()?;
    let mut cfg = load_config(&args.common, args.init.as_deref(), env.world_size)?;
    let device = open_device(args.common.device, env.local_rank)?;
    cfg.warnings.extend(engine_warnings(&cfg, &device));
    if args.resume.as_deref() == Some("latest") && args.run_dir.is_none() {
        anyhow::bail!("--resume latest needs --run-dir: the run directory whose checkpoints/ to continue from");
    }
    let run_dir = args.run_dir.clone().unwrap_or_else(|| default_run_dir(&env));
    let hash = config_hash(&cfg)?;
    // collective timeout: train.comm_timeout_s, or VITSCALE_COMM_TIMEOUT when set.
    let comm_opts = crate::comm::CommOptions::from_config_and_env(cfg.train.comm_timeout_s)?;
    let rank = env.rank;
    let opts = TrainOptions {
        // Rank 0 owns the run directory; the others log beside it.
        run_dir: if rank == 0 { run_dir.clone() } else { run_dir.join(format!("rank{rank}")) },
        init: args.init.clone(),
        save_weights: if rank == 0 { args.save_weights.clone() } else { None },
        progress_bar: rank == 0 && std::io::stderr().is_terminal(),
        quiet: rank != 0,
        resume: args.resume.as_deref().map(|s| crate::train::checkpoint::resume_path(s, &run_dir.join("checkpoints"))),
        keep_checkpoints: args.keep_checkpoints,
        trace: args.trace.clone(),
    };
    // SIGINT/SIGTERM from here on: finish the step on every rank, checkpoint it, exit
    // with 128 + signal (see train::stop and `exit_code`).
    let _stop_guard;
    let summary = match &device {
        Device::Cpu(be) => {
            let mut comm = crate::comm::init_cpu(&env, &comm_opts, &hash)?;
            _stop_guard = cfg.train.checkpoint_on_signal.then(crate::train::stop::StopGuard::install);
            engine::train_with(be, &cfg, &opts, comm.as_mut())?
        }
        Device::Cuda(be) => {
            if env.world_size > 1 {
                anyhow::bail!(
                    "rank {rank}: data parallel across GPUs needs the NCCL communicator, which is not implemented yet (world size {}); use --device cpu for multi-process runs",
                    env.world_size
                );
            }
            _stop_guard = cfg.train.checkpoint_on_signal.then(crate::train::stop::StopGuard::install);
            engine::train_with(be, &cfg, &opts, &mut SingleComm::new())?
        }
    };
    if rank != 0 {
        return Ok(());
    }
    eprintln!(
        "done: val_top1 {:.4} val_loss {:.4} train_loss {:.4} | {} images in {:.1} s ({:.0} img/s) | run dir {}",
        summary.val_top1, summary.val_loss, summary.train_loss, summary.images, summary.wall_s, summary.images_per_s, summary.run_dir
    );
    if args.common.json {
        println!("{}", serde_json::to_string(&summary)?);
    }
    Ok(())
}

/// The exit status for a command's error: 128 + signal when training stopped for
/// SIGINT/SIGTERM (130 / 143), else 1.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    e.downcast_ref::<engine::TrainError>().map_or(1, engine::TrainError::exit_code)
}

fn evaluate_weights<B: Backend>(be: &B, cfg: &RunConfig, weights: &Path, set: &std::sync::Arc<crate::data::ImageSet>) -> anyhow::Result<engine::EvalSummary> {
    let mut vit = engine::build_model(be, cfg, Some(weights))?;
    Ok(engine::evaluate(be, &mut vit, set, cfg, cfg.train.eval_batch_size)?)
}

/// Identifies the resolved configuration, so ranks started with different configs
/// refuse to train together (rendezvous names the rank and both hashes).
fn config_hash(cfg: &RunConfig) -> anyhow::Result<String> {
    use sha2::{Digest, Sha256};
    let bytes = serde_json::to_vec(cfg)?;
    Ok(Sha256::digest(&bytes).iter().take(8).map(|b| format!("{b:02x}")).collect())
}

pub fn eval_cmd(args: EvalArgs) -> anyhow::Result<()> {
    let mut cfg = load_config(&args.common, Some(&args.weights), 1)?;
    let device = open_device(args.common.device, 0)?;
    cfg.warnings.extend(engine_warnings(&cfg, &device));
    for w in &cfg.warnings {
        eprintln!("warning: {w}");
    }
    let sets = crate::data::open(&cfg.data, cfg.model.image_size, cfg.model.num_classes, cfg.train.seed)?;
    let set = match args.split {
        SplitArg::Train => &sets.train,
        SplitArg::Val => &sets.val,
    };
    let ev = match &device {
        Device::Cpu(be) => evaluate_weights(be, &cfg, &args.weights, set)?,
        Device::Cuda(be) => evaluate_weights(be, &cfg, &args.weights, set)?,
    };
    eprintln!("eval: loss {:.6} top1 {:.4} on {} images", ev.loss, ev.top1, ev.images);
    if args.common.json {
        println!("{}", serde_json::to_string(&ev)?);
    }
    Ok(())
}
