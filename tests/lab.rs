//! The scaling lab end to end through the binary, on CPU ranks: a grid of 12 points (8 that
//! train, 4 whose global batch cannot fit the training set) runs under `vitscale sweep`, the
//! failures are recorded with their reason and the sweep goes on, `--resume` reruns nothing
//! that is done, `vitscale report` writes the Markdown, the HTML and charts that decode and are
//! not blank, and a point past its timeout is stopped with its workers. Points are tiny (the
//! built-in 16-px model, 4 steps) so the whole file takes seconds on a 2-core machine.

use std::path::Path;

mod common;
use common::{free_port, jsonl, last_json, repo_path, tmp, vitscale};

/// The spec of the tests: micro 8 / 32 / 1024 × GAS 1 / 2 × 1 / 2 ranks on 512 training
/// images; micro 1024 needs a global batch larger than the training set, so those 4 fail.
fn write_spec(dir: &Path) -> std::path::PathBuf {
    let spec = serde_json::json!({
        "name": "lab-test",
        "base": {
            "model": {"preset": "vit_builtin_default"},
            "data": {"dataset": "builtin", "train_size": 512, "val_size": 32, "num_workers": 1},
            "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
        },
        "set": {"train.eval_batch_size": 32},
        "grid": {"train_micro_batch_size_per_gpu": [8, 32, 1024], "gradient_accumulation_steps": [1, 2], "nproc": [1, 2]},
        "device": "cpu", "steps": 4, "warmup_steps": 1, "timeout_s": 120
    });
    let path = dir.join("spec.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&spec).expect("json")).expect("write spec");
    path
}

fn records(dir: &Path) -> Vec<serde_json::Value> {
    jsonl(&dir.join("sweep.jsonl"))
}

/// A PNG that decodes, has the expected size range, and shows a picture: many colours and a
/// good share of non-white pixels (a blank or text-less chart has neither).
fn check_png(path: &Path) {
    let img = image::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).to_rgb8();
    let (w, h) = img.dimensions();
    assert!(w >= 600 && h >= 300, "{}: {w}×{h}", path.display());
    let mut colours = std::collections::HashSet::new();
    let mut inked = 0usize;
    for p in img.pixels() {
        colours.insert(p.0);
        if p.0 != [255, 255, 255] {
            inked += 1;
        }
    }
    let share = inked as f64 / (w * h) as f64;
    assert!(colours.len() > 20, "{}: only {} colours", path.display(), colours.len());
    assert!(share > 0.02 && share < 0.9, "{}: {:.1} % of the pixels are not white", path.display(), share * 100.0);
}

#[test]
fn a_sweep_runs_records_failures_resumes_and_reports() {
    let tmp = tmp();
    let cwd = tmp.path();
    let spec = write_spec(cwd);
    let out = vitscale(cwd, &["sweep", spec.to_str().expect("utf-8"), "--out", "sw", "--json"]);
    assert!(out.status.success(), "sweep failed: {}", String::from_utf8_lossy(&out.stderr));
    let outcome = last_json(&out);
    assert_eq!(outcome["points"], 12);
    assert_eq!(outcome["ok"], 8, "{outcome}");
    assert_eq!(outcome["failed"], 4, "{outcome}");
    let dir = cwd.join("sw");
    let recs = records(&dir);
    assert_eq!(recs.len(), 12);
    for r in &recs {
        let micro = r["keys"]["train_micro_batch_size_per_gpu"].as_u64().expect("micro");
        if micro == 1024 {
            assert_eq!(r["status"], "failed", "{r}");
            let reason = r["reason"].as_str().expect("a reason");
            assert!(reason.contains("exit code 1") && reason.contains("larger than the training set"), "{reason}");
        } else {
            assert_eq!(r["status"], "ok", "{r}");
            let f = &r["figures"];
            assert!(f["images_per_s"].as_f64().expect("throughput") > 0.0);
            assert_eq!(f["measured_steps"], 3, "4 steps minus 1 warm-up");
            assert_eq!(f["world_size"], r["keys"]["nproc"]);
            assert_eq!(f["global_batch"].as_u64(), Some(micro * r["keys"]["gradient_accumulation_steps"].as_u64().expect("gas") * r["keys"]["nproc"].as_u64().expect("n")));
            // every rank's figures, with the memory each recorded
            let ranks = f["ranks"].as_array().expect("ranks");
            assert_eq!(ranks.len() as u64, r["keys"]["nproc"].as_u64().expect("n"));
            assert!(ranks.iter().all(|k| k["peak_mem_bytes"].as_u64().unwrap_or(0) > 1 << 20), "{f}");
            let cmd = r["command"].as_str().expect("command");
            // a rerun writes a fresh run directory: the point's own holds its run
            assert!(cmd.starts_with("vitscale ") && cmd.contains("--config sw/points/") && !cmd.contains("--run-dir"), "{cmd}");
            if r["keys"]["nproc"] == 2 {
                assert!(cmd.contains("launch --nproc-per-node 2 -- train"), "{cmd}");
                assert!(f["comm_bytes_per_step"].as_f64().expect("bytes") > 0.0, "{f}");
            }
        }
    }

    // a second sweep into the same directory without --resume is refused
    let again = vitscale(cwd, &["sweep", spec.to_str().expect("utf-8"), "--out", "sw"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--resume"));

    // --resume reruns nothing that is done: no point runs, no run directory is touched
    let metrics = dir.join(recs[0]["run_dir"].as_str().expect("run dir")).join("metrics.jsonl");
    let before = std::fs::metadata(&metrics).and_then(|m| m.modified()).expect("mtime");
    let resumed = vitscale(cwd, &["sweep", spec.to_str().expect("utf-8"), "--out", "sw", "--resume", "--json"]);
    assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
    let o = last_json(&resumed);
    assert_eq!((o["ran"].as_u64(), o["skipped"].as_u64()), (Some(0), Some(12)), "{o}");
    assert_eq!(std::fs::metadata(&metrics).and_then(|m| m.modified()).expect("mtime"), before);
    assert_eq!(records(&dir).len(), 12);
    // a point lost from sweep.jsonl (the sweep was stopped during it) is the only one rerun
    let text = std::fs::read_to_string(dir.join("sweep.jsonl")).expect("read");
    let lost: serde_json::Value = serde_json::from_str(text.lines().nth(2).expect("line 3")).expect("json");
    let kept: Vec<&str> = text.lines().enumerate().filter(|(i, _)| *i != 2).map(|(_, l)| l).collect();
    std::fs::write(dir.join("sweep.jsonl"), kept.join("\n") + "\n").expect("write");
    let resumed = vitscale(cwd, &["sweep", spec.to_str().expect("utf-8"), "--out", "sw", "--resume", "--json"]);
    let o = last_json(&resumed);
    assert_eq!((o["ran"].as_u64(), o["skipped"].as_u64()), (Some(1), Some(11)), "{o}");
    let recs = records(&dir);
    assert_eq!(recs.last().expect("a line")["id"], lost["id"]);

    // the report: every point in the table, the failures with their reason, charts as files
    let rep = vitscale(cwd, &["report", "sw", "--json"]);
    assert!(rep.status.success(), "report failed: {}", String::from_utf8_lossy(&rep.stderr));
    let r = last_json(&rep);
    let md = std::fs::read_to_string(dir.join("report.md")).expect("report.md");
    let html = std::fs::read_to_string(dir.join("report.html")).expect("report.html");
    for rec in &recs {
        let id = rec["id"].as_str().expect("id");
        assert!(md.contains(id) && html.contains(id), "{id} missing from the report");
    }
    assert!(md.contains("larger than the training set"), "the failure's reason is in the report");
    assert!(md.contains("## Findings checked against the data"));
    for chart in ["throughput", "breakdown", "scaling_strong", "scaling_weak", "comm_share", "gas", "memory"] {
        let png = dir.join("charts").join(format!("{chart}.png"));
        check_png(&png);
        let svg = std::fs::read_to_string(dir.join("charts").join(format!("{chart}.svg"))).expect("svg");
        assert!(svg.starts_with("<svg") && svg.contains("<text"), "{chart}.svg has no text");
        assert!(md.contains(&format!("charts/{chart}.png")), "report.md links {chart}");
    }
    // self-contained: the images are inside the HTML, nothing is fetched
    assert_eq!(html.matches("src=\"data:image/png;base64,").count(), 7);
    assert!(!html.contains("src=\"charts/") && !html.contains("http://") && !html.contains("https://"));
    // every finding carries a verdict computed from the data
    let findings = r["findings"].as_array().expect("findings");
    assert!(findings.len() >= 7);
    for f in findings {
        let v = f["verdict"]["verdict"].as_str().expect("verdict");
        assert!(["true", "false", "not_checked"].contains(&v), "{f}");
    }
    // this grid has both rank counts at each per-rank batch: weak scaling is checked
    assert!(findings.iter().any(|f| f["statement"].as_str().unwrap_or("").contains("weak scaling") && f["verdict"]["verdict"] != "not_checked"));
}

#[test]
fn a_point_past_its_timeout_is_stopped_with_its_workers_and_recorded() {
    let tmp = tmp();
    let cwd = tmp.path();
    let spec = serde_json::json!({
        "base": {"model": {"preset": "vit_builtin_default"}, "data": {"dataset": "builtin", "train_size": 512, "val_size": 32, "num_workers": 1}},
        "grid": {"nproc": [2]},
        "steps": 1000000, "warmup_steps": 1, "timeout_s": 2
    });
    std::fs::write(cwd.join("long.json"), spec.to_string()).expect("write");
    let t = std::time::Instant::now();
    let out = vitscale(cwd, &["sweep", "long.json", "--out", "sw", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // 2 s of running plus at most the 5 s grace between SIGTERM and SIGKILL
    assert!(t.elapsed().as_secs_f64() < 30.0, "took {:?}", t.elapsed());
    let r = &records(&cwd.join("sw"))[0];
    assert_eq!(r["status"], "failed");
    assert!(r["reason"].as_str().expect("reason").contains("timeout"), "{r}");
    // the workers are gone: their metrics stop growing
    let m = cwd.join("sw/points").join(r["id"].as_str().expect("id")).join("run/rank1/metrics.jsonl");
    let len = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    let a = len(&m);
    std::thread::sleep(std::time::Duration::from_millis(800));
    assert_eq!(a, len(&m), "a worker is still writing after the sweep returned");
}

#[test]
fn bad_specs_and_missing_sweeps_get_clear_errors() {
    let tmp = tmp();
    let cwd = tmp.path();
    std::fs::write(cwd.join("bad.json"), r#"{"base": "nowhere.json", "grid": {"nproc": [1]}}"#).expect("write");
    let out = vitscale(cwd, &["sweep", "bad.json"]);
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("bad.json") && e.contains("nowhere.json"), "{e}");
    std::fs::write(cwd.join("bad2.json"), r#"{"base": {}, "grid": {"nproc": [1, "two"]}}"#).expect("write");
    let e = String::from_utf8_lossy(&vitscale(cwd, &["sweep", "bad2.json"]).stderr).to_string();
    assert!(e.contains("grid.nproc") && e.contains("\"two\""), "{e}");
    let out = vitscale(cwd, &["report", "nothing-here"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a sweep directory"));
}

#[test]
fn every_study_spec_loads_and_every_point_resolves() {
    let dir = repo_path("configs/study");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("configs/study") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("json") {
            continue;
        }
        let spec = vitscale::lab::spec::SweepSpec::load(&path).unwrap_or_else(|e| panic!("{e}"));
        for p in spec.points() {
            let cfg = spec.point_config(&p).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            vitscale::config::resolve(&cfg, p.nproc()).unwrap_or_else(|e| panic!("{} point {}: {e}", path.display(), p.id));
        }
        n += 1;
    }
    assert!(n >= 5, "found {n} specs");
}

#[test]
fn bench_comm_over_cpu_ranks_reports_nccl_tests_columns() {
    let tmp = tmp();
    let port = free_port();
    let out = vitscale(
        tmp.path(),
        &["launch", "--nproc-per-node", "3", "--master-port", &port.to_string(), "--", "bench", "--comm", "--device", "cpu",
          "--comm-min-bytes", "1000", "--comm-max-bytes", "64000", "--comm-iters", "3", "--warmup", "1", "--json"],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("algbw (GB/s)") && stdout.contains("busbw (GB/s)") && stdout.contains("#wrong"), "{stdout}");
    let r = last_json(&out);
    assert_eq!(r["world_size"], 3);
    let rows = r["rows"].as_array().expect("rows");
    // 1000 B .. 64000 B doubling: 7 sizes per collective, each a multiple of 3 floats
    assert_eq!(rows.len(), 3 * 7, "{r}");
    for row in rows {
        let (bytes, count) = (row["bytes"].as_u64().expect("bytes"), row["count"].as_u64().expect("count"));
        assert_eq!(bytes, count * 4);
        assert_eq!(count % 3, 0);
        assert_eq!(row["wrong"], 0, "{row}");
        let (t, alg, bus) = (row["time_us"].as_f64().expect("t"), row["algbw_gb_s"].as_f64().expect("alg"), row["busbw_gb_s"].as_f64().expect("bus"));
        assert!(t > 0.0 && (alg - bytes as f64 / (t * 1e-6) / 1e9).abs() <= 1e-9 * alg.max(1.0), "{row}");
        let factor = if row["op"] == "all_reduce" { 4.0 / 3.0 } else { 2.0 / 3.0 };
        assert!((bus - alg * factor).abs() <= 1e-9 * bus.max(1.0), "{row}");
    }
    let ops: std::collections::BTreeSet<&str> = rows.iter().filter_map(|r| r["op"].as_str()).collect();
    assert_eq!(ops.into_iter().collect::<Vec<_>>(), vec!["all_gather", "all_reduce", "reduce_scatter"]);
}

/// The all-to-all, on request: every rank's result checked element by element (`#wrong` 0
/// at every size over 3 ranks), nccl-tests' (n−1)/n bus factor.
#[test]
fn bench_comm_measures_the_all_to_all_on_request() {
    let tmp = tmp();
    let port = free_port();
    let out = vitscale(
        tmp.path(),
        &["launch", "--nproc-per-node", "3", "--master-port", &port.to_string(), "--", "bench", "--comm", "--device", "cpu",
          "--comm-ops", "all_to_all", "--comm-min-bytes", "1000", "--comm-max-bytes", "64000", "--comm-iters", "3", "--warmup", "1", "--json"],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r = last_json(&out);
    let rows = r["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 7, "{r}");
    for row in rows {
        assert_eq!(row["op"], "all_to_all", "{row}");
        assert_eq!(row["wrong"], 0, "{row}");
        let (alg, bus) = (row["algbw_gb_s"].as_f64().expect("alg"), row["busbw_gb_s"].as_f64().expect("bus"));
        assert!((bus - alg * 2.0 / 3.0).abs() <= 1e-9 * bus.max(1.0), "{row}");
    }
}

/// A sweep over an emulated slowdown × the split: every point records its mixed-speed
/// figures, and the report has their table and the chart of equal split, balanced and ideal.
#[test]
fn a_mixed_speed_sweep_reports_equal_split_balanced_and_ideal() {
    let tmp = tmp();
    let cwd = tmp.path();
    let spec = serde_json::json!({
        "name": "mixed-test",
        "base": {
            "model": {"preset": "vit_builtin_default"},
            "data": {"dataset": "builtin", "train_size": 1024, "val_size": 32, "num_workers": 1},
            "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
        },
        "set": {"train.eval_batch_size": 32, "train.balance_every": 2, "train_micro_batch_size_per_gpu": 32},
        "grid": {"nproc": [2], "train.emulate_slowdown": [{"1": 1.0}, {"1": 2.0}], "train.balance": ["off", "auto"]},
        "device": "cpu", "steps": 10, "warmup_steps": 2, "timeout_s": 120
    });
    std::fs::write(cwd.join("spec.json"), serde_json::to_vec_pretty(&spec).expect("json")).expect("write spec");
    let out = vitscale(cwd, &["sweep", "spec.json", "--out", "sw", "--json"]);
    assert!(out.status.success(), "sweep failed: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(last_json(&out)["ok"], 4);
    for r in records(&cwd.join("sw")) {
        let b = &r["figures"]["balance"];
        let (ideal, ips) = (b["ideal_images_per_s"].as_f64().unwrap_or(0.0), r["figures"]["images_per_s"].as_f64().unwrap_or(0.0));
        assert!(ideal > 0.0 && ips > 0.0 && b["compute_bound_images_per_s"].as_f64().unwrap_or(0.0) > 0.0, "{r}");
        let shares: Vec<f64> = b["shares"].as_array().expect("shares").iter().filter_map(|v| v.as_f64()).collect();
        assert_eq!(shares.len(), 2, "{r}");
        assert!((shares.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{r}");
        if r["keys"]["train.balance"] == "off" {
            assert!(shares.iter().all(|s| *s == 0.5), "{r}");
        }
    }
    let rep = vitscale(cwd, &["report", "sw"]);
    assert!(rep.status.success(), "{}", String::from_utf8_lossy(&rep.stderr));
    let md = std::fs::read_to_string(cwd.join("sw/report.md")).expect("report.md");
    assert!(md.contains("## Mixed-speed ranks") && md.contains("| 2 | 2.00× | auto |") && md.contains("| 2 | 1.00× | off |"), "{md}");
    assert!(md.contains("charts/mixed_speed.png"), "no mixed-speed chart in {md}");
    check_png(&cwd.join("sw/charts/mixed_speed.png"));
}
