//! Mixed-speed ranks: straggler emulation (`train.emulate_slowdown`) and a split of the global
//! batch proportional to each rank's speed (`train.balance`), with the gradient of the equal
//! split. docs/balance.md is the user's description; this is how the loop does it.
//!
//! **Exactness.** A split only moves images between ranks: the global batch of a step is the
//! same images (`data::shard_sized` cuts the sampler's global batch, rank-major, into
//! micro-batches of each rank's size), each image's augmentation and mixing draw are keyed by
//! its dataset index and the global step, and mixing partners are neighbours in the global
//! order (every size is even when mixing, so a pair never straddles two ranks). The loss
//! gradient of every image is scaled by 1 / global batch (`train::step`), so a rank's summed
//! gradient already carries the weight of its share (n_r / G · its mean) before the reduction
//! sums the ranks — whatever the reduction is (all-reduce, ZeRO's reduce-scatter).
//!
//! **Sizes.** Shares are apportioned in units (1 image, 2 when mixing) by largest remainder,
//! every rank at least one unit, so the sizes always add up to the equal split's total
//! (world × `train_micro_batch_size_per_gpu`) per micro-batch.
//!
//! **Auto.** Every step each rank measures its compute (the passes of its micro-batches,
//! including an emulated slowdown) and its wait at the gradient synchronization; one host
//! all-reduce gives every rank every rank's numbers, so all of them take the same decision.
//! Every `train.balance_every` steps the speeds (each rank's median over the window's steps of
//! images / compute second, averaged with the previous estimate) give new sizes, taken when they shorten the predicted
//! step by more than a few per cent; they take effect `lag` steps later, at a step boundary (the loader builds
//! batches ahead; `data::split` keeps decided steps fixed). Steps that carry one-off costs (the
//! first two of the run, the first at new sizes, which may allocate larger buffers) are left
//! out of the estimate.
//!
//! **Emulation.** A rank with factor f waits (f − 1) × its measured compute per image × the
//! micro-batch's images before each micro-batch, after synchronizing the device: the device
//! idles that long, so its gradients reach the reduction that much later, as on a slower card.
//! The estimate is the median of the rank's last few micro-batches; the run's first
//! micro-batch is slowed after it ran.
//!
//! **Measuring** synchronizes the device at each micro-batch's start and end and after the
//! gradient synchronization; it is on only when a balance or an emulation is configured, so
//! plain runs keep a step without host synchronization.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::{Backend, ParamGroups, Span, StepHyper};
use crate::util::median;
use crate::config::OptimizerConfig;
use crate::model::Vit;
use crate::comm::Comm;
use crate::config::{Balance, RunConfig};
use crate::data::split::SplitSchedule;
use crate::metrics::trace::{Trace, Track};
use crate::metrics::BalanceRecord;
use crate::train::error::TrainError;
use crate::train::plan::Plan;
use crate::train::shares::apportion;
use crate::train::sync::{GradSync, Updated};

/// The balance state of one rank through a run.
pub struct Balancer {
    rank: usize,
    world: usize,
    unit: usize,
    /// Images of one micro-batch summed over the ranks (world × the equal micro-batch).
    total: usize,
    mode: Balance,
    every: u64,
    /// Steps between a decision and the step it applies to.
    lag: u64,
    /// Sizes by step, read by the loader; None under the equal split.
    pub schedule: Option<Arc<SplitSchedule>>,
    /// This rank's slowdown factor (1 = none).
    slowdown: f64,
    /// Whether anything is measured (a balance or an emulation is configured).
    pub measuring: bool,
    /// Seconds per image of this rank's last few measured micro-batches (without emulation).
    recent_per_image: Vec<f64>,
    micro_start: Option<Instant>,
    // this step
    step_compute: f64,
    step_emulated: f64,
    step_wait: f64,
    step_images: usize,
    /// When this step began: the previous step's end (or the run's first micro-batch).
    step_began: Option<Instant>,
    // the auto estimate's window
    /// Each measured step's speed (images per compute second) of every rank.
    win_speeds: Vec<Vec<f64>>,
    /// Steps left out of the estimate.
    skip: Vec<u64>,
    // the metrics window
    rec: BalanceRecord,
    rec_images: Vec<f64>,
    rec_compute: Vec<f64>,
    /// Each rank's seconds of steps as if it never waited for a later rank (see `end_step`).
    rec_own: Vec<f64>,
    /// Images those seconds trained.
    rec_own_images: Vec<f64>,
    current: Vec<usize>,
    /// Each rank's estimated speed (images per compute second), smoothed over windows.
    speeds: Option<Vec<f64>>,
}

/// Micro-batches whose median time per image sets the emulated delay: one descheduled
/// micro-batch does not stretch the next one's delay.
const RECENT: usize = 5;

/// Weight of the previous estimate in each new speed estimate: one noisy window (a loaded
/// host, a clock change) moves the split only half way.
const SMOOTHING: f64 = 0.5;

/// A new split changes the sizes only when it is predicted to shorten the step by more than
/// this fraction: measurement noise does not move images back and forth.
const MIN_GAIN: f64 = 0.03;

/// The split for ranks of estimated `speeds` (images per second), or None to keep `current`:
/// proportional sizes (`apportion`), taken when the slowest rank's predicted time (its images
/// / its speed) drops by more than `min_gain` (`MIN_GAIN`, or more when the speeds are noisy:
/// `noise_gain`).
pub fn decide(speeds: &[f64], current: &[usize], total: usize, unit: usize, min_gain: f64) -> Option<Vec<usize>> {
    let next = apportion(total, speeds, unit);
    let step_time = |sizes: &[usize]| sizes.iter().zip(speeds).map(|(&b, v)| b as f64 / v).fold(0.0, f64::max);
    (next != current && step_time(&next) < (1.0 - min_gain.max(MIN_GAIN)) * step_time(current)).then_some(next)
}

/// The gain a new split must promise when the window's speeds scatter: twice the largest
/// relative median absolute deviation of any rank's per-step speed, at most `MAX_NOISE_GAIN`.
/// Ranks that time-share cores (more ranks than cores) measure speeds that move by tens of
/// percent from step to step; a split chasing that noise loses to the equal split, one
/// following a real difference in speed (a 3× slower rank) still clears the bar.
pub fn noise_gain(window: &[Vec<f64>]) -> f64 {
    noise_scatter(window).min(MAX_NOISE_GAIN)
}

/// The most the noise may raise the bar: a 1.5× slower rank (a 25 % shorter step balanced)
/// is still followed however noisy the measurements are.
const MAX_NOISE_GAIN: f64 = 0.25;

fn noise_scatter(window: &[Vec<f64>]) -> f64 {
    let ranks = window.first().map_or(0, Vec::len);
    (0..ranks)
        .filter_map(|q| {
            let v: Vec<f64> = window.iter().map(|w| w[q]).collect();
            let m = median(&v)?;
            let dev: Vec<f64> = v.iter().map(|x| (x - m).abs()).collect();
            (m > 0.0).then(|| median(&dev).unwrap_or(0.0) / m)
        })
        .fold(0.0, f64::max)
        * 2.0
}

impl Balancer {
    /// The balance of rank `rank` for a run of `cfg` with `plan`, starting at step
    /// `start_step`; the loader builds batches up to `prefetch` micro-batches ahead.
    pub fn new(cfg: &RunConfig, plan: &Plan, rank: usize, start_step: u64, prefetch: usize) -> Balancer {
        // (ranks that split the batch: the data-parallel degree)
        let (world, micro, gas) = (plan.data_parallel, plan.micro_batch, plan.gradient_accumulation_steps);
        let u = plan.split_unit;
        let total = world * micro;
        // the loader's window may hold prefetch micro-batches of steps not yet run: decide at
        // least that far ahead so it never waits for a decision it holds up (data::split)
        let lag = prefetch.max(1).div_ceil(gas.max(1)) as u64 + 1;
        let initial = plan.rank_micro_batches.clone();
        let schedule = match &cfg.train.balance {
            Balance::Off => None,
            Balance::Shares(_) => Some(SplitSchedule::new(initial.clone(), u64::MAX)),
            Balance::Auto => Some(SplitSchedule::new(initial.clone(), start_step + lag + 1)),
        };
        let slowdown = cfg.train.emulate_slowdown.iter().find(|(r, _)| *r == rank).map_or(1.0, |&(_, f)| f);
        let measuring = !cfg.train.balance.is_off() || !cfg.train.emulate_slowdown.is_empty();
        Balancer {
            rank,
            world,
            unit: u,
            total,
            mode: cfg.train.balance.clone(),
            every: cfg.train.balance_every.max(1),
            lag,
            schedule,
            slowdown,
            measuring,
            recent_per_image: Vec::new(),
            micro_start: None,
            step_compute: 0.0,
            step_emulated: 0.0,
            step_wait: 0.0,
            step_images: 0,
            win_speeds: Vec::new(),
            skip: vec![start_step, start_step + 1],
            rec: BalanceRecord::default(),
            rec_images: vec![0.0; world],
            rec_compute: vec![0.0; world],
            rec_own: vec![0.0; world],
            rec_own_images: vec![0.0; world],
            step_began: None,
            current: initial,
            speeds: None,
        }
    }

    /// A line for the run's start saying what is balanced and emulated (None: nothing).
    pub fn describe(&self) -> Option<String> {
        if !self.measuring {
            return None;
        }
        let split = match &self.mode {
            Balance::Off => "equal split".to_string(),
            Balance::Shares(_) => format!("fixed split, micro-batches {:?}", self.current),
            Balance::Auto => format!("auto split, re-estimated every {} steps, applied {} steps later", self.every, self.lag + 1),
        };
        let slow = if self.slowdown > 1.0 { format!("; this rank emulates a {}× slower device", self.slowdown) } else { String::new() };
        Some(format!("balance: {split}{slow}"))
    }

    /// The per-rank micro-batch sizes of step `step`, as the loader cut it.
    pub fn sizes(&self, step: u64) -> Result<Vec<usize>, TrainError> {
        match &self.schedule {
            None => Ok(self.current.clone()),
            Some(s) => s.decided(step).map(|v| v.to_vec()).ok_or_else(|| TrainError::Config(format!("train.balance: the split of step {step} was not decided ahead"))),
        }
    }

    /// Before one of this rank's micro-batches of `b` images: emulate the slowdown, start the
    /// compute clock.
    pub fn before_micro<B: Backend>(&mut self, be: &B, b: usize, step: u64, trace: Option<&mut Trace>) -> Result<(), TrainError> {
        if !self.measuring {
            return Ok(());
        }
        be.synchronize()?;
        // (the run's first step: its own time starts with its first micro-batch)
        self.step_began.get_or_insert_with(Instant::now);
        if let Some(per) = median(&self.recent_per_image) {
            self.emulate(per * b as f64, step, trace);
        }
        self.micro_start = Some(Instant::now());
        Ok(())
    }

    /// After the micro-batch's passes: stop the compute clock (the device done).
    pub fn after_micro<B: Backend>(&mut self, be: &B, b: usize, step: u64, trace: Option<&mut Trace>) -> Result<(), TrainError> {
        let Some(t0) = self.micro_start.take() else { return Ok(()) };
        be.synchronize()?;
        let secs = t0.elapsed().as_secs_f64();
        let first = self.recent_per_image.is_empty();
        if self.recent_per_image.len() == RECENT {
            self.recent_per_image.remove(0);
        }
        self.recent_per_image.push(secs / b.max(1) as f64);
        self.step_compute += secs;
        self.step_images += b;
        if first {
            // nothing was measured before the run's first micro-batch: slow it down after it
            self.emulate(secs, step, trace);
        }
        Ok(())
    }

    /// Holds this rank for (factor − 1) × `compute_s`, the device idle.
    fn emulate(&mut self, compute_s: f64, step: u64, trace: Option<&mut Trace>) {
        let delay = (self.slowdown - 1.0) * compute_s;
        if delay <= 0.0 {
            return;
        }
        let t = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(delay));
        let spent = t.elapsed().as_secs_f64();
        self.step_compute += spent;
        self.step_emulated += spent;
        if let Some(tr) = trace {
            let args = [("step".to_string(), serde_json::json!(step)), ("factor".to_string(), serde_json::json!(self.slowdown))].into_iter().collect();
            tr.span(Track::Compute, "emulated slowdown", t, Instant::now(), args);
        }
    }

    /// Wraps the step's gradient sync so the wait at it is measured.
    pub fn timed<'s, B: Backend>(&self, inner: &'s mut dyn GradSync<B>) -> Timed<'s, B> {
        Timed { inner, measuring: self.measuring, wait_s: 0.0 }
    }

    /// The step's wait at the gradient synchronization, as `Timed` measured it.
    pub fn add_wait(&mut self, secs: f64) {
        self.step_wait += secs;
    }

    /// After step `step`'s boundary, on every rank: share the step's numbers, re-estimate
    /// under "auto", decide the split ahead.
    pub fn end_step<Buf>(&mut self, comm: &mut dyn Comm<Buf>, step: u64) -> Result<(), TrainError> {
        if !self.measuring {
            return Ok(());
        }
        let w = self.world;
        let wall = self.step_began.take().map_or(0.0, |t| t.elapsed().as_secs_f64());
        // every rank's (compute, wait, images) in its own slots: the sum is exact
        let mut all = vec![0.0f64; 3 * w];
        all[3 * self.rank] = self.step_compute;
        all[3 * self.rank + 1] = self.step_wait;
        all[3 * self.rank + 2] = self.step_images as f64;
        let mut walls = vec![0.0f64; w];
        walls[self.rank] = wall;
        all.extend(walls);
        if w > 1 {
            comm.all_reduce_host(&mut all)?;
        }
        // the next step's own time runs from here: everything a step costs (data, logging,
        // evaluation) is in it, as it is in the throughput
        self.step_began = Some(Instant::now());
        let waits: Vec<f64> = (0..w).map(|r| all[3 * r + 1]).collect();
        let least = waits.iter().copied().fold(f64::INFINITY, f64::min);
        // A rank's own time for the step: its wall time less what it waited beyond the rank
        // that waited least (the others' lateness; data, the exposed communication and the
        // update, which every rank pays, stay in). Its images over that are its speed had no rank
        // been later than it; their sum is the ideal throughput of these ranks.
        for q in 0..w {
            let own = all[3 * w + q] - (waits[q] - least);
            if all[3 * w + q] > 0.0 && own > 0.0 {
                self.rec_own[q] += own;
                self.rec_own_images[q] += all[3 * q + 2];
            }
        }
        let sizes = self.sizes(step)?;
        let r = &mut self.rec;
        r.compute_s += self.step_compute;
        r.emulated_s += self.step_emulated;
        r.wait_s += self.step_wait;
        if w > 1 {
            *r.straggler_s.get_or_insert(0.0) += waits.iter().map(|t| t - least).sum::<f64>();
        }
        for q in 0..w {
            self.rec_compute[q] += all[3 * q];
            self.rec_images[q] += all[3 * q + 2];
        }
        r.micro_batch = sizes[self.rank];
        r.share = sizes[self.rank] as f64 / self.total as f64;
        (self.step_compute, self.step_emulated, self.step_wait, self.step_images) = (0.0, 0.0, 0.0, 0);

        if let (Balance::Auto, Some(schedule)) = (&self.mode, &self.schedule) {
            if !self.skip.contains(&step) {
                if (0..w).all(|q| all[3 * q] > 0.0) {
                    self.win_speeds.push((0..w).map(|q| all[3 * q + 2] / all[3 * q]).collect());
                }
            }
            if self.win_speeds.len() as u64 >= self.every {
                let window: Vec<f64> = (0..w).map(|q| median(&self.win_speeds.iter().map(|v| v[q]).collect::<Vec<_>>()).unwrap_or(0.0)).collect();
                let speeds: Vec<f64> = match &self.speeds {
                    None => window,
                    Some(old) => old.iter().zip(&window).map(|(o, n)| SMOOTHING * o + (1.0 - SMOOTHING) * n).collect(),
                };
                let latest = schedule.decided(step + self.lag).map(|s| s.to_vec()).unwrap_or_else(|| sizes.clone());
                let next = decide(&speeds, &latest, self.total, self.unit, noise_gain(&self.win_speeds));
                self.speeds = Some(speeds);
                if let Some(next) = next {
                    let from = step + 1 + self.lag;
                    schedule.change(from, next).map_err(|known| TrainError::Config(format!("train.balance: step {known} was decided before step {from} could change")))?;
                    self.skip.push(from);
                }
                self.win_speeds.clear();
            }
            schedule.extend(step + 2 + self.lag);
        }
        self.current = sizes;
        Ok(())
    }

    /// The metrics since the previous call (None when nothing is measured).
    pub fn take_record(&mut self) -> Option<BalanceRecord> {
        if !self.measuring {
            return None;
        }
        let mut rec = std::mem::take(&mut self.rec);
        rec.rank_images_per_s = (0..self.world).map(|q| if self.rec_own[q] > 0.0 { self.rec_own_images[q] / self.rec_own[q] } else { 0.0 }).collect();
        rec.ideal_images_per_s = rec.rank_images_per_s.iter().sum();
        rec.rank_compute_images_per_s = (0..self.world).map(|q| if self.rec_compute[q] > 0.0 { self.rec_images[q] / self.rec_compute[q] } else { 0.0 }).collect();
        // the share stays what it is until the next step says otherwise
        (self.rec.share, self.rec.micro_batch) = (rec.share, rec.micro_batch);
        self.rec_images.iter_mut().for_each(|c| *c = 0.0);
        self.rec_compute.iter_mut().for_each(|c| *c = 0.0);
        self.rec_own.iter_mut().for_each(|c| *c = 0.0);
        self.rec_own_images.iter_mut().for_each(|c| *c = 0.0);
        Some(rec)
    }
}

/// A gradient sync whose `finish` — the wait for the other ranks' gradients — is timed, the
/// device synchronized after it when measuring (on a GPU the reduction runs on its own
/// stream and the compute stream waits for it).
pub struct Timed<'s, B: Backend> {
    inner: &'s mut dyn GradSync<B>,
    measuring: bool,
    pub wait_s: f64,
}

impl<B: Backend> GradSync<B> for Timed<'_, B> {
    fn reports_blocks(&self) -> bool {
        self.inner.reports_blocks()
    }
    fn ready(&mut self, be: &B, grads: &mut B::Buf, span: Span) -> Result<(), TrainError> {
        self.inner.ready(be, grads, span)
    }
    fn finish(&mut self, be: &B, grads: &mut B::Buf) -> Result<u64, TrainError> {
        let t = Instant::now();
        let bytes = self.inner.finish(be, grads)?;
        if self.measuring {
            be.synchronize()?;
        }
        self.wait_s += t.elapsed().as_secs_f64();
        Ok(bytes)
    }
    fn global_sum_squares(&mut self, be: &B, grads: &B::Buf, inf_from: f32) -> Result<f64, TrainError> {
        self.inner.global_sum_squares(be, grads, inf_from)
    }
    // the sync's own update (ZeRO's sharded one), or the update of the whole gradient
    #[allow(clippy::too_many_arguments)]
    fn update(&mut self, be: &B, vit: &mut Vit<B>, state: &mut B::Buf, opt: &OptimizerConfig, decay: &ParamGroups, hyper: StepHyper, read_norm: bool) -> Result<Updated, TrainError> {
        self.inner.update(be, vit, state, opt, decay, hyper, read_norm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speed_proportional_updates_converge_to_equal_compute_times() {
        // ranks whose micro-batch of b images takes a + c·b seconds: with no fixed cost the
        // first update lands on shares ∝ 1/c; with one, the updates approach equal times
        for (fixed, cost) in [(0.0, vec![1.0, 3.0]), (0.0, vec![1.0, 1.0, 1.0, 3.0]), (20.0, vec![1.0, 3.0]), (5.0, vec![1.0, 2.0, 1.5, 1.0])] {
            let n = cost.len();
            let total = 64 * n;
            let mut sizes = vec![64; n];
            let time = |s: &[usize]| -> Vec<f64> { s.iter().zip(&cost).map(|(&b, c)| fixed + c * b as f64).collect() };
            for _ in 0..12 {
                let t = time(&sizes);
                let speeds: Vec<f64> = sizes.iter().zip(&t).map(|(&b, t)| b as f64 / t).collect();
                sizes = apportion(total, &speeds, 2);
            }
            let t = time(&sizes);
            let (lo, hi) = (t.iter().copied().fold(f64::INFINITY, f64::min), t.iter().copied().fold(0.0, f64::max));
            // within what one unit of 2 images changes
            let step = 2.0 * cost.iter().copied().fold(0.0, f64::max);
            assert!(hi - lo <= step + 1e-9, "cost {cost:?} + {fixed}: sizes {sizes:?}, times {t:?}");
            if fixed == 0.0 {
                let inv: f64 = cost.iter().map(|c| 1.0 / c).sum();
                for (b, c) in sizes.iter().zip(&cost) {
                    assert!((*b as f64 - total as f64 / c / inv).abs() <= 2.0, "{sizes:?} for cost {cost:?}");
                }
            }
        }
    }

    #[test]
    fn a_split_changes_only_for_a_real_gain() {
        // 3:1 speeds: from the equal split the step is 2 × shorter
        assert_eq!(decide(&[3.0, 1.0], &[32, 32], 64, 1, 0.0), Some(vec![48, 16]));
        // already there, or a gain within the noise: keep
        assert_eq!(decide(&[3.0, 1.0], &[48, 16], 64, 1, 0.0), None);
        assert_eq!(decide(&[3.05, 1.0], &[48, 16], 64, 1, 0.0), None);
        assert_eq!(decide(&[1.0, 1.02], &[32, 32], 64, 2, 0.0), None);
        // speeds 1.25 : 1 promise a 10 % shorter step: taken when they are steady, kept when
        // the window's speeds scatter by ±10 % (the bar is then 20 %)
        let steady = vec![vec![1.25, 1.0]; 5];
        let noisy: Vec<Vec<f64>> = [0.9, 1.1, 1.0, 0.9, 1.1].iter().map(|f| vec![1.25 * f, 1.0 * (2.0 - f)]).collect();
        assert!(noise_gain(&steady) < 1e-12);
        assert!((noise_gain(&noisy) - 0.2).abs() < 1e-9, "{}", noise_gain(&noisy));
        assert_eq!(decide(&[1.25, 1.0], &[32, 32], 64, 1, noise_gain(&steady)), Some(vec![36, 28]));
        assert_eq!(decide(&[1.25, 1.0], &[32, 32], 64, 1, noise_gain(&noisy)), None);
        // a 3× slower rank clears a noisy bar, and however noisy, the bar stays at 25 %
        assert_eq!(decide(&[3.0, 1.0], &[32, 32], 64, 1, noise_gain(&noisy)), Some(vec![48, 16]));
        let wild: Vec<Vec<f64>> = [0.5, 1.5, 1.0, 0.5, 1.5].iter().map(|f| vec![*f, 1.0]).collect();
        assert_eq!(noise_gain(&wild), 0.25);
    }

    #[test]
    fn apportion_is_proportional_sums_up_and_gives_everyone_a_unit() {
        assert_eq!(apportion(64, &[1.0, 1.0], 1), vec![32, 32]);
        assert_eq!(apportion(64, &[3.0, 1.0], 1), vec![48, 16]);
        assert_eq!(apportion(64, &[3.0, 1.0], 2), vec![48, 16]);
        // every rank keeps a unit however slow
        assert_eq!(apportion(8, &[1.0, 1e-9, 1e-9, 1e-9], 2), vec![2, 2, 2, 2]);
        assert_eq!(apportion(10, &[1.0, 1e-9], 2), vec![8, 2]);
        // random weights: the sum is exact, sizes are multiples of the unit, within a unit of
        // the proportional value
        let mut x = 0x9e3779b97f4a7c15u64;
        for _ in 0..200 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = 1 + (x % 6) as usize;
            let unit = 1 + (x >> 8) as usize % 2;
            let total = unit * (n + (x >> 16) as usize % 100);
            let w: Vec<f64> = (0..n).map(|i| 0.1 + ((x >> (i * 5)) % 31) as f64).collect();
            let s = apportion(total, &w, unit);
            assert_eq!(s.iter().sum::<usize>(), total, "{w:?}");
            let sum: f64 = w.iter().sum();
            let want: Vec<f64> = w.iter().map(|wi| wi / sum * total as f64).collect();
            // when no rank needs raising to its one unit, each is within a unit of its
            // proportional value
            let free = want.iter().all(|&x| x >= unit as f64);
            for (si, wi) in s.iter().zip(&want) {
                assert!(si % unit == 0 && *si >= unit);
                assert!(!free || (*si as f64 - wi).abs() < unit as f64 + 1e-9, "{s:?} for {w:?}");
            }
        }
    }
}
