//! DeepSpeed's monitoring keys through the binary: `tensorboard` and `csv_monitor` blocks on a
//! 2-rank CPU run write rank 0's files under `<output_path>/<job_name>/` (the event file's
//! TFRecord framing and checksums are checked here; TensorBoard's own reader checks it too when
//! python3 with `tensorboard` is installed, else that part says it is skipped), the CSV files
//! follow DeepSpeed's layout and agree with metrics.jsonl, and `wall_clock_breakdown` prints
//! the phases.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod common;
use common::{free_port, metrics, repo_path, tmp, EXE};

/// The records of a TFRecord file, each checksum verified.
fn tfrecords(path: &Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(path).expect("event file");
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let len_bytes = &bytes[i..i + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let crc = u32::from_le_bytes(bytes[i + 8..i + 12].try_into().expect("4 bytes"));
        assert_eq!(crc, vitscale::metrics::tfevents::masked_crc32c(len_bytes), "length checksum at offset {i}");
        let data = &bytes[i + 12..i + 12 + len];
        let dcrc = u32::from_le_bytes(bytes[i + 12 + len..i + 16 + len].try_into().expect("4 bytes"));
        assert_eq!(dcrc, vitscale::metrics::tfevents::masked_crc32c(data), "data checksum at offset {i}");
        out.push(data.to_vec());
        i += 16 + len;
    }
    assert_eq!(i, bytes.len(), "no trailing bytes");
    out
}

fn csv(path: &Path) -> (String, Vec<(u64, f64)>) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut lines = text.lines();
    let header = lines.next().expect("header").to_string();
    let rows = lines
        .map(|l| {
            let (s, v) = l.split_once(',').expect("step,value");
            (s.parse().expect("step"), v.parse().expect("value"))
        })
        .collect();
    (header, rows)
}

#[test]
fn tensorboard_and_csv_monitors_write_deepspeeds_layout() {
    let tmp = tmp();
    let run = tmp.path().join("run");
    let logs = tmp.path().join("logs");
    let port = free_port();
    let out = Command::new(EXE)
        .args(["launch", "--nproc-per-node", "2", "--master-port", &port.to_string(), "--", "train", "--device", "cpu"])
        .args(["--set", "train.steps=6", "--set", "steps_per_print=2", "--set", "train_micro_batch_size_per_gpu=16"])
        .args(["--set", "data.train_size=256", "--set", "data.val_size=32", "--set", "wall_clock_breakdown=true"])
        .arg("--set")
        .arg(format!("tensorboard={{\"enabled\": true, \"output_path\": \"{}\", \"job_name\": \"tb_job\"}}", logs.display()))
        .args(["--set", "csv_monitor={\"enabled\": true, \"job_name\": \"csv_job\"}"])
        .arg("--run-dir")
        .arg(&run)
        .stdin(Stdio::null())
        .output()
        .expect("run vitscale");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // wall_clock_breakdown: one phase line per logged step (3 logged steps: 2, 4, 6)
    assert_eq!(stderr.matches("time (ms) per step | data:").count(), 3, "{stderr}");

    // metrics.jsonl is the reference: steps 2, 4, 6 at 64, 128, 192 global samples (32 a step)
    let recs = metrics(&run, None);
    assert_eq!(recs.len(), 3);

    // csv_monitor: output_path "" = the run directory; rank 1 writes none
    let dir = run.join("csv_job");
    let (header, rows) = csv(&dir.join("Train_Samples_train_loss.csv"));
    assert_eq!(header, "step,train_loss");
    assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), vec![64, 128, 192]);
    for (row, rec) in rows.iter().zip(&recs) {
        let loss = rec["loss"].as_f64().expect("loss");
        assert!((row.1 - loss).abs() <= 1e-12 * loss.abs().max(1.0), "{row:?} vs {loss}");
    }
    let (header, rows) = csv(&dir.join("Train_Samples_elapsed_time_ms_forward.csv"));
    assert_eq!(header, "step,elapsed_time_ms_forward");
    // per step: the record's window is 2 steps
    let fwd = recs[2]["forward_s"].as_f64().expect("forward") * 1e3 / 2.0;
    assert!((rows[2].1 - fwd).abs() <= 1e-9 * fwd.max(1.0));
    for tag in ["lr", "images_per_s", "elapsed_time_ms_backward", "elapsed_time_ms_backward_allreduce", "elapsed_time_ms_step"] {
        assert!(dir.join(format!("Train_Samples_{tag}.csv")).exists(), "{tag}");
    }
    assert!(!run.join("rank1").join("csv_job").exists(), "only rank 0 writes monitors");

    // tensorboard: one event file with a version record and 3 scalar events
    let tb_dir = logs.join("tb_job");
    let files: Vec<PathBuf> = std::fs::read_dir(&tb_dir).expect("tb dir").map(|e| e.expect("entry").path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0].file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("events.out.tfevents.")));
    let records = tfrecords(&files[0]);
    assert_eq!(records.len(), 4);
    assert!(records[0].windows(13).any(|w| w == b"brain.Event:2"));
    for r in &records[1..] {
        for tag in ["Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/images_per_s", "Train/Samples/elapsed_time_ms_forward"] {
            assert!(r.windows(tag.len()).any(|w| w == tag.as_bytes()), "{tag}");
        }
    }

    // TensorBoard's own reader, when it is installed: every CSV value at its step
    let mut expected = serde_json::Map::new();
    for entry in std::fs::read_dir(&dir).expect("csv dir") {
        let p = entry.expect("entry").path();
        let name = p.file_stem().and_then(|s| s.to_str()).expect("name").to_string();
        let tag = format!("Train/Samples/{}", name.trim_start_matches("Train_Samples_"));
        let (_, rows) = csv(&p);
        // the event file holds f32
        let pts: Vec<serde_json::Value> = rows.iter().map(|(s, v)| serde_json::json!([s, *v as f32 as f64])).collect();
        expected.insert(tag, pts.into());
    }
    let exp = tmp.path().join("expected.json");
    std::fs::write(&exp, serde_json::Value::Object(expected).to_string()).expect("write");
    let script = repo_path("scripts/check_tensorboard.py");
    match Command::new("python3").arg(&script).arg(&tb_dir).arg(&exp).output() {
        Err(e) => eprintln!("skipped TensorBoard's reader: python3 cannot run ({e})"),
        Ok(o) if o.status.code() == Some(3) => eprintln!("skipped TensorBoard's reader: {}", String::from_utf8_lossy(&o.stderr).trim()),
        Ok(o) => assert!(o.status.success(), "TensorBoard's reader: {}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)),
    }
}
