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
    check_stream, launch_args, CUdeviceptr, CUstream, Context, DeviceBuffer, Event, OwnedStream,
    SharedReads, THREADS,
};
use super::kernels::Kernels;
use super::layout::{GaBoundary, GaChunk, GaSource, GaSources, GaTensor, SOURCES_PER_LAUNCH};
use super::sharded::{self, ShardMemory};
use super::wire::Wire;
use crate::accumulator::sharding::{BucketSchedule, Shard};
use crate::accumulator::{
    AddKernels, Agreed, BoundaryWork, DeviceScale, Gradient, Grads, MasterMemory, MasterWrite,
    MicrobatchTurns, Overflow, Plan, Proposal, Reduced, ScaleSource, Sharding, SyncInfo,
    TensorStats, TensorWrite,
};
use crate::backend::cuda::nccl::NcclComm;
use crate::comm::Communicator;
use crate::device::Device;
use crate::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};
use crate::math::NORM_BLOCK;

mod boundary;
mod control;
pub(super) mod overflow;

pub(super) use boundary::{norm_and_clip, NormSpan};
pub(super) use control::{
    agreed_totals, nccl, pack_control, read_info, reduce_control, reduce_to_owners,
    wait_for_collectives, wait_for_groups, Claims, Schedule,
};

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
}

impl MasterMemory for DeviceStore {
    fn device(&self) -> Device {
        Device::Cuda { ordinal: self.ctx.ordinal, stream: self.stream.cast() }
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
}

impl AddKernels for DeviceStore {
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
}

impl MicrobatchTurns for DeviceStore {
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
}

impl BoundaryWork for DeviceStore {
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
        agreed: &Agreed,
        read: bool,
    ) -> Result<Option<SyncInfo>> {
        {
            // The boundary is rewritten: after the scalers' gathers of the last one.
            let mut reads = self.boundary_reads();
            reads.before_write()?;
            let result = match &self.memory {
                Memory::Whole(w) => self.enqueue_boundary(w, p, agreed.totals.as_ref()),
                Memory::Shard(s) => s.with(self).enqueue_boundary(p, agreed.totals.as_ref()),
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

    /// The clipping pass of the boundary (`ga_scale_by`, one f32 product per element as
    /// `simd::scale`), with the job's factor in the boundary's second factor.
    fn scale_result(&self, _master: &mut MasterWrite, factor: f32) -> Result<()> {
        let own = self.plan.shard();
        let mut reads = self.boundary_reads();
        reads.before_write()?;
        let result =
            self.boundary.write_at(std::mem::offset_of!(GaBoundary, second_factor), &[factor]);
        let result = result.and_then(|()| {
            if own.is_empty() {
                return Ok(());
            }
            let (data, n, boundary) = (
                self.master_address(own.start) as CUdeviceptr,
                own.len() as u64,
                self.boundary.ptr(),
            );
            let mut args = launch_args!(data, n, boundary);
            // SAFETY: ga_scale_by takes the `n` elements of this rank's result at `data` (its
            // held range of the master) and the boundary's ga_boundary, live buffers of the
            // store's context.
            unsafe {
                self.kernels.scale_by.launch_over(
                    &self.ctx,
                    self.stream,
                    n.div_ceil(THREADS as u64),
                    &mut args,
                )
            }
        });
        reads.after_write()?;
        result
    }

    /// The job's overflow, counts, norm and coefficient written over the group's in the
    /// boundary (a host read and write on the stream), so a CUDA scaler's gather and an
    /// optimizer's skip follow the job.
    fn conclude(&self, info: &SyncInfo) -> Result<()> {
        let mut reads = self.boundary_reads();
        reads.before_write()?;
        let mut b = [GaBoundary::default()];
        let result = self.boundary.read(&mut b).and_then(|()| {
            let b = GaBoundary {
                count: info.total_count,
                microbatches: info.microbatches,
                found_inf: info.found_inf as u64,
                dropped: info.dropped_microbatches,
                grad_norm: info.grad_norm,
                clip_coef: info.clip_coef,
                empty: 0,
                ..b[0]
            };
            self.boundary.write(&[b])
        });
        reads.after_write()?;
        result
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
