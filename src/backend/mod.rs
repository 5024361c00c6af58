//! Devices: what differs between the CPU and CUDA, and nothing else. `store_for`,
//! `optimizer_store_for` and `scaler_for` are where a [`Device`] becomes its backend. Each backend
//! supplies one accumulator store for every sharding policy (its master memory, whole or this
//! rank's shard, and the kernels over it: `cpu::HostStore`, `cuda::DeviceStore`, behind
//! `accumulator::Store`), an optimizer's state and fused step (`cpu::HostOptimizer`,
//! `cuda::DeviceOptimizer`, behind `optimizer::store::OptimizerStore`) and a scaler's state
//! (`cpu::HostScaler`, `cuda::CudaScaler`, behind `scaler::ScalerStore`); the semantics (windows,
//! counts, normalisation, the boundary's order, the update rules, checks and errors, the shards
//! and the window's flags) live once in `accumulator`, `optimizer` and `scaler`. Every backend
//! implements the same per-element contract (see `crate::math` and its CUDA twin
//! `cuda/kernels/math.cuh`), so every device produces bitwise-identical master gradients.

pub mod cpu;
pub mod cuda;

use std::ffi::c_void;
use std::sync::Arc;

use crate::accumulator::{Gradient, Grads, Plan, Store, TensorDesc};
use crate::comm::Communicator;
use crate::device::{Device, DevicePtr};
use crate::dtype::{self, Grad};
use crate::error::{Error, ErrorKind, Result};
use crate::optimizer::store::{OptimizerStore, Setup};
use crate::scaler::{ScalerConfig, ScalerState, ScalerStore};

/// Whether objects can be created on `device` here: a CUDA device needs a driver, a valid stream
/// and NVRTC to compile the kernels (else BACKEND_UNAVAILABLE).
pub(crate) fn check(device: Device) -> Result<()> {
    let Device::Cuda { stream, .. } = device else { return Ok(()) };
    cuda::driver::check_stream(stream.cast(), "`stream`")?;
    cuda::driver::require_driver()?;
    cuda::compile::require_nvrtc().map_err(|e| {
        Error::new(
            ErrorKind::BackendUnavailable,
            format!(
                "a CUDA device was asked for, but the kernels cannot be compiled: {}",
                e.message
            ),
        )
    })
}

/// The one place a [`Device`] becomes its backend: the store of an accumulator on `device` over
/// `plan`, owning its master or adopting `adopt` (a host or device address of the layout's
/// length), and for sharded accumulation bound to `comm` (none: a group of one).
pub(crate) fn store_for(
    device: Device,
    plan: &Arc<Plan>,
    adopt: Option<*mut f32>,
    comm: Option<Arc<dyn Communicator>>,
) -> Result<Box<dyn Store>> {
    Ok(match device {
        Device::Cpu => Box::new(cpu::HostStore::new(plan.clone(), adopt, comm)?),
        Device::Cuda { ordinal, stream } => Box::new(cuda::DeviceStore::new(
            plan.clone(),
            ordinal,
            stream.cast(),
            adopt.map(|p| p as u64),
            comm,
        )?),
    })
}

/// The state of an optimizer on `device`, made from `setup` (checked by the caller, except for
/// what only the device can check: the weights' memory, and the adopted masters'): in host
/// memory, or in device memory ordered on the device's stream.
pub(crate) fn optimizer_store_for(
    device: Device,
    setup: &Setup<'_>,
) -> Result<Box<dyn OptimizerStore>> {
    Ok(match device {
        Device::Cpu => Box::new(cpu::HostOptimizer::new(setup)?),
        Device::Cuda { .. } if setup.weight_formats.iter().any(|f| f.is_fp8()) => {
            let i = setup.weight_formats.iter().position(|f| f.is_fp8()).expect("one is FP8");
            return Err(Error::invalid(format!(
                "`weight_formats[{i}]`: FP8 weights are written by host optimizers only (not on CUDA yet)"
            )));
        }
        Device::Cuda { .. } if setup.format.blockwise() => {
            return Err(Error::invalid(
                "`moments`: 8-bit blockwise moments are kept by host optimizers only (use FP32 or bf16 moments on CUDA)",
            ))
        }
        Device::Cuda { ordinal, stream } => {
            Box::new(cuda::DeviceOptimizer::new(setup, ordinal, stream.cast())?)
        }
    })
}

/// Gradients given as raw addresses, one per tensor of `descs` (the C ABI's form): host views on
/// the CPU, device addresses on CUDA. A host address is checked for null, alignment and size
/// first (the error names `grads[i]`); a device address is the CUDA store's to check.
///
/// # Safety
/// On the CPU, each non-null address points to its tensor's numel readable values of its dtype
/// for `'a`.
pub(crate) unsafe fn raw_gradients<'a>(
    device: Device,
    grads: &[*const c_void],
    descs: &[TensorDesc],
) -> Result<RawGradients<'a>> {
    if grads.len() != descs.len() {
        return Err(Error::new(
            ErrorKind::SizeMismatch,
            format!(
                "add got {} gradients, the accumulator has {} tensors",
                grads.len(),
                descs.len()
            ),
        ));
    }
    if let Device::Cuda { .. } = device {
        return Ok(RawGradients::Device(grads.iter().map(|&p| p as DevicePtr).collect()));
    }
    let mut views = Vec::with_capacity(grads.len());
    for (i, (&p, d)) in grads.iter().zip(descs).enumerate() {
        // The checks without a message first: over a thousand small tensors, building the
        // argument's name (or returning a Result through memory) cost as much as the adds.
        // SAFETY: the caller's contract.
        match unsafe { dtype::grad_view(p, d.numel, d.dtype) } {
            Some(g) => views.push(g),
            None => return Err(dtype::buffer_error(p, d.numel, d.dtype, &format!("grads[{i}]"))),
        }
    }
    Ok(RawGradients::Host(views))
}

/// One raw gradient of `desc` (checked by the caller for null, alignment and size): a host view
/// on the CPU, a device address on CUDA.
///
/// # Safety
/// As [`raw_gradients`], for the one address.
pub(crate) unsafe fn raw_gradient<'a>(
    device: Device,
    grad: *const c_void,
    desc: TensorDesc,
) -> Result<Gradient<'a>> {
    Ok(match device {
        Device::Cuda { .. } => Gradient::Device(grad as DevicePtr),
        // SAFETY: the caller's contract.
        Device::Cpu => Gradient::Host(
            unsafe { dtype::grad_view(grad, desc.numel, desc.dtype) }
                .ok_or_else(|| dtype::buffer_error(grad, desc.numel, desc.dtype, "grad"))?,
        ),
    })
}

/// What [`raw_gradients`] makes of the addresses.
pub(crate) enum RawGradients<'a> {
    Host(Vec<Grad<'a>>),
    Device(Vec<DevicePtr>),
}

impl RawGradients<'_> {
    pub(crate) fn as_grads(&self) -> Grads<'_> {
        match self {
            RawGradients::Host(g) => Grads::Host(g),
            RawGradients::Device(d) => Grads::Device(d),
        }
    }
}

/// The state of a scaler on `device` under `config` (checked by the caller), starting from
/// `initial`: in host memory behind a lock, or in device memory ordered on the device's stream.
pub(crate) fn scaler_for(
    device: Device,
    config: ScalerConfig,
    initial: &ScalerState,
) -> Result<Box<dyn ScalerStore>> {
    Ok(match device {
        Device::Cpu => Box::new(cpu::HostScaler::new(config, initial)),
        Device::Cuda { ordinal, stream } => {
            Box::new(cuda::CudaScaler::new(config, initial, ordinal, stream.cast())?)
        }
    })
}
