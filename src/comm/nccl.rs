//! The NCCL communicator (CUDA devices): one rank of an NCCL group, created from a unique id or
//! adopted from the caller. NCCL is loaded at run time; its collectives are enqueued on a CUDA
//! stream and never wait for the device. The accumulator's CUDA boundary drives it.
//!
//! Communicators gradacc creates are non-blocking, so no NCCL call here waits for a peer: a call
//! that answers ncclInProgress is polled with ncclCommGetAsyncError until it is enqueued, up to a
//! deadline, and `abort` from any thread ends such a wait. Every other use of one communicator is
//! serialised: NCCL allows one thread at a time inside a communicator.

use std::cell::Cell;
use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use parking_lot::{Mutex, MutexGuard};

use crate::backend::cuda::driver::{CUdeviceptr, CUstream, Context};
use crate::error::{Error, ErrorKind, Result};

/// Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES).
pub const UNIQUE_ID_BYTES: usize = 128;

/// How long a rank waits for the others (to create the communicator, to enqueue a collective, to
/// finalise it) before it gives up. A rank that starts minutes after the others is normal; one
/// that never comes is a failure.
pub use super::DEFAULT_TIMEOUT;

/// The NCCL entry points gradacc calls, resolved from the library `library::NCCL` loads, and
/// typed to return a plain integer. cudarc declares them returning its `ncclResult_t` enum, and a
/// code outside that enum (from a newer NCCL, or a broken one) would be undefined behaviour before
/// any check could look at it. The data type and operation stay cudarc's enums: gradacc only passes
/// values it made.
mod api {
    use std::ffi::{c_char, c_int, c_void};
    use std::sync::OnceLock;

    use cudarc::nccl::sys::{
        cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId,
    };
    use libloading::Library;

    use crate::backend::cuda::library::{self, Opened};
    use crate::error::Result;

    pub(super) const SUCCESS: c_int = 0;
    pub(super) const IN_PROGRESS: c_int = 7;

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
        pub comm_init_rank_config: unsafe extern "C" fn(
            *mut ncclComm_t,
            c_int,
            ncclUniqueId,
            c_int,
            *mut ncclConfig_t,
        ) -> c_int,
        pub comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
        pub comm_user_rank: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
        pub comm_count: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
        pub comm_cu_device: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
        pub all_reduce: unsafe extern "C" fn(
            *const c_void,
            *mut c_void,
            usize,
            ncclDataType_t,
            ncclRedOp_t,
            ncclComm_t,
            cudaStream_t,
        ) -> c_int,
        pub reduce_scatter: unsafe extern "C" fn(
            *const c_void,
            *mut c_void,
            usize,
            ncclDataType_t,
            ncclRedOp_t,
            ncclComm_t,
            cudaStream_t,
        ) -> c_int,
        pub all_gather: unsafe extern "C" fn(
            *const c_void,
            *mut c_void,
            usize,
            ncclDataType_t,
            ncclComm_t,
            cudaStream_t,
        ) -> c_int,
        pub reduce: unsafe extern "C" fn(
            *const c_void,
            *mut c_void,
            usize,
            ncclDataType_t,
            ncclRedOp_t,
            c_int,
            ncclComm_t,
            cudaStream_t,
        ) -> c_int,
        pub send: unsafe extern "C" fn(
            *const c_void,
            usize,
            ncclDataType_t,
            c_int,
            ncclComm_t,
            cudaStream_t,
        ) -> c_int,
        pub recv: unsafe extern "C" fn(
            *mut c_void,
            usize,
            ncclDataType_t,
            c_int,
            ncclComm_t,
            cudaStream_t,
        ) -> c_int,
        pub group_start: unsafe extern "C" fn() -> c_int,
        pub group_end: unsafe extern "C" fn() -> c_int,
        pub comm_finalize: unsafe extern "C" fn(ncclComm_t) -> c_int,
        pub comm_destroy: unsafe extern "C" fn(ncclComm_t) -> c_int,
        pub comm_abort: unsafe extern "C" fn(ncclComm_t) -> c_int,
        pub get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
        pub get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
        /// Kept open for the entry points above.
        _library: Library,
    }

    /// Loads NCCL and resolves every entry point, once per process: the first candidate of
    /// `library::NCCL` that has them all, or BACKEND_UNAVAILABLE listing each tried and why
    /// (one without an entry point is named with the first it lacks).
    pub(super) fn get() -> Result<&'static Api> {
        static API: OnceLock<Result<Api>> = OnceLock::new();
        API.get_or_init(|| library::load(&library::NCCL, resolve)).as_ref().map_err(Clone::clone)
    }

    fn resolve(opened: Opened) -> std::result::Result<Api, String> {
        macro_rules! resolve {
            ($name:literal) => {
                // SAFETY: each field's type is the C prototype of the symbol in nccl.h, with
                // ncclResult_t (a C enum, an int) as c_int.
                unsafe { opened.symbol($name) }
                    .map_err(|e| format!("{e} (gradacc needs NCCL 2.14 or newer)"))?
            };
        }
        Ok(Api {
            get_unique_id: resolve!("ncclGetUniqueId"),
            comm_init_rank_config: resolve!("ncclCommInitRankConfig"),
            comm_get_async_error: resolve!("ncclCommGetAsyncError"),
            comm_user_rank: resolve!("ncclCommUserRank"),
            comm_count: resolve!("ncclCommCount"),
            comm_cu_device: resolve!("ncclCommCuDevice"),
            all_reduce: resolve!("ncclAllReduce"),
            reduce_scatter: resolve!("ncclReduceScatter"),
            all_gather: resolve!("ncclAllGather"),
            reduce: resolve!("ncclReduce"),
            // Since NCCL 2.7.
            send: resolve!("ncclSend"),
            recv: resolve!("ncclRecv"),
            group_start: resolve!("ncclGroupStart"),
            group_end: resolve!("ncclGroupEnd"),
            comm_finalize: resolve!("ncclCommFinalize"),
            comm_destroy: resolve!("ncclCommDestroy"),
            comm_abort: resolve!("ncclCommAbort"),
            get_error_string: resolve!("ncclGetErrorString"),
            get_last_error: resolve!("ncclGetLastError"),
            _library: opened.library,
        })
    }
}

use api::{Api, IN_PROGRESS, SUCCESS};

/// Whether the NCCL library loads and has every entry point gradacc calls (never panics; loaded
/// once per process, by `GRADACC_NCCL_LIBRARY` or as `libnccl.so.2`, then `libnccl.so`).
pub fn nccl_available() -> bool {
    nccl().is_ok()
}

/// BACKEND_UNAVAILABLE unless NCCL loads with every entry point, naming every library tried and
/// why each failed.
pub fn require_nccl() -> Result<()> {
    nccl().map(|_| ())
}

/// The NCCL entry points, or BACKEND_UNAVAILABLE naming every library tried and why each failed.
fn nccl() -> Result<&'static Api> {
    api::get()
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
    Error::new(
        ErrorKind::CommFailure,
        format!("{what} failed: {text} {detail}").trim_end().to_string(),
    )
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

/// Polls `state` (ncclCommGetAsyncError's answer) until it leaves ncclInProgress: Ok once it is
/// ncclSuccess, `error(code)` for an error, a timeout error after `timeout`. Sleeps between
/// polls, a little longer each time up to 1 ms, so a long wait costs no core.
fn poll(
    timeout: Option<Duration>,
    what: &str,
    mut state: impl FnMut() -> Result<c_int>,
    error: impl FnOnce(c_int) -> Error,
) -> Result<()> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(10);
    loop {
        match state()? {
            SUCCESS => return Ok(()),
            IN_PROGRESS => {}
            code => return Err(error(code)),
        }
        if let Some(timeout) = timeout.filter(|&t| start.elapsed() >= t) {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("{what} did not complete within {timeout:?}: a rank failed or never arrived; the communicator is no longer usable"),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

/// A number for the calling thread, never 0 and never reused.
fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static TOKEN: Cell<u64> = const { Cell::new(0) });
    TOKEN.with(|t| {
        if t.get() == 0 {
            t.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

/// The ranks of communicators gradacc created that are alive in this process, by unique id and
/// device: NCCL needs a device per rank, and finds two on one device only once every rank of the
/// group has arrived; gradacc refuses the second before it enters NCCL.
struct Member {
    id: [u8; UNIQUE_ID_BYTES],
    ordinal: i32,
    rank: usize,
}

static MEMBERS: Mutex<Vec<Member>> = Mutex::new(Vec::new());

/// A rank's entry in [`MEMBERS`], removed when the communicator (or its failed creation) ends.
struct Membership {
    id: [u8; UNIQUE_ID_BYTES],
    rank: usize,
}

impl Membership {
    fn claim(id: &[u8; UNIQUE_ID_BYTES], rank: usize, ordinal: i32) -> Result<Self> {
        let mut members = lock(&MEMBERS);
        for m in members.iter().filter(|m| m.id == *id) {
            if m.rank == rank {
                return Err(Error::invalid(format!("rank {rank} of this NCCL group already exists in this process (on CUDA device {})", m.ordinal)));
            }
            if m.ordinal == ordinal {
                return Err(Error::invalid(format!(
                    "ranks {} and {rank} of one NCCL group are both on CUDA device {ordinal} in this process: NCCL needs a device per rank",
                    m.rank
                )));
            }
        }
        members.push(Member { id: *id, ordinal, rank });
        Ok(Membership { id: *id, rank })
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        lock(&MEMBERS).retain(|m| m.id != self.id || m.rank != self.rank);
    }
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

    /// Runs one NCCL call on the communicator, unless it was aborted or failed.
    fn call<T>(&self, f: impl FnOnce(ncclComm_t) -> T) -> Result<T> {
        let _call = lock(&self.call);
        self.usable()?;
        let _g = self.ctx.enter()?;
        Ok(f(self.comm))
    }

    /// COMM_FAILURE for `code` of `what`, with NCCL's last message about this communicator.
    fn error(&self, code: c_int, what: &str) -> Error {
        let detail = if self.in_own_group() {
            // This thread holds `call` for its group.
            last_error(self.api, self.comm)
        } else {
            self.call(|comm| last_error(self.api, comm)).unwrap_or_default()
        };
        nccl_error(self.api, code, what, &detail)
    }

    fn usable(&self) -> Result<()> {
        if self.aborted.load(Ordering::Acquire) {
            return Err(Error::new(ErrorKind::CommFailure, "the communicator was aborted"));
        }
        if self.failed.load(Ordering::Acquire) {
            return Err(Error::new(
                ErrorKind::CommFailure,
                "the communicator failed earlier (NCCL reported an error or a wait for the other ranks timed out): destroy it",
            ));
        }
        Ok(())
    }

    /// The communicator's state from ncclCommGetAsyncError: ncclSuccess, ncclInProgress while an
    /// operation is still being issued, or an error (a peer failed).
    fn async_state(&self) -> Result<c_int> {
        let api = self.api;
        let (code, state) = self.call(|comm| {
            let mut state = IN_PROGRESS;
            // SAFETY: a live communicator (`call`); valid out-pointer, written as an int.
            let code = unsafe { (api.comm_get_async_error)(comm, &mut state) };
            (code, state)
        })?;
        if code != SUCCESS {
            return Err(self.error(code, "ncclCommGetAsyncError"));
        }
        Ok(state)
    }

    /// Completes a call that returned `code`: done, enqueued later (ncclInProgress: waits until
    /// the communicator leaves that state), or failed. A failure marks the communicator failed,
    /// so it is aborted rather than finalised; an abort during the wait ends it.
    fn finish(&self, code: c_int, what: &str) -> Result<()> {
        let result = match code {
            SUCCESS => return Ok(()),
            IN_PROGRESS => {
                poll(self.timeout(), what, || self.async_state(), |code| self.error(code, what))
            }
            code => Err(self.error(code, what)),
        };
        if result.is_err() && !self.aborted.load(Ordering::Acquire) {
            self.failed.store(true, Ordering::Release);
        }
        result
    }

    /// Whether the calling thread is inside this communicator's [`NcclComm::group`].
    fn in_own_group(&self) -> bool {
        self.group_thread.load(Ordering::Relaxed) == thread_token()
    }

    /// Enqueues an in-place sum of `count` values at `ptr` on `stream`. Inside [`NcclComm::group`],
    /// several are launched together.
    pub fn allreduce_sum_f32(
        &self,
        ptr: CUdeviceptr,
        count: usize,
        stream: CUstream,
    ) -> Result<()> {
        self.allreduce(ptr, count, ncclDataType_t::ncclFloat32, ncclRedOp_t::ncclSum, stream)
    }

    /// Enqueues an in-place u64 reduction (`max` false: sum) of `count` values at `ptr`.
    pub fn allreduce_u64(
        &self,
        ptr: CUdeviceptr,
        count: usize,
        max: bool,
        stream: CUstream,
    ) -> Result<()> {
        let op = if max { ncclRedOp_t::ncclMax } else { ncclRedOp_t::ncclSum };
        self.allreduce(ptr, count, ncclDataType_t::ncclUint64, op, stream)
    }

    fn allreduce(
        &self,
        ptr: CUdeviceptr,
        count: usize,
        dtype: ncclDataType_t,
        op: ncclRedOp_t,
        stream: CUstream,
    ) -> Result<()> {
        let (api, buf) = (self.api, ptr as *mut c_void);
        // SAFETY: a live communicator (`issue`); NCCL reads and writes `count` elements at `buf`
        // on `stream`, the caller's device buffer.
        self.issue("ncclAllReduce", |comm| unsafe {
            (api.all_reduce)(buf, buf, count, dtype, op, comm, stream as _)
        })
    }

    /// Enqueues an in-place reduce-scatter (sum) of f32: `ptr` holds `world_size * recv_count`
    /// values, and rank r's part, `recv_count` values from `ptr + r * recv_count` (NCCL's in-place
    /// layout), receives the sum of every rank's part r.
    pub fn reduce_scatter_sum_f32(
        &self,
        ptr: CUdeviceptr,
        recv_count: usize,
        stream: CUstream,
    ) -> Result<()> {
        let (api, send) = (self.api, ptr as *const c_void);
        let recv = (ptr + (4 * self.rank * recv_count) as u64) as *mut c_void;
        // SAFETY: a live communicator (`issue`); NCCL reads `world_size * recv_count` f32 at
        // `send` and writes the `recv_count` at `recv`, inside it, on `stream` (the caller's
        // buffer of that size).
        self.issue("ncclReduceScatter", |comm| unsafe {
            (api.reduce_scatter)(
                send,
                recv,
                recv_count,
                ncclDataType_t::ncclFloat32,
                ncclRedOp_t::ncclSum,
                comm,
                stream as _,
            )
        })
    }

    /// Enqueues an in-place sum of `count` f32 at `ptr` into rank `root`'s buffer; the other
    /// ranks' buffers are only read.
    pub fn reduce_sum_f32(
        &self,
        ptr: CUdeviceptr,
        count: usize,
        root: usize,
        stream: CUstream,
    ) -> Result<()> {
        let (api, buf) = (self.api, ptr as *mut c_void);
        let root = c_int::try_from(root)
            .map_err(|_| Error::invalid(format!("NCCL root {root} is out of range")))?;
        // SAFETY: a live communicator (`issue`); NCCL reads `count` f32 at `buf` and, on the
        // root, writes them, on `stream` (the caller's buffer of that size).
        self.issue("ncclReduce", |comm| unsafe {
            (api.reduce)(
                buf,
                buf,
                count,
                ncclDataType_t::ncclFloat32,
                ncclRedOp_t::ncclSum,
                root,
                comm,
                stream as _,
            )
        })
    }

    /// Enqueues an in-place all-gather of f64: `ptr` holds `world_size * send_count` values, and
    /// every rank's part r, `send_count` values from `ptr + r * send_count`, receives rank r's.
    pub fn allgather_f64(
        &self,
        ptr: CUdeviceptr,
        send_count: usize,
        stream: CUstream,
    ) -> Result<()> {
        let (api, recv) = (self.api, ptr as *mut c_void);
        let send = (ptr + (8 * self.rank * send_count) as u64) as *const c_void;
        // SAFETY: a live communicator (`issue`); NCCL reads the `send_count` f64 at `send` and
        // writes `world_size * send_count` at `recv`, which holds them, on `stream`.
        self.issue("ncclAllGather", |comm| unsafe {
            (api.all_gather)(send, recv, send_count, ncclDataType_t::ncclFloat64, comm, stream as _)
        })
    }

    /// Enqueues, as one NCCL group, this rank's part of an exchange of bf16 words (16-bit values
    /// bit for bit): `sends[q]` (an address and a count) goes to rank `q`, and `recvs[q]` receives
    /// rank `q`'s message to this rank; an empty one is neither sent nor received. Every pair
    /// of ranks must agree on each message's count. A rank may send to itself.
    pub fn exchange_bf16(
        &self,
        sends: &[(CUdeviceptr, usize)],
        recvs: &[(CUdeviceptr, usize)],
        stream: CUstream,
    ) -> Result<()> {
        if sends.len() != self.world_size || recvs.len() != self.world_size {
            return Err(Error::invalid(format!(
                "an exchange over {} ranks got {} sends and {} receives",
                self.world_size,
                sends.len(),
                recvs.len()
            )));
        }
        let api = self.api;
        let dtype = ncclDataType_t::ncclBfloat16;
        self.group(|| {
            for (q, (&(send, s), &(recv, r))) in sends.iter().zip(recvs).enumerate() {
                let peer = q as c_int;
                if s > 0 {
                    // SAFETY: a live communicator (`issue`); NCCL reads `s` 16-bit words at
                    // `send` on `stream` (the caller's device buffer of that size).
                    self.issue("ncclSend", |comm| unsafe {
                        (api.send)(send as *const c_void, s, dtype, peer, comm, stream as _)
                    })?;
                }
                if r > 0 {
                    // SAFETY: as above; NCCL writes `r` words at `recv`.
                    self.issue("ncclRecv", |comm| unsafe {
                        (api.recv)(recv as *mut c_void, r, dtype, peer, comm, stream as _)
                    })?;
                }
            }
            Ok(())
        })
    }

    /// Enqueues an in-place all-gather of f32: `ptr` holds `world_size * send_count` values, and
    /// every rank's part r receives rank r's.
    pub fn allgather_f32(
        &self,
        ptr: CUdeviceptr,
        send_count: usize,
        stream: CUstream,
    ) -> Result<()> {
        let (api, recv) = (self.api, ptr as *mut c_void);
        let send = (ptr + (4 * self.rank * send_count) as u64) as *const c_void;
        // SAFETY: a live communicator (`issue`); NCCL reads the `send_count` f32 at `send` and
        // writes `world_size * send_count` at `recv`, which holds them, on `stream`.
        self.issue("ncclAllGather", |comm| unsafe {
            (api.all_gather)(send, recv, send_count, ncclDataType_t::ncclFloat32, comm, stream as _)
        })
    }

    /// Issues one collective: inside this thread's [`NcclComm::group`] NCCL collects it (the
    /// group checked the communicator and holds it), otherwise it is enqueued at once.
    fn issue(&self, what: &str, call: impl FnOnce(ncclComm_t) -> c_int) -> Result<()> {
        if self.in_own_group() {
            // This thread holds `serial` and `call` for the group, which checked the
            // communicator: NCCL collects the call, and ncclGroupEnd launches and waits for it.
            let _g = self.ctx.enter()?;
            let code = call(self.comm);
            return if code == SUCCESS || code == IN_PROGRESS {
                Ok(())
            } else {
                self.finish(code, what)
            };
        }
        let _serial = lock(&self.serial);
        let code = self.call(call)?;
        self.finish(code, what)
    }

    /// Runs `f` between ncclGroupStart and ncclGroupEnd, so the collectives it issues on this
    /// communicator launch as one; returns once they are enqueued. No other thread uses the
    /// communicator meanwhile, and `abort` waits until ncclGroupEnd has returned (not for the
    /// wait after it), since the group refers to the communicator until then.
    pub fn group<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let api = self.api;
        if self.in_own_group() {
            // Nested: NCCL counts the depth, and the outermost ncclGroupEnd launches.
            // SAFETY: group calls take no communicator.
            check(api, unsafe { (api.group_start)() }, "ncclGroupStart", self.comm)?;
            let result = f();
            // SAFETY: as above.
            let end = unsafe { (api.group_end)() };
            let r = result?;
            return if end == SUCCESS || end == IN_PROGRESS {
                Ok(r)
            } else {
                Err(self.error(end, "ncclGroupEnd"))
            };
        }
        let _serial = lock(&self.serial);
        let end = {
            let call = lock(&self.call);
            self.usable()?;
            let _g = self.ctx.enter()?;
            // SAFETY: group calls take no communicator.
            check(api, unsafe { (api.group_start)() }, "ncclGroupStart", self.comm)?;
            let owner = GroupOwner::enter(&self.group_thread);
            let result = f();
            drop(owner);
            // SAFETY: as above; the communicator the group refers to is live (`call`).
            let end = unsafe { (api.group_end)() };
            drop(call);
            (result, end)
        };
        let (result, end) = end;
        let end = self.finish(end, "ncclGroupEnd");
        let r = result?;
        end.map(|_| r)
    }
}

/// Marks the calling thread as inside a communicator's group, until dropped (also on unwind).
struct GroupOwner<'a>(&'a AtomicU64);

impl<'a> GroupOwner<'a> {
    fn enter(owner: &'a AtomicU64) -> Self {
        owner.store(thread_token(), Ordering::Relaxed);
        GroupOwner(owner)
    }
}

impl Drop for GroupOwner<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

impl super::Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn device(&self) -> crate::device::Device {
        crate::device::Device::Cuda { ordinal: self.ctx.ordinal, stream: std::ptr::null_mut() }
    }

    fn collectives(&self) -> super::Collectives<'_> {
        super::Collectives::Nccl(self)
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
