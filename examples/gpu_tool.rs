//! Stand-alone entry to `selftest` and `bench` (the same code as `vitscale selftest|bench`),
//! usable while the main CLI is being wired: `cargo run --release --example gpu_tool -- bench`.

use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    Selftest(vitscale::selftest::SelftestArgs),
    Bench(vitscale::bench::BenchArgs),
}

fn main() {
    let r = match Cli::parse().command {
        Command::Selftest(a) => vitscale::selftest::selftest(&a).and_then(|ok| if ok { Ok(()) } else { Err(anyhow::anyhow!("selftest failed")) }),
        Command::Bench(a) => vitscale::bench::bench(&a).map(|_| ()),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
