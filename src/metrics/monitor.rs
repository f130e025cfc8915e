//! DeepSpeed's file monitors on rank 0: `tensorboard` (an event file, `metrics::tfevents`) and
//! `csv_monitor` (one CSV per tag, DeepSpeed's layout: `<tag with / and spaces as _>.csv`,
//! header `step,<last part of the tag>`), both under `<output_path>/<job_name>/` and both
//! against the global sample count, as DeepSpeed logs them. Each logged step records the
//! loss, the learning rate, the throughput and the per-step phase times in milliseconds.

use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::config::{MonitorConfig, MonitorTarget};
use crate::metrics::tfevents::EventWriter;
use crate::metrics::StepRecord;

/// The open monitors of a run (none when no block is enabled).
pub struct Monitors {
    tb: Option<EventWriter>,
    csv: Option<(PathBuf, HashSet<String>)>,
}

fn dir_of(t: &MonitorTarget, run_dir: &Path) -> PathBuf {
    let base = if t.output_path.is_empty() { run_dir.to_path_buf() } else { PathBuf::from(&t.output_path) };
    base.join(&t.job_name)
}

/// The records of one logged step: (tag, value). Phase times are per optimizer step.
pub fn events(rec: &StepRecord, steps_in_window: u64) -> Vec<(&'static str, f64)> {
    let per = |s: f64| s * 1e3 / steps_in_window.max(1) as f64;
    let p = &rec.phases;
    vec![
        ("Train/Samples/train_loss", rec.loss),
        ("Train/Samples/lr", rec.lr),
        ("Train/Samples/images_per_s", rec.images_per_s),
        ("Train/Samples/elapsed_time_ms_forward", per(p.forward_s)),
        ("Train/Samples/elapsed_time_ms_backward", per(p.backward_s)),
        ("Train/Samples/elapsed_time_ms_backward_allreduce", per(rec.comm_total_s)),
        ("Train/Samples/elapsed_time_ms_comm_exposed", per(p.comm_s)),
        ("Train/Samples/elapsed_time_ms_data_wait", per(p.data_s)),
        ("Train/Samples/elapsed_time_ms_step", per(p.optimizer_s)),
        ("Train/Samples/elapsed_time_ms_other", per(rec.other_s)),
    ]
}

impl Monitors {
    /// Opens the enabled monitors of `cfg` (`output_path` "" = `run_dir`).
    pub fn open(cfg: &MonitorConfig, run_dir: &Path) -> std::io::Result<Monitors> {
        let tb = match &cfg.tensorboard {
            Some(t) => Some(EventWriter::create(&dir_of(t, run_dir))?),
            None => None,
        };
        let csv = match &cfg.csv_monitor {
            Some(t) => {
                let d = dir_of(t, run_dir);
                std::fs::create_dir_all(&d)?;
                Some((d, HashSet::new()))
            }
            None => None,
        };
        Ok(Monitors { tb, csv })
    }

    pub fn is_empty(&self) -> bool {
        self.tb.is_none() && self.csv.is_none()
    }

    /// Records a logged step at `samples` global samples so far.
    pub fn step(&mut self, rec: &StepRecord, steps_in_window: u64, samples: u64) -> std::io::Result<()> {
        if self.is_empty() {
            return Ok(());
        }
        let evs = events(rec, steps_in_window);
        if let Some(tb) = &mut self.tb {
            let vals: Vec<(&str, f32)> = evs.iter().map(|(t, v)| (*t, *v as f32)).collect();
            tb.scalars(samples as i64, &vals)?;
        }
        if let Some((dir, started)) = &mut self.csv {
            for (tag, v) in &evs {
                let file = tag.replace(['/', ' '], "_");
                let path = dir.join(format!("{file}.csv"));
                let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
                // a fresh header the first time this run writes the file, as DeepSpeed does
                if started.insert(file) {
                    writeln!(f, "step,{}", tag.rsplit('/').next().unwrap_or(tag))?;
                }
                writeln!(f, "{samples},{v}")?;
            }
        }
        Ok(())
    }

    /// The event file, when the TensorBoard monitor is on.
    pub fn event_file(&self) -> Option<&Path> {
        self.tb.as_ref().map(|t| t.path.as_path())
    }
}
