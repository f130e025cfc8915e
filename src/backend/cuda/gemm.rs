//! cuBLASLt GEMMs: 16-bit (bf16 or fp16, the backend's `HalfFormat`) or f32 operands, fp32 accumulation, optional bias epilogue,
//! strided batches. Descriptors, layouts and the chosen algorithm are cached per shape so a
//! call costs one attribute update and one `cublasLtMatmul`. The algorithm is chosen by timing
//! the heuristic's candidates on first use (`fastest`); the choices persist on disk beside the
//! compiled kernels (`ChoiceStore`), so a later process on the same card and library skips the
//! timing.
//!
//! cuBLASLt is column-major. Row-major callers describe their product in column-major terms
//! (a row-major (R, C) matrix is a column-major C×R matrix with leading dimension C); the
//! backend's `matmul_*` methods do that translation and say so beside each call.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Mutex;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys::CUdeviceptr;

use crate::backend::half::HalfFormat;
use crate::backend::BackendError;

/// A buffer's element type. `Half` is the backend's 16-bit compute format, bf16 or fp16
/// (`HalfFormat`, one per backend): buffers and shapes say "16-bit", the backend says which.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    Half,
    F32,
}

impl Ty {
    fn cuda(self, half: HalfFormat) -> lt::cudaDataType {
        match (self, half) {
            (Ty::Half, HalfFormat::Bf16) => lt::cudaDataType::CUDA_R_16BF,
            (Ty::Half, HalfFormat::F16) => lt::cudaDataType::CUDA_R_16F,
            (Ty::F32, _) => lt::cudaDataType::CUDA_R_32F,
        }
    }
    pub fn size(self) -> usize {
        match self {
            Ty::Half => 2,
            Ty::F32 => 4,
        }
    }
}

/// One column-major product D = alpha·op(A)·op(B) + beta·C (+ bias per row of D); C has D's
/// type and layout and is either D itself (accumulate) or another buffer (a residual input).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GemmShape {
    pub ta: bool,
    pub tb: bool,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub a_ty: Ty,
    pub b_ty: Ty,
    pub d_ty: Ty,
    pub lda: i64,
    pub ldb: i64,
    pub ldd: i64,
    pub batch: i32,
    pub stride_a: i64,
    pub stride_b: i64,
    pub stride_d: i64,
    pub bias: bool,
    /// beta ≠ 0 (accumulate into D).
    pub accumulate: bool,
    /// Smallest pointer alignment in bytes across A, B, D (power of two, ≤ 256).
    pub align: u32,
}

struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    a: lt::cublasLtMatrixLayout_t,
    b: lt::cublasLtMatrixLayout_t,
    d: lt::cublasLtMatrixLayout_t,
    algo: lt::cublasLtMatmulAlgo_t,
    /// Heuristic's candidates, timed on first use (see `tune`).
    candidates: Vec<lt::cublasLtMatmulAlgo_t>,
}

/// Algorithms the heuristic proposes per shape; each is timed on first use.
const CANDIDATES: usize = 16;
/// Timed rounds per candidate when tuning (after one warm-up run each). The rounds interleave
/// the candidates so clock or neighbour drift hits them alike, and the medians are compared:
/// robustness against drift rather than speed.
const TUNING_ROUNDS: usize = 7;
/// Products whose fastest interleaved median reaches this (ms) are timed once more, each
/// candidate alone for a sustained stretch: a training step holds the card at its power limit,
/// where the clock follows the power a kernel draws, and interleaved rounds time every
/// candidate at one shared clock, so under the cap the sustained choice can differ (and draw
/// less power at a higher clock). The threshold takes ViT-B/16's qkv and MLP products and
/// leaves small ones, where the step's mix of kernels sets the clock, to the interleaved
/// rounds.
const SUSTAINED_MIN_MS: f32 = 0.15;
/// Each sustained candidate runs this long (ms) before it is timed, and this long timed.
const SUSTAINED_MS: f32 = 30.0;
/// Candidates slower than the interleaved best by more than this factor are not timed again.
const SUSTAINED_SPREAD: f32 = 1.15;

pub struct Gemm {
    handle: lt::cublasLtHandle_t,
    workspace: CUdeviceptr,
    workspace_size: usize,
    plans: Mutex<HashMap<GemmShape, Plan>>,
    choices: Mutex<ChoiceStore>,
    sustained: bool,
    /// The format of `Ty::Half` operands.
    half: HalfFormat,
}

/// The tuner's choices on disk: one line per product, `key<TAB>index<TAB>candidates`, where
/// the key names the card, the cuBLASLt version and the shape, and the index points into the
/// heuristic's candidate list (which is fixed for a given card, library and shape). A choice
/// is only reused when the heuristic still returns as many candidates. The file is a cache: an
/// unreadable or malformed line is skipped and the product tuned again; each update rewrites
/// the whole file through a temporary file and a rename, so a reader never sees half of it
/// (processes tuning at once may drop each other's lines, which are then tuned again).
struct ChoiceStore {
    path: Option<PathBuf>,
    prefix: String,
    entries: HashMap<String, (usize, usize)>,
}

impl ChoiceStore {
    /// The store of `path` (None: in memory only) for the card and library that `prefix` names.
    fn open(path: Option<PathBuf>, prefix: String) -> ChoiceStore {
        let entries = path.as_ref().and_then(|p| std::fs::read_to_string(p).ok()).map(|text| parse_choices(&text)).unwrap_or_default();
        ChoiceStore { path, prefix, entries }
    }

    fn key(&self, s: &GemmShape) -> String {
        format!("{}|{s:?}", self.prefix)
    }

    /// The stored candidate index for `s`, if it was chosen among `count` candidates.
    fn get(&self, s: &GemmShape, count: usize) -> Option<usize> {
        match self.entries.get(&self.key(s)) {
            Some(&(index, n)) if n == count && index < count => Some(index),
            _ => None,
        }
    }

    /// Records a choice and rewrites the file (errors only cost the next process a retune).
    fn put(&mut self, s: &GemmShape, index: usize, count: usize) {
        let key = self.key(s);
        self.entries.insert(key, (index, count));
        let Some(path) = &self.path else { return };
        let mut lines: Vec<String> = self.entries.iter().map(|(k, (i, n))| format!("{k}\t{i}\t{n}")).collect();
        lines.sort();
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, lines.join("\n") + "\n").is_ok() && std::fs::rename(&tmp, path).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

/// `key<TAB>index<TAB>candidates` lines; anything else is skipped.
fn parse_choices(text: &str) -> HashMap<String, (usize, usize)> {
    let mut out = HashMap::new();
    for line in text.lines() {
        let mut f = line.split('\t');
        if let (Some(k), Some(i), Some(n), None) = (f.next(), f.next(), f.next(), f.next()) {
            if let (Ok(i), Ok(n)) = (i.parse::<usize>(), n.parse::<usize>()) {
                if !k.is_empty() && i < n {
                    out.insert(k.to_string(), (i, n));
                }
            }
        }
    }
    out
}

// SAFETY: the handle and descriptors are only used under `plans`' lock or by the one
// stream the backend owns; cuBLASLt handles may be shared across threads.
unsafe impl Send for Gemm {}
unsafe impl Sync for Gemm {}

/// Whether `stream` is capturing a graph (no synchronizing work allowed then).
pub fn capturing_stream(stream: cudarc::driver::sys::CUstream) -> bool {
    capturing(stream)
}

fn capturing(stream: cudarc::driver::sys::CUstream) -> bool {
    // SAFETY: the stream handle is live.
    match unsafe { cudarc::driver::result::stream::is_capturing(stream) } {
        Ok(st) => st != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
        Err(_) => true,
    }
}

fn lt_err(op: &str, s: lt::cublasStatus_t) -> BackendError {
    BackendError::Device(format!("{op}: cuBLASLt {s:?}"))
}

fn check(op: &str, s: lt::cublasStatus_t) -> Result<(), BackendError> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(lt_err(op, s))
    }
}

/// Largest power of two (≤ 256) dividing every address the GEMM may touch.
pub fn alignment(ptrs: &[u64]) -> u32 {
    let mut a = 256u64;
    for &p in ptrs {
        if p != 0 {
            a = a.min(1u64 << p.trailing_zeros().min(8));
        }
    }
    a as u32
}

impl Gemm {
    /// `card` names the GPU in the on-disk choice store's keys; `store_path` is the store's
    /// file (None: choices are kept for this process only); `sustained` adds the sustained
    /// timing of long products to the interleaved rounds (`CudaOptions::gemm_tune`).
    /// `half`: the format of `Ty::Half` operands (part of the store's keys when fp16).
    pub fn new(workspace: CUdeviceptr, workspace_size: usize, card: &str, store_path: Option<PathBuf>, sustained: bool, half: HalfFormat) -> Result<Gemm, BackendError> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: out-pointer to a handle.
        check("cublasLtCreate", unsafe { lt::cublasLtCreate(&mut handle) })?;
        // SAFETY: no arguments; the library is loaded (the handle exists).
        let version = unsafe { lt::cublasLtGetVersion() };
        // the tuning rule is part of the key: choices made under another rule are not reused
        let rule = if sustained { format!("sustained from {SUSTAINED_MIN_MS} ms, {SUSTAINED_MS} ms, spread {SUSTAINED_SPREAD}") } else { "quick".to_string() };
        // fp16 products are other products than bf16 ones: their own keys
        let fmt = if half == HalfFormat::F16 { "|fp16" } else { "" };
        let prefix = format!("{card}|cublasLt {version}|{rule}{fmt}");
        let choices = Mutex::new(ChoiceStore::open(store_path, prefix));
        Ok(Gemm { handle, workspace, workspace_size, plans: Mutex::new(HashMap::new()), choices, sustained, half })
    }

    fn make_plan(&self, s: &GemmShape) -> Result<Plan, BackendError> {
        // SAFETY: every cuBLASLt object is created here, configured with pointers to live
        // locals of the documented types, and owned by the returned plan.
        unsafe {
            let mut desc = std::ptr::null_mut();
            check("cublasLtMatmulDescCreate", lt::cublasLtMatmulDescCreate(&mut desc, lt::cublasComputeType_t::CUBLAS_COMPUTE_32F, lt::cudaDataType::CUDA_R_32F))?;
            let set = |attr: lt::cublasLtMatmulDescAttributes_t, v: *const c_void, n: usize| {
                check("cublasLtMatmulDescSetAttribute", lt::cublasLtMatmulDescSetAttribute(desc, attr, v, n))
            };
            let ta: i32 = if s.ta { 1 } else { 0 };
            let tb: i32 = if s.tb { 1 } else { 0 };
            set(lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &ta as *const i32 as *const c_void, 4)?;
            set(lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, &tb as *const i32 as *const c_void, 4)?;
            if s.bias {
                let epi = lt::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                set(lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi as *const _ as *const c_void, std::mem::size_of_val(&epi))?;
                let bt = s.d_ty.cuda(self.half);
                set(lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt as *const _ as *const c_void, std::mem::size_of_val(&bt))?;
            }
            let layout = |ty: Ty, rows: u64, cols: u64, ld: i64, stride: i64| -> Result<lt::cublasLtMatrixLayout_t, BackendError> {
                let mut l = std::ptr::null_mut();
                check("cublasLtMatrixLayoutCreate", lt::cublasLtMatrixLayoutCreate(&mut l, ty.cuda(self.half), rows, cols, ld))?;
                if s.batch > 1 {
                    check("cublasLtMatrixLayoutSetAttribute", lt::cublasLtMatrixLayoutSetAttribute(l, lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &s.batch as *const i32 as *const c_void, 4))?;
                    check("cublasLtMatrixLayoutSetAttribute", lt::cublasLtMatrixLayoutSetAttribute(l, lt::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride as *const i64 as *const c_void, 8))?;
                }
                Ok(l)
            };
            let (ar, ac) = if s.ta { (s.k, s.m) } else { (s.m, s.k) };
            let (br, bc) = if s.tb { (s.n, s.k) } else { (s.k, s.n) };
            let a = layout(s.a_ty, ar, ac, s.lda, s.stride_a)?;
            let b = layout(s.b_ty, br, bc, s.ldb, s.stride_b)?;
            let d = layout(s.d_ty, s.m, s.n, s.ldd, s.stride_d)?;
            let mut pref = std::ptr::null_mut();
            check("cublasLtMatmulPreferenceCreate", lt::cublasLtMatmulPreferenceCreate(&mut pref))?;
            let ws = self.workspace_size as u64;
            check("cublasLtMatmulPreferenceSetAttribute", lt::cublasLtMatmulPreferenceSetAttribute(pref, lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws as *const u64 as *const c_void, 8))?;
            for attr in [
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ] {
                check("cublasLtMatmulPreferenceSetAttribute", lt::cublasLtMatmulPreferenceSetAttribute(pref, attr, &s.align as *const u32 as *const c_void, 4))?;
            }
            let mut heur: [lt::cublasLtMatmulHeuristicResult_t; CANDIDATES] = std::mem::zeroed();
            let mut count = 0i32;
            let r = lt::cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, d, d, pref, CANDIDATES as i32, heur.as_mut_ptr(), &mut count);
            lt::cublasLtMatmulPreferenceDestroy(pref);
            check("cublasLtMatmulAlgoGetHeuristic", r)?;
            if count == 0 {
                return Err(BackendError::Device(format!("cuBLASLt has no algorithm for {s:?}")));
            }
            let candidates = heur[..count as usize].iter().filter(|h| h.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS).map(|h| h.algo).collect();
            Ok(Plan { desc, a, b, d, algo: heur[0].algo, candidates })
        }
    }

    /// Runs the product on `stream`. Pointers are device addresses matching `s`.
    #[allow(clippy::too_many_arguments)]
    pub fn run(&self, op: &str, s: &GemmShape, a: CUdeviceptr, b: CUdeviceptr, c: CUdeviceptr, d: CUdeviceptr, bias: CUdeviceptr, alpha: f32, beta: f32, stream: cudarc::driver::sys::CUstream) -> Result<(), BackendError> {
        let mut plans = self.plans.lock().map_err(|_| BackendError::Device(format!("{op}: GEMM plan cache poisoned")))?;
        if !plans.contains_key(s) {
            let p = self.make_plan(s).map_err(|e| BackendError::Device(format!("{op}: {e}")))?;
            plans.insert(*s, p);
        }
        let p = plans.get_mut(s).ok_or_else(|| BackendError::Device(format!("{op}: GEMM plan missing")))?;
        // SAFETY: the plan's objects live in the cache; pointers are device buffers the
        // caller checked against the shape; alpha/beta are host f32 (scale type 32F).
        unsafe {
            if s.bias {
                check(op, lt::cublasLtMatmulDescSetAttribute(p.desc, lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias as *const u64 as *const c_void, 8))?;
            }
            // First use: a choice stored by an earlier process (a host lookup, fine during graph
            // capture too), or outside capture, time every candidate and keep the fastest. A
            // product that does not read its own output is timed on these operands (re-running
            // it only rewrites the same output); one that accumulates into D in place (weight
            // gradients) is timed on a temporary copy of D's extent, so D is never touched.
            let stored = if p.candidates.len() > 1 { self.choices.lock().ok().and_then(|store| store.get(s, p.candidates.len())) } else { None };
            if let Some(i) = stored {
                p.algo = p.candidates[i];
            } else if p.candidates.len() > 1 && !capturing(stream) {
                let cands = std::mem::take(&mut p.candidates);
                let in_place = s.accumulate && c == d;
                let scratch = if in_place { TempBuf::new(d_extent_bytes(s)).ok() } else { None };
                let target = match (&scratch, in_place) {
                    (Some(t), true) => Some((t.ptr, t.ptr)),
                    (None, true) => None,  // no memory for the copy: keep the heuristic's pick
                    _ => Some((c, d)),
                };
                if let Some((tc, td)) = target {
                    if let Some(best) = self.fastest(p, &cands, a, b, tc, td, alpha, beta, stream) {
                        p.algo = cands[best];
                        if let Ok(mut store) = self.choices.lock() {
                            store.put(s, best, cands.len());
                        }
                    }
                }
            }
            p.candidates.clear();
            self.matmul(op, p, &p.algo, a, b, c, d, alpha, beta, stream)
        }
    }

    /// # Safety
    /// As `run`: live plan objects and device pointers matching the plan's shape.
    #[allow(clippy::too_many_arguments)]
    unsafe fn matmul(&self, op: &str, p: &Plan, algo: &lt::cublasLtMatmulAlgo_t, a: CUdeviceptr, b: CUdeviceptr, c: CUdeviceptr, d: CUdeviceptr, alpha: f32, beta: f32, stream: cudarc::driver::sys::CUstream) -> Result<(), BackendError> {
        check(
            op,
            lt::cublasLtMatmul(
                self.handle,
                p.desc,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                p.a,
                b as *const c_void,
                p.b,
                &beta as *const f32 as *const c_void,
                c as *const c_void,
                p.d,
                d as *mut c_void,
                p.d,
                algo,
                self.workspace as *mut c_void,
                self.workspace_size,
                stream as _,
            ),
        )
    }

    /// The index of the candidate with the smallest median time over TUNING_ROUNDS interleaved
    /// rounds (a candidate that fails to run is dropped), or for a product of at least
    /// SUSTAINED_MIN_MS, of the one fastest when each runs alone for a sustained stretch
    /// (`sustained`); None if none ran.
    ///
    /// # Safety
    /// As `run`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn fastest(&self, p: &Plan, cands: &[lt::cublasLtMatmulAlgo_t], a: CUdeviceptr, b: CUdeviceptr, c: CUdeviceptr, d: CUdeviceptr, alpha: f32, beta: f32, stream: cudarc::driver::sys::CUstream) -> Option<usize> {
        use cudarc::driver::result::event;
        use cudarc::driver::sys::CUevent_flags;
        let mut ok: Vec<bool> = cands.iter().map(|algo| self.matmul("GEMM tuning", p, algo, a, b, c, d, alpha, beta, stream).is_ok()).collect();
        // one event pair per candidate and round, read after the whole batch has run
        let mut events = Vec::new();
        for _ in 0..TUNING_ROUNDS {
            for (i, algo) in cands.iter().enumerate() {
                if !ok[i] {
                    continue;
                }
                let (e0, e1) = match (event::create(CUevent_flags::CU_EVENT_DEFAULT), event::create(CUevent_flags::CU_EVENT_DEFAULT)) {
                    (Ok(e0), Ok(e1)) => (e0, e1),
                    (r0, r1) => {
                        // out of events: drop this candidate (its rounds are then incomplete)
                        for e in [r0, r1].into_iter().flatten() {
                            let _ = event::destroy(e);
                        }
                        ok[i] = false;
                        continue;
                    }
                };
                let _ = event::record(e0, stream);
                ok[i] = self.matmul("GEMM tuning", p, algo, a, b, c, d, alpha, beta, stream).is_ok();
                let _ = event::record(e1, stream);
                events.push((i, e0, e1));
            }
        }
        let mut times: Vec<Vec<f32>> = vec![Vec::new(); cands.len()];
        let synced = events.last().map(|&(_, _, e1)| event::synchronize(e1).is_ok()).unwrap_or(false);
        for (i, e0, e1) in events {
            if synced {
                if let Ok(ms) = event::elapsed(e0, e1) {
                    times[i].push(ms);
                }
            }
            let _ = event::destroy(e0);
            let _ = event::destroy(e1);
        }
        let mut best: Option<(f32, usize)> = None;
        for (i, t) in times.iter_mut().enumerate() {
            if !ok[i] || t.len() != TUNING_ROUNDS {
                continue;
            }
            t.sort_by(|x, y| x.total_cmp(y));
            let med = t[TUNING_ROUNDS / 2];
            if best.is_none_or(|(m, _)| med < m) {
                best = Some((med, i));
            }
        }
        let (best_ms, best_i) = best?;
        if !self.sustained || best_ms < SUSTAINED_MIN_MS {
            return Some(best_i);
        }
        let contenders: Vec<usize> = (0..cands.len()).filter(|&i| ok[i] && times[i].len() == TUNING_ROUNDS && times[i][TUNING_ROUNDS / 2] <= best_ms * SUSTAINED_SPREAD).collect();
        let reps = ((SUSTAINED_MS / best_ms).ceil() as usize).max(1);
        let mut sustained: Option<(f32, usize)> = None;
        for i in contenders {
            if let Some(ms) = self.sustained_ms(p, &cands[i], reps, a, b, c, d, alpha, beta, stream) {
                if sustained.is_none_or(|(m, _)| ms < m) {
                    sustained = Some((ms, i));
                }
            }
        }
        Some(sustained.map_or(best_i, |(_, i)| i))
    }

    /// Mean time (ms) of `reps` back-to-back runs of one candidate after `reps` untimed runs
    /// (the clock settles to the power this candidate draws); None if a run or an event failed.
    ///
    /// # Safety
    /// As `run`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn sustained_ms(&self, p: &Plan, algo: &lt::cublasLtMatmulAlgo_t, reps: usize, a: CUdeviceptr, b: CUdeviceptr, c: CUdeviceptr, d: CUdeviceptr, alpha: f32, beta: f32, stream: cudarc::driver::sys::CUstream) -> Option<f32> {
        use cudarc::driver::result::event;
        use cudarc::driver::sys::CUevent_flags;
        for _ in 0..reps {
            self.matmul("GEMM tuning", p, algo, a, b, c, d, alpha, beta, stream).ok()?;
        }
        let e0 = event::create(CUevent_flags::CU_EVENT_DEFAULT).ok()?;
        let e1 = match event::create(CUevent_flags::CU_EVENT_DEFAULT) {
            Ok(e) => e,
            Err(_) => {
                let _ = event::destroy(e0);
                return None;
            }
        };
        let mut ran = event::record(e0, stream).is_ok();
        for _ in 0..reps {
            ran &= self.matmul("GEMM tuning", p, algo, a, b, c, d, alpha, beta, stream).is_ok();
        }
        ran &= event::record(e1, stream).is_ok() && event::synchronize(e1).is_ok();
        let ms = if ran { event::elapsed(e0, e1).ok().map(|t| t / reps as f32) } else { None };
        let _ = event::destroy(e0);
        let _ = event::destroy(e1);
        ms
    }
}

/// Bytes from D's first element to one past its last, as `s` lays D out.
fn d_extent_bytes(s: &GemmShape) -> usize {
    let last_col = (s.ldd.max(0) as u64) * s.n.saturating_sub(1) + s.m;
    let batches = if s.batch > 1 { (s.stride_d.max(0) as u64) * (s.batch as u64 - 1) } else { 0 };
    ((last_col + batches) as usize) * s.d_ty.size()
}

/// Device memory held only while a product is tuned (freed on drop; synchronous, outside
/// capture). Not counted in the backend's peak-memory figure: at most one weight gradient's
/// size, for milliseconds, during the first step.
struct TempBuf {
    ptr: CUdeviceptr,
}

impl TempBuf {
    fn new(bytes: usize) -> Result<TempBuf, BackendError> {
        // SAFETY: a plain device allocation, freed once in drop.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes.max(256)) }.map_err(|e| BackendError::Device(format!("GEMM tuning buffer: {e}")))?;
        Ok(TempBuf { ptr })
    }
}

impl Drop for TempBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync in `new`; work queued on it is complete once the
        // tuning synchronized (free_sync waits for the device anyway).
        unsafe {
            let _ = cudarc::driver::result::free_sync(self.ptr);
        }
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        if let Ok(plans) = self.plans.get_mut() {
            for (_, p) in plans.drain() {
                // SAFETY: each object was created by make_plan and is destroyed once.
                unsafe {
                    lt::cublasLtMatrixLayoutDestroy(p.a);
                    lt::cublasLtMatrixLayoutDestroy(p.b);
                    lt::cublasLtMatrixLayoutDestroy(p.d);
                    lt::cublasLtMatmulDescDestroy(p.desc);
                }
            }
        }
        // SAFETY: the handle was created in `new` and is destroyed once.
        unsafe { lt::cublasLtDestroy(self.handle) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n: u64) -> GemmShape {
        GemmShape { ta: true, tb: false, m: 768, n, k: 3072, a_ty: Ty::Half, b_ty: Ty::Half, d_ty: Ty::Half, lda: 3072, ldb: 3072, ldd: 768, batch: 1, stride_a: 0, stride_b: 0, stride_d: 0, bias: true, accumulate: false, align: 256 }
    }

    #[test]
    fn choices_survive_a_reopen_and_need_the_same_candidate_count() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("gemm-choices.tsv");
        let mut store = ChoiceStore::open(Some(path.clone()), "H200 (132 SMs)|cublasLt 130000|sustained 1".into());
        assert_eq!(store.get(&shape(50432), 8), None);
        store.put(&shape(50432), 3, 8);
        store.put(&shape(256), 0, 6);
        let again = ChoiceStore::open(Some(path.clone()), "H200 (132 SMs)|cublasLt 130000|sustained 1".into());
        assert_eq!(again.get(&shape(50432), 8), Some(3));
        assert_eq!(again.get(&shape(256), 6), Some(0));
        // another candidate list (library or heuristic changed): tuned again
        assert_eq!(again.get(&shape(50432), 7), None);
        // another card, library or tuning rule: its own keys
        let other = ChoiceStore::open(Some(path.clone()), "H100 (132 SMs)|cublasLt 130000|sustained 1".into());
        assert_eq!(other.get(&shape(50432), 8), None);
        let quick = ChoiceStore::open(Some(path), "H200 (132 SMs)|cublasLt 130000|quick 1".into());
        assert_eq!(quick.get(&shape(50432), 8), None);
    }

    #[test]
    fn malformed_choice_lines_are_skipped() {
        let text = "a|b\t2\t8\nno tabs here\nk\tx\t8\nk2\t9\t8\nk3\t1\t4\textra\n\t1\t2\nk4\t0\t1\n";
        let parsed = parse_choices(text);
        assert_eq!(parsed.len(), 2, "{parsed:?}");
        assert_eq!(parsed.get("a|b"), Some(&(2, 8)));
        assert_eq!(parsed.get("k4"), Some(&(0, 1)));
    }

    #[test]
    fn a_store_without_a_file_keeps_choices_in_memory() {
        let mut store = ChoiceStore::open(None, "card|lib|rule".into());
        store.put(&shape(1), 1, 2);
        assert_eq!(store.get(&shape(1), 2), Some(1));
        assert_eq!(store.get(&shape(2), 2), None);
    }
}
