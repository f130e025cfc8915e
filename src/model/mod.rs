//! The timm Vision Transformer: its shape (`spec`), its parameter table (`params`), random
//! initialization (`init`), its forward and manual backward over any `Backend` (`vit`),
//! timm-compatible weights (`weights`), also in torchvision's layout (`torchvision`), timm's
//! position-embedding resampling (`resample`), and sequence parallelism's token split and
//! exchanges (`seq_parallel`).

pub mod drop_path;
pub mod init;
pub mod params;
pub mod partition;
pub mod resample;
pub mod seq_parallel;
pub mod spec;
pub mod torchvision;
pub mod vit;
pub mod weights;

pub use params::{ParamEntry, ParamKind, ParamTable};
pub use spec::{GlobalPool, ModelConfig, LN_EPS};
pub use vit::{checkpoint_keeps_attention, smoothed_targets, ForwardOut, Recompute, Vit};
