//! A saved window rewritten with a fresh checksum (the checksum catches damage, not a deliberate
//! edit): loading re-derives the overflow flag from the masters instead of trusting the saved
//! one, so a NaN or an infinity saved as "no overflow" is an overflow in the window itself (saved
//! again, merged, or synced), not only once the boundary's norm comes out non-finite.

use gradacc::{Accumulator, AccumulatorConfig, Dtype, Grad, Scaler, ScalerConfig, TensorDesc};

/// The saved format's trailing checksum (FNV-1a, 64-bit), as a forger would recompute it.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Offsets in a whole (not sharded) saved window of `tensors` tensors: magic and version (8),
/// layout and alignment (16), count, micro-batches and rank-windows (24), then the overflow flag,
/// one written flag per tensor, the master length (8) and the masters (at their aligned places).
fn found_inf_at() -> usize {
    48
}
fn master_at(tensors: usize, element: usize) -> usize {
    49 + tensors + 8 + 4 * element
}

fn forge(bytes: &mut [u8], tensors: usize, element: usize, value: f32) {
    bytes[found_inf_at()] = 0;
    let at = master_at(tensors, element);
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    let body = bytes.len() - 8;
    let sum = fnv1a(&bytes[..body]);
    bytes[body..].copy_from_slice(&sum.to_le_bytes());
}

fn window() -> (Accumulator, Vec<TensorDesc>) {
    let tensors = vec![
        TensorDesc { numel: 5, dtype: Dtype::F32 },
        TensorDesc { numel: 3, dtype: Dtype::F32 },
    ];
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let scaler = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
    let (a, b) = ([1.0f32, 2.0, 3.0, 4.0, 5.0], [0.5f32, -0.5, 0.25]);
    acc.add(&scaler, &[Grad::F32(&a), Grad::F32(&b)], 4).unwrap();
    (acc, tensors)
}

#[test]
fn a_forged_clean_flag_over_a_non_finite_master_still_reports_the_overflow() {
    for value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let second = window().0.offset(1).unwrap();
        for element in [0, 4, second + 2] {
            let (acc, tensors) = window();
            let mut bytes = acc.save_window().unwrap();
            forge(&mut bytes, tensors.len(), element, value);
            for merge in [false, true] {
                let target = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                if merge {
                    target.merge_window(&bytes).unwrap();
                } else {
                    target.load_window(&bytes).unwrap();
                }
                // The window itself carries the overflow: saved again, the flag is set.
                let again = target.save_window().unwrap();
                assert_eq!(again[found_inf_at()], 1, "{value} at {element} (merge: {merge})");
                let info = target.sync(None).unwrap();
                assert!(
                    info.found_inf,
                    "{value} at master element {element} (merge: {merge}) synced as clean: {info:?}"
                );
            }
        }
    }
}

#[test]
fn an_honest_window_round_trips_clean() {
    let (acc, tensors) = window();
    let mut bytes = acc.save_window().unwrap();
    // Rewriting a finite value with a fresh checksum is a valid window: nothing to re-derive.
    forge(&mut bytes, tensors.len(), 2, 7.0);
    let target = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    target.load_window(&bytes).unwrap();
    let info = target.sync(None).unwrap();
    assert!(!info.found_inf, "{info:?}");
    assert!(info.grad_norm.is_finite(), "{info:?}");
}

/// The padding after each tensor is saved as +0: a window with anything else there (a value the
/// norm and the reductions would read) is refused, and the accumulator keeps its window.
#[test]
fn a_value_forged_into_the_padding_is_refused() {
    let (acc, tensors) = window();
    let second = acc.offset(1).unwrap();
    for (element, value) in [(5, 1.0f32), (second - 1, -0.0), (second + 3, 2.5)] {
        let mut bytes = acc.save_window().unwrap();
        forge(&mut bytes, tensors.len(), element, value);
        let (target, _) = window();
        let before = target.save_window().unwrap();
        for merge in [false, true] {
            let e = if merge { target.merge_window(&bytes) } else { target.load_window(&bytes) }
                .expect_err("a window with a value in its padding was taken");
            assert_eq!(e.kind, gradacc::ErrorKind::CorruptState, "{e:?}");
            assert!(e.message.contains(&format!("master element {element}")), "{e:?}");
            assert_eq!(target.save_window().unwrap(), before, "a refused window changed it");
        }
    }
}
