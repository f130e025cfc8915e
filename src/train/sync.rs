//! Gradient sync as a plan: the parameter groups that the backward finishes one after another
//! (head with the final norm, the blocks from last to first, the embedding; see
//! `Vit::gradient_groups`) are cut into buckets in that order, a small first bucket so the
//! first reduction starts early (PyTorch DDP's 1 MiB), then buckets of about
//! `zero_optimization.reduce_bucket_size` elements. A bucket is whole groups, so it is one
//! contiguous span of the flat gradient buffer.
//!
//! During the step's last backward, `BucketSync` starts each bucket's all-reduce on the
//! communicator as soon as its last group is final (`Comm::start`: the TCP ring's worker
//! thread, or NCCL's stream) and lets the backward go on; the boundary waits for whatever is
//! still in flight. The time of that wait is the *exposed* communication; the time from each
//! start to its completion is the communication itself.

use std::time::Instant;

use serde::Serialize;

use crate::backend::{Backend, ParamGroups, Span, StepHyper};
use crate::comm::{Collective, Comm, ReduceOp, Wire, Work};
use crate::config::{CommDtype, GradComm, OptimizerConfig};
use crate::model::Vit;
use crate::train::error::TrainError;

/// How a step's gradients are combined across ranks. The backward of the step's last pass calls
/// `ready` as each block's gradients are complete (reverse order: head, last block … first
/// block, embedding) when `reports_blocks` says so; the boundary calls `finish` once every
/// gradient is written, and waits for it.
pub trait GradSync<B: Backend> {
    /// Whether the backward should report finished blocks (it then flushes the deferred bias
    /// sums per block, which costs a few launches).
    fn reports_blocks(&self) -> bool {
        false
    }
    /// Whether every pass's backward (of every micro-batch, not only the step's last) must
    /// hand each group to `ready`: ZeRO-3, whose ranks keep only their pieces of the
    /// gradients, so each pass's gradients are reduced group by group as the backward
    /// produces them.
    fn reduces_every_pass(&self) -> bool {
        false
    }
    /// The gradients of `span` are final for this step (ZeRO-3: this pass's gradients of the
    /// group `span`, at offset 0 of `grads`, the gradient slot, reduced before returning).
    fn ready(&mut self, _be: &B, _grads: &mut B::Buf, _span: Span) -> Result<(), TrainError> {
        Ok(())
    }
    /// Every gradient is written: complete the reduction. Returns the bytes this rank sent.
    fn finish(&mut self, be: &B, grads: &mut B::Buf) -> Result<u64, TrainError>;
    /// After `finish`: the sum of squares of the whole reduced gradient, the same value on
    /// every rank (the fp16 overflow check: non-finite exactly when some gradient is, or is of
    /// magnitude ≥ `inf_from`, as `Backend::sum_squares`).
    fn global_sum_squares(&mut self, be: &B, grads: &B::Buf, inf_from: f32) -> Result<f64, TrainError> {
        Ok(be.sum_squares(grads, inf_from)?)
    }
    /// After `finish`: the optimizer step with `hyper` (clipping included), which leaves the
    /// updated weights on every rank. By default every rank updates every parameter from the
    /// whole reduced gradient; ZeRO (`train::zero`) updates this rank's shard and all-gathers.
    /// With `read_norm` the pre-clip global gradient norm comes back.
    #[allow(clippy::too_many_arguments)]
    fn update(&mut self, be: &B, vit: &mut Vit<B>, state: &mut B::Buf, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper, read_norm: bool) -> Result<Updated, TrainError> {
        let norm = if read_norm { Some(be.sum_squares(&vit.grads, f32::INFINITY)?.sqrt()) } else { None };
        vit.update(be, state, opt, decay, hyper)?;
        Ok(Updated { norm, bytes: 0 })
    }
}

/// What `GradSync::update` did besides the update itself.
#[derive(Clone, Copy, Debug, Default)]
pub struct Updated {
    /// The pre-clip global gradient norm, when asked for.
    pub norm: Option<f64>,
    /// Bytes the update communicated (ZeRO's all-gather of the weights).
    pub bytes: u64,
}

/// One rank: nothing to combine.
pub struct LocalGrads;

impl<B: Backend> GradSync<B> for LocalGrads {
    fn finish(&mut self, _be: &B, _grads: &mut B::Buf) -> Result<u64, TrainError> {
        Ok(0)
    }
}

/// Elements of the first bucket: 1 MiB of f32, PyTorch DDP's first bucket.
pub const FIRST_BUCKET_ELEMS: usize = 1 << 18;
/// `reduce_bucket_size` when the config gives none: 25 MiB of f32 (DDP's `bucket_cap_mb`).
/// DeepSpeed's own default, 5e8 elements, would put a whole ViT-B in one bucket and leave
/// nothing to overlap.
pub const DEFAULT_BUCKET_ELEMS: usize = 25 << 18;

/// The wire of the gradient all-reduce for `cfg` over `world` ranks, with DeepSpeed's
/// meaning: the values sent are each rank's mean gradient divided by
/// `gradient_predivide_factor` (or by the world size with `prescale_gradients`), and the sum
/// is scaled to the mean afterwards. The step's gradients are already divided by the global
/// batch (each rank's mean over its images / world), so the factors here are what turns that
/// into DeepSpeed's values and back. A power-of-two factor is exact in fp32 and bf16, so such
/// factors are not applied at all.
pub fn gradient_wire(cfg: &GradComm, world: usize) -> Wire {
    let (pre, post) = if cfg.prescale { (1.0, 1.0) } else { (world as f64 / cfg.predivide, cfg.predivide / world as f64) };
    let exact = |x: f64| x > 0.0 && (x.log2().fract() == 0.0);
    let (pre, post) = if exact(pre) && exact(post) { (1.0, 1.0) } else { (pre as f32, post as f32) };
    Wire { bf16: cfg.dtype == CommDtype::Bf16, pre, post }
}

/// One bucket: a span of the flat buffer and the groups (indices into the backward's order)
/// it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Bucket {
    pub span: Span,
    pub groups: std::ops::Range<usize>,
}

/// The buckets of a model, in the order the backward completes them.
#[derive(Clone, Debug, PartialEq)]
pub struct BucketPlan {
    pub buckets: Vec<Bucket>,
    /// For each group, its bucket.
    bucket_of: Vec<usize>,
}

impl BucketPlan {
    /// Cuts `groups` (contiguous spans in backward order, each adjacent to the next one below
    /// it in the buffer) into buckets: the first closes once it holds `first` elements, later
    /// ones once they hold `size`. A group larger than a bucket is a bucket of its own.
    pub fn new(groups: &[Span], first: usize, size: usize) -> Result<BucketPlan, String> {
        for w in groups.windows(2) {
            if w[1].off + w[1].len != w[0].off {
                return Err(format!("gradient groups are not contiguous in backward order: {:?} then {:?}", w[0], w[1]));
            }
        }
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut bucket_of = Vec::with_capacity(groups.len());
        let mut start = 0;
        let mut elems = 0;
        for (i, g) in groups.iter().enumerate() {
            elems += g.len;
            bucket_of.push(buckets.len());
            let cap = if buckets.is_empty() { first } else { size };
            if elems >= cap.max(1) || i + 1 == groups.len() {
                let lo = g.off;
                buckets.push(Bucket { span: Span { off: lo, len: elems }, groups: start..i + 1 });
                start = i + 1;
                elems = 0;
            }
        }
        Ok(BucketPlan { buckets, bucket_of })
    }

    /// The plan a run with `reduce_bucket_size = bucket_elems` uses: a first bucket of
    /// `FIRST_BUCKET_ELEMS` (or the bucket size, when smaller), then buckets of that size.
    pub fn for_bucket_size(groups: &[Span], bucket_elems: usize) -> Result<BucketPlan, String> {
        BucketPlan::new(groups, FIRST_BUCKET_ELEMS.min(bucket_elems), bucket_elems)
    }

    pub fn total(&self) -> usize {
        self.buckets.iter().map(|b| b.span.len).sum()
    }

    /// The bucket of group `g` in backward order (None past the last group).
    pub(crate) fn bucket_of(&self, g: usize) -> Option<usize> {
        self.bucket_of.get(g).copied()
    }
}

/// What the sync measured in one step.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct SyncTimes {
    /// Seconds the boundary waited for reductions still in flight (not hidden by the backward).
    pub exposed_s: f64,
    /// Seconds from each bucket's start to its completion, summed (what the reductions took).
    pub total_s: f64,
    pub bytes: u64,
}

/// One bucket's reduction, for the trace: when it started and completed (seconds since the
/// sync's epoch), and its bucket.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct BucketEvent {
    pub bucket: usize,
    pub start_s: f64,
    pub end_s: f64,
}

/// What both gradient syncs (this one and ZeRO's, `train::zero`) keep per step: which groups
/// of each bucket the backward has reported, the buckets' collectives in flight, and what they
/// measured.
pub struct BucketTracker {
    /// Groups of each bucket reported final so far.
    done_groups: Vec<usize>,
    /// (bucket, started, completed as polled, its collectives)
    in_flight: Vec<(usize, Instant, Option<Instant>, Vec<Work>)>,
    /// Instant the trace's times count from.
    epoch: Instant,
    pub times: SyncTimes,
    pub events: Vec<BucketEvent>,
}

impl BucketTracker {
    pub fn new(plan: &BucketPlan, epoch: Instant) -> Self {
        BucketTracker { done_groups: vec![0; plan.buckets.len()], in_flight: Vec::new(), epoch, times: SyncTimes::default(), events: Vec::new() }
    }

    /// The backward finished its next group, `span` (groups arrive in backward order, one
    /// call each): the bucket it completed, if it was that bucket's last group.
    pub fn group_done(&mut self, plan: &BucketPlan, span: Span) -> Result<Option<usize>, TrainError> {
        let g: usize = self.done_groups.iter().sum();
        let b = plan.bucket_of(g).ok_or_else(|| TrainError::Config(format!("the backward reported more gradient groups than the bucket plan has ({g})")))?;
        let bucket = &plan.buckets[b];
        if span.off < bucket.span.off || span.off + span.len > bucket.span.off + bucket.span.len {
            return Err(TrainError::Config(format!("gradient group {g} ({span:?}) lies outside its bucket {b} ({:?})", bucket.span)));
        }
        self.done_groups[b] += 1;
        Ok((self.done_groups[b] == bucket.groups.len()).then_some(b))
    }

    /// The buckets the backward did not report (a backward without reports), now marked
    /// complete: the boundary starts them.
    pub fn unreported(&mut self, plan: &BucketPlan) -> Vec<usize> {
        let mut out = Vec::new();
        for (b, bucket) in plan.buckets.iter().enumerate() {
            if self.done_groups[b] < bucket.groups.len() {
                self.done_groups[b] = bucket.groups.len();
                out.push(b);
            }
        }
        out
    }

    /// Bucket `b`'s collectives started now, sending `bytes`.
    pub fn started(&mut self, b: usize, works: Vec<Work>, bytes: u64) {
        self.times.bytes += bytes;
        self.in_flight.push((b, Instant::now(), None, works));
    }

    /// Bucket `b`'s collectives, started at `started` and waited for until now by the backward
    /// itself (ZeRO-3's per-pass reduction of a group in the gradient slot): all of it exposed.
    pub fn waited(&mut self, b: usize, started: Instant, bytes: u64) {
        let done = Instant::now();
        let s = (done - started).as_secs_f64();
        self.times.bytes += bytes;
        self.times.total_s += s;
        self.times.exposed_s += s;
        self.events.push(BucketEvent { bucket: b, start_s: (started - self.epoch).as_secs_f64(), end_s: (done - self.epoch).as_secs_f64() });
    }

    /// Notes which buckets have completed by now (the trace then shows when).
    pub fn poll<Buf>(&mut self, comm: &mut dyn Comm<Buf>) -> Result<(), TrainError> {
        for (_, _, done, works) in self.in_flight.iter_mut() {
            if done.is_none() {
                if let Some(last) = works.last() {
                    *done = comm.poll(last)?;
                }
            }
        }
        Ok(())
    }

    /// Waits for every bucket in flight (the exposed communication), records each one's time,
    /// and starts the next step afresh. Returns the bytes this step sent.
    pub fn wait_all<Buf>(&mut self, comm: &mut dyn Comm<Buf>, grads: &mut Buf) -> Result<u64, TrainError> {
        let t = Instant::now();
        comm.begin_waits()?;
        for (b, started, polled, works) in std::mem::take(&mut self.in_flight) {
            for w in works {
                comm.wait(w, grads)?;
            }
            // completed when a poll first saw it, else by the time its wait returned
            let done = polled.unwrap_or_else(Instant::now);
            self.times.total_s += (done - started).as_secs_f64();
            self.events.push(BucketEvent { bucket: b, start_s: (started - self.epoch).as_secs_f64(), end_s: (done - self.epoch).as_secs_f64() });
        }
        comm.end_waits()?;
        self.times.exposed_s += t.elapsed().as_secs_f64();
        self.done_groups.iter_mut().for_each(|d| *d = 0);
        Ok(std::mem::take(&mut self.times.bytes))
    }
}

/// The bucketed, overlapped gradient all-reduce of one step.
pub struct BucketSync<'c, Buf> {
    pub comm: &'c mut dyn Comm<Buf>,
    pub plan: &'c BucketPlan,
    pub track: BucketTracker,
    /// How the buckets travel (dtype, pre/post scaling).
    pub wire: Wire,
}

impl<'c, Buf> BucketSync<'c, Buf> {
    pub fn new(comm: &'c mut dyn Comm<Buf>, plan: &'c BucketPlan, epoch: Instant) -> Self {
        BucketSync { comm, plan, track: BucketTracker::new(plan, epoch), wire: Wire::PLAIN }
    }

    fn start_bucket(&mut self, grads: &mut Buf, b: usize) -> Result<(), TrainError> {
        let span = self.plan.buckets[b].span;
        self.comm.label_next(&format!("gradient bucket {b} of {}", self.plan.buckets.len()));
        let work = self.comm.start_as(Collective::AllReduce(ReduceOp::Sum), grads, span, self.wire)?;
        self.track.started(b, vec![work], (span.len * self.wire.elem_bytes()) as u64);
        Ok(())
    }
}

impl<B: Backend> GradSync<B> for BucketSync<'_, B::Buf> {
    fn reports_blocks(&self) -> bool {
        self.comm.world_size() > 1
    }

    fn ready(&mut self, _be: &B, grads: &mut B::Buf, span: Span) -> Result<(), TrainError> {
        if self.comm.world_size() == 1 {
            return Ok(());
        }
        if let Some(b) = self.track.group_done(self.plan, span)? {
            self.start_bucket(grads, b)?;
        }
        self.track.poll(&mut *self.comm)
    }

    fn finish(&mut self, _be: &B, grads: &mut B::Buf) -> Result<u64, TrainError> {
        if self.comm.world_size() == 1 {
            return Ok(0);
        }
        for b in self.track.unreported(self.plan) {
            self.start_bucket(grads, b)?;
        }
        self.track.wait_all(&mut *self.comm, grads)
    }

    // Every rank holds the same reduced gradient; the ranks still agree on whether it
    // overflowed (DeepSpeed all-reduces its overflow flag), so no rank can step alone.
    fn global_sum_squares(&mut self, be: &B, grads: &B::Buf, inf_from: f32) -> Result<f64, TrainError> {
        let sq = be.sum_squares(grads, inf_from)?;
        if self.comm.world_size() == 1 {
            return Ok(sq);
        }
        let mut overflowed = [if sq.is_finite() { 0.0 } else { 1.0 }];
        self.comm.all_reduce_host(&mut overflowed)?;
        Ok(if overflowed[0] > 0.0 { f64::INFINITY } else { sq })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Groups like a ViT's in backward order: head (small), blocks, embedding.
    fn groups(lens: &[usize]) -> Vec<Span> {
        let total: usize = lens.iter().sum();
        let mut off = total;
        lens.iter()
            .map(|&len| {
                off -= len;
                Span { off, len }
            })
            .collect()
    }

    #[test]
    fn first_bucket_is_small_then_buckets_fill_to_the_size() {
        let g = groups(&[10, 100, 100, 100, 100, 30]);
        let p = BucketPlan::new(&g, 50, 250).unwrap();
        let spans: Vec<(usize, usize)> = p.buckets.iter().map(|b| (b.span.off, b.span.len)).collect();
        // head+block (110 ≥ 50), then 100+100+100 ≥ 250, then the rest (130)
        assert_eq!(spans, vec![(330, 110), (30, 300), (0, 30)]);
        assert_eq!(p.buckets.iter().map(|b| b.groups.clone()).collect::<Vec<_>>(), vec![0..2, 2..5, 5..6]);
        assert_eq!(p.total(), 440);
        // every group maps to the bucket that covers it
        for (i, s) in g.iter().enumerate() {
            let b = &p.buckets[p.bucket_of[i]];
            assert!(b.groups.contains(&i) && s.off >= b.span.off && s.off + s.len <= b.span.off + b.span.len);
        }
    }

    #[test]
    fn a_group_larger_than_a_bucket_is_its_own_bucket_and_one_bucket_can_hold_all() {
        let g = groups(&[5, 1000, 1000, 7]);
        let p = BucketPlan::new(&g, 1, 10).unwrap();
        assert_eq!(p.buckets.iter().map(|b| b.span.len).collect::<Vec<_>>(), vec![5, 1000, 1000, 7]);
        let one = BucketPlan::new(&g, usize::MAX, usize::MAX).unwrap();
        assert_eq!(one.buckets.len(), 1);
        assert_eq!(one.buckets[0].span, Span { off: 0, len: 2012 });
    }

    #[test]
    fn the_wire_follows_deepspeeds_scaling() {
        let g = |prescale, predivide| GradComm { dtype: CommDtype::Fp32, prescale, predivide };
        // defaults over 4 ranks: ×4 then ÷4, both exact, so nothing is applied
        assert_eq!(gradient_wire(&g(false, 1.0), 4), Wire::PLAIN);
        // over 3 ranks the default scaling is not exact: ×3 before, ÷3 after
        let w = gradient_wire(&g(false, 1.0), 3);
        assert_eq!((w.pre, w.post), (3.0, 1.0 / 3.0));
        // the pre-divide factor: values sent are the mean / 1.5
        let w = gradient_wire(&g(false, 1.5), 4);
        assert!((w.pre - 4.0 / 1.5).abs() < 1e-6 && (w.post - 1.5 / 4.0).abs() < 1e-6);
        // prescale: the values sent are the mean / world, which the step's gradients already are
        assert_eq!(gradient_wire(&g(true, 1.5), 3), Wire::PLAIN);
        let b = GradComm { dtype: CommDtype::Bf16, prescale: false, predivide: 1.0 };
        assert_eq!(gradient_wire(&b, 2), Wire { bf16: true, pre: 1.0, post: 1.0 });
        assert_eq!(gradient_wire(&b, 2).elem_bytes(), 2);
    }

    #[test]
    fn groups_out_of_order_are_refused() {
        let mut g = groups(&[10, 20, 30]);
        g.swap(1, 2);
        assert!(BucketPlan::new(&g, 1, 1).unwrap_err().contains("not contiguous"));
    }

    #[test]
    fn the_plan_covers_a_real_model_exactly() {
        let m = crate::model::ModelConfig::preset("vit_base_patch16_224").unwrap();
        let be = crate::backend::cpu::Cpu::new();
        let vit = crate::model::Vit::new(&be, m).unwrap();
        let p = BucketPlan::new(&vit.gradient_groups(), FIRST_BUCKET_ELEMS, DEFAULT_BUCKET_ELEMS).unwrap();
        assert_eq!(p.total(), vit.table.total);
        // the head with the final norm (770k values, 1000 classes) fills the first bucket;
        // every ViT-B block (7.1M values) exceeds 25 MiB of f32 and is a bucket of its own;
        // the embedding is the last
        assert_eq!(p.buckets.len(), 14);
        assert_eq!(p.buckets[0].groups, 0..1);
        assert_eq!(p.buckets[13].span.off, 0);
    }
}
