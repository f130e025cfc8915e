//! `vitscale plan`: predictions of the step-time model (`crate::plan`) from a compute profile
//! and a cluster file — one configuration (`--config`/`--set`), the ranked choices for a
//! global batch (`--recommend`), a projection over node counts (`--project OUT`) — and the
//! validation of the model against a measured sweep (`--validate SWEEP_DIR`).

use std::path::{Path, PathBuf};

use clap::Args;

use crate::plan::cluster::Cluster;
use crate::plan::comm_fit::CommFit;
use crate::plan::model;
use crate::plan::profile::Profile;
use crate::util::plural;

const GIB: f64 = (1u64 << 30) as f64;

/// Command-line options of `vitscale plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// The compute profile (`vitscale bench --profile-out P.json`). --validate takes several
    /// (CPU points use the one measured with their threads per rank) and defaults to the sweep
    /// directory's profile*.json.
    #[arg(long, value_name = "P.json")]
    pub profile: Vec<PathBuf>,
    /// The cluster file (`configs/clusters/*.json`).
    #[arg(long, value_name = "C.json")]
    pub cluster: Option<PathBuf>,
    /// Replace the cluster file's node count.
    #[arg(long)]
    pub nodes: Option<usize>,
    /// Replace the cluster file's devices per node.
    #[arg(long)]
    pub gpus_per_node: Option<usize>,
    /// Replace the cluster file's ranks per device (the rank count of `one_gpu_emulation.json`
    /// and `cpu_ranks_here.json`).
    #[arg(long)]
    pub ranks_per_device: Option<usize>,
    /// A `bench --comm --comm-out` file (repeatable): the levels marked `from_comm`, and with
    /// --validate the network of the sweep's ranks (default: the sweep directory's comm*.json).
    #[arg(long = "comm", value_name = "C.json")]
    pub comm: Vec<PathBuf>,
    /// The output of `vitscale bench --data --json` saved to a file: the loader's images/s per
    /// core (its one-thread point) models data loading, with `data.num_workers` cores per rank
    /// (replaces the cluster file's loader keys).
    #[arg(long, value_name = "D.json")]
    pub data: Option<PathBuf>,
    /// With --data: the pipeline to read (default cifar32_crop_flip up to 64 px, else
    /// jpeg224_rrc_flip_loader).
    #[arg(long)]
    pub data_pipeline: Option<String>,
    /// The run configuration (DeepSpeed JSON + model/data/train). Default: the profiled model
    /// with AdamW and the engine's defaults.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override one key of the configuration: `--set key.path=JSON` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Rank the micro/GAS/ZeRO/bucket/wire choices that reach --global-batch on the cluster.
    #[arg(long)]
    pub recommend: bool,
    /// With --recommend: the global batch (images per optimizer step).
    #[arg(long, value_name = "B")]
    pub global_batch: Option<usize>,
    /// With --recommend: the memory one rank may use, GiB.
    #[arg(long, value_name = "GiB")]
    pub memory_limit: Option<f64>,
    /// With --recommend: how many choices to print.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Predict every finished point of this sweep directory and compare; writes DIR/plan.json.
    #[arg(long, value_name = "SWEEP_DIR")]
    pub validate: Option<PathBuf>,
    /// Predict the cluster at 1, 2, 4 … of its nodes and each --micros size; writes
    /// OUT/projection.md, OUT/projection.json and OUT/charts/projection.png|svg.
    #[arg(long, value_name = "OUT")]
    pub project: Option<PathBuf>,
    /// With --project: micro-batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128,256")]
    pub micros: Vec<usize>,
    /// Print one JSON object as the last line of stdout.
    #[arg(long)]
    pub json: bool,
    /// Predict from a profile measured on another device than the cluster's (`device` in the
    /// cluster file), as if the cluster had the profile's device: a what-if, said so.
    #[arg(long)]
    pub allow_device_mismatch: bool,
}

fn load_comm(paths: &[PathBuf]) -> anyhow::Result<Vec<CommFit>> {
    paths.iter().map(|p| CommFit::load(p).map_err(anyhow::Error::msg)).collect()
}

fn load_profile(path: &Path) -> anyhow::Result<Profile> {
    Profile::load(path).map_err(anyhow::Error::msg)
}

fn need<'a, T>(x: &'a Option<T>, flag: &str, why: &str) -> anyhow::Result<&'a T> {
    x.as_ref().ok_or_else(|| anyhow::anyhow!("{flag} is required {why}"))
}

/// The configuration value: `--config` (the profiled model when it names none) or the
/// default, with every `--set` applied.
fn config_value(args: &PlanArgs, profile: &Profile) -> anyhow::Result<serde_json::Value> {
    let mut v = match &args.config {
        Some(p) => crate::config::load_json(Some(p), &[])?,
        None => {
            let mut v = crate::plan::default_config_value(profile);
            if let Some(o) = v.as_object_mut() {
                o.remove("model");
            }
            v
        }
    };
    for s in &args.sets {
        crate::config::apply_set(&mut v, s)?;
    }
    // the profiled model unless the configuration or a --set names one (which must then be
    // the profiled one: `check_model`)
    if v.get("model").is_none() {
        v["model"] = serde_json::to_value(&profile.model_config)?;
    }
    Ok(v)
}

/// `vitscale plan`.
pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    if let Some(dir) = &args.validate {
        return validate(&args, dir);
    }
    let profile_path = match args.profile.as_slice() {
        [] => anyhow::bail!("--profile is required (a `bench --profile-out` file)"),
        [p] => p,
        _ => anyhow::bail!("--profile given {} times: only --validate takes several", args.profile.len()),
    };
    let profile = load_profile(profile_path)?;
    let comm = load_comm(&args.comm)?;
    let cluster_path = need(&args.cluster, "--cluster", "(a cluster file, e.g. configs/clusters/h200_8_nvlink.json)")?;
    let mut cluster = Cluster::load(cluster_path, &comm).and_then(|c| c.with_counts(args.nodes, args.gpus_per_node, args.ranks_per_device)).map_err(anyhow::Error::msg)?;
    match cluster.check_device(&profile.device) {
        Ok(None) => {}
        Ok(Some(w)) => eprintln!("warning: {w}"),
        Err(e) if args.allow_device_mismatch => eprintln!("warning: {e} (--allow-device-mismatch: predicting with the profile's device)"),
        Err(e) => anyhow::bail!("--profile {} --cluster {}: {e}; --allow-device-mismatch predicts anyway", profile_path.display(), cluster_path.display()),
    }
    if let Some(d) = &args.data {
        let (pipeline, rate) = crate::plan::loader_rate(d, args.data_pipeline.as_deref(), profile.model_config.image_size).map_err(anyhow::Error::msg)?;
        eprintln!("data loading: {rate:.0} images/s per core ({pipeline}, {})", d.display());
        cluster.loader_images_per_s_per_core = Some(rate);
        let base = config_value(&args, &profile)?;
        let workers = base.pointer("/data/num_workers").and_then(serde_json::Value::as_u64).unwrap_or(1).max(1);
        cluster.loader_cores_per_rank = workers as f64;
    }
    if let Some(out) = &args.project {
        let p = crate::plan::project::project(&profile, &profile_path.display().to_string(), &cluster, &args.micros, out).map_err(anyhow::Error::msg)?;
        crate::outln!("{:>5} {:>6} {:>6} {:>12} {:>10} {:>10} {:>10} {:>12}", "nodes", "ranks", "micro", "images/s", "per rank", "efficiency", "step ms", "exposed ms");
        for r in &p.rows {
            crate::outln!("{:>5} {:>6} {:>6} {:>12.0} {:>10.0} {:>9.1}% {:>10.2} {:>12.2}", r.nodes, r.ranks, r.micro, r.images_per_s, r.images_per_s_per_rank, r.efficiency * 100.0, r.step_ms, r.comm_exposed_ms);
        }
        crate::outln!("inputs trusted least:");
        for l in &p.least_trusted {
            crate::outln!("  - {l}");
        }
        eprintln!("wrote {}", p.files.join(", "));
        if args.json {
            crate::outln!("{}", serde_json::to_string(&p)?);
        }
        return Ok(());
    }
    let base = config_value(&args, &profile)?;
    let world = cluster.world();
    if args.recommend {
        let b = *need(&args.global_batch, "--global-batch", "with --recommend")?;
        if let Some(l) = args.memory_limit {
            if !(l.is_finite() && l > 0.0) {
                anyhow::bail!("--memory-limit {l}: expected a positive number of GiB");
            }
        }
        let choices = crate::plan::recommend::recommend(&profile, &cluster, &base, b, args.memory_limit.map(|g| g * GIB)).map_err(anyhow::Error::msg)?;
        if choices.is_empty() {
            anyhow::bail!("no split of global batch {b} over {} fits {} GiB per rank", plural(world, "rank", "ranks"), args.memory_limit.unwrap_or(f64::INFINITY));
        }
        crate::outln!("global batch {b} on {} ({}), fastest first:", cluster.name, plural(world, "rank", "ranks"));
        crate::outln!("{:>4} {:>6} {:>4} {:>5} {:>20} {:>5} {:>11} {:>9} {:>11} {:>10}", "#", "micro", "GAS", "ZeRO", "bucket", "wire", "images/s", "step ms", "exposed ms", "memory GiB");
        for (i, c) in choices.iter().take(args.top.max(1)).enumerate() {
            crate::outln!(
                "{:>4} {:>6} {:>4} {:>5} {:>20} {:>5} {:>11.1} {:>9.2} {:>11.2} {:>10.2}",
                i + 1,
                c.micro,
                c.gas,
                c.zero_stage,
                match c.same_with_buckets.len() {
                    0 => c.bucket_elems.to_string(),
                    n => format!("{} (+{n} alike)", c.bucket_elems),
                },
                c.comm_dtype,
                c.images_per_s,
                c.step_s * 1e3,
                c.comm_exposed_s * 1e3,
                c.memory_per_rank_bytes as f64 / GIB
            );
        }
        if choices.iter().take(args.top.max(1)).any(|c| !c.same_with_buckets.is_empty()) {
            crate::outln!("(+N alike): N other bucket sizes are predicted the same (the gradients fit one bucket of each); the --json choices list them");
        }
        if args.json {
            crate::outln!("{}", serde_json::to_string(&serde_json::json!({"cluster": cluster.name, "global_batch": b, "world": world, "choices": choices}))?);
        }
        return Ok(());
    }
    let cfg = crate::config::resolve(&base, world)?;
    crate::plan::check_model(&profile, &cfg, "the configuration").map_err(anyhow::Error::msg)?;
    let groups = crate::plan::groups(&profile);
    let plan = crate::plan::run_plan(&profile, &cfg);
    let mut s = crate::plan::scenario(&cfg, &plan);
    s.ranks_per_device = cluster.ranks_per_device;
    s.compute_scale = cluster.compute_scale;
    s.loader = cluster.loader_images_per_s_per_core.map(|r| (r, cluster.loader_cores_per_rank));
    let net = crate::plan::network(&cluster);
    let p = model::predict(&profile, &groups, &s, &net).map_err(anyhow::Error::msg)?;
    let eff = model::efficiency(&profile, &groups, &s, &p).map_err(anyhow::Error::msg)?;
    let mem = model::memory(&plan).map_err(anyhow::Error::msg)?;
    let ms = |x: f64| x * 1e3;
    crate::outln!(
        "{} on {} ({} × {} × {} = {}), micro {} × GAS {}, global batch {}, ZeRO {}, {} gradients, buckets of {} elements:",
        profile.model,
        cluster.name,
        plural(cluster.nodes, "node", "nodes"),
        plural(cluster.gpus_per_node, "device", "devices"),
        plural(cluster.ranks_per_device, "rank", "ranks"),
        plural(world, "rank", "ranks"),
        s.micro,
        s.gas,
        p.global_batch,
        s.zero_stage,
        if s.comm_bf16 { "bf16" } else { "fp32" },
        s.bucket_elems
    );
    crate::outln!("  predicted {:.1} images/s ({:.1} per rank), efficiency {:.1} % of {} device(s) × one rank alone", p.images_per_s, p.images_per_s_per_rank, eff * 100.0, cluster.gpus_per_node * cluster.nodes);
    crate::outln!(
        "  step {:.3} ms = compute {:.3} (forward {:.3}, backward {:.3}) + exposed comm {:.3} ({:.3} waiting for the slowest rank; reductions {:.3} in {} buckets, {:.1} MB) + optimizer {:.3} (norm and all-gather {:.3}) + data {:.3} + loop {:.3}",
        ms(p.step_s),
        ms(p.compute_s),
        ms(p.forward_s),
        ms(p.backward_s),
        ms(p.comm_exposed_s),
        ms(p.straggle_s),
        ms(p.comm_total_s),
        p.buckets.len(),
        p.comm_bytes_per_step / 1e6,
        ms(p.optimizer_s),
        ms(p.allgather_s),
        ms(p.data_s),
        ms(p.loop_s)
    );
    if s.sequence_parallel > 1 {
        crate::outln!("  sequence parallelism: groups of {} ranks, each all-to-all a block and pass inside the passes: {:.3} ms a step", s.sequence_parallel, ms(p.all_to_all_s));
    }
    crate::outln!(
        "  memory per rank {:.3} GiB: weights {:.3}, compute copy {:.3}, gradients {:.3}, optimizer state {:.3}, activations {:.3}",
        mem.total as f64 / GIB,
        mem.weights as f64 / GIB,
        mem.compute_copy as f64 / GIB,
        mem.gradients as f64 / GIB,
        mem.optimizer_state as f64 / GIB,
        mem.activations as f64 / GIB
    );
    for n in &p.notes {
        crate::outln!("  note: {n}");
    }
    if cluster.compute_scale != 1.0 {
        crate::outln!("  note: compute scaled by {} ({}) — the input this prediction trusts least", cluster.compute_scale, cluster.compute_scale_source.as_deref().unwrap_or("no source given"));
    }
    if args.json {
        crate::outln!("{}", serde_json::to_string(&serde_json::json!({"cluster": cluster, "scenario": s, "prediction": p, "efficiency": eff, "memory_per_rank": mem}))?);
    }
    Ok(())
}

fn validate(args: &PlanArgs, dir: &Path) -> anyhow::Result<()> {
    // a run directory (what `train --run-dir` writes) is the likeliest wrong argument here
    if !dir.join("sweep.jsonl").is_file() {
        if dir.join("config.json").is_file() && dir.join("metrics.jsonl").is_file() {
            anyhow::bail!("--validate {}: this is a run directory (config.json, metrics.jsonl), not a sweep: --validate takes the directory `vitscale sweep` writes (spec.json, sweep.jsonl, points/)", dir.display());
        }
        anyhow::bail!("--validate {}: not a sweep directory (no sweep.jsonl): --validate takes the directory `vitscale sweep` writes", dir.display());
    }
    let profile_paths = if args.profile.is_empty() { crate::plan::validate::files_in(dir, "profile") } else { args.profile.clone() };
    if profile_paths.is_empty() {
        anyhow::bail!("--validate {}: give --profile P.json, or put the sweep's profile at {}", dir.display(), dir.join("profile.json").display());
    }
    let profiles = profile_paths.iter().map(|p| load_profile(p).map(|x| (p.display().to_string(), x))).collect::<anyhow::Result<Vec<_>>>()?;
    let profile = &profiles[0].1;
    let comm_paths = if args.comm.is_empty() { crate::plan::validate::files_in(dir, "comm") } else { args.comm.clone() };
    let comm = load_comm(&comm_paths)?;
    let loader = match &args.data {
        Some(d) => Some(crate::plan::loader_rate(d, args.data_pipeline.as_deref(), profile.model_config.image_size).map_err(anyhow::Error::msg)?.1),
        None => None,
    };
    let v = crate::plan::validate::validate(dir, &profiles, &comm, loader).map_err(anyhow::Error::msg)?;
    crate::out!("{}", crate::plan::validate::table(&v));
    let out = dir.join("plan.json");
    crate::util::write_atomic(&out, serde_json::to_string_pretty(&v)?.as_bytes()).map_err(|e| anyhow::anyhow!("{}: {e}", out.display()))?;
    eprintln!("wrote {}", out.display());
    if args.json {
        crate::outln!("{}", serde_json::to_string(&v)?);
    }
    Ok(())
}
