//! CIFAR-10 and CIFAR-100 in their binary distribution form (`cifar-10-batches-bin`,
//! `cifar-100-binary`).
//!
//! CIFAR-10: `data_batch_{1..5}.bin` (train; whichever exist) and `test_batch.bin` (val), each a
//! sequence of 3073-byte records: 1 label byte, then 3072 bytes of 32×32 R, G, B planes (CHW).
//! CIFAR-100: `train.bin` and `test.bin`, 3074-byte records: coarse label byte, fine label byte,
//! then the planes; we train on the fine label (100 classes).
//!
//! Pixels are converted to HWC once at load so every batch reads each image as one contiguous
//! run. Bad files are errors naming the file and the byte offset of the offending record.

use std::fs;
use std::path::{Path, PathBuf};

use super::{DataError, ImageSet};

pub const SIDE: usize = 32;
const PIXELS: usize = SIDE * SIDE * 3;

/// Which CIFAR and its binary layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Cifar10,
    Cifar100,
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::Cifar10 => "cifar10",
            Variant::Cifar100 => "cifar100",
        }
    }
    pub fn num_classes(self) -> usize {
        match self {
            Variant::Cifar10 => 10,
            Variant::Cifar100 => 100,
        }
    }
    /// Label bytes before the pixels of each record.
    fn label_bytes(self) -> usize {
        match self {
            Variant::Cifar10 => 1,
            Variant::Cifar100 => 2,
        }
    }
    pub fn record_len(self) -> usize {
        self.label_bytes() + PIXELS
    }
    /// The folder name inside the official archive, also accepted one level below `data.path`.
    fn archive_dir(self) -> &'static str {
        match self {
            Variant::Cifar10 => "cifar-10-batches-bin",
            Variant::Cifar100 => "cifar-100-binary",
        }
    }
    fn train_files(self) -> Vec<String> {
        match self {
            Variant::Cifar10 => (1..=5).map(|i| format!("data_batch_{i}.bin")).collect(),
            Variant::Cifar100 => vec!["train.bin".to_string()],
        }
    }
    fn test_file(self) -> &'static str {
        match self {
            Variant::Cifar10 => "test_batch.bin",
            Variant::Cifar100 => "test.bin",
        }
    }
}

/// A loaded CIFAR: both splits and the files they came from.
pub struct Loaded {
    pub train: ImageSet,
    pub val: ImageSet,
    pub dir: PathBuf,
    pub train_files: Vec<PathBuf>,
    pub val_file: PathBuf,
}

/// `data.path` itself when it holds the test file, else its archive-named subfolder when that
/// does (users point at either the folder they extracted into or the folder inside it).
fn resolve_dir(path: &Path, v: Variant) -> PathBuf {
    let sub = path.join(v.archive_dir());
    if !path.join(v.test_file()).is_file() && sub.join(v.test_file()).is_file() {
        sub
    } else {
        path.to_path_buf()
    }
}

/// Loads both splits from the binary form under `path`.
pub fn load(path: &Path, v: Variant) -> Result<Loaded, DataError> {
    let dir = resolve_dir(path, v);
    let train_files: Vec<PathBuf> = v.train_files().iter().map(|f| dir.join(f)).filter(|p| p.is_file()).collect();
    if train_files.is_empty() {
        return Err(DataError::NotFound {
            dataset: v.name(),
            split: "train",
            dir: dir.clone(),
            expected: v.train_files().join(", "),
        });
    }
    let val_file = dir.join(v.test_file());
    if !val_file.is_file() {
        return Err(DataError::NotFound { dataset: v.name(), split: "val", dir, expected: v.test_file().to_string() });
    }
    let mut train = empty(v);
    for f in &train_files {
        read_file(f, v, &mut train)?;
    }
    let mut val = empty(v);
    read_file(&val_file, v, &mut val)?;
    Ok(Loaded { train, val, dir, train_files, val_file })
}

fn empty(v: Variant) -> ImageSet {
    ImageSet { images: Vec::new(), labels: Vec::new(), side: SIDE, num_classes: v.num_classes() }
}

/// Appends every record of one binary file to `set`.
pub fn read_file(path: &Path, v: Variant, set: &mut ImageSet) -> Result<(), DataError> {
    let bytes = fs::read(path).map_err(|source| DataError::Io { path: path.to_path_buf(), source })?;
    parse_records(&bytes, path, v, set)
}

/// Parses records from `bytes` (the content of `path`, named in errors).
pub fn parse_records(bytes: &[u8], path: &Path, v: Variant, set: &mut ImageSet) -> Result<(), DataError> {
    let rec = v.record_len();
    let whole = bytes.len() / rec;
    if bytes.len() % rec != 0 {
        return Err(DataError::Truncated {
            path: path.to_path_buf(),
            offset: (whole * rec) as u64,
            file_len: bytes.len() as u64,
            record_len: rec,
        });
    }
    set.images.reserve(whole * PIXELS);
    set.labels.reserve(whole);
    // The label we train on is the last label byte (CIFAR-10's only one, CIFAR-100's fine one).
    let label_at = v.label_bytes() - 1;
    for (k, r) in bytes.chunks_exact(rec).enumerate() {
        let label = r[label_at] as usize;
        if label >= v.num_classes() {
            return Err(DataError::LabelOutOfRange {
                path: path.to_path_buf(),
                offset: (k * rec + label_at) as u64,
                label,
                num_classes: v.num_classes(),
            });
        }
        set.labels.push(label as u16);
        push_chw_as_hwc(&r[v.label_bytes()..], SIDE, &mut set.images);
    }
    Ok(())
}

/// Appends a (3, S, S) planar image as (S, S, 3) interleaved.
pub fn push_chw_as_hwc(chw: &[u8], side: usize, out: &mut Vec<u8>) {
    let plane = side * side;
    let (r, rest) = chw.split_at(plane);
    let (g, b) = rest.split_at(plane);
    out.extend((0..plane).flat_map(|p| [r[p], g[p], b[p]]));
}
