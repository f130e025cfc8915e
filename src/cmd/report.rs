//! `vitscale report DIR`: `DIR/report.md`, a self-contained `DIR/report.html` and the charts
//! (`DIR/charts/*.png|svg`) of a sweep directory (`crate::lab::report`).

use std::path::PathBuf;

use clap::Args;

/// Command-line options of `vitscale report`.
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// A sweep directory (`vitscale sweep --out DIR`).
    pub dir: PathBuf,
    /// Print one JSON object (the files written and the findings) as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

/// `vitscale report`.
pub fn run(args: ReportArgs) -> anyhow::Result<()> {
    let validation = crate::plan::validate::read_saved(&args.dir)?;
    let r = crate::lab::report::write(&args.dir, validation.as_ref().map(|v| v as &dyn crate::lab::report::Section))?;
    crate::errln!("wrote {} and {} ({} charts)", r.markdown.display(), r.html.display(), r.charts.len());
    for f in &r.findings {
        crate::errln!("  [{}] {}", f.verdict_text(), f.statement);
    }
    if args.json {
        crate::outln!("{}", serde_json::to_string(&r)?);
    }
    Ok(())
}
