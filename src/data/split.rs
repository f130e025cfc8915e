//! The split of each global batch over the ranks when it is not the equal one
//! (`train.balance`): which images per micro-batch each rank feeds at each global step.
//!
//! The training loop decides the split a few steps ahead and the loader, which builds batches
//! ahead on its own thread, reads it here. A step's split is fixed once decided, so the loader
//! never builds a batch that the loop would cut differently: the loop publishes that steps
//! `..known` are decided (the last sizes carrying on), and changes sizes only from a step not
//! yet decided. A loader asking for an undecided step waits; closing the schedule (the loader
//! being dropped) ends that wait.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Per-rank micro-batch sizes by global step (steps counted over epochs, from 0).
#[derive(Debug)]
pub struct SplitSchedule {
    state: Mutex<State>,
    cv: Condvar,
}

#[derive(Debug)]
struct State {
    /// (first step, sizes from that step on), in step order.
    changes: Vec<(u64, Arc<[usize]>)>,
    /// Steps below this are decided.
    known: u64,
    closed: bool,
}

impl SplitSchedule {
    /// Sizes `initial` from step 0 on, decided for steps below `known`.
    pub fn new(initial: Vec<usize>, known: u64) -> Arc<SplitSchedule> {
        Arc::new(SplitSchedule { state: Mutex::new(State { changes: vec![(0, initial.into())], known, closed: false }), cv: Condvar::new() })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // a panic elsewhere while holding the lock leaves the data consistent (plain pushes)
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The sizes of global step `step`, waiting until that step is decided; None once the
    /// schedule is closed.
    pub fn sizes_at(&self, step: u64) -> Option<Arc<[usize]>> {
        let mut st = self.lock();
        while st.known <= step && !st.closed {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if st.known <= step {
            return None;
        }
        st.changes.iter().rev().find(|(from, _)| *from <= step).map(|(_, s)| s.clone())
    }

    /// The sizes of step `step` if it is decided, without waiting.
    pub fn decided(&self, step: u64) -> Option<Arc<[usize]>> {
        let st = self.lock();
        (step < st.known).then(|| st.changes.iter().rev().find(|(from, _)| *from <= step).map(|(_, s)| s.clone())).flatten()
    }

    /// Every step below `known` is decided.
    pub fn extend(&self, known: u64) {
        let mut st = self.lock();
        st.known = st.known.max(known);
        self.cv.notify_all();
    }

    /// From step `from` on, the sizes are `sizes`. Fails (returns the first undecided step)
    /// when `from` is already decided: a decided step never changes.
    pub fn change(&self, from: u64, sizes: Vec<usize>) -> Result<(), u64> {
        let mut st = self.lock();
        if from < st.known {
            return Err(st.known);
        }
        st.changes.retain(|(f, _)| *f < from);
        st.changes.push((from, sizes.into()));
        Ok(())
    }

    /// Ends every wait: later `sizes_at` of undecided steps return None.
    pub fn close(&self) {
        self.lock().closed = true;
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decided_steps_never_change_and_waits_end() {
        let s = SplitSchedule::new(vec![4, 4], 3);
        assert_eq!(&*s.sizes_at(2).expect("decided"), &[4, 4]);
        assert_eq!(s.change(2, vec![6, 2]), Err(3), "step 2 is decided");
        s.change(5, vec![6, 2]).expect("step 5 is not decided");
        assert!(s.decided(5).is_none());
        // a waiting reader gets the step once it is decided
        let s2 = s.clone();
        let reader = std::thread::spawn(move || s2.sizes_at(6));
        s.extend(7);
        assert_eq!(reader.join().expect("reader").as_deref(), Some(&[6usize, 2][..]));
        assert_eq!(s.decided(4).as_deref(), Some(&[4usize, 4][..]));
        // closing ends a wait on an undecided step
        let s3 = s.clone();
        let waiting = std::thread::spawn(move || s3.sizes_at(100));
        std::thread::sleep(std::time::Duration::from_millis(20));
        s.close();
        assert!(waiting.join().expect("reader").is_none());
    }
}
