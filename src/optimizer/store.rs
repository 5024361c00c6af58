//! What a device supplies to the optimizer: its state's memory (masters, moments, step count,
//! learning rate), the fused step pass over the range this rank holds, and the all-gather of the
//! weights under sharding. `backend::optimizer_store_for` makes one per device; the rules (the
//! update, the checks, the agreement, the saved format) are the optimizer's, above it.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use super::config::{Algorithm, TensorGroup};
use super::format::StateFormat;
use super::fp8::{WeightFormat, WeightMut};
use super::piece;
use super::rounding::Rounding;
use crate::accumulator::protocol::{self, HostChannel, Step};
use crate::accumulator::{Accumulator, Plan};
use crate::comm::{Communicator, ControlSum, HostCollectives};
use crate::device::DevicePtr;
use crate::dtype::{Dtype, Grad};
use crate::error::{Error, Result};

/// The model's weights a step writes, tensor by tensor, in the accumulator's memory: host slices
/// for the CPU, device addresses (each holding its tensor's numel values of the dtype given at
/// creation) for CUDA.
#[derive(Debug)]
pub(crate) enum Weights<'a, 'b> {
    Host(&'a mut [WeightMut<'b>]),
    Device(&'a [DevicePtr]),
}

impl<'a, 'b> Weights<'a, 'b> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Weights::Host(w) => w.len(),
            Weights::Device(w) => w.len(),
        }
    }

    /// The host weights a host store writes (the optimizer checked the device already).
    pub(crate) fn host(self) -> Result<&'a mut [WeightMut<'b>]> {
        match self {
            Weights::Host(w) => Ok(w),
            Weights::Device(_) => Err(Error::invalid("device weights for a host optimizer")),
        }
    }

    /// The device addresses a device store writes.
    pub(crate) fn device(self) -> Result<&'a [DevicePtr]> {
        match self {
            Weights::Device(w) => Ok(w),
            Weights::Host(_) => Err(Error::invalid("host weights for a device optimizer")),
        }
    }

    /// The byte addresses of each weight, of `dtypes` and `numel` elements.
    pub(crate) fn ranges(&self, dtypes: &[Dtype], numel: &[usize]) -> Vec<Range<usize>> {
        match self {
            Weights::Host(w) => w.iter().map(WeightMut::addresses).collect(),
            Weights::Device(w) => device_ranges(w, dtypes, numel).collect(),
        }
    }
}

/// The model's weights an optimizer is made from: host values, or device addresses.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Init<'a> {
    Host(&'a [Grad<'a>]),
    Device(&'a [DevicePtr]),
}

/// What a store is made of, worked out and checked by the optimizer (the adopted masters are
/// checked by [`Setup::check_adopted`], which the store calls among its own checks).
pub(crate) struct Setup<'a> {
    pub plan: &'a Arc<Plan>,
    pub algorithm: Algorithm,
    pub rounding: Rounding,
    pub format: StateFormat,
    /// The learning rate of the first step.
    pub lr: f32,
    /// Per tensor: its group, and the model weights' dtype.
    pub groups: &'a [TensorGroup],
    pub dtypes: &'a [Dtype],
    /// How the step writes each tensor's model weights.
    pub weight_formats: &'a [WeightFormat],
    /// The model weights whose held elements become the masters, unless the caller's are adopted.
    pub weights: Init<'a>,
    /// The caller's masters (host or device address) and their length, adopted.
    pub masters: Option<(*mut f32, usize)>,
}

impl Setup<'_> {
    /// The range of the flat layout this rank holds.
    pub(crate) fn held(&self) -> Range<usize> {
        self.plan.shard()
    }

    /// Each tensor's element count.
    pub(crate) fn numel(&self) -> Vec<usize> {
        self.plan.descs.iter().map(|d| d.numel).collect()
    }

    /// Fails unless the adopted masters, if any, can hold the held range and lie apart from the
    /// weights; `on_device` checks them on the device, between the two.
    pub(crate) fn check_adopted(
        &self,
        on_device: impl FnOnce(DevicePtr, usize) -> Result<()>,
    ) -> Result<()> {
        let Some((ptr, len)) = self.masters else { return Ok(()) };
        let ptr = ptr as u64;
        super::check_masters(ptr, len, &self.held())?;
        on_device(ptr, len)?;
        let ranges: Vec<Range<usize>> = match self.weights {
            Init::Host(w) => w.iter().map(Grad::addresses).collect(),
            Init::Device(w) => device_ranges(w, self.dtypes, &self.numel()).collect(),
        };
        super::check_apart(ptr, len, ranges.into_iter())
    }

    /// The pieces of each tensor inside `held` (a range of the flat layout), in tensor order:
    /// `at` is the held index of the first element, or with `bytes` its byte offset among the
    /// pieces' model weights.
    pub(crate) fn pieces(&self, held: &Range<usize>, bytes: bool) -> Vec<Span> {
        let mut at = 0;
        (0..self.dtypes.len())
            .filter_map(|i| {
                let p = piece(self.plan, i, held);
                let start = if bytes { at } else { p.held.start };
                at += p.tensor.len() * self.dtypes[i].size();
                (!p.tensor.is_empty()).then_some(Span { tensor: i, elements: p.tensor, at: start })
            })
            .collect()
    }

    /// Under sharding: every rank's pieces (`at` in bytes, counted from the rank's first), and
    /// this rank.
    pub(crate) fn shards(&self) -> Option<(Vec<Vec<Span>>, usize)> {
        let (_, rank) = self.plan.config.sharding.shard()?;
        Some((self.plan.shards().iter().map(|r| self.pieces(r, true)).collect(), rank))
    }
}

/// One tensor's elements in a table: tensor `tensor`, its elements `elements` (counted from the
/// tensor's start), and where the first one goes (`at`: a held index, or a byte offset).
pub(crate) struct Span {
    pub tensor: usize,
    pub elements: Range<usize>,
    pub at: usize,
}

/// The state a store holds, read or to be written: the learning rate, the step count, and the
/// held masters (or remainders) and moments (`second` empty for SGD), each in its format.
pub(crate) struct Values<'a> {
    pub lr: f32,
    pub steps: u64,
    pub master: Column<'a>,
    pub first: Column<'a>,
    pub second: Column<'a>,
}

/// One held value per element: f32, or 16-bit words (bf16 moments, the masters' remainders),
/// or 8-bit blockwise moments of `map` (a code per element, a scale per block).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Column<'a> {
    F32(&'a [f32]),
    U16(&'a [u16]),
    Blocks { codes: &'a [u8], scales: &'a [f32], signed: bool },
}

impl Column<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Column::F32(v) => v.len(),
            Column::U16(v) => v.len(),
            Column::Blocks { codes, .. } => codes.len(),
        }
    }

    /// The values of `range` (from a block boundary for blocks) as f32: 16-bit words widened as
    /// bf16, or (`integers`) as the integers they are; blocks decoded.
    pub(crate) fn widened(&self, range: Range<usize>, integers: bool) -> Vec<f32> {
        match self {
            Column::F32(v) => v[range].to_vec(),
            Column::U16(v) if integers => v[range].iter().map(|&b| b as f32).collect(),
            Column::U16(v) => v[range].iter().map(|&b| crate::math::bf16_to_f32(b)).collect(),
            Column::Blocks { codes, scales, signed } => {
                let map = super::blockwise::map(!signed as usize);
                let blocks = &scales[range.start / super::blockwise::BLOCK..];
                super::blockwise::dequantise_all(map, &codes[range], blocks)
            }
        }
    }
}

/// What every rank's optimizer must share in a sharded step (algorithm, rounding, model dtypes,
/// groups), hashed once at creation; a step's claim hashes it with the learning rate and step
/// count.
#[derive(Debug)]
pub(crate) struct Fingerprint(pub u64);

impl Fingerprint {
    /// The protocol step of a sharded step: ranks that differ fail together instead of stepping
    /// their shards by different rules or all-gathering pieces of different sizes. `schedule` is
    /// the learning rate and step count when the host holds them; a device mixes its own into the
    /// claim.
    pub(crate) fn step(&self, schedule: Option<(f32, u64)>) -> Step {
        let mut bytes = self.0.to_le_bytes().to_vec();
        if let Some((lr, steps)) = schedule {
            bytes.extend(lr.to_bits().to_le_bytes());
            bytes.extend(steps.to_le_bytes());
        }
        Step::Optimizer { setup: crate::state::checksum(&bytes) }
    }
}

/// The group a sharded step all-gathers over: its communicator, every rank's shard, this rank.
pub(crate) struct Gather<'a> {
    pub comm: &'a dyn Communicator,
    pub shards: Vec<Range<usize>>,
    pub rank: usize,
}

/// The agreement of a sharded step over host collectives, with the schedule the host holds.
pub(crate) fn agree_on_host(
    h: &dyn HostCollectives,
    kind: &Fingerprint,
    schedule: (f32, u64),
    plan: &Plan,
    own: Option<&Error>,
) -> Result<()> {
    let step = kind.step(Some(schedule));
    let claim = ControlSum::of(&step.claim(plan, None, own.is_some()));
    protocol::agree(step, Some(&HostChannel(h)), None, &claim, own).map(drop)
}

/// An optimizer's state in one device's memory, and the passes over it. Calls are serialised by
/// the optimizer's lock.
pub(crate) trait OptimizerStore: Send + fmt::Debug {
    /// The learning rate of the next step: read from the device's memory (this waits for it),
    /// or, if it cannot be read, the last value set.
    fn lr(&self) -> f32;

    /// Sets the learning rate (checked by the caller) of the steps from the next one on.
    fn set_lr(&mut self, lr: f32) -> Result<()>;

    /// The device address of the learning rate every step reads; none in host memory.
    fn lr_address(&self) -> Option<DevicePtr> {
        None
    }

    /// Steps taken: the device's count when the host does not know it (this waits), or, if it
    /// cannot be read, the last count the host knew.
    fn steps(&mut self) -> u64;

    /// Runs `f` on the state: in place in host memory, else on a host copy (this waits).
    fn view(&self, f: &mut dyn FnMut(&Values<'_>)) -> Result<()>;

    /// Overwrites the state with `values` (adopted masters in place); a device's copy is
    /// stream-ordered, and a failed one is reported with the state unknown.
    fn restore(&mut self, values: &Values<'_>) -> Result<()>;

    /// The adopted masters' address and length.
    fn adopted(&self) -> Option<(DevicePtr, usize)>;

    /// Fails unless `comm` is the kind of communicator this store all-gathers over.
    fn takes(&self, comm: &dyn Communicator) -> Result<()>;

    /// Fails unless the weights (of the model's count and, on the host, dtypes and lengths) are
    /// in this device's memory: a device refuses what is not one allocation of its tensor.
    fn check_weights(&self, _weights: &Weights<'_, '_>) -> Result<()> {
        Ok(())
    }

    /// The agreement of a sharded step over `comm` at `kind`, this rank's claim flagged invalid
    /// with `own` (whose error it returns); every rank's verdict is the same.
    fn agree(
        &self,
        kind: &Fingerprint,
        plan: &Plan,
        comm: &dyn Communicator,
        own: Option<&Error>,
    ) -> Result<()>;

    /// Takes part in a sharded step this rank cannot make, through the device's own agreement
    /// (a host communicator's peers are told by the optimizer).
    fn refuse(&self, _kind: &Fingerprint, _plan: &Plan, _comm: &dyn Communicator) {}

    /// One step from `acc`'s reduced gradient (checked synced, in a window not stepped yet, with
    /// the model's weights): the fused pass over the held range writing `weights`, nothing when
    /// the boundary overflowed, then under `gather` the all-gather of the weights. `consumed`
    /// takes the window once the step reads it. Returns whether it stepped, when the host knows.
    fn step(
        &mut self,
        acc: &Accumulator,
        weights: Weights<'_, '_>,
        gather: Option<&Gather<'_>>,
        consumed: &mut Option<u64>,
    ) -> Result<Option<bool>>;
}

/// The byte addresses of device weights of `dtypes` and `numel` elements.
pub(crate) fn device_ranges<'a>(
    weights: &'a [DevicePtr],
    dtypes: &'a [Dtype],
    numel: &'a [usize],
) -> impl Iterator<Item = Range<usize>> + 'a {
    weights.iter().zip(dtypes).zip(numel).map(|((&w, d), &n)| w as usize..w as usize + n * d.size())
}
