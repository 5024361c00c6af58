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

mod collectives;
mod far;
mod hierarchy;
mod init;
mod messages;
mod shared_memory;
mod wait;

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mpi::ffi;
use parking_lot::{Mutex, MutexGuard};

use self::hierarchy::Hierarchy;
use self::init::{check, ensure_initialized, flag};
use self::wait::{Backoff, Serial, SERIAL};
use super::liveness::{Peers, Process};
use super::shares::Workspace;
use super::shm::{posix, Region};
use super::{packing, Busy, BusyGuard, Communicator, HostCollectives, DEFAULT_TIMEOUT};
use crate::error::{Error, Result};

extern "C" {
    /// MPI_IN_PLACE of the MPI this crate was built against (src/comm/mpi_shim.c).
    fn gradacc_internal_mpi_in_place() -> *mut c_void;
}

/// A timeout of `None` (wait forever), as stored.
const FOREVER: u64 = u64::MAX;

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
    /// The group's ranks on other hosts, which a wait looks at through the beacon (see `beacon`).
    far: Option<super::beacon::Far>,
    /// Rank 0 runs where this rank does, or either place is unknown: only then does this rank
    /// open the shared memory rank 0 offers (on another host, or another pid namespace, the
    /// offer's `/proc` path names some other process's file).
    near_root: bool,
    /// What it was created with, and its splits are.
    options: MpiOptions,
    /// The host's and the hosts' communicators, when the boundary reduces host by host (see
    /// `hierarchy`).
    hierarchy: Option<Box<Hierarchy>>,
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
        Self::adopt(unsafe { ffi::RSMPI_COMM_WORLD }, options, true)
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
        Self::adopt(comm, options, true)
    }

    /// Adopts a duplicate of `parent`; with `hierarchical`, sets up the hierarchy where it
    /// applies (the hierarchy's own communicators are flat).
    fn adopt(parent: ffi::MPI_Comm, options: MpiOptions, hierarchical: bool) -> Result<Self> {
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
            far: None,
            near_root: true,
            options,
            hierarchy: None,
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
        (this.peers, this.near_root, this.far) = this.same_host_peers()?;
        if options.shared_memory {
            this.shared = this.share_memory()?;
        }
        if hierarchical {
            this.hierarchy = this.hierarchy()?;
        }
        Ok(this)
    }

    /// Every rank's process (collective, at creation): the ones this rank watches, and whether
    /// rank 0 may share memory with it (see `near_root`).
    fn same_host_peers(&self) -> Result<(Peers, bool, Option<super::beacon::Far>)> {
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
        let (root, me) = (group[0].place, group[self.rank].place);
        let far = self.far_peers(&group)?;
        Ok((Peers::new(self.rank, &group), root == me || root == 0 || me == 0, far))
    }

    /// How many of the group's other ranks run on this host and are watched while waiting.
    pub fn watched_peers(&self) -> usize {
        self.peers.len()
    }

    /// Whether the boundary's data moves through shared memory.
    pub fn shares_memory(&self) -> bool {
        self.shared.is_some()
    }

    /// [`Communicator::split`]: MPI_Comm_split of this communicator, adopted with its options
    /// (and a hierarchy of its own where `hierarchical` and it applies).
    fn split_comm(&self, color: usize, key: usize, hierarchical: bool) -> Result<MpiComm> {
        let to_int = |v: usize, name: &str| {
            c_int::try_from(v)
                .map_err(|_| Error::invalid(format!("`{name}` = {v} does not fit in an MPI int")))
        };
        let (color, key) = (to_int(color, "color")?, to_int(key, "key")?);
        // Held until the new communicator is adopted: below MPI_THREAD_MULTIPLE that is MPI calls
        // too, which `SERIAL` orders.
        let _entered = self.enter()?;
        // SAFETY: as for the placeholder in `adopt`: MPI_Comm_split overwrites it before any use.
        let mut part: ffi::MPI_Comm = unsafe { std::mem::zeroed() };
        // SAFETY: `self.comm` is this communicator's live duplicate, used by one collective at a
        // time (`enter`); MPI writes the new handle to `part`, and with MPI_ERRORS_RETURN a
        // failure comes back as the return code.
        check(unsafe { ffi::MPI_Comm_split(self.comm, color, key, &mut part) }, "MPI_Comm_split")?;
        let adopted = Self::adopt(part, self.options, hierarchical);
        // SAFETY: `part` is the communicator MPI_Comm_split made, ours alone; `adopt` made its own
        // duplicate (or failed), and nothing else refers to it.
        unsafe { ffi::MPI_Comm_free(&mut part) };
        adopted
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

    fn host(&self) -> Option<&dyn HostCollectives> {
        Some(self)
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
        if let Some(h) = &self.hierarchy {
            h.set_timeout(ns);
        }
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        Ok(Arc::new(self.split_comm(color, key, true)?))
    }
}
