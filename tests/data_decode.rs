//! `data.decode = "gpu"` on the host side: which runs decode on the GPU (`resolve_decode`), and
//! the encoded batches the loader builds for it — the file bytes, sizes, crops, flips, labels
//! and keys from which a device must produce exactly the CPU path's images. The check decodes
//! each encoded image with the CPU decoder and resamples it with the crop and flip the batch
//! carries; that must reproduce the CPU path's batch bit for bit. (The device's own decode
//! and kernels are checked against the CPU by `vitscale selftest --device cuda`.)

use std::fs;
use std::path::Path;

use vitscale::backend::cpu::Cpu;
use vitscale::backend::Backend;
use vitscale::config::{DataConfig, DatasetKind, Decode, DecodeScale, Interpolation};
use vitscale::core::encoded::{decode_rgb, Encoding};
use vitscale::data::resize::{resample, Region};
use vitscale::data::shards::{self, PackOptions};
use vitscale::data::{cpu_decodes, open, resolve_decode, try_make_batch, DataError, DecodeDevice};

mod common;
use common::{fixtures, fresh_seed, tmp};

const NAMES: [&str; 5] = ["astronaut", "camera", "chelsea", "coffee", "rocket"];

/// The fixture photographs as a 5-class folder, plus a PNG in class 0.
fn photo_folder(root: &Path) {
    for name in NAMES {
        fs::create_dir_all(root.join(name)).unwrap();
        fs::copy(fixtures().join(format!("photos/{name}.jpg")), root.join(format!("{name}/{name}.jpg"))).unwrap();
    }
    let png = image::RgbImage::from_fn(90, 70, |x, y| image::Rgb([(x * 2) as u8, (y * 3) as u8, ((x + y) % 256) as u8]));
    png.save(root.join("astronaut/drawing.png")).unwrap();
}

/// The CPU path decodes whole images at full size here (`data.decode_scale = "full"`), as the
/// device does, so the emulated device batch can equal it bit for bit.
fn cfg(root: &Path, decode: Decode) -> DataConfig {
    DataConfig { val_split: 0.0, num_workers: 2, decode, decode_scale: DecodeScale::Full, ..DataConfig::for_dataset(DatasetKind::Folder, Some(root.to_path_buf()), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]) }
}

#[test]
fn which_runs_decode_on_the_gpu() {
    let dir = tmp();
    let base = cfg(dir.path(), Decode::Auto);
    let engines = || Ok(7);
    let gpu = || DecodeDevice::Gpu { engines: &engines };
    let decode = |c: &DataConfig, d: DecodeDevice| resolve_decode(c, d).map(|(decode, _)| decode);
    assert_eq!(resolve_decode(&base, gpu()).unwrap(), (Decode::Gpu, vec![]));
    assert_eq!(resolve_decode(&base, DecodeDevice::Cpu).unwrap(), (Decode::Cpu, vec![]));
    assert_eq!(decode(&DataConfig { decode: Decode::Cpu, ..base.clone() }, gpu()).unwrap(), Decode::Cpu);
    // in-memory sets have nothing to decode
    let builtin = DataConfig { decode: Decode::Gpu, ..DataConfig::for_dataset(DatasetKind::Builtin, None, [0.5; 3], [0.5; 3]) };
    assert_eq!(decode(&builtin, gpu()).unwrap(), Decode::Cpu);
    // an augmentation on decoded CPU pixels: auto falls back, gpu refuses naming it
    let mut mixed = base.clone();
    mixed.aug.mixup = 0.8;
    assert_eq!(decode(&mixed, gpu()).unwrap(), Decode::Cpu);
    mixed.decode = Decode::Gpu;
    mixed.aug.reprob = 0.25;
    let e = resolve_decode(&mixed, gpu()).unwrap_err().to_string();
    assert!(e.contains("data.decode") && e.contains("data.mixup") && e.contains("data.reprob") && !e.contains("data.cutmix"), "{e}");
    // with augmentation off those options do nothing, so nothing stops the GPU
    let mut plain = mixed.clone();
    plain.augment = vitscale::config::Augment::None;
    assert_eq!(decode(&plain, gpu()).unwrap(), Decode::Gpu);
    // a GPU without JPEG engines, or without nvJPEG: auto stays on the CPU and says why; an
    // explicit gpu still decodes there
    let none = || Ok(0);
    let (d, why) = resolve_decode(&base, DecodeDevice::Gpu { engines: &none }).unwrap();
    assert!(d == Decode::Cpu && why.len() == 1 && why[0].contains("no JPEG engines"), "{why:?}");
    let missing = || Err("libnvjpeg.so.13: not found".to_string());
    let (d, why) = resolve_decode(&base, DecodeDevice::Gpu { engines: &missing }).unwrap();
    assert!(d == Decode::Cpu && why.len() == 1 && why[0].contains("libnvjpeg.so.13"), "{why:?}");
    // a CPU share the CPU path leaves unused is said so; on the GPU it is not
    let shared = DataConfig { decode_cpu_share: 0.3, ..base.clone() };
    let (d, why) = resolve_decode(&shared, DecodeDevice::Cpu).unwrap();
    assert!(d == Decode::Cpu && why.len() == 1 && why[0].contains("data.decode_cpu_share"), "{why:?}");
    assert_eq!(resolve_decode(&shared, gpu()).unwrap(), (Decode::Gpu, vec![]));
    assert_eq!(decode(&DataConfig { decode: Decode::Gpu, ..base.clone() }, DecodeDevice::Gpu { engines: &none }).unwrap(), Decode::Gpu);
    // the engines are asked only where auto decides
    let unasked = || -> Result<u32, String> { panic!("asked for the engines") };
    assert_eq!(decode(&mixed_auto(&base), DecodeDevice::Gpu { engines: &unasked }).unwrap(), Decode::Cpu);
    assert_eq!(decode(&DataConfig { decode: Decode::Gpu, ..base.clone() }, DecodeDevice::Gpu { engines: &unasked }).unwrap(), Decode::Gpu);
    // no GPU
    let e = resolve_decode(&DataConfig { decode: Decode::Gpu, ..base }, DecodeDevice::Cpu).unwrap_err().to_string();
    assert!(e.contains("data.decode") && e.contains("--device cuda"), "{e}");
}

/// `base` with mixup on: `auto` decodes on the CPU without asking the GPU.
fn mixed_auto(base: &DataConfig) -> DataConfig {
    let mut c = base.clone();
    c.aug.mixup = 0.8;
    c
}

/// Decodes every encoded image with the CPU decoder and resamples it as the batch says.
fn emulate_device(batch: &vitscale::core::encoded::EncodedBatch) -> Vec<f32> {
    let side = batch.side;
    let filter = if batch.bicubic { Interpolation::Bicubic } else { Interpolation::Bilinear };
    let mut out = vec![0f32; batch.len() * 3 * side * side];
    for (img, o) in batch.images.iter().zip(out.chunks_mut(3 * side * side)) {
        let px = match img.encoding {
            Encoding::Jpeg => {
                let mut px = Vec::new();
                let (w, h) = decode_rgb(&img.bytes, &mut px).unwrap();
                assert_eq!((w, h), (img.width, img.height), "{}: header size", img.source);
                px.truncate(w * h * 3);
                px
            }
            Encoding::Rgb => img.bytes.clone(),
        };
        assert_eq!(px.len(), img.width * img.height * 3, "{}", img.source);
        let [x0, y0, w, h] = img.crop;
        resample(&px, img.width, img.height, Region { x0, y0, w, h }, side, img.flip, filter, batch.mean, batch.std, o);
    }
    out
}

#[test]
fn encoded_batches_carry_what_the_cpu_path_draws() {
    let dir = tmp();
    photo_folder(dir.path());
    let seed = fresh_seed();
    for (interpolation, side) in [(Interpolation::Bilinear, 64), (Interpolation::Bicubic, 48)] {
        let cpu_cfg = DataConfig { interpolation, ..cfg(dir.path(), Decode::Cpu) };
        let gpu_cfg = DataConfig { decode: Decode::Gpu, ..cpu_cfg.clone() };
        let d = open(&cpu_cfg, side, 5, seed).unwrap();
        let idx: Vec<usize> = (0..d.train.len()).chain([2, 0]).collect();
        for (train, epoch) in [(true, 0), (true, 3), (false, 0)] {
            let want = try_make_batch(&d.train, &idx, &cpu_cfg, train, epoch, seed).unwrap();
            let got = try_make_batch(&d.train, &idx, &gpu_cfg, train, epoch, seed).unwrap();
            assert!(got.images.is_empty(), "an encoded batch holds no pixels");
            assert!(want.encoded.is_none());
            let enc = got.encoded.as_ref().expect("encoded batch");
            assert_eq!((enc.side, enc.bicubic, enc.mean, enc.std), (side, interpolation == Interpolation::Bicubic, cpu_cfg.mean, cpu_cfg.std));
            assert_eq!(got.labels, want.labels);
            assert_eq!(got.keys, want.keys);
            assert_eq!(enc.len(), idx.len());
            for (img, &i) in enc.images.iter().zip(&idx) {
                let file = &d.train.files[i];
                assert!(img.source.contains(&*file.file_name().unwrap().to_string_lossy()), "{} names {}", img.source, file.display());
                match img.encoding {
                    Encoding::Jpeg => assert_eq!(img.bytes, fs::read(file).unwrap(), "{}: the file's bytes", img.source),
                    Encoding::Rgb => assert!(file.extension().unwrap() == "png"),
                }
                if !train {
                    assert!(!img.flip, "evaluation never flips");
                }
            }
            let emulated = emulate_device(enc);
            assert_eq!(emulated.len(), want.images.len());
            let same = emulated.iter().zip(&want.images).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "seed {seed}, train {train}, epoch {epoch}, {interpolation:?}: decoding the encoded batch must give the CPU batch");
        }
        // a training batch flips some images and not others over a few epochs
        let flips: usize = (0..4).map(|e| try_make_batch(&d.train, &idx, &gpu_cfg, true, e, seed).unwrap().encoded.unwrap().images.iter().filter(|i| i.flip).count()).sum();
        assert!(flips > 0 && flips < 4 * idx.len(), "seed {seed}: {flips} flips");
    }
}

/// `data.decode_cpu_share`: the JPEGs it picks are decoded by the loader as the CPU path
/// decodes them, so the device, resampling the window it is handed with the crop and flip in
/// the window's pixels, gives the CPU path's batch bit for bit. At share 1 with the partial
/// decode (`decode_scale = "auto"`) every JPEG arrives as its window's pixels; at 0.5 with the
/// full-size decode the images it picks are those `cpu_decodes` names, whatever the thread count.
#[test]
fn the_cpu_share_of_a_gpu_batch_is_decoded_as_the_cpu_path_decodes() {
    let dir = tmp();
    photo_folder(dir.path());
    let seed = fresh_seed();
    for (scale, share) in [(DecodeScale::Auto, 1.0), (DecodeScale::Full, 0.5)] {
        let cpu_cfg = DataConfig { decode_scale: scale, ..cfg(dir.path(), Decode::Cpu) };
        let d = open(&cpu_cfg, 48, 5, seed).unwrap();
        let idx: Vec<usize> = (0..d.train.len()).chain([3, 1]).collect();
        let jpeg = |i: usize| d.train.files[i].extension().unwrap() == "jpg";
        let mut picked = 0;
        for (train, epoch) in [(true, 0), (true, 5), (false, 0)] {
            let want = try_make_batch(&d.train, &idx, &cpu_cfg, train, epoch, seed).unwrap();
            let mut encs = Vec::new();
            for workers in [1, 3] {
                let gpu_cfg = DataConfig { decode: Decode::Gpu, decode_cpu_share: share, num_workers: workers, ..cpu_cfg.clone() };
                let got = try_make_batch(&d.train, &idx, &gpu_cfg, train, epoch, seed).unwrap();
                assert_eq!(got.labels, want.labels);
                encs.push(got.encoded.unwrap());
            }
            assert_eq!(encs[0], encs[1], "the same batch with 1 and 3 loader threads");
            let enc = &encs[0];
            for (img, &i) in enc.images.iter().zip(&idx) {
                let on_cpu = jpeg(i) && cpu_decodes(share, seed, epoch, i);
                picked += usize::from(on_cpu);
                match img.encoding {
                    Encoding::Jpeg => assert!(!on_cpu && img.bytes == fs::read(&d.train.files[i]).unwrap(), "{}", img.source),
                    Encoding::Rgb => {
                        assert!(on_cpu || !jpeg(i), "{}: decoded by the loader, not picked", img.source);
                        assert_eq!(img.bytes.len(), img.width * img.height * 3, "{}", img.source);
                    }
                }
            }
            let emulated = emulate_device(enc);
            let same = emulated.iter().zip(&want.images).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "seed {seed}, share {share}, {scale:?}, train {train}, epoch {epoch}: the device's batch must be the CPU path's");
        }
        if share == 1.0 {
            assert_eq!(picked, 3 * idx.iter().filter(|&&i| jpeg(i)).count(), "share 1 decodes every JPEG on the CPU");
        }
    }
}

/// The share is a per-image draw: about that share of images, none at 0, all at 1, other
/// images under another seed or epoch.
#[test]
fn cpu_decodes_draws_its_share_per_image() {
    let seed = fresh_seed();
    let count = |share: f64, seed: u64, epoch: u64| (0..20_000).filter(|&i| cpu_decodes(share, seed, epoch, i)).count();
    assert_eq!(count(0.0, seed, 0), 0);
    assert_eq!(count(1.0, seed, 0), 20_000);
    for share in [0.1, 0.35, 0.8] {
        let got = count(share, seed, 2) as f64 / 20_000.0;
        // 4.5 standard deviations of a binomial share of 20 000
        let tol = 4.5 * (share * (1.0 - share) / 20_000.0).sqrt();
        assert!((got - share).abs() < tol, "seed {seed}: share {share} drew {got}");
    }
    let same = (0..2_000).filter(|&i| cpu_decodes(0.5, seed, 0, i) == cpu_decodes(0.5, seed, 1, i)).count();
    assert!((800..1200).contains(&same), "seed {seed}: epochs 0 and 1 agree on {same} of 2000 images");
    let same = (0..2_000).filter(|&i| cpu_decodes(0.5, seed, 0, i) == cpu_decodes(0.5, seed ^ 1, 0, i)).count();
    assert!((800..1200).contains(&same), "seed {seed}: two seeds agree on {same} of 2000 images");
}

#[test]
fn shard_members_are_encoded_from_their_bytes() {
    let dir = tmp();
    photo_folder(&dir.path().join("src"));
    shards::pack(&dir.path().join("src"), &dir.path().join("out"), &PackOptions { max_bytes: Some(40 << 10), max_images: None, val_split: 0.0, seed: 0 }).unwrap();
    let seed = fresh_seed();
    let cpu_cfg = DataConfig { dataset: DatasetKind::Shards, path: Some(dir.path().join("out")), ..cfg(dir.path(), Decode::Cpu) };
    let gpu_cfg = DataConfig { decode: Decode::Gpu, ..cpu_cfg.clone() };
    let d = open(&cpu_cfg, 32, 5, seed).unwrap();
    let idx: Vec<usize> = (0..d.train.len()).collect();
    let want = try_make_batch(&d.train, &idx, &cpu_cfg, true, 1, seed).unwrap();
    let got = try_make_batch(&d.train, &idx, &gpu_cfg, true, 1, seed).unwrap();
    let enc = got.encoded.as_ref().unwrap();
    assert_eq!(got.labels, want.labels);
    assert!(enc.images.iter().all(|i| i.source.contains(".tar") && i.source.contains("member")), "{:?}", enc.images.iter().map(|i| &i.source).collect::<Vec<_>>());
    let emulated = emulate_device(enc);
    assert!(emulated.iter().zip(&want.images).all(|(a, b)| a.to_bits() == b.to_bits()), "seed {seed}");
}

#[test]
fn a_bad_file_is_named_or_skipped() {
    let dir = tmp();
    photo_folder(dir.path());
    fs::write(dir.path().join("camera/broken.jpg"), b"\xff\xd8\xff\xe0 not really a jpeg").unwrap();
    let c = cfg(dir.path(), Decode::Gpu);
    let d = open(&c, 32, 5, 0).unwrap();
    let bad = d.train.files.iter().position(|f| f.ends_with("camera/broken.jpg")).unwrap();
    let e = try_make_batch(&d.train, &[bad], &c, true, 0, 0).unwrap_err();
    assert!(matches!(e, DataError::Decode { .. }), "{e}");
    assert!(e.to_string().contains("broken.jpg"), "{e}");
    let skip = DataConfig { skip_bad: true, ..c.clone() };
    let b = try_make_batch(&d.train, &[bad], &skip, true, 0, 0).unwrap();
    let enc = b.encoded.unwrap();
    assert!(!enc.images[0].source.contains("broken"), "replaced by the next readable image");
    assert_eq!(d.train.skipped.load(std::sync::atomic::Ordering::Relaxed), 1);
    // the same where the loader decodes it (data.decode_cpu_share)
    let on_cpu = DataConfig { decode_cpu_share: 1.0, ..c };
    let e = try_make_batch(&d.train, &[bad], &on_cpu, true, 0, 0).unwrap_err();
    assert!(matches!(e, DataError::Decode { .. }) && e.to_string().contains("broken.jpg"), "{e}");
    let b = try_make_batch(&d.train, &[bad], &DataConfig { skip_bad: true, ..on_cpu }, true, 0, 0).unwrap();
    let img = &b.encoded.unwrap().images[0];
    assert!(!img.source.contains("broken") && img.encoding == Encoding::Rgb, "replaced by the next readable image, decoded");
    assert_eq!(d.train.skipped.load(std::sync::atomic::Ordering::Relaxed), 2);
}

#[test]
fn a_backend_without_a_decoder_says_so() {
    let dir = tmp();
    photo_folder(dir.path());
    let c = cfg(dir.path(), Decode::Gpu);
    let d = open(&c, 32, 5, 0).unwrap();
    let b = try_make_batch(&d.train, &[0, 1], &c, true, 0, 0).unwrap();
    let be = Cpu::new();
    let mut buf = be.alloc_f32(2 * 3 * 32 * 32).unwrap();
    let e = be.decode_input(&mut buf, b.encoded.as_ref().unwrap(), 0..2).unwrap_err().to_string();
    assert!(e.contains("data.decode") && e.contains("cpu"), "{e}");
}
