//! The communicator's checks behind `vitscale selftest`: every collective the training step
//! and ZeRO use, on this rank's communicator (NCCL on a GPU, the TCP ring on CPU ranks; one
//! rank outside a launcher), against sums computed on the host in f64.
//!
//! Every rank's input is drawn from (seed, rank), so each rank can compute what all of them
//! hold without exchanging it; the seed is rank 0's, shared first. Spans start at an odd
//! offset and have a length that no world size up to 8 divides into equal ring chunks, where
//! the collective allows it.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{rel_err, Check};
use crate::backend::{BResult, Backend, BackendError};
use crate::comm::{Collective, Comm, ReduceOp, Span, Wire};

fn input(seed: u64, rank: usize, len: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (0x5eed_c044_u64.wrapping_mul(rank as u64 + 1)));
    (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

fn check(name: String, got: &[f32], want: &[f32], tol: f64) -> Check {
    let e = rel_err(got, want);
    Check { name, rel_err: e, tol, pass: e <= tol }
}

fn comm_err(e: crate::comm::CommError) -> BackendError {
    BackendError::Device(format!("communicator: {e}"))
}

/// The collectives' checks on `comm` (every rank of its world must call this with the same
/// `seed`).
pub fn comm_checks<B: Backend>(be: &B, comm: &mut dyn Comm<B::Buf>, seed: u64) -> BResult<Vec<Check>> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let tag = format!("[{}]", comm.describe());
    let mut out = Vec::new();
    let total = 4099 + 840; // an odd head, then a span every world size up to 8 divides
    let span_odd = Span { off: 3, len: 4093 };
    let span_even = Span { off: 4099, len: 840 };
    let all: Vec<Vec<f32>> = (0..world).map(|r| input(seed, r, total)).collect();
    let sum = |s: Span| -> Vec<f32> { (s.off..s.off + s.len).map(|i| all.iter().map(|v| v[i] as f64).sum::<f64>() as f32).collect() };
    let mut buf = be.alloc_f32(total)?;
    let run = |be: &B, comm: &mut dyn Comm<B::Buf>, buf: &mut B::Buf, op: Collective, span: Span, wire: Wire| -> BResult<Vec<f32>> {
        be.upload(buf, 0, &all[rank])?;
        let w = comm.start_as(op, buf, span, wire).map_err(comm_err)?;
        comm.wait(w, buf).map_err(comm_err)?;
        be.synchronize()?;
        Ok(be.download(buf)?[span.range()].to_vec())
    };
    let plain = Wire::PLAIN;

    let got = run(be, comm, &mut buf, Collective::AllReduce(ReduceOp::Sum), span_odd, plain)?;
    out.push(check(format!("comm all_reduce sum f32 {tag}"), &got, &sum(span_odd), 1e-6));
    let got = run(be, comm, &mut buf, Collective::AllReduce(ReduceOp::Avg), span_odd, plain)?;
    let avg: Vec<f32> = sum(span_odd).iter().map(|v| v / world as f32).collect();
    out.push(check(format!("comm all_reduce avg f32 {tag}"), &got, &avg, 1e-6));
    if world > 1 {
        // (one process reduces nothing: it has no wire to scale)
        let got = run(be, comm, &mut buf, Collective::AllReduce(ReduceOp::Sum), span_odd, Wire { bf16: false, pre: 3.0, post: 0.25 })?;
        let scaled: Vec<f32> = sum(span_odd).iter().map(|v| v * 0.75).collect();
        out.push(check(format!("comm all_reduce sum, scaled ×3 before and ×0.25 after {tag}"), &got, &scaled, 1e-6));
        // bf16 inputs and partial sums: relative 2^-8 per rounding
        let got = run(be, comm, &mut buf, Collective::AllReduce(ReduceOp::Sum), span_odd, Wire { bf16: true, pre: 1.0, post: 1.0 })?;
        out.push(check(format!("comm all_reduce sum on a bf16 wire {tag}"), &got, &sum(span_odd), 1e-2));
        let rounded = got.iter().all(|v| v.to_bits() & 0xffff == 0);
        out.push(Check { name: format!("comm bf16 wire results are bf16 values {tag}"), rel_err: if rounded { 0.0 } else { 1.0 }, tol: 0.0, pass: rounded });
    }
    if world > 1 {
        // a compute-dtype buffer (bf16 or fp16 on a GPU: the collective must name the format the
        // buffer holds); its inputs and the sum are rounded once each: the compute tolerance
        let mut half = be.alloc(total)?;
        be.upload(&mut half, 0, &all[rank])?;
        let w = comm.start_as(Collective::AllReduce(ReduceOp::Sum), &mut half, span_odd, plain).map_err(comm_err)?;
        comm.wait(w, &mut half).map_err(comm_err)?;
        be.synchronize()?;
        let got = be.download(&half)?[span_odd.range()].to_vec();
        out.push(check(format!("comm all_reduce sum of a compute-dtype buffer {tag}"), &got, &sum(span_odd), 1e-2));
    }
    // reduce-scatter: this rank's shard of the sum
    let got = run(be, comm, &mut buf, Collective::ReduceScatter(ReduceOp::Sum), span_even, plain)?;
    let sh = crate::comm::shard(Span { off: 0, len: span_even.len }, world, rank);
    out.push(check(format!("comm reduce_scatter sum (own shard) {tag}"), &got[sh.range()], &sum(span_even)[sh.range()], 1e-6));
    // reduce-scatter on a scaled bf16 wire (ZeRO's gradients on NCCL; a transport that cannot
    // refuses it, and then there is nothing to check)
    if world > 1 {
        be.upload(&mut buf, 0, &all[rank])?;
        match comm.start_as(Collective::ReduceScatter(ReduceOp::Sum), &mut buf, span_even, Wire { bf16: true, pre: 2.0, post: 0.25 }) {
            Ok(w) => {
                comm.wait(w, &mut buf).map_err(comm_err)?;
                be.synchronize()?;
                let got = be.download(&buf)?[span_even.range()].to_vec();
                let want: Vec<f32> = sum(span_even).iter().map(|v| v * 0.5).collect();
                out.push(check(format!("comm reduce_scatter on a scaled bf16 wire (own shard) {tag}"), &got[sh.range()], &want[sh.range()], 1e-2));
            }
            Err(crate::comm::CommError::Unsupported { .. }) => {}
            Err(e) => return Err(comm_err(e)),
        }
    }
    // all-gather: every rank's own shard of its input, concatenated
    let got = run(be, comm, &mut buf, Collective::AllGather, span_even, plain)?;
    let gathered: Vec<f32> = (0..world)
        .flat_map(|r| {
            let s = crate::comm::shard(span_even, world, r);
            all[r][s.range()].to_vec()
        })
        .collect();
    out.push(check(format!("comm all_gather {tag}"), &got, &gathered, 0.0));
    // broadcast from the last rank
    let root = world - 1;
    let got = run(be, comm, &mut buf, Collective::Broadcast { root }, span_odd, plain)?;
    out.push(check(format!("comm broadcast from rank {root} {tag}"), &got, &all[root][span_odd.range()], 0.0));
    // all-to-all (sequence parallelism): block j of this rank's span comes from rank j's block
    // `rank`. Every transport has it (and `split_groups`): a refusal is a failed check.
    let blocks = |inputs: &[Vec<f32>], members: &[usize], me: usize, span: Span| -> Vec<f32> {
        let c = span.len / members.len();
        members.iter().flat_map(|&r| inputs[r][span.range()][me * c..(me + 1) * c].to_vec()).collect()
    };
    let refused = |name: String, e: crate::comm::CommError| Check { name: format!("{name}: refused: {e}"), rel_err: f64::NAN, tol: 0.0, pass: false };
    let world_ranks: Vec<usize> = (0..world).collect();
    be.upload(&mut buf, 0, &all[rank])?;
    match comm.start(Collective::AllToAll, &mut buf, span_even) {
        Ok(w) => {
            comm.wait(w, &mut buf).map_err(comm_err)?;
            be.synchronize()?;
            let got = be.download(&buf)?[span_even.range()].to_vec();
            out.push(check(format!("comm all_to_all {tag}"), &got, &blocks(&all, &world_ranks, rank, span_even), 0.0));
        }
        Err(e @ crate::comm::CommError::Unsupported { .. }) => out.push(refused(format!("comm all_to_all {tag}"), e)),
        Err(e) => return Err(comm_err(e)),
    }
    // the same in the compute dtype (bf16 on a GPU: the activations sequence parallelism
    // moves), on values the dtype holds exactly, so the result is still exact
    let exact: Vec<Vec<f32>> = all.iter().map(|v| v.iter().map(|x| f32::from_bits(x.to_bits() & 0xffff_0000)).collect()).collect();
    let mut act = be.alloc(total)?;
    let run_act = |comm: &mut dyn Comm<B::Buf>, act: &mut B::Buf, me: usize| -> BResult<Result<Vec<f32>, crate::comm::CommError>> {
        be.upload(act, 0, &exact[me])?;
        let w = match comm.start(Collective::AllToAll, act, span_even) {
            Ok(w) => w,
            Err(e @ crate::comm::CommError::Unsupported { .. }) => return Ok(Err(e)),
            Err(e) => return Err(comm_err(e)),
        };
        comm.wait(w, act).map_err(comm_err)?;
        be.synchronize()?;
        Ok(Ok(be.download(act)?[span_even.range()].to_vec()))
    };
    match run_act(comm, &mut act, rank)? {
        Ok(got) => out.push(check(format!("comm all_to_all in the compute dtype {tag}"), &got, &blocks(&exact, &world_ranks, rank, span_even), 0.0)),
        Err(e) => out.push(refused(format!("comm all_to_all in the compute dtype {tag}"), e)),
    }
    // groups of consecutive ranks (sequence parallelism's groups): all-to-all and all-reduce
    // within the group, on the group's own communicator, while the world's is still in use
    // (pairs, fours and the whole world: sequence_parallel_size 2 and 4 with and without
    // data parallelism)
    let mut sizes: Vec<usize> = [2, 4, world].into_iter().filter(|&g| g > 1 && world.is_multiple_of(g)).collect();
    sizes.dedup();
    for size in sizes {
        let mut group = match comm.split_groups(size) {
            Ok(g) => g,
            Err(e @ crate::comm::CommError::Unsupported { .. }) => {
                out.push(refused(format!("comm groups of {size} {tag}"), e));
                continue;
            }
            Err(e) => return Err(comm_err(e)),
        };
        let base = rank / size * size;
        let members: Vec<usize> = (base..base + size).collect();
        let local_ok = group.rank() == rank - base && group.world_size() == size;
        out.push(Check { name: format!("comm groups of {size}: rank {} of {} in the group {tag}", group.rank(), group.world_size()), rel_err: if local_ok { 0.0 } else { 1.0 }, tol: 0.0, pass: local_ok });
        // a world collective in flight while the group's runs: neither waits on the other's
        be.upload(&mut buf, 0, &all[rank])?;
        let world_work = comm.start(Collective::AllReduce(ReduceOp::Sum), &mut buf, span_even).map_err(comm_err)?;
        match run_act(&mut *group, &mut act, rank)? {
            Ok(got) => out.push(check(format!("comm all_to_all in groups of {size}, compute dtype {tag}"), &got, &blocks(&exact, &members, rank - base, span_even), 0.0)),
            Err(e) => out.push(refused(format!("comm all_to_all in groups of {size} {tag}"), e)),
        }
        comm.wait(world_work, &mut buf).map_err(comm_err)?;
        be.synchronize()?;
        let got = be.download(&buf)?[span_even.range()].to_vec();
        out.push(check(format!("comm all_reduce of the world beside a group's all_to_all {tag}"), &got, &sum(span_even), 1e-6));
        let got = run(be, &mut *group, &mut buf, Collective::AllToAll, span_even, plain)?;
        out.push(check(format!("comm all_to_all in groups of {size} {tag}"), &got, &blocks(&all, &members, rank - base, span_even), 0.0));
        let got = run(be, &mut *group, &mut buf, Collective::AllReduce(ReduceOp::Sum), span_odd, plain)?;
        let want: Vec<f32> = span_odd.range().map(|i| members.iter().map(|&r| all[r][i] as f64).sum::<f64>() as f32).collect();
        out.push(check(format!("comm all_reduce in groups of {size} {tag}"), &got, &want, 1e-6));
        let mut host = vec![rank as f64];
        group.all_reduce_host(&mut host).map_err(comm_err)?;
        let ok = host[0] == members.iter().sum::<usize>() as f64;
        out.push(Check { name: format!("comm all_reduce_host in groups of {size} {tag}"), rel_err: if ok { 0.0 } else { 1.0 }, tol: 0.0, pass: ok });
    }
    // several collectives in flight at once complete in order, each with its own result
    be.upload(&mut buf, 0, &all[rank])?;
    let a = comm.start(Collective::AllReduce(ReduceOp::Sum), &mut buf, Span { off: 0, len: 2000 }).map_err(comm_err)?;
    let b = comm.start(Collective::AllReduce(ReduceOp::Sum), &mut buf, Span { off: 2000, len: 2939 }).map_err(comm_err)?;
    comm.wait(a, &mut buf).map_err(comm_err)?;
    comm.wait(b, &mut buf).map_err(comm_err)?;
    be.synchronize()?;
    let got = be.download(&buf)?;
    out.push(check(format!("comm two all_reduces in flight {tag}"), &got, &sum(Span { off: 0, len: total }), 1e-6));
    // host values
    let mut host = vec![rank as f64 + 0.5, 1.0];
    comm.all_reduce_host(&mut host).map_err(comm_err)?;
    let want = [(world * world) as f64 / 2.0, world as f64];
    let ok = (host[0] - want[0]).abs() < 1e-9 && host[1] == want[1];
    out.push(Check { name: format!("comm all_reduce_host {tag}"), rel_err: if ok { 0.0 } else { 1.0 }, tol: 0.0, pass: ok });
    Ok(out)
}
