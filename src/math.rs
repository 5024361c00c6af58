//! The per-element arithmetic every backend shares: the contract of the accumulation, the norm
//! and the 16-bit conversions. The CUDA kernels call device twins of these functions
//! (`backend/cuda/kernels/math.cuh`); this host copy is what CI tests, so the device math is
//! tested without a GPU.

/// Elements per block of the deterministic sum of squares.
pub const NORM_BLOCK: usize = 4096;

/// Partial sums per block of the sum of squares: element `i` of a block goes to lane
/// `i % NORM_LANES`. Sixteen lanes are two AVX-512 or four AVX2 f64 vectors, so SIMD paths keep
/// them in registers.
pub const NORM_LANES: usize = 16;

/// Lanes of the fold of the block sums into the sum of squares ([`fold_first_width`] and
/// `cpu::fold_block_sums`): block sum `b` goes to lane `b % FOLD_LANES`. A fixed shape, not a
/// thread count, fixes the bits, and it is wide enough for a GPU to add the lanes in parallel.
pub const FOLD_LANES: usize = 8192;

/// The first width of the fold's halving over `used` lanes (the lanes that hold a block sum):
/// half the smallest power of two that covers them, 0 for one lane or none. Lanes past `used`
/// hold nothing, so the halving starts where the first of them would be added.
pub fn fold_first_width(used: usize) -> usize {
    used.next_power_of_two() / 2
}

/// The clipping coefficient of a gradient of norm `grad_norm` clipped to `max_norm`:
/// `max_norm / (norm + 1e-6)`, at most 1; 1 for a non-finite norm or without clipping
/// (`max_norm` 0). PyTorch's `clip_grad_norm_` formula.
pub fn clip_coef(grad_norm: f64, max_norm: f64) -> f64 {
    if max_norm == 0.0 || !grad_norm.is_finite() {
        1.0
    } else {
        (max_norm / (grad_norm + 1e-6)).min(1.0)
    }
}

/// `weight / scale`, rounded once to f32: the single multiplier applied to every element of a
/// micro-batch (the unscale, times the item count when a mean-reduced loss is weighted).
pub fn unscale_factor(weight: f64, scale: f32) -> f32 {
    (weight / scale as f64) as f32
}

/// One element of the fused pass: a rounded multiply then a rounded add.
#[inline(always)]
pub fn accumulate_one(master: f32, grad: f32, factor: f32, assign: bool) -> f32 {
    let v = grad * factor;
    if assign {
        v
    } else {
        master + v
    }
}

/// bfloat16 bits to f32: the bits are the upper half of an f32, a NaN's payload as it is (the
/// SIMD loads shift the same way). Not `half`'s `to_f32`, which quiets a signalling NaN.
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// IEEE binary16 bits to f32 (exact: every f16 value is an f32 value). A NaN keeps its payload
/// as it is, a signalling one included, as `math.cuh`'s host twin does. Written out rather than
/// `half`'s `to_f32`: that one quiets a signalling NaN (as F16C does), and keeping the payload
/// on top of it costs the scalar path a third of its speed.
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = ((bits as u32) & 0x8000) << 16;
    let exp = ((bits >> 10) & 0x1f) as u32;
    let mant = (bits & 0x3ff) as u32;
    let magnitude = if exp == 0x1f {
        // inf or NaN: keep the payload.
        0x7f80_0000 | (mant << 13)
    } else if exp != 0 {
        ((exp + 112) << 23) | (mant << 13)
    } else if mant == 0 {
        0
    } else {
        // Subnormal: the value is mant * 2^-24, exact in f32.
        ((mant as f32) * f32::from_bits(0x3380_0000)).to_bits()
    };
    f32::from_bits(sign | magnitude)
}

/// f32 to IEEE binary16 bits, rounding to nearest even, up to infinity past the largest finite
/// value; a NaN stays NaN, quiet, with the upper bits of its payload. `half`'s software rounding,
/// not its F16C call (`from_f32`): that one asks the CPU at every element, which keeps the
/// optimizer's loop from vectorizing (AdamW with f16 weights took 1.4 times as long); this one
/// inlines. Slices convert with F16C (`half::slice::HalfFloatSliceExt`).
#[inline(always)]
pub fn f32_to_f16(value: f32) -> u16 {
    half::f16::from_f32_const(value).to_bits()
}

/// f32 to bfloat16 bits, rounding to nearest even; a NaN stays NaN, quiet, with the upper bits
/// of its payload.
#[inline(always)]
pub fn f32_to_bf16(value: f32) -> u16 {
    half::bf16::from_f32(value).to_bits()
}

/// `v * v` in f64. The product of two f32 values is exact in f64, so a fused multiply-add of
/// squares rounds exactly like this multiply followed by an add: SIMD paths may use either.
#[inline(always)]
pub fn square(v: f32) -> f64 {
    (v as f64) * (v as f64)
}

/// Adds the squares of `values` into `lanes`, element `i` into lane `i % NORM_LANES`, each lane in
/// element order. SIMD paths call it for the part of a block that does not fill a whole vector.
#[inline]
pub fn add_squares_to_lanes(lanes: &mut [f64; NORM_LANES], values: &[f32]) {
    for (i, &v) in values.iter().enumerate() {
        lanes[i % NORM_LANES] += square(v);
    }
}

/// Combines the lanes by halving: lane `j` += lane `j + w` for `w` = 8, 4, 2, 1; the result is lane
/// 0. This is the order a SIMD register reduction takes, fixed here so every path gives the same
/// bits.
#[inline]
pub fn combine_lanes(mut lanes: [f64; NORM_LANES]) -> f64 {
    let mut width = NORM_LANES / 2;
    while width > 0 {
        for j in 0..width {
            lanes[j] += lanes[j + width];
        }
        width /= 2;
    }
    lanes[0]
}

/// Sum of squares of one block (at most `NORM_BLOCK` elements) in f64: `NORM_LANES` strided lane
/// sums, each in element order, combined by [`combine_lanes`]. Every backend computes exactly this.
pub fn block_sum_squares(block: &[f32]) -> f64 {
    let mut lanes = [0.0; NORM_LANES];
    add_squares_to_lanes(&mut lanes, block);
    combine_lanes(lanes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 16-bit format from its definition, for the reference conversions below: `mant` mantissa
    /// bits, exponent bias `bias`.
    #[derive(Clone, Copy)]
    struct Format {
        mant: u32,
        bias: i32,
    }

    const F16: Format = Format { mant: 10, bias: 15 };
    const BF16: Format = Format { mant: 7, bias: 127 };

    impl Format {
        /// The pattern of +infinity: all exponent bits set.
        fn infinity(self) -> u16 {
            ((2 * self.bias + 1) as u16) << self.mant
        }

        /// The value of a non-negative pattern up to `infinity()`, which reads as the power of
        /// two that overflow rounds to (one ulp past the largest finite value).
        fn value(self, bits: u16) -> f64 {
            let (e, m) = ((bits >> self.mant) as i32, (bits & ((1 << self.mant) - 1)) as f64);
            let ulp = |e: i32| 2f64.powi(e - self.bias - self.mant as i32);
            if e == 0 {
                m * ulp(1)
            } else {
                (m + 2f64.powi(self.mant as i32)) * ulp(e)
            }
        }

        /// The pattern widened to f32: the value with its sign, a NaN with its payload as it is.
        fn widen(self, bits: u16) -> u32 {
            let sign = ((bits & 0x8000) as u32) << 16;
            let magnitude = bits & 0x7fff;
            if magnitude > self.infinity() {
                let payload = (magnitude & ((1 << self.mant) - 1)) as u32;
                return sign | 0x7f80_0000 | payload << (23 - self.mant);
            }
            let v = if magnitude == self.infinity() {
                f32::INFINITY
            } else {
                self.value(magnitude) as f32
            };
            sign | v.to_bits()
        }

        /// `x` rounded to the nearest pattern, ties to the even one, found by bisection over the
        /// values and one exact comparison with the midpoint; a NaN stays NaN with the quiet bit
        /// set and the upper bits of its payload.
        fn round(self, x: f32) -> u16 {
            let sign = ((x.to_bits() >> 16) & 0x8000) as u16;
            if x.is_nan() {
                let payload = ((x.to_bits() & 0x7f_ffff) >> (23 - self.mant)) as u16;
                return sign | self.infinity() | 1 << (self.mant - 1) | payload;
            }
            let a = (x as f64).abs();
            let (mut lo, mut hi) = (0u16, self.infinity());
            if a >= self.value(hi) {
                return sign | hi;
            }
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if self.value(mid) <= a {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            // Exact in f64: adjacent values have few significant bits.
            let midpoint = (self.value(lo) + self.value(hi)) / 2.0;
            let up = a > midpoint || (a == midpoint && lo & 1 == 1);
            sign | if up { hi } else { lo }
        }
    }

    /// f32 values where rounding to `format` is delicate, for every pattern: the value itself,
    /// the midpoint to the next one and the f32 neighbours of both, with both signs; then random
    /// bit patterns (every exponent, subnormals and NaNs) and random NaN payloads.
    fn rounding_cases(format: Format) -> Vec<f32> {
        let mut v = Vec::new();
        for p in 0..format.infinity() {
            let mid = ((format.value(p) + format.value(p + 1)) / 2.0) as f32;
            for x in [format.value(p) as f32, mid] {
                for b in [x.to_bits(), x.to_bits() + 1, x.to_bits().saturating_sub(1)] {
                    v.extend([f32::from_bits(b), -f32::from_bits(b)]);
                }
            }
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2_000_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            v.push(f32::from_bits(state as u32));
            v.push(f32::from_bits((state >> 32) as u32 | 0x7f80_0000));
        }
        v.extend([f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN, f32::NAN, -f32::NAN]);
        v
    }

    #[test]
    fn widening_is_the_definition_on_every_pattern() {
        for bits in 0..=0xffffu16 {
            let (got, want) = (f16_to_f32(bits).to_bits(), F16.widen(bits));
            assert_eq!(got, want, "f16 {bits:#06x}: got {got:#010x}, want {want:#010x}");
            let (got, want) = (bf16_to_f32(bits).to_bits(), BF16.widen(bits));
            assert_eq!(got, want, "bf16 {bits:#06x}: got {got:#010x}, want {want:#010x}");
        }
    }

    #[test]
    fn rounding_is_nearest_even_by_the_definition() {
        let f16c = |x| half::f16::from_f32(x).to_bits();
        for (format, name, round) in [
            (F16, "f16", f32_to_f16 as fn(f32) -> u16),
            (F16, "f16 (F16C where the CPU has it)", f16c),
            (BF16, "bf16", f32_to_bf16),
        ] {
            for x in rounding_cases(format) {
                let (got, want) = (round(x), format.round(x));
                assert_eq!(got, want, "{name} of {x:e} ({:#010x})", x.to_bits());
            }
        }
    }

    /// The SIMD sums of squares may use fused multiply-adds because a square of an f32 is exact in
    /// f64: then `fma(v, v, acc)` and `acc + v * v` round the same single time.
    #[test]
    fn fused_square_accumulation_rounds_like_multiply_then_add() {
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..1_000_000 {
            let v = f32::from_bits(next() as u32);
            let acc = f64::from_bits(next() >> 2); // non-negative, finite
            let fused = (v as f64).mul_add(v as f64, acc);
            let separate = acc + square(v);
            assert!(
                fused.to_bits() == separate.to_bits() || (fused.is_nan() && separate.is_nan()),
                "{v:e} {acc:e}"
            );
        }
    }

    #[test]
    fn lanes_combine_by_halving() {
        // Magnitudes far apart, so that a different order gives different bits.
        let lanes: [f64; NORM_LANES] =
            std::array::from_fn(|j| 1e8f64.powi(j as i32 % 3) / (j as f64 + 3.0));
        assert_ne!(combine_lanes(lanes), lanes.iter().sum::<f64>());
        let by_hand = (((lanes[0] + lanes[8]) + (lanes[4] + lanes[12]))
            + ((lanes[2] + lanes[10]) + (lanes[6] + lanes[14])))
            + (((lanes[1] + lanes[9]) + (lanes[5] + lanes[13]))
                + ((lanes[3] + lanes[11]) + (lanes[7] + lanes[15])));
        assert_eq!(combine_lanes(lanes), by_hand);
        assert_eq!(block_sum_squares(&[]).to_bits(), 0.0f64.to_bits());
        assert_eq!(block_sum_squares(&[3.0; 17]), 153.0);
    }
}
