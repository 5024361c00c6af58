//! The store of a sharded accumulation (ZeRO-2): this rank's shard of the FP32 master and one
//! bucket of FP32 staging, in host memory. A micro-batch goes through the staging a part at a
//! time: its gradients are converted, unscaled, weighted and checked into the staging, the
//! staging is reduce-scattered over the accumulator's communicator, and this rank's part is added
//! into the shard (assigned in a window's first micro-batch) while it is in cache. The boundary
//! only agrees, normalises, measures and clips.
//!
//! The parts are cut two ways, and every rank cuts the same way in a micro-batch (the control
//! step checks it). A whole micro-batch (`add`) goes by stripes: stripe k holds the k-th slice of
//! every shard, so each reduce-scatter is balanced, every rank receiving and summing its own
//! slice. Tensors arriving one by one (`add_tensor`) go by buckets, in the backward's order (the
//! last bucket first), each reduced as soon as its tensors have landed; a bucket inside one shard
//! is then a reduce into its owner. Either way each element is the same sum in rank order, so the
//! bits do not depend on the cut.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::master::Master;
use super::math::NORM_BLOCK;
use super::store::{agree, between_ranks, host_collectives, unscale_factor, Boundary, NormPass};
use crate::accumulator::protocol::{self, Channel, HostChannel, Step};
use crate::accumulator::{Agreed, Gradient, Grads, Plan, Proposal, Store, SyncInfo};
use crate::comm::{BlockPass, Communicator, ControlSum, HostCollectives};
use crate::device::Device;
use crate::dtype::{Dtype, Grad};
use crate::error::{Error, ErrorKind, Result};
use crate::scaler::Scaler;

pub(crate) struct ShardedStore {
    plan: Arc<Plan>,
    comm: Arc<dyn Communicator>,
    /// Every rank's range of the flat layout, and this rank's.
    shards: Vec<Range<usize>>,
    own: Range<usize>,
    /// Each bucket's tensors.
    bucket_tensors: Vec<Range<usize>>,
    /// Elements of each shard in one stripe: a bucket's worth over all ranks, in whole norm blocks.
    stripe: usize,
    shard: Master,
    /// The window's sticky non-finite flag (this rank's gradients only).
    found_inf: AtomicBool,
    /// A reduction failed after the micro-batch's control step: the shard holds part of it.
    lost: AtomicBool,
    microbatch: Mutex<Microbatch>,
}

impl std::fmt::Debug for ShardedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardedStore")
            .field("own", &self.own)
            .field("shards", &self.shards)
            .finish()
    }
}

/// The micro-batch in progress, tensor by tensor (`add_tensor`).
struct Microbatch {
    /// Whether a micro-batch is open and the shard is assigned by it (the window's first).
    open: bool,
    first: bool,
    /// An `add_tensor` of this micro-batch was invalid on this rank: closing it fails every rank.
    invalid: bool,
    /// Buckets reduced so far, in the order of `schedule`.
    reduced: usize,
    /// Each tensor's contribution has landed.
    landed: Vec<bool>,
    /// Each bucket's tensors still to land.
    missing: Vec<usize>,
    /// Each bucket's staging while it fills; a bucket that fills before its turn keeps its own.
    stages: Vec<Option<Vec<f32>>>,
    /// Staging no bucket holds, kept for the next.
    spare: Vec<Vec<f32>>,
}

impl ShardedStore {
    /// Allocates the shard and one bucket of staging; `comm` must be the group of the shards
    /// (checked by the accumulator).
    pub(crate) fn new(plan: Arc<Plan>, comm: Arc<dyn Communicator>) -> Result<Self> {
        host_collectives(&*comm)?;
        let shards = plan.shards();
        let own = shards[comm.rank()].clone();
        let shard = Master::owned(own.len())?;
        // Clamped first: a bucket_numel near usize::MAX ("one bucket") must not wrap.
        let stripe = plan
            .config
            .bucket_numel
            .div_ceil(shards.len())
            .min(plan.layout.len())
            .max(1)
            .next_multiple_of(NORM_BLOCK);
        let staging = Self::allocate_stage(&plan, &shards, stripe)?;
        let mut bucket_tensors = vec![0..0; plan.layout.buckets().len()];
        for i in 0..plan.descs.len() {
            let t = &mut bucket_tensors[plan.layout.bucket_of(i)];
            *t = if t.start == t.end { i..i + 1 } else { t.start..i + 1 };
        }
        let microbatch = Microbatch {
            open: false,
            first: true,
            invalid: false,
            reduced: 0,
            landed: vec![false; plan.descs.len()],
            missing: vec![0; plan.layout.buckets().len()],
            stages: (0..plan.layout.buckets().len()).map(|_| None).collect(),
            spare: vec![staging],
        };
        Ok(ShardedStore {
            plan,
            comm,
            shards,
            own,
            bucket_tensors,
            stripe,
            shard,
            found_inf: AtomicBool::new(false),
            lost: AtomicBool::new(false),
            microbatch: Mutex::new(microbatch),
        })
    }

    /// One part's staging: room for the largest bucket, from the norm block it starts in (so
    /// that the shards' boundaries inside it fall on block boundaries, as the reduce-scatter
    /// needs), and for a stripe.
    fn allocate_stage(plan: &Plan, shards: &[Range<usize>], stripe: usize) -> Result<Vec<f32>> {
        let buckets =
            plan.layout.buckets().iter().map(|b| b.end - stage_base(b)).max().unwrap_or(0);
        let len = buckets.max(shards.iter().map(|s| s.len().min(stripe)).sum());
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|_| {
            Error::new(
                ErrorKind::OutOfMemory,
                format!("cannot allocate a staging bucket of {len} f32 elements"),
            )
        })?;
        v.resize(len, 0.0);
        Ok(v)
    }

    fn state(&self) -> MutexGuard<'_, Microbatch> {
        self.microbatch.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The buckets in the order every rank reduces them: the backward's (the last first).
    fn schedule(&self, k: usize) -> usize {
        self.plan.layout.buckets().len() - 1 - k
    }

    /// The tensors of bucket `b`.
    fn tensors_of(&self, b: usize) -> Range<usize> {
        self.bucket_tensors[b].clone()
    }

    /// Converts the gradients of `flat` ranges of the master into the staging (assigned), each
    /// range at its staging position; flags overflow. `flat` ascends, and so do the positions.
    fn stage_ranges<'g>(
        &self,
        stage: &mut [f32],
        parts: &[(Range<usize>, usize)],
        grads: &dyn Fn(usize) -> Grad<'g>,
        factor: f32,
    ) {
        let layout = &self.plan.layout;
        // The padding between tensors is staged as zeros: the staging is reused, and the
        // padding's reduced values land in the shard.
        for (flat, position) in parts.iter().filter(|(f, _)| !f.is_empty()) {
            for i in layout.tensor_at(flat.start)..layout.tensor_at(flat.end - 1) + 1 {
                let p = layout.padding(i);
                let (lo, hi) = (p.start.max(flat.start), p.end.min(flat.end));
                if lo < hi {
                    stage[position + lo - flat.start..position + hi - flat.start].fill(0.0);
                }
            }
        }
        let (mut rest, mut at) = (stage, 0);
        let mut passes = Vec::new();
        for (flat, position) in parts.iter().filter(|(f, _)| !f.is_empty()) {
            let mut i = layout.tensor_at(flat.start);
            while i < self.plan.descs.len() && layout.range(i).start < flat.end {
                let t = layout.range(i);
                let (lo, hi) = (t.start.max(flat.start), t.end.min(flat.end));
                if lo >= hi {
                    // The range starts in this tensor's padding.
                    i += 1;
                    continue;
                }
                let (_, tail) =
                    std::mem::take(&mut rest).split_at_mut(position + (lo - flat.start) - at);
                let (master, tail) = tail.split_at_mut(hi - lo);
                passes.push(super::TensorPass {
                    master,
                    grad: grads(i).slice(lo - t.start, hi - t.start),
                    assign: true,
                });
                (rest, at) = (tail, position + (hi - flat.start));
                i += 1;
            }
        }
        if super::accumulate_many(passes, factor, self.plan.config.threads) {
            self.found_inf.store(true, Ordering::Relaxed);
        }
    }

    /// Stripe `k`: each rank's slice of the master (ascending) and its piece of the staging,
    /// packed in rank order.
    fn stripe(&self, k: usize) -> (Vec<Range<usize>>, Vec<Range<usize>>) {
        let flat: Vec<Range<usize>> = self
            .shards
            .iter()
            .map(|s| {
                (s.start + k * self.stripe).min(s.end)..(s.start + (k + 1) * self.stripe).min(s.end)
            })
            .collect();
        let mut at = 0;
        let pieces = flat.iter().map(|f| (at..at + f.len(), at += f.len()).0).collect();
        (flat, pieces)
    }

    /// Reduce-scatters bucket `b`'s staging and adds this rank's part into the shard (assigns it
    /// with `first`).
    fn reduce_bucket(&self, b: usize, stage: &mut [f32], first: bool) -> Result<()> {
        let bucket = self.plan.layout.buckets()[b].clone();
        let base = stage_base(&bucket);
        let clamp = |s: &Range<usize>| {
            s.start.clamp(base, bucket.end) - base..s.end.clamp(base, bucket.end) - base
        };
        let pieces: Vec<Range<usize>> = self.shards.iter().map(clamp).collect();
        // This rank's part of the bucket proper (the staging's head belongs to the bucket before).
        let own = clamp(&self.own);
        let own = own.start.max(bucket.start - base)..own.end.max(bucket.start - base);
        let shard_at = (own.start + base).saturating_sub(self.own.start).min(self.own.len());
        self.reduce_part(&mut stage[..bucket.end - base], &pieces, own, shard_at, first)
    }

    /// Reduce-scatters `stage` cut into `pieces` (one per rank) and adds `own`, this rank's part,
    /// into the shard from element `shard_at` (assigns it with `first`). A failure loses the
    /// window.
    fn reduce_part(
        &self,
        stage: &mut [f32],
        pieces: &[Range<usize>],
        own: Range<usize>,
        shard_at: usize,
        first: bool,
    ) -> Result<()> {
        let into = AddInto {
            stage: stage.as_ptr() as usize..stage.as_ptr_range().end as usize,
            own,
            // An empty part may start past a short shard's end: the address is never written.
            dst: self.shard.ptr_at(shard_at.min(self.own.len())) as usize,
            assign: first,
            wire: self.plan.config.wire,
            found_inf: &self.found_inf,
        };
        let result = match between_ranks(Some(&*self.comm))? {
            Some(c) => c.reduce_scatter_with_pass(stage, pieces, &into).map(drop),
            None => {
                into.run(stage, &mut []);
                Ok(())
            }
        };
        result.inspect_err(|_| self.lost.store(true, Ordering::Relaxed))
    }

    /// Reduces, in schedule order, every bucket from the next one on that is complete (with
    /// `all`: every bucket, its missing tensors zeroed).
    fn reduce_ready(&self, m: &mut Microbatch, all: bool) -> Result<()> {
        let buckets = self.plan.layout.buckets().len();
        while m.reduced < buckets {
            let b = self.schedule(m.reduced);
            if m.missing[b] != 0 && !all {
                return Ok(());
            }
            let mut stage = match m.stages[b].take() {
                Some(stage) => stage,
                None => self.spare_stage(&mut m.spare)?,
            };
            let base = stage_base(&self.plan.layout.buckets()[b]);
            // A tensor that received nothing contributes zeros, and so does every padding.
            for i in self.tensors_of(b) {
                let layout = &self.plan.layout;
                let r = if m.landed[i] { layout.padding(i) } else { layout.slot(i) };
                stage[r.start - base..r.end - base].fill(0.0);
            }
            let result = self.reduce_bucket(b, &mut stage, m.first);
            m.spare.push(stage);
            m.reduced += 1;
            result?;
        }
        Ok(())
    }

    /// A staging buffer for the next part, after the micro-batch's control step: the peers are
    /// then waiting for this rank's reductions, so a rank that cannot allocate one aborts the
    /// communicator (they fail instead of waiting) and loses its window.
    fn spare_stage(&self, spare: &mut Vec<Vec<f32>>) -> Result<Vec<f32>> {
        match spare.pop() {
            Some(stage) => Ok(stage),
            None => Self::allocate_stage(&self.plan, &self.shards, self.stripe).inspect_err(|_| {
                self.lost.store(true, Ordering::Relaxed);
                let _ = self.comm.abort();
            }),
        }
    }

    /// The control step that closes a micro-batch added tensor by tensor: an invalid
    /// `add_tensor` on any rank left its tensor out of every rank's sums, so every rank's window
    /// is lost.
    fn close_together(&self, invalid: bool) -> Result<()> {
        let own = invalid.then(protocol::refused_here);
        self.control_step(Step::Closing, own.as_ref())
            .inspect_err(|_| self.lost.store(true, Ordering::Relaxed))
    }

    /// One control step of a micro-batch over the shard group (see [`protocol`]).
    fn control_step(&self, step: Step, own: Option<&Error>) -> Result<()> {
        let mine = ControlSum::of(&step.claim(&self.plan, None, own.is_some()));
        let group = between_ranks(Some(&*self.comm))?.map(HostChannel);
        protocol::agree(step, group.as_ref().map(|c| c as &dyn Channel), None, &mine, own)?;
        Ok(())
    }

    /// Ends the micro-batch (reduced, or failed): one staging buffer is kept for the next.
    fn finish(&self, m: &mut Microbatch) {
        m.open = false;
        m.first = false;
        let kept = m.spare.pop().or_else(|| m.stages.iter_mut().find_map(Option::take));
        m.spare.clear();
        m.stages.iter_mut().for_each(|s| *s = None);
        m.spare.extend(kept);
    }
}

/// Where bucket `b`'s staging starts in the flat layout: the norm block it starts in.
fn stage_base(b: &Range<usize>) -> usize {
    b.start / NORM_BLOCK * NORM_BLOCK
}

/// A micro-batch's pass over the reduce-scattered staging: this rank's part of the bucket is
/// added into the shard (or assigned), while it is in cache, and checked, as the unsharded
/// accumulation checks what it writes into its master. It writes no block values.
struct AddInto<'a> {
    /// The staging's addresses, and this rank's part of the bucket in it.
    stage: Range<usize>,
    own: Range<usize>,
    /// The shard element at staging position `own.start` (an address, so the pass is `Sync`).
    dst: usize,
    assign: bool,
    wire: Dtype,
    found_inf: &'a AtomicBool,
}

impl BlockPass for AddInto<'_> {
    fn run(&self, run: &mut [f32], _values: &mut [f64]) {
        // Every communicator passes over runs of the buffer it reduces, here the staging.
        let span = run.as_ptr_range();
        debug_assert!(
            self.stage.start <= span.start as usize && span.end as usize <= self.stage.end,
            "a run outside the staging"
        );
        let at = (span.start as usize).wrapping_sub(self.stage.start) / size_of::<f32>();
        let (lo, hi) = (at.max(self.own.start), (at + run.len()).min(self.own.end));
        if lo >= hi {
            return;
        }
        let src = &run[lo - at..hi - at];
        // SAFETY: `dst` addresses the shard element of staging position `own.start`, and the
        // shard holds every element of `own` from there; only this pass writes the shard while
        // the store's micro-batch lock (or the window's write lock) is held.
        let dst = unsafe {
            std::slice::from_raw_parts_mut((self.dst as *mut f32).add(lo - self.own.start), hi - lo)
        };
        // The accumulation kernel with a factor of 1 (exact): `dst = src` or `dst += src`, and
        // whether a value it wrote is not finite, in one vectorised pass.
        if super::accumulate(dst, Grad::F32(src), 1.0, self.assign, 1) {
            self.found_inf.store(true, Ordering::Relaxed);
        }
    }

    fn wire(&self) -> Dtype {
        self.wire
    }

    /// Nothing to gather: the shard is all a micro-batch's reduction leaves.
    fn writes_values(&self) -> bool {
        false
    }
}

impl Store for ShardedStore {
    fn device(&self) -> Device {
        Device::Cpu
    }

    /// The micro-batch's control step: the ranks agree that they all add a micro-batch to the
    /// same layout, or all fail with nothing reduced.
    fn open_microbatch(&self, first: bool, whole: bool, error: Option<&Error>) -> Result<()> {
        let mut m = self.state();
        self.control_step(Step::Microbatch { whole }, error)?;
        m.open = true;
        m.first = first;
        m.invalid = false;
        m.reduced = 0;
        m.landed.fill(false);
        for b in 0..m.missing.len() {
            m.missing[b] = self.tensors_of(b).len();
        }
        Ok(())
    }

    fn add(
        &self,
        scaler: &Scaler,
        grads: Grads<'_>,
        weight: f64,
        _first: &dyn Fn(usize) -> bool,
    ) -> Result<()> {
        let Grads::Host(grads) = grads else {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                "device addresses for a CPU accumulator",
            ));
        };
        let factor = unscale_factor(scaler, weight)?;
        let mut m = self.state();
        let mut stage = self.spare_stage(&mut m.spare)?;
        let mut result = Ok(());
        let rank = self.comm.rank();
        // The first shard is the largest.
        for k in 0..self.shards[0].len().div_ceil(self.stripe) {
            let (flat, pieces) = self.stripe(k);
            let parts: Vec<(Range<usize>, usize)> =
                flat.iter().cloned().zip(pieces.iter().map(|p| p.start)).collect();
            self.stage_ranges(&mut stage, &parts, &|i| grads[i], factor);
            let end = pieces.last().map_or(0, |p| p.end);
            result = self.reduce_part(
                &mut stage[..end],
                &pieces,
                pieces[rank].clone(),
                k * self.stripe,
                m.first,
            );
            if result.is_err() {
                break;
            }
        }
        m.spare.push(stage);
        self.finish(&mut m);
        result
    }

    fn add_tensor(
        &self,
        scaler: &Scaler,
        index: usize,
        grad: Gradient<'_>,
        weight: f64,
        _first: bool,
    ) -> Result<()> {
        let Gradient::Host(grad) = grad else {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                "a device address for a CPU accumulator",
            ));
        };
        let factor = unscale_factor(scaler, weight)?;
        let mut m = self.state();
        let m = &mut *m;
        protocol::check_contribution(m.open, m.landed[index], index)?;
        let b = self.plan.layout.bucket_of(index);
        let mut stage = match m.stages[b].take() {
            Some(stage) => stage,
            None => self.spare_stage(&mut m.spare)?,
        };
        let base = stage_base(&self.plan.layout.buckets()[b]);
        let r = self.plan.layout.range(index);
        self.stage_ranges(&mut stage, &[(r.clone(), r.start - base)], &|_| grad, factor);
        m.stages[b] = Some(stage);
        m.landed[index] = true;
        m.missing[b] -= 1;
        self.reduce_ready(m, false).inspect_err(|_| m.open = false)
    }

    fn close_microbatch(&self) -> Result<()> {
        let mut m = self.state();
        let result = if m.open {
            self.reduce_ready(&mut m, true).and_then(|()| self.close_together(m.invalid))
        } else {
            Ok(())
        };
        self.finish(&mut m);
        result
    }

    fn note_invalid(&self) {
        self.state().invalid = true;
    }

    fn take_lost(&self) -> bool {
        self.lost.swap(false, Ordering::Relaxed)
    }

    fn bound(&self) -> Option<&dyn Communicator> {
        Some(&*self.comm)
    }

    fn zero(&self, index: usize) -> Result<()> {
        let r = self.plan.layout.range(index);
        let (lo, hi) = (r.start.max(self.own.start), r.end.min(self.own.end));
        if lo < hi {
            // SAFETY: the window's write lock is held (the boundary).
            unsafe { self.shard.slice_mut(lo - self.own.start..hi - self.own.start) }.fill(0.0);
        }
        Ok(())
    }

    fn clear_found_inf(&self) -> Result<()> {
        self.found_inf.store(false, Ordering::Relaxed);
        Ok(())
    }

    fn agree(&self, p: &Proposal<'_>) -> Result<Agreed> {
        agree(&self.plan, p, self.found_inf.load(Ordering::Relaxed))
    }

    /// The shard holds the window's sum over the ranks: it is normalised and measured here, its
    /// block values gathered from every shard for the norm, and clipped. In a hybrid boundary
    /// the shard is first all-reduced over the replicas.
    fn reduce(&self, p: &Proposal<'_>, agreed: &Agreed, _read: bool) -> Result<Option<SyncInfo>> {
        // The micro-batches' reductions had the wire; the replicas sum FP32 sums.
        let boundary = Boundary::new(&self.plan, agreed, Dtype::F32);
        let pass = boundary.pass;
        // SAFETY: the window's write lock is held for the whole boundary.
        let shard = unsafe { self.shard.slice_mut(0..self.own.len()) };
        let mine = match between_ranks(p.replicas)? {
            Some(r) => {
                over_replicas(r, between_ranks(p.comm)?, shard, &NormPass { clip: None, ..pass })?
            }
            None => {
                let mut values = vec![0.0; super::blocks(shard.len())];
                pass.run(shard, &mut values);
                values
            }
        };
        let values = match between_ranks(p.comm)? {
            Some(c) => {
                let counts: Vec<usize> =
                    self.shards.iter().map(|s| super::blocks(s.len())).collect();
                c.allgather_values(&mine, &counts)?
            }
            None => mine,
        };
        if let Some(factor) = pass.rescales().then(|| pass.rescale(&values)).flatten() {
            super::scale(shard, factor, pass.threads);
        }
        Ok(Some(boundary.info(&values)))
    }

    fn master_address(&self, offset: usize) -> *mut f32 {
        self.shard.ptr_at(offset.saturating_sub(self.own.start).min(self.own.len()))
    }

    fn read(&self, range: Range<usize>, out: &mut [f32]) -> Result<()> {
        // SAFETY: the accumulator's window lock is held for reading; it reads only held ranges.
        out.copy_from_slice(unsafe {
            self.shard.slice_mut(range.start - self.own.start..range.end - self.own.start)
        });
        Ok(())
    }

    fn write(&self, values: &[f32]) -> Result<()> {
        // SAFETY: the window's write lock is held.
        unsafe { self.shard.slice_mut(0..values.len()) }.copy_from_slice(values);
        Ok(())
    }

    fn found_inf(&self) -> Result<bool> {
        Ok(self.found_inf.load(Ordering::Relaxed))
    }

    fn set_found_inf(&self, value: bool) -> Result<()> {
        self.found_inf.store(value, Ordering::Relaxed);
        Ok(())
    }
}

/// A hybrid boundary's replica step: the shard all-reduced over the replicas with `pass` (the
/// same bits on every replica), then one control reduction over the shard group so that a
/// replica failure on any rank fails every rank. Returns the shard's block values.
fn over_replicas(
    replicas: &dyn HostCollectives,
    group: Option<&dyn HostCollectives>,
    shard: &mut [f32],
    pass: &NormPass,
) -> Result<Vec<f64>> {
    let result = replicas.allreduce_with_pass(shard, std::slice::from_ref(&(0..shard.len())), pass);
    let Some(group) = group else { return result };
    let told =
        group.reduce_control(&ControlSum { error: result.is_err(), ..Default::default() })?;
    match result {
        Err(e) => Err(e),
        Ok(_) if told.error => Err(protocol::replica_failed()),
        ok => ok,
    }
}
