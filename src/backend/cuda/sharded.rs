//! Sharded accumulation (ZeRO-2) in a CUDA device store: this rank's shard of the FP32 master
//! and one stripe of FP32 staging in device memory ([`ShardMemory`], one of `DeviceStore`'s
//! memories), and the kernels and NCCL calls that reduce-scatter every micro-batch on the
//! accumulator's stream. The window's flags are the core's [`Shard`]. Nothing waits on the host but a first exchange per
//! communicator, which checks that every rank holds the same layout.
//!
//! The parts of a micro-batch are the core's ([`crate::accumulator::sharding`]): this file holds
//! only what the device does with them. A whole micro-batch (`add`) goes by stripes. For each the
//! add kernel converts, unscales, weights and checks the gradients into the staging, rank r's
//! slice at `r * count` (NCCL's in-place layout, every piece `count` long); an in-place
//! ncclReduceScatter sums the slices over the ranks; and the add kernel again, on that F32 part
//! with factor 1, assigns it to the shard (the window's first micro-batch) or adds it, which is
//! `dst = src` or `dst += src` bit for bit, and flags a non-finite sum. Each element is the CPU's
//! sum in the same order, so with a communicator that sums in rank order the shard holds the CPU
//! store's bits.
//!
//! Tensors arriving one by one (`begin_microbatch`, `add_tensor`: backward hooks) go by buckets:
//! each tensor is converted into its bucket's staging on the accumulator's stream, and each
//! bucket is reduced when the schedule says, on a communication stream that waits for the
//! conversions with an event:
//! every piece of the bucket inside a shard is summed into that shard's owner (ncclReduce, one
//! NCCL group per bucket) and the owner adds its piece into the shard, so the reductions overlap
//! the rest of the backward and nothing waits on the host. A staging buffer goes back to a pool
//! once its reduction is enqueued, and the next bucket that takes it waits (on the device) for
//! that reduction only; two are kept between micro-batches, so the conversions of one bucket run
//! beside the reduction of the one before. `end_microbatch` reduces the buckets still waiting
//! (their absent tensors as zeros), orders the accumulator's stream after the communication
//! stream, and runs the closing control step, the micro-batch's one host wait: a refused
//! `add_tensor` on any rank fails the micro-batch on every rank and discards the windows. Each
//! element is the same sum in rank order as by stripes, so `add` and `add_tensor` give the same
//! bits.

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, MutexGuard};

use super::driver::{launch_args, CUdeviceptr, CUstream, Context, DeviceBuffer, Event};
use super::layout::{GaChunk, GaScalerState, GaSource, GaSources, GaTensor, SOURCES_PER_LAUNCH};
use super::store::overflow::once;
use super::store::{
    agreed_totals, nccl, norm_and_clip, pack_control, reduce_control, reduce_to_owners,
    wait_for_collectives, DeviceStore, NormSpan, Tables, CHUNK,
};
use crate::accumulator::protocol::Step;
use crate::accumulator::sharding::{intersect, relative, Hooks, Shard, Stages, Turns};
use crate::accumulator::{Agreed, DeviceScale, MasterWrite, Overflow, Plan, Proposal};
use crate::backend::cuda::nccl::NcclComm;
use crate::comm::{Communicator, ControlSum};
use crate::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};
use crate::math::NORM_BLOCK;

/// Staging buffers kept between tensor-by-tensor micro-batches.
const KEPT_STAGES: usize = 2;
/// One `ga_add_multi` launch of a stripe: pieces `first..first + count` of the piece table and
/// their chunks, consecutive in the chunk table.
struct AddLaunch {
    first: usize,
    count: usize,
    first_chunk: usize,
    num_chunks: u64,
}

/// One stripe: its reduce-scatter's piece length, this rank's slice and the conversion launches.
struct Stripe {
    /// Elements of every rank's piece of the staging (the longest slice: the first shard's).
    count: usize,
    /// This rank's slice: its length, at shard offset `k * stripe`.
    own: usize,
    launches: Vec<AddLaunch>,
}

/// Where a piece of the staging reads its gradient: tensor `tensor` from element `from`, or
/// (`tensor` [`PADDING`]) the zeros of the padding after a tensor.
#[derive(Clone, Copy)]
struct Source {
    tensor: usize,
    from: usize,
}

/// One add of a reduced piece into the shard: `numel` f32 values at `src` added into the shard at
/// `dst` (assigned with `assign`), a non-finite sum flagged in `flag`.
struct ShardAdd {
    dst: CUdeviceptr,
    src: CUdeviceptr,
    numel: usize,
    assign: bool,
    flag: CUdeviceptr,
}

/// The `Source::tensor` of a piece of padding: it reads f32 zeros, so the reused staging holds
/// zeros there when it is reduced into the shard.
const PADDING: usize = usize::MAX;

/// One bucket's staging of a tensor-by-tensor micro-batch, in device memory on the accumulator's
/// stream.
pub(crate) struct Stage {
    buf: DeviceBuffer,
    /// Recorded on the communication stream after the last reduction that read the buffer.
    free: Event,
}

/// A device store's memory under sharded accumulation: this rank's shard of the master, the
/// staging every micro-batch is reduced through, and the tables of its conversions.
pub(super) struct ShardMemory {
    pub sharding: Shard,
    /// Every shard's length rounded up to whole norm blocks: the block sums' all-gather piece.
    padded: usize,
    stripes: Vec<Stripe>,
    /// Each piece's gradient, by the piece table's index.
    sources: Vec<Source>,
    /// The piece table (`ga_tensor`: a piece's staging offset, length and dtype) and its chunks.
    pieces: DeviceBuffer,
    chunks: DeviceBuffer,
    shard: DeviceBuffer,
    staging: DeviceBuffer,
    /// f32 zeros, as many as the longest padding: the gradient of a piece of padding.
    zeros: DeviceBuffer,
    /// A scaler state of scale 1: the shard add's factor is then exactly 1.
    unit: DeviceBuffer,
    /// Elements of the longest bucket: one staging buffer of a tensor-by-tensor micro-batch.
    bucket_len: usize,
    hooks: Mutex<Hooks<Stage>>,
    /// The overflow flag of the bucket adds on the communication stream (a separate word: two
    /// streams never write one), merged into the window's when the micro-batch ends.
    sum_inf: DeviceBuffer,
    /// The checks' tables over the whole layout: with `Overflow::DropMicrobatch` or
    /// `tensor_stats`, which check this rank's gradients before they are reduced.
    checks: Option<Tables>,
    /// Under `Overflow::DropMicrobatch`: the shard and the window's flag (after it) as a
    /// micro-batch fed tensor by tensor found them, restored when a rank's gradient of it was
    /// poisoned (its buckets are reduced as they fill); allocated at the first such micro-batch.
    before: OnceLock<DeviceBuffer>,
}

/// A whole micro-batch's gradients as `add` converts them: unscaled by `scaler`, weighted.
pub(super) struct Gradients<'a> {
    pub scaler: &'a dyn DeviceScale,
    pub grads: &'a [CUdeviceptr],
    pub weight: f64,
}

/// The shard group must be an NCCL communicator on the accumulator's device (the accumulator
/// checked its size and rank); none only for one shard.
pub(super) fn check_comm(comm: Option<&dyn Communicator>, ordinal: i32) -> Result<()> {
    if let Some(c) = comm {
        let c = nccl(c)?;
        if c.ordinal() != ordinal {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                format!("the communicator is on CUDA device {}, the accumulator on CUDA device {ordinal}", c.ordinal()),
            ));
        }
    }
    Ok(())
}

impl ShardMemory {
    /// Allocates the shard and the staging (zeroed) on `stream` and uploads the stripes' tables;
    /// `comm` passed [`check_comm`].
    pub(super) fn new(
        plan: &Plan,
        ctx: &Arc<Context>,
        stream: CUstream,
        comm: Option<Arc<dyn Communicator>>,
    ) -> Result<Self> {
        let sharding = Shard::new(plan, comm)?;
        let (world, own) = (sharding.shards.len(), sharding.own.clone());
        // The first shard is the longest; whole blocks, so the block sums tile the layout's.
        let padded = sharding.shards[0].len().next_multiple_of(NORM_BLOCK);
        let (stripes, sources, table, chunks) = Self::cut(plan, &sharding);
        let staging = stripes.first().map_or(0, |s| s.count) * world;
        let unit = GaScalerState { scale: 1.0, ..Default::default() };
        let buckets = plan.layout.buckets();
        let checks = plan.config.overflow == Overflow::DropMicrobatch || plan.config.tensor_stats;
        Ok(ShardMemory {
            checks: checks.then(|| Tables::new(plan, ctx, stream)).transpose()?,
            before: OnceLock::new(),
            bucket_len: buckets.iter().map(|b| b.len()).max().unwrap_or(0),
            hooks: Mutex::new(Hooks::new(plan)),
            sum_inf: DeviceBuffer::zeroed(ctx, stream, 4)?,
            pieces: DeviceBuffer::from_slice(ctx, stream, &table)?,
            chunks: DeviceBuffer::from_slice(ctx, stream, &chunks)?,
            shard: DeviceBuffer::zeroed(ctx, stream, own.len() * 4)?,
            // Zeroed once: past a short slice the staging is summed but never read back.
            staging: DeviceBuffer::zeroed(ctx, stream, staging * 4)?,
            // Bytes: a padding is shorter than one alignment.
            zeros: DeviceBuffer::zeroed(ctx, stream, crate::accumulator::MASTER_ALIGN)?,
            unit: DeviceBuffer::from_slice(ctx, stream, &[unit])?,
            sharding,
            padded,
            stripes,
            sources,
        })
    }

    /// Elements of the boundary's block sums: every rank's shard in whole blocks.
    pub(super) fn partials_len(&self) -> usize {
        self.sharding.shards.len() * (self.padded / NORM_BLOCK)
    }

    /// The memory with its store: what the sharded passes run on.
    pub(super) fn with<'a>(&'a self, store: &'a DeviceStore) -> Sharded<'a> {
        Sharded { store, mem: self }
    }

    /// Cuts the layout into stripes: per stripe, every rank's slice split at tensor boundaries
    /// into pieces (in rank order, each at its staging offset), the pieces into chunks, and the
    /// chunks into launches of up to SOURCES_PER_LAUNCH pieces.
    #[allow(clippy::type_complexity)]
    fn cut(
        plan: &Plan,
        sharding: &Shard,
    ) -> (Vec<Stripe>, Vec<Source>, Vec<GaTensor>, Vec<GaChunk>) {
        let (layout, descs) = (&plan.layout, &plan.descs);
        let (shards, rank, striping) = (&sharding.shards, sharding.rank, sharding.stripes);
        let (mut stripes, mut sources, mut table, mut chunks) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let slice = |s: &Range<usize>, k: usize| striping.slice(s, k);
        for k in 0..striping.count {
            let count = slice(&shards[0], k).len();
            let first_piece = table.len();
            for (r, s) in shards.iter().enumerate() {
                let flat = slice(s, k);
                if flat.is_empty() {
                    continue;
                }
                let mut i = layout.tensor_at(flat.start);
                while i < descs.len() && layout.range(i).start < flat.end {
                    let t = layout.range(i);
                    let (lo, hi) = (t.start.max(flat.start), t.end.min(flat.end));
                    if lo < hi {
                        let offset = (r * count + lo - flat.start) as u64;
                        table.push(GaTensor {
                            offset,
                            numel: (hi - lo) as u64,
                            dtype: descs[i].dtype.code(),
                            pad: 0,
                        });
                        sources.push(Source { tensor: i, from: lo - t.start });
                    }
                    let p = layout.padding(i);
                    let (lo, hi) = (p.start.max(flat.start), p.end.min(flat.end));
                    if lo < hi {
                        table.push(GaTensor {
                            offset: (r * count + lo - flat.start) as u64,
                            numel: (hi - lo) as u64,
                            dtype: Dtype::F32.code(),
                            pad: 0,
                        });
                        sources.push(Source { tensor: PADDING, from: 0 });
                    }
                    i += 1;
                }
            }
            let launches = (first_piece..table.len())
                .step_by(SOURCES_PER_LAUNCH)
                .map(|first| {
                    let count = SOURCES_PER_LAUNCH.min(table.len() - first);
                    let first_chunk = chunks.len();
                    for (p, piece) in table.iter().enumerate().skip(first).take(count) {
                        let numel = piece.numel as usize;
                        chunks.extend((0..numel).step_by(CHUNK).map(|start| GaChunk {
                            tensor: p as u64,
                            start: start as u64,
                            len: (numel - start).min(CHUNK) as u64,
                        }));
                    }
                    AddLaunch {
                        first,
                        count,
                        first_chunk,
                        num_chunks: (chunks.len() - first_chunk) as u64,
                    }
                })
                .collect();
            stripes.push(Stripe { count, own: slice(&shards[rank], k).len(), launches });
        }
        (stripes, sources, table, chunks)
    }

    fn hooks(&self) -> MutexGuard<'_, Hooks<Stage>> {
        self.hooks.lock()
    }

    /// The checks' tables (made with the memory where its policies check).
    pub(super) fn checks(&self) -> Result<&Tables> {
        self.checks.as_ref().ok_or_else(|| {
            Error::new(ErrorKind::Internal, "a check of a shard made without its tables")
        })
    }
}

/// A device store's sharded accumulation at work: its shard memory, with the store's device,
/// stream, tables and flags.
pub(super) struct Sharded<'a> {
    store: &'a DeviceStore,
    mem: &'a ShardMemory,
}

impl Sharded<'_> {
    /// A staging buffer for a bucket: a new one while fewer than KEPT_STAGES exist (so a
    /// bucket's conversions need not wait for the reduction before it) or none is spare; else
    /// the longest unused, once its last reduction is done (a wait on the device).
    fn take_stage(&self, h: &mut Hooks<Stage>) -> Result<Stage> {
        if h.staged() >= KEPT_STAGES {
            if let Some(stage) = h.spare.pop_front() {
                stage.free.wait(self.store.stream)?;
                return Ok(stage);
            }
        }
        Ok(Stage {
            buf: DeviceBuffer::zeroed(&self.store.ctx, self.store.stream, self.mem.bucket_len * 4)?,
            free: Event::new(&self.store.ctx)?,
        })
    }

    /// Converts tensor `index`'s gradient into its bucket's staging (unscaled, weighted and
    /// checked, as `add` converts it into a stripe), on the accumulator's stream.
    fn convert(
        &self,
        scaler: &dyn DeviceScale,
        index: usize,
        grad: CUdeviceptr,
        weight: f64,
        stage: &Stage,
    ) -> Result<()> {
        let (desc, r) = (self.store.plan.descs[index], self.store.plan.layout.range(index));
        let bucket = &self.store.plan.layout.buckets()[self.store.plan.layout.bucket_of(index)];
        let dst = stage.buf.ptr() + 4 * (r.start - bucket.start) as u64;
        // A poisoned gradient raises its tensor's flag: closing the micro-batch drops it.
        let flag = match self.mem.sharding.drops {
            true => self.store.flags()?.ptr() + 4 * index as u64,
            false => self.store.found_inf.ptr(),
        };
        let (numel, dtype, assign) = (desc.numel as u64, desc.dtype.code(), 1u32);
        scaler.launch_reading(self.store.stream.cast(), |state| {
            let mut args = launch_args!(dst, grad, numel, dtype, state, weight, assign, flag);
            // SAFETY: argument types follow ga_add_one. The destination is the tensor's place in
            // its bucket's staging (`bucket_len` elements from the bucket's start, and the bucket
            // holds the tensor); the gradient holds the tensor's numel values (the caller's
            // contract, checked for size by the accumulator); the flag is a u32 of this store.
            unsafe {
                self.store.kernels.add_one.launch_over(
                    &self.store.ctx,
                    self.store.stream,
                    numel.div_ceil(CHUNK as u64),
                    &mut args,
                )
            }
        })
    }

    /// Enqueues bucket `b`'s reduction on the communication stream, after the conversions: each
    /// piece inside a shard summed into its owner, and this rank's piece added into the shard
    /// (assigned with `assign`). The staging's `free` event marks the end of its use.
    fn reduce_bucket(&self, b: usize, stage: &Stage, assign: bool) -> Result<()> {
        let bucket = self.store.plan.layout.buckets()[b].clone();
        let stream = self.store.comm_stream()?.stream;
        self.store.event().order(self.store.stream, stream)?;
        let at = |flat: usize| stage.buf.ptr() + 4 * (flat - bucket.start) as u64;
        let reduced = match self.group()? {
            Some(c) if self.store.bf16(c).is_some() => {
                let pieces: Vec<Range<usize>> = self
                    .mem
                    .sharding
                    .shards
                    .iter()
                    .map(|s| relative(&intersect(s, &bucket), bucket.start))
                    .collect();
                let out = at(bucket.start + pieces[self.mem.sharding.rank].start);
                self.store.bf16(c).expect("matched above").reduce_to_owners(
                    c,
                    at(bucket.start),
                    &pieces,
                    out,
                    stream,
                )
            }
            Some(c) => reduce_to_owners(c, &bucket, &self.mem.sharding.shards, at, stream),
            None => Ok(()),
        };
        let own = intersect(&bucket, &self.mem.sharding.own);
        let added = reduced.and_then(|()| {
            if own.is_empty() {
                return Ok(());
            }
            let (dst, src) = (self.shard_at(self.mem.sharding.offset(own.start)), at(own.start));
            let into =
                ShardAdd { dst, src, numel: own.len(), assign, flag: self.mem.sum_inf.ptr() };
            // SAFETY: the source is this rank's reduced piece of the bucket in the staging, the
            // destination the shard's elements of that piece; `sum_inf` is written on this
            // stream only.
            unsafe { self.add_to_shard(into, stream) }
        });
        // Recorded even after a failure: part of the reduction may be enqueued.
        let recorded = stage.free.record(stream);
        added.and(recorded)
    }

    /// This rank's window is lost and it never pairs another collective with its peers'.
    fn stop(&self) {
        self.mem.sharding.lose();
        if let Ok(Some(c)) = self.group() {
            c.stop_pairing();
        }
    }

    /// The control step that closes a micro-batch added tensor by tensor, with this rank's
    /// error `own` and whether a gradient of it was `poisoned` here (it waits, for the
    /// micro-batch's reductions too). Returns whether one was on any rank.
    fn close_together(&self, own: Option<&Error>, poisoned: bool) -> Result<bool> {
        let total = match self.group()? {
            Some(c) => {
                let total = self.store.claims.exchange(
                    Step::Closing,
                    &self.store.plan,
                    Some(c),
                    None,
                    own.is_some(),
                    poisoned,
                );
                Ok(total.inspect_err(|_| self.stop())?)
            }
            None => Ok(ControlSum { dropped: poisoned as u64, ..Default::default() }),
        };
        Ok(Step::Closing.judge(total, own)?.dropped != 0)
    }

    /// Enqueues a copy of the shard and the window's flag as they are, for
    /// [`Sharded::enqueue_restore`].
    fn enqueue_keep(&self, first: bool) -> Result<()> {
        let bytes = 4 * self.mem.sharding.own.len();
        let before = once(&self.mem.before, || {
            DeviceBuffer::zeroed(&self.store.ctx, self.store.stream, bytes + 4)
        })?;
        before.copy_from(0, &self.mem.shard, 0, bytes)?;
        match first {
            true => before.zero_f32(bytes / 4, 1),
            false => before.copy_from(bytes, &self.store.found_inf, 0, 4),
        }
    }

    /// Enqueues putting back what [`Sharded::enqueue_keep`] kept.
    fn enqueue_restore(&self) -> Result<()> {
        let bytes = 4 * self.mem.sharding.own.len();
        let before = self.mem.before.get().ok_or_else(|| {
            Error::new(ErrorKind::Internal, "a dropped micro-batch with no copy of the shard")
        })?;
        self.mem.shard.copy_from(0, before, 0, bytes)?;
        self.store.found_inf.copy_from(0, before, bytes, 4)
    }

    /// After the communication stream is joined: its overflow flag goes into the window's.
    fn merge_sum_inf(&self) -> Result<()> {
        let (into, from) = (self.store.found_inf.ptr(), self.mem.sum_inf.ptr());
        let mut args = launch_args!(into, from);
        // SAFETY: argument types follow ga_or_flag; both are u32 flags of this store.
        unsafe {
            self.store.kernels.or_flag.launch(
                &self.store.ctx,
                1,
                1,
                self.store.stream,
                &mut args,
            )?
        };
        self.mem.sum_inf.zero_f32(0, 1)
    }

    fn shard_at(&self, offset: usize) -> CUdeviceptr {
        self.mem.shard.ptr() + 4 * offset as u64
    }

    /// The NCCL communicator of the shard group, when there is one.
    fn group(&self) -> Result<Option<&NcclComm>> {
        self.mem.sharding.comm().map(nccl).transpose()
    }

    /// Stripe `k`: converts this rank's gradients into the staging (with none, zeros: this rank
    /// dropped the micro-batch, and the others' sums still reach the shards), reduce-scatters
    /// it, and adds this rank's slice into the shard (assigns it with `assign`).
    fn add_stripe(&self, grads: Option<&Gradients<'_>>, k: usize, assign: bool) -> Result<()> {
        let s = &self.mem.stripes[k];
        let staging = self.mem.staging.ptr();
        match grads {
            Some(g) => self.convert_stripe(g, s)?,
            None => self.mem.staging.zero_f32(0, s.count * self.mem.sharding.shards.len())?,
        }
        if let Some(c) = self.group()? {
            let reduced = match self.store.bf16(c) {
                // The staging in NCCL's in-place layout: rank q's piece at `q * count`.
                Some(wire) => {
                    let pieces: Vec<Range<usize>> =
                        (0..c.world_size()).map(|q| q * s.count..(q + 1) * s.count).collect();
                    wire.reduce_to_owners(
                        c,
                        staging,
                        &pieces,
                        staging + (4 * self.mem.sharding.rank * s.count) as u64,
                        self.store.stream,
                    )
                }
                None => c.reduce_scatter_sum_f32(staging, s.count, self.store.stream),
            };
            reduced.inspect_err(|_| self.mem.sharding.lose())?;
        }
        if s.own == 0 {
            return Ok(());
        }
        let (stripe, rank) = (self.mem.sharding.stripes.len, self.mem.sharding.rank);
        let (dst, src) = (self.shard_at(k * stripe), staging + (4 * rank * s.count) as u64);
        let into = ShardAdd { dst, src, numel: s.own, assign, flag: self.store.found_inf.ptr() };
        // SAFETY: the source is this rank's reduced piece, `own` of its `count` elements at
        // `rank * count` in the staging; the destination the shard from `k * stripe`, which holds
        // this stripe's slice of `own` elements.
        unsafe { self.add_to_shard(into, self.store.stream) }
            .inspect_err(|_| self.mem.sharding.lose())
    }

    /// Converts this rank's gradients into stripe `s`'s staging: one conversion launch per
    /// SOURCES_PER_LAUNCH pieces.
    fn convert_stripe(&self, g: &Gradients<'_>, s: &Stripe) -> Result<()> {
        let (pieces, staging, found_inf) =
            (self.mem.pieces.ptr(), self.mem.staging.ptr(), self.store.found_inf.ptr());
        let (scaler, grads, weight) = (g.scaler, g.grads, g.weight);
        for launch in &s.launches {
            let mut sources = GaSources {
                first_tensor: launch.first as u64,
                count: launch.count as u64,
                s: [GaSource::default(); SOURCES_PER_LAUNCH],
            };
            for (slot, p) in sources.s.iter_mut().zip(launch.first..launch.first + launch.count) {
                let Source { tensor, from } = self.mem.sources[p];
                let grad = if tensor == PADDING {
                    self.mem.zeros.ptr()
                } else {
                    let bytes =
                        if self.store.plan.descs[tensor].dtype == Dtype::F32 { 4 } else { 2 };
                    grads[tensor] + (from * bytes) as u64
                };
                *slot = GaSource { grad, assign: 1, pad: 0 };
            }
            let chunks = self.mem.chunks.ptr()
                + (launch.first_chunk * std::mem::size_of::<GaChunk>()) as u64;
            let num_chunks = launch.num_chunks;
            scaler.launch_reading(self.store.stream.cast(), |state| {
                let mut args = launch_args!(
                    pieces, chunks, num_chunks, sources, staging, state, weight, found_inf
                );
                // SAFETY: argument types follow ga_add_multi (`sources` by value). The chunks are
                // this launch's pieces', each inside the staging (`world * count` elements); a
                // piece's gradient address is its tensor's from element `from`, and the piece
                // ends inside the tensor, whose numel values the caller's address holds; a piece
                // of padding (f32, shorter than MASTER_ALIGN bytes) reads `zeros`, that long.
                unsafe {
                    self.store.kernels.add_multi.launch_over(
                        &self.store.ctx,
                        self.store.stream,
                        num_chunks,
                        &mut args,
                    )
                }
            })?;
        }
        Ok(())
    }

    /// Enqueues `into` on `stream`: the add kernel with a factor of exactly 1 (a scaler state of
    /// scale 1), so `dst = src` or `dst += src` bit for bit, and a non-finite sum flagged.
    ///
    /// # Safety
    /// `src` holds `numel` f32 values, the shard holds `numel` elements from `dst`, and `flag`
    /// is a u32 of this context that no other stream writes meanwhile.
    unsafe fn add_to_shard(&self, into: ShardAdd, stream: CUstream) -> Result<()> {
        let ShardAdd { dst, src, numel, assign, flag } = into;
        let (numel, dtype, unit, weight, assign) =
            (numel as u64, Dtype::F32.code(), self.mem.unit.ptr(), 1.0f64, assign as u32);
        let mut args = launch_args!(dst, src, numel, dtype, unit, weight, assign, flag);
        // SAFETY: argument types follow ga_add_one; the addresses are the caller's contract.
        unsafe {
            self.store.kernels.add_one.launch_over(
                &self.store.ctx,
                stream,
                numel.div_ceil(CHUNK as u64),
                &mut args,
            )
        }
    }

    /// Once per communicator (it waits): every rank checks that all ranks hold the same layout
    /// and take the same step (`at`: the first micro-batch or the boundary), so that they never
    /// run collectives of different sizes. A rank with `error` takes part, and the others fail
    /// with PEER_FAILURE.
    fn verify_layout(&self, comm: &NcclComm, step: Step, error: Option<&Error>) -> Result<()> {
        let checked = self.store.check_layout_once(comm, step, error)?;
        match error {
            Some(e) if !checked => self.refuse_checked([comm], e),
            _ => Ok(()),
        }
    }

    /// [`verify_layout`](Self::verify_layout) of a hybrid boundary, once per pair of groups:
    /// the grid check over both groups. After it, a rank whose call is invalid stops pairing on
    /// both groups, whose peers wait in the boundary's collectives.
    fn verify_grid(
        &self,
        comm: Option<&NcclComm>,
        replicas: &NcclComm,
        error: Option<&Error>,
    ) -> Result<()> {
        let shard = self.mem.sharding.rank;
        let checked = self.store.check_grid_once(comm, replicas, shard, error)?;
        match error {
            Some(e) if !checked => self.refuse_checked(comm.into_iter().chain([replicas]), e),
            _ => Ok(()),
        }
    }

    /// This rank's call is refused after the layouts were checked: the peers are in the call's
    /// collectives, which this rank never makes. Its own earlier ones complete first (the peers
    /// made them too), so its window stays whole; one that cannot complete loses it. Then it
    /// stops pairing on `groups`.
    fn refuse_checked<'c>(
        &self,
        groups: impl IntoIterator<Item = &'c NcclComm>,
        error: &Error,
    ) -> Result<()> {
        if self.drain().is_err() {
            self.mem.sharding.lose();
        }
        groups.into_iter().for_each(NcclComm::stop_pairing);
        Err(error.clone())
    }

    /// Host reads wait for the stream, which a reduce-scatter that a peer never joined would hold
    /// forever: the wait is the communicator's (its timeout aborts it, and the stream drains).
    /// After an abort the stream drains by itself.
    pub(super) fn drain(&self) -> Result<()> {
        self.store.join_comm_stream()?;
        match self.group()? {
            Some(c) if c.health().is_ok() => {
                wait_for_collectives(&self.store.ctx, self.store.stream, c)
            }
            _ => Ok(()),
        }
    }

    /// The boundary's device work: the control words (the agreed `totals`' counts where the host
    /// knows them) summed over the group, then normalise and measure the shard, gather every
    /// shard's block sums, and clip the shard.
    pub(super) fn enqueue_boundary(
        &self,
        p: &Proposal<'_>,
        totals: Option<&ControlSum>,
    ) -> Result<()> {
        let partials = self.store.partials.ptr();
        pack_control(self.store, p, totals)?;
        let comm = p.comm.map(nccl).transpose()?;
        if let Some(c) = comm {
            reduce_control(self.store, c, self.store.stream)?;
        }
        // A hybrid boundary: the counts and the shard (the shard group's sum) are summed over the
        // replicas (FP32 sums, as on the CPU) before the norm.
        if let Some(r) = p.replicas.map(nccl).transpose()? {
            // Every replica holds the same shard: an empty one is skipped by all of them.
            r.group(|| {
                reduce_control(self.store, r, self.store.stream)?;
                if self.mem.sharding.own.is_empty() {
                    return Ok(());
                }
                r.allreduce_sum_f32(
                    self.mem.shard.ptr(),
                    self.mem.sharding.own.len(),
                    self.store.stream,
                )
            })?;
        }
        // Every rank's block sums at its shard's blocks (a short shard's last ones stay zero, and
        // only the trailing shards are short): every rank folds the same sums in the same order.
        let gather = comm.map(|c| (c, self.mem.padded / NORM_BLOCK));
        let (own, rank) = (self.mem.sharding.own.clone(), self.mem.sharding.rank);
        let measure = || self.store.measure_segments(self.mem.shard.ptr(), own.clone(), rank, comm);
        let span = NormSpan {
            data: self.mem.shard.ptr(),
            n: own.len() as u64,
            first_block: rank * self.mem.padded / NORM_BLOCK,
            gather,
            measure: self.store.measures().then_some(&measure as &dyn Fn() -> Result<()>),
        };
        // SAFETY: the shard holds `own.len()` elements, `boundary` a ga_boundary and `partials`
        // every rank's `padded / NORM_BLOCK` block sums, sized at creation.
        unsafe {
            norm_and_clip(
                &self.store.ctx,
                &self.store.kernels,
                self.store.stream,
                &self.store.plan,
                self.store.boundary.ptr(),
                partials,
                span,
            )
        }
    }
}

/// Bucket by bucket, a staging buffer of device memory, reduced on the communication stream.
impl Stages for Sharded<'_> {
    type Stage = Stage;

    fn take(&self, hooks: &mut Hooks<Stage>) -> Result<Stage> {
        self.take_stage(hooks)
    }

    fn zero(&self, stage: &mut Stage, b: usize, range: Range<usize>) -> Result<()> {
        let bucket = &self.store.plan.layout.buckets()[b];
        stage.buf.zero_f32(range.start - bucket.start, range.len())
    }

    fn reduce(&self, stage: &mut Stage, b: usize) -> Result<()> {
        self.reduce_bucket(b, stage, self.mem.sharding.first())
    }

    /// The peers wait for each bucket's reduction: this rank stops pairing.
    fn failed(&self) {
        self.stop();
    }
}

/// A micro-batch's turns on the device. No control step when a micro-batch opens (it would wait
/// for the stream): the ranks check their layouts once, at the first micro-batch (whose cut, by
/// stripes or by buckets, they must share), and a rank whose call is invalid takes part with its
/// error. After that a rank whose call is invalid aborts the communicator, so that it never
/// pairs a later collective with the peers' reductions; theirs fail when their communicator
/// times out or is aborted. The closing step is the micro-batch's one host wait; the shard's
/// copy is device memory, enqueued on the accumulator's stream. Of the staging buffers,
/// KEPT_STAGES stay (the others are freed on the accumulator's stream, after the reductions that
/// read them).
impl Turns for Sharded<'_> {
    const KEPT: usize = KEPT_STAGES;

    fn keep_before(&self, _master: &MasterWrite, first: bool) -> Result<()> {
        self.enqueue_keep(first)
    }

    fn restore(&self, _master: &mut MasterWrite) -> Result<()> {
        self.enqueue_restore()
    }

    fn open_step(&self, whole: bool, error: Option<&Error>) -> Result<()> {
        match self.group()? {
            Some(c) => self.verify_layout(c, Step::Microbatch { whole }, error),
            None => error.map_or(Ok(()), |e| Err(e.clone())),
        }
    }

    /// The communication stream joined, and its overflow flag merged into the window's.
    fn join(&self) -> Result<()> {
        self.store.join_comm_stream().and_then(|()| self.merge_sum_inf())
    }

    /// Whether a gradient of the open micro-batch raised its tensor's flag (a wait for the
    /// micro-batch's reductions).
    fn poisoned(&self) -> Result<bool> {
        Ok(self.mem.sharding.drops && !self.store.flagged()?.is_empty())
    }

    fn close_step(&self, own: Option<&Error>, poisoned: bool) -> Result<bool> {
        self.close_together(own, poisoned)
    }
}

impl Sharded<'_> {
    pub(super) fn open_microbatch(
        &self,
        master: &MasterWrite,
        first: bool,
        whole: bool,
        error: Option<&Error>,
    ) -> Result<()> {
        self.mem.sharding.open_microbatch(self, master, &mut self.mem.hooks(), first, whole, error)
    }

    pub(super) fn close_microbatch(&self, master: &mut MasterWrite) -> Result<bool> {
        self.mem.sharding.close_microbatch(
            self,
            master,
            &self.store.plan.layout,
            &mut self.mem.hooks(),
        )
    }

    /// Before the layouts are checked, the refusal takes part in the check; after, it aborts.
    pub(super) fn refuse(&self) {
        if let Ok(Some(c)) = self.group() {
            let _ = self.verify_layout(
                c,
                Step::Microbatch { whole: true },
                Some(&Error::invalid("this rank's call was refused")),
            );
        }
    }

    /// One conversion launch per SOURCES_PER_LAUNCH pieces of a stripe, its reduce-scatter and
    /// the shard add, stripe after stripe; nothing waits. With no `grads`, zeros (this rank
    /// dropped the micro-batch).
    pub(super) fn add(&self, grads: Option<&Gradients<'_>>) -> Result<()> {
        let assign = self.mem.sharding.first();
        for k in 0..self.mem.stripes.len() {
            // Part of the micro-batch may be in the shard, and the peers wait in this stripe's
            // reduce-scatter or the next: the window is lost, and the communicator aborted so
            // that this rank never pairs another collective with theirs.
            self.add_stripe(grads, k, assign).inspect_err(|_| self.stop())?;
        }
        Ok(())
    }

    /// Converts the tensor into its bucket's staging and enqueues the reduction of every bucket
    /// that is then complete, in the backward's order; nothing waits.
    pub(super) fn add_tensor(
        &self,
        scaler: &dyn DeviceScale,
        index: usize,
        grad: CUdeviceptr,
        weight: f64,
    ) -> Result<()> {
        self.mem.hooks().contribute(self, &self.store.plan.layout, index, |stage| {
            self.convert(scaler, index, grad, weight, stage)
        })
    }

    pub(super) fn zero(&self, index: usize) -> Result<()> {
        let part = self.mem.sharding.held(&self.store.plan.layout.range(index));
        if part.is_empty() {
            return Ok(());
        }
        self.mem.shard.zero_f32(part.start, part.len())
    }

    /// The counts stay on the device, where the boundary sums them; alone (or asked for them),
    /// the host knows them.
    pub(super) fn agree(&self, p: &Proposal<'_>) -> Result<Agreed> {
        let (comm, replicas) = (p.comm.map(nccl).transpose()?, p.replicas.map(nccl).transpose()?);
        match (comm, replicas) {
            (c, Some(r)) => self.verify_grid(c, r, p.error.as_ref())?,
            (Some(c), None) => self.verify_layout(c, Step::Boundary, p.error.as_ref())?,
            (None, None) => p.error.clone().map_or(Ok(()), Err)?,
        }
        Ok(Agreed { totals: agreed_totals(self.store, p, comm, replicas)? })
    }

    pub(super) fn master_address(&self, offset: usize) -> *mut f32 {
        self.shard_at(self.mem.sharding.offset(offset)) as *mut f32
    }

    /// `range` lies inside the shard (the accumulator reads only held ranges).
    pub(super) fn read(&self, range: Range<usize>, out: &mut [f32]) -> Result<()> {
        self.mem
            .shard
            .read_at(4 * (range.start - self.mem.sharding.own.start), &mut out[..range.len()])
    }

    pub(super) fn write(&self, values: &[f32]) -> Result<()> {
        self.mem.shard.write(values)
    }
}
