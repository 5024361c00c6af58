//! Ordering between streams: events recorded on one and waited for on another (also across a
//! graph capture), and the edges both ways for a buffer one stream owns and others read.

use std::sync::Arc;

use cudarc::driver::sys;

use super::{capturing, CUstream, Context};
use crate::backend::cuda::driver_api;
use crate::error::Result;

/// An event used only for ordering (no timing), created in `ctx`.
pub struct Event {
    ctx: Arc<Context>,
    event: sys::CUevent,
}

// SAFETY: the only non-Send field is the CUevent handle, which the driver lets any thread record
// and wait on once its context is current (every method enters `ctx` first).
unsafe impl Send for Event {}
// SAFETY: the handle never changes after `new` and every method takes `&self`; the driver
// serialises cuEventRecord and cuStreamWaitEvent on one event internally.
unsafe impl Sync for Event {}

impl Event {
    pub fn new(ctx: &Arc<Context>) -> Result<Self> {
        let _g = ctx.enter()?;
        let mut event = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: `_g` made `ctx` current; CU_EVENT_DISABLE_TIMING is a valid flag and `event` is a
        // live out-pointer.
        ctx.check(unsafe { (ctx.api.cuEventCreate)(&mut event, flags) }, "cuEventCreate")?;
        Ok(Event { ctx: ctx.clone(), event })
    }

    /// Captures everything enqueued on `stream` so far.
    pub fn record(&self, stream: CUstream) -> Result<()> {
        let _g = self.ctx.enter()?;
        // SAFETY: `self.event` is live (created in `new`, destroyed only in `drop`) and belongs to
        // the context `_g` made current; `stream` is a stream of that context, as callers pass
        // their object's streams.
        self.ctx.check(unsafe { (self.ctx.api.cuEventRecord)(self.event, stream) }, "cuEventRecord")
    }

    /// Makes `stream` wait (on the device) for the work the last `record` captured.
    pub fn wait(&self, stream: CUstream) -> Result<()> {
        let _g = self.ctx.enter()?;
        // SAFETY: as in `record`: a live event of the current context and one of its streams;
        // flags 0 is the only value the driver defines.
        self.ctx.check(
            unsafe { (self.ctx.api.cuStreamWaitEvent)(stream, self.event, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// As [`Event::record`] on a stream that is not capturing a graph. On one that is (`capturing`),
    /// the record becomes a node of the graph (CU_EVENT_RECORD_EXTERNAL): every replay records the
    /// event, so a stream outside the graph can wait for the replay's work.
    pub fn record_across_capture(&self, stream: CUstream, capturing: bool) -> Result<()> {
        if !capturing {
            return self.record(stream);
        }
        let _g = self.ctx.enter()?;
        // SAFETY: as in `record`; CU_EVENT_RECORD_EXTERNAL is the flag for a capturing stream.
        self.ctx.check(
            unsafe {
                (self.ctx.api.cuEventRecordWithFlags)(
                    self.event,
                    stream,
                    driver_api::EVENT_RECORD_EXTERNAL,
                )
            },
            "cuEventRecordWithFlags",
        )
    }

    /// As [`Event::wait`] on a stream that is not capturing a graph. On one that is (`capturing`),
    /// the wait becomes a node of the graph (CU_EVENT_WAIT_EXTERNAL) that waits, at every replay,
    /// for the event's last record before the replay: a capture may not otherwise wait for work
    /// recorded outside it (CUDA_ERROR_STREAM_CAPTURE_ISOLATION).
    pub fn wait_across_capture(&self, stream: CUstream, capturing: bool) -> Result<()> {
        if !capturing {
            return self.wait(stream);
        }
        let _g = self.ctx.enter()?;
        // SAFETY: as in `wait`; CU_EVENT_WAIT_EXTERNAL is the flag for a capturing stream.
        self.ctx.check(
            unsafe {
                (self.ctx.api.cuStreamWaitEvent)(
                    stream,
                    self.event,
                    driver_api::EVENT_WAIT_EXTERNAL,
                )
            },
            "cuStreamWaitEvent",
        )
    }

    /// Makes `later` wait (on the device) for everything enqueued on `earlier` so far.
    /// No-op when they are the same stream.
    pub fn order(&self, earlier: CUstream, later: CUstream) -> Result<()> {
        if earlier == later {
            return Ok(());
        }
        self.record(earlier)?;
        self.wait(later)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_g) = self.ctx.enter() {
            // SAFETY: `self.event` was created by cuEventCreate in `new` and is destroyed only
            // here, once; the driver defers the release past work that still uses it.
            unsafe { (self.ctx.api.cuEventDestroy_v2)(self.event) };
        }
    }
}

/// A buffer owned by one stream and read by kernels on others: the happens-before edges both
/// ways. A reader stream waits for the owner's writes before it reads (only when a write was
/// enqueued since it last waited), and the owner waits for every read before it next writes or
/// frees the buffer. One event per reader stream, reused; one record per read.
///
/// Either side may be captured into a CUDA graph while the other is not (the caller captures its
/// step on one stream, and the other object's stream runs outside the graph): a capturing stream
/// records and waits through graph nodes (`Event::record_across_capture`, `wait_across_capture`),
/// and since replays then read or write behind the host's back, that side's events are waited for
/// at every later write or read, not only when the host saw one enqueued.
pub struct SharedReads {
    ctx: Arc<Context>,
    owner: CUstream,
    /// Recorded on the owner's stream after each write.
    written: Event,
    /// Writes enqueued so far (each followed by a record of `written`).
    writes: u64,
    /// A write was captured into a graph: every read waits for `written`.
    writes_replayed: bool,
    readers: Vec<Reader>,
}

struct Reader {
    stream: CUstream,
    /// Recorded on the reader's stream after each read.
    read: Event,
    /// A read was recorded that the owner has not waited for yet.
    pending: bool,
    /// A read was captured into a graph: every write waits for `read`.
    replayed: bool,
    /// The value of `writes` this stream last waited for.
    seen: u64,
}

// SAFETY: its only non-Send fields are CUstream handles, which it only passes to driver calls
// (through `Event`, itself Send) after entering the context; those calls work from any thread.
unsafe impl Send for SharedReads {}
// SAFETY: every method takes `&mut self`, so a `&SharedReads` shared across threads allows no
// access to the handles or counters at all.
unsafe impl Sync for SharedReads {}

impl SharedReads {
    pub fn new(ctx: &Arc<Context>, owner: CUstream) -> Result<Self> {
        Ok(SharedReads {
            ctx: ctx.clone(),
            owner,
            written: Event::new(ctx)?,
            writes: 0,
            writes_replayed: false,
            readers: Vec::new(),
        })
    }

    /// Before a read enqueued on `stream`: it waits for the owner's writes it has not seen. A
    /// capturing stream always waits: the graph's replays must wait for the writes before each.
    pub fn before_read(&mut self, stream: CUstream) -> Result<()> {
        if stream == self.owner {
            return Ok(());
        }
        let capturing = capturing(&self.ctx, stream)?;
        let writes = self.writes;
        let i = match self.readers.iter().position(|r| r.stream == stream) {
            Some(i) => i,
            None => {
                self.readers.push(Reader {
                    stream,
                    read: Event::new(&self.ctx)?,
                    pending: false,
                    replayed: false,
                    seen: 0,
                });
                self.readers.len() - 1
            }
        };
        if self.readers[i].seen != writes || capturing || self.writes_replayed {
            self.written.wait_across_capture(stream, capturing)?;
            self.readers[i].seen = writes;
        }
        Ok(())
    }

    /// After a read enqueued on `stream` (following `before_read`).
    pub fn after_read(&mut self, stream: CUstream) -> Result<()> {
        if stream == self.owner {
            return Ok(());
        }
        let capturing = capturing(&self.ctx, stream)?;
        if let Some(r) = self.readers.iter_mut().find(|r| r.stream == stream) {
            r.read.record_across_capture(stream, capturing)?;
            r.pending = true;
            r.replayed |= capturing;
        }
        Ok(())
    }

    /// Before the owner's stream writes or frees the buffer: it waits for every read. A capturing
    /// owner waits for every reader's last read: the graph's replays must wait for the reads
    /// before each.
    pub fn before_write(&mut self) -> Result<()> {
        if self.readers.is_empty() {
            return Ok(());
        }
        let capturing = capturing(&self.ctx, self.owner)?;
        for r in self.readers.iter_mut().filter(|r| r.pending || r.replayed || capturing) {
            r.read.wait_across_capture(self.owner, capturing)?;
            r.pending = false;
        }
        Ok(())
    }

    /// After a write enqueued on the owner's stream.
    pub fn after_write(&mut self) -> Result<()> {
        let capturing = capturing(&self.ctx, self.owner)?;
        self.written.record_across_capture(self.owner, capturing)?;
        self.writes += 1;
        self.writes_replayed |= capturing;
        Ok(())
    }
}
