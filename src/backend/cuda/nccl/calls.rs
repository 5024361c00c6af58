//! How one NCCL call is made: NCCL's result codes as errors, each call serialised and refused
//! once the communicator failed, and an answer of ncclInProgress polled until it is enqueued.

use std::cell::Cell;
use std::ffi::{c_int, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cudarc::nccl::sys::ncclComm_t;

use super::api::{self, Api, IN_PROGRESS, SUCCESS};
use super::{lock, NcclComm};
use crate::error::{Error, ErrorKind, Result};

/// The NCCL entry points, or BACKEND_UNAVAILABLE naming every library tried and why each failed.
pub(super) fn nccl() -> Result<&'static Api> {
    api::get()
}

/// COMM_FAILURE for result `code` of `what`, with NCCL's text for it and `detail` (its last
/// error message); a code gradacc does not know is named by its number, never made an enum.
pub(super) fn nccl_error(api: &Api, code: c_int, what: &str, detail: &str) -> Error {
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
pub(super) fn last_error(api: &Api, comm: ncclComm_t) -> String {
    // SAFETY: see above; the result is a NUL-terminated string NCCL keeps, or null.
    let text = unsafe { (api.get_last_error)(comm) };
    if text.is_null() {
        return String::new();
    }
    // SAFETY: non-null, so a NUL-terminated string, copied at once.
    unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
}

/// Ok for ncclSuccess, otherwise the error; `comm` as for [`last_error`].
pub(super) fn check(api: &Api, code: c_int, what: &str, comm: ncclComm_t) -> Result<()> {
    if code == SUCCESS {
        Ok(())
    } else {
        Err(nccl_error(api, code, what, &last_error(api, comm)))
    }
}

/// Polls `state` (ncclCommGetAsyncError's answer) until it leaves ncclInProgress: Ok once it is
/// ncclSuccess, `error(code)` for an error, a timeout error after `timeout`. Sleeps between
/// polls, a little longer each time up to 1 ms, so a long wait costs no core.
pub(super) fn poll(
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
pub(super) fn thread_token() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static TOKEN: Cell<u64> = const { Cell::new(0) });
    TOKEN.with(|t| {
        if t.get() == 0 {
            t.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        t.get()
    })
}

impl NcclComm {
    /// Runs one NCCL call on the communicator, unless it was aborted or failed.
    pub(super) fn call<T>(&self, f: impl FnOnce(ncclComm_t) -> T) -> Result<T> {
        let _call = lock(&self.call);
        self.usable()?;
        let _g = self.ctx.enter()?;
        Ok(f(self.comm))
    }

    /// COMM_FAILURE for `code` of `what`, with NCCL's last message about this communicator.
    pub(super) fn error(&self, code: c_int, what: &str) -> Error {
        let detail = if self.in_own_group() {
            // This thread holds `call` for its group.
            last_error(self.api, self.comm)
        } else {
            self.call(|comm| last_error(self.api, comm)).unwrap_or_default()
        };
        nccl_error(self.api, code, what, &detail)
    }

    pub(super) fn usable(&self) -> Result<()> {
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
    pub(super) fn async_state(&self) -> Result<c_int> {
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
    pub(super) fn finish(&self, code: c_int, what: &str) -> Result<()> {
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
    pub(super) fn in_own_group(&self) -> bool {
        self.group_thread.load(Ordering::Relaxed) == thread_token()
    }
}
