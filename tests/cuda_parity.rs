//! CUDA backend vs the CPU reference: every op plus 20 training steps (see `vitscale::selftest`).
//! Runs when a GPU and the CUDA libraries are found; otherwise prints why and passes (CI has no GPU).

#[test]
fn cuda_backend_matches_cpu() {
    if let Err(why) = vitscale::backend::cuda::cuda_available() {
        eprintln!("skipping the CUDA parity test: {why}");
        return;
    }
    let be = match vitscale::backend::cuda::Cuda::new(0) {
        Ok(b) => b,
        Err(e) => panic!("a GPU was found but the CUDA backend failed to start: {e}"),
    };
    let (seed, checks, dev, cpu) = vitscale::selftest::run_checks(&be, None).expect("parity run failed");
    let failed: Vec<_> = checks.iter().filter(|c| !c.pass).collect();
    assert!(failed.is_empty(), "seed {seed}: failed checks {failed:#?}\nlosses device {dev:?}\nlosses cpu {cpu:?}");
    // Every attention path (gemm, fused, fused-pipe) at the shapes that matter.
    for path in vitscale::backend::cuda::AttentionPath::ALL {
        be.set_attention(path);
        let checks = vitscale::selftest::attention_checks(&be, seed ^ path as u64, path.name()).expect("attention checks failed to run");
        let failed: Vec<_> = checks.iter().filter(|c| !c.pass).collect();
        assert!(failed.is_empty(), "seed {seed}, attention path {}: failed checks {failed:#?}", path.name());
    }
}

#[test]
fn probe_never_panics() {
    // Whatever the machine has, the probe answers with a value.
    let _ = vitscale::backend::cuda::probe(0);
    let _ = vitscale::backend::cuda::probe(1 << 20);
}
