//! The NCCL communicator (CUDA devices): one rank of an NCCL group, created from a unique id or
//! adopted from the caller. NCCL is loaded at run time; its collectives are enqueued on a CUDA
//! stream and never wait on the host. The accumulator's CUDA boundary drives it.

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard};

use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};

use crate::backend::cuda::driver::{CUdeviceptr, CUstream, Context};
use crate::error::{Error, ErrorKind, Result};

/// Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES).
pub const UNIQUE_ID_BYTES: usize = 128;

/// The NCCL entry points gradacc calls, resolved from the library cudarc loaded, but typed to
/// return a plain integer. cudarc declares them returning its `ncclResult_t` enum, and a code
/// outside that enum (from a newer NCCL, or a broken one) would be undefined behaviour before any
/// check could look at it. The data type and operation stay cudarc's enums: gradacc only passes
/// values it made.
mod api {
    use std::ffi::{c_char, c_int, c_void};
    use std::sync::OnceLock;

    use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};

    pub(super) const SUCCESS: c_int = 0;

    /// The name of a result code this version of gradacc knows (nccl.h, up to NCCL 2.30).
    pub(super) fn result_name(code: c_int) -> Option<&'static str> {
        Some(match code {
            0 => "ncclSuccess",
            1 => "ncclUnhandledCudaError",
            2 => "ncclSystemError",
            3 => "ncclInternalError",
            4 => "ncclInvalidArgument",
            5 => "ncclInvalidUsage",
            6 => "ncclRemoteError",
            7 => "ncclInProgress",
            8 => "ncclTimeout",
            _ => return None,
        })
    }

    pub(super) struct Api {
        pub get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> c_int,
        pub comm_init_rank: unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int,
        pub comm_user_rank: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
        pub comm_count: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
        pub comm_cu_device: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
        pub all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t) -> c_int,
        pub group_start: unsafe extern "C" fn() -> c_int,
        pub group_end: unsafe extern "C" fn() -> c_int,
        pub comm_destroy: unsafe extern "C" fn(ncclComm_t) -> c_int,
        pub comm_abort: unsafe extern "C" fn(ncclComm_t) -> c_int,
        pub get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
        pub get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
    }

    /// Resolves every entry point once; an error names the first missing one. Call it only once
    /// the library is known to load: cudarc's loader panics otherwise.
    pub(super) fn get() -> Result<&'static Api, String> {
        static API: OnceLock<Result<Api, String>> = OnceLock::new();
        API.get_or_init(|| {
            // SAFETY: the caller checked that the library loads, so culib does not panic.
            let lib = unsafe { cudarc::nccl::sys::culib() };
            macro_rules! resolve {
                ($name:literal) => {
                    // SAFETY: each field's type is the C prototype of the symbol in nccl.h, with
                    // ncclResult_t (a C enum, an int) as c_int.
                    *unsafe { lib.get($name) }.map_err(|e| format!("libnccl.so has no {}: {e}", $name))?
                };
            }
            Ok(Api {
                get_unique_id: resolve!("ncclGetUniqueId"),
                comm_init_rank: resolve!("ncclCommInitRank"),
                comm_user_rank: resolve!("ncclCommUserRank"),
                comm_count: resolve!("ncclCommCount"),
                comm_cu_device: resolve!("ncclCommCuDevice"),
                all_reduce: resolve!("ncclAllReduce"),
                group_start: resolve!("ncclGroupStart"),
                group_end: resolve!("ncclGroupEnd"),
                comm_destroy: resolve!("ncclCommDestroy"),
                comm_abort: resolve!("ncclCommAbort"),
                get_error_string: resolve!("ncclGetErrorString"),
                get_last_error: resolve!("ncclGetLastError"),
            })
        })
        .as_ref()
        .map_err(Clone::clone)
    }
}

use api::{Api, SUCCESS};

/// Whether the NCCL library loads and has every entry point gradacc calls (never panics; asked
/// once per process). cudarc looks for `libnccl.so`; the PyPI wheel ships only `libnccl.so.2`,
/// so a `libnccl.so` link next to it is needed.
pub fn nccl_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| nccl().is_ok())
}

/// The NCCL entry points, or BACKEND_UNAVAILABLE saying why not.
fn nccl() -> Result<&'static Api> {
    // SAFETY: is_culib_present only tries to dlopen the library by its usual names.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(Error::new(ErrorKind::BackendUnavailable, "NCCL (libnccl.so) could not be loaded: put its folder on LD_LIBRARY_PATH"));
    }
    api::get().map_err(|e| Error::new(ErrorKind::BackendUnavailable, e))
}

/// COMM_FAILURE for result `code` of `what`, with NCCL's text for it and `detail` (its last
/// error message); a code gradacc does not know is named by its number, never made an enum.
fn nccl_error(api: &Api, code: c_int, what: &str, detail: &str) -> Error {
    let text = match api::result_name(code) {
        Some(name) => {
            // SAFETY: ncclGetErrorString returns a static NUL-terminated string for a known code.
            let text = unsafe { CStr::from_ptr((api.get_error_string)(code)) };
            format!("{name} ({})", text.to_string_lossy())
        }
        None => format!("unknown NCCL result code {code}"),
    };
    Error::new(ErrorKind::CommFailure, format!("{what} failed: {text} {detail}").trim_end().to_string())
}

/// NCCL's last error message. `comm` may be null (NCCL itself ignores it; a stand-in may keep
/// one message per communicator); otherwise it must be live and not in use by another thread.
fn last_error(api: &Api, comm: ncclComm_t) -> String {
    // SAFETY: see above; the result is a NUL-terminated string NCCL keeps, or null.
    let text = unsafe { (api.get_last_error)(comm) };
    if text.is_null() {
        return String::new();
    }
    // SAFETY: non-null, so a NUL-terminated string, copied at once.
    unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
}

/// Ok for ncclSuccess, otherwise the error; `comm` as for [`last_error`].
fn check(api: &Api, code: c_int, what: &str, comm: ncclComm_t) -> Result<()> {
    if code == SUCCESS {
        Ok(())
    } else {
        Err(nccl_error(api, code, what, &last_error(api, comm)))
    }
}

/// A new unique id, to be sent from rank 0 to every rank (out of band) before they create their
/// communicators. Works without a GPU.
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    let api = nccl()?;
    let mut id = ncclUniqueId { internal: [0; UNIQUE_ID_BYTES] };
    // SAFETY: writes NCCL_UNIQUE_ID_BYTES bytes to a struct of that size.
    check(api, unsafe { (api.get_unique_id)(&mut id) }, "ncclGetUniqueId", std::ptr::null_mut())?;
    Ok(id.internal.map(|b| b as u8))
}

/// One rank of an NCCL group.
pub struct NcclComm {
    comm: ncclComm_t,
    api: &'static Api,
    ctx: Arc<Context>,
    rank: usize,
    world_size: usize,
    /// Created by gradacc (destroyed by it), or adopted from the caller (never destroyed).
    owned: bool,
    /// Set by `abort`, which frees the communicator: enqueuing holds the read side, so an abort
    /// from another thread waits for an enqueue in progress instead of freeing under it.
    aborted: RwLock<bool>,
    /// Process-unique: accumulators remember which communicators they verified their layout with.
    id: u64,
}

// SAFETY: an ncclComm_t may be used from any thread, one collective call at a time; the
// accumulator serialises its boundary per communicator use.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl NcclComm {
    /// Joins the group named by `id` as `rank` of `world_size`, on device `ordinal`. Collective:
    /// blocks until every rank has called it.
    pub fn new(id: &[u8; UNIQUE_ID_BYTES], rank: usize, world_size: usize, ordinal: i32) -> Result<Self> {
        let api = nccl()?;
        if world_size == 0 || rank >= world_size || world_size > i32::MAX as usize {
            return Err(Error::invalid(format!("`rank` = {rank} is not in 0..`world_size` = {world_size}")));
        }
        let ctx = Context::get(ordinal)?;
        let _g = ctx.enter()?;
        let unique = ncclUniqueId { internal: id.map(|b| b as _) };
        let mut comm = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the current context picks the device.
        let code = unsafe { (api.comm_init_rank)(&mut comm, world_size as c_int, unique, rank as c_int) };
        check(api, code, "ncclCommInitRank", comm)?;
        Ok(NcclComm { comm, api, ctx, rank, world_size, owned: true, aborted: RwLock::new(false), id: NEXT_ID.fetch_add(1, Ordering::Relaxed) })
    }

    /// Adopts the caller's `ncclComm_t`: rank, size and device are read from it; gradacc never
    /// destroys or aborts it.
    ///
    /// # Safety
    /// `raw` must be a live `ncclComm_t` that outlives this object.
    pub unsafe fn adopt(raw: *mut c_void) -> Result<Self> {
        let api = nccl()?;
        let comm = raw as ncclComm_t;
        let (mut rank, mut count, mut device) = (0, 0, 0);
        check(api, (api.comm_user_rank)(comm, &mut rank), "ncclCommUserRank", comm)?;
        check(api, (api.comm_count)(comm, &mut count), "ncclCommCount", comm)?;
        check(api, (api.comm_cu_device)(comm, &mut device), "ncclCommCuDevice", comm)?;
        let ctx = Context::get(device)?;
        Ok(NcclComm {
            comm,
            api,
            ctx,
            rank: rank as usize,
            world_size: count as usize,
            owned: false,
            aborted: RwLock::new(false),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    pub fn ordinal(&self) -> i32 {
        self.ctx.ordinal
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Aborts the communicator's pending and future operations (after a peer died, or to break a
    /// hang). Only for communicators gradacc created; later calls fail with COMM_FAILURE.
    pub fn abort(&self) -> Result<()> {
        if !self.owned {
            return Err(Error::wrong_state("this communicator adopts the caller's ncclComm_t: abort it with ncclCommAbort"));
        }
        let mut aborted = self.aborted.write().unwrap_or_else(|e| e.into_inner());
        if !*aborted {
            *aborted = true;
            let _g = self.ctx.enter()?;
            // SAFETY: created by ncclCommInitRank, aborted once (under the write lock).
            check(self.api, unsafe { (self.api.comm_abort)(self.comm) }, "ncclCommAbort", std::ptr::null_mut())?;
        }
        Ok(())
    }

    /// Holds off `abort` while the caller enqueues; fails if it already happened.
    fn live(&self) -> Result<RwLockReadGuard<'_, bool>> {
        let aborted = self.aborted.read().unwrap_or_else(|e| e.into_inner());
        if *aborted {
            return Err(Error::new(ErrorKind::CommFailure, "the communicator was aborted"));
        }
        Ok(aborted)
    }

    /// Enqueues an in-place sum of `count` values at `ptr` on `stream`. Inside [`NcclComm::group`],
    /// several are launched together.
    pub fn allreduce_sum_f32(&self, ptr: CUdeviceptr, count: usize, stream: CUstream) -> Result<()> {
        self.allreduce(ptr, count, ncclDataType_t::ncclFloat32, ncclRedOp_t::ncclSum, stream)
    }

    /// Enqueues an in-place u64 reduction (`max` false: sum) of `count` values at `ptr`.
    pub fn allreduce_u64(&self, ptr: CUdeviceptr, count: usize, max: bool, stream: CUstream) -> Result<()> {
        let op = if max { ncclRedOp_t::ncclMax } else { ncclRedOp_t::ncclSum };
        self.allreduce(ptr, count, ncclDataType_t::ncclUint64, op, stream)
    }

    fn allreduce(&self, ptr: CUdeviceptr, count: usize, dtype: ncclDataType_t, op: ncclRedOp_t, stream: CUstream) -> Result<()> {
        let _live = self.live()?;
        let _g = self.ctx.enter()?;
        let buf = ptr as *mut c_void;
        // SAFETY: a live communicator (`_live`); NCCL reads and writes `count` elements at `buf`.
        let code = unsafe { (self.api.all_reduce)(buf, buf, count, dtype, op, self.comm, stream as _) };
        check(self.api, code, "ncclAllReduce", self.comm)
    }

    /// Runs `f` between ncclGroupStart and ncclGroupEnd, so its collectives launch as one (each
    /// collective in `f` holds off `abort` itself; the group calls are not per communicator).
    pub fn group<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        drop(self.live()?);
        let _g = self.ctx.enter()?;
        // SAFETY: group calls take no communicator.
        check(self.api, unsafe { (self.api.group_start)() }, "ncclGroupStart", self.comm)?;
        let result = f();
        // SAFETY: as above.
        let end = check(self.api, unsafe { (self.api.group_end)() }, "ncclGroupEnd", self.comm);
        let r = result?;
        end.map(|_| r)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.owned && !*self.aborted.get_mut().unwrap_or_else(|e| e.into_inner()) {
            if let Ok(_g) = self.ctx.enter() {
                // SAFETY: created by ncclCommInitRank, destroyed once.
                unsafe { (self.api.comm_destroy)(self.comm) };
            }
        }
    }
}
