//! `vitscale train`: trains a ViT on this process's share of the job (one process, or one
//! rank under `vitscale launch`, torchrun or Slurm), writing the run directory on rank 0.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::Args;

use super::common::{check_memory, check_output_file, check_writable_dir, config_hash, engine_warnings, load_config_edited, open_device, plan_on, ConfigArgs, Device};
use crate::comm::SingleComm;
use crate::train::trainer::{Trainer, TrainOptions};

/// Command-line options of `vitscale train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    pub common: ConfigArgs,
    /// Directory for config.json, metrics.jsonl and summary.json (default runs/<time>-<pid>).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Start from these weights (safetensors, timm's or torchvision's key names, told apart by
    /// the names). As timm does, a head of another class count is initialized anew and a
    /// position embedding of another patch grid (another model.image_size) is resampled
    /// (bicubic, antialiased), each with a notice.
    #[arg(long)]
    pub init: Option<PathBuf>,
    /// Write the final weights here (safetensors, key names as --weights-format says).
    #[arg(long)]
    pub save_weights: Option<PathBuf>,
    /// Key names of the --save-weights file: timm's `VisionTransformer` or torchvision's
    /// (`vit_b_16` and its siblings). Checkpoints always use timm's.
    #[arg(long, value_name = "timm|torchvision", default_value = "timm", requires = "save_weights")]
    pub weights_format: crate::model::weights::WeightsFormat,
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

fn default_run_dir(env: &crate::comm::DistEnv) -> PathBuf {
    // every rank must pick the same directory without talking: `vitscale launch` sets
    // VITSCALE_RUN_ID; under other launchers the job's identity (SLURM job and step, Open
    // MPI's namespace, torchrun's run id), else the rendezvous address.
    if let Some(id) = std::env::var("VITSCALE_RUN_ID").ok().filter(|s| !s.is_empty()) {
        return PathBuf::from("runs").join(id);
    }
    if env.is_distributed() {
        let job = crate::comm::env::job_id();
        let id = if job.is_empty() {
            format!("dist-{}-{}", env.master_addr, env.master_port)
        } else {
            job.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '-' }).collect()
        };
        return PathBuf::from("runs").join(id);
    }
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    PathBuf::from("runs").join(format!("{secs}-{}", std::process::id()))
}

/// Resuming on another world size than the checkpoint's: the config's batch keys are set so
/// the global batch stays the checkpoint's (`config::keep_global_batch`).
fn keep_saved_global_batch(value: &mut serde_json::Value, state: &serde_json::Value, world: usize) -> anyhow::Result<Vec<String>> {
    let num = |k: &str| state.get(k).and_then(serde_json::Value::as_u64).map(|x| x as usize);
    match (num("world_size"), num("global_batch")) {
        (Some(saved_world), Some(global)) if saved_world != world => Ok(vec![crate::config::keep_global_batch(value, global, saved_world, world)?]),
        _ => Ok(Vec::new()),
    }
}

/// A resume continues the checkpoint's run exactly: every key that shapes the trajectory
/// (seed, model, data, optimizer, schedule, precision, global batch…) must be the
/// checkpoint's; the run's length, logging, checkpointing and the split of the global batch
/// may change (the keys flagged resume-free, `config::resume_free_keys`).
fn check_resume_config(dir: &std::path::Path, state: &serde_json::Value, cfg: &crate::config::RunConfig) -> anyhow::Result<()> {
    let differences = match state.get("config").filter(|c| c.get("train_batch_size").is_some()) {
        Some(saved) => crate::config::resume_differences(saved, &crate::config::resolved_json(cfg)),
        // checkpoints that record the seed only
        None => match state.get("seed").and_then(serde_json::Value::as_u64) {
            Some(seed) if seed != cfg.train.seed => vec![format!("train.seed: checkpoint {seed}, now {}", cfg.train.seed)],
            _ => Vec::new(),
        },
    };
    if differences.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "--resume {}: this configuration differs from the checkpoint's, and a resume continues a run exactly:\n  {}\nset these back (e.g. `--config <run dir>/config.json`), or start a new run from the weights with --init {}/model.safetensors",
        dir.display(),
        differences.join("\n  "),
        dir.display()
    )
}

/// The GPU this process opens: `VITSCALE_DEVICE_INDEX` when set (`launch --one-gpu`), else its
/// local rank.
pub(crate) fn gpu_index(env: &crate::comm::DistEnv) -> anyhow::Result<usize> {
    match std::env::var(crate::comm::env::DEVICE_INDEX_VAR) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().map_err(|_| anyhow::anyhow!("{}={v:?}: expected a GPU index", crate::comm::env::DEVICE_INDEX_VAR)),
        _ => Ok(env.local_rank),
    }
}

/// `vitscale train`.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    // this process's place in the job (one process when no launcher variables are set);
    // the config resolves the DeepSpeed batch triple for that world size.
    let env = crate::comm::DistEnv::detect()?;
    let rank = env.rank;
    if args.resume.as_deref() == Some("latest") && args.run_dir.is_none() {
        anyhow::bail!("--resume latest needs --run-dir: the run directory whose checkpoints/ to continue from");
    }
    let run_dir = args.run_dir.clone().unwrap_or_else(|| default_run_dir(&env));
    let resume = args.resume.as_deref().map(|s| crate::train::checkpoint::resume_path(s, &run_dir.join("checkpoints")));
    // "not a checkpoint" would name the checkpoints folder, not what is wrong: the run has none
    let ckpt_root = run_dir.join("checkpoints");
    let no_checkpoints = !ckpt_root.join(crate::train::checkpoint::LATEST_FILE).exists() && crate::train::checkpoint::list(&ckpt_root).map_or(true, |l| l.is_empty());
    if args.resume.as_deref() == Some("latest") && no_checkpoints {
        anyhow::bail!(
            "--resume latest: there are no checkpoints in the run directory {} (no step directory in {}); a run writes them when train.checkpoint_every > 0",
            run_dir.display(),
            ckpt_root.display()
        );
    }
    // the checkpoint's state first: a resume keeps its global batch and must match its config
    let saved = resume.as_deref().map(crate::train::checkpoint::read_state).transpose()?;
    let mut cfg = load_config_edited(&args.common, args.init.as_deref(), env.world_size, |v| match &saved {
        Some((_, state)) => {
            // what the first command set for the run (its length, checkpoint interval…) holds
            // unless this one says otherwise
            let carried = state.get("config").map_or_else(Vec::new, |saved| crate::config::carry_over(v, saved));
            if rank == 0 && !carried.is_empty() {
                let shown: Vec<&str> = carried.iter().filter(|n| n.starts_with("train.")).map(String::as_str).collect();
                crate::errln!(
                    "notice: resuming with {} not given here taken from the checkpoint's run ({}{})",
                    crate::util::plural(carried.len(), "setting", "settings"),
                    shown.join(", "),
                    if shown.len() < carried.len() { ", …" } else { "" }
                );
            }
            keep_saved_global_batch(v, state, env.world_size)
        }
        None => Ok(Vec::new()),
    })?;
    if let Some((dir, state)) = &saved {
        check_resume_config(dir, state, &cfg)?;
    }
    // Everything the run will write is checked before it starts, so no result is lost at
    // the end to a bad path and no earlier run is written over.
    let my_dir = if rank == 0 { run_dir.clone() } else { run_dir.join(format!("rank{rank}")) };
    if resume.is_none() {
        crate::train::run_dir::check_fresh(&my_dir)?;
    }
    if let (0, Some(p)) = (rank, &args.save_weights) {
        check_output_file(p, "--save-weights")?;
    }
    if args.weights_format == crate::model::weights::WeightsFormat::Torchvision {
        crate::model::torchvision::check_exportable(&cfg.model).map_err(|e| anyhow::anyhow!("--weights-format torchvision: {e}"))?;
    }
    if let Some(d) = &args.trace {
        check_writable_dir(d, "--trace", d)?;
        crate::metrics::trace::check_fresh(d, rank).map_err(|e| anyhow::anyhow!("--trace {}: {e}", d.display()))?;
    }
    let device = open_device(args.common.device, gpu_index(&env)?, rank == 0, &cfg.precision)?;
    let decode_device = match &device {
        Device::Cuda(be) => crate::data::DecodeDevice::Gpu { engines: &|| be.jpeg_engines() },
        _ => crate::data::DecodeDevice::Cpu,
    };
    let (decode, warnings) = crate::data::resolve_decode(&cfg.data, decode_device)?;
    cfg.data.decode = decode;
    cfg.warnings.extend(warnings);
    cfg.warnings.extend(engine_warnings(&cfg, &device));
    let plan = plan_on(&cfg, &device);
    check_memory(&plan, &device, "this training run")?;
    let hash = config_hash(&cfg)?;
    // rendezvous and collective timeout: train.comm_timeout_s, or the VITSCALE_* variables.
    let comm_opts = crate::comm::CommOptions::from_config_and_env(cfg.train.comm_timeout_s)?;
    let opts = TrainOptions {
        // Rank 0 owns the run directory; the others log beside it.
        run_dir: my_dir,
        init: args.init.clone(),
        // every rank: rank 0 writes the file, but the others take part when the weights have
        // to be gathered first (ZeRO with a master shard)
        save_weights: args.save_weights.clone(),
        save_weights_format: args.weights_format,
        progress_bar: rank == 0 && std::io::stderr().is_terminal(),
        quiet: rank != 0,
        resume,
        keep_checkpoints: args.keep_checkpoints,
        trace: args.trace.clone(),
    };
    // SIGINT/SIGTERM from here on: finish the step on every rank, checkpoint it, exit
    // with 128 + signal (see train::stop and `cmd::exit_code`).
    let _stop_guard;
    let summary = match &device {
        Device::Cpu(be) => {
            let mut comm = crate::comm::init_cpu(&env, &comm_opts, &hash)?;
            _stop_guard = cfg.train.checkpoint_on_signal.then(crate::train::stop::StopGuard::install);
            Trainer::new(be, &cfg, plan, &opts, comm.as_mut())?.run()?
        }
        Device::Cuda(be) => {
            _stop_guard = cfg.train.checkpoint_on_signal.then(crate::train::stop::StopGuard::install);
            if env.world_size > 1 {
                let mut comm = crate::backend::cuda::nccl::NcclComm::connect(&env, &comm_opts, &hash, be)?;
                Trainer::new(be, &cfg, plan, &opts, &mut comm)?.run()?
            } else {
                Trainer::new(be, &cfg, plan, &opts, &mut SingleComm::new())?.run()?
            }
        }
    };
    if rank != 0 {
        return Ok(());
    }
    eprintln!(
        "done: val_top1 {:.4} val_loss {:.4} train_loss {:.4} | {} images in {:.1} s ({:.0} img/s) | run dir {}",
        summary.val_top1, summary.val_loss, summary.train_loss, summary.images, summary.wall_s, summary.images_per_s, summary.run_dir
    );
    if let Some(n) = summary.skipped.filter(|&n| n > 0) {
        eprintln!("warning: {n} unreadable image(s) were replaced by a neighbour (data.skip_bad); the count is in summary.json");
    }
    if args.common.json {
        crate::outln!("{}", serde_json::to_string(&summary)?);
    }
    Ok(())
}
