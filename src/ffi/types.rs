//! The plain C types shared by several objects (dtype, device, tensor descriptor) and the
//! argument-checking helpers every exported function uses. Enum-like values are plain `int32_t`
//! with named constants, so a caller's out-of-range value is a status, never undefined behaviour.

use std::ffi::c_void;
use std::mem::size_of;

use super::status::null;
use crate::dtype::{Dtype, Grad};
use crate::error::{Error, ErrorKind, Result};

/// Element type of a model gradient buffer.
pub type gradacc_dtype_t = i32;
/// IEEE 754 binary32.
pub const GRADACC_DTYPE_F32: gradacc_dtype_t = 0;
/// IEEE 754 binary16 (`_Float16`, `__half`, numpy `float16`).
pub const GRADACC_DTYPE_F16: gradacc_dtype_t = 1;
/// bfloat16 (`__nv_bfloat16`, the upper 16 bits of an f32).
pub const GRADACC_DTYPE_BF16: gradacc_dtype_t = 2;

/// Kind of device an object is bound to.
pub type gradacc_device_kind_t = i32;
/// Host memory; buffers are host pointers.
pub const GRADACC_DEVICE_CPU: gradacc_device_kind_t = 0;
/// A CUDA device; buffers are device pointers and work is ordered on the given stream.
pub const GRADACC_DEVICE_CUDA: gradacc_device_kind_t = 1;

/// The device an object is bound to. Pass NULL where a `const gradacc_device_t*` is taken to
/// mean the CPU.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_device_t {
    /// GRADACC_DEVICE_CPU or GRADACC_DEVICE_CUDA.
    pub kind: gradacc_device_kind_t,
    /// CUDA device ordinal; 0 for the CPU.
    pub ordinal: i32,
    /// The caller's `cudaStream_t` / `CUstream` (borrowed, never destroyed; it must outlive every
    /// object created on it, whose device memory is freed on it); NULL for the CPU. On CUDA, NULL
    /// or `CU_STREAM_LEGACY` is the legacy default stream; `CU_STREAM_PER_THREAD` (0x2) is refused
    /// (it names another stream on every thread).
    pub stream: *mut c_void,
}

/// One tensor of an accumulator: element count and the dtype its gradients arrive in.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_tensor_desc_t {
    /// Number of elements (at least 1).
    pub numel: u64,
    /// GRADACC_DTYPE_*.
    pub dtype: gradacc_dtype_t,
}

pub(crate) fn dtype_from_c(value: gradacc_dtype_t, argument: &str) -> Result<Dtype> {
    match value {
        GRADACC_DTYPE_F32 => Ok(Dtype::F32),
        GRADACC_DTYPE_F16 => Ok(Dtype::F16),
        GRADACC_DTYPE_BF16 => Ok(Dtype::Bf16),
        v => Err(Error::invalid(format!("`{argument}` = {v} is not a GRADACC_DTYPE_* value"))),
    }
}

pub(crate) fn dtype_to_c(dtype: Dtype) -> gradacc_dtype_t {
    dtype.code()
}

/// A parsed `gradacc_device_t`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Device {
    Cpu,
    Cuda { ordinal: i32, stream: crate::backend::cuda::driver::CUstream },
}

/// Reads the device argument: NULL or a CPU device, or a CUDA device where a driver and NVRTC
/// are present (else BACKEND_UNAVAILABLE).
pub(crate) fn parse_device(device: *const gradacc_device_t) -> Result<Device> {
    if device.is_null() {
        return Ok(Device::Cpu);
    }
    // SAFETY: non-null and, by the API contract, points to a gradacc_device_t.
    let d = unsafe { *device };
    match d.kind {
        GRADACC_DEVICE_CPU => {
            if d.ordinal != 0 || !d.stream.is_null() {
                return Err(Error::invalid(format!(
                    "a CPU `device` takes ordinal 0 and a NULL stream, got ordinal {} and stream {:p}",
                    d.ordinal, d.stream
                )));
            }
            Ok(Device::Cpu)
        }
        GRADACC_DEVICE_CUDA => {
            if d.ordinal < 0 {
                return Err(Error::invalid(format!("`device`.ordinal = {} is negative", d.ordinal)));
            }
            crate::backend::cuda::driver::check_stream(d.stream as _, "`device`.stream")?;
            crate::backend::cuda::driver::require_driver()?;
            if !crate::backend::cuda::compile::nvrtc_available() {
                return Err(Error::new(
                    ErrorKind::BackendUnavailable,
                    "`device`.kind is CUDA, but NVRTC (libnvrtc.so.12) could not be loaded to compile the kernels",
                ));
            }
            Ok(Device::Cuda { ordinal: d.ordinal, stream: d.stream as _ })
        }
        k => Err(Error::invalid(format!("`device`.kind = {k} is not a GRADACC_DEVICE_* value"))),
    }
}

/// Whether a buffer argument (host or device address) passes the checks: non-null, aligned for
/// `dtype`, and a length that fits the address space. Element sizes are powers of two: a mask and
/// a multiplication instead of divisions.
#[inline]
fn buffer_ok(ptr: *const c_void, numel: usize, dtype: Dtype) -> bool {
    let aligned = ptr as usize & (dtype.size() - 1) == 0;
    !ptr.is_null() && aligned && numel.checked_mul(dtype.size()).is_some_and(|bytes| bytes <= isize::MAX as usize)
}

/// Checks a buffer argument without touching it (a CUDA address is never dereferenced on the
/// host); the error names `argument`.
pub(crate) fn check_buffer(ptr: *const c_void, numel: usize, dtype: Dtype, argument: &str) -> Result<()> {
    if buffer_ok(ptr, numel, dtype) {
        Ok(())
    } else {
        Err(grad_error(ptr, numel, dtype, argument))
    }
}

/// Borrows a C gradient buffer as a typed slice if it passes [`check_buffer`]'s checks; `None`
/// otherwise. No message is built, and inlined it returns in registers:
/// `gradacc_accumulator_add` runs it once per tensor on every call.
///
/// # Safety
/// As for [`grad_from_c`].
#[inline]
pub(crate) unsafe fn grad_view<'a>(ptr: *const c_void, numel: usize, dtype: Dtype) -> Option<Grad<'a>> {
    if !buffer_ok(ptr, numel, dtype) {
        return None;
    }
    Some(match dtype {
        Dtype::F32 => Grad::F32(std::slice::from_raw_parts(ptr as *const f32, numel)),
        Dtype::F16 => Grad::F16(std::slice::from_raw_parts(ptr as *const u16, numel)),
        Dtype::Bf16 => Grad::Bf16(std::slice::from_raw_parts(ptr as *const u16, numel)),
    })
}

/// Borrows a C gradient buffer as a typed slice after checking pointer, alignment and size; the
/// error names `argument`.
///
/// # Safety
/// A non-null `ptr` must point to `numel` readable elements of `dtype`, alive for `'a`.
pub(crate) unsafe fn grad_from_c<'a>(ptr: *const c_void, numel: usize, dtype: Dtype, argument: &str) -> Result<Grad<'a>> {
    grad_view(ptr, numel, dtype).ok_or_else(|| grad_error(ptr, numel, dtype, argument))
}

/// The error for a gradient buffer that [`grad_view`] refused.
pub(crate) fn grad_error(ptr: *const c_void, numel: usize, dtype: Dtype, argument: &str) -> Error {
    if ptr.is_null() {
        null(argument)
    } else if ptr as usize & (dtype.size() - 1) != 0 {
        Error::invalid(format!("`{argument}` = {ptr:p} is not aligned to {} bytes for {}", dtype.size(), dtype.name()))
    } else {
        Error::invalid(format!("`{argument}` length {numel} is too large"))
    }
}

/// Checks an output pointer up front, so a call fails before it changes anything.
pub(crate) fn out_ptr<'a, T>(ptr: *mut T, argument: &str) -> Result<&'a mut T> {
    // SAFETY: non-null, and by the API contract points to writable storage for a T.
    unsafe { ptr.as_mut() }.ok_or_else(|| null(argument))
}

/// Reads a config struct that starts with `size_t struct_size`, checking that size.
///
/// # Safety
/// A non-null `ptr` must point to at least `struct_size` readable bytes.
pub(crate) unsafe fn read_config<T: Copy>(ptr: *const T, argument: &str) -> Result<T> {
    if ptr.is_null() {
        return Err(null(argument));
    }
    let declared = *(ptr as *const usize);
    if declared != size_of::<T>() {
        return Err(Error::invalid(format!(
            "`{argument}`.struct_size = {declared}, expected {} (initialise it with its *_config_default function)",
            size_of::<T>()
        )));
    }
    Ok(*ptr)
}

/// Copies `bytes` into a caller's buffer; with a NULL buffer only reports the size needed.
pub(crate) fn write_bytes(bytes: &[u8], buf: *mut u8, capacity: usize, out_len: *mut usize) -> Result<()> {
    let len_out = out_ptr(out_len, "out_len")?;
    if !buf.is_null() {
        if capacity < bytes.len() {
            return Err(Error::new(ErrorKind::SizeMismatch, format!("`capacity` = {capacity} is too small: the state needs {} bytes", bytes.len())));
        }
        // SAFETY: buf holds at least `capacity` >= bytes.len() writable bytes (API contract).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
    }
    *len_out = bytes.len();
    Ok(())
}

/// Borrows input bytes.
///
/// # Safety
/// A non-null `ptr` must point to `len` readable bytes.
pub(crate) unsafe fn read_bytes<'a>(ptr: *const u8, len: usize, argument: &str) -> Result<&'a [u8]> {
    if ptr.is_null() {
        return Err(null(argument));
    }
    Ok(std::slice::from_raw_parts(ptr, len))
}
