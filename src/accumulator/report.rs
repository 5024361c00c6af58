//! What a boundary reports, the same on every rank: the totals, the norm and the clipping
//! ([`SyncInfo`]), and where the window first went non-finite ([`OverflowAt`]), read from the
//! totals the ranks agreed.

use crate::comm::{ControlSum, OverflowKey};

/// What the boundary reports; identical on every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SyncInfo {
    /// Some rank saw a non-finite value in this window, or the reduced gradient holds one (every
    /// window was finite, their sum overflowed): the optimizer step must be skipped.
    pub found_inf: bool,
    /// Items added over all micro-batches and ranks.
    pub total_count: u64,
    /// Micro-batches added over all ranks.
    pub microbatches: u64,
    /// Global L2 norm of the normalised gradient, before clipping.
    pub grad_norm: f64,
    /// Factor applied by clipping (1 when clipping is off or not needed).
    pub clip_coef: f64,
    /// Micro-batches dropped over all ranks ([`Overflow::DropMicrobatch`]); their items and
    /// micro-batches are not in the totals above.
    ///
    /// [`Overflow::DropMicrobatch`]: super::Overflow::DropMicrobatch
    pub dropped_microbatches: u64,
    /// Where the window first went non-finite, the same on every rank; `None` when it stayed
    /// finite. `None` with `found_inf` when a rank's first non-finite place is unknown (a
    /// restored window holding one; on CUDA under `SkipStep`; a kept sum that overflowed a whole
    /// CUDA master under `DropMicrobatch`): it may precede every located place, so no rank names
    /// one.
    pub overflow: Option<OverflowAt>,
}

/// Where a window first went non-finite: the first place in the order micro-batch, then
/// tensor, then rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverflowAt {
    /// A non-finite value in rank `rank`'s micro-batch `microbatch` (its window's micro-batches
    /// counted from 0, dropped ones included; after a load, see [`Accumulator::load_window`](super::Accumulator::load_window)) in
    /// tensor `tensor`: a gradient value after unscaling, or the master where adding it
    /// overflowed.
    Gradient { rank: usize, microbatch: u64, tensor: usize },
    /// Every rank's window was finite; their sum overflowed.
    Reduction,
}

impl SyncInfo {
    /// The report from the agreed totals and the reduced gradient's norm: an overflow where a
    /// rank's window went non-finite, or the norm is not (every rank added finite values, but
    /// their sum overflowed, or a BF16 wire rounded a value to infinity).
    pub(crate) fn of(total: &ControlSum, grad_norm: f64, clip_coef: f64) -> Self {
        let found_inf = total.found_inf || !grad_norm.is_finite();
        let overflow = match OverflowKey::parts(total.first_bad) {
            Some((microbatch, tensor, rank)) => {
                Some(OverflowAt::Gradient { rank, microbatch, tensor })
            }
            None if total.first_bad == OverflowKey::NONE && found_inf => {
                Some(OverflowAt::Reduction)
            }
            None => None,
        };
        SyncInfo {
            found_inf,
            total_count: total.count,
            microbatches: total.microbatches,
            grad_norm,
            clip_coef,
            dropped_microbatches: total.dropped,
            overflow,
        }
    }
}
