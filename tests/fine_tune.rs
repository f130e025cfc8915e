//! The fine-tuning regularizers timm users reach for, checked against independent references:
//! layer-wise learning-rate decay against timm's own parameter groups (a committed fixture made
//! by `reference/make_layer_decay_fixture.py`), stochastic depth against its definition
//! (per-image masks, expectation preserved, N ranks = 1 rank), and the weight EMA against the
//! update rule applied to the weights the run itself saved.

use serde_json::Value;
use vitscale::config::DecaySkip;
use vitscale::model::params::ParamTable;
use vitscale::model::spec::{GlobalPool, ModelConfig};
use vitscale::backend::ParamGroups;

fn fixture(name: &str) -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).expect("fixture JSON")
}

/// The architecture of one of the fixture's timm models (`VisionTransformer` keyword arguments).
fn model_of(kw: &Value) -> ModelConfig {
    let int = |k: &str| kw[k].as_u64().unwrap_or_else(|| panic!("fixture model lacks {k}")) as usize;
    let avg = kw.get("global_pool").and_then(Value::as_str) == Some("avg");
    ModelConfig {
        image_size: int("img_size"),
        patch_size: int("patch_size"),
        in_chans: 3,
        embed_dim: int("embed_dim"),
        depth: int("depth"),
        num_heads: int("num_heads"),
        mlp_ratio: 4.0,
        num_classes: int("num_classes"),
        qkv_bias: true,
        class_token: kw.get("class_token").and_then(Value::as_bool).unwrap_or(true),
        global_pool: if avg { GlobalPool::Avg } else { GlobalPool::Token },
    }
}

/// Every parameter's learning-rate factor and weight decay equal timm's
/// `param_groups_layer_decay` (weight decay 0.05, the model's `no_weight_decay()` list) for each
/// pooling and class-token layout and two decay rates.
#[test]
fn layer_decay_groups_are_timms() {
    let fx = fixture("layer_decay.json");
    let cases = fx["cases"].as_array().expect("cases");
    assert!(cases.len() >= 6);
    let skip = DecaySkip { bias: true, norm: true, pos_embed: true, cls_token: true };
    for case in cases {
        let (name, ld) = (case["name"].as_str().unwrap(), case["layer_decay"].as_f64().unwrap());
        let table = ParamTable::new(&model_of(&case["model"]));
        let groups = ParamGroups::new(&table, &skip).with_layer_decay(&table, ld);
        let want = case["params"].as_object().expect("params");
        assert_eq!(table.entries.len(), want.len(), "{name}: parameter count");
        for (entry, g) in table.entries.iter().zip(&groups.groups) {
            assert_eq!(entry.span, g.span);
            let w = want.get(&entry.name).unwrap_or_else(|| panic!("{name}: timm has no {}", entry.name));
            let scale = w["lr_scale"].as_f64().unwrap();
            assert!(((g.lr_scale as f64) - scale).abs() <= 1e-7 * scale, "{name} ld {ld}: {} lr_scale {} vs timm {scale}", entry.name, g.lr_scale);
            assert_eq!(g.decays, w["weight_decay"].as_f64().unwrap() > 0.0, "{name}: decay of {}", entry.name);
        }
    }
}

mod common;
use common::{ok, tensors, tmp, vitscale};

/// One SGD step (no momentum, no weight decay) from the same weights on the same batch: with
/// layer decay 0.5 every tensor moves by its timm factor times what it moves without, in a
/// real training run (the factor reaches the update through the trainer's groups).
#[test]
fn a_training_step_scales_each_layers_update_by_its_factor() {
    let t = tmp();
    let dir = t.path();
    let common: Vec<String> = ["--device", "cpu", "--set", "data.train_size=64", "--set", "data.val_size=16", "--set", "train.eval_every=0",
        "--set", "train_micro_batch_size_per_gpu=16", "--set", "train.steps=1"].iter().map(|s| s.to_string()).collect();
    let start = dir.join("start.safetensors");
    let mut a: Vec<String> = vec!["train".into()];
    a.extend(common.clone());
    a.extend(["--save-weights".into(), start.display().to_string(), "--run-dir".into(), dir.join("r0").display().to_string()]);
    ok(&vitscale(dir, &a), "first run");
    let sgd = ["--set", "optimizer.type=SGD", "--set", "optimizer.params.lr=0.5", "--set", "optimizer.params.momentum=0", "--set", "optimizer.params.weight_decay=0"];
    let step = |name: &str, extra: &[&str]| {
        let out = dir.join(format!("{name}.safetensors"));
        let mut a: Vec<String> = vec!["train".into(), "--init".into(), start.display().to_string()];
        a.extend(common.clone());
        a.extend(sgd.iter().chain(extra).map(|s| s.to_string()));
        a.extend(["--save-weights".into(), out.display().to_string(), "--run-dir".into(), dir.join(name).display().to_string()]);
        ok(&vitscale(dir, &a), name);
        tensors(&out)
    };
    let plain = step("plain", &[]);
    let decayed = step("decayed", &["--set", "optimizer.params.layer_decay=0.5"]);
    let w0 = tensors(&start);
    let depth = w0.iter().filter(|(n, _)| n.ends_with(".norm1.weight")).count() as i32;
    assert!(depth >= 2);
    let mut checked = 0;
    for (((name, w), (_, p)), (_, d)) in w0.iter().zip(&plain).zip(&decayed) {
        let want = if let Some(rest) = name.strip_prefix("blocks.") {
            0.5f64.powi(depth - rest.split('.').next().unwrap().parse::<i32>().unwrap())
        } else if name.starts_with("norm.") {
            0.5
        } else if name.starts_with("head.") || name.starts_with("fc_norm.") {
            1.0
        } else {
            0.5f64.powi(depth + 1)
        };
        let (dp, dd): (Vec<f64>, Vec<f64>) = w.iter().zip(p).zip(d).map(|((&w, &p), &d)| ((p - w) as f64, (d - w) as f64)).unzip();
        let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
        if norm(&dp) == 0.0 {
            continue; // a tensor whose gradient is zero on this batch
        }
        let err: f64 = dp.iter().zip(&dd).map(|(p, d)| (d - want * p).powi(2)).sum::<f64>().sqrt() / (want * norm(&dp));
        // f32 rounding of weights near 1 (norms) against updates of 1e-4: a few parts in 1e3;
        // neighbouring layers differ by a factor of 2
        assert!(err < 1e-2, "{name}: update ratio off by {err:.2e} (factor {want})");
        checked += 1;
    }
    assert!(checked > 10, "only {checked} tensors moved");
}

use vitscale::backend::cpu::Cpu;
use vitscale::backend::Backend;
use vitscale::model::Vit;

/// Forward + backward of `imgs` on the CPU with `scales` (None: no stochastic depth) from
/// `weights`: (per-image losses, gradients).
fn run_model(cfg: &ModelConfig, weights: &[f32], imgs: &[f32], targets: &[f32], b: usize, scales: Option<&[f32]>) -> (Vec<f32>, Vec<f32>) {
    let be = Cpu::new();
    let mut vit = Vit::new(&be, cfg.clone()).unwrap();
    vit.set_params(&be, weights).unwrap();
    if let Some(s) = scales {
        vit.set_branch_scales(&be, Some((s, vec![true; cfg.depth])), b).unwrap();
    }
    let out = vit.forward(&be, imgs, targets, b, Some(1.0)).unwrap();
    vit.backward(&be).unwrap();
    (out.losses, be.download(&vit.grads).unwrap())
}

/// Stochastic depth against an independent formulation: a branch whose output an image's factor
/// s multiplies is the same network as one whose projection (attention's `proj`, the MLP's
/// `fc2`) has weight and bias multiplied by s. So each image's loss under random per-image,
/// per-branch factors (0 = dropped, 2 = kept at p = 0.5) equals its loss alone through the
/// weight-scaled model, and the gradient of the batch is the sum over images of their
/// weight-scaled gradients, with the chain rule's factor s on the scaled tensors. For token
/// pooling (the last block on the class token alone) and average pooling.
#[test]
fn stochastic_depth_equals_scaling_the_branch_weights() {
    let (mut rng, seed) = common::fresh_rng();
    use rand::Rng;
    for pool in [GlobalPool::Token, GlobalPool::Avg] {
        let cfg = ModelConfig { image_size: 8, patch_size: 4, in_chans: 3, embed_dim: 16, depth: 3, num_heads: 2, mlp_ratio: 2.0, num_classes: 4, qkv_bias: true, class_token: true, global_pool: pool };
        let table = ParamTable::new(&cfg);
        let weights: Vec<f32> = (0..table.total).map(|_| rng.gen_range(-0.3f32..0.3)).collect();
        let b = 4;
        let per = 3 * 8 * 8;
        let imgs: Vec<f32> = (0..b * per).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        let mut targets = vec![0.0f32; b * 4];
        (0..b).for_each(|i| targets[i * 4 + rng.gen_range(0..4)] = 1.0);
        // [block][branch][image]; every image keeps at least one branch somewhere
        let mut scales: Vec<f32> = (0..cfg.depth * 2 * b).map(|_| if rng.gen_bool(0.5) { 0.0 } else { 2.0 }).collect();
        scales[2 * b..3 * b].iter_mut().for_each(|s| *s = 2.0);
        let (losses, grads) = run_model(&cfg, &weights, &imgs, &targets, b, Some(&scales));
        let mut want_grads = vec![0.0f64; table.total];
        for j in 0..b {
            let mut w = weights.clone();
            let factor = |blk: usize, br: usize| scales[(blk * 2 + br) * b + j];
            let mut span_factor = vec![1.0f32; table.total];
            for (i, s) in table.spans.blocks.iter().enumerate() {
                for (br, spans) in [(0, [s.proj_w, s.proj_b]), (1, [s.fc2_w, s.fc2_b])] {
                    for sp in spans {
                        sp.range().for_each(|k| {
                            w[k] *= factor(i, br);
                            span_factor[k] = factor(i, br);
                        });
                    }
                }
            }
            let (l, g) = run_model(&cfg, &w, &imgs[j * per..(j + 1) * per], &targets[j * 4..(j + 1) * 4], 1, None);
            assert!((l[0] - losses[j]).abs() <= 1e-5 * l[0].abs().max(1.0), "{pool:?} image {j}: loss {} vs weight-scaled {} (seed {seed})", losses[j], l[0]);
            for k in 0..table.total {
                want_grads[k] += (g[k] * span_factor[k]) as f64;
            }
        }
        let scale = want_grads.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        for (k, (&got, want)) in grads.iter().zip(&want_grads).enumerate() {
            let name = &table.entries.iter().find(|e| e.span.range().contains(&k)).unwrap().name;
            assert!((got as f64 - want).abs() <= 1e-5 * scale, "{pool:?} gradient of {name}: {got} vs {want} (seed {seed})");
        }
        // and with every factor 1 the model is the plain one
        let ones = vec![1.0f32; cfg.depth * 2 * b];
        let plain = run_model(&cfg, &weights, &imgs, &targets, b, None);
        let unit = run_model(&cfg, &weights, &imgs, &targets, b, Some(&ones));
        assert!(plain.0.iter().zip(&unit.0).all(|(a, b)| (a - b).abs() <= 1e-6 * a.abs().max(1.0)));
    }
}

/// 4 SGD steps of a 32-image global batch with stochastic depth at 0.3: two ranks (micro 8,
/// GAS 2) and one process (micro 32) draw the same masks for the same images and end with the
/// same weights (to the rounding of summing gradients in another order), and both differ from
/// the run without it.
#[test]
fn stochastic_depth_trains_the_same_on_any_split_of_the_batch() {
    let t = tmp();
    let run_split = |nproc: usize, micro: &str, rate: &str, name: &str| {
        let mut args = common::launch_args(nproc);
        args.push("train".into());
        for a in ["--device=cpu", "--set=train.steps=4", "--set=train_batch_size=32", "--set=data.val_size=64", "--set=train.eval_every=0",
            "--set=optimizer={\"type\":\"SGD\",\"params\":{\"lr\":0.05,\"momentum\":0.9}}"] {
            args.push(a.into());
        }
        args.push(format!("--set=train_micro_batch_size_per_gpu={micro}"));
        args.push(format!("--set=model.drop_path_rate={rate}"));
        args.extend(common::run_dir_args(&t.path().join(name)));
        ok(&common::run(&args), name);
        t.path().join(name)
    };
    let one = run_split(1, "32", "0.3", "one");
    let two = run_split(2, "8", "0.3", "two");
    let plain = run_split(1, "32", "0", "plain");
    let d = common::max_rel_diff(&two, &one);
    assert!(d < 1e-5, "2 ranks vs 1 process with stochastic depth: {d:e}");
    let effect = common::max_rel_diff(&plain, &one);
    assert!(effect > 1e-3, "drop_path_rate 0.3 changed the weights by only {effect:e}");
}

/// The weight EMA against its definition applied to the weights the run itself wrote after
/// every step (checkpoint_every 1, every checkpoint kept): e₁ = w₁ (timm's first update copies),
/// eₜ = lerp(eₜ₋₁, wₜ, 1 − d) at d = 0.6, as the `_ema.safetensors` beside `--save-weights`
/// and the last checkpoint's `ema.*` tensors hold it. Then two ranks under ZeRO 1 and 2
/// (micro 8 against one rank's 16) end with the one rank's average.
#[test]
fn the_weight_ema_follows_its_definition_on_one_and_two_ranks() {
    let t = tmp();
    let steps = 5;
    let run = |nproc: usize, extra: &[&str], name: &str| {
        let mut args = common::launch_args(nproc);
        args.push("train".into());
        for a in ["--device=cpu", "--set=train_batch_size=16", "--set=data.val_size=32", "--set=train.eval_every=0",
            "--set=train.checkpoint_every=1", "--keep-checkpoints=0", "--set=train.ema={\"decay\":0.6}",
            "--set=optimizer={\"type\":\"SGD\",\"params\":{\"lr\":0.05,\"momentum\":0.9}}"] {
            args.push(a.into());
        }
        args.push(format!("--set=train.steps={steps}"));
        args.extend(extra.iter().map(|s| s.to_string()));
        args.extend(common::run_dir_args(&t.path().join(name)));
        let out = common::run(&args);
        ok(&out, name);
        (t.path().join(name), out)
    };
    let (one, out) = run(1, &["--set=train_micro_batch_size_per_gpu=16", "--json"], "one");
    let summary = common::last_json(&out);
    assert!(summary["ema_val_top1"].as_f64().is_some_and(|v| (0.0..=1.0).contains(&v)), "{summary}");
    let weights_at = |s: u64| tensors(&one.join(format!("checkpoints/step_{s:06}/model.safetensors")));
    let mut ema = weights_at(1);
    for s in 2..=steps {
        for ((_, e), (_, w)) in ema.iter_mut().zip(weights_at(s)) {
            e.iter_mut().zip(&w).for_each(|(e, w)| *e += 0.4 * (w - *e));
        }
    }
    let saved = tensors(&one.join("w_ema.safetensors"));
    let last_ck = tensors(&one.join(format!("checkpoints/step_{steps:06}/optimizer.safetensors")));
    let worst = |got: &[(String, Vec<f32>)]| {
        ema.iter().zip(got).map(|((n, a), (m, b))| {
            assert_eq!(n, m.trim_start_matches("ema."));
            common::rel_l2(b, a)
        }).fold(0.0, f64::max)
    };
    let ck_ema: Vec<(String, Vec<f32>)> = last_ck.into_iter().filter(|(n, _)| n.starts_with("ema.")).collect();
    assert_eq!(ck_ema.len(), ema.len());
    assert!(worst(&saved) < 1e-6 && worst(&ck_ema) < 1e-6, "saved EMA {} / checkpoint EMA {} off the definition", worst(&saved), worst(&ck_ema));
    // the average is not the weights themselves
    assert!(common::max_rel_diff_files(&one.join("w_ema.safetensors"), &one.join("w.safetensors")) > 1e-3);
    for stage in ["1", "2"] {
        let (two, _) = run(2, &["--set=train_micro_batch_size_per_gpu=8", &format!("--set=zero_optimization.stage={stage}")], &format!("zero{stage}"));
        let d = common::max_rel_diff_files(&two.join("w_ema.safetensors"), &one.join("w_ema.safetensors"));
        assert!(d < 1e-5, "ZeRO {stage} on 2 ranks: EMA differs from 1 rank by {d:e}");
    }
}

/// A run resumed from its step-3 checkpoint ends with the weight EMA of the run that went
/// straight to step 6, bit for bit (the average travels in the checkpoint).
#[test]
fn a_resumed_run_continues_the_weight_ema_exactly() {
    let t = tmp();
    let base = |steps: &str, name: &str| -> Vec<String> {
        let mut a: Vec<String> = ["train", "--device=cpu", "--set=train_batch_size=16", "--set=data.val_size=32", "--set=train.eval_every=0",
            "--set=train.checkpoint_every=3", "--set=train.ema={\"decay\":0.7,\"warmup\":true}"].iter().map(|s| s.to_string()).collect();
        a.push(format!("--set=train.steps={steps}"));
        a.extend(common::run_dir_args(&t.path().join(name)));
        a
    };
    ok(&common::run(&base("6", "straight")), "straight");
    ok(&common::run(&base("3", "split")), "first half");
    let mut again = base("6", "split");
    again.extend(["--resume".to_string(), "latest".to_string()]);
    ok(&common::run(&again), "resumed");
    let (a, b) = (tensors(&t.path().join("straight/w_ema.safetensors")), tensors(&t.path().join("split/w_ema.safetensors")));
    assert_eq!(a.len(), b.len());
    for ((n, x), (_, y)) in a.iter().zip(&b) {
        assert!(x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()), "{n}: the resumed run's EMA differs");
    }
}

/// Where ZeRO shards the master weights (GPU ranks), each rank averages only the pieces it
/// owns, and evaluating or saving the average puts them together: `gather_owned` of every
/// rank's pieces gives back the whole buffer on every rank, for 2 and 3 ranks (thread ranks
/// joined by loopback sockets) and buckets of odd sizes with replicated tails.
#[test]
fn owned_pieces_gather_into_the_whole_buffer_on_every_rank() {
    use vitscale::backend::Span;
    use vitscale::comm::{CommOptions, DistEnv, TcpComm};
    use vitscale::train::sync::BucketPlan;
    use vitscale::train::zero::ZeroLayout;
    let lens = [13usize, 40, 7, 101];
    let total: usize = lens.iter().sum();
    let mut off = total;
    let groups: Vec<Span> = lens.iter().map(|&len| {
        off -= len;
        Span { off, len }
    }).collect();
    let plan = BucketPlan::new(&groups, 1, 1).unwrap();
    let full: Vec<f32> = (0..total).map(|i| i as f32 * 0.5 - 7.0).collect();
    let opt = vitscale::config::OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false };
    for world in [2usize, 3] {
        let port = common::free_port();
        let opts = CommOptions { timeout: std::time::Duration::from_secs(60), rendezvous_timeout: std::time::Duration::from_secs(30) };
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..world).map(|rank| {
                let (plan, full, opts, opt) = (&plan, &full, &opts, &opt);
                s.spawn(move || {
                    let layout = ZeroLayout::new(plan, opt, 2, world, rank, true).unwrap().with_master_shard();
                    let mut comm = TcpComm::connect(&DistEnv::loopback(rank, world, port), opts, "gather-owned").expect("connect");
                    let own = layout.shard_master(full).unwrap();
                    assert!(own.len() < total, "rank {rank} owns everything");
                    layout.gather_owned(&Cpu::new(), &mut comm, &own).unwrap()
                })
            }).collect();
            for (rank, h) in hs.into_iter().enumerate() {
                assert_eq!(h.join().expect("rank thread"), full, "rank {rank} of {world}");
            }
        });
    }
}

/// The memory estimate counts the weight EMA: its f32 average (sharded like the master weights
/// under ZeRO on a device with a compute copy) and the model it is evaluated on (whole f32
/// weights and, on such a device, the compute copy).
#[test]
fn the_memory_estimate_counts_the_weight_ema() {
    use vitscale::train::memory::{estimate, DeviceMemory, RankBatch};
    let cfg_of = |ema: bool, stage: u8, world: usize| {
        let mut v = serde_json::json!({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage}, "model": {"preset": "vit_small_patch16_224", "num_classes": 10},
            "data": {"dataset": "synthetic", "train_size": 64, "val_size": 16}});
        if ema {
            v["train"] = serde_json::json!({"ema": {}});
        }
        vitscale::config::resolve(&v, world).expect("config")
    };
    let attention = |b: usize, n: usize, h: usize, _d: usize| b * h * n * n;
    let gpu = DeviceMemory { compute_bytes: 2.0, compute_copy: true, attention_saved: &attention };
    let p = ParamTable::new(&cfg_of(false, 0, 1).model).total as f64;
    let shape = |world| RankBatch { micro: 8, pass_images: 8, eval_images: 8, world };
    let extra = |stage: u8, world: usize| {
        let with = estimate(&cfg_of(true, stage, world), shape(world), &gpu, false, false);
        let without = estimate(&cfg_of(false, stage, world), shape(world), &gpu, false, false);
        assert_eq!(with.total - without.total, with.ema);
        with.ema
    };
    // one rank: the average (4 bytes a parameter) + the evaluated model (4 + 2)
    assert!((extra(0, 1) - 10.0 * p).abs() < 1.0, "{} vs {}", extra(0, 1), 10.0 * p);
    // ZeRO 2 over 4 ranks: the average shrinks with the master shard (tails replicated)
    let z = extra(2, 4);
    assert!(z < 6.0 * p + 1.1 * p && z > 6.0 * p + 0.9 * p, "{z} for {p} parameters");
}
