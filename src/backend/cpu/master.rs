//! The flat FP32 master buffer: owned, or adopted from the caller. Callers of the `unsafe`
//! accessors guarantee exclusive access to the range they touch (the accumulator's locks do).

use crate::error::{Error, ErrorKind, Result};
use std::ops::Range;

#[derive(Debug)]
pub(super) struct Master {
    ptr: *mut f32,
    len: usize,
    /// Whether `ptr` came from `Box::into_raw` here (freed on drop) or is the caller's buffer.
    /// A raw pointer rather than a kept `Box`: moving a `Box` would assert unique access to the
    /// memory and invalidate `ptr` under Rust's aliasing rules.
    owned: bool,
}

// SAFETY: the buffer is plain f32 memory; the accumulator serialises every access to a range.
unsafe impl Send for Master {}
// SAFETY: shared references only hand out ranges through `slice_mut`, whose callers hold the
// accumulator's locks for those ranges.
unsafe impl Sync for Master {}

impl Master {
    pub(super) fn owned(len: usize) -> Result<Self> {
        let mut v: Vec<f32> = Vec::new();
        v.try_reserve_exact(len).map_err(|_| {
            Error::new(
                ErrorKind::OutOfMemory,
                format!("cannot allocate a master buffer of {len} f32 elements"),
            )
        })?;
        v.resize(len, 0.0);
        let ptr = Box::into_raw(v.into_boxed_slice()) as *mut f32;
        Ok(Master { ptr, len, owned: true })
    }

    pub(super) fn borrowed(ptr: *mut f32, len: usize) -> Self {
        Master { ptr, len, owned: false }
    }

    pub(super) fn ptr_at(&self, offset: usize) -> *mut f32 {
        assert!(offset <= self.len, "master offset {offset} past its {} elements", self.len);
        // SAFETY: offset is within the allocation (or one past its end).
        unsafe { self.ptr.add(offset) }
    }

    /// # Safety
    /// The caller must hold exclusive access to `range` for the lifetime of the returned slice.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slice_mut(&self, range: Range<usize>) -> &mut [f32] {
        assert!(range.start <= range.end && range.end <= self.len);
        // SAFETY: the range lies inside the allocation (asserted), and the caller holds exclusive
        // access to it.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len()) }
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: `ptr` and `len` are exactly what `Box::into_raw` gave in `owned`, freed once.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
        }
    }
}
