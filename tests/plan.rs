//! The planner end to end through the binary, on the CPU: `bench --profile-out` writes a
//! profile that loads (alone, and under a launcher as one of 2 ranks side by side),
//! `bench --comm --comm-out` a comm file that fits, a small sweep (1 and 2
//! CPU ranks × 2 micro sizes of the built-in 16-px model) is predicted by `plan --validate`
//! with finite errors and the JSON fields, `report` then shows predicted against measured, and
//! `plan` / `--recommend` / `--project` run on the presets. Bad cluster files and profiles
//! are refused with the file and key named. Sized to take well under a minute on a loaded
//! 2-core machine. The ≤ 5 % target is not asserted: timing on a shared box is not a test.

use std::path::Path;

mod common;
use common::{last_json, ok, read_json, repo_path, tmp, vitscale};

fn clusters() -> std::path::PathBuf {
    repo_path("configs/clusters")
}

fn profile(cwd: &Path, path: &str) {
    let out = vitscale(cwd, &["bench", "--device", "cpu", "--model", "vit_builtin_default", "--profile-out", path, "--profile-micros", "16,8,32", "--steps", "3", "--warmup", "1"]);
    ok(&out, "bench --profile-out");
}

/// The profile loads, holds the sizes asked for in order, one backward time per gradient
/// group (depth + 2), parts that add up to about the whole step; a wrong version is refused.
#[test]
fn a_cpu_profile_loads_and_a_wrong_version_is_refused() {
    let tmp = tmp();
    let cwd = tmp.path();
    profile(cwd, "p.json");
    let p = vitscale::plan::profile::Profile::load(&cwd.join("p.json")).expect("the profile loads");
    assert_eq!(p.points.iter().map(|x| x.micro).collect::<Vec<_>>(), vec![8, 16, 32]);
    assert_eq!(p.model, "vit_builtin_default");
    assert_eq!(p.device_kind, "cpu");
    assert!(p.threads >= 1 && p.params > 0 && !p.graph);
    for x in &p.points {
        assert_eq!(x.backward_groups_s.len(), p.model_config.depth + 2);
        let sum: f64 = x.backward_groups_s.iter().sum();
        assert!((sum - x.backward_s).abs() <= 1e-9 + 1e-6 * x.backward_s, "groups {sum} vs backward {}", x.backward_s);
        assert!(x.forward_s > 0.0 && x.backward_s > 0.0 && x.optimizer_s > 0.0 && x.step_s > 0.0);
    }
    let mut v = read_json(&cwd.join("p.json"));
    v["version"] = serde_json::json!(99);
    std::fs::write(cwd.join("v99.json"), v.to_string()).unwrap();
    let e = vitscale::plan::profile::Profile::load(&cwd.join("v99.json")).expect_err("version 99");
    assert!(e.contains("v99.json") && e.contains("version"), "{e}");
    // through the command line: an error, not a panic
    let out = vitscale(cwd, &["plan", "--profile", "v99.json", "--cluster", clusters().join("h200_8_nvlink.json").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("version"));
}

/// A cluster file with a defect is refused naming the file and the key.
#[test]
fn bad_cluster_files_name_the_key() {
    let tmp = tmp();
    let cwd = tmp.path();
    profile(cwd, "p.json");
    let cases = [
        (r#"{"source": "x", "nodes": 1, "intra": {"bandwidth_gb_s": 1, "latency_us": 1}}"#, "`gpus_per_node`: missing"),
        (r#"{"source": "x", "gpus_per_node": 0, "nodes": 1}"#, "`gpus_per_node`: 0"),
        (r#"{"source": "x", "gpus_per_node": 2, "nodes": 1, "intra": {"bandwidth_gb_s": -3, "latency_us": 1}}"#, "`intra.bandwidth_gb_s`"),
        (r#"{"source": "x", "gpus_per_node": 2, "nodes": 1, "intra": {"bandwidth_gb_s": 3, "latency_us": 1}, "gpus": 4}"#, "`gpus`: unknown key"),
        (r#"{"source": "x", "gpus_per_node": 2, "nodes": 1, "intra": {"from_comm": true}}"#, "`intra.from_comm`"),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let name = format!("bad{i}.json");
        std::fs::write(cwd.join(&name), text).unwrap();
        let out = vitscale(cwd, &["plan", "--profile", "p.json", "--cluster", &name]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {err}");
        assert!(err.contains(&name) && err.contains(want), "{name}: {err:?} should name {want:?}");
    }
}

/// Profile + comm bench + a small sweep (every point run twice) → `plan --validate` predicts
/// every point with finite errors from the median of its runs, and writes `plan.json`; the
/// report shows it; the presets predict, recommend, project.
#[test]
fn validate_a_small_cpu_sweep_and_plan_on_the_presets() {
    let tmp = tmp();
    let cwd = tmp.path();
    let spec = serde_json::json!({
        "name": "plan-test",
        "base": {
            "model": {"preset": "vit_builtin_default"},
            "data": {"dataset": "builtin", "train_size": 1024, "val_size": 32, "num_workers": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}
        },
        "set": {"train.eval_batch_size": 32},
        "grid": {"nproc": [1, 2], "train_micro_batch_size_per_gpu": [8, 32]},
        "device": "cpu", "steps": 8, "warmup_steps": 2, "timeout_s": 120, "repeats": 2
    });
    std::fs::write(cwd.join("spec.json"), spec.to_string()).unwrap();
    let out = vitscale(cwd, &["sweep", "spec.json", "--out", "sw", "--json"]);
    ok(&out, "sweep");
    assert_eq!(last_json(&out)["ok"], 8);
    profile(cwd, "sw/profile.json");
    // each of 2 launched ranks profiles its own step beside the other: rank 0 writes the file,
    // with the threads the launcher gives a rank of 2
    let out = vitscale(cwd, &["launch", "--nproc-per-node", "2", "--", "bench", "--device", "cpu", "--model", "vit_builtin_default", "--profile-out", "sw/profile_2ranks.json", "--profile-micros", "8,32", "--steps", "2", "--warmup", "1"]);
    ok(&out, "launch … bench --profile-out");
    assert!(String::from_utf8_lossy(&out.stdout).contains("one of 2 ranks side by side"), "{}", String::from_utf8_lossy(&out.stdout));
    let side = vitscale::plan::profile::Profile::load(&cwd.join("sw/profile_2ranks.json")).expect("the side-by-side profile loads");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!((side.ranks, side.threads, side.cores), (2, cores.div_ceil(2), cores));
    assert_eq!(vitscale::plan::profile::Profile::load(&cwd.join("sw/profile.json")).expect("profile").ranks, 1);
    // sizes up to 4 MiB and the median of 7 iterations: on a shared 2-core machine the small
    // messages' times are noisy, and the largest ones must set the slope the fit needs
    let out = vitscale(cwd, &["launch", "--nproc-per-node", "2", "--", "bench", "--comm", "--device", "cpu", "--comm-max-bytes", "4194304", "--comm-iters", "7", "--warmup", "1", "--comm-out", "sw/comm_2.json"]);
    ok(&out, "bench --comm");
    let fit = vitscale::plan::comm_fit::CommFit::load(&cwd.join("sw/comm_2.json")).expect("the comm file fits");
    assert_eq!(fit.world_size, 2);
    assert!(fit.all_reduce.beta_bytes_s > 0.0 && fit.all_reduce.alpha_s >= 0.0);
    // every preset loads (the from_comm ones with this fit) and says where its figures come from
    let mut presets = 0;
    for entry in std::fs::read_dir(clusters()).expect("configs/clusters") {
        let path = entry.expect("entry").path();
        let c = vitscale::plan::cluster::Cluster::load(&path, std::slice::from_ref(&fit)).unwrap_or_else(|e| panic!("{e}"));
        assert!(c.world() >= 1 && !c.source.is_empty(), "{}", path.display());
        presets += 1;
    }
    assert!(presets >= 5, "{presets} presets");

    // the profile and the comm file are found in the sweep directory
    let out = vitscale(cwd, &["plan", "--validate", "sw", "--json"]);
    ok(&out, "plan --validate");
    let v = last_json(&out);
    let points = v["points"].as_array().expect("points");
    assert_eq!(points.len(), 4);
    for p in points {
        let (m, pr, e) = (p["measured_images_per_s"].as_f64().unwrap(), p["predicted_images_per_s"].as_f64().unwrap(), p["err"].as_f64().unwrap());
        assert!(m > 0.0 && pr.is_finite() && pr > 0.0, "{p}");
        assert!(((pr - m) / m - e).abs() < 1e-9, "{p}");
        // one-rank points have nothing to communicate; two-rank points do
        let exposed = p["comm_exposed_s"][1].as_f64().unwrap();
        if p["world"] == 1 { assert_eq!(exposed, 0.0) } else { assert!(exposed > 0.0, "{p}") }
        // one rank is predicted from the rank alone on every core, two from the two side by side
        let want = if p["world"] == 1 { "profile.json" } else { "profile_2ranks.json" };
        assert!(p["profile"].as_str().unwrap().ends_with(want), "{p}");
        // measured: per run, the global batch over rank 0's median step after the 2 warm-up
        // steps, read here from its metrics lines (one a step); the point's, the median (here
        // the mean) of its 2 runs, and its spread half their difference
        let global = (p["world"].as_u64().unwrap() * p["micro"].as_u64().unwrap()) as f64;
        let runs: Vec<f64> = (1..=2)
            .map(|r| {
                let metrics = std::fs::read_to_string(cwd.join("sw/points").join(format!("{}_r{r}", p["id"].as_str().unwrap())).join("run/metrics.jsonl")).unwrap();
                let mut secs: Vec<f64> = metrics
                    .lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .filter(|r| r.get("kind").is_none() && r["step"].as_u64().is_some_and(|s| s > 2))
                    .map(|r| r["train_s"].as_f64().unwrap() / r["steps"].as_f64().unwrap())
                    .collect();
                secs.sort_by(f64::total_cmp);
                assert_eq!(secs.len(), 6, "{p}");
                global / ((secs[2] + secs[3]) / 2.0)
            })
            .collect();
        let got: Vec<f64> = p["runs_images_per_s"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
        assert!(got.len() == 2 && got.iter().zip(&runs).all(|(a, b)| (a - b).abs() < 1e-6 * b), "{p}: runs {runs:?}");
        assert!((m - (runs[0] + runs[1]) / 2.0).abs() < 1e-6 * m, "{p}: measured {m}, runs {runs:?}");
        assert!((p["spread_images_per_s"].as_f64().unwrap() - (runs[0] - runs[1]).abs() / 2.0).abs() < 1e-6 * m, "{p}");
    }
    // 4 points: 6 pairs, each apart beyond the spread of its runs or tied within it
    let order = &v["order"];
    assert_eq!((order["pairs"].as_u64(), order["min_runs"].as_u64()), (Some(6), Some(2)), "{order}");
    assert_eq!(order["apart"].as_u64().unwrap() + order["tied"].as_u64().unwrap(), 6, "{order}");
    assert!(order["right"].as_u64().unwrap() <= order["apart"].as_u64().unwrap(), "{order}");
    // every point is a prediction, the one-rank points too (nothing is fitted on the sweep)
    let errs: Vec<f64> = points.iter().map(|p| p["err"].as_f64().unwrap().abs()).collect();
    let max = errs.iter().cloned().fold(0.0, f64::max);
    assert!((v["max_abs_err"].as_f64().unwrap() - max).abs() < 1e-12);
    let med = v["median_abs_err"].as_f64().unwrap();
    assert!(med.is_finite() && med <= max);
    assert!(v["pairwise_correct"].as_f64().is_some_and(|x| (0.0..=1.0).contains(&x)));
    eprintln!("validation on this machine: median |error| {:.1} %, max {:.1} %", med * 100.0, max * 100.0);
    assert!(cwd.join("sw/plan.json").exists());

    let out = vitscale(cwd, &["report", "sw"]);
    ok(&out, "report");
    let md = std::fs::read_to_string(cwd.join("sw/report.md")).unwrap();
    assert!(md.contains("Predicted against measured") && md.contains("p003"), "the report lacks the prediction section");
    assert!(cwd.join("sw/charts/predicted.png").exists());

    // one configuration on the CPU-ranks preset with the measured comm file
    let cpu = clusters().join("cpu_ranks_here.json");
    let out = vitscale(cwd, &["plan", "--profile", "sw/profile.json", "--cluster", cpu.to_str().unwrap(), "--comm", "sw/comm_2.json", "--set", "train_micro_batch_size_per_gpu=16", "--json"]);
    ok(&out, "plan");
    let j = last_json(&out);
    assert_eq!(j["prediction"]["world"], 2);
    assert!(j["prediction"]["images_per_s"].as_f64().unwrap() > 0.0);
    assert!(j["memory_per_rank"]["total"].as_u64().unwrap() > 0);
    // a model other than the profiled one is refused, not predicted as the profiled one
    let out = vitscale(cwd, &["plan", "--profile", "sw/profile.json", "--cluster", cpu.to_str().unwrap(), "--comm", "sw/comm_2.json", "--set", "model.preset=vit_tiny_patch4_32"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the profile is of vit_builtin_default"), "{}", String::from_utf8_lossy(&out.stderr));
    // without the comm file the from_comm level cannot be built
    let out = vitscale(cwd, &["plan", "--profile", "sw/profile.json", "--cluster", cpu.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("intra.from_comm"));

    let a100 = clusters().join("a100_8x4_ib200.json");
    let out = vitscale(cwd, &["plan", "--profile", "sw/profile.json", "--cluster", a100.to_str().unwrap(), "--recommend", "--global-batch", "2048", "--json"]);
    ok(&out, "plan --recommend");
    let r = last_json(&out);
    let choices = r["choices"].as_array().unwrap();
    assert!(!choices.is_empty());
    for c in choices {
        let (m, g) = (c["micro"].as_u64().unwrap(), c["gas"].as_u64().unwrap());
        assert_eq!(m * g * 32, 2048, "{c}");
    }
    let ips: Vec<f64> = choices.iter().map(|c| c["images_per_s"].as_f64().unwrap()).collect();
    assert!(ips.windows(2).all(|w| w[1] <= w[0] * 1.005 + 1e-9), "not ranked fastest first");
    // a memory limit no choice fits is an error naming it
    let out = vitscale(cwd, &["plan", "--profile", "sw/profile.json", "--cluster", a100.to_str().unwrap(), "--recommend", "--global-batch", "2048", "--memory-limit", "0.0000001"]);
    assert_eq!(out.status.code(), Some(1));

    let study = clusters().join("study_32_nodes_h200.json");
    // a CPU profile on an H200 cluster is a what-if the command must be told it is
    let out = vitscale(cwd, &["plan", "--profile", "sw/profile.json", "--cluster", study.to_str().unwrap(), "--project", "proj", "--micros", "16,64", "--allow-device-mismatch", "--json"]);
    ok(&out, "plan --project");
    let p = last_json(&out);
    // nodes 1, 2, 4, 8, 16, 32 × 2 micro sizes
    assert_eq!(p["rows"].as_array().unwrap().len(), 12);
    assert!(cwd.join("proj/projection.md").exists() && cwd.join("proj/charts/projection.png").exists());
}

/// The H200 profiles and one-GPU comm benches under `docs/data/` (what `docs/plan.md`'s GPU
/// figures come from) load with this binary, and predict two H200s on NVLink within the
/// physics: more than one GPU's throughput, at most twice it, and the one-GPU emulation's
/// 2 ranks far below one rank alone (their network is the socket transport's).
#[test]
fn the_committed_h200_inputs_load_and_predict() {
    let data = repo_path("docs/data");
    let tmp = tmp();
    for model in ["vit_base_patch16_224", "vit_small_patch4_32"] {
        let prof = data.join(format!("profile_h200_{model}.json"));
        let p = prof.to_str().unwrap();
        let nvlink = clusters().join("h200_8_nvlink.json");
        let one = vitscale(tmp.path(), &["plan", "--profile", p, "--cluster", nvlink.to_str().unwrap(), "--gpus-per-node", "1", "--set", "train_micro_batch_size_per_gpu=128", "--json"]);
        ok(&one, "plan on one H200");
        let two = vitscale(tmp.path(), &["plan", "--profile", p, "--cluster", nvlink.to_str().unwrap(), "--gpus-per-node", "2", "--set", "train_micro_batch_size_per_gpu=128", "--json"]);
        ok(&two, "plan on two H200s");
        let (a, b) = (last_json(&one)["prediction"]["images_per_s"].as_f64().unwrap(), last_json(&two)["prediction"]["images_per_s"].as_f64().unwrap());
        assert!(b > a && b <= 2.0 * a * (1.0 + 1e-9), "{model}: one GPU {a}, two {b}");
    }
    let prof = data.join("profile_h200_vit_small_patch4_32.json");
    let comm = data.join("comm_h200_one_gpu_2_ranks.json");
    let emu = clusters().join("one_gpu_emulation.json");
    let out = vitscale(tmp.path(), &["plan", "--profile", prof.to_str().unwrap(), "--cluster", emu.to_str().unwrap(), "--comm", comm.to_str().unwrap(), "--ranks-per-device", "2", "--set", "train_micro_batch_size_per_gpu=128", "--json"]);
    ok(&out, "plan on the one-GPU emulation");
    let eff = last_json(&out)["efficiency"].as_f64().unwrap();
    assert!(eff > 0.0 && eff < 0.5, "two ranks over loopback sockets: efficiency {eff}");
}
