//! The command implementations behind `src/main.rs`: argument structs (clap) and what each
//! subcommand does. Every failure comes back as an error naming its source, never a panic.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use crate::backend::cpu::Cpu;
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
    if let Some(path) = weights_path {
        let inferred = weights::infer(path)?;
        let root = value.as_object_mut().ok_or_else(|| anyhow::anyhow!("the config must be a JSON object"))?;
        let model = root.entry("model").or_insert_with(|| serde_json::json!({}));
        let model = model.as_object_mut().ok_or_else(|| anyhow::anyhow!("`model` must be a JSON object"))?;
        if !model.contains_key("preset") {
            for (k, v) in inferred.fields {
                model.entry(k).or_insert(v);
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
    let mut cfg = config::resolve(&value, world_size)?;
    cfg.warnings.extend(notes);
    Ok(cfg)
}

/// Resolves `--device` to a backend and runs `f` with it.
fn check_device(device: DeviceArg) -> anyhow::Result<()> {
    match device {
        DeviceArg::Cpu | DeviceArg::Auto => Ok(()),
        DeviceArg::Cuda => anyhow::bail!("--device cuda: this build has no CUDA backend yet; use --device cpu"),
    }
}

fn default_run_dir() -> PathBuf {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    PathBuf::from("runs").join(format!("{secs}-{}", std::process::id()))
}

pub fn train_cmd(args: TrainArgs) -> anyhow::Result<()> {
    check_device(args.common.device)?;
    let cfg = load_config(&args.common, args.init.as_deref(), 1)?;
    let opts = TrainOptions {
        run_dir: args.run_dir.clone().unwrap_or_else(default_run_dir),
        init: args.init.clone(),
        save_weights: args.save_weights.clone(),
        progress_bar: std::io::stderr().is_terminal(),
        quiet: false,
    };
    let summary = engine::train(&Cpu::new(), &cfg, &opts)?;
    eprintln!(
        "done: val_top1 {:.4} val_loss {:.4} train_loss {:.4} | {} images in {:.1} s ({:.0} img/s) | run dir {}",
        summary.val_top1, summary.val_loss, summary.train_loss, summary.images, summary.wall_s, summary.images_per_s, summary.run_dir
    );
    if args.common.json {
        println!("{}", serde_json::to_string(&summary)?);
    }
    Ok(())
}

pub fn eval_cmd(args: EvalArgs) -> anyhow::Result<()> {
    check_device(args.common.device)?;
    let cfg = load_config(&args.common, Some(&args.weights), 1)?;
    for w in &cfg.warnings {
        eprintln!("warning: {w}");
    }
    let be = Cpu::new();
    let mut vit = engine::build_model(&be, &cfg, Some(&args.weights))?;
    let sets = crate::data::open(&cfg.data, cfg.model.image_size, cfg.model.num_classes, cfg.train.seed)?;
    let set = match args.split {
        SplitArg::Train => &sets.train,
        SplitArg::Val => &sets.val,
    };
    let ev = engine::evaluate(&be, &mut vit, set, &cfg, cfg.train.eval_batch_size)?;
    eprintln!("eval: loss {:.6} top1 {:.4} on {} images", ev.loss, ev.top1, ev.images);
    if args.common.json {
        println!("{}", serde_json::to_string(&ev)?);
    }
    Ok(())
}
