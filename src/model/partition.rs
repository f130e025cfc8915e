//! ZeRO-3's partitioned weights (`train::zero` owns the layout): a rank keeps its own shard
//! of every parameter group's f32 weights and assembles a group's whole weights only while
//! the forward or backward needs them.
//!
//! The groups are the backward's (`ParamTable::gradient_groups`): the embedding, each
//! transformer block, the final norm with the head. Each one is laid out as ZeRO-2 lays out
//! a bucket: its longest prefix that divides by the world size W is cut into W shards, rank r
//! owns shard r; the tail (fewer than W values) is on every rank. `owned` holds this rank's
//! pieces back to back, in the layout's order.
//!
//! A *resident* group keeps its whole weights on every rank, refreshed by an all-gather after
//! each optimizer step: the embedding and the head (read outside the block loop, and small),
//! and any block no larger than `stage3_param_persistence_threshold` elements (DeepSpeed's
//! rule for small tensors). Every other block is *gathered*: into one of at most two slots of
//! the largest such block, just before its forward, and again before its backward. With
//! prefetch on, the next block's gather (the one after it in the forward, the one before it
//! in the backward) is started before the current block computes, on a communicator of its
//! own so it overlaps both the compute and the gradient reductions; a slot is overwritten
//! (released) by the gather after next. The compute reads a group's weights at offset 0 of
//! its buffer (`spans`: the table's spans rebased to each group's start).
//!
//! Gradients are partitioned the same way: no rank keeps a whole gradient buffer. Each
//! group's backward writes that pass's gradients into the gradient slot (zeroed first), the
//! ranks reduce-scatter the slot's prefix and all-reduce its tail (`train::zero`, every pass,
//! as DeepSpeed does), and each rank adds its own shard and the tail into its partitioned
//! gradients, laid out as `owned` (`add_grads`).
//!
//! Where the forward reads a compute copy (bf16 on a GPU), the resident groups and the slots
//! are in the compute dtype: a gather copies this rank's f32 pieces into the buffer, rounding
//! them as the compute copy's cast would, and all-gathers the rounded values (2 bytes each, as
//! DeepSpeed gathers its bf16 parameters). The f32 weights stay in the owners' pieces alone.

use crate::backend::{BResult, Backend, BackendError};
use crate::comm::{Collective, Comm, Span, Work};

use super::params::{BlockSpans, ModelSpans, ParamTable};

/// One parameter group of the partition, in the flat buffers' coordinates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupPart {
    pub span: Span,
    /// The longest prefix of `span` that divides by the world size (all-gathered).
    pub prefix: Span,
    /// This rank's shard of the prefix, and its offset in `owned`.
    pub shard: Span,
    pub shard_at: usize,
    /// The rest of `span` (fewer values than ranks, on every rank), and its offset in `owned`.
    pub tail: Span,
    pub tail_at: usize,
}

/// How the gathers run (`zero_optimization.stage3_*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GatherOptions {
    /// Blocks of at most this many elements stay whole on every rank.
    pub persistence_threshold: usize,
    /// Start the next block's gather while the current one computes.
    pub prefetch: bool,
}

struct Slot<B: Backend> {
    buf: B::Buf,
    /// The group it holds (or is receiving), and the gather still in flight.
    group: Option<usize>,
    work: Option<Work>,
}

/// This rank's share of the weights and the buffers the gathers fill.
pub struct Partition<B: Backend> {
    /// Groups in flat order: 0 the embedding, 1..=depth the blocks, depth+1 the head.
    pub groups: Vec<GroupPart>,
    /// The table's spans rebased to the start of each group.
    pub spans: ModelSpans,
    /// This rank's pieces of the f32 weights (`GroupPart::shard_at`/`tail_at`).
    pub owned: B::Buf,
    /// The whole weights of each resident group (None: gathered).
    resident: Vec<Option<B::Buf>>,
    slots: Vec<Slot<B>>,
    /// The slot whose group is being computed (not to be overwritten by a prefetch).
    in_use: Option<usize>,
    /// One group's gradients of one pass at offset 0, where the backward of a group whose
    /// weights sit at offset 0 of their buffer writes them (the largest group's size); reduced
    /// over the ranks there, then this rank's pieces added into the partitioned gradients
    /// (`add_grads`).
    pub grad_slot: B::Buf,
    comm: Box<dyn Comm<B::Buf>>,
    /// Values this rank received and sent in gathers so far (drained by `take_gathered`).
    gathered: u64,
    /// Whether the resident groups and the slots hold the compute dtype (`Backend::alloc`)
    /// rather than f32.
    compute_dtype: bool,
}

impl<B: Backend> Partition<B> {
    /// The partition of `table` over `groups` (one per gradient group, flat order) with
    /// `comm` (the parameter gathers' own communicator over every rank).
    pub fn new(be: &B, table: &ParamTable, groups: Vec<GroupPart>, comm: Box<dyn Comm<B::Buf>>, opts: GatherOptions) -> BResult<Self> {
        let depth = table.spans.blocks.len();
        if groups.len() != depth + 2 {
            return Err(BackendError::Shape { op: "partition", msg: format!("{} parameter groups for a model of {depth} blocks (expected {})", groups.len(), depth + 2) });
        }
        let owned_len = groups.iter().map(|g| g.shard.len + g.tail.len).sum::<usize>();
        let resident_group = |i: usize| i == 0 || i == depth + 1 || groups[i].span.len <= opts.persistence_threshold;
        // the whole weights the forward reads, in the dtype it reads them in
        let compute_dtype = be.needs_compute_copy();
        let whole = |len: usize| if compute_dtype { be.alloc(len) } else { be.alloc_f32(len) };
        let mut resident = Vec::with_capacity(groups.len());
        for (i, g) in groups.iter().enumerate() {
            resident.push(if resident_group(i) { Some(whole(g.span.len.max(1))?) } else { None });
        }
        let widest_gathered = (0..groups.len()).filter(|&i| !resident_group(i)).map(|i| groups[i].span.len).max();
        let mut slots = Vec::new();
        if let Some(w) = widest_gathered {
            for _ in 0..if opts.prefetch { 2 } else { 1 } {
                slots.push(Slot { buf: whole(w)?, group: None, work: None });
            }
        }
        let widest = groups.iter().map(|g| g.span.len).max().unwrap_or(1);
        Ok(Partition {
            spans: rebased(table, &groups),
            owned: be.alloc_f32(owned_len.max(1))?,
            resident,
            slots,
            in_use: None,
            grad_slot: be.alloc_f32(widest)?,
            groups,
            comm,
            gathered: 0,
            compute_dtype,
        })
    }

    /// The group of block `i`.
    pub fn block_group(i: usize) -> usize {
        i + 1
    }

    /// Ranks the weights (and gradients) are partitioned over.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Elements of this rank's pieces (`owned`), and of its partitioned gradients (laid out
    /// the same way: `GroupPart::shard_at` / `tail_at`).
    pub fn owned_len(&self) -> usize {
        self.groups.iter().map(|g| g.shard.len + g.tail.len).sum()
    }

    /// Adds group `g`'s gradients of this rank's pieces from the gradient slot (the group at
    /// offset 0, reduced over the ranks: this rank's shard and the tail hold the sums) into
    /// `grads`, this rank's partitioned gradients.
    pub fn add_grads(&self, be: &B, g: usize, grads: &mut B::Buf) -> BResult<()> {
        let p = &self.groups[g];
        be.add_span(grads, p.shard_at, &self.grad_slot, p.shard.off - p.span.off, p.shard.len)?;
        be.add_span(grads, p.tail_at, &self.grad_slot, p.tail.off - p.span.off, p.tail.len)
    }

    /// Whether group `g` stays whole on every rank.
    pub fn is_resident(&self, g: usize) -> bool {
        self.resident[g].is_some()
    }

    /// This rank's pieces and the resident groups cut from whole weights (table layout).
    pub fn seed(&mut self, be: &B, full: &[f32]) -> BResult<()> {
        let mut owned = vec![0.0; be.len(&self.owned)];
        for g in &self.groups {
            owned[g.shard_at..g.shard_at + g.shard.len].copy_from_slice(&full[g.shard.range()]);
            owned[g.tail_at..g.tail_at + g.tail.len].copy_from_slice(&full[g.tail.range()]);
        }
        be.upload(&mut self.owned, 0, &owned)?;
        for (g, r) in self.groups.iter().zip(self.resident.iter_mut()) {
            if let Some(buf) = r {
                be.upload(buf, 0, &full[g.span.range()])?;
            }
        }
        for s in self.slots.iter_mut() {
            s.group = None;
        }
        Ok(())
    }

    /// This rank's pieces into `dst` (a group's buffer at offset 0), then the all-gather of
    /// the prefix started (None when one rank holds everything).
    fn start_into(be: &B, comm: &mut dyn Comm<B::Buf>, owned: &B::Buf, g: &GroupPart, dst: &mut B::Buf) -> BResult<Option<Work>> {
        be.copy_span(dst, g.shard.off - g.span.off, owned, g.shard_at, g.shard.len)?;
        be.copy_span(dst, g.tail.off - g.span.off, owned, g.tail_at, g.tail.len)?;
        if comm.world_size() == 1 || g.prefix.len == 0 {
            return Ok(None);
        }
        comm.start(Collective::AllGather, dst, Span { off: 0, len: g.prefix.len }).map(Some).map_err(|e| BackendError::Device(format!("gathering the weights: {e}")))
    }

    /// Starts gathering group `g` into a slot not in use, unless it is resident or already in
    /// a slot (a prefetch).
    pub fn prefetch(&mut self, be: &B, g: usize) -> BResult<()> {
        if g >= self.groups.len() || self.is_resident(g) || self.slots.iter().any(|s| s.group == Some(g)) {
            return Ok(());
        }
        let Some(k) = (0..self.slots.len()).find(|&k| Some(k) != self.in_use) else { return Ok(()) };
        let slot = &mut self.slots[k];
        if let Some(w) = slot.work.take() {
            self.comm.wait(w, &mut slot.buf).map_err(|e| BackendError::Device(format!("gathering the weights: {e}")))?;
        }
        slot.work = Self::start_into(be, &mut *self.comm, &self.owned, &self.groups[g], &mut slot.buf)?;
        slot.group = Some(g);
        self.gathered += self.groups[g].prefix.len as u64;
        Ok(())
    }

    /// Makes group `g`'s whole weights available (gathering them now if no prefetch did) and
    /// marks its slot in use; `weights(g)` then reads them.
    pub fn acquire(&mut self, be: &B, g: usize) -> BResult<()> {
        if self.is_resident(g) {
            return Ok(());
        }
        if !self.slots.iter().any(|s| s.group == Some(g)) {
            self.in_use = None;
            self.prefetch(be, g)?;
        }
        let k = self.slots.iter().position(|s| s.group == Some(g)).ok_or_else(|| BackendError::Device(format!("no gather slot for parameter group {g}")))?;
        let slot = &mut self.slots[k];
        if let Some(w) = slot.work.take() {
            self.comm.wait(w, &mut slot.buf).map_err(|e| BackendError::Device(format!("gathering the weights: {e}")))?;
        }
        self.in_use = Some(k);
        Ok(())
    }

    /// Group `g`'s whole weights at offset 0 (resident, or acquired).
    pub fn weights(&self, g: usize) -> BResult<&B::Buf> {
        if let Some(Some(buf)) = self.resident.get(g) {
            return Ok(buf);
        }
        self.slots
            .iter()
            .find(|s| s.group == Some(g) && s.work.is_none())
            .map(|s| &s.buf)
            .ok_or_else(|| BackendError::Device(format!("parameter group {g} read before it was gathered")))
    }

    /// Group `g`'s whole weights (as `weights`) and the gradient slot, for its backward.
    pub fn weights_and_grad_slot(&mut self, g: usize) -> BResult<(&B::Buf, &mut B::Buf)> {
        let Partition { resident, slots, grad_slot, .. } = self;
        let w = match resident.get(g) {
            Some(Some(buf)) => buf,
            _ => slots
                .iter()
                .find(|s| s.group == Some(g) && s.work.is_none())
                .map(|s| &s.buf)
                .ok_or_else(|| BackendError::Device(format!("parameter group {g} read before it was gathered")))?,
        };
        Ok((w, grad_slot))
    }

    /// Waits for every gather in flight and forgets what the slots hold (their weights are
    /// stale once the optimizer stepped).
    pub fn release_all(&mut self) -> BResult<()> {
        for s in self.slots.iter_mut() {
            if let Some(w) = s.work.take() {
                self.comm.wait(w, &mut s.buf).map_err(|e| BackendError::Device(format!("gathering the weights: {e}")))?;
            }
            s.group = None;
        }
        self.in_use = None;
        Ok(())
    }

    /// After an update of `owned`: the resident groups gathered again, the slots emptied.
    pub fn refresh(&mut self, be: &B) -> BResult<()> {
        self.release_all()?;
        let mut works = Vec::new();
        for (g, r) in self.groups.iter().zip(self.resident.iter_mut()) {
            if let Some(buf) = r {
                works.push(Self::start_into(be, &mut *self.comm, &self.owned, g, buf)?);
                self.gathered += g.prefix.len as u64;
            }
        }
        for (w, r) in works.into_iter().zip(self.resident.iter_mut().filter_map(|r| r.as_mut())) {
            if let Some(w) = w {
                self.comm.wait(w, r).map_err(|e| BackendError::Device(format!("gathering the weights: {e}")))?;
            }
        }
        Ok(())
    }

    /// The forward's gather calls for block `i`: its group acquired, the next one prefetched.
    /// Every forward makes exactly these calls, so every rank's slots hold the same groups and
    /// its collectives pair up with the others'.
    pub fn forward_block(&mut self, be: &B, i: usize) -> BResult<usize> {
        let g = Self::block_group(i);
        self.acquire(be, g)?;
        self.prefetch(be, g + 1)?;
        Ok(g)
    }

    /// The backward's gather calls for block `i` (the one before it prefetched).
    pub fn backward_block(&mut self, be: &B, i: usize) -> BResult<usize> {
        let g = Self::block_group(i);
        self.acquire(be, g)?;
        self.prefetch(be, g - 1)?;
        Ok(g)
    }

    /// Runs the gather calls of `n` forward passes without computing anything: a rank with
    /// fewer evaluation batches than another keeps the collectives paired.
    pub fn idle_forwards(&mut self, be: &B, n: usize) -> BResult<()> {
        let depth = self.groups.len() - 2;
        for _ in 0..n {
            for i in 0..depth {
                self.forward_block(be, i)?;
            }
        }
        Ok(())
    }

    /// Elements this rank holds for the weights: its pieces, the resident groups, the slots.
    pub fn held_elems(&self, be: &B) -> usize {
        be.len(&self.owned) + self.resident.iter().flatten().map(|b| be.len(b)).sum::<usize>() + self.slots.iter().map(|s| be.len(&s.buf)).sum::<usize>()
    }

    /// Bytes this rank holds for the weights: (f32: its pieces, compute dtype: the resident
    /// groups and the slots) when they are in a compute dtype of `compute_bytes` each, else
    /// (all of `held_elems` in f32, 0).
    pub fn held_bytes(&self, be: &B, compute_bytes: u64) -> (u64, u64) {
        let whole = (self.held_elems(be) - be.len(&self.owned)) as u64;
        match self.compute_dtype {
            true => (4 * be.len(&self.owned) as u64, compute_bytes * whole),
            false => (4 * self.held_elems(be) as u64, 0),
        }
    }

    /// Whether the whole weights are held in the compute dtype (see the module doc).
    pub fn in_compute_dtype(&self) -> bool {
        self.compute_dtype
    }

    /// Elements of the gather slots (what a rank holds of the gathered blocks at once).
    pub fn slot_elems(&self, be: &B) -> usize {
        self.slots.iter().map(|s| be.len(&s.buf)).sum()
    }

    /// Elements all-gathered since the last call (each rank's whole prefix of each gather).
    pub fn take_gathered(&mut self) -> u64 {
        std::mem::take(&mut self.gathered)
    }
}

fn shift(s: Span, base: usize) -> Span {
    Span { off: s.off - base, len: s.len }
}

impl BlockSpans {
    /// These spans relative to `base` (the block's first offset).
    pub fn rebased(&self, base: usize) -> BlockSpans {
        let f = |s: Span| shift(s, base);
        BlockSpans {
            norm1_w: f(self.norm1_w),
            norm1_b: f(self.norm1_b),
            qkv_w: f(self.qkv_w),
            qkv_b: self.qkv_b.map(f),
            proj_w: f(self.proj_w),
            proj_b: f(self.proj_b),
            norm2_w: f(self.norm2_w),
            norm2_b: f(self.norm2_b),
            fc1_w: f(self.fc1_w),
            fc1_b: f(self.fc1_b),
            fc2_w: f(self.fc2_w),
            fc2_b: f(self.fc2_b),
        }
    }
}

/// `table`'s spans with each group's rebased to its own start: the embedding's stay (it
/// starts at 0), each block's and the head's start at 0.
fn rebased(table: &ParamTable, groups: &[GroupPart]) -> ModelSpans {
    let t = &table.spans;
    let head = groups.last().map_or(0, |g| g.span.off);
    ModelSpans {
        cls_token: t.cls_token,
        pos_embed: t.pos_embed,
        patch_w: t.patch_w,
        patch_b: t.patch_b,
        blocks: t.blocks.iter().map(|b| b.rebased(b.norm1_w.off)).collect(),
        final_norm_w: shift(t.final_norm_w, head),
        final_norm_b: shift(t.final_norm_b, head),
        head_w: shift(t.head_w, head),
        head_b: shift(t.head_b, head),
    }
}
