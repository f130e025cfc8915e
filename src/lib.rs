//! vitscale: train Vision Transformers on CPU and GPUs, and measure how training scales.
//!
//! Module map:
//! - `config`  — defines: the run configuration (DeepSpeed JSON + model/data/train), parsing and validation.
//! - `model`   — defines: the ViT shape, parameter table, forward/backward over a backend, timm weights I/O.
//! - `backend` — defines: the `Backend` trait (every op with explicit shapes) and the CPU reference backend.
//! - `comm`    — defines: the `Comm` trait (collectives on flat buffers), the TCP ring for CPU ranks, rendezvous, `DistEnv`.
//! - `train`   — defines: checkpoints (save atomically, verify on load).
//! - `launch`  — defines: `vitscale launch`, spawning workers locally or over ssh from a hostfile.

pub mod backend;
pub mod comm;
pub mod config;
pub mod launch;
pub mod model;
pub mod train;
