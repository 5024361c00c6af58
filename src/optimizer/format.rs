//! How the optimizer keeps its state: FP32 moments, bf16 moments rounded stochastically or 8-bit
//! blocks, and FP32 masters, masters kept as the model's bf16 weight plus a 16-bit remainder, or
//! no masters (the model's weight read back and rounded stochastically). The remainder's split
//! and join are here, with the proof that they are exact.

use super::rounding::Rounding;
use crate::dtype::Dtype;
use crate::error::{Error, Result};

/// How AdamW's moments (SGD's momentum buffer) are stored between steps. Either way a step
/// computes them in f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MomentFormat {
    /// 4 bytes per moment. The default.
    #[default]
    F32,
    /// 2 bytes per moment: each new moment is rounded stochastically to bf16 (as the weights'
    /// stochastic rounding rounds, with its own draws), keyed by `seed`, the step and the
    /// element's index in the flat layout, so every rank and shard count rounds alike.
    Bf16 { seed: u64 },
    /// 1 byte per moment plus one f32 scale per block of
    /// [`MOMENT_BLOCK`](super::MOMENT_BLOCK) elements: each moment coded as the nearest entry of
    /// a dynamic quantisation map (signed for the first moment, unsigned for the second) times
    /// its block's largest magnitude (`blockwise.rs`). Deterministic: no seed. Host optimizers
    /// only.
    Int8Blockwise,
}

/// How the FP32 master weights are stored between steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MasterFormat {
    /// 4 bytes per master, beside the model's weight. The default.
    #[default]
    F32,
    /// The master is the model's bf16 weight (its upper 16 bits, see [`split_master`]) plus a
    /// 16-bit remainder the optimizer keeps: 2 bytes per master beside the weight, and the
    /// master exactly the FP32 master of [`MasterFormat::F32`]. Only for bf16 weights, rounded to
    /// nearest, and not with adopted masters; the model's weights must be written by the
    /// optimizer alone, since each step reads its master back from them.
    Bf16Remainder,
    /// No masters: each step reads its master from the model's weight (widened exactly), steps
    /// it in f32 as the FP32 master is stepped, and writes it back into the weight with the
    /// weights' rounding. 0 bytes per master. 16-bit weights need [`Rounding::Stochastic`]: an
    /// update below half the weight's 16-bit spacing would round to nearest back to the same
    /// weight every step and be lost, while rounded stochastically it moves the weight by its
    /// expected value. Over f32 weights the weight is the master, and the step is the FP32
    /// masters' bit for bit. Not with adopted masters; the model's weights must be written by
    /// the optimizer alone.
    None,
}

/// An optimizer's state formats ([`OptimizerBuilder::state`](super::OptimizerBuilder::state));
/// the default is FP32 throughout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateFormat {
    pub moments: MomentFormat,
    pub masters: MasterFormat,
}

impl StateFormat {
    /// The codes saved state and the kernels use: (masters, moments, the moments' seed).
    pub(crate) fn codes(&self) -> (u64, u64, u64) {
        let masters = match self.masters {
            MasterFormat::F32 => 0,
            MasterFormat::Bf16Remainder => 1,
            MasterFormat::None => 2,
        };
        match self.moments {
            MomentFormat::F32 => (masters, 0, 0),
            MomentFormat::Bf16 { seed } => (masters, 1, seed),
            MomentFormat::Int8Blockwise => (masters, 2, 0),
        }
    }

    /// Whether the moments are bf16.
    pub(crate) fn bf16_moments(&self) -> bool {
        matches!(self.moments, MomentFormat::Bf16 { .. })
    }

    /// Whether the moments are 8-bit blocks.
    pub(crate) fn blockwise(&self) -> bool {
        self.moments == MomentFormat::Int8Blockwise
    }

    /// Whether the masters are remainders of the bf16 weights.
    pub(crate) fn remainders(&self) -> bool {
        self.masters == MasterFormat::Bf16Remainder
    }

    /// Whether no masters are kept (the model's weights are the masters).
    pub(crate) fn no_masters(&self) -> bool {
        self.masters == MasterFormat::None
    }

    /// Fails unless the formats can be kept for weights of `dtypes`, with `rounding` and
    /// (`adopted`) the caller's FP32 masters.
    pub(crate) fn check(&self, dtypes: &[Dtype], rounding: Rounding, adopted: bool) -> Result<()> {
        if self.no_masters() {
            return check_no_masters(dtypes, rounding, adopted);
        }
        if !self.remainders() {
            return Ok(());
        }
        if let Some((i, d)) = dtypes.iter().enumerate().find(|(_, d)| **d != Dtype::Bf16) {
            return Err(Error::invalid(format!(
                "`weights[{i}]` is {}: bf16-remainder masters are exact only over bf16 weights (keep FP32 masters for f16 and f32 weights)",
                d.name()
            )));
        }
        if rounding != Rounding::NearestEven {
            return Err(Error::invalid(
                "stochastic rounding of the weights with bf16-remainder masters: the weight is the master's upper half, so it cannot be rounded otherwise (use Rounding::NearestEven)",
            ));
        }
        if adopted {
            return Err(Error::invalid(
                "adopted `masters` with bf16-remainder masters: the optimizer keeps the remainders, the model's weights the rest",
            ));
        }
        Ok(())
    }

    /// Bytes of optimizer state per held element (masters and moments, without the model's
    /// weight), for an algorithm with `moments` moments; blockwise moments' scales are counted
    /// as their share of a whole block (4 / [`MOMENT_BLOCK`](super::MOMENT_BLOCK) per moment).
    pub fn state_bytes(&self, moments: usize) -> f64 {
        let master = match self.masters {
            MasterFormat::F32 => 4.0,
            MasterFormat::Bf16Remainder => 2.0,
            MasterFormat::None => 0.0,
        };
        let moment = match self.moments {
            MomentFormat::F32 => 4.0,
            MomentFormat::Bf16 { .. } => 2.0,
            MomentFormat::Int8Blockwise => 1.0 + 4.0 / super::MOMENT_BLOCK as f64,
        };
        master + moments as f64 * moment
    }
}

/// [`StateFormat::check`] for [`MasterFormat::None`]: 16-bit weights rounded stochastically (f32
/// weights take any rounding, which they ignore), and the masters not adopted.
fn check_no_masters(dtypes: &[Dtype], rounding: Rounding, adopted: bool) -> Result<()> {
    let half = dtypes.iter().enumerate().find(|(_, d)| **d != Dtype::F32);
    if let (Some((i, d)), Rounding::NearestEven) = (half, rounding) {
        return Err(Error::invalid(format!(
            "`rounding` is Rounding::NearestEven with no masters (MasterFormat::None) and `weights[{i}]` in {}: an update below half the weight's 16-bit spacing would round back to the same weight every step and be lost (use Rounding::Stochastic, or keep masters)",
            d.name()
        )));
    }
    if adopted {
        return Err(Error::invalid(
            "adopted `masters` with no masters (MasterFormat::None): the model's weights are the masters",
        ));
    }
    Ok(())
}

/// The bf16 weight and 16-bit remainder of master `x`: the remainder is the lower half of `x`'s
/// bits, and the weight its upper half, plus one when the lower half is 0x8000 or more. The
/// weight is thus `x` rounded to nearest with ties away from zero (the bits grow with the
/// magnitude for either sign): round to nearest even but at exact ties whose upper half is even.
/// No split can do better. Under round to nearest even an even bf16 value is the rounding of
/// 65,537 f32 bit patterns and an odd one of 65,535, but a 16-bit remainder tells only 65,536
/// apart; this rule moves one tie of every even value to its odd neighbour, which then has
/// 65,536 too. A carry out of the mantissa goes into the exponent, as rounding does (up to
/// infinity past the largest finite bf16). NaN masters are kept exactly, but their weight can
/// read as an infinity (a payload only in the lower half) or, for negative NaNs from
/// 0xffff8000 up, as +0: the step never makes a NaN master from finite values.
#[inline(always)]
pub fn split_master(x: f32) -> (u16, u16) {
    let bits = x.to_bits();
    let lo = bits as u16;
    (((bits >> 16) as u16).wrapping_add(lo >> 15), lo)
}

/// The master whose split is (`weight`, `remainder`): exact for every bit pattern.
#[inline(always)]
pub fn join_master(weight: u16, remainder: u16) -> f32 {
    let hi = weight.wrapping_sub(remainder >> 15);
    f32::from_bits((hi as u32) << 16 | remainder as u32)
}

/// The remainder of a saved FP32 master `x` whose model weight is `x` rounded to nearest even
/// (what an optimizer with FP32 masters writes): the lower half of its bits, except at a tie
/// whose upper half is even, where no remainder joins that weight back to `x` (see
/// [`split_master`]); there the master moves one f32 unit toward its weight (0x7fff). `None`
/// for a non-finite master.
pub(crate) fn remainder_of_nearest(x: f32) -> Option<u16> {
    if !x.is_finite() {
        return None;
    }
    let bits = x.to_bits();
    let lo = bits as u16;
    Some(if lo == 0x8000 && (bits >> 16) & 1 == 0 { 0x7fff } else { lo })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math::{bf16_to_f32, f32_to_bf16};

    /// Every class of bit pattern: the split joins back exactly, and the weight is round to
    /// nearest even but at the ties of even upper halves, where it is one bf16 unit away from
    /// zero.
    #[test]
    fn split_joins_back_exactly_and_rounds_to_nearest() {
        let mut cases: Vec<u32> = Vec::new();
        // Normals, subnormals and zeros of both signs, with every lower half around the tie,
        // and carries into the exponent (upper half 0x3f7f, 0x007f: subnormal to normal) and
        // to infinity (0x7f7f).
        for hi in [0x3f80u32, 0x3f81, 0x3f7f, 0x0000, 0x0001, 0x007f, 0x0080, 0x7f7f, 0x4b00] {
            for lo in [0u32, 1, 0x7ffe, 0x7fff, 0x8000, 0x8001, 0xfffe, 0xffff] {
                for sign in [0, 0x8000_0000] {
                    cases.push(sign | hi << 16 | lo);
                }
            }
        }
        // Infinities and NaNs.
        cases.extend([0x7f80_0000, 0xff80_0000, 0x7fc0_0000, 0x7f80_0001, 0xffff_ffff]);
        // And a stride through all 2^32 patterns.
        cases.extend((0..1u64 << 32).step_by(65_521).map(|b| b as u32));
        for bits in cases {
            let x = f32::from_bits(bits);
            let (w, r) = split_master(x);
            assert_eq!(join_master(w, r).to_bits(), bits, "{bits:#010x}");
            if !x.is_nan() {
                let tie_of_even = bits & 0xffff == 0x8000 && (bits >> 16) & 1 == 0;
                let expected = f32_to_bf16(x).wrapping_add(tie_of_even as u16);
                assert_eq!(w, expected, "{bits:#010x}");
            }
        }
    }

    #[test]
    fn nan_masters_with_an_upper_payload_stay_nan_weights() {
        let (w, _) = split_master(f32::from_bits(0x7fc0_1234));
        assert!(bf16_to_f32(w).is_nan());
    }

    /// The remainder of a saved FP32 master joins its nearest-even weight back to the master,
    /// moved by one f32 unit only at the ties of even upper halves.
    #[test]
    fn a_saved_master_converts_with_its_nearest_weight() {
        for bits in
            (0..1u64 << 32).step_by(4093).map(|b| b as u32).chain([0x3f80_8000, 0xbf81_8000])
        {
            let x = f32::from_bits(bits);
            let Some(r) = remainder_of_nearest(x) else {
                assert!(!x.is_finite());
                continue;
            };
            let back = join_master(f32_to_bf16(x), r).to_bits();
            let tie_of_even = bits & 0xffff == 0x8000 && (bits >> 16) & 1 == 0;
            assert_eq!(back, if tie_of_even { bits - 1 } else { bits }, "{bits:#010x}");
        }
    }

    #[test]
    fn remainders_refuse_what_they_cannot_keep_exactly() {
        let f = StateFormat { masters: MasterFormat::Bf16Remainder, ..Default::default() };
        let e = f.check(&[Dtype::Bf16, Dtype::F16], Rounding::NearestEven, false).unwrap_err();
        assert!(e.message.contains("`weights[1]` is f16"), "{}", e.message);
        assert!(f.check(&[Dtype::F32], Rounding::NearestEven, false).is_err());
        assert!(f.check(&[Dtype::Bf16], Rounding::Stochastic { seed: 1 }, false).is_err());
        assert!(f.check(&[Dtype::Bf16], Rounding::NearestEven, true).is_err());
        assert!(f.check(&[Dtype::Bf16], Rounding::NearestEven, false).is_ok());
        assert_eq!(f.state_bytes(2), 10.0);
    }

    #[test]
    fn no_masters_refuse_nearest_rounding_of_16_bit_weights_and_adoption() {
        let f = StateFormat { masters: MasterFormat::None, ..Default::default() };
        let sr = Rounding::Stochastic { seed: 1 };
        let e = f.check(&[Dtype::F32, Dtype::F16], Rounding::NearestEven, false).unwrap_err();
        assert!(e.message.contains("`rounding`") && e.message.contains("`weights[1]` in f16"));
        assert!(f.check(&[Dtype::Bf16], Rounding::NearestEven, false).is_err());
        assert!(f.check(&[Dtype::Bf16], sr, true).unwrap_err().message.contains("adopted"));
        assert!(f.check(&[Dtype::F32], Rounding::NearestEven, false).is_ok());
        assert!(f.check(&[Dtype::F32, Dtype::F16, Dtype::Bf16], sr, false).is_ok());
        assert_eq!(f.state_bytes(2), 8.0);
        assert_eq!(f.codes().0, 2);
    }
}
