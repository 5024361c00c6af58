//! How a collective waits: for the process's MPI lock below MPI_THREAD_MULTIPLE, and for its
//! requests, polling with a backoff until they complete, the timeout passes or the communicator
//! is aborted; what a wait gives up on is kept, and the communicator aborted.

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mpi::ffi;
use parking_lot::{Mutex, MutexGuard};

use super::init::error_text;
use super::{Entered, MpiComm};
use crate::comm::beacon::FarWatch;
use crate::comm::Communicator;
use crate::error::{Error, ErrorKind, Result};

/// Serialises gradacc's MPI calls when MPI runs below MPI_THREAD_MULTIPLE.
pub(super) static SERIAL: Mutex<()> = Mutex::new(());

thread_local! {
    /// This thread holds [`SERIAL`]: a collective it runs inside another one (the hybrid
    /// boundary's replica all-reduce, inside the shard group's reduce-scatter) is still one
    /// thread's MPI calls, one at a time, and must not wait for itself.
    static HOLDING_SERIAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// This thread's hold on [`SERIAL`]: the lock itself, or nothing for a collective nested in one
/// that holds it.
pub(super) struct Serial(#[allow(dead_code)] Option<MutexGuard<'static, ()>>);

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

/// The pauses of a polling wait: none for [`SPIN`], then sleeps from [`FIRST_PAUSE`] doubling
/// up to [`MAX_PAUSE`].
pub(super) struct Backoff {
    start: Instant,
    pause: Duration,
}

impl Backoff {
    pub(super) fn new() -> Backoff {
        Backoff { start: Instant::now(), pause: FIRST_PAUSE }
    }

    pub(super) fn waited(&self) -> Duration {
        self.start.elapsed()
    }

    pub(super) fn pause(&mut self) {
        if self.start.elapsed() < SPIN {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(self.pause);
            self.pause = (self.pause * 2).min(MAX_PAUSE);
        }
    }
}

impl MpiComm {
    pub(super) fn enter(&self) -> Result<Entered<'_>> {
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
    pub(super) fn post_failed(&self, mut e: Error) -> Error {
        e.message.push_str("; the communicator was aborted");
        self.set_aborted(format!(" after: {}", e.message));
        e
    }

    /// COMM_FAILURE once the communicator was aborted.
    pub(super) fn check_live(&self) -> Result<()> {
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
    pub(super) fn set_aborted(&self, reason: String) {
        let reason = {
            let mut r = lock(&self.reason);
            if r.is_none() {
                *r = Some(reason);
                // The ranks on other hosts stop within a round trip.
                if let Some(far) = &self.far {
                    far.aborted();
                }
            }
            r.clone().unwrap_or_default()
        };
        self.aborted.store(true, Ordering::Release);
        // The peers waiting in shared memory stop at once.
        if let Some(shared) = &self.shared {
            shared.region.abort();
        }
        if let Some(h) = &self.hierarchy {
            h.set_aborted(&reason);
        }
    }

    /// Waits until every request in `requests` completes: polls MPI_Testall, spinning for
    /// [`SPIN`] and then sleeping between polls ([`FIRST_PAUSE`] doubling up to [`MAX_PAUSE`]).
    /// Past the timeout it fails with TIMEOUT naming `phase`; once another thread aborted the
    /// communicator, with COMM_FAILURE. Either way, and on an MPI error, the requests still
    /// pending go to `abandoned` (their memory must stay alive) and the communicator is aborted.
    pub(super) fn wait(
        &self,
        requests: &mut [ffi::MPI_Request],
        abandoned: &mut Vec<ffi::MPI_Request>,
        phase: &dyn Fn() -> String,
    ) -> Result<()> {
        let timeout = self.timeout();
        let mut backoff = Backoff::new();
        let mut watch = self.peers.watch(backoff.start);
        let mut far = FarWatch::new(self.far.as_ref(), backoff.start);
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
            let now = Instant::now();
            if let Err(why) = watch.check(now).and_then(|()| far.check(now)) {
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
    pub(super) fn abandon(
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
