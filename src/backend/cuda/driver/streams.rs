//! Streams as the host sees them: waiting for their work (with a timeout and a health check),
//! asking whether one captures a graph, and the streams gradacc owns.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;

use super::{CUstream, Context};
use crate::error::{Error, ErrorKind, Result};

/// Waits on the host for everything enqueued on `stream` so far.
pub fn synchronize(ctx: &Context, stream: CUstream) -> Result<()> {
    let _g = ctx.enter()?;
    // SAFETY: `_g` made `ctx` current; `stream` is a stream of it, as every caller passes the
    // stream its object was created on in that context.
    ctx.check(unsafe { (ctx.api.cuStreamSynchronize)(stream) }, "cuStreamSynchronize")
}

/// Waits on the host for everything enqueued on `stream` so far, like [`synchronize`], but fails
/// with TIMEOUT once `timeout` has passed, and with `healthy`'s error as soon as it reports one
/// (called between polls: a communicator's health, so a failed peer ends the wait). Sleeps
/// between polls, a little longer each time up to 1 ms, so a long wait costs no core.
pub fn wait_until_done(
    ctx: &Context,
    stream: CUstream,
    timeout: Option<Duration>,
    mut healthy: impl FnMut() -> Result<()>,
) -> Result<()> {
    const NOT_READY: u32 = 600;
    let start = Instant::now();
    let mut pause = Duration::from_micros(5);
    loop {
        let code = {
            let _g = ctx.enter()?;
            // SAFETY: `_g` made `ctx` current; `stream` is a stream of it (as for `synchronize`).
            unsafe { (ctx.api.cuStreamQuery)(stream) }
        };
        if code != NOT_READY {
            return ctx.check(code, "cuStreamQuery");
        }
        healthy()?;
        if let Some(t) = timeout.filter(|&t| start.elapsed() >= t) {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("the stream's work did not complete within {t:?}"),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(1));
    }
}

/// Whether `stream` is capturing a CUDA graph (an invalidated capture counts: its stream is still
/// in capture mode until the capture ends).
pub fn capturing(ctx: &Context, stream: CUstream) -> Result<bool> {
    let _g = ctx.enter()?;
    let mut status: c_int = 0;
    // SAFETY: `_g` made `ctx` current; `stream` is a stream of it (callers pass their objects'
    // streams); the driver writes one CUstreamCaptureStatus (an `int`) to `status`, a live local.
    let code = unsafe { (ctx.api.cuStreamIsCapturing)(stream, &mut status) };
    ctx.check(code, "cuStreamIsCapturing")?;
    Ok(status != 0)
}

/// A stream of gradacc's own, for communication that overlaps the caller's stream.
pub struct OwnedStream {
    ctx: Arc<Context>,
    pub stream: CUstream,
}

// SAFETY: the CUstream handle is accepted by the driver from any thread once its context is
// current; `drop` enters the context first.
unsafe impl Send for OwnedStream {}
// SAFETY: the handle never changes after `new`; shared use only copies it into driver calls,
// which are thread-safe.
unsafe impl Sync for OwnedStream {}

impl OwnedStream {
    pub fn new(ctx: &Arc<Context>) -> Result<Self> {
        let _g = ctx.enter()?;
        let mut stream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: `_g` made `ctx` current; CU_STREAM_NON_BLOCKING is a valid flag and `stream` is
        // a live out-pointer.
        ctx.check(unsafe { (ctx.api.cuStreamCreate)(&mut stream, flags) }, "cuStreamCreate")?;
        Ok(OwnedStream { ctx: ctx.clone(), stream })
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        if let Ok(_g) = self.ctx.enter() {
            // SAFETY: `self.stream` was created by cuStreamCreate in `new` and is destroyed only
            // here, once; the driver lets pending work complete before releasing it.
            unsafe { (self.ctx.api.cuStreamDestroy_v2)(self.stream) };
        }
    }
}
