//! Do the ranks hold the same training state?
//!
//! Data-parallel ranks start from rank 0's broadcast state and apply the same all-reduced
//! gradients, so after every step their weights and optimizer state must be bitwise equal.
//! Everything written once for the whole job relies on that: rank 0 alone writes checkpoints
//! and `--save-weights`, and a comparison of N ranks with one process reads rank 0's file.
//! A rank that drifted (a bug, a nondeterministic kernel, a flipped bit) would go unnoticed.
//!
//! [`check`] hashes this rank's state (the exact f32 bits, see [`hash_f32`]) and gathers every
//! rank's hashes on every rank through `Comm::all_reduce_host`: each rank writes its 64-bit
//! hashes as 16-bit pieces into its own slots of a zeroed vector and the f64 sum fills in
//! every slot. The pieces are small integers and every slot has one nonzero term, so the sum
//! is exact whatever the summation order. Every rank then sees the same table and returns the
//! same verdict, so no rank goes on to write while another stops.

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::comm::Comm;

/// Elements hashed as one independent piece: the pieces are hashed in parallel and their
/// digests hashed in order, so the result does not depend on the thread count.
const PIECE: usize = 1 << 18;

/// Hashes written per rank: the weights and the optimizer state.
const PER_RANK: usize = 2;
/// 16-bit pieces per 64-bit hash (each exact in an f64 sum).
const PIECES: usize = 4;

/// A 64-bit hash of the exact bits of `vals` (so −0.0 ≠ 0.0, NaN payloads count, one ulp
/// changes it) and of their number: the first 8 bytes, little-endian, of SHA-256 over the
/// length and the SHA-256 digests of consecutive 1 MiB pieces of the native-endian bytes.
pub fn hash_f32(vals: &[f32]) -> u64 {
    let digests: Vec<[u8; 32]> = vals.par_chunks(PIECE).map(|c| Sha256::digest(bytemuck::cast_slice::<f32, u8>(c)).into()).collect();
    let mut h = Sha256::new();
    h.update((vals.len() as u64).to_le_bytes());
    for d in &digests {
        h.update(d);
    }
    let d = h.finalize();
    u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// One rank's state, hashed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StateHash {
    pub weights: u64,
    pub optimizer: u64,
}

impl StateHash {
    pub fn of(weights: &[f32], optimizer: &[f32]) -> Self {
        StateHash { weights: hash_f32(weights), optimizer: hash_f32(optimizer) }
    }

    /// The weights hash as 16 hex digits (`TrainSummary::weights_hash`).
    pub fn weights_hex(&self) -> String {
        format!("{:016x}", self.weights)
    }
}

/// Why the ranks could not confirm they hold the same state.
#[derive(Debug, thiserror::Error)]
pub enum AgreeError {
    #[error(transparent)]
    Comm(#[from] crate::comm::CommError),
    /// A rank sent something that is not a state hash.
    #[error("{0}")]
    Malformed(String),
    /// The ranks' weights or optimizer state differ.
    #[error(transparent)]
    Diverged(#[from] Divergence),
}

/// Ranks whose state differs from rank 0's after `step`. Every rank gets the same value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct Divergence {
    pub step: u64,
    pub world: usize,
    /// Every rank's hashes, by rank.
    pub hashes: Vec<StateHash>,
    /// Ranks whose weights differ from rank 0's.
    pub weights: Vec<usize>,
    /// Ranks whose optimizer state differs from rank 0's.
    pub optimizer: Vec<usize>,
}

impl Divergence {
    /// Every rank that differs from rank 0 in anything, ascending.
    pub fn ranks(&self) -> Vec<usize> {
        let mut r: Vec<usize> = self.weights.iter().chain(&self.optimizer).copied().collect();
        r.sort_unstable();
        r.dedup();
        r
    }

    fn describe(&self) -> String {
        // A long list of hashes helps nobody: rank 0's and the first few others' suffice.
        let listed = |ranks: &[usize], get: fn(&StateHash) -> u64| -> String {
            let mut parts = vec![format!("rank 0 {:016x}", get(&self.hashes[0]))];
            parts.extend(ranks.iter().take(4).map(|&r| format!("rank {r} {:016x}", get(&self.hashes[r]))));
            if ranks.len() > 4 {
                parts.push(format!("{} more", ranks.len() - 4));
            }
            parts.join(", ")
        };
        let mut what = Vec::new();
        if !self.weights.is_empty() {
            what.push(format!("rank(s) {} hold other weights than rank 0 (hashes: {})", rank_list(&self.weights), listed(&self.weights, |h| h.weights)));
        }
        if !self.optimizer.is_empty() {
            what.push(format!(
                "rank(s) {} hold another optimizer state than rank 0 (hashes: {})",
                rank_list(&self.optimizer),
                listed(&self.optimizer, |h| h.optimizer)
            ));
        }
        format!(
            "ranks diverged after step {} (world of {}): {}. Data-parallel ranks must hold bitwise the same state after every \
             step, so this is a bug in vitscale or a nondeterministic device; please report it with this message. Nothing of \
             this step was saved (rank 0 writes checkpoints and --save-weights only when every rank agrees)",
            self.step,
            self.world,
            what.join("; ")
        )
    }
}

fn rank_list(ranks: &[usize]) -> String {
    ranks.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")
}

/// Every rank's hashes, gathered on every rank (one `all_reduce_host` of 8 × world values).
pub fn gather<Buf>(comm: &mut dyn Comm<Buf>, mine: StateHash) -> Result<Vec<StateHash>, AgreeError> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let stride = PER_RANK * PIECES;
    let mut slots = vec![0.0f64; world * stride];
    for (k, h) in [mine.weights, mine.optimizer].into_iter().enumerate() {
        for j in 0..PIECES {
            slots[rank * stride + k * PIECES + j] = ((h >> (16 * j)) & 0xffff) as f64;
        }
    }
    comm.all_reduce_host(&mut slots)?;
    let mut pieces = Vec::with_capacity(slots.len());
    for (i, &v) in slots.iter().enumerate() {
        // Only a rank writing outside its own slots (two ranks with one id) could break this.
        if !(0.0..65536.0).contains(&v) || v.fract() != 0.0 {
            return Err(AgreeError::Malformed(format!(
                "rank {rank}: the gathered state hashes are corrupt (rank {}'s slot {} sums to {v}); two processes may share a rank",
                i / stride,
                i % stride
            )));
        }
        pieces.push(v as u64);
    }
    let join = |p: &[u64]| p.iter().enumerate().fold(0u64, |acc, (j, &x)| acc | (x << (16 * j)));
    Ok(pieces.chunks_exact(stride).map(|c| StateHash { weights: join(&c[..PIECES]), optimizer: join(&c[PIECES..]) }).collect())
}

/// Hashes this rank's state after `step` and compares it with every other rank's. Every rank
/// must call it at the same point. Returns this rank's hashes when all ranks agree, else
/// [`AgreeError::Diverged`] on every rank, naming the ranks that differ from rank 0.
pub fn check<Buf>(comm: &mut dyn Comm<Buf>, step: u64, weights: &[f32], optimizer: &[f32]) -> Result<StateHash, AgreeError> {
    let mine = StateHash::of(weights, optimizer);
    let all = gather(comm, mine)?;
    let differ = |get: fn(&StateHash) -> u64| -> Vec<usize> { (1..all.len()).filter(|&r| get(&all[r]) != get(&all[0])).collect() };
    let (w, o) = (differ(|h| h.weights), differ(|h| h.optimizer));
    if w.is_empty() && o.is_empty() {
        return Ok(mine);
    }
    Err(AgreeError::Diverged(Divergence { step, world: all.len(), hashes: all, weights: w, optimizer: o }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::{CommOptions, DistEnv, SingleComm, TcpComm};
    use std::time::Duration;

    /// Runs `f(rank, comm)` on `world` threads joined in one TcpComm ring over loopback.
    fn with_world<T: Send>(world: usize, f: impl Fn(usize, &mut TcpComm) -> T + Sync) -> Vec<T> {
        let port = crate::launch::free_port().expect("loopback port");
        let opts = CommOptions { timeout: Duration::from_secs(10), rendezvous_timeout: Duration::from_secs(10) };
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let (f, opts) = (&f, &opts);
                    s.spawn(move || {
                        let env = DistEnv::loopback(rank, world, port);
                        let mut c = TcpComm::connect(&env, opts, "agree").expect("connect");
                        f(rank, &mut c)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
        })
    }

    /// Weights and optimizer state that look trained: more than one hash piece, every value
    /// different.
    fn state() -> (Vec<f32>, Vec<f32>) {
        let w: Vec<f32> = (0..PIECE + 1000).map(|i| ((i as f32) * 0.618).sin() * 0.02).collect();
        let o: Vec<f32> = w.iter().map(|x| x * x).collect();
        (w, o)
    }

    fn one_ulp_up(v: &mut [f32], i: usize) {
        v[i] = f32::from_bits(v[i].to_bits() + 1);
    }

    /// Each rank's verdict: Ok(hash) or the diverged ranks (weights, optimizer) and message.
    type Verdict = Result<StateHash, (Vec<usize>, Vec<usize>, String)>;

    fn verdicts(world: usize, bad_weights: &[usize], bad_optimizer: &[usize]) -> Vec<Verdict> {
        with_world(world, |rank, c| {
            let (mut w, mut o) = state();
            if bad_weights.contains(&rank) {
                one_ulp_up(&mut w, PIECE + 17);
            }
            if bad_optimizer.contains(&rank) {
                one_ulp_up(&mut o, 3);
            }
            match check(c, 4, &w, &o) {
                Ok(h) => Ok(h),
                Err(AgreeError::Diverged(d)) => Err((d.weights.clone(), d.optimizer.clone(), d.to_string())),
                Err(e) => panic!("rank {rank}: {e}"),
            }
        })
    }

    #[test]
    fn the_hash_sees_every_bit_and_the_length() {
        let (w, _) = state();
        let h = hash_f32(&w);
        assert_eq!(h, hash_f32(&w.clone()));
        let mut u = w.clone();
        one_ulp_up(&mut u, 0);
        assert_ne!(hash_f32(&u), h);
        assert_ne!(hash_f32(&[0.0]), hash_f32(&[-0.0]));
        assert_ne!(hash_f32(&w[..w.len() - 1]), h);
        assert_ne!(hash_f32(&[]), hash_f32(&[0.0]));
    }

    #[test]
    fn ranks_with_identical_state_agree() {
        let (w, o) = state();
        let want = StateHash::of(&w, &o);
        for v in verdicts(4, &[], &[]) {
            assert_eq!(v, Ok(want));
        }
        // One rank compares with itself.
        assert_eq!(check(&mut SingleComm::new() as &mut dyn Comm<Vec<f32>>, 4, &w, &o).ok(), Some(want));
    }

    // mutation check: with `check` always returning Ok(mine), the two tests below fail.
    #[test]
    fn a_rank_one_ulp_off_is_named_on_every_rank() {
        let out = verdicts(2, &[1], &[]);
        for (rank, v) in out.iter().enumerate() {
            let (w, o, msg) = v.clone().expect_err(&format!("rank {rank} did not see rank 1 diverge"));
            assert_eq!((w, o), (vec![1], vec![]), "rank {rank}: {msg}");
            assert!(msg.contains("ranks diverged after step 4 (world of 2): rank(s) 1 hold other weights than rank 0 (hashes: rank 0 "), "{msg}");
            assert!(!msg.contains("optimizer") && msg.contains("bug") && msg.contains("report it"), "{msg}");
        }
        // Every rank reports the same thing.
        assert!(out.iter().all(|v| v == &out[0]));
    }

    #[test]
    fn ranks_1_and_3_of_4_one_ulp_off_are_named_and_only_they() {
        let out = verdicts(4, &[1, 3], &[3]);
        for (rank, v) in out.iter().enumerate() {
            let (w, o, msg) = v.clone().expect_err(&format!("rank {rank} did not see ranks 1 and 3 diverge"));
            assert_eq!((w, o), (vec![1, 3], vec![3]), "rank {rank}: {msg}");
            assert!(msg.contains("rank(s) 1, 3 hold other weights") && msg.contains("rank(s) 3 hold another optimizer state"), "{msg}");
            assert!(!msg.contains("rank 2 "), "rank 2 agrees with rank 0: {msg}");
        }
        assert!(out.iter().all(|v| v == &out[0]));
    }
}
