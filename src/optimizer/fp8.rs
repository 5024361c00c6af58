//! FP8 model weights written by a sharded step for the all-gather: E4M3 (`float8_e4m3fn`: no
//! infinity, one NaN pattern per sign, largest finite 448) with one f32 scale per tensor, or
//! MXFP8 (the OCP Microscaling format) with one E8M0 scale byte per block of [`MX_BLOCK`]
//! elements. docs/optimizer.md ("FP8 weights on the all-gather") states the rules; this file
//! holds the conversions and the quantisers of a tensor's piece.

use crate::dtype::GradMut;

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Elements per MXFP8 block, counted from the tensor's start: the OCP format's 32.
pub const MX_BLOCK: usize = 32;

/// The amax below which a per-tensor scale is taken as of this amax (torchao's `EPS`), so that
/// an all-zero (or all-tiny) tensor gets a finite scale: 448 / 1e-12.
pub const SCALE_AMAX_FLOOR: f64 = 1e-12;

/// The E8M0 code of NaN.
pub const E8M0_NAN: u8 = 0xFF;

/// How the step writes a tensor's model weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightFormat {
    /// The model's dtype given at creation (f32, f16 or bf16). The default.
    #[default]
    Model,
    /// E4M3 codes with one f32 scale per tensor: `scale = 448 / max(amax, 1e-12)` from the amax
    /// of the tensor's new FP32 masters over all ranks, `code = E4M3(clamp(x * scale, ±448))`
    /// rounded to nearest even; the weight is `code / scale`.
    E4m3Tensorwise,
    /// MXFP8: E4M3 codes of `x / 2^e` (saturated at ±448, nearest even) with one E8M0 byte
    /// `e + 127` per block of [`MX_BLOCK`] elements, `e = floor(log2(block amax)) - 8` clamped to
    /// -127..=127; the weight is `code * 2^e`.
    Mxfp8,
}

impl WeightFormat {
    /// Whether the step writes FP8 codes.
    pub fn is_fp8(self) -> bool {
        self != WeightFormat::Model
    }

    /// Scale entries (f32 for E4M3, E8M0 bytes for MXFP8) a tensor of `numel` elements takes.
    pub fn scales(self, numel: usize) -> usize {
        match self {
            WeightFormat::Model => 0,
            WeightFormat::E4m3Tensorwise => 1,
            WeightFormat::Mxfp8 => numel.div_ceil(MX_BLOCK),
        }
    }

    pub(crate) fn code(self) -> u8 {
        self as u8
    }

    /// The format in words, for messages.
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::Model => "the model's dtype",
            WeightFormat::E4m3Tensorwise => "E4M3 with a scale per tensor",
            WeightFormat::Mxfp8 => "MXFP8",
        }
    }
}

/// A tensor's model weights as a step writes them: the model's dtype, or FP8 codes and scales.
#[derive(Debug)]
pub enum WeightMut<'a> {
    /// [`WeightFormat::Model`]: the tensor's values in the model's dtype.
    Model(GradMut<'a>),
    /// [`WeightFormat::E4m3Tensorwise`]: one E4M3 code per element and the tensor's scale
    /// (`scale.len() == 1`).
    E4m3 { codes: &'a mut [u8], scale: &'a mut [f32] },
    /// [`WeightFormat::Mxfp8`]: one E4M3 code per element and one E8M0 scale per block.
    Mxfp8 { codes: &'a mut [u8], scales: &'a mut [u8] },
}

impl<'a> WeightMut<'a> {
    /// The format this buffer is of.
    pub fn format(&self) -> WeightFormat {
        match self {
            WeightMut::Model(_) => WeightFormat::Model,
            WeightMut::E4m3 { .. } => WeightFormat::E4m3Tensorwise,
            WeightMut::Mxfp8 { .. } => WeightFormat::Mxfp8,
        }
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            WeightMut::Model(w) => w.len(),
            WeightMut::E4m3 { codes, .. } | WeightMut::Mxfp8 { codes, .. } => codes.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The scale entries held (none for the model's dtype).
    pub(crate) fn scale_len(&self) -> usize {
        match self {
            WeightMut::Model(_) => 0,
            WeightMut::E4m3 { scale, .. } => scale.len(),
            WeightMut::Mxfp8 { scales, .. } => scales.len(),
        }
    }

    /// The byte addresses of the element buffer.
    pub(crate) fn addresses(&self) -> std::ops::Range<usize> {
        match self {
            WeightMut::Model(w) => w.as_grad().addresses(),
            WeightMut::E4m3 { codes, .. } | WeightMut::Mxfp8 { codes, .. } => {
                let start = codes.as_ptr() as usize;
                start..start + codes.len()
            }
        }
    }
}

/// `x` as E4M3, rounded to nearest even, saturating: magnitudes above 448 (infinities
/// included) become ±448, NaN the NaN code of its sign (0x7F, 0xFF). ±0 keep their sign.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    if x.is_nan() {
        return sign | 0x7F;
    }
    let a = x.abs().min(E4M3_MAX);
    // Below E4M3's smallest normal 2^-6 the codes are the multiples of 2^-9 (code 8 is 2^-6
    // itself): `a * 512` is exact, and adding 2^23 rounds it to an integer, ties to even, in
    // the sum's low bits. Both ways are computed and one selected, so that the loop has no
    // branch and vectorizes.
    let small = (a * 512.0 + 8_388_608.0).to_bits() - 0x4B00_0000;
    // Round the 23-bit significand to 3 bits, ties to even (a carry moves the exponent), then
    // rebias the exponent from 127 to 7 (wrapping below 2^-6, where `small` is taken).
    let b = a.to_bits();
    let normal = ((b + 0x7_FFFF + ((b >> 20) & 1)) >> 20).wrapping_sub(120 << 3);
    let code = if a < 1.0 / 64.0 { small } else { normal };
    sign | code as u8
}

/// The value of the E4M3 code `c` (NaN for 0x7F and 0xFF).
pub fn e4m3_to_f32(c: u8) -> f32 {
    let (e, m) = ((c >> 3) & 0xF, (c & 7) as f32);
    let v = match (e, c & 7) {
        (15, 7) => f32::NAN,
        (0, _) => m / 512.0,
        _ => (8.0 + m) * pow2(e as i32 - 10),
    };
    if c & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// 2^k for k in -126..=127.
fn pow2(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// The largest magnitude of `x` (0 when empty), NaN when one is NaN: the maximum of the
/// magnitudes' bit patterns, which orders them as numbers and puts NaN above infinity.
pub fn amax(x: &[f32]) -> f32 {
    f32::from_bits(x.iter().map(|v| v.to_bits() & 0x7FFF_FFFF).max().unwrap_or(0))
}

/// The per-tensor E4M3 scale of a tensor whose amax is `amax` (finite):
/// `448 / max(amax, 1e-12)`, computed in f64 and rounded to the nearest f32.
pub fn e4m3_scale(amax: f32) -> f32 {
    (f64::from(E4M3_MAX) / f64::from(amax).max(SCALE_AMAX_FLOOR)) as f32
}

/// `x` quantised with the per-tensor `scale` into `codes`: `f32_to_e4m3(x * scale)`, the
/// product in f32. With `scale = e4m3_scale(amax(x))` it is what a step writes for a whole
/// tensor (for its weights before the first step, say).
///
/// # Panics
/// If `codes` is not as long as `x`.
pub fn quantise_tensorwise(x: &[f32], scale: f32, codes: &mut [u8]) {
    assert_eq!(codes.len(), x.len(), "one code per element");
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = f32_to_e4m3(v * scale);
    }
}

/// The E8M0 scale of an MXFP8 block whose amax is `amax`: `floor(log2(amax)) - 8 + 127`,
/// clamped to 0..=254 (an amax of 0 gives 0, 2^-127); NaN and infinity give [`E8M0_NAN`].
pub fn mx_scale(amax: f32) -> u8 {
    if !amax.is_finite() {
        return E8M0_NAN;
    }
    // A subnormal amax (biased exponent 0) is below 2^-126, so its exponent clamps to -127
    // as 0 does.
    let biased = ((amax.to_bits() >> 23) & 0xFF) as i32;
    let e = if biased == 0 { -127 } else { biased - 127 - 8 };
    (e.clamp(-127, 127) + 127) as u8
}

/// The value of the E8M0 byte `b`: 2^(b - 127), NaN for [`E8M0_NAN`].
pub fn e8m0_to_f32(b: u8) -> f32 {
    match b {
        E8M0_NAN => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        _ => pow2(b as i32 - 127),
    }
}

/// `x`, a tensor's elements from a block boundary, as MXFP8: each block's scale into `scales`
/// and its elements `f32_to_e4m3(x * 2^-e)` into `codes` (the product exact: a power of two
/// scales it, and what it would round below f32's normals is below E4M3's half-smallest).
///
/// # Panics
/// If `codes` is not as long as `x`, or `scales` does not hold one byte per block.
pub fn quantise_mx(x: &[f32], codes: &mut [u8], scales: &mut [u8]) {
    assert_eq!(codes.len(), x.len(), "one code per element");
    assert_eq!(scales.len(), x.len().div_ceil(MX_BLOCK), "one scale per block");
    for ((block, out), s) in x.chunks(MX_BLOCK).zip(codes.chunks_mut(MX_BLOCK)).zip(scales) {
        *s = mx_scale(amax(block));
        // The scale's exponent is at most 119 (f32's amax is below 2^128), so 2^-e is a normal.
        let inverse = pow2(127 - *s as i32);
        for (c, &v) in out.iter_mut().zip(block) {
            *c = f32_to_e4m3(v * inverse);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for c in 0..=255u8 {
            let v = e4m3_to_f32(c);
            if v.is_nan() {
                assert_eq!(c & 0x7F, 0x7F);
            } else {
                assert_eq!(f32_to_e4m3(v), c, "code {c:#04x} = {v}");
            }
        }
    }

    #[test]
    fn scales_of_the_e8m0_range() {
        assert_eq!(mx_scale(0.0), 0);
        assert_eq!(mx_scale(f32::MAX), 127 + 127 - 8);
        assert_eq!(mx_scale(1.0), 127 - 8);
        assert_eq!(mx_scale(448.0), 127);
        assert_eq!(mx_scale(f32::NAN), E8M0_NAN);
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert!(e8m0_to_f32(E8M0_NAN).is_nan());
    }
}
