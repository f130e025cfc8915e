//! Learning-rate schedules with DeepSpeed's exact numbers (`deepspeed/runtime/lr_schedules.py`).
//!
//! How DeepSpeed sequences them, which fixes the off-by-one we reproduce:
//! - the scheduler is built with `last_batch_iteration = -1` and immediately writes
//!   `get_lr()` at -1 into the optimizer: `warmup_min_lr` for WarmupLR/WarmupDecayLR, and 0
//!   for WarmupCosineLR (its ratio is 0 before the first step);
//! - the engine calls `scheduler.step()` *after* each successful `optimizer.step()` (skipped
//!   fp16 overflow steps do not advance it), which increments `last_batch_iteration`.
//!
//! So the optimizer step that follows `k` completed steps runs with the LR computed at
//! `last_batch_iteration = k - 1`. In particular steps 0 and 1 both use `warmup_min_lr`
//! (log warmup: `ln(0 + 1) = 0`), and the warmup uses `max(2, warmup_num_steps)`.

use crate::config::{SchedulerConfig, WarmupType};

/// The learning rate for the optimizer step taken after `step` completed (non-skipped)
/// optimizer steps; `base_lr` is the optimizer's configured lr (no scheduler = constant).
/// `run_steps` is the run's length in optimizer steps, the schedule length of
/// `total_num_steps: "auto"`.
pub fn lr_at(sched: Option<&SchedulerConfig>, base_lr: f64, step: u64, run_steps: u64) -> f64 {
    let Some(sched) = sched else { return base_lr };
    // DeepSpeed's `last_batch_iteration` for this step; -1 before the first scheduler.step().
    let it = step as i64 - 1;
    match *sched {
        SchedulerConfig::WarmupLR { warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type } => {
            if it < 0 {
                return warmup_min_lr;
            }
            let w = warmup_num_steps.max(2);
            let gamma = if (it as u64) < w { warmup_gamma(warmup_type, it, w) } else { 1.0 };
            warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma
        }
        SchedulerConfig::WarmupDecayLR { warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, total_num_steps } => {
            if it < 0 {
                return warmup_min_lr;
            }
            let w = warmup_num_steps.max(2);
            let gamma = if (it as u64) < w {
                warmup_gamma(warmup_type, it, w)
            } else {
                // Linear decay from 1 at the end of warmup to 0 at total_num_steps.
                let total = total_num_steps.resolve(run_steps);
                let left = total as f64 - it as f64;
                let span = (total as f64 - w as f64).max(1.0);
                (left / span).max(0.0)
            };
            warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma
        }
        SchedulerConfig::WarmupCosineLR { total_num_steps, warmup_min_ratio, warmup_num_steps, cos_min_ratio, warmup_type } => {
            if it < 0 {
                return 0.0;
            }
            let w = warmup_num_steps.max(2);
            let ratio = if (it as u64) < w {
                warmup_min_ratio + warmup_gamma(warmup_type, it, w) * (1.0 - warmup_min_ratio)
            } else {
                let done = (it - w as i64 + 1) as f64;
                let span = (total_num_steps.resolve(run_steps) as f64 - w as f64).max(1.0);
                // Current DeepSpeed clamps progress at 1 so the LR stays at the floor past the end.
                let progress = (done / span).min(1.0);
                let cos = (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0;
                (cos_min_ratio + (1.0 - cos_min_ratio) * cos).max(0.0)
            };
            base_lr * ratio
        }
    }
}

/// Warmup fraction at iteration `it` (0 <= it < w): log = ln(it + 1) / ln(w), linear = it / w.
fn warmup_gamma(kind: WarmupType, it: i64, w: u64) -> f64 {
    match kind {
        WarmupType::Log => ((it + 1) as f64).ln() / (w as f64).ln(),
        WarmupType::Linear => it as f64 / w as f64,
    }
}

/// A warning when the schedule's warm-up is not shorter than the run's `total_steps`: the
/// learning rate would still be warming up at the last step.
pub fn warmup_warning(scheduler: Option<&SchedulerConfig>, base_lr: f64, total_steps: u64) -> Option<String> {
    let s = scheduler?;
    let warmup = match s {
        SchedulerConfig::WarmupLR { warmup_num_steps, .. } | SchedulerConfig::WarmupDecayLR { warmup_num_steps, .. } | SchedulerConfig::WarmupCosineLR { warmup_num_steps, .. } => *warmup_num_steps,
    };
    if total_steps == 0 || warmup < total_steps {
        return None;
    }
    let last = lr_at(Some(s), base_lr, total_steps - 1, total_steps);
    Some(format!(
        "scheduler.params.warmup_num_steps {warmup} is not shorter than the run ({total_steps} steps): the learning rate is still warming up at the last step ({last:.3e}); shorten the warm-up or lengthen the run"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TotalSteps;

    /// The run's length passed where the schedule has a fixed total (which must ignore it).
    const RUN: u64 = 7;

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{a} != {b}");
    }

    #[test]
    fn no_scheduler_is_constant() {
        for k in [0, 1, 1000] {
            assert_eq!(lr_at(None, 3e-4, k, RUN), 3e-4);
        }
    }

    #[test]
    fn warmup_lr_log() {
        let s = SchedulerConfig::WarmupLR { warmup_min_lr: 0.0, warmup_max_lr: 0.001, warmup_num_steps: 10, warmup_type: WarmupType::Log };
        // Steps 0 and 1 both at the minimum (iteration -1, then ln(1) = 0).
        close(lr_at(Some(&s), 1.0, 0, RUN), 0.0);
        close(lr_at(Some(&s), 1.0, 1, RUN), 0.0);
        // Step 2: iteration 1, gamma = ln 2 / ln 10 = 0.30103.
        close(lr_at(Some(&s), 1.0, 2, RUN), 0.001 * 2f64.ln() / 10f64.ln());
        // Step 10: iteration 9, gamma = ln 10 / ln 10 = 1.
        close(lr_at(Some(&s), 1.0, 10, RUN), 0.001);
        close(lr_at(Some(&s), 1.0, 11, RUN), 0.001);
        close(lr_at(Some(&s), 1.0, 100_000, RUN), 0.001);
    }

    #[test]
    fn warmup_lr_linear_with_min() {
        let s = SchedulerConfig::WarmupLR { warmup_min_lr: 1e-4, warmup_max_lr: 1.1e-3, warmup_num_steps: 4, warmup_type: WarmupType::Linear };
        // lr = 1e-4 + 1e-3 · it / 4
        close(lr_at(Some(&s), 9.9, 0, RUN), 1e-4);
        close(lr_at(Some(&s), 9.9, 1, RUN), 1e-4);
        close(lr_at(Some(&s), 9.9, 2, RUN), 1e-4 + 0.25e-3);
        close(lr_at(Some(&s), 9.9, 4, RUN), 1e-4 + 0.75e-3);
        close(lr_at(Some(&s), 9.9, 5, RUN), 1.1e-3);
    }

    #[test]
    fn warmup_steps_below_two_use_two() {
        // warmup_num_steps = 1 behaves as 2: step 2 (iteration 1) = ln 2 / ln 2 = 1.
        let s = SchedulerConfig::WarmupLR { warmup_min_lr: 0.0, warmup_max_lr: 1.0, warmup_num_steps: 1, warmup_type: WarmupType::Log };
        close(lr_at(Some(&s), 0.0, 1, RUN), 0.0);
        close(lr_at(Some(&s), 0.0, 2, RUN), 1.0);
        let s = SchedulerConfig::WarmupLR { warmup_min_lr: 0.0, warmup_max_lr: 1.0, warmup_num_steps: 1, warmup_type: WarmupType::Linear };
        close(lr_at(Some(&s), 0.0, 2, RUN), 0.5);
        close(lr_at(Some(&s), 0.0, 3, RUN), 1.0);
    }

    #[test]
    fn warmup_decay_linear_decay() {
        let s = SchedulerConfig::WarmupDecayLR {
            warmup_min_lr: 0.0, warmup_max_lr: 0.01, warmup_num_steps: 10, warmup_type: WarmupType::Linear, total_num_steps: TotalSteps::Fixed(110),
        };
        close(lr_at(Some(&s), 0.0, 6, RUN), 0.01 * 5.0 / 10.0);
        // Iteration 10 (step 11): gamma = (110 - 10) / (110 - 10) = 1.
        close(lr_at(Some(&s), 0.0, 11, RUN), 0.01);
        // Iteration 60 (step 61): (110 - 60) / 100 = 0.5.
        close(lr_at(Some(&s), 0.0, 61, RUN), 0.005);
        // Iteration 110 and beyond: 0.
        close(lr_at(Some(&s), 0.0, 111, RUN), 0.0);
        close(lr_at(Some(&s), 0.0, 500, RUN), 0.0);
    }

    #[test]
    fn warmup_cosine_ratio_of_base() {
        let s = SchedulerConfig::WarmupCosineLR {
            total_num_steps: TotalSteps::Fixed(20), warmup_min_ratio: 0.1, warmup_num_steps: 4, cos_min_ratio: 0.01, warmup_type: WarmupType::Linear,
        };
        let base = 0.5;
        // Before the first scheduler step DeepSpeed's ratio is 0.
        close(lr_at(Some(&s), base, 0, RUN), 0.0);
        // Iteration 0: 0.1 + 0 · 0.9 = 0.1; iteration 2: 0.1 + 0.5 · 0.9 = 0.55.
        close(lr_at(Some(&s), base, 1, RUN), base * 0.1);
        close(lr_at(Some(&s), base, 3, RUN), base * 0.55);
        // Iteration 4 (step 5): progress (4-4+1)/16 = 1/16.
        let c = (1.0 + (std::f64::consts::PI / 16.0).cos()) / 2.0;
        close(lr_at(Some(&s), base, 5, RUN), base * (0.01 + 0.99 * c));
        // Iteration 11: progress 8/16 → cos term 0.5.
        close(lr_at(Some(&s), base, 12, RUN), base * (0.01 + 0.99 * 0.5));
        // Iteration 19: progress 1 → floor; past the end it stays at the floor.
        close(lr_at(Some(&s), base, 20, RUN), base * 0.01);
        close(lr_at(Some(&s), base, 1000, RUN), base * 0.01);
    }

    #[test]
    fn warmup_cosine_log_warmup() {
        let s = SchedulerConfig::WarmupCosineLR {
            total_num_steps: TotalSteps::Fixed(100), warmup_min_ratio: 0.0, warmup_num_steps: 8, cos_min_ratio: 0.0, warmup_type: WarmupType::Log,
        };
        // Iteration 3: ln 4 / ln 8 = 2/3.
        close(lr_at(Some(&s), 3.0, 4, RUN), 2.0);
    }

    #[test]
    fn auto_total_is_the_run_length() {
        let decay = |total| SchedulerConfig::WarmupDecayLR {
            warmup_min_lr: 1e-5, warmup_max_lr: 0.01, warmup_num_steps: 5, warmup_type: WarmupType::Linear, total_num_steps: total,
        };
        let cosine = |total| SchedulerConfig::WarmupCosineLR {
            total_num_steps: total, warmup_min_ratio: 0.1, warmup_num_steps: 5, cos_min_ratio: 0.01, warmup_type: WarmupType::Log,
        };
        for n in [3, 40, 123] {
            for (auto, fixed) in [(decay(TotalSteps::RunLength), decay(TotalSteps::Fixed(n))), (cosine(TotalSteps::RunLength), cosine(TotalSteps::Fixed(n)))] {
                for k in 0..n + 5 {
                    // Bit-identical: the same arithmetic on the same numbers.
                    assert_eq!(lr_at(Some(&auto), 0.5, k, n), lr_at(Some(&fixed), 0.5, k, RUN), "run of {n} steps, step {k}: {auto:?}");
                }
            }
        }
        // The run's length does reach the schedule: a longer run decays later.
        let s = decay(TotalSteps::RunLength);
        assert!(lr_at(Some(&s), 0.5, 30, 40) < lr_at(Some(&s), 0.5, 30, 123));
    }
}
