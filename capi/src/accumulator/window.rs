//! The window as a whole: discarding it, and saving, loading and merging it.

use super::{gradacc_accumulator_t, ACCUMULATORS};
use crate::status::{gradacc_status_t, guard};
use crate::types::*;

/// Discards the window in progress (or the synced result); the next micro-batch starts a new one.
///
/// Thread safety: serialised with every other call on `acc`.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_reset(
    acc: *mut gradacc_accumulator_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_reset", || Ok(ACCUMULATORS.get(acc, "acc")?.reset()?))
}

/// Saves the window in progress (masters, counts, micro-batches, overflow flag) as versioned
/// bytes, for a checkpoint in the middle of accumulation. Not inside a micro-batch nor after sync.
/// With `buf` NULL, only writes the needed size to `*out_len`. On CUDA it copies the masters to
/// the host (it waits for the accumulator's stream); the bytes are the same on every device. A
/// sharded accumulation saves its shard, and the bytes name it: they load only into the same
/// shard of an accumulation over as many ranks (anything else is GRADACC_STATUS_CORRUPT_STATE).
///
/// Thread safety: serialised with every other call on `acc`.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_save_window(
    acc: *const gradacc_accumulator_t,
    buf: *mut u8,
    capacity: usize,
    out_len: *mut usize,
) -> gradacc_status_t {
    // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
    guard("gradacc_accumulator_save_window", || unsafe {
        write_bytes(&ACCUMULATORS.get(acc, "acc")?.save_window()?, buf, capacity, out_len)
    })
}

/// Restores a window written by gradacc_accumulator_save_window from an accumulator with the same
/// tensors, saved on any device. Corrupt or foreign bytes fail and leave the accumulator unchanged.
/// The window's dropped micro-batches were not saved: gradacc_sync_info_t's
/// `dropped_microbatches` counts the drops after the load, and `overflow_microbatch` counts the
/// restored window's kept micro-batches, then each fed since the load, dropped ones included
/// (docs/overflow.md).
///
/// Thread safety: serialised with every other call on `acc`.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_load_window(
    acc: *mut gradacc_accumulator_t,
    bytes: *const u8,
    len: usize,
) -> gradacc_status_t {
    guard("gradacc_accumulator_load_window", || {
        // SAFETY: a non-null `bytes` points to `len` readable bytes (API contract).
        let bytes = unsafe { read_bytes(bytes, len, "bytes")? };
        Ok(ACCUMULATORS.get(acc, "acc")?.load_window(bytes)?)
    })
}

/// Adds a window written by gradacc_accumulator_save_window (of an accumulator with the same
/// tensors, on any device or rank) into `acc`'s current window: masters add, item counts and
/// micro-batches add, overflow flags OR. Windows are sums, so work saved on N ranks resumes on M
/// (4 ranks to 2: each survivor merges one lost rank's window). The window counts the ranks'
/// windows it sums (a merge into a window with no micro-batch yet replaces this rank's own in the
/// count), so GRADACC_NORMALIZE_BY_WORLD divides by the size of the group that did the work; every
/// normalisation then gives the original group's gradient. Windows saved by 0.2 count as one
/// rank's window each. The merged window's kept micro-batches count in `overflow_microbatch` after
/// those already in the window. Corrupt or foreign bytes fail and leave the accumulator unchanged.
///
/// Thread safety: serialised with every other call on `acc`.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_merge_window(
    acc: *mut gradacc_accumulator_t,
    bytes: *const u8,
    len: usize,
) -> gradacc_status_t {
    guard("gradacc_accumulator_merge_window", || {
        // SAFETY: a non-null `bytes` points to `len` readable bytes (API contract).
        let bytes = unsafe { read_bytes(bytes, len, "bytes")? };
        Ok(ACCUMULATORS.get(acc, "acc")?.merge_window(bytes)?)
    })
}
