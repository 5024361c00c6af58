//! The flat FP32 master buffer: owned, or adopted from the caller. Callers of the `unsafe`
//! accessors guarantee exclusive access to the range they touch (the accumulator's locks do).

use crate::error::{Error, ErrorKind, Result};
use std::ops::Range;

#[derive(Debug)]
pub(super) struct Master {
    ptr: *mut f32,
    len: usize,
    /// Keeps an owned buffer alive; `None` when the caller's buffer was adopted.
    _owned: Option<Box<[f32]>>,
}

// SAFETY: the buffer is plain f32 memory; the accumulator serialises every access to a range.
unsafe impl Send for Master {}
unsafe impl Sync for Master {}

impl Master {
    pub(super) fn owned(len: usize) -> Result<Self> {
        let mut v: Vec<f32> = Vec::new();
        v.try_reserve_exact(len)
            .map_err(|_| Error::new(ErrorKind::OutOfMemory, format!("cannot allocate a master buffer of {len} f32 elements")))?;
        v.resize(len, 0.0);
        let mut b = v.into_boxed_slice();
        Ok(Master { ptr: b.as_mut_ptr(), len, _owned: Some(b) })
    }

    pub(super) fn borrowed(ptr: *mut f32, len: usize) -> Self {
        Master { ptr, len, _owned: None }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn ptr_at(&self, offset: usize) -> *mut f32 {
        debug_assert!(offset <= self.len);
        // SAFETY: offset is within the allocation (or one past its end).
        unsafe { self.ptr.add(offset) }
    }

    /// # Safety
    /// The caller must hold exclusive access to `range` for the lifetime of the returned slice.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn slice_mut(&self, range: Range<usize>) -> &mut [f32] {
        assert!(range.start <= range.end && range.end <= self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.len())
    }
}
