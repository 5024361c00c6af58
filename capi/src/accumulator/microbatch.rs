//! The micro-batch's calls: adding a whole micro-batch, or opening one, adding its tensors one
//! by one and closing it.

use std::ffi::c_void;

use super::{gradacc_accumulator_t, ACCUMULATORS};
use crate::comm::{gradacc_comm_t, COMMS};
use crate::scaler::{gradacc_scaler_t, SCALERS};
use crate::status::{gradacc_status_t, guard, null, CallResult};
use crate::types::*;
use gradacc::accumulator::Owed;
use gradacc::error::{Error, ErrorKind};

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
/// end: both are the caller's to get right. gradacc_accumulator_add_grads takes each gradient with
/// its dtype and length (gradacc_grad_t) and refuses a mismatch; so do the C++ wrapper's typed
/// forms (gradacc::Accumulator::add over gradacc::Grad, add_tensor over spans) and the Go,
/// Python, Julia and Rust bindings for the typed buffers they take, not for raw addresses.
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
    // SAFETY: the caller passes `n` addresses at `grads` (API contract).
    unsafe { add_addresses("gradacc_accumulator_add", acc, scaler, grads, n, count, false) }
}

/// gradacc_accumulator_add of the window's last micro-batch, which the boundary follows: on the
/// CPU, where the boundary only measures the sum (with clipping, or GRADACC_NORMALIZE_NONE), the
/// add also sums the norm's blocks of the master while each piece is in cache, so that a
/// boundary that reduces nothing between ranks (no communicator, or a group of one) needs no read
/// of its own: the report, the gradient and every step's bits are gradacc_accumulator_add's.
/// Anything that writes the master after it (another add, a tensor-by-tensor micro-batch, a
/// restore, an address taken with gradacc_accumulator_master or _shard) leaves the boundary to
/// measure for itself: a micro-batch wrongly called the last costs the saving, never the
/// result. Under GRADACC_SHARDING_ACCUMULATE and on CUDA it is gradacc_accumulator_add. Fails as
/// gradacc_accumulator_add does.
///
/// Thread safety: as gradacc_accumulator_add.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_add_final(
    acc: *mut gradacc_accumulator_t,
    scaler: *const gradacc_scaler_t,
    grads: *const *const c_void,
    n: usize,
    count: u64,
) -> gradacc_status_t {
    // SAFETY: as gradacc_accumulator_add.
    unsafe { add_addresses("gradacc_accumulator_add_final", acc, scaler, grads, n, count, true) }
}

/// gradacc_accumulator_add (`last`: _add_final) of the raw addresses at `grads`, as `entry`.
///
/// # Safety
/// `grads` holds `n` addresses, each of its tensor's size in its dtype (the entry points' contract).
unsafe fn add_addresses(
    entry: &'static str,
    acc: *mut gradacc_accumulator_t,
    scaler: *const gradacc_scaler_t,
    grads: *const *const c_void,
    n: usize,
    count: u64,
    last: bool,
) -> gradacc_status_t {
    guard(entry, || {
        // SAFETY: the caller passes `n` addresses at `grads` (this function's contract).
        unsafe {
            add_each(acc, scaler, grads, n, count, last, |i, g, _| match g.is_null() {
                true => Err(null(&format!("grads[{i}]"))),
                false => Ok(*g),
            })
        }
    })
}

/// The body of gradacc_accumulator_add, _add_final and _add_grads (`last`: the window's last
/// micro-batch, see _add_final): `address` turns the caller's gradient `i`
/// (of the `n` at `grads`, checked against the tensor count first) into its tensor's address, or
/// refuses it; a refusal reaches the sharded peers before the error returns.
///
/// # Safety
/// A non-null `grads` points to `n` values of `G`, each naming its tensor's gradient as the
/// calling entry point documents.
unsafe fn add_each<G>(
    acc: *mut gradacc_accumulator_t,
    scaler: *const gradacc_scaler_t,
    grads: *const G,
    n: usize,
    count: u64,
    last: bool,
    address: impl Fn(usize, &G, &gradacc::TensorDesc) -> CallResult<*const c_void>,
) -> CallResult<()> {
    let a = ACCUMULATORS.get(acc, "acc")?;
    // Under sharded accumulation the other ranks are in the micro-batch's collective.
    let owed = Owed::collective(&a);
    let args = || {
        let s = SCALERS.get(scaler, "scaler")?;
        let tensors = a.tensors();
        if grads.is_null() {
            return Err(null("grads"));
        }
        if n != tensors.len() {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("`n` = {n}, but the accumulator has {} tensors", tensors.len()),
            )
            .into());
        }
        // SAFETY: `grads` holds `n` values (the caller's contract).
        let grads = unsafe { read_slice(grads, n, "grads", "n")? };
        let data = grads.iter().zip(tensors).enumerate().map(|(i, (g, t))| address(i, g, t));
        Ok((s, data.collect::<CallResult<Vec<_>>>()?))
    };
    let (s, data) = args()?;
    owed.settle();
    Ok(match last {
        // SAFETY: each address holds its tensor's gradient (the caller's contract); the raw adds
        // check its alignment and size before use.
        true => unsafe { a.add_final_raw(&s, &data, count) },
        // SAFETY: as above.
        false => unsafe { a.add_raw(&s, &data, count) },
    }?)
}

/// gradacc_accumulator_add with each gradient's element type and length: `grads[i]` must hold
/// exactly tensor i's declared numel values of its declared dtype, else the call fails, adding
/// nothing, with GRADACC_STATUS_DTYPE_MISMATCH (another dtype) or GRADACC_STATUS_SIZE_MISMATCH
/// (another numel), naming the tensor and both values. Everything else is
/// gradacc_accumulator_add's, and so is what stays the caller's to get right: that `data` points
/// to that many values of that type.
///
/// Thread safety: as gradacc_accumulator_add.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_add_grads(
    acc: *mut gradacc_accumulator_t,
    scaler: *const gradacc_scaler_t,
    grads: *const gradacc_grad_t,
    n: usize,
    count: u64,
) -> gradacc_status_t {
    guard("gradacc_accumulator_add_grads", || {
        // SAFETY: the caller passes `n` descriptors at `grads` (API contract).
        unsafe {
            add_each(acc, scaler, grads, n, count, false, |i, g, t| {
                g.checked(t, i, &format!("grads[{i}]"))
            })
        }
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
/// gradacc_accumulator_add, that is the caller's to get right; gradacc_accumulator_add_tensor_grad
/// takes the dtype too and checks it, and the C++ wrapper's span forms and the bindings check the
/// element type of the typed buffers they take.
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

/// gradacc_accumulator_add_tensor with the gradient's element type and length: `grad` must hold
/// exactly tensor `index`'s declared numel values of its declared dtype, else the call fails,
/// adding nothing, with GRADACC_STATUS_DTYPE_MISMATCH or GRADACC_STATUS_SIZE_MISMATCH, naming the
/// tensor and both values. Everything else is gradacc_accumulator_add_tensor's.
///
/// Thread safety: as gradacc_accumulator_add_tensor.
#[no_mangle]
pub unsafe extern "C" fn gradacc_accumulator_add_tensor_grad(
    acc: *mut gradacc_accumulator_t,
    scaler: *const gradacc_scaler_t,
    index: usize,
    grad: *const gradacc_grad_t,
) -> gradacc_status_t {
    guard("gradacc_accumulator_add_tensor_grad", || {
        let a = ACCUMULATORS.get(acc, "acc")?;
        // Under sharded accumulation a refused contribution fails the micro-batch everywhere.
        let owed = Owed::tensor(&a);
        let s = SCALERS.get(scaler, "scaler")?;
        // SAFETY: a non-null `grad` points to one descriptor (API contract).
        let g = unsafe { grad.as_ref() }.ok_or_else(|| null("grad"))?;
        let tensors = a.tensors();
        let desc = tensors.get(index).ok_or_else(|| {
            Error::invalid(format!(
                "`index` = {index}, but the accumulator has {} tensors",
                tensors.len()
            ))
        })?;
        let data = g.checked(desc, index, "grad")?;
        owed.settle();
        // SAFETY: `data` holds the tensor's values, as the descriptor says (API contract);
        // `add_tensor_raw` checks its alignment, size and count before use.
        Ok(unsafe { a.add_tensor_raw(&s, index, data, desc.numel) }?)
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
