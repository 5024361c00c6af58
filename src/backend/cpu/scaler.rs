//! A loss scaler's state in host memory, behind a lock, so one scaler can serve accumulators used
//! from several threads. The rules (the update, the checks, the saved bytes) are
//! `crate::scaler`'s; this file only keeps the state and scales host losses.

use std::ffi::c_void;

use half::slice::HalfFloatSliceExt;
use parking_lot::{Mutex, MutexGuard};

use crate::accumulator::ScaleSource;
use crate::device::Device;
use crate::dtype::{Dtype, GradMut};
use crate::error::Result;
use crate::math;
use crate::scaler::{ScalerConfig, ScalerState, ScalerStore};

pub(crate) struct HostScaler {
    kept: Mutex<Kept>,
}

#[derive(Clone, Copy)]
struct Kept {
    config: ScalerConfig,
    state: ScalerState,
}

impl HostScaler {
    /// A scaler starting from `initial` under `config` (both checked by the caller).
    pub(crate) fn new(config: ScalerConfig, initial: &ScalerState) -> Self {
        HostScaler { kept: Mutex::new(Kept { config, state: *initial }) }
    }

    fn lock(&self) -> MutexGuard<'_, Kept> {
        // A panic cannot leave the state half-written (updates assign a finished copy), so a
        // poisoned lock still guards consistent data.
        self.kept.lock()
    }
}

impl ScalerStore for HostScaler {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn config(&self) -> ScalerConfig {
        self.lock().config
    }

    fn state(&self) -> Result<ScalerState> {
        Ok(self.lock().state)
    }

    fn load(&self, config: ScalerConfig, state: &ScalerState) -> Result<()> {
        *self.lock() = Kept { config, state: *state };
        Ok(())
    }

    fn source(&self) -> ScaleSource<'_> {
        ScaleSource::Host(self.lock().state.scale)
    }

    /// 16-bit values round to nearest even.
    unsafe fn scale_loss(&self, loss: *mut c_void, numel: usize, dtype: Dtype) -> Result<()> {
        let s = self.lock().state.scale;
        // SAFETY: checked, writable and unshared for the call: the caller's contract.
        let loss = unsafe { loss_view(loss, numel, dtype) };
        match loss {
            GradMut::F32(v) => v.iter_mut().for_each(|x| *x *= s),
            GradMut::F16(v) => v.reinterpret_cast_mut().iter_mut().for_each(|x| {
                *x = math::f32_to_f16(math::f16_to_f32(*x) * s);
            }),
            GradMut::Bf16(v) => v.reinterpret_cast_mut().iter_mut().for_each(|x| {
                *x = math::f32_to_bf16(math::bf16_to_f32(*x) * s);
            }),
        }
        Ok(())
    }

    fn step(
        &self,
        next: &dyn Fn(&ScalerConfig, &ScalerState) -> Result<ScalerState>,
    ) -> Option<Result<ScalerState>> {
        let mut kept = self.lock();
        Some(next(&kept.config, &kept.state).inspect(|n| kept.state = *n))
    }
}

/// `numel` values of `dtype` at `loss`, to write.
///
/// # Safety
/// `loss` is non-null, aligned, and points to `numel` writable values of `dtype` that nothing
/// else uses while the view lives.
unsafe fn loss_view<'a>(loss: *mut c_void, numel: usize, dtype: Dtype) -> GradMut<'a> {
    // SAFETY: the caller's contract.
    unsafe {
        match dtype {
            Dtype::F32 => GradMut::F32(std::slice::from_raw_parts_mut(loss as *mut f32, numel)),
            Dtype::F16 => {
                GradMut::f16_bits(std::slice::from_raw_parts_mut(loss as *mut u16, numel))
            }
            Dtype::Bf16 => {
                GradMut::bf16_bits(std::slice::from_raw_parts_mut(loss as *mut u16, numel))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scaler(scale: f32) -> HostScaler {
        let config = ScalerConfig { init_scale: scale, ..Default::default() };
        let state = ScalerState {
            scale,
            growth_tracker: 0,
            hysteresis_tracker: 1,
            stats: Default::default(),
        };
        HostScaler::new(config, &state)
    }

    #[test]
    fn the_source_is_the_current_scale() {
        let s = scaler(8.0);
        assert!(matches!(s.source(), ScaleSource::Host(x) if x == 8.0));
        let halve = |_: &ScalerConfig, st: &ScalerState| Ok(ScalerState { scale: 4.0, ..*st });
        assert_eq!(s.step(&halve).unwrap().unwrap().scale, 4.0);
        assert!(matches!(s.source(), ScaleSource::Host(x) if x == 4.0));
    }

    #[test]
    fn a_failed_step_keeps_the_state() {
        let s = scaler(8.0);
        let before = s.state().unwrap();
        let fail = |_: &ScalerConfig, _: &ScalerState| Err(crate::Error::invalid("no"));
        assert!(s.step(&fail).unwrap().is_err());
        assert_eq!(s.state().unwrap(), before);
    }
}
