//! Training: the step and loop (`engine`), learning-rate schedules (`schedule`), checkpoints
//! (`checkpoint`), graceful stop on SIGINT/SIGTERM (`stop`), the check that every rank holds
//! the same state (`agree`).

pub mod agree;
pub mod checkpoint;
pub mod engine;
pub mod schedule;
pub mod stop;
