//! The accumulation boundary, over one communicator or a hybrid grid of two, and the info it
//! writes for the caller.

use super::config::{
    gradacc_sync_info_t, GRADACC_OVERFLOW_AT_GRADIENT, GRADACC_OVERFLOW_AT_NONE,
    GRADACC_OVERFLOW_AT_REDUCTION,
};
use super::{gradacc_accumulator_t, ACCUMULATORS};
use crate::comm::{gradacc_comm_t, sync_in_flight, COMMS};
use crate::status::{gradacc_status_t, guard};
use crate::types::*;
use gradacc::accumulator::Owed;
use gradacc::accumulator::{OverflowAt, SyncInfo};

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
    // SAFETY: the caller's arguments, under this function's contract.
    unsafe { sync(acc, comm, out_info, false) }
}

/// gradacc_accumulator_sync for an optimizer that steps right after (gradacc_optimizer_step):
/// with clipping, the gradient in memory stays the sum before normalisation and clipping, whose
/// one factor the step applies inside its own pass, bitwise as after gradacc_accumulator_sync, and the
/// boundary saves a pass over the gradient. The addresses from gradacc_accumulator_master and
/// gradacc_accumulator_shard then hold that sum: a caller that reads the
/// reduced gradient itself syncs with gradacc_accumulator_sync. On CUDA it is
/// gradacc_accumulator_sync. Arguments, errors and `*out_info` (may be NULL) as
/// gradacc_accumulator_sync's, but the boundary's info is always read on the host (on CUDA the
/// call waits for the accumulator's stream).
///
/// Thread safety: as gradacc_accumulator_sync.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_sync_for_step(
    acc: *mut gradacc_accumulator_t,
    comm: *mut gradacc_comm_t,
    out_info: *mut gradacc_sync_info_t,
) -> gradacc_status_t {
    // SAFETY: the caller's arguments, under this function's contract.
    unsafe { sync(acc, comm, out_info, true) }
}

/// The plain boundary, its clip coefficient left to the step with `for_step`.
///
/// # Safety
/// As gradacc_accumulator_sync's arguments.
unsafe fn sync(
    acc: *mut gradacc_accumulator_t,
    comm: *mut gradacc_comm_t,
    out_info: *mut gradacc_sync_info_t,
    for_step: bool,
) -> gradacc_status_t {
    let name =
        if for_step { "gradacc_accumulator_sync_for_step" } else { "gradacc_accumulator_sync" };
    guard(name, || {
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
        if out_info.is_null() && !for_step {
            return Ok(a.sync_enqueue(comm)?);
        }
        let info = if for_step { a.sync_for_step(comm)? } else { a.sync(comm)? };
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        unsafe { write_sync_info(out_info, &info) };
        Ok(())
    })
}

/// Writes a boundary's info to a caller's `out` (nothing when it is NULL).
///
/// # Safety
/// A non-null `out` points to a writable `gradacc_sync_info_t` of its `struct_size`.
pub(crate) unsafe fn write_sync_info(out: *mut gradacc_sync_info_t, info: &SyncInfo) {
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
