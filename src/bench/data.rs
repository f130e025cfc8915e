//! Loader throughput, for `vitscale bench --data` and `cargo bench --bench data`: images per
//! second (and per core) for the pipelines that matter —
//! CIFAR-style 32-px random crop + flip from memory, 224-px RandomResizedCrop + flip from
//! JPEG files (decode included), and the same + RandAugment (`rand-m9-mstd0.5-inc1`, timm's
//! ViT recipe) — at 1 thread and at every core. BENCHMARKS.md keeps the measured numbers.
//!
//! Inputs are generated (no dataset download): 32-px random images for the CIFAR path, and
//! 500×375 JPEGs (ImageNet's typical size and quality 90, smooth content plus noise so the
//! entropy decoder has real work) written to a temporary folder for the JPEG path, or the JPEGs
//! of a given folder.
//!
//! BENCHMARKS.md ("Data loader") has the current figures, beside torchvision's
//! (`peers/loader_bench.py`) on the same files.
//!

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use crate::data::synthetic::{self, write_jpegs};
use crate::data::{fill_batch, Batch, DataError, ImageSet, Loader, LoaderPlan, Sampler};
use crate::config::{DataConfig, DatasetKind};

/// One measured point.
#[derive(Clone, Debug, Serialize)]
pub struct BenchPoint {
    pub pipeline: String,
    pub threads: usize,
    pub images: usize,
    pub seconds: f64,
    pub images_per_s: f64,
    pub images_per_s_per_core: f64,
}

fn config(dataset: DatasetKind) -> DataConfig {
    DataConfig::for_dataset(dataset, None, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
}

/// Batches of `batch` images from `set` on a pool of `threads`, for at least `min_seconds`.
fn measure(pipeline: &str, set: &ImageSet, cfg: &DataConfig, batch: usize, threads: usize, min_seconds: f64) -> Result<BenchPoint, DataError> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| DataError::Invalid { key: "bench", msg: format!("thread pool: {e}") })?;
    let mut b = Batch::default();
    let n = set.len();
    let idx = |k: usize| -> Vec<usize> { (0..batch).map(|j| (k * batch + j) % n).collect() };
    // Warm-up: first-touch allocation of the output buffer and thread start-up.
    pool.install(|| fill_batch(&mut b, set, &idx(0), cfg, true, 0, 0))?;
    let t = Instant::now();
    let mut images = 0;
    let mut k = 1;
    while t.elapsed().as_secs_f64() < min_seconds {
        pool.install(|| fill_batch(&mut b, set, &idx(k), cfg, true, 0, 0))?;
        images += batch;
        k += 1;
    }
    let seconds = t.elapsed().as_secs_f64();
    let ips = images as f64 / seconds;
    Ok(BenchPoint { pipeline: pipeline.into(), threads, images, seconds, images_per_s: ips, images_per_s_per_core: ips / threads as f64 })
}

/// One rank's training batches of `batch` images from `set`, on and on, built by `threads`
/// loader threads with 4 batches of prefetch.
fn endless_plan(set: &Arc<ImageSet>, cfg: &DataConfig, batch: usize, threads: usize) -> LoaderPlan {
    let mut cfg = cfg.clone();
    cfg.num_workers = threads;
    cfg.prefetch = 4;
    LoaderPlan {
        set: set.clone(),
        sampler: Sampler::new(set.len(), batch, true, 0, false),
        cfg,
        train: true,
        seed: 0,
        rank: 0,
        world: 1,
        gas: 1,
        start_epoch: 0,
        start_step: 0,
        steps: u64::MAX,
        mix: None,
    }
}

/// Full-size JPEG decode alone (no crop, no resampling) on `threads` threads: the figure to
/// hold against another decoder's (torchvision's `decode_jpeg`, PIL) on the same files.
fn measure_decode_only(files: &[PathBuf], threads: usize, min_seconds: f64) -> Result<BenchPoint, DataError> {
    use rayon::prelude::*;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| DataError::Invalid { key: "bench", msg: format!("thread pool: {e}") })?;
    let bytes: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).map_err(|source| DataError::Io { path: f.clone(), source })).collect::<Result<_, _>>()?;
    let round = |k: usize| -> Result<(), DataError> {
        pool.install(|| {
            (0..threads * 8).into_par_iter().try_for_each_init(Vec::new, |px, j| {
                let i = (k * threads * 8 + j) % bytes.len();
                crate::core::encoded::decode_rgb(&bytes[i], px).map(|_| ()).map_err(|msg| DataError::Decode { path: files[i].clone(), msg })
            })
        })
    };
    round(0)?;
    let t = Instant::now();
    let (mut images, mut k) = (0, 1);
    while t.elapsed().as_secs_f64() < min_seconds {
        round(k)?;
        images += threads * 8;
        k += 1;
    }
    let seconds = t.elapsed().as_secs_f64();
    let ips = images as f64 / seconds;
    Ok(BenchPoint { pipeline: "jpeg_decode_only_full_size".into(), threads, images, seconds, images_per_s: ips, images_per_s_per_core: ips / threads as f64 })
}

/// The same through a [`Loader`] (`num_workers = threads`, prefetch 4) consumed as fast as it
/// produces: what a training loop would see.
fn measure_loader(pipeline: &str, set: &Arc<ImageSet>, cfg: &DataConfig, batch: usize, threads: usize, min_seconds: f64) -> Result<BenchPoint, DataError> {
    let mut loader = Loader::start(endless_plan(set, cfg, batch, threads))?;
    // Warm-up: the first window.
    for _ in 0..4 {
        if let Some(p) = loader.next() {
            loader.recycle(p?.batch);
        }
    }
    let t = Instant::now();
    let mut images = 0;
    while t.elapsed().as_secs_f64() < min_seconds {
        match loader.next() {
            Some(p) => {
                let p = p?;
                images += p.batch.len();
                loader.recycle(p.batch);
            }
            None => break,
        }
    }
    let seconds = t.elapsed().as_secs_f64();
    let ips = images as f64 / seconds;
    Ok(BenchPoint { pipeline: format!("{pipeline}_loader"), threads, images, seconds, images_per_s: ips, images_per_s_per_core: ips / threads as f64 })
}

/// The `.jpg` files directly in `dir`, sorted.
fn jpegs_in(dir: &Path) -> Result<Vec<PathBuf>, DataError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| DataError::Io { path: dir.to_path_buf(), source })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("jpg") || e.eq_ignore_ascii_case("jpeg")))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(DataError::NotFound { dataset: "bench", split: "jpeg", dir: dir.to_path_buf(), expected: "*.jpg files".into() });
    }
    Ok(files)
}

/// Runs both pipelines at 1 thread and at `threads` (0 = all cores), each for `min_seconds`.
/// The JPEG pipeline reads the `.jpg` files of `jpeg_dir` when given (to compare with another
/// loader on the very same files), else generated ones.
pub fn run(threads: usize, min_seconds: f64, jpeg_dir: Option<&Path>) -> Result<Vec<BenchPoint>, DataError> {
    let all = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
    let mut counts = vec![1];
    if all > 1 {
        counts.push(all);
    }
    let mut out = Vec::new();

    let cifar = synthetic::generate(10_000, 32, 10, 0, 0);
    let ccfg = config(DatasetKind::Cifar10);
    for &t in &counts {
        out.push(measure("cifar32_crop_flip", &cifar, &ccfg, 256, t, min_seconds)?);
    }

    let dir = std::env::temp_dir().join(format!("vitscale-bench-jpeg-{}", std::process::id()));
    let files = match jpeg_dir {
        Some(d) => jpegs_in(d)?,
        None => write_jpegs(&dir, 64, 1)?,
    };
    let labels = vec![0u16; files.len()];
    let decode_files = files.clone();
    let set = Arc::new(ImageSet::from_files(files, labels, 224, 1));
    let fcfg = config(DatasetKind::Folder);
    let mut racfg = fcfg.clone();
    racfg.aug.auto_augment = crate::config::parse_rand_augment("rand-m9-mstd0.5-inc1")
        .map_err(|msg| DataError::Invalid { key: "data.auto_augment", msg })?;
    let result = (|| -> Result<(), DataError> {
        for &t in &counts {
            out.push(measure_decode_only(&decode_files, t, min_seconds)?);
            out.push(measure("jpeg224_rrc_flip", &set, &fcfg, 128, t, min_seconds)?);
            out.push(measure_loader("jpeg224_rrc_flip", &set, &fcfg, 32, t, min_seconds)?);
            out.push(measure_loader("jpeg224_rrc_flip_randaug", &set, &racfg, 32, t, min_seconds)?);
        }
        Ok(())
    })();
    if jpeg_dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result?;
    Ok(out)
}

/// GPU decode (`data.decode = "gpu"`) of the 224-px RandomResizedCrop + flip pipeline on
/// `be`: a [`Loader`] of `threads` threads reads the files and draws the crops, the device
/// decodes (nvJPEG), resamples, flips and normalizes each micro-batch of `batch` into a bf16
/// input buffer; images per second until every batch is on the device. `_decode_only` repeats
/// one batch already read, so no file reading or loader thread is in the figure.
pub fn gpu_decode_points(be: &crate::backend::cuda::Cuda, jpeg_dir: Option<&Path>, batch: usize, thread_counts: &[usize], min_seconds: f64) -> anyhow::Result<Vec<BenchPoint>> {
    use crate::backend::Backend;
    let dir = std::env::temp_dir().join(format!("vitscale-bench-gpujpeg-{}", std::process::id()));
    let files = match jpeg_dir {
        Some(d) => jpegs_in(d)?,
        None => write_jpegs(&dir, 256, 1)?,
    };
    let labels = vec![0u16; files.len()];
    let set = Arc::new(ImageSet::from_files(files, labels, 224, 1));
    let mut cfg = config(DatasetKind::Folder);
    cfg.decode = crate::config::Decode::Gpu;
    let mut input = be.alloc(batch * 3 * 224 * 224)?;
    let mut out = Vec::new();
    let engines = be.jpeg_engines().map_err(|e| anyhow::anyhow!(e))?;
    let tag = if engines > 0 { "gpu_decode_hw" } else { "gpu_decode_hybrid" };
    // decode only: one batch read once, decoded again and again
    {
        let mut b = Batch::default();
        let idx: Vec<usize> = (0..batch).map(|j| j % set.len()).collect();
        fill_batch(&mut b, &set, &idx, &cfg, true, 0, 0)?;
        let enc = b.encoded.as_ref().ok_or_else(|| anyhow::anyhow!("the loader built no encoded batch"))?;
        be.decode_input(&mut input, enc, 0..batch)?;
        be.synchronize()?;
        let t = Instant::now();
        let mut images = 0;
        while t.elapsed().as_secs_f64() < min_seconds {
            be.decode_input(&mut input, enc, 0..batch)?;
            images += batch;
        }
        be.synchronize()?;
        let seconds = t.elapsed().as_secs_f64();
        let ips = images as f64 / seconds;
        out.push(BenchPoint { pipeline: format!("jpeg224_rrc_flip_{tag}_decode_only"), threads: 0, images, seconds, images_per_s: ips, images_per_s_per_core: f64::NAN });
    }
    for &threads in thread_counts {
        let mut loader = Loader::start(endless_plan(&set, &cfg, batch, threads))?;
        let mut next = |input: &mut crate::backend::cuda::CudaBuf| -> anyhow::Result<usize> {
            let p = loader.next().ok_or_else(|| anyhow::anyhow!("loader ended"))??;
            let n = p.batch.len();
            let enc = p.batch.encoded.as_ref().ok_or_else(|| anyhow::anyhow!("the loader built no encoded batch"))?;
            be.decode_input(input, enc, 0..n)?;
            loader.recycle(p.batch);
            Ok(n)
        };
        for _ in 0..4 {
            next(&mut input)?;
        }
        be.synchronize()?;
        let t = Instant::now();
        let mut images = 0;
        while t.elapsed().as_secs_f64() < min_seconds {
            images += next(&mut input)?;
        }
        be.synchronize()?;
        let seconds = t.elapsed().as_secs_f64();
        let ips = images as f64 / seconds;
        out.push(BenchPoint { pipeline: format!("jpeg224_rrc_flip_{tag}_loader"), threads, images, seconds, images_per_s: ips, images_per_s_per_core: ips / threads as f64 });
    }
    if jpeg_dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(out)
}

/// `vitscale bench --data`: runs [`run`] and prints a table (and with `json`, one JSON object
/// `{"machine": …, "points": […]}` as the last line).
/// With `gpu` (`--device cuda`), the GPU decode points follow (`gpu_decode_points`, micro-batch
/// 256, loader threads 1, 2 and 4).
pub fn command(threads: usize, min_seconds: f64, jpeg_dir: Option<&Path>, json: bool, gpu: Option<usize>) -> anyhow::Result<()> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let load = std::fs::read_to_string("/proc/loadavg").ok().and_then(|l| l.split_whitespace().next().map(str::to_string));
    eprintln!("data loader benchmark: {cores} cores, load average {}", load.as_deref().unwrap_or("unknown"));
    let mut points = run(threads, min_seconds, jpeg_dir)?;
    if let Some(index) = gpu {
        let be = crate::backend::cuda::Cuda::new(index)?;
        points.extend(gpu_decode_points(&be, jpeg_dir, 256, &[1, 2, 4], min_seconds)?);
    }
    crate::outln!("{:<44} {:>7} {:>12} {:>14}", "pipeline", "threads", "images/s", "images/s/core");
    for p in &points {
        crate::outln!("{:<44} {:>7} {:>12.0} {:>14.0}", p.pipeline, p.threads, p.images_per_s, p.images_per_s_per_core);
    }
    if json {
        crate::outln!("{}", serde_json::json!({ "cores": cores, "load_average": load, "points": points }));
    }
    Ok(())
}

#[cfg(test)]
mod timing {
    use super::*;
    use crate::data::{decode, randaug, resize};

    /// Process CPU time, standing in for `std::time::Instant` here: on a shared machine it
    /// does not count the time other processes hold the core.
    struct Instant(f64);

    impl Instant {
        fn now() -> Self {
            let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // SAFETY: clock_gettime writes the timespec it is given.
            unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
            Instant(t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9)
        }

        fn elapsed(&self) -> std::time::Duration {
            std::time::Duration::from_secs_f64((Instant::now().0 - self.0).max(0.0))
        }
    }

    /// Per-stage cost (process CPU time) of one 224-px training image from a generated 500×375
    /// JPEG (`cargo test --release --lib stage_timings -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn stage_timings() {
        let dir = std::env::temp_dir().join(format!("vitscale-stage-timings-{}", std::process::id()));
        let files = write_jpegs(&dir, 16, 1).unwrap();
        let n = 64;
        let t = Instant::now();
        let imgs: Vec<_> = (0..n).map(|i| decode(&files[i % files.len()]).unwrap()).collect();
        eprintln!("decode (first touch): {:.3} ms", t.elapsed().as_secs_f64() * 1e3 / n as f64);
        let bytes: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
        for round in 0..2 {
            let t = Instant::now();
            for i in 0..n {
                let im = image::load_from_memory(&bytes[i % files.len()]).unwrap().into_rgb8();
                std::hint::black_box(&im);
            }
            let via_image = t.elapsed().as_secs_f64() * 1e3 / n as f64;
            let (mut file, mut px) = (Vec::new(), Vec::new());
            let t = Instant::now();
            for i in 0..n {
                crate::data::decode_into(&files[i % files.len()], &mut file, &mut px).unwrap();
                std::hint::black_box(&px);
            }
            let direct = t.elapsed().as_secs_f64() * 1e3 / n as f64;
            eprintln!("decode round {round}: image crate from memory {via_image:.3} ms, direct zune-jpeg incl. file read {direct:.3} ms");
        }
        let side = 224;
        let mut out = vec![0f32; 3 * side * side];
        let cfg = config(DatasetKind::Folder);
        let t = Instant::now();
        for (i, im) in imgs.iter().enumerate() {
            let (w, h) = (im.width() as usize, im.height() as usize);
            let (r, flip) = resize::draw_rrc(0, 0, i, w, h, cfg.scale, cfg.ratio);
            resize::resample(im.as_raw(), w, h, r, side, flip, cfg.interpolation, cfg.mean, cfg.std, &mut out);
        }
        eprintln!("resample (f32 CHW): {:.3} ms", t.elapsed().as_secs_f64() * 1e3 / n as f64);
        let mut out8 = vec![0u8; 3 * side * side];
        let t = Instant::now();
        for (i, im) in imgs.iter().enumerate() {
            let (w, h) = (im.width() as usize, im.height() as usize);
            let (r, flip) = resize::draw_rrc(0, 0, i, w, h, cfg.scale, cfg.ratio);
            resize::resample_u8(im.as_raw(), w, h, r, side, flip, cfg.interpolation, &mut out8);
        }
        eprintln!("resample (u8 HWC): {:.3} ms", t.elapsed().as_secs_f64() * 1e3 / n as f64);
        let t = Instant::now();
        let mut sum = 0f32;
        for (i, im) in imgs.iter().enumerate() {
            let (w, h) = (im.width() as usize, im.height() as usize);
            let (r, flip) = resize::draw_rrc(0, 0, i, w, h, cfg.scale, cfg.ratio);
            resize::resample_rows(im.as_raw(), w, h, r, side, flip, cfg.interpolation, |_, row| sum += row[5]);
        }
        eprintln!("resample (rows only): {:.3} ms {sum}", t.elapsed().as_secs_f64() * 1e3 / n as f64);
        let ra = crate::config::parse_rand_augment("rand-m9-mstd0.5-inc1").unwrap().unwrap();
        let mut px = vec![0u8; 3 * side * side];
        let mut scratch = Vec::new();
        let t = Instant::now();
        for i in 0..n {
            randaug::apply(&ra, &mut px, side, [124, 116, 104], 0, 0, i, &mut scratch);
        }
        eprintln!("randaug ops only: {:.3} ms", t.elapsed().as_secs_f64() * 1e3 / n as f64);
        let set = ImageSet::from_files(files.clone(), vec![0; files.len()], side, 1);
        let mut racfg = cfg.clone();
        racfg.aug.auto_augment = Some(ra);
        let idx: Vec<usize> = (0..n).collect();
        let mut b = Batch::default();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        for (name, c) in [("rrc+flip", &cfg), ("rrc+flip+randaug", &racfg)] {
            pool.install(|| fill_batch(&mut b, &set, &idx, c, true, 0, 0)).unwrap();
            let t = Instant::now();
            pool.install(|| fill_batch(&mut b, &set, &idx, c, true, 0, 0)).unwrap();
            eprintln!("fill_batch {name}: {:.3} ms/image", t.elapsed().as_secs_f64() * 1e3 / n as f64);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
