//! Read-only finiteness checks: whether a micro-batch's gradients stay finite once unscaled,
//! before anything is added (`Overflow::DropMicrobatch`), and which tensor of a master went
//! non-finite (the boundary's report). Each value is the add's own: one rounded multiply by the
//! same factor, so a value passes exactly when the add would write it finite.

use super::math::{bf16_to_f32, f16_to_f32};
use super::MIN_ELEMENTS_PER_THREAD;
#[cfg(target_arch = "x86_64")]
use super::{active_isa, Isa};
use crate::dtype::Grad;

/// Whether every value of `grad`, multiplied by `factor`, is finite. Magnitudes order as their
/// encodings (sign cleared), infinity and NaN above every finite one, so one pass takes the largest
/// encoding (a vectorised max) and one comparison against the largest encoding whose product
/// stays finite decides.
pub fn finite_after_unscale(grad: Grad<'_>, factor: f32) -> bool {
    Limits::of(factor).admit(grad)
}

/// Per dtype, the largest magnitude encoding whose product by one factor stays finite: found once
/// per micro-batch, not once per tensor.
struct Limits {
    f32: Option<u32>,
    f16: Option<u32>,
    bf16: Option<u32>,
}

impl Limits {
    fn of(factor: f32) -> Self {
        Limits {
            f32: largest_finite(0x7f80_0000, factor, f32::from_bits),
            f16: largest_finite(0x7c00, factor, |m| f16_to_f32(m as u16)),
            bf16: largest_finite(0x7f80, factor, |m| bf16_to_f32(m as u16)),
        }
    }

    /// Whether every value of `grad` stays finite.
    fn admit(&self, grad: Grad<'_>) -> bool {
        let largest = match grad {
            Grad::F32(_) => self.f32,
            Grad::F16(_) => self.f16,
            Grad::Bf16(_) => self.bf16,
        };
        let Some(largest) = largest else { return grad.is_empty() };
        largest_encoding(grad) <= largest
    }
}

/// The largest magnitude encoding (sign cleared) in `grad`, on the widest vectors the CPU has.
fn largest_encoding(grad: Grad<'_>) -> u32 {
    #[cfg(target_arch = "x86_64")]
    match active_isa() {
        // SAFETY: `active_isa` reports the ISA only where the CPU has it (AVX-512 BW included).
        Isa::Avx512 => return unsafe { largest_encoding_avx512(grad) },
        // SAFETY: as above, for AVX2.
        Isa::Avx2 => return unsafe { largest_encoding_avx2(grad) },
        Isa::Scalar => {}
    }
    largest_encoding_any(grad)
}

/// # Safety
/// The CPU must have AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn largest_encoding_avx512(grad: Grad<'_>) -> u32 {
    largest_encoding_any(grad)
}

/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn largest_encoding_avx2(grad: Grad<'_>) -> u32 {
    largest_encoding_any(grad)
}

/// [`largest_encoding`]'s loop, compiled for whichever vectors its caller enables.
#[inline(always)]
fn largest_encoding_any(grad: Grad<'_>) -> u32 {
    match grad {
        Grad::F32(v) => largest_magnitude(v, |x: f32| x.to_bits() & 0x7fff_ffff),
        Grad::F16(_) | Grad::Bf16(_) => {
            let bits = grad.bits().unwrap_or_default();
            largest_magnitude(bits, |b: u16| b & 0x7fff) as u32
        }
    }
}

/// Lanes of the running maximum: a fixed-size array the compiler keeps in vector registers (a
/// plain fold is one dependency chain, about a third of the memory bandwidth).
const LANES: usize = 64;

/// Parts of the buffer read side by side: a lone read stream leaves much of a core's memory
/// bandwidth unused (the add that follows moves three).
const STREAMS: usize = 4;

/// The largest `magnitude(x)` over `values`.
#[inline(always)]
fn largest_magnitude<T: Copy, M: Copy + Ord + Default>(
    values: &[T],
    magnitude: impl Fn(T) -> M,
) -> M {
    let fold = |mut lanes: [M; LANES], chunk: &[T]| {
        for i in 0..LANES {
            lanes[i] = lanes[i].max(magnitude(chunk[i]));
        }
        lanes
    };
    let part = values.len() / (STREAMS * LANES) * LANES;
    let (head, tail) = values.split_at(part * STREAMS);
    let mut lanes = [M::default(); LANES];
    for k in (0..part).step_by(LANES) {
        for s in 0..STREAMS {
            lanes = fold(lanes, &head[s * part + k..s * part + k + LANES]);
        }
    }
    let chunks = tail.chunks_exact(LANES);
    let rest = chunks.remainder().iter().map(|&x| magnitude(x)).max().unwrap_or_default();
    let lanes = chunks.fold(lanes, fold);
    lanes.into_iter().max().unwrap_or_default().max(rest)
}

/// The largest magnitude encoding below `inf` (the format's infinity) whose value times `factor`
/// is finite; `None` when not even zero's is (a non-finite factor). The products grow with the
/// encoding, so a binary search finds it.
fn largest_finite(inf: u32, factor: f32, value: impl Fn(u32) -> f32) -> Option<u32> {
    let finite = |m: u32| (value(m) * factor).is_finite();
    if !finite(0) {
        return None;
    }
    let (mut ok, mut bad) = (0, inf);
    while bad - ok > 1 {
        let mid = ok + (bad - ok) / 2;
        if finite(mid) {
            ok = mid;
        } else {
            bad = mid;
        }
    }
    Some(ok)
}

/// The tensors of `grads` holding a value that is not finite once multiplied by `factor`, in
/// order. With `threads > 1` the tensors are cut into runs of about equal elements, one per
/// thread.
pub fn nonfinite_tensors(grads: &[Grad<'_>], factor: f32, threads: usize) -> Vec<usize> {
    let limits = Limits::of(factor);
    let scan = |from: usize, run: &[Grad<'_>]| -> Vec<usize> {
        (0..run.len()).filter(|&i| !limits.admit(run[i])).map(|i| from + i).collect()
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
        let mut bad = scan(0, &grads[..starts[1]]);
        for h in handles {
            bad.extend(h.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)));
        }
        bad
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: the add's own multiply, element by element.
    fn reference(grad: Grad<'_>, factor: f32) -> bool {
        (0..grad.len()).all(|i| {
            let x = match grad {
                Grad::F32(v) => v[i],
                Grad::F16(v) => f16_to_f32(v[i].to_bits()),
                Grad::Bf16(v) => bf16_to_f32(v[i].to_bits()),
            };
            (x * factor).is_finite()
        })
    }

    #[test]
    fn agrees_with_the_multiply_at_every_position_and_factor() {
        let specials = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 65504.0, 3.0e38, -1.0e38];
        let factors = [1.0f32, 0.0, 2.0e-5, 1.0e30, 1.0e34, f32::MAX, -3.0];
        // Past 256 elements the buffer is read as four streams and a tail: poison each part.
        for n in [0usize, 1, 15, 16, 17, 100, 256, 1000, 4097] {
            let ats = (0..n.min(20)).chain([n / 4 - n / 8, n / 2, n - n / 5, n.saturating_sub(1)]);
            for at in ats.filter(|&at| at < n) {
                for &special in &specials {
                    let mut v: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 3.0).collect();
                    v[at] = special;
                    let f16: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
                    let bf16: Vec<half::bf16> =
                        v.iter().map(|&x| half::bf16::from_f32(x)).collect();
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
    fn the_bad_tensors_for_any_thread_count() {
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
                let mut want: Vec<usize> = bad.into_iter().chain(also).collect();
                want.sort();
                want.dedup();
                for threads in [1, 2, 3, 8] {
                    assert_eq!(nonfinite_tensors(&grads, 1.0, threads), want, "threads {threads}");
                }
            }
        }
    }
}
