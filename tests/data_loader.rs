//! The loader works ahead: while the consumer is busy (the training step), the next batches are
//! built, so taking them costs no waiting. Also covers evaluation plans (no shuffle, a short
//! last batch spread over ranks), mixing in every `data.mixup_mode` across ranks, and
//! evaluation through the loader.

use std::time::{Duration, Instant};

use vitscale::backend::cpu::Cpu;
use vitscale::config::{self, DataConfig, DatasetKind, MixMode};
use vitscale::data::{fill_batch, make_batch, open, shard, Batch, Loader, LoaderPlan, MixTargets, Sampler};
use vitscale::model::smoothed_targets;
use vitscale::train::evaluate;

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
    // 224-px images, so that building a batch (tens of ms) is far from taking a ready one (a
    // channel receive, microseconds), even on a loaded machine; at 32 px both take a few ms.
    let c = DataConfig { train_size: 192, val_size: 64, ..cfg() };
    let d = open(&c, 224, 10, 0).unwrap();
    // What building one batch costs the loader's one worker here and now: the slowest of three
    // refills of a batch whose buffers are already allocated, as the loader's recycled ones are.
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let mut scratch = Batch::default();
    let per_batch = (0..4)
        .map(|k| {
            let idx: Vec<usize> = (40 * k..40 * k + 64).collect();
            let t = Instant::now();
            one.install(|| fill_batch(&mut scratch, &d.train, &idx, &c, true, 0, 0)).unwrap();
            t.elapsed()
        })
        .skip(1)
        .max()
        .unwrap();
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
    // A "training step" long enough for the producer to fill its queue of 3: twenty batch
    // builds, so a producer that gets a sixth of a core on a loaded machine still finishes.
    std::thread::sleep((per_batch * 20).max(Duration::from_millis(400)));
    let t = Instant::now();
    for _ in 0..3 {
        let p = loader.next().unwrap().unwrap();
        loader.recycle(p.batch);
    }
    let waited = t.elapsed();
    // Without prefetching, at least two of the three are built while we wait (≥ 2 ×
    // `per_batch`); ready ones take microseconds. One `per_batch` as the bound leaves the
    // consumer room to be descheduled a few times: on 2 cores at a load average of 10,
    // `per_batch` was 16–83 ms, this loader waited 2–6 ms, and one changed to build on demand
    // (queue of 0, window of 1) 80–100 ms.
    assert!(waited < per_batch, "waited {waited:?} for prefetched batches; building one takes {per_batch:?}");
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

/// Mixup / CutMix in every mode: 2 ranks × 2 micro-batches concatenated give exactly the
/// 1-rank batches (pixels and soft targets), since pairs never straddle a shard and the
/// per-pair / per-image draws are keyed by dataset index.
#[test]
fn mixed_batches_do_not_depend_on_the_rank_split() {
    let mut c = cfg();
    c.aug.mixup = 0.8;
    c.aug.cutmix = 1.0;
    c.aug.mixup_prob = 0.8;
    let d = open(&c, 16, 10, 0).unwrap();
    let sampler = Sampler::new(d.train.len(), 16, true, 2, true);
    let mut per_mode = Vec::new();
    for mode in [MixMode::Batch, MixMode::Pair, MixMode::Elem] {
        c.aug.mixup_mode = mode;
        let run = |rank: usize, world: usize, gas: usize| -> Vec<(Vec<f32>, Vec<f32>)> {
            let plan = LoaderPlan {
                sampler: sampler.clone(),
                set: d.train.clone(),
                cfg: c.clone(),
                train: true,
                seed: 4,
                rank,
                world,
                gas,
                start_epoch: 0,
                start_step: 120,
                steps: 6,
                mix: Some(MixTargets { num_classes: 10, label_smoothing: 0.1 }),
            };
            Loader::start(plan).unwrap().map(|p| p.unwrap().batch).map(|b| (b.images, b.targets.unwrap())).collect()
        };
        let one = run(0, 1, 1);
        assert_eq!(one.len(), 6);
        let parts: Vec<Vec<(Vec<f32>, Vec<f32>)>> = (0..2).map(|r| run(r, 2, 2)).collect();
        for (step, (images, targets)) in one.iter().enumerate() {
            let (mut im, mut tg) = (Vec::new(), Vec::new());
            for part in &parts {
                for micro in 0..2 {
                    im.extend_from_slice(&part[step * 2 + micro].0);
                    tg.extend_from_slice(&part[step * 2 + micro].1);
                }
            }
            assert!(im == *images && tg == *targets, "{mode:?} step {step}");
        }
        per_mode.push(one);
    }
    // The modes really differ.
    assert_ne!(per_mode[0], per_mode[1]);
    assert_ne!(per_mode[1], per_mode[2]);
}

/// Evaluation runs on batches the loader builds ahead; the result is bit-identical to building
/// each batch synchronously before its forward (what evaluation did before), whatever
/// `data.num_workers` and `data.prefetch` are, including a short last batch.
#[test]
fn evaluation_through_the_loader_matches_synchronous_batches() {
    let v = serde_json::json!({
        "train_micro_batch_size_per_gpu": 8,
        "data": {"train_size": 40, "val_size": 203},
        "train": {"steps": 1, "seed": 3, "eval_batch_size": 24}
    });
    let base = config::resolve(&v, 1).unwrap();
    let be = Cpu::new();
    let mut vit = evaluate::build_model(&be, &base, None).unwrap();
    let sets = open(&base.data, base.model.image_size, base.model.num_classes, base.train.seed).unwrap();
    let k = base.model.num_classes;
    let (mut loss, mut correct) = (0f64, 0usize);
    for start in (0..203).step_by(24) {
        let idx: Vec<usize> = (start..(start + 24).min(203)).collect();
        let b = make_batch(&sets.val, &idx, &base.data, false, 0, base.train.seed);
        let out = vit.forward(&be, &b.images, &smoothed_targets(&b.labels, k, 0.0), b.len(), None).unwrap();
        loss += out.losses.iter().map(|&v| v as f64).sum::<f64>();
        for (row, &label) in out.logits.chunks(k).zip(&b.labels) {
            let pred = row.iter().enumerate().fold(0, |best, (j, v)| if *v > row[best] { j } else { best });
            correct += usize::from(pred == label as usize);
        }
    }
    let (loss, top1) = (loss / 203.0, correct as f64 / 203.0);
    for (workers, prefetch) in [(0, 2), (1, 1), (1, 4), (3, 1), (4, 3)] {
        let mut c = base.clone();
        c.data.num_workers = workers;
        c.data.prefetch = prefetch;
        let ev = evaluate::evaluate(&be, &mut vit, &sets.val, &c, 24).unwrap();
        assert_eq!((ev.loss.to_bits(), ev.top1.to_bits(), ev.images), (loss.to_bits(), top1.to_bits(), 203), "workers {workers} prefetch {prefetch}");
    }
    // Started ahead, as the trainer starts it before the step an evaluation follows: its first
    // batches are built before the evaluation begins, and the result is the same.
    let loader = evaluate::eval_loader(&sets.val, &base, 24, 0, 1).unwrap();
    let t = Instant::now();
    while loader.built() < base.data.prefetch as u64 {
        assert!(t.elapsed() < Duration::from_secs(60), "the evaluation loader built nothing ahead");
        std::thread::sleep(Duration::from_millis(5));
    }
    let ev = evaluate::evaluate_from(&be, &mut vit, 203, loader, &mut vitscale::comm::SingleComm::new()).unwrap();
    assert_eq!((ev.loss.to_bits(), ev.top1.to_bits(), ev.images), (loss.to_bits(), top1.to_bits(), 203), "started ahead");
}

/// The loader does not drain at an epoch boundary: epoch e+1's first micro-batches are built
/// while epoch e's last one still waits to be taken (the next epoch's order is known from the
/// seed), and the batches are the ones built on demand.
#[test]
fn prefetch_crosses_the_epoch_boundary() {
    let c = DataConfig { train_size: 40, val_size: 8, prefetch: 2, ..cfg() };
    let d = open(&c, 32, 10, 0).unwrap();
    let sampler = Sampler::new(d.train.len(), 8, true, 3, true); // 5 steps per epoch
    let plan = LoaderPlan {
        sampler: sampler.clone(),
        set: d.train.clone(),
        cfg: c.clone(),
        train: true,
        seed: 3,
        rank: 0,
        world: 1,
        gas: 1,
        start_epoch: 0,
        start_step: 0,
        steps: 10,
        mix: None,
    };
    let mut loader = Loader::start(plan).unwrap();
    // Take all but epoch 0's last batch.
    for step in 0..4 {
        let p = loader.next().unwrap().unwrap();
        assert_eq!((p.epoch, p.step), (0, step));
        loader.recycle(p.batch);
    }
    // Without taking it, wait for the producer to have built epoch 1's first batch (6 in all).
    let t = Instant::now();
    while loader.built() < 6 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "epoch 1's first batch was not built while epoch 0's last waited to be taken ({} built)",
            loader.built()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    for (epoch, step) in [(0u64, 4usize), (1, 0), (1, 1)] {
        let p = loader.next().unwrap().unwrap();
        assert_eq!((p.epoch, p.step), (epoch, step));
        assert_eq!(p.batch, make_batch(&d.train, &sampler.global_batch(epoch, step), &c, true, epoch, 3));
    }
}
