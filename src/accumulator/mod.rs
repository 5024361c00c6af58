//! The accumulator: FP32 master gradients for a set of tensors, filled micro-batch by micro-batch
//! in one fused pass each, and turned at the boundary into the normalised, all-reduced, clipped
//! gradient of the whole effective batch, identical on every rank.
//!
//! One [`Accumulator`] serves every device. This module holds the semantics, once: the window and
//! its phases (`window`), counts and normalisation rules (`config`), the tensor and bucket layout
//! (`layout`), how the ranks agree before a collective and what each verdict says (`protocol`),
//! how sharding cuts a micro-batch into stripes and buckets (`sharding`), which checks run before
//! anything changes, and the order of the boundary's steps. A boundary feature starts here.
//! A device supplies the memory and the kernels through the `Store` trait: `backend::cpu` (a
//! host buffer, SIMD passes, host communicators) and `backend::cuda` (device memory, kernels on the
//! caller's stream, NCCL). A store reads the loss scale from the `ScaleSource` each add hands it,
//! never from the scaler. A trait object rather than a type parameter: the device is chosen at
//! run time by every caller of the C ABI and of the bindings, so one concrete type keeps that
//! choice out of their code, and the per-call cost of one indirect call is nothing beside a pass
//! over a tensor.

mod builder;
mod checkpoint;
mod config;
mod grads;
mod layout;
mod plan;
pub(crate) mod protocol;
#[cfg(feature = "internal")]
pub use protocol::Owed;
mod report;
mod scale_source;
pub(crate) mod sharding;
mod store;
pub(crate) mod tensor_stats;
mod window;

pub use config::{
    AccumulatorConfig, LossReduction, Normalize, Overflow, Sharding, TensorDesc, MAX_WINDOW_COUNT,
};

use std::ffi::c_void;
use std::ops::Range;
use std::sync::Arc;

use crate::comm::Communicator;
use crate::device::Device;
use crate::dtype;
use crate::error::{Error, ErrorKind, Result};
use crate::scaler::Scaler;
pub use builder::AccumulatorBuilder;
pub use grads::{Gradient, Grads};
pub(crate) use layout::Layout;
pub use layout::MASTER_ALIGN;
pub(crate) use plan::{Agreed, Plan, Proposal, Reduced};
pub use report::{OverflowAt, SyncInfo};
pub(crate) use scale_source::{DeviceScale, ScaleSource};
pub(crate) use store::Store;
pub(crate) use tensor_stats::Segments;
pub use tensor_stats::TensorStats;
pub(crate) use window::{MasterWrite, TensorWrite};
use window::{Phase, State, Window, WindowWrite};

/// Mixed-precision gradient accumulator over a fixed list of tensors, on one device.
///
/// `add`, `begin_microbatch`/`end_microbatch`, `sync` and `reset` serialise on the window.
/// `add_tensor` may run concurrently from several threads: distinct tensors in parallel, several
/// contributions to one tensor one after another.
pub struct Accumulator {
    plan: Arc<Plan>,
    window: Window,
    store: Box<dyn Store>,
}

impl std::fmt::Debug for Accumulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accumulator")
            .field("device", &self.device())
            .field("plan", &self.plan)
            .finish()
    }
}

impl Accumulator {
    pub fn device(&self) -> Device {
        self.store.device()
    }

    pub fn config(&self) -> &AccumulatorConfig {
        &self.plan.config
    }

    pub fn tensors(&self) -> &[TensorDesc] {
        &self.plan.descs
    }

    /// Total elements of the master buffer, the padding between tensors included: the length
    /// an adopted master must have.
    pub fn len(&self) -> usize {
        self.plan.layout.len()
    }

    /// The master length, in f32 elements, of an accumulator over `tensors`: each tensor starts
    /// at a multiple of [`MASTER_ALIGN`] bytes, with zeros between. What a buffer given to
    /// [`AccumulatorBuilder::master_buffer`] must hold.
    pub fn master_len(tensors: &[TensorDesc]) -> Result<usize> {
        Ok(Layout::new(tensors, usize::MAX)?.len())
    }

    /// Where tensor `index` starts in the flat master, in elements (a multiple of
    /// [`MASTER_ALIGN`] / 4): with [`Accumulator::shard`]'s range it tells which tensors' elements
    /// a shard holds.
    pub fn offset(&self, index: usize) -> Result<usize> {
        self.plan.layout.check_index(index)?;
        Ok(self.range(index).start)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element ranges of the communication buckets.
    pub fn buckets(&self) -> &[Range<usize>] {
        self.plan.layout.buckets()
    }

    /// This rank's shard: its element range in the flat master and the address of its first
    /// element (a device address on CUDA; valid while the accumulator lives). Without sharding it
    /// is the whole master, so an optimizer can always update just `shard()`. Under
    /// [`Sharding::ReduceScatter`], after a `sync` the range holds this rank's part of the reduced,
    /// normalised (and clipped) gradient; the rest of the master is unspecified until the next
    /// window's first micro-batch overwrites it. Under [`Sharding::Accumulate`] the shard is all
    /// the accumulator holds: the window's sum over the ranks while accumulating, the reduced
    /// gradient after a `sync`.
    pub fn shard(&self) -> (Range<usize>, *mut f32) {
        let range = self.plan.shard();
        let ptr = self.store.master_address(range.start);
        (range, ptr)
    }

    fn range(&self, index: usize) -> Range<usize> {
        self.plan.layout.range(index)
    }

    /// Adds one micro-batch: every tensor's gradient, scaled by `scaler`'s current scale, for
    /// `count` items. Fails without changing anything on a wrong tensor count, length, dtype or
    /// device. On CUDA the work is enqueued on the accumulator's stream (one launch for up to
    /// 224 tensors) and the call returns without waiting; the buffers must stay valid until the
    /// stream has run it.
    ///
    /// Under [`Sharding::Accumulate`] a collective: every rank calls it alike, and a failure
    /// ends as that policy states.
    pub fn add<'a>(&self, scaler: &Scaler, grads: impl Into<Grads<'a>>, count: u64) -> Result<()> {
        let grads = grads.into();
        let mut w = self.window.write();
        let checked = self.check_add(&w, scaler, grads, count);
        let weight = self.plan.config.weight(count);
        // Under DropMicrobatch the micro-batch is checked before anything is added.
        let (bad, unchecked) = match (&checked, self.plan.config.overflow) {
            (Ok(()), Overflow::DropMicrobatch) => {
                // The check waits for a shard's earlier reductions: one that failed loses the
                // window. A check that fails is this rank's error, which the peers hear of when
                // the micro-batch opens.
                let bad = self.store.bad_gradients(scaler.source(), grads, weight);
                match self.settle_lost(&mut w, bad) {
                    Ok(bad) => (bad, None),
                    Err(e) => (Vec::new(), Some(e)),
                }
            }
            _ => (Vec::new(), None),
        };
        let error = checked.as_ref().err().or(unchecked.as_ref());
        self.store.open_microbatch(w.master(), self.opens_window(&w), true, error)?;
        self.start_window_if_synced(&mut w)?;
        let n = self.plan.descs.len();
        if let Some(&tensor) = bad.first() {
            if self.plan.config.tensor_stats {
                w.count_bad(n, bad);
            }
            let added = self.store.add_nothing(w.master_mut());
            if self.settle_lost(&mut w, added)? {
                (0..n).for_each(|i| self.window.mark_written(&w, i));
            }
            w.drop_microbatch(tensor);
            return Ok(());
        }
        let (state, master) = w.parts();
        let first = |i| !self.window.written(state, i);
        let added = self.store.add(master, scaler.source(), grads, weight, &first);
        let went_bad = self.settle_lost(&mut w, added)?;
        for i in 0..n {
            self.window.mark_written(&w, i);
        }
        if went_bad {
            let stats = self.plan.config.tensor_stats;
            let locate = w.first_bad.is_none();
            // A master the store can scan holds every bad gradient's tensor too, and its first is
            // the place; only a store that cannot (a shard, which also takes other ranks'
            // values) needs this rank's gradients read again.
            let summed = if locate { self.store.first_bad_master(w.master())? } else { None };
            let bad = if stats || (locate && summed.is_none()) {
                self.store.bad_gradients(scaler.source(), grads, weight)?
            } else {
                Vec::new()
            };
            if locate {
                let tensor = bad.first().copied().into_iter().chain(summed).min();
                w.went_bad(tensor.unwrap_or(0));
            }
            if stats {
                w.count_bad(n, bad);
            }
        }
        w.add_microbatch(count);
        Ok(())
    }

    /// `add`'s checks, before anything changes.
    fn check_add(&self, w: &State, scaler: &Scaler, grads: Grads<'_>, count: u64) -> Result<()> {
        w.between_microbatches("add inside begin_microbatch/end_microbatch: use add_tensor, or end the micro-batch first")?;
        self.store.check_open()?;
        let n = self.plan.descs.len();
        if grads.len() != n {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("add got {} gradients, the accumulator has {n} tensors", grads.len()),
            ));
        }
        for i in 0..n {
            self.check_grad(i, grads.get(i), || format!("grads[{i}]"))?;
        }
        self.plan.config.check_count(w.open_count(), count)?;
        self.check_scaler(scaler)
    }

    /// Whether the next micro-batch is its window's first (it assigns).
    fn opens_window(&self, w: &State) -> bool {
        w.synced() || w.microbatches == 0 && !self.window.written(w, 0)
    }

    /// After a failed reduction of a sharded accumulation the window holds part of a
    /// micro-batch: it is discarded, and the call's error says so.
    fn settle_lost<T>(&self, w: &mut State, result: Result<T>) -> Result<T> {
        if !self.store.take_lost() {
            return result;
        }
        self.discard(w)?;
        Err(match result {
            Err(e) => Error::new(e.kind, format!("{} (the window was discarded)", e.message)),
            Ok(_) => Error::new(
                ErrorKind::CommFailure,
                "a reduction of this micro-batch failed in add_tensor; the window was discarded",
            ),
        })
    }

    /// Like [`Accumulator::add`], with the gradients as raw addresses in the accumulator's
    /// memory (host pointers on the CPU, device addresses on CUDA), each checked for null,
    /// alignment and size.
    ///
    /// # Safety
    /// On the CPU, each non-null address must point to its tensor's declared numel readable
    /// values of its dtype for the duration of the call.
    #[cfg(feature = "internal")]
    pub unsafe fn add_raw(
        &self,
        scaler: &Scaler,
        grads: &[*const c_void],
        count: u64,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        match unsafe { crate::backend::raw_gradients(self.device(), grads, self.tensors()) } {
            Ok(g) => self.add(scaler, g.as_grads(), count),
            Err(e) => {
                self.refuse_collective();
                Err(e)
            }
        }
    }

    /// Opens a micro-batch of `count` items whose tensors arrive one by one through `add_tensor`.
    pub fn begin_microbatch(&self, count: u64) -> Result<()> {
        self.begin(count, None)
    }

    /// Opens the window's last micro-batch of `count` items and names the communicator of its
    /// boundary. On CUDA with NCCL, each bucket is all-reduced (under
    /// [`Sharding::ReduceScatter`]: each of its pieces reduced into the piece's shard owner) as
    /// soon as all of its tensors arrived (one contribution each), overlapping the rest of the
    /// backward pass; `sync` over the same communicator completes the boundary. Every rank must
    /// do the same. On the CPU, and under [`Overflow::DropMicrobatch`] (whose micro-batch reaches
    /// the master only when it ends clean), it is `begin_microbatch`.
    pub fn begin_final_microbatch(&self, count: u64, comm: Arc<dyn Communicator>) -> Result<()> {
        self.begin(count, Some(comm))
    }

    fn begin(&self, count: u64, comm: Option<Arc<dyn Communicator>>) -> Result<()> {
        let mut w = self.window.write();
        let checked = w
            .between_microbatches(
                "begin_microbatch while a micro-batch is open: call end_microbatch first",
            )
            .and_then(|()| self.store.check_open())
            .and_then(|()| self.plan.config.check_count(w.open_count(), count))
            .and_then(|()| comm.as_ref().map_or(Ok(()), |c| self.check_comm(&**c)))
            .and_then(|()| self.check_bound(comm.as_deref()));
        let error = checked.as_ref().err();
        self.store.open_microbatch(w.master(), self.opens_window(&w), false, error)?;
        if let Some(c) = &comm {
            self.store.begin_final(c)?;
        }
        self.start_window_if_synced(&mut w)?;
        self.window.open_microbatch(&mut w);
        w.phase = Phase::InMicrobatch { count };
        Ok(())
    }

    /// Adds one contribution to tensor `index` in the open micro-batch. Callable from several
    /// threads at once; a tensor may receive several contributions (a chunked backward).
    ///
    /// Under [`Sharding::Accumulate`] each tensor takes one contribution per micro-batch, and a
    /// refusal fails the micro-batch on every rank when it ends: that policy states the rules.
    pub fn add_tensor<'a>(
        &self,
        scaler: &Scaler,
        index: usize,
        grad: impl Into<Gradient<'a>>,
    ) -> Result<()> {
        let grad = grad.into();
        let w = self.window.read();
        let count = w.microbatch_count()?;
        let added = self
            .plan
            .layout
            .check_index(index)
            .and_then(|()| self.check_grad(index, grad, || "grad".into()))
            .and_then(|()| self.check_scaler(scaler))
            .and_then(|()| {
                let (weight, source) = (self.plan.config.weight(count), scaler.source());
                let drop = self.plan.config.overflow == Overflow::DropMicrobatch;
                // A sharded accumulation reduces a micro-batch as its tensors arrive: a poisoned
                // gradient contributes zeros, and closing the micro-batch drops it on every rank.
                if !drop || self.store.shard().is_some() {
                    // A non-finite sum of a finite gradient is the master's, not the gradient's.
                    // Once the window has its place, only a drop or `tensor_stats` needs to know
                    // which.
                    self.window.contribute(&w, index, |tensor, first| {
                        let went_bad =
                            self.store.add_tensor(tensor, source, grad, weight, first)?;
                        let wanted = drop || self.plan.config.tensor_stats || w.first_bad.is_none();
                        Ok((went_bad && wanted)
                            .then(|| self.store.finite_gradient(source, grad, weight)))
                    })
                } else {
                    self.window.stage(&w, index, |tensor, first| {
                        let went_bad =
                            self.store.stage_tensor(tensor, source, grad, weight, first)?;
                        Ok(went_bad.then_some(Ok(false)))
                    })
                }
            });
        match added {
            Ok(went_bad) => {
                match went_bad.transpose()? {
                    Some(false) => self.window.note_bad(index),
                    Some(true) => self.window.note_overflow(index),
                    None => {}
                }
                Ok(())
            }
            Err(e) => {
                self.refuse_tensor();
                Err(e)
            }
        }
    }

    /// Like [`Accumulator::add_tensor`], with the gradient as a raw address of `numel` elements in
    /// the accumulator's memory, checked for null, alignment, size and the tensor's numel.
    ///
    /// # Safety
    /// On the CPU, a non-null `grad` must point to `numel` readable values of the tensor's dtype
    /// for the duration of the call.
    #[cfg(feature = "internal")]
    pub unsafe fn add_tensor_raw(
        &self,
        scaler: &Scaler,
        index: usize,
        grad: *const c_void,
        numel: usize,
    ) -> Result<()> {
        let checked = self
            .tensors()
            .get(index)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "`index` = {index} is out of range (the accumulator has {} tensors)",
                    self.tensors().len()
                ))
            })
            .and_then(|&desc| {
                if numel != desc.numel {
                    return Err(Error::new(
                        ErrorKind::SizeMismatch,
                        format!(
                            "`numel` = {numel}, but tensor {index} has {} elements",
                            desc.numel
                        ),
                    ));
                }
                dtype::check_buffer(grad, numel, desc.dtype, "grad").map(|()| desc)
            });
        let desc = checked.inspect_err(|_| self.refuse_tensor())?;
        // SAFETY: checked above; readable by the caller's contract.
        let grad = unsafe { crate::backend::raw_gradient(self.device(), grad, desc) };
        self.add_tensor(scaler, index, grad.inspect_err(|_| self.refuse_tensor())?)
    }

    /// Closes the open micro-batch; its count and one micro-batch join the window.
    ///
    /// Under [`Sharding::Accumulate`] a collective: the buckets still waiting are reduced here,
    /// as that policy states.
    pub fn end_microbatch(&self) -> Result<()> {
        let mut w = self.window.write();
        let Phase::InMicrobatch { count } = w.phase else {
            // The other ranks of a sharded accumulation are closing theirs: tell them.
            self.refuse_collective();
            return Err(Error::wrong_state("end_microbatch without begin_microbatch"));
        };
        let closed = self.store.close_microbatch(w.master_mut());
        let dropped_everywhere = self.settle_lost(&mut w, closed)?;
        let drop = self.plan.config.overflow == Overflow::DropMicrobatch;
        let mut bad: Vec<usize> = self.window.bad_tensors().collect();
        if drop {
            bad.extend(self.store.staged_bad()?);
            bad.sort_unstable();
            bad.dedup();
        }
        if self.plan.config.tensor_stats {
            w.count_bad(self.plan.descs.len(), bad.iter().copied());
        }
        if drop && (dropped_everywhere || !bad.is_empty()) {
            // A sharded accumulation's shard is as before the micro-batch: what its hooks
            // marked written is not, when the micro-batch opened the window.
            if self.store.shard().is_some_and(sharding::Shard::first) {
                self.window.forget_written();
            }
            match bad.first() {
                Some(&tensor) => w.drop_microbatch(tensor),
                // Another rank's gradient was poisoned.
                None => w.drop_microbatch_unlocated(),
            }
            return Ok(());
        }
        if let Some(tensor) = bad.first().copied().into_iter().chain(self.window.overflowed()).min()
        {
            w.went_bad(tensor);
        }
        if drop {
            let staged: Vec<usize> = self.window.staged(&w).collect();
            for i in staged {
                // The kept micro-batch's sum overflowed the master: a place, not a bad gradient.
                let first = !self.window.written(&w, i);
                if self.store.merge_staged(w.master_mut(), i, first)? {
                    w.went_bad(i);
                }
                self.window.mark_written(&w, i);
            }
        }
        if self.store.bound().is_some() {
            // Every bucket was reduced: the whole shard is written.
            for i in 0..self.plan.descs.len() {
                self.window.mark_written(&w, i);
            }
        }
        w.add_microbatch(count);
        Ok(())
    }

    /// The boundary. With a communicator, every rank of its group must call it: the control
    /// values are agreed first (so ranks agree on counts and overflow, and fail together where
    /// the transport can tell them), then the master is summed bucket by bucket, normalised,
    /// measured and clipped. `None` is the single-process boundary, or a sharded accumulation's
    /// own communicator ([`Sharding::Accumulate`]). On CUDA this waits for the accumulator's
    /// stream to read the info; [`Accumulator::sync_enqueue`] does not.
    pub fn sync(&self, comm: Option<&dyn Communicator>) -> Result<SyncInfo> {
        self.boundary(comm, None, true)?
            .ok_or_else(|| Error::new(ErrorKind::Internal, "a read boundary returned no info"))
    }

    /// The boundary without reading its info: on CUDA everything is enqueued on the accumulator's
    /// stream and the call returns at once (the info stays on the device for the scaler's
    /// update); on the CPU it is [`Accumulator::sync`].
    pub fn sync_enqueue(&self, comm: Option<&dyn Communicator>) -> Result<()> {
        self.boundary(comm, None, false).map(drop)
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
        self.boundary(Some(shard), Some(replicas), true)?
            .ok_or_else(|| Error::new(ErrorKind::Internal, "a read boundary returned no info"))
    }

    fn boundary(
        &self,
        comm: Option<&dyn Communicator>,
        replicas: Option<&dyn Communicator>,
        read: bool,
    ) -> Result<Option<SyncInfo>> {
        // Sharded accumulation reduces over its own communicator; `None` names it too.
        if let Err(e) = self.check_bound(comm) {
            // The shard group, then the replicas, as the boundary's control step would.
            self.refuse_collective();
            replicas.into_iter().for_each(protocol::refuse);
            return Err(e);
        }
        let comm = comm.or(self.store.bound());
        let result = self.run_boundary(comm, replicas, read);
        if let Err(e) = &result {
            // A boundary past its deadline ends this rank's use of its groups, on every transport.
            if e.kind == ErrorKind::Timeout {
                for c in comm.iter().chain(&replicas) {
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
    ) -> Result<Option<SyncInfo>> {
        let groups = || comm.iter().chain(&replicas).copied();
        if let Err(e) = groups()
            .try_for_each(|c| self.check_comm(c))
            .and_then(|()| self.check_replicas(replicas))
        {
            groups().for_each(protocol::refuse);
            return Err(e);
        }
        let mut w = self.window.write();
        let error = w
            .in_microbatch()
            .then(|| Error::wrong_state("sync inside a micro-batch: call end_microbatch first"))
            .or_else(|| self.check_shard_comm(comm).err());
        // A sync right after a sync closes a new, empty window: a rank with no micro-batch this
        // time still takes part in the boundary of the others.
        let empty_again = w.synced();
        let (count, microbatches, ranks) =
            if empty_again { (0, 0, 1) } else { (w.count, w.microbatches, w.rank_windows()) };
        let (dropped, first_bad) = if empty_again { (0, None) } else { (w.dropped, w.first_bad) };
        let nonfinite = match (self.plan.config.tensor_stats, empty_again) {
            (false, _) => Vec::new(),
            (true, true) => vec![0; self.plan.descs.len()],
            (true, false) => w.nonfinite(self.plan.descs.len()),
        };
        let proposal = Proposal {
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
        };
        let agreed = self.store.agree(&proposal).map_err(|e| match e.kind {
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
        })?;
        if let Some(t) = &agreed.totals {
            if t.microbatches == 0 && t.dropped != 0 {
                // Every micro-batch of every rank was dropped: nothing to reduce, the step is
                // skipped, and the master reads as zeros.
                if empty_again {
                    self.discard(&mut w)?;
                }
                self.zero_untouched(&mut w)?;
                self.store.set_found_inf(true)?;
                if let Err(e) = self.store.count_only(&proposal) {
                    let _ = self.discard(&mut w);
                    return Err(Error::new(
                        e.kind,
                        format!("{} (the window was discarded)", e.message),
                    ));
                }
                let info = SyncInfo { found_inf: true, ..SyncInfo::of(t, 0.0, 1.0) };
                w.phase = Phase::Synced(Some(info));
                return Ok(Some(info));
            }
            if t.microbatches == 0 {
                return Err(Error::new(
                    ErrorKind::EmptyWindow,
                    "sync on an empty window: no rank added a micro-batch",
                ));
            }
            if self.plan.config.normalize.divisor(t.count, t.microbatches, t.ranks) == 0 {
                return Err(Error::new(
                    ErrorKind::EmptyWindow,
                    "the window's global item count is 0: nothing to normalise by",
                ));
            }
        }

        // From here on the window is consumed: every rank passed the same checks, and a failure
        // discards the window (a retry must not reduce a bucket twice).
        let proposal = Proposal { error: None, ..proposal };
        let result = self.consume(&mut w, empty_again, &proposal, &agreed, read);
        match result {
            Ok(info) => {
                w.phase = Phase::Synced(info);
                Ok(info)
            }
            Err(e) => {
                let _ = self.discard(&mut w);
                Err(Error::new(e.kind, format!("{} (the window was discarded)", e.message)))
            }
        }
    }

    /// Takes part in the collective that this rank's invalid call would have joined, so that the
    /// other ranks fail instead of waiting: under sharded accumulation every micro-batch and
    /// boundary is a collective over the creation communicator. Nothing otherwise.
    pub(crate) fn refuse_collective(&self) {
        self.store.refuse();
    }

    /// An `add_tensor` that failed before reaching the accumulator (an argument refused on the
    /// way): under sharded accumulation the open micro-batch then fails on every rank when it
    /// ends.
    pub(crate) fn refuse_tensor(&self) {
        self.store.note_invalid();
    }

    /// A sharded accumulation reduces over the communicator it was created with: another is
    /// refused (`None` names its own).
    fn check_bound(&self, comm: Option<&dyn Communicator>) -> Result<()> {
        match (self.store.bound(), comm) {
            (Some(b), Some(c)) if !std::ptr::addr_eq(b, c) => Err(Error::invalid(
                "a sharded accumulation reduces over the communicator it was created with; this call got another (pass it, or none)",
            )),
            _ => Ok(()),
        }
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

    /// Each tensor's telemetry of the last boundary, the same on every rank: the norm of its
    /// reduced, normalised gradient and in how many micro-batches it went non-finite. Needs
    /// [`AccumulatorConfig::tensor_stats`] and a window synced with its info read (else
    /// `WrongState`).
    pub fn tensor_stats(&self) -> Result<Vec<TensorStats>> {
        if !self.plan.config.tensor_stats {
            return Err(Error::wrong_state(
                "tensor_stats is off in this accumulator's config: nothing was measured",
            ));
        }
        match self.window.read().phase {
            Phase::Synced(Some(_)) => self.store.tensor_stats().ok_or_else(|| {
                Error::new(ErrorKind::Internal, "a synced boundary left no tensor stats")
            }),
            _ => Err(Error::wrong_state(
                "tensor_stats needs a window synced with its info read: call sync first",
            )),
        }
    }

    /// The last boundary's result, while the window is still synced and its info was read.
    pub fn synced_info(&self) -> Option<SyncInfo> {
        match self.window.read().phase {
            Phase::Synced(info) => info,
            _ => None,
        }
    }

    /// Discards the window in progress (or the synced result): the next micro-batch starts afresh.
    ///
    /// Under [`Sharding::Accumulate`], inside a micro-batch it ends the micro-batch as
    /// `end_microbatch` does (the other ranks' reductions pair with it), then discards.
    pub fn reset(&self) -> Result<()> {
        let mut w = self.window.write();
        self.store.end_final()?;
        let closed = if w.in_microbatch() {
            self.store.close_microbatch(w.master_mut()).map(drop)
        } else {
            Ok(())
        };
        self.store.take_lost();
        self.discard(&mut w)?;
        closed
    }

    /// Copies tensor `index`'s FP32 master gradient to `out` (all zeros for a tensor that received
    /// nothing in a synced window). On CUDA this waits for the accumulator's stream.
    /// Under [`Sharding::Accumulate`], only a tensor inside the shard can be read.
    pub fn read_master(&self, index: usize, out: &mut [f32]) -> Result<()> {
        let r = self.held_tensor(index)?;
        // After a final micro-batch began, its buckets are being reduced on another stream.
        self.store.check_open()?;
        if out.len() != r.len() {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("output holds {} values, tensor {index} has {}", out.len(), r.len()),
            ));
        }
        let w = self.window.write();
        self.store.read(w.master(), r, out)
    }

    /// Runs `f` on tensor `index`'s FP32 master gradient: in place on the CPU, on a host copy on
    /// a device.
    pub fn with_master<R>(&self, index: usize, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        self.held_tensor(index)?;
        self.store.check_open()?;
        let w = self.window.write();
        let (mut f, mut out) = (Some(f), None);
        let run = &mut |master: &[f32]| out = f.take().map(|f| f(master));
        self.store.view(w.master(), self.range(index), run)?;
        Ok(out.expect("a view runs once"))
    }

    /// Address of tensor `index`'s master gradient (a device address on CUDA) and its length, for
    /// callers across the C boundary. The buffer never moves while the accumulator lives.
    pub fn master_ptr(&self, index: usize) -> Result<(*mut f32, usize)> {
        let r = self.held_tensor(index)?;
        Ok((self.store.master_address(r.start), r.len()))
    }

    /// Tensor `index`'s range, when the store holds all of it.
    fn held_tensor(&self, index: usize) -> Result<Range<usize>> {
        self.plan.layout.check_index(index)?;
        let (r, held) = (self.range(index), self.plan.held());
        if r.start < held.start || r.end > held.end {
            return Err(Error::invalid(format!(
                "tensor {index} (elements {r:?}) is not inside this rank's shard {held:?}: a sharded accumulation holds only its shard (gradacc_accumulator_shard; shard() in Rust)"
            )));
        }
        Ok(r)
    }

    /// Runs `f` on the synced window's id, its info and this rank's part of the reduced gradient
    /// ([`Accumulator::shard`]'s range, on the host), holding the window so that nothing changes
    /// it meanwhile: what an optimizer steps from. `WrongState` naming `what` unless synced.
    pub(crate) fn with_reduced<R>(
        &self,
        what: &str,
        f: impl FnOnce(u64, SyncInfo, &[f32]) -> R,
    ) -> Result<R> {
        let w = self.window.write();
        let (window, info) = synced_window(&w, what)?;
        self.store.check_open()?;
        let (mut f, mut out) = (Some(f), None);
        let run = &mut |g: &[f32]| out = f.take().map(|f| f(window, info, g));
        self.store.view(w.master(), self.plan.shard(), run)?;
        Ok(out.expect("a view runs once"))
    }

    /// The synced window's id, checked as [`Accumulator::with_reduced`] checks it.
    pub(crate) fn synced_window(&self, what: &str) -> Result<u64> {
        synced_window(&self.window.read(), what).map(|(window, _)| window)
    }

    /// [`Accumulator::with_reduced`] on a device: `f` gets the synced window's id, its info when
    /// the host has it (after `sync`; none after `sync_enqueue`) and where the reduced gradient
    /// and the boundary's result are in device memory, holding the window meanwhile. Nothing
    /// waits for the device. `WrongState` naming `what` unless synced.
    pub(crate) fn with_reduced_on_device<R>(
        &self,
        what: &str,
        f: impl FnOnce(u64, Option<SyncInfo>, Reduced) -> Result<R>,
    ) -> Result<R> {
        let w = self.window.write();
        let (window, info) = synced_on_device(&w, what)?;
        self.store.check_open()?;
        let reduced = self.store.reduced().ok_or_else(|| {
            Error::new(ErrorKind::DeviceMismatch, format!("{what}: the accumulator is on the CPU"))
        })?;
        f(window, info, reduced)
    }

    /// The synced window's id, checked as [`Accumulator::with_reduced_on_device`] checks it.
    pub(crate) fn synced_window_on_device(&self, what: &str) -> Result<u64> {
        synced_on_device(&self.window.read(), what).map(|(window, _)| window)
    }

    pub(crate) fn plan(&self) -> &Arc<Plan> {
        &self.plan
    }

    /// The communicator a sharded accumulation is bound to.
    pub(crate) fn bound(&self) -> Option<&dyn Communicator> {
        self.store.bound()
    }

    /// Checks that the window is synced (WRONG_STATE naming `what` otherwise) and returns its
    /// info when the host has it.
    pub(crate) fn check_synced(&self, what: &str) -> Result<Option<SyncInfo>> {
        match self.window.read().phase {
            Phase::Synced(info) => Ok(info),
            _ => Err(Error::wrong_state(format!(
                "{what} has not been synced in its current window: call sync first"
            ))),
        }
    }

    /// Enqueues the gather of the synced boundary's overflow flag into a scaler's device state.
    pub(crate) fn gather_into(&self, scaler: &dyn DeviceScale, what: &str) -> Result<()> {
        let w = self.window.read();
        if !w.synced() {
            return Err(Error::wrong_state(format!(
                "{what} has not been synced in its current window: call sync first"
            )));
        }
        self.store.gather_into(scaler)
    }

    fn discard(&self, w: &mut State) -> Result<()> {
        w.next();
        self.store.clear_found_inf()
    }

    fn start_window_if_synced(&self, w: &mut State) -> Result<()> {
        if w.synced() {
            self.discard(w)?;
        }
        Ok(())
    }

    fn check_scaler(&self, scaler: &Scaler) -> Result<()> {
        Device::require_same(("the scaler", scaler.device()), ("the accumulator", self.device()))
    }

    fn check_comm(&self, comm: &dyn Communicator) -> Result<()> {
        Device::require_same(
            ("the communicator", comm.device()),
            ("the accumulator", self.device()),
        )
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

/// The id of a synced window and its info if the host has it; `WrongState` naming `what`
/// otherwise.
fn synced_on_device(w: &State, what: &str) -> Result<(u64, Option<SyncInfo>)> {
    match w.phase {
        Phase::Synced(info) => Ok((w.id, info)),
        _ => Err(Error::wrong_state(format!(
            "{what} needs a synced window: call sync first (a window steps the optimizer once)"
        ))),
    }
}

/// The id and info of a synced window whose boundary's result is on the host; `WrongState`
/// naming `what` otherwise.
fn synced_window(w: &State, what: &str) -> Result<(u64, SyncInfo)> {
    let (id, info) = synced_on_device(w, what)?;
    let info = info.ok_or_else(|| {
        Error::wrong_state(format!(
            "{what} needs the boundary's result on the host: sync, not sync_enqueue"
        ))
    })?;
    Ok((id, info))
}
