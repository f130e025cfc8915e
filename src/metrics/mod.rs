//! Step metrics: wall-clock phase timers, the run directory's `metrics.jsonl` writer and
//! DeepSpeed's monitors (`monitor`: TensorBoard event files via `tfevents`, CSV files). The
//! scaling lab reads only what is written here.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::Instant;

use serde::Serialize;

pub mod monitor;
pub mod tfevents;
pub mod trace;

/// Seconds spent in each phase of the optimizer steps since the last reset.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct PhaseTimes {
    /// Data: from the previous phase's end until the inputs are on the device (the wait for the
    /// loader, which builds batches ahead on its own threads, and the host→device copy).
    pub data_s: f64,
    pub forward_s: f64,
    pub backward_s: f64,
    /// Exposed communication: the time the step waited after its backward for gradient
    /// buckets still being reduced (on a GPU, the compute stream waiting for the
    /// communication stream).
    pub comm_s: f64,
    /// Norm, clipping, the optimizer update (and on CPU ranks under ZeRO the weights' gather).
    pub optimizer_s: f64,
}

impl PhaseTimes {
    pub fn total(&self) -> f64 {
        self.data_s + self.forward_s + self.backward_s + self.comm_s + self.optimizer_s
    }
}

/// Times a closure and adds the seconds to `slot`.
pub fn timed<T>(slot: &mut f64, f: impl FnOnce() -> T) -> T {
    let t = Instant::now();
    let out = f();
    *slot += t.elapsed().as_secs_f64();
    out
}

/// One line of `metrics.jsonl`.
#[derive(Clone, Debug, Serialize)]
pub struct StepRecord {
    pub step: u64,
    pub epoch: u64,
    pub lr: f64,
    /// Mean training loss over the steps since the previous record.
    pub loss: f64,
    pub grad_norm: f64,
    /// Global images per second over the steps since the previous record.
    pub images_per_s: f64,
    pub images_per_s_per_rank: f64,
    /// Model FLOPs utilization per device: the images/s per rank × the model's training FLOPs
    /// per image against the device's measured dense matrix rate (bench's); absent on the CPU.
    pub mfu: Option<f64>,
    /// The window's phases on the device timeline (`train::timeline`), summed over its steps.
    #[serde(flatten)]
    pub phases: PhaseTimes,
    /// The step's bookkeeping (stop flags, losses read back, the metrics line), the last phase.
    pub other_s: f64,
    /// The phases added up: the window's steps on the device timeline; absent when the
    /// timeline is off.
    pub timed_s: Option<f64>,
    /// Wall seconds the window trained (its steps' images / `images_per_s`), beside `timed_s`.
    pub train_s: f64,
    /// Optimizer steps in the window.
    pub steps: u64,
    pub rank: usize,
    /// Seconds the gradient buckets' reductions took, from each one's start to its completion,
    /// summed: overlapped with the backward or not (`comm_s` is the part that was not).
    pub comm_total_s: f64,
    /// Share of that time hidden behind the backward: 1 − exposed / total (absent on one rank).
    pub comm_overlap: Option<f64>,
    /// Bytes of gradients this rank all-reduced since the previous record.
    pub comm_bytes: u64,
    /// Bus bandwidth of those all-reduces in GB/s, by NCCL-tests' convention
    /// (bytes · 2(W−1)/W / time), over `comm_total_s`; absent on one rank.
    pub bus_gb_s: Option<f64>,
    /// Peak memory of this rank so far (`peak_memory`), and what it counts.
    pub peak_mem_bytes: Option<u64>,
    pub peak_mem_source: Option<&'static str>,
    /// Seconds spent since the previous record on checking that the ranks hold the same state
    /// and writing checkpoints; not part of `images_per_s`.
    pub checkpoint_s: f64,
    /// Seconds spent evaluating since the previous record (the evaluation after a logged step
    /// lands in the next record); not part of `images_per_s`.
    pub eval_s: f64,
    pub wall_s: f64,
    /// Compute, wait, share and straggler effect of mixed-speed ranks (`train::balance`),
    /// present when `train.balance` or `train.emulate_slowdown` is set.
    #[serde(flatten)]
    pub balance: Option<BalanceRecord>,
    /// fp16 runs (`train::loss_scale`): the loss scale after the record's last step, and the
    /// optimizer steps skipped for overflowing gradients since the run began (DeepSpeed's
    /// `skipped_steps`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u64>,
}

/// Per-rank balance metrics over the steps since the previous record, flattened into the
/// `metrics.jsonl` line when a balance (`train::balance`) or an emulation is configured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BalanceRecord {
    /// Seconds this rank computed: the passes of its micro-batches, emulated slowdown included.
    pub compute_s: f64,
    /// The part of `compute_s` that the emulated slowdown added.
    pub emulated_s: f64,
    /// Seconds this rank waited at the gradient synchronization (from its last backward to
    /// the reduced gradients): the other ranks' lateness plus the exposed communication.
    pub wait_s: f64,
    /// This rank's share of the global batch and its micro-batch, at the last step.
    pub share: f64,
    pub micro_batch: usize,
    /// Straggler effect, summed over the steps: Σ over ranks of (wait − the least wait of any
    /// rank), as DeepSpeed's comms logger defines it (each rank's latency of the operation
    /// minus the fastest rank's); absent on one rank.
    pub straggler_s: Option<f64>,
    /// Each rank's own speed over these steps: its images / its own step time, the wall time
    /// from the previous step's end to this one's less what it waited for ranks later than
    /// the least-waiting one (so data, the exposed communication and the update, which every
    /// rank pays, are in it).
    pub rank_images_per_s: Vec<f64>,
    /// The sum of those speeds: what the ranks would train if none waited for another.
    pub ideal_images_per_s: f64,
    /// Each rank's images / its compute seconds (forward and backward alone): the speeds
    /// `auto` balances.
    pub rank_compute_images_per_s: Vec<f64>,
}


/// This rank's peak memory so far: the backend's own count (device memory on a GPU), else the
/// process's peak resident set (the CPU backend's buffers live in it).
pub fn peak_memory<B: crate::backend::Backend>(be: &B) -> (Option<u64>, Option<&'static str>) {
    match be.peak_memory() {
        Some((b, what)) => (Some(b), Some(what)),
        None => match host_peak_rss() {
            Some(b) => (Some(b), Some("peak resident set of the rank's process")),
            None => (None, None),
        },
    }
}

/// The process's peak resident set in bytes (`getrusage`; Linux reports KiB).
pub fn host_peak_rss() -> Option<u64> {
    // SAFETY: rusage is a plain C struct, valid when zeroed.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes the struct it is given.
    let r = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    (r == 0 && ru.ru_maxrss > 0).then(|| ru.ru_maxrss as u64 * 1024)
}

/// NCCL-tests' bus bandwidth of an all-reduce of `bytes` over `world` ranks taking `secs`.
pub fn allreduce_bus_gb_s(bytes: u64, world: usize, secs: f64) -> Option<f64> {
    (world > 1 && secs > 0.0).then(|| bytes as f64 * 2.0 * (world - 1) as f64 / world as f64 / secs / 1e9)
}

/// An evaluation result line of `metrics.jsonl` (`"kind": "eval"`).
#[derive(Clone, Debug, Serialize)]
pub struct EvalRecord {
    pub kind: &'static str,
    pub step: u64,
    pub epoch: u64,
    pub val_loss: f64,
    pub val_top1: f64,
    pub images: usize,
    /// The weight EMA's figures on the same images (`train.ema`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ema_val_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ema_val_top1: Option<f64>,
}

/// Appends JSON lines to a file, flushing each so a killed run keeps its history.
pub struct JsonlWriter {
    out: BufWriter<File>,
}

impl JsonlWriter {
    pub fn create(path: &Path) -> std::io::Result<Self> {
        Ok(JsonlWriter { out: BufWriter::new(File::create(path)?) })
    }
    /// Opens `path` for appending (created if missing): a resumed run keeps its history.
    pub fn append(path: &Path) -> std::io::Result<Self> {
        let f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(JsonlWriter { out: BufWriter::new(f) })
    }
    pub fn write<T: Serialize>(&mut self, record: &T) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.out, record).map_err(std::io::Error::other)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }
}
