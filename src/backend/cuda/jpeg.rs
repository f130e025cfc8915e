//! GPU image decode (`data.decode = "gpu"`): nvJPEG decodes a batch's JPEGs on the device, then
//! three kernels (`kernels/image.cu`) resample each crop to S × S with PIL's antialiased filter,
//! flip and normalize into the model's input — what `data::resize` does on the CPU.
//!
//! nvJPEG is opened at run time like the other CUDA libraries (`libs::candidate_dirs`). Two
//! decoders: the hardware one (the JPEG engines of A100/H100/H200-class GPUs,
//! `NVJPEG_BACKEND_HARDWARE`, one batched call) when the GPU has engines, and the default
//! hybrid one (Huffman decoding on the calling thread, the rest on the GPU) for GPUs without
//! them and for the JPEGs the engines refuse (progressive, some subsamplings): a batch the
//! hardware call rejects is decoded image by image with the hybrid decoder, and an image that
//! decoder rejects too is decoded on the CPU (zune-jpeg) and copied up; one that nobody can
//! decode is an error naming its file. Images the loader already decoded (PNG, WebP) are
//! copied up as they are.
//!
//! With `VITSCALE_NVJPEG_ROI=on` the engines decode only each crop's window (the source rows
//! and columns its filter reads, `crop_window`), through `nvjpegDecodeBatchedEx` with a region
//! per image, and the image's job moves into the window's coordinates (`ImageJob::in_window`).
//! A library without that call, or a batch the engines refuse so, is decoded whole as before.
//! It is off by default: on an H100 it trained no faster than whole images (BENCHMARKS.md).
//!
//! Everything runs on a stream of its own, at the device's highest priority, so it overlaps
//! the compute stream's step and its few kernels are not queued behind the step's; the final
//! kernel waits for the event that says the previous forward has read the input buffer, and
//! the compute stream waits for the decode only where it first reads the input (`patchify`)
//! or synchronizes (`order_decoded_input`), so the step still queued ahead of it runs on. The
//! calling thread only lays the batch out and copies it into one of two pinned arenas (a
//! pageable source would make each copy wait for the stream; an arena is refilled only after
//! the decode that read it); the nvJPEG calls and the launches are made by a thread of their own
//! (`DecodeThread`), because nvJPEG's batched hardware call holds its thread while the
//! engines decode, and the training thread must go on launching the step meanwhile.
//!
//! With `VITSCALE_DECODE_AHEAD=on` (off by default: on an H100 it trained no faster than the
//! plain path, BENCHMARKS.md) the trainer starts the batch after next
//! (`decode_ahead`, DALI's prefetch depth of 2): a thread of its own lays it out from copies of
//! its images, decodes it and enqueues everything up to the last pass, the one that writes the
//! model's input, while the calling thread returns at once. When the batch is staged
//! (`decode_input` of the same images), that pass is enqueued by the thread if it is still
//! running, else by the caller (`Handoff`), and the compute stream waits for it only where the
//! forward reads the batch: nvJPEG's call, whose time varies from batch to batch, has two steps
//! to finish before the training thread waits for it. The decode threads take the decoder in
//! the order they were started (`Finished`). One set of device buffers serves both ways: a
//! batch's last pass is enqueued, or the batch dropped, before the next batch's decode is, so
//! the decode stream orders every read and write of the rows, taps and table, and nvJPEG's own
//! writes wait for `pixels_read` as above. The
//! process asks for 32 hardware queues (`libs::request_hardware_queues`): with the driver's
//! default 8, nvJPEG's streams share the compute stream's queue and each batched call also
//! waits for the whole queued step.
//! nvJPEG's own device and pinned buffers come from caching allocators: its default ones call
//! `cudaFree`/`cudaFreeHost`, which wait for the whole device, step included.

use std::ffi::{c_int, c_uint, c_void};

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::result as dr;
use cudarc::driver::sys::{CUevent, CUstream};
use cudarc::driver::CudaStream;

use super::device::{dev, kargs, CudaBuf, THREADS};
use super::gemm::Ty;
use super::options::{choose, env, ON_OFF};
use super::{libs, Cuda};
use crate::backend::{BResult, BackendError};
use crate::core::encoded::{EncodedBatch, Encoding};

type Handle = *mut c_void;
type State = *mut c_void;
type Params = *mut c_void;

/// `nvjpegImage_t`: up to 4 channel planes and their pitches; interleaved RGB uses plane 0.
#[repr(C)]
#[derive(Clone, Copy)]
struct NvImage {
    channel: [*mut u8; 4],
    pitch: [usize; 4],
}

const BACKEND_DEFAULT: c_int = 0;
const BACKEND_GPU_HYBRID: c_int = 2;
const BACKEND_HARDWARE: c_int = 3;
const OUTPUT_RGBI: c_int = 5;
const CSS_420: c_int = 2;

/// nvJPEG's status codes, named (nvjpeg.h).
fn status_name(s: c_int) -> &'static str {
    match s {
        1 => "NOT_INITIALIZED",
        2 => "INVALID_PARAMETER",
        3 => "BAD_JPEG",
        4 => "JPEG_NOT_SUPPORTED",
        5 => "ALLOCATOR_FAILURE",
        6 => "EXECUTION_FAILED",
        7 => "ARCH_MISMATCH",
        8 => "INTERNAL_ERROR",
        9 => "IMPLEMENTATION_NOT_SUPPORTED",
        10 => "INCOMPLETE_BITSTREAM",
        _ => "unknown status",
    }
}

fn check(what: &str, s: c_int) -> Result<(), String> {
    match s {
        0 => Ok(()),
        _ => Err(format!("{what}: nvJPEG status {s} ({})", status_name(s))),
    }
}

/// The nvJPEG entry points used here (signatures from nvjpeg.h, CUDA 12 and 13).
struct Api {
    create_ex: unsafe extern "C" fn(c_int, *mut c_void, *mut c_void, c_uint, *mut Handle) -> c_int,
    destroy: unsafe extern "C" fn(Handle) -> c_int,
    state_create: unsafe extern "C" fn(Handle, *mut State) -> c_int,
    state_destroy: unsafe extern "C" fn(State) -> c_int,
    decode: unsafe extern "C" fn(Handle, State, *const u8, usize, c_int, *mut NvImage, CUstream) -> c_int,
    batched_init: unsafe extern "C" fn(Handle, State, c_int, c_int, c_int) -> c_int,
    batched: unsafe extern "C" fn(Handle, State, *const *const u8, *const usize, *mut NvImage, CUstream) -> c_int,
    hw_info: unsafe extern "C" fn(Handle, *mut c_uint, *mut c_uint) -> c_int,
    /// `nvjpegDecodeBatchedPreAllocate` (CUDA 11.6 on; absent in older libraries).
    pre_allocate: Option<unsafe extern "C" fn(Handle, State, c_int, c_int, c_int, c_int, c_int) -> c_int>,
    /// The batched call with a region per image, where the library has it.
    roi: Option<RoiApi>,
    _lib: libloading::Library,
}

/// `nvjpegDecodeBatchedEx` and the decode-parameter calls it takes (nvjpeg.h).
struct RoiApi {
    batched_ex: unsafe extern "C" fn(Handle, State, *const *const u8, *const usize, *mut NvImage, *mut Params, CUstream) -> c_int,
    params_create: unsafe extern "C" fn(Handle, *mut Params) -> c_int,
    params_destroy: unsafe extern "C" fn(Params) -> c_int,
    set_output_format: unsafe extern "C" fn(Params, c_int) -> c_int,
    set_roi: unsafe extern "C" fn(Params, c_int, c_int, c_int, c_int) -> c_int,
}

const NAMES: [&str; 3] = ["libnvjpeg.so.13", "libnvjpeg.so.12", "libnvjpeg.so"];

fn open_api() -> Result<Api, String> {
    let symbols = [
        "nvjpegCreateEx", "nvjpegDestroy", "nvjpegJpegStateCreate", "nvjpegJpegStateDestroy", "nvjpegDecode",
        "nvjpegDecodeBatchedInitialize", "nvjpegDecodeBatched", "nvjpegGetHardwareDecoderInfo",
    ];
    let (lib, p) = libs::open_with_symbols(&NAMES, &symbols).map_err(|tried| {
        format!(
            "data.decode = \"gpu\": cannot load libnvjpeg.so.13 (nvJPEG): not on the loader path and not found in the CUDA library folders ({}); install the CUDA toolkit or `pip install nvidia-nvjpeg-cu13`, set VITSCALE_CUDA_LIB_DIR to the folder that holds it, or use data.decode = \"cpu\"",
            if tried.is_empty() { "no candidate file".to_string() } else { tried.join("; ") }
        )
    })?;
    // SAFETY: the symbol, where the library has it, is nvjpegDecodeBatchedPreAllocate with
    // this nvjpeg.h signature; the pointer is used only while `lib` stays loaded (below).
    let pre_allocate = unsafe { lib.get::<unsafe extern "C" fn(Handle, State, c_int, c_int, c_int, c_int, c_int) -> c_int>(b"nvjpegDecodeBatchedPreAllocate\0") }.ok().map(|f| *f);
    // SAFETY: as above, each symbol with its nvjpeg.h signature; all five or none.
    let roi = unsafe {
        let ex = lib.get::<unsafe extern "C" fn(Handle, State, *const *const u8, *const usize, *mut NvImage, *mut Params, CUstream) -> c_int>(b"nvjpegDecodeBatchedEx\0").ok().map(|f| *f);
        let create = lib.get::<unsafe extern "C" fn(Handle, *mut Params) -> c_int>(b"nvjpegDecodeParamsCreate\0").ok().map(|f| *f);
        let destroy = lib.get::<unsafe extern "C" fn(Params) -> c_int>(b"nvjpegDecodeParamsDestroy\0").ok().map(|f| *f);
        let format = lib.get::<unsafe extern "C" fn(Params, c_int) -> c_int>(b"nvjpegDecodeParamsSetOutputFormat\0").ok().map(|f| *f);
        let set_roi = lib.get::<unsafe extern "C" fn(Params, c_int, c_int, c_int, c_int) -> c_int>(b"nvjpegDecodeParamsSetROI\0").ok().map(|f| *f);
        match (ex, create, destroy, format, set_roi) {
            (Some(batched_ex), Some(params_create), Some(params_destroy), Some(set_output_format), Some(set_roi)) => Some(RoiApi { batched_ex, params_create, params_destroy, set_output_format, set_roi }),
            _ => None,
        }
    };
    // SAFETY: each address is the named nvJPEG function, transmuted to its nvjpeg.h type;
    // `lib` moves into the table that keeps it loaded.
    Ok(unsafe {
        Api {
            create_ex: std::mem::transmute::<*const c_void, _>(p[0]),
            destroy: std::mem::transmute::<*const c_void, _>(p[1]),
            state_create: std::mem::transmute::<*const c_void, _>(p[2]),
            state_destroy: std::mem::transmute::<*const c_void, _>(p[3]),
            decode: std::mem::transmute::<*const c_void, _>(p[4]),
            batched_init: std::mem::transmute::<*const c_void, _>(p[5]),
            batched: std::mem::transmute::<*const c_void, _>(p[6]),
            hw_info: std::mem::transmute::<*const c_void, _>(p[7]),
            pre_allocate,
            roi,
            _lib: lib,
        }
    })
}

/// `nvjpegDevAllocator_t` and `nvjpegPinnedAllocator_t`.
#[repr(C)]
struct DevAllocator {
    malloc: extern "C" fn(*mut *mut c_void, usize) -> c_int,
    free: extern "C" fn(*mut c_void) -> c_int,
}

#[repr(C)]
struct PinnedAllocator {
    malloc: extern "C" fn(*mut *mut c_void, usize, c_uint) -> c_int,
    free: extern "C" fn(*mut c_void) -> c_int,
}

/// Blocks nvJPEG has freed, each reusable once the event recorded at its free (on the decode
/// stream, where nvJPEG's work on it was queued) has completed; `sizes` of every block made.
#[derive(Default)]
struct Pool {
    free: Vec<(usize, usize, CUevent)>,
    sizes: HashMap<usize, usize>,
}

// SAFETY: a CUevent is a handle the driver lets any thread of the process use.
unsafe impl Send for Pool {}

static DEVICE_POOL: Mutex<Option<Pool>> = Mutex::new(None);
static PINNED_POOL: Mutex<Option<Pool>> = Mutex::new(None);
/// The decode stream, for the events the allocators record (one decoder per process).
static DECODE_STREAM: AtomicU64 = AtomicU64::new(0);

/// A cached block of at least `size` bytes (at most twice that) whose last use is over.
fn take_cached(pool: &Mutex<Option<Pool>>, size: usize) -> Option<usize> {
    let mut g = pool.lock().ok()?;
    let p = g.get_or_insert_with(Pool::default);
    let mut best: Option<usize> = None;
    for (k, &(_, sz, ev)) in p.free.iter().enumerate() {
        // SAFETY: a live event created by `put_back`.
        let done = unsafe { dr::event::query(ev) }.is_ok();
        if done && sz >= size && sz <= size.saturating_mul(2) && best.is_none_or(|b| p.free[b].1 > sz) {
            best = Some(k);
        }
    }
    let (ptr, _, ev) = p.free.swap_remove(best?);
    // SAFETY: the event is ours and no longer waited on.
    let _ = unsafe { dr::event::destroy(ev) };
    Some(ptr)
}

fn put_back(pool: &Mutex<Option<Pool>>, ptr: usize) -> c_int {
    let Ok(mut g) = pool.lock() else { return 1 };
    let p = g.get_or_insert_with(Pool::default);
    let Some(&size) = p.sizes.get(&ptr) else { return 1 };
    let Ok(ev) = dr::event::create(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING) else { return 1 };
    let stream = DECODE_STREAM.load(Ordering::Relaxed) as CUstream;
    // SAFETY: a fresh event and the live decode stream.
    if unsafe { dr::event::record(ev, stream) }.is_err() {
        return 1;
    }
    p.free.push((ptr, size, ev));
    0
}

fn remember(pool: &Mutex<Option<Pool>>, ptr: usize, size: usize) {
    if let Ok(mut g) = pool.lock() {
        g.get_or_insert_with(Pool::default).sizes.insert(ptr, size);
    }
}

/// An allocation for nvJPEG: a cached block of `pool` when one fits and is free, else a fresh
/// one from `fresh` (remembered, so it returns to the pool when freed). 0 on success.
fn pool_malloc(pool: &Mutex<Option<Pool>>, out: *mut *mut c_void, size: usize, fresh: impl FnOnce(usize) -> Option<usize>) -> c_int {
    let size = size.max(256);
    let ptr = match take_cached(pool, size) {
        Some(p) => p,
        None => match fresh(size) {
            Some(p) => {
                remember(pool, p, size);
                p
            }
            None => return 1,
        },
    };
    // SAFETY: nvJPEG passes a valid out-pointer.
    unsafe { *out = ptr as *mut c_void };
    0
}

fn pool_free(pool: &Mutex<Option<Pool>>, ptr: *mut c_void) -> c_int {
    if ptr.is_null() {
        return 0;
    }
    put_back(pool, ptr as usize)
}

extern "C" fn dev_malloc(out: *mut *mut c_void, size: usize) -> c_int {
    // SAFETY: a plain device allocation in the current (the backend's) context.
    pool_malloc(&DEVICE_POOL, out, size, |n| unsafe { dr::malloc_sync(n) }.ok().map(|p| p as usize))
}

extern "C" fn dev_free(ptr: *mut c_void) -> c_int {
    pool_free(&DEVICE_POOL, ptr)
}

extern "C" fn pinned_malloc(out: *mut *mut c_void, size: usize, flags: c_uint) -> c_int {
    // SAFETY: a plain pinned host allocation.
    pool_malloc(&PINNED_POOL, out, size, |n| unsafe { dr::malloc_host(n, flags) }.ok().map(|p| p as usize))
}

extern "C" fn pinned_free(ptr: *mut c_void) -> c_int {
    pool_free(&PINNED_POOL, ptr)
}

static DEV_ALLOCATOR: DevAllocator = DevAllocator { malloc: dev_malloc, free: dev_free };
static PINNED_ALLOCATOR: PinnedAllocator = PinnedAllocator { malloc: pinned_malloc, free: pinned_free };

/// Pinned host memory the decode reads from: the table, the bitstreams, decoded images.
struct Arena {
    ptr: *mut u8,
    bytes: usize,
    /// Recorded after the last decode that read this arena.
    done: Option<cudarc::driver::CudaEvent>,
}

impl Arena {
    /// Room for `bytes`, once the decode that last read it is over.
    fn prepare(&mut self, bytes: usize) -> BResult<&mut [u8]> {
        if let Some(ev) = self.done.take() {
            ev.synchronize().map_err(dev("waiting for an earlier decode"))?;
        }
        if self.bytes < bytes {
            if !self.ptr.is_null() {
                // SAFETY: allocated below by malloc_host; its last reader is done (above).
                unsafe { dr::free_host(self.ptr as *mut c_void) }.map_err(dev("cuMemFreeHost"))?;
                self.ptr = std::ptr::null_mut();
                self.bytes = 0;
            }
            let want = bytes + bytes / 4;
            // SAFETY: a plain pinned allocation.
            self.ptr = unsafe { dr::malloc_host(want, 0) }.map_err(|e| BackendError::Device(format!("allocating {want} bytes of pinned memory for the decode: {e}")))? as *mut u8;
            self.bytes = want;
        }
        // SAFETY: `ptr` holds `self.bytes ≥ bytes` bytes that nothing else reads now.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, bytes) })
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if let Some(ev) = self.done.take() {
            let _ = ev.synchronize();
        }
        if !self.ptr.is_null() {
            // SAFETY: allocated by malloc_host, no longer read.
            let _ = unsafe { dr::free_host(self.ptr as *mut c_void) };
        }
    }
}

/// One nvJPEG handle and its decode state.
struct Decoder {
    handle: Handle,
    state: State,
}

impl Decoder {
    fn new(api: &Api, backend: c_int) -> Result<Decoder, String> {
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: out-pointer to a live handle; the allocators are the caching ones above.
        // nvJPEG keeps the allocator tables' function pointers; the tables are statics.
        let (d, p) = (&DEV_ALLOCATOR as *const DevAllocator as *mut c_void, &PINNED_ALLOCATOR as *const PinnedAllocator as *mut c_void);
        check("nvjpegCreateEx", unsafe { (api.create_ex)(backend, d, p, 0, &mut handle) })?;
        let mut state: State = std::ptr::null_mut();
        // SAFETY: `handle` was just created.
        if let Err(e) = check("nvjpegJpegStateCreate", unsafe { (api.state_create)(handle, &mut state) }) {
            // SAFETY: the handle is ours and unused.
            unsafe { (api.destroy)(handle) };
            return Err(e);
        }
        Ok(Decoder { handle, state })
    }

    fn free(&mut self, api: &Api) {
        // SAFETY: both were created by `new` and are destroyed once (the pointers are nulled).
        unsafe {
            if !self.state.is_null() {
                (api.state_destroy)(self.state);
            }
            if !self.handle.is_null() {
                (api.destroy)(self.handle);
            }
        }
        self.state = std::ptr::null_mut();
        self.handle = std::ptr::null_mut();
    }
}

/// One image's place in the decode buffers, as `kernels/image.cu`'s `ImageJob`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ImageJob {
    src: i64,
    w: i32,
    h: i32,
    x0: f32,
    y0: f32,
    cw: f32,
    ch: f32,
    flip: i32,
    row0: i32,
    rows: i32,
    kx: i32,
    tmp: i64,
    ky: i32,
    pad: i32,
    taps: i64,
}

/// The filter's reach in source pixels each side of an output's center, along an axis whose
/// window of `rlen` source pixels becomes `out` pixels: bilinear 1, bicubic 2, widened by the
/// downscale factor (the kernels' f32 formula).
fn filter_support(rlen: f32, out: usize, bicubic: bool) -> f32 {
    let fscale = (rlen / out as f32).max(1.0);
    if bicubic {
        2.0 * fscale
    } else {
        fscale
    }
}

/// Taps per output pixel along such an axis: the support each side and the center. Sizes the
/// tap table; the kernels never use more.
fn taps_per_output(rlen: f32, out: usize, bicubic: bool) -> usize {
    (filter_support(rlen, out, bicubic).ceil() as usize) * 2 + 1
}

/// The source rows the vertical filter reads for a crop starting at `r0` of `rlen` rows of an
/// image `len` rows high, resampled to `out` rows: (first, count), computed with the kernel's
/// f32 formulas and widened by a row each side against rounding differences.
fn row_range(len: usize, r0: f32, rlen: f32, out: usize, bicubic: bool) -> (usize, usize) {
    let scale = rlen / out as f32;
    let support = filter_support(rlen, out, bicubic);
    let n = taps_per_output(rlen, out, bicubic);
    let (mut lo_all, mut hi_all) = (usize::MAX, 0usize);
    for i in 0..out {
        let c = r0 + (i as f32 + 0.5) * scale;
        let lo = ((c - support).floor().max(0.0) as usize).min(len - 1);
        let hi = ((c + support).ceil().max(0.0) as usize).max(lo + 1).min(len).min(lo + n);
        lo_all = lo_all.min(lo);
        hi_all = hi_all.max(hi);
    }
    let lo = lo_all.saturating_sub(1);
    let hi = (hi_all + 1).min(len);
    (lo, hi - lo)
}

/// The window of a JPEG that a crop's filters read, `[x, y, width, height]` in source pixels:
/// the columns and rows `row_range` finds along each axis. None where the window is not
/// at least a tenth smaller than the image (a whole decode then costs about the same).
fn crop_window(width: usize, height: usize, crop: [f32; 4], side: usize, bicubic: bool) -> Option<[usize; 4]> {
    let (x, w) = row_range(width, crop[0], crop[2], side, bicubic);
    let (y, h) = row_range(height, crop[1], crop[3], side, bicubic);
    (10 * w * h <= 9 * width * height).then_some([x, y, w, h])
}

impl ImageJob {
    /// The job of the same crop of an image of which only `window` (`crop_window`) was
    /// decoded, with `pitch`-free rows of `window`'s width: the crop's origin, the image's
    /// size and the first row the vertical filter reads move into the window's coordinates.
    /// The window holds every pixel the filters read, so the clamps at the window's edges
    /// stand in for those at the image's edges. The crop's origin moves by whole pixels,
    /// exact in f32 below 2^24; the taps' centers are then summed from another origin and
    /// can differ from the whole image's by an f32 rounding step.
    fn in_window(&self, window: [usize; 4]) -> ImageJob {
        let [x, y, w, h] = window;
        ImageJob { w: w as i32, h: h as i32, x0: self.x0 - x as f32, y0: self.y0 - y as f32, row0: self.row0 - y as i32, ..*self }
    }
}

/// The decoders and the device buffers they reuse from batch to batch.
pub(super) struct JpegDecoder {
    api: Api,
    hardware: Option<Decoder>,
    hybrid: Decoder,
    /// Batch size the hardware decoder was last initialized for (0: must initialize).
    batched_for: usize,
    /// Whether the hardware decoder's memory pool was set up (`nvjpegDecodeBatchedPreAllocate`).
    pooled: bool,
    /// The decode stream (highest priority unless `VITSCALE_DECODE_PRIORITY=normal`).
    stream: Arc<CudaStream>,
    /// Decoded RGB8 images, one after another (bytes; allocated as bf16 words).
    pixels: Option<CudaBuf>,
    /// Recorded after the kernel that last read `pixels`. The hardware decoder writes its
    /// output while it is called, not in the order of the stream it is given, so a batched
    /// call first waits for this on the host: the previous batch's resampling may still be
    /// queued behind other work.
    pixels_read: Option<cudarc::driver::CudaEvent>,
    /// The horizontal pass's f32 rows.
    tmp: Option<CudaBuf>,
    /// The images' filter taps (`resample_taps`).
    taps: Option<CudaBuf>,
    /// The batch's `ImageJob`s (bytes; allocated as f32 words).
    jobs: Option<CudaBuf>,
    /// Two pinned arenas used in turn.
    arenas: [Arena; 2],
    next_arena: usize,
    /// The hardware decoder's engines (0: none, hybrid only).
    pub engines: u32,
    /// Whether the engines decode only each crop's window (`VITSCALE_NVJPEG_ROI`); cleared
    /// for the rest of the run when the library lacks the call or the engines refuse it.
    pub(super) windows: bool,
    /// One decode-parameter set per image of the batched call with windows.
    params: Vec<Params>,
    /// Images decoded as windows so far (the selftest checks that the path ran).
    pub(super) windowed_images: u64,
    /// A batch decoded ahead has everything but its last pass on the stream, and nobody has
    /// enqueued that pass yet: until it is enqueued or the batch dropped, no other batch may
    /// use the buffers that pass reads.
    awaiting_output: bool,
}

// SAFETY: the nvJPEG handles are used by one thread at a time (the backend keeps the decoder
// behind a mutex); nvJPEG allows a handle to move between threads.
unsafe impl Send for JpegDecoder {}

impl Drop for JpegDecoder {
    fn drop(&mut self) {
        let api = &self.api;
        if let Some(roi) = api.roi.as_ref() {
            for &p in &self.params {
                // SAFETY: created by `params_create`, destroyed once, before the handles.
                unsafe { (roi.params_destroy)(p) };
            }
        }
        if let Some(d) = self.hardware.as_mut() {
            d.free(api);
        }
        self.hybrid.free(&self.api);
    }
}

impl JpegDecoder {
    fn new(ctx: &Arc<cudarc::driver::CudaContext>) -> Result<JpegDecoder, String> {
        ctx.bind_to_thread().map_err(|e| format!("binding the CUDA context: {e}"))?;
        let (least, greatest) = dr::stream::get_priority_range().map_err(|e| format!("cuCtxGetStreamPriorityRange: {e}"))?;
        // `VITSCALE_DECODE_PRIORITY=normal` puts the decode at the compute stream's priority, so
        // that its kernels wait for the step's blocks instead of going ahead of them (measured
        // on an H100: no difference either way, BENCHMARKS.md).
        let priority = choose(&env, "VITSCALE_DECODE_PRIORITY", greatest, &[("high", greatest), ("normal", least)])?;
        let stream = ctx.new_stream_with_priority(priority).map_err(|e| format!("creating the decode stream: {e}"))?;
        DECODE_STREAM.store(stream.cu_stream() as u64, Ordering::Relaxed);
        let api = open_api()?;
        let hybrid = Decoder::new(&api, BACKEND_DEFAULT)?;
        // The batched call's decoder: the hardware backend, which exists only where the GPU
        // has JPEG engines (elsewhere creating it fails and the hybrid decoder does
        // everything), or with `VITSCALE_NVJPEG_BATCHED=gpu_hybrid` nvJPEG's GPU-assisted
        // Huffman decoder, whose batched call is kernels on the decode stream.
        let gpu_hybrid = match std::env::var("VITSCALE_NVJPEG_BATCHED").as_deref() {
            Ok("gpu_hybrid") => true,
            Ok("hardware") | Ok("") | Err(_) => false,
            Ok(other) => return Err(format!("VITSCALE_NVJPEG_BATCHED must be hardware or gpu_hybrid, got {other:?}")),
        };
        let hardware = if gpu_hybrid { Some(Decoder::new(&api, BACKEND_GPU_HYBRID)?) } else { Decoder::new(&api, BACKEND_HARDWARE).ok() };
        let mut engines = 0;
        if let (Some(hw), false) = (&hardware, gpu_hybrid) {
            let (mut e, mut cores): (c_uint, c_uint) = (0, 0);
            // SAFETY: a live handle and two out-pointers.
            if unsafe { (api.hw_info)(hw.handle, &mut e, &mut cores) } == 0 {
                engines = e;
            }
        }
        let windows = choose(&env, "VITSCALE_NVJPEG_ROI", false, &ON_OFF)?;
        let arena = || Arena { ptr: std::ptr::null_mut(), bytes: 0, done: None };
        Ok(JpegDecoder { api, hardware, hybrid, batched_for: 0, pooled: false, pixels: None, pixels_read: None, tmp: None, taps: None, jobs: None, stream, arenas: [arena(), arena()], next_arena: 0, engines, windows, params: Vec::new(), windowed_images: 0, awaiting_output: false })
    }
}

/// Grows `slot` to at least `bytes` bytes (as `ty` words), first waiting for the decode stream
/// so no queued kernel still reads the buffer being replaced.
fn ensure(t: &DecodeThread, stream: &Arc<CudaStream>, slot: &mut Option<CudaBuf>, bytes: usize, ty: Ty, what: &str) -> BResult<u64> {
    let words = bytes.div_ceil(ty.size()).max(1);
    if slot.as_ref().is_none_or(|b| b.len < words) {
        if slot.is_some() {
            stream.synchronize().map_err(dev("synchronizing the decode stream"))?;
        }
        *slot = None;
        // room to grow: batches vary in their images' sizes
        let words = words + words / 4;
        *slot = Some(Cuda::raw_alloc_with(&t.ctx, stream, &t.mem, words, ty).map_err(|e| BackendError::Device(format!("{what}: {e}")))?);
    }
    Ok(slot.as_ref().map(|b| b.ptr).unwrap_or(0))
}

/// What the decode thread needs for one batch, prepared by `lay_out` (in the calling thread for
/// a plain decode, in the batch's own thread for one decoded ahead): the bitstreams are already
/// in pinned arena `which`, the device buffers already sized.
struct Submission {
    arena_ptr: usize,
    which: usize,
    host_at: Vec<(usize, usize)>,
    jobs: Vec<ImageJob>,
    /// Each image's window to decode on the engines (`crop_window`), where one is worth it.
    windows: Vec<Option<[usize; 4]>>,
    encodings: Vec<Encoding>,
    sources: Vec<String>,
    px: u64,
    output: OutputPass,
    /// The input buffer and its format, where the thread also enqueues the last pass; None for
    /// a batch decoded ahead (`decode_ahead`), whose last pass waits for its staging.
    dst: Option<(u64, i32)>,
}

/// The last pass of a batch's decode: the vertical resampling of the decoder's rows into the
/// model's input, normalized. It writes the input buffer, so it waits until the compute stream
/// has read the previous batch from it.
struct OutputPass {
    images: usize,
    tmp: u64,
    taps: u64,
    jobs: u64,
    side: usize,
    bicubic: bool,
    mean: [f32; 3],
    std: [f32; 3],
    kernel: cudarc::driver::CudaFunction,
}

impl OutputPass {
    /// Enqueues the pass on `stream` into `dst` (`dt`: its format), after the compute stream's
    /// latest "inputs read" event; returns the event recorded after it.
    fn enqueue(&self, ctx: &Arc<cudarc::driver::CudaContext>, stream: &CudaStream, inputs_read: &Mutex<Option<cudarc::driver::CudaEvent>>, (dst, dt): (u64, i32)) -> BResult<cudarc::driver::CudaEvent> {
        let cu = stream.cu_stream();
        // (the compute thread records a newer event only after it has settled this batch)
        if let Some(ev) = inputs_read.lock().map_err(|_| BackendError::Device("decode_input: event lock poisoned".into()))?.as_ref() {
            // SAFETY: a live event of this context; the wait is enqueued on the decode stream.
            unsafe { cudarc::driver::result::stream::wait_event(cu, ev.cu_event(), cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                .map_err(dev("cuStreamWaitEvent"))?;
        }
        let k: [f32; 3] = std::array::from_fn(|c| 1.0 / (255.0 * self.std[c]));
        let o: [f32; 3] = std::array::from_fn(|c| self.mean[c] / self.std[c]);
        let (tmp, jobs, taps, side, bicubic) = (self.tmp, self.jobs, self.taps, self.side as i32, i32::from(self.bicubic));
        let grid = ((self.side * self.side).div_ceil(THREADS as usize).clamp(1, 1024) as u32, self.images as u32, 1);
        launch(cu, &self.kernel, "resample_cols_norm", grid, &mut kargs![dst, dt, tmp, jobs, taps, side, bicubic, k[0], k[1], k[2], o[0], o[1], o[2]])?;
        let ready = ctx.new_event(None).map_err(dev("cuEventCreate"))?;
        ready.record(stream).map_err(dev("cuEventRecord"))?;
        Ok(ready)
    }
}

/// The decode threads' share of the backend, so a thread never borrows the backend itself: the
/// context, the decoder, the compute stream's "inputs read" event, and what laying a batch out
/// needs (the memory count for the buffers' allocations, the resampling kernels: taps, rows,
/// columns).
struct DecodeThread {
    ctx: Arc<cudarc::driver::CudaContext>,
    jpeg: Arc<Mutex<Option<JpegDecoder>>>,
    inputs_read: Arc<Mutex<Option<cudarc::driver::CudaEvent>>>,
    mem: Arc<super::MemStats>,
    kernels: [cudarc::driver::CudaFunction; 3],
}

/// The decoded batch's state: being enqueued by the decode thread, or enqueued with the event
/// its last kernel recorded.
pub(super) enum PendingDecode {
    Running(std::thread::JoinHandle<BResult<Option<cudarc::driver::CudaEvent>>>),
    Enqueued(cudarc::driver::CudaEvent),
}

impl PendingDecode {
    /// The event, once the decode thread has enqueued the batch (its error otherwise).
    pub(super) fn settle(self) -> BResult<cudarc::driver::CudaEvent> {
        match self {
            PendingDecode::Enqueued(ev) => Ok(ev),
            PendingDecode::Running(h) => join(h)?.ok_or_else(|| BackendError::Device("the GPU decode thread enqueued no last pass".into())),
        }
    }
}

/// The decode thread's result (a panic as an error).
fn join(h: std::thread::JoinHandle<BResult<Option<cudarc::driver::CudaEvent>>>) -> BResult<Option<cudarc::driver::CudaEvent>> {
    h.join().map_err(|_| BackendError::Device("the GPU decode thread panicked".into()))?
}

/// Which images a batch decoded ahead holds: each image's bytes (where they lie and how many),
/// size, crop and flip, and the output's settings. The trainer keeps the batch alive from
/// `decode_ahead` until it stages it, so no other batch's bytes can lie at the same addresses
/// meanwhile.
#[derive(PartialEq)]
struct BatchKey {
    images: Vec<(usize, usize, usize, usize, [u32; 4], bool)>,
    side: usize,
    bicubic: bool,
    norm: [u32; 6],
}

impl BatchKey {
    fn of(batch: &EncodedBatch, images: &[crate::core::encoded::EncodedImage]) -> BatchKey {
        BatchKey {
            images: images.iter().map(|m| (m.bytes.as_ptr() as usize, m.bytes.len(), m.width, m.height, m.crop.map(f32::to_bits), m.flip)).collect(),
            side: batch.side,
            bicubic: batch.bicubic,
            norm: [batch.mean[0], batch.mean[1], batch.mean[2], batch.std[0], batch.std[1], batch.std[2]].map(f32::to_bits),
        }
    }
}

/// Between a batch decoded ahead and its staging, whichever comes second enqueues the last
/// pass: the staging leaves the input buffer here for the thread if the thread is still
/// running, and the thread, done first, leaves the pass here for the staging.
#[derive(Default)]
struct Handoff {
    dst: Option<(u64, i32)>,
    last_pass: Option<OutputPass>,
}

/// Set once a decode thread is done with the decoder (or stopped). Each thread waits for the
/// one started before it (`Cuda::decode_chain`), so that the batches take the decoder, and
/// enqueue their work, in the order they were handed in, whichever thread the mutex would
/// wake first.
#[derive(Default)]
pub(super) struct Finished {
    flag: Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Finished {
    fn wait(&self) -> BResult<()> {
        let poisoned = |_| BackendError::Device("the GPU decode: order lock poisoned".into());
        let mut done = self.flag.lock().map_err(poisoned)?;
        while !*done {
            done = self.cv.wait(done).map_err(poisoned)?;
        }
        Ok(())
    }
}

/// Sets its `Finished` when dropped: on every way out of a decode thread.
struct SetOnDrop(Arc<Finished>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        if let Ok(mut done) = self.0.flag.lock() {
            *done = true;
        }
        self.0.cv.notify_all();
    }
}

/// A batch being decoded ahead (`Backend::decode_ahead`): which it is, its thread (which lays
/// it out, decodes it and enqueues everything before the last pass) and their handoff.
pub(super) struct AheadDecode {
    key: BatchKey,
    handoff: Arc<Mutex<Handoff>>,
    thread: std::thread::JoinHandle<BResult<Option<cudarc::driver::CudaEvent>>>,
}

impl DecodeThread {
    /// Enqueues one batch the caller laid out (`lay_out`): everything before the last pass
    /// (`first_passes`), then the last pass into `sub.dst`. Returns the event recorded after it.
    fn enqueue(self, sub: Submission) -> BResult<Option<cudarc::driver::CudaEvent>> {
        let mut guard = self.jpeg.lock().map_err(|_| BackendError::Device("decode_input: decoder lock poisoned".into()))?;
        let dec = guard.as_mut().ok_or_else(|| BackendError::Device("the GPU image decoder is not open".into()))?;
        self.first_passes(dec, &sub)?;
        match sub.dst {
            Some(dst) => Ok(Some(sub.output.enqueue(&self.ctx, &dec.stream, &self.inputs_read, dst)?)),
            None => Ok(None),
        }
    }

    /// A batch decoded ahead (`Cuda::decode_ahead_impl`; `batch` holds copies of its images):
    /// lays it out, enqueues everything before the last pass, then the last pass too if the
    /// batch was staged meanwhile (`handoff.dst`), else leaves that pass in the handoff for the
    /// staging. Returns the event recorded after the last pass, if this thread enqueued it.
    fn decode_ahead(self, batch: EncodedBatch, handoff: Arc<Mutex<Handoff>>) -> BResult<Option<cudarc::driver::CudaEvent>> {
        let mut guard = self.jpeg.lock().map_err(|_| BackendError::Device("decode_ahead: decoder lock poisoned".into()))?;
        let dec = opened(&self.ctx, &mut guard).map_err(BackendError::Device)?;
        let sub = self.lay_out(dec, &batch, &batch.images, None)?;
        self.first_passes(dec, &sub)?;
        let mut h = handoff.lock().map_err(|_| BackendError::Device("decode_ahead: handoff lock poisoned".into()))?;
        match h.dst {
            Some(dst) => Ok(Some(sub.output.enqueue(&self.ctx, &dec.stream, &self.inputs_read, dst)?)),
            None => {
                h.last_pass = Some(sub.output);
                dec.awaiting_output = true;
                Ok(None)
            }
        }
    }

    /// Lays `images` (of `batch`) out in the decoder's buffers, growing them where needed, and
    /// copies their bytes into the next pinned arena; `dst`: where the last pass writes, None
    /// for a batch decoded ahead.
    fn lay_out(&self, dec: &mut JpegDecoder, batch: &EncodedBatch, images: &[crate::core::encoded::EncodedImage], dst: Option<(u64, i32)>) -> BResult<Submission> {
        let (b, side) = (images.len(), batch.side);
        if dec.awaiting_output {
            return Err(BackendError::Device("the GPU decode: a batch decoded ahead was neither staged nor dropped before the next batch".into()));
        }
        let stream = dec.stream.clone();
        // Where each image goes: its pixels on the device, its horizontal-pass rows, and its
        // bytes in the pinned arena (after the table).
        let windows_on = dec.windows;
        let mut jobs = Vec::with_capacity(b);
        let (mut px_bytes, mut tmp_floats, mut tap_words) = (0usize, 0usize, 0usize);
        let table_bytes = (std::mem::size_of::<ImageJob>() * b).div_ceil(256) * 256;
        let mut host_at = Vec::with_capacity(b);
        let mut windows = Vec::with_capacity(b);
        let mut host_bytes = table_bytes;
        for img in images {
            if img.width == 0 || img.height == 0 {
                return Err(BackendError::Device(format!("{}: empty image", img.source)));
            }
            let n = match img.encoding {
                Encoding::Jpeg => img.bytes.len(),
                Encoding::Rgb => img.width * img.height * 3,
            };
            if img.bytes.len() < n {
                return Err(BackendError::Device(format!("{}: {} bytes of pixels for {}×{} RGB", img.source, img.bytes.len(), img.width, img.height)));
            }
            host_at.push((host_bytes, n));
            host_bytes += n.div_ceil(64) * 64;
            let (row0, rows) = row_range(img.height, img.crop[1], img.crop[3], side, batch.bicubic);
            windows.push(if windows_on && img.encoding == Encoding::Jpeg { crop_window(img.width, img.height, img.crop, side, batch.bicubic) } else { None });
            let (kx, ky) = (taps_per_output(img.crop[2], side, batch.bicubic), taps_per_output(img.crop[3], side, batch.bicubic));
            jobs.push(ImageJob {
                src: px_bytes as i64,
                w: img.width as i32,
                h: img.height as i32,
                x0: img.crop[0],
                y0: img.crop[1],
                cw: img.crop[2],
                ch: img.crop[3],
                flip: i32::from(img.flip),
                row0: row0 as i32,
                rows: rows as i32,
                kx: kx as i32,
                tmp: tmp_floats as i64,
                ky: ky as i32,
                pad: 0,
                taps: tap_words as i64,
            });
            // 256-byte aligned starts, as nvJPEG's planes like them
            px_bytes += (img.width * img.height * 3).div_ceil(256) * 256;
            tmp_floats += rows * side * 3;
            tap_words += side * (4 + kx + ky);
        }
        let px = ensure(self, &stream, &mut dec.pixels, px_bytes, Ty::Half, "the decoded images")?;
        let tmp = ensure(self, &stream, &mut dec.tmp, tmp_floats * 4, Ty::F32, "the resampling rows")?;
        let taps = ensure(self, &stream, &mut dec.taps, tap_words * 4, Ty::F32, "the resampling taps")?;
        let jobs_ptr = ensure(self, &stream, &mut dec.jobs, table_bytes, Ty::F32, "the decode table")?;
        let which = dec.next_arena;
        dec.next_arena = 1 - which;
        let arena = dec.arenas[which].prepare(host_bytes)?;
        // (the table, at the arena's start, is written by the decode thread once it is final)
        for (img, &(at, n)) in images.iter().zip(&host_at) {
            arena[at..at + n].copy_from_slice(&img.bytes[..n]);
        }
        let output = OutputPass { images: b, tmp, taps, jobs: jobs_ptr, side, bicubic: batch.bicubic, mean: batch.mean, std: batch.std, kernel: self.kernels[2].clone() };
        Ok(Submission {
            arena_ptr: arena.as_ptr() as usize,
            which,
            host_at,
            jobs,
            windows,
            encodings: images.iter().map(|m| m.encoding).collect(),
            sources: images.iter().map(|m| m.source.clone()).collect(),
            px,
            output,
            dst,
        })
    }

    /// Enqueues one laid-out batch on the decode stream up to its last pass: the decode
    /// (hardware, hybrid, CPU as the module doc says), the copies of already-decoded images,
    /// the table and the first two resampling kernels.
    fn first_passes(&self, dec: &mut JpegDecoder, sub: &Submission) -> BResult<()> {
        let stream = dec.stream.clone();
        let cu = stream.cu_stream();
        let b = sub.jobs.len();
        // SAFETY: the arena is pinned memory of at least the laid-out bytes; it is not
        // rewritten before the event recorded after this decode's reads of it (`Arena::prepare`),
        // and not freed while this thread runs (the backend joins it first).
        let arena_ptr = sub.arena_ptr as *const u8;
        let bytes_of = |i: usize| unsafe { std::slice::from_raw_parts(arena_ptr.add(sub.host_at[i].0), sub.host_at[i].1) };
        // Each image's job, moved into its window's coordinates where only the window is
        // decoded; the table goes to the device once the decode has settled that.
        let mut jobs = sub.jobs.clone();
        // SAFETY (the copies below): each source range lies in the pinned arena (see above);
        // each destination range was laid out within its buffer by the caller.

        // Decode: the JPEGs in one hardware call where possible, the rest one by one.
        let dest = |j: &ImageJob| NvImage { channel: [(sub.px + j.src as u64) as *mut u8, std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut()], pitch: [j.w as usize * 3, 0, 0, 0] };
        let jpegs: Vec<usize> = (0..b).filter(|&i| sub.encodings[i] == Encoding::Jpeg).collect();
        let mut pending: Vec<usize> = jpegs.clone();
        let windowed = dec.windows && jpegs.iter().any(|&i| sub.windows[i].is_some());
        if let (Some(hw), false) = (dec.hardware.as_ref(), jpegs.is_empty()) {
            let api = &dec.api;
            let mut ok = true;
            if !dec.pooled {
                // Without a pool the hardware decoder allocates and frees its buffers in every
                // call, bypassing the allocators above, and a free waits for the whole device:
                // each batch's decode would then wait for the step running beside it. The pool
                // is sized for this batch (it grows if a later batch needs more); a library
                // without the call, or one that refuses it, decodes as before.
                dec.pooled = true;
                if let Some(pre) = dec.api.pre_allocate {
                    let (w, h) = jpegs.iter().fold((1, 1), |(w, h), &i| (w.max(sub.jobs[i].w), h.max(sub.jobs[i].h)));
                    // SAFETY: live handle and state of the hardware decoder, before its first
                    // batched initialization.
                    let _ = unsafe { pre(hw.handle, hw.state, jpegs.len() as c_int, w, h, CSS_420, OUTPUT_RGBI) };
                }
            }
            if dec.batched_for != jpegs.len() {
                // SAFETY: live handle and state of the hardware decoder.
                ok = check("nvjpegDecodeBatchedInitialize", unsafe { (api.batched_init)(hw.handle, hw.state, jpegs.len() as c_int, 1, OUTPUT_RGBI) }).is_ok();
                dec.batched_for = if ok { jpegs.len() } else { 0 };
            }
            if ok {
                if let Some(ev) = dec.pixels_read.take() {
                    ev.synchronize().map_err(dev("waiting for the previous batch's resampling"))?;
                }
                let data: Vec<*const u8> = jpegs.iter().map(|&i| bytes_of(i).as_ptr()).collect();
                let lens: Vec<usize> = jpegs.iter().map(|&i| sub.host_at[i].1).collect();
                let mut r = -1;
                if windowed {
                    // the windows' jobs: each window decodes to rows of its own width
                    let in_windows: Vec<ImageJob> = jpegs.iter().map(|&i| sub.windows[i].map_or(sub.jobs[i], |w| sub.jobs[i].in_window(w))).collect();
                    r = match api.roi.as_ref() {
                        Some(roi) => {
                            while dec.params.len() < jpegs.len() {
                                let mut p: Params = std::ptr::null_mut();
                                // SAFETY: a live handle and an out-pointer.
                                check("nvjpegDecodeParamsCreate", unsafe { (roi.params_create)(hw.handle, &mut p) }).map_err(BackendError::Device)?;
                                dec.params.push(p);
                            }
                            // (the first refusal's status, if any parameter is refused)
                            let mut set = 0;
                            for (k, &i) in jpegs.iter().enumerate() {
                                let [x, y, w, h] = sub.windows[i].unwrap_or([0, 0, sub.jobs[i].w as usize, sub.jobs[i].h as usize]);
                                // SAFETY: a live parameter set.
                                for status in [unsafe { (roi.set_output_format)(dec.params[k], OUTPUT_RGBI) }, unsafe { (roi.set_roi)(dec.params[k], x as c_int, y as c_int, w as c_int, h as c_int) }] {
                                    if set == 0 {
                                        set = status;
                                    }
                                }
                            }
                            let mut outs: Vec<NvImage> = in_windows.iter().map(dest).collect();
                            // SAFETY: as the plain call below; each output plane has room for
                            // its window's w·h·3 bytes (fewer than the image's laid out).
                            if set == 0 { unsafe { (roi.batched_ex)(hw.handle, hw.state, data.as_ptr(), lens.as_ptr(), outs.as_mut_ptr(), dec.params.as_mut_ptr(), cu) } } else { set }
                        }
                        None => -1,
                    };
                    if r == 0 {
                        for (k, &i) in jpegs.iter().enumerate() {
                            jobs[i] = in_windows[k];
                        }
                        dec.windowed_images += jpegs.iter().filter(|&&i| sub.windows[i].is_some()).count() as u64;
                    } else {
                        crate::errln!("VITSCALE_NVJPEG_ROI: the JPEG engines did not decode the crops' windows ({}); decoding whole images from here on", if api.roi.is_none() { "this nvJPEG has no nvjpegDecodeBatchedEx".to_string() } else { format!("nvJPEG status {r} ({})", status_name(r)) });
                        dec.windows = false;
                        // (nvJPEG asks for a fresh initialization after a failed batch)
                        ok = check("nvjpegDecodeBatchedInitialize", unsafe { (api.batched_init)(hw.handle, hw.state, jpegs.len() as c_int, 1, OUTPUT_RGBI) }).is_ok();
                        dec.batched_for = if ok { jpegs.len() } else { 0 };
                    }
                }
                if r != 0 && ok {
                    let mut outs: Vec<NvImage> = jpegs.iter().map(|&i| dest(&sub.jobs[i])).collect();
                    // SAFETY: `data`/`lens` describe the bitstreams in the arena, each output
                    // plane has room for its image's w·h·3 bytes (laid out by the caller).
                    r = unsafe { (api.batched)(hw.handle, hw.state, data.as_ptr(), lens.as_ptr(), outs.as_mut_ptr(), cu) };
                }
                if r == 0 {
                    pending.clear();
                } else {
                    // nvJPEG asks for a fresh initialization after a failed batch
                    dec.batched_for = 0;
                }
            }
        }
        let mut cpu_px = Vec::new();
        for &i in &pending {
            let job = &sub.jobs[i];
            let mut out = dest(job);
            let bits = bytes_of(i);
            // SAFETY: as above, for one image with the hybrid decoder.
            let r = unsafe { (dec.api.decode)(dec.hybrid.handle, dec.hybrid.state, bits.as_ptr(), bits.len(), OUTPUT_RGBI, &mut out, cu) };
            if r != 0 {
                // the CPU decoder as a last resort (CMYK, unusual layouts); rare, so this copy
                // from pageable memory may wait for the stream
                let src = &sub.sources[i];
                let (w, h) = crate::core::encoded::decode_rgb(bits, &mut cpu_px)
                    .map_err(|msg| BackendError::Device(format!("{src}: cannot decode image: nvJPEG status {r} ({}), CPU decoder: {msg}", status_name(r))))?;
                if (w as i32, h as i32) != (job.w, job.h) {
                    return Err(BackendError::Device(format!("{src}: decoded {w}×{h}, its header said {}×{}", job.w, job.h)));
                }
                // SAFETY: the destination has w·h·3 bytes; the stream is synchronized before
                // `cpu_px` is reused or dropped.
                unsafe { dr::memcpy_htod_async(sub.px + job.src as u64, &cpu_px[..w * h * 3], cu) }.map_err(dev("copying a CPU-decoded image"))?;
                stream.synchronize().map_err(dev("copying a CPU-decoded image"))?;
            }
        }
        for i in (0..b).filter(|&i| sub.encodings[i] == Encoding::Rgb) {
            // SAFETY: see the copies' note above.
            unsafe { dr::memcpy_htod_async(sub.px + sub.jobs[i].src as u64, bytes_of(i), cu) }.map_err(dev("copying decoded images"))?;
        }

        // SAFETY: `ImageJob` is plain old data (repr(C), its padding an explicit field); the
        // arena's first bytes are this decode's table (the caller laid the bitstreams after
        // room for b jobs), and pinned, so the copy may read them after this call returns.
        let table_len = std::mem::size_of::<ImageJob>() * b;
        let table = unsafe {
            std::ptr::copy_nonoverlapping(jobs.as_ptr() as *const u8, arena_ptr as *mut u8, table_len);
            std::slice::from_raw_parts(arena_ptr, table_len)
        };
        unsafe { dr::memcpy_htod_async(sub.output.jobs, table, cu) }.map_err(dev("copying the decode table"))?;

        // Resample: the taps and the rows; the output pass below or at the batch's staging.
        let out = &sub.output;
        let (px, tmp, taps, jobs_ptr) = (sub.px, out.tmp, out.taps, out.jobs);
        let bicubic = i32::from(out.bicubic);
        let side = out.side;
        let side_i = side as i32;
        let max_rows = sub.jobs.iter().map(|j| j.rows as usize).max().unwrap_or(1);
        let grid_x = |n: usize| (n.div_ceil(THREADS as usize).clamp(1, 1024)) as u32;
        launch(cu, &self.kernels[0], "resample_taps", (grid_x(2 * side), b as u32, 1), &mut kargs![taps, jobs_ptr, side_i, bicubic])?;
        launch(cu, &self.kernels[1], "resample_rows_rgb8", (grid_x(max_rows * side), b as u32, 1), &mut kargs![tmp, px, jobs_ptr, taps, side_i, bicubic])?;
        // the last reads of the pixels and of the arena (the table's copy is before them)
        let read = self.ctx.new_event(None).map_err(dev("cuEventCreate"))?;
        read.record(&stream).map_err(dev("cuEventRecord"))?;
        dec.pixels_read = Some(read);
        let done = self.ctx.new_event(None).map_err(dev("cuEventCreate"))?;
        done.record(&stream).map_err(dev("cuEventRecord"))?;
        dec.arenas[sub.which].done = Some(done);
        Ok(())
    }
}

/// Launches `f` (kernel `name` of kernels/image.cu) on `stream`.
fn launch(stream: CUstream, f: &cudarc::driver::CudaFunction, name: &str, grid: (u32, u32, u32), args: &mut [*mut c_void]) -> BResult<()> {
    // SAFETY: the launch sites pass arguments matching the kernels' signatures in
    // kernels/image.cu, device pointers to buffers sized for the batch, and values that
    // outlive the call.
    unsafe { dr::launch_kernel(f.cu_function(), grid, (THREADS, 1, 1), 0, stream, args) }.map_err(|e| BackendError::Device(format!("launching {name}: {e}")))
}

impl Cuda {
    /// `Backend::decode_input` (see the module doc). A batch `decode_ahead` started is only
    /// finished: its last pass, enqueued by its thread if that is still running, else from
    /// this one. Any other is laid out here and copied into a pinned arena; a thread of its own
    /// then makes the nvJPEG calls, which hold the calling thread for as long as the engines
    /// take (they would hold back the launches of the step queued meanwhile), and enqueues the
    /// resampling.
    pub(super) fn decode_input_impl(&self, dst: &mut CudaBuf, batch: &EncodedBatch, range: std::ops::Range<usize>) -> BResult<()> {
        let images = batch.images.get(range.clone()).ok_or_else(|| BackendError::Shape { op: "decode_input", msg: format!("images {range:?} of a batch of {}", batch.images.len()) })?;
        super::device::check_len("decode_input", "dst", dst, images.len() * 3 * batch.side * batch.side)?;
        if images.is_empty() {
            return Ok(());
        }
        // The previous batch is enqueued before this one reuses the decoder or the input.
        self.settle_pending_decode()?;
        let ahead = self.decode_ahead.lock().map_err(|_| BackendError::Device("decode_input: decode-ahead lock poisoned".into()))?.take();
        if let Some(a) = ahead {
            if a.key != BatchKey::of(batch, images) {
                self.drop_ahead(a)?;
            } else {
                let pending = self.finish_ahead(a, (dst.ptr, dst.dt()))?;
                self.decoded_ahead.fetch_add(1, Ordering::Relaxed);
                *self.decoded_input.lock().map_err(|_| BackendError::Device("decode_input: event lock poisoned".into()))? = Some(pending);
                return Ok(());
            }
        }
        self.ctx.bind_to_thread().map_err(dev("decode_input"))?;
        let t = self.decode_thread()?;
        let sub = {
            let mut guard = self.jpeg.lock().map_err(|_| BackendError::Device("decode_input: decoder lock poisoned".into()))?;
            let dec = opened(&self.ctx, &mut guard).map_err(BackendError::Device)?;
            t.lay_out(dec, batch, images, Some((dst.ptr, dst.dt())))?
        };
        let handle = self.spawn_decode(t, "gpu-decode", move |t| t.enqueue(sub))?;
        *self.decoded_input.lock().map_err(|_| BackendError::Device("decode_input: event lock poisoned".into()))? = Some(PendingDecode::Running(handle));
        Ok(())
    }

    /// The last pass of batch `a`, decoded ahead, into `dst`: left to its thread if that is
    /// still running (the thread is then the pending decode), else enqueued here.
    fn finish_ahead(&self, a: AheadDecode, dst: (u64, i32)) -> BResult<PendingDecode> {
        let last_pass = {
            let mut h = a.handoff.lock().map_err(|_| BackendError::Device("decode_input: handoff lock poisoned".into()))?;
            match h.last_pass.take() {
                Some(pass) => pass,
                None => {
                    h.dst = Some(dst);
                    self.ahead_handed_over.fetch_add(1, Ordering::Relaxed);
                    return Ok(PendingDecode::Running(a.thread));
                }
            }
        };
        join(a.thread)?;
        self.ctx.bind_to_thread().map_err(dev("decode_input"))?;
        let mut guard = self.jpeg.lock().map_err(|_| BackendError::Device("decode_input: decoder lock poisoned".into()))?;
        let dec = opened(&self.ctx, &mut guard).map_err(BackendError::Device)?;
        let ready = last_pass.enqueue(&self.ctx, &dec.stream, &self.inputs_read, dst)?;
        dec.awaiting_output = false;
        Ok(PendingDecode::Enqueued(ready))
    }

    /// Waits for batch `a`, decoded ahead, and drops it: its buffers are free for the next
    /// batch (it is decoded again if it is staged later; an error of its decode is not this
    /// caller's).
    pub(super) fn drop_ahead(&self, a: AheadDecode) -> BResult<()> {
        let _ = join(a.thread);
        if let Some(dec) = self.jpeg.lock().map_err(|_| BackendError::Device("decode_input: decoder lock poisoned".into()))?.as_mut() {
            dec.awaiting_output = false;
        }
        Ok(())
    }

    /// `Backend::decode_ahead`: starts decoding images `range` of a batch that is staged after
    /// the next one. Its thread lays it out from copies of its images, waits for the decoder
    /// (the batch before it still holds it while decoding), and enqueues everything but the
    /// last pass, which writes the input buffer and is left for `decode_input` of the same
    /// images (`finish_ahead`); this thread returns at once. A batch started ahead before and
    /// not yet staged is dropped first; one staged has its last pass enqueued, or left to its
    /// thread which enqueues it under the decoder's lock, before this one's decode.
    pub(super) fn decode_ahead_impl(&self, batch: &EncodedBatch, range: std::ops::Range<usize>) -> BResult<()> {
        let images = batch.images.get(range.clone()).ok_or_else(|| BackendError::Shape { op: "decode_ahead", msg: format!("images {range:?} of a batch of {}", batch.images.len()) })?;
        if images.is_empty() {
            return Ok(());
        }
        self.discard_decode_ahead()?;
        let t = self.decode_thread()?;
        let owned = EncodedBatch { images: images.to_vec(), side: batch.side, bicubic: batch.bicubic, mean: batch.mean, std: batch.std };
        let handoff = Arc::new(Mutex::new(Handoff::default()));
        let h = handoff.clone();
        let thread = self.spawn_decode(t, "gpu-decode-ahead", move |t| t.decode_ahead(owned, h))?;
        *self.decode_ahead.lock().map_err(|_| BackendError::Device("decode_ahead: lock poisoned".into()))? = Some(AheadDecode { key: BatchKey::of(batch, images), handoff, thread });
        Ok(())
    }

    /// Whether the trainer should decode ahead (`VITSCALE_DECODE_AHEAD`: off unless "on"),
    /// read once: the trainer asks at every micro-batch.
    pub(super) fn decodes_ahead_impl(&self) -> BResult<bool> {
        self.decode_ahead_on.get_or_init(|| choose(&env, "VITSCALE_DECODE_AHEAD", false, &ON_OFF)).clone().map_err(BackendError::Device)
    }

    /// Waits for a batch decoded ahead and drops it (before anything that changes what the
    /// decoder does).
    fn discard_decode_ahead(&self) -> BResult<()> {
        let ahead = self.decode_ahead.lock().map_err(|_| BackendError::Device("decode-ahead lock poisoned".into()))?.take();
        match ahead {
            Some(a) => self.drop_ahead(a),
            None => Ok(()),
        }
    }

    /// Starts decode thread `name`, which runs `work` with the context bound once the decode
    /// thread started before it is done (`Finished`).
    fn spawn_decode(
        &self,
        t: DecodeThread,
        name: &str,
        work: impl FnOnce(DecodeThread) -> BResult<Option<cudarc::driver::CudaEvent>> + Send + 'static,
    ) -> BResult<std::thread::JoinHandle<BResult<Option<cudarc::driver::CudaEvent>>>> {
        let mine = Arc::new(Finished::default());
        let before = self.decode_chain.lock().map_err(|_| BackendError::Device("the GPU decode: order lock poisoned".into()))?.replace(mine.clone());
        std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let _finished = SetOnDrop(mine);
                if let Some(before) = before {
                    before.wait()?;
                }
                t.ctx.bind_to_thread().map_err(dev("the GPU decode thread"))?;
                work(t)
            })
            .map_err(|e| BackendError::Device(format!("starting the GPU decode thread: {e}")))
    }

    /// What a decode thread needs of the backend.
    fn decode_thread(&self) -> BResult<DecodeThread> {
        let k = |name: &str| -> BResult<cudarc::driver::CudaFunction> { Ok(self.kernels.get(name)?.clone()) };
        Ok(DecodeThread {
            ctx: self.ctx.clone(),
            jpeg: self.jpeg.clone(),
            inputs_read: self.inputs_read.clone(),
            mem: self.mem.clone(),
            kernels: [k("resample_taps")?, k("resample_rows_rgb8")?, k("resample_cols_norm")?],
        })
    }

    /// Waits (on the host) until the decode thread has enqueued the pending batch, keeping its
    /// event; a decode that failed is reported here, naming its file.
    fn settle_pending_decode(&self) -> BResult<()> {
        let mut slot = self.decoded_input.lock().map_err(|_| BackendError::Device("decoded input: event lock poisoned".into()))?;
        if let Some(p) = slot.take() {
            *slot = Some(PendingDecode::Enqueued(p.settle()?));
        }
        Ok(())
    }

    /// Makes the compute stream wait for a decoded batch still being written to the input
    /// buffer (`decode_input`), if any: before the first kernel that reads the input, and
    /// before any synchronization that promises every queued result.
    pub(super) fn order_decoded_input(&self) -> BResult<()> {
        let pending = self.decoded_input.lock().map_err(|_| BackendError::Device("decoded input: event lock poisoned".into()))?.take();
        if let Some(p) = pending {
            let ev = p.settle()?;
            // SAFETY: a live event of this context recorded on the decode stream.
            unsafe { cudarc::driver::result::stream::wait_event(self.stream.cu_stream(), ev.cu_event(), cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                .map_err(dev("cuStreamWaitEvent"))?;
        }
        Ok(())
    }

    /// The GPU decoder's JPEG engines: Some(0) when it decodes without them (hybrid), None
    /// when nvJPEG cannot be loaded (the error).
    pub fn jpeg_engines(&self) -> Result<u32, String> {
        let mut guard = self.jpeg.lock().map_err(|_| "decoder lock poisoned".to_string())?;
        Ok(opened(&self.ctx, &mut guard)?.engines)
    }

    /// Whether the JPEG engines decode only each crop's window (`VITSCALE_NVJPEG_ROI`), and
    /// how many images they have decoded so; `set_jpeg_windows` changes the first.
    pub fn jpeg_windows(&self) -> Result<(bool, u64), String> {
        let mut guard = self.jpeg.lock().map_err(|_| "decoder lock poisoned".to_string())?;
        let dec = opened(&self.ctx, &mut guard)?;
        Ok((dec.windows, dec.windowed_images))
    }

    /// Decodes only each crop's window on the JPEG engines (`on`) or whole images.
    pub fn set_jpeg_windows(&self, on: bool) -> Result<(), String> {
        self.settle_pending_decode().map_err(|e| e.to_string())?;
        self.discard_decode_ahead().map_err(|e| e.to_string())?;
        let mut guard = self.jpeg.lock().map_err(|_| "decoder lock poisoned".to_string())?;
        opened(&self.ctx, &mut guard)?.windows = on;
        Ok(())
    }

    /// How many batches `decode_input` has finished from a start ahead (`decode_ahead`), and
    /// of those, how many it left to their still-running thread to finish.
    pub fn jpeg_decoded_ahead(&self) -> (u64, u64) {
        (self.decoded_ahead.load(Ordering::Relaxed), self.ahead_handed_over.load(Ordering::Relaxed))
    }

    /// Runs `f` with the decoder held, so that no decode thread can make progress meanwhile
    /// (the selftest stages a batch decoded ahead before its thread can finish).
    pub fn jpeg_holding_decoder<R>(&self, f: impl FnOnce() -> R) -> Result<R, String> {
        let _held = self.jpeg.lock().map_err(|_| "decoder lock poisoned".to_string())?;
        Ok(f())
    }

    /// Whether the batch decoded ahead, if any, has everything but its last pass enqueued (the
    /// selftest waits for it to take the staging's side of the handoff).
    pub fn jpeg_ahead_ready(&self) -> bool {
        self.decode_ahead.lock().ok().is_some_and(|slot| slot.as_ref().is_some_and(|a| a.handoff.lock().is_ok_and(|h| h.last_pass.is_some())))
    }
}

/// The decoder in `slot`, opened on first use.
fn opened<'a>(ctx: &Arc<cudarc::driver::CudaContext>, slot: &'a mut Option<JpegDecoder>) -> Result<&'a mut JpegDecoder, String> {
    if slot.is_none() {
        *slot = Some(JpegDecoder::new(ctx)?);
    }
    slot.as_mut().ok_or_else(|| "the GPU image decoder could not be opened".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ImageJob` is read by the kernels as kernels/image.cu declares it: the C struct's
    /// natural layout (an i64 at each 8-byte boundary it needs), 72 bytes.
    #[test]
    fn image_job_layout_matches_the_kernels() {
        let j = ImageJob::default();
        let base = &j as *const ImageJob as usize;
        let at = |f: *const u8| f as usize - base;
        assert_eq!(std::mem::size_of::<ImageJob>(), 72);
        assert_eq!(at(&j.src as *const i64 as *const u8), 0);
        assert_eq!(at(&j.w as *const i32 as *const u8), 8);
        assert_eq!(at(&j.x0 as *const f32 as *const u8), 16);
        assert_eq!(at(&j.flip as *const i32 as *const u8), 32);
        assert_eq!(at(&j.kx as *const i32 as *const u8), 44);
        assert_eq!(at(&j.tmp as *const i64 as *const u8), 48);
        assert_eq!(at(&j.ky as *const i32 as *const u8), 56);
        assert_eq!(at(&j.taps as *const i64 as *const u8), 64);
    }

    /// A crop's window holds every source pixel its filters can read: for each output pixel
    /// along each axis, the pixels within the filter's support of its center (PIL's reach,
    /// computed here in f64), over random RandomResizedCrop-like windows of random images.
    #[test]
    fn crop_window_holds_every_pixel_the_filters_read() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x5eed);
        let mut windowed = 0;
        for _ in 0..400 {
            let (width, height) = (rng.gen_range(40..900usize), rng.gen_range(40..900usize));
            let (side, bicubic) = ([32usize, 224, 384][rng.gen_range(0..3)], rng.gen_bool(0.5));
            let cw = rng.gen_range(8.0..width as f32);
            let ch = rng.gen_range(8.0..height as f32);
            let crop = [rng.gen_range(0.0..(width as f32 - cw).max(0.01)), rng.gen_range(0.0..(height as f32 - ch).max(0.01)), cw, ch];
            let Some([x, y, w, h]) = crop_window(width, height, crop, side, bicubic) else {
                continue;
            };
            windowed += 1;
            assert!(x + w <= width && y + h <= height && w >= 1 && h >= 1, "{crop:?} in {width}×{height}: window {:?}", [x, y, w, h]);
            assert!(10 * w * h <= 9 * width * height);
            for (len, r0, rlen, lo_win, n_win) in [(width, crop[0], crop[2], x, w), (height, crop[1], crop[3], y, h)] {
                let scale = rlen as f64 / side as f64;
                let support = if bicubic { 2.0 } else { 1.0 } * scale.max(1.0);
                for i in 0..side {
                    let c = r0 as f64 + (i as f64 + 0.5) * scale;
                    let first = ((c - support).floor().max(0.0) as usize).min(len - 1);
                    let last = ((c + support).ceil() as usize).min(len);
                    assert!(first >= lo_win && last <= lo_win + n_win, "output {i} reads {first}..{last}, window {lo_win}..{} ({crop:?}, {len} px, side {side})", lo_win + n_win);
                }
            }
        }
        assert!(windowed > 100, "only {windowed} crops had a window");
    }

    /// A job moved into its window keeps its crop: the origin moves by the window's whole
    /// pixels exactly, the size becomes the window's (the decoded rows' width), and the
    /// vertical filter's first row becomes the window's first.
    #[test]
    fn a_job_in_its_window_keeps_its_crop() {
        let (width, height, side) = (471, 376, 224);
        let crop = [123.37f32, 57.81, 201.5, 170.25];
        let (row0, rows) = row_range(height, crop[1], crop[3], side, true);
        let job = ImageJob { src: 4096, w: width as i32, h: height as i32, x0: crop[0], y0: crop[1], cw: crop[2], ch: crop[3], flip: 1, row0: row0 as i32, rows: rows as i32, kx: 9, tmp: 77, ky: 9, pad: 0, taps: 12 };
        let window = crop_window(width, height, crop, side, true).expect("a crop of under half the image has a window");
        let [x, y, w, h] = window;
        assert_eq!((y, h), (row0, rows));
        let moved = job.in_window(window);
        assert_eq!((moved.w, moved.h, moved.row0, moved.rows), (w as i32, h as i32, 0, rows as i32));
        assert_eq!(moved.x0 + x as f32, crop[0]);
        assert_eq!(moved.y0 + y as f32, crop[1]);
        assert_eq!((moved.cw, moved.ch, moved.flip, moved.src, moved.tmp, moved.taps, moved.kx, moved.ky), (crop[2], crop[3], 1, 4096, 77, 12, 9, 9));
        // a crop of the whole image has no window worth decoding
        assert_eq!(crop_window(width, height, [0.0, 0.0, width as f32, height as f32], side, false), None);
    }

    /// A batch decoded ahead is finished only for the same images of the same batch: another
    /// range, a copy with equal contents in other buffers, another crop or flip, or other
    /// output settings all differ from it.
    #[test]
    fn a_batch_key_is_the_batch_and_its_images() {
        let image = |k: usize| crate::core::encoded::EncodedImage { bytes: vec![k as u8; 100 + k], encoding: Encoding::Jpeg, width: 40, height: 30, crop: [1.0, 2.0, 30.0, 20.0], flip: false, source: format!("f{k}.jpg") };
        let mut batch = EncodedBatch { images: (0..4).map(image).collect(), side: 224, bicubic: true, mean: [0.5; 3], std: [0.25; 3] };
        let key = BatchKey::of(&batch, &batch.images);
        assert!(key == BatchKey::of(&batch, &batch.images[..]));
        assert!(key != BatchKey::of(&batch, &batch.images[1..]));
        let copy = batch.clone();
        assert!(key != BatchKey::of(&copy, &copy.images), "equal contents in other buffers");
        // each change made to the batch itself (its buffers stay), then undone
        let changes: [fn(&mut EncodedBatch); 4] = [|b| b.images[2].crop[0] = if b.images[2].crop[0] == 1.0 { 1.5 } else { 1.0 }, |b| b.images[3].flip = !b.images[3].flip, |b| b.side = if b.side == 224 { 192 } else { 224 }, |b| b.std[1] = if b.std[1] == 0.25 { 0.3 } else { 0.25 }];
        for (k, change) in changes.iter().enumerate() {
            change(&mut batch);
            assert!(key != BatchKey::of(&batch, &batch.images), "change {k}");
            change(&mut batch);
            assert!(key == BatchKey::of(&batch, &batch.images), "change {k} undone");
        }
    }

    /// The tap table's room per output: the filter's support each side of the center and the
    /// center (PIL's `ceil(support) * 2 + 1`), the support widening with the downscale factor.
    #[test]
    fn taps_per_output_follows_the_support() {
        // upscaling or equal size: bilinear support 1 → 3 taps, bicubic 2 → 5
        assert_eq!(taps_per_output(100.0, 224, false), 3);
        assert_eq!(taps_per_output(224.0, 224, true), 5);
        // 448 → 224: factor 2, supports 2 and 4
        assert_eq!(taps_per_output(448.0, 224, false), 5);
        assert_eq!(taps_per_output(448.0, 224, true), 9);
        // 500 → 224: factor 2.23, supports 2.23 (ceil 3) and 4.46 (ceil 5)
        assert_eq!(taps_per_output(500.0, 224, false), 7);
        assert_eq!(taps_per_output(500.0, 224, true), 11);
    }
}
