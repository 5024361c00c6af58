//! The MPI communicator (feature `mpi`): one rank of an MPI communicator, which gradacc duplicates
//! so its traffic never mixes with the caller's, and sets to return errors instead of aborting.
//! The boundary reduces in shares (see `shares`): per chunk one MPI_Alltoallv, this rank's sum
//! and pass, one MPI_Allgatherv. Each element is summed by one rank, in rank order, so every rank
//! gets the same bits by construction, and they are the in-process communicator's bits.
//!
//! `allreduce_sum` (the Rust API's plain sum, not the boundary) is MPI_Allreduce; its identical
//! bits on every rank rest on MPI, whose standard advises "the same result on all processes".
//!
//! An MPI initialised below MPI_THREAD_MULTIPLE (by the caller) gets every gradacc collective of
//! the process behind one lock, so two communicators used from two threads never call MPI at
//! once (enough for MPI_THREAD_SERIALIZED; with FUNNELED or SINGLE, call gradacc from the thread
//! that makes the program's MPI calls).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ops::Range;
use std::sync::{Mutex, MutexGuard};

use mpi::ffi;

use super::shares::{self, ShareTransport};
use super::{check_buckets, packing, BlockPass, Busy, BusyGuard, Collectives, Communicator, Control, ControlSum, HostCollectives};
use crate::error::{Error, ErrorKind, Result};

extern "C" {
    /// MPI_IN_PLACE of the MPI this crate was built against (src/comm/mpi_shim.c).
    fn gradacc_internal_mpi_in_place() -> *mut c_void;
    fn atexit(f: extern "C" fn()) -> c_int;
}

/// The largest element count one MPI call takes (its count is a C int); larger buckets are split.
const MAX_COUNT: usize = 1 << 30;

/// Whether gradacc initialised MPI in this process (then it finalises it at exit).
static INIT: Mutex<bool> = Mutex::new(false);

/// Serialises gradacc's MPI calls when MPI runs below MPI_THREAD_MULTIPLE.
static SERIAL: Mutex<()> = Mutex::new(());

/// One rank of a duplicated MPI communicator.
pub struct MpiComm {
    comm: ffi::MPI_Comm,
    rank: usize,
    world: usize,
    /// MPI was initialised below MPI_THREAD_MULTIPLE: collectives take [`SERIAL`].
    serialize: bool,
    busy: Busy,
}

// SAFETY: an MPI_Comm is a handle (an int in MPICH, a pointer in Open MPI) that MPI lets any
// thread pass: freely at MPI_THREAD_MULTIPLE, and below it one call at a time, which `serialize`
// enforces (`enter` takes `SERIAL`); the other fields are plain data.
unsafe impl Send for MpiComm {}
// SAFETY: every `&self` method that calls MPI goes through `enter` first, where `busy` refuses a
// second collective on the same handle and `SERIAL` orders all of them below MPI_THREAD_MULTIPLE;
// `rank`, `world` and `serialize` never change after `adopt`.
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

extern "C" fn finalize_at_exit() {
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
    let mut ours = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if flag(ffi::MPI_Finalized) {
        return Err(Error::new(ErrorKind::BackendUnavailable, "MPI was already finalised in this process"));
    }
    if flag(ffi::MPI_Initialized) {
        return Ok(());
    }
    let mut provided: c_int = 0;
    // SAFETY: MPI is neither initialised nor finalised (both checked above under `INIT`, which
    // keeps two gradacc threads from racing here); MPI allows NULL argc and argv, and `provided` is
    // a live int.
    let rc = unsafe { ffi::MPI_Init_thread(std::ptr::null_mut(), std::ptr::null_mut(), ffi::RSMPI_THREAD_MULTIPLE, &mut provided) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return Err(Error::new(ErrorKind::BackendUnavailable, format!("MPI_Init_thread failed (code {rc})")));
    }
    if !*ours {
        *ours = true;
        // SAFETY: `finalize_at_exit` is an `extern "C" fn()` that cannot unwind, as atexit requires;
        // `ours` makes this the only registration.
        unsafe { atexit(finalize_at_exit) };
    }
    Ok(())
}

impl MpiComm {
    /// A communicator over MPI_COMM_WORLD (initialising MPI if nobody has).
    pub fn world() -> Result<Self> {
        ensure_initialized()?;
        // SAFETY: reads rsmpi's extern constant for MPI_COMM_WORLD, set when the library loads and
        // never written; `ensure_initialized` just made the handle usable.
        Self::adopt(unsafe { ffi::RSMPI_COMM_WORLD })
    }

    /// A communicator over the caller's communicator, given as its Fortran handle (the value of
    /// `MPI_Comm_c2f` in C, `comm.py2f()` in mpi4py, `MPI.API.MPI_Comm_c2f(comm.val)` in MPI.jl). The caller's
    /// communicator is duplicated, never changed, and may be freed once this returns.
    pub fn from_fortran(handle: i64) -> Result<Self> {
        let f = ffi::RSMPI_Fint::try_from(handle)
            .map_err(|_| Error::invalid(format!("Fortran communicator handle {handle} does not fit in an MPI_Fint")))?;
        ensure_initialized()?;
        // SAFETY: `ensure_initialized` ran; MPI_Comm_f2c takes any integer and maps one it does not
        // know to MPI_COMM_NULL (checked below) or to a handle the duplication rejects.
        let comm = unsafe { ffi::RSMPI_Comm_f2c(f) };
        // SAFETY: reads rsmpi's extern constant for MPI_COMM_NULL, set at load and never written.
        if comm == unsafe { ffi::RSMPI_COMM_NULL } {
            return Err(Error::invalid(format!("Fortran communicator handle {handle} is MPI_COMM_NULL or unknown")));
        }
        Self::adopt(comm)
    }

    fn adopt(parent: ffi::MPI_Comm) -> Result<Self> {
        let mut level: c_int = 0;
        // SAFETY: both callers ran `ensure_initialized` first; MPI writes one int to `level`.
        check(unsafe { ffi::MPI_Query_thread(&mut level) }, "MPI_Query_thread")?;
        // SAFETY: reads rsmpi's extern constant for MPI_THREAD_MULTIPLE, set at load, never written.
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
        let mut this = MpiComm { comm, rank: 0, world: 0, serialize, busy: Busy::default() };
        // From here on `this` frees the duplicate on every path.
        // SAFETY: `this.comm` is the duplicate MPI_Comm_dup just made, ours alone, so changing its
        // handler leaves the caller's communicator as it was; ERRORS_RETURN is rsmpi's constant.
        check(unsafe { ffi::MPI_Comm_set_errhandler(this.comm, ffi::RSMPI_ERRORS_RETURN) }, "MPI_Comm_set_errhandler")?;
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: `this.comm` is the live duplicate made above; MPI writes one int to `rank`.
        check(unsafe { ffi::MPI_Comm_rank(this.comm, &mut rank) }, "MPI_Comm_rank")?;
        // SAFETY: as for MPI_Comm_rank; MPI writes one int to `size`.
        check(unsafe { ffi::MPI_Comm_size(this.comm, &mut size) }, "MPI_Comm_size")?;
        this.rank = rank as usize;
        this.world = size as usize;
        Ok(this)
    }

    fn enter(&self) -> Result<Entered<'_>> {
        let busy = self.busy.enter(|| format!("MPI communicator rank {}", self.rank))?;
        let serial = self.serialize.then(|| SERIAL.lock().unwrap_or_else(|e| e.into_inner()));
        Ok(Entered(busy, serial))
    }
}

/// An MPI count or displacement; larger ones fail instead of wrapping.
fn count(n: usize, what: &str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| Error::invalid(format!("{what} of {n} elements exceeds what one MPI call takes")))
}

/// The reduction in shares over MPI, on a communicator whose collective is already entered.
struct Shares<'a>(&'a MpiComm);

impl ShareTransport for Shares<'_> {
    fn rank(&self) -> usize {
        self.0.rank
    }

    fn world(&self) -> usize {
        self.0.world
    }

    fn exchange(&self, chunk: &[f32], shares: &[Range<usize>], scratch: &mut [f32], slots: &[Range<usize>]) -> Result<()> {
        let world = self.0.world;
        let (mut send_counts, mut send_at) = (vec![0 as c_int; world], vec![0 as c_int; world]);
        let (mut recv_counts, mut recv_at) = (vec![0 as c_int; world], vec![0 as c_int; world]);
        for q in (0..world).filter(|&q| q != self.0.rank) {
            send_counts[q] = count(shares[q].len(), "a share")?;
            send_at[q] = count(shares[q].start, "a share's offset")?;
            recv_counts[q] = count(slots[q].len(), "a share")?;
            recv_at[q] = count(slots[q].start, "a share's offset")?;
        }
        // SAFETY: `reduce_in_shares` cuts `shares` from this chunk and `slots` from `scratch`, so
        // every count and displacement stays inside its buffer; each array has `world` entries,
        // the communicator's size; `chunk` and `scratch` are distinct borrows, and the call
        // blocks until MPI is done with both.
        let rc = unsafe {
            ffi::MPI_Alltoallv(
                chunk.as_ptr() as *const c_void,
                send_counts.as_ptr(),
                send_at.as_ptr(),
                ffi::RSMPI_FLOAT,
                scratch.as_mut_ptr() as *mut c_void,
                recv_counts.as_ptr(),
                recv_at.as_ptr(),
                ffi::RSMPI_FLOAT,
                self.0.comm,
            )
        };
        check(rc, "MPI_Alltoallv")
    }

    fn gather(&self, chunk: &mut [f32], shares: &[Range<usize>]) -> Result<()> {
        let counts = shares.iter().map(|s| count(s.len(), "a share")).collect::<Result<Vec<_>>>()?;
        let at = shares.iter().map(|s| count(s.start, "a share's offset")).collect::<Result<Vec<_>>>()?;
        // SAFETY: `reduce_in_shares` cuts one share per rank (`world` entries) from this chunk, so
        // every count and displacement stays inside `chunk`; with MPI_IN_PLACE (the shim's value
        // for the linked MPI) the send arguments are ignored and this rank's share is read from
        // its place in `chunk`; the call blocks until MPI is done with it.
        let rc = unsafe {
            ffi::MPI_Allgatherv(
                gradacc_internal_mpi_in_place(),
                0,
                ffi::RSMPI_FLOAT,
                chunk.as_mut_ptr() as *mut c_void,
                counts.as_ptr(),
                at.as_ptr(),
                ffi::RSMPI_FLOAT,
                self.0.comm,
            )
        };
        check(rc, "MPI_Allgatherv")
    }

    fn gather_values(&self, mine: &[f64], counts: &[usize], all: &mut [f64]) -> Result<()> {
        let mut at = Vec::with_capacity(counts.len());
        let mut next = 0;
        for &n in counts {
            at.push(count(next, "the block values' offset")?);
            next += n;
        }
        let counts = counts.iter().map(|&n| count(n, "the block values")).collect::<Result<Vec<_>>>()?;
        // SAFETY: `mine` holds this rank's `counts[rank]` values and `reduce_in_shares` sizes `all`
        // to the sum of `counts`; the displacements are the running sums, so every rank's values
        // land inside `all`; `at` and `counts` have `world` entries; the call blocks.
        let rc = unsafe {
            ffi::MPI_Allgatherv(
                mine.as_ptr() as *const c_void,
                count(mine.len(), "the block values")?,
                ffi::RSMPI_DOUBLE,
                all.as_mut_ptr() as *mut c_void,
                counts.as_ptr(),
                at.as_ptr(),
                ffi::RSMPI_DOUBLE,
                self.0.comm,
            )
        };
        check(rc, "MPI_Allgatherv (block values)")
    }
}

/// This handle's collective in progress (and, below MPI_THREAD_MULTIPLE, the process's): held,
/// never read.
#[allow(dead_code)]
struct Entered<'a>(BusyGuard<'a>, Option<MutexGuard<'static, ()>>);

impl Drop for MpiComm {
    fn drop(&mut self) {
        // After MPI_Finalize (the caller's, or ours at exit) every communicator is gone already.
        if !flag(ffi::MPI_Finalized) {
            // SAFETY: `self.comm` is the duplicate `adopt` made, freed only here, once; MPI is not
            // finalised (checked above), and no request is in flight on it: every collective
            // waits for its own before returning, and `&mut self` excludes a running one.
            unsafe { ffi::MPI_Comm_free(&mut self.comm) };
        }
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
}

impl HostCollectives for MpiComm {
    /// Two small non-blocking all-reduces in flight together: SUM and MAX of the packed words.
    fn reduce_control(&self, mine: &Control) -> Result<ControlSum> {
        let _busy = self.enter()?;
        let (sum_in, max_in) = packing::pack(mine);
        let mut sum = [0u64; packing::SUM_WORDS];
        let mut max = [0u64; packing::MAX_WORDS];
        // SAFETY: reads rsmpi's extern constant for MPI_REQUEST_NULL, set at load, never written.
        let mut requests = [unsafe { ffi::RSMPI_REQUEST_NULL }; 2];
        // SAFETY: each count is the length of the local u64 arrays it goes with (SUM_WORDS,
        // MAX_WORDS), and those arrays and `requests` stay alive and untouched until MPI_Waitall
        // completes every request posted (one if the second post failed, none if the first did:
        // `?` returns before any is in flight).
        unsafe {
            check(
                ffi::MPI_Iallreduce(
                    sum_in.as_ptr() as *const c_void,
                    sum.as_mut_ptr() as *mut c_void,
                    packing::SUM_WORDS as c_int,
                    ffi::RSMPI_UINT64_T,
                    ffi::RSMPI_SUM,
                    self.comm,
                    &mut requests[0],
                ),
                "MPI_Iallreduce (control, SUM)",
            )?;
            let second = check(
                ffi::MPI_Iallreduce(
                    max_in.as_ptr() as *const c_void,
                    max.as_mut_ptr() as *mut c_void,
                    packing::MAX_WORDS as c_int,
                    ffi::RSMPI_UINT64_T,
                    ffi::RSMPI_MAX,
                    self.comm,
                    &mut requests[1],
                ),
                "MPI_Iallreduce (control, MAX)",
            );
            let posted = if second.is_ok() { 2 } else { 1 };
            let waited = check(ffi::MPI_Waitall(posted, requests.as_mut_ptr(), ffi::RSMPI_STATUSES_IGNORE), "MPI_Waitall (control)");
            second.and(waited)?;
        }
        Ok(packing::unpack(&sum, &max))
    }

    /// MPI_Allreduce in place, in pieces of at most 2^30 elements (an MPI count is a C int).
    fn allreduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let _busy = self.enter()?;
        for piece in buf.chunks_mut(MAX_COUNT) {
            // SAFETY: `piece` is a live `&mut` of at most MAX_COUNT (2^30) elements, so its length
            // fits a C int; with MPI_IN_PLACE MPI reads and writes only `piece`, before returning.
            let rc = unsafe {
                ffi::MPI_Allreduce(
                    gradacc_internal_mpi_in_place(),
                    piece.as_mut_ptr() as *mut c_void,
                    piece.len() as c_int,
                    ffi::RSMPI_FLOAT,
                    ffi::RSMPI_SUM,
                    self.comm,
                )
            };
            check(rc, "MPI_Allreduce")?;
        }
        Ok(())
    }

    /// The reduction in shares (see `shares`). Buckets do not change its result, so it cuts the
    /// buffer into its own chunks and the buckets are only checked.
    fn allreduce_with_pass(&self, buf: &mut [f32], buckets: &[Range<usize>], pass: &dyn BlockPass) -> Result<Vec<f64>> {
        check_buckets(buf.len(), buckets)?;
        let _busy = self.enter()?;
        shares::reduce_in_shares(&Shares(self), buf, shares::SHARE_NUMEL, pass)
    }
}
