//! What an accumulator is built from: its tensors and how it normalises at the boundary.

use crate::dtype::Dtype;
use crate::error::{Error, Result};

/// One model tensor whose gradient the accumulator receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorDesc {
    pub numel: usize,
    pub dtype: Dtype,
}

/// How the caller reduced its loss over the `count` items of a micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossReduction {
    /// The loss was averaged over the micro-batch's items.
    Mean,
    /// The loss was summed over the micro-batch's items.
    Sum,
}

/// What the summed gradient is divided by at the boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Normalize {
    /// The global item count (over micro-batches and ranks): the gradient of the mean loss over
    /// every item of the effective batch. A mean-reduced micro-batch is weighted by its count.
    ByCount,
    /// The global number of micro-batches: the usual `loss / steps` combined with a DDP mean.
    ByMicrobatches,
    /// The number of ranks: summed over micro-batches, averaged over ranks (DDP with no_sync).
    /// Precisely, the number of rank-windows the boundary sums: a window that merged saved
    /// windows counts each of them
    /// ([`Accumulator::merge_window`](super::Accumulator::merge_window)), so windows of N ranks
    /// merged into M normalise as the N ranks would have.
    ByWorld,
    /// The plain sum.
    None,
}

impl Normalize {
    /// What the summed gradient is divided by, given the window's global totals; 0 means there
    /// is nothing to normalise by (an empty window).
    pub fn divisor(self, total_count: u64, total_microbatches: u64, total_ranks: u64) -> u64 {
        match self {
            Normalize::ByCount => total_count,
            Normalize::ByMicrobatches => total_microbatches,
            Normalize::ByWorld => total_ranks,
            Normalize::None => 1,
        }
    }

    /// The stable code of the mode: GRADACC_NORMALIZE_* in the C API, GA_NORMALIZE_* in the
    /// kernels.
    pub fn code(self) -> i32 {
        match self {
            Normalize::ByCount => 0,
            Normalize::ByMicrobatches => 1,
            Normalize::ByWorld => 2,
            Normalize::None => 3,
        }
    }
}

/// What each rank holds of the reduced gradient after the boundary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sharding {
    /// Every rank holds the whole reduced gradient (an all-reduce, as DDP). The default.
    #[default]
    None,
    /// Rank `rank` of `shards` holds only its shard of the reduced gradient, a contiguous range of
    /// the flat layout ([`Accumulator::shard`](super::Accumulator::shard)): a reduce-scatter, a
    /// distributed optimizer's pattern. The window accumulates the whole gradient as with
    /// `None`; the norm and the clipping coefficient are the whole gradient's, the same on every
    /// rank, and the shard holds the bits an all-reduce would leave there. `sync` takes a
    /// communicator of `shards` ranks on which this is rank `rank`.
    ReduceScatter { shards: usize, rank: usize },
    /// Sharded accumulation (ZeRO-2, FSDP): rank `rank` of `shards` holds only its shard of the
    /// FP32 gradient, and every micro-batch is reduce-scattered as it is added. This doc is the
    /// contract; docs/sharding.md ("Sharded accumulation (ZeRO-2)") states it for every
    /// language, with examples and measurements, and the C header and the bindings point there.
    ///
    /// **Who holds what.** The shard is [`Accumulator::shard`]'s range, cut as under
    /// [`Sharding::ReduceScatter`]; besides it, FP32 staging: one stripe for `add` (a bucket's
    /// worth over all ranks), and for tensors added one by one each bucket from its first
    /// tensor until its turn to be reduced (one bucket at a time when they arrive in the
    /// backward's order; in the forward's, every bucket). Nothing else of the master exists:
    /// `read_master`, `with_master` and `master_ptr` take only a tensor wholly inside the shard
    /// (`InvalidArgument` otherwise), and no master buffer can be adopted.
    ///
    /// **The communicator** is given at creation ([`AccumulatorBuilder::communicator`]),
    /// `shards` ranks of which this is `rank`. The accumulator holds its own reference to it, so
    /// the group lives as long as the accumulator, whatever becomes of the caller's reference (MPI
    /// must stay initialised until then). `sync` and `sync_enqueue` take it or `None`; another communicator
    /// fails on every rank, `InvalidArgument` on the rank that passed it. With one shard there is
    /// no collective: [`Accumulator::new`] makes it, and it is the unsharded accumulation bit for
    /// bit.
    ///
    /// **Every rank makes the same calls.** Each micro-batch (`add`, or `begin_microbatch`,
    /// `add_tensor`s, `end_microbatch`) and each boundary is a collective over that communicator,
    /// so every rank makes the same sequence of them, each micro-batch with the rank's own item
    /// count; `reset` inside a micro-batch ends it as `end_microbatch` would, then discards.
    ///
    /// **An invalid call fails on every rank.** Each micro-batch opens with a control step in
    /// which the ranks compare their layouts and steps:
    /// - A rank whose call is invalid (a wrong tensor count, dtype, length or count, the wrong
    ///   state, an argument the C layer refused, or one a binding's `add` or `sync` refused)
    ///   still takes part: it fails with its own error, the others with `PeerFailure`; nothing
    ///   is added and every window is intact.
    /// - Ranks at different steps (the boundary on some, a micro-batch on others; `add` on some,
    ///   `begin_microbatch` on others) or with different accumulators all fail with
    ///   `SizeMismatch`, nothing reduced.
    /// - An `add_tensor` cannot be checked before its bucket moves: one refused on any rank (a
    ///   wrong length or dtype, a second contribution) fails the micro-batch on every rank at
    ///   `end_microbatch` (`WrongState` where it was refused, `PeerFailure` elsewhere), and every
    ///   window is discarded.
    /// - A reduction that fails after the control step (an abort, a timeout, a lost peer,
    ///   staging that cannot be allocated, which aborts the communicator) fails the call on every
    ///   rank and discards the windows ("(the window was discarded)").
    /// - On CUDA the ranks compare layouts once, at the first micro-batch (a host wait). After
    ///   it, a call refused on one rank (other than `add_tensor`) waits for that rank's earlier
    ///   collectives and aborts the communicator, its own window intact; the others fail with
    ///   `CommFailure`, or `Timeout` at the latest, and their windows are discarded.
    ///
    /// A window lost with its communicator resumes from a saved window in a new accumulation.
    ///
    /// **Tensor by tensor.** Each tensor takes one contribution per micro-batch (a second is
    /// `WrongState`), and the `add_tensor` calls run one at a time, from any threads (one may
    /// reduce a bucket). Buckets are reduced in the backward's order, the last first, each once
    /// all of its tensors have landed; `end_microbatch` reduces the rest, a tensor that received
    /// nothing contributing zeros.
    ///
    /// **What it computes.** Each micro-batch is converted, unscaled, weighted and checked as
    /// under every policy, summed over the ranks in rank order and added into the shard (the
    /// window's first micro-batch assigns). `add` and `add_tensor` give the same bits. The other
    /// policies sum each rank's micro-batches first and the ranks once, so the results differ by
    /// the order of the FP32 sums (and, with a BF16 wire, which here rounds each rank's
    /// contribution to every micro-batch once, by those roundings): the same values within
    /// rounding, not the same bits. On NCCL, whose reduce-scatter may order its sums otherwise,
    /// the ranks still agree.
    ///
    /// **The boundary** reduces no gradient. Counts, micro-batches and overflow are agreed once
    /// (a non-finite value on any rank, or a sum that overflows as it is added into a shard,
    /// skips the step on every rank); the norm is the whole gradient's, from every shard's block
    /// sums, the same on every rank; clipping scales the own shard. [`Accumulator::sync_hybrid`]
    /// with the creation communicator as the shard group first all-reduces the shard over the
    /// replicas, in FP32.
    ///
    /// **Checkpoints.** [`Accumulator::save_window`] writes the shard and names it; the bytes
    /// load and merge only into the same shard of an accumulation over as many ranks
    /// (`CorruptState` otherwise).
    ///
    /// [`Accumulator::shard`]: super::Accumulator::shard
    /// [`AccumulatorBuilder::communicator`]: super::AccumulatorBuilder::communicator
    /// [`Accumulator::new`]: super::Accumulator::new
    /// [`Accumulator::sync_hybrid`]: super::Accumulator::sync_hybrid
    /// [`Accumulator::save_window`]: super::Accumulator::save_window
    Accumulate { shards: usize, rank: usize },
}

/// What a non-finite gradient value costs the window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overflow {
    /// The window's step is skipped on every rank, as PyTorch's `GradScaler` does. The default.
    #[default]
    SkipStep,
    /// Only the micro-batch that held it is dropped, on the rank that fed it: the master is
    /// exactly as before that micro-batch, whose items and micro-batch do not count, and the
    /// window goes on. The boundary normalises by what was kept on every rank, and the step is
    /// skipped only when nothing was kept anywhere or the sum of the kept micro-batches
    /// overflows. docs/overflow.md states the policy for every language, with its costs.
    ///
    /// A micro-batch fed by [`Accumulator::add`](super::Accumulator::add) is checked before it
    /// is added (a read of its gradients). One fed tensor by tensor goes through an FP32 staging
    /// buffer the size of the master (allocated at its first use), added into the master when
    /// the micro-batch ends clean. A dropped micro-batch backs the scale off at the next update
    /// ([`Scaler::update_from`](crate::Scaler::update_from)).
    ///
    /// A window that drops every micro-batch on every rank is one skipped step: `sync` reports
    /// `found_inf` with no items and no micro-batches, every drop and the first place, a norm
    /// of 0 and a clipping coefficient of 1; the master reads +0.0 throughout; the next update
    /// counts one overflow however many micro-batches were dropped (one backoff once the
    /// hysteresis runs out; `ScaleAtMinimum` at the minimum scale, changing nothing), and the
    /// optimizer's step changes nothing.
    ///
    /// Under [`Sharding::Accumulate`], whose micro-batches are reduced over the ranks as they
    /// are fed: a dropping rank's `add` still takes part, with zeros, so the shards hold the
    /// other ranks' sums. A micro-batch fed tensor by tensor has its buckets reduced before its
    /// last tensor is seen, so a rank's poisoned gradient (staged as zeros) drops it on every
    /// rank: `end_microbatch` restores the shard from a copy made when it began (the shard's
    /// size, allocated at its first use), and each rank counts it dropped.
    ///
    /// CPU and CUDA accumulators, every sharding policy. On CUDA the check of an `add`, and the
    /// close of a micro-batch fed tensor by tensor, read per-tensor flags back to the host: each
    /// waits for the accumulator's stream, so such calls cannot be captured in a CUDA graph.
    DropMicrobatch,
}

impl Overflow {
    /// The stable code of the policy: GRADACC_OVERFLOW_* in the C API.
    pub fn code(self) -> i32 {
        match self {
            Overflow::SkipStep => 0,
            Overflow::DropMicrobatch => 1,
        }
    }
}

impl Sharding {
    /// The shard count and this rank's shard, under either sharded policy.
    pub fn shard(self) -> Option<(usize, usize)> {
        match self {
            Sharding::None => None,
            Sharding::ReduceScatter { shards, rank } | Sharding::Accumulate { shards, rank } => {
                Some((shards, rank))
            }
        }
    }
}

/// Configuration of an [`Accumulator`](super::Accumulator). `Default` gives the documented
/// defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AccumulatorConfig {
    /// Default [`LossReduction::Mean`].
    pub loss_reduction: LossReduction,
    /// Default [`Normalize::ByCount`].
    pub normalize: Normalize,
    /// Clip the boundary gradient's global L2 norm to this value; 0 disables clipping (default).
    pub max_grad_norm: f32,
    /// Target elements per communication bucket; buckets hold whole tensors (default 4M = 16 MiB).
    pub bucket_numel: usize,
    /// Threads used by one kernel call on large tensors; results do not depend on it (default 1).
    pub threads: usize,
    /// What each rank holds after the boundary (default [`Sharding::None`]: all of it).
    pub sharding: Sharding,
    /// What the boundary's reductions send (default [`Dtype::F32`]). [`Dtype::Bf16`] halves the
    /// bytes: each rank rounds its contribution to bf16 once, and the receiver sums the
    /// contributions in FP32, so over W ranks the error is at most (2^-8 + (W-1) * 2^-24) of the
    /// magnitude (the sum of the contributions' absolute values): the bf16 rounding's share does
    /// not grow with the number of ranks.
    pub wire: Dtype,
    /// What a non-finite gradient value costs (default [`Overflow::SkipStep`]).
    pub overflow: Overflow,
    /// Each boundary also measures every tensor: its norm and in how many micro-batches it went
    /// non-finite ([`Accumulator::tensor_stats`](super::Accumulator::tensor_stats)), at the
    /// cost of summing each tensor's squares in the boundary's pass and one small gather
    /// (default off; every device and sharding policy).
    pub tensor_stats: bool,
}

impl Default for AccumulatorConfig {
    fn default() -> Self {
        AccumulatorConfig {
            loss_reduction: LossReduction::Mean,
            normalize: Normalize::ByCount,
            max_grad_norm: 0.0,
            bucket_numel: 4 << 20,
            threads: 1,
            sharding: Sharding::None,
            wire: Dtype::F32,
            overflow: Overflow::SkipStep,
            tensor_stats: false,
        }
    }
}

/// The most items one rank's window may hold.
pub const MAX_WINDOW_COUNT: u64 = 1 << 47;

impl AccumulatorConfig {
    pub fn validate(&self) -> Result<()> {
        if !(self.max_grad_norm.is_finite() && self.max_grad_norm >= 0.0) {
            return Err(Error::invalid(format!(
                "max_grad_norm must be finite and >= 0 (0 = off), got {}",
                self.max_grad_norm
            )));
        }
        if self.bucket_numel == 0 {
            return Err(Error::invalid("bucket_numel must be >= 1, got 0"));
        }
        if self.threads == 0 || self.threads > 1024 {
            return Err(Error::invalid(format!(
                "threads must be in 1..=1024, got {}",
                self.threads
            )));
        }
        if let Some((shards, rank)) = self.sharding.shard() {
            if shards == 0 || rank >= shards {
                return Err(Error::invalid(format!(
                    "sharding: rank must be in 0..shards, got rank {rank} of {shards} shards"
                )));
            }
        }
        if self.wire == Dtype::F16 {
            return Err(Error::invalid(
                "wire: the reductions send f32 or bf16, got f16 (its range would overflow sums)",
            ));
        }
        Ok(())
    }

    /// Checks a micro-batch's item count against the loss reduction and the window's total so far.
    pub fn check_count(&self, window_total: u64, count: u64) -> Result<()> {
        if count == 0 && self.loss_reduction == LossReduction::Mean {
            return Err(Error::invalid(
                "count is 0, but a mean-reduced loss needs at least one item",
            ));
        }
        // 2^47 items per rank and window: sums over up to 65536 ranks stay exact in u64 on every
        // communicator (the MPI control words are plain u64 sums).
        if window_total.checked_add(count).is_none_or(|t| t > MAX_WINDOW_COUNT) {
            // Past 2^63 a count is most likely a negative number converted to unsigned.
            let wrapped = match i64::try_from(count) {
                Ok(_) => String::new(),
                Err(_) => format!(" (as a signed integer {}: a negative count?)", count as i64),
            };
            return Err(Error::invalid(format!(
                "count {count}{wrapped}: the window's item total would pass its limit of \
                 {MAX_WINDOW_COUNT} (2^47) items per rank; it holds {window_total}"
            )));
        }
        Ok(())
    }

    /// The multiplier weight of a micro-batch of `count` items (see `weights_by_count`).
    pub fn weight(&self, count: u64) -> f64 {
        if self.weights_by_count() {
            count as f64
        } else {
            1.0
        }
    }

    /// Whether a micro-batch's gradient is weighted by its item count as it is added: only a
    /// mean-reduced loss normalised by the global count needs it (mean × count = per-item sum).
    pub fn weights_by_count(&self) -> bool {
        self.loss_reduction == LossReduction::Mean && self.normalize == Normalize::ByCount
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_holds_at_most_max_window_count_items() {
        let c = AccumulatorConfig::default();
        assert!(c.check_count(0, MAX_WINDOW_COUNT).is_ok());
        assert!(c.check_count(MAX_WINDOW_COUNT - 5, 5).is_ok());
        let e = c.check_count(MAX_WINDOW_COUNT, 1).unwrap_err();
        assert!(e.message.contains("limit of 140737488355328 (2^47)"), "{}", e.message);
        assert!(c.check_count(u64::MAX, 1).is_err(), "no wrap-around");
        // 65536 full windows still sum exactly.
        assert!(MAX_WINDOW_COUNT.checked_mul(65536).is_some());
    }
}
