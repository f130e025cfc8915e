//! Resuming a run: which keys a resume may change (the keys flagged `resume_free` in their
//! tables), the differences that refuse a resume, and keeping the checkpoint's global batch
//! on another world size.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use super::key_def::{full, key_err, Result};
use super::reference::{dotted, TABLES};
use super::top_level::{resolve_batch, GAS, MICRO_BATCH, TRAIN_BATCH_SIZE};

/// Keys a resumed run may change, as dotted paths: the run's length, how often it logs,
/// evaluates and checkpoints, and how the same global batch is split and scheduled
/// (micro-batch, GAS, passes, workers, timeouts, where the same dataset lies). Every other key
/// shapes the trajectory, and a resume continues the run exactly, so it must match the
/// checkpoint. Read from the `resume_free` flags of the key tables.
pub fn resume_free_keys() -> Vec<String> {
    let mut keys = Vec::new();
    for table in TABLES {
        for path in table.at {
            for def in table.keys.iter().filter(|d| d.resume_free) {
                let key = full(&dotted(path), def.name);
                if !keys.contains(&key) {
                    keys.push(key);
                }
            }
        }
    }
    keys
}

/// The resume-free keys a resumed run takes from its checkpoint's configuration (`saved`, as
/// `resolved_json` wrote it) when the new configuration (`value`, before resolving) does not
/// give them: the run's length, logging, evaluation and checkpoint intervals, the data's place
/// and loader settings, the ZeRO layout. The batch split and the sequence-parallel layout are
/// left out (a resume on another world size re-derives the split from the global batch), and the run's length is one choice: a value that
/// gives `train.steps` or `train.epochs` keeps both of its own. Returns `key = value` for each
/// key taken.
pub fn carry_over(value: &mut Value, saved: &Value) -> Vec<String> {
    // (the split includes the sequence-parallel layout: the new job's own, default 1)
    let split = [MICRO_BATCH.name, GAS.name, TRAIN_BATCH_SIZE.name, super::top_level::SEQUENCE_PARALLEL_SIZE.name, "memory", "plan"];
    let length_given = ["/train/steps", "/train/epochs"].iter().any(|p| value.pointer(p).is_some());
    let mut notes = Vec::new();
    for key in resume_free_keys() {
        if split.contains(&key.as_str()) || (length_given && (key == "train.steps" || key == "train.epochs")) {
            continue;
        }
        let pointer = format!("/{}", key.replace('.', "/"));
        let Some(saved_value) = saved.pointer(&pointer).filter(|v| !v.is_null()) else { continue };
        if value.pointer(&pointer).is_some() {
            continue;
        }
        if set_path(value, &key, saved_value.clone()) {
            notes.push(format!("{key} = {saved_value}"));
        }
    }
    notes
}

/// Sets `value` at the dotted `key`, creating objects on the way; false where a non-object
/// stands in the way.
fn set_path(value: &mut Value, key: &str, x: Value) -> bool {
    let mut at = value;
    let parts: Vec<&str> = key.split('.').collect();
    for (i, part) in parts.iter().enumerate() {
        let Some(obj) = at.as_object_mut() else { return false };
        if i + 1 == parts.len() {
            obj.insert(part.to_string(), x);
            return true;
        }
        at = obj.entry(part.to_string()).or_insert_with(|| Value::Object(Default::default()));
    }
    false
}

fn flatten(prefix: &str, v: &Value, out: &mut BTreeMap<String, Value>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                flatten(&full(prefix, k), x, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.clone());
        }
    }
}

/// The keys where the configuration `now` (as [`resolved_json`](super::resolved_json) writes
/// it) differs from the `saved` one of a checkpoint, other than the [`resume_free_keys`]: one
/// `key: checkpoint X, now Y` line each.
pub fn resume_differences(saved: &Value, now: &Value) -> Vec<String> {
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    flatten("", saved, &mut a);
    flatten("", now, &mut b);
    let resume_free = resume_free_keys();
    let free = |k: &str| resume_free.iter().any(|f| k == f || k.starts_with(&format!("{f}.")));
    let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let show = |v: Option<&Value>| v.map_or("(absent)".to_string(), |v| v.to_string());
    keys.into_iter()
        .filter(|k| !free(k))
        .filter(|k| match (a.get(*k), b.get(*k)) {
            // 0.1 written by an f32 field and read back as f64 compares equal in f32.
            (Some(Value::Number(x)), Some(Value::Number(y))) => match (x.as_f64(), y.as_f64()) {
                (Some(x), Some(y)) => x != y && (x as f32) != (y as f32),
                _ => x != y,
            },
            (x, y) => x != y,
        })
        .map(|k| format!("{k}: checkpoint {}, now {}", show(a.get(k)), show(b.get(k))))
        .collect()
}

/// For a run resumed on another world size than its checkpoint's (`saved_world`): sets the
/// batch keys of `value` so the global batch stays the checkpoint's `global`, keeping the
/// micro-batch the config gives when it divides (else its GAS, else neither). A
/// `train_batch_size` the config gives must equal `global`. Returns the note saying what was
/// derived.
pub fn keep_global_batch(value: &mut Value, global: usize, saved_world: usize, world: usize) -> Result<String> {
    let root = value.as_object_mut().ok_or_else(|| key_err("(top level)", "expected a JSON object"))?;
    let num = |k: &str| root.get(k).and_then(Value::as_u64).map(|x| x as usize);
    let (t, m, g) = (num(TRAIN_BATCH_SIZE.name), num(MICRO_BATCH.name), num(GAS.name));
    // the triple counts the data-parallel degree (a group that does not divide the world is
    // the resolver's error to report)
    let sp = num(super::top_level::SEQUENCE_PARALLEL_SIZE.name).filter(|&s| s > 0 && world.is_multiple_of(s)).unwrap_or(1);
    let dp = world / sp;
    if let Some(t) = t.filter(|&t| t != global) {
        return Err(key_err(
            TRAIN_BATCH_SIZE.name,
            format!("is {t}, but the checkpoint was trained with a global batch of {global}; a resumed run keeps its global batch (leave train_batch_size out or set it to {global})"),
        ));
    }
    let mut last = None;
    for (cm, cg) in [(m, g), (m, None), (None, g), (None, None)] {
        match resolve_batch(Some(global), cm, cg, dp) {
            Ok(b) => {
                root.insert(TRAIN_BATCH_SIZE.name.into(), global.into());
                root.insert(MICRO_BATCH.name.into(), b.micro_batch_per_gpu.into());
                root.insert(GAS.name.into(), b.gradient_accumulation_steps.into());
                let slots = if sp > 1 { format!("{dp} data-parallel groups of {sp}") } else { format!("{world} ranks") };
                return Ok(format!(
                    "resuming a checkpoint of {saved_world} rank(s) on {world}: train_batch_size {global} kept = micro {} × GAS {} × {slots}",
                    b.micro_batch_per_gpu, b.gradient_accumulation_steps
                ));
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| key_err(TRAIN_BATCH_SIZE.name, "cannot be kept")))
}
