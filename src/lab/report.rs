//! `vitscale report DIR`: reads a sweep directory (`spec.json`, `sweep.jsonl`, the points' run
//! directories) and writes `report.md`, a self-contained `report.html` (charts inlined as
//! base64 PNG) and `charts/*.png|svg`. The document is built once as blocks and rendered to
//! both formats, so the two always say the same.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde::Serialize;
use serde_json::Value;

use super::analysis::{self, Finding, Pt, Scaling, Series, Verdict, XDim};
use super::charts::{Chart, Panel, PanelKind};
use super::summary::{read_point, PointFigures};
use super::sweep::{read_records, PointRecord};
use crate::config::keys;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{dir}: not a sweep directory ({why}); run `vitscale sweep SPEC.json --out {dir}` first")]
    NotASweep { dir: String, why: String },
    #[error("{0}")]
    Read(String),
    #[error("{path}: {source}")]
    Write { path: String, source: std::io::Error },
    #[error("chart: {0}")]
    Chart(String),
}

/// What `write` produced.
#[derive(Debug, Serialize)]
pub struct ReportFiles {
    pub markdown: PathBuf,
    pub html: PathBuf,
    /// PNG paths (each has an SVG beside it).
    pub charts: Vec<PathBuf>,
    pub findings: Vec<Finding>,
    pub points: usize,
    pub failed: usize,
}

/// The largest relative difference between a point's phases and its step's wall time for which
/// its breakdown counts as accounting for the step.
pub const PHASE_GAP_LIMIT: f64 = 0.02;

/// A piece of the report, rendered into both `report.md` and `report.html`.
pub enum Block {
    H(u8, String),
    P(String),
    Table(Vec<String>, Vec<Vec<String>>),
    Image { png: PathBuf, svg: PathBuf, alt: String },
}

/// A section another part of the lab contributes (the planner's predicted-against-measured,
/// `plan::validate`): its blocks, and the charts it drew into `chart_dir`.
pub trait Section {
    fn add_blocks(&self, chart_dir: &Path, blocks: &mut Vec<Block>, chart_files: &mut Vec<PathBuf>) -> Result<(), ReportError>;
}

/// Writes the report of the sweep in `dir`, with `extra` (if any) before the table of points.
pub fn write(dir: &Path, extra: Option<&dyn Section>) -> Result<ReportFiles, ReportError> {
    let spec_path = dir.join("spec.json");
    let spec: Value = std::fs::read_to_string(&spec_path)
        .map_err(|e| ReportError::NotASweep { dir: dir.display().to_string(), why: format!("{}: {e}", spec_path.display()) })
        .and_then(|t| serde_json::from_str(&t).map_err(|e| ReportError::Read(format!("{}: {e}", spec_path.display()))))?;
    let mut records = read_records(dir).map_err(ReportError::Read)?;
    if records.is_empty() {
        return Err(ReportError::NotASweep { dir: dir.display().to_string(), why: "sweep.jsonl holds no point".into() });
    }
    // the figures are recomputed from the run directories (so the report follows the files);
    // a point whose run directory is gone keeps what sweep.jsonl recorded, and the text says so
    let full = spec.get("full_training").and_then(Value::as_bool).unwrap_or(false);
    let warmup = if full { 0 } else { spec.get("warmup_steps").and_then(Value::as_u64).unwrap_or(0) };
    let mut from_jsonl: Vec<String> = Vec::new();
    for r in records.iter_mut().filter(|r| r.ok()) {
        match read_point(&dir.join(&r.run_dir), warmup) {
            Ok(f) => r.figures = Some(f),
            Err(_) => from_jsonl.push(r.id.clone()),
        }
    }
    let pts = analysis::finished(&records);
    let findings = analysis::findings(&pts);
    let chart_dir = dir.join("charts");
    let charts = build_charts(&pts, &records);
    let mut blocks = Vec::new();
    let name = spec.get("name").and_then(Value::as_str).unwrap_or("sweep");
    let failed: Vec<&PointRecord> = records.iter().filter(|r| !r.ok()).collect();
    blocks.push(Block::H(1, format!("Scaling report: {name}")));
    if let Some(d) = spec.get("description").and_then(Value::as_str).filter(|d| !d.is_empty()) {
        blocks.push(Block::P(d.to_string()));
    }
    let device = spec.get("device").and_then(Value::as_str).unwrap_or("cpu");
    let steps = if full { "trained to the end of each run".to_string() } else {
        format!("{} steps per point, the first {warmup} left out of the figures", spec.get("steps").and_then(Value::as_u64).unwrap_or(0))
    };
    let sources = match from_jsonl.len() {
        0 => "The points, their status and commands are read from sweep.jsonl; every figure below is recomputed from the finished points' run directories (config.json, metrics.jsonl per rank)".to_string(),
        n => format!(
            "The points, their status and commands are read from sweep.jsonl; the figures are recomputed from the finished points' run directories (config.json, metrics.jsonl per rank), except for {n} point{} whose run directory is missing or unreadable ({}), whose figures are those sweep.jsonl recorded when {} ran",
            if n == 1 { "" } else { "s" },
            from_jsonl.join(", "),
            if n == 1 { "it" } else { "they" }
        ),
    };
    blocks.push(Block::P(format!(
        "{} on {device} ({steps}): {} finished, {} failed. Base configuration: {}. {sources}; regenerate with `vitscale report {}`.",
        crate::util::plural(records.len(), "point", "points"),
        pts.len(),
        failed.len(),
        spec.get("base_source").and_then(Value::as_str).unwrap_or("?"),
        dir.display()
    )));

    blocks.push(Block::H(2, "Findings checked against the data".into()));
    blocks.push(Block::Table(
        vec!["statement (from the study)".into(), "measured".into(), "verdict".into()],
        findings
            .iter()
            .map(|f| {
                let v = match &f.verdict {
                    Verdict::NotChecked(why) => format!("not checked: {why}"),
                    _ => f.verdict_text().to_string(),
                };
                vec![f.statement.clone(), f.measured.clone(), v]
            })
            .collect(),
    ));

    blocks.push(Block::H(2, "Charts".into()));
    let mut chart_files = Vec::new();
    for (chart, caption, missing) in charts {
        blocks.push(Block::H(3, chart.title.clone()));
        match missing {
            Some(why) => blocks.push(Block::P(format!("Not in this sweep: {why}."))),
            None => {
                let (png, svg) = chart.save(&chart_dir).map_err(ReportError::Chart)?;
                blocks.push(Block::P(caption));
                blocks.push(Block::Image { png: png.clone(), svg, alt: chart.title.clone() });
                chart_files.push(png);
            }
        }
    }

    for (title, groups) in [("Strong scaling (fixed global batch)", analysis::strong_scaling(&pts)), ("Weak scaling (fixed per-rank batch)", analysis::weak_scaling(&pts))] {
        if groups.is_empty() {
            continue;
        }
        blocks.push(Block::H(2, title.into()));
        let mut rows = Vec::new();
        for g in &groups {
            for (w, ips, s, e) in &g.rows {
                rows.push(vec![g.name.clone(), w.to_string(), format!("{ips:.1}"), format!("{s:.2}"), format!("{:.0} %", e * 100.0)]);
            }
        }
        blocks.push(Block::Table(vec!["held fixed".into(), "ranks".into(), "images/s".into(), "speed-up".into(), "efficiency".into()], rows));
    }

    let mixed = mixed_speed_rows(&pts);
    if !mixed.is_empty() {
        blocks.push(Block::H(2, "Mixed-speed ranks".into()));
        blocks.push(Block::P("Points with an emulated slowdown or a balanced split. Ideal: the sum of each rank's own speed, its images over its step time less what it waited for later ranks (the throughput if no rank waited for another; the exposed communication and the update stay in). Compute bound: the sum of images over forward-and-backward seconds alone. The straggler effect is Σ over ranks of (wait − the least wait), per step.".into()));
        let rows = mixed
            .iter()
            .map(|m| {
                vec![
                    m.world.to_string(),
                    format!("{:.2}×", m.slowdown),
                    m.balance.clone(),
                    format!("{:.1}", m.images_per_s),
                    format!("{:.1}", m.ideal),
                    format!("{:.0} %", 100.0 * m.images_per_s / m.ideal.max(f64::MIN_POSITIVE)),
                    format!("{:.1}", m.compute_bound),
                    ms(m.straggler),
                    m.shares.iter().map(|x| format!("{x:.3}")).collect::<Vec<_>>().join(" / "),
                ]
            })
            .collect();
        blocks.push(Block::Table(
            ["ranks", "slowest rank", "split", "images/s", "ideal", "of ideal", "compute bound", "straggler ms/step", "shares (last step)"].iter().map(|x| x.to_string()).collect(),
            rows,
        ));
    }

    if let Some(section) = extra {
        section.add_blocks(&chart_dir, &mut blocks, &mut chart_files)?;
    }

    // a breakdown is only worth drawing where the phases account for the step
    let unaccounted: Vec<Vec<String>> = records
        .iter()
        .filter_map(|r| {
            let f = r.figures.as_ref()?;
            let gap = f.breakdown.phase_gap()?;
            (gap.abs() > PHASE_GAP_LIMIT).then(|| vec![r.id.clone(), ms(f.breakdown.step_s), ms(f.breakdown.timed_s.unwrap_or(0.0)), format!("{:+.1} %", gap * 100.0)])
        })
        .collect();
    if !unaccounted.is_empty() {
        blocks.push(Block::H(2, "Points whose phases do not add up to their step".into()));
        blocks.push(Block::P(format!(
            "The phases of these points differ from the step's wall time by more than {:.0} %: their breakdown does not account for the step (a host that fell behind the device between logging steps, or a step interrupted by other work).",
            PHASE_GAP_LIMIT * 100.0
        )));
        blocks.push(Block::Table(["point", "step ms", "phases ms", "difference"].iter().map(|s| s.to_string()).collect(), unaccounted));
    }

    blocks.push(Block::H(2, "Every point".into()));
    blocks.push(Block::P("Times are per optimizer step, averaged over the measured steps and over ranks. \"exposed comm\" is the time a step waited for communication after its backward: the gradient buckets still in flight, and also the ranks' per-step agreement on stop signals and ZeRO's all-gather of the weights, with any wait for a slower rank at those points. \"bucket comm\" is the gradient buckets' reduction time alone, each from its start to its completion, overlapped or not. The two measure different things: where the buckets are not hidden (CPU ranks, small models) exposed comm exceeds bucket comm by the agreement and the waits. \"bus GB/s\" is the bytes the buckets reduced over their total time, by NCCL-tests' convention.".into()));
    let head = ["point", "grid values", "status", "ranks", "micro × GAS", "global batch", "images/s", "per rank", "step ms", "forward", "backward", "exposed comm", "bucket comm", "data wait", "optimizer", "comm share", "bus GB/s", "peak memory per rank"];
    let rows = records.iter().map(point_row).collect();
    blocks.push(Block::Table(head.iter().map(|s| s.to_string()).collect(), rows));
    if !failed.is_empty() {
        blocks.push(Block::H(2, "Failed points".into()));
        blocks.push(Block::Table(
            vec!["point".into(), "reason".into(), "logs".into()],
            failed.iter().map(|r| vec![r.id.clone(), r.reason.clone().unwrap_or_default(), format!("points/{}/stderr.log", r.id)]).collect(),
        ));
    }
    blocks.push(Block::H(2, "Commands that reproduce each point".into()));
    blocks.push(Block::P(format!("Run from the directory the sweep was started in (the configurations are `{}/points/<id>/point.json`); each run writes a fresh run directory under runs/.", dir.display())));
    // records written before the commands left out --run-dir name the point's run directory,
    // which a rerun would refuse as holding a run
    blocks.push(Block::Table(vec!["point".into(), "command".into()], records.iter().map(|r| vec![r.id.clone(), format!("`{}`", super::sweep::without_run_dir(&r.command))]).collect()));

    let md = render_md(&blocks, dir);
    let html = render_html(&blocks, name)?;
    let (mdp, htmlp) = (dir.join("report.md"), dir.join("report.html"));
    std::fs::write(&mdp, md).map_err(|source| ReportError::Write { path: mdp.display().to_string(), source })?;
    std::fs::write(&htmlp, html).map_err(|source| ReportError::Write { path: htmlp.display().to_string(), source })?;
    Ok(ReportFiles { markdown: mdp, html: htmlp, charts: chart_files, findings, points: records.len(), failed: failed.len() })
}

/// Seconds as milliseconds with two decimals.
pub fn ms(x: f64) -> String {
    format!("{:.2}", x * 1e3)
}

fn mib(b: u64) -> String {
    format!("{:.0} MiB", b as f64 / 1048576.0)
}

fn point_row(r: &PointRecord) -> Vec<String> {
    let keys = r.keys.iter().map(|(k, v)| format!("{}={v}", short_key(k))).collect::<Vec<_>>().join(", ");
    let status = if r.ok() { "ok".to_string() } else { "FAILED".to_string() };
    let Some(f) = &r.figures else {
        let mut row = vec![r.id.clone(), keys, status];
        row.extend(std::iter::repeat_n("—".to_string(), 15));
        return row;
    };
    let b = &f.breakdown;
    let mem: Vec<String> = f.ranks.iter().map(|x| x.peak_mem_bytes.map_or("—".into(), mib)).collect();
    vec![
        r.id.clone(),
        keys,
        status,
        f.world_size.to_string(),
        format!("{} × {}", f.micro_batch, f.gradient_accumulation_steps),
        f.global_batch.to_string(),
        format!("{:.1}", f.images_per_s),
        format!("{:.1}", f.images_per_s_per_rank),
        ms(b.step_s),
        ms(b.forward_s),
        ms(b.backward_s),
        ms(b.comm_exposed_s),
        ms(b.comm_total_s),
        ms(b.data_s),
        ms(b.optimizer_s),
        format!("{:.1} %", f.comm_share * 100.0),
        f.bus_gb_s.map_or("—".into(), |x| format!("{x:.2}")),
        mem.join(" / "),
    ]
}

/// A grid key as the table shows it: the study's names short, others as given.
fn short_key(k: &str) -> &str {
    let names = [(keys::MICRO_BATCH, "micro"), (keys::GAS, "GAS"), (keys::ZERO_STAGE, "ZeRO"), (keys::TRAIN_BATCH_SIZE, "global batch")];
    names.iter().find(|(key, _)| key.is(k)).map_or(k, |(_, short)| *short)
}

fn short_label(f: &PointFigures, r: &PointRecord) -> String {
    let mut s = format!("{}r micro {} GAS {}", f.world_size, f.micro_batch, f.gradient_accumulation_steps);
    if f.zero_stage > 0 {
        s.push_str(&format!(" Z{}", f.zero_stage));
    }
    let extra: Vec<String> = r
        .keys
        .iter()
        .filter(|(k, _)| !analysis::is_study_key(k))
        .map(|(k, v)| format!("{}={}", k.rsplit('.').next().unwrap_or(k), v.to_string().replace('"', "")))
        .collect();
    if !extra.is_empty() {
        s.push_str(&format!(" {}", extra.join(" ")));
    }
    s
}

fn distinct(pts: &[Pt], f: impl Fn(&PointFigures) -> u64) -> usize {
    pts.iter().map(|p| f(p.f)).collect::<std::collections::BTreeSet<_>>().len()
}

fn scaling_chart(file: &str, title: &str, groups: &[Scaling]) -> Chart {
    let speed: Vec<Series> = groups.iter().map(|g| Series { name: g.name.clone(), points: g.rows.iter().map(|r| (r.0 as f64, r.2)).collect() }).collect();
    let eff: Vec<Series> = groups.iter().map(|g| Series { name: g.name.clone(), points: g.rows.iter().map(|r| (r.0 as f64, r.3)).collect() }).collect();
    Chart {
        file: file.into(),
        title: title.into(),
        panels: vec![
            Panel {
                title: "speed-up".into(),
                x_label: "ranks".into(),
                y_label: "speed-up over the fewest ranks (×)".into(),
                kind: PanelKind::Lines { series: speed, log2_x: false, ideal: Some(("ideal (linear)".into(), 1.0)), y_percent: false, y_from_zero: true, log10_y: false },
            },
            Panel {
                title: "efficiency".into(),
                x_label: "ranks".into(),
                y_label: "scaling efficiency (% of ideal)".into(),
                kind: PanelKind::Lines { series: eff, log2_x: false, ideal: Some(("ideal (100 %)".into(), 0.0)), y_percent: true, y_from_zero: true, log10_y: false },
            },
        ],
    }
}

/// One mixed-speed point: its ranks, the slowest rank's emulated factor, its split.
struct MixedRow {
    world: usize,
    slowdown: f64,
    balance: String,
    images_per_s: f64,
    ideal: f64,
    compute_bound: f64,
    straggler: f64,
    shares: Vec<f64>,
}

/// The points that measured mixed-speed figures, by ranks, split and slowdown.
fn mixed_speed_rows(pts: &[Pt]) -> Vec<MixedRow> {
    let mut rows: Vec<MixedRow> = pts
        .iter()
        .filter_map(|p| {
            let b = p.f.balance.as_ref()?;
            let slowdown = p.rec.keys.get(&keys::TRAIN_EMULATE_SLOWDOWN.dotted()).and_then(Value::as_object).map_or(1.0, |m| m.values().filter_map(Value::as_f64).fold(1.0, f64::max));
            let balance = match p.rec.keys.get(&keys::TRAIN_BALANCE.dotted()) {
                Some(Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => "off".into(),
            };
            Some(MixedRow { world: p.f.world_size, slowdown, balance, images_per_s: p.f.images_per_s, ideal: b.ideal_images_per_s, compute_bound: b.compute_bound_images_per_s, straggler: b.straggler_s_per_step, shares: b.shares.clone() })
        })
        .collect();
    rows.sort_by(|a, b| (a.world, &a.balance).cmp(&(b.world, &b.balance)).then(a.slowdown.total_cmp(&b.slowdown)));
    rows
}

/// The mixed-speed chart: throughput against the slowest rank's factor, equal split and
/// balanced, with the ideal of the balanced runs, one set of lines per rank count.
fn mixed_speed_chart(rows: &[MixedRow]) -> Chart {
    let mut series: Vec<Series> = Vec::new();
    let worlds: std::collections::BTreeSet<usize> = rows.iter().map(|r| r.world).collect();
    for w in worlds {
        let of = |bal: &str| -> Vec<&MixedRow> { rows.iter().filter(|r| r.world == w && r.balance == bal).collect() };
        let (off, auto) = (of("off"), of("auto"));
        let line = |name: String, pts: &[&MixedRow], y: fn(&MixedRow) -> f64| Series { name, points: pts.iter().map(|r| (r.slowdown, y(r))).collect() };
        if !off.is_empty() {
            series.push(line(format!("{w} ranks, equal split"), &off, |r| r.images_per_s));
        }
        if !auto.is_empty() {
            series.push(line(format!("{w} ranks, balanced (auto)"), &auto, |r| r.images_per_s));
            series.push(line(format!("{w} ranks, ideal"), &auto, |r| r.ideal));
        }
    }
    Chart {
        file: "mixed_speed".into(),
        title: "Mixed-speed ranks: equal split, balanced, ideal".into(),
        panels: vec![Panel {
            title: String::new(),
            x_label: "slowest rank's slowdown (×)".into(),
            y_label: "throughput (images/s, all ranks)".into(),
            kind: PanelKind::Lines { series, log2_x: false, ideal: None, y_percent: false, y_from_zero: true, log10_y: false },
        }],
    }
}

/// The charts, each with its caption, or the reason it is not drawn.
fn build_charts(pts: &[Pt], records: &[PointRecord]) -> Vec<(Chart, String, Option<String>)> {
    let mut out = Vec::new();
    let line = |file: &str, title: &str, xl: &str, yl: &str, series: Vec<Series>, log2: bool, pct: bool| Chart {
        file: file.into(),
        title: title.into(),
        panels: vec![Panel { title: String::new(), x_label: xl.into(), y_label: yl.into(), kind: PanelKind::Lines { series, log2_x: log2, ideal: None, y_percent: pct, y_from_zero: true, log10_y: false } }],
    };
    let micros = distinct(pts, |f| f.micro_batch as u64);

    let s = analysis::series(pts, XDim::Micro, &[], |p| Some(p.f.images_per_s));
    out.push((
        line("throughput", "Throughput against micro batch", "micro batch per rank (images, log scale)", "throughput (images/s, all ranks)", s, true, false),
        "Global images per second over the measured steps, one line per world size (and per other grid value).".to_string(),
        (micros < 2).then(|| "needs 2 or more micro-batch sizes".to_string()),
    ));

    let done: Vec<(&PointRecord, &PointFigures)> = records.iter().filter_map(|r| r.figures.as_ref().map(|f| (r, f))).collect();
    let labels: Vec<String> = done.iter().map(|(r, f)| short_label(f, r)).collect();
    let part = |name: &str, g: fn(&PointFigures) -> f64| (name.to_string(), done.iter().map(|(_, f)| g(f) * 1e3).collect::<Vec<f64>>());
    let parts = vec![
        part("forward", |f| f.breakdown.forward_s),
        part("backward", |f| f.breakdown.backward_s),
        part("exposed communication", |f| f.breakdown.comm_exposed_s),
        part("data wait", |f| f.breakdown.data_s),
        part("optimizer", |f| f.breakdown.optimizer_s),
        part("other", |f| f.breakdown.other_s),
    ];
    out.push((
        Chart { file: "breakdown".into(), title: "Step breakdown per point".into(), panels: vec![Panel { title: String::new(), x_label: "time per optimizer step (ms, mean over ranks)".into(), y_label: String::new(), kind: PanelKind::StackedBars { labels, parts } }] },
        "Where each step's time goes: forward, backward, communication the step waited for, waiting for data, the optimizer, and the rest. A long red part is a communication-bound point.".to_string(),
        done.is_empty().then(|| "no finished point".to_string()),
    ));

    let strong = analysis::strong_scaling(pts);
    out.push((
        scaling_chart("scaling_strong", "Strong scaling (fixed global batch)", &strong),
        "Speed-up and efficiency as ranks are added with the global batch held fixed (at each rank count the fastest micro × GAS split of that batch); the dashed line is ideal linear scaling.".to_string(),
        strong.is_empty().then(|| "needs one global batch at 2 or more rank counts".to_string()),
    ));
    let weak = analysis::weak_scaling(pts);
    out.push((
        scaling_chart("scaling_weak", "Weak scaling (fixed per-rank batch)", &weak),
        "Speed-up and efficiency as ranks are added with each rank's batch held fixed (the global batch grows); the dashed line is ideal.".to_string(),
        weak.is_empty().then(|| "needs one per-rank batch at 2 or more rank counts".to_string()),
    ));

    let multi: Vec<Pt> = pts.iter().filter(|p| p.f.world_size > 1).cloned().collect();
    let s = analysis::series(&multi, XDim::Micro, &[], |p| Some(p.f.comm_share));
    out.push((
        line("comm_share", "Communication share against micro batch", "micro batch per rank (images, log scale)", "exposed communication (% of step time)", s, true, true),
        "The share of each step spent waiting for gradient reductions, for points with more than one rank.".to_string(),
        (distinct(&multi, |f| f.micro_batch as u64) < 2).then(|| "needs 2 or more micro-batch sizes at a rank count above 1".to_string()),
    ));

    let s = analysis::series(pts, XDim::Gas, &[], |p| Some(p.f.images_per_s));
    out.push((
        line("gas", "Effect of gradient accumulation", "gradient accumulation steps (log scale)", "throughput (images/s, all ranks)", s, true, false),
        "Throughput against GAS: more micro-batches per synchronisation amortise the gradient reduction.".to_string(),
        (distinct(pts, |f| f.gradient_accumulation_steps as u64) < 2).then(|| format!("needs 2 or more values of {}", keys::GAS)),
    ));

    // memory: one bar per point (coloured by ZeRO stage), the stage variants of a
    // configuration next to each other
    let mut with_mem: Vec<(&PointRecord, &PointFigures, u64)> = done
        .iter()
        .filter_map(|(r, f)| f.ranks.iter().filter_map(|x| x.peak_mem_bytes).max().map(|m| (*r, *f, m)))
        .collect();
    with_mem.sort_by_key(|(r, f, _)| (f.world_size, f.micro_batch, f.gradient_accumulation_steps, r.index, f.zero_stage));
    let stages: std::collections::BTreeSet<u64> = with_mem.iter().map(|(_, f, _)| f.zero_stage).collect();
    let source = with_mem.iter().flat_map(|(_, f, _)| f.ranks.iter()).find_map(|r| r.peak_mem_source.clone()).unwrap_or_default();
    let labels: Vec<String> = with_mem.iter().map(|(r, f, _)| short_label(f, r)).collect();
    let parts: Vec<(String, Vec<f64>)> = stages
        .iter()
        .map(|s| (format!("ZeRO stage {s}"), with_mem.iter().map(|(_, f, m)| if f.zero_stage == *s { *m as f64 / 1048576.0 } else { 0.0 }).collect()))
        .collect();
    let title = if stages.len() == 1 { format!("Peak memory per rank (ZeRO stage {} only in this sweep)", stages.iter().next().copied().unwrap_or(0)) } else { "Peak memory per rank against ZeRO stage".to_string() };
    out.push((
        Chart { file: "memory".into(), title, panels: vec![Panel { title: String::new(), x_label: "peak memory of the highest rank (MiB)".into(), y_label: String::new(), kind: PanelKind::StackedBars { labels, parts } }] },
        format!("The highest peak memory of any rank of each point ({}), coloured by ZeRO stage. ", if source.is_empty() { "as recorded" } else { &source })
            + &if stages.len() == 1 { format!("Only one ZeRO stage was swept: add `{}` to the grid to compare stages.", keys::ZERO_STAGE) } else { String::new() },
        with_mem.is_empty().then(|| "no point recorded its peak memory".to_string()),
    ));

    let mixed = mixed_speed_rows(pts);
    out.push((
        mixed_speed_chart(&mixed),
        format!(
            "Throughput as one rank is slowed ({}), with the equal split ({} \"off\") and the speed-proportional one (\"auto\"); the ideal is the sum of each rank's own speed in the balanced run.",
            keys::TRAIN_EMULATE_SLOWDOWN,
            keys::TRAIN_BALANCE
        ),
        (mixed.len() < 2).then(|| format!("needs points with {} or {}", keys::TRAIN_EMULATE_SLOWDOWN, keys::TRAIN_BALANCE)),
    ));
    out
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// `code` spans (backticks) become <code>; everything else is escaped.
fn inline_html(s: &str) -> String {
    let mut out = String::new();
    for (i, part) in s.split('`').enumerate() {
        if i % 2 == 1 { out.push_str(&format!("<code>{}</code>", escape(part))) } else { out.push_str(&escape(part)) }
    }
    out
}

fn md_cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

fn render_md(blocks: &[Block], dir: &Path) -> String {
    let mut out = String::new();
    for b in blocks {
        match b {
            Block::H(l, t) => out.push_str(&format!("{} {t}\n\n", "#".repeat(*l as usize))),
            Block::P(t) => out.push_str(&format!("{t}\n\n")),
            Block::Table(head, rows) => {
                out.push_str(&format!("| {} |\n", head.iter().map(|h| md_cell(h)).collect::<Vec<_>>().join(" | ")));
                out.push_str(&format!("|{}\n", "---|".repeat(head.len())));
                for r in rows {
                    out.push_str(&format!("| {} |\n", r.iter().map(|c| md_cell(c)).collect::<Vec<_>>().join(" | ")));
                }
                out.push('\n');
            }
            Block::Image { png, svg, alt } => {
                let rel = |p: &Path| p.strip_prefix(dir).unwrap_or(p).display().to_string();
                out.push_str(&format!("![{alt}]({})\n\n([SVG]({}))\n\n", rel(png), rel(svg)));
            }
        }
    }
    out
}

fn render_html(blocks: &[Block], name: &str) -> Result<String, ReportError> {
    let mut out = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>Scaling report: {}</title>\n<style>\n\
body {{ font-family: 'DejaVu Sans', Arial, sans-serif; margin: 2em auto; max-width: 1800px; color: #222; padding: 0 1em; }}\n\
table {{ border-collapse: collapse; margin: 1em 0; font-size: 12px; }}\n\
th, td {{ border: 1px solid #ccc; padding: 3px 6px; text-align: left; vertical-align: top; }}\n\
th {{ background: #f2f2f2; }}\n\
tr:nth-child(even) td {{ background: #fafafa; }}\n\
td.true {{ background: #d9f2d9 !important; font-weight: bold; }}\n\
td.false {{ background: #f8d7d7 !important; font-weight: bold; }}\n\
img {{ max-width: 100%; border: 1px solid #ddd; }}\n\
div.wide {{ overflow-x: auto; }}\n\
code {{ font-size: 12px; background: #f4f4f4; padding: 1px 3px; }}\n\
</style></head><body>\n",
        escape(name)
    );
    for b in blocks {
        match b {
            Block::H(l, t) => out.push_str(&format!("<h{l}>{}</h{l}>\n", inline_html(t))),
            Block::P(t) => out.push_str(&format!("<p>{}</p>\n", inline_html(t))),
            Block::Table(head, rows) => {
                out.push_str("<div class=\"wide\"><table><thead><tr>");
                for h in head {
                    out.push_str(&format!("<th>{}</th>", inline_html(h)));
                }
                out.push_str("</tr></thead><tbody>\n");
                for r in rows {
                    out.push_str("<tr>");
                    for c in r {
                        let class = match c.as_str() {
                            "true" => " class=\"true\"",
                            "false" | "FAILED" => " class=\"false\"",
                            _ => "",
                        };
                        out.push_str(&format!("<td{class}>{}</td>", inline_html(c)));
                    }
                    out.push_str("</tr>\n");
                }
                out.push_str("</tbody></table></div>\n");
            }
            Block::Image { png, alt, .. } => {
                let bytes = std::fs::read(png).map_err(|source| ReportError::Write { path: png.display().to_string(), source })?;
                let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
                out.push_str(&format!("<p><img alt=\"{}\" src=\"data:image/png;base64,{b64}\"></p>\n", escape(alt)));
            }
        }
    }
    out.push_str("</body></html>\n");
    Ok(out)
}
