//! The CPU transport: ranks are processes (on one or several machines) joined in a ring of
//! TCP connections; rank `r` sends to `r + 1` and receives from `r − 1`.
//!
//! `split_groups` opens a second ring of the same kind over each group of consecutive ranks
//! (sequence parallelism's group), with its own connections and worker, so the group's
//! collectives run while the world's (gradient buckets) are in flight. Its errors name world
//! ranks. All-to-all goes around the ring too: each block travels forward to its
//! destination, W − 1 steps (for the small groups it serves, the extra hops are cheap).
//!
//! All-reduce is the bandwidth-optimal ring: reduce-scatter (W − 1 steps, each rank ends
//! owning the full sum of one chunk) then all-gather (W − 1 steps). Each chunk is summed in
//! a fixed order that depends only on the world size, so results are reproducible run to run,
//! and the all-gather copies the owner's bytes, so every rank holds bitwise the same result.
//!
//! A background worker thread runs the collectives in the order they were started (that is
//! the asynchronous form: `start` copies the span out and queues it, `wait` copies the result
//! back), and a sender thread writes outgoing frames while the worker reads incoming ones, so
//! neighbours never block each other on full socket buffers.
//!
//! Every read waits at most `CommOptions::timeout` for progress; on expiry the rank asks rank 0
//! (through the rendezvous connection) which ranks have not entered the collective, and fails
//! with an error naming them. After any error the communicator is poisoned: collectives can no
//! longer be matched across ranks, so every later call fails too.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::rendezvous::{self, ControlLink, RendezvousRequest, Rendezvoused};
use super::wire::{FrameHeader, HEADER_BYTES};
use super::{check_args, check_group, CResult, Collective, Comm, CommError, CommOptions, DistEnv, ReduceOp, SingleComm, Span, Wire, Work};

/// Largest piece a broadcast forwards at once, in elements, so the ring pipelines it.
const BROADCAST_PIECE: usize = 1 << 20;

/// Op codes in frame headers.
const OP_ALL_REDUCE: u8 = 1;
const OP_REDUCE_SCATTER: u8 = 2;
const OP_ALL_GATHER: u8 = 3;
const OP_BROADCAST: u8 = 4;
const OP_BARRIER: u8 = 5;
const OP_HOST: u8 = 6;
const OP_ALL_TO_ALL: u8 = 7;

fn op_name(code: u8) -> &'static str {
    match code {
        OP_ALL_REDUCE => "all_reduce",
        OP_REDUCE_SCATTER => "reduce_scatter",
        OP_ALL_GATHER => "all_gather",
        OP_BROADCAST => "broadcast",
        OP_BARRIER => "barrier",
        OP_HOST => "all_reduce_host",
        OP_ALL_TO_ALL => "all_to_all",
        _ => "unknown",
    }
}

/// Element types the ring moves and sums.
trait Elem: bytemuck::Pod + std::ops::AddAssign + Send + 'static {
    fn div(self, n: usize) -> Self;
}
impl Elem for f32 {
    fn div(self, n: usize) -> Self {
        self / n as f32
    }
}
impl Elem for f64 {
    fn div(self, n: usize) -> Self {
        self / n as f64
    }
}
/// bf16 on the wire: each addition is done in f32 and rounded back, as NCCL's bf16 sum does.
impl Elem for half::bf16 {
    fn div(self, n: usize) -> Self {
        half::bf16::from_f32(self.to_f32() / n as f32)
    }
}

enum Payload {
    F32(Vec<f32>),
    F64(Vec<f64>),
}

enum JobOp {
    Coll(Collective, Wire),
    Barrier,
    Host,
    /// The device communicator entered its collective `seq` (reported to rank 0).
    DeviceArrive(u64),
    /// The last device collective each rank entered (asked of rank 0).
    DeviceLast(u64),
    /// This process is alive (reported to rank 0).
    Alive,
}

struct Job {
    op: JobOp,
    data: Payload,
    reply: mpsc::Sender<CResult<Payload>>,
}

/// What a world ring keeps of the rendezvous to open group rings later (`split_groups`).
#[derive(Clone, Debug)]
struct Net {
    /// Every rank's ring address (its IP is where the rank's group listener is found too).
    peers: Vec<SocketAddr>,
    session: u64,
    /// Where the world ring's listener listens (loopback for one node): the group's listens there too.
    bind_ip: IpAddr,
    opts: CommOptions,
}

/// A ring of TCP connections between CPU ranks. See the module doc.
pub struct TcpComm {
    rank: usize,
    world: usize,
    /// The world ring's rendezvous (None on a group's ring).
    net: Option<Net>,
    jobs: Option<mpsc::Sender<Job>>,
    pending: HashMap<u64, mpsc::Receiver<CResult<Payload>>>,
    /// Results `poll` found before their `wait`, with when it found them.
    arrived: HashMap<u64, (CResult<Payload>, Instant)>,
    next_id: u64,
    /// Why the communicator is unusable, once it is.
    failed: Option<String>,
    /// Payload vectors of finished collectives, reused by the next ones (`payload`).
    spare: Vec<Vec<f32>>,
    _worker: Option<JoinHandle<()>>,
}

/// Payload vectors `TcpComm` keeps for reuse: a step's gradient buckets in flight at once.
const SPARE_PAYLOADS: usize = 4;

impl std::fmt::Debug for TcpComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TcpComm(rank {} of {})", self.rank, self.world)
    }
}

impl TcpComm {
    /// Rendezvous as `env` describes, then connect the ring.
    pub fn connect(env: &DistEnv, opts: &CommOptions, config_hash: &str) -> CResult<Self> {
        Self::connect_sharing(env, opts, config_hash, Vec::new()).map(|(c, _)| c)
    }

    /// As `connect`, also handing every rank rank 0's `blob` (ignored on other ranks). A GPU
    /// communicator uses this to spread the NCCL unique id, and keeps the ring for host-side
    /// values (`all_reduce_host`).
    pub fn connect_sharing(env: &DistEnv, opts: &CommOptions, config_hash: &str, blob: Vec<u8>) -> CResult<(Self, Vec<u8>)> {
        let listener = bind_listener(env.rank, &env.master_addr)?;
        let data_port = listener.local_addr().map_err(|e| io_err(env.rank, env.rank, "reading the ring listener address", e))?.port();
        let rv = rendezvous::rendezvous(&RendezvousRequest {
            rank: env.rank,
            world_size: env.world_size,
            master_addr: env.master_addr.clone(),
            master_port: env.master_port,
            timeout: opts.rendezvous_timeout,
            config_hash: config_hash.to_string(),
            job_id: super::env::job_id(),
            data_port,
            blob,
        })?;
        let blob = rv.blob.clone();
        Ok((Self::from_rendezvous(rv, listener, opts)?, blob))
    }

    /// Connects the ring after rendezvous; `listener` is the one whose port went to
    /// rendezvous as `data_port`.
    pub fn from_rendezvous(rv: Rendezvoused, listener: TcpListener, opts: &CommOptions) -> CResult<Self> {
        let (rank, world) = (rv.rank, rv.world_size);
        let bind_ip = listener.local_addr().map_err(|e| io_err(rank, rank, "reading the ring listener address", e))?.ip();
        let net = Net { peers: rv.peers.clone(), session: rv.session, bind_ip, opts: opts.clone() };
        if world == 1 {
            return Ok(TcpComm { rank, world, net: Some(net), jobs: None, pending: HashMap::new(), arrived: HashMap::new(), next_id: 0, failed: None, spare: Vec::new(), _worker: None });
        }
        let next = (rank + 1) % world;
        let prev = (rank + world - 1) % world;
        let deadline = Instant::now() + opts.rendezvous_timeout;
        let to_next = connect_next(rank, next, rv.peers[next], rv.session, deadline)?;
        let from_prev = accept_prev(rank, prev, &listener, rv.session, deadline)?;
        drop(listener);
        let (jobs, worker) = start_ring(rank, world, (0..world).collect(), (to_next, from_prev), Some(rv.control), opts.timeout)?;
        Ok(TcpComm { rank, world, net: Some(net), jobs: Some(jobs), pending: HashMap::new(), arrived: HashMap::new(), next_id: 0, failed: None, spare: Vec::new(), _worker: Some(worker) })
    }


    /// The ring of this rank's group of `size` consecutive ranks (see `Comm::split_groups`):
    /// every rank binds a listener, the world ring tells every rank every port, and each rank
    /// connects to the next rank of its group.
    pub(crate) fn group_ring(&mut self, size: usize) -> CResult<TcpComm> {
        let net = self.net.clone().ok_or_else(|| CommError::Unsupported { what: format!("groups of a group ({})", self.describe()) })?;
        let (rank, world) = (self.rank, self.world);
        let listener = TcpListener::bind(SocketAddr::new(net.bind_ip, 0)).map_err(|e| io_err(rank, rank, "binding the group listener", e))?;
        let port = listener.local_addr().map_err(|e| io_err(rank, rank, "reading the group listener address", e))?.port();
        let mut ports = vec![0.0f64; world];
        ports[rank] = f64::from(port);
        self.all_reduce_host(&mut ports)?;
        let (base, local) = (rank / size * size, rank % size);
        let next = base + (local + 1) % size;
        let prev = base + (local + size - 1) % size;
        // another session number: a group connection is never taken for a world ring's
        let session = net.session ^ (0x5350_0000_0000_0000 | size as u64);
        let deadline = Instant::now() + net.opts.rendezvous_timeout;
        let to_next = connect_next(rank, next, SocketAddr::new(net.peers[next].ip(), ports[next] as u16), session, deadline)?;
        let from_prev = accept_prev(rank, prev, &listener, session, deadline)?;
        drop(listener);
        let (jobs, worker) = start_ring(local, size, (base..base + size).collect(), (to_next, from_prev), None, net.opts.timeout)?;
        Ok(TcpComm { rank: local, world: size, net: None, jobs: Some(jobs), pending: HashMap::new(), arrived: HashMap::new(), next_id: 0, failed: None, spare: Vec::new(), _worker: Some(worker) })
    }

    fn submit(&mut self, op: JobOp, data: Payload) -> CResult<u64> {
        if let Some(cause) = &self.failed {
            return Err(CommError::Poisoned { rank: self.rank, cause: cause.clone() });
        }
        let (tx, rx) = mpsc::channel();
        self.next_id += 1;
        match &self.jobs {
            Some(jobs) => {
                if jobs.send(Job { op, data, reply: tx }).is_err() {
                    return Err(self.poison("the ring thread ended".into()));
                }
            }
            // One rank: every collective is the identity.
            None => {
                let _ = tx.send(Ok(data));
            }
        }
        self.pending.insert(self.next_id, rx);
        Ok(self.next_id)
    }

    fn finish(&mut self, id: u64) -> CResult<Payload> {
        let got = match self.arrived.remove(&id) {
            Some((r, _)) => Ok(r),
            None => self.pending.remove(&id).ok_or(CommError::UnknownWork { id })?.recv(),
        };
        match got {
            Ok(Ok(p)) => Ok(p),
            Ok(Err(e)) => {
                self.failed.get_or_insert_with(|| e.to_string());
                Err(e)
            }
            Err(_) => Err(self.poison("the ring thread ended".into())),
        }
    }

    /// A copy of `src` in a vector a finished collective left behind when one is large
    /// enough (the smallest such), else a fresh one. A fresh vector of 32 MiB or more is,
    /// with glibc, always a new mapping whose pages fault in on the copy: reusing
    /// the vectors keeps a large bucket's collective at the cost of its bytes moved.
    fn payload(&mut self, src: &[f32]) -> Vec<f32> {
        let fit = self.spare.iter().enumerate().filter(|(_, v)| v.capacity() >= src.len()).min_by_key(|(_, v)| v.capacity()).map(|(i, _)| i);
        let mut v = fit.map(|i| self.spare.swap_remove(i)).unwrap_or_default();
        v.clear();
        v.extend_from_slice(src);
        v
    }

    /// Keeps a finished collective's payload for `payload`, the largest `SPARE_PAYLOADS`.
    fn recycle(&mut self, v: Vec<f32>) {
        self.spare.push(v);
        if self.spare.len() > SPARE_PAYLOADS {
            let smallest = self.spare.iter().enumerate().min_by_key(|(_, v)| v.capacity()).map_or(0, |(i, _)| i);
            self.spare.swap_remove(smallest);
        }
    }

    fn poison(&mut self, cause: String) -> CommError {
        let cause = self.failed.get_or_insert(cause).clone();
        CommError::Poisoned { rank: self.rank, cause }
    }
}

/// Starts the sender and worker threads of a ring in which this process is rank `rank` of
/// `world`; `ids` are the world ranks of the ring's members (what errors name); `control` the
/// link to rank 0's arrival tracker (a world ring's alone).
fn start_ring(
    rank: usize,
    world: usize,
    ids: Vec<usize>,
    (to_next, from_prev): (TcpStream, TcpStream),
    control: Option<ControlLink>,
    timeout: Duration,
) -> CResult<(mpsc::Sender<Job>, JoinHandle<()>)> {
    let next = (rank + 1) % world;
    let prev = (rank + world - 1) % world;
    let (me, id_next, id_prev) = (ids[rank], ids[next], ids[prev]);
    from_prev.set_read_timeout(Some(timeout)).map_err(|e| io_err(me, id_prev, "setting the read timeout", e))?;
    to_next.set_write_timeout(Some(timeout)).map_err(|e| io_err(me, id_next, "setting the write timeout", e))?;
    let (send_tx, send_rx) = mpsc::channel::<Outgoing>();
    let send_err: Arc<Mutex<Option<io::Error>>> = Arc::new(Mutex::new(None));
    let se = send_err.clone();
    let mut out = to_next;
    std::thread::Builder::new()
        .name(format!("vitscale-ring-send-{me}"))
        .spawn(move || sender(&mut out, send_rx, se))
        .map_err(|e| io_err(me, id_next, "starting the sender thread", e))?;
    let ring = Ring { rank, world, next, prev, ids, from_prev, send: send_tx, send_err, control, seq: 0, timeout, failed: None };
    let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
    let worker = std::thread::Builder::new()
        .name(format!("vitscale-ring-{me}"))
        .spawn(move || ring.run(jobs_rx))
        .map_err(|e| io_err(me, me, "starting the ring thread", e))?;
    Ok((jobs_tx, worker))
}

/// The arrivals of a device communicator's collectives, reported through this ring's control
/// link to rank 0, so that a stalled collective can name the ranks that never entered it.
/// Cloneable into a watchdog thread; every call is best effort.
#[derive(Clone)]
pub struct Arrivals {
    jobs: Option<mpsc::Sender<Job>>,
}

impl Arrivals {
    /// This rank entered device collective `seq` (numbered from 1, the same on every rank).
    pub fn arrive(&self, seq: u64) {
        if let Some(j) = &self.jobs {
            let (tx, _rx) = mpsc::channel();
            let _ = j.send(Job { op: JobOp::DeviceArrive(seq), data: Payload::F64(Vec::new()), reply: tx });
        }
    }

    /// Tells rank 0 this process is alive (call it from a thread that runs while the rank
    /// waits on its device: a stopped process goes silent).
    pub fn alive(&self) {
        if let Some(j) = &self.jobs {
            let (tx, _rx) = mpsc::channel();
            let _ = j.send(Job { op: JobOp::Alive, data: Payload::F64(Vec::new()), reply: tx });
        }
    }

    /// Per rank: the last device collective it entered (0 = none) and the milliseconds since
    /// rank 0 last heard from it; None when rank 0 could not be asked within `within`.
    pub fn last_entered(&self, seq: u64, within: Duration) -> Option<Vec<(u64, u64)>> {
        let j = self.jobs.as_ref()?;
        let (tx, rx) = mpsc::channel();
        j.send(Job { op: JobOp::DeviceLast(seq), data: Payload::F64(Vec::new()), reply: tx }).ok()?;
        match rx.recv_timeout(within) {
            Ok(Ok(Payload::F64(v))) if !v.is_empty() => Some(v.chunks_exact(2).map(|p| (p[0] as u64, p[1] as u64)).collect()),
            _ => None,
        }
    }
}

impl TcpComm {
    /// A handle for reporting a device communicator's arrivals (see [`Arrivals`]).
    pub fn arrivals(&self) -> Arrivals {
        Arrivals { jobs: self.jobs.clone() }
    }
}

impl Comm<Vec<f32>> for TcpComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn describe(&self) -> String {
        format!("tcp ring, rank {} of {}", self.rank, self.world)
    }

    fn start(&mut self, op: Collective, buf: &mut Vec<f32>, span: Span) -> CResult<Work> {
        self.start_as(op, buf, span, Wire::PLAIN)
    }

    fn start_as(&mut self, op: Collective, buf: &mut Vec<f32>, span: Span, wire: Wire) -> CResult<Work> {
        check_args(op, span, buf.len(), self.world)?;
        if !wire.is_plain() && !matches!(op, Collective::AllReduce(_)) {
            return Err(CommError::Unsupported { what: format!("{} with {wire:?} on {}", op.name(), self.describe()) });
        }
        let data = self.payload(&buf[span.range()]);
        let id = self.submit(JobOp::Coll(op, wire), Payload::F32(data))?;
        Ok(Work { id, op, span })
    }

    fn wait(&mut self, work: Work, buf: &mut Vec<f32>) -> CResult<()> {
        let Payload::F32(data) = self.finish(work.id)? else {
            return Err(self.poison("internal: wrong payload type".into()));
        };
        let span = work.span;
        match work.op {
            // Only the own shard is defined after a reduce-scatter; leave the rest as it was.
            Collective::ReduceScatter(_) => {
                let sh = super::shard(Span { off: 0, len: span.len }, self.world, self.rank);
                buf[span.off + sh.off..span.off + sh.off + sh.len].copy_from_slice(&data[sh.range()]);
            }
            _ => buf[span.range()].copy_from_slice(&data),
        }
        self.recycle(data);
        Ok(())
    }

    fn poll(&mut self, work: &Work) -> CResult<Option<Instant>> {
        if let Some((_, at)) = self.arrived.get(&work.id) {
            return Ok(Some(*at));
        }
        let Some(rx) = self.pending.get(&work.id) else { return Err(CommError::UnknownWork { id: work.id }) };
        match rx.try_recv() {
            Ok(r) => {
                self.pending.remove(&work.id);
                let now = Instant::now();
                self.arrived.insert(work.id, (r, now));
                Ok(Some(now))
            }
            // not done yet; a vanished worker is reported by `wait`
            Err(_) => Ok(None),
        }
    }

    fn barrier(&mut self) -> CResult<()> {
        let id = self.submit(JobOp::Barrier, Payload::F32(vec![0.0]))?;
        self.finish(id).map(|_| ())
    }

    fn all_reduce_host(&mut self, vals: &mut [f64]) -> CResult<()> {
        let id = self.submit(JobOp::Host, Payload::F64(vals.to_vec()))?;
        match self.finish(id)? {
            Payload::F64(v) => {
                vals.copy_from_slice(&v);
                Ok(())
            }
            Payload::F32(_) => Err(self.poison("internal: wrong payload type".into())),
        }
    }

    fn split_groups(&mut self, size: usize) -> CResult<Box<dyn Comm<Vec<f32>>>> {
        check_group(size, self.world)?;
        if size == 1 {
            return Ok(Box::new(SingleComm::new()));
        }
        Ok(Box::new(self.group_ring(size)?))
    }
}

fn io_err(rank: usize, peer: usize, what: &'static str, source: io::Error) -> CommError {
    CommError::Io { rank, peer, what, source }
}

/// The ring listener: loopback only when rank 0 is on loopback (one node), otherwise every
/// interface, since peers reach us at whatever address rank 0 saw us connect from.
fn bind_listener(rank: usize, master_addr: &str) -> CResult<TcpListener> {
    let ip = if rendezvous::is_loopback(master_addr) { IpAddr::V4(Ipv4Addr::LOCALHOST) } else { IpAddr::V4(Ipv4Addr::UNSPECIFIED) };
    TcpListener::bind(SocketAddr::new(ip, 0)).map_err(|e| io_err(rank, rank, "binding the ring listener", e))
}

/// First bytes on a ring connection: the session nonce and the connecting rank.
fn ring_hello(session: u64, rank: usize) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&session.to_le_bytes());
    b[8..].copy_from_slice(&(rank as u64).to_le_bytes());
    b
}

fn connect_next(rank: usize, next: usize, addr: SocketAddr, session: u64, deadline: Instant) -> CResult<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(mut s) => {
                s.set_nodelay(true).map_err(|e| io_err(rank, next, "configuring the ring connection", e))?;
                s.write_all(&ring_hello(session, rank)).map_err(|e| io_err(rank, next, "greeting the next rank", e))?;
                return Ok(s);
            }
            Err(e) if Instant::now() >= deadline => return Err(io_err(rank, next, "connecting to the next rank", e)),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn accept_prev(rank: usize, prev: usize, listener: &TcpListener, session: u64, deadline: Instant) -> CResult<TcpStream> {
    listener.set_nonblocking(true).map_err(|e| io_err(rank, prev, "configuring the ring listener", e))?;
    let start = Instant::now();
    loop {
        if Instant::now() >= deadline {
            return Err(CommError::Timeout {
                rank,
                world: 0,
                op: "ring setup",
                seq: 0,
                waited: start.elapsed(),
                waiting_on: prev,
                missing: Some(vec![prev]),
            });
        }
        match listener.accept() {
            Ok((mut s, _)) => {
                let mut hello = [0u8; 16];
                let ok = s
                    .set_nonblocking(false)
                    .and_then(|_| s.set_read_timeout(Some(Duration::from_secs(10))))
                    .and_then(|_| s.read_exact(&mut hello));
                // Anything but our previous rank of this session is a stray: drop it.
                if ok.is_ok() && hello == ring_hello(session, prev) {
                    return Ok(s);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => return Err(io_err(rank, prev, "accepting the previous rank", e)),
        }
    }
}

enum Outgoing {
    Frame(Vec<u8>),
    /// Acknowledged once every earlier frame has been handed to the kernel.
    Flush(mpsc::Sender<()>),
}

/// Writes frames to the next rank, in order, until the channel closes or a write fails.
fn sender(out: &mut TcpStream, rx: mpsc::Receiver<Outgoing>, err: Arc<Mutex<Option<io::Error>>>) {
    for m in rx {
        match m {
            Outgoing::Frame(bytes) => {
                if let Err(e) = out.write_all(&bytes) {
                    if let Ok(mut slot) = err.lock() {
                        *slot = Some(e);
                    }
                    return;
                }
            }
            Outgoing::Flush(ack) => {
                let _ = ack.send(());
            }
        }
    }
}

/// The worker thread's state: both ring connections and the collective counter.
struct Ring {
    rank: usize,
    world: usize,
    next: usize,
    prev: usize,
    /// World rank of each member (errors name these; a group's ring numbers its members from 0).
    ids: Vec<usize>,
    from_prev: TcpStream,
    send: mpsc::Sender<Outgoing>,
    send_err: Arc<Mutex<Option<io::Error>>>,
    /// Rank 0's arrival tracker (the world ring's; a group's ring has none).
    control: Option<ControlLink>,
    /// Number of the collective in progress (1-based; identical on every rank).
    seq: u64,
    timeout: Duration,
    failed: Option<String>,
}

/// Chunk `i` of `len` elements split over `world`: sizes differ by at most one.
fn chunk(len: usize, world: usize, i: usize) -> std::ops::Range<usize> {
    let (base, rem) = (len / world, len % world);
    let start = i * base + i.min(rem);
    start..start + base + usize::from(i < rem)
}

impl Ring {
    fn run(mut self, jobs: mpsc::Receiver<Job>) {
        for job in jobs {
            let result = match &self.failed {
                Some(cause) => Err(CommError::Poisoned { rank: self.me(), cause: cause.clone() }),
                None => {
                    let r = self.execute(job.op, job.data);
                    if let Err(e) = &r {
                        self.failed = Some(e.to_string());
                    }
                    r
                }
            };
            let _ = job.reply.send(result);
        }
    }

    fn execute(&mut self, op: JobOp, data: Payload) -> CResult<Payload> {
        match op {
            JobOp::DeviceArrive(seq) => {
                let me = self.me();
                if let Some(c) = self.control.as_mut() {
                    c.arrive(me, seq, true);
                }
                return Ok(data);
            }
            JobOp::DeviceLast(seq) => {
                // (last entered, ms silent) per rank, one after the other
                let status = self.control.as_mut().and_then(|c| c.status(seq, true));
                let v = status.map(|(last, _, silent)| last.iter().zip(&silent).flat_map(|(&l, &q)| [l as f64, q as f64]).collect()).unwrap_or_default();
                return Ok(Payload::F64(v));
            }
            JobOp::Alive => {
                let me = self.me();
                if let Some(c) = self.control.as_mut() {
                    c.alive(me);
                }
                return Ok(data);
            }
            _ => {}
        }
        self.seq += 1;
        let (me, seq) = (self.me(), self.seq);
        if let Some(c) = self.control.as_mut() {
            c.arrive(me, seq, false);
        }
        let out = match (op, data) {
            (JobOp::Coll(Collective::AllReduce(op), wire), Payload::F32(mut d)) => {
                self.all_reduce_as(&mut d, op == ReduceOp::Avg, wire)?;
                Payload::F32(d)
            }
            (JobOp::Coll(Collective::ReduceScatter(op), _), Payload::F32(mut d)) => {
                self.reduce_scatter(&mut d, OP_REDUCE_SCATTER, op == ReduceOp::Avg)?;
                Payload::F32(d)
            }
            (JobOp::Coll(Collective::AllGather, _), Payload::F32(mut d)) => {
                self.all_gather(&mut d, OP_ALL_GATHER, 0)?;
                Payload::F32(d)
            }
            (JobOp::Coll(Collective::Broadcast { root }, _), Payload::F32(mut d)) => {
                self.broadcast(&mut d, root)?;
                Payload::F32(d)
            }
            (JobOp::Coll(Collective::AllToAll, _), Payload::F32(mut d)) => {
                self.all_to_all(&mut d)?;
                Payload::F32(d)
            }
            (JobOp::Barrier, Payload::F32(mut d)) => {
                self.all_reduce(&mut d, OP_BARRIER, false)?;
                Payload::F32(d)
            }
            (JobOp::Host, Payload::F64(mut d)) => {
                self.all_reduce(&mut d, OP_HOST, false)?;
                Payload::F64(d)
            }
            _ => return Err(CommError::Poisoned { rank: self.me(), cause: "internal: payload does not match the operation".into() }),
        };
        self.flush(out)
    }

    /// Waits until the sender has written everything this collective queued, so a rank that
    /// returns from its last collective and exits does not drop frames its neighbour needs.
    fn flush(&mut self, out: Payload) -> CResult<Payload> {
        let (tx, rx) = mpsc::channel();
        if self.send.send(Outgoing::Flush(tx)).is_err() || rx.recv_timeout(self.timeout + Duration::from_secs(1)).is_err() {
            return Err(self.send_failure(OP_ALL_REDUCE));
        }
        Ok(out)
    }

    /// An all-reduce of f32 values travelling as `wire` says: scaled by `pre`, summed (in f32,
    /// or in bf16 with every partial sum rounded), scaled by `post`.
    fn all_reduce_as(&mut self, d: &mut [f32], avg: bool, wire: Wire) -> CResult<()> {
        if wire.pre != 1.0 {
            d.iter_mut().for_each(|x| *x *= wire.pre);
        }
        if wire.bf16 {
            let mut h: Vec<half::bf16> = d.iter().map(|&x| half::bf16::from_f32(x)).collect();
            self.all_reduce(&mut h, OP_ALL_REDUCE, avg)?;
            d.iter_mut().zip(&h).for_each(|(x, v)| *x = v.to_f32());
        } else {
            self.all_reduce(d, OP_ALL_REDUCE, avg)?;
        }
        if wire.post != 1.0 {
            d.iter_mut().for_each(|x| *x *= wire.post);
        }
        Ok(())
    }

    fn all_reduce<T: Elem>(&mut self, d: &mut [T], code: u8, avg: bool) -> CResult<()> {
        self.reduce_scatter(d, code, avg)?;
        self.all_gather(d, code, self.world as u32 - 1)
    }

    /// After W − 1 steps rank r holds the full reduction of chunk r. At step s it sends chunk
    /// r − s − 1 (summed over ranks r − s − 1 … r) and adds the incoming chunk r − s − 2.
    fn reduce_scatter<T: Elem>(&mut self, d: &mut [T], code: u8, avg: bool) -> CResult<()> {
        let (r, w, n) = (self.rank, self.world, d.len());
        for s in 0..w - 1 {
            let send_c = chunk(n, w, (r + 2 * w - s - 1) % w);
            let recv_c = chunk(n, w, (r + 2 * w - s - 2) % w);
            self.send_frame(code, s as u32, &d[send_c])?;
            let got: Vec<T> = self.recv_frame(code, s as u32, recv_c.len())?;
            for (x, g) in d[recv_c].iter_mut().zip(got) {
                *x += g;
            }
        }
        if avg {
            for x in &mut d[chunk(n, w, r)] {
                *x = x.div(w);
            }
        }
        Ok(())
    }

    /// Each rank starts owning chunk r; at step s it forwards chunk r − s and receives chunk
    /// r − s − 1. `step0` numbers the steps after a preceding reduce-scatter.
    fn all_gather<T: Elem>(&mut self, d: &mut [T], code: u8, step0: u32) -> CResult<()> {
        let (r, w, n) = (self.rank, self.world, d.len());
        for s in 0..w - 1 {
            let send_c = chunk(n, w, (r + w - s) % w);
            let recv_c = chunk(n, w, (r + 2 * w - s - 1) % w);
            self.send_frame(code, step0 + s as u32, &d[send_c])?;
            let got: Vec<T> = self.recv_frame(code, step0 + s as u32, recv_c.len())?;
            d[recv_c].copy_from_slice(&got);
        }
        Ok(())
    }

    /// Block `j` of this rank's span (W blocks) goes to rank `j`, and block `j` of the result
    /// comes from rank `j`. Every block travels forward along the ring to its destination: at
    /// step s a rank forwards, in order of destination, the blocks rank r − s sent that have
    /// not arrived yet (those for r + 1 … r − s − 1 + W) and keeps the first one it receives,
    /// which is rank r − s − 1's block for it. The own block never moves.
    fn all_to_all(&mut self, d: &mut [f32]) -> CResult<()> {
        let (r, w) = (self.rank, self.world);
        let c = d.len() / w;
        let mut carry: Vec<f32> = Vec::with_capacity((w - 1) * c);
        for k in 1..w {
            carry.extend_from_slice(&d[(r + k) % w * c..][..c]);
        }
        for s in 0..w - 1 {
            self.send_frame(OP_ALL_TO_ALL, s as u32, &carry)?;
            let mut got: Vec<f32> = self.recv_frame(OP_ALL_TO_ALL, s as u32, (w - 1 - s) * c)?;
            let origin = (r + 2 * w - 1 - s) % w;
            d[origin * c..(origin + 1) * c].copy_from_slice(&got[..c]);
            // what is left travels on: drop the kept block in place rather than copy the rest
            got.drain(..c);
            carry = got;
        }
        Ok(())
    }

    /// Pipelined along the ring from `root`: each rank receives a piece from its previous
    /// rank and forwards it, except to the root.
    fn broadcast(&mut self, d: &mut [f32], root: usize) -> CResult<()> {
        let pieces = d.len().div_ceil(BROADCAST_PIECE).max(1);
        for p in 0..pieces {
            let range = p * BROADCAST_PIECE..((p + 1) * BROADCAST_PIECE).min(d.len());
            if self.rank != root {
                let got: Vec<f32> = self.recv_frame(OP_BROADCAST, p as u32, range.len())?;
                d[range.clone()].copy_from_slice(&got);
            }
            if self.next != root {
                self.send_frame(OP_BROADCAST, p as u32, &d[range])?;
            }
        }
        Ok(())
    }

    /// This rank's world rank (errors name it).
    fn me(&self) -> usize {
        self.ids[self.rank]
    }

    fn header(&self, code: u8, step: u32, count: usize, elem_bytes: usize) -> FrameHeader {
        FrameHeader { op: code, elem_bytes: elem_bytes as u8, seq: self.seq, step, count: count as u64 }
    }

    fn send_frame<T: Elem>(&mut self, code: u8, step: u32, data: &[T]) -> CResult<()> {
        let h = self.header(code, step, data.len(), std::mem::size_of::<T>());
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let mut frame = Vec::with_capacity(HEADER_BYTES + bytes.len());
        frame.extend_from_slice(&h.encode());
        frame.extend_from_slice(bytes);
        if self.send.send(Outgoing::Frame(frame)).is_err() {
            return Err(self.send_failure(code));
        }
        Ok(())
    }

    fn send_failure(&mut self, code: u8) -> CommError {
        let e = self.send_err.lock().ok().and_then(|mut s| s.take());
        match e {
            Some(e) if is_timeout(&e) => self.timeout_error(code, Duration::ZERO, self.ids[self.next]),
            Some(e) if is_closed(&e) => CommError::PeerClosed { rank: self.me(), peer: self.ids[self.next], op: op_name(code), seq: self.seq },
            Some(e) => io_err(self.me(), self.ids[self.next], "sending to the next rank", e),
            None => CommError::PeerClosed { rank: self.me(), peer: self.ids[self.next], op: op_name(code), seq: self.seq },
        }
    }

    fn recv_frame<T: Elem>(&mut self, code: u8, step: u32, count: usize) -> CResult<Vec<T>> {
        let started = Instant::now();
        let mut hb = [0u8; HEADER_BYTES];
        self.from_prev.read_exact(&mut hb).map_err(|e| self.recv_error(code, started, e))?;
        let want = self.header(code, step, count, std::mem::size_of::<T>());
        let describe = |h: &FrameHeader| format!("{} #{} step {} ({} elements of {} bytes)", op_name(h.op), h.seq, h.step, h.count, h.elem_bytes);
        match FrameHeader::decode(&hb) {
            Some(h) if h == want => {}
            got => {
                return Err(CommError::Desync {
                    rank: self.me(),
                    peer: self.ids[self.prev],
                    ours: describe(&want),
                    theirs: got.map(|h| describe(&h)).unwrap_or_else(|| "bytes that are not a vitscale frame".into()),
                })
            }
        }
        let mut out = vec![T::zeroed(); count];
        self.from_prev.read_exact(bytemuck::cast_slice_mut(&mut out)).map_err(|e| self.recv_error(code, started, e))?;
        Ok(out)
    }

    fn recv_error(&mut self, code: u8, started: Instant, e: io::Error) -> CommError {
        if is_timeout(&e) {
            self.timeout_error(code, started.elapsed(), self.ids[self.prev])
        } else if is_closed(&e) {
            CommError::PeerClosed { rank: self.me(), peer: self.ids[self.prev], op: op_name(code), seq: self.seq }
        } else {
            io_err(self.me(), self.ids[self.prev], "receiving from the previous rank", e)
        }
    }

    fn timeout_error(&mut self, code: u8, waited: Duration, waiting_on: usize) -> CommError {
        let seq = self.seq;
        let missing = self.control.as_mut().and_then(|c| c.missing(seq, false));
        CommError::Timeout {
            rank: self.me(),
            world: self.world,
            op: op_name(code),
            seq: self.seq,
            waited: waited.max(self.timeout),
            waiting_on,
            missing,
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

fn is_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionAborted
    )
}

#[cfg(test)]
mod tests {
    use super::chunk;

    #[test]
    fn chunks_tile_the_buffer() {
        for len in [0, 1, 5, 12, 13] {
            for w in 1..6 {
                let mut at = 0;
                for i in 0..w {
                    let c = chunk(len, w, i);
                    assert_eq!(c.start, at);
                    assert!(c.len() == len / w || c.len() == len / w + 1);
                    at = c.end;
                }
                assert_eq!(at, len);
            }
        }
    }
}
