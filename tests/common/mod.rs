//! Helpers the end-to-end tests share: a free loopback port, running the `vitscale` binary,
//! reading safetensors weights and comparing two sets of them.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output, Stdio};

pub const EXE: &str = env!("CARGO_BIN_EXE_vitscale");

/// A port that was free a moment ago (each run takes its own, so tests run in parallel).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("loopback port")
}

/// Runs `vitscale args…` (outside any launcher's run id) and panics with its stderr on failure.
pub fn run(args: &[String]) -> Output {
    let out = Command::new(EXE).args(args).env_remove("VITSCALE_RUN_ID").stdin(Stdio::null()).output().expect("run vitscale");
    if !out.status.success() {
        panic!("vitscale {args:?} failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    out
}

/// Every f32 tensor of a safetensors file, by name.
pub fn tensors(path: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut out: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()))
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Largest |a − b| / (1 + |b|) over every tensor of two files with the same tensors.
pub fn max_rel_diff_files(a: &Path, b: &Path) -> f32 {
    let (ta, tb) = (tensors(a), tensors(b));
    assert_eq!(ta.len(), tb.len(), "{} and {} hold different tensors", a.display(), b.display());
    let mut worst = 0f32;
    for ((na, va), (nb, vb)) in ta.iter().zip(&tb) {
        assert_eq!(na, nb);
        assert_eq!(va.len(), vb.len(), "{na}");
        for (x, y) in va.iter().zip(vb) {
            assert!(x.is_finite() && y.is_finite(), "{na}: non-finite value");
            worst = worst.max((x - y).abs() / (1.0 + y.abs()));
        }
    }
    worst
}

/// The weights a run directory saved (`w.safetensors`).
pub fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    tensors(&dir.join("w.safetensors"))
}

/// `max_rel_diff_files` of the `w.safetensors` two run directories saved.
pub fn max_rel_diff(a: &Path, b: &Path) -> f32 {
    max_rel_diff_files(&a.join("w.safetensors"), &b.join("w.safetensors"))
}
