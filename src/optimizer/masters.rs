//! The host FP32 masters of a CPU optimizer: a vector it owns, or the caller's buffer it adopted
//! (a framework's own FP32 master weights, updated in place so that no second copy exists).
//! Either way the optimizer reaches them as one slice, under its state's lock.

use std::ops::{Deref, DerefMut};

#[derive(Debug)]
pub(super) enum Masters {
    Owned(Vec<f32>),
    /// The caller's `len` values at `ptr`, never freed here.
    Adopted { ptr: *mut f32, len: usize },
}

// SAFETY: an adopted buffer is plain f32 memory that the caller lends for the optimizer's
// lifetime (`Optimizer::with_masters`' contract); it is reached only through the optimizer's
// state, whose lock serialises every access.
unsafe impl Send for Masters {}
// SAFETY: as Send: `&Masters` gives only reads, under the state's lock.
unsafe impl Sync for Masters {}

impl Default for Masters {
    fn default() -> Self {
        Masters::Owned(Vec::new())
    }
}

impl Deref for Masters {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            Masters::Owned(v) => v,
            // SAFETY: the caller lends `len` initialised f32 values at the non-null, aligned
            // `ptr` (checked at creation) for the optimizer's lifetime, and writes none of them
            // while the optimizer reads (`Optimizer::with_masters`' contract).
            Masters::Adopted { ptr, len } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

impl DerefMut for Masters {
    fn deref_mut(&mut self) -> &mut [f32] {
        match self {
            Masters::Owned(v) => v,
            // SAFETY: as `deref`; `&mut self`, held under the state's lock, excludes every
            // other access through the optimizer, and the caller makes none while it writes.
            Masters::Adopted { ptr, len } => unsafe {
                std::slice::from_raw_parts_mut(*ptr, *len)
            },
        }
    }
}
