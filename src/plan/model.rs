//! The step-time model: pure functions of a compute profile (`plan::profile`), a network
//! (α–β per level) and a scenario (micro, GAS, ranks, ZeRO stage, buckets, wire dtype,
//! sharing, balance). No engine is touched.
//!
//! ```text
//! step = GAS × compute(micro)                    slowest rank; K ranks on one device: × K
//!      + exposed communication                   buckets on the last backward's timeline,
//!                                                and the wait for the slowest of N ranks
//!      + optimizer                               stage 0: whole; stage ≥ 1: 1/N + all-gather
//!      + stage 3's weight gathers                every pass, less what the prefetch hides
//!      + sequence parallelism's all-to-alls      four per block and pass, none hidden
//!      + exposed data                            loader time not hidden behind compute
//! ```
//!
//! Collectives follow the ring: all-reduce 2(n−1)/n·S/β + 2(n−1)α, reduce-scatter and
//! all-gather (n−1)/n·S/β + (n−1)α. Over several nodes the all-reduce is hierarchical: a
//! reduce-scatter inside the node, an all-reduce of each rank's 1/g between nodes (the g
//! ranks of a node share its bandwidth), an all-gather inside the node.
//!
//! Buckets come from `train::sync::BucketPlan`, the plan training uses. A bucket's
//! reduction can start when the backward has finished its last group and the previous
//! bucket's reduction has finished (one link, collectives in order); what ends after the
//! backward is exposed. Only the boundary micro-batch communicates. The boundary also waits
//! for the slowest rank: with the profile's spread σ of one pass, GAS passes and N ranks,
//! σ·√GAS·E[max of N standard normals].
//!
//! Sequence parallelism (`sequence_parallel_size` = SP, `model::seq_parallel`): the world is
//! DP × SP ranks, and the SP consecutive ranks of a group split each image's tokens. A rank's
//! compute is that of micro/SP images at full length (its tokens for the token-wise layers,
//! its H/SP heads over every token for the attention: the same products either way). Each
//! block exchanges qkv and the attention's output in the forward and their gradients in the
//! backward, each an all-to-all of the rank's own tokens (B·N/SP tokens × 3E or E values of
//! `compute_bytes`) over the group: costed as an all-gather of that buffer ((SP−1)/SP of it
//! crosses the group's link), none of it hidden, since the attention needs its inputs and the
//! next layer its outputs: the passes grow by it, as the engine's timed forward and backward
//! do. The gradients are reduced over every rank, as without SP.
//!
//! Sharing: K ranks on one GPU (`launch --one-gpu`) are modelled as time-slicing it, so each
//! rank's compute takes K × what it takes alone, and a reduction runs during the backward
//! only while the ranks wait on the network there (sequence parallelism's all-to-alls). K CPU
//! ranks on one machine run side by side on its cores: their compute is that of a profile
//! taken by K ranks at once, or a profile's scaled by threads (`sharing_factor`). The network
//! between them is the cluster's level measured on that same machine.

use serde::Serialize;

use crate::core::Span;
use crate::plan::profile::Profile;
use crate::train::sync::BucketPlan;

/// Latency per ring step and ring bandwidth per rank.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct AlphaBeta {
    pub alpha_s: f64,
    pub beta_bytes_s: f64,
}

/// The collectives the step uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Op {
    AllReduce,
    ReduceScatter,
    AllGather,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllGather => "all_gather",
        }
    }
}

/// Measured times of each collective over sizes at one rank count (a comm bench), used
/// instead of the α–β line for messages inside the measured range at that rank count.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Curve {
    pub world: usize,
    /// (bytes, seconds) in increasing size, per collective: all-reduce, reduce-scatter,
    /// all-gather.
    pub points: [Vec<(f64, f64)>; 3],
}

impl Curve {
    /// The time of `bytes` interpolated linearly in log(bytes)–log(time) between the measured
    /// sizes; None outside them.
    pub fn time(&self, op: Op, bytes: f64) -> Option<f64> {
        let pts = &self.points[op_index(op)];
        let (first, last) = (pts.first()?, pts.last()?);
        if bytes < first.0 || bytes > last.0 {
            return None;
        }
        let i = pts.iter().position(|p| p.0 >= bytes)?;
        if i == 0 || pts[i].0 == bytes {
            return Some(pts[i].1);
        }
        let ((x0, y0), (x1, y1)) = (pts[i - 1], pts[i]);
        let f = (bytes.ln() - x0.ln()) / (x1.ln() - x0.ln());
        Some((y0.ln() + f * (y1.ln() - y0.ln())).exp())
    }
}

fn op_index(op: Op) -> usize {
    match op {
        Op::AllReduce => 0,
        Op::ReduceScatter => 1,
        Op::AllGather => 2,
    }
}

/// One network level: α and β per collective, and the measured curve it was fitted from, if
/// any.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Level {
    pub link: String,
    pub all_reduce: AlphaBeta,
    pub reduce_scatter: AlphaBeta,
    pub all_gather: AlphaBeta,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub curve: Option<Curve>,
}

impl Level {
    /// A level with one α–β for every collective.
    pub fn uniform(link: &str, ab: AlphaBeta) -> Level {
        Level { link: link.to_string(), all_reduce: ab, reduce_scatter: ab, all_gather: ab, curve: None }
    }

    pub fn get(&self, op: Op) -> AlphaBeta {
        match op {
            Op::AllReduce => self.all_reduce,
            Op::ReduceScatter => self.reduce_scatter,
            Op::AllGather => self.all_gather,
        }
    }

    /// Seconds of `op` on `bytes` over `n` ranks of this level: the measured curve where it
    /// covers this rank count and size, else the ring with this level's α and β.
    pub fn time(&self, op: Op, n: usize, bytes: f64) -> f64 {
        if n <= 1 || bytes <= 0.0 {
            return 0.0;
        }
        if let Some(t) = self.curve.as_ref().filter(|c| c.world == n).and_then(|c| c.time(op, bytes)) {
            return t;
        }
        ring_time(op, n, bytes, &self.get(op))
    }
}

/// (latency steps, bandwidth factor) of the ring for `op` over `n` ranks.
pub fn ring_factors(op: Op, n: usize) -> (f64, f64) {
    let n = n as f64;
    match op {
        Op::AllReduce => (2.0 * (n - 1.0), 2.0 * (n - 1.0) / n),
        Op::ReduceScatter | Op::AllGather => (n - 1.0, (n - 1.0) / n),
    }
}

/// Seconds of `op` on a buffer of `bytes` over a ring of `n` ranks.
pub fn ring_time(op: Op, n: usize, bytes: f64, ab: &AlphaBeta) -> f64 {
    if n <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    let (k, f) = ring_factors(op, n);
    k * ab.alpha_s + f * bytes / ab.beta_bytes_s
}

/// The ranks and their links.
#[derive(Clone, Debug, Serialize)]
pub struct Network {
    pub ranks_per_node: usize,
    pub nodes: usize,
    pub intra: Option<Level>,
    /// Bandwidth per node.
    pub inter: Option<Level>,
}

impl Network {
    pub fn world(&self) -> usize {
        self.ranks_per_node * self.nodes
    }

    /// Seconds of `op` on `bytes` over every rank (hierarchical over several nodes).
    pub fn time(&self, op: Op, bytes: f64) -> Result<f64, String> {
        let (g, m) = (self.ranks_per_node, self.nodes);
        let intra = || self.intra.as_ref().ok_or_else(|| format!("{g} ranks per node need an `intra` level"));
        let inter = || self.inter.as_ref().ok_or_else(|| format!("{m} nodes need an `inter` level"));
        if g * m <= 1 {
            return Ok(0.0);
        }
        if m == 1 {
            return Ok(intra()?.time(op, g, bytes));
        }
        let node = inter()?;
        if g == 1 {
            return Ok(node.time(op, m, bytes));
        }
        let l = intra()?;
        // between nodes each of the g ranks moves 1/g of the buffer; they share the node's β
        let ab = node.get(op);
        let shared = AlphaBeta { alpha_s: ab.alpha_s, beta_bytes_s: ab.beta_bytes_s / g as f64 };
        let part = bytes / g as f64;
        Ok(match op {
            Op::AllReduce => l.time(Op::ReduceScatter, g, bytes) + ring_time(Op::AllReduce, m, part, &shared) + l.time(Op::AllGather, g, bytes),
            Op::ReduceScatter => l.time(Op::ReduceScatter, g, bytes) + ring_time(Op::ReduceScatter, m, part, &shared),
            Op::AllGather => ring_time(Op::AllGather, m, part, &shared) + l.time(Op::AllGather, g, bytes),
        })
    }
}

/// What a step is run with, besides the profile and the network.
#[derive(Clone, Debug, Serialize)]
pub struct Scenario {
    pub micro: usize,
    pub gas: usize,
    /// 0, 1, 2 or 3.
    pub zero_stage: u8,
    /// Stage 3's gathers: which blocks are partitioned and whether the next is prefetched
    /// (`zero_optimization.stage3_*`).
    pub stage3: crate::config::Stage3Config,
    /// Stage 2 reduce-scatters its buckets (`zero_optimization.reduce_scatter`).
    pub reduce_scatter: bool,
    /// `reduce_bucket_size` in elements.
    pub bucket_elems: usize,
    /// Reductions start during the backward (`zero_optimization.overlap_comm`).
    pub overlap: bool,
    /// Gradients travel as bf16 (`communication_data_type`).
    pub comm_bf16: bool,
    /// Ranks time-sharing each device.
    pub ranks_per_device: usize,
    /// Time factor on the profile's compute (another device than the profiled one).
    pub compute_scale: f64,
    /// Each rank's share of a global micro-batch (`train.balance`), None = equal.
    pub shares: Option<Vec<f64>>,
    /// Each rank's compute slowdown (≥ 1; `train.emulate_slowdown`), empty = none.
    pub slowdown: Vec<f64>,
    /// Loader images/s per core and cores per rank, when known.
    pub loader: Option<(f64, f64)>,
    /// Ranks per sequence-parallel group (`sequence_parallel_size`; 1: none).
    pub sequence_parallel: usize,
}

impl Scenario {
    /// A scenario with the engine's defaults for everything but micro and GAS.
    pub fn new(micro: usize, gas: usize) -> Scenario {
        Scenario {
            micro,
            gas,
            zero_stage: 0,
            stage3: crate::config::Stage3Config::default(),
            reduce_scatter: true,
            bucket_elems: crate::train::sync::DEFAULT_BUCKET_ELEMS,
            overlap: true,
            comm_bf16: false,
            ranks_per_device: 1,
            compute_scale: 1.0,
            shares: None,
            slowdown: Vec::new(),
            loader: None,
            sequence_parallel: 1,
        }
    }
}

/// One bucket's reduction on the predicted timeline (seconds from the start of the last
/// backward).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct BucketTiming {
    pub elements: usize,
    pub bytes: f64,
    pub ready_s: f64,
    pub start_s: f64,
    pub end_s: f64,
}

/// The reductions of `plan`'s buckets placed on a backward whose groups finish at
/// `group_done_s` (cumulative, backward order) and which ends at `backward_end_s`:
/// each starts when its last group is done and the link is free, and takes `time(bucket)` at
/// full speed. Until the backward ends a reduction progresses at `rate` ∈ [0, 1] of its speed:
/// 1 is full overlap, 0 none (every reduction starts at the end), a share between for ranks
/// that can run a reduction only in part of the backward (time-slicing ranks, while they wait
/// on sequence parallelism's all-to-alls). Returns the timings and the exposed seconds.
pub fn bucket_timeline(plan: &BucketPlan, group_done_s: &[f64], backward_end_s: f64, rate: f64, time: &dyn Fn(usize) -> Result<(f64, f64), String>) -> Result<(Vec<BucketTiming>, f64), String> {
    let rate = if rate.is_finite() { rate.clamp(0.0, 1.0) } else { 0.0 };
    let mut out = Vec::with_capacity(plan.buckets.len());
    let mut free = 0.0f64;
    for (i, b) in plan.buckets.iter().enumerate() {
        let last = b.groups.end.checked_sub(1).ok_or_else(|| format!("bucket {i} holds no group"))?;
        let done = *group_done_s.get(last).ok_or_else(|| format!("bucket {i} ends at group {last}, the profile has {}", group_done_s.len()))?;
        let ready = if rate > 0.0 { done } else { backward_end_s };
        let start = ready.max(free);
        let (secs, bytes) = time(i)?;
        // the part done before the backward ends, at `rate`, then the rest at full speed
        let inside = if start < backward_end_s { (backward_end_s - start) * rate } else { 0.0 };
        free = if inside > 0.0 && secs <= inside { start + secs / rate } else { start.max(backward_end_s) + (secs - inside) };
        out.push(BucketTiming { elements: b.span.len, bytes, ready_s: ready, start_s: start, end_s: free });
    }
    let exposed = (free - backward_end_s).max(0.0);
    Ok((out, exposed))
}

/// ZeRO-3's gradient reductions (`train::zero::ZeroSync::reduce_group`): one per group in
/// every micro-batch's backward, each started once its group is done and waited for before
/// the next group's backward, so the backward is stretched by all of them. Returns the last
/// micro-batch's timeline (each reduction shifting the groups after it) and the exposed
/// seconds of the step (`gas` micro-batches' worth).
pub fn stage3_reductions(plan: &BucketPlan, group_done_s: &[f64], time: &dyn Fn(usize) -> Result<(f64, f64), String>, gas: usize) -> Result<(Vec<BucketTiming>, f64), String> {
    let mut out = Vec::with_capacity(plan.buckets.len());
    let mut shift = 0.0;
    for (i, b) in plan.buckets.iter().enumerate() {
        let last = b.groups.end.checked_sub(1).ok_or_else(|| format!("bucket {i} holds no group"))?;
        let done = *group_done_s.get(last).ok_or_else(|| format!("bucket {i} ends at group {last}, the profile has {}", group_done_s.len()))?;
        let (secs, bytes) = time(i)?;
        let ready = done + shift;
        out.push(BucketTiming { elements: b.span.len, bytes, ready_s: ready, start_s: ready, end_s: ready + secs });
        shift += secs;
    }
    Ok((out, gas as f64 * shift))
}

/// The part of the weights' all-gather the next forward waits for: the buckets are gathered
/// one after another from the last (the embedding's, which the forward reads first), taking
/// `gathers[b]` each, and the forward runs the groups in its order (the backward's reversed),
/// each once its bucket has arrived. The forward of `forward_s` is split over the groups in
/// the backward's proportions (`backward_groups_s`), as the profile splits it.
pub fn gather_behind_forward(plan: &BucketPlan, gathers: &[f64], backward_groups_s: &[f64], forward_s: f64) -> Result<f64, String> {
    let total_bwd: f64 = backward_groups_s.iter().sum();
    let groups = backward_groups_s.len();
    let mut arrived = vec![0.0; plan.buckets.len()];
    let mut at = 0.0;
    for b in (0..plan.buckets.len()).rev() {
        at += gathers.get(b).copied().ok_or_else(|| format!("no gather time for bucket {b}"))?;
        arrived[b] = at;
    }
    let mut t = 0.0f64;
    for g in (0..groups).rev() {
        let b = plan.bucket_of(g).ok_or_else(|| format!("group {g} is in no bucket"))?;
        let f = if total_bwd > 0.0 { forward_s * backward_groups_s[g] / total_bwd } else { forward_s / groups as f64 };
        t = t.max(arrived[b]) + f;
    }
    Ok((t - forward_s).max(0.0))
}

/// A predicted step.
#[derive(Clone, Debug, Serialize)]
pub struct Prediction {
    pub world: usize,
    pub global_batch: usize,
    pub images_per_s: f64,
    pub images_per_s_per_rank: f64,
    pub step_s: f64,
    /// Forward + backward of every micro-batch of the slowest rank.
    pub compute_s: f64,
    pub forward_s: f64,
    pub backward_s: f64,
    /// Gradient reductions of the boundary micro-batch, overlapped or not.
    pub comm_total_s: f64,
    /// What of them ends after the backward, plus the wait for the slowest rank.
    pub comm_exposed_s: f64,
    /// The part of `comm_exposed_s` that waits for the slowest rank.
    pub straggle_s: f64,
    /// The optimizer step (this rank's 1/N under ZeRO) with ZeRO's weight all-gather.
    pub optimizer_s: f64,
    pub allgather_s: f64,
    /// Loader time not hidden behind compute (0 when the loader is not modelled).
    pub data_s: f64,
    /// Sequence parallelism's all-to-alls over the step (every pass), none hidden; already
    /// part of `forward_s` and `backward_s`, as the engine measures them.
    pub all_to_all_s: f64,
    /// The training loop's per-step read-back of the losses and the norm beyond the profiled
    /// parts (`ProfilePoint::loop_s`).
    pub loop_s: f64,
    pub comm_bytes_per_step: f64,
    pub buckets: Vec<BucketTiming>,
    /// Per rank images per micro-batch (balanced shares).
    pub rank_micro: Vec<f64>,
    pub notes: Vec<String>,
}

/// Predicts one optimizer step of `s` on `net` from `profile`; `groups` are the model's
/// gradient groups in backward order (`ParamTable::gradient_groups`).
pub fn predict(profile: &Profile, groups: &[Span], s: &Scenario, net: &Network) -> Result<Prediction, String> {
    let world = net.world();
    if s.micro == 0 || s.gas == 0 || world == 0 {
        return Err(format!("micro {} × GAS {} on {world} ranks: every factor must be at least 1", s.micro, s.gas));
    }
    if groups.len() != profile.points[0].backward_groups_s.len() {
        return Err(format!("the model has {} gradient groups, the profile {}", groups.len(), profile.points[0].backward_groups_s.len()));
    }
    let sp = s.sequence_parallel.max(1);
    if !world.is_multiple_of(sp) || !profile.model_config.num_heads.is_multiple_of(sp) {
        return Err(format!("sequence_parallel_size {sp} must divide the {world} ranks and the model's {} heads", profile.model_config.num_heads));
    }
    let mut notes = Vec::new();
    // each rank's micro-batch: equal, or the balance's shares of world × micro
    let rank_micro: Vec<f64> = match &s.shares {
        Some(sh) if sh.len() == world => {
            let sum: f64 = sh.iter().sum();
            sh.iter().map(|x| x / sum * (world * s.micro) as f64).collect()
        }
        Some(sh) => return Err(format!("{} balance shares for {world} ranks", sh.len())),
        None => vec![s.micro as f64; world],
    };
    let share = sharing_factor(profile, s.ranks_per_device);
    let factor = |r: usize| share * s.compute_scale * s.slowdown.get(r).copied().unwrap_or(1.0);
    // the slowest rank sets the pace of every collective
    let (slow, t) = rank_micro
        .iter()
        .enumerate()
        .map(|(r, &m)| (r, profile.at(m / sp as f64)))
        .max_by(|a, b| ((a.1.forward_s + a.1.backward_s) * factor(a.0)).total_cmp(&((b.1.forward_s + b.1.backward_s) * factor(b.0))))
        .ok_or("no rank")?;
    let k = factor(slow);
    // sequence parallelism's exchanges happen inside the passes (the engine's forward and
    // backward include them): half of each pass's in each, spread over the backward's groups
    let (a2a_pass, a2a_bytes) = if sp > 1 { sequence_all_to_alls(profile, rank_micro[slow], sp, net)? } else { (0.0, 0.0) };
    let (fwd, bwd) = (t.forward_s * k + a2a_pass / 2.0, t.backward_s * k + a2a_pass / 2.0);
    let compute = s.gas as f64 * (fwd + bwd);
    // the last backward's timeline: group g is done at the sum of the first g+1 groups
    let stretch = if t.backward_s > 0.0 { bwd / (t.backward_s * k) } else { 1.0 };
    let mut done = Vec::with_capacity(t.backward_groups_s.len());
    let mut acc = 0.0;
    for g in &t.backward_groups_s {
        acc += g * k * stretch;
        done.push(acc);
    }
    // (stage 3: one bucket per parameter group, the unit of its partition)
    let plan = if s.zero_stage >= 3 { BucketPlan::new(groups, 1, 1)? } else { BucketPlan::for_bucket_size(groups, s.bucket_elems.max(1))? };
    let grad_bytes = if s.comm_bf16 { 2.0 } else { 4.0 };
    let scatters = s.zero_stage >= 2 && s.reduce_scatter;
    let bucket_time = |i: usize| -> Result<(f64, f64), String> {
        let len = plan.buckets[i].span.len;
        if !scatters {
            let bytes = len as f64 * grad_bytes;
            return Ok((net.time(Op::AllReduce, bytes)?, bytes));
        }
        // stage 2: the prefix that divides by the world reduce-scattered, its tail all-reduced
        let cut = len - len % world;
        let (pb, tb) = (cut as f64 * grad_bytes, (len - cut) as f64 * grad_bytes);
        Ok((net.time(Op::ReduceScatter, pb)? + net.time(Op::AllReduce, tb)?, pb + tb))
    };
    // ranks time-slicing one GPU take turns on it, and a collective's kernels hold the GPU
    // while they wait for the network: the reductions cannot run beside the other ranks'
    // backward compute. They can while the ranks wait on the network themselves: inside the
    // backward of a sequence-parallel group, its all-to-alls (on the group's own
    // communicator), the share `a2a / bwd` of it.
    let time_sliced = s.ranks_per_device > 1 && profile.device_kind != "cpu";
    let bwd_a2a = a2a_pass / 2.0;
    if time_sliced && s.overlap {
        notes.push(if bwd_a2a > 0.0 {
            "ranks time-slicing one GPU: the reductions overlap the backward only while it waits on the sequence-parallel all-to-alls (the collectives' kernels hold the GPU in turn)".into()
        } else {
            "ranks time-slicing one GPU: the reductions are not overlapped with the backward (the collectives' kernels hold the GPU in turn)".into()
        });
    }
    let overlap_rate = match (s.overlap, time_sliced) {
        (false, _) => 0.0,
        (true, false) => 1.0,
        (true, true) if bwd > 0.0 => bwd_a2a / bwd,
        (true, true) => 0.0,
    };
    let overlap = s.overlap && !time_sliced;
    // stage 3 partitions the gradients: every micro-batch's backward reduces each group as it
    // finishes and waits for it there (the gradient slot is the next group's), so its
    // reductions are exposed, GAS times a step
    let stage3 = s.zero_stage >= 3;
    let rounds = if stage3 { s.gas as f64 } else { 1.0 };
    let (buckets, exposed) = match world > 1 {
        true if stage3 => stage3_reductions(&plan, &done, &bucket_time, s.gas)?,
        true => bucket_timeline(&plan, &done, bwd, overlap_rate, &bucket_time)?,
        false => (Vec::new(), 0.0),
    };
    // the boundary also waits for the slowest rank: the step's compute varies between
    // repetitions (the profile's spread, GAS passes adding up independently), and the
    // collective finishes with the last of `world` ranks
    let straggle = t.pass_spread_s * k * (s.gas as f64).sqrt() * expected_max_normal(world);
    let exposed = exposed + straggle;
    let mut comm_total: f64 = rounds * buckets.iter().map(|b| b.end_s - b.start_s).sum::<f64>();
    let mut bytes: f64 = rounds * buckets.iter().map(|b| b.bytes).sum::<f64>();
    // what a gathered weight costs on the wire: the dtype the forward reads (a GPU's compute
    // copy; the CPU's f32)
    let gpu = profile.device_kind != "cpu";
    let value_bytes = if gpu { profile.compute_bytes } else { 4.0 };
    // stage 3: the partitioned blocks' gathers of every pass, each hidden behind the block
    // before it where prefetched (`model::partition`)
    let (gather_exposed, gather_total, gather_bytes) = if s.zero_stage >= 3 && world > 1 { stage3_gathers(groups, &t.backward_groups_s, fwd, s, net, k, value_bytes)? } else { (0.0, 0.0, 0.0) };
    let exposed = exposed + gather_exposed;
    comm_total += gather_total;
    bytes += gather_bytes;
    let all_to_all = s.gas as f64 * a2a_pass;
    comm_total += all_to_all;
    bytes += s.gas as f64 * a2a_bytes;
    // the optimizer: whole at stage 0, this rank's shard at stage ≥ 1, then the gradient
    // norm's all-reduce and the updated weights gathered bucket by bucket: on a GPU the
    // compute copy (`compute_bytes` a value, the master weights stay sharded) behind the next
    // forward, on the CPU the f32 weights at the boundary
    let opt_full = t.optimizer_s * share * s.compute_scale;
    let (optimizer, allgather) = if s.zero_stage >= 1 && world > 1 {
        let mut gathers = Vec::with_capacity(plan.buckets.len());
        // (stage 3 gathers the resident groups after the update; the blocks in the passes)
        let resident = |i: usize| s.zero_stage < 3 || i == 0 || i + 1 == plan.buckets.len() || plan.buckets[i].span.len <= s.stage3.param_persistence_threshold;
        for (_, b) in plan.buckets.iter().enumerate().filter(|(i, _)| resident(*i)) {
            let cut = (b.span.len - b.span.len % world) as f64 * value_bytes;
            gathers.push(net.time(Op::AllGather, cut)?);
            bytes += cut;
        }
        let norm = net.time(Op::AllReduce, 8.0)?;
        // (stage 3 waits for its resident groups' gather at the boundary)
        let ag = if gpu && overlap && s.zero_stage < 3 {
            gather_behind_forward(&plan, &gathers, &t.backward_groups_s, fwd)?
        } else {
            gathers.iter().sum()
        };
        (opt_full / world as f64 + norm + ag, norm + ag)
    } else {
        (opt_full, 0.0)
    };
    let data = match s.loader {
        Some((rate, cores)) => {
            let load = s.gas as f64 * rank_micro[slow] / (rate * cores);
            (load - compute).max(0.0)
        }
        None => {
            notes.push("data loading not modelled (no loader rate: `vitscale plan --data D.json` with a saved `bench --data --json`, or the cluster file's loader_images_per_s_per_core)".into());
            0.0
        }
    };
    if share != 1.0 {
        notes.push(format!("{} rank(s) per device: compute × {share:.2} ({})", s.ranks_per_device, sharing_rule(profile, s.ranks_per_device)));
    }
    // the loop's read-back, once a step (ranks sharing a device wait for it side by side); on
    // the CPU every call is synchronous, and two separately timed steps differ by noise only
    let loop_s = if profile.device_kind == "cpu" { 0.0 } else { t.loop_s };
    let step = compute + exposed + optimizer + data + loop_s;
    // the ranks of a sequence-parallel group share their images
    let global_batch = s.micro * s.gas * (world / sp);
    let ips = global_batch as f64 / step;
    Ok(Prediction {
        world,
        global_batch,
        images_per_s: ips,
        images_per_s_per_rank: ips / world as f64,
        step_s: step,
        compute_s: compute,
        forward_s: s.gas as f64 * fwd,
        backward_s: s.gas as f64 * bwd,
        comm_total_s: comm_total,
        comm_exposed_s: exposed,
        straggle_s: straggle,
        optimizer_s: optimizer,
        allgather_s: allgather,
        data_s: data,
        all_to_all_s: all_to_all,
        loop_s,
        comm_bytes_per_step: bytes,
        buckets,
        rank_micro,
        notes,
    })
}

/// Sequence parallelism's all-to-alls over one pass (forward + backward): (seconds, bytes sent
/// per rank). Per block four exchanges of the rank's `micro`·N/SP tokens (qkv 3E and the output E
/// values in the forward, their gradients in the backward), over the group of `sp`
/// consecutive ranks: inside a node when it fits there, else across `sp`/g nodes.
fn sequence_all_to_alls(profile: &Profile, micro: f64, sp: usize, net: &Network) -> Result<(f64, f64), String> {
    let m = &profile.model_config;
    let own = micro * m.num_tokens().div_ceil(sp) as f64 * m.embed_dim as f64 * profile.compute_bytes;
    let g = net.ranks_per_node.max(1);
    let group = if sp <= g { Network { ranks_per_node: sp, nodes: 1, ..net.clone() } } else { Network { ranks_per_node: g, nodes: sp.div_ceil(g), ..net.clone() } };
    let per_block = 2.0 * (group.time(Op::AllGather, 3.0 * own)? + group.time(Op::AllGather, own)?);
    let blocks = m.depth as f64;
    Ok((blocks * per_block, blocks * 2.0 * 4.0 * own * (sp - 1) as f64 / sp as f64))
}

/// ZeRO-3's weight gathers over one step of `s`: (exposed seconds, seconds on the wire,
/// bytes). `groups` in backward order (head, blocks last to first, embedding) with their
/// backward seconds; each block's forward is taken as the forward's share in proportion to
/// its backward. The schedule of `model::partition`: the first forward of a step gathers
/// every partitioned block, each backward and later forward all but the blocks still in the
/// slots (two with the prefetch, one without). Prefetched, a gather waits only for what the
/// block before it does not cover; otherwise it is exposed whole.
#[allow(clippy::too_many_arguments)]
fn stage3_gathers(groups: &[Span], backward_groups_s: &[f64], fwd: f64, s: &Scenario, net: &Network, k: f64, value_bytes: f64) -> Result<(f64, f64, f64), String> {
    let world = net.world();
    let z = &s.stage3;
    let blocks: Vec<(usize, f64)> = (1..groups.len().saturating_sub(1)).filter(|&i| groups[i].len > z.param_persistence_threshold).map(|i| (groups[i].len, backward_groups_s[i] * k)).collect();
    let Some(largest) = blocks.iter().map(|b| b.0).max() else { return Ok((0.0, 0.0, 0.0)) };
    let prefetch = largest <= z.prefetch_bucket_size && 2 * largest <= z.max_live_parameters;
    let bwd_sum: f64 = backward_groups_s.iter().sum::<f64>() * k;
    let fwd_of = |b: f64| if bwd_sum > 0.0 { fwd * b / bwd_sum } else { 0.0 };
    let kept = if prefetch { 2 } else { 1 };
    let (mut exposed, mut total, mut bytes) = (0.0, 0.0, 0.0);
    for pass in 0..2 * s.gas {
        // the first forward gathers every block; each later pass all but those still in a slot
        let skip = if pass == 0 { 0 } else { kept.min(blocks.len()) };
        let gathered: Vec<&(usize, f64)> = blocks.iter().skip(skip).collect();
        for (j, &&(len, bwd_s)) in gathered.iter().enumerate() {
            let cut = (len - len % world) as f64 * value_bytes;
            let g = net.time(Op::AllGather, cut)?;
            total += g;
            bytes += cut;
            // what the previous block of the pass computes while this gather runs
            let cover = if pass % 2 == 0 { fwd_of(bwd_s) } else { bwd_s };
            exposed += if prefetch && j > 0 { (g - cover).max(0.0) } else { g };
        }
    }
    Ok((exposed, total, bytes))
}

/// The factor on the profile's compute for one of `k` ranks sharing a device. A GPU (or an
/// unknown CPU) is time-sliced: k. CPU ranks launched on the profiled machine get
/// t = ⌈cores / k⌉ threads each (`vitscale launch`) and run side by side. A profile taken by
/// k ranks of t threads side by side (`ProfilePoint`s of one rank among them) is their compute
/// as it is: 1. Otherwise the profile's threads over t, compute taken to scale linearly with
/// threads, times k·t / cores where the ranks' threads outnumber the cores, over the same
/// oversubscription the profile's own ranks had. With a profile of one rank on every core this
/// is k.
pub fn sharing_factor(profile: &Profile, k: usize) -> f64 {
    let k = k.max(1);
    if profile.device_kind == "cpu" && profile.cores > 0 && profile.threads > 0 {
        let cores = profile.cores as f64;
        let t = profile.cores.div_ceil(k);
        let oversubscribed = ((k * t) as f64 / cores).max(1.0);
        let profiled = ((profile.ranks.max(1) * profile.threads) as f64 / cores).max(1.0);
        profile.threads as f64 / t as f64 * oversubscribed / profiled
    } else {
        k as f64
    }
}

fn sharing_rule(profile: &Profile, k: usize) -> String {
    if profile.device_kind == "cpu" && profile.cores > 0 && profile.threads > 0 {
        let side = if profile.ranks > 1 { format!(" as one of {} ranks side by side", profile.ranks) } else { " alone".to_string() };
        format!("{k} CPU rank(s) on {} cores get {} thread(s) each; the profile ran {}{side}", profile.cores, profile.cores.div_ceil(k.max(1)), profile.threads)
    } else {
        format!("{k} ranks time-slice the device")
    }
}

/// E[max of n independent standard normal variables]: how far the slowest of n ranks lags the
/// typical one, in standard deviations. Exact values (numerical integration) up to 8, then at
/// powers of two to 4096, linear in ln n between them and held beyond.
pub fn expected_max_normal(n: usize) -> f64 {
    const SMALL: [f64; 9] = [0.0, 0.0, 0.5642, 0.8463, 1.0294, 1.1630, 1.2672, 1.3522, 1.4236];
    const POW2: [(f64, f64); 10] = [(8.0, 1.4236), (16.0, 1.7660), (32.0, 2.0697), (64.0, 2.3437), (128.0, 2.5946), (256.0, 2.8269), (512.0, 3.0439), (1024.0, 3.2482), (2048.0, 3.4418), (4096.0, 3.6261)];
    if n < SMALL.len() {
        return SMALL[n];
    }
    let x = (n as f64).ln();
    for w in POW2.windows(2) {
        let ((n0, y0), (n1, y1)) = (w[0], w[1]);
        if (n as f64) <= n1 {
            return y0 + (y1 - y0) * (x - n0.ln()) / (n1.ln() - n0.ln());
        }
    }
    POW2[POW2.len() - 1].1
}

/// Throughput relative to every device running one rank alone at the same micro and GAS
/// (no communication): `world / ranks_per_device` devices, so K ranks time-sharing a device
/// are compared with that device's one rank, not with K of them.
pub fn efficiency(profile: &Profile, groups: &[Span], s: &Scenario, p: &Prediction) -> Result<f64, String> {
    // (one device alone runs whole images: no sequence-parallel group)
    let one = Scenario { ranks_per_device: 1, shares: None, slowdown: Vec::new(), sequence_parallel: 1, ..s.clone() };
    let alone = predict(profile, groups, &one, &Network { ranks_per_node: 1, nodes: 1, intra: None, inter: None })?;
    let devices = p.world as f64 / s.ranks_per_device.max(1) as f64;
    Ok(p.images_per_s / (alone.images_per_s * devices))
}

/// Memory per rank in bytes, from the run's plan (`train::plan::Plan::for_config`, its one
/// estimate `train::memory::estimate`): weights (+ compute copy), gradients, optimizer state
/// by ZeRO stage, and activations.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryPrediction {
    pub weights: u64,
    pub compute_copy: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    pub activations: u64,
    pub total: u64,
}

/// The memory of one rank of a run, from its plan (`plan::run_plan`: the configuration's batch,
/// world size, optimizer and ZeRO stage on the profiled device).
pub fn memory(plan: &crate::train::plan::Plan) -> Result<MemoryPrediction, String> {
    let est = plan.memory.as_ref().ok_or("the run's plan has no memory estimate")?;
    let m = &est.state;
    let activations = est.activations as u64;
    Ok(MemoryPrediction {
        weights: m.weights,
        compute_copy: m.compute_copy,
        gradients: m.gradients,
        optimizer_state: m.optimizer_state,
        activations,
        total: m.total + activations,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ab(alpha_us: f64, gb_s: f64) -> AlphaBeta {
        AlphaBeta { alpha_s: alpha_us * 1e-6, beta_bytes_s: gb_s * 1e9 }
    }

    fn level(a: AlphaBeta) -> Level {
        Level::uniform("test", a)
    }

    /// Inside the measured sizes at the measured rank count the curve is read (log–log
    /// between points); elsewhere the α–β ring.
    #[test]
    fn a_measured_curve_is_used_inside_its_range() {
        let a = ab(5.0, 10.0);
        let pts = vec![(1e6, 1e-3), (4e6, 16e-3)];
        let l = Level { curve: Some(Curve { world: 2, points: [pts.clone(), pts.clone(), pts] }), ..level(a) };
        // halfway in log size between 1e6 and 4e6 is 2e6: halfway in log time, 4 ms
        assert!((l.time(Op::AllReduce, 2, 2e6) - 4e-3).abs() < 1e-12);
        assert_eq!(l.time(Op::AllReduce, 2, 4e6), 16e-3);
        assert_eq!(l.time(Op::AllReduce, 2, 8e6), ring_time(Op::AllReduce, 2, 8e6, &a));
        assert_eq!(l.time(Op::AllReduce, 4, 2e6), ring_time(Op::AllReduce, 4, 2e6, &a));
    }

    /// Hand-computed ring times: 4 ranks, 100 MB at 10 GB/s with 5 µs per step.
    #[test]
    fn ring_times_match_the_formulas() {
        let a = ab(5.0, 10.0);
        // all-reduce: 2·3/4 · 1e8/1e10 + 2·3·5e-6 = 0.015 + 0.00003
        assert!((ring_time(Op::AllReduce, 4, 1e8, &a) - 0.01503).abs() < 1e-12);
        // reduce-scatter / all-gather: 3/4 · 0.01 + 3·5e-6
        assert!((ring_time(Op::ReduceScatter, 4, 1e8, &a) - 0.007515).abs() < 1e-12);
        assert!((ring_time(Op::AllGather, 4, 1e8, &a) - 0.007515).abs() < 1e-12);
        assert_eq!(ring_time(Op::AllReduce, 1, 1e8, &a), 0.0);
    }

    /// Two nodes of 4: intra reduce-scatter + inter all-reduce of 1/4 at a quarter of the
    /// node's bandwidth + intra all-gather.
    #[test]
    fn hierarchical_all_reduce_adds_the_levels() {
        let (i, o) = (ab(2.0, 100.0), ab(10.0, 20.0));
        let net = Network { ranks_per_node: 4, nodes: 2, intra: Some(level(i)), inter: Some(level(o)) };
        let s = 4e8;
        let intra = 0.75 * s / 1e11 + 3.0 * 2e-6;
        // 2·1/2 · (s/4) / (20e9/4) + 2·1·10e-6 = s/20e9 + 20e-6
        let inter = s / 20e9 + 20e-6;
        let t = net.time(Op::AllReduce, s).expect("time");
        assert!((t - (2.0 * intra + inter)).abs() < 1e-12, "{t}");
        let missing = Network { inter: None, ..net };
        assert!(missing.time(Op::AllReduce, s).unwrap_err().contains("inter"));
    }

    /// Three buckets on a backward of 3 groups done at 1, 2, 3 s, each reduction 1.5 s:
    /// starts 1, 2.5, 4 (the link is busy), ends 2.5, 4, 5.5: 2.5 s exposed after the
    /// backward's end at 3 s. Without overlap all start at 3: 3 + 4.5 = 7.5, 4.5 s exposed.
    #[test]
    fn bucket_overlap_timeline_on_three_buckets() {
        let groups = vec![Span { off: 20, len: 10 }, Span { off: 10, len: 10 }, Span { off: 0, len: 10 }];
        let plan = BucketPlan::new(&groups, 10, 10).expect("plan");
        assert_eq!(plan.buckets.len(), 3);
        let time = |_: usize| Ok((1.5, 40.0));
        let (t, exposed) = bucket_timeline(&plan, &[1.0, 2.0, 3.0], 3.0, 1.0, &time).expect("timeline");
        let starts: Vec<f64> = t.iter().map(|b| b.start_s).collect();
        let ends: Vec<f64> = t.iter().map(|b| b.end_s).collect();
        assert_eq!(starts, vec![1.0, 2.5, 4.0]);
        assert_eq!(ends, vec![2.5, 4.0, 5.5]);
        assert!((exposed - 2.5).abs() < 1e-12);
        let (_, exposed) = bucket_timeline(&plan, &[1.0, 2.0, 3.0], 3.0, 0.0, &time).expect("timeline");
        assert!((exposed - 4.5).abs() < 1e-12);
        // fast reductions hide completely except the last bucket's
        let quick = |_: usize| Ok((0.25, 40.0));
        let (_, exposed) = bucket_timeline(&plan, &[1.0, 2.0, 3.0], 3.0, 1.0, &quick).expect("timeline");
        assert!((exposed - 0.25).abs() < 1e-12);
    }

    /// Three buckets of one group each (groups in backward order: group 2 is the forward's
    /// first), gathered from the last bucket: bucket 2 (1 s) has arrived at 1 s, bucket 1
    /// (2 s) at 3 s, bucket 0 (3 s) at 6 s. A forward of 3 s, 1 s a group, runs group 2 over
    /// 1–2 s, group 1 over 3–4 s, group 0 over 6–7 s: 4 s beyond its own 3 s. A forward slow
    /// enough hides everything but the first gather.
    #[test]
    fn the_gather_behind_the_forward_waits_bucket_by_bucket() {
        let groups = vec![Span { off: 20, len: 10 }, Span { off: 10, len: 10 }, Span { off: 0, len: 10 }];
        let plan = BucketPlan::new(&groups, 10, 10).expect("plan");
        let exposed = gather_behind_forward(&plan, &[3.0, 2.0, 1.0], &[1.0, 1.0, 1.0], 3.0).expect("timeline");
        assert!((exposed - 4.0).abs() < 1e-12, "{exposed}");
        let hidden = gather_behind_forward(&plan, &[0.1, 0.1, 0.1], &[1.0, 1.0, 1.0], 30.0).expect("timeline");
        assert!((hidden - 0.1).abs() < 1e-12, "{hidden}");
    }

    /// Data-parallel ranks time-slicing one GPU hide none of their reductions behind the
    /// backward: the exposed time is every bucket's (as without `overlap_comm`); CPU ranks keep
    /// the overlap.
    #[test]
    fn time_sliced_gpu_ranks_expose_every_reduction() {
        let mut p = toy_profile();
        let groups = crate::plan::groups(&p);
        let net = two_ranks(ab(10.0, 1.0));
        // buckets of about a group each, so the first ones can start during the backward
        let buckets = Scenario { bucket_elems: groups.iter().map(|g| g.len).max().unwrap_or(1), ..Scenario::new(8, 1) };
        let shared = Scenario { ranks_per_device: 2, ..buckets.clone() };
        let cpu = predict(&p, &groups, &shared, &net).expect("cpu");
        p.device_kind = "cuda".into();
        let gpu = predict(&p, &groups, &shared, &net).expect("gpu");
        let serial = predict(&p, &groups, &Scenario { overlap: false, ..shared.clone() }, &net).expect("no overlap");
        assert!(cpu.comm_exposed_s < gpu.comm_exposed_s, "{} vs {}", cpu.comm_exposed_s, gpu.comm_exposed_s);
        assert!((gpu.comm_exposed_s - serial.comm_exposed_s).abs() < 1e-12);
        assert!((gpu.comm_exposed_s - gpu.comm_total_s).abs() < 1e-12);
        // one rank per GPU overlaps again
        let own = predict(&p, &groups, &buckets, &net).expect("own");
        assert!(own.buckets.len() > 2 && own.comm_exposed_s < own.comm_total_s);
    }

    /// At rate ½ during the backward (ends at 3 s), three reductions of 1.5 s whose groups are
    /// done at 1, 2 and 3 s: the first does 1 s of its work by 3 s (2 s at half speed) and ends
    /// at 3.5; the others start after it at full speed: 5.0 and 6.5, 3.5 s exposed — between
    /// full overlap's 2.5 and none's 4.5. Quick ones (0.25 s) end at 1.5, 2.5 and 3.25.
    #[test]
    fn a_reduction_at_a_share_of_its_speed_during_the_backward() {
        let groups = vec![Span { off: 20, len: 10 }, Span { off: 10, len: 10 }, Span { off: 0, len: 10 }];
        let plan = BucketPlan::new(&groups, 10, 10).expect("plan");
        let time = |_: usize| Ok((1.5, 40.0));
        let (t, exposed) = bucket_timeline(&plan, &[1.0, 2.0, 3.0], 3.0, 0.5, &time).expect("timeline");
        let ends: Vec<f64> = t.iter().map(|b| b.end_s).collect();
        assert_eq!(ends, vec![3.5, 5.0, 6.5]);
        assert!((exposed - 3.5).abs() < 1e-12, "{exposed}");
        let quick = |_: usize| Ok((0.25, 40.0));
        let (t, exposed) = bucket_timeline(&plan, &[1.0, 2.0, 3.0], 3.0, 0.5, &quick).expect("timeline");
        let ends: Vec<f64> = t.iter().map(|b| b.end_s).collect();
        assert_eq!(ends, vec![1.5, 2.5, 3.25]);
        assert!((exposed - 0.25).abs() < 1e-12);
        // a reduction that takes no time ends where it starts, at any rate (0 included)
        for rate in [0.0, 0.5] {
            let (t, exposed) = bucket_timeline(&plan, &[1.0, 2.0, 3.0], 3.0, rate, &|_| Ok((0.0, 0.0))).expect("timeline");
            assert!(t.iter().all(|b| b.end_s == b.start_s) && exposed == 0.0, "rate {rate}");
        }
    }

    /// Time-slicing GPU ranks of a sequence-parallel group hide part of the reductions: those
    /// run while the backward waits on its all-to-alls, so less is exposed than with no
    /// overlap, and more than with the overlap of ranks on GPUs of their own.
    #[test]
    fn time_sliced_sequence_parallel_ranks_hide_reductions_behind_their_all_to_alls() {
        let mut p = toy_profile();
        p.device_kind = "cuda".into();
        let groups = crate::plan::groups(&p);
        let net = two_ranks(ab(10.0, 1.0));
        let buckets = Scenario { bucket_elems: groups.iter().map(|g| g.len).max().unwrap_or(1), sequence_parallel: 2, ..Scenario::new(8, 2) };
        let shared = Scenario { ranks_per_device: 2, ..buckets.clone() };
        let sliced = predict(&p, &groups, &shared, &net).expect("time-sliced");
        let serial = predict(&p, &groups, &Scenario { overlap: false, ..shared.clone() }, &net).expect("no overlap");
        assert!(sliced.all_to_all_s > 0.0);
        assert!(sliced.comm_exposed_s < serial.comm_exposed_s, "{} vs {}", sliced.comm_exposed_s, serial.comm_exposed_s);
        let separate = predict(&p, &groups, &buckets, &net).expect("one rank a GPU");
        assert!(separate.comm_exposed_s < sliced.comm_exposed_s, "{} vs {}", separate.comm_exposed_s, sliced.comm_exposed_s);
    }

    /// ZeRO-3 adds the blocks' gathers of every pass (the first forward of a step all of them,
    /// every later pass all but the two still in the slots), reduce-scatters one bucket per
    /// group in every micro-batch (GAS times stage 2's gradient bytes, all exposed), and
    /// gathers only the resident groups after the update; the prefetch hides gathers behind
    /// compute, and blocks kept whole gather nothing in the passes.
    #[test]
    fn zero_3_gathers_every_pass_and_the_prefetch_hides_them() {
        let p = toy_profile();
        let groups = crate::plan::groups(&p);
        let net = two_ranks(ab(10.0, 1.0));
        let all = crate::config::Stage3Config { param_persistence_threshold: 0, ..Default::default() };
        let z2 = predict(&p, &groups, &Scenario { zero_stage: 2, bucket_elems: 1, ..Scenario::new(8, 2) }, &net).expect("stage 2");
        let z3 = predict(&p, &groups, &Scenario { zero_stage: 3, stage3: all, ..Scenario::new(8, 2) }, &net).expect("stage 3");
        let d = groups.len() - 2;
        let block = groups[1].len;
        // 4 passes (GAS 2): d + 3·(d − 2) block gathers, less stage 2's gather of the blocks after the update
        let gathers = (d + 3 * (d - 2)) as f64 * (block - block % 2) as f64 * 4.0;
        let blocks_after_update: f64 = groups[1..groups.len() - 1].iter().map(|g| (g.len - g.len % 2) as f64 * 4.0).sum();
        // the gradients reduce-scattered in both micro-batches: one more round of stage 2's
        let round: f64 = z2.buckets.iter().map(|b| b.bytes).sum();
        assert!(round > 0.0);
        assert!((z3.comm_bytes_per_step - z2.comm_bytes_per_step - gathers + blocks_after_update - round).abs() < 1.0, "{} vs {}", z3.comm_bytes_per_step, z2.comm_bytes_per_step);
        assert!(z3.step_s > z2.step_s);
        let z3_reductions: f64 = z3.buckets.iter().map(|b| b.end_s - b.start_s).sum();
        assert!(z3.comm_exposed_s >= 2.0 * z3_reductions, "{} vs 2 × {z3_reductions}", z3.comm_exposed_s);
        let serial = predict(&p, &groups, &Scenario { zero_stage: 3, stage3: crate::config::Stage3Config { prefetch_bucket_size: 0, ..all }, ..Scenario::new(8, 2) }, &net).expect("no prefetch");
        assert!(serial.comm_exposed_s > z3.comm_exposed_s, "{} vs {}", serial.comm_exposed_s, z3.comm_exposed_s);
        let resident = predict(&p, &groups, &Scenario { zero_stage: 3, ..Scenario::new(8, 2) }, &net).expect("resident");
        assert!((resident.comm_bytes_per_step - z2.comm_bytes_per_step - round).abs() < 1.0, "{} vs {}", resident.comm_bytes_per_step, z2.comm_bytes_per_step);
        // on a GPU every gathered weight is the bf16 value the forward reads: half the bytes
        let mut gp = p.clone();
        gp.device_kind = "cuda".into();
        assert_eq!(gp.compute_bytes, 2.0);
        let g2 = predict(&gp, &groups, &Scenario { zero_stage: 2, bucket_elems: 1, ..Scenario::new(8, 2) }, &net).expect("gpu stage 2");
        let g3 = predict(&gp, &groups, &Scenario { zero_stage: 3, stage3: all, ..Scenario::new(8, 2) }, &net).expect("gpu stage 3");
        let g_round: f64 = g2.buckets.iter().map(|b| b.bytes).sum();
        assert!((g3.comm_bytes_per_step - g2.comm_bytes_per_step - (gathers - blocks_after_update) / 2.0 - g_round).abs() < 1.0, "{} vs {}", g3.comm_bytes_per_step, g2.comm_bytes_per_step);
    }

    /// On a GPU, ZeRO gathers the compute copy (2 bytes a value) behind the next forward; on
    /// the CPU the f32 weights at the boundary. The profile's logged step beyond its parts is
    /// the loop's cost on a GPU, 0 on the CPU.
    #[test]
    fn zero_gathers_and_the_loop_cost_follow_the_device() {
        let mut p = toy_profile();
        let groups = crate::plan::groups(&p);
        let net = two_ranks(ab(10.0, 1.0));
        let z1 = Scenario { zero_stage: 1, ..Scenario::new(8, 1) };
        let cpu = predict(&p, &groups, &z1, &net).expect("cpu");
        let stage0 = predict(&p, &groups, &Scenario::new(8, 1), &net).expect("stage 0");
        // f32 all-gather of each bucket's divisible prefix: about the all-reduce's bytes again
        assert!((cpu.comm_bytes_per_step - 2.0 * stage0.comm_bytes_per_step).abs() < 4.0 * 2.0 * 8.0, "{} vs {}", cpu.comm_bytes_per_step, stage0.comm_bytes_per_step);
        p.device_kind = "cuda".into();
        let gpu = predict(&p, &groups, &z1, &net).expect("gpu");
        assert!((gpu.comm_bytes_per_step - 1.5 * stage0.comm_bytes_per_step).abs() < 4.0 * 2.0 * 8.0);
        assert!(gpu.allgather_s < cpu.allgather_s, "the gather hides behind the forward: {} vs {}", gpu.allgather_s, cpu.allgather_s);
        assert_eq!(gpu.loop_s, 0.0);
        // a logged step 1 ms over the parts (7.5 ms of pass + 2 ms of optimizer at micro 8)
        for pt in &mut p.points {
            pt.logged_step_s = pt.forward_s + pt.backward_s + pt.optimizer_s + 1e-3;
        }
        let logged = predict(&p, &groups, &Scenario::new(8, 1), &net).expect("logged");
        assert!((logged.loop_s - 1e-3).abs() < 1e-12 && (logged.step_s - stage0.step_s - 1e-3).abs() < 1e-12);
        p.device_kind = "cpu".into();
        assert_eq!(predict(&p, &groups, &Scenario::new(8, 1), &net).expect("cpu").loop_s, 0.0);
    }

    /// A profile of the built-in model whose every group takes 1 ms of backward and
    /// 0.5 ms of forward per 8 images, 2 ms of optimizer.
    fn toy_profile() -> Profile {
        use crate::plan::profile::ProfilePoint;
        let cfg = crate::model::ModelConfig::preset("vit_builtin_default").expect("preset");
        let groups = cfg.depth + 2;
        let point = |micro: usize| {
            let k = micro as f64 / 8.0;
            ProfilePoint { micro, forward_s: groups as f64 * 0.5e-3 * k, backward_s: groups as f64 * 1e-3 * k, backward_groups_s: vec![1e-3 * k; groups], forward_groups_s: vec![0.5e-3 * k; groups], optimizer_s: 2e-3, step_s: 0.0, logged_step_s: 0.0, pass_spread_s: 0.0, reps: 1 }
        };
        Profile {
            format: crate::plan::profile::PROFILE_FORMAT.into(),
            version: crate::plan::profile::PROFILE_VERSION,
            device: "toy".into(),
            device_kind: "cpu".into(),
            threads: 1,
            cores: 0,
            ranks: 1,
            model: "vit_builtin_default".into(),
            params: crate::model::ParamTable::new(&cfg).total,
            model_config: cfg,
            dtype: "bf16".into(),
            compute_bytes: 2.0,
            attention_saved_per_image: 100,
            graph: false,
            recompute: false,
            attention: "toy".into(),
            optimizer: "AdamW".into(),
            forward_split: String::new(),
            points: vec![point(8), point(16)],
        }
    }

    fn two_ranks(a: AlphaBeta) -> Network {
        Network { ranks_per_node: 2, nodes: 1, intra: Some(level(a)), inter: None }
    }

    /// GAS multiplies compute, not communication (only the boundary micro-batch reduces); a
    /// bf16 wire moves half the bytes; K ranks on one device take K × the compute; ZeRO ≥ 1
    /// divides the optimizer by the world and adds the weights' all-gather.
    #[test]
    fn the_step_terms_follow_the_scenario() {
        let p = toy_profile();
        let groups = crate::plan::groups(&p);
        let net = two_ranks(ab(10.0, 1.0));
        let one = predict(&p, &groups, &Scenario::new(8, 1), &net).expect("gas 1");
        let four = predict(&p, &groups, &Scenario::new(8, 4), &net).expect("gas 4");
        assert!((four.compute_s - 4.0 * one.compute_s).abs() < 1e-12);
        assert_eq!(four.comm_total_s, one.comm_total_s);
        assert_eq!(four.comm_bytes_per_step, one.comm_bytes_per_step);
        // 5 groups × 1 ms backward + 5 × 0.5 ms forward at micro 8
        assert!((one.compute_s - 7.5e-3).abs() < 1e-12);
        let bf16 = predict(&p, &groups, &Scenario { comm_bf16: true, ..Scenario::new(8, 1) }, &net).expect("bf16");
        assert!((bf16.comm_bytes_per_step * 2.0 - one.comm_bytes_per_step).abs() < 1e-6);
        assert_eq!(one.comm_bytes_per_step, 4.0 * p.params as f64);
        // time-slicing: two ranks on one device, each computes twice as long
        let shared = predict(&p, &groups, &Scenario { ranks_per_device: 2, ..Scenario::new(8, 1) }, &net).expect("shared");
        assert!((shared.compute_s - 2.0 * one.compute_s).abs() < 1e-12);
        assert!((shared.optimizer_s - 2.0 * one.optimizer_s).abs() < 1e-12);
        let eff = efficiency(&p, &groups, &Scenario { ranks_per_device: 2, ..Scenario::new(8, 1) }, &shared).expect("eff");
        // one device: the ideal is one rank's throughput, which time-slicing alone keeps
        let alone = 8.0 / (7.5e-3 + 2e-3);
        assert!((eff - shared.images_per_s / alone).abs() < 1e-9);
        // ZeRO 1: half the optimizer, plus the all-gather of the f32 weights
        let z1 = predict(&p, &groups, &Scenario { zero_stage: 1, ..Scenario::new(8, 1) }, &net).expect("zero 1");
        assert!(z1.allgather_s > 0.0);
        assert!((z1.optimizer_s - (1e-3 + z1.allgather_s)).abs() < 1e-12);
        // one rank: no communication at all
        let solo = predict(&p, &groups, &Scenario::new(8, 1), &Network { ranks_per_node: 1, nodes: 1, intra: None, inter: None }).expect("solo");
        assert_eq!((solo.comm_total_s, solo.comm_exposed_s, solo.comm_bytes_per_step), (0.0, 0.0, 0.0));
        // interpolation in micro: 12 images lie halfway between 8 and 16
        let mid = predict(&p, &groups, &Scenario::new(12, 1), &net).expect("12");
        assert!((mid.compute_s - 1.5 * one.compute_s).abs() < 1e-12);
        // balance shares: the rank given 3/4 of 2 × 8 images sets the pace (12 images)
        let bal = predict(&p, &groups, &Scenario { shares: Some(vec![3.0, 1.0]), ..Scenario::new(8, 1) }, &net).expect("shares");
        assert!((bal.compute_s - mid.compute_s).abs() < 1e-12);
    }

    /// Sequence parallelism: two ranks of one group do the compute of half the images each,
    /// plus four all-to-alls a block and pass that nothing hides, and count their images once.
    #[test]
    fn sequence_parallel_halves_the_compute_and_adds_the_all_to_alls() {
        let p = toy_profile();
        let groups = crate::plan::groups(&p);
        let (alpha, beta) = (10e-6, 1e9);
        let net = two_ranks(ab(10.0, 1.0));
        let dp = predict(&p, &groups, &Scenario::new(16, 2), &net).expect("data parallel");
        let sp = predict(&p, &groups, &Scenario { sequence_parallel: 2, ..Scenario::new(16, 2) }, &net).expect("sp 2");
        let half = predict(&p, &groups, &Scenario::new(8, 2), &net).expect("micro 8");
        // a rank's own tokens of 16 images: ⌈N/2⌉ tokens × E values of 2 bytes
        let m = &p.model_config;
        let own = 16.0 * m.num_tokens().div_ceil(2) as f64 * m.embed_dim as f64 * 2.0;
        // each exchange: half of the buffer crosses, one latency (two ranks)
        let x = |bytes: f64| bytes / 2.0 / beta + alpha;
        let pass = m.depth as f64 * 2.0 * (x(3.0 * own) + x(own));
        assert!((sp.all_to_all_s - 2.0 * pass).abs() < 1e-12, "{} vs {}", sp.all_to_all_s, 2.0 * pass);
        assert!((sp.compute_s - (half.compute_s + 2.0 * pass)).abs() < 1e-12);
        assert!(sp.comm_total_s > sp.all_to_all_s);
        assert_eq!(sp.global_batch, 16 * 2);
        assert_eq!(dp.global_batch, 16 * 2 * 2);
        assert_eq!(dp.all_to_all_s, 0.0);
        // the group must divide the ranks and the heads
        assert!(predict(&p, &groups, &Scenario { sequence_parallel: 3, ..Scenario::new(16, 1) }, &net).is_err());
    }

    /// Sharing: a GPU profile is time-sliced (× k); CPU ranks get ⌈cores / k⌉ threads and the
    /// profile's threads are scaled to theirs; a profile taken by k ranks side by side is taken
    /// as it is for k ranks.
    #[test]
    fn sharing_a_device() {
        let mut p = toy_profile();
        p.device_kind = "cuda".into();
        assert_eq!((sharing_factor(&p, 1), sharing_factor(&p, 4)), (1.0, 4.0));
        p.device_kind = "cpu".into();
        // a CPU profile without its core count: time-sliced too
        assert_eq!(sharing_factor(&p, 2), 2.0);
        (p.cores, p.threads) = (2, 2);
        // on every core: k, also when 4 one-thread ranks share 2 cores
        assert_eq!((sharing_factor(&p, 1), sharing_factor(&p, 2), sharing_factor(&p, 4)), (1.0, 2.0, 4.0));
        // profiled with one thread: exact for 2 ranks on 2 cores, half for 1 rank on both
        p.threads = 1;
        assert_eq!((sharing_factor(&p, 2), sharing_factor(&p, 1)), (1.0, 0.5));
        (p.cores, p.threads) = (16, 16);
        // 3 ranks of 6 threads on 16 cores: 18 threads time-share 16 cores
        assert!((sharing_factor(&p, 3) - 3.0).abs() < 1e-12);
        // profiled by 2 ranks of 1 thread side by side on 2 cores: exactly what 2 ranks run
        (p.cores, p.threads, p.ranks) = (2, 1, 2);
        assert_eq!(sharing_factor(&p, 2), 1.0);
        // one rank on both cores: twice the threads, half the time
        assert_eq!(sharing_factor(&p, 1), 0.5);
        // 4 one-thread ranks on 2 cores are twice as crowded as the 2 profiled
        assert_eq!(sharing_factor(&p, 4), 2.0);
        // 4 ranks of 2 threads (set by hand) side by side on 4 cores: 8 threads, a core per
        // rank, as 4 launched ranks of 1 thread each have; 2 launched ranks get 2 cores each
        (p.cores, p.threads, p.ranks) = (4, 2, 4);
        assert_eq!(sharing_factor(&p, 4), 1.0);
        assert_eq!(sharing_factor(&p, 2), 0.5);
    }

    /// The slowest of n ranks: exact small values, a smooth continuation beyond 8, and the
    /// straggle term σ·√GAS·E[max] in the step.
    #[test]
    fn the_wait_for_the_slowest_rank() {
        assert_eq!(expected_max_normal(1), 0.0);
        assert!((expected_max_normal(2) - 1.0 / std::f64::consts::PI.sqrt()).abs() < 1e-4);
        let (e8, e9, e256) = (expected_max_normal(8), expected_max_normal(9), expected_max_normal(256));
        // 9 ranks: 1.4850 exactly; the interpolation in ln n stays within 0.02
        assert!(e9 > e8 && (e9 - 1.485).abs() < 0.02, "{e9}");
        assert!((e256 - 2.8269).abs() < 1e-12, "{e256}");
        assert!(expected_max_normal(300) > e256 && expected_max_normal(100_000) == 3.6261);
        let mut p = toy_profile();
        for x in p.points.iter_mut() {
            x.pass_spread_s = 1e-3;
        }
        let groups = crate::plan::groups(&p);
        let net = two_ranks(ab(10.0, 1.0));
        let q = predict(&p, &groups, &Scenario::new(8, 4), &net).expect("predict");
        assert!((q.straggle_s - 1e-3 * 2.0 * 0.5642).abs() < 1e-12);
        let solo = predict(&p, &groups, &Scenario::new(8, 4), &Network { ranks_per_node: 1, nodes: 1, intra: None, inter: None }).expect("solo");
        assert_eq!(solo.straggle_s, 0.0);
    }

    /// Memory per rank by stage, by hand for Adam (2 state values per parameter) over 4 ranks
    /// with a bf16 compute copy: f32 master weights 4P (stage 0) or P (a ZeRO rank keeps its
    /// shard), copy 2P, gradients 4P, state 8P (stage 0) or 2P.
    #[test]
    fn memory_by_stage() {
        let p = toy_profile();
        let n = p.params as u64;
        let base = crate::plan::default_config_value(&p);
        for (stage, weights, state) in [(0u8, 4 * n, 8 * n), (1, n, 2 * n), (2, n, 2 * n)] {
            let mut v = base.clone();
            v["zero_optimization"] = serde_json::json!({"stage": stage});
            let cfg = crate::plan::resolve_with(&v, 16, 1, 4).expect("config");
            let m = memory(&crate::plan::run_plan(&p, &cfg)).expect("memory");
            assert_eq!((m.weights, m.compute_copy, m.gradients, m.optimizer_state), (weights, 2 * n, 4 * n, state), "stage {stage}");
            assert!(m.activations > 0);
            assert_eq!(m.total, weights + 6 * n + state + m.activations);
        }
        // activations grow with the micro-batch
        let small = memory(&crate::plan::run_plan(&p, &crate::plan::resolve_with(&base, 8, 1, 1).expect("config"))).expect("memory");
        let large = memory(&crate::plan::run_plan(&p, &crate::plan::resolve_with(&base, 64, 1, 1).expect("config"))).expect("memory");
        assert!(large.activations > 4 * small.activations);
    }
}
