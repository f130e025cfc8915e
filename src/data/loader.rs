//! A prefetching loader: builds one rank's micro-batches ahead of the training step on its own
//! thread pool, so decoding and augmentation overlap the forward/backward.
//!
//! One producer thread walks the plan (epoch, step, micro-batch) in order and fills batches on a
//! private rayon pool of `data.num_workers` threads (0 = all cores); finished batches wait in a
//! bounded queue of `data.prefetch` entries, so memory stays fixed and a slow consumer stalls
//! the producer rather than piling up batches. Buffers come back through [`Loader::recycle`] and
//! are refilled in place. Batches are bit-identical to [`super::try_make_batch`] on the same
//! indices: the producer only changes *when* a batch is built, never *what* it holds.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::{fill_batch, shard, Batch, DataError, ImageSet, Sampler};
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
    handle: Option<JoinHandle<()>>,
}

impl Loader {
    /// Starts the producer. Fails only if the worker pool cannot be created.
    pub fn start(plan: LoaderPlan) -> Result<Loader, DataError> {
        let workers = if plan.cfg.num_workers == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        } else {
            plan.cfg.num_workers
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(workers)
            .thread_name(|i| format!("vitscale-data-{i}"))
            .build()
            .map_err(|e| DataError::Invalid { key: "data.num_workers", msg: format!("cannot start {workers} loader threads: {e}") })?;
        let (tx, rx) = sync_channel(plan.cfg.prefetch.max(1));
        let (recycle_tx, recycle_rx) = channel::<Batch>();
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let handle = std::thread::Builder::new()
            .name("vitscale-data".into())
            .spawn(move || {
                let steps_per_epoch = plan.sampler.steps_per_epoch();
                if steps_per_epoch == 0 {
                    return;
                }
                let (mut epoch, mut step) = (plan.start_epoch, plan.start_step);
                // Normalize a start step past the end of its epoch.
                epoch += (step / steps_per_epoch) as u64;
                step %= steps_per_epoch;
                let mut order = plan.sampler.epoch(epoch);
                for _ in 0..plan.steps {
                    for micro in 0..plan.gas {
                        if stop2.load(Ordering::Relaxed) {
                            return;
                        }
                        let idx = shard(order.batch(step), plan.rank, plan.world, micro, plan.gas);
                        let mut batch = recycle_rx.try_recv().unwrap_or_default();
                        let r = pool.install(|| fill_batch(&mut batch, &plan.set, idx, &plan.cfg, plan.train, epoch, plan.seed));
                        let msg = r.map(|()| Prepared { epoch, step, micro, batch });
                        let failed = msg.is_err();
                        // A closed queue means the loader was dropped: just stop.
                        if tx.send(msg).is_err() || failed {
                            return;
                        }
                    }
                    step += 1;
                    if step == steps_per_epoch {
                        step = 0;
                        epoch += 1;
                        order = plan.sampler.epoch(epoch);
                    }
                }
            })
            .map_err(|e| DataError::Invalid { key: "data.num_workers", msg: format!("cannot start the loader thread: {e}") })?;
        Ok(Loader { rx: Some(rx), recycle_tx, stop, handle: Some(handle) })
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
        // Closing the queue unblocks a producer waiting to send.
        drop(self.rx.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
