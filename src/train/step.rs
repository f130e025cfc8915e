//! The training step, the one that `train`, `bench` and `selftest` all run:
//!
//! ```text
//! for each of the GAS micro-batches this rank feeds:
//!     for each pass of the plan (≤ plan.pass_images images):
//!         stage inputs → forward, loss gradient scaled by 1/global batch → backward (grads +=)
//!         (last micro-batch only: the backward reports each finished block to the sync)
//! boundary: sync.finish (wait for the gradient reduction) → [fp16: the overflow check, which
//!           skips the update] → sync.update: global-norm clip and the optimizer update
//!           (which refreshes the compute copy; under ZeRO this rank's shard, then the
//!           all-gather of the weights) → zero the gradients
//! ```
//!
//! No gradient communication happens on non-boundary micro-batches, except at ZeRO stage 3:
//! there no rank keeps a whole gradient buffer, so every pass's backward reduce-scatters each
//! group's gradients as it produces them (`GradSync::reduces_every_pass`), as DeepSpeed does. Nothing is read back to the host
//! unless asked: each pass's per-image losses are copied into a device buffer of their own and
//! come back when the caller takes them (`take_losses`, on logging steps), and the gradient
//! norm is computed for the host only when the boundary is asked for it. So a step on a GPU
//! has no host synchronization at all except on those steps, which have two (the norm, the
//! losses).

use crate::backend::{optimizer_state_len, Backend, ParamGroups, Span, StepHyper, FP16_INF_FROM};
use crate::config::OptimizerConfig;
use crate::core::encoded::EncodedBatch;
use crate::metrics::trace::{Trace, Track};
use crate::model::drop_path::DropPath;
use crate::model::Vit;
use crate::train::error::TrainError;
use crate::train::loss_scale::{LossScaling, Verdict};
use crate::train::plan::Plan;
use crate::train::timeline::{Phase, Timeline};
use crate::train::sync::GradSync;

/// One micro-batch on the host: `images` (B, 3, S, S) normalized — or, decoded on the device,
/// `encoded` — and its soft targets by rows.
pub struct MicroBatch<'a> {
    pub images: &'a [f32],
    /// The images still encoded (`data.decode = "gpu"`; `images` is then empty).
    pub encoded: Option<&'a EncodedBatch>,
    pub b: usize,
    /// Soft targets (n, K) of images `start..start + n`.
    pub targets: &'a dyn Fn(usize, usize) -> Vec<f32>,
    /// Each image's sample key (`data::Batch::keys`): what stochastic depth draws from.
    pub keys: &'a [u64],
}

/// The model and its optimizer, stepped as the plan says.
pub struct Step<B: Backend> {
    pub vit: Vit<B>,
    pub opt_state: B::Buf,
    pub optimizer: OptimizerConfig,
    pub decay: ParamGroups,
    /// `gradient_clipping`: the global gradient norm is clipped to this on the device (0 = off).
    pub clip: f64,
    pub plan: Plan,
    /// Device copies of each pass's per-image losses not yet taken: (step, images, buffer).
    pending_losses: Vec<(u64, usize, B::Buf)>,
    spare_losses: Vec<B::Buf>,
    /// The rank's trace, when the run writes one (`--trace`).
    pub trace: Option<Trace>,
    /// The step's phases on the device timeline (`train::timeline`), when the caller times them
    /// (the trainer does; the benchmarks time whole steps themselves).
    pub timeline: Option<Timeline<B>>,
    /// Stochastic depth (`model.drop_path_rate`), drawn per pass from the images' keys.
    pub drop_path: Option<DropPath>,
    /// fp16's loss scaling (`train::loss_scale`): the loss gradient is scaled, the optimizer
    /// unscales, overflowing steps are skipped.
    pub loss_scaling: Option<LossScaling>,
}

impl<B: Backend> Step<B> {
    pub fn new(be: &B, vit: Vit<B>, optimizer: OptimizerConfig, decay: ParamGroups, clip: f64, plan: Plan) -> Result<Self, TrainError> {
        let len = optimizer_state_len(&optimizer, vit.table.total);
        Self::with_state_len(be, vit, optimizer, decay, clip, plan, len)
    }

    /// `new` with an optimizer state of `state_len` values: a ZeRO shard's
    /// (`ZeroLayout::state_len`) instead of the whole model's.
    pub fn with_state_len(be: &B, mut vit: Vit<B>, optimizer: OptimizerConfig, decay: ParamGroups, clip: f64, plan: Plan, state_len: usize) -> Result<Self, TrainError> {
        vit.set_recompute(plan.recompute_policy());
        let opt_state = be.alloc_f32(state_len)?;
        vit.zero_grads(be)?;
        Ok(Step { vit, opt_state, optimizer, decay, clip, plan, pending_losses: Vec::new(), spare_losses: Vec::new(), trace: None, timeline: None, drop_path: None, loss_scaling: None })
    }

    /// Copies the first pass of a micro-batch to the device ahead of its step (while the
    /// device still runs the previous backward); `micro_batch` skips staging it again.
    pub fn stage_ahead(&mut self, be: &B, batch: &MicroBatch<'_>) -> Result<(), TrainError> {
        let n = batch.b.min(self.plan.pass_images);
        self.stage_pass(be, batch, 0, n)
    }

    /// Stages images `start..start + n` of `batch` on the device: copies them, or decodes them
    /// there when they are still encoded.
    fn stage_pass(&mut self, be: &B, batch: &MicroBatch<'_>, start: usize, n: usize) -> Result<(), TrainError> {
        let targets = (batch.targets)(start, n);
        match batch.encoded {
            Some(enc) => self.vit.stage_encoded_inputs(be, enc, start..start + n, &targets, n)?,
            None => {
                let per_image = batch.images.len() / batch.b.max(1);
                self.vit.stage_inputs(be, &batch.images[start * per_image..(start + n) * per_image], &targets, n)?;
            }
        }
        Ok(())
    }

    /// Ends the current interval of the timeline as `phase` (nothing when the step is not timed).
    pub fn mark(&mut self, be: &B, phase: Phase) -> Result<(), TrainError> {
        if let Some(tl) = self.timeline.as_mut() {
            tl.mark(be, phase)?;
        }
        Ok(())
    }

    /// Every pass of one micro-batch of step `step`. `first_staged`: `stage_ahead` staged its
    /// first pass. With `sync`, this is the step's last micro-batch: its last pass's backward
    /// reports finished blocks to the sync (every pass's, where the sync reduces every pass:
    /// ZeRO-3, whose sync every micro-batch is given).
    pub fn micro_batch(&mut self, be: &B, batch: &MicroBatch<'_>, step: u64, first_staged: bool, mut sync: Option<&mut dyn GradSync<B>>) -> Result<(), TrainError> {
        let passes: Vec<(usize, usize)> = self.plan.passes(batch.b).collect();
        let last = passes.len().saturating_sub(1);
        // (ZeRO-3: every pass's backward reduces its gradients)
        let every = sync.as_ref().is_some_and(|s| s.reduces_every_pass());
        for (i, (start, n)) in passes.into_iter().enumerate() {
            // staged ahead, unless an evaluation's forward has replaced those inputs since
            if !(i == 0 && first_staged && self.vit.has_unread_inputs(n)) {
                self.stage_pass(be, batch, start, n)?;
            }
            self.set_branch_scales(be, batch, start, n)?;
            self.mark(be, Phase::Data)?;
            let report = match sync.as_mut() {
                Some(s) if every || i == last => Some(&mut **s as &mut dyn GradSync<B>),
                _ => None,
            };
            self.pass(be, n, step, report)?;
        }
        Ok(())
    }

    /// Stochastic depth's factors for the pass over images `start..start + n` of `batch`.
    fn set_branch_scales(&mut self, be: &B, batch: &MicroBatch<'_>, start: usize, n: usize) -> Result<(), TrainError> {
        let Some(dp) = &self.drop_path else { return Ok(()) };
        let keys = batch.keys.get(start..start + n).ok_or_else(|| {
            TrainError::Config(format!("model.drop_path_rate needs each image's sample key; the batch of {} images carries {}", batch.b, batch.keys.len()))
        })?;
        let active = (0..dp.rates.len()).map(|i| dp.active(i)).collect();
        self.vit.set_branch_scales(be, Some((&dp.scales(keys), active)), n)?;
        Ok(())
    }

    /// One forward/backward pass over the `n` images staged on the device.
    pub fn pass(&mut self, be: &B, n: usize, step: u64, sync: Option<&mut dyn GradSync<B>>) -> Result<(), TrainError> {
        let t0 = std::time::Instant::now();
        self.vit.forward_staged(be, n, Some(self.dloss_scale()))?;
        self.keep_losses(be, step, n)?;
        self.mark(be, Phase::Forward)?;
        let t1 = std::time::Instant::now();
        match sync {
            Some(s) if s.reports_blocks() => {
                let Step { vit, trace, .. } = self;
                let mut group = 0usize;
                let mut last = t1;
                vit.backward_reporting(
                    be,
                    Some(&mut |grads: &mut B::Buf, span: Span| {
                        if let Some(tr) = trace.as_mut() {
                            let now = std::time::Instant::now();
                            tr.span(Track::Gradients, format!("group {group}"), last, now, args(&[("step", step as f64), ("elements", span.len as f64)]));
                            last = now;
                        }
                        group += 1;
                        s.ready(be, grads, span)
                    }),
                )?
            }
            _ => self.vit.backward(be)?,
        }
        self.mark(be, Phase::Backward)?;
        let t2 = std::time::Instant::now();
        if let Some(tr) = self.trace.as_mut() {
            // the host's side: when it enqueued the work (on the CPU, when the work ran)
            let a = args(&[("step", step as f64), ("images", n as f64)]);
            tr.span(Track::Compute, "forward", t0, t1, a.clone());
            tr.span(Track::Compute, "backward", t1, t2, a);
        }
        Ok(())
    }

    /// The forward and backward of one pass over the staged inputs without keeping its
    /// losses: what `bench` captures into a CUDA graph and replays (the boundary zeroes the
    /// gradients after each update).
    pub fn pass_unlogged(&mut self, be: &B, n: usize) -> Result<(), TrainError> {
        self.vit.forward_staged(be, n, Some(self.dloss_scale()))?;
        self.vit.backward(be)?;
        Ok(())
    }

    /// `pass_unlogged` whose backward reports each finished gradient group to `sync` (the
    /// last pass of a benchmarked data-parallel step).
    pub fn pass_unlogged_reporting(&mut self, be: &B, n: usize, sync: &mut dyn GradSync<B>) -> Result<(), TrainError> {
        self.vit.forward_staged(be, n, Some(self.dloss_scale()))?;
        if !sync.reports_blocks() {
            self.vit.backward(be)?;
            return Ok(());
        }
        self.vit.backward_reporting(be, Some(&mut |grads: &mut B::Buf, span: Span| sync.ready(be, grads, span)))?;
        Ok(())
    }

    /// The loss gradient's factor: 1/global batch (the mean), times the loss scale under fp16.
    fn dloss_scale(&self) -> f32 {
        match &self.loss_scaling {
            Some(ls) => ls.dloss_scale(self.plan.global_batch),
            None => 1.0 / self.plan.global_batch as f32,
        }
    }

    fn keep_losses(&mut self, be: &B, step: u64, n: usize) -> Result<(), TrainError> {
        let src = self.vit.losses_buf()?;
        let len = be.len(src);
        let mut dst = match self.spare_losses.iter().position(|b| be.len(b) == len) {
            Some(i) => self.spare_losses.swap_remove(i),
            None => be.alloc_f32(len)?,
        };
        be.copy(&mut dst, src)?;
        self.pending_losses.push((step, n, dst));
        Ok(())
    }

    /// The boundary of optimizer step `step` (0-based): finish the gradient sync, clip by the
    /// global norm and update on the device with learning rate `lr`, zero the gradients. With
    /// `read_norm` the pre-clip global gradient norm comes back (one host synchronization).
    /// Returns it and the bytes this rank communicated.
    ///
    /// Under fp16 loss scaling the global sum of squares is read every step (the overflow
    /// check, agreed by every rank): an overflow skips the update (weights, optimizer state
    /// and Adam's step count stay; the gradients are zeroed; the norm reads as inf), else the
    /// update unscales, and Adam counts only the applied steps.
    pub fn boundary(&mut self, be: &B, sync: &mut dyn GradSync<B>, lr: f64, step: u64, read_norm: bool) -> Result<(Option<f64>, u64), TrainError> {
        let t0 = std::time::Instant::now();
        let bytes = sync.finish(be, &mut self.vit.grads)?;
        self.mark(be, Phase::CommExposed)?;
        let t1 = std::time::Instant::now();
        let mut hyper = StepHyper { lr: lr as f32, step: step + 1, grad_scale: 1.0, clip_norm: self.clip };
        let mut unscaled_norm = None;
        if let Some(ls) = self.loss_scaling.as_mut() {
            match ls.at_boundary(sync.global_sum_squares(be, &self.vit.grads, FP16_INF_FROM)?)? {
                Verdict::Skip => {
                    self.vit.zero_grads(be)?;
                    self.mark(be, Phase::Optimizer)?;
                    return Ok((read_norm.then_some(f64::INFINITY), bytes));
                }
                Verdict::Apply { grad_scale, norm } => {
                    (hyper.grad_scale, hyper.step) = (grad_scale, ls.applied(step + 1));
                    unscaled_norm = Some(norm);
                }
            }
        }
        let up = sync.update(be, &mut self.vit, &mut self.opt_state, &self.optimizer, &self.decay, hyper, read_norm && unscaled_norm.is_none())?;
        self.vit.zero_grads(be)?;
        self.mark(be, Phase::Optimizer)?;
        let t2 = std::time::Instant::now();
        if let Some(tr) = self.trace.as_mut() {
            tr.span(Track::Compute, "wait for gradients", t0, t1, args(&[("step", step as f64)]));
            tr.span(Track::Compute, "clip + optimizer", t1, t2, args(&[("step", step as f64)]));
        }
        Ok((if read_norm { unscaled_norm.or(up.norm) } else { None }, bytes + up.bytes))
    }

    /// The summed per-image losses of every step since the last call, as (step, sum), in step
    /// order (one host synchronization).
    pub fn take_losses(&mut self, be: &B) -> Result<Vec<(u64, f64)>, TrainError> {
        let mut out: Vec<(u64, f64)> = Vec::new();
        for (step, n, buf) in self.pending_losses.drain(..) {
            let losses = be.download(&buf)?;
            let sum: f64 = losses[..n].iter().map(|&v| v as f64).sum();
            match out.last_mut() {
                Some((s, acc)) if *s == step => *acc += sum,
                _ => out.push((step, sum)),
            }
            self.spare_losses.push(buf);
        }
        Ok(out)
    }
}

/// Trace-event arguments from (name, number) pairs.
fn args(kv: &[(&str, f64)]) -> serde_json::Map<String, serde_json::Value> {
    kv.iter().map(|(k, v)| (k.to_string(), serde_json::json!(v))).collect()
}
