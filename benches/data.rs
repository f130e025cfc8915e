//! Loader throughput (`cargo bench --bench data [-- SECONDS] [--threads N] [--jpeg-dir DIR]`):
//! CIFAR 32-px crop+flip and 224-px JPEG RandomResizedCrop+flip, images/s at 1 thread and at N
//! threads (default: every core). Prints one JSON line per point.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut secs = 3.0;
    let mut threads = 0;
    let mut jpeg_dir = None;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--threads" => {
                threads = args.get(i + 1).and_then(|a| a.parse().ok()).unwrap_or(0);
                i += 1;
            }
            "--jpeg-dir" => {
                jpeg_dir = args.get(i + 1).map(std::path::PathBuf::from);
                i += 1;
            }
            // `cargo bench` adds `--bench`; a bare number is the seconds per point.
            a => {
                if let Ok(s) = a.parse::<f64>() {
                    secs = s;
                }
            }
        }
        i += 1;
    }
    match vitscale::bench::data::run(threads, secs, jpeg_dir.as_deref()) {
        Ok(points) => {
            for p in points {
                println!("{}", serde_json::to_string(&p).unwrap_or_default());
            }
        }
        Err(e) => {
            eprintln!("bench data: {e}");
            std::process::exit(1);
        }
    }
}
