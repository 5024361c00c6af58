//! The control words over NCCL: the claims each rank makes before a collective, packed,
//! all-reduced on the device and read back where the host must know them (the layout checks,
//! the close of a hook micro-batch), and the waits that end in a peer's failure rather than
//! forever.

use std::ops::Range;
use std::sync::Arc;

use crate::accumulator::protocol::{self, Channel, Step, CLAIM_WORDS};
use crate::accumulator::sharding::intersect;
use crate::accumulator::{Overflow, Plan, Proposal, SyncInfo};
use crate::backend::cuda::driver::{
    launch_args, synchronize, wait_until_done, CUdeviceptr, CUstream, Context, DeviceBuffer,
};
use crate::backend::cuda::kernels::Kernels;
use crate::backend::cuda::layout::{GaBoundary, CONTROL_WORDS, FIRST_BAD_WORD};
use crate::backend::cuda::nccl::NcclComm;
use crate::comm::{Communicator, Control, ControlSum, OverflowKey};
use crate::error::{Error, ErrorKind, Result};

use super::DeviceStore;

/// The NCCL communicator behind `comm`, or DEVICE_MISMATCH.
pub(in crate::backend::cuda) fn nccl(comm: &dyn Communicator) -> Result<&NcclComm> {
    NcclComm::of(comm).ok_or_else(|| {
        Error::new(
            ErrorKind::DeviceMismatch,
            "a host communicator for a CUDA accumulator: use an NCCL communicator",
        )
    })
}

/// The totals the host knows after the control step, `None` when they are summed on the device
/// with the buckets: a boundary whose group is this rank alone knows its own (and tells an empty
/// window before anything is enqueued); one whose caller asks for them ([`Proposal::host_totals`],
/// a mesh step) sums the control words over its groups and reads them back (a host wait). A
/// hybrid boundary's group is the grid.
pub(in crate::backend::cuda) fn agreed_totals(
    store: &DeviceStore,
    p: &Proposal<'_>,
    comm: Option<&NcclComm>,
    replicas: Option<&NcclComm>,
) -> Result<Option<ControlSum>> {
    if p.host_totals {
        return control_to_host(store, p, comm, replicas).map(Some);
    }
    let world = comm.map_or(1, |c| c.world_size()) * replicas.map_or(1, |r| r.world_size());
    // A window whose every micro-batch was dropped is not empty: the device's boundary reports it
    // (and the scaler gathers it from there).
    let all_dropped = p.microbatches == 0 && p.dropped != 0;
    Ok((world == 1 && !all_dropped).then(|| ControlSum {
        count: p.count,
        microbatches: p.microbatches,
        ranks: p.ranks,
        dropped: p.dropped,
        ..Default::default()
    }))
}

/// The control words summed over `comm`, then `replicas`, in the boundary, read on the host.
/// Nothing else is reduced: the window stays intact, and the reduction packs the words again.
fn control_to_host(
    store: &DeviceStore,
    p: &Proposal<'_>,
    comm: Option<&NcclComm>,
    replicas: Option<&NcclComm>,
) -> Result<ControlSum> {
    let groups: Vec<&NcclComm> = comm.iter().chain(&replicas).copied().collect();
    {
        // The boundary is rewritten: after the scalers' gathers of the last one.
        let mut reads = store.boundary_reads();
        reads.before_write()?;
        let result = pack_control(store, p, None)
            .and_then(|()| groups.iter().try_for_each(|c| reduce_control(store, c, store.stream)));
        reads.after_write()?;
        result?;
    }
    wait_for_groups(&store.ctx, store.stream, &groups)?;
    let mut b = [GaBoundary::default()];
    store.boundary.read(&mut b)?;
    groups.iter().try_for_each(|c| c.health())?;
    let b = b[0];
    Ok(ControlSum {
        count: b.count,
        microbatches: b.microbatches,
        found_inf: b.found_inf != 0,
        ranks: b.ranks,
        dropped: b.dropped,
        first_bad: !b.first_bad,
        ..Default::default()
    })
}

/// Reads the boundary's result (waits for the stream); None for an empty window.
pub(in crate::backend::cuda) fn read_info(boundary: &DeviceBuffer) -> Result<Option<SyncInfo>> {
    let mut b = [GaBoundary::default()];
    boundary.read(&mut b)?;
    let b = b[0];
    if b.empty != 0 {
        return Ok(None);
    }
    let total = ControlSum {
        count: b.count,
        microbatches: b.microbatches,
        found_inf: b.found_inf != 0,
        dropped: b.dropped,
        first_bad: !b.first_bad,
        ..Default::default()
    };
    Ok(Some(SyncInfo::of(&total, b.grad_norm, b.clip_coef)))
}

/// Enqueues this rank's control words into `store`'s boundary. The place is the host's under
/// DROP_MICROBATCH; under SKIP_STEP the flag stays on the device, and a window that went
/// non-finite is reported unlocated. Under DROP_MICROBATCH a flag the host cannot place is
/// reported as [`Proposal::unlocated_if_flagged`] says, as on the CPU. With the agreed `totals`
/// (the host knows them), the counts are those: the first rank of the groups brings them and
/// the others zeros, so the control reduction ends with them on every rank.
pub(in crate::backend::cuda) fn pack_control(
    store: &DeviceStore,
    p: &Proposal<'_>,
    totals: Option<&ControlSum>,
) -> Result<()> {
    let boundary = store.boundary.ptr();
    let (count, microbatches, ranks, dropped) = match totals {
        None => (p.count, p.microbatches, p.ranks, p.dropped),
        Some(t) if p.world_rank() == 0 => (t.count, t.microbatches, t.ranks, t.dropped),
        Some(_) => (0, 0, 0, 0),
    };
    let found_inf = store.found_inf.ptr();
    let first_bad = match store.plan.config.overflow {
        Overflow::DropMicrobatch => p.first_bad(false),
        Overflow::SkipStep => OverflowKey::UNLOCATED,
    };
    let unlocated_if_flagged = p.unlocated_if_flagged(&store.plan) as i32;
    let mut args = launch_args!(
        boundary,
        count,
        microbatches,
        found_inf,
        ranks,
        dropped,
        first_bad,
        unlocated_if_flagged
    );
    // SAFETY: argument types follow ga_pack_control; `boundary` holds a ga_boundary.
    unsafe { store.kernels.pack_control.launch(&store.ctx, 1, 1, store.stream, &mut args) }
}

/// Enqueues the control words' reduction over `c` on `stream` (inside the caller's NCCL group,
/// if any): the sums, and under DROP_MICROBATCH the first place (a MAX of complements).
pub(in crate::backend::cuda) fn reduce_control(
    store: &DeviceStore,
    c: &NcclComm,
    stream: CUstream,
) -> Result<()> {
    let boundary = store.boundary.ptr();
    c.allreduce_u64(boundary, CONTROL_WORDS, false, stream)?;
    if store.plan.config.overflow == Overflow::DropMicrobatch {
        c.allreduce_u64(boundary + 8 * FIRST_BAD_WORD as u64, 1, true, stream)?;
    }
    Ok(())
}

/// Waits for the stream's collectives on `comm` up to its timeout, failing early when NCCL
/// reports a peer's failure. A timeout aborts the communicator (its kernels then end, and the
/// stream drains) and fails with TIMEOUT.
pub(in crate::backend::cuda) fn wait_for_collectives(
    ctx: &Context,
    stream: CUstream,
    comm: &NcclComm,
) -> Result<()> {
    wait_for_groups(ctx, stream, &[comm])
}

/// [`wait_for_collectives`] for a stream with collectives on several communicators (a hybrid
/// boundary's shard and replica groups): up to the shortest timeout, failing early on any
/// group's failure. A timeout aborts every group: the stream may wait in any of them.
pub(in crate::backend::cuda) fn wait_for_groups(
    ctx: &Context,
    stream: CUstream,
    groups: &[&NcclComm],
) -> Result<()> {
    let timeout = groups.iter().filter_map(|c| c.timeout()).min();
    let result =
        wait_until_done(ctx, stream, timeout, || groups.iter().try_for_each(|c| c.health()));
    if let Err(e) = &result {
        if e.kind == ErrorKind::Timeout {
            let what = format!(
                "the boundary's collectives: {}; a rank failed or never arrived",
                e.message
            );
            // Only an abort ends NCCL's kernels; without one the stream would never drain.
            let mut refused = None;
            for c in groups {
                if let Err(e) = c.abort() {
                    c.mark_failed();
                    refused.get_or_insert(e);
                }
            }
            if let Some(refused) = refused {
                return Err(Error::new(
                    ErrorKind::Timeout,
                    format!("{what}, and the communicator could not be aborted ({}): abort it, then the stream drains", refused.message),
                ));
            }
            synchronize(ctx, stream)?;
            return Err(Error::new(
                ErrorKind::Timeout,
                format!("{what}, and the communicator was aborted"),
            ));
        }
    }
    result
}

/// A device's control channel (see [`protocol`]): the claim words all-reduced with MAX over an
/// NCCL communicator on a stream, and read back on the host once the stream has run it (a
/// blocking exchange: the stores run it once per communicator or pair of groups, and at the close
/// of a hook micro-batch under sharded accumulation).
struct DeviceChannel<'a> {
    pub ctx: &'a Context,
    pub stream: CUstream,
    /// [`CLAIM_WORDS`] u64 of the stream's context.
    pub words: &'a DeviceBuffer,
    pub comm: &'a NcclComm,
    /// Device values mixed into the claim before it is reduced.
    pub schedule: Option<&'a Schedule>,
}

/// A sharded optimizer step's learning rate (one f32) and step count (one u64) in device memory,
/// as its kernels will read them: part of the step's claim ([`Claims::scheduled`]).
pub(in crate::backend::cuda) struct Schedule {
    pub kernels: Arc<Kernels>,
    pub lr: CUdeviceptr,
    pub steps: CUdeviceptr,
}

impl Channel for DeviceChannel<'_> {
    fn exchange(&self, mine: &ControlSum) -> Result<ControlSum> {
        self.words.write(&protocol::claim_words(mine))?;
        if let Some(s) = self.schedule {
            let (words, lr, steps) = (self.words.ptr(), s.lr, s.steps);
            let mut args = launch_args!(words, lr, steps);
            // SAFETY: ga_claim_schedule takes the CLAIM_WORDS claim words, one f32 (read as its
            // bits) and one u64, all live buffers of this context.
            unsafe { s.kernels.claim_schedule.launch(self.ctx, 1, 1, self.stream, &mut args)? };
        }
        self.comm.allreduce_u64(self.words.ptr(), CLAIM_WORDS, true, self.stream)?;
        wait_for_collectives(self.ctx, self.stream, self.comm)?;
        let mut max = [0u64; CLAIM_WORDS];
        self.words.read(&mut max)?;
        self.comm.health()?;
        Ok(protocol::from_claim_words(&max))
    }
}

/// The claims a device store exchanges, through [`CLAIM_WORDS`] u64 of device memory on its
/// stream.
pub(in crate::backend::cuda) struct Claims {
    ctx: Arc<Context>,
    stream: CUstream,
    words: DeviceBuffer,
    schedule: Option<Schedule>,
}

impl Claims {
    pub(in crate::backend::cuda) fn new(ctx: &Arc<Context>, stream: CUstream) -> Result<Self> {
        let words = DeviceBuffer::zeroed(ctx, stream, CLAIM_WORDS * 8)?;
        Ok(Claims { ctx: ctx.clone(), stream, words, schedule: None })
    }

    /// An optimizer's claims: every one also carries `schedule`'s learning rate and step count,
    /// mixed in on the device, so that ranks whose values differ fail together (a schedule on
    /// the device included).
    pub(in crate::backend::cuda) fn scheduled(
        ctx: &Arc<Context>,
        stream: CUstream,
        schedule: Schedule,
    ) -> Result<Self> {
        Ok(Claims { schedule: Some(schedule), ..Claims::new(ctx, stream)? })
    }

    /// The reduced claims at `step` over `group` (none: this rank alone) and, at a hybrid
    /// boundary, over the replicas of `shard` ([`protocol::exchange`]); this rank's claims it
    /// dropped the micro-batch with `dropped`.
    pub(in crate::backend::cuda) fn exchange(
        &self,
        step: Step,
        plan: &Plan,
        group: Option<&NcclComm>,
        replicas: Option<(&NcclComm, usize)>,
        invalid: bool,
        dropped: bool,
    ) -> Result<ControlSum> {
        let (ctx, stream, words, schedule) =
            (&*self.ctx, self.stream, &self.words, self.schedule.as_ref());
        let channel = |comm| DeviceChannel { ctx, stream, words, comm, schedule };
        let mine = Control {
            dropped: dropped as u64,
            ..step.claim(plan, replicas.map(|(r, _)| r.world_size()), invalid)
        };
        let group = group.map(channel);
        let replicas = replicas.map(|(r, shard)| (channel(r), shard));
        protocol::exchange(
            group.as_ref().map(|c| c as &dyn Channel),
            replicas.as_ref().map(|(c, shard)| (c as &dyn Channel, *shard)),
            &ControlSum::of(&mine),
        )
    }

    /// The control step at `step`: the exchange, then its verdict ([`protocol::agree`]).
    pub(in crate::backend::cuda) fn agree(
        &self,
        step: Step,
        plan: &Plan,
        group: Option<&NcclComm>,
        replicas: Option<(&NcclComm, usize)>,
        own: Option<&Error>,
    ) -> Result<()> {
        let total = self.exchange(step, plan, group, replicas, own.is_some(), false);
        step.judge(total, own).map(drop)
    }
}

/// Each piece of `bucket` inside a shard summed into that shard's owner (one ncclReduce per
/// piece, in one NCCL group); `at(e)` is the device address of flat element `e`.
pub(in crate::backend::cuda) fn reduce_to_owners(
    c: &NcclComm,
    bucket: &Range<usize>,
    shards: &[Range<usize>],
    at: impl Fn(usize) -> CUdeviceptr,
    stream: CUstream,
) -> Result<()> {
    c.group(|| {
        for (owner, shard) in shards.iter().enumerate() {
            let piece = intersect(bucket, shard);
            if !piece.is_empty() {
                c.reduce_sum_f32(at(piece.start), piece.len(), owner, stream)?;
            }
        }
        Ok(())
    })
}
