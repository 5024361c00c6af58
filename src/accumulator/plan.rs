//! What an accumulator is made of besides its window ([`Plan`]: its config, tensors and layout,
//! and what the ranks must hold alike), and what a boundary hands between the accumulator and
//! its store: this rank's [`Proposal`], what the ranks [`Agreed`], where the result is.

use std::ops::Range;

use super::{AccumulatorConfig, Layout, LossReduction, Overflow, Sharding, TensorDesc};
use crate::comm::{Communicator, ControlSum, OverflowKey};
use crate::device::DevicePtr;
use crate::dtype::Dtype;
use crate::error::Error;
use crate::state;

/// What an accumulator is made of besides its window: shared with its store.
#[derive(Debug)]
pub(crate) struct Plan {
    pub config: AccumulatorConfig,
    pub descs: Vec<TensorDesc>,
    pub layout: Layout,
}

impl Plan {
    /// What the ranks of a group must hold alike to reduce together: the layout, and the settings
    /// that decide what the boundary computes (the loss reduction, the normalisation and the
    /// clipping norm, the shard count and the wire dtype). Ranks that differ in any of them would
    /// end with different gradients, or run different collectives.
    pub(crate) fn fingerprint(&self) -> u64 {
        let c = &self.config;
        let mut bytes = self.layout.hash().to_le_bytes().to_vec();
        bytes.push(matches!(c.loss_reduction, LossReduction::Sum) as u8);
        bytes.extend(c.normalize.code().to_le_bytes());
        bytes.extend(c.max_grad_norm.to_bits().to_le_bytes());
        match c.sharding {
            Sharding::None => {}
            Sharding::ReduceScatter { shards, .. } => bytes.extend((shards as u64).to_le_bytes()),
            // Sharded accumulation reduces every micro-batch: it never pairs with the others.
            Sharding::Accumulate { shards, .. } => {
                bytes.extend((shards as u64 | 1 << 63).to_le_bytes())
            }
        }
        if c.wire != Dtype::F32 {
            bytes.extend(c.wire.code().to_le_bytes());
        }
        // The policy decides what the ranks count; telemetry adds a gather to the boundary.
        if c.overflow != Overflow::SkipStep {
            bytes.extend([0x0f, c.overflow.code() as u8]);
        }
        if c.tensor_stats {
            bytes.extend([0x75, 1]);
        }
        state::checksum(&bytes)
    }

    /// Every rank's shard under either sharded policy, in rank order; empty without sharding.
    /// Shards split the flat layout into equal parts rounded up to whole blocks of the norm
    /// ([`NORM_BLOCK`](crate::math::NORM_BLOCK) elements, so a shard's block sums
    /// are the all-reduce's); the last ones may be shorter or empty.
    pub(crate) fn shards(&self) -> Vec<Range<usize>> {
        let Some((shards, _)) = self.config.sharding.shard() else { return Vec::new() };
        crate::comm::shares::shard_ranges(self.layout.len(), shards)
    }

    /// This rank's shard; the whole layout without sharding.
    pub(crate) fn shard(&self) -> Range<usize> {
        match self.config.sharding.shard() {
            Some((shards, rank)) => {
                crate::comm::shares::shard_range(self.layout.len(), shards, rank)
            }
            None => 0..self.layout.len(),
        }
    }

    /// The part of the flat master the store holds: the shard under sharded accumulation, the
    /// whole layout otherwise.
    pub(crate) fn held(&self) -> Range<usize> {
        self.held_in(&self.layout)
    }

    /// What [`Plan::held`] would be in `layout` (the packed layout of a window saved by 0.2).
    pub(super) fn held_in(&self, layout: &Layout) -> Range<usize> {
        match self.config.sharding {
            Sharding::Accumulate { shards, rank } => {
                crate::comm::shares::shard_range(layout.len(), shards, rank)
            }
            _ => 0..layout.len(),
        }
    }
}

/// What this rank brings to a boundary.
pub(crate) struct Proposal<'a> {
    pub comm: Option<&'a dyn Communicator>,
    /// A hybrid boundary's replica group: the shard is then all-reduced over it.
    pub replicas: Option<&'a dyn Communicator>,
    pub count: u64,
    pub microbatches: u64,
    /// The rank-windows this rank's window sums (at least 1).
    pub ranks: u64,
    /// Micro-batches this rank dropped, and where its window first went non-finite.
    pub dropped: u64,
    pub first_bad: Option<(u64, usize)>,
    /// The window was restored holding a non-finite value whose place was not saved.
    pub unlocated: bool,
    /// With `tensor_stats`: in how many micro-batches each tensor went non-finite on this rank.
    pub nonfinite: Vec<u64>,
    /// This rank's call is invalid; the store tells the other ranks if its transport can.
    pub error: Option<Error>,
    /// The caller reads the group's totals before the reduction and may replace them (a mesh
    /// step's job totals): a device store agrees them on the host ([`Agreed::totals`]).
    pub host_totals: bool,
    /// The clipping factor is left pending rather than applied to the gradient in memory: an
    /// optimizer steps right after ([`Accumulator::sync_for_step`](super::Accumulator::sync_for_step)).
    /// A store that cannot defer applies it as ever.
    pub defer_clip: bool,
}

impl Proposal<'_> {
    /// This rank's place in the world of the boundary's groups: at a hybrid boundary, replica
    /// group rank times the shard group's size plus the shard group rank.
    pub(crate) fn world_rank(&self) -> usize {
        let rank = self.comm.map_or(0, |c| c.rank());
        match self.replicas {
            Some(r) => r.rank() * self.comm.map_or(1, |c| c.world_size()) + rank,
            None => rank,
        }
    }

    /// Whether the window's flag, set where this rank knows no place, is reported unlocated: a
    /// whole master's is (its own sum went non-finite, or a restored window's place is unknown).
    /// A sharded accumulation's flag also takes the other ranks' values and their sums, and each
    /// rank names its own gradients' places, so a flag without one is another rank's, which
    /// names it, or a sum's: the reduction (unless the window was restored holding it).
    pub(crate) fn unlocated_if_flagged(&self, plan: &Plan) -> bool {
        !matches!(plan.config.sharding, Sharding::Accumulate { .. }) || self.unlocated
    }

    /// The [`OverflowKey`] of this rank's first non-finite place; with only the window's flag
    /// `found_inf` set (a saved window, or a store that cannot locate), [`OverflowKey::UNLOCATED`].
    pub(crate) fn first_bad(&self, found_inf: bool) -> u64 {
        match self.first_bad {
            Some((microbatch, tensor)) => OverflowKey::of(microbatch, tensor, self.world_rank()),
            None if found_inf => OverflowKey::UNLOCATED,
            None => OverflowKey::NONE,
        }
    }
}

/// What the ranks agreed on, as far as the host knows before the reduction.
pub(crate) struct Agreed {
    /// The global totals, when the host has them (the CPU always; a device alone, or when the
    /// proposal asks for [`Proposal::host_totals`]): the accumulator then tells an empty window
    /// before anything changes, and a device's reduction normalises by these.
    pub totals: Option<ControlSum>,
}

/// A synced window's result in device memory: what a device optimizer steps from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reduced {
    /// The reduced gradient of [`Plan::shard`]'s range, from its first element (f32).
    pub grad: DevicePtr,
    /// The boundary's `ga_boundary` (its overflow flag and emptiness decide a skip).
    pub boundary: DevicePtr,
}
