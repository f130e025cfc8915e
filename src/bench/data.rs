//! Loader throughput, for `vitscale bench --data` and `cargo bench --bench data`: images per
//! second (and per core) for the pipelines that matter —
//! CIFAR-style 32-px random crop + flip from memory, 224-px RandomResizedCrop + flip from
//! JPEG files (decode included), and the same + RandAugment (`rand-m9-mstd0.5-inc1`, timm's
//! ViT recipe) — at 1 thread and at every core. BENCHMARKS.md keeps the measured numbers.
//!
//! Where one core's time goes on the 224-px JPEG path, each stage alone on one thread
//! ([`stage_points`]): reading the files (page cache), the full-size decode (zune-jpeg, the
//! `data.decode_scale = "full"` decoder: `jpeg_decode_only_full_size`; and libjpeg-turbo at
//! full size), the partial decode `"auto"` does for each image's RandomResizedCrop window, and
//! the whole per-image pipeline (read + decode + crop + flip + normalize) with each setting.
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
    /// Partial-decode points: decoded pixels as a fraction of the full-size images' pixels.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decoded_fraction: Option<f64>,
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
    Ok(BenchPoint { pipeline: pipeline.into(), threads, images, seconds, images_per_s: ips, images_per_s_per_core: ips / threads as f64, decoded_fraction: None })
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

/// Full-size JPEG decode alone (zune-jpeg, the `data.decode_scale = "full"` decoder; no crop, no
/// resampling) on `threads` threads: the figure to
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
    Ok(BenchPoint { pipeline: "jpeg_decode_only_full_size".into(), threads, images, seconds, images_per_s: ips, images_per_s_per_core: ips / threads as f64, decoded_fraction: None })
}

/// Rounds of [`alternate`].
pub const ROUNDS: usize = 5;

/// Times `a` and `b` as [`time_one_thread`] does, in [`ROUNDS`] alternating rounds of
/// `min_seconds / ROUNDS` each (after one warm-up pass over `warm` images each); returns each
/// one's (images, seconds) summed over its rounds.
fn alternate(warm: usize, min_seconds: f64, mut a: impl FnMut(usize) -> Result<(), DataError>, mut b: impl FnMut(usize) -> Result<(), DataError>) -> Result<((usize, f64), (usize, f64)), DataError> {
    let (mut ta, mut tb) = ((0, 0.0), (0, 0.0));
    for round in 0..ROUNDS {
        let w = if round == 0 { warm } else { 0 };
        let (ia, sa) = time_one_thread(w, min_seconds / ROUNDS as f64, &mut a)?;
        let (ib, sb) = time_one_thread(w, min_seconds / ROUNDS as f64, &mut b)?;
        ta = (ta.0 + ia, ta.1 + sa);
        tb = (tb.0 + ib, tb.1 + sb);
    }
    Ok((ta, tb))
}

/// Runs `one(k)` (image `k` of an endless sequence) on this thread for at least `min_seconds`
/// after a warm-up pass over `warm` images; returns (images, seconds).
fn time_one_thread(warm: usize, min_seconds: f64, mut one: impl FnMut(usize) -> Result<(), DataError>) -> Result<(usize, f64), DataError> {
    for k in 0..warm {
        one(k)?;
    }
    let t = Instant::now();
    let mut k = 0;
    while t.elapsed().as_secs_f64() < min_seconds {
        for _ in 0..16 {
            one(k)?;
            k += 1;
        }
    }
    Ok((k, t.elapsed().as_secs_f64()))
}

fn one_thread_point(pipeline: &str, (images, seconds): (usize, f64), decoded_fraction: Option<f64>) -> BenchPoint {
    let ips = images as f64 / seconds;
    BenchPoint { pipeline: pipeline.into(), threads: 1, images, seconds, images_per_s: ips, images_per_s_per_core: ips, decoded_fraction }
}

/// Each stage of the 224-px JPEG training path alone, on the calling thread (one core), over
/// `files` in turn, image `k` with the RandomResizedCrop window training would draw for it:
///
/// - `jpeg_file_read_only`: open + read each file into a reused buffer (the page cache after
///   the first pass: what the loader pays per file once the set is cached);
/// - `jpeg_decode_only_full_size_turbo`, `…_scale_1_2_turbo`, `…_scale_1_4_turbo`:
///   libjpeg-turbo decoding the whole image at full size, 1/2 and 1/4 (from memory);
/// - `jpeg224_decode_only_crop_scaled`: the `"auto"` decode, from memory: only the window's
///   rows and columns, at the DCT reduction the window allows (`decoded_fraction`: its decoded
///   pixels over the full images'); `jpeg128_…` the same for 128-px outputs, where windows of
///   256 px and more decode at 1/2;
/// - `jpeg224_rrc_flip_image_{auto,full}`: one image's whole CPU path — read, decode, crop +
///   resample to 224, flip, normalize to f32 — with each `data.decode_scale`.
///
/// The plain full-size decode and the `"auto"` path, which `bench --data` compares, are timed
/// in [`ROUNDS`] alternating rounds and each point sums its rounds: a core's speed drifts on a
/// shared host (clocks, neighbours), and two points timed one after the other can differ by
/// more than the paths do.
pub fn stage_points(files: &[PathBuf], min_seconds: f64) -> Result<Vec<BenchPoint>, DataError> {
    use crate::config::DecodeScale;
    use crate::data::{decode_window, jpeg, read_file, resize};
    let n = files.len();
    let bytes: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).map_err(|source| DataError::Io { path: f.clone(), source })).collect::<Result<_, _>>()?;
    let cfg = config(DatasetKind::Folder);
    let side = 224;
    let window = |k: usize, w: usize, h: usize| resize::draw_rrc(0, (k / n) as u64, k % n, w, h, cfg.scale, cfg.ratio);
    let (mut file, mut px) = (Vec::new(), Vec::new());
    let mut out = Vec::new();
    let t = time_one_thread(n, min_seconds, |k| read_file(&files[k % n], &mut file))?;
    out.push(one_thread_point("jpeg_file_read_only", t, None));
    let partial: &[(usize, &str)] = if jpeg::AVAILABLE { &[(2, "jpeg_decode_only_scale_1_2_turbo"), (4, "jpeg_decode_only_scale_1_4_turbo")] } else { &[] };
    // One image's whole CPU path with `scale`, into the given buffers.
    let whole_path = |k: usize, scale: DecodeScale, file: &mut Vec<u8>, px: &mut Vec<u8>, f32s: &mut [f32]| -> Result<(), DataError> {
        read_file(&files[k % n], file)?;
        let d = decode_window(file, scale, side, |w, h| window(k, w, h), px).map_err(|msg| DataError::Decode { path: files[k % n].clone(), msg })?;
        resize::resample(&px[..d.width * d.height * 3], d.width, d.height, d.region, side, d.flip, cfg.interpolation, cfg.mean, cfg.std, f32s);
        Ok(())
    };
    if jpeg::AVAILABLE {
        let (mut plain_px, mut path_px, mut path_file) = (Vec::new(), Vec::new(), Vec::new());
        let mut f32s = vec![0f32; 3 * side * side];
        let (plain, path) = alternate(
            n,
            min_seconds,
            |k| jpeg::decode_whole(&bytes[k % n], 1, &mut plain_px).map(|_| ()).map_err(|msg| DataError::Decode { path: files[k % n].clone(), msg }),
            |k| whole_path(k, DecodeScale::Auto, &mut path_file, &mut path_px, &mut f32s),
        )?;
        out.push(one_thread_point("jpeg_decode_only_full_size_turbo", plain, None));
        out.push(one_thread_point("jpeg224_rrc_flip_image_auto", path, None));
    }
    for &(r, name) in partial {
        let t = time_one_thread(n, min_seconds, |k| jpeg::decode_whole(&bytes[k % n], r, &mut px).map(|_| ()).map_err(|msg| DataError::Decode { path: files[k % n].clone(), msg }))?;
        out.push(one_thread_point(name, t, None));
    }
    for out_side in if jpeg::AVAILABLE { vec![side, 128] } else { vec![] } {
        let (mut decoded, mut full) = (0f64, 0f64);
        let t = time_one_thread(n, min_seconds, |k| {
            let p = jpeg::decode(&bytes[k % n], |w, h| Some((window(k, w, h).0, out_side)), &mut px).map_err(|msg| DataError::Decode { path: files[k % n].clone(), msg })?;
            decoded += (p.width * p.height) as f64;
            full += (p.source.0 * p.source.1) as f64;
            Ok(())
        })?;
        out.push(one_thread_point(&format!("jpeg{out_side}_decode_only_crop_scaled"), t, Some(decoded / full)));
    }
    let mut f32s = vec![0f32; 3 * side * side];
    // (with libjpeg-turbo the `"auto"` point was timed above, against the plain decode)
    let scales: &[DecodeScale] = if jpeg::AVAILABLE { &[DecodeScale::Full] } else { &[DecodeScale::Auto, DecodeScale::Full] };
    for &scale in scales {
        let t = time_one_thread(n, min_seconds, |k| whole_path(k, scale, &mut file, &mut px, &mut f32s))?;
        out.push(one_thread_point(&format!("jpeg224_rrc_flip_image_{}", scale.as_str()), t, None));
    }
    Ok(out)
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
    Ok(BenchPoint { pipeline: format!("{pipeline}_loader"), threads, images, seconds, images_per_s: ips, images_per_s_per_core: ips / threads as f64, decoded_fraction: None })
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

/// Runs both pipelines at 1 thread and at `threads` (0 = all cores), each for `min_seconds`,
/// and the one-thread [`stage_points`] of the JPEG path.
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
    let mut fullcfg = fcfg.clone();
    fullcfg.decode_scale = crate::config::DecodeScale::Full;
    let result = (|| -> Result<(), DataError> {
        out.extend(stage_points(&decode_files, min_seconds)?);
        for &t in &counts {
            out.push(measure_decode_only(&decode_files, t, min_seconds)?);
            out.push(measure("jpeg224_rrc_flip", &set, &fcfg, 128, t, min_seconds)?);
            out.push(measure("jpeg224_rrc_flip_full_decode", &set, &fullcfg, 128, t, min_seconds)?);
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
        out.push(BenchPoint { pipeline: format!("jpeg224_rrc_flip_{tag}_decode_only"), threads: 0, images, seconds, images_per_s: ips, images_per_s_per_core: f64::NAN, decoded_fraction: None });
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
        out.push(BenchPoint { pipeline: format!("jpeg224_rrc_flip_{tag}_loader"), threads, images, seconds, images_per_s: ips, images_per_s_per_core: ips / threads as f64, decoded_fraction: None });
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
    crate::outln!("{:<44} {:>7} {:>12} {:>14} {:>8}", "pipeline", "threads", "images/s", "images/s/core", "decoded");
    for p in &points {
        let frac = p.decoded_fraction.map_or(String::new(), |f| format!("{:.0} %", f * 100.0));
        crate::outln!("{:<44} {:>7} {:>12.0} {:>14.0} {:>8}", p.pipeline, p.threads, p.images_per_s, p.images_per_s_per_core, frac);
    }
    let ratio = path_against_plain_decode(&points);
    if let Some(r) = ratio {
        crate::outln!("one core: the 224-px CPU path (read, decode, crop, flip, normalize) at {:.1} % of a plain full-size libjpeg-turbo decode", 100.0 * r);
    }
    if json {
        crate::outln!("{}", serde_json::json!({ "cores": cores, "load_average": load, "points": points, "cpu_path_vs_plain_decode": ratio }));
    }
    Ok(())
}

/// The one-thread images/s of the whole `"auto"` path over those of libjpeg-turbo decoding the
/// same files whole at full size, both from [`stage_points`] of one run (None without the
/// `turbojpeg` feature or a JPEG folder's points).
fn path_against_plain_decode(points: &[BenchPoint]) -> Option<f64> {
    let rate = |name: &str| points.iter().find(|p| p.pipeline == name && p.threads == 1).map(|p| p.images_per_s);
    let (path, plain) = (rate("jpeg224_rrc_flip_image_auto")?, rate("jpeg_decode_only_full_size_turbo")?);
    (plain > 0.0).then(|| path / plain)
}

#[cfg(test)]
mod ratio {
    use super::*;

    fn point(pipeline: &str, threads: usize, ips: f64) -> BenchPoint {
        BenchPoint { pipeline: pipeline.into(), threads, images: 1, seconds: 1.0, images_per_s: ips, images_per_s_per_core: ips / threads as f64, decoded_fraction: None }
    }

    #[test]
    fn the_two_compared_points_alternate_and_sum_their_rounds() {
        use std::cell::RefCell;
        let order = RefCell::new(Vec::new());
        let ((ia, sa), (ib, sb)) = alternate(3, 0.01, |_| Ok(order.borrow_mut().push('a')), |_| Ok(order.borrow_mut().push('b'))).unwrap();
        let order = order.into_inner();
        // 2·ROUNDS runs, each switching to the other closure: a, b, a, b, …
        let mut runs: Vec<(char, usize)> = Vec::new();
        for &c in &order {
            match runs.last_mut() {
                Some((last, n)) if *last == c => *n += 1,
                _ => runs.push((c, 1)),
            }
        }
        assert_eq!(runs.len(), 2 * ROUNDS, "{runs:?}");
        assert!(runs.iter().enumerate().all(|(i, &(c, _))| c == if i % 2 == 0 { 'a' } else { 'b' }), "{runs:?}");
        // the warm-up (3 images each, first round only) is run but not counted
        let (na, nb) = (order.iter().filter(|&&c| c == 'a').count(), order.iter().filter(|&&c| c == 'b').count());
        assert_eq!((ia + 3, ib + 3), (na, nb));
        // each round lasts at least its share of the time
        assert!(sa >= 0.0099 && sb >= 0.0099, "{sa} {sb}");
    }

    #[test]
    fn the_path_is_compared_with_the_plain_decode_on_one_thread() {
        let pts = [point("jpeg224_rrc_flip_image_auto", 4, 9000.0), point("jpeg224_rrc_flip_image_auto", 1, 1500.0), point("jpeg_decode_only_full_size_turbo", 1, 1600.0)];
        assert_eq!(path_against_plain_decode(&pts), Some(1500.0 / 1600.0));
        // without the libjpeg-turbo points (no turbojpeg feature) there is nothing to compare
        assert_eq!(path_against_plain_decode(&pts[..2]), None);
        assert_eq!(path_against_plain_decode(&[point("jpeg_decode_only_full_size_turbo", 1, 0.0), point("jpeg224_rrc_flip_image_auto", 1, 5.0)]), None);
    }
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
            resize::resample_rows(im.as_raw(), w, h, r, side, flip, cfg.interpolation, |_, [_, g, _]| sum += g[1]);
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
