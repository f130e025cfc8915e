//! vitscale: train Vision Transformers on CPU and GPUs, and measure how training scales.
//!
//! Module map:
//! - `core`    — defines: the shared vocabulary below backend, model and config (spans, optimizer hyper-parameters, decay groups, parameter kinds, numerical constants).
//! - `config`  — defines: the run configuration (DeepSpeed JSON + model/data/train), parsing and validation.
//! - `model`   — defines: the ViT shape, parameter table, init, forward/backward over a backend, sequence parallelism's token split and all-to-all exchanges, timm weights I/O.
//! - `backend` — defines: the `Backend` trait (every op with explicit shapes), the CPU reference backend, the CUDA backend (host code by layer, NVRTC kernels, the NCCL communicator).
//! - `data`    — defines: datasets (built-in, synthetic, CIFAR), augmentation, sampling into global batches and their split over ranks.
//! - `train`   — defines: the Trainer (the loop as an object), the one training step, the run's Plan (batch split, passes, ZeRO layout, the one memory estimate), gradient buckets reduced during the backward, ZeRO-1/2 sharding, evaluation, the run directory, schedules, checkpoints, the ranks' agreement check, mixed-speed balancing and straggler emulation.
//! - `comm`    — defines: the `Comm` trait (collectives on flat buffers, all-to-all, groups of consecutive ranks), the TCP ring for CPU ranks, rendezvous, `DistEnv` and the launcher ↔ worker variables.
//! - `launch`  — defines: the launcher behind `vitscale launch` (its flags, `LaunchArgs`), spawning workers locally or over ssh from a hostfile, supervising them.
//! - `metrics` — defines: phase timers, the `metrics.jsonl` records, the per-rank Chrome trace.
//! - `lab`     — defines: the scaling lab: sweep specs, `vitscale sweep` (points as subprocesses, `sweep.jsonl`, resume), `vitscale report` (tables, charts, findings checked against the data; other parts add sections).
//! - `plan`    — defines: the planner behind `vitscale plan`: the compute profile and comm bench formats, cluster files, comm fits, the step-time model, validation against sweeps (and its report section), recommendations, projections.
//! - `cmd`     — defines: the subcommands behind `vitscale` (one file each: its arguments and `run`), the config and device loading they share, exit codes.
//! - `util`    — defines: atomic file writes, scoped signal handlers.
//! - `selftest` — defines: the parity checks behind `vitscale selftest`, every backend op and a short training run against the CPU reference.
//! - `bench`   — defines: every benchmark behind `vitscale bench` (its flags, `BenchArgs`): training-step throughput, MFU and peak memory on synthetic device-resident data; data parallel; the planner's compute profile; the collectives (`--comm`); the data loader (`--data`).

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
