//! Training: checkpoints (`checkpoint`).

pub mod checkpoint;
