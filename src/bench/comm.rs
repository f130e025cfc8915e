//! `vitscale bench --comm`: an nccl-tests-like sweep of all-reduce, reduce-scatter and
//! all-gather over message sizes, on the ranks of the job (CPU ranks over the TCP ring, GPU
//! ranks over NCCL; start several with `vitscale launch`). Run on every rank; rank 0 prints.
//!
//! Definitions are nccl-tests' but for the time: `size` is the bytes of the whole buffer (the
//! all-reduce's input, the reduce-scatter's input, the all-gather's output), `time` the mean
//! over ranks of the median iteration (nccl-tests: the mean one), `algbw = size / time`, and `busbw = algbw · f` with
//! f = 2(n−1)/n for all-reduce and (n−1)/n for reduce-scatter and all-gather, so busbw is
//! comparable with the link's bandwidth whatever the rank count. Before timing each size, one
//! operation on known values is checked (`wrong` counts the elements that differ).
//!
//! `--comm-buckets PRESET` adds the sizes of that model's gradient buckets (on an fp32 and a
//! bf16 wire, at the default `reduce_bucket_size`) to the doubling ones, so the planner reads
//! the time of the messages a run sends off measured points instead of interpolating between
//! sizes twice apart, across which a host's caches and allocator can change the cost per byte.

use std::time::Instant;

use serde::Serialize;

use crate::backend::Backend;
use crate::comm::{shard, Collective, Comm, ReduceOp, Span};
use crate::plan::comm_fit::COMM_FORMAT;

/// Flags of `bench --comm` (flattened into `vitscale bench`).
#[derive(clap::Args, Debug, Clone)]
pub struct CommBenchArgs {
    /// Measure collectives (all-reduce, reduce-scatter, all-gather) over sizes instead of the
    /// model, on the job's ranks (`vitscale launch --nproc-per-node N -- bench --comm`).
    #[arg(long)]
    pub comm: bool,
    /// With --comm: smallest message in bytes.
    #[arg(long, default_value_t = 8192)]
    pub comm_min_bytes: u64,
    /// With --comm: largest message in bytes (sizes double from the smallest).
    #[arg(long, default_value_t = 64 << 20)]
    pub comm_max_bytes: u64,
    /// With --comm: timed iterations per size (after --warmup ones, at least 1).
    #[arg(long, default_value_t = 20)]
    pub comm_iters: usize,
    /// With --comm: also measure the sizes of this model preset's gradient buckets (as
    /// training sends them at the default reduce_bucket_size, on an fp32 and a bf16 wire).
    #[arg(long, value_name = "PRESET")]
    pub comm_buckets: Option<String>,
    /// With --comm: the collectives, comma-separated, of all_reduce, reduce_scatter, all_gather,
    /// all_to_all (sequence parallelism's exchange; not in the default list).
    #[arg(long, default_value = "all_reduce,reduce_scatter,all_gather")]
    pub comm_ops: String,
    /// With --comm: rank 0 also writes the table as JSON to this file (the `--json` object),
    /// the input `vitscale plan --comm` fits latency and bandwidth from.
    #[arg(long, value_name = "C.json")]
    pub comm_out: Option<std::path::PathBuf>,
}

/// One measured (operation, size).
#[derive(Clone, Debug, Serialize)]
pub struct CommRow {
    pub op: String,
    pub bytes: u64,
    /// f32 elements of the buffer.
    pub count: usize,
    pub time_us: f64,
    pub algbw_gb_s: f64,
    pub busbw_gb_s: f64,
    pub wrong: usize,
}

#[derive(Clone, Debug, Serialize)]
pub struct CommBenchResult {
    /// What wrote the file (`vitscale plan --comm` checks it).
    pub format: &'static str,
    pub transport: String,
    pub device: String,
    pub world_size: usize,
    pub dtype: &'static str,
    pub iters: usize,
    pub warmup: usize,
    pub rows: Vec<CommRow>,
}

/// The sizes, doubling from `min` to `max` bytes, each a whole number of f32 per rank.
pub fn sizes(min: u64, max: u64, world: usize) -> Result<Vec<usize>, String> {
    if min == 0 || max < min {
        return Err(format!("--comm-min-bytes {min} / --comm-max-bytes {max}: need 0 < min <= max"));
    }
    let unit = 4 * world as u64;
    let mut out = Vec::new();
    let mut b = min;
    while b <= max {
        let count = (b.div_ceil(unit) * unit / 4) as usize;
        if out.last() != Some(&count) {
            out.push(count);
        }
        b = b.saturating_mul(2);
    }
    Ok(out)
}

/// The bytes of `preset`'s gradient buckets at the default bucket size, on an fp32 wire and on
/// a bf16 one, in increasing order.
pub fn bucket_bytes(preset: &str) -> Result<Vec<u64>, String> {
    let cfg = crate::model::ModelConfig::preset(preset).ok_or_else(|| format!("--comm-buckets {preset}: not a model preset (`vitscale bench --help` names the presets)"))?;
    let groups = crate::model::ParamTable::new(&cfg).gradient_groups();
    let plan = crate::train::sync::BucketPlan::for_bucket_size(&groups, crate::train::sync::DEFAULT_BUCKET_ELEMS).map_err(|e| format!("--comm-buckets {preset}: {e}"))?;
    let mut out: Vec<u64> = plan.buckets.iter().flat_map(|b| [b.span.len as u64 * 4, b.span.len as u64 * 2]).filter(|&b| b > 0).collect();
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// `sizes(min, max, world)` with the sizes of `extra` (bytes, each rounded up as those are)
/// merged in.
pub fn sizes_with(min: u64, max: u64, extra: &[u64], world: usize) -> Result<Vec<usize>, String> {
    let mut out = sizes(min, max, world)?;
    let unit = 4 * world as u64;
    out.extend(extra.iter().map(|&b| (b.div_ceil(unit) * unit / 4) as usize));
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

fn parse_ops(s: &str) -> Result<Vec<Collective>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| match x {
            "all_reduce" | "allreduce" => Ok(Collective::AllReduce(ReduceOp::Sum)),
            "reduce_scatter" | "reducescatter" => Ok(Collective::ReduceScatter(ReduceOp::Sum)),
            "all_gather" | "allgather" => Ok(Collective::AllGather),
            "all_to_all" | "alltoall" => Ok(Collective::AllToAll),
            other => Err(format!("--comm-ops: unknown collective `{other}` (all_reduce, reduce_scatter, all_gather, all_to_all)")),
        })
        .collect()
}

/// nccl-tests' bus-bandwidth factor.
pub fn bus_factor(op: Collective, world: usize) -> f64 {
    let n = world as f64;
    match op {
        Collective::AllReduce(_) => 2.0 * (n - 1.0) / n,
        _ => (n - 1.0) / n,
    }
}

/// Fills the buffer with the known input of `op` for this rank and checks the result after
/// one operation; returns the number of wrong elements.
fn check<B: Backend>(be: &B, comm: &mut dyn Comm<B::Buf>, buf: &mut B::Buf, op: Collective, count: usize) -> Result<usize, String> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let span = Span { off: 0, len: count };
    // values small enough that every sum is exact in f32
    let input: Vec<f32> = match op {
        Collective::AllGather => (0..count).map(|i| if shard(span, world, rank).contains(i) { (rank + 1) as f32 + (i % 7) as f32 } else { -1.0 }).collect(),
        // block j (count / world values) goes to rank j; each value names its sender
        Collective::AllToAll => (0..count).map(|i| ((rank + 1) * 8 + i % 8) as f32).collect(),
        _ => (0..count).map(|i| (rank + 1) as f32 + (i % 7) as f32).collect(),
    };
    be.upload(buf, 0, &input).map_err(|e| e.to_string())?;
    let w = comm.start(op, buf, span).map_err(|e| e.to_string())?;
    comm.wait(w, buf).map_err(|e| e.to_string())?;
    let out = be.download(buf).map_err(|e| e.to_string())?;
    let sum_ranks = (world * (world + 1) / 2) as f32;
    let wrong = match op {
        Collective::AllReduce(_) => (0..count).filter(|&i| out[i] != sum_ranks + (world * (i % 7)) as f32).count(),
        Collective::ReduceScatter(_) => {
            let s = shard(span, world, rank);
            (s.off..s.off + s.len).filter(|&i| out[i] != sum_ranks + (world * (i % 7)) as f32).count()
        }
        Collective::AllGather => (0..count)
            .filter(|&i| {
                let owner = i / (count / world);
                out[i] != (owner + 1) as f32 + (i % 7) as f32
            })
            .count(),
        // block j of rank r's result is block r of rank j's input
        Collective::AllToAll => (0..count).filter(|&i| out[i] != ((i / (count / world) + 1) * 8 + (rank * (count / world) + i % (count / world)) % 8) as f32).count(),
        // (not benchmarked)
        Collective::Broadcast { .. } => 0,
    };
    Ok(wrong)
}

trait Contains {
    fn contains(&self, i: usize) -> bool;
}
impl Contains for Span {
    fn contains(&self, i: usize) -> bool {
        i >= self.off && i < self.off + self.len
    }
}

/// Runs the sweep on this rank; every rank returns the same rows.
pub fn run<B: Backend>(be: &B, comm: &mut dyn Comm<B::Buf>, args: &CommBenchArgs, warmup: usize) -> Result<CommBenchResult, String> {
    let world = comm.world_size();
    let ops = parse_ops(&args.comm_ops)?;
    let extra = match &args.comm_buckets {
        Some(preset) => bucket_bytes(preset)?,
        None => Vec::new(),
    };
    let counts = sizes_with(args.comm_min_bytes, args.comm_max_bytes, &extra, world)?;
    let iters = args.comm_iters.max(1);
    let max_count = counts.iter().copied().max().unwrap_or(0);
    let mut buf = be.alloc_f32(max_count).map_err(|e| format!("allocating {} bytes: {e}", max_count * 4))?;
    let mut rows = Vec::new();
    for &op in &ops {
        for &count in &counts {
            let wrong = check(be, comm, &mut buf, op, count)?;
            let span = Span { off: 0, len: count };
            for _ in 0..warmup {
                let w = comm.start(op, &mut buf, span).map_err(|e| e.to_string())?;
                comm.wait(w, &mut buf).map_err(|e| e.to_string())?;
            }
            comm.barrier().map_err(|e| e.to_string())?;
            let mut times = Vec::with_capacity(iters);
            for _ in 0..iters {
                let t = Instant::now();
                let w = comm.start(op, &mut buf, span).map_err(|e| e.to_string())?;
                comm.wait(w, &mut buf).map_err(|e| e.to_string())?;
                be.synchronize().map_err(|e| e.to_string())?;
                times.push(t.elapsed().as_secs_f64());
            }
            // the median iteration: a stretch of a shared host's noise moves it only when it
            // covers half the iterations (the planner's profiles keep medians too)
            let secs = crate::util::median(&times).unwrap_or(0.0);
            // drop the transport's own timing records of these operations
            let _ = comm.take_device_timing(std::time::Instant::now());
            let mut v = [secs, wrong as f64];
            comm.all_reduce_host(&mut v).map_err(|e| e.to_string())?;
            let time = v[0] / world as f64;
            let bytes = count as u64 * 4;
            let algbw = bytes as f64 / time / 1e9;
            rows.push(CommRow {
                op: op.name().to_string(),
                bytes,
                count,
                time_us: time * 1e6,
                algbw_gb_s: algbw,
                busbw_gb_s: algbw * bus_factor(op, world),
                wrong: v[1] as usize,
            });
        }
    }
    Ok(CommBenchResult { format: COMM_FORMAT, transport: comm.describe(), device: be.name(), world_size: world, dtype: "float", iters, warmup, rows })
}

/// The nccl-tests-style table.
pub fn table(r: &CommBenchResult) -> String {
    let mut s = format!("# {} | {} | {} | {} | {} after {} warm-up\n", r.transport, r.device, crate::util::plural(r.world_size, "rank", "ranks"), r.dtype, crate::util::plural(r.iters, "iteration", "iterations"), r.warmup);
    s.push_str(&format!("{:>16} {:>14} {:>12} {:>12} {:>12} {:>12} {:>7}\n", "op", "size (B)", "count", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"));
    for x in &r.rows {
        s.push_str(&format!("{:>16} {:>14} {:>12} {:>12.1} {:>12.3} {:>12.3} {:>7}\n", x.op, x.bytes, x.count, x.time_us, x.algbw_gb_s, x.busbw_gb_s, x.wrong));
    }
    s
}

/// `vitscale bench --comm` on this process's rank: CPU ranks or GPU ranks as `device` says.
pub fn command(args: &CommBenchArgs, device: &str, warmup: usize, json: bool) -> anyhow::Result<()> {
    let env = crate::comm::DistEnv::detect()?;
    let opts = crate::comm::CommOptions::from_env()?;
    // every rank of the job runs the same sweep; the hash makes ranks with other flags refuse
    let hash = format!("bench-comm {} {} {} {} {} {:?}", args.comm_min_bytes, args.comm_max_bytes, args.comm_iters, args.comm_ops, warmup, args.comm_buckets);
    let result = match device {
        "cpu" => {
            let be = crate::backend::cpu::Cpu::new();
            let mut comm = crate::comm::init_cpu(&env, &opts, &hash)?;
            run(&be, comm.as_mut(), args, warmup).map_err(|e| anyhow::anyhow!("bench --comm (rank {}): {e}", env.rank))?
        }
        "cuda" => {
            let index = match std::env::var(crate::comm::env::DEVICE_INDEX_VAR) {
                Ok(v) if !v.trim().is_empty() => v.trim().parse().map_err(|_| anyhow::anyhow!("{}={v:?}: expected a GPU index", crate::comm::env::DEVICE_INDEX_VAR))?,
                _ => env.local_rank,
            };
            crate::backend::cuda::probe(index).map_err(|e| anyhow::anyhow!("--device cuda: no usable GPU {index}: {e}"))?;
            let be = crate::backend::cuda::Cuda::new(index).map_err(|e| anyhow::anyhow!("--device cuda: GPU {index}: {e}"))?;
            if env.world_size > 1 {
                let mut comm = crate::backend::cuda::nccl::NcclComm::connect(&env, &opts, &hash, &be)?;
                run(&be, &mut comm, args, warmup).map_err(|e| anyhow::anyhow!("bench --comm (rank {}): {e}", env.rank))?
            } else {
                run(&be, &mut crate::comm::SingleComm::new(), args, warmup).map_err(|e| anyhow::anyhow!("bench --comm: {e}"))?
            }
        }
        other => anyhow::bail!("--device {other}: bench --comm runs on cpu or cuda"),
    };
    if env.rank == 0 {
        crate::out!("{}", table(&result));
        if result.world_size == 1 {
            crate::outln!("# one rank: every collective is a no-op; start several with `vitscale launch --nproc-per-node N -- bench --comm`");
        }
        if json {
            crate::outln!("{}", serde_json::to_string(&result)?);
        }
        if let Some(path) = &args.comm_out {
            let text = serde_json::to_string_pretty(&result)?;
            crate::util::write_atomic(path, text.as_bytes()).map_err(|e| anyhow::anyhow!("--comm-out {}: {e}", path.display()))?;
        }
    }
    let wrong: usize = result.rows.iter().map(|r| r.wrong).sum();
    if wrong > 0 {
        anyhow::bail!("bench --comm: {wrong} elements held wrong values after a collective (see #wrong)");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_double_and_divide_by_the_world() {
        let s = sizes(1000, 8000, 3).expect("valid");
        assert_eq!(s.len(), 4);
        assert!(s.iter().all(|c| c % 3 == 0));
        assert!(s.windows(2).all(|w| w[1] > w[0]));
        assert!(sizes(0, 10, 1).is_err());
        assert!(sizes(10, 5, 1).is_err());
    }

    /// ViT-Ti/4 32 px's gradients (under 25 MiB of f32) go in two buckets: the first of about
    /// 1 MiB of f32, then the rest. Each is measured on an fp32 wire (× 4 bytes) and a bf16
    /// one (× 2), and the sizes join the doubling series in order.
    #[test]
    fn bucket_sizes_join_the_series() {
        let cfg = crate::model::ModelConfig::preset("vit_tiny_patch4_32").expect("preset");
        let total = crate::model::ParamTable::new(&cfg).gradient_groups().iter().map(|g| g.len).sum::<usize>() as u64;
        let b = bucket_bytes("vit_tiny_patch4_32").expect("buckets");
        assert_eq!(b.len(), 4, "{b:?}");
        assert_eq!((b[1], b[3]), (2 * b[0], 2 * b[2]), "{b:?}");
        assert_eq!(b[1] + b[3], 4 * total, "{b:?}");
        assert!(b[1] >= 4 << 18 && b[1] < 4 << 20, "first bucket {} bytes", b[1]);
        assert!(bucket_bytes("no_such_model").expect_err("unknown").contains("no_such_model"));
        let s = sizes_with(1 << 20, 4 << 20, &[3_000_001, 2 << 20], 2).expect("sizes");
        // 1, 2, 4 MiB and 3 000 001 bytes rounded up to whole f32 per rank (3 000 008)
        assert_eq!(s, vec![1 << 18, 1 << 19, 750_002, 1 << 20]);
    }

    #[test]
    fn bus_factors_are_nccl_tests() {
        assert_eq!(bus_factor(Collective::AllReduce(ReduceOp::Sum), 4), 1.5);
        assert_eq!(bus_factor(Collective::AllGather, 4), 0.75);
        assert_eq!(bus_factor(Collective::ReduceScatter(ReduceOp::Sum), 2), 0.5);
    }
}
