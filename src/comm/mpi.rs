//! The MPI communicator (feature `mpi`): one rank of an MPI communicator, which gradacc duplicates
//! so its traffic never mixes with the caller's, and sets to return errors instead of aborting.
//! The boundary reduces in shares (see `shares`): per chunk an exchange, this rank's sum and pass,
//! and a gather. Each element is summed by one rank, in rank order, so every rank gets the same
//! bits by construction, and they are the in-process communicator's bits. When every rank of the
//! group is on one host, the exchange and the gather go through memory the ranks share (see
//! `shm`; set up at creation, [`MpiOptions::shared_memory`]); otherwise they are one
//! MPI_Ialltoallv and one MPI_Iallgatherv. The control reduction and the block values are MPI
//! collectives either way.
//!
//! `allreduce_sum` (the Rust API's plain sum, not the boundary) is MPI_Iallreduce, piece by piece
//! through a buffer of the communicator; its identical bits on every rank rest on MPI, whose
//! standard advises "the same result on all processes".
//!
//! No rank waits forever: every collective is non-blocking and its requests are polled with
//! MPI_Testall, sleeping between polls, until they complete, the communicator's timeout passes
//! (TIMEOUT, naming the phase; the communicator is then aborted) or another thread aborts it
//! (COMM_FAILURE); a peer on this host that died or stays stopped fails the wait within
//! milliseconds (COMM_FAILURE naming the rank, see `liveness`). Requests abandoned that way stay pending inside MPI and may still complete
//! later (a late peer arrives), so MPI is never handed the caller's memory: every buffer a request
//! names (control words, counts and displacements, the staged chunk, scratch, the all-reduce's
//! piece) belongs to the communicator, data is copied into it before a post and out of it only
//! after the request completed, and it outlives those requests: if they are still pending when
//! the communicator is dropped, that memory and the MPI communicator itself are leaked instead of
//! freed (see Drop). Once anything was posted, any failure aborts the communicator, so a rank
//! that fell out of step with its peers' collectives never posts another one.
//!
//! An MPI initialised below MPI_THREAD_MULTIPLE (by the caller) gets every gradacc collective of
//! the process behind one lock, so two communicators used from two threads never call MPI at
//! once (enough for MPI_THREAD_SERIALIZED; with FUNNELED or SINGLE, call gradacc from the thread
//! that makes the program's MPI calls). A collective waits for that lock the way it waits for its
//! requests, so the timeout and an abort hold there too.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mpi::ffi;
use parking_lot::{Mutex, MutexGuard};

use super::liveness::{Peers, Process};
use super::shares::{self, ShareTransport, Step, Workspace};
use super::shm::{self, posix, Region, Shm};
use super::{
    check_buckets, check_counts, check_shards, packing, BlockPass, Busy, BusyGuard, Collectives,
    Communicator, ControlSum, HostCollectives, DEFAULT_TIMEOUT,
};
use crate::error::{Error, ErrorKind, Result};

extern "C" {
    /// MPI_IN_PLACE of the MPI this crate was built against (src/comm/mpi_shim.c).
    fn gradacc_internal_mpi_in_place() -> *mut c_void;
    fn atexit(f: extern "C" fn()) -> c_int;
}

/// Bytes of the broadcast that tells the ranks how to reach the shared memory (`shm::posix`).
const OFFER_BYTES: usize = 128;

/// Elements `allreduce_sum` reduces per MPI call, through the communicator's piece buffer (4 MB).
const SUM_PIECE: usize = 1 << 20;

/// Whether gradacc initialised MPI in this process (then it finalises it at exit).
static INIT: Mutex<bool> = Mutex::new(false);

/// Serialises gradacc's MPI calls when MPI runs below MPI_THREAD_MULTIPLE.
static SERIAL: Mutex<()> = Mutex::new(());

thread_local! {
    /// This thread holds [`SERIAL`]: a collective it runs inside another one (the hybrid
    /// boundary's replica all-reduce, inside the shard group's reduce-scatter) is still one
    /// thread's MPI calls, one at a time, and must not wait for itself.
    static HOLDING_SERIAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// This thread's hold on [`SERIAL`]: the lock itself, or nothing for a collective nested in one
/// that holds it.
struct Serial(#[allow(dead_code)] Option<MutexGuard<'static, ()>>);

impl Drop for Serial {
    fn drop(&mut self) {
        if self.0.is_some() {
            HOLDING_SERIAL.with(|h| h.set(false));
        }
    }
}

/// How long a wait polls without sleeping. A healthy collective of the boundary completes within
/// tens of microseconds, and MPI moves data only while this process calls it (shared memory,
/// TCP), so sleeping at once would add a sleep's latency to each of them; see docs/mpi.md.
const SPIN: Duration = Duration::from_micros(200);
/// The first sleep between two polls after [`SPIN`]; each next one doubles, up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_micros(5);
/// The longest sleep between two polls: how late a wait may notice that its requests completed,
/// the timeout passed, or the communicator was aborted.
const MAX_PAUSE: Duration = Duration::from_micros(500);

/// A timeout of `None` (wait forever), as stored.
const FOREVER: u64 = u64::MAX;

/// The pauses of a polling wait: none for [`SPIN`], then sleeps from [`FIRST_PAUSE`] doubling
/// up to [`MAX_PAUSE`].
struct Backoff {
    start: Instant,
    pause: Duration,
}

impl Backoff {
    fn new() -> Backoff {
        Backoff { start: Instant::now(), pause: FIRST_PAUSE }
    }

    fn waited(&self) -> Duration {
        self.start.elapsed()
    }

    fn pause(&mut self) {
        if self.start.elapsed() < SPIN {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(self.pause);
            self.pause = (self.pause * 2).min(MAX_PAUSE);
        }
    }
}

/// One rank of a duplicated MPI communicator.
pub struct MpiComm {
    comm: ffi::MPI_Comm,
    rank: usize,
    world: usize,
    /// MPI was initialised below MPI_THREAD_MULTIPLE: collectives take [`SERIAL`].
    serialize: bool,
    busy: Busy,
    /// The timeout in nanoseconds, [`FOREVER`] for none.
    timeout_ns: AtomicU64,
    /// Set by [`Communicator::abort`], a timeout or an MPI error inside a wait: every collective
    /// fails from then on, and a wait in progress stops.
    aborted: AtomicBool,
    /// Why it was aborted, for the errors of later calls.
    reason: Mutex<Option<String>>,
    /// The memory MPI may use besides the caller's buffer, and the requests abandoned in it. Only
    /// the collective holding `busy` locks it.
    mem: Mutex<Memory>,
    /// Memory every rank of the group maps, when all are on one host: the boundary's data then
    /// moves through it instead of through MPI (see `shm`).
    shared: Option<Shared>,
    /// The group's ranks on this host, which a wait looks at: one that died or stays stopped
    /// fails the wait in milliseconds (see `liveness`).
    peers: Peers,
}

/// The group's shared memory and the region over it (the region goes first, then the mapping).
struct Shared {
    region: Region,
    _mapping: posix::Mapping,
}

/// Options of an MPI communicator, fixed at creation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MpiOptions {
    /// When every rank of the group is on one host, reduce the boundary's data through shared
    /// memory the ranks map (MPI still carries the control reduction and the block values).
    /// `true` by default; a group across hosts, or one whose memory cannot be shared, uses MPI
    /// for everything either way.
    pub shared_memory: bool,
}

impl Default for MpiOptions {
    fn default() -> Self {
        MpiOptions { shared_memory: true }
    }
}

/// The control exchange's words, at a fixed heap address: a request abandoned by a timeout may
/// still read the inputs and write the results when a late peer arrives.
#[derive(Debug, Default)]
struct ControlWords {
    sum_in: [u64; packing::SUM_WORDS],
    max_in: [u64; packing::MAX_WORDS],
    sum: [u64; packing::SUM_WORDS],
    max: [u64; packing::MAX_WORDS],
}

/// Counts and displacements of the vector collectives (`world` entries each), which MPI reads
/// until a non-blocking collective completes.
#[derive(Debug, Default)]
struct Counts {
    send: Vec<c_int>,
    send_at: Vec<c_int>,
    recv: Vec<c_int>,
    recv_at: Vec<c_int>,
}

/// Everything a pending request may name, except the caller's buffer.
#[derive(Debug, Default)]
struct Memory {
    control: Box<ControlWords>,
    counts: Counts,
    work: Workspace,
    /// `allreduce_sum`'s piece: each piece of the caller's buffer is copied in, reduced in place
    /// and copied back once the request completed.
    piece: Vec<f32>,
    /// Requests a timeout, an abort or an MPI error left pending. Once there is one, the
    /// communicator is aborted: nothing above is touched again, and it is leaked at drop unless
    /// they completed by then.
    abandoned: Vec<ffi::MPI_Request>,
    /// Barriers this rank passed in the shared memory.
    passed: u64,
}

// SAFETY: an MPI_Comm is a handle (an int in MPICH, a pointer in Open MPI) that MPI lets any
// thread pass: freely at MPI_THREAD_MULTIPLE, and below it one call at a time, which `serialize`
// enforces (`enter` takes `SERIAL`); the other fields are plain data.
unsafe impl Send for MpiComm {}
// SAFETY: every `&self` method that calls MPI goes through `enter` first, where `busy` refuses a
// second collective on the same handle and `SERIAL` orders all of them below MPI_THREAD_MULTIPLE;
// `rank`, `world` and `serialize` never change after `adopt`; the timeout and the abort flag are
// atomics and `reason` and `mem` mutexes (`abort`, the one method other threads may call during
// a collective, touches only the flag and `reason`, and never calls MPI).
unsafe impl Sync for MpiComm {}

/// MPI's own text for an error code.
fn error_text(code: c_int) -> String {
    let mut buf = vec![0 as c_char; 4096];
    let mut len: c_int = 0;
    // SAFETY: MPI writes at most MPI_MAX_ERROR_STRING chars, and `buf` is larger than that of any
    // MPI (Open MPI 256, MPICH 1024); `len` is a live int.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return format!("MPI error code {code}");
    }
    // SAFETY: MPI_Error_string succeeded, so it wrote a NUL-terminated string into `buf`, which
    // outlives this borrow.
    unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned()
}

/// Turns an MPI return code into a result whose message names the call.
fn check(rc: c_int, what: &str) -> Result<()> {
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::CommFailure, format!("{what} failed: {}", error_text(rc))))
    }
}

fn flag(f: unsafe extern "C" fn(*mut c_int) -> c_int) -> bool {
    let mut v: c_int = 0;
    // SAFETY: `f` is MPI_Initialized or MPI_Finalized (the only functions passed in), which MPI
    // allows at any time, before MPI_Init and after MPI_Finalize, from any thread; each writes one
    // int to `v`, a live local.
    unsafe { f(&mut v) };
    v != 0
}

/// Finalises the MPI gradacc initialised, unless a process of the job was seen dead: MPI_Finalize
/// then waits for it (Open MPI 4.1.4 under `mpirun --enable-recovery`: in its fence, in 3 of 28
/// runs, also with nothing of gradacc's pending), and exiting without it is the lesser harm.
extern "C" fn finalize_at_exit() {
    if super::liveness::a_peer_ended() {
        return;
    }
    if flag(ffi::MPI_Initialized) && !flag(ffi::MPI_Finalized) {
        // SAFETY: `ensure_initialized` registers this handler only after its own MPI_Init_thread
        // succeeded; MPI is initialised and not finalised (checked just above), and the process is
        // exiting, so no gradacc collective is in flight.
        unsafe { ffi::MPI_Finalize() };
    }
}

/// Initialises MPI unless somebody already did. When gradacc initialises it, it also finalises
/// it at process exit (communicators may be created and destroyed any number of times before);
/// an MPI the caller initialised is never finalised by gradacc.
fn ensure_initialized() -> Result<()> {
    let mut ours = INIT.lock();
    if flag(ffi::MPI_Finalized) {
        return Err(Error::new(
            ErrorKind::BackendUnavailable,
            "MPI was already finalised in this process",
        ));
    }
    if flag(ffi::MPI_Initialized) {
        return Ok(());
    }
    let mut provided: c_int = 0;
    // SAFETY: MPI is neither initialised nor finalised (both checked above under `INIT`, which
    // keeps two gradacc threads from racing here); MPI allows NULL argc and argv, and `provided` is
    // a live int.
    let rc = unsafe {
        ffi::MPI_Init_thread(
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            ffi::RSMPI_THREAD_MULTIPLE,
            &mut provided,
        )
    };
    if rc != ffi::MPI_SUCCESS as c_int {
        return Err(Error::new(
            ErrorKind::BackendUnavailable,
            format!("MPI_Init_thread failed (code {rc})"),
        ));
    }
    if !*ours {
        *ours = true;
        // SAFETY: `finalize_at_exit` is an `extern "C" fn()` that cannot unwind, as atexit
        // requires;
        // `ours` makes this the only registration.
        unsafe { atexit(finalize_at_exit) };
    }
    Ok(())
}

impl MpiComm {
    /// A communicator over MPI_COMM_WORLD (initialising MPI if nobody has).
    pub fn world() -> Result<Self> {
        Self::world_with(MpiOptions::default())
    }

    /// [`MpiComm::world`] with `options`.
    pub fn world_with(options: MpiOptions) -> Result<Self> {
        ensure_initialized()?;
        // SAFETY: reads rsmpi's extern constant for MPI_COMM_WORLD, set when the library loads and
        // never written; `ensure_initialized` just made the handle usable.
        Self::adopt(unsafe { ffi::RSMPI_COMM_WORLD }, options)
    }

    /// A communicator over the caller's communicator, given as its Fortran handle (the value of
    /// `MPI_Comm_c2f` in C, `comm.py2f()` in mpi4py, `MPI.API.MPI_Comm_c2f(comm.val)` in MPI.jl).
    /// The caller's communicator is duplicated, never changed, and may be freed once this returns.
    pub fn from_fortran(handle: i64) -> Result<Self> {
        Self::from_fortran_with(handle, MpiOptions::default())
    }

    /// [`MpiComm::from_fortran`] with `options`.
    pub fn from_fortran_with(handle: i64, options: MpiOptions) -> Result<Self> {
        let f = ffi::RSMPI_Fint::try_from(handle).map_err(|_| {
            Error::invalid(format!(
                "Fortran communicator handle {handle} does not fit in an MPI_Fint"
            ))
        })?;
        ensure_initialized()?;
        // SAFETY: `ensure_initialized` ran; MPI_Comm_f2c takes any integer and maps one it does not
        // know to MPI_COMM_NULL (checked below) or to a handle the duplication rejects.
        let comm = unsafe { ffi::RSMPI_Comm_f2c(f) };
        // SAFETY: reads rsmpi's extern constant for MPI_COMM_NULL, set at load and never written.
        if comm == unsafe { ffi::RSMPI_COMM_NULL } {
            return Err(Error::invalid(format!(
                "Fortran communicator handle {handle} is MPI_COMM_NULL or unknown"
            )));
        }
        Self::adopt(comm, options)
    }

    fn adopt(parent: ffi::MPI_Comm, options: MpiOptions) -> Result<Self> {
        let mut level: c_int = 0;
        // SAFETY: both callers ran `ensure_initialized` first; MPI writes one int to `level`.
        check(unsafe { ffi::MPI_Query_thread(&mut level) }, "MPI_Query_thread")?;
        // SAFETY: reads rsmpi's extern constant for MPI_THREAD_MULTIPLE, set at load, never
        // written.
        let serialize = level < unsafe { ffi::RSMPI_THREAD_MULTIPLE };
        let mut inter: c_int = 0;
        // SAFETY: `parent` is MPI_COMM_WORLD or an f2c result other than MPI_COMM_NULL; MPI reports
        // a stale one through the caller's error handler; `inter` is a live int.
        check(unsafe { ffi::MPI_Comm_test_inter(parent, &mut inter) }, "MPI_Comm_test_inter")?;
        if inter != 0 {
            // Collectives on an intercommunicator combine the other group's data, not this one's.
            return Err(Error::invalid("the communicator is an intercommunicator; gradacc needs an intracommunicator (one group of ranks)"));
        }
        // SAFETY: MPI_Comm is an int (MPICH) or a pointer (Open MPI), for which all-zero bits are a
        // valid value; it is only a placeholder that MPI_Comm_dup overwrites before any use.
        let mut comm: ffi::MPI_Comm = unsafe { std::mem::zeroed() };
        // SAFETY: `parent` passed MPI_Comm_test_inter just above; MPI writes the new handle to
        // `comm`, and a failure follows the caller's error handler.
        check(unsafe { ffi::MPI_Comm_dup(parent, &mut comm) }, "MPI_Comm_dup")?;
        let mut this = MpiComm {
            comm,
            rank: 0,
            world: 0,
            serialize,
            busy: Busy::default(),
            timeout_ns: AtomicU64::new(DEFAULT_TIMEOUT.as_nanos() as u64),
            aborted: AtomicBool::new(false),
            reason: Mutex::new(None),
            mem: Mutex::new(Memory::default()),
            shared: None,
            peers: Peers::none(),
        };
        // From here on `this` frees the duplicate on every path.
        check(
            // SAFETY: `this.comm` is the duplicate MPI_Comm_dup just made, ours alone, so changing its
            // handler leaves the caller's communicator as it was; ERRORS_RETURN is rsmpi's constant.
            unsafe { ffi::MPI_Comm_set_errhandler(this.comm, ffi::RSMPI_ERRORS_RETURN) },
            "MPI_Comm_set_errhandler",
        )?;
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: `this.comm` is the live duplicate made above; MPI writes one int to `rank`.
        check(unsafe { ffi::MPI_Comm_rank(this.comm, &mut rank) }, "MPI_Comm_rank")?;
        // SAFETY: as for MPI_Comm_rank; MPI writes one int to `size`.
        check(unsafe { ffi::MPI_Comm_size(this.comm, &mut size) }, "MPI_Comm_size")?;
        this.rank = rank as usize;
        this.world = size as usize;
        this.peers = this.same_host_peers()?;
        if options.shared_memory {
            this.shared = this.share_memory()?;
        }
        Ok(this)
    }

    /// Maps shared memory for the group, when every rank can (collective, at creation): rank 0
    /// creates it and broadcasts how to reach it, every rank maps it, and all agree whether all
    /// could; then rank 0 withdraws the offer (see `shm::posix`: on Linux nothing of it is ever
    /// left in a file system, whenever a rank dies). `None` where any rank could not (another
    /// host, no /dev/shm, too little room there) or the group is too large or a single rank.
    fn share_memory(&self) -> Result<Option<Shared>> {
        let Some(piece) = shm::piece_for(self.world) else { return Ok(None) };
        let size = Region::size(self.world, piece);
        let mut name = [0u8; OFFER_BYTES];
        let created = if self.rank == 0 { posix::Mapping::create(size).ok() } else { None };
        if let Some((_, offer)) = &created {
            let text = offer.name().as_bytes();
            if text.len() < OFFER_BYTES {
                name[..text.len()].copy_from_slice(text);
            }
        }
        let (buf, len) = (name.as_mut_ptr().cast(), OFFER_BYTES as c_int);
        // SAFETY: `name` is OFFER_BYTES writable bytes on every rank, the count given; rank 0 is
        // the root of a blocking broadcast on the communicator's own duplicate, which every rank
        // calls here.
        let rc = unsafe { ffi::MPI_Bcast(buf, len, ffi::RSMPI_UINT8_T, 0, self.comm) };
        check(rc, "MPI_Bcast (shared memory)")?;
        let name = String::from_utf8_lossy(
            &name[..name.iter().position(|&b| b == 0).unwrap_or(OFFER_BYTES)],
        )
        .into_owned();
        let (mapping, offer) = match created {
            Some((m, offer)) => (Some(m), Some(offer)),
            None if !name.is_empty() => (posix::Mapping::open(&name, size).ok(), None),
            None => (None, None),
        };
        let (mine, mut all): (c_int, c_int) = (c_int::from(mapping.is_some()), 0);
        // SAFETY: one int in, one int out, a blocking all-reduce every rank calls here.
        let agreed = check(
            unsafe {
                ffi::MPI_Allreduce(
                    (&mine as *const c_int).cast(),
                    (&mut all as *mut c_int).cast(),
                    1,
                    ffi::RSMPI_INT32_T,
                    ffi::RSMPI_MIN,
                    self.comm,
                )
            },
            "MPI_Allreduce (shared memory)",
        );
        drop(offer);
        agreed?;
        Ok(match mapping {
            Some(m) if all == 1 => Some(Shared {
                // SAFETY: the mapping is `size` bytes, page-aligned, zero-filled at creation, mapped
                // by every rank of the group (all agreed) and used only through this region, which
                // lives beside it in `Shared` and goes first.
                region: unsafe { Region::new(m.base(), self.world, piece) },
                _mapping: m,
            }),
            _ => None,
        })
    }

    /// Every rank's process (collective, at creation), and of those the ones this rank watches.
    fn same_host_peers(&self) -> Result<Peers> {
        let mine = Process::mine().words();
        let mut all = vec![0u64; 3 * self.world];
        let (send, recv) = (mine.as_ptr().cast(), all.as_mut_ptr().cast());
        // SAFETY: three u64 in, three per rank out into `all` (3 * world), a blocking all-gather
        // on the communicator's own duplicate that every rank calls here; RSMPI_UINT64_T is
        // rsmpi's constant, set at load and never written.
        let rc = unsafe {
            let words = ffi::RSMPI_UINT64_T;
            ffi::MPI_Allgather(send, 3, words, recv, 3, words, self.comm)
        };
        check(rc, "MPI_Allgather (processes)")?;
        let group: Vec<Process> = all.chunks_exact(3).map(Process::from_words).collect();
        Ok(Peers::new(self.rank, &group))
    }

    /// How many of the group's other ranks run on this host and are watched while waiting.
    pub fn watched_peers(&self) -> usize {
        self.peers.len()
    }

    /// Whether the boundary's data moves through shared memory.
    pub fn shares_memory(&self) -> bool {
        self.shared.is_some()
    }

    /// Runs one reduction in shares over this communicator's transport: shared memory when the
    /// group has it, MPI otherwise; a failure once anything moved aborts the communicator.
    fn in_shares<R>(&self, run: impl FnOnce(&mut dyn ShareTransport) -> Result<R>) -> Result<R> {
        let mut entered = self.enter()?;
        let mem = &mut *entered.2;
        let mut t = Shares::new(self, &mut mem.counts, &mut mem.work, &mut mem.abandoned);
        let result = match &self.shared {
            Some(shared) => {
                // A barrier raised is as good as a post: a failure leaves the peers out of step.
                t.posted = true;
                let mut s = Shm::new(
                    &mut t,
                    &shared.region,
                    &mut mem.passed,
                    self.timeout(),
                    &self.aborted,
                    &self.peers,
                    "MPI",
                );
                run(&mut s)
            }
            None => run(&mut t),
        };
        t.settle(result)
    }

    fn enter(&self) -> Result<Entered<'_>> {
        self.check_live()?;
        let busy = self.busy.enter(|| format!("MPI communicator rank {}", self.rank))?;
        let serial = if self.serialize { Some(self.serial()?) } else { None };
        // Aborted while this call waited for the process's MPI lock.
        self.check_live()?;
        Ok(Entered(busy, serial, lock(&self.mem)))
    }

    /// Takes [`SERIAL`] (unless this thread holds it already), polling it the way
    /// [`MpiComm::wait`] polls requests: past this
    /// communicator's timeout it fails with TIMEOUT and aborts the communicator (its peers may
    /// have posted the collective this rank could not), and once another thread aborted it, with
    /// COMM_FAILURE.
    fn serial(&self) -> Result<Serial> {
        if HOLDING_SERIAL.with(|h| h.get()) {
            return Ok(Serial(None));
        }
        let timeout = self.timeout();
        let mut backoff = Backoff::new();
        let held = |guard| {
            HOLDING_SERIAL.with(|h| h.set(true));
            Ok(Serial(Some(guard)))
        };
        loop {
            if let Some(guard) = SERIAL.try_lock() {
                return held(guard);
            }
            self.check_live()?;
            let waited = backoff.waited();
            if let Some(t) = timeout.filter(|&t| waited >= t) {
                let e = Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "MPI collective on rank {} of {} did not start within the timeout of {t:?} (waited {waited:.3?}): MPI runs below MPI_THREAD_MULTIPLE and another gradacc collective of this process held the process's MPI lock; the communicator was aborted",
                        self.rank, self.world
                    ),
                );
                self.set_aborted(format!(" after: {}", e.message));
                return Err(e);
            }
            backoff.pause();
        }
    }

    /// Aborts the communicator after an MPI call failed to post a collective: its peers may have
    /// posted theirs, or this rank posted an earlier part of the same collective, so its next
    /// collective could pair with the wrong one of theirs.
    fn post_failed(&self, mut e: Error) -> Error {
        e.message.push_str("; the communicator was aborted");
        self.set_aborted(format!(" after: {}", e.message));
        e
    }

    /// COMM_FAILURE once the communicator was aborted.
    fn check_live(&self) -> Result<()> {
        if !self.aborted.load(Ordering::Acquire) {
            return Ok(());
        }
        let reason = lock(&self.reason).clone().unwrap_or_default();
        Err(Error::new(
            ErrorKind::CommFailure,
            format!("MPI communicator rank {} of {} was aborted{reason}; it cannot be used again (destroy it)", self.rank, self.world),
        ))
    }

    /// Marks the communicator aborted; the first reason given is kept.
    fn set_aborted(&self, reason: String) {
        let mut r = lock(&self.reason);
        if r.is_none() {
            *r = Some(reason);
        }
        self.aborted.store(true, Ordering::Release);
        // The peers waiting in shared memory stop at once.
        if let Some(shared) = &self.shared {
            shared.region.abort();
        }
    }

    /// Waits until every request in `requests` completes: polls MPI_Testall, spinning for
    /// [`SPIN`] and then sleeping between polls ([`FIRST_PAUSE`] doubling up to [`MAX_PAUSE`]).
    /// Past the timeout it fails with TIMEOUT naming `phase`; once another thread aborted the
    /// communicator, with COMM_FAILURE. Either way, and on an MPI error, the requests still
    /// pending go to `abandoned` (their memory must stay alive) and the communicator is aborted.
    fn wait(
        &self,
        requests: &mut [ffi::MPI_Request],
        abandoned: &mut Vec<ffi::MPI_Request>,
        phase: &dyn Fn() -> String,
    ) -> Result<()> {
        let timeout = self.timeout();
        let mut backoff = Backoff::new();
        let mut watch = self.peers.watch(backoff.start);
        loop {
            let mut done: c_int = 0;
            // SAFETY: `requests` holds requests this communicator posted (or MPI_REQUEST_NULL),
            // none completed yet; MPI_Testall frees and nulls them only when all completed, and
            // writes one int to `done`.
            let rc = unsafe {
                ffi::MPI_Testall(
                    requests.len() as c_int,
                    requests.as_mut_ptr(),
                    &mut done,
                    ffi::RSMPI_STATUSES_IGNORE,
                )
            };
            if rc != ffi::MPI_SUCCESS as c_int {
                let e = Error::new(
                    ErrorKind::CommFailure,
                    format!(
                        "MPI {} failed: {}; the communicator was aborted",
                        phase(),
                        error_text(rc)
                    ),
                );
                self.abandon(requests, abandoned, &e.message);
                return Err(e);
            }
            if done != 0 {
                return Ok(());
            }
            if self.aborted.load(Ordering::Acquire) {
                self.abandon(requests, abandoned, "");
                return Err(Error::new(
                    ErrorKind::CommFailure,
                    format!(
                        "MPI {} stopped after {:.3?}: the communicator (rank {} of {}) was aborted",
                        phase(),
                        backoff.waited(),
                        self.rank,
                        self.world
                    ),
                ));
            }
            if let Err(why) = watch.check(Instant::now()) {
                let e = Error::new(
                    ErrorKind::CommFailure,
                    format!(
                        "MPI {} stopped after {:.3?} on rank {} of {}: {why}; the communicator was aborted",
                        phase(),
                        backoff.waited(),
                        self.rank,
                        self.world
                    ),
                );
                self.abandon(requests, abandoned, &e.message);
                return Err(e);
            }
            let waited = backoff.waited();
            if let Some(t) = timeout.filter(|&t| waited >= t) {
                let e = Error::new(
                    ErrorKind::Timeout,
                    format!(
                        "MPI {} did not complete within the timeout of {t:?} (waited {waited:.3?}) on rank {} of {}: a rank failed, is late, or did not call it; the communicator was aborted",
                        phase(),
                        self.rank,
                        self.world
                    ),
                );
                self.abandon(requests, abandoned, &e.message);
                return Err(e);
            }
            backoff.pause();
        }
    }

    /// Keeps the still pending ones of `requests` (and so the memory they name) and aborts.
    fn abandon(
        &self,
        requests: &[ffi::MPI_Request],
        abandoned: &mut Vec<ffi::MPI_Request>,
        reason: &str,
    ) {
        // SAFETY: reads rsmpi's extern constant for MPI_REQUEST_NULL, set at load, never written.
        let null = unsafe { ffi::RSMPI_REQUEST_NULL };
        abandoned.extend(requests.iter().copied().filter(|&r| r != null));
        self.set_aborted(if reason.is_empty() {
            String::new()
        } else {
            format!(" after: {reason}")
        });
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock()
}

/// An MPI count or displacement; larger ones fail instead of wrapping.
fn count(n: usize, what: &str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        Error::invalid(format!("{what} of {n} elements exceeds what one MPI call takes"))
    })
}

/// The reduction in shares over MPI, on a communicator whose collective is already entered:
/// counts and displacements go to the communicator's [`Counts`], data to its [`Workspace`],
/// abandoned requests to its list.
struct Shares<'a> {
    comm: &'a MpiComm,
    counts: &'a mut Counts,
    work: &'a mut Workspace,
    abandoned: &'a mut Vec<ffi::MPI_Request>,
    /// Where each other rank's copy of this rank's piece lies in the scratch (words), and the
    /// last gather's ranges.
    slots: Vec<Range<usize>>,
    packed: Vec<Range<usize>>,
    /// Whether a collective was posted: a failure from then on aborts the communicator.
    posted: bool,
}

impl<'a> Shares<'a> {
    fn new(
        comm: &'a MpiComm,
        counts: &'a mut Counts,
        work: &'a mut Workspace,
        abandoned: &'a mut Vec<ffi::MPI_Request>,
    ) -> Self {
        Shares {
            comm,
            counts,
            work,
            abandoned,
            slots: Vec::new(),
            packed: Vec::new(),
            posted: false,
        }
    }

    /// A reduction's result: a failure once anything was posted leaves this rank out of step with
    /// its peers, who may post the next collective of this one, so it aborts the communicator.
    fn settle<T>(&self, result: Result<T>) -> Result<T> {
        if let Err(e) = &result {
            if self.posted {
                self.comm.set_aborted(format!(" after: {}", e.message));
            }
        }
        result
    }

    /// Waits for one request posted with return code `rc` (nothing was posted when it failed,
    /// and the communicator is aborted).
    fn finish_one(
        &mut self,
        rc: c_int,
        mut request: ffi::MPI_Request,
        call: &str,
        step: &dyn Fn() -> String,
    ) -> Result<()> {
        check(rc, call).map_err(|e| self.comm.post_failed(e))?;
        self.posted = true;
        self.comm.wait(std::slice::from_mut(&mut request), self.abandoned, step)
    }
}

/// Sets `v` to `world` zeros, keeping its memory.
fn zeroed(v: &mut Vec<c_int>, world: usize) {
    v.clear();
    v.resize(world, 0);
}

impl ShareTransport for Shares<'_> {
    fn rank(&self) -> usize {
        self.comm.rank
    }

    fn world(&self) -> usize {
        self.comm.world
    }

    fn outbox(&mut self, _k: usize, words: usize) -> &mut [u16] {
        shares::words_mut(shares::skewed(&mut self.work.stage, words.div_ceil(2)))
    }

    fn exchange(&mut self, step: Step, _k: usize, packed: &[Range<usize>]) -> Result<()> {
        let (world, rank) = (self.comm.world, self.comm.rank);
        let own = packed[rank].len();
        // One slot of `own` words per rank but this one, in rank order.
        self.slots =
            (0..world).map(|q| (q - usize::from(q > rank)) * own).map(|at| at..at + own).collect();
        let scratch = shares::words_mut(shares::skewed(
            &mut self.work.scratch,
            ((world - 1) * own).div_ceil(2),
        ));
        let c = &mut *self.counts;
        for v in [&mut c.send, &mut c.send_at, &mut c.recv, &mut c.recv_at] {
            zeroed(v, world);
        }
        for q in (0..world).filter(|&q| q != rank) {
            c.send[q] = count(packed[q].len(), "a share")?;
            c.send_at[q] = count(packed[q].start, "a share's offset")?;
            c.recv[q] = count(own, "a share")?;
            c.recv_at[q] = count(self.slots[q].start, "a share's offset")?;
        }
        let stage = shares::words(shares::skewed_ref(&self.work.stage));
        // SAFETY: reads rsmpi's extern constant for MPI_REQUEST_NULL, set at load, never written.
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the reduction sized the outbox (the stage) to hold every range of `packed`, and
        // the scratch was sized above to hold every slot, so every count and displacement stays
        // inside its buffer; each array has `world` entries, the communicator's size. MPI uses
        // them until the request completes: the counts are the communicator's `Counts`, and the
        // stage and scratch its `Workspace` (never the caller's buffer), never touched again nor
        // freed while a request is abandoned (see `Memory`).
        let rc = unsafe {
            ffi::MPI_Ialltoallv(
                stage.as_ptr() as *const c_void,
                c.send.as_ptr(),
                c.send_at.as_ptr(),
                ffi::RSMPI_UINT16_T,
                scratch.as_mut_ptr() as *mut c_void,
                c.recv.as_ptr(),
                c.recv_at.as_ptr(),
                ffi::RSMPI_UINT16_T,
                self.comm.comm,
                &mut request,
            )
        };
        self.finish_one(rc, request, "MPI_Ialltoallv", &|| step.to_string())
    }

    fn incoming(&self, q: usize) -> &[u16] {
        &shares::words(shares::skewed_ref(&self.work.scratch))[self.slots[q].clone()]
    }

    fn gather(&mut self, step: Step, _k: usize, packed: &[Range<usize>]) -> Result<()> {
        let c = &mut *self.counts;
        c.recv.clear();
        c.recv_at.clear();
        for s in packed {
            c.recv.push(count(s.len(), "a share")?);
            c.recv_at.push(count(s.start, "a share's offset")?);
        }
        self.packed = packed.to_vec();
        let stage = shares::skewed(&mut self.work.stage, packed.last().map_or(0, |p| p.end));
        // SAFETY: reads rsmpi's extern constant for MPI_REQUEST_NULL, set at load, never written.
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: the reduction sized the stage to hold every range of `packed`, one per rank
        // (`world` entries), so every count and displacement stays inside it; with MPI_IN_PLACE
        // (the shim's value for the linked MPI) the send arguments are ignored and this rank's
        // piece is read from its place in the stage. The stage is the communicator's `Workspace`
        // (never the caller's buffer) and the counts its `Counts`: alive until the request
        // completes, or for good once it is abandoned (see `exchange`).
        let rc = unsafe {
            ffi::MPI_Iallgatherv(
                gradacc_internal_mpi_in_place(),
                0,
                ffi::RSMPI_FLOAT,
                stage.as_mut_ptr() as *mut c_void,
                c.recv.as_ptr(),
                c.recv_at.as_ptr(),
                ffi::RSMPI_FLOAT,
                self.comm.comm,
                &mut request,
            )
        };
        self.finish_one(rc, request, "MPI_Iallgatherv", &|| step.to_string())
    }

    fn finished(&self, q: usize) -> &[f32] {
        &shares::skewed_ref(&self.work.stage)[self.packed[q].clone()]
    }

    fn gather_values(&mut self, mine: &[f64], counts: &[usize]) -> Result<&[f64]> {
        let c = &mut *self.counts;
        c.recv.clear();
        c.recv_at.clear();
        let mut next = 0;
        for &n in counts {
            c.recv_at.push(count(next, "the block values' offset")?);
            c.recv.push(count(n, "the block values")?);
            next += n;
        }
        let send = count(mine.len(), "the block values")?;
        let w = &mut *self.work;
        w.mine.clear();
        w.mine.extend_from_slice(mine);
        w.all.clear();
        w.all.resize(next, 0.0);
        // SAFETY: reads rsmpi's extern constant for MPI_REQUEST_NULL, set at load, never written.
        let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `w.mine` holds this rank's `counts[rank]` values and `w.all` the sum of
        // `counts`; the displacements are the running sums, so every rank's values land inside
        // `w.all`; the arrays have `world` entries. Both are the communicator's `Workspace` and
        // the counts its `Counts`: alive until the request completes, or for good once it is
        // abandoned.
        let rc = unsafe {
            ffi::MPI_Iallgatherv(
                w.mine.as_ptr() as *const c_void,
                send,
                ffi::RSMPI_DOUBLE,
                w.all.as_mut_ptr() as *mut c_void,
                c.recv.as_ptr(),
                c.recv_at.as_ptr(),
                ffi::RSMPI_DOUBLE,
                self.comm.comm,
                &mut request,
            )
        };
        self.finish_one(rc, request, "MPI_Iallgatherv (block values)", &|| {
            Step::Values.to_string()
        })?;
        Ok(&self.work.all)
    }
}

/// This handle's collective in progress (and, below MPI_THREAD_MULTIPLE, the process's), and
/// the communicator's memory: the guards are held while it runs.
struct Entered<'a>(
    #[allow(dead_code)] BusyGuard<'a>,
    #[allow(dead_code)] Option<Serial>,
    MutexGuard<'a, Memory>,
);

impl Drop for MpiComm {
    /// Frees the duplicate, unless a timeout or an abort left requests pending on it that have
    /// not completed since: then the MPI communicator and the memory those requests name are
    /// leaked, because a late peer may still make MPI write into that memory, and freeing the
    /// communicator under pending requests is not something to rely on (MPI lets the free
    /// return before they complete; Open MPI would then run them on a released communicator).
    fn drop(&mut self) {
        // After MPI_Finalize (the caller's, or ours at exit) every communicator is gone already,
        // and MPI touches no memory.
        if flag(ffi::MPI_Finalized) {
            return;
        }
        let timeout = self.timeout();
        let mem = self.mem.get_mut();
        // Below MPI_THREAD_MULTIPLE, MPI is called only under `SERIAL`, polled like a collective
        // polls it. Past this communicator's timeout the communicator (and, with requests pending,
        // their memory) is leaked instead of freed. With no timeout, this waits as long as the
        // other communicator's collective holds the lock, which its own timeout or abort bounds:
        // a destroy cannot fail, and freeing the communicator needs an MPI call.
        let mut backoff = Backoff::new();
        let _serial = loop {
            if !self.serialize {
                break None;
            }
            if let Some(guard) = SERIAL.try_lock() {
                break Some(guard);
            }
            if timeout.is_some_and(|t| backoff.waited() >= t) {
                if !mem.abandoned.is_empty() {
                    std::mem::forget(std::mem::take(mem));
                }
                return;
            }
            backoff.pause();
        };
        if !mem.abandoned.is_empty() {
            let mut done: c_int = 0;
            // SAFETY: the requests were posted on this communicator and never completed nor freed
            // (a wait that abandons them returns at once); MPI is not finalised (checked above),
            // and `&mut self` excludes any other use of them.
            let rc = unsafe {
                ffi::MPI_Testall(
                    mem.abandoned.len() as c_int,
                    mem.abandoned.as_mut_ptr(),
                    &mut done,
                    ffi::RSMPI_STATUSES_IGNORE,
                )
            };
            if rc != ffi::MPI_SUCCESS as c_int || done == 0 {
                // Still pending: leak what they may still use, and the communicator.
                std::mem::forget(std::mem::take(mem));
                return;
            }
        }
        // SAFETY: `self.comm` is the duplicate `adopt` made, freed only here, once; MPI is not
        // finalised (checked above), and no request is pending on it: every collective waits for
        // its own, and those it abandoned completed (just checked); `&mut self` excludes a
        // running one.
        unsafe { ffi::MPI_Comm_free(&mut self.comm) };
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn collectives(&self) -> Collectives<'_> {
        Collectives::Host(self)
    }

    /// Sets the flag a wait in progress polls (it then fails with COMM_FAILURE) and every later
    /// collective checks. MPI is not called, nor aborted: the other ranks learn of it only at a
    /// barrier in shared memory (whose abort word this raises); in an MPI collective they time
    /// out unless they abort too.
    fn abort(&self) -> Result<()> {
        self.set_aborted(String::new());
        Ok(())
    }

    fn timeout(&self) -> Option<Duration> {
        Some(self.timeout_ns.load(Ordering::Relaxed))
            .filter(|&ns| ns != FOREVER)
            .map(Duration::from_nanos)
    }

    fn set_timeout(&self, timeout: Option<Duration>) -> Result<()> {
        let ns = timeout.map_or(FOREVER, |t| t.as_nanos().clamp(1, FOREVER as u128 - 1) as u64);
        self.timeout_ns.store(ns, Ordering::Relaxed);
        Ok(())
    }
}

impl HostCollectives for MpiComm {
    /// Two small non-blocking all-reduces in flight together: SUM and MAX of the packed words,
    /// in the communicator's [`ControlWords`].
    fn reduce_control(&self, mine: &ControlSum) -> Result<ControlSum> {
        let mut entered = self.enter()?;
        let mem = &mut *entered.2;
        let words = &mut *mem.control;
        (words.sum_in, words.max_in) = packing::pack(mine);
        // SAFETY: reads rsmpi's extern constant for MPI_REQUEST_NULL, set at load, never written.
        let mut requests = [unsafe { ffi::RSMPI_REQUEST_NULL }; 2];
        // SAFETY: each count is the length of the u64 arrays it goes with (SUM_WORDS, MAX_WORDS);
        // the arrays are the communicator's heap `ControlWords`, untouched until `wait` completes
        // every request posted, and kept alive for good if it (or a failed second post) abandons
        // them (see `Memory`).
        let rc = unsafe {
            ffi::MPI_Iallreduce(
                words.sum_in.as_ptr() as *const c_void,
                words.sum.as_mut_ptr() as *mut c_void,
                packing::SUM_WORDS as c_int,
                ffi::RSMPI_UINT64_T,
                ffi::RSMPI_SUM,
                self.comm,
                &mut requests[0],
            )
        };
        check(rc, "MPI_Iallreduce (control, SUM)").map_err(|e| self.post_failed(e))?;
        // SAFETY: as for the first.
        let rc = unsafe {
            ffi::MPI_Iallreduce(
                words.max_in.as_ptr() as *const c_void,
                words.max.as_mut_ptr() as *mut c_void,
                packing::MAX_WORDS as c_int,
                ffi::RSMPI_UINT64_T,
                ffi::RSMPI_MAX,
                self.comm,
                &mut requests[1],
            )
        };
        if let Err(e) = check(rc, "MPI_Iallreduce (control, MAX)") {
            // The SUM is posted: keep its request and memory, and abort.
            let e = self.post_failed(e);
            self.abandon(&requests, &mut mem.abandoned, &e.message);
            return Err(e);
        }
        self.wait(&mut requests, &mut mem.abandoned, &|| "control exchange".to_string())?;
        Ok(packing::unpack(&words.sum, &words.max))
    }

    /// MPI_Iallreduce in place, in pieces of [`SUM_PIECE`] elements, each copied into the
    /// communicator's piece buffer, reduced there and copied back once its request completed, so
    /// a request abandoned by a timeout or an abort never touches `buf`.
    fn allreduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let mut entered = self.enter()?;
        let mem = &mut *entered.2;
        let most = SUM_PIECE.min(buf.len());
        if mem.piece.len() < most {
            mem.piece.resize(most, 0.0);
        }
        let pieces = buf.len().div_ceil(SUM_PIECE);
        for (k, part) in buf.chunks_mut(SUM_PIECE).enumerate() {
            let piece = &mut mem.piece[..part.len()];
            piece.copy_from_slice(part);
            // SAFETY: reads rsmpi's extern constant for MPI_REQUEST_NULL, set at load, never
            // written.
            let mut request = unsafe { ffi::RSMPI_REQUEST_NULL };
            // SAFETY: `piece` is the communicator's piece buffer, of at most SUM_PIECE (2^20)
            // elements, so its length fits a C int; with MPI_IN_PLACE MPI reads and writes only
            // `piece`, which is untouched until `wait` completes the request and kept alive for
            // good if it abandons it (see `Memory`).
            let rc = unsafe {
                ffi::MPI_Iallreduce(
                    gradacc_internal_mpi_in_place(),
                    piece.as_mut_ptr() as *mut c_void,
                    piece.len() as c_int,
                    ffi::RSMPI_FLOAT,
                    ffi::RSMPI_SUM,
                    self.comm,
                    &mut request,
                )
            };
            check(rc, "MPI_Iallreduce").map_err(|e| self.post_failed(e))?;
            self.wait(std::slice::from_mut(&mut request), &mut mem.abandoned, &|| {
                format!("all-reduce, piece {} of {pieces}", k + 1)
            })?;
            part.copy_from_slice(piece);
        }
        Ok(())
    }

    /// The reduction in shares (see `shares`). Buckets do not change its result, so it cuts the
    /// buffer into its own chunks and the buckets are only checked.
    fn allreduce_with_pass(
        &self,
        buf: &mut [f32],
        buckets: &[Range<usize>],
        pass: &dyn BlockPass,
    ) -> Result<Vec<f64>> {
        check_buckets(buf.len(), buckets)?;
        self.in_shares(|t| shares::reduce_in_shares(t, buf, shares::SHARE_NUMEL, pass))
    }

    /// The reduction in shares by shards: each rank exchanges only its copies of the others'
    /// shards and sums its own, and nothing is gathered: half an all-reduce's traffic.
    fn reduce_scatter_with_pass(
        &self,
        buf: &mut [f32],
        shards: &[Range<usize>],
        pass: &dyn BlockPass,
    ) -> Result<Vec<f64>> {
        check_shards(buf.len(), shards, self.world)?;
        self.in_shares(|t| {
            let cut =
                shares::ShardCut { shards, piece_numel: shares::SHARE_NUMEL.min(t.piece_limit()) };
            shares::reduce_by_cut(t, buf, &cut, false, pass)
        })
    }

    /// MPI_Iallgatherv of doubles, through the communicator's workspace.
    fn allgather_values(&self, mine: &[f64], counts: &[usize]) -> Result<Vec<f64>> {
        check_counts(mine.len(), counts, self.rank, self.world)?;
        let mut entered = self.enter()?;
        let mem = &mut *entered.2;
        let mut t = Shares::new(self, &mut mem.counts, &mut mem.work, &mut mem.abandoned);
        let result = t.gather_values(mine, counts).map(<[f64]>::to_vec);
        t.settle(result)
    }
}
