//! Small shared helpers: atomic file writes, scoped signal handlers.

use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, fsync, rename,
/// then fsync of the directory, so a reader sees the old file or the whole new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir)?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    if let Ok(d) = std::fs::File::open(&dir) {
        let _ = d.sync_all(); // best effort: some filesystems refuse fsync on directories
    }
    Ok(())
}

/// Signal handlers installed for as long as this value lives; the previous actions come back
/// when it is dropped (a launcher or a training run may live inside a test process).
pub struct SignalHandlers {
    old: Vec<(libc::c_int, libc::sigaction)>,
}

impl SignalHandlers {
    /// Installs `handler` for each of `signals`. The handler must be async-signal-safe (ours
    /// only store to atomics). Signals whose action cannot be changed are left as they were.
    pub fn install(signals: &[libc::c_int], handler: extern "C" fn(libc::c_int)) -> Self {
        let mut old = Vec::new();
        for &sig in signals {
            // SAFETY: sigaction with a zeroed struct naming an async-signal-safe handler; the
            // previous action is saved for `drop` to restore.
            unsafe {
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = handler as *const () as libc::sighandler_t;
                act.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut act.sa_mask);
                let mut prev: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(sig, &act, &mut prev) == 0 {
                    old.push((sig, prev));
                }
            }
        }
        SignalHandlers { old }
    }
}

impl Drop for SignalHandlers {
    fn drop(&mut self) {
        for (sig, prev) in &self.old {
            // SAFETY: restores the action saved by `install`.
            unsafe {
                libc::sigaction(*sig, prev, std::ptr::null_mut());
            }
        }
    }
}
