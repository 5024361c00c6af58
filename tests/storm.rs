//! Numeric storms through the C ABI: 100,000 optimizer steps per scaler configuration, each one
//! an fp16 micro-batch added to an accumulator, synced, and a scaler update, with bursts of
//! overflowing gradients long enough to drive the scale to its minimum. The scale never leaves
//! [min_scale, max_scale], an overflow at the minimum is reported as
//! GRADACC_STATUS_SCALE_AT_MINIMUM and changes nothing, every step follows the reference update
//! rule, and once the bursts stop the scale grows again.

mod common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};

use common::{to_f16, Rng};
use gradacc_capi::*;

fn ok(status: gradacc_status_t) {
    assert_eq!(
        status,
        GRADACC_STATUS_OK,
        "{}",
        unsafe { std::ffi::CStr::from_ptr(gradacc_last_error()) }.to_string_lossy()
    );
}

/// The documented update rule: (scale, growth tracker, hysteresis tracker) after a step, or None
/// when the step must fail with SCALE_AT_MINIMUM.
fn reference(
    c: &gradacc_scaler_config_t,
    state: (f32, u32, u32),
    found_inf: bool,
) -> Option<(f32, u32, u32)> {
    let (scale, growth, hyst) = state;
    if found_inf {
        let hyst = hyst.saturating_sub(1);
        if hyst == 0 {
            if scale <= c.min_scale {
                return None;
            }
            return Some(((scale * c.backoff_factor).max(c.min_scale), 0, hyst));
        }
        Some((scale, 0, hyst))
    } else {
        let hyst = if c.consecutive_hysteresis { c.hysteresis } else { hyst };
        if growth + 1 == c.growth_interval {
            let grown = (scale * c.growth_factor).min(c.max_scale);
            Some((if grown.is_finite() && grown > scale { grown } else { scale }, 0, c.hysteresis))
        } else {
            Some((scale, growth + 1, hyst))
        }
    }
}

fn storm(name: &str, hysteresis: u32, consecutive: bool, max_scale: f32) {
    let mut rng = Rng::fresh(name);
    let mut c = std::mem::MaybeUninit::uninit();
    ok(unsafe { gradacc_scaler_config_default(c.as_mut_ptr()) });
    let mut c: gradacc_scaler_config_t = unsafe { c.assume_init() };
    c.growth_interval = 50;
    c.min_scale = 4.0;
    c.max_scale = max_scale;
    c.hysteresis = hysteresis;
    c.consecutive_hysteresis = consecutive;
    let mut s = null_mut();
    ok(unsafe { gradacc_scaler_create(&c, null(), &mut s) });
    let desc = gradacc_tensor_desc_t { numel: 8, dtype: GRADACC_DTYPE_F16 };
    let mut a = null_mut();
    ok(unsafe { gradacc_accumulator_create(null(), &desc, 1, null(), &mut a) });

    let steps = 100_000;
    let mut state = (c.init_scale, 0u32, c.hysteresis);
    let (mut at_minimum, mut skipped, mut bursts, mut recoveries) = (0u64, 0u64, 0u64, 0u64);
    let mut burst_left = 0u32;
    let mut lowest = f32::INFINITY;
    let mut hit_min_in_burst = false;
    let mut calm_since_min = 0u32;
    for step in 0..steps {
        if burst_left == 0 && rng.range(0, 999) < 3 {
            // A burst: from a few steps to long enough to reach min_scale from the top.
            burst_left = rng.range(3, 80) as u32;
            bursts += 1;
        }
        let storm_now = burst_left > 0;
        burst_left = burst_left.saturating_sub(1);
        let mut scale = 0.0f32;
        ok(unsafe { gradacc_scaler_scale(s, &mut scale) });
        assert!(
            scale.is_finite() && scale >= c.min_scale && scale <= c.max_scale,
            "step {step}: scale {scale} out of range"
        );
        assert_eq!(scale, state.0, "step {step}: scale differs from the reference rule");
        lowest = lowest.min(scale);
        // Calm gradients overflow fp16 only at the highest scales; storm gradients at any scale.
        let magnitude = if storm_now { 1e5 } else { rng.uniform(0.01, 0.6) };
        let grad: Vec<u16> = (0..8)
            .map(|i| to_f16((magnitude * if i % 2 == 0 { 1.0 } else { -0.5 }) as f32 * scale))
            .collect();
        let grads = [grad.as_ptr() as *const c_void];
        ok(unsafe { gradacc_accumulator_add(a, s, grads.as_ptr(), 1, 16) });
        let mut info = gradacc_sync_info_t::default();
        ok(unsafe { gradacc_accumulator_sync(a, null_mut(), &mut info) });
        let overflow_expected = grad.iter().any(|&h| h & 0x7c00 == 0x7c00);
        assert_eq!(info.found_inf, overflow_expected, "step {step}");
        let list = [a as *const gradacc_accumulator_t];
        let mut skip = false;
        let st = unsafe { gradacc_scaler_update(s, list.as_ptr(), 1, &mut skip) };
        match reference(&c, state, info.found_inf) {
            Some(next) => {
                ok(st);
                assert_eq!(skip, info.found_inf);
                skipped += skip as u64;
                state = next;
            }
            None => {
                assert_eq!(st, GRADACC_STATUS_SCALE_AT_MINIMUM, "step {step}");
                let msg = unsafe { std::ffi::CStr::from_ptr(gradacc_last_error()) }
                    .to_string_lossy()
                    .into_owned();
                assert!(msg.contains("min_scale"), "{msg}");
                let mut after = 0.0f32;
                ok(unsafe { gradacc_scaler_scale(s, &mut after) });
                assert_eq!(after, c.min_scale, "a refused update leaves the scale at the minimum");
                at_minimum += 1;
                hit_min_in_burst = true;
                // The caller skips this step; the next micro-batch opens a new window.
            }
        }
        if storm_now {
            calm_since_min = 0;
        } else if hit_min_in_burst {
            calm_since_min += 1;
            let mut now = 0.0f32;
            ok(unsafe { gradacc_scaler_scale(s, &mut now) });
            if now > c.min_scale {
                recoveries += 1;
                hit_min_in_burst = false;
                calm_since_min = 0;
            } else {
                // Recovery needs only growth_interval finite steps once the storm is over.
                assert!(
                    calm_since_min <= c.growth_interval + 1,
                    "step {step}: no growth {calm_since_min} calm steps after the minimum"
                );
            }
        }
    }
    let mut st = gradacc_scaler_stats_t::default();
    ok(unsafe { gradacc_scaler_stats(s, &mut st) });
    eprintln!(
        "{name}: {steps} steps, {bursts} overflow bursts, {skipped} skipped steps, {} growths, {} backoffs, \
         {at_minimum} SCALE_AT_MINIMUM, {recoveries} recoveries from the minimum, lowest scale {lowest}",
        st.growths, st.backoffs
    );
    assert_eq!(st.steps, steps - at_minimum, "refused updates are not counted as steps");
    assert_eq!(st.skipped_steps, skipped);
    assert!(
        at_minimum > 0 && recoveries > 0 && lowest == c.min_scale,
        "the storm reached the minimum and recovered"
    );
    ok(unsafe { gradacc_accumulator_destroy(a) });
    ok(unsafe { gradacc_scaler_destroy(s) });
}

#[test]
fn storm_pytorch_rule() {
    storm("storm_pytorch_rule", 1, false, f32::INFINITY);
}

#[test]
fn storm_megatron_hysteresis() {
    storm("storm_megatron_hysteresis", 3, false, 1e6);
}

#[test]
fn storm_deepspeed_consecutive_hysteresis() {
    storm("storm_deepspeed_consecutive_hysteresis", 2, true, f32::INFINITY);
}
