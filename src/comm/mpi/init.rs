//! MPI in the process: initialised by gradacc when the caller did not (and then finalised at
//! exit), and MPI's return codes turned into errors that name the call.

use std::ffi::{c_char, c_int, CStr};

use mpi::ffi;
use parking_lot::Mutex;

use crate::error::{Error, ErrorKind, Result};

extern "C" {
    fn atexit(f: extern "C" fn()) -> c_int;
}

/// Whether gradacc initialised MPI in this process (then it finalises it at exit).
static INIT: Mutex<bool> = Mutex::new(false);

/// MPI's own text for an error code.
pub(super) fn error_text(code: c_int) -> String {
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
pub(super) fn check(rc: c_int, what: &str) -> Result<()> {
    if rc == ffi::MPI_SUCCESS as c_int {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::CommFailure, format!("{what} failed: {}", error_text(rc))))
    }
}

pub(super) fn flag(f: unsafe extern "C" fn(*mut c_int) -> c_int) -> bool {
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
    if crate::comm::liveness::a_peer_ended() {
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
pub(super) fn ensure_initialized() -> Result<()> {
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
