//! A per-rank timeline in the Chrome trace format (`chrome://tracing`, Perfetto): complete
//! events ("ph": "X") on named tracks, so the forward and backward passes, each block's
//! finished gradients and each gradient bucket's reduction line up and their overlap can be
//! seen. `vitscale train --trace DIR` writes `DIR/trace-rank<r>.json`.
//!
//! The host tracks hold the host's times: on the CPU backend when the work ran, on a GPU when
//! the host enqueued it. The device track holds the step's phases from the same marks as the
//! metrics lines (`train::timeline`), placed on the host clock, so a chart, a metrics line and
//! the trace never disagree.

use std::path::Path;
use std::time::Instant;

use serde::Serialize;

/// Tracks (Chrome "threads") of a rank's timeline.
#[derive(Clone, Copy, Debug)]
pub enum Track {
    /// Forward and backward passes, the boundary.
    Compute = 1,
    /// Points at which the backward finished a group's gradients.
    Gradients = 2,
    /// Each bucket's reduction, from its start to its completion.
    Comm = 3,
    /// Waiting for the data loader.
    Data = 4,
    /// The step's phases where the device ran them (`train::timeline`): on a GPU its compute
    /// stream, placed on the host clock.
    Device = 5,
    /// Each collective on a GPU's communication stream (NCCL), placed on the host clock.
    DeviceComm = 6,
    /// Each batch-input copy on a GPU's copy stream, placed on the host clock.
    DeviceCopy = 7,
}

impl Track {
    fn name(self) -> &'static str {
        match self {
            Track::Compute => "compute",
            Track::Gradients => "gradients ready",
            Track::Comm => "gradient reduction",
            Track::Data => "data wait",
            Track::Device => "device: compute stream",
            Track::DeviceComm => "device: communication stream",
            Track::DeviceCopy => "device: copy stream",
        }
    }
}

#[derive(Serialize)]
struct Event {
    name: String,
    ph: &'static str,
    /// microseconds since the trace's epoch
    ts: f64,
    dur: f64,
    pid: usize,
    tid: usize,
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    args: serde_json::Map<String, serde_json::Value>,
}

/// The events of one rank.
pub struct Trace {
    epoch: Instant,
    rank: usize,
    events: Vec<Event>,
}

impl Trace {
    pub fn new(rank: usize, epoch: Instant) -> Trace {
        Trace { epoch, rank, events: Vec::new() }
    }

    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// An event from `start` to `end` on `track`.
    pub fn span(&mut self, track: Track, name: impl Into<String>, start: Instant, end: Instant, args: serde_json::Map<String, serde_json::Value>) {
        let ts = start.saturating_duration_since(self.epoch).as_secs_f64() * 1e6;
        let dur = end.saturating_duration_since(start).as_secs_f64() * 1e6;
        self.events.push(Event { name: name.into(), ph: "X", ts, dur, pid: self.rank, tid: track as usize, args });
    }

    /// An event given in seconds since the epoch.
    pub fn span_s(&mut self, track: Track, name: impl Into<String>, start_s: f64, end_s: f64, args: serde_json::Map<String, serde_json::Value>) {
        self.events.push(Event { name: name.into(), ph: "X", ts: start_s * 1e6, dur: (end_s - start_s).max(0.0) * 1e6, pid: self.rank, tid: track as usize, args });
    }

    /// Writes `dir/trace-rank<r>.json` (atomically); a trace already there is an error, not
    /// overwritten (`check_fresh` refuses it before the run starts).
    pub fn write(&self, dir: &Path) -> std::io::Result<std::path::PathBuf> {
        std::fs::create_dir_all(dir)?;
        check_fresh(dir, self.rank)?;
        let mut all: Vec<serde_json::Value> = Vec::with_capacity(self.events.len() + 5);
        all.push(serde_json::json!({"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": format!("rank {}", self.rank)}}));
        for t in [Track::Compute, Track::Gradients, Track::Comm, Track::Data, Track::Device, Track::DeviceComm, Track::DeviceCopy] {
            all.push(serde_json::json!({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": t as usize, "args": {"name": t.name()}}));
        }
        for e in &self.events {
            all.push(serde_json::to_value(e).map_err(std::io::Error::other)?);
        }
        let bytes = serde_json::to_vec(&serde_json::json!({ "traceEvents": all, "displayTimeUnit": "ms" })).map_err(std::io::Error::other)?;
        let path = path(dir, self.rank);
        crate::util::write_atomic(&path, &bytes)?;
        Ok(path)
    }
}

/// The trace file of `rank` in `dir`.
pub fn path(dir: &Path, rank: usize) -> std::path::PathBuf {
    dir.join(format!("trace-rank{rank}.json"))
}

/// Refuses a `dir` that already holds `rank`'s trace (an earlier run's), naming the file, as a
/// run directory that holds a run is refused.
pub fn check_fresh(dir: &Path, rank: usize) -> std::io::Result<()> {
    let p = path(dir, rank);
    if p.exists() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("{} already holds a trace (an earlier run's): choose another --trace directory, or remove the file", p.display()),
        ));
    }
    Ok(())
}
