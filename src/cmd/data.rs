//! `vitscale data`: dataset tools. `data pack` writes an image folder as tar shards
//! (`data::shards`) for `data.dataset=shards`.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use crate::data::shards;

/// Command-line options of `vitscale data`.
#[derive(Args, Debug)]
pub struct DataArgs {
    #[command(subcommand)]
    pub command: DataCommand,
}

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Pack an image folder (the layout data.dataset=folder reads) into WebDataset-layout tar
    /// shards (KEY.jpg|png|webp + KEY.cls) and an index.json, for data.dataset=shards.
    Pack(PackArgs),
}

/// Options of `vitscale data pack`.
#[derive(Args, Debug)]
pub struct PackArgs {
    /// The image folder: FOLDER/train/<class>/… + FOLDER/val/<class>/…, or FOLDER/<class>/…
    /// (split by --val-split and --seed, as data.val_split and train.seed split it).
    pub folder: PathBuf,
    /// Output directory (must not exist, or be empty): OUT/train-000000.tar …, OUT/val-000000.tar …, OUT/index.json.
    pub out: PathBuf,
    /// Largest shard: bytes or a size with a unit (512MiB, 1GB, 1.5G; k/M/G/T = powers of 1000,
    /// KiB/MiB/GiB/TiB = powers of 1024). Default 512MiB unless --shard-images alone is given.
    #[arg(long, value_name = "SIZE", value_parser = shards::parse_size)]
    pub shard_size: Option<u64>,
    /// Most images per shard (with --shard-size too, a shard closes at whichever comes first).
    #[arg(long, value_name = "N")]
    pub shard_images: Option<usize>,
    /// Folder without train/ + val/: the fraction of each class held out for validation.
    #[arg(long, default_value_t = 0.1)]
    pub val_split: f64,
    /// Folder without train/ + val/: the seed of that split (use the run's train.seed to hold
    /// out the images data.dataset=folder would).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `vitscale data`.
pub fn run(args: DataArgs) -> anyhow::Result<()> {
    match args.command {
        DataCommand::Pack(a) => pack(a),
    }
}

fn pack(a: PackArgs) -> anyhow::Result<()> {
    const DEFAULT_SHARD_BYTES: u64 = 512 << 20;
    let max_bytes = match (a.shard_size, a.shard_images) {
        (None, None) => Some(DEFAULT_SHARD_BYTES),
        (b, _) => b,
    };
    let opts = shards::PackOptions { max_bytes, max_images: a.shard_images, val_split: a.val_split, seed: a.seed };
    let r = shards::pack(&a.folder, &a.out, &opts)?;
    println!(
        "packed {} ({} classes): {} train images in {} / {} val images in {}, {:.1} MiB, into {}",
        r.layout,
        r.classes,
        r.train.0,
        crate::util::plural(r.train.1, "shard", "shards"),
        r.val.0,
        crate::util::plural(r.val.1, "shard", "shards"),
        r.bytes as f64 / (1u64 << 20) as f64,
        a.out.display()
    );
    Ok(())
}
