//! Finding the CUDA libraries at run time, so a binary built without CUDA runs wherever a
//! driver and the pip or toolkit libraries are present.
//!
//! `cudarc` (dynamic loading) opens libraries by bare name (`libcublasLt.so.13`, …) and panics
//! when none loads. We first try the same bare names; for each library that the loader cannot
//! find on its own we search the usual places (pip wheels `site-packages/nvidia/cu13/lib`,
//! `nvidia/cublas/lib`, `nvidia/cuda_nvrtc/lib`, `nvidia/nccl/lib`, conda, `/usr/local/cuda*`,
//! and `VITSCALE_CUDA_LIB_DIR`) and open the file there by its full path with `RTLD_GLOBAL`.
//! The dynamic loader then matches cudarc's later bare-name `dlopen` against the already loaded
//! library's soname, so cudarc uses it. Failures are values naming the library, never panics.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// One library cudarc needs: what it is for, cudarc's presence check, file names to look for,
/// and how a user gets it.
struct Lib {
    what: &'static str,
    present: unsafe fn() -> bool,
    files: &'static [&'static str],
    remedy: &'static str,
}

const LIBS: &[Lib] = &[
    Lib { what: "libcuda.so.1 (the NVIDIA driver)", present: cudarc::driver::sys::is_culib_present, files: &["libcuda.so.1", "libcuda.so"], remedy: "install the NVIDIA driver (in a container: run it with the GPU runtime, which mounts the driver's libraries)" },
    Lib { what: "libnvrtc.so.13 (NVRTC, compiles the kernels)", present: cudarc::nvrtc::sys::is_culib_present, files: &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"], remedy: "install the CUDA toolkit or `pip install nvidia-cuda-nvrtc`" },
    Lib { what: "libcublasLt.so.13 (cuBLASLt, the GEMMs)", present: cudarc::cublaslt::sys::is_culib_present, files: &["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"], remedy: "install the CUDA toolkit or `pip install nvidia-cublas`" },
];

/// The hardware work queues a CUDA context gets (`CUDA_DEVICE_MAX_CONNECTIONS`) when the user
/// sets none: 32, the most the driver allows, instead of its default 8. Streams share the queues
/// round-robin, and work behind another stream's work in the same queue waits for it. nvJPEG's
/// hardware decoder makes streams of its own; with 8 queues one of them shares the compute
/// stream's queue, and each batched decode waits for the whole queued training step instead
/// of running beside it. With 32 it runs beside the step.
pub const HARDWARE_QUEUES: &str = "32";

/// Sets `CUDA_DEVICE_MAX_CONNECTIONS` to [`HARDWARE_QUEUES`] unless the user set it. The driver
/// reads it when it starts, so this must run before any CUDA call and, since it changes the
/// process environment, while the process has one thread: at the top of `main`.
pub fn request_hardware_queues() {
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", HARDWARE_QUEUES);
    }
}

/// The warning for a run that decodes images on the GPU under `CUDA_DEVICE_MAX_CONNECTIONS`
/// = `value` (the environment's, which [`request_hardware_queues`] keeps): with fewer than 16
/// queues nvJPEG's streams may share the compute stream's (8 and fewer were measured to), and
/// each batched decode then waits for the whole queued step.
pub fn hardware_queue_warning(value: Option<&str>) -> Option<String> {
    let v = value?;
    match v.trim().parse::<u32>() {
        Ok(n) if n >= 16 => None,
        _ => Some(format!(
            "data.decode = gpu with CUDA_DEVICE_MAX_CONNECTIONS={v} in the environment: with fewer than 16 hardware queues the GPU decode waits for each queued training step instead of running beside it (docs/data.md); unset it (vitscale then uses {HARDWARE_QUEUES}) or set 16 to 32"
        )),
    }
}

/// Directories that may hold CUDA libraries, most specific first.
pub fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Ok(v) = std::env::var("VITSCALE_CUDA_LIB_DIR") {
        dirs.extend(std::env::split_paths(&v));
    }
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Ok(v) = std::env::var(var) {
            prefixes.push(PathBuf::from(v));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    for p in ["/opt/torch/.venv", "/usr/local", "/usr", "/opt/conda"] {
        prefixes.push(PathBuf::from(p));
    }
    // Every lib/python3*/site-packages/nvidia/<pkg>/lib under each prefix.
    for prefix in &prefixes {
        for libdir in ["lib", "lib64"] {
            let Ok(entries) = std::fs::read_dir(prefix.join(libdir)) else { continue };
            for e in entries.flatten() {
                let name = e.file_name();
                if !name.to_string_lossy().starts_with("python3") {
                    continue;
                }
                for site in ["site-packages", "dist-packages"] {
                    let nv = e.path().join(site).join("nvidia");
                    for pkg in ["cu13", "cu12", "cublas", "cuda_nvrtc", "cuda_runtime", "nccl", "nvjpeg"] {
                        let d = nv.join(pkg).join("lib");
                        if d.is_dir() {
                            dirs.push(d);
                        }
                    }
                }
            }
        }
        if prefix.join("lib").is_dir() && std::env::var_os("CONDA_PREFIX").map(PathBuf::from).as_deref() == Some(prefix.as_path()) {
            dirs.push(prefix.join("lib"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    if let Ok(entries) = std::fs::read_dir("/usr/local") {
        let mut cuda: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("cuda-")))
            .map(|p| p.join("lib64"))
            .collect();
        cuda.sort();
        cuda.reverse();
        dirs.extend(cuda);
    }
    for d in ["/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/wsl/lib"] {
        dirs.push(PathBuf::from(d));
    }
    dirs.retain(|d| d.is_dir());
    dirs.dedup();
    dirs
}

/// Opens `path` globally and keeps it loaded for the life of the process.
fn preload(path: &Path) -> Result<(), String> {
    // SAFETY: loading a vendor library runs its initializers; these are the CUDA libraries
    // cudarc would load anyway. RTLD_GLOBAL makes later bare-name dlopens match its soname.
    let lib = unsafe {
        libloading::os::unix::Library::open(Some(path), libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL)
    }
    .map_err(|e| format!("{}: {e}", path.display()))?;
    std::mem::forget(lib);
    Ok(())
}

fn load_all() -> Result<(), String> {
    let mut dirs: Option<Vec<PathBuf>> = None;
    for lib in LIBS {
        // SAFETY: cudarc's check only dlopens candidate names and drops the handle.
        if unsafe { (lib.present)() } {
            continue;
        }
        let dirs = dirs.get_or_insert_with(candidate_dirs);
        let mut tried = Vec::new();
        'search: for d in dirs.iter() {
            for f in lib.files {
                let p = d.join(f);
                if p.exists() {
                    // NVRTC loads its builtins library by name from its own directory.
                    if f.starts_with("libnvrtc") {
                        if let Ok(entries) = std::fs::read_dir(d) {
                            for e in entries.flatten() {
                                if e.file_name().to_string_lossy().starts_with("libnvrtc-builtins.so") {
                                    let _ = preload(&e.path());
                                }
                            }
                        }
                    }
                    match preload(&p) {
                        Ok(()) => break 'search,
                        Err(e) => tried.push(e),
                    }
                }
            }
        }
        // SAFETY: as above.
        if !unsafe { (lib.present)() } {
            let searched: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
            return Err(format!(
                "cannot load {}: not on the loader path and not found in [{}]{}; {}, or set \
                 VITSCALE_CUDA_LIB_DIR or LD_LIBRARY_PATH to the folder that holds it",
                lib.what,
                searched.join(", "),
                if tried.is_empty() { String::new() } else { format!(" (failed: {})", tried.join("; ")) },
                lib.remedy
            ));
        }
    }
    Ok(())
}

/// Makes the driver, NVRTC and cuBLASLt loadable by cudarc, once per process. Never panics.
pub fn ensure_loaded() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| std::panic::catch_unwind(load_all).unwrap_or_else(|_| Err("loading the CUDA libraries panicked".into())))
        .clone()
}

/// Opens the first library file named in `names` — by bare name (the loader's search path),
/// then in each of [`candidate_dirs`] — that exports every symbol in `symbols`, and returns it
/// with the symbols' addresses in order (a file lacking one is skipped: an older version).
/// The error lists every file tried and why it was not taken.
pub fn open_with_symbols(names: &[&str], symbols: &[&str]) -> Result<(libloading::Library, Vec<*const std::ffi::c_void>), Vec<String>> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = names.iter().map(PathBuf::from).collect();
    for d in candidate_dirs() {
        candidates.extend(names.iter().map(|n| d.join(n)).filter(|p| p.exists()));
    }
    for path in candidates {
        // SAFETY: opening a vendor library runs its initializers, as any user of it does.
        let lib = match unsafe { libloading::Library::new(&path) } {
            Ok(l) => l,
            Err(e) => {
                tried.push(format!("{}: {e}", path.display()));
                continue;
            }
        };
        // SAFETY: looking up exported symbols by name; the caller uses each address only as
        // the function its header declares under that name, while `lib` stays loaded.
        let found = symbols
            .iter()
            .map(|name| unsafe { lib.get::<*const std::ffi::c_void>(name.as_bytes()) }.map(|s| *s).map_err(|e| format!("{}: {name}: {e}", path.display())))
            .collect::<Result<Vec<_>, String>>();
        match found {
            Ok(addrs) => return Ok((lib, addrs)),
            Err(e) => tried.push(e),
        }
    }
    Err(tried)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_few_hardware_queues_for_the_gpu_decode_are_warned() {
        // unset: vitscale's own 32 applies
        assert_eq!(hardware_queue_warning(None), None);
        for ok in ["16", "32", " 24 "] {
            assert_eq!(hardware_queue_warning(Some(ok)), None, "{ok}");
        }
        for low in ["1", "8", "15", "", "many"] {
            let w = hardware_queue_warning(Some(low)).unwrap_or_default();
            assert!(w.contains(&format!("CUDA_DEVICE_MAX_CONNECTIONS={low} ")) && w.contains("data.decode = gpu"), "{low}: {w}");
        }
    }
}
