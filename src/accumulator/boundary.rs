//! The boundary: `sync`, `sync_enqueue` and `sync_hybrid`. This rank's proposal is checked and
//! agreed with the other ranks before anything changes; then the window is consumed, its master
//! summed, normalised, measured and clipped by the store, and the report kept in the window.

use super::window::{Phase, State, WindowWrite};
// The policy the docs below name; the code never needs it.
#[cfg(doc)]
use super::Sharding;
use super::{protocol, Accumulator, Agreed, Proposal, SyncInfo};
use crate::comm::{Communicator, ControlSum};
use crate::error::{Error, ErrorKind, Result};

impl Accumulator {
    /// The boundary. With a communicator, every rank of its group must call it: the control
    /// values are agreed first (so ranks agree on counts and overflow, and fail together where
    /// the transport can tell them), then the master is summed bucket by bucket, normalised,
    /// measured and clipped. `None` is the single-process boundary, or a sharded accumulation's
    /// own communicator ([`Sharding::Accumulate`]). On CUDA this waits for the accumulator's
    /// stream to read the info; [`Accumulator::sync_enqueue`] does not.
    pub fn sync(&self, comm: Option<&dyn Communicator>) -> Result<SyncInfo> {
        self.boundary(comm, None, true, false)?
            .ok_or_else(|| Error::new(ErrorKind::Internal, "a read boundary returned no info"))
    }

    /// [`Accumulator::sync`] for an optimizer that steps right after: with clipping, the
    /// gradient in memory stays the sum before normalisation and clipping, whose one factor the
    /// step applies inside its own pass (the same `g * c` rounded to f32, so the step is
    /// bitwise the one after `sync`), and the boundary saves a read and a write of the
    /// gradient. Reading the synced gradient through the accumulator (`read`, `with_master`,
    /// `with_shard`) applies the coefficient to it first, with `sync`'s bits; only an address
    /// taken from `master_ptr` or `shard` sees the sum before it, until such a read. The report
    /// is `sync`'s. On CUDA this is `sync`.
    pub fn sync_for_step(&self, comm: Option<&dyn Communicator>) -> Result<SyncInfo> {
        self.boundary(comm, None, true, true)?
            .ok_or_else(|| Error::new(ErrorKind::Internal, "a read boundary returned no info"))
    }

    /// [`Accumulator::sync_hybrid`] for an optimizer that steps right after, as
    /// [`Accumulator::sync_for_step`] is `sync`'s.
    pub fn sync_hybrid_for_step(
        &self,
        shard: &dyn Communicator,
        replicas: &dyn Communicator,
    ) -> Result<SyncInfo> {
        self.boundary(Some(shard), Some(replicas), true, true)?
            .ok_or_else(|| Error::new(ErrorKind::Internal, "a read boundary returned no info"))
    }

    /// The boundary without reading its info: on CUDA everything is enqueued on the accumulator's
    /// stream and the call returns at once (the info stays on the device for the scaler's
    /// update); on the CPU it is [`Accumulator::sync`].
    pub fn sync_enqueue(&self, comm: Option<&dyn Communicator>) -> Result<()> {
        self.boundary(comm, None, false, false).map(drop)
    }

    /// The hybrid boundary (HSDP): a sharded accumulator reduce-scatters over `shard` (its
    /// [`Sharding::ReduceScatter`] group), and each shard is then all-reduced over `replicas`,
    /// the ranks that hold the same shard in the other shard groups, once. Every rank of both
    /// groups must call it. Counts, micro-batches and overflow are agreed over every rank of both
    /// (the world is their product); the norm is the whole gradient's, the same everywhere. The
    /// shard holds the sum over each shard group in rank order, summed over the replicas in
    /// their rank order. On CUDA both groups are NCCL communicators on the accumulator's device;
    /// the first hybrid sync per pair of groups checks the grid's layouts (a host wait).
    pub fn sync_hybrid(
        &self,
        shard: &dyn Communicator,
        replicas: &dyn Communicator,
    ) -> Result<SyncInfo> {
        self.boundary(Some(shard), Some(replicas), true, false)?
            .ok_or_else(|| Error::new(ErrorKind::Internal, "a read boundary returned no info"))
    }

    fn boundary(
        &self,
        comm: Option<&dyn Communicator>,
        replicas: Option<&dyn Communicator>,
        read: bool,
        defer_clip: bool,
    ) -> Result<Option<SyncInfo>> {
        let result = self.run_boundary(comm, replicas, read, defer_clip);
        if let Err(e) = &result {
            // A boundary past its deadline ends this rank's use of its groups, on every transport.
            if e.kind == ErrorKind::Timeout {
                for c in comm.or(self.store.bound()).iter().chain(&replicas) {
                    let _ = c.abort();
                }
            }
        }
        result
    }

    fn run_boundary(
        &self,
        comm: Option<&dyn Communicator>,
        replicas: Option<&dyn Communicator>,
        read: bool,
        defer_clip: bool,
    ) -> Result<Option<SyncInfo>> {
        let mut opened = self.open_boundary(comm, replicas, false, None)?;
        opened.proposal.defer_clip = defer_clip;
        let info = opened.finish(read);
        // Taken whatever the outcome: a failed boundary leaves nothing pending.
        let pending = self.store.take_deferred();
        let info = info?;
        opened.w.pending_clip = pending;
        opened.w.phase = Phase::Synced(info);
        Ok(info)
    }

    /// The boundary up to its control step: the window held, this rank's proposal agreed with
    /// the group's. Nothing has changed yet; a mesh step ([`crate::mesh`]) agrees over the whole
    /// job between this and [`Opened::finish`], and asks for the group's totals on the host
    /// (`host_totals`) to replace them with the job's. With `refused` (the caller's own check
    /// failed), the control step runs flagged invalid, as for any invalid call, so the group's
    /// peers fail on every transport that can tell them, and the error is returned.
    pub(crate) fn open_boundary<'a>(
        &'a self,
        comm: Option<&'a dyn Communicator>,
        replicas: Option<&'a dyn Communicator>,
        host_totals: bool,
        refused: Option<Error>,
    ) -> Result<Opened<'a>> {
        // Sharded accumulation reduces over its own communicator; `None` names it too.
        if let Err(e) = self.check_bound(comm) {
            // The shard group, then the replicas, as the boundary's control step would.
            self.refuse_collective();
            replicas.into_iter().for_each(protocol::refuse);
            return Err(e);
        }
        let comm = comm.or(self.store.bound());
        let groups = || comm.iter().chain(&replicas).copied();
        if let Err(e) = groups()
            .try_for_each(|c| self.check_comm(c))
            .and_then(|()| self.check_replicas(replicas))
        {
            groups().for_each(protocol::refuse);
            return Err(e);
        }
        let w = self.window.write();
        let error = refused
            .or_else(|| {
                w.in_microbatch().then(|| {
                    Error::wrong_state("sync inside a micro-batch: call end_microbatch first")
                })
            })
            .or_else(|| self.check_shard_comm(comm).err());
        // A sync right after a sync closes a new, empty window: a rank with no micro-batch this
        // time still takes part in the boundary of the others.
        let empty_again = w.synced();
        let proposal = self.propose(&w, empty_again, (comm, replicas), error, host_totals);
        let agreed = self.agree(&proposal)?;
        Ok(Opened { acc: self, w, empty_again, proposal, agreed })
    }

    /// What this rank brings to the boundary over `groups` (its group and replicas) from window
    /// `w` (a new, empty one when `empty_again`), with `error` when its call is invalid.
    fn propose<'a>(
        &self,
        w: &State,
        empty_again: bool,
        (comm, replicas): (Option<&'a dyn Communicator>, Option<&'a dyn Communicator>),
        error: Option<Error>,
        host_totals: bool,
    ) -> Proposal<'a> {
        let (count, microbatches, ranks) =
            if empty_again { (0, 0, 1) } else { (w.count, w.microbatches, w.rank_windows()) };
        let (dropped, first_bad) = if empty_again { (0, None) } else { (w.dropped, w.first_bad) };
        let nonfinite = match (self.plan.config.tensor_stats, empty_again) {
            (false, _) => Vec::new(),
            (true, true) => vec![0; self.plan.descs.len()],
            (true, false) => w.nonfinite(self.plan.descs.len()),
        };
        Proposal {
            comm,
            replicas,
            count,
            microbatches,
            ranks,
            dropped,
            first_bad,
            unlocated: !empty_again && w.unlocated(),
            nonfinite,
            error,
            host_totals,
            defer_clip: false,
        }
    }

    /// The control step. A transport that fails or times out here has reduced nothing: the
    /// error says that the window is intact, and how this rank resumes.
    fn agree(&self, proposal: &Proposal<'_>) -> Result<Agreed> {
        self.store.agree(proposal).map_err(|e| match e.kind {
            // Nothing was reduced: the caller may save the window or sync again on a new group.
            ErrorKind::CommFailure | ErrorKind::Timeout => {
                // A sharded accumulation is bound to its communicator: it resumes in a new one.
                let next = if self.store.bound().is_some() {
                    "load it into an accumulation on a new communicator"
                } else {
                    "or sync again on a new communicator"
                };
                Error::new(
                    e.kind,
                    format!("{}; this rank's window is intact (save_window it, {next})", e.message),
                )
            }
            _ => e,
        })
    }

    /// Every micro-batch of every rank was dropped (the agreed totals `t`): nothing to reduce,
    /// the step is skipped, and the master reads as zeros.
    fn end_dropped_window(
        &self,
        w: &mut WindowWrite<'_>,
        empty_again: bool,
        proposal: &Proposal<'_>,
        t: &ControlSum,
    ) -> Result<SyncInfo> {
        if empty_again {
            self.discard(w)?;
        }
        self.zero_untouched(w)?;
        self.store.set_found_inf(true)?;
        if let Err(e) = self.store.count_only(proposal) {
            let _ = self.discard(w);
            return Err(Error::new(e.kind, format!("{} (the window was discarded)", e.message)));
        }
        Ok(SyncInfo { found_inf: true, ..SyncInfo::of(t, 0.0, 1.0) })
    }

    /// The agreed totals `t` give a gradient to normalise: some rank added a micro-batch, and
    /// the divisor is not 0. Nothing has changed when they do not; `again` says that this rank's
    /// window was synced already.
    fn check_totals(&self, t: &ControlSum, again: bool) -> Result<()> {
        if t.microbatches == 0 {
            let why = match again {
                true => "the window was synced already, and no rank added a micro-batch since",
                false => "no rank added a micro-batch",
            };
            return Err(Error::new(
                ErrorKind::EmptyWindow,
                format!("sync on an empty window: {why}"),
            ));
        }
        if self.plan.config.normalize.divisor(t.count, t.microbatches, t.ranks) == 0 {
            return Err(Error::new(
                ErrorKind::EmptyWindow,
                "the window's global item count is 0: nothing to normalise by",
            ));
        }
        Ok(())
    }

    /// A sharded accumulator reduces only on a communicator whose size and rank are its own
    /// (checked on every rank, and told to the others through the control reduction).
    fn check_shard_comm(&self, comm: Option<&dyn Communicator>) -> Result<()> {
        let Some((shards, rank)) = self.plan.config.sharding.shard() else { return Ok(()) };
        let (world, at) = comm.map_or((1, 0), |c| (c.world_size(), c.rank()));
        if (world, at) != (shards, rank) {
            return Err(Error::invalid(format!(
                "the accumulator holds shard {rank} of {shards}, but the communicator is rank {at} of {world}{}",
                if comm.is_none() { " (no communicator)" } else { "" }
            )));
        }
        Ok(())
    }

    fn consume(
        &self,
        w: &mut WindowWrite<'_>,
        empty_again: bool,
        proposal: &Proposal<'_>,
        agreed: &Agreed,
        read: bool,
    ) -> Result<Option<SyncInfo>> {
        if empty_again {
            self.discard(w)?;
        }
        self.zero_untouched(w)?;
        self.store.reduce(w.master_mut(), proposal, agreed, read)
    }

    /// Zeroes the tensors not written in window `w`: they read as zero at the boundary.
    fn zero_untouched(&self, w: &mut WindowWrite<'_>) -> Result<()> {
        let untouched: Vec<usize> = self.window.untouched(w).collect();
        for i in untouched {
            self.store.zero(w.master_mut(), i)?;
            self.window.mark_written(w, i);
        }
        Ok(())
    }

    /// A hybrid boundary needs a sharded accumulator (every rank of the group is alike, so
    /// every rank refuses alike).
    fn check_replicas(&self, replicas: Option<&dyn Communicator>) -> Result<()> {
        if replicas.is_none() {
            return Ok(());
        }
        if self.plan.config.sharding.shard().is_none() {
            return Err(Error::invalid(
                "a hybrid boundary needs a sharded accumulator (reduce-scatter over the shard group); this one is not sharded",
            ));
        }
        Ok(())
    }
}

/// A boundary whose control step has run ([`Accumulator::open_boundary`]): the window held, and
/// what this rank proposed and its group agreed.
pub(crate) struct Opened<'a> {
    pub(crate) acc: &'a Accumulator,
    w: WindowWrite<'a>,
    empty_again: bool,
    pub(crate) proposal: Proposal<'a>,
    pub(crate) agreed: Agreed,
}

impl Opened<'_> {
    /// The rest of the boundary: the window consumed, its master summed, normalised (by the
    /// agreed totals, which a mesh step may have replaced with the job's), measured and clipped.
    /// The caller sets the window's phase from the info.
    pub(crate) fn finish(&mut self, read: bool) -> Result<Option<SyncInfo>> {
        let Opened { acc, w, empty_again, proposal, agreed } = self;
        let empty_again = *empty_again;
        if let Some(t) = &agreed.totals {
            if t.microbatches == 0 && t.dropped != 0 {
                return acc.end_dropped_window(w, empty_again, proposal, t).map(Some);
            }
            acc.check_totals(t, empty_again)?;
        }

        // From here on the window is consumed: every rank passed the same checks, and a failure
        // discards the window (a retry must not reduce a bucket twice).
        proposal.error = None;
        acc.consume(w, empty_again, proposal, agreed, read).map_err(|e| {
            let _ = acc.discard(w);
            Error::new(e.kind, format!("{} (the window was discarded)", e.message))
        })
    }

    /// Ends the boundary with `info`, the report every rank's step follows: in the window, and
    /// where a device's scaler and optimizer read it.
    pub(crate) fn conclude(&mut self, info: SyncInfo) -> Result<()> {
        self.acc.store.conclude(&info)?;
        self.w.pending_clip = None;
        self.w.phase = Phase::Synced(Some(info));
        Ok(())
    }

    /// Discards the window the boundary consumed (a later step of the same boundary failed):
    /// the next micro-batch starts afresh.
    pub(crate) fn discard(&mut self) {
        let _ = self.acc.discard(&mut self.w);
    }

    /// The per-tensor stats the boundary measured (with `tensor_stats`).
    pub(crate) fn tensor_stats(&self) -> Option<Vec<crate::accumulator::TensorStats>> {
        self.acc.store.tensor_stats()
    }

    /// Which micro-batches the window dropped (its drop signature; 0 for a new, empty one).
    pub(crate) fn drops(&self) -> u64 {
        if self.empty_again {
            0
        } else {
            self.w.drops
        }
    }

    /// Multiplies the gradient this rank holds after the boundary by `factor`.
    pub(crate) fn scale(&mut self, factor: f32) -> Result<()> {
        self.acc.store.scale_result(self.w.master_mut(), factor)
    }
}
