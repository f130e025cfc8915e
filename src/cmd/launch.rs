//! `vitscale launch`: the command, whose exit code is the workers' (the flags, `LaunchArgs`,
//! and the supervision are `crate::launch`'s).

pub use crate::launch::LaunchArgs;

/// `vitscale launch`: the exit code the workers ended with (the failing rank's status, 128 +
/// signal); a launcher error keeps its own (`cmd::exit_code`).
pub fn run(args: LaunchArgs) -> anyhow::Result<i32> {
    Ok(crate::launch::run(args)?)
}
