//! Collective communication between data-parallel ranks, on flat buffers.
//!
//! The engine reduces gradients at gradient-accumulation boundaries only, and ZeRO shards
//! parameters and optimizer state; both need the same five collectives, all on a window
//! (`Span`) of one flat buffer: `all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`,
//! `barrier`. Sequence parallelism (`model::seq_parallel`) adds `all_to_all`, run on a
//! communicator of its own over a group of consecutive ranks (`Comm::split_groups`).
//! [`Comm`] is generic over the buffer type (`Backend::Buf`), so one trait serves:
//!
//! - [`SingleComm`]: world size 1, every collective is a no-op (any buffer type);
//! - [`cpu::TcpComm`]: CPU ranks that are processes on one or several machines, a ring over
//!   TCP (reduce-scatter then all-gather), for `Vec<f32>` buffers;
//! - `backend::cuda::nccl::NcclComm` for GPU buffers, which enqueues on a communication
//!   stream ordered against the compute stream by events (it lives beside the CUDA host code,
//!   which it needs; this module needs nothing of the backends).
//!
//! Every collective has an asynchronous form: `start` returns a [`Work`] that `wait`
//! completes, so GPU communication can overlap the backward pass. Between `start` and
//! `wait` the caller must neither read nor write the span (NCCL reduces in place in device
//! memory; the TCP ring copies the span out at `start` and back at `wait`).
//!
//! Ranks find each other through `rendezvous` (rank 0 serves a small TCP service at
//! `MASTER_ADDR:MASTER_PORT`), with the process layout read by `env::DistEnv::detect`.
//! Every wait has a timeout ([`CommOptions`]) and fails with an error naming the rank(s)
//! that did not arrive.

pub mod cpu;
pub mod env;
pub mod rendezvous;
mod wire;

use std::time::Duration;

pub use crate::core::Span;
pub use cpu::{Arrivals, TcpComm};
pub use env::{DistEnv, EnvError, EnvSource};
pub use rendezvous::{RendezvousError, Rendezvoused};

/// How a reduction combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the world size (NCCL's `ncclAvg`).
    Avg,
}

/// One collective operation on a span of a flat buffer. Contracts (`W` ranks, span of
/// `len` elements, rank `r`):
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// Every rank ends with the reduction over ranks of the whole span; bitwise identical on
    /// every rank.
    AllReduce(ReduceOp),
    /// `len % W == 0`; rank `r` ends with the reduction of shard `r` (see [`shard`]) in place;
    /// the rest of the span is unspecified afterwards.
    ReduceScatter(ReduceOp),
    /// `len % W == 0`; rank `r`'s input is its shard `r`; every rank ends with every shard.
    AllGather,
    /// Every rank ends with `root`'s span.
    Broadcast { root: usize },
    /// `len % W == 0`; the span is W chunks of `len / W`: chunk `j` of rank `r`'s input ends
    /// as chunk `r` of rank `j`'s output (MPI's `Alltoall`). Values are moved, never summed,
    /// so the result is exact.
    AllToAll,
}

impl Collective {
    /// Name for errors and logs.
    pub fn name(self) -> &'static str {
        match self {
            Collective::AllReduce(_) => "all_reduce",
            Collective::ReduceScatter(_) => "reduce_scatter",
            Collective::AllGather => "all_gather",
            Collective::Broadcast { .. } => "broadcast",
            Collective::AllToAll => "all_to_all",
        }
    }
}

/// How an all-reduce's values travel: in f32 or rounded to bf16 (half the bytes; NCCL then
/// sums in bf16, the TCP ring rounds every partial sum to bf16 the same way), and the factors
/// applied to the span before and after the sum (DeepSpeed's gradient pre- and post-division).
/// The result is left in the buffer's own type.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Wire {
    pub bf16: bool,
    pub pre: f32,
    pub post: f32,
}

impl Wire {
    pub const PLAIN: Wire = Wire { bf16: false, pre: 1.0, post: 1.0 };

    pub fn is_plain(&self) -> bool {
        *self == Wire::PLAIN
    }

    /// Bytes per element on the wire.
    pub fn elem_bytes(&self) -> usize {
        if self.bf16 {
            2
        } else {
            4
        }
    }
}

/// Rank `rank`'s shard of an evenly divisible span: the ZeRO partition and the
/// reduce-scatter / all-gather layout. `span.len` must be a multiple of `world`.
pub fn shard(span: Span, world: usize, rank: usize) -> Span {
    let n = span.len / world.max(1);
    Span { off: span.off + rank * n, len: n }
}

/// An operation started by `Comm::start`, to be completed by `Comm::wait` on the same comm
/// with the same buffer. Dropping it without waiting leaves the span in an unspecified state.
#[must_use = "a started collective must be completed with Comm::wait"]
#[derive(Debug)]
pub struct Work {
    pub(crate) id: u64,
    pub(crate) op: Collective,
    pub(crate) span: Span,
}

impl Work {
    pub fn op(&self) -> Collective {
        self.op
    }
    pub fn span(&self) -> Span {
        self.span
    }
}

/// Timeouts of the distributed runtime.
#[derive(Clone, Debug, PartialEq)]
pub struct CommOptions {
    /// How long a collective waits for a peer before failing (default 300 s). A rank that
    /// never calls the collective is named in the error.
    pub timeout: Duration,
    /// How long rendezvous waits for every rank to arrive (default 300 s).
    pub rendezvous_timeout: Duration,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions { timeout: Duration::from_secs(300), rendezvous_timeout: Duration::from_secs(300) }
    }
}

/// Environment variable overriding [`CommOptions::timeout`], in seconds.
pub const ENV_COMM_TIMEOUT: &str = "VITSCALE_COMM_TIMEOUT";
/// Environment variable overriding [`CommOptions::rendezvous_timeout`], in seconds.
pub const ENV_RENDEZVOUS_TIMEOUT: &str = "VITSCALE_RENDEZVOUS_TIMEOUT";

impl CommOptions {
    /// Defaults, overridden by `VITSCALE_COMM_TIMEOUT` / `VITSCALE_RENDEZVOUS_TIMEOUT`
    /// (seconds, may be fractional). The variables travel with `vitscale launch` to every
    /// node, so one setting reaches every rank.
    pub fn from_env() -> Result<Self, EnvError> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// As `from_env`, reading variables through `get` (tests).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        Self::over(CommOptions::default(), get)
    }

    /// The run configuration's timeout (`train.comm_timeout_s`) for the rendezvous and the
    /// collectives, each overridden by its variable as in `from_env`.
    pub fn from_config_and_env(comm_timeout_s: f64) -> Result<Self, EnvError> {
        let t = Duration::from_secs_f64(comm_timeout_s);
        let base = CommOptions { timeout: t, rendezvous_timeout: t };
        Self::over(base, |k| std::env::var(k).ok())
    }

    /// `base` with whatever the variables read through `get` set.
    pub fn over(base: CommOptions, get: impl Fn(&str) -> Option<String>) -> Result<Self, EnvError> {
        let mut o = base;
        if let Some(t) = env::seconds_var(&get, ENV_COMM_TIMEOUT)? {
            o.timeout = t;
        }
        if let Some(t) = env::seconds_var(&get, ENV_RENDEZVOUS_TIMEOUT)? {
            o.rendezvous_timeout = t;
        }
        Ok(o)
    }
}

/// Errors of collectives. Each names this rank and, where known, the peer at fault.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    #[error(
        "rank {rank}: {op} #{seq} timed out after {waited:.1?} waiting for rank {waiting_on}: {}",
        missing_text(missing, *world)
    )]
    Timeout {
        rank: usize,
        world: usize,
        op: &'static str,
        seq: u64,
        waited: Duration,
        waiting_on: usize,
        /// Ranks that never entered this collective (empty when every rank arrived and the
        /// data stalled, or when rank 0 could not be asked).
        missing: Option<Vec<usize>>,
    },
    #[error("rank {rank}: rank {peer} closed its connection during {op} #{seq} (it exited or crashed)")]
    PeerClosed { rank: usize, peer: usize, op: &'static str, seq: u64 },
    #[error("rank {rank}: ranks called different collectives: this rank is in {ours}, rank {peer} sent {theirs}")]
    Desync { rank: usize, peer: usize, ours: String, theirs: String },
    #[error("rank {rank}: {what} (peer rank {peer}): {source}")]
    Io { rank: usize, peer: usize, what: &'static str, source: std::io::Error },
    #[error("rank {rank}: the communicator failed earlier and cannot be used: {cause}")]
    Poisoned { rank: usize, cause: String },
    #[error("{op}: span of {len} elements is not divisible by the world size {world}")]
    Uneven { op: &'static str, len: usize, world: usize },
    #[error("{op}: span {off}..{end} is outside the buffer of {buf_len} elements")]
    OutOfRange { op: &'static str, off: usize, end: usize, buf_len: usize },
    #[error("groups of {size} consecutive ranks do not tile a world of {world} ranks")]
    BadGroup { size: usize, world: usize },
    #[error("broadcast root {root} is not a rank of a world of {world}")]
    BadRoot { root: usize, world: usize },
    #[error("wait: work #{id} was not started on this communicator (or was already waited on)")]
    UnknownWork { id: u64 },
    #[error("{what}: not supported by this transport")]
    Unsupported { what: String },
    /// A device-side failure (NCCL, CUDA) on this rank.
    #[error("rank {rank}: {msg}")]
    Device { rank: usize, msg: String },
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    #[error(transparent)]
    Env(#[from] EnvError),
}

fn missing_text(missing: &Option<Vec<usize>>, world: usize) -> String {
    match missing {
        Some(m) if !m.is_empty() => format!("rank(s) {m:?} of {world} did not arrive"),
        Some(_) => "every rank arrived; the transfer stalled".to_string(),
        None => "which ranks arrived is unknown (rank 0 could not be asked, or the collective is a group's)".to_string(),
    }
}

pub type CResult<T> = Result<T, CommError>;

/// What a device transport measured of its collectives (`Comm::take_device_timing`).
#[derive(Clone, Debug, Default)]
pub struct DeviceTiming {
    /// Seconds the compute stream waited for collectives at the boundaries.
    pub exposed_s: f64,
    /// Seconds from each collective's start to its end on the communication stream, summed.
    pub total_s: f64,
    /// Each collective on the communication stream: (what, start, end) in seconds since the
    /// epoch the caller gave, on the host clock.
    pub spans: Vec<(String, f64, f64)>,
}

/// Collectives over flat buffers of type `Buf`. See the module doc for the asynchronous
/// contract and [`Collective`] for what each operation leaves in the span.
///
/// All ranks must issue the same collectives, with spans of the same length, in the same
/// order; a mismatch is detected and reported where the transport can (the TCP ring checks
/// every message header).
pub trait Comm<Buf>: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Short description for logs ("tcp-ring 4 ranks", "single").
    fn describe(&self) -> String;

    /// Starts `op` on `buf[span]`. The span must not be touched until `wait`.
    fn start(&mut self, op: Collective, buf: &mut Buf, span: Span) -> CResult<Work>;
    /// `start` of an all-reduce whose values travel as `wire` says. Transports that cannot
    /// change the wire refuse anything but [`Wire::PLAIN`].
    fn start_as(&mut self, op: Collective, buf: &mut Buf, span: Span, wire: Wire) -> CResult<Work> {
        if wire.is_plain() {
            return self.start(op, buf, span);
        }
        Err(CommError::Unsupported { what: format!("{} with {wire:?} on {}", op.name(), self.describe()) })
    }
    /// Names the next collective this rank starts ("gradient bucket 3 of 14"), for the error
    /// that reports it stalled. Transports that name collectives otherwise ignore it.
    fn label_next(&mut self, _label: &str) {}
    /// Completes `work`, leaving the result in `buf[work.span()]`.
    fn wait(&mut self, work: Work, buf: &mut Buf) -> CResult<()>;
    /// Whether `detach` works here: a transport whose collectives write the buffer on the
    /// device's own queues (NCCL). The TCP ring writes results on the host, in `wait`.
    fn can_detach(&self) -> bool {
        false
    }
    /// Completes `work` later: returns a fence that, once ordered (`Fence::order`), makes the
    /// compute queue wait for the collective, so compute that does not read the span can go
    /// on meanwhile (ZeRO's weight gather behind the next forward).
    fn detach(&mut self, work: Work) -> CResult<Box<dyn crate::core::Fence>> {
        Err(CommError::Unsupported { what: format!("detaching {} on {}", work.op.name(), self.describe()) })
    }
    /// Returns when every rank has called `barrier`.
    fn barrier(&mut self) -> CResult<()>;
    /// Sums small host-side values over ranks (losses, accuracy counts, timings), in f64.
    fn all_reduce_host(&mut self, vals: &mut [f64]) -> CResult<()>;
    /// Whether a started collective has completed, and since when as far as this rank saw
    /// (None: still running, or the transport cannot tell without waiting). Never blocks.
    fn poll(&mut self, _work: &Work) -> CResult<Option<std::time::Instant>> {
        Ok(None)
    }
    /// Called before and after the boundary's waits for a step's collectives, so a transport
    /// that times on the device can measure how long compute waited (the exposed part).
    fn begin_waits(&mut self) -> CResult<()> {
        Ok(())
    }
    fn end_waits(&mut self) -> CResult<()> {
        Ok(())
    }
    /// The collectives waited on since the last call, measured on the device (their spans
    /// placed on the host clock as seconds since `epoch`); None for transports the host's clock
    /// times (the TCP ring). Synchronizes.
    fn take_device_timing(&mut self, _epoch: std::time::Instant) -> CResult<Option<DeviceTiming>> {
        Ok(None)
    }

    // ---- blocking forms --------------------------------------------------------------
    fn all_reduce(&mut self, buf: &mut Buf, span: Span, op: ReduceOp) -> CResult<()> {
        let w = self.start(Collective::AllReduce(op), buf, span)?;
        self.wait(w, buf)
    }
    /// `all_reduce` with [`ReduceOp::Avg`]: the data-parallel gradient average.
    fn all_reduce_avg(&mut self, buf: &mut Buf, span: Span) -> CResult<()> {
        self.all_reduce(buf, span, ReduceOp::Avg)
    }
    fn reduce_scatter(&mut self, buf: &mut Buf, span: Span, op: ReduceOp) -> CResult<()> {
        let w = self.start(Collective::ReduceScatter(op), buf, span)?;
        self.wait(w, buf)
    }
    fn all_gather(&mut self, buf: &mut Buf, span: Span) -> CResult<()> {
        let w = self.start(Collective::AllGather, buf, span)?;
        self.wait(w, buf)
    }
    fn broadcast(&mut self, buf: &mut Buf, span: Span, root: usize) -> CResult<()> {
        let w = self.start(Collective::Broadcast { root }, buf, span)?;
        self.wait(w, buf)
    }
    fn all_to_all(&mut self, buf: &mut Buf, span: Span) -> CResult<()> {
        let w = self.start(Collective::AllToAll, buf, span)?;
        self.wait(w, buf)
    }

    /// A new communicator over this rank's group when the world is cut into groups of `size`
    /// consecutive ranks (rank `r` is rank `r % size` of group `r / size`): sequence
    /// parallelism's group. Every rank of the world must call it, in the same order with
    /// respect to its other collectives. Its collectives are independent of this
    /// communicator's (their own connections or streams), so both can be in use at once.
    fn split_groups(&mut self, size: usize) -> CResult<Box<dyn Comm<Buf>>> {
        Err(CommError::Unsupported { what: format!("groups of {size} ranks on {}", self.describe()) })
    }
}

/// Checks a group size for `split_groups` over `world` ranks.
pub(crate) fn check_group(size: usize, world: usize) -> CResult<()> {
    if size == 0 || !world.is_multiple_of(size) {
        return Err(CommError::BadGroup { size, world });
    }
    Ok(())
}

/// Checks what every implementation must reject the same way.
pub(crate) fn check_args(op: Collective, span: Span, buf_len: usize, world: usize) -> CResult<()> {
    let end = span.off.saturating_add(span.len);
    if end > buf_len {
        return Err(CommError::OutOfRange { op: op.name(), off: span.off, end, buf_len });
    }
    match op {
        Collective::ReduceScatter(_) | Collective::AllGather | Collective::AllToAll if !span.len.is_multiple_of(world) => {
            Err(CommError::Uneven { op: op.name(), len: span.len, world })
        }
        Collective::Broadcast { root } if root >= world => Err(CommError::BadRoot { root, world }),
        _ => Ok(()),
    }
}

/// World size 1: every collective leaves the buffer as it is (a sum or average over one rank
/// is the value itself, and the only shard is the whole span).
#[derive(Debug, Default)]
pub struct SingleComm {
    next_id: u64,
}

impl SingleComm {
    pub fn new() -> Self {
        SingleComm::default()
    }
}

impl<Buf> Comm<Buf> for SingleComm {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn describe(&self) -> String {
        "single process".to_string()
    }
    fn start(&mut self, op: Collective, _buf: &mut Buf, span: Span) -> CResult<Work> {
        // The buffer's length is the backend's to know; the span is checked where a transport
        // touches memory.
        check_args(op, span, usize::MAX, 1)?;
        self.next_id += 1;
        Ok(Work { id: self.next_id, op, span })
    }
    fn wait(&mut self, _work: Work, _buf: &mut Buf) -> CResult<()> {
        Ok(())
    }
    fn barrier(&mut self) -> CResult<()> {
        Ok(())
    }
    fn all_reduce_host(&mut self, _vals: &mut [f64]) -> CResult<()> {
        Ok(())
    }
    fn split_groups(&mut self, size: usize) -> CResult<Box<dyn Comm<Buf>>> {
        check_group(size, 1)?;
        Ok(Box::new(SingleComm::new()))
    }
}

/// The communicator for CPU ranks described by `env`: [`SingleComm`] for one process, else
/// rendezvous at `MASTER_ADDR:MASTER_PORT` and a [`TcpComm`] ring. `config_hash` identifies
/// the resolved run configuration; ranks that disagree fail with an error naming both values.
pub fn init_cpu(env: &DistEnv, opts: &CommOptions, config_hash: &str) -> CResult<Box<dyn Comm<Vec<f32>>>> {
    if env.world_size == 1 {
        return Ok(Box::new(SingleComm::new()));
    }
    Ok(Box::new(TcpComm::connect(env, opts, config_hash)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_variable_overrides_the_configured_timeout() {
        let base = CommOptions { timeout: Duration::from_secs_f64(2.5), ..CommOptions::default() };
        let o = CommOptions::over(base.clone(), |_| None).expect("no variables");
        assert_eq!(o.timeout, Duration::from_secs_f64(2.5));
        let o = CommOptions::over(base.clone(), |k| (k == ENV_COMM_TIMEOUT).then(|| "7".to_string())).expect("valid");
        assert_eq!(o.timeout, Duration::from_secs(7));
        assert!(CommOptions::over(base, |k| (k == ENV_COMM_TIMEOUT).then(|| "soon".to_string())).is_err());
    }
}
