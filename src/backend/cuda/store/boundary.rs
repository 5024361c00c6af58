//! The whole master's boundary on the device: the control words and the buckets not reduced
//! early, normalised, measured and clipped in [`norm_and_clip`] (which a shard's boundary runs
//! too), and the layout checks every rank runs once per communicator before its collectives.

use std::ops::Range;

use super::{
    agreed_totals, nccl, pack_control, reduce_control, reduce_to_owners, DeviceStore, Split, Whole,
    NORM_BLOCKS_PER_CTA,
};
use crate::accumulator::protocol::Step;
use crate::accumulator::sharding::{intersect, relative};
use crate::accumulator::{Agreed, Plan, Proposal, Sharding};
use crate::backend::cuda::driver::{launch_args, CUdeviceptr, CUstream, Context, THREADS};
use crate::backend::cuda::kernels::Kernels;
use crate::backend::cuda::nccl::NcclComm;
use crate::comm::ControlSum;
use crate::error::{Error, Result};
use crate::math::NORM_BLOCK;

/// What the boundary's norm pass runs over: `n` elements at `data`, starting at block
/// `first_block` of the layout (their block sums go there in the partials); with `gather`, every
/// rank's that many block sums are then all-gathered over the communicator.
pub(in crate::backend::cuda) struct NormSpan<'a> {
    pub data: CUdeviceptr,
    pub n: u64,
    pub first_block: usize,
    pub gather: Option<(&'a NcclComm, usize)>,
    /// Enqueued once the span is normalised (without clipping) and before it is clipped: what
    /// measures the values the norm's pass leaves (`tensor_stats`).
    pub measure: Option<&'a dyn Fn() -> Result<()>>,
}

/// Normalise, norm and clip on the device, from the reduced control words in `boundary`: the
/// span's blocks are scaled (without clipping) and measured into `partials`, gathered from every
/// rank when the span is a shard, folded into the norm, and scaled by the clipping factor.
///
/// # Safety
/// `boundary` holds a ga_boundary; `partials` holds a block sum for every block of the layout
/// (and of every rank's padded shard); the span's `n` elements at `data` are device memory of
/// the stream's context.
#[allow(clippy::too_many_arguments)]
pub(in crate::backend::cuda) unsafe fn norm_and_clip(
    ctx: &Context,
    kernels: &Kernels,
    stream: CUstream,
    plan: &Plan,
    boundary: CUdeviceptr,
    partials: CUdeviceptr,
    span: NormSpan<'_>,
) -> Result<()> {
    let NormSpan { data, n, first_block, gather, measure } = span;
    let num_blocks = plan.layout.len().div_ceil(NORM_BLOCK) as u64;
    // The span starts on a block boundary, so its blocks (and their sums) are the layout's, in
    // the same places.
    let own_partials = partials + 8 * first_block as u64;
    let max_norm = plan.config.max_grad_norm as f64;
    let normalize_code = plan.config.normalize.code();
    // Without clipping the normalisation is applied with the norm pass; with clipping the norm
    // decides the factor, so a second pass applies it.
    let normalize_now: i32 = (max_norm == 0.0) as i32;
    // SAFETY: each launch's arguments follow its kernel's signature in kernels.cu, over the
    // buffers of the caller's contract. An empty span launches nothing on it.
    unsafe {
        let mut args = launch_args!(boundary, normalize_code);
        kernels.begin_boundary.launch(ctx, 1, 1, stream, &mut args)?;
        if n > 0 {
            let mut args = launch_args!(data, n, boundary, normalize_now, own_partials);
            let grid = ctx.grid_for(n.div_ceil(NORM_BLOCK as u64).div_ceil(NORM_BLOCKS_PER_CTA));
            kernels.scale_sum_squares.launch(ctx, grid, THREADS, stream, &mut args)?;
        }
    }
    measure.map_or(Ok(()), |m| m())?;
    if let Some((c, blocks)) = gather {
        c.allgather_f64(partials, blocks, stream)?;
    }
    // SAFETY: as above.
    unsafe {
        let mut args = launch_args!(boundary, partials, num_blocks, max_norm);
        kernels.finish_norm.launch(ctx, 1, THREADS, stream, &mut args)?;
        if max_norm != 0.0 && n > 0 {
            let mut args = launch_args!(data, n, boundary);
            kernels.scale_by.launch_over(ctx, stream, n.div_ceil(THREADS as u64), &mut args)?;
        }
    }
    Ok(())
}

impl DeviceStore {
    /// The boundary's device work: the control words (the agreed `totals`' counts where the host
    /// knows them) and the buckets not reduced early, then normalise, norm and clip.
    pub(super) fn enqueue_boundary(
        &self,
        w: &Whole,
        p: &Proposal<'_>,
        totals: Option<&ControlSum>,
    ) -> Result<()> {
        let overlap = w.overlap().take();
        if overlap.is_some() {
            self.join_comm_stream()?;
        }
        pack_control(self, p, totals)?;
        // Also at world size 1: NCCL then copies in place, and the path is the one every rank
        // takes.
        let comm = p.comm.map(nccl).transpose()?;
        if let Some(c) = comm.filter(|c| self.bf16(c).is_some()) {
            // The wire's kernels run between its collectives: no NCCL group around them. Bucket
            // by bucket (sharded, each bucket's pieces to their owners), which bounds its staging.
            reduce_control(self, c, self.stream)?;
            let buckets = self.plan.layout.buckets();
            let left = overlap.as_ref().map_or(buckets.len(), |o| o.schedule.waiting());
            buckets[..left].iter().try_for_each(|b| self.reduce_bucket(w, c, b, self.stream))?;
        } else if let Some(c) = comm {
            let buckets = self.plan.layout.buckets();
            c.group(|| {
                reduce_control(self, c, self.stream)?;
                match (&w.split, &overlap) {
                    (Some(s), None) => self.reduce_shards(w, c, s),
                    // The buckets the final micro-batch did not reduce early.
                    (_, o) => buckets[..o.as_ref().map_or(buckets.len(), |o| o.schedule.waiting())]
                        .iter()
                        .try_for_each(|b| self.reduce_bucket(w, c, b, self.stream)),
                }
            })?;
        }
        // A hybrid boundary: the counts, and the shard the shard group just reduced, are summed
        // over the replicas (FP32 sums, as on the CPU) before the norm.
        if let Some(r) = p.replicas.map(nccl).transpose()? {
            let own = w.split.as_ref().map_or(0..self.plan.layout.len(), Split::own);
            // The wire is the first reduction's between ranks: the replicas', after a shard group
            // of one (whose shard is the whole master, bucket by bucket).
            if let Some(wire) = self.bf16(r).filter(|_| comm.is_none_or(|c| c.world_size() == 1)) {
                reduce_control(self, r, self.stream)?;
                for b in self.plan.layout.buckets() {
                    let piece = intersect(b, &own);
                    if !piece.is_empty() {
                        wire.allreduce(r, w.at(piece.start), piece.len(), self.stream)?;
                    }
                }
                return self.finish_boundary(w, comm);
            }
            // Every replica holds the same shard: an empty one is skipped by all of them (its
            // address may be one past a caller's master).
            r.group(|| {
                reduce_control(self, r, self.stream)?;
                if own.is_empty() {
                    return Ok(());
                }
                r.allreduce_sum_f32(w.at(own.start), own.len(), self.stream)
            })?;
        }
        self.finish_boundary(w, comm)
    }

    /// Enqueues bucket `b`'s reduction on `stream`: an in-place all-reduce; sharded, each of its
    /// pieces (a bucket may span shards) summed into the rank whose shard holds it. On the BF16
    /// wire the same, through [`Wire`](crate::backend::cuda::wire::Wire) (never inside an NCCL group: its kernels run between).
    pub(super) fn reduce_bucket(
        &self,
        w: &Whole,
        c: &NcclComm,
        b: &Range<usize>,
        stream: CUstream,
    ) -> Result<()> {
        if let Some(wire) = self.bf16(c) {
            let data = w.at(b.start);
            let Some(s) = &w.split else { return wire.allreduce(c, data, b.len(), stream) };
            let pieces: Vec<Range<usize>> =
                s.shards.iter().map(|r| relative(&intersect(r, b), b.start)).collect();
            return wire.reduce_to_owners(
                c,
                data,
                &pieces,
                data + 4 * pieces[s.rank].start as u64,
                stream,
            );
        }
        let Some(s) = &w.split else {
            return c.allreduce_sum_f32(w.at(b.start), b.len(), stream);
        };
        reduce_to_owners(c, b, &s.shards, |at| w.at(at), stream)
    }

    /// Enqueues the reduce-scatter of the whole master on the accumulator's stream: in place over
    /// the padded master, or shard by shard into each owner.
    pub(super) fn reduce_shards(&self, w: &Whole, c: &NcclComm, s: &Split) -> Result<()> {
        if s.padded {
            return c.reduce_scatter_sum_f32(w.master.ptr(), s.size, self.stream);
        }
        for (owner, shard) in s.shards.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            c.reduce_sum_f32(w.at(shard.start), shard.len(), owner, self.stream)?;
        }
        Ok(())
    }

    /// Normalise, norm and clip, on the device, from the reduced control words: over the whole
    /// master, or sharded over this rank's shard, with the block sums of every shard gathered
    /// from the ranks before the norm.
    pub(super) fn finish_boundary(&self, w: &Whole, comm: Option<&NcclComm>) -> Result<()> {
        let own = w.split.as_ref().map_or(0..self.plan.layout.len(), Split::own);
        let gather = w.split.as_ref().zip(comm).map(|(s, c)| (c, s.size / NORM_BLOCK));
        let slot = w.split.as_ref().map_or(0, |s| s.rank);
        let measure =
            || self.measure_segments(w.at(own.start), own.clone(), slot, gather.map(|g| g.0));
        let span = NormSpan {
            data: w.at(own.start),
            n: own.len() as u64,
            first_block: own.start / NORM_BLOCK,
            gather,
            measure: self.stats.as_ref().map(|_| &measure as &dyn Fn() -> Result<()>),
        };
        // SAFETY: the master holds the range `own`, and `boundary` and `partials` were sized for
        // this layout (and its shards, padded) at creation.
        unsafe {
            norm_and_clip(
                &self.ctx,
                &self.kernels,
                self.stream,
                &self.plan,
                self.boundary.ptr(),
                self.partials.ptr(),
                span,
            )
        }
    }

    /// Once per pair of groups: the layout check of a hybrid boundary over the shard group and
    /// the replicas ([`protocol::agree`](crate::accumulator::protocol::agree)); a shard that does not fit the shard group fails it.
    pub(super) fn verify_grid(
        &self,
        w: &Whole,
        comm: &NcclComm,
        replicas: &NcclComm,
        error: Option<&Error>,
    ) -> Result<()> {
        let misfit = self.shard_misfit(comm);
        let shard = w.split.as_ref().map_or(0, |s| s.rank);
        let checked =
            self.check_grid_once(Some(comm), replicas, shard, error.or(misfit.as_ref()))?;
        match error {
            Some(e) if !checked => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// Once per communicator: every rank checks that all ranks have the same layout (a blocking
    /// exchange of the element count and the layout hash, with their complements, by MAX), so a
    /// mismatch fails on every rank instead of corrupting memory inside NCCL. A sharded rank
    /// whose shard is not its rank's on `comm` fails it too, and the others with it.
    pub(super) fn verify_layout(&self, comm: &NcclComm) -> Result<()> {
        let misfit = self.shard_misfit(comm);
        self.check_layout_once(comm, Step::Boundary, misfit.as_ref()).map(drop)
    }

    /// The layout check at `step` over `comm` (a blocking exchange, [`Claims::agree`](super::Claims::agree)), this
    /// rank's claim flagged with `own`, once per communicator; `Ok(false)` when `comm` was
    /// checked before, and nothing ran.
    pub(in crate::backend::cuda) fn check_layout_once(
        &self,
        comm: &NcclComm,
        step: Step,
        own: Option<&Error>,
    ) -> Result<bool> {
        let mut verified = self.verified.lock();
        if verified.contains(&comm.id()) {
            return Ok(false);
        }
        self.claims.agree(step, &self.plan, Some(comm), None, own)?;
        verified.push(comm.id());
        Ok(true)
    }

    /// [`check_layout_once`](Self::check_layout_once) of a hybrid boundary, once per pair of
    /// shard group (none: a group of one) and replicas, the claim tagged with the `shard` this
    /// rank holds.
    pub(in crate::backend::cuda) fn check_grid_once(
        &self,
        comm: Option<&NcclComm>,
        replicas: &NcclComm,
        shard: usize,
        own: Option<&Error>,
    ) -> Result<bool> {
        let mut verified = self.verified_grids.lock();
        let pair = (comm.map_or(0, NcclComm::id), replicas.id());
        if verified.contains(&pair) {
            return Ok(false);
        }
        self.claims.agree(Step::Boundary, &self.plan, comm, Some((replicas, shard)), own)?;
        verified.push(pair);
        Ok(true)
    }

    /// Why this rank's shard cannot be reduced over `comm` (another size, or another rank), if so.
    pub(super) fn shard_misfit(&self, comm: &NcclComm) -> Option<Error> {
        let Sharding::ReduceScatter { shards, rank } = self.plan.config.sharding else {
            return None;
        };
        let (world, at) = (comm.world_size(), comm.rank());
        ((world, at) != (shards, rank))
            .then(|| Error::invalid(format!("the accumulator holds shard {rank} of {shards}, but the communicator is rank {at} of {world}")))
    }

    /// A call that fails here does not enter NCCL, so the other ranks wait, as in any NCCL
    /// program, until the communicator is aborted. The counts stay on the device, where the
    /// boundary reduces them with the buckets; alone, the host knows them already.
    pub(super) fn agree_whole(&self, w: &Whole, p: &Proposal<'_>) -> Result<Agreed> {
        let replicas = p.replicas.map(nccl).transpose()?;
        if let Some(e) = &p.error {
            // A shard that does not fit the communicator fails the layout check, the one exchange
            // every rank runs before the boundary's collectives: this rank takes part, so the
            // others fail with it instead of waiting for its collectives.
            if let Some(c) =
                p.comm.and_then(|c| nccl(c).ok()).filter(|c| self.shard_misfit(c).is_some())
            {
                let _ = match replicas {
                    Some(r) => self.verify_grid(w, c, r, Some(e)),
                    None => self.verify_layout(c),
                };
            } else if p.host_totals {
                self.refuse_control(w, p, e);
            }
            return Err(e.clone());
        }
        let comm = p.comm.map(nccl).transpose()?;
        {
            let overlap = w.overlap();
            match (comm, overlap.as_ref()) {
                (Some(c), Some(o)) if c.id() != nccl(&*o.comm)?.id() => {
                    return Err(Error::invalid(
                        "sync got another communicator than the final micro-batch's",
                    ));
                }
                (None, Some(_)) => {
                    return Err(Error::invalid(
                        "`comm` is NULL, but the final micro-batch was opened with a communicator",
                    ))
                }
                _ => {}
            }
        }
        match (comm, replicas) {
            (Some(c), Some(r)) => self.verify_grid(w, c, r, None)?,
            (Some(c), None) => self.verify_layout(c)?,
            _ => {}
        }
        Ok(Agreed { totals: agreed_totals(self, p, comm, replicas)? })
    }

    /// A rank whose call is invalid in a step whose peers sum the control words on the host (a
    /// mesh step) takes part: in the layout check with its error when its groups are new (the
    /// peers fail there), else in the control words' sum (the mesh's world agreement then fails
    /// them, naming this rank). Its window is intact either way.
    fn refuse_control(&self, w: &Whole, p: &Proposal<'_>, e: &Error) {
        let (Ok(comm), Ok(replicas)) =
            (p.comm.map(nccl).transpose(), p.replicas.map(nccl).transpose())
        else {
            return;
        };
        let shard = w.split.as_ref().map_or(0, |s| s.rank);
        let checked = match (comm, replicas) {
            (c, Some(r)) => self.check_grid_once(c, r, shard, Some(e)),
            (Some(c), None) => self.check_layout_once(c, Step::Boundary, Some(e)),
            (None, None) => Ok(false),
        };
        if matches!(checked, Ok(false)) {
            let _ = agreed_totals(self, p, comm, replicas);
        }
    }
}
