//! The one place that turns Rust objects into C handles and back. A handle is a unique number
//! (never an address, never reused), looked up in a per-type registry: a destroyed, foreign or
//! wrong-type handle is simply not found, so it is reported instead of dereferenced. The registry
//! holds an `Arc`, and a call holds its own clone, so destroying a handle while another thread is
//! still inside a call on it cannot free memory under that call.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::status::{CallError, CallResult};

/// Handle numbers are multiples of 16 from an arbitrary base, so they look like aligned pointers
/// to C and are never 0.
static NEXT_ID: AtomicU64 = AtomicU64::new(0x6ac0_0000);

pub(crate) struct Registry<T: ?Sized> {
    what: &'static str,
    live: RwLock<HashMap<usize, Arc<T>>>,
}

impl<T: ?Sized> Registry<T> {
    pub(crate) fn new(what: &'static str) -> Self {
        Registry { what, live: RwLock::new(HashMap::new()) }
    }

    /// Registers `object` and returns its new handle.
    pub(crate) fn insert<H>(&self, object: Arc<T>) -> *mut H {
        let id = NEXT_ID.fetch_add(16, Ordering::Relaxed) as usize;
        self.live.write().insert(id, object);
        id as *mut H
    }

    /// The object behind `handle`, or an error naming the argument.
    pub(crate) fn get<H>(&self, handle: *const H, argument: &str) -> CallResult<Arc<T>> {
        if handle.is_null() {
            return Err(crate::status::null(argument));
        }
        self.live
            .read()
            .get(&(handle as usize))
            .cloned()
            .ok_or_else(|| self.unknown(handle as usize, argument))
    }

    /// Unregisters `handle`; the object is dropped once no call is using it any more.
    pub(crate) fn remove<H>(&self, handle: *const H, argument: &str) -> CallResult<Arc<T>> {
        self.live
            .write()
            .remove(&(handle as usize))
            .ok_or_else(|| self.unknown(handle as usize, argument))
    }

    fn unknown(&self, handle: usize, argument: &str) -> CallError {
        CallError::Handle(format!(
            "argument `{argument}` = {handle:#x} is not a live {} handle (destroyed, never created, or another type)",
            self.what
        ))
    }
}
