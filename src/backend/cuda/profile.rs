//! Per-launch profiling: while on (`set_profiling`), every kernel and GEMM launch is bracketed
//! by events (`timed`), and a step's launches are read back in queue order or summed by name
//! (`vitscale bench --profile`).

use std::collections::HashMap;

use super::device::dev;
use super::Cuda;
use crate::backend::{BResult, Backend};

/// One launch of a profiled step (`Cuda::take_profile_timeline`).
#[derive(Clone, Debug)]
pub struct ProfiledLaunch {
    pub name: String,
    pub ms: f64,
    /// From the end of the previous profiled launch to the start of this one.
    pub gap_before_ms: f64,
}

/// A profiled step's launches summed by name: (name, total ms, launches), largest first.
pub fn profile_by_name(timeline: &[ProfiledLaunch]) -> Vec<(String, f64, usize)> {
    let mut sum: HashMap<&str, (f64, usize)> = HashMap::new();
    for l in timeline {
        let e = sum.entry(&l.name).or_insert((0.0, 0));
        e.0 += l.ms;
        e.1 += 1;
    }
    let mut v: Vec<(String, f64, usize)> = sum.into_iter().map(|(k, (t, n))| (k.to_string(), t, n)).collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

impl Cuda {
    /// Turns per-launch timing on or off (benchmark diagnostics; never while capturing).
    pub fn set_profiling(&self, on: bool) {
        if let Ok(mut p) = self.profile.lock() {
            *p = if on { Some(Vec::new()) } else { None };
        }
    }

    /// Per-launch times recorded since `set_profiling(true)`, summed by name:
    /// (name, total ms, launches), largest first. Synchronizes.
    pub fn take_profile(&self) -> BResult<Vec<(String, f64, usize)>> {
        Ok(profile_by_name(&self.take_profile_timeline()?))
    }

    /// The launches recorded since `set_profiling(true)` in queue order, each with its time and
    /// the time since the previous launch ended (what the GPU spent between the two: memsets,
    /// copies, or the launch itself). Synchronizes.
    pub fn take_profile_timeline(&self) -> BResult<Vec<ProfiledLaunch>> {
        self.synchronize()?;
        let recs = match self.profile.lock() {
            Ok(mut p) => p.as_mut().map(std::mem::take).unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        let mut out = Vec::with_capacity(recs.len());
        let mut prev_end: Option<&cudarc::driver::CudaEvent> = None;
        for (name, e0, e1) in &recs {
            let ms = e0.elapsed_ms(e1).map_err(dev("cuEventElapsedTime"))? as f64;
            let gap_before_ms = match prev_end {
                Some(p) => p.elapsed_ms(e0).map_err(dev("cuEventElapsedTime"))? as f64,
                None => 0.0,
            };
            out.push(ProfiledLaunch { name: name.clone(), ms, gap_before_ms });
            prev_end = Some(e1);
        }
        Ok(out)
    }

    /// Runs `f` between two timing events when profiling is on.
    pub(super) fn timed(&self, name: &str, f: impl FnOnce() -> BResult<()>) -> BResult<()> {
        let on = self.profile.lock().map(|p| p.is_some()).unwrap_or(false);
        if !on {
            return f();
        }
        let ev = || self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(dev("cuEventCreate"));
        let (e0, e1) = (ev()?, ev()?);
        e0.record(&self.stream).map_err(dev("cuEventRecord"))?;
        f()?;
        e1.record(&self.stream).map_err(dev("cuEventRecord"))?;
        if let Ok(mut p) = self.profile.lock() {
            if let Some(v) = p.as_mut() {
                v.push((name.to_string(), e0, e1));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_sums_by_name_largest_first() {
        let l = |name: &str, ms: f64| ProfiledLaunch { name: name.into(), ms, gap_before_ms: 0.0 };
        let timeline = [l("ln", 0.5), l("gemm", 2.0), l("ln", 0.75), l("adam", 1.0)];
        let got = profile_by_name(&timeline);
        assert_eq!(got, vec![("gemm".to_string(), 2.0, 1), ("ln".to_string(), 1.25, 2), ("adam".to_string(), 1.0, 1)]);
        assert!(profile_by_name(&[]).is_empty());
    }
}
