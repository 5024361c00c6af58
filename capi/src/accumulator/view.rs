//! What an accumulator shows: its master and shard, the per-tensor statistics, and the layout
//! of its tensors in the flat master.

use super::create::creation_args;
use super::{gradacc_accumulator_t, ACCUMULATORS};
use crate::status::{gradacc_status_t, guard};
use crate::types::*;
use gradacc::accumulator::Accumulator;
use gradacc::error::{Error, ErrorKind};

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
