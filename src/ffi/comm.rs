//! C API of the communicators.

use std::sync::{Arc, LazyLock};

use super::handle::Registry;
use super::status::{guard, gradacc_status_t, null};
use super::types::out_ptr;
use crate::comm::{Communicator, LocalComm};
use crate::error::Error;

/// One rank's endpoint of a data-parallel group (opaque). Free with gradacc_comm_destroy.
pub struct gradacc_comm_t {
    _private: [u8; 0],
}

pub(crate) static COMMS: LazyLock<Registry<dyn Communicator>> = LazyLock::new(|| Registry::new("communicator"));

/// Creates an in-process group of `world_size` ranks (one per thread, e.g. one replica per
/// socket or per device) and writes its handles, rank 0 first, to `out_comms[0..world_size]`.
/// Reductions sum in rank order, so every rank gets bitwise-identical results.
///
/// Ownership: each handle is the caller's; free each with gradacc_comm_destroy.
/// Thread safety: each handle is used by one thread at a time (a concurrent second collective on
/// the same handle fails with GRADACC_STATUS_WRONG_STATE); every rank of the group must take part
/// in every sync, or the others wait for it.
#[no_mangle]
pub extern "C" fn gradacc_comm_create_local(world_size: usize, out_comms: *mut *mut gradacc_comm_t) -> gradacc_status_t {
    guard("gradacc_comm_create_local", || {
        if out_comms.is_null() {
            return Err(null("out_comms"));
        }
        if world_size == 0 || world_size > 4096 {
            return Err(Error::invalid(format!("`world_size` = {world_size} is outside 1..=4096")));
        }
        let handles: Vec<*mut gradacc_comm_t> =
            LocalComm::group(world_size)?.into_iter().map(|c| COMMS.insert(Arc::new(c) as Arc<dyn Communicator>)).collect();
        // SAFETY: the caller provides room for `world_size` handles.
        unsafe { std::ptr::copy_nonoverlapping(handles.as_ptr(), out_comms, world_size) };
        Ok(())
    })
}

/// Destroys a communicator handle. NULL is accepted and does nothing; must not be called twice on
/// one handle (a second call is detected and reported as GRADACC_STATUS_INVALID_HANDLE).
///
/// Thread safety: any thread, once no call uses the handle.
#[no_mangle]
pub extern "C" fn gradacc_comm_destroy(comm: *mut gradacc_comm_t) -> gradacc_status_t {
    guard("gradacc_comm_destroy", || {
        if !comm.is_null() {
            COMMS.remove(comm, "comm")?;
        }
        Ok(())
    })
}

/// Writes this handle's rank (0-based) to `*out`.
///
/// Thread safety: any thread.
#[no_mangle]
pub extern "C" fn gradacc_comm_rank(comm: *const gradacc_comm_t, out: *mut usize) -> gradacc_status_t {
    guard("gradacc_comm_rank", || {
        let c = COMMS.get(comm, "comm")?;
        *out_ptr(out, "out")? = c.rank();
        Ok(())
    })
}

/// Writes the group's number of ranks to `*out`.
///
/// Thread safety: any thread.
#[no_mangle]
pub extern "C" fn gradacc_comm_world_size(comm: *const gradacc_comm_t, out: *mut usize) -> gradacc_status_t {
    guard("gradacc_comm_world_size", || {
        let c = COMMS.get(comm, "comm")?;
        *out_ptr(out, "out")? = c.world_size();
        Ok(())
    })
}
