//! Image folders (`data.dataset=folder`), torchvision `ImageFolder` style: one subfolder per
//! class, class index = position in the sorted list of subfolder names, images found
//! recursively below each (`.jpg`, `.jpeg`, `.png`, `.webp`, any case).
//!
//! Layout: `path/train/<class>/…` with `path/val/<class>/…` when both exist; otherwise the
//! classes directly under `path` (or under `path/train`) are split per class, seeded, holding
//! out `data.val_split` of each class for validation.
//!
//! Only the file list is built at open; images are decoded per batch (a dataset like ImageNet
//! does not fit in memory decoded), so unreadable files surface in batches (see
//! `data.skip_bad`).

use std::fs;
use std::path::{Path, PathBuf};

use super::rng::{hash, stream, SplitMix};
use super::{DataError, ImageSet};

const EXTENSIONS: [&str; 4] = ["jpg", "jpeg", "png", "webp"];

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io { path: path.to_path_buf(), source }
}

/// Subfolders of `dir`, sorted by name (byte order, like Python's `sorted`).
fn class_dirs(dir: &Path) -> Result<Vec<(String, PathBuf)>, DataError> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).map_err(io_err(dir))? {
        let e = e.map_err(io_err(dir))?;
        let p = e.path();
        if p.is_dir() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with('.') {
                out.push((name, p));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn is_image(p: &Path) -> bool {
    p.extension().and_then(|e| e.to_str()).is_some_and(|e| EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x)))
}

/// Image files below `dir`, recursively, in sorted order.
fn images_below(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), DataError> {
    let mut entries: Vec<PathBuf> = fs::read_dir(dir).map_err(io_err(dir))?.map(|e| e.map(|e| e.path())).collect::<Result<_, _>>().map_err(io_err(dir))?;
    entries.sort();
    for p in entries {
        if p.is_dir() {
            images_below(&p, out)?;
        } else if is_image(&p) {
            out.push(p);
        }
    }
    Ok(())
}

/// (class names, per-class file lists) of the folder of `split` ("train" or "val").
fn scan(dir: &Path, split: &'static str) -> Result<(Vec<String>, Vec<Vec<PathBuf>>), DataError> {
    let classes = class_dirs(dir)?;
    if classes.is_empty() {
        return Err(DataError::NotFound { dataset: "folder", split, dir: dir.to_path_buf(), expected: "one subfolder per class".into() });
    }
    if classes.len() > u16::MAX as usize + 1 {
        return Err(DataError::Invalid { key: "data.path", msg: format!("{} has {} class folders; at most 65536 are supported", dir.display(), classes.len()) });
    }
    let mut files = Vec::with_capacity(classes.len());
    for (_, p) in &classes {
        let mut f = Vec::new();
        images_below(p, &mut f)?;
        if f.is_empty() {
            return Err(DataError::NotFound { dataset: "folder", split, dir: p.clone(), expected: "at least one .jpg/.jpeg/.png/.webp image".into() });
        }
        files.push(f);
    }
    Ok((classes.into_iter().map(|(n, _)| n).collect(), files))
}

/// Both splits of a folder dataset, as file-backed image sets producing `side`-px batches.
pub struct Loaded {
    pub train: ImageSet,
    pub val: ImageSet,
    pub classes: Vec<String>,
    /// How the split was made, for the description.
    pub layout: String,
}

fn file_set(per_class: Vec<Vec<PathBuf>>, num_classes: usize, side: usize) -> ImageSet {
    let mut files = Vec::new();
    let mut labels = Vec::new();
    for (c, fs) in per_class.into_iter().enumerate() {
        labels.extend(std::iter::repeat_n(c as u16, fs.len()));
        files.extend(fs);
    }
    ImageSet::from_files(files, labels, side, num_classes)
}

/// Where the training classes live: `path/train` when it exists, else `path`.
fn train_root(path: &Path) -> PathBuf {
    let t = path.join("train");
    if t.is_dir() {
        t
    } else {
        path.to_path_buf()
    }
}

/// Lists the folder dataset under `path` (batches of `side` px).
pub fn load(path: &Path, side: usize, val_split: f64, seed: u64) -> Result<Loaded, DataError> {
    if !path.is_dir() {
        return Err(DataError::Io { path: path.to_path_buf(), source: std::io::ErrorKind::NotFound.into() });
    }
    let root = train_root(path);
    let (classes, train_files) = scan(&root, "train")?;
    let k = classes.len();
    let val_dir = path.join("val");
    if root != path && val_dir.is_dir() {
        let (vclasses, vfiles) = scan(&val_dir, "val")?;
        // Val labels must mean what train labels mean: map by name, refuse unknown classes.
        let mut per_class = vec![Vec::new(); k];
        for (name, files) in vclasses.iter().zip(vfiles) {
            match classes.binary_search(name) {
                Ok(c) => per_class[c] = files,
                Err(_) => {
                    return Err(DataError::Invalid {
                        key: "data.path",
                        msg: format!("{} is a class folder with no counterpart in {}", val_dir.join(name).display(), root.display()),
                    })
                }
            }
        }
        let layout = format!("{}/{{train,val}}", path.display());
        return Ok(Loaded { train: file_set(train_files, k, side), val: file_set(per_class, k, side), classes, layout });
    }
    if !(0.0..1.0).contains(&val_split) {
        return Err(DataError::Invalid { key: "data.val_split", msg: format!("must be in [0, 1), got {val_split}") });
    }
    // Seeded per-class split: the same files go to val whatever the thread count or run.
    let mut train = Vec::with_capacity(k);
    let mut val = Vec::with_capacity(k);
    for (c, mut files) in train_files.into_iter().enumerate() {
        let mut rng = SplitMix::new(hash(&[seed, stream::SPLIT, c as u64]));
        for i in (1..files.len()).rev() {
            files.swap(i, rng.below_usize(i + 1));
        }
        let n_val = (files.len() as f64 * val_split).round() as usize;
        let rest = files.split_off(n_val);
        let (mut v, mut t) = (files, rest);
        // Keep each split in file order so batches read directories sequentially.
        v.sort();
        t.sort();
        val.push(v);
        train.push(t);
    }
    let layout = format!("{} split {:.0}/{:.0} by seed {seed}", root.display(), (1.0 - val_split) * 100.0, val_split * 100.0);
    Ok(Loaded { train: file_set(train, k, side), val: file_set(val, k, side), classes, layout })
}

/// Class names of a folder dataset (sorted subfolder names of `path/train`, or of `path`), read
/// before the model is built so `model.num_classes` can default to their count.
pub fn class_names(path: &Path) -> Result<Vec<String>, DataError> {
    Ok(class_dirs(&train_root(path))?.into_iter().map(|(name, _)| name).collect())
}

/// Training images a folder dataset will have, listing files only (for planning steps without
/// opening the dataset, `data::train_len`).
pub fn count_train(path: &Path, val_split: f64, seed: u64) -> Result<usize, DataError> {
    Ok(load(path, 1, val_split, seed)?.train.len())
}
