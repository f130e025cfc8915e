//! Sweep specs: a base configuration, fixed overrides and a grid of dotted keys whose
//! cartesian product is the set of points (the format `configs/study/*.json` follow).
//!
//! ```json
//! {"base": "../vit_tiny_cifar10.json", "set": {"train.steps": 30},
//!  "grid": {"train_micro_batch_size_per_gpu": [16, 64], "nproc": [1, 2]},
//!  "device": "cpu", "steps": 30, "warmup_steps": 5, "full_training": false, "timeout_s": 900}
//! ```
//! `base` is a path relative to the spec file or an inline config object. Grid keys are the
//! dotted keys `vitscale train --set` takes, plus two of the lab's own: `nproc` (ranks, run
//! through `vitscale launch --nproc-per-node`) and `one_gpu` (every rank on GPU 0).
//!
//! `"repeats": R` runs every point R times, in rounds (every point once, then every point
//! again, …), so that a slow stretch of a shared machine falls on all points alike; the runs'
//! ids end in `_r1` … `_rR`, and `plan --validate` measures each point's spread from them.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{Map, Value};

use crate::config::keys;

/// Grid key: the number of ranks of a point.
pub const NPROC_KEY: &str = "nproc";
/// Grid key: put every rank on GPU 0 (`vitscale launch --one-gpu`).
pub const ONE_GPU_KEY: &str = "one_gpu";

/// Keys a spec may hold, with their doc (error messages list them).
pub const SPEC_KEYS: &[(&str, &str)] = &[
    ("base", "the run configuration: a path relative to the spec file, or an inline object"),
    ("set", "fixed overrides for every point: {\"dotted.key\": value}"),
    ("grid", "{\"dotted.key\": [values…]}; the points are the cartesian product; special keys nproc, one_gpu"),
    ("device", "\"cpu\" or \"cuda\" (default \"cpu\")"),
    ("steps", "optimizer steps per point (default 30; ignored with full_training)"),
    ("warmup_steps", "leading steps left out of each point's summary (default 5)"),
    ("full_training", "train each point to the end of its configured run instead of `steps` (default false)"),
    ("timeout_s", "seconds a point may run before it is stopped and recorded as failed (default 900)"),
    ("repeats", "runs of every point, in rounds of one run each (default 1)"),
    ("name", "a title for the report (default: the spec file's name)"),
    ("description", "free text shown in the report"),
];

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("sweep spec {path}: {msg}")]
    Invalid { path: String, msg: String },
}

/// A validated sweep spec.
#[derive(Clone, Debug, Serialize)]
pub struct SweepSpec {
    pub name: String,
    pub description: String,
    /// The base configuration, loaded.
    pub base: Value,
    /// Where it came from (a file, or "inline").
    pub base_source: String,
    pub set: Map<String, Value>,
    /// Grid keys in the spec's order with their values.
    pub grid: Vec<(String, Vec<Value>)>,
    pub device: String,
    pub steps: u64,
    pub warmup_steps: u64,
    pub full_training: bool,
    pub timeout_s: f64,
    /// Runs of every point (rounds); left out of `spec.json` when 1, as specs without it wrote.
    #[serde(skip_serializing_if = "is_one")]
    pub repeats: u64,
}

fn is_one(x: &u64) -> bool {
    *x == 1
}

/// One point of the grid: its values of the grid keys, in the grid's order.
#[derive(Clone, Debug, Serialize)]
pub struct Point {
    pub index: usize,
    /// A file-name-safe id unique in the sweep, e.g. `p003_micro64_gas1_nproc2` (with
    /// `repeats`, `p003_micro64_gas1_nproc2_r2` for the second run).
    pub id: String,
    pub keys: Map<String, Value>,
    /// Which run of the point this is (0-based; 0 without `repeats`).
    pub repeat: usize,
}

impl Point {
    /// Ranks of this point (`nproc`, default 1).
    pub fn nproc(&self) -> usize {
        self.keys.get(NPROC_KEY).and_then(Value::as_u64).unwrap_or(1) as usize
    }
    pub fn one_gpu(&self) -> bool {
        self.keys.get(ONE_GPU_KEY).and_then(Value::as_bool).unwrap_or(false)
    }
}

fn bad(path: &str, msg: impl Into<String>) -> SpecError {
    SpecError::Invalid { path: path.to_string(), msg: msg.into() }
}

impl SweepSpec {
    /// Reads and validates the spec at `path`.
    pub fn load(path: &Path) -> Result<SweepSpec, SpecError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| bad(&shown, format!("cannot read: {e}")))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| bad(&shown, format!("not valid JSON: {e}")))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let stem = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_else(|| "sweep".into());
        SweepSpec::from_value(&v, dir, &shown, &stem)
    }

    /// Validates a spec value; a path `base` is resolved against `dir`.
    pub fn from_value(v: &Value, dir: &Path, shown: &str, default_name: &str) -> Result<SweepSpec, SpecError> {
        let obj = v.as_object().ok_or_else(|| bad(shown, "the top level must be a JSON object"))?;
        for k in obj.keys() {
            if !SPEC_KEYS.iter().any(|(name, _)| name == k) {
                let known: Vec<&str> = SPEC_KEYS.iter().map(|(n, _)| *n).collect();
                return Err(bad(shown, format!("unknown key `{k}`; a spec has {}", known.join(", "))));
            }
        }
        let (base, base_source) = match obj.get("base") {
            None => return Err(bad(shown, "`base` is required: a config file path relative to the spec, or an inline config object")),
            Some(Value::String(p)) => {
                let file: PathBuf = dir.join(p);
                let v = crate::config::load_json(Some(&file), &[]).map_err(|e| bad(shown, format!("base: {e}")))?;
                (v, file.display().to_string())
            }
            Some(o @ Value::Object(_)) => (o.clone(), "inline".to_string()),
            Some(other) => return Err(bad(shown, format!("base: expected a path or an object, got {other}"))),
        };
        let set = match obj.get("set") {
            None => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(other) => return Err(bad(shown, format!("set: expected an object of dotted keys, got {other}"))),
        };
        let grid_obj = match obj.get("grid") {
            Some(Value::Object(m)) if !m.is_empty() => m,
            Some(Value::Object(_)) | None => return Err(bad(shown, "`grid` is required: an object of dotted keys to lists of values")),
            Some(other) => return Err(bad(shown, format!("grid: expected an object, got {other}"))),
        };
        let mut grid = Vec::new();
        for (k, vals) in grid_obj {
            let list = vals.as_array().filter(|a| !a.is_empty()).ok_or_else(|| bad(shown, format!("grid.{k}: expected a non-empty list of values")))?;
            if k.split('.').any(str::is_empty) {
                return Err(bad(shown, format!("grid.{k}: not a dotted key path")));
            }
            match k.as_str() {
                NPROC_KEY => {
                    if let Some(x) = list.iter().find(|x| x.as_u64().filter(|n| *n >= 1).is_none()) {
                        return Err(bad(shown, format!("grid.nproc: {x} is not a rank count (an integer >= 1)")));
                    }
                }
                ONE_GPU_KEY => {
                    if let Some(x) = list.iter().find(|x| !x.is_boolean()) {
                        return Err(bad(shown, format!("grid.one_gpu: {x} is not true or false")));
                    }
                }
                _ => {}
            }
            // a value listed twice would run the same point twice under two ids
            for (i, x) in list.iter().enumerate() {
                if list[..i].contains(x) {
                    return Err(bad(shown, format!("grid.{k}: the value {x} is listed twice; list each value once")));
                }
            }
            grid.push((k.clone(), list.clone()));
        }
        let device = match obj.get("device") {
            None => "cpu".to_string(),
            Some(Value::String(s)) if s == "cpu" || s == "cuda" => s.clone(),
            Some(other) => return Err(bad(shown, format!("device: expected \"cpu\" or \"cuda\", got {other}"))),
        };
        let uint = |k: &str, dflt: u64, min: u64| -> Result<u64, SpecError> {
            match obj.get(k) {
                None => Ok(dflt),
                Some(x) => x.as_u64().filter(|n| *n >= min).ok_or_else(|| bad(shown, format!("{k}: expected an integer >= {min}, got {x}"))),
            }
        };
        let steps = uint("steps", 30, 1)?;
        let repeats = uint("repeats", 1, 1)?;
        let warmup_steps = uint("warmup_steps", 5, 0)?;
        let full_training = match obj.get("full_training") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(bad(shown, format!("full_training: expected true or false, got {other}"))),
        };
        if !full_training && warmup_steps >= steps {
            return Err(bad(shown, format!("warmup_steps ({warmup_steps}) must be less than steps ({steps}): no step would be measured")));
        }
        let timeout_s = match obj.get("timeout_s") {
            None => 900.0,
            Some(x) => x.as_f64().filter(|t| *t > 0.0 && t.is_finite()).ok_or_else(|| bad(shown, format!("timeout_s: expected seconds > 0, got {x}")))?,
        };
        let text = |k: &str, dflt: &str| -> Result<String, SpecError> {
            match obj.get(k) {
                None => Ok(dflt.to_string()),
                Some(Value::String(s)) => Ok(s.clone()),
                Some(other) => Err(bad(shown, format!("{k}: expected a string, got {other}"))),
            }
        };
        let name = text("name", default_name)?;
        // the name is the default sweep directory under sweeps/: `../x` or `a/b` would land
        // elsewhere
        let mut parts = Path::new(&name).components();
        if !matches!((parts.next(), parts.next()), (Some(std::path::Component::Normal(_)), None)) || name.contains(['/', '\\']) {
            return Err(bad(shown, format!("name: {name:?} is not a plain name (one path component, no `/`, `..` or `.`): it names the sweep directory sweeps/<name>")));
        }
        Ok(SweepSpec {
            name,
            description: text("description", "")?,
            base,
            base_source,
            set,
            grid,
            device,
            steps,
            warmup_steps,
            full_training,
            timeout_s,
            repeats,
        })
    }

    /// Refuses a `set` or grid key the configuration does not know, before any point runs: a
    /// typo at the top level would otherwise only warn in each point's stderr.log and run
    /// every point with the default. The base with `set` and the first value of every grid key
    /// is resolved once; an unknown-key warning or error naming one of those keys is an
    /// error here, with the configuration's suggestion. Other problems of the configuration
    /// are left to the points, which record them.
    pub fn check_keys(&self) -> Result<(), SpecError> {
        let mut cfg = self.base.clone();
        let mut keys: Vec<(&str, &str)> = Vec::new();
        for (k, v) in &self.set {
            crate::config::apply_set(&mut cfg, &format!("{k}={v}")).map_err(|e| bad(&self.name, format!("set.{k}: {e}")))?;
            keys.push((k, "set"));
        }
        for (k, vals) in &self.grid {
            if k == NPROC_KEY || k == ONE_GPU_KEY {
                continue;
            }
            crate::config::apply_set(&mut cfg, &format!("{k}={}", vals[0])).map_err(|e| bad(&self.name, format!("grid.{k}: {e}")))?;
            keys.push((k, "grid"));
        }
        let unknown = |key: &str, what: &str, msg: &str| bad(&self.name, format!("{what}.{key}: not a configuration key: {msg}"));
        match crate::config::resolve(&cfg, 1) {
            Ok(resolved) => {
                for (k, what) in &keys {
                    let prefix = format!("{k}: unknown key");
                    if let Some(w) = resolved.warnings.iter().find(|w| w.starts_with(&prefix)) {
                        // the configuration's ", ignored (as DeepSpeed …)" is not what happens here
                        let w = w.strip_prefix(&format!("{k}: ")).unwrap_or(w);
                        return Err(unknown(k, what, w.split(", ignored").next().unwrap_or(w)));
                    }
                }
            }
            Err(crate::config::ConfigError::Key { key, msg }) if msg.starts_with("unknown key") => {
                if let Some((k, what)) = keys.iter().find(|(k, _)| *k == key || key.starts_with(&format!("{k}."))) {
                    return Err(unknown(k, what, &msg));
                }
            }
            Err(_) => {}
        }
        Ok(())
    }

    /// Every run of every point of the grid in the order they run: the grid's points (the
    /// last key varying fastest) once per round of `repeats`.
    pub fn points(&self) -> Vec<Point> {
        let mut combos: Vec<Vec<&Value>> = vec![vec![]];
        for (_, vals) in &self.grid {
            combos = combos.into_iter().flat_map(|c| vals.iter().map(move |v| {
                let mut c = c.clone();
                c.push(v);
                c
            })).collect();
        }
        let grid: Vec<(String, Map<String, Value>)> = combos
            .into_iter()
            .enumerate()
            .map(|(index, vals)| {
                let keys: Map<String, Value> = self.grid.iter().map(|(k, _)| k.clone()).zip(vals.into_iter().cloned()).collect();
                let mut id = format!("p{index:03}");
                for (k, v) in &keys {
                    id.push('_');
                    id.push_str(&short_key(k));
                    id.push_str(&slug(v));
                }
                (id, keys)
            })
            .collect();
        let rounds = self.repeats.max(1) as usize;
        (0..rounds)
            .flat_map(|repeat| grid.iter().map(move |(id, keys)| (repeat, id, keys)))
            .enumerate()
            .map(|(index, (repeat, id, keys))| {
                let id = if rounds > 1 { format!("{id}_r{}", repeat + 1) } else { id.clone() };
                Point { index, id, keys: keys.clone(), repeat }
            })
            .collect()
    }

    /// The configuration of `point`: the base, then `set`, then the point's grid values
    /// (dotted keys as `--set` applies them), then the lab's own: the run length and a
    /// metrics line every step (the summary is per step).
    pub fn point_config(&self, point: &Point) -> Result<Value, SpecError> {
        let mut cfg = self.base.clone();
        let apply = |cfg: &mut Value, k: &str, v: &Value| {
            crate::config::apply_set(cfg, &format!("{k}={v}")).map_err(|e| bad(&self.name, format!("{k}: {e}")))
        };
        for (k, v) in &self.set {
            apply(&mut cfg, k, v)?;
        }
        for (k, v) in &point.keys {
            if k != NPROC_KEY && k != ONE_GPU_KEY {
                apply(&mut cfg, k, v)?;
            }
        }
        if !self.full_training {
            apply(&mut cfg, &keys::TRAIN_STEPS.dotted(), &Value::from(self.steps))?;
        }
        apply(&mut cfg, &keys::TRAIN_LOG_EVERY.dotted(), &Value::from(1))?;
        Ok(cfg)
    }
}

/// A short name of a dotted key for point ids (the last part, abbreviated).
fn short_key(k: &str) -> String {
    let last = k.rsplit('.').next().unwrap_or(k);
    let abbreviations = [(keys::MICRO_BATCH, "micro"), (keys::GAS, "gas"), (keys::TRAIN_BATCH_SIZE, "batch"), (keys::ZERO_STAGE, "zero")];
    match abbreviations.iter().find(|(key, _)| key.name() == last) {
        Some((_, short)) => short.to_string(),
        None => last.chars().filter(|c| c.is_ascii_alphanumeric()).take(12).collect(),
    }
}

/// A value as file-name-safe text: `{"1": 2.0}` → `1-2.0`.
fn slug(v: &Value) -> String {
    let s = match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut out: String = s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' || c == '-' { c } else { '-' }).collect();
    while out.contains("--") {
        out = out.replace("--", "-");
    }
    out.trim_matches('-').chars().take(24).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_grid_is_the_cartesian_product_with_unique_ids() {
        let v = json!({"base": {"model": {"preset": "vit_builtin_default"}}, "grid": {"train_micro_batch_size_per_gpu": [8, 16, 32], "nproc": [1, 2]}, "steps": 4, "warmup_steps": 1});
        let s = SweepSpec::from_value(&v, Path::new("."), "t", "t").expect("valid spec");
        let pts = s.points();
        assert_eq!(pts.len(), 6);
        let ids: std::collections::HashSet<_> = pts.iter().map(|p| p.id.clone()).collect();
        assert_eq!(ids.len(), 6);
        assert_eq!(pts[1].keys["nproc"], json!(2));
        assert_eq!(pts[2].keys["train_micro_batch_size_per_gpu"], json!(16));
        let cfg = s.point_config(&pts[5]).expect("config");
        assert_eq!(cfg["train_micro_batch_size_per_gpu"], json!(32));
        assert_eq!(cfg["train"]["steps"], json!(4));
        assert!(cfg.get("nproc").is_none());
    }

    /// Three rounds of a grid of two points: every point once per round, in the grid's order.
    #[test]
    fn repeats_run_in_rounds() {
        let v = json!({"base": {"model": {"preset": "vit_builtin_default"}}, "grid": {"nproc": [1, 2]}, "repeats": 3, "steps": 4, "warmup_steps": 1});
        let s = SweepSpec::from_value(&v, Path::new("."), "t", "t").expect("valid spec");
        let pts = s.points();
        let ids: Vec<&str> = pts.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["p000_nproc1_r1", "p001_nproc2_r1", "p000_nproc1_r2", "p001_nproc2_r2", "p000_nproc1_r3", "p001_nproc2_r3"]);
        assert_eq!(pts.iter().map(|p| (p.index, p.repeat, p.nproc())).collect::<Vec<_>>(), [(0, 0, 1), (1, 0, 2), (2, 1, 1), (3, 1, 2), (4, 2, 1), (5, 2, 2)]);
        // without repeats the ids and the recorded spec are as before
        let one = SweepSpec::from_value(&json!({"base": {}, "grid": {"nproc": [1]}}), Path::new("."), "t", "t").expect("valid spec");
        assert_eq!(one.points()[0].id, "p000_nproc1");
        assert!(serde_json::to_value(&one).expect("json").get("repeats").is_none());
        assert_eq!(serde_json::to_value(&s).expect("json")["repeats"], json!(3));
    }

    #[test]
    fn bad_specs_name_the_key() {
        let cases = [
            (json!({"grid": {"a": [1]}}), "base"),
            (json!({"base": {}, "grid": {}}), "grid"),
            (json!({"base": {}, "grid": {"nproc": [0]}}), "grid.nproc"),
            (json!({"base": {}, "grid": {"x": []}}), "grid.x"),
            (json!({"base": {}, "grid": {"x": [1]}, "device": "tpu"}), "device"),
            (json!({"base": {}, "grid": {"x": [1]}, "steps": 3, "warmup_steps": 3}), "warmup_steps"),
            (json!({"base": {}, "grid": {"x": [1]}, "timeout": 3}), "timeout"),
            (json!({"base": {}, "grid": {"x": [1, 2, 1]}}), "grid.x"),
            (json!({"base": {}, "grid": {"x": [1]}, "name": "../../x"}), "name"),
            (json!({"base": {}, "grid": {"x": [1]}, "name": "a/b"}), "name"),
            (json!({"base": {}, "grid": {"x": [1]}, "name": ".."}), "name"),
            (json!({"base": {}, "grid": {"x": [1]}, "name": ""}), "name"),
            (json!({"base": {}, "grid": {"x": [1]}, "repeats": 0}), "repeats"),
            (json!({"base": {}, "grid": {"x": [1]}, "repeats": "3"}), "repeats"),
        ];
        for (v, key) in cases {
            let e = SweepSpec::from_value(&v, Path::new("."), "t", "t").expect_err("invalid").to_string();
            assert!(e.contains(key), "{e} should name {key}");
        }
    }
}
