//! ZeRO stage 3 (partitioned weights) on CPU ranks: 2 and 4 ranks equal one process with the
//! same global batch (GAS 4, gradient clipping, SGD with momentum and AdamW), and stage 0 at
//! the same world size; the gathered optimizer state a checkpoint holds is stage 0's; the
//! prefetch changes nothing but when the weights travel; checkpoints resume between stage 3
//! and stage 0 at other world sizes; the weight EMA follows the partitioned weights; each
//! rank holds its share of the weights, optimizer state and the resident groups and gather
//! slots, as predicted.
//!
//! Stage 3 with sequence parallelism is tested with the other layouts in
//! `tests/sequence_parallel.rs`.
//!
//! Runs are the tiny ones of `dist_zero.rs` (default model, 16-px built-in images, 4 steps of
//! 32 images), with `stage3_param_persistence_threshold = 0` so every block is partitioned
//! (the default model's blocks are below DeepSpeed's default threshold).

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::{max_rel_diff, train_at_stage, zero_run_args, ADAMW, CLIP, SGD, max_rel_diff_files, metrics, read_json, tmp};

/// Same world size, stage 3 against stage 0 (and stage 2, and one process at stage 3 against
/// stage 0): the same per-element update from gradients summed in another order. Stage 3
/// partitions the gradients, so with GAS 4 each micro-batch's gradients are summed over the
/// ranks first (reduce-scattered every pass) and then over the micro-batches (added into the
/// rank's partitioned gradients), where stages 0–2 sum over the micro-batches first (the
/// backward's kernels accumulating into a whole buffer) and over the ranks at the boundary.
/// Each order rounds each sum of GAS·N terms differently, a few f32 ulps of the gradient; the
/// measured weight differences after 4 steps (relative to 1 + |w|) are listed at the tests.
/// SGD passes them on as they are; AdamW (m/√v) amplifies them on near-zero gradients. With
/// GAS 1 there is one order again: stage 3 is stage 2 (same buckets) and one process at
/// stage 3 is stage 0 bit for bit (`gas_1_...` below).
const STAGE_TOL_SGD: f32 = 2e-8;
const STAGE_TOL_ADAM: f32 = 2e-6;
/// Against one process with the same global batch (as `dist_zero.rs`): per-sample gradients
/// summed in another order.
const SPLIT_TOL_SGD: f32 = 1e-6;
const SPLIT_TOL_ADAM: f32 = 3e-5;

const PARTITION_ALL: &str = "--set=zero_optimization.stage3_param_persistence_threshold=0";

fn common(steps: u64) -> Vec<String> {
    let mut args = zero_run_args(steps);
    // 5 evaluation batches of 200 images: the ranks run different numbers of them
    args.push("--set=train.eval_batch_size=48".into());
    args
}

fn train(nproc: usize, stage: u8, steps: u64, extra: &[&str], dir: &Path) -> Output {
    train_at_stage(nproc, stage, common(steps), extra, dir)
}

/// The default model's stage-3 layout at `world` ranks: (groups with a tail, groups).
fn tails_at(world: usize) -> (usize, usize) {
    let m = vitscale::model::ModelConfig::preset("vit_builtin_default").expect("preset");
    let table = vitscale::model::ParamTable::new(&m);
    let groups = table.gradient_groups();
    (groups.iter().filter(|g| g.len % world != 0).count(), groups.len())
}

/// `reduce_bucket_size` 1: one bucket per parameter group, stage 3's buckets.
const GROUP_BUCKETS: &str = "--set=zero_optimization.reduce_bucket_size=1";

fn stage_3_equals_stage_0_and_one_process(opt: &str, stage_tol: f32, split_tol: f32) {
    // 4 ranks give groups whose length does not divide (uneven shards, replicated tails)
    assert!(tails_at(4).0 > 0, "no group of the default model has a tail at 4 ranks");
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    train(1, 0, 4, &[opt, CLIP], &p("one"));
    // one process at stage 3 (every gather the identity): stage 0 up to the order of the
    // micro-batches' sums (each pass's gradients added into the partitioned ones)
    train(1, 3, 4, &[opt, CLIP, PARTITION_ALL], &p("one_s3"));
    let d = max_rel_diff(&p("one_s3"), &p("one"));
    eprintln!("{opt}: one process stage 3 vs stage 0: {d:e}");
    assert!(d < stage_tol, "one process, stage 3 vs stage 0: {d:e}");
    let norms: Vec<f64> = metrics(&p("one"), None).iter().map(|r| r["grad_norm"].as_f64().unwrap_or(f64::NAN)).collect();
    assert!(norms.len() == 4 && norms.iter().all(|&n| n > 0.5), "gradient norms {norms:?} do not exceed the clip 0.05 by far");
    for world in [2usize, 4] {
        let (base, s2, name) = (format!("w{world}s0"), format!("w{world}s2"), format!("w{world}s3"));
        train(world, 0, 4, &[opt, CLIP], &p(&base));
        train(world, 2, 4, &[opt, CLIP, GROUP_BUCKETS], &p(&s2));
        train(world, 3, 4, &[opt, CLIP, PARTITION_ALL], &p(&name));
        let d0 = max_rel_diff(&p(&name), &p(&base));
        let d1 = max_rel_diff(&p(&name), &p("one"));
        let d2 = max_rel_diff(&p(&name), &p(&s2));
        eprintln!("{opt}: {world} ranks stage 3: vs stage 0 {d0:e}, vs 1 process {d1:e}, vs stage 2 with its buckets {d2:e}");
        assert!(d0 < stage_tol, "{world} ranks stage 3 vs stage 0: {d0:e}");
        assert!(d1 < split_tol, "{world} ranks stage 3 vs 1 process: {d1:e}");
        assert!(d2 < stage_tol, "{world} ranks stage 3 vs stage 2 with the same buckets: {d2:e}");
        let loss = |d: &Path| metrics(d, None).iter().map(|r| r["loss"].as_f64().unwrap_or(f64::NAN)).collect::<Vec<f64>>();
        for (a, b) in loss(&p(&name)).iter().zip(loss(&p("one"))) {
            assert!((a - b).abs() < 1e-5, "losses {a} vs {b}");
        }
        // the gathered optimizer state of the step-4 checkpoint is stage 0's
        let opt_file = |d: &str| p(d).join("checkpoints/step_000004/optimizer.safetensors");
        let ds = max_rel_diff_files(&opt_file(&name), &opt_file(&base));
        assert!(ds < stage_tol, "{world} ranks stage 3: optimizer state vs stage 0: {ds:e}");
        // the evaluation (the ranks run different numbers of batches) agrees with stage 0's
        let val = |d: &str| read_json(&p(d).join("summary.json"))["val_loss"].as_f64().unwrap_or(f64::NAN);
        assert!((val(&name) - val(&base)).abs() < 1e-6, "val_loss {} vs {}", val(&name), val(&base));
        let h0 = read_json(&p(&name).join("summary.json"))["weights_hash"].clone();
        for r in 1..world {
            assert_eq!(read_json(&p(&name).join(format!("rank{r}/summary.json")))["weights_hash"], h0, "rank {r}");
        }
    }
}

#[test]
fn sgd_stage_3_at_2_and_4_ranks_equals_stage_0_and_one_process_with_gas_and_clipping() {
    stage_3_equals_stage_0_and_one_process(SGD, STAGE_TOL_SGD, SPLIT_TOL_SGD);
}

#[test]
fn adamw_stage_3_at_2_and_4_ranks_equals_stage_0_and_one_process_with_gas_and_clipping() {
    stage_3_equals_stage_0_and_one_process(ADAMW, STAGE_TOL_ADAM, SPLIT_TOL_ADAM);
}

/// GAS 1: stage 3's per-pass reduction is stage 2's reduction of the same values (one bucket
/// per group, the same collectives), added to zeroed partitioned gradients: bit for bit. One
/// process at stage 3 is stage 0 bit for bit. AdamW, clipping on every step.
#[test]
fn gas_1_stage_3_equals_stage_2_and_one_process_stage_0_bit_for_bit() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    const GAS_1: &str = "--set=gradient_accumulation_steps=1";
    train(1, 0, 4, &[ADAMW, CLIP, GAS_1], &p("one"));
    train(1, 3, 4, &[ADAMW, CLIP, GAS_1, PARTITION_ALL], &p("one_s3"));
    assert_eq!(max_rel_diff(&p("one_s3"), &p("one")), 0.0, "one process, GAS 1, stage 3 vs stage 0");
    for world in [2usize, 4] {
        let (s2, s3) = (format!("w{world}s2"), format!("w{world}s3"));
        train(world, 2, 4, &[ADAMW, CLIP, GAS_1, GROUP_BUCKETS], &p(&s2));
        train(world, 3, 4, &[ADAMW, CLIP, GAS_1, PARTITION_ALL], &p(&s3));
        let d = max_rel_diff(&p(&s3), &p(&s2));
        eprintln!("GAS 1, {world} ranks: stage 3 vs stage 2 {d:e}");
        assert_eq!(d, 0.0, "GAS 1, {world} ranks: stage 3 vs stage 2 with the same buckets");
    }
}

#[test]
fn the_prefetch_and_the_persistence_rule_change_when_weights_travel_not_the_values() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    train(2, 3, 4, &[ADAMW, CLIP, PARTITION_ALL], &p("prefetch"));
    train(2, 3, 4, &[ADAMW, CLIP, PARTITION_ALL, "--set=zero_optimization.stage3_prefetch_bucket_size=0"], &p("no_prefetch"));
    // DeepSpeed's default threshold keeps every block of the default model whole
    train(2, 3, 4, &[ADAMW, CLIP], &p("resident"));
    for name in ["no_prefetch", "resident"] {
        let d = max_rel_diff(&p(name), &p("prefetch"));
        eprintln!("{name} vs prefetch: {d:e}");
        assert_eq!(d, 0.0, "{name}");
    }
}

#[test]
fn checkpoints_resume_between_stage_3_and_stage_0_across_world_sizes() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    let ck = |d: &str| p(d).join("checkpoints/step_000002").display().to_string();
    train(1, 0, 4, &[ADAMW, CLIP], &p("straight"));
    // 2 ranks at stage 3 stop at step 2; one process at stage 0 continues
    train(2, 3, 2, &[ADAMW, CLIP, PARTITION_ALL], &p("two_s3"));
    train(1, 0, 4, &[ADAMW, CLIP, "--resume", &ck("two_s3")], &p("two_to_one"));
    // one process's checkpoint continued by 4 ranks at stage 3; the stage-3 checkpoint by 4 ranks at stage 3
    train(4, 3, 4, &[ADAMW, CLIP, PARTITION_ALL, "--resume", &ck("straight")], &p("one_to_four_s3"));
    train(4, 3, 4, &[ADAMW, CLIP, PARTITION_ALL, "--resume", &ck("two_s3")], &p("two_to_four_s3"));
    for name in ["two_to_one", "one_to_four_s3", "two_to_four_s3"] {
        let d = max_rel_diff(&p(name), &p("straight"));
        eprintln!("resumed {name} vs straight: {d:e}");
        assert!(d < SPLIT_TOL_ADAM, "{name}: {d:e}");
    }
    assert_eq!(read_json(&p("two_s3").join("checkpoints/step_000002/state.json"))["zero_stage"], 3);
    // the stage-3 checkpoint holds the whole weights: the same file a stage-0 run writes
    let w = |d: &str| p(d).join("checkpoints/step_000002/model.safetensors");
    let d = max_rel_diff_files(&w("two_s3"), &w("straight"));
    assert!(d < SPLIT_TOL_ADAM, "step-2 weights: {d:e}");
}

#[test]
fn the_weight_ema_follows_the_partitioned_weights() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    let ema = "--set=train.ema={\"decay\":0.5}";
    // GAS 1: two ranks sum their gradients in one order at every stage, so stage 3's weights
    // are stage 0's bit for bit and the average must be too
    let gas_1 = "--set=gradient_accumulation_steps=1";
    train(2, 0, 4, &[ADAMW, CLIP, ema, gas_1], &p("s0"));
    train(2, 3, 4, &[ADAMW, CLIP, ema, gas_1, PARTITION_ALL], &p("s3"));
    assert_eq!(max_rel_diff(&p("s3"), &p("s0")), 0.0, "GAS 1, 2 ranks: stage 3 weights vs stage 0");
    let f = |d: &str| p(d).join("w_ema.safetensors");
    let d = max_rel_diff_files(&f("s3"), &f("s0"));
    eprintln!("EMA, 2 ranks stage 3 vs stage 0: {d:e}");
    assert_eq!(d, 0.0);
    let ev = |d: &str| read_json(&p(d).join("summary.json"))["ema_val_loss"].as_f64().unwrap_or(f64::NAN);
    assert!((ev("s3") - ev("s0")).abs() < 1e-9, "EMA val_loss {} vs {}", ev("s3"), ev("s0"));
}

/// Per rank, what the run accounted from its buffers against the prediction and against an
/// independent count from the parameter table: the weights are this rank's share of every
/// group (its shard plus the tails) plus the resident embedding and head plus two gather slots
/// of a block; the optimizer state is its share; the gradients are its share (partitioned as
/// the weights, the same pieces), plus a slot of the largest group. A deeper model than the
/// default so the share shows.
#[test]
fn each_rank_holds_its_share_of_the_weights_and_state_as_predicted() {
    let t = tmp();
    let p = |n: &str| -> PathBuf { t.path().join(n) };
    let deep = "--set=model.depth=12";
    let m = {
        let mut m = vitscale::model::ModelConfig::preset("vit_builtin_default").expect("preset");
        m.depth = 12;
        m
    };
    let table = vitscale::model::ParamTable::new(&m);
    let total = table.total as u64;
    let sum = |pred: &dyn Fn(&str) -> bool| -> u64 { table.entries.iter().filter(|e| pred(&e.name)).map(|e| e.span.len as u64).sum() };
    let block = sum(&|n| n.starts_with("blocks.0."));
    let embed = sum(&|n| ["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"].contains(&n));
    let head = sum(&|n| n.starts_with("norm.") || n.starts_with("fc_norm.") || n.starts_with("head."));
    assert_eq!(embed + head + 12 * block, total, "the independent count misses parameters");
    train(1, 0, 1, &[ADAMW, deep], &p("s0"));
    let s0 = read_json(&p("s0").join("config.json"))["memory"]["accounted"].clone();
    for world in [2u64, 4] {
        let name = format!("w{world}");
        train(world as usize, 3, 1, &[ADAMW, deep, PARTITION_ALL], &p(&name));
        let groups = 14u64;
        for r in 0..world {
            let dir = if r == 0 { p(&name) } else { p(&name).join(format!("rank{r}")) };
            let mem = metrics(&dir, Some("memory")).last().cloned().unwrap_or_else(|| panic!("rank {r}: no memory record"));
            let (acc, pred) = (&mem["accounted"], &mem["predicted"]);
            let get = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} missing"));
            // the share: total/N, up to the tails (fewer than N values a group, on every rank)
            let share_lo = total.div_ceil(world) - groups;
            let share_hi = total / world + groups * world;
            let weights = get(acc, "weights") / 4 - (embed + head + 2 * block);
            assert!(weights >= share_lo && weights <= share_hi, "rank {r} of {world}: {weights} own weights, share {}", total / world);
            let state = get(acc, "optimizer_state") / 8;
            assert!(state >= share_lo && state <= share_hi, "rank {r} of {world}: optimizer state of {state} values");
            // the partitioned gradients: exactly this rank's pieces of the weights, plus the slot
            assert_eq!(get(acc, "gradients"), 4 * (weights + block.max(embed).max(head)), "rank {r} of {world}: gradients");
            // against stage 0's whole buffer: the share
            assert!(get(acc, "gradients") * world <= get(&s0, "gradients") + 4 * (world * block.max(embed).max(head) + groups * world * world), "rank {r} of {world}: gradients vs stage 0");
            // the prediction is the same rule, up to the tails
            for k in ["weights", "optimizer_state", "gradients"] {
                let (a, b) = (get(acc, k) as f64, get(pred, k) as f64);
                assert!((a - b).abs() <= (8 * groups * world) as f64, "rank {r} of {world}: {k} accounted {a}, predicted {b}");
            }
            // against stage 0: the weights and the state shrink with the world size
            assert!(get(acc, "weights") < get(&s0, "weights") * 2 / world + 4 * (embed + head + 2 * block), "rank {r} of {world}: weights");
            assert!(get(acc, "optimizer_state") * world <= get(&s0, "optimizer_state") + 8 * groups * world * world, "rank {r} of {world}: state");
        }
    }
}

/// The model's passes over partitioned weights and gradients, 2 ranks in one process (threads,
/// a TCP ring for the gathers, another for the gradients, reduced by the trainer's `ZeroSync`):
/// forward and backward give the logits of the model with whole weights bit for bit, each
/// rank's partitioned gradients are its pieces of the whole model's (both ranks see the same
/// images, so each pass's sum over them is exactly twice the pass's gradients), and the gathers
/// follow the schedule. A backward without the gradient reduction is refused. Per micro-batch, with D
/// partitioned blocks: the first forward gathers every block; the backward reuses the last two
/// from the forward's slots and gathers the other D − 2 again; the next forward finds the
/// first two still there. Without prefetch one slot: the backward reuses only the last block.
#[test]
fn partitioned_passes_equal_whole_weights_and_gather_each_block_before_forward_and_backward() {
    use std::sync::atomic::AtomicUsize;
    use std::sync::Arc;
    use std::time::Duration;
    use vitscale::backend::cpu::Cpu;
    use vitscale::backend::Backend;
    use common::CountingComm;
    use vitscale::comm::{CommOptions, DistEnv, TcpComm};
    use vitscale::model::partition::{GatherOptions, Partition};
    use vitscale::model::Vit;

    let world = 2;
    let depth = 5;
    let mut m = vitscale::model::ModelConfig::preset("vit_builtin_default").expect("preset");
    m.depth = depth;
    let table = vitscale::model::ParamTable::new(&m);
    let weights = vitscale::model::init::init_params(&table, 7);
    let b = 3;
    let images: Vec<f32> = (0..b * m.in_chans * m.image_size * m.image_size).map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0).collect();
    let targets = vitscale::model::smoothed_targets(&[1, 4, 7], m.num_classes, 0.1);
    let be = Cpu::new();
    // the reference: whole weights, two micro-batches accumulated, then an evaluation forward
    let mut whole = Vit::new(&be, m.clone()).expect("model");
    whole.set_params(&be, &weights).expect("weights");
    let mut want = Vec::new();
    let mut fresh = Vec::new();
    for _ in 0..2 {
        whole.zero_grads(&be).expect("zero");
        want.push(whole.forward(&be, &images, &targets, b, Some(1.0 / b as f32)).expect("forward").logits);
        whole.backward(&be).expect("backward");
        fresh.push(be.download(&whole.grads).expect("grads"));
    }
    // each pass's gradients summed over the 2 ranks (2·g, exact), added into zeroed
    // partitioned gradients pass after pass
    let want_grads: Vec<f32> = fresh[0].iter().zip(&fresh[1]).map(|(a, b)| 2.0 * a + 2.0 * b).collect();
    let want_eval = whole.forward(&be, &images, &targets, b, None).expect("eval").logits;

    for prefetch in [true, false] {
        let port = common::free_port();
        let opts = CommOptions { timeout: Duration::from_secs(60), rendezvous_timeout: Duration::from_secs(30) };
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world)
                .map(|rank| {
                    let (m, table, weights, images, targets, opts) = (&m, &table, &weights, &images, &targets, &opts);
                    let (want, want_grads, want_eval) = (&want, &want_grads, &want_eval);
                    s.spawn(move || {
                        let be = Cpu::new();
                        let counts: Arc<[AtomicUsize; 4]> = Arc::new(Default::default());
                        let mut inner = TcpComm::connect(&DistEnv::loopback(rank, world, port), opts, "zero3-passes").expect("connect");
                        let mut grad_comm = vitscale::comm::Comm::<Vec<f32>>::split_groups(&mut inner, world).expect("gradient ring");
                        let comm = Box::new(CountingComm { inner, counts: counts.clone() });
                        let gathers = || CountingComm::take(&counts, CountingComm::ALL_GATHER);
                        let plan = vitscale::train::sync::BucketPlan::new(&table.gradient_groups(), 1, 1).expect("plan");
                        let opt = vitscale::config::OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false };
                        let layout = vitscale::train::zero::ZeroLayout::new(&plan, &opt, 3, world, rank, true).expect("layout");
                        let parts = layout.partition_parts(depth + 2).expect("parts");
                        let part = Partition::new(&be, table, parts, comm, GatherOptions { persistence_threshold: 0, prefetch }).expect("partition");
                        let mut vit = Vit::new(&be, m.clone()).expect("model");
                        vit.set_params(&be, weights).expect("weights");
                        vit.partition(&be, part).expect("partition");
                        assert!(vit.params_host(&be).is_err(), "the whole weights are still there");
                        vit.zero_grads(&be).expect("zero");
                        let mut sync = vitscale::train::zero::ZeroSync::new(&mut *grad_comm, &plan, &layout, true, std::time::Instant::now());
                        let mut passes = Vec::new();
                        for (i, w) in want.iter().enumerate() {
                            let got = vit.forward(&be, images, targets, b, Some(1.0 / b as f32)).expect("forward").logits;
                            assert_eq!(&got, w, "rank {rank}: logits of micro-batch {i}");
                            passes.push(gathers());
                            if i == 0 {
                                assert!(vit.backward(&be).is_err(), "rank {rank}: a backward without the gradient reduction ran");
                            }
                            use vitscale::train::sync::GradSync;
                            vit.backward_reporting(&be, Some(&mut |g: &mut Vec<f32>, span| GradSync::<Cpu>::ready(&mut sync, &be, g, span))).expect("backward");
                            passes.push(gathers());
                        }
                        assert_eq!(be.download(&vit.grads).expect("grads"), layout.shard_master(want_grads).expect("pieces"), "rank {rank}: partitioned gradients");
                        let want_counts = if prefetch { [depth, depth - 2, depth - 2, depth - 2] } else { [depth, depth - 1, depth - 1, depth - 1] };
                        assert_eq!(passes, want_counts, "rank {rank}, prefetch {prefetch}: gathers per pass");
                        // after an update the slots are stale: everything is gathered again
                        vit.partitioned_mut().expect("partitioned").refresh(&be).expect("refresh");
                        gathers();
                        assert_eq!(&vit.forward(&be, images, targets, b, None).expect("eval").logits, want_eval, "rank {rank}: evaluation");
                        assert_eq!(gathers(), depth, "rank {rank}: gathers of a forward after an update");
                        let p = vit.partitioned().expect("partitioned");
                        assert_eq!(p.slot_elems(&be), if prefetch { 2 } else { 1 } * p.groups[1].span.len, "rank {rank}: gather slots");
                    })
                })
                .collect();
            for h in hs {
                h.join().expect("rank thread panicked");
            }
        });
    }
}
