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
    /// Start a data-parallel run: N workers here, or one launcher per host of a hostfile.
    Launch(vitscale::launch::LaunchArgs),
    /// Check every backend op and a short training run against the CPU reference.
    Selftest(vitscale::selftest::SelftestArgs),
    /// Training-step throughput, MFU and peak memory on synthetic device-resident data
    /// (`--data`: data-loader throughput instead).
    Bench(vitscale::bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        // The launcher's exit code is its workers' (the failing rank's status, 128 + signal).
        Command::Launch(args) => match vitscale::launch::run(args) {
            Ok(code) => std::process::exit(code),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(e.exit_code());
            }
        },
        Command::Train(args) => cli::train_cmd(args),
        Command::Eval(args) => cli::eval_cmd(args),
        Command::Selftest(args) => vitscale::selftest::selftest(&args).and_then(|ok| if ok { Ok(()) } else { Err(anyhow::anyhow!("selftest failed")) }),
        Command::Bench(args) if args.data => vitscale::data::bench::command(args.threads, args.secs, args.jpeg_dir.as_deref(), args.json),
        Command::Bench(args) => vitscale::bench::bench(&args).map(|_| ()),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(cli::exit_code(&e));
    }
}
