//! Training: the step and loop (`engine`), learning-rate schedules (`schedule`), checkpoints
//! (`checkpoint`).

pub mod checkpoint;
pub mod engine;
pub mod schedule;
