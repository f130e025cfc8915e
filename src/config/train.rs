//! The `train` section (vitscale's own): run length, seed, evaluation, checkpointing and
//! logging, activation memory, and how the global batch is split over the ranks.

use serde_json::{json, Map, Value};

use super::key_def::*;
use super::types::*;
use super::value::*;
use crate::model::Recompute;

pub(super) const TRAIN: KeyDef = key("train", Ty::Section, Dflt::Derived("10 epochs"), "Run length, seed, evaluation and logging.");

// A resume continues the trajectory of the seed, the label smoothing and the decay kinds;
// every other key here sets the run's length, how often it evaluates, logs and checkpoints,
// or how the same global batch is computed and split (which leaves the reduced gradient as
// it was: tests/balance.rs), so a resume may change it.

const SKIP_KINDS: &[&str] = &["bias", "norm", "pos_embed", "cls_token"];
const T_EPOCHS: KeyDef = key("epochs", POS_INT, Dflt::Int(10), "Run length in epochs (ignored when steps is set).")
    .resume_free();
pub(super) const T_STEPS: KeyDef = key("steps", POS_INT, Dflt::Unset, "Run length in optimizer steps; wins over epochs.")
    .resume_free();
const T_SEED: KeyDef = key("seed", NONNEG_INT, Dflt::Int(0), "Seed for initialization, shuffling and augmentation.");
const T_RECOMPUTE: KeyDef = key("recompute", Ty::Choice(Recompute::NAMES), Dflt::Derived("\"blocks\" when the activation_checkpointing block is given, else \"auto\""),
    "Activation memory: \"always\" regenerates every block's LayerNorm and GELU outputs in the backward instead of keeping them (saves 2·C + F values per token and block), \"never\" keeps them, \"auto\" regenerates only where the backend says it is nearly free (small batches on a GPU; never on the CPU); \"blocks\" checkpoints every block (keeps its output and runs its forward again in the backward, up to fc2's input: one block's activations held at a time; where the attention's saved state is no larger than its output, as with the GPU's fused attention, each block also keeps its attention output and the recompute skips the attention core; the same gradients); \"blocks_full\" checkpoints every block keeping its output alone, the attention core recomputed too (least memory).")
    .resume_free();
const T_EVAL_EVERY: KeyDef = key("eval_every", NONNEG_INT, Dflt::Int(0), "Evaluate every N optimizer steps; 0 = at the end of each epoch.")
    .resume_free();
const T_CKPT_EVERY: KeyDef = key("checkpoint_every", NONNEG_INT, Dflt::Int(0), "Checkpoint every N optimizer steps; 0 = never.")
    .resume_free();
const T_SMOOTHING: KeyDef = key("label_smoothing", UNIT_HALF_OPEN, Dflt::Num(0.0), "Label smoothing of the cross-entropy targets.");
const T_DECAY_SKIP: KeyDef = key("weight_decay_skip", Ty::StrList(SKIP_KINDS), Dflt::StrList(SKIP_KINDS), "Parameter kinds without weight decay; [] decays everything.");
pub(super) const T_LOG_EVERY: KeyDef = key("log_every", POS_INT, Dflt::Derived("steps_per_print (10)"), "Log a metrics line every N optimizer steps.")
    .resume_free();
pub(super) const T_PASS_IMAGES: KeyDef = key(
    "pass_images",
    POS_INT,
    Dflt::Derived("512"),
    "Most images one forward/backward pass takes: a larger micro-batch runs as several passes whose gradients add up (the same result with bounded activation memory).",
)
.resume_free();
pub(super) const T_EVAL_BATCH: KeyDef = key("eval_batch_size", POS_INT, Dflt::Derived("train_micro_batch_size_per_gpu"), "Evaluation batch size.")
    .resume_free();
const T_CKPT_ON_SIGNAL: KeyDef = key(
    "checkpoint_on_signal",
    Ty::Bool,
    Dflt::Derived("true when checkpoint_every > 0, else false"),
    "On SIGINT/SIGTERM, finish the current optimizer step on every rank, write a checkpoint of it (rank 0) and exit with 130/143; false = the signal ends the process at once.",
)
.resume_free();
const T_COMM_TIMEOUT: KeyDef = key(
    "comm_timeout_s",
    POSITIVE,
    Dflt::Num(300.0),
    "Seconds the rendezvous and each collective wait for the other ranks before failing with an error naming the missing rank(s); the variables VITSCALE_RENDEZVOUS_TIMEOUT (rendezvous) and VITSCALE_COMM_TIMEOUT (collectives) override it.",
)
.resume_free();
pub(super) const T_SLOWDOWN: KeyDef = key(
    "emulate_slowdown",
    Ty::Section,
    Dflt::Unset,
    "Straggler emulation: {\"<rank>\": factor, …} with factor >= 1 makes that rank take factor × its measured compute time per micro-batch, as a slower device would (docs/balance.md says how).",
)
.resume_free();
const BALANCE_CHOICES: &[&str] = &["off", "auto"];
pub(super) const T_BALANCE: KeyDef = key(
    "balance",
    Ty::Choice(BALANCE_CHOICES),
    Dflt::Str("off"),
    "Split of the global batch over the ranks: \"off\" = equal micro-batches; [s0, s1, …] = one positive share per rank, micro-batches proportional to them; \"auto\" = proportional to each rank's measured speed, re-estimated every train.balance_every steps. The global batch, its loss and its gradient stay those of the equal split; every rank gets at least one image per micro-batch (two when mixing).",
)
.resume_free();
const T_BALANCE_EVERY: KeyDef = key("balance_every", POS_INT, Dflt::Int(5), "Under train.balance = \"auto\": steps of measured compute time between re-estimates of the shares.")
    .resume_free();
pub(super) const T_EMA: KeyDef = key("ema", Ty::Section, Dflt::Unset,
    "An exponential moving average of the weights, as timm's ModelEmaV3 (--model-ema): updated after every optimizer step, evaluated beside the weights (ema_val_loss, ema_val_top1), saved in checkpoints and beside --save-weights (NAME_ema.safetensors). {} turns it on with the defaults below.");
const EMA_ENABLED: KeyDef = key("enabled", Ty::Bool, Dflt::Bool(true), "false turns the average off.");
const EMA_DECAY: KeyDef = key("decay", Ty::Num { lo: 0.0, hi: 1.0, lo_open: false, hi_open: true }, Dflt::Num(0.9998), "Decay per step (timm's --model-ema-decay default).");
const EMA_MIN_DECAY: KeyDef = key("min_decay", Ty::Num { lo: 0.0, hi: 1.0, lo_open: false, hi_open: true }, Dflt::Num(0.0), "Lower bound of the warm-up's decay.");
const EMA_AFTER: KeyDef = key("update_after_step", NONNEG_INT, Dflt::Int(0), "Optimizer steps after the first during which the average copies the weights.");
const EMA_WARMUP: KeyDef = key("warmup", Ty::Bool, Dflt::Bool(false), "Warm-up: decay 1 − (1 + t/warmup_gamma)^−warmup_power at the t-th step after the first, capped at decay (timm's use_warmup, --model-ema-warmup).");
const EMA_GAMMA: KeyDef = key("warmup_gamma", POSITIVE, Dflt::Num(1.0), "The warm-up's γ.");
const EMA_POWER: KeyDef = key("warmup_power", POSITIVE, Dflt::Num(2.0 / 3.0), "The warm-up's power.");
/// Keys of `train.ema`.
pub const EMA_KEYS: &[KeyDef] = &[EMA_ENABLED, EMA_DECAY, EMA_MIN_DECAY, EMA_AFTER, EMA_WARMUP, EMA_GAMMA, EMA_POWER];
/// Keys of the `train` section.
pub const TRAIN_KEYS: &[KeyDef] = &[
    T_EPOCHS, T_STEPS, T_SEED, T_RECOMPUTE, T_PASS_IMAGES, T_EVAL_EVERY, T_CKPT_EVERY, T_SMOOTHING, T_DECAY_SKIP, T_LOG_EVERY, T_EVAL_BATCH, T_CKPT_ON_SIGNAL, T_COMM_TIMEOUT,
    T_SLOWDOWN, T_BALANCE, T_BALANCE_EVERY, T_EMA,
];

/// `train.ema`: None when absent, null or `enabled: false`.
fn parse_ema(sec: Option<&Map<String, Value>>, cx: &mut Cx) -> Result<Option<EmaConfig>> {
    let p = full(TRAIN.name, T_EMA.name);
    let Some(e) = section(sec.and_then(|s| s.get(T_EMA.name)), &p)? else { return Ok(None) };
    check_keys(&p, e, EMA_KEYS, &[])?;
    let e = Some(e);
    if !get_bool(e, &p, &EMA_ENABLED, cx)? {
        return Ok(None);
    }
    Ok(Some(EmaConfig {
        decay: get_num(e, &p, &EMA_DECAY, cx)?,
        min_decay: get_num(e, &p, &EMA_MIN_DECAY, cx)?,
        update_after_step: get_int(e, &p, &EMA_AFTER, cx)?,
        warmup: get_bool(e, &p, &EMA_WARMUP, cx)?,
        warmup_gamma: get_num(e, &p, &EMA_GAMMA, cx)?,
        warmup_power: get_num(e, &p, &EMA_POWER, cx)?,
    }))
}

/// `train.ema` as resolved (absent when off).
fn write_ema(e: &EmaConfig) -> Value {
    let mut out = Map::new();
    put(&mut out, &EMA_DECAY, json!(e.decay));
    put(&mut out, &EMA_MIN_DECAY, json!(e.min_decay));
    put(&mut out, &EMA_AFTER, json!(e.update_after_step));
    put(&mut out, &EMA_WARMUP, json!(e.warmup));
    put(&mut out, &EMA_GAMMA, json!(e.warmup_gamma));
    put(&mut out, &EMA_POWER, json!(e.warmup_power));
    Value::Object(out)
}

/// The `train` section; `log_every` defaults to DeepSpeed's `steps_per_print`, the evaluation
/// batch to the micro-batch, and the rank lists are checked against the world size.
/// DeepSpeed's `activation_checkpointing` block: given (an object), it turns on checkpointing
/// per block (`train.recompute = "blocks"` unless that key says otherwise). What vitscale does
/// not implement of it is warned by name.
pub(super) const ACTIVATION_CHECKPOINTING: KeyDef = key("activation_checkpointing", Ty::Section, Dflt::Unset,
    "DeepSpeed's activation checkpointing block: given, every transformer block is checkpointed (train.recompute = \"blocks\" unless train.recompute is given).");
/// Keys of the `activation_checkpointing` block.
pub const ACTIVATION_CHECKPOINTING_KEYS: &[KeyDef] = &[
    ds_warn("partition_activations", Dflt::Bool(false), "Shard the checkpoints over model-parallel ranks; not implemented (vitscale has no model parallelism)."),
    ds_warn("cpu_checkpointing", Dflt::Bool(false), "Keep the checkpoints in host memory; not implemented."),
    ds_warn("contiguous_memory_optimization", Dflt::Bool(false), "Copy checkpoints into one buffer; vitscale's block outputs are preallocated buffers already: no effect."),
    ds_warn("number_checkpoints", Dflt::Unset, "Checkpoints for the contiguous buffer; every block is checkpointed."),
    ds_warn("synchronize_checkpoint_boundary", Dflt::Bool(false), "Synchronize the device at each checkpoint; not implemented."),
    ds_warn("profile", Dflt::Bool(false), "Time the checkpoint functions; not implemented (train --trace shows the passes)."),
];

/// Whether `root` has an `activation_checkpointing` block; warns for each of its keys set
/// to something vitscale does not do.
pub(super) fn parse_activation_checkpointing(root: &Map<String, Value>, cx: &mut Cx) -> Result<bool> {
    let p = ACTIVATION_CHECKPOINTING.name;
    let Some(block) = section(root.get(p), p)? else { return Ok(false) };
    check_keys(p, block, ACTIVATION_CHECKPOINTING_KEYS, &[])?;
    for def in ACTIVATION_CHECKPOINTING_KEYS {
        let Some(v) = block.get(def.name).filter(|v| !v.is_null()) else { continue };
        if v != &Value::Bool(false) {
            cx.warn(format!("{}: {} (checkpointing runs per block without it)", full(p, def.name), def.doc));
        }
    }
    Ok(true)
}

/// The `train` section; `checkpointing`: DeepSpeed's `activation_checkpointing` block is given.
pub(super) fn parse(sec: Option<&Map<String, Value>>, batch: &BatchConfig, steps_per_print: u64, checkpointing: bool, cx: &mut Cx) -> Result<TrainConfig> {
    let p = TRAIN.name;
    if let Some(s) = sec {
        check_keys(p, s, TRAIN_KEYS, &[])?;
    }
    let skip = match given(sec, p, &T_DECAY_SKIP, cx) {
        None => SKIP_KINDS.to_vec(),
        Some(v) => {
            let arr = v.as_array().ok_or_else(|| bad(p, &T_DECAY_SKIP, v))?;
            let mut out = Vec::new();
            for item in arr {
                let s = item.as_str().filter(|s| SKIP_KINDS.contains(s)).ok_or_else(|| {
                    key_err(full(p, T_DECAY_SKIP.name), format!("unknown entry {}; expected entries from {}", kind_of(item), quoted(SKIP_KINDS)))
                })?;
                if out.contains(&s) {
                    return Err(key_err(full(p, T_DECAY_SKIP.name), format!("\"{s}\" is listed twice")));
                }
                out.push(s);
            }
            out
        }
    };
    let checkpoint_every = get_int(sec, p, &T_CKPT_EVERY, cx)?;
    Ok(TrainConfig {
        epochs: get_int(sec, p, &T_EPOCHS, cx)? as usize,
        steps: opt_int(sec, p, &T_STEPS, cx)?,
        seed: get_int(sec, p, &T_SEED, cx)?,
        eval_every: get_int(sec, p, &T_EVAL_EVERY, cx)?,
        checkpoint_every,
        label_smoothing: get_num(sec, p, &T_SMOOTHING, cx)? as f32,
        weight_decay_skip: DecaySkip {
            bias: skip.contains(&"bias"),
            norm: skip.contains(&"norm"),
            pos_embed: skip.contains(&"pos_embed"),
            cls_token: skip.contains(&"cls_token"),
        },
        log_every: opt_int(sec, p, &T_LOG_EVERY, cx)?.unwrap_or(steps_per_print),
        eval_batch_size: opt_int(sec, p, &T_EVAL_BATCH, cx)?.map(|i| i as usize).unwrap_or(batch.micro_batch_per_gpu),
        checkpoint_on_signal: opt_bool(sec, p, &T_CKPT_ON_SIGNAL, cx)?.unwrap_or(checkpoint_every > 0),
        comm_timeout_s: get_num(sec, p, &T_COMM_TIMEOUT, cx)?,
        recompute: match given(sec, p, &T_RECOMPUTE, cx) {
            Some(_) => Recompute::parse(get_str(sec, p, &T_RECOMPUTE, cx)?).unwrap_or_default(),
            None if checkpointing => Recompute::Blocks,
            None => Recompute::Auto,
        },
        pass_images: opt_int(sec, p, &T_PASS_IMAGES, cx)?.map(|i| i as usize),
        emulate_slowdown: parse_slowdown(sec, p, batch.ranks())?,
        balance: parse_balance(sec, p, batch.world_size, cx)?,
        balance_every: get_int(sec, p, &T_BALANCE_EVERY, cx)?,
        ema: parse_ema(sec, cx)?,
    })
}

/// `train.emulate_slowdown`: an object of rank (decimal string) → factor >= 1, ranks below
/// the world size.
fn parse_slowdown(sec: Option<&Map<String, Value>>, p: &str, world: usize) -> Result<Vec<(usize, f64)>> {
    let name = full(p, T_SLOWDOWN.name);
    let Some(v) = sec.and_then(|s| s.get(T_SLOWDOWN.name)).filter(|v| !v.is_null()) else { return Ok(Vec::new()) };
    let obj = v.as_object().ok_or_else(|| key_err(&name, format!("expected an object {{\"<rank>\": factor}}, got {}", kind_of(v))))?;
    let mut out = Vec::new();
    for (k, f) in obj {
        let rank: usize = k.parse().map_err(|_| key_err(&name, format!("\"{k}\" is not a rank; expected a decimal rank such as \"1\"")))?;
        if rank >= world {
            return Err(key_err(&name, format!("rank {rank} does not exist: the job has {world} rank(s), 0..{}", world.saturating_sub(1))));
        }
        let factor = f.as_f64().filter(|x| x.is_finite() && *x >= 1.0).ok_or_else(|| {
            key_err(&name, format!("rank {rank}: expected a factor >= 1 (how many times slower), got {}", kind_of(f)))
        })?;
        out.push((rank, factor));
    }
    out.sort_by_key(|&(r, _)| r);
    Ok(out)
}

/// `train.balance`: "off", "auto" or one positive share per rank.
fn parse_balance(sec: Option<&Map<String, Value>>, p: &str, world: usize, cx: &mut Cx) -> Result<Balance> {
    let name = full(p, T_BALANCE.name);
    let expected = || format!("expected \"off\", \"auto\" or a list of {world} positive shares (one per rank)");
    match sec.and_then(|s| s.get(T_BALANCE.name)).filter(|v| !v.is_null()) {
        None => Ok(Balance::Off),
        Some(Value::Array(items)) => {
            if items.len() != world {
                return Err(key_err(&name, format!("{} shares for {world} rank(s); {}", items.len(), expected())));
            }
            let shares = items
                .iter()
                .enumerate()
                .map(|(r, x)| x.as_f64().filter(|x| x.is_finite() && *x > 0.0).ok_or_else(|| key_err(&name, format!("share of rank {r}: {}, got {}", expected(), kind_of(x)))))
                .collect::<Result<Vec<f64>>>()?;
            Ok(Balance::Shares(shares))
        }
        Some(v) => match get_str(sec, p, &T_BALANCE, cx).map_err(|_| key_err(&name, format!("{}, got {}", expected(), kind_of(v))))? {
            "auto" => Ok(Balance::Auto),
            "off" => Ok(Balance::Off),
            other => Err(key_err(&name, format!("{}, got \"{other}\"", expected()))),
        },
    }
}

/// Every option as resolved (derived defaults written out); `pass_images` and `steps` only
/// when given, as absent has a meaning of its own (the default pass size, the epochs).
pub(super) fn write(t: &TrainConfig) -> Value {
    let mut out = Map::new();
    put(&mut out, &T_EPOCHS, json!(t.epochs));
    put(&mut out, &T_SEED, json!(t.seed));
    put(&mut out, &T_EVAL_EVERY, json!(t.eval_every));
    put(&mut out, &T_CKPT_EVERY, json!(t.checkpoint_every));
    put(&mut out, &T_SMOOTHING, json!(t.label_smoothing));
    let skipped = |kind: &str| match kind {
        "bias" => t.weight_decay_skip.bias,
        "norm" => t.weight_decay_skip.norm,
        "pos_embed" => t.weight_decay_skip.pos_embed,
        _ => t.weight_decay_skip.cls_token,
    };
    put(&mut out, &T_DECAY_SKIP, json!(SKIP_KINDS.iter().copied().filter(|k| skipped(k)).collect::<Vec<_>>()));
    put(&mut out, &T_LOG_EVERY, json!(t.log_every));
    put(&mut out, &T_EVAL_BATCH, json!(t.eval_batch_size));
    put(&mut out, &T_CKPT_ON_SIGNAL, json!(t.checkpoint_on_signal));
    put(&mut out, &T_COMM_TIMEOUT, json!(t.comm_timeout_s));
    put(&mut out, &T_RECOMPUTE, json!(t.recompute.as_str()));
    let slowdown: Map<String, Value> = t.emulate_slowdown.iter().map(|(r, f)| (r.to_string(), json!(f))).collect();
    put(&mut out, &T_SLOWDOWN, Value::Object(slowdown));
    let balance = match &t.balance {
        Balance::Off => json!("off"),
        Balance::Auto => json!("auto"),
        Balance::Shares(s) => json!(s),
    };
    put(&mut out, &T_BALANCE, balance);
    put(&mut out, &T_BALANCE_EVERY, json!(t.balance_every));
    if let Some(n) = t.pass_images {
        put(&mut out, &T_PASS_IMAGES, json!(n));
    }
    if let Some(steps) = t.steps {
        put(&mut out, &T_STEPS, json!(steps));
    }
    if let Some(e) = &t.ema {
        put(&mut out, &T_EMA, write_ema(e));
    }
    Value::Object(out)
}
