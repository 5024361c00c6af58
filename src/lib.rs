//! gradacc: correct mixed-precision gradient accumulation.
//!
//! A [`Scaler`] keeps the dynamic loss scale. An [`Accumulator`] adds the scaled 16- or 32-bit
//! gradients of each micro-batch, unscaled as they arrive, into one flat FP32 master buffer, and at
//! the boundary ([`Accumulator::sync`]) all-reduces it once over a [`Communicator`], normalises it,
//! measures its norm and clips it.
//!
//! ```
//! use gradacc::{Accumulator, AccumulatorConfig, Dtype, Grad, Scaler, ScalerConfig, TensorDesc};
//!
//! // One tensor of 3 weights; its gradients come in f32 here, f16 and bf16 the same way.
//! let tensors = [TensorDesc { numel: 3, dtype: Dtype::F32 }];
//! let scaler = Scaler::new(ScalerConfig::default())?;
//! let config = AccumulatorConfig { max_grad_norm: 10.0, ..Default::default() };
//! let acc = Accumulator::new(config, &tensors)?;
//! let mut weights = [0.5f32; 3];
//! for _step in 0..2 {
//!     for items in [8, 5] {
//!         // The backward of the mean loss over the micro-batch's items, scaled by the scale:
//!         // here the loss (w - 1)^2 / 2 of every item.
//!         let scale = scaler.scale()?;
//!         let grad = weights.map(|w| (w - 1.0) * scale);
//!         acc.add(&scaler, &[Grad::F32(&grad)][..], items)?;
//!     }
//!     // With several ranks: acc.sync(Some(&*comm)), comm a LocalComm, MpiComm or NcclComm.
//!     let info = acc.sync(None)?;
//!     if !scaler.update(info.found_inf)?.skipped {
//!         // The master holds the gradient of the mean loss over all 13 items, unscaled.
//!         acc.with_master(0, |g| weights.iter_mut().zip(g).for_each(|(w, g)| *w -= 0.5 * g))?;
//!     }
//! }
//! assert_eq!(weights, [0.875; 3]);
//! # Ok::<(), gradacc::Error>(())
//! ```
//!
//! 16-bit gradients and weights are `half::f16` / `half::bf16` slices (the crate re-exports
//! [`half`]); bits from elsewhere borrow as they are ([`Grad::f16_bits`], [`Grad::bf16_bits`]):
//!
//! ```
//! use gradacc::half::{bf16, f16};
//! use gradacc::{Accumulator, AccumulatorConfig, Dtype, Grad, GradMut, Optimizer};
//! use gradacc::{OptimizerConfig, Scaler, ScalerConfig, TensorDesc};
//!
//! let (n, f16s, bf16s) = (2, Dtype::F16, Dtype::Bf16);
//! let tensors = [TensorDesc { numel: n, dtype: f16s }, TensorDesc { numel: n, dtype: bf16s }];
//! let scaler = Scaler::new(ScalerConfig { init_scale: 1024.0, ..Default::default() })?;
//! let acc = Accumulator::new(AccumulatorConfig::default(), &tensors)?;
//! let (mut w0, mut w1) = ([f16::ONE; 2], [bf16::ONE; 2]);
//! let config = OptimizerConfig { lr: 0.01, ..Default::default() };
//! let opt = Optimizer::new(&acc, config, &[], &[Grad::F16(&w0), Grad::Bf16(&w1)])?;
//! let g0 = [f16::from_f32(0.5 * 1024.0); 2];
//! let g1 = [0x4400u16; 2]; // bf16 bits of 512 = 0.5 * 1024, as a C buffer holds them
//! acc.add(&scaler, &[Grad::F16(&g0), Grad::bf16_bits(&g1)][..], 1)?;
//! let info = acc.sync(None)?;
//! scaler.update(info.found_inf)?;
//! assert!(opt.step(&acc, &mut [GradMut::F16(&mut w0), GradMut::Bf16(&mut w1)], None)?);
//! assert!(w0[0] < f16::ONE && w1[1] < bf16::ONE);
//! # Ok::<(), gradacc::Error>(())
//! ```
//!
//! Who owns what: `accumulator` is the core (the window's state machine, the add path in
//! `accumulator/microbatch.rs`, the boundary's steps in `accumulator/boundary.rs` and its
//! protocol in `accumulator/protocol.rs`, sharding as a policy in `accumulator/sharding.rs`, what
//! a device supplies in `accumulator/store.rs`, window checkpoints in `accumulator/checkpoint.rs`),
//! `scaler` the loss scale's semantics, `optimizer` the FP32-master step, `comm` the
//! communicators, `simd` the host's kernels (which the CPU store and the host transports share),
//! and `backend` what each device supplies (its store: master memory and kernels; its scaler
//! state). A boundary feature is written once in the core; a device only adds
//! kernels. The C ABI is the crate `gradacc-capi` (capi/).

// Every unsafe operation sits in its own block with a `SAFETY:` comment saying why it is sound.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
// Small functions: at most 80 lines each (clippy.toml).
#![warn(clippy::too_many_lines)]
// Without `internal` the modules are private and what only gradacc-capi uses is unreachable;
// the builds with it (the workspace, its tests) still check for dead code and unused imports.
#![cfg_attr(not(feature = "internal"), allow(dead_code, unused_imports))]

// The crate's modules: public with feature `internal` (for gradacc-capi, the tests and the
// benches; no semver promise), private otherwise, so that the Rust API is the names exported
// below. Each is declared twice, in full, so that rustfmt (which does not look inside macros)
// formats every file.
#[cfg(feature = "internal")]
pub mod accumulator;
#[cfg(not(feature = "internal"))]
mod accumulator;
#[cfg(feature = "internal")]
pub mod backend;
#[cfg(not(feature = "internal"))]
mod backend;
#[cfg(feature = "internal")]
pub mod comm;
#[cfg(not(feature = "internal"))]
mod comm;
#[cfg(feature = "internal")]
pub mod device;
#[cfg(not(feature = "internal"))]
mod device;
mod diagnostics;
#[cfg(feature = "internal")]
pub mod dtype;
#[cfg(not(feature = "internal"))]
mod dtype;
#[cfg(feature = "internal")]
pub mod error;
#[cfg(not(feature = "internal"))]
mod error;
#[cfg(feature = "internal")]
pub mod math;
#[cfg(not(feature = "internal"))]
mod math;
#[cfg(feature = "internal")]
pub mod mesh;
#[cfg(not(feature = "internal"))]
mod mesh;
#[cfg(feature = "internal")]
pub mod optimizer;
#[cfg(not(feature = "internal"))]
mod optimizer;
#[cfg(feature = "internal")]
pub mod scaler;
#[cfg(not(feature = "internal"))]
mod scaler;
#[cfg(feature = "internal")]
pub mod simd;
#[cfg(not(feature = "internal"))]
mod simd;
mod state;

pub use accumulator::{
    Accumulator, AccumulatorBuilder, AccumulatorConfig, Gradient, Grads, LossReduction, Normalize,
    Overflow, OverflowAt, Sharding, SyncInfo, TensorDesc, TensorStats, MASTER_ALIGN,
    MAX_WINDOW_COUNT,
};
pub use backend::cuda::nccl::{unique_id as nccl_unique_id, NcclComm};
pub use comm::{Communicator, LocalComm, DEFAULT_TIMEOUT};
#[cfg(feature = "mpi")]
pub use comm::{MpiComm, MpiOptions};
pub use device::{Device, DevicePtr, Stream};
pub use diagnostics::{diagnostics, ENVIRONMENT};
pub use dtype::{Dtype, Grad, GradMut};
pub use error::{Error, ErrorKind, Result};
/// The `half` crate whose `f16` and `bf16` the 16-bit gradients and weights are, re-exported so
/// that a user names the same version (`gradacc::half::f16`).
pub use half;
pub use mesh::{Axis, Mesh, MeshInfo, MeshShape, Part, Replicated};
pub use optimizer::fp8;
pub use optimizer::{
    join_master, split_master, Algorithm, MasterFormat, MomentFormat, Optimizer, OptimizerBuilder,
    OptimizerConfig, Rounding, Slot, StateFormat, TensorGroup, WeightFormat, WeightMut,
    MOMENT_BLOCK,
};
pub use scaler::{Scaler, ScalerConfig, ScalerState, ScalerStats, StepOutcome};

/// The crate version, the single source of every version number the project reports.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
