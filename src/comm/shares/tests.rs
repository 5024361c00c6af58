//! The reduction in shares against its references: the plan's cut, the per-share sum's order,
//! the copying and shared-memory transports over threads, and the in-process communicator's bits.

use std::sync::{Arc, Barrier, Mutex};

use super::cut::MAX_CHUNK_NUMEL;
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
                            s.start.is_multiple_of(block) || s.is_empty() && s.start == chunk.end
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
            all.as_ptr() as usize..all.as_ptr() as usize + std::mem::size_of_val(all.as_slice()),
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
        for len in
            [1, 100, block + 1, 3 * block + 7, 7 * block, 2 * world * 3 * block + 2 * block + 99]
        {
            let shards = shard_ranges(len, world);
            for clip in [false, true] {
                let (sum, values) = reference(world, len, 0.3, clip);
                let mut runs = vec![("in process", scattered(world, len, SHARE_NUMEL, clip, true))];
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
                        let values = reduce_by_cut(&mut t, &mut buf, &cut, false, pass).unwrap();
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
        for len in
            [1, 100, block + 1, 3 * block + 7, 7 * block, 2 * world * 3 * block + 2 * block + 99]
        {
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
                        assert!(
                            same_bits(got, &want),
                            "world {world} len {len} share {share_numel} clip {clip} rank {rank}"
                        );
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
    let region = unsafe { super::super::shm::Region::new(mem.as_mut_ptr().cast(), world, piece) };
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
                    (0..world).map(|r| (sum[shards[r].clone()].to_vec(), values.clone())).collect()
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
                        let e = reduce_in_shares(&mut t, &mut vec![1.0; len], SHARE_NUMEL, pass)
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
        assert!(took1 < Duration::from_secs(10), "rank 1 waited {took1:?} for a peer that gave up");
    }
}
