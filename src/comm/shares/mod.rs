//! The boundary's reduction in shares, for communicators between processes. The buffer is cut
//! into chunks and every chunk into one share per rank. Each rank receives the other ranks' copies
//! of its share, sums them in rank order, runs the boundary's pass on the sum while it is still in
//! cache, and then every rank gathers the finished shares. Each element is summed and passed once,
//! by its share's owner, so every rank holds the same bits by construction, and they are the bits
//! of the in-process communicator, which also sums in rank order.

mod buffers;
mod cut;
#[cfg(test)]
mod tests;

// Without MPI only the shared-memory transport and the tests use the buffers.
#[cfg_attr(not(feature = "mpi"), allow(unused_imports))]
pub(crate) use buffers::{
    skewed, skewed_ref, values, values_mut, words, words_mut, Workspace, PAGE, SKEW,
};
pub(crate) use cut::{shard_range, shard_ranges, Cut, ShardCut};
pub use cut::{Plan, SHARE_NUMEL};

use std::ops::Range;

use super::BlockPass;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::math::NORM_BLOCK;
use crate::simd;

/// Elements summed per step of [`sum_and_pass`] from rank 2 on: the running sum stays in L1.
const RUN: usize = 2048;

/// Sums the `world` contributions to one share in rank order, `((c0 + c1) + c2) + ...`, the order
/// of the in-process communicator, and runs `pass` on the sum. `own` holds rank `rank`'s
/// contribution and receives the result; `other(q)` is rank `q`'s contribution for every other
/// `q`, as long as `own`.
///
/// Addition commutes, so ranks 0 and 1 start from their own contribution and add in place, one
/// streaming pass per other rank, the last one fused with `pass` block by block (only a NaN's
/// payload can depend on the order of two NaNs, as it does between SIMD paths). Ranks from 2 on
/// sum run by run in a buffer that stays in L1, then pass.
pub fn sum_and_pass<'a>(
    own: &mut [f32],
    rank: usize,
    world: usize,
    other: impl Fn(usize) -> &'a [f32],
    pass: &dyn BlockPass,
    values: &mut [f64],
) {
    if rank <= 1 {
        let mut others = (0..world).filter(|&q| q != rank).peekable();
        while let Some(q) = others.next() {
            if others.peek().is_some() {
                simd::add_assign(own, other(q));
            } else {
                return pass.add_and_run(own, other(q), values);
            }
        }
        return pass.run(own, values);
    }
    let mut acc = [0f32; RUN];
    for start in (0..own.len()).step_by(RUN) {
        let run = start..(start + RUN).min(own.len());
        let acc = &mut acc[..run.len()];
        acc.copy_from_slice(&other(0)[run.clone()]);
        for q in 1..world {
            simd::add_assign(
                acc,
                if q == rank { &own[run.clone()] } else { &other(q)[run.clone()] },
            );
        }
        own[run].copy_from_slice(acc);
    }
    pass.run(own, values);
}

/// Where the reduction in shares is, for a transport's error messages (a timeout names it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// The exchange of chunk `chunk` (counted from 1) of `chunks`.
    Exchange { chunk: usize, chunks: usize },
    /// The gather of chunk `chunk` (counted from 1) of `chunks`.
    Gather { chunk: usize, chunks: usize },
    /// The final gather of every rank's block values.
    Values,
    /// The closing wait, after which every rank may reuse its outboxes.
    Done,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Step::Exchange { chunk, chunks } => {
                write!(f, "share reduction, chunk {chunk} of {chunks} (exchange)")
            }
            Step::Gather { chunk, chunks } => {
                write!(f, "share reduction, chunk {chunk} of {chunks} (gather)")
            }
            Step::Values => write!(f, "share reduction, the gather of the block sums"),
            Step::Done => write!(f, "share reduction, the closing wait"),
        }
    }
}

/// What the reduction in shares needs from a transport between ranks that do not share the
/// caller's memory. Every rank calls `exchange`, `gather`, `gather_values` and `finish` in the same
/// order, with the same ranges. `step` says where the reduction is, for error messages.
///
/// In one step the reduction stages the pieces this rank sends in the step's outbox, at the
/// word ranges of `packed` (this rank's own piece included, so every rank has the same ranges):
/// two 16-bit words per FP32 value, one per value on a bf16 wire.
pub(crate) trait ShareTransport {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// The most elements one rank's piece of a step may hold: the cut is capped to it.
    fn piece_limit(&self) -> usize {
        usize::MAX
    }

    /// Step `k`'s outbox, at least `words` words long. Steps alternate between outboxes, so the
    /// one of step `k` may be read by the other ranks until they reach step `k + 1`'s exchange.
    fn outbox(&mut self, k: usize, words: usize) -> &mut [u16];

    /// Sends `outbox[packed[q]]` to every other rank `q`; then [`ShareTransport::incoming`]`(q)`
    /// is rank `q`'s `outbox[packed[rank]]`: its copy of this rank's piece.
    fn exchange(&mut self, step: Step, k: usize, packed: &[Range<usize>]) -> Result<()>;

    /// Rank `q`'s copy of this rank's piece, after the exchange.
    fn incoming(&self, q: usize) -> &[u16];

    /// Every rank's finished piece, FP32 at `packed[q]` (in values) of step `k`'s outbox, to
    /// every other rank; then [`ShareTransport::finished`]`(q)` is rank `q`'s.
    fn gather(&mut self, step: Step, k: usize, packed: &[Range<usize>]) -> Result<()>;

    /// Rank `q`'s finished piece, after the gather.
    fn finished(&self, q: usize) -> &[f32];

    /// Every rank's `mine` (rank `q`'s holding `counts[q]` values) concatenated in rank order.
    /// It comes after every step's exchange, and before the gathers when the pass has a second
    /// step (they need every block's value).
    fn gather_values(&mut self, mine: &[f64], counts: &[usize]) -> Result<&[f64]>;

    /// After the last step: returns once no rank reads this rank's outboxes any more, so the
    /// next reduction may write them.
    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}

/// Sums `buf` over the ranks of `t` in shares of about `share_numel` elements and runs `pass` on
/// each share of the sum by its owner; returns the values `pass` wrote for every block of `buf`,
/// in block order, the same on every rank. See [`super::HostCollectives::allreduce_with_pass`].
pub(crate) fn reduce_in_shares(
    t: &mut (impl ShareTransport + ?Sized),
    buf: &mut [f32],
    share_numel: usize,
    pass: &dyn BlockPass,
) -> Result<Vec<f64>> {
    let plan = Plan::new(buf.len(), t.world(), share_numel.min(t.piece_limit()));
    reduce_by_cut(t, buf, &plan, true, pass)
}

/// One step's pieces in the buffer, and where each lies in the outbox (packed in rank order).
struct StepPieces {
    pieces: Vec<Range<usize>>,
    packed: Vec<Range<usize>>,
}

impl StepPieces {
    fn of(cut: &dyn Cut, world: usize, k: usize) -> StepPieces {
        let pieces: Vec<Range<usize>> = (0..world).map(|q| cut.piece(k, q)).collect();
        let mut at = 0;
        let packed = pieces
            .iter()
            .map(|p| {
                at += p.len();
                at - p.len()..at
            })
            .collect();
        StepPieces { pieces, packed }
    }

    /// The outbox's length in values.
    fn len(&self) -> usize {
        self.packed.last().map_or(0, |p| p.end)
    }
}

/// The finished piece of step `k` goes out through the outbox, and the others come back into the
/// caller's buffer once the gather completed.
fn gather_step(
    t: &mut (impl ShareTransport + ?Sized),
    buf: &mut [f32],
    k: usize,
    steps: usize,
    s: &StepPieces,
) -> Result<()> {
    let rank = t.rank();
    let len = s.len();
    simd::copy_for_peer(
        &mut values_mut(&mut t.outbox(k, 2 * len)[..2 * len])[s.packed[rank].clone()],
        &buf[s.pieces[rank].clone()],
    );
    t.gather(Step::Gather { chunk: k + 1, chunks: steps }, k, &s.packed)?;
    for q in (0..t.world()).filter(|&q| q != rank) {
        buf[s.pieces[q].clone()].copy_from_slice(t.finished(q));
    }
    Ok(())
}

/// As [`reduce_in_shares`], by any [`Cut`] (whose pieces the caller keeps within
/// [`ShareTransport::piece_limit`]): each step's pieces are staged packed in rank order,
/// exchanged, summed and passed by their owner. With `share_out` every rank then gathers every
/// finished piece (an all-reduce); without, each rank keeps only its own pieces and the rest of
/// `buf` is left as it was (a reduce-scatter). Returns every block's value.
pub(crate) fn reduce_by_cut(
    t: &mut (impl ShareTransport + ?Sized),
    buf: &mut [f32],
    cut: &dyn Cut,
    share_out: bool,
    pass: &dyn BlockPass,
) -> Result<Vec<f64>> {
    let (rank, world) = (t.rank(), t.world());
    let steps = cut.steps();
    assert!(cut.largest() <= t.piece_limit(), "the cut's pieces exceed the transport's");
    // On a bf16 wire, the other ranks' copies of this rank's piece, widened back to FP32.
    let mut widened = Vec::new();
    let mut mine = Vec::new();
    // With a second step the finished pieces wait for every block's value before they go out:
    // first every step is exchanged, summed and passed, then the values are gathered, each rank
    // scales its own pieces, and the gathers follow. Without one, each step's piece goes out
    // while it is still in cache.
    let deferred = pass.rescales();
    for k in 0..steps {
        let s = StepPieces::of(cut, world, k);
        send_step(t, buf, k, steps, &s, pass)?;
        let own = s.pieces[rank].clone();
        let first = mine.len();
        mine.resize(first + simd::blocks(own.len()), 0.0);
        sum_step(t, &mut buf[own], &mut widened, pass, &mut mine[first..]);
        if share_out && !deferred {
            gather_step(t, buf, k, steps, &s)?;
        }
    }
    let values = gather_values(t, cut, buf.len(), &mine, pass)?;
    if deferred {
        let factor = pass.rescale(&values);
        for k in 0..steps {
            if let Some(factor) = factor {
                simd::scale(&mut buf[cut.piece(k, rank)], factor, 1);
            }
            if share_out {
                gather_step(t, buf, k, steps, &StepPieces::of(cut, world, k))?;
            }
        }
    }
    t.finish()?;
    Ok(values)
}

/// Every rank's pieces of `cut`, as they are in its `buf`, to every other rank: the gathers of
/// [`reduce_by_cut`] alone, step by step.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn gather_by_cut(
    t: &mut (impl ShareTransport + ?Sized),
    buf: &mut [f32],
    cut: &dyn Cut,
) -> Result<()> {
    let steps = cut.steps();
    assert!(cut.largest() <= t.piece_limit(), "the cut's pieces exceed the transport's");
    for k in 0..steps {
        gather_step(t, buf, k, steps, &StepPieces::of(cut, t.world(), k))?;
    }
    t.finish()
}

/// Stages the pieces of step `k` that this rank sends, copied out of the caller's buffer (as they
/// are, or on a bf16 wire rounded to bf16 bits, which are widened back on arrival, exactly), and
/// exchanges them.
fn send_step(
    t: &mut (impl ShareTransport + ?Sized),
    buf: &[f32],
    k: usize,
    steps: usize,
    s: &StepPieces,
    pass: &dyn BlockPass,
) -> Result<()> {
    let (rank, world) = (t.rank(), t.world());
    let bf16 = pass.wire() == Dtype::Bf16;
    // Words per value on the wire.
    let per_value = if bf16 { 1 } else { 2 };
    // Each piece where its FP32 values would lie, so a bf16 piece never overlaps the place of
    // this rank's finished piece, which the gather writes while others may still read.
    let on_wire: Vec<Range<usize>> =
        s.packed.iter().map(|p| 2 * p.start..2 * p.start + per_value * p.len()).collect();
    let out = t.outbox(k, 2 * s.len());
    for q in (0..world).filter(|&q| q != rank) {
        let (from, to) = (&buf[s.pieces[q].clone()], &mut out[on_wire[q].clone()]);
        if bf16 {
            simd::to_bf16_bits(from, to);
        } else {
            simd::copy_for_peer(values_mut(to), from);
        }
    }
    t.exchange(Step::Exchange { chunk: k + 1, chunks: steps }, k, &on_wire)
}

/// Sums the other ranks' arrived copies into this rank's piece `own` and passes it, writing its
/// blocks' values into `out`. On a bf16 wire this rank's own piece is rounded in place first,
/// and the arrivals are widened into `widened`.
fn sum_step(
    t: &(impl ShareTransport + ?Sized),
    own: &mut [f32],
    widened: &mut Vec<f32>,
    pass: &dyn BlockPass,
    out: &mut [f64],
) {
    let (rank, world) = (t.rank(), t.world());
    if pass.wire() != Dtype::Bf16 {
        sum_and_pass(own, rank, world, |q| values(t.incoming(q)), pass, out);
        return;
    }
    let n = own.len();
    simd::round_to_bf16(own, 1);
    widened.resize(world * n, 0.0);
    for q in (0..world).filter(|&q| q != rank) {
        for (v, &w) in widened[q * n..(q + 1) * n].iter_mut().zip(t.incoming(q)) {
            *v = f32::from_bits((w as u32) << 16);
        }
    }
    let widened = &*widened;
    sum_and_pass(own, rank, world, |q| &widened[q * n..(q + 1) * n], pass, out);
}

/// Every block's value of a buffer of `len` elements, from each rank's values of its own
/// pieces (`mine`, in step order), gathered when the pass writes values; zeros otherwise.
fn gather_values(
    t: &mut (impl ShareTransport + ?Sized),
    cut: &dyn Cut,
    len: usize,
    mine: &[f64],
    pass: &dyn BlockPass,
) -> Result<Vec<f64>> {
    let mut values = vec![0.0; simd::blocks(len)];
    if pass.writes_values() {
        let blocks_of =
            |p: &Range<usize>| p.start / NORM_BLOCK..p.start / NORM_BLOCK + simd::blocks(p.len());
        let world = t.world();
        let counts: Vec<usize> =
            (0..world).map(|q| cut.pieces(q).iter().map(|p| blocks_of(p).len()).sum()).collect();
        let mut next = t.gather_values(mine, &counts)?.iter();
        for q in 0..world {
            for p in cut.pieces(q) {
                for (slot, &v) in values[blocks_of(&p)].iter_mut().zip(next.by_ref()) {
                    *slot = v;
                }
            }
        }
    }
    Ok(values)
}
