//! How the reduction in shares cuts a buffer: the all-reduce's plan of chunks and shares, the
//! reduce-scatter's shards, and the [`Cut`] both are, always in whole blocks of the norm.

use std::ops::Range;

use crate::math::NORM_BLOCK;
use crate::simd;

/// Elements of one rank's share of a full chunk (256 KB). A share and the other ranks' copies of
/// it stay in L2 from the exchange through the sum and the pass to the gather. At 2 processes on
/// the benchmark machine shares of 32K-128K elements were equally fast, 256K about 5% slower and
/// 1M about 14% slower (docs/mpi.md).
pub const SHARE_NUMEL: usize = 64 * 1024;

/// Most elements in one chunk. With many ranks the shares shrink (to one block at the least), so
/// the scratch for the other ranks' copies of a share stays under 16 MB.
pub(super) const MAX_CHUNK_NUMEL: usize = 4 << 20;

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

    /// How many chunks the plan cuts the buffer into.
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
