//! `vitscale sweep SPEC.json [--out DIR] [--resume]`: runs every point of a sweep spec
//! (`crate::lab::spec`) and records them in `DIR/sweep.jsonl` (`crate::lab::sweep`).

use std::path::PathBuf;

use clap::Args;

use crate::lab::{spec::SweepSpec, sweep};

/// Command-line options of `vitscale sweep`.
#[derive(Args, Debug)]
pub struct SweepArgs {
    /// The sweep spec (JSON): base config, `set`, `grid`, `device`, `steps`, `warmup_steps`,
    /// `full_training`, `timeout_s`.
    pub spec: PathBuf,
    /// Directory for sweep.jsonl and the points' run directories (default sweeps/<spec name>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue a sweep in --out: skip the points sweep.jsonl already holds.
    #[arg(long)]
    pub resume: bool,
    /// With --resume: run the failed points again too.
    #[arg(long)]
    pub retry_failed: bool,
    /// Write report.md / report.html when the sweep ends (`vitscale report DIR`).
    #[arg(long)]
    pub report: bool,
    /// Print one JSON object (the outcome) as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

/// `vitscale sweep`: exit 0 when the sweep ran, whether or not some points failed (they are
/// recorded with their reason).
pub fn run(args: SweepArgs) -> anyhow::Result<()> {
    let spec = SweepSpec::load(&args.spec)?;
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("sweeps").join(&spec.name));
    let exe = std::env::current_exe().map_err(|e| anyhow::anyhow!("cannot find this executable to run the points: {e}"))?;
    let opts = sweep::SweepOptions { out: out.clone(), resume: args.resume, retry_failed: args.retry_failed, exe, quiet: false };
    let outcome = sweep::run(&spec, &opts)?;
    eprintln!(
        "sweep {}: {} points, {} run ({} ok, {} failed), {} skipped, {:.1} s | {}/sweep.jsonl",
        spec.name, outcome.points, outcome.ran, outcome.ok, outcome.failed, outcome.skipped, outcome.wall_s, out.display()
    );
    if args.report {
        let r = crate::lab::report::write(&out)?;
        eprintln!("report: {}", r.markdown.display());
    } else {
        eprintln!("next: vitscale report {}", out.display());
    }
    if args.json {
        println!("{}", serde_json::to_string(&outcome)?);
    }
    Ok(())
}
