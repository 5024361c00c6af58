//! The in-process communicator: N ranks as threads of one process, one handle per rank. Buffers
//! are reduced in place without a scratch copy, by the cuts of `shares` that MPI uses: rank r
//! sums its pieces over all ranks in rank order (so the bits are the same whoever computes them)
//! and runs the boundary's pass on each while it is in cache, then every rank copies the other
//! pieces (or, for a reduce-scatter, keeps only its own). The bits are the MPI communicator's.
//!
//! Ranks meet at an abortable, time-limited barrier (one mutex, one condition variable, a
//! generation counter). The group has a failure state: an abort, a timeout or a dropped handle
//! sets it (the first one's reason is kept), wakes every waiting rank, and fails every later
//! collective. Because ranks read each other's buffers, the barrier also counts the ranks inside
//! the reading phases of an all-reduce: a rank that fails out of one waits until no rank reads
//! any more before it returns, so its caller never frees a buffer a peer still reads.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::{
    check_buckets, check_counts, check_shards, shares, BlockPass, Busy, BusyGuard, Communicator,
    ControlSum, HostCollectives, DEFAULT_TIMEOUT,
};
use crate::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};
use crate::math::NORM_BLOCK;
use crate::simd;

/// The handle's timeout in nanoseconds when it is this value: wait forever.
const FOREVER: u64 = u64::MAX;

/// A rank's published buffers during a reduction: the one being summed, and (in a reduction
/// with a pass) its values, one per block.
#[derive(Clone, Copy)]
struct Published {
    ptr: *mut f32,
    len: usize,
    values: *mut f64,
}

// SAFETY: a published pointer is only dereferenced inside the reading phases of one all-reduce,
// while its owner is inside the same collective and keeps the buffer alive: the owner returns only
// after every rank has left the reading phases (see `Group::wait`).
unsafe impl Send for Published {}

/// What a rank waits for at a barrier, for the messages of timeouts and failures. Each kind of
/// collective is its own variant: ranks in different ones fail at their first barrier.
#[derive(Clone, Copy)]
enum What {
    Control,
    AllReduce(usize),
    AllReduceWithPass(usize),
    ReduceScatterWithPass(usize),
    Gather(usize),
}

impl fmt::Display for What {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            What::Control => f.write_str("the control exchange"),
            What::AllReduce(n) => write!(f, "the all-reduce of {n} elements"),
            What::AllReduceWithPass(n) => write!(f, "the boundary's all-reduce of {n} elements"),
            What::ReduceScatterWithPass(n) => {
                write!(f, "the boundary's reduce-scatter of {n} elements")
            }
            What::Gather(n) => write!(f, "the gather of {n} values"),
        }
    }
}

/// How a barrier relates to the reading phases of an all-reduce (ranks reading peers' buffers).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reads {
    /// No rank reads a peer's buffer around this barrier.
    None,
    /// Reading starts when this barrier opens: every rank becomes a reader at once.
    Start,
    /// This rank reads before and after this barrier.
    Within,
    /// This rank has stopped reading when it arrives here.
    End,
}

/// Why the group failed: the first failure's reason, given to every rank that fails after it.
struct Failure {
    reason: String,
}

struct State {
    /// Ranks arrived at the barrier of the current generation.
    arrived: Vec<bool>,
    count: usize,
    /// Bumped each time the barrier opens.
    generation: u64,
    /// The collective and the barrier within it that the first rank of this generation arrived
    /// at: a rank that arrives at another one (ranks calling different collectives) fails the
    /// group before anyone reads a buffer that was published for another collective.
    tag: Option<(std::mem::Discriminant<What>, Reads)>,
    /// Ranks inside the reading phases of an all-reduce (whose buffers others may read).
    readers: usize,
    failure: Option<Failure>,
    buffers: Vec<Published>,
    controls: Vec<ControlSum>,
}

struct Group {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank of an in-process group. Each handle is meant for one thread (one replica); the
/// handles of a group must all take part in every collective. Dropping a handle fails the group
/// (the rank left it): ranks waiting for it, and every later collective, fail with COMM_FAILURE.
pub struct LocalComm {
    rank: usize,
    group: Arc<Group>,
    /// Set while this handle is inside a collective: a second concurrent use is refused, not raced.
    busy: Busy,
    /// How long a wait at a barrier may last, in nanoseconds ([`FOREVER`]: no limit).
    timeout_ns: AtomicU64,
}

fn ranks(list: &[usize]) -> String {
    match list {
        [r] => format!("rank {r}"),
        _ => format!("ranks {list:?}"),
    }
}

impl Group {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    /// Marks the group failed with `reason` unless it already failed, and wakes every waiter.
    fn fail(&self, s: &mut State, reason: impl FnOnce() -> String) {
        if s.failure.is_none() {
            s.failure = Some(Failure { reason: reason() });
        }
        self.cv.notify_all();
    }

    /// Arrives at the barrier (with `s` locked, so a rank can publish its values in the same
    /// critical section) and waits until every rank has arrived, the group fails, or `timeout`
    /// passes. On a failure, a rank that reads peers' buffers first stops being a reader, and
    /// every rank waits until no rank reads any more: then no buffer of this collective is read
    /// after its owner returns.
    fn wait(
        &self,
        mut s: MutexGuard<'_, State>,
        rank: usize,
        what: What,
        timeout: Option<Duration>,
        reads: Reads,
    ) -> Result<()> {
        let mut reading = reads == Reads::Within;
        if reads == Reads::End {
            s.readers -= 1;
        }
        if s.failure.is_some() {
            return Err(self.leave(s, rank, what, reading));
        }
        let tag = (std::mem::discriminant(&what), reads);
        if *s.tag.get_or_insert(tag) != tag {
            self.fail(&mut s, || format!("the ranks called different collectives (rank {rank} arrived in {what}); the group was aborted"));
            return Err(self.leave(s, rank, what, reading));
        }
        s.arrived[rank] = true;
        s.count += 1;
        if s.count == self.world {
            self.open(&mut s, reads);
            return Ok(());
        }
        let generation = s.generation;
        let start = Instant::now();
        let deadline = timeout.and_then(|t| start.checked_add(t));
        loop {
            match deadline {
                None => self.cv.wait(&mut s),
                Some(d) => {
                    if Instant::now() >= d {
                        break;
                    }
                    let _ = self.cv.wait_until(&mut s, d);
                }
            }
            if s.generation != generation {
                return Ok(());
            }
            if s.failure.is_some() {
                return Err(self.leave(s, rank, what, reading));
            }
        }
        // Timed out: name the ranks that had not arrived, and fail the group so they stop too.
        let waited = start.elapsed();
        let missing: Vec<usize> = (0..self.world).filter(|&r| !s.arrived[r]).collect();
        let first = s.failure.is_none();
        self.fail(&mut s, || format!("rank {rank} timed out after {waited:.2?} in {what} waiting for {}; the group was aborted", ranks(&missing)));
        if !first {
            return Err(self.leave(s, rank, what, reading));
        }
        if std::mem::take(&mut reading) {
            s.readers -= 1;
        }
        drop(self.drain(s));
        Err(Error::new(
            ErrorKind::Timeout,
            format!(
                "local communicator rank {rank}: {what} did not complete within the timeout of {:?} (waited {waited:.2?}): {} had not arrived; the group was aborted",
                timeout.unwrap_or_default(),
                ranks(&missing)
            ),
        ))
    }

    /// Opens the barrier: the last rank arrived.
    fn open(&self, s: &mut State, reads: Reads) {
        s.count = 0;
        s.arrived.fill(false);
        s.generation = s.generation.wrapping_add(1);
        s.tag = None;
        if reads == Reads::Start {
            s.readers = self.world;
        }
        self.cv.notify_all();
    }

    /// The failed group's error for `rank`, once no rank reads a peer's buffer any more.
    fn leave(&self, mut s: MutexGuard<'_, State>, rank: usize, what: What, reading: bool) -> Error {
        if reading {
            s.readers -= 1;
        }
        let s = self.drain(s);
        let reason = s.failure.as_ref().map_or("", |f| f.reason.as_str());
        Error::new(
            ErrorKind::CommFailure,
            format!("local communicator rank {rank}: {what} failed: {reason}"),
        )
    }

    /// Waits until no rank is inside a reading phase. Readers only read memory and then arrive at
    /// a barrier, where they see the failure and stop reading: the wait is short and bounded.
    fn drain<'a>(&'a self, mut s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        if s.readers == 0 {
            self.cv.notify_all();
        }
        while s.readers > 0 {
            self.cv.wait(&mut s);
        }
        s
    }
}

/// Held by a rank inside the reading phases of an all-reduce. Should the rank panic there, it
/// fails the group and, before the unwinding frees the rank's buffer, stops reading and waits
/// until no peer reads any more. It does nothing unless the thread panics.
struct Reading<'a> {
    group: &'a Group,
    rank: usize,
    counted: bool,
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        if self.counted && std::thread::panicking() {
            let rank = self.rank;
            let mut s = self.group.state();
            self.group.fail(&mut s, || format!("rank {rank} panicked in an all-reduce"));
            s.readers -= 1;
            drop(self.group.drain(s));
        }
    }
}

impl LocalComm {
    /// Creates the `world` handles of a new group, rank 0 first. Each has the timeout
    /// [`DEFAULT_TIMEOUT`].
    pub fn group(world: usize) -> Result<Vec<LocalComm>> {
        if world == 0 {
            return Err(Error::invalid("world_size must be >= 1, got 0"));
        }
        let group = Arc::new(Group {
            world,
            state: Mutex::new(State {
                arrived: vec![false; world],
                count: 0,
                generation: 0,
                tag: None,
                readers: 0,
                failure: None,
                buffers: vec![
                    Published {
                        ptr: std::ptr::null_mut(),
                        len: 0,
                        values: std::ptr::null_mut()
                    };
                    world
                ],
                controls: vec![ControlSum::default(); world],
            }),
            cv: Condvar::new(),
        });
        let ns = DEFAULT_TIMEOUT.as_nanos() as u64;
        Ok((0..world)
            .map(|rank| LocalComm {
                rank,
                group: group.clone(),
                busy: Busy::default(),
                timeout_ns: AtomicU64::new(ns),
            })
            .collect())
    }

    fn enter(&self) -> Result<BusyGuard<'_>> {
        self.busy.enter(|| format!("local communicator rank {}", self.rank))
    }
}

impl Drop for LocalComm {
    /// A rank that leaves fails the group, so peers waiting for it wake instead of waiting
    /// forever. No collective of this handle is running (it would borrow the handle), so no peer
    /// reads this rank's buffers.
    fn drop(&mut self) {
        let rank = self.rank;
        let mut s = self.group.state();
        self.group.fail(&mut s, || format!("rank {rank} left the group"));
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn host(&self) -> Option<&dyn HostCollectives> {
        Some(self)
    }

    /// Fails the whole group: every rank waiting in a collective returns COMM_FAILURE (after no
    /// rank reads its buffer any more), and so does every later collective of any rank.
    fn abort(&self) -> Result<()> {
        let rank = self.rank;
        let mut s = self.group.state();
        self.group.fail(&mut s, || format!("the group was aborted by rank {rank}"));
        Ok(())
    }

    fn timeout(&self) -> Option<Duration> {
        match self.timeout_ns.load(Ordering::Relaxed) {
            FOREVER => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    fn set_timeout(&self, timeout: Option<Duration>) -> Result<()> {
        let ns = timeout.map_or(FOREVER, |t| {
            u64::try_from(t.as_nanos()).unwrap_or(FOREVER - 1).min(FOREVER - 1)
        });
        self.timeout_ns.store(ns, Ordering::Relaxed);
        Ok(())
    }
}

impl HostCollectives for LocalComm {
    fn reduce_control(&self, mine: &ControlSum) -> Result<ControlSum> {
        let _busy = self.enter()?;
        let g = &*self.group;
        let (rank, timeout, what) = (self.rank, self.timeout(), What::Control);
        let mut s = g.state();
        s.controls[rank] = *mine;
        g.wait(s, rank, what, timeout, Reads::None)?;
        let sum = {
            let s = g.state();
            s.controls[1..].iter().fold(s.controls[0], |acc, c| acc.merge(c))
        };
        // Nobody may publish the next round's values before everyone has read this one.
        g.wait(g.state(), rank, what, timeout, Reads::None)?;
        Ok(sum)
    }

    /// The boundary's reduction by the share plan with nothing to pass: rank r sums its shares
    /// over the ranks in rank order, and every rank copies the others' shares.
    fn allreduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let plan = shares::Plan::new(buf.len(), self.group.world, shares::SHARE_NUMEL);
        self.reduce_with_pass(buf, What::AllReduce(buf.len()), &plan, true, &Sum).map(drop)
    }

    /// The reduction in shares of `shares::reduce_in_shares`, with the peers' buffers read in
    /// place instead of exchanged: the buffer is cut by the same plan, rank r sums its share of
    /// each chunk over all ranks in rank order and runs `pass` on it while it is in cache, the
    /// ranks read each other's block values, each scales its own shares when the pass has a
    /// second step, and then every rank copies the other shares. Each rank passes over
    /// `1/world` of the buffer, and the bits are those of the reduction in shares between
    /// processes. Buckets do not change the result: they are only checked.
    fn allreduce_with_pass(
        &self,
        buf: &mut [f32],
        buckets: &[Range<usize>],
        pass: &dyn BlockPass,
    ) -> Result<Vec<f64>> {
        check_buckets(buf.len(), buckets)?;
        let plan = shares::Plan::new(buf.len(), self.group.world, shares::SHARE_NUMEL);
        self.reduce_with_pass(buf, What::AllReduceWithPass(buf.len()), &plan, true, pass)
    }

    /// As the reduction in shares, with each rank's shard whole: rank r sums shard r in pieces
    /// of `shares::SHARE_NUMEL` elements, each passed while in cache, and nobody copies the
    /// other shards.
    fn reduce_scatter_with_pass(
        &self,
        buf: &mut [f32],
        shards: &[Range<usize>],
        pass: &dyn BlockPass,
    ) -> Result<Vec<f64>> {
        check_shards(buf.len(), shards, self.group.world)?;
        let cut = shares::ShardCut { shards, piece_numel: shares::SHARE_NUMEL };
        self.reduce_with_pass(buf, What::ReduceScatterWithPass(buf.len()), &cut, false, pass)
    }

    /// Each rank publishes its values in place in its own result and copies the others' from
    /// their owners' results.
    fn allgather_values(&self, mine: &[f64], counts: &[usize]) -> Result<Vec<f64>> {
        let (rank, world) = (self.rank, self.group.world);
        check_counts(mine.len(), counts, rank, world)?;
        let _busy = self.enter()?;
        let what = What::Gather(counts.iter().sum());
        let starts: Vec<usize> =
            counts.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
        let mut all = vec![0.0f64; counts.iter().sum()];
        all[starts[rank]..starts[rank] + mine.len()].copy_from_slice(mine);
        // As in `reduce_with_pass`, the result is only used through the published pointer
        // until the end.
        let base = all.as_mut_ptr();
        let (peers, reading) = self.start_reading(
            Published { ptr: std::ptr::null_mut(), len: all.len(), values: base },
            what,
        )?;
        for (q, p) in peers.iter().enumerate().filter(|&(q, _)| q != rank) {
            // SAFETY: every rank's result is `all.len()` long (checked by `start_reading`) and
            // alive while any rank reads (see `reduce_with_pass`); rank q wrote its own values
            // before publishing and nobody writes them now; this rank writes only rank q's
            // range of its own result, which its peers do not read (each reads the range of its
            // owner only).
            unsafe {
                let theirs =
                    std::slice::from_raw_parts(p.values.add(starts[q]).cast_const(), counts[q]);
                std::slice::from_raw_parts_mut(base.add(starts[q]), counts[q])
                    .copy_from_slice(theirs);
            }
        }
        self.stop_reading(reading, what)?;
        Ok(all)
    }
}

impl LocalComm {
    /// The boundary's reduction by `cut` (see `shares::Cut`), in which rank q sums its pieces
    /// over the ranks in rank order and passes them. Phase 1: this rank's pieces, summed and
    /// passed while in cache. Phase 2: the other ranks' block values, then the pass's second step
    /// on this rank's pieces. Phase 3, with `share_out`: every other rank's pieces, copied from
    /// their owner. Returns every block's value, the same on every rank.
    fn reduce_with_pass(
        &self,
        buf: &mut [f32],
        what: What,
        cut: &dyn shares::Cut,
        share_out: bool,
        pass: &dyn BlockPass,
    ) -> Result<Vec<f64>> {
        let _busy = self.enter()?;
        let g = &*self.group;
        let (rank, world, timeout) = (self.rank, g.world, self.timeout());
        let len = buf.len();
        let mut values = vec![0.0f64; simd::blocks(len)];
        // A bf16 wire: the peers read this rank's contribution rounded, once (a pass over the
        // buffer before the reduction: they read it in place).
        if pass.wire() == Dtype::Bf16 {
            simd::round_to_bf16(buf, 1);
        }
        // Every access of this rank to its two published buffers goes through the pointers its
        // peers read through too: `buf` and `values` are not used through their own handles
        // until the end, so no access through them invalidates the peers'.
        let (base, vbase) = (buf.as_mut_ptr(), values.as_mut_ptr());
        let (peers, mut reading) =
            self.start_reading(Published { ptr: base, len, values: vbase }, what)?;
        let blocks_of =
            |s: &Range<usize>| s.start / NORM_BLOCK..s.start / NORM_BLOCK + simd::blocks(s.len());
        let mine = cut.pieces(rank);

        // Phase 1: this rank's ranges, summed over the ranks and passed.
        for own in &mine {
            let blocks = blocks_of(own);
            // SAFETY: the peers' buffers are `len` long (checked by `start_reading`) and alive
            // while any rank reads (`Group::wait` holds a failing rank until the reader count is
            // 0, so no peer returns and frees them first); in this phase only this rank touches
            // range `own` of any buffer and blocks `blocks` of any value array (the ranks' ranges
            // are disjoint, start on block boundaries, and each block lies in one range), so the
            // peers' copies are only read, and this rank's own, reached through the pointers it
            // published, are written by it alone.
            unsafe {
                let mine = std::slice::from_raw_parts_mut(base.add(own.start), own.len());
                let sums = std::slice::from_raw_parts_mut(vbase.add(blocks.start), blocks.len());
                let other = |q: usize| {
                    std::slice::from_raw_parts(peers[q].ptr.add(own.start).cast_const(), own.len())
                };
                shares::sum_and_pass(mine, rank, world, other, pass, sums);
            }
        }
        g.wait(g.state(), rank, what, timeout, Reads::Within)
            .inspect_err(|_| reading.counted = false)?;

        // Phase 2: the other ranks' block values, then this rank's second step on its ranges.
        let theirs: Vec<Vec<Range<usize>>> =
            (0..world).map(|q| if q == rank { Vec::new() } else { cut.pieces(q) }).collect();
        for (q, p) in peers.iter().enumerate().filter(|&(q, _)| q != rank) {
            for blocks in theirs[q].iter().map(blocks_of) {
                // SAFETY: rank q's value array holds `simd::blocks(len)` values and stays alive
                // while any rank reads; rank q wrote its own blocks in phase 1 and nobody writes
                // them now; this rank writes only blocks it does not own into its own array,
                // which its peers do not read (each reads the blocks of their owner only).
                unsafe {
                    let theirs = std::slice::from_raw_parts(
                        p.values.add(blocks.start).cast_const(),
                        blocks.len(),
                    );
                    std::slice::from_raw_parts_mut(vbase.add(blocks.start), blocks.len())
                        .copy_from_slice(theirs);
                }
            }
        }
        if pass.rescales() {
            // SAFETY: this rank's value array, complete now, is read by nobody else in this phase.
            let all = unsafe { std::slice::from_raw_parts(vbase.cast_const(), values.len()) };
            if let Some(factor) = pass.rescale(all) {
                for own in &mine {
                    // SAFETY: as in phase 1, this rank's ranges of its own buffer are touched by
                    // it alone until the barrier below.
                    simd::scale(
                        unsafe { std::slice::from_raw_parts_mut(base.add(own.start), own.len()) },
                        factor,
                        1,
                    );
                }
            }
            g.wait(g.state(), rank, what, timeout, Reads::Within)
                .inspect_err(|_| reading.counted = false)?;
        }

        // Phase 3: every other rank's ranges, copied from their owner, which only reads now.
        if share_out {
            for (q, p) in peers.iter().enumerate().filter(|&(q, _)| q != rank) {
                for range in &theirs[q] {
                    // SAFETY: rank q's buffer is `len` long and alive while any rank reads (as in
                    // phase 1); its range was finished before the barrier above and is only read
                    // now; this rank writes that range of its own buffer, through the pointer it
                    // published, which no other rank reads now (each reads its owner's ranges,
                    // and this rank does not own the range).
                    unsafe { copy_from_peer(base, p, range.clone()) };
                }
            }
        }
        self.stop_reading(reading, what)?;
        Ok(values)
    }

    /// Publishes this rank's buffers and waits for every rank's: from then on every rank is a
    /// reader until it calls [`LocalComm::stop_reading`]. Fails with SIZE_MISMATCH, on every
    /// rank and before anyone reads, when the buffers' lengths differ.
    fn start_reading(&self, mine: Published, what: What) -> Result<(Vec<Published>, Reading<'_>)> {
        let (g, rank, timeout) = (&*self.group, self.rank, self.timeout());
        let mut s = g.state();
        s.buffers[rank] = mine;
        g.wait(s, rank, what, timeout, Reads::Start)?;
        let mut reading = Reading { group: g, rank, counted: true };
        let peers: Vec<Published> = g.state().buffers.clone();
        if peers.iter().any(|p| p.len != mine.len) {
            // Nobody reads: leave the reading phase at once, and wait so that nobody publishes
            // the next round's buffer before everyone has copied this round's list.
            reading.counted = false;
            g.wait(g.state(), rank, what, timeout, Reads::End)?;
            let lens: Vec<usize> = peers.iter().map(|p| p.len).collect();
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("all-reduce buffer lengths differ across ranks: {lens:?}"),
            ));
        }
        Ok((peers, reading))
    }

    /// Leaves the reading phases: nobody may return (and free or reuse its buffers) while others
    /// still read them.
    fn stop_reading(&self, mut reading: Reading<'_>, what: What) -> Result<()> {
        reading.counted = false;
        self.group.wait(self.group.state(), self.rank, what, self.timeout(), Reads::End)
    }
}

/// The plain all-reduce's pass: the sum alone (`add_and_run`'s default adds, `run` does nothing).
struct Sum;

impl BlockPass for Sum {
    fn run(&self, _run: &mut [f32], _values: &mut [f64]) {}
}

/// Copies `range` of a peer's published buffer into the same range of this rank's, `base`.
///
/// # Safety
/// `peer` must be alive with `range` inside it and unwritten during the copy; `base` must be
/// this rank's published buffer with `range` inside it, read by no other rank during the copy.
unsafe fn copy_from_peer(base: *mut f32, peer: &Published, range: Range<usize>) {
    // SAFETY: the caller's contract.
    unsafe {
        let src = std::slice::from_raw_parts(peer.ptr.add(range.start).cast_const(), range.len());
        std::slice::from_raw_parts_mut(base.add(range.start), range.len()).copy_from_slice(src);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Control;

    #[test]
    fn sums_are_exact_and_identical_on_every_rank() {
        for world in [1usize, 2, 3, 5] {
            let comms = LocalComm::group(world).unwrap();
            let len = 10_007;
            let results: Vec<Vec<f32>> = std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .iter()
                    .map(|c| {
                        s.spawn(move || {
                            let r = c.rank();
                            let mut buf: Vec<f32> = (0..len)
                                .map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.37 + r as f32)
                                .collect();
                            c.allreduce_sum(&mut buf).unwrap();
                            buf
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for i in 0..len {
                // The reference: the same f32 sum in rank order.
                let mut want = 0f32;
                for r in 0..world {
                    let v = ((i * 7 + r * 13) % 101) as f32 * 0.37 + r as f32;
                    want = if r == 0 { v } else { want + v };
                }
                for res in &results {
                    assert_eq!(res[i].to_bits(), want.to_bits(), "world {world} element {i}");
                }
            }
        }
    }

    #[test]
    fn control_reduction_and_length_mismatch() {
        let comms = LocalComm::group(3).unwrap();
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    let r = c.rank() as u64;
                    let sum = c
                        .reduce_control(&ControlSum::of(&Control {
                            numel: 10 + r,
                            layout: 5,
                            count: r + 1,
                            microbatches: 1,
                            ranks: r + 1,
                            found_inf: r == 2,
                            dropped: r,
                            first_bad: if r == 0 { u64::MAX } else { 100 - r },
                            error: false,
                        }))
                        .unwrap();
                    assert_eq!(
                        sum,
                        ControlSum {
                            min_numel: 10,
                            max_numel: 12,
                            min_layout: 5,
                            max_layout: 5,
                            count: 6,
                            microbatches: 3,
                            ranks: 6,
                            found_inf: true,
                            dropped: 3,
                            first_bad: 98,
                            error: false
                        }
                    );
                    let mut buf = vec![1.0f32; 4 + c.rank()];
                    let err = c.allreduce_sum(&mut buf).unwrap_err();
                    assert_eq!(err.kind, ErrorKind::SizeMismatch);
                    assert!(
                        buf.iter().all(|&v| v == 1.0),
                        "a failed reduction must leave the buffer as it was"
                    );
                });
            }
        });
    }

    #[test]
    fn timeouts_are_per_handle_and_default_to_ten_minutes() {
        let comms = LocalComm::group(2).unwrap();
        assert_eq!(comms[0].timeout(), Some(DEFAULT_TIMEOUT));
        comms[0].set_timeout(None).unwrap();
        assert_eq!(comms[0].timeout(), None);
        assert_eq!(comms[1].timeout(), Some(DEFAULT_TIMEOUT));
        comms[1].set_timeout(Some(Duration::from_millis(250))).unwrap();
        assert_eq!(comms[1].timeout(), Some(Duration::from_millis(250)));
        comms[1].set_timeout(Some(Duration::MAX)).unwrap();
        assert!(comms[1].timeout().is_some());
    }

    /// A rank held inside a reading phase (it reads a peer's buffer) while the group is aborted:
    /// the aborted peers may not return (and free their buffers) before it stops reading.
    #[test]
    fn a_failing_rank_waits_for_readers() {
        let comms = LocalComm::group(3).unwrap();
        let g = comms[0].group.clone();
        // Pretend every rank passed the first barrier of an all-reduce.
        {
            let mut s = g.state();
            s.readers = 3;
        }
        let left = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for r in 0..2 {
                let (g, left) = (&g, &left);
                sc.spawn(move || {
                    let err =
                        g.wait(g.state(), r, What::AllReduce(8), None, Reads::Within).unwrap_err();
                    assert_eq!(err.kind, ErrorKind::CommFailure);
                    assert!(err.message.contains("aborted by rank 2"), "{}", err.message);
                    left.fetch_add(1, Ordering::SeqCst);
                });
            }
            comms[2].abort().unwrap();
            comms[2].abort().unwrap();
            std::thread::sleep(Duration::from_millis(50));
            assert_eq!(
                left.load(Ordering::SeqCst),
                0,
                "a rank returned while rank 2 still read its buffer"
            );
            // Rank 2 stops reading: it arrives at its barrier and sees the failure.
            let err = g.wait(g.state(), 2, What::AllReduce(8), None, Reads::End).unwrap_err();
            assert!(
                err.message
                    .contains("all-reduce of 8 elements failed: the group was aborted by rank 2"),
                "{}",
                err.message
            );
        });
        assert_eq!(left.load(Ordering::SeqCst), 2);
        assert_eq!(g.state().readers, 0);
    }

    #[test]
    fn a_rank_that_panics_while_reading_fails_the_group_after_it_stops_reading() {
        let comms = LocalComm::group(2).unwrap();
        let g = comms[0].group.clone();
        g.state().readers = 2;
        std::thread::scope(|sc| {
            let g = &g;
            let h = sc.spawn(move || {
                let _reading = Reading { group: g, rank: 1, counted: true };
                panic!("injected panic inside a reading phase");
            });
            let err = g.wait(g.state(), 0, What::AllReduce(8), None, Reads::Within).unwrap_err();
            assert!(err.message.contains("rank 1 panicked in an all-reduce"), "{}", err.message);
            assert!(h.join().is_err());
        });
        assert_eq!(g.state().readers, 0);
    }

    /// Ranks that call different collectives (one the control exchange, one an all-reduce, with
    /// a buffer of the length another rank published earlier) fail the group at the first
    /// barrier: no rank reads a buffer published for another collective.
    #[test]
    fn ranks_in_different_collectives_fail_before_reading() {
        let comms = LocalComm::group(2).unwrap();
        std::thread::scope(|s| {
            let mut stale = vec![1.0f32; 8];
            s.spawn(|| comms[1].allreduce_sum(&mut [2.0f32; 8]).unwrap());
            comms[0].allreduce_sum(&mut stale).unwrap();
        });
        let (control, reduce) = std::thread::scope(|s| {
            let control = s.spawn(|| comms[0].reduce_control(&ControlSum::default()));
            let reduce = s.spawn(|| {
                let mut w = vec![3.0f32; 8];
                (comms[1].allreduce_sum(&mut w), w)
            });
            (control.join().unwrap(), reduce.join().unwrap())
        });
        assert_eq!(control.unwrap_err().kind, ErrorKind::CommFailure);
        let (result, w) = reduce;
        let err = result.unwrap_err();
        assert_eq!(err.kind, ErrorKind::CommFailure);
        assert!(err.message.contains("different collectives"), "{err}");
        assert!(w.iter().all(|&v| v == 3.0), "the buffer was changed: {w:?}");
    }
}
