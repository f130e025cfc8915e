//! Tar shards (`data.dataset=shards`): an image folder packed into `.tar` files in the
//! WebDataset layout timm and open_clip read — for every image a `KEY.jpg` (or `.png`,
//! `.webp`) member holding the original file's bytes, followed by a `KEY.cls` member holding
//! its class index as decimal text — plus an `index.json` beside them with the class names and,
//! for every shard, its size and the byte offset and label of each image.
//!
//! [`pack`] writes them (`vitscale data pack`) from a folder in the layout
//! `data.dataset=folder` reads, in that dataset's order: image `i` of a split is image `i` of
//! the folder dataset (for a folder without `val/`, the seeded split is made at packing time).
//! [`load`] reads the index; batches then read each image by offset, its two members in one
//! read, and check them (names, pairing, the label against the index). Random access keeps
//! the folder dataset's semantics exactly — the same seeded permutation per epoch, split over
//! ranks and micro-batches by the same sampler, the same augmentation — so a shards dataset
//! yields the folder dataset's batches bit for bit, and ranks read only the images they use.
//! Thousands of small files become a few large ones (what network file systems and object
//! stores need); a shard read is a seek plus one contiguous read.

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{folder, DataError, ImageSet};

/// The index file's name inside a shards directory.
pub const INDEX: &str = "index.json";
const FORMAT: &str = "vitscale-shards";
const VERSION: u64 = 1;
const BLOCK: u64 = 512;
/// Extensions of image members (stored as found, `.jpeg` as `.jpg`).
const IMAGE_EXTENSIONS: [&str; 3] = ["jpg", "png", "webp"];

/// Where one image lies: shard file `shard`, its image member's header at byte `offset`, and
/// `len` bytes from there through the end of its `.cls` member's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    pub shard: u32,
    pub offset: u64,
    pub len: u32,
}

/// The shard files of one split and where each of its images lies (image `i` = `members[i]`).
#[derive(Debug, PartialEq)]
pub struct ShardSet {
    pub files: Vec<PathBuf>,
    pub members: Vec<Member>,
}

// ---- index.json ----

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct IndexFile {
    format: String,
    version: u64,
    classes: Vec<String>,
    train: SplitIndex,
    val: SplitIndex,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SplitIndex {
    images: usize,
    class_counts: Vec<usize>,
    shards: Vec<ShardEntry>,
}

/// One shard: its file name (in the index's directory), size, and per image the offset of
/// its image member's header, the bytes through its `.cls` data, and its label.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShardEntry {
    file: String,
    bytes: u64,
    images: usize,
    offsets: Vec<u64>,
    lens: Vec<u32>,
    labels: Vec<u16>,
}

fn format_err(path: &Path, msg: impl Into<String>) -> DataError {
    DataError::Format { path: path.to_path_buf(), msg: msg.into() }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io { path: path.to_path_buf(), source }
}

fn member_err(path: &Path, offset: u64, member: &str, msg: impl Into<String>) -> DataError {
    DataError::Member { path: path.to_path_buf(), offset, member: member.to_string(), msg: msg.into() }
}

fn pad(n: u64) -> u64 {
    n.div_ceil(BLOCK) * BLOCK
}

/// Both splits of a shards directory.
pub struct Loaded {
    pub train: ImageSet,
    pub val: ImageSet,
    pub classes: Vec<String>,
    pub shard_counts: [usize; 2],
}

fn read_index(dir: &Path) -> Result<IndexFile, DataError> {
    let path = dir.join(INDEX);
    if !dir.is_dir() {
        return Err(DataError::Io { path: dir.to_path_buf(), source: std::io::ErrorKind::NotFound.into() });
    }
    let text = match fs::read_to_string(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format_err(&path, "missing: a shards directory holds the index.json `vitscale data pack` writes last (an interrupted pack leaves none)"))
        }
        r => r.map_err(io_err(&path))?,
    };
    let index: IndexFile = serde_json::from_str(&text).map_err(|e| format_err(&path, format!("not a shards index: {e}")))?;
    if index.format != FORMAT || index.version != VERSION {
        return Err(format_err(&path, format!("format \"{}\" version {}; this vitscale reads \"{FORMAT}\" version {VERSION}", index.format, index.version)));
    }
    if index.classes.is_empty() || index.classes.len() > u16::MAX as usize + 1 {
        return Err(format_err(&path, format!("{} classes; expected 1 to 65536", index.classes.len())));
    }
    Ok(index)
}

/// Class names of the shards directory `dir` (from its index), for defaulting
/// `model.num_classes`.
pub fn class_names(dir: &Path) -> Result<Vec<String>, DataError> {
    Ok(read_index(dir)?.classes)
}

/// Training images of the shards directory `dir` (from its index).
pub fn count_train(dir: &Path) -> Result<usize, DataError> {
    Ok(read_index(dir)?.train.images)
}

/// Checks one split of the index against itself and the shard files on disk (their sizes;
/// members are checked as they are read) and makes its image set.
fn split_set(dir: &Path, name: &str, split: SplitIndex, num_classes: usize, side: usize) -> Result<ImageSet, DataError> {
    let index = dir.join(INDEX);
    let mut files = Vec::with_capacity(split.shards.len());
    let mut members = Vec::with_capacity(split.images);
    let mut labels = Vec::with_capacity(split.images);
    for (s, e) in split.shards.into_iter().enumerate() {
        let at = format!("{name} shard {} ({})", s, e.file);
        // a plain file name: the index cannot point outside its directory
        if e.file.is_empty() || e.file.contains(['/', '\\']) || e.file.starts_with('.') {
            return Err(format_err(&index, format!("{at}: not a plain file name")));
        }
        if e.offsets.len() != e.images || e.lens.len() != e.images || e.labels.len() != e.images {
            return Err(format_err(&index, format!("{at}: {} images but {} offsets, {} lengths, {} labels", e.images, e.offsets.len(), e.lens.len(), e.labels.len())));
        }
        let path = dir.join(&e.file);
        let bytes = fs::metadata(&path).map_err(io_err(&path))?.len();
        if bytes != e.bytes {
            return Err(format_err(&path, format!("is {bytes} bytes but {INDEX} says {}: truncated or replaced since it was packed", e.bytes)));
        }
        for k in 0..e.images {
            let (offset, len, label) = (e.offsets[k], e.lens[k], e.labels[k]);
            // two headers and at least the class digit
            if offset % BLOCK != 0 || offset + len as u64 > bytes || (len as u64) <= 2 * BLOCK {
                return Err(format_err(&index, format!("{at}: image {k} at byte offset {offset} ({len} bytes) does not fit a {bytes}-byte tar")));
            }
            if label as usize >= num_classes {
                return Err(format_err(&index, format!("{at}: image {k} has label {label}, but there are {num_classes} classes")));
            }
            members.push(Member { shard: s as u32, offset, len });
            labels.push(label);
        }
        files.push(path);
    }
    if members.len() != split.images {
        return Err(format_err(&index, format!("the {name} split lists {} images but its shards hold {}", split.images, members.len())));
    }
    let mut set = ImageSet::from_files(Vec::new(), labels, side, num_classes);
    if split.class_counts != set.class_counts() {
        return Err(format_err(&index, format!("the {name} split's class_counts do not match its labels")));
    }
    set.shards = Some(Arc::new(ShardSet { files, members }));
    Ok(set)
}

/// Opens the shards directory `dir` (batches of `side` px).
pub fn load(dir: &Path, side: usize) -> Result<Loaded, DataError> {
    let index = read_index(dir)?;
    let k = index.classes.len();
    let shard_counts = [index.train.shards.len(), index.val.shards.len()];
    let train = split_set(dir, "train", index.train, k, side)?;
    let val = split_set(dir, "val", index.val, k, side)?;
    Ok(Loaded { train, val, classes: index.classes, shard_counts })
}

/// The tar checksum of a header block: its bytes summed with the checksum field as spaces.
fn checksum(block: &[u8]) -> u32 {
    block.iter().enumerate().map(|(i, &b)| if (148..156).contains(&i) { b' ' as u32 } else { b as u32 }).sum()
}

/// The name and data size of the member whose header is `block` (at `offset` of `path`);
/// `what` names it in errors until its name is known.
fn parse_header(path: &Path, offset: u64, block: &[u8], what: &str) -> Result<(String, u64), DataError> {
    let h = tar::Header::from_byte_slice(block);
    let stored = h.cksum().map_err(|e| member_err(path, offset, what, format!("not a tar header: {e}")))?;
    if stored != checksum(block) {
        return Err(member_err(path, offset, what, "not a tar header (bad checksum): the index does not match this shard"));
    }
    let name = String::from_utf8_lossy(&h.path_bytes()).into_owned();
    if !h.entry_type().is_file() {
        return Err(member_err(path, offset, &name, "not a regular file member"));
    }
    let size = h.entry_size().map_err(|e| member_err(path, offset, &name, format!("bad size field: {e}")))?;
    Ok((name, size))
}

/// Reads image `i` of `set` into `buf`: checks its image member and the `.cls` member after it
/// (pairing, a decimal class index below `num_classes` equal to `label`, the index's length)
/// and returns where the image's bytes lie in `buf`, and its member name.
pub fn read_image(set: &ShardSet, i: usize, label: u16, num_classes: usize, buf: &mut Vec<u8>) -> Result<(std::ops::Range<usize>, String), DataError> {
    let m = set.members[i];
    let path = &set.files[m.shard as usize];
    buf.clear();
    buf.resize(m.len as usize, 0);
    let read = fs::File::open(path).and_then(|mut f| {
        f.seek(SeekFrom::Start(m.offset))?;
        f.read_exact(buf)
    });
    let what = format!("of image {i}");
    read.map_err(|e| member_err(path, m.offset, &what, format!("cannot read {} bytes: {e}", m.len)))?;
    let (name, size) = parse_header(path, m.offset, &buf[..BLOCK as usize], &what)?;
    let stem = name.rsplit_once('.').filter(|(s, e)| !s.is_empty() && IMAGE_EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x))).map(|(s, _)| s);
    let Some(stem) = stem else {
        return Err(member_err(path, m.offset, &name, "not an image member (.jpg, .png or .webp)"));
    };
    let cls_at = BLOCK + pad(size);
    if cls_at + BLOCK > m.len as u64 {
        return Err(member_err(path, m.offset, &name, format!("{size}-byte member does not fit the {} bytes the index gives it", m.len)));
    }
    let cls_offset = m.offset + cls_at;
    let (cls_name, cls_size) = parse_header(path, cls_offset, &buf[cls_at as usize..(cls_at + BLOCK) as usize], &format!("after {name}"))?;
    let want = format!("{stem}.cls");
    if cls_name != want {
        return Err(member_err(path, m.offset, &name, format!("has no {want} after it (the next member, at byte offset {cls_offset}, is {cls_name})")));
    }
    if cls_at + BLOCK + cls_size != m.len as u64 {
        return Err(member_err(path, cls_offset, &cls_name, format!("ends at byte {} of the sample but the index says {}", cls_at + BLOCK + cls_size, m.len)));
    }
    let text = &buf[(cls_at + BLOCK) as usize..];
    let parsed = std::str::from_utf8(text).ok().and_then(|t| t.trim().parse::<u64>().ok());
    let Some(class) = parsed else {
        return Err(member_err(path, cls_offset, &cls_name, format!("is not a class index (decimal text): {:?}", String::from_utf8_lossy(text))));
    };
    if class >= num_classes as u64 {
        return Err(member_err(path, cls_offset, &cls_name, format!("class {class} is out of range ({num_classes} classes)")));
    }
    if class != label as u64 {
        return Err(member_err(path, cls_offset, &cls_name, format!("class {class}, but {INDEX} says {label}")));
    }
    Ok((BLOCK as usize..(BLOCK + size) as usize, name))
}

// ---- packing ----

/// How `pack` cuts the shards: a shard is closed before it would pass `max_bytes` or hold
/// more than `max_images` (each when set); an image larger than `max_bytes` gets a shard of its own.
#[derive(Clone, Debug)]
pub struct PackOptions {
    pub max_bytes: Option<u64>,
    pub max_images: Option<usize>,
    /// For a folder without `train/` + `val/`: the fraction of each class held out for
    /// validation (`data.val_split`), split by `seed` (`train.seed`) as the folder dataset does.
    pub val_split: f64,
    pub seed: u64,
}

/// What `pack` wrote.
#[derive(Clone, Debug)]
pub struct PackReport {
    pub classes: usize,
    /// (images, shards) of train and val.
    pub train: (usize, usize),
    pub val: (usize, usize),
    pub bytes: u64,
    pub layout: String,
}

/// An open shard being written to a temporary file, renamed into place when finished.
struct Writer {
    builder: tar::Builder<std::io::BufWriter<fs::File>>,
    tmp: PathBuf,
    entry: ShardEntry,
    pos: u64,
}

/// Packs the image folder `src` (folder dataset layout) into shards in `out`, which must not
/// exist or be empty. Each shard and the index are written to a temporary file and renamed;
/// the index comes last, so a directory without one is an interrupted pack. On error the
/// files this call wrote are removed.
pub fn pack(src: &Path, out: &Path, opts: &PackOptions) -> Result<PackReport, DataError> {
    if opts.max_bytes == Some(0) || opts.max_images == Some(0) {
        return Err(DataError::Invalid { key: "--shard-size/--shard-images", msg: "must be positive".into() });
    }
    if out.exists() {
        let empty = out.is_dir() && fs::read_dir(out).map_err(io_err(out))?.next().is_none();
        if !empty {
            return Err(format_err(out, "already exists and is not an empty directory: refusing to overwrite it (choose a new output directory)"));
        }
    }
    let l = folder::load(src, 1, opts.val_split, opts.seed)?;
    fs::create_dir_all(out).map_err(io_err(out))?;
    let mut written: Vec<PathBuf> = Vec::new();
    let result = pack_into(&l, out, opts, &mut written);
    if result.is_err() {
        for p in &written {
            let _ = fs::remove_file(p);
        }
    }
    result
}

fn pack_into(l: &folder::Loaded, out: &Path, opts: &PackOptions, written: &mut Vec<PathBuf>) -> Result<PackReport, DataError> {
    let train = pack_split(out, "train", &l.train, opts, written)?;
    let val = pack_split(out, "val", &l.val, opts, written)?;
    let (train_n, val_n) = ((l.train.len(), train.shards.len()), (l.val.len(), val.shards.len()));
    let bytes = train.shards.iter().chain(&val.shards).map(|s| s.bytes).sum();
    let index = IndexFile { format: FORMAT.into(), version: VERSION, classes: l.classes.clone(), train, val };
    let path = out.join(INDEX);
    let tmp = out.join(format!(".{INDEX}.tmp"));
    written.push(tmp.clone());
    let text = serde_json::to_string(&index).map_err(|e| format_err(&path, e.to_string()))?;
    write_synced(&tmp, text.as_bytes())?;
    fs::rename(&tmp, &path).map_err(io_err(&path))?;
    written.push(path);
    Ok(PackReport { classes: l.classes.len(), train: train_n, val: val_n, bytes, layout: l.layout.clone() })
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let mut f = fs::File::create(path).map_err(io_err(path))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(io_err(path))
}

fn pack_split(out: &Path, split: &'static str, set: &ImageSet, opts: &PackOptions, written: &mut Vec<PathBuf>) -> Result<SplitIndex, DataError> {
    let mut shards = Vec::new();
    let mut cur: Option<Writer> = None;
    for (i, (file, &label)) in set.files.iter().zip(&set.labels).enumerate() {
        let bytes = fs::read(file).map_err(io_err(file))?;
        let ext = file.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).unwrap_or_default();
        let ext = if ext == "jpeg" { "jpg".to_string() } else { ext };
        // keys unique over the whole directory, free of dots (WebDataset splits at the first)
        let key = format!("{split}_{i:08}");
        let cls = label.to_string();
        let span = BLOCK + pad(bytes.len() as u64) + BLOCK + pad(cls.len() as u64);
        let full = cur.as_ref().is_some_and(|w| {
            opts.max_images.is_some_and(|n| w.entry.images >= n) || opts.max_bytes.is_some_and(|b| w.pos + span + 2 * BLOCK > b)
        });
        if full {
            shards.push(finish(cur.take().expect("checked above"), out, written)?);
        }
        let w = match &mut cur {
            Some(w) => w,
            None => {
                let name = format!("{split}-{:06}.tar", shards.len());
                let tmp = out.join(format!(".{name}.tmp"));
                written.push(tmp.clone());
                let f = fs::File::create(&tmp).map_err(io_err(&tmp))?;
                let entry = ShardEntry { file: name, bytes: 0, images: 0, offsets: Vec::new(), lens: Vec::new(), labels: Vec::new() };
                cur.insert(Writer { builder: tar::Builder::new(std::io::BufWriter::new(f)), tmp, entry, pos: 0 })
            }
        };
        let offset = w.pos;
        append(w, &format!("{key}.{ext}"), &bytes)?;
        append(w, &format!("{key}.cls"), cls.as_bytes())?;
        w.entry.offsets.push(offset);
        w.entry.lens.push((span - pad(cls.len() as u64) + cls.len() as u64).try_into().map_err(|_| format_err(file, "larger than 4 GiB: too large for a shard"))?);
        w.entry.labels.push(label);
        w.entry.images += 1;
    }
    if let Some(w) = cur {
        shards.push(finish(w, out, written)?);
    }
    Ok(SplitIndex { images: set.len(), class_counts: set.class_counts(), shards })
}

fn append(w: &mut Writer, name: &str, data: &[u8]) -> Result<(), DataError> {
    let mut h = tar::Header::new_ustar();
    h.set_path(name).map_err(|e| format_err(&w.tmp, format!("member name {name}: {e}")))?;
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    // fixed, so packing the same folder twice gives the same bytes
    h.set_mtime(0);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    w.builder.append(&h, data).map_err(io_err(&w.tmp))?;
    w.pos += BLOCK + pad(data.len() as u64);
    Ok(())
}

/// Ends the tar, checks its length is what the offsets assumed, syncs and renames it.
fn finish(w: Writer, out: &Path, written: &mut Vec<PathBuf>) -> Result<ShardEntry, DataError> {
    let Writer { builder, tmp, mut entry, pos } = w;
    let file = builder.into_inner().and_then(|b| b.into_inner().map_err(|e| e.into_error())).map_err(io_err(&tmp))?;
    file.sync_all().map_err(io_err(&tmp))?;
    let len = file.metadata().map_err(io_err(&tmp))?.len();
    // the tar ends with two zero blocks after the last member
    if len != pos + 2 * BLOCK {
        return Err(format_err(&tmp, format!("wrote {len} bytes where the member offsets assume {}", pos + 2 * BLOCK)));
    }
    entry.bytes = len;
    let path = out.join(&entry.file);
    fs::rename(&tmp, &path).map_err(io_err(&path))?;
    written.push(path);
    Ok(entry)
}

/// Parses a shard size: bytes, or a number with a unit — `k`/`KB`, `M`/`MB`, `G`/`GB`, `T`/`TB`
/// (powers of 1000) or `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024); case-insensitive, e.g.
/// `256MiB`, `1GB`, `1.5G`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num.parse().map_err(|_| format!("\"{s}\" is not a size: expected e.g. 512MiB, 1GB or a byte count"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "m" | "mb" => 1e6,
        "g" | "gb" => 1e9,
        "t" | "tb" => 1e12,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "tib" => 1024f64.powi(4),
        u => return Err(format!("\"{s}\": unknown unit \"{u}\"; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")),
    };
    let bytes = (x * mult).round();
    if !(1.0..u64::MAX as f64).contains(&bytes) {
        return Err(format!("\"{s}\": a shard size must be at least 1 byte"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("1.5g"), Ok(1_500_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size(" 2 KiB "), Ok(2048));
        for bad in ["", "MiB", "12XB", "0", "-5MB", "1e3"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn checksum_matches_the_tar_crate() {
        let mut h = tar::Header::new_ustar();
        h.set_path("train_00000001.jpg").unwrap();
        h.set_size(1234);
        h.set_cksum();
        assert_eq!(checksum(h.as_bytes()), h.cksum().unwrap());
    }
}
