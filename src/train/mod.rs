//! Training: the step and loop (`engine`), learning-rate schedules (`schedule`).

pub mod engine;
pub mod schedule;
