//! The MPI communicator (feature `mpi`): one rank of an MPI communicator, which gradacc duplicates
//! so its traffic never mixes with the caller's, and sets to return errors instead of aborting.
//! The boundary reduces in shares (see `shares`): per chunk one MPI_Alltoallv, this rank's sum
//! and pass, one MPI_Allgatherv. Each element is summed by one rank, in rank order, so every rank
//! gets the same bits by construction, and they are the in-process communicator's bits.
//!
//! `allreduce_buckets` posts buckets as non-blocking MPI_Iallreduce, several in flight at once; its
//! bitwise-identical results rest on MPI: the standard advises that MPI_Allreduce give "the same
//! result on all processes", and Open MPI's and MPICH's algorithms do (each element is combined by
//! one owner and broadcast, or in the same pairing order everywhere). The C tests compare the bits
//! of every reduced gradient across ranks.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use mpi::ffi;

use super::shares::{self, ShareTransport};
use super::{check_buckets, packing, BlockPass, Communicator, Control, ControlSum};
use crate::error::{Error, ErrorKind, Result};

extern "C" {
    /// MPI_IN_PLACE of the MPI this crate was built against (src/comm/mpi_shim.c).
    fn gradacc_internal_mpi_in_place() -> *mut c_void;
    fn atexit(f: extern "C" fn()) -> c_int;
}

/// The largest element count one MPI call takes (its count is a C int); larger buckets are split.
const MAX_COUNT: usize = 1 << 30;

/// Options of an MPI communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MpiConfig {
    /// Buckets whose MPI_Iallreduce may be in flight at once (at least 1; default 8).
    pub max_in_flight: usize,
}

impl Default for MpiConfig {
    fn default() -> Self {
        MpiConfig { max_in_flight: 8 }
    }
}

/// Whether gradacc initialised MPI in this process (then it finalises it at exit).
static INIT: Mutex<bool> = Mutex::new(false);

/// One rank of a duplicated MPI communicator.
pub struct MpiComm {
    comm: ffi::MPI_Comm,
    rank: usize,
    world: usize,
    config: MpiConfig,
    /// Set while this handle is inside a collective: a concurrent second use is refused, because
    /// two collectives racing on one communicator would pair up differently on different ranks.
    busy: AtomicBool,
}

// SAFETY: an MPI_Comm is a handle; MPI allows it to be used from any thread within the thread
// level MPI was initialised with, and `busy` keeps one handle to one collective at a time.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

/// MPI's own text for an error code.
fn error_text(code: c_int) -> String {
    let mut buf = vec![0 as c_char; 4096];
    let mut len: c_int = 0;
    // SAFETY: the buffer is larger than MPI_MAX_ERROR_STRING of any MPI (Open MPI 256, MPICH 1024).
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return format!("MPI error code {code}");
    }
    // SAFETY: MPI wrote a NUL-terminated string into the buffer.
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
    // SAFETY: MPI_Initialized and MPI_Finalized may be called at any time, from any thread.
    unsafe { f(&mut v) };
    v != 0
}

extern "C" fn finalize_at_exit() {
    if flag(ffi::MPI_Initialized) && !flag(ffi::MPI_Finalized) {
        // SAFETY: gradacc initialised MPI and nobody finalised it; the process is exiting.
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
    // SAFETY: MPI is neither initialised nor finalised; NULL argc/argv are allowed.
    let rc = unsafe { ffi::MPI_Init_thread(std::ptr::null_mut(), std::ptr::null_mut(), ffi::RSMPI_THREAD_MULTIPLE, &mut provided) };
    if rc != ffi::MPI_SUCCESS as c_int {
        return Err(Error::new(ErrorKind::BackendUnavailable, format!("MPI_Init_thread failed (code {rc})")));
    }
    if !*ours {
        *ours = true;
        // SAFETY: registering a plain extern "C" function.
        unsafe { atexit(finalize_at_exit) };
    }
    Ok(())
}

impl MpiComm {
    /// A communicator over MPI_COMM_WORLD (initialising MPI if nobody has).
    pub fn world(config: MpiConfig) -> Result<Self> {
        ensure_initialized()?;
        // SAFETY: MPI is initialised; MPI_COMM_WORLD is valid until it is finalised.
        Self::adopt(unsafe { ffi::RSMPI_COMM_WORLD }, config)
    }

    /// A communicator over the caller's communicator, given as its Fortran handle (the value of
    /// `MPI_Comm_c2f` in C, `comm.py2f()` in mpi4py, `comm.val` in MPI.jl). The caller's
    /// communicator is duplicated, never changed, and may be freed once this returns.
    pub fn from_fortran(handle: i64, config: MpiConfig) -> Result<Self> {
        let f = ffi::RSMPI_Fint::try_from(handle)
            .map_err(|_| Error::invalid(format!("Fortran communicator handle {handle} does not fit in an MPI_Fint")))?;
        ensure_initialized()?;
        // SAFETY: MPI is initialised; f2c of an unknown handle yields MPI_COMM_NULL (checked below)
        // or an invalid handle that the duplication rejects.
        let comm = unsafe { ffi::RSMPI_Comm_f2c(f) };
        if comm == unsafe { ffi::RSMPI_COMM_NULL } {
            return Err(Error::invalid(format!("Fortran communicator handle {handle} is MPI_COMM_NULL or unknown")));
        }
        Self::adopt(comm, config)
    }

    fn adopt(parent: ffi::MPI_Comm, config: MpiConfig) -> Result<Self> {
        if config.max_in_flight == 0 {
            return Err(Error::invalid("max_in_flight is 0: at least one bucket must be in flight"));
        }
        let mut inter: c_int = 0;
        // SAFETY: parent is a communicator handle; errors follow the caller's error handler.
        check(unsafe { ffi::MPI_Comm_test_inter(parent, &mut inter) }, "MPI_Comm_test_inter")?;
        if inter != 0 {
            // Collectives on an intercommunicator combine the other group's data, not this one's.
            return Err(Error::invalid("the communicator is an intercommunicator; gradacc needs an intracommunicator (one group of ranks)"));
        }
        // SAFETY: a zeroed handle is only a placeholder for the output of MPI_Comm_dup.
        let mut comm: ffi::MPI_Comm = unsafe { std::mem::zeroed() };
        // SAFETY: parent is a valid communicator; errors here follow the caller's error handler.
        check(unsafe { ffi::MPI_Comm_dup(parent, &mut comm) }, "MPI_Comm_dup")?;
        let mut this = MpiComm { comm, rank: 0, world: 0, config, busy: AtomicBool::new(false) };
        // From here on `this` frees the duplicate on every path.
        // SAFETY: `comm` is our own duplicate; the caller's communicator keeps its handler.
        check(unsafe { ffi::MPI_Comm_set_errhandler(this.comm, ffi::RSMPI_ERRORS_RETURN) }, "MPI_Comm_set_errhandler")?;
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: valid communicator and output pointers.
        check(unsafe { ffi::MPI_Comm_rank(this.comm, &mut rank) }, "MPI_Comm_rank")?;
        check(unsafe { ffi::MPI_Comm_size(this.comm, &mut size) }, "MPI_Comm_size")?;
        this.rank = rank as usize;
        this.world = size as usize;
        Ok(this)
    }

    pub fn config(&self) -> MpiConfig {
        self.config
    }

    fn enter(&self) -> Result<Busy<'_>> {
        if self.busy.swap(true, Ordering::Acquire) {
            return Err(Error::wrong_state(format!("MPI communicator rank {} is already inside a collective on another thread", self.rank)));
        }
        Ok(Busy(&self.busy))
    }

    /// Posts `pieces` (at most `max_in_flight` of them) and waits for all that were posted.
    fn reduce_pieces(&self, buf: &mut [f32], pieces: &[Range<usize>]) -> Result<()> {
        // SAFETY: the null request is a plain constant.
        let mut requests = vec![unsafe { ffi::RSMPI_REQUEST_NULL }; pieces.len()];
        if let [p] = pieces {
            // One piece gains nothing from being non-blocking, and the blocking all-reduce has
            // the implementation's tuned algorithms (Open MPI's non-blocking ones are generic).
            // SAFETY: the piece lies inside `buf` (checked by the caller).
            let rc = unsafe {
                ffi::MPI_Allreduce(
                    gradacc_internal_mpi_in_place(),
                    buf.as_mut_ptr().add(p.start) as *mut c_void,
                    p.len() as c_int,
                    ffi::RSMPI_FLOAT,
                    ffi::RSMPI_SUM,
                    self.comm,
                )
            };
            return check(rc, "MPI_Allreduce");
        }
        let mut posted = 0;
        let mut failure = Ok(());
        let base = buf.as_mut_ptr();
        for (p, req) in pieces.iter().zip(requests.iter_mut()) {
            // SAFETY: the piece lies inside `buf` (checked by the caller), pieces are disjoint, and
            // `buf` stays borrowed until the Waitall below has completed every posted request.
            let rc = unsafe {
                ffi::MPI_Iallreduce(
                    gradacc_internal_mpi_in_place(),
                    base.add(p.start) as *mut c_void,
                    p.len() as c_int,
                    ffi::RSMPI_FLOAT,
                    ffi::RSMPI_SUM,
                    self.comm,
                    req,
                )
            };
            if let Err(e) = check(rc, "MPI_Iallreduce") {
                failure = Err(e);
                break;
            }
            posted += 1;
        }
        // SAFETY: the first `posted` requests are live; the rest are never passed to MPI.
        let waited = check(unsafe { ffi::MPI_Waitall(posted as c_int, requests.as_mut_ptr(), ffi::RSMPI_STATUSES_IGNORE) }, "MPI_Waitall");
        failure.and(waited)
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
        // SAFETY: every range lies inside its buffer (the plan's shares of this chunk, slots of
        // `scratch`), the buffers do not overlap, and the call is blocking.
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
        // SAFETY: the shares lie inside the chunk; in place, each rank's share is read from its
        // own place in `chunk` (MPI_IN_PLACE), and the call is blocking.
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
        // SAFETY: `mine` holds this rank's count, `all` the sum of the counts; blocking call.
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

struct Busy<'a>(&'a AtomicBool);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // After MPI_Finalize (the caller's, or ours at exit) every communicator is gone already.
        if !flag(ffi::MPI_Finalized) {
            // SAFETY: our own duplicate, no request of ours in flight (collectives wait for theirs).
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

    /// Two small non-blocking all-reduces in flight together: SUM and MAX of the packed words.
    fn reduce_control(&self, mine: &Control) -> Result<ControlSum> {
        let _busy = self.enter()?;
        let (sum_in, max_in) = packing::pack(mine);
        let mut sum = [0u64; packing::SUM_WORDS];
        let mut max = [0u64; packing::MAX_WORDS];
        // SAFETY: the null request is a plain constant.
        let mut requests = [unsafe { ffi::RSMPI_REQUEST_NULL }; 2];
        // SAFETY: the arrays outlive the Waitall below; counts match their lengths.
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

    fn allreduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        #[allow(clippy::single_range_in_vec_init)] // one bucket: the whole buffer
        let whole = [0..buf.len()];
        self.allreduce_buckets(buf, &whole)
    }

    /// Keeps up to `max_in_flight` buckets in flight: posts that many MPI_Iallreduce, waits for
    /// them all, then the next group. Buckets over 2^30 elements are split.
    fn allreduce_buckets(&self, buf: &mut [f32], buckets: &[Range<usize>]) -> Result<()> {
        check_buckets(buf.len(), buckets)?;
        let _busy = self.enter()?;
        let pieces: Vec<Range<usize>> = buckets
            .iter()
            .flat_map(|b| (b.start..b.end).step_by(MAX_COUNT).map(move |s| s..(s + MAX_COUNT).min(b.end)))
            .collect();
        for group in pieces.chunks(self.config.max_in_flight) {
            self.reduce_pieces(buf, group)?;
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
