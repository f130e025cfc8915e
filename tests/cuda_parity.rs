//! The CUDA backend against the CPU reference, and the GPU probe behind `--device auto`.
//!
//! `cuda_backend_matches_cpu` (every op plus 20 training steps, see `vitscale::selftest`, then
//! every attention path) needs a GPU, so it is `#[ignore]`d: a plain `cargo test` reports it as
//! ignored, never as passed. On a GPU machine run it with
//! `cargo test --release --test cuda_parity -- --ignored`; run that way where no GPU is usable,
//! it fails and says why. (`vitscale selftest --device cuda`, which the GPU scripts run, makes
//! the same checks and more.)
//!
//! The probe tests run everywhere and check the answer on both kinds of machine: with a GPU,
//! a consistent description of it; without one, an error that names what is missing.

use vitscale::backend::cuda::{probe, DeviceInfo};

#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine"]
fn cuda_backend_matches_cpu() {
    let gpu = probe(0).unwrap_or_else(|why| panic!("the CUDA parity test needs a usable GPU 0 and found none: {why}"));
    eprintln!("CUDA parity on {} ({})", gpu.name, gpu.arch());
    let be = match vitscale::backend::cuda::Cuda::new(0) {
        Ok(b) => b,
        Err(e) => panic!("a GPU was found but the CUDA backend failed to start: {e}"),
    };
    let (seed, checks, dev, cpu) = vitscale::selftest::run_checks(&be, None).expect("parity run failed");
    assert!(!checks.is_empty(), "the parity run made no checks");
    let failed: Vec<_> = checks.iter().filter(|c| !c.pass).collect();
    assert!(failed.is_empty(), "seed {seed}: failed checks {failed:#?}\nlosses device {dev:?}\nlosses cpu {cpu:?}");
    // Every attention path (gemm, fused, fused-pipe) at the shapes that matter.
    for path in vitscale::backend::cuda::AttentionPath::ALL {
        be.set_attention(path);
        let checks = vitscale::selftest::attention_checks(&be, seed ^ path as u64, path.name()).expect("attention checks failed to run");
        assert!(!checks.is_empty(), "attention path {}: no checks made", path.name());
        let failed: Vec<_> = checks.iter().filter(|c| !c.pass).collect();
        assert!(failed.is_empty(), "seed {seed}, attention path {}: failed checks {failed:#?}", path.name());
    }
}

/// The same parity run with the GPU computing in fp16 (an fp16 block's backend), every
/// attention path included; the format's range ends and overflow path (`selftest::half`).
#[test]
#[ignore = "needs a CUDA GPU: run with --ignored on a GPU machine"]
fn cuda_backend_matches_cpu_in_fp16() {
    probe(0).unwrap_or_else(|why| panic!("the CUDA parity test needs a usable GPU 0 and found none: {why}"));
    let be = vitscale::backend::cuda::Cuda::for_precision(0, &vitscale::config::fp16_defaults())
        .unwrap_or_else(|e| panic!("a GPU was found but the CUDA backend failed to start in fp16: {e}"));
    assert_eq!(be.half_format(), vitscale::backend::half::HalfFormat::F16);
    let (seed, mut checks, dev, cpu) = vitscale::selftest::run_checks(&be, None).expect("fp16 parity run failed");
    checks.extend(vitscale::selftest::half::half_format_checks(&be, seed).expect("fp16 format checks failed to run"));
    for path in vitscale::backend::cuda::AttentionPath::ALL {
        be.set_attention(path);
        checks.extend(vitscale::selftest::attention_checks(&be, seed ^ path as u64, path.name()).expect("attention checks failed to run"));
    }
    let failed: Vec<_> = checks.iter().filter(|c| !c.pass).collect();
    assert!(failed.is_empty(), "seed {seed}, fp16: failed checks {failed:#?}\nlosses device {dev:?}\nlosses cpu {cpu:?}");
}

/// What a successful probe must say about GPU `index`.
fn check_description(info: &DeviceInfo, index: usize) {
    assert_eq!(info.index, index, "{info:?}");
    assert!(info.device_count > index, "GPU {index} described, but the count is {}: {info:?}", info.device_count);
    assert!(!info.name.trim().is_empty(), "{info:?}");
    let (major, minor) = info.compute_capability;
    assert!((3..=20).contains(&major) && (0..10).contains(&minor), "compute capability {major}.{minor}: {info:?}");
    assert_eq!(info.arch(), format!("sm_{major}{minor}"));
    assert!(info.total_mem > 0, "{info:?}");
    assert!(info.multiprocessors > 0, "{info:?}");
    // `domain:bus:device.0`, hex, as NVML names the card
    let parts: Vec<&str> = info.pci_bus_id.split([':', '.']).collect();
    assert!(parts.len() == 4 && parts[3] == "0" && parts[..3].iter().all(|p| !p.is_empty() && u32::from_str_radix(p, 16).is_ok()), "PCI bus id {:?}", info.pci_bus_id);
}

/// Whether a probe error names something that is missing or failing: a library (by file name,
/// with a remedy), the driver, the absence of a GPU, or the context that could not be made.
fn names_the_cause(why: &str) -> bool {
    let library = why.starts_with("cannot load ")
        && ["libcuda.so.1", "libnvrtc.so.13", "libcublasLt.so.13"].iter().any(|l| why.contains(l))
        && why.contains("VITSCALE_CUDA_LIB_DIR");
    library
        || why.starts_with("CUDA driver: ")
        || why == "the CUDA driver reports no GPU"
        || why.starts_with("creating a context on GPU 0: ")
        || why == "loading the CUDA libraries panicked"
}

#[test]
fn probe_describes_gpu_0_or_names_what_is_missing() {
    let first = probe(0);
    match &first {
        Ok(info) => check_description(info, 0),
        Err(why) => assert!(names_the_cause(why), "probe(0) failed without naming the cause: {why:?}"),
    }
    // The answer is the machine's, not the call's: asking again says the same.
    match (&first, probe(0)) {
        (Ok(a), Ok(b)) => assert_eq!((&a.name, &a.pci_bus_id, a.device_count), (&b.name, &b.pci_bus_id, b.device_count)),
        (Err(a), Err(b)) => assert_eq!(*a, b),
        (a, b) => panic!("probe(0) changed its answer: {a:?}, then {b:?}"),
    }
    // `--device auto` decides by exactly this probe.
    assert_eq!(vitscale::backend::cuda::cuda_available().map(|i| i.pci_bus_id), first.map(|i| i.pci_bus_id));
}

#[test]
fn probe_of_a_gpu_that_cannot_exist_is_an_error_naming_it() {
    for index in [1usize << 20, usize::MAX] {
        let why = match probe(index) {
            Ok(info) => panic!("probe({index}) described a GPU: {info:?}"),
            Err(why) => why,
        };
        match probe(0) {
            // The driver counted the GPUs: the error names the index and the count.
            Ok(gpu0) => assert_eq!(why, format!("GPU index {index} out of range: {} GPU(s) present", gpu0.device_count)),
            // Nothing to count (no library, no driver, no GPU): the same cause as for GPU 0,
            // checked before any index is looked at.
            Err(why0) if !why0.starts_with("creating a context") => assert_eq!(why, why0, "probe({index})"),
            // GPU 0 exists but its context failed: the count is known, so the index is named.
            Err(_) => assert!(why.starts_with(&format!("GPU index {index} out of range: ")), "{why}"),
        }
    }
}
