//! The NCCL communicator (CUDA devices): one rank of an NCCL group, created from a unique id or
//! adopted from the caller. NCCL is loaded at run time; its collectives are enqueued on a CUDA
//! stream and never wait on the host. The accumulator's CUDA boundary drives it.

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use cudarc::nccl::sys::{self, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t, ncclUniqueId};

use crate::backend::cuda::driver::{CUdeviceptr, CUstream, Context};
use crate::error::{Error, ErrorKind, Result};

/// Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES).
pub const UNIQUE_ID_BYTES: usize = 128;

/// Whether the NCCL library can be loaded (never panics). cudarc looks for `libnccl.so`; the
/// PyPI wheel ships only `libnccl.so.2`, so a `libnccl.so` link next to it is needed.
pub fn nccl_available() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { sys::is_culib_present() }
}

fn require_nccl() -> Result<()> {
    if nccl_available() {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::BackendUnavailable, "NCCL (libnccl.so) could not be loaded: put its folder on LD_LIBRARY_PATH"))
    }
}

fn check(result: ncclResult_t, comm: ncclComm_t, what: &str) -> Result<()> {
    if result == ncclResult_t::ncclSuccess {
        return Ok(());
    }
    // SAFETY: both return pointers to static or communicator-owned NUL-terminated strings.
    let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(result)) }.to_string_lossy().into_owned();
    let detail = if comm.is_null() { String::new() } else { unsafe { CStr::from_ptr(sys::ncclGetLastError(comm)) }.to_string_lossy().into_owned() };
    Err(Error::new(ErrorKind::CommFailure, format!("{what} failed: {result:?} ({text}) {detail}").trim_end().to_string()))
}

/// A new unique id, to be sent from rank 0 to every rank (out of band) before they create their
/// communicators. Works without a GPU.
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    require_nccl()?;
    let mut id = ncclUniqueId { internal: [0; UNIQUE_ID_BYTES] };
    check(unsafe { sys::ncclGetUniqueId(&mut id) }, std::ptr::null_mut(), "ncclGetUniqueId")?;
    Ok(id.internal.map(|b| b as u8))
}

/// One rank of an NCCL group.
pub struct NcclComm {
    comm: ncclComm_t,
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
        require_nccl()?;
        if world_size == 0 || rank >= world_size || world_size > i32::MAX as usize {
            return Err(Error::invalid(format!("`rank` = {rank} is not in 0..`world_size` = {world_size}")));
        }
        let ctx = Context::get(ordinal)?;
        let _g = ctx.enter()?;
        let unique = ncclUniqueId { internal: id.map(|b| b as _) };
        let mut comm = std::ptr::null_mut();
        check(unsafe { sys::ncclCommInitRank(&mut comm, world_size as i32, unique, rank as i32) }, std::ptr::null_mut(), "ncclCommInitRank")?;
        Ok(NcclComm { comm, ctx, rank, world_size, owned: true, aborted: RwLock::new(false), id: NEXT_ID.fetch_add(1, Ordering::Relaxed) })
    }

    /// Adopts the caller's `ncclComm_t`: rank, size and device are read from it; gradacc never
    /// destroys or aborts it.
    ///
    /// # Safety
    /// `raw` must be a live `ncclComm_t` that outlives this object.
    pub unsafe fn adopt(raw: *mut c_void) -> Result<Self> {
        require_nccl()?;
        let comm = raw as ncclComm_t;
        let (mut rank, mut count, mut device) = (0, 0, 0);
        check(sys::ncclCommUserRank(comm, &mut rank), comm, "ncclCommUserRank")?;
        check(sys::ncclCommCount(comm, &mut count), comm, "ncclCommCount")?;
        check(sys::ncclCommCuDevice(comm, &mut device), comm, "ncclCommCuDevice")?;
        let ctx = Context::get(device)?;
        Ok(NcclComm {
            comm,
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
            check(unsafe { sys::ncclCommAbort(self.comm) }, std::ptr::null_mut(), "ncclCommAbort")?;
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
        check(unsafe { sys::ncclAllReduce(buf, buf, count, dtype, op, self.comm, stream as _) }, self.comm, "ncclAllReduce")
    }

    /// Runs `f` between ncclGroupStart and ncclGroupEnd, so its collectives launch as one (each
    /// collective in `f` holds off `abort` itself; the group calls are not per communicator).
    pub fn group<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        drop(self.live()?);
        let _g = self.ctx.enter()?;
        check(unsafe { sys::ncclGroupStart() }, self.comm, "ncclGroupStart")?;
        let result = f();
        let end = check(unsafe { sys::ncclGroupEnd() }, self.comm, "ncclGroupEnd");
        let r = result?;
        end.map(|_| r)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.owned && !*self.aborted.get_mut().unwrap_or_else(|e| e.into_inner()) {
            if let Ok(_g) = self.ctx.enter() {
                // SAFETY: created by ncclCommInitRank, destroyed once.
                unsafe { sys::ncclCommDestroy(self.comm) };
            }
        }
    }
}
