//! The `vitscale` command line: parse, dispatch. Commands live in `vitscale::cli`.

use clap::{Parser, Subcommand};

use vitscale::cli::{self, EvalArgs, TrainArgs};

#[derive(Parser)]
#[command(name = "vitscale", version, about = "Train Vision Transformers on CPU and GPUs, and measure how training scales")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a ViT (defaults: CPU, built-in dataset, small model).
    Train(TrainArgs),
    /// Evaluate weights on a dataset split.
    Eval(EvalArgs),
    // -- added by the cuda branch: backend parity checks and the throughput benchmark
    /// Check every backend op and a short training run against the CPU reference.
    Selftest(vitscale::selftest::SelftestArgs),
    /// Training-step throughput, MFU and peak memory on synthetic device-resident data.
    Bench(vitscale::bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => cli::train_cmd(args),
        Command::Eval(args) => cli::eval_cmd(args),
        Command::Selftest(args) => vitscale::selftest::selftest(&args).and_then(|ok| if ok { Ok(()) } else { Err(anyhow::anyhow!("selftest failed")) }),
        Command::Bench(args) => vitscale::bench::bench(&args).map(|_| ()),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
