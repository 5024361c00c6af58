//! The FP32-master optimizer step, the third technique of mixed precision: FP32 master weights,
//! AdamW or SGD stepped from the accumulator's reduced, normalised, clipped gradient, the new
//! weights written into the model's 16- or 32-bit buffers in the same pass, and under a sharded
//! boundary (ZeRO-1 and ZeRO-2) each rank stepping its shard only and all-gathering the weights.
//!
//! Who owns what: the per-element rule is `update.rs` (PyTorch's operation order), the rounding
//! into the model's dtype `rounding.rs`, the saved format `saved.rs`; this file binds them to an
//! accumulator's layout and shard and to its window (one step per synced window).

mod config;
mod masters;
mod pass;
mod rounding;
mod saved;
mod update;

use std::ops::Range;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

pub use config::{Algorithm, OptimizerConfig, TensorGroup};
pub use rounding::Rounding;

use crate::accumulator::protocol::{self, HostChannel, Step};
use crate::accumulator::sharding::intersect;
use crate::accumulator::{Accumulator, Plan, Sharding};
use crate::backend::cuda::optimizer::{self as cuda, DeviceOptimizer, Setup};
use crate::comm::nccl::NcclComm;
use crate::comm::{Collectives, Communicator, ControlSum, HostCollectives};
use crate::device::{Device, DevicePtr};
use crate::dtype::{self, Dtype, Grad, GradMut};
use crate::error::{Error, ErrorKind, Result};
use crate::math::{bf16_to_f32, f16_to_f32};
use masters::Masters;
use update::Scalars;

/// Which per-element value of the optimizer [`Optimizer::read`] returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// The FP32 master weights.
    Weights,
    /// AdamW's first moment (`exp_avg`), or SGD's momentum buffer.
    FirstMoment,
    /// AdamW's second moment (`exp_avg_sq`).
    SecondMoment,
}

/// FP32 master weights and the optimizer's state for the tensors of one accumulator, stepped
/// once per synced window. Under [`Sharding::ReduceScatter`] and [`Sharding::Accumulate`] it
/// holds only this rank's shard ([`Accumulator::shard`]): 12 bytes per element of the shard for
/// AdamW, 8 for SGD (its momentum buffer is kept even at momentum 0), and after each step the
/// ranks all-gather the new model weights, so every rank's model is bitwise what one unsharded
/// optimizer would write.
///
/// On a CPU accumulator ([`Optimizer::new`], [`Optimizer::step`]) the state is in host memory and
/// the sharded all-gather runs over in-process and MPI communicators. On a CUDA accumulator
/// ([`Optimizer::new_device`], [`Optimizer::step_device`]) the masters, the state and the step
/// count are in device memory, each step is enqueued on the accumulator's stream (the skip is
/// decided there, from the boundary's overflow flag), and the all-gather runs over NCCL. Both
/// write the same bits. [`Optimizer::with_masters`] and [`Optimizer::with_masters_device`] adopt
/// the caller's FP32 masters instead of allocating them.
#[derive(Debug)]
pub struct Optimizer {
    algorithm: Algorithm,
    rounding: Rounding,
    groups: Vec<TensorGroup>,
    plan: Arc<Plan>,
    /// The model's weight dtype of each tensor.
    dtypes: Vec<Dtype>,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    lr: f32,
    /// Steps taken; skipped ones do not count (bias correction counts the steps taken).
    steps: u64,
    /// The accumulator window last stepped from (or skipped): one step per synced window.
    consumed: Option<u64>,
    /// The flat layout's range held, and its values (zeros in the padding when owned; an
    /// adopted buffer's padding is not read, and written only by `load`, with zeros).
    held: Range<usize>,
    master: Masters,
    first: Vec<f32>,
    /// Empty for SGD.
    second: Vec<f32>,
    /// On a CUDA accumulator: the masters, state and step count, in device memory (the host
    /// vectors above are then empty).
    device: Option<DeviceOptimizer>,
    /// On a CUDA accumulator: whether `steps` is the device's count (every step since it was
    /// last read was stepped after a `sync`, whose result the host has).
    steps_known: bool,
}

impl Optimizer {
    /// An optimizer over `acc`'s tensors, device and sharding, its FP32 masters initialised from
    /// the model's weights `weights` (one whole tensor per accumulator tensor, of any dtype: the
    /// model's, which `step` writes), each tensor in `groups[i]` (empty: every tensor in the
    /// default group). Fails, making nothing, on a config out of range, a weight of the wrong
    /// length, or a CUDA accumulator (`DeviceMismatch`: see [`Optimizer::new_device`]).
    pub fn new(
        acc: &Accumulator,
        config: OptimizerConfig,
        groups: &[TensorGroup],
        weights: &[Grad<'_>],
    ) -> Result<Self> {
        Self::new_host(acc, config, groups, weights, None)
    }

    /// [`Optimizer::new`] over the caller's FP32 master weights, adopted: `masters` holds `len`
    /// values laid out as the accumulator's flat layout over the range this rank holds
    /// ([`Accumulator::shard`]: element k is flat element `shard.start + k`, so tensor i's
    /// masters start at [`Accumulator::offset`]`(i) - shard.start`; a step neither reads nor
    /// writes the padding between tensors, and [`Optimizer::load`] writes zeros there). Their
    /// values ARE the masters: creation does not overwrite them from `weights` (which give the
    /// model's dtypes and lengths), every step updates them in place, `load` writes into them,
    /// and no copy is kept. Fails, making nothing, as `new` does, and on a null or misaligned
    /// `masters`, or one that overlaps a weight (`InvalidArgument`: a step writes both; `step`
    /// refuses such weights too), or a `len` other than the shard's (`SizeMismatch`).
    ///
    /// # Safety
    /// `masters` must be valid for reads and writes of `len` f32 values in host memory for the
    /// optimizer's lifetime, and neither read nor written by anything else while one of its
    /// calls runs.
    pub unsafe fn with_masters(
        acc: &Accumulator,
        config: OptimizerConfig,
        groups: &[TensorGroup],
        weights: &[Grad<'_>],
        masters: *mut f32,
        len: usize,
    ) -> Result<Self> {
        Self::new_host(acc, config, groups, weights, Some((masters, len)))
    }

    fn new_host(
        acc: &Accumulator,
        config: OptimizerConfig,
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
        let plan = acc.plan().clone();
        let n = plan.descs.len();
        let groups = groups_for(groups, n)?;
        check_count(weights.len(), n)?;
        for (i, w) in weights.iter().enumerate() {
            check_len(i, w.len(), plan.descs[i].numel)?;
        }
        let held = plan.shard();
        let master = match adopt {
            Some((ptr, len)) => {
                check_masters(ptr as u64, len, &held)?;
                let adopted = Masters::Adopted { ptr, len };
                adopted.check_apart(weights.iter().copied())?;
                adopted
            }
            None => Masters::Owned(masters_from(&plan, &held, weights)),
        };
        let second = if config.algorithm.second_moment() { vec![0.0; held.len()] } else { vec![] };
        let state = State {
            lr: config.lr,
            steps: 0,
            consumed: None,
            first: vec![0.0; held.len()],
            second,
            master,
            held,
            device: None,
            steps_known: true,
        };
        Ok(Optimizer {
            algorithm: config.algorithm,
            rounding: config.rounding,
            groups,
            plan,
            dtypes: weights.iter().map(Grad::dtype).collect(),
            state: Mutex::new(state),
        })
    }

    /// [`Optimizer::new`] for a CUDA accumulator: the model's weights are device addresses
    /// (`weights[i]` holds tensor i's numel values of `dtypes[i]`, on the accumulator's device),
    /// and the masters, the state and the step count are allocated in device memory on the
    /// accumulator's stream. Reads the weights (waits for the stream). Fails, making nothing, on
    /// a config out of range, a wrong count, a weight that is not one device allocation of its
    /// tensor's length (`DeviceMismatch`, host memory included), or a CPU accumulator
    /// (`DeviceMismatch`).
    pub fn new_device(
        acc: &Accumulator,
        config: OptimizerConfig,
        groups: &[TensorGroup],
        weights: &[DevicePtr],
        dtypes: &[Dtype],
    ) -> Result<Self> {
        Self::new_on_device(acc, config, groups, weights, dtypes, None)
    }

    /// [`Optimizer::with_masters`] for a CUDA accumulator: [`Optimizer::new_device`] over the
    /// caller's FP32 masters at the device address `masters`, `len` values laid out as the held
    /// range of the flat layout (see `with_masters`), adopted: never overwritten from the
    /// weights, updated in place by every step (stream-ordered on the accumulator's stream),
    /// never freed. Creation does not read the weights and does not wait for the stream. Fails,
    /// making nothing, as `new_device` does, on a null or misaligned `masters`
    /// (`InvalidArgument`), a `len` other than the shard's (`SizeMismatch`), or a `masters`
    /// that is not one device allocation of `len` f32 values on the accumulator's device
    /// (`DeviceMismatch`).
    ///
    /// # Safety
    /// `masters` must stay allocated for the optimizer's lifetime, and nothing else may read or
    /// write it while a step enqueued on the stream runs.
    pub unsafe fn with_masters_device(
        acc: &Accumulator,
        config: OptimizerConfig,
        groups: &[TensorGroup],
        weights: &[DevicePtr],
        dtypes: &[Dtype],
        masters: DevicePtr,
        len: usize,
    ) -> Result<Self> {
        Self::new_on_device(acc, config, groups, weights, dtypes, Some((masters, len)))
    }

    fn new_on_device(
        acc: &Accumulator,
        config: OptimizerConfig,
        groups: &[TensorGroup],
        weights: &[DevicePtr],
        dtypes: &[Dtype],
        adopt: Option<(DevicePtr, usize)>,
    ) -> Result<Self> {
        config.validate()?;
        let Device::Cuda { ordinal, stream } = acc.device() else {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                "the accumulator is on the CPU: its optimizer takes host weights (Optimizer::new)",
            ));
        };
        let plan = acc.plan().clone();
        let n = plan.descs.len();
        let groups = groups_for(groups, n)?;
        check_count(weights.len(), n)?;
        if dtypes.len() != n {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("`dtypes` has {} entries for {n} tensors", dtypes.len()),
            ));
        }
        let numel: Vec<usize> = plan.descs.iter().map(|d| d.numel).collect();
        cuda::check_weights_on(ordinal, weights, dtypes, &numel)?;
        let held = plan.shard();
        if let Some((ptr, len)) = adopt {
            check_masters(ptr, len, &held)?;
            cuda::check_masters_on(ordinal, ptr, len)?;
            masters::check_apart(ptr, len, device_ranges(weights, dtypes, &numel))?;
        }
        let pieces_of = |held: &Range<usize>, bytes: bool| {
            let mut at = 0;
            (0..n)
                .filter_map(|i| {
                    let p = piece(&plan, i, held);
                    let start = if bytes { at } else { p.held.start };
                    at += p.tensor.len() * dtypes[i].size();
                    (!p.tensor.is_empty()).then_some(cuda::Piece {
                        tensor: i,
                        elements: p.tensor,
                        at: start,
                    })
                })
                .collect::<Vec<_>>()
        };
        let shards = plan.config.sharding.shard().map(|(_, rank)| {
            (plan.shards().iter().map(|r| pieces_of(r, true)).collect::<Vec<_>>(), rank)
        });
        let device = DeviceOptimizer::new(Setup {
            ordinal,
            stream: stream.cast(),
            lr: config.lr,
            dtypes,
            groups: &groups,
            pieces: pieces_of(&held, false),
            held: held.clone(),
            second_moment: config.algorithm.second_moment(),
            shards,
            weights,
            masters: adopt.map(|(ptr, _)| ptr),
        })?;
        let state = State {
            lr: config.lr,
            steps: 0,
            consumed: None,
            held,
            master: Masters::default(),
            first: vec![],
            second: vec![],
            device: Some(device),
            steps_known: true,
        };
        Ok(Optimizer {
            algorithm: config.algorithm,
            rounding: config.rounding,
            groups,
            plan,
            dtypes: dtypes.to_vec(),
            state: Mutex::new(state),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// The protocol step of a sharded step, fingerprinting what every rank's optimizer must
    /// share: ranks that differ (another rounding, a bf16 weight against an f16 one, another
    /// learning rate or step count) fail together instead of stepping their shards by different
    /// rules or all-gathering pieces of different sizes. `schedule` is the learning rate and
    /// step count when the host holds them; a device mixes its own into the claim.
    fn step_kind(&self, schedule: Option<(f32, u64)>) -> Step {
        let (code, params) = self.algorithm.encode();
        let mut bytes = code.to_le_bytes().to_vec();
        params.iter().for_each(|p| bytes.extend(p.to_bits().to_le_bytes()));
        match self.rounding {
            Rounding::NearestEven => bytes.push(0),
            Rounding::Stochastic { seed } => {
                bytes.push(1);
                bytes.extend(seed.to_le_bytes());
            }
        }
        for (d, g) in self.dtypes.iter().zip(&self.groups) {
            bytes.extend(d.code().to_le_bytes());
            bytes.push(g.weight_decay as u8);
            bytes.extend(g.lr_scale.to_bits().to_le_bytes());
        }
        if let Some((lr, steps)) = schedule {
            bytes.extend(lr.to_bits().to_le_bytes());
            bytes.extend(steps.to_le_bytes());
        }
        Step::Optimizer { setup: crate::state::checksum(&bytes) }
    }

    /// The learning rate of the next step. On a CUDA accumulator it lives in device memory
    /// ([`Optimizer::lr_device_ptr`]): this waits for the stream and reads it; if the device
    /// cannot be read, the last value the host set.
    pub fn lr(&self) -> f32 {
        let s = self.lock();
        match s.device.as_ref().map(DeviceOptimizer::lr) {
            Some(Ok(lr)) => lr,
            _ => s.lr,
        }
    }

    /// Sets the learning rate of the steps from the next one on (a schedule calls it each step).
    /// On a CUDA accumulator the value is copied to the device on the accumulator's stream,
    /// so the steps enqueued before this call keep theirs.
    pub fn set_lr(&self, lr: f32) -> Result<()> {
        config::check_lr(lr)?;
        let mut s = self.lock();
        if let Some(device) = &s.device {
            device.set_lr(lr)?;
        }
        s.lr = lr;
        Ok(())
    }

    /// On a CUDA accumulator, the device address of the learning rate (one `float`) that every
    /// step reads when it runs on the stream. A schedule that runs on the device (a kernel, or
    /// a copy node in a captured graph) writes it there, so a captured step replays with the
    /// schedule and without the host. The value is used as written: it is not checked, as
    /// [`Optimizer::set_lr`] checks its own. `DeviceMismatch` on a CPU accumulator.
    pub fn lr_device_ptr(&self) -> Result<DevicePtr> {
        match &self.lock().device {
            Some(device) => Ok(device.lr_address()),
            None => Err(Error::new(
                ErrorKind::DeviceMismatch,
                "the optimizer steps a CPU accumulator: its learning rate is a host value (set_lr)",
            )),
        }
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
        let mut s = self.lock();
        if !s.steps_known {
            if let Some(Ok(steps)) = s.device.as_ref().map(DeviceOptimizer::steps) {
                (s.steps, s.steps_known) = (steps, true);
            }
        }
        s.steps
    }

    /// This rank's values of tensor `index` in `slot`: the range of the tensor's elements it
    /// holds (all of them without sharding) and their values. On a CUDA accumulator this reads
    /// the device (it waits for the stream).
    pub fn read(&self, index: usize, slot: Slot) -> Result<(Range<usize>, Vec<f32>)> {
        self.plan.layout.check_index(index)?;
        let s = self.lock();
        let p = piece(&self.plan, index, &s.held);
        let copy = s.device.as_ref().map(DeviceOptimizer::read).transpose()?;
        let (master, first, second) = match &copy {
            Some((_, [m, f, v])) => (&m[..], &f[..], &v[..]),
            None => (&s.master[..], &s.first[..], &s.second[..]),
        };
        let values = match slot {
            Slot::Weights => master,
            Slot::FirstMoment => first,
            Slot::SecondMoment if self.algorithm.second_moment() => second,
            Slot::SecondMoment => {
                return Err(Error::invalid("`slot`: SGD keeps no second moment".to_string()))
            }
        };
        Ok((p.tensor, values[p.held].to_vec()))
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
        if acc.device() != Device::Cpu {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                "the accumulator is on CUDA: step it with the weights' device addresses (Optimizer::step_device)",
            ));
        }
        let group = self.host_group(self.gather_group(acc, comm)?)?;
        let mut s = self.lock();
        let own = self.check_step(&s, acc, weights).err();
        // Under a sharded boundary every rank steps and gathers, or none: the ranks agree first,
        // so that a rank whose call is invalid never leaves the others waiting in the gather.
        match (&group, own) {
            (Some((h, ..)), own) => {
                let step = self.step_kind(Some((s.lr, s.steps)));
                let claim = ControlSum::of(&step.claim(&self.plan, None, own.is_some()));
                protocol::agree(step, Some(&HostChannel(*h)), None, &claim, own.as_ref())?;
            }
            (None, Some(e)) => return Err(e),
            (None, None) => {}
        }
        let stepped = acc.with_reduced("the optimizer step", |window, info, grad| {
            s.consumed = Some(window);
            if !info.found_inf {
                self.update(&mut s, grad, weights);
            }
            !info.found_inf
        })?;
        drop(s);
        if let (true, Some((h, shards, rank))) = (stepped, group) {
            self.all_gather(h, &shards, rank, weights)?;
        }
        Ok(stepped)
    }

    /// Takes part in a step this rank cannot make (the C ABI refused its arguments before
    /// `step`): under a sharded boundary the agreement, flagged invalid, so that the other ranks
    /// fail at once with PEER_FAILURE instead of waiting in the all-gather. Changes nothing.
    #[cfg(feature = "internal")]
    pub fn refuse_step(&self, acc: &Accumulator, comm: Option<&dyn Communicator>) {
        let Ok(Some((comm, ..))) = self.gather_group(acc, comm) else { return };
        match comm.collectives() {
            Collectives::Host(h) => {
                let claim = self.step_kind(None).claim(&self.plan, None, true);
                let _ = h.reduce_control(&ControlSum::of(&claim));
            }
            Collectives::Nccl(c) => {
                let s = self.lock();
                if let Some(d) = &s.device {
                    let refused = Error::invalid("this rank's step was refused");
                    let _ = d.agree(self.step_kind(None), &self.plan, c, Some(&refused));
                }
            }
        }
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
        if self.lock().device.is_none() {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                "the optimizer steps a CPU accumulator: use Optimizer::step with host weights",
            ));
        }
        let group = match self.gather_group(acc, comm)? {
            Some((c, ..)) => Some(nccl_of(c)?),
            None => None,
        };
        let mut s = self.lock();
        let device = s.device.as_ref().expect("checked above; never removed");
        let own = self.check_step_device(&s, device, acc, weights).err();
        match (group, own) {
            (Some(c), own) => device.agree(self.step_kind(None), &self.plan, c, own.as_ref())?,
            (None, Some(e)) => return Err(e),
            (None, None) => {}
        }
        let rule = cuda::rule(&self.algorithm, self.rounding);
        let stepped =
            acc.with_reduced_on_device("the optimizer step", |window, info, reduced| {
                s.consumed = Some(window);
                let device = s.device.as_ref().expect("checked above");
                device.step(reduced, weights, rule, group)?;
                match info {
                    Some(info) if !info.found_inf => s.steps += 1,
                    Some(_) => {}
                    None => s.steps_known = false,
                }
                Ok(info.map(|i| !i.found_inf))
            })?;
        Ok(stepped)
    }

    /// [`Optimizer::check_step`] on a device: the accumulator, the window, the weights' count
    /// and memory.
    fn check_step_device(
        &self,
        s: &State,
        device: &DeviceOptimizer,
        acc: &Accumulator,
        weights: &[DevicePtr],
    ) -> Result<()> {
        if !Arc::ptr_eq(acc.plan(), &self.plan) {
            return Err(Error::invalid(
                "`acc` is not the accumulator this optimizer was made over",
            ));
        }
        check_count(weights.len(), self.dtypes.len())?;
        let numel: Vec<usize> = self.plan.descs.iter().map(|d| d.numel).collect();
        device.check_weights(weights, &self.dtypes, &numel)?;
        if let Some((ptr, len)) = device.adopted() {
            masters::check_apart(ptr, len, device_ranges(weights, &self.dtypes, &numel))?;
        }
        let window = acc.synced_window_on_device("the optimizer step")?;
        if s.consumed == Some(window) {
            return Err(Error::wrong_state(
                "the optimizer already stepped from this window: sync again first",
            ));
        }
        Ok(())
    }

    /// Fails unless `acc` is this optimizer's, synced in a window not stepped yet, and
    /// `weights` are the model's (count, dtypes, lengths).
    fn check_step(&self, s: &State, acc: &Accumulator, weights: &[GradMut<'_>]) -> Result<()> {
        if !Arc::ptr_eq(acc.plan(), &self.plan) {
            return Err(Error::invalid(
                "`acc` is not the accumulator this optimizer was made over",
            ));
        }
        check_count(weights.len(), self.dtypes.len())?;
        for (i, w) in weights.iter().enumerate() {
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
        s.master.check_apart(weights.iter().map(GradMut::as_grad))?;
        let window = acc.synced_window("the optimizer step")?;
        if s.consumed == Some(window) {
            return Err(Error::wrong_state(
                "the optimizer already stepped from this window: sync again first",
            ));
        }
        Ok(())
    }

    /// The host collectives of a CPU step's all-gather, and the shards.
    fn host_group<'a>(&self, group: Option<ShardGroup<'a>>) -> Result<Option<GatherGroup<'a>>> {
        let Some((comm, shards, rank)) = group else { return Ok(None) };
        match comm.collectives() {
            Collectives::Host(h) => Ok(Some((h, shards, rank))),
            _ => Err(Error::new(
                ErrorKind::DeviceMismatch,
                "`comm`: a CPU accumulator's optimizer all-gathers over host communicators (in-process, MPI)",
            )),
        }
    }

    /// The communicator and shards over which a step all-gathers the weights, if any.
    fn gather_group<'a>(
        &self,
        acc: &'a Accumulator,
        comm: Option<&'a dyn Communicator>,
    ) -> Result<Option<ShardGroup<'a>>> {
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
        Ok(Some((comm, self.plan.shards(), rank)))
    }

    /// One step of every held element, its model weight written as it goes.
    fn update(&self, s: &mut State, grad: &[f32], weights: &mut [GradMut<'_>]) {
        let t = s.steps + 1;
        let State { lr, held, master, first, second, .. } = s;
        for (i, w) in weights.iter_mut().enumerate() {
            let p = piece(&self.plan, i, held);
            let group = self.groups[i];
            let lr = *lr as f64 * group.lr_scale as f64;
            let k = Scalars::new(&self.algorithm, lr, group.weight_decay, t);
            let state = pass::Piece {
                grad: &grad[p.held.clone()],
                master: &mut master[p.held.clone()],
                first: &mut first[p.held.clone()],
                second: if second.is_empty() { &mut [] } else { &mut second[p.held.clone()] },
            };
            let threads = self.plan.config.threads;
            let out = w.slice_mut(p.tensor);
            pass::step_threads(&k, state, out, self.rounding, t, p.flat.start, threads);
        }
        s.steps = t;
    }

    /// Every rank's part of the model weights to every rank, bit for bit.
    fn all_gather(
        &self,
        h: &dyn HostCollectives,
        shards: &[Range<usize>],
        rank: usize,
        weights: &mut [GradMut<'_>],
    ) -> Result<()> {
        let pieces = |q: usize| {
            (0..self.dtypes.len()).filter_map(move |i| {
                let p = piece(&self.plan, i, &shards[q]);
                (!p.tensor.is_empty()).then_some((i, p.tensor))
            })
        };
        let bytes =
            |q: usize| -> usize { pieces(q).map(|(i, r)| r.len() * self.dtypes[i].size()).sum() };
        let counts: Vec<usize> = (0..shards.len()).map(bytes).collect();
        let mut mine = Vec::with_capacity(counts[rank]);
        for (i, r) in pieces(rank) {
            append_bytes(&weights[i], r, &mut mine);
        }
        let all = h.allgather_bytes(&mine, &counts)?;
        let mut at = 0;
        for q in 0..shards.len() {
            for (i, r) in pieces(q) {
                let n = r.len() * self.dtypes[i].size();
                if q != rank {
                    set_bytes(&mut weights[i], r, &all[at..at + n]);
                }
                at += n;
            }
        }
        Ok(())
    }

    /// The optimizer's state (this rank's part of it), versioned and checksummed. The format is
    /// the same on every device: on a CUDA accumulator the state is copied to the host (this
    /// waits for the stream).
    pub fn save(&self) -> Result<Vec<u8>> {
        let s = self.lock();
        let Some(device) = &s.device else { return Ok(saved::encode(self, &s)) };
        let (steps, [master, first, second]) = device.read()?;
        let lr = device.lr()?;
        config::check_lr(lr).map_err(|e| {
            Error::invalid(format!("the learning rate in device memory: {}", e.message))
        })?;
        let copy = State {
            lr,
            steps,
            consumed: None,
            held: s.held.clone(),
            master: Masters::Owned(master),
            first,
            second,
            device: None,
            steps_known: true,
        };
        Ok(saved::encode(self, &copy))
    }

    /// Restores the state from saved parts: the bytes [`Optimizer::save`] wrote on any number of
    /// ranks (one part without sharding), together covering this rank's elements, from an
    /// optimizer with the same tensors, model dtypes, algorithm and rounding. Corrupt, foreign
    /// or insufficient parts are refused with `CorruptState`, and two parts that hold the same
    /// element (the same part given twice, or parts of two saves) with `InvalidArgument`,
    /// naming them; either way the optimizer is unchanged.
    /// The next step may be from the current window (the window it last stepped is forgotten).
    /// Adopted masters are written in place, the padding between tensors with zeros.
    pub fn load(&self, parts: &[&[u8]]) -> Result<()> {
        let mut s = self.lock();
        let restored = saved::decode(self, &s.held, parts)?;
        match s.device.take() {
            // Copied to the device (stream-ordered); a failed copy leaves the device's state
            // unknown, and is reported.
            Some(device) => {
                let r = &restored;
                let written = device.write(r.steps, r.lr, &r.master, &r.first, &r.second);
                *s = State {
                    device: Some(device),
                    master: Masters::default(),
                    first: vec![],
                    second: vec![],
                    ..restored
                };
                written
            }
            // Into the masters in place: adopted ones stay the caller's buffer.
            None => {
                let mut master = std::mem::take(&mut s.master);
                master.copy_from_slice(&restored.master);
                *s = State { master, ..restored };
                Ok(())
            }
        }
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

/// The NCCL communicator of a CUDA step's all-gather.
fn nccl_of(comm: &dyn Communicator) -> Result<&NcclComm> {
    match comm.collectives() {
        Collectives::Nccl(c) => Ok(c),
        Collectives::Host(_) => Err(Error::new(
            ErrorKind::DeviceMismatch,
            "`comm`: a CUDA accumulator's optimizer all-gathers over an NCCL communicator",
        )),
    }
}

/// The group a sharded step all-gathers over: its communicator, every rank's shard, this rank.
type ShardGroup<'a> = (&'a dyn Communicator, Vec<Range<usize>>, usize);

/// Where a sharded step all-gathers: the host collectives, every rank's shard, this rank.
type GatherGroup<'a> = (&'a dyn HostCollectives, Vec<Range<usize>>, usize);

/// Where tensor `i`'s elements inside `held` (a range of the flat layout) are.
#[derive(Clone, Debug)]
struct Piece {
    /// In the flat layout.
    flat: Range<usize>,
    /// Counted from the tensor's start.
    tensor: Range<usize>,
    /// Counted from `held`'s start.
    held: Range<usize>,
}

/// Tensor `i`'s piece of `held`; empty (at the starts) when it has no element there.
fn piece(plan: &Plan, i: usize, held: &Range<usize>) -> Piece {
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

/// The held masters of an owned optimizer: the model's weights widened, zeros in the padding.
fn masters_from(plan: &Plan, held: &Range<usize>, weights: &[Grad<'_>]) -> Vec<f32> {
    let mut master = vec![0.0f32; held.len()];
    for (i, w) in weights.iter().enumerate() {
        let p = piece(plan, i, held);
        let values = w.slice(p.tensor.start, p.tensor.end);
        for (m, v) in master[p.held].iter_mut().zip(0..) {
            *m = value_at(&values, v);
        }
    }
    master
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

/// The byte addresses of device weights of `dtypes` and `numel` elements.
fn device_ranges<'a>(
    weights: &'a [DevicePtr],
    dtypes: &'a [Dtype],
    numel: &'a [usize],
) -> impl Iterator<Item = Range<usize>> + 'a {
    weights.iter().zip(dtypes).zip(numel).map(|((&w, d), &n)| w as usize..w as usize + n * d.size())
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

fn value_at(g: &Grad<'_>, at: usize) -> f32 {
    match g {
        Grad::F32(b) => b[at],
        Grad::F16(b) => f16_to_f32(b[at]),
        Grad::Bf16(b) => bf16_to_f32(b[at]),
    }
}

fn append_bytes(w: &GradMut<'_>, r: Range<usize>, out: &mut Vec<u8>) {
    match w {
        GradMut::F32(b) => b[r].iter().for_each(|v| out.extend(v.to_bits().to_le_bytes())),
        GradMut::F16(b) | GradMut::Bf16(b) => b[r].iter().for_each(|v| out.extend(v.to_le_bytes())),
    }
}

fn set_bytes(w: &mut GradMut<'_>, r: Range<usize>, bytes: &[u8]) {
    match w {
        GradMut::F32(b) => b[r].iter_mut().zip(bytes.chunks_exact(4)).for_each(|(v, c)| {
            *v = f32::from_bits(u32::from_le_bytes(c.try_into().expect("4 bytes")))
        }),
        GradMut::F16(b) | GradMut::Bf16(b) => b[r]
            .iter_mut()
            .zip(bytes.chunks_exact(2))
            .for_each(|(v, c)| *v = u16::from_le_bytes(c.try_into().expect("2 bytes"))),
    }
}
