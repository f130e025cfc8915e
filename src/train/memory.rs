//! Memory a run needs, estimated from the configuration before anything large is allocated,
//! and the limit it has to fit in. A model or batch that cannot fit is refused with both
//! numbers, instead of an allocation abort or the kernel's OOM killer ending the process
//! without a word.
//!
//! The estimate adds what the engine allocates: the flat parameters, their compute copy and
//! gradients, the optimizer state (sharded as the ZeRO stage shards them, `state_bytes`, the
//! same rule the run's `"memory"` record predicts and accounts against), one pass's activations (`model::Vit`'s saved tensors and
//! gradient scratch, at the larger of the training pass and the evaluation batch), the
//! in-memory dataset and the loader's prepared batches. It is computed in f64, so absurd sizes
//! give a large number rather than an overflow. The limit is, on the CPU, the smaller of the
//! available RAM (`MemAvailable`) and the address space `ulimit -v` leaves; on a GPU, the
//! device memory the driver reports free.

use serde::Serialize;

use crate::backend::{optimizer_state_len, Backend};
use crate::config::{DatasetKind, RunConfig, Stage3Config};
use crate::model::{ModelConfig, Vit};

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes per part of a run, and their sum.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// f32 weights (this rank's shard of them under a ZeRO master shard) and the compute copy.
    pub params: f64,
    pub grads: f64,
    /// This rank's optimizer state (its shard at ZeRO stages 1/2).
    pub optimizer: f64,
    pub activations: f64,
    pub data: f64,
    /// The weight EMA (`train.ema`): its f32 average (as sharded as the master weights) and the
    /// model it is evaluated on (whole weights and compute copy, while evaluating). 0 without.
    pub ema: f64,
    pub total: f64,
    /// The model-state part by kind, in bytes: what `config.json`'s `"memory"` record predicts.
    pub state: MemoryBytes,
}

impl std::fmt::Display for Estimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2} GiB (parameters {:.2}, gradients {:.2}, optimizer state {:.2}, activations {:.2}, data {:.2}{})",
            self.total / GIB,
            self.params / GIB,
            self.grads / GIB,
            self.optimizer / GIB,
            self.activations / GIB,
            self.data / GIB,
            if self.ema > 0.0 { format!(", weight EMA {:.2}", self.ema / GIB) } else { String::new() }
        )
    }
}

/// How much memory there is, and where the number comes from (for the error).
#[derive(Clone, Debug, PartialEq)]
pub struct Limit {
    pub bytes: f64,
    pub what: String,
}

/// Bytes of [f32 weights, compute copy, f32 gradients, optimizer state] one rank holds for
/// `params` parameters at ZeRO stage `stage` of `world` ranks: the optimizer state (`per_param`
/// f32 values per parameter) divided by the world size at stages ≥ 1, and the f32 master
/// weights too where the forward reads a compute copy or at stage 3, and the f32 gradients at
/// stage 3 (partitioned as the weights; below it they are accumulated locally whole). In u128
/// so that absurd configured sizes give a huge number rather than an overflow.
pub fn state_bytes(params: u128, per_param: u128, compute_copy: bool, stage: u8, world: usize) -> [u128; 4] {
    let split = |bytes: u128| if stage >= 1 { bytes.div_ceil(world.max(1) as u128) } else { bytes };
    // (stage 3 adds its resident groups and gather slots: `stage3_extra_elems`)
    let weights = if compute_copy || stage >= 3 { split(4 * params) } else { 4 * params };
    // (at stage 3 no rank keeps a whole compute copy: its resident groups and slots are
    // `stage3_extra_elems`, in the compute dtype)
    // (stage 3 adds the gradient slot: `stage3_extra_elems`)
    let grads = if stage >= 3 { split(4 * params) } else { 4 * params };
    [weights, if compute_copy && stage < 3 { 2 * params } else { 0 }, grads, split(per_param * 4 * params)]
}

/// ZeRO-3's elements beyond the ÷N shares (`model::partition`): [the resident groups'
/// whole weights plus the gather slots, the gradient slot]. The embedding and the head are
/// resident, and the blocks too when they have at most `stage3_param_persistence_threshold`
/// elements; otherwise one slot of a block, two with the prefetch (a block within
/// `stage3_prefetch_bucket_size`, two of them within `stage3_max_live_parameters`). The
/// gradient slot holds the largest group. In f64, as `estimate`.
pub fn stage3_extra_elems(m: &ModelConfig, z: &Stage3Config) -> [f64; 2] {
    let (c, f, k) = (m.embed_dim as f64, m.mlp_hidden() as f64, m.num_classes as f64);
    let n = (m.image_size / m.patch_size.max(1)).pow(2) as f64 + f64::from(u8::from(m.class_token));
    let pd = (m.in_chans * m.patch_size * m.patch_size) as f64;
    let block = 4.0 * c * c + 2.0 * c * f + if m.qkv_bias { 3.0 * c } else { 0.0 } + 2.0 * c + f + 4.0 * c;
    let embed = pd * c + c + n * c + if m.class_token { c } else { 0.0 };
    let head = 2.0 * c + c * k + k;
    let gathered = m.depth > 0 && block > z.param_persistence_threshold as f64;
    let prefetch = block <= z.prefetch_bucket_size as f64 && 2.0 * block <= z.max_live_parameters as f64;
    let (resident, slots) = match gathered {
        true => (embed + head, if prefetch { 2.0 } else { 1.0 } * block),
        false => (embed + head + m.depth as f64 * block, 0.0),
    };
    [resident + slots, embed.max(head).max(if m.depth > 0 { block } else { 0.0 })]
}

/// Bytes a rank holds for the model and its training state, by kind: what the run accounted
/// from its buffers, and what the stage predicts (`predict`). The lab charts memory against
/// stage from these (`config.json`'s `"memory"`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryBytes {
    /// f32 weights: the whole master copy (stage 0, and the CPU at every stage: its forward
    /// reads them, gathered), or this rank's master shard (stages 1/2 with a compute copy).
    pub weights: u64,
    /// The compute-dtype copy the GPU's forward reads (bf16), 0 where the forward reads f32.
    pub compute_copy: u64,
    /// f32 gradients: accumulated locally over the micro-batches, whole, at stages 0–2; at
    /// stage 3 this rank's pieces of them (partitioned as the weights) plus the gradient slot.
    pub gradients: u64,
    pub optimizer_state: u64,
    pub total: u64,
}

impl MemoryBytes {
    fn new(weights: u64, compute_copy: u64, gradients: u64, optimizer_state: u64) -> Self {
        let total = weights.saturating_add(compute_copy).saturating_add(gradients).saturating_add(optimizer_state);
        MemoryBytes { weights, compute_copy, gradients, optimizer_state, total }
    }

    /// What a stage predicts for `params` parameters on `world` ranks (`state_bytes`).
    pub fn predict(params: usize, per_param: usize, compute_copy: bool, stage: u8, world: usize) -> Self {
        let [w, c, g, o] = state_bytes(params as u128, per_param as u128, compute_copy, stage, world).map(|b| u64::try_from(b).unwrap_or(u64::MAX));
        MemoryBytes::new(w, c, g, o)
    }

    /// `estimate`'s f64 parts, saturated to u64.
    fn saturating_from(weights: f64, compute_copy: f64, gradients: f64, optimizer_state: f64) -> Self {
        MemoryBytes::new(weights as u64, compute_copy as u64, gradients as u64, optimizer_state as u64)
    }

    /// What this rank holds: the lengths of its buffers (`master_in_state`: elements of the
    /// state buffer that are this rank's master weights, under a ZeRO master shard).
    pub fn account<B: Backend>(be: &B, vit: &Vit<B>, state: &B::Buf, master_in_state: usize) -> Self {
        // ZeRO-3: its own pieces, the resident groups and the gather slots
        // (on a GPU the resident groups and the slots are bf16 and there is no whole compute copy)
        let p = vit.table.total as u64;
        let copy_whole = if be.needs_compute_copy() { 2 * p } else { 0 };
        let (whole, copy) = match vit.partitioned() {
            Some(part) => part.held_bytes(be, 2),
            None if vit.master_released() => (0, copy_whole),
            None => (4 * be.len(&vit.params) as u64, copy_whole),
        };
        let grad_slot = vit.partitioned().map_or(0, |part| be.len(&part.grad_slot)) as u64;
        let state = (be.len(state) - master_in_state) as u64;
        MemoryBytes::new(whole + 4 * master_in_state as u64, copy, 4 * (be.len(&vit.grads) as u64 + grad_slot), 4 * state)
    }
}

/// The `"memory"` record of a run: per rank, at its stage.
#[derive(Clone, Debug, Serialize)]
pub struct MemoryRecord {
    pub stage: u8,
    pub world_size: usize,
    pub params: usize,
    pub accounted: MemoryBytes,
    pub predicted: MemoryBytes,
    /// Peak bytes the device allocated by the end of the run (GPU), None on the CPU.
    pub measured_peak: Option<u64>,
}

/// Parameter count of `m`, in f64 (no overflow for any configured size).
pub fn param_count(m: &ModelConfig) -> f64 {
    // F as timm truncates it (`int(embed_dim * mlp_ratio)`), as the parameter table has it
    let (c, f, k) = (m.embed_dim as f64, m.mlp_hidden() as f64, m.num_classes as f64);
    let n = (m.image_size / m.patch_size.max(1)).pow(2) as f64 + f64::from(u8::from(m.class_token));
    let pd = (m.in_chans * m.patch_size * m.patch_size) as f64;
    let block = 3.0 * c * c + 3.0 * c + c * c + c + 2.0 * c * f + f + c + 4.0 * c;
    pd * c + c + c + n * c + m.depth as f64 * block + 2.0 * c + c * k + k
}

/// Activation elements (compute dtype) of one pass of `b` images, and its f32 statistics, as
/// `model::Vit` allocates them; `attention_saved` is the backend's saved attention length for
/// one block at this batch.
fn activation_elems(m: &ModelConfig, b: f64, attention_saved: f64, regenerate: bool, checkpointing: bool, no_kept_attention: bool) -> (f64, f64) {
    // F as timm truncates it (`int(embed_dim * mlp_ratio)`), as the parameter table has it
    let (c, f, k) = (m.embed_dim as f64, m.mlp_hidden() as f64, m.num_classes as f64);
    let n = (m.image_size / m.patch_size.max(1)).pow(2) as f64 + f64::from(u8::from(m.class_token));
    let np = (m.image_size / m.patch_size.max(1)).pow(2) as f64;
    let pd = (m.in_chans * m.patch_size * m.patch_size) as f64;
    let bn = b * n;
    // per block: qkv, att, x1, fc1_pre (+ ln1, ln2, fc1_act when kept), and its output; under
    // checkpointing one block's set serves every block and the outputs stay, with each
    // block's attention output and state where the model keeps them
    let kept = if regenerate { 0.0 } else { 2.0 * c + f };
    let block = bn * (3.0 * c + 2.0 * c + f + kept) + attention_saved;
    let sets = if checkpointing { (m.depth as f64).min(1.0) } else { m.depth as f64 };
    let kept_attention = if checkpointing && !no_kept_attention && crate::model::checkpoint_keeps_attention(attention_saved, bn, c, false) {
        m.depth as f64 * (bn * c + attention_saved)
    } else {
        0.0
    };
    let outputs = m.depth as f64 * bn * c + kept_attention;
    let regen = if regenerate { bn * (c + f) } else { 0.0 };
    // embedding, residual and gradient scratch shared by the blocks
    let shared = b * 3.0 * (m.image_size * m.image_size) as f64 + b * np * (pd + 2.0 * c) + bn * (c + 5.0 * c + 3.0 * c + f) + b * (8.0 * c + 2.0 * k);
    let stats = sets * 4.0 * bn + 2.0 * b + 2.0 * b * k;
    (sets * block + outputs + regen + shared, stats)
}

/// The images of one rank's step that the estimate is for (from the run's `Plan`).
#[derive(Clone, Copy, Debug)]
pub struct RankBatch {
    /// The largest micro-batch the rank can be given (the loader's batches in flight).
    pub micro: usize,
    /// Images per forward/backward pass.
    pub pass_images: usize,
    /// Images per evaluation batch (capped as a pass is).
    pub eval_images: usize,
    pub world: usize,
}

/// What the estimate needs to know of the device.
pub struct DeviceMemory<'a> {
    /// Bytes per activation element: 4 (f32 on the CPU), 2 (bf16 on a GPU).
    pub compute_bytes: f64,
    /// The forward reads a narrower compute copy of the weights (GPU): ZeRO then shards the
    /// f32 master weights too.
    pub compute_copy: bool,
    /// Saved attention elements of one block for (b, n, h, d) (`Backend::attention_saved_len`).
    pub attention_saved: &'a dyn Fn(usize, usize, usize, usize) -> usize,
}

/// The estimate for training (or evaluating) `cfg` at `shape` on a device with `dev`'s traits
/// (activation bytes, saved attention, compute copy), with the ZeRO stage's sharding of the
/// state (`state_bytes`), and `regenerate` as the plan resolved it.
pub fn estimate(cfg: &RunConfig, shape: RankBatch, dev: &DeviceMemory<'_>, regenerate: bool, checkpointing: bool) -> Estimate {
    let m = &cfg.model;
    let per_param = optimizer_state_len(&cfg.optimizer, 1) as u128;
    let [shard, copy, grads, optimizer] = state_bytes(param_count(m) as u128, per_param, dev.compute_copy, cfg.zero_stage, shape.world).map(|b| b as f64);
    let [w3, g3] = if cfg.zero_stage >= 3 { stage3_extra_elems(m, &cfg.zero3) } else { [0.0, 0.0] };
    // the resident groups and the slots hold what the forward reads: f32, or the compute copy's dtype
    let (weights, copy) = if dev.compute_copy { (shard, copy + dev.compute_bytes * w3) } else { (shard + 4.0 * w3, copy) };
    let grads = grads + 4.0 * g3;
    let b = shape.pass_images.max(shape.eval_images).max(1);
    let n = (m.image_size / m.patch_size.max(1)).pow(2) + usize::from(m.class_token);
    let h = m.num_heads.max(1);
    // the backend's own count, in f64 to stay exact beyond usize for absurd sizes
    let att = if (b as f64) * (h as f64) * (n as f64) * (n as f64) < 1e15 {
        (dev.attention_saved)(b, n, h, m.embed_dim / h) as f64
    } else {
        b as f64 * h as f64 * n as f64 * n as f64
    };
    // ("blocks_full" keeps no attention output: as under sequence parallelism, the rerun
    // computes the attention again)
    let no_kept_attention = cfg.batch.sequence_parallel_size > 1 || cfg.train.recompute == crate::model::Recompute::BlocksFull;
    let (elems, stats) = activation_elems(m, b as f64, att, regenerate, checkpointing, no_kept_attention);
    // stochastic depth: one branch's output through a scratch, and each image's factors
    let drop_path = if cfg.drop_path_rate > 0.0 { b as f64 * n as f64 * m.embed_dim as f64 * dev.compute_bytes + (2 * m.depth * b) as f64 * 4.0 } else { 0.0 };
    // sequence parallelism: a rank keeps its 1/SP of the tokens' activations and its 1/SP of the
    // heads' attention state (roughly: the patch embedding and the head run whole)
    let sp = cfg.batch.sequence_parallel_size.max(1) as f64;
    let activations = (elems * dev.compute_bytes + stats * 4.0 + drop_path) / sp;
    let d = &cfg.data;
    let pixels = (m.image_size * m.image_size * 3) as f64;
    let stored = match d.dataset {
        DatasetKind::Builtin | DatasetKind::Synthetic => (d.train_size + d.val_size) as f64 * pixels,
        DatasetKind::Cifar10 | DatasetKind::Cifar100 => 60_000.0 * 32.0 * 32.0 * 3.0,
        DatasetKind::Folder | DatasetKind::Shards => 0.0,
    };
    // prepared f32 batches in flight: the prefetch queue, one per worker, the current one
    let in_flight = (d.prefetch + d.num_workers.max(1) + 2) as f64 * shape.micro as f64 * pixels * 4.0;
    let data = stored + in_flight;
    let params = weights + copy;
    let whole = param_count(m) as f64;
    let ema = match cfg.train.ema {
        Some(_) => shard + 4.0 * whole + if dev.compute_copy { dev.compute_bytes * whole } else { 0.0 },
        None => 0.0,
    };
    Estimate {
        params,
        grads,
        optimizer,
        activations,
        data,
        ema,
        total: params + grads + optimizer + activations + data + ema,
        state: MemoryBytes::saturating_from(weights, copy, grads, optimizer),
    }
}

/// The memory this process may still use on the CPU: the smaller of `MemAvailable` and what
/// `ulimit -v` leaves above the current address space (less a reserve for thread stacks and
/// allocator arenas, which count against that limit). None when neither can be read.
pub fn cpu_limit() -> Option<Limit> {
    let mut best: Option<Limit> = None;
    if let Some(avail) = meminfo_kib("MemAvailable:") {
        best = Some(Limit { bytes: avail * 1024.0, what: "available RAM (MemAvailable in /proc/meminfo)".into() });
    }
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we own.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut rl) } == 0;
    if ok && rl.rlim_cur != libc::RLIM_INFINITY {
        let used = status_kib("VmSize:").unwrap_or(0.0) * 1024.0;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let reserve = 256.0 * 1024.0 * 1024.0 + threads * 72.0 * 1024.0 * 1024.0;
        let left = (rl.rlim_cur as f64 - used - reserve).max(0.0);
        if best.as_ref().is_none_or(|b| left < b.bytes) {
            best = Some(Limit { bytes: left, what: format!("the address space `ulimit -v` ({:.2} GiB) leaves", rl.rlim_cur as f64 / GIB) });
        }
    }
    best
}

fn meminfo_kib(field: &str) -> Option<f64> {
    kib_field("/proc/meminfo", field)
}

fn status_kib(field: &str) -> Option<f64> {
    kib_field("/proc/self/status", field)
}

fn kib_field(path: &str, field: &str) -> Option<f64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    line[field.len()..].split_whitespace().next()?.parse().ok()
}

/// Refuses `est` when it exceeds `limit`, naming both and what to lower.
pub fn check(est: &Estimate, limit: &Limit, what: &str) -> Result<(), String> {
    if est.total <= limit.bytes {
        return Ok(());
    }
    Err(format!(
        "{what} needs an estimated {est}, more than the {:.2} GiB of {}; lower train_micro_batch_size_per_gpu or train.pass_images (images per pass), train.eval_batch_size, or the model size (model.embed_dim, model.depth, model.image_size)",
        limit.bytes / GIB,
        limit.what
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parameter count agrees with the parameter table of every preset.
    #[test]
    fn param_count_matches_the_table_of_every_preset() {
        for name in crate::model::spec::PRESET_NAMES {
            let m = ModelConfig::preset(name).expect("preset");
            let t = crate::model::ParamTable::new(&m);
            assert_eq!(param_count(&m), t.total as f64, "{name}");
        }
    }

    /// Stage 3 where the forward reads a bf16 compute copy: no rank keeps a whole copy; its
    /// resident groups and gather slots count 2 bytes a value (in the compute copy's column),
    /// the f32 weights are the rank's P/N, and the gradient slot is f32. Against the
    /// arithmetic of the parameter table's own groups.
    #[test]
    fn stage_3_on_a_gpu_holds_bf16_gathered_weights_and_no_whole_compute_copy() {
        let v = serde_json::json!({"model": {"preset": "vit_base_patch16_224", "num_classes": 10}, "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 8});
        let world = 4;
        let cfg = crate::config::resolve(&v, world).expect("config");
        let att = |b: usize, n: usize, h: usize, _d: usize| b * h * n * n;
        let gpu = DeviceMemory { compute_bytes: 2.0, compute_copy: true, attention_saved: &att };
        let shape = RankBatch { micro: 8, pass_images: 8, eval_images: 1, world };
        let e = estimate(&cfg, shape, &gpu, false, false);
        let t = crate::model::ParamTable::new(&cfg.model);
        let groups = t.gradient_groups();
        // groups: head (+ final norm), blocks last to first, embedding
        let (head, embed, block) = (groups[0].len as u64, groups[groups.len() - 1].len as u64, groups[1].len as u64);
        let p = t.total as u64;
        // ViT-B/16's block exceeds every stage-3 default but fits two within max_live: two slots
        assert_eq!(e.state.compute_copy, 2 * (embed + head + 2 * block));
        assert_eq!(e.state.weights, (4 * p).div_ceil(world as u64));
        // the gradients partitioned as the weights, plus the gradient slot
        assert_eq!(e.state.gradients, (4 * p).div_ceil(world as u64) + 4 * block.max(embed).max(head));
        // the same run on the CPU: the gathered weights are f32 and there is no compute copy
        let cpu = DeviceMemory { compute_bytes: 4.0, compute_copy: false, attention_saved: &att };
        let c = estimate(&cfg, shape, &cpu, false, false);
        assert_eq!((c.state.compute_copy, c.state.weights), (0, (4 * p).div_ceil(world as u64) + 4 * (embed + head + 2 * block)));
        // below stage 3 the GPU keeps the whole bf16 copy
        assert_eq!(MemoryBytes::predict(t.total, 2, true, 2, world).compute_copy, 2 * p);
        assert_eq!(MemoryBytes::predict(t.total, 2, true, 3, world).compute_copy, 0);
    }

    /// Absurd sizes give a finite, huge estimate, not an overflow.
    #[test]
    fn absurd_sizes_estimate_without_overflow() {
        let v = serde_json::json!({"model": {"embed_dim": 1u64 << 40, "num_heads": 1, "depth": 1u64 << 20}, "train_micro_batch_size_per_gpu": 1u64 << 30});
        let cfg = crate::config::resolve(&v, 1).expect("config");
        let att = |b: usize, n: usize, h: usize, _d: usize| b * h * n * n;
        let dev = DeviceMemory { compute_bytes: 4.0, compute_copy: false, attention_saved: &att };
        let shape = RankBatch { micro: cfg.batch.micro_batch_per_gpu, pass_images: cfg.batch.micro_batch_per_gpu, eval_images: 1, world: 1 };
        let e = estimate(&cfg, shape, &dev, false, false);
        assert!(e.total.is_finite() && e.total > 1e20, "{e}");
        let err = check(&e, &Limit { bytes: 8.0 * GIB, what: "test".into() }, "training").unwrap_err();
        assert!(err.contains("8.00 GiB") && err.contains("estimated"), "{err}");
    }
}
