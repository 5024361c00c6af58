//! The host FP32 masters of a CPU optimizer: a vector it owns, or the caller's buffer it adopted
//! (a framework's own FP32 master weights, updated in place so that no second copy exists).
//! Either way the optimizer reaches them as one slice, under its state's lock.

use std::ops::{Deref, DerefMut, Range};

use crate::dtype::Grad;
use crate::error::{Error, Result};

#[derive(Debug)]
pub(super) enum Masters {
    Owned(Vec<f32>),
    /// The caller's `len` values at `ptr`, never freed here.
    Adopted {
        ptr: *mut f32,
        len: usize,
    },
}

// SAFETY: an adopted buffer is plain f32 memory that the caller lends for the optimizer's
// lifetime (`Optimizer::with_masters`' contract); it is reached only through the optimizer's
// state, whose lock serialises every access.
unsafe impl Send for Masters {}
// SAFETY: as Send: `&Masters` gives only reads, under the state's lock.
unsafe impl Sync for Masters {}

impl Masters {
    /// [`check_apart`] of adopted masters and `weights`.
    pub(super) fn check_apart<'g>(&self, weights: impl Iterator<Item = Grad<'g>>) -> Result<()> {
        let Masters::Adopted { ptr, len } = *self else { return Ok(()) };
        check_apart(ptr as u64, len, weights.map(|w| w.addresses()))
    }
}

/// Refuses model weights (their byte addresses, host or device) that share memory with the
/// `len` adopted masters at `masters`: a step writes both, and the result would depend on the
/// order of the writes.
pub(super) fn check_apart(
    masters: u64,
    len: usize,
    weights: impl Iterator<Item = Range<usize>>,
) -> Result<()> {
    let masters = masters as usize..masters as usize + len * size_of::<f32>();
    for (i, bytes) in weights.enumerate() {
        if bytes.start < masters.end && masters.start < bytes.end {
            return Err(Error::invalid(format!(
                "`weights[{i}]` (bytes {:#x}..{:#x}) overlaps the adopted `masters` (bytes {:#x}..{:#x}): a step writes both",
                bytes.start, bytes.end, masters.start, masters.end
            )));
        }
    }
    Ok(())
}

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
            Masters::Adopted { ptr, len } => unsafe { std::slice::from_raw_parts_mut(*ptr, *len) },
        }
    }
}
