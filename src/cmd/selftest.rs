//! `vitscale selftest`: its flags, which checks of `crate::selftest` run on the chosen backend,
//! and their report (one line per check, the two loss sequences, PASS or FAIL).

use crate::backend::cpu::Cpu;
use crate::backend::half::HalfFormat;
use crate::backend::Backend;
use crate::selftest::{attention_path_checks, hopper_gemm_checks, hopper_wgrad_checks, run_parts, Check, Parts};

/// Command-line options of `vitscale selftest`.
#[derive(clap::Args, Debug, Clone)]
pub struct SelftestArgs {
    /// Backend to check against the CPU reference: cuda, cpu, or auto (a GPU when one is
    /// usable, else the CPU, saying so).
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// GPU index.
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Seed for the random inputs (default: fresh each run).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print one JSON object as the last line.
    #[arg(long)]
    pub json: bool,
    /// Only compile every CUDA kernel module for this architecture (e.g. sm_90, sm_80, or
    /// compute_75 for PTX as `VITSCALE_CUDA_ARCH=sm_75` builds it) with NVRTC and report
    /// each, for the 16-bit format `--half` names (both when not given): needs the NVRTC
    /// library, no GPU.
    #[arg(long, value_name = "ARCH")]
    pub compile_kernels: Option<String>,
    /// The GPU's 16-bit compute format to check: bf16 or fp16 (as a run with a bf16 or fp16
    /// block computes). Default: what a run without either block gets (bf16; fp16 before
    /// Ampere, also under `VITSCALE_CUDA_ARCH=sm_75`).
    #[arg(long, value_name = "FORMAT")]
    pub half: Option<String>,
    /// Only these parts of the checks, comma-separated: ops, optimizer, training, gemm,
    /// attention, half, decode, comm (default: all). The report says which ran.
    #[arg(long, value_name = "PARTS")]
    pub only: Option<String>,
}

/// `--half`: the format by name.
fn parse_half(v: &str) -> anyhow::Result<HalfFormat> {
    match v.trim().to_ascii_lowercase().as_str() {
        "bf16" | "bfloat16" => Ok(HalfFormat::Bf16),
        "fp16" | "f16" | "float16" => Ok(HalfFormat::F16),
        other => anyhow::bail!("--half: {other:?} is not a 16-bit format; expected bf16 or fp16"),
    }
}

/// `--compile-kernels ARCH`: one line per module and format; an error when any failed to
/// compile.
fn compile_kernels(arch: &str, halves: &[HalfFormat]) -> anyhow::Result<()> {
    if !crate::backend::cuda::compile::is_arch_name(arch) {
        anyhow::bail!("--compile-kernels: {arch:?} is not an architecture name like sm_90, sm_80 or compute_75 (PTX)");
    }
    let (maj, min) = crate::backend::cuda::compile::nvrtc_version()
        .map_err(|e| anyhow::anyhow!("--compile-kernels needs the NVRTC library (libnvrtc), which could not be loaded: {e}"))?;
    crate::outln!("compiling every kernel module for {arch} with NVRTC {maj}.{min}");
    let mut failed = 0;
    for (module, r) in halves.iter().flat_map(|&h| crate::backend::cuda::compile::compile_all(arch, h)) {
        match r {
            Ok(bytes) => crate::outln!("  ok   {module:<28} {bytes} bytes of {}", if arch.starts_with("compute_") { "PTX" } else { "cubin" }),
            Err(e) => {
                failed += 1;
                crate::outln!("  FAIL {module}\n{e}");
            }
        }
    }
    if failed > 0 {
        anyhow::bail!("{failed} kernel modules failed to compile for {arch}");
    }
    crate::outln!("every module compiled");
    Ok(())
}

/// What ran and how it went, for the report.
struct Outcome<'a> {
    name: &'a str,
    seed: u64,
    /// The parts that ran; `only`: picked with `--only`.
    parts: Parts,
    only: bool,
    checks: &'a [Check],
    dev: &'a [f32],
    cpu: &'a [f32],
}

/// The report; `others`: (world, failed checks of ranks 1..world) under a launcher. A run of
/// some parts (`--only`) names them on its last line, so it is not read as a whole selftest.
fn report(o: &Outcome, json: bool, others: Option<(usize, usize)>) -> bool {
    let ok = o.checks.iter().all(|c| c.pass) && others.is_none_or(|(_, f)| f == 0);
    let only = o.only.then(|| o.parts.names().join(", "));
    crate::outln!("selftest on {} (seed {}){}", o.name, o.seed, only.as_ref().map_or(String::new(), |p| format!(", only: {p}")));
    for c in o.checks {
        crate::outln!("  {} {:<78} rel err {:.2e} (tol {:.0e})", if c.pass { "ok  " } else { "FAIL" }, c.name, c.rel_err, c.tol);
    }
    if !o.dev.is_empty() || !o.cpu.is_empty() {
        crate::outln!("  losses device: {}", o.dev.iter().map(|v| format!("{v:.4}")).collect::<Vec<_>>().join(" "));
        crate::outln!("  losses cpu:    {}", o.cpu.iter().map(|v| format!("{v:.4}")).collect::<Vec<_>>().join(" "));
    }
    let failed = o.checks.iter().filter(|c| !c.pass).count();
    if let Some((world, f)) = others {
        crate::outln!("ranks 1..{}: {f} failed checks", world - 1);
    }
    let scope = only.as_ref().map_or(String::new(), |p| format!(" (only {p})"));
    crate::outln!("{} checks, {} failed: {}{scope}", o.checks.len(), failed, if ok { "PASS" } else { "FAIL" });
    if json {
        crate::outln!("{}", serde_json::json!({"device": o.name, "seed": o.seed, "pass": ok, "parts": o.parts.names(), "checks": o.checks, "losses_device": o.dev, "losses_cpu": o.cpu, "other_ranks_failed": others.map(|o| o.1)}));
    }
    ok
}

/// The communicator's checks (`selftest::comm`) on `comm`, with rank 0's seed.
fn comm_checks<B: Backend>(be: &B, comm: &mut dyn crate::comm::Comm<B::Buf>, seed: u64) -> anyhow::Result<Vec<Check>> {
    let mut shared = [if comm.rank() == 0 { (seed % (1 << 52)) as f64 } else { 0.0 }];
    comm.all_reduce_host(&mut shared)?;
    Ok(crate::selftest::comm::comm_checks(be, comm, shared[0] as u64)?)
}

/// Under a launcher every rank checks; rank 0 reports, with the other ranks' failure count.
fn report_ranks(comm: &mut dyn crate::comm::Comm<impl Sized>, o: &Outcome, json: bool) -> anyhow::Result<bool> {
    let mut failed = [o.checks.iter().filter(|c| !c.pass).count() as f64];
    let own = failed[0];
    comm.all_reduce_host(&mut failed)?;
    if comm.rank() != 0 {
        return Ok(own == 0.0);
    }
    let others = (comm.world_size() > 1).then(|| (comm.world_size(), (failed[0] - own) as usize));
    Ok(report(o, json, others))
}

/// One pass of the device checks on GPU `gpu` opened for the 16-bit format `half` (None: as a
/// run without a precision block): (every check passed, the seed).
#[allow(clippy::too_many_arguments)]
fn cuda_pass(gpu: usize, half: Option<HalfFormat>, seed: Option<u64>, parts: Parts, env: &crate::comm::DistEnv, opts: &crate::comm::CommOptions, json: bool) -> anyhow::Result<(bool, u64)> {
    // the precision a run that asks for this format has
    let precision = match half {
        None => crate::config::Precision::Fp32,
        Some(HalfFormat::Bf16) => crate::config::Precision::Bf16,
        Some(HalfFormat::F16) => crate::config::fp16_defaults(),
    };
    let be = crate::backend::cuda::Cuda::for_precision(gpu, &precision)?;
    if env.rank == 0 {
        if let Some(n) = be.half_notice() {
            crate::outln!("notice: {n}");
        }
        crate::outln!("compute format: {}", be.half_format().name());
    }
    let chosen = be.attention_path();
    // A pass takes tens of seconds, most of it the CPU references of the long attention
    // shapes: say which part runs, on stderr, so a slow part is told from a stuck one.
    let t0 = std::time::Instant::now();
    let stage = |what: &str| {
        if env.rank == 0 {
            crate::errln!("selftest: {what} ({:.1} s)", t0.elapsed().as_secs_f64());
        }
    };
    stage("operator and training checks");
    let (seed, mut checks, d, c) = run_parts(&be, seed, parts)?;
    if parts.gemm {
        stage("hopper GEMM checks");
        match hopper_gemm_checks(&be, seed) {
            Ok(Some(cs)) => checks.extend(cs),
            Ok(None) => crate::outln!("hopper GEMM kernel not compiled for this device and format (sm_90 with bf16 only): its checks skipped"),
            Err(e) => checks.push(Check { name: format!("hopper GEMM checks: {e}"), rel_err: f64::NAN, tol: 0.0, pass: false }),
        }
        match hopper_wgrad_checks(&be, seed) {
            Ok(Some(cs)) => checks.extend(cs),
            Ok(None) => {}
            Err(e) => checks.push(Check { name: format!("weight-gradient kernel checks: {e}"), rel_err: f64::NAN, tol: 0.0, pass: false }),
        }
    }
    if parts.attention {
        checks.extend(attention_path_checks(&be, seed, &|what| stage(what))?);
    }
    if parts.half {
        stage("16-bit format checks");
        checks.extend(crate::selftest::half::half_format_checks(&be, seed)?);
    }
    if parts.decode {
        stage("JPEG decode checks");
        checks.extend(crate::selftest::decode::decode_checks(&be, seed)?);
    }
    // the communicator also gathers the other ranks' failures for the report
    let mut comm = crate::backend::cuda::nccl::NcclComm::connect(env, opts, "selftest", &be)?;
    if parts.comm {
        stage("communicator checks");
        checks.extend(comm_checks(&be, &mut comm, seed)?);
    }
    stage("done");
    if env.rank == 0 && (parts.training || parts.attention) {
        crate::outln!("attention path for the model checks: {}", chosen.name());
    }
    let outcome = Outcome { name: &be.name(), seed, parts, only: parts != Parts::ALL, checks: &checks, dev: &d, cpu: &c };
    Ok((report_ranks(&mut comm, &outcome, json)?, seed))
}

/// `vitscale selftest`: the report, then an error when any check failed.
pub fn run(args: SelftestArgs) -> anyhow::Result<()> {
    let half = args.half.as_deref().map(parse_half).transpose()?;
    if let Some(arch) = &args.compile_kernels {
        return compile_kernels(arch, &half.map_or(vec![HalfFormat::Bf16, HalfFormat::F16], |h| vec![h]));
    }
    let parts = args.only.as_deref().map(Parts::parse).transpose().map_err(|e| anyhow::anyhow!("--only: {e}"))?.unwrap_or(Parts::ALL);
    let env = crate::comm::DistEnv::detect()?;
    // The ranks meet only after their own device checks, which take a minute or more and can
    // end minutes apart (ranks sharing one GPU and the host's cores): the rendezvous waits up
    // to 10 minutes, a collective once met 60 s; the variables override both.
    let base = crate::comm::CommOptions { timeout: std::time::Duration::from_secs(60), rendezvous_timeout: std::time::Duration::from_secs(600) };
    let opts = crate::comm::CommOptions::over(base, |k| std::env::var(k).ok())?;
    let device = super::common::resolve_device_name(&args.device, args.gpu);
    let ok = match device.as_str() {
        "cuda" | "gpu" => {
            let gpu = if env.world_size > 1 { super::train::gpu_index(&env)? } else { args.gpu };
            // Without --half: the default format, then on one process the other one the GPU
            // computes in (fp16 from Ampere on; bf16 has no hardware before it). Under a
            // launcher one format a run (--half), so the ranks meet once.
            let formats = match half {
                Some(h) => vec![h],
                None => {
                    let info = crate::backend::cuda::probe(gpu).map_err(|e| anyhow::anyhow!("--device cuda: GPU {gpu}: {e}"))?;
                    let cc = crate::backend::cuda::compile::forced_capability()?.unwrap_or(info.compute_capability);
                    let first = crate::backend::half::choose(&crate::config::Precision::Fp32, cc, &info.name).map_err(|e| anyhow::anyhow!(e))?.format;
                    match (first, env.world_size) {
                        (HalfFormat::Bf16, 1) => vec![HalfFormat::Bf16, HalfFormat::F16],
                        _ => vec![first],
                    }
                }
            };
            // every pass draws the same inputs (the first pass's seed)
            let (mut ok, mut last_seed) = (true, None);
            for (i, &h) in formats.iter().enumerate() {
                let seed = if i == 0 { args.seed } else { args.seed.or(last_seed) };
                let (pass_ok, s) = cuda_pass(gpu, Some(h).filter(|_| half.is_some() || i > 0), seed, parts, &env, &opts, args.json)?;
                last_seed = Some(s);
                ok &= pass_ok;
            }
            ok
        }
        "cpu" => {
            let ran = parts.on_cpu();
            if args.only.is_some() && ran != parts {
                let gpu_only: Vec<&str> = parts.names().into_iter().filter(|n| !ran.names().contains(n)).collect();
                anyhow::bail!("--only {}: GPU parts, checked with --device cuda; on the CPU the parts are {}", gpu_only.join(","), Parts::ALL.on_cpu().names().join(", "));
            }
            let be = Cpu::new();
            let (seed, mut checks, d, c) = run_parts(&be, args.seed, parts)?;
            let mut comm = crate::comm::init_cpu(&env, &opts, "selftest")?;
            if parts.comm {
                checks.extend(comm_checks(&be, comm.as_mut(), seed)?);
            }
            let outcome = Outcome { name: &be.name(), seed, parts: ran, only: ran != Parts::ALL.on_cpu(), checks: &checks, dev: &d, cpu: &c };
            report_ranks(comm.as_mut(), &outcome, args.json)?
        }
        other => anyhow::bail!("--device must be cuda, cpu or auto, got {other:?}"),
    };
    if !ok {
        anyhow::bail!("selftest failed");
    }
    Ok(())
}
