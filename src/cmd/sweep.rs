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
    /// Override a key of every point (after the spec's `set`, before the grid values), as
    /// `vitscale train --set` does: `--set data.path=DIR` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Run the points on this device instead of the spec's `device` (cpu or cuda).
    #[arg(long, value_parser = ["cpu", "cuda"])]
    pub device: Option<String>,
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
    let mut spec = SweepSpec::load(&args.spec)?;
    for arg in &args.sets {
        let (k, v) = arg.split_once('=').ok_or_else(|| anyhow::anyhow!("--set {arg}: expected key.path=value (e.g. --set data.path=DIR)"))?;
        if k.trim().is_empty() || k.split('.').any(str::is_empty) {
            anyhow::bail!("--set {arg}: `{k}` is not a dotted key path");
        }
        // as `vitscale train --set`: JSON when it parses, else a plain string
        let value = serde_json::from_str(v).unwrap_or_else(|_| serde_json::Value::String(v.to_string()));
        spec.set.insert(k.trim().to_string(), value);
    }
    if let Some(d) = &args.device {
        spec.device = d.clone();
    }
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from("sweeps").join(&spec.name));
    let exe = std::env::current_exe().map_err(|e| anyhow::anyhow!("cannot find this executable to run the points: {e}"))?;
    let opts = sweep::SweepOptions { out: out.clone(), resume: args.resume, retry_failed: args.retry_failed, exe, quiet: false };
    let outcome = sweep::run(&spec, &opts)?;
    crate::errln!(
        "sweep {}: {}, {} run ({} ok, {} failed), {} skipped, {:.1} s | {}/sweep.jsonl",
        spec.name, crate::util::plural(outcome.points, "point", "points"), outcome.ran, outcome.ok, outcome.failed, outcome.skipped, outcome.wall_s, out.display()
    );
    if args.report {
        let validation = crate::plan::validate::read_saved(&out)?;
        let r = crate::lab::report::write(&out, validation.as_ref().map(|v| v as &dyn crate::lab::report::Section))?;
        crate::errln!("report: {}", r.markdown.display());
    } else {
        crate::errln!("next: vitscale report {}", out.display());
    }
    if args.json {
        crate::outln!("{}", serde_json::to_string(&outcome)?);
    }
    Ok(())
}
