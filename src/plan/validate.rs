//! `vitscale plan --validate SWEEP_DIR`: every finished point of a sweep predicted from what a
//! user measures first — the one-rank compute profile and the comm bench — and compared with
//! what the point measured (`lab::summary`). No multi-rank point feeds the model. Writes
//! `SWEEP_DIR/plan.json`, which `vitscale report` shows as predicted against measured.
//!
//! A point's ranks time-share one device on the CPU and under `launch --one-gpu`; their
//! network is the comm bench's (fitted at the nearest rank count measured). Each point's
//! error is (predicted − measured) / measured images/s, measured at the point's median step
//! (`PointFigures::steady_images_per_s`); per term (compute, exposed
//! communication, optimizer, the rest) the mean gap in seconds says which term misses.
//!
//! A sweep with `repeats` runs each point several times: the point's throughput is the
//! median of its runs and its spread half their range. Two points are in a measured order
//! only when their medians differ by more than the sum of their spreads (their runs' ranges,
//! centred on the medians, do not overlap); closer pairs are ties within the run-to-run noise,
//! and the order check (`OrderCheck`) counts how many of the pairs apart the prediction
//! orders right. Spearman's ρ is over every point.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::comm_fit::CommFit;
use super::model::{self, Network};
use super::profile::Profile;
use crate::lab::analysis::Series;
use crate::lab::charts::{Chart, Panel, PanelKind};
use crate::lab::report::{ms, Block, ReportError, Section};
use crate::lab::summary::read_point;
use crate::lab::sweep::read_records;

/// One point, predicted and measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PointCheck {
    pub id: String,
    pub world: usize,
    pub micro: usize,
    pub gas: usize,
    pub zero_stage: u64,
    /// Ranks that shared a device.
    pub ranks_per_device: usize,
    /// The profile that predicted it.
    pub profile: String,
    /// The median of the runs' throughputs.
    pub measured_images_per_s: f64,
    /// Each run's throughput, in the order they ran (one without `repeats`).
    #[serde(default)]
    pub runs_images_per_s: Vec<f64>,
    /// Half the range of `runs_images_per_s` (0 with one run).
    #[serde(default)]
    pub spread_images_per_s: f64,
    pub predicted_images_per_s: f64,
    /// (predicted − measured) / measured.
    pub err: f64,
    /// Seconds per step: (measured, predicted).
    pub compute_s: (f64, f64),
    pub comm_exposed_s: (f64, f64),
    pub optimizer_s: (f64, f64),
    /// Data wait and the rest of the step, which the model does not predict without a loader
    /// rate: (measured, predicted).
    pub other_s: (f64, f64),
    pub step_s: (f64, f64),
    /// The training loop's own per-step cost in the prediction (seconds; the profile's
    /// `logged_step_s` beyond its parts, `model::Prediction::loop_s`).
    #[serde(default)]
    pub loop_cost_s: f64,
}

/// The validation of one sweep.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Validation {
    pub sweep: String,
    pub profile: String,
    pub comm: Vec<String>,
    pub points: Vec<PointCheck>,
    pub median_abs_err: f64,
    pub max_abs_err: f64,
    /// Spearman's rank correlation of predicted with measured throughput.
    pub spearman: Option<f64>,
    /// Share of point pairs the prediction orders as measured (every pair, ties in the noise
    /// too).
    pub pairwise_correct: Option<f64>,
    /// The order over the pairs the measurement tells apart.
    #[serde(default)]
    pub order: OrderCheck,
    /// Mean |predicted − measured| per term over the points, as a share of the measured step.
    pub term_gaps: Vec<(String, f64)>,
    pub notes: Vec<String>,
}

/// Average ranks (1-based, ties share their mean rank).
fn ranks(xs: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..xs.len()).collect();
    idx.sort_by(|&a, &b| xs[a].total_cmp(&xs[b]));
    let mut r = vec![0.0; xs.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && xs[idx[j + 1]] == xs[idx[i]] {
            j += 1;
        }
        let mean = (i + j) as f64 / 2.0 + 1.0;
        for &k in &idx[i..=j] {
            r[k] = mean;
        }
        i = j + 1;
    }
    r
}

/// Spearman's ρ (Pearson's correlation of the ranks); None under 3 points or no spread.
pub fn spearman(a: &[f64], b: &[f64]) -> Option<f64> {
    if a.len() < 3 || a.len() != b.len() {
        return None;
    }
    let (ra, rb) = (ranks(a), ranks(b));
    let n = ra.len() as f64;
    let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
    let cov: f64 = ra.iter().zip(&rb).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = ra.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = rb.iter().map(|y| (y - mb).powi(2)).sum();
    (va > 0.0 && vb > 0.0).then(|| cov / (va * vb).sqrt())
}

/// Share of pairs that `pred` orders as `meas` does; None under 2 points.
pub fn pairwise_correct(meas: &[f64], pred: &[f64]) -> Option<f64> {
    let mut total = 0usize;
    let mut right = 0usize;
    for i in 0..meas.len() {
        for j in i + 1..meas.len() {
            total += 1;
            if (meas[i] - meas[j]).signum() == (pred[i] - pred[j]).signum() {
                right += 1;
            }
        }
    }
    (total > 0).then(|| right as f64 / total as f64)
}

/// The prediction's order against the measured one, over the pairs of points whose measured
/// throughputs differ by more than their combined spread.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OrderCheck {
    pub pairs: usize,
    /// Pairs whose medians differ by more than the sum of their spreads.
    pub apart: usize,
    /// Of those, the pairs the prediction orders as measured.
    pub right: usize,
    /// Pairs within their combined spread: which is faster is noise.
    pub tied: usize,
    /// Fewest runs of a point; with one run no spread was measured and every pair of unequal
    /// throughputs counts as apart.
    pub min_runs: usize,
}

impl OrderCheck {
    /// Share of the pairs apart ordered right; None when no pair is apart.
    pub fn share_right(&self) -> Option<f64> {
        (self.apart > 0).then(|| self.right as f64 / self.apart as f64)
    }

    /// One line: "5 of 6 pairs apart beyond their spread ordered right (83 %), 9 pairs within
    /// it (tied)".
    pub fn text(&self) -> String {
        let mut s = match self.share_right() {
            Some(r) => format!("{} of {} ordered right ({:.0} %)", self.right, crate::util::plural(self.apart, "pair apart beyond its spread", "pairs apart beyond their spread"), r * 100.0),
            None => "no pair apart beyond its spread".to_string(),
        };
        s.push_str(&format!(", {} within it (tied)", crate::util::plural(self.tied, "pair", "pairs")));
        if self.min_runs <= 1 {
            s.push_str("; a point ran once, so no spread was measured (give the sweep `repeats`)");
        }
        s
    }
}

/// The order check of points with measured medians `meas`, spreads `spread` (half the range
/// of their runs), `runs` runs each, and predictions `pred`. A pair is apart when
/// |meas_i − meas_j| > spread_i + spread_j, and right when the prediction puts the faster
/// one first (an equal prediction is not right).
pub fn order_check(meas: &[f64], spread: &[f64], runs: &[usize], pred: &[f64]) -> OrderCheck {
    let n = meas.len().min(spread.len()).min(pred.len());
    let mut c = OrderCheck { min_runs: runs.iter().copied().min().unwrap_or(0), ..OrderCheck::default() };
    for i in 0..n {
        for j in i + 1..n {
            c.pairs += 1;
            let d = meas[i] - meas[j];
            if d.abs() > spread[i] + spread[j] {
                c.apart += 1;
                if d * (pred[i] - pred[j]) > 0.0 {
                    c.right += 1;
                }
            } else {
                c.tied += 1;
            }
        }
    }
    c
}

/// A run's id without the `_rN` its repeat added (`lab::spec::SweepSpec::points`).
fn point_id(id: &str, repeat: usize) -> &str {
    id.strip_suffix(&format!("_r{}", repeat + 1)).unwrap_or(id)
}

/// The fit measured at the rank count nearest `world` (equal first, then the larger).
fn nearest(comm: &[CommFit], world: usize) -> Option<&CommFit> {
    comm.iter().min_by_key(|c| (c.world_size.abs_diff(world), std::cmp::Reverse(c.world_size)))
}

/// Which of `profiles` predicts a point of `world` ranks. On the CPU the launcher gives each
/// rank t = ⌈cores / world⌉ threads: the profile taken by `world` ranks of t threads side by
/// side, else one taken with t threads (alone), else the first. On a GPU the first.
pub fn pick_profile(profiles: &[(String, Profile)], world: usize) -> usize {
    let Some((_, first)) = profiles.first() else { return 0 };
    if first.device_kind != "cpu" || first.cores == 0 {
        return 0;
    }
    let t = first.cores.div_ceil(world.max(1));
    let at = |ranks: Option<usize>| profiles.iter().position(|(_, p)| p.threads == t && ranks.is_none_or(|r| p.ranks == r));
    at(Some(world)).or_else(|| at(Some(1))).or_else(|| at(None)).unwrap_or(0)
}

/// The files of a sweep directory named `<prefix>*.json`, sorted (`profile*.json`,
/// `comm*.json`).
pub fn files_in(dir: &Path, prefix: &str) -> Vec<std::path::PathBuf> {
    let mut out: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(prefix) && n.ends_with(".json"))).collect())
        .unwrap_or_default();
    out.sort();
    out
}

/// Predicts every finished point of the sweep in `dir` from `profiles` (source, profile) and
/// `comm` (and the loader's images/s per core, with each point's `data.num_workers` cores,
/// when given). A CPU point's K ranks get ⌈cores / K⌉ threads each: the profile measured by K
/// such ranks side by side predicts it, else one measured with that many threads, else the
/// first (`pick_profile`).
pub fn validate(dir: &Path, profiles: &[(String, Profile)], comm: &[CommFit], loader_per_core: Option<f64>) -> Result<Validation, String> {
    let (profile_source, profile) = profiles.first().map(|(s, p)| (s.as_str(), p)).ok_or("no profile to predict from")?;
    let spec_path = dir.join("spec.json");
    let spec: serde_json::Value = std::fs::read_to_string(&spec_path)
        .map_err(|e| format!("{}: not a sweep directory ({e})", dir.display()))
        .and_then(|t| serde_json::from_str(&t).map_err(|e| format!("{}: {e}", spec_path.display())))?;
    let full = spec.get("full_training").and_then(serde_json::Value::as_bool).unwrap_or(false);
    let warmup = if full { 0 } else { spec.get("warmup_steps").and_then(serde_json::Value::as_u64).unwrap_or(0) };
    let device = spec.get("device").and_then(serde_json::Value::as_str).unwrap_or("cpu").to_string();
    for (src, p) in profiles {
        if device != p.device_kind {
            return Err(format!("the sweep in {} ran on {device}, the profile ({src}) on {}", dir.display(), p.device_kind));
        }
    }
    let records = read_records(dir)?;
    let groups = super::groups(profile);
    let mut points = Vec::new();
    let mut notes = Vec::new();
    // the runs of each point (its grid keys), in the order the points first ran
    let mut runs: Vec<Vec<(&crate::lab::sweep::PointRecord, crate::lab::summary::PointFigures)>> = Vec::new();
    for r in records.iter().filter(|r| r.ok()) {
        let f = match read_point(&dir.join(&r.run_dir), warmup) {
            Ok(f) => f,
            Err(e) => {
                notes.push(format!("{}: not predicted ({e})", r.id));
                continue;
            }
        };
        match runs.iter_mut().find(|g| g[0].0.keys == r.keys) {
            Some(g) => g.push((r, f)),
            None => runs.push(vec![(r, f)]),
        }
    }
    for group in &runs {
        let (r, _) = &group[0];
        let id = point_id(&r.id, r.repeat).to_string();
        let run = dir.join(&r.run_dir);
        let cfg_path = run.join("config.json");
        let v = crate::config::load_json(Some(&cfg_path), &[]).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
        let f = &group[0].1;
        let cfg = crate::config::resolve(&v, f.world_size).map_err(|e| format!("{}: {e}", cfg_path.display()))?;
        let world = f.world_size;
        let (src, profile) = profiles.get(pick_profile(profiles, world)).map(|(s, p)| (s.as_str(), p)).unwrap_or((profile_source, profile));
        super::check_model(profile, &cfg, &format!("point {id}"))?;
        // CPU ranks share the machine; GPU ranks share GPU 0 under --one-gpu
        let shared = device == "cpu" || r.command.contains("--one-gpu") || r.keys.get(crate::lab::spec::ONE_GPU_KEY).and_then(serde_json::Value::as_bool).unwrap_or(false);
        let (rpd, gpus) = if shared { (world, 1) } else { (1, world) };
        let intra = if world > 1 {
            let fit = nearest(comm, world).ok_or_else(|| format!("point {id} has {world} ranks: give a comm bench of these ranks (`--comm C.json`, or a comm*.json in {})", dir.display()))?;
            if fit.world_size != world {
                notes.push(format!("{id}: {world} ranks predicted with the comm bench of {} ranks ({})", fit.world_size, fit.source));
            }
            Some(fit.level("intra"))
        } else {
            None
        };
        let net = Network { ranks_per_node: rpd * gpus, nodes: 1, intra, inter: None };
        let mut s = super::scenario(&cfg, &super::run_plan(profile, &cfg));
        s.ranks_per_device = rpd;
        s.loader = loader_per_core.map(|r| (r, cfg.data.num_workers.max(1) as f64));
        let p = model::predict(profile, &groups, &s, &net).map_err(|e| format!("point {id}: {e}"))?;
        // each run's steady throughput (its median step), as the profile keeps its medians:
        // a stretch of slow steps on a shared machine moves neither unless it lasts half the run
        let ips: Vec<f64> = group.iter().map(|(_, f)| if f.steady_images_per_s > 0.0 { f.steady_images_per_s } else { f.images_per_s }).collect();
        let measured_ips = crate::util::median(&ips).unwrap_or(f64::NAN);
        let spread = (ips.iter().copied().fold(f64::MIN, f64::max) - ips.iter().copied().fold(f64::MAX, f64::min)) / 2.0;
        // each term the median over the runs
        let term = |t: fn(&crate::lab::summary::Breakdown) -> f64| crate::util::median(&group.iter().map(|(_, f)| t(&f.breakdown)).collect::<Vec<_>>()).unwrap_or(f64::NAN);
        points.push(PointCheck {
            id,
            world,
            micro: f.micro_batch,
            gas: f.gradient_accumulation_steps,
            zero_stage: f.zero_stage,
            ranks_per_device: rpd,
            profile: src.to_string(),
            measured_images_per_s: measured_ips,
            runs_images_per_s: ips,
            spread_images_per_s: spread,
            predicted_images_per_s: p.images_per_s,
            err: (p.images_per_s - measured_ips) / measured_ips,
            compute_s: (term(|b| b.forward_s + b.backward_s), p.compute_s),
            comm_exposed_s: (term(|b| b.comm_exposed_s), p.comm_exposed_s),
            optimizer_s: (term(|b| b.optimizer_s), p.optimizer_s),
            other_s: (term(|b| b.data_s + b.other_s), p.data_s + p.loop_s),
            step_s: (term(|b| b.step_s), p.step_s),
            loop_cost_s: p.loop_s,
        });
    }
    if points.is_empty() {
        return Err(format!("{}: no finished point to predict", dir.display()));
    }
    let abs: Vec<f64> = points.iter().map(|p| p.err.abs()).collect();
    let meas: Vec<f64> = points.iter().map(|p| p.measured_images_per_s).collect();
    let pred: Vec<f64> = points.iter().map(|p| p.predicted_images_per_s).collect();
    let n = points.len() as f64;
    let gap = |f: fn(&PointCheck) -> (f64, f64)| points.iter().map(|p| (f(p).1 - f(p).0).abs() / p.step_s.0.max(1e-12)).sum::<f64>() / n;
    let term_gaps = vec![
        ("compute".to_string(), gap(|p| p.compute_s)),
        ("exposed communication".to_string(), gap(|p| p.comm_exposed_s)),
        ("optimizer".to_string(), gap(|p| p.optimizer_s)),
        ("data wait + rest".to_string(), gap(|p| p.other_s)),
    ];
    Ok(Validation {
        sweep: dir.display().to_string(),
        profile: profiles.iter().map(|(s, _)| s.clone()).collect::<Vec<_>>().join(", "),
        comm: comm.iter().map(|c| c.source.clone()).collect(),
        median_abs_err: crate::util::median(&abs).unwrap_or(f64::NAN),
        max_abs_err: abs.iter().copied().fold(0.0, f64::max),
        spearman: spearman(&meas, &pred),
        pairwise_correct: pairwise_correct(&meas, &pred),
        order: order_check(&meas, &points.iter().map(|p| p.spread_images_per_s).collect::<Vec<_>>(), &points.iter().map(|p| p.runs_images_per_s.len().max(1)).collect::<Vec<_>>(), &pred),
        term_gaps,
        notes,
        points,
    })
}

/// A point's measured throughput, with ± its spread when it ran more than once.
fn measured(p: &PointCheck) -> String {
    if p.runs_images_per_s.len() > 1 {
        format!("{:.1} ± {:.1}", p.measured_images_per_s, p.spread_images_per_s)
    } else {
        format!("{:.1}", p.measured_images_per_s)
    }
}

/// The validation as a table.
pub fn table(v: &Validation) -> String {
    let ms = |x: f64| format!("{:.2}", x * 1e3);
    let mut s = format!("predicted from {} and {}\n", v.profile, if v.comm.is_empty() { "no comm bench".to_string() } else { v.comm.join(", ") });
    s.push_str(&format!(
        "{:<28} {:>5} {:>6} {:>4} {:>14} {:>11} {:>8}  {:>17} {:>17} {:>17} {:>17}\n",
        "point", "ranks", "micro", "GAS", "measured/s", "predicted/s", "error", "compute ms m/p", "exposed ms m/p", "optimizer ms m/p", "rest ms m/p"
    ));
    for p in &v.points {
        let id = p.id.clone();
        s.push_str(&format!(
            "{:<28} {:>5} {:>6} {:>4} {:>14} {:>11.1} {:>7.1}%  {:>8}/{:<8} {:>8}/{:<8} {:>8}/{:<8} {:>8}/{:<8}\n",
            id,
            p.world,
            p.micro,
            p.gas,
            measured(p),
            p.predicted_images_per_s,
            p.err * 100.0,
            ms(p.compute_s.0),
            ms(p.compute_s.1),
            ms(p.comm_exposed_s.0),
            ms(p.comm_exposed_s.1),
            ms(p.optimizer_s.0),
            ms(p.optimizer_s.1),
            ms(p.other_s.0),
            ms(p.other_s.1)
        ));
    }
    s.push_str(&format!("points predicted {}: median |error| {:.1} %, max |error| {:.1} %", v.points.len(), v.median_abs_err * 100.0, v.max_abs_err * 100.0));
    if let Some(r) = v.spearman {
        s.push_str(&format!(", Spearman {r:.3}"));
    }
    if let Some(r) = v.pairwise_correct {
        s.push_str(&format!(", pairs ordered right {:.0} %", r * 100.0));
    }
    s.push('\n');
    if v.order.pairs > 0 {
        s.push_str(&format!("order: {}\n", v.order.text()));
    }
    s.push_str("mean |gap| per term (share of the measured step): ");
    s.push_str(&v.term_gaps.iter().map(|(t, g)| format!("{t} {:.1} %", g * 100.0)).collect::<Vec<_>>().join(", "));
    s.push('\n');
    for n in &v.notes {
        s.push_str(&format!("note: {n}\n"));
    }
    s
}

/// The planner's validation of this sweep (`vitscale plan --validate DIR` writes
/// `DIR/plan.json`), when there is one.
pub fn read_saved(dir: &Path) -> Result<Option<Validation>, ReportError> {
    let path = dir.join("plan.json");
    match std::fs::read_to_string(&path) {
        Ok(t) => serde_json::from_str(&t).map(Some).map_err(|e| ReportError::Read(format!("{}: {e} (rewrite it with `vitscale plan --validate {}`)", path.display(), dir.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ReportError::Read(format!("{}: {e}", path.display()))),
    }
}

/// The report's predicted-against-measured section: the errors, a table per point, a chart.
impl Section for Validation {
    fn add_blocks(&self, chart_dir: &Path, blocks: &mut Vec<Block>, chart_files: &mut Vec<PathBuf>) -> Result<(), ReportError> {
        let v = self;
        blocks.push(Block::H(2, "Predicted against measured (`vitscale plan --validate`)".into()));
        let rank = match (v.spearman, v.pairwise_correct) {
            (Some(r), Some(p)) => format!(" Ranking by throughput: Spearman {r:.2}, {:.0} % of pairs in the measured order.", p * 100.0),
            (None, Some(p)) => format!(" {:.0} % of pairs in the measured order.", p * 100.0),
            _ => String::new(),
        };
        let rank = if v.order.pairs > 0 { format!("{rank} Order over the pairs the runs tell apart: {}.", v.order.text()) } else { rank };
        let gaps = v.term_gaps.iter().map(|(t, g)| format!("{t} {:.1} %", g * 100.0)).collect::<Vec<_>>().join(", ");
        blocks.push(Block::P(format!(
            "Every point predicted from the one-rank compute profile ({}) and the comm bench ({}) alone; no multi-rank point feeds the model. {}: median |error| {:.1} %, max |error| {:.1} %.{rank} Mean gap per term, as a share of the measured step: {gaps}.",
            v.profile,
            if v.comm.is_empty() { "none".to_string() } else { v.comm.join(", ") },
            crate::util::plural(v.points.len(), "point", "points"),
            v.median_abs_err * 100.0,
            v.max_abs_err * 100.0
        )));
        let head = ["point", "ranks", "micro × GAS", "measured images/s", "predicted images/s", "error", "compute ms (m / p)", "exposed comm ms (m / p)", "optimizer ms (m / p)", "rest ms (m / p)"];
        let pair = |x: (f64, f64)| format!("{} / {}", ms(x.0), ms(x.1));
        let rows = v
            .points
            .iter()
            .map(|p| {
                vec![
                    p.id.clone(),
                    p.world.to_string(),
                    format!("{} × {}", p.micro, p.gas),
                    measured(p),
                    format!("{:.1}", p.predicted_images_per_s),
                    format!("{:+.1} %", p.err * 100.0),
                    pair(p.compute_s),
                    pair(p.comm_exposed_s),
                    pair(p.optimizer_s),
                    pair(p.other_s),
                ]
            })
            .collect();
        blocks.push(Block::Table(head.iter().map(|s| s.to_string()).collect(), rows));
        let worlds: std::collections::BTreeSet<usize> = v.points.iter().map(|p| p.world).collect();
        let series: Vec<Series> = worlds
            .iter()
            .map(|w| {
                let mut pts: Vec<(f64, f64)> = v.points.iter().filter(|p| p.world == *w).map(|p| (p.measured_images_per_s, p.predicted_images_per_s)).collect();
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series { name: format!("{w} rank{}", if *w == 1 { "" } else { "s" }), points: pts }
            })
            .collect();
        let lo = v.points.iter().map(|p| p.measured_images_per_s).fold(f64::MAX, f64::min);
        let chart = Chart {
            file: "predicted".into(),
            title: "Predicted against measured throughput".into(),
            panels: vec![Panel {
                title: String::new(),
                x_label: "measured throughput (images/s)".into(),
                y_label: "predicted throughput (images/s)".into(),
                // the dashed line y = x: a perfect prediction
                kind: PanelKind::Lines { series, log2_x: false, ideal: Some(("prediction = measurement".into(), lo)), y_percent: false, y_from_zero: true, log10_y: false },
            }],
        };
        let (png, svg) = chart.save(chart_dir).map_err(ReportError::Chart)?;
        blocks.push(Block::P("Each point at its measured (x) and predicted (y) throughput, one line per rank count; on the dashed line the prediction equals the measurement.".into()));
        blocks.push(Block::Image { png: png.clone(), svg, alt: "Predicted against measured throughput".into() });
        chart_files.push(png);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On 2 cores: 1 rank takes the 2-thread profile, 2 ranks the one of 2 one-thread ranks
    /// side by side over the one-thread rank alone; without either, the one-thread one, then
    /// the first. A GPU sweep always takes the first.
    #[test]
    fn each_point_takes_the_profile_of_its_ranks() {
        let base: Profile = serde_json::from_value(serde_json::json!({
            "format": "vitscale-profile", "version": 1, "device": "cpu", "device_kind": "cpu",
            "threads": 2, "cores": 2, "model": "m", "model_config": crate::model::ModelConfig::preset("vit_builtin_default").expect("preset"),
            "params": 1, "dtype": "f32", "compute_bytes": 4.0, "attention_saved_per_image": 1, "graph": false,
            "recompute": false, "attention": "cpu", "optimizer": "AdamW", "forward_split": "", "points": []
        }))
        .expect("profile");
        assert_eq!(base.ranks, 1, "a file without `ranks` was taken alone");
        let with = |threads: usize, ranks: usize| (format!("{threads}t{ranks}r"), Profile { threads, ranks, ..base.clone() });
        let all = vec![with(2, 1), with(1, 1), with(1, 2)];
        assert_eq!((pick_profile(&all, 1), pick_profile(&all, 2)), (0, 2));
        let alone = vec![with(2, 1), with(1, 1)];
        assert_eq!(pick_profile(&alone, 2), 1);
        assert_eq!(pick_profile(&alone[..1], 2), 0);
        // 3 ranks on 2 cores get 1 thread each: no profile of 3 side by side, the alone one
        assert_eq!(pick_profile(&all, 3), 1);
        let gpu: Vec<(String, Profile)> = all.iter().map(|(s, p)| (s.clone(), Profile { device_kind: "cuda".into(), cores: 0, ..p.clone() })).collect();
        assert_eq!(pick_profile(&gpu, 2), 0);
    }

    /// Points A 100 ± 2, B 97 ± 0.5, C 90 ± 1, D 89.5 ± 0 (medians ± half their ranges).
    /// A–B: 3 > 2.5, apart; A–C: 10 > 3; A–D: 10.5 > 2; B–C: 7 > 1.5; B–D: 7.5 > 0.5;
    /// C–D: 0.5 ≤ 1, tied. The prediction swaps A and B and gets C–D (a tie) "wrong" too:
    /// 4 of the 5 pairs apart right, 1 tied.
    #[test]
    fn the_order_counts_only_pairs_apart_beyond_their_spread() {
        let meas = [100.0, 97.0, 90.0, 89.5];
        let spread = [2.0, 0.5, 1.0, 0.0];
        let pred = [96.0, 98.0, 80.0, 85.0];
        let c = order_check(&meas, &spread, &[3, 3, 3, 3], &pred);
        assert_eq!(c, OrderCheck { pairs: 6, apart: 5, right: 4, tied: 1, min_runs: 3 });
        assert_eq!(c.share_right(), Some(0.8));
        // over every pair, the tie counts: 4 of 6
        assert!((pairwise_correct(&meas, &pred).unwrap() - 4.0 / 6.0).abs() < 1e-12);
        // wider spreads turn A–B into a tie too (3 ≤ 2 + 1.5), and the swap no longer counts
        let c = order_check(&meas, &[2.0, 1.5, 1.0, 0.0], &[3, 3, 3, 3], &pred);
        assert_eq!((c.apart, c.right, c.tied), (4, 4, 2));
        // a difference equal to the combined spread is a tie; an equal prediction is not right
        let c = order_check(&[10.0, 8.0, 5.0], &[1.0, 1.0, 0.0], &[2, 2, 1], &[7.0, 1.0, 1.0]);
        assert_eq!(c, OrderCheck { pairs: 3, apart: 2, right: 1, tied: 1, min_runs: 1 });
        assert!(c.text().contains("no spread was measured"), "{}", c.text());
        // nothing apart: no share
        let c = order_check(&[10.0, 10.5], &[1.0, 1.0], &[3, 3], &[1.0, 2.0]);
        assert_eq!((c.apart, c.tied, c.share_right()), (0, 1, None));
        assert!(c.text().starts_with("no pair apart"), "{}", c.text());
    }

    #[test]
    fn a_run_id_names_its_point() {
        assert_eq!(point_id("p003_micro8_nproc2_r2", 1), "p003_micro8_nproc2");
        assert_eq!(point_id("p003_micro8_nproc2", 0), "p003_micro8_nproc2");
        // only the run's own suffix goes
        assert_eq!(point_id("p003_micro8_nproc2_r2", 0), "p003_micro8_nproc2_r2");
    }

    #[test]
    fn rank_statistics() {
        let a = [1.0, 2.0, 3.0, 4.0];
        assert!((spearman(&a, &[10.0, 20.0, 30.0, 40.0]).unwrap() - 1.0).abs() < 1e-12);
        assert!((spearman(&a, &[4.0, 3.0, 2.0, 1.0]).unwrap() + 1.0).abs() < 1e-12);
        // one swapped pair of 6: 5/6 right; ρ = 1 − 6·2/(4·15) = 0.8
        assert!((pairwise_correct(&a, &[1.0, 3.0, 2.0, 4.0]).unwrap() - 5.0 / 6.0).abs() < 1e-12);
        assert!((spearman(&a, &[1.0, 3.0, 2.0, 4.0]).unwrap() - 0.8).abs() < 1e-12);
        assert_eq!(ranks(&[5.0, 1.0, 5.0]), vec![2.5, 1.0, 2.5]);
        assert!(spearman(&[1.0, 2.0], &[1.0, 2.0]).is_none());
        assert!((crate::util::median(&[3.0, 1.0, 2.0, 10.0]).unwrap() - 2.5).abs() < 1e-12);
    }
}
