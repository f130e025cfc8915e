//! Training: the step and loop (`engine`), learning-rate schedules (`schedule`), checkpoints
//! (`checkpoint`), graceful stop on SIGINT/SIGTERM (`stop`).

pub mod checkpoint;
pub mod engine;
pub mod schedule;
pub mod stop;
