//! Run configuration: a DeepSpeed JSON (every DeepSpeed key keeps its meaning) plus the
//! `model`, `data` and `train` sections, `--set key.path=JSON` overrides, and the validated
//! typed result.
//!
//! **One definition per option.** Every key we read is a [`KeyDef`] (name, type and accepted
//! values, default, doc, support level, whether a resume may change it) in its section's
//! table ([`TOP_KEYS`], [`ADAM_KEYS`], [`MODEL_KEYS`], [`DATA_KEYS`], …). The getters take the
//! definition, so the default applied, the error text ("expected …"), the help text
//! ([`help_text`], which `docs/config.md` is) and the key written into a run's `config.json`
//! ([`resolved_json`]) all come from the same place. Each section's file holds its table,
//! its parsing and validation, and its writing. To add a key: add a `KeyDef` constant to its
//! section's file, put it in the table, read it with the getter of its type and write it in
//! the section's `write`.
//!
//! Rules that are not DeepSpeed's own, all documented on their keys:
//! - no batch key at all → `train_micro_batch_size_per_gpu = 64`, `gradient_accumulation_steps = 1`;
//! - no `optimizer` block → AdamW, lr 1e-3, weight_decay 0.05 (training from scratch);
//! - `"auto"` (as Hugging Face writes it) counts as "not given", with a warning;
//! - DeepSpeed keys whose feature we do not implement are accepted and listed in
//!   `RunConfig::warnings` (never silently dropped);
//! - unknown keys follow DeepSpeed: at the top level (which DeepSpeed ignores) they are a
//!   warning naming the key and the closest known one, so a config DeepSpeed runs also runs
//!   here; inside a section (DeepSpeed's sections forbid extras; ours do too) they are errors;
//! - a key given twice in one JSON object is an error naming it (DeepSpeed refuses duplicate
//!   keys too), rather than the last one silently winning.

// What every section is made of: key definitions, reading values by them, the JSON input.
mod key_def;
mod load;
mod types;
mod value;

// One file per section of the JSON.
mod data;
mod model;
mod monitor;
mod optimizer;
mod precision;
mod scheduler;
mod top_level;
mod train;
mod zero;

// Over all sections: the key reference, resuming, keys by name for the rest of the crate.
pub mod keys;
mod reference;
mod resume;

use serde_json::{Map, Value};

pub use data::{parse_rand_augment, DATA_KEYS};
pub use key_def::{ConfigError, Dflt, KeyDef, Support, Ty};
pub use keys::{ConfigBuilder, KeyPath};
pub use load::{apply_set, load_json, parse_json_strict};
pub use model::MODEL_KEYS;
pub use monitor::MONITOR_KEYS;
pub use precision::fp16_defaults;
pub use optimizer::{ADAM_KEYS, DEFAULT_WEIGHT_DECAY, OPTIMIZER_TYPES, SGD_KEYS};
pub use reference::help_text;
pub use resume::{carry_over, keep_global_batch, resume_differences, resume_free_keys};
pub use scheduler::SCHEDULER_TYPES;
pub use top_level::{resolve_batch, DEFAULT_MICRO_BATCH, TOP_KEYS};
pub use train::TRAIN_KEYS;
pub use types::*;
pub use value::suggest;

use key_def::{key_err, kind_of, Cx, Result};
use value::{get_int, get_num, note_unimplemented, put, section};

/// Parses a whole configuration (as returned by [`load_json`]) for a job of `world_size` ranks
/// (data-parallel degree × `sequence_parallel_size`) into a validated [`RunConfig`].
pub fn resolve(value: &Value, world_size: usize) -> Result<RunConfig> {
    let root = value
        .as_object()
        .ok_or_else(|| key_err("(top level)", format!("expected a JSON object, got {}", kind_of(value))))?;
    let mut cx = Cx::default();
    top_level::warn_unknown_top_level(root, &mut cx);
    note_unimplemented("", root, TOP_KEYS, &mut cx);

    // Sections that depend on others come after them: the model on the data (its class
    // count), the train section on the batch, the scheduler on the optimizer's lr.
    let batch = top_level::resolve_batch_keys(root, world_size, &mut cx)?;
    let gradient_clipping = get_num(Some(root), "", &top_level::GRADIENT_CLIPPING, &mut cx)?;
    let precision = precision::parse(root, &mut cx)?;
    let zero = zero::parse(root.get(zero::ZERO_OPTIMIZATION.name), &mut cx)?;
    let grad_comm = top_level::parse_grad_comm(root, &precision, zero.stage, &mut cx)?;
    let data = data::parse(section(root.get(data::DATA.name), data::DATA.name)?, &mut cx)?;
    let model_section = section(root.get(model::MODEL.name), model::MODEL.name)?;
    let model = model::parse(model_section, &data, &mut cx)?;
    let drop_path_rate = model::parse_drop_path(model_section, &mut cx)?;
    let steps_per_print = get_int(Some(root), "", &top_level::STEPS_PER_PRINT, &mut cx)?;
    let checkpointing = train::parse_activation_checkpointing(root, &mut cx)?;
    let train = train::parse(section(root.get(train::TRAIN.name), train::TRAIN.name)?, &batch, steps_per_print, checkpointing, &mut cx)?;
    let (optimizer, layer_decay) = optimizer::parse(section(root.get(optimizer::OPTIMIZER.name), optimizer::OPTIMIZER.name)?, &mut cx)?;
    data::check_mixing_batch(&data, &batch)?;
    top_level::check_sequence_parallel(&batch, &model, &train)?;
    let scheduler = scheduler::parse(section(root.get(scheduler::SCHEDULER.name), scheduler::SCHEDULER.name)?, &optimizer, &mut cx)?;
    let monitor = monitor::parse(root, &mut cx)?;

    Ok(RunConfig {
        batch,
        optimizer,
        layer_decay,
        scheduler,
        gradient_clipping,
        precision,
        zero_stage: zero.stage,
        reduce_bucket_size: zero.bucket,
        zero_reduce_scatter: zero.reduce_scatter,
        zero_overlap_comm: zero.overlap_comm,
        zero3: zero.stage3,
        grad_comm,
        model,
        drop_path_rate,
        data,
        train,
        monitor,
        warnings: cx.warnings,
    })
}

/// The resolved configuration as a DeepSpeed-shaped JSON with every value explicit but
/// `total_num_steps: "auto"` (the run's length, known only to the training loop): written
/// into run directories, and loadable again with [`resolve`] (same world size) to the same
/// `RunConfig`. Each section writes its own keys from its own definitions; the order below
/// is the order `config.json` has always had, so files of older and newer runs compare line
/// by line.
pub fn resolved_json(cfg: &RunConfig) -> Value {
    let mut out = Map::new();
    top_level::write_batch(&cfg.batch, &mut out);
    put(&mut out, &optimizer::OPTIMIZER, optimizer::write(&cfg.optimizer, cfg.layer_decay));
    top_level::write_clipping(cfg.gradient_clipping, &mut out);
    put(&mut out, &zero::ZERO_OPTIMIZATION, zero::write(cfg));
    put(&mut out, &model::MODEL, model::write(&cfg.model, cfg.drop_path_rate));
    put(&mut out, &data::DATA, data::write(&cfg.data));
    put(&mut out, &train::TRAIN, train::write(&cfg.train));
    if let Some(s) = &cfg.scheduler {
        put(&mut out, &scheduler::SCHEDULER, scheduler::write(s));
    }
    top_level::write_grad_comm(&cfg.grad_comm, &mut out);
    precision::write(&cfg.precision, &mut out);
    monitor::write(&cfg.monitor, &mut out);
    Value::Object(out)
}
