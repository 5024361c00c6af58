//! The accumulator: FP32 master gradients for a set of tensors, filled micro-batch by micro-batch
//! in one fused pass each, and turned at the boundary into the normalised, all-reduced, clipped
//! gradient of the whole effective batch, identical on every rank.
//!
//! One [`Accumulator`] serves every device. This module holds the semantics, once: the window and
//! its phases (`window`), counts and normalisation rules (`config`), the tensor and bucket layout
//! (`layout`), how an accumulator is made (`builder`) and what it shares with its store (`plan`),
//! how the ranks agree before a collective and what each verdict says (`protocol`), how sharding
//! cuts a micro-batch into stripes and buckets (`sharding`), the add path (`microbatch`, with a
//! gradient's checks in `grads`), the order of the boundary's steps (`boundary`), what it reports
//! and hands on (`report`, `synced`), and the window's checkpoints (`checkpoint`); every check
//! runs before anything changes. This file holds the type and its views. A boundary feature
//! starts here. A device supplies the memory and the kernels through the `Store` trait (`store`):
//! `backend::cpu` (a host buffer, SIMD passes, host communicators) and `backend::cuda` (device
//! memory, kernels on the caller's stream, NCCL). A store reads the loss scale from the
//! `ScaleSource` each add hands it, never from the scaler. A trait object rather than a type
//! parameter: the device is chosen at run time by every caller of the C ABI and of the bindings,
//! so one concrete type keeps that choice out of their code, and the per-call cost of one
//! indirect call is nothing beside a pass over a tensor.

pub(crate) mod boundary;
mod builder;
mod checkpoint;
mod config;
mod grads;
mod layout;
mod microbatch;
mod plan;
pub(crate) mod protocol;
#[cfg(feature = "internal")]
pub use protocol::Owed;
mod report;
mod scale_source;
pub(crate) mod sharding;
mod store;
mod synced;
pub(crate) mod tensor_stats;
mod window;

pub use config::{
    AccumulatorConfig, LossReduction, Normalize, Overflow, Sharding, TensorDesc, MAX_WINDOW_COUNT,
};

use std::ops::Range;
use std::sync::Arc;

use crate::comm::Communicator;
use crate::device::Device;
use crate::error::{Error, ErrorKind, Result};
pub use builder::AccumulatorBuilder;
pub use grads::{Gradient, Grads};
pub(crate) use layout::Layout;
pub use layout::MASTER_ALIGN;
pub(crate) use plan::{Agreed, Plan, Proposal, Reduced};
pub use report::{OverflowAt, SyncInfo};
pub(crate) use scale_source::{DeviceScale, ScaleSource};
pub(crate) use store::{AddKernels, BoundaryWork, MasterMemory, MicrobatchTurns, Store};
pub(crate) use tensor_stats::Segments;
pub use tensor_stats::TensorStats;
pub(crate) use window::{MasterWrite, TensorWrite};
use window::{State, Window};

/// Mixed-precision gradient accumulator over a fixed list of tensors, on one device.
///
/// `add`, `begin_microbatch`/`end_microbatch`, `sync` and `reset` serialise on the window.
/// `add_tensor` may run concurrently from several threads: distinct tensors in parallel, several
/// contributions to one tensor one after another.
pub struct Accumulator {
    plan: Arc<Plan>,
    window: Window,
    store: Box<dyn Store>,
}

impl std::fmt::Debug for Accumulator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accumulator")
            .field("device", &self.device())
            .field("plan", &self.plan)
            .finish()
    }
}

impl Accumulator {
    pub fn device(&self) -> Device {
        self.store.device()
    }

    pub fn config(&self) -> &AccumulatorConfig {
        &self.plan.config
    }

    pub fn tensors(&self) -> &[TensorDesc] {
        &self.plan.descs
    }

    /// Total elements of the master buffer, the padding between tensors included: the length
    /// an adopted master must have.
    pub fn len(&self) -> usize {
        self.plan.layout.len()
    }

    /// The master length, in f32 elements, of an accumulator over `tensors`: each tensor starts
    /// at a multiple of [`MASTER_ALIGN`] bytes, with zeros between. What a buffer given to
    /// [`AccumulatorBuilder::master_buffer`] must hold.
    pub fn master_len(tensors: &[TensorDesc]) -> Result<usize> {
        Ok(Layout::new(tensors, usize::MAX)?.len())
    }

    /// Where tensor `index` starts in the flat master, in elements (a multiple of
    /// [`MASTER_ALIGN`] / 4): with [`Accumulator::shard`]'s range it tells which tensors' elements
    /// a shard holds.
    pub fn offset(&self, index: usize) -> Result<usize> {
        self.plan.layout.check_index(index)?;
        Ok(self.range(index).start)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element ranges of the communication buckets.
    pub fn buckets(&self) -> &[Range<usize>] {
        self.plan.layout.buckets()
    }

    /// This rank's shard: its element range in the flat master and the address of its first
    /// element (a device address on CUDA; valid while the accumulator lives). Without sharding it
    /// is the whole master, so an optimizer can always update just `shard()`. Under
    /// [`Sharding::ReduceScatter`], after a `sync` the range holds this rank's part of the reduced,
    /// normalised (and clipped) gradient; the rest of the master is unspecified until the next
    /// window's first micro-batch overwrites it. Under [`Sharding::Accumulate`] the shard is all
    /// the accumulator holds: the window's sum over the ranks while accumulating, the reduced
    /// gradient after a `sync`. Read it safely with [`Accumulator::with_shard`]. After
    /// [`Accumulator::sync_for_step`] it holds the gradient before a pending clip coefficient
    /// until a read through the accumulator applies it.
    pub fn shard(&self) -> (Range<usize>, *mut f32) {
        let range = self.plan.shard();
        let ptr = self.store.master_address(range.start);
        (range, ptr)
    }

    fn range(&self, index: usize) -> Range<usize> {
        self.plan.layout.range(index)
    }

    /// Takes part in the collective that this rank's invalid call would have joined, so that the
    /// other ranks fail instead of waiting: under sharded accumulation every micro-batch and
    /// boundary is a collective over the creation communicator. Nothing otherwise.
    pub(crate) fn refuse_collective(&self) {
        self.store.refuse();
    }

    /// An `add_tensor` that failed before reaching the accumulator (an argument refused on the
    /// way): under sharded accumulation the open micro-batch then fails on every rank when it
    /// ends.
    pub(crate) fn refuse_tensor(&self) {
        self.store.note_invalid();
    }

    /// A sharded accumulation reduces over the communicator it was created with: another is
    /// refused (`None` names its own).
    fn check_bound(&self, comm: Option<&dyn Communicator>) -> Result<()> {
        match (self.store.bound(), comm) {
            (Some(b), Some(c)) if !std::ptr::addr_eq(b, c) => Err(Error::invalid(
                "a sharded accumulation reduces over the communicator it was created with; this call got another (pass it, or none)",
            )),
            _ => Ok(()),
        }
    }

    /// Discards the window in progress (or the synced result): the next micro-batch starts afresh.
    ///
    /// Under [`Sharding::Accumulate`], inside a micro-batch it ends the micro-batch as
    /// `end_microbatch` does (the other ranks' reductions pair with it), then discards.
    pub fn reset(&self) -> Result<()> {
        let mut w = self.window.write();
        self.store.end_final()?;
        let closed = if w.in_microbatch() {
            self.store.close_microbatch(w.master_mut()).map(drop)
        } else {
            Ok(())
        };
        self.store.take_lost();
        self.discard(&mut w)?;
        closed
    }

    /// Copies tensor `index`'s FP32 master gradient to `out` (all zeros for a tensor that received
    /// nothing in a synced window). On CUDA this waits for the accumulator's stream.
    /// Under [`Sharding::Accumulate`], only a tensor inside the shard can be read.
    pub fn read_master(&self, index: usize, out: &mut [f32]) -> Result<()> {
        let r = self.held_tensor(index)?;
        // After a final micro-batch began, its buckets are being reduced on another stream.
        self.store.check_open()?;
        if out.len() != r.len() {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("output holds {} values, tensor {index} has {}", out.len(), r.len()),
            ));
        }
        let mut w = self.window.write();
        self.settle_clip(&mut w)?;
        self.store.read(w.master(), r, out)
    }

    /// Runs `f` on tensor `index`'s FP32 master gradient: in place on the CPU, on a host copy on
    /// a device.
    pub fn with_master<R>(&self, index: usize, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        self.held_tensor(index)?;
        self.store.check_open()?;
        let mut w = self.window.write();
        self.settle_clip(&mut w)?;
        let (mut f, mut out) = (Some(f), None);
        let run = &mut |master: &[f32]| out = f.take().map(|f| f(master));
        self.store.view(w.master(), self.range(index), run)?;
        Ok(out.expect("a view runs once"))
    }

    /// Runs `f` on this rank's shard of the flat FP32 master ([`Accumulator::shard`]'s range;
    /// the whole master without sharding): in place on the CPU, on a host copy on a device. The
    /// safe way to read what `shard()`'s address points to.
    pub fn with_shard<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        self.store.check_open()?;
        let mut w = self.window.write();
        self.settle_clip(&mut w)?;
        let (mut f, mut out) = (Some(f), None);
        let run = &mut |shard: &[f32]| out = f.take().map(|f| f(shard));
        self.store.view(w.master(), self.plan.shard(), run)?;
        Ok(out.expect("a view runs once"))
    }

    /// Address of tensor `index`'s master gradient (a device address on CUDA) and its length, for
    /// callers across the C boundary. The buffer never moves while the accumulator lives. After
    /// [`Accumulator::sync_for_step`] it holds the gradient before a pending clip coefficient
    /// (see [`Accumulator::shard`]).
    pub fn master_ptr(&self, index: usize) -> Result<(*mut f32, usize)> {
        let r = self.held_tensor(index)?;
        Ok((self.store.master_address(r.start), r.len()))
    }

    /// Tensor `index`'s range, when the store holds all of it.
    fn held_tensor(&self, index: usize) -> Result<Range<usize>> {
        self.plan.layout.check_index(index)?;
        let (r, held) = (self.range(index), self.plan.held());
        if r.start < held.start || r.end > held.end {
            return Err(Error::invalid(format!(
                "tensor {index} (elements {r:?}) is not inside this rank's shard {held:?}: a sharded accumulation holds only its shard (gradacc_accumulator_shard; shard() in Rust)"
            )));
        }
        Ok(r)
    }

    pub(crate) fn plan(&self) -> &Arc<Plan> {
        &self.plan
    }

    /// The communicator a sharded accumulation is bound to.
    pub(crate) fn bound(&self) -> Option<&dyn Communicator> {
        self.store.bound()
    }

    fn discard(&self, w: &mut State) -> Result<()> {
        w.next();
        self.store.clear_found_inf()
    }

    fn start_window_if_synced(&self, w: &mut State) -> Result<()> {
        if w.synced() {
            self.discard(w)?;
        }
        Ok(())
    }

    fn check_comm(&self, comm: &dyn Communicator) -> Result<()> {
        Device::require_same(
            ("the communicator", comm.device()),
            ("the accumulator", self.device()),
        )
    }
}
