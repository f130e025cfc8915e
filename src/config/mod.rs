//! Run configuration: a DeepSpeed JSON (every DeepSpeed key keeps its meaning) plus the
//! `model`, `data` and `train` sections, `--set key.path=JSON` overrides, and the validated
//! typed result.

mod parse;
mod types;

pub use parse::*;
pub use types::*;
