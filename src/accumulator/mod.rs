//! The accumulator: FP32 master gradients for a set of tensors, filled micro-batch by micro-batch
//! in one fused pass each, and turned at the boundary into the normalised, all-reduced, clipped
//! gradient of the whole effective batch, identical on every rank.

mod config;
mod layout;
mod master;

pub use config::{AccumulatorConfig, LossReduction, Normalize, TensorDesc};

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::backend::cpu::{self, math};
use crate::comm::{BlockPass, Communicator, Control, ControlSum};
use crate::dtype::Grad;
use crate::error::{Error, ErrorKind, Result};
use crate::scaler::Scaler;
use crate::state;
pub(crate) use layout::Layout;
use master::Master;

const WINDOW_MAGIC: [u8; 4] = *b"GAWN";
/// 2: the layout fingerprint covers tensor offsets, lengths and dtypes as well as buckets.
const WINDOW_VERSION: u32 = 2;

/// What the boundary reports; identical on every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SyncInfo {
    /// Some rank saw a non-finite value in this window: the optimizer step must be skipped.
    pub found_inf: bool,
    /// Items added over all micro-batches and ranks.
    pub total_count: u64,
    /// Micro-batches added over all ranks.
    pub microbatches: u64,
    /// Global L2 norm of the normalised gradient, before clipping.
    pub grad_norm: f64,
    /// Factor applied by clipping (1 when clipping is off or not needed).
    pub clip_coef: f64,
}

/// Where the window stands.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// No micro-batch yet.
    Empty,
    /// At least one micro-batch added.
    Open,
    /// Between `begin_microbatch(count)` and `end_microbatch()`.
    InMicrobatch { count: u64 },
    /// The boundary ran; masters hold the result until the next micro-batch opens a new window.
    Synced(SyncInfo),
}

#[derive(Debug)]
struct Window {
    /// Identifies the window; a tensor last written in another window reads as zero.
    id: u64,
    phase: Phase,
    count: u64,
    microbatches: u64,
}

/// Mixed-precision gradient accumulator over a fixed list of tensors.
///
/// `add`, `begin_microbatch`/`end_microbatch`, `sync` and `reset` serialise on the window.
/// `add_tensor` may run concurrently from several threads: distinct tensors in parallel, several
/// contributions to one tensor one after another.
#[derive(Debug)]
pub struct Accumulator {
    config: AccumulatorConfig,
    descs: Vec<TensorDesc>,
    layout: Layout,
    master: Master,
    /// The window id in which each tensor was last written.
    written_in: Vec<AtomicU64>,
    /// Serialises contributions to one tensor from `add_tensor` callers on different threads.
    tensor_locks: Vec<Mutex<()>>,
    /// The window's sticky non-finite flag (set by concurrent `add_tensor` callers).
    found_inf: AtomicBool,
    window: RwLock<Window>,
}

impl Accumulator {
    /// An accumulator that owns its master buffer.
    pub fn new(config: AccumulatorConfig, tensors: &[TensorDesc]) -> Result<Self> {
        let layout = Layout::new(tensors, config.bucket_numel)?;
        let master = Master::owned(layout.len())?;
        Self::build(config, tensors, layout, master)
    }

    /// An accumulator that adopts a caller's FP32 buffer of exactly the total element count as its
    /// master buffer.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` f32 values, and used by nothing else
    /// while the accumulator is alive except through the accumulator's own accessors.
    pub unsafe fn with_buffer(config: AccumulatorConfig, tensors: &[TensorDesc], ptr: *mut f32, len: usize) -> Result<Self> {
        let layout = Layout::new(tensors, config.bucket_numel)?;
        let want = layout.len();
        if ptr.is_null() {
            return Err(Error::new(ErrorKind::NullArgument, "master buffer is null"));
        }
        if len != want {
            return Err(Error::new(ErrorKind::SizeMismatch, format!("master buffer holds {len} elements, the tensors need {want}")));
        }
        if ptr.align_offset(std::mem::align_of::<f32>()) != 0 {
            return Err(Error::invalid(format!("master buffer {ptr:p} is not 4-byte aligned")));
        }
        Self::build(config, tensors, layout, Master::borrowed(ptr, len))
    }

    fn build(config: AccumulatorConfig, tensors: &[TensorDesc], layout: Layout, master: Master) -> Result<Self> {
        config.validate()?;
        Ok(Accumulator {
            config,
            descs: tensors.to_vec(),
            layout,
            master,
            written_in: tensors.iter().map(|_| AtomicU64::new(0)).collect(),
            tensor_locks: tensors.iter().map(|_| Mutex::new(())).collect(),
            found_inf: AtomicBool::new(false),
            window: RwLock::new(Window { id: 1, phase: Phase::Empty, count: 0, microbatches: 0 }),
        })
    }

    pub fn config(&self) -> &AccumulatorConfig {
        &self.config
    }

    pub fn tensors(&self) -> &[TensorDesc] {
        &self.descs
    }

    /// Total elements of the master buffer.
    pub fn len(&self) -> usize {
        self.master.len()
    }

    pub fn is_empty(&self) -> bool {
        self.master.len() == 0
    }

    /// Element ranges of the communication buckets.
    pub fn buckets(&self) -> &[Range<usize>] {
        self.layout.buckets()
    }

    fn read(&self) -> RwLockReadGuard<'_, Window> {
        // Window updates are single assignments after all checks, so a poisoned lock still holds
        // a consistent window.
        self.window.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Window> {
        self.window.write().unwrap_or_else(|e| e.into_inner())
    }

    fn range(&self, index: usize) -> Range<usize> {
        self.layout.range(index)
    }

    /// Adds one micro-batch: every tensor's gradient, scaled by `scaler`'s current scale, for
    /// `count` items. Fails without changing anything on a wrong tensor count, length or dtype.
    pub fn add(&self, scaler: &Scaler, grads: &[Grad<'_>], count: u64) -> Result<()> {
        let mut w = self.write();
        if matches!(w.phase, Phase::InMicrobatch { .. }) {
            return Err(Error::wrong_state("add inside begin_microbatch/end_microbatch: use add_tensor, or end the micro-batch first"));
        }
        if grads.len() != self.descs.len() {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("add got {} gradients, the accumulator has {} tensors", grads.len(), self.descs.len()),
            ));
        }
        for (i, g) in grads.iter().enumerate() {
            self.check_grad(i, g)?;
        }
        self.check_count(&w, count)?;
        self.start_window_if_synced(&mut w);
        let factor = self.factor(scaler, count);
        let mut passes = Vec::with_capacity(grads.len());
        for (i, g) in grads.iter().enumerate() {
            // SAFETY: the window's write lock excludes every other writer of the master buffer,
            // and the tensors' ranges do not overlap.
            let master = unsafe { self.master.slice_mut(self.range(i)) };
            // A load and a store rather than a swap: the write lock excludes every other writer, and
            // a locked exchange per tensor showed in the per-call cost of many small tensors.
            let assign = self.written_in[i].load(Ordering::Relaxed) != w.id;
            if assign {
                self.written_in[i].store(w.id, Ordering::Relaxed);
            }
            passes.push(cpu::TensorPass { master, grad: *g, assign });
        }
        // One pass over all tensors: the threads share the micro-batch, not each large tensor.
        let bad = cpu::accumulate_many(passes, factor, self.config.threads);
        if bad {
            self.found_inf.store(true, Ordering::Relaxed);
        }
        w.count += count;
        w.microbatches += 1;
        w.phase = Phase::Open;
        Ok(())
    }

    /// Opens a micro-batch of `count` items whose tensors arrive one by one through `add_tensor`.
    pub fn begin_microbatch(&self, count: u64) -> Result<()> {
        let mut w = self.write();
        if matches!(w.phase, Phase::InMicrobatch { .. }) {
            return Err(Error::wrong_state("begin_microbatch while a micro-batch is open: call end_microbatch first"));
        }
        self.check_count(&w, count)?;
        self.start_window_if_synced(&mut w);
        w.phase = Phase::InMicrobatch { count };
        Ok(())
    }

    /// Adds one contribution to tensor `index` in the open micro-batch. Callable from several
    /// threads at once; a tensor may receive several contributions (a chunked backward).
    pub fn add_tensor(&self, scaler: &Scaler, index: usize, grad: Grad<'_>) -> Result<()> {
        let w = self.read();
        let Phase::InMicrobatch { count } = w.phase else {
            return Err(Error::wrong_state("add_tensor outside a micro-batch: call begin_microbatch first"));
        };
        self.layout.check_index(index)?;
        self.check_grad(index, &grad)?;
        let factor = self.factor(scaler, count);
        let _tensor = self.tensor_locks[index].lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the window's read lock excludes `add`/`sync`/`reset`, and the tensor lock
        // excludes other `add_tensor` callers on this tensor; tensors never overlap.
        let m = unsafe { self.master.slice_mut(self.range(index)) };
        let assign = self.written_in[index].load(Ordering::Relaxed) != w.id;
        let bad = cpu::accumulate(m, grad, factor, assign, self.config.threads);
        self.written_in[index].store(w.id, Ordering::Relaxed);
        if bad {
            self.found_inf.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Closes the open micro-batch; its count and one micro-batch join the window.
    pub fn end_microbatch(&self) -> Result<()> {
        let mut w = self.write();
        let Phase::InMicrobatch { count } = w.phase else {
            return Err(Error::wrong_state("end_microbatch without begin_microbatch"));
        };
        w.count += count;
        w.microbatches += 1;
        w.phase = Phase::Open;
        Ok(())
    }

    /// The boundary. With a communicator, every rank of its group must call it: the control
    /// values are reduced first (so ranks agree on counts and overflow, and all fail together if
    /// any rank's call is invalid), then the master buffer is summed bucket by bucket, normalised,
    /// measured and clipped. `None` is the single-process boundary.
    pub fn sync(&self, comm: Option<&dyn Communicator>) -> Result<SyncInfo> {
        let mut w = self.write();
        let local_error = match w.phase {
            Phase::InMicrobatch { .. } => Some(Error::wrong_state("sync inside a micro-batch: call end_microbatch first")),
            _ => None,
        };
        // A sync right after a sync closes a new, empty window: a rank with no micro-batch this
        // time still takes part in the boundary of the others.
        let empty_again = matches!(w.phase, Phase::Synced(_));
        let mine = if empty_again {
            Control { numel: self.len() as u64, layout: self.layout.hash(), ..Default::default() }
        } else {
            Control {
                numel: self.len() as u64,
                layout: self.layout.hash(),
                count: w.count,
                microbatches: w.microbatches,
                found_inf: self.found_inf.load(Ordering::Relaxed),
                error: local_error.is_some(),
            }
        };
        let (total, world) = match comm {
            Some(c) => (c.reduce_control(&mine)?, c.world_size()),
            None => (ControlSum::of(&mine), 1),
        };
        if let Some(e) = local_error {
            return Err(e);
        }
        check_agreement(&total)?;
        let divisor = self.config.normalize.divisor(total.count, total.microbatches, world as u64);
        if divisor == 0 {
            return Err(Error::new(ErrorKind::EmptyWindow, "the window's global item count is 0: nothing to normalise by"));
        }

        // From here on the window is consumed: every rank passed the same checks.
        if empty_again {
            self.discard(&mut w);
        }
        for i in 0..self.descs.len() {
            if self.written_in[i].load(Ordering::Relaxed) != w.id {
                // SAFETY: the write lock is held.
                unsafe { self.master.slice_mut(self.range(i)) }.fill(0.0);
            }
        }
        // SAFETY: the write lock is held for the rest of the call.
        let all = unsafe { self.master.slice_mut(0..self.len()) };
        let threads = self.config.threads;
        let max = self.config.max_grad_norm as f64;
        let normalize = (1.0 / divisor as f64) as f32;
        // Without clipping the factor is known before the norm, so the pass that measures each
        // block also normalises it. With clipping the factor depends on the norm: the pass only
        // measures, and a second pass scales when the norm calls for it.
        let pass = NormPass { factor: (max == 0.0 && normalize != 1.0).then_some(normalize), threads };
        let block_sums = match comm.filter(|c| c.world_size() > 1) {
            // The communicator runs the pass on the sum, possibly share by share as it completes.
            Some(c) => match c.allreduce_with_pass(all, self.layout.buckets(), &pass) {
                Ok(sums) => sums,
                Err(e) => {
                    self.discard(&mut w);
                    return Err(Error::new(e.kind, format!("{} (the window was discarded)", e.message)));
                }
            },
            None => {
                let mut sums = vec![0.0; cpu::blocks(all.len())];
                pass.run(all, &mut sums);
                sums
            }
        };
        let grad_norm = cpu::fold_block_sums(&block_sums).sqrt() / divisor as f64;
        let clip_coef = if max == 0.0 || !grad_norm.is_finite() { 1.0 } else { (max / (grad_norm + 1e-6)).min(1.0) };
        if max != 0.0 {
            let factor = (clip_coef / divisor as f64) as f32;
            if factor != 1.0 {
                cpu::scale(all, factor, threads);
            }
        }
        let info = SyncInfo { found_inf: total.found_inf, total_count: total.count, microbatches: total.microbatches, grad_norm, clip_coef };
        self.found_inf.store(total.found_inf, Ordering::Relaxed);
        w.phase = Phase::Synced(info);
        Ok(info)
    }

    /// The last boundary's result, while the window is still synced.
    pub fn synced_info(&self) -> Option<SyncInfo> {
        match self.read().phase {
            Phase::Synced(info) => Some(info),
            _ => None,
        }
    }

    /// Discards the window in progress (or the synced result): the next micro-batch starts afresh.
    pub fn reset(&self) {
        let mut w = self.write();
        self.discard(&mut w);
    }

    /// Runs `f` on tensor `index`'s FP32 master gradient (all zeros for a tensor that received
    /// nothing in a synced window).
    pub fn with_master<R>(&self, index: usize, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        self.layout.check_index(index)?;
        let _w = self.write();
        // SAFETY: the write lock excludes every writer.
        Ok(f(unsafe { self.master.slice_mut(self.range(index)) }))
    }

    /// Raw pointer to tensor `index`'s master gradient and its length, for callers across the C
    /// boundary. The buffer never moves while the accumulator lives.
    pub fn master_ptr(&self, index: usize) -> Result<(*mut f32, usize)> {
        self.layout.check_index(index)?;
        let r = self.range(index);
        Ok((self.master.ptr_at(r.start), r.len()))
    }

    /// The window in progress (masters, counts, micro-batches, overflow flag, which tensors were
    /// written) as versioned bytes: a checkpoint in the middle of accumulation.
    pub fn save_window(&self) -> Result<Vec<u8>> {
        let w = self.write();
        if !matches!(w.phase, Phase::Empty | Phase::Open) {
            return Err(Error::wrong_state("save_window needs a window between micro-batches (not inside one, not synced)"));
        }
        let mut out = state::Writer::new(WINDOW_MAGIC, WINDOW_VERSION);
        out.u64(self.layout.hash()).u64(w.count).u64(w.microbatches).bool(self.found_inf.load(Ordering::Relaxed));
        for written in &self.written_in {
            out.bool(written.load(Ordering::Relaxed) == w.id);
        }
        // SAFETY: the write lock is held.
        out.f32s(unsafe { self.master.slice_mut(0..self.len()) });
        Ok(out.finish())
    }

    /// Restores a window written by [`Accumulator::save_window`] of an accumulator with the same
    /// layout. Corrupt or foreign bytes are rejected and leave the accumulator unchanged.
    pub fn load_window(&self, bytes: &[u8]) -> Result<()> {
        let mut w = self.write();
        if matches!(w.phase, Phase::InMicrobatch { .. }) {
            return Err(Error::wrong_state("load_window inside a micro-batch: call end_microbatch or reset first"));
        }
        let mut r = state::Reader::open("accumulator window", bytes, WINDOW_MAGIC, WINDOW_VERSION)?;
        if r.u64()? != self.layout.hash() {
            return Err(Error::new(ErrorKind::SizeMismatch, "accumulator window: saved from an accumulator with another tensor layout"));
        }
        let (count, microbatches, found_inf) = (r.u64()?, r.u64()?, r.bool()?);
        let written: Vec<bool> = (0..self.descs.len()).map(|_| r.bool()).collect::<Result<_>>()?;
        let mut values = Vec::new();
        r.f32s_into(&mut values, self.len())?;
        r.finish()?;
        let id = w.id + 1;
        for (slot, &was_written) in self.written_in.iter().zip(&written) {
            slot.store(if was_written { id } else { 0 }, Ordering::Relaxed);
        }
        // SAFETY: the write lock is held.
        unsafe { self.master.slice_mut(0..self.len()) }.copy_from_slice(&values);
        self.found_inf.store(found_inf, Ordering::Relaxed);
        let phase = if microbatches == 0 { Phase::Empty } else { Phase::Open };
        *w = Window { id, phase, count, microbatches };
        Ok(())
    }

    fn discard(&self, w: &mut Window) {
        *w = Window { id: w.id + 1, phase: Phase::Empty, count: 0, microbatches: 0 };
        self.found_inf.store(false, Ordering::Relaxed);
    }

    fn start_window_if_synced(&self, w: &mut Window) {
        if matches!(w.phase, Phase::Synced(_)) {
            self.discard(w);
        }
    }

    fn factor(&self, scaler: &Scaler, count: u64) -> f32 {
        math::unscale_factor(self.config.weight(count), scaler.scale())
    }

    fn check_count(&self, w: &Window, count: u64) -> Result<()> {
        // A synced window restarts from zero, so only an open window's total can overflow.
        self.config.check_count(if matches!(w.phase, Phase::Synced(_)) { 0 } else { w.count }, count)
    }

    fn check_grad(&self, index: usize, g: &Grad<'_>) -> Result<()> {
        let d = self.descs[index];
        if g.dtype() != d.dtype {
            return Err(Error::new(
                ErrorKind::DtypeMismatch,
                format!("gradient {index} is {}, tensor {index} was declared {}", g.dtype().name(), d.dtype.name()),
            ));
        }
        if g.len() != d.numel {
            return Err(Error::new(ErrorKind::SizeMismatch, format!("gradient {index} has {} elements, tensor {index} has {}", g.len(), d.numel)));
        }
        Ok(())
    }
}

/// The boundary's pass over the summed master buffer: each block's sum of squares, and the
/// normalisation when its factor is known before the norm (no clipping).
struct NormPass {
    factor: Option<f32>,
    threads: usize,
}

impl BlockPass for NormPass {
    fn run(&self, run: &mut [f32], sums: &mut [f64]) {
        match self.factor {
            Some(factor) => cpu::scale_and_block_sum_squares(run, factor, sums, self.threads),
            None => cpu::block_sum_squares(run, sums, self.threads),
        }
    }

    fn add_and_run(&self, run: &mut [f32], addend: &[f32], sums: &mut [f64]) {
        cpu::add_and_block_sum_squares(run, addend, self.factor, sums);
    }
}

/// Fails on every rank alike when the ranks' control values are inconsistent.
fn check_agreement(total: &ControlSum) -> Result<()> {
    if total.error {
        return Err(Error::new(ErrorKind::PeerFailure, "another rank's sync call was invalid; no rank reduced"));
    }
    if total.min_numel != total.max_numel || total.min_layout != total.max_layout {
        return Err(Error::new(
            ErrorKind::SizeMismatch,
            format!(
                "ranks' accumulators differ (element counts from {} to {}, or a different tensor layout); no rank reduced",
                total.min_numel, total.max_numel
            ),
        ));
    }
    if total.microbatches == 0 {
        return Err(Error::new(ErrorKind::EmptyWindow, "sync on an empty window: no rank added a micro-batch"));
    }
    Ok(())
}
