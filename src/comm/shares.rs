//! The boundary's reduction in shares, for communicators between processes. The buffer is cut
//! into chunks and every chunk into one share per rank. Each rank receives the other ranks' copies
//! of its share, sums them in rank order, runs the boundary's pass on the sum while it is still in
//! cache, and then every rank gathers the finished shares. Each element is summed and passed once,
//! by its share's owner, so every rank holds the same bits by construction, and they are the bits
//! of the in-process communicator, which also sums in rank order.

use std::ops::Range;

use super::BlockPass;
use crate::dtype::Dtype;
use crate::error::Result;
use crate::math::NORM_BLOCK;
use crate::simd;

/// Elements of one rank's share of a full chunk (256 KB). A share and the other ranks' copies of
/// it stay in L2 from the exchange through the sum and the pass to the gather. At 2 processes on
/// the benchmark machine shares of 32K-128K elements were equally fast, 256K about 5% slower and
/// 1M about 14% slower (docs/mpi.md).
pub const SHARE_NUMEL: usize = 64 * 1024;

/// Most elements in one chunk. With many ranks the shares shrink (to one block at the least), so
/// the scratch for the other ranks' copies of a share stays under 16 MB.
const MAX_CHUNK_NUMEL: usize = 4 << 20;

/// Elements summed per step of [`sum_and_pass`] from rank 2 on: the running sum stays in L1.
const RUN: usize = 2048;

/// How a buffer is cut: chunks of `world` shares, each share whole blocks of `NORM_BLOCK`, so the
/// pass always sees whole blocks and every block's value is computed by one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    len: usize,
    world: usize,
    share: usize,
}

impl Plan {
    /// A plan for `len` elements over `world` ranks. `share_numel` is rounded up to whole blocks
    /// (one at the least) and shrunk, not below one block, to keep a chunk within
    /// `MAX_CHUNK_NUMEL` elements.
    pub fn new(len: usize, world: usize, share_numel: usize) -> Plan {
        assert!(world >= 1, "a group has at least one rank");
        let most = (MAX_CHUNK_NUMEL / world / NORM_BLOCK).max(1);
        let blocks = share_numel.div_ceil(NORM_BLOCK).clamp(1, most);
        Plan { len, world, share: blocks * NORM_BLOCK }
    }

    /// Chunk `k`: `world` shares, the last chunk shorter.
    pub fn chunk(&self, k: usize) -> Range<usize> {
        let size = self.share * self.world;
        (k * size).min(self.len)..((k + 1) * size).min(self.len)
    }

    /// The chunks, in order.
    #[cfg(test)]
    pub fn chunks(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (0..self.chunk_count()).map(|k| self.chunk(k))
    }

    /// How many chunks [`Plan::chunks`] yields.
    pub fn chunk_count(&self) -> usize {
        self.len.div_ceil(self.share * self.world)
    }

    /// Rank `q`'s share of `chunk`, in elements of the whole buffer: whole blocks, the chunk's
    /// blocks split as evenly as they go (so in a short chunk some shares may be empty). In a
    /// full chunk every share has `share_numel` elements.
    pub fn share(&self, chunk: &Range<usize>, q: usize) -> Range<usize> {
        let len = chunk.len();
        let blocks = simd::blocks(len);
        let at = |k: usize| chunk.start + (blocks * k / self.world * NORM_BLOCK).min(len);
        at(q)..at(q + 1)
    }
}

/// How a reduction in shares cuts the buffer: in step `k` of `steps()`, rank `q` sums and passes
/// `piece(k, q)` (elements of the whole buffer). Pieces of one step are disjoint, in rank order,
/// start on block boundaries and hold whole blocks (only the buffer's last may be short), hold at
/// most `largest()` elements, and may be empty; over all steps they cover the buffer once.
pub(crate) trait Cut {
    fn steps(&self) -> usize;
    fn piece(&self, k: usize, q: usize) -> Range<usize>;
    fn largest(&self) -> usize;

    /// Rank `q`'s pieces, step by step.
    fn pieces(&self, q: usize) -> Vec<Range<usize>> {
        (0..self.steps()).map(|k| self.piece(k, q)).collect()
    }
}

/// The all-reduce's cut: step k is chunk k, and rank q's piece its share of it.
impl Cut for Plan {
    fn steps(&self) -> usize {
        self.chunk_count()
    }

    fn piece(&self, k: usize, q: usize) -> Range<usize> {
        self.share(&self.chunk(k), q)
    }

    fn largest(&self) -> usize {
        self.share
    }
}

/// `shards` contiguous shards of a buffer of `len` elements, in rank order: equal parts rounded up
/// to whole blocks of the norm, so a shard's block sums are those of any other cut at block
/// boundaries; the last shards may be shorter or empty.
pub(crate) fn shard_ranges(len: usize, shards: usize) -> Vec<Range<usize>> {
    (0..shards).map(|q| shard_range(len, shards, q)).collect()
}

/// Shard `q`'s range of [`shard_ranges`].
pub(crate) fn shard_range(len: usize, shards: usize, q: usize) -> Range<usize> {
    let size = len.div_ceil(shards.max(1)).next_multiple_of(NORM_BLOCK);
    (q * size).min(len)..((q + 1) * size).min(len)
}

/// The reduce-scatter's cut: rank q's pieces are its shard, `piece_numel` elements at a time.
pub(crate) struct ShardCut<'a> {
    pub shards: &'a [Range<usize>],
    pub piece_numel: usize,
}

impl Cut for ShardCut<'_> {
    fn steps(&self) -> usize {
        self.shards.iter().map(|s| s.len().div_ceil(self.piece_numel)).max().unwrap_or(0)
    }

    fn piece(&self, k: usize, q: usize) -> Range<usize> {
        let s = &self.shards[q];
        let start = (s.start + k * self.piece_numel).min(s.end);
        start..(start + self.piece_numel).min(s.end)
    }

    fn largest(&self) -> usize {
        self.piece_numel
    }
}

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

/// The memory a copying transport hands its collectives: its outbox, the other ranks' copies of
/// this rank's piece, and the block values. The caller's buffer is never handed over; it is
/// copied into the outbox before a collective and out of it after one completed. A transport
/// between processes keeps the workspace for as long as a collective it abandoned (a timeout, an
/// abort) may still read or write it, instead of freeing it when the call returns.
#[derive(Debug, Default)]
pub(crate) struct Workspace {
    /// One step's pieces, packed in rank order: the pieces this rank sends in the exchange, then
    /// the gather's in-place buffer.
    pub stage: Vec<f32>,
    /// The other ranks' copies of this rank's piece, one slot per other rank, in rank order.
    pub scratch: Vec<f32>,
    pub mine: Vec<f64>,
    pub all: Vec<f64>,
}

/// Where a transport's own buffers start within a page: half a page past a boundary. Copies
/// between such a buffer and the caller's run at half speed when the two addresses agree in their
/// low 12 bits, or nearly (a load waits for an unrelated store that looks like the same address:
/// "4K aliasing"), and the caller's buffers usually start on a page boundary or a few bytes past
/// one (malloc's header). Measured at 2 processes, 16M elements, on a loaded machine: the
/// shared-memory sync took 43.8 ms with page-aligned outboxes and 23.8 ms with these (39.3 and
/// 40.9 ms as MPI messages in the same runs).
pub(crate) const SKEW: usize = 2048;

/// Bytes in a page.
pub(crate) const PAGE: usize = 4096;

/// Values from `p` to the next address [`SKEW`] past a page boundary.
fn skew_of(p: *const f32) -> usize {
    (SKEW + PAGE - p as usize % PAGE) % PAGE / 4
}

/// `n` values of `v` (grown as needed) that start [`SKEW`] past a page boundary.
pub(crate) fn skewed(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n + PAGE / 4 {
        v.resize(n + PAGE / 4, 0.0);
    }
    let at = skew_of(v.as_ptr());
    &mut v[at..at + n]
}

/// The values of `v` from where [`skewed`] starts them.
pub(crate) fn skewed_ref(v: &[f32]) -> &[f32] {
    &v[skew_of(v.as_ptr()).min(v.len())..]
}

/// The 16-bit words an FP32 buffer travels as: two per value, bit for bit.
pub(crate) fn words(v: &[f32]) -> &[u16] {
    // SAFETY: the same bytes viewed as u16 (alignment 2 divides f32's 4, every bit pattern is a
    // valid u16), borrowed for as long as `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 2) }
}

/// [`words`], writable: any words written make valid f32 bit patterns.
pub(crate) fn words_mut(v: &mut [f32]) -> &mut [u16] {
    // SAFETY: as in `words`, and every pattern written through the view is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 2) }
}

/// FP32 values travelling as [`words`]: the words must start on a 4-byte boundary and come in
/// pairs (every outbox and every range of FP32 values in one does).
pub(crate) fn values(w: &[u16]) -> &[f32] {
    assert!(
        w.as_ptr().cast::<f32>().is_aligned() && w.len().is_multiple_of(2),
        "FP32 values travel as aligned pairs of words"
    );
    // SAFETY: the assertion makes the pointer f32-aligned and the length whole values; every bit
    // pattern is a valid f32; borrowed for as long as `w`.
    unsafe { std::slice::from_raw_parts(w.as_ptr().cast(), w.len() / 2) }
}

/// [`values`], writable.
pub(crate) fn values_mut(w: &mut [u16]) -> &mut [f32] {
    assert!(
        w.as_ptr().cast::<f32>().is_aligned() && w.len().is_multiple_of(2),
        "FP32 values travel as aligned pairs of words"
    );
    // SAFETY: as in `values`; any f32 written makes valid u16 words.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast(), w.len() / 2) }
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Barrier, Mutex};

    use super::*;
    use crate::comm::{Communicator, HostCollectives, LocalComm};

    #[test]
    fn plans_cut_whole_blocks_and_cover_the_buffer() {
        let block = NORM_BLOCK;
        for world in [1, 2, 3, 4, 7] {
            for share_numel in [1, block - 1, block, block + 1, 3 * block, SHARE_NUMEL] {
                for len in [
                    1,
                    100,
                    block,
                    block + 1,
                    2 * block - 1,
                    5 * block + 17,
                    3 * world * 4 * block + 3 * block + 5,
                ] {
                    let plan = Plan::new(len, world, share_numel);
                    assert_eq!(plan.largest() % block, 0);
                    assert!(plan.largest() >= share_numel.min(MAX_CHUNK_NUMEL / world).max(1));
                    let mut next = 0;
                    let mut blocks_seen = vec![0u32; simd::blocks(len)];
                    for chunk in plan.chunks() {
                        assert_eq!(chunk.start, next);
                        assert!(chunk.len() <= world * plan.largest());
                        let full = chunk.len() == world * plan.largest();
                        let mut at = chunk.start;
                        for q in 0..world {
                            let s = plan.share(&chunk, q);
                            assert_eq!(s.start, at, "shares are contiguous, in rank order");
                            assert!(
                                s.start.is_multiple_of(block)
                                    || s.is_empty() && s.start == chunk.end
                            );
                            assert!(!full || s.len() == plan.largest());
                            at = s.end;
                        }
                        assert_eq!(at, chunk.end);
                        next = chunk.end;
                    }
                    assert_eq!(next, len);
                    assert_eq!(plan.chunk_count(), plan.chunks().count());
                    for q in 0..world {
                        for p in plan.pieces(q) {
                            assert!(p.start.is_multiple_of(block) || p.is_empty());
                            let first = p.start / block;
                            blocks_seen[first..first + simd::blocks(p.len())]
                                .iter_mut()
                                .for_each(|n| *n += 1);
                        }
                    }
                    assert!(
                        blocks_seen.iter().all(|&n| n == 1),
                        "every block is passed by exactly one rank"
                    );
                }
            }
        }
        // The pieces of a plan are its shares, chunk by chunk.
        let plan = Plan::new(5 * block + 17, 2, block);
        assert_eq!(
            plan.pieces(1),
            [block..2 * block, 3 * block..4 * block, 5 * block..5 * block + 17]
        );
        // Many ranks: chunks stay bounded, shares never drop below a block.
        assert_eq!(Plan::new(1 << 30, 64, SHARE_NUMEL).largest(), SHARE_NUMEL);
        assert_eq!(Plan::new(1 << 30, 256, SHARE_NUMEL).largest(), MAX_CHUNK_NUMEL / 256);
        assert_eq!(Plan::new(1 << 30, 4096, SHARE_NUMEL).largest(), block);
    }

    /// Normalises and measures, like the boundary; `fused` picks the block-by-block fused
    /// `add_and_run` instead of the trait's default; `clip` adds a second step whose factor
    /// depends on every block's value, like clipping.
    struct Normalise {
        factor: f32,
        fused: bool,
        clip: bool,
        wire: Dtype,
    }

    /// The second step's factor in the tests: a function of every block's value, not 1.
    fn clip_factor(values: &[f64]) -> f32 {
        (1.0 / (1.0 + simd::fold_block_sums(values).sqrt())) as f32
    }

    impl BlockPass for Normalise {
        fn run(&self, run: &mut [f32], values: &mut [f64]) {
            simd::scale_and_block_sum_squares(run, self.factor, values, 1);
        }

        fn add_and_run(&self, run: &mut [f32], addend: &[f32], values: &mut [f64]) {
            if self.fused {
                simd::add_and_block_sum_squares(run, addend, Some(self.factor), values);
            } else {
                simd::add_assign(run, addend);
                self.run(run, values);
            }
        }

        fn rescales(&self) -> bool {
            self.clip
        }

        fn rescale(&self, values: &[f64]) -> Option<f32> {
            self.clip.then(|| clip_factor(values))
        }

        fn wire(&self) -> Dtype {
            self.wire
        }
    }

    #[test]
    fn share_sums_follow_rank_order_then_pass() {
        let len = 3 * RUN + 5;
        for world in [1, 2, 3, 5] {
            let data: Vec<Vec<f32>> =
                (0..world).map(|r| (0..len).map(|i| value(r, i)).collect()).collect();
            let mut want: Vec<f32> =
                (0..len).map(|i| (1..world).fold(data[0][i], |s, r| s + data[r][i])).collect();
            let mut want_values = vec![0.0; simd::blocks(len)];
            simd::scale_and_block_sum_squares(&mut want, 0.3, &mut want_values, 1);
            for rank in 0..world {
                for fused in [false, true] {
                    let mut own = data[rank].clone();
                    let mut values = vec![0.0; simd::blocks(len)];
                    sum_and_pass(
                        &mut own,
                        rank,
                        world,
                        |q| &data[q],
                        &Normalise { factor: 0.3, fused, clip: false, wire: Dtype::F32 },
                        &mut values,
                    );
                    assert!(
                        own.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "world {world} rank {rank}"
                    );
                    assert!(
                        values.iter().zip(&want_values).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "world {world} rank {rank}"
                    );
                }
            }
        }
    }

    /// Values whose f32 sums round differently in another order.
    fn value(rank: usize, i: usize) -> f32 {
        let x = ((i * 2654435761 + rank * 40503) % 1_000_003) as f32 / 1_000_003.0;
        (x - 0.5) * [1.0, 3e3, 1e-3, 7e5, 0.1][rank % 5]
    }

    /// An in-process transport: the ranks are threads that read each other's published buffers
    /// between barriers, with the same contract as the MPI one: it copies into a workspace of
    /// its own, as MPI does.
    struct Threads {
        rank: usize,
        world: usize,
        barrier: Arc<Barrier>,
        posts: Arc<Mutex<Vec<(usize, usize)>>>,
        work: Workspace,
        /// Where `incoming(q)` lies in the scratch (words), and the last gather's ranges.
        slots: Vec<Range<usize>>,
        packed: Vec<Range<usize>>,
        /// The address ranges of every buffer this rank was handed, for the test to check that
        /// none is the caller's.
        handed: Vec<Range<usize>>,
        /// 16-bit words received in exchanges.
        words_received: usize,
    }

    impl Threads {
        fn group(world: usize) -> Vec<Threads> {
            let barrier = Arc::new(Barrier::new(world));
            let posts = Arc::new(Mutex::new(vec![(0, 0); world]));
            (0..world)
                .map(|rank| Threads {
                    rank,
                    world,
                    barrier: barrier.clone(),
                    posts: posts.clone(),
                    work: Workspace::default(),
                    slots: Vec::new(),
                    packed: Vec::new(),
                    handed: Vec::new(),
                    words_received: 0,
                })
                .collect()
        }

        /// Publishes this rank's buffer; returns every rank's, once all have published.
        fn publish<T>(&mut self, p: *const T, len: usize) -> Vec<(usize, usize)> {
            self.handed.push(p as usize..p as usize + len * std::mem::size_of::<T>());
            self.posts.lock().unwrap()[self.rank] = (p as usize, len);
            self.barrier.wait();
            self.posts.lock().unwrap().clone()
        }
    }

    impl ShareTransport for Threads {
        fn rank(&self) -> usize {
            self.rank
        }

        fn world(&self) -> usize {
            self.world
        }

        fn outbox(&mut self, _k: usize, words: usize) -> &mut [u16] {
            let stage = &mut self.work.stage;
            stage.resize(stage.len().max(words.div_ceil(2)), 0.0);
            words_mut(stage)
        }

        fn exchange(&mut self, _step: Step, _k: usize, packed: &[Range<usize>]) -> Result<()> {
            let own = packed[self.rank].len();
            let scratch = &mut self.work.scratch;
            scratch.resize(scratch.len().max((self.world * own).div_ceil(2)), 0.0);
            self.slots = (0..self.world).map(|q| q * own..(q + 1) * own).collect();
            let (stage, at) = (self.work.stage.as_ptr(), self.work.stage.len());
            let posts = self.publish(stage, at);
            let scratch = &mut self.work.scratch;
            self.handed.push(
                scratch.as_ptr() as usize
                    ..scratch.as_ptr() as usize + std::mem::size_of_val(scratch.as_slice()),
            );
            for q in (0..self.world).filter(|&q| q != self.rank) {
                self.words_received += own;
                // SAFETY: `posts[q]` is the pointer and length of rank q's stage, published before
                // `publish`'s barrier; rank q does not touch it until it passes the barrier below.
                let theirs =
                    unsafe { std::slice::from_raw_parts(posts[q].0 as *const f32, posts[q].1) };
                words_mut(scratch)[self.slots[q].clone()]
                    .copy_from_slice(&words(theirs)[packed[self.rank].clone()]);
            }
            self.barrier.wait();
            Ok(())
        }

        fn incoming(&self, q: usize) -> &[u16] {
            &words(&self.work.scratch)[self.slots[q].clone()]
        }

        fn gather(&mut self, _step: Step, _k: usize, packed: &[Range<usize>]) -> Result<()> {
            let (stage, at) = (self.work.stage.as_ptr(), self.work.stage.len());
            let posts = self.publish(stage, at);
            for q in (0..self.world).filter(|&q| q != self.rank) {
                let s = packed[q].clone();
                // SAFETY: `posts[q]` is rank q's stage, alive and unwritten until the barrier
                // below; `packed[q]` is inside it (same ranges on every rank), and only rank q's
                // own place is read, which no rank writes now: each writes only the other ranks'
                // places of its own stage.
                let theirs = unsafe {
                    std::slice::from_raw_parts((posts[q].0 as *const f32).add(s.start), s.len())
                };
                self.work.stage[s].copy_from_slice(theirs);
            }
            self.packed = packed.to_vec();
            self.barrier.wait();
            Ok(())
        }

        fn finished(&self, q: usize) -> &[f32] {
            &self.work.stage[self.packed[q].clone()]
        }

        fn gather_values(&mut self, mine: &[f64], counts: &[usize]) -> Result<&[f64]> {
            let posts = self.publish(mine.as_ptr(), mine.len());
            let all = &mut self.work.all;
            all.clear();
            all.resize(counts.iter().sum(), 0.0);
            self.handed.push(
                all.as_ptr() as usize
                    ..all.as_ptr() as usize + std::mem::size_of_val(all.as_slice()),
            );
            let mut at = 0;
            for q in 0..self.world {
                assert_eq!(posts[q].1, counts[q]);
                // SAFETY: `posts[q]` is rank q's `mine`, held as `&[f64]` (so unwritten) and alive
                // until the barrier below; its length was checked against `counts[q]` just above.
                let theirs =
                    unsafe { std::slice::from_raw_parts(posts[q].0 as *const f64, posts[q].1) };
                all[at..at + counts[q]].copy_from_slice(theirs);
                at += counts[q];
            }
            self.barrier.wait();
            Ok(&self.work.all)
        }
    }

    /// Every rank's buffer and block values from the reduction in shares.
    fn in_shares(
        world: usize,
        len: usize,
        share_numel: usize,
        factor: f32,
        clip: bool,
    ) -> Vec<(Vec<f32>, Vec<f64>)> {
        let group = Threads::group(world);
        let pass = Normalise { factor, fused: true, clip, wire: Dtype::F32 };
        std::thread::scope(|s| {
            let handles: Vec<_> = group
                .into_iter()
                .map(|mut t| {
                    let pass = &pass;
                    s.spawn(move || {
                        let mut buf: Vec<f32> = (0..len).map(|i| value(t.rank, i)).collect();
                        // Twice over one transport: the second call reuses the first's memory.
                        let mut copy = buf.clone();
                        let first = reduce_in_shares(&mut t, &mut copy, share_numel, pass).unwrap();
                        let values = reduce_in_shares(&mut t, &mut buf, share_numel, pass).unwrap();
                        assert!(
                            copy.iter().zip(&buf).all(|(a, b)| a.to_bits() == b.to_bits())
                                && first == values
                        );
                        // No collective was handed the caller's memory, which an abandoned request
                        // between processes could still read or write after the call returned.
                        for caller in [buf.as_ptr_range(), copy.as_ptr_range()] {
                            let caller = caller.start as usize..caller.end as usize;
                            assert!(!t.handed.is_empty());
                            assert!(
                                t.handed.iter().all(|h| h.is_empty()
                                    || h.end <= caller.start
                                    || caller.end <= h.start),
                                "a transport was handed the caller's buffer"
                            );
                        }
                        (buf, values)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Every rank's own shard and the block values of a reduce-scatter, between processes
    /// (`reduce_by_cut` over the test transport) or in process.
    fn scattered(
        world: usize,
        len: usize,
        piece_numel: usize,
        clip: bool,
        local: bool,
    ) -> Vec<(Vec<f32>, Vec<f64>)> {
        let shards = shard_ranges(len, world);
        let pass = Normalise { factor: 0.3, fused: true, clip, wire: Dtype::F32 };
        let comms = LocalComm::group(world).unwrap();
        let group = Threads::group(world);
        std::thread::scope(|s| {
            let handles: Vec<_> = group
                .into_iter()
                .zip(&comms)
                .map(|(mut t, comm)| {
                    let (pass, shards) = (&pass, &shards);
                    s.spawn(move || {
                        let mut buf: Vec<f32> = (0..len).map(|i| value(t.rank, i)).collect();
                        let values = if local {
                            comm.reduce_scatter_with_pass(&mut buf, shards, pass).unwrap()
                        } else {
                            let cut = ShardCut { shards, piece_numel };
                            reduce_by_cut(&mut t, &mut buf, &cut, false, pass).unwrap()
                        };
                        (buf[shards[t.rank].clone()].to_vec(), values)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn reduce_scatter_leaves_each_rank_its_shard_of_the_reference() {
        let block = NORM_BLOCK;
        for world in [1, 2, 3, 5] {
            for len in [
                1,
                100,
                block + 1,
                3 * block + 7,
                7 * block,
                2 * world * 3 * block + 2 * block + 99,
            ] {
                let shards = shard_ranges(len, world);
                for clip in [false, true] {
                    let (sum, values) = reference(world, len, 0.3, clip);
                    let mut runs =
                        vec![("in process", scattered(world, len, SHARE_NUMEL, clip, true))];
                    for piece_numel in [block, 2 * block, SHARE_NUMEL] {
                        runs.push((
                            "between processes",
                            scattered(world, len, piece_numel, clip, false),
                        ));
                    }
                    for (how, run) in runs {
                        for (rank, got) in run.iter().enumerate() {
                            let want = (sum[shards[rank].clone()].to_vec(), values.clone());
                            assert!(
                                same_bits(got, &want),
                                "{how}: world {world} len {len} clip {clip} rank {rank}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Every rank's result (its whole buffer after an all-reduce, its shard after a
    /// reduce-scatter), the block values, and the 16-bit words it received in exchanges, sent on
    /// `wire` through the test transport; with `round`, the inputs are rounded to bf16 first.
    fn over_the_wire(
        world: usize,
        len: usize,
        scatter: bool,
        wire: Dtype,
        round: bool,
    ) -> Vec<(Vec<f32>, Vec<f64>, usize)> {
        let shards = shard_ranges(len, world);
        let pass = Normalise { factor: 0.3, fused: true, clip: true, wire };
        std::thread::scope(|s| {
            let handles: Vec<_> = Threads::group(world)
                .into_iter()
                .map(|mut t| {
                    let (pass, shards) = (&pass, &shards);
                    s.spawn(move || {
                        let mut buf: Vec<f32> = (0..len).map(|i| value(t.rank, i)).collect();
                        if round {
                            simd::round_to_bf16(&mut buf, 1);
                        }
                        let values = if scatter {
                            let cut = ShardCut { shards, piece_numel: 2 * NORM_BLOCK };
                            let values =
                                reduce_by_cut(&mut t, &mut buf, &cut, false, pass).unwrap();
                            buf = buf[shards[t.rank].clone()].to_vec();
                            values
                        } else {
                            reduce_in_shares(&mut t, &mut buf, NORM_BLOCK, pass).unwrap()
                        };
                        (buf, values, t.words_received)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn a_bf16_wire_rounds_once_and_sends_half_the_words() {
        for world in [2, 3, 5] {
            for len in [1, 3 * NORM_BLOCK + 7, 4 * world * NORM_BLOCK + 99] {
                for scatter in [false, true] {
                    // The bits of an FP32 wire on contributions rounded beforehand.
                    let f32s = over_the_wire(world, len, scatter, Dtype::F32, true);
                    let bf16s = over_the_wire(world, len, scatter, Dtype::Bf16, false);
                    for (rank, (a, b)) in f32s.iter().zip(&bf16s).enumerate() {
                        let what = format!("world {world} len {len} scatter {scatter} rank {rank}");
                        assert!(
                            same_bits(&(a.0.clone(), a.1.clone()), &(b.0.clone(), b.1.clone())),
                            "{what}"
                        );
                        assert_eq!(a.2, 2 * b.2, "{what}: words received");
                    }
                    assert!(bf16s.iter().any(|r| r.2 > 0) || len < world, "something travelled");
                }
            }
        }
    }

    /// Every rank's buffer and block values from the in-process communicator's reduction in
    /// shares.
    fn in_process(world: usize, len: usize, factor: f32, clip: bool) -> Vec<(Vec<f32>, Vec<f64>)> {
        let comms = LocalComm::group(world).unwrap();
        let pass = Normalise { factor, fused: false, clip, wire: Dtype::F32 };
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .map(|c| {
                    let pass = &pass;
                    s.spawn(move || {
                        let mut buf: Vec<f32> = (0..len).map(|i| value(c.rank(), i)).collect();
                        #[allow(clippy::single_range_in_vec_init)] // one bucket: the whole buffer
                        let values = c.allreduce_with_pass(&mut buf, &[0..len], pass).unwrap();
                        (buf, values)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn same_bits(a: &(Vec<f32>, Vec<f64>), b: &(Vec<f32>, Vec<f64>)) -> bool {
        a.0.len() == b.0.len()
            && a.1.len() == b.1.len()
            && a.0.iter().zip(&b.0).all(|(x, y)| x.to_bits() == y.to_bits())
            && a.1.iter().zip(&b.1).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// The reference: the sum in rank order, the pass over the whole buffer, then the second
    /// step's scaling, on one thread.
    fn reference(world: usize, len: usize, factor: f32, clip: bool) -> (Vec<f32>, Vec<f64>) {
        let mut sum: Vec<f32> =
            (0..len).map(|i| (1..world).fold(value(0, i), |s, r| s + value(r, i))).collect();
        let mut values = vec![0.0; simd::blocks(len)];
        simd::scale_and_block_sum_squares(&mut sum, factor, &mut values, 1);
        if clip {
            simd::scale(&mut sum, clip_factor(&values), 1);
        }
        (sum, values)
    }

    #[test]
    fn shares_give_the_reference_bits_for_any_cut() {
        let block = NORM_BLOCK;
        for world in [1, 2, 3, 5] {
            // Buffers shorter than a block, with fewer blocks than ranks, not a multiple of the
            // chunk, and spanning several chunks; shares smaller than a block and not whole blocks.
            for len in [
                1,
                100,
                block + 1,
                3 * block + 7,
                7 * block,
                2 * world * 3 * block + 2 * block + 99,
            ] {
                for clip in [false, true] {
                    let want = reference(world, len, 0.3, clip);
                    for (rank, got) in in_process(world, len, 0.3, clip).iter().enumerate() {
                        assert!(
                            same_bits(got, &want),
                            "in process: world {world} len {len} clip {clip} rank {rank}"
                        );
                    }
                    for share_numel in [1, block, 2 * block + 1, 3 * block, SHARE_NUMEL] {
                        for (rank, got) in
                            in_shares(world, len, share_numel, 0.3, clip).iter().enumerate()
                        {
                            assert!(same_bits(got, &want), "world {world} len {len} share {share_numel} clip {clip} rank {rank}");
                        }
                    }
                }
            }
        }
    }

    /// Memory standing in for a shared mapping: zeroed, 8-byte aligned.
    fn heap_region(world: usize, piece: usize) -> (Vec<u64>, super::super::shm::Region) {
        let mut mem = vec![0u64; super::super::shm::Region::size(world, piece).div_ceil(8)];
        // SAFETY: `mem` is zeroed, 8-byte aligned, `size` bytes, and outlives the region (the
        // caller keeps both together and drops the region's users first); only the threads of
        // one group use it, each through its own `Shm` over this one region.
        let region =
            unsafe { super::super::shm::Region::new(mem.as_mut_ptr().cast(), world, piece) };
        (mem, region)
    }

    /// Every rank's result through shared memory (`shm::Shm` over threads), as
    /// [`over_the_wire`]: its whole buffer after an all-reduce, its shard after a reduce-scatter.
    /// Each rank reduces twice in a row over one region, the first time into a copy it drops.
    fn through_shared_memory(
        world: usize,
        len: usize,
        piece: usize,
        scatter: bool,
        wire: Dtype,
        clip: bool,
    ) -> Vec<(Vec<f32>, Vec<f64>)> {
        use super::super::liveness::Peers;
        use super::super::shm::Shm;
        let shards = shard_ranges(len, world);
        let pass = Normalise { factor: 0.3, fused: true, clip, wire };
        let (_mem, region) = heap_region(world, piece);
        let stopped = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let handles: Vec<_> = Threads::group(world)
                .into_iter()
                .map(|mut inner| {
                    let (pass, shards, region, stopped) = (&pass, &shards, &region, &stopped);
                    s.spawn(move || {
                        let (mut passed, nobody) = (0, Peers::none());
                        let mut t = Shm::new(
                            &mut inner,
                            region,
                            &mut passed,
                            Some(std::time::Duration::from_secs(60)),
                            stopped,
                            &nobody,
                            "test",
                        );
                        let rank = t.rank();
                        let mut buf: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
                        let mut run = |buf: &mut Vec<f32>| {
                            if scatter {
                                let cut = ShardCut { shards, piece_numel: piece };
                                reduce_by_cut(&mut t, buf, &cut, false, pass).unwrap()
                            } else {
                                reduce_in_shares(&mut t, buf, SHARE_NUMEL, pass).unwrap()
                            }
                        };
                        run(&mut buf.clone());
                        let values = run(&mut buf);
                        if scatter {
                            buf = buf[shards[rank].clone()].to_vec();
                        }
                        (buf, values)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn shared_memory_gives_the_bits_of_the_copying_transport() {
        let block = NORM_BLOCK;
        for world in [2, 3, 5] {
            for len in [1, 100, block + 1, 3 * block + 7, 2 * world * 3 * block + 2 * block + 99] {
                for (scatter, wire, clip) in [
                    (false, Dtype::F32, false),
                    (false, Dtype::F32, true),
                    (true, Dtype::F32, true),
                    (false, Dtype::Bf16, true),
                    (true, Dtype::Bf16, true),
                ] {
                    let shards = shard_ranges(len, world);
                    // The copying transport, checked against the reference by the tests above.
                    let want: Vec<(Vec<f32>, Vec<f64>)> = if wire == Dtype::F32 && !scatter {
                        let (sum, values) = reference(world, len, 0.3, clip);
                        vec![(sum, values); world]
                    } else if wire == Dtype::F32 {
                        let (sum, values) = reference(world, len, 0.3, clip);
                        (0..world)
                            .map(|r| (sum[shards[r].clone()].to_vec(), values.clone()))
                            .collect()
                    } else {
                        assert!(clip, "over_the_wire clips");
                        over_the_wire(world, len, scatter, wire, false)
                            .into_iter()
                            .map(|(b, v, _)| (b, v))
                            .collect()
                    };
                    // Pieces of one block make many steps, so both outboxes of every rank turn
                    // over.
                    let piece = if scatter && wire == Dtype::Bf16 { 2 * block } else { block };
                    let got = through_shared_memory(world, len, piece, scatter, wire, clip);
                    for (rank, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(same_bits(g, w), "world {world} len {len} scatter {scatter} wire {wire:?} clip {clip} rank {rank}");
                    }
                }
            }
        }
    }

    /// A rank that never arrives: the others fail with TIMEOUT once their timeout passed, or at
    /// once with COMM_FAILURE when another rank gave up first; a rank whose communicator is
    /// aborted stops with COMM_FAILURE and tells the others.
    #[test]
    fn shared_memory_barriers_time_out_and_pass_an_abort_on() {
        use super::super::liveness::Peers;
        use super::super::shm::Shm;
        use crate::error::ErrorKind;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::{Duration, Instant};
        let (world, len) = (3, 5 * NORM_BLOCK);
        let pass = Normalise { factor: 1.0, fused: true, clip: false, wire: Dtype::F32 };
        for abort in [false, true] {
            let (_mem, region) = heap_region(world, NORM_BLOCK);
            let flags: Vec<AtomicBool> = (0..world).map(|_| AtomicBool::new(false)).collect();
            let timeouts =
                [Duration::from_millis(300), Duration::from_secs(30), Duration::from_secs(30)];
            let results: Vec<_> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..world)
                    .map(|rank| {
                        let (pass, region, flags) = (&pass, &region, &flags);
                        s.spawn(move || {
                            // Rank 2 never comes; the others' inner transports are never reached.
                            if rank == 2 {
                                return None;
                            }
                            let mut inner = Threads::group(world).swap_remove(rank);
                            let (mut passed, nobody) = (0, Peers::none());
                            let mut t = Shm::new(
                                &mut inner,
                                region,
                                &mut passed,
                                Some(timeouts[rank]),
                                &flags[rank],
                                &nobody,
                                "test",
                            );
                            if abort && rank == 0 {
                                flags[0].store(true, Ordering::Release);
                            }
                            let start = Instant::now();
                            let e =
                                reduce_in_shares(&mut t, &mut vec![1.0; len], SHARE_NUMEL, pass)
                                    .unwrap_err();
                            Some((e.kind, e.message.clone(), start.elapsed()))
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let (kind0, message0, _) = results[0].clone().unwrap();
            let (kind1, message1, took1) = results[1].clone().unwrap();
            if abort {
                assert_eq!(kind0, ErrorKind::CommFailure, "{message0}");
                assert!(message0.contains("the communicator was aborted"), "{message0}");
            } else {
                assert_eq!(kind0, ErrorKind::Timeout, "{message0}");
                assert!(
                    message0.contains("chunk 1 of 2 (exchange)") && message0.contains("waited"),
                    "{message0}"
                );
            }
            assert_eq!(kind1, ErrorKind::CommFailure, "{message1}");
            assert!(message1.contains("another rank"), "{message1}");
            assert!(
                took1 < Duration::from_secs(10),
                "rank 1 waited {took1:?} for a peer that gave up"
            );
        }
    }
}
