//! The benchmarks behind `vitscale bench`, one room: this file is the training step's
//! throughput on synthetic, device-resident data; `data_parallel` the same step over ranks;
//! `profile` the planner's compute profile (`--profile-out`); `comm` the collectives over
//! sizes (`--comm`); `data` the loader (`--data`, and `cargo bench --bench data`); `args`
//! their flags.
//!
//! The step is the one a training run takes (`train::step::Step`: forward → backward →
//! global gradient norm and clipping at 1.0 on the device → AdamW (lr 1e-4, weight decay
//! 0.05), which refreshes the compute copy of the weights → zero the gradients), the same work
//! as `peers/vit_bench.py`. Data is drawn once and
//! stays on the device, so the number measures the engine, not the loader.
//!
//! On CUDA the per-micro-batch part (forward, backward) is captured once into a CUDA
//! graph and replayed (`--graph on|off|auto`); the gradient norm and the fused optimizer
//! kernel, which clips by it and writes the bf16 compute copy, run after it with no host
//! round trip (the training loop reads the norm back for its log). Timing uses CUDA events
//! over the timed steps after `--warmup` steps; MFU counts
//! `ModelConfig::train_flops_per_image` against the bf16 GEMM rate measured in the same
//! process (cuBLASLt, 8192³, random data).

pub mod args;
pub mod comm;
pub mod data;
pub mod data_parallel;
pub mod profile;

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::cpu::Cpu;
use crate::backend::cuda::telemetry::{PowerSampler, PowerSummary};
use crate::backend::{BResult, Backend, ParamGroups};
use crate::bench::args::BenchArgs;
use crate::config::{DecaySkip, OptimizerConfig};
use crate::model::vit::{smoothed_targets, Recompute, Vit};
use crate::model::spec::PRESET_NAMES;
use crate::model::ModelConfig;
use crate::train::plan::Plan;
use crate::train::step::Step;
use crate::train::sync::LocalGrads;

/// What one benchmark measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchResult {
    pub engine: String,
    pub device: String,
    pub model: String,
    pub image_size: usize,
    pub params: usize,
    pub micro: usize,
    pub steps: usize,
    pub graph: bool,
    pub step_ms: f64,
    pub img_per_s: f64,
    pub train_gflop_per_img: f64,
    pub achieved_tflops: f64,
    pub ceiling_tflops: f64,
    pub mfu: f64,
    /// Share of the model's FLOPs the step executes (below 1 with the class token tail: the
    /// last block's queries, projection and MLP on the class token alone).
    pub executed_share: f64,
    pub peak_mem_gib: f64,
    pub loss: f32,
    pub kernel_compile_s: f64,
    /// Attention path on CUDA ("fused", "fused-pipe", "gemm"); "cpu" on the CPU.
    pub attention: String,
    /// Whether the backward regenerated LayerNorm/GELU outputs (`--recompute always`, or `auto`
    /// where the pass is small enough).
    pub recomputed: bool,
    /// Whether the backward ran each block's forward again from its saved input
    /// (`--recompute blocks`, activation checkpointing).
    pub checkpointed: bool,
    /// Under checkpointing, whether each block kept its attention output, so that the rerun
    /// skipped the attention core (`model::checkpoint_keeps_attention`).
    pub attention_kept: bool,
    /// SM clock and board power during the timed steps (CUDA with NVML only).
    pub gpu_power: Option<PowerSummary>,
    /// The same during the ceiling GEMM.
    pub ceiling_gpu_power: Option<PowerSummary>,
}

struct Setup {
    cfg: ModelConfig,
    opt: OptimizerConfig,
    images: Vec<f32>,
    targets: Vec<f32>,
}

fn setup(args: &BenchArgs) -> anyhow::Result<Setup> {
    let mut cfg = ModelConfig::preset(&args.model)
        .ok_or_else(|| anyhow::anyhow!("unknown --model {:?}; presets: {}", args.model, PRESET_NAMES.join(", ")))?;
    if let Some(k) = args.classes {
        cfg.num_classes = k;
    }
    if let Some(px) = args.img {
        cfg.image_size = px;
    }
    cfg.validate().map_err(anyhow::Error::msg)?;
    if args.micro == 0 || args.steps == 0 {
        anyhow::bail!("--micro and --steps must be at least 1");
    }
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let n = args.micro * cfg.in_chans * cfg.image_size * cfg.image_size;
    let images: Vec<f32> = (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect();
    let labels: Vec<u32> = (0..args.micro).map(|_| rng.gen_range(0..cfg.num_classes as u32)).collect();
    let targets = smoothed_targets(&labels, cfg.num_classes, 0.0);
    let opt = OptimizerConfig::Adam { lr: 1e-4, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.05, adam_w_mode: true, bias_correction: true };
    Ok(Setup { cfg, opt, images, targets })
}

fn mean_loss<B: Backend>(be: &B, m: &Vit<B>, b: usize) -> BResult<f32> {
    let out = m.forward_out(be, b)?;
    Ok(out.losses.iter().sum::<f32>() / b as f32)
}

/// The benchmarked training step on `be` (`train::step::Step`, as a training run has it):
/// seeded weights, every parameter decayed (as the peer), gradients clipped to global norm 1.0
/// on the device, one pass over the whole micro-batch, the `--recompute` policy, and the
/// synthetic batch staged.
fn bench_step<B: Backend>(be: &B, args: &BenchArgs, s: &Setup, world: usize) -> anyhow::Result<Step<B>> {
    let mut m = Vit::new(be, s.cfg.clone())?;
    m.set_class_token_tail(!args.full_last_block);
    m.set_params(be, &crate::model::init::init_params(&m.table, 0))?;
    let decay = ParamGroups::new(&m.table, &DecaySkip { bias: false, norm: false, pos_embed: false, cls_token: false });
    let recompute = Recompute::parse(&args.recompute).map_err(|e| anyhow::anyhow!("--recompute: {e}"))?;
    let plan = Plan::new(be, &s.cfg, args.micro, args.gas.max(1), world, Some(args.micro), recompute);
    let mut st = Step::new(be, m, s.opt.clone(), decay, BENCH_CLIP, plan)?;
    st.vit.stage_inputs(be, &s.images, &s.targets, args.micro)?;
    Ok(st)
}

/// The global gradient norm the benchmarked step clips to.
const BENCH_CLIP: f64 = 1.0;

/// One benchmarked optimizer step after its forward and backward ran: the boundary of the
/// training step (clip on the device, AdamW at a constant lr, zero the gradients).
fn boundary<B: Backend>(be: &B, st: &mut Step<B>, step: u64) -> anyhow::Result<()> {
    let lr = st.optimizer.lr();
    st.boundary(be, &mut LocalGrads, lr, step, false)?;
    Ok(())
}

/// The `--gas` micro-batch passes of one step (eager).
fn passes<B: Backend>(be: &B, st: &mut Step<B>, args: &BenchArgs) -> anyhow::Result<()> {
    for _ in 0..args.gas.max(1) {
        st.pass_unlogged(be, args.micro)?;
    }
    Ok(())
}

impl BenchResult {
    /// What the step's activation memory policy did: regenerated, checkpointed, kept attention.
    fn memory_policy<B: Backend>(&mut self, st: &Step<B>) {
        self.recomputed = st.plan.recompute;
        self.checkpointed = st.plan.checkpointing;
        self.attention_kept = st.vit.checkpoint_kept_attention() == Some(true);
    }
}

fn bench_cpu(args: &BenchArgs, s: &Setup) -> anyhow::Result<BenchResult> {
    let be = Cpu::new();
    let mut st = bench_step(&be, args, s, 1)?;
    let mut step = 0u64;
    for _ in 0..args.warmup {
        passes(&be, &mut st, args)?;
        boundary(&be, &mut st, step)?;
        step += 1;
    }
    let t = Instant::now();
    for _ in 0..args.steps {
        passes(&be, &mut st, args)?;
        boundary(&be, &mut st, step)?;
        step += 1;
    }
    let ms = t.elapsed().as_secs_f64() * 1e3 / args.steps as f64;
    let loss = mean_loss(&be, &st.vit, args.micro)?;
    let mut r = result(args, s, "cpu".into(), st.vit.table.total, false, ms, 0.0, 0.0, loss, 0.0);
    r.memory_policy(&st);
    Ok(r)
}

#[allow(clippy::too_many_arguments)]
fn result(args: &BenchArgs, s: &Setup, device: String, params: usize, graph: bool, step_ms: f64, ceiling: f64, peak: f64, loss: f32, compile_s: f64) -> BenchResult {
    let img_per_s = (args.micro * args.gas.max(1)) as f64 / (step_ms * 1e-3);
    let flops = s.cfg.train_flops_per_image();
    let achieved = flops * img_per_s / 1e12;
    BenchResult {
        engine: "vitscale".into(),
        device,
        model: args.model.clone(),
        image_size: s.cfg.image_size,
        params,
        micro: args.micro,
        steps: args.steps,
        graph,
        step_ms,
        img_per_s,
        train_gflop_per_img: flops / 1e9,
        achieved_tflops: achieved,
        ceiling_tflops: ceiling,
        mfu: if ceiling > 0.0 { achieved / ceiling } else { 0.0 },
        executed_share: s.cfg.executed_forward_flops_per_image(!args.full_last_block) / s.cfg.forward_flops_per_image(),
        peak_mem_gib: peak,
        loss,
        kernel_compile_s: compile_s,
        attention: "cpu".into(),
        recomputed: false,
        checkpointed: false,
        attention_kept: false,
        gpu_power: None,
        ceiling_gpu_power: None,
    }
}

fn bench_cuda(args: &BenchArgs, s: &Setup) -> anyhow::Result<BenchResult> {
    use crate::backend::cuda::Cuda;
    let be = open_cuda(args, args.gpu)?;
    eprintln!("attention path: {}", be.attention_path().name());
    // GPU telemetry every 5 ms around the ceiling GEMM and the timed steps (NVML, if present)
    let sampler = || PowerSampler::start(&be.info().pci_bus_id, std::time::Duration::from_millis(5));
    let (ceiling, ceiling_power) = if args.no_ceiling {
        (794.0, None)
    } else {
        let p = sampler();
        let c = be.matmul_tflops(8192, 10)?;
        (c, p.and_then(PowerSampler::finish))
    };
    be.synchronize()?;
    be.reset_peak();
    let mut st = bench_step(&be, args, s, 1)?;
    let want_graph = wants_graph(args)?;
    let mut step = 0u64;
    // One eager step first: grows every scratch buffer and plans every GEMM.
    st.pass_unlogged(&be, args.micro)?;
    boundary(&be, &mut st, step)?;
    step += 1;
    be.synchronize()?;
    let graph = if want_graph { capture_pass(&be, &mut st, args)? } else { None };
    let run_step = |st: &mut Step<Cuda>, step: u64| -> anyhow::Result<()> {
        for _ in 0..args.gas.max(1) {
            match &graph {
                // The graph ran the forward with a training loss and its backward; the model's
                // host-side flag of a pending backward was consumed at capture.
                Some(g) => g.launch()?,
                None => st.pass_unlogged(&be, args.micro)?,
            }
        }
        boundary(&be, st, step)
    };
    for _ in 0..args.warmup {
        run_step(&mut st, step)?;
        step += 1;
    }
    be.synchronize()?;
    let ev = || be.context().new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
    let (e0, e1) = (ev()?, ev()?);
    let power = sampler();
    e0.record(be.stream())?;
    for _ in 0..args.steps {
        run_step(&mut st, step)?;
        step += 1;
    }
    e1.record(be.stream())?;
    e1.synchronize()?;
    let power = power.and_then(PowerSampler::finish);
    let ms = e0.elapsed_ms(&e1)? as f64 / args.steps as f64;
    let loss = mean_loss(&be, &st.vit, args.micro)?;
    let peak = be.peak_bytes() as f64 / (1u64 << 30) as f64;
    if args.profile {
        be.set_profiling(true);
        st.pass_unlogged(&be, args.micro)?;
        boundary(&be, &mut st, step)?;
        let timeline = be.take_profile_timeline()?;
        be.set_profiling(false);
        print_profile(&timeline);
    }
    let compile_s = be.compile_seconds();
    let mut r = result(args, s, be.name(), st.vit.table.total, graph.is_some(), ms, ceiling, peak, loss, compile_s);
    r.attention = be.attention_path().name().to_string();
    r.memory_policy(&st);
    r.gpu_power = power;
    r.ceiling_gpu_power = ceiling_power;
    Ok(r)
}

/// The profiled eager step: time per kernel name, then what lay between launches (the
/// launch itself, memsets, copies) and the widest of those gaps with their neighbours.
fn print_profile(timeline: &[crate::backend::cuda::ProfiledLaunch]) {
    let by_name = crate::backend::cuda::profile_by_name(timeline);
    let total: f64 = by_name.iter().map(|p| p.1).sum();
    println!("profile of one eager step ({total:.2} ms in kernels and GEMMs):");
    for (name, ms, n) in by_name.iter().take(40) {
        println!("  {:>8.3} ms {:>5.1}% {:>4}×  {}", ms, 100.0 * ms / total, n, name);
    }
    let gaps: f64 = timeline.iter().map(|l| l.gap_before_ms).sum();
    println!("between the {} launches: {gaps:.3} ms in all; the widest gaps:", timeline.len());
    let mut idx: Vec<usize> = (1..timeline.len()).collect();
    idx.sort_by(|&a, &b| timeline[b].gap_before_ms.total_cmp(&timeline[a].gap_before_ms));
    for &i in idx.iter().take(8) {
        println!("  {:>8.3} ms  {} → {}", timeline[i].gap_before_ms, timeline[i - 1].name, timeline[i].name);
    }
}

/// GPU `gpu` with the `--attention` path asked for.
fn open_cuda(args: &BenchArgs, gpu: usize) -> anyhow::Result<crate::backend::cuda::Cuda> {
    let be = crate::backend::cuda::Cuda::new(gpu)?;
    if let Some(a) = &args.attention {
        be.set_attention(crate::backend::cuda::parse_attention(a).map_err(|e| anyhow::anyhow!("--attention: {e}"))?);
    }
    Ok(be)
}

/// `--graph`: whether to capture the micro-batch pass (on, auto) or not (off).
fn wants_graph(args: &BenchArgs) -> anyhow::Result<bool> {
    match args.graph.as_str() {
        "on" | "auto" => Ok(true),
        "off" => Ok(false),
        other => anyhow::bail!("--graph must be on, off or auto, got {other:?}"),
    }
}

/// One micro-batch pass captured into a CUDA graph (after an eager step has grown every
/// buffer); None, with a note, when capture fails and `--graph` is not `on`.
fn capture_pass(be: &crate::backend::cuda::Cuda, st: &mut Step<crate::backend::cuda::Cuda>, args: &BenchArgs) -> anyhow::Result<Option<crate::backend::cuda::Graph>> {
    be.begin_capture()?;
    let cap = st.pass_unlogged(be, args.micro);
    let g = be.end_capture();
    match (cap, g) {
        (Ok(()), Ok(g)) => Ok(Some(g)),
        (c, g) => {
            let why = c.err().map(|e| e.to_string()).or(g.err().map(|e| e.to_string())).unwrap_or_default();
            if args.graph == "on" {
                anyhow::bail!("CUDA graph capture failed: {why}");
            }
            eprintln!("note: CUDA graph capture failed ({why}); timing eager launches");
            Ok(None)
        }
    }
}

/// This machine's name, for telling whether ranks share a device.
fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default()
}

fn id_of(text: &str) -> u64 {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(text.as_bytes());
    u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// The data-parallel benchmark (`data_parallel`) as one rank of the job `env` describes (the
/// process was started by `vitscale launch` or another launcher).
pub fn measure_data_parallel(args: &BenchArgs, env: &crate::comm::DistEnv, gpu: usize) -> anyhow::Result<data_parallel::DataParallelResult> {
    use crate::train::sync::DEFAULT_BUCKET_ELEMS;
    use data_parallel::Passes;
    let s = setup(args)?;
    let bf16 = match args.comm_dtype.as_str() {
        "fp32" => false,
        "bf16" => true,
        other => anyhow::bail!("--comm-dtype must be fp32 or bf16, got {other:?}"),
    };
    let wire = crate::comm::Wire { bf16, pre: 1.0, post: 1.0 };
    let bucket = args.bucket_elems.unwrap_or(DEFAULT_BUCKET_ELEMS);
    if bucket == 0 {
        anyhow::bail!("--bucket-elems must be at least 1");
    }
    let opts = crate::comm::CommOptions::from_config_and_env(300.0)?;
    // every rank must benchmark the same thing: the arguments are the rendezvous' config hash
    let hash = format!("{:016x}", id_of(&format!("{:?}", BenchArgs { gpu: 0, ..args.clone() })));
    match args.device.as_str() {
        "cpu" => {
            let be = Cpu::new();
            let mut st = bench_step(&be, args, &s, env.world_size)?;
            let mut comm = crate::comm::init_cpu(env, &opts, &hash)?;
            data_parallel::measure(&be, &mut st, comm.as_mut(), args, Passes::Eager, wire, bucket, id_of(&hostname()))
        }
        "cuda" | "gpu" => {
            use crate::backend::cuda::nccl::NcclComm;
            let be = open_cuda(args, gpu)?;
            let mut st = bench_step(&be, args, &s, env.world_size)?;
            // one eager step grows every buffer before a capture
            st.pass_unlogged(&be, args.micro)?;
            st.vit.zero_grads(&be)?;
            be.synchronize()?;
            let graph = if wants_graph(args)? { capture_pass(&be, &mut st, args)? } else { None };
            let replay = || -> anyhow::Result<()> {
                match &graph {
                    Some(g) => Ok(g.launch()?),
                    None => Ok(()),
                }
            };
            let passes = match (&graph, args.graph.as_str()) {
                (None, _) => Passes::Eager,
                (Some(_), "on") => Passes::GraphAll(&replay),
                (Some(_), _) => Passes::GraphBeforeBoundary(&replay),
            };
            let mut comm = NcclComm::connect(env, &opts, &hash, &be)?;
            let device = format!("{}/{}", hostname(), be.info().pci_bus_id);
            data_parallel::measure(&be, &mut st, &mut comm, args, passes, wire, bucket, id_of(&device))
        }
        other => anyhow::bail!("--device must be cuda or cpu, got {other:?}"),
    }
}

/// Runs the benchmark `args` describe (the model options; `--data` is the command's).
pub fn measure(args: &BenchArgs) -> anyhow::Result<BenchResult> {
    let s = setup(args)?;
    match args.device.as_str() {
        "cuda" | "gpu" => bench_cuda(args, &s),
        "cpu" => bench_cpu(args, &s),
        other => anyhow::bail!("--device must be cuda or cpu, got {other:?}"),
    }
}
