//! Read-only finiteness checks: whether a micro-batch's gradients stay finite once unscaled,
//! before anything is added (`Overflow::DropMicrobatch`), and which tensor of a master went
//! non-finite (the boundary's report). Each value is the add's own: one rounded multiply by the
//! same factor, so a value passes exactly when the add would write it finite.

use super::math::{bf16_to_f32, f16_to_f32};
use super::MIN_ELEMENTS_PER_THREAD;
use crate::dtype::Grad;

/// Lanes of the folded check: independent accumulators the compiler keeps in vector registers.
const LANES: usize = 16;

/// Whether every value of `grad`, multiplied by `factor`, is finite.
pub fn finite_after_unscale(grad: Grad<'_>, factor: f32) -> bool {
    match grad {
        Grad::F32(v) => all_finite(v, factor, |x| x),
        Grad::Bf16(v) => all_finite(v, factor, bf16_to_f32),
        // A finite f16 is at most 65504 in magnitude: when that times `factor` stays finite, only
        // the inf and NaN encodings (exponent all ones) fail, a check on the bits alone.
        Grad::F16(v) if (65504.0 * factor.abs()).is_finite() => !v
            .chunks(LANES * 64)
            .any(|c| c.iter().fold(false, |bad, &b| bad | (b & 0x7c00 == 0x7c00))),
        Grad::F16(v) => all_finite(v, factor, f16_to_f32),
    }
}

/// Whether every `to(x) * factor` is finite: `value * 0` is zero for a finite value and NaN
/// otherwise, and NaN stays in a lane's sum, so one comparison at the end decides.
fn all_finite<T: Copy>(values: &[T], factor: f32, to: impl Fn(T) -> f32) -> bool {
    let chunks = values.chunks_exact(LANES);
    let rest = chunks.remainder();
    let mut lanes = [0.0f32; LANES];
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += to(x) * factor * 0.0;
        }
    }
    lanes.iter().all(|&l| l == 0.0) && rest.iter().all(|&x| (to(x) * factor).is_finite())
}

/// The first of `grads` holding a value that is not finite once multiplied by `factor`. With
/// `threads > 1` the tensors are cut into runs of about equal elements, one per thread, and the
/// earliest bad tensor of any run is the answer.
pub fn first_nonfinite(grads: &[Grad<'_>], factor: f32, threads: usize) -> Option<usize> {
    let scan = |from: usize, run: &[Grad<'_>]| {
        run.iter().position(|&g| !finite_after_unscale(g, factor)).map(|i| from + i)
    };
    let total: usize = grads.iter().map(|g| g.len()).sum();
    let parts = threads.min(total / MIN_ELEMENTS_PER_THREAD).max(1);
    if parts == 1 {
        return scan(0, grads);
    }
    // Run k takes the tensors from the first that starts at or past element `total * k / parts`.
    let mut starts = vec![0];
    let mut seen = 0;
    for (i, g) in grads.iter().enumerate() {
        if seen >= total * starts.len() / parts && i > *starts.last().unwrap_or(&0) {
            starts.push(i);
        }
        seen += g.len();
    }
    starts.push(grads.len());
    std::thread::scope(|scope| {
        let handles: Vec<_> = starts
            .windows(2)
            .skip(1)
            .map(|w| scope.spawn(move || scan(w[0], &grads[w[0]..w[1]])))
            .collect();
        let first = scan(0, &grads[..starts[1]]);
        let rest = handles.into_iter().filter_map(|h| {
            h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        });
        first.into_iter().chain(rest).min()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math::{f32_to_bf16, f32_to_f16};

    /// The reference: the add's own multiply, element by element.
    fn reference(grad: Grad<'_>, factor: f32) -> bool {
        (0..grad.len()).all(|i| {
            let x = match grad {
                Grad::F32(v) => v[i],
                Grad::F16(v) => f16_to_f32(v[i]),
                Grad::Bf16(v) => bf16_to_f32(v[i]),
            };
            (x * factor).is_finite()
        })
    }

    #[test]
    fn agrees_with_the_multiply_at_every_position_and_factor() {
        let specials = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 65504.0, 3.0e38, -1.0e38];
        let factors = [1.0f32, 0.0, 2.0e-5, 1.0e30, 1.0e34, f32::MAX, -3.0];
        for n in [0usize, 1, 15, 16, 17, 100] {
            for at in 0..n.min(20) {
                for &special in &specials {
                    let mut v: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 3.0).collect();
                    v[at] = special;
                    let f16: Vec<u16> = v.iter().map(|&x| f32_to_f16(x)).collect();
                    let bf16: Vec<u16> = v.iter().map(|&x| f32_to_bf16(x)).collect();
                    for &factor in &factors {
                        for g in [Grad::F32(&v), Grad::F16(&f16), Grad::Bf16(&bf16)] {
                            assert_eq!(
                                finite_after_unscale(g, factor),
                                reference(g, factor),
                                "{:?} n {n} at {at} value {special} factor {factor}",
                                g.dtype()
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_first_bad_tensor_for_any_thread_count() {
        let sizes = [300_000usize, 5, 700_000, 1, 400_000, 90_000, 650_000];
        let clean: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![1.5; n]).collect();
        for bad in [None, Some(0), Some(3), Some(4), Some(6)] {
            for also in [None, Some(5)] {
                let mut data = clean.clone();
                for i in bad.into_iter().chain(also) {
                    let n = data[i].len();
                    data[i][n - 1] = f32::NAN;
                }
                let grads: Vec<Grad<'_>> = data.iter().map(|v| Grad::F32(v)).collect();
                let want = bad.into_iter().chain(also).min();
                for threads in [1, 2, 3, 8] {
                    assert_eq!(first_nonfinite(&grads, 1.0, threads), want, "threads {threads}");
                }
            }
        }
    }
}
