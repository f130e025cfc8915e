//! The scaling lab: `vitscale sweep` runs a grid of training points (each a subprocess of this
//! binary, in its own run directory) and `vitscale report` turns the sweep's directory into
//! tables, charts and the study's findings checked against the data. Both read run
//! directories only (`config.json`, `metrics.jsonl`, `summary.json`), never the engine.
//!
//! - `spec`       — the sweep spec format (base config, fixed overrides, grid, run length).
//! - `sweep`      — runs the points, records `sweep.jsonl`, resumes.
//! - `summary`    — a point's figures from its run directory.
//! - `analysis`   — series, scaling and findings computed from the points.
//! - `charts`     — the report's charts (plotters, PNG and SVG, a font bundled in the binary).
//! - `report`     — `report.md` and a self-contained `report.html`.

pub mod analysis;
pub mod charts;
pub mod report;
pub mod spec;
pub mod summary;
pub mod sweep;
