//! Writing an FP32 master weight into the model's weight: round to nearest even, or stochastic
//! rounding driven by a counter-based generator, so that every rank, shard count and rerun draws
//! the same number for the same element of the same step.

use crate::dtype::Dtype;
use crate::math::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// How an FP32 master weight becomes the model's 16-bit weight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Rounding {
    /// Round to nearest, ties to even. The default.
    #[default]
    NearestEven,
    /// Round up or down with probabilities that make the expected value the FP32 weight, so
    /// that updates smaller than the 16-bit spacing still move the weight on average. The
    /// random number of an element is a function of the seed, the step and the element's index
    /// in the flat layout alone. Values beyond the largest finite 16-bit value, infinities, NaN
    /// and values that are already representable round as with `NearestEven`. F32 weights are
    /// written as they are either way.
    Stochastic { seed: u64 },
}

impl Rounding {
    /// The code stored in saved state.
    pub(crate) fn code(self) -> (u64, u64) {
        match self {
            Rounding::NearestEven => (0, 0),
            Rounding::Stochastic { seed } => (1, seed),
        }
    }
}

/// SplitMix64's finaliser: a bijection of u64 whose outputs pass statistical tests even for
/// consecutive inputs.
#[inline(always)]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of one step's draws.
#[inline]
pub(crate) fn key(seed: u64, step: u64) -> u64 {
    mix(seed ^ mix(step.wrapping_add(0x9e37_79b9_7f4a_7c15)))
}

/// The key of one step's draws for the moments in bf16, apart from the weights' draws of the
/// same seed: an element's 64 random bits ([`draws_at`]) round its first moment with their upper
/// half and its second with their lower half, one hash for both.
#[inline]
pub(crate) fn moment_key(seed: u64, step: u64) -> u64 {
    key(mix(seed ^ 0xd6e8_feb8_6659_fd93), step)
}

/// The random 32 bits of the first and of the second moment of the element with `counter`.
#[inline(always)]
pub(crate) fn draws_at(counter: u64) -> (u32, u32) {
    let z = mix(counter);
    ((z >> 32) as u32, z as u32)
}

/// How far apart consecutive elements' counters are.
const STRIDE: u64 = 0x9e37_79b9_7f4a_7c15;

/// The counter of element `index` in the step of `key`; the next element's is [`next`] of it,
/// so a loop steps it with an add (which vectorizes) instead of a 64-bit multiply per element.
#[inline(always)]
pub(crate) fn counter(key: u64, index: u64) -> u64 {
    key.wrapping_add(index.wrapping_mul(STRIDE))
}

/// The counter of the element after the one of `counter`.
#[inline(always)]
pub(crate) fn next(counter: u64) -> u64 {
    counter.wrapping_add(STRIDE)
}

/// The random 32 bits of the element with counter `counter`.
#[inline(always)]
pub(crate) fn draw_at(counter: u64) -> u32 {
    (mix(counter) >> 32) as u32
}

/// The random 32 bits of element `index` in the step of `key`: the definition the pass steps
/// through with [`counter`] and [`next`], and the CUDA kernels' `ga_round_draw`.
#[cfg(test)]
fn draw(key: u64, index: u64) -> u32 {
    draw_at(counter(key, index))
}

/// `x` in `dtype` (16-bit), rounded stochastically with the random bits `r`: up (away from
/// zero) with probability (|x| - |lo|) / (|hi| - |lo|), `lo` and `hi` the neighbours of `x`.
#[inline(always)]
pub(crate) fn stochastic(x: f32, dtype: Dtype, r: u32) -> u16 {
    if dtype == Dtype::Bf16 {
        stochastic_bf16(x, r)
    } else {
        by_neighbours(x, dtype, r)
    }
}

/// [`stochastic`] from the neighbours' values, for any 16-bit `dtype`.
#[inline]
fn by_neighbours(x: f32, dtype: Dtype, r: u32) -> u16 {
    let f16 = dtype == Dtype::F16;
    let nearest = if f16 { f32_to_f16 } else { f32_to_bf16 };
    let to_f32 = if f16 { f16_to_f32 } else { bf16_to_f32 };
    let n = nearest(x);
    if !x.is_finite() || x == 0.0 || to_f32(n) == x {
        return n;
    }
    // Sign and magnitude: a neighbour one magnitude step from another is its bits plus one.
    let (down, up) = if to_f32(n).abs() > x.abs() { (n - 1, n) } else { (n, n + 1) };
    let (lo, hi) = (to_f32(down).abs() as f64, to_f32(up).abs() as f64);
    if !hi.is_finite() {
        return n;
    }
    // Both differences are exact in f64; `hi - lo` is a power of two.
    let p = (x.abs() as f64 - lo) / (hi - lo);
    if (r as f64) < p * 4294967296.0 {
        up
    } else {
        down
    }
}

/// [`stochastic`] for bf16 in integers (a test holds it to [`by_neighbours`]): the neighbours are the upper half of `x`'s bits and the
/// next, and p · 2^32 is the lower half shifted up (both in units of `x`'s f32 spacing).
#[inline(always)]
pub(crate) fn stochastic_bf16(x: f32, r: u32) -> u16 {
    let bits = x.to_bits();
    let down = (bits >> 16) as u16;
    // Infinities and NaN, and the largest finite magnitude, whose upper neighbour is infinite.
    if down & 0x7f80 == 0x7f80 || down & 0x7fff == 0x7f7f {
        return f32_to_bf16(x);
    }
    down + (r < (bits & 0xffff) << 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stochastic_rounding_picks_a_neighbour_with_the_right_frequency() {
        for dtype in [Dtype::F16, Dtype::Bf16] {
            let to_f32 = if dtype == Dtype::F16 { f16_to_f32 } else { bf16_to_f32 };
            for x in [1.0f32 + 0.3 * 2f32.powi(-7), -3.7e-3, 6.1e-5, -1.0e-7, 60000.5] {
                let n = 100_000u64;
                let mut sum = 0.0f64;
                let mut seen = std::collections::BTreeSet::new();
                for i in 0..n {
                    let h = stochastic(x, dtype, draw(key(7, 3), i));
                    seen.insert(h);
                    sum += to_f32(h) as f64;
                }
                assert!(seen.len() <= 2, "{dtype:?} {x}: {seen:?}");
                let (lo, hi) = (to_f32(*seen.first().unwrap()), to_f32(*seen.last().unwrap()));
                let spacing = (hi as f64 - lo as f64).abs().max(f64::MIN_POSITIVE);
                // The mean's standard error is at most spacing / (2 sqrt(n)); allow 5 of them.
                let err = (sum / n as f64 - x as f64).abs();
                assert!(err < 5.0 * spacing / (2.0 * (n as f64).sqrt()), "{dtype:?} {x}: {err}");
            }
        }
    }

    /// Stepping the counter draws each element's number, across the wrap of the index too.
    #[test]
    fn stepping_the_counter_is_drawing_by_index() {
        let mut z = 3u64;
        for base in [0, 1, 12_345, u64::MAX - 500] {
            z = mix(z);
            let mut c = counter(z, base);
            for i in 0..1000u64 {
                assert_eq!(
                    draw_at(c),
                    draw(z, base.wrapping_add(i)),
                    "key {z:#x} index {base}+{i}"
                );
                c = next(c);
            }
        }
    }

    /// The integer path for bf16 is the general rule's.
    #[test]
    fn bf16_in_integers_is_the_general_rule() {
        let general = |x: f32, r: u32| by_neighbours(x, Dtype::Bf16, r);
        let mut z = 1u64;
        for _ in 0..200_000 {
            z = mix(z);
            let x = f32::from_bits(z as u32);
            let r = (z >> 32) as u32;
            assert_eq!(
                stochastic_bf16(x, r),
                general(x, r),
                "{x:e} ({:#x}), r {r:#x}",
                x.to_bits()
            );
        }
        for x in [f32::MAX, -f32::MAX, 3.3895e38, f32::MIN_POSITIVE, 1e-45, -0.0] {
            for r in [0, 1, u32::MAX / 2, u32::MAX] {
                assert_eq!(stochastic_bf16(x, r), general(x, r), "{x:e}, r {r:#x}");
            }
        }
    }

    #[test]
    fn representable_and_special_values_round_as_nearest_even() {
        for r in [0, u32::MAX] {
            assert_eq!(stochastic(1.5, Dtype::Bf16, r), f32_to_bf16(1.5));
            assert_eq!(stochastic(f32::INFINITY, Dtype::F16, r), f32_to_f16(f32::INFINITY));
            assert_eq!(stochastic(65519.0, Dtype::F16, r), f32_to_f16(65519.0));
            assert_eq!(stochastic(-0.0, Dtype::F16, r), 0x8000);
        }
    }
}
