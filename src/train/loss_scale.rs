//! fp16 loss scaling with DeepSpeed's meaning (`deepspeed/runtime/fp16/loss_scaler.py` and the
//! ZeRO 1/2 optimizer's `step`): the loss gradient is multiplied by the current scale, the
//! optimizer unscales, and a step whose gradients hold an inf or NaN is skipped on every rank.
//!
//! - [`DynamicLossScaler`] is DeepSpeed's state machine (`fp16.loss_scale` 0): an overflow
//!   spends one unit of hysteresis, or halves the scale (not below `min_loss_scale`) once the
//!   hysteresis is down to 1; `loss_scale_window` finite steps since the last overflow double
//!   it and refill the hysteresis. An overflow at the minimum scale with no hysteresis left
//!   ends the run, as DeepSpeed raises there.
//! - `fp16.loss_scale` > 0 is DeepSpeed's static `LossScaler`: the scale never changes, yet an
//!   overflowing step is still skipped (ZeRO checks every fp16 step for overflow).
//! - [`LossScaling`] is what the training step holds: the scaler, the count of skipped steps
//!   (DeepSpeed's `skipped_steps`), and the decision at each boundary.
//!
//! As DeepSpeed's ZeRO 1/2 `step` does, the scale is updated *before* the gradients are
//! unscaled: on the step where the window expires, the gradients (computed with the old
//! scale) are divided by the doubled one. The logged gradient norm is unscaled by the scale
//! the gradients were computed with (DeepSpeed's `_global_grad_norm`), inf on an overflow.

use serde::{Deserialize, Serialize};

use crate::config::Precision;
use crate::train::error::TrainError;

/// DeepSpeed's `DynamicLossScaler` (its fields by their names there; `scale_factor` is 2).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DynamicLossScaler {
    pub cur_scale: f64,
    /// Updates so far (one per optimizer boundary, skipped or not).
    pub cur_iter: u64,
    /// `cur_iter` of the last overflow; -1 before any.
    pub last_overflow_iter: i64,
    pub scale_window: u64,
    pub min_scale: f64,
    /// `hysteresis`: overflows tolerated before the scale halves.
    pub delayed_shift: u32,
    pub cur_hysteresis: u32,
    pub consecutive_hysteresis: bool,
}

const SCALE_FACTOR: f64 = 2.0;

impl DynamicLossScaler {
    pub fn new(init_scale: f64, scale_window: u64, min_scale: f64, delayed_shift: u32, consecutive_hysteresis: bool) -> Self {
        DynamicLossScaler { cur_scale: init_scale, cur_iter: 0, last_overflow_iter: -1, scale_window, min_scale, delayed_shift, cur_hysteresis: delayed_shift, consecutive_hysteresis }
    }

    /// One boundary's update: `overflow` when the step's gradients were not finite. Errs where
    /// DeepSpeed raises: an overflow with the scale at its minimum and no hysteresis left.
    pub fn update_scale(&mut self, overflow: bool) -> Result<(), String> {
        if overflow {
            if self.delayed_shift == 1 || self.cur_hysteresis == 1 {
                if self.cur_scale == self.min_scale {
                    return Err(format!(
                        "fp16: the gradients overflow at the minimum loss scale ({}, fp16.min_loss_scale) with no hysteresis left; DeepSpeed stops here too (\"cannot decrease scale anymore\")",
                        self.min_scale
                    ));
                }
                self.cur_scale = (self.cur_scale / SCALE_FACTOR).max(self.min_scale);
            } else {
                self.cur_hysteresis -= 1;
            }
            self.last_overflow_iter = self.cur_iter as i64;
        } else {
            if self.consecutive_hysteresis {
                self.cur_hysteresis = self.delayed_shift;
            }
            let stable_interval = self.cur_iter as i64 - self.last_overflow_iter - 1;
            if stable_interval > 0 && (stable_interval as u64).is_multiple_of(self.scale_window) {
                if !self.consecutive_hysteresis {
                    self.cur_hysteresis = self.delayed_shift;
                }
                self.cur_scale *= SCALE_FACTOR;
            }
        }
        self.cur_iter += 1;
        Ok(())
    }
}

/// The scaler of an fp16 run: DeepSpeed's static `LossScaler` or its `DynamicLossScaler`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Scaler {
    Static { scale: f64 },
    Dynamic(DynamicLossScaler),
}

/// What the boundary does with a step's gradients.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Verdict {
    /// Finite gradients: update with `grad_scale` (1 / the scale after this step's update,
    /// as DeepSpeed unscales); `norm` is the unscaled global gradient norm.
    Apply { grad_scale: f32, norm: f64 },
    /// Non-finite gradients: no update on any rank; the gradients are zeroed.
    Skip,
}

/// The loss scaling of an fp16 run, as the training step holds it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaling {
    pub scaler: Scaler,
    /// DeepSpeed's `skipped_steps`: boundaries whose update was skipped for an overflow.
    pub skipped_steps: u64,
}

impl LossScaling {
    /// The scaling `precision` asks for: None unless fp16 is enabled.
    pub fn for_precision(precision: &Precision) -> Option<Self> {
        let Precision::Fp16 { loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale, consecutive_hysteresis } = *precision else {
            return None;
        };
        let scaler = if loss_scale > 0.0 {
            Scaler::Static { scale: loss_scale }
        } else {
            let init = 2f64.powi(initial_scale_power as i32);
            Scaler::Dynamic(DynamicLossScaler::new(init, loss_scale_window, min_loss_scale, hysteresis, consecutive_hysteresis))
        };
        Some(LossScaling { scaler, skipped_steps: 0 })
    }

    /// The current loss scale.
    pub fn scale(&self) -> f64 {
        match &self.scaler {
            Scaler::Static { scale } => *scale,
            Scaler::Dynamic(d) => d.cur_scale,
        }
    }

    /// The loss gradient's factor for a global batch of `global_batch` images: the mean's
    /// 1/batch times the scale (f32, as the forward takes it; a scale past f32's range makes
    /// it infinite, and the step overflows).
    pub fn dloss_scale(&self, global_batch: usize) -> f32 {
        (self.scale() / global_batch as f64) as f32
    }

    /// The boundary's decision from the global sum of squares of the (scaled) gradients over
    /// every rank (non-finite exactly when some gradient is inf or NaN, as it is summed in
    /// f64 from f32 values), updating the scale and the skipped-step count.
    pub fn at_boundary(&mut self, sum_squares: f64) -> Result<Verdict, TrainError> {
        let overflow = !sum_squares.is_finite();
        let prev = self.scale();
        if let Scaler::Dynamic(d) = &mut self.scaler {
            d.update_scale(overflow).map_err(TrainError::Config)?;
        }
        if overflow {
            self.skipped_steps += 1;
            return Ok(Verdict::Skip);
        }
        Ok(Verdict::Apply { grad_scale: (1.0 / self.scale()) as f32, norm: sum_squares.sqrt() / prev })
    }

    /// Optimizer steps applied after `steps` boundaries: the count Adam's bias correction and
    /// the LR schedule see (DeepSpeed neither steps the optimizer nor the scheduler on a skip).
    pub fn applied(&self, steps: u64) -> u64 {
        steps.saturating_sub(self.skipped_steps)
    }

    /// The scaling's state for a checkpoint's `state.json`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    /// The scaling saved in a checkpoint's `state.json` (under `loss_scaling`).
    pub fn from_json(v: &serde_json::Value) -> Result<Self, String> {
        serde_json::from_value(v.clone()).map_err(|e| format!("loss_scaling: {e}"))
    }

    /// Continues the scaling of a checkpoint (`saved`, from its `state.json`): the scale, the
    /// scaler's counters and the skipped steps come from it, so a resumed run scales exactly
    /// as the straight run; the settings (window, hysteresis, minimum) are this run's
    /// configuration. A checkpoint with the other kind of scaler is refused.
    pub fn restore(&mut self, saved: &serde_json::Value) -> Result<(), String> {
        let s = Self::from_json(saved)?;
        match (&mut self.scaler, s.scaler) {
            // a static scale is the configuration's; nothing of it evolves
            (Scaler::Static { .. }, Scaler::Static { .. }) => {}
            (Scaler::Dynamic(d), Scaler::Dynamic(saved)) => {
                d.cur_scale = saved.cur_scale;
                d.cur_iter = saved.cur_iter;
                d.last_overflow_iter = saved.last_overflow_iter;
                d.cur_hysteresis = saved.cur_hysteresis;
            }
            _ => return Err("the checkpoint's loss scaling is of the other kind (static vs dynamic, fp16.loss_scale)".into()),
        }
        self.skipped_steps = s.skipped_steps;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dynamic(power: i32, window: u64, hyst: u32) -> LossScaling {
        LossScaling { scaler: Scaler::Dynamic(DynamicLossScaler::new(2f64.powi(power), window, 1.0, hyst, false)), skipped_steps: 0 }
    }

    #[test]
    fn an_overflow_skips_and_counts_and_a_finite_step_unscales_by_the_updated_scale() {
        let mut s = dynamic(4, 2, 1);
        assert_eq!(s.dloss_scale(4), 4.0);
        assert_eq!(s.at_boundary(f64::INFINITY).unwrap(), Verdict::Skip);
        assert_eq!(s.at_boundary(f64::NAN).unwrap(), Verdict::Skip);
        assert_eq!((s.scale(), s.skipped_steps, s.applied(2)), (4.0, 2, 0));
        // iterations 2 and 3 keep 4 (0 and 1 stable since the overflow at 1); iteration 4
        // (2 stable) doubles it before unscaling; the norm is unscaled by the scale used
        assert_eq!(s.at_boundary(64.0).unwrap(), Verdict::Apply { grad_scale: 0.25, norm: 2.0 });
        assert_eq!(s.at_boundary(64.0).unwrap(), Verdict::Apply { grad_scale: 0.25, norm: 2.0 });
        assert_eq!(s.at_boundary(64.0).unwrap(), Verdict::Apply { grad_scale: 0.125, norm: 2.0 });
        assert_eq!((s.scale(), s.applied(5)), (8.0, 3));
    }

    #[test]
    fn a_scale_past_f32_overflows_the_loss_gradient() {
        assert!(dynamic(200, 10, 2).dloss_scale(8).is_infinite());
        assert_eq!(dynamic(130, 10, 2).dloss_scale(8), 2f32.powi(127));
    }

    #[test]
    fn resume_takes_the_scale_and_counters_and_refuses_other_kinds() {
        let mut a = dynamic(10, 3, 2);
        for sq in [f64::INFINITY, 1.0, f64::INFINITY, f64::INFINITY] {
            a.at_boundary(sq).unwrap();
        }
        let mut b = dynamic(10, 3, 2);
        b.restore(&a.to_json()).unwrap();
        assert_eq!(a, b);
        let mut st = LossScaling { scaler: Scaler::Static { scale: 8.0 }, skipped_steps: 0 };
        assert!(st.restore(&a.to_json()).unwrap_err().contains("other kind"));
        assert!(b.restore(&serde_json::json!({"skipped_steps": 1})).unwrap_err().contains("loss_scaling"));
    }
}
