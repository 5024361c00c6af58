//! Device memory: buffers allocated and freed in stream order (or adopted from the caller), the
//! copies and fills enqueued on them, and what the driver knows of an address.

use std::ffi::c_void;
use std::sync::Arc;

use super::{CUdeviceptr, CUstream, Context};
use crate::backend::cuda::driver_api::{self, SUCCESS};
use crate::error::Result;

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
