//! CIFAR binary readers on small generated files: labels and pixels land where expected, and
//! every kind of bad input is an error naming the file (and byte offset), never a panic.

use std::fs;
use std::path::Path;

use vitscale::config::{DataConfig, DatasetKind};
use vitscale::data::{make_batch, open, DataError};

mod common;
use common::{cifar_pixel as pixel, cifar_planes, tmp};

fn cfg(dataset: DatasetKind, path: &Path) -> DataConfig {
    // Normalized value == byte value.
    DataConfig::for_dataset(dataset, Some(path.to_path_buf()), [0.0; 3], [1.0 / 255.0; 3])
}

/// One CIFAR record: label bytes then CHW planes.
fn record(labels: &[u8], img: usize) -> Vec<u8> {
    [labels.to_vec(), cifar_planes(img)].concat()
}

fn write(path: &Path, records: &[Vec<u8>]) {
    fs::write(path, records.concat()).unwrap();
}

#[test]
fn cifar10_labels_and_pixels_land_where_expected() {
    let dir = tmp();
    // Only batches 1 and 3 exist: both are loaded, in order.
    write(&dir.path().join("data_batch_1.bin"), &[record(&[3], 0), record(&[9], 1)]);
    write(&dir.path().join("data_batch_3.bin"), &[record(&[0], 2)]);
    write(&dir.path().join("test_batch.bin"), &[record(&[5], 3)]);
    let d = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap();
    assert_eq!(d.train.labels, vec![3, 9, 0]);
    assert_eq!(d.val.labels, vec![5]);
    assert_eq!(d.num_classes, 10);
    assert!(d.description.contains("3 train"), "{}", d.description);
    // HWC storage: (y, x, c).
    for (i, img) in [(0usize, 0usize), (2, 2)] {
        let im = d.train.image(i);
        for (y, x, c) in [(0, 0, 0), (0, 1, 0), (5, 7, 2), (31, 31, 1)] {
            assert_eq!(im[(y * 32 + x) * 3 + c], pixel(img, c, y, x));
        }
    }
    // Eval batch (no augmentation) is CHW again and equals the original planes.
    let b = make_batch(&d.val, &[0], &cfg(DatasetKind::Cifar10, dir.path()), false, 0, 0);
    assert_eq!(b.labels, vec![5]);
    for c in 0..3 {
        for y in 0..32 {
            for x in 0..32 {
                assert_eq!(b.images[c * 1024 + y * 32 + x].round() as u8, pixel(3, c, y, x));
            }
        }
    }
}

#[test]
fn cifar_archive_subfolder_is_found() {
    let dir = tmp();
    let sub = dir.path().join("cifar-10-batches-bin");
    fs::create_dir(&sub).unwrap();
    write(&sub.join("data_batch_1.bin"), &[record(&[1], 0)]);
    write(&sub.join("test_batch.bin"), &[record(&[2], 1)]);
    let d = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap();
    assert_eq!(d.train.labels, vec![1]);
}

#[test]
fn cifar100_uses_the_fine_label() {
    let dir = tmp();
    write(&dir.path().join("train.bin"), &[record(&[19, 99], 0), record(&[0, 42], 1)]);
    write(&dir.path().join("test.bin"), &[record(&[4, 7], 2)]);
    let d = open(&cfg(DatasetKind::Cifar100, dir.path()), 32, 100, 0).unwrap();
    assert_eq!(d.train.labels, vec![99, 42]);
    assert_eq!(d.val.labels, vec![7]);
    assert_eq!(d.train.image(1)[(4 * 32 + 6) * 3 + 2], pixel(1, 2, 4, 6));
}

#[test]
fn missing_files_are_named() {
    let dir = tmp();
    let e = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap_err();
    assert!(matches!(e, DataError::NotFound { split: "train", .. }), "{e}");
    assert!(e.to_string().contains("data_batch_1.bin"), "{e}");
    write(&dir.path().join("data_batch_2.bin"), &[record(&[1], 0)]);
    let e = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap_err();
    assert!(e.to_string().contains("test_batch.bin"), "{e}");
    let e = open(&cfg(DatasetKind::Cifar100, dir.path()), 32, 100, 0).unwrap_err();
    assert!(e.to_string().contains("train.bin"), "{e}");
}

#[test]
fn truncated_file_names_file_and_offset() {
    let dir = tmp();
    let mut recs = vec![record(&[1], 0), record(&[2], 1)];
    recs[1].truncate(1000);
    write(&dir.path().join("data_batch_1.bin"), &recs);
    write(&dir.path().join("test_batch.bin"), &[record(&[2], 1)]);
    let e = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap_err();
    match &e {
        DataError::Truncated { path, offset, .. } => {
            assert!(path.ends_with("data_batch_1.bin"));
            assert_eq!(*offset, 3073);
        }
        other => panic!("expected Truncated, got {other}"),
    }
    let msg = e.to_string();
    assert!(msg.contains("data_batch_1.bin") && msg.contains("offset 3073"), "{msg}");
}

#[test]
fn out_of_range_label_names_file_and_offset() {
    let dir = tmp();
    write(&dir.path().join("data_batch_1.bin"), &[record(&[1], 0)]);
    write(&dir.path().join("test_batch.bin"), &[record(&[2], 0), record(&[2], 1), record(&[10], 2)]);
    let e = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, DataError::LabelOutOfRange { label: 10, offset: 6146, .. }), "{msg}");
    assert!(msg.contains("test_batch.bin") && msg.contains("6146"), "{msg}");
    // CIFAR-100: the fine label is the second byte of the record.
    write(&dir.path().join("train.bin"), &[record(&[1, 2], 0), record(&[3, 100], 1)]);
    write(&dir.path().join("test.bin"), &[record(&[1, 2], 0)]);
    let e = open(&cfg(DatasetKind::Cifar100, dir.path()), 32, 100, 0).unwrap_err();
    assert!(matches!(e, DataError::LabelOutOfRange { label: 100, offset: 3075, .. }), "{e}");
}

#[test]
fn unreadable_path_is_an_error() {
    let dir = tmp();
    // A directory where a file is expected: is_file() is false, so it is reported as missing.
    fs::create_dir(dir.path().join("test_batch.bin")).unwrap();
    write(&dir.path().join("data_batch_1.bin"), &[record(&[1], 0)]);
    let e = open(&cfg(DatasetKind::Cifar10, dir.path()), 32, 10, 0).unwrap_err();
    assert!(e.to_string().contains("test_batch.bin"), "{e}");
}

#[test]
fn skip_bad_drops_bad_records_and_counts_them() {
    let dir = tmp();
    let mut recs = vec![record(&[1], 0), record(&[12], 1), record(&[2], 2), record(&[3], 3)];
    recs[3].truncate(100);
    write(&dir.path().join("data_batch_1.bin"), &recs);
    write(&dir.path().join("test_batch.bin"), &[record(&[2], 1)]);
    let mut c = cfg(DatasetKind::Cifar10, dir.path());
    assert!(open(&c, 32, 10, 0).is_err());
    c.skip_bad = true;
    let d = open(&c, 32, 10, 0).unwrap();
    assert_eq!(d.train.labels, vec![1, 2]);
    assert_eq!(d.train.image(1)[0], pixel(2, 0, 0, 0));
    assert_eq!(d.train.skipped.load(std::sync::atomic::Ordering::Relaxed), 2);
    assert!(d.description.contains("2 bad record(s) skipped"), "{}", d.description);
}
