//! The overflow policies' and the telemetry's device work, over a whole master or a shard: the per-tensor
//! flags a micro-batch's check raises (read back by the host under DROP_MICROBATCH, counted on the
//! device under SKIP_STEP), the staging of a hook micro-batch, and the per-tensor norms of the
//! boundary, whose fold is the CPU's (`tensor_stats.rs`).

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::{nccl, AddLaunch, DeviceStore, Memory, Tables, Whole, CHUNK, NORM_BLOCKS_PER_CTA};
use crate::accumulator::sharding::Shard;
use crate::accumulator::{
    DeviceScale, MicrobatchTurns, Overflow, Plan, Proposal, Segments, TensorStats,
};
use crate::backend::cuda::driver::{
    launch_args, CUdeviceptr, CUstream, Context, DeviceBuffer, THREADS,
};
use crate::backend::cuda::layout::GaBoundary;
use crate::backend::cuda::nccl::NcclComm;
use crate::error::{Error, ErrorKind, Result};

/// `tensor_stats` on the device: the layout's segments and their table, the segment sums (this
/// rank's; under reduce-scatter every shard's, gathered in rank order), the non-finite counts
/// summed over the ranks, and the last boundary's stats once read.
pub(super) struct Stats {
    segments: Segments,
    bounds: DeviceBuffer,
    sums: DeviceBuffer,
    counts: DeviceBuffer,
    last: Mutex<Option<Vec<TensorStats>>>,
}

impl Stats {
    pub(super) fn new(plan: &Plan, ctx: &Arc<Context>, stream: CUstream) -> Result<Self> {
        let segments = Segments::new(&plan.layout, plan.descs.len());
        let shards = plan.shards().len().max(1);
        Ok(Stats {
            bounds: DeviceBuffer::from_slice(ctx, stream, &segments.bounds())?,
            sums: DeviceBuffer::zeroed(ctx, stream, 8 * shards * segments.len())?,
            counts: DeviceBuffer::zeroed(ctx, stream, 8 * plan.descs.len())?,
            segments,
            last: Mutex::new(None),
        })
    }
}

/// The checks, staging and measures, over the whole master or a shard.
impl DeviceStore {
    /// Enqueues the segment sums of the normalised master's elements `held`, which `data` holds
    /// (this rank's range: the whole layout, or a shard), into slot `slot` (`tensor_stats`) and,
    /// with `gather` (the shards' group), gathers every shard's.
    pub(in crate::backend::cuda) fn measure_segments(
        &self,
        data: CUdeviceptr,
        held: Range<usize>,
        slot: usize,
        gather: Option<&NcclComm>,
    ) -> Result<()> {
        let Some(stats) = &self.stats else { return Ok(()) };
        let num = stats.segments.len() as u64;
        let bounds = stats.bounds.ptr();
        let out = stats.sums.ptr() + 8 * slot as u64 * num;
        let (lo, hi) = (held.start as u64, held.end as u64);
        let mut args = launch_args!(data, bounds, num, lo, hi, out);
        let grid = self.ctx.grid_for(num.div_ceil(NORM_BLOCKS_PER_CTA));
        // SAFETY: argument types follow ga_segment_squares; `data` holds the elements `held` (the
        // caller's contract), the table `num` segments, and the sums one slot of `num` f64 per
        // shard.
        unsafe {
            self.kernels.segment_squares.launch(&self.ctx, grid, THREADS, self.stream, &mut args)?
        };
        match gather {
            Some(c) if c.world_size() > 1 => {
                c.allgather_f64(stats.sums.ptr(), num as usize, self.stream)
            }
            _ => Ok(()),
        }
    }

    /// Enqueues the sum of the window's non-finite counts (the host's, or under SKIP_STEP the
    /// device's) over the boundary's groups.
    pub(super) fn share_counts(&self, p: &Proposal<'_>) -> Result<()> {
        let Some(stats) = &self.stats else { return Ok(()) };
        if !self.counts_on_device() {
            stats.counts.write(&p.nonfinite)?;
        }
        for c in p.comm.iter().chain(&p.replicas) {
            nccl(*c)?.allreduce_u64(stats.counts.ptr(), p.nonfinite.len(), false, self.stream)?;
        }
        Ok(())
    }

    /// Reads the boundary's stats back (waits for the stream) and keeps them.
    pub(super) fn read_stats(&self) -> Result<()> {
        let Some(stats) = &self.stats else { return Ok(()) };
        let mut sums = vec![0f64; stats.sums.bytes() / 8];
        let mut counts = vec![0u64; self.plan.descs.len()];
        let mut b = [GaBoundary::default()];
        stats.sums.read(&mut sums)?;
        stats.counts.read(&mut counts)?;
        self.boundary.read(&mut b)?;
        // With clipping the pass measures the sum before normalising it.
        let d = b[0].divisor as f64;
        let scale = if self.plan.config.max_grad_norm != 0.0 { 1.0 / (d * d) } else { 1.0 };
        let measured = stats.segments.stats(&sums, &counts, scale);
        *stats.last.lock() = Some(measured);
        Ok(())
    }

    /// The whole master: a hook micro-batch is staged only over one (a shard's is reduced as
    /// its buckets fill, see `sharded.rs`).
    pub(super) fn whole(&self) -> Result<&Whole> {
        match &self.memory {
            Memory::Whole(w) => Ok(w),
            Memory::Shard(_) => Err(Error::new(
                ErrorKind::Internal,
                "a hook micro-batch is staged over a whole master only",
            )),
        }
    }

    /// Whether the boundary measures the tensors (`tensor_stats`).
    pub(in crate::backend::cuda) fn measures(&self) -> bool {
        self.stats.is_some()
    }

    /// The tables the checks run on: the whole master's, or (made with it) a shard's.
    pub(super) fn checks(&self) -> Result<&Tables> {
        match &self.memory {
            Memory::Whole(w) => Ok(&w.tables),
            Memory::Shard(s) => s.checks(),
        }
    }

    /// The per-tensor flags of `Overflow::DropMicrobatch`, allocated (zeroed) at first use.
    pub(in crate::backend::cuda) fn flags(&self) -> Result<&DeviceBuffer> {
        let bytes = 4 * self.plan.descs.len();
        once(&self.flags, || DeviceBuffer::zeroed(&self.ctx, self.stream, bytes))
    }

    /// The hook micro-batch's staging, allocated at first use.
    pub(super) fn stage(&self) -> Result<&DeviceBuffer> {
        let bytes = 4 * self.plan.layout.len();
        once(&self.stage, || DeviceBuffer::zeroed(&self.ctx, self.stream, bytes))
    }

    /// The tensors whose flag is raised, in order (waits for the stream; a shard's, as every
    /// host read of it, with the communicator's timeout).
    pub(in crate::backend::cuda) fn flagged(&self) -> Result<Vec<usize>> {
        self.drain()?;
        let mut flags = vec![0u32; self.plan.descs.len()];
        self.flags()?.read(&mut flags)?;
        Ok(flags.iter().enumerate().filter(|(_, &f)| f != 0).map(|(i, _)| i).collect())
    }

    /// `ga_check_multi` over the micro-batch `grads`, launched as the whole master's adds are;
    /// then the flags are read back (a host wait). A shard's stream also holds the earlier
    /// micro-batches' reductions: a wait that fails loses the window.
    pub(super) fn check(
        &self,
        scaler: &dyn DeviceScale,
        grads: &[CUdeviceptr],
        weight: f64,
    ) -> Result<Vec<usize>> {
        self.flags()?.zero_f32(0, self.plan.descs.len())?;
        let t = self.checks()?;
        self.launch_checks(&t.launches, scaler, &|i| grads[i], weight)?;
        self.flagged().inspect_err(|_| self.shard().map_or((), Shard::lose))
    }

    /// Enqueues `ga_check_multi` over `launches` (of [`DeviceStore::checks`]), raising the flags
    /// of the tensors whose gradient (`grad(i)`) goes non-finite once unscaled and weighted.
    pub(super) fn launch_checks(
        &self,
        launches: &[AddLaunch],
        scaler: &dyn DeviceScale,
        grad: &dyn Fn(usize) -> CUdeviceptr,
        weight: f64,
    ) -> Result<()> {
        let t = self.checks()?;
        let (f, tensors, flags) = (self.kernels.check_multi, t.tensors.ptr(), self.flags()?.ptr());
        for launch in launches {
            let (sources, chunks, num_chunks) = t.tables(launch, grad, &|_| false);
            scaler.launch_reading(self.stream.cast(), |state| {
                let mut args =
                    launch_args!(tensors, chunks, num_chunks, sources, state, weight, flags);
                // SAFETY: argument types follow ga_check_multi (`sources` by value); the chunk
                // range is this launch's tensors', the flags hold one u32 per tensor, and the
                // gradient addresses hold their tensors' numel values (the caller's contract).
                unsafe { f.launch_over(&self.ctx, self.stream, num_chunks, &mut args) }
            })?;
        }
        Ok(())
    }

    /// Whether the non-finite counts of `tensor_stats` are kept on the device: under SKIP_STEP,
    /// where the host decides nothing (under DROP_MICROBATCH its decisions are the counts).
    pub(super) fn counts_on_device(&self) -> bool {
        self.stats.is_some() && self.plan.config.overflow == Overflow::SkipStep
    }

    /// Enqueues the count of the flagged tensors into the window's counts (clearing the flags).
    pub(super) fn count_flags(&self) -> Result<()> {
        let (Some(stats), Some(flags)) = (&self.stats, self.flags.get()) else { return Ok(()) };
        let (counts, flags, n) = (stats.counts.ptr(), flags.ptr(), self.plan.descs.len() as u64);
        let mut args = launch_args!(counts, flags, n);
        // SAFETY: argument types follow ga_count_flags; both buffers hold one value per tensor.
        unsafe {
            self.kernels.count_flags.launch_over(
                &self.ctx,
                self.stream,
                n.div_ceil(THREADS as u64),
                &mut args,
            )
        }
    }

    /// Adds the staging of tensor `index` into its master (assigns with `first`), with the
    /// add's flag on the window.
    pub(super) fn merge_whole(&self, w: &Whole, index: usize, first: bool) -> Result<()> {
        let start = self.plan.layout.range(index).start;
        let (master, staged) = (w.at(start), self.stage()?.ptr() + 4 * start as u64);
        let (numel, assign, found_inf) =
            (self.plan.descs[index].numel as u64, first as u32, self.found_inf.ptr());
        let mut args = launch_args!(master, staged, numel, assign, found_inf);
        // SAFETY: argument types follow ga_merge; both ranges are the tensor's, in buffers of the
        // layout's length.
        unsafe {
            self.kernels.merge.launch_over(
                &self.ctx,
                self.stream,
                numel.div_ceil(CHUNK as u64),
                &mut args,
            )
        }
    }

    /// Under SKIP_STEP with `tensor_stats`, the window's device counts start at zero.
    pub(super) fn zero_counts(&self) -> Result<()> {
        match &self.stats {
            Some(s) if self.counts_on_device() => s.counts.zero_f32(0, 2 * self.plan.descs.len()),
            _ => Ok(()),
        }
    }

    /// The last boundary's stats, once read.
    pub(super) fn last_stats(&self) -> Option<Vec<TensorStats>> {
        self.stats.as_ref()?.last.lock().clone()
    }
}

/// The buffer in `cell`, made by `make` at first use.
pub(in crate::backend::cuda) fn once(
    cell: &OnceLock<DeviceBuffer>,
    make: impl FnOnce() -> Result<DeviceBuffer>,
) -> Result<&DeviceBuffer> {
    if let Some(b) = cell.get() {
        return Ok(b);
    }
    let made = make()?;
    Ok(cell.get_or_init(|| made))
}
