//! The training loop as an object: `Trainer::new` builds the run (run directory, data, model,
//! gradient sync, restored state), `Trainer::step` runs one optimizer step and everything due
//! after it, `Trainer::finish` checks the ranks agree, evaluates, saves and writes the summary.
//!
//! One step, top to bottom (`Trainer::step`):
//!
//! ```text
//! micro-batches  the GAS micro-batches this rank feeds, each as the plan's passes; the last
//!                one's backward hands finished buckets to the gradient sync (train::step)
//! boundary       the gradient sum across ranks, clipping on the device, the learning rate from
//!                the schedule, the optimizer update
//! stop flags     SIGINT / SIGTERM on any rank, agreed by every rank (train::stop)
//! losses         read back on logging steps and epoch ends only (each read waits for the device)
//! checkpoint     when due: the ranks compare their state hashes (train::agree), rank 0 writes
//! metrics line   on logging steps: the window's phases, images/s, communication, memory
//! evaluation     every `train.eval_every` steps or at epoch ends, and after the last step
//! ```
//!
//! Under sequence parallelism (`sequence_parallel_size` = SP) rank r is rank r mod SP of the
//! group r ÷ SP, which feeds the images of data-parallel slot r ÷ SP; the model runs each
//! image's tokens split over the group (`model::seq_parallel`, on a communicator of the group's
//! own), and the gradient sum over every rank is the unchanged data-parallel reduction.
//!
//! The batch split, passes and memory come from the run's one `Plan` (`train::plan`); the loader
//! (`data::Loader`) decodes, augments and mixes on its own threads, and the time a step waits
//! for it is `data_s`. A non-finite loss ends the run when it is read back.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::backend::{optimizer_state_len, Backend, ParamGroups, Span};
use crate::comm::{Comm, SingleComm, Wire};
use crate::config::RunConfig;
use crate::data::loader::Prepared;
use crate::data::{self, Batch, Datasets, ImageSet, Loader, LoaderPlan, MixTargets, Sampler};
use crate::metrics::monitor::Monitors;
use crate::metrics::trace::{Trace, Track};
use crate::metrics::{allreduce_bus_gb_s, EvalRecord, StepRecord};
use crate::model::smoothed_targets;
use crate::train::agree::{self, StateHash};
use crate::train::balance::Balancer;
use crate::train::error::TrainError;
use crate::train::ema::{self, Ema};
use crate::train::loss_scale::LossScaling;
use crate::train::evaluate::{build_model_for_training, eval_loader, eval_rounds, evaluate_rounds, evaluate_with, EvalSummary};
use crate::train::plan::Plan;
use crate::train::run_dir::RunDir;
use crate::train::step::{MicroBatch, Step};
use crate::train::sync::{gradient_wire, BucketPlan, BucketSync, GradSync};
use crate::train::timeline::{Phase, Timeline};
use crate::train::memory::{MemoryBytes, MemoryRecord};
use crate::train::zero::{AnySync, ZeroLayout, ZeroSync};
use crate::train::{checkpoint, schedule, stop};

/// Where a run writes, and what it loads/saves besides.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    pub run_dir: PathBuf,
    pub init: Option<PathBuf>,
    pub save_weights: Option<PathBuf>,
    /// Key names of the `save_weights` file.
    pub save_weights_format: crate::model::weights::WeightsFormat,
    /// Draw a progress bar (terminal) instead of plain periodic lines.
    pub progress_bar: bool,
    /// Print nothing but errors (the caller prints the summary).
    pub quiet: bool,
    // checkpoints: resume from this checkpoint (step dir, root or `latest` file), and
    // how many step directories `<run dir>/checkpoints` keeps (0 = all).
    pub resume: Option<PathBuf>,
    pub keep_checkpoints: usize,
    /// Write this rank's timeline (`trace-rank<r>.json`, Chrome trace format) into this folder.
    pub trace: Option<PathBuf>,
}

/// The result of a training run (`--json` prints it; `summary.json` holds it).
#[derive(Clone, Debug, Serialize)]
pub struct TrainSummary {
    pub val_top1: f64,
    pub val_loss: f64,
    /// The weight EMA's validation figures (`train.ema`), when the run keeps one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ema_val_top1: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ema_val_loss: Option<f64>,
    /// Mean training loss over the last epoch's steps (or the whole run if shorter).
    pub train_loss: f64,
    /// Training images processed, counted on the global batch.
    pub images: u64,
    pub steps: u64,
    pub wall_s: f64,
    pub images_per_s: f64,
    pub device: String,
    pub params: usize,
    pub run_dir: String,
    /// Hash of the final weights' exact f32 bits (`train::agree::hash_f32`, 16 hex digits):
    /// the same on every rank of a run, and equal between runs that end bitwise equal.
    pub weights_hash: String,
    /// Image files replaced by a neighbour because they could not be read (`data.skip_bad`,
    /// train and val together); present only when `data.skip_bad` is on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped: Option<usize>,
    /// fp16 runs: the final loss scale and the optimizer steps skipped for overflowing
    /// gradients (DeepSpeed's `skipped_steps`; `steps` counts them, as its `global_steps` does).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u64>,
}

/// Trains a model as `cfg` says on one rank (world size 1).
pub fn train<B: Backend>(be: &B, cfg: &RunConfig, opts: &TrainOptions) -> Result<TrainSummary, TrainError> {
    train_with(be, cfg, opts, &mut SingleComm::new())
}

/// Trains as this rank of `comm`'s world: every rank runs this same loop on its shard of each
/// global batch; gradients are summed across ranks at accumulation boundaries only.
pub fn train_with<B: Backend>(be: &B, cfg: &RunConfig, opts: &TrainOptions, comm: &mut dyn Comm<B::Buf>) -> Result<TrainSummary, TrainError> {
    Trainer::new(be, cfg, Plan::for_run(be, cfg), opts, comm)?.run()
}

/// How this rank's gradients travel: the bucket plan, its ZeRO shard (stages 1/2), the wire.
struct Gradients {
    buckets: BucketPlan,
    zero: Option<ZeroLayout>,
    wire: Wire,
    /// Buckets start while the backward runs (`zero_optimization.overlap_comm`); without it the
    /// boundary starts every bucket.
    overlap: bool,
    /// The run's clock origin, for the buckets' trace events.
    epoch: Instant,
}

impl Gradients {
    /// The sync of one step: gradients are summed over ranks once per step, bucket by bucket
    /// during the last micro-batch's backward (ZeRO-3: group by group during every pass's
    /// backward).
    fn begin<'c, Buf>(&'c self, comm: &'c mut dyn Comm<Buf>) -> AnySync<'c, Buf> {
        match &self.zero {
            Some(z) => {
                let mut s = ZeroSync::new(comm, &self.buckets, z, self.overlap, self.epoch);
                s.wire = self.wire;
                AnySync::Zero(s)
            }
            None => {
                let mut s = BucketSync::new(comm, &self.buckets, self.epoch);
                s.wire = self.wire;
                AnySync::Plain(s)
            }
        }
    }

    /// Elements of the optimizer-state buffer that are this rank's master weights.
    fn master_in_state(&self) -> usize {
        self.zero.as_ref().filter(|z| z.master_shard).map_or(0, |z| z.owned_len())
    }
}

/// This rank's stream of micro-batches: the loader, the next micro-batch taken while the
/// device still runs the current backward (its first pass possibly already on the device), and
/// where the backend decodes ahead (`Backend::decodes_ahead`), the one after it, whose first
/// pass is already being decoded.
struct Feed {
    loader: Loader,
    ahead: Option<Prepared>,
    decoding: Option<Prepared>,
    first_pass_staged: bool,
    num_classes: usize,
    label_smoothing: f32,
}

/// Mixup / CutMix soft targets of images `start..start + n` when the loader made them, else
/// smoothed one-hot labels.
fn soft_targets(batch: &Batch, start: usize, n: usize, k: usize, label_smoothing: f32) -> Vec<f32> {
    match &batch.targets {
        Some(t) => t[start * k..(start + n) * k].to_vec(),
        None => smoothed_targets(&batch.labels[start..start + n], k, label_smoothing),
    }
}

impl Feed {
    /// Micro-batch `m` of step `step` through every pass of the plan; `report`: the step's
    /// last micro-batch hands finished buckets to the sync. Unless this is the run's last
    /// micro-batch, the next one is taken and its first pass staged before returning.
    #[allow(clippy::too_many_arguments)]
    fn run_micro<B: Backend>(
        &mut self,
        be: &B,
        st: &mut Step<B>,
        bal: &mut Balancer,
        report: Option<&mut dyn GradSync<B>>,
        (step, m): (u64, usize),
        last_of_run: bool,
    ) -> Result<(), TrainError> {
        let prepared = match self.ahead.take() {
            Some(p) => p,
            None => self.wait_for_batch(st, (step, m))?,
        };
        let batch = prepared.batch;
        let (k, smoothing) = (self.num_classes, self.label_smoothing);
        let targets = |start: usize, n: usize| soft_targets(&batch, start, n, k, smoothing);
        let mb = MicroBatch { images: &batch.images, encoded: batch.encoded.as_ref(), b: batch.len(), targets: &targets, keys: &batch.keys };
        bal.before_micro(be, mb.b, step, st.trace.as_mut())?;
        st.micro_batch(be, &mb, step, std::mem::take(&mut self.first_pass_staged), report)?;
        bal.after_micro(be, mb.b, step, st.trace.as_mut())?;
        if !last_of_run && stop::pending() == 0 {
            self.take_ahead(be, st, batch.len())?;
        }
        self.loader.recycle(batch);
        Ok(())
    }

    /// The micro-batch being decoded ahead, else the loader's next (blocking on it: the host's
    /// data wait, on the device timeline part of `Data`).
    fn wait_for_batch<B: Backend>(&mut self, st: &mut Step<B>, (step, m): (u64, usize)) -> Result<Prepared, TrainError> {
        if let Some(p) = self.decoding.take() {
            return Ok(p);
        }
        let t_wait = Instant::now();
        let next = self.loader.next();
        if let Some(tr) = st.trace.as_mut() {
            tr.span(Track::Data, "data wait", t_wait, Instant::now(), serde_json::Map::new());
        }
        match next {
            Some(p) => Ok(p?),
            None => Err(TrainError::Config(format!("the data loader stopped before step {step}, micro-batch {m}"))),
        }
    }

    /// While the device runs this backward (the host only enqueued it), takes the next
    /// micro-batch and stages its first pass: a GPU then starts the next forward as soon as the
    /// optimizer is done instead of waiting for the host to convert and copy. The backward
    /// never reads the staged inputs; a pass never grows past the current one's last pass, so
    /// staging allocates nothing.
    /// Where the backend decodes ahead, the micro-batch after that one is taken too and its
    /// first pass starts decoding (the one taken before is handed out first, so the batches
    /// keep the loader's order).
    fn take_ahead<B: Backend>(&mut self, be: &B, st: &mut Step<B>, current_images: usize) -> Result<(), TrainError> {
        let next = match self.decoding.take() {
            Some(p) => p,
            None => match self.loader.next() {
                Some(p) => p?,
                None => return Ok(()),
            },
        };
        let widest_pass = st.plan.passes(current_images).last().map_or(0, |p| p.1);
        if next.batch.len().min(st.plan.pass_images) <= widest_pass {
            let (k, smoothing) = (self.num_classes, self.label_smoothing);
            let targets = |start: usize, n: usize| soft_targets(&next.batch, start, n, k, smoothing);
            let mb = MicroBatch { images: &next.batch.images, encoded: next.batch.encoded.as_ref(), b: next.batch.len(), targets: &targets, keys: &next.batch.keys };
            let t_stage = Instant::now();
            st.stage_ahead(be, &mb)?;
            if let Some(tr) = st.trace.as_mut() {
                let what = if mb.encoded.is_some() { "stage next batch (device decode)" } else { "stage next batch (copy)" };
                tr.span(Track::Data, what, t_stage, Instant::now(), serde_json::Map::new());
            }
            self.first_pass_staged = true;
        }
        if next.batch.encoded.is_some() && be.decodes_ahead()? {
            if let Some(after) = self.loader.next() {
                let after = after?;
                if let Some(enc) = after.batch.encoded.as_ref() {
                    let t_decode = Instant::now();
                    be.decode_ahead(enc, 0..after.batch.len().min(st.plan.pass_images))?;
                    if let Some(tr) = st.trace.as_mut() {
                        tr.span(Track::Data, "decode the batch after next (device)", t_decode, Instant::now(), serde_json::Map::new());
                    }
                }
                self.decoding = Some(after);
            }
        }
        st.mark(be, Phase::Data)?;
        self.ahead = Some(next);
        Ok(())
    }
}

/// Sums over the steps since the last metrics line (the phases are the timeline's, read when
/// the line is written).
struct Window {
    comm_bytes: u64,
    comm_total_s: f64,
    /// Seconds of the window's collectives as the device timed them, if it did.
    device_comm_total_s: Option<f64>,
    loss: f64,
    steps: u64,
    start: Instant,
    checkpoint_s: f64,
    eval_s: f64,
}

impl Window {
    fn new() -> Self {
        Window { comm_bytes: 0, comm_total_s: 0.0, device_comm_total_s: None, loss: 0.0, steps: 0, start: Instant::now(), checkpoint_s: 0.0, eval_s: 0.0 }
    }

    /// Time that is not training (evaluation, the state agreement, checkpoints): logged apart
    /// and left out of the window's images/s, as DeepSpeed's throughput timer leaves it out.
    fn exclude(&mut self, spent: std::time::Duration) {
        self.start += spent;
    }
}

/// The training loss over the current epoch, and the last finished epoch's mean.
struct EpochLoss {
    sum: f64,
    steps: u64,
    last_mean: f64,
}

/// Where a step stands in the run.
#[derive(Clone, Copy)]
struct StepAt {
    step: u64,
    epoch: u64,
    last: bool,
    epoch_end: bool,
}

/// One rank's training run, from its built state to its summary.
pub struct Trainer<'r, B: Backend> {
    be: &'r B,
    cfg: &'r RunConfig,
    opts: &'r TrainOptions,
    comm: &'r mut dyn Comm<B::Buf>,
    rank: usize,
    world: usize,
    /// The data-parallel slot this rank feeds and their number (rank ÷ SP, world ÷ SP).
    data_rank: usize,
    data_world: usize,
    /// Whether this rank reports its group's losses (rank 0 of its sequence-parallel group:
    /// every rank of a group computes the same ones).
    reports_losses: bool,
    run: RunDir,
    /// DeepSpeed's tensorboard / csv_monitor blocks: rank 0 writes them, as DeepSpeed does.
    monitors: Option<Monitors>,
    train_set: Arc<ImageSet>,
    val_set: Arc<ImageSet>,
    st: Step<B>,
    grads: Gradients,
    /// Mixed-speed ranks: this rank's emulated slowdown, the split of each global batch.
    bal: Balancer,
    feed: Feed,
    steps_per_epoch: u64,
    total_steps: u64,
    next_step: u64,
    window: Window,
    epoch_loss: EpochLoss,
    last_eval: Option<EvalSummary>,
    /// The weight EMA (`train.ema`) and its last evaluation.
    ema: Option<Ema<B>>,
    last_ema_eval: Option<EvalSummary>,
    /// The next evaluation's loader, started before the step it follows (its batches do not
    /// depend on the model), so the evaluation does not begin by waiting for decoding.
    eval_ahead: Option<Loader>,
    images_done: u64,
    /// This rank's state hashes after the last step, once the ranks agreed on them.
    final_hash: Option<StateHash>,
    bar: Option<indicatif::ProgressBar>,
    t_start: Instant,
    train_wall: Instant,
    /// Evaluation, state agreement and checkpoint time since `train_wall`: left out of the
    /// summary's images/s.
    not_training: std::time::Duration,
    /// The device's dense matrix rate (TFLOP/s), the MFU ceiling; None on the CPU.
    ceiling_tflops: Option<f64>,
}

/// The data a run reads, opened and checked against its global batch.
struct TrainData {
    train_set: Arc<ImageSet>,
    val_set: Arc<ImageSet>,
    sampler: Sampler,
    description: String,
    warnings: Vec<String>,
}

fn open_data(cfg: &RunConfig, plan: &Plan, run: &RunDir) -> Result<TrainData, TrainError> {
    let Datasets { train: train_set, val: val_set, description, class_names, warnings, .. } =
        data::open(&cfg.data, cfg.model.image_size, cfg.model.num_classes, cfg.train.seed)?;
    // an empty split would train nothing or report an accuracy of 0 of 0 images
    data::check_splits(&train_set, &val_set, &cfg.data)?;
    run.write_classes(&class_names)?;
    if train_set.len() < plan.global_batch {
        return Err(TrainError::Config(format!(
            "train_batch_size ({}) is larger than the training set ({} images in {description})",
            plan.global_batch,
            train_set.len()
        )));
    }
    let sampler = Sampler::new(train_set.len(), plan.global_batch, cfg.data.shuffle, cfg.train.seed, true);
    Ok(TrainData { train_set, val_set, sampler, description, warnings })
}

/// The model, its optimizer state (this rank's shard under ZeRO) and how its gradients travel.
fn build_step<B: Backend>(be: &B, cfg: &RunConfig, plan: &Plan, opts: &TrainOptions, (rank, world): (usize, usize), t_start: Instant) -> Result<(Step<B>, Gradients), TrainError> {
    let vit = build_model_for_training(be, cfg, opts.init.as_deref(), opts.quiet)?;
    let mut decay = ParamGroups::new(&vit.table, &cfg.train.weight_decay_skip);
    if let Some(ld) = cfg.layer_decay {
        decay = decay.with_layer_decay(&vit.table, ld);
    }
    // the gradient buckets, reduced while the step's last backward goes on; at stage 3 one
    // per parameter group, the unit its weights are partitioned and gathered by
    let buckets = match plan.zero.stage {
        3 => BucketPlan::new(&vit.gradient_groups(), 1, 1).map_err(TrainError::Config)?,
        _ => BucketPlan::new(&vit.gradient_groups(), plan.zero.first_bucket_elems, plan.zero.bucket_elems).map_err(TrainError::Config)?,
    };
    let zero = match plan.zero.stage {
        0 => None,
        // where the forward reads a compute copy, nobody needs the whole f32 weights
        s => Some(ZeroLayout::new(&buckets, &cfg.optimizer, s, world, rank, plan.zero.reduce_scatter)?)
            .map(|z| if plan.zero.master_shard { z.with_master_shard() } else { z }),
    };
    let state_len = zero.as_ref().map_or(optimizer_state_len(&cfg.optimizer, vit.table.total), |z| z.buffer_len());
    let mut st = Step::with_state_len(be, vit, cfg.optimizer.clone(), decay, cfg.gradient_clipping, plan.clone(), state_len)?;
    st.drop_path = crate::model::drop_path::DropPath::new(cfg.drop_path_rate, cfg.model.depth, cfg.train.seed);
    // a GPU before Ampere computes in fp16 without an fp16 block: DeepSpeed's default scaler
    st.loss_scaling = match be.implicit_fp16() {
        true => LossScaling::for_precision(&crate::config::fp16_defaults()),
        false => LossScaling::for_precision(&cfg.precision),
    };
    if opts.trace.is_some() {
        be.time_input_copies(true)?;
        st.trace = Some(Trace::new(rank, t_start));
    }
    // the bf16 wire and its scaling at stage 0, and at ZeRO stages on a GPU (NCCL
    // reduce-scatters a bf16 wire; CPU ranks' ring does not: fp32 there)
    let wire = if zero.is_none() || be.needs_compute_copy() { gradient_wire(&cfg.grad_comm, world) } else { Wire::PLAIN };
    Ok((st, Gradients { buckets, zero, wire, overlap: plan.zero.overlap_comm, epoch: t_start }))
}

/// ZeRO-3: `vit`'s whole weights handed over to this rank's partition (its pieces, the
/// resident groups), its gathers on a communicator of their own over every rank.
fn partition_weights<B: Backend>(be: &B, cfg: &RunConfig, z: &ZeroLayout, vit: &mut crate::model::Vit<B>, comm: &mut dyn Comm<B::Buf>, quiet: bool) -> Result<(), TrainError> {
    let s3 = cfg.zero3;
    let groups = vit.gradient_groups().len();
    let parts = z.partition_parts(groups)?;
    let largest = parts[1..groups - 1].iter().map(|g| g.span.len).filter(|&n| n > s3.param_persistence_threshold).max().unwrap_or(0);
    if largest > s3.max_live_parameters && !quiet {
        crate::errln!(
            "warning: zero_optimization.stage3_max_live_parameters = {} is below one block ({largest} elements): one block is gathered at a time",
            s3.max_live_parameters
        );
    }
    let prefetch = largest <= s3.prefetch_bucket_size && 2 * largest <= s3.max_live_parameters;
    let opts = crate::model::partition::GatherOptions { persistence_threshold: s3.param_persistence_threshold, prefetch };
    let gathers = comm.split_groups(comm.world_size())?;
    let part = crate::model::partition::Partition::new(be, &vit.table, parts, gathers, opts)?;
    vit.partition(be, part)?;
    Ok(())
}

/// What this rank holds, against what the plan predicts for its stage (the lab charts it).
fn memory_record<B: Backend>(be: &B, st: &Step<B>, grads: &Gradients, measured_peak: Option<u64>) -> MemoryRecord {
    let plan = &st.plan;
    MemoryRecord {
        stage: plan.zero.stage,
        world_size: plan.world_size,
        params: st.vit.table.total,
        accounted: MemoryBytes::account(be, &st.vit, &st.opt_state, grads.master_in_state()),
        // (a run's plan carries its estimate; a bare step shape's is the stage's rule alone)
        predicted: plan.memory.as_ref().map_or_else(
            || MemoryBytes::predict(st.vit.table.total, optimizer_state_len(&st.optimizer, 1), be.needs_compute_copy(), plan.zero.stage, plan.world_size),
            |e| e.state.clone(),
        ),
        measured_peak,
    }
}

/// Resumes from `--resume` when given, then makes every rank start from rank 0's exact state.
/// Returns the step to start from.
#[allow(clippy::too_many_arguments)]
fn restore<B: Backend>(
    be: &B,
    opts: &TrainOptions,
    plan: &Plan,
    st: &mut Step<B>,
    grads: &Gradients,
    comm: &mut dyn Comm<B::Buf>,
    run: &mut RunDir,
    total_steps: u64,
) -> Result<(u64, Option<Vec<f32>>), TrainError> {
    let mut start_step = 0u64;
    let mut ema = None;
    if let Some(spec) = &opts.resume {
        let r = checkpoint::restore(spec, &st.vit.table, &st.optimizer)?;
        let saved_batch = r.state.get("global_batch").and_then(|v| v.as_u64());
        if saved_batch != Some(plan.global_batch as u64) {
            let saved = saved_batch.map_or("records no global batch".to_string(), |b| format!("was trained with a global batch of {b} images"));
            return Err(TrainError::Config(format!(
                "{}: the checkpoint {saved}, this run has {}; a resumed run keeps its global batch (leave train_batch_size out, or set it to the checkpoint's)",
                r.dir.display(),
                plan.global_batch
            )));
        }
        // refused before anything is trained: a summary of no steps would replace the finished
        // run's
        if r.step >= total_steps {
            return Err(TrainError::Config(format!(
                "{} is at step {}, and this run has {total_steps} steps: nothing is left to train (raise train.steps or train.epochs to continue)",
                r.dir.display(),
                r.step
            )));
        }
        st.vit.set_params(be, &r.params)?;
        // checkpoints hold the whole state: a ZeRO rank keeps its shard of it
        match &grads.zero {
            Some(z) => be.upload(&mut st.opt_state, 0, &z.shard_state(&r.opt_state)?)?,
            None => be.upload(&mut st.opt_state, 0, &r.opt_state)?,
        }
        // the scaler continues where it stopped (a checkpoint without its state, written
        // before the scaler was saved, starts it afresh)
        if let (Some(ls), Some(saved)) = (st.loss_scaling.as_mut(), r.state.get("loss_scaling").filter(|v| !v.is_null())) {
            ls.restore(saved).map_err(|e| TrainError::Config(format!("{}: {e}", r.dir.display())))?;
        }
        start_step = r.step;
        ema = r.ema;
        run.log(&serde_json::json!({"kind": "resume", "step": start_step, "from": r.dir.display().to_string()}))?;
        if !opts.quiet {
            crate::errln!("resumed from {} at step {start_step}", r.dir.display());
        }
    }
    if comm.world_size() > 1 {
        let num_params = st.vit.table.total;
        comm.broadcast(&mut st.vit.params, Span { off: 0, len: num_params }, 0)?;
        st.vit.params_changed(be)?;
        // (a ZeRO rank's shard came from the file every rank read)
        if opts.resume.is_some() && grads.zero.is_none() {
            let olen = be.len(&st.opt_state);
            comm.broadcast(&mut st.opt_state, Span { off: 0, len: olen }, 0)?;
        }
    }
    Ok((start_step, ema))
}

/// The weight EMA of `train.ema`: the checkpoint's average when resuming from one that kept
/// it, else the weights the run starts from (every rank's, equal after `restore`). Made before
/// a master shard takes the whole weights over.
fn start_ema<B: Backend>(be: &B, cfg: &RunConfig, st: &Step<B>, grads: &Gradients, restored: Option<Vec<f32>>) -> Result<Option<Ema<B>>, TrainError> {
    let Some(ema_cfg) = &cfg.train.ema else { return Ok(None) };
    let start = match restored {
        Some(e) => e,
        None => st.vit.params_host(be)?,
    };
    Ok(Some(Ema::new(be, ema_cfg.clone(), &start, grads.zero.as_ref())?))
}

impl<'r, B: Backend> Trainer<'r, B> {
    /// Builds the run of `cfg` as this rank of `comm`'s world, `plan` being the run's plan
    /// (`Plan::for_run`): run directory, data, model and optimizer state, restored state, loader.
    pub fn new(be: &'r B, cfg: &'r RunConfig, plan: Plan, opts: &'r TrainOptions, comm: &'r mut dyn Comm<B::Buf>) -> Result<Self, TrainError> {
        let t_start = Instant::now();
        // the rank layout comes from the communicator; the plan was made for it.
        let (rank, world) = (comm.rank(), comm.world_size());
        if world != plan.world_size {
            return Err(TrainError::Config(format!("the config was resolved for {} ranks but the job has {world}", plan.world_size)));
        }
        let mut run = RunDir::open(&opts.run_dir, cfg, &plan, opts.resume.is_some(), opts.keep_checkpoints)?;
        let monitors = match rank {
            0 => Some(Monitors::open(&cfg.monitor, &opts.run_dir).map_err(|source| TrainError::RunDir { path: opts.run_dir.clone(), source })?),
            _ => None,
        };
        let data = open_data(cfg, &plan, &run)?;
        let steps_per_epoch = data.sampler.steps_per_epoch() as u64;
        let total_steps = cfg.train.steps.unwrap_or(cfg.train.epochs as u64 * steps_per_epoch);

        let (mut st, grads) = build_step(be, cfg, &plan, opts, (rank, world), t_start)?;
        // sequence parallelism: the group's communicator (every rank opens its group here)
        let sp = plan.sequence_parallel;
        if sp > 1 {
            let group = comm.split_groups(sp)?;
            st.vit.set_sequence_parallel(Some(crate::model::seq_parallel::SeqParallel::new(group)))?;
        }
        let (data_rank, data_world) = (rank / sp, world / sp);
        let (start_step, restored_ema) = restore(be, opts, &plan, &mut st, &grads, &mut *comm, &mut run, total_steps)?;
        let ema = start_ema(be, cfg, &st, &grads, restored_ema)?;
        // a master shard: this rank's pieces of rank 0's weights, then the whole copy goes
        if let Some(z) = &grads.zero {
            z.take_master(be, &mut st.vit, &mut st.opt_state)?;
            if z.stage == 3 {
                partition_weights(be, cfg, z, &mut st.vit, &mut *comm, opts.quiet)?;
            }
        }
        // what this rank holds once the weights are where they stay
        run.add_to_config("memory", &memory_record(be, &st, &grads, None))?;
        let bal = Balancer::new(cfg, &plan, data_rank, start_step, cfg.data.prefetch);
        if !opts.quiet {
            announce(be, cfg, &plan, &data, &bal, st.vit.table.total, total_steps);
        }
        let bar = (opts.progress_bar && !opts.quiet).then(|| progress_bar(total_steps));
        // measured before the first step, so its GEMMs are in no window
        let ceiling_tflops = be.matrix_ceiling_tflops()?;
        if timeline_enabled() {
            st.timeline = Some(Timeline::start(be, t_start)?);
        }
        let train_wall = Instant::now();
        // this rank's shard of every global batch from `start_step` on, built ahead.
        let loader = Loader::start_split(
            LoaderPlan {
                set: data.train_set.clone(),
                cfg: cfg.data.clone(),
                sampler: data.sampler.clone(),
                train: true,
                seed: cfg.train.seed,
                rank: data_rank,
                world: data_world,
                gas: plan.gradient_accumulation_steps,
                start_epoch: 0,
                start_step: start_step as usize,
                steps: total_steps.saturating_sub(start_step),
                mix: Some(MixTargets { num_classes: cfg.model.num_classes, label_smoothing: cfg.train.label_smoothing }),
            },
            bal.schedule.clone(),
        )?;
        let feed = Feed { loader, ahead: None, decoding: None, first_pass_staged: false, num_classes: cfg.model.num_classes, label_smoothing: cfg.train.label_smoothing };
        Ok(Trainer {
            be,
            cfg,
            opts,
            comm,
            rank,
            world,
            data_rank,
            data_world,
            reports_losses: rank % sp == 0,
            run,
            monitors,
            train_set: data.train_set,
            val_set: data.val_set,
            st,
            grads,
            bal,
            feed,
            steps_per_epoch,
            total_steps,
            next_step: start_step,
            window: Window::new(),
            epoch_loss: EpochLoss { sum: 0.0, steps: 0, last_mean: f64::NAN },
            last_eval: None,
            ema,
            last_ema_eval: None,
            eval_ahead: None,
            images_done: 0,
            final_hash: None,
            bar,
            t_start,
            train_wall,
            not_training: std::time::Duration::ZERO,
            ceiling_tflops,
        })
    }

    /// Every step left, then `finish`.
    pub fn run(mut self) -> Result<TrainSummary, TrainError> {
        while !self.done() {
            self.step()?;
        }
        self.finish()
    }

    /// Whether every step of the run has been taken.
    pub fn done(&self) -> bool {
        self.next_step >= self.total_steps
    }

    /// One optimizer step and what is due after it (see the module doc).
    pub fn step(&mut self) -> Result<(), TrainError> {
        let step = self.next_step;
        let at = StepAt {
            step,
            epoch: step / self.steps_per_epoch,
            last: step + 1 == self.total_steps,
            epoch_end: (step + 1) % self.steps_per_epoch == 0,
        };
        let log_due = (step + 1) % self.cfg.train.log_every.max(1) == 0 || at.last;
        if self.eval_due(at) && self.eval_ahead.is_none() {
            self.eval_ahead = Some(eval_loader(&self.val_set, self.cfg, self.cfg.train.eval_batch_size, self.data_rank, self.data_world)?);
        }
        let (grad_norm, lr) = self.micro_batches_and_boundary(at, log_due)?;
        self.bal.end_step(&mut *self.comm, step)?;
        let stop_sig = self.agree_on_stop()?;
        let log_now = log_due || stop_sig != 0;
        if log_now || at.epoch_end {
            self.read_losses()?;
        }
        self.window.steps += 1;
        self.epoch_loss.steps += 1;
        let saved = self.checkpoint_if_due(at, stop_sig)?;
        self.images_done += self.st.plan.global_batch as u64;
        if log_now {
            self.log_window(at, lr, grad_norm)?;
        }
        if let Some(pb) = &self.bar {
            pb.inc(1);
        }
        if stop_sig != 0 {
            return Err(self.stop_for_signal(at, stop_sig, saved)?);
        }
        // the step's bookkeeping ends here: an evaluation after it is timed apart
        self.st.mark(self.be, Phase::Other)?;
        self.evaluate_if_due(at)?;
        self.next_step += 1;
        Ok(())
    }

    /// The step's micro-batches, then the boundary: gradient sync, clipping on the device, the
    /// schedule's learning rate, the update. Returns the gradient norm (logging steps) and lr.
    fn micro_batches_and_boundary(&mut self, at: StepAt, log_due: bool) -> Result<(Option<f64>, f64), TrainError> {
        let Trainer { be, cfg, comm, grads, st, bal, feed, window, total_steps, ema, .. } = self;
        let be: &B = be;
        let mut sync = grads.begin(&mut **comm);
        let gas = st.plan.gradient_accumulation_steps;
        // ZeRO-3 reduces the gradients of every micro-batch (no rank keeps them whole)
        let every = GradSync::<B>::reduces_every_pass(&sync);
        for m in 0..gas {
            let last_micro = m + 1 == gas;
            let report: Option<&mut dyn GradSync<B>> = if (last_micro && grads.overlap) || every { Some(&mut sync) } else { None };
            feed.run_micro(be, st, bal, report, (at.step, m), at.last && last_micro)?;
        }
        let step = at.step;
        // DeepSpeed's scheduler does not advance on steps skipped for an fp16 overflow
        let scheduler_step = st.loss_scaling.as_ref().map_or(step, |ls| ls.applied(step));
        let skipped_before = st.loss_scaling.as_ref().map(|ls| ls.skipped_steps);
        let lr = schedule::lr_at(cfg.scheduler.as_ref(), cfg.optimizer.lr(), scheduler_step, *total_steps);
        let (grad_norm, bytes) = {
            let mut timed = bal.timed::<B>(&mut sync);
            let out = st.boundary(be, &mut timed, lr, step, log_due)?;
            bal.add_wait(timed.wait_s);
            out
        };
        // (a skipped step changed no weight: the average is left as it is too)
        let skipped = skipped_before != st.loss_scaling.as_ref().map(|ls| ls.skipped_steps);
        if let Some(e) = ema.as_mut().filter(|_| !skipped) {
            e.update(be, step + 1, &st.vit, &st.opt_state)?;
            st.mark(be, Phase::Optimizer)?;
        }
        window.comm_bytes += bytes;
        window.comm_total_s += sync.times().total_s;
        if let Some(tr) = st.trace.as_mut() {
            for e in sync.events() {
                let span = grads.buckets.buckets[e.bucket].span;
                let args = [("step".to_string(), serde_json::json!(step)), ("elements".to_string(), serde_json::json!(span.len))].into_iter().collect();
                tr.span_s(Track::Comm, format!("bucket {}", e.bucket), e.start_s, e.end_s, args);
            }
        }
        Ok((grad_norm, lr))
    }

    /// The stop flags (SIGINT/SIGTERM seen on any rank), agreed every step.
    fn agree_on_stop(&mut self) -> Result<i32, TrainError> {
        let mut sig = stop::pending();
        if self.world > 1 {
            let mut flags = stop::flags(sig);
            self.comm.all_reduce_host(&mut flags)?;
            sig = stop::agreed(sig, flags);
        }
        Ok(sig)
    }

    /// The losses of the steps since the last read, summed over ranks (one host synchronization).
    fn read_losses(&mut self) -> Result<(), TrainError> {
        let taken = self.st.take_losses(self.be)?;
        let mut sums: Vec<f64> = taken.iter().map(|&(_, v)| if self.reports_losses { v } else { 0.0 }).collect();
        if self.world > 1 {
            self.comm.all_reduce_host(&mut sums)?;
        }
        // a device transport timed its collectives with events: their total replaces the
        // host's view of them, which on a GPU only sees the enqueueing (what the step waited for
        // is the timeline's `CommExposed`)
        let copies = self.be.take_input_copies(self.t_start)?;
        if let Some(tr) = self.st.trace.as_mut() {
            for (what, start_s, end_s) in copies {
                tr.span_s(Track::DeviceCopy, what, start_s, end_s, serde_json::Map::new());
            }
        }
        if let Some(timing) = self.comm.take_device_timing(self.t_start)? {
            *self.window.device_comm_total_s.get_or_insert(0.0) += timing.total_s;
            if let Some(tr) = self.st.trace.as_mut() {
                for (what, start_s, end_s) in timing.spans {
                    tr.span_s(Track::DeviceComm, what, start_s, end_s, serde_json::Map::new());
                }
            }
        }
        for (&(s, _), sum) in taken.iter().zip(sums) {
            let loss = sum / self.st.plan.global_batch as f64;
            if !loss.is_finite() {
                return Err(TrainError::Diverged { step: s, loss });
            }
            self.window.loss += loss;
            self.epoch_loss.sum += loss;
        }
        Ok(())
    }

    /// The whole f32 weights (a collective when ZeRO shards the master weights).
    fn full_params(&mut self) -> Result<Vec<f32>, TrainError> {
        match &self.grads.zero {
            Some(z) if z.master_shard => z.gather_master(self.be, &mut *self.comm, &self.st.opt_state),
            Some(z) if z.stage == 3 => {
                let part = self.st.vit.partitioned().ok_or_else(|| TrainError::Config("ZeRO stage 3 without partitioned weights".into()))?;
                let owned = self.be.download(&part.owned)?;
                z.gather_owned(self.be, &mut *self.comm, &owned[..z.owned_len()])
            }
            _ => Ok(self.st.vit.params_host(self.be)?),
        }
    }

    /// The whole optimizer state (a collective under ZeRO: every rank gathers the shards).
    fn full_optimizer_state(&mut self) -> Result<Vec<f32>, TrainError> {
        match &self.grads.zero {
            Some(z) => z.gather_state(self.be, &mut *self.comm, &self.st.opt_state),
            None => Ok(self.be.download(&self.st.opt_state)?),
        }
    }

    /// Both, in the order every rank gathers them.
    fn full_state(&mut self) -> Result<(Vec<f32>, Vec<f32>), TrainError> {
        Ok((self.full_params()?, self.full_optimizer_state()?))
    }

    /// Checkpoints when due (rank 0 writes, for every rank), also when stopping for a signal.
    /// Every rank knows whether one is due (the stop flag is agreed), so all of them first
    /// check that they hold the same state, as they do after the last step. Returns the
    /// checkpoint written, if this rank wrote one.
    fn checkpoint_if_due(&mut self, at: StepAt, stop_sig: i32) -> Result<Option<PathBuf>, TrainError> {
        let (be, step) = (self.be, at.step);
        let every = self.cfg.train.checkpoint_every;
        let stop_ckpt = stop_sig != 0 && self.cfg.train.checkpoint_on_signal;
        let want_ckpt = stop_ckpt || (every > 0 && ((step + 1) % every == 0 || at.last));
        let agree_now = at.last || (want_ckpt && self.world > 1);
        let writes = self.rank == 0 && want_ckpt;
        if !agree_now && !writes {
            return Ok(None);
        }
        // The state agreement and the checkpoint write are not training: their time leaves the
        // window's images/s (as DeepSpeed's throughput excludes checkpoints) and is logged as
        // `checkpoint_s`. The device finishes the step first, so its work stays in the step.
        self.st.mark(be, Phase::Other)?;
        be.synchronize()?;
        let t_checkpoint = Instant::now();
        let mut host_state = None;
        if agree_now {
            let (p, o) = self.full_state()?;
            let h = agree::check(&mut *self.comm, step + 1, &p, &o)?;
            if at.last {
                self.final_hash = Some(h);
            }
            host_state = Some((p, o));
        }
        // the average travels with the state: the writer's copy, gathered by every rank under
        // a master shard (every rank knows a checkpoint is due)
        let ema = match &self.ema {
            Some(e) if want_ckpt && (writes || e.is_sharded()) => Some(e.full(be, &mut *self.comm, self.grads.zero.as_ref())?),
            _ => None,
        };
        let mut saved = None;
        if writes {
            let (p, o) = match host_state.take() {
                Some(state) => state,
                // one rank (more ranks agreed above): nothing to gather from others
                None => self.full_state()?,
            };
            let state = self.checkpoint_state(step);
            saved = Some(self.run.checkpoint(step + 1, &self.st.vit.table, &p, self.cfg, &o, ema.as_deref(), &state)?);
        }
        // freeing the host copies of the state (a GiB for ViT-B) is part of this work too
        drop(host_state);
        self.st.mark(be, Phase::NotTraining)?;
        let spent = t_checkpoint.elapsed();
        self.window.checkpoint_s += spent.as_secs_f64();
        self.window.exclude(spent);
        self.not_training += spent;
        Ok(saved)
    }

    /// The `state.json` of a checkpoint after step `step` (0-based): where to resume and what
    /// the resumed run must keep.
    fn checkpoint_state(&self, step: u64) -> serde_json::Value {
        serde_json::json!({
            "step": step + 1,
            "epoch": (step + 1) / self.steps_per_epoch,
            "step_in_epoch": (step + 1) % self.steps_per_epoch,
            "scheduler_step": self.st.loss_scaling.as_ref().map_or(step + 1, |ls| ls.applied(step + 1)),
            "loss_scaling": self.st.loss_scaling.as_ref().map(LossScaling::to_json),
            "global_batch": self.st.plan.global_batch,
            "world_size": self.world,
            "zero_stage": self.st.plan.zero.stage,
            "seed": self.cfg.train.seed,
            "config": crate::config::resolved_json(self.cfg),
        })
    }

    /// The window's metrics line (`metrics.jsonl`, the monitors, the breakdown and progress
    /// output), then a new window. The phases are the timeline's (read here, the one wait for
    /// the device this adds to a logging step, which has already waited for its losses).
    fn log_window(&mut self, at: StepAt, lr: f64, grad_norm: Option<f64>) -> Result<(), TrainError> {
        let (world, global_batch) = (self.world, self.st.plan.global_batch);
        self.st.mark(self.be, Phase::Other)?;
        let device = match self.st.timeline.as_mut() {
            Some(tl) => Some(tl.read(self.be)?),
            None => None,
        };
        let w = &mut self.window;
        let train_s = w.start.elapsed().as_secs_f64();
        if let Some(total) = w.device_comm_total_s.take() {
            w.comm_total_s = total;
        }
        let ips = (w.steps * global_batch as u64) as f64 / train_s.max(1e-9);
        let phases = device.as_ref().map(|d| d.phases).unwrap_or_default();
        let (peak_mem_bytes, peak_mem_source) = crate::metrics::peak_memory(self.be);
        let rec = StepRecord {
            step: at.step + 1,
            epoch: at.epoch,
            lr,
            loss: w.loss / w.steps as f64,
            // a stop between logging steps reads no norm (it would cost a synchronization)
            grad_norm: grad_norm.unwrap_or(f64::NAN),
            images_per_s: ips,
            images_per_s_per_rank: ips / world as f64,
            // bench's definition: the model's training FLOPs per image against the measured
            // dense matrix rate, per device (rank)
            mfu: self.ceiling_tflops.map(|c| ips / world as f64 * self.cfg.model.train_flops_per_image() / (c * 1e12)),
            phases,
            other_s: device.as_ref().map_or(0.0, |d| d.other_s),
            timed_s: device.as_ref().map(|d| d.step_s),
            train_s,
            steps: w.steps,
            rank: self.rank,
            comm_total_s: w.comm_total_s,
            comm_overlap: (world > 1 && w.comm_total_s > 0.0).then(|| (1.0 - phases.comm_s / w.comm_total_s).clamp(0.0, 1.0)),
            comm_bytes: w.comm_bytes,
            bus_gb_s: allreduce_bus_gb_s(w.comm_bytes, world, w.comm_total_s),
            peak_mem_bytes,
            peak_mem_source,
            checkpoint_s: std::mem::take(&mut w.checkpoint_s),
            eval_s: std::mem::take(&mut w.eval_s),
            wall_s: self.t_start.elapsed().as_secs_f64(),
            balance: self.bal.take_record(),
            loss_scale: self.st.loss_scaling.as_ref().map(LossScaling::scale),
            skipped_steps: self.st.loss_scaling.as_ref().map(|ls| ls.skipped_steps),
        };
        let steps = w.steps;
        self.window = Window::new();
        self.run.log(&rec)?;
        if let (Some(tr), Some(d)) = (self.st.trace.as_mut(), &device) {
            for &(phase, start_s, end_s) in &d.spans {
                tr.span_s(Track::Device, phase.name(), start_s, end_s, serde_json::Map::new());
            }
        }
        if let Some(m) = self.monitors.as_mut() {
            m.step(&rec, steps, self.images_done).map_err(|source| TrainError::RunDir { path: self.opts.run_dir.clone(), source })?;
        }
        if self.cfg.monitor.wall_clock_breakdown && !self.opts.quiet {
            // DeepSpeed's breakdown line, from the same phases as the metrics line
            let per = |s: f64| s * 1e3 / steps.max(1) as f64;
            let line = format!(
                "time (ms) per step | data: {:.2} | forward: {:.2} | backward: {:.2} | allreduce exposed: {:.2} | allreduce total: {:.2} | optimizer: {:.2} | other: {:.2} | step: {:.2}",
                per(phases.data_s), per(phases.forward_s), per(phases.backward_s), per(phases.comm_s), per(rec.comm_total_s), per(phases.optimizer_s), per(rec.other_s), per(train_s)
            );
            self.print(line);
        }
        let msg = format!("epoch {} loss {:.4} lr {lr:.2e} {ips:.0} img/s", at.epoch, rec.loss);
        match &self.bar {
            Some(pb) => pb.set_message(msg),
            None if !self.opts.quiet => crate::errln!("step {}/{} {msg}", at.step + 1, self.total_steps),
            None => {}
        }
        Ok(())
    }

    /// A line above the progress bar, or on stderr.
    fn print(&self, line: String) {
        match &self.bar {
            Some(pb) => pb.println(line),
            None => crate::errln!("{line}"),
        }
    }

    /// Stops for a signal: every rank agreed on this step; the others wait until rank 0's
    /// checkpoint is on disk, then all end with the error that exits 128 + signal.
    fn stop_for_signal(&mut self, at: StepAt, signal: i32, saved: Option<PathBuf>) -> Result<TrainError, TrainError> {
        if let Some(pb) = &self.bar {
            pb.abandon();
        }
        if self.world > 1 {
            self.comm.barrier()?;
        }
        let detail = match (&saved, self.cfg.train.checkpoint_on_signal) {
            (Some(dir), _) => format!("checkpoint {} written; continue with --resume latest --run-dir {}", dir.display(), self.opts.run_dir.display()),
            (None, true) => "rank 0 wrote the checkpoint".to_string(),
            (None, false) => "no checkpoint written (train.checkpoint_on_signal is false)".to_string(),
        };
        Ok(TrainError::Interrupted { signal, step: at.step + 1, detail })
    }

    /// Whether an evaluation follows step `at`: every `train.eval_every` steps, or at each epoch
    /// end, and after the last step.
    fn eval_due(&self, at: StepAt) -> bool {
        let every = self.cfg.train.eval_every;
        let due = if every > 0 { (at.step + 1) % every == 0 } else { at.epoch_end };
        due || at.last
    }

    /// The evaluation after step `at`, when [`Self::eval_due`].
    fn evaluate_if_due(&mut self, at: StepAt) -> Result<(), TrainError> {
        if at.epoch_end || at.last {
            self.epoch_loss.last_mean = self.epoch_loss.sum / self.epoch_loss.steps.max(1) as f64;
            (self.epoch_loss.sum, self.epoch_loss.steps) = (0.0, 0);
        }
        if !self.eval_due(at) {
            return Ok(());
        }
        // the step's queued device work finishes first, so it stays in the step's time
        self.st.mark(self.be, Phase::Other)?;
        self.be.synchronize()?;
        let t_eval = Instant::now();
        let loader = match self.eval_ahead.take() {
            Some(l) => l,
            None => eval_loader(&self.val_set, self.cfg, self.cfg.train.eval_batch_size, self.data_rank, self.data_world)?,
        };
        let rounds = eval_rounds(self.val_set.len(), self.cfg, self.cfg.train.eval_batch_size, self.data_world);
        let ev = evaluate_rounds(self.be, &mut self.st.vit, self.val_set.len(), loader, rounds, &mut *self.comm)?;
        let ema_ev = self.evaluate_ema()?;
        self.st.mark(self.be, Phase::NotTraining)?;
        let spent = t_eval.elapsed();
        self.window.eval_s += spent.as_secs_f64();
        self.window.exclude(spent);
        self.not_training += spent;
        let rec = EvalRecord {
            kind: "eval",
            step: at.step + 1,
            epoch: at.epoch,
            val_loss: ev.loss,
            val_top1: ev.top1,
            images: ev.images,
            ema_val_loss: ema_ev.as_ref().map(|e| e.loss),
            ema_val_top1: ema_ev.as_ref().map(|e| e.top1),
        };
        self.run.log(&rec)?;
        if !self.opts.quiet {
            let ema_part = ema_ev.as_ref().map_or(String::new(), |e| format!(" | ema val_loss {:.4} val_top1 {:.4}", e.loss, e.top1));
            self.print(format!("eval after step {}: val_loss {:.4} val_top1 {:.4}{ema_part}", at.step + 1, ev.loss, ev.top1));
        }
        self.last_eval = Some(ev);
        self.last_ema_eval = ema_ev;
        Ok(())
    }

    /// The weight EMA on the validation split (None without one): its pieces gathered and
    /// loaded into a model of its own, so the training model is untouched. Every rank takes part.
    fn evaluate_ema(&mut self) -> Result<Option<EvalSummary>, TrainError> {
        let Some(ema) = &self.ema else { return Ok(None) };
        let weights = ema.full(self.be, &mut *self.comm, self.grads.zero.as_ref())?;
        let mut vit = crate::model::Vit::new_for_inference(self.be, self.cfg.model.clone())?;
        vit.set_recompute(self.cfg.train.recompute);
        vit.set_params(self.be, &weights)?;
        Ok(Some(evaluate_with(self.be, &mut vit, &self.val_set, self.cfg, self.cfg.train.eval_batch_size, &mut *self.comm)?))
    }

    /// After the last step: the ranks' agreement (a run resumed at its last step trains none,
    /// so its ranks compare the restored state here), the memory record, the final
    /// evaluation, the saved weights, the summary and the trace.
    pub fn finish(mut self) -> Result<TrainSummary, TrainError> {
        if let Some(pb) = &self.bar {
            pb.finish_and_clear();
        }
        let train_secs = self.train_wall.elapsed().saturating_sub(self.not_training).as_secs_f64();
        let be = self.be;
        let final_hash = match self.final_hash {
            Some(h) => h,
            None => {
                let (p, o) = self.full_state()?;
                agree::check(&mut *self.comm, self.total_steps, &p, &o)?
            }
        };
        let mut mem = serde_json::to_value(memory_record(be, &self.st, &self.grads, be.peak_bytes())).map_err(|e| TrainError::Config(e.to_string()))?;
        mem["kind"] = "memory".into();
        self.run.log(&mem)?;
        let ev = match self.last_eval.take() {
            Some(ev) => ev,
            None => evaluate_with(be, &mut self.st.vit, &self.val_set, self.cfg, self.cfg.train.eval_batch_size, &mut *self.comm)?,
        };
        let ema_ev = match self.last_ema_eval.take() {
            Some(e) => Some(e),
            None => self.evaluate_ema()?,
        };
        // one file for the job, from rank 0, now that every rank is known to hold these
        // weights (every rank is given the same --save-weights: all take part in a gather)
        if let Some(path) = self.opts.save_weights.clone() {
            let p = self.full_params()?;
            // rank 0 writes it; every rank takes part where gathering it is a collective
            let ema = match &self.ema {
                Some(e) if self.rank == 0 || e.is_sharded() => Some(e.full(be, &mut *self.comm, self.grads.zero.as_ref())?),
                _ => None,
            };
            if self.rank == 0 {
                let format = self.opts.save_weights_format;
                crate::model::weights::save_as(&path, &self.st.vit.table, &self.st.vit.cfg, &p, format)?;
                if let Some(e) = ema {
                    crate::model::weights::save_as(&ema::weights_path(&path), &self.st.vit.table, &self.st.vit.cfg, &e, format)?;
                }
            }
        }
        let summary = TrainSummary {
            val_top1: ev.top1,
            val_loss: ev.loss,
            ema_val_top1: ema_ev.as_ref().map(|e| e.top1),
            ema_val_loss: ema_ev.as_ref().map(|e| e.loss),
            train_loss: self.epoch_loss.last_mean,
            images: self.images_done,
            steps: self.total_steps,
            wall_s: self.t_start.elapsed().as_secs_f64(),
            images_per_s: self.images_done as f64 / train_secs.max(1e-9),
            device: be.name(),
            params: self.st.vit.table.total,
            run_dir: self.opts.run_dir.display().to_string(),
            weights_hash: final_hash.weights_hex(),
            skipped: self.cfg.data.skip_bad.then(|| {
                use std::sync::atomic::Ordering::Relaxed;
                self.train_set.skipped.load(Relaxed) + self.val_set.skipped.load(Relaxed)
            }),
            loss_scale: self.st.loss_scaling.as_ref().map(LossScaling::scale),
            skipped_steps: self.st.loss_scaling.as_ref().map(|ls| ls.skipped_steps),
        };
        self.run.write_summary(&summary)?;
        if let (Some(dir), Some(tr)) = (&self.opts.trace, &self.st.trace) {
            tr.write(dir).map_err(|source| TrainError::RunDir { path: dir.clone(), source })?;
        }
        Ok(summary)
    }
}

/// Whether the step's phases are timed on the device timeline: always, except when
/// `VITSCALE_TIMELINE=off` (to measure what the timing itself costs).
fn timeline_enabled() -> bool {
    std::env::var("VITSCALE_TIMELINE").map_or(true, |v| v.trim() != "off")
}

/// The run's opening lines: device, model, data, length and batch split, warnings, balance.
fn announce<B: Backend>(be: &B, cfg: &RunConfig, plan: &Plan, data: &TrainData, bal: &Balancer, num_params: usize, total_steps: u64) {
    crate::errln!(
        "vitscale: {} | model {num_params} params | data {} | {} of {} images ({} × {} GAS × {})",
        be.name(),
        data.description,
        crate::util::plural(total_steps as usize, "step", "steps"),
        plan.global_batch,
        plan.micro_batch,
        plan.gradient_accumulation_steps,
        crate::util::plural(plan.world_size, "rank", "ranks")
    );
    // the run's length is known here (epochs × steps per epoch): a warm-up it never leaves
    let warmup = crate::train::schedule::warmup_warning(cfg.scheduler.as_ref(), cfg.optimizer.lr(), total_steps);
    for w in cfg.warnings.iter().chain(&data.warnings).chain(&warmup) {
        crate::errln!("warning: {w}");
    }
    if let Some(line) = bal.describe() {
        crate::errln!("{line}");
    }
}

fn progress_bar(total_steps: u64) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(total_steps);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps | {msg} | ETA {eta}").unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    pb
}
