//! `TrainError`: every way a training run can fail, below the loop so that the step, the sync,
//! the balance and the run directory can return it without importing the loop. It wraps the
//! errors of the modules below it (checkpoints, the ranks' agreement), which never import it.

use std::path::PathBuf;

use crate::train::{agree, checkpoint, stop};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    #[error(transparent)]
    Weights(#[from] crate::model::weights::WeightsError),
    #[error("run directory {path}: {source}")]
    RunDir { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Config(String),
    #[error("training diverged at step {step}: loss is {loss}")]
    Diverged { step: u64, loss: f64 },
    // collectives and checkpoints
    #[error(transparent)]
    Comm(#[from] crate::comm::CommError),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    /// The ranks' weights or optimizer state differ, or could not be compared (`train::agree`).
    #[error(transparent)]
    Agree(#[from] agree::AgreeError),
    /// SIGINT / SIGTERM acted on at a step boundary (see `train::stop`).
    #[error("stopped by {} after step {step}: {detail}", stop::signal_name(*signal))]
    Interrupted { signal: i32, step: u64, detail: String },
}

impl TrainError {
    /// The process exit status this error calls for: 128 + signal for a graceful stop (130
    /// SIGINT, 143 SIGTERM, as shells report them), else 1.
    pub fn exit_code(&self) -> i32 {
        match self {
            TrainError::Interrupted { signal, .. } => 128 + signal,
            _ => 1,
        }
    }
}
