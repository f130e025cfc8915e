//! `vitscale selftest`: its flags, which checks of `crate::selftest` run on the chosen backend,
//! and their report (one line per check, the two loss sequences, PASS or FAIL).

use crate::backend::cpu::Cpu;
use crate::backend::Backend;
use crate::selftest::{attention_path_checks, hopper_gemm_checks, run_checks, Check};

/// Command-line options of `vitscale selftest`.
#[derive(clap::Args, Debug, Clone)]
pub struct SelftestArgs {
    /// Backend to check against the CPU reference: cuda (default) or cpu.
    #[arg(long, default_value = "cuda")]
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
}

fn report(name: &str, seed: u64, checks: &[Check], dev: &[f32], cpu: &[f32], json: bool) -> bool {
    let ok = checks.iter().all(|c| c.pass);
    println!("selftest on {name} (seed {seed})");
    for c in checks {
        println!("  {} {:<78} rel err {:.2e} (tol {:.0e})", if c.pass { "ok  " } else { "FAIL" }, c.name, c.rel_err, c.tol);
    }
    println!("  losses device: {}", dev.iter().map(|v| format!("{v:.4}")).collect::<Vec<_>>().join(" "));
    println!("  losses cpu:    {}", cpu.iter().map(|v| format!("{v:.4}")).collect::<Vec<_>>().join(" "));
    let failed = checks.iter().filter(|c| !c.pass).count();
    println!("{} checks, {} failed: {}", checks.len(), failed, if ok { "PASS" } else { "FAIL" });
    if json {
        println!("{}", serde_json::json!({"device": name, "seed": seed, "pass": ok, "checks": checks, "losses_device": dev, "losses_cpu": cpu}));
    }
    ok
}

/// `vitscale selftest`: the report, then an error when any check failed.
pub fn run(args: SelftestArgs) -> anyhow::Result<()> {
    let ok = match args.device.as_str() {
        "cuda" | "gpu" => {
            let be = crate::backend::cuda::Cuda::new(args.gpu)?;
            let chosen = be.attention_path();
            let (seed, mut checks, d, c) = run_checks(&be, args.seed)?;
            match hopper_gemm_checks(&be, seed) {
                Ok(Some(cs)) => checks.extend(cs),
                Ok(None) => println!("hopper GEMM kernel not compiled for this device (sm_90 only): its checks skipped"),
                Err(e) => checks.push(Check { name: format!("hopper GEMM checks: {e}"), rel_err: f64::NAN, tol: 0.0, pass: false }),
            }
            checks.extend(attention_path_checks(&be, seed)?);
            println!("attention path for the model checks: {}", chosen.name());
            report(&be.name(), seed, &checks, &d, &c, args.json)
        }
        "cpu" => {
            let be = Cpu::new();
            let (seed, checks, d, c) = run_checks(&be, args.seed)?;
            report(&be.name(), seed, &checks, &d, &c, args.json)
        }
        other => anyhow::bail!("--device must be cuda or cpu, got {other:?}"),
    };
    if !ok {
        anyhow::bail!("selftest failed");
    }
    Ok(())
}
