//! Placeholder until the optimizer kernels land (replaced by the real module).
use crate::backend::{DecayGroups, StepHyper};
use crate::config::OptimizerConfig;
pub fn sum_squares(x: &[f32]) -> f64 {
    x.iter().map(|v| (*v as f64) * (*v as f64)).sum()
}
pub fn optimizer_step(params: &mut [f32], grads: &[f32], _state: &mut [f32], opt: &OptimizerConfig, _decay: &DecayGroups, hyper: StepHyper) {
    let lr = hyper.lr;
    let _ = opt;
    for (p, g) in params.iter_mut().zip(grads) {
        *p -= lr * g * hyper.grad_scale;
    }
}
