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
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(args) => cli::train_cmd(args),
        Command::Eval(args) => cli::eval_cmd(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
