//! A prefetching loader: builds one rank's micro-batches ahead of the training step on its own
//! thread pool, so decoding and augmentation overlap the forward/backward.
//!
//! One producer thread walks the plan (epoch, step, micro-batch) in order and fills the next
//! `data.prefetch` batches together on a private rayon pool of `data.num_workers` threads
//! (0 = all cores) — one parallel pass over all their images, so no thread idles at a per-batch
//! barrier; finished batches wait in a bounded queue of `data.prefetch` entries, so memory stays
//! fixed (at most about 3 × prefetch batches live) and a slow consumer stalls the producer
//! rather than piling up batches. Buffers come back through [`Loader::recycle`] and
//! are refilled in place. Batches are bit-identical to [`super::try_make_batch`] on the same
//! indices: the producer only changes *when* a batch is built, never *what* it holds.
//! [`Loader::start`] walks a sampler's plan (training); [`Loader::start_batches`] a given list
//! of index batches (evaluation). A training plan runs on across epoch boundaries (each
//! epoch's order comes from the seed), so the next epoch's first batches are built while the
//! current epoch's last ones still wait to be taken: the queue never drains at a boundary.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::split::SplitSchedule;
use super::{fill_batches, mix, shard, shard_sized, Batch, DataError, ImageSet, Sampler};
use crate::config::DataConfig;

/// What one rank's loader produces: `steps` global steps from (`start_epoch`, `start_step`),
/// each as `gas` micro-batches of this rank's shard.
#[derive(Clone, Debug)]
pub struct LoaderPlan {
    pub set: Arc<ImageSet>,
    pub cfg: DataConfig,
    pub sampler: Sampler,
    /// Training batches (augmented) or evaluation batches.
    pub train: bool,
    pub seed: u64,
    pub rank: usize,
    pub world: usize,
    pub gas: usize,
    pub start_epoch: u64,
    pub start_step: usize,
    /// Global steps to produce in total (they run on into later epochs).
    pub steps: u64,
    /// Soft targets for training batches when `cfg.aug` asks for mixup / CutMix: the class
    /// count and the label smoothing folded into them. `None`: no mixing.
    pub mix: Option<MixTargets>,
}

/// What mixed targets need besides the data config.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MixTargets {
    pub num_classes: usize,
    pub label_smoothing: f32,
}

/// One micro-batch and where it belongs.
#[derive(Debug)]
pub struct Prepared {
    pub epoch: u64,
    pub step: usize,
    pub micro: usize,
    pub batch: Batch,
}

pub struct Loader {
    rx: Option<Receiver<Result<Prepared, DataError>>>,
    recycle_tx: Sender<Batch>,
    stop: Arc<AtomicBool>,
    /// Micro-batches the producer has built (taken or not).
    built: Arc<AtomicU64>,
    handle: Option<JoinHandle<()>>,
    /// The split the producer reads, closed on drop so a producer waiting on it ends.
    split: Option<Arc<SplitSchedule>>,
}

/// One micro-batch to build: (epoch, step, micro, dataset indices).
type Position = (u64, usize, usize, Vec<usize>);

impl Loader {
    /// Starts the producer. Fails only if the worker pool cannot be created.
    pub fn start(plan: LoaderPlan) -> Result<Loader, DataError> {
        Self::start_split(plan, None)
    }

    /// [`Loader::start`] with each global step cut over the ranks as `split` says for that
    /// step (`shard_sized`) instead of equally; the producer waits for steps not yet decided.
    pub fn start_split(plan: LoaderPlan, split: Option<Arc<SplitSchedule>>) -> Result<Loader, DataError> {
        let sizes = split.clone();
        let LoaderPlan { set, cfg, sampler, train, seed, rank, world, gas, start_epoch, start_step, steps, mix } = plan;
        // Plan order as (epoch, step, micro, indices), built lazily on the producer thread.
        let positions = move || -> Box<dyn Iterator<Item = Position>> {
            let steps_per_epoch = sampler.steps_per_epoch();
            if steps_per_epoch == 0 {
                return Box::new(std::iter::empty());
            }
            let (mut epoch, mut step) = (start_epoch, start_step);
            epoch += (step / steps_per_epoch) as u64;
            step %= steps_per_epoch;
            let mut order = sampler.epoch(epoch);
            let total = steps as usize * gas;
            Box::new((0..total).map_while(move |k| {
                let micro = k % gas;
                if k > 0 && micro == 0 {
                    step += 1;
                    if step == steps_per_epoch {
                        step = 0;
                        epoch += 1;
                        order = sampler.epoch(epoch);
                    }
                }
                let idx = match &sizes {
                    None => shard(order.batch(step), rank, world, micro, gas).to_vec(),
                    // None: the schedule was closed (the loader is being dropped)
                    Some(s) => shard_sized(order.batch(step), &s.sizes_at(epoch * steps_per_epoch as u64 + step as u64)?, rank, micro, gas).to_vec(),
                };
                Some((epoch, step, micro, idx))
            }))
        };
        let mut loader = Self::spawn(set, cfg, train, seed, mix, positions)?;
        loader.split = split;
        Ok(loader)
    }

    /// Starts a producer of the given batches of dataset indices, in order, without mixing:
    /// `batches[i]` comes out as step `i` (micro 0) of `epoch`. Evaluation uses it for the
    /// batches each rank runs.
    pub fn start_batches(set: Arc<ImageSet>, cfg: DataConfig, train: bool, epoch: u64, seed: u64, batches: Vec<Vec<usize>>) -> Result<Loader, DataError> {
        Self::spawn(set, cfg, train, seed, None, move || batches.into_iter().enumerate().map(move |(step, idx)| (epoch, step, 0, idx)))
    }

    fn spawn<I: Iterator<Item = Position>>(
        set: Arc<ImageSet>,
        cfg: DataConfig,
        train: bool,
        seed: u64,
        mix: Option<MixTargets>,
        positions: impl FnOnce() -> I + Send + 'static,
    ) -> Result<Loader, DataError> {
        let workers = if cfg.num_workers == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { cfg.num_workers };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(workers)
            .thread_name(|i| format!("vitscale-data-{i}"))
            .build()
            .map_err(|e| DataError::Invalid { key: "data.num_workers", msg: format!("cannot start {workers} loader threads: {e}") })?;
        let (tx, rx) = sync_channel(cfg.prefetch.max(1));
        let (recycle_tx, recycle_rx) = channel::<Batch>();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let built = Arc::new(AtomicU64::new(0));
        let built2 = built.clone();
        let handle = std::thread::Builder::new()
            .name("vitscale-data".into())
            .spawn(move || {
                let mut positions = positions();
                // Build the prefetch window in one parallel pass, then hand it out in order.
                let window = cfg.prefetch.max(1);
                loop {
                    let group: Vec<Position> = positions.by_ref().take(window).collect();
                    if group.is_empty() || stop2.load(Ordering::Relaxed) {
                        return;
                    }
                    let mut batches: Vec<Batch> = group.iter().map(|_| recycle_rx.try_recv().unwrap_or_default()).collect();
                    let jobs: Vec<(&[usize], u64)> = group.iter().map(|(e, _, _, idx)| (idx.as_slice(), *e)).collect();
                    if let Err(e) = pool.install(|| fill_batches(&mut batches, &jobs, &set, &cfg, train, seed)) {
                        let _ = tx.send(Err(e));
                        return;
                    }
                    // Mixup / CutMix: drawn per global step (per pair / image in those modes),
                    // applied to this rank's slice.
                    if let Some(mt) = mix.filter(|_| train && cfg.aug.mixes()) {
                        let side = set.batch_side;
                        pool.install(|| {
                            use rayon::prelude::*;
                            batches.par_iter_mut().zip(group.par_iter()).for_each(|(batch, (epoch, step, _, idx))| {
                                mix::mix_batch(batch, idx, &cfg.aug, seed, *epoch, *step, side, mt.num_classes, mt.label_smoothing);
                            })
                        });
                    }
                    built2.fetch_add(group.len() as u64, Ordering::Relaxed);
                    for ((epoch, step, micro, _), batch) in group.into_iter().zip(batches) {
                        // A closed queue means the loader was dropped: just stop.
                        if tx.send(Ok(Prepared { epoch, step, micro, batch })).is_err() {
                            return;
                        }
                    }
                }
            })
            .map_err(|e| DataError::Invalid { key: "data.num_workers", msg: format!("cannot start the loader thread: {e}") })?;
        Ok(Loader { rx: Some(rx), recycle_tx, stop, built, handle: Some(handle), split: None })
    }

    /// Micro-batches built so far, whether taken or still queued: how far the producer has
    /// got along the plan (it runs on across epoch boundaries).
    pub fn built(&self) -> u64 {
        self.built.load(Ordering::Relaxed)
    }

    /// Gives a consumed batch's buffers back for reuse.
    pub fn recycle(&self, batch: Batch) {
        // The producer may have finished; then the buffers are simply dropped.
        let _ = self.recycle_tx.send(batch);
    }
}

impl Iterator for Loader {
    type Item = Result<Prepared, DataError>;

    /// The next micro-batch in plan order (blocking until it is ready); `None` at the end of the
    /// plan or after an error was returned.
    fn next(&mut self) -> Option<Self::Item> {
        self.rx.as_ref()?.recv().ok()
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(s) = &self.split {
            s.close();
        }
        // Closing the queue unblocks a producer waiting to send.
        drop(self.rx.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
