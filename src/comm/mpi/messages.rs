//! The reduction in shares as MPI messages: each exchange one MPI_Ialltoallv, each gather one
//! MPI_Iallgatherv, through the communicator's own memory, never the caller's.

use std::ffi::{c_int, c_void};
use std::ops::Range;

use mpi::ffi;

use super::init::check;
use super::{gradacc_internal_mpi_in_place, Counts, MpiComm};
use crate::comm::shares::{self, ShareTransport, Step, Workspace};
use crate::error::{Error, Result};

/// An MPI count or displacement; larger ones fail instead of wrapping.
fn count(n: usize, what: &str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        Error::invalid(format!("{what} of {n} elements exceeds what one MPI call takes"))
    })
}

/// The reduction in shares over MPI, on a communicator whose collective is already entered:
/// counts and displacements go to the communicator's [`Counts`], data to its [`Workspace`],
/// abandoned requests to its list.
pub(super) struct Shares<'a> {
    comm: &'a MpiComm,
    counts: &'a mut Counts,
    work: &'a mut Workspace,
    abandoned: &'a mut Vec<ffi::MPI_Request>,
    /// Where each other rank's copy of this rank's piece lies in the scratch (words), and the
    /// last gather's ranges.
    slots: Vec<Range<usize>>,
    packed: Vec<Range<usize>>,
    /// Whether a collective was posted: a failure from then on aborts the communicator.
    pub(super) posted: bool,
}

impl<'a> Shares<'a> {
    pub(super) fn new(
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
    pub(super) fn settle<T>(&self, result: Result<T>) -> Result<T> {
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
