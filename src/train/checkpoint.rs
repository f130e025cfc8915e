//! Training checkpoints: everything needed to resume a run exactly, written so that a crash
//! at any moment never leaves a checkpoint that looks complete but is not.
//!
//! Layout under a checkpoint root (usually `<run dir>/checkpoints`):
//!
//! ```text
//! step_000123/
//!   model.safetensors      weights, f32, caller's names (timm keys): loadable by timm as is;
//!                          the model's architecture in its metadata (as `--save-weights`)
//!   optimizer.safetensors  optimizer state tensors (e.g. `exp_avg.<key>`), f32, and the
//!                          weight EMA (`ema.<key>`) when the run keeps one
//!   state.json             caller's JSON: scheduler step, epoch, data position, RNG, config
//!   manifest.json          written last: step, and per file its size, SHA-256, tensor names
//! latest                   one line: the name of the newest complete step directory
//! ```
//!
//! A save writes into a hidden temporary directory, fsyncs every file and the directory, then
//! renames it into place (atomic on POSIX file systems) and fsyncs the root; `latest` is
//! replaced the same way (temporary file, fsync, rename). Old step directories beyond
//! `keep_last` are removed afterwards. `load` refuses any directory whose manifest is missing
//! or whose files differ from it in size or hash, naming the file, so a half-written or
//! truncated checkpoint is never resumed from.
//!
//! The API is backend-neutral: the engine downloads its flat buffers into named host tensors
//! ([`TensorRef`]) and uploads what [`load`] returns. With ZeRO, the engine gathers sharded
//! state first and rank 0 writes, so a run can resume with a different world size.

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "state.json";
pub const MANIFEST_FILE: &str = "manifest.json";
pub const LATEST_FILE: &str = "latest";
const FORMAT_VERSION: u32 = 1;

/// A named tensor to save, borrowed from the caller.
#[derive(Clone, Copy, Debug)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub shape: &'a [usize],
    pub data: &'a [f32],
}

/// A named tensor read back from a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// A loaded, verified checkpoint. Tensors come back in the order they were saved.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub step: u64,
    pub weights: Vec<Tensor>,
    pub optimizer: Vec<Tensor>,
    pub state: serde_json::Value,
}

impl Checkpoint {
    pub fn weight(&self, name: &str) -> Option<&Tensor> {
        self.weights.iter().find(|t| t.name == name)
    }
    pub fn optimizer_tensor(&self, name: &str) -> Option<&Tensor> {
        self.optimizer.iter().find(|t| t.name == name)
    }
}

/// Errors of saving and loading; each names the file or tensor.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{what} {}: {source}", path.display())]
    Io { what: &'static str, path: PathBuf, source: io::Error },
    #[error("checkpoint {} is incomplete or damaged: {}{why}", dir.display(), if file.is_empty() { String::new() } else { format!("{file}: ") })]
    Incomplete { dir: PathBuf, file: String, why: String },
    #[error("{} is not a checkpoint: no {MANIFEST_FILE} and no `{LATEST_FILE}` pointer", path.display())]
    NotACheckpoint { path: PathBuf },
    #[error("{} points to {target:?}, which is not a step directory name", path.display())]
    BadPointer { path: PathBuf, target: String },
    #[error("tensor {name:?}: {why}")]
    BadTensor { name: String, why: String },
}

type Result<T> = std::result::Result<T, CheckpointError>;

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CheckpointError + 'a {
    move |source| CheckpointError::Io { what, path: path.to_path_buf(), source }
}

/// What the manifest records of each file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
struct FileEntry {
    bytes: u64,
    sha256: String,
    /// Tensor names in saved order (safetensors files only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    tensors: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    step: u64,
    files: BTreeMap<String, FileEntry>,
}

/// The directory name of a step: `step_000123` (sorted by name = sorted by step up to 10⁶,
/// and parsed as a number beyond).
pub fn step_dir_name(step: u64) -> String {
    format!("step_{step:06}")
}

fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step_")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Saves a checkpoint of `step` under `root` and points `latest` at it; keeps the newest
/// `keep_last` step directories (0 = keep all). Returns the step directory.
pub fn save(
    root: &Path,
    step: u64,
    weights: &[TensorRef],
    optimizer: &[TensorRef],
    state: &serde_json::Value,
    keep_last: usize,
) -> Result<PathBuf> {
    save_with_metadata(root, step, weights, &[], optimizer, state, keep_last)
}

/// As [`save`], with `weights_meta` (key, value) added to the weights file's safetensors
/// metadata: the model architecture, so the file evaluates without a config.
pub fn save_with_metadata(
    root: &Path,
    step: u64,
    weights: &[TensorRef],
    weights_meta: &[(&str, String)],
    optimizer: &[TensorRef],
    state: &serde_json::Value,
    keep_last: usize,
) -> Result<PathBuf> {
    fs::create_dir_all(root).map_err(io_err("creating the checkpoint directory", root))?;
    remove_stale_temporaries(root);
    let name = step_dir_name(step);
    let tmp = root.join(format!(".tmp-{name}-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(io_err("removing an old temporary directory", &tmp))?;
    }
    fs::create_dir(&tmp).map_err(io_err("creating", &tmp))?;

    if let Err(e) = write_contents(&tmp, step, weights, weights_meta, optimizer, state) {
        // Leave nothing half-written behind.
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }

    let dir = root.join(&name);
    if dir.exists() {
        // Saving the same step again (after a resume): swap the old one out first, since a
        // rename cannot replace a non-empty directory.
        let old = root.join(format!(".old-{name}-{}", std::process::id()));
        fs::rename(&dir, &old).map_err(io_err("moving aside", &dir))?;
        fs::rename(&tmp, &dir).map_err(io_err("renaming the finished checkpoint to", &dir))?;
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(&tmp, &dir).map_err(io_err("renaming the finished checkpoint to", &dir))?;
    }
    sync_dir(root)?;

    let latest_tmp = root.join(format!(".{LATEST_FILE}.tmp-{}", std::process::id()));
    write_file(&latest_tmp, format!("{name}\n").as_bytes())?;
    let latest = root.join(LATEST_FILE);
    fs::rename(&latest_tmp, &latest).map_err(io_err("replacing", &latest))?;
    sync_dir(root)?;

    if keep_last > 0 {
        prune(root, keep_last, step)?;
    }
    Ok(dir)
}

/// Writes the files of one checkpoint into `tmp`, the manifest last, all synced.
fn write_contents(tmp: &Path, step: u64, weights: &[TensorRef], weights_meta: &[(&str, String)], optimizer: &[TensorRef], state: &serde_json::Value) -> Result<()> {
    let mut files = BTreeMap::new();
    files.insert(MODEL_FILE.to_string(), write_tensors(&tmp.join(MODEL_FILE), weights, weights_meta)?);
    files.insert(OPTIMIZER_FILE.to_string(), write_tensors(&tmp.join(OPTIMIZER_FILE), optimizer, &[])?);
    let state_bytes = serde_json::to_vec_pretty(state).map_err(|e| CheckpointError::Io {
        what: "serializing the training state for",
        path: tmp.join(STATE_FILE),
        source: io::Error::other(e),
    })?;
    files.insert(STATE_FILE.to_string(), write_file(&tmp.join(STATE_FILE), &state_bytes)?);
    // The manifest goes last: its presence certifies that everything above is complete.
    let manifest = Manifest { format: FORMAT_VERSION, step, files };
    let mbytes = serde_json::to_vec_pretty(&manifest).map_err(|e| CheckpointError::Io {
        what: "serializing",
        path: tmp.join(MANIFEST_FILE),
        source: io::Error::other(e),
    })?;
    write_file(&tmp.join(MANIFEST_FILE), &mbytes)?;
    sync_dir(tmp)?;
    Ok(())
}


/// Step directories under `root`, oldest first.
pub fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    for e in fs::read_dir(root).map_err(io_err("listing", root))? {
        let e = e.map_err(io_err("listing", root))?;
        if let Some(step) = e.file_name().to_str().and_then(parse_step_dir) {
            if e.path().is_dir() {
                out.push((step, e.path()));
            }
        }
    }
    out.sort();
    Ok(out)
}

fn prune(root: &Path, keep_last: usize, current: u64) -> Result<()> {
    let all = list(root)?;
    let excess = all.len().saturating_sub(keep_last);
    for (step, dir) in all.into_iter().take(excess) {
        if step != current {
            fs::remove_dir_all(&dir).map_err(io_err("removing old checkpoint", &dir))?;
        }
    }
    Ok(())
}

/// Temporary directories left by a save that crashed (only rank 0 saves into a root).
fn remove_stale_temporaries(root: &Path) {
    let Ok(rd) = fs::read_dir(root) else { return };
    for e in rd.flatten() {
        let n = e.file_name();
        let n = n.to_string_lossy();
        if n.starts_with(".tmp-") || n.starts_with(".old-") {
            let _ = fs::remove_dir_all(e.path());
        } else if n.starts_with(&format!(".{LATEST_FILE}.tmp-")) {
            let _ = fs::remove_file(e.path());
        }
    }
}

fn write_tensors(path: &Path, tensors: &[TensorRef], extra_meta: &[(&str, String)]) -> Result<FileEntry> {
    let mut seen = HashSet::new();
    let mut views = Vec::with_capacity(tensors.len());
    for t in tensors {
        if !seen.insert(t.name) {
            return Err(CheckpointError::BadTensor { name: t.name.into(), why: format!("saved twice in {}", path.display()) });
        }
        let n: usize = t.shape.iter().product();
        if n != t.data.len() {
            return Err(CheckpointError::BadTensor {
                name: t.name.into(),
                why: format!("shape {:?} holds {n} elements but {} were given", t.shape, t.data.len()),
            });
        }
        let view = TensorView::new(Dtype::F32, t.shape.to_vec(), bytemuck::cast_slice(t.data))
            .map_err(|e| CheckpointError::BadTensor { name: t.name.into(), why: e.to_string() })?;
        views.push((t.name, view));
    }
    // "format: pt" lets safetensors' torch loader (timm) take the file without a warning.
    let meta = Some(
        [("format".to_string(), "pt".to_string())]
            .into_iter()
            .chain(extra_meta.iter().map(|(k, v)| (k.to_string(), v.clone())))
            .collect(),
    );
    safetensors::serialize_to_file(views, &meta, path)
        .map_err(|e| CheckpointError::Io { what: "writing", path: path.to_path_buf(), source: io::Error::other(e) })?;
    let f = File::open(path).map_err(io_err("reopening", path))?;
    f.sync_all().map_err(io_err("syncing", path))?;
    let (bytes, sha256) = hash_file(path)?;
    Ok(FileEntry { bytes, sha256, tensors: tensors.iter().map(|t| t.name.to_string()).collect() })
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<FileEntry> {
    let mut f = File::create(path).map_err(io_err("creating", path))?;
    f.write_all(bytes).map_err(io_err("writing", path))?;
    f.sync_all().map_err(io_err("syncing", path))?;
    Ok(FileEntry { bytes: bytes.len() as u64, sha256: hex(&Sha256::digest(bytes)), tensors: Vec::new() })
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("syncing directory", dir))
}

fn hash_file(path: &Path) -> Result<(u64, String)> {
    let mut f = File::open(path).map_err(io_err("reading", path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(io_err("reading", path))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((n, hex(&h.finalize())))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The checkpoint directory `spec` designates: a step directory itself, a checkpoint root
/// (its `latest` pointer), or a `latest` file.
pub fn resolve(spec: &Path) -> Result<PathBuf> {
    if spec.join(MANIFEST_FILE).is_file() {
        return Ok(spec.to_path_buf());
    }
    let pointer = if spec.is_dir() { spec.join(LATEST_FILE) } else { spec.to_path_buf() };
    if !pointer.is_file() {
        if spec.is_dir() && parse_step_dir(&spec.file_name().unwrap_or_default().to_string_lossy()).is_some() {
            return Err(CheckpointError::Incomplete { dir: spec.to_path_buf(), file: MANIFEST_FILE.into(), why: "missing (the save did not finish)".into() });
        }
        return Err(CheckpointError::NotACheckpoint { path: spec.to_path_buf() });
    }
    let target = fs::read_to_string(&pointer).map_err(io_err("reading", &pointer))?;
    let target = target.trim();
    if parse_step_dir(target).is_none() {
        return Err(CheckpointError::BadPointer { path: pointer, target: target.to_string() });
    }
    let root = pointer.parent().unwrap_or(Path::new("."));
    let dir = root.join(target);
    // the pointer is written last, so a step it names that is gone or empty was removed or
    // damaged after the save: say so, rather than the OS's "No such file" of a file inside it
    if !dir.is_dir() {
        return Err(CheckpointError::Incomplete { dir, file: String::new(), why: format!("missing: the step directory {} names does not exist", pointer.display()) });
    }
    if !dir.join(MANIFEST_FILE).is_file() {
        return Err(CheckpointError::Incomplete { dir, file: MANIFEST_FILE.into(), why: "missing (the step directory is empty or its save did not finish)".into() });
    }
    Ok(dir)
}

/// `--resume` values: `latest` means the newest checkpoint under `root`; anything else is a
/// path (a step directory, a root, or a `latest` file).
pub fn resume_path(spec: &str, root: &Path) -> PathBuf {
    if spec == LATEST_FILE {
        root.to_path_buf()
    } else {
        PathBuf::from(spec)
    }
}

/// The training state (`state.json`) of the checkpoint `spec` designates, without reading
/// its tensors: what a resumed run checks its configuration against before it starts.
pub fn read_state(spec: &Path) -> Result<(PathBuf, serde_json::Value)> {
    let dir = resolve(spec)?;
    let path = dir.join(STATE_FILE);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(CheckpointError::Incomplete { dir, file: STATE_FILE.into(), why: "missing".into() }),
        Err(e) => return Err(CheckpointError::Io { what: "reading", path, source: e }),
    };
    let state = serde_json::from_slice(&bytes)
        .map_err(|e| CheckpointError::Incomplete { dir: dir.clone(), file: STATE_FILE.into(), why: format!("unreadable: {e}") })?;
    Ok((dir, state))
}

/// Loads and verifies the checkpoint `spec` designates (see [`resolve`]).
pub fn load(spec: &Path) -> Result<Checkpoint> {
    let dir = resolve(spec)?;
    let incomplete = |file: &str, why: String| CheckpointError::Incomplete { dir: dir.clone(), file: file.to_string(), why };
    let mpath = dir.join(MANIFEST_FILE);
    let mbytes = match fs::read(&mpath) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(incomplete(MANIFEST_FILE, "missing (the save did not finish)".into())),
        Err(e) => return Err(CheckpointError::Io { what: "reading", path: mpath, source: e }),
    };
    let manifest: Manifest = serde_json::from_slice(&mbytes).map_err(|e| incomplete(MANIFEST_FILE, format!("unreadable: {e}")))?;
    if manifest.format != FORMAT_VERSION {
        return Err(incomplete(MANIFEST_FILE, format!("format {} (this build reads {FORMAT_VERSION})", manifest.format)));
    }
    for required in [MODEL_FILE, OPTIMIZER_FILE, STATE_FILE] {
        if !manifest.files.contains_key(required) {
            return Err(incomplete(MANIFEST_FILE, format!("does not list {required}")));
        }
    }

    let mut contents: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for (name, entry) in &manifest.files {
        let path = dir.join(name);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(incomplete(name, "missing".into())),
            Err(e) => return Err(CheckpointError::Io { what: "reading", path, source: e }),
        };
        if bytes.len() as u64 != entry.bytes {
            return Err(incomplete(name, format!("{} bytes, the manifest says {} (truncated?)", bytes.len(), entry.bytes)));
        }
        if hex(&Sha256::digest(&bytes)) != entry.sha256 {
            return Err(incomplete(name, "contents differ from the manifest's SHA-256 (corrupted)".into()));
        }
        contents.insert(name.clone(), bytes);
    }
    let tensors = |file: &str| -> Result<Vec<Tensor>> {
        let bytes = &contents[file];
        let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| incomplete(file, e.to_string()))?;
        let order = &manifest.files[file].tensors;
        let mut out = Vec::with_capacity(order.len());
        for name in order {
            let v = st.tensor(name).map_err(|e| incomplete(file, format!("tensor {name:?}: {e}")))?;
            if v.dtype() != Dtype::F32 {
                return Err(incomplete(file, format!("tensor {name:?} is {:?}, expected F32", v.dtype())));
            }
            // Copy through bytemuck: the file's bytes carry no alignment guarantee.
            let mut data = vec![0f32; v.data().len() / 4];
            bytemuck::cast_slice_mut::<f32, u8>(&mut data).copy_from_slice(v.data());
            out.push(Tensor { name: name.clone(), shape: v.shape().to_vec(), data });
        }
        Ok(out)
    };
    let weights = tensors(MODEL_FILE)?;
    let optimizer = tensors(OPTIMIZER_FILE)?;
    let state = serde_json::from_slice(&contents[STATE_FILE]).map_err(|e| incomplete(STATE_FILE, format!("unreadable: {e}")))?;
    Ok(Checkpoint { dir, step: manifest.step, weights, optimizer, state })
}

// ---- the engine's flat buffers ↔ named tensors ----------------------------------------------

/// Where each named tensor lives in a flat buffer: (name, shape, span).
pub type Layout = Vec<(String, Vec<usize>, crate::backend::Span)>;

/// The weights by timm key, in table order.
pub fn param_layout(table: &crate::model::ParamTable) -> Layout {
    table.entries.iter().map(|e| (e.name.clone(), e.shape.clone(), e.span)).collect()
}

/// The optimizer state buffer by torch's state names (`exp_avg.<key>`, `exp_avg_sq.<key>` for
/// Adam; `momentum_buffer.<key>` for SGD), following `backend::optimizer_state_len`'s layout.
pub fn optimizer_layout(opt: &crate::config::OptimizerConfig, table: &crate::model::ParamTable) -> Layout {
    let parts: &[&str] = match opt {
        crate::config::OptimizerConfig::Adam { .. } => &["exp_avg", "exp_avg_sq"],
        crate::config::OptimizerConfig::Sgd { .. } => &["momentum_buffer"],
    };
    let mut out = Vec::new();
    for (k, part) in parts.iter().enumerate() {
        for e in &table.entries {
            let span = crate::backend::Span { off: k * table.total + e.span.off, len: e.span.len };
            out.push((format!("{part}.{}", e.name), e.shape.clone(), span));
        }
    }
    out
}

/// Borrowed views of `flat` by `layout`, for [`save`].
pub fn views<'a>(layout: &'a Layout, flat: &'a [f32]) -> Vec<TensorRef<'a>> {
    layout.iter().map(|(n, s, sp)| TensorRef { name: n, shape: s, data: &flat[sp.range()] }).collect()
}

/// Rebuilds a flat buffer of `len` from loaded tensors; every tensor of the layout must be
/// there with its shape (an error names the first that is not, and the file).
pub fn assemble(layout: &Layout, tensors: &[Tensor], len: usize, dir: &Path, file: &str) -> Result<Vec<f32>> {
    let by_name: BTreeMap<&str, &Tensor> = tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut flat = vec![0f32; len];
    for (name, shape, span) in layout {
        let bad = |why: String| CheckpointError::Incomplete { dir: dir.to_path_buf(), file: file.to_string(), why };
        let t = by_name.get(name.as_str()).ok_or_else(|| bad(format!("has no tensor {name:?} (different model or optimizer?)")))?;
        if &t.shape != shape {
            return Err(bad(format!("tensor {name:?} has shape {:?}, the model needs {shape:?}", t.shape)));
        }
        flat[span.range()].copy_from_slice(&t.data);
    }
    Ok(flat)
}

/// The weight EMA by timm key with an `ema.` prefix (`ema.blocks.0.attn.qkv.weight`), in the
/// optimizer file beside the state it belongs with.
pub fn ema_layout(table: &crate::model::ParamTable) -> Layout {
    table.entries.iter().map(|e| (format!("ema.{}", e.name), e.shape.clone(), e.span)).collect()
}

/// Saves the engine's training state after optimizer step `step` (1-based count of steps
/// done): weights, optimizer state and the weight EMA (when kept) from host copies of the flat
/// buffers, and `state`.
#[allow(clippy::too_many_arguments)]
pub fn save_training(
    root: &Path,
    step: u64,
    table: &crate::model::ParamTable,
    model: &crate::model::ModelConfig,
    params: &[f32],
    opt: &crate::config::OptimizerConfig,
    opt_state: &[f32],
    ema: Option<&[f32]>,
    state: &serde_json::Value,
    keep_last: usize,
) -> Result<PathBuf> {
    let pl = param_layout(table);
    let ol = optimizer_layout(opt, table);
    let el = ema_layout(table);
    let meta = [crate::model::weights::model_metadata(model)];
    let mut optimizer = views(&ol, opt_state);
    if let Some(e) = ema {
        optimizer.extend(views(&el, e));
    }
    save_with_metadata(root, step, &views(&pl, params), &meta, &optimizer, state, keep_last)
}

/// What a resumed run continues from.
#[derive(Clone, Debug)]
pub struct Restored {
    pub step: u64,
    pub params: Vec<f32>,
    pub opt_state: Vec<f32>,
    /// The weight EMA, when the checkpoint holds one.
    pub ema: Option<Vec<f32>>,
    pub state: serde_json::Value,
    pub dir: PathBuf,
}

/// Loads `spec` (see [`resolve`]) into flat buffers laid out for `table` and `opt`.
pub fn restore(spec: &Path, table: &crate::model::ParamTable, opt: &crate::config::OptimizerConfig) -> Result<Restored> {
    let ck = load(spec)?;
    let params = assemble(&param_layout(table), &ck.weights, table.total, &ck.dir, MODEL_FILE)?;
    let olen = crate::backend::optimizer_state_len(opt, table.total);
    let opt_state = assemble(&optimizer_layout(opt, table), &ck.optimizer, olen, &ck.dir, OPTIMIZER_FILE)?;
    // all of the average or none of it (a partial one is an error naming the first missing)
    let ema = match ck.optimizer.iter().any(|t| t.name.starts_with("ema.")) {
        true => Some(assemble(&ema_layout(table), &ck.optimizer, table.total, &ck.dir, OPTIMIZER_FILE)?),
        false => None,
    };
    Ok(Restored { step: ck.step, params, opt_state, ema, state: ck.state, dir: ck.dir })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    type Owned = Vec<(String, Vec<usize>, Vec<f32>)>;

    fn tensors(seed: f32) -> (Owned, Owned) {
        let w = vec![
            ("patch_embed.proj.weight".to_string(), vec![2, 3], (0..6).map(|i| seed + i as f32).collect()),
            ("head.bias".to_string(), vec![3], vec![seed; 3]),
        ];
        let o = vec![("exp_avg.head.bias".to_string(), vec![3], vec![-seed; 3])];
        (w, o)
    }

    fn refs(v: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<TensorRef<'_>> {
        v.iter().map(|(n, s, d)| TensorRef { name: n, shape: s, data: d }).collect()
    }

    fn save_step(root: &Path, step: u64, keep: usize) -> PathBuf {
        let (w, o) = tensors(step as f32);
        save(root, step, &refs(&w), &refs(&o), &json!({"step": step, "epoch": 1, "rng": [1, 2]}), keep).unwrap()
    }

    #[test]
    fn round_trip_latest_and_keep_last() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ckpt");
        for step in [10, 20, 30] {
            save_step(&root, step, 2);
        }
        let names: Vec<u64> = list(&root).unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(names, [20, 30], "keep_last 2");
        assert_eq!(fs::read_to_string(root.join("latest")).unwrap().trim(), "step_000030");
        let c = load(&root).unwrap();
        assert_eq!(c.step, 30);
        assert_eq!(c.dir, root.join("step_000030"));
        let (w, o) = tensors(30.0);
        assert_eq!(c.weights.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["patch_embed.proj.weight", "head.bias"]);
        assert_eq!(c.weight("patch_embed.proj.weight").unwrap().data, w[0].2);
        assert_eq!(c.weight("patch_embed.proj.weight").unwrap().shape, [2, 3]);
        assert_eq!(c.optimizer_tensor("exp_avg.head.bias").unwrap().data, o[0].2);
        assert_eq!(c.state["rng"], json!([1, 2]));
        // The same checkpoint through every spelling.
        assert_eq!(load(&root.join("latest")).unwrap().step, 30);
        assert_eq!(load(&root.join("step_000020")).unwrap().step, 20);
        assert_eq!(resume_path("latest", &root), root);
        // No temporaries left behind.
        assert!(fs::read_dir(&root).unwrap().flatten().all(|e| !e.file_name().to_string_lossy().starts_with('.')));
        // Re-saving an existing step replaces it.
        save_step(&root, 30, 0);
        assert_eq!(load(&root).unwrap().step, 30);
    }

    #[test]
    fn weights_file_is_plain_safetensors() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_step(tmp.path(), 1, 0);
        let bytes = fs::read(dir.join(MODEL_FILE)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("head.bias").unwrap().shape(), [3]);
    }

    #[test]
    fn damaged_checkpoints_are_refused_naming_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = save_step(tmp.path(), 5, 0);

        // Truncated tensor file.
        let m = dir.join(MODEL_FILE);
        let good = fs::read(&m).unwrap();
        fs::write(&m, &good[..good.len() - 4]).unwrap();
        let e = load(&dir).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("truncated"), "{e}");
        // Same size, flipped byte.
        let mut bad = good.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        fs::write(&m, &bad).unwrap();
        let e = load(&dir).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("SHA-256"), "{e}");
        fs::write(&m, &good).unwrap();
        assert!(load(&dir).is_ok());

        // Missing file.
        fs::remove_file(dir.join(OPTIMIZER_FILE)).unwrap();
        let e = load(&dir).unwrap_err().to_string();
        assert!(e.contains("optimizer.safetensors: missing"), "{e}");

        // A crash before the manifest: never loadable.
        fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
        let e = load(&dir).unwrap_err().to_string();
        assert!(e.contains("manifest.json") && e.contains("did not finish"), "{e}");

        let e = load(tmp.path().join("nothing").as_path()).unwrap_err();
        assert!(matches!(e, CheckpointError::NotACheckpoint { .. }), "{e}");
    }

    #[test]
    fn engine_buffers_round_trip_by_timm_key() {
        let cfg = crate::model::ModelConfig::preset(crate::model::spec::DEFAULT_PRESET).expect("default preset");
        let table = crate::model::ParamTable::new(&cfg);
        let opt = crate::config::OptimizerConfig::Adam {
            lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, adam_w_mode: true, bias_correction: true,
        };
        let params: Vec<f32> = (0..table.total).map(|i| i as f32 * 0.5).collect();
        let state: Vec<f32> = (0..2 * table.total).map(|i| -(i as f32)).collect();
        let tmp = tempfile::tempdir().unwrap();
        save_training(tmp.path(), 7, &table, &cfg, &params, &opt, &state, None, &json!({"epoch": 0}), 0).unwrap();
        // The weights file records the architecture, so it evaluates without a config.
        let inferred = crate::model::weights::infer(&tmp.path().join(step_dir_name(7)).join(MODEL_FILE)).unwrap();
        assert_eq!(inferred.num_heads, Some(cfg.num_heads));
        let r = restore(tmp.path(), &table, &opt).unwrap();
        assert_eq!((r.step, r.params == params, r.opt_state == state, r.ema), (7, true, true, None));
        // with a weight EMA, it comes back as saved
        let ema: Vec<f32> = params.iter().map(|v| v * 0.25 + 1.0).collect();
        save_training(tmp.path(), 8, &table, &cfg, &params, &opt, &state, Some(&ema), &json!({"epoch": 0}), 0).unwrap();
        assert_eq!(restore(tmp.path(), &table, &opt).unwrap().ema.as_deref(), Some(&ema[..]));
        let ck = load(tmp.path()).unwrap();
        assert!(ck.weight("cls_token").is_some() && ck.optimizer_tensor("exp_avg_sq.head.weight").is_some());
        // An SGD run cannot resume from Adam state: the error names the file and tensor.
        let sgd = crate::config::OptimizerConfig::Sgd { lr: 0.1, momentum: 0.9, dampening: 0.0, weight_decay: 0.0, nesterov: false };
        let e = restore(tmp.path(), &table, &sgd).unwrap_err().to_string();
        assert!(e.contains("optimizer.safetensors") && e.contains("momentum_buffer."), "{e}");
    }

    #[test]
    fn bad_tensors_are_rejected_before_writing() {
        let tmp = tempfile::tempdir().unwrap();
        let d = [1.0f32, 2.0];
        let t = [TensorRef { name: "a", shape: &[3], data: &d }];
        let e = save(tmp.path(), 1, &t, &[], &json!({}), 0).unwrap_err().to_string();
        assert!(e.contains("\"a\"") && e.contains("3 elements but 2"), "{e}");
        let t = [TensorRef { name: "a", shape: &[2], data: &d }, TensorRef { name: "a", shape: &[2], data: &d }];
        assert!(save(tmp.path(), 1, &t, &[], &json!({}), 0).unwrap_err().to_string().contains("saved twice"));
        assert!(!tmp.path().join("latest").exists());
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0, "no temporary directory left");
    }
}
