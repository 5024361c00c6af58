//! The loss scaler on a CUDA device: its state lives in device memory and is updated by a kernel
//! from the accumulators' agreed overflow flags, so an optimizer step needs no host round trip.
//! The update rule is `ga_scaler_next` (kernels/math.cuh), the device twin of the CPU scaler's.

use std::ffi::c_void;
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};

use super::driver::{
    check_stream, launch_args, CUdeviceptr, CUstream, Context, DeviceBuffer, SharedReads, THREADS,
};
use super::kernels::Kernels;
use super::layout::{GaScalerRule, GaScalerState};
use crate::accumulator::{DeviceScale, ScaleSource};
use crate::device::{Device, DevicePtr, Stream};
use crate::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};
use crate::scaler::{ScalerConfig, ScalerState, ScalerStats, ScalerStore};

/// A dynamic loss scaler whose state is in device memory, ordered on one stream.
///
/// Accumulators on other streams read the state in their add kernels; every such read and every
/// write of the state is enqueued under one lock, with events both ways (`SharedReads`), so an
/// update, a load or the free never overtakes an add that another stream has queued.
pub struct CudaScaler {
    ctx: Arc<Context>,
    kernels: Arc<Kernels>,
    stream: CUstream,
    state: DeviceBuffer,
    inner: Mutex<Inner>,
}

struct Inner {
    /// The configuration (changes only by `load`).
    config: ScalerConfig,
    /// The state's readers on other streams, and its writes on the scaler's.
    reads: SharedReads,
}

// SAFETY: the stream handle is only used through driver calls, which are thread-safe.
unsafe impl Send for CudaScaler {}
// SAFETY: as Send; mutable host state is behind the lock.
unsafe impl Sync for CudaScaler {}

fn rule(c: &ScalerConfig) -> GaScalerRule {
    GaScalerRule {
        growth_factor: c.growth_factor,
        backoff_factor: c.backoff_factor,
        min_scale: c.min_scale,
        max_scale: c.max_scale,
        growth_interval: c.growth_interval,
        hysteresis: c.hysteresis,
        consecutive_hysteresis: c.consecutive_hysteresis as u32,
        dynamic: c.dynamic as u32,
    }
}

fn device_state(s: &ScalerState) -> GaScalerState {
    GaScalerState {
        scale: s.scale,
        growth_tracker: s.growth_tracker,
        hysteresis_tracker: s.hysteresis_tracker,
        steps: s.stats.steps,
        skipped_steps: s.stats.skipped_steps,
        growths: s.stats.growths,
        backoffs: s.stats.backoffs,
        ..Default::default()
    }
}

impl CudaScaler {
    /// A scaler on device `ordinal` starting from `initial` (checked by the caller), ordered on
    /// the caller's `stream` (borrowed).
    pub(crate) fn new(
        config: ScalerConfig,
        initial: &ScalerState,
        ordinal: i32,
        stream: CUstream,
    ) -> Result<Self> {
        check_stream(stream, "`stream`")?;
        let ctx = Context::get(ordinal)?;
        let kernels = Kernels::of(&ctx)?;
        let state = DeviceBuffer::from_slice(&ctx, stream, &[device_state(initial)])?;
        let mut reads = SharedReads::new(&ctx, stream)?;
        reads.after_write()?;
        let inner = Inner { config, reads };
        Ok(CudaScaler { ctx, kernels, stream, state, inner: Mutex::new(inner) })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Enqueues `write` on the scaler's stream, ordered after every read of the state.
    fn write_state<R>(
        &self,
        inner: &mut Inner,
        write: impl FnOnce(&mut Inner) -> Result<R>,
    ) -> Result<R> {
        inner.reads.before_write()?;
        let result = write(inner);
        // Recorded even after a failure: part of the write may be enqueued.
        inner.reads.after_write()?;
        result
    }

    /// Reads the state to the host (waits for the scaler's stream). An update that hit min_scale
    /// since the last read is reported here, once, and its flag cleared. Holds the scaler's lock,
    /// so no update is enqueued between the read and the clear, and clears only that flag.
    fn read_state(&self) -> Result<GaScalerState> {
        let mut inner = self.lock();
        let mut s = [GaScalerState::default()];
        self.state.read(&mut s)?;
        let s = s[0];
        if s.at_minimum != 0 {
            self.write_state(&mut inner, |_| {
                self.state.write_at(std::mem::offset_of!(GaScalerState, at_minimum), &[0u32])
            })?;
            return Err(Error::new(
                ErrorKind::ScaleAtMinimum,
                format!(
                    "an update met an overflow with the loss scale already at min_scale {} and changed nothing: the gradients overflow even unscaled",
                    inner.config.min_scale
                ),
            ));
        }
        Ok(s)
    }

    fn launch_gather(&self, inner: &mut Inner, boundary: CUdeviceptr) -> Result<()> {
        self.write_state(inner, |_| {
            let f = self.kernels.scaler_gather;
            let state = self.state.ptr();
            let mut args = launch_args!(state, boundary);
            // SAFETY: argument types follow ga_scaler_gather.
            unsafe { f.launch(&self.ctx, 1, 1, self.stream, &mut args) }
        })
    }
}

impl ScalerStore for CudaScaler {
    fn device(&self) -> Device {
        Device::Cuda { ordinal: self.ctx.ordinal, stream: self.stream.cast() }
    }

    fn config(&self) -> ScalerConfig {
        self.lock().config
    }

    /// A host read: waits for the scaler's stream.
    fn state(&self) -> Result<ScalerState> {
        let s = self.read_state()?;
        Ok(ScalerState {
            scale: s.scale,
            growth_tracker: s.growth_tracker,
            hysteresis_tracker: s.hysteresis_tracker,
            stats: ScalerStats {
                steps: s.steps,
                skipped_steps: s.skipped_steps,
                growths: s.growths,
                backoffs: s.backoffs,
            },
        })
    }

    /// Ordered after every read of the state.
    fn load(&self, config: ScalerConfig, state: &ScalerState) -> Result<()> {
        let mut inner = self.lock();
        self.write_state(&mut inner, |_| self.state.write(&[device_state(state)]))?;
        inner.config = config;
        Ok(())
    }

    fn source(&self) -> ScaleSource<'_> {
        ScaleSource::Device(self)
    }

    /// Enqueues `loss *= scale` on the device address `loss`, on the scaler's stream.
    unsafe fn scale_loss(&self, loss: *mut c_void, numel: usize, dtype: Dtype) -> Result<()> {
        let _inner = self.lock();
        let f = self.kernels.scale_loss;
        let (loss, n, dtype_code, state) =
            (loss as u64, numel as u64, dtype.code(), self.state.ptr());
        let mut args = launch_args!(loss, n, dtype_code, state);
        // SAFETY: argument types follow ga_scale_loss; `loss` holds `numel` values (caller's
        // contract).
        unsafe { f.launch_over(&self.ctx, self.stream, n.div_ceil(THREADS as u64), &mut args) }
    }

    /// The state only kernels update, from the flags gathered into it.
    fn step(
        &self,
        _next: &dyn Fn(&ScalerConfig, &ScalerState) -> Result<ScalerState>,
    ) -> Option<Result<ScalerState>> {
        None
    }
}

impl DeviceScale for CudaScaler {
    fn stream(&self) -> Stream {
        self.stream.cast()
    }

    fn read_on(
        &self,
        stream: Stream,
        launch: &mut dyn FnMut(DevicePtr) -> Result<()>,
    ) -> Result<()> {
        let stream: CUstream = stream.cast();
        let mut inner = self.lock();
        inner.reads.before_read(stream)?;
        launch(self.state.ptr())?;
        inner.reads.after_read(stream)
    }

    /// Returns with the lock released.
    fn gather_ordered(&self, boundary: DevicePtr) -> Result<()> {
        self.launch_gather(&mut self.lock(), boundary)
    }

    fn clear_gathered(&self) -> Result<()> {
        let mut inner = self.lock();
        self.write_state(&mut inner, |_| {
            self.state.write_at(std::mem::offset_of!(GaScalerState, pending_found_inf), &[0u32])
        })
    }

    /// Reading the answer also reports SCALE_AT_MINIMUM if the update could not back off.
    fn update(&self, read: bool) -> Result<Option<bool>> {
        {
            let mut inner = self.lock();
            self.write_state(&mut inner, |inner| {
                let f = self.kernels.scaler_update;
                let (state, r) = (self.state.ptr(), rule(&inner.config));
                let mut args = launch_args!(state, r);
                // SAFETY: argument types follow ga_scaler_update.
                unsafe { f.launch(&self.ctx, 1, 1, self.stream, &mut args) }
            })?;
        }
        if !read {
            return Ok(None);
        }
        Ok(Some(self.read_state()?.last_skipped != 0))
    }
}

impl Drop for CudaScaler {
    fn drop(&mut self) {
        // The state is freed on the scaler's stream: after every add that reads it elsewhere.
        let _ = self.lock().reads.before_write();
    }
}
