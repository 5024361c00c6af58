//! The accumulator's store in host memory: the FP32 master buffer (the whole of it, or under
//! sharded accumulation this rank's shard, see `sharded.rs`), the window's overflow flag, the
//! SIMD passes over them, and the boundary over a host communicator.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::master::Master;
use super::sharded::ShardMemory;
use crate::accumulator::protocol::{self, Channel, HostChannel, Step};
use crate::accumulator::sharding::Shard;
use crate::accumulator::tensor_stats::{self, Squares};
use crate::accumulator::{
    AddKernels, Agreed, BoundaryWork, Gradient, Grads, MasterMemory, MasterWrite, MicrobatchTurns,
    Plan, Proposal, ScaleSource, Segments, Sharding, SyncInfo, TensorStats, TensorWrite,
};
use crate::comm::{
    finish_whole, pass_whole, BlockPass, Communicator, Control, ControlSum, HostCollectives,
};
use crate::device::Device;
use crate::dtype::{Dtype, Grad};
use crate::error::{Error, ErrorKind, Result};
use crate::math;
use crate::simd::{self, check};

#[derive(Debug)]
pub(crate) struct HostStore {
    plan: Arc<Plan>,
    memory: Memory,
    /// The window's sticky non-finite flag (set by concurrent `add_tensor` callers).
    found_inf: AtomicBool,
    /// The FP32 staging of a micro-batch fed tensor by tensor under `Overflow::DropMicrobatch`,
    /// laid out as the master; allocated at its first use.
    stage: OnceLock<Master>,
    /// With `tensor_stats`: the layout's segments, and the last boundary's stats.
    segments: Option<Segments>,
    stats: Mutex<Option<Vec<TensorStats>>>,
    /// The clipping factor the last boundary left pending ([`BoundaryWork::take_deferred`]).
    deferred: Mutex<Option<f32>>,
    /// What the window's last add measured of the whole master ([`AddKernels::add_final`]).
    folded: Mutex<Option<Folded>>,
}

/// The norm's blocks of the whole master as an add left it, and the per-tensor segments' sums
/// (with `tensor_stats`): the boundary's measuring pass, done while the add had each piece in
/// cache. It holds while the master's count of writes is `writes`.
#[derive(Debug)]
struct Folded {
    writes: u64,
    block_sums: Vec<f64>,
    squares: Option<Vec<f64>>,
}

/// What a boundary's reduction leaves: its report, the scale of its segments' sums (see
/// [`Boundary::stats_scale`]), the deferred clip factor ([`Boundary::deferred`]), and the
/// segments' sums when they came from the last add's measurement.
struct Outcome {
    info: SyncInfo,
    stats_scale: f64,
    deferred: Option<f32>,
    squares: Option<Vec<f64>>,
}

/// What a host store holds of the master.
#[derive(Debug)]
enum Memory {
    /// All of it: every policy but sharded accumulation.
    Whole(Master),
    /// This rank's shard, and the staging every micro-batch is reduced through.
    Shard(Box<ShardMemory>),
}

impl HostStore {
    /// Under sharded accumulation, this rank's shard reduced over `comm` (none: a group of one);
    /// else a zeroed master, or the caller's buffer of the layout's length adopted (its padding
    /// zeroed: no pass writes it, and every sum reads it).
    pub(crate) fn new(
        plan: Arc<Plan>,
        adopt: Option<*mut f32>,
        comm: Option<Arc<dyn Communicator>>,
    ) -> Result<Self> {
        let memory = if let Sharding::Accumulate { .. } = plan.config.sharding {
            let comm = match comm {
                Some(c) => c,
                None => Arc::new(crate::comm::LocalComm::group(1)?.remove(0)),
            };
            Memory::Shard(Box::new(ShardMemory::new(&plan, comm)?))
        } else {
            Memory::Whole(Self::allocate(&plan, adopt)?)
        };
        let segments =
            plan.config.tensor_stats.then(|| Segments::new(&plan.layout, plan.descs.len()));
        Ok(HostStore {
            plan,
            memory,
            found_inf: AtomicBool::new(false),
            stage: OnceLock::new(),
            segments,
            stats: Mutex::new(None),
            deferred: Mutex::new(None),
            folded: Mutex::new(None),
        })
    }

    fn allocate(plan: &Plan, adopt: Option<*mut f32>) -> Result<Master> {
        let len = plan.layout.len();
        let mut master = match adopt {
            Some(ptr) => Master::borrowed(ptr, len),
            None => Master::owned(len)?,
        };
        if adopt.is_some() {
            let all = master.as_mut_slice();
            (0..plan.descs.len()).for_each(|i| all[plan.layout.padding(i)].fill(0.0));
        }
        Ok(master)
    }

    /// The held master elements of flat `range` (under sharded accumulation, those inside the
    /// shard), to read.
    fn held<'a>(&'a self, master: &'a MasterWrite, range: Range<usize>) -> &'a [f32] {
        match &self.memory {
            Memory::Whole(whole) => whole.slice(master, range),
            Memory::Shard(s) => s.shard.slice(master, s.sharding.held(&range)),
        }
    }

    /// [`HostStore::held`], to write.
    fn held_mut<'a>(&'a self, master: &'a mut MasterWrite, range: Range<usize>) -> &'a mut [f32] {
        match &self.memory {
            Memory::Whole(whole) => whole.slice_mut(master, range),
            Memory::Shard(s) => s.shard.slice_mut(master, s.sharding.held(&range)),
        }
    }

    /// Sets the window's flag when `bad`; returns `bad`.
    fn flag(&self, bad: bool) -> bool {
        if bad {
            self.found_inf.store(true, Ordering::Relaxed);
        }
        bad
    }

    /// The whole master: a hook micro-batch is staged only over one (a shard's is reduced as
    /// its buckets fill, see `sharded.rs`).
    fn whole(&self) -> Result<&Master> {
        match &self.memory {
            Memory::Whole(master) => Ok(master),
            Memory::Shard(_) => Err(Error::new(
                ErrorKind::Internal,
                "a hook micro-batch is staged over a whole master only",
            )),
        }
    }

    /// Every tensor's stats from this rank's segment `sums` (times `scale`) and the proposal's
    /// counts, shared over the boundary's groups, kept for `tensor_stats`.
    fn share_stats(
        &self,
        segments: &Segments,
        p: &Proposal<'_>,
        sums: Vec<f64>,
        scale: f64,
    ) -> Result<()> {
        let (group, replicas) = (sized(p.comm)?, sized(p.replicas)?);
        // A shard group of one: the replicas hold the pieces.
        let (group, replicas) = if group.is_none() { (replicas, None) } else { (group, replicas) };
        let stats = tensor_stats::share(segments, group, replicas, sums, &p.nonfinite, scale)?;
        *self.stats.lock() = Some(stats);
        Ok(())
    }

    /// The boundary of a store holding the whole master, taking the measurement of the last add
    /// (`folded`) where its pass would only measure the master this process holds alone.
    fn reduce_whole(
        &self,
        master: &mut MasterWrite,
        p: &Proposal<'_>,
        agreed: &Agreed,
        squares: Option<&Squares<'_>>,
        folded: Option<Folded>,
    ) -> Result<Outcome> {
        let all = self.held_mut(master, 0..self.plan.layout.len());
        let (host, replicas) = (between_ranks(p.comm)?, between_ranks(p.replicas)?);
        // Only a reduction between ranks has a wire (in a hybrid boundary, the first: the
        // replicas then sum FP32 sums); the communicator rounds the contributions.
        let wire = if host.or(replicas).is_some() { self.plan.config.wire } else { Dtype::F32 };
        let boundary = Boundary::new(&self.plan, agreed, wire, p.defer_clip);
        let pass = boundary.pass;
        let shards = self.plan.shards();
        // One process passes the whole master as one run: a thread's worth per thread at a time.
        let piece = (host.is_none() && replicas.is_none()).then_some(pass.piece());
        let measured = Measured::new(&pass, squares, all, 0, piece);
        let mut folded_squares = None;
        let block_sums = match (host, replicas) {
            // The communicator runs the pass on the sum, possibly share by share as it completes.
            (Some(c), None) if shards.is_empty() => {
                c.allreduce_with_pass(all, self.plan.layout.buckets(), &measured)?
            }
            (Some(c), None) => c.reduce_scatter_with_pass(all, &shards, &measured)?,
            (Some(c), Some(r)) => hybrid(c, r, all, &shards, pass, squares)?,
            // A shard group of one: the shard is the whole gradient, all-reduced over the replicas.
            (None, Some(r)) => r.allreduce_with_pass(all, self.plan.layout.buckets(), &measured)?,
            (None, None) => match folded.filter(|_| pass.factor.is_none()) {
                Some(f) => {
                    folded_squares = f.squares;
                    finish_whole(all, &pass, f.block_sums, pass.threads)
                }
                None => pass_whole(all, &measured, pass.threads),
            },
        };
        Ok(Outcome {
            info: boundary.info(&block_sums),
            stats_scale: boundary.stats_scale(),
            deferred: boundary.deferred(&block_sums),
            squares: folded_squares,
        })
    }

    /// Whether `add_final` over a whole master measures: where the boundary's pass may only
    /// measure (with clipping, or without a divisor); elsewhere that pass normalises as it
    /// measures, so the sums of the values before it would not serve.
    fn folds(&self) -> bool {
        let config = &self.plan.config;
        config.max_grad_norm != 0.0 || config.normalize == crate::Normalize::None
    }

    /// The last add's measurement, taken; none when the master was written since.
    fn take_fold(&self) -> Option<Folded> {
        let Memory::Whole(whole) = &self.memory else { return None };
        self.folded.lock().take().filter(|f| f.writes == whole.writes())
    }

    /// The staging, allocated at its first use.
    fn stage(&self) -> Result<&Master> {
        if let Some(stage) = self.stage.get() {
            return Ok(stage);
        }
        let _ = self.stage.set(Master::owned(self.plan.layout.len())?);
        Ok(self.stage.get().expect("set above"))
    }

    /// The shard memory `s` at work with this store's plan and overflow flag.
    fn sharded<'a>(&'a self, s: &'a ShardMemory) -> super::sharded::Sharded<'a> {
        s.with(&self.plan, &self.found_inf)
    }
}

impl MasterMemory for HostStore {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn zero(&self, master: &mut MasterWrite, index: usize) -> Result<()> {
        // Under sharded accumulation only the shard's part is zeroed.
        self.held_mut(master, self.plan.layout.range(index)).fill(0.0);
        Ok(())
    }

    fn clear_found_inf(&self) -> Result<()> {
        self.found_inf.store(false, Ordering::Relaxed);
        Ok(())
    }

    fn master_address(&self, offset: usize) -> *mut f32 {
        match &self.memory {
            // The caller may write through it.
            Memory::Whole(master) => {
                master.note_write();
                master.ptr_at(offset)
            }
            Memory::Shard(s) => s.shard.ptr_at(s.sharding.offset(offset)),
        }
    }

    fn read(&self, master: &MasterWrite, range: Range<usize>, out: &mut [f32]) -> Result<()> {
        out.copy_from_slice(self.held(master, range));
        Ok(())
    }

    fn write(&self, master: &mut MasterWrite, values: &[f32]) -> Result<()> {
        let from = self.plan.held().start;
        self.held_mut(master, from..from + values.len()).copy_from_slice(values);
        Ok(())
    }

    fn found_inf(&self) -> Result<bool> {
        Ok(self.found_inf.load(Ordering::Relaxed))
    }

    fn set_found_inf(&self, value: bool) -> Result<()> {
        self.found_inf.store(value, Ordering::Relaxed);
        Ok(())
    }

    fn view(
        &self,
        master: &MasterWrite,
        range: Range<usize>,
        f: &mut dyn FnMut(&[f32]),
    ) -> Result<()> {
        f(self.held(master, range));
        Ok(())
    }
}

impl AddKernels for HostStore {
    fn add(
        &self,
        master: &mut MasterWrite,
        scale: ScaleSource<'_>,
        grads: Grads<'_>,
        weight: f64,
        first: &dyn Fn(usize) -> bool,
    ) -> Result<bool> {
        let grads = grads.host()?;
        let factor = unscale_factor(scale, weight)?;
        if let Memory::Shard(s) = &self.memory {
            // Whether this rank's gradients were non-finite: the shard's flag also takes the
            // other ranks' values.
            return self.sharded(s).add(Some(grads), factor);
        }
        let layout = &self.plan.layout;
        let all = self.held_mut(master, 0..layout.len());
        let ranges = (0..grads.len()).map(|i| layout.range(i));
        let passes = split_ranges(all, ranges)
            .into_iter()
            .zip(grads)
            .enumerate()
            .map(|(i, (master, &grad))| simd::TensorPass { master, grad, assign: first(i) })
            .collect();
        // One pass over all tensors: the threads share the micro-batch, not each large tensor.
        Ok(self.flag(simd::accumulate_many(passes, factor, self.plan.config.threads)))
    }

    fn add_final(
        &self,
        master: &mut MasterWrite,
        scale: ScaleSource<'_>,
        grads: Grads<'_>,
        weight: f64,
        first: &dyn Fn(usize) -> bool,
    ) -> Result<bool> {
        let (Memory::Whole(whole), true) = (&self.memory, self.folds()) else {
            return self.add(master, scale, grads, weight, first);
        };
        let (grads, factor) = (grads.host()?, unscale_factor(scale, weight)?);
        let layout = &self.plan.layout;
        let tensors: Vec<simd::PlacedPass<'_>> = (grads.iter().enumerate())
            .map(|(i, &grad)| simd::PlacedPass {
                start: layout.range(i).start,
                grad,
                assign: first(i),
            })
            .collect();
        let all = whole.slice_mut(master, 0..layout.len());
        let mut block_sums = vec![0.0; simd::blocks(all.len())];
        let squares = self.segments.as_ref().map(Segments::squares);
        let record = |at: usize, piece: &[f32]| {
            if let Some(squares) = &squares {
                squares.record(at, piece, &segment_sum_squares);
            }
        };
        let threads = self.plan.config.threads;
        let bad = simd::accumulate_and_block_sum_squares(
            all,
            &tensors,
            factor,
            &mut block_sums,
            threads,
            &record,
        );
        let squares = squares.map(Squares::into_sums);
        *self.folded.lock() = Some(Folded { writes: whole.writes(), block_sums, squares });
        Ok(self.flag(bad))
    }

    fn add_tensor(
        &self,
        tensor: &mut TensorWrite,
        scale: ScaleSource<'_>,
        grad: Gradient<'_>,
        weight: f64,
        first: bool,
    ) -> Result<bool> {
        let grad = grad.host()?;
        let factor = unscale_factor(scale, weight)?;
        let master = match &self.memory {
            Memory::Whole(master) => master.tensor_mut(tensor),
            // Under DropMicrobatch, whether the gradient was poisoned (staged as zeros).
            Memory::Shard(s) => return self.sharded(s).add_tensor(tensor.index(), grad, factor),
        };
        let threads = self.plan.config.threads;
        Ok(self.flag(simd::accumulate(master, grad, factor, first, threads)))
    }

    fn bad_gradients(
        &self,
        scale: ScaleSource<'_>,
        grads: Grads<'_>,
        weight: f64,
    ) -> Result<Vec<usize>> {
        let factor = unscale_factor(scale, weight)?;
        Ok(check::nonfinite_tensors(grads.host()?, factor, self.plan.config.threads))
    }

    fn finite_gradient(
        &self,
        scale: ScaleSource<'_>,
        grad: Gradient<'_>,
        weight: f64,
    ) -> Result<bool> {
        Ok(check::finite_after_unscale(grad.host()?, unscale_factor(scale, weight)?))
    }

    /// None under sharded accumulation: its shard also holds the other ranks' values.
    fn first_bad_master(&self, master: &MasterWrite) -> Result<Option<usize>> {
        let Memory::Whole(whole) = &self.memory else { return Ok(None) };
        Ok((0..self.plan.descs.len()).find(|&i| {
            crate::state::holds_non_finite(whole.slice(master, self.plan.layout.range(i)))
        }))
    }

    fn stage_tensor(
        &self,
        tensor: &mut TensorWrite,
        scale: ScaleSource<'_>,
        grad: Gradient<'_>,
        weight: f64,
        first: bool,
    ) -> Result<bool> {
        self.whole()?;
        let (grad, factor) = (grad.host()?, unscale_factor(scale, weight)?);
        let staged = self.stage()?.tensor_mut(tensor);
        Ok(simd::accumulate(staged, grad, factor, first, self.plan.config.threads))
    }

    fn merge_staged(&self, master: &mut MasterWrite, index: usize, first: bool) -> Result<bool> {
        let range = self.plan.layout.range(index);
        let (master, staged) = self.whole()?.pair_mut(self.stage()?, master, range);
        // The accumulation kernel with a factor of 1 (exact): the staging's values as they are.
        let threads = self.plan.config.threads;
        Ok(self.flag(simd::accumulate(master, Grad::F32(staged), 1.0, first, threads)))
    }
}

impl MicrobatchTurns for HostStore {
    fn shard(&self) -> Option<&Shard> {
        match &self.memory {
            Memory::Whole(_) => None,
            Memory::Shard(s) => Some(&s.sharding),
        }
    }

    /// Under sharded accumulation, the micro-batch's control step (see `sharded.rs`).
    fn open_microbatch(
        &self,
        master: &MasterWrite,
        first: bool,
        whole: bool,
        error: Option<&Error>,
    ) -> Result<()> {
        match &self.memory {
            Memory::Whole(_) => error.map_or(Ok(()), |e| Err(e.clone())),
            Memory::Shard(s) => self.sharded(s).open_microbatch(master, first, whole, error),
        }
    }

    fn close_microbatch(&self, master: &mut MasterWrite) -> Result<bool> {
        match &self.memory {
            Memory::Whole(_) => Ok(false),
            Memory::Shard(s) => self.sharded(s).close_microbatch(master),
        }
    }

    fn add_nothing(&self, _master: &mut MasterWrite) -> Result<bool> {
        match &self.memory {
            Memory::Whole(_) => Ok(false),
            Memory::Shard(s) => self.sharded(s).add(None, 0.0).map(|_| true),
        }
    }
}

impl BoundaryWork for HostStore {
    fn agree(&self, p: &Proposal<'_>) -> Result<Agreed> {
        agree(&self.plan, p, self.found_inf.load(Ordering::Relaxed))
    }

    fn reduce(
        &self,
        master: &mut MasterWrite,
        p: &Proposal<'_>,
        agreed: &Agreed,
        _read: bool,
    ) -> Result<Option<SyncInfo>> {
        let squares = self.segments.as_ref().map(Segments::squares);
        *self.deferred.lock() = None;
        let folded = self.take_fold();
        let out = match &self.memory {
            Memory::Whole(_) => self.reduce_whole(master, p, agreed, squares.as_ref(), folded)?,
            Memory::Shard(s) => {
                let (info, stats_scale, deferred) =
                    self.sharded(s).reduce(master, p, agreed, squares.as_ref())?;
                Outcome { info, stats_scale, deferred, squares: None }
            }
        };
        let Outcome { info, stats_scale, deferred, squares: folded_squares } = out;
        if let (Some(segments), Some(squares)) = (&self.segments, squares) {
            let sums = folded_squares.unwrap_or_else(|| squares.into_sums());
            self.share_stats(segments, p, sums, stats_scale)?;
        }
        *self.deferred.lock() = deferred;
        Ok(Some(info))
    }

    fn take_deferred(&self) -> Option<f32> {
        self.deferred.lock().take()
    }

    #[cfg(test)]
    fn holds_fold(&self) -> bool {
        let Memory::Whole(whole) = &self.memory else { return false };
        self.folded.lock().as_ref().is_some_and(|f| f.writes == whole.writes())
    }

    fn scale_result(&self, master: &mut MasterWrite, factor: f32) -> Result<()> {
        simd::scale(self.held_mut(master, self.plan.shard()), factor, self.plan.config.threads);
        Ok(())
    }

    fn tensor_stats(&self) -> Option<Vec<TensorStats>> {
        self.stats.lock().clone()
    }

    fn count_only(&self, p: &Proposal<'_>) -> Result<()> {
        let Some(segments) = &self.segments else { return Ok(()) };
        self.share_stats(segments, p, segments.squares().into_sums(), 1.0)
    }
}

/// The parts of `all` at `ranges` (increasing, disjoint), borrowed apart.
fn split_ranges(
    mut all: &mut [f32],
    ranges: impl Iterator<Item = Range<usize>>,
) -> Vec<&mut [f32]> {
    let mut at = 0;
    ranges
        .map(|r| {
            let (_, rest) = std::mem::take(&mut all).split_at_mut(r.start - at);
            let (part, rest) = rest.split_at_mut(r.len());
            (all, at) = (rest, r.end);
            part
        })
        .collect()
}

/// The boundary's control step over the shard group (or the whole group) and the replicas (see
/// [`protocol`]): the claims carry the window's counts, so the agreed totals are the world's.
pub(super) fn agree(plan: &Plan, p: &Proposal<'_>, found_inf: bool) -> Result<Agreed> {
    let found_inf = p.microbatches != 0 && found_inf;
    let mine = Control {
        count: p.count,
        microbatches: p.microbatches,
        ranks: p.ranks,
        found_inf,
        dropped: p.dropped,
        first_bad: p.first_bad(found_inf && p.unlocated_if_flagged(plan)),
        ..Step::Boundary.claim(plan, p.replicas.map(|r| r.world_size()), p.error.is_some())
    };
    let group = p.comm.map(host_collectives).transpose()?.map(HostChannel);
    let replicas = p.replicas.map(host_collectives).transpose()?.map(HostChannel);
    let shard = plan.config.sharding.shard().map_or(0, |(_, rank)| rank);
    let total = protocol::agree(
        Step::Boundary,
        group.as_ref().map(|c| c as &dyn Channel),
        replicas.as_ref().map(|c| (c as &dyn Channel, shard)),
        &ControlSum::of(&mine),
        p.error.as_ref(),
    )?;
    Ok(Agreed { totals: Some(total) })
}

/// The factor that unscales and weights a micro-batch's gradients: `weight` over the scaler's
/// host scale.
pub(super) fn unscale_factor(scale: ScaleSource<'_>, weight: f64) -> Result<f32> {
    Ok(math::unscale_factor(weight, scale.host()?))
}

/// What a boundary computes from the agreed totals: the divisor and the pass over the sum.
pub(super) struct Boundary {
    total: ControlSum,
    divisor: u64,
    pub pass: NormPass,
}

impl Boundary {
    /// Without clipping the factor is known before the norm, so the pass that measures each
    /// block also normalises it. With clipping the factor depends on the norm: the pass only
    /// measures, and its second step scales once every block's sum is known.
    /// With `defer`, the second step is left to the caller ([`Boundary::deferred`]).
    pub(super) fn new(plan: &Plan, agreed: &Agreed, wire: Dtype, defer: bool) -> Self {
        let total = agreed.totals.expect("the host agreement has totals");
        let config = &plan.config;
        let divisor = config.normalize.divisor(total.count, total.microbatches, total.ranks);
        let max_norm = config.max_grad_norm as f64;
        let normalize = (1.0 / divisor as f64) as f32;
        let clip = (max_norm != 0.0).then_some(Clip { max_norm, divisor });
        let pass = NormPass {
            factor: (clip.is_none() && normalize != 1.0).then_some(normalize),
            clip,
            defer,
            threads: config.threads,
            wire,
        };
        Boundary { total, divisor, pass }
    }

    /// What turns a sum of squares of the values the pass leaves into the normalised gradient's:
    /// without clipping the pass normalises first; with it, the pass only measures.
    pub(super) fn stats_scale(&self) -> f64 {
        match self.pass.factor {
            Some(_) => 1.0,
            None => 1.0 / (self.divisor as f64 * self.divisor as f64),
        }
    }

    /// The boundary's report, from the values of every block of the sum. A non-finite norm is
    /// an overflow too: every rank added finite values, but their sum overflowed (or a BF16 wire
    /// rounded a value to infinity). The norm sums squares of f32 values in f64, where a finite
    /// gradient cannot overflow and NaN propagates, so the norm is finite exactly when every
    /// element of the reduced gradient is, and every rank has its bits: the ranks agree without
    /// another collective.
    pub(super) fn info(&self, block_sums: &[f64]) -> SyncInfo {
        let max_norm = self.pass.clip.map_or(0.0, |c| c.max_norm);
        let (grad_norm, clip_coef) = norm_and_clip(block_sums, self.divisor, max_norm);
        let t = &self.total;
        SyncInfo::of(t, grad_norm, clip_coef)
    }

    /// The second step's factor when the pass deferred it (from the values of every block, as
    /// [`BlockPass::rescale`] computes it); none when it ran, or would leave the sum as it is.
    pub(super) fn deferred(&self, block_sums: &[f64]) -> Option<f32> {
        self.pass.defer.then(|| self.pass.rescale(block_sums)).flatten()
    }
}

/// The boundary's pass over the summed master buffer: each block's sum of squares, and the
/// normalisation when its factor is known before the norm (no clipping); with clipping, a second
/// step scales by the clipping coefficient over the divisor once the norm is known.
#[derive(Clone, Copy)]
pub(super) struct NormPass {
    pub factor: Option<f32>,
    pub clip: Option<Clip>,
    /// The second step is left to the boundary's caller: no communicator runs it.
    pub defer: bool,
    pub threads: usize,
    pub wire: Dtype,
}

impl NormPass {
    /// Elements one process passes at a time over a buffer it holds whole: a thread's worth per
    /// thread, so that the per-tensor sums read each piece while it is in cache.
    pub(super) fn piece(&self) -> usize {
        self.threads.max(1) * simd::MIN_ELEMENTS_PER_THREAD
    }
}

/// The host collectives of a communicator: a CPU accumulator reduces on no other.
pub(super) fn host_collectives(c: &dyn Communicator) -> Result<&dyn HostCollectives> {
    c.host().ok_or_else(|| {
        Error::new(ErrorKind::DeviceMismatch, "a device's communicator for a CPU accumulator")
    })
}

/// [`between_ranks`] with the group's size.
fn sized(c: Option<&dyn Communicator>) -> Result<Option<tensor_stats::Group<'_>>> {
    Ok(between_ranks(c)?.zip(c.map(|c| c.world_size())))
}

/// The host collectives of a group of more than one rank; `None` for no group or a group of one.
pub(super) fn between_ranks(c: Option<&dyn Communicator>) -> Result<Option<&dyn HostCollectives>> {
    c.filter(|c| c.world_size() > 1).map(host_collectives).transpose()
}

/// The hybrid boundary: a reduce-scatter over the shard group whose pass all-reduces each piece
/// of the shard over the replicas (with the normalisation, but without the second step), so the
/// pieces are final before the shard group gathers the block values and clips. A failure on any
/// replica group then fails every rank, through one more control reduction over the shard group.
fn hybrid(
    shard: &dyn HostCollectives,
    replicas: &dyn HostCollectives,
    buf: &mut [f32],
    shards: &[Range<usize>],
    pass: NormPass,
    squares: Option<&Squares<'_>>,
) -> Result<Vec<f64>> {
    let over = OverReplicas {
        replicas,
        inner: NormPass { clip: None, wire: Dtype::F32, ..pass },
        outer: pass,
        failed: Mutex::new(None),
    };
    let measured = Measured::new(&over, squares, buf, 0, None);
    let values = shard.reduce_scatter_with_pass(buf, shards, &measured)?;
    let failed = over.failed.into_inner();
    let told =
        shard.reduce_control(&ControlSum { error: failed.is_some(), ..Default::default() })?;
    match failed {
        Some(e) => Err(e),
        None if told.error => Err(protocol::replica_failed()),
        None => Ok(values),
    }
}

/// The hybrid boundary's pass over the shard group (see [`hybrid`]). The shard group calls `run`
/// on one piece at a time, in the same order on every replica.
struct OverReplicas<'a> {
    replicas: &'a dyn HostCollectives,
    /// What the replicas run on each piece: `outer` without its second step.
    inner: NormPass,
    outer: NormPass,
    failed: Mutex<Option<Error>>,
}

impl BlockPass for OverReplicas<'_> {
    fn run(&self, run: &mut [f32], values: &mut [f64]) {
        let mut failed = self.failed.lock();
        if failed.is_none() {
            let whole = 0..run.len();
            match self.replicas.allreduce_with_pass(run, std::slice::from_ref(&whole), &self.inner)
            {
                Ok(v) => values.copy_from_slice(&v),
                Err(e) => *failed = Some(e),
            }
        }
    }

    fn rescales(&self) -> bool {
        self.outer.rescales()
    }

    fn rescale(&self, values: &[f64]) -> Option<f32> {
        self.outer.rescale(values)
    }

    fn wire(&self) -> Dtype {
        self.outer.wire
    }
}

/// A boundary pass that also sums each tensor's squares of every run it passes, while the run is
/// in cache (`tensor_stats`); without squares to fill, the pass alone.
pub(super) struct Measured<'a> {
    inner: &'a dyn BlockPass,
    squares: Option<&'a Squares<'a>>,
    /// The addresses of the master (or shard) passed over, and the flat position of its first
    /// element: a run's place in the layout is its offset from there.
    buf: Range<usize>,
    first: usize,
    /// Elements a run is passed in, so each piece is summed while in cache; none to take runs as
    /// they come (a communicator's shares are already that small, and a hybrid boundary's runs
    /// are collectives, whose number must not depend on this rank's threads).
    piece: Option<usize>,
}

impl<'a> Measured<'a> {
    /// `inner` over `buf`, which holds the layout's elements from flat position `first` on.
    pub(super) fn new(
        inner: &'a dyn BlockPass,
        squares: Option<&'a Squares<'a>>,
        buf: &[f32],
        first: usize,
        piece: Option<usize>,
    ) -> Self {
        let buf = buf.as_ptr() as usize..buf.as_ptr_range().end as usize;
        Measured { inner, squares, buf, first, piece }
    }

    fn record(&self, run: &[f32]) {
        let Some(squares) = self.squares else { return };
        // Every communicator passes over runs of the buffer it reduces (as `AddInto` relies on).
        let start = run.as_ptr() as usize;
        assert!(
            self.buf.start <= start && start + size_of_val(run) <= self.buf.end,
            "a boundary pass over a run outside the master"
        );
        let at = self.first + (start - self.buf.start) / size_of::<f32>();
        squares.record(at, run, &segment_sum_squares);
    }
}

/// A per-tensor segment's sum of squares: each segment lies in one block, which the block kernel
/// on the widest vectors sums.
fn segment_sum_squares(segment: &[f32]) -> f64 {
    let mut one = [0.0];
    simd::block_sum_squares(segment, &mut one, 1);
    one[0]
}

impl BlockPass for Measured<'_> {
    fn run(&self, run: &mut [f32], values: &mut [f64]) {
        let (Some(piece), Some(_)) = (self.piece, self.squares) else {
            self.inner.run(run, values);
            return self.record(run);
        };
        for (part, part_values) in
            run.chunks_mut(piece).zip(values.chunks_mut(piece / math::NORM_BLOCK))
        {
            self.inner.run(part, part_values);
            self.record(part);
        }
    }

    fn add_and_run(&self, run: &mut [f32], addend: &[f32], values: &mut [f64]) {
        self.inner.add_and_run(run, addend, values);
        self.record(run);
    }

    fn rescales(&self) -> bool {
        self.inner.rescales()
    }

    fn rescale(&self, values: &[f64]) -> Option<f32> {
        self.inner.rescale(values)
    }

    fn writes_values(&self) -> bool {
        self.inner.writes_values()
    }

    fn wire(&self) -> Dtype {
        self.inner.wire()
    }
}

/// What the clipping coefficient needs beyond the block sums.
#[derive(Clone, Copy)]
pub(super) struct Clip {
    max_norm: f64,
    divisor: u64,
}

/// The global norm of the normalised gradient and the clipping coefficient, from the block sums
/// of squares of the unnormalised sum: `max_norm / (norm + 1e-6)`, at most 1; 1 for a non-finite
/// norm or without clipping (`max_norm` 0). Every rank computes it from the same sums, so every
/// rank has the same bits.
fn norm_and_clip(block_sums: &[f64], divisor: u64, max_norm: f64) -> (f64, f64) {
    let grad_norm = simd::fold_block_sums(block_sums).sqrt() / divisor as f64;
    (grad_norm, math::clip_coef(grad_norm, max_norm))
}

impl BlockPass for NormPass {
    fn run(&self, run: &mut [f32], sums: &mut [f64]) {
        match self.factor {
            Some(factor) => simd::scale_and_block_sum_squares(run, factor, sums, self.threads),
            None => simd::block_sum_squares(run, sums, self.threads),
        }
    }

    fn add_and_run(&self, run: &mut [f32], addend: &[f32], sums: &mut [f64]) {
        simd::add_and_block_sum_squares(run, addend, self.factor, sums);
    }

    fn rescales(&self) -> bool {
        self.clip.is_some() && !self.defer
    }

    /// The clipping coefficient over the divisor, rounded to f32 once; `None` when that is 1.
    fn rescale(&self, sums: &[f64]) -> Option<f32> {
        let clip = self.clip?;
        let (_, clip_coef) = norm_and_clip(sums, clip.divisor, clip.max_norm);
        Some((clip_coef / clip.divisor as f64) as f32).filter(|&f| f != 1.0)
    }

    fn wire(&self) -> Dtype {
        self.wire
    }
}
