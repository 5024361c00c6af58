//! The add path: a micro-batch added whole (`add`) or tensor by tensor (`begin_microbatch`,
//! `add_tensor`, `end_microbatch`). Every check runs before anything changes; then the store's
//! pass, and the window learns what was written, dropped, or where it first went non-finite.

use std::ffi::c_void;
use std::sync::Arc;

use super::window::{Phase, State};
// The policy the docs below name; the code never needs it.
#[cfg(doc)]
use super::Sharding;
use super::{sharding, Accumulator, Gradient, Grads, Overflow};
use crate::comm::Communicator;
use crate::device::Device;
use crate::dtype;
use crate::error::{Error, ErrorKind, Result};
use crate::scaler::Scaler;

impl Accumulator {
    /// Adds one micro-batch: every tensor's gradient, scaled by `scaler`'s current scale, for
    /// `count` items. Fails without changing anything on a wrong tensor count, length, dtype or
    /// device. On CUDA the work is enqueued on the accumulator's stream (one launch for up to
    /// 224 tensors) and the call returns without waiting; the buffers must stay valid until the
    /// stream has run it.
    ///
    /// Under [`Sharding::Accumulate`] a collective: every rank calls it alike, and a failure
    /// ends as that policy states.
    pub fn add<'a>(&self, scaler: &Scaler, grads: impl Into<Grads<'a>>, count: u64) -> Result<()> {
        self.add_with(scaler, grads.into(), count, false)
    }

    /// [`Accumulator::add`] of the window's last micro-batch, which the boundary follows. On the
    /// CPU, where the boundary's pass only measures (with clipping, or
    /// [`Normalize::None`](super::Normalize::None)), the add also sums the norm's blocks (and
    /// with `tensor_stats` each tensor's squares) of the master while each piece of it is in
    /// cache, and a boundary that reduces nothing between ranks (no communicator, or a group of
    /// one) takes them instead of reading the master again: the same bits, one pass fewer.
    /// Whatever writes the master after it (another add, `add_tensor`, a restore, an address
    /// taken with `master_ptr` or `shard`) leaves the boundary to measure for itself, so a
    /// micro-batch wrongly called the last costs the saving, never the result. Under
    /// [`Sharding::Accumulate`], and on CUDA, it is `add`.
    pub fn add_final<'a>(
        &self,
        scaler: &Scaler,
        grads: impl Into<Grads<'a>>,
        count: u64,
    ) -> Result<()> {
        self.add_with(scaler, grads.into(), count, true)
    }

    /// `add`, measuring the result for the boundary when `last` ([`Accumulator::add_final`]).
    fn add_with(&self, scaler: &Scaler, grads: Grads<'_>, count: u64, last: bool) -> Result<()> {
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
        let added = match last {
            true => self.store.add_final(master, scaler.source(), grads, weight, &first),
            false => self.store.add(master, scaler.source(), grads, weight, &first),
        };
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
        unsafe { self.add_raw_with(scaler, grads, count, false) }
    }

    /// [`Accumulator::add_final`] with the gradients as raw addresses, as
    /// [`Accumulator::add_raw`] takes them.
    ///
    /// # Safety
    /// As [`Accumulator::add_raw`].
    #[cfg(feature = "internal")]
    pub unsafe fn add_final_raw(
        &self,
        scaler: &Scaler,
        grads: &[*const c_void],
        count: u64,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.add_raw_with(scaler, grads, count, true) }
    }

    /// # Safety
    /// As [`Accumulator::add_raw`].
    #[cfg(feature = "internal")]
    unsafe fn add_raw_with(
        &self,
        scaler: &Scaler,
        grads: &[*const c_void],
        count: u64,
        last: bool,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        match unsafe { crate::backend::raw_gradients(self.device(), grads, self.tensors()) } {
            Ok(g) => self.add_with(scaler, g.as_grads(), count, last),
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
        self.end_microbatch_with(false)
    }

    /// Whether the open micro-batch (fed tensor by tensor, under [`Overflow::DropMicrobatch`],
    /// not a sharded accumulation) holds a non-finite gradient: what `end_microbatch` would drop.
    /// Changes nothing.
    pub(crate) fn microbatch_poisoned(&self) -> Result<bool> {
        let w = self.window.read();
        w.microbatch_count().map_err(|_| {
            Error::wrong_state("no micro-batch is open: call begin_microbatch and add_tensor first")
        })?;
        if self.plan.config.overflow != Overflow::DropMicrobatch {
            return Err(Error::invalid(
                "the accumulator does not drop micro-batches (create it with overflow = \
                 DropMicrobatch)",
            ));
        }
        if self.store.shard().is_some() {
            return Err(Error::invalid(
                "a sharded accumulation (Sharding::Accumulate) reduces its micro-batch as it \
                 arrives: its drops are its group's own; use Sharding::ReduceScatter or None",
            ));
        }
        Ok(self.window.bad_tensors().next().is_some() || !self.store.staged_bad()?.is_empty())
    }

    /// `end_microbatch`, dropping the micro-batch also when `peer_dropped` (a peer that saw the
    /// same data dropped it: [`crate::Mesh::end_microbatch`]).
    pub(crate) fn end_microbatch_with(&self, peer_dropped: bool) -> Result<()> {
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
        if drop && (dropped_everywhere || peer_dropped || !bad.is_empty()) {
            // A sharded accumulation's shard is as before the micro-batch: what its hooks
            // marked written is not, when the micro-batch opened the window.
            if self.store.shard().is_some_and(sharding::Shard::first) {
                self.window.forget_written();
            }
            match bad.first() {
                Some(&tensor) => w.drop_microbatch(tensor),
                // Another rank's gradient was poisoned (of this group, or a peer that saw the same
                // data).
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

    fn check_scaler(&self, scaler: &Scaler) -> Result<()> {
        Device::require_same(("the scaler", scaler.device()), ("the accumulator", self.device()))
    }
}

#[cfg(test)]
mod tests {
    //! Where `add_final`'s measurement is kept for the boundary, and where it is not (the bits
    //! are the same either way: `tests/final_add.rs`).

    use super::*;
    use crate::accumulator::{AccumulatorConfig, Normalize, Sharding, TensorDesc};
    use crate::dtype::{Dtype, Grad};
    use crate::scaler::ScalerConfig;

    #[test]
    fn the_last_add_keeps_its_measurement_until_the_master_changes() {
        let tensors = [
            TensorDesc { numel: 5000, dtype: Dtype::F32 },
            TensorDesc { numel: 3, dtype: Dtype::F32 },
        ];
        let (a, b) = (vec![0.5f32; 5000], vec![-2.0f32; 3]);
        let grads = [Grad::F32(&a), Grad::F32(&b)];
        let scaler = Scaler::new(ScalerConfig::default()).unwrap();
        let clip = AccumulatorConfig { max_grad_norm: 1.0, ..Default::default() };
        let make = |config| Accumulator::new(config, &tensors).unwrap();
        let acc = make(clip);
        acc.add(&scaler, &grads[..], 1).unwrap();
        assert!(!acc.store.holds_fold(), "a plain add measures nothing");
        acc.add_final(&scaler, &grads[..], 1).unwrap();
        assert!(acc.store.holds_fold(), "the last add's measurement");
        acc.sync_for_step(None).unwrap();
        assert!(!acc.store.holds_fold(), "the boundary takes it");
        acc.add_final(&scaler, &grads[..], 1).unwrap();
        acc.add(&scaler, &grads[..], 1).unwrap();
        assert!(!acc.store.holds_fold(), "an add after it");
        acc.add_final(&scaler, &grads[..], 1).unwrap();
        let _ = acc.master_ptr(1).unwrap();
        assert!(!acc.store.holds_fold(), "an address that may write");
        acc.sync(None).unwrap();
        // Where the boundary's pass normalises as it measures, and a shard: nothing is kept.
        let plain = AccumulatorConfig { normalize: Normalize::None, ..Default::default() };
        let divided = AccumulatorConfig { normalize: Normalize::ByCount, ..Default::default() };
        let shard =
            AccumulatorConfig { sharding: Sharding::Accumulate { shards: 1, rank: 0 }, ..clip };
        for (config, kept) in [(plain, true), (divided, false), (shard, false)] {
            let acc = make(config);
            acc.add_final(&scaler, &grads[..], 1).unwrap();
            assert_eq!(acc.store.holds_fold(), kept, "{config:?}");
        }
    }
}
