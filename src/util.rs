//! Small shared helpers: atomic file writes, scoped signal handlers, the median, POSIX shell
//! quoting, printing to a stdout whose reader may have gone (`outln!`), and the allocator the
//! binary uses (the system's, with a clear exit when memory runs out).

use std::io::Write;
use std::path::Path;

/// The median of `v` (the mean of the middle two for an even count); None when empty.
pub fn median(v: &[f64]) -> Option<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    (n > 0).then(|| if n % 2 == 1 { s[n / 2] } else { 0.5 * (s[n / 2 - 1] + s[n / 2]) })
}

/// Quotes for a POSIX shell: `'...'`, with embedded quotes closed, escaped and reopened.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_./=:,@%+".contains(&b)) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Writes formatted text to stdout. A reader that closed the pipe (`vitscale … | head -1`)
/// is not an error for the work that printed: the text is dropped and the command goes on
/// (Rust's `println!` panics there). Any other write error is reported once on stderr.
pub fn write_stdout(args: std::fmt::Arguments) {
    use std::sync::atomic::{AtomicBool, Ordering};
    static REPORTED: AtomicBool = AtomicBool::new(false);
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        if e.kind() != std::io::ErrorKind::BrokenPipe && !REPORTED.swap(true, Ordering::Relaxed) {
            let _ = writeln!(std::io::stderr(), "warning: cannot write to stdout: {e}");
        }
    }
}

/// Writes formatted text to stderr, dropping it when stderr cannot take it (`… 2>&1 | head`):
/// progress lines must not end the work they report on (`eprintln!` panics there).
pub fn write_stderr(args: std::fmt::Arguments) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| err.flush());
}

/// `eprintln!` through `util::write_stderr`: a closed stderr is not a panic.
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => { $crate::util::write_stderr(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `println!` through `util::write_stdout`: a closed stdout is not a panic.
#[macro_export]
macro_rules! outln {
    () => { $crate::util::write_stdout(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::util::write_stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `print!` through `util::write_stdout`.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::util::write_stdout(format_args!($($arg)*)) };
}

/// `n` and the noun, singular for one: `plural(1, "rank", "ranks")` is "1 rank".
pub fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// `x` with `sig` significant digits (at least one decimal when |x| < 10^sig), so a small
/// model's 0.016 GFLOP does not print as "0.0".
pub fn fmt_sig(x: f64, sig: usize) -> String {
    if x == 0.0 || !x.is_finite() {
        return format!("{x}");
    }
    let digits = x.abs().log10().floor() as i64 + 1;
    let decimals = (sig as i64 - digits).max(0) as usize;
    format!("{x:.decimals$}")
}

/// This process's peak resident memory so far, in GiB (Linux's `ru_maxrss`, KiB); None where
/// the call fails.
pub fn peak_rss_gib() -> Option<f64> {
    // SAFETY: getrusage writes into the zeroed struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    (rc == 0 && ru.ru_maxrss > 0).then(|| ru.ru_maxrss as f64 * 1024.0 / (1u64 << 30) as f64)
}

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

/// The system allocator, except that an allocation the system refuses (`ulimit -v`, an
/// exhausted machine) ends the process with a one-line error and exit status 1 instead of an
/// abort (status 134) with Rust's bare "memory allocation failed". The memory estimate
/// (`train::memory`) refuses runs that cannot fit before they start; this catches what it
/// cannot foresee. The message is written without allocating.
pub struct ReportingAlloc;

// SAFETY: every call forwards to `System` with the same arguments; only a null result is
// acted on, and then the process ends.
unsafe impl std::alloc::GlobalAlloc for ReportingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { std::alloc::System.alloc(layout) };
        if p.is_null() {
            out_of_memory(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { std::alloc::System.alloc_zeroed(layout) };
        if p.is_null() {
            out_of_memory(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: same contract as ours.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { std::alloc::System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            out_of_memory(new_size);
        }
        p
    }
}

/// Writes the out-of-memory error to stderr (no allocation: a stack buffer) and exits with 1.
fn out_of_memory(size: usize) -> ! {
    let mut buf = [0u8; 320];
    let mut len = 0;
    let mut put = |bytes: &[u8]| {
        for &b in bytes {
            if len < buf.len() {
                buf[len] = b;
                len += 1;
            }
        }
    };
    put(b"error: out of memory: an allocation of ");
    let mut digits = [0u8; 20];
    let (mut n, mut i) = (size, digits.len());
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    put(&digits[i..]);
    put(b" bytes failed (available RAM or `ulimit -v`); lower train_micro_batch_size_per_gpu, train.pass_images or the model size\n");
    // SAFETY: writes our own buffer to fd 2, then ends the process without unwinding.
    unsafe {
        libc::write(2, buf.as_ptr().cast(), len);
        libc::_exit(1)
    }
}
