//! Training: the loop as an object (`trainer`), the one step it, `bench` and `selftest` run
//! (`step`), the run's plan derived once before training (`plan`: batch split, passes, ZeRO
//! layout, memory), the split arithmetic (`shares`), gradient buckets reduced during the backward
//! (`sync`), ZeRO stages 1/2 over the same buckets (`zero`), the memory model (`memory`),
//! evaluation and the initial model (`evaluate`), the run directory's files (`run_dir`),
//! learning-rate schedules (`schedule`), checkpoints (`checkpoint`), graceful stop on
//! SIGINT/SIGTERM (`stop`), the check that every rank holds the same state (`agree`),
//! mixed-speed ranks (`balance`), and the errors of all of them (`error`).

pub mod agree;
pub mod balance;
pub mod checkpoint;
pub mod ema;
pub mod error;
pub mod evaluate;
pub mod loss_scale;
pub mod memory;
pub mod plan;
pub mod run_dir;
pub mod schedule;
pub mod shares;
pub mod step;
pub mod stop;
pub mod sync;
pub mod timeline;
pub mod trainer;
pub mod zero;
