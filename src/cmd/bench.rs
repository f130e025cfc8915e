//! `vitscale bench`: its flags, and the report of one measurement — training-step throughput,
//! MFU and peak memory (`crate::bench`), with `--data` the loader's (`bench::data`), with `--comm`
//! the collectives' (`bench::comm`).

pub use crate::bench::args::{default_model_and_micro, default_profile_micros, BenchArgs};

/// On the CPU, refuses a step that cannot fit in memory (`train::memory`), before allocating.
fn check_cpu_memory(args: &BenchArgs) -> anyhow::Result<()> {
    use crate::config::keys;
    let v = crate::config::ConfigBuilder::new()
        .set(keys::MODEL_PRESET, args.model.as_str())
        .set(keys::MICRO_BATCH, args.micro)
        .set(keys::TRAIN_PASS_IMAGES, args.micro.max(1))
        .set(keys::TRAIN_EVAL_BATCH_SIZE, 1)
        .set(keys::DATA_TRAIN_SIZE, 1)
        .set(keys::DATA_VAL_SIZE, 1)
        .build();
    // An unknown preset or a zero micro-batch is reported by the benchmark itself.
    let Ok(cfg) = crate::config::resolve(&v, 1) else { return Ok(()) };
    let device = super::common::Device::Cpu(crate::backend::cpu::Cpu::new());
    let plan = super::common::plan_on(&cfg, &device);
    super::common::check_memory(&plan, &device, &format!("bench --model {} --micro {}", args.model, args.micro))
}

/// `vitscale bench`.
pub fn run(mut args: BenchArgs) -> anyhow::Result<()> {
    args.device = super::common::resolve_device_name(&args.device, args.gpu);
    if args.comm.comm {
        return crate::bench::comm::command(&args.comm, &args.device, args.warmup, args.json);
    }
    if args.data {
        let gpu = (args.device == "cuda").then_some(args.gpu);
        return crate::bench::data::command(args.threads, args.secs, args.jpeg_dir.as_deref(), args.json, gpu);
    }
    let (model, micro) = default_model_and_micro(&args.device);
    args.model = args.model_arg.clone().unwrap_or_else(|| model.to_string());
    args.micro = args.micro_arg.unwrap_or(micro);
    if args.gas == 0 {
        anyhow::bail!("--gas must be at least 1");
    }
    let env = crate::comm::DistEnv::detect()?;
    if args.zero > 2 {
        anyhow::bail!("--zero must be 0, 1 or 2, got {}", args.zero);
    }
    if args.zero > 0 && env.world_size == 1 {
        anyhow::bail!("--zero {} shards across ranks: run it under a launcher (vitscale launch --nproc-per-node N -- bench --zero {})", args.zero, args.zero);
    }
    if args.zero > 0 && args.comm_dtype != "fp32" && args.device == "cpu" {
        anyhow::bail!("--comm-dtype {}: CPU ranks reduce-scatter in fp32 (the bf16 wire applies at --zero 0, and at every stage on GPUs)", args.comm_dtype);
    }
    if args.device == "cpu" {
        check_cpu_memory(&args)?;
    }
    if let Some(path) = args.profile_out.clone() {
        let micros = args.profile_micros.clone().unwrap_or_else(|| default_profile_micros(&args.device));
        if args.device == "cpu" {
            if let Some(&largest) = micros.iter().max() {
                check_cpu_memory(&BenchArgs { micro: largest, ..args.clone() })?;
            }
        }
        let p = crate::bench::profile::measure_profile(&args, &micros, &env)?;
        // side by side, every rank measured its own copy; rank 0 writes the file
        if env.rank != 0 {
            return Ok(());
        }
        p.save(&path).map_err(|e| anyhow::anyhow!("--profile-out {e}"))?;
        let side = if p.ranks > 1 { format!(", one of {} ranks side by side", p.ranks) } else { String::new() };
        println!("profile of {} on {} ({} micro sizes{side}) written to {}", p.model, p.device, p.points.len(), path.display());
        if args.json {
            println!("{}", serde_json::to_string(&p)?);
        }
        return Ok(());
    }
    if env.world_size > 1 {
        let gpu = if args.device == "cpu" { 0 } else { super::train::gpu_index(&env)? };
        let r = crate::bench::measure_data_parallel(&args, &env, gpu)?;
        if env.rank == 0 {
            println!("{} on {} ranks (--device {}):", args.model, r.world, args.device);
            println!("{r}");
            if args.json {
                println!("{}", serde_json::to_string(&r)?);
            }
        }
        return Ok(());
    }
    let r = crate::bench::measure(&args)?;
    // The CPU has no measured matrix ceiling, so no MFU.
    let mfu = if r.ceiling_tflops > 0.0 {
        format!("{:.1} TFLOP/s of {:.0} measured ceiling = MFU {:.1}%", r.achieved_tflops, r.ceiling_tflops, r.mfu * 100.0)
    } else {
        format!("{:.3} TFLOP/s (no MFU: no measured ceiling on this device)", r.achieved_tflops)
    };
    // the CPU backend has no device memory to measure: its figure would print as 0.00
    let peak = match (r.device.as_str(), crate::util::peak_rss_gib()) {
        ("cpu", Some(rss)) => format!("peak mem n/a on the CPU (no device memory; process peak RSS {rss:.2} GiB)"),
        ("cpu", None) => "peak mem n/a on the CPU (no device memory)".to_string(),
        _ => format!("peak mem {:.2} GiB", r.peak_mem_gib),
    };
    let kept = if r.attention_kept { " (attention outputs kept)" } else { "" };
    println!(
        "{} on {}: micro {} | {:.2} ms/step | {:.1} img/s | {mfu} | {peak} | graph {} | norm/GELU recomputed {} | blocks checkpointed {}{kept} | loss {:.4}",
        r.model, r.device, r.micro, r.step_ms, r.img_per_s, r.graph, r.recomputed, r.checkpointed, r.loss
    );
    if r.executed_share < 1.0 {
        println!(
            "MFU counts the model's {} GFLOP per trained image; the step executes {:.1} % of them (the last block's queries, projection and MLP on the class token alone): {} TFLOP/s executed",
            crate::util::fmt_sig(r.train_gflop_per_img, 3),
            r.executed_share * 100.0,
            crate::util::fmt_sig(r.achieved_tflops * r.executed_share, 3)
        );
    }
    if let Some(p) = &r.gpu_power {
        println!("GPU during the timed steps: {p}");
    }
    if let Some(p) = &r.ceiling_gpu_power {
        println!("GPU during the ceiling GEMM: {p}");
    }
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    }
    Ok(())
}
