//! Loader throughput (`cargo bench --bench data`): CIFAR 32-px crop+flip and 224-px JPEG
//! RandomResizedCrop+flip, images/s at 1 thread and at every core. Prints one JSON line per point.

fn main() {
    // `cargo bench` passes `--bench`; a number argument sets the seconds per point.
    let secs = std::env::args().skip(1).find_map(|a| a.parse::<f64>().ok()).unwrap_or(3.0);
    match vitscale::data::bench::run(0, secs) {
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
