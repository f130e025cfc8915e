//! ZeRO stages 1 and 2: each rank keeps and updates only its shard of the optimizer state,
//! over the same buckets as the plain gradient sync (`train::sync::BucketPlan`).
//!
//! Layout. Every bucket is one contiguous span of the flat buffers. Its longest prefix whose
//! length divides by the world size W is cut into W equal shards (`comm::shard`): rank r owns
//! shard r of every bucket. The few elements left over (fewer than W per bucket, its *tail*)
//! are owned by every rank: each rank all-reduces and updates them identically, so they need
//! no gather. A rank's optimizer state is one compact buffer holding, piece after piece, the
//! state of each owned span (Adam: its m then its v), `optimizer_state_len(P)/W` plus the
//! tails instead of `optimizer_state_len(P)`.
//!
//! One optimizer step:
//!
//! ```text
//! micro-batches 1..GAS−1: backward, gradients accumulate locally (no communication)
//! last micro-batch: as each bucket is final in the backward, start its reduction
//!     stage 1: all-reduce the bucket        (every rank holds the whole reduced gradient)
//!     stage 2: reduce-scatter its prefix    (a rank holds only its shard of it)
//!              + all-reduce its tail
//! boundary: wait → Σ g² of the owned shards, all-reduced (+ the tails once) → clip factor
//!           → optimizer on the owned pieces → all-gather every bucket's prefix of the
//!           weights the forward reads
//! ```
//!
//! Stage 3 (`model::partition`) partitions the gradients too: every pass of every micro-batch
//! reduces each group as its backward finishes it, in the gradient slot (`reduce_group`:
//! reduce-scatter of its prefix, all-reduce of its tail, waited for), and each rank adds its
//! pieces into its partitioned gradients; the boundary then has nothing left to wait for.
//!
//! What is gathered depends on the backend. The CPU's forward reads the f32 weights, so every
//! rank keeps them whole and the gather moves f32 values. A GPU's forward reads a bf16 compute
//! copy: there a rank keeps only its pieces of the f32 master weights, after its optimizer
//! state in one compact buffer (`with_master_shard`), releases the whole f32 weights, and its
//! update writes the bf16 copy of its pieces, which the ranks all-gather (2 bytes a value).
//! Each value a rank receives is the owner's bf16 rounding of the same f32 master value that
//! stage 0 would round, so the compute copy is stage 0's bit for bit.
//!
//! Clipping is the stage-0 rule (`StepHyper::effective_grad_scale`) applied to the global norm,
//! so the update is stage 0's up to the order of the f64 sum of squares. Computing that norm
//! reads one number back to the host (every rank must know it before its update): with
//! `gradient_clipping` on, a step at stage 1/2 has one host synchronization that stage 0 on a
//! GPU does not. Checkpoints hold the gathered state (`gather_state`, `gather_master`), in the
//! stage-0 format, so any stage at any world size resumes from any checkpoint (`shard_state`,
//! `seed_master`).

use std::time::Instant;

use crate::backend::{optimizer_state_len, Backend, ParamGroups, ShardPiece, Span, StepHyper};
use crate::comm::{shard, Collective, Comm, ReduceOp, Wire, Work};
use crate::config::OptimizerConfig;
use crate::model::partition::GroupPart;
use crate::model::Vit;
use crate::train::error::TrainError;
use crate::train::sync::{GradSync, Updated};
use crate::train::sync::{BucketEvent, BucketPlan, BucketSync, BucketTracker, SyncTimes};

/// Which rank owns what at a ZeRO stage, and how the gradients travel.
#[derive(Clone, Debug, PartialEq)]
pub struct ZeroLayout {
    /// 1 or 2.
    pub stage: u8,
    pub world: usize,
    pub rank: usize,
    /// Parameters (elements of the flat buffers).
    pub total: usize,
    /// Optimizer state values per parameter (Adam 2, SGD 1).
    per_param: usize,
    /// For each bucket: (prefix divisible by the world size, tail of fewer than W elements).
    pub parts: Vec<(Span, Span)>,
    /// This rank's pieces: (span of the flat buffers, offset of its state in the compact
    /// state); each bucket's own shard of its prefix, then its tail.
    pub pieces: Vec<(Span, usize)>,
    /// Elements of this rank's compact optimizer state.
    pub state_len: usize,
    /// Stage 2 reduce-scatters (`zero_optimization.reduce_scatter`); false: all-reduce.
    pub reduce_scatter: bool,
    /// Whether this rank keeps only its pieces of the f32 master weights, after its optimizer
    /// state in the same compact buffer (`with_master_shard`: where the forward reads a compute
    /// copy, so the whole f32 weights are needed by nobody).
    pub master_shard: bool,
}

impl ZeroLayout {
    pub fn new(plan: &BucketPlan, opt: &OptimizerConfig, stage: u8, world: usize, rank: usize, reduce_scatter: bool) -> Result<ZeroLayout, TrainError> {
        if !(1..=3).contains(&stage) || world == 0 || rank >= world {
            return Err(TrainError::Config(format!("ZeRO layout for stage {stage}, rank {rank} of {world}: expected stage 1, 2 or 3 and a rank below the world size")));
        }
        let per_param = optimizer_state_len(opt, 1);
        let mut parts = Vec::with_capacity(plan.buckets.len());
        let mut pieces = Vec::new();
        let mut state_len = 0;
        for b in &plan.buckets {
            let cut = b.span.len - b.span.len % world;
            let prefix = Span { off: b.span.off, len: cut };
            let tail = Span { off: b.span.off + cut, len: b.span.len - cut };
            parts.push((prefix, tail));
            for piece in [shard(prefix, world, rank), tail] {
                if piece.len > 0 {
                    pieces.push((piece, state_len));
                    state_len += per_param * piece.len;
                }
            }
        }
        Ok(ZeroLayout { stage, world, rank, total: plan.total(), per_param, parts, pieces, state_len, reduce_scatter, master_shard: false })
    }

    /// The same layout with this rank's pieces of the master weights kept after its optimizer
    /// state (`buffer_len` grows by the owned elements), for a backend whose forward reads a
    /// compute copy: the whole f32 weights are then released (`Vit::release_master`), the
    /// update writes the compute copy of the owned pieces, and the ranks all-gather that copy
    /// (bf16 on a GPU: half the bytes of the f32 weights).
    pub fn with_master_shard(mut self) -> Self {
        self.master_shard = true;
        self
    }

    /// Stage 3's partition of the weights: one `GroupPart` per gradient group in flat order
    /// (embedding, blocks, head), the offsets into this rank's pieces laid out as
    /// `shard_master` lays them out. Stage 3's buckets are the groups (`zero3_buckets`);
    /// `groups` is how many the model has.
    pub fn partition_parts(&self, groups: usize) -> Result<Vec<GroupPart>, TrainError> {
        if self.stage != 3 || self.parts.len() != groups {
            return Err(TrainError::Config(format!("stage {} layout of {} buckets: partitioning weights needs stage 3 with one bucket per parameter group ({groups})", self.stage, self.parts.len())));
        }
        let mut out = Vec::with_capacity(groups);
        let mut at = 0;
        for &(prefix, tail) in &self.parts {
            let sh = shard(prefix, self.world, self.rank);
            let shard_at = at;
            at += sh.len;
            out.push(GroupPart { span: Span { off: prefix.off, len: prefix.len + tail.len }, prefix, shard: sh, shard_at, tail, tail_at: at });
            at += tail.len;
        }
        // the buckets run in backward order; the partition's groups in flat order
        out.reverse();
        Ok(out)
    }

    /// Stage 3's pieces with the offsets of their weights in the partition's own buffer
    /// (`Partition::owned`).
    pub fn owned_pieces(&self) -> Vec<ShardPiece> {
        self.shard_pieces().into_iter().map(|p| ShardPiece { master_off: p.master_off - self.state_len, ..p }).collect()
    }

    /// Elements this rank owns (its shards and the replicated tails).
    pub fn owned_len(&self) -> usize {
        self.pieces.iter().map(|(s, _)| s.len).sum()
    }

    /// Elements of the compact buffer: the optimizer state, then (with a master shard) the
    /// owned master weights.
    pub fn buffer_len(&self) -> usize {
        self.state_len + if self.master_shard { self.owned_len() } else { 0 }
    }

    /// The owned pieces with the offsets of their state and master weights in the compact
    /// buffer (the master offsets are meaningful with `master_shard`).
    pub fn shard_pieces(&self) -> Vec<ShardPiece> {
        let mut at = self.state_len;
        self.pieces
            .iter()
            .map(|&(span, state_off)| {
                let p = ShardPiece { span, state_off, master_off: at };
                at += span.len;
                p
            })
            .collect()
    }

    /// The compact buffer's master part cut from whole weights (`total` values).
    pub fn shard_master(&self, full: &[f32]) -> Result<Vec<f32>, TrainError> {
        if full.len() != self.total {
            return Err(TrainError::Config(format!("{} weights, expected {}", full.len(), self.total)));
        }
        Ok(self.pieces.iter().flat_map(|&(span, _)| full[span.range()].iter().copied()).collect())
    }

    /// Writes this rank's pieces of whole weights into the master part of its compact buffer.
    pub fn seed_master<B: Backend>(&self, be: &B, buffer: &mut B::Buf, full: &[f32]) -> Result<(), TrainError> {
        if !self.master_shard {
            return Err(TrainError::Config("seed_master on a layout that keeps whole master weights".into()));
        }
        be.upload(buffer, self.state_len, &self.shard_master(full)?)?;
        Ok(())
    }

    /// Hands `vit`'s whole f32 weights over to this rank's master shard in `buffer` (its
    /// pieces copied in, then the whole copy released), when the layout keeps a master shard.
    pub fn take_master<B: Backend>(&self, be: &B, vit: &mut Vit<B>, buffer: &mut B::Buf) -> Result<(), TrainError> {
        if self.master_shard {
            let host = vit.params_host(be)?;
            self.seed_master(be, buffer, &host)?;
            vit.release_master(be)?;
        }
        Ok(())
    }

    /// The whole f32 master weights assembled from every rank's master shard (a collective,
    /// as `gather_state`).
    pub fn gather_master<B: Backend>(&self, be: &B, comm: &mut dyn Comm<B::Buf>, buffer: &B::Buf) -> Result<Vec<f32>, TrainError> {
        let compact = self.download_buffer(be, buffer)?;
        self.gather_owned(be, comm, &compact[self.state_len..])
    }

    /// A whole flat buffer assembled from every rank's values of the elements it owns (`owned`:
    /// this rank's pieces back to back, as the master part of the compact buffer lays them
    /// out): a collective, as `gather_master`.
    pub fn gather_owned<B: Backend>(&self, be: &B, comm: &mut dyn Comm<B::Buf>, owned: &[f32]) -> Result<Vec<f32>, TrainError> {
        if owned.len() != self.owned_len() {
            return Err(TrainError::Config(format!("rank {}: {} owned values, the layout owns {}", self.rank, owned.len(), self.owned_len())));
        }
        let mut full = vec![0.0; self.total];
        let mut at = 0;
        for (span, _) in &self.pieces {
            full[span.range()].copy_from_slice(&owned[at..at + span.len]);
            at += span.len;
        }
        self.all_gather_components(be, comm, &mut full, 1)?;
        Ok(full)
    }

    fn download_buffer<B: Backend>(&self, be: &B, buffer: &B::Buf) -> Result<Vec<f32>, TrainError> {
        let compact = be.download(buffer)?;
        if compact.len() != self.buffer_len() {
            return Err(TrainError::Config(format!("rank {}: sharded optimizer buffer of {} values, the layout expects {}", self.rank, compact.len(), self.buffer_len())));
        }
        Ok(compact)
    }

    /// Every rank's shard of each bucket prefix into `full` (`components` consecutive arrays
    /// of `total` values, each laid out as the flat buffers), every rank's own shard already
    /// in place. The shards travel one bucket at a time through a device buffer of the
    /// largest bucket, so this adds no more than that to the device's memory.
    fn all_gather_components<B: Backend>(&self, be: &B, comm: &mut dyn Comm<B::Buf>, full: &mut [f32], components: usize) -> Result<(), TrainError> {
        if self.world == 1 {
            return Ok(());
        }
        let widest = self.parts.iter().map(|(p, _)| p.len).max().unwrap_or(0);
        let mut buf = be.alloc_f32(widest.max(1))?;
        for c in 0..components {
            for &(prefix, _) in self.parts.iter().filter(|(p, _)| p.len > 0) {
                let at = c * self.total + prefix.off;
                let mine = shard(Span { off: 0, len: prefix.len }, self.world, self.rank);
                be.upload(&mut buf, mine.off, &full[at + mine.off..at + mine.off + mine.len])?;
                comm.all_gather(&mut buf, Span { off: 0, len: prefix.len })?;
                let got = be.download(&buf)?;
                full[at..at + prefix.len].copy_from_slice(&got[..prefix.len]);
            }
        }
        Ok(())
    }

    /// Stage 3: this rank's own shards and the replicated tails as spans of its partitioned
    /// gradients (laid out as `Partition::owned`: per bucket its shard, then its tail).
    fn partitioned_spans(&self) -> (Vec<Span>, Vec<Span>) {
        let (mut shards, mut tails) = (Vec::new(), Vec::new());
        let mut at = 0;
        for &(prefix, tail) in &self.parts {
            let sh = shard(prefix, self.world, self.rank);
            if sh.len > 0 {
                shards.push(Span { off: at, len: sh.len });
            }
            at += sh.len;
            if tail.len > 0 {
                tails.push(Span { off: at, len: tail.len });
            }
            at += tail.len;
        }
        (shards, tails)
    }

    /// Whether the boundary reduce-scatters (stage 2 with `reduce_scatter`).
    pub fn scatters(&self) -> bool {
        self.stage >= 2 && self.reduce_scatter
    }

    /// The owned spans that no other rank owns (shards of the prefixes).
    fn own_shards(&self) -> Vec<Span> {
        self.parts.iter().map(|&(p, _)| shard(p, self.world, self.rank)).filter(|s| s.len > 0).collect()
    }

    fn tails(&self) -> Vec<Span> {
        self.parts.iter().map(|&(_, t)| t).filter(|t| t.len > 0).collect()
    }

    /// Elements of the whole (stage-0) optimizer state.
    pub fn full_state_len(&self) -> usize {
        self.per_param * self.total
    }

    /// This rank's compact state cut from the whole state (`optimizer_state_len(P)` values,
    /// the stage-0 and checkpoint layout: Adam's m of every parameter, then v).
    pub fn shard_state(&self, full: &[f32]) -> Result<Vec<f32>, TrainError> {
        if full.len() != self.full_state_len() {
            return Err(TrainError::Config(format!("optimizer state of {} values, expected {} for {} parameters", full.len(), self.full_state_len(), self.total)));
        }
        let mut out = vec![0.0; self.state_len];
        for &(span, soff) in &self.pieces {
            for c in 0..self.per_param {
                let src = c * self.total + span.off;
                out[soff + c * span.len..soff + (c + 1) * span.len].copy_from_slice(&full[src..src + span.len]);
            }
        }
        Ok(out)
    }

    /// Writes this rank's compact state into its places in a whole state.
    fn place_state(&self, compact: &[f32], full: &mut [f32]) {
        for &(span, soff) in &self.pieces {
            for c in 0..self.per_param {
                let dst = c * self.total + span.off;
                full[dst..dst + span.len].copy_from_slice(&compact[soff + c * span.len..soff + (c + 1) * span.len]);
            }
        }
    }

    /// The whole optimizer state, assembled from every rank's shard (a collective: every rank
    /// calls it and gets the same values); assembled on the host.
    pub fn gather_state<B: Backend>(&self, be: &B, comm: &mut dyn Comm<B::Buf>, state: &B::Buf) -> Result<Vec<f32>, TrainError> {
        let compact = self.download_buffer(be, state)?;
        let mut full = vec![0.0; self.full_state_len()];
        self.place_state(&compact[..self.state_len], &mut full);
        self.all_gather_components(be, comm, &mut full, self.per_param)?;
        Ok(full)
    }
}

/// The ZeRO gradient sync and sharded update of one optimizer step.
pub struct ZeroSync<'c, Buf> {
    pub comm: &'c mut dyn Comm<Buf>,
    pub plan: &'c BucketPlan,
    pub layout: &'c ZeroLayout,
    /// Start each bucket's reduction while the backward goes on (`zero_optimization.overlap_comm`);
    /// false: all of them at the boundary.
    pub overlap: bool,
    pub track: BucketTracker,
    /// Collectives started, for the tests that no micro-batch but the last communicates.
    pub started: usize,
    /// How the gradients travel (`train::sync::gradient_wire`: bf16 and the pre/post scaling
    /// of `communication_data_type` and `gradient_predivide_factor`), where the transport can
    /// reduce-scatter that way (NCCL); plain f32 otherwise.
    pub wire: Wire,
}

impl<'c, Buf> ZeroSync<'c, Buf> {
    pub fn new(comm: &'c mut dyn Comm<Buf>, plan: &'c BucketPlan, layout: &'c ZeroLayout, overlap: bool, epoch: Instant) -> Self {
        ZeroSync { comm, plan, layout, overlap, track: BucketTracker::new(plan, epoch), started: 0, wire: Wire::PLAIN }
    }

    fn start(&mut self, op: Collective, buf: &mut Buf, span: Span) -> Result<Work, TrainError> {
        self.started += 1;
        Ok(self.comm.start(op, buf, span)?)
    }

    fn start_gradients(&mut self, op: Collective, buf: &mut Buf, span: Span) -> Result<Work, TrainError> {
        self.started += 1;
        Ok(self.comm.start_as(op, buf, span, self.wire)?)
    }

    /// ZeRO-3: this pass's gradients of the group `span` (a bucket), at offset 0 of the
    /// gradient slot, reduced over the ranks there: its prefix reduce-scattered (this rank's
    /// shard holds the sum), its tail all-reduced, and waited for before returning, since the
    /// backward adds this rank's pieces into its partitioned gradients next and then reuses
    /// the slot. Bytes counted as `start_bucket` counts them.
    fn reduce_group(&mut self, slot: &mut Buf, span: Span) -> Result<(), TrainError> {
        let b = self.plan.buckets.iter().position(|k| k.span == span).ok_or_else(|| TrainError::Config(format!("ZeRO-3: the backward reported {span:?}, which is no parameter group of the partition")))?;
        let (prefix, tail) = self.layout.parts[b];
        let value = self.wire.elem_bytes();
        let started = Instant::now();
        let mut works = Vec::new();
        let bytes = if self.layout.scatters() {
            if prefix.len > 0 {
                works.push(self.start_gradients(Collective::ReduceScatter(ReduceOp::Sum), slot, Span { off: 0, len: prefix.len })?);
            }
            if tail.len > 0 {
                works.push(self.start_gradients(Collective::AllReduce(ReduceOp::Sum), slot, Span { off: prefix.len, len: tail.len })?);
            }
            prefix.len * value / 2 + tail.len * value
        } else {
            works.push(self.start_gradients(Collective::AllReduce(ReduceOp::Sum), slot, Span { off: 0, len: span.len })?);
            span.len * value
        };
        for w in works {
            self.comm.wait(w, slot)?;
        }
        self.track.waited(b, started, bytes as u64);
        Ok(())
    }

    /// Starts bucket `b`'s reduction. Bytes are counted as the all-reduce of the same
    /// values would be (the busbw the metrics derive stays comparable across stages): a
    /// reduce-scatter and the all-gather that follows it count half each.
    fn start_bucket(&mut self, grads: &mut Buf, b: usize) -> Result<(), TrainError> {
        let span = self.plan.buckets[b].span;
        let (prefix, tail) = self.layout.parts[b];
        let mut works = Vec::new();
        let value = self.wire.elem_bytes();
        if self.layout.scatters() {
            if prefix.len > 0 {
                works.push(self.start_gradients(Collective::ReduceScatter(ReduceOp::Sum), grads, prefix)?);
            }
            if tail.len > 0 {
                works.push(self.start_gradients(Collective::AllReduce(ReduceOp::Sum), grads, tail)?);
            }
            let bytes = (prefix.len * value / 2 + tail.len * value) as u64;
            self.track.started(b, works, bytes);
        } else {
            works.push(self.start_gradients(Collective::AllReduce(ReduceOp::Sum), grads, span)?);
            self.track.started(b, works, (span.len * value) as u64);
        }
        Ok(())
    }
}

impl<B: Backend> GradSync<B> for ZeroSync<'_, B::Buf> {
    fn reports_blocks(&self) -> bool {
        (self.overlap || self.layout.stage == 3) && self.comm.world_size() > 1
    }

    fn reduces_every_pass(&self) -> bool {
        self.layout.stage == 3 && self.comm.world_size() > 1
    }

    fn ready(&mut self, _be: &B, grads: &mut B::Buf, span: Span) -> Result<(), TrainError> {
        if self.comm.world_size() == 1 {
            return Ok(());
        }
        if self.layout.stage == 3 {
            return self.reduce_group(grads, span);
        }
        if !self.overlap {
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
        if self.layout.stage == 3 {
            // every group of every pass was reduced during its backward
            return Ok(std::mem::take(&mut self.track.times.bytes));
        }
        for b in self.track.unreported(self.plan) {
            self.start_bucket(grads, b)?;
        }
        self.track.wait_all(&mut *self.comm, grads)
    }

    // the global norm: every rank's own shards once (summed over ranks), the replicated
    // tails once (stage 3: in its partitioned gradients, where only those are)
    fn global_sum_squares(&mut self, be: &B, grads: &B::Buf, inf_from: f32) -> Result<f64, TrainError> {
        let l = self.layout;
        let (shards, tails) = if l.stage == 3 { l.partitioned_spans() } else { (l.own_shards(), l.tails()) };
        let mut own = [be.sum_squares_spans(grads, &shards, inf_from)?];
        if l.world > 1 {
            self.comm.all_reduce_host(&mut own)?;
        }
        Ok(own[0] + be.sum_squares_spans(grads, &tails, inf_from)?)
    }

    fn update(&mut self, be: &B, vit: &mut Vit<B>, state: &mut B::Buf, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper, read_norm: bool) -> Result<Updated, TrainError> {
        let l = self.layout;
        let norm = if hyper.clip_norm > 0.0 || read_norm { Some(self.global_sum_squares(be, &vit.grads, f32::INFINITY)?.sqrt()) } else { None };
        let grad_scale = match norm {
            Some(n) if hyper.clip_norm > 0.0 => hyper.effective_grad_scale(n),
            _ => hyper.grad_scale,
        };
        let sharded = StepHyper { grad_scale, clip_norm: 0.0, ..hyper };
        if l.stage == 3 {
            // this rank's pieces of the weights updated in the partition from its partitioned
            // gradients (laid out as the pieces), then the resident groups gathered whole
            // again (the blocks are gathered as the passes reach them)
            let pieces = l.owned_pieces();
            let (part, grads) = vit.partition_and_grads().ok_or_else(|| TrainError::Config("ZeRO stage 3 on a model whose weights are not partitioned".into()))?;
            be.optimizer_step_master(&mut part.owned, grads, state, &pieces, opt, decay, sharded)?;
            let t = Instant::now();
            part.refresh(be)?;
            let comm_s = t.elapsed().as_secs_f64();
            self.track.times.total_s += comm_s;
            self.track.times.exposed_s += comm_s;
            // every gather of the step (forward, backward, this one), counted as the update's
            // gather is below: half the bytes of an all-reduce of the same f32 values, a
            // quarter where the gathered weights are 2-byte (a GPU's bf16)
            let gathered = part.take_gathered();
            let per_elem = if part.in_compute_dtype() { 1 } else { 2 };
            let bytes = if l.world > 1 { per_elem * gathered } else { 0 };
            return Ok(Updated { norm: if read_norm { norm } else { None }, bytes });
        }
        // Every rank's updated shards to every rank: the compute copy (bf16 on a GPU) when the
        // master weights are sharded too, else the f32 weights (which the CPU's forward reads).
        // Bytes count as the all-reduce of the same values would (see `start_bucket`): half
        // each for the f32 gather, a quarter for a 2-byte one.
        let gathered: &mut B::Buf = if l.master_shard {
            let pieces = l.shard_pieces();
            let (grads, compute) = vit.grads_and_compute();
            let compute = compute.ok_or_else(|| TrainError::Config("ZeRO master shard without a compute copy".into()))?;
            be.optimizer_step_shard(state, grads, compute, &pieces, opt, decay, sharded)?;
            compute
        } else {
            be.optimizer_step_pieces(&mut vit.params, &vit.grads, state, &l.pieces, opt, decay, sharded)?;
            &mut vit.params
        };
        let per_elem = if l.master_shard { 1 } else { 2 };
        let t = Instant::now();
        let mut bytes = 0u64;
        if l.world > 1 && l.master_shard && self.overlap && self.comm.can_detach() {
            // behind the next forward: the embedding's bucket (the last) first, as the forward
            // reads them, each layer waiting only for its own weights (`Vit::weights_arriving`)
            let mut arriving = Vec::new();
            for &(prefix, _) in l.parts.iter().rev().filter(|(p, _)| p.len > 0) {
                let w = self.start(Collective::AllGather, gathered, prefix)?;
                arriving.push((prefix, self.comm.detach(w)?));
                bytes += (prefix.len * per_elem) as u64;
            }
            for (prefix, fence) in arriving {
                vit.weights_arriving(prefix, fence);
            }
        } else if l.world > 1 {
            let mut works = Vec::new();
            for &(prefix, _) in l.parts.iter().filter(|(p, _)| p.len > 0) {
                works.push(self.start(Collective::AllGather, gathered, prefix)?);
                bytes += (prefix.len * per_elem) as u64;
            }
            self.comm.begin_waits()?;
            for w in works {
                self.comm.wait(w, gathered)?;
            }
            self.comm.end_waits()?;
        }
        let comm_s = t.elapsed().as_secs_f64();
        self.track.times.total_s += comm_s;
        self.track.times.exposed_s += comm_s;
        if !l.master_shard {
            vit.params_changed(be)?;
        }
        Ok(Updated { norm: if read_norm { norm } else { None }, bytes })
    }
}

/// The gradient sync of a step: plain (stage 0) or ZeRO.
pub enum AnySync<'c, Buf> {
    Plain(BucketSync<'c, Buf>),
    Zero(ZeroSync<'c, Buf>),
}

impl<Buf> AnySync<'_, Buf> {
    pub fn times(&self) -> SyncTimes {
        match self {
            AnySync::Plain(s) => s.track.times,
            AnySync::Zero(s) => s.track.times,
        }
    }
    pub fn events(&self) -> &[BucketEvent] {
        match self {
            AnySync::Plain(s) => &s.track.events,
            AnySync::Zero(s) => &s.track.events,
        }
    }
}

impl<B: Backend> GradSync<B> for AnySync<'_, B::Buf> {
    fn reports_blocks(&self) -> bool {
        match self {
            AnySync::Plain(s) => GradSync::<B>::reports_blocks(s),
            AnySync::Zero(s) => GradSync::<B>::reports_blocks(s),
        }
    }
    fn reduces_every_pass(&self) -> bool {
        match self {
            AnySync::Plain(s) => GradSync::<B>::reduces_every_pass(s),
            AnySync::Zero(s) => GradSync::<B>::reduces_every_pass(s),
        }
    }
    fn ready(&mut self, be: &B, grads: &mut B::Buf, span: Span) -> Result<(), TrainError> {
        match self {
            AnySync::Plain(s) => s.ready(be, grads, span),
            AnySync::Zero(s) => s.ready(be, grads, span),
        }
    }
    fn finish(&mut self, be: &B, grads: &mut B::Buf) -> Result<u64, TrainError> {
        match self {
            AnySync::Plain(s) => s.finish(be, grads),
            AnySync::Zero(s) => s.finish(be, grads),
        }
    }
    fn global_sum_squares(&mut self, be: &B, grads: &B::Buf, inf_from: f32) -> Result<f64, TrainError> {
        match self {
            AnySync::Plain(s) => s.global_sum_squares(be, grads, inf_from),
            AnySync::Zero(s) => s.global_sum_squares(be, grads, inf_from),
        }
    }
    fn update(&mut self, be: &B, vit: &mut Vit<B>, state: &mut B::Buf, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper, read_norm: bool) -> Result<Updated, TrainError> {
        match self {
            AnySync::Plain(s) => s.update(be, vit, state, opt, decay, hyper, read_norm),
            AnySync::Zero(s) => s.update(be, vit, state, opt, decay, hyper, read_norm),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::memory::MemoryBytes;
    use crate::train::sync::{BucketPlan, FIRST_BUCKET_ELEMS};

    fn sgd() -> OptimizerConfig {
        OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
    fn adam() -> OptimizerConfig {
        OptimizerConfig::Adam { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, adam_w_mode: true, bias_correction: true }
    }

    /// Buckets of odd lengths (in backward order: highest offset first).
    fn plan() -> BucketPlan {
        let lens = [13usize, 40, 7, 101];
        let total: usize = lens.iter().sum();
        let mut off = total;
        let groups: Vec<Span> = lens.iter().map(|&len| {
            off -= len;
            Span { off, len }
        }).collect();
        BucketPlan::new(&groups, 1, 1).unwrap()
    }

    #[test]
    fn the_ranks_own_every_element_once_apart_from_the_replicated_tails() {
        let p = plan();
        for world in [1, 2, 3, 4] {
            let mut owners = vec![0usize; p.total()];
            let mut tails = vec![false; p.total()];
            for rank in 0..world {
                let l = ZeroLayout::new(&p, &adam(), 2, world, rank, true).unwrap();
                for s in l.own_shards() {
                    owners[s.range()].iter_mut().for_each(|o| *o += 1);
                }
                for t in l.tails() {
                    assert!(t.len < world);
                    tails[t.range()].iter_mut().for_each(|f| *f = true);
                }
                for (prefix, _) in &l.parts {
                    assert_eq!(prefix.len % world, 0);
                }
                assert_eq!(l.state_len, l.pieces.iter().map(|(s, _)| 2 * s.len).sum::<usize>());
            }
            for i in 0..p.total() {
                assert_eq!(owners[i] + usize::from(tails[i]) * world, if tails[i] { world } else { 1 }, "element {i} at world {world}");
            }
        }
        assert!(ZeroLayout::new(&p, &sgd(), 4, 2, 0, true).is_err());
        assert!(ZeroLayout::new(&p, &sgd(), 1, 2, 2, true).is_err());
    }

    #[test]
    fn sharding_then_placing_the_state_round_trips_across_ranks() {
        let p = plan();
        for opt in [adam(), sgd()] {
            let full: Vec<f32> = (0..optimizer_state_len(&opt, p.total())).map(|_| rand::random::<f32>()).collect();
            for world in [1, 2, 4] {
                let mut rebuilt = vec![f32::NAN; full.len()];
                for rank in 0..world {
                    let l = ZeroLayout::new(&p, &opt, 1, world, rank, true).unwrap();
                    let mine = l.shard_state(&full).unwrap();
                    assert_eq!(mine.len(), l.state_len);
                    l.place_state(&mine, &mut rebuilt);
                }
                assert_eq!(rebuilt, full, "{opt:?} at world {world}");
            }
            let l = ZeroLayout::new(&p, &opt, 1, 2, 0, true).unwrap();
            assert!(l.shard_state(&full[1..]).is_err());
        }
    }

    #[test]
    fn a_real_model_shards_its_adam_state_by_the_world_size() {
        let m = crate::model::ModelConfig::preset("vit_base_patch16_224").unwrap();
        let be = crate::backend::cpu::Cpu::new();
        let vit = crate::model::Vit::new(&be, m).unwrap();
        let p = BucketPlan::new(&vit.gradient_groups(), FIRST_BUCKET_ELEMS, crate::train::sync::DEFAULT_BUCKET_ELEMS).unwrap();
        for world in [2, 4] {
            let l = ZeroLayout::new(&p, &adam(), 1, world, 0, true).unwrap();
            let ideal = 2 * vit.table.total / world;
            // the tails add fewer than `world` values per bucket
            assert!(l.state_len >= ideal && l.state_len <= ideal + 2 * world * p.buckets.len(), "{} vs {ideal}", l.state_len);
            let pred = MemoryBytes::predict(vit.table.total, 2, false, 1, world);
            assert_eq!(pred.optimizer_state, (8 * vit.table.total as u64).div_ceil(world as u64));
            assert_eq!(pred.total, pred.weights + pred.gradients + pred.optimizer_state);
            // with a compute copy the f32 master weights are split too: 12 bytes a parameter
            let gpu = MemoryBytes::predict(vit.table.total, 2, true, 1, world);
            let p = vit.table.total as u64;
            assert_eq!(MemoryBytes::predict(vit.table.total, 2, true, 0, world).total - gpu.total, 12 * p - (4 * p).div_ceil(world as u64) - (8 * p).div_ceil(world as u64));
        }
    }

    #[test]
    fn master_shards_follow_the_state_and_cover_every_weight() {
        let p = plan();
        let full: Vec<f32> = (0..p.total()).map(|i| i as f32 + 0.5).collect();
        for world in [1, 2, 3, 4] {
            let mut seen = vec![0usize; p.total()];
            for rank in 0..world {
                let l = ZeroLayout::new(&p, &adam(), 2, world, rank, true).unwrap().with_master_shard();
                assert_eq!(l.buffer_len(), l.state_len + l.owned_len());
                let mine = l.shard_master(&full).unwrap();
                assert_eq!(mine.len(), l.owned_len());
                let pieces = l.shard_pieces();
                for (q, &(span, state_off)) in pieces.iter().zip(&l.pieces) {
                    assert_eq!((q.span, q.state_off), (span, state_off));
                    assert!(q.master_off >= l.state_len && q.master_off + span.len <= l.buffer_len());
                    assert_eq!(&mine[q.master_off - l.state_len..][..span.len], &full[span.range()]);
                    span.range().for_each(|i| seen[i] += 1);
                }
                // consecutive, no overlap
                for w in pieces.windows(2) {
                    assert_eq!(w[0].master_off + w[0].span.len, w[1].master_off);
                }
                assert!(l.shard_master(&full[1..]).is_err());
            }
            let l = ZeroLayout::new(&p, &adam(), 2, world, 0, true).unwrap();
            for &(prefix, tail) in &l.parts {
                assert!(prefix.range().all(|i| seen[i] == 1), "world {world}: a shard owned twice or never");
                assert!(tail.range().all(|i| seen[i] == world), "world {world}: a tail not on every rank");
            }
        }
    }

    #[test]
    fn stage_3_partitions_every_group_and_holds_what_the_memory_model_predicts() {
        let m = crate::model::ModelConfig::preset("vit_small_patch16_224").unwrap();
        let table = crate::model::ParamTable::new(&m);
        let groups = table.gradient_groups();
        let p = BucketPlan::new(&groups, 1, 1).unwrap();
        let be = crate::backend::cpu::Cpu::new();
        let full: Vec<f32> = (0..table.total).map(|i| i as f32).collect();
        for world in [1, 3, 4] {
            let mut seen = vec![0usize; table.total];
            for rank in 0..world {
                let l = ZeroLayout::new(&p, &adam(), 3, world, rank, true).unwrap();
                let parts = l.partition_parts(groups.len()).unwrap();
                // flat order, each group whole, the owned offsets as `shard_master` lays them out
                let mine = l.shard_master(&full).unwrap();
                for (i, g) in parts.iter().enumerate() {
                    assert_eq!(g.span.off, if i == 0 { 0 } else { parts[i - 1].span.off + parts[i - 1].span.len });
                    assert_eq!(&mine[g.shard_at..g.shard_at + g.shard.len], &full[g.shard.range()]);
                    assert_eq!(&mine[g.tail_at..g.tail_at + g.tail.len], &full[g.tail.range()]);
                    g.shard.range().chain(g.tail.range()).for_each(|j| seen[j] += 1);
                }
                assert_eq!(parts.iter().map(|g| g.shard.len + g.tail.len).sum::<usize>(), l.owned_len());
                assert_eq!(l.owned_pieces().iter().map(|q| q.master_off + q.span.len).max(), Some(l.owned_len()));
                if rank == 0 {
                    for (threshold, prefetch) in [(0, true), (0, false), (usize::MAX, true)] {
                        let z = crate::config::Stage3Config { param_persistence_threshold: threshold, prefetch_bucket_size: if prefetch { usize::MAX } else { 0 }, ..Default::default() };
                        let opts = crate::model::partition::GatherOptions { persistence_threshold: threshold, prefetch };
                        let part = crate::model::partition::Partition::new(&be, &table, parts.clone(), Box::new(crate::comm::SingleComm::new()), opts).unwrap();
                        let [extra, grad_slot] = crate::train::memory::stage3_extra_elems(&m, &z);
                        assert_eq!(part.held_elems(&be), l.owned_len() + extra as usize, "world {world}, threshold {threshold}, prefetch {prefetch}");
                        assert_eq!(be.len(&part.grad_slot), grad_slot as usize);
                    }
                }
            }
            let tails: Vec<Span> = ZeroLayout::new(&p, &adam(), 3, world, 0, true).unwrap().tails();
            for (j, &n) in seen.iter().enumerate() {
                let in_tail = tails.iter().any(|t| t.range().contains(&j));
                assert_eq!(n, if in_tail { world } else { 1 }, "element {j} at world {world}");
            }
        }
    }

    #[test]
    fn one_rank_gathers_the_master_shard_it_was_seeded_with() {
        let p = plan();
        let be = crate::backend::cpu::Cpu::new();
        let full: Vec<f32> = (0..p.total()).map(|_| rand::random::<f32>()).collect();
        let l = ZeroLayout::new(&p, &sgd(), 1, 1, 0, true).unwrap().with_master_shard();
        let mut buf = be.alloc_f32(l.buffer_len()).unwrap();
        l.seed_master(&be, &mut buf, &full).unwrap();
        let mut comm = crate::comm::SingleComm::new();
        assert_eq!(l.gather_master(&be, &mut comm, &buf).unwrap(), full);
        assert!(ZeroLayout::new(&p, &sgd(), 1, 1, 0, true).unwrap().seed_master(&be, &mut buf, &full).is_err());
    }
}
