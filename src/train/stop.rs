//! Graceful stop on SIGINT / SIGTERM: the handler only records the signal in an atomic; the
//! engine reads it at each optimizer-step boundary ([`pending`]), the ranks agree on it (the
//! flag travels with the step's loss all-reduce, so every rank stops after the same step),
//! rank 0 checkpoints that step, and every rank exits with 128 + signal (130 for SIGINT, 143
//! for SIGTERM), as shells expect.
//!
//! A second signal while the first is being acted on ends the process at once (the handler
//! restores the default action and re-raises), so an impatient second Ctrl-C still works.
//! Only `vitscale train` installs the handler ([`StopGuard::install`]); library callers that
//! do not install it never see a pending stop.

use std::sync::atomic::{AtomicI32, Ordering};

/// The first signal received and not yet acted on (0 = none).
static PENDING: AtomicI32 = AtomicI32::new(0);

const CAUGHT: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

extern "C" fn on_signal(sig: libc::c_int) {
    if PENDING.swap(sig, Ordering::SeqCst) != 0 {
        // SAFETY: signal(2) and raise(3) are async-signal-safe; the default action of SIGINT
        // and SIGTERM ends the process.
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
    }
}

/// The signal waiting to be acted on, or 0.
pub fn pending() -> i32 {
    PENDING.load(Ordering::SeqCst)
}

/// Signal name for messages.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// Encodes this rank's pending signal as two summable flags (SIGINT, SIGTERM) for the
/// step's host all-reduce.
pub fn flags(sig: i32) -> [f64; 2] {
    [f64::from(u8::from(sig == libc::SIGINT)), f64::from(u8::from(sig == libc::SIGTERM))]
}

/// The signal this rank stops for after the all-reduce of [`flags`]: its own if it got one,
/// else SIGTERM if any rank got SIGTERM, else SIGINT if any got SIGINT, else 0 (go on).
pub fn agreed(own: i32, summed: [f64; 2]) -> i32 {
    if own != 0 {
        own
    } else if summed[1] > 0.0 {
        libc::SIGTERM
    } else if summed[0] > 0.0 {
        libc::SIGINT
    } else {
        0
    }
}

/// Catches SIGINT / SIGTERM while alive; restores the previous actions on drop. A signal
/// that arrives after the last step (during the final evaluation) is not acted on: the run
/// is complete by then.
pub struct StopGuard {
    _handlers: crate::util::SignalHandlers,
}

impl StopGuard {
    /// Installs the handler; a signal left over from an earlier run in this process is
    /// forgotten.
    pub fn install() -> Self {
        PENDING.store(0, Ordering::SeqCst);
        StopGuard { _handlers: crate::util::SignalHandlers::install(&CAUGHT, on_signal) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_agree_on_one_signal() {
        assert_eq!(agreed(0, [0.0, 0.0]), 0);
        assert_eq!(agreed(0, [1.0, 0.0]), libc::SIGINT);
        assert_eq!(agreed(0, [1.0, 1.0]), libc::SIGTERM);
        assert_eq!(agreed(libc::SIGINT, [1.0, 1.0]), libc::SIGINT);
        assert_eq!(flags(libc::SIGTERM), [0.0, 1.0]);
    }
}
