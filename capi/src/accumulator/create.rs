//! Creating an accumulator (owning its master, over the caller's buffer, or sharded) and
//! destroying it.

use std::sync::Arc;

use super::config::{config_from_c, gradacc_accumulator_config_t};
use super::{gradacc_accumulator_t, ACCUMULATORS};
use crate::comm::{check_no_sync_of, gradacc_comm_t, COMMS};
use crate::status::{gradacc_status_t, guard, null, CallResult};
use crate::types::*;
use gradacc::accumulator::{Accumulator, AccumulatorConfig, Sharding, TensorDesc};
use gradacc::device::Device;
use gradacc::error::Error;

/// Reads the config and tensor list arguments shared by both constructors.
pub(super) fn creation_args(
    config: *const gradacc_accumulator_config_t,
    tensors: *const gradacc_tensor_desc_t,
    n: usize,
    device: *const gradacc_device_t,
) -> CallResult<(AccumulatorConfig, Vec<TensorDesc>, Device)> {
    let config = if config.is_null() {
        AccumulatorConfig::default()
    } else {
        // SAFETY: a non-null `config` points to a config struct of its `struct_size` (API
        // contract).
        config_from_c(&unsafe { read_config(config, "config")? })?
    };
    // Before the pointer: an empty list (a C++ `{}`, whose data() may be NULL) is the count's fault.
    if n == 0 {
        return Err(Error::invalid("`n` is 0: an accumulator needs at least one tensor").into());
    }
    // SAFETY: by the API contract `n` descriptors; the length is checked before use.
    let raw = unsafe { read_slice(tensors, n, "tensors", "n")? };
    let descs = raw
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let numel = usize::try_from(t.numel).map_err(|_| {
                Error::invalid(format!("`tensors[{i}]`.numel = {} is too large", t.numel))
            })?;
            Ok(TensorDesc { numel, dtype: dtype_from_c(t.dtype, &format!("tensors[{i}].dtype"))? })
        })
        .collect::<CallResult<Vec<_>>>()?;
    Ok((config, descs, parse_device(device)?))
}

/// Creates an accumulator over `n` tensors, owning a zero-initialised FP32 master buffer laid out
/// tensor after tensor, each tensor starting at a multiple of GRADACC_MASTER_ALIGN bytes (the
/// buffer's start included), with zeros between. `config` NULL means the defaults; `device`
/// NULL means the CPU. On a CUDA device the master is allocated in device memory on the device's
/// stream (stream-ordered), and every later call on the accumulator is ordered on that stream;
/// the first CUDA object on a device compiles the kernels with NVRTC (tens of milliseconds).
///
/// Ownership: `*out` is the caller's; free it with gradacc_accumulator_destroy.
/// Thread safety: any thread. See each function for what may run concurrently on the result.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_create(
    config: *const gradacc_accumulator_config_t,
    tensors: *const gradacc_tensor_desc_t,
    n: usize,
    device: *const gradacc_device_t,
    out: *mut *mut gradacc_accumulator_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_create", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        let (config, descs, device) = creation_args(config, tensors, n, device)?;
        *out = ACCUMULATORS
            .insert(Arc::new(Accumulator::builder(&descs).device(device).config(config).build()?));
        Ok(())
    })
}

/// Like gradacc_accumulator_create, but adopts the caller's FP32 buffer `master` of exactly
/// `master_numel` elements as the master buffer, e.g. a framework's own contiguous gradient
/// buffer: the tensors with the padding that starts each at a multiple of GRADACC_MASTER_ALIGN
/// bytes (gradacc_accumulator_master_numel gives the count; tensor i starts at
/// gradacc_accumulator_offset). Its contents are ignored until written; the padding is zeroed here
/// (stream-ordered on CUDA) and must stay untouched. A `master` aligned to GRADACC_MASTER_ALIGN
/// bytes makes every tensor's master as aligned.
///
/// Ownership: `*out` is the caller's; free it with gradacc_accumulator_destroy. `master` stays the
/// caller's and must outlive the accumulator; gradacc never frees it.
/// Thread safety: as gradacc_accumulator_create.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_create_with_buffer(
    config: *const gradacc_accumulator_config_t,
    tensors: *const gradacc_tensor_desc_t,
    n: usize,
    device: *const gradacc_device_t,
    master: *mut f32,
    master_numel: usize,
    out: *mut *mut gradacc_accumulator_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_create_with_buffer", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        let (config, descs, device) = creation_args(config, tensors, n, device)?;
        if master.is_null() {
            return Err(null("master"));
        }
        check_len::<f32>(master_numel, "master_numel")?;
        // SAFETY: the caller lends `master_numel` f32 values in the device's memory for the
        // accumulator's lifetime (API contract).
        *out = ACCUMULATORS.insert(Arc::new(unsafe {
            Accumulator::builder(&descs)
                .device(device)
                .config(config)
                .master_buffer(master, master_numel)
                .build()?
        }));
        Ok(())
    })
}

/// Creates a sharded accumulation (GRADACC_SHARDING_ACCUMULATE, whose contract is in
/// docs/sharding.md, "Sharded accumulation (ZeRO-2)"). `config`->sharding must be
/// GRADACC_SHARDING_ACCUMULATE, and `comm` a communicator of `config`->shard_count ranks on
/// which this is rank `config`->shard_rank: a host communicator (in-process or MPI) when `device`
/// is NULL or the CPU, an NCCL communicator on the same device for CUDA. Fails, writing nothing,
/// with GRADACC_STATUS_INVALID_ARGUMENT for another policy, or a shard count or rank that is not
/// `comm`'s size and rank; GRADACC_STATUS_DEVICE_MISMATCH for a communicator of another kind or
/// device; GRADACC_STATUS_NULL_ARGUMENT or GRADACC_STATUS_INVALID_HANDLE for a NULL or dead `comm`.
///
/// From then on gradacc_accumulator_add, gradacc_accumulator_begin_microbatch /
/// gradacc_accumulator_add_tensor / gradacc_accumulator_end_microbatch,
/// gradacc_accumulator_reset inside a micro-batch, and gradacc_accumulator_sync (with `comm` or
/// NULL) are collectives over `comm`. gradacc_accumulator_shard gives what the accumulator holds;
/// gradacc_accumulator_master covers only tensors inside it.
///
/// Ownership: `*out` is the caller's; free it with gradacc_accumulator_destroy. The accumulator
/// holds its own reference to `comm`'s communicator: destroying the handle `comm` releases the
/// handle only, and the group stays usable through the accumulator (for MPI, destroy the
/// accumulator before MPI_Finalize).
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_create_sharded(
    config: *const gradacc_accumulator_config_t,
    tensors: *const gradacc_tensor_desc_t,
    n: usize,
    device: *const gradacc_device_t,
    comm: *mut gradacc_comm_t,
    out: *mut *mut gradacc_accumulator_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_create_sharded", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        let (config, descs, device) = creation_args(config, tensors, n, device)?;
        let comm = COMMS.get(comm, "comm")?;
        if !matches!(config.sharding, Sharding::Accumulate { .. }) {
            return Err(Error::invalid("`config`.sharding must be GRADACC_SHARDING_ACCUMULATE for gradacc_accumulator_create_sharded").into());
        }
        *out = ACCUMULATORS.insert(Arc::new(
            Accumulator::builder(&descs)
                .device(device)
                .config(config)
                .communicator(comm)
                .build()?,
        ));
        Ok(())
    })
}

/// Destroys an accumulator. NULL is accepted and does nothing; must not be called twice on one
/// handle (a second call is detected and reported as GRADACC_STATUS_INVALID_HANDLE). Pointers from
/// gradacc_accumulator_master become invalid.
///
/// Fails with GRADACC_STATUS_WRONG_STATE, leaving the accumulator usable, while a sync of it runs on
/// another thread: abort or destroy the communicator it waits on first.
///
/// Thread safety: any thread, once no other call uses the accumulator.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_destroy(
    acc: *mut gradacc_accumulator_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_destroy", || {
        if !acc.is_null() {
            check_no_sync_of(acc as usize)?;
            ACCUMULATORS.remove(acc, "acc")?;
        }
        Ok(())
    })
}
