//! Window checkpoints: the window in progress as versioned bytes ([`Accumulator::save_window`]),
//! read back to replace the window or to add into it, every check made before anything changes,
//! and the windows saved by 0.2 (tensors packed back to back) laid out anew.

use std::ops::Range;

use super::window::Phase;
use super::{config, sharding, Accumulator, Layout, Plan, Sharding, MASTER_ALIGN};
use crate::error::{Error, ErrorKind, Result};
use crate::state;

const WINDOW_MAGIC: [u8; 4] = *b"GAWN";
/// 2 (0.2): the layout fingerprint covers tensor offsets, lengths and dtypes as well as buckets.
/// 3 (0.2): a sharded accumulation's shard (version 2 with the shard count and rank after the
/// layout, and only the shard's masters).
/// 4 and 5: versions 2 and 3 with the number of rank-windows the window sums (at least 1) after
/// its micro-batch count. Windows of versions 2 and 3 are one rank's window each.
/// 6 and 7: versions 4 and 5 in the aligned layout (each tensor at a multiple of
/// [`MASTER_ALIGN`] bytes, zeros between), the alignment in bytes after the layout's fingerprint.
/// Versions 2 to 5 hold the tensors packed back to back, and are laid out anew when read.
const WINDOW_VERSION: u32 = 6;
const SHARD_WINDOW_VERSION: u32 = 7;
/// The first version in the aligned layout.
const ALIGNED_WINDOW_VERSION: u32 = 6;
/// The first version with the rank-window count.
const RANKS_WINDOW_VERSION: u32 = 4;
const OLDEST_WINDOW_VERSION: u32 = 2;
/// The most rank-windows a saved window may sum: far beyond any group, and a corrupt value is
/// refused rather than normalised by.
const MAX_WINDOW_RANKS: u64 = 1 << 32;

/// A window read back from [`Accumulator::save_window`]'s bytes.
struct SavedWindow {
    count: u64,
    microbatches: u64,
    /// The rank-windows it sums (at least 1).
    ranks: u64,
    found_inf: bool,
    written: Vec<bool>,
    masters: Vec<f32>,
}

impl Plan {
    /// `masters`, the held elements of the same tensors in `packed` (a window saved by 0.2), in
    /// this plan's layout, zeros in the padding. A shard whose tensors' elements are not the
    /// ones this rank's shard holds in the aligned layout cannot be laid out anew.
    fn lay_out_packed(&self, packed: &Layout, masters: &[f32]) -> Result<Vec<f32>> {
        let (from, to) = (self.held_in(packed), self.held());
        // The elements of tensor `i` that `held` holds, counted from the tensor's start.
        let part = |layout: &Layout, held: &Range<usize>, i: usize| {
            let t = layout.range(i);
            let (lo, hi) = (t.start.clamp(held.start, held.end), t.end.clamp(held.start, held.end));
            if lo < hi {
                lo - t.start..hi - t.start
            } else {
                0..0
            }
        };
        let mut out = vec![0.0; to.len()];
        for i in 0..self.descs.len() {
            let (p, a) = (part(packed, &from, i), part(&self.layout, &to, i));
            if p != a {
                return Err(Error::new(
                    ErrorKind::SizeMismatch,
                    format!(
                        "accumulator window: saved by 0.2 with the tensors packed back to back, its shard holds elements {p:?} of \
                         tensor {i}, but in the aligned layout (each tensor at a multiple of {MASTER_ALIGN} bytes) this rank's shard \
                         holds {a:?}: finish that window with the version that saved it"
                    ),
                ));
            }
            if p.is_empty() {
                continue;
            }
            let (src, dst) =
                (packed.range(i).start + p.start, self.layout.range(i).start + a.start);
            out[dst - to.start..dst - to.start + a.len()]
                .copy_from_slice(&masters[src - from.start..src - from.start + p.len()]);
        }
        Ok(out)
    }
}

impl Accumulator {
    /// The window in progress (masters, counts, micro-batches, overflow flag, which tensors were
    /// written) as versioned bytes: a checkpoint in the middle of accumulation. On CUDA this
    /// waits for the accumulator's stream.
    pub fn save_window(&self) -> Result<Vec<u8>> {
        let w = self.window.write();
        if !matches!(w.phase, Phase::Empty | Phase::Open) {
            return Err(Error::wrong_state(
                "save_window needs a window between micro-batches (not inside one, not synced)",
            ));
        }
        self.store.check_open()?;
        let held = self.plan.held();
        let mut masters = vec![0.0; held.len()];
        self.store.read(w.master(), held, &mut masters)?;
        let shard = self.sharded_accumulation();
        let mut out = state::Writer::new(
            WINDOW_MAGIC,
            if shard.is_some() { SHARD_WINDOW_VERSION } else { WINDOW_VERSION },
        );
        out.u64(self.plan.layout.hash()).u64(MASTER_ALIGN as u64);
        if let Some((shards, rank)) = shard {
            out.u64(shards as u64).u64(rank as u64);
        }
        out.u64(w.count).u64(w.microbatches).u64(w.rank_windows()).bool(self.store.found_inf()?);
        for i in 0..self.tensors().len() {
            out.bool(self.window.written(&w, i));
        }
        out.f32s(&masters);
        Ok(out.finish())
    }

    /// Restores a window written by [`Accumulator::save_window`] of an accumulator with the same
    /// layout, on any device. Corrupt or foreign bytes are rejected and leave the accumulator
    /// unchanged. The window's dropped micro-batches were not saved: the boundary's
    /// [`SyncInfo::dropped_microbatches`](super::SyncInfo::dropped_microbatches) counts the drops
    /// after the load, and the micro-batch of an [`OverflowAt::Gradient`](super::OverflowAt)
    /// counts the restored window's kept micro-batches, then each
    /// one fed since the load, dropped ones included.
    pub fn load_window(&self, bytes: &[u8]) -> Result<()> {
        let mut w = self.window.write();
        w.between_microbatches(
            "load_window inside a micro-batch: call end_microbatch or reset first",
        )?;
        self.store.check_open()?;
        let saved = self.parse_window(bytes)?;
        self.store.write(w.master_mut(), &saved.masters)?;
        self.store.set_found_inf(saved.found_inf)?;
        self.window.restore(&mut w, &saved.written);
        w.restored(saved.found_inf);
        self.store.restart_counts()?;
        w.phase = if saved.microbatches == 0 { Phase::Empty } else { Phase::Open };
        w.count = saved.count;
        w.microbatches = saved.microbatches;
        w.ranks = saved.ranks;
        Ok(())
    }

    /// Adds a window written by [`Accumulator::save_window`] (of an accumulator with the same
    /// layout, on any device and rank) into the current one: windows are sums, so work saved on N
    /// ranks resumes on M. Masters add (in f32, the current value first), counts and micro-batches
    /// add, overflow flags OR; a tensor written in either window counts as written. The window
    /// also counts the ranks' windows it sums (merged into a window with no micro-batch yet, a
    /// saved window replaces this rank's own in that count), so [`Normalize::ByWorld`] divides by
    /// the size of the group that produced the work. The merged window's kept micro-batches
    /// count in an [`OverflowAt::Gradient`](super::OverflowAt)'s micro-batch after those already
    /// in the window.
    /// After a sync it starts a new window, as `add` does. On CUDA this waits for the
    /// accumulator's stream.
    /// Corrupt or foreign bytes are rejected and leave the accumulator unchanged.
    ///
    /// [`Normalize::ByWorld`]: super::Normalize::ByWorld
    pub fn merge_window(&self, bytes: &[u8]) -> Result<()> {
        let mut w = self.window.write();
        w.between_microbatches(
            "merge_window inside a micro-batch: call end_microbatch or reset first",
        )?;
        self.store.check_open()?;
        let saved = self.parse_window(bytes)?;
        // An empty saved window (a rank that had added nothing) adds no items; it still counts as
        // a rank-window (that rank was in the group).
        if saved.count > 0 {
            self.plan.config.check_count(w.open_count(), saved.count)?;
        }
        let ranks = w.ranks_after_merge(saved.ranks);
        if ranks > MAX_WINDOW_RANKS {
            return Err(Error::invalid(format!("merge_window: the window would sum {ranks} rank-windows, more than {MAX_WINDOW_RANKS}")));
        }
        let microbatches = if w.synced() { 0 } else { w.microbatches };
        if microbatches.checked_add(saved.microbatches).is_none() {
            return Err(Error::invalid("merge_window: the micro-batch count overflows"));
        }
        self.start_window_if_synced(&mut w)?;
        let held = self.plan.held();
        let mut masters = vec![0.0; held.len()];
        self.store.read(w.master(), held.clone(), &mut masters)?;
        let mut written = saved.written.clone();
        for (i, theirs) in saved.written.iter().enumerate() {
            let mine = self.window.written(&w, i);
            // The tensor's part of the held range, in `masters`.
            let r = self.range(i);
            let r = sharding::relative(&sharding::intersect(&r, &held), held.start);
            match (mine, *theirs) {
                (true, true) => {
                    masters[r.clone()].iter_mut().zip(&saved.masters[r]).for_each(|(m, s)| *m += s)
                }
                (false, true) => masters[r.clone()].copy_from_slice(&saved.masters[r]),
                _ => {}
            }
            written[i] |= mine;
        }
        let found_inf = self.store.found_inf()? || saved.found_inf;
        self.store.write(w.master_mut(), &masters)?;
        self.store.set_found_inf(found_inf)?;
        let (count, microbatches) = (w.count + saved.count, w.microbatches + saved.microbatches);
        w.ranks = ranks;
        self.window.restore(&mut w, &written);
        if saved.found_inf {
            w.merged_nonfinite();
        }
        w.phase = if microbatches == 0 { Phase::Empty } else { Phase::Open };
        w.count = count;
        w.microbatches = microbatches;
        Ok(())
    }

    /// Reads and checks saved window bytes against this accumulator's layout; a window saved in
    /// the packed layout (versions 2 to 5) comes back in the aligned one.
    fn parse_window(&self, bytes: &[u8]) -> Result<SavedWindow> {
        let what = "accumulator window";
        let (mut r, version) = state::Reader::open_versions(
            what,
            bytes,
            WINDOW_MAGIC,
            OLDEST_WINDOW_VERSION..=SHARD_WINDOW_VERSION,
        )?;
        let packed = if version >= ALIGNED_WINDOW_VERSION {
            None
        } else {
            Some(Layout::packed(&self.plan.descs, self.plan.config.bucket_numel)?)
        };
        let layout = packed.as_ref().unwrap_or(&self.plan.layout);
        if r.u64()? != layout.hash() {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                "accumulator window: saved from an accumulator with another tensor layout",
            ));
        }
        if version >= ALIGNED_WINDOW_VERSION {
            let align = r.u64()?;
            if align != MASTER_ALIGN as u64 {
                return Err(Error::new(
                    ErrorKind::CorruptState,
                    format!("{what}: its tensors are aligned to {align} bytes, this library's to {MASTER_ALIGN}"),
                ));
            }
        }
        let saved = if version % 2 == 1 { Some((r.u64()?, r.u64()?)) } else { None };
        let mine = self.sharded_accumulation().map(|(shards, rank)| (shards as u64, rank as u64));
        if saved != mine {
            let name = |s: Option<(u64, u64)>| match s {
                Some((shards, rank)) => {
                    format!("shard {rank} of {shards} of a sharded accumulation")
                }
                None => "a whole window (not a sharded accumulation)".to_string(),
            };
            return Err(Error::new(
                ErrorKind::CorruptState,
                format!("{what}: it holds {}, and this accumulator {}", name(saved), name(mine)),
            ));
        }
        let (count, microbatches) = (r.u64()?, r.u64()?);
        let ranks = if version >= RANKS_WINDOW_VERSION { r.u64()? } else { 1 };
        let found_inf = r.bool()?;
        let written: Vec<bool> =
            (0..self.tensors().len()).map(|_| r.bool()).collect::<Result<_>>()?;
        let held = self.plan.held_in(layout);
        let mut masters = Vec::new();
        r.f32s_into(&mut masters, held.len())?;
        r.finish()?;
        let found_inf = found_inf || state::holds_non_finite(&masters);
        if count > config::MAX_WINDOW_COUNT
            || (microbatches == 0 && count != 0)
            || !(1..=MAX_WINDOW_RANKS).contains(&ranks)
        {
            return Err(Error::new(
                ErrorKind::CorruptState,
                format!(
                    "accumulator window: {count} items in {microbatches} micro-batches over {ranks} rank-windows is not a window this library saves"
                ),
            ));
        }
        match &packed {
            Some(packed) => masters = self.plan.lay_out_packed(packed, &masters)?,
            None => self.check_padding(&held, &masters)?,
        }
        Ok(SavedWindow { count, microbatches, ranks, found_inf, written, masters })
    }

    /// Saved masters of the `held` range keep +0 in every padding, as this library writes them: a
    /// window with anything else there (which the norm and the reductions would read) is refused.
    fn check_padding(&self, held: &Range<usize>, masters: &[f32]) -> Result<()> {
        for i in 0..self.tensors().len() {
            let padding = sharding::intersect(&self.plan.layout.padding(i), held);
            let values = &masters[sharding::relative(&padding, held.start)];
            if let Some(k) = values.iter().position(|v| v.to_bits() != 0) {
                return Err(Error::new(
                    ErrorKind::CorruptState,
                    format!(
                        "accumulator window: master element {} (padding after tensor {i}) holds \
                         {}, not the zero this library saves",
                        padding.start + k,
                        values[k]
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The shard count and this rank's shard under [`Sharding::Accumulate`].
    fn sharded_accumulation(&self) -> Option<(usize, usize)> {
        match self.plan.config.sharding {
            Sharding::Accumulate { shards, rank } => Some((shards, rank)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    //! Saved windows edited and given a fresh checksum, so that the decoding's own checks, not
    //! the checksum, must refuse them; a refused window leaves the accumulator as it was.

    use super::*;
    use crate::accumulator::{AccumulatorConfig, TensorDesc};
    use crate::dtype::{Dtype, Grad};
    use crate::scaler::{Scaler, ScalerConfig};

    /// Offsets in a whole window's bytes: the format version after the magic, then the layout's
    /// fingerprint, the alignment, and the item, micro-batch and rank-window counts.
    const VERSION_AT: usize = 4;
    const ALIGN_AT: usize = 16;
    const COUNTS_AT: usize = 24;
    const CHECKSUM_LEN: usize = 8;

    /// An accumulator over two tensors (the second after padding) holding one micro-batch of
    /// `count` items whose gradients are all `value`.
    fn window_of(value: f32, count: u64) -> Accumulator {
        let tensors = [
            TensorDesc { numel: 3, dtype: Dtype::F32 },
            TensorDesc { numel: 5, dtype: Dtype::F32 },
        ];
        let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
        let scaler = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
        let (a, b) = ([value; 3], [value; 5]);
        acc.add(&scaler, &[Grad::F32(&a), Grad::F32(&b)], count).unwrap();
        acc
    }

    /// `saved` with its body edited by `edit` and the checksum recomputed.
    fn resealed(saved: &[u8], edit: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut body = saved[..saved.len() - CHECKSUM_LEN].to_vec();
        edit(&mut body);
        let sum = state::checksum(&body);
        body.extend(sum.to_le_bytes());
        body
    }

    fn put_u64(body: &mut [u8], at: usize, value: u64) {
        body[at..at + 8].copy_from_slice(&value.to_le_bytes());
    }

    /// Both `load_window` and `merge_window` refuse `bytes` with `kind` and change nothing.
    fn assert_refused(bytes: &[u8], kind: ErrorKind, what: &str) {
        let target = window_of(2.0, 4);
        let before = target.save_window().unwrap();
        for merge in [false, true] {
            let (call, result) = if merge {
                ("merge_window", target.merge_window(bytes))
            } else {
                ("load_window", target.load_window(bytes))
            };
            let Err(e) = result else { panic!("{call} took {what}") };
            assert_eq!(e.kind, kind, "{call} of {what}: {e}");
            assert_eq!(
                target.save_window().unwrap(),
                before,
                "{call} of {what} changed the window"
            );
        }
    }

    #[test]
    fn a_resealed_window_as_saved_loads() {
        let saved = window_of(1.0, 3).save_window().unwrap();
        let target = window_of(2.0, 4);
        target.load_window(&resealed(&saved, |_| {})).unwrap();
        assert_eq!(target.save_window().unwrap(), saved);
    }

    #[test]
    fn every_truncation_of_a_resealed_window_is_corrupt() {
        let saved = window_of(1.0, 3).save_window().unwrap();
        for len in VERSION_AT + 4..saved.len() - CHECKSUM_LEN {
            let cut = resealed(&saved, |b| b.truncate(len));
            assert_refused(&cut, ErrorKind::CorruptState, &format!("a window cut to {len} bytes"));
        }
    }

    #[test]
    fn a_window_retagged_with_another_version_is_refused() {
        let saved = window_of(1.0, 3).save_window().unwrap();
        assert_eq!(saved[VERSION_AT..VERSION_AT + 4], WINDOW_VERSION.to_le_bytes());
        // Versions this library never wrote, and a shard's on a whole window (its counts would
        // be read as a shard count and rank), are corrupt; a packed version is another layout.
        for (version, kind) in [
            (0, ErrorKind::CorruptState),
            (OLDEST_WINDOW_VERSION - 1, ErrorKind::CorruptState),
            (SHARD_WINDOW_VERSION, ErrorKind::CorruptState),
            (SHARD_WINDOW_VERSION + 1, ErrorKind::CorruptState),
            (u32::MAX, ErrorKind::CorruptState),
            (RANKS_WINDOW_VERSION, ErrorKind::SizeMismatch),
        ] {
            let retagged = resealed(&saved, |b| {
                b[VERSION_AT..VERSION_AT + 4].copy_from_slice(&version.to_le_bytes())
            });
            assert_refused(&retagged, kind, &format!("a window retagged as version {version}"));
        }
    }

    #[test]
    fn a_window_of_another_alignment_is_corrupt() {
        let saved = window_of(1.0, 3).save_window().unwrap();
        for align in [0, 4, MASTER_ALIGN as u64 / 2, MASTER_ALIGN as u64 * 2] {
            let forged = resealed(&saved, |b| put_u64(b, ALIGN_AT, align));
            assert_refused(
                &forged,
                ErrorKind::CorruptState,
                &format!("a window aligned to {align}"),
            );
        }
    }

    #[test]
    fn counts_no_saved_window_holds_are_corrupt() {
        let saved = window_of(1.0, 3).save_window().unwrap();
        // Items, micro-batches, rank-windows.
        for (count, microbatches, ranks) in [
            (config::MAX_WINDOW_COUNT + 1, 1, 1),
            (1, 0, 1),
            (3, 1, 0),
            (3, 1, MAX_WINDOW_RANKS + 1),
        ] {
            let forged = resealed(&saved, |b| {
                put_u64(b, COUNTS_AT, count);
                put_u64(b, COUNTS_AT + 8, microbatches);
                put_u64(b, COUNTS_AT + 16, ranks);
            });
            let what = format!("{count} items in {microbatches} micro-batches over {ranks} ranks");
            assert_refused(&forged, ErrorKind::CorruptState, &what);
        }
    }
}
