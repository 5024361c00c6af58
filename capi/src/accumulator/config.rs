//! The accumulator's C types (the config with its enum-like values, the sync info) and the
//! config's conversion to the Rust API's; gradacc_accumulator_config_default.

use std::mem::size_of;

use crate::status::{gradacc_status_t, guard};
use crate::types::*;
use gradacc::accumulator::{AccumulatorConfig, LossReduction, Normalize, Overflow, Sharding};
use gradacc::dtype::Dtype;
use gradacc::error::{Error, Result};

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

pub(super) fn config_from_c(c: &gradacc_accumulator_config_t) -> Result<AccumulatorConfig> {
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
