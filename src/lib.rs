//! gradacc: correct mixed-precision gradient accumulation.
//!
//! A [`Scaler`] keeps the dynamic loss scale. An [`Accumulator`] adds the scaled 16- or 32-bit
//! gradients of each micro-batch, unscaled as they arrive, into one flat FP32 master buffer, and at
//! the boundary ([`Accumulator::sync`]) all-reduces it once over a [`Communicator`], normalises it,
//! measures its norm and clips it. The C ABI in `ffi` exposes the same objects.

// Every unsafe operation sits in its own block with a `SAFETY:` comment saying why it is sound.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

pub mod accumulator;
pub mod backend;
pub mod comm;
pub mod device;
pub mod dtype;
pub mod error;
pub mod scaler;
mod state;

pub use accumulator::{
    Accumulator, AccumulatorConfig, Gradient, Grads, LossReduction, Normalize, Sharding, SyncInfo,
    TensorDesc,
};
pub use comm::{Communicator, HostCollectives, LocalComm};
#[cfg(feature = "mpi")]
pub use comm::{MpiComm, MpiOptions};
pub use device::Device;
pub use dtype::{Dtype, Grad, GradMut};
pub use error::{Error, ErrorKind, Result};
pub use scaler::{Scaler, ScalerConfig, ScalerStats};

/// The crate version, the single source of every version number the project reports.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
