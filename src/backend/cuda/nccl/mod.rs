//! The NCCL communicator (CUDA devices): one rank of an NCCL group, created from a unique id or
//! adopted from the caller. NCCL is loaded at run time; its collectives are enqueued on a CUDA
//! stream and never wait for the device. The accumulator's CUDA boundary drives it.
//!
//! Communicators gradacc creates are non-blocking, so no NCCL call here waits for a peer: a call
//! that answers ncclInProgress is polled with ncclCommGetAsyncError until it is enqueued, up to a
//! deadline, and `abort` from any thread ends such a wait. Every other use of one communicator is
//! serialised: NCCL allows one thread at a time inside a communicator.

mod api;
mod calls;
mod collectives;
mod membership;

use std::any::Any;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclUniqueId};
use parking_lot::{Mutex, MutexGuard};

use self::calls::{check, last_error, nccl, nccl_error, poll};
use self::membership::Membership;
use crate::backend::cuda::driver::Context;
use crate::comm::Communicator;
use crate::error::{Error, ErrorKind, Result};

/// Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES).
pub const UNIQUE_ID_BYTES: usize = 128;

/// How long a rank waits for the others (to create the communicator, to enqueue a collective, to
/// finalise it) before it gives up. A rank that starts minutes after the others is normal; one
/// that never comes is a failure.
pub use crate::comm::DEFAULT_TIMEOUT;

use api::{Api, IN_PROGRESS, SUCCESS};

/// Whether the NCCL library loads and has every entry point gradacc calls (never panics; loaded
/// once per process, by `GRADACC_NCCL_LIBRARY` or as `libnccl.so.2`, then `libnccl.so`).
pub fn nccl_available() -> bool {
    nccl().is_ok()
}

/// NCCL's version as (major, minor, patch) and the file it was loaded from (or the name it was
/// loaded by), or why it does not load.
pub fn nccl_library() -> Result<((i32, i32, i32), String)> {
    let api = api::get()?;
    let v = api.version;
    Ok(((v / 10000, v / 100 % 100, v % 100), api.file.clone()))
}

/// BACKEND_UNAVAILABLE unless NCCL loads with every entry point, naming every library tried and
/// why each failed.
pub fn require_nccl() -> Result<()> {
    nccl().map(|_| ())
}

/// A new unique id, to be sent from rank 0 to every rank (out of band) before they create their
/// communicators. Works without a GPU.
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    let api = nccl()?;
    let mut id = ncclUniqueId { internal: [0; UNIQUE_ID_BYTES] };
    // SAFETY: writes NCCL_UNIQUE_ID_BYTES bytes to a struct of that size.
    check(api, unsafe { (api.get_unique_id)(&mut id) }, "ncclGetUniqueId", std::ptr::null_mut())?;
    // c_char is i8 on x86-64 and u8 on aarch64: its byte either way.
    Ok(id.internal.map(|b| b.to_ne_bytes()[0]))
}

/// NCCL_CONFIG_INITIALIZER of the nccl.h cudarc's bindings come from (2.30), with `blocking` 0.
/// NCCL reads at most `size` bytes of it, so an older NCCL reads the fields it knows.
fn nonblocking_config() -> ncclConfig_t {
    const UNDEF: c_int = c_int::MIN; // NCCL_CONFIG_UNDEF_INT: NCCL's default
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 2 * 10_000 + 30 * 100,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

/// One rank of an NCCL group.
///
/// Every call on it is serialised, so several threads may share it (a final micro-batch's
/// bucket reductions from hook threads and another accumulator's sync); only `abort` runs beside
/// them. Collectives of *other* communicators issued inside [`NcclComm::group`] are not covered.
pub struct NcclComm {
    comm: ncclComm_t,
    api: &'static Api,
    ctx: Arc<Context>,
    rank: usize,
    world_size: usize,
    /// Created by gradacc (finalised and destroyed, or aborted, by it), or adopted from the
    /// caller (never destroyed or aborted).
    owned: bool,
    /// Held for each use of the communicator from its first call to the end of its wait (for a
    /// group, from ncclGroupStart to the end of ncclGroupEnd's wait): NCCL allows one thread at a
    /// time, and two threads' collectives would be issued in different orders on different ranks.
    serial: Mutex<()>,
    /// The thread that holds `serial` for a group (0: none). Its collectives inside the group are
    /// part of it and must not lock again.
    group_thread: AtomicU64,
    /// Held across each single NCCL call (they all return at once on a non-blocking
    /// communicator) and from ncclGroupStart to ncclGroupEnd, never across a wait for the other
    /// ranks: `abort` takes it, so it cannot free the communicator under a call or a group.
    call: Mutex<()>,
    /// Set by `abort` before it takes `call`: later calls fail instead of touching the freed
    /// communicator.
    aborted: AtomicBool,
    /// NCCL reported an error or a wait timed out: a peer may be gone, so later calls fail, and
    /// drop aborts instead of finalising (which would wait for the peers).
    failed: AtomicBool,
    /// Milliseconds a call waits for the other ranks; u64::MAX waits forever.
    timeout_ms: AtomicU64,
    _membership: Option<Membership>,
    /// Process-unique: accumulators remember which communicators they verified their layout with.
    id: u64,
}

// SAFETY: the ncclComm_t is used by one thread at a time (`serial`, `call`), except for
// ncclCommAbort, which NCCL allows from any thread and which never runs during another call.
unsafe impl Send for NcclComm {}
// SAFETY: as Send: every method serialises its NCCL calls through `serial` and `call`.
unsafe impl Sync for NcclComm {}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

impl NcclComm {
    /// Joins the group named by `id` as `rank` of `world_size`, on device `ordinal`. Collective:
    /// returns once every rank has called it, or fails after [`DEFAULT_TIMEOUT`].
    pub fn new(
        id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        world_size: usize,
        ordinal: i32,
    ) -> Result<Self> {
        Self::with_timeout(id, rank, world_size, ordinal, DEFAULT_TIMEOUT)
    }

    /// As [`NcclComm::new`], waiting at most `timeout` for the other ranks here and in every
    /// later call.
    pub fn with_timeout(
        id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        world_size: usize,
        ordinal: i32,
        timeout: Duration,
    ) -> Result<Self> {
        let api = nccl()?;
        if world_size == 0 || rank >= world_size || world_size > i32::MAX as usize {
            return Err(Error::invalid(format!(
                "`rank` = {rank} is not in 0..`world_size` = {world_size}"
            )));
        }
        let ctx = Context::get(ordinal)?;
        // Before NCCL, which finds a second rank on the device only once every rank arrived.
        let membership = Membership::claim(id, rank, ordinal)?;
        let mut comm = std::ptr::null_mut();
        let code = {
            let _g = ctx.enter()?;
            let unique = ncclUniqueId { internal: id.map(|b| b as _) };
            let mut config = nonblocking_config();
            // SAFETY: valid out-pointer and config; the current context picks the device.
            unsafe {
                (api.comm_init_rank_config)(
                    &mut comm,
                    world_size as c_int,
                    unique,
                    rank as c_int,
                    &mut config,
                )
            }
        };
        if comm.is_null() {
            return Err(if code == SUCCESS || code == IN_PROGRESS {
                Error::new(
                    ErrorKind::CommFailure,
                    "ncclCommInitRankConfig returned no communicator",
                )
            } else {
                nccl_error(
                    api,
                    code,
                    "ncclCommInitRankConfig",
                    &last_error(api, std::ptr::null_mut()),
                )
            });
        }
        let c = NcclComm {
            comm,
            api,
            ctx,
            rank,
            world_size,
            owned: true,
            serial: Mutex::new(()),
            group_thread: AtomicU64::new(0),
            call: Mutex::new(()),
            aborted: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            timeout_ms: AtomicU64::new(timeout.as_millis().min(u64::MAX as u128 - 1) as u64),
            _membership: Some(membership),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        };
        // On failure `c` drops here and, being failed, is aborted (NCCL frees it), not finalised.
        c.finish(code, "ncclCommInitRankConfig")?;
        Ok(c)
    }

    /// Adopts the caller's `ncclComm_t`: rank, size and device are read from it (once a
    /// non-blocking one has finished its creation); gradacc never destroys or aborts it.
    ///
    /// # Safety
    /// `raw` must be a live `ncclComm_t` that outlives this object.
    pub unsafe fn adopt(raw: *mut c_void) -> Result<Self> {
        let api = nccl()?;
        let comm = raw as ncclComm_t;
        let what = "the adopted communicator's creation";
        let state = || {
            let mut state = IN_PROGRESS;
            check(
                api,
                // SAFETY: `comm` is live (the caller's promise); valid out-pointer.
                unsafe { (api.comm_get_async_error)(comm, &mut state) },
                "ncclCommGetAsyncError",
                comm,
            )?;
            Ok(state)
        };
        poll(Some(DEFAULT_TIMEOUT), what, state, |code| {
            nccl_error(api, code, what, &last_error(api, comm))
        })?;
        let (mut rank, mut count, mut device) = (0, 0, 0);
        // SAFETY: as above; the three queries only read the communicator.
        unsafe {
            check(api, (api.comm_user_rank)(comm, &mut rank), "ncclCommUserRank", comm)?;
            check(api, (api.comm_count)(comm, &mut count), "ncclCommCount", comm)?;
            check(api, (api.comm_cu_device)(comm, &mut device), "ncclCommCuDevice", comm)?;
        }
        let ctx = Context::get(device)?;
        Ok(NcclComm {
            comm,
            api,
            ctx,
            rank: rank as usize,
            world_size: count as usize,
            owned: false,
            serial: Mutex::new(()),
            group_thread: AtomicU64::new(0),
            call: Mutex::new(()),
            aborted: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            timeout_ms: AtomicU64::new(DEFAULT_TIMEOUT.as_millis() as u64),
            _membership: None,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        })
    }

    /// Splits this communicator (ncclCommSplit): every rank of it calls, with its `color` (None:
    /// it joins no new group) and `key`; the ranks of one color form a new group, ranked by key,
    /// then by their rank here, each on its device. A framework's mesh groups, colored by
    /// [`MeshShape::color`](crate::MeshShape::color) with the rank as the key. Collective on this
    /// communicator; the new one is non-blocking and waits as long as this one does. Needs
    /// NCCL 2.18 or newer (BACKEND_UNAVAILABLE before).
    pub fn split(&self, color: Option<usize>, key: usize) -> Result<Option<NcclComm>> {
        let split = self.api.comm_split.ok_or_else(|| {
            Error::new(
                ErrorKind::BackendUnavailable,
                format!("NCCL {} has no ncclCommSplit (2.18 or newer has)", self.api.version),
            )
        })?;
        let too_big = |what: &str, v: usize| {
            Error::invalid(format!("`{what}` = {v} is not below 2^31 (an NCCL int)"))
        };
        let color = match color {
            None => -1, // NCCL_SPLIT_NOCOLOR
            Some(c) => c_int::try_from(c).map_err(|_| too_big("color", c))?,
        };
        let key = c_int::try_from(key).map_err(|_| too_big("key", key))?;
        let _serial = lock(&self.serial);
        let mut comm = std::ptr::null_mut();
        let mut config = nonblocking_config();
        let api = self.api;
        // SAFETY: a live communicator (`call`); valid out-pointer and config.
        let code =
            self.call(|parent| unsafe { split(parent, color, key, &mut comm, &mut config) })?;
        if code != SUCCESS && code != IN_PROGRESS {
            return Err(self.error(code, "ncclCommSplit"));
        }
        if comm.is_null() {
            return match color {
                -1 => Ok(None),
                _ => Err(Error::new(
                    ErrorKind::CommFailure,
                    "ncclCommSplit returned no communicator",
                )),
            };
        }
        let mut c = NcclComm {
            comm,
            api,
            ctx: self.ctx.clone(),
            rank: 0,
            world_size: 0,
            owned: true,
            serial: Mutex::new(()),
            group_thread: AtomicU64::new(0),
            call: Mutex::new(()),
            aborted: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            timeout_ms: AtomicU64::new(self.timeout_ms.load(Ordering::Relaxed)),
            _membership: None,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        };
        // On failure `c` drops here and, being failed, is aborted.
        c.finish(code, "ncclCommSplit")?;
        let (mut rank, mut count) = (0, 0);
        c.call(|comm| {
            // SAFETY: a live communicator, created above; valid out-pointers.
            unsafe {
                check(api, (api.comm_user_rank)(comm, &mut rank), "ncclCommUserRank", comm)?;
                check(api, (api.comm_count)(comm, &mut count), "ncclCommCount", comm)
            }
        })??;
        (c.rank, c.world_size) = (rank as usize, count as usize);
        Ok(Some(c))
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

    /// How long a call waits for the other ranks before it fails.
    pub fn timeout(&self) -> Option<Duration> {
        Some(self.timeout_ms.load(Ordering::Relaxed))
            .filter(|&ms| ms != u64::MAX)
            .map(Duration::from_millis)
    }

    /// Whether [`NcclComm::abort`] ran, or NCCL reported an error (a peer failed) or a wait timed
    /// out: every later call fails, and drop aborts the communicator.
    pub fn is_failed(&self) -> bool {
        self.aborted.load(Ordering::Acquire) || self.failed.load(Ordering::Acquire)
    }

    /// Aborts the communicator's pending and future operations (after a peer died, or to break a
    /// hang): from any thread, also while another thread waits in a call on it, which then fails
    /// with COMM_FAILURE, as every later call does. Only for communicators gradacc created.
    pub fn abort(&self) -> Result<()> {
        if !self.owned {
            return Err(Error::wrong_state(
                "this communicator adopts the caller's ncclComm_t: abort it with ncclCommAbort",
            ));
        }
        if self.aborted.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // Waits for at most one NCCL call in progress (they return at once on a non-blocking
        // communicator); the flag keeps any other from starting.
        let _call = lock(&self.call);
        let _g = self.ctx.enter();
        // SAFETY: created by ncclCommInitRankConfig and not freed: `aborted` was clear, drop has
        // not run (it needs the only reference), and no other call is inside NCCL (`call`).
        let code = unsafe { (self.api.comm_abort)(self.comm) };
        if code == SUCCESS || code == IN_PROGRESS {
            Ok(())
        } else {
            Err(nccl_error(
                self.api,
                code,
                "ncclCommAbort",
                &last_error(self.api, std::ptr::null_mut()),
            ))
        }
    }

    /// Marks the communicator failed: every later call fails, and drop aborts it.
    pub(crate) fn mark_failed(&self) {
        self.failed.store(true, Ordering::Release);
    }

    /// Ends this rank's use of the communicator (an abort, or for an adopted communicator that
    /// cannot be aborted, the failed mark that refuses every later call): its peers' pending
    /// collectives then fail at their timeout instead of pairing with a call they did not make.
    pub(crate) fn stop_pairing(&self) {
        if self.abort().is_err() {
            self.mark_failed();
        }
    }

    /// Fails with COMM_FAILURE when the communicator was aborted, failed before, or has an
    /// asynchronous error now (a peer failed or aborted). For a caller that has waited on its
    /// stream for collectives: an abort ends them without a result, and the wait cannot tell.
    pub fn health(&self) -> Result<()> {
        if self.in_own_group() {
            // The group checked the communicator at its start, and holds `call` until its end.
            return self.usable();
        }
        let _serial = lock(&self.serial);
        match self.async_state()? {
            SUCCESS | IN_PROGRESS => Ok(()),
            code => {
                self.failed.store(true, Ordering::Release);
                Err(self.error(code, "the communicator"))
            }
        }
    }
}

impl NcclComm {
    /// The NCCL communicator behind `comm`, if it is one.
    pub(crate) fn of(comm: &dyn Communicator) -> Option<&NcclComm> {
        (comm as &dyn Any).downcast_ref()
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn device(&self) -> crate::device::Device {
        crate::device::Device::Cuda { ordinal: self.ctx.ordinal, stream: std::ptr::null_mut() }
    }

    fn abort(&self) -> Result<()> {
        NcclComm::abort(self)
    }

    fn timeout(&self) -> Option<Duration> {
        NcclComm::timeout(self)
    }

    fn set_timeout(&self, timeout: Option<Duration>) -> Result<()> {
        let ms = timeout.map_or(u64::MAX, |t| t.as_millis().clamp(1, u64::MAX as u128 - 1) as u64);
        self.timeout_ms.store(ms, Ordering::Relaxed);
        Ok(())
    }

    /// [`NcclComm::split`] with a color: every rank of a mesh's world is in a group of each kind.
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        match NcclComm::split(self, Some(color), key)? {
            Some(comm) => Ok(Arc::new(comm)),
            None => {
                Err(Error::new(ErrorKind::Internal, "ncclCommSplit with a color made no group"))
            }
        }
    }
}

impl Drop for NcclComm {
    /// A healthy communicator is finalised (its pending operations complete, up to the timeout)
    /// and destroyed; one whose peers failed is aborted, since finalising it would wait for them.
    fn drop(&mut self) {
        if !self.owned || *self.aborted.get_mut() {
            return;
        }
        let healthy =
            !*self.failed.get_mut() && matches!(self.async_state(), Ok(SUCCESS | IN_PROGRESS));
        let finalized = healthy && {
            let api = self.api;
            self.call(|comm| {
                // SAFETY: a live communicator this object created, used by no other thread.
                unsafe { (api.comm_finalize)(comm) }
            })
            .and_then(|code| self.finish(code, "ncclCommFinalize"))
            .is_ok()
        };
        let _g = self.ctx.enter();
        // SAFETY: created by ncclCommInitRankConfig, freed exactly once, here.
        unsafe {
            if finalized {
                (self.api.comm_destroy)(self.comm);
            } else {
                (self.api.comm_abort)(self.comm);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_codes_outside_nccl_h_are_only_numbers() {
        assert_eq!(api::result_name(SUCCESS), Some("ncclSuccess"));
        assert_eq!(api::result_name(IN_PROGRESS), Some("ncclInProgress"));
        assert_eq!(api::result_name(8), Some("ncclTimeout"));
        for unknown in [9, 100, -1, c_int::MIN] {
            assert_eq!(api::result_name(unknown), None);
        }
    }

    #[test]
    fn the_config_is_nccl_config_initializer_but_non_blocking() {
        let c = nonblocking_config();
        assert_eq!(
            (c.size, c.magic, c.version, c.blocking),
            (std::mem::size_of::<ncclConfig_t>(), 0xcafe_beef, 23000, 0)
        );
        let undefined = [
            c.cgaClusterSize,
            c.minCTAs,
            c.maxCTAs,
            c.splitShare,
            c.trafficClass,
            c.collnetEnable,
            c.CTAPolicy,
        ];
        let more = [
            c.shrinkShare,
            c.nvlsCTAs,
            c.nChannelsPerNetPeer,
            c.nvlinkCentricSched,
            c.graphUsageMode,
            c.numRmaCtx,
            c.maxP2pPeers,
        ];
        assert!(undefined.iter().chain(&more).all(|&v| v == c_int::MIN));
        assert!(c.netName.is_null() && c.commName.is_null());
    }
}
