//! A synced window's result, read while the window is held so that nothing changes it: the
//! report and the per-tensor stats for the caller, the reduced gradient for the optimizer (on
//! the host or in device memory), the overflow flag for a device scaler.

use super::window::{Phase, State, WindowWrite};
// The setting the docs below name; the code never needs it.
#[cfg(doc)]
use super::AccumulatorConfig;
use super::{Accumulator, DeviceScale, Reduced, SyncInfo, TensorStats};
use crate::error::{Error, ErrorKind, Result};

impl Accumulator {
    /// Each tensor's telemetry of the last boundary, the same on every rank: the norm of its
    /// reduced, normalised gradient and in how many micro-batches it went non-finite. Needs
    /// [`AccumulatorConfig::tensor_stats`] and a window synced with its info read (else
    /// `WrongState`).
    pub fn tensor_stats(&self) -> Result<Vec<TensorStats>> {
        if !self.plan.config.tensor_stats {
            return Err(Error::wrong_state(
                "tensor_stats is off in this accumulator's config: nothing was measured",
            ));
        }
        match self.window.read().phase {
            Phase::Synced(Some(_)) => self.store.tensor_stats().ok_or_else(|| {
                Error::new(ErrorKind::Internal, "a synced boundary left no tensor stats")
            }),
            _ => Err(Error::wrong_state(
                "tensor_stats needs a window synced with its info read: call sync first",
            )),
        }
    }

    /// The last boundary's result, while the window is still synced and its info was read.
    pub fn synced_info(&self) -> Option<SyncInfo> {
        match self.window.read().phase {
            Phase::Synced(info) => info,
            _ => None,
        }
    }

    /// Runs `f` on the synced window's id, its info, this rank's part of the reduced gradient
    /// ([`Accumulator::shard`]'s range, on the host) and the clipping factor still to apply to
    /// each of its elements (1 unless the boundary left one pending,
    /// [`Accumulator::sync_for_step`]), holding the window so that nothing changes it
    /// meanwhile: what an optimizer steps from. `WrongState` naming `what` unless synced.
    pub(crate) fn with_reduced<R>(
        &self,
        what: &str,
        f: impl FnOnce(u64, SyncInfo, &[f32], f32) -> R,
    ) -> Result<R> {
        let w = self.window.write();
        let (window, info) = synced_window(&w, what)?;
        self.store.check_open()?;
        let factor = w.pending_clip.unwrap_or(1.0);
        let (mut f, mut out) = (Some(f), None);
        let run = &mut |g: &[f32]| out = f.take().map(|f| f(window, info, g, factor));
        self.store.view(w.master(), self.plan.shard(), run)?;
        Ok(out.expect("a view runs once"))
    }

    /// Applies the clipping factor a boundary left pending to the synced gradient in memory
    /// (with the bits `sync` leaves), so that a reader sees the clipped gradient.
    pub(super) fn settle_clip(&self, w: &mut WindowWrite<'_>) -> Result<()> {
        if let (true, Some(factor)) = (w.synced(), w.pending_clip) {
            self.store.scale_result(w.master_mut(), factor)?;
            w.pending_clip = None;
        }
        Ok(())
    }

    /// The synced window's id, checked as [`Accumulator::with_reduced`] checks it.
    pub(crate) fn synced_window(&self, what: &str) -> Result<u64> {
        synced_window(&self.window.read(), what).map(|(window, _)| window)
    }

    /// [`Accumulator::with_reduced`] on a device: `f` gets the synced window's id, its info when
    /// the host has it (after `sync`; none after `sync_enqueue`) and where the reduced gradient
    /// and the boundary's result are in device memory, holding the window meanwhile. Nothing
    /// waits for the device. `WrongState` naming `what` unless synced.
    pub(crate) fn with_reduced_on_device<R>(
        &self,
        what: &str,
        f: impl FnOnce(u64, Option<SyncInfo>, Reduced) -> Result<R>,
    ) -> Result<R> {
        let w = self.window.write();
        let (window, info) = synced_on_device(&w, what)?;
        self.store.check_open()?;
        let reduced = self.store.reduced().ok_or_else(|| {
            Error::new(ErrorKind::DeviceMismatch, format!("{what}: the accumulator is on the CPU"))
        })?;
        f(window, info, reduced)
    }

    /// The synced window's id, checked as [`Accumulator::with_reduced_on_device`] checks it.
    pub(crate) fn synced_window_on_device(&self, what: &str) -> Result<u64> {
        synced_on_device(&self.window.read(), what).map(|(window, _)| window)
    }

    /// Checks that the window is synced (WRONG_STATE naming `what` otherwise) and returns its
    /// info when the host has it.
    pub(crate) fn check_synced(&self, what: &str) -> Result<Option<SyncInfo>> {
        match self.window.read().phase {
            Phase::Synced(info) => Ok(info),
            _ => Err(Error::wrong_state(format!(
                "{what} has not been synced in its current window: call sync first"
            ))),
        }
    }

    /// Enqueues the gather of the synced boundary's overflow flag into a scaler's device state.
    pub(crate) fn gather_into(&self, scaler: &dyn DeviceScale, what: &str) -> Result<()> {
        let w = self.window.read();
        if !w.synced() {
            return Err(Error::wrong_state(format!(
                "{what} has not been synced in its current window: call sync first"
            )));
        }
        self.store.gather_into(scaler)
    }
}

/// The id of a synced window and its info if the host has it; `WrongState` naming `what`
/// otherwise.
fn synced_on_device(w: &State, what: &str) -> Result<(u64, Option<SyncInfo>)> {
    match w.phase {
        Phase::Synced(info) => Ok((w.id, info)),
        _ => Err(Error::wrong_state(format!(
            "{what} needs a synced window: call sync first (a window steps the optimizer once)"
        ))),
    }
}

/// The id and info of a synced window whose boundary's result is on the host; `WrongState`
/// naming `what` otherwise.
fn synced_window(w: &State, what: &str) -> Result<(u64, SyncInfo)> {
    let (id, info) = synced_on_device(w, what)?;
    let info = info.ok_or_else(|| {
        Error::wrong_state(format!(
            "{what} needs the boundary's result on the host: sync, not sync_enqueue"
        ))
    })?;
    Ok((id, info))
}
