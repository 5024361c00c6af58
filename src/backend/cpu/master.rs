//! The flat FP32 master buffer: owned, or adopted from the caller. It is shared by reference, so
//! its elements are reached through the window's rights: [`MasterWrite`] (the window's write lock)
//! for any range, [`TensorWrite`] (the window's read lock and the tensor's lock) for one tensor's.
//! Each right names one buffer's use at a time: the master, its staging or the shard.

use crate::accumulator::{MasterWrite, TensorWrite, MASTER_ALIGN};
use crate::error::{Error, ErrorKind, Result};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug)]
pub(super) struct Master {
    ptr: *mut f32,
    len: usize,
    /// Whether `ptr` was allocated here (freed on drop) or is the caller's buffer. A raw pointer
    /// rather than a kept `Box`: moving a `Box` would assert unique access to the memory and
    /// invalidate `ptr` under Rust's aliasing rules.
    owned: bool,
    /// How many times the buffer was handed out to write (or its address taken): a measurement
    /// of it holds while this is what it was then.
    writes: AtomicU64,
}

// SAFETY: the buffer is plain f32 memory; the accumulator serialises every access to a range.
unsafe impl Send for Master {}
// SAFETY: shared references only reach elements through the window's rights, which the window's
// locks hand out to one thread at a time for a given range.
unsafe impl Sync for Master {}

impl Master {
    /// A zeroed buffer starting at a multiple of [`MASTER_ALIGN`] bytes, so that the layout's
    /// aligned offsets are aligned addresses.
    pub(super) fn owned(len: usize) -> Result<Self> {
        let Some(layout) = Self::allocation(len) else {
            return Ok(Self::new(std::ptr::NonNull::dangling().as_ptr(), len, true));
        };
        // SAFETY: `layout` has a non-zero size (`allocation` gives none for an empty buffer).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut f32;
        if ptr.is_null() {
            return Err(Error::new(
                ErrorKind::OutOfMemory,
                format!("cannot allocate a master buffer of {len} f32 elements"),
            ));
        }
        Ok(Self::new(ptr, len, true))
    }

    /// How an owned buffer of `len` elements is allocated; none when it is empty.
    fn allocation(len: usize) -> Option<std::alloc::Layout> {
        let size = len.checked_mul(4).filter(|&s| s > 0)?;
        std::alloc::Layout::from_size_align(size, MASTER_ALIGN).ok()
    }

    pub(super) fn borrowed(ptr: *mut f32, len: usize) -> Self {
        Self::new(ptr, len, false)
    }

    fn new(ptr: *mut f32, len: usize, owned: bool) -> Self {
        Master { ptr, len, owned, writes: AtomicU64::new(0) }
    }

    /// The count of writes so far (see [`Master::note_write`]).
    pub(super) fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// Counts a write: every mutable slice, and an address handed out, through which the caller
    /// may write.
    pub(super) fn note_write(&self) {
        self.writes.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn ptr_at(&self, offset: usize) -> *mut f32 {
        assert!(offset <= self.len, "master offset {offset} past its {} elements", self.len);
        // SAFETY: offset is within the allocation (or one past its end).
        unsafe { self.ptr.add(offset) }
    }

    /// Elements `range`, read while the window's write right is held (no writer runs).
    pub(super) fn slice<'a>(&'a self, _read: &'a MasterWrite, range: Range<usize>) -> &'a [f32] {
        let start = self.start_of(&range);
        // SAFETY: the range lies inside the allocation (`start_of`), and the window's write right,
        // borrowed for as long as the slice, excludes every writer.
        unsafe { std::slice::from_raw_parts(start, range.len()) }
    }

    /// Elements `range`, written under the window's write right.
    pub(super) fn slice_mut<'a>(
        &'a self,
        _write: &'a mut MasterWrite,
        range: Range<usize>,
    ) -> &'a mut [f32] {
        self.note_write();
        let start = self.start_of(&range);
        // SAFETY: the range lies inside the allocation (`start_of`), and the window's write right,
        // borrowed mutably for as long as the slice, excludes every other access.
        unsafe { std::slice::from_raw_parts_mut(start, range.len()) }
    }

    /// Tensor `tensor`'s elements, written under its right.
    pub(super) fn tensor_mut<'a>(&'a self, tensor: &'a mut TensorWrite) -> &'a mut [f32] {
        self.note_write();
        let range = tensor.range();
        let start = self.start_of(&range);
        // SAFETY: the range lies inside the allocation (`start_of`); the tensor's right,
        // borrowed mutably for as long as the slice, excludes every other access to its range
        // (other tensors' rights cover disjoint ranges, and no window write right is in use).
        unsafe { std::slice::from_raw_parts_mut(start, range.len()) }
    }

    /// Elements `range` of this buffer to write and of `other` to read, under the window's write
    /// right (this buffer and `other` are distinct allocations).
    pub(super) fn pair_mut<'a>(
        &'a self,
        other: &'a Master,
        _write: &'a mut MasterWrite,
        range: Range<usize>,
    ) -> (&'a mut [f32], &'a [f32]) {
        assert!(!std::ptr::eq(self, other), "a pair of one buffer");
        self.note_write();
        let (mine, theirs) = (self.start_of(&range), other.start_of(&range));
        // SAFETY: both ranges lie inside their allocations (`start_of`), which are distinct
        // buffers (each `Master` owns or adopts its own); the window's write right, borrowed
        // mutably for as long as the slices, excludes every other access.
        unsafe {
            (
                std::slice::from_raw_parts_mut(mine, range.len()),
                std::slice::from_raw_parts(theirs, range.len()),
            )
        }
    }

    /// The whole buffer, while nothing else can reach it (it is being built).
    pub(super) fn as_mut_slice(&mut self) -> &mut [f32] {
        // SAFETY: the buffer holds `len` elements, and `&mut self` excludes every other access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The address of `range`'s first element, the range checked to lie inside the buffer.
    fn start_of(&self, range: &Range<usize>) -> *mut f32 {
        assert!(range.start <= range.end && range.end <= self.len, "{range:?} past {}", self.len);
        self.ptr_at(range.start)
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
