//! Portable kernels over one contiguous part of a buffer: the reference every SIMD path must match
//! bit for bit, the only path off x86-64, and the head and tail handler of the SIMD paths.

use super::math;
use half::slice::HalfFloatSliceExt;

use crate::dtype::Grad;

/// The fused pass with the element decoder as a parameter; `ASSIGN` is a constant so the loop
/// carries no branch.
#[inline]
pub(super) fn accumulate_with<const ASSIGN: bool, E: Copy>(
    master: &mut [f32],
    grad: &[E],
    factor: f32,
    decode: impl Fn(E) -> f32,
) -> bool {
    let mut bad = false;
    for (m, &g) in master.iter_mut().zip(grad) {
        *m = math::accumulate_one(*m, decode(g), factor, ASSIGN);
        bad |= !m.is_finite();
    }
    bad
}

pub(super) fn accumulate(master: &mut [f32], grad: Grad<'_>, factor: f32, assign: bool) -> bool {
    match (grad, assign) {
        (Grad::F32(g), false) => accumulate_with::<false, _>(master, g, factor, |x| x),
        (Grad::F32(g), true) => accumulate_with::<true, _>(master, g, factor, |x| x),
        (Grad::F16(g), false) => {
            accumulate_with::<false, _>(master, g.reinterpret_cast(), factor, math::f16_to_f32)
        }
        (Grad::F16(g), true) => {
            accumulate_with::<true, _>(master, g.reinterpret_cast(), factor, math::f16_to_f32)
        }
        (Grad::Bf16(g), false) => {
            accumulate_with::<false, _>(master, g.reinterpret_cast(), factor, math::bf16_to_f32)
        }
        (Grad::Bf16(g), true) => {
            accumulate_with::<true, _>(master, g.reinterpret_cast(), factor, math::bf16_to_f32)
        }
    }
}

#[inline]
pub(super) fn scale(buf: &mut [f32], factor: f32) {
    for v in buf {
        *v *= factor;
    }
}

/// One sum of squares per `NORM_BLOCK` of `buf` into `out` (which has one slot per block).
pub(super) fn block_sums(buf: &[f32], out: &mut [f64]) {
    for (sum, block) in out.iter_mut().zip(buf.chunks(math::NORM_BLOCK)) {
        *sum = math::block_sum_squares(block);
    }
}

#[inline]
pub(super) fn add_assign(dst: &mut [f32], src: &[f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d += s;
    }
}
