//! CIFAR-10 and CIFAR-100 in every form they are distributed in, read into identical image sets:
//!
//! - **binary** (`cifar-10-batches-bin`, `cifar-100-binary`): CIFAR-10 `data_batch_{1..5}.bin`
//!   (train; whichever exist) and `test_batch.bin`, each a sequence of 3073-byte records: 1 label
//!   byte, then 3072 bytes of 32×32 R, G, B planes (CHW). CIFAR-100 `train.bin` / `test.bin`,
//!   3074-byte records: coarse label byte, fine label byte, then the planes.
//! - **python** (`cifar-10-batches-py`, `cifar-100-python`): pickled dicts, CIFAR-10
//!   `data_batch_{1..5}` / `test_batch` with `data` (N × 3072 uint8 NumPy array, same CHW
//!   planes) and `labels`; CIFAR-100 `train` / `test` with `fine_labels` and `coarse_labels`.
//! - **archives**: the official `.tar.gz` of either form, read in place (no extraction).
//!
//! `data.path` may name the extracted folder, the folder above it, or the archive; the form is
//! detected from what is there (binary first, as it is the fastest to read). `data.label`
//! chooses CIFAR-100's fine (100) or coarse (20) label.
//!
//! Pixels are converted to HWC once at load so every batch reads each image as one contiguous
//! run. Bad files are errors naming the file (archive members as `archive.tar.gz/member`) and the
//! byte offset of the offending record.

use std::collections::HashMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

use super::pickle;
use super::{DataError, ImageSet};
use crate::config::LabelKind;

pub const SIDE: usize = 32;
const PIXELS: usize = SIDE * SIDE * 3;

/// Which CIFAR.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Variant {
    Cifar10,
    Cifar100,
}

/// How the files are encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    Binary,
    Python,
}

impl Form {
    pub fn name(self) -> &'static str {
        match self {
            Form::Binary => "binary",
            Form::Python => "python",
        }
    }
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Variant::Cifar10 => "cifar10",
            Variant::Cifar100 => "cifar100",
        }
    }
    pub fn num_classes(self, label: LabelKind) -> usize {
        match (self, label) {
            (Variant::Cifar10, _) => 10,
            (Variant::Cifar100, LabelKind::Fine) => 100,
            (Variant::Cifar100, LabelKind::Coarse) => 20,
        }
    }
    /// Label bytes before the pixels of each binary record.
    fn label_bytes(self) -> usize {
        match self {
            Variant::Cifar10 => 1,
            Variant::Cifar100 => 2,
        }
    }
    pub fn record_len(self) -> usize {
        self.label_bytes() + PIXELS
    }
    /// The folder name inside the official archive of `form`.
    fn folder(self, form: Form) -> &'static str {
        match (self, form) {
            (Variant::Cifar10, Form::Binary) => "cifar-10-batches-bin",
            (Variant::Cifar10, Form::Python) => "cifar-10-batches-py",
            (Variant::Cifar100, Form::Binary) => "cifar-100-binary",
            (Variant::Cifar100, Form::Python) => "cifar-100-python",
        }
    }
    /// The official archive file names, looked for inside `data.path`.
    fn archives(self) -> [&'static str; 2] {
        match self {
            Variant::Cifar10 => ["cifar-10-binary.tar.gz", "cifar-10-python.tar.gz"],
            Variant::Cifar100 => ["cifar-100-binary.tar.gz", "cifar-100-python.tar.gz"],
        }
    }
    fn train_files(self, form: Form) -> Vec<String> {
        let ext = if form == Form::Binary { ".bin" } else { "" };
        match self {
            Variant::Cifar10 => (1..=5).map(|i| format!("data_batch_{i}{ext}")).collect(),
            Variant::Cifar100 => vec![format!("train{ext}")],
        }
    }
    fn test_file(self, form: Form) -> String {
        let ext = if form == Form::Binary { ".bin" } else { "" };
        match self {
            Variant::Cifar10 => format!("test_batch{ext}"),
            Variant::Cifar100 => format!("test{ext}"),
        }
    }
}

/// A loaded CIFAR: both splits and where they came from.
pub struct Loaded {
    pub train: ImageSet,
    pub val: ImageSet,
    pub form: Form,
    /// The folder or archive read.
    pub source: PathBuf,
    pub train_files: Vec<PathBuf>,
    pub val_file: PathBuf,
    /// Official training files of this form that are not there (a partial copy).
    pub missing_train_files: Vec<String>,
}

/// Where the batch files are read from.
enum Source {
    Dir(PathBuf),
    /// An archive held in memory: member base name → (member path, bytes). Only members whose
    /// base name is a CIFAR batch file are kept.
    Archive { path: PathBuf, members: HashMap<String, (String, Vec<u8>)> },
}

impl Source {
    fn has(&self, name: &str) -> bool {
        match self {
            Source::Dir(d) => d.join(name).is_file(),
            Source::Archive { members, .. } => members.contains_key(name),
        }
    }
    /// The path errors name for `name`.
    fn display(&self, name: &str) -> PathBuf {
        match self {
            Source::Dir(d) => d.join(name),
            Source::Archive { path, members } => match members.get(name) {
                Some((member, _)) => path.join(member),
                None => path.join(name),
            },
        }
    }
    fn read(&mut self, name: &str) -> Result<Vec<u8>, DataError> {
        match self {
            Source::Dir(d) => {
                let p = d.join(name);
                fs::read(&p).map_err(|source| DataError::Io { path: p, source })
            }
            // Each member is read once: take it out of the map rather than copy 30 MB.
            Source::Archive { path, members } => match members.get_mut(name) {
                Some((_, bytes)) => Ok(std::mem::take(bytes)),
                None => Err(DataError::Io { path: path.join(name), source: std::io::ErrorKind::NotFound.into() }),
            },
        }
    }
    fn path(&self) -> &Path {
        match self {
            Source::Dir(d) => d,
            Source::Archive { path, .. } => path,
        }
    }
}

fn is_archive(p: &Path) -> bool {
    let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    n.ends_with(".tar.gz") || n.ends_with(".tgz") || n.ends_with(".tar")
}

/// Reads the CIFAR batch members of a `.tar`/`.tar.gz` archive into memory.
fn read_archive(path: &Path, v: Variant) -> Result<Source, DataError> {
    let io = |source: std::io::Error| DataError::Io { path: path.to_path_buf(), source };
    let file = fs::File::open(path).map_err(io)?;
    let reader: Box<dyn Read> = if path.extension().is_some_and(|e| e == "tar") {
        Box::new(std::io::BufReader::new(file))
    } else {
        Box::new(flate2::read::GzDecoder::new(std::io::BufReader::new(file)))
    };
    let wanted: Vec<String> = [Form::Binary, Form::Python]
        .iter()
        .flat_map(|&f| v.train_files(f).into_iter().chain([v.test_file(f)]))
        .collect();
    let mut members = HashMap::new();
    let mut ar = tar::Archive::new(reader);
    for entry in ar.entries().map_err(io)? {
        let mut entry = entry.map_err(io)?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let member = entry.path().map_err(io)?.to_string_lossy().into_owned();
        let base = member.rsplit('/').next().unwrap_or(&member).to_string();
        if wanted.contains(&base) {
            // The header's size is untrusted: reserve at most what a CIFAR batch needs.
            let mut bytes = Vec::with_capacity((entry.size() as usize).min(200 << 20));
            entry.read_to_end(&mut bytes).map_err(|source| DataError::Io { path: path.join(&member), source })?;
            members.insert(base, (member, bytes));
        }
    }
    Ok(Source::Archive { path: path.to_path_buf(), members })
}

/// Finds the source and form under `path`: the folder itself, the official folder below it, or
/// an archive (given directly or found by its official name). Binary beats python beats archive.
fn locate(path: &Path, v: Variant) -> Result<(Source, Form), DataError> {
    let detect = |src: Source| -> Option<(Source, Form)> {
        [Form::Binary, Form::Python].into_iter().find(|&f| src.has(&v.test_file(f)) || v.train_files(f).iter().any(|t| src.has(t))).map(|f| (src, f))
    };
    if path.is_file() && is_archive(path) {
        let src = read_archive(path, v)?;
        return detect(src).ok_or_else(|| not_found(path, v, "train"));
    }
    if !path.is_dir() {
        return Err(DataError::Io { path: path.to_path_buf(), source: std::io::ErrorKind::NotFound.into() });
    }
    let mut dirs = vec![path.to_path_buf()];
    dirs.extend([Form::Binary, Form::Python].map(|f| path.join(v.folder(f))));
    for d in dirs {
        if let Some(found) = detect(Source::Dir(d)) {
            return Ok(found);
        }
    }
    for a in v.archives() {
        let p = path.join(a);
        if p.is_file() {
            let src = read_archive(&p, v)?;
            return detect(src).ok_or_else(|| not_found(&p, v, "train"));
        }
    }
    Err(not_found(path, v, "train"))
}

fn not_found(dir: &Path, v: Variant, split: &'static str) -> DataError {
    let expected = match split {
        "train" => format!(
            "{} (binary), {} (python), a {} folder, or {}",
            v.train_files(Form::Binary).join(", "),
            v.train_files(Form::Python).join(", "),
            v.folder(Form::Binary),
            v.archives().join(" / ")
        ),
        _ => format!("{} or {}", v.test_file(Form::Binary), v.test_file(Form::Python)),
    };
    DataError::NotFound { dataset: v.name(), split, dir: dir.to_path_buf(), expected }
}

/// Training records under `path` without reading pixels: binary file sizes ÷ record size; the
/// python and archive forms are assumed complete (50 000).
pub fn count_train(path: &Path, v: Variant) -> Result<usize, DataError> {
    if path.is_dir() {
        for d in [path.to_path_buf(), path.join(v.folder(Form::Binary))] {
            let files: Vec<PathBuf> = v.train_files(Form::Binary).iter().map(|f| d.join(f)).filter(|p| p.is_file()).collect();
            if !files.is_empty() {
                let mut n = 0;
                for f in files {
                    let len = fs::metadata(&f).map_err(|source| DataError::Io { path: f.clone(), source })?.len();
                    n += len as usize / v.record_len();
                }
                return Ok(n);
            }
        }
    }
    Ok(50_000)
}

/// Loads both splits from whatever form is under `path`.
/// With `skip_bad`, a truncated final record or a record with an out-of-range label is dropped
/// and counted in the set's `skipped` instead of failing the load.
pub fn load(path: &Path, v: Variant, label: LabelKind, skip_bad: bool) -> Result<Loaded, DataError> {
    if v == Variant::Cifar10 && label == LabelKind::Coarse {
        return Err(DataError::Invalid { key: "data.label", msg: "coarse labels exist only in cifar100".into() });
    }
    let (mut src, form) = locate(path, v)?;
    let train_names: Vec<String> = v.train_files(form).into_iter().filter(|f| src.has(f)).collect();
    if train_names.is_empty() {
        return Err(not_found(src.path(), v, "train"));
    }
    let test_name = v.test_file(form);
    if !src.has(&test_name) {
        return Err(not_found(src.path(), v, "val"));
    }
    let missing_train_files: Vec<String> = v.train_files(form).into_iter().filter(|f| !src.has(f)).collect();
    // An empty file is a broken copy (an interrupted download), never zero records to skip.
    let nonempty = |bytes: Vec<u8>, path: PathBuf, set: &ImageSet| -> Result<Option<Vec<u8>>, DataError> {
        match (bytes.is_empty(), skip_bad) {
            (false, _) => Ok(Some(bytes)),
            (true, true) => {
                set.skipped.fetch_add(1, Ordering::Relaxed);
                Ok(None)
            }
            (true, false) => Err(DataError::Format { path, msg: "is empty (0 bytes): a broken copy? (data.skip_bad=true skips it)".into() }),
        }
    };
    let mut train = empty(v, label);
    for name in &train_names {
        let bytes = src.read(name)?;
        if let Some(bytes) = nonempty(bytes, src.display(name), &train)? {
            parse(&bytes, &src.display(name), v, form, label, skip_bad, &mut train)?;
        }
    }
    let mut val = empty(v, label);
    let bytes = src.read(&test_name)?;
    if let Some(bytes) = nonempty(bytes, src.display(&test_name), &val)? {
        parse(&bytes, &src.display(&test_name), v, form, label, skip_bad, &mut val)?;
    }
    Ok(Loaded {
        train,
        val,
        form,
        source: src.path().to_path_buf(),
        train_files: train_names.iter().map(|n| src.display(n)).collect(),
        val_file: src.display(&test_name),
        missing_train_files,
    })
}

fn empty(v: Variant, label: LabelKind) -> ImageSet {
    ImageSet::in_memory(Vec::new(), Vec::new(), SIDE, v.num_classes(label))
}

fn parse(bytes: &[u8], path: &Path, v: Variant, form: Form, label: LabelKind, skip_bad: bool, set: &mut ImageSet) -> Result<(), DataError> {
    match form {
        Form::Binary => parse_records(bytes, path, v, label, skip_bad, set),
        Form::Python => parse_pickle(bytes, path, v, label, skip_bad, set),
    }
}

/// Appends every record of one binary file to `set`.
pub fn read_file(path: &Path, v: Variant, label: LabelKind, skip_bad: bool, set: &mut ImageSet) -> Result<(), DataError> {
    let bytes = fs::read(path).map_err(|source| DataError::Io { path: path.to_path_buf(), source })?;
    parse_records(&bytes, path, v, label, skip_bad, set)
}

/// Parses binary records from `bytes` (the content of `path`, named in errors).
pub fn parse_records(bytes: &[u8], path: &Path, v: Variant, label: LabelKind, skip_bad: bool, set: &mut ImageSet) -> Result<(), DataError> {
    let rec = v.record_len();
    let whole = bytes.len() / rec;
    if !bytes.len().is_multiple_of(rec) && skip_bad {
        set.skipped.fetch_add(1, Ordering::Relaxed);
    } else if !bytes.len().is_multiple_of(rec) {
        return Err(DataError::Truncated {
            path: path.to_path_buf(),
            offset: (whole * rec) as u64,
            file_len: bytes.len() as u64,
            record_len: rec,
        });
    }
    set.images.reserve(whole * PIXELS);
    set.labels.reserve(whole);
    // CIFAR-10's only label byte, or CIFAR-100's coarse (first) / fine (second) byte.
    let label_at = match label {
        LabelKind::Coarse => 0,
        LabelKind::Fine => v.label_bytes() - 1,
    };
    let classes = v.num_classes(label);
    for (k, r) in bytes.chunks_exact(rec).enumerate() {
        let l = r[label_at] as usize;
        if l >= classes && skip_bad {
            set.skipped.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        if l >= classes {
            return Err(DataError::LabelOutOfRange { path: path.to_path_buf(), offset: (k * rec + label_at) as u64, label: l, num_classes: classes });
        }
        set.labels.push(l as u16);
        push_chw_as_hwc(&r[v.label_bytes()..], SIDE, &mut set.images);
    }
    Ok(())
}

/// Parses one pickled batch (a dict with `data` and the label list) and appends it to `set`.
pub fn parse_pickle(bytes: &[u8], path: &Path, v: Variant, label: LabelKind, skip_bad: bool, set: &mut ImageSet) -> Result<(), DataError> {
    let bad = |msg: String| DataError::Format { path: path.to_path_buf(), msg };
    let root = pickle::loads(bytes).map_err(|e| DataError::Format { path: path.to_path_buf(), msg: e.to_string() })?;
    let key = match (v, label) {
        (Variant::Cifar10, _) => "labels",
        (Variant::Cifar100, LabelKind::Fine) => "fine_labels",
        (Variant::Cifar100, LabelKind::Coarse) => "coarse_labels",
    };
    let data = root.get("data").ok_or_else(|| bad(format!("no 'data' entry in the pickled {}", root.kind())))?;
    let arr = pickle::ndarray_u8(data).map_err(|m| bad(format!("'data': {m}")))?;
    if arr.shape.len() != 2 || arr.shape[1] != PIXELS {
        return Err(bad(format!("'data' has shape {:?}, expected (N, {PIXELS})", arr.shape)));
    }
    let labels = match root.get(key) {
        Some(pickle::Value::List(l)) => l,
        Some(other) => return Err(bad(format!("'{key}' is a {}, expected a list", other.kind()))),
        None => return Err(bad(format!("no '{key}' entry"))),
    };
    if labels.len() != arr.shape[0] {
        return Err(bad(format!("{} labels for {} images", labels.len(), arr.shape[0])));
    }
    let classes = v.num_classes(label);
    set.images.reserve(arr.data.len());
    for (k, (l, img)) in labels.iter().zip(arr.data.chunks_exact(PIXELS)).enumerate() {
        match l.as_int() {
            Some(i) if (0..classes as i64).contains(&i) => set.labels.push(i as u16),
            _ if skip_bad => {
                set.skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            // No byte offset survives unpickling: name the entry instead.
            _ => return Err(bad(format!("'{key}'[{k}] = {l:?} is not a class index below {classes}"))),
        }
        push_chw_as_hwc(img, SIDE, &mut set.images);
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
