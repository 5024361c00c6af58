//! Sharded accumulation in a host store: this rank's shard of the FP32 master and its FP32 staging,
//! in host memory ([`ShardMemory`], one of [`HostStore`]'s memories). The contract (who holds what,
//! which calls pair up, how a failure ends) is [`Sharding::Accumulate`]'s, and the window's flags
//! are the core's [`Shard`]; this file only does the work. A micro-batch goes through the staging a
//! part at a time: its gradients are converted, unscaled, weighted and checked into the staging,
//! the staging is reduce-scattered over the accumulator's communicator, and this rank's part is
//! added into the shard (assigned in a window's first micro-batch) while it is in cache. The
//! boundary only agrees, normalises, measures and clips.
//!
//! The parts are the core's ([`crate::accumulator::sharding`]): stripes for a whole micro-batch,
//! every rank receiving and summing its own slice; buckets for tensors arriving one by one, a
//! bucket inside one shard then a reduce into its owner. Either way each element is summed in
//! rank order, which is what makes `add` and `add_tensor` give the same bits.
//!
//! [`Sharding::Accumulate`]: crate::accumulator::Sharding::Accumulate
//! [`HostStore`]: super::HostStore

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use super::master::Master;
use super::store::{between_ranks, host_collectives, Boundary, Measured, NormPass};
use crate::accumulator::protocol::{self, Channel, HostChannel, Step};
use crate::accumulator::sharding::{intersect, relative, Hooks, Shard, Stages, Turns};
use crate::accumulator::tensor_stats::Squares;
use crate::accumulator::{Agreed, MasterWrite, Plan, Proposal, SyncInfo};
use crate::comm::{BlockPass, Communicator, Control, ControlSum, HostCollectives};
use crate::dtype::{Dtype, Grad};
use crate::error::{Error, ErrorKind, Result};
use crate::math::NORM_BLOCK;
use crate::simd::{self, check};

/// A host store's memory under sharded accumulation: this rank's shard of the master, and the
/// staging a micro-batch goes through.
pub(super) struct ShardMemory {
    pub sharding: Shard,
    pub shard: Master,
    hooks: Mutex<Hooks<Vec<f32>>>,
    /// Under `Overflow::DropMicrobatch`: the shard and the window's flag as a micro-batch fed
    /// tensor by tensor found them, restored when a rank's gradient of it was poisoned (its
    /// buckets are reduced as they fill, before the micro-batch's last tensor is seen).
    before: Mutex<Before>,
}

/// The shard as it stood when the open micro-batch began (allocated at its first use).
#[derive(Default)]
struct Before {
    shard: Vec<f32>,
    found_inf: bool,
}

impl std::fmt::Debug for ShardMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardMemory").field("sharding", &self.sharding).finish()
    }
}

impl ShardMemory {
    /// Allocates the shard and one bucket of staging; `comm` must be the group of the shards
    /// (checked by the accumulator).
    pub(super) fn new(plan: &Plan, comm: Arc<dyn Communicator>) -> Result<Self> {
        host_collectives(&*comm)?;
        let sharding = Shard::new(plan, Some(comm))?;
        let shard = Master::owned(sharding.own.len())?;
        let mut hooks = Hooks::new(plan);
        hooks.spare.push_back(Sharded::allocate_stage(plan, &sharding)?);
        Ok(ShardMemory { sharding, shard, hooks: Mutex::new(hooks), before: Mutex::default() })
    }

    /// The memory with its store's plan and overflow flag: what the sharded passes run on.
    pub(super) fn with<'a>(&'a self, plan: &'a Plan, found_inf: &'a AtomicBool) -> Sharded<'a> {
        Sharded {
            plan,
            found_inf,
            sharding: &self.sharding,
            shard: &self.shard,
            hooks: &self.hooks,
            before: &self.before,
        }
    }
}

/// A host store's sharded accumulation at work: its shard memory, with the store's plan and
/// the window's overflow flag (this rank's gradients, and what the shard adds write).
pub(super) struct Sharded<'a> {
    plan: &'a Plan,
    found_inf: &'a AtomicBool,
    sharding: &'a Shard,
    shard: &'a Master,
    hooks: &'a Mutex<Hooks<Vec<f32>>>,
    before: &'a Mutex<Before>,
}

impl Sharded<'_> {
    /// One part's staging: room for the largest bucket, from the norm block it starts in (so
    /// that the shards' boundaries inside it fall on block boundaries, as the reduce-scatter
    /// needs), and for a stripe.
    fn allocate_stage(plan: &Plan, sharding: &Shard) -> Result<Vec<f32>> {
        let buckets =
            plan.layout.buckets().iter().map(|b| b.end - stage_base(b)).max().unwrap_or(0);
        let stripe = sharding.stripes.len;
        let len = buckets.max(sharding.shards.iter().map(|s| s.len().min(stripe)).sum());
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

    fn hooks(&self) -> MutexGuard<'_, Hooks<Vec<f32>>> {
        self.hooks.lock()
    }

    /// Converts the gradients of `flat` ranges of the master into the staging (assigned), each
    /// range at its staging position; flags overflow, and returns whether a value it wrote is not
    /// finite (this rank's gradient). `flat` ascends, and so do the positions.
    fn stage_ranges<'g>(
        &self,
        stage: &mut [f32],
        parts: &[(Range<usize>, usize)],
        grads: &dyn Fn(usize) -> Grad<'g>,
        factor: f32,
    ) -> bool {
        let layout = &self.plan.layout;
        let (mut rest, mut at) = (stage, 0);
        let mut passes = Vec::new();
        for (flat, position) in parts.iter().filter(|(f, _)| !f.is_empty()) {
            // Each tensor's slot in the part, in one walk: its values, converted, then its
            // padding, staged as zeros (the staging is reused, and the padding's reduced values
            // land in the shard).
            let mut i = layout.tensor_at(flat.start);
            while i < self.plan.descs.len() && layout.slot(i).start < flat.end {
                let r = layout.range(i);
                let (values, padding) = (intersect(&r, flat), intersect(&layout.padding(i), flat));
                let (_, tail) = std::mem::take(&mut rest)
                    .split_at_mut(position + (values.start - flat.start) - at);
                let (master, tail) = tail.split_at_mut(values.len());
                let (zeros, tail) = tail.split_at_mut(padding.len());
                zeros.fill(0.0);
                if !values.is_empty() {
                    passes.push(simd::TensorPass {
                        master,
                        grad: grads(i).slice(values.start - r.start, values.end - r.start),
                        assign: true,
                    });
                }
                (rest, at) = (tail, position + (padding.end.max(values.end) - flat.start));
                i += 1;
            }
        }
        let bad = simd::accumulate_many(passes, factor, self.plan.config.threads);
        if bad {
            self.found_inf.store(true, Ordering::Relaxed);
        }
        bad
    }

    /// Stripe `k`: each rank's slice of the master (ascending) and its piece of the staging,
    /// packed in rank order.
    fn stripe(&self, k: usize) -> (Vec<Range<usize>>, Vec<Range<usize>>) {
        let s = &self.sharding;
        let flat: Vec<Range<usize>> = s.shards.iter().map(|r| s.stripes.slice(r, k)).collect();
        let mut at = 0;
        let pieces = flat.iter().map(|f| (at..at + f.len(), at += f.len()).0).collect();
        (flat, pieces)
    }

    /// Reduce-scatters bucket `b`'s staging and adds this rank's part into the shard (assigns it
    /// with `first`).
    fn reduce_bucket(&self, b: usize, stage: &mut [f32], first: bool) -> Result<()> {
        let bucket = self.plan.layout.buckets()[b].clone();
        let base = stage_base(&bucket);
        let clamp = |s: &Range<usize>| relative(&intersect(s, &(base..bucket.end)), base);
        let pieces: Vec<Range<usize>> = self.sharding.shards.iter().map(clamp).collect();
        // This rank's part of the bucket proper (the staging's head belongs to the bucket before).
        let own = clamp(&self.sharding.own);
        let own = own.start.max(bucket.start - base)..own.end.max(bucket.start - base);
        let shard_at = self.sharding.offset(own.start + base);
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
            dst: self.shard.ptr_at(shard_at.min(self.sharding.own.len())) as usize,
            assign: first,
            wire: self.plan.config.wire,
            found_inf: self.found_inf,
        };
        let result = match between_ranks(self.sharding.comm())? {
            Some(c) => c.reduce_scatter_with_pass(stage, pieces, &into).map(drop),
            None => {
                into.run(stage, &mut []);
                Ok(())
            }
        };
        result.inspect_err(|_| self.sharding.lose())
    }

    /// A staging buffer for the next part, after the micro-batch's control step: the peers are
    /// then waiting for this rank's reductions, so a rank that cannot allocate one aborts the
    /// communicator (they fail instead of waiting) and loses its window.
    fn spare_stage(&self, spare: &mut VecDeque<Vec<f32>>) -> Result<Vec<f32>> {
        match spare.pop_front() {
            Some(stage) => Ok(stage),
            None => Self::allocate_stage(self.plan, self.sharding).inspect_err(|_| {
                self.sharding.lose();
                if let Some(c) = self.sharding.comm() {
                    let _ = c.abort();
                }
            }),
        }
    }

    /// One control step of a micro-batch over the shard group (see [`protocol`]), this rank's
    /// micro-batch claimed `dropped` or not; the agreed sum.
    fn control_step(&self, step: Step, own: Option<&Error>, dropped: bool) -> Result<ControlSum> {
        let claim =
            Control { dropped: dropped as u64, ..step.claim(self.plan, None, own.is_some()) };
        let group = between_ranks(self.sharding.comm())?.map(HostChannel);
        let mine = ControlSum::of(&claim);
        protocol::agree(step, group.as_ref().map(|c| c as &dyn Channel), None, &mine, own)
    }

    /// Ends the micro-batch (reduced, or failed): one staging buffer is kept for the next.
    fn finish(&self, h: &mut Hooks<Vec<f32>>) {
        h.finish(<Self as Turns>::KEPT);
    }
}

/// A micro-batch's turns on the host: the control steps are host reductions over the shard
/// group (every micro-batch's opening one too), the shard's copy is host memory.
impl Turns for Sharded<'_> {
    const KEPT: usize = 1;

    fn keep_before(&self, master: &MasterWrite, first: bool) -> Result<()> {
        let mut before = self.before.lock();
        let shard = self.shard.slice(master, 0..self.sharding.own.len());
        if before.shard.len() != shard.len() {
            before.shard = Vec::new();
            before.shard.try_reserve_exact(shard.len()).map_err(|_| {
                Error::new(
                    ErrorKind::OutOfMemory,
                    format!("cannot allocate a copy of the shard ({} f32 elements)", shard.len()),
                )
            })?;
        }
        before.shard.clear();
        before.shard.extend_from_slice(shard);
        before.found_inf = !first && self.found_inf.load(Ordering::Relaxed);
        Ok(())
    }

    fn restore(&self, master: &mut MasterWrite) -> Result<()> {
        let before = self.before.lock();
        self.shard.slice_mut(master, 0..self.sharding.own.len()).copy_from_slice(&before.shard);
        self.found_inf.store(before.found_inf, Ordering::Relaxed);
        Ok(())
    }

    fn open_step(&self, whole: bool, error: Option<&Error>) -> Result<()> {
        self.control_step(Step::Microbatch { whole }, error, false).map(drop)
    }

    fn close_step(&self, own: Option<&Error>, poisoned: bool) -> Result<bool> {
        Ok(self.control_step(Step::Closing, own, poisoned)?.dropped != 0)
    }
}

/// Bucket by bucket, a staging buffer of host memory.
impl Stages for Sharded<'_> {
    type Stage = Vec<f32>;

    fn take(&self, hooks: &mut Hooks<Vec<f32>>) -> Result<Vec<f32>> {
        self.spare_stage(&mut hooks.spare)
    }

    fn zero(&self, stage: &mut Vec<f32>, b: usize, range: Range<usize>) -> Result<()> {
        let base = stage_base(&self.plan.layout.buckets()[b]);
        stage[relative(&range, base)].fill(0.0);
        Ok(())
    }

    fn reduce(&self, stage: &mut Vec<f32>, b: usize) -> Result<()> {
        self.reduce_bucket(b, stage, self.sharding.first())
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
        if simd::accumulate(dst, Grad::F32(src), 1.0, self.assign, 1) {
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

impl Sharded<'_> {
    /// The micro-batch's control step: the ranks agree that they all add a micro-batch to the
    /// same layout, or all fail with nothing reduced.
    pub(super) fn open_microbatch(
        &self,
        master: &MasterWrite,
        first: bool,
        whole: bool,
        error: Option<&Error>,
    ) -> Result<()> {
        self.sharding.open_microbatch(self, master, &mut self.hooks(), first, whole, error)
    }

    /// A whole micro-batch, stripe by stripe: staged, reduce-scattered, added into the shard;
    /// with no `grads`, zeros (this rank dropped it, the others' sums still reach the shards).
    /// Returns whether this rank's gradients held a non-finite value once unscaled.
    pub(super) fn add(&self, grads: Option<&[Grad<'_>]>, factor: f32) -> Result<bool> {
        let mut h = self.hooks();
        let mut stage = self.spare_stage(&mut h.spare)?;
        let (mut result, mut bad) = (Ok(()), false);
        let (rank, stripes) = (self.sharding.rank, self.sharding.stripes);
        // The first shard is the largest.
        for k in 0..stripes.count {
            let (flat, pieces) = self.stripe(k);
            let end = pieces.last().map_or(0, |p| p.end);
            match grads {
                Some(grads) => {
                    let parts: Vec<(Range<usize>, usize)> =
                        flat.iter().cloned().zip(pieces.iter().map(|p| p.start)).collect();
                    bad |= self.stage_ranges(&mut stage, &parts, &|i| grads[i], factor);
                }
                None => stage[..end].fill(0.0),
            }
            result = self.reduce_part(
                &mut stage[..end],
                &pieces,
                pieces[rank].clone(),
                k * stripes.len,
                self.sharding.first(),
            );
            if result.is_err() {
                break;
            }
        }
        h.spare.push_back(stage);
        self.finish(&mut h);
        result.map(|()| bad)
    }

    /// Tensor `index` into its bucket's staging; every bucket then complete is reduced. Returns
    /// whether the gradient held a non-finite value once unscaled. Under
    /// `Overflow::DropMicrobatch` such a gradient is poisoned: it is staged as zeros, and closing
    /// the micro-batch drops it on every rank.
    pub(super) fn add_tensor(&self, index: usize, grad: Grad<'_>, factor: f32) -> Result<bool> {
        let layout = &self.plan.layout;
        let (r, b) = (layout.range(index), layout.bucket_of(index));
        let base = stage_base(&layout.buckets()[b]);
        let poisoned = self.sharding.drops && !check::finite_after_unscale(grad, factor);
        let bad = self.hooks().contribute(self, layout, index, |stage| {
            if poisoned {
                return Stages::zero(self, stage, b, layout.slot(index)).map(|()| true);
            }
            Ok(self.stage_ranges(stage, &[(r.clone(), r.start - base)], &|_| grad, factor))
        })?;
        if poisoned {
            self.sharding.note_poisoned();
        }
        Ok(bad)
    }

    /// The buckets still waiting are reduced, then the closing control step. Returns whether a
    /// rank's gradient was poisoned: the shard is then as before the micro-batch, on every rank.
    pub(super) fn close_microbatch(&self, master: &mut MasterWrite) -> Result<bool> {
        self.sharding.close_microbatch(self, master, &self.plan.layout, &mut self.hooks())
    }

    /// The shard holds the window's sum over the ranks: it is normalised and measured here, its
    /// block values gathered from every shard for the norm, and clipped. In a hybrid boundary
    /// the shard is first all-reduced over the replicas.
    ///
    /// With `squares` (`tensor_stats`), the pass sums each segment of the shard too. Returns the
    /// report, the scale of those sums ([`Boundary::stats_scale`]) and the deferred clip factor.
    pub(super) fn reduce(
        &self,
        master: &mut MasterWrite,
        p: &Proposal<'_>,
        agreed: &Agreed,
        squares: Option<&Squares<'_>>,
    ) -> Result<(SyncInfo, f64, Option<f32>)> {
        // The micro-batches' reductions had the wire; the replicas sum FP32 sums.
        let boundary = Boundary::new(self.plan, agreed, Dtype::F32, p.defer_clip);
        let pass = boundary.pass;
        let shard = self.shard.slice_mut(master, 0..self.sharding.own.len());
        let first = self.sharding.own.start;
        let mine = match between_ranks(p.replicas)? {
            Some(r) => {
                let inner = NormPass { clip: None, ..pass };
                // Runs the replicas pass are collectives: taken as they come.
                let measured = Measured::new(&inner, squares, shard, first, None);
                over_replicas(r, between_ranks(p.comm)?, shard, &measured)?
            }
            None => {
                let mut values = vec![0.0; simd::blocks(shard.len())];
                let measured = Measured::new(&pass, squares, shard, first, Some(pass.piece()));
                measured.run(shard, &mut values);
                values
            }
        };
        let values = match between_ranks(p.comm)? {
            Some(c) => {
                let counts: Vec<usize> =
                    self.sharding.shards.iter().map(|s| simd::blocks(s.len())).collect();
                c.allgather_values(&mine, &counts)?
            }
            None => mine,
        };
        if let Some(factor) = pass.rescales().then(|| pass.rescale(&values)).flatten() {
            simd::scale(shard, factor, pass.threads);
        }
        Ok((boundary.info(&values), boundary.stats_scale(), boundary.deferred(&values)))
    }
}

/// A hybrid boundary's replica step: the shard all-reduced over the replicas with `pass` (the
/// same bits on every replica), then one control reduction over the shard group so that a
/// replica failure on any rank fails every rank. Returns the shard's block values.
fn over_replicas(
    replicas: &dyn HostCollectives,
    group: Option<&dyn HostCollectives>,
    shard: &mut [f32],
    pass: &dyn BlockPass,
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
