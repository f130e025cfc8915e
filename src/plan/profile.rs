//! The compute profile of one device (`vitscale bench --profile-out P.json`): for one model,
//! the time of each part of a training step of one rank at a few micro-batch sizes, and what
//! the step ran with (device, threads, dtype, recompute). The planner interpolates it in the
//! micro-batch size; nothing here touches an engine.
//!
//! The backward is timed per gradient group, in the order it finishes them (`Vit::
//! gradient_groups`: head + final norm, the blocks last to first, the embedding), by waiting
//! for the device at each group's report; that is the timeline the bucket model places the
//! reductions on. The forward has no per-block report: its per-block figure is the forward
//! split in the proportions the backward's groups take (`forward_split` says so in the file).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::model::ModelConfig;

/// What a profile file says it is (`format`) and the layout version the planner reads.
pub const PROFILE_FORMAT: &str = "vitscale-profile";
pub const PROFILE_VERSION: u64 = 1;

/// How the per-block forward is obtained (recorded in the file).
pub const FORWARD_SPLIT: &str = "forward total split over the groups in the backward's proportions";

/// One micro-batch size's measured times (seconds, medians over the repetitions).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfilePoint {
    pub micro: usize,
    /// The forward of one pass over `micro` images (loss and its gradient included).
    pub forward_s: f64,
    /// The backward of that pass.
    pub backward_s: f64,
    /// The backward per gradient group, in backward order (head, blocks last to first,
    /// embedding); sums to `backward_s`.
    pub backward_groups_s: Vec<f64>,
    /// The forward per group (same order), `FORWARD_SPLIT`.
    pub forward_groups_s: Vec<f64>,
    /// The boundary: gradient norm, clip, optimizer update, zeroing the gradients.
    pub optimizer_s: f64,
    /// A whole eager step as the benchmark times it (forward + backward + boundary, mean over
    /// the timed steps, no per-group waits): checks the parts above.
    pub step_s: f64,
    /// The same step with the training loop's per-step read-back of the losses and the
    /// gradient norm (what a run logging every step pays: the host waits for the device
    /// each step); 0 in profiles written before it was measured.
    #[serde(default)]
    pub logged_step_s: f64,
    /// How much one pass (forward + backward) varies between repetitions: 1.4826 × the
    /// median absolute deviation, seconds.
    #[serde(default)]
    pub pass_spread_s: f64,
    pub reps: usize,
}

/// A device's compute profile for one model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub format: String,
    pub version: u64,
    /// The backend's own name ("cpu (2 threads)", "NVIDIA H200 …").
    pub device: String,
    /// "cpu" or "cuda".
    pub device_kind: String,
    /// Compute threads of the rank (the CPU's rayon pool; 0 on a GPU).
    pub threads: usize,
    /// Cores of the machine the profile ran on (CPU; 0 on a GPU): CPU ranks launched here get
    /// cores / ranks threads each.
    #[serde(default)]
    pub cores: usize,
    /// Ranks that ran the profile at once on this machine, each its own copy of the step
    /// (`vitscale launch --nproc-per-node K -- bench --profile-out`, CPU): the times are those
    /// of one rank among K, as K launched training ranks run beside each other. 1: alone.
    #[serde(default = "one")]
    pub ranks: usize,
    /// The preset's name, or "custom".
    pub model: String,
    pub model_config: ModelConfig,
    pub params: usize,
    /// Activation dtype of the step ("f32" on the CPU, "bf16" on a GPU).
    pub dtype: String,
    /// Bytes per activation element (4 or 2), for the memory estimate.
    pub compute_bytes: f64,
    /// The backend's saved attention elements per image and block (`attention_saved_len`
    /// at batch 1), for the memory estimate.
    pub attention_saved_per_image: usize,
    /// Whether the profiled step ran as a CUDA graph (never: the training loop runs eager).
    pub graph: bool,
    /// Whether the backward regenerated LayerNorm/GELU outputs (the plan's choice at the
    /// largest micro profiled).
    pub recompute: bool,
    /// CUDA attention path, "cpu" on the CPU.
    pub attention: String,
    pub optimizer: String,
    pub forward_split: String,
    /// Points in increasing micro-batch size.
    pub points: Vec<ProfilePoint>,
}

fn one() -> usize {
    1
}

/// Interpolated times of one pass at a micro-batch size.
#[derive(Clone, Debug, PartialEq)]
pub struct PassTimes {
    /// The spread of one pass between repetitions (`ProfilePoint::pass_spread_s`).
    pub pass_spread_s: f64,
    pub forward_s: f64,
    pub backward_s: f64,
    pub backward_groups_s: Vec<f64>,
    pub optimizer_s: f64,
    /// What the training loop's per-step read-back adds to the step (`ProfilePoint::loop_s`).
    pub loop_s: f64,
}

impl ProfilePoint {
    /// The step logged every step beyond its parts timed with waits (forward, backward,
    /// boundary), never below 0; 0 without `logged_step_s`. The parts' waits already drain the
    /// device as the read-back does, so on a GPU what stays is the read-back's own cost (the
    /// model takes 0 on the CPU, where every call is synchronous).
    pub fn loop_s(&self) -> f64 {
        if self.logged_step_s > 0.0 { (self.logged_step_s - (self.forward_s + self.backward_s + self.optimizer_s)).max(0.0) } else { 0.0 }
    }
}

impl Profile {
    /// Reads and checks a profile file.
    pub fn load(path: &Path) -> Result<Profile, String> {
        let shown = path.display();
        let text = std::fs::read_to_string(path).map_err(|e| format!("profile {shown}: {e}"))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("profile {shown}: not valid JSON: {e}"))?;
        match v.get("format").and_then(|f| f.as_str()) {
            Some(PROFILE_FORMAT) => {}
            other => return Err(format!("profile {shown}: `format` is {other:?}, expected \"{PROFILE_FORMAT}\" (write one with `vitscale bench --profile-out`)")),
        }
        match v.get("version").and_then(|x| x.as_u64()) {
            Some(PROFILE_VERSION) => {}
            other => return Err(format!("profile {shown}: `version` is {other:?}; this vitscale reads version {PROFILE_VERSION} (profile again with this binary)")),
        }
        let p: Profile = serde_json::from_value(v).map_err(|e| format!("profile {shown}: {e}"))?;
        p.check().map_err(|e| format!("profile {shown}: {e}"))?;
        Ok(p)
    }

    /// The invariants the model relies on.
    pub fn check(&self) -> Result<(), String> {
        if self.points.is_empty() {
            return Err("`points` is empty".into());
        }
        if self.ranks == 0 {
            return Err("`ranks` is 0 (the ranks that ran the profile at once: 1 or more)".into());
        }
        let groups = self.model_config.depth + 2;
        for (i, p) in self.points.iter().enumerate() {
            if p.micro == 0 {
                return Err(format!("points[{i}].micro is 0"));
            }
            if i > 0 && p.micro <= self.points[i - 1].micro {
                return Err(format!("points[{i}].micro {} is not above the previous point's", p.micro));
            }
            if p.backward_groups_s.len() != groups || p.forward_groups_s.len() != groups {
                return Err(format!("points[{i}]: {} backward / {} forward groups, expected {groups} (depth + 2)", p.backward_groups_s.len(), p.forward_groups_s.len()));
            }
            let all = [p.forward_s, p.backward_s, p.optimizer_s, p.step_s, p.logged_step_s, p.pass_spread_s].into_iter().chain(p.backward_groups_s.iter().copied()).chain(p.forward_groups_s.iter().copied());
            if let Some(x) = all.into_iter().find(|x| !x.is_finite() || *x < 0.0) {
                return Err(format!("points[{i}]: time {x} is not a finite non-negative number of seconds"));
            }
        }
        Ok(())
    }

    /// Writes the profile as pretty JSON.
    pub fn save(&self, path: &Path) -> Result<(), String> {
        let text = serde_json::to_string_pretty(self).map_err(|e| e.to_string())?;
        crate::util::write_atomic(path, text.as_bytes()).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The times of one pass of `micro` images (fractional for balanced shares): piecewise
    /// linear between the profiled sizes, extended along the nearest segment beyond them
    /// (never below the time proportional to the nearest point). The optimizer does not depend
    /// on the micro-batch: the median over the points.
    pub fn at(&self, micro: f64) -> PassTimes {
        let pts = &self.points;
        let groups = pts[0].backward_groups_s.len();
        let lerp = |f: &dyn Fn(&ProfilePoint) -> f64| -> f64 { interpolate(pts, micro, f) };
        let backward_groups_s: Vec<f64> = (0..groups).map(|g| lerp(&|p: &ProfilePoint| p.backward_groups_s[g])).collect();
        let mut opt: Vec<f64> = pts.iter().map(|p| p.optimizer_s).collect();
        opt.sort_by(f64::total_cmp);
        PassTimes { pass_spread_s: lerp(&|p: &ProfilePoint| p.pass_spread_s), forward_s: lerp(&|p: &ProfilePoint| p.forward_s), backward_s: backward_groups_s.iter().sum(), backward_groups_s, optimizer_s: opt[opt.len() / 2], loop_s: lerp(&|p: &ProfilePoint| p.loop_s()) }
    }
}

/// `f` at `x` along the points' micro sizes (see `Profile::at`).
fn interpolate(pts: &[ProfilePoint], x: f64, f: &dyn Fn(&ProfilePoint) -> f64) -> f64 {
    if pts.len() == 1 {
        return f(&pts[0]) * x / pts[0].micro as f64;
    }
    let i = pts.iter().position(|p| p.micro as f64 >= x).unwrap_or(pts.len() - 1).max(1);
    let (a, b) = (&pts[i - 1], &pts[i]);
    let (xa, xb) = (a.micro as f64, b.micro as f64);
    let y = f(a) + (f(b) - f(a)) * (x - xa) / (xb - xa);
    // beyond the ends, not below proportional scaling of the nearest point
    let floor = if x < xa { f(a) * x / xa } else if x > xb { f(b) * x / xb } else { 0.0 };
    y.max(floor).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(micro: usize, fwd: f64) -> ProfilePoint {
        let groups = vec![fwd / 4.0; 4];
        ProfilePoint { micro, forward_s: fwd, backward_s: fwd, backward_groups_s: groups.clone(), forward_groups_s: groups, optimizer_s: 0.5, step_s: 2.0 * fwd + 0.5, logged_step_s: 0.0, pass_spread_s: 0.0, reps: 1 }
    }

    /// Linear inside the range, along the end segment outside it, floored by proportional.
    #[test]
    fn interpolation_is_piecewise_linear() {
        let pts = vec![point(8, 1.0), point(16, 1.5), point(32, 3.5)];
        let f = |p: &ProfilePoint| p.forward_s;
        assert!((interpolate(&pts, 12.0, &f) - 1.25).abs() < 1e-12);
        assert!((interpolate(&pts, 24.0, &f) - 2.5).abs() < 1e-12);
        assert!((interpolate(&pts, 16.0, &f) - 1.5).abs() < 1e-12);
        // beyond 32: the last segment's slope (1/8 s per image)
        assert!((interpolate(&pts, 40.0, &f) - 4.5).abs() < 1e-12);
        // below 8: the first segment gives 0.75 at 4, above proportional (0.5)
        assert!((interpolate(&pts, 4.0, &f) - 0.75).abs() < 1e-12);
        // far below: proportional to the first point wins over a negative extension
        let steep = vec![point(8, 1.0), point(16, 10.0)];
        assert!((interpolate(&steep, 4.0, &f) - 0.5).abs() < 1e-12);
    }
}
