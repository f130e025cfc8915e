//! GPU clock and power telemetry through NVML (`libnvidia-ml.so.1`, loaded at run time by
//! `nvml-wrapper`): a background sampler that `vitscale bench` runs around its timed steps and
//! around the GEMM ceiling, so a throughput figure comes with the SM clock it ran at and whether
//! the board's power limit was holding the clock down.
//!
//! Why: on an H200 a ViT-B/16 training step sits at the 700 W limit (NVML's "SW power cap"
//! throttle reason) at 1.44–1.58 GHz, so kernel time saved reaches the step only in part, and
//! a short ceiling GEMM may run at a clock the step never sees. Telemetry is best effort: without
//! NVML (no driver library, a container without it) the sampler reports nothing and the bench
//! runs as before.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::enum_wrappers::device::Clock;
use nvml_wrapper::Nvml;

/// What the sampler saw over one measured stretch.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PowerSummary {
    pub samples: usize,
    /// Mean, lowest and highest SM clock (MHz).
    pub sm_mhz_mean: f64,
    pub sm_mhz_min: u32,
    pub sm_mhz_max: u32,
    /// Mean board power as NVML reports it (W; on recent GPUs an average over about a second).
    pub power_w_mean: f64,
    /// The enforced power limit (W).
    pub power_limit_w: f64,
    /// Share of the samples in which the power limit ("SW power cap") was throttling the clock.
    pub power_capped: f64,
}

struct Sample {
    sm_mhz: u32,
    power_mw: u32,
    capped: bool,
}

/// A background thread reading the GPU's clock, power and throttle reasons every `period`.
pub struct PowerSampler {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<Option<(Vec<Sample>, u32)>>,
}

impl PowerSampler {
    /// Starts sampling the GPU at `pci_bus_id` (`domain:bus:device.function`, hex). Returns
    /// None where NVML cannot be loaded or does not know the device.
    pub fn start(pci_bus_id: &str, period: Duration) -> Option<PowerSampler> {
        let nvml = Nvml::init().ok()?;
        // fail here, not in the thread, when the device is unknown
        nvml.device_by_pci_bus_id(pci_bus_id).ok()?;
        let (stop, bus) = (Arc::new(AtomicBool::new(false)), pci_bus_id.to_string());
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let dev = nvml.device_by_pci_bus_id(bus.as_str()).ok()?;
            let limit_mw = dev.enforced_power_limit().unwrap_or(0);
            let mut samples = Vec::new();
            loop {
                // (read before checking the flag: a stretch shorter than a period still
                // yields one sample)
                if let (Ok(sm_mhz), Ok(power_mw)) = (dev.clock_info(Clock::SM), dev.power_usage()) {
                    let capped = dev.current_throttle_reasons().map(|r| r.contains(ThrottleReasons::SW_POWER_CAP)).unwrap_or(false);
                    samples.push(Sample { sm_mhz, power_mw, capped });
                }
                if flag.load(Ordering::Relaxed) {
                    break;
                }
                std::thread::sleep(period);
            }
            Some((samples, limit_mw))
        });
        Some(PowerSampler { stop, handle })
    }

    /// Stops the thread and summarizes its samples (None if it got none).
    pub fn finish(self) -> Option<PowerSummary> {
        self.stop.store(true, Ordering::Relaxed);
        let (samples, limit_mw) = self.handle.join().ok()??;
        summarize(&samples, limit_mw)
    }
}

fn summarize(samples: &[Sample], limit_mw: u32) -> Option<PowerSummary> {
    if samples.is_empty() {
        return None;
    }
    let n = samples.len() as f64;
    Some(PowerSummary {
        samples: samples.len(),
        sm_mhz_mean: samples.iter().map(|s| s.sm_mhz as f64).sum::<f64>() / n,
        sm_mhz_min: samples.iter().map(|s| s.sm_mhz).min().unwrap_or(0),
        sm_mhz_max: samples.iter().map(|s| s.sm_mhz).max().unwrap_or(0),
        power_w_mean: samples.iter().map(|s| s.power_mw as f64).sum::<f64>() / n / 1e3,
        power_limit_w: limit_mw as f64 / 1e3,
        power_capped: samples.iter().filter(|s| s.capped).count() as f64 / n,
    })
}

impl std::fmt::Display for PowerSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SM {:.0} MHz ({}–{}), {:.0} W of {:.0} W, power-capped in {:.0} % of {} samples",
            self.sm_mhz_mean,
            self.sm_mhz_min,
            self.sm_mhz_max,
            self.power_w_mean,
            self.power_limit_w,
            100.0 * self.power_capped,
            self.samples
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_of_samples() {
        let s = [
            Sample { sm_mhz: 1500, power_mw: 690_000, capped: true },
            Sample { sm_mhz: 1980, power_mw: 300_000, capped: false },
            Sample { sm_mhz: 1440, power_mw: 700_000, capped: true },
            Sample { sm_mhz: 1560, power_mw: 698_000, capped: true },
        ];
        let p = summarize(&s, 700_000).unwrap();
        assert_eq!(p.samples, 4);
        assert_eq!((p.sm_mhz_min, p.sm_mhz_max), (1440, 1980));
        assert!((p.sm_mhz_mean - 1620.0).abs() < 1e-9);
        assert!((p.power_w_mean - 597.0).abs() < 1e-9);
        assert!((p.power_capped - 0.75).abs() < 1e-12);
        assert_eq!(p.power_limit_w, 700.0);
        assert!(summarize(&[], 700_000).is_none());
    }

    #[test]
    fn unknown_device_or_no_nvml_gives_none() {
        // On a machine without NVML the library fails to load; with NVML this bus id names
        // no GPU. Either way: no sampler, no panic.
        assert!(PowerSampler::start("ffff:ff:1f.7", Duration::from_millis(5)).is_none());
    }
}
