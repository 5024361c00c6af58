//! C API of the dynamic loss scaler.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, LazyLock};

use crate::accumulator::ACCUMULATORS;
use crate::handle::Registry;
use crate::status::{gradacc_status_t, guard, null, CallResult};
use crate::types::*;
use gradacc::scaler::{Scaler, ScalerConfig};

/// A dynamic loss scaler (opaque). Create with gradacc_scaler_create, free with
/// gradacc_scaler_destroy.
pub struct gradacc_scaler_t {
    _private: [u8; 0],
}

pub(crate) static SCALERS: LazyLock<Registry<Scaler>> = LazyLock::new(|| Registry::new("scaler"));

/// Scaler configuration. Initialise with gradacc_scaler_config_default, then change fields.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_scaler_config_t {
    /// sizeof(gradacc_scaler_config_t); set by gradacc_scaler_config_default.
    pub struct_size: usize,
    /// Scale at creation (default 65536).
    pub init_scale: f32,
    /// Factor applied after growth_interval consecutive finite steps (default 2).
    pub growth_factor: f32,
    /// Factor applied on a backoff (default 0.5).
    pub backoff_factor: f32,
    /// Consecutive finite steps before the scale grows (default 2000).
    pub growth_interval: u32,
    /// Overflows tolerated before a backoff: 1 backs off on every overflow as PyTorch does
    /// (default); n > 1 backs off on the n-th overflow since the last growth, as Megatron-Core.
    pub hysteresis: u32,
    /// Also refill the hysteresis tracker after every finite step, as DeepSpeed's option of this
    /// name (default false).
    pub consecutive_hysteresis: bool,
    /// Lowest scale (default 1). An overflow that needs a backoff at this scale makes
    /// gradacc_scaler_update fail with GRADACC_STATUS_SCALE_AT_MINIMUM.
    pub min_scale: f32,
    /// Highest scale (default INFINITY: grow while the grown scale is finite, as PyTorch).
    pub max_scale: f32,
    /// false keeps the scale fixed at init_scale (default true).
    pub dynamic: bool,
}

/// Statistics of a scaler since creation or since its state was loaded. Set struct_size before
/// the call (`gradacc_scaler_stats_t st = GRADACC_SCALER_STATS_INIT;` in C).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_scaler_stats_t {
    /// sizeof(gradacc_scaler_stats_t), set by the caller: the library writes only the fields this
    /// size covers (an older header's size is accepted), and never changes struct_size itself.
    pub struct_size: usize,
    /// Optimizer steps seen by gradacc_scaler_update.
    pub steps: u64,
    /// Steps skipped because of an overflow.
    pub skipped_steps: u64,
    /// Times the scale grew.
    pub growths: u64,
    /// Times the scale backed off.
    pub backoffs: u64,
}

impl From<&gradacc_scaler_config_t> for ScalerConfig {
    fn from(c: &gradacc_scaler_config_t) -> Self {
        ScalerConfig {
            init_scale: c.init_scale,
            growth_factor: c.growth_factor,
            backoff_factor: c.backoff_factor,
            growth_interval: c.growth_interval,
            hysteresis: c.hysteresis,
            consecutive_hysteresis: c.consecutive_hysteresis,
            min_scale: c.min_scale,
            max_scale: c.max_scale,
            dynamic: c.dynamic,
        }
    }
}

/// Fills `*out` with the default scaler configuration (and its struct_size).
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_scaler_config_default(
    out: *mut gradacc_scaler_config_t,
) -> gradacc_status_t {
    guard("gradacc_scaler_config_default", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        let d = ScalerConfig::default();
        *out = gradacc_scaler_config_t {
            struct_size: size_of::<gradacc_scaler_config_t>(),
            init_scale: d.init_scale,
            growth_factor: d.growth_factor,
            backoff_factor: d.backoff_factor,
            growth_interval: d.growth_interval,
            hysteresis: d.hysteresis,
            consecutive_hysteresis: d.consecutive_hysteresis,
            min_scale: d.min_scale,
            max_scale: d.max_scale,
            dynamic: d.dynamic,
        };
        Ok(())
    })
}

/// Creates a scaler. `config` NULL means the defaults; `device` NULL means the CPU. On a CUDA
/// device the state lives in device memory, ordered on the device's stream, and is updated there
/// by gradacc_scaler_update without a host round trip.
///
/// Ownership: `*out` is the caller's; free it with gradacc_scaler_destroy (after every
/// accumulator call that uses it has returned).
/// Thread safety: any thread. The new scaler may be used from several threads: reads and
/// gradacc_scaler_update are internally serialised.
#[no_mangle]
pub unsafe extern "C" fn gradacc_scaler_create(
    config: *const gradacc_scaler_config_t,
    device: *const gradacc_device_t,
    out: *mut *mut gradacc_scaler_t,
) -> gradacc_status_t {
    guard("gradacc_scaler_create", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        let config = if config.is_null() {
            ScalerConfig::default()
        } else {
            // SAFETY: a non-null `config` points to a config struct of its `struct_size` (API
            // contract).
            (&unsafe { read_config(config, "config")? }).into()
        };
        *out = SCALERS.insert(Arc::new(Scaler::on(parse_device(device)?, config)?));
        Ok(())
    })
}

/// Destroys a scaler. NULL is accepted and does nothing; must not be called twice on one handle
/// (a second call is detected and reported as GRADACC_STATUS_INVALID_HANDLE).
///
/// Thread safety: any thread, once no other call uses the scaler.
#[no_mangle]
pub unsafe extern "C" fn gradacc_scaler_destroy(scaler: *mut gradacc_scaler_t) -> gradacc_status_t {
    guard("gradacc_scaler_destroy", || {
        if !scaler.is_null() {
            SCALERS.remove(scaler, "scaler")?;
        }
        Ok(())
    })
}

/// Reads the current loss scale into `*out`. On CUDA this synchronises with the scaler's stream.
///
/// Thread safety: any thread, concurrently with other calls on the scaler.
#[no_mangle]
pub unsafe extern "C" fn gradacc_scaler_scale(
    scaler: *const gradacc_scaler_t,
    out: *mut f32,
) -> gradacc_status_t {
    guard("gradacc_scaler_scale", || {
        let s = SCALERS.get(scaler, "scaler")?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        *out = s.scale()?;
        Ok(())
    })
}

/// Multiplies `numel` loss values of `dtype` at `loss` in place by the current scale (16-bit
/// values round to nearest even). Call it on the loss before the backward pass. On CUDA `loss` is
/// a device address and the work is enqueued on the scaler's stream.
///
/// Thread safety: any thread; `loss` must not be used concurrently.
#[no_mangle]
pub unsafe extern "C" fn gradacc_scaler_scale_loss(
    scaler: *const gradacc_scaler_t,
    loss: *mut c_void,
    numel: usize,
    dtype: gradacc_dtype_t,
) -> gradacc_status_t {
    guard("gradacc_scaler_scale_loss", || {
        let s = SCALERS.get(scaler, "scaler")?;
        let dtype = dtype_from_c(dtype, "dtype")?;
        // SAFETY: the caller passes `numel` writable values of `dtype` at `loss` (API contract);
        // the address is checked before use, and a CUDA address is never dereferenced here.
        if loss.is_null() {
            return Err(null("loss"));
        }
        // SAFETY: `loss` holds `numel` writable values of `dtype` (API contract);
        // `scale_loss_raw` checks its alignment and size, and never dereferences a CUDA address.
        Ok(unsafe { s.scale_loss_raw(loss, numel, dtype, "loss") }?)
    })
}

/// Ends an optimizer step: reads the agreed overflow flag of each of the `n` accumulators (each
/// must have completed gradacc_accumulator_sync for its current window), and updates the scale
/// once. `*out_skipped` (may be NULL) is set to true when any of them overflowed: skip the
/// optimizer step. Every rank calls it with its own scaler and gets the same result.
///
/// Fails with GRADACC_STATUS_SCALE_AT_MINIMUM, changing nothing, when an overflow needs a backoff
/// while the scale is already at min_scale.
///
/// On CUDA: the flags are gathered and the scale updated by kernels on the scaler's stream
/// (ordered after each accumulator's stream); with `out_skipped` NULL the call does not wait,
/// and a SCALE_AT_MINIMUM is reported by the next call that reads the state (get_scale,
/// get_stats, save, or an update with `out_skipped`); with `out_skipped` it waits (a host read).
/// Thread safety: any thread; serialised with other updates of the scaler.
#[no_mangle]
pub unsafe extern "C" fn gradacc_scaler_update(
    scaler: *mut gradacc_scaler_t,
    accumulators: *const *const crate::accumulator::gradacc_accumulator_t,
    n: usize,
    out_skipped: *mut bool,
) -> gradacc_status_t {
    guard("gradacc_scaler_update", || {
        let s = SCALERS.get(scaler, "scaler")?;
        if accumulators.is_null() {
            return Err(null("accumulators"));
        }
        if n == 0 {
            return Err(gradacc::error::Error::invalid(
                "`n` is 0: pass the accumulators whose step this update ends",
            )
            .into());
        }
        // SAFETY: the caller passes `n` handles at `accumulators` (API contract).
        let handles = unsafe { read_slice(accumulators, n, "accumulators", "n")? };
        let accs = handles
            .iter()
            .enumerate()
            .map(|(i, &a)| ACCUMULATORS.get(a, &format!("accumulators[{i}]")))
            .collect::<CallResult<Vec<_>>>()?;
        let refs: Vec<&gradacc::Accumulator> = accs.iter().map(|a| &**a).collect();
        let skipped = s.update_from(&refs, !out_skipped.is_null())?;
        // SAFETY: a non-null `out_skipped` points to a writable bool (API contract).
        if let (Some(o), Some(skipped)) = (unsafe { out_skipped.as_mut() }, skipped) {
            *o = skipped;
        }
        Ok(())
    })
}

/// Writes the scaler's statistics to `*out`.
///
/// Thread safety: any thread, concurrently with other calls on the scaler.
#[no_mangle]
pub unsafe extern "C" fn gradacc_scaler_stats(
    scaler: *const gradacc_scaler_t,
    out: *mut gradacc_scaler_stats_t,
) -> gradacc_status_t {
    guard("gradacc_scaler_stats", || {
        let s = SCALERS.get(scaler, "scaler")?.stats()?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        unsafe {
            write_out(
                out,
                "out",
                gradacc_scaler_stats_t {
                    struct_size: 0,
                    steps: s.steps,
                    skipped_steps: s.skipped_steps,
                    growths: s.growths,
                    backoffs: s.backoffs,
                },
            )
        }
    })
}

/// Saves the scaler's complete state (config, scale, trackers, statistics) as versioned bytes.
/// With `buf` NULL, only writes the needed size to `*out_len`; otherwise `capacity` must be at
/// least that size, and `*out_len` receives the bytes written.
///
/// Thread safety: any thread, concurrently with other calls on the scaler.
#[no_mangle]
pub unsafe extern "C" fn gradacc_scaler_save(
    scaler: *const gradacc_scaler_t,
    buf: *mut u8,
    capacity: usize,
    out_len: *mut usize,
) -> gradacc_status_t {
    // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
    guard("gradacc_scaler_save", || unsafe {
        write_bytes(&SCALERS.get(scaler, "scaler")?.save()?, buf, capacity, out_len)
    })
}

/// Restores a state written by gradacc_scaler_save. Corrupt, truncated or foreign bytes fail with
/// GRADACC_STATUS_CORRUPT_STATE and leave the scaler unchanged.
///
/// Thread safety: any thread; serialised with other updates of the scaler.
#[no_mangle]
pub unsafe extern "C" fn gradacc_scaler_load(
    scaler: *mut gradacc_scaler_t,
    bytes: *const u8,
    len: usize,
) -> gradacc_status_t {
    guard("gradacc_scaler_load", || {
        let s = SCALERS.get(scaler, "scaler")?;
        // SAFETY: a non-null `bytes` points to `len` readable bytes (API contract).
        Ok(s.load(unsafe { read_bytes(bytes, len, "bytes")? })?)
    })
}
