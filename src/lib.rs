//! vitscale: train Vision Transformers on CPU and GPUs, and measure how training scales.
//!
//! Module map:
//! - `core`    — defines: the shared vocabulary below backend, model and config (spans, optimizer hyper-parameters, decay groups, parameter kinds, numerical constants).
//! - `config`  — defines: the run configuration (DeepSpeed JSON + model/data/train), parsing and validation.
//! - `model`   — defines: the ViT shape, parameter table, init, forward/backward over a backend, timm weights I/O.
//! - `backend` — defines: the `Backend` trait (every op with explicit shapes), the CPU reference backend, the CUDA backend (host code by layer, NVRTC kernels, the NCCL communicator).
//! - `data`    — defines: datasets (built-in, synthetic, CIFAR), augmentation, sampling into global batches and their split over ranks.
//! - `train`   — defines: the one training step, the batch plan, gradient buckets reduced during the backward, ZeRO-1/2 sharding, the loop, the memory estimate checked before allocating, the run directory, schedules, checkpoints, the ranks' agreement check, mixed-speed balancing and straggler emulation.
//! - `comm`    — defines: the `Comm` trait (collectives on flat buffers), the TCP ring for CPU ranks, rendezvous, `DistEnv`.
//! - `launch`  — defines: the launcher behind `vitscale launch`, spawning workers locally or over ssh from a hostfile, supervising them.
//! - `metrics` — defines: phase timers, the `metrics.jsonl` records, the per-rank Chrome trace.
//! - `lab`     — defines: the scaling lab: sweep specs, `vitscale sweep` (points as subprocesses, `sweep.jsonl`, resume), `vitscale report` (tables, charts, findings checked against the data), `bench --comm`.
//! - `plan`    — defines: the planner behind `vitscale plan`: the compute profile format, cluster files, comm fits, the step-time and memory model, validation against sweeps, recommendations, projections.
//! - `cmd`     — defines: the subcommands behind `vitscale` (one file each: its arguments and `run`), the config and device loading they share, exit codes.
//! - `util`    — defines: atomic file writes, scoped signal handlers.
//! - `selftest` — defines: the parity checks behind `vitscale selftest`, every backend op and a short training run against the CPU reference.
//! - `bench`   — defines: the benchmark behind `vitscale bench`, training-step throughput, MFU and peak memory on synthetic device-resident data.

pub mod backend;
pub mod cmd;
pub mod comm;
pub mod config;
pub mod core;
pub mod data;
pub mod lab;
pub mod launch;
pub mod metrics;
pub mod model;
pub mod plan;
pub mod train;
pub mod util;
pub mod selftest;
pub mod bench;
