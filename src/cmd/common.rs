//! What the commands share: the run-configuration flags (`ConfigArgs`, `--device`), loading
//! the configuration (`load_config`), opening the device (`open_device`), the warnings for
//! settings a device does not honour, and the configuration hash ranks compare.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};

use crate::backend::cpu::Cpu;
use crate::backend::cuda::{self, Cuda};
use crate::config::{self, RunConfig};
use crate::model::weights;

/// `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// A GPU when one is usable, else the CPU (with a notice).
    Auto,
    Cpu,
    Cuda,
}

/// Options shared by commands that take a run configuration.
#[derive(Args, Debug, Clone)]
pub struct ConfigArgs {
    /// DeepSpeed JSON config plus `model` / `data` / `train` sections.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one key: `--set key.path=JSON` (repeatable), e.g. `--set data.mean=[0.5,0.5,0.5]`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    #[arg(long, value_enum, default_value = "auto")]
    pub device: DeviceArg,
    /// Print one machine-readable JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

/// Loads the run configuration. With a weights file, architecture fields the config does not
/// give are read off the file's shapes (a named `model.preset` is kept as is and checked
/// against the file when the weights load).
pub fn load_config(args: &ConfigArgs, weights_path: Option<&Path>, world_size: usize) -> anyhow::Result<RunConfig> {
    load_config_edited(args, weights_path, world_size, |_| Ok(Vec::new()))
}

/// As [`load_config`], with `edit` applied to the JSON (after `--set`, before resolving); the
/// notes it returns join the warnings.
pub fn load_config_edited(
    args: &ConfigArgs,
    weights_path: Option<&Path>,
    world_size: usize,
    edit: impl FnOnce(&mut serde_json::Value) -> anyhow::Result<Vec<String>>,
) -> anyhow::Result<RunConfig> {
    let mut value = config::load_json(args.config.as_deref(), &args.sets)?;
    let mut notes = edit(&mut value)?;
    let mut classes_from_weights: Option<(std::path::PathBuf, u64)> = None;
    if let Some(path) = weights_path {
        let inferred = weights::infer(path)?;
        let root = value.as_object_mut().ok_or_else(|| anyhow::anyhow!("the config must be a JSON object"))?;
        let model = root.entry("model").or_insert_with(|| serde_json::json!({}));
        let model = model.as_object_mut().ok_or_else(|| anyhow::anyhow!("`model` must be a JSON object"))?;
        if !model.contains_key("preset") {
            if !model.contains_key("num_classes") {
                classes_from_weights = inferred.fields.get("num_classes").and_then(|v| v.as_u64()).map(|k| (path.to_path_buf(), k));
            }
            for (k, v) in inferred.fields {
                model.entry(k).or_insert(v);
            }
            if !model.contains_key("num_heads") {
                if let Some(h) = inferred.num_heads {
                    model.insert("num_heads".into(), h.into());
                }
            }
            if !model.contains_key("num_heads") {
                match inferred.guessed_num_heads {
                    Some(h) => {
                        model.insert("num_heads".into(), h.into());
                        let c = model.get("embed_dim").and_then(|v| v.as_u64()).unwrap_or(0) as usize;
                        notes.push(format!("model.num_heads not given: using {h} (head width {}, as timm's ViTs of width {c} have it); set it if the weights use another", c / h.max(1)));
                    }
                    None => anyhow::bail!(
                        "{}: model.num_heads cannot be read from the weights (width {} is not a multiple of 64 nor a known timm width); give it with --set model.num_heads=H",
                        path.display(),
                        model.get("embed_dim").map(|v| v.to_string()).unwrap_or_default()
                    ),
                }
            }
        }
    }
    default_folder_classes(&mut value)?;
    let resolved = config::resolve(&value, world_size);
    let mut cfg = match (resolved, classes_from_weights) {
        (Err(e), Some((path, k))) if e.to_string().contains("model.num_classes") => {
            // The class count was read from the weights, not written by the user: say so.
            return Err(anyhow::Error::new(e).context(format!(
                "{}: the weights' head has {k} outputs, so model.num_classes was read as {k} from them",
                path.display()
            )));
        }
        (r, _) => r?,
    };
    cfg.warnings.extend(notes);
    Ok(cfg)
}

/// For an image-folder dataset whose config (and weights) leave `model.num_classes` out, the
/// class count is the number of class subfolders, as a user of timm's ImageFolder expects
/// (for shards, the classes their index lists).
fn default_folder_classes(value: &mut serde_json::Value) -> anyhow::Result<()> {
    let dataset = value["data"]["dataset"].as_str();
    if !matches!(dataset, Some("folder" | "shards")) || !value["model"]["num_classes"].is_null() {
        return Ok(());
    }
    let shards = dataset == Some("shards");
    let Some(path) = value["data"]["path"].as_str().map(str::to_string) else {
        return Ok(()); // the config check reports the missing data.path
    };
    let classes = if shards { crate::data::shards::class_names(Path::new(&path))? } else { crate::data::folder::class_names(Path::new(&path))? };
    if classes.is_empty() {
        return Ok(()); // opening the dataset names the empty folder
    }
    let root = value.as_object_mut().ok_or_else(|| anyhow::anyhow!("the config must be a JSON object"))?;
    let model = root.entry("model").or_insert_with(|| serde_json::json!({}));
    if let Some(model) = model.as_object_mut() {
        model.insert("num_classes".into(), classes.len().into());
        // documented usage, not a warning: say once (rank 0) what was taken
        if std::env::var("RANK").map_or(true, |r| r.trim() == "0") {
            let what = if shards { crate::util::plural(classes.len(), "class", "classes") } else { crate::util::plural(classes.len(), "class folder", "class folders") };
            eprintln!("notice: model.num_classes from the data: {what} in {path}");
        }
    }
    Ok(())
}

/// Settings the configuration accepts but the chosen device does not honour (yet), or honours
/// only slowly: each becomes a warning, never a silent no-op.
pub fn engine_warnings(cfg: &RunConfig, device: &Device) -> Vec<String> {
    let mut w = Vec::new();
    match (&cfg.precision, device) {
        (config::Precision::Bf16, Device::Cuda(_)) => {}
        (config::Precision::Fp32, Device::Cpu(_)) => {}
        // before Ampere the backend chose fp16 and said so in a notice when it opened
        (config::Precision::Fp32, Device::Cuda(be)) if crate::backend::Backend::implicit_fp16(be) => {}
        (config::Precision::Fp32, Device::Cuda(_)) => w.push(
            "no bf16/fp16 block: the CUDA backend computes in bf16 with f32 master weights, optimizer state and gradient accumulation (f32 compute is CPU-only)".into(),
        ),
        (config::Precision::Fp16 { .. }, Device::Cuda(_)) => {}
        (config::Precision::Bf16, Device::Cpu(_)) => w.push("bf16.enabled: the CPU backend computes in f32; bf16 applies on GPUs".into()),
        (config::Precision::Fp16 { .. }, Device::Cpu(_)) => {
            w.push("fp16.enabled: the CPU backend computes in f32 (fp16 compute needs a GPU); DeepSpeed's loss scaling still runs: the loss gradient is scaled, overflowing steps are skipped and the scale adapts".into())
        }
    }
    if let Device::Cuda(be) = device {
        w.extend(be.slower_paths());
        if cfg.data.decode == config::Decode::Gpu {
            let queues = std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok();
            w.extend(crate::backend::cuda::libs::hardware_queue_warning(queues.as_deref()));
        }
    }
    w
}

/// Checks that a file can be written at `path` before any work is done (`flag` names the
/// option): not a directory, its folder exists (or can be created) and is writable. The
/// work's result is never lost to a bad path at the end.
pub fn check_output_file(path: &Path, flag: &str) -> anyhow::Result<()> {
    if path.is_dir() {
        anyhow::bail!("{flag} {}: is a directory; give a file path (e.g. {}/model.safetensors)", path.display(), path.display());
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    check_writable_dir(&dir, flag, path)
}

/// Checks that `dir` exists or can be created, and that a file can be created in it.
pub fn check_writable_dir(dir: &Path, flag: &str, shown: &Path) -> anyhow::Result<()> {
    if dir.exists() && !dir.is_dir() {
        anyhow::bail!("{flag} {}: {} is not a directory", shown.display(), dir.display());
    }
    std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("{flag} {}: cannot create the folder {}: {e}", shown.display(), dir.display()))?;
    let probe = dir.join(format!(".vitscale-write-check-{}", std::process::id()));
    std::fs::write(&probe, b"").map_err(|e| anyhow::anyhow!("{flag} {}: cannot write in {}: {e}", shown.display(), dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// The run's plan (`train::plan::Plan`) on `device`: derived once, then read by the memory
/// check and the trainer.
pub fn plan_on(cfg: &RunConfig, device: &Device) -> crate::train::plan::Plan {
    match device {
        Device::Cpu(be) => crate::train::plan::Plan::for_run(be, cfg),
        Device::Cuda(be) => crate::train::plan::Plan::for_run(be, cfg),
    }
}

/// Refuses a run that cannot fit: the plan's memory estimate (`train::memory`) against what
/// this process may still use on `device`. `what` names the run in the error.
pub fn check_memory(plan: &crate::train::plan::Plan, device: &Device, what: &str) -> anyhow::Result<()> {
    use crate::train::memory;
    let Some(est) = &plan.memory else { return Ok(()) };
    let limit = match device {
        Device::Cpu(_) => memory::cpu_limit(),
        Device::Cuda(be) => be.mem_info().ok().map(|(free, _)| memory::Limit {
            bytes: free as f64,
            what: format!("free memory on GPU {} ({})", be.info().index, be.info().name),
        }),
    };
    match limit {
        Some(limit) => memory::check(est, &limit, what).map_err(|m| anyhow::anyhow!(m)),
        None => Ok(()),
    }
}

/// The backend a command runs on.
pub enum Device {
    Cpu(Cpu),
    Cuda(Cuda),
}

/// Resolves `--device`: `cuda` must find a usable GPU (the error says which library or driver
/// call failed); `auto` takes the GPU of this process's local rank when there is one and
/// otherwise falls back to the CPU, saying so in one line when `notice` (rank 0). A GPU is
/// opened for `precision` (its 16-bit format, `backend::half::choose`; an automatic choice is
/// said in one line when `notice`).
pub fn open_device(arg: DeviceArg, local_rank: usize, notice: bool, precision: &config::Precision) -> anyhow::Result<Device> {
    let open = |what: &str| -> anyhow::Result<Device> {
        let be = Cuda::for_precision(local_rank, precision).map_err(|e| anyhow::anyhow!("{what}GPU {local_rank}: {e}"))?;
        if let (true, Some(n)) = (notice, be.half_notice()) {
            eprintln!("notice: {n}");
        }
        Ok(Device::Cuda(be))
    };
    match arg {
        DeviceArg::Cpu => Ok(Device::Cpu(Cpu::new())),
        DeviceArg::Cuda => {
            cuda::probe(local_rank).map_err(|e| anyhow::anyhow!("--device cuda: no usable GPU {local_rank}: {e}"))?;
            open("--device cuda: ")
        }
        DeviceArg::Auto => match cuda::probe(local_rank) {
            Ok(_) => open(""),
            Err(why) => {
                if notice {
                    cpu_fallback_notice(&why.to_string());
                }
                Ok(Device::Cpu(Cpu::new()))
            }
        },
    }
}

/// The one line `--device auto` prints when it falls back to the CPU.
fn cpu_fallback_notice(why: &str) {
    // The first clause of the reason is enough here; `--device cuda` prints it all.
    let short: String = why.split([';', '\n', '(']).next().unwrap_or("").trim().chars().take(100).collect();
    eprintln!("notice: no usable GPU ({short}): running on the CPU (--device cpu skips this check, --device cuda says why in full)");
}

/// Resolves a `--device` given as a name (`bench`, `selftest`): `auto` becomes `cuda` when GPU
/// `gpu` is usable, else `cpu` with the one-line notice `open_device` prints (from rank 0 of a
/// launched job only); any other name is returned as given. Under a launcher the ranks probe
/// GPU `gpu`, which is usable when theirs are.
pub fn resolve_device_name(arg: &str, gpu: usize) -> String {
    if arg != "auto" {
        return arg.to_string();
    }
    // a probe only: the command opens the GPU itself (a second context would cost memory)
    match cuda::probe(gpu) {
        Ok(_) => "cuda".into(),
        Err(why) => {
            if std::env::var("RANK").map_or(true, |r| r.trim() == "0") {
                cpu_fallback_notice(&why.to_string());
            }
            "cpu".into()
        }
    }
}

/// Identifies the resolved configuration, so ranks started with different configs
/// refuse to train together (rendezvous names the rank and both hashes).
pub fn config_hash(cfg: &RunConfig) -> anyhow::Result<String> {
    use sha2::{Digest, Sha256};
    let bytes = serde_json::to_vec(cfg)?;
    Ok(Sha256::digest(&bytes).iter().take(8).map(|b| format!("{b:02x}")).collect())
}
