//! DeepSpeed's file monitors, `tensorboard` and `csv_monitor` (one table for both blocks), and
//! `wall_clock_breakdown`, which prints the same per-phase times on rank 0.

use serde_json::{json, Map, Value};

use super::key_def::*;
use super::types::{MonitorConfig, MonitorTarget};
use super::value::*;

pub(super) const WALL_CLOCK: KeyDef = key("wall_clock_breakdown", Ty::Bool, Dflt::Bool(false),
    "Print the time of each phase (data wait, forward, backward, exposed and total gradient reduction, optimizer) per step on rank 0 at every logged step, as DeepSpeed prints its timers. The phases are measured and written to metrics.jsonl and the monitors either way.");
pub(super) const TENSORBOARD: KeyDef = key("tensorboard", Ty::Section, Dflt::Unset,
    "DeepSpeed's TensorBoard monitor {enabled, output_path, job_name}: rank 0 writes an event file (events.out.tfevents.*) under <output_path>/<job_name>/ with Train/Samples/train_loss, lr, images_per_s and the step phases (elapsed_time_ms_*), against the global sample count, at every logged step.");
pub(super) const CSV_MONITOR: KeyDef = key("csv_monitor", Ty::Section, Dflt::Unset,
    "DeepSpeed's CSV monitor {enabled, output_path, job_name}: the same records as the TensorBoard monitor, one file per tag (Train_Samples_train_loss.csv, …) with the header `step,<name>`, under <output_path>/<job_name>/.");

const MON_ENABLED: KeyDef = key("enabled", Ty::Bool, Dflt::Bool(false), "Write this monitor's files (rank 0 only, as DeepSpeed).");
const MON_OUTPUT: KeyDef = key("output_path", Ty::Str, Dflt::Str(""),
    "Directory under which the monitor's `job_name` folder is made; \"\" = the run directory (DeepSpeed: the launch directory).");
const MON_JOB: KeyDef = key("job_name", Ty::Str, Dflt::Str("DeepSpeedJobName"), "Folder of this job under output_path (a name, not a path).");
/// Keys of the `tensorboard` and `csv_monitor` blocks.
pub const MONITOR_KEYS: &[KeyDef] = &[MON_ENABLED, MON_OUTPUT, MON_JOB];

fn parse_monitor_block(root: &Map<String, Value>, def: &KeyDef, cx: &mut Cx) -> Result<Option<MonitorTarget>> {
    let Some(sec) = section(root.get(def.name), def.name)? else { return Ok(None) };
    check_keys(def.name, sec, MONITOR_KEYS, &[])?;
    let output_path = get_str(Some(sec), def.name, &MON_OUTPUT, cx)?.to_string();
    let job_name = get_str(Some(sec), def.name, &MON_JOB, cx)?.to_string();
    if job_name.is_empty() || job_name.contains('/') || job_name == "." || job_name == ".." {
        return Err(key_err(full(def.name, MON_JOB.name), format!("\"{job_name}\" is not a folder name (no '/', not empty)")));
    }
    Ok(get_bool(Some(sec), def.name, &MON_ENABLED, cx)?.then_some(MonitorTarget { output_path, job_name }))
}

/// Both monitor blocks and `wall_clock_breakdown`, read from the top level.
pub(super) fn parse(root: &Map<String, Value>, cx: &mut Cx) -> Result<MonitorConfig> {
    Ok(MonitorConfig {
        tensorboard: parse_monitor_block(root, &TENSORBOARD, cx)?,
        csv_monitor: parse_monitor_block(root, &CSV_MONITOR, cx)?,
        wall_clock_breakdown: get_bool(Some(root), "", &WALL_CLOCK, cx)?,
    })
}

/// The enabled monitors' blocks (a disabled one is left out, as absent means off) after
/// `wall_clock_breakdown`.
pub(super) fn write(monitor: &MonitorConfig, out: &mut Map<String, Value>) {
    put(out, &WALL_CLOCK, json!(monitor.wall_clock_breakdown));
    for (def, target) in [(&TENSORBOARD, &monitor.tensorboard), (&CSV_MONITOR, &monitor.csv_monitor)] {
        if let Some(t) = target {
            let mut block = Map::new();
            put(&mut block, &MON_ENABLED, json!(true));
            put(&mut block, &MON_OUTPUT, json!(t.output_path));
            put(&mut block, &MON_JOB, json!(t.job_name));
            put(out, def, Value::Object(block));
        }
    }
}
