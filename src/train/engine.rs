//! The training loop, readable top to bottom. Each optimizer step is `train::step::Step`'s:
//! the GAS micro-batches this rank feeds (taken from the prefetching `data::Loader`, which
//! decodes, augments, normalizes and mixes on its own threads; the time spent *waiting* for it
//! is `data_s`), each run as the plan's passes, then the boundary: the gradient sum across
//! ranks, clipping on the device, the learning rate from the schedule, the optimizer update.
//! Around it: the stop flags agreed every step (a SIGINT / SIGTERM caught by `train::stop`
//! is acted on at a step every rank agrees on: checkpoint, then stop), the losses and the
//! gradient norm read back on logging steps (`train.log_every`) and epoch ends only,
//! evaluation, metrics lines and progress output; the run directory's files are written
//! through `train::run_dir`. After the last step, and before each checkpoint of a multi-rank
//! run, the ranks compare hashes of their weights and optimizer state (`train::agree`) and
//! all fail if any differs. A non-finite loss ends the run when it is read back.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::backend::{optimizer_state_len, Backend, DecayGroups, Span};
use crate::comm::{Comm, CommError, SingleComm};
use crate::config::RunConfig;
use crate::data::{self, Datasets, ImageSet, Loader, LoaderPlan, MixTargets, Sampler};
use crate::metrics::monitor::Monitors;
use crate::metrics::{allreduce_bus_gb_s, EvalRecord, PhaseTimes, StepRecord};
use crate::model::{init, smoothed_targets, weights, Vit};
use crate::train::plan::{self, Plan};
use crate::train::run_dir::RunDir;
use crate::metrics::trace::{Trace, Track};
use crate::train::step::{GradSync, MicroBatch, Step};
use crate::train::sync::{gradient_wire, BucketPlan, BucketSync, DEFAULT_BUCKET_ELEMS, FIRST_BUCKET_ELEMS};
use crate::train::zero::{AnySync, MemoryBytes, MemoryRecord, ZeroLayout, ZeroSync};
use crate::train::balance::Balancer;
use crate::train::{agree, checkpoint, schedule, stop};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    #[error(transparent)]
    Weights(#[from] crate::model::weights::WeightsError),
    #[error("run directory {path}: {source}")]
    RunDir { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Config(String),
    #[error("training diverged at step {step}: loss is {loss}")]
    Diverged { step: u64, loss: f64 },
    // collectives and checkpoints
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// The ranks' weights or optimizer state differ (see `train::agree`).
    #[error(transparent)]
    RanksDiverged(#[from] agree::Divergence),
    /// SIGINT / SIGTERM acted on at a step boundary (see `train::stop`).
    #[error("stopped by {} after step {step}: {detail}", stop::signal_name(*signal))]
    Interrupted { signal: i32, step: u64, detail: String },
}

impl TrainError {
    /// The process exit status this error calls for: 128 + signal for a graceful stop (130
    /// SIGINT, 143 SIGTERM, as shells report them), else 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            TrainError::Interrupted { signal, .. } => 128 + signal,
            _ => 1,
        }
    }
}

/// Where a run writes, and what it loads/saves besides.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    pub run_dir: PathBuf,
    pub init: Option<PathBuf>,
    pub save_weights: Option<PathBuf>,
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
}

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
    let k = vit.cfg.num_classes;
    let (mut loss_sum, mut correct) = (0.0f64, 0usize);
    let n = set.len();
    let batch = batch.clamp(1, plan::pass_images_cap(cfg.train.pass_images));
    let (rank, world) = (comm.rank(), comm.world_size());
    let batches: Vec<Vec<usize>> = (rank * batch..n).step_by(world * batch).map(|start| (start..(start + batch).min(n)).collect()).collect();
    let mut loader = Loader::start_batches(set.clone(), cfg.data.clone(), false, 0, cfg.train.seed, batches)?;
    while let Some(prepared) = loader.next() {
        let batch_data = prepared?.batch;
        let b = batch_data.len();
        let targets = smoothed_targets(&batch_data.labels, k, 0.0);
        let out = vit.forward(be, &batch_data.images, &targets, b, None)?;
        loss_sum += out.losses.iter().map(|&v| v as f64).sum::<f64>();
        for (row, &label) in out.logits.chunks(k).zip(&batch_data.labels) {
            // First maximal index, as torch.argmax.
            let pred = row.iter().enumerate().fold(0, |best, (j, v)| if *v > row[best] { j } else { best });
            correct += usize::from(pred == label as usize);
        }
        loader.recycle(batch_data);
    }
    let mut sums = [loss_sum, correct as f64];
    comm.all_reduce_host(&mut sums)?;
    let (loss_sum, correct) = (sums[0], sums[1]);
    Ok(EvalSummary { loss: loss_sum / n.max(1) as f64, top1: correct / n.max(1) as f64, images: n })
}

/// Builds the model with its initial weights: `--init` file or a seeded timm-style init.
pub fn build_model<B: Backend>(be: &B, cfg: &RunConfig, init_path: Option<&Path>) -> Result<Vit<B>, TrainError> {
    let mut vit = Vit::new(be, cfg.model.clone())?;
    vit.set_recompute(cfg.train.recompute);
    let host = match init_path {
        Some(p) => weights::load(p, &vit.table)?,
        None => init::init_params(&vit.table, cfg.train.seed),
    };
    vit.set_params(be, &host)?;
    Ok(vit)
}

/// Trains a model as `cfg` says on one rank (world size 1).
pub fn train<B: Backend>(be: &B, cfg: &RunConfig, opts: &TrainOptions) -> Result<TrainSummary, TrainError> {
    train_with(be, cfg, opts, &mut SingleComm::new())
}

/// Trains as this rank of `comm`'s world: every rank runs this same loop on its shard of each
/// global batch; gradients are summed across ranks at accumulation boundaries only.
pub fn train_with<B: Backend>(be: &B, cfg: &RunConfig, opts: &TrainOptions, comm: &mut dyn Comm<B::Buf>) -> Result<TrainSummary, TrainError> {
    let t_start = Instant::now();
    // the rank layout comes from the communicator; the config was resolved for it.
    let (rank, world) = (comm.rank(), comm.world_size());
    if world != cfg.batch.world_size {
        return Err(TrainError::Config(format!("the config was resolved for {} ranks but the job has {world}", cfg.batch.world_size)));
    }
    let plan = Plan::for_run(be, cfg);
    let mut run = RunDir::open(&opts.run_dir, cfg, &plan, opts.resume.is_some(), opts.keep_checkpoints)?;
    // DeepSpeed's tensorboard / csv_monitor blocks: rank 0 writes them, as DeepSpeed does
    let mut monitors = match rank {
        0 => Some(Monitors::open(&cfg.monitor, &opts.run_dir).map_err(|source| TrainError::RunDir { path: opts.run_dir.clone(), source })?),
        _ => None,
    };

    // ---- data, model, optimizer state
    let Datasets { train: train_set, val: val_set, description, class_names, warnings: data_warnings, .. } =
        data::open(&cfg.data, cfg.model.image_size, cfg.model.num_classes, cfg.train.seed)?;
    // an empty split would train nothing or report an accuracy of 0 of 0 images
    data::check_splits(&train_set, &val_set, &cfg.data)?;
    run.write_classes(&class_names)?;
    let global_batch = plan.global_batch;
    if train_set.len() < global_batch {
        return Err(TrainError::Config(format!(
            "train_batch_size ({global_batch}) is larger than the training set ({} images in {description})",
            train_set.len()
        )));
    }
    let sampler = Sampler::new(train_set.len(), global_batch, cfg.data.shuffle, cfg.train.seed, true);
    let steps_per_epoch = sampler.steps_per_epoch() as u64;
    let total_steps = cfg.train.steps.unwrap_or(cfg.train.epochs as u64 * steps_per_epoch);

    let vit = build_model(be, cfg, opts.init.as_deref())?;
    let num_params = vit.table.total;
    let decay = DecayGroups::new(&vit.table, &cfg.train.weight_decay_skip);
    // the gradient buckets, reduced while the step's last backward goes on
    let bucket_elems = cfg.reduce_bucket_size.unwrap_or(DEFAULT_BUCKET_ELEMS);
    let buckets = BucketPlan::new(&vit.gradient_groups(), FIRST_BUCKET_ELEMS.min(bucket_elems), bucket_elems).map_err(TrainError::Config)?;
    // ZeRO 1/2 (the config resolves a 3 to 2): this rank's shard of the optimizer state
    let zero_stage = cfg.zero_stage;
    let zero = match zero_stage {
        0 => None,
        // where the forward reads a compute copy, nobody needs the whole f32 weights
        s => Some(ZeroLayout::new(&buckets, &cfg.optimizer, s, world, rank, cfg.zero_reduce_scatter)?)
            .map(|z| if be.needs_compute_copy() { z.with_master_shard() } else { z }),
    };
    let state_len = zero.as_ref().map_or(optimizer_state_len(&cfg.optimizer, num_params), |z| z.buffer_len());
    let master_in_state = zero.as_ref().filter(|z| z.master_shard).map_or(0, |z| z.owned_len());
    let mut st = Step::with_state_len(be, vit, cfg.optimizer.clone(), decay, cfg.gradient_clipping, plan.clone(), state_len)?;
    if opts.trace.is_some() {
        st.trace = Some(Trace::new(rank, t_start));
    }
    // how the gradient buckets travel: the bf16 wire and its scaling at stage 0, and at ZeRO
    // stages on a GPU (NCCL reduce-scatters a bf16 wire; CPU ranks' ring does not: fp32 there)
    let wire = if zero.is_none() || be.needs_compute_copy() { gradient_wire(&cfg.grad_comm, world) } else { crate::comm::Wire::PLAIN };
    // what this rank holds, against what the stage predicts (the lab charts it)
    let compute_copy = be.needs_compute_copy();
    let memory = |measured_peak: Option<u64>, st: &Step<B>| MemoryRecord {
        stage: zero_stage,
        world_size: world,
        params: num_params,
        accounted: MemoryBytes::account(be, &st.vit, &st.opt_state, master_in_state),
        predicted: MemoryBytes::predict(num_params, optimizer_state_len(&cfg.optimizer, 1), compute_copy, zero_stage, world),
        measured_peak,
    };
    run.add_to_config("memory", &memory(None, &st))?;
    // The whole optimizer state (a collective under ZeRO: every rank gathers the shards).
    let full_state = |st: &Step<B>, comm: &mut dyn Comm<B::Buf>| -> Result<Vec<f32>, TrainError> {
        match &zero {
            Some(z) => z.gather_state(be, comm, &st.opt_state),
            None => Ok(be.download(&st.opt_state)?),
        }
    };
    // The whole f32 weights (a collective when ZeRO shards the master weights).
    let full_params = |st: &Step<B>, comm: &mut dyn Comm<B::Buf>| -> Result<Vec<f32>, TrainError> {
        match &zero {
            Some(z) if z.master_shard => z.gather_master(be, comm, &st.opt_state),
            _ => Ok(st.vit.params_host(be)?),
        }
    };

    // resume, then make every rank start from rank 0's exact state.
    let mut start_step = 0u64;
    if let Some(spec) = &opts.resume {
        let r = checkpoint::restore(spec, &st.vit.table, &cfg.optimizer)?;
        let saved_batch = r.state.get("global_batch").and_then(|v| v.as_u64());
        if saved_batch != Some(global_batch as u64) {
            let saved = saved_batch.map_or("records no global batch".to_string(), |b| format!("was trained with a global batch of {b} images"));
            return Err(TrainError::Config(format!(
                "{}: the checkpoint {saved}, this run has {global_batch}; a resumed run keeps its global batch (leave train_batch_size out, or set it to the checkpoint's)",
                r.dir.display()
            )));
        }
        if r.step >= total_steps && !opts.quiet {
            eprintln!("warning: {} is at step {}, and this run has {total_steps} steps: nothing is left to train (raise train.steps or train.epochs to continue)", r.dir.display(), r.step);
        }
        st.vit.set_params(be, &r.params)?;
        // checkpoints hold the whole state: a ZeRO rank keeps its shard of it
        match &zero {
            Some(z) => be.upload(&mut st.opt_state, 0, &z.shard_state(&r.opt_state)?)?,
            None => be.upload(&mut st.opt_state, 0, &r.opt_state)?,
        }
        start_step = r.step;
        run.log(&serde_json::json!({"kind": "resume", "step": start_step, "from": r.dir.display().to_string()}))?;
        if !opts.quiet {
            eprintln!("resumed from {} at step {start_step}", r.dir.display());
        }
    }
    if world > 1 {
        comm.broadcast(&mut st.vit.params, Span { off: 0, len: num_params }, 0)?;
        st.vit.params_changed(be)?;
        // (a ZeRO rank's shard came from the file every rank read)
        if opts.resume.is_some() && zero.is_none() {
            let olen = be.len(&st.opt_state);
            comm.broadcast(&mut st.opt_state, Span { off: 0, len: olen }, 0)?;
        }
    }
    // a master shard: this rank's pieces of rank 0's weights, then the whole copy goes
    if let Some(z) = &zero {
        z.take_master(be, &mut st.vit, &mut st.opt_state)?;
    }
    let k = cfg.model.num_classes;
    let (micro, gas) = (plan.micro_batch, plan.gradient_accumulation_steps);
    // mixed-speed ranks: this rank's emulated slowdown, the split of each global batch
    let mut bal = Balancer::new(cfg, rank, start_step, cfg.data.prefetch);

    if !opts.quiet {
        eprintln!(
            "vitscale: {} | model {} params | data {description} | {total_steps} steps of {global_batch} images ({micro} × {gas} GAS × {world} ranks)",
            be.name(),
            num_params
        );
        for w in cfg.warnings.iter().chain(&data_warnings) {
            eprintln!("warning: {w}");
        }
        if let Some(line) = bal.describe() {
            eprintln!("{line}");
        }
    }
    let bar = (opts.progress_bar && !opts.quiet).then(|| {
        let pb = indicatif::ProgressBar::new(total_steps);
        pb.set_style(
            indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} steps | {msg} | ETA {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        pb
    });

    // ---- the loop
    let mut phases = PhaseTimes::default();
    let (mut window_comm_bytes, mut window_comm_total) = (0u64, 0.0f64);
    // (exposed, total) seconds of the window's collectives as the device timed them, if it did
    let mut window_device_comm: Option<(f64, f64)> = None;
    let (mut window_loss, mut window_steps, mut window_start) = (0.0f64, 0u64, Instant::now());
    let mut window_checkpoint_s = 0.0f64;
    let (mut epoch_loss, mut epoch_steps) = (0.0f64, 0u64);
    let mut last_epoch_loss = f64::NAN;
    let mut last_eval: Option<EvalSummary> = None;
    let mut images_done = 0u64;
    // this rank's state hashes after the last step, once the ranks agreed on them.
    let mut final_hash: Option<agree::StateHash> = None;
    let train_wall = Instant::now();
    // this rank's shard of every global batch from `start_step` on, built ahead.
    let mut loader = Loader::start_split(LoaderPlan {
        set: train_set.clone(),
        cfg: cfg.data.clone(),
        sampler: sampler.clone(),
        train: true,
        seed: cfg.train.seed,
        rank,
        world,
        gas,
        start_epoch: 0,
        start_step: start_step as usize,
        steps: total_steps.saturating_sub(start_step),
        mix: Some(MixTargets { num_classes: k, label_smoothing: cfg.train.label_smoothing }),
    }, bal.schedule.clone())?;
    // The next micro-batch, taken from the loader while the device still runs the current
    // backward, and whether its first pass's inputs are already staged on the device.
    let mut ahead: Option<crate::data::loader::Prepared> = None;
    let mut first_pass_staged = false;
    let soft_targets = |batch: &crate::data::Batch, start: usize, n: usize| -> Vec<f32> {
        // Mixup / CutMix soft targets when the loader made them, else smoothed one-hot.
        match &batch.targets {
            Some(t) => t[start * k..(start + n) * k].to_vec(),
            None => smoothed_targets(&batch.labels[start..start + n], k, cfg.train.label_smoothing),
        }
    };
    for step in start_step..total_steps {
        let epoch = step / steps_per_epoch;
        let last_step = step + 1 == total_steps;
        // gradients are summed over ranks once per step, bucket by bucket during the last
        // micro-batch's backward
        let mut sync = match &zero {
            Some(z) => {
                let mut s = ZeroSync::new(&mut *comm, &buckets, z, cfg.zero_overlap_comm, t_start);
                s.wire = wire;
                AnySync::Zero(s)
            }
            None => {
                let mut s = BucketSync::new(&mut *comm, &buckets, t_start);
                s.wire = wire;
                AnySync::Plain(s)
            }
        };
        for m in 0..gas {
            let prepared = match ahead.take() {
                Some(p) => p,
                None => {
                    // data-wait: only the time this step is blocked on the loader.
                    let t_wait = Instant::now();
                    let next = loader.next();
                    phases.data_s += t_wait.elapsed().as_secs_f64();
                    if let Some(tr) = st.trace.as_mut() {
                        tr.span(Track::Data, "data wait", t_wait, Instant::now(), serde_json::Map::new());
                    }
                    match next {
                        Some(p) => p?,
                        None => return Err(TrainError::Config(format!("the data loader stopped before step {step}, micro-batch {m}"))),
                    }
                }
            };
            debug_assert_eq!((prepared.epoch, prepared.step as u64, prepared.micro), (epoch, step % steps_per_epoch, m));
            let batch = prepared.batch;
            let targets = |start: usize, n: usize| soft_targets(&batch, start, n);
            let mb = MicroBatch { images: &batch.images, b: batch.len(), targets: &targets };
            let last_micro = m + 1 == gas;
            // (without overlap_comm the boundary starts every bucket)
            let report: Option<&mut dyn GradSync<B>> = if last_micro && cfg.zero_overlap_comm { Some(&mut sync) } else { None };
            bal.before_micro(be, mb.b, step, st.trace.as_mut())?;
            st.micro_batch(be, &mb, step, std::mem::take(&mut first_pass_staged), report, &mut phases)?;
            bal.after_micro(be, mb.b, step, st.trace.as_mut())?;
            // While the device runs this backward (the host only enqueued it), take the next
            // micro-batch and stage its first pass: a GPU then starts the next forward as soon
            // as the optimizer is done instead of waiting for the host to convert and copy.
            // (The backward never reads the staged inputs; the pass size never grows, so
            // staging allocates nothing.)
            if !(last_step && last_micro) && stop::pending() == 0 {
                let t_wait = Instant::now();
                let next = loader.next();
                phases.data_s += t_wait.elapsed().as_secs_f64();
                if let Some(next) = next {
                    let next = next?;
                    if next.batch.len().min(plan.pass_images) <= plan.passes(batch.len()).last().map_or(0, |p| p.1) {
                        let t_stage = Instant::now();
                        let targets = |start: usize, n: usize| soft_targets(&next.batch, start, n);
                        let mb = MicroBatch { images: &next.batch.images, b: next.batch.len(), targets: &targets };
                        st.stage_ahead(be, &mb)?;
                        first_pass_staged = true;
                        phases.forward_s += t_stage.elapsed().as_secs_f64();
                    }
                    ahead = Some(next);
                }
            }
            loader.recycle(batch);
        }

        // ---- boundary: gradient sync, clipping on the device, schedule, update
        let epoch_end = (step + 1) % steps_per_epoch == 0;
        let log_due = (step + 1) % cfg.train.log_every.max(1) == 0 || last_step;
        let lr = schedule::lr_at(cfg.scheduler.as_ref(), cfg.optimizer.lr(), step, total_steps);
        let (grad_norm, bytes) = {
            let mut timed = bal.timed::<B>(&mut sync);
            let out = st.boundary(be, &mut timed, lr, step, log_due, &mut phases)?;
            bal.add_wait(timed.wait_s);
            out
        };
        window_comm_bytes += bytes;
        window_comm_total += sync.times().total_s;
        if let Some(tr) = st.trace.as_mut() {
            for e in sync.events() {
                let span = buckets.buckets[e.bucket].span;
                let args = [("step".to_string(), serde_json::json!(step)), ("elements".to_string(), serde_json::json!(span.len))].into_iter().collect();
                tr.span_s(Track::Comm, format!("bucket {}", e.bucket), e.start_s, e.end_s, args);
            }
        }
        drop(sync);
        bal.end_step(&mut *comm, step)?;
        // the stop flags (SIGINT/SIGTERM seen on any rank), agreed every step
        let mut stop_sig = stop::pending();
        if world > 1 {
            let t_comm = Instant::now();
            let mut flags = stop::flags(stop_sig);
            comm.all_reduce_host(&mut flags)?;
            stop_sig = stop::agreed(stop_sig, flags);
            phases.comm_s += t_comm.elapsed().as_secs_f64();
        }
        let log_now = log_due || stop_sig != 0;
        // the losses come back on logging steps and epoch ends only (each read waits for the device)
        if log_now || epoch_end {
            let taken = st.take_losses(be)?;
            let mut sums: Vec<f64> = taken.iter().map(|&(_, v)| v).collect();
            if world > 1 {
                comm.all_reduce_host(&mut sums)?;
            }
            // a device transport timed its collectives with events: those replace the host's
            // view of them, which on a GPU only sees the enqueueing
            if let Some((exposed, total)) = comm.take_device_timing()? {
                let w = window_device_comm.get_or_insert((0.0, 0.0));
                (w.0, w.1) = (w.0 + exposed, w.1 + total);
            }
            for (&(s, _), sum) in taken.iter().zip(sums) {
                let loss = sum / global_batch as f64;
                if !loss.is_finite() {
                    return Err(TrainError::Diverged { step: s, loss });
                }
                window_loss += loss;
                epoch_loss += loss;
            }
        }
        window_steps += 1;
        epoch_steps += 1;

        // checkpoint (rank 0 writes, for every rank), also when stopping for a signal. Every
        // rank knows whether one is due (the stop flag is agreed), so all of them first check
        // that they hold the same state, as they do after the last step.
        let every = cfg.train.checkpoint_every;
        let stop_ckpt = stop_sig != 0 && cfg.train.checkpoint_on_signal;
        let want_ckpt = stop_ckpt || (every > 0 && ((step + 1) % every == 0 || last_step));
        let agree_now = last_step || (want_ckpt && world > 1);
        let mut saved = None;
        let mut host_state = None;
        // The state agreement and the checkpoint write are not training: their time leaves the
        // window's images/s (as DeepSpeed's throughput excludes checkpoints) and is logged as
        // `checkpoint_s`. The device finishes the step first, so its work stays in the step.
        let t_checkpoint = (agree_now || (rank == 0 && want_ckpt)).then(|| be.synchronize().map(|_| Instant::now())).transpose()?;
        if agree_now {
            let (p, o) = (full_params(&st, &mut *comm)?, full_state(&st, &mut *comm)?);
            let h = agree::check(comm, step + 1, &p, &o)?;
            if last_step {
                final_hash = Some(h);
            }
            host_state = Some((p, o));
        }
        if rank == 0 && want_ckpt {
            let state = serde_json::json!({
                "step": step + 1,
                "epoch": (step + 1) / steps_per_epoch,
                "step_in_epoch": (step + 1) % steps_per_epoch,
                "scheduler_step": step + 1,
                "global_batch": global_batch,
                "world_size": world,
                "zero_stage": zero_stage,
                "seed": cfg.train.seed,
                "config": crate::config::resolved_json(cfg),
            });
            let (p, o) = match host_state.take() {
                Some(state) => state,
                // one rank (more ranks agreed above): nothing to gather from others
                None => (full_params(&st, &mut *comm)?, full_state(&st, &mut *comm)?),
            };
            saved = Some(run.checkpoint(step + 1, &st.vit.table, &p, cfg, &o, &state)?);
        }
        if let Some(t) = t_checkpoint {
            let spent = t.elapsed();
            window_checkpoint_s += spent.as_secs_f64();
            window_start += spent;
        }
        images_done += global_batch as u64;

        // ---- metrics line
        if log_now {
            if let Some((exposed, total)) = window_device_comm.take() {
                (phases.comm_s, window_comm_total) = (exposed, total);
            }
            let secs = window_start.elapsed().as_secs_f64();
            let ips = (window_steps * global_batch as u64) as f64 / secs.max(1e-9);
            let (peak_mem_bytes, peak_mem_source) = crate::metrics::peak_memory(be);
            let rec = StepRecord {
                step: step + 1,
                epoch,
                lr,
                loss: window_loss / window_steps as f64,
                // a stop between logging steps reads no norm (it would cost a synchronization)
                grad_norm: grad_norm.unwrap_or(f64::NAN),
                images_per_s: ips,
                images_per_s_per_rank: ips / world as f64,
                // MFU needs the device's measured matrix ceiling: `vitscale bench` reports it.
                mfu: None,
                phases,
                rank,
                comm_total_s: window_comm_total,
                comm_overlap: (world > 1 && window_comm_total > 0.0).then(|| (1.0 - phases.comm_s / window_comm_total).clamp(0.0, 1.0)),
                comm_bytes: window_comm_bytes,
                bus_gb_s: allreduce_bus_gb_s(window_comm_bytes, world, window_comm_total),
                peak_mem_bytes,
                peak_mem_source,
                checkpoint_s: std::mem::take(&mut window_checkpoint_s),
                wall_s: t_start.elapsed().as_secs_f64(),
                balance: bal.take_record(),
            };
            let window_comm_total_logged = window_comm_total;
            (window_comm_bytes, window_comm_total) = (0, 0.0);
            run.log(&rec)?;
            if let Some(m) = monitors.as_mut() {
                m.step(&rec, window_steps, images_done).map_err(|source| TrainError::RunDir { path: opts.run_dir.clone(), source })?;
            }
            if cfg.monitor.wall_clock_breakdown && !opts.quiet {
                let per = |s: f64| s * 1e3 / window_steps.max(1) as f64;
                let line = format!(
                    "time (ms) per step | data wait: {:.2} | forward: {:.2} | backward: {:.2} | allreduce exposed: {:.2} | allreduce total: {:.2} | optimizer: {:.2}",
                    per(phases.data_s), per(phases.forward_s), per(phases.backward_s), per(phases.comm_s), per(window_comm_total_logged), per(phases.optimizer_s)
                );
                match &bar {
                    Some(pb) => pb.println(line),
                    None => eprintln!("{line}"),
                }
            }
            let msg = format!("epoch {epoch} loss {:.4} lr {lr:.2e} {ips:.0} img/s", rec.loss);
            match &bar {
                Some(pb) => pb.set_message(msg),
                None if !opts.quiet => eprintln!("step {}/{total_steps} {msg}", step + 1),
                None => {}
            }
            phases = PhaseTimes::default();
            (window_loss, window_steps, window_start) = (0.0, 0, Instant::now());
        }
        if let Some(pb) = &bar {
            pb.inc(1);
        }

        // stop for a signal: every rank agreed on this step; the others wait until
        // rank 0's checkpoint is on disk, then all exit with 128 + signal.
        if stop_sig != 0 {
            if let Some(pb) = &bar {
                pb.abandon();
            }
            if world > 1 {
                comm.barrier()?;
            }
            let detail = match (&saved, stop_ckpt) {
                (Some(dir), _) => format!(
                    "checkpoint {} written; continue with --resume latest --run-dir {}",
                    dir.display(),
                    opts.run_dir.display()
                ),
                (None, true) => "rank 0 wrote the checkpoint".to_string(),
                (None, false) => "no checkpoint written (train.checkpoint_on_signal is false)".to_string(),
            };
            return Err(TrainError::Interrupted { signal: stop_sig, step: step + 1, detail });
        }

        // ---- evaluation: every eval_every steps, or at each epoch end, and at the end
        let due = if cfg.train.eval_every > 0 { (step + 1) % cfg.train.eval_every == 0 } else { epoch_end };
        if epoch_end || last_step {
            last_epoch_loss = epoch_loss / epoch_steps.max(1) as f64;
            (epoch_loss, epoch_steps) = (0.0, 0);
        }
        if due || last_step {
            let ev = evaluate_with(be, &mut st.vit, &val_set, cfg, cfg.train.eval_batch_size, comm)?;
            let rec = EvalRecord { kind: "eval", step: step + 1, epoch, val_loss: ev.loss, val_top1: ev.top1, images: ev.images };
            run.log(&rec)?;
            let line = format!("eval after step {}: val_loss {:.4} val_top1 {:.4}", step + 1, ev.loss, ev.top1);
            match &bar {
                Some(pb) => pb.println(line),
                None if !opts.quiet => eprintln!("{line}"),
                None => {}
            }
            last_eval = Some(ev);
        }
    }
    if let Some(pb) = &bar {
        pb.finish_and_clear();
    }
    let train_secs = train_wall.elapsed().as_secs_f64();

    // a run resumed at its last step trains none: its ranks compare the restored state here.
    let final_hash = match final_hash {
        Some(h) => h,
        None => {
            let o = full_state(&st, &mut *comm)?;
            let p = full_params(&st, &mut *comm)?;
            agree::check(comm, total_steps, &p, &o)?
        }
    };
    let mut mem = serde_json::to_value(memory(be.peak_bytes(), &st)).map_err(|e| TrainError::Config(e.to_string()))?;
    mem["kind"] = "memory".into();
    run.log(&mem)?;
    let ev = match last_eval {
        Some(ev) => ev,
        None => evaluate_with(be, &mut st.vit, &val_set, cfg, cfg.train.eval_batch_size, comm)?,
    };
    // one file for the job, from rank 0, now that every rank is known to hold these weights.
    // (every rank is given the same --save-weights: all of them take part in a gather)
    if let Some(path) = opts.save_weights.as_ref() {
        let p = full_params(&st, &mut *comm)?;
        if rank == 0 {
            weights::save(path, &st.vit.table, &st.vit.cfg, &p)?;
        }
    }
    let summary = TrainSummary {
        val_top1: ev.top1,
        val_loss: ev.loss,
        train_loss: last_epoch_loss,
        images: images_done,
        steps: total_steps,
        wall_s: t_start.elapsed().as_secs_f64(),
        images_per_s: images_done as f64 / train_secs.max(1e-9),
        device: be.name(),
        params: num_params,
        run_dir: opts.run_dir.display().to_string(),
        weights_hash: final_hash.weights_hex(),
        skipped: cfg.data.skip_bad.then(|| {
            use std::sync::atomic::Ordering::Relaxed;
            train_set.skipped.load(Relaxed) + val_set.skipped.load(Relaxed)
        }),
    };
    run.write_summary(&summary)?;
    if let (Some(dir), Some(tr)) = (&opts.trace, &st.trace) {
        tr.write(dir).map_err(|source| TrainError::RunDir { path: dir.clone(), source })?;
    }
    Ok(summary)
}
