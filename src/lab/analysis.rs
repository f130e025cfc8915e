//! What the report shows, computed from the points' figures: series for the charts, strong
//! and weak scaling, and the study's findings as statements checked against the data. Nothing
//! here is hard-coded to a result: a statement's verdict is the comparison it names, done on
//! the measured numbers, and "not checked" when the sweep lacks the points it needs.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::spec::NPROC_KEY;
use super::summary::PointFigures;
use super::sweep::PointRecord;
use crate::config::keys;

/// A finished point: its record and figures.
#[derive(Clone, Debug)]
pub struct Pt<'a> {
    pub rec: &'a PointRecord,
    pub f: &'a PointFigures,
}

/// The successful points of a sweep.
pub fn finished(records: &[PointRecord]) -> Vec<Pt<'_>> {
    records.iter().filter(|r| r.ok()).filter_map(|r| r.figures.as_ref().map(|f| Pt { rec: r, f })).collect()
}

/// Whether grid key `k` is one of the study's coordinates (ranks, micro-batch, GAS, ZeRO
/// stage) or, for a global batch, follows from them.
pub fn is_study_key(k: &str) -> bool {
    k == NPROC_KEY || [keys::MICRO_BATCH, keys::GAS, keys::TRAIN_BATCH_SIZE, keys::ZERO_STAGE].iter().any(|key| key.is(k))
}

/// A point's coordinates: the four the study varies, then any other grid key.
pub fn dims(p: &Pt) -> BTreeMap<String, String> {
    let mut d = BTreeMap::new();
    // numbers zero-padded so groups sort numerically; `unpad` shows them
    d.insert("0ranks".to_string(), pad(p.f.world_size as u64));
    d.insert("1micro".to_string(), pad(p.f.micro_batch as u64));
    d.insert("2GAS".to_string(), pad(p.f.gradient_accumulation_steps as u64));
    d.insert("3ZeRO".to_string(), pad(p.f.zero_stage));
    for (k, v) in &p.rec.keys {
        if !is_study_key(k) {
            let shown = match v {
                Value::String(s) => s.clone(),
                Value::Number(n) if n.as_u64().is_some() => pad(n.as_u64().unwrap_or(0)),
                other => other.to_string(),
            };
            d.insert(format!("9{k}"), shown);
        }
    }
    d
}

fn pad(n: u64) -> String {
    format!("{n:012}")
}

/// A coordinate's value as shown (padding removed).
pub fn unpad(v: &str) -> String {
    if v.len() == 12 && v.bytes().all(|b| b.is_ascii_digit()) {
        let t = v.trim_start_matches('0');
        if t.is_empty() { "0".into() } else { t.into() }
    } else {
        v.to_string()
    }
}

fn dim_name(k: &str) -> &str {
    &k[1..]
}

/// Which coordinate a chart puts on its x axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XDim {
    Ranks,
    Micro,
    Gas,
    Zero,
}

impl XDim {
    fn key(self) -> &'static str {
        match self {
            XDim::Ranks => "0ranks",
            XDim::Micro => "1micro",
            XDim::Gas => "2GAS",
            XDim::Zero => "3ZeRO",
        }
    }
    fn value(self, f: &PointFigures) -> f64 {
        match self {
            XDim::Ranks => f.world_size as f64,
            XDim::Micro => f.micro_batch as f64,
            XDim::Gas => f.gradient_accumulation_steps as f64,
            XDim::Zero => f.zero_stage as f64,
        }
    }
}

/// A group's coordinates (name, value), as `dims` gives them.
type Coords = Vec<(String, String)>;

/// One line of a chart.
#[derive(Clone, Debug, Serialize)]
pub struct Series {
    pub name: String,
    /// (x, y) sorted by x.
    pub points: Vec<(f64, f64)>,
}

/// Groups points by every coordinate but `x` (and those in `ignore`), one series per group
/// with `y` against `x`; a series is named by the coordinates that differ between groups.
/// Several points at one x within a group (possible when `ignore` hides a coordinate) keep
/// the largest y.
pub fn series(pts: &[Pt], x: XDim, ignore: &[&str], y: impl Fn(&Pt) -> Option<f64>) -> Vec<Series> {
    let mut groups: BTreeMap<Coords, BTreeMap<i64, (f64, f64)>> = BTreeMap::new();
    for p in pts {
        let Some(yv) = y(p) else { continue };
        let key: Vec<(String, String)> = dims(p).into_iter().filter(|(k, _)| k != x.key() && !ignore.contains(&dim_name(k))).collect();
        let xv = x.value(p.f);
        let slot = groups.entry(key).or_default().entry((xv * 1000.0) as i64).or_insert((xv, yv));
        if yv > slot.1 {
            *slot = (xv, yv);
        }
    }
    // name each group by the coordinates that vary between groups
    let keys: Vec<&Vec<(String, String)>> = groups.keys().collect();
    let varying: Vec<String> = keys
        .first()
        .map(|k0| k0.iter().map(|(k, _)| k.clone()).filter(|k| keys.iter().any(|g| g.iter().find(|(kk, _)| kk == k) != k0.iter().find(|(kk, _)| kk == k))).collect())
        .unwrap_or_default();
    groups
        .into_iter()
        .map(|(key, pts)| {
            let name = key
                .iter()
                .filter(|(k, _)| varying.contains(k))
                .map(|(k, v)| match (dim_name(k), unpad(v)) {
                    ("ranks", v) => format!("{v} rank{}", if v == "1" { "" } else { "s" }),
                    (n, v) => format!("{n} {v}"),
                })
                .collect::<Vec<_>>()
                .join(", ");
            Series { name: if name.is_empty() { "all points".into() } else { name }, points: pts.into_values().collect() }
        })
        .collect()
}

/// Strong or weak scaling of one group of points: speed-up and efficiency against ideal.
#[derive(Clone, Debug, Serialize)]
pub struct Scaling {
    /// What is held fixed ("global batch 256", "per-rank batch 64 × GAS 1").
    pub name: String,
    /// The batch held fixed: the global batch (strong), images per rank per step (weak).
    pub batch: usize,
    /// (ranks, images/s, speed-up, efficiency) by ranks, relative to the fewest ranks.
    pub rows: Vec<(usize, f64, f64, f64)>,
}

fn scaling_rows(by_world: BTreeMap<usize, f64>) -> Vec<(usize, f64, f64, f64)> {
    let Some((&w0, &t0)) = by_world.iter().next() else { return vec![] };
    by_world
        .into_iter()
        .map(|(w, t)| {
            let speedup = if t0 > 0.0 { t / t0 } else { 0.0 };
            let ideal = w as f64 / w0 as f64;
            (w, t, speedup, speedup / ideal)
        })
        .collect()
}

/// Strong scaling: points with the same global batch (and ZeRO stage and other keys) at
/// different rank counts; at each rank count the fastest split of that batch.
pub fn strong_scaling(pts: &[Pt]) -> Vec<Scaling> {
    let mut groups: BTreeMap<(usize, Coords), BTreeMap<usize, f64>> = BTreeMap::new();
    for p in pts {
        let others: Vec<(String, String)> = dims(p).into_iter().filter(|(k, _)| !["0ranks", "1micro", "2GAS"].contains(&k.as_str())).collect();
        let slot = groups.entry((p.f.global_batch, others)).or_default().entry(p.f.world_size).or_insert(0.0);
        *slot = slot.max(p.f.images_per_s);
    }
    groups
        .into_iter()
        .filter(|(_, w)| w.len() >= 2)
        .map(|((gb, others), w)| Scaling { name: group_name(&format!("global batch {gb}"), &others), batch: gb, rows: scaling_rows(w) })
        .collect()
}

/// Weak scaling: points with the same per-rank work (micro, GAS, ZeRO, other keys) at
/// different rank counts.
pub fn weak_scaling(pts: &[Pt]) -> Vec<Scaling> {
    let mut groups: BTreeMap<Vec<(String, String)>, BTreeMap<usize, f64>> = BTreeMap::new();
    for p in pts {
        let key: Vec<(String, String)> = dims(p).into_iter().filter(|(k, _)| k != "0ranks").collect();
        let slot = groups.entry(key).or_default().entry(p.f.world_size).or_insert(0.0);
        *slot = slot.max(p.f.images_per_s);
    }
    groups
        .into_iter()
        .filter(|(_, w)| w.len() >= 2)
        .map(|(key, w)| {
            let get = |n: &str| key.iter().find(|(k, _)| k == n).map(|(_, v)| unpad(v)).unwrap_or_default();
            let others: Vec<(String, String)> = key.iter().filter(|(k, _)| !["1micro", "2GAS"].contains(&k.as_str())).cloned().collect();
            let per_rank = get("1micro").parse::<usize>().unwrap_or(0) * get("2GAS").parse::<usize>().unwrap_or(0);
            Scaling { name: group_name(&format!("micro {} × GAS {} per rank", get("1micro"), get("2GAS")), &others), batch: per_rank, rows: scaling_rows(w) }
        })
        .collect()
}

fn group_name(head: &str, others: &[(String, String)]) -> String {
    let mut s = head.to_string();
    for (k, v) in others {
        let v = unpad(v);
        if k == "3ZeRO" && v == "0" {
            continue;
        }
        s.push_str(&format!(", {} {v}", dim_name(k)));
    }
    s
}

/// A statement's verdict.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(rename_all = "snake_case", tag = "verdict", content = "why")]
pub enum Verdict {
    True,
    False,
    /// The sweep lacks what the statement needs (the text says what).
    NotChecked(String),
}

/// A finding: the statement, the measured numbers behind it, and whether they bear it out.
#[derive(Clone, Debug, Serialize)]
pub struct Finding {
    /// The claim as the study makes it.
    pub statement: String,
    /// What the data shows, with numbers.
    pub measured: String,
    pub verdict: Verdict,
}

impl Finding {
    pub fn verdict_text(&self) -> &'static str {
        match self.verdict {
            Verdict::True => "true",
            Verdict::False => "false",
            Verdict::NotChecked(_) => "not checked",
        }
    }
}

fn verdict(b: bool) -> Verdict {
    if b { Verdict::True } else { Verdict::False }
}

/// Points at one rank count with a single value of every coordinate but micro: the batch-size
/// sweep of that rank count (GAS 1 and ZeRO 0 preferred when the sweep has several).
fn micro_sweep<'a>(pts: &[Pt<'a>], world: usize) -> Vec<Pt<'a>> {
    let at: Vec<Pt> = pts.iter().filter(|p| p.f.world_size == world).cloned().collect();
    let min_gas = at.iter().map(|p| p.f.gradient_accumulation_steps).min().unwrap_or(1);
    let min_zero = at.iter().map(|p| p.f.zero_stage).min().unwrap_or(0);
    let mut v: Vec<Pt> = at.into_iter().filter(|p| p.f.gradient_accumulation_steps == min_gas && p.f.zero_stage == min_zero).collect();
    v.sort_by_key(|p| p.f.micro_batch);
    // other grid keys: keep the first group only
    if let Some(first) = v.first() {
        let base: Vec<(String, String)> = dims(first).into_iter().filter(|(k, _)| k.starts_with('9')).collect();
        v.retain(|p| dims(p).into_iter().filter(|(k, _)| k.starts_with('9')).collect::<Vec<_>>() == base);
    }
    v.dedup_by_key(|p| p.f.micro_batch);
    v
}

fn worlds(pts: &[Pt]) -> Vec<usize> {
    let mut w: Vec<usize> = pts.iter().map(|p| p.f.world_size).collect();
    w.sort();
    w.dedup();
    w
}

fn pct(x: f64) -> String {
    format!("{:.0} %", x * 100.0)
}

/// The study's findings (`STUDY.md`), each checked against the sweep's points.
pub fn findings(pts: &[Pt]) -> Vec<Finding> {
    let mut out = Vec::new();
    let ws = worlds(pts);

    // 1. the batch-size sweet spot: where throughput stops rising
    let statement = "Throughput stops rising between micro 64 and 128 (the study's sweet spot): past the knee, a larger micro batch gains less than 5 %".to_string();
    let mut measured = Vec::new();
    let mut all_in = true;
    let mut checked = false;
    let mut still_rising = Vec::new();
    for &w in &ws {
        let sweep = micro_sweep(pts, w);
        if sweep.len() < 3 {
            continue;
        }
        let best = sweep.iter().map(|p| p.f.images_per_s).fold(0.0, f64::max);
        let knee = sweep.iter().find(|p| p.f.images_per_s >= 0.95 * best).map_or(0, |p| p.f.micro_batch);
        let best_at = sweep.iter().find(|p| p.f.images_per_s == best).map_or(0, |p| p.f.micro_batch);
        let largest = sweep.last().map_or(0, |p| p.f.micro_batch);
        if knee == largest {
            // the curve has not flattened inside the sweep: nothing says where it would
            still_rising.push(format!("{w} rank(s): still rising at the largest micro, {largest} ({best:.1} img/s)"));
            continue;
        }
        checked = true;
        all_in &= (64..=128).contains(&knee);
        measured.push(format!("{w} rank(s): throughput stops rising past micro {knee} (best {best:.1} img/s at micro {best_at})"));
    }
    measured.extend(still_rising.iter().cloned());
    out.push(Finding {
        statement,
        measured: if measured.is_empty() { "—".into() } else { measured.join("; ") },
        verdict: if checked {
            verdict(all_in)
        } else if !still_rising.is_empty() {
            Verdict::NotChecked("throughput still rises at the largest micro batch swept: extend the sweep past it".into())
        } else {
            Verdict::NotChecked("needs at least 3 micro-batch sizes at one rank count".into())
        },
    });

    // 2. small batches synchronise more than they compute
    let statement = "At the smallest micro batch, ranks spend more time in exposed communication than in forward + backward".to_string();
    let multi: Vec<usize> = ws.iter().copied().filter(|w| *w > 1).collect();
    let mut measured = Vec::new();
    let mut all = true;
    for &w in &multi {
        if let Some(p) = micro_sweep(pts, w).first() {
            let b = &p.f.breakdown;
            let compute = b.forward_s + b.backward_s;
            all &= b.comm_exposed_s > compute;
            measured.push(format!("{w} ranks, micro {}: exposed comm {:.2} ms vs compute {:.2} ms", p.f.micro_batch, b.comm_exposed_s * 1e3, compute * 1e3));
        }
    }
    out.push(Finding {
        statement,
        verdict: if measured.is_empty() { Verdict::NotChecked("needs points with more than one rank".into()) } else { verdict(all) },
        measured: if measured.is_empty() { "—".into() } else { measured.join("; ") },
    });

    // 3. communication share falls as the batch grows
    let statement = "The communication share of a step falls as the micro batch grows".to_string();
    let mut measured = Vec::new();
    let mut all = true;
    for &w in &multi {
        let s = micro_sweep(pts, w);
        if s.len() >= 2 {
            let (a, b) = (&s[0], &s[s.len() - 1]);
            all &= b.f.comm_share < a.f.comm_share;
            measured.push(format!("{w} ranks: {} at micro {} → {} at micro {}", pct(a.f.comm_share), a.f.micro_batch, pct(b.f.comm_share), b.f.micro_batch));
        }
    }
    out.push(Finding {
        statement,
        verdict: if measured.is_empty() { Verdict::NotChecked("needs 2 micro-batch sizes at a rank count above 1".into()) } else { verdict(all) },
        measured: if measured.is_empty() { "—".into() } else { measured.join("; ") },
    });

    // 4. 1 → 2 ranks halves the time; 5. near-linear scaling
    let weak = weak_scaling(pts);
    let two: Vec<(String, f64)> = weak
        .iter()
        .filter(|s| s.rows.first().map(|r| r.0) == Some(1))
        .filter_map(|s| s.rows.iter().find(|r| r.0 == 2).map(|r| (s.name.clone(), r.2)))
        .collect();
    let statement = "Going from 1 to 2 ranks at a fixed per-rank batch halves the time per image (speed-up ≥ 1.8)".to_string();
    if two.is_empty() {
        out.push(Finding { statement, measured: "—".into(), verdict: Verdict::NotChecked("needs the same per-rank batch at 1 and 2 ranks".into()) });
    } else {
        let ok = two.iter().filter(|(_, s)| *s >= 1.8).count();
        let (lo, hi) = two.iter().fold((f64::MAX, 0.0f64), |(lo, hi), (_, s)| (lo.min(*s), hi.max(*s)));
        let speedups: Vec<f64> = two.iter().map(|(_, s)| *s).collect();
        let median = crate::util::median(&speedups).unwrap_or(0.0);
        out.push(Finding {
            statement,
            measured: format!("speed-up {lo:.2}–{hi:.2} (median {median:.2}) over {} per-rank batches; ≥ 1.8 in {ok}", two.len()),
            verdict: verdict(median >= 1.8),
        });
    }
    for (kind, groups) in [("weak", &weak), ("strong", &strong_scaling(pts))] {
        let statement = format!("Data parallelism scales near-linearly ({kind} scaling): efficiency at the most ranks is at least 90 %");
        // the group reaching the most ranks, then the largest batch: the study's setting
        let pick = groups.iter().max_by_key(|s| (s.rows.last().map_or(0, |r| r.0), s.batch));
        match pick {
            None => out.push(Finding {
                statement,
                measured: "—".into(),
                verdict: Verdict::NotChecked(format!("needs {} at 2 or more rank counts", if kind == "weak" { "one per-rank batch" } else { "one global batch" })),
            }),
            Some(s) => {
                let last = s.rows.last().copied().unwrap_or((1, 0.0, 1.0, 1.0));
                let first = s.rows[0];
                out.push(Finding {
                    statement,
                    measured: format!(
                        "{}: efficiency at {} ranks is {} (speed-up {:.2} over {} rank{}: {:.1} → {:.1} img/s)",
                        s.name, last.0, pct(last.3), last.2, first.0, if first.0 == 1 { "" } else { "s" }, first.1, last.1
                    ),
                    verdict: verdict(last.3 >= 0.9),
                });
            }
        }
    }

    // 6. gradient accumulation
    let statement = "With several ranks, gradient accumulation raises throughput at the smallest micro batch (fewer synchronisations per image)".to_string();
    let mut measured = Vec::new();
    let mut all = true;
    for &w in &multi {
        let at: Vec<&Pt> = pts.iter().filter(|p| p.f.world_size == w).collect();
        let Some(min_micro) = at.iter().map(|p| p.f.micro_batch).min() else { continue };
        let mut by_gas: Vec<&&Pt> = at.iter().filter(|p| p.f.micro_batch == min_micro && p.f.zero_stage == 0).collect();
        by_gas.sort_by_key(|p| p.f.gradient_accumulation_steps);
        if let (Some(a), Some(b)) = (by_gas.first(), by_gas.last()) {
            if a.f.gradient_accumulation_steps != b.f.gradient_accumulation_steps {
                all &= b.f.images_per_s > a.f.images_per_s;
                measured.push(format!(
                    "{w} ranks, micro {min_micro}: {:.1} img/s at GAS {} vs {:.1} at GAS {}",
                    b.f.images_per_s, b.f.gradient_accumulation_steps, a.f.images_per_s, a.f.gradient_accumulation_steps
                ));
            }
        }
    }
    out.push(Finding {
        statement,
        verdict: if measured.is_empty() { Verdict::NotChecked("needs 2 GAS values at a rank count above 1".into()) } else { verdict(all) },
        measured: if measured.is_empty() { "—".into() } else { measured.join("; ") },
    });

    // 7. memory against ZeRO stage
    let statement = "Sharding with ZeRO lowers the peak memory per rank below stage 0's".to_string();
    let stages: std::collections::BTreeSet<u64> = pts.iter().map(|p| p.f.zero_stage).collect();
    let mem = |p: &Pt| p.f.ranks.iter().filter_map(|r| r.peak_mem_bytes).max();
    if stages.len() < 2 {
        out.push(Finding {
            statement,
            measured: format!("stage {} only", stages.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(", ")),
            verdict: Verdict::NotChecked("needs points at ZeRO stage 0 and a higher stage".into()),
        });
    } else {
        let mut measured = Vec::new();
        let mut all = true;
        for p in pts.iter().filter(|p| p.f.zero_stage > 0 && p.f.world_size > 1) {
            let twin = pts.iter().find(|q| {
                q.f.zero_stage == 0 && q.f.world_size == p.f.world_size && q.f.micro_batch == p.f.micro_batch && q.f.gradient_accumulation_steps == p.f.gradient_accumulation_steps
            });
            if let (Some(q), Some(mp)) = (twin, mem(p)) {
                if let Some(mq) = mem(q) {
                    all &= mp < mq;
                    measured.push(format!("{} ranks micro {}: stage {} {:.0} MiB vs stage 0 {:.0} MiB", p.f.world_size, p.f.micro_batch, p.f.zero_stage, mp as f64 / 1048576.0, mq as f64 / 1048576.0));
                }
            }
        }
        out.push(Finding {
            statement,
            verdict: if measured.is_empty() { Verdict::NotChecked("needs a stage-0 twin with recorded memory for a sharded point".into()) } else { verdict(all) },
            measured: if measured.is_empty() { "—".into() } else { measured.join("; ") },
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lab::summary::{Breakdown, RankFigures};
    use serde_json::{json, Map};

    /// A finished point with these coordinates, throughput and step parts (seconds).
    fn point(world: usize, micro: usize, gas: usize, ips: f64, compute_s: f64, comm_s: f64) -> PointRecord {
        let step_s = compute_s + comm_s;
        let b = Breakdown { forward_s: compute_s / 3.0, backward_s: compute_s * 2.0 / 3.0, comm_exposed_s: comm_s, step_s, ..Breakdown::default() };
        let f = PointFigures {
            world_size: world,
            micro_batch: micro,
            gradient_accumulation_steps: gas,
            global_batch: world * micro * gas,
            zero_stage: 0,
            measured_steps: 10,
            images_per_s: ips,
            images_per_s_per_rank: ips / world as f64,
            median_step_s: step_s,
            steady_images_per_s: ips,
            comm_share: comm_s / step_s,
            breakdown: b.clone(),
            comm_bytes_per_step: 0.0,
            bus_gb_s: None,
            ranks: (0..world).map(|rank| RankFigures { rank, breakdown: b.clone(), peak_mem_bytes: Some(1 << 30), peak_mem_source: None, bus_gb_s: None }).collect(),
            val_top1: None,
            final_loss: None,
            balance: None,
        };
        let mut keys = Map::new();
        keys.insert(crate::config::keys::MICRO_BATCH.dotted(), json!(micro));
        keys.insert(crate::config::keys::GAS.dotted(), json!(gas));
        keys.insert(NPROC_KEY.into(), json!(world));
        PointRecord {
            id: format!("w{world}m{micro}g{gas}"),
            index: 0,
            keys,
            repeat: 0,
            status: "ok".into(),
            reason: None,
            exit_code: Some(0),
            wall_s: 1.0,
            run_dir: String::new(),
            command: String::new(),
            figures: Some(f),
        }
    }

    fn verdict_of<'a>(fs: &'a [Finding], needle: &str) -> &'a Verdict {
        &fs.iter().find(|f| f.statement.contains(needle)).unwrap_or_else(|| panic!("no finding about {needle}")).verdict
    }

    /// A study-like sweep: throughput per rank saturates at `knee`, communication is fixed per
    /// step, so small micro batches are communication-bound. `scale` is the 2-rank speed-up.
    fn sweep(knee: usize, scale: f64, comm_s: f64) -> Vec<PointRecord> {
        let mut v = Vec::new();
        for &w in &[1usize, 2] {
            for &m in &[16usize, 32, 64, 128, 256] {
                let per_rank = 1000.0 * (m.min(knee) as f64 / knee as f64);
                let ips = per_rank * if w == 1 { 1.0 } else { scale };
                let step = (w * m) as f64 / ips;
                let comm = if w == 1 { 0.0 } else { comm_s.min(step * 0.9) };
                v.push(point(w, m, 1, ips, step - comm, comm));
            }
        }
        v
    }

    #[test]
    fn verdicts_follow_the_numbers() {
        let recs = sweep(64, 1.95, 0.05);
        let pts = finished(&recs);
        let fs = findings(&pts);
        assert_eq!(verdict_of(&fs, "stops rising"), &Verdict::True);
        assert_eq!(verdict_of(&fs, "halves the time"), &Verdict::True);
        assert_eq!(verdict_of(&fs, "weak scaling"), &Verdict::True);
        assert_eq!(verdict_of(&fs, "falls as the micro batch grows"), &Verdict::True);
        assert_eq!(verdict_of(&fs, "exposed communication than in forward"), &Verdict::True);
        assert!(matches!(verdict_of(&fs, "ZeRO"), Verdict::NotChecked(_)));
        assert!(matches!(verdict_of(&fs, "gradient accumulation"), Verdict::NotChecked(_)));

        // the same sweep with a knee at 16, poor scaling and little communication: every
        // verdict that depends on those flips
        let recs = sweep(16, 1.2, 0.0001);
        let fs = findings(&finished(&recs));
        assert_eq!(verdict_of(&fs, "stops rising"), &Verdict::False);
        assert_eq!(verdict_of(&fs, "halves the time"), &Verdict::False);
        assert_eq!(verdict_of(&fs, "weak scaling"), &Verdict::False);
        assert_eq!(verdict_of(&fs, "exposed communication than in forward"), &Verdict::False);
        assert!(fs.iter().find(|f| f.statement.contains("weak scaling")).map_or(false, |f| f.measured.contains("60 %")), "{fs:?}");

        // still rising at the largest micro: the knee is outside the sweep, not a verdict
        let recs = sweep(1024, 1.95, 0.05);
        let fs = findings(&finished(&recs));
        assert!(matches!(verdict_of(&fs, "stops rising"), Verdict::NotChecked(_)));
    }

    /// An even count of speed-ups has the mean of the middle two as its median: {0.65, 0.65,
    /// 1.11, 1.67} → 0.88, not the upper middle 1.11 (which would also flip nothing here, but
    /// misstates the data).
    #[test]
    fn the_two_rank_speed_up_median_is_the_median() {
        let mut recs = Vec::new();
        for (m, s) in [(16usize, 0.65), (32, 0.65), (64, 1.11), (128, 1.67)] {
            recs.push(point(1, m, 1, 100.0, 0.1, 0.0));
            recs.push(point(2, m, 1, 100.0 * s, 0.1, 0.01));
        }
        let fs = findings(&finished(&recs));
        let f = fs.iter().find(|f| f.statement.contains("halves the time")).expect("the 1 → 2 ranks finding");
        assert!(f.measured.contains("(median 0.88)"), "{}", f.measured);
    }

    #[test]
    fn scaling_is_relative_to_the_fewest_ranks() {
        let recs = vec![point(1, 32, 2, 100.0, 0.6, 0.0), point(2, 32, 2, 180.0, 0.6, 0.1), point(4, 32, 2, 300.0, 0.6, 0.2), point(2, 32, 1, 150.0, 0.4, 0.03)];
        let pts = finished(&recs);
        let weak = weak_scaling(&pts);
        assert_eq!(weak.len(), 1, "one per-rank batch at several rank counts: {weak:?}");
        let rows = &weak[0].rows;
        assert_eq!(rows.iter().map(|r| r.0).collect::<Vec<_>>(), vec![1, 2, 4]);
        assert!((rows[1].2 - 1.8).abs() < 1e-12 && (rows[2].3 - 0.75).abs() < 1e-12);
        // global batch 128: 2 ranks × 32 × 2 and 4 ranks × 32 × 1 do not exist; 64 does at 1 and 2
        let strong = strong_scaling(&pts);
        assert_eq!(strong.len(), 1);
        assert_eq!(strong[0].batch, 64);
        assert_eq!(strong[0].rows.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>(), vec![(1, 100.0), (2, 150.0)]);
        // series: one line per rank count, sorted by x, named by what differs
        let s = series(&pts, XDim::Micro, &["GAS"], |p| Some(p.f.images_per_s));
        assert_eq!(s.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(), vec!["1 rank", "2 ranks", "4 ranks"]);
        assert_eq!(s[1].points, vec![(32.0, 180.0)], "the larger of two points at one x");
    }
}
