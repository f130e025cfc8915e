//! Memory a run needs, estimated from the configuration before anything large is allocated,
//! and the limit it has to fit in. A model or batch that cannot fit is refused with both
//! numbers, instead of an allocation abort or the kernel's OOM killer ending the process
//! without a word.
//!
//! The estimate adds what the engine allocates: the flat parameters, their compute copy and
//! gradients, the optimizer state, one pass's activations (`model::Vit`'s saved tensors and
//! gradient scratch, at the larger of the training pass and the evaluation batch), the
//! in-memory dataset and the loader's prepared batches. It is computed in f64, so absurd sizes
//! give a large number rather than an overflow. The limit is, on the CPU, the smaller of the
//! available RAM (`MemAvailable`) and the address space `ulimit -v` leaves; on a GPU, the
//! device memory the driver reports free.

use crate::config::{DatasetKind, OptimizerConfig, RunConfig};
use crate::model::ModelConfig;
use crate::train::plan;

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes per part of a run, and their sum.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    pub params: f64,
    pub grads: f64,
    pub optimizer: f64,
    pub activations: f64,
    pub data: f64,
    pub total: f64,
}

impl std::fmt::Display for Estimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2} GiB (parameters {:.2}, gradients {:.2}, optimizer state {:.2}, activations {:.2}, data {:.2})",
            self.total / GIB,
            self.params / GIB,
            self.grads / GIB,
            self.optimizer / GIB,
            self.activations / GIB,
            self.data / GIB
        )
    }
}

/// How much memory there is, and where the number comes from (for the error).
#[derive(Clone, Debug, PartialEq)]
pub struct Limit {
    pub bytes: f64,
    pub what: String,
}

/// Parameter count of `m`, in f64 (no overflow for any configured size).
pub fn param_count(m: &ModelConfig) -> f64 {
    let (c, f, k) = (m.embed_dim as f64, m.embed_dim as f64 * m.mlp_ratio, m.num_classes as f64);
    let n = (m.image_size / m.patch_size.max(1)).pow(2) as f64 + f64::from(u8::from(m.class_token));
    let pd = (m.in_chans * m.patch_size * m.patch_size) as f64;
    let block = 3.0 * c * c + 3.0 * c + c * c + c + 2.0 * c * f + f + c + 4.0 * c;
    pd * c + c + c + n * c + m.depth as f64 * block + 2.0 * c + c * k + k
}

/// Activation elements (compute dtype) of one pass of `b` images, and its f32 statistics, as
/// `model::Vit` allocates them; `attention_saved` is the backend's saved attention length for
/// one block at this batch.
fn activation_elems(m: &ModelConfig, b: f64, attention_saved: f64, regenerate: bool) -> (f64, f64) {
    let (c, f, k) = (m.embed_dim as f64, m.embed_dim as f64 * m.mlp_ratio, m.num_classes as f64);
    let n = (m.image_size / m.patch_size.max(1)).pow(2) as f64 + f64::from(u8::from(m.class_token));
    let np = (m.image_size / m.patch_size.max(1)).pow(2) as f64;
    let pd = (m.in_chans * m.patch_size * m.patch_size) as f64;
    let bn = b * n;
    // per block: qkv, att, x1, x2, fc1_pre (+ ln1, ln2, fc1_act when kept)
    let kept = if regenerate { 0.0 } else { 2.0 * c + f };
    let block = bn * (3.0 * c + 3.0 * c + f + kept) + attention_saved;
    let regen = if regenerate { bn * (c + f) } else { 0.0 };
    // embedding, residual and gradient scratch shared by the blocks
    let shared = b * 3.0 * (m.image_size * m.image_size) as f64 + b * np * (pd + 2.0 * c) + bn * (c + 5.0 * c + 3.0 * c + f) + b * (8.0 * c + 2.0 * k);
    let stats = m.depth as f64 * 4.0 * bn + 2.0 * b + 2.0 * b * k;
    (m.depth as f64 * block + regen + shared, stats)
}

/// The estimate for training (or evaluating) `cfg` with `compute_bytes` per activation
/// element (4 on the CPU, 2 for bf16 on a GPU) and `attention_saved(b, n, h, d)`, the
/// backend's saved attention elements per block.
pub fn estimate(cfg: &RunConfig, compute_bytes: f64, attention_saved: impl Fn(usize, usize, usize, usize) -> usize, regenerate: bool) -> Estimate {
    let m = &cfg.model;
    let p = param_count(m);
    // f32 master copy, plus the compute copy where it is narrower
    let params = p * 4.0 + if compute_bytes < 4.0 { p * compute_bytes } else { 0.0 };
    let grads = p * 4.0;
    let optimizer = p * 4.0
        * match &cfg.optimizer {
            OptimizerConfig::Adam { .. } => 2.0,
            OptimizerConfig::Sgd { momentum, .. } if *momentum > 0.0 => 1.0,
            OptimizerConfig::Sgd { .. } => 0.0,
        };
    let cap = plan::pass_images_cap(cfg.train.pass_images);
    let b = cfg.batch.micro_batch_per_gpu.min(cap).max(cfg.train.eval_batch_size.min(cap)).max(1);
    let n = (m.image_size / m.patch_size.max(1)).pow(2) + usize::from(m.class_token);
    let h = m.num_heads.max(1);
    // the backend's own count, in f64 to stay exact beyond usize for absurd sizes
    let att = if (b as f64) * (h as f64) * (n as f64) * (n as f64) < 1e15 {
        attention_saved(b, n, h, m.embed_dim / h) as f64
    } else {
        b as f64 * h as f64 * n as f64 * n as f64
    };
    let (elems, stats) = activation_elems(m, b as f64, att, regenerate);
    let activations = elems * compute_bytes + stats * 4.0;
    let d = &cfg.data;
    let pixels = (m.image_size * m.image_size * 3) as f64;
    let stored = match d.dataset {
        DatasetKind::Builtin | DatasetKind::Synthetic => (d.train_size + d.val_size) as f64 * pixels,
        DatasetKind::Cifar10 | DatasetKind::Cifar100 => 60_000.0 * 32.0 * 32.0 * 3.0,
        DatasetKind::Folder => 0.0,
    };
    // prepared f32 batches in flight: the prefetch queue, one per worker, the current one
    let in_flight = (d.prefetch + d.num_workers.max(1) + 2) as f64 * cfg.batch.micro_batch_per_gpu as f64 * pixels * 4.0;
    let data = stored + in_flight;
    Estimate { params, grads, optimizer, activations, data, total: params + grads + optimizer + activations + data }
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

    /// Absurd sizes give a finite, huge estimate, not an overflow.
    #[test]
    fn absurd_sizes_estimate_without_overflow() {
        let v = serde_json::json!({"model": {"embed_dim": 1u64 << 40, "num_heads": 1, "depth": 1u64 << 20}, "train_micro_batch_size_per_gpu": 1u64 << 30});
        let cfg = crate::config::resolve(&v, 1).expect("config");
        let e = estimate(&cfg, 4.0, |b, n, h, _| b * h * n * n, false);
        assert!(e.total.is_finite() && e.total > 1e20, "{e}");
        let err = check(&e, &Limit { bytes: 8.0 * GIB, what: "test".into() }, "training").unwrap_err();
        assert!(err.contains("8.00 GiB") && err.contains("estimated"), "{err}");
    }
}
