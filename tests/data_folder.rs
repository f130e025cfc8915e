//! Image folders (JPEG/PNG/WebP, class = sorted subfolder name), their split, per-batch decoding with
//! RandomResizedCrop / center crop, `data.skip_bad`, and the prefetching loader.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vitscale::config::{DataConfig, DatasetKind, DecodeScale, Interpolation};
use vitscale::data::{open, shard, try_make_batch, DataError, Loader, LoaderPlan, Sampler};

mod common;
use common::{tmp, vitscale};

fn cfg(path: &Path) -> DataConfig {
    DataConfig {
        num_workers: 2,
        val_split: 0.25,
        prefetch: 2,
        // Normalized value == pixel value.
        ..DataConfig::for_dataset(DatasetKind::Folder, Some(path.to_path_buf()), [0.0; 3], [1.0 / 255.0; 3])
    }
}

/// A solid image of `rgb`, `w`×`h`, saved as PNG or JPEG by extension.
fn solid(path: &Path, w: u32, h: u32, rgb: [u8; 3]) {
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    image::RgbImage::from_pixel(w, h, image::Rgb(rgb)).save(path).unwrap();
}

/// Classes dog, bird, cat (sorted: bird 0, cat 1, dog 2), `n` images each, colour = class.
fn make_tree(root: &Path, n: usize) -> Vec<[u8; 3]> {
    let colours = [[200, 10, 10], [10, 200, 10], [10, 10, 200]];
    for (c, name) in ["bird", "cat", "dog"].iter().enumerate() {
        for i in 0..n {
            // Mixed formats, sizes and a nested folder, as real trees have.
            let ext = if i % 2 == 0 { "png" } else { "JPG" };
            let sub = if i % 3 == 0 { "nested/" } else { "" };
            solid(&root.join(format!("{name}/{sub}img{i}.{ext}")), 40 + i as u32, 30, colours[c]);
        }
    }
    fs::write(root.join("bird/notes.txt"), "not an image").unwrap();
    colours.to_vec()
}

#[test]
fn seeded_split_sorted_classes_and_pixels() {
    let dir = tmp();
    let colours = make_tree(dir.path(), 8);
    let c = cfg(dir.path());
    let d = open(&c, 16, 3, 5).unwrap();
    assert_eq!(d.num_classes, 3);
    assert_eq!(d.train.len() + d.val.len(), 24);
    assert_eq!(d.val.class_counts(), vec![2, 2, 2]); // 25 % of 8 per class
    // Deterministic in the seed, disjoint.
    let again = open(&c, 16, 3, 5).unwrap();
    assert_eq!(d.val.files, again.val.files);
    assert!(d.val.files.iter().all(|f| !d.train.files.contains(f)));
    assert_ne!(open(&c, 16, 3, 6).unwrap().val.files, d.val.files);
    // Eval batch: solid images stay solid, label = sorted class index.
    let idx: Vec<usize> = (0..d.val.len()).collect();
    let b = try_make_batch(&d.val, &idx, &c, false, 0, 0).unwrap();
    for (k, &l) in b.labels.iter().enumerate() {
        let img = &b.images[k * 3 * 256..(k + 1) * 3 * 256];
        for ch in 0..3 {
            let v = img[ch * 256 + 100];
            // JPEG is lossy: allow a few levels.
            assert!((v - colours[l as usize][ch] as f32).abs() < 8.0, "class {l} channel {ch}: {v}");
        }
    }
    assert!(d.description.contains("bird, cat, dog"), "{}", d.description);
}

/// WebP files (lossless, as the image crate writes them) are found and decoded
/// like the other formats; a broken one is an error naming it.
#[test]
fn webp_images_in_folders() {
    let dir = tmp();
    let colours = [[200u8, 10, 10], [10, 200, 10]];
    for (c, name) in ["a", "b"].iter().enumerate() {
        for i in 0..3 {
            let p = dir.path().join(format!("{name}/img{i}.{}", if i == 0 { "WEBP" } else { "webp" }));
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            image::RgbImage::from_pixel(20 + i, 17, image::Rgb(colours[c])).save_with_format(&p, image::ImageFormat::WebP).unwrap();
        }
    }
    let mut c = cfg(dir.path());
    c.val_split = 0.0;
    let d = open(&c, 16, 2, 0).unwrap();
    assert_eq!(d.train.class_counts(), vec![3, 3]);
    let idx: Vec<usize> = (0..6).collect();
    for train in [false, true] {
        let b = try_make_batch(&d.train, &idx, &c, train, 0, 0).unwrap();
        for (k, &l) in b.labels.iter().enumerate() {
            for (ch, &want) in colours[l as usize].iter().enumerate() {
                let v = b.images[k * 3 * 256 + ch * 256 + 77];
                assert!((v - want as f32).abs() < 0.01, "class {l} channel {ch}: {v}");
            }
        }
    }
    fs::write(dir.path().join("a/broken.webp"), b"RIFF\x10\0\0\0WEBPVP8 junk").unwrap();
    let d = open(&c, 16, 2, 0).unwrap();
    let i = d.train.files.iter().position(|f| f.ends_with("broken.webp")).unwrap();
    let e = try_make_batch(&d.train, &[i], &c, false, 0, 0).unwrap_err().to_string();
    assert!(e.contains("broken.webp") && e.contains("cannot decode image"), "{e}");
}

#[test]
fn train_val_folders_and_class_mismatch() {
    let dir = tmp();
    make_tree(&dir.path().join("train"), 3);
    make_tree(&dir.path().join("val"), 2);
    let c = cfg(dir.path());
    let d = open(&c, 16, 3, 0).unwrap();
    assert_eq!((d.train.len(), d.val.len()), (9, 6));
    assert_eq!(d.val.class_counts(), vec![2, 2, 2]);
    let e = open(&c, 16, 1000, 0).unwrap_err();
    assert!(e.to_string().contains("model.num_classes=3"), "{e}");
    solid(&dir.path().join("val/zebra/z.png"), 8, 8, [0, 0, 0]);
    let e = open(&c, 16, 3, 0).unwrap_err();
    assert!(e.to_string().contains("zebra"), "{e}");
}

#[test]
fn empty_class_and_missing_folder_are_errors() {
    let dir = tmp();
    let c = cfg(&dir.path().join("nope"));
    assert!(open(&c, 16, 3, 0).unwrap_err().to_string().contains("nope"));
    fs::create_dir_all(dir.path().join("a")).unwrap();
    solid(&dir.path().join("b/x.png"), 8, 8, [1, 2, 3]);
    let e = open(&cfg(dir.path()), 16, 2, 0).unwrap_err();
    assert!(e.to_string().contains("at least one"), "{e}");
}

#[test]
fn augmentation_is_deterministic_and_rank_independent() {
    let dir = tmp();
    // Non-uniform images, so crops differ.
    for i in 0..12 {
        let img = image::RgbImage::from_fn(64, 48, |x, y| image::Rgb([(x * 4) as u8, (y * 5) as u8, (i * 20) as u8]));
        let p = dir.path().join(format!("c{}/i{i}.png", i % 2));
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        img.save(&p).unwrap();
    }
    let mut c = cfg(dir.path());
    c.val_split = 0.0;
    let d = open(&c, 24, 2, 0).unwrap();
    let global = Sampler::new(d.train.len(), 8, true, 3, true).global_batch(1, 0);
    let whole = try_make_batch(&d.train, &global, &c, true, 1, 3).unwrap();
    assert_eq!(whole, try_make_batch(&d.train, &global, &c, true, 1, 3).unwrap());
    let mut images = Vec::new();
    for rank in 0..2 {
        for micro in 0..2 {
            images.extend(try_make_batch(&d.train, shard(&global, rank, 2, micro, 2), &c, true, 1, 3).unwrap().images);
        }
    }
    assert_eq!(images, whole.images);
    assert_ne!(try_make_batch(&d.train, &global, &c, true, 2, 3).unwrap().images, whole.images);
}

/// `data.interpolation = "bicubic"` reaches the folder batches (training crops and the
/// evaluation resize): deterministic, rank-independent, different from bilinear on a gradient
/// image, solid images still solid.
#[test]
fn bicubic_interpolation_in_folder_batches() {
    let dir = tmp();
    for i in 0..8 {
        let img = image::RgbImage::from_fn(64, 48, |x, y| image::Rgb([((x * x) % 256) as u8, (y * 5) as u8, (i * 20) as u8]));
        let p = dir.path().join(format!("c{}/i{i}.png", i % 2));
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        img.save(&p).unwrap();
    }
    solid(&dir.path().join("c0/solid.png"), 50, 37, [90, 140, 30]);
    let mut c = cfg(dir.path());
    c.val_split = 0.0;
    let mut cubic = c.clone();
    cubic.interpolation = Interpolation::Bicubic;
    let d = open(&c, 24, 2, 0).unwrap();
    let idx: Vec<usize> = (0..d.train.len()).collect();
    for train in [true, false] {
        let lin = try_make_batch(&d.train, &idx, &c, train, 1, 3).unwrap();
        let cub = try_make_batch(&d.train, &idx, &cubic, train, 1, 3).unwrap();
        assert_eq!(cub, try_make_batch(&d.train, &idx, &cubic, train, 1, 3).unwrap());
        assert_ne!(cub.images, lin.images, "train {train}");
        let mut halves = try_make_batch(&d.train, &idx[..4], &cubic, train, 1, 3).unwrap().images;
        halves.extend(try_make_batch(&d.train, &idx[4..], &cubic, train, 1, 3).unwrap().images);
        assert_eq!(halves, cub.images);
        let solid_at = d.train.files.iter().position(|f| f.ends_with("c0/solid.png")).unwrap();
        let per = 3 * 24 * 24;
        for (ch, want) in [90f32, 140.0, 30.0].into_iter().enumerate() {
            let plane = &cub.images[solid_at * per + ch * 576..solid_at * per + (ch + 1) * 576];
            assert!(plane.iter().all(|v| (v - want).abs() < 1e-3), "train {train} channel {ch}");
        }
    }
}

fn corrupt_tree(root: &Path) -> PathBuf {
    make_tree(root, 4);
    let bad = root.join("cat/img1.JPG");
    fs::write(&bad, b"\xff\xd8\xff\xe0 this is not a jpeg").unwrap();
    bad
}

#[test]
fn bad_files_error_or_are_skipped() {
    let dir = tmp();
    let bad = corrupt_tree(dir.path());
    let mut c = cfg(dir.path());
    c.val_split = 0.0;
    let d = open(&c, 16, 3, 0).unwrap();
    let k = d.train.files.iter().position(|f| f == &bad).unwrap();
    let e = try_make_batch(&d.train, &[0, k], &c, true, 0, 0).unwrap_err();
    assert!(matches!(e, DataError::Decode { .. }), "{e}");
    assert!(e.to_string().contains("img1.JPG") && e.to_string().contains("skip_bad"), "{e}");
    c.skip_bad = true;
    let b = try_make_batch(&d.train, &[0, k], &c, true, 0, 0).unwrap();
    assert_eq!(b.len(), 2);
    // The replacement is the next file (same class here), and it was counted.
    assert_eq!(b.labels[1] as u16, d.train.labels[k + 1]);
    assert_eq!(d.train.skipped.load(std::sync::atomic::Ordering::Relaxed), 1);
}

fn plan(set: Arc<vitscale::data::ImageSet>, c: &DataConfig, rank: usize, steps: u64) -> LoaderPlan {
    LoaderPlan {
        sampler: Sampler::new(set.len(), 6, true, 1, true),
        set,
        cfg: c.clone(),
        train: true,
        seed: 1,
        rank,
        world: 2,
        gas: 3,
        start_epoch: 0,
        start_step: 1,
        steps,
        mix: None,
    }
}

#[test]
fn loader_matches_direct_batches_across_epochs() {
    let dir = tmp();
    make_tree(dir.path(), 5);
    let mut c = cfg(dir.path());
    c.val_split = 0.0;
    let d = open(&c, 16, 3, 0).unwrap(); // 15 images: 2 steps of 6 per epoch
    let sampler = Sampler::new(d.train.len(), 6, true, 1, true);
    for rank in 0..2 {
        let mut loader = Loader::start(plan(d.train.clone(), &c, rank, 4)).unwrap();
        // From (epoch 0, step 1): steps (0,1), (1,0), (1,1), (2,0).
        let expected_steps = [(0u64, 1usize), (1, 0), (1, 1), (2, 0)];
        for &(epoch, step) in &expected_steps {
            for micro in 0..3 {
                let p = loader.next().unwrap().unwrap();
                assert_eq!((p.epoch, p.step, p.micro), (epoch, step, micro));
                let global = sampler.global_batch(epoch, step);
                let direct = try_make_batch(&d.train, shard(&global, rank, 2, micro, 3), &c, true, epoch, 1).unwrap();
                assert_eq!(p.batch, direct);
                loader.recycle(p.batch);
            }
        }
        assert!(loader.next().is_none());
    }
}

#[test]
fn loader_reports_errors_and_drops_cleanly() {
    let dir = tmp();
    corrupt_tree(dir.path());
    let mut c = cfg(dir.path());
    c.val_split = 0.0;
    let d = open(&c, 16, 3, 0).unwrap();
    let mut loader = Loader::start(plan(d.train.clone(), &c, 0, 100)).unwrap();
    let mut saw_error = false;
    for item in loader.by_ref() {
        if let Err(e) = item {
            assert!(e.to_string().contains("img1.JPG"), "{e}");
            saw_error = true;
        }
    }
    assert!(saw_error);
    // Dropping a loader whose producer is blocked on a full queue must not hang.
    c.skip_bad = true;
    let mut loader = Loader::start(plan(d.train.clone(), &c, 0, 1000)).unwrap();
    assert!(loader.next().unwrap().is_ok());
    drop(loader);
}

#[test]
#[ignore]
fn profile_decode_vs_resample() {
    let dir = tmp();
    let files = vitscale::data::synthetic::write_jpegs(dir.path(), 32, 1).unwrap();
    let t = std::time::Instant::now();
    let mut imgs = Vec::new();
    for _ in 0..4 {
        imgs.clear();
        for f in &files {
            imgs.push(vitscale::data::decode(f).unwrap());
        }
    }
    let dec = t.elapsed().as_secs_f64() / (4.0 * files.len() as f64);
    let t = std::time::Instant::now();
    let mut out = vec![0f32; 3 * 224 * 224];
    let mut rng = vitscale::data::rng::SplitMix::new(1);
    for _ in 0..4 {
        for im in &imgs {
            let r = vitscale::data::resize::random_resized_crop(&mut rng, 500, 375, [0.08, 1.0], [0.75, 4.0 / 3.0]);
            vitscale::data::resize::resample(im.as_raw(), 500, 375, r, 224, true, Interpolation::Bilinear, [0.5; 3], [0.5; 3], &mut out);
        }
    }
    let rs = t.elapsed().as_secs_f64() / (4.0 * files.len() as f64);
    eprintln!("decode {:.2} ms, resample {:.2} ms per image", dec * 1e3, rs * 1e3);
}

/// `vitscale train` on a folder with `extra` settings; (exit ok, stderr, summary.json).
fn train_folder(root: &Path, run_dir: &Path, extra: &[&str]) -> (bool, String, Option<serde_json::Value>) {
    let mut args: Vec<String> = [
        "train", "--device=cpu", "--set=data.dataset=folder", "--set=model.image_size=16", "--set=model.patch_size=8",
        "--set=model.depth=1", "--set=train_batch_size=4", "--set=train.steps=3", "--set=data.val_split=0.25",
        "--set=data.num_workers=1", "--set=model.num_classes=3",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(format!("--set=data.path={}", root.display()));
    args.extend(extra.iter().map(|s| s.to_string()));
    args.extend(["--run-dir".to_string(), run_dir.display().to_string()]);
    let out = vitscale(Path::new("."), &args);
    let summary = fs::read(run_dir.join("summary.json")).ok().and_then(|b| serde_json::from_slice(&b).ok());
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned(), summary)
}

#[test]
fn training_on_a_bad_file_fails_naming_it_or_skips_and_counts_it() {
    let dir = tmp();
    make_tree(dir.path(), 6);
    // Every file of one class is broken, so whichever split or batch meets one first fails.
    for i in 0..6 {
        for ext in ["png", "JPG"] {
            let sub = if i % 3 == 0 { "nested/" } else { "" };
            let p = dir.path().join(format!("cat/{sub}img{i}.{ext}"));
            if p.exists() {
                fs::write(&p, b"\x89PNG broken").unwrap();
            }
        }
    }
    let runs = tmp();
    let (ok, err, _) = train_folder(dir.path(), &runs.path().join("a"), &[]);
    assert!(!ok, "training on broken files succeeded");
    assert!(!err.contains("panicked"), "a bad file panicked: {err}");
    assert!(err.contains("cannot decode image") && err.contains("/cat/") && err.contains("data.skip_bad"), "{err}");
    let (ok, err, summary) = train_folder(dir.path(), &runs.path().join("b"), &["--set=data.skip_bad=true"]);
    assert!(ok, "{err}");
    let skipped = summary.and_then(|s| s["skipped"].as_u64()).unwrap_or(0);
    assert!(skipped >= 1, "summary.json does not count the skipped files");
    // Without skip_bad, summary.json has no `skipped` field.
    let good = tmp();
    make_tree(good.path(), 4);
    let (ok, err, summary) = train_folder(good.path(), &runs.path().join("c"), &["--set=data.auto_augment=rand-m9-mstd0.5-inc1", "--set=data.reprob=0.25"]);
    assert!(ok, "{err}");
    assert!(summary.is_some_and(|s| s.get("skipped").is_none()));
    // data_s is the data-wait, a part of each logged window, never more than its wall time.
    let lines = fs::read_to_string(runs.path().join("c/metrics.jsonl")).unwrap();
    let step: serde_json::Value = lines.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).find(|v| v.get("data_s").is_some()).unwrap();
    let data_s = step["data_s"].as_f64().unwrap();
    assert!(data_s >= 0.0 && data_s <= step["wall_s"].as_f64().unwrap(), "{step}");
}

/// Damaged photographs through the default partial decode (`data.decode_scale = "auto"`):
/// whatever libjpeg-turbo rejects or warns about goes to the full-size decoder, so each file
/// gives exactly the `"full"` path's result — the same pixels, or the same error naming the
/// file — and with `data.skip_bad` an undecodable one is replaced and counted.
#[test]
fn damaged_photos_take_the_full_paths_result() {
    let dir = tmp();
    let bytes = fs::read(common::fixtures().join("photos/chelsea.jpg")).unwrap();
    fs::create_dir_all(dir.path().join("a")).unwrap();
    fs::write(dir.path().join("a/0_good.jpg"), &bytes).unwrap();
    fs::write(dir.path().join("a/1_truncated.jpg"), &bytes[..bytes.len() * 2 / 3]).unwrap();
    let mut garbled = bytes.clone();
    garbled[2000..2400].iter_mut().for_each(|b| *b ^= 0x5a);
    fs::write(dir.path().join("a/2_garbled.jpg"), &garbled).unwrap();
    fs::write(dir.path().join("a/3_header_only.jpg"), &bytes[..300]).unwrap();
    let c = DataConfig { val_split: 0.0, ..cfg(dir.path()) };
    let d = open(&c, 48, 1, 0).unwrap();
    for k in 0..d.train.len() {
        for train in [true, false] {
            let run = |scale| try_make_batch(&d.train, &[k], &DataConfig { decode_scale: scale, ..c.clone() }, train, 0, 0);
            match (run(DecodeScale::Auto), run(DecodeScale::Full)) {
                (Ok(a), Ok(f)) => {
                    if k > 0 {
                        assert_eq!(a.images, f.images, "{}", d.train.files[k].display());
                    }
                }
                (Err(a), Err(f)) => {
                    assert_eq!(a.to_string(), f.to_string());
                    assert!(a.to_string().contains(&*d.train.files[k].file_name().unwrap().to_string_lossy()), "{a}");
                }
                (a, f) => panic!("{}: auto {:?} vs full {:?}", d.train.files[k].display(), a.map(|_| ()), f.map(|_| ())),
            }
        }
    }
    let header_only = d.train.files.iter().position(|f| f.ends_with("3_header_only.jpg")).unwrap();
    assert!(try_make_batch(&d.train, &[header_only], &c, true, 0, 0).is_err());
    let skip = DataConfig { skip_bad: true, ..c.clone() };
    try_make_batch(&d.train, &[header_only], &skip, true, 0, 0).unwrap();
    assert!(d.train.skipped.load(std::sync::atomic::Ordering::Relaxed) >= 1);
}

/// An `[8][8][3]` grid of block means of an HWC image (block rows `i*h/8 .. (i+1)*h/8`,
/// likewise columns), as `tests/fixtures/photos/make_reference.py` computes them.
fn block_means(px: impl Fn(usize, usize, usize) -> f64, w: usize, h: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(8 * 8 * 3);
    for i in 0..8 {
        for j in 0..8 {
            let (rows, cols) = (i * h / 8..(i + 1) * h / 8, j * w / 8..(j + 1) * w / 8);
            let n = (rows.len() * cols.len()) as f64;
            for c in 0..3 {
                out.push(rows.clone().flat_map(|y| cols.clone().map(move |x| (x, y))).map(|(x, y)| px(x, y, c)).sum::<f64>() / n);
            }
        }
    }
    out
}

/// Real photographs (`tests/fixtures/photos`, colour and greyscale) in an image folder:
/// vitscale's JPEG decoding agrees with PIL (libjpeg), and its evaluation crop (the window
/// `resize::center_crop` defines, resampled with antialiased bilinear) with PIL resampling the
/// same window, compared as 8×8 grids of block means that `make_reference.py` computed. Block
/// means average out what legitimately differs (IDCT rounding between decoders, PIL's fixed
/// point) and keep what must not (colour conversion, channel order, orientation, greyscale
/// expansion, the window's place and scale). (torchvision's two-step Resize + CenterCrop rounds
/// the long side and the crop offset to whole pixels, so it is not this window exactly;
/// reference.json holds its blocks too, `eval64_torchvision`.)
#[test]
fn photos_decode_and_crop_as_pil_does() {
    let reference: serde_json::Value = serde_json::from_slice(&fs::read(common::fixtures().join("photos/reference.json")).unwrap()).unwrap();
    let dir = tmp();
    let names = ["astronaut", "camera", "chelsea", "coffee", "rocket"]; // sorted: class k = names[k]
    for name in names {
        fs::create_dir_all(dir.path().join(name)).unwrap();
        fs::copy(common::fixtures().join(format!("photos/{name}.jpg")), dir.path().join(format!("{name}/{name}.jpg"))).unwrap();
    }
    let c = DataConfig { val_split: 0.0, ..cfg(dir.path()) };
    let d = open(&c, 64, 5, 0).unwrap();
    let flat = |v: &serde_json::Value| -> Vec<f64> {
        v.as_array().unwrap().iter().flat_map(|r| r.as_array().unwrap().iter().flat_map(|p| p.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()))).collect()
    };
    let worst = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f64, f64::max);
    for (k, name) in names.iter().enumerate() {
        let r = &reference[name];
        let img = vitscale::data::decode(&d.train.files[k]).unwrap();
        let (w, h) = (img.width() as usize, img.height() as usize);
        assert_eq!([w as u64, h as u64], [r["size"][0].as_u64().unwrap(), r["size"][1].as_u64().unwrap()], "{name}");
        let decoded = block_means(|x, y, ch| img.get_pixel(x as u32, y as u32)[ch] as f64, w, h);
        let dec_err = worst(&decoded, &flat(&r["decoded"]));
        assert!(dec_err < 1.0, "{name}: decoded block means differ from PIL's by up to {dec_err:.3} levels");
        // The full-size decode (data.decode_scale = "full") resamples as PIL does; the default
        // "auto" decodes these 64-px crops at 1/2 scale, whose scaled IDCT filters a little
        // differently (src/data/jpeg.rs bounds it on full images).
        for (scale, bound) in [(DecodeScale::Full, 1.0), (DecodeScale::Auto, 2.0)] {
            let c = DataConfig { decode_scale: scale, ..c.clone() };
            let b = try_make_batch(&d.train, &[k], &c, false, 0, 0).unwrap();
            assert_eq!(b.labels, vec![k as u32]);
            // CHW, normalized value == pixel value
            let eval = block_means(|x, y, ch| b.images[ch * 64 * 64 + y * 64 + x] as f64, 64, 64);
            // timm's evaluation transform as torchvision runs it (Resize + CenterCrop)
            let eval_err = worst(&eval, &flat(&r["eval64_torchvision"]));
            eprintln!("{name}: block means within {dec_err:.3} (decode, PIL) and {eval_err:.3} (evaluation crop, torchvision, decode_scale {}) levels", scale.as_str());
            assert!(eval_err < bound, "{name}: evaluation-crop block means (decode_scale {}) differ from torchvision's by up to {eval_err:.3} levels", scale.as_str());
        }
    }
}
