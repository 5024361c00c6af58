//! AVX-512F kernels, 16 f32 lanes per vector. Each loop peels a scalar head so stores are 64-byte
//! aligned, runs four vectors per iteration, then one, and leaves the last few elements to the
//! scalar kernel, which computes the same bits; the fused pass may visit its vectors backward
//! (`alias`). No software prefetch: the hardware prefetchers keep up with these sequential streams
//! (see `docs/kernels.md`).
//!
//! The functions are safe to call only where the CPU has AVX-512F, AVX2 and F16C: the caller
//! checks that through `isa`.

use std::arch::x86_64::*;

use super::alias::{accumulate_in_direction, accumulate_loop};
use super::{math, scalar};
use crate::dtype::Grad;

const LANES: usize = 16;
const UNROLL: usize = 4;
/// f32 elements per 64-byte cache line.
const LINE: usize = 16;
const EXPONENT: i32 = 0x7f80_0000;

/// Loads LANES f32s from `p`.
///
/// # Safety
/// `p` must be valid for reading LANES `f32`s, and the CPU must have AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_f32(p: *const f32) -> __m512 {
    // SAFETY: the caller passes `p` valid for LANES reads (see `# Safety`); the load is unaligned.
    unsafe { _mm512_loadu_ps(p) }
}

/// Loads LANES f16 bit patterns from `p`, widened to f32.
///
/// # Safety
/// `p` must be valid for reading LANES `u16`s, and the CPU must have AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_f16(p: *const u16) -> __m512 {
    // SAFETY: the caller passes `p` valid for LANES reads (see `# Safety`); the load is unaligned.
    _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(p.cast()) })
}

/// Loads LANES bf16 bit patterns from `p`, widened to f32.
///
/// # Safety
/// `p` must be valid for reading LANES `u16`s, and the CPU must have AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_bf16(p: *const u16) -> __m512 {
    // SAFETY: the caller passes `p` valid for LANES reads (see `# Safety`); the load is unaligned.
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(unsafe {
        _mm256_loadu_si256(p.cast())
    })))
}

/// One vector of the fused pass. `seen` keeps the largest exponent field written per lane: it
/// reaches all ones exactly when some written value is infinite or NaN.
///
/// # Safety
/// `m` must be valid for reading and writing LANES f32s, and the CPU must have AVX-512F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn step<const ASSIGN: bool>(m: *mut f32, g: __m512, factor: __m512, seen: &mut __m512i) {
    let v = _mm512_mul_ps(g, factor);
    // SAFETY: the caller passes `m` valid for LANES reads (see `# Safety`); the load is unaligned.
    let r = if ASSIGN { v } else { _mm512_add_ps(unsafe { _mm512_loadu_ps(m) }, v) };
    // SAFETY: `m` is also valid for LANES writes; the store is unaligned.
    unsafe { _mm512_storeu_ps(m, r) };
    *seen = _mm512_max_epu32(
        *seen,
        _mm512_and_si512(_mm512_castps_si512(r), _mm512_set1_epi32(EXPONENT)),
    );
}

/// `x` in every lane.
#[inline]
#[target_feature(enable = "avx512f")]
fn splat(x: f32) -> __m512 {
    _mm512_set1_ps(x)
}

/// The `seen` of `step` before any value.
#[inline]
#[target_feature(enable = "avx512f")]
fn nothing_seen() -> __m512i {
    _mm512_setzero_si512()
}

/// Whether `seen` (see `step`) holds the exponent of an infinite or NaN value.
#[inline]
#[target_feature(enable = "avx512f")]
fn seen_non_finite(seen: __m512i) -> bool {
    _mm512_cmpeq_epi32_mask(seen, _mm512_set1_epi32(EXPONENT)) != 0
}

accumulate_loop!("avx512f", 64, accumulate_f32, f32, load_f32, |x| x);
accumulate_loop!("avx512f", 64, accumulate_f16, u16, load_f16, math::f16_to_f32);
accumulate_loop!("avx512f", 64, accumulate_bf16, u16, load_bf16, math::bf16_to_f32);

/// The fused pass, each loop in the direction `alias` picks.
#[target_feature(enable = "avx512f")]
pub(super) fn accumulate(master: &mut [f32], grad: Grad<'_>, factor: f32, assign: bool) -> bool {
    accumulate_in_direction!(master, grad, factor, assign)
}

#[target_feature(enable = "avx512f")]
pub(super) fn scale(buf: &mut [f32], factor: f32) {
    let n = buf.len();
    let head = buf.as_ptr().align_offset(64).min(n);
    scalar::scale(&mut buf[..head], factor);
    let p = buf.as_mut_ptr();
    let f = _mm512_set1_ps(factor);
    let mut i = head;
    while i + LINE <= n {
        for j in (i..i + LINE).step_by(LANES) {
            // SAFETY: j + LANES <= i + LINE <= n (the loop condition), so elements j..j + LANES are
            // in `buf`.
            unsafe { _mm512_storeu_ps(p.add(j), _mm512_mul_ps(_mm512_loadu_ps(p.add(j)), f)) };
        }
        i += LINE;
    }
    scalar::scale(&mut buf[i..], factor);
}

/// Lanes 0..8 of the block's partial sums live in `lo`, lanes 8..16 in `hi` (see
/// `math::NORM_LANES`).
#[target_feature(enable = "avx512f")]
pub(super) fn block_sums(buf: &[f32], out: &mut [f64]) {
    const _: () = assert!(math::NORM_LANES == 2 * 8);
    for (sum, block) in out.iter_mut().zip(buf.chunks(math::NORM_BLOCK)) {
        let full = block.len() / math::NORM_LANES * math::NORM_LANES;
        let p = block.as_ptr();
        let (mut lo, mut hi) = (_mm512_setzero_pd(), _mm512_setzero_pd());
        let mut i = 0;
        while i < full {
            // SAFETY: i < full, a multiple of NORM_LANES (16) no larger than the block, so i..i +
            // 16 is in it.
            let (a, b) = unsafe { (_mm256_loadu_ps(p.add(i)), _mm256_loadu_ps(p.add(i + 8))) };
            let (a, b) = (_mm512_cvtps_pd(a), _mm512_cvtps_pd(b));
            // A fused multiply-add rounds like multiply-then-add here: squares are exact in f64.
            lo = _mm512_fmadd_pd(a, a, lo);
            hi = _mm512_fmadd_pd(b, b, hi);
            i += math::NORM_LANES;
        }
        let mut lanes = [0.0; math::NORM_LANES];
        // SAFETY: `lanes` holds NORM_LANES (16, asserted above) f64s; the stores are unaligned.
        unsafe {
            _mm512_storeu_pd(lanes.as_mut_ptr(), lo);
            _mm512_storeu_pd(lanes.as_mut_ptr().add(8), hi);
        }
        math::add_squares_to_lanes(&mut lanes, &block[full..]);
        *sum = math::combine_lanes(lanes);
    }
}

#[target_feature(enable = "avx512f")]
pub(super) fn add_assign(dst: &mut [f32], src: &[f32]) {
    let n = dst.len().min(src.len());
    let head = dst.as_ptr().align_offset(64).min(n);
    scalar::add_assign(&mut dst[..head], &src[..head]);
    let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
    let mut i = head;
    while i + LINE <= n {
        for j in (i..i + LINE).step_by(LANES) {
            // SAFETY: j + LANES <= i + LINE <= n, the shorter length, so j..j + LANES is in both
            // slices.
            unsafe {
                _mm512_storeu_ps(
                    d.add(j),
                    _mm512_add_ps(_mm512_loadu_ps(d.add(j)), _mm512_loadu_ps(s.add(j))),
                )
            };
        }
        i += LINE;
    }
    scalar::add_assign(&mut dst[i..n], &src[i..n]);
}
