//! vitscale: train Vision Transformers on CPU and GPUs, and measure how training scales.
//!
//! Module map:
//! - `config`  — defines: the run configuration (DeepSpeed JSON + model/data/train), parsing and validation.
//! - `model`   — defines: the ViT shape, parameter table, forward/backward over a backend, timm weights I/O.
//! - `backend` — defines: the `Backend` trait (every op with explicit shapes) and the CPU reference backend.
//! - `data`    — defines: datasets (built-in, synthetic, CIFAR), the global-batch sampler and rank sharding, augmentation, batches.

pub mod backend;
pub mod config;
pub mod data;
pub mod model;
