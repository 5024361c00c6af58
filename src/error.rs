//! The error type of the Rust API. Every error carries a message that names the argument or state
//! and the value that was wrong. Each kind has its own C status code (a kind without one does not
//! compile: see `ffi::status`); the C layer adds the two failures only C can have, a NULL pointer
//! and an unknown handle.

use std::fmt;

/// What went wrong, as a stable category (the C status code is derived from it). New kinds may
/// be added in any release.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// An argument had a value outside its domain (a count, a size, an enum value, a config field,
    /// a null or misaligned address).
    InvalidArgument,
    /// A gradient's dtype differs from the tensor's declared dtype.
    DtypeMismatch,
    /// A buffer's length differs from what the object expects.
    SizeMismatch,
    /// Objects bound to different devices or backends were combined.
    DeviceMismatch,
    /// The call is not allowed in the object's current state (e.g. `sync` inside a micro-batch).
    WrongState,
    /// The accumulation window holds no micro-batch on any rank.
    EmptyWindow,
    /// An overflow arrived while the loss scale was already at `min_scale`.
    ScaleAtMinimum,
    /// The requested backend is not available in this build or on this machine.
    BackendUnavailable,
    /// The communicator failed, or ranks disagreed in a way that makes the collective meaningless.
    CommFailure,
    /// A collective did not complete within the communicator's timeout; the communicator was
    /// aborted.
    Timeout,
    /// Another rank of the collective reported an error, so this rank did not complete it either.
    PeerFailure,
    /// Serialised state is corrupt, truncated, or of an unknown version.
    CorruptState,
    /// An allocation failed.
    OutOfMemory,
    /// The CUDA driver reported an error (a launch, a copy, a bad device address).
    DeviceFailure,
    /// A bug inside gradacc (a caught panic). Please report it.
    Internal,
}

impl ErrorKind {
    /// Every kind, in declaration order: what the C ABI maps to its statuses, checked there
    /// to give each one its own.
    #[cfg(feature = "internal")]
    pub const ALL: [ErrorKind; 15] = {
        use ErrorKind::*;
        [
            InvalidArgument,
            DtypeMismatch,
            SizeMismatch,
            DeviceMismatch,
            WrongState,
            EmptyWindow,
            ScaleAtMinimum,
            BackendUnavailable,
            CommFailure,
            Timeout,
            PeerFailure,
            CorruptState,
            OutOfMemory,
            DeviceFailure,
            Internal,
        ]
    };
}

/// An error with its category and a human-readable message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub kind: ErrorKind,
    pub message: String,
}

impl Error {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error { kind, message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::InvalidArgument, message)
    }

    pub fn wrong_state(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::WrongState, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(all(test, feature = "internal"))]
mod tests {
    use super::ErrorKind;

    /// `ALL` lists each kind once: the match fails to compile when a kind is added, and the
    /// assertion when `ALL` misses it.
    #[test]
    fn all_lists_every_kind() {
        let position = |k: ErrorKind| match k {
            ErrorKind::InvalidArgument => 0,
            ErrorKind::DtypeMismatch => 1,
            ErrorKind::SizeMismatch => 2,
            ErrorKind::DeviceMismatch => 3,
            ErrorKind::WrongState => 4,
            ErrorKind::EmptyWindow => 5,
            ErrorKind::ScaleAtMinimum => 6,
            ErrorKind::BackendUnavailable => 7,
            ErrorKind::CommFailure => 8,
            ErrorKind::Timeout => 9,
            ErrorKind::PeerFailure => 10,
            ErrorKind::CorruptState => 11,
            ErrorKind::OutOfMemory => 12,
            ErrorKind::DeviceFailure => 13,
            ErrorKind::Internal => 14,
        };
        for (i, k) in ErrorKind::ALL.iter().enumerate() {
            assert_eq!(position(*k), i, "{k:?}");
        }
    }
}
