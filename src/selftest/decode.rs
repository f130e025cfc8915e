//! GPU image decode (`data.decode = "gpu"`) against the CPU pipeline: the same encoded batch
//! (real photographs, colour and greyscale, and a decoded RGB image) decoded, cropped, flipped
//! and normalized by the device and by `data::resize` on the CPU decoder's pixels.
//!
//! Two tolerances, because two things differ. Images handed over already decoded (the RGB
//! path) isolate the resampling kernels: they must agree with the CPU to float rounding
//! (≤ 0.05 of a pixel level, on a 0..255 scale). JPEGs add the decoders' own differences
//! (nvJPEG's and zune-jpeg's IDCT and chroma upsampling, a level or two at edges, more in
//! rare pixels): the mean absolute difference must stay ≤ 1.5 levels and the largest ≤ 48.
//!
//! On a GPU with JPEG engines the JPEG batches are decoded a second time with only each crop's
//! window decoded (`VITSCALE_NVJPEG_ROI`): against the CPU with the same tolerances, against
//! the whole-image decode within 0.1 level on average and 16 at most (the engines' pixels
//! inside a window should be those of the whole image; the crop's taps are computed from the
//! window's origin, an f32 rounding step apart), and the path must have run.
//!
//! Each JPEG batch decoded ahead (`Backend::decode_ahead`) as the trainer does it, the batch
//! after next started before the next one is staged: bit for bit the batch decoded when
//! staged, and a batch started ahead but then not the one staged (other images, another range)
//! is dropped and the staged batch decoded whole.
//!
//! And each JPEG batch once more as the loader hands it over with `data.decode_cpu_share`:
//! every other photograph decoded on the CPU (its crop's window, at a reduced DCT scale where
//! that applies) and sent as RGB beside the JPEGs. Those must match the CPU's resampling of the
//! same window to float rounding, the JPEGs the first decode of the batch.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::Check;
use crate::backend::{BResult, Backend};
use crate::core::encoded::{decode_rgb, EncodedBatch, EncodedImage, Encoding};
use crate::config::{DecodeScale, Interpolation};
use crate::data::resize;

const PHOTOS: [(&str, &[u8]); 5] = [
    ("astronaut.jpg", include_bytes!("../../tests/fixtures/photos/astronaut.jpg")),
    ("camera.jpg", include_bytes!("../../tests/fixtures/photos/camera.jpg")),
    ("chelsea.jpg", include_bytes!("../../tests/fixtures/photos/chelsea.jpg")),
    ("coffee.jpg", include_bytes!("../../tests/fixtures/photos/coffee.jpg")),
    ("rocket.jpg", include_bytes!("../../tests/fixtures/photos/rocket.jpg")),
];

/// A smooth, textured RGB image (gradients, a ring, fine stripes) of `w` × `h`.
fn synthetic_rgb(w: usize, h: usize, seed: u64) -> Vec<u8> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (fx, fy, ph): (f32, f32, f32) = (rng.gen_range(0.01..0.05), rng.gen_range(0.01..0.05), rng.gen_range(0.0..6.0));
    let mut px = vec![0u8; w * h * 3];
    for y in 0..h {
        for x in 0..w {
            let (xf, yf) = (x as f32, y as f32);
            let r = ((xf - w as f32 / 2.0).hypot(yf - h as f32 / 2.0) * 0.2).sin();
            let stripes = if (x / 3) % 2 == 0 { 40.0 } else { 0.0 };
            let v = [128.0 + 100.0 * (fx * xf + ph).sin(), 128.0 + 90.0 * (fy * yf).cos() + stripes, 128.0 + 120.0 * r];
            for c in 0..3 {
                px[(y * w + x) * 3 + c] = v[c].clamp(0.0, 255.0) as u8;
            }
        }
    }
    px
}

/// (mean, max) absolute difference in pixel levels of two normalized (B, 3, S, S) batches.
fn level_diff(a: &[f32], b: &[f32], std: [f32; 3], side: usize) -> (f64, f64) {
    let plane = side * side;
    let (mut sum, mut max) = (0f64, 0f64);
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        let c = (i / plane) % 3;
        let d = if x.is_nan() || y.is_nan() { f64::INFINITY } else { ((x - y) * std[c] * 255.0).abs() as f64 };
        sum += d;
        max = max.max(d);
    }
    (sum / a.len().max(1) as f64, max)
}

/// The checks (empty, with a notice, when nvJPEG cannot be loaded on this machine).
pub fn decode_checks(be: &crate::backend::cuda::Cuda, seed: u64) -> BResult<Vec<Check>> {
    let engines = match be.jpeg_engines() {
        Ok(n) => n,
        Err(e) => {
            crate::outln!("GPU image decode not checked: {e}");
            return Ok(Vec::new());
        }
    };
    let device = |e: String| crate::backend::BackendError::Device(e);
    let (windows_chosen, _) = be.jpeg_windows().map_err(device)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x1a6e);
    let mut checks = Vec::new();
    let (mean, std) = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
    for (side, bicubic) in [(224, false), (224, true), (32, false)] {
        let filter = if bicubic { Interpolation::Bicubic } else { Interpolation::Bilinear };
        for jpeg in [true, false] {
            let mut batch = EncodedBatch { images: Vec::new(), side, bicubic, mean, std };
            let mut sources = Vec::new();
            let count = if jpeg { 2 * PHOTOS.len() } else { 4 };
            for k in 0..count {
                let (bytes, encoding, w, h, pixels, name) = if jpeg {
                    let (name, bytes) = PHOTOS[k % PHOTOS.len()];
                    let mut px = Vec::new();
                    let (w, h) = decode_rgb(bytes, &mut px).map_err(|e| crate::backend::BackendError::Device(format!("{name}: {e}")))?;
                    px.truncate(w * h * 3);
                    (bytes.to_vec(), Encoding::Jpeg, w, h, px, name.to_string())
                } else {
                    let (w, h) = (rng.gen_range(40..500), rng.gen_range(40..400));
                    let px = synthetic_rgb(w, h, rng.gen());
                    (px.clone(), Encoding::Rgb, w, h, px, format!("synthetic {w}×{h}"))
                };
                // crops from RandomResizedCrop's draw, and (every third) the evaluation's center crop
                let (region, flip) = if k % 3 == 2 {
                    (resize::center_crop(w, h, side, 0.875), false)
                } else {
                    resize::draw_rrc(rng.gen(), 0, k, w, h, [0.08, 1.0], [0.75, 4.0 / 3.0])
                };
                sources.push((pixels, w, h, region, flip));
                batch.images.push(EncodedImage { bytes, encoding, width: w, height: h, crop: [region.x0, region.y0, region.w, region.h], flip, source: name });
            }
            let per = 3 * side * side;
            let mut cpu = vec![0f32; count * per];
            for ((px, w, h, region, flip), out) in sources.iter().zip(cpu.chunks_mut(per)) {
                resize::resample(px, *w, *h, *region, side, *flip, filter, mean, std, out);
            }
            let mut dev = be.alloc_f32(count * per)?;
            be.fill(&mut dev, f32::NAN)?;
            be.decode_input(&mut dev, &batch, 0..count)?;
            be.synchronize()?;
            let got = be.download(&dev)?;
            let (avg, max) = level_diff(&got, &cpu, std, side);
            let what = if jpeg { "JPEG photographs (nvJPEG)" } else { "decoded RGB images" };
            let f = if bicubic { "bicubic" } else { "bilinear" };
            let name = format!("GPU decode: {count} {what} → {side} px {f}, crops + flips vs CPU: mean |Δ| {avg:.3}, max {max:.2} levels");
            let (tol_mean, tol_max) = if jpeg { (1.5, 48.0) } else { (0.05, 0.05) };
            let (err, tol) = if jpeg { (avg, tol_mean) } else { (max, tol_max) };
            checks.push(Check { name, rel_err: err, tol, pass: avg.is_finite() && avg <= tol_mean && max <= tol_max });
            if jpeg {
                checks.push(cpu_share_check(be, &batch, &got, &sources, filter)?);
                checks.push(ahead_check(be, &batch, &got)?);
            }
            if jpeg && engines > 0 {
                // the same batch with only the crops' windows decoded on the engines
                be.set_jpeg_windows(true).map_err(device)?;
                let (_, before) = be.jpeg_windows().map_err(device)?;
                let mut win = be.alloc_f32(count * per)?;
                be.fill(&mut win, f32::NAN)?;
                let r = be.decode_input(&mut win, &batch, 0..count).and_then(|_| be.synchronize());
                let (_, after) = be.jpeg_windows().map_err(device)?;
                be.set_jpeg_windows(windows_chosen).map_err(device)?;
                r?;
                let windowed = be.download(&win)?;
                let (avg, max) = level_diff(&windowed, &cpu, std, side);
                let name = format!("GPU decode, crops' windows only: {count} JPEG photographs → {side} px {f} vs CPU: mean |Δ| {avg:.3}, max {max:.2} levels");
                checks.push(Check { name, rel_err: avg, tol: tol_mean, pass: avg.is_finite() && avg <= tol_mean && max <= tol_max });
                let (avg, max) = level_diff(&windowed, &got, std, side);
                let name = format!("GPU decode, crops' windows only vs whole images: mean |Δ| {avg:.3}, max {max:.2} levels ({} of {count} images as windows)", after - before);
                checks.push(Check { name, rel_err: avg, tol: 0.1, pass: avg.is_finite() && avg <= 0.1 && max <= 16.0 && after > before });
            }
        }
    }
    Ok(checks)
}

/// The JPEG `batch` (whose device decode gave `whole`) with every other image decoded on the
/// CPU as the loader does for `data.decode_cpu_share` (`data::decode_window`, crop and flip
/// from `sources`), decoded again on the device: the CPU-decoded images against the CPU's
/// resampling of the same pixels (≤ 0.05 level), the others against `whole` (≤ 0.05).
fn cpu_share_check(be: &crate::backend::cuda::Cuda, batch: &EncodedBatch, whole: &[f32], sources: &[(Vec<u8>, usize, usize, resize::Region, bool)], filter: Interpolation) -> BResult<Check> {
    let (side, count) = (batch.side, batch.len());
    let per = 3 * side * side;
    let mut mixed = batch.clone();
    let mut want = whole.to_vec();
    for k in (0..count).step_by(2) {
        let img = &batch.images[k];
        let (region, flip) = (sources[k].3, sources[k].4);
        let mut px = Vec::new();
        let d = crate::data::decode_window(&img.bytes, DecodeScale::Auto, side, |_, _| (region, flip), &mut px)
            .map_err(|e| crate::backend::BackendError::Device(format!("{}: {e}", img.source)))?;
        px.truncate(d.width * d.height * 3);
        resize::resample(&px, d.width, d.height, d.region, side, d.flip, filter, batch.mean, batch.std, &mut want[k * per..(k + 1) * per]);
        mixed.images[k] = EncodedImage { bytes: px, encoding: Encoding::Rgb, width: d.width, height: d.height, crop: [d.region.x0, d.region.y0, d.region.w, d.region.h], flip: d.flip, source: img.source.clone() };
    }
    let mut dev = be.alloc_f32(count * per)?;
    be.fill(&mut dev, f32::NAN)?;
    be.decode_input(&mut dev, &mixed, 0..count)?;
    be.synchronize()?;
    let got = be.download(&dev)?;
    let (avg, max) = level_diff(&got, &want, batch.std, side);
    let f = if batch.bicubic { "bicubic" } else { "bilinear" };
    let name = format!("GPU decode, every other JPEG decoded by the loader (data.decode_cpu_share): {count} photographs → {side} px {f}: mean |Δ| {avg:.4}, max {max:.3} levels");
    Ok(Check { name, rel_err: max, tol: 0.05, pass: avg.is_finite() && max <= 0.05 })
}

/// The JPEG `batch` (whose plain device decode gave `whole`) decoded ahead, in the trainer's
/// order, each of the three ways a start ahead can end, and each must equal `whole` bit for
/// bit:
/// - staged while its thread still runs (the decoder held meanwhile, so the thread cannot
///   finish first), after the reversed batch was staged plainly: the thread enqueues the last
///   pass;
/// - staged after its thread finished: the staging enqueues the last pass;
/// - a start ahead of images 1.. followed by the staging of all of them: dropped, the batch
///   decoded whole.
///
/// The decoder's counts say which way each went.
fn ahead_check(be: &crate::backend::cuda::Cuda, batch: &EncodedBatch, whole: &[f32]) -> BResult<Check> {
    let (side, count) = (batch.side, batch.len());
    let per = 3 * side * side;
    let mut reversed = batch.clone();
    reversed.images.reverse();
    let before = be.jpeg_decoded_ahead();
    let mut bufs = [be.alloc_f32(count * per)?, be.alloc_f32(count * per)?, be.alloc_f32(count * per)?, be.alloc_f32(count * per)?];
    for buf in bufs.iter_mut() {
        be.fill(buf, f32::NAN)?;
    }
    let [first, second, third, fourth] = &mut bufs;
    be.decode_input(first, &reversed, 0..count)?;
    be.synchronize()?;
    be.jpeg_holding_decoder(|| -> BResult<()> {
        be.decode_ahead(batch, 0..count)?;
        be.decode_input(second, batch, 0..count)
    })
    .map_err(crate::backend::BackendError::Device)??;
    let after_thread = be.jpeg_decoded_ahead();
    be.decode_ahead(batch, 0..count)?;
    let t0 = std::time::Instant::now();
    while !be.jpeg_ahead_ready() {
        if t0.elapsed().as_secs() > 30 {
            return Err(crate::backend::BackendError::Device("GPU decode ahead: the batch's thread did not finish its first passes in 30 s".into()));
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    be.decode_input(third, batch, 0..count)?;
    let after_staging = be.jpeg_decoded_ahead();
    be.decode_ahead(batch, 1..count)?;
    be.decode_input(fourth, batch, 0..count)?;
    be.synchronize()?;
    let after_drop = be.jpeg_decoded_ahead();
    let [first, second, third, fourth] = [&bufs[0], &bufs[1], &bufs[2], &bufs[3]].map(|b| be.download(b));
    let (first, second, third, fourth) = (first?, second?, third?, fourth?);
    // the reversed batch's images, put back in order, are the whole batch's
    let mut reordered = vec![0f32; count * per];
    for k in 0..count {
        reordered[k * per..(k + 1) * per].copy_from_slice(&first[(count - 1 - k) * per..(count - k) * per]);
    }
    let (_, max_reversed) = level_diff(&reordered, whole, batch.std, side);
    let (_, max_thread) = level_diff(&second, whole, batch.std, side);
    let (_, max_staging) = level_diff(&third, whole, batch.std, side);
    let (_, max_dropped) = level_diff(&fourth, whole, batch.std, side);
    // (finished, of which by the thread) in each round
    let round = |a: (u64, u64), b: (u64, u64)| (b.0 - a.0, b.1 - a.1);
    let (by_thread, by_staging, dropped) = (round(before, after_thread), round(after_thread, after_staging), round(after_staging, after_drop));
    let name = format!(
        "GPU decode ahead: {count} photographs → {side} px; max |Δ| vs the plain decode: last pass by the thread {max_thread:.3} (finished {}, by the thread {}), by the staging {max_staging:.3} (finished {}, by the thread {}), start dropped {max_dropped:.3} (finished {}), reversed batch {max_reversed:.3} levels",
        by_thread.0, by_thread.1, by_staging.0, by_staging.1, dropped.0
    );
    let worst = max_thread.max(max_staging).max(max_dropped).max(max_reversed);
    let ways = by_thread == (1, 1) && by_staging == (1, 0) && dropped == (0, 0);
    Ok(Check { name, rel_err: worst, tol: 0.0, pass: worst == 0.0 && ways })
}
