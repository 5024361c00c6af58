//! Element types of model gradients and the borrowed views the kernels read.
//! 16-bit gradients are `half::f16` / `half::bf16` slices; the kernels read their bits, and raw
//! bits (the C layer's) become typed slices without a copy ([`Grad::f16_bits`]).

use std::ffi::c_void;

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

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
///
/// ```
/// use gradacc::half::f16;
/// use gradacc::{Dtype, Grad};
///
/// let values: Vec<f16> = [0.5f32, -2.0].map(f16::from_f32).to_vec();
/// let grad = Grad::F16(&values);
/// assert_eq!(grad.dtype(), Dtype::F16);
/// // The same values as bits, as a C caller hands them over: borrowed, not copied.
/// let bits = [0x3800u16, 0xc000];
/// assert_eq!(Grad::f16_bits(&bits).bits(), grad.bits());
/// ```
#[derive(Clone, Copy, Debug)]
pub enum Grad<'a> {
    F32(&'a [f32]),
    /// IEEE 754 binary16.
    F16(&'a [f16]),
    /// bfloat16 (the upper half of an f32).
    Bf16(&'a [bf16]),
}

impl<'a> From<&'a [f32]> for Grad<'a> {
    fn from(s: &'a [f32]) -> Self {
        Grad::F32(s)
    }
}

impl<'a> From<&'a [f16]> for Grad<'a> {
    fn from(s: &'a [f16]) -> Self {
        Grad::F16(s)
    }
}

impl<'a> From<&'a [bf16]> for Grad<'a> {
    fn from(s: &'a [bf16]) -> Self {
        Grad::Bf16(s)
    }
}

impl<'a> Grad<'a> {
    /// An f16 buffer given as its IEEE binary16 bit patterns, borrowed as it is.
    pub fn f16_bits(bits: &'a [u16]) -> Self {
        Grad::F16(bits.reinterpret_cast())
    }

    /// A bf16 buffer given as its bit patterns, borrowed as it is.
    pub fn bf16_bits(bits: &'a [u16]) -> Self {
        Grad::Bf16(bits.reinterpret_cast())
    }

    /// The bit patterns of a 16-bit buffer (what the kernels read); `None` for f32.
    pub fn bits(&self) -> Option<&'a [u16]> {
        match *self {
            Grad::F32(_) => None,
            Grad::F16(s) => Some(s.reinterpret_cast()),
            Grad::Bf16(s) => Some(s.reinterpret_cast()),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Grad::F32(s) => s.len(),
            Grad::F16(s) => s.len(),
            Grad::Bf16(s) => s.len(),
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
            Grad::F16(s) => s.as_ptr() as usize,
            Grad::Bf16(s) => s.as_ptr() as usize,
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

/// A mutable buffer of one of the supported element types (a loss to scale in place, a model's
/// weights that the optimizer writes).
#[derive(Debug)]
pub enum GradMut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [f16]),
    Bf16(&'a mut [bf16]),
}

impl<'a> From<&'a mut [f32]> for GradMut<'a> {
    fn from(s: &'a mut [f32]) -> Self {
        GradMut::F32(s)
    }
}

impl<'a> From<&'a mut [f16]> for GradMut<'a> {
    fn from(s: &'a mut [f16]) -> Self {
        GradMut::F16(s)
    }
}

impl<'a> From<&'a mut [bf16]> for GradMut<'a> {
    fn from(s: &'a mut [bf16]) -> Self {
        GradMut::Bf16(s)
    }
}

impl<'a> GradMut<'a> {
    /// An f16 buffer given as its IEEE binary16 bit patterns, borrowed as it is.
    pub fn f16_bits(bits: &'a mut [u16]) -> Self {
        GradMut::F16(bits.reinterpret_cast_mut())
    }

    /// A bf16 buffer given as its bit patterns, borrowed as it is.
    pub fn bf16_bits(bits: &'a mut [u16]) -> Self {
        GradMut::Bf16(bits.reinterpret_cast_mut())
    }

    /// The bit patterns of a 16-bit buffer, writable; `None` for f32.
    pub fn bits_mut(&mut self) -> Option<&mut [u16]> {
        match self {
            GradMut::F32(_) => None,
            GradMut::F16(s) => Some(s.reinterpret_cast_mut()),
            GradMut::Bf16(s) => Some(s.reinterpret_cast_mut()),
        }
    }

    pub fn len(&self) -> usize {
        self.as_grad().len()
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
            Dtype::F16 => Grad::F16(std::slice::from_raw_parts(ptr as *const f16, numel)),
            Dtype::Bf16 => Grad::Bf16(std::slice::from_raw_parts(ptr as *const bf16, numel)),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_bits_borrow_the_same_memory_as_the_typed_slice() {
        let mut bits = vec![0x3c00u16, 0xc000, 0x7e00];
        let (at, len) = (bits.as_ptr() as usize, bits.len());
        let g = Grad::f16_bits(&bits);
        assert!(matches!(g, Grad::F16(s) if s[0] == f16::ONE && s[1] == f16::from_f32(-2.0)));
        assert_eq!((g.addresses(), g.bits()), (at..at + 2 * len, Some(&bits[..])));
        assert_eq!(Grad::bf16_bits(&bits).dtype(), Dtype::Bf16);
        assert_eq!(Grad::from(&[1.0f32][..]).bits(), None);
        let mut w = GradMut::bf16_bits(&mut bits);
        w.bits_mut().expect("16-bit")[0] = bf16::from_f32(3.0).to_bits();
        if let GradMut::Bf16(s) = &mut w {
            s[1] = bf16::ONE;
        }
        assert_eq!(w.dtype(), Dtype::Bf16);
        assert_eq!(bits[..2], [0x4040, 0x3f80]);
        let typed = [bf16::MAX; 2];
        assert_eq!(Grad::from(&typed[..]).bits(), Some(&[0x7f7f, 0x7f7f][..]));
    }
}
