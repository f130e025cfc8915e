//! Training: the loop (`engine`), the one step it, `bench` and `selftest` run (`step`), the
//! batch plan resolved before training (`plan`), gradient buckets reduced during the backward
//! (`sync`), ZeRO stages 1/2 over the same buckets (`zero`), the run directory's files (`run_dir`),
//! the memory estimate checked before allocating (`memory`),
//! learning-rate schedules (`schedule`), checkpoints (`checkpoint`), graceful stop on
//! SIGINT/SIGTERM (`stop`), the check that every rank holds the same state (`agree`), mixed-speed
//! ranks: straggler emulation and speed-proportional splits (`balance`).

pub mod agree;
pub mod balance;
pub mod checkpoint;
pub mod engine;
pub mod memory;
pub mod plan;
pub mod run_dir;
pub mod schedule;
pub mod step;
pub mod stop;
pub mod sync;
pub mod zero;
