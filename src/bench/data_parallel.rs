//! `vitscale launch --nproc-per-node N -- bench`: the benchmarked step on N ranks, with the
//! gradient buckets all-reduced during the last backward exactly as a training step does
//! (`train::sync::BucketSync`), and the figures that say what data parallelism costs.
//!
//! Three measurements, in one process per rank, one after the other:
//! 1. **one rank alone**: rank 0 runs the step with no communication while the others wait at
//!    a barrier; this is the baseline of the scaling efficiency. Its forward and backward
//!    are also timed alone (synchronized around each), for the overlap target.
//! 2. **the bucketed all-reduce alone**: every rank reduces the whole gradient, bucket by
//!    bucket, with no backward to hide behind.
//! 3. **data parallel**: every rank runs the step; the exposed communication is the time the
//!    boundary waits for outstanding buckets (device events on NCCL, the host clock on the TCP
//!    ring).
//!
//! The overlap is as good as the network allows when exposed ≤ max(0, all-reduce alone −
//! backward alone) + 10 % of the all-reduce alone: what the backward cannot hide, plus a
//! margin. When the ranks share one device (`launch --one-gpu`), they also share its compute,
//! so the efficiency against N × one rank is at most 1/N; the report says so.

use std::time::Instant;

use serde::Serialize;

use crate::backend::Backend;
use crate::bench::args::BenchArgs;
use crate::comm::{Comm, Wire};
use crate::train::step::Step;
use crate::train::sync::{BucketPlan, BucketSync, GradSync, LocalGrads, FIRST_BUCKET_ELEMS};
use crate::train::zero::{ZeroLayout, ZeroSync};

/// What a data-parallel benchmark measured (rank 0's view; step times are the slowest rank's).
#[derive(Clone, Debug, Serialize)]
pub struct DataParallelResult {
    pub world: usize,
    pub micro: usize,
    pub gas: usize,
    /// ZeRO stage of the data-parallel step (0: every rank keeps everything).
    pub zero_stage: u8,
    /// Whether the ranks share one device (then they also share its compute).
    pub shared_device: bool,
    /// "off", "non-boundary micro-batches" or "every micro-batch".
    pub graph: String,
    /// "fp32" or "bf16".
    pub wire: String,
    pub buckets: usize,
    pub step_ms: f64,
    pub global_img_per_s: f64,
    pub per_rank_img_per_s: f64,
    pub one_rank_step_ms: f64,
    pub one_rank_img_per_s: f64,
    /// global / (world × one rank).
    pub efficiency: f64,
    pub forward_alone_ms: f64,
    pub backward_alone_ms: f64,
    pub allreduce_alone_ms: f64,
    /// Per step: the boundary's wait for outstanding buckets, and the buckets' own time.
    pub exposed_ms: f64,
    pub comm_total_ms: f64,
    pub exposed_share: f64,
    /// max(0, all-reduce alone − backward alone) + 10 % of the all-reduce alone.
    pub overlap_target_ms: f64,
    pub overlap_met: bool,
    pub bytes_per_step: u64,
    /// The highest peak of device memory any rank's backend held during the data-parallel
    /// phase (None where the backend keeps no count: the CPU).
    pub peak_mem_gib: Option<f64>,
    /// Bus bandwidth of the all-reduce alone (nccl-tests' definition: algbw × 2(N − 1)/N).
    pub allreduce_bus_gb_s: f64,
}

/// How the micro-batch passes run: eager, or replaying a captured graph of one pass.
pub(super) enum Passes<'a> {
    Eager,
    /// Graph for every micro-batch but the last, whose eager backward reports its buckets.
    GraphBeforeBoundary(&'a dyn Fn() -> anyhow::Result<()>),
    /// Graph for every micro-batch: the buckets are reduced after the whole backward.
    GraphAll(&'a dyn Fn() -> anyhow::Result<()>),
}

impl Passes<'_> {
    fn name(&self) -> &'static str {
        match self {
            Passes::Eager => "off",
            Passes::GraphBeforeBoundary(_) => "non-boundary micro-batches",
            Passes::GraphAll(_) => "every micro-batch",
        }
    }
}

/// One optimizer step of `gas` micro-batches; with `sync`, the last pass reports its buckets
/// (unless every pass is a graph replay) and the boundary waits for them.
fn one_step<B: Backend>(be: &B, st: &mut Step<B>, passes: &Passes<'_>, gas: usize, micro: usize, sync: &mut dyn GradSync<B>, step: u64) -> anyhow::Result<()> {
    for m in 0..gas {
        let last = m + 1 == gas;
        match passes {
            // a replay reads every weight: ZeRO's gather (if still arriving) must be done
            Passes::GraphAll(g) => {
                st.vit.await_weights()?;
                g()?
            }
            Passes::GraphBeforeBoundary(g) if !last => {
                st.vit.await_weights()?;
                g()?
            }
            _ if last => st.pass_unlogged_reporting(be, micro, sync)?,
            _ => st.pass_unlogged(be, micro)?,
        }
    }
    let lr = st.optimizer.lr();
    st.boundary(be, sync, lr, step, false)?;
    Ok(())
}

fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Runs the three measurements of the module doc on this rank. `device_id` identifies the
/// device this rank computes on (equal ids = a shared device).
#[allow(clippy::too_many_arguments)]
pub(super) fn measure<B: Backend>(be: &B, st: &mut Step<B>, comm: &mut dyn Comm<B::Buf>, args: &BenchArgs, passes: Passes<'_>, wire: Wire, bucket_elems: usize, device_id: u64) -> anyhow::Result<DataParallelResult> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let (micro, gas) = (args.micro, args.gas.max(1));
    let plan = BucketPlan::new(&st.vit.gradient_groups(), FIRST_BUCKET_ELEMS.min(bucket_elems), bucket_elems).map_err(anyhow::Error::msg)?;
    let mut ids = vec![0f64; world];
    ids[rank] = (device_id & ((1 << 48) - 1)) as f64;
    comm.all_reduce_host(&mut ids)?;
    let mut distinct = ids.clone();
    distinct.sort_by(f64::total_cmp);
    distinct.dedup();
    let shared_device = distinct.len() < world;
    let mut step = 0u64;

    // 1. one rank alone (the others wait at the barrier)
    comm.barrier()?;
    let mut alone = [0f64; 3];
    if rank == 0 {
        for _ in 0..args.warmup.max(1) {
            one_step(be, st, &passes, gas, micro, &mut LocalGrads, step)?;
            step += 1;
        }
        be.synchronize()?;
        let t = Instant::now();
        for _ in 0..args.steps {
            one_step(be, st, &passes, gas, micro, &mut LocalGrads, step)?;
            step += 1;
        }
        be.synchronize()?;
        alone[0] = ms_since(t) / args.steps as f64;
        // forward and backward of one pass, each synchronized; the fastest of three
        let (mut fwd, mut bwd) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..3 {
            let t0 = Instant::now();
            st.vit.forward_staged(be, micro, Some(1.0 / st.plan.global_batch as f32))?;
            be.synchronize()?;
            let t1 = Instant::now();
            st.vit.backward(be)?;
            be.synchronize()?;
            fwd = fwd.min((t1 - t0).as_secs_f64() * 1e3);
            bwd = bwd.min(ms_since(t1));
            st.vit.zero_grads(be)?;
        }
        alone[1] = fwd;
        alone[2] = bwd;
    }
    comm.barrier()?;
    comm.all_reduce_host(&mut alone)?;
    let [one_ms, fwd_ms, bwd_ms] = alone;

    // 2. the bucketed all-reduce alone
    const AR_REPS: usize = 5;
    let mut ar_ms = 0.0;
    let mut bytes = 0u64;
    for rep in 0..=AR_REPS {
        be.synchronize()?;
        comm.barrier()?;
        let t = Instant::now();
        let mut sync = BucketSync::new(&mut *comm, &plan, t);
        sync.wire = wire;
        bytes = GradSync::<B>::finish(&mut sync, be, &mut st.vit.grads)?;
        be.synchronize()?;
        if rep > 0 {
            ar_ms += ms_since(t) / AR_REPS as f64;
        }
    }
    st.vit.zero_grads(be)?;
    comm.take_device_timing(std::time::Instant::now())?;

    // 3. data parallel, at ZeRO stage `args.zero`: from here on this rank keeps only its shard
    // of the optimizer state (and, with a compute copy, of the master weights)
    let zero = match args.zero {
        0 => None,
        s @ (1 | 2) => {
            let l = ZeroLayout::new(&plan, &st.optimizer, s, world, rank, true)?;
            let l = if be.needs_compute_copy() { l.with_master_shard() } else { l };
            let full = be.download(&st.opt_state)?;
            let mut compact = be.alloc_f32(l.buffer_len())?;
            be.upload(&mut compact, 0, &l.shard_state(&full)?)?;
            l.take_master(be, &mut st.vit, &mut compact)?;
            st.opt_state = compact;
            Some(l)
        }
        other => anyhow::bail!("--zero must be 0, 1 or 2, got {other}"),
    };
    // this phase's own peak (the one-rank phase held the whole state)
    be.synchronize()?;
    be.reset_peak_bytes();
    let epoch = Instant::now();
    let dp_step = |st: &mut Step<B>, comm: &mut dyn Comm<B::Buf>, step: u64| -> anyhow::Result<(f64, f64)> {
        let times = match &zero {
            Some(l) => {
                let mut sync = ZeroSync::new(comm, &plan, l, true, epoch);
                sync.wire = wire;
                one_step(be, st, &passes, gas, micro, &mut sync, step)?;
                sync.track.times
            }
            None => {
                let mut sync = BucketSync::new(comm, &plan, epoch);
                sync.wire = wire;
                one_step(be, st, &passes, gas, micro, &mut sync, step)?;
                sync.track.times
            }
        };
        Ok((times.exposed_s, times.total_s))
    };
    for _ in 0..args.warmup.max(1) {
        dp_step(st, comm, step)?;
        step += 1;
    }
    be.synchronize()?;
    comm.barrier()?;
    comm.take_device_timing(std::time::Instant::now())?;
    let (mut host_exposed, mut host_total) = (0.0, 0.0);
    let t = Instant::now();
    for _ in 0..args.steps {
        let (e, tot) = dp_step(st, comm, step)?;
        host_exposed += e;
        host_total += tot;
        step += 1;
    }
    be.synchronize()?;
    let mut step_ms = vec![0f64; world];
    step_ms[rank] = ms_since(t) / args.steps as f64;
    let (exposed_s, total_s) = comm.take_device_timing(std::time::Instant::now())?.map_or((host_exposed, host_total), |t| (t.exposed_s, t.total_s));
    let mut peaks = vec![0f64; world];
    peaks[rank] = be.peak_bytes().map_or(-1.0, |b| b as f64);
    comm.all_reduce_host(&mut peaks)?;
    let peak = [peaks.iter().copied().fold(f64::NEG_INFINITY, f64::max)];
    comm.all_reduce_host(&mut step_ms)?;
    let step_ms = step_ms.iter().copied().fold(0.0, f64::max);

    let global = (world * micro * gas) as f64 / (step_ms * 1e-3);
    let one_rank = (micro * gas) as f64 / (one_ms * 1e-3);
    let exposed_ms = exposed_s * 1e3 / args.steps as f64;
    let target = (ar_ms - bwd_ms).max(0.0) + 0.1 * ar_ms;
    let algbw = bytes as f64 / (ar_ms * 1e-3) / 1e9;
    Ok(DataParallelResult {
        world,
        micro,
        gas,
        zero_stage: args.zero,
        shared_device,
        graph: passes.name().into(),
        wire: if wire.bf16 { "bf16" } else { "fp32" }.into(),
        buckets: plan.buckets.len(),
        step_ms,
        global_img_per_s: global,
        per_rank_img_per_s: global / world as f64,
        one_rank_step_ms: one_ms,
        one_rank_img_per_s: one_rank,
        efficiency: global / (world as f64 * one_rank),
        forward_alone_ms: fwd_ms,
        backward_alone_ms: bwd_ms,
        allreduce_alone_ms: ar_ms,
        exposed_ms,
        comm_total_ms: total_s * 1e3 / args.steps as f64,
        exposed_share: exposed_ms / step_ms,
        overlap_target_ms: target,
        overlap_met: exposed_ms <= target,
        bytes_per_step: bytes,
        peak_mem_gib: (peak[0] >= 0.0).then(|| peak[0] / (1u64 << 30) as f64),
        allreduce_bus_gb_s: algbw * 2.0 * (world as f64 - 1.0) / world as f64,
    })
}

impl std::fmt::Display for DataParallelResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "data parallel: {} ranks × micro {} × GAS {}{} | {:.2} ms/step | {:.1} img/s global, {:.1} per rank | one rank alone {:.1} img/s | efficiency {:.1} % of {} × one rank",
            self.world,
            self.micro,
            self.gas,
            if self.zero_stage > 0 { format!(" × ZeRO {}", self.zero_stage) } else { String::new() },
            self.step_ms, self.global_img_per_s, self.per_rank_img_per_s, self.one_rank_img_per_s, self.efficiency * 100.0, self.world
        )?;
        if self.shared_device {
            writeln!(
                f,
                "the ranks share one device, and so its compute: global / one rank alone = {:.1} % (the ideal is 100 %)",
                100.0 * self.global_img_per_s / self.one_rank_img_per_s
            )?;
        }
        writeln!(
            f,
            "communication per step: exposed {:.2} ms ({:.1} % of the step), buckets busy {:.2} ms | {} buckets, {:.1} MB on a {} wire | all-reduce alone {:.2} ms ({:.2} GB/s bus) | forward alone {:.2} ms, backward alone {:.2} ms",
            self.exposed_ms,
            self.exposed_share * 100.0,
            self.comm_total_ms,
            self.buckets,
            self.bytes_per_step as f64 / 1e6,
            self.wire,
            self.allreduce_alone_ms,
            self.allreduce_bus_gb_s,
            self.forward_alone_ms,
            self.backward_alone_ms
        )?;
        write!(
            f,
            "overlap target: exposed ≤ max(0, all-reduce − backward) + 10 % of the all-reduce = {:.2} ms: {} | graph: {}{}",
            self.overlap_target_ms,
            if self.overlap_met { "met" } else { "missed" },
            self.graph,
            self.peak_mem_gib.map_or(String::new(), |g| format!(" | peak memory per rank {g:.2} GiB"))
        )
    }
}
