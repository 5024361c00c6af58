//! Where an object's memory lives and its work runs. Accumulators, scalers and communicators that
//! work together must be on the same device; the rules that check it live with the objects.

use crate::error::{Error, ErrorKind, Result};

/// An address in a device's memory (CUDA's `CUdeviceptr`).
pub type DevicePtr = u64;

/// A CUDA stream handle (`CUstream`), opaque here: the core orders work by it without the driver,
/// and only the CUDA backend reads it as its driver's type.
pub type Stream = *mut std::ffi::c_void;

/// The CPU, or one CUDA device with the caller's stream that orders every call's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    /// `stream` is borrowed: the caller keeps it alive while objects on it exist. NULL is the
    /// legacy default stream; the per-thread default stream is refused (it differs per thread).
    Cuda {
        ordinal: i32,
        stream: Stream,
    },
}

impl Device {
    /// Checks that objects can be created on this device here: a CUDA device needs a driver, a
    /// valid stream and NVRTC to compile the kernels (else BACKEND_UNAVAILABLE).
    pub fn check(self) -> Result<Self> {
        if let Device::Cuda { ordinal, .. } = self {
            if ordinal < 0 {
                return Err(Error::invalid(format!("CUDA device ordinal {ordinal} is negative")));
            }
        }
        crate::backend::check(self)?;
        Ok(self)
    }

    /// Whether two objects on these devices can work together: the CPU with the CPU, or the same
    /// CUDA device (their streams may differ: the objects order themselves with events).
    pub fn same_as(self, other: Device) -> bool {
        match (self, other) {
            (Device::Cpu, Device::Cpu) => true,
            (Device::Cuda { ordinal: a, .. }, Device::Cuda { ordinal: b, .. }) => a == b,
            _ => false,
        }
    }

    /// "the CPU" or "CUDA device N", for messages.
    pub fn name(self) -> String {
        match self {
            Device::Cpu => "the CPU".into(),
            Device::Cuda { ordinal, .. } => format!("CUDA device {ordinal}"),
        }
    }

    /// DEVICE_MISMATCH unless `a` and `b` (each named for the message) can work together.
    pub(crate) fn require_same(a: (&str, Device), b: (&str, Device)) -> Result<()> {
        if a.1.same_as(b.1) {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::DeviceMismatch,
            format!("{} is on {}, {} on {}", a.0, a.1.name(), b.0, b.1.name()),
        ))
    }
}
