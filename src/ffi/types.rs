//! The plain C types shared by several objects (dtype, device, tensor descriptor) and the
//! argument-checking helpers every exported function uses. Enum-like values are plain `int32_t`
//! with named constants, so a caller's out-of-range value is a status, never undefined behaviour.

use std::ffi::c_void;
use std::mem::size_of;

use super::status::null;
use crate::device::Device;
use crate::dtype::Dtype;
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
            Device::Cuda { ordinal: d.ordinal, stream: d.stream as _ }.check()
        }
        k => Err(Error::invalid(format!("`device`.kind = {k} is not a GRADACC_DEVICE_* value"))),
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
