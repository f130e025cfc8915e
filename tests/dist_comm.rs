//! Collectives and rendezvous between ranks that are threads of this test, talking TCP over
//! loopback exactly as processes would. Every test is bounded: the timeouts that are meant to
//! fire are 0.5–3 s; the others (5–60 s) are far above what a loaded machine needs.

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

mod common;
use common::free_port;

use vitscale::comm::rendezvous::{rendezvous, RendezvousRequest};
use vitscale::comm::{
    shard, Collective, Comm, CommError, CommOptions, DistEnv, ReduceOp, RendezvousError, SingleComm, Span, TcpComm, Wire,
};

fn env(rank: usize, world: usize, port: u16) -> DistEnv {
    DistEnv::loopback(rank, world, port)
}

fn opts(timeout_s: f64) -> CommOptions {
    CommOptions { timeout: Duration::from_secs_f64(timeout_s), rendezvous_timeout: Duration::from_secs(10) }
}

/// Runs `f(rank, comm)` on `world` threads joined in one TcpComm ring; results by rank.
fn with_world<T: Send>(world: usize, timeout_s: f64, f: impl Fn(usize, &mut TcpComm) -> T + Sync) -> Vec<T> {
    let port = free_port();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let f = &f;
                s.spawn(move || {
                    let mut c = TcpComm::connect(&env(r, world, port), &opts(timeout_s), "cfg").expect("connect");
                    f(r, &mut c)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// A reproducible pseudo-random vector per rank (no shared RNG state between threads).
fn data(rank: usize, len: usize) -> Vec<f32> {
    let mut x = 0x9E37_79B9u32.wrapping_mul(rank as u32 + 1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn all_reduce_sums_identically_on_every_rank() {
    for world in [2, 3, 4] {
        // 1001 elements: chunks of unequal size; offset span to exercise windows.
        let len = 1001;
        let span = Span { off: 7, len };
        let run = || {
            with_world(world, 5.0, |r, c| {
                let mut buf = vec![-5.0f32; len + 20];
                buf[7..7 + len].copy_from_slice(&data(r, len));
                c.all_reduce(&mut buf, span, ReduceOp::Sum).expect("all_reduce");
                buf
            })
        };
        let out = run();
        for r in 1..world {
            assert!(out[r] == out[0], "world {world}: rank {r} differs from rank 0");
        }
        for i in 0..len {
            let want: f64 = (0..world).map(|r| data(r, len)[i] as f64).sum();
            assert!((out[0][7 + i] as f64 - want).abs() < 1e-5, "world {world} elem {i}: {} vs {want}", out[0][7 + i]);
        }
        // Outside the span nothing moved.
        assert!(out[0][..7].iter().chain(&out[0][7 + len..]).all(|&v| v == -5.0));
        // Same summation order every run: bitwise reproducible.
        assert!(run()[0] == out[0], "world {world}: not reproducible");
    }
}

/// A bf16 wire: the sum travels and accumulates in bf16 (every value of the result is a bf16
/// number, the same bits on every rank) and is within bf16 rounding of the f32 sum; the
/// scaling factors apply before and after the sum; other collectives refuse a non-plain wire.
#[test]
fn all_reduce_on_a_bf16_wire_rounds_like_bf16_and_scales() {
    for world in [2, 3, 4] {
        let len = 777;
        let outs = with_world(world, 30.0, |r, c| {
            let mut bf = data(r, len);
            let w = c.start_as(Collective::AllReduce(ReduceOp::Sum), &mut bf, Span { off: 0, len }, Wire { bf16: true, pre: 1.0, post: 1.0 }).expect("start");
            c.wait(w, &mut bf).expect("wait");
            let mut scaled = data(r, len);
            let w = c.start_as(Collective::AllReduce(ReduceOp::Sum), &mut scaled, Span { off: 0, len }, Wire { bf16: false, pre: 3.0, post: 0.25 }).expect("start");
            c.wait(w, &mut scaled).expect("wait");
            let mut other = data(r, 12);
            let refused = c.start_as(Collective::AllGather, &mut other, Span { off: 0, len: 12 }, Wire { bf16: true, pre: 1.0, post: 1.0 });
            (bf, scaled, matches!(refused, Err(CommError::Unsupported { .. })))
        });
        let exact: Vec<f64> = (0..len).map(|i| (0..world).map(|r| data(r, len)[i] as f64).sum()).collect();
        let mut worst = 0f64;
        for (r, (bf, scaled, refused)) in outs.iter().enumerate() {
            assert!(refused, "world {world} rank {r}: all_gather accepted a bf16 wire");
            assert_eq!(bf, &outs[0].0, "world {world}: rank {r} holds other bf16 sums than rank 0");
            for (i, &v) in bf.iter().enumerate() {
                assert_eq!(v.to_bits() & 0xffff, 0, "world {world} rank {r} [{i}]: {v} is not a bf16 value");
                // each of the world − 1 additions rounds to bf16 (relative 2^-8), on partial
                // sums no larger than the sum of magnitudes (< world)
                let bound = world as f64 * world as f64 / 256.0 + 1e-6;
                let err = (v as f64 - exact[i]).abs();
                assert!(err <= bound, "world {world} [{i}]: {v} vs {} (bound {bound})", exact[i]);
                worst = worst.max(err);
            }
            for (i, &v) in scaled.iter().enumerate() {
                let want = exact[i] * 3.0 * 0.25;
                assert!((v as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()), "world {world} [{i}]: scaled {v} vs {want}");
            }
        }
        // the bf16 wire did round: the f32 sum is not what came back
        assert!(worst > 1e-4, "world {world}: the bf16 sums equal the f32 sums ({worst:e}): no rounding happened");
    }
}

#[test]
fn average_reduce_scatter_all_gather_broadcast_barrier_host() {
    let world = 4;
    let out = with_world(world, 5.0, |r, c| {
        // Average of integers 0..3 = 1.5 exactly.
        let mut a = vec![r as f32; 10];
        c.all_reduce_avg(&mut a, Span { off: 0, len: 10 }).expect("avg");

        // Reduce-scatter: rank r owns shard r of the sum.
        let mut rs: Vec<f32> = (0..8).map(|i| (i * 10 + r) as f32).collect();
        let whole = Span { off: 0, len: 8 };
        c.reduce_scatter(&mut rs, whole, ReduceOp::Sum).expect("reduce_scatter");
        let mine = shard(whole, world, r);

        // All-gather: every rank contributes its shard.
        let mut ag = vec![0.0f32; 8];
        for i in shard(whole, world, r).range() {
            ag[i] = 100.0 + i as f32;
        }
        c.all_gather(&mut ag, whole).expect("all_gather");

        // Broadcast from rank 2 of more than one pipeline piece.
        let n = (1 << 20) + 3;
        let mut b = if r == 2 { data(2, n) } else { vec![0.0; n] };
        c.broadcast(&mut b, Span { off: 0, len: n }, 2).expect("broadcast");

        c.barrier().expect("barrier");
        let mut h = [r as f64, 1.0];
        c.all_reduce_host(&mut h).expect("host");
        (a, rs[mine.range()].to_vec(), ag, b == data(2, n), h)
    });
    for (r, (a, rs, ag, bcast_ok, h)) in out.into_iter().enumerate() {
        assert!(a.iter().all(|&v| v == 1.5), "rank {r}: avg {a:?}");
        let want: Vec<f32> = (0..2).map(|k| ((2 * r + k) * 10 * world + 6) as f32).collect();
        assert_eq!(rs, want, "rank {r}: reduce_scatter shard");
        assert_eq!(ag, (0..8).map(|i| 100.0 + i as f32).collect::<Vec<_>>(), "rank {r}: all_gather");
        assert!(bcast_ok, "rank {r}: broadcast");
        assert_eq!(h, [6.0, 4.0], "rank {r}: host all-reduce");
    }
}

#[test]
fn async_collectives_complete_in_order_and_spans_are_checked() {
    let out = with_world(2, 5.0, |r, c| {
        let mut buf = vec![r as f32 + 1.0; 6];
        let w1 = c.start(Collective::AllReduce(ReduceOp::Sum), &mut buf, Span { off: 0, len: 3 }).expect("start 1");
        let w2 = c.start(Collective::AllReduce(ReduceOp::Sum), &mut buf, Span { off: 3, len: 3 }).expect("start 2");
        c.wait(w1, &mut buf).expect("wait 1");
        c.wait(w2, &mut buf).expect("wait 2");
        let uneven = c.reduce_scatter(&mut buf, Span { off: 0, len: 5 }, ReduceOp::Sum).unwrap_err();
        let outside = c.all_reduce(&mut buf, Span { off: 4, len: 5 }, ReduceOp::Sum).unwrap_err();
        (buf, uneven.to_string(), outside.to_string())
    });
    for (buf, uneven, outside) in out {
        assert_eq!(buf, vec![3.0; 6]);
        assert!(uneven.contains("not divisible by the world size 2"), "{uneven}");
        assert!(outside.contains("4..9") && outside.contains("6 elements"), "{outside}");
    }
}

#[test]
fn rank_0_blob_reaches_every_rank_with_the_ring() {
    let port = free_port();
    let out: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|r| {
                s.spawn(move || {
                    let blob = if r == 0 { b"unique-id".to_vec() } else { b"ignored".to_vec() };
                    let (mut c, got) = TcpComm::connect_sharing(&env(r, 3, port), &opts(5.0), "cfg", blob).expect("connect");
                    let mut v = [1.0f64];
                    c.all_reduce_host(&mut v).expect("host all-reduce");
                    assert_eq!(v, [3.0]);
                    got
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    assert!(out.iter().all(|b| b == b"unique-id"), "{out:?}");
}

#[test]
fn single_rank_is_a_no_op() {
    let mut c = SingleComm::new();
    let mut buf = vec![1.0f32, 2.0, 3.0];
    Comm::<Vec<f32>>::all_reduce_avg(&mut c, &mut buf, Span { off: 0, len: 3 }).unwrap();
    Comm::<Vec<f32>>::all_gather(&mut c, &mut buf, Span { off: 0, len: 3 }).unwrap();
    assert_eq!(buf, [1.0, 2.0, 3.0]);
    assert_eq!(Comm::<Vec<f32>>::world_size(&c), 1);
}

#[test]
fn a_rank_that_never_calls_is_named_after_the_timeout() {
    let t0 = Instant::now();
    // A 3 s timeout: long enough that ranks 0 and 1, started together, both enter the
    // collective before either times out even on a loaded 2-core machine (at 1 s that race
    // was lost now and then).
    // Ranks 0 and 1 keep their communicators until both have failed: a rank that returns drops
    // its links, and a neighbour still inside its own wait would then see a closed connection
    // instead of the timeout (seen on a loaded 2-core CI machine).
    let both_failed = std::sync::Barrier::new(2);
    let out = with_world(3, 3.0, |r, c| {
        if r == 2 {
            // Arrives at rendezvous but never enters the collective; stays alive past the
            // others' timeout so they see a silent rank, not a closed connection.
            std::thread::sleep(Duration::from_secs(8));
            return None;
        }
        let mut buf = vec![1.0f32; 16];
        let e = c.all_reduce(&mut buf, Span { off: 0, len: 16 }, ReduceOp::Sum);
        // The communicator is poisoned afterwards.
        let again = c.barrier();
        both_failed.wait(); // (before any unwrap: a panic here would leave the other rank waiting)
        Some((e.unwrap_err(), again.unwrap_err()))
    });
    assert!(t0.elapsed() < Duration::from_secs(20), "took {:?}", t0.elapsed());
    for (r, res) in out.into_iter().enumerate().take(2) {
        let (e, again) = res.expect("ranks 0 and 1 return errors");
        match &e {
            CommError::Timeout { missing, op, .. } => {
                assert_eq!(missing.as_deref(), Some(&[2usize][..]), "rank {r}: {e}");
                assert_eq!(*op, "all_reduce");
            }
            other => panic!("rank {r}: expected a timeout, got {other}"),
        }
        assert!(e.to_string().contains("rank(s) [2] of 3 did not arrive"), "{e}");
        assert!(matches!(again, CommError::Poisoned { .. }), "rank {r}: {again}");
    }
}

#[test]
fn a_rank_that_exits_is_reported_promptly() {
    let t0 = Instant::now();
    let out = with_world(3, 60.0, |r, c| {
        if r == 1 {
            return None; // drops its communicator: the process "exited"
        }
        let mut buf = vec![1.0f32; 16];
        Some(c.all_reduce(&mut buf, Span { off: 0, len: 16 }, ReduceOp::Sum).unwrap_err())
    });
    // A closed connection is not waited out: that would take the 60 s timeout. It is reported
    // in well under a second; 20 s leaves a loaded 2-core machine ample room to start three
    // ranks and connect them, and still stays far from the timeout.
    assert!(t0.elapsed() < Duration::from_secs(20), "took {:?}", t0.elapsed());
    let e2 = out[2].as_ref().expect("rank 2 error");
    assert!(matches!(e2, CommError::PeerClosed { peer: 1, .. }), "{e2}");
    assert!(e2.to_string().contains("rank 1 closed its connection"), "{e2}");
}

#[test]
fn mismatched_collectives_are_detected() {
    let out = with_world(2, 5.0, |r, c| {
        let mut buf = vec![1.0f32; 4];
        let span = Span { off: 0, len: 4 };
        if r == 0 {
            c.all_reduce(&mut buf, span, ReduceOp::Sum).unwrap_err()
        } else {
            c.all_gather(&mut buf, span).unwrap_err()
        }
    });
    let any_desync = out.iter().any(|e| matches!(e, CommError::Desync { .. }));
    assert!(any_desync, "{out:?}");
    let text = out.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(" | ");
    assert!(text.contains("all_gather") && text.contains("all_reduce"), "{text}");
}

fn request(rank: usize, world: usize, port: u16, hash: &str, timeout_s: f64) -> RendezvousRequest {
    RendezvousRequest {
        rank,
        world_size: world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        timeout: Duration::from_secs_f64(timeout_s),
        config_hash: hash.into(),
        job_id: String::new(),
        data_port: 40000 + rank as u16,
        blob: if rank == 0 { b"nccl-unique-id".to_vec() } else { Vec::new() },
    }
}

/// Runs rendezvous for the given (rank, world, hash) on threads.
fn rendezvous_all(reqs: Vec<RendezvousRequest>) -> Vec<Result<vitscale::comm::Rendezvoused, RendezvousError>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = reqs.iter().map(|q| s.spawn(move || rendezvous(q))).collect();
        hs.into_iter().map(|h| h.join().expect("rendezvous thread panicked")).collect()
    })
}

#[test]
fn rendezvous_exchanges_addresses_and_blob() {
    let port = free_port();
    let out: Vec<_> = rendezvous_all((0..3).map(|r| request(r, 3, port, "abc", 5.0)).collect())
        .into_iter()
        .enumerate()
        .map(|(r, o)| o.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect();
    // Every rank's ring address as the requests gave them: loopback, data port 40000 + rank.
    let want_peers: Vec<SocketAddr> = (0..3).map(|r| SocketAddr::from(([127, 0, 0, 1], 40000 + r as u16))).collect();
    for (r, o) in out.iter().enumerate() {
        assert_eq!((o.rank, o.world_size), (r, 3));
        assert_eq!(o.blob, b"nccl-unique-id", "rank {r}: rank 0's blob");
        assert_eq!(o.peers, want_peers, "rank {r}");
    }
    // Rank 0 draws the session number; every other rank must have received that one.
    for (r, o) in out.iter().enumerate().skip(1) {
        assert_eq!(o.session, out[0].session, "rank {r} has another session than rank 0");
    }
    // It is drawn per rendezvous, so a connection left from an earlier run is told apart.
    let port = free_port();
    let again: Vec<u64> = rendezvous_all((0..2).map(|r| request(r, 2, port, "abc", 5.0)).collect())
        .into_iter()
        .map(|o| o.expect("second rendezvous").session)
        .collect();
    assert_eq!(again[0], again[1]);
    assert_ne!(again[0], out[0].session, "two rendezvous drew the same session number");
}

#[test]
fn rendezvous_names_ranks_that_never_arrive() {
    let port = free_port();
    let t0 = Instant::now();
    let out = rendezvous_all(vec![request(0, 4, port, "h", 1.0), request(2, 4, port, "h", 1.0)]);
    // Bounded by the 1 s timeout. Rank 2 would give up on its own only 15 s after that, so
    // 10 s tells the two apart and leaves a loaded machine 9 s of slack.
    assert!(t0.elapsed() < Duration::from_secs(10), "took {:?}", t0.elapsed());
    match &out[0] {
        Err(RendezvousError::Missing { missing, world: 4, .. }) => assert_eq!(missing, &vec![1, 3]),
        other => panic!("rank 0: {other:?}"),
    }
    // The rank that did arrive gets the same diagnosis from rank 0.
    let e = out[1].as_ref().unwrap_err().to_string();
    assert!(e.contains("rank(s) [1, 3] of 4 never arrived"), "{e}");
}

#[test]
fn rendezvous_without_rank_0_names_the_address() {
    let port = free_port();
    let out = rendezvous_all(vec![request(1, 2, port, "h", 0.5)]);
    let e = out[0].as_ref().unwrap_err();
    assert!(matches!(e, RendezvousError::Unreachable { rank: 1, .. }), "{e}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}

#[test]
fn config_hash_mismatch_names_rank_and_both_values() {
    let port = free_port();
    let out = rendezvous_all(vec![request(0, 2, port, "aaaa", 5.0), request(1, 2, port, "bbbb", 5.0)]);
    match &out[0] {
        Err(RendezvousError::ConfigMismatch { rank: 1, theirs, ours }) => assert_eq!((theirs.as_str(), ours.as_str()), ("bbbb", "aaaa")),
        other => panic!("rank 0: {other:?}"),
    }
    let e = out[1].as_ref().unwrap_err().to_string();
    assert!(e.contains("rank 1 has config hash bbbb, rank 0 has aaaa"), "{e}");
}

#[test]
fn world_size_mismatch_and_port_in_use() {
    let port = free_port();
    let out = rendezvous_all(vec![request(0, 2, port, "h", 5.0), request(1, 3, port, "h", 5.0)]);
    assert!(matches!(out[0], Err(RendezvousError::WorldSizeMismatch { rank: 1, theirs: 3, ours: 2 })), "{:?}", out[0]);
    assert!(out[1].as_ref().unwrap_err().to_string().contains("world sizes disagree"));

    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let out = rendezvous_all(vec![request(0, 2, port, "h", 1.0)]);
    let e = out[0].as_ref().unwrap_err();
    assert!(matches!(e, RendezvousError::PortInUse { .. }), "{e}");
    assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
}

/// What rank `me` of `members` must hold after an all-to-all of `len` elements (block `j`
/// from member `j`'s block `me`), computed from the inputs alone.
fn all_to_all_reference(members: &[usize], me: usize, len: usize) -> Vec<f32> {
    let c = len / members.len();
    members.iter().flat_map(|&r| data(r, len)[me * c..(me + 1) * c].to_vec()).collect()
}

#[test]
fn all_to_all_moves_block_j_to_rank_j_over_the_world_and_in_groups() {
    let len = 4 * 3 * 5; // divisible by every world and group size below
    for world in [2, 3, 4] {
        let out = with_world(world, 5.0, |r, c| {
            let mut buf = vec![-5.0f32; len + 9];
            buf[4..4 + len].copy_from_slice(&data(r, len));
            c.all_to_all(&mut buf, Span { off: 4, len }).expect("all_to_all");
            buf
        });
        let members: Vec<usize> = (0..world).collect();
        for (r, buf) in out.iter().enumerate() {
            assert_eq!(&buf[4..4 + len], &all_to_all_reference(&members, r, len)[..], "world {world} rank {r}");
            assert!(buf[..4].iter().chain(&buf[4 + len..]).all(|&v| v == -5.0), "world {world} rank {r}: outside the span changed");
        }
    }
    // groups of 2 of a world of 4 (sequence parallelism's layout): each group exchanges within
    // itself, on its own communicator, while the world's ring stays usable
    let out = with_world(4, 5.0, |r, c| {
        let mut g = c.split_groups(2).expect("split_groups");
        assert_eq!((g.rank(), g.world_size()), (r % 2, 2));
        let mut buf = data(r, len);
        g.all_to_all(&mut buf, Span { off: 0, len }).expect("group all_to_all");
        let mut sum = vec![r as f32 + 1.0; 3];
        g.all_reduce(&mut sum, Span { off: 0, len: 3 }, ReduceOp::Sum).expect("group all_reduce");
        let mut world_sum = vec![1.0f32; 5];
        c.all_reduce(&mut world_sum, Span { off: 0, len: 5 }, ReduceOp::Sum).expect("world all_reduce");
        (buf, sum[0], world_sum[0])
    });
    for (r, (buf, group_sum, world_sum)) in out.iter().enumerate() {
        let base = r / 2 * 2;
        assert_eq!(buf, &all_to_all_reference(&[base, base + 1], r - base, len), "rank {r}");
        assert_eq!(*group_sum, (base + 1 + base + 2) as f32, "rank {r}: the group's sum");
        assert_eq!(*world_sum, 4.0, "rank {r}: the world's sum");
    }
}

#[test]
fn bad_groups_and_uneven_all_to_alls_are_refused() {
    let out = with_world(2, 5.0, |_, c| {
        let groups = c.split_groups(3).err().map(|e| e.to_string());
        let mut buf = vec![0.0f32; 5];
        let uneven = c.all_to_all(&mut buf, Span { off: 0, len: 5 }).err().map(|e| e.to_string());
        (groups, uneven)
    });
    for (groups, uneven) in out {
        assert!(groups.as_deref().is_some_and(|e| e.contains("groups of 3") && e.contains("world of 2")), "{groups:?}");
        assert!(uneven.as_deref().is_some_and(|e| e.contains("all_to_all") && e.contains("not divisible")), "{uneven:?}");
    }
    let mut single = SingleComm::new();
    let mut buf = vec![1.0f32, 2.0];
    Comm::<Vec<f32>>::all_to_all(&mut single, &mut buf, Span { off: 0, len: 2 }).expect("one rank");
    assert_eq!(buf, vec![1.0, 2.0]);
}
