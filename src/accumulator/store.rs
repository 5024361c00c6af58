//! The `Store` traits: a device's part of an accumulator, which the accumulator drives after its
//! checks, in four narrow parts: the master's memory ([`MasterMemory`]), the add path's kernels
//! ([`AddKernels`]), the turns of a micro-batch ([`MicrobatchTurns`]) and the boundary's work
//! ([`BoundaryWork`]). `backend::cpu` and `backend::cuda` implement each; the defaults are what a
//! store without the feature does. Each part of the core imports the parts it drives.

use std::ops::Range;
use std::sync::Arc;

// The policy the docs below name; the code never needs it.
#[cfg(doc)]
use super::Overflow;
use super::{
    protocol, sharding, Agreed, DeviceScale, Gradient, Grads, MasterWrite, Proposal, Reduced,
    ScaleSource, SyncInfo, TensorStats, TensorWrite,
};
use crate::comm::Communicator;
use crate::device::Device;
use crate::error::{Error, ErrorKind, Result};

/// `what` (a setting) where no store runs it (`where_`).
fn not_here(what: &str, where_: &str) -> Error {
    Error::new(ErrorKind::BackendUnavailable, format!("{what} does not run {where_}"))
}

/// A device's part of an accumulator: the master's memory and the kernels over it, in four
/// narrow parts. The accumulator decides what runs and when, after its checks; a store only
/// does it.
pub(crate) trait Store: MasterMemory + AddKernels + MicrobatchTurns + BoundaryWork {}

impl<T: MasterMemory + AddKernels + MicrobatchTurns + BoundaryWork> Store for T {}

/// A store's memory: the master (whole, or this rank's shard), the window's overflow flag and
/// counts, read, written and zeroed where the accumulator's write rights allow.
pub(crate) trait MasterMemory: Send + Sync {
    fn device(&self) -> Device;

    /// Zeroes tensor `index`'s master.
    fn zero(&self, master: &mut MasterWrite, index: usize) -> Result<()>;

    /// The window's overflow flag starts clear.
    fn clear_found_inf(&self) -> Result<()>;

    /// A restored window's per-tensor counts start at zero, where the store keeps them.
    fn restart_counts(&self) -> Result<()> {
        Ok(())
    }

    /// Address of master element `offset` (a device address on a device).
    fn master_address(&self, offset: usize) -> *mut f32;

    /// Copies master elements `range` (held ones) to `out` (waits for the device).
    fn read(&self, master: &MasterWrite, range: Range<usize>, out: &mut [f32]) -> Result<()>;

    /// Overwrites the held master elements (see `Plan::held`) with `values`.
    fn write(&self, master: &mut MasterWrite, values: &[f32]) -> Result<()>;

    /// The window's overflow flag (waits for the device).
    fn found_inf(&self) -> Result<bool>;

    fn set_found_inf(&self, value: bool) -> Result<()>;

    /// Runs `f` on master elements `range` (held ones): in place in host memory, else on a host
    /// copy.
    fn view(
        &self,
        master: &MasterWrite,
        range: Range<usize>,
        f: &mut dyn FnMut(&[f32]),
    ) -> Result<()> {
        let mut copy = vec![0.0; range.len()];
        self.read(master, range, &mut copy)?;
        f(&copy);
        Ok(())
    }
}

/// A store's add path: the fused kernels that unscale, weigh, check and add a micro-batch's
/// gradients into the master, or into the staging of a micro-batch that may be dropped.
pub(crate) trait AddKernels: MasterMemory {
    /// Adds one micro-batch (gradients checked against the tensors): tensor i unscaled by
    /// `scale`, weighted, checked for non-finite values, and assigned when `first(i)` or added.
    /// Returns whether a value it wrote into the master is not finite, where the store knows it
    /// on the host and the core can locate it ([`AddKernels::first_bad_master`]); `false` elsewhere.
    fn add(
        &self,
        master: &mut MasterWrite,
        scale: ScaleSource<'_>,
        grads: Grads<'_>,
        weight: f64,
        first: &dyn Fn(usize) -> bool,
    ) -> Result<bool>;

    /// `add` of the window's last micro-batch: a store may also measure the norm's blocks of the
    /// result while each piece is in cache, for a boundary that reduces nothing between ranks to
    /// use while nothing has written the master since. The default is `add`.
    fn add_final(
        &self,
        master: &mut MasterWrite,
        scale: ScaleSource<'_>,
        grads: Grads<'_>,
        weight: f64,
        first: &dyn Fn(usize) -> bool,
    ) -> Result<bool> {
        self.add(master, scale, grads, weight, first)
    }

    /// Adds one contribution to `tensor`. Returns whether a value it wrote is not finite, as
    /// `add` does.
    fn add_tensor(
        &self,
        tensor: &mut TensorWrite,
        scale: ScaleSource<'_>,
        grad: Gradient<'_>,
        weight: f64,
        first: bool,
    ) -> Result<bool>;

    /// The tensors whose gradients are not finite once unscaled and weighted, in order: the check
    /// of a whole micro-batch before it is added ([`Overflow::DropMicrobatch`]), and what
    /// `tensor_stats` counts.
    fn bad_gradients(
        &self,
        _scale: ScaleSource<'_>,
        _grads: Grads<'_>,
        _weight: f64,
    ) -> Result<Vec<usize>> {
        Err(not_here("overflow = DropMicrobatch", &format!("on {}", self.device().name())))
    }

    /// Whether one gradient stays finite once unscaled and weighted (an `add_tensor` that wrote a
    /// non-finite value: its own, or the master's sum overflowing).
    fn finite_gradient(
        &self,
        _scale: ScaleSource<'_>,
        _grad: Gradient<'_>,
        _weight: f64,
    ) -> Result<bool> {
        Ok(false)
    }

    /// The first tensor whose master holds a non-finite value (where an add went bad).
    fn first_bad_master(&self, _master: &MasterWrite) -> Result<Option<usize>> {
        Ok(None)
    }

    /// Adds one contribution to `tensor` into the staging instead of the master (assigned with
    /// `first`, the tensor's first in the micro-batch): [`Overflow::DropMicrobatch`]'s
    /// micro-batch fed tensor by tensor. Returns whether a value it wrote is not finite; the
    /// window's flag is left alone.
    fn stage_tensor(
        &self,
        _tensor: &mut TensorWrite,
        _scale: ScaleSource<'_>,
        _grad: Gradient<'_>,
        _weight: f64,
        _first: bool,
    ) -> Result<bool> {
        Err(not_here("overflow = DropMicrobatch", &format!("on {}", self.device().name())))
    }

    /// The tensors whose staging went non-finite in the open micro-batch where `stage_tensor`
    /// could not tell at once (a device keeps the flags: reading them waits for it); the
    /// window's marks hold the others.
    fn staged_bad(&self) -> Result<Vec<usize>> {
        Ok(Vec::new())
    }

    /// Adds tensor `index`'s staging into its master (assigns it with `first`), flagging the
    /// window as `add_tensor` does. Returns whether a value it wrote is not finite.
    fn merge_staged(&self, _master: &mut MasterWrite, _index: usize, _first: bool) -> Result<bool> {
        Err(not_here("overflow = DropMicrobatch", &format!("on {}", self.device().name())))
    }
}

/// A store's turns of a micro-batch: what it does when one opens, closes or is dropped, and the
/// window's last micro-batch. Only a store that reduces every micro-batch (sharded
/// accumulation: [`MicrobatchTurns::shard`]) or overlaps the last one's reductions does
/// anything here; the defaults are the others'.
pub(crate) trait MicrobatchTurns: MasterMemory {
    /// Refuses a new micro-batch when the window cannot take one.
    fn check_open(&self) -> Result<()> {
        Ok(())
    }

    /// A micro-batch opens, the window's first with `first`, `whole` from `add` (else tensor by
    /// tensor, from `begin_microbatch`). With
    /// `error` this rank's call is invalid: a store that reduces every micro-batch still takes
    /// part in the micro-batch's control step, so that every rank fails together; the error is
    /// returned.
    fn open_microbatch(
        &self,
        _master: &MasterWrite,
        _first: bool,
        _whole: bool,
        error: Option<&Error>,
    ) -> Result<()> {
        error.map_or(Ok(()), |e| Err(e.clone()))
    }

    /// The micro-batch `begin_microbatch` opened ends (or is reset): a store that reduces every
    /// micro-batch reduces the buckets still waiting. Returns whether the micro-batch was
    /// dropped on every rank (such a store under [`Overflow::DropMicrobatch`], when a rank's
    /// gradient was not finite: the master is as before the micro-batch).
    fn close_microbatch(&self, _master: &mut MasterWrite) -> Result<bool> {
        Ok(false)
    }

    /// This rank dropped the micro-batch `add` brought ([`Overflow::DropMicrobatch`]): a store
    /// that reduces every micro-batch still takes part in its reductions, with zeros. Returns
    /// whether the master was written (with the other ranks' sums).
    fn add_nothing(&self, _master: &mut MasterWrite) -> Result<bool> {
        Ok(false)
    }

    /// This rank's part of a sharded accumulation, whose store reduces every micro-batch.
    fn shard(&self) -> Option<&sharding::Shard> {
        None
    }

    /// Whether a reduction failed since the last call, leaving the window's sums incomplete.
    fn take_lost(&self) -> bool {
        self.shard().is_some_and(sharding::Shard::take_lost)
    }

    /// An `add_tensor` of the open micro-batch failed on this rank: a store that reduces every
    /// micro-batch fails it on every rank when it closes.
    fn note_invalid(&self) {
        if let Some(s) = self.shard() {
            s.note_invalid();
        }
    }

    /// The communicator a store reduces every micro-batch over (sharded accumulation).
    fn bound(&self) -> Option<&dyn Communicator> {
        self.shard().and_then(sharding::Shard::comm)
    }

    /// This rank's call was refused before it reached the collective its peers are in: a store
    /// bound to a communicator tells them (a host communicator's control step carries the error).
    fn refuse(&self) {
        if let Some(c) = self.bound() {
            protocol::refuse(c);
        }
    }

    /// The window's last micro-batch opens, with the communicator of its boundary.
    fn begin_final(&self, _comm: &Arc<dyn Communicator>) -> Result<()> {
        Ok(())
    }

    /// Ends what `begin_final` started, before a reset or the boundary.
    fn end_final(&self) -> Result<()> {
        Ok(())
    }
}

/// A store's part of the boundary: the control step, the reduction with the pass over its sum,
/// and what the boundary leaves (stats, the device's result, the scaler's gather).
pub(crate) trait BoundaryWork: MasterMemory {
    /// The control step: the ranks agree on counts, layouts and errors before any bucket moves.
    fn agree(&self, proposal: &Proposal<'_>) -> Result<Agreed>;

    /// The reduction step: sum over the ranks, normalise, measure, clip. With `read`, the info.
    fn reduce(
        &self,
        master: &mut MasterWrite,
        proposal: &Proposal<'_>,
        agreed: &Agreed,
        read: bool,
    ) -> Result<Option<SyncInfo>>;

    /// The factor the last reduction left pending when its proposal deferred the clip
    /// ([`Proposal::defer_clip`]), taken once: the gradient in memory is the sum before it. None
    /// when nothing is pending (no clipping, a factor of 1, or a store that applied it).
    fn take_deferred(&self) -> Option<f32> {
        None
    }

    /// Multiplies the boundary's result this rank holds (`Plan::shard`'s range) by `factor`
    /// with [`crate::simd::scale`]'s bits: a mesh step's clipping, whose coefficient is the
    /// whole job's.
    fn scale_result(&self, _master: &mut MasterWrite, _factor: f32) -> Result<()> {
        Err(not_here("a mesh step", &format!("on {}", self.device().name())))
    }

    /// A mesh step replaced the boundary's report with the job's (`info`: its overflow, norm
    /// and clip coefficient): a store whose boundary's result is read on the device (a scaler's
    /// gather, an optimizer's skip) writes it there. The CPU's is the window's.
    fn conclude(&self, _info: &SyncInfo) -> Result<()> {
        Ok(())
    }

    /// Whether a measurement `add_final` left still holds (nothing wrote the master since).
    #[cfg(test)]
    fn holds_fold(&self) -> bool {
        false
    }

    /// The last boundary's per-tensor stats, when the store measured them.
    fn tensor_stats(&self) -> Option<Vec<TensorStats>> {
        None
    }

    /// A boundary with nothing to reduce (every micro-batch dropped): the per-tensor stats are
    /// the counts alone, still summed over the ranks.
    fn count_only(&self, _proposal: &Proposal<'_>) -> Result<()> {
        Ok(())
    }

    /// Where a device store's reduced gradient (this rank's shard, from its first element) and
    /// the boundary's result are; none on the CPU.
    fn reduced(&self) -> Option<Reduced> {
        None
    }

    /// Enqueues the gather of the synced boundary's overflow flag into a scaler's device state.
    fn gather_into(&self, _scaler: &dyn DeviceScale) -> Result<()> {
        Err(Error::new(
            ErrorKind::DeviceMismatch,
            "a CUDA scaler cannot gather a CPU accumulator's boundary",
        ))
    }
}
