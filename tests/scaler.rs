//! The scaler against straightforward reference models of PyTorch GradScaler, Megatron-Core's
//! DynamicGradScaler and DeepSpeed's consecutive hysteresis, on random overflow sequences.

mod common;

use common::Rng;
use gradacc::{Dtype, ErrorKind, GradMut, Scaler, ScalerConfig};

/// torch.amp.GradScaler.update (AmpKernels.cu `_amp_update_scale_`), in f32 as PyTorch keeps it.
fn pytorch(flags: &[bool], init: f32, growth: f32, backoff: f32, interval: u32) -> Vec<f32> {
    let (mut scale, mut tracker) = (init, 0u32);
    flags
        .iter()
        .map(|&inf| {
            if inf {
                scale *= backoff;
                tracker = 0;
            } else {
                tracker += 1;
                if tracker == interval {
                    let grown = scale * growth;
                    if grown.is_finite() {
                        scale = grown;
                    }
                    tracker = 0;
                }
            }
            scale
        })
        .collect()
}

/// Megatron-Core DynamicGradScaler.update, plus DeepSpeed's consecutive_hysteresis refill.
fn megatron(flags: &[bool], c: &ScalerConfig) -> Vec<f32> {
    let (mut scale, mut growth_tracker, mut hysteresis_tracker) =
        (c.init_scale, 0u32, c.hysteresis as i64);
    flags
        .iter()
        .map(|&inf| {
            if inf {
                growth_tracker = 0;
                hysteresis_tracker -= 1;
                if hysteresis_tracker <= 0 {
                    scale = (scale * c.backoff_factor).max(c.min_scale);
                }
            } else {
                if c.consecutive_hysteresis {
                    hysteresis_tracker = c.hysteresis as i64;
                }
                growth_tracker += 1;
                if growth_tracker == c.growth_interval {
                    growth_tracker = 0;
                    hysteresis_tracker = c.hysteresis as i64;
                    scale *= c.growth_factor;
                }
            }
            scale
        })
        .collect()
}

fn run(scaler: &Scaler, flags: &[bool]) -> Vec<f32> {
    flags.iter().map(|&f| scaler.update(f).unwrap().scale).collect()
}

fn random_flags(rng: &mut Rng, n: usize, p_inf: f64) -> Vec<bool> {
    (0..n).map(|_| rng.uniform(0.0, 1.0) < p_inf).collect()
}

#[test]
fn hysteresis_one_is_pytorch_exactly() {
    let mut rng = Rng::fresh("hysteresis_one_is_pytorch_exactly");
    for _ in 0..200 {
        let interval = rng.range(1, 6) as u32;
        let growth = [2.0f32, 1.5, 4.0][rng.range(0, 2) as usize];
        let backoff = [0.5f32, 0.25, 0.75][rng.range(0, 2) as usize];
        let init = 2f32.powi(rng.range(0, 24) as i32);
        let p = rng.uniform(0.05, 0.6);
        let flags = random_flags(&mut rng, 300, p);
        let c = ScalerConfig {
            init_scale: init,
            growth_factor: growth,
            backoff_factor: backoff,
            growth_interval: interval,
            min_scale: f32::MIN_POSITIVE,
            ..Default::default()
        };
        let want = pytorch(&flags, init, growth, backoff, interval);
        // Keep to sequences that stay above min_scale, where PyTorch has no floor.
        if want.iter().any(|&s| s <= f32::MIN_POSITIVE * 4.0) {
            continue;
        }
        assert_eq!(run(&Scaler::new(c).unwrap(), &flags), want, "{c:?} {flags:?}");
    }
}

#[test]
fn growth_never_reaches_infinity() {
    let c = ScalerConfig { init_scale: f32::MAX, growth_interval: 1, ..Default::default() };
    let s = Scaler::new(c).unwrap();
    assert_eq!(run(&s, &[false, false]), pytorch(&[false, false], c.init_scale, 2.0, 0.5, 1));
    assert_eq!(s.scale().unwrap(), f32::MAX);
    assert_eq!(s.stats().unwrap().growths, 0);
}

#[test]
fn hysteresis_matches_megatron_and_deepspeed() {
    let mut rng = Rng::fresh("hysteresis_matches_megatron_and_deepspeed");
    for _ in 0..200 {
        let c = ScalerConfig {
            init_scale: 2f32.powi(rng.range(4, 20) as i32),
            growth_interval: rng.range(1, 5) as u32,
            hysteresis: rng.range(1, 4) as u32,
            consecutive_hysteresis: rng.range(0, 1) == 1,
            min_scale: 1.0,
            ..Default::default()
        };
        let p = rng.uniform(0.1, 0.5);
        let flags = random_flags(&mut rng, 200, p);
        let want = megatron(&flags, &c);
        // Megatron has no guard against growing into infinity; compare where it stays sane.
        if want.iter().any(|&s| s > 1e30) {
            continue;
        }
        let s = Scaler::new(c).unwrap();
        for (i, &f) in flags.iter().enumerate() {
            match s.update(f) {
                Ok(o) => assert_eq!(o.scale, want[i], "step {i} of {flags:?} with {c:?}"),
                // Megatron clamps silently at min_scale; gradacc reports it instead.
                Err(e) => {
                    assert_eq!(e.kind, ErrorKind::ScaleAtMinimum);
                    assert_eq!(s.scale().unwrap(), c.min_scale);
                    break;
                }
            }
        }
    }
}

#[test]
fn min_scale_is_a_floor_then_an_error_and_recovery_follows() {
    let c =
        ScalerConfig { init_scale: 8.0, min_scale: 3.0, growth_interval: 2, ..Default::default() };
    let s = Scaler::new(c).unwrap();
    assert_eq!(s.update(true).unwrap().scale, 4.0);
    assert_eq!(s.update(true).unwrap().scale, 3.0); // clamped, still a backoff
    let before = (s.scale().unwrap(), s.stats().unwrap());
    let e = s.update(true).unwrap_err();
    assert_eq!(e.kind, ErrorKind::ScaleAtMinimum);
    assert_eq!((s.scale().unwrap(), s.stats().unwrap()), before, "a failed update changes nothing");
    assert_eq!(run(&s, &[false, false]), [3.0, 6.0]);
}

#[test]
fn max_scale_caps_growth() {
    let s = Scaler::new(ScalerConfig {
        init_scale: 4.0,
        max_scale: 6.0,
        growth_interval: 1,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(run(&s, &[false, false, false]), [6.0, 6.0, 6.0]);
    assert_eq!(s.stats().unwrap().growths, 1);
}

#[test]
fn saved_state_resumes_identically_and_bad_bytes_change_nothing() {
    let mut rng = Rng::fresh("saved_state_resumes_identically_and_bad_bytes_change_nothing");
    let c = ScalerConfig {
        growth_interval: 3,
        hysteresis: 2,
        min_scale: f32::MIN_POSITIVE,
        ..Default::default()
    };
    let a = Scaler::new(c).unwrap();
    run(&a, &random_flags(&mut rng, 50, 0.1));
    let bytes = a.save().unwrap();
    let b = Scaler::new(ScalerConfig::default()).unwrap();
    for i in 0..bytes.len() {
        let mut bad = bytes.clone();
        bad[i] ^= 0x01;
        assert_eq!(b.load(&bad).unwrap_err().kind, ErrorKind::CorruptState, "flipped byte {i}");
        assert_eq!(b.config(), ScalerConfig::default());
    }
    b.load(&bytes).unwrap();
    assert_eq!(b.stats().unwrap(), a.stats().unwrap());
    let rest = random_flags(&mut rng, 100, 0.1);
    assert_eq!(run(&a, &rest), run(&b, &rest));
}

/// A host loss is scaled in place, 16-bit values rounded to nearest even (each sample below is a
/// tie, or an overflow to infinity), the same through the slice and the raw-address entry points.
#[test]
fn a_host_loss_scales_in_place_rounding_to_nearest_even() {
    let s = Scaler::new(ScalerConfig { init_scale: 3.0, ..Default::default() }).unwrap();
    // f16: 1 + 2^-10 times 3 lies halfway between 3 + 2^-9 and 3 + 2^-8; 65504 overflows.
    let (f16_in, f16_out) = ([0x3c01u16, 0x7bff], [0x4202u16, 0x7c00]);
    // bf16: 1 + 2^-7 times 3 lies halfway between 3 + 2^-6 and 3 + 2^-5.
    let (bf16_in, bf16_out) = ([0x3f81u16, 0xbf80], [0x4042u16, 0xc040]);
    let (f32_in, f32_out) = ([0.5f32, -2.0], [1.5f32, -6.0]);

    let (mut a, mut b, mut c) = (f16_in, bf16_in, f32_in);
    s.scale_loss(GradMut::f16_bits(&mut a)).unwrap();
    s.scale_loss(GradMut::bf16_bits(&mut b)).unwrap();
    s.scale_loss(GradMut::F32(&mut c)).unwrap();
    assert_eq!((a, b, c), (f16_out, bf16_out, f32_out));

    let (mut a, mut b, mut c) = (f16_in, bf16_in, f32_in);
    // SAFETY: each buffer holds two values of its dtype, used by nothing else during the call.
    unsafe {
        s.scale_loss_raw(a.as_mut_ptr().cast(), 2, Dtype::F16, "loss").unwrap();
        s.scale_loss_raw(b.as_mut_ptr().cast(), 2, Dtype::Bf16, "loss").unwrap();
        s.scale_loss_raw(c.as_mut_ptr().cast(), 2, Dtype::F32, "loss").unwrap();
    }
    assert_eq!((a, b, c), (f16_out, bf16_out, f32_out));
}
