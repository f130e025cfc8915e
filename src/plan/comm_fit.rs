//! Latency α and bandwidth β per collective, fitted from a `vitscale bench --comm --comm-out`
//! file. The ring model says a collective of S bytes over n ranks takes k_α·α + f·S/β
//! (all-reduce: k_α = 2(n−1), f = 2(n−1)/n; reduce-scatter and all-gather: n−1 and (n−1)/n),
//! so the measured times are fitted by a line t = c₀ + c₁·S, weighted by 1/t² (each size's
//! relative error counts the same, so small messages fix the latency and large ones the
//! bandwidth), and α = c₀/k_α, β = f/c₁. The measured times themselves are kept too: at the
//! bench's rank count, a message inside the measured sizes is read off them
//! (`model::Curve`), since a real link's bandwidth is not one number over sizes.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::model::{ring_factors, AlphaBeta, Curve, Level, Op};

#[derive(Clone, Debug, Deserialize)]
struct Row {
    op: String,
    bytes: u64,
    time_us: f64,
}

#[derive(Clone, Debug, Deserialize)]
struct CommFile {
    format: Option<String>,
    transport: String,
    device: String,
    world_size: usize,
    rows: Vec<Row>,
}


/// The `format` of a comm bench file (`vitscale bench --comm --comm-out`, `bench::comm`).
pub const COMM_FORMAT: &str = "vitscale-comm-bench";
/// A comm bench's fit: α and β per collective at the bench's rank count.
#[derive(Clone, Debug, Serialize)]
pub struct CommFit {
    pub source: String,
    pub transport: String,
    pub device: String,
    pub world_size: usize,
    pub all_reduce: AlphaBeta,
    pub reduce_scatter: AlphaBeta,
    pub all_gather: AlphaBeta,
    /// Largest relative error of the fitted line over the measured sizes, per collective.
    pub max_rel_err: [f64; 3],
    /// The measured (bytes, seconds), per collective.
    pub curve: Curve,
}

impl CommFit {
    /// Reads `path` and fits every collective it holds (all three are needed).
    pub fn load(path: &Path) -> Result<CommFit, String> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| format!("comm bench {shown}: {e}"))?;
        let f: CommFile = serde_json::from_str(&text).map_err(|e| format!("comm bench {shown}: {e} (write one with `vitscale launch --nproc-per-node N -- bench --comm --comm-out C.json`)"))?;
        if f.format.as_deref() != Some(COMM_FORMAT) {
            return Err(format!("comm bench {shown}: `format` is {:?}, expected \"{}\"", f.format, COMM_FORMAT));
        }
        if f.world_size < 2 {
            return Err(format!("comm bench {shown}: measured on {} rank(s); a fit needs 2 or more (`vitscale launch --nproc-per-node 2 -- bench --comm …`)", f.world_size));
        }
        let mut fits = Vec::new();
        let mut curves: Vec<Vec<(f64, f64)>> = Vec::new();
        for op in [Op::AllReduce, Op::ReduceScatter, Op::AllGather] {
            let mut pts: Vec<(f64, f64)> = f.rows.iter().filter(|r| r.op == op.name()).map(|r| (r.bytes as f64, r.time_us * 1e-6)).collect();
            fits.push(fit(op, f.world_size, &pts).map_err(|e| format!("comm bench {shown}: {}: {e}", op.name()))?);
            pts.retain(|(s, t)| *s > 0.0 && *t > 0.0 && t.is_finite());
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            curves.push(pts);
        }
        let [ar, rs, ag]: [Vec<(f64, f64)>; 3] = curves.try_into().map_err(|_| format!("comm bench {shown}: three collectives expected"))?;
        Ok(CommFit {
            source: shown,
            transport: f.transport,
            device: f.device,
            world_size: f.world_size,
            all_reduce: fits[0].0,
            reduce_scatter: fits[1].0,
            all_gather: fits[2].0,
            max_rel_err: [fits[0].1, fits[1].1, fits[2].1],
            curve: Curve { world: f.world_size, points: [ar, rs, ag] },
        })
    }

    /// The level these fits describe.
    pub fn level(&self, link: &str) -> Level {
        Level {
            link: format!("{link} (measured by {}, {} ranks, {})", self.source, self.world_size, self.transport),
            all_reduce: self.all_reduce,
            reduce_scatter: self.reduce_scatter,
            all_gather: self.all_gather,
            curve: Some(self.curve.clone()),
        }
    }
}

/// Fits (α, β) of `op` over `n` ranks to (bytes, seconds) points; also the largest relative
/// error of the fit.
pub fn fit(op: Op, n: usize, pts: &[(f64, f64)]) -> Result<(AlphaBeta, f64), String> {
    let pts: Vec<(f64, f64)> = pts.iter().copied().filter(|(s, t)| *s > 0.0 && *t > 0.0 && t.is_finite()).collect();
    if pts.len() < 2 {
        return Err(format!("{} sizes with a positive time; a fit needs 2 or more", pts.len()));
    }
    // weighted least squares, weights 1/t²
    let (mut sw, mut sx, mut sy, mut sxx, mut sxy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &(x, y) in &pts {
        let w = 1.0 / (y * y);
        sw += w;
        sx += w * x;
        sy += w * y;
        sxx += w * x * x;
        sxy += w * x * y;
    }
    let det = sw * sxx - sx * sx;
    if det <= 0.0 {
        return Err("the sizes do not differ".into());
    }
    let mut c1 = (sw * sxy - sx * sy) / det;
    let mut c0 = (sy - c1 * sx) / sw;
    if c0 < 0.0 {
        // no negative latency: the best line through the origin
        c0 = 0.0;
        c1 = sxy / sxx;
    }
    if c1 <= 0.0 {
        return Err("time does not grow with the message size (a bandwidth cannot be fitted)".into());
    }
    let (k_alpha, f) = ring_factors(op, n);
    let ab = AlphaBeta { alpha_s: c0 / k_alpha, beta_bytes_s: f / c1 };
    let max_rel = pts.iter().map(|&(x, y)| ((c0 + c1 * x) - y).abs() / y).fold(0.0, f64::max);
    Ok((ab, max_rel))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::model::ring_time;

    /// Times generated by the ring model come back as the α and β that made them.
    #[test]
    fn a_fit_recovers_the_ring_model() {
        let truth = AlphaBeta { alpha_s: 20e-6, beta_bytes_s: 3e9 };
        for (op, n) in [(Op::AllReduce, 4), (Op::ReduceScatter, 2), (Op::AllGather, 8)] {
            let pts: Vec<(f64, f64)> = (13..27).map(|k| (2f64.powi(k), ring_time(op, n, 2f64.powi(k), &truth))).collect();
            let (ab, err) = fit(op, n, &pts).expect("fit");
            assert!((ab.alpha_s / truth.alpha_s - 1.0).abs() < 1e-6, "{op:?} α {}", ab.alpha_s);
            assert!((ab.beta_bytes_s / truth.beta_bytes_s - 1.0).abs() < 1e-6, "{op:?} β {}", ab.beta_bytes_s);
            assert!(err < 1e-9);
        }
        assert!(fit(Op::AllReduce, 2, &[(8.0, 1.0)]).is_err());
        assert!(fit(Op::AllReduce, 2, &[(8.0, 2.0), (16.0, 1.0)]).is_err());
    }
}
