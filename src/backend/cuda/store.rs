//! The accumulator's store on a CUDA device: the same results as the CPU's (bitwise: the
//! per-element math is shared, see kernels/math.cuh), with the FP32 master in device memory and
//! every step enqueued on the caller's stream. The boundary reduces the control words and the
//! master buckets with NCCL and normalises, measures and clips on the device; only calls that
//! return values to the host wait for the stream, and they say so.
//!
//! A micro-batch opened with `begin_final_microbatch` ends the window: as its tensors arrive, each
//! bucket whose tensors have all arrived is all-reduced at once on a communication stream, so
//! the reduction overlaps the rest of the backward pass.
//!
//! Under `Overflow::DropMicrobatch` the host decides each drop, as on the CPU: a check kernel
//! flags each tensor of a micro-batch that would go non-finite, and the flags are read back (a
//! wait per micro-batch); a hook micro-batch is staged on the device and merged when it ends
//! clean. The boundary sums the dropped count with the other control words and agrees on the
//! first place with a MAX of its complement.
//!
//! Under reduce-scatter sharding the boundary leaves each rank only its shard reduced: one
//! in-place ncclReduceScatter over the master, padded to the shards' equal split (a caller's
//! master of the layout's length is summed shard by shard into each owner with ncclReduce, and a
//! final micro-batch's buckets piece by piece the same way). The norm's block sums are computed
//! on each shard and all-gathered, so every rank folds the same sums in the same order.

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, MutexGuard};

use super::driver::{
    check_stream, launch_args, synchronize, wait_until_done, CUdeviceptr, CUstream, Context,
    DeviceBuffer, Event, OwnedStream, SharedReads, THREADS,
};
use super::kernels::Kernels;
use super::layout::{
    GaBoundary, GaChunk, GaSource, GaSources, GaTensor, CONTROL_WORDS, FIRST_BAD_WORD,
    SOURCES_PER_LAUNCH,
};
use super::sharded::{self, ShardMemory};
use super::wire::Wire;
use crate::accumulator::protocol::{self, Channel, Step, CLAIM_WORDS};
use crate::accumulator::sharding::{intersect, relative, BucketSchedule, Shard};
use crate::accumulator::{
    Agreed, DeviceScale, Gradient, Grads, MasterWrite, Overflow, Plan, Proposal, Reduced,
    ScaleSource, Sharding, Store, SyncInfo, TensorStats, TensorWrite,
};
use crate::backend::cuda::nccl::NcclComm;
use crate::comm::{Communicator, Control, ControlSum, OverflowKey};
use crate::device::Device;
use crate::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};
use crate::math::NORM_BLOCK;

pub(super) mod overflow;

use overflow::Stats;

/// Elements per thread block of an add launch (a piece of one tensor): small enough that a tensor
/// of a million elements still spreads over every SM.
pub(crate) const CHUNK: usize = 8192;
/// NORM_BLOCKs per thread block of the sum-of-squares kernel (a half-warp each).
pub(super) const NORM_BLOCKS_PER_CTA: u64 = THREADS as u64 / 16;

/// The final micro-batch's early bucket reductions.
struct Overlap {
    comm: Arc<dyn Communicator>,
    /// The buckets reduced early, as their tensors arrive (a tensor's later contributions to a
    /// bucket not yet reduced are added, but count once).
    schedule: BucketSchedule,
}

/// Reduce-scatter at the boundary: every rank's shard and how this rank's master is reduced.
struct Split {
    rank: usize,
    /// Every rank's shard in rank order ([`Plan::shards`]): shard q starts at `q * size`.
    shards: Vec<Range<usize>>,
    /// Elements of the equal split, a whole number of NORM_BLOCKs.
    size: usize,
    /// The master holds `shards.len() * size` elements (an owned master is padded with zeros no
    /// add touches), NCCL's layout for an in-place reduce-scatter. A caller's master of the
    /// layout's length is not, and its shards are reduced one by one into their owners.
    padded: bool,
}

impl Split {
    /// The split of `plan`'s sharding, None without it. The in-place collectives (reduce-scatter
    /// of the master, all-gather of the block sums) need shards of equal size on whole blocks.
    fn of(plan: &Plan) -> Result<Option<Split>> {
        let Sharding::ReduceScatter { rank, .. } = plan.config.sharding else { return Ok(None) };
        let (shards, len) = (plan.shards(), plan.layout.len());
        let size = shards[0].len().next_multiple_of(NORM_BLOCK);
        if !shards
            .iter()
            .enumerate()
            .all(|(q, r)| *r == ((q * size).min(len)..((q + 1) * size).min(len)))
        {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("the shards {shards:?} are not an equal split in whole blocks"),
            ));
        }
        Ok(Some(Split { rank, shards, size, padded: false }))
    }

    fn own(&self) -> Range<usize> {
        self.shards[self.rank].clone()
    }

    /// Elements of the padded master: every shard at its full size.
    fn padded_len(&self) -> usize {
        self.shards.len() * self.size
    }
}

/// One `ga_add_multi` launch of an `add`: tensors `first..first + count` and their chunks, which
/// are consecutive in the chunk table (it lists tensor after tensor).
struct AddLaunch {
    first: usize,
    count: usize,
    first_chunk: usize,
    num_chunks: u64,
}

/// The accumulator's store in CUDA device memory: the FP32 master (the whole of it, or under
/// sharded accumulation this rank's shard, see `sharded.rs`) and the kernels' tables, with every
/// step enqueued on the accumulator's stream.
pub(crate) struct DeviceStore {
    pub(super) ctx: Arc<Context>,
    pub(super) kernels: Arc<Kernels>,
    pub(super) stream: CUstream,
    pub(super) plan: Arc<Plan>,
    memory: Memory,
    /// The window's overflow flag (a u32 written by the add kernels; under sharded accumulation
    /// also by the shard adds, for a sum that overflows).
    pub(super) found_inf: DeviceBuffer,
    pub(super) boundary: DeviceBuffer,
    pub(super) partials: DeviceBuffer,
    pub(super) claims: Claims,
    /// Communicators this accumulator's layout was verified against.
    pub(super) verified: Mutex<Vec<u64>>,
    /// Pairs of shard and replica groups a hybrid boundary's layout was verified against.
    pub(super) verified_grids: Mutex<Vec<(u64, u64)>>,
    /// Where buckets are reduced while the accumulator's stream goes on (a final micro-batch's,
    /// or a sharded accumulation's hook micro-batch), and the event that orders the two.
    comm_stream: OnceLock<OwnedStream>,
    event: Mutex<Event>,
    /// The boundary is read by scalers' gathers on their streams: the next boundary (and the
    /// free) waits for those reads.
    boundary_reads: Mutex<SharedReads>,
    /// The BF16 wire's staging, with `wire_dtype` BF16.
    wire: Option<Wire>,
    /// Under `Overflow::DropMicrobatch`: one u32 per tensor, raised where a micro-batch's
    /// gradient (or a hook micro-batch's staging) went non-finite, and the FP32 staging of a
    /// micro-batch fed tensor by tensor, laid out as the master; allocated at first use.
    flags: OnceLock<DeviceBuffer>,
    stage: OnceLock<DeviceBuffer>,
    /// With `tensor_stats`.
    stats: Option<Stats>,
}

/// What a device store holds of the master.
enum Memory {
    /// All of it: every policy but sharded accumulation.
    Whole(Box<Whole>),
    /// This rank's shard, and the staging every micro-batch is reduced through.
    Shard(Box<ShardMemory>),
}

/// The whole master, the tables of its add launches, and how the boundary reduces it.
struct Whole {
    master: DeviceBuffer,
    tables: Tables,
    split: Option<Split>,
    /// The final micro-batch's early reductions, from `begin_final` to the boundary.
    overlap: Mutex<Option<Overlap>>,
}

impl Whole {
    fn overlap(&self) -> MutexGuard<'_, Option<Overlap>> {
        self.overlap.lock()
    }

    fn at(&self, offset: usize) -> CUdeviceptr {
        self.master.ptr() + 4 * offset as u64
    }
}

/// The multi-tensor kernels' tables over every tensor of the layout: each tensor's place in the
/// master, length and dtype, its chunks, and the launches of up to SOURCES_PER_LAUNCH tensors.
/// The whole master's adds and every store's checks run on them.
pub(super) struct Tables {
    tensors: DeviceBuffer,
    chunks: DeviceBuffer,
    /// The launches: up to SOURCES_PER_LAUNCH consecutive tensors each, with their chunks.
    launches: Vec<AddLaunch>,
    /// Each tensor's first chunk in the table (and the table's length, last).
    chunk_starts: Vec<usize>,
}

impl Tables {
    /// Uploads the tables of `plan`'s layout on `stream`.
    pub(super) fn new(plan: &Plan, ctx: &Arc<Context>, stream: CUstream) -> Result<Self> {
        let (layout, tensors) = (&plan.layout, &plan.descs);
        let table: Vec<GaTensor> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| GaTensor {
                offset: layout.range(i).start as u64,
                numel: t.numel as u64,
                dtype: t.dtype.code(),
                pad: 0,
            })
            .collect();
        let chunks: Vec<GaChunk> = tensors
            .iter()
            .enumerate()
            .flat_map(|(i, t)| {
                (0..t.numel).step_by(CHUNK).map(move |start| GaChunk {
                    tensor: i as u64,
                    start: start as u64,
                    len: (t.numel - start).min(CHUNK) as u64,
                })
            })
            .collect();
        let chunk_starts = (0..=tensors.len())
            .map(|i| chunks.partition_point(|c| (c.tensor as usize) < i))
            .collect();
        let launches = (0..tensors.len())
            .step_by(SOURCES_PER_LAUNCH)
            .map(|first| {
                let count = SOURCES_PER_LAUNCH.min(tensors.len() - first);
                let first_chunk = chunks.partition_point(|c| (c.tensor as usize) < first);
                let num_chunks = chunks[first_chunk..]
                    .partition_point(|c| (c.tensor as usize) < first + count)
                    as u64;
                AddLaunch { first, count, first_chunk, num_chunks }
            })
            .collect();
        Ok(Tables {
            tensors: DeviceBuffer::from_slice(ctx, stream, &table)?,
            chunks: DeviceBuffer::from_slice(ctx, stream, &chunks)?,
            launches,
            chunk_starts,
        })
    }

    /// A multi-tensor launch over tensor `index` alone.
    fn one(&self, index: usize) -> AddLaunch {
        let (start, end) = (self.chunk_starts[index], self.chunk_starts[index + 1]);
        AddLaunch { first: index, count: 1, first_chunk: start, num_chunks: (end - start) as u64 }
    }

    /// What a multi-tensor launch over `launch`'s tensors takes: their sources, and the address
    /// and number of their chunks.
    fn tables(
        &self,
        launch: &AddLaunch,
        grad: &dyn Fn(usize) -> CUdeviceptr,
        first: &dyn Fn(usize) -> bool,
    ) -> (GaSources, CUdeviceptr, u64) {
        let mut sources = GaSources {
            first_tensor: launch.first as u64,
            count: launch.count as u64,
            s: [GaSource::default(); SOURCES_PER_LAUNCH],
        };
        for (slot, i) in sources.s.iter_mut().zip(launch.first..launch.first + launch.count) {
            *slot = GaSource { grad: grad(i), assign: first(i) as u32, pad: 0 };
        }
        let chunk_bytes = launch.first_chunk * std::mem::size_of::<GaChunk>();
        let chunks = self.chunks.ptr() + chunk_bytes as u64;
        (sources, chunks, launch.num_chunks)
    }
}

// SAFETY: device addresses and the stream handle are used only through thread-safe driver calls;
// host state is behind locks.
unsafe impl Send for DeviceStore {}
// SAFETY: as Send.
unsafe impl Sync for DeviceStore {}

/// The NCCL communicator behind `comm`, or DEVICE_MISMATCH.
pub(super) fn nccl(comm: &dyn Communicator) -> Result<&NcclComm> {
    NcclComm::of(comm).ok_or_else(|| {
        Error::new(
            ErrorKind::DeviceMismatch,
            "a host communicator for a CUDA accumulator: use an NCCL communicator",
        )
    })
}

/// The totals of a boundary whose group is this rank alone: the host knows them (and tells an
/// empty window before anything is enqueued); `None` when they are summed on the device. A
/// hybrid boundary's group is the grid.
pub(super) fn alone(
    p: &Proposal<'_>,
    comm: Option<&NcclComm>,
    replicas: Option<&NcclComm>,
) -> Option<ControlSum> {
    let world = comm.map_or(1, |c| c.world_size()) * replicas.map_or(1, |r| r.world_size());
    // A window whose every micro-batch was dropped is not empty: the device's boundary reports it
    // (and the scaler gathers it from there).
    let all_dropped = p.microbatches == 0 && p.dropped != 0;
    (world == 1 && !all_dropped).then(|| ControlSum {
        count: p.count,
        microbatches: p.microbatches,
        ranks: p.ranks,
        ..Default::default()
    })
}

/// Reads the boundary's result (waits for the stream); None for an empty window.
pub(super) fn read_info(boundary: &DeviceBuffer) -> Result<Option<SyncInfo>> {
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
/// reported as [`Proposal::unlocated_if_flagged`] says, as on the CPU.
pub(super) fn pack_control(store: &DeviceStore, p: &Proposal<'_>) -> Result<()> {
    let boundary = store.boundary.ptr();
    let (count, microbatches, found_inf, ranks, dropped) =
        (p.count, p.microbatches, store.found_inf.ptr(), p.ranks, p.dropped);
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
pub(super) fn reduce_control(store: &DeviceStore, c: &NcclComm, stream: CUstream) -> Result<()> {
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
pub(super) fn wait_for_collectives(ctx: &Context, stream: CUstream, comm: &NcclComm) -> Result<()> {
    wait_for_groups(ctx, stream, &[comm])
}

/// [`wait_for_collectives`] for a stream with collectives on several communicators (a hybrid
/// boundary's shard and replica groups): up to the shortest timeout, failing early on any
/// group's failure. A timeout aborts every group: the stream may wait in any of them.
pub(super) fn wait_for_groups(ctx: &Context, stream: CUstream, groups: &[&NcclComm]) -> Result<()> {
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
pub(super) struct DeviceChannel<'a> {
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
pub(super) struct Schedule {
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
pub(super) struct Claims {
    ctx: Arc<Context>,
    stream: CUstream,
    words: DeviceBuffer,
    schedule: Option<Schedule>,
}

impl Claims {
    pub(super) fn new(ctx: &Arc<Context>, stream: CUstream) -> Result<Self> {
        let words = DeviceBuffer::zeroed(ctx, stream, CLAIM_WORDS * 8)?;
        Ok(Claims { ctx: ctx.clone(), stream, words, schedule: None })
    }

    /// An optimizer's claims: every one also carries `schedule`'s learning rate and step count,
    /// mixed in on the device, so that ranks whose values differ fail together (a schedule on
    /// the device included).
    pub(super) fn scheduled(
        ctx: &Arc<Context>,
        stream: CUstream,
        schedule: Schedule,
    ) -> Result<Self> {
        Ok(Claims { schedule: Some(schedule), ..Claims::new(ctx, stream)? })
    }

    /// The reduced claims at `step` over `group` (none: this rank alone) and, at a hybrid
    /// boundary, over the replicas of `shard` ([`protocol::exchange`]); this rank's claims it
    /// dropped the micro-batch with `dropped`.
    pub(super) fn exchange(
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
    pub(super) fn agree(
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
pub(super) fn reduce_to_owners(
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

/// What the boundary's norm pass runs over: `n` elements at `data`, starting at block
/// `first_block` of the layout (their block sums go there in the partials); with `gather`, every
/// rank's that many block sums are then all-gathered over the communicator.
pub(super) struct NormSpan<'a> {
    pub data: CUdeviceptr,
    pub n: u64,
    pub first_block: usize,
    pub gather: Option<(&'a NcclComm, usize)>,
    /// Enqueued once the span is normalised (without clipping) and before it is clipped: what
    /// measures the values the norm's pass leaves (`tensor_stats`).
    pub measure: Option<&'a dyn Fn() -> Result<()>>,
}

/// Normalise, norm and clip on the device, from the reduced control words in `boundary`: the
/// span's blocks are scaled (without clipping) and measured into `partials`, gathered from every
/// rank when the span is a shard, folded into the norm, and scaled by the clipping factor.
///
/// # Safety
/// `boundary` holds a ga_boundary; `partials` holds a block sum for every block of the layout
/// (and of every rank's padded shard); the span's `n` elements at `data` are device memory of
/// the stream's context.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn norm_and_clip(
    ctx: &Context,
    kernels: &Kernels,
    stream: CUstream,
    plan: &Plan,
    boundary: CUdeviceptr,
    partials: CUdeviceptr,
    span: NormSpan<'_>,
) -> Result<()> {
    let NormSpan { data, n, first_block, gather, measure } = span;
    let num_blocks = plan.layout.len().div_ceil(NORM_BLOCK) as u64;
    // The span starts on a block boundary, so its blocks (and their sums) are the layout's, in
    // the same places.
    let own_partials = partials + 8 * first_block as u64;
    let max_norm = plan.config.max_grad_norm as f64;
    let normalize_code = plan.config.normalize.code();
    // Without clipping the normalisation is applied with the norm pass; with clipping the norm
    // decides the factor, so a second pass applies it.
    let normalize_now: i32 = (max_norm == 0.0) as i32;
    // SAFETY: each launch's arguments follow its kernel's signature in kernels.cu, over the
    // buffers of the caller's contract. An empty span launches nothing on it.
    unsafe {
        let mut args = launch_args!(boundary, normalize_code);
        kernels.begin_boundary.launch(ctx, 1, 1, stream, &mut args)?;
        if n > 0 {
            let mut args = launch_args!(data, n, boundary, normalize_now, own_partials);
            let grid = ctx.grid_for(n.div_ceil(NORM_BLOCK as u64).div_ceil(NORM_BLOCKS_PER_CTA));
            kernels.scale_sum_squares.launch(ctx, grid, THREADS, stream, &mut args)?;
        }
    }
    measure.map_or(Ok(()), |m| m())?;
    if let Some((c, blocks)) = gather {
        c.allgather_f64(partials, blocks, stream)?;
    }
    // SAFETY: as above.
    unsafe {
        let mut args = launch_args!(boundary, partials, num_blocks, max_norm);
        kernels.finish_norm.launch(ctx, 1, THREADS, stream, &mut args)?;
        if max_norm != 0.0 && n > 0 {
            let mut args = launch_args!(data, n, boundary);
            kernels.scale_by.launch_over(ctx, stream, n.div_ceil(THREADS as u64), &mut args)?;
        }
    }
    Ok(())
}

impl Whole {
    /// Allocates the master (zeroed) on `stream`, or adopts the caller's device buffer of the
    /// layout's length, and uploads the kernels' tables. Returns the boundary's block sums'
    /// length with it.
    fn new(
        plan: &Plan,
        ctx: &Arc<Context>,
        stream: CUstream,
        adopt: Option<CUdeviceptr>,
    ) -> Result<(Self, usize)> {
        let (layout, tensors) = (&plan.layout, &plan.descs);
        let len = layout.len();
        let mut split = Split::of(plan)?;
        // Sharded, the master's padding (zero, never added to) makes the reduce-scatter in place;
        // the block sums are all-gathered in place, every shard's at its full size.
        let (padded_len, num_partials) = match &split {
            Some(s) => (s.padded_len(), s.padded_len() / NORM_BLOCK),
            None => (len, len.div_ceil(NORM_BLOCK)),
        };
        let master = match adopt {
            Some(ptr) => DeviceBuffer::adopt(ctx, stream, ptr, len * 4),
            None => DeviceBuffer::zeroed(ctx, stream, padded_len * 4)?,
        };
        if adopt.is_some() {
            // The padding between tensors is summed and measured with them: zeros, which no
            // kernel writes otherwise.
            for i in 0..tensors.len() {
                let p = layout.padding(i);
                master.zero_f32(p.start, p.len())?;
            }
        }
        if let Some(s) = &mut split {
            s.padded = adopt.is_none() || len == padded_len;
        }
        let whole = Whole {
            tables: Tables::new(plan, ctx, stream)?,
            split,
            master,
            overlap: Mutex::new(None),
        };
        Ok((whole, num_partials))
    }
}

impl DeviceStore {
    /// The store of an accumulator over `plan` on device `ordinal`, every step on `stream`:
    /// under sharded accumulation this rank's shard reduced over `comm` (an NCCL communicator on
    /// the device; none only for one shard), else the whole master, owned or adopted.
    pub(crate) fn new(
        plan: Arc<Plan>,
        ordinal: i32,
        stream: CUstream,
        adopt: Option<CUdeviceptr>,
        comm: Option<Arc<dyn Communicator>>,
    ) -> Result<Self> {
        check_stream(stream, "`stream`")?;
        let sharded = matches!(plan.config.sharding, Sharding::Accumulate { .. });
        if sharded {
            sharded::check_comm(comm.as_deref(), ordinal)?;
        }
        let ctx = Context::get(ordinal)?;
        let kernels = Kernels::of(&ctx)?;
        let (memory, num_partials) = if sharded {
            let shard = ShardMemory::new(&plan, &ctx, stream, comm)?;
            let num_partials = shard.partials_len();
            (Memory::Shard(Box::new(shard)), num_partials)
        } else {
            let (whole, num_partials) = Whole::new(&plan, &ctx, stream, adopt)?;
            (Memory::Whole(Box::new(whole)), num_partials)
        };
        Ok(DeviceStore {
            memory,
            found_inf: DeviceBuffer::zeroed(&ctx, stream, 4)?,
            boundary: DeviceBuffer::zeroed(&ctx, stream, std::mem::size_of::<GaBoundary>())?,
            partials: DeviceBuffer::zeroed(&ctx, stream, num_partials * 8)?,
            claims: Claims::new(&ctx, stream)?,
            event: Mutex::new(Event::new(&ctx)?),
            boundary_reads: Mutex::new(SharedReads::new(&ctx, stream)?),
            verified: Mutex::new(Vec::new()),
            verified_grids: Mutex::new(Vec::new()),
            comm_stream: OnceLock::new(),
            flags: OnceLock::new(),
            stage: OnceLock::new(),
            stats: plan.config.tensor_stats.then(|| Stats::new(&plan, &ctx, stream)).transpose()?,
            wire: (plan.config.wire == Dtype::Bf16)
                .then(|| Wire::new(ctx.clone(), kernels.clone(), stream))
                .transpose()?,
            ctx,
            kernels,
            stream,
            plan,
        })
    }

    pub(super) fn boundary_reads(&self) -> MutexGuard<'_, SharedReads> {
        self.boundary_reads.lock()
    }

    pub(super) fn event(&self) -> MutexGuard<'_, Event> {
        self.event.lock()
    }

    pub(super) fn comm_stream(&self) -> Result<&OwnedStream> {
        if let Some(s) = self.comm_stream.get() {
            return Ok(s);
        }
        let created = OwnedStream::new(&self.ctx)?;
        Ok(self.comm_stream.get_or_init(|| created))
    }

    /// Orders the accumulator's stream after the communication stream's bucket reductions: the
    /// memory they read and write is the accumulator's stream's again.
    pub(super) fn join_comm_stream(&self) -> Result<()> {
        match self.comm_stream.get() {
            Some(s) => self.event().order(s.stream, self.stream),
            None => Ok(()),
        }
    }

    /// The BF16 wire's staging for a reduction over `c`: only between ranks.
    pub(super) fn bf16(&self, c: &NcclComm) -> Option<&Wire> {
        self.wire.as_ref().filter(|_| c.world_size() > 1)
    }

    /// Host reads of a sharded accumulation's memory wait for its reductions (see `sharded.rs`).
    fn drain(&self) -> Result<()> {
        match &self.memory {
            Memory::Whole(_) => Ok(()),
            Memory::Shard(s) => s.with(self).drain(),
        }
    }

    /// Counts a final-micro-batch tensor in and launches every bucket that is ready, in order.
    fn tensor_arrived(&self, w: &Whole, o: &mut Overlap, index: usize) -> Result<()> {
        let layout = &self.plan.layout;
        if !o.schedule.land(index, layout.bucket_of(index)) {
            return Ok(());
        }
        let comm_stream = self.comm_stream()?.stream;
        while let Some(b) = o.schedule.next(false) {
            let bucket = &layout.buckets()[b];
            self.event().order(self.stream, comm_stream)?;
            self.reduce_bucket(w, nccl(&*o.comm)?, bucket, comm_stream)?;
            // Counted as reduced early only once issued: the boundary reduces every other bucket.
            o.schedule.advance();
        }
        Ok(())
    }

    /// The boundary's device work: the control words and the buckets not reduced early, then
    /// normalise, norm and clip.
    fn enqueue_boundary(&self, w: &Whole, p: &Proposal<'_>) -> Result<()> {
        let overlap = w.overlap().take();
        if overlap.is_some() {
            self.join_comm_stream()?;
        }
        pack_control(self, p)?;
        // Also at world size 1: NCCL then copies in place, and the path is the one every rank
        // takes.
        let comm = p.comm.map(nccl).transpose()?;
        if let Some(c) = comm.filter(|c| self.bf16(c).is_some()) {
            // The wire's kernels run between its collectives: no NCCL group around them. Bucket
            // by bucket (sharded, each bucket's pieces to their owners), which bounds its staging.
            reduce_control(self, c, self.stream)?;
            let buckets = self.plan.layout.buckets();
            let left = overlap.as_ref().map_or(buckets.len(), |o| o.schedule.waiting());
            buckets[..left].iter().try_for_each(|b| self.reduce_bucket(w, c, b, self.stream))?;
        } else if let Some(c) = comm {
            let buckets = self.plan.layout.buckets();
            c.group(|| {
                reduce_control(self, c, self.stream)?;
                match (&w.split, &overlap) {
                    (Some(s), None) => self.reduce_shards(w, c, s),
                    // The buckets the final micro-batch did not reduce early.
                    (_, o) => buckets[..o.as_ref().map_or(buckets.len(), |o| o.schedule.waiting())]
                        .iter()
                        .try_for_each(|b| self.reduce_bucket(w, c, b, self.stream)),
                }
            })?;
        }
        // A hybrid boundary: the counts, and the shard the shard group just reduced, are summed
        // over the replicas (FP32 sums, as on the CPU) before the norm.
        if let Some(r) = p.replicas.map(nccl).transpose()? {
            let own = w.split.as_ref().map_or(0..self.plan.layout.len(), Split::own);
            // The wire is the first reduction's between ranks: the replicas', after a shard group
            // of one (whose shard is the whole master, bucket by bucket).
            if let Some(wire) = self.bf16(r).filter(|_| comm.is_none_or(|c| c.world_size() == 1)) {
                reduce_control(self, r, self.stream)?;
                for b in self.plan.layout.buckets() {
                    let piece = intersect(b, &own);
                    if !piece.is_empty() {
                        wire.allreduce(r, w.at(piece.start), piece.len(), self.stream)?;
                    }
                }
                return self.finish_boundary(w, comm);
            }
            // Every replica holds the same shard: an empty one is skipped by all of them (its
            // address may be one past a caller's master).
            r.group(|| {
                reduce_control(self, r, self.stream)?;
                if own.is_empty() {
                    return Ok(());
                }
                r.allreduce_sum_f32(w.at(own.start), own.len(), self.stream)
            })?;
        }
        self.finish_boundary(w, comm)
    }

    /// Enqueues bucket `b`'s reduction on `stream`: an in-place all-reduce; sharded, each of its
    /// pieces (a bucket may span shards) summed into the rank whose shard holds it. On the BF16
    /// wire the same, through [`Wire`] (never inside an NCCL group: its kernels run between).
    fn reduce_bucket(
        &self,
        w: &Whole,
        c: &NcclComm,
        b: &Range<usize>,
        stream: CUstream,
    ) -> Result<()> {
        if let Some(wire) = self.bf16(c) {
            let data = w.at(b.start);
            let Some(s) = &w.split else { return wire.allreduce(c, data, b.len(), stream) };
            let pieces: Vec<Range<usize>> =
                s.shards.iter().map(|r| relative(&intersect(r, b), b.start)).collect();
            return wire.reduce_to_owners(
                c,
                data,
                &pieces,
                data + 4 * pieces[s.rank].start as u64,
                stream,
            );
        }
        let Some(s) = &w.split else {
            return c.allreduce_sum_f32(w.at(b.start), b.len(), stream);
        };
        reduce_to_owners(c, b, &s.shards, |at| w.at(at), stream)
    }

    /// Enqueues the reduce-scatter of the whole master on the accumulator's stream: in place over
    /// the padded master, or shard by shard into each owner.
    fn reduce_shards(&self, w: &Whole, c: &NcclComm, s: &Split) -> Result<()> {
        if s.padded {
            return c.reduce_scatter_sum_f32(w.master.ptr(), s.size, self.stream);
        }
        for (owner, shard) in s.shards.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            c.reduce_sum_f32(w.at(shard.start), shard.len(), owner, self.stream)?;
        }
        Ok(())
    }

    /// Normalise, norm and clip, on the device, from the reduced control words: over the whole
    /// master, or sharded over this rank's shard, with the block sums of every shard gathered
    /// from the ranks before the norm.
    fn finish_boundary(&self, w: &Whole, comm: Option<&NcclComm>) -> Result<()> {
        let own = w.split.as_ref().map_or(0..self.plan.layout.len(), Split::own);
        let gather = w.split.as_ref().zip(comm).map(|(s, c)| (c, s.size / NORM_BLOCK));
        let slot = w.split.as_ref().map_or(0, |s| s.rank);
        let measure =
            || self.measure_segments(w.at(own.start), own.clone(), slot, gather.map(|g| g.0));
        let span = NormSpan {
            data: w.at(own.start),
            n: own.len() as u64,
            first_block: own.start / NORM_BLOCK,
            gather,
            measure: self.stats.as_ref().map(|_| &measure as &dyn Fn() -> Result<()>),
        };
        // SAFETY: the master holds the range `own`, and `boundary` and `partials` were sized for
        // this layout (and its shards, padded) at creation.
        unsafe {
            norm_and_clip(
                &self.ctx,
                &self.kernels,
                self.stream,
                &self.plan,
                self.boundary.ptr(),
                self.partials.ptr(),
                span,
            )
        }
    }

    /// Once per pair of groups: the layout check of a hybrid boundary over the shard group and
    /// the replicas ([`protocol::agree`]); a shard that does not fit the shard group fails it.
    fn verify_grid(
        &self,
        w: &Whole,
        comm: &NcclComm,
        replicas: &NcclComm,
        error: Option<&Error>,
    ) -> Result<()> {
        let misfit = self.shard_misfit(comm);
        let shard = w.split.as_ref().map_or(0, |s| s.rank);
        let checked =
            self.check_grid_once(Some(comm), replicas, shard, error.or(misfit.as_ref()))?;
        match error {
            Some(e) if !checked => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// Once per communicator: every rank checks that all ranks have the same layout (a blocking
    /// exchange of the element count and the layout hash, with their complements, by MAX), so a
    /// mismatch fails on every rank instead of corrupting memory inside NCCL. A sharded rank
    /// whose shard is not its rank's on `comm` fails it too, and the others with it.
    fn verify_layout(&self, comm: &NcclComm) -> Result<()> {
        let misfit = self.shard_misfit(comm);
        self.check_layout_once(comm, Step::Boundary, misfit.as_ref()).map(drop)
    }

    /// The layout check at `step` over `comm` (a blocking exchange, [`Claims::agree`]), this
    /// rank's claim flagged with `own`, once per communicator; `Ok(false)` when `comm` was
    /// checked before, and nothing ran.
    pub(super) fn check_layout_once(
        &self,
        comm: &NcclComm,
        step: Step,
        own: Option<&Error>,
    ) -> Result<bool> {
        let mut verified = self.verified.lock();
        if verified.contains(&comm.id()) {
            return Ok(false);
        }
        self.claims.agree(step, &self.plan, Some(comm), None, own)?;
        verified.push(comm.id());
        Ok(true)
    }

    /// [`check_layout_once`](Self::check_layout_once) of a hybrid boundary, once per pair of
    /// shard group (none: a group of one) and replicas, the claim tagged with the `shard` this
    /// rank holds.
    pub(super) fn check_grid_once(
        &self,
        comm: Option<&NcclComm>,
        replicas: &NcclComm,
        shard: usize,
        own: Option<&Error>,
    ) -> Result<bool> {
        let mut verified = self.verified_grids.lock();
        let pair = (comm.map_or(0, NcclComm::id), replicas.id());
        if verified.contains(&pair) {
            return Ok(false);
        }
        self.claims.agree(Step::Boundary, &self.plan, comm, Some((replicas, shard)), own)?;
        verified.push(pair);
        Ok(true)
    }

    /// Why this rank's shard cannot be reduced over `comm` (another size, or another rank), if so.
    fn shard_misfit(&self, comm: &NcclComm) -> Option<Error> {
        let Sharding::ReduceScatter { shards, rank } = self.plan.config.sharding else {
            return None;
        };
        let (world, at) = (comm.world_size(), comm.rank());
        ((world, at) != (shards, rank))
            .then(|| Error::invalid(format!("the accumulator holds shard {rank} of {shards}, but the communicator is rank {at} of {world}")))
    }
}

/// The whole master's passes (under sharded accumulation the shard's are `sharded.rs`'s).
impl DeviceStore {
    /// One `ga_add_multi` launch per SOURCES_PER_LAUNCH tensors (one for most models). The
    /// gradient addresses travel as a kernel parameter, copied by the launch: no per-call copy
    /// from host memory, so a step's adds can be captured into a CUDA graph.
    fn add_whole(
        &self,
        w: &Whole,
        scaler: &dyn DeviceScale,
        grads: &[CUdeviceptr],
        weight: f64,
        first: &dyn Fn(usize) -> bool,
    ) -> Result<()> {
        let f = self.kernels.add_multi;
        let t = &w.tables;
        let (tensors, master, found_inf) = (t.tensors.ptr(), w.master.ptr(), self.found_inf.ptr());
        for launch in &t.launches {
            let (sources, chunks, num_chunks) = t.tables(launch, &|i| grads[i], first);
            scaler.launch_reading(self.stream.cast(), |state| {
                let mut args = launch_args!(
                    tensors, chunks, num_chunks, sources, master, state, weight, found_inf
                );
                // SAFETY: argument types follow ga_add_multi (`sources` by value); the chunk range
                // is this launch's tensors', tables and master were sized at creation, and the
                // gradient addresses hold their tensors' numel values (the caller's contract).
                unsafe { f.launch_over(&self.ctx, self.stream, num_chunks, &mut args) }
            })?;
        }
        Ok(())
    }

    fn add_tensor_whole(
        &self,
        w: &Whole,
        scaler: &dyn DeviceScale,
        index: usize,
        grad: CUdeviceptr,
        weight: f64,
        first: bool,
    ) -> Result<()> {
        let mut overlap = w.overlap();
        if let Some(o) = overlap.as_ref() {
            if self.plan.layout.bucket_of(index) >= o.schedule.waiting() {
                return Err(Error::wrong_state(format!(
                    "tensor {index} got a second contribution in the final micro-batch after its bucket's all-reduce started"
                )));
            }
        }
        let into = w.at(self.plan.layout.range(index).start);
        self.add_one(scaler, into, index, grad, weight, first, self.found_inf.ptr())?;
        if let Some(o) = overlap.as_mut() {
            self.tensor_arrived(w, o, index)?;
        }
        Ok(())
    }

    /// `ga_add_one` of tensor `index`'s contribution `grad` into `into` (its place in the master,
    /// or in the staging), raising the u32 flag at `flag` for a non-finite value written.
    #[allow(clippy::too_many_arguments)]
    fn add_one(
        &self,
        scaler: &dyn DeviceScale,
        into: CUdeviceptr,
        index: usize,
        grad: CUdeviceptr,
        weight: f64,
        first: bool,
        flag: CUdeviceptr,
    ) -> Result<()> {
        let desc = self.plan.descs[index];
        let f = self.kernels.add_one;
        let (numel, dtype, assign) = (desc.numel as u64, desc.dtype.code(), first as u32);
        scaler.launch_reading(self.stream.cast(), |state| {
            let mut args = launch_args!(into, grad, numel, dtype, state, weight, assign, flag);
            // SAFETY: argument types follow ga_add_one; `into` is tensor `index`'s place in a
            // buffer laid out as the master, `flag` a u32 of device memory.
            unsafe {
                f.launch_over(&self.ctx, self.stream, numel.div_ceil(CHUNK as u64), &mut args)
            }
        })
    }

    /// A call that fails here does not enter NCCL, so the other ranks wait, as in any NCCL
    /// program, until the communicator is aborted. The counts stay on the device, where the
    /// boundary reduces them with the buckets; alone, the host knows them already.
    fn agree_whole(&self, w: &Whole, p: &Proposal<'_>) -> Result<Agreed> {
        let replicas = p.replicas.map(nccl).transpose()?;
        if let Some(e) = &p.error {
            // A shard that does not fit the communicator fails the layout check, the one exchange
            // every rank runs before the boundary's collectives: this rank takes part, so the
            // others fail with it instead of waiting for its collectives.
            if let Some(c) =
                p.comm.and_then(|c| nccl(c).ok()).filter(|c| self.shard_misfit(c).is_some())
            {
                let _ = match replicas {
                    Some(r) => self.verify_grid(w, c, r, Some(e)),
                    None => self.verify_layout(c),
                };
            }
            return Err(e.clone());
        }
        let comm = p.comm.map(nccl).transpose()?;
        {
            let overlap = w.overlap();
            match (comm, overlap.as_ref()) {
                (Some(c), Some(o)) if c.id() != nccl(&*o.comm)?.id() => {
                    return Err(Error::invalid(
                        "sync got another communicator than the final micro-batch's",
                    ));
                }
                (None, Some(_)) => {
                    return Err(Error::invalid(
                        "`comm` is NULL, but the final micro-batch was opened with a communicator",
                    ))
                }
                _ => {}
            }
        }
        match (comm, replicas) {
            (Some(c), Some(r)) => self.verify_grid(w, c, r, None)?,
            (Some(c), None) => self.verify_layout(c)?,
            _ => {}
        }
        Ok(Agreed { totals: alone(p, comm, replicas) })
    }
}

impl Store for DeviceStore {
    fn device(&self) -> Device {
        Device::Cuda { ordinal: self.ctx.ordinal, stream: self.stream.cast() }
    }

    fn shard(&self) -> Option<&Shard> {
        match &self.memory {
            Memory::Whole(_) => None,
            Memory::Shard(s) => Some(&s.sharding),
        }
    }

    /// Refuses a new micro-batch after the final one: its buckets are already reduced.
    fn check_open(&self) -> Result<()> {
        if let Memory::Whole(w) = &self.memory {
            if w.overlap().is_some() {
                return Err(Error::wrong_state(
                    "the window's final micro-batch has ended: call sync (or reset) before adding more",
                ));
            }
        }
        Ok(())
    }

    fn open_microbatch(
        &self,
        master: &MasterWrite,
        first: bool,
        whole: bool,
        error: Option<&Error>,
    ) -> Result<()> {
        match &self.memory {
            Memory::Whole(_) => error.map_or(Ok(()), |e| Err(e.clone()))?,
            Memory::Shard(s) => s.with(self).open_microbatch(master, first, whole, error)?,
        }
        // A hook micro-batch starts with no tensor flagged.
        match self.flags.get().filter(|_| !whole) {
            Some(flags) => flags.zero_f32(0, self.plan.descs.len()),
            None => Ok(()),
        }
    }

    /// Under sharded accumulation, whether the micro-batch was dropped on every rank.
    fn close_microbatch(&self, master: &mut MasterWrite) -> Result<bool> {
        let dropped = match &self.memory {
            Memory::Whole(_) => false,
            Memory::Shard(s) => s.with(self).close_microbatch(master)?,
        };
        if self.counts_on_device() {
            self.count_flags()?;
        }
        Ok(dropped)
    }

    /// Under sharded accumulation this rank's zeros join the micro-batch's reductions.
    fn add_nothing(&self, _master: &mut MasterWrite) -> Result<bool> {
        match &self.memory {
            Memory::Whole(_) => Ok(false),
            Memory::Shard(s) => s.with(self).add(None).map(|()| true),
        }
    }

    fn refuse(&self) {
        if let Memory::Shard(s) = &self.memory {
            s.with(self).refuse();
        }
    }

    fn add(
        &self,
        _master: &mut MasterWrite,
        scale: ScaleSource<'_>,
        grads: Grads<'_>,
        weight: f64,
        first: &dyn Fn(usize) -> bool,
    ) -> Result<bool> {
        let grads = grads.device()?;
        let scaler = scale.device()?;
        // The overflow flag stays on the device: nothing to locate on the host.
        match &self.memory {
            Memory::Whole(w) => self.add_whole(w, scaler, grads, weight, first)?,
            Memory::Shard(s) => {
                s.with(self).add(Some(&sharded::Gradients { scaler, grads, weight }))?
            }
        }
        if self.counts_on_device() {
            self.flags()?.zero_f32(0, self.plan.descs.len())?;
            self.launch_checks(&self.checks()?.launches, scaler, &|i| grads[i], weight)?;
            self.count_flags()?;
        }
        Ok(false)
    }

    fn add_tensor(
        &self,
        tensor: &mut TensorWrite,
        scale: ScaleSource<'_>,
        grad: Gradient<'_>,
        weight: f64,
        first: bool,
    ) -> Result<bool> {
        let index = tensor.index();
        let grad = grad.device()?;
        let scaler = scale.device()?;
        match &self.memory {
            Memory::Whole(w) => self.add_tensor_whole(w, scaler, index, grad, weight, first)?,
            Memory::Shard(s) => s.with(self).add_tensor(scaler, index, grad, weight)?,
        }
        // Counted once per micro-batch, when it closes.
        if self.counts_on_device() {
            self.launch_checks(&[self.checks()?.one(index)], scaler, &|_| grad, weight)?;
        }
        Ok(false)
    }

    fn bad_gradients(
        &self,
        scale: ScaleSource<'_>,
        grads: Grads<'_>,
        weight: f64,
    ) -> Result<Vec<usize>> {
        let (grads, scaler) = (grads.device()?, scale.device()?);
        self.check(scaler, grads, weight)
    }

    /// The flag of the tensor's staging stays on the device until `staged_bad`.
    fn stage_tensor(
        &self,
        tensor: &mut TensorWrite,
        scale: ScaleSource<'_>,
        grad: Gradient<'_>,
        weight: f64,
        first: bool,
    ) -> Result<bool> {
        let index = tensor.index();
        self.whole()?;
        let (grad, scaler) = (grad.device()?, scale.device()?);
        let into = self.stage()?.ptr() + 4 * self.plan.layout.range(index).start as u64;
        let flag = self.flags()?.ptr() + 4 * index as u64;
        self.add_one(scaler, into, index, grad, weight, first, flag).map(|()| false)
    }

    fn staged_bad(&self) -> Result<Vec<usize>> {
        match self.flags.get() {
            Some(_) => self.flagged(),
            None => Ok(Vec::new()),
        }
    }

    /// The window's flag stays on the device: a sum that overflows is not located.
    fn merge_staged(&self, _master: &mut MasterWrite, index: usize, first: bool) -> Result<bool> {
        self.merge_whole(self.whole()?, index, first).map(|()| false)
    }

    /// The first call per communicator checks on the host that all ranks' layouts agree (it waits).
    /// Under DROP_MICROBATCH the micro-batch is staged, so nothing is reduced early.
    fn begin_final(&self, comm: &Arc<dyn Communicator>) -> Result<()> {
        let Memory::Whole(w) = &self.memory else { return Ok(()) };
        if self.plan.config.overflow == Overflow::DropMicrobatch {
            return Ok(());
        }
        self.verify_layout(nccl(&**comm)?)?;
        self.comm_stream()?;
        // A bucket is reduced early only once each of its tensors arrived in this micro-batch, so
        // no tensor of it can be stale: nothing needs zeroing first.
        let schedule = BucketSchedule::new(&self.plan.layout, self.plan.descs.len());
        *w.overlap() = Some(Overlap { comm: comm.clone(), schedule });
        Ok(())
    }

    fn end_final(&self) -> Result<()> {
        let Memory::Whole(w) = &self.memory else { return Ok(()) };
        let overlap = w.overlap().take();
        match overlap {
            Some(_) => self.join_comm_stream(),
            None => Ok(()),
        }
    }

    fn zero(&self, _master: &mut MasterWrite, index: usize) -> Result<()> {
        match &self.memory {
            Memory::Whole(w) => {
                w.master.zero_f32(self.plan.layout.range(index).start, self.plan.descs[index].numel)
            }
            Memory::Shard(s) => s.with(self).zero(index),
        }
    }

    /// A new window: under SKIP_STEP with `tensor_stats`, its counts start at zero too.
    fn clear_found_inf(&self) -> Result<()> {
        self.restart_counts()?;
        self.found_inf.zero_f32(0, 1)
    }

    fn restart_counts(&self) -> Result<()> {
        self.zero_counts()
    }

    fn agree(&self, p: &Proposal<'_>) -> Result<Agreed> {
        match &self.memory {
            Memory::Whole(w) => self.agree_whole(w, p),
            Memory::Shard(s) => s.with(self).agree(p),
        }
    }

    fn reduce(
        &self,
        _master: &mut MasterWrite,
        p: &Proposal<'_>,
        _agreed: &Agreed,
        read: bool,
    ) -> Result<Option<SyncInfo>> {
        {
            // The boundary is rewritten: after the scalers' gathers of the last one.
            let mut reads = self.boundary_reads();
            reads.before_write()?;
            let result = match &self.memory {
                Memory::Whole(w) => self.enqueue_boundary(w, p),
                Memory::Shard(s) => s.with(self).enqueue_boundary(p),
            }
            .and_then(|()| self.share_counts(p));
            // Recorded even after a failure: part of the boundary may be enqueued.
            reads.after_write()?;
            result?;
        }
        if !read {
            return Ok(None);
        }
        let groups: Vec<&NcclComm> =
            p.comm.iter().chain(&p.replicas).map(|c| nccl(*c)).collect::<Result<_>>()?;
        wait_for_groups(&self.ctx, self.stream, &groups)?;
        let info = read_info(&self.boundary)?;
        // An abort (or a peer's failure) ends the collectives the read waited for without
        // reducing: the values read are not the boundary's.
        groups.iter().try_for_each(|c| c.health())?;
        match info {
            Some(info) => {
                self.read_stats()?;
                Ok(Some(info))
            }
            None => Err(Error::new(ErrorKind::EmptyWindow, "sync on an empty window: no rank added a micro-batch, or the global item count is 0")),
        }
    }

    fn master_address(&self, offset: usize) -> *mut f32 {
        match &self.memory {
            Memory::Whole(w) => w.at(offset) as *mut f32,
            Memory::Shard(s) => s.with(self).master_address(offset),
        }
    }

    fn read(&self, _master: &MasterWrite, range: Range<usize>, out: &mut [f32]) -> Result<()> {
        self.drain()?;
        match &self.memory {
            Memory::Whole(w) => w.master.read_at(4 * range.start, &mut out[..range.len()]),
            Memory::Shard(s) => s.with(self).read(range, out),
        }
    }

    fn write(&self, _master: &mut MasterWrite, values: &[f32]) -> Result<()> {
        self.drain()?;
        match &self.memory {
            Memory::Whole(w) => w.master.write(values),
            Memory::Shard(s) => s.with(self).write(values),
        }
    }

    fn found_inf(&self) -> Result<bool> {
        self.drain()?;
        let mut flag = [0u32];
        self.found_inf.read(&mut flag)?;
        Ok(flag[0] != 0)
    }

    fn set_found_inf(&self, value: bool) -> Result<()> {
        self.drain()?;
        self.found_inf.write(&[value as u32])
    }

    fn tensor_stats(&self) -> Option<Vec<TensorStats>> {
        self.last_stats()
    }

    fn reduced(&self) -> Option<Reduced> {
        let own = self.plan.shard();
        let grad = if own.is_empty() { 0 } else { self.master_address(own.start) as u64 };
        Some(Reduced { grad, boundary: self.boundary.ptr() })
    }

    /// On the scaler's stream: after the boundary is written, and before the next boundary or the
    /// free overwrites it.
    fn gather_into(&self, scaler: &dyn DeviceScale) -> Result<()> {
        let mut reads = self.boundary_reads();
        reads.before_read(scaler.stream().cast())?;
        scaler.gather_ordered(self.boundary.ptr())?;
        reads.after_read(scaler.stream().cast())
    }
}

impl Drop for DeviceStore {
    fn drop(&mut self) {
        // Pending reductions on the communication stream read the memory (a final micro-batch's
        // early ones, or a sharded accumulation's buckets), and scalers' gathers the boundary:
        // let the stream order the frees after them.
        let _ = match &self.memory {
            Memory::Whole(_) => self.end_final(),
            Memory::Shard(_) => self.join_comm_stream(),
        };
        let _ = self.boundary_reads().before_write();
    }
}
