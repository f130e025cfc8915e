//! The `vitscale` command line: parse, dispatch, and end with the command's exit code. The
//! commands live in `vitscale::cmd`.

use clap::{Parser, Subcommand};

use vitscale::cmd;

/// A refused allocation ends with an error message and status 1, not an abort.
#[global_allocator]
static ALLOC: vitscale::util::ReportingAlloc = vitscale::util::ReportingAlloc;

#[derive(Parser)]
#[command(name = "vitscale", version, about = "Train Vision Transformers on CPU and GPUs, and measure how training scales")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a ViT (defaults: a GPU when one is usable, else the CPU; built-in dataset; small model).
    Train(cmd::train::TrainArgs),
    /// Evaluate weights on a dataset split.
    Eval(cmd::eval::EvalArgs),
    /// Start a data-parallel run: N workers here, or one launcher per host of a hostfile.
    Launch(cmd::launch::LaunchArgs),
    /// Check every backend op and a short training run against the CPU reference.
    Selftest(cmd::selftest::SelftestArgs),
    /// Training-step throughput, MFU and peak memory on synthetic device-resident data
    /// (`--data`: data-loader throughput instead).
    Bench(cmd::bench::BenchArgs),
    /// Run every point of a sweep spec (a grid over config keys and rank counts) into a directory.
    Sweep(cmd::sweep::SweepArgs),
    /// Write report.md, report.html and charts for a sweep directory.
    Report(cmd::report::ReportArgs),
    /// Predict step time, throughput and memory on a cluster from a compute profile; rank
    /// batch choices; validate the model against a sweep.
    Plan(cmd::plan::PlanArgs),
    /// Dataset tools: `data pack` writes an image folder as tar shards for data.dataset=shards.
    Data(cmd::data::DataArgs),
}

fn main() {
    // Before any thread or CUDA call: see `request_hardware_queues`.
    vitscale::backend::cuda::libs::request_hardware_queues();
    let cli = Cli::parse();
    // The main thread is the global rayon pool's first thread (RAYON_NUM_THREADS threads in
    // all, as before): a parallel loop started here runs on it and the others steal from it,
    // instead of the main thread handing every loop to the pool and sleeping until a pool
    // thread wakes it. A CPU step runs thousands of such loops; on a virtual machine each
    // hand-off wakes a halted core, whose latency varies with the host's load. A pool already
    // built (nothing builds one before this) is left as it is.
    let _ = rayon::ThreadPoolBuilder::new().use_current_thread().build_global();
    let result = match cli.command {
        // The launcher ends with its workers' exit code.
        Command::Launch(args) => cmd::launch::run(args),
        Command::Train(args) => cmd::train::run(args).map(|()| 0),
        Command::Eval(args) => cmd::eval::run(args).map(|()| 0),
        Command::Selftest(args) => cmd::selftest::run(args).map(|()| 0),
        Command::Bench(args) => cmd::bench::run(args).map(|()| 0),
        Command::Sweep(args) => cmd::sweep::run(args).map(|()| 0),
        Command::Report(args) => cmd::report::run(args).map(|()| 0),
        Command::Plan(args) => cmd::plan::run(args).map(|()| 0),
        Command::Data(args) => cmd::data::run(args).map(|()| 0),
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {}", cmd::error_message(&e));
            std::process::exit(cmd::exit_code(&e));
        }
    }
}
