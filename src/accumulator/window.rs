//! The accumulation window's state machine, the one copy of its rules for every device: which
//! call may follow which, how counts add up, when a window starts and ends, and which tensors
//! were written in it (a tensor not written in the current window reads as zero at the
//! boundary, and its first contribution overwrites instead of adding).

use std::ops::{Deref, DerefMut, Range};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::SyncInfo;
use crate::error::{Error, Result};

/// Where the window stands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Phase {
    /// No micro-batch yet.
    Empty,
    /// At least one micro-batch added.
    Open,
    /// Between `begin_microbatch(count)` and `end_microbatch()`.
    InMicrobatch { count: u64 },
    /// The boundary ran (or, on a device, is enqueued); the masters hold its result until the
    /// next micro-batch opens a new window. The info, once the host has it.
    Synced(Option<SyncInfo>),
}

#[derive(Debug)]
pub(crate) struct State {
    /// Identifies the window; tensors remember the id of the window that last wrote them.
    pub id: u64,
    pub phase: Phase,
    /// Items added in this window on this rank.
    pub count: u64,
    /// Micro-batches added in this window on this rank.
    pub microbatches: u64,
    /// How many ranks' windows this one sums, once a load or merge set it; 0 for this rank's own
    /// window alone (it counts 1, and a merge into it while it is empty replaces it).
    pub ranks: u64,
    /// Micro-batches dropped in this window on this rank (`Overflow::DropMicrobatch`).
    pub dropped: u64,
    /// Which micro-batches were dropped: a sum of a hash of each one's index in the window, the
    /// same on ranks that dropped the same ones in any order (a mesh step compares peers').
    pub drops: u64,
    /// Where this rank's window first went non-finite: (micro-batch, tensor).
    pub first_bad: Option<(u64, usize)>,
    /// Counts the micro-batches opened over the accumulator's life: it names the open one.
    pub serial: u64,
    /// Per tensor, the micro-batches in which it went non-finite (empty until one did).
    nonfinite: Vec<u64>,
    /// The window was restored holding a non-finite value whose place was not saved: it went
    /// non-finite before any place this rank can name.
    unlocated: bool,
    /// While synced: the clipping factor the boundary left for the optimizer's step to apply
    /// ([`Accumulator::sync_for_step`](super::Accumulator::sync_for_step)); the gradient in
    /// memory is the sum before it. Set on every boundary, read only while synced.
    pub pending_clip: Option<f32>,
}

impl State {
    /// The window was restored holding a non-finite value whose place was not saved.
    pub fn unlocated(&self) -> bool {
        self.unlocated
    }

    pub fn in_microbatch(&self) -> bool {
        matches!(self.phase, Phase::InMicrobatch { .. })
    }

    pub fn synced(&self) -> bool {
        matches!(self.phase, Phase::Synced(_))
    }

    /// Fails with WRONG_STATE (`message`) inside a micro-batch.
    pub fn between_microbatches(&self, message: &str) -> Result<()> {
        if self.in_microbatch() {
            return Err(Error::wrong_state(message));
        }
        Ok(())
    }

    /// The open micro-batch's item count.
    pub fn microbatch_count(&self) -> Result<u64> {
        match self.phase {
            Phase::InMicrobatch { count } => Ok(count),
            _ => Err(Error::wrong_state(
                "add_tensor outside a micro-batch: call begin_microbatch first",
            )),
        }
    }

    /// Items already in the window a new micro-batch would join (a synced window restarts from 0).
    pub fn open_count(&self) -> u64 {
        if self.synced() {
            0
        } else {
            self.count
        }
    }

    /// The rank-windows this window sums, for the boundary: at least its own.
    pub fn rank_windows(&self) -> u64 {
        self.ranks.max(1)
    }

    /// The rank-windows after a saved window of `saved` merges in (a synced window starts anew
    /// first). Into this rank's own window with nothing in it yet the saved one is the window, as
    /// a load would make it: merge-then-add continues the saved rank's window. Otherwise both
    /// count: add-then-merge takes on another rank's work.
    pub fn ranks_after_merge(&self, saved: u64) -> u64 {
        let (ranks, microbatches) =
            if self.synced() { (0, 0) } else { (self.ranks, self.microbatches) };
        if ranks == 0 && microbatches == 0 {
            saved
        } else {
            ranks.max(1).saturating_add(saved)
        }
    }

    /// A micro-batch of `count` items joins the window.
    pub fn add_microbatch(&mut self, count: u64) {
        self.count += count;
        self.microbatches += 1;
        self.phase = Phase::Open;
    }

    /// The index in this window of the micro-batch being fed: every one fed so far counts.
    pub fn microbatch_index(&self) -> u64 {
        self.microbatches + self.dropped
    }

    /// The micro-batch being fed went non-finite in `tensor`: the window's first place, unless
    /// it has one.
    pub fn went_bad(&mut self, tensor: usize) {
        if !self.unlocated {
            let index = self.microbatch_index();
            self.first_bad.get_or_insert((index, tensor));
        }
    }

    /// A saved window replaces this one (`found_inf`: it holds a non-finite value): the drops,
    /// places and counts of the replaced one go with it.
    pub fn restored(&mut self, found_inf: bool) {
        self.dropped = 0;
        self.drops = 0;
        self.first_bad = None;
        self.nonfinite.clear();
        self.unlocated = found_inf;
    }

    /// A saved window holding a non-finite value merges into this one: its place is unknown, and
    /// this window's own place stands only if it has one already.
    pub fn merged_nonfinite(&mut self) {
        self.unlocated |= self.first_bad.is_none();
    }

    /// Tensors `bad` of the micro-batch being fed went non-finite: each counts one more
    /// micro-batch.
    pub fn count_bad(&mut self, tensors: usize, bad: impl IntoIterator<Item = usize>) {
        self.nonfinite.resize(tensors, 0);
        for t in bad {
            self.nonfinite[t] += 1;
        }
    }

    /// Per tensor, the micro-batches of this window in which it went non-finite.
    pub fn nonfinite(&self, tensors: usize) -> Vec<u64> {
        let mut counts = self.nonfinite.clone();
        counts.resize(tensors, 0);
        counts
    }

    /// The micro-batch being fed is dropped: non-finite in `tensor`, it counts for nothing.
    pub fn drop_microbatch(&mut self, tensor: usize) {
        self.went_bad(tensor);
        self.drop_current(&format!("tensor {tensor}'s"));
    }

    /// The micro-batch being fed is dropped for another rank's non-finite gradient (a sharded
    /// accumulation's micro-batch fed tensor by tensor): it counts for nothing, and this rank
    /// names no place.
    pub fn drop_microbatch_unlocated(&mut self) {
        self.drop_current("another rank's");
    }

    /// The micro-batch being fed counts for nothing: `whose` gradient was not finite.
    fn drop_current(&mut self, whose: &str) {
        let index = self.microbatch_index();
        log::info!(
            "micro-batch {} of the window dropped: {whose} gradient is not finite",
            index + 1
        );
        self.drops = self.drops.wrapping_add(drop_hash(index));
        self.dropped += 1;
        self.phase = Phase::Open;
    }

    /// Starts a new, empty window; everything written before reads as zero.
    pub fn next(&mut self) {
        *self = State { id: self.id + 1, serial: self.serial, ..State::new() };
    }

    fn new() -> Self {
        State {
            id: 1,
            phase: Phase::Empty,
            count: 0,
            microbatches: 0,
            ranks: 0,
            dropped: 0,
            drops: 0,
            first_bad: None,
            serial: 0,
            nonfinite: Vec::new(),
            unlocated: false,
            pending_clip: None,
        }
    }
}

/// A dropped micro-batch's index, mixed (splitmix64's finaliser), for [`State::drops`].
fn drop_hash(index: u64) -> u64 {
    let mut z = index.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The right to write the whole master (and its staging): one per window, reached only through
/// [`WindowWrite`], so only the holder of the window's write lock writes with it.
#[derive(Debug)]
pub(crate) struct MasterWrite(());

/// The right to write one tensor's part of the master (and of its staging): one per tensor,
/// inside the tensor's lock, handed out only to a holder of the window's read lock, so never
/// while a [`MasterWrite`] is in use.
#[derive(Debug)]
pub(crate) struct TensorWrite {
    index: usize,
    range: Range<usize>,
}

impl TensorWrite {
    /// The tensor.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The tensor's flat range in the master's layout.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }
}

/// The window's state under its write lock, with the right to write the master.
pub(crate) struct WindowWrite<'a> {
    state: RwLockWriteGuard<'a, State>,
    master: MasterWrite,
}

impl WindowWrite<'_> {
    /// The state and the master's write right, borrowed apart.
    pub fn parts(&mut self) -> (&mut State, &mut MasterWrite) {
        (&mut self.state, &mut self.master)
    }

    /// The master's write right, to read with.
    pub fn master(&self) -> &MasterWrite {
        &self.master
    }

    pub fn master_mut(&mut self) -> &mut MasterWrite {
        &mut self.master
    }
}

impl Deref for WindowWrite<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.state
    }
}

impl DerefMut for WindowWrite<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.state
    }
}

/// The window and the per-tensor marks, behind their locks.
///
/// Calls that change the window take the write lock. `add_tensor` callers share the read lock
/// and serialise per tensor, so distinct tensors are added in parallel.
#[derive(Debug)]
pub(crate) struct Window {
    state: RwLock<State>,
    /// The id of the window in which each tensor was last written.
    written_in: Vec<AtomicU64>,
    /// Serialises contributions to one tensor from `add_tensor` callers on different threads.
    tensor_locks: Vec<Mutex<TensorWrite>>,
    /// The serial of the micro-batch in which each tensor was last staged
    /// (`Overflow::DropMicrobatch`).
    staged_in: Vec<AtomicU64>,
    /// Each tensor's gradient went non-finite in the open micro-batch.
    bad_in_microbatch: Vec<AtomicBool>,
    /// The smallest tensor of the open micro-batch whose master sum overflowed from finite
    /// gradients; `usize::MAX` for none.
    overflowed: AtomicUsize,
}

impl Window {
    /// The window of the tensors at flat `ranges` of the master.
    pub fn new(ranges: impl ExactSizeIterator<Item = Range<usize>>) -> Self {
        let tensors = ranges.len();
        Window {
            state: RwLock::new(State::new()),
            written_in: (0..tensors).map(|_| AtomicU64::new(0)).collect(),
            tensor_locks: ranges
                .enumerate()
                .map(|(index, range)| Mutex::new(TensorWrite { index, range }))
                .collect(),
            staged_in: (0..tensors).map(|_| AtomicU64::new(0)).collect(),
            bad_in_microbatch: (0..tensors).map(|_| AtomicBool::new(false)).collect(),
            overflowed: AtomicUsize::new(usize::MAX),
        }
    }

    // Window updates are single assignments after all checks, so a poisoned lock still holds a
    // consistent window.
    pub fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read()
    }

    pub fn write(&self) -> WindowWrite<'_> {
        let state = self.state.write();
        WindowWrite { state, master: MasterWrite(()) }
    }

    /// Runs one contribution to tensor `index` in window `w` (the read lock held) with the
    /// tensor's write right, told whether it is the tensor's first in the window (it then
    /// assigns), and marks the tensor written if it succeeds. The tensor's lock covers the read
    /// of the mark, the contribution and the new mark, so of two racing first contributions
    /// exactly one assigns.
    pub fn contribute<R>(
        &self,
        w: &RwLockReadGuard<'_, State>,
        index: usize,
        add: impl FnOnce(&mut TensorWrite, bool) -> Result<R>,
    ) -> Result<R> {
        self.marked(&self.written_in[index], w.id, index, add)
    }

    /// [`Window::contribute`] into the staging of the open micro-batch `w`: first, and marked,
    /// per micro-batch.
    pub fn stage<R>(
        &self,
        w: &RwLockReadGuard<'_, State>,
        index: usize,
        add: impl FnOnce(&mut TensorWrite, bool) -> Result<R>,
    ) -> Result<R> {
        self.marked(&self.staged_in[index], w.serial, index, add)
    }

    /// Runs `add` under tensor `index`'s lock, told whether `mark` is not yet `current`, and sets
    /// it if `add` succeeds.
    fn marked<R>(
        &self,
        mark: &AtomicU64,
        current: u64,
        index: usize,
        add: impl FnOnce(&mut TensorWrite, bool) -> Result<R>,
    ) -> Result<R> {
        let mut tensor = self.tensor_locks[index].lock();
        let added = add(&mut tensor, mark.load(Ordering::Relaxed) != current)?;
        mark.store(current, Ordering::Relaxed);
        Ok(added)
    }

    /// Tensors staged in the open micro-batch `w`, in order.
    pub fn staged<'a>(&'a self, w: &'a State) -> impl Iterator<Item = usize> + 'a {
        (0..self.staged_in.len())
            .filter(move |&i| self.staged_in[i].load(Ordering::Relaxed) == w.serial)
    }

    /// A micro-batch opens: it names a new serial, and nothing in it went non-finite yet.
    pub fn open_microbatch(&self, w: &mut State) {
        w.serial += 1;
        self.bad_in_microbatch.iter().for_each(|b| b.store(false, Ordering::Relaxed));
        self.overflowed.store(usize::MAX, Ordering::Relaxed);
    }

    /// Tensor `index`'s master sum overflowed in the open micro-batch, its gradient finite.
    pub fn note_overflow(&self, index: usize) {
        self.overflowed.fetch_min(index, Ordering::Relaxed);
    }

    /// The smallest tensor of the open micro-batch whose master sum overflowed.
    pub fn overflowed(&self) -> Option<usize> {
        Some(self.overflowed.load(Ordering::Relaxed)).filter(|&i| i != usize::MAX)
    }

    /// Tensor `index`'s gradient (its contribution) in the open micro-batch is not finite.
    pub fn note_bad(&self, index: usize) {
        self.bad_in_microbatch[index].store(true, Ordering::Relaxed);
    }

    /// The tensors of the open micro-batch that went non-finite, in order.
    pub fn bad_tensors(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.bad_in_microbatch.len())
            .filter(|&i| self.bad_in_microbatch[i].load(Ordering::Relaxed))
    }

    /// Whether tensor `index` was written in window `w`. Relaxed: the window's lock orders
    /// every access (the write lock, or the read lock and the tensor's lock).
    pub fn written(&self, w: &State, index: usize) -> bool {
        self.written_in[index].load(Ordering::Relaxed) == w.id
    }

    pub fn mark_written(&self, w: &State, index: usize) {
        self.written_in[index].store(w.id, Ordering::Relaxed);
    }

    /// No tensor counts as written in any window.
    pub fn forget_written(&self) {
        self.written_in.iter().for_each(|t| t.store(0, Ordering::Relaxed));
    }

    /// Tensors not written in window `w`.
    pub fn untouched<'a>(&'a self, w: &'a State) -> impl Iterator<Item = usize> + 'a {
        (0..self.written_in.len()).filter(move |&i| !self.written(w, i))
    }

    /// Opens a new window `w.id + 1` in which exactly the tensors marked in `written` count as
    /// written (a restored checkpoint).
    pub fn restore(&self, w: &mut State, written: &[bool]) {
        let id = w.id + 1;
        for (slot, &was) in self.written_in.iter().zip(written) {
            slot.store(if was { id } else { 0 }, Ordering::Relaxed);
        }
        w.id = id;
    }
}
