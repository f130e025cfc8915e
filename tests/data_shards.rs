//! Tar shards (`vitscale data pack`, `data.dataset=shards`): the packed layout read back by
//! the tar crate, the images, labels and batches compared with the folder dataset reading the
//! original files, every image once per epoch over 2 and 3 ranks, determinism from the seed,
//! and bad shards, index files and options as errors that name the file and member.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vitscale::config::{DataConfig, DatasetKind};
use vitscale::data::shards::{self, PackOptions};
use vitscale::data::{open, try_make_batch, Batch, Datasets, ImageSet, Loader, LoaderPlan, Sampler};

mod common;
use common::{fixtures, tmp, vitscale};

const SIDE: usize = 24;

fn cfg(dataset: DatasetKind, path: &Path) -> DataConfig {
    DataConfig { num_workers: 2, prefetch: 2, ..DataConfig::for_dataset(dataset, Some(path.to_path_buf()), [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]) }
}

const PHOTOS: [&str; 5] = ["astronaut", "chelsea", "coffee", "rocket", "camera"];

/// A folder `root/train|val/<class>/…` of distinct images cut from the fixture photographs:
/// JPEG crops of several sizes, PNG crops, and the fixture files themselves byte for byte
/// (one is greyscale). Returns the number of (train, val) images.
fn make_folder(root: &Path, per_class: usize) -> (usize, usize) {
    let photos: Vec<image::RgbImage> = PHOTOS.iter().map(|p| image::open(fixtures().join(format!("photos/{p}.jpg"))).unwrap().into_rgb8()).collect();
    let mut counts = (0, 0);
    for (split, n) in [("train", per_class), ("val", per_class / 2)] {
        for (c, class) in ["kestrel", "lynx", "otter"].iter().enumerate() {
            let dir = root.join(split).join(class);
            fs::create_dir_all(&dir).unwrap();
            for i in 0..n {
                let k = c * 31 + i + if split == "val" { 7 } else { 0 };
                // each fixture file once: train astronaut, camera, coffee; val chelsea, rocket
                let photo = match (split, i) {
                    ("train", 0) => Some([0, 4, 2][c]),
                    ("val", 0) if c < 2 => Some([1, 3][c]),
                    _ => None,
                };
                if let Some(p) = photo {
                    fs::copy(fixtures().join(format!("photos/{}.jpg", PHOTOS[p])), dir.join(format!("photo_{i}.jpeg"))).unwrap();
                } else {
                    let p = &photos[k % photos.len()];
                    let (w, h) = (60 + (k * 7) as u32 % 90, 50 + (k * 11) as u32 % 80);
                    let (x, y) = ((k * 37) as u32 % (p.width() - w), (k * 23) as u32 % (p.height() - h));
                    let crop = image::imageops::crop_imm(p, x, y, w, h).to_image();
                    let ext = if k % 4 == 1 { "png" } else { "jpg" };
                    crop.save(dir.join(format!("crop_{i:02}.{ext}"))).unwrap();
                }
                if split == "train" { counts.0 += 1 } else { counts.1 += 1 }
            }
        }
    }
    counts
}

fn pack(src: &Path, out: &Path, max_images: Option<usize>) -> shards::PackReport {
    shards::pack(src, out, &PackOptions { max_bytes: None, max_images, val_split: 0.1, seed: 0 }).unwrap()
}

fn open_both(src: &Path, out: &Path) -> (Datasets, Datasets, DataConfig, DataConfig) {
    let (cf, cs) = (cfg(DatasetKind::Folder, src), cfg(DatasetKind::Shards, out));
    let f = open(&cf, SIDE, 3, 0).unwrap();
    let s = open(&cs, SIDE, 3, 0).unwrap();
    (f, s, cf, cs)
}

/// The shards hold the WebDataset layout: per image `KEY.ext` with the original file's bytes,
/// then `KEY.cls` with its label, keys unique, in the folder dataset's order — read with the
/// tar crate, independently of vitscale's reader.
#[test]
fn packed_shards_hold_the_original_files_in_the_webdataset_layout() {
    let (src, out) = (tmp(), tmp());
    let (n_train, n_val) = make_folder(src.path(), 8);
    let out = out.path().join("shards");
    let r = pack(src.path(), &out, Some(5));
    assert_eq!((r.train, r.val), ((n_train, n_train.div_ceil(5)), (n_val, n_val.div_ceil(5))));
    let f = open(&cfg(DatasetKind::Folder, src.path()), SIDE, 3, 0).unwrap();
    let mut keys = std::collections::HashSet::new();
    for (split, set) in [("train", &f.train), ("val", &f.val)] {
        let mut shard_files: Vec<PathBuf> = fs::read_dir(&out).unwrap().map(|e| e.unwrap().path()).filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(&format!("{split}-"))).collect();
        shard_files.sort();
        assert_eq!(shard_files.len(), set.len().div_ceil(5));
        let mut members = Vec::new();
        for (s, path) in shard_files.iter().enumerate() {
            assert_eq!(path.file_name().unwrap().to_str().unwrap(), format!("{split}-{s:06}.tar"));
            let mut a = tar::Archive::new(fs::File::open(path).unwrap());
            for e in a.entries().unwrap() {
                let mut e = e.unwrap();
                let name = e.path().unwrap().to_str().unwrap().to_string();
                let mut bytes = Vec::new();
                std::io::Read::read_to_end(&mut e, &mut bytes).unwrap();
                members.push((name, bytes));
            }
        }
        assert_eq!(members.len(), 2 * set.len());
        for (i, pair) in members.chunks(2).enumerate() {
            let (img, cls) = (&pair[0], &pair[1]);
            let (key, ext) = img.0.split_once('.').unwrap();
            assert!(keys.insert(key.to_string()), "key {key} twice");
            assert_eq!(cls.0, format!("{key}.cls"));
            let original = &set.files[i];
            let want_ext = original.extension().unwrap().to_str().unwrap().to_lowercase().replace("jpeg", "jpg");
            assert_eq!(ext, want_ext, "{}", original.display());
            assert!(img.1 == fs::read(original).unwrap(), "{} is not stored as-is", original.display());
            assert_eq!(std::str::from_utf8(&cls.1).unwrap(), set.labels[i].to_string());
        }
    }
    // no temporary files are left behind
    assert!(fs::read_dir(&out).unwrap().all(|e| !e.unwrap().file_name().to_str().unwrap().starts_with('.')));
}

/// Shards are the folder dataset: same classes, labels, decoded pixels (evaluation batches at
/// a side that resamples every image) and augmented training batches, bit for bit.
#[test]
fn shards_yield_the_folder_datasets_images_and_batches() {
    let (src, out) = (tmp(), tmp());
    make_folder(src.path(), 8);
    let out = out.path().join("shards");
    pack(src.path(), &out, Some(4));
    let (f, s, cf, cs) = open_both(src.path(), &out);
    assert_eq!(s.class_names, vec!["kestrel", "lynx", "otter"]);
    assert_eq!(s.class_names, f.class_names);
    assert!(s.description.contains("shards"), "{}", s.description);
    for (fs_, ss, what) in [(&f.train, &s.train, "train"), (&f.val, &s.val, "val")] {
        assert_eq!(ss.labels, fs_.labels, "{what} labels");
        let all: Vec<usize> = (0..fs_.len()).collect();
        let want = try_make_batch(fs_, &all, &cf, false, 0, 3).unwrap();
        let got = try_make_batch(ss, &all, &cs, false, 0, 3).unwrap();
        assert!(got == want, "{what}: evaluation batches differ");
        for epoch in [0, 5] {
            let want = try_make_batch(fs_, &all, &cf, true, epoch, 3).unwrap();
            let got = try_make_batch(ss, &all, &cs, true, epoch, 3).unwrap();
            assert!(got == want, "{what}: training batches of epoch {epoch} differ");
        }
    }
    // With RandAugment and random erasing too.
    let mut cf2 = cf.clone();
    cf2.aug.auto_augment = vitscale::config::parse_rand_augment("rand-m9-mstd0.5-inc1").unwrap();
    cf2.aug.reprob = 0.5;
    let cs2 = DataConfig { dataset: DatasetKind::Shards, path: cs.path.clone(), ..cf2.clone() };
    let idx: Vec<usize> = (0..f.train.len()).rev().collect();
    assert!(try_make_batch(&s.train, &idx, &cs2, true, 1, 9).unwrap() == try_make_batch(&f.train, &idx, &cf2, true, 1, 9).unwrap());
}

/// A folder without `val/` is split at packing time as the folder dataset splits it for the
/// same `val_split` and seed.
#[test]
fn packing_a_folder_without_val_makes_the_folder_datasets_split() {
    let (src, out) = (tmp(), tmp());
    make_folder(src.path(), 8);
    let flat = src.path().join("train");
    let out = out.path().join("shards");
    shards::pack(&flat, &out, &PackOptions { max_bytes: Some(64 << 10), max_images: None, val_split: 0.25, seed: 11 }).unwrap();
    let cf = DataConfig { val_split: 0.25, ..cfg(DatasetKind::Folder, &flat) };
    let f = open(&cf, SIDE, 3, 11).unwrap();
    let s = open(&cfg(DatasetKind::Shards, &out), SIDE, 3, 0).unwrap();
    for (a, b) in [(&f.train, &s.train), (&f.val, &s.val)] {
        assert_eq!(a.labels, b.labels);
        let all: Vec<usize> = (0..a.len()).collect();
        assert!(try_make_batch(a, &all, &cf, false, 0, 0).unwrap() == try_make_batch(b, &all, &cfg(DatasetKind::Shards, &out), false, 0, 0).unwrap());
    }
    // 64 KiB shards: more than one, each within the limit (no image here is larger).
    let tars: Vec<u64> = fs::read_dir(&out).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "tar")).map(|p| fs::metadata(p).unwrap().len()).collect();
    assert!(tars.len() > 2, "{tars:?}");
    assert!(tars.iter().all(|&b| b <= 64 << 10), "{tars:?}");
}

#[allow(clippy::too_many_arguments)]
fn loader_plan(set: Arc<ImageSet>, c: &DataConfig, seed: u64, rank: usize, world: usize, gas: usize, global: usize, steps: u64) -> LoaderPlan {
    LoaderPlan {
        sampler: Sampler::new(set.len(), global, true, seed, true),
        set,
        cfg: c.clone(),
        // unaugmented, so every image's pixels identify it
        train: false,
        seed,
        rank,
        world,
        gas,
        start_epoch: 0,
        start_step: 0,
        steps,
        mix: None,
    }
}

fn images(b: &Batch) -> Vec<Vec<u32>> {
    b.images.chunks(3 * SIDE * SIDE).map(|px| px.iter().map(|v| v.to_bits()).collect()).collect()
}

/// Over 2 and 3 ranks, each epoch every image is seen once, except the `len mod global batch`
/// images the folder dataset's sampler drops too (`drop_last`, a different set each epoch);
/// each rank's batches are the folder dataset's.
#[test]
fn every_image_once_per_epoch_over_ranks() {
    let (src, out) = (tmp(), tmp());
    let (n, _) = make_folder(src.path(), 9); // 27 training images
    let out = out.path().join("shards");
    pack(src.path(), &out, Some(4));
    let (f, s, cf, cs) = open_both(src.path(), &out);
    // The reference identity of each image: its unaugmented pixels, from the folder dataset.
    let all: Vec<usize> = (0..n).collect();
    let by_pixels: HashMap<Vec<u32>, usize> = images(&try_make_batch(&f.train, &all, &cf, false, 0, 0).unwrap()).into_iter().enumerate().map(|(i, p)| (p, i)).collect();
    assert_eq!(by_pixels.len(), n, "the test images must be distinct");
    for (world, gas) in [(2usize, 2usize), (3, 1)] {
        let global = 2 * world * gas; // 8 or 6: 27 does not divide
        let steps_per_epoch = n / global;
        let epochs = 3;
        let mut seen = vec![vec![0usize; n]; epochs];
        for rank in 0..world {
            let steps = (epochs * steps_per_epoch) as u64;
            let shard_loader = Loader::start(loader_plan(s.train.clone(), &cs, 4, rank, world, gas, global, steps)).unwrap();
            let folder_loader = Loader::start(loader_plan(f.train.clone(), &cf, 4, rank, world, gas, global, steps)).unwrap();
            for (p, q) in shard_loader.zip(folder_loader) {
                let (p, q) = (p.unwrap(), q.unwrap());
                assert!(p.batch == q.batch, "world {world} rank {rank}: epoch {} step {} differs from the folder dataset", p.epoch, p.step);
                for (img, &label) in images(&p.batch).into_iter().zip(&p.batch.labels) {
                    let i = by_pixels[&img];
                    assert_eq!(label as u16, f.train.labels[i]);
                    seen[p.epoch as usize][i] += 1;
                }
            }
        }
        for (e, counts) in seen.iter().enumerate() {
            assert!(counts.iter().all(|&c| c <= 1), "world {world} epoch {e}: an image twice: {counts:?}");
            assert_eq!(counts.iter().sum::<usize>(), steps_per_epoch * global, "world {world} epoch {e}");
            // the ones left out are the tail of the epoch's permutation, as for the folder
            let order = Sampler::new(n, global, true, 4, true).order(e as u64);
            let missed: Vec<usize> = (0..n).filter(|&i| counts[i] == 0).collect();
            let mut tail = order[steps_per_epoch * global..].to_vec();
            tail.sort();
            assert_eq!(missed, tail, "world {world} epoch {e}");
        }
    }
}

/// The order and augmentation come from the seed: the same seed gives the same batches, another
/// seed another order; the shard layout (images per shard) changes nothing.
#[test]
fn batches_are_deterministic_in_the_seed_not_the_shard_layout() {
    let (src, out) = (tmp(), tmp());
    make_folder(src.path(), 6);
    let (a, b) = (out.path().join("a"), out.path().join("b"));
    pack(src.path(), &a, Some(3));
    pack(src.path(), &b, Some(100));
    let (ca, cb) = (cfg(DatasetKind::Shards, &a), cfg(DatasetKind::Shards, &b));
    let sa = open(&ca, SIDE, 3, 0).unwrap();
    let sb = open(&cb, SIDE, 3, 0).unwrap();
    let run = |set: &Arc<ImageSet>, c: &DataConfig, seed: u64| -> Vec<Batch> {
        let mut plan = loader_plan(set.clone(), c, seed, 0, 1, 1, 4, 8);
        plan.train = true;
        Loader::start(plan).unwrap().map(|p| p.unwrap().batch).collect()
    };
    let x = run(&sa.train, &ca, 21);
    assert_eq!(x.len(), 8);
    assert!(x == run(&sa.train, &ca, 21));
    assert!(x == run(&sb.train, &cb, 21), "the shard layout changed the batches");
    assert!(x != run(&sa.train, &ca, 22));
}

// ---- bad input ----

fn index(out: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs::read(out.join("index.json")).unwrap()).unwrap()
}

/// (offset of image `k`'s header in the first train shard, its length, shard path).
fn member(out: &Path, k: usize) -> (u64, u64, PathBuf) {
    let ix = index(out);
    let sh = &ix["train"]["shards"][0];
    (sh["offsets"][k].as_u64().unwrap(), sh["lens"][k].as_u64().unwrap(), out.join(sh["file"].as_str().unwrap()))
}

fn patch(path: &Path, at: u64, bytes: &[u8]) {
    let mut all = fs::read(path).unwrap();
    all[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
    fs::write(path, all).unwrap();
}

/// Packs a fresh copy, applies `damage`, and returns the error of a batch over every training
/// image (the index still opens).
fn batch_error(damage: impl FnOnce(&Path)) -> String {
    let (src, out) = (tmp(), tmp());
    make_folder(src.path(), 4);
    let dir = out.path().join("shards");
    pack(src.path(), &dir, None);
    damage(&dir);
    let c = cfg(DatasetKind::Shards, &dir);
    let s = open(&c, SIDE, 3, 0).unwrap();
    let all: Vec<usize> = (0..s.train.len()).collect();
    try_make_batch(&s.train, &all, &c, false, 0, 0).unwrap_err().to_string()
}

#[test]
fn a_bad_cls_member_is_an_error_naming_shard_member_and_offset() {
    // Image 2 is a crop (k = 2): its label is one decimal digit, the last byte of its span.
    let e = batch_error(|d| {
        let (off, len, path) = member(d, 2);
        patch(&path, off + len - 1, b"x");
    });
    assert!(e.contains("train-000000.tar") && e.contains("train_00000002.cls") && e.contains("not a class index") && e.contains("\"x\""), "{e}");
    assert!(e.contains("byte offset"), "{e}");
    let e = batch_error(|d| {
        let (off, len, path) = member(d, 2);
        patch(&path, off + len - 1, b"7");
    });
    assert!(e.contains("train-000000.tar") && e.contains("train_00000002.cls") && e.contains("out of range (3 classes)"), "{e}");
    // In range but not the label the index gives.
    let e = batch_error(|d| {
        let (off, len, path) = member(d, 2);
        patch(&path, off + len - 1, b"2");
    });
    assert!(e.contains("train_00000002.cls") && e.contains("index.json says 0"), "{e}");
}

#[test]
fn a_member_without_its_pair_is_an_error() {
    let e = batch_error(|d| {
        let (off, len, path) = member(d, 1);
        // The .cls header is the second-last block of the span: rename it to .txt.
        let at = off + (len - 1) / 512 * 512 - 512;
        let all = fs::read(&path).unwrap();
        let mut h = tar::Header::new_old();
        h.as_mut_bytes().copy_from_slice(&all[at as usize..at as usize + 512]);
        assert_eq!(h.path().unwrap().to_str().unwrap(), "train_00000001.cls");
        h.set_path("train_00000001.txt").unwrap();
        h.set_cksum();
        patch(&path, at, h.as_bytes());
    });
    assert!(e.contains("train-000000.tar") && e.contains("train_00000001.") && e.contains("has no train_00000001.cls after it") && e.contains("train_00000001.txt"), "{e}");
}

#[test]
fn a_truncated_or_missing_shard_and_a_bad_index_are_errors() {
    let (src, out) = (tmp(), tmp());
    make_folder(src.path(), 4);
    let dir = out.path().join("shards");
    pack(src.path(), &dir, Some(5));
    let c = cfg(DatasetKind::Shards, &dir);
    let shard = dir.join("train-000001.tar");
    let full = fs::read(&shard).unwrap();
    fs::write(&shard, &full[..full.len() - 700]).unwrap();
    let e = open(&c, SIDE, 3, 0).unwrap_err().to_string();
    assert!(e.contains("train-000001.tar") && e.contains("truncated"), "{e}");
    fs::remove_file(&shard).unwrap();
    let e = open(&c, SIDE, 3, 0).unwrap_err().to_string();
    assert!(e.contains("train-000001.tar"), "{e}");
    fs::write(&shard, &full).unwrap();
    assert!(open(&c, SIDE, 3, 0).is_ok());
    // A shard that is cut short after it was opened: the read names shard and offset.
    let s = open(&c, SIDE, 3, 0).unwrap();
    fs::write(&shard, &full[..1000]).unwrap();
    let all: Vec<usize> = (0..s.train.len()).collect();
    let e = try_make_batch(&s.train, &all, &c, false, 0, 0).unwrap_err().to_string();
    assert!(e.contains("train-000001.tar") && e.contains("byte offset") && e.contains("cannot read"), "{e}");
    fs::write(&shard, &full).unwrap();
    // The index: wrong class count for the model, unreadable, missing.
    let e = open(&c, SIDE, 5, 0).unwrap_err().to_string();
    assert!(e.contains("model.num_classes=3"), "{e}");
    let text = fs::read_to_string(dir.join("index.json")).unwrap();
    fs::write(dir.join("index.json"), &text[..text.len() / 2]).unwrap();
    let e = open(&c, SIDE, 3, 0).unwrap_err().to_string();
    assert!(e.contains("index.json") && e.contains("not a shards index"), "{e}");
    let mut ix: serde_json::Value = serde_json::from_str(&text).unwrap();
    ix["train"]["shards"][0]["labels"][0] = 9.into();
    fs::write(dir.join("index.json"), ix.to_string()).unwrap();
    let e = open(&c, SIDE, 3, 0).unwrap_err().to_string();
    assert!(e.contains("index.json") && e.contains("label 9"), "{e}");
    let mut ix: serde_json::Value = serde_json::from_str(&text).unwrap();
    ix["train"]["shards"][0]["file"] = "../elsewhere.tar".into();
    fs::write(dir.join("index.json"), ix.to_string()).unwrap();
    let e = open(&c, SIDE, 3, 0).unwrap_err().to_string();
    assert!(e.contains("not a plain file name"), "{e}");
    fs::remove_file(dir.join("index.json")).unwrap();
    let e = open(&c, SIDE, 3, 0).unwrap_err().to_string();
    assert!(e.contains("index.json") && e.contains("missing"), "{e}");
}

/// An image whose bytes do not decode is an error naming shard and member (or, with
/// `data.skip_bad`, replaced by the next image and counted).
#[test]
fn an_undecodable_member_errors_or_is_skipped() {
    let (src, out) = (tmp(), tmp());
    make_folder(src.path(), 4);
    fs::write(src.path().join("train/lynx/crop_01.jpg"), b"\xff\xd8\xff\xe0 not a jpeg at all").unwrap();
    let dir = out.path().join("shards");
    pack(src.path(), &dir, None);
    let mut c = cfg(DatasetKind::Shards, &dir);
    let s = open(&c, SIDE, 3, 0).unwrap();
    let all: Vec<usize> = (0..s.train.len()).collect();
    let e = try_make_batch(&s.train, &all, &c, false, 0, 0).unwrap_err().to_string();
    assert!(e.contains("train-000000.tar") && e.contains("train_00000004.jpg") && e.contains("cannot decode") && e.contains("skip_bad"), "{e}");
    c.skip_bad = true;
    assert_eq!(try_make_batch(&s.train, &all, &c, false, 0, 0).unwrap().len(), all.len());
    assert_eq!(s.train.skipped.load(std::sync::atomic::Ordering::Relaxed), 1);
}

// ---- the command line ----

#[test]
fn cli_packs_refuses_existing_output_and_trains_on_shards() {
    let (src, out) = (tmp(), tmp());
    make_folder(src.path(), 6);
    let dir = out.path().join("shards");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a = vec!["data".to_string(), "pack".into(), src.path().display().to_string(), dir.display().to_string()];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let o = vitscale(Path::new("."), &args(&["--shard-size", "100KiB"]));
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout).into_owned(), String::from_utf8_lossy(&o.stderr).into_owned());
    assert!(o.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("18 train images") && stdout.contains("9 val images"), "{stdout}");
    let before = fs::read(dir.join("index.json")).unwrap();
    // existing output: refused, untouched
    let o = vitscale(Path::new("."), &args(&[]));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && stderr.contains("already exists") && stderr.contains(dir.to_str().unwrap()), "{stderr}");
    assert_eq!(fs::read(dir.join("index.json")).unwrap(), before);
    // a bad size
    let o = vitscale(Path::new("."), &args(&["--shard-size", "12XB"]));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && stderr.contains("12XB") && !stderr.contains("panicked"), "{stderr}");
    // train on the shards; model.num_classes comes from the index
    let run_dir = out.path().join("run");
    let o = vitscale(
        Path::new("."),
        &[
            "train", "--device=cpu", "--set=data.dataset=shards", &format!("--set=data.path={}", dir.display()), "--set=model.image_size=16",
            "--set=model.patch_size=8", "--set=model.depth=1", "--set=train_batch_size=4", "--set=train.steps=3", "--set=data.num_workers=1",
            "--run-dir", run_dir.to_str().unwrap(),
        ],
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{stderr}");
    let summary: serde_json::Value = serde_json::from_slice(&fs::read(run_dir.join("summary.json")).unwrap()).unwrap();
    assert!(summary["val_top1"].is_number(), "{summary}");
}

/// An empty image file packs (its bytes, none, as-is) and fails only the batches that hold it,
/// as in the folder it came from.
#[test]
fn an_empty_image_file_fails_only_its_batches() {
    let (src, out) = (tmp(), tmp());
    make_folder(src.path(), 4);
    fs::write(src.path().join("train/otter/crop_02.jpg"), b"").unwrap();
    let dir = out.path().join("shards");
    pack(src.path(), &dir, None);
    let c = cfg(DatasetKind::Shards, &dir);
    let s = open(&c, SIDE, 3, 0).unwrap();
    // kestrel 0..4, lynx 4..8, otter: crop_01 8, crop_02 9
    assert!(try_make_batch(&s.train, &[0, 1, 8, 10], &c, false, 0, 0).is_ok());
    let e = try_make_batch(&s.train, &[9], &c, false, 0, 0).unwrap_err().to_string();
    assert!(e.contains("train_00000009.jpg") && e.contains("cannot decode"), "{e}");
}

/// Decode + evaluation-transform time of the same 224-px batches from files and from shards
/// (`cargo test --release --test data_shards -- --ignored --nocapture`).
#[test]
#[ignore]
fn profile_shards_vs_folder() {
    let (src, out) = (tmp(), tmp());
    for class in ["a", "b"] {
        vitscale::data::synthetic::write_jpegs(&src.path().join("train").join(class), 200, class.len() as u64 + 1).unwrap();
        vitscale::data::synthetic::write_jpegs(&src.path().join("val").join(class), 2, 9).unwrap();
    }
    let dir = out.path().join("shards");
    let t = std::time::Instant::now();
    pack(src.path(), &dir, None);
    let pack_s = t.elapsed().as_secs_f64();
    let (cf, cs) = (cfg(DatasetKind::Folder, src.path()), cfg(DatasetKind::Shards, &dir));
    let f = open(&cf, 224, 2, 0).unwrap();
    let s = open(&cs, 224, 2, 0).unwrap();
    let all: Vec<usize> = (0..f.train.len()).collect();
    for round in 0..2 {
        let t = std::time::Instant::now();
        let a = try_make_batch(&f.train, &all, &cf, true, round, 0).unwrap();
        let folder_s = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        let b = try_make_batch(&s.train, &all, &cs, true, round, 0).unwrap();
        let shards_s = t.elapsed().as_secs_f64();
        assert!(a == b);
        eprintln!("{} images: folder {folder_s:.3} s, shards {shards_s:.3} s (pack {pack_s:.3} s)", all.len());
    }
}
