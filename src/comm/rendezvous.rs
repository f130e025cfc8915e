//! Rendezvous: how ranks find each other before any collective.
//!
//! Rank 0 serves a small TCP service at `MASTER_ADDR:MASTER_PORT`; every other rank connects
//! (retrying until the rendezvous timeout, since rank 0 may start later) and says who it is:
//! its rank, its world size, a hash of its resolved configuration, and the port of its ring
//! listener. When all ranks are in, rank 0 checks that they agree and answers everyone with
//! the ring addresses and an opaque blob (the NCCL unique id travels this way). Any
//! disagreement fails every rank with the same error text, naming the rank and both values.
//!
//! Each request carries the job's identity (`comm::env::job_id`: `vitscale launch`'s run id,
//! torchrun's, SLURM's job and step, Open MPI's): rank 0 refuses a process of another job
//! that reached its port and keeps waiting for its own ranks, so two runs given one port
//! never mix. A rank that waits says so on stderr every so often: whom it waits for, and
//! how long it has left (`train.comm_timeout_s`, or `VITSCALE_RENDEZVOUS_TIMEOUT`).
//!
//! The connections stay open afterwards as a control channel: each rank reports entering each
//! collective, so a rank whose collective times out can ask rank 0 which ranks never arrived.

use std::collections::BTreeMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::wire::{read_control, write_control, Control, PROTOCOL_VERSION};

/// Errors of rendezvous. Each names the rank, host and port involved.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("rank 0 cannot serve rendezvous on {addr}:{port}: the port is already in use (another run? choose another MASTER_PORT / --master-port)")]
    PortInUse { addr: String, port: u16 },
    #[error("rank 0 cannot serve rendezvous on {addr}:{port}: {source}")]
    Bind { addr: String, port: u16, source: io::Error },
    #[error("cannot resolve rendezvous host {addr:?}: {detail}")]
    Resolve { addr: String, detail: String },
    #[error("rank {rank}: rank 0's rendezvous at {addr}:{port} was not reachable within {waited:.0?} (last error: {last})")]
    Unreachable { rank: usize, addr: String, port: u16, waited: Duration, last: String },
    #[error("rendezvous at {addr}:{port} timed out after {waited:.0?}: rank(s) {missing:?} of {world} never arrived")]
    Missing { addr: String, port: u16, missing: Vec<usize>, world: usize, waited: Duration },
    #[error("world sizes disagree: rank {rank} has world size {theirs}, rank 0 has {ours}")]
    WorldSizeMismatch { rank: usize, theirs: usize, ours: usize },
    #[error("configurations disagree: rank {rank} has config hash {theirs}, rank 0 has {ours}")]
    ConfigMismatch { rank: usize, theirs: String, ours: String },
    #[error("rank {rank} joined twice (from {first} and from {second})")]
    DuplicateRank { rank: usize, first: String, second: String },
    #[error("a process at {from} claims rank {rank}, which is not a joining rank of a world of {world}")]
    BadRank { rank: usize, world: usize, from: String },
    #[error("rank {rank} of job {ours:?}: the rendezvous at {addr}:{port} belongs to job {theirs:?}: two runs were given the same port (choose another MASTER_PORT / --master-port)")]
    OtherJob { rank: usize, addr: String, port: u16, ours: String, theirs: String },
    #[error("rank {rank}: rendezvous failed at rank 0: {reason}")]
    Rejected { rank: usize, reason: String },
    #[error("rank {rank}: rendezvous protocol error with {peer}: {detail}")]
    Protocol { rank: usize, peer: String, detail: String },
}

/// What a rank brings to rendezvous.
#[derive(Clone, Debug)]
pub struct RendezvousRequest {
    pub rank: usize,
    pub world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub timeout: Duration,
    /// Identifies the resolved configuration; every rank must bring the same.
    pub config_hash: String,
    /// The job's identity from the launcher ("" = unnamed: any peer is accepted).
    pub job_id: String,
    /// Port of this rank's ring listener (0 when the transport needs none, e.g. NCCL).
    pub data_port: u16,
    /// Rank 0's blob for everyone (ignored on other ranks).
    pub blob: Vec<u8>,
}

/// The outcome: everyone's ring address, and rank 0's blob.
#[derive(Debug)]
pub struct Rendezvoused {
    pub rank: usize,
    pub world_size: usize,
    /// Ring listener address of each rank, indexed by rank.
    pub peers: Vec<SocketAddr>,
    /// Random per-run number that ring connections present, so a stray connection (an old
    /// run on the same ports) is refused.
    pub session: u64,
    pub blob: Vec<u8>,
    pub(crate) control: ControlLink,
}

/// Last collective each rank entered (of the TCP ring, and of the device communicator), and
/// whether its control connection closed.
#[derive(Debug)]
pub(crate) struct Tracker {
    state: Mutex<TrackerState>,
}

#[derive(Clone, Debug)]
struct TrackerState {
    ring: Vec<u64>,
    device: Vec<u64>,
    gone: Vec<bool>,
    /// When each rank was last heard from.
    heard: Vec<Instant>,
}

/// What rank 0 knows of every rank: the last collective entered (of the lane asked), whether
/// its connection closed, milliseconds since it was last heard from.
pub(crate) type RankStatus = (Vec<u64>, Vec<bool>, Vec<u64>);

impl Tracker {
    fn new(world: usize) -> Self {
        Tracker { state: Mutex::new(TrackerState { ring: vec![0; world], device: vec![0; world], gone: vec![false; world], heard: vec![Instant::now(); world] }) }
    }
    fn arrive(&self, rank: usize, seq: u64, device: bool) {
        if let Ok(mut s) = self.state.lock() {
            let last = if device { &mut s.device } else { &mut s.ring };
            last[rank] = last[rank].max(seq);
            s.heard[rank] = Instant::now();
        }
    }
    fn hear(&self, rank: usize) {
        if let Ok(mut s) = self.state.lock() {
            s.heard[rank] = Instant::now();
        }
    }
    fn gone(&self, rank: usize) {
        if let Ok(mut s) = self.state.lock() {
            s.gone[rank] = true;
        }
    }
    fn status(&self, device: bool) -> RankStatus {
        let s = match self.state.lock() {
            Ok(s) => s.clone(),
            Err(p) => p.into_inner().clone(),
        };
        let silent = s.heard.iter().map(|h| h.elapsed().as_millis() as u64).collect();
        (if device { s.device } else { s.ring }, s.gone, silent)
    }
}

/// A rank's end of the control channel: rank 0 reads its tracker directly.
#[derive(Debug)]
pub(crate) enum ControlLink {
    Local(Arc<Tracker>),
    Remote(TcpStream),
    /// The link failed once; it is not used again (arrival reports are best effort).
    Broken,
}

impl ControlLink {
    /// Reports entering collective `seq` (`device`: of the device communicator). Best
    /// effort: the transports detect failures themselves.
    pub(crate) fn arrive(&mut self, rank: usize, seq: u64, device: bool) {
        match self {
            ControlLink::Local(t) => t.arrive(rank, seq, device),
            ControlLink::Remote(s) => {
                if write_control(s, &Control::Arrive { seq, device }).is_err() {
                    *self = ControlLink::Broken;
                }
            }
            ControlLink::Broken => {}
        }
    }

    /// Ranks that have not entered collective `seq`, with a note for ranks whose connection
    /// closed; `None` when rank 0 cannot be asked.
    pub(crate) fn missing(&mut self, seq: u64, device: bool) -> Option<Vec<usize>> {
        let (last, _, _) = self.status(seq, device)?;
        Some(last.iter().enumerate().filter(|(_, &l)| l < seq).map(|(r, _)| r).collect())
    }

    /// Reports that this process is alive. Best effort.
    pub(crate) fn alive(&mut self, rank: usize) {
        match self {
            ControlLink::Local(t) => t.hear(rank),
            ControlLink::Remote(s) => {
                if write_control(s, &Control::Alive).is_err() {
                    *self = ControlLink::Broken;
                }
            }
            ControlLink::Broken => {}
        }
    }

    /// What rank 0's tracker holds of every rank (see [`RankStatus`]); `None` when rank 0
    /// cannot be asked.
    pub(crate) fn status(&mut self, seq: u64, device: bool) -> Option<RankStatus> {
        let status = match self {
            ControlLink::Local(t) => t.status(device),
            ControlLink::Remote(s) => {
                let asked = write_control(s, &Control::Query { seq, device })
                    .and_then(|_| s.set_read_timeout(Some(Duration::from_secs(5))))
                    .and_then(|_| read_control(s));
                match asked {
                    Ok(Control::Status { last, gone, silent_ms }) => (last, gone, silent_ms),
                    _ => {
                        *self = ControlLink::Broken;
                        return None;
                    }
                }
            }
            ControlLink::Broken => return None,
        };
        Some(status)
    }
}

fn resolve(addr: &str, port: u16) -> Result<Vec<SocketAddr>, RendezvousError> {
    let addrs: Vec<SocketAddr> = (addr, port)
        .to_socket_addrs()
        .map_err(|e| RendezvousError::Resolve { addr: addr.to_string(), detail: e.to_string() })?
        .collect();
    if addrs.is_empty() {
        return Err(RendezvousError::Resolve { addr: addr.to_string(), detail: "no addresses".into() });
    }
    Ok(addrs)
}

/// Whether `addr` names this machine's loopback interface only (then every listener binds to
/// loopback, and nothing is exposed to the network).
pub fn is_loopback(addr: &str) -> bool {
    resolve(addr, 0).map(|a| a.iter().all(|s| s.ip().is_loopback())).unwrap_or(false)
}

/// When a waiting rank next says it is still waiting: after 5 s, then every 30 s.
struct Progress {
    next: Instant,
}

impl Progress {
    fn new(start: Instant) -> Self {
        Progress { next: start + Duration::from_secs(5) }
    }
    /// Prints `what()` with the time waited and the time left, when a report is due.
    fn report(&mut self, start: Instant, timeout: Duration, what: impl FnOnce() -> String) {
        if Instant::now() >= self.next {
            let waited = start.elapsed().as_secs_f64();
            eprintln!("{} ({waited:.0} s so far; giving up after {:.0} s)", what(), timeout.as_secs_f64());
            self.next = Instant::now() + Duration::from_secs(30);
        }
    }
}

/// Runs rendezvous for `req.rank`. See the module doc.
pub fn rendezvous(req: &RendezvousRequest) -> Result<Rendezvoused, RendezvousError> {
    // every command opens its device before it meets the other ranks: under `launch
    // --one-gpu` the next rank may start now
    crate::comm::env::signal_device_ready();
    if req.rank == 0 {
        serve(req)
    } else {
        join(req)
    }
}

fn serve(req: &RendezvousRequest) -> Result<Rendezvoused, RendezvousError> {
    let world = req.world_size;
    let tracker = Arc::new(Tracker::new(world));
    if world == 1 {
        let peers = vec![SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), req.data_port)];
        let session = new_session();
        return Ok(Rendezvoused { rank: 0, world_size: 1, peers, session, blob: req.blob.clone(), control: ControlLink::Local(tracker) });
    }
    let (addr, port) = (req.master_addr.as_str(), req.master_port);
    let resolved = resolve(addr, port)?;
    // Loopback masters bind loopback only; otherwise listen on every interface, as torchrun's
    // store does, because MASTER_ADDR may be a name that resolves to an address the host
    // does not own (NAT, aliases).
    let bind = if resolved.iter().all(|a| a.ip().is_loopback()) {
        resolved[0]
    } else {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port)
    };
    let listener = TcpListener::bind(bind).map_err(|e| match e.kind() {
        io::ErrorKind::AddrInUse => RendezvousError::PortInUse { addr: addr.to_string(), port },
        _ => RendezvousError::Bind { addr: addr.to_string(), port, source: e },
    })?;
    listener.set_nonblocking(true).map_err(|e| RendezvousError::Bind { addr: addr.to_string(), port, source: e })?;

    let start = Instant::now();
    let mut progress = Progress::new(start);
    let mut joined: BTreeMap<usize, (TcpStream, SocketAddr, u16)> = BTreeMap::new();
    let fail = |joined: &mut BTreeMap<usize, (TcpStream, SocketAddr, u16)>, extra: Option<&mut TcpStream>, err: RendezvousError| {
        let reject = Control::Reject { reason: err.to_string() };
        for (s, _, _) in joined.values_mut() {
            let _ = write_control(s, &reject);
        }
        if let Some(s) = extra {
            let _ = write_control(s, &reject);
        }
        err
    };
    while joined.len() < world - 1 {
        if start.elapsed() >= req.timeout {
            let missing = (1..world).filter(|r| !joined.contains_key(r)).collect();
            let err = RendezvousError::Missing { addr: addr.to_string(), port, missing, world, waited: start.elapsed() };
            return Err(fail(&mut joined, None, err));
        }
        let (mut s, from) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {
                progress.report(start, req.timeout, || {
                    let missing: Vec<usize> = (1..world).filter(|r| !joined.contains_key(r)).collect();
                    format!("rank 0: rendezvous at {addr}:{port} waiting for rank(s) {missing:?} of {world}")
                });
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(fail(&mut joined, None, RendezvousError::Bind { addr: addr.to_string(), port, source: e })),
        };
        // A connection that never says hello must not stall the others for long.
        let hello = s
            .set_nonblocking(false)
            .and_then(|_| s.set_nodelay(true))
            .and_then(|_| s.set_read_timeout(Some(Duration::from_secs(10))))
            .and_then(|_| read_control(&mut s));
        let (rank, their_world, hash, data_port) = match hello {
            // A process of another job (same port): refuse it, keep waiting for ours.
            Ok(Control::Hello { version, rank, job, .. }) if version == PROTOCOL_VERSION && !job.is_empty() && !req.job_id.is_empty() && job != req.job_id => {
                let err = RendezvousError::OtherJob { rank, addr: addr.to_string(), port, ours: job, theirs: req.job_id.clone() };
                let _ = write_control(&mut s, &Control::Reject { reason: err.to_string() });
                continue;
            }
            Ok(Control::Hello { version, rank, world_size, config_hash, data_port, .. }) if version == PROTOCOL_VERSION => {
                (rank, world_size, config_hash, data_port)
            }
            // Not one of ours (a port scanner, an old build): refuse it and keep waiting.
            Ok(other) => {
                let _ = write_control(&mut s, &Control::Reject { reason: format!("unexpected first message {other:?} (protocol version {PROTOCOL_VERSION} expected)") });
                continue;
            }
            Err(_) => continue,
        };
        let err = if their_world != world {
            Some(RendezvousError::WorldSizeMismatch { rank, theirs: their_world, ours: world })
        } else if rank == 0 || rank >= world {
            Some(RendezvousError::BadRank { rank, world, from: from.to_string() })
        } else if let Some((_, first, _)) = joined.get(&rank) {
            Some(RendezvousError::DuplicateRank { rank, first: first.to_string(), second: from.to_string() })
        } else if hash != req.config_hash {
            Some(RendezvousError::ConfigMismatch { rank, theirs: hash, ours: req.config_hash.clone() })
        } else {
            None
        };
        if let Some(err) = err {
            return Err(fail(&mut joined, Some(&mut s), err));
        }
        joined.insert(rank, (s, from, data_port));
    }

    // Rank 0's own ring address: the local address its peers reached it at.
    let my_ip = joined.values().next().and_then(|(s, _, _)| s.local_addr().ok()).map(|a| a.ip());
    let my_ip = my_ip.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let mut peers = vec![SocketAddr::new(my_ip, req.data_port)];
    peers.extend(joined.values().map(|(_, from, p)| SocketAddr::new(from.ip(), *p)));
    let session = new_session();
    let welcome = Control::Welcome {
        world_size: world,
        peers: peers.iter().map(|p| p.to_string()).collect(),
        session,
        blob: req.blob.clone(),
    };
    for (rank, (mut s, _, _)) in joined {
        if write_control(&mut s, &welcome).is_err() || s.set_read_timeout(None).is_err() {
            // It vanished between hello and welcome; the ring will report it.
            tracker.gone(rank);
            continue;
        }
        let t = tracker.clone();
        std::thread::Builder::new()
            .name(format!("vitscale-coord-{rank}"))
            .spawn(move || coordinate(rank, s, t))
            .map_err(|e| RendezvousError::Bind { addr: addr.to_string(), port, source: e })?;
    }
    Ok(Rendezvoused { rank: 0, world_size: world, peers, session, blob: req.blob.clone(), control: ControlLink::Local(tracker) })
}

/// Rank 0's side of one rank's control connection: records arrivals, answers queries, and
/// ends when the rank disconnects.
fn coordinate(rank: usize, mut s: TcpStream, tracker: Arc<Tracker>) {
    loop {
        match read_control(&mut s) {
            Ok(Control::Arrive { seq, device }) => tracker.arrive(rank, seq, device),
            Ok(Control::Alive) => tracker.hear(rank),
            Ok(Control::Query { device, .. }) => {
                tracker.hear(rank);
                let (last, gone, silent_ms) = tracker.status(device);
                if write_control(&mut s, &Control::Status { last, gone, silent_ms }).is_err() {
                    break;
                }
            }
            Ok(_) | Err(_) => break,
        }
    }
    tracker.gone(rank);
}

fn join(req: &RendezvousRequest) -> Result<Rendezvoused, RendezvousError> {
    let (addr, port, rank) = (req.master_addr.as_str(), req.master_port, req.rank);
    let start = Instant::now();
    let mut progress = Progress::new(start);
    let mut last = String::from("never tried");
    let mut s = loop {
        if start.elapsed() >= req.timeout {
            return Err(RendezvousError::Unreachable { rank, addr: addr.to_string(), port, waited: start.elapsed(), last });
        }
        progress.report(start, req.timeout, || format!("rank {rank}: waiting for rank 0's rendezvous at {addr}:{port} (last error: {last})"));
        // Resolve each time: the master's name may only appear in DNS once its node is up.
        match resolve(addr, port) {
            Ok(addrs) => {
                let left = req.timeout.saturating_sub(start.elapsed()).max(Duration::from_millis(1));
                match TcpStream::connect_timeout(&addrs[0], left.min(Duration::from_secs(2))) {
                    Ok(s) => break s,
                    Err(e) => last = e.to_string(),
                }
            }
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let peer = format!("rank 0 at {addr}:{port}");
    let proto = |detail: String| RendezvousError::Protocol { rank, peer: peer.clone(), detail };
    let hello = Control::Hello {
        version: PROTOCOL_VERSION,
        rank,
        world_size: req.world_size,
        config_hash: req.config_hash.clone(),
        data_port: req.data_port,
        job: req.job_id.clone(),
    };
    s.set_nodelay(true).map_err(|e| proto(e.to_string()))?;
    write_control(&mut s, &hello).map_err(|e| proto(format!("sending hello: {e}")))?;
    // Rank 0 answers when the last rank is in, or with the list of missing ranks when its own
    // timeout expires: wait a little longer than that so its error, which names them, wins.
    let wait = req.timeout.saturating_sub(start.elapsed()) + Duration::from_secs(15);
    let deadline = Instant::now() + wait;
    // Wait for the first byte of the answer in short slices, saying who we wait for; the
    // message itself is then read whole.
    s.set_read_timeout(Some(Duration::from_secs(1))).map_err(|e| proto(e.to_string()))?;
    loop {
        match s.peek(&mut [0u8; 1]) {
            Ok(_) => break,
            Err(e) if (e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut) && Instant::now() < deadline => {
                progress.report(start, req.timeout, || format!("rank {rank}: joined the rendezvous at {addr}:{port}, waiting for the other ranks"));
            }
            Err(_) => break, // read_control below reports it
        }
    }
    s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)))).map_err(|e| proto(e.to_string()))?;
    match read_control(&mut s) {
        Ok(Control::Welcome { world_size, peers, session, blob }) => {
            let peers: Result<Vec<SocketAddr>, _> = peers.iter().map(|p| p.parse::<SocketAddr>()).collect();
            let peers = peers.map_err(|e| proto(format!("bad peer address: {e}")))?;
            if world_size != req.world_size || peers.len() != world_size {
                return Err(proto(format!("welcome for {world_size} ranks with {} addresses", peers.len())));
            }
            s.set_read_timeout(None).map_err(|e| proto(e.to_string()))?;
            Ok(Rendezvoused { rank, world_size, peers, session, blob, control: ControlLink::Remote(s) })
        }
        Ok(Control::Reject { reason }) => Err(RendezvousError::Rejected { rank, reason }),
        Ok(other) => Err(proto(format!("unexpected reply {other:?}"))),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut => {
            Err(proto(format!("no answer within {wait:.0?} after joining")))
        }
        Err(e) => Err(proto(format!("connection lost before rendezvous completed: {e}"))),
    }
}

/// A number unlikely to repeat between runs: time and process id through a hash.
fn new_session() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.write_u32(std::process::id());
    h.finish()
}
