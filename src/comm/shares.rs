//! The boundary's reduction in shares, for communicators between processes. The buffer is cut
//! into chunks and every chunk into one share per rank. Each rank receives the other ranks' copies
//! of its share, sums them in rank order, runs the boundary's pass on the sum while it is still in
//! cache, and then every rank gathers the finished shares. Each element is summed and passed once,
//! by its share's owner, so every rank holds the same bits by construction, and they are the bits
//! of the in-process communicator, which also sums in rank order.

use std::ops::Range;

use super::BlockPass;
use crate::backend::cpu::{self, math::NORM_BLOCK};
use crate::dtype::Dtype;
use crate::error::Result;

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
        let blocks = cpu::blocks(len);
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
    let size = len.div_ceil(shards.max(1)).next_multiple_of(NORM_BLOCK);
    (0..shards).map(|q| (q * size).min(len)..((q + 1) * size).min(len)).collect()
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
pub fn sum_and_pass<'a>(own: &mut [f32], rank: usize, world: usize, other: impl Fn(usize) -> &'a [f32], pass: &dyn BlockPass, values: &mut [f64]) {
    if rank <= 1 {
        let mut others = (0..world).filter(|&q| q != rank).peekable();
        while let Some(q) = others.next() {
            if others.peek().is_some() {
                cpu::add_assign(own, other(q));
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
            cpu::add_assign(acc, if q == rank { &own[run.clone()] } else { &other(q)[run.clone()] });
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
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Step::Exchange { chunk, chunks } => write!(f, "share reduction, chunk {chunk} of {chunks} (exchange)"),
            Step::Gather { chunk, chunks } => write!(f, "share reduction, chunk {chunk} of {chunks} (gather)"),
            Step::Values => write!(f, "share reduction, the gather of the block sums"),
        }
    }
}

/// The only memory the reduction in shares hands a transport: a copy of the chunk in flight, the
/// other ranks' copies of this rank's share, and the block values. The caller's buffer is never
/// handed over; it is copied into `stage` before a collective and out of it after one completed.
/// A transport between processes keeps the workspace for as long as a collective it abandoned (a
/// timeout, an abort) may still read or write it, instead of freeing it when the call returns.
#[derive(Debug, Default)]
pub(crate) struct Workspace {
    /// One chunk at the chunk's own offsets: the shares this rank sends in the exchange, then the
    /// gather's in-place buffer.
    stage: Vec<f32>,
    scratch: Vec<f32>,
    /// With a bf16 wire: the stage and the scratch as they travel, one word per value.
    wire_stage: Vec<u16>,
    wire_scratch: Vec<u16>,
    mine: Vec<f64>,
    all: Vec<f64>,
}

/// The 16-bit words an FP32 buffer travels as: two per value, bit for bit.
fn words(v: &[f32]) -> &[u16] {
    // SAFETY: the same bytes viewed as u16 (alignment 2 divides f32's 4, every bit pattern is a
    // valid u16), borrowed for as long as `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), v.len() * 2) }
}

/// [`words`], writable: any words written make valid f32 bit patterns.
fn words_mut(v: &mut [f32]) -> &mut [u16] {
    // SAFETY: as in `words`, and every pattern written through the view is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 2) }
}

/// Element ranges as ranges of [`words`].
fn in_words(ranges: &[Range<usize>]) -> Vec<Range<usize>> {
    ranges.iter().map(|r| 2 * r.start..2 * r.end).collect()
}

/// The three collectives the reduction in shares needs from a transport between processes.
/// Every rank calls each of them, in the same order, with the same `shares` and `counts`. `step`
/// says where the reduction is, for error messages. Every buffer passed is in the [`Workspace`],
/// never the caller's memory.
pub(crate) trait ShareTransport {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;

    /// Sends `chunk[shares[q]]` to every other rank `q`, and receives every other rank `q`'s copy
    /// of this rank's share, `chunk[shares[rank]]` there, into `scratch[slots[q]]`. `chunk` is the
    /// workspace's copy of the chunk (only the other ranks' shares are filled in), in 16-bit
    /// words: two per FP32 value, or one per value on a bf16 wire; the ranges count words.
    fn exchange(&mut self, step: Step, chunk: &[u16], shares: &[Range<usize>], scratch: &mut [u16], slots: &[Range<usize>]) -> Result<()>;

    /// Copies every other rank `q`'s finished `chunk[shares[q]]` into the same place of this
    /// rank's `chunk` (the workspace's copy, holding this rank's finished share); this rank's own
    /// share is left as it is.
    fn gather(&mut self, step: Step, chunk: &mut [f32], shares: &[Range<usize>]) -> Result<()>;

    /// Every rank's `mine` (rank `q`'s holding `counts[q]` values) concatenated in rank order into
    /// `all`. It comes after every chunk's exchange, and before the gathers when the pass has a
    /// second step (they need every block's value).
    fn gather_values(&mut self, mine: &[f64], counts: &[usize], all: &mut [f64]) -> Result<()>;
}

/// Sums `buf` over the ranks of `t` in shares of about `share_numel` elements and runs `pass` on
/// each share of the sum by its owner; returns the values `pass` wrote for every block of `buf`,
/// in block order, the same on every rank. See [`super::HostCollectives::allreduce_with_pass`].
/// The scratch memory comes from `ws` (kept by the caller between calls).
pub(crate) fn reduce_in_shares(
    t: &mut impl ShareTransport,
    ws: &mut Workspace,
    buf: &mut [f32],
    share_numel: usize,
    pass: &dyn BlockPass,
) -> Result<Vec<f64>> {
    let plan = Plan::new(buf.len(), t.world(), share_numel);
    reduce_by_cut(t, ws, buf, &plan, true, pass)
}

/// Every rank's `mine` in rank order (rank q brings `counts[q]` values), through the transport's
/// gather of block values and the workspace it keeps alive.
pub(crate) fn allgather_values(t: &mut impl ShareTransport, ws: &mut Workspace, mine: &[f64], counts: &[usize]) -> Result<Vec<f64>> {
    ws.mine.clear();
    ws.mine.extend_from_slice(mine);
    ws.all.clear();
    ws.all.resize(counts.iter().sum(), 0.0);
    t.gather_values(&ws.mine, counts, &mut ws.all)?;
    Ok(ws.all.clone())
}

/// One step's pieces in the buffer, and where each lies in the stage (packed in rank order).
type StepPieces = (Vec<Range<usize>>, Vec<Range<usize>>);

/// As [`reduce_in_shares`], by any [`Cut`]: each step's pieces are staged packed in rank order,
/// exchanged, summed and passed by their owner. With `share_out` every rank then gathers every
/// finished piece (an all-reduce); without, each rank keeps only its own pieces and the rest of
/// `buf` is left as it was (a reduce-scatter). Returns every block's value.
pub(crate) fn reduce_by_cut(
    t: &mut impl ShareTransport,
    ws: &mut Workspace,
    buf: &mut [f32],
    cut: &dyn Cut,
    share_out: bool,
    pass: &dyn BlockPass,
) -> Result<Vec<f64>> {
    let (rank, world) = (t.rank(), t.world());
    let (steps, largest) = (cut.steps(), cut.largest());
    // Other ranks' copies of this rank's piece, in rank order, without a slot for its own.
    let scratch_len = (world - 1) * largest;
    if ws.scratch.len() < scratch_len {
        ws.scratch.resize(scratch_len, 0.0);
    }
    let scratch = &mut ws.scratch[..scratch_len];
    let stage_len = world * largest;
    if ws.stage.len() < stage_len {
        ws.stage.resize(stage_len, 0.0);
    }
    let stage = &mut ws.stage[..stage_len];
    let bf16 = pass.wire() == Dtype::Bf16;
    if bf16 {
        ws.wire_stage.resize(ws.wire_stage.len().max(stage_len), 0);
        ws.wire_scratch.resize(ws.wire_scratch.len().max(scratch_len), 0);
    }
    let mine = &mut ws.mine;
    mine.clear();
    // Step k's pieces, and where each lies in the stage: packed in rank order.
    let step_of = |k: usize| {
        let pieces: Vec<Range<usize>> = (0..world).map(|q| cut.piece(k, q)).collect();
        let mut at = 0;
        let packed: Vec<Range<usize>> = pieces
            .iter()
            .map(|p| {
                at += p.len();
                at - p.len()..at
            })
            .collect();
        (pieces, packed)
    };
    // The finished piece goes out through the stage, and the others come back into the caller's
    // buffer only once the gather completed.
    let gather = |t: &mut dyn ShareTransport, stage: &mut [f32], buf: &mut [f32], k: usize, (pieces, packed): &StepPieces| -> Result<()> {
        stage[packed[rank].clone()].copy_from_slice(&buf[pieces[rank].clone()]);
        t.gather(Step::Gather { chunk: k + 1, chunks: steps }, &mut stage[..packed[world - 1].end], packed)?;
        for q in (0..world).filter(|&q| q != rank) {
            buf[pieces[q].clone()].copy_from_slice(&stage[packed[q].clone()]);
        }
        Ok(())
    };
    // With a second step the finished pieces wait for every block's value before they go out:
    // first every step is exchanged, summed and passed, then the values are gathered, each rank
    // scales its own pieces, and the gathers follow. Without one, each step's piece goes out
    // while it is still in cache.
    let deferred = pass.rescales();
    for k in 0..steps {
        let (pieces, packed) = step_of(k);
        let own = pieces[rank].clone();
        let slots: Vec<Range<usize>> = (0..world)
            .map(|q| {
                let slot = q - usize::from(q > rank);
                if q == rank {
                    0..0
                } else {
                    slot * largest..slot * largest + own.len()
                }
            })
            .collect();
        // The pieces this rank sends, copied out of the caller's buffer before the exchange: as
        // they are, or on a bf16 wire rounded to bf16 bits, which are widened back on arrival
        // (exactly), and this rank's own piece rounded in place before the sum.
        let others = (0..world).filter(|&q| q != rank);
        let step = Step::Exchange { chunk: k + 1, chunks: steps };
        let end = packed[world - 1].end;
        if bf16 {
            for q in others.clone() {
                cpu::to_bf16_bits(&buf[pieces[q].clone()], &mut ws.wire_stage[packed[q].clone()]);
            }
            t.exchange(step, &ws.wire_stage[..end], &packed, &mut ws.wire_scratch[..scratch_len], &slots)?;
            cpu::round_to_bf16(&mut buf[own.clone()], 1);
            for q in others {
                for (v, &w) in scratch[slots[q].clone()].iter_mut().zip(&ws.wire_scratch[slots[q].clone()]) {
                    *v = f32::from_bits((w as u32) << 16);
                }
            }
        } else {
            for q in others {
                stage[packed[q].clone()].copy_from_slice(&buf[pieces[q].clone()]);
            }
            t.exchange(step, words(&stage[..end]), &in_words(&packed), words_mut(scratch), &in_words(&slots))?;
        }
        let first = mine.len();
        mine.resize(first + cpu::blocks(own.len()), 0.0);
        sum_and_pass(&mut buf[own], rank, world, |q| &scratch[slots[q].clone()], pass, &mut mine[first..]);
        if share_out && !deferred {
            gather(t, stage, buf, k, &(pieces, packed))?;
        }
    }

    let mut values = vec![0.0; cpu::blocks(buf.len())];
    if pass.writes_values() {
        let blocks_of = |p: &Range<usize>| p.start / NORM_BLOCK..p.start / NORM_BLOCK + cpu::blocks(p.len());
        let counts: Vec<usize> = (0..world).map(|q| cut.pieces(q).iter().map(|p| blocks_of(p).len()).sum()).collect();
        let all = &mut ws.all;
        all.clear();
        all.resize(counts.iter().sum(), 0.0);
        t.gather_values(mine, &counts, all)?;
        let mut next = all.iter();
        for q in 0..world {
            for p in cut.pieces(q) {
                for (slot, &v) in values[blocks_of(&p)].iter_mut().zip(next.by_ref()) {
                    *slot = v;
                }
            }
        }
    }
    if deferred {
        let factor = pass.rescale(&values);
        for k in 0..steps {
            if let Some(factor) = factor {
                cpu::scale(&mut buf[cut.piece(k, rank)], factor, 1);
            }
            if share_out {
                gather(t, stage, buf, k, &step_of(k))?;
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
                for len in [1, 100, block, block + 1, 2 * block - 1, 5 * block + 17, 3 * world * 4 * block + 3 * block + 5] {
                    let plan = Plan::new(len, world, share_numel);
                    assert_eq!(plan.largest() % block, 0);
                    assert!(plan.largest() >= share_numel.min(MAX_CHUNK_NUMEL / world).max(1));
                    let mut next = 0;
                    let mut blocks_seen = vec![0u32; cpu::blocks(len)];
                    for chunk in plan.chunks() {
                        assert_eq!(chunk.start, next);
                        assert!(chunk.len() <= world * plan.largest());
                        let full = chunk.len() == world * plan.largest();
                        let mut at = chunk.start;
                        for q in 0..world {
                            let s = plan.share(&chunk, q);
                            assert_eq!(s.start, at, "shares are contiguous, in rank order");
                            assert!(s.start.is_multiple_of(block) || s.is_empty() && s.start == chunk.end);
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
                            blocks_seen[first..first + cpu::blocks(p.len())].iter_mut().for_each(|n| *n += 1);
                        }
                    }
                    assert!(blocks_seen.iter().all(|&n| n == 1), "every block is passed by exactly one rank");
                }
            }
        }
        // The pieces of a plan are its shares, chunk by chunk.
        let plan = Plan::new(5 * block + 17, 2, block);
        assert_eq!(plan.pieces(1), [block..2 * block, 3 * block..4 * block, 5 * block..5 * block + 17]);
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
        (1.0 / (1.0 + cpu::fold_block_sums(values).sqrt())) as f32
    }

    impl BlockPass for Normalise {
        fn run(&self, run: &mut [f32], values: &mut [f64]) {
            cpu::scale_and_block_sum_squares(run, self.factor, values, 1);
        }

        fn add_and_run(&self, run: &mut [f32], addend: &[f32], values: &mut [f64]) {
            if self.fused {
                cpu::add_and_block_sum_squares(run, addend, Some(self.factor), values);
            } else {
                cpu::add_assign(run, addend);
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
            let data: Vec<Vec<f32>> = (0..world).map(|r| (0..len).map(|i| value(r, i)).collect()).collect();
            let mut want: Vec<f32> = (0..len).map(|i| (1..world).fold(data[0][i], |s, r| s + data[r][i])).collect();
            let mut want_values = vec![0.0; cpu::blocks(len)];
            cpu::scale_and_block_sum_squares(&mut want, 0.3, &mut want_values, 1);
            for rank in 0..world {
                for fused in [false, true] {
                    let mut own = data[rank].clone();
                    let mut values = vec![0.0; cpu::blocks(len)];
                    sum_and_pass(&mut own, rank, world, |q| &data[q], &Normalise { factor: 0.3, fused, clip: false, wire: Dtype::F32 }, &mut values);
                    assert!(own.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "world {world} rank {rank}");
                    assert!(values.iter().zip(&want_values).all(|(a, b)| a.to_bits() == b.to_bits()), "world {world} rank {rank}");
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
    /// between barriers, with the same contract as the MPI one.
    struct Threads {
        rank: usize,
        world: usize,
        barrier: Arc<Barrier>,
        posts: Arc<Mutex<Vec<(usize, usize)>>>,
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
                .map(|rank| Threads { rank, world, barrier: barrier.clone(), posts: posts.clone(), handed: Vec::new(), words_received: 0 })
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

        fn exchange(&mut self, _step: Step, chunk: &[u16], shares: &[Range<usize>], scratch: &mut [u16], slots: &[Range<usize>]) -> Result<()> {
            let posts = self.publish(chunk.as_ptr(), chunk.len());
            self.handed.push(scratch.as_ptr() as usize..scratch.as_ptr() as usize + std::mem::size_of_val(scratch));
            for q in (0..self.world).filter(|&q| q != self.rank) {
                self.words_received += slots[q].len();
                // SAFETY: `posts[q]` is the pointer and length of rank q's `chunk`, published before
                // `publish`'s barrier; rank q holds it as `&[u16]`, so nobody writes it, and it stays
                // alive until rank q passes the barrier below.
                let theirs = unsafe { std::slice::from_raw_parts(posts[q].0 as *const u16, posts[q].1) };
                scratch[slots[q].clone()].copy_from_slice(&theirs[shares[self.rank].clone()]);
            }
            self.barrier.wait();
            Ok(())
        }

        fn gather(&mut self, _step: Step, chunk: &mut [f32], shares: &[Range<usize>]) -> Result<()> {
            let posts = self.publish(chunk.as_ptr(), chunk.len());
            for q in (0..self.world).filter(|&q| q != self.rank) {
                let s = shares[q].clone();
                // SAFETY: `posts[q]` is rank q's chunk, alive until the barrier below; `shares[q]` is
                // inside it (same plan on every rank), and share q is final and only read now: every
                // rank writes only the other ranks' shares of its own chunk.
                let theirs = unsafe { std::slice::from_raw_parts((posts[q].0 as *const f32).add(s.start), s.len()) };
                chunk[s].copy_from_slice(theirs);
            }
            self.barrier.wait();
            Ok(())
        }

        fn gather_values(&mut self, mine: &[f64], counts: &[usize], all: &mut [f64]) -> Result<()> {
            let posts = self.publish(mine.as_ptr(), mine.len());
            self.handed.push(all.as_ptr() as usize..all.as_ptr() as usize + std::mem::size_of_val(all));
            let mut at = 0;
            for q in 0..self.world {
                assert_eq!(posts[q].1, counts[q]);
                // SAFETY: `posts[q]` is rank q's `mine`, held as `&[f64]` (so unwritten) and alive
                // until the barrier below; its length was checked against `counts[q]` just above.
                let theirs = unsafe { std::slice::from_raw_parts(posts[q].0 as *const f64, posts[q].1) };
                all[at..at + counts[q]].copy_from_slice(theirs);
                at += counts[q];
            }
            self.barrier.wait();
            Ok(())
        }
    }

    /// Every rank's buffer and block values from the reduction in shares.
    fn in_shares(world: usize, len: usize, share_numel: usize, factor: f32, clip: bool) -> Vec<(Vec<f32>, Vec<f64>)> {
        let group = Threads::group(world);
        let pass = Normalise { factor, fused: true, clip, wire: Dtype::F32 };
        std::thread::scope(|s| {
            let handles: Vec<_> = group
                .into_iter()
                .map(|mut t| {
                    let pass = &pass;
                    s.spawn(move || {
                        let mut buf: Vec<f32> = (0..len).map(|i| value(t.rank, i)).collect();
                        // Twice over one workspace: the second call reuses the first's memory.
                        let mut ws = Workspace::default();
                        let mut copy = buf.clone();
                        let first = reduce_in_shares(&mut t, &mut ws, &mut copy, share_numel, pass).unwrap();
                        let values = reduce_in_shares(&mut t, &mut ws, &mut buf, share_numel, pass).unwrap();
                        assert!(copy.iter().zip(&buf).all(|(a, b)| a.to_bits() == b.to_bits()) && first == values);
                        // No collective was handed the caller's memory, which an abandoned request
                        // between processes could still read or write after the call returned.
                        for caller in [buf.as_ptr_range(), copy.as_ptr_range()] {
                            let caller = caller.start as usize..caller.end as usize;
                            assert!(!t.handed.is_empty());
                            assert!(
                                t.handed.iter().all(|h| h.is_empty() || h.end <= caller.start || caller.end <= h.start),
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
    fn scattered(world: usize, len: usize, piece_numel: usize, clip: bool, local: bool) -> Vec<(Vec<f32>, Vec<f64>)> {
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
                            reduce_by_cut(&mut t, &mut Workspace::default(), &mut buf, &cut, false, pass).unwrap()
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
            for len in [1, 100, block + 1, 3 * block + 7, 7 * block, 2 * world * 3 * block + 2 * block + 99] {
                let shards = shard_ranges(len, world);
                for clip in [false, true] {
                    let (sum, values) = reference(world, len, 0.3, clip);
                    let mut runs = vec![("in process", scattered(world, len, SHARE_NUMEL, clip, true))];
                    for piece_numel in [block, 2 * block, SHARE_NUMEL] {
                        runs.push(("between processes", scattered(world, len, piece_numel, clip, false)));
                    }
                    for (how, run) in runs {
                        for (rank, got) in run.iter().enumerate() {
                            let want = (sum[shards[rank].clone()].to_vec(), values.clone());
                            assert!(same_bits(got, &want), "{how}: world {world} len {len} clip {clip} rank {rank}");
                        }
                    }
                }
            }
        }
    }

    /// Every rank's result (its whole buffer after an all-reduce, its shard after a
    /// reduce-scatter), the block values, and the 16-bit words it received in exchanges, sent on
    /// `wire` through the test transport; with `round`, the inputs are rounded to bf16 first.
    fn over_the_wire(world: usize, len: usize, scatter: bool, wire: Dtype, round: bool) -> Vec<(Vec<f32>, Vec<f64>, usize)> {
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
                            cpu::round_to_bf16(&mut buf, 1);
                        }
                        let mut ws = Workspace::default();
                        let values = if scatter {
                            let cut = ShardCut { shards, piece_numel: 2 * NORM_BLOCK };
                            let values = reduce_by_cut(&mut t, &mut ws, &mut buf, &cut, false, pass).unwrap();
                            buf = buf[shards[t.rank].clone()].to_vec();
                            values
                        } else {
                            reduce_in_shares(&mut t, &mut ws, &mut buf, NORM_BLOCK, pass).unwrap()
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
                        assert!(same_bits(&(a.0.clone(), a.1.clone()), &(b.0.clone(), b.1.clone())), "{what}");
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
        let mut sum: Vec<f32> = (0..len).map(|i| (1..world).fold(value(0, i), |s, r| s + value(r, i))).collect();
        let mut values = vec![0.0; cpu::blocks(len)];
        cpu::scale_and_block_sum_squares(&mut sum, factor, &mut values, 1);
        if clip {
            cpu::scale(&mut sum, clip_factor(&values), 1);
        }
        (sum, values)
    }

    #[test]
    fn shares_give_the_reference_bits_for_any_cut() {
        let block = NORM_BLOCK;
        for world in [1, 2, 3, 5] {
            // Buffers shorter than a block, with fewer blocks than ranks, not a multiple of the
            // chunk, and spanning several chunks; shares smaller than a block and not whole blocks.
            for len in [1, 100, block + 1, 3 * block + 7, 7 * block, 2 * world * 3 * block + 2 * block + 99] {
                for clip in [false, true] {
                    let want = reference(world, len, 0.3, clip);
                    for (rank, got) in in_process(world, len, 0.3, clip).iter().enumerate() {
                        assert!(same_bits(got, &want), "in process: world {world} len {len} clip {clip} rank {rank}");
                    }
                    for share_numel in [1, block, 2 * block + 1, 3 * block, SHARE_NUMEL] {
                        for (rank, got) in in_shares(world, len, share_numel, 0.3, clip).iter().enumerate() {
                            assert!(same_bits(got, &want), "world {world} len {len} share {share_numel} clip {clip} rank {rank}");
                        }
                    }
                }
            }
        }
    }
}
