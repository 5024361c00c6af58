//! C API of the communicators.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::handle::Registry;
use crate::status::{gradacc_status_t, guard, null};
use crate::types::{out_ptr, rank_to_c, read_config, ConfigDefaults};
use gradacc::backend::cuda::nccl::{self, NcclComm, UNIQUE_ID_BYTES};
use gradacc::comm::{Communicator, LocalComm};
use gradacc::error::{Error, ErrorKind};

/// A backend gradacc may be built with: a communicator transport or a device kind.
pub type gradacc_backend_t = i32;
/// The in-process communicator (gradacc_comm_create_local); in every build.
pub const GRADACC_BACKEND_LOCAL: gradacc_backend_t = 0;
/// The MPI communicator (gradacc_comm_create_mpi); in builds with the `mpi` feature
/// (CMake option GRADACC_WITH_MPI).
pub const GRADACC_BACKEND_MPI: gradacc_backend_t = 1;
/// The NCCL communicator (gradacc_comm_create_nccl): in every build; available where the CUDA
/// driver and NCCL (GRADACC_NCCL_LIBRARY, else libnccl.so.2 or libnccl.so) load.
pub const GRADACC_BACKEND_NCCL: gradacc_backend_t = 2;
/// CUDA devices (GRADACC_DEVICE_CUDA): in every build; available where the CUDA driver sees a
/// device and NVRTC (GRADACC_NVRTC_LIBRARY, else libnvrtc.so.13, .so.12 or .so) loads.
pub const GRADACC_BACKEND_CUDA: gradacc_backend_t = 3;

/// The `fortran_comm` value of gradacc_comm_create_mpi that means MPI_COMM_WORLD.
pub const GRADACC_MPI_COMM_WORLD: i64 = -1;

/// MPI communicator options. Initialise with gradacc_mpi_config_default, then change fields.
/// Options are appended over time; an older struct_size gives the missing ones their defaults.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_mpi_config_t {
    /// sizeof(gradacc_mpi_config_t); set by gradacc_mpi_config_default.
    pub struct_size: usize,
    /// 1: when every rank is on one host, move the boundary's data through memory the ranks
    /// share (a few MB, left nowhere after a crash) instead of MPI messages; MPI still carries the
    /// control reduction and the block sums. Ranks on several hosts, or where the memory cannot
    /// be shared, use MPI either way. 0: MPI only. Default 1.
    pub shared_memory: u32,
}

/// One rank's endpoint of a data-parallel group (opaque). Free with gradacc_comm_destroy.
pub struct gradacc_comm_t {
    _private: [u8; 0],
}

/// An NCCL unique id: rank 0 makes it with gradacc_nccl_unique_id and sends its bytes to
/// every rank (MPI_Bcast, a file, a TCP store) before they call gradacc_comm_create_nccl.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_nccl_unique_id_t {
    /// Opaque bytes (NCCL_UNIQUE_ID_BYTES).
    pub internal: [u8; 128],
}

pub(crate) static COMMS: LazyLock<Registry<dyn Communicator>> =
    LazyLock::new(|| Registry::new("communicator"));

/// Creates an in-process group of `world_size` ranks (1 to 4096; one per thread, e.g. one replica
/// per socket or per device) and writes its handles, rank 0 first, to `out_comms[0..world_size]`.
/// Reductions sum in rank order, so every rank gets bitwise-identical results.
///
/// Ownership: each handle is the caller's; free each with gradacc_comm_destroy.
/// Thread safety: each handle is used by one thread at a time (a concurrent second collective on
/// the same handle fails with GRADACC_STATUS_WRONG_STATE); every rank of the group must take part
/// in every sync, or the others wait for it.
#[no_mangle]
pub unsafe extern "C" fn gradacc_comm_create_local(
    world_size: i32,
    out_comms: *mut *mut gradacc_comm_t,
) -> gradacc_status_t {
    guard("gradacc_comm_create_local", || {
        if out_comms.is_null() {
            return Err(null("out_comms"));
        }
        if !(1..=4096).contains(&world_size) {
            return Err(
                Error::invalid(format!("`world_size` = {world_size} is outside 1..=4096")).into()
            );
        }
        let world_size = world_size as usize;
        let handles: Vec<*mut gradacc_comm_t> =
            LocalComm::group(world_size)?.into_iter().map(|c| COMMS.insert(Arc::new(c))).collect();
        // SAFETY: the caller provides room for `world_size` handles.
        unsafe { std::ptr::copy_nonoverlapping(handles.as_ptr(), out_comms, world_size) };
        Ok(())
    })
}

/// Destroys a communicator handle. NULL is accepted and does nothing; must not be called twice on
/// one handle (a second call is detected and reported as GRADACC_STATUS_INVALID_HANDLE).
/// A sync on another thread that uses the handle (gradacc_accumulator_sync, _sync_hybrid) is
/// failed first, as gradacc_comm_abort fails it (GRADACC_STATUS_COMM_FAILURE; the communicator is
/// aborted, and in-process its whole group), and the destroy returns once that sync returned.
/// An NCCL communicator gradacc created is finalised and destroyed when healthy (its pending
/// collectives complete first, for at most 10 minutes), and aborted when it failed (a peer's
/// error, a timeout), which never waits for the other ranks.
///
/// Thread safety: any thread, once no call uses the handle.
#[no_mangle]
pub unsafe extern "C" fn gradacc_comm_destroy(comm: *mut gradacc_comm_t) -> gradacc_status_t {
    guard("gradacc_comm_destroy", || {
        if !comm.is_null() {
            let c = COMMS.remove(comm, "comm")?;
            end_syncs_on(comm as usize, &*c);
        }
        Ok(())
    })
}

/// Writes this handle's rank (0-based) to `*out`. Ranks and world sizes are `int32_t` in every
/// communicator function, as in MPI and NCCL, whose `int` ranks callers pass on unchanged.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_comm_rank(
    comm: *const gradacc_comm_t,
    out: *mut i32,
) -> gradacc_status_t {
    guard("gradacc_comm_rank", || {
        let c = COMMS.get(comm, "comm")?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        *unsafe { out_ptr(out, "out") }? = rank_to_c(c.rank());
        Ok(())
    })
}

/// Writes the group's number of ranks to `*out`.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_comm_world_size(
    comm: *const gradacc_comm_t,
    out: *mut i32,
) -> gradacc_status_t {
    guard("gradacc_comm_world_size", || {
        let c = COMMS.get(comm, "comm")?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        *unsafe { out_ptr(out, "out") }? = rank_to_c(c.world_size());
        Ok(())
    })
}

/// Writes to `*out` whether `backend` (GRADACC_BACKEND_*) can be used: MPI when the library was
/// built with it; CUDA and NCCL when their libraries load on this machine (checked without ever
/// failing: a machine with no driver just answers false). Every build has every function of the
/// header; a constructor of an unavailable backend fails with GRADACC_STATUS_BACKEND_UNAVAILABLE.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_backend_available(
    backend: gradacc_backend_t,
    out: *mut bool,
) -> gradacc_status_t {
    guard("gradacc_backend_available", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        *out = match backend {
            GRADACC_BACKEND_LOCAL => true,
            GRADACC_BACKEND_MPI => cfg!(feature = "mpi"),
            GRADACC_BACKEND_NCCL => {
                gradacc::backend::cuda::driver::driver_available() && nccl::nccl_available()
            }
            GRADACC_BACKEND_CUDA => gradacc::backend::cuda::available(),
            v => {
                return Err(Error::invalid(format!(
                    "`backend` = {v} is not a GRADACC_BACKEND_* value"
                ))
                .into())
            }
        };
        Ok(())
    })
}

/// Fills `*out` with the default MPI communicator options (and their struct_size). Available in
/// every build.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_mpi_config_default(
    out: *mut gradacc_mpi_config_t,
) -> gradacc_status_t {
    guard("gradacc_mpi_config_default", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        *out = gradacc_mpi_config_t {
            struct_size: std::mem::size_of::<gradacc_mpi_config_t>(),
            shared_memory: 1,
        };
        Ok(())
    })
}

/// Creates this process's rank of an MPI communicator: MPI_COMM_WORLD when `fortran_comm` is
/// GRADACC_MPI_COMM_WORLD (-1), otherwise the caller's communicator given by its Fortran handle:
/// `MPI_Comm_c2f(comm)` in C, `comm.py2f()` in mpi4py, `MPI.API.MPI_Comm_c2f(comm.val)` in
/// MPI.jl (`comm.val` alone is MPI.jl's C handle, not this one). `config` NULL means the
/// defaults. Every rank of the communicator must call this (it is collective).
///
/// gradacc works on a duplicate (MPI_Comm_dup) with MPI_ERRORS_RETURN, so MPI errors come back
/// as GRADACC_STATUS_COMM_FAILURE; it initialises MPI if the caller has not (and then finalises
/// it at exit). A build without MPI fails with GRADACC_STATUS_BACKEND_UNAVAILABLE. Details, and
/// how the boundary reduces: docs/mpi.md.
///
/// Ownership: `*out_comm` is the caller's; free it with gradacc_comm_destroy (before MPI_Finalize
/// when the caller finalises MPI itself).
/// Thread safety: one collective at a time per handle (a concurrent second one fails with
/// GRADACC_STATUS_WRONG_STATE). Below MPI_THREAD_MULTIPLE (an MPI the caller initialised), gradacc
/// runs its collectives one at a time in the process, which MPI_THREAD_SERIALIZED needs; with
/// FUNNELED or SINGLE, make every gradacc MPI call from the thread that makes the caller's.
#[no_mangle]
pub unsafe extern "C" fn gradacc_comm_create_mpi(
    fortran_comm: i64,
    config: *const gradacc_mpi_config_t,
    out_comm: *mut *mut gradacc_comm_t,
) -> gradacc_status_t {
    guard("gradacc_comm_create_mpi", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out_comm, "out_comm") }?;
        let config = if config.is_null() {
            gradacc_mpi_config_t::defaults()
        } else {
            // SAFETY: non-null; read_config checks the declared size first.
            unsafe { read_config(config, "config")? }
        };
        if config.shared_memory > 1 {
            return Err(Error::invalid(format!(
                "`config.shared_memory` = {} is neither 0 nor 1",
                config.shared_memory
            ))
            .into());
        }
        if fortran_comm < GRADACC_MPI_COMM_WORLD {
            return Err(Error::invalid(format!("`fortran_comm` = {fortran_comm} is neither a Fortran handle nor GRADACC_MPI_COMM_WORLD (-1)")).into());
        }
        #[cfg(feature = "mpi")]
        {
            use gradacc::comm::{MpiComm, MpiOptions};
            let options = MpiOptions { shared_memory: config.shared_memory == 1 };
            let comm = if fortran_comm == GRADACC_MPI_COMM_WORLD {
                MpiComm::world_with(options)?
            } else {
                MpiComm::from_fortran_with(fortran_comm, options)?
            };
            *out = COMMS.insert(Arc::new(comm));
            Ok(())
        }
        #[cfg(not(feature = "mpi"))]
        {
            let _ = (out, config);
            Err(Error::new(
                gradacc::error::ErrorKind::BackendUnavailable,
                "this build of gradacc has no MPI backend (rebuild with cargo feature `mpi`, CMake option GRADACC_WITH_MPI=ON)",
            )
            .into())
        }
    })
}

/// Writes a new NCCL unique id to `*out` (rank 0 calls it, then shares the bytes). Works without
/// a GPU; needs NCCL (GRADACC_NCCL_LIBRARY, else libnccl.so.2 or libnccl.so).
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_nccl_unique_id(
    out: *mut gradacc_nccl_unique_id_t,
) -> gradacc_status_t {
    guard("gradacc_nccl_unique_id", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        *out = gradacc_nccl_unique_id_t { internal: nccl::unique_id()? };
        Ok(())
    })
}

/// Creates rank `rank` of `world_size` of the NCCL group named by `id`, on CUDA device
/// `device_ordinal` (one rank per GPU). Collective: returns once every rank has called it, or
/// fails with GRADACC_STATUS_TIMEOUT when they have not within 10 minutes; every later call waits
/// at most the communicator's timeout (gradacc_comm_set_timeout) for the other ranks. Two ranks of
/// one group on one device in one process are refused (GRADACC_STATUS_INVALID_ARGUMENT).
/// Accumulators on that device sync over it; their stream carries the collectives.
///
/// Ownership: `*out_comm` is the caller's; free it with gradacc_comm_destroy, or first
/// gradacc_comm_abort to abandon pending collectives (after a peer failed).
/// Thread safety: any thread. Calls on one communicator from several threads (bucket reductions
/// from backward hooks, another accumulator's sync) run one at a time; every rank must still
/// issue them in the same order.
#[no_mangle]
pub unsafe extern "C" fn gradacc_comm_create_nccl(
    id: *const gradacc_nccl_unique_id_t,
    rank: i32,
    world_size: i32,
    device_ordinal: i32,
    out_comm: *mut *mut gradacc_comm_t,
) -> gradacc_status_t {
    guard("gradacc_comm_create_nccl", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out_comm, "out_comm") }?;
        // SAFETY: points to a gradacc_nccl_unique_id_t when non-null (API contract).
        let id = unsafe { id.as_ref() }.ok_or_else(|| null("id"))?;
        if world_size < 1 || rank < 0 || rank >= world_size {
            return Err(Error::invalid(format!(
                "`rank` = {rank} is not in 0..`world_size` = {world_size}"
            ))
            .into());
        }
        if device_ordinal < 0 {
            return Err(
                Error::invalid(format!("`device_ordinal` = {device_ordinal} is negative")).into()
            );
        }
        let id: &[u8; UNIQUE_ID_BYTES] = &id.internal;
        let comm = NcclComm::new(id, rank as usize, world_size as usize, device_ordinal)?;
        *out = COMMS.insert(Arc::new(comm));
        Ok(())
    })
}

/// Wraps the caller's `ncclComm_t` (passed as `void*`); its rank, size and device are read from
/// it. gradacc never destroys or aborts an adopted communicator. A non-blocking one
/// (ncclConfig_t.blocking = 0) works too: gradacc waits until each of its calls is enqueued.
///
/// Ownership: `*out_comm` is the caller's (free with gradacc_comm_destroy, before the caller
/// destroys its ncclComm_t); `nccl_comm` stays the caller's.
/// Thread safety: as gradacc_comm_create_nccl; the caller must not run its own collectives on
/// the communicator concurrently with a gradacc call on it.
#[no_mangle]
pub unsafe extern "C" fn gradacc_comm_adopt_nccl(
    nccl_comm: *mut std::ffi::c_void,
    out_comm: *mut *mut gradacc_comm_t,
) -> gradacc_status_t {
    guard("gradacc_comm_adopt_nccl", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out_comm, "out_comm") }?;
        if nccl_comm.is_null() {
            return Err(null("nccl_comm"));
        }
        // SAFETY: the caller passes a live ncclComm_t that outlives the handle (API contract).
        let comm = unsafe { NcclComm::adopt(nccl_comm)? };
        *out = COMMS.insert(Arc::new(comm));
        Ok(())
    })
}

/// Creates this rank's communicator of a split of `comm`: the ranks that pass the same `color`
/// form a group, ranked by `key` (ties by their rank in `comm`), on the same transport with the
/// same options: MPI_Comm_split for an MPI communicator, ncclCommSplit for an NCCL one (NCCL
/// 2.18 or newer; before, GRADACC_STATUS_BACKEND_UNAVAILABLE). An in-process one cannot be split
/// (GRADACC_STATUS_INVALID_ARGUMENT: make its groups with gradacc_comm_create_local). A mesh's
/// groups come from gradacc_mesh_shape_split, which passes each rank's color and key. Collective:
/// every rank of `comm` calls it; like creation it waits as long as the transport's split does.
///
/// Ownership: `*out_comm` is the caller's; free it with gradacc_comm_destroy.
/// Thread safety: any thread; one collective at a time per handle, as for a sync.
#[no_mangle]
pub unsafe extern "C" fn gradacc_comm_split(
    comm: *mut gradacc_comm_t,
    color: u32,
    key: u32,
    out_comm: *mut *mut gradacc_comm_t,
) -> gradacc_status_t {
    guard("gradacc_comm_split", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out_comm, "out_comm") }?;
        let c = COMMS.get(comm, "comm")?;
        *out = COMMS.insert(c.split(color as usize, key as usize)?);
        Ok(())
    })
}

/// Sets how long a collective on `comm` may wait for the other ranks: after `seconds` it fails
/// with GRADACC_STATUS_TIMEOUT, naming the phase and the wait, and aborts the communicator.
/// 0 waits forever; the default is 600 (10 minutes). Applies to collectives that start later.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_comm_set_timeout(
    comm: *mut gradacc_comm_t,
    seconds: f64,
) -> gradacc_status_t {
    guard("gradacc_comm_set_timeout", || {
        let c = COMMS.get(comm, "comm")?;
        if !(seconds.is_finite() && (0.0..=1e9).contains(&seconds)) {
            return Err(Error::invalid(format!(
                "`seconds` = {seconds} is not in 0..=1e9 (0 waits forever)"
            ))
            .into());
        }
        // Below a nanosecond still times out at once: only 0 means forever.
        let timeout = (seconds > 0.0).then(|| {
            std::time::Duration::from_secs_f64(seconds).max(std::time::Duration::from_nanos(1))
        });
        Ok(c.set_timeout(timeout)?)
    })
}

/// Writes `comm`'s timeout in seconds to `*out` (0: it waits forever).
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_comm_timeout(
    comm: *const gradacc_comm_t,
    out: *mut f64,
) -> gradacc_status_t {
    guard("gradacc_comm_timeout", || {
        let c = COMMS.get(comm, "comm")?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        *unsafe { out_ptr(out, "out") }? = c.timeout().map_or(0.0, |t| t.as_secs_f64());
        Ok(())
    })
}

/// Aborts this rank's communicator, of any backend: a sync waiting in it on any thread, and every
/// later one, fails with GRADACC_STATUS_COMM_FAILURE (use it when a peer died). In-process, every
/// rank of the group fails; with MPI, this rank stops waiting (MPI itself is not aborted). The
/// handle still needs gradacc_comm_destroy. An adopted NCCL communicator fails with
/// GRADACC_STATUS_WRONG_STATE (abort it with ncclCommAbort).
///
/// Thread safety: any thread, also while another thread is blocked in a sync on the communicator
/// (that sync then fails with GRADACC_STATUS_COMM_FAILURE).
#[no_mangle]
pub unsafe extern "C" fn gradacc_comm_abort(comm: *mut gradacc_comm_t) -> gradacc_status_t {
    guard("gradacc_comm_abort", || Ok(COMMS.get(comm, "comm")?.abort()?))
}

/// The syncs in flight through the C API: which accumulator handle waits on which communicator
/// handles. A destroy of either must not return OK while such a sync keeps waiting on a handle
/// nobody can reach any more.
struct Flights {
    live: Mutex<Vec<(u64, usize, Vec<usize>)>>,
    /// Notified whenever a sync leaves.
    left: Condvar,
}

static FLIGHTS: Flights = Flights { live: Mutex::new(Vec::new()), left: Condvar::new() };

/// How long a destroy waits for the sync it failed to return: an aborted wait returns within
/// milliseconds; the rest of a boundary (its own compute) is bounded by the buffer's size.
const SYNC_LEAVES_WITHIN: Duration = Duration::from_secs(60);

fn flights() -> MutexGuard<'static, Vec<(u64, usize, Vec<usize>)>> {
    FLIGHTS.live.lock()
}

/// A sync in flight, registered until it drops.
pub(crate) struct Flight(u64);

impl Drop for Flight {
    fn drop(&mut self) {
        flights().retain(|f| f.0 != self.0);
        FLIGHTS.left.notify_all();
    }
}

/// Registers a sync of accumulator handle `acc` over the communicator handles `comms`.
pub(crate) fn sync_in_flight(acc: usize, comms: &[usize]) -> Flight {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    flights().push((id, acc, comms.to_vec()));
    Flight(id)
}

/// Refuses to destroy accumulator handle `acc` while a sync of it is in flight on another thread:
/// WRONG_STATE, the handle left as it was.
pub(crate) fn check_no_sync_of(acc: usize) -> gradacc::error::Result<()> {
    if flights().iter().any(|f| f.1 == acc) {
        return Err(Error::new(
            ErrorKind::WrongState,
            format!(
                "argument `acc` = {acc:#x} is in a sync on another thread: the accumulator was \
                 not destroyed; abort the communicator that sync waits on (gradacc_comm_abort, \
                 or destroy it) or let the sync return, then destroy the accumulator"
            ),
        ));
    }
    Ok(())
}

/// Fails the syncs in flight on communicator handle `handle` (now out of the registry) by
/// aborting `comm`, and waits (bounded) until they returned.
fn end_syncs_on(handle: usize, comm: &dyn Communicator) {
    let uses = |f: &Vec<(u64, usize, Vec<usize>)>| f.iter().any(|f| f.2.contains(&handle));
    if !uses(&flights()) {
        return;
    }
    // An adopted NCCL communicator cannot be aborted by gradacc: its sync ends at its timeout.
    let _ = comm.abort();
    let mut live = flights();
    let deadline = Instant::now() + SYNC_LEAVES_WITHIN;
    while uses(&live) {
        if Instant::now() >= deadline {
            return;
        }
        let _ = FLIGHTS.left.wait_until(&mut live, deadline);
    }
}
