//! `vitscale plan --project OUT`: a cluster's predicted throughput over node counts (1, 2, 4 …
//! up to the cluster's) and micro-batch sizes, weak scaling (each rank keeps its micro-batch),
//! written as `OUT/projection.md`, `OUT/projection.json` and a chart
//! (`OUT/charts/projection.png|svg`): the study's multi-node experiment on other hardware.

use std::path::Path;

use serde::Serialize;

use super::cluster::Cluster;
use super::model::{self, Network};
use super::profile::Profile;
use crate::lab::analysis::Series;
use crate::lab::charts::{Chart, Panel, PanelKind};

/// One predicted configuration.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub nodes: usize,
    pub ranks: usize,
    pub micro: usize,
    pub images_per_s: f64,
    pub images_per_s_per_rank: f64,
    pub efficiency: f64,
    pub step_ms: f64,
    pub comm_exposed_ms: f64,
    pub comm_share: f64,
}

/// What the projection wrote.
#[derive(Clone, Debug, Serialize)]
pub struct Projection {
    pub cluster: String,
    pub source: String,
    pub profile: String,
    pub rows: Vec<Row>,
    /// The inputs the projection trusts least, most doubtful first.
    pub least_trusted: Vec<String>,
    pub files: Vec<String>,
}

/// 1, 2, 4 … up to `max` (and `max` itself).
pub fn node_counts(max: usize) -> Vec<usize> {
    let mut v: Vec<usize> = std::iter::successors(Some(1usize), |n| n.checked_mul(2)).take_while(|n| *n <= max).collect();
    if v.last() != Some(&max) {
        v.push(max);
    }
    v
}

/// Predicts `cluster` at each node count and micro size (GAS 1, the engine's defaults
/// otherwise) and writes the table, JSON and chart under `out`.
pub fn project(profile: &Profile, profile_source: &str, cluster: &Cluster, micros: &[usize], out: &Path) -> Result<Projection, String> {
    let groups = super::groups(profile);
    let mut rows = Vec::new();
    for &nodes in &node_counts(cluster.nodes) {
        let net = Network { nodes, ..super::network(cluster) };
        for &micro in micros {
            let mut s = model::Scenario::new(micro, 1);
            s.ranks_per_device = cluster.ranks_per_device;
            s.compute_scale = cluster.compute_scale;
            s.loader = cluster.loader_images_per_s_per_core.map(|r| (r, cluster.loader_cores_per_rank));
            let p = model::predict(profile, &groups, &s, &net)?;
            let eff = model::efficiency(profile, &groups, &s, &p)?;
            rows.push(Row {
                nodes,
                ranks: p.world,
                micro,
                images_per_s: p.images_per_s,
                images_per_s_per_rank: p.images_per_s_per_rank,
                efficiency: eff,
                step_ms: p.step_s * 1e3,
                comm_exposed_ms: p.comm_exposed_s * 1e3,
                comm_share: p.comm_exposed_s / p.step_s,
            });
        }
    }
    let mut least = Vec::new();
    if cluster.compute_scale != 1.0 {
        least.push(format!("compute_scale {} ({}): the profile was measured on {}, not on this cluster's devices", cluster.compute_scale, cluster.compute_scale_source.as_deref().unwrap_or("no source given"), profile.device));
    }
    if cluster.nodes > 1 {
        least.push(format!("the inter-node level ({}): figures from the cluster file, not measured here; the hierarchical ring assumes the node's NICs are shared evenly by its ranks", cluster.inter.as_ref().map_or("?", |l| l.link.as_str())));
    }
    least.push(format!("the intra-node level ({}): the busbw of large messages from the cluster file; small buckets pay latency the file's single α may understate", cluster.intra.as_ref().map_or("none", |l| l.link.as_str())));
    if cluster.loader_images_per_s_per_core.is_none() {
        least.push("data loading: not modelled (no loader rate), so a loader-bound configuration is predicted too fast".into());
    }
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let chart_dir = out.join("charts");
    let by_micro = |f: fn(&Row) -> f64| -> Vec<Series> {
        micros.iter().map(|&m| Series { name: format!("micro {m}"), points: rows.iter().filter(|r| r.micro == m).map(|r| (r.nodes as f64, f(r))).collect() }).collect()
    };
    let chart = Chart {
        file: "projection".into(),
        title: format!("Predicted: {} ({} per node)", cluster.name, cluster.ranks_per_node()),
        panels: vec![
            Panel { title: "throughput".into(), x_label: "nodes".into(), y_label: "predicted images/s (all ranks, log scale)".into(), kind: PanelKind::Lines { series: by_micro(|r| r.images_per_s), log2_x: true, ideal: None, y_percent: false, y_from_zero: true, log10_y: true } },
            Panel { title: "efficiency".into(), x_label: "nodes".into(), y_label: "predicted efficiency (% of ranks × one rank)".into(), kind: PanelKind::Lines { series: by_micro(|r| r.efficiency), log2_x: true, ideal: Some(("ideal (100 %)".into(), 0.0)), y_percent: true, y_from_zero: true, log10_y: false } },
        ],
    };
    let (png, svg) = chart.save(&chart_dir)?;
    let mut md = format!("# Projection: {}\n\n{}\n\nProfile: {profile_source} ({} on {}). Cluster source: {}.\n\n", cluster.name, "Predicted by `vitscale plan --project` (weak scaling: each rank keeps its micro-batch, GAS 1, fp32 gradients, ZeRO 0, the default buckets).", profile.model, profile.device, cluster.source.trim_end().trim_end_matches('.'));
    md.push_str("| nodes | ranks | micro | images/s | per rank | efficiency | step ms | exposed comm ms | comm share |\n|---|---|---|---|---|---|---|---|---|\n");
    for r in &rows {
        let n = crate::lab::charts::thousands;
        md.push_str(&format!("| {} | {} | {} | {} | {} | {:.1} % | {:.2} | {:.2} | {:.1} % |\n", r.nodes, r.ranks, r.micro, n(r.images_per_s), n(r.images_per_s_per_rank), r.efficiency * 100.0, r.step_ms, r.comm_exposed_ms, r.comm_share * 100.0));
    }
    md.push_str("\n![projection](charts/projection.png)\n\nInputs trusted least:\n\n");
    for l in &least {
        md.push_str(&format!("- {l}\n"));
    }
    let mdp = out.join("projection.md");
    std::fs::write(&mdp, md).map_err(|e| format!("{}: {e}", mdp.display()))?;
    let mut p = Projection { cluster: cluster.name.clone(), source: cluster.source.clone(), profile: profile_source.to_string(), rows, least_trusted: least, files: Vec::new() };
    p.files = vec![mdp.display().to_string(), out.join("projection.json").display().to_string(), png.display().to_string(), svg.display().to_string()];
    let jp = out.join("projection.json");
    std::fs::write(&jp, serde_json::to_string_pretty(&p).map_err(|e| e.to_string())?).map_err(|e| format!("{}: {e}", jp.display()))?;
    Ok(p)
}
