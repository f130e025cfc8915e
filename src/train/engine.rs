//! The training step and loop, readable top to bottom:
//!
//! for each optimizer step: for each of the GAS micro-batches this rank feeds, take the batch
//! the prefetching `data::Loader` built ahead (decode, augment, normalize, mixup/CutMix on its
//! own threads; the time spent *waiting* for it is `data_s`), forward with the loss gradient scaled by 1/global-batch, backward
//! (parameter gradients accumulate) — no communication in between; at the boundary: reduce
//! gradients across ranks, global norm + clipping, learning rate from the schedule, one
//! optimizer update over the flat buffer, zero the gradients. Evaluation, metrics lines,
//! progress output and the run directory are around that loop. A SIGINT / SIGTERM caught by
//! `train::stop` is acted on at a boundary that every rank agrees on: checkpoint, then stop.
//! After the last step, and before each checkpoint of a multi-rank run, the ranks compare
//! hashes of their weights and optimizer state (`train::agree`) and all fail if any differs.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::backend::{optimizer_state_len, Backend, DecayGroups, Span, StepHyper};
use crate::comm::{Comm, CommError, ReduceOp, SingleComm};
use crate::config::RunConfig;
use crate::data::{self, Datasets, ImageSet, Loader, LoaderPlan, MixTargets, Sampler};
use crate::metrics::{allreduce_bus_gb_s, timed, EvalRecord, JsonlWriter, PhaseTimes, StepRecord};
use crate::model::{init, smoothed_targets, weights, Vit};
use crate::train::{agree, checkpoint, schedule, stop};

/// Largest number of images one forward/backward pass processes on the host backend; a larger
/// micro-batch is run as several passes whose gradients add up (same math, bounded memory).
pub const MAX_IMAGES_PER_PASS: usize = 512;

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
    let batch = batch.clamp(1, MAX_IMAGES_PER_PASS);
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

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::RunDir { path: path.to_path_buf(), source }
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
    std::fs::create_dir_all(&opts.run_dir).map_err(io_err(&opts.run_dir))?;
    let resolved = serde_json::to_vec_pretty(cfg).map_err(|e| TrainError::Config(e.to_string()))?;
    crate::util::write_atomic(&opts.run_dir.join("config.json"), &resolved).map_err(io_err(&opts.run_dir))?;
    let metrics_path = opts.run_dir.join("metrics.jsonl");
    // a resumed run appends, after a `{"kind": "resume"}` line, so the history before
    // the interruption stays (steps after that line's `step` replace earlier lines).
    let mut metrics = match opts.resume {
        Some(_) => JsonlWriter::append(&metrics_path),
        None => JsonlWriter::create(&metrics_path),
    }
    .map_err(io_err(&metrics_path))?;

    // ---- data, model, optimizer state
    let Datasets { train: train_set, val: val_set, description, class_names, .. } =
        data::open(&cfg.data, cfg.model.image_size, cfg.model.num_classes, cfg.train.seed)?;
    // Class index → name, so predictions and exported weights can be read later.
    let names = serde_json::to_vec_pretty(&class_names).map_err(|e| TrainError::Config(e.to_string()))?;
    crate::util::write_atomic(&opts.run_dir.join("classes.json"), &names).map_err(io_err(&opts.run_dir))?;
    let global_batch = cfg.batch.train_batch_size;
    if train_set.len() < global_batch {
        return Err(TrainError::Config(format!(
            "train_batch_size ({global_batch}) is larger than the training set ({} images in {description})",
            train_set.len()
        )));
    }
    let sampler = Sampler::new(train_set.len(), global_batch, cfg.data.shuffle, cfg.train.seed, true);
    let steps_per_epoch = sampler.steps_per_epoch() as u64;
    let total_steps = cfg.train.steps.unwrap_or(cfg.train.epochs as u64 * steps_per_epoch);

    let mut vit = build_model(be, cfg, opts.init.as_deref())?;
    let num_params = vit.table.total;
    let decay = DecayGroups::new(&vit.table, &cfg.train.weight_decay_skip);
    let mut opt_state = be.alloc_f32(optimizer_state_len(&cfg.optimizer, num_params))?;
    vit.zero_grads(be)?;

    // resume, then make every rank start from rank 0's exact state.
    let ckpt_root = opts.run_dir.join("checkpoints");
    let mut start_step = 0u64;
    if let Some(spec) = &opts.resume {
        let r = checkpoint::restore(spec, &vit.table, &cfg.optimizer)?;
        let saved_batch = r.state.get("global_batch").and_then(|v| v.as_u64());
        if saved_batch != Some(global_batch as u64) {
            return Err(TrainError::Config(format!(
                "{}: saved with a global batch of {saved_batch:?}, this run has {global_batch}; set train_batch_size to resume with the same global batch",
                r.dir.display()
            )));
        }
        vit.set_params(be, &r.params)?;
        be.upload(&mut opt_state, 0, &r.opt_state)?;
        start_step = r.step;
        let mark = serde_json::json!({"kind": "resume", "step": start_step, "from": r.dir.display().to_string()});
        metrics.write(&mark).map_err(io_err(&metrics_path))?;
        if !opts.quiet {
            eprintln!("resumed from {} at step {start_step}", r.dir.display());
        }
    }
    if world > 1 {
        comm.broadcast(&mut vit.params, Span { off: 0, len: num_params }, 0)?;
        vit.params_changed(be)?;
        if opts.resume.is_some() {
            let olen = be.len(&opt_state);
            comm.broadcast(&mut opt_state, Span { off: 0, len: olen }, 0)?;
        }
    }
    let k = cfg.model.num_classes;
    let (micro, gas) = (cfg.batch.micro_batch_per_gpu, cfg.batch.gradient_accumulation_steps);

    if !opts.quiet {
        eprintln!(
            "vitscale: {} | model {} params | data {description} | {total_steps} steps of {global_batch} images ({micro} × {gas} GAS × {world} ranks)",
            be.name(),
            num_params
        );
        for w in &cfg.warnings {
            eprintln!("warning: {w}");
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
    let mut window_comm_bytes = 0u64;
    let (mut window_loss, mut window_steps, mut window_start) = (0.0f64, 0u64, Instant::now());
    let (mut epoch_loss, mut epoch_steps) = (0.0f64, 0u64);
    let mut last_epoch_loss = f64::NAN;
    let mut last_eval: Option<EvalSummary> = None;
    let mut images_done = 0u64;
    // this rank's state hashes after the last step, once the ranks agreed on them.
    let mut final_hash: Option<agree::StateHash> = None;
    let train_wall = Instant::now();
    // this rank's shard of every global batch from `start_step` on, built ahead.
    let mut loader = Loader::start(LoaderPlan {
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
    })?;
    let per_image = 3 * cfg.model.image_size * cfg.model.image_size;
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
        let mut step_loss = 0.0f64;
        for m in 0..gas {
            let prepared = match ahead.take() {
                Some(p) => p,
                None => {
                    // data-wait: only the time this step is blocked on the loader.
                    let t_wait = Instant::now();
                    let next = loader.next();
                    phases.data_s += t_wait.elapsed().as_secs_f64();
                    match next {
                        Some(p) => p?,
                        None => return Err(TrainError::Config(format!("the data loader stopped before step {step}, micro-batch {m}"))),
                    }
                }
            };
            debug_assert_eq!((prepared.epoch, prepared.step as u64, prepared.micro), (epoch, step % steps_per_epoch, m));
            let batch = prepared.batch;
            let b = batch.len();
            let last_micro_of_run = step + 1 == total_steps && m + 1 == gas;
            for start in (0..b).step_by(MAX_IMAGES_PER_PASS) {
                let n = (b - start).min(MAX_IMAGES_PER_PASS);
                // staged ahead, unless an evaluation's forward has replaced those inputs since
                let staged = std::mem::take(&mut first_pass_staged) && start == 0 && vit.has_unread_inputs(n);
                let out = timed(&mut phases.forward_s, || -> Result<_, TrainError> {
                    if !staged {
                        let images = &batch.images[start * per_image..(start + n) * per_image];
                        vit.stage_inputs(be, images, &soft_targets(&batch, start, n), n)?;
                    }
                    vit.forward_staged(be, n, Some(1.0 / global_batch as f32))?;
                    Ok(vit.forward_out(be, n)?)
                })?;
                step_loss += out.losses.iter().map(|&v| v as f64).sum::<f64>();
                timed(&mut phases.backward_s, || vit.backward(be))?;
                // While the device runs this backward (the host only enqueued it), take the next
                // micro-batch and stage its first pass: a GPU then starts the next forward as soon
                // as the optimizer is done instead of waiting for the host to convert and copy.
                // (The backward never reads the staged inputs; the pass size never grows, so
                // staging allocates nothing.)
                if start + n >= b && !last_micro_of_run && stop::pending() == 0 {
                    let t_wait = Instant::now();
                    let next = loader.next();
                    phases.data_s += t_wait.elapsed().as_secs_f64();
                    if let Some(next) = next {
                        let next = next?;
                        let nb = next.batch.len().min(MAX_IMAGES_PER_PASS);
                        if nb <= n {
                            let t_stage = Instant::now();
                            vit.stage_inputs(be, &next.batch.images[..nb * per_image], &soft_targets(&next.batch, 0, nb), nb)?;
                            phases.forward_s += t_stage.elapsed().as_secs_f64();
                            first_pass_staged = true;
                        }
                        ahead = Some(next);
                    }
                }
            }
            loader.recycle(batch);
        }
        // the step's only communication: sum gradients (each already scaled by
        // 1/global batch), the loss and the stop flags (SIGINT/SIGTERM seen) over ranks.
        let mut stop_sig = stop::pending();
        if world > 1 {
            let t_comm = Instant::now();
            comm.all_reduce(&mut vit.grads, Span { off: 0, len: num_params }, ReduceOp::Sum)?;
            window_comm_bytes += (num_params * std::mem::size_of::<f32>()) as u64;
            let f = stop::flags(stop_sig);
            let mut host = [step_loss, f[0], f[1]];
            comm.all_reduce_host(&mut host)?;
            step_loss = host[0];
            stop_sig = stop::agreed(stop_sig, [host[1], host[2]]);
            phases.comm_s += t_comm.elapsed().as_secs_f64();
        }
        step_loss /= global_batch as f64;
        if !step_loss.is_finite() {
            return Err(TrainError::Diverged { step, loss: step_loss });
        }

        // ---- boundary: norm, clipping, schedule, update
        let t_opt = Instant::now();
        let grad_norm = be.sum_squares(&vit.grads)?.sqrt();
        let clip = cfg.gradient_clipping;
        let grad_scale = if clip > 0.0 && grad_norm > clip { (clip / (grad_norm + 1e-6)) as f32 } else { 1.0 };
        let lr = schedule::lr_at(cfg.scheduler.as_ref(), cfg.optimizer.lr(), step, total_steps);
        let hyper = StepHyper { lr: lr as f32, step: step + 1, grad_scale, clip_norm: 0.0 };
        vit.update(be, &mut opt_state, &cfg.optimizer, &decay, hyper)?;
        vit.zero_grads(be)?;
        be.synchronize()?;
        phases.optimizer_s += t_opt.elapsed().as_secs_f64();

        // checkpoint (rank 0 writes, for every rank), also when stopping for a signal. Every
        // rank knows whether one is due (the stop flag is agreed), so all of them first check
        // that they hold the same state, as they do after the last step.
        let every = cfg.train.checkpoint_every;
        let stop_ckpt = stop_sig != 0 && cfg.train.checkpoint_on_signal;
        let want_ckpt = stop_ckpt || (every > 0 && ((step + 1) % every == 0 || step + 1 == total_steps));
        let agree_now = step + 1 == total_steps || (want_ckpt && world > 1);
        let mut saved = None;
        let mut host_state = None;
        if agree_now {
            let (p, o) = (vit.params_host(be)?, be.download(&opt_state)?);
            let h = agree::check(comm, step + 1, &p, &o)?;
            if step + 1 == total_steps {
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
                "seed": cfg.train.seed,
                "config": cfg,
            });
            let (p, o) = match host_state.take() {
                Some(state) => state,
                None => (vit.params_host(be)?, be.download(&opt_state)?),
            };
            saved = Some(checkpoint::save_training(&ckpt_root, step + 1, &vit.table, &p, &cfg.optimizer, &o, &state, opts.keep_checkpoints)?);
        }

        images_done += global_batch as u64;
        window_loss += step_loss;
        window_steps += 1;
        epoch_loss += step_loss;
        epoch_steps += 1;

        // ---- metrics line
        let last_step = step + 1 == total_steps;
        if (step + 1) % cfg.train.log_every.max(1) == 0 || last_step || stop_sig != 0 {
            let secs = window_start.elapsed().as_secs_f64();
            let ips = (window_steps * global_batch as u64) as f64 / secs.max(1e-9);
            let rec = StepRecord {
                step: step + 1,
                epoch,
                lr,
                loss: window_loss / window_steps as f64,
                grad_norm,
                images_per_s: ips,
                images_per_s_per_rank: ips / world as f64,
                // MFU needs the device's measured matrix ceiling: `vitscale bench` reports it.
                mfu: None,
                phases,
                comm_bytes: window_comm_bytes,
                bus_gb_s: allreduce_bus_gb_s(window_comm_bytes, world, phases.comm_s),
                wall_s: t_start.elapsed().as_secs_f64(),
            };
            window_comm_bytes = 0;
            metrics.write(&rec).map_err(io_err(&metrics_path))?;
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
        let epoch_end = (step + 1) % steps_per_epoch == 0;
        let due = if cfg.train.eval_every > 0 { (step + 1) % cfg.train.eval_every == 0 } else { epoch_end };
        if epoch_end || last_step {
            last_epoch_loss = epoch_loss / epoch_steps.max(1) as f64;
            (epoch_loss, epoch_steps) = (0.0, 0);
        }
        if due || last_step {
            let ev = evaluate_with(be, &mut vit, &val_set, cfg, cfg.train.eval_batch_size, comm)?;
            let rec = EvalRecord { kind: "eval", step: step + 1, epoch, val_loss: ev.loss, val_top1: ev.top1, images: ev.images };
            metrics.write(&rec).map_err(io_err(&metrics_path))?;
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
        None => agree::check(comm, total_steps, &vit.params_host(be)?, &be.download(&opt_state)?)?,
    };
    let ev = match last_eval {
        Some(ev) => ev,
        None => evaluate_with(be, &mut vit, &val_set, cfg, cfg.train.eval_batch_size, comm)?,
    };
    // one file for the job, from rank 0, now that every rank is known to hold these weights.
    if let Some(path) = opts.save_weights.as_ref().filter(|_| rank == 0) {
        weights::save(path, &vit.table, &vit.cfg, &vit.params_host(be)?)?;
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
    let bytes = serde_json::to_vec_pretty(&summary).map_err(|e| TrainError::Config(e.to_string()))?;
    crate::util::write_atomic(&opts.run_dir.join("summary.json"), &bytes).map_err(io_err(&opts.run_dir))?;
    Ok(summary)
}
