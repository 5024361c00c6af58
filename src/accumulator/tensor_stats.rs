//! Per-tensor telemetry of a boundary (`AccumulatorConfig::tensor_stats`): each tensor's L2 norm
//! of the reduced, normalised gradient, and in how many micro-batches it held a non-finite value,
//! the same on every rank under every policy.
//!
//! The norms come out of the boundary's own pass over the sum: while a run of blocks is in cache,
//! each segment of it (the part of one tensor inside one norm block) has its squares summed in
//! f64. The segments are fixed by the layout, so whichever rank and thread passes a segment, its
//! value is the same; the ranks then share their segments in one gather (with the counts), and
//! every rank folds each tensor's segments in position order: the same bits everywhere.

use std::ops::Range;

use parking_lot::Mutex;

use super::Layout;
use crate::comm::HostCollectives;
use crate::error::Result;
use crate::math::NORM_BLOCK;

/// One tensor's telemetry of the last boundary.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TensorStats {
    /// The L2 norm of the tensor's reduced, normalised gradient, before clipping (the part of
    /// [`SyncInfo::grad_norm`](super::SyncInfo::grad_norm) this tensor holds).
    pub grad_norm: f64,
    /// Micro-batches, over every rank, in which this tensor held a non-finite value after
    /// unscaling (dropped ones included).
    pub nonfinite_microbatches: u64,
}

/// A segment no pass on this rank has summed yet (a sum of squares is never negative).
const NOT_HERE: f64 = -1.0;

/// The segments of a layout, in position order: tensor `tensor`'s values inside one norm block.
#[derive(Debug)]
pub(crate) struct Segments {
    spans: Vec<(Range<usize>, usize)>,
}

impl Segments {
    pub(crate) fn new(layout: &Layout, tensors: usize) -> Self {
        let mut spans = Vec::new();
        for t in 0..tensors {
            let r = layout.range(t);
            let mut at = r.start;
            while at < r.end {
                let end = r.end.min((at / NORM_BLOCK + 1) * NORM_BLOCK);
                spans.push((at..end, t));
                at = end;
            }
        }
        Segments { spans }
    }

    pub(crate) fn len(&self) -> usize {
        self.spans.len()
    }

    /// Each segment's [start, end) in master elements, in order: a device's table of them.
    pub(crate) fn bounds(&self) -> Vec<[u64; 2]> {
        self.spans.iter().map(|(r, _)| [r.start as u64, r.end as u64]).collect()
    }

    /// The sums of this rank's passes, to be filled by [`Squares::record`].
    pub(crate) fn squares(&self) -> Squares<'_> {
        Squares { segments: self, sums: Mutex::new(vec![NOT_HERE; self.spans.len()]) }
    }

    /// Every tensor's stats from every rank's segment sums (`gathered`, one array of
    /// [`Segments::len`] per rank, in rank order; the first rank that summed a segment gives its
    /// value) and the non-finite counts summed over the ranks. `scale` turns a sum of squares of
    /// the values passed into the normalised gradient's: `1 / divisor²` when the pass measured
    /// the sum before normalising it.
    pub(crate) fn stats(&self, gathered: &[f64], counts: &[u64], scale: f64) -> Vec<TensorStats> {
        let n = self.spans.len();
        let mut squares = vec![0.0f64; counts.len()];
        for (s, (_, t)) in self.spans.iter().enumerate() {
            let value =
                gathered.chunks(n).map(|rank| rank[s]).find(|&v| v != NOT_HERE).unwrap_or(0.0);
            squares[*t] += value;
        }
        squares
            .iter()
            .zip(counts)
            .map(|(&sq, &nonfinite_microbatches)| TensorStats {
                grad_norm: (sq * scale).sqrt(),
                nonfinite_microbatches,
            })
            .collect()
    }
}

/// A host group and its size.
pub(crate) type Group<'a> = (&'a dyn HostCollectives, usize);

/// Every tensor's stats on every rank of a host boundary: this rank's segment `sums` and
/// non-finite `counts` gathered over `group` (none: this rank alone), then at a hybrid boundary
/// over `replicas` too: the counts summed, and the sums merged, since a replica may have measured
/// only its share of the shard (a sharded accumulation's replicas all-reduce it share by share,
/// each passing its own), in rank order.
pub(crate) fn share(
    segments: &Segments,
    group: Option<Group<'_>>,
    replicas: Option<Group<'_>>,
    sums: Vec<f64>,
    counts: &[u64],
    scale: f64,
) -> Result<Vec<TensorStats>> {
    // Counts are exact in f64: a window holds far fewer than 2^53 micro-batches.
    let mut mine = sums;
    mine.extend(counts.iter().map(|&c| c as f64));
    let (mut gathered, mut counts) = match group {
        Some((g, world)) => {
            let all = g.allgather_values(&mine, &vec![mine.len(); world])?;
            let (n, mut sums, mut total) = (segments.len(), Vec::new(), vec![0u64; counts.len()]);
            for rank in all.chunks(mine.len()) {
                sums.extend_from_slice(&rank[..n]);
                total.iter_mut().zip(&rank[n..]).for_each(|(t, &c)| *t += c as u64);
            }
            (sums, total)
        }
        None => (mine[..segments.len()].to_vec(), counts.to_vec()),
    };
    if let Some((r, world)) = replicas {
        let mut per_group = gathered.clone();
        per_group.extend(counts.iter().map(|&c| c as f64));
        let all = r.allgather_values(&per_group, &vec![per_group.len(); world])?;
        let n = gathered.len();
        counts.fill(0);
        gathered.fill(NOT_HERE);
        for replica in all.chunks(per_group.len().max(1)) {
            for (g, &v) in gathered.iter_mut().zip(&replica[..n]) {
                if *g == NOT_HERE {
                    *g = v;
                }
            }
            counts.iter_mut().zip(&replica[n..]).for_each(|(t, &c)| *t += c as u64);
        }
    }
    Ok(segments.stats(&gathered, &counts, scale))
}

/// The segment sums of one rank's boundary passes.
pub(crate) struct Squares<'a> {
    segments: &'a Segments,
    sums: Mutex<Vec<f64>>,
}

impl Squares<'_> {
    /// The values of the flat master from element `at` have passed: every segment inside them
    /// is summed by `sum` (a block's sum of squares, `math::block_sum_squares`'s bits on any
    /// device; a pass runs over whole blocks, so a segment is never cut).
    pub(crate) fn record(&self, at: usize, values: &[f32], sum: &dyn Fn(&[f32]) -> f64) {
        let spans = &self.segments.spans;
        let end = at + values.len();
        let first = spans.partition_point(|(r, _)| r.start < at);
        let mut found = Vec::new();
        for (s, (r, _)) in spans.iter().enumerate().skip(first) {
            if r.start >= end {
                break;
            }
            found.push((s, sum(&values[r.start - at..r.end.min(end) - at])));
        }
        let mut sums = self.sums.lock();
        for (s, sum) in found {
            sums[s] = sum;
        }
    }

    /// This rank's segment sums, [`NOT_HERE`] where it passed none.
    pub(crate) fn into_sums(self) -> Vec<f64> {
        self.sums.into_inner()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accumulator::TensorDesc;
    use crate::dtype::Dtype;
    use crate::math::block_sum_squares;

    #[test]
    fn segments_cut_tensors_at_blocks_and_any_rank_may_sum_them() {
        let descs: Vec<TensorDesc> = [5000usize, 3, 9000, 1]
            .iter()
            .map(|&numel| TensorDesc { numel, dtype: Dtype::F32 })
            .collect();
        let layout = Layout::new(&descs, 1 << 20).unwrap();
        let segments = Segments::new(&layout, descs.len());
        // The padding's values are never summed: give it some.
        let master: Vec<f32> = (0..layout.len()).map(|i| (i % 7) as f32 - 3.0).collect();
        // Two "ranks" pass alternate blocks; a third passes everything.
        let blocks: Vec<Range<usize>> = (0..layout.len().div_ceil(NORM_BLOCK))
            .map(|b| b * NORM_BLOCK..((b + 1) * NORM_BLOCK).min(layout.len()))
            .collect();
        let ranks: Vec<Vec<f64>> = (0..3)
            .map(|rank| {
                let squares = segments.squares();
                for (b, r) in blocks.iter().enumerate() {
                    if rank == 2 || b % 2 == rank {
                        squares.record(r.start, &master[r.clone()], &block_sum_squares);
                    }
                }
                squares.into_sums()
            })
            .collect();
        for gathered in [ranks[..2].concat(), ranks[2].clone(), ranks.concat()] {
            let stats = segments.stats(&gathered, &[0, 1, 2, 3], 0.25);
            for (t, s) in stats.iter().enumerate() {
                let want: f64 = master[layout.range(t)].iter().map(|&v| (v as f64).powi(2)).sum();
                assert!((s.grad_norm - (want * 0.25).sqrt()).abs() <= 1e-12 * want.sqrt());
                assert_eq!(s.nonfinite_microbatches, t as u64);
            }
        }
    }
}
