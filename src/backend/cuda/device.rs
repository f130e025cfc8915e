//! The device layer under every op: opening a GPU (`probe`, `DeviceInfo`), buffers and their
//! memory accounting (`CudaBuf`, `MemStats`), kernel launches and their argument lists
//! (`kargs!`, `launch*`), scratch space, graph capture, and the memory ops of the `Backend`
//! trait (copies, fills, casts, the staged batch-input upload). The layer files build on
//! these; nothing here knows a model layer.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUdeviceptr, CUstream};
use cudarc::driver::{result as dr, CudaContext, CudaStream};
use rayon::prelude::*;

use super::gemm::{self, Ty};
use super::{libs, Cuda};
use crate::backend::{BResult, Backend, BackendError, Span};

/// What the probe found about a GPU.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_mem: usize,
    pub multiprocessors: u32,
    pub device_count: usize,
    /// `domain:bus:device.function` (hex), how NVML names the same GPU (`telemetry`).
    pub pci_bus_id: String,
}

impl DeviceInfo {
    /// NVRTC target, e.g. "sm_90".
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

pub(super) fn dev<E: std::fmt::Display>(op: &str) -> impl FnOnce(E) -> BackendError + '_ {
    move |e| BackendError::Device(format!("{op}: {e}"))
}

fn probe_inner(index: usize) -> Result<DeviceInfo, String> {
    libs::ensure_loaded()?;
    let count = CudaContext::device_count().map_err(|e| format!("CUDA driver: {e}"))? as usize;
    if count == 0 {
        return Err("the CUDA driver reports no GPU".into());
    }
    if index >= count {
        return Err(format!("GPU index {index} out of range: {count} GPU(s) present"));
    }
    let ctx = CudaContext::new(index).map_err(|e| format!("creating a context on GPU {index}: {e}"))?;
    let name = ctx.name().map_err(|e| e.to_string())?;
    let cc = ctx.compute_capability().map_err(|e| e.to_string())?;
    let total_mem = ctx.total_mem().map_err(|e| e.to_string())?;
    let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(|e| e.to_string())?;
    let pci = |a| ctx.attribute(a).map_err(|e| e.to_string());
    let pci_bus_id = format!(
        "{:x}:{:x}:{:x}.0",
        pci(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
        pci(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
        pci(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
    );
    Ok(DeviceInfo { index, name, compute_capability: cc, total_mem, multiprocessors: sms as u32, device_count: count, pci_bus_id })
}

/// Whether GPU `index` is usable: loads the libraries and opens a context. Never panics
/// (cudarc's loader panics on a missing library; that is caught and reported by name).
pub fn probe(index: usize) -> Result<DeviceInfo, String> {
    match std::panic::catch_unwind(|| probe_inner(index)) {
        Ok(r) => r,
        Err(p) => Err(p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "CUDA initialization panicked".into())),
    }
}

/// `probe(0)`: the check behind `--device auto`.
pub fn cuda_available() -> Result<DeviceInfo, String> {
    probe(0)
}

/// Live and peak bytes of device memory this backend allocated.
#[derive(Default, Debug)]
pub struct MemStats {
    pub live: AtomicUsize,
    pub peak: AtomicUsize,
}

/// A device buffer: raw allocation, element count and dtype. Freed on drop.
pub struct CudaBuf {
    pub(super) ptr: CUdeviceptr,
    pub(super) len: usize,
    pub(super) ty: Ty,
    ctx: Arc<CudaContext>,
    mem: Arc<MemStats>,
}

// SAFETY: a device address is plain data; the allocation is only freed by Drop.
unsafe impl Send for CudaBuf {}

unsafe impl Sync for CudaBuf {}

impl CudaBuf {
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    /// Whether the buffer holds the backend's 16-bit compute format (bf16 or fp16).
    pub fn is_half(&self) -> bool {
        self.ty == Ty::Half
    }
    pub(super) fn bytes(&self) -> usize {
        self.len * self.ty.size()
    }
    pub(super) fn dt(&self) -> i32 {
        match self.ty {
            Ty::F32 => 0,
            Ty::Half => 1,
        }
    }
    /// Address of element `off`.
    pub(super) fn at(&self, off: usize) -> CUdeviceptr {
        self.ptr + (off * self.ty.size()) as u64
    }
}

impl Drop for CudaBuf {
    fn drop(&mut self) {
        if self.ptr != 0 {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: `ptr` came from cuMemAlloc in `Cuda::raw_alloc` and is freed once. The
            // driver waits for work using it when freeing (cuMemFree synchronizes).
            let _ = unsafe { dr::free_sync(self.ptr) };
            self.mem.live.fetch_sub(self.bytes(), Ordering::Relaxed);
        }
    }
}

/// Kernel arguments: pointers to each value, which must live until the launch returns
/// (temporaries in the launching statement do).
macro_rules! kargs {
    ($($a:expr),* $(,)?) => { [$( &$a as *const _ as *mut std::ffi::c_void ),*] };
}
pub(super) use kargs;

/// A captured CUDA graph, ready to replay on the backend's stream.
pub struct Graph {
    exec: cudarc::driver::sys::CUgraphExec,
    graph: cudarc::driver::sys::CUgraph,
    stream: CUstream,
    ctx: Arc<CudaContext>,
}

impl Graph {
    pub fn launch(&self) -> BResult<()> {
        // SAFETY: exec was instantiated from a graph captured on this stream.
        unsafe { dr::graph::launch(self.exec, self.stream) }.map_err(dev("cuGraphLaunch"))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: created in end_capture, destroyed once.
        unsafe {
            let _ = dr::graph::exec_destroy(self.exec);
            let _ = dr::graph::destroy(self.graph);
        }
    }
}

/// Pinned host memory a batch input is converted into before its copy (`upload_input`), and
/// the event recorded on the copy stream once that copy is done (the buffer may be reused
/// after it).
pub(super) struct Staging {
    host: *mut c_void,
    bytes: usize,
    done: cudarc::driver::sys::CUevent,
    in_flight: bool,
}

// SAFETY: the pinned pointer and the event are plain handles, used under the staging lock.
unsafe impl Send for Staging {}

impl Staging {
    /// No host memory yet (`upload_input` allocates it on first use) and a fresh event.
    pub(super) fn new() -> BResult<Staging> {
        let done = cudarc::driver::result::event::create(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(dev("cuEventCreate"))?;
        Ok(Staging { host: std::ptr::null_mut(), bytes: 0, done, in_flight: false })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: the event was created in `Staging::new`; the host memory (if any) by
        // cuMemHostAlloc in `upload_input`; both are released once. Waiting on the event first
        // keeps an in-flight copy from reading freed memory.
        unsafe {
            if self.in_flight {
                let _ = cudarc::driver::result::event::synchronize(self.done);
            }
            if !self.host.is_null() {
                let _ = dr::free_host(self.host);
            }
            let _ = cudarc::driver::result::event::destroy(self.done);
        }
    }
}

/// Scratch buffers the attention ops reuse between calls, grown on demand.
#[derive(Default)]
pub(super) struct Scratch {
    slots: HashMap<&'static str, CudaBuf>,
}

/// Threads per block of the grid-stride and row kernels.
pub(super) const THREADS: u32 = 256;

/// Whether the 16-byte (8 × bf16) kernel variants apply: every buffer bf16, rows of `c` in
/// whole 16-byte groups, every address 16-byte aligned, and `total / 8` within 32-bit indices.
pub(super) fn v8_ok(c: usize, total: usize, bufs: &[&CudaBuf], ptrs: &[CUdeviceptr]) -> bool {
    c % 8 == 0 && total / 8 <= i32::MAX as usize && bufs.iter().all(|b| b.ty == Ty::Half) && ptrs.iter().all(|p| p % 16 == 0)
}

pub(super) fn check_len(op: &'static str, what: &str, buf: &CudaBuf, want: usize) -> BResult<()> {
    if buf.len < want {
        return Err(BackendError::Shape { op, msg: format!("{what} holds {} elements, needs {want}", buf.len) });
    }
    Ok(())
}

pub(super) fn check_bf16(op: &'static str, what: &str, buf: &CudaBuf) -> BResult<()> {
    if buf.ty != Ty::Half {
        return Err(BackendError::Shape { op, msg: format!("{what} must be a compute-dtype (16-bit) buffer") });
    }
    Ok(())
}

pub(super) fn check_f32(op: &'static str, what: &str, buf: &CudaBuf) -> BResult<()> {
    if buf.ty != Ty::F32 {
        return Err(BackendError::Shape { op, msg: format!("{what} must be an f32 buffer (alloc_f32)") });
    }
    Ok(())
}

pub(super) fn check_span(op: &'static str, what: &str, buf: &CudaBuf, s: Span) -> BResult<()> {
    if s.off + s.len > buf.len {
        return Err(BackendError::Shape { op, msg: format!("{what} span {}..{} outside a buffer of {}", s.off, s.off + s.len, buf.len) });
    }
    Ok(())
}


impl Cuda {
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// A compiled kernel and the grid cap of `grid`, for launches on a stream other than
    /// the compute stream (the NCCL communicator's).
    pub(super) fn kernel_for_stream(&self, name: &str) -> BResult<(cudarc::driver::CudaFunction, u32)> {
        Ok((self.kernels.get(name)?.clone(), self.info.multiprocessors as u32 * 16))
    }

    pub(super) fn mem_stats(&self) -> &Arc<MemStats> {
        &self.mem
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Seconds NVRTC spent compiling at start-up (0 when the disk cache had everything).
    pub fn compile_seconds(&self) -> f64 {
        self.kernels.compile_s
    }

    /// Peak bytes of device memory held by this backend's buffers (workspace included).
    pub fn peak_bytes(&self) -> usize {
        self.mem.peak.load(Ordering::Relaxed)
    }

    pub fn reset_peak(&self) {
        self.mem.peak.store(self.mem.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// (free, total) bytes on the device as the driver reports them.
    pub fn mem_info(&self) -> BResult<(usize, usize)> {
        self.ctx.mem_get_info().map_err(dev("cuMemGetInfo"))
    }

    /// Starts capturing every op queued on the backend's stream into a graph.
    pub fn begin_capture(&self) -> BResult<()> {
        self.ctx.bind_to_thread().map_err(dev("begin_capture"))?;
        // SAFETY: the stream is ours and not already capturing.
        unsafe { dr::stream::begin_capture(self.stream.cu_stream(), cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
            .map_err(dev("cuStreamBeginCapture"))
    }

    /// Ends the capture begun by `begin_capture` and instantiates the graph.
    pub fn end_capture(&self) -> BResult<Graph> {
        // SAFETY: the stream is capturing (begin_capture succeeded).
        let graph = unsafe { dr::stream::end_capture(self.stream.cu_stream()) }.map_err(dev("cuStreamEndCapture"))?;
        // SAFETY: graph was just captured.
        let exec = unsafe { dr::graph::instantiate(graph, cudarc::driver::sys::CUgraphInstantiate_flags(0)) }.map_err(dev("cuGraphInstantiate"))?;
        Ok(Graph { exec, graph, stream: self.stream.cu_stream(), ctx: self.ctx.clone() })
    }

    /// Fills `buf` with deterministic pseudo-random values in [-scale, scale).
    pub fn fill_random(&self, buf: &mut CudaBuf, seed: u32, scale: f32) -> BResult<()> {
        let n = buf.len as i64;
        self.launch1("fill_random_kernel", buf.len, &mut kargs![buf.ptr, buf.dt(), n, seed, scale])
    }

    pub(super) fn raw_alloc_with(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, mem: &Arc<MemStats>, len: usize, ty: Ty) -> BResult<CudaBuf> {
        ctx.bind_to_thread().map_err(dev("alloc"))?;
        let bytes = (len * ty.size()).max(1);
        // SAFETY: plain device allocation, zeroed on our stream before any use.
        let ptr = unsafe { dr::malloc_sync(bytes) }.map_err(|e| BackendError::Device(format!("allocating {bytes} bytes on the GPU: {e}")))?;
        // SAFETY: ptr points to `bytes` bytes just allocated.
        unsafe { dr::memset_d8_async(ptr, 0, bytes, stream.cu_stream()) }.map_err(dev("cuMemsetD8Async"))?;
        // The zeroing must be done before any other stream writes the buffer: `upload_input`
        // copies on the copy stream, which is not ordered after this one, and a busy compute
        // stream (a rank waiting for its peers) would run the memset after the copy and wipe
        // the batch. Allocations are rare (buffers only grow), so waiting here costs nothing in
        // the steady state; during graph capture the memset is a node of the graph instead.
        if !gemm::capturing_stream(stream.cu_stream()) {
            stream.synchronize().map_err(dev("synchronizing a new buffer's zeroing"))?;
        }
        let live = mem.live.fetch_add(len * ty.size(), Ordering::Relaxed) + len * ty.size();
        mem.peak.fetch_max(live, Ordering::Relaxed);
        Ok(CudaBuf { ptr, len, ty, ctx: ctx.clone(), mem: mem.clone() })
    }

    pub(super) fn raw_alloc(&self, len: usize, ty: Ty) -> BResult<CudaBuf> {
        Self::raw_alloc_with(&self.ctx, &self.stream, &self.mem, len, ty)
    }

    /// Address of a scratch buffer of at least `len` bf16 elements (contents undefined).
    pub(super) fn scratch(&self, name: &'static str, len: usize) -> BResult<CUdeviceptr> {
        let mut s = self.scratch.lock().map_err(|_| BackendError::Device("scratch lock poisoned".into()))?;
        if s.slots.get(name).is_none_or(|b| b.len < len) {
            // The old buffer may still be read by queued kernels: drain the stream first.
            if s.slots.contains_key(name) {
                self.synchronize()?;
            }
            s.slots.remove(name);
            let b = self.raw_alloc(len, Ty::Half)?;
            s.slots.insert(name, b);
        }
        Ok(s.slots[name].ptr)
    }

    pub(super) fn grid(&self, n: usize) -> u32 {
        let blocks = n.div_ceil(THREADS as usize).max(1);
        blocks.min(self.info.multiprocessors as usize * 16) as u32
    }

    pub(super) fn launch(&self, name: &str, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, args: &mut [*mut c_void]) -> BResult<()> {
        let f = self.kernels.get(name)?;
        self.timed(name, || {
            // SAFETY: every launch site passes arguments whose types and order match the
            // kernel's signature in kernels/*.cu, device pointers to live buffers whose lengths
            // the caller checked against the shapes, and values that outlive this call.
            unsafe { dr::launch_kernel(f.cu_function(), grid, block, smem, self.stream.cu_stream(), args) }
                .map_err(|e| BackendError::Device(format!("launching {name}: {e}")))
        })
    }

    /// 1-D grid-stride launch over `n` elements.
    pub(super) fn launch1(&self, name: &str, n: usize, args: &mut [*mut c_void]) -> BResult<()> {
        self.launch(name, (self.grid(n), 1, 1), (THREADS, 1, 1), 0, args)
    }

    /// `launch` for a kernel using `smem` bytes of dynamic shared memory, raising the kernel's
    /// limit above the default 48 KiB first (a function attribute, not a stream operation, so
    /// it is allowed during graph capture).
    pub(super) fn launch_dyn(&self, name: &str, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, args: &mut [*mut c_void]) -> BResult<()> {
        self.allow_dynamic_smem(name, smem)?;
        self.launch(name, grid, block, smem, args)
    }

    /// Raises kernel `name`'s dynamic shared-memory limit to `smem` bytes where that is above
    /// the default 48 KiB.
    pub(super) fn allow_dynamic_smem(&self, name: &str, smem: u32) -> BResult<()> {
        // (from 32 KiB on: the kernel's static shared memory counts against the same default)
        if smem > 32 * 1024 {
            let f = self.kernels.get(name)?;
            f.set_attribute(cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
                .map_err(|e| BackendError::Device(format!("{name}: raising dynamic shared memory to {smem} bytes: {e}")))?;
        }
        Ok(())
    }

    /// `launch_dyn` in clusters of `cluster` blocks along x (`grid.0` a multiple of it).
    pub(super) fn launch_clustered(&self, name: &str, grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, cluster: u32, args: &mut [*mut c_void]) -> BResult<()> {
        use cudarc::driver::sys as cu;
        if cluster <= 1 {
            return self.launch_dyn(name, grid, block, smem, args);
        }
        let f = self.kernels.get(name)?;
        self.allow_dynamic_smem(name, smem)?;
        // (named "{name}/c{cluster}" in the profile's launch table)
        self.timed(&format!("{name}/c{cluster}"), || {
            let mut attr = cluster_attribute(cluster);
            let config = launch_config(grid, block, smem, self.stream.cu_stream(), &mut attr);
            // SAFETY: as in `launch`; the configuration and its one attribute outlive the call.
            let r = unsafe { cu::cuLaunchKernelEx(&config, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) };
            if r != cu::CUresult::CUDA_SUCCESS {
                return Err(BackendError::Device(format!("launching {name} in clusters of {cluster}: {r:?}")));
            }
            Ok(())
        })
    }

    /// How many clusters of `cluster` blocks of kernel `name` (`block` threads, `smem` bytes of
    /// dynamic shared memory each) the device runs at once; 0 where it cannot run them. Asked
    /// of the driver once per kernel and cluster size: a persistent grid larger than this would
    /// run its last clusters after the others.
    pub(super) fn max_active_clusters(&self, name: &str, block: u32, smem: u32, cluster: u32) -> BResult<u32> {
        use cudarc::driver::sys as cu;
        let key = (name.to_string(), cluster);
        if let Some(&n) = self.cluster_fit.lock().map_err(|_| BackendError::Device("cluster_fit lock poisoned".into()))?.get(&key) {
            return Ok(n);
        }
        let f = self.kernels.get(name)?;
        self.allow_dynamic_smem(name, smem)?;
        let mut attr = cluster_attribute(cluster);
        let config = launch_config((cluster * self.info.multiprocessors.max(1), 1, 1), (block, 1, 1), smem, self.stream.cu_stream(), &mut attr);
        let mut n: i32 = 0;
        // SAFETY: out-pointer to a live i32; the configuration and its attribute outlive the call.
        let r = unsafe { cu::cuOccupancyMaxActiveClusters(&mut n, f.cu_function(), &config) };
        let n = if r == cu::CUresult::CUDA_SUCCESS { n.max(0) as u32 } else { 0 };
        self.cluster_fit.lock().map_err(|_| BackendError::Device("cluster_fit lock poisoned".into()))?.insert(key, n);
        Ok(n)
    }

    pub(super) fn cast_impl(&self, dst: &mut CudaBuf, src: &CudaBuf) -> BResult<()> {
        self.flush_partial_sums()?;
        check_len("cast", "dst", dst, src.len)?;
        let n = src.len as i64;
        self.launch1("cast_kernel", src.len, &mut kargs![dst.ptr, dst.dt(), src.ptr, src.dt(), n])
    }

    pub(super) fn upload_impl(&self, dst: &mut CudaBuf, off: usize, src: &[f32]) -> BResult<()> {
        self.flush_partial_sums()?;
        check_len("upload", "dst", dst, off + src.len())?;
        self.ctx.bind_to_thread().map_err(dev("upload"))?;
        let s = self.stream.cu_stream();
        // SAFETY: the destination range was checked; the host slice outlives the copy because
        // the stream is synchronized before returning.
        unsafe {
            match dst.ty {
                Ty::F32 => dr::memcpy_htod_async(dst.at(off), src, s).map_err(dev("upload"))?,
                Ty::Half => {
                    let half = self.half_format();
                    let h: Vec<u16> = src.iter().map(|&x| half.to_bits(x)).collect();
                    dr::memcpy_htod_async(dst.at(off), &h, s).map_err(dev("upload"))?;
                    return self.synchronize();
                }
            }
        }
        self.synchronize()
    }

    pub(super) fn upload_input_impl(&self, dst: &mut CudaBuf, src: &[f32]) -> BResult<()> {
        check_len("upload_input", "dst", dst, src.len())?;
        // Small inputs (the targets) take the same path: the plain `upload` would make the host
        // wait for every queued kernel. During graph capture nothing may synchronize, so the
        // plain copy is the only choice there (the bench stages before capturing).
        if gemm::capturing_stream(self.stream.cu_stream()) {
            return self.upload(dst, 0, src);
        }
        self.ctx.bind_to_thread().map_err(dev("upload_input"))?;
        let bytes = src.len() * dst.ty.size();
        let i = self.next_staging.fetch_add(1, Ordering::Relaxed) % 2;
        let mut slots = self.staging.lock().map_err(|_| BackendError::Device("upload_input: staging lock poisoned".into()))?;
        let slot = &mut slots[i];
        // SAFETY: `done` is a live event; waiting on it means the copy that last read this
        // pinned buffer has finished, so it may be freed or rewritten.
        unsafe {
            if slot.in_flight {
                cudarc::driver::result::event::synchronize(slot.done).map_err(dev("cuEventSynchronize"))?;
                slot.in_flight = false;
            }
            if slot.bytes < bytes {
                if !slot.host.is_null() {
                    dr::free_host(slot.host).map_err(dev("cuMemFreeHost"))?;
                    slot.host = std::ptr::null_mut();
                    slot.bytes = 0;
                }
                slot.host = dr::malloc_host(bytes, 0).map_err(|e| BackendError::Device(format!("allocating {bytes} bytes of pinned host memory: {e}")))?;
                slot.bytes = bytes;
            }
        }
        let (copy, compute) = (self.copy_stream.cu_stream(), self.stream.cu_stream());
        // not before the queued forward that reads the current inputs has read them
        if let Some(ev) = self.inputs_read.lock().map_err(|_| BackendError::Device("upload_input: event lock poisoned".into()))?.as_ref() {
            // SAFETY: a live event of this context; the wait is enqueued on the copy stream.
            unsafe { cudarc::driver::result::stream::wait_event(copy, ev.cu_event(), cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                .map_err(dev("cuStreamWaitEvent"))?;
        }
        // a traced run times the copy itself on its stream
        let timed = match self.copy_timing.lock().map_err(|_| BackendError::Device("upload_input: copy timing lock poisoned".into()))?.is_some() {
            true => {
                let start = self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(dev("cuEventCreate"))?;
                start.record(&self.copy_stream).map_err(dev("cuEventRecord"))?;
                Some(start)
            }
            false => None,
        };
        // SAFETY: `host` holds `slot.bytes ≥ bytes` bytes of pinned memory that nothing else
        // touches until `done` fires; the destination range was checked; the compute stream
        // waits for `done` before any later kernel, and the caller guarantees no queued kernel
        // reads `dst` (the trait's contract).
        unsafe {
            match dst.ty {
                Ty::Half => {
                    let half = self.half_format();
                    let h = std::slice::from_raw_parts_mut(slot.host as *mut u16, src.len());
                    h.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(o, i)| {
                        for (o, &x) in o.iter_mut().zip(i) {
                            *o = half.to_bits(x);
                        }
                    });
                    dr::memcpy_htod_async(dst.ptr, &h[..], copy).map_err(dev("upload_input"))?;
                }
                Ty::F32 => {
                    let h = std::slice::from_raw_parts_mut(slot.host as *mut f32, src.len());
                    h.par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(o, i)| o.copy_from_slice(i));
                    dr::memcpy_htod_async(dst.ptr, &h[..], copy).map_err(dev("upload_input"))?;
                }
            }
            cudarc::driver::result::event::record(slot.done, copy).map_err(dev("cuEventRecord"))?;
            cudarc::driver::result::stream::wait_event(compute, slot.done, cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).map_err(dev("cuStreamWaitEvent"))?;
        }
        slot.in_flight = true;
        if let Some(start) = timed {
            let end = self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(dev("cuEventCreate"))?;
            end.record(&self.copy_stream).map_err(dev("cuEventRecord"))?;
            if let Some(list) = self.copy_timing.lock().map_err(|_| BackendError::Device("upload_input: copy timing lock poisoned".into()))?.as_mut() {
                list.push((start, end, bytes));
            }
        }
        Ok(())
    }

    /// The input copies timed since the last call, placed on the host clock: a probe recorded
    /// after them on the copy stream is reached as soon as they are done, and the host's clock
    /// when it is seen reached places every event before it (as the communicator's timing does).
    pub(super) fn take_input_copies_impl(&self, epoch: std::time::Instant) -> BResult<Vec<(String, f64, f64)>> {
        let taken = match self.copy_timing.lock().map_err(|_| BackendError::Device("copy timing lock poisoned".into()))?.as_mut() {
            Some(list) => std::mem::take(list),
            None => return Ok(Vec::new()),
        };
        if taken.is_empty() {
            return Ok(Vec::new());
        }
        let probe = self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).map_err(dev("cuEventCreate"))?;
        probe.record(&self.copy_stream).map_err(dev("cuEventRecord"))?;
        probe.synchronize().map_err(dev("cuEventSynchronize"))?;
        let now = epoch.elapsed().as_secs_f64();
        let secs = |a: &cudarc::driver::CudaEvent, b: &cudarc::driver::CudaEvent| -> BResult<f64> { Ok(a.elapsed_ms(b).map_err(dev("cuEventElapsedTime"))? as f64 * 1e-3) };
        let mut out = Vec::with_capacity(taken.len());
        for (start, end, bytes) in &taken {
            let end_s = now - secs(end, &probe)?;
            out.push((format!("input copy {:.1} MiB", *bytes as f64 / (1 << 20) as f64), end_s - secs(start, end)?, end_s));
        }
        Ok(out)
    }

    /// Records that the compute stream has read the staged inputs up to here (`inputs_read`).
    /// Not during graph capture: a captured record would belong to the graph's replays.
    pub(super) fn mark_inputs_read(&self) -> BResult<()> {
        if gemm::capturing_stream(self.stream.cu_stream()) {
            return Ok(());
        }
        let mut slot = self.inputs_read.lock().map_err(|_| BackendError::Device("inputs_consumed: event lock poisoned".into()))?;
        if slot.is_none() {
            *slot = Some(self.ctx.new_event(None).map_err(dev("creating the inputs event"))?);
        }
        if let Some(ev) = slot.as_ref() {
            ev.record(&self.stream).map_err(dev("recording the inputs event"))?;
        }
        Ok(())
    }

    pub(super) fn download_impl(&self, src: &CudaBuf) -> BResult<Vec<f32>> {
        self.synchronize()?;
        // SAFETY: the host vectors have exactly the buffer's byte size; the stream is idle.
        unsafe {
            match src.ty {
                Ty::F32 => {
                    let mut h = vec![0f32; src.len];
                    dr::memcpy_dtoh_sync(&mut h, src.ptr).map_err(dev("download"))?;
                    Ok(h)
                }
                Ty::Half => {
                    let mut h = vec![0u16; src.len];
                    dr::memcpy_dtoh_sync(&mut h, src.ptr).map_err(dev("download"))?;
                    let half = self.half_format();
                    Ok(h.into_iter().map(|b| half.from_bits(b)).collect())
                }
            }
        }
    }

    pub(super) fn fill_impl(&self, buf: &mut CudaBuf, value: f32) -> BResult<()> {
        self.flush_partial_sums()?;
        if value == 0.0 {
            // SAFETY: the whole allocation of `buf`.
            return unsafe { dr::memset_d8_async(buf.ptr, 0, buf.bytes(), self.stream.cu_stream()) }.map_err(dev("fill"));
        }
        let n = buf.len as i64;
        self.launch1("fill_kernel", buf.len, &mut kargs![buf.ptr, buf.dt(), n, value])
    }

    pub(super) fn copy_impl(&self, dst: &mut CudaBuf, src: &CudaBuf) -> BResult<()> {
        self.flush_partial_sums()?;
        check_len("copy", "dst", dst, src.len)?;
        if dst.ty == src.ty {
            // SAFETY: both ranges hold src.bytes() bytes.
            return unsafe { dr::memcpy_dtod_async(dst.ptr, src.ptr, src.bytes(), self.stream.cu_stream()) }.map_err(dev("copy"));
        }
        self.cast(dst, src)
    }

    pub(super) fn synchronize_impl(&self) -> BResult<()> {
        self.order_decoded_input()?;
        self.flush_partial_sums()?;
        self.stream.synchronize().map_err(dev("synchronize"))
    }
}

/// The launch attribute that groups blocks into clusters of `x` along the grid's x.
fn cluster_attribute(x: u32) -> cudarc::driver::sys::CUlaunchAttribute {
    use cudarc::driver::sys as cu;
    // SAFETY: a plain-old-data struct; the fields the driver reads for this id are set below.
    let mut attr: cu::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = cu::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim = cu::CUlaunchAttributeValue_union__bindgen_ty_1 { x, y: 1, z: 1 };
    attr
}

/// A `cuLaunchKernelEx` configuration with the one attribute `attr`.
fn launch_config(grid: (u32, u32, u32), block: (u32, u32, u32), smem: u32, stream: cudarc::driver::sys::CUstream, attr: &mut cudarc::driver::sys::CUlaunchAttribute) -> cudarc::driver::sys::CUlaunchConfig {
    cudarc::driver::sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block.0,
        blockDimY: block.1,
        blockDimZ: block.2,
        sharedMemBytes: smem,
        hStream: stream,
        attrs: attr,
        numAttrs: 1,
    }
}
