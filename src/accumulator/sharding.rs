//! Sharding as a policy of the core: how a micro-batch is cut into the parts that are reduced
//! one at a time, the same on every device and every rank (the control step checks that the
//! ranks cut alike).
//!
//! A whole micro-batch (`add`) goes by stripes ([`Stripes`]): stripe k holds the k-th slice of
//! every shard, so each reduce-scatter is balanced. Tensors arriving one by one (hooks) go by
//! buckets in the backward's order, the last bucket first, each reduced as soon as its tensors
//! have landed ([`BucketSchedule`]); under sharded accumulation each bucket fills a staging
//! buffer first ([`Hooks`]). A device supplies only what it does to a staging buffer
//! ([`Stages`]): take one, zero part of it, reduce it. What a sharded accumulation's window
//! knows beyond its memory (its group, the shards, and its flags) is a [`Shard`], the same on
//! every device, and so is the order of a micro-batch's turns ([`Shard::open_microbatch`],
//! [`Shard::close_microbatch`]): a device supplies each turn's work ([`Turns`]).

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use super::layout::Layout;
use super::{protocol, MasterWrite, Overflow, Plan, Sharding};
use crate::comm::Communicator;
use crate::error::{Error, ErrorKind, Result};
use crate::math::NORM_BLOCK;

/// The part of `a` inside `b`; when they do not meet, an empty range at the end of `b` nearest
/// to `a`.
pub(crate) fn intersect(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    a.start.clamp(b.start, b.end)..a.end.clamp(b.start, b.end)
}

/// `r` counted from `base`.
pub(crate) fn relative(r: &Range<usize>, base: usize) -> Range<usize> {
    r.start - base..r.end - base
}

/// The stripes of a whole micro-batch: stripe k is the k-th slice of [`Stripes::len`] elements
/// of every shard (shorter or empty past a shard's end).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stripes {
    /// Elements of each shard in one stripe: a bucket's worth over all ranks, in whole norm
    /// blocks (so that a shard's block sums are the all-reduce's).
    pub len: usize,
    /// Stripes in a micro-batch: enough for the first shard, the longest.
    pub count: usize,
}

impl Stripes {
    pub(crate) fn new(plan: &Plan, shards: &[Range<usize>]) -> Self {
        // Clamped first: a bucket_numel near usize::MAX ("one bucket") must not wrap.
        let len = plan
            .config
            .bucket_numel
            .div_ceil(shards.len())
            .min(plan.layout.len())
            .max(1)
            .next_multiple_of(NORM_BLOCK);
        Stripes { len, count: shards[0].len().div_ceil(len) }
    }

    /// `shard`'s slice in stripe `k`.
    pub(crate) fn slice(&self, shard: &Range<usize>, k: usize) -> Range<usize> {
        intersect(&(shard.start + k * self.len..shard.start + (k + 1) * self.len), shard)
    }
}

/// The buckets of a micro-batch whose tensors arrive one by one, reduced in the backward's order
/// (the last bucket first), each once all of its tensors have landed, and only in that order, so
/// every rank issues the same collectives in the same sequence.
#[derive(Debug)]
pub(crate) struct BucketSchedule {
    /// Each bucket's tensors.
    tensors: Vec<Range<usize>>,
    /// Each tensor has landed.
    landed: Vec<bool>,
    /// Each bucket's tensors still to land.
    missing: Vec<usize>,
    /// Buckets reduced so far.
    reduced: usize,
}

impl BucketSchedule {
    pub(crate) fn new(layout: &Layout, tensors: usize) -> Self {
        let mut of_bucket = vec![0..0; layout.buckets().len()];
        for i in 0..tensors {
            let t = &mut of_bucket[layout.bucket_of(i)];
            *t = if t.start == t.end { i..i + 1 } else { t.start..i + 1 };
        }
        let missing = of_bucket.iter().map(|t| t.len()).collect();
        BucketSchedule { tensors: of_bucket, landed: vec![false; tensors], missing, reduced: 0 }
    }

    /// A new micro-batch: nothing has landed, nothing is reduced.
    pub(crate) fn restart(&mut self) {
        self.landed.fill(false);
        for (missing, tensors) in self.missing.iter_mut().zip(&self.tensors) {
            *missing = tensors.len();
        }
        self.reduced = 0;
    }

    pub(crate) fn landed(&self, index: usize) -> bool {
        self.landed[index]
    }

    /// Tensor `index` (of bucket `bucket`) landed; `false` when it had already.
    pub(crate) fn land(&mut self, index: usize, bucket: usize) -> bool {
        if std::mem::replace(&mut self.landed[index], true) {
            return false;
        }
        self.missing[bucket] -= 1;
        true
    }

    /// The next bucket to reduce, when all of its tensors have landed (with `all`, whatever
    /// landed); `None` once every bucket is reduced.
    pub(crate) fn next(&self, all: bool) -> Option<usize> {
        let b = self.tensors.len().checked_sub(self.reduced + 1)?;
        (all || self.missing[b] == 0).then_some(b)
    }

    /// The bucket [`BucketSchedule::next`] gave is reduced (or its reduction was issued).
    pub(crate) fn advance(&mut self) {
        self.reduced += 1;
    }

    /// Buckets not reduced yet: the first this many (the schedule reduces the last first).
    pub(crate) fn waiting(&self) -> usize {
        self.tensors.len() - self.reduced
    }

    /// Bucket `b`'s tensors.
    pub(crate) fn tensors(&self, b: usize) -> Range<usize> {
        self.tensors[b].clone()
    }
}

/// This rank's part of a sharded accumulation: the group it reduces every micro-batch over,
/// every rank's shard, and the window's flags that the accumulator reads back through the store
/// (whether the micro-batch assigns, was refused on this rank, or lost a reduction).
pub(crate) struct Shard {
    /// The shard group; none only for one shard created without one.
    comm: Option<Arc<dyn Communicator>>,
    pub rank: usize,
    /// Every rank's range of the flat layout, and this rank's.
    pub shards: Vec<Range<usize>>,
    pub own: Range<usize>,
    pub stripes: Stripes,
    /// A poisoned gradient is dropped (`Overflow::DropMicrobatch`).
    pub drops: bool,
    /// The open micro-batch assigns the shard (the window's first).
    first: AtomicBool,
    /// An `add_tensor` of the open micro-batch was refused on this rank: closing it fails every
    /// rank.
    invalid: AtomicBool,
    /// A gradient of the open micro-batch was not finite on this rank (`Overflow::DropMicrobatch`):
    /// closing it drops it on every rank.
    poisoned: AtomicBool,
    /// A reduction failed after the micro-batch's control step: the shard holds part of it.
    lost: AtomicBool,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard").field("own", &self.own).field("shards", &self.shards).finish()
    }
}

impl Shard {
    /// The shard `plan` assigns this rank, reduced over `comm` (whose size and rank the
    /// accumulator checked).
    pub(crate) fn new(plan: &Plan, comm: Option<Arc<dyn Communicator>>) -> Result<Self> {
        let Sharding::Accumulate { rank, .. } = plan.config.sharding else {
            return Err(Error::new(
                ErrorKind::Internal,
                "a sharded store for an accumulator that does not shard",
            ));
        };
        let shards = plan.shards();
        let own = shards[rank].clone();
        let stripes = Stripes::new(plan, &shards);
        Ok(Shard {
            comm,
            rank,
            shards,
            own,
            stripes,
            drops: plan.config.overflow == Overflow::DropMicrobatch,
            first: AtomicBool::new(true),
            invalid: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            lost: AtomicBool::new(false),
        })
    }

    /// The communicator every micro-batch is reduced over.
    pub(crate) fn comm(&self) -> Option<&dyn Communicator> {
        self.comm.as_deref()
    }

    /// A micro-batch opens, the window's first with `first`: nothing of it is refused or
    /// poisoned yet.
    pub(crate) fn open(&self, first: bool) {
        self.first.store(first, Ordering::Relaxed);
        self.invalid.store(false, Ordering::Relaxed);
        self.poisoned.store(false, Ordering::Relaxed);
    }

    /// The open micro-batch assigns the shard.
    pub(crate) fn first(&self) -> bool {
        self.first.load(Ordering::Relaxed)
    }

    pub(crate) fn note_invalid(&self) {
        self.invalid.store(true, Ordering::Relaxed);
    }

    /// A gradient of the open micro-batch was not finite on this rank; it contributed zeros.
    pub(crate) fn note_poisoned(&self) {
        self.poisoned.store(true, Ordering::Relaxed);
    }

    /// A reduction failed after part of a micro-batch reached the shard.
    pub(crate) fn lose(&self) {
        self.lost.store(true, Ordering::Relaxed);
    }

    /// Whether the window was lost since the last call.
    pub(crate) fn take_lost(&self) -> bool {
        self.lost.swap(false, Ordering::Relaxed)
    }

    /// The control step that closes a micro-batch added tensor by tensor: `exchange` runs it with
    /// this rank's error when one of its `add_tensor` calls was refused (which left its tensor
    /// out of every rank's sums), and whether a gradient of it was poisoned here; it returns
    /// whether one was on any rank (every rank then drops the micro-batch). A failure loses the
    /// window.
    pub(crate) fn close(
        &self,
        exchange: impl FnOnce(Option<&Error>, bool) -> Result<bool>,
    ) -> Result<bool> {
        let own = self.invalid.load(Ordering::Relaxed).then(protocol::refused_here);
        let poisoned = self.poisoned.load(Ordering::Relaxed);
        exchange(own.as_ref(), poisoned).inspect_err(|_| self.lose())
    }

    /// A micro-batch opens, the window's first with `first`, `whole` from `add` (else tensor by
    /// tensor): under [`Overflow::DropMicrobatch`] a micro-batch fed tensor by tensor first keeps
    /// the shard (before the opening step, so that a rank that cannot keep it fails every rank,
    /// as an invalid call does); then the opening step with this rank's `error`; then the
    /// window's flags and, tensor by tensor, the bucket schedule start afresh.
    pub(crate) fn open_microbatch<D: Turns>(
        &self,
        device: &D,
        master: &MasterWrite,
        hooks: &mut Hooks<D::Stage>,
        first: bool,
        whole: bool,
        error: Option<&Error>,
    ) -> Result<()> {
        let keeps = !whole && self.drops && error.is_none();
        let kept = if keeps { device.keep_before(master, first).err() } else { None };
        device.open_step(whole, error.or(kept.as_ref()))?;
        self.open(first);
        if !whole {
            hooks.open();
        }
        Ok(())
    }

    /// The micro-batch `open_microbatch` opened tensor by tensor ends: the buckets still waiting
    /// are reduced (absent tensors as zeros), the device joins its work, then the closing step
    /// tells every rank whether a rank's call was refused or a gradient poisoned; when one was,
    /// each rank puts back its shard as the micro-batch found it. Returns whether it did. The
    /// staging goes back to the spares, of which [`Turns::KEPT`] stay.
    pub(crate) fn close_microbatch<D: Turns>(
        &self,
        device: &D,
        master: &mut MasterWrite,
        layout: &Layout,
        hooks: &mut Hooks<D::Stage>,
    ) -> Result<bool> {
        let open = hooks.open;
        let reduced = if open { hooks.reduce_ready(device, layout, true) } else { Ok(()) };
        let joined = device.join();
        let result = reduced.and_then(|()| {
            if !open {
                return Ok(false);
            }
            // A rank that cannot join, or read its flags, never reaches the closing step its
            // peers wait in.
            let poisoned =
                joined.and_then(|()| device.poisoned()).inspect_err(|_| device.failed())?;
            if poisoned {
                self.note_poisoned();
            }
            let dropped = self.close(|own, poisoned| device.close_step(own, poisoned))?;
            if dropped {
                device.restore(master).inspect_err(|_| self.lose())?;
            }
            Ok(dropped)
        });
        hooks.finish(D::KEPT);
        result
    }

    /// The part of flat `range` this rank holds, counted from the shard's start.
    pub(crate) fn held(&self, range: &Range<usize>) -> Range<usize> {
        relative(&intersect(range, &self.own), self.own.start)
    }

    /// The shard element of flat element `offset`, clamped into the shard (an address for a
    /// tensor outside it is never used).
    pub(crate) fn offset(&self, offset: usize) -> usize {
        offset.saturating_sub(self.own.start).min(self.own.len())
    }
}

/// What a device does with a bucket's staging under sharded accumulation.
pub(crate) trait Stages {
    type Stage;

    /// A staging buffer for a bucket that holds none yet: one of `hooks`' spares, or a new one.
    fn take(&self, hooks: &mut Hooks<Self::Stage>) -> Result<Self::Stage>;

    /// Zeroes master elements `range` (inside bucket `b`) of bucket `b`'s staging.
    fn zero(&self, stage: &mut Self::Stage, b: usize, range: Range<usize>) -> Result<()>;

    /// Reduces bucket `b`'s staging over the shard group and adds this rank's part into the
    /// shard.
    fn reduce(&self, stage: &mut Self::Stage, b: usize) -> Result<()>;

    /// Taking, zeroing or reducing a bucket failed: the peers wait for this rank's reductions.
    fn failed(&self) {}
}

/// The work of each turn of a sharded accumulation's micro-batch on a device, in the order
/// [`Shard::open_microbatch`] and [`Shard::close_microbatch`] take them.
pub(crate) trait Turns: Stages {
    /// Staging buffers kept between micro-batches.
    const KEPT: usize;

    /// Keeps the shard and the window's flag as they are, for [`Turns::restore`]; a micro-batch
    /// that opens the window (`first`) keeps a clear flag (the core clears a synced window's only
    /// after this turn).
    fn keep_before(&self, master: &MasterWrite, first: bool) -> Result<()>;

    /// Puts back what [`Turns::keep_before`] kept: the micro-batch is dropped.
    fn restore(&self, master: &mut MasterWrite) -> Result<()>;

    /// The step that opens a micro-batch over the shard group, this rank with `error` taking
    /// part so that every rank fails together; the error is returned.
    fn open_step(&self, whole: bool, error: Option<&Error>) -> Result<()>;

    /// The micro-batch's work is done and its flags are in the window's (a device joins its
    /// streams); taken at every close.
    fn join(&self) -> Result<()> {
        Ok(())
    }

    /// Whether a gradient of the open micro-batch was poisoned on this rank where the device
    /// keeps the flags (reading them waits for it); the shard's marks hold the others.
    fn poisoned(&self) -> Result<bool> {
        Ok(false)
    }

    /// The closing step, with this rank's error `own` and whether a gradient was `poisoned` here:
    /// whether one was on any rank.
    fn close_step(&self, own: Option<&Error>, poisoned: bool) -> Result<bool>;
}

/// A sharded accumulation's micro-batch whose tensors arrive one by one (backward hooks): each
/// tensor is converted into its bucket's staging, and each bucket is reduced in the
/// [`BucketSchedule`]'s order once complete, its staging then going back to the spares.
pub(crate) struct Hooks<S> {
    /// A micro-batch is open (and its reductions have not failed).
    pub open: bool,
    schedule: BucketSchedule,
    /// Each bucket's staging while it fills.
    stages: Vec<Option<S>>,
    /// Staging no bucket holds, the longest unused first.
    pub spare: VecDeque<S>,
}

impl<S> Hooks<S> {
    pub(crate) fn new(plan: &Plan) -> Self {
        let schedule = BucketSchedule::new(&plan.layout, plan.descs.len());
        Hooks {
            open: false,
            stages: (0..plan.layout.buckets().len()).map(|_| None).collect(),
            schedule,
            spare: VecDeque::new(),
        }
    }

    /// Staging buffers that exist: the spares and those buckets hold.
    pub(crate) fn staged(&self) -> usize {
        self.spare.len() + self.stages.iter().flatten().count()
    }

    /// A micro-batch opens.
    pub(crate) fn open(&mut self) {
        self.open = true;
        self.schedule.restart();
    }

    /// Tensor `index`'s one contribution: `convert` writes it into its bucket's staging, then
    /// every bucket now complete is reduced in order. A failed reduction fails the micro-batch.
    pub(crate) fn contribute<D: Stages<Stage = S>, R>(
        &mut self,
        device: &D,
        layout: &Layout,
        index: usize,
        convert: impl FnOnce(&mut S) -> Result<R>,
    ) -> Result<R> {
        protocol::check_contribution(self.open, self.schedule.landed(index), index)?;
        let b = layout.bucket_of(index);
        let mut stage = match self.stages[b].take() {
            Some(stage) => stage,
            None => device.take(self)?,
        };
        let converted = convert(&mut stage);
        self.stages[b] = Some(stage);
        let converted = converted?;
        self.schedule.land(index, b);
        self.reduce_ready(device, layout, false).inspect_err(|_| self.open = false)?;
        Ok(converted)
    }

    /// Reduces, in the schedule's order, every bucket from the next one on that is complete
    /// (with `all`: every bucket, its absent tensors as zeros). The schedule moves past a bucket
    /// whose reduction failed: this rank's window is lost then, and the device told.
    pub(crate) fn reduce_ready<D: Stages<Stage = S>>(
        &mut self,
        device: &D,
        layout: &Layout,
        all: bool,
    ) -> Result<()> {
        while let Some(b) = self.schedule.next(all) {
            let result = self.reduce_bucket(device, layout, b);
            self.schedule.advance();
            result.inspect_err(|_| device.failed())?;
        }
        Ok(())
    }

    fn reduce_bucket<D: Stages<Stage = S>>(
        &mut self,
        device: &D,
        layout: &Layout,
        b: usize,
    ) -> Result<()> {
        let mut stage = match self.stages[b].take() {
            Some(stage) => stage,
            None => device.take(self)?,
        };
        // A tensor that received nothing contributes zeros, and so does every padding (the
        // staging is reused).
        let schedule = &self.schedule;
        let zeroed = schedule
            .tensors(b)
            .map(|i| if schedule.landed(i) { layout.padding(i) } else { layout.slot(i) })
            .filter(|r| !r.is_empty())
            .try_for_each(|r| device.zero(&mut stage, b, r));
        let result = zeroed.and_then(|()| device.reduce(&mut stage, b));
        self.spare.push_back(stage);
        result
    }

    /// The micro-batch ends (reduced, or failed): every bucket's staging goes back to the spares,
    /// of which `keep` stay for the next.
    pub(crate) fn finish(&mut self, keep: usize) {
        self.open = false;
        let held: Vec<S> = self.stages.iter_mut().filter_map(Option::take).collect();
        self.spare.extend(held);
        self.spare.truncate(keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Dtype, TensorDesc};

    #[test]
    fn intersect_stays_inside_and_is_empty_when_apart() {
        let b = 10..20;
        assert_eq!(intersect(&(12..15), &b), 12..15);
        assert_eq!(intersect(&(5..12), &b), 10..12);
        assert_eq!(intersect(&(18..30), &b), 18..20);
        assert_eq!(intersect(&(0..5), &b), 10..10);
        assert_eq!(intersect(&(25..30), &b), 20..20);
        assert_eq!(relative(&(12..15), 10), 2..5);
    }

    /// A rank's shard tells the part of a range it holds, and the window's flags behave as the
    /// stores rely on: a refused `add_tensor` fails the close and loses the window, once.
    #[test]
    fn a_shard_holds_its_range_and_keeps_the_window_flags() {
        let descs = [TensorDesc { numel: 1 << 16, dtype: Dtype::F32 }];
        let config = crate::AccumulatorConfig {
            sharding: Sharding::Accumulate { shards: 2, rank: 1 },
            ..Default::default()
        };
        let layout = Layout::new(&descs, config.bucket_numel).unwrap();
        let plan = Plan { config, descs: descs.to_vec(), layout };
        let s = Shard::new(&plan, None).unwrap();
        assert_eq!((s.rank, s.own.clone()), (1, plan.shards()[1].clone()));
        let own = s.own.clone();
        assert!(own.start > 0 && own.len() > 5, "{own:?}");
        assert_eq!(s.held(&(0..own.start + 3)), 0..3);
        assert_eq!(s.held(&(0..own.start)), 0..0, "a range before the shard");
        assert_eq!(s.offset(own.start + 5), 5);
        assert_eq!((s.offset(0), s.offset(usize::MAX)), (0, own.len()));

        let alone = |own: Option<&Error>, poisoned| own.map_or(Ok(poisoned), |e| Err(e.clone()));
        s.open(false);
        assert!(!s.first());
        assert!(!s.close(alone).unwrap());
        assert!(!s.take_lost());
        s.note_poisoned();
        assert!(s.close(alone).unwrap(), "a poisoned micro-batch is dropped");
        s.note_invalid();
        let refused = s.close(alone);
        assert_eq!(refused.unwrap_err().kind, ErrorKind::WrongState);
        assert!(s.take_lost() && !s.take_lost(), "lost once, then taken");
        s.open(true);
        assert!(s.first() && s.close(alone) == Ok(false), "opening clears both flags");
    }

    /// Buckets go last first, each only once complete and never before a later one.
    #[test]
    fn the_schedule_reduces_complete_buckets_in_backward_order() {
        let descs = [4, 4, 4, 4, 4].map(|numel| TensorDesc { numel, dtype: Dtype::F32 });
        // Two aligned slots per bucket.
        let layout = Layout::new(&descs, 2 * crate::accumulator::layout::ALIGN_ELEMS).unwrap();
        assert_eq!(layout.buckets().len(), 3, "{:?}", layout.buckets());
        let mut s = BucketSchedule::new(&layout, descs.len());
        assert_eq!((s.tensors(0), s.tensors(2)), (0..2, 4..5));
        assert!(s.land(0, 0) && s.land(1, 0));
        assert_eq!(s.next(false), None, "bucket 0 waits for bucket 2");
        assert!(!s.land(1, 0), "a tensor lands once");
        assert!(s.land(4, 2));
        assert_eq!(s.next(false), Some(2));
        s.advance();
        assert_eq!((s.waiting(), s.next(false)), (2, None));
        assert_eq!(s.next(true), Some(1), "with `all`, whatever landed");
        s.advance();
        assert_eq!(s.next(false), Some(0));
        s.advance();
        assert_eq!((s.waiting(), s.next(true)), (0, None));
        s.restart();
        assert!(!s.landed(0) && s.waiting() == 3);
    }
}
