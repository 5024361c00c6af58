//! The FP32-master optimizer step, the third technique of mixed precision: FP32 master weights,
//! AdamW or SGD stepped from the accumulator's reduced, normalised, clipped gradient, the new
//! weights written into the model's 16- or 32-bit buffers in the same pass, and under a sharded
//! boundary (ZeRO-1 and ZeRO-2) each rank stepping its shard only and all-gathering the weights.
//!
//! Who owns what: the per-element rule is `update.rs` (PyTorch's operation order), the rounding
//! into the model's dtype `rounding.rs`, the saved format `saved.rs`, what a device supplies (its
//! state's memory, the fused pass, the all-gather) `store.rs`, one store per device made by
//! `backend::optimizer_store_for`; this file binds them to an accumulator's layout and shard and
//! to its window (one step per synced window), and holds the checks and the agreement's order.

pub(crate) mod blockwise;
mod builder;
mod config;
mod format;
pub mod fp8;
pub(crate) mod pass;
mod rounding;
mod saved;
pub(crate) mod store;
pub(crate) mod update;

use std::ops::Range;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

pub use blockwise::BLOCK as MOMENT_BLOCK;
pub use builder::OptimizerBuilder;
pub use config::{Algorithm, OptimizerConfig, TensorGroup};
pub use format::{join_master, split_master, MasterFormat, MomentFormat, StateFormat};
pub use fp8::{WeightFormat, WeightMut};
pub use rounding::Rounding;

use crate::accumulator::sharding::intersect;
use crate::accumulator::{Accumulator, Plan, Sharding};
use crate::backend;
use crate::comm::Communicator;
use crate::device::{Device, DevicePtr};
use crate::dtype::{self, Dtype, Grad, GradMut};
use crate::error::{Error, ErrorKind, Result};
use store::{Fingerprint, Gather, Init, OptimizerStore, Setup, Weights};

/// Which per-element value of the optimizer [`Optimizer::read`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// The FP32 master weights.
    Weights,
    /// AdamW's first moment (`exp_avg`), or SGD's momentum buffer.
    FirstMoment,
    /// AdamW's second moment (`exp_avg_sq`).
    SecondMoment,
    /// With [`MasterFormat::Bf16Remainder`], the masters' 16-bit remainders (as f32 values
    /// 0..=65535): tensor i's master is [`join_master`] of its bf16 weight and remainder.
    Remainders,
}

/// FP32 master weights and the optimizer's state for the tensors of one accumulator, stepped
/// once per synced window. Under [`Sharding::ReduceScatter`] and [`Sharding::Accumulate`] it
/// holds only this rank's shard ([`Accumulator::shard`]): 12 bytes per element of the shard for
/// AdamW, 8 for SGD (its momentum buffer is kept even at momentum 0), down to 2.125 and 1.0625
/// with the smaller state formats ([`OptimizerBuilder::state`]), and after each step the ranks
/// all-gather the new model weights, so every rank's model is bitwise what one unsharded
/// optimizer would write.
///
/// One builder makes it on every device ([`Optimizer::builder`]; [`Optimizer::new`],
/// [`Optimizer::new_device`], [`Optimizer::with_masters`] and [`Optimizer::with_masters_device`]
/// are its shorthands). On a CPU accumulator (host weights, [`Optimizer::step`]) the state is in
/// host memory and the sharded all-gather runs over in-process and MPI communicators. On a CUDA
/// accumulator (device addresses, [`Optimizer::step_device`]) the masters, the state and the
/// step count are in device memory, each step is enqueued on the accumulator's stream (the skip
/// is decided there, from the boundary's overflow flag), and the all-gather runs over NCCL. Both
/// write the same bits. Adopted masters ([`OptimizerBuilder::masters`],
/// [`OptimizerBuilder::device_masters`]) are the caller's FP32 masters, used in place.
#[derive(Debug)]
pub struct Optimizer {
    algorithm: Algorithm,
    rounding: Rounding,
    /// How the masters and moments are kept.
    format: StateFormat,
    /// How the step writes each tensor's model weights.
    weight_formats: Vec<WeightFormat>,
    plan: Arc<Plan>,
    /// The model's weight dtype of each tensor.
    dtypes: Vec<Dtype>,
    /// Whether the accumulator is on the CPU, and the range of its flat layout this rank holds.
    on_cpu: bool,
    held: Range<usize>,
    /// What every rank's optimizer must share in a sharded step.
    fingerprint: Fingerprint,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The accumulator window last stepped from (or skipped): one step per synced window.
    consumed: Option<u64>,
    /// The masters, moments, learning rate and step count, in the device's memory.
    store: Box<dyn OptimizerStore>,
}

impl Optimizer {
    /// Shorthand for [`Optimizer::builder`]`(acc).config(config).groups(groups)
    /// .weights(weights).build()`: an optimizer over a CPU accumulator's tensors, device and
    /// sharding, its FP32 masters initialised from the model's weights `weights` (one whole
    /// tensor per accumulator tensor, of any dtype: the model's, which `step` writes). Fails,
    /// making nothing, on a config out of range, a weight of the wrong length, or a CUDA
    /// accumulator (`DeviceMismatch`: see [`Optimizer::new_device`]).
    pub fn new(
        acc: &Accumulator,
        config: OptimizerConfig,
        groups: &[TensorGroup],
        weights: &[Grad<'_>],
    ) -> Result<Self> {
        Self::builder(acc).config(config).groups(groups).weights(weights).build()
    }

    /// Shorthand for [`Optimizer::new`] with [`OptimizerBuilder::masters`]`(masters, len)`: the
    /// caller's FP32 master weights in host memory adopted (their values ARE the masters, see
    /// there).
    ///
    /// # Safety
    /// As [`OptimizerBuilder::masters`]: `masters` must be valid for reads and writes of `len`
    /// f32 values in host memory for the optimizer's lifetime, and neither read nor written by
    /// anything else while one of its calls runs.
    pub unsafe fn with_masters(
        acc: &Accumulator,
        config: OptimizerConfig,
        groups: &[TensorGroup],
        weights: &[Grad<'_>],
        masters: *mut f32,
        len: usize,
    ) -> Result<Self> {
        let builder = Self::builder(acc).config(config).groups(groups).weights(weights);
        // SAFETY: the caller's contract, which is the builder's.
        unsafe { builder.masters(masters, len) }.build()
    }

    /// Shorthand for [`Optimizer::builder`]`(acc).config(config).groups(groups)
    /// .device_weights(weights, dtypes).build()`: [`Optimizer::new`] for a CUDA accumulator. The
    /// model's weights are device addresses (`weights[i]` holds tensor i's numel values of
    /// `dtypes[i]`, on the accumulator's device), and the masters, the state and the step count
    /// are allocated in device memory on the accumulator's stream. Reads the weights (waits for
    /// the stream). Fails, making nothing, on a config out of range, a wrong count, a weight
    /// that is not one device allocation of its tensor's length (`DeviceMismatch`, host memory
    /// included), or a CPU accumulator (`DeviceMismatch`).
    pub fn new_device(
        acc: &Accumulator,
        config: OptimizerConfig,
        groups: &[TensorGroup],
        weights: &[DevicePtr],
        dtypes: &[Dtype],
    ) -> Result<Self> {
        Self::builder(acc).config(config).groups(groups).device_weights(weights, dtypes).build()
    }

    /// Shorthand for [`Optimizer::new_device`] with
    /// [`OptimizerBuilder::device_masters`]`(masters, len)`: the caller's FP32 masters at a
    /// device address adopted (see there). Creation does not read the weights and does not
    /// wait for the stream.
    ///
    /// # Safety
    /// As [`OptimizerBuilder::device_masters`]: `masters` must stay allocated for the
    /// optimizer's lifetime, and nothing else may read or write it while a step enqueued on the
    /// stream runs.
    pub unsafe fn with_masters_device(
        acc: &Accumulator,
        config: OptimizerConfig,
        groups: &[TensorGroup],
        weights: &[DevicePtr],
        dtypes: &[Dtype],
        masters: DevicePtr,
        len: usize,
    ) -> Result<Self> {
        let builder = Self::builder(acc).config(config).groups(groups);
        let builder = builder.device_weights(weights, dtypes);
        // SAFETY: the caller's contract, which is the builder's.
        unsafe { builder.device_masters(masters, len) }.build()
    }

    /// [`OptimizerBuilder::build`] with host weights (and host masters, if adopted).
    fn new_host(
        acc: &Accumulator,
        config: OptimizerConfig,
        format: (StateFormat, &[WeightFormat]),
        groups: &[TensorGroup],
        weights: &[Grad<'_>],
        adopt: Option<(*mut f32, usize)>,
    ) -> Result<Self> {
        config.validate()?;
        if acc.device() != Device::Cpu {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                format!(
                    "the accumulator is on {}: its optimizer takes the weights' device addresses (Optimizer::new_device)",
                    acc.device().name()
                ),
            ));
        }
        let n = acc.plan().descs.len();
        let groups = groups_for(groups, n)?;
        check_count(weights.len(), n)?;
        for (i, w) in weights.iter().enumerate() {
            check_len(i, w.len(), acc.plan().descs[i].numel)?;
        }
        let dtypes: Vec<Dtype> = weights.iter().map(Grad::dtype).collect();
        Self::create(acc, (config, format), groups, dtypes, Init::Host(weights), adopt)
    }

    /// [`OptimizerBuilder::build`] with device weights (and device masters, if adopted).
    fn new_on_device(
        acc: &Accumulator,
        config: OptimizerConfig,
        format: (StateFormat, &[WeightFormat]),
        groups: &[TensorGroup],
        weights: &[DevicePtr],
        dtypes: &[Dtype],
        adopt: Option<(DevicePtr, usize)>,
    ) -> Result<Self> {
        config.validate()?;
        let Device::Cuda { .. } = acc.device() else {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                "the accumulator is on the CPU: its optimizer takes host weights (Optimizer::new)",
            ));
        };
        let n = acc.plan().descs.len();
        let groups = groups_for(groups, n)?;
        check_count(weights.len(), n)?;
        if dtypes.len() != n {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("`dtypes` has {} entries for {n} tensors", dtypes.len()),
            ));
        }
        let adopt = adopt.map(|(ptr, len)| (ptr as usize as *mut f32, len));
        Self::create(acc, (config, format), groups, dtypes.to_vec(), Init::Device(weights), adopt)
    }

    /// The optimizer over checked arguments: its store made on the accumulator's device (which
    /// checks what only the device can, and the adopted masters).
    fn create(
        acc: &Accumulator,
        (config, (format, weight_formats)): (OptimizerConfig, (StateFormat, &[WeightFormat])),
        groups: Vec<TensorGroup>,
        dtypes: Vec<Dtype>,
        weights: Init<'_>,
        masters: Option<(*mut f32, usize)>,
    ) -> Result<Self> {
        format.check(&dtypes, config.rounding, masters.is_some())?;
        let weight_formats = weight_formats_for(weight_formats, acc, &format)?;
        let plan = acc.plan().clone();
        let setup = Setup {
            plan: &plan,
            algorithm: config.algorithm,
            rounding: config.rounding,
            format,
            lr: config.lr,
            groups: &groups,
            dtypes: &dtypes,
            weight_formats: &weight_formats,
            weights,
            masters,
        };
        let store = backend::optimizer_store_for(acc.device(), &setup)?;
        let fingerprint = fingerprint(&config, &format, &dtypes, &groups, &weight_formats);
        Ok(Optimizer {
            algorithm: config.algorithm,
            rounding: config.rounding,
            format,
            weight_formats,
            on_cpu: acc.device() == Device::Cpu,
            held: plan.shard(),
            plan,
            dtypes,
            fingerprint,
            state: Mutex::new(State { consumed: None, store }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// The learning rate of the next step. On a CUDA accumulator it lives in device memory
    /// ([`Optimizer::lr_device_ptr`]): this waits for the stream and reads it; if the device
    /// cannot be read, the last value the host set.
    pub fn lr(&self) -> f32 {
        self.lock().store.lr()
    }

    /// Sets the learning rate of the steps from the next one on (a schedule calls it each step).
    /// On a CUDA accumulator the value is copied to the device on the accumulator's stream,
    /// so the steps enqueued before this call keep theirs.
    pub fn set_lr(&self, lr: f32) -> Result<()> {
        config::check_lr(lr)?;
        self.lock().store.set_lr(lr)
    }

    /// On a CUDA accumulator, the device address of the learning rate (one `float`) that every
    /// step reads when it runs on the stream. A schedule that runs on the device (a kernel, or
    /// a copy node in a captured graph) writes it there, so a captured step replays with the
    /// schedule and without the host. The value is used as written: it is not checked, as
    /// [`Optimizer::set_lr`] checks its own. `DeviceMismatch` on a CPU accumulator.
    pub fn lr_device_ptr(&self) -> Result<DevicePtr> {
        self.lock().store.lr_address().ok_or_else(|| {
            Error::new(
                ErrorKind::DeviceMismatch,
                "the optimizer steps a CPU accumulator: its learning rate is a host value (set_lr)",
            )
        })
    }

    /// How the masters and moments are kept.
    pub fn state_format(&self) -> StateFormat {
        self.format
    }

    /// How the step writes each tensor's model weights ([`OptimizerBuilder::weight_formats`]).
    pub fn weight_formats(&self) -> &[WeightFormat] {
        &self.weight_formats
    }

    /// The dtype of each tensor's model weights (those given at creation).
    pub fn weight_dtypes(&self) -> &[Dtype] {
        &self.dtypes
    }

    /// Steps taken (a skipped step is not one). On a CUDA accumulator the count lives in device
    /// memory: this waits for the stream when a step since the last read was enqueued after
    /// `sync_enqueue` (the host did not see its boundary's result), and otherwise returns the
    /// count the host kept; if the device cannot be read, the last count the host knew.
    pub fn steps(&self) -> u64 {
        self.lock().store.steps()
    }

    /// This rank's values of tensor `index` in `slot`: the range of the tensor's elements it
    /// holds (all of them without sharding) and their values (bf16 moments widened, exactly;
    /// 8-bit blockwise moments decoded, as the step decodes them).
    /// On a CUDA accumulator this reads the device (it waits for the stream). With
    /// [`MasterFormat::Bf16Remainder`] the masters are not the optimizer's alone: read
    /// [`Slot::Remainders`] and join them with the weights ([`join_master`]); with
    /// [`MasterFormat::None`] the masters are the model's weights, and neither slot is kept.
    pub fn read(&self, index: usize, slot: Slot) -> Result<(Range<usize>, Vec<f32>)> {
        self.plan.layout.check_index(index)?;
        if slot == Slot::SecondMoment && !self.algorithm.second_moment() {
            return Err(Error::invalid("`slot`: SGD keeps no second moment".to_string()));
        }
        // The masters' slot this format keeps, if any.
        let kept = match self.format.masters {
            MasterFormat::F32 => Some(Slot::Weights),
            MasterFormat::Bf16Remainder => Some(Slot::Remainders),
            MasterFormat::None => None,
        };
        if matches!(slot, Slot::Weights | Slot::Remainders) && Some(slot) != kept {
            return Err(Error::invalid(match self.format.masters {
                MasterFormat::Bf16Remainder => "`slot`: the masters are the bf16 weights plus remainders: read Slot::Remainders and join them with the weights (join_master)",
                MasterFormat::F32 => "`slot`: the masters are FP32 and keep no remainders",
                MasterFormat::None => "`slot`: no masters are kept (MasterFormat::None): the model's weights are the masters",
            }));
        }
        let p = piece(&self.plan, index, &self.held);
        let mut out = Vec::new();
        self.lock().store.view(&mut |v| {
            let values = match slot {
                Slot::Weights | Slot::Remainders => &v.master,
                Slot::FirstMoment => &v.first,
                Slot::SecondMoment => &v.second,
            };
            out = values.widened(p.held.clone(), slot == Slot::Remainders);
        })?;
        Ok((p.tensor, out))
    }

    /// The optimizer step after `acc`'s `sync`: from the reduced gradient, steps the FP32
    /// masters and the state and writes the model's weights `weights` (the same dtypes and
    /// lengths as at creation), or, when the boundary found a non-finite value, changes nothing
    /// at all. Returns whether it stepped. Under a sharded boundary the ranks then all-gather
    /// the new weights over `comm` (the communicator `sync` took; `None` for a sharded
    /// accumulation's own): every rank calls `step` alike.
    ///
    /// Fails with `WrongState` before a sync or a second time after one, and on the wrong
    /// accumulator, weights or communicator, changing nothing. A failed all-gather (the
    /// communicator failed) leaves this rank's shard stepped and the other shards' weights as
    /// they were: resume from saved state.
    pub fn step(
        &self,
        acc: &Accumulator,
        weights: &mut [GradMut<'_>],
        comm: Option<&dyn Communicator>,
    ) -> Result<bool> {
        let mut weights: Vec<WeightMut<'_>> =
            weights.iter_mut().map(|w| WeightMut::Model(w.slice_mut(0..w.len()))).collect();
        self.step_weights(acc, &mut weights, comm)
    }

    /// [`Optimizer::step`] with each tensor's weights in the format chosen at creation
    /// ([`OptimizerBuilder::weight_formats`]): the model's dtype, or FP8 codes (one per
    /// element) and scales (one f32 for [`WeightFormat::E4m3Tensorwise`], one E8M0 byte per
    /// block of [`fp8::MX_BLOCK`] for [`WeightFormat::Mxfp8`]). After the step every rank holds
    /// the codes and scales of quantising each whole tensor's new FP32 masters on one rank.
    ///
    /// Fails as `step` does, and with `DtypeMismatch` on a weight of another format and
    /// `SizeMismatch` on codes or scales of the wrong length, changing nothing. When the new
    /// masters of an FP8 tensor hold an infinity or NaN on any rank, no scale is applied: every
    /// rank fails with `InvalidArgument` naming the tensor, its weights and state unchanged,
    /// and the window may be stepped again (after lowering the learning rate, say).
    pub fn step_weights(
        &self,
        acc: &Accumulator,
        weights: &mut [WeightMut<'_>],
        comm: Option<&dyn Communicator>,
    ) -> Result<bool> {
        if acc.device() != Device::Cpu {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                "the accumulator is on CUDA: step it with the weights' device addresses (Optimizer::step_device)",
            ));
        }
        let stepped = self.step_with(acc, Weights::Host(weights), comm)?;
        Ok(stepped == Some(true))
    }

    /// Takes part in a step this rank cannot make (the C ABI refused its arguments before
    /// `step`): under a sharded boundary the agreement, flagged invalid, so that the other ranks
    /// fail at once with PEER_FAILURE instead of waiting in the all-gather. Changes nothing.
    #[cfg(feature = "internal")]
    pub fn refuse_step(&self, acc: &Accumulator, comm: Option<&dyn Communicator>) {
        let Ok(Some(group)) = self.gather_group(acc, comm) else { return };
        // A host communicator's control reduction carries the refusal; a device's own
        // agreement, flagged invalid, tells the peers of a device communicator.
        let claim = self.fingerprint.step(None).claim(&self.plan, None, true);
        crate::accumulator::protocol::refuse_with(group.comm, &claim);
        self.lock().store.refuse(&self.fingerprint, &self.plan, group.comm);
    }

    /// The optimizer step on a CUDA accumulator ([`Optimizer::step`]'s semantics), enqueued on
    /// the accumulator's stream without waiting for it: `weights` are the model weights' device
    /// addresses (the dtypes given at creation). One fused launch steps the held range and
    /// writes the weights; whether the boundary overflowed (then nothing changes, the step count
    /// included) is read by the kernels from the boundary's result in device memory, so the step
    /// also follows `sync_enqueue`. Returns whether it stepped when the host has the boundary's
    /// result (after `sync`), and None after `sync_enqueue` (the device decided).
    ///
    /// Under a sharded boundary the ranks first agree as [`Optimizer::step`]'s do, through a
    /// blocking exchange over the NCCL communicator (this waits for the stream), then
    /// all-gather the new weights over it, stream-ordered. While the stream is captured into a
    /// CUDA graph nothing may wait: the first sharded step over a communicator then fails with
    /// `WrongState` (take it before capturing), and after it no exchange runs; a call invalid
    /// on this rank stops pairing on the communicator (it aborts it), so that the other ranks'
    /// all-gather fails instead of pairing with a later call. Fails, changing nothing, as `step`
    /// does, and with `DeviceMismatch` on a weight that is not one device allocation of its
    /// tensor's length.
    pub fn step_device(
        &self,
        acc: &Accumulator,
        weights: &[DevicePtr],
        comm: Option<&dyn Communicator>,
    ) -> Result<Option<bool>> {
        if self.on_cpu {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                "the optimizer steps a CPU accumulator: use Optimizer::step with host weights",
            ));
        }
        self.step_with(acc, Weights::Device(weights), comm)
    }

    /// A step whose weights are in the device's memory: under a sharded boundary every rank
    /// steps and gathers, or none.
    fn step_with(
        &self,
        acc: &Accumulator,
        weights: Weights<'_, '_>,
        comm: Option<&dyn Communicator>,
    ) -> Result<Option<bool>> {
        let group = self.gather_group(acc, comm)?;
        let mut s = self.lock();
        if let Some(g) = &group {
            s.store.takes(g.comm)?;
        }
        let own = self.check_step(&s, acc, &weights).err();
        // The ranks agree first, so that a rank whose call is invalid never leaves the others
        // waiting in the gather.
        match (&group, own) {
            (Some(g), own) => {
                s.store.agree(&self.fingerprint, &self.plan, g.comm, own.as_ref())?;
            }
            (None, Some(e)) => return Err(e),
            (None, None) => {}
        }
        let State { consumed, store } = &mut *s;
        store.step(acc, weights, group.as_ref(), consumed)
    }

    /// Fails unless `acc` is this optimizer's, synced in a window not stepped yet, and
    /// `weights` are the model's (count, dtypes and lengths, the device's memory, apart from
    /// adopted masters).
    fn check_step(&self, s: &State, acc: &Accumulator, weights: &Weights<'_, '_>) -> Result<()> {
        if !Arc::ptr_eq(acc.plan(), &self.plan) {
            return Err(Error::invalid(
                "`acc` is not the accumulator this optimizer was made over",
            ));
        }
        check_count(weights.len(), self.dtypes.len())?;
        if let Weights::Host(w) = weights {
            self.check_dtypes(w)?;
        }
        s.store.check_weights(weights)?;
        let numel: Vec<usize> = self.plan.descs.iter().map(|d| d.numel).collect();
        if let Some((ptr, len)) = s.store.adopted() {
            check_apart(ptr, len, weights.ranges(&self.dtypes, &numel).into_iter())?;
        }
        let window = match weights {
            Weights::Host(_) => acc.synced_window("the optimizer step")?,
            Weights::Device(_) => acc.synced_window_on_device("the optimizer step")?,
        };
        if s.consumed == Some(window) {
            return Err(Error::wrong_state(
                "the optimizer already stepped from this window: sync again first",
            ));
        }
        Ok(())
    }

    /// Fails unless host weights have the model's formats, dtypes and lengths.
    fn check_dtypes(&self, weights: &[WeightMut<'_>]) -> Result<()> {
        for (i, w) in weights.iter().enumerate() {
            let (format, numel) = (self.weight_formats[i], self.plan.descs[i].numel);
            if w.format() != format {
                return Err(Error::new(
                    ErrorKind::DtypeMismatch,
                    format!(
                        "`weights[{i}]` is {}, tensor {i}'s weights are {} (OptimizerBuilder::weight_formats)",
                        w.format().name(),
                        format.name()
                    ),
                ));
            }
            let WeightMut::Model(w) = w else {
                check_len(i, w.len(), numel)?;
                if w.scale_len() != format.scales(numel) {
                    return Err(Error::new(
                        ErrorKind::SizeMismatch,
                        format!(
                            "`weights[{i}]`'s scales hold {} entries; {} of {numel} elements takes {}",
                            w.scale_len(),
                            format.name(),
                            format.scales(numel)
                        ),
                    ));
                }
                continue;
            };
            let dtype = w.dtype();
            if dtype != self.dtypes[i] {
                return Err(Error::new(
                    ErrorKind::DtypeMismatch,
                    format!(
                        "`weights[{i}]` is {dtype:?}, the model's weights were {:?}",
                        self.dtypes[i]
                    ),
                ));
            }
            check_len(i, w.len(), self.plan.descs[i].numel)?;
        }
        Ok(())
    }

    /// The communicator and shards over which a step all-gathers the weights, if any.
    fn gather_group<'a>(
        &self,
        acc: &'a Accumulator,
        comm: Option<&'a dyn Communicator>,
    ) -> Result<Option<Gather<'a>>> {
        let sharding = self.plan.config.sharding;
        let Some((shards, rank)) = sharding.shard() else { return Ok(None) };
        if shards == 1 {
            return Ok(None);
        }
        let comm = match (comm, sharding) {
            (Some(c), _) => c,
            (None, Sharding::Accumulate { .. }) => acc.bound().expect("bound to its group"),
            (None, _) => {
                return Err(Error::invalid(format!(
                    "`comm`: a reduce-scatter boundary over {shards} ranks all-gathers the weights over the communicator `sync` took"
                )))
            }
        };
        if (comm.world_size(), comm.rank()) != (shards, rank) {
            return Err(Error::invalid(format!(
                "`comm` is rank {} of {}; the optimizer holds shard {rank} of {shards}",
                comm.rank(),
                comm.world_size()
            )));
        }
        Ok(Some(Gather { comm, shards: self.plan.shards(), rank }))
    }

    /// The optimizer's state (this rank's part of it), versioned and checksummed. The format is
    /// the same on every device: on a CUDA accumulator the state is copied to the host (this
    /// waits for the stream).
    pub fn save(&self) -> Result<Vec<u8>> {
        let mut out = None;
        self.lock().store.view(&mut |v| {
            out = Some(match config::check_lr(v.lr) {
                Ok(()) => Ok(saved::encode(self, v)),
                Err(e) => Err(Error::invalid(format!(
                    "the learning rate in device memory: {}",
                    e.message
                ))),
            })
        })?;
        out.expect("a view runs once")
    }

    /// Restores the state from saved parts: the bytes [`Optimizer::save`] wrote on any number of
    /// ranks (one part without sharding), together covering this rank's elements, from an
    /// optimizer with the same tensors, model dtypes, algorithm and rounding. Corrupt, foreign
    /// or insufficient parts are refused with `CorruptState`, and two parts that hold the same
    /// element (the same part given twice, or parts of two saves) with `InvalidArgument`,
    /// naming them; either way the optimizer is unchanged.
    /// The next step may be from the current window (the window it last stepped is forgotten).
    /// Adopted masters are written in place, the padding between tensors with zeros. Parts of
    /// another [`StateFormat`] convert: FP32 moments round to nearest bf16 and bf16 widen; FP32
    /// masters become the remainders of their nearest-even bf16 weights (the model's weights
    /// an FP32-master optimizer wrote), exact but at ties of even upper halves, where the master
    /// moves one f32 unit toward its weight. Remainders do not load into FP32 masters
    /// (`CorruptState`: their upper halves are the model's weights).
    pub fn load(&self, parts: &[&[u8]]) -> Result<()> {
        let mut s = self.lock();
        let restored = saved::decode(self, parts)?;
        s.consumed = None;
        s.store.restore(&restored.values())
    }
}

/// Each tensor in `groups[i]`; every tensor in the default group when `groups` is empty.
fn groups_for(groups: &[TensorGroup], n: usize) -> Result<Vec<TensorGroup>> {
    let groups = match groups.len() {
        0 => vec![TensorGroup::default(); n],
        g if g == n => groups.to_vec(),
        g => {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("`groups` has {g} entries for {n} tensors"),
            ))
        }
    };
    for (i, g) in groups.iter().enumerate() {
        g.validate(i)?;
    }
    Ok(groups)
}

/// Each tensor's weight format (the model's dtype for all when `formats` is empty), checked
/// against what FP8 weights need: a sharded boundary and FP32 masters.
fn weight_formats_for(
    formats: &[WeightFormat],
    acc: &Accumulator,
    state: &StateFormat,
) -> Result<Vec<WeightFormat>> {
    let n = acc.plan().descs.len();
    let formats = match formats.len() {
        0 => vec![WeightFormat::Model; n],
        g if g == n => formats.to_vec(),
        g => {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("`weight_formats` has {g} entries for {n} tensors"),
            ))
        }
    };
    let Some((i, f)) = formats.iter().enumerate().find(|(_, f)| f.is_fp8()) else {
        return Ok(formats);
    };
    let name = f.name();
    if acc.plan().config.sharding.shard().is_none() {
        return Err(Error::invalid(format!(
            "`weight_formats[{i}]` is {name}: FP8 weights are written for the all-gather of a sharded boundary (ReduceScatter, Accumulate), and this accumulator is not sharded"
        )));
    }
    let masters = match state.masters {
        MasterFormat::F32 => return Ok(formats),
        MasterFormat::Bf16Remainder => "bf16 remainders",
        MasterFormat::None => "no masters",
    };
    Err(Error::invalid(format!(
        "`weight_formats[{i}]` is {name}: FP8 weights need FP32 masters (an FP8 weight cannot hold the master), and the state keeps {masters}"
    )))
}

/// Where tensor `i`'s elements inside `held` (a range of the flat layout) are.
#[derive(Clone, Debug)]
pub(crate) struct Piece {
    /// In the flat layout.
    pub flat: Range<usize>,
    /// Counted from the tensor's start.
    pub tensor: Range<usize>,
    /// Counted from `held`'s start.
    pub held: Range<usize>,
}

/// Tensor `i`'s piece of `held`; empty (at the starts) when it has no element there.
pub(crate) fn piece(plan: &Plan, i: usize, held: &Range<usize>) -> Piece {
    let t = plan.layout.range(i);
    let flat = intersect(&t, held);
    if flat.is_empty() {
        return Piece { flat: t.start..t.start, tensor: 0..0, held: 0..0 };
    }
    Piece {
        tensor: flat.start - t.start..flat.end - t.start,
        held: flat.start - held.start..flat.end - held.start,
        flat,
    }
}

/// Fails unless adopted masters at `ptr` (host or device) can hold the `held` range: non-null,
/// 4-byte aligned, exactly its length.
fn check_masters(ptr: u64, len: usize, held: &Range<usize>) -> Result<()> {
    dtype::check_buffer(ptr as *const std::ffi::c_void, len, Dtype::F32, "masters")?;
    if len == held.len() {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::SizeMismatch,
            format!(
                "`masters` holds {len} elements; this rank holds {} of the flat layout ({}..{}: Accumulator::shard, gradacc_accumulator_shard)",
                held.len(),
                held.start,
                held.end
            ),
        ))
    }
}

fn check_count(got: usize, tensors: usize) -> Result<()> {
    if got == tensors {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::SizeMismatch,
            format!("`weights` has {got} tensors, the accumulator {tensors}"),
        ))
    }
}

fn check_len(i: usize, got: usize, numel: usize) -> Result<()> {
    if got == numel {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::SizeMismatch,
            format!("`weights[{i}]` holds {got} elements, tensor {i} has {numel}"),
        ))
    }
}

/// Refuses model weights (their byte addresses, host or device) that share memory with the
/// `len` adopted masters at `masters`: a step writes both, and the result would depend on the
/// order of the writes.
fn check_apart(
    masters: u64,
    len: usize,
    weights: impl Iterator<Item = Range<usize>>,
) -> Result<()> {
    let masters = masters as usize..masters as usize + len * size_of::<f32>();
    for (i, bytes) in weights.enumerate() {
        if bytes.start < masters.end && masters.start < bytes.end {
            return Err(Error::invalid(format!(
                "`weights[{i}]` (bytes {:#x}..{:#x}) overlaps the adopted `masters` (bytes {:#x}..{:#x}): a step writes both",
                bytes.start, bytes.end, masters.start, masters.end
            )));
        }
    }
    Ok(())
}

/// What every rank's optimizer must share in a sharded step: ranks that differ (another
/// rounding, a bf16 weight against an f16 one) fail together.
fn fingerprint(
    config: &OptimizerConfig,
    format: &StateFormat,
    dtypes: &[Dtype],
    groups: &[TensorGroup],
    weight_formats: &[WeightFormat],
) -> Fingerprint {
    let (code, params) = config.algorithm.encode();
    let mut bytes = code.to_le_bytes().to_vec();
    if *format != StateFormat::default() {
        // FP32 state hashes as it always did.
        let (masters, moments, seed) = format.codes();
        [masters, moments, seed].iter().for_each(|c| bytes.extend(c.to_le_bytes()));
    }
    params.iter().for_each(|p| bytes.extend(p.to_bits().to_le_bytes()));
    match config.rounding {
        Rounding::NearestEven => bytes.push(0),
        Rounding::Stochastic { seed } => {
            bytes.push(1);
            bytes.extend(seed.to_le_bytes());
        }
    }
    for (d, g) in dtypes.iter().zip(groups) {
        bytes.extend(d.code().to_le_bytes());
        bytes.push(g.weight_decay as u8);
        bytes.extend(g.lr_scale.to_bits().to_le_bytes());
    }
    if weight_formats.iter().any(|f| f.is_fp8()) {
        // Weights in their model dtypes hash as they always did.
        bytes.extend(weight_formats.iter().map(|f| f.code()));
    }
    Fingerprint(crate::state::checksum(&bytes))
}
