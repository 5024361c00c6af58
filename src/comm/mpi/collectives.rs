//! The host collectives over MPI: the control reduction and the plain sum as MPI all-reduces,
//! the boundary's reduction in shares through shared memory or as messages.

use std::ffi::{c_int, c_void};
use std::ops::Range;

use mpi::ffi;

use super::init::check;
use super::messages::Shares;
use super::{gradacc_internal_mpi_in_place, MpiComm};
use crate::comm::shares::{self, ShareTransport};
use crate::comm::shm::Shm;
use crate::comm::{
    check_buckets, check_counts, check_shards, packing, BlockPass, Communicator, ControlSum,
    HostCollectives,
};
use crate::error::Result;

/// Elements `allreduce_sum` reduces per MPI call, through the communicator's piece buffer (4 MB).
const SUM_PIECE: usize = 1 << 20;

impl MpiComm {
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
}

impl MpiComm {
    /// Every rank's `shards[rank]` of `buf` to every other rank (an all-gather in place), over
    /// the reduction in shares' transport.
    pub(super) fn gather_shards(&self, buf: &mut [f32], shards: &[Range<usize>]) -> Result<()> {
        check_shards(buf.len(), shards, self.world)?;
        self.in_shares(|t| {
            let cut =
                shares::ShardCut { shards, piece_numel: shares::SHARE_NUMEL.min(t.piece_limit()) };
            shares::gather_by_cut(t, buf, &cut)
        })
    }
}

impl HostCollectives for MpiComm {
    /// Two small non-blocking all-reduces in flight together: SUM and MAX of the packed words,
    /// in the communicator's [`ControlWords`](super::ControlWords).
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
        if let Some(h) = &self.hierarchy {
            return self.reduce_by_hosts(h, buf, pass);
        }
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
