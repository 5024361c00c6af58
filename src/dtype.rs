//! Element types of model gradients and the borrowed views the kernels read.
//! 16-bit formats travel as raw `u16` bits: the library never needs a half-float type of its own.

use std::ffi::c_void;

use crate::error::{Error, Result};

/// Element type of a model gradient buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    Bf16,
}

impl Dtype {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::Bf16 => 2,
        }
    }

    /// The stable code of the dtype: GRADACC_DTYPE_* in the C API, `GA_DTYPE_*` in the kernels,
    /// and the byte the layout fingerprint holds.
    pub fn code(self) -> i32 {
        match self {
            Dtype::F32 => 0,
            Dtype::F16 => 1,
            Dtype::Bf16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
        }
    }
}

/// A borrowed gradient buffer of one of the supported element types.
#[derive(Clone, Copy, Debug)]
pub enum Grad<'a> {
    F32(&'a [f32]),
    /// IEEE 754 binary16 bit patterns.
    F16(&'a [u16]),
    /// bfloat16 bit patterns (the upper half of an f32).
    Bf16(&'a [u16]),
}

impl<'a> Grad<'a> {
    pub fn len(&self) -> usize {
        match self {
            Grad::F32(s) => s.len(),
            Grad::F16(s) | Grad::Bf16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> Dtype {
        match self {
            Grad::F32(_) => Dtype::F32,
            Grad::F16(_) => Dtype::F16,
            Grad::Bf16(_) => Dtype::Bf16,
        }
    }

    /// The buffer's byte addresses.
    pub(crate) fn addresses(&self) -> std::ops::Range<usize> {
        let start = match self {
            Grad::F32(s) => s.as_ptr() as usize,
            Grad::F16(s) | Grad::Bf16(s) => s.as_ptr() as usize,
        };
        start..start + self.len() * self.dtype().size()
    }

    /// The sub-range `[start, end)` of this buffer.
    pub fn slice(&self, start: usize, end: usize) -> Grad<'a> {
        match *self {
            Grad::F32(s) => Grad::F32(&s[start..end]),
            Grad::F16(s) => Grad::F16(&s[start..end]),
            Grad::Bf16(s) => Grad::Bf16(&s[start..end]),
        }
    }
}

/// A mutable buffer of one of the supported element types (a loss to scale in place).
#[derive(Debug)]
pub enum GradMut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [u16]),
    Bf16(&'a mut [u16]),
}

impl<'a> GradMut<'a> {
    pub fn len(&self) -> usize {
        match self {
            GradMut::F32(s) => s.len(),
            GradMut::F16(s) | GradMut::Bf16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> Dtype {
        self.as_grad().dtype()
    }

    /// The same buffer, read-only.
    pub fn as_grad(&self) -> Grad<'_> {
        match self {
            GradMut::F32(s) => Grad::F32(s),
            GradMut::F16(s) => Grad::F16(s),
            GradMut::Bf16(s) => Grad::Bf16(s),
        }
    }

    /// The elements `r` of this buffer.
    pub fn slice_mut(&mut self, r: std::ops::Range<usize>) -> GradMut<'_> {
        match self {
            GradMut::F32(s) => GradMut::F32(&mut s[r]),
            GradMut::F16(s) => GradMut::F16(&mut s[r]),
            GradMut::Bf16(s) => GradMut::Bf16(&mut s[r]),
        }
    }

    /// The buffer cut in two at element `mid`.
    pub fn split_at_mut(self, mid: usize) -> (GradMut<'a>, GradMut<'a>) {
        match self {
            GradMut::F32(s) => {
                let (a, b) = s.split_at_mut(mid);
                (GradMut::F32(a), GradMut::F32(b))
            }
            GradMut::F16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (GradMut::F16(a), GradMut::F16(b))
            }
            GradMut::Bf16(s) => {
                let (a, b) = s.split_at_mut(mid);
                (GradMut::Bf16(a), GradMut::Bf16(b))
            }
        }
    }
}

/// Whether a buffer address (host or device) passes the checks: non-null, aligned for `dtype`,
/// and a length that fits the address space. Element sizes are powers of two: a mask and a
/// multiplication instead of divisions.
#[inline]
fn buffer_ok(ptr: *const c_void, numel: usize, dtype: Dtype) -> bool {
    let aligned = ptr as usize & (dtype.size() - 1) == 0;
    !ptr.is_null()
        && aligned
        && numel.checked_mul(dtype.size()).is_some_and(|bytes| bytes <= isize::MAX as usize)
}

/// Checks a buffer address without touching it (a device address is never dereferenced on the
/// host); the error names `argument`.
pub(crate) fn check_buffer(
    ptr: *const c_void,
    numel: usize,
    dtype: Dtype,
    argument: &str,
) -> Result<()> {
    if buffer_ok(ptr, numel, dtype) {
        Ok(())
    } else {
        Err(buffer_error(ptr, numel, dtype, argument))
    }
}

/// Borrows a host gradient buffer as a typed slice if it passes [`check_buffer`]'s checks; `None`
/// otherwise. No message is built, and inlined it returns in registers: `add` over raw addresses
/// runs it once per tensor on every call.
///
/// # Safety
/// A non-null `ptr` must point to `numel` readable elements of `dtype`, alive for `'a`.
#[inline]
pub(crate) unsafe fn grad_view<'a>(
    ptr: *const c_void,
    numel: usize,
    dtype: Dtype,
) -> Option<Grad<'a>> {
    if !buffer_ok(ptr, numel, dtype) {
        return None;
    }
    // SAFETY: non-null and aligned (checked), readable for `numel` elements (the caller's
    // contract).
    Some(unsafe {
        match dtype {
            Dtype::F32 => Grad::F32(std::slice::from_raw_parts(ptr as *const f32, numel)),
            Dtype::F16 => Grad::F16(std::slice::from_raw_parts(ptr as *const u16, numel)),
            Dtype::Bf16 => Grad::Bf16(std::slice::from_raw_parts(ptr as *const u16, numel)),
        }
    })
}

/// The error for a buffer address that [`check_buffer`] refuses.
pub(crate) fn buffer_error(
    ptr: *const c_void,
    numel: usize,
    dtype: Dtype,
    argument: &str,
) -> Error {
    if ptr.is_null() {
        Error::invalid(format!("argument `{argument}` is NULL"))
    } else if ptr as usize & (dtype.size() - 1) != 0 {
        Error::invalid(format!(
            "`{argument}` = {ptr:p} is not aligned to {} bytes for {}",
            dtype.size(),
            dtype.name()
        ))
    } else {
        Error::invalid(format!("`{argument}` length {numel} is too large"))
    }
}
