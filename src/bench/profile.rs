//! `vitscale bench --profile-out P.json`: the compute profile of this device on one rank
//! (`plan::profile`), measured on the benchmark's own step (`bench_step`, `boundary`) at each
//! micro-batch size of `--profile-micros`.
//!
//! Each repetition waits for the device before and after the forward, at every gradient
//! group the backward reports, and after the boundary, and reads the host clock there: on the
//! CPU the calls are synchronous anyway, on a GPU the waits make host time device time. The
//! step runs eager (no CUDA graph), as the training loop runs it. Besides the parts, the
//! whole step is timed without the waits (`ProfilePoint::step_s`), so the file shows what the
//! waits cost, and as a training loop that logs every step runs it (`logged_step_s`: the
//! losses and the gradient norm read back each step).
//!
//! Under a launcher (CPU only) every rank profiles its own copy of the step at the same time,
//! meeting at a barrier before each timed stretch, and rank 0 writes the file: the times are
//! those of one rank while the others compute beside it, as launched training ranks run. A
//! rank alone on a machine is not such a rank: it has the memory system to itself, and its
//! threads hand work to cores that sit idle (on a virtual machine, waking an idle core costs
//! far more than switching threads on a busy one).

use std::time::Instant;

use crate::backend::{Backend, BackendError, Span};
use crate::bench::args::BenchArgs;
use crate::plan::profile::{Profile, ProfilePoint, FORWARD_SPLIT, PROFILE_FORMAT, PROFILE_VERSION};

/// The median of `xs`, 0 when there is none.
fn median(xs: &[f64]) -> f64 {
    crate::util::median(xs).unwrap_or(0.0)
}

/// Before each timed stretch: the ranks profiling side by side wait for each other (a
/// barrier), so each stretch is timed while all of them compute; alone, nothing.
type Together<'a> = &'a mut dyn FnMut() -> anyhow::Result<()>;

/// One micro-batch size on `be`: `args.warmup` untimed steps, then `args.steps` timed
/// repetitions of the parts, then as many whole steps without waits.
fn profile_micro<B: Backend>(be: &B, args: &BenchArgs, together: Together<'_>) -> anyhow::Result<(ProfilePoint, bool)> {
    let s = super::setup(args)?;
    let mut st = super::bench_step(be, args, &s, 1)?;
    let m = args.micro;
    let scale = Some(1.0 / m as f32);
    let mut step = 0u64;
    together()?;
    for _ in 0..args.warmup.max(1) {
        st.pass_unlogged(be, m)?;
        super::boundary(be, &mut st, step)?;
        step += 1;
    }
    let reps = args.steps.max(1);
    let groups = st.vit.gradient_groups().len();
    let (mut fwd, mut bwd, mut opt) = (Vec::new(), Vec::new(), Vec::new());
    let mut per_group: Vec<Vec<f64>> = vec![Vec::new(); groups];
    together()?;
    for _ in 0..reps {
        be.synchronize()?;
        let t0 = Instant::now();
        st.vit.forward_staged(be, m, scale)?;
        be.synchronize()?;
        let t1 = Instant::now();
        let mut marks: Vec<Instant> = Vec::with_capacity(groups);
        st.vit.backward_reporting::<BackendError>(
            be,
            Some(&mut |_g: &mut B::Buf, _span: Span| {
                be.synchronize()?;
                marks.push(Instant::now());
                Ok(())
            }),
        )?;
        be.synchronize()?;
        let t2 = Instant::now();
        super::boundary(be, &mut st, step)?;
        step += 1;
        be.synchronize()?;
        let t3 = Instant::now();
        if marks.len() != groups {
            anyhow::bail!("the backward reported {} gradient groups, expected {groups}", marks.len());
        }
        let mut prev = t1;
        for (g, t) in marks.iter().enumerate() {
            per_group[g].push((*t - prev).as_secs_f64());
            prev = *t;
        }
        // what the backward did after its last report belongs to the last group
        if let Some(last) = per_group[groups - 1].last_mut() {
            *last += (t2 - prev).as_secs_f64();
        }
        fwd.push((t1 - t0).as_secs_f64());
        bwd.push((t2 - t1).as_secs_f64());
        opt.push((t3 - t2).as_secs_f64());
    }
    // the whole step without waits between its parts
    together()?;
    be.synchronize()?;
    let t = Instant::now();
    for _ in 0..reps {
        st.pass_unlogged(be, m)?;
        super::boundary(be, &mut st, step)?;
        step += 1;
    }
    be.synchronize()?;
    let step_s = t.elapsed().as_secs_f64() / reps as f64;
    // the step as a training loop that logs every step runs it (the lab's sweeps do): the
    // losses kept, the gradient norm and the losses read back at the end of every step, so
    // the host cannot queue the next step ahead of the device
    let t = Instant::now();
    for _ in 0..reps {
        st.pass(be, m, step, None)?;
        let lr = st.optimizer.lr();
        st.boundary(be, &mut super::LocalGrads, lr, step, true)?;
        st.take_losses(be)?;
        step += 1;
    }
    let logged_step_s = t.elapsed().as_secs_f64() / reps as f64;
    // the spread of one pass between repetitions (a robust standard deviation: 1.4826 × the
    // median absolute deviation), for the planner's wait on the slowest of several ranks
    let pass: Vec<f64> = fwd.iter().zip(&bwd).map(|(f, b)| f + b).collect();
    let mid = median(&pass);
    let dev: Vec<f64> = pass.iter().map(|x| (x - mid).abs()).collect();
    let pass_spread_s = 1.4826 * median(&dev);
    let backward_groups_s: Vec<f64> = per_group.iter().map(|v| median(v)).collect();
    let backward_s: f64 = backward_groups_s.iter().sum();
    let forward_s = median(&fwd);
    let forward_groups_s = backward_groups_s.iter().map(|g| if backward_s > 0.0 { forward_s * g / backward_s } else { forward_s / groups as f64 }).collect();
    let point = ProfilePoint { micro: m, forward_s, backward_s, backward_groups_s, forward_groups_s, optimizer_s: median(&opt), step_s, logged_step_s, pass_spread_s, reps };
    Ok((point, st.plan.recompute))
}

fn profile_on<B: Backend>(be: &B, args: &BenchArgs, micros: &[usize], kind: &str, attention: String, ranks: usize, together: Together<'_>) -> anyhow::Result<Profile> {
    let mut points = Vec::new();
    let mut recompute = false;
    for &m in micros {
        let a = BenchArgs { micro: m, ..args.clone() };
        let (p, r) = profile_micro(be, &a, &mut *together)?;
        eprintln!(
            "profile micro {m}: forward {:.3} ms, backward {:.3} ms, optimizer {:.3} ms, whole step {:.3} ms, logged every step {:.3} ms",
            p.forward_s * 1e3,
            p.backward_s * 1e3,
            p.optimizer_s * 1e3,
            p.step_s * 1e3,
            p.logged_step_s * 1e3
        );
        points.push(p);
        recompute = r;
    }
    let s = super::setup(&BenchArgs { micro: micros[0], ..args.clone() })?;
    let cfg = s.cfg;
    let attention_saved_per_image = be.attention_saved_len(1, cfg.num_tokens(), cfg.num_heads, cfg.head_dim());
    let threads = if kind == "cpu" { rayon::current_num_threads() } else { 0 };
    let cores = if kind == "cpu" { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { 0 };
    Ok(Profile {
        format: PROFILE_FORMAT.into(),
        version: PROFILE_VERSION,
        device: be.name(),
        device_kind: kind.into(),
        threads,
        cores,
        ranks,
        model: args.model.clone(),
        params: crate::model::ParamTable::new(&cfg).total,
        model_config: cfg,
        dtype: if kind == "cpu" { "f32".into() } else { "bf16".into() },
        compute_bytes: if kind == "cpu" { 4.0 } else { 2.0 },
        attention_saved_per_image,
        graph: false,
        recompute,
        attention,
        optimizer: "AdamW".into(),
        forward_split: FORWARD_SPLIT.into(),
        points,
    })
}

/// Profiles `args.model` at each of `micros` (increasing, deduplicated here) on `args.device`:
/// alone, or under a launcher (`env`, CPU ranks) every rank at once, each with the threads the
/// launcher gave it. Every rank returns the profile it measured; rank 0's is the file.
pub fn measure_profile(args: &BenchArgs, micros: &[usize], env: &crate::comm::DistEnv) -> anyhow::Result<Profile> {
    let mut micros = micros.to_vec();
    micros.sort_unstable();
    micros.dedup();
    if micros.is_empty() || micros[0] == 0 {
        anyhow::bail!("--profile-micros: give one or more micro-batch sizes of at least 1");
    }
    let ranks = env.world_size.max(1);
    if ranks > 1 && args.device != "cpu" {
        anyhow::bail!("--profile-out under a launcher profiles CPU ranks side by side; on a GPU, profile one rank without a launcher");
    }
    match args.device.as_str() {
        "cpu" => {
            let mut comm = if ranks > 1 {
                let opts = crate::comm::CommOptions::from_config_and_env(300.0)?;
                // every rank must profile the same thing: the arguments are the rendezvous' hash
                let hash = format!("{:016x}", super::id_of(&format!("{args:?}")));
                Some(crate::comm::init_cpu(env, &opts, &hash)?)
            } else {
                None
            };
            let mut together = || -> anyhow::Result<()> {
                if let Some(c) = comm.as_mut() {
                    c.barrier()?;
                }
                Ok(())
            };
            profile_on(&crate::backend::cpu::Cpu::new(), args, &micros, "cpu", "cpu".into(), ranks, &mut together)
        }
        "cuda" | "gpu" => {
            let be = super::open_cuda(args, args.gpu)?;
            let att = be.attention_path().name().to_string();
            profile_on(&be, args, &micros, "cuda", att, 1, &mut || Ok(()))
        }
        other => anyhow::bail!("--device must be cuda or cpu, got {other:?}"),
    }
}
