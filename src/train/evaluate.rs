//! Evaluation: a model's loss and top-1 accuracy on every image of a split, shared by the ranks
//! of a job (each runs its own batches; the sums are reduced), and the model a run starts from
//! (`--init` weights or a seeded timm-style init).

use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use crate::backend::Backend;
use crate::comm::{Comm, SingleComm};
use crate::config::RunConfig;
use crate::data::{ImageSet, Loader};
use crate::model::{init, smoothed_targets, weights, Vit};
use crate::train::error::TrainError;
use crate::train::plan;

/// Result of evaluating a model on a split.
#[derive(Clone, Debug, Serialize)]
pub struct EvalSummary {
    pub loss: f64,
    pub top1: f64,
    pub images: usize,
}

/// Evaluates `vit` on every image of `set` (no augmentation, no smoothing).
pub fn evaluate<B: Backend>(be: &B, vit: &mut Vit<B>, set: &Arc<ImageSet>, cfg: &RunConfig, batch: usize) -> Result<EvalSummary, TrainError> {
    evaluate_with(be, vit, set, cfg, batch, &mut SingleComm::new())
}

/// `evaluate` shared by the ranks of `comm`: evaluation batch `i` (the same batches
/// as on one rank) is run by rank `i mod world`, and the loss sums and correct counts are
/// summed over ranks, so every rank gets the one-rank result up to the order of the f64 sum.
/// This rank's batches are built ahead by a `data::Loader` (`data.num_workers` threads,
/// `data.prefetch` batches ahead) while the model runs the current one; they are the batches
/// `data::try_make_batch` builds, so the result does not depend on either setting.
pub fn evaluate_with<B: Backend>(
    be: &B,
    vit: &mut Vit<B>,
    set: &Arc<ImageSet>,
    cfg: &RunConfig,
    batch: usize,
    comm: &mut dyn Comm<B::Buf>,
) -> Result<EvalSummary, TrainError> {
    // a sequence-parallel group runs the same batches (each rank its tokens of them)
    let sp = vit.sequence_parallel().map_or(1, |(_, size)| size);
    let loader = eval_loader(set, cfg, batch, comm.rank() / sp, comm.world_size() / sp)?;
    let rounds = eval_rounds(set.len(), cfg, batch, comm.world_size() / sp);
    evaluate_rounds(be, vit, set.len(), loader, rounds, comm)
}

/// The most batches any of `world` ranks runs in an evaluation of `n` images (`eval_loader`'s
/// split): rank 0's.
pub fn eval_rounds(n: usize, cfg: &RunConfig, batch: usize, world: usize) -> usize {
    let batch = batch.clamp(1, plan::pass_images_cap(cfg.train.pass_images));
    n.div_ceil(batch).div_ceil(world.max(1))
}

/// The loader of rank `rank`'s evaluation batches of `set` (batch `i` of the split is rank
/// `i mod world`'s), already building them. The batches do not depend on the model, so a
/// trainer starts it before the step after which it evaluates, and the first forward of the
/// evaluation does not wait for decoding.
pub fn eval_loader(set: &Arc<ImageSet>, cfg: &RunConfig, batch: usize, rank: usize, world: usize) -> Result<Loader, TrainError> {
    let n = set.len();
    let batch = batch.clamp(1, plan::pass_images_cap(cfg.train.pass_images));
    let batches: Vec<Vec<usize>> = (rank * batch..n).step_by(world * batch).map(|start| (start..(start + batch).min(n)).collect()).collect();
    Ok(Loader::start_batches(set.clone(), cfg.data.clone(), false, 0, cfg.train.seed, batches)?)
}

/// [`evaluate_with`] on the batches of `loader` (from [`eval_loader`] for this rank of `comm`,
/// over a split of `n` images). A model with partitioned weights (ZeRO-3) over several ranks
/// needs `evaluate_rounds`.
pub fn evaluate_from<B: Backend>(be: &B, vit: &mut Vit<B>, n: usize, loader: Loader, comm: &mut dyn Comm<B::Buf>) -> Result<EvalSummary, TrainError> {
    if vit.partitioned().is_some() && comm.world_size() > 1 {
        return Err(TrainError::Config("evaluating partitioned weights (ZeRO-3) over several ranks needs the most batches a rank runs: evaluate_rounds".into()));
    }
    evaluate_rounds(be, vit, n, loader, 0, comm)
}

/// [`evaluate_from`] where `rounds` is the most batches a rank runs (`eval_rounds`): under
/// ZeRO-3 a rank with fewer runs the rest of the forwards' weight gathers idle, so every
/// rank's gathers pair up.
pub fn evaluate_rounds<B: Backend>(be: &B, vit: &mut Vit<B>, n: usize, mut loader: Loader, rounds: usize, comm: &mut dyn Comm<B::Buf>) -> Result<EvalSummary, TrainError> {
    let k = vit.cfg.num_classes;
    let (mut loss_sum, mut correct) = (0.0f64, 0usize);
    let mut ran = 0;
    while let Some(prepared) = loader.next() {
        ran += 1;
        let batch_data = prepared?.batch;
        let b = batch_data.len();
        let targets = smoothed_targets(&batch_data.labels, k, 0.0);
        let out = match &batch_data.encoded {
            Some(enc) => {
                vit.stage_encoded_inputs(be, enc, 0..b, &targets, b)?;
                vit.forward_staged(be, b, None)?;
                vit.forward_out(be, b)?
            }
            None => vit.forward(be, &batch_data.images, &targets, b, None)?,
        };
        loss_sum += out.losses.iter().map(|&v| v as f64).sum::<f64>();
        for (row, &label) in out.logits.chunks(k).zip(&batch_data.labels) {
            // First maximal index, as torch.argmax.
            let pred = row.iter().enumerate().fold(0, |best, (j, v)| if *v > row[best] { j } else { best });
            correct += usize::from(pred == label as usize);
        }
        loader.recycle(batch_data);
    }
    if let Some(p) = vit.partitioned_mut() {
        p.idle_forwards(be, rounds.saturating_sub(ran))?;
        // (the evaluation's gathers are no step's traffic)
        p.take_gathered();
    }
    let mut sums = [loss_sum, correct as f64];
    // every rank of a sequence-parallel group computed the same losses: rank 0 of it counts them
    if vit.sequence_parallel().is_some_and(|(rank, _)| rank != 0) {
        sums = [0.0, 0.0];
    }
    comm.all_reduce_host(&mut sums)?;
    let (loss_sum, correct) = (sums[0], sums[1]);
    Ok(EvalSummary { loss: loss_sum / n.max(1) as f64, top1: correct / n.max(1) as f64, images: n })
}

/// Builds the model with the weights of `weights` exactly (evaluation), or a seeded timm-style
/// init without a file.
pub fn build_model<B: Backend>(be: &B, cfg: &RunConfig, weights_path: Option<&Path>) -> Result<Vit<B>, TrainError> {
    let mut vit = Vit::new(be, cfg.model.clone())?;
    vit.set_recompute(cfg.train.recompute);
    let host = match weights_path {
        Some(p) => weights::load(p, &vit.table)?,
        None => init::init_params(&vit.table, cfg.train.seed),
    };
    vit.set_params(be, &host)?;
    Ok(vit)
}

/// Builds the model a training run starts from: the seeded init, with the `--init` file's
/// weights over it. A file whose classifier head has another class count than the run keeps
/// the fresh head, as timm does when `num_classes` differs; a file saved for another patch
/// grid has its position embedding resampled to the run's, as timm does when `img_size`
/// differs. Each says so unless `quiet`.
pub fn build_model_for_training<B: Backend>(be: &B, cfg: &RunConfig, init_path: Option<&Path>, quiet: bool) -> Result<Vit<B>, TrainError> {
    let mut vit = Vit::new(be, cfg.model.clone())?;
    vit.set_recompute(cfg.train.recompute);
    let host = match init_path {
        Some(p) => {
            // the seeded init is made only for a head the file cannot give
            let (host, changes) = weights::load_for_fine_tuning(p, &vit.table, || init::init_params(&vit.table, cfg.train.seed))?;
            if let (Some(g), false) = (changes.pos_embed, quiet) {
                let (a, b) = (g.from, g.to);
                crate::errln!(
                    "notice: {}: pos_embed resampled from {a}×{a} to {b}×{b} patches for model.image_size {} (bicubic, antialiased, as timm's resample_abs_pos_embed; the class token's row kept)",
                    p.display(),
                    cfg.model.image_size
                );
            }
            if let (Some(h), false) = (changes.new_head, quiet) {
                crate::errln!(
                    "notice: {} has a head for {} classes and this run has {}: the head is initialized anew (seed {}), every other weight comes from the file",
                    p.display(),
                    h.file_classes,
                    h.model_classes,
                    cfg.train.seed
                );
            }
            host
        }
        None => init::init_params(&vit.table, cfg.train.seed),
    };
    vit.set_params(be, &host)?;
    Ok(vit)
}
