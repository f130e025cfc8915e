//! A training run's directory, everything the loop writes to disk: `config.json` (the resolved
//! configuration in the input language, every value explicit, with the batch plan as its
//! `"plan"` section: `vitscale train --config <dir>/config.json` runs the same run again),
//! `classes.json`, `metrics.jsonl`, `checkpoints/` and `summary.json`. Small files are
//! written atomically; the metrics are appended line by line.
//!
//! A directory that already holds a run is never written over by a new one: only a resumed
//! run reopens it (and appends to its metrics), so metrics and checkpoints of two runs never
//! mix.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::config::RunConfig;
use crate::metrics::JsonlWriter;
use crate::model::ParamTable;
use crate::train::checkpoint;
use crate::train::error::TrainError;
use crate::train::plan::Plan;

pub struct RunDir {
    pub path: PathBuf,
    metrics_path: PathBuf,
    metrics: JsonlWriter,
    keep_checkpoints: usize,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::RunDir { path: path.to_path_buf(), source }
}

fn json_bytes<T: Serialize>(v: &T) -> Result<Vec<u8>, TrainError> {
    serde_json::to_vec_pretty(v).map_err(|e| TrainError::Config(e.to_string()))
}

/// Files whose presence means a directory already holds a run.
pub const RUN_FILES: &[&str] = &["config.json", "metrics.jsonl", "summary.json", "checkpoints"];

/// Refuses a directory that already holds a run (any of [`RUN_FILES`]): a new run would
/// overwrite its metrics and mix checkpoints. A missing or empty directory, or one with
/// other files only, is fine. The error says what to do instead.
pub fn check_fresh(path: &Path) -> Result<(), TrainError> {
    if path.exists() && !path.is_dir() {
        return Err(TrainError::Config(format!("run directory {}: exists and is not a directory", path.display())));
    }
    if let Some(found) = RUN_FILES.iter().find(|f| path.join(f).exists()) {
        return Err(TrainError::Config(format!(
            "run directory {} already holds a run ({found}); continue it with --resume latest --run-dir {}, or choose another --run-dir (or remove the old one)",
            path.display(),
            path.display()
        )));
    }
    Ok(())
}

impl RunDir {
    /// Creates (or, resuming, reopens) the directory and writes `config.json`: the resolved
    /// configuration with the plan as its `"plan"` section. A resumed run appends to
    /// `metrics.jsonl`, so the history before the interruption stays.
    pub fn open(path: &Path, cfg: &RunConfig, plan: &Plan, resuming: bool, keep_checkpoints: usize) -> Result<RunDir, TrainError> {
        if !resuming {
            check_fresh(path)?;
        }
        std::fs::create_dir_all(path).map_err(io_err(path))?;
        let mut resolved = crate::config::resolved_json(cfg);
        if let Some(o) = resolved.as_object_mut() {
            o.insert("plan".into(), serde_json::to_value(plan).map_err(|e| TrainError::Config(e.to_string()))?);
        }
        crate::util::write_atomic(&path.join("config.json"), &json_bytes(&resolved)?).map_err(io_err(path))?;
        let metrics_path = path.join("metrics.jsonl");
        let metrics = if resuming { JsonlWriter::append(&metrics_path) } else { JsonlWriter::create(&metrics_path) }.map_err(io_err(&metrics_path))?;
        Ok(RunDir { path: path.to_path_buf(), metrics_path, metrics, keep_checkpoints })
    }

    /// Adds (or replaces) section `key` of `config.json` with `value`, atomically: what the
    /// run learns once the model is built (the memory it holds).
    pub fn add_to_config<T: Serialize>(&self, key: &str, value: &T) -> Result<(), TrainError> {
        let path = self.path.join("config.json");
        let text = std::fs::read(&path).map_err(io_err(&self.path))?;
        let mut cfg: serde_json::Value = serde_json::from_slice(&text).map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))?;
        let v = serde_json::to_value(value).map_err(|e| TrainError::Config(e.to_string()))?;
        match cfg.as_object_mut() {
            Some(o) => o.insert(key.to_string(), v),
            None => return Err(TrainError::Config(format!("{}: not a JSON object", path.display()))),
        };
        crate::util::write_atomic(&path, &json_bytes(&cfg)?).map_err(io_err(&self.path))
    }

    /// `classes.json`: class index → name, so predictions and exported weights can be read later.
    pub fn write_classes(&self, names: &[String]) -> Result<(), TrainError> {
        crate::util::write_atomic(&self.path.join("classes.json"), &json_bytes(&names)?).map_err(io_err(&self.path))
    }

    /// One line of `metrics.jsonl`.
    pub fn log<T: Serialize>(&mut self, record: &T) -> Result<(), TrainError> {
        self.metrics.write(record).map_err(io_err(&self.metrics_path))
    }

    pub fn checkpoint_root(&self) -> PathBuf {
        self.path.join("checkpoints")
    }

    /// A training checkpoint of step `step` under `checkpoints/` (atomic; older ones pruned to
    /// `keep_checkpoints`); returns its directory.
    #[allow(clippy::too_many_arguments)]
    pub fn checkpoint(&self, step: u64, table: &ParamTable, params: &[f32], cfg: &RunConfig, opt_state: &[f32], ema: Option<&[f32]>, state: &serde_json::Value) -> Result<PathBuf, TrainError> {
        Ok(checkpoint::save_training(&self.checkpoint_root(), step, table, &cfg.model, params, &cfg.optimizer, opt_state, ema, state, self.keep_checkpoints)?)
    }

    /// `summary.json`: the `--json` object.
    pub fn write_summary<T: Serialize>(&self, summary: &T) -> Result<(), TrainError> {
        crate::util::write_atomic(&self.path.join("summary.json"), &json_bytes(summary)?).map_err(io_err(&self.path))
    }
}
