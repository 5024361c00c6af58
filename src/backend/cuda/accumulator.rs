//! The accumulator on a CUDA device: the same windows, semantics and results as the CPU
//! accumulator (bitwise: the per-element math is shared, see kernels/math.cuh), with the FP32
//! master in device memory and every step enqueued on the caller's stream. The boundary reduces
//! the control words and the master buckets with NCCL and normalises, measures and clips on the
//! device; only calls that return values to the host wait for the stream, and they say so.
//!
//! A micro-batch opened with `begin_final_microbatch` ends the window: as its tensors arrive, each
//! bucket whose tensors have all arrived is all-reduced at once on a communication stream, so
//! the reduction overlaps the rest of the backward pass.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::driver::{check_stream, launch_args, CUdeviceptr, CUstream, Context, DeviceBuffer, Event, OwnedStream, SharedReads, THREADS};
use super::kernels::Kernels;
use super::layout::{GaBoundary, GaChunk, GaSource, GaSources, GaTensor, SOURCES_PER_LAUNCH};
use super::scaler::CudaScaler;
use crate::accumulator::{AccumulatorConfig, Layout, SyncInfo, TensorDesc};
use crate::backend::cpu::math::NORM_BLOCK;
use crate::comm::nccl::NcclComm;
use crate::error::{Error, ErrorKind, Result};

/// Elements per thread block of an add launch (a piece of one tensor): small enough that a tensor
/// of a million elements still spreads over every SM.
pub(crate) const CHUNK: usize = 8192;
/// NORM_BLOCKs per thread block of the sum-of-squares kernel (a half-warp each).
const NORM_BLOCKS_PER_CTA: u64 = THREADS as u64 / 16;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    Empty,
    Open,
    InMicrobatch {
        count: u64,
    },
    /// The boundary is enqueued.
    Synced,
}

struct Window {
    id: u64,
    phase: Phase,
    count: u64,
    microbatches: u64,
}

/// The final micro-batch's early bucket reductions.
struct Overlap {
    comm: Arc<NcclComm>,
    /// Tensors of each bucket still to arrive.
    missing: Vec<usize>,
    /// Tensors that arrived (a tensor's later contributions to a bucket not yet reduced are
    /// added, but count once).
    arrived: Vec<bool>,
    /// Buckets are launched in reverse order (backward produces the last tensors first), and
    /// only in that order, so every rank issues the same collectives in the same sequence.
    next: usize,
}

/// One `ga_add_multi` launch of an `add`: tensors `first..first + count` and their chunks, which
/// are consecutive in the chunk table (it lists tensor after tensor).
struct AddLaunch {
    first: usize,
    count: usize,
    first_chunk: usize,
    num_chunks: u64,
}

/// Mixed-precision accumulator with its FP32 master in CUDA device memory.
pub struct CudaAccumulator {
    ctx: Arc<Context>,
    kernels: Arc<Kernels>,
    stream: CUstream,
    config: AccumulatorConfig,
    descs: Vec<TensorDesc>,
    layout: Layout,
    master: DeviceBuffer,
    tensors: DeviceBuffer,
    chunks: DeviceBuffer,
    /// The `add` launches: up to SOURCES_PER_LAUNCH consecutive tensors each, with their chunks.
    launches: Vec<AddLaunch>,
    found_inf: DeviceBuffer,
    boundary: DeviceBuffer,
    partials: DeviceBuffer,
    layout_check: DeviceBuffer,
    written_in: Vec<AtomicU64>,
    tensor_locks: Vec<Mutex<()>>,
    window: RwLock<Window>,
    /// Communicators this accumulator's layout was verified against.
    verified: Mutex<Vec<u64>>,
    /// The final micro-batch's early reductions, from `begin_final_microbatch` to `sync`.
    overlap: Mutex<Option<Overlap>>,
    comm_stream: OnceLock<OwnedStream>,
    event: Mutex<Event>,
    /// The boundary is read by scalers' gathers on their streams: the next boundary (and the
    /// free) waits for those reads.
    boundary_reads: Mutex<SharedReads>,
}

// SAFETY: device addresses and the stream handle are used only through thread-safe driver calls;
// host state is behind locks.
unsafe impl Send for CudaAccumulator {}
unsafe impl Sync for CudaAccumulator {}

impl CudaAccumulator {
    /// An accumulator on device `ordinal` whose work is ordered on the caller's `stream`; the
    /// master is allocated on that stream (zeroed), or `adopt` is the caller's device buffer of
    /// exactly the total element count.
    pub fn new(
        config: AccumulatorConfig,
        tensors: &[TensorDesc],
        ordinal: i32,
        stream: CUstream,
        adopt: Option<(CUdeviceptr, usize)>,
    ) -> Result<Self> {
        check_stream(stream, "`stream`")?;
        config.validate()?;
        let layout = Layout::new(tensors, config.bucket_numel)?;
        let len = layout.len();
        let ctx = Context::get(ordinal)?;
        let kernels = Kernels::of(&ctx)?;
        let table: Vec<GaTensor> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| GaTensor { offset: layout.range(i).start as u64, numel: t.numel as u64, dtype: t.dtype.code(), pad: 0 })
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
        let launches = (0..tensors.len())
            .step_by(SOURCES_PER_LAUNCH)
            .map(|first| {
                let count = SOURCES_PER_LAUNCH.min(tensors.len() - first);
                let first_chunk = chunks.partition_point(|c| (c.tensor as usize) < first);
                let num_chunks = chunks[first_chunk..].partition_point(|c| (c.tensor as usize) < first + count) as u64;
                AddLaunch { first, count, first_chunk, num_chunks }
            })
            .collect();
        let master = match adopt {
            Some((ptr, numel)) => {
                if numel != len {
                    return Err(Error::new(ErrorKind::SizeMismatch, format!("master buffer holds {numel} elements, the tensors need {len}")));
                }
                if ptr == 0 || ptr % 4 != 0 {
                    return Err(Error::invalid(format!("master buffer {ptr:#x} is null or not 4-byte aligned")));
                }
                DeviceBuffer::adopt(&ctx, stream, ptr, len * 4)
            }
            None => DeviceBuffer::zeroed(&ctx, stream, len * 4)?,
        };
        Ok(CudaAccumulator {
            tensors: DeviceBuffer::from_slice(&ctx, stream, &table)?,
            chunks: DeviceBuffer::from_slice(&ctx, stream, &chunks)?,
            launches,
            found_inf: DeviceBuffer::zeroed(&ctx, stream, 4)?,
            boundary: DeviceBuffer::zeroed(&ctx, stream, std::mem::size_of::<GaBoundary>())?,
            partials: DeviceBuffer::zeroed(&ctx, stream, len.div_ceil(NORM_BLOCK) * 8)?,
            layout_check: DeviceBuffer::zeroed(&ctx, stream, 4 * 8)?,
            event: Mutex::new(Event::new(&ctx)?),
            boundary_reads: Mutex::new(SharedReads::new(&ctx, stream)?),
            master,
            written_in: tensors.iter().map(|_| AtomicU64::new(0)).collect(),
            tensor_locks: tensors.iter().map(|_| Mutex::new(())).collect(),
            window: RwLock::new(Window { id: 1, phase: Phase::Empty, count: 0, microbatches: 0 }),
            verified: Mutex::new(Vec::new()),
            overlap: Mutex::new(None),
            comm_stream: OnceLock::new(),
            ctx,
            kernels,
            stream,
            config,
            descs: tensors.to_vec(),
            layout,
        })
    }

    pub fn config(&self) -> &AccumulatorConfig {
        &self.config
    }

    pub fn tensors(&self) -> &[TensorDesc] {
        &self.descs
    }

    pub fn ordinal(&self) -> i32 {
        self.ctx.ordinal
    }

    pub fn stream(&self) -> CUstream {
        self.stream
    }

    pub fn buckets(&self) -> &[Range<usize>] {
        self.layout.buckets()
    }

    fn read(&self) -> RwLockReadGuard<'_, Window> {
        self.window.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Window> {
        self.window.write().unwrap_or_else(|e| e.into_inner())
    }

    fn overlap(&self) -> MutexGuard<'_, Option<Overlap>> {
        self.overlap.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_scaler(&self, scaler: &CudaScaler) -> Result<()> {
        if scaler.ordinal() != self.ctx.ordinal {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                format!("the scaler is on CUDA device {}, the accumulator on device {}", scaler.ordinal(), self.ctx.ordinal),
            ));
        }
        Ok(())
    }

    fn check_comm(&self, comm: &NcclComm) -> Result<()> {
        if comm.ordinal() != self.ctx.ordinal {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                format!("the communicator is on CUDA device {}, the accumulator on device {}", comm.ordinal(), self.ctx.ordinal),
            ));
        }
        Ok(())
    }

    /// Adds one micro-batch: `grads[i]` is the device address of tensor i's gradient (numel and
    /// dtype as declared), scaled by `scaler`'s current scale. One launch per SOURCES_PER_LAUNCH
    /// tensors (one for most models).
    /// Enqueued on the accumulator's stream; returns without waiting.
    pub fn add(&self, scaler: &CudaScaler, grads: &[CUdeviceptr], count: u64) -> Result<()> {
        let mut w = self.write();
        if matches!(w.phase, Phase::InMicrobatch { .. }) {
            return Err(Error::wrong_state("add inside begin_microbatch/end_microbatch: use add_tensor, or end the micro-batch first"));
        }
        self.check_not_after_final()?;
        if grads.len() != self.descs.len() {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("add got {} gradients, the accumulator has {} tensors", grads.len(), self.descs.len()),
            ));
        }
        for (i, (&g, d)) in grads.iter().zip(&self.descs).enumerate() {
            check_grad_ptr(g, d, || format!("grads[{i}]"))?;
        }
        self.check_count(&w, count)?;
        self.check_scaler(scaler)?;
        self.start_window_if_synced(&mut w)?;
        // The gradient addresses travel as a kernel parameter, copied by the launch: no per-call
        // copy from host memory, so a step's adds can be captured into a CUDA graph.
        let f = self.kernels.add_multi;
        let (tensors, master, weight, found_inf) = (self.tensors.ptr(), self.master.ptr(), self.config.weight(count), self.found_inf.ptr());
        for launch in &self.launches {
            let mut sources =
                GaSources { first_tensor: launch.first as u64, count: launch.count as u64, s: [GaSource::default(); SOURCES_PER_LAUNCH] };
            for (slot, i) in sources.s.iter_mut().zip(launch.first..launch.first + launch.count) {
                *slot = GaSource { grad: grads[i], assign: (self.written_in[i].load(Ordering::Relaxed) != w.id) as u32, pad: 0 };
            }
            let chunks = self.chunks.ptr() + (launch.first_chunk * std::mem::size_of::<GaChunk>()) as u64;
            let num_chunks = launch.num_chunks;
            scaler.launch_reading(self.stream, |state| {
                let mut args = launch_args!(tensors, chunks, num_chunks, sources, master, state, weight, found_inf);
                // SAFETY: argument types follow ga_add_multi (`sources` by value); the chunk range
                // is this launch's tensors', tables and master were sized at creation, and the
                // gradient addresses hold their tensors' numel values (the caller's contract).
                unsafe { f.launch(&self.ctx, self.ctx.grid_for(num_chunks), THREADS, self.stream, &mut args) }
            })?;
        }
        for slot in &self.written_in {
            slot.store(w.id, Ordering::Relaxed);
        }
        w.count += count;
        w.microbatches += 1;
        w.phase = Phase::Open;
        Ok(())
    }

    /// Opens a micro-batch of `count` items whose tensors arrive one by one through `add_tensor`.
    pub fn begin_microbatch(&self, count: u64) -> Result<()> {
        self.begin(count, None)
    }

    /// Opens the window's last micro-batch: each bucket is all-reduced over `comm` as soon as all
    /// of its tensors have arrived (one contribution each), overlapping the rest of the backward
    /// pass; `sync` over the same `comm` completes the boundary. Every rank must do the same.
    pub fn begin_final_microbatch(&self, count: u64, comm: Arc<NcclComm>) -> Result<()> {
        self.check_comm(&comm)?;
        self.begin(count, Some(comm))
    }

    fn begin(&self, count: u64, comm: Option<Arc<NcclComm>>) -> Result<()> {
        let mut w = self.write();
        if matches!(w.phase, Phase::InMicrobatch { .. }) {
            return Err(Error::wrong_state("begin_microbatch while a micro-batch is open: call end_microbatch first"));
        }
        self.check_not_after_final()?;
        self.check_count(&w, count)?;
        if let Some(c) = &comm {
            self.verify_layout(c)?;
            self.comm_stream()?;
        }
        self.start_window_if_synced(&mut w)?;
        if let Some(comm) = comm {
            // A bucket is reduced early only once each of its tensors arrived in this
            // micro-batch, so no tensor of it can be stale: nothing needs zeroing first.
            let mut missing = vec![0; self.layout.buckets().len()];
            for i in 0..self.descs.len() {
                missing[self.layout.bucket_of(i)] += 1;
            }
            let next = missing.len();
            *self.overlap() = Some(Overlap { comm, missing, arrived: vec![false; self.descs.len()], next });
        }
        w.phase = Phase::InMicrobatch { count };
        Ok(())
    }

    /// Adds one contribution to tensor `index` of the open micro-batch (device address `grad`).
    /// Callable from several threads at once.
    pub fn add_tensor(&self, scaler: &CudaScaler, index: usize, grad: CUdeviceptr) -> Result<()> {
        let w = self.read();
        let Phase::InMicrobatch { count } = w.phase else {
            return Err(Error::wrong_state("add_tensor outside a micro-batch: call begin_microbatch first"));
        };
        self.layout.check_index(index)?;
        let desc = self.descs[index];
        check_grad_ptr(grad, &desc, || "grad".into())?;
        self.check_scaler(scaler)?;
        let _tensor = self.tensor_locks[index].lock().unwrap_or_else(|e| e.into_inner());
        let first_in_window = self.written_in[index].load(Ordering::Relaxed) != w.id;
        let mut overlap = self.overlap();
        if let Some(o) = overlap.as_ref() {
            if o.next <= self.layout.bucket_of(index) {
                return Err(Error::wrong_state(format!(
                    "tensor {index} got a second contribution in the final micro-batch after its bucket's all-reduce started"
                )));
            }
        }
        let f = self.kernels.add_one;
        let master = self.master.ptr() + 4 * self.layout.range(index).start as u64;
        let (numel, dtype, weight, assign, found_inf) =
            (desc.numel as u64, desc.dtype.code(), self.config.weight(count), first_in_window as u32, self.found_inf.ptr());
        scaler.launch_reading(self.stream, |state| {
            let mut args = launch_args!(master, grad, numel, dtype, state, weight, assign, found_inf);
            // SAFETY: argument types follow ga_add_one; the master range is the tensor's.
            unsafe { f.launch(&self.ctx, self.ctx.grid_for(numel.div_ceil(CHUNK as u64)), THREADS, self.stream, &mut args) }
        })?;
        self.written_in[index].store(w.id, Ordering::Relaxed);
        if let Some(o) = overlap.as_mut() {
            self.tensor_arrived(o, index)?;
        }
        Ok(())
    }

    /// Counts a final-micro-batch tensor in and launches every bucket that is ready, in order.
    fn tensor_arrived(&self, o: &mut Overlap, index: usize) -> Result<()> {
        if std::mem::replace(&mut o.arrived[index], true) {
            return Ok(());
        }
        let b = self.layout.bucket_of(index);
        o.missing[b] -= 1;
        let comm_stream = self.comm_stream()?.stream;
        while o.next > 0 && o.missing[o.next - 1] == 0 {
            o.next -= 1;
            let bucket = &self.layout.buckets()[o.next];
            self.event.lock().unwrap_or_else(|e| e.into_inner()).order(self.stream, comm_stream)?;
            o.comm.allreduce_sum_f32(self.master.ptr() + 4 * bucket.start as u64, bucket.len(), comm_stream)?;
        }
        Ok(())
    }

    /// Closes the open micro-batch.
    pub fn end_microbatch(&self) -> Result<()> {
        let mut w = self.write();
        let Phase::InMicrobatch { count, .. } = w.phase else {
            return Err(Error::wrong_state("end_microbatch without begin_microbatch"));
        };
        w.count += count;
        w.microbatches += 1;
        w.phase = Phase::Open;
        Ok(())
    }

    /// The boundary, enqueued on the accumulator's stream: with `comm`, the control words and
    /// every master bucket (not already reduced by a final micro-batch) are summed over the
    /// ranks; then normalise, norm and clip on the device. With `read`, waits for the stream and
    /// returns the info (and EMPTY_WINDOW for a window empty on every rank); without, returns
    /// at once and the info stays on the device for the scaler.
    ///
    /// A call that fails before communicating (sync inside a micro-batch, a device mismatch)
    /// leaves the other ranks waiting inside NCCL, as any NCCL program: abort the communicator.
    pub fn sync(&self, comm: Option<&NcclComm>, read: bool) -> Result<Option<SyncInfo>> {
        let mut w = self.write();
        if matches!(w.phase, Phase::InMicrobatch { .. }) {
            return Err(Error::wrong_state("sync inside a micro-batch: call end_microbatch first"));
        }
        let comm = {
            let overlap = self.overlap();
            match (comm, overlap.as_ref()) {
                (Some(c), Some(o)) if c.id() != o.comm.id() => {
                    return Err(Error::invalid("sync got another communicator than the final micro-batch's"));
                }
                (Some(c), _) => {
                    self.check_comm(c)?;
                    drop(overlap);
                    self.verify_layout(c)?;
                    Some(c)
                }
                (None, Some(_)) => return Err(Error::invalid("`comm` is NULL, but the final micro-batch was opened with a communicator")),
                (None, None) => None,
            }
        };
        let world = comm.map_or(1, |c| c.world_size()) as u64;
        // A sync right after a sync closes a new, empty window (the rank still takes part).
        let empty_again = w.phase == Phase::Synced;
        if world == 1 {
            // Everything is local: the empty-window error can be told before any work, and
            // leaves the window as it was.
            let (count, microbatches) = if empty_again { (0, 0) } else { (w.count, w.microbatches) };
            if microbatches == 0 || self.config.normalize.divisor(count, microbatches, 1) == 0 {
                return Err(Error::new(ErrorKind::EmptyWindow, "sync on an empty window: no micro-batch, or an item count of 0"));
            }
        }
        // Every check passed: from here on the window is consumed, and a failure discards it, as
        // the CPU path does (a retry must not reduce a bucket twice).
        let result = self.run_boundary(&mut w, comm, empty_again, world);
        if result.is_err() {
            let _ = self.discard(&mut w);
            return result.map(|_| None);
        }
        w.phase = Phase::Synced;
        if !read {
            return Ok(None);
        }
        let info = self.read_info()?;
        // An abort (or a peer's failure) ends the collectives the read waited for without
        // reducing: the values read are not the boundary's.
        if let Err(e) = comm.map_or(Ok(()), NcclComm::health) {
            self.discard(&mut w)?;
            return Err(e);
        }
        match info {
            Some(info) => Ok(Some(info)),
            None => {
                self.discard(&mut w)?;
                Err(Error::new(ErrorKind::EmptyWindow, "sync on an empty window: no rank added a micro-batch, or the global item count is 0"))
            }
        }
    }

    /// The boundary's device work: the control words and the buckets not reduced early, then
    /// normalise, norm and clip.
    fn run_boundary(&self, w: &mut Window, comm: Option<&NcclComm>, empty_again: bool, world: u64) -> Result<()> {
        // The boundary is rewritten: after the scalers' gathers of the last one.
        let mut reads = self.boundary_reads();
        reads.before_write()?;
        let result = self.enqueue_boundary(w, comm, empty_again, world);
        // Recorded even after a failure: part of the boundary may be enqueued.
        reads.after_write()?;
        result
    }

    fn enqueue_boundary(&self, w: &mut Window, comm: Option<&NcclComm>, empty_again: bool, world: u64) -> Result<()> {
        let overlap = self.overlap().take();
        if let Some(o) = &overlap {
            self.finish_overlap(o)?;
        }
        if empty_again {
            self.discard(w)?;
        }
        self.zero_untouched(w)?;
        let boundary = self.boundary.ptr();
        let (count, microbatches, found_inf) = (w.count, w.microbatches, self.found_inf.ptr());
        let mut args = launch_args!(boundary, count, microbatches, found_inf);
        // SAFETY: argument types follow ga_pack_control.
        unsafe { self.kernels.pack_control.launch(&self.ctx, 1, 1, self.stream, &mut args)? };
        // Also at world size 1: NCCL then copies in place, and the path is the one every rank takes.
        if let Some(c) = comm {
            let reduced_early = overlap.as_ref().map_or(self.layout.buckets().len(), |o| o.next);
            c.group(|| {
                c.allreduce_u64(boundary, 3, false, self.stream)?;
                for b in &self.layout.buckets()[..reduced_early] {
                    c.allreduce_sum_f32(self.master.ptr() + 4 * b.start as u64, b.len(), self.stream)?;
                }
                Ok(())
            })?;
        }
        self.finish_boundary(world)
    }

    /// Normalise, norm and clip, on the device, from the reduced control words.
    fn finish_boundary(&self, world: u64) -> Result<()> {
        let n = self.layout.len() as u64;
        let num_blocks = n.div_ceil(NORM_BLOCK as u64);
        let max_norm = self.config.max_grad_norm as f64;
        let (boundary, master, partials) = (self.boundary.ptr(), self.master.ptr(), self.partials.ptr());
        let normalize_code = self.config.normalize.code();
        // Without clipping the normalisation is applied with the norm pass; with clipping the
        // norm decides the factor, so a second pass applies it.
        let normalize_now: i32 = (max_norm == 0.0) as i32;
        // SAFETY (all launches): argument types follow the kernels; buffers were sized at creation.
        unsafe {
            let mut args = launch_args!(boundary, normalize_code, world);
            self.kernels.begin_boundary.launch(&self.ctx, 1, 1, self.stream, &mut args)?;
            let mut args = launch_args!(master, n, boundary, normalize_now, partials);
            let grid = self.ctx.grid_for(num_blocks.div_ceil(NORM_BLOCKS_PER_CTA));
            self.kernels.scale_sum_squares.launch(&self.ctx, grid, THREADS, self.stream, &mut args)?;
            let mut args = launch_args!(boundary, partials, num_blocks, max_norm);
            self.kernels.finish_norm.launch(&self.ctx, 1, THREADS, self.stream, &mut args)?;
            if max_norm != 0.0 {
                let mut args = launch_args!(master, n, boundary);
                self.kernels.scale_by.launch(&self.ctx, self.ctx.grid_for(n.div_ceil(THREADS as u64)), THREADS, self.stream, &mut args)?;
            }
        }
        Ok(())
    }

    /// Reads the boundary's result (waits for the stream); None for an empty window.
    fn read_info(&self) -> Result<Option<SyncInfo>> {
        let mut b = [GaBoundary::default()];
        self.boundary.read(&mut b)?;
        let b = b[0];
        if b.empty != 0 {
            return Ok(None);
        }
        Ok(Some(SyncInfo {
            found_inf: b.found_inf != 0,
            total_count: b.count,
            microbatches: b.microbatches,
            grad_norm: b.grad_norm,
            clip_coef: b.clip_coef,
        }))
    }

    /// Device address of the synced boundary (for the scaler's update), or None when the window
    /// is not synced.
    pub fn synced_boundary(&self) -> Option<CUdeviceptr> {
        (self.read().phase == Phase::Synced).then(|| self.boundary.ptr())
    }

    /// Enqueues `scaler`'s gather of the synced window's agreed overflow flag (for its next
    /// update), on the scaler's stream: after the boundary is written, and before the next
    /// boundary or the free overwrites it.
    pub fn gather_into(&self, scaler: &CudaScaler) -> Result<()> {
        self.check_scaler(scaler)?;
        let w = self.read();
        if w.phase != Phase::Synced {
            return Err(Error::wrong_state("the accumulator has not been synced in its current window: call sync first"));
        }
        let mut reads = self.boundary_reads();
        reads.before_read(scaler.stream())?;
        scaler.gather_ordered(self.boundary.ptr())?;
        reads.after_read(scaler.stream())
    }

    fn boundary_reads(&self) -> MutexGuard<'_, SharedReads> {
        self.boundary_reads.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Discards the window in progress (or the synced result).
    pub fn reset(&self) -> Result<()> {
        let mut w = self.write();
        if let Some(o) = self.overlap().take() {
            self.finish_overlap(&o)?;
        }
        self.discard(&mut w)
    }

    /// Device address of tensor `index`'s master gradient and its length.
    pub fn master_ptr(&self, index: usize) -> Result<(CUdeviceptr, usize)> {
        self.layout.check_index(index)?;
        Ok((self.master.ptr() + 4 * self.layout.range(index).start as u64, self.descs[index].numel))
    }

    /// Copies tensor `index`'s master gradient to the host (waits for the stream).
    pub fn read_master(&self, index: usize, out: &mut [f32]) -> Result<()> {
        let (_, len) = self.master_ptr(index)?;
        if out.len() != len {
            return Err(Error::new(ErrorKind::SizeMismatch, format!("output holds {} values, tensor {index} has {len}", out.len())));
        }
        let _w = self.write();
        self.master.read_at(4 * self.layout.range(index).start, out)
    }

    fn zero_untouched(&self, w: &Window) -> Result<()> {
        for (i, slot) in self.written_in.iter().enumerate() {
            if slot.load(Ordering::Relaxed) != w.id {
                self.master.zero_f32(self.layout.range(i).start, self.descs[i].numel)?;
                slot.store(w.id, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    fn discard(&self, w: &mut Window) -> Result<()> {
        *w = Window { id: w.id + 1, phase: Phase::Empty, count: 0, microbatches: 0 };
        self.found_inf.zero_f32(0, 1)
    }

    fn start_window_if_synced(&self, w: &mut Window) -> Result<()> {
        if w.phase == Phase::Synced {
            self.discard(w)?;
        }
        Ok(())
    }

    fn check_count(&self, w: &Window, count: u64) -> Result<()> {
        self.config.check_count(if w.phase == Phase::Synced { 0 } else { w.count }, count)
    }

    fn comm_stream(&self) -> Result<&OwnedStream> {
        if let Some(s) = self.comm_stream.get() {
            return Ok(s);
        }
        let created = OwnedStream::new(&self.ctx)?;
        Ok(self.comm_stream.get_or_init(|| created))
    }

    /// Refuses a new micro-batch after the final one: its buckets are already reduced.
    fn check_not_after_final(&self) -> Result<()> {
        if self.overlap().is_some() {
            return Err(Error::wrong_state("the window's final micro-batch has ended: call sync (or reset) before adding more"));
        }
        Ok(())
    }

    /// Makes the accumulator's stream wait for the early reductions on the communication stream.
    fn finish_overlap(&self, _: &Overlap) -> Result<()> {
        let comm_stream = self.comm_stream()?.stream;
        self.event.lock().unwrap_or_else(|e| e.into_inner()).order(comm_stream, self.stream)
    }

    /// Once per communicator: every rank checks that all ranks have the same layout (a blocking
    /// exchange of the element count and the layout hash, with their complements, by MAX), so a
    /// mismatch fails on every rank instead of corrupting memory inside NCCL.
    fn verify_layout(&self, comm: &NcclComm) -> Result<()> {
        let mut verified = self.verified.lock().unwrap_or_else(|e| e.into_inner());
        if verified.contains(&comm.id()) {
            return Ok(());
        }
        let (numel, hash) = (self.layout.len() as u64, self.layout.hash());
        let mine = [numel, hash, !numel, !hash];
        self.layout_check.write(&mine)?;
        comm.allreduce_u64(self.layout_check.ptr(), 4, true, self.stream)?;
        let mut max = [0u64; 4];
        self.layout_check.read(&mut max)?;
        comm.health()?;
        let (max_numel, max_hash, min_numel, min_hash) = (max[0], max[1], !max[2], !max[3]);
        if max_numel != min_numel || max_hash != min_hash {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("ranks' accumulators differ (element counts from {min_numel} to {max_numel}, or a different tensor layout); no rank reduced"),
            ));
        }
        verified.push(comm.id());
        Ok(())
    }
}

/// A device gradient address: non-null and aligned for its dtype.
/// `argument` names it in the error, and is only formatted when a check fails.
fn check_grad_ptr(ptr: CUdeviceptr, d: &TensorDesc, argument: impl FnOnce() -> String) -> Result<()> {
    if ptr == 0 {
        return Err(Error::new(ErrorKind::NullArgument, format!("argument `{}` is NULL", argument())));
    }
    if ptr & (d.dtype.size() as u64 - 1) != 0 {
        return Err(Error::invalid(format!("`{}` = {ptr:#x} is not aligned to {} bytes for {}", argument(), d.dtype.size(), d.dtype.name())));
    }
    Ok(())
}

impl Drop for CudaAccumulator {
    fn drop(&mut self) {
        // Pending early reductions read the master, and scalers' gathers the boundary: let the
        // stream order the frees after them.
        if let Some(o) = self.overlap().take() {
            let _ = self.finish_overlap(&o);
        }
        let _ = self.boundary_reads().before_write();
    }
}
