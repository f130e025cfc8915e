//! A point's figures, read from its run directory only (`config.json`, each rank's
//! `metrics.jsonl`, `summary.json`): the sweep records them in `sweep.jsonl` and the report
//! recomputes them from the same files. With `train.log_every = 1` (the sweep sets it) each
//! `metrics.jsonl` line is one step; the first `warmup` steps are left out.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Mean seconds per step of each phase on one rank, over the measured steps.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Breakdown {
    pub data_s: f64,
    pub forward_s: f64,
    pub backward_s: f64,
    /// Communication the step waited for (not hidden behind the backward): the gradient
    /// buckets still in flight after the backward, and also the per-step agreement on stop
    /// signals and ZeRO's all-gather of the weights, with any wait for a slower rank at those
    /// points. So it can exceed `comm_total_s`, which counts the buckets alone.
    pub comm_exposed_s: f64,
    pub optimizer_s: f64,
    /// The step's bookkeeping (stop flags, losses read back, logging): the run's `other_s`
    /// where it logged its phases on the timeline, else the wall time in no phase.
    pub other_s: f64,
    /// Wall time of a step.
    pub step_s: f64,
    /// Gradient buckets' reduction time, each from its start to its completion, overlapped or
    /// not.
    pub comm_total_s: f64,
    /// The phases added up on the device timeline (the run's `timed_s`), when every measured
    /// record has it: against `step_s` it says whether the phases account for the step.
    #[serde(default)]
    pub timed_s: Option<f64>,
}

impl Breakdown {
    /// How far the phases' sum is from the step's wall time, relative to it (None when the
    /// run did not log its phases on the timeline).
    pub fn phase_gap(&self) -> Option<f64> {
        self.timed_s.filter(|_| self.step_s > 0.0).map(|t| (t - self.step_s) / self.step_s)
    }
}

/// What one rank measured.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RankFigures {
    pub rank: usize,
    pub breakdown: Breakdown,
    /// Peak memory the rank recorded (device memory on a GPU, resident set on the CPU).
    pub peak_mem_bytes: Option<u64>,
    pub peak_mem_source: Option<String>,
    pub bus_gb_s: Option<f64>,
}

/// A point's summary figures.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PointFigures {
    pub world_size: usize,
    pub micro_batch: usize,
    pub gradient_accumulation_steps: usize,
    pub global_batch: usize,
    pub zero_stage: u64,
    pub measured_steps: usize,
    /// Global images per second over the measured steps (rank 0's clock): all their images
    /// over all their time, the mean step.
    pub images_per_s: f64,
    pub images_per_s_per_rank: f64,
    /// The typical step's seconds: the median over the measured steps of rank 0's step time
    /// (each logged window's time over its steps counted once per step). 0 when none.
    #[serde(default)]
    pub median_step_s: f64,
    /// Global images per second at the median step (`global_batch / median_step_s`): the
    /// point's steady throughput, which a stretch of slow steps (another process, a busy host)
    /// moves only when it covers half the measured steps. 0 when none.
    #[serde(default)]
    pub steady_images_per_s: f64,
    /// Phases averaged over ranks.
    pub breakdown: Breakdown,
    /// Exposed communication / step time.
    pub comm_share: f64,
    /// Gradient bytes one rank reduces per step.
    pub comm_bytes_per_step: f64,
    pub bus_gb_s: Option<f64>,
    pub ranks: Vec<RankFigures>,
    pub val_top1: Option<f64>,
    pub final_loss: Option<f64>,
    /// Mixed-speed figures, where the run measured them (a balance or an emulated slowdown).
    #[serde(default)]
    pub balance: Option<BalanceFigures>,
}

/// What a run with `train.balance` or `train.emulate_slowdown` measured (rank 0's records,
/// whose shared figures every rank logs alike), over the measured steps.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BalanceFigures {
    /// The sum of each rank's own speed (no rank waiting for another), mean over records.
    pub ideal_images_per_s: f64,
    /// The sum of each rank's images / forward-and-backward seconds.
    pub compute_bound_images_per_s: f64,
    /// The straggler effect per step (Σ over ranks of wait − the least wait).
    pub straggler_s_per_step: f64,
    /// Each rank's share of the global batch at the last measured step.
    pub shares: Vec<f64>,
}

fn num(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(0.0)
}

/// The metrics file of `rank` under a run directory (rank 0 owns the directory, the others
/// log in `rank<r>/`).
pub fn metrics_path(run_dir: &Path, rank: usize) -> PathBuf {
    if rank == 0 { run_dir.join("metrics.jsonl") } else { run_dir.join(format!("rank{rank}")).join("metrics.jsonl") }
}

/// The step lines (not eval/resume lines) of a metrics file.
pub fn step_records(path: &Path) -> Result<Vec<Value>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))?;
        if v.get("kind").is_none() && v.get("step").is_some() {
            out.push(v);
        }
    }
    Ok(out)
}

/// Reads a finished point's run directory. `warmup` leading steps are excluded.
pub fn read_point(run_dir: &Path, warmup: u64) -> Result<PointFigures, String> {
    let cfg_path = run_dir.join("config.json");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).map_err(|e| format!("{}: {e}", cfg_path.display()))?)
        .map_err(|e| format!("{}: {e}", cfg_path.display()))?;
    let plan = cfg.get("plan").ok_or_else(|| format!("{}: no \"plan\" section", cfg_path.display()))?;
    let get = |k: &str| plan.get(k).and_then(Value::as_u64).map(|x| x as usize).ok_or_else(|| format!("{}: plan.{k} missing", cfg_path.display()));
    let (world, micro, gas, global) = (get("world_size")?, get("micro_batch")?, get("gradient_accumulation_steps")?, get("global_batch")?);
    // the run's config.json is in the input language: DeepSpeed's zero_optimization.stage
    let zero_stage = cfg.pointer("/zero_optimization/stage").or_else(|| cfg.get("zero_stage")).and_then(Value::as_u64).unwrap_or(0);

    let mut ranks = Vec::new();
    let mut images_per_s = 0.0;
    let mut measured = 0;
    let mut median_step_s = 0.0;
    let mut final_loss = None;
    let mut comm_bytes = 0.0;
    // for the mixed-speed figures: rank 0's measured records, every rank's last share
    let mut rank0_kept: Vec<Value> = Vec::new();
    let mut shares = Vec::with_capacity(world);
    let (mut all_bytes, mut all_bus_secs) = (0.0f64, 0.0f64);
    for rank in 0..world {
        let recs = step_records(&metrics_path(run_dir, rank))?;
        let kept: Vec<&Value> = recs.iter().filter(|r| r.get("step").and_then(Value::as_u64).unwrap_or(0) > warmup).collect();
        if kept.is_empty() {
            return Err(format!("{}: no step after the {warmup} warm-up steps", metrics_path(run_dir, rank).display()));
        }
        // each record covers the steps since the previous one: weight by that count
        let mut prev_step = recs.iter().map(|r| r.get("step").and_then(Value::as_u64).unwrap_or(0)).filter(|s| *s <= warmup).max().unwrap_or(0);
        let (mut steps, mut secs) = (0u64, 0.0f64);
        // (seconds per step, steps) of each measured window
        let mut per_step: Vec<(f64, u64)> = Vec::with_capacity(kept.len());
        let mut b = Breakdown::default();
        // all-reduce seconds of the records that report a bus bandwidth (multi-rank ones)
        let (mut bus_bytes, mut bus_secs) = (0.0, 0.0);
        let mut peak: Option<u64> = None;
        // the timeline's sum and bookkeeping phase, while every record has them
        let mut timed: Option<(f64, f64)> = Some((0.0, 0.0));
        let mut source = None;
        let mut bytes = 0.0;
        for r in &kept {
            let step = r.get("step").and_then(Value::as_u64).unwrap_or(prev_step + 1);
            let n = step.saturating_sub(prev_step).max(1);
            prev_step = step;
            steps += n;
            let ips = num(r, "images_per_s");
            let window = if ips > 0.0 { n as f64 * global as f64 / ips } else { 0.0 };
            secs += window;
            if window > 0.0 {
                per_step.push((window / n as f64, n));
            }
            b.data_s += num(r, "data_s");
            b.forward_s += num(r, "forward_s");
            b.backward_s += num(r, "backward_s");
            b.comm_exposed_s += num(r, "comm_s");
            b.optimizer_s += num(r, "optimizer_s");
            b.comm_total_s += num(r, "comm_total_s");
            b.step_s += window;
            timed = match (timed, r.get("timed_s").and_then(Value::as_f64)) {
                (Some((t, o)), Some(x)) => Some((t + x, o + num(r, "other_s"))),
                _ => None,
            };
            bytes += num(r, "comm_bytes");
            if r.get("bus_gb_s").and_then(Value::as_f64).is_some() {
                bus_bytes += num(r, "comm_bytes");
                bus_secs += num(r, "comm_total_s");
            }
            if let Some(m) = r.get("peak_mem_bytes").and_then(Value::as_u64) {
                peak = Some(peak.map_or(m, |p: u64| p.max(m)));
                source = r.get("peak_mem_source").and_then(Value::as_str).map(str::to_string);
            }
        }
        let n = steps.max(1) as f64;
        for x in [&mut b.data_s, &mut b.forward_s, &mut b.backward_s, &mut b.comm_exposed_s, &mut b.optimizer_s, &mut b.comm_total_s, &mut b.step_s] {
            *x /= n;
        }
        match timed {
            Some((t, o)) => (b.timed_s, b.other_s) = (Some(t / n), o / n),
            None => b.other_s = (b.step_s - (b.data_s + b.forward_s + b.backward_s + b.comm_exposed_s + b.optimizer_s)).max(0.0),
        }
        shares.push(kept.last().map_or(0.0, |r| num(r, "share")));
        if rank == 0 {
            rank0_kept = kept.iter().map(|r| (*r).clone()).collect();
            images_per_s = if secs > 0.0 { steps as f64 * global as f64 / secs } else { 0.0 };
            measured = steps as usize;
            median_step_s = weighted_median(&per_step).unwrap_or(0.0);
            final_loss = kept.last().and_then(|r| r.get("loss")).and_then(Value::as_f64);
            comm_bytes = bytes / n;
        }
        // total bytes over total time: a mean of per-record ratios would weigh a short window
        // that happened to be fast like a long one
        let bus_gb_s = crate::metrics::allreduce_bus_gb_s(bus_bytes as u64, world, bus_secs);
        all_bytes += bus_bytes;
        all_bus_secs += bus_secs;
        ranks.push(RankFigures { rank, breakdown: b, peak_mem_bytes: peak, peak_mem_source: source, bus_gb_s });
    }
    let w = ranks.len().max(1) as f64;
    let mean = |f: fn(&Breakdown) -> f64| ranks.iter().map(|r| f(&r.breakdown)).sum::<f64>() / w;
    let breakdown = Breakdown {
        data_s: mean(|b| b.data_s),
        forward_s: mean(|b| b.forward_s),
        backward_s: mean(|b| b.backward_s),
        comm_exposed_s: mean(|b| b.comm_exposed_s),
        optimizer_s: mean(|b| b.optimizer_s),
        other_s: mean(|b| b.other_s),
        step_s: ranks[0].breakdown.step_s,
        comm_total_s: mean(|b| b.comm_total_s),
        // rank 0's, beside rank 0's step
        timed_s: ranks[0].breakdown.timed_s,
    };
    let balance = balance_figures(&rank0_kept, measured, shares);
    let val_top1 = std::fs::read_to_string(run_dir.join("summary.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v.get("val_top1").and_then(Value::as_f64));
    Ok(PointFigures {
        world_size: world,
        micro_batch: micro,
        gradient_accumulation_steps: gas,
        global_batch: global,
        zero_stage,
        measured_steps: measured,
        images_per_s,
        images_per_s_per_rank: images_per_s / world as f64,
        median_step_s,
        steady_images_per_s: if median_step_s > 0.0 { global as f64 / median_step_s } else { 0.0 },
        comm_share: if breakdown.step_s > 0.0 { breakdown.comm_exposed_s / breakdown.step_s } else { 0.0 },
        breakdown,
        comm_bytes_per_step: comm_bytes,
        bus_gb_s: crate::metrics::allreduce_bus_gb_s(all_bytes as u64, world, all_bus_secs),
        ranks,
        val_top1,
        final_loss,
        balance,
    })
}

/// The median of values each counted `weight` times (`util::median` of the expanded list);
/// None when the total count is 0.
fn weighted_median(xs: &[(f64, u64)]) -> Option<f64> {
    let expanded: Vec<f64> = xs.iter().flat_map(|&(v, w)| std::iter::repeat_n(v, w as usize)).collect();
    crate::util::median(&expanded)
}

/// The mixed-speed figures from rank 0's measured records (`steps` of them in all) and every
/// rank's last share; None when the records carry none.
fn balance_figures(kept: &[Value], steps: usize, shares: Vec<f64>) -> Option<BalanceFigures> {
    let with: Vec<&Value> = kept.iter().filter(|r| r.get("ideal_images_per_s").is_some()).collect();
    if with.is_empty() {
        return None;
    }
    let n = with.len() as f64;
    let compute = with.iter().map(|r| r.get("rank_compute_images_per_s").and_then(Value::as_array).map_or(0.0, |v| v.iter().filter_map(Value::as_f64).sum())).sum::<f64>() / n;
    Some(BalanceFigures {
        ideal_images_per_s: with.iter().map(|r| num(r, "ideal_images_per_s")).sum::<f64>() / n,
        compute_bound_images_per_s: compute,
        straggler_s_per_step: with.iter().map(|r| num(r, "straggler_s")).sum::<f64>() / steps.max(1) as f64,
        shares,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_median_counts_each_value_its_weight() {
        // 1, 2, 2, 2, 9 → 2
        assert_eq!(weighted_median(&[(9.0, 1), (2.0, 3), (1.0, 1)]), Some(2.0));
        // 1, 1, 5, 7 → (1 + 5) / 2
        assert_eq!(weighted_median(&[(5.0, 1), (1.0, 2), (7.0, 1)]), Some(3.0));
        assert_eq!(weighted_median(&[]), None);
        assert_eq!(weighted_median(&[(4.0, 0)]), None);
    }

    /// A one-rank run directory whose steps took these seconds (one metrics line a step).
    fn run_with_steps(dir: &Path, global: usize, step_secs: &[f64]) {
        std::fs::create_dir_all(dir).unwrap();
        let cfg = serde_json::json!({"plan": {"world_size": 1, "micro_batch": global, "gradient_accumulation_steps": 1, "global_batch": global}});
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let lines: Vec<String> = step_secs
            .iter()
            .enumerate()
            .map(|(i, s)| serde_json::json!({"step": i + 1, "images_per_s": global as f64 / s, "loss": 2.0}).to_string())
            .collect();
        std::fs::write(dir.join("metrics.jsonl"), lines.join("\n")).unwrap();
    }

    #[test]
    fn steady_throughput_is_the_median_step_and_the_mean_keeps_every_step() {
        let dir = std::env::temp_dir().join(format!("vitscale-summary-steady-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // a slow first (warm-up) step, then 0.1 s steps with a slow stretch of two at 0.2 s
        run_with_steps(&dir, 8, &[1.0, 0.1, 0.2, 0.2, 0.1, 0.1]);
        let f = read_point(&dir, 1).unwrap();
        assert_eq!(f.measured_steps, 5);
        assert!((f.median_step_s - 0.1).abs() < 1e-9, "{}", f.median_step_s);
        assert!((f.steady_images_per_s - 80.0).abs() < 1e-6, "{}", f.steady_images_per_s);
        // 40 images in 0.7 s
        assert!((f.images_per_s - 40.0 / 0.7).abs() < 1e-6, "{}", f.images_per_s);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
