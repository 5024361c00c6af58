//! Communicators: how the ranks of a data-parallel group meet at the accumulation boundary.
//!
//! Every communicator has one shape, [`Communicator`]: its rank, its group's size, its device,
//! abort and timeout. What it reduces depends on the memory it reduces, and this is the one place
//! that says so:
//! - A host transport (in-process threads, MPI) offers [`HostCollectives`]
//!   ([`Communicator::host`]): calls over host buffers that return when done, the small control
//!   reduction that makes every rank agree on counts, overflow and errors, and an in-place sum of
//!   FP32 buffers, bitwise identical on every rank, run together with the boundary's per-block
//!   pass over the sum.
//! - A device's transport lives with its device's backend, which recognises its own through
//!   [`std::any::Any`] (NCCL: `backend::cuda::nccl`): its calls are enqueued on the device's
//!   streams and return before the data moved.
//!
//! No list of transports is closed here: a store asks its communicator for what its device
//! needs, and a communicator of the other kind is a DEVICE_MISMATCH, found before anything is
//! reduced.

#[cfg(feature = "mpi")]
mod beacon;
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
mod liveness;
mod local;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) mod packing;
// Without MPI only the plan and the per-share sum are used (by the in-process communicator).
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) mod shares;
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) mod shm;

pub use local::LocalComm;
#[cfg(feature = "mpi")]
pub use mpi::{MpiComm, MpiOptions};

use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::device::Device;
use crate::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};
use crate::simd;

/// The boundary's work on the summed buffer, handed to [`HostCollectives::allreduce_with_pass`].
/// It runs on runs of the sum that start at a multiple of [`crate::math::NORM_BLOCK`] elements of
/// the whole buffer and hold whole blocks (only the buffer's last block may be short); it may
/// change the run in place and writes one value per block of the run. What it does to a block,
/// and the value it writes, must depend on that block's elements alone: then any cut of the
/// buffer into runs, on any rank, gives the same bits.
pub trait BlockPass: Sync {
    /// Passes over `run`, writing one value per block into `values`.
    fn run(&self, run: &mut [f32], values: &mut [f64]);

    /// `run[i] += addend[i]`, then [`BlockPass::run`]: a communicator that sums a share of the
    /// buffer itself ends it with this. The default does one after the other; an implementation
    /// may fuse them block by block, with the same bits.
    fn add_and_run(&self, run: &mut [f32], addend: &[f32], values: &mut [f64]) {
        simd::add_assign(run, addend);
        self.run(run, values);
    }

    /// Whether the pass has a second step, [`BlockPass::rescale`]: a factor for every element of
    /// the sum that depends on every block's value (the boundary's clipping coefficient). A
    /// communicator that hands out finished shares as it goes must then hold them until every
    /// block's value is known. `false` by default.
    fn rescales(&self) -> bool {
        false
    }

    /// The second step's factor, from the values of every block of the buffer in block order
    /// (the same on every rank), or `None` to leave the sum as it is. Called once per rank, only
    /// when [`BlockPass::rescales`]; the communicator multiplies each element of the sum by the
    /// factor exactly once (each rank its own shares, before handing them out), with
    /// [`simd::scale`]'s bits.
    fn rescale(&self, _values: &[f64]) -> Option<f32> {
        None
    }

    /// Whether the values the pass writes are wanted: without them (`false`) a communicator may
    /// skip gathering them between ranks, and returns zeros. A pass that rescales needs them.
    /// `true` by default.
    fn writes_values(&self) -> bool {
        true
    }

    /// What the contributions travel as: with [`Dtype::Bf16`] the communicator rounds each
    /// rank's contribution to bfloat16 once ([`simd::round_to_bf16`]'s bits) before it is summed,
    /// so a transport between processes sends half the bytes; the sums stay FP32 in rank order,
    /// the bits of an FP32 wire on rounded contributions. [`Dtype::F32`] by default.
    fn wire(&self) -> Dtype {
        Dtype::F32
    }
}

/// What one rank brings to the boundary's control reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Control {
    /// Elements this rank will reduce: ranks that disagree fail together instead of corrupting
    /// memory.
    pub numel: u64,
    /// A fingerprint of the tensor and bucket layout, compared like `numel`.
    pub layout: u64,
    /// Items (samples or tokens) added in this rank's window.
    pub count: u64,
    /// Micro-batches added in this rank's window.
    pub microbatches: u64,
    /// How many ranks' windows this rank's window sums: 1 for its own, more after merges of
    /// saved windows. BY_WORLD divides by the sum over the group.
    pub ranks: u64,
    /// This rank saw a non-finite value.
    pub found_inf: bool,
    /// Micro-batches this rank dropped (`Overflow::DropMicrobatch`).
    pub dropped: u64,
    /// Where this rank's window first went non-finite, as an [`OverflowKey`]; `u64::MAX` when
    /// it stayed finite.
    pub first_bad: u64,
    /// This rank cannot complete the boundary (its call was invalid); all ranks then stop.
    pub error: bool,
}

/// The reduction of every rank's [`Control`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ControlSum {
    pub min_numel: u64,
    pub max_numel: u64,
    pub min_layout: u64,
    pub max_layout: u64,
    pub count: u64,
    pub microbatches: u64,
    pub ranks: u64,
    pub found_inf: bool,
    pub dropped: u64,
    /// The smallest of the ranks' keys.
    pub first_bad: u64,
    pub error: bool,
}

impl Default for Control {
    fn default() -> Self {
        Control {
            numel: 0,
            layout: 0,
            count: 0,
            microbatches: 0,
            ranks: 0,
            found_inf: false,
            dropped: 0,
            first_bad: OverflowKey::NONE,
            error: false,
        }
    }
}

impl Default for ControlSum {
    fn default() -> Self {
        ControlSum::of(&Control::default())
    }
}

/// A place where a window went non-finite (micro-batch, tensor, rank) as one word whose order is
/// the places' order, so the ranks agree on the first by a minimum. Fields past their width
/// saturate: micro-batch indices at 2^20 - 2, tensors at 2^24 - 1, ranks at 2^20 - 1.
pub struct OverflowKey;

impl OverflowKey {
    /// No place: the window stayed finite.
    pub const NONE: u64 = u64::MAX;
    /// A window that went non-finite where no place was recorded (restored from a saved window,
    /// or on a store that cannot locate). Its place may be any, the very first included, so it
    /// sorts before every located place: a group with such a rank reports no place.
    pub const UNLOCATED: u64 = 0;
    const RANK_BITS: u32 = 20;
    const TENSOR_BITS: u32 = 24;
    const MICROBATCH_BITS: u32 = 64 - Self::TENSOR_BITS - Self::RANK_BITS;

    pub fn of(microbatch: u64, tensor: usize, rank: usize) -> u64 {
        let field = |v: u64, bits: u32| v.min((1 << bits) - 1);
        // The all-ones word is NONE and located keys start at 1 (0 is UNLOCATED): the largest
        // micro-batch index stops one short of all ones, so adding 1 never reaches NONE.
        let mb = field(microbatch, Self::MICROBATCH_BITS).min((1 << Self::MICROBATCH_BITS) - 2);
        let place = mb << (Self::TENSOR_BITS + Self::RANK_BITS)
            | field(tensor as u64, Self::TENSOR_BITS) << Self::RANK_BITS
            | field(rank as u64, Self::RANK_BITS);
        place + 1
    }

    /// The key's (micro-batch, tensor, rank); `None` for [`Self::NONE`] and
    /// [`Self::UNLOCATED`].
    pub fn parts(key: u64) -> Option<(u64, usize, usize)> {
        (key != Self::UNLOCATED && key != Self::NONE).then(|| {
            let place = key - 1;
            let mask = |bits: u32| (1u64 << bits) - 1;
            (
                place >> (Self::TENSOR_BITS + Self::RANK_BITS),
                (place >> Self::RANK_BITS & mask(Self::TENSOR_BITS)) as usize,
                (place & mask(Self::RANK_BITS)) as usize,
            )
        })
    }
}

impl ControlSum {
    /// The reduction over a single rank.
    pub fn of(c: &Control) -> Self {
        ControlSum {
            min_numel: c.numel,
            max_numel: c.numel,
            min_layout: c.layout,
            max_layout: c.layout,
            count: c.count,
            microbatches: c.microbatches,
            ranks: c.ranks,
            found_inf: c.found_inf,
            dropped: c.dropped,
            first_bad: c.first_bad,
            error: c.error,
        }
    }

    /// The reduction over the ranks of both. Saturating sums: a wrapped count would silently
    /// mis-normalise.
    pub fn merge(self, o: &ControlSum) -> Self {
        ControlSum {
            min_numel: self.min_numel.min(o.min_numel),
            max_numel: self.max_numel.max(o.max_numel),
            min_layout: self.min_layout.min(o.min_layout),
            max_layout: self.max_layout.max(o.max_layout),
            count: self.count.saturating_add(o.count),
            microbatches: self.microbatches.saturating_add(o.microbatches),
            ranks: self.ranks.saturating_add(o.ranks),
            found_inf: self.found_inf | o.found_inf,
            dropped: self.dropped.saturating_add(o.dropped),
            first_bad: self.first_bad.min(o.first_bad),
            error: self.error | o.error,
        }
    }
}

/// How long a collective waits for the other ranks by default: PyTorch's process groups' default.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// One rank's endpoint of a data-parallel group. A device's backend recognises its own
/// transport by upcasting to [`Any`] and downcasting.
pub trait Communicator: Send + Sync + Any {
    /// This rank's index, in `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn world_size(&self) -> usize;

    /// Where the buffers it reduces live.
    fn device(&self) -> Device {
        Device::Cpu
    }

    /// The host collectives, where the communicator reduces host buffers; `None` for a device's
    /// transport, which its backend drives (see the module documentation).
    fn host(&self) -> Option<&dyn HostCollectives> {
        None
    }

    /// Stops this rank's use of the group: calls waiting in it, on any thread, fail with
    /// COMM_FAILURE, and so does every later call. Idempotent.
    fn abort(&self) -> Result<()> {
        Err(Error::new(ErrorKind::WrongState, "this communicator cannot be aborted"))
    }

    /// How long a collective may wait for the other ranks before it fails with TIMEOUT and aborts
    /// the communicator; `None` waits forever. [`DEFAULT_TIMEOUT`] at creation.
    fn timeout(&self) -> Option<Duration> {
        None
    }

    /// Sets [`Communicator::timeout`] for the collectives that start after this call.
    fn set_timeout(&self, _timeout: Option<Duration>) -> Result<()> {
        Err(Error::new(ErrorKind::WrongState, "this communicator has no timeout"))
    }

    /// A new communicator of the same transport over the ranks of this group that pass the same
    /// `color`, ranked by `key` (ties by rank; MPI_Comm_split, ncclCommSplit): how a mesh's
    /// groups are made from its world ([`crate::MeshShape::split`] passes each rank's color and
    /// key). Collective: every rank of the group calls it, at setup (like creation, it waits as
    /// long as its transport's split). In-process groups are made together instead
    /// ([`crate::MeshShape::local_groups`]).
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        let _ = (color, key);
        Err(Error::invalid(
            "this communicator cannot be split (in-process groups: MeshShape::local_groups)",
        ))
    }
}

/// The collectives of a host communicator. Every rank of the group must call them, in the same
/// order.
pub trait HostCollectives: Send + Sync {
    /// Reduces every rank's control values (a rank's own are `ControlSum::of(&control)`, or
    /// already the reduction over another group); every rank receives the same [`ControlSum`].
    fn reduce_control(&self, mine: &ControlSum) -> Result<ControlSum>;

    /// Sums `buf` over all ranks in place. Every rank ends with bitwise-identical contents.
    fn allreduce_sum(&self, buf: &mut [f32]) -> Result<()>;

    /// Sums each bucket `buf[b]` over all ranks in place; the buckets are disjoint and in
    /// ascending order. A backend may keep several in flight at once; this one reduces them one
    /// after another. Every rank must pass the same buckets.
    fn allreduce_buckets(&self, buf: &mut [f32], buckets: &[Range<usize>]) -> Result<()> {
        check_buckets(buf.len(), buckets)?;
        for b in buckets {
            self.allreduce_sum(&mut buf[b.clone()])?;
        }
        Ok(())
    }

    /// Sums `buf` over all ranks in place, as [`HostCollectives::allreduce_buckets`] does, and runs
    /// `pass` once over every element of the sum; returns the value `pass` wrote for each block of
    /// `buf`, in block order. Every rank ends with the same bits in `buf` and the same values.
    ///
    /// With [`BlockPass::rescales`], the sum is then multiplied by the factor
    /// [`BlockPass::rescale`] returns, and the values are those the pass wrote before that.
    ///
    /// This default reduces the buckets, then runs `pass` over the whole buffer on every rank. A
    /// backend may instead have each rank sum a share of the buffer, run `pass` on that share while
    /// it is still in cache, and then share the results: each rank then passes over `1/world` of
    /// the buffer, and never over memory another core has just written.
    fn allreduce_with_pass(
        &self,
        buf: &mut [f32],
        buckets: &[Range<usize>],
        pass: &dyn BlockPass,
    ) -> Result<Vec<f64>> {
        if pass.wire() == Dtype::Bf16 {
            simd::round_to_bf16(buf, 1);
        }
        self.allreduce_buckets(buf, buckets)?;
        Ok(pass_whole(buf, pass, 1))
    }

    /// As [`HostCollectives::allreduce_with_pass`], but this rank needs only `shards[rank]` of
    /// the result: the shards are contiguous, disjoint, in rank order, start on block boundaries
    /// and cover `buf`, one per rank, the same on every rank. That shard of `buf` ends with the
    /// sum, passed (and rescaled), bitwise as `allreduce_with_pass` leaves it; the rest of `buf`
    /// is unspecified. The values of every block are returned, as there.
    ///
    /// This default is the all-reduce, which leaves every shard reduced. A backend may instead
    /// sum and pass only each rank's own shard: half an all-reduce's traffic.
    fn reduce_scatter_with_pass(
        &self,
        buf: &mut [f32],
        shards: &[Range<usize>],
        pass: &dyn BlockPass,
    ) -> Result<Vec<f64>> {
        check_shards(buf.len(), shards, shards.len())?;
        self.allreduce_with_pass(buf, std::slice::from_ref(&(0..buf.len())), pass)
    }

    /// Every rank's `mine` concatenated in rank order, on every rank: rank q brings `counts[q]`
    /// values, and every rank passes the same `counts`. A sharded accumulation's boundary
    /// gathers its shards' block values with it.
    fn allgather_values(&self, mine: &[f64], counts: &[usize]) -> Result<Vec<f64>>;

    /// Every rank's `mine` bytes concatenated in rank order, on every rank, bit for bit: rank q
    /// brings `counts[q]` bytes, and every rank passes the same `counts`. This default carries
    /// them as the bit patterns of [`HostCollectives::allgather_values`]' values, 8 bytes each,
    /// which every implementation copies and never computes with.
    fn allgather_bytes(&self, mine: &[u8], counts: &[usize]) -> Result<Vec<u8>> {
        let words = |bytes: usize| bytes.div_ceil(8);
        let packed: Vec<f64> = mine
            .chunks(8)
            .map(|c| {
                let mut w = [0u8; 8];
                w[..c.len()].copy_from_slice(c);
                f64::from_bits(u64::from_le_bytes(w))
            })
            .collect();
        let word_counts: Vec<usize> = counts.iter().map(|&c| words(c)).collect();
        let all = self.allgather_values(&packed, &word_counts)?;
        let mut out = Vec::with_capacity(counts.iter().sum());
        let mut at = 0;
        for (&bytes, &n) in counts.iter().zip(&word_counts) {
            out.extend(all[at..at + n].iter().flat_map(|v| v.to_bits().to_le_bytes()).take(bytes));
            at += n;
        }
        Ok(out)
    }
}

/// `counts` has one entry per rank and this rank's is `mine`'s length.
pub(crate) fn check_counts(mine: usize, counts: &[usize], rank: usize, world: usize) -> Result<()> {
    if counts.len() != world || counts[rank] != mine {
        return Err(Error::invalid(format!(
            "{} counts for {world} ranks, rank {rank} bringing {mine} values: {counts:?}",
            counts.len()
        )));
    }
    Ok(())
}

/// One communicator handle's collective in progress: a concurrent second one on the same handle
/// is refused, because two collectives racing on one communicator would pair up differently on
/// different ranks.
#[derive(Debug, Default)]
pub(crate) struct Busy(AtomicBool);

impl Busy {
    /// Marks the handle busy until the guard drops; `what` names it in the error.
    pub(crate) fn enter(&self, what: impl FnOnce() -> String) -> Result<BusyGuard<'_>> {
        if self.0.swap(true, Ordering::Acquire) {
            return Err(Error::wrong_state(format!(
                "{} is already inside a collective on another thread",
                what()
            )));
        }
        Ok(BusyGuard(&self.0))
    }
}

pub(crate) struct BusyGuard<'a>(&'a AtomicBool);

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Runs `pass` over all of `buf` on this rank alone, then its second step on `threads` threads:
/// what a group of one rank, or a communicator without shares, does with the sum. Returns the
/// values of the first step.
pub(crate) fn pass_whole(buf: &mut [f32], pass: &dyn BlockPass, threads: usize) -> Vec<f64> {
    let mut values = vec![0.0; simd::blocks(buf.len())];
    pass.run(buf, &mut values);
    finish_whole(buf, pass, values, threads)
}

/// [`pass_whole`]'s second step, on the block `values` of `buf` as its run measured them (or an
/// add that measured them as it wrote `buf`, where the run would only measure).
pub(crate) fn finish_whole(
    buf: &mut [f32],
    pass: &dyn BlockPass,
    values: Vec<f64>,
    threads: usize,
) -> Vec<f64> {
    if let Some(factor) = pass.rescales().then(|| pass.rescale(&values)).flatten() {
        simd::scale(buf, factor, threads);
    }
    values
}

/// Shards must be `world` contiguous ranges in rank order that cover the buffer, each starting on
/// a block boundary of the norm.
pub(crate) fn check_shards(len: usize, shards: &[Range<usize>], world: usize) -> Result<()> {
    let mut end = 0;
    for (q, s) in shards.iter().enumerate() {
        if s.start != end
            || s.start > s.end
            || !(s.start.is_multiple_of(crate::math::NORM_BLOCK) || s.is_empty())
        {
            let block = crate::math::NORM_BLOCK;
            return Err(Error::invalid(format!(
                "shard {q} ({s:?}) must start at {end}, a multiple of {block} elements"
            )));
        }
        end = s.end;
    }
    if shards.len() != world || end != len {
        return Err(Error::invalid(format!(
            "{} shards covering {end} elements for {world} ranks and a buffer of {len}",
            shards.len()
        )));
    }
    Ok(())
}

/// Buckets must be disjoint, ascending and inside the buffer.
pub(crate) fn check_buckets(len: usize, buckets: &[Range<usize>]) -> Result<()> {
    let mut end = 0;
    for (i, b) in buckets.iter().enumerate() {
        if b.start < end || b.start > b.end || b.end > len {
            return Err(Error::invalid(format!("bucket {i} ({b:?}) overlaps the previous one or leaves the buffer of {len} elements")));
        }
        end = b.end;
    }
    Ok(())
}
