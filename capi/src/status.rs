//! Status codes, the per-thread last-error message, and the panic boundary every exported
//! function runs inside.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use gradacc::error::{Error, ErrorKind};

/// Result of every gradacc function: `GRADACC_STATUS_OK` (0) or an error code. A C enum whose
/// values never change meaning; new codes may be added, so a `switch` over it needs a default.
/// Functions that take a status back (gradacc_status_string) take it as `int32_t`, so any value is
/// safe to pass.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(clippy::upper_case_acronyms)]
pub enum gradacc_status_t {
    /// Success.
    GRADACC_STATUS_OK = 0,
    /// A required pointer argument was NULL.
    GRADACC_STATUS_NULL_ARGUMENT = 1,
    /// An argument's value is outside its domain (a count, an index, an enum value, a config
    /// field).
    GRADACC_STATUS_INVALID_ARGUMENT = 2,
    /// A handle that was destroyed, never created, or is of another object type.
    GRADACC_STATUS_INVALID_HANDLE = 3,
    /// A gradient's dtype differs from its tensor's declared dtype.
    GRADACC_STATUS_DTYPE_MISMATCH = 4,
    /// A buffer's length, or an accumulator's layout across ranks, differs from what is expected.
    GRADACC_STATUS_SIZE_MISMATCH = 5,
    /// Objects bound to different devices or backends were combined.
    GRADACC_STATUS_DEVICE_MISMATCH = 6,
    /// The call is not allowed in the object's current state (e.g. sync inside a micro-batch).
    GRADACC_STATUS_WRONG_STATE = 7,
    /// The accumulation window holds no micro-batch (on any rank), or its global item count is 0.
    GRADACC_STATUS_EMPTY_WINDOW = 8,
    /// An overflow needed a backoff while the loss scale was already at min_scale.
    GRADACC_STATUS_SCALE_AT_MINIMUM = 9,
    /// The requested backend (CUDA, NCCL, MPI) is not in this build or not on this machine.
    GRADACC_STATUS_BACKEND_UNAVAILABLE = 10,
    /// The communicator failed.
    GRADACC_STATUS_COMM_FAILURE = 11,
    /// Another rank's call failed, so this rank stopped the collective too (nothing was reduced).
    GRADACC_STATUS_PEER_FAILURE = 12,
    /// Saved state bytes are corrupt, truncated, foreign, or of an unsupported version.
    GRADACC_STATUS_CORRUPT_STATE = 13,
    /// An allocation failed.
    GRADACC_STATUS_OUT_OF_MEMORY = 14,
    /// An internal error (a bug in gradacc); the message says where.
    GRADACC_STATUS_INTERNAL = 15,
    /// The CUDA driver reported an error (a failed launch or copy, an invalid device address, a
    /// device that fell off the bus); the message carries the driver's own text.
    GRADACC_STATUS_DEVICE_FAILURE = 16,
    /// A collective did not complete within the communicator's timeout (gradacc_comm_set_timeout);
    /// the communicator was aborted, and the message names the phase and how long it waited.
    GRADACC_STATUS_TIMEOUT = 17,
}

pub use gradacc_status_t::*;

/// Every status with its name and meaning, in code order.
const STATUS_TEXT: [(gradacc_status_t, &CStr); 17] = [
    (
        GRADACC_STATUS_NULL_ARGUMENT,
        c"GRADACC_STATUS_NULL_ARGUMENT: a required pointer argument was NULL",
    ),
    (
        GRADACC_STATUS_INVALID_ARGUMENT,
        c"GRADACC_STATUS_INVALID_ARGUMENT: an argument's value is outside its domain",
    ),
    (
        GRADACC_STATUS_INVALID_HANDLE,
        c"GRADACC_STATUS_INVALID_HANDLE: destroyed, unknown or wrong-type handle",
    ),
    (
        GRADACC_STATUS_DTYPE_MISMATCH,
        c"GRADACC_STATUS_DTYPE_MISMATCH: gradient dtype differs from the tensor's",
    ),
    (
        GRADACC_STATUS_SIZE_MISMATCH,
        c"GRADACC_STATUS_SIZE_MISMATCH: buffer length or layout differs from the expected one",
    ),
    (
        GRADACC_STATUS_DEVICE_MISMATCH,
        c"GRADACC_STATUS_DEVICE_MISMATCH: objects of different devices or backends combined",
    ),
    (
        GRADACC_STATUS_WRONG_STATE,
        c"GRADACC_STATUS_WRONG_STATE: call not allowed in the object's current state",
    ),
    (GRADACC_STATUS_EMPTY_WINDOW, c"GRADACC_STATUS_EMPTY_WINDOW: the accumulation window is empty"),
    (
        GRADACC_STATUS_SCALE_AT_MINIMUM,
        c"GRADACC_STATUS_SCALE_AT_MINIMUM: overflow with the loss scale already at min_scale",
    ),
    (
        GRADACC_STATUS_BACKEND_UNAVAILABLE,
        c"GRADACC_STATUS_BACKEND_UNAVAILABLE: backend not in this build or not on this machine",
    ),
    (GRADACC_STATUS_COMM_FAILURE, c"GRADACC_STATUS_COMM_FAILURE: the communicator failed"),
    (
        GRADACC_STATUS_PEER_FAILURE,
        c"GRADACC_STATUS_PEER_FAILURE: another rank's call failed; nothing was reduced",
    ),
    (
        GRADACC_STATUS_CORRUPT_STATE,
        c"GRADACC_STATUS_CORRUPT_STATE: saved state bytes are corrupt or of another version",
    ),
    (GRADACC_STATUS_OUT_OF_MEMORY, c"GRADACC_STATUS_OUT_OF_MEMORY: an allocation failed"),
    (GRADACC_STATUS_INTERNAL, c"GRADACC_STATUS_INTERNAL: internal error in gradacc"),
    (
        GRADACC_STATUS_DEVICE_FAILURE,
        c"GRADACC_STATUS_DEVICE_FAILURE: the CUDA driver reported an error",
    ),
    (
        GRADACC_STATUS_TIMEOUT,
        c"GRADACC_STATUS_TIMEOUT: a collective did not complete within the communicator's timeout",
    ),
];

/// What an exported function fails with: a core error, or one of the two failures only a C
/// caller can cause.
#[derive(Debug)]
pub(crate) enum CallError {
    Core(Error),
    /// A required pointer argument was NULL; the message names it.
    Null(String),
    /// A handle that is not live in its registry; the message names the argument and the value.
    Handle(String),
}

impl From<Error> for CallError {
    fn from(e: Error) -> Self {
        CallError::Core(e)
    }
}

/// The result of an exported function's body.
pub(crate) type CallResult<T> = std::result::Result<T, CallError>;

impl CallError {
    pub(crate) fn message(&self) -> &str {
        match self {
            CallError::Core(e) => &e.message,
            CallError::Null(m) | CallError::Handle(m) => m,
        }
    }

    /// The status of the failure: one per kind (a test checks each of `ErrorKind::ALL` has its
    /// own), and a new kind must be given one here.
    fn status(&self) -> gradacc_status_t {
        let kind = match self {
            CallError::Null(_) => return GRADACC_STATUS_NULL_ARGUMENT,
            CallError::Handle(_) => return GRADACC_STATUS_INVALID_HANDLE,
            CallError::Core(e) => e.kind,
        };
        match kind {
            ErrorKind::InvalidArgument => GRADACC_STATUS_INVALID_ARGUMENT,
            ErrorKind::DtypeMismatch => GRADACC_STATUS_DTYPE_MISMATCH,
            ErrorKind::SizeMismatch => GRADACC_STATUS_SIZE_MISMATCH,
            ErrorKind::DeviceMismatch => GRADACC_STATUS_DEVICE_MISMATCH,
            ErrorKind::WrongState => GRADACC_STATUS_WRONG_STATE,
            ErrorKind::EmptyWindow => GRADACC_STATUS_EMPTY_WINDOW,
            ErrorKind::ScaleAtMinimum => GRADACC_STATUS_SCALE_AT_MINIMUM,
            ErrorKind::BackendUnavailable => GRADACC_STATUS_BACKEND_UNAVAILABLE,
            ErrorKind::CommFailure => GRADACC_STATUS_COMM_FAILURE,
            ErrorKind::Timeout => GRADACC_STATUS_TIMEOUT,
            ErrorKind::PeerFailure => GRADACC_STATUS_PEER_FAILURE,
            ErrorKind::CorruptState => GRADACC_STATUS_CORRUPT_STATE,
            ErrorKind::OutOfMemory => GRADACC_STATUS_OUT_OF_MEMORY,
            ErrorKind::DeviceFailure => GRADACC_STATUS_DEVICE_FAILURE,
            ErrorKind::Internal => GRADACC_STATUS_INTERNAL,
            // The Rust enum may grow; until the C ABI names a new kind, it reports a bug.
            _ => GRADACC_STATUS_INTERNAL,
        }
    }
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
pub(crate) fn guard(function: &str, body: impl FnOnce() -> CallResult<()>) -> gradacc_status_t {
    crate::logging::install();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => GRADACC_STATUS_OK,
        Ok(Err(e)) => {
            set_last_error(&format!("{function}: {}", e.message()));
            e.status()
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
pub(crate) fn null(argument: &str) -> CallError {
    CallError::Null(format!("argument `{argument}` is NULL"))
}

/// A static description of a status code (never NULL; unknown codes get a generic text). The code
/// is an `int32_t` rather than a gradacc_status_t so that any value may be passed.
///
/// Thread safety: may be called from any thread at any time.
#[no_mangle]
pub extern "C" fn gradacc_status_string(status: i32) -> *const c_char {
    let text: &CStr = if status == GRADACC_STATUS_OK as i32 {
        c"GRADACC_STATUS_OK: success"
    } else {
        STATUS_TEXT
            .iter()
            .find(|(s, _)| *s as i32 == status)
            .map_or(c"unknown gradacc status code", |(_, text)| text)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kind of the Rust API has a status of its own, so none reaches C as INTERNAL by the
    /// catch-all arm.
    #[test]
    fn every_kind_has_its_own_status() {
        let statuses: Vec<gradacc_status_t> =
            ErrorKind::ALL.iter().map(|&k| CallError::Core(Error::new(k, "")).status()).collect();
        for (i, s) in statuses.iter().enumerate() {
            assert!(!statuses[..i].contains(s), "{:?} shares {s:?}", ErrorKind::ALL[i]);
        }
    }
}
