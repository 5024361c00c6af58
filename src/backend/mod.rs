//! Devices: what differs between the CPU and CUDA, and nothing else. `store_for` and
//! `scaler_for` are where a [`Device`] becomes its backend. Each backend supplies one accumulator
//! store for every sharding policy (its master memory, whole or this rank's shard, and the kernels
//! over it: `cpu::HostStore`, `cuda::DeviceStore`, behind `accumulator::Store`) and a scaler's
//! state (`cpu::HostScaler`, `cuda::CudaScaler`, behind `scaler::ScalerStore`); the semantics
//! (windows, counts, normalisation, the boundary's order, the update rule, checks and errors, the
//! shards and the window's flags) live once in `accumulator` and `scaler`. Every backend
//! implements the same per-element contract (see `crate::math` and its CUDA twin
//! `cuda/kernels/math.cuh`), so every device produces bitwise-identical master gradients.

pub mod cpu;
pub mod cuda;

use std::sync::Arc;

use crate::accumulator::{Plan, Store};
use crate::comm::Communicator;
use crate::device::Device;
use crate::error::{Error, ErrorKind, Result};
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
