//! The step's phases on the device's timeline. Each phase ends with a mark recorded where its
//! work runs (`Backend::record_mark`: a timing event on a GPU's compute stream, the host clock
//! on the CPU), and the interval from the previous mark to it is that phase's time. The marks
//! follow one another without a gap, so the phases of a window add up to the device time from
//! its first mark to its last: the step's time as the device lived it, including the time it
//! sat idle waiting for the host (which lands in the phase the host was late for).
//!
//! Phases (docs/lab.md defines them for users):
//! - `Data`: from the previous mark to the inputs being on the device: the wait for the
//!   loader and the host→device copy the compute stream waits for.
//! - `Forward`, `Backward`: the passes.
//! - `CommExposed`: the compute stream waiting for the gradient reduction after the backward.
//! - `Optimizer`: clipping, the update, zeroing the gradients.
//! - `Other`: the step's bookkeeping (stop flags, losses read back, the metrics line).
//! - `NotTraining`: evaluation, the ranks' state agreement and checkpoints: timed apart, so it
//!   never lands in a training phase; it is not a phase of the step.
//!
//! Marks are read back only when a window is read (logging steps); reading waits for the
//! last mark. The marks are reused from window to window.

use std::time::Instant;

use crate::backend::{BResult, Backend};
use crate::metrics::PhaseTimes;

/// What the interval ending at a mark was spent on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Data,
    Forward,
    Backward,
    CommExposed,
    Optimizer,
    Other,
    NotTraining,
}

impl Phase {
    /// The name a trace span of this phase carries.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::CommExposed => "wait for gradients",
            Phase::Optimizer => "clip + optimizer",
            Phase::Other => "bookkeeping",
            Phase::NotTraining => "evaluation / checkpoint",
        }
    }
}

/// One read window: the training phases' sums, and each interval for the trace.
#[derive(Clone, Debug, Default)]
pub struct WindowTimes {
    pub phases: PhaseTimes,
    /// Seconds of `Phase::Other`.
    pub other_s: f64,
    /// Seconds of the training phases together: the window's steps on the device timeline.
    pub step_s: f64,
    /// Every interval of the window on the host's clock (seconds since the run's epoch): the
    /// last mark is placed at the moment the host saw it reached, the others before it by their
    /// device-time distance.
    pub spans: Vec<(Phase, f64, f64)>,
}

/// The marks of the current window of one rank.
pub struct Timeline<B: Backend> {
    /// `marks[0]` is the anchor (the previous window's last mark); `marks[1..used]` this
    /// window's, in order; `phases[i]` is the phase of the interval ending at `marks[i]`.
    marks: Vec<B::Mark>,
    phases: Vec<Phase>,
    used: usize,
    /// The run's clock origin, for the spans.
    epoch: Instant,
}

impl<B: Backend> Timeline<B> {
    /// A timeline whose anchor is recorded now.
    pub fn start(be: &B, epoch: Instant) -> BResult<Self> {
        let mut anchor = be.new_mark()?;
        be.record_mark(&mut anchor)?;
        Ok(Timeline { marks: vec![anchor], phases: vec![Phase::NotTraining], used: 1, epoch })
    }

    /// Ends the interval since the previous mark as `phase`.
    pub fn mark(&mut self, be: &B, phase: Phase) -> BResult<()> {
        if self.used == self.marks.len() {
            self.marks.push(be.new_mark()?);
            self.phases.push(phase);
        }
        be.record_mark(&mut self.marks[self.used])?;
        self.phases[self.used] = phase;
        self.used += 1;
        Ok(())
    }

    /// The window's intervals by phase (waits until the device reaches the last mark); the last
    /// mark becomes the next window's anchor.
    pub fn read(&mut self, be: &B) -> BResult<WindowTimes> {
        let mut out = WindowTimes::default();
        let mut secs = Vec::with_capacity(self.used);
        for i in 1..self.used {
            secs.push(be.seconds_between(&self.marks[i - 1], &self.marks[i])?);
        }
        // the last mark is reached now (the read waited for it): place the intervals before it
        let mut end = self.epoch.elapsed().as_secs_f64();
        for (i, &s) in secs.iter().enumerate().rev() {
            out.spans.push((self.phases[i + 1], end - s, end));
            end -= s;
        }
        out.spans.reverse();
        for (i, s) in secs.into_iter().enumerate() {
            let p = &mut out.phases;
            match self.phases[i + 1] {
                Phase::Data => p.data_s += s,
                Phase::Forward => p.forward_s += s,
                Phase::Backward => p.backward_s += s,
                Phase::CommExposed => p.comm_s += s,
                Phase::Optimizer => p.optimizer_s += s,
                Phase::Other => out.other_s += s,
                Phase::NotTraining => continue,
            }
            out.step_s += s;
        }
        self.marks.swap(0, self.used - 1);
        self.used = 1;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use std::time::Duration;

    /// The phases tile the timeline: their sum is the time from the anchor to the last training
    /// mark, evaluation time stays out, and each phase gets its own interval.
    #[test]
    fn phases_add_up_to_the_window_and_leave_evaluation_out() {
        let be = Cpu::new();
        let t0 = Instant::now();
        let mut tl = Timeline::start(&be, t0).unwrap();
        let nap = |ms| std::thread::sleep(Duration::from_millis(ms));
        nap(20);
        tl.mark(&be, Phase::Data).unwrap();
        nap(40);
        tl.mark(&be, Phase::Forward).unwrap();
        nap(60);
        tl.mark(&be, Phase::NotTraining).unwrap();
        nap(30);
        tl.mark(&be, Phase::Backward).unwrap();
        let w = tl.read(&be).unwrap();
        let total = t0.elapsed().as_secs_f64();
        let p = w.phases;
        // each phase at least its sleep, and not much more (a loaded 2-core machine: 15 ms)
        for (got, want) in [(p.data_s, 0.020), (p.forward_s, 0.040), (p.backward_s, 0.030)] {
            assert!(got >= want && got < want + 0.015, "{got} for a {want} s interval");
        }
        assert_eq!((p.comm_s, p.optimizer_s, w.other_s), (0.0, 0.0, 0.0));
        assert!((w.step_s - (p.data_s + p.forward_s + p.backward_s)).abs() < 1e-12);
        // the evaluation's 60 ms is neither in the step nor lost from the timeline
        let spans: f64 = w.spans.iter().map(|s| s.2 - s.1).sum();
        assert!(spans >= w.step_s + 0.060 && spans <= total + 1e-6, "spans {spans}, step {}, total {total}", w.step_s);
        assert_eq!(w.spans.iter().map(|s| s.0).collect::<Vec<_>>(), vec![Phase::Data, Phase::Forward, Phase::NotTraining, Phase::Backward]);
        // spans follow one another on the host clock
        for pair in w.spans.windows(2) {
            assert!((pair[0].2 - pair[1].1).abs() < 1e-9);
        }
        // the next window starts at the last mark: nothing is counted twice
        nap(10);
        tl.mark(&be, Phase::Optimizer).unwrap();
        let w2 = tl.read(&be).unwrap();
        assert!(w2.phases.optimizer_s >= 0.010 && w2.phases.optimizer_s < 0.025, "{}", w2.phases.optimizer_s);
        assert_eq!(w2.spans.len(), 1);
    }
}
