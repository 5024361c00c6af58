//! The CUDA driver API, loaded at run time: availability checks that never panic, the device's
//! primary context (shared with PyTorch, CuPy or any runtime-API program in the process), device
//! memory ordered on a stream, events, and kernel launches. Nothing else in gradacc calls the
//! driver directly.

// Streams, events and contexts are opaque driver handles typed as raw pointers: gradacc passes
// them to the driver and never dereferences them.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::driver_api::{self, Api, MemAccessDesc, ERROR_OUT_OF_MEMORY, SUCCESS};
use crate::error::{Error, ErrorKind, Result};

pub use sys::{CUdeviceptr, CUstream};

// The core names device addresses without the driver's types: they must be the same type.
const _: fn(crate::device::DevicePtr) -> CUdeviceptr = |p| p;

/// `CU_STREAM_PER_THREAD`: the calling thread's own default stream, another stream on every thread.
const STREAM_PER_THREAD: usize = 0x2;

/// Whether the CUDA driver library can be loaded and initialised and sees at least one device.
/// Never panics: the driver is reached only through pointers resolved after the library was
/// found (cudarc's loader panics when it is missing).
pub fn driver_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let Ok(api) = driver_api::get() else { return false };
        let mut count = 0;
        // SAFETY: `api` holds entry points resolved from the loaded libcuda with their cuda.h
        // prototypes; cuInit takes flags 0, and cuDeviceGetCount runs only after it succeeded
        // (`&&`) and writes one `int` to `count`, a live local.
        unsafe {
            (api.cuInit)(0) == SUCCESS && (api.cuDeviceGetCount)(&mut count) == SUCCESS && count > 0
        }
    })
}

/// A 4-byte allocation in the primary context `context` and its process-unique id: the sentinel
/// a reset of the context destroys ([`Context::was_reset`]). Never freed: it lives as long as the
/// context's state.
fn sentinel(api: &'static Api, context: sys::CUcontext) -> Result<(CUdeviceptr, u64)> {
    // SAFETY: `context` was just retained by cuDevicePrimaryCtxRetain, so it can be pushed.
    check(api, unsafe { (api.cuCtxPushCurrent_v2)(context) }, "cuCtxPushCurrent")?;
    let _pop = ContextGuard { api };
    let (mut ptr, mut id) = (0, 0u64);
    // SAFETY: the context is current; `ptr` is a live out-pointer for the allocation's address.
    check(api, unsafe { (api.cuMemAlloc_v2)(&mut ptr, 4) }, "cuMemAlloc")?;
    // SAFETY: `ptr` is the live allocation just made; the attribute is a 64-bit id written to
    // `id`, a live local.
    let code = unsafe {
        (api.cuPointerGetAttribute)(
            &mut id as *mut u64 as *mut c_void,
            driver_api::POINTER_ATTRIBUTE_BUFFER_ID,
            ptr,
        )
    };
    check(api, code, "cuPointerGetAttribute")?;
    Ok((ptr, id))
}

/// Fails with BACKEND_UNAVAILABLE unless the driver is usable.
pub fn require_driver() -> Result<()> {
    if driver_available() {
        return Ok(());
    }
    let why = match driver_api::get() {
        Err(why) => why,
        Ok(_) => "cuInit failed or no device is visible",
    };
    Err(Error::new(ErrorKind::BackendUnavailable, format!("no usable CUDA driver: {why}")))
}

/// The CUDA version the driver supports (as 13000 for 13.0), or None without a driver library.
/// Needs no device and no cuInit.
pub fn driver_version() -> Option<i32> {
    let api = driver_api::get().ok()?;
    let mut version = 0;
    // SAFETY: `api` holds entry points resolved from the loaded libcuda with their cuda.h
    // prototypes; cuDriverGetVersion writes one `int` to `version`, a live local.
    (unsafe { (api.cuDriverGetVersion)(&mut version) } == SUCCESS).then_some(version)
}

/// The number of CUDA devices visible to the process (0 without a usable driver).
pub fn device_count() -> i32 {
    let (true, Ok(api)) = (driver_available(), driver_api::get()) else { return 0 };
    let mut count = 0;
    // SAFETY: `driver_available` returned true, so cuInit succeeded in this process; the driver
    // writes one `int` to `count`, a live local.
    if unsafe { (api.cuDeviceGetCount)(&mut count) } == SUCCESS {
        count
    } else {
        0
    }
}

/// Refuses a stream handle gradacc cannot order work on: `CU_STREAM_PER_THREAD` (0x2) names a
/// different stream on every calling thread, while an object's calls may come from any thread
/// and must all land on one stream. NULL and `CU_STREAM_LEGACY` (0x1) are the legacy stream.
/// `argument` names the stream as the error shows it (quoted as in "`stream`").
pub fn check_stream(stream: CUstream, argument: &str) -> Result<()> {
    if stream as usize == STREAM_PER_THREAD {
        return Err(Error::invalid(format!(
            "{argument} = {stream:p} is CU_STREAM_PER_THREAD (cudaStreamPerThread), a different stream on every calling thread; \
             pass a stream of your own, or NULL for the legacy default stream"
        )));
    }
    Ok(())
}

/// Turns a driver result code into an error naming the call, the code and the driver's text.
/// Any number is accepted: a code this build does not know is reported, not misread.
fn check(api: &Api, code: u32, what: &str) -> Result<()> {
    if code == SUCCESS {
        return Ok(());
    }
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString takes any code; for one it knows it writes a pointer to a static
    // string, for one it does not it fails and the pointer stays null.
    let known = unsafe { (api.cuGetErrorString)(code, &mut text) } == SUCCESS && !text.is_null();
    let text = if known {
        // SAFETY: `known` means cuGetErrorString succeeded and left `text` non-null, pointing at a
        // NUL-terminated string in the driver's static data, which lives as long as the library
        // (never unloaded); the borrow ends with this expression's `to_string_lossy`.
        unsafe { CStr::from_ptr(text) }.to_string_lossy()
    } else {
        "a result code this driver does not describe".into()
    };
    let kind =
        if code == ERROR_OUT_OF_MEMORY { ErrorKind::OutOfMemory } else { ErrorKind::DeviceFailure };
    Err(Error::new(kind, format!("{what} failed: CUDA driver result {code} ({text})")))
}

/// One device's primary context, retained for as long as any gradacc object on the device lives.
///
/// A host program may reset the primary context (`cudaDeviceReset`, `cuDevicePrimaryCtxReset`):
/// everything made in it is destroyed, gradacc's kernels included. A 4-byte allocation made with
/// the `Context` (the sentinel) is destroyed too, which is how the reset is noticed: the next
/// object on the device gets a new `Context` (and its kernels are loaded again), and a call of an
/// object made before the reset that fails says why.
pub struct Context {
    pub ordinal: i32,
    /// Unique in the process: a reset's new `Context` for the same device has another.
    pub id: u64,
    context: sys::CUcontext,
    /// The sentinel's address and its allocation's process-unique id.
    sentinel: (CUdeviceptr, u64),
    api: &'static Api,
    /// (major, minor) compute capability.
    pub capability: (i32, i32),
    pub multiprocessors: u32,
    /// Whether the device has stream-ordered memory pools (`cuMemAllocAsync`); without them
    /// buffers come from `cuMemAlloc` and a free waits for the buffer's stream first.
    memory_pools: bool,
}

// SAFETY: the only non-Send field is the CUcontext handle, which the driver lets any thread make
// current (`enter` pushes it on the calling thread); `api` is `&'static` and the rest is plain
// data.
unsafe impl Send for Context {}
// SAFETY: no field changes after `get` builds the struct and every method takes `&self`, so shared
// use only reads; the handle goes to driver calls, which are thread-safe.
unsafe impl Sync for Context {}

impl Context {
    /// The primary context of device `ordinal`, shared by every gradacc object on that device.
    pub fn get(ordinal: i32) -> Result<Arc<Context>> {
        require_driver()?;
        let api =
            driver_api::get().map_err(|why| Error::new(ErrorKind::BackendUnavailable, why))?;
        static CONTEXTS: Mutex<Vec<Arc<Context>>> = Mutex::new(Vec::new());
        let mut contexts = CONTEXTS.lock();
        if let Some(i) = contexts.iter().position(|c| c.ordinal == ordinal) {
            if !contexts[i].was_reset() {
                return Ok(contexts[i].clone());
            }
            // Retained again below, which makes the primary context active again.
            contexts.remove(i);
        }
        let mut count = 0;
        // SAFETY: `require_driver` saw cuInit succeed; the driver writes one `int` to `count`.
        check(api, unsafe { (api.cuDeviceGetCount)(&mut count) }, "cuDeviceGetCount")?;
        if ordinal < 0 || ordinal >= count {
            return Err(Error::invalid(format!(
                "`device`.ordinal = {ordinal}, but {count} CUDA device(s) are visible"
            )));
        }
        let mut device = 0;
        // SAFETY: `ordinal` is in 0..count (checked just above); `device` is a live CUdevice.
        check(api, unsafe { (api.cuDeviceGet)(&mut device, ordinal) }, "cuDeviceGet")?;
        let mut context = std::ptr::null_mut();
        check(
            api,
            // SAFETY: `device` came from the successful cuDeviceGet above; `context` is a live
            // CUcontext.
            unsafe { (api.cuDevicePrimaryCtxRetain)(&mut context, device) },
            "cuDevicePrimaryCtxRetain",
        )?;
        let attribute = |a: sys::CUdevice_attribute| {
            let mut v = 0;
            // SAFETY: `a` is a CUdevice_attribute value from cudarc's cuda.h bindings, `device`
            // came from cuDeviceGet above, and the driver writes one `int` to `v`, a live local.
            check(
                api,
                unsafe { (api.cuDeviceGetAttribute)(&mut v, a as c_int, device) },
                "cuDeviceGetAttribute",
            )
            .map(|_| v)
        };
        use sys::CUdevice_attribute::*;
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let c = Arc::new(Context {
            ordinal,
            id: IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            context,
            sentinel: sentinel(api, context)?,
            api,
            capability: (
                attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            multiprocessors: attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32,
            memory_pools: attribute(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? != 0,
        });
        if c.memory_pools {
            c.grant_peer_access(device, count)?;
        }
        // Kept for the life of the process: the primary context is the runtime API's too, so
        // releasing it under a framework that uses the device would gain nothing.
        contexts.push(c.clone());
        Ok(c)
    }

    /// Lets every other visible device read and write this device's stream-ordered allocations,
    /// once per device and process. Several ranks in one process hand NCCL masters that the
    /// peers' kernels access directly, and a pool allocation is reachable only from its own
    /// device unless its pool grants access. A peer the hardware cannot reach is refused by the
    /// driver and left out: NCCL then stages through host memory and never touches the buffer
    /// from that device.
    fn grant_peer_access(&self, device: sys::CUdevice, count: i32) -> Result<()> {
        let api = self.api;
        let _g = self.enter()?;
        let mut pool = std::ptr::null_mut();
        check(
            api,
            // SAFETY: `device` is the handle `get` had from cuDeviceGet for this context; the
            // driver writes one CUmemoryPool to `pool`, a live local.
            unsafe { (api.cuDeviceGetDefaultMemPool)(&mut pool, device) },
            "cuDeviceGetDefaultMemPool",
        )?;
        for peer in (0..count).filter(|&p| p != self.ordinal) {
            let mut peer_device = 0;
            // SAFETY: `peer` is in 0..count, the device count `get` read; `peer_device` is live.
            check(api, unsafe { (api.cuDeviceGet)(&mut peer_device, peer) }, "cuDeviceGet")?;
            let access = MemAccessDesc {
                location_type: driver_api::MEM_LOCATION_TYPE_DEVICE,
                location_id: peer_device,
                flags: driver_api::MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: `pool` came from cuDeviceGetDefaultMemPool above; the count is 1 and `access`
            // is one live `MemAccessDesc`, `#[repr(C)]` with CUmemAccessDesc's fields and layout.
            let _ = unsafe { (api.cuMemPoolSetAccess)(pool, &access, 1) };
        }
        Ok(())
    }

    /// Whether the device's primary context was reset since this `Context` was made: its
    /// sentinel allocation is gone (or its address holds another allocation).
    pub fn was_reset(&self) -> bool {
        // SAFETY: as in `enter`; a push the driver refuses counts as a reset.
        if unsafe { (self.api.cuCtxPushCurrent_v2)(self.context) } != SUCCESS {
            return true;
        }
        let _g = ContextGuard { api: self.api };
        let mut id: u64 = 0;
        // SAFETY: `_g` made the context current; the attribute is a 64-bit id, written to `id`,
        // a live local; any address may be asked about (an unknown one is an error code).
        let code = unsafe {
            (self.api.cuPointerGetAttribute)(
                &mut id as *mut u64 as *mut c_void,
                driver_api::POINTER_ATTRIBUTE_BUFFER_ID,
                self.sentinel.0,
            )
        };
        code != SUCCESS || id != self.sentinel.1
    }

    /// [`check`] for a call in this context: a failure after a reset of the primary context is
    /// reported as that, since the object's memory, streams and kernels are gone.
    fn check(&self, code: u32, what: &str) -> Result<()> {
        check(self.api, code, what).map_err(|e| {
            if !self.was_reset() {
                return e;
            }
            Error::new(
                ErrorKind::DeviceFailure,
                format!(
                    "{what} failed: device {}'s primary context was reset (cudaDeviceReset or cuDevicePrimaryCtxReset) after this object was created, destroying its memory, streams and kernels; destroy the object and create it again",
                    self.ordinal
                ),
            )
        })
    }

    /// Whether buffers are stream-ordered pool allocations (else `cuMemAlloc`).
    pub fn memory_pools(&self) -> bool {
        self.memory_pools
    }

    /// Makes this context current on the calling thread until the guard drops, then restores the
    /// caller's context: gradacc never leaves a different context current behind.
    pub fn enter(&self) -> Result<ContextGuard> {
        // SAFETY: `self.context` was retained by cuDevicePrimaryCtxRetain in `get` and is never
        // released, so it is a live context to push (after a reset of it the driver may refuse
        // the push, and `check` says why).
        let code = unsafe { (self.api.cuCtxPushCurrent_v2)(self.context) };
        self.check(code, "cuCtxPushCurrent")?;
        Ok(ContextGuard { api: self.api })
    }

    /// The device's SM count times a small factor: enough blocks to fill it for grid-stride loops.
    pub fn grid_for(&self, work_items: u64) -> u32 {
        (work_items.max(1)).min(self.multiprocessors as u64 * 8) as u32
    }
}

pub struct ContextGuard {
    api: &'static Api,
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        let mut previous = std::ptr::null_mut();
        // SAFETY: a guard exists only after `enter`'s push succeeded, so this pops that context;
        // the driver writes the popped handle to `previous`, a live local.
        unsafe { (self.api.cuCtxPopCurrent_v2)(&mut previous) };
    }
}

/// A device allocation, stream-ordered: allocated and freed on `stream` (the caller's), so it
/// never synchronises the device. Or a caller's buffer, adopted and never freed.
///
/// On a device without memory pools the memory comes from `cuMemAlloc`, which is not stream
/// ordered: the free then waits for the buffer's stream first.
pub struct DeviceBuffer {
    ctx: Arc<Context>,
    ptr: CUdeviceptr,
    bytes: usize,
    stream: CUstream,
    owned: bool,
}

// SAFETY: the raw fields are a device address (an integer) and a CUstream handle, which the
// driver accepts from any thread once the owning context is current, as every method makes it.
unsafe impl Send for DeviceBuffer {}
// SAFETY: no field changes after construction and every method takes `&self`; the copies and
// fills it enqueues are ordered by the stream, not by Rust borrows.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// `bytes` of device memory, zero-filled, ordered on `stream`.
    pub fn zeroed(ctx: &Arc<Context>, stream: CUstream, bytes: usize) -> Result<Self> {
        let api = ctx.api;
        let _g = ctx.enter()?;
        let mut ptr = 0;
        let size = bytes.max(4);
        if ctx.memory_pools {
            ctx.check(
                // SAFETY: `_g` made `ctx` current and `stream` is a stream of it (the constructors'
                // callers pass the stream their object was created with); `ptr` is a live
                // out-pointer.
                unsafe { (api.cuMemAllocAsync)(&mut ptr, size, stream) },
                "cuMemAllocAsync",
            )?;
        } else {
            // SAFETY: `_g` made `ctx` current, so the memory belongs to it; `ptr` is a live
            // out-pointer.
            ctx.check(unsafe { (api.cuMemAlloc_v2)(&mut ptr, size) }, "cuMemAlloc")?;
        }
        let buffer = DeviceBuffer { ctx: ctx.clone(), ptr, bytes, stream, owned: true };
        // SAFETY: the allocation above succeeded (`?`) with exactly `size` bytes at `ptr`, usable
        // on `stream`, and the fill covers those bytes only.
        ctx.check(unsafe { (api.cuMemsetD8Async)(ptr, 0, size, stream) }, "cuMemsetD8Async")?;
        Ok(buffer)
    }

    /// `values` copied to a new device buffer, ordered on `stream`.
    pub fn from_slice<T: Copy>(ctx: &Arc<Context>, stream: CUstream, values: &[T]) -> Result<Self> {
        let buffer = DeviceBuffer::zeroed(ctx, stream, std::mem::size_of_val(values))?;
        buffer.write(values)?;
        Ok(buffer)
    }

    /// Adopts a caller's device buffer of `bytes` bytes; it is never freed here.
    pub fn adopt(ctx: &Arc<Context>, stream: CUstream, ptr: CUdeviceptr, bytes: usize) -> Self {
        DeviceBuffer { ctx: ctx.clone(), ptr, bytes, stream, owned: false }
    }

    /// The buffer's size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// Enqueues a copy of `values` to the start of the buffer. The host values are staged by the
    /// driver before this returns, so they may be dropped at once.
    pub fn write<T: Copy>(&self, values: &[T]) -> Result<()> {
        self.write_at(0, values)
    }

    /// Enqueues a copy of `values` to byte offset `offset`.
    pub fn write_at<T: Copy>(&self, offset: usize, values: &[T]) -> Result<()> {
        let bytes = std::mem::size_of_val(values);
        assert!(offset + bytes <= self.bytes, "device write out of bounds");
        if bytes == 0 {
            return Ok(());
        }
        let api = self.ctx.api;
        let _g = self.ctx.enter()?;
        let dst = self.ptr + offset as u64;
        // SAFETY: offset + bytes <= self.bytes (asserted above), so the destination is inside the
        // buffer; the source is `values`, `bytes` readable bytes, which the driver stages from
        // pageable host memory before returning, so the slice need not outlive the call.
        self.ctx.check(
            unsafe {
                (api.cuMemcpyHtoDAsync_v2)(
                    dst,
                    values.as_ptr() as *const c_void,
                    bytes,
                    self.stream,
                )
            },
            "cuMemcpyHtoDAsync",
        )
    }

    /// Reads the buffer's first `out.len()` values: waits for the stream first (a host read).
    pub fn read<T: Copy>(&self, out: &mut [T]) -> Result<()> {
        self.read_at(0, out)
    }

    /// Reads `out.len()` values from byte offset `offset` (a host read, as `read`).
    pub fn read_at<T: Copy>(&self, offset: usize, out: &mut [T]) -> Result<()> {
        let bytes = std::mem::size_of_val(out);
        assert!(offset + bytes <= self.bytes, "device read out of bounds");
        let api = self.ctx.api;
        let _g = self.ctx.enter()?;
        let src = self.ptr + offset as u64;
        self.ctx.check(
            // SAFETY: offset + bytes <= self.bytes (asserted above), so the source is inside the
            // buffer; `out` is `bytes` writable bytes borrowed mutably until the synchronise below,
            // which completes the copy before `out` is released or read.
            unsafe {
                (api.cuMemcpyDtoHAsync_v2)(out.as_mut_ptr() as *mut c_void, src, bytes, self.stream)
            },
            "cuMemcpyDtoHAsync",
        )?;
        // SAFETY: `self.stream` is the stream the buffer was made on, in the context `_g` made
        // current.
        self.ctx.check(unsafe { (api.cuStreamSynchronize)(self.stream) }, "cuStreamSynchronize")
    }

    /// Enqueues a copy of `bytes` bytes from byte `from_at` of `from` (a buffer of the same
    /// context) to byte `at` of this buffer, on this buffer's stream.
    pub fn copy_from(
        &self,
        at: usize,
        from: &DeviceBuffer,
        from_at: usize,
        bytes: usize,
    ) -> Result<()> {
        assert!(
            at + bytes <= self.bytes && from_at + bytes <= from.bytes,
            "device copy out of bounds"
        );
        assert!(Arc::ptr_eq(&self.ctx, &from.ctx), "a device copy across contexts");
        if bytes == 0 {
            return Ok(());
        }
        let api = self.ctx.api;
        let _g = self.ctx.enter()?;
        let (dst, src) = (self.ptr + at as u64, from.ptr + from_at as u64);
        // SAFETY: both ranges lie inside their buffers (asserted above), device memory of the
        // context `_g` made current; the stream orders the copy after this buffer's earlier work.
        self.ctx.check(
            unsafe { (api.cuMemcpyDtoDAsync_v2)(dst, src, bytes, self.stream) },
            "cuMemcpyDtoDAsync",
        )
    }

    /// Enqueues zeroing `count` f32 values from element `start`.
    pub fn zero_f32(&self, start: usize, count: usize) -> Result<()> {
        assert!((start + count) * 4 <= self.bytes, "device fill out of bounds");
        if count == 0 {
            return Ok(());
        }
        let api = self.ctx.api;
        let _g = self.ctx.enter()?;
        // SAFETY: (start + count) * 4 <= self.bytes (asserted above), so the `count` 32-bit words
        // from element `start` are inside the buffer; `_g` made its context current.
        self.ctx.check(
            unsafe { (api.cuMemsetD32Async)(self.ptr + 4 * start as u64, 0, count, self.stream) },
            "cuMemsetD32Async",
        )
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let api = self.ctx.api;
        if let Ok(_g) = self.ctx.enter() {
            if self.ctx.memory_pools {
                // SAFETY: `owned` buffers come only from `zeroed`, which used cuMemAllocAsync when
                // `memory_pools`; `drop` runs once, and the free is ordered on the buffer's stream
                // after its work (the owners order other streams' uses before it with events).
                unsafe { (api.cuMemFreeAsync)(self.ptr, self.stream) };
            } else {
                // cuMemFree takes effect at once: wait for every use enqueued before it (other
                // streams' uses are ordered before the buffer's stream's end with events).
                // SAFETY: `owned` buffers come only from `zeroed`, which used cuMemAlloc without
                // pools; `drop` runs once, and the synchronise completes the buffer's last use
                // before the free.
                unsafe {
                    (api.cuStreamSynchronize)(self.stream);
                    (api.cuMemFree_v2)(self.ptr);
                }
            }
        }
    }
}

/// The id of the device allocation holding `ptr` (`CU_POINTER_ATTRIBUTE_BUFFER_ID`), or None
/// when `ptr` is not device memory the driver knows (host memory, a freed buffer). Never touches
/// the memory and does not wait.
pub fn buffer_id(ctx: &Context, ptr: CUdeviceptr) -> Result<Option<u64>> {
    let _g = ctx.enter()?;
    let mut id: u64 = 0;
    // SAFETY: `_g` made `ctx` current; the attribute is a 64-bit id written to `id`, a live
    // local; any address may be asked about (an unknown one is an error code, not a fault).
    let code = unsafe {
        (ctx.api.cuPointerGetAttribute)(
            &mut id as *mut u64 as *mut c_void,
            driver_api::POINTER_ATTRIBUTE_BUFFER_ID,
            ptr,
        )
    };
    Ok((code == SUCCESS && id != 0).then_some(id))
}

/// Waits on the host for everything enqueued on `stream` so far.
pub fn synchronize(ctx: &Context, stream: CUstream) -> Result<()> {
    let _g = ctx.enter()?;
    // SAFETY: `_g` made `ctx` current; `stream` is a stream of it, as every caller passes the
    // stream its object was created on in that context.
    ctx.check(unsafe { (ctx.api.cuStreamSynchronize)(stream) }, "cuStreamSynchronize")
}

/// Waits on the host for everything enqueued on `stream` so far, like [`synchronize`], but fails
/// with TIMEOUT once `timeout` has passed, and with `healthy`'s error as soon as it reports one
/// (called between polls: a communicator's health, so a failed peer ends the wait). Sleeps
/// between polls, a little longer each time up to 1 ms, so a long wait costs no core.
pub fn wait_until_done(
    ctx: &Context,
    stream: CUstream,
    timeout: Option<Duration>,
    mut healthy: impl FnMut() -> Result<()>,
) -> Result<()> {
    const NOT_READY: u32 = 600;
    let start = Instant::now();
    let mut pause = Duration::from_micros(5);
    loop {
        let code = {
            let _g = ctx.enter()?;
            // SAFETY: `_g` made `ctx` current; `stream` is a stream of it (as for `synchronize`).
            unsafe { (ctx.api.cuStreamQuery)(stream) }
        };
        if code != NOT_READY {
            return ctx.check(code, "cuStreamQuery");
        }
        healthy()?;
        if let Some(t) = timeout.filter(|&t| start.elapsed() >= t) {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("the stream's work did not complete within {t:?}"),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

/// Enqueues a device-to-device copy of `bytes` bytes on `stream` (the bandwidth floor of the
/// benchmarks).
pub fn copy(
    ctx: &Context,
    stream: CUstream,
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
) -> Result<()> {
    let _g = ctx.enter()?;
    // SAFETY: `_g` made `ctx` current; `dst` and `src` are each `bytes` bytes of device memory of
    // this context: the one caller, the copy-bandwidth benchmark, passes two buffers it allocated
    // with at least that size.
    ctx.check(
        unsafe { (ctx.api.cuMemcpyDtoDAsync_v2)(dst, src, bytes, stream) },
        "cuMemcpyDtoDAsync",
    )
}

/// Whether `stream` is capturing a CUDA graph (an invalidated capture counts: its stream is still
/// in capture mode until the capture ends).
pub fn capturing(ctx: &Context, stream: CUstream) -> Result<bool> {
    let _g = ctx.enter()?;
    let mut status: c_int = 0;
    // SAFETY: `_g` made `ctx` current; `stream` is a stream of it (callers pass their objects'
    // streams); the driver writes one CUstreamCaptureStatus (an `int`) to `status`, a live local.
    let code = unsafe { (ctx.api.cuStreamIsCapturing)(stream, &mut status) };
    ctx.check(code, "cuStreamIsCapturing")?;
    Ok(status != 0)
}

/// An event used only for ordering (no timing), created in `ctx`.
pub struct Event {
    ctx: Arc<Context>,
    event: sys::CUevent,
}

// SAFETY: the only non-Send field is the CUevent handle, which the driver lets any thread record
// and wait on once its context is current (every method enters `ctx` first).
unsafe impl Send for Event {}
// SAFETY: the handle never changes after `new` and every method takes `&self`; the driver
// serialises cuEventRecord and cuStreamWaitEvent on one event internally.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(ctx: &Arc<Context>) -> Result<Self> {
        let _g = ctx.enter()?;
        let mut event = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `_g` made `ctx` current; CU_EVENT_DISABLE_TIMING is a valid flag and `event` is a
        // live out-pointer.
        ctx.check(unsafe { (ctx.api.cuEventCreate)(&mut event, flags) }, "cuEventCreate")?;
        Ok(Event { ctx: ctx.clone(), event })
    }

    /// Captures everything enqueued on `stream` so far.
    pub fn record(&self, stream: CUstream) -> Result<()> {
        let _g = self.ctx.enter()?;
        // SAFETY: `self.event` is live (created in `new`, destroyed only in `drop`) and belongs to
        // the context `_g` made current; `stream` is a stream of that context, as callers pass
        // their object's streams.
        self.ctx.check(unsafe { (self.ctx.api.cuEventRecord)(self.event, stream) }, "cuEventRecord")
    }

    /// Makes `stream` wait (on the device) for the work the last `record` captured.
    pub fn wait(&self, stream: CUstream) -> Result<()> {
        let _g = self.ctx.enter()?;
        // SAFETY: as in `record`: a live event of the current context and one of its streams;
        // flags 0 is the only value the driver defines.
        self.ctx.check(
            unsafe { (self.ctx.api.cuStreamWaitEvent)(stream, self.event, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// As [`Event::record`] on a stream that is not capturing a graph. On one that is (`capturing`),
    /// the record becomes a node of the graph (CU_EVENT_RECORD_EXTERNAL): every replay records the
    /// event, so a stream outside the graph can wait for the replay's work.
    pub fn record_across_capture(&self, stream: CUstream, capturing: bool) -> Result<()> {
        if !capturing {
            return self.record(stream);
        }
        let _g = self.ctx.enter()?;
        // SAFETY: as in `record`; CU_EVENT_RECORD_EXTERNAL is the flag for a capturing stream.
        self.ctx.check(
            unsafe {
                (self.ctx.api.cuEventRecordWithFlags)(
                    self.event,
                    stream,
                    driver_api::EVENT_RECORD_EXTERNAL,
                )
            },
            "cuEventRecordWithFlags",
        )
    }

    /// As [`Event::wait`] on a stream that is not capturing a graph. On one that is (`capturing`),
    /// the wait becomes a node of the graph (CU_EVENT_WAIT_EXTERNAL) that waits, at every replay,
    /// for the event's last record before the replay: a capture may not otherwise wait for work
    /// recorded outside it (CUDA_ERROR_STREAM_CAPTURE_ISOLATION).
    pub fn wait_across_capture(&self, stream: CUstream, capturing: bool) -> Result<()> {
        if !capturing {
            return self.wait(stream);
        }
        let _g = self.ctx.enter()?;
        // SAFETY: as in `wait`; CU_EVENT_WAIT_EXTERNAL is the flag for a capturing stream.
        self.ctx.check(
            unsafe {
                (self.ctx.api.cuStreamWaitEvent)(
                    stream,
                    self.event,
                    driver_api::EVENT_WAIT_EXTERNAL,
                )
            },
            "cuStreamWaitEvent",
        )
    }

    /// Makes `later` wait (on the device) for everything enqueued on `earlier` so far.
    /// No-op when they are the same stream.
    pub fn order(&self, earlier: CUstream, later: CUstream) -> Result<()> {
        if earlier == later {
            return Ok(());
        }
        self.record(earlier)?;
        self.wait(later)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_g) = self.ctx.enter() {
            // SAFETY: `self.event` was created by cuEventCreate in `new` and is destroyed only
            // here, once; the driver defers the release past work that still uses it.
            unsafe { (self.ctx.api.cuEventDestroy_v2)(self.event) };
        }
    }
}

/// A buffer owned by one stream and read by kernels on others: the happens-before edges both
/// ways. A reader stream waits for the owner's writes before it reads (only when a write was
/// enqueued since it last waited), and the owner waits for every read before it next writes or
/// frees the buffer. One event per reader stream, reused; one record per read.
///
/// Either side may be captured into a CUDA graph while the other is not (the caller captures its
/// step on one stream, and the other object's stream runs outside the graph): a capturing stream
/// records and waits through graph nodes (`Event::record_across_capture`, `wait_across_capture`),
/// and since replays then read or write behind the host's back, that side's events are waited for
/// at every later write or read, not only when the host saw one enqueued.
pub struct SharedReads {
    ctx: Arc<Context>,
    owner: CUstream,
    /// Recorded on the owner's stream after each write.
    written: Event,
    /// Writes enqueued so far (each followed by a record of `written`).
    writes: u64,
    /// A write was captured into a graph: every read waits for `written`.
    writes_replayed: bool,
    readers: Vec<Reader>,
}

struct Reader {
    stream: CUstream,
    /// Recorded on the reader's stream after each read.
    read: Event,
    /// A read was recorded that the owner has not waited for yet.
    pending: bool,
    /// A read was captured into a graph: every write waits for `read`.
    replayed: bool,
    /// The value of `writes` this stream last waited for.
    seen: u64,
}

// SAFETY: its only non-Send fields are CUstream handles, which it only passes to driver calls
// (through `Event`, itself Send) after entering the context; those calls work from any thread.
unsafe impl Send for SharedReads {}
// SAFETY: every method takes `&mut self`, so a `&SharedReads` shared across threads allows no
// access to the handles or counters at all.
unsafe impl Sync for SharedReads {}

impl SharedReads {
    pub fn new(ctx: &Arc<Context>, owner: CUstream) -> Result<Self> {
        Ok(SharedReads {
            ctx: ctx.clone(),
            owner,
            written: Event::new(ctx)?,
            writes: 0,
            writes_replayed: false,
            readers: Vec::new(),
        })
    }

    /// Before a read enqueued on `stream`: it waits for the owner's writes it has not seen. A
    /// capturing stream always waits: the graph's replays must wait for the writes before each.
    pub fn before_read(&mut self, stream: CUstream) -> Result<()> {
        if stream == self.owner {
            return Ok(());
        }
        let capturing = capturing(&self.ctx, stream)?;
        let writes = self.writes;
        let i = match self.readers.iter().position(|r| r.stream == stream) {
            Some(i) => i,
            None => {
                self.readers.push(Reader {
                    stream,
                    read: Event::new(&self.ctx)?,
                    pending: false,
                    replayed: false,
                    seen: 0,
                });
                self.readers.len() - 1
            }
        };
        if self.readers[i].seen != writes || capturing || self.writes_replayed {
            self.written.wait_across_capture(stream, capturing)?;
            self.readers[i].seen = writes;
        }
        Ok(())
    }

    /// After a read enqueued on `stream` (following `before_read`).
    pub fn after_read(&mut self, stream: CUstream) -> Result<()> {
        if stream == self.owner {
            return Ok(());
        }
        let capturing = capturing(&self.ctx, stream)?;
        if let Some(r) = self.readers.iter_mut().find(|r| r.stream == stream) {
            r.read.record_across_capture(stream, capturing)?;
            r.pending = true;
            r.replayed |= capturing;
        }
        Ok(())
    }

    /// Before the owner's stream writes or frees the buffer: it waits for every read. A capturing
    /// owner waits for every reader's last read: the graph's replays must wait for the reads
    /// before each.
    pub fn before_write(&mut self) -> Result<()> {
        if self.readers.is_empty() {
            return Ok(());
        }
        let capturing = capturing(&self.ctx, self.owner)?;
        for r in self.readers.iter_mut().filter(|r| r.pending || r.replayed || capturing) {
            r.read.wait_across_capture(self.owner, capturing)?;
            r.pending = false;
        }
        Ok(())
    }

    /// After a write enqueued on the owner's stream.
    pub fn after_write(&mut self) -> Result<()> {
        let capturing = capturing(&self.ctx, self.owner)?;
        self.written.record_across_capture(self.owner, capturing)?;
        self.writes += 1;
        self.writes_replayed |= capturing;
        Ok(())
    }
}

/// A stream of gradacc's own, for communication that overlaps the caller's stream.
pub struct OwnedStream {
    ctx: Arc<Context>,
    pub stream: CUstream,
}

// SAFETY: the CUstream handle is accepted by the driver from any thread once its context is
// current; `drop` enters the context first.
unsafe impl Send for OwnedStream {}
// SAFETY: the handle never changes after `new`; shared use only copies it into driver calls,
// which are thread-safe.
unsafe impl Sync for OwnedStream {}

impl OwnedStream {
    pub fn new(ctx: &Arc<Context>) -> Result<Self> {
        let _g = ctx.enter()?;
        let mut stream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: `_g` made `ctx` current; CU_STREAM_NON_BLOCKING is a valid flag and `stream` is
        // a live out-pointer.
        ctx.check(unsafe { (ctx.api.cuStreamCreate)(&mut stream, flags) }, "cuStreamCreate")?;
        Ok(OwnedStream { ctx: ctx.clone(), stream })
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        if let Ok(_g) = self.ctx.enter() {
            // SAFETY: `self.stream` was created by cuStreamCreate in `new` and is destroyed only
            // here, once; the driver lets pending work complete before releasing it.
            unsafe { (self.ctx.api.cuStreamDestroy_v2)(self.stream) };
        }
    }
}

/// A compiled kernel module loaded into a context, with its functions looked up by name.
pub struct Module {
    api: &'static Api,
    module: sys::CUmodule,
}

// SAFETY: a CUmodule handle is usable from any thread while its context is current; modules
// are never unloaded, and `api` is `&'static`.
unsafe impl Send for Module {}
// SAFETY: the handle never changes after `load`; `function` only passes it to
// cuModuleGetFunction, which is thread-safe.
unsafe impl Sync for Module {}

impl Module {
    /// Loads a CUBIN or NUL-terminated PTX image into `ctx` (never unloaded: cached per process).
    pub fn load(ctx: &Context, image: &[u8]) -> Result<Self> {
        let _g = ctx.enter()?;
        let mut module = std::ptr::null_mut();
        ctx.check(
            // SAFETY: `_g` made `ctx` current; `image` is a whole CUBIN, or PTX with its NUL, from
            // NVRTC (every caller passes `Compiled::image`), so the driver reads only inside the
            // slice;
            // `module` is a live out-pointer.
            unsafe { (ctx.api.cuModuleLoadData)(&mut module, image.as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
        Ok(Module { api: ctx.api, module })
    }

    pub fn function(&self, name: &CStr) -> Result<Function> {
        let mut f = std::ptr::null_mut();
        check(
            self.api,
            // SAFETY: `self.module` was loaded in `load` and is never unloaded; `name` is a `CStr`,
            // so NUL-terminated; `f` is a live out-pointer.
            unsafe { (self.api.cuModuleGetFunction)(&mut f, self.module, name.as_ptr()) },
            "cuModuleGetFunction",
        )?;
        Ok(Function(f))
    }
}

#[derive(Clone, Copy)]
pub struct Function(sys::CUfunction);

// SAFETY: a CUfunction is a handle into a module that is never unloaded; the driver launches
// it from any thread once its context is current (`launch` enters it).
unsafe impl Send for Function {}
// SAFETY: the handle is immutable and only copied into cuLaunchKernel, which is thread-safe.
unsafe impl Sync for Function {}

/// Threads per block of every launch (the kernels' __launch_bounds__).
pub const THREADS: u32 = 256;

impl Function {
    /// [`Function::launch`] with THREADS per block and the grid [`Context::grid_for`] gives
    /// `work_items` (a grid-stride kernel's chunks or elements).
    ///
    /// # Safety
    /// As for [`Function::launch`].
    pub unsafe fn launch_over(
        &self,
        ctx: &Context,
        stream: CUstream,
        work_items: u64,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller's contract, which is `launch`'s.
        unsafe { self.launch(ctx, ctx.grid_for(work_items), THREADS, stream, args) }
    }

    /// Enqueues the kernel on `stream`. `args` holds one pointer per kernel parameter, each to a
    /// value of exactly the parameter's type (the caller's `launch_args!` makes them).
    ///
    /// # Safety
    /// The argument types and device addresses must match the kernel's signature and be valid
    /// for the kernel's accesses.
    pub unsafe fn launch(
        &self,
        ctx: &Context,
        grid: u32,
        threads: u32,
        stream: CUstream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let _g = ctx.enter()?;
        let api = ctx.api;
        ctx.check(
            // SAFETY: `self.0` came from cuModuleGetFunction on a module never unloaded, and `_g`
            // made its context current; `args` holds one pointer per kernel parameter to a value
            // of its type, valid for the kernel's accesses (this function's `# Safety` contract);
            // `extra` is null, as the driver requires when `kernelParams` is given.
            unsafe {
                (api.cuLaunchKernel)(
                    self.0,
                    grid.max(1),
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    stream,
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }
}

/// The argument array of a launch: a pointer to each local variable, in parameter order. Takes
/// names only, so no pointer can outlive a temporary.
macro_rules! launch_args {
    ($($value:ident),* $(,)?) => {
        [$(&$value as *const _ as *mut std::ffi::c_void),*]
    };
}
pub(crate) use launch_args;

#[cfg(test)]
mod tests {
    use super::*;

    /// A result code no driver header lists (held in a `u32`, where cudarc's enum could not
    /// hold it) is an error naming the call and the number; out-of-memory keeps its kind.
    #[test]
    fn any_driver_result_code_is_reported_by_its_number() {
        let Ok(api) = driver_api::get() else {
            return; // no driver library: no cuGetErrorString to ask
        };
        let e = check(api, 987_654, "cuSomething").unwrap_err();
        assert_eq!(e.kind, ErrorKind::DeviceFailure);
        assert!(
            e.message.starts_with("cuSomething failed: CUDA driver result 987654"),
            "{}",
            e.message
        );
        let e = check(api, ERROR_OUT_OF_MEMORY, "cuMemAllocAsync").unwrap_err();
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
        assert!(check(api, SUCCESS, "cuInit").is_ok());
    }
}
