//! The CUDA driver API, loaded at run time: availability checks that never panic, the device's
//! primary context (shared with PyTorch, CuPy or any runtime-API program in the process), device
//! memory ordered on a stream, events, and kernel launches. Nothing else in gradacc calls the
//! driver directly.

// Streams, events and contexts are opaque driver handles typed as raw pointers: gradacc passes
// them to the driver and never dereferences them.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

mod events;
mod launch;
mod memory;
mod streams;

use std::ffi::{c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::driver_api::{self, Api, MemAccessDesc, ERROR_OUT_OF_MEMORY, SUCCESS};
use crate::error::{Error, ErrorKind, Result};

pub use events::{Event, SharedReads};
pub(crate) use launch::launch_args;
pub use launch::{Function, Module, THREADS};
pub use memory::{buffer_id, copy, DeviceBuffer};
pub use streams::{capturing, synchronize, wait_until_done, OwnedStream};
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
