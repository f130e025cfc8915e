//! `vitscale eval`: loss and top-1 accuracy of a weights file on a dataset split.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use super::common::{check_memory, engine_warnings, load_config_edited, open_device, plan_on, ConfigArgs, Device};
use crate::backend::Backend;
use crate::config::RunConfig;
use crate::train::evaluate;

/// Command-line options of `vitscale eval`.
#[derive(Args, Debug)]
pub struct EvalArgs {
    #[command(flatten)]
    pub common: ConfigArgs,
    /// Weights to evaluate (safetensors, timm's or torchvision's key names).
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

fn evaluate_weights<B: Backend>(be: &B, cfg: &RunConfig, weights: &Path, set: &std::sync::Arc<crate::data::ImageSet>) -> anyhow::Result<evaluate::EvalSummary> {
    let mut vit = evaluate::build_model(be, cfg, Some(weights))?;
    Ok(evaluate::evaluate(be, &mut vit, set, cfg, cfg.train.eval_batch_size)?)
}

/// `vitscale eval`.
pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    // one process runs whole images: a training run's sequence_parallel_size does not apply
    let mut cfg = load_config_edited(&args.common, Some(&args.weights), 1, |v| {
        let dropped = v.as_object_mut().and_then(|o| o.remove("sequence_parallel_size"));
        Ok(dropped.filter(|d| d.as_u64() != Some(1)).map(|d| format!("sequence_parallel_size = {d} ignored: evaluation runs whole images in one process")).into_iter().collect())
    })?;
    let device = open_device(args.common.device, 0, true, &cfg.precision)?;
    cfg.warnings.extend(engine_warnings(&cfg, &device));
    check_memory(&plan_on(&cfg, &device), &device, "this evaluation")?;
    for w in &cfg.warnings {
        eprintln!("warning: {w}");
    }
    let sets = crate::data::open(&cfg.data, cfg.model.image_size, cfg.model.num_classes, cfg.train.seed)?;
    for w in &sets.warnings {
        eprintln!("warning: {w}");
    }
    let set = match args.split {
        SplitArg::Train => &sets.train,
        SplitArg::Val => &sets.val,
    };
    // an empty split would report a top-1 of 0 of 0 images
    if set.len() == 0 {
        anyhow::bail!("{}: the {:?} split has no images, nothing to evaluate", cfg.data.dataset.as_str(), args.split);
    }
    let ev = match &device {
        Device::Cpu(be) => evaluate_weights(be, &cfg, &args.weights, set)?,
        Device::Cuda(be) => evaluate_weights(be, &cfg, &args.weights, set)?,
    };
    eprintln!("eval: loss {:.6} top1 {:.4} on {} images", ev.loss, ev.top1, ev.images);
    if args.common.json {
        crate::outln!("{}", serde_json::to_string(&ev)?);
    }
    Ok(())
}
