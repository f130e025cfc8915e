//! Cluster files (`configs/clusters/*.json`): the machines a prediction is for. A cluster has
//! `nodes` nodes of `gpus_per_node` devices, `ranks_per_device` ranks on each device (more
//! than 1: ranks time-share it, as `launch --one-gpu` or CPU ranks do), and a latency α and a
//! bandwidth β per network level for each collective: `intra` (between the ranks of a node)
//! and `inter` (between nodes; its bandwidth is the node's, all its NICs together). A level
//! is `{"bandwidth_gb_s", "latency_us"}` for every collective, or one such object per
//! collective (`all_reduce`, `reduce_scatter`, `all_gather`), or `{"from_comm": true}`: fitted
//! from a `bench --comm --comm-out` file given to `vitscale plan --comm`. Bandwidth is the
//! ring's per-rank figure, the bus bandwidth nccl-tests prints for large messages.
//!
//! Every key is listed once in `CLUSTER_KEYS` / `LEVEL_KEYS` with its doc; an unknown key, a
//! missing one, a zero count or a non-positive bandwidth is an error naming the file and key.

use std::path::Path;

use serde::Serialize;
use serde_json::{Map, Value};

use super::comm_fit::CommFit;
use super::model::{AlphaBeta, Level, Op};

/// Keys of a cluster file, with their doc.
pub const CLUSTER_KEYS: &[(&str, &str)] = &[
    ("name", "a short name shown with the prediction (default: the file's name)"),
    ("description", "free text"),
    ("source", "where the figures come from (required: a prediction is only as good as its inputs)"),
    ("device", "the nodes' device as a profile names it, e.g. \"H200\", \"A100\" or \"cpu\": a profile measured on another device is refused unless compute_scale converts it"),
    ("gpus_per_node", "devices per node (an integer >= 1); CPU ranks: 1, the machine"),
    ("nodes", "nodes (an integer >= 1)"),
    ("ranks_per_device", "ranks on each device (default 1); above 1 they time-share it: one-GPU emulation, CPU ranks"),
    ("compute_scale", "time factor applied to the profile's compute (default 1): a device other than the profiled one, e.g. 1.9 for an A100 from an H200 profile"),
    ("compute_scale_source", "where compute_scale comes from"),
    ("intra", "the level between the ranks of a node: {bandwidth_gb_s, latency_us}, one such object per collective, or {from_comm: true}; required when a node has more than one rank"),
    ("inter", "the level between nodes, bandwidth per node: as intra; required when nodes > 1"),
    ("loader_images_per_s_per_core", "data-loader images/s of one core for this model's input (from `bench --data`); absent: data loading is not modelled"),
    ("loader_cores_per_rank", "loader cores each rank has (default 1)"),
];

/// Keys of one level (or of one collective inside it).
pub const LEVEL_KEYS: &[(&str, &str)] = &[
    ("bandwidth_gb_s", "ring bandwidth per rank (the nccl-tests busbw of large messages), GB/s = 1e9 bytes/s, > 0"),
    ("latency_us", "latency per ring step (α), microseconds, >= 0"),
    ("link", "what the level is (text)"),
    ("all_reduce", "this collective's own {bandwidth_gb_s, latency_us}"),
    ("reduce_scatter", "this collective's own {bandwidth_gb_s, latency_us}"),
    ("all_gather", "this collective's own {bandwidth_gb_s, latency_us}"),
    ("from_comm", "true: fit α and β per collective from the `vitscale plan --comm` file"),
];

/// A validated cluster.
#[derive(Clone, Debug, Serialize)]
pub struct Cluster {
    pub name: String,
    pub source: String,
    /// The nodes' device (`device`), matched against a profile's device name.
    pub device: Option<String>,
    pub gpus_per_node: usize,
    pub nodes: usize,
    pub ranks_per_device: usize,
    pub compute_scale: f64,
    pub compute_scale_source: Option<String>,
    pub intra: Option<Level>,
    pub inter: Option<Level>,
    pub loader_images_per_s_per_core: Option<f64>,
    pub loader_cores_per_rank: f64,
}

impl Cluster {
    pub fn world(&self) -> usize {
        self.gpus_per_node * self.nodes * self.ranks_per_device
    }
    pub fn ranks_per_node(&self) -> usize {
        self.gpus_per_node * self.ranks_per_device
    }

    /// Whether a profile measured on `profile_device` (its backend's name, e.g. "cuda:0 NVIDIA
    /// H200" or "cpu (2 threads)") is for this cluster's devices: Ok(None) when it is, Ok(Some
    /// (warning)) when that cannot be told or `compute_scale` converts it, Err when it is not.
    pub fn check_device(&self, profile_device: &str) -> Result<Option<String>, String> {
        let Some(d) = &self.device else {
            return Ok(Some(format!("cluster {} names no `device`: whether the profile (measured on {profile_device}) is for its devices is not checked", self.name)));
        };
        if profile_device.to_lowercase().contains(&d.to_lowercase()) {
            return Ok(None);
        }
        if self.compute_scale != 1.0 {
            return Ok(Some(format!(
                "the profile was measured on {profile_device}, the cluster {} has {d} devices: its compute is scaled by compute_scale {} ({}); check that the scale is for a profile of this device",
                self.name,
                self.compute_scale,
                self.compute_scale_source.as_deref().unwrap_or("no source given")
            )));
        }
        Err(format!(
            "the profile was measured on {profile_device}, but the cluster {} has {d} devices: its times would be predicted as this profile's device's. Profile a {d} (`vitscale bench --profile-out` there), or give the cluster a compute_scale (with compute_scale_source) that converts this device's times",
            self.name
        ))
    }

    /// The cluster with some counts replaced (`vitscale plan --nodes/--gpus-per-node/
    /// --ranks-per-device`); the levels the new counts need must be in the file.
    pub fn with_counts(mut self, nodes: Option<usize>, gpus_per_node: Option<usize>, ranks_per_device: Option<usize>) -> Result<Cluster, String> {
        for (flag, v) in [("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--ranks-per-device", ranks_per_device)] {
            if v == Some(0) {
                return Err(format!("{flag} 0: expected at least 1"));
            }
        }
        self.nodes = nodes.unwrap_or(self.nodes);
        self.gpus_per_node = gpus_per_node.unwrap_or(self.gpus_per_node);
        self.ranks_per_device = ranks_per_device.unwrap_or(self.ranks_per_device);
        if self.ranks_per_node() > 1 && self.intra.is_none() {
            return Err(format!("cluster {}: {} ranks per node need an `intra` level, which the file does not give", self.name, self.ranks_per_node()));
        }
        if self.nodes > 1 && self.inter.is_none() {
            return Err(format!("cluster {}: {} nodes need an `inter` level, which the file does not give", self.name, self.nodes));
        }
        Ok(self)
    }

    /// Reads and validates `path`; `comm` supplies the levels marked `from_comm`.
    pub fn load(path: &Path, comm: &[CommFit]) -> Result<Cluster, String> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| format!("cluster {shown}: {e}"))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| format!("cluster {shown}: not valid JSON: {e}"))?;
        let stem = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "cluster".into());
        Cluster::from_value(&v, &shown, &stem, comm)
    }

    /// Validates a cluster value (`shown` names it in errors).
    pub fn from_value(v: &Value, shown: &str, default_name: &str, comm: &[CommFit]) -> Result<Cluster, String> {
        let err = |key: &str, msg: String| format!("cluster {shown}: `{key}`: {msg}");
        let obj = v.as_object().ok_or_else(|| format!("cluster {shown}: the top level must be a JSON object"))?;
        unknown_keys(obj, CLUSTER_KEYS).map_err(|k| err(&k, format!("unknown key; a cluster file has {}", names(CLUSTER_KEYS))))?;
        let count = |key: &str, default: Option<usize>| -> Result<usize, String> {
            match obj.get(key) {
                None => default.ok_or_else(|| err(key, "missing (an integer >= 1)".into())),
                Some(x) => x.as_u64().filter(|n| *n >= 1).map(|n| n as usize).ok_or_else(|| err(key, format!("{x} is not an integer >= 1"))),
            }
        };
        let text = |key: &str| -> Result<Option<String>, String> {
            match obj.get(key) {
                None => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(x) => Err(err(key, format!("{x} is not a string"))),
            }
        };
        let positive = |key: &str, default: Option<f64>| -> Result<Option<f64>, String> {
            match obj.get(key) {
                None => Ok(default),
                Some(x) => x.as_f64().filter(|f| f.is_finite() && *f > 0.0).map(Some).ok_or_else(|| err(key, format!("{x} is not a number > 0"))),
            }
        };
        let source = text("source")?.ok_or_else(|| err("source", "missing: say where the figures come from".into()))?;
        let gpus_per_node = count("gpus_per_node", None)?;
        let nodes = count("nodes", None)?;
        let ranks_per_device = count("ranks_per_device", Some(1))?;
        let level = |key: &str, needed: bool| -> Result<Option<Level>, String> {
            match obj.get(key) {
                None if needed => Err(err(key, "missing: this cluster has ranks that talk over it".into())),
                None => Ok(None),
                Some(x) => parse_level(x, key, comm).map(Some).map_err(|(k, m)| err(&k, m)),
            }
        };
        let intra = level("intra", gpus_per_node * ranks_per_device > 1)?;
        let inter = level("inter", nodes > 1)?;
        Ok(Cluster {
            name: text("name")?.unwrap_or_else(|| default_name.to_string()),
            source,
            device: text("device")?.filter(|d| !d.trim().is_empty()),
            gpus_per_node,
            nodes,
            ranks_per_device,
            compute_scale: positive("compute_scale", Some(1.0))?.unwrap_or(1.0),
            compute_scale_source: text("compute_scale_source")?,
            intra,
            inter,
            loader_images_per_s_per_core: positive("loader_images_per_s_per_core", None)?,
            loader_cores_per_rank: positive("loader_cores_per_rank", Some(1.0))?.unwrap_or(1.0),
        })
    }
}

fn names(keys: &[(&str, &str)]) -> String {
    keys.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", ")
}

fn unknown_keys(obj: &Map<String, Value>, keys: &[(&str, &str)]) -> Result<(), String> {
    match obj.keys().find(|k| !keys.iter().any(|(n, _)| n == k)) {
        Some(k) => Err(k.clone()),
        None => Ok(()),
    }
}

/// Above this a `bandwidth_gb_s` is a unit mistake: 10 TB/s per rank is several times any
/// NVLink or node's NICs together.
const MAX_BANDWIDTH_GB_S: f64 = 10_000.0;
/// Above this a `latency_us` is a unit mistake (nanoseconds): 100 ms per ring step.
const MAX_LATENCY_US: f64 = 100_000.0;

/// One {bandwidth_gb_s, latency_us} at `key`.
fn parse_ab(v: &Value, key: &str) -> Result<AlphaBeta, (String, String)> {
    let obj = v.as_object().ok_or_else(|| (key.to_string(), format!("{v} is not an object of bandwidth_gb_s and latency_us")))?;
    let bw = obj.get("bandwidth_gb_s").ok_or_else(|| (format!("{key}.bandwidth_gb_s"), "missing (GB/s, > 0)".to_string()))?;
    let bw = bw.as_f64().filter(|x| x.is_finite() && *x > 0.0).ok_or_else(|| (format!("{key}.bandwidth_gb_s"), format!("{bw} is not a bandwidth > 0 GB/s")))?;
    // the key is in GB/s: a figure in bytes/s (4.5e11 for 450 GB/s) would predict free
    // communication without a word
    if bw > MAX_BANDWIDTH_GB_S {
        return Err((
            format!("{key}.bandwidth_gb_s"),
            format!("{bw} GB/s is not plausible (above {MAX_BANDWIDTH_GB_S} GB/s): the unit is GB/s (1e9 bytes/s); in bytes/s this would be {} GB/s", bw / 1e9),
        ));
    }
    let lat = obj.get("latency_us").ok_or_else(|| (format!("{key}.latency_us"), "missing (microseconds, >= 0)".to_string()))?;
    let lat = lat.as_f64().filter(|x| x.is_finite() && *x >= 0.0).ok_or_else(|| (format!("{key}.latency_us"), format!("{lat} is not a latency >= 0 µs")))?;
    if lat > MAX_LATENCY_US {
        return Err((format!("{key}.latency_us"), format!("{lat} µs is not plausible (above {MAX_LATENCY_US} µs, a tenth of a second per ring step): the unit is microseconds; in nanoseconds this would be {} µs", lat / 1e3)));
    }
    Ok(AlphaBeta { alpha_s: lat * 1e-6, beta_bytes_s: bw * 1e9 })
}

/// A level at `key` (see the module doc); errors are (dotted key, message).
fn parse_level(v: &Value, key: &str, comm: &[CommFit]) -> Result<Level, (String, String)> {
    let obj = v.as_object().ok_or_else(|| (key.to_string(), format!("{v} is not an object")))?;
    if let Err(k) = unknown_keys(obj, LEVEL_KEYS) {
        return Err((format!("{key}.{k}"), format!("unknown key; a level has {}", names(LEVEL_KEYS))));
    }
    let link = obj.get("link").and_then(Value::as_str).unwrap_or(key).to_string();
    match obj.get("from_comm") {
        Some(Value::Bool(true)) => {
            let fit = comm.first().ok_or_else(|| (format!("{key}.from_comm"), "this level is fitted from a `bench --comm --comm-out` file: give it with `--comm C.json`".to_string()))?;
            return Ok(fit.level(&link));
        }
        Some(Value::Bool(false)) | None => {}
        Some(x) => return Err((format!("{key}.from_comm"), format!("{x} is not true or false"))),
    }
    let per_op = ["all_reduce", "reduce_scatter", "all_gather"].iter().any(|k| obj.contains_key(*k));
    let shared = obj.contains_key("bandwidth_gb_s") || obj.contains_key("latency_us");
    if per_op {
        let mut out = Vec::new();
        for op in [Op::AllReduce, Op::ReduceScatter, Op::AllGather] {
            let k = format!("{key}.{}", op.name());
            match obj.get(op.name()) {
                Some(x) => out.push(parse_ab(x, &k)?),
                None if shared => out.push(parse_ab(v, key)?),
                None => return Err((k, "missing: give every collective, or one bandwidth_gb_s and latency_us for the level".to_string())),
            }
        }
        return Ok(Level { link, all_reduce: out[0], reduce_scatter: out[1], all_gather: out[2], curve: None });
    }
    let ab = parse_ab(v, key)?;
    Ok(Level::uniform(&link, ab))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn load(v: Value) -> Result<Cluster, String> {
        Cluster::from_value(&v, "c.json", "c", &[])
    }

    fn good() -> Value {
        json!({"source": "test", "gpus_per_node": 8, "nodes": 2,
               "intra": {"bandwidth_gb_s": 400, "latency_us": 10},
               "inter": {"all_reduce": {"bandwidth_gb_s": 25, "latency_us": 20}, "bandwidth_gb_s": 20, "latency_us": 30}})
    }

    #[test]
    fn a_good_file_loads_with_its_levels() {
        let c = load(good()).expect("valid");
        assert_eq!((c.world(), c.ranks_per_node()), (16, 8));
        let inter = c.inter.expect("inter");
        assert_eq!(inter.all_reduce.beta_bytes_s, 25e9);
        assert_eq!(inter.all_gather.beta_bytes_s, 20e9);
        assert!((inter.reduce_scatter.alpha_s - 30e-6).abs() < 1e-15);
    }

    /// Each defect is reported with the file and the key it is in.
    #[test]
    fn bad_files_name_the_key() {
        let cases: Vec<(Value, &str)> = vec![
            ({ let mut v = good(); v.as_object_mut().unwrap().remove("nodes"); v }, "`nodes`: missing"),
            ({ let mut v = good(); v["gpus_per_node"] = json!(0); v }, "`gpus_per_node`: 0 is not an integer >= 1"),
            ({ let mut v = good(); v["intra"]["bandwidth_gb_s"] = json!(-5); v }, "`intra.bandwidth_gb_s`: -5 is not a bandwidth"),
            ({ let mut v = good(); v["colour"] = json!("red"); v }, "`colour`: unknown key"),
            ({ let mut v = good(); v["inter"]["speed"] = json!(1); v }, "`inter.speed`: unknown key"),
            ({ let mut v = good(); v.as_object_mut().unwrap().remove("inter"); v }, "`inter`: missing"),
            ({ let mut v = good(); v.as_object_mut().unwrap().remove("source"); v }, "`source`: missing"),
            ({ let mut v = good(); v["intra"] = json!({"from_comm": true}); v }, "`intra.from_comm`"),
            ({ let mut v = good(); v["intra"] = json!({"all_reduce": {"bandwidth_gb_s": 1, "latency_us": 1}}); v }, "`intra.reduce_scatter`: missing"),
            ({ let mut v = good(); v["compute_scale"] = json!(0); v }, "`compute_scale`: 0 is not a number > 0"),
            ({ let mut v = good(); v["intra"]["bandwidth_gb_s"] = json!(4.5e11); v }, "`intra.bandwidth_gb_s`: 450000000000 GB/s is not plausible"),
            ({ let mut v = good(); v["inter"]["all_reduce"]["bandwidth_gb_s"] = json!(2.5e10); v }, "`inter.all_reduce.bandwidth_gb_s`"),
            ({ let mut v = good(); v["intra"]["latency_us"] = json!(5e6); v }, "`intra.latency_us`: 5000000 µs is not plausible"),
        ];
        for (v, want) in cases {
            let e = load(v).expect_err(want);
            assert!(e.contains("cluster c.json") && e.contains(want), "{e:?} should name {want:?}");
        }
    }
}
