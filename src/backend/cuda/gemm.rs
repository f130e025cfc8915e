//! cuBLASLt GEMMs: bf16 (or f32) operands, fp32 accumulation, optional bias epilogue,
//! strided batches. Descriptors, layouts and the chosen algorithm are cached per shape so a
//! call costs one attribute update and one `cublasLtMatmul`.
//!
//! cuBLASLt is column-major. Row-major callers describe their product in column-major terms
//! (a row-major (R, C) matrix is a column-major C×R matrix with leading dimension C); the
//! backend's `matmul_*` methods do that translation and say so beside each call.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys::CUdeviceptr;

use crate::backend::BackendError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ty {
    Bf16,
    F32,
}

impl Ty {
    fn cuda(self) -> lt::cudaDataType {
        match self {
            Ty::Bf16 => lt::cudaDataType::CUDA_R_16BF,
            Ty::F32 => lt::cudaDataType::CUDA_R_32F,
        }
    }
    pub fn size(self) -> usize {
        match self {
            Ty::Bf16 => 2,
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

/// Algorithms the heuristic proposes per shape; each is timed once on first use.
const CANDIDATES: usize = 8;

pub struct Gemm {
    handle: lt::cublasLtHandle_t,
    workspace: CUdeviceptr,
    workspace_size: usize,
    plans: Mutex<HashMap<GemmShape, Plan>>,
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
    pub fn new(workspace: CUdeviceptr, workspace_size: usize) -> Result<Gemm, BackendError> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: out-pointer to a handle.
        check("cublasLtCreate", unsafe { lt::cublasLtCreate(&mut handle) })?;
        Ok(Gemm { handle, workspace, workspace_size, plans: Mutex::new(HashMap::new()) })
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
                let bt = s.d_ty.cuda();
                set(lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt as *const _ as *const c_void, std::mem::size_of_val(&bt))?;
            }
            let layout = |ty: Ty, rows: u64, cols: u64, ld: i64, stride: i64| -> Result<lt::cublasLtMatrixLayout_t, BackendError> {
                let mut l = std::ptr::null_mut();
                check("cublasLtMatrixLayoutCreate", lt::cublasLtMatrixLayoutCreate(&mut l, ty.cuda(), rows, cols, ld))?;
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
            // First use of a product that does not read its own output, outside graph capture:
            // time every candidate on these operands (re-running it only rewrites the same
            // output) and keep the fastest.
            if p.candidates.len() > 1 && (!s.accumulate || c != d) && !capturing(stream) {
                let cands = std::mem::take(&mut p.candidates);
                let mut best = (f32::INFINITY, p.algo);
                for algo in cands {
                    if let Ok(ms) = self.time_algo(p, &algo, a, b, c, d, alpha, beta, stream) {
                        if ms < best.0 {
                            best = (ms, algo);
                        }
                    }
                }
                p.algo = best.1;
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

    /// Median of 3 timed runs (after one warm-up) of `algo`, in ms.
    ///
    /// # Safety
    /// As `run`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn time_algo(&self, p: &Plan, algo: &lt::cublasLtMatmulAlgo_t, a: CUdeviceptr, b: CUdeviceptr, c: CUdeviceptr, d: CUdeviceptr, alpha: f32, beta: f32, stream: cudarc::driver::sys::CUstream) -> Result<f32, BackendError> {
        use cudarc::driver::result::event;
        use cudarc::driver::sys::CUevent_flags;
        let e = |x| BackendError::Device(format!("GEMM tuning: {x}"));
        self.matmul("GEMM tuning", p, algo, a, b, c, d, alpha, beta, stream)?;
        let mut times = Vec::new();
        for _ in 0..3 {
            let e0 = event::create(CUevent_flags::CU_EVENT_DEFAULT).map_err(e)?;
            let e1 = event::create(CUevent_flags::CU_EVENT_DEFAULT).map_err(e)?;
            event::record(e0, stream).map_err(e)?;
            let r = self.matmul("GEMM tuning", p, algo, a, b, c, d, alpha, beta, stream);
            event::record(e1, stream).map_err(e)?;
            event::synchronize(e1).map_err(e)?;
            let t = event::elapsed(e0, e1).map_err(e);
            let _ = event::destroy(e0);
            let _ = event::destroy(e1);
            r?;
            times.push(t?);
        }
        times.sort_by(|x, y| x.total_cmp(y));
        Ok(times[1])
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
