//! The dynamic loss scaler. With `hysteresis = 1` its scale sequence is PyTorch GradScaler's for
//! any sequence of overflow flags; `hysteresis > 1` follows Megatron-Core's DynamicGradScaler, and
//! `consecutive_hysteresis` DeepSpeed's option of that name.
//!
//! One [`Scaler`] serves every device. This module holds its semantics once: the configuration
//! and its checks, the update rule (`next_state`; the device twin is `ga_scaler_next` in the
//! CUDA kernels, tested against it), the saved bytes, and which accumulators an update may read.
//! The device's backend keeps the state (`ScalerStore`, made by `backend::scaler_for`): on the
//! CPU behind a lock, so one scaler can serve accumulators used from several threads; on CUDA in
//! device memory, updated by a kernel with no host round trip. Accumulators read the scale
//! through the `ScaleSource` the state hands out.

use std::ffi::c_void;

use crate::accumulator::{Accumulator, ScaleSource};
use crate::device::Device;
use crate::dtype::{self, Dtype, GradMut};
use crate::error::{Error, ErrorKind, Result};
use crate::state;

/// Configuration of a [`Scaler`]. `Default` gives the documented defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalerConfig {
    /// Scale at creation (default 65536).
    pub init_scale: f32,
    /// Factor applied after `growth_interval` consecutive finite steps (default 2).
    pub growth_factor: f32,
    /// Factor applied on a backoff (default 0.5).
    pub backoff_factor: f32,
    /// Consecutive finite steps before a growth (default 2000).
    pub growth_interval: u32,
    /// Overflows tolerated before a backoff; 1 backs off on every overflow (default 1).
    pub hysteresis: u32,
    /// Refill the hysteresis tracker after every finite step, not only after a growth (default
    /// false).
    pub consecutive_hysteresis: bool,
    /// Lowest scale; an overflow that needs a backoff below it is an error (default 1).
    pub min_scale: f32,
    /// Highest scale; growth stops there (default +inf: grow while the result is finite).
    pub max_scale: f32,
    /// `false` keeps the scale fixed at `init_scale`; steps are still counted and skipped.
    pub dynamic: bool,
}

impl Default for ScalerConfig {
    fn default() -> Self {
        ScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            hysteresis: 1,
            consecutive_hysteresis: false,
            min_scale: 1.0,
            max_scale: f32::INFINITY,
            dynamic: true,
        }
    }
}

impl ScalerConfig {
    /// Checks every field, naming the first one that is out of its domain.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if !(c.init_scale.is_finite() && c.init_scale > 0.0) {
            return Err(Error::invalid(format!(
                "init_scale must be finite and > 0, got {}",
                c.init_scale
            )));
        }
        if !(c.growth_factor.is_finite() && c.growth_factor > 1.0) {
            return Err(Error::invalid(format!(
                "growth_factor must be finite and > 1, got {}",
                c.growth_factor
            )));
        }
        if !(c.backoff_factor > 0.0 && c.backoff_factor < 1.0) {
            return Err(Error::invalid(format!(
                "backoff_factor must be in (0, 1), got {}",
                c.backoff_factor
            )));
        }
        if c.growth_interval == 0 {
            return Err(Error::invalid("growth_interval must be >= 1, got 0"));
        }
        if c.hysteresis == 0 {
            return Err(Error::invalid("hysteresis must be >= 1, got 0"));
        }
        if !(c.min_scale.is_finite() && c.min_scale > 0.0) {
            return Err(Error::invalid(format!(
                "min_scale must be finite and > 0, got {}",
                c.min_scale
            )));
        }
        if c.max_scale.is_nan() || c.max_scale < c.init_scale {
            return Err(Error::invalid(format!(
                "max_scale must be >= init_scale ({}), got {}",
                c.init_scale, c.max_scale
            )));
        }
        if c.min_scale > c.init_scale {
            return Err(Error::invalid(format!(
                "min_scale must be <= init_scale ({}), got {}",
                c.init_scale, c.min_scale
            )));
        }
        Ok(())
    }
}

/// Counters since creation (or since the state was loaded).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScalerStats {
    /// Optimizer steps seen by `update`.
    pub steps: u64,
    /// Steps skipped because of an overflow.
    pub skipped_steps: u64,
    /// Times the scale grew.
    pub growths: u64,
    /// Times the scale backed off.
    pub backoffs: u64,
}

/// The scaler's moving parts: what its backend keeps, and what the update rule and the saved
/// bytes are made of.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScalerState {
    pub scale: f32,
    /// Consecutive finite steps since the last growth or overflow.
    pub growth_tracker: u32,
    /// Overflows still tolerated before the next backoff.
    pub hysteresis_tracker: u32,
    pub stats: ScalerStats,
}

impl ScalerState {
    /// The state of a new scaler.
    fn initial(config: &ScalerConfig) -> Self {
        ScalerState {
            scale: config.init_scale,
            growth_tracker: 0,
            hysteresis_tracker: config.hysteresis,
            stats: ScalerStats::default(),
        }
    }
}

/// What one call of [`Scaler::update`] decided.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// The optimizer step must be skipped (the window overflowed).
    pub skipped: bool,
    /// The scale after the update.
    pub scale: f32,
}

/// A device's part of a scaler: where its state lives and the kernels over it. The scaler
/// decides what runs, after its checks; a store only does it.
pub(crate) trait ScalerStore: Send + Sync {
    fn device(&self) -> Device;

    fn config(&self) -> ScalerConfig;

    /// The moving parts (a device's are read back: waits for the scaler's stream).
    fn state(&self) -> Result<ScalerState>;

    /// Replaces the configuration and the state (both checked by the caller).
    fn load(&self, config: ScalerConfig, state: &ScalerState) -> Result<()>;

    /// Where an accumulator's add finds the current scale.
    fn source(&self) -> ScaleSource<'_>;

    /// Multiplies `numel` loss values of `dtype` at `loss` in place by the current scale (a host
    /// pointer or a device address, as the store's memory).
    ///
    /// # Safety
    /// `loss` passed `dtype::check_buffer`; a host pointer points to `numel` writable values,
    /// used by nothing else during the call.
    unsafe fn scale_loss(&self, loss: *mut c_void, numel: usize, dtype: Dtype) -> Result<()>;

    /// Ends a step on the host: the state becomes `next` of it, under the state's lock, and is
    /// returned. `None` for a state in device memory, which its kernels update from the flags
    /// gathered into it (`DeviceScale`).
    fn step(
        &self,
        next: &dyn Fn(&ScalerConfig, &ScalerState) -> Result<ScalerState>,
    ) -> Option<Result<ScalerState>>;
}

/// A dynamic (or fixed) loss scaler, on one device.
pub struct Scaler {
    store: Box<dyn ScalerStore>,
}

impl std::fmt::Debug for Scaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scaler")
            .field("device", &self.device())
            .field("config", &self.config())
            .finish()
    }
}

const STATE_MAGIC: [u8; 4] = *b"GASC";
const STATE_VERSION: u32 = 1;

impl Scaler {
    /// A CPU scaler.
    pub fn new(config: ScalerConfig) -> Result<Self> {
        Self::on(Device::Cpu, config)
    }

    /// A scaler on `device` (on CUDA, its state is in device memory, ordered on the device's
    /// stream).
    pub fn on(device: Device, config: ScalerConfig) -> Result<Self> {
        config.validate()?;
        let initial = ScalerState::initial(&config);
        Ok(Scaler { store: crate::backend::scaler_for(device.check()?, config, &initial)? })
    }

    /// A CPU scaler resumed from `state` under `config`, checked as [`Scaler::load`] checks bytes.
    pub fn with_state(config: ScalerConfig, state: ScalerState) -> Result<Self> {
        let s = Scaler::new(config)?;
        s.load(&encode(config, &state))?;
        Ok(s)
    }

    pub fn device(&self) -> Device {
        self.store.device()
    }

    pub fn config(&self) -> ScalerConfig {
        self.store.config()
    }

    /// The moving parts of the state (on CUDA a host read: waits for the scaler's stream).
    pub fn state(&self) -> Result<ScalerState> {
        self.store.state()
    }

    /// The current loss scale (on CUDA a host read: waits for the scaler's stream).
    pub fn scale(&self) -> Result<f32> {
        Ok(self.state()?.scale)
    }

    /// Where an accumulator's add finds the current scale.
    pub(crate) fn source(&self) -> ScaleSource<'_> {
        self.store.source()
    }

    fn not_on_cpu(&self) -> Error {
        Error::new(
            ErrorKind::DeviceMismatch,
            format!("the scaler is on {}: this call needs a CPU scaler", self.device().name()),
        )
    }

    /// Statistics (on CUDA a host read).
    pub fn stats(&self) -> Result<ScalerStats> {
        Ok(self.state()?.stats)
    }

    /// Multiplies a host loss buffer in place by the current scale (16-bit values round to
    /// nearest even). CPU scalers only; see [`Scaler::scale_loss_raw`] for any device.
    pub fn scale_loss(&self, loss: GradMut<'_>) -> Result<()> {
        if let ScaleSource::Device(_) = self.source() {
            return Err(self.not_on_cpu());
        }
        let (loss, numel, dtype) = match loss {
            GradMut::F32(v) => (v.as_mut_ptr().cast::<c_void>(), v.len(), Dtype::F32),
            GradMut::F16(v) => (v.as_mut_ptr().cast::<c_void>(), v.len(), Dtype::F16),
            GradMut::Bf16(v) => (v.as_mut_ptr().cast::<c_void>(), v.len(), Dtype::Bf16),
        };
        // SAFETY: a host store, and the exclusive borrow of `numel` values of `dtype` (aligned
        // and in bounds, as every slice) lasts the call.
        unsafe { self.store.scale_loss(loss, numel, dtype) }
    }

    /// Multiplies `numel` loss values of `dtype` at `loss` in place by the current scale: a host
    /// pointer on the CPU, a device address on CUDA (enqueued on the scaler's stream). The address
    /// is checked for null, alignment and size first; `argument` names it in the error.
    ///
    /// # Safety
    /// On the CPU, a non-null `loss` must point to `numel` writable values of `dtype`, not used by
    /// anything else during the call.
    pub unsafe fn scale_loss_raw(
        &self,
        loss: *mut c_void,
        numel: usize,
        dtype: Dtype,
        argument: &str,
    ) -> Result<()> {
        dtype::check_buffer(loss, numel, dtype, argument)?;
        // SAFETY: checked above; writable and unshared by the caller's contract.
        unsafe { self.store.scale_loss(loss, numel, dtype) }
    }

    /// Ends an optimizer step whose window overflowed (`found_inf`) or not, on a CPU scaler.
    /// Every rank must pass the same, agreed flag (the accumulator's `sync` provides it), so every
    /// replica's scaler moves identically. [`Scaler::update_from`] reads the flags itself.
    ///
    /// Fails with [`ErrorKind::ScaleAtMinimum`], changing nothing, when an overflow needs a backoff
    /// while the scale already sits at `min_scale`.
    pub fn update(&self, found_inf: bool) -> Result<StepOutcome> {
        self.update_after(found_inf, false)
    }

    /// [`Scaler::update`] after a window that dropped micro-batches (`dropped`) or not: a drop
    /// backs the scale off as an overflow does (else every later micro-batch would be dropped
    /// too), though the step is taken; the scale grows only after clean steps.
    fn update_after(&self, found_inf: bool, dropped: bool) -> Result<StepOutcome> {
        let before = std::cell::Cell::new(0.0);
        let next = self.store.step(&|config, state| {
            before.set(state.scale);
            next_state(config, state, found_inf, dropped)
        });
        let next = next.ok_or_else(|| self.not_on_cpu())??;
        tell(before.get(), &next, found_inf, dropped);
        Ok(StepOutcome { skipped: found_inf, scale: next.scale })
    }

    /// Ends an optimizer step from the agreed overflow flags of `accumulators` (each synced in its
    /// current window, on this scaler's device), updating the scale once. Returns whether the
    /// step must be skipped; on CUDA the flags are gathered and the scale updated by kernels on
    /// the scaler's stream, and the answer is read (a host wait) only with `wait`, else `None`.
    /// Every check runs first, so a failing call changes nothing.
    pub fn update_from(&self, accumulators: &[&Accumulator], wait: bool) -> Result<Option<bool>> {
        if accumulators.is_empty() {
            return Err(Error::invalid(
                "no accumulators: pass the accumulators whose step this update ends",
            ));
        }
        let (mut found_inf, mut dropped) = (false, false);
        for (i, a) in accumulators.iter().enumerate() {
            let what = format!("accumulators[{i}]");
            Device::require_same((&what, a.device()), ("the scaler", self.device()))?;
            let info = a.check_synced(&what)?;
            found_inf |= info.is_some_and(|info| info.found_inf);
            dropped |= info.is_some_and(|info| info.dropped_microbatches != 0);
        }
        let ScaleSource::Device(state) = self.source() else {
            return Ok(Some(self.update_after(found_inf, dropped)?.skipped));
        };
        for (i, a) in accumulators.iter().enumerate() {
            if let Err(e) = a.gather_into(state, &format!("accumulators[{i}]")) {
                // The gathers so far would otherwise count in the next update.
                state.clear_gathered()?;
                return Err(e);
            }
        }
        state.update(wait)
    }

    /// The complete state (config, scale, trackers, statistics) as versioned bytes, the same on
    /// every device (on CUDA a host read).
    pub fn save(&self) -> Result<Vec<u8>> {
        Ok(encode(self.config(), &self.state()?))
    }

    /// Restores a state written by [`Scaler::save`] on any device. Rejects corrupt, foreign or
    /// inconsistent bytes without changing anything.
    pub fn load(&self, bytes: &[u8]) -> Result<()> {
        let (config, state) = decode(bytes)?;
        self.store.load(config, &state)
    }
}

/// The saved bytes of a scaler.
fn encode(c: ScalerConfig, s: &ScalerState) -> Vec<u8> {
    let mut w = state::Writer::new(STATE_MAGIC, STATE_VERSION);
    w.f32(c.init_scale)
        .f32(c.growth_factor)
        .f32(c.backoff_factor)
        .u64(c.growth_interval as u64)
        .u64(c.hysteresis as u64)
        .bool(c.consecutive_hysteresis)
        .f32(c.min_scale)
        .f32(c.max_scale)
        .bool(c.dynamic)
        .f32(s.scale)
        .u64(s.growth_tracker as u64)
        .u64(s.hysteresis_tracker as u64)
        .u64(s.stats.steps)
        .u64(s.stats.skipped_steps)
        .u64(s.stats.growths)
        .u64(s.stats.backoffs);
    w.finish()
}

/// Parses and checks saved bytes: corrupt, foreign or inconsistent bytes are CORRUPT_STATE.
fn decode(bytes: &[u8]) -> Result<(ScalerConfig, ScalerState)> {
    let mut r = state::Reader::open("scaler state", bytes, STATE_MAGIC, STATE_VERSION)?;
    let small = |v: u64, what: &str| {
        u32::try_from(v).map_err(|_| {
            Error::new(ErrorKind::CorruptState, format!("scaler state: {what} {v} out of range"))
        })
    };
    let config = ScalerConfig {
        init_scale: r.f32()?,
        growth_factor: r.f32()?,
        backoff_factor: r.f32()?,
        growth_interval: small(r.u64()?, "growth_interval")?,
        hysteresis: small(r.u64()?, "hysteresis")?,
        consecutive_hysteresis: r.bool()?,
        min_scale: r.f32()?,
        max_scale: r.f32()?,
        dynamic: r.bool()?,
    };
    let scale = r.f32()?;
    let growth_tracker = small(r.u64()?, "growth_tracker")?;
    let hysteresis_tracker = small(r.u64()?, "hysteresis_tracker")?;
    let stats = ScalerStats {
        steps: r.u64()?,
        skipped_steps: r.u64()?,
        growths: r.u64()?,
        backoffs: r.u64()?,
    };
    r.finish()?;
    config
        .validate()
        .map_err(|e| Error::new(ErrorKind::CorruptState, format!("scaler state: {}", e.message)))?;
    if !(scale.is_finite() && scale >= config.min_scale && scale <= config.max_scale)
        || growth_tracker >= config.growth_interval
        || hysteresis_tracker > config.hysteresis
    {
        return Err(Error::new(
            ErrorKind::CorruptState,
            "scaler state: scale or trackers inconsistent with the config",
        ));
    }
    Ok((config, ScalerState { scale, growth_tracker, hysteresis_tracker, stats }))
}

/// The update rule, as a pure function of the configuration and the state: PyTorch's, where a
/// window that dropped micro-batches backs off as an overflow does but is not a skipped step.
/// Tells the user what a host update decided: a skipped step, and a window that dropped
/// micro-batches, at info; a grown scale at debug.
fn tell(before: f32, next: &ScalerState, found_inf: bool, dropped: bool) {
    let step = next.stats.steps;
    if found_inf {
        log::info!(
            "step {step} skipped: a gradient was not finite; loss scale {before} -> {}",
            next.scale
        );
    } else if dropped {
        log::info!(
            "step {step} taken without its dropped micro-batches; loss scale {before} -> {}",
            next.scale
        );
    } else if next.scale != before {
        log::debug!("step {step}: loss scale grew {before} -> {}", next.scale);
    }
}

fn next_state(
    c: &ScalerConfig,
    s: &ScalerState,
    found_inf: bool,
    dropped: bool,
) -> Result<ScalerState> {
    let mut n = *s;
    n.stats.steps += 1;
    n.stats.skipped_steps += found_inf as u64;
    if !c.dynamic {
        return Ok(n);
    }
    if found_inf || dropped {
        n.growth_tracker = 0;
        n.hysteresis_tracker = s.hysteresis_tracker.saturating_sub(1);
        // A drop at the minimum scale keeps it: the dropped micro-batch already spared the step.
        if n.hysteresis_tracker == 0 && (found_inf || s.scale > c.min_scale) {
            if s.scale <= c.min_scale {
                return Err(Error::new(
                    ErrorKind::ScaleAtMinimum,
                    format!("overflow with the loss scale already at min_scale {}: the gradients overflow even unscaled", c.min_scale),
                ));
            }
            n.scale = (s.scale * c.backoff_factor).max(c.min_scale);
            n.stats.backoffs += 1;
        }
    } else {
        if c.consecutive_hysteresis {
            n.hysteresis_tracker = c.hysteresis;
        }
        n.growth_tracker = s.growth_tracker + 1;
        if n.growth_tracker == c.growth_interval {
            n.growth_tracker = 0;
            n.hysteresis_tracker = c.hysteresis;
            let grown = (s.scale * c.growth_factor).min(c.max_scale);
            // As PyTorch: never grow into infinity.
            if grown.is_finite() && grown > s.scale {
                n.scale = grown;
                n.stats.growths += 1;
            }
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(config: ScalerConfig, flags: &[u8]) -> Vec<f32> {
        let s = Scaler::new(config).unwrap();
        flags.iter().map(|&f| s.update(f != 0).unwrap().scale).collect()
    }

    #[test]
    fn pytorch_trace_from_the_issue() {
        let c = ScalerConfig { growth_interval: 3, ..Default::default() };
        let got = trace(c, &[0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0]);
        let want = [
            65536., 65536., 131072., 65536., 65536., 65536., 131072., 131072., 65536., 32768.,
            32768.,
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn fixed_scale_counts_but_never_moves() {
        let s =
            Scaler::new(ScalerConfig { dynamic: false, init_scale: 128.0, ..Default::default() })
                .unwrap();
        assert!(s.update(true).unwrap().skipped);
        assert!(!s.update(false).unwrap().skipped);
        assert_eq!(s.scale().unwrap(), 128.0);
        assert_eq!(
            s.stats().unwrap(),
            ScalerStats { steps: 2, skipped_steps: 1, growths: 0, backoffs: 0 }
        );
    }

    #[test]
    fn invalid_configs_name_the_field() {
        let bad = [
            (ScalerConfig { init_scale: 0.0, ..Default::default() }, "init_scale"),
            (ScalerConfig { growth_factor: 1.0, ..Default::default() }, "growth_factor"),
            (ScalerConfig { backoff_factor: 1.0, ..Default::default() }, "backoff_factor"),
            (ScalerConfig { growth_interval: 0, ..Default::default() }, "growth_interval"),
            (ScalerConfig { hysteresis: 0, ..Default::default() }, "hysteresis"),
            (ScalerConfig { min_scale: f32::NAN, ..Default::default() }, "min_scale"),
            (ScalerConfig { max_scale: 2.0, ..Default::default() }, "max_scale"),
        ];
        for (c, field) in bad {
            let e = Scaler::new(c).unwrap_err();
            assert_eq!(e.kind, ErrorKind::InvalidArgument);
            assert!(e.message.contains(field), "{}", e.message);
        }
    }
}
