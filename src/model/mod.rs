//! The timm Vision Transformer: its shape (`spec`), its parameter table (`params`), its
//! forward and manual backward over any `Backend` (`vit`), and timm-compatible weights
//! (`weights`).

pub mod params;
pub mod spec;

pub use params::{ParamEntry, ParamKind, ParamTable};
pub use spec::{GlobalPool, ModelConfig, LN_EPS};
