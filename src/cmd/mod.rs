//! The subcommands behind `src/main.rs`, one file each: its clap arguments and its `run`.
//!
//! - `train`    — `vitscale train`: train a ViT (one process, or one rank of a launched job).
//! - `eval`     — `vitscale eval`: loss and top-1 of a weights file on a dataset split.
//! - `data`     — `vitscale data pack`: an image folder as tar shards (`crate::data::shards`).
//! - `launch`   — `vitscale launch`: the launcher's flags; the supervision is `crate::launch`.
//! - `bench`    — `vitscale bench`: report a training-step (`crate::bench`) or loader benchmark.
//! - `selftest` — `vitscale selftest`: run and report the parity checks of `crate::selftest`.
//! - `sweep`    — `vitscale sweep`: run a sweep spec's points (`crate::lab::sweep`).
//! - `report`   — `vitscale report`: the report of a sweep directory (`crate::lab::report`).
//! - `plan`     — `vitscale plan`: predictions and their validation (`crate::plan`).
//! - `common`   — what they share: `ConfigArgs`, `load_config`, `open_device`, `config_hash`.
//!
//! Every failure comes back as an error naming its source, never a panic; `exit_code` and
//! `error_message` say how `main` ends with it.

pub mod bench;
pub mod common;
pub mod data;
pub mod eval;
pub mod launch;
pub mod plan;
pub mod report;
pub mod selftest;
pub mod sweep;
pub mod train;

use crate::launch::LaunchError;
use crate::train::error::TrainError;

/// The exit status for a command's error: 128 + signal when training or a sweep stopped for
/// SIGINT/SIGTERM (130 / 143); the launcher's own (a failed worker's status, 128 + signal);
/// else 1.
pub fn exit_code(e: &anyhow::Error) -> i32 {
    if let Some(e) = e.downcast_ref::<LaunchError>() {
        return e.exit_code();
    }
    if let Some(e) = e.downcast_ref::<crate::lab::sweep::SweepError>() {
        return e.exit_code();
    }
    e.downcast_ref::<TrainError>().map_or(1, TrainError::exit_code)
}

/// The message `main` prints for a command's error: the error and its causes, except for the
/// launcher's errors, whose message already names their cause.
pub fn error_message(e: &anyhow::Error) -> String {
    if e.downcast_ref::<LaunchError>().is_some() {
        return format!("{e}");
    }
    // Each cause once: an error whose text already includes its source's (thiserror's
    // `{source}` in the message) would otherwise print it twice.
    let mut msg = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if msg.contains(&text) {
            continue;
        }
        if !msg.is_empty() {
            msg.push_str(": ");
        }
        msg.push_str(&text);
    }
    msg
}
