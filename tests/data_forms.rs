//! CIFAR in every distributed form — binary folder, python-pickle folder, and the `.tar.gz`
//! archive of each — must give identical image sets and batches; pickles written by real
//! CPython + NumPy (tests/fixtures) must read; bad pickles are errors naming the file.

use std::fs;
use std::io::Write;
use std::path::Path;

use vitscale::config::{DataConfig, DatasetKind, Interpolation, LabelKind};
use vitscale::data::{make_batch, open, DataError, Datasets};

mod common;
use common::{cifar_pixel as pixel, cifar_planes as planes, fixtures, tmp};

fn cfg(dataset: DatasetKind, path: &Path) -> DataConfig {
    DataConfig::for_dataset(dataset, Some(path.to_path_buf()), [0.5; 3], [0.25; 3])
}

/// One split: (first image id, labels as (coarse, fine)).
struct Split {
    first: usize,
    labels: Vec<(u8, u8)>,
}

fn binary(split: &Split, cifar100: bool) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, &(coarse, fine)) in split.labels.iter().enumerate() {
        if cifar100 {
            out.push(coarse);
        }
        out.push(fine);
        out.extend(planes(split.first + k));
    }
    out
}

/// A protocol-2 pickle laid out exactly as the official Python-2 CIFAR files are: SHORT_BINSTRING
/// keys, the array as `numpy.core.multiarray._reconstruct` + BUILD with a BINSTRING payload.
fn py2_pickle(split: &Split, cifar100: bool) -> Vec<u8> {
    let mut p = b"\x80\x02}q\x01(".to_vec();
    let key = |p: &mut Vec<u8>, k: &str| {
        p.push(b'U');
        p.push(k.len() as u8);
        p.extend(k.as_bytes());
    };
    key(&mut p, "batch_label");
    key(&mut p, "training batch 1 of 1");
    key(&mut p, "data");
    p.extend(b"cnumpy.core.multiarray\n_reconstruct\nq\x05cnumpy\nndarray\nq\x06K\x00\x85U\x01b\x87Rq\x07(K\x01");
    let n = split.labels.len() as u16;
    p.push(b'M');
    p.extend(n.to_le_bytes());
    p.extend(b"M\x00\x0c\x86cnumpy\ndtype\nq\x08U\x02u1K\x00K\x01\x87Rq\t(K\x03U\x01|NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89T");
    let data: Vec<u8> = (0..split.labels.len()).flat_map(|k| planes(split.first + k)).collect();
    p.extend((data.len() as u32).to_le_bytes());
    p.extend(&data);
    p.extend(b"tb");
    let list = |p: &mut Vec<u8>, vals: Vec<u8>| {
        p.extend(b"](");
        for v in vals {
            p.push(b'K');
            p.push(v);
        }
        p.push(b'e');
    };
    if cifar100 {
        key(&mut p, "fine_labels");
        list(&mut p, split.labels.iter().map(|l| l.1).collect());
        key(&mut p, "coarse_labels");
        list(&mut p, split.labels.iter().map(|l| l.0).collect());
    } else {
        key(&mut p, "labels");
        list(&mut p, split.labels.iter().map(|l| l.1).collect());
    }
    p.extend(b"u.");
    p
}

fn write_tar_gz(path: &Path, files: &[(String, Vec<u8>)]) {
    let gz = flate2::write::GzEncoder::new(fs::File::create(path).unwrap(), flate2::Compression::fast());
    let mut tar = tar::Builder::new(gz);
    for (name, bytes) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(bytes.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        tar.append_data(&mut h, name, bytes.as_slice()).unwrap();
    }
    tar.into_inner().unwrap().finish().unwrap().flush().unwrap();
}

/// Writes CIFAR-10 (two train batches, one test) or CIFAR-100 in all four forms under `root`;
/// returns the four paths to open.
fn write_all_forms(root: &Path, cifar100: bool) -> Vec<std::path::PathBuf> {
    let splits: Vec<(String, String, Split)> = if cifar100 {
        vec![
            ("train.bin".into(), "train".into(), Split { first: 0, labels: vec![(19, 99), (0, 42), (7, 3)] }),
            ("test.bin".into(), "test".into(), Split { first: 3, labels: vec![(4, 7), (1, 0)] }),
        ]
    } else {
        vec![
            ("data_batch_1.bin".into(), "data_batch_1".into(), Split { first: 0, labels: vec![(0, 3), (0, 9)] }),
            ("data_batch_2.bin".into(), "data_batch_2".into(), Split { first: 2, labels: vec![(0, 0), (0, 5), (0, 1)] }),
            ("test_batch.bin".into(), "test_batch".into(), Split { first: 5, labels: vec![(0, 5), (0, 8)] }),
        ]
    };
    let (bin_dir, py_dir) = if cifar100 { ("cifar-100-binary", "cifar-100-python") } else { ("cifar-10-batches-bin", "cifar-10-batches-py") };
    let bin: Vec<(String, Vec<u8>)> = splits.iter().map(|(b, _, s)| (format!("{bin_dir}/{b}"), binary(s, cifar100))).collect();
    let py: Vec<(String, Vec<u8>)> = splits.iter().map(|(_, p, s)| (format!("{py_dir}/{p}"), py2_pickle(s, cifar100))).collect();
    for form in ["bin", "py"] {
        let d = root.join(form);
        for (name, bytes) in if form == "bin" { &bin } else { &py } {
            let p = d.join(name);
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, bytes).unwrap();
        }
    }
    write_tar_gz(&root.join("bin.tar.gz"), &bin);
    write_tar_gz(&root.join("py.tar.gz"), &py);
    vec![root.join("bin"), root.join("py"), root.join("bin.tar.gz"), root.join("py.tar.gz")]
}

fn assert_same(a: &Datasets, b: &Datasets, c: &DataConfig) {
    assert_eq!(a.train.images, b.train.images);
    assert_eq!(a.train.labels, b.train.labels);
    assert_eq!(a.val.images, b.val.images);
    assert_eq!(a.val.labels, b.val.labels);
    let idx: Vec<usize> = (0..a.train.len()).rev().collect();
    assert_eq!(make_batch(&a.train, &idx, c, true, 2, 9), make_batch(&b.train, &idx, c, true, 2, 9));
}

#[test]
fn cifar10_all_forms_give_identical_batches() {
    let dir = tmp();
    let paths = write_all_forms(dir.path(), false);
    let c = cfg(DatasetKind::Cifar10, dir.path());
    let sets: Vec<Datasets> = paths.iter().map(|p| open(&cfg(DatasetKind::Cifar10, p), 32, 10, 0).unwrap()).collect();
    assert_eq!(sets[0].train.labels, vec![3, 9, 0, 5, 1]);
    assert_eq!(sets[0].val.labels, vec![5, 8]);
    assert_eq!(sets[0].train.image(3)[(4 * 32 + 6) * 3 + 2], pixel(3, 2, 4, 6));
    for s in &sets[1..] {
        assert_same(&sets[0], s, &c);
    }
    assert!(sets[1].description.contains("python"), "{}", sets[1].description);
    assert!(sets[3].description.contains("py.tar.gz"), "{}", sets[3].description);
}

#[test]
fn cifar100_all_forms_and_both_labels() {
    let dir = tmp();
    let paths = write_all_forms(dir.path(), true);
    let c = cfg(DatasetKind::Cifar100, dir.path());
    let fine: Vec<Datasets> = paths.iter().map(|p| open(&cfg(DatasetKind::Cifar100, p), 32, 100, 0).unwrap()).collect();
    assert_eq!(fine[0].train.labels, vec![99, 42, 3]);
    for s in &fine[1..] {
        assert_same(&fine[0], s, &c);
    }
    for p in &paths {
        let mut cc = cfg(DatasetKind::Cifar100, p);
        cc.label = LabelKind::Coarse;
        let d = open(&cc, 32, 20, 0).unwrap();
        assert_eq!(d.train.labels, vec![19, 0, 7], "{}", p.display());
        assert_eq!(d.val.labels, vec![4, 1]);
        assert_eq!(d.num_classes, 20);
    }
}

#[test]
fn official_archive_found_inside_the_folder() {
    let dir = tmp();
    let scratch = tmp();
    write_all_forms(scratch.path(), false);
    fs::copy(scratch.path().join("py.tar.gz"), dir.path().join("cifar-10-python.tar.gz")).unwrap();
    let d = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap();
    assert_eq!(d.train.len(), 5);
}

#[test]
fn pickles_from_cpython_and_numpy_read() {
    let fixtures = fixtures();
    for proto in [2, 4, 5] {
        let dir = tmp();
        let bytes = fs::read(fixtures.join(format!("cifar10_py3_protocol{proto}.pkl"))).unwrap();
        fs::write(dir.path().join("data_batch_1"), &bytes).unwrap();
        fs::write(dir.path().join("test_batch"), &bytes).unwrap();
        let d = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap_or_else(|e| panic!("protocol {proto}: {e}"));
        assert_eq!(d.train.labels, vec![3, 9, 0]);
        for i in 0..3 {
            for (y, x, c) in [(0, 0, 0), (5, 7, 2), (31, 31, 1)] {
                assert_eq!(d.train.image(i)[(y * 32 + x) * 3 + c], pixel(i, c, y, x), "protocol {proto}");
            }
        }
    }
}

#[test]
fn bad_pickles_are_errors_naming_the_file() {
    let dir = tmp();
    let good = py2_pickle(&Split { first: 0, labels: vec![(0, 1), (0, 2)] }, false);
    fs::write(dir.path().join("test_batch"), &good).unwrap();
    // Truncated mid-array.
    fs::write(dir.path().join("data_batch_1"), &good[..good.len() / 2]).unwrap();
    let e = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, DataError::Format { .. }) && msg.contains("data_batch_1") && msg.contains("byte offset"), "{msg}");
    // Label out of range.
    let bad = py2_pickle(&Split { first: 0, labels: vec![(0, 1), (0, 10)] }, false);
    fs::write(dir.path().join("data_batch_1"), &bad).unwrap();
    let msg = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap_err().to_string();
    assert!(msg.contains("data_batch_1") && msg.contains("'labels'[1]"), "{msg}");
    // Not a pickle at all.
    fs::write(dir.path().join("data_batch_1"), b"hello").unwrap();
    let msg = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap_err().to_string();
    assert!(msg.contains("data_batch_1"), "{msg}");
    // A corrupt archive.
    let arch = dir.path().join("x.tar.gz");
    fs::write(&arch, b"\x1f\x8b\x08\x00garbage").unwrap();
    let msg = open(&cfg(DatasetKind::Cifar10, &arch), 32, 10, 0).unwrap_err().to_string();
    assert!(msg.contains("x.tar.gz"), "{msg}");
}

#[test]
fn cifar_at_224_is_resampled() {
    let dir = tmp();
    let paths = write_all_forms(dir.path(), false);
    let mut c = cfg(DatasetKind::Cifar10, &paths[0]);
    let d = open(&c, 64, 10, 0).unwrap();
    assert!(d.description.contains("resampled to 64"), "{}", d.description);
    assert_eq!(c.interpolation, Interpolation::Bilinear, "the default filter");
    for filter in [Interpolation::Bilinear, Interpolation::Bicubic] {
        c.interpolation = filter;
        check_eval_resampling(&d, &c);
    }
    // Training images go through RandomResizedCrop to the same size.
    let t = make_batch(&d.train, &[0, 1, 2], &c, true, 0, 0);
    assert_eq!(t.images.len(), 3 * 3 * 64 * 64);
    assert!(t.images.iter().all(|v| v.is_finite()));
}

/// The eval batch of the two val images at 64 px against the source ramps (see
/// `cifar_at_224_is_resampled`).
fn check_eval_resampling(d: &Datasets, c: &DataConfig) {
    let filter = c.interpolation;
    let b = make_batch(&d.val, &[0, 1], c, false, 0, 0);
    assert_eq!(b.images.len(), 2 * 3 * 64 * 64);
    // Eval is timm's transform as torchvision runs it: the image resized to R = floor(64 /
    // crop_pct) px a side, then the 64 × 64 crop at round((R − 64) / 2) (Python's round, halves
    // to even); `src_at` is the source position (in pixel-index units, pixel k's centre at k)
    // that output pixel i samples: resized pixel left + i, scaled back by 32 / R.
    let resized = (64.0 / c.crop_pct).floor();
    let left = ((resized - 64.0) / 2.0_f64).round_ties_even();
    let src_at = |i: usize| (left + i as f64 + 0.5) * 32.0 / resized - 0.5;
    // The val images (ids 5 and 6) are ramps, base + 3y + x, on channels 0 and 1 (no wrap past
    // 255 there). An interpolating filter with normalized weights, bilinear or bicubic,
    // reproduces a linear function wherever all its taps lie inside the image, so there the
    // output is the ramp at `src_at`, normalized with mean 0.5 and std 0.25.
    let want = |img: usize, c: usize, sy: f64, sx: f64| ((pixel(img, c, 0, 0) as f64 + 3.0 * sy + sx) / 255.0 - 0.5) / 0.25;
    // One 8-bit level is 1 / 255 / 0.25 ≈ 0.016 here; the f32 resampling is good to ~1e-5.
    let tol = 1e-3;
    let got = |k: usize, c: usize, oy: usize, ox: usize| b.images[((k * 3 + c) * 64 + oy) * 64 + ox] as f64;
    // The four central output pixels (about 2× up) average the ramp at the middle of their
    // source positions (the ramp is linear)
    let mid = (src_at(31) + src_at(32)) / 2.0;
    let centre: f64 = [(31, 31), (31, 32), (32, 31), (32, 32)].iter().map(|&(y, x)| got(0, 0, y, x)).sum::<f64>() / 4.0;
    assert!((centre - want(5, 0, mid, mid)).abs() < tol, "{filter:?}: centre {centre} vs {}", want(5, 0, mid, mid));
    assert!((got(0, 0, 32, 32) - want(5, 0, src_at(32), src_at(32))).abs() < tol, "{filter:?}: pixel (32, 32): {} vs {}", got(0, 0, 32, 32), want(5, 0, src_at(32), src_at(32)));
    // Every output pixel whose taps (radius 2 at most, upsampling) stay inside the source.
    let inside = |i: usize| (2.0..=29.0).contains(&src_at(i));
    let mut checked = 0;
    for (k, img) in [(0, 5), (1, 6)] {
        for ch in 0..2 {
            for oy in (0..64).filter(|&i| inside(i)) {
                for ox in (0..64).filter(|&i| inside(i)) {
                    let (g, w) = (got(k, ch, oy, ox), want(img, ch, src_at(oy), src_at(ox)));
                    assert!((g - w).abs() < tol, "{filter:?}: image {img} channel {ch} pixel ({oy}, {ox}): {g} vs {w}");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 4 * 50 * 50, "{filter:?}: only {checked} pixels checked");
}
