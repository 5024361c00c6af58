//! C API of the accumulator.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, LazyLock};

use crate::comm::{check_no_sync_of, gradacc_comm_t, sync_in_flight, COMMS};
use crate::handle::Registry;
use crate::scaler::{gradacc_scaler_t, SCALERS};
use crate::status::{gradacc_status_t, guard, null, CallResult};
use crate::types::*;
use gradacc::accumulator::Owed;
use gradacc::accumulator::{
    Accumulator, AccumulatorConfig, LossReduction, Normalize, Overflow, OverflowAt, Sharding,
    SyncInfo, TensorDesc,
};
use gradacc::device::Device;
use gradacc::dtype::Dtype;
use gradacc::error::{Error, ErrorKind, Result};

/// Bytes to which every tensor's FP32 master is aligned in the flat master: tensor `i` starts at
/// an element offset that is a multiple of GRADACC_MASTER_ALIGN / 4 (gradacc_accumulator_offset),
/// with zeros between tensors. An owned master starts at such an address too.
pub const GRADACC_MASTER_ALIGN: usize = 256;
const _: () = assert!(GRADACC_MASTER_ALIGN == gradacc::accumulator::MASTER_ALIGN);

/// A gradient accumulator (opaque). Create with gradacc_accumulator_create, free with
/// gradacc_accumulator_destroy.
pub struct gradacc_accumulator_t {
    _private: [u8; 0],
}

pub(crate) static ACCUMULATORS: LazyLock<Registry<Accumulator>> =
    LazyLock::new(|| Registry::new("accumulator"));

/// How the caller reduced its loss over the `count` items of a micro-batch.
pub type gradacc_loss_reduction_t = i32;
/// The loss is the mean over the micro-batch's items (default).
pub const GRADACC_LOSS_REDUCTION_MEAN: gradacc_loss_reduction_t = 0;
/// The loss is the sum over the micro-batch's items.
pub const GRADACC_LOSS_REDUCTION_SUM: gradacc_loss_reduction_t = 1;

/// What the summed gradient is divided by at the boundary.
pub type gradacc_normalize_t = i32;
/// The global item count over micro-batches and ranks (default): the gradient of the mean loss
/// over every item of the effective batch. Mean-reduced micro-batches are weighted by their count.
pub const GRADACC_NORMALIZE_BY_COUNT: gradacc_normalize_t = 0;
/// The global number of micro-batches (`loss / steps` with a DDP mean): a mean of means.
pub const GRADACC_NORMALIZE_BY_MICROBATCHES: gradacc_normalize_t = 1;
/// The number of ranks: sum over micro-batches, mean over ranks (DDP with no_sync). A window that
/// merged saved windows counts the ranks that produced them (gradacc_accumulator_merge_window).
pub const GRADACC_NORMALIZE_BY_WORLD: gradacc_normalize_t = 2;
/// No division: the plain sum.
pub const GRADACC_NORMALIZE_NONE: gradacc_normalize_t = 3;

/// What each rank holds of the reduced gradient after the boundary.
pub type gradacc_sharding_t = i32;
/// Every rank holds the whole reduced gradient: an all-reduce, as DDP (default).
pub const GRADACC_SHARDING_NONE: gradacc_sharding_t = 0;
/// Rank `shard_rank` of `shard_count` holds only its shard of the reduced gradient, a contiguous
/// range of the flat layout (gradacc_accumulator_shard): a reduce-scatter, half an all-reduce's
/// traffic, as a distributed optimizer (ZeRO-1) needs. The window accumulates the whole gradient;
/// the norm and clipping coefficient are the whole gradient's, the same on every rank; the shard
/// holds the bits an all-reduce would leave there (on host communicators; on real NCCL, whose
/// collectives may order their sums differently, within the last bits). Sync on a communicator
/// of `shard_count` ranks on which this is rank `shard_rank`, on the CPU or CUDA, or with
/// gradacc_accumulator_sync_hybrid over a shard group and a replica group (HSDP).
pub const GRADACC_SHARDING_REDUCE_SCATTER: gradacc_sharding_t = 1;
/// Sharded accumulation (ZeRO-2): rank `shard_rank` of `shard_count` holds only its shard of the
/// FP32 gradient, and every micro-batch is reduce-scattered as it is added. Create it with
/// gradacc_accumulator_create_sharded. What each rank holds, the calls every rank makes, how a
/// failure ends and what the result equals: docs/sharding.md, "Sharded accumulation (ZeRO-2)".
pub const GRADACC_SHARDING_ACCUMULATE: gradacc_sharding_t = 2;

/// What a non-finite gradient value costs the window (the Rust API's `Overflow`, whose doc is the
/// contract; docs/overflow.md states it for every language).
pub type gradacc_overflow_t = i32;
/// The window's step is skipped on every rank, as PyTorch's GradScaler does (default).
pub const GRADACC_OVERFLOW_SKIP_STEP: gradacc_overflow_t = 0;
/// Only the micro-batch that held it is dropped, on the rank that fed it; the boundary normalises
/// by what every rank kept, and the step is skipped only when nothing was kept or the sum
/// overflows. CPU and CUDA accumulators, every sharding policy; on CUDA each
/// gradacc_accumulator_add and gradacc_accumulator_end_microbatch waits for the stream
/// (docs/overflow.md). Update the scaler with gradacc_scaler_update: a drop backs the scale off.
/// A window that drops every micro-batch on every rank is one skipped step: found_inf 1,
/// total_count and microbatches 0, grad_norm 0, clip_coef 1, the master +0.0 throughout; the
/// scaler's update counts one overflow however many were dropped (GRADACC_STATUS_SCALE_AT_MINIMUM
/// at min_scale), and gradacc_optimizer_step changes nothing (docs/overflow.md, "A window that
/// drops everything").
pub const GRADACC_OVERFLOW_DROP_MICROBATCH: gradacc_overflow_t = 1;

/// Where a window first went non-finite (gradacc_sync_info_t's `overflow_at`).
pub type gradacc_overflow_at_t = i32;
/// Nowhere: the window stayed finite, or found_inf is set and the first place is unknown (a
/// rank's window went non-finite where nothing recorded it, which may come before any other
/// place, so no rank names one). Such places: a window restored by gradacc_accumulator_load_window or
/// gradacc_accumulator_merge_window that holds a non-finite value (every device and policy);
/// on CUDA under GRADACC_OVERFLOW_SKIP_STEP, every overflowing window; on CUDA under
/// GRADACC_OVERFLOW_DROP_MICROBATCH, a kept micro-batch whose sum overflowed a whole master
/// (the CPU locates that one: GRADIENT). A shard's overflowing sum under sharded accumulation is
/// REDUCTION on both devices.
pub const GRADACC_OVERFLOW_AT_NONE: gradacc_overflow_at_t = 0;
/// A gradient: `overflow_rank`, `overflow_microbatch` and `overflow_tensor` say where.
pub const GRADACC_OVERFLOW_AT_GRADIENT: gradacc_overflow_at_t = 1;
/// Every rank's window was finite; their sum overflowed.
pub const GRADACC_OVERFLOW_AT_REDUCTION: gradacc_overflow_at_t = 2;

/// Accumulator configuration. Initialise with gradacc_accumulator_config_default, then change
/// fields.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_accumulator_config_t {
    /// sizeof(gradacc_accumulator_config_t); set by gradacc_accumulator_config_default.
    pub struct_size: usize,
    /// GRADACC_LOSS_REDUCTION_* (default MEAN).
    pub loss_reduction: gradacc_loss_reduction_t,
    /// GRADACC_NORMALIZE_* (default BY_COUNT).
    pub normalize: gradacc_normalize_t,
    /// Clip the boundary gradient's global L2 norm to this value; 0 disables clipping (default 0).
    pub max_grad_norm: f32,
    /// Target elements per communication bucket; a bucket holds whole tensors (default 4194304).
    pub bucket_numel: u64,
    /// Threads one kernel call may use on large tensors; results are bitwise identical for any
    /// value (default 1).
    pub threads: u32,
    /// Padding, ignored (0.1's struct ended at `threads`, padded to 40 bytes: a field here would
    /// read an older caller's padding).
    pub reserved: u32,
    /// GRADACC_SHARDING_* (default NONE).
    pub sharding: gradacc_sharding_t,
    /// Ranks the gradient is sharded over: the size of the communicator given to sync (or, for
    /// GRADACC_SHARDING_ACCUMULATE, to gradacc_accumulator_create_sharded) (default 1; must be 1
    /// unless sharding is on; at most 65536).
    pub shard_count: u32,
    /// This rank's shard, in 0..shard_count: its rank on that communicator (default 0).
    pub shard_rank: u32,
    /// What the boundary's reductions send: GRADACC_DTYPE_F32 (default), or GRADACC_DTYPE_BF16,
    /// half the bytes: each rank rounds its contribution to bf16 once, and the receiver sums the
    /// contributions in FP32, so over W ranks the error is at most (2^-8 + (W-1) * 2^-24) of the
    /// magnitude (the sum of the contributions' absolute values): the bf16 rounding's share does
    /// not grow with the number of ranks (docs/sharding.md).
    pub wire_dtype: gradacc_dtype_t,
    /// GRADACC_OVERFLOW_* (default SKIP_STEP).
    pub overflow: gradacc_overflow_t,
    /// 1: every boundary also measures each tensor (gradacc_accumulator_tensor_stats); 0: off
    /// (default). Every device and sharding policy.
    pub tensor_stats: u32,
}

/// What the boundary reports; identical on every rank. Set struct_size before the call
/// (`gradacc_sync_info_t info = GRADACC_SYNC_INFO_INIT;` in C).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_sync_info_t {
    /// sizeof(gradacc_sync_info_t), set by the caller: the library writes only the fields this size
    /// covers (an older header's size is accepted), and never changes struct_size itself.
    pub struct_size: usize,
    /// Some rank saw an inf or NaN in this window, or the reduced gradient holds one (finite
    /// windows whose sum overflowed): skip the optimizer step.
    pub found_inf: bool,
    /// Items added over all micro-batches and ranks.
    pub total_count: u64,
    /// Micro-batches added over all ranks.
    pub microbatches: u64,
    /// Global L2 norm of the normalised gradient, before clipping.
    pub grad_norm: f64,
    /// Factor clipping applied (1 when clipping is off or not needed).
    pub clip_coef: f64,
    /// Micro-batches dropped over all ranks (GRADACC_OVERFLOW_DROP_MICROBATCH); their items and
    /// micro-batches are not in total_count and microbatches.
    pub dropped_microbatches: u64,
    /// GRADACC_OVERFLOW_AT_*: where the window first went non-finite, in the order micro-batch,
    /// then tensor, then rank; the same on every rank. NONE with found_inf set when a rank's
    /// place is unknown (GRADACC_OVERFLOW_AT_NONE says when), whatever the other ranks located.
    pub overflow_at: gradacc_overflow_at_t,
    /// With GRADACC_OVERFLOW_AT_GRADIENT: the rank (at a hybrid boundary, replica rank times the
    /// shard group's size plus shard rank), its window's micro-batch (from 0, dropped ones
    /// included; after gradacc_accumulator_load_window, see there) and the tensor index; 0
    /// otherwise.
    pub overflow_rank: u64,
    pub overflow_microbatch: u64,
    pub overflow_tensor: u64,
}

/// The most shards a sharded accumulator may have: a communicator of more ranks could not sum
/// the windows' item counts (up to 2^47 each) exactly, so a larger count is refused at creation
/// rather than at the first boundary.
const MAX_SHARD_COUNT: usize = 1 << 16;

/// The config's sharding policy with its shard count and rank.
fn sharding_from_c(c: &gradacc_accumulator_config_t) -> Result<Sharding> {
    let (shards, rank) = (c.shard_count as usize, c.shard_rank as usize);
    if c.sharding != GRADACC_SHARDING_NONE && shards > MAX_SHARD_COUNT {
        return Err(Error::invalid(format!(
            "`config`.shard_count = {shards} is above {MAX_SHARD_COUNT}, the most ranks a boundary's \
             item counts sum exactly over"
        )));
    }
    Ok(match c.sharding {
        GRADACC_SHARDING_NONE if (shards, rank) == (1, 0) => Sharding::None,
        // A zero-filled struct lands here first: say so, rather than blame the sharding fields.
        GRADACC_SHARDING_NONE if shards == 0 => {
            return Err(Error::invalid(
                "`config`.shard_count = 0: without sharding it is 1. Initialise the config with \
                 gradacc_accumulator_config_default() (a zero-filled struct is not the defaults), \
                 then change its fields",
            ))
        }
        GRADACC_SHARDING_NONE => {
            return Err(Error::invalid(format!(
            "`config`.shard_count = {shards} and `config`.shard_rank = {rank} need a sharding policy, but `config`.sharding is GRADACC_SHARDING_NONE"
        )))
        }
        GRADACC_SHARDING_REDUCE_SCATTER if shards >= 1 && rank < shards => Sharding::ReduceScatter { shards, rank },
        GRADACC_SHARDING_ACCUMULATE if shards >= 1 && rank < shards => Sharding::Accumulate { shards, rank },
        GRADACC_SHARDING_REDUCE_SCATTER | GRADACC_SHARDING_ACCUMULATE => {
            return Err(Error::invalid(format!("`config`.shard_rank = {rank} is not below `config`.shard_count = {shards}")))
        }
        v => return Err(Error::invalid(format!("`config`.sharding = {v} is not a GRADACC_SHARDING_* value"))),
    })
}

fn config_from_c(c: &gradacc_accumulator_config_t) -> Result<AccumulatorConfig> {
    let loss_reduction = match c.loss_reduction {
        GRADACC_LOSS_REDUCTION_MEAN => LossReduction::Mean,
        GRADACC_LOSS_REDUCTION_SUM => LossReduction::Sum,
        v => {
            return Err(Error::invalid(format!(
                "`config`.loss_reduction = {v} is not a GRADACC_LOSS_REDUCTION_* value"
            )))
        }
    };
    let normalize = match c.normalize {
        GRADACC_NORMALIZE_BY_COUNT => Normalize::ByCount,
        GRADACC_NORMALIZE_BY_MICROBATCHES => Normalize::ByMicrobatches,
        GRADACC_NORMALIZE_BY_WORLD => Normalize::ByWorld,
        GRADACC_NORMALIZE_NONE => Normalize::None,
        v => {
            return Err(Error::invalid(format!(
                "`config`.normalize = {v} is not a GRADACC_NORMALIZE_* value"
            )))
        }
    };
    let bucket_numel = usize::try_from(c.bucket_numel).map_err(|_| {
        Error::invalid(format!("`config`.bucket_numel = {} is too large", c.bucket_numel))
    })?;
    let sharding = sharding_from_c(c)?;
    let wire = match c.wire_dtype {
        GRADACC_DTYPE_F32 => Dtype::F32,
        GRADACC_DTYPE_BF16 => Dtype::Bf16,
        v => {
            return Err(Error::invalid(format!(
                "`config`.wire_dtype = {v} is neither GRADACC_DTYPE_F32 nor GRADACC_DTYPE_BF16"
            )))
        }
    };
    let overflow = match c.overflow {
        GRADACC_OVERFLOW_SKIP_STEP => Overflow::SkipStep,
        GRADACC_OVERFLOW_DROP_MICROBATCH => Overflow::DropMicrobatch,
        v => {
            return Err(Error::invalid(format!(
                "`config`.overflow = {v} is not a GRADACC_OVERFLOW_* value"
            )))
        }
    };
    let tensor_stats = match c.tensor_stats {
        0 | 1 => c.tensor_stats == 1,
        v => return Err(Error::invalid(format!("`config`.tensor_stats = {v} is neither 0 nor 1"))),
    };
    Ok(AccumulatorConfig {
        loss_reduction,
        normalize,
        max_grad_norm: c.max_grad_norm,
        bucket_numel,
        threads: c.threads as usize,
        sharding,
        wire,
        overflow,
        tensor_stats,
    })
}

/// Fills `*out` with the default accumulator configuration (and its struct_size).
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_config_default(
    out: *mut gradacc_accumulator_config_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_config_default", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        let d = AccumulatorConfig::default();
        *out = gradacc_accumulator_config_t {
            struct_size: size_of::<gradacc_accumulator_config_t>(),
            loss_reduction: GRADACC_LOSS_REDUCTION_MEAN,
            normalize: GRADACC_NORMALIZE_BY_COUNT,
            max_grad_norm: d.max_grad_norm,
            bucket_numel: d.bucket_numel as u64,
            threads: d.threads as u32,
            reserved: 0,
            sharding: GRADACC_SHARDING_NONE,
            shard_count: 1,
            shard_rank: 0,
            wire_dtype: d.wire.code(),
            overflow: d.overflow.code(),
            tensor_stats: d.tensor_stats as u32,
        };
        Ok(())
    })
}

/// Reads the config and tensor list arguments shared by both constructors.
fn creation_args(
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

/// Adds one micro-batch of `count` items (a window holds at most 2^47 items per rank, so sums
/// over ranks stay exact): `grads[i]` is tensor i's gradient (numel and dtype as
/// declared), produced from a loss scaled by `scaler`'s current scale. One fused pass per tensor
/// converts to f32, unscales (and weights by `count` for a mean-reduced loss normalised by count),
/// flags non-finite values, and accumulates into the master (the first micro-batch of a window
/// overwrites it).
///
/// Fails without changing anything on: a tensor count `n` other than the accumulator's
/// (GRADACC_STATUS_SIZE_MISMATCH); a NULL `grads` or `grads[i]` (GRADACC_STATUS_NULL_ARGUMENT);
/// a `grads[i]` not aligned for its tensor's dtype, or whose declared extent (the tensor's numel
/// elements of its dtype from `grads[i]`) shares any byte with the master, its own tensor's
/// master included (GRADACC_STATUS_INVALID_ARGUMENT); a `count` of 0 for a mean-reduced loss or
/// past the window's limit (GRADACC_STATUS_INVALID_ARGUMENT); a call inside an open micro-batch
/// (GRADACC_STATUS_WRONG_STATE); a scaler on another device (GRADACC_STATUS_DEVICE_MISMATCH).
/// What it cannot check: behind a `void *` the C ABI sees neither a buffer's element type nor
/// its length. Each `grads[i]` is read as its tensor's declared numel values of its declared
/// dtype, so a buffer of another element type is read as that dtype and a shorter one past its
/// end: both are the caller's to get right. The C++ wrapper's typed forms
/// (gradacc::Accumulator::add over gradacc::Grad, add_tensor over spans) and the Go, Python,
/// Julia and Rust bindings check both for the typed buffers they take, not for raw addresses.
///
/// On CUDA, `grads[i]` are device addresses; one kernel launch adds every tensor; the call
/// returns once the work is enqueued on the accumulator's stream (the buffers must stay valid
/// until the stream has run it). The scale is read on the device: no host synchronisation.
///
/// Thread safety: serialised with every other call on `acc`; buffers are read during the call only
/// (on CUDA: by the stream's work).
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_add(
    acc: *mut gradacc_accumulator_t,
    scaler: *const gradacc_scaler_t,
    grads: *const *const c_void,
    n: usize,
    count: u64,
) -> gradacc_status_t {
    guard("gradacc_accumulator_add", || {
        let a = ACCUMULATORS.get(acc, "acc")?;
        // Under sharded accumulation the other ranks are in the micro-batch's collective.
        let owed = Owed::collective(&a);
        let args = || {
            let s = SCALERS.get(scaler, "scaler")?;
            if grads.is_null() {
                return Err(null("grads"));
            }
            if n != a.tensors().len() {
                return Err(Error::new(
                    ErrorKind::SizeMismatch,
                    format!("`n` = {n}, but the accumulator has {} tensors", a.tensors().len()),
                )
                .into());
            }
            // SAFETY: the caller passes `n` addresses at `grads` (API contract).
            let grads = unsafe { read_slice(grads, n, "grads", "n")? };
            if let Some(i) = grads.iter().position(|g| g.is_null()) {
                return Err(null(&format!("grads[{i}]")));
            }
            Ok((s, grads))
        };
        let (s, grads) = args()?;
        owed.settle();
        // SAFETY: each address holds its tensor's gradient (API contract); `add_raw` checks its
        // alignment and size before use.
        Ok(unsafe { a.add_raw(&s, grads, count) }?)
    })
}

/// Opens a micro-batch of `count` items whose gradients arrive tensor by tensor through
/// gradacc_accumulator_add_tensor (as a framework's backward hooks produce them).
///
/// Thread safety: serialised with every other call on `acc`.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_begin_microbatch(
    acc: *mut gradacc_accumulator_t,
    count: u64,
) -> gradacc_status_t {
    guard("gradacc_accumulator_begin_microbatch", || {
        Ok(ACCUMULATORS.get(acc, "acc")?.begin_microbatch(count)?)
    })
}

/// Opens the window's last micro-batch of `count` items, arriving tensor by tensor, and names the
/// communicator its boundary will use: on CUDA with NCCL, each bucket's all-reduce starts on a
/// communication stream as soon as every tensor of the bucket has arrived (one contribution
/// each; buckets start in reverse tensor order, as backward produces them), overlapping the rest
/// of the backward pass. gradacc_accumulator_sync with the same `comm` completes the boundary.
/// Every rank must do the same. On the CPU, and under GRADACC_OVERFLOW_DROP_MICROBATCH, it is
/// gradacc_accumulator_begin_microbatch.
/// The first call per communicator checks on the host that all ranks' layouts agree (it waits).
///
/// Thread safety: serialised with every other call on `acc`.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_begin_final_microbatch(
    acc: *mut gradacc_accumulator_t,
    count: u64,
    comm: *mut gradacc_comm_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_begin_final_microbatch", || {
        let a = ACCUMULATORS.get(acc, "acc")?;
        // Under sharded accumulation the other ranks are in the micro-batch's control step.
        let owed = Owed::collective(&a);
        let comm = COMMS.get(comm, "comm")?;
        owed.settle();
        Ok(a.begin_final_microbatch(count, comm)?)
    })
}

/// Adds one contribution to tensor `index` of the open micro-batch: `numel` elements of the
/// tensor's declared dtype at `grad`. A tensor may receive several contributions (a chunked
/// backward); they are summed. Under GRADACC_SHARDING_ACCUMULATE each tensor takes one
/// contribution per micro-batch, and a call refused on any rank fails the micro-batch on every
/// rank at gradacc_accumulator_end_microbatch (docs/sharding.md).
///
/// Fails without adding anything on: an `index` out of range (GRADACC_STATUS_INVALID_ARGUMENT);
/// a `numel` other than the tensor's declared one (GRADACC_STATUS_SIZE_MISMATCH); a NULL `grad`
/// (GRADACC_STATUS_NULL_ARGUMENT); a `grad` misaligned or overlapping the master, as in
/// gradacc_accumulator_add; no open micro-batch (GRADACC_STATUS_WRONG_STATE); a scaler on
/// another device. It cannot check that `grad` holds `numel` values of the tensor's dtype: as in
/// gradacc_accumulator_add, that is the caller's to get right, and the C++ wrapper's span forms
/// and the bindings check the element type of the typed buffers they take.
///
/// Thread safety: may run concurrently with other gradacc_accumulator_add_tensor calls on the same
/// accumulator from other threads (distinct tensors in parallel; one tensor's contributions are
/// serialised, and summed in the order they arrive, so contributions to one tensor from several
/// threads can round differently from run to run: for reproducible bits, give each tensor's
/// contributions from one thread); not concurrently with other calls on `acc`.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_add_tensor(
    acc: *mut gradacc_accumulator_t,
    scaler: *const gradacc_scaler_t,
    index: usize,
    grad: *const c_void,
    numel: usize,
) -> gradacc_status_t {
    guard("gradacc_accumulator_add_tensor", || {
        let a = ACCUMULATORS.get(acc, "acc")?;
        // Under sharded accumulation a refused contribution fails the micro-batch everywhere.
        let owed = Owed::tensor(&a);
        let s = SCALERS.get(scaler, "scaler")?;
        if grad.is_null() {
            return Err(null("grad"));
        }
        owed.settle();
        // SAFETY: `grad` holds `numel` values of the tensor's dtype (API contract);
        // `add_tensor_raw` checks its alignment, size and count before use.
        Ok(unsafe { a.add_tensor_raw(&s, index, grad, numel) }?)
    })
}

/// Closes the open micro-batch.
///
/// Thread safety: serialised with every other call on `acc`; call it after every
/// gradacc_accumulator_add_tensor of the micro-batch has returned.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_end_microbatch(
    acc: *mut gradacc_accumulator_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_end_microbatch", || {
        Ok(ACCUMULATORS.get(acc, "acc")?.end_microbatch()?)
    })
}

/// The accumulation boundary; every rank of `comm`'s group calls it (`comm` NULL: one process).
/// The ranks agree on counts, overflow and layout first, then the FP32 master is summed bucket
/// by bucket, normalised (gradacc_normalize_t), measured and, if configured, clipped: every rank
/// ends with the same bits and the same `*out_info` (may be NULL). If any rank's call is invalid,
/// every rank fails and nothing is reduced; a window empty on every rank is EMPTY_WINDOW. A sync
/// right after a sync takes part with an empty window. On CUDA the work is enqueued on the
/// accumulator's stream and only a non-NULL `out_info` waits; see docs/cuda.md for NCCL's rules.
/// A sharded accumulation (GRADACC_SHARDING_ACCUMULATE) syncs over the communicator it was created
/// with: `comm` is that handle or NULL (another fails on every rank).
///
/// Thread safety: serialised with every other call on `acc`; one call per rank, each on its
/// rank's thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_sync(
    acc: *mut gradacc_accumulator_t,
    comm: *mut gradacc_comm_t,
    out_info: *mut gradacc_sync_info_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_sync", || {
        let _flight = sync_in_flight(acc as usize, &[comm as usize]);
        let a = ACCUMULATORS.get(acc, "acc");
        let comm = (!comm.is_null()).then(|| COMMS.get(comm, "comm")).transpose();
        // The other ranks are in the boundary: over `comm`, or the accumulator's own (a sharded
        // accumulation's) when it is NULL or refused.
        let owed = Owed::boundary(a.as_ref().ok(), comm.as_ref().ok().and_then(Option::as_ref));
        let comm = comm?;
        check_out_struct(out_info, "out_info")?;
        let a = a?;
        owed.settle();
        let comm = comm.as_deref();
        if out_info.is_null() {
            return Ok(a.sync_enqueue(comm)?);
        }
        let info = a.sync(comm)?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        unsafe { write_sync_info(out_info, &info) };
        Ok(())
    })
}

/// Writes a boundary's info to a caller's `out` (nothing when it is NULL).
///
/// # Safety
/// A non-null `out` points to a writable `gradacc_sync_info_t` of its `struct_size`.
unsafe fn write_sync_info(out: *mut gradacc_sync_info_t, info: &SyncInfo) {
    let c = gradacc_sync_info_t {
        struct_size: 0,
        found_inf: info.found_inf,
        total_count: info.total_count,
        microbatches: info.microbatches,
        grad_norm: info.grad_norm,
        clip_coef: info.clip_coef,
        dropped_microbatches: info.dropped_microbatches,
        overflow_at: match info.overflow {
            None => GRADACC_OVERFLOW_AT_NONE,
            Some(OverflowAt::Gradient { .. }) => GRADACC_OVERFLOW_AT_GRADIENT,
            Some(OverflowAt::Reduction) => GRADACC_OVERFLOW_AT_REDUCTION,
        },
        overflow_rank: 0,
        overflow_microbatch: 0,
        overflow_tensor: 0,
    };
    let c = match info.overflow {
        Some(OverflowAt::Gradient { rank, microbatch, tensor }) => gradacc_sync_info_t {
            overflow_rank: rank as u64,
            overflow_microbatch: microbatch,
            overflow_tensor: tensor as u64,
            ..c
        },
        _ => c,
    };
    // SAFETY: by the caller's contract.
    unsafe { write_out_struct(out, c) }
}

/// The hybrid boundary (HSDP) of an accumulator created with GRADACC_SHARDING_REDUCE_SCATTER or
/// GRADACC_SHARDING_ACCUMULATE: the master is reduce-scattered over `shard_comm` (its shard group:
/// shard_count ranks, this one rank shard_rank; for ACCUMULATE, the communicator it was created
/// with, which reduced every micro-batch already), and each shard is then all-reduced over
/// `replica_comm`, the ranks holding
/// the same shard in the other shard groups (rank a*shard_count + i is shard i of shard group a
/// and replica a of replica group i, say). Every rank of both groups calls it. Counts, overflow
/// and layout are agreed over all ranks (the world is the product of the group sizes); the norm
/// is the whole gradient's; each shard is summed in its shard group in rank order, then over
/// the replicas in their rank order. Replica groups whose ranks hold different shards, or an
/// unsharded accumulator, fail on every rank with nothing reduced. Host communicators (in-process,
/// MPI) for a CPU accumulator; for a CUDA accumulator, two NCCL communicators on its device (the
/// first hybrid sync per pair of groups checks the grid's layouts, a host wait). `*out_info` may
/// be NULL.
///
/// Thread safety: as gradacc_accumulator_sync.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_sync_hybrid(
    acc: *mut gradacc_accumulator_t,
    shard_comm: *mut gradacc_comm_t,
    replica_comm: *mut gradacc_comm_t,
    out_info: *mut gradacc_sync_info_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_sync_hybrid", || {
        let _flight = sync_in_flight(acc as usize, &[shard_comm as usize, replica_comm as usize]);
        let a = ACCUMULATORS.get(acc, "acc");
        let shard = COMMS.get(shard_comm, "shard_comm");
        let replicas = COMMS.get(replica_comm, "replica_comm");
        // The other ranks are in the boundary over both groups.
        let owed = Owed::boundary(a.as_ref().ok(), [&shard, &replicas].into_iter().flatten());
        check_out_struct(out_info, "out_info")?;
        let (a, shard, replicas) = (a?, shard?, replicas?);
        owed.settle();
        let info = a.sync_hybrid(&*shard, &*replicas)?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract);
        // a NULL one is skipped.
        unsafe { write_sync_info(out_info, &info) };
        Ok(())
    })
}

/// Writes a pointer to tensor `index`'s FP32 master gradient and its element count (a device
/// address on CUDA, whose contents are ready in the accumulator's stream order). The pointer
/// stays valid until the accumulator is destroyed; its contents are the boundary's result after
/// gradacc_accumulator_sync, and in progress otherwise. A sharded accumulation holds only its
/// shard: a tensor not wholly inside it is GRADACC_STATUS_INVALID_ARGUMENT (use
/// gradacc_accumulator_shard).
///
/// Thread safety: any thread; reading through the pointer must not overlap calls that add.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_master(
    acc: *const gradacc_accumulator_t,
    index: usize,
    out_data: *mut *mut f32,
    out_numel: *mut usize,
) -> gradacc_status_t {
    guard("gradacc_accumulator_master", || {
        let a = ACCUMULATORS.get(acc, "acc")?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let p = unsafe { out_ptr(out_data, "out_data") }?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let n = unsafe { out_ptr(out_numel, "out_numel") }?;
        let (ptr, len) = a
            .master_ptr(index)
            .map_err(|e| Error::new(e.kind, format!("`index`: {}", e.message)))?;
        *p = ptr;
        *n = len;
        Ok(())
    })
}

/// This rank's shard of the master: `*out_offset` and `*out_numel` give its element range in the
/// flat layout (tensor after tensor, each at gradacc_accumulator_offset, zeros between), `*out_data` the address of its first element (a device
/// address on CUDA). Without sharding the shard is the whole master. Under
/// GRADACC_SHARDING_REDUCE_SCATTER, after a successful sync the range holds this rank's part of
/// the reduced, normalised (and clipped) gradient, for an optimizer that updates only its shard;
/// the rest of the master is unspecified until the next window's first micro-batch. Shards split
/// the layout into equal parts rounded up to whole blocks of 4096 elements; the last ones may be
/// shorter or empty (`*out_numel` 0). Under GRADACC_SHARDING_ACCUMULATE the shard is all the
/// accumulator holds: the window's sum over the ranks while accumulating, the reduced, normalised
/// (and clipped) gradient after sync.
///
/// Ownership: `*out_data` is borrowed from `acc` and valid until it is destroyed.
/// Thread safety: any thread; the range never changes, and the data is stable while no call
/// writes the master.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_shard(
    acc: *const gradacc_accumulator_t,
    out_offset: *mut usize,
    out_numel: *mut usize,
    out_data: *mut *mut f32,
) -> gradacc_status_t {
    guard("gradacc_accumulator_shard", || {
        let a = ACCUMULATORS.get(acc, "acc")?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let offset = unsafe { out_ptr(out_offset, "out_offset") }?;
        // SAFETY: as above.
        let numel = unsafe { out_ptr(out_numel, "out_numel") }?;
        // SAFETY: as above.
        let data = unsafe { out_ptr(out_data, "out_data") }?;
        let (range, ptr) = a.shard();
        (*offset, *numel, *data) = (range.start, range.len(), ptr);
        Ok(())
    })
}

/// Each tensor's telemetry of the last boundary, the same on every rank (`config`.tensor_stats =
/// 1): into `grad_norms[i]` the L2 norm of tensor i's reduced, normalised gradient before
/// clipping, into `nonfinite_microbatches[i]` the micro-batches over every rank in which it held a
/// non-finite value (docs/overflow.md). Either array may be NULL; `n` is the accumulator's tensor
/// count. GRADACC_STATUS_WRONG_STATE without tensor_stats, or before a sync that read its info;
/// nothing is written on failure.
///
/// Thread safety: any thread; not concurrently with the next window's first micro-batch.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_tensor_stats(
    acc: *const gradacc_accumulator_t,
    grad_norms: *mut f64,
    nonfinite_microbatches: *mut u64,
    n: usize,
) -> gradacc_status_t {
    guard("gradacc_accumulator_tensor_stats", || {
        let a = ACCUMULATORS.get(acc, "acc")?;
        let tensors = a.tensors().len();
        if n != tensors {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("`n` = {n}, but the accumulator has {tensors} tensors"),
            )
            .into());
        }
        // SAFETY: a non-null array holds `n` writable values (API contract).
        let mut norms = unsafe { out_array(grad_norms, n, "grad_norms") }?;
        // SAFETY: as above.
        let mut counts = unsafe { out_array(nonfinite_microbatches, n, "nonfinite_microbatches") }?;
        let stats = a.tensor_stats()?;
        for (i, s) in stats.iter().enumerate() {
            if let Some(norms) = norms.as_deref_mut() {
                norms[i] = s.grad_norm;
            }
            if let Some(counts) = counts.as_deref_mut() {
                counts[i] = s.nonfinite_microbatches;
            }
        }
        Ok(())
    })
}

/// Writes to `*out_numel` the length, in f32 elements, of the flat master of an accumulator over
/// the `n` tensors `tensors`: each tensor starts at a multiple of GRADACC_MASTER_ALIGN bytes, with
/// zeros between and after the last. It is the `master_numel` gradacc_accumulator_create_with_buffer
/// needs.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_master_numel(
    tensors: *const gradacc_tensor_desc_t,
    n: usize,
    out_numel: *mut usize,
) -> gradacc_status_t {
    guard("gradacc_accumulator_master_numel", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out_numel, "out_numel") }?;
        // The defaults for the config and the device: only the tensors decide the length.
        let (_, descs, _) = creation_args(std::ptr::null(), tensors, n, std::ptr::null())?;
        *out = Accumulator::master_len(&descs)?;
        Ok(())
    })
}

/// Writes to `*out_offset` where tensor `index` starts in the flat master, in elements: a multiple
/// of GRADACC_MASTER_ALIGN / 4. With gradacc_accumulator_shard's range it tells which tensors'
/// elements a shard holds.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_offset(
    acc: *const gradacc_accumulator_t,
    index: usize,
    out_offset: *mut usize,
) -> gradacc_status_t {
    guard("gradacc_accumulator_offset", || {
        let a = ACCUMULATORS.get(acc, "acc")?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out_offset, "out_offset") }?;
        *out =
            a.offset(index).map_err(|e| Error::new(e.kind, format!("`index`: {}", e.message)))?;
        Ok(())
    })
}

/// Writes the number of tensors to `*out`.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_num_tensors(
    acc: *const gradacc_accumulator_t,
    out: *mut usize,
) -> gradacc_status_t {
    guard("gradacc_accumulator_num_tensors", || {
        let a = ACCUMULATORS.get(acc, "acc")?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        *unsafe { out_ptr(out, "out") }? = a.tensors().len();
        Ok(())
    })
}

/// Writes tensor `index`'s descriptor (element count and dtype) to `*out`, so a caller that did
/// not create the accumulator can still size its buffers.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_tensor(
    acc: *const gradacc_accumulator_t,
    index: usize,
    out: *mut gradacc_tensor_desc_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_tensor", || {
        let a = ACCUMULATORS.get(acc, "acc")?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        let d = a.tensors().get(index).ok_or_else(|| {
            Error::invalid(format!(
                "`index` = {index} is out of range (the accumulator has {} tensors)",
                a.tensors().len()
            ))
        })?;
        *out = gradacc_tensor_desc_t { numel: d.numel as u64, dtype: dtype_to_c(d.dtype) };
        Ok(())
    })
}

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
