//! The flat FP32 master buffer: owned, or adopted from the caller. Callers of the `unsafe`
//! accessors guarantee exclusive access to the range they touch (the accumulator's locks do).

use crate::accumulator::MASTER_ALIGN;
use crate::error::{Error, ErrorKind, Result};
use std::ops::Range;

#[derive(Debug)]
pub(super) struct Master {
    ptr: *mut f32,
    len: usize,
    /// Whether `ptr` was allocated here (freed on drop) or is the caller's buffer. A raw pointer
    /// rather than a kept `Box`: moving a `Box` would assert unique access to the memory and
    /// invalidate `ptr` under Rust's aliasing rules.
    owned: bool,
}

// SAFETY: the buffer is plain f32 memory; the accumulator serialises every access to a range.
unsafe impl Send for Master {}
// SAFETY: shared references only hand out ranges through `slice_mut`, whose callers hold the
// accumulator's locks for those ranges.
unsafe impl Sync for Master {}

impl Master {
    /// A zeroed buffer starting at a multiple of [`MASTER_ALIGN`] bytes, so that the layout's
    /// aligned offsets are aligned addresses.
    pub(super) fn owned(len: usize) -> Result<Self> {
        let Some(layout) = Self::allocation(len) else {
            return Ok(Master { ptr: std::ptr::NonNull::dangling().as_ptr(), len, owned: true });
        };
        // SAFETY: `layout` has a non-zero size (`allocation` gives none for an empty buffer).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
        if ptr.is_null() {
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                format!("cannot allocate a master buffer of {len} f32 elements"),
            ));
        }
        Ok(Master { ptr, len, owned: true })
    }

    /// How an owned buffer of `len` elements is allocated; none when it is empty.
    fn allocation(len: usize) -> Option<std::alloc::Layout> {
        let size = len.checked_mul(4).filter(|&s| s > 0)?;
        std::alloc::Layout::from_size_align(size, MASTER_ALIGN).ok()
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
        if let Some(layout) = Self::allocation(self.len).filter(|_| self.owned) {
            // SAFETY: `ptr` was allocated in `owned` with this layout, and is freed once.
            unsafe { std::alloc::dealloc(self.ptr as *mut u8, layout) };
        }
    }
}
