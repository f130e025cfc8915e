//! `vitscale train`: trains a ViT on this process's share of the job (one process, or one
//! rank under `vitscale launch`, torchrun or Slurm), writing the run directory on rank 0.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::Args;

use super::common::{config_hash, engine_warnings, load_config, open_device, ConfigArgs, Device};
use crate::comm::SingleComm;
use crate::train::engine::{self, TrainOptions};

/// Command-line options of `vitscale train`.
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

/// The GPU this process opens: `VITSCALE_DEVICE_INDEX` when set (`launch --one-gpu`), else its
/// local rank.
pub(crate) fn gpu_index(env: &crate::comm::DistEnv) -> anyhow::Result<usize> {
    match std::env::var(crate::launch::DEVICE_INDEX_VAR) {
        Ok(v) if !v.trim().is_empty() => v.trim().parse().map_err(|_| anyhow::anyhow!("{}={v:?}: expected a GPU index", crate::launch::DEVICE_INDEX_VAR)),
        _ => Ok(env.local_rank),
    }
}

/// `vitscale train`.
pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    // this process's place in the job (one process when no launcher variables are set);
    // the config resolves the DeepSpeed batch triple for that world size.
    let env = crate::comm::DistEnv::detect()?;
    let mut cfg = load_config(&args.common, args.init.as_deref(), env.world_size)?;
    let device = open_device(args.common.device, gpu_index(&env)?)?;
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
    // with 128 + signal (see train::stop and `cmd::exit_code`).
    let _stop_guard;
    let summary = match &device {
        Device::Cpu(be) => {
            let mut comm = crate::comm::init_cpu(&env, &comm_opts, &hash)?;
            _stop_guard = cfg.train.checkpoint_on_signal.then(crate::train::stop::StopGuard::install);
            engine::train_with(be, &cfg, &opts, comm.as_mut())?
        }
        Device::Cuda(be) => {
            _stop_guard = cfg.train.checkpoint_on_signal.then(crate::train::stop::StopGuard::install);
            if env.world_size > 1 {
                let mut comm = crate::backend::cuda::nccl::NcclComm::connect(&env, &comm_opts, &hash, be)?;
                engine::train_with(be, &cfg, &opts, &mut comm)?
            } else {
                engine::train_with(be, &cfg, &opts, &mut SingleComm::new())?
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
    if args.common.json {
        println!("{}", serde_json::to_string(&summary)?);
    }
    Ok(())
}
