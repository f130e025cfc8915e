//! Kernel sources (the `.cu` files beside this module, embedded in the binary), compiled by
//! NVRTC for the device's architecture and cached on disk as cubins.
//!
//! Every module is built for one 16-bit compute format (`HalfFormat`): bf16, or fp16 with
//! `-DVITSCALE_HALF_F16`, which common.cuh's conversions and flash.cu's mma types follow; the
//! Hopper module (bf16 wgmma) is built for bf16 only, so an fp16 backend runs cuBLASLt and
//! flash.cu there.
//!
//! Cache key: SHA-256 of (common header + source + arch + NVRTC version + options); the
//! folder is `$VITSCALE_CACHE_DIR`, else `$XDG_CACHE_HOME/vitscale/kernels`, else
//! `~/.cache/vitscale/kernels`. A cache that cannot be written only costs a recompile.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, CString};
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::sys as nv;
use sha2::{Digest, Sha256};

use crate::backend::half::HalfFormat;
use crate::backend::BackendError;

const COMMON: &str = include_str!("kernels/common.cuh");
/// The wgmma/TMA building blocks, after `COMMON` in front of every `HOPPER` module.
const HOPPER_COMMON: &str = include_str!("kernels/hopper.cuh");

/// (file name, source): each becomes one module.
pub const SOURCES: &[(&str, &str)] = &[
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("embed.cu", include_str!("kernels/embed.cu")),
    ("layernorm.cu", include_str!("kernels/layernorm.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("loss.cu", include_str!("kernels/loss.cu")),
    ("optim.cu", include_str!("kernels/optim.cu")),
    ("image.cu", include_str!("kernels/image.cu")),
];

/// Modules whose compile failure is not fatal: their kernels are missing and `get` says why,
/// so the paths that need them report the error while everything else keeps working.
pub const OPTIONAL: &[(&str, &str)] = &[("flash.cu", include_str!("kernels/flash.cu"))];

/// Optional modules for Hopper only (`sm_90`), compiled for `sm_90a`: the warpgroup (wgmma)
/// instructions exist on no other architecture. Elsewhere they are skipped and their kernels
/// are missing.
pub const HOPPER: &[(&str, &str)] = &[
    ("hopper.cu", include_str!("kernels/hopper.cu")),
    ("hopper_flash_fwd.cu", include_str!("kernels/hopper_flash_fwd.cu")),
    ("hopper_flash_bwd.cu", include_str!("kernels/hopper_flash_bwd.cu")),
    ("hopper_wgrad.cu", include_str!("kernels/hopper_wgrad.cu")),
];

fn dev_err(op: &str, e: impl std::fmt::Display) -> BackendError {
    BackendError::Device(format!("{op}: {e}"))
}

pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("VITSCALE_CACHE_DIR") {
        return Some(PathBuf::from(d).join("kernels"));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("vitscale").join("kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("vitscale").join("kernels"))
}

pub fn nvrtc_version() -> Result<(i32, i32), BackendError> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: out-pointers to two live ints.
    let r = unsafe { nv::nvrtcVersion(&mut major, &mut minor) };
    if r != nv::nvrtcResult::NVRTC_SUCCESS {
        return Err(dev_err("nvrtcVersion", format!("{r:?}")));
    }
    Ok((major, minor))
}

fn nvrtc_check(op: &str, r: nv::nvrtcResult) -> Result<(), BackendError> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(dev_err(op, format!("{r:?}")))
    }
}

/// Compiles `src` for `arch`: a cubin for a real architecture ("sm_90"), PTX text for a
/// virtual one ("compute_75", JIT-compiled by the driver for the device at load).
fn nvrtc_cubin(name: &str, src: &str, arch: &str, opts: &[String]) -> Result<Vec<u8>, BackendError> {
    let ptx = arch.starts_with("compute_");
    let csrc = CString::new(src).map_err(|e| dev_err(name, e))?;
    let cname = CString::new(name).map_err(|e| dev_err(name, e))?;
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings that outlive the program; no headers passed.
    nvrtc_check("nvrtcCreateProgram", unsafe {
        nv::nvrtcCreateProgram(&mut prog, csrc.as_ptr(), cname.as_ptr(), 0, std::ptr::null(), std::ptr::null())
    })?;
    let copts: Vec<CString> = opts.iter().map(|o| CString::new(o.as_str()).unwrap_or_default()).collect();
    let ptrs: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: `prog` was created above; option pointers live until the call returns.
    let r = unsafe { nv::nvrtcCompileProgram(prog, ptrs.len() as c_int, ptrs.as_ptr()) };
    let result = if r != nv::nvrtcResult::NVRTC_SUCCESS {
        let mut log_len = 0usize;
        // SAFETY: `prog` is valid; the log buffer has the size NVRTC reported.
        let log = unsafe {
            nv::nvrtcGetProgramLogSize(prog, &mut log_len);
            let mut buf = vec![0u8; log_len.max(1)];
            nv::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char);
            String::from_utf8_lossy(&buf).trim_end_matches('\0').to_string()
        };
        let hint = if r == nv::nvrtcResult::NVRTC_ERROR_INVALID_OPTION { unsupported_arch_hint(arch, nvrtc_version().ok()) } else { None };
        Err(BackendError::Device(format!("NVRTC failed to compile {name} for {arch} ({r:?}):\n{log}{}", hint.map(|h| format!("\n{h}")).unwrap_or_default())))
    } else {
        let mut size = 0usize;
        // SAFETY: `prog` compiled successfully; the buffer has the size NVRTC reported.
        unsafe {
            if ptx {
                nvrtc_check("nvrtcGetPTXSize", nv::nvrtcGetPTXSize(prog, &mut size)).and_then(|_| {
                    let mut buf = vec![0u8; size];
                    nvrtc_check("nvrtcGetPTX", nv::nvrtcGetPTX(prog, buf.as_mut_ptr() as *mut c_char)).map(|_| buf)
                })
            } else {
                nvrtc_check("nvrtcGetCUBINSize", nv::nvrtcGetCUBINSize(prog, &mut size)).and_then(|_| {
                    let mut buf = vec![0u8; size];
                    nvrtc_check("nvrtcGetCUBIN", nv::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char)).map(|_| buf)
                })
            }
        }
    };
    // SAFETY: destroys the program created above exactly once.
    unsafe { nv::nvrtcDestroyProgram(&mut prog) };
    result
}

/// The architecture the kernels are built for when `VITSCALE_CUDA_ARCH` forces one older than
/// the device's ("sm_75" on an H200): compiled as PTX for the virtual architecture
/// ("compute_75") and JIT-compiled by the driver, so the code that runs is what that
/// architecture allows (no sm_80+ instructions; optional modules that need them are missing
/// and their paths fall back). None when unset. An error for a malformed value.
pub fn forced_arch() -> Result<Option<String>, BackendError> {
    let Ok(v) = std::env::var("VITSCALE_CUDA_ARCH") else { return Ok(None) };
    let v = v.trim();
    match v.strip_prefix("sm_").filter(|_| is_arch_name(v)) {
        Some(digits) => Ok(Some(format!("compute_{digits}"))),
        None => Err(BackendError::Device(format!("VITSCALE_CUDA_ARCH={v:?}: expected an architecture such as sm_75 or sm_80"))),
    }
}

/// The compute capability `VITSCALE_CUDA_ARCH` forces ((7, 5) for sm_75), if any: what the
/// backend's choices (the 16-bit format) follow, as the kernels do.
pub fn forced_capability() -> Result<Option<(i32, i32)>, BackendError> {
    Ok(forced_arch()?.as_deref().and_then(capability_of))
}

/// The compute capability an architecture name stands for: "sm_75" or "compute_75" → (7, 5),
/// "sm_100" → (10, 0) (the last digit is the minor version).
pub fn capability_of(arch: &str) -> Option<(i32, i32)> {
    let d = arch.strip_prefix("sm_").or_else(|| arch.strip_prefix("compute_"))?;
    if d.len() < 2 || !d.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let (maj, min) = d.split_at(d.len() - 1);
    Some((maj.parse().ok()?, min.parse().ok()?))
}

/// What to do when this NVRTC rejects `arch` as a target: NVRTC 13 (CUDA 13) dropped Volta
/// (sm_70, sm_72), which CUDA 12's NVRTC still builds for.
fn unsupported_arch_hint(arch: &str, nvrtc: Option<(i32, i32)>) -> Option<String> {
    let (cap, (major, minor)) = (capability_of(arch)?, nvrtc?);
    (major >= 13 && cap < (7, 5)).then(|| {
        format!(
            "NVRTC {major}.{minor} (CUDA {major}) no longer targets {arch}; CUDA 12's NVRTC does: put a folder holding \
             libnvrtc.so.12 (and its libnvrtc-builtins) first on LD_LIBRARY_PATH, e.g. from `pip install nvidia-cuda-nvrtc-cu12`, \
             with a symlink libnvrtc.so -> libnvrtc.so.12 there so it is loaded before any libnvrtc.so.13 (docs/precision.md)"
        )
    })
}

/// Compiles every module for `arch` (e.g. "sm_90", or "compute_75" for PTX) with NVRTC alone, with the options the
/// device load uses: no GPU, driver or cache is involved. (module, cubin bytes or the
/// compiler's error) for the required, the optional and (for sm_90) the Hopper modules: what
/// `vitscale selftest --compile-kernels` reports, so kernel sources can be checked on a
/// machine without a GPU. `half`: the 16-bit compute format the modules are built for.
pub fn compile_all(arch: &str, half: HalfFormat) -> Vec<(String, Result<usize, BackendError>)> {
    modules_for(arch, half)
        .map(|m| {
            let (src, opts) = m.source_and_options();
            (format!("{} ({}, {})", m.name, m.arch, half.name()), nvrtc_cubin(m.name, &src, m.arch, &opts).map(|c| c.len()))
        })
        .collect()
}

/// Whether `arch` names an architecture NVRTC targets: `sm_XY` (a cubin) or `compute_XY` (PTX).
pub fn is_arch_name(arch: &str) -> bool {
    arch.strip_prefix("sm_").or_else(|| arch.strip_prefix("compute_")).is_some_and(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit()))
}

/// One kernel module as compiled for a target.
struct Module<'a> {
    name: &'static str,
    body: &'static str,
    /// A compile or load failure leaves its kernels missing instead of failing the backend.
    optional: bool,
    arch: &'a str,
    half: HalfFormat,
}

impl Module<'_> {
    /// The source NVRTC compiles (the common header first) and its options.
    fn source_and_options(&self) -> (String, Vec<String>) {
        let hopper = if HOPPER.iter().any(|(name, _)| *name == self.name) { format!("#line 1 \"hopper.cuh\"\n{HOPPER_COMMON}\n") } else { String::new() };
        let src = format!("{COMMON}\n{hopper}#line 1 \"{}\"\n{}", self.name, self.body);
        let mut opts = vec![format!("--gpu-architecture={}", self.arch), "--std=c++17".into(), "-default-device".into(), "--use_fast_math".into()];
        if self.half == HalfFormat::F16 {
            opts.push("-DVITSCALE_HALF_F16".into());
        }
        (src, opts)
    }
}

/// Every module built for `arch` and `half`: the required ones, the optional ones, and on
/// sm_90 with bf16 the Hopper ones (for sm_90a; their wgmma kernels are bf16 only).
fn modules_for(arch: &str, half: HalfFormat) -> impl Iterator<Item = Module<'_>> {
    let hopper: &[(&str, &str)] = if arch == "sm_90" && half == HalfFormat::Bf16 { HOPPER } else { &[] };
    let module = move |(name, body): &(&'static str, &'static str), optional, arch| Module { name, body, optional, arch, half };
    SOURCES
        .iter()
        .map(move |m| module(m, false, arch))
        .chain(OPTIONAL.iter().map(move |m| module(m, true, arch)))
        .chain(hopper.iter().map(move |m| module(m, true, "sm_90a")))
}

/// Every kernel function by name.
pub struct Kernels {
    funcs: HashMap<String, CudaFunction>,
    _modules: Vec<Arc<CudaModule>>,
    /// Optional modules that failed to compile or load: (file name, error).
    pub failed: Vec<(String, String)>,
    /// Seconds spent compiling (0 when everything came from the cache).
    pub compile_s: f64,
    /// The older architecture forced by `VITSCALE_CUDA_ARCH` (PTX target), if any.
    pub forced: Option<String>,
    /// The 16-bit compute format the modules were built for.
    pub half: HalfFormat,
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>, arch: &str, half: HalfFormat) -> Result<Kernels, BackendError> {
        let (maj, min) = nvrtc_version()?;
        let dir = cache_dir();
        let mut funcs = HashMap::new();
        let mut modules = Vec::new();
        let mut compile_s = 0.0;
        let mut failed = Vec::new();
        // a forced older target replaces the device's (PTX, JIT-compiled at load)
        let forced = forced_arch()?;
        let arch: &str = forced.as_deref().unwrap_or(arch);
        for m in modules_for(arch, half) {
            let (name, body, optional, arch) = (m.name, m.body, m.optional, m.arch);
            let (src, opts) = m.source_and_options();
            let mut h = Sha256::new();
            h.update(src.as_bytes());
            h.update(arch.as_bytes());
            h.update(format!("nvrtc {maj}.{min} {opts:?}").as_bytes());
            let key: String = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
            let ext = if arch.starts_with("compute_") { "ptx" } else { "cubin" };
            let fmt = if half == HalfFormat::F16 { "-f16" } else { "" };
            let path = dir.as_ref().map(|d| d.join(format!("{}-{arch}{fmt}-{key}.{ext}", name.trim_end_matches(".cu"))));
            let cached = path.as_ref().and_then(|p| std::fs::read(p).ok());
            let cubin = match cached {
                Some(c) => c,
                None => {
                    let t = std::time::Instant::now();
                    let c = match nvrtc_cubin(name, &src, arch, &opts) {
                        Ok(c) => c,
                        Err(e) if optional => {
                            failed.push((name.to_string(), e.to_string()));
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    compile_s += t.elapsed().as_secs_f64();
                    if let (Some(d), Some(p)) = (&dir, &path) {
                        let _ = std::fs::create_dir_all(d);
                        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                        if std::fs::write(&tmp, &c).is_ok() {
                            let _ = std::fs::rename(&tmp, p);
                        }
                    }
                    c
                }
            };
            let image = match arch.starts_with("compute_") {
                true => cudarc::nvrtc::Ptx::from_src(String::from_utf8_lossy(&cubin).trim_end_matches('\0').to_string()),
                false => cudarc::nvrtc::Ptx::from_binary(cubin),
            };
            let loaded = ctx.load_module(image).map_err(|e| dev_err(&format!("loading module {name}"), e)).and_then(|module| {
                let mut fs = Vec::new();
                for fname in kernel_names(body) {
                    let f = module.load_function(&fname).map_err(|e| dev_err(&format!("kernel {fname}"), e))?;
                    fs.push((fname, f));
                }
                Ok((module, fs))
            });
            match loaded {
                Ok((module, fs)) => {
                    funcs.extend(fs);
                    modules.push(module);
                }
                Err(e) if optional => failed.push((name.to_string(), e.to_string())),
                Err(e) => return Err(e),
            }
        }
        Ok(Kernels { funcs, _modules: modules, failed, compile_s, forced, half })
    }

    pub fn get(&self, name: &str) -> Result<&CudaFunction, BackendError> {
        self.funcs.get(name).ok_or_else(|| {
            let why: Vec<String> = self.failed.iter().map(|(f, e)| format!("{f}: {e}")).collect();
            if why.is_empty() {
                BackendError::Device(format!("kernel {name} not found in the compiled modules"))
            } else {
                BackendError::Device(format!("kernel {name} not found; optional modules that failed: {}", why.join("; ")))
            }
        })
    }

}

/// Names of the `extern "C" __global__ void NAME(` functions in a source file (an optional
/// `__launch_bounds__(…)` before the name is skipped). Kernels stamped out by the
/// `LN_INSTANCE(J)`, `LNV_INSTANCE(J)` and `LNV_KERNELS(J, …)` macros are listed from their uses.
fn kernel_names(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    for part in src.split("__global__ void ").skip(1) {
        let mut part = part.trim_start();
        if let Some(rest) = part.strip_prefix("__launch_bounds__") {
            match rest.find(')') {
                Some(close) => part = rest[close + 1..].trim_start(),
                None => continue,
            }
        }
        if let Some(end) = part.find('(') {
            let name = part[..end].trim();
            if !name.contains('#') && !name.is_empty() {
                out.push(name.to_string());
            }
        }
    }
    // (LNV_KERNELS(J, FB, BB): the vectorized pair with its blocks per SM spelled out)
    for (mac, suffix) in [("LN_INSTANCE(", "c"), ("LNV_INSTANCE(", "v"), ("LNV_KERNELS(", "v")] {
        for part in src.split(mac).skip(1) {
            if let Some(end) = part.find([')', ',']) {
                if let Ok(j) = part[..end].trim().parse::<u32>() {
                    out.push(format!("layernorm_fwd_{suffix}{j}"));
                    out.push(format!("layernorm_bwd_{suffix}{j}"));
                }
            }
        }
    }
    // LNS_INSTANCE(J) and LNS_KERNEL(J, …): the LayerNorm backward that also sums dinp's
    // columns (no forward)
    for mac in ["LNS_INSTANCE(", "LNS_KERNEL("] {
        for part in src.split(mac).skip(1) {
            if let Some(end) = part.find([')', ',']) {
                if let Ok(j) = part[..end].trim().parse::<u32>() {
                    out.push(format!("layernorm_bwd_s{j}"));
                }
            }
        }
    }
    // FA_PIPE(D) in flash.cu: the tiled forward, backward and delta pass for head dim D
    for part in src.split("\nFA_PIPE(").skip(1) {
        if let Some(end) = part.find(')') {
            if let Ok(d) = part[..end].trim().parse::<u32>() {
                out.push(format!("flash_fwd_d{d}_pipe"));
                out.push(format!("flash_fwd_d{d}_pipe128"));
                out.push(format!("flash_bwd_d{d}_pipe"));
                out.push(format!("flash_bwd_pre_d{d}"));
            }
        }
    }
    // FA_SMALL(D, W) in flash.cu: the small-head forward and backward for head dim D, W warps
    for part in src.split("\nFA_SMALL(").skip(1) {
        if let Some(end) = part.find(')') {
            let dw: Vec<Option<u32>> = part[..end].split(',').map(|v| v.trim().parse().ok()).collect();
            if let [Some(d), Some(w)] = dw[..] {
                out.push(format!("flash_fwd_small_d{d}_w{w}"));
                out.push(format!("flash_bwd_small_d{d}_w{w}"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volta_under_nvrtc_13_says_where_to_get_nvrtc_12() {
        let h = unsupported_arch_hint("sm_70", Some((13, 0))).unwrap();
        assert!(h.contains("NVRTC 13.0") && h.contains("sm_70") && h.contains("libnvrtc.so.12"), "{h}");
        assert_eq!(unsupported_arch_hint("sm_70", Some((12, 9))), None);
        assert_eq!(unsupported_arch_hint("sm_75", Some((13, 0))), None);
        assert!(unsupported_arch_hint("compute_72", Some((13, 1))).is_some());
    }

    #[test]
    fn capability_of_architecture_names() {
        assert_eq!(capability_of("compute_75"), Some((7, 5)));
        assert_eq!(capability_of("sm_80"), Some((8, 0)));
        assert_eq!(capability_of("sm_90"), Some((9, 0)));
        assert_eq!(capability_of("sm_100"), Some((10, 0)));
        for bad in ["sm_", "sm_7", "75", "compute_7x", "sm_75a"] {
            assert_eq!(capability_of(bad), None, "{bad}");
        }
    }

    /// Every listed name must be a plain identifier (a launch-bounds attribute once came back as
    /// a kernel name, and every module load then failed on the device), and the launch sites'
    /// kernels must all be listed.
    #[test]
    fn kernel_names_are_identifiers_and_complete() {
        let mut all = Vec::new();
        for (_, src) in SOURCES.iter().chain(OPTIONAL.iter()).chain(HOPPER.iter()) {
            for n in kernel_names(src) {
                assert!(!n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') && !n.starts_with("__"), "bad kernel name {n:?}");
                all.push(n);
            }
        }
        for want in ["layernorm_fwd_v24", "layernorm_bwd_v24", "layernorm_bwd_v40", "layernorm_fwd_v44", "layernorm_fwd_v32", "layernorm_fwd_v40", "layernorm_bwd_v44", "flash_dq_store_sums", "layernorm_bwd_v12", "layernorm_fwd_c24", "layernorm_bwd_c3",
                     "gelu_fwd_v8", "gelu_bwd_v8", "add_v8", "bias_grad_v8", "reduce_partials_batch", "add_kernel",
                     "flash_fwd_small_d64_w5", "flash_bwd_small_d32_w4", "flash_fwd_d64_pipe", "flash_fwd_d80_pipe", "flash_fwd_d128_pipe128", "flash_bwd_d128_pipe", "flash_bwd_pre_d96", "layernorm_bwd_s12", "layernorm_bwd_s24", "layernorm_bwd_s32", "layernorm_bwd_s40", "layernorm_bwd_s44", "gelu_fwd_bias_v8",
                     "gemm_gelu_fwd_ws", "gemm_dgelu_bwd_ws", "gemm_gelu_fwd_grad_ws_w", "gemm_dgelu_mul_ws_w", "gemm_gelu_fwd_ws_w4", "gemm_gelu_fwd_grad_ws_w4", "gemm_dgelu_bwd_ws_w4", "gemm_dgelu_mul_ws_w4", "embed_fwd_v8", "embed_bwd_params_part", "pool_bwd_v8", "patchify_v8", "flash_fwd_wg_d64", "flash_bwd_wg_d64", "flash_fwd_wg_long_d64", "flash_fwd_wg_long_d80", "flash_bwd_wg_long_d64", "flash_bwd_wg_long_d80", "gemm_wgrad_tt", "flash_bwd_small_d64_w13",
                     "class_attention_fwd", "class_attention_bwd", "flash_bwd_pre_fold_d64_r1", "flash_bwd_pre_fold_d80_r2", "flash_fold_keys_store", "adam_kernel", "class_attention_fwd_v8", "class_attention_bwd_v8", "add_class_rows_v8"] {
            assert!(all.iter().any(|n| n == want), "{want} not listed");
        }
        let mod_rs = include_str!("mod.rs");
        for pat in ["self.launch1(\"", "self.launch(\""] {
            for part in mod_rs.split(pat).skip(1) {
                if let Some(end) = part.find('"') {
                    let name = &part[..end];
                    if !name.contains('{') {
                        assert!(all.iter().any(|n| n == name), "launched kernel {name} is not listed");
                    }
                }
            }
        }
    }
}
