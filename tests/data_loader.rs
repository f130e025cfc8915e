//! The loader works ahead: while the consumer is busy (the training step), the next batches are
//! built, so taking them costs no waiting. Also covers evaluation plans (no shuffle, a short
//! last batch spread over ranks).

use std::time::{Duration, Instant};

use vitscale::config::{DataConfig, DatasetKind};
use vitscale::data::{make_batch, open, shard, Loader, LoaderPlan, Sampler};

fn cfg() -> DataConfig {
    DataConfig {
        num_workers: 1,
        train_size: 2000,
        val_size: 250,
        prefetch: 3,
        ..DataConfig::for_dataset(DatasetKind::Builtin, None, [0.5; 3], [0.5; 3])
    }
}

#[test]
fn batches_are_ready_after_the_consumer_was_busy() {
    let c = cfg();
    let d = open(&c, 32, 10, 0).unwrap();
    let plan = LoaderPlan {
        sampler: Sampler::new(d.train.len(), 64, true, 0, true),
        set: d.train.clone(),
        cfg: c.clone(),
        train: true,
        seed: 0,
        rank: 0,
        world: 1,
        gas: 1,
        start_epoch: 0,
        start_step: 0,
        steps: 20,
        mix: None,
    };
    let mut loader = Loader::start(plan).unwrap();
    let first = loader.next().unwrap().unwrap();
    // A "training step" long enough for the producer to fill the queue.
    std::thread::sleep(Duration::from_millis(400));
    let t = Instant::now();
    for _ in 0..3 {
        let p = loader.next().unwrap().unwrap();
        loader.recycle(p.batch);
    }
    let waited = t.elapsed();
    // Building three 64-image batches takes a few ms; generous bound for a loaded machine.
    assert!(waited < Duration::from_millis(150), "waited {waited:?} for prefetched batches");
    loader.recycle(first.batch);
}

#[test]
fn eval_plan_covers_the_split_once() {
    let c = cfg();
    let d = open(&c, 16, 10, 0).unwrap(); // 250 val images, global batch 64: 4 steps, last 58
    let sampler = Sampler::new(d.val.len(), 64, false, 0, false);
    let mut seen = Vec::new();
    for rank in 0..3 {
        let plan = LoaderPlan {
            sampler: sampler.clone(),
            set: d.val.clone(),
            cfg: c.clone(),
            train: false,
            seed: 0,
            rank,
            world: 3,
            gas: 2,
            start_epoch: 0,
            start_step: 0,
            steps: sampler.steps_per_epoch() as u64,
            mix: None,
        };
        for p in Loader::start(plan).unwrap() {
            let p = p.unwrap();
            let idx = shard(sampler.epoch(0).batch(p.step), rank, 3, p.micro, 2).to_vec();
            assert_eq!(p.batch, make_batch(&d.val, &idx, &c, false, 0, 0));
            seen.extend(idx);
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..250).collect::<Vec<_>>());
}
