//! Status codes, the per-thread last-error message, and the panic boundary every exported
//! function runs inside.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::{Error, ErrorKind, Result};

/// Result of every gradacc function: `GRADACC_STATUS_OK` (0) or an error code.
pub type gradacc_status_t = i32;

/// Success.
pub const GRADACC_STATUS_OK: gradacc_status_t = 0;
/// A required pointer argument was NULL.
pub const GRADACC_STATUS_NULL_ARGUMENT: gradacc_status_t = 1;
/// An argument's value is outside its domain (a count, an index, an enum value, a config field).
pub const GRADACC_STATUS_INVALID_ARGUMENT: gradacc_status_t = 2;
/// A handle that was destroyed, never created, or is of another object type.
pub const GRADACC_STATUS_INVALID_HANDLE: gradacc_status_t = 3;
/// A gradient's dtype differs from its tensor's declared dtype.
pub const GRADACC_STATUS_DTYPE_MISMATCH: gradacc_status_t = 4;
/// A buffer's length, or an accumulator's layout across ranks, differs from what is expected.
pub const GRADACC_STATUS_SIZE_MISMATCH: gradacc_status_t = 5;
/// Objects bound to different devices or backends were combined.
pub const GRADACC_STATUS_DEVICE_MISMATCH: gradacc_status_t = 6;
/// The call is not allowed in the object's current state (e.g. sync inside a micro-batch).
pub const GRADACC_STATUS_WRONG_STATE: gradacc_status_t = 7;
/// The accumulation window holds no micro-batch (on any rank), or its global item count is 0.
pub const GRADACC_STATUS_EMPTY_WINDOW: gradacc_status_t = 8;
/// An overflow needed a backoff while the loss scale was already at min_scale.
pub const GRADACC_STATUS_SCALE_AT_MINIMUM: gradacc_status_t = 9;
/// The requested backend (CUDA, NCCL, MPI) is not in this build or not on this machine.
pub const GRADACC_STATUS_BACKEND_UNAVAILABLE: gradacc_status_t = 10;
/// The communicator failed.
pub const GRADACC_STATUS_COMM_FAILURE: gradacc_status_t = 11;
/// Another rank's call failed, so this rank stopped the collective too (nothing was reduced).
pub const GRADACC_STATUS_PEER_FAILURE: gradacc_status_t = 12;
/// Saved state bytes are corrupt, truncated, foreign, or of an unsupported version.
pub const GRADACC_STATUS_CORRUPT_STATE: gradacc_status_t = 13;
/// An allocation failed.
pub const GRADACC_STATUS_OUT_OF_MEMORY: gradacc_status_t = 14;
/// An internal error (a bug in gradacc); the message says where.
pub const GRADACC_STATUS_INTERNAL: gradacc_status_t = 15;
/// The CUDA driver reported an error (a failed launch or copy, an invalid device address, a
/// device that fell off the bus); the message carries the driver's own text.
pub const GRADACC_STATUS_DEVICE_FAILURE: gradacc_status_t = 16;

/// Every status with its name and meaning, in code order.
const STATUS_TEXT: [(&CStr, ErrorKind); 16] = [
    (c"GRADACC_STATUS_NULL_ARGUMENT: a required pointer argument was NULL", ErrorKind::NullArgument),
    (c"GRADACC_STATUS_INVALID_ARGUMENT: an argument's value is outside its domain", ErrorKind::InvalidArgument),
    (c"GRADACC_STATUS_INVALID_HANDLE: destroyed, unknown or wrong-type handle", ErrorKind::InvalidHandle),
    (c"GRADACC_STATUS_DTYPE_MISMATCH: gradient dtype differs from the tensor's", ErrorKind::DtypeMismatch),
    (c"GRADACC_STATUS_SIZE_MISMATCH: buffer length or layout differs from the expected one", ErrorKind::SizeMismatch),
    (c"GRADACC_STATUS_DEVICE_MISMATCH: objects of different devices or backends combined", ErrorKind::DeviceMismatch),
    (c"GRADACC_STATUS_WRONG_STATE: call not allowed in the object's current state", ErrorKind::WrongState),
    (c"GRADACC_STATUS_EMPTY_WINDOW: the accumulation window is empty", ErrorKind::EmptyWindow),
    (c"GRADACC_STATUS_SCALE_AT_MINIMUM: overflow with the loss scale already at min_scale", ErrorKind::ScaleAtMinimum),
    (c"GRADACC_STATUS_BACKEND_UNAVAILABLE: backend not in this build or not on this machine", ErrorKind::BackendUnavailable),
    (c"GRADACC_STATUS_COMM_FAILURE: the communicator failed", ErrorKind::CommFailure),
    (c"GRADACC_STATUS_PEER_FAILURE: another rank's call failed; nothing was reduced", ErrorKind::PeerFailure),
    (c"GRADACC_STATUS_CORRUPT_STATE: saved state bytes are corrupt or of another version", ErrorKind::CorruptState),
    (c"GRADACC_STATUS_OUT_OF_MEMORY: an allocation failed", ErrorKind::OutOfMemory),
    (c"GRADACC_STATUS_INTERNAL: internal error in gradacc", ErrorKind::Internal),
    (c"GRADACC_STATUS_DEVICE_FAILURE: the CUDA driver reported an error", ErrorKind::DeviceFailure),
];

fn status_of(kind: ErrorKind) -> gradacc_status_t {
    STATUS_TEXT.iter().position(|(_, k)| *k == kind).map_or(GRADACC_STATUS_INTERNAL, |i| i as gradacc_status_t + 1)
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(message: &str) {
    // Interior NULs would truncate the C string; replace them rather than lose the message.
    let c = CString::new(message.replace('\0', "?")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = c);
}

/// Runs an exported function's body: errors become a status plus the thread's last-error
/// message, and a panic never unwinds into the caller.
pub(crate) fn guard(function: &str, body: impl FnOnce() -> Result<()>) -> gradacc_status_t {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => GRADACC_STATUS_OK,
        Ok(Err(e)) => {
            set_last_error(&format!("{function}: {}", e.message));
            status_of(e.kind)
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("{function}: internal error: {what}"));
            GRADACC_STATUS_INTERNAL
        }
    }
}

/// Error for a NULL pointer argument.
pub(crate) fn null(argument: &str) -> Error {
    Error::new(ErrorKind::NullArgument, format!("argument `{argument}` is NULL"))
}

/// A static description of a status code (never NULL; unknown codes get a generic text).
///
/// Thread safety: may be called from any thread at any time.
#[no_mangle]
pub extern "C" fn gradacc_status_string(status: gradacc_status_t) -> *const c_char {
    let text: &CStr = match status {
        GRADACC_STATUS_OK => c"GRADACC_STATUS_OK: success",
        s if s >= 1 && (s as usize) <= STATUS_TEXT.len() => STATUS_TEXT[s as usize - 1].0,
        _ => c"unknown gradacc status code",
    };
    text.as_ptr()
}

/// The message of the most recent failed gradacc call on the calling thread ("" if none yet).
/// It names the function, the argument and the value that was wrong. Successful calls leave it
/// unchanged.
///
/// Ownership: the string belongs to gradacc and stays valid until the next failing gradacc call on
/// the same thread; copy it to keep it.
/// Thread safety: per thread; may be called from any thread.
#[no_mangle]
pub extern "C" fn gradacc_last_error() -> *const c_char {
    LAST_ERROR.with(|slot| slot.borrow().as_ptr())
}
