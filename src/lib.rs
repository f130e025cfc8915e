//! vitscale: train Vision Transformers on CPU and GPUs, and measure how training scales.
//!
//! Module map:
//! - `config`  — defines: the run configuration (DeepSpeed JSON + model/data/train), parsing and validation.
//! - `model`   — defines: the ViT shape, parameter table, forward/backward over a backend, timm weights I/O.
//! - `train`   — defines: learning-rate schedules (DeepSpeed's numbers).
//! - `backend` — defines: the `Backend` trait (every op with explicit shapes) and the CPU reference backend.

pub mod backend;
pub mod config;
pub mod model;
pub mod train;
