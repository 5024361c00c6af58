//! AVX2 + F16C kernels, 8 f32 lanes per vector: the same loops as `avx512`, at half the width.
//!
//! The functions are safe to call only where the CPU has AVX2 and F16C: the caller checks that
//! through `isa`.

use std::arch::x86_64::*;

use super::alias::{accumulate_in_direction, accumulate_loop};
use super::{math, scalar};
use crate::dtype::Grad;

const LANES: usize = 8;
const UNROLL: usize = 4;
/// f32 elements per 64-byte cache line.
const LINE: usize = 16;
const EXPONENT: i32 = 0x7f80_0000;

/// Loads LANES f32s from `p`.
///
/// # Safety
/// `p` must be valid for reading LANES `f32`s, and the CPU must have AVX2 and F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load_f32(p: *const f32) -> __m256 {
    // SAFETY: the caller passes `p` valid for LANES reads (see `# Safety`); the load is unaligned.
    unsafe { _mm256_loadu_ps(p) }
}

/// Loads LANES f16 bit patterns from `p`, widened to f32.
///
/// # Safety
/// `p` must be valid for reading LANES `u16`s, and the CPU must have AVX2 and F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load_f16(p: *const u16) -> __m256 {
    // SAFETY: the caller passes `p` valid for LANES reads (see `# Safety`); the load is unaligned.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
}

/// Loads LANES bf16 bit patterns from `p`, widened to f32.
///
/// # Safety
/// `p` must be valid for reading LANES `u16`s, and the CPU must have AVX2 and F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn load_bf16(p: *const u16) -> __m256 {
    // SAFETY: the caller passes `p` valid for LANES reads (see `# Safety`); the load is unaligned.
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(unsafe {
        _mm_loadu_si128(p.cast())
    })))
}

/// One vector of the fused pass. `seen` keeps the largest exponent field written per lane: it
/// reaches all ones exactly when some written value is infinite or NaN.
///
/// # Safety
/// `m` must be valid for reading and writing LANES f32s, and the CPU must have AVX2 and F16C.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn step<const ASSIGN: bool>(m: *mut f32, g: __m256, factor: __m256, seen: &mut __m256i) {
    let v = _mm256_mul_ps(g, factor);
    // SAFETY: the caller passes `m` valid for LANES reads (see `# Safety`); the load is unaligned.
    let r = if ASSIGN { v } else { _mm256_add_ps(unsafe { _mm256_loadu_ps(m) }, v) };
    // SAFETY: `m` is also valid for LANES writes; the store is unaligned.
    unsafe { _mm256_storeu_ps(m, r) };
    *seen = _mm256_max_epu32(
        *seen,
        _mm256_and_si256(_mm256_castps_si256(r), _mm256_set1_epi32(EXPONENT)),
    );
}

/// `x` in every lane.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn splat(x: f32) -> __m256 {
    _mm256_set1_ps(x)
}

/// The `seen` of `step` before any value.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn nothing_seen() -> __m256i {
    _mm256_setzero_si256()
}

/// Whether `seen` (see `step`) holds the exponent of an infinite or NaN value.
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn seen_non_finite(seen: __m256i) -> bool {
    _mm256_movemask_epi8(_mm256_cmpeq_epi32(seen, _mm256_set1_epi32(EXPONENT))) != 0
}

accumulate_loop!("avx2,f16c", 32, accumulate_f32, f32, load_f32, |x| x);
accumulate_loop!("avx2,f16c", 32, accumulate_f16, u16, load_f16, math::f16_to_f32);
accumulate_loop!("avx2,f16c", 32, accumulate_bf16, u16, load_bf16, math::bf16_to_f32);

/// The fused pass, each loop in the direction `alias` picks.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn accumulate(master: &mut [f32], grad: Grad<'_>, factor: f32, assign: bool) -> bool {
    accumulate_in_direction!(master, grad, factor, assign)
}

#[target_feature(enable = "avx2,f16c")]
pub(super) fn scale(buf: &mut [f32], factor: f32) {
    let n = buf.len();
    let head = buf.as_ptr().align_offset(32).min(n);
    scalar::scale(&mut buf[..head], factor);
    let p = buf.as_mut_ptr();
    let f = _mm256_set1_ps(factor);
    let mut i = head;
    while i + LINE <= n {
        for j in (i..i + LINE).step_by(LANES) {
            // SAFETY: j + LANES <= i + LINE <= n (the loop condition), so elements j..j + LANES are
            // in `buf`.
            unsafe { _mm256_storeu_ps(p.add(j), _mm256_mul_ps(_mm256_loadu_ps(p.add(j)), f)) };
        }
        i += LINE;
    }
    scalar::scale(&mut buf[i..], factor);
}

/// The block's partial sums live in four vectors, lanes 4k..4k + 4 in `acc[k]` (see
/// `math::NORM_LANES`).
#[target_feature(enable = "avx2,f16c")]
pub(super) fn block_sums(buf: &[f32], out: &mut [f64]) {
    const _: () = assert!(math::NORM_LANES == 4 * 4);
    for (sum, block) in out.iter_mut().zip(buf.chunks(math::NORM_BLOCK)) {
        let full = block.len() / math::NORM_LANES * math::NORM_LANES;
        let p = block.as_ptr();
        let mut acc = [_mm256_setzero_pd(); 4];
        let mut i = 0;
        while i < full {
            for (k, a) in acc.iter_mut().enumerate() {
                // SAFETY: i < full, a multiple of NORM_LANES (16) no larger than the block, so i..i
                // + 16 is in it.
                let x = _mm256_cvtps_pd(unsafe { _mm_loadu_ps(p.add(i + 4 * k)) });
                *a = _mm256_add_pd(*a, _mm256_mul_pd(x, x));
            }
            i += math::NORM_LANES;
        }
        let mut lanes = [0.0; math::NORM_LANES];
        for (k, a) in acc.iter().enumerate() {
            // SAFETY: `lanes` holds NORM_LANES (16, asserted above) f64s; the stores are unaligned.
            unsafe { _mm256_storeu_pd(lanes.as_mut_ptr().add(4 * k), *a) };
        }
        math::add_squares_to_lanes(&mut lanes, &block[full..]);
        *sum = math::combine_lanes(lanes);
    }
}

#[target_feature(enable = "avx2,f16c")]
pub(super) fn add_assign(dst: &mut [f32], src: &[f32]) {
    let n = dst.len().min(src.len());
    let head = dst.as_ptr().align_offset(32).min(n);
    scalar::add_assign(&mut dst[..head], &src[..head]);
    let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
    let mut i = head;
    while i + LINE <= n {
        for j in (i..i + LINE).step_by(LANES) {
            // SAFETY: j + LANES <= i + LINE <= n, the shorter length, so j..j + LANES is in both
            // slices.
            unsafe {
                _mm256_storeu_ps(
                    d.add(j),
                    _mm256_add_ps(_mm256_loadu_ps(d.add(j)), _mm256_loadu_ps(s.add(j))),
                )
            };
        }
        i += LINE;
    }
    scalar::add_assign(&mut dst[i..n], &src[i..n]);
}

/// `dst[i] += src[i]`, the sum of squares of each `NORM_BLOCK` of the result into `out`, then
/// `dst[i] *= factor` with `SCALE`, all in one sweep: the bits of `add_assign`, `block_sums` and
/// `scale` run in turn, with one load and one store per element where those three make three each.
///
/// Unlike the other loops it prefetches both streams `AHEAD` bytes ahead: the serial f64 sums
/// keep so many instructions in flight that the core stops running ahead of the hardware
/// prefetchers (see `docs/kernels.md`; `cargo bench --bench add`, the `boundary sweep` row).
#[target_feature(enable = "avx2,f16c")]
pub(super) fn add_and_block_sums<const SCALE: bool>(
    dst: &mut [f32],
    src: &[f32],
    factor: f32,
    out: &mut [f64],
) {
    const _: () = assert!(math::NORM_LANES == 2 * LANES);
    const AHEAD: usize = 1024;
    let f = _mm256_set1_ps(factor);
    for ((block, add), sum) in
        dst.chunks_mut(math::NORM_BLOCK).zip(src.chunks(math::NORM_BLOCK)).zip(out.iter_mut())
    {
        let n = block.len().min(add.len());
        let full = n / math::NORM_LANES * math::NORM_LANES;
        let (d, s) = (block.as_mut_ptr(), add.as_ptr());
        // Lanes 4k..4k + 4 in `acc[k]`, as in `block_sums`: the low and high halves of each vector.
        let mut acc = [_mm256_setzero_pd(); 4];
        let mut i = 0;
        while i < full {
            // A prefetch never faults, so the addresses may run past the slices.
            _mm_prefetch::<_MM_HINT_T0>(d.cast::<i8>().wrapping_add(4 * i + AHEAD));
            _mm_prefetch::<_MM_HINT_T0>(s.cast::<i8>().wrapping_add(4 * i + AHEAD));
            for (h, pair) in acc.chunks_exact_mut(2).enumerate() {
                let j = i + h * LANES;
                // SAFETY: j + LANES <= i + NORM_LANES <= full <= n, the shorter length, so j..j +
                // LANES is in both slices.
                let v =
                    unsafe { _mm256_add_ps(_mm256_loadu_ps(d.add(j)), _mm256_loadu_ps(s.add(j))) };
                let lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
                let hi = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v));
                pair[0] = _mm256_add_pd(pair[0], _mm256_mul_pd(lo, lo));
                pair[1] = _mm256_add_pd(pair[1], _mm256_mul_pd(hi, hi));
                let v = if SCALE { _mm256_mul_ps(v, f) } else { v };
                // SAFETY: as for the loads.
                unsafe { _mm256_storeu_ps(d.add(j), v) };
            }
            i += math::NORM_LANES;
        }
        let tail = &mut block[full..n];
        scalar::add_assign(tail, &add[full..n]);
        let mut lanes = [0.0; math::NORM_LANES];
        for (k, a) in acc.iter().enumerate() {
            // SAFETY: `lanes` holds NORM_LANES (16, asserted above) f64s; the stores are unaligned.
            unsafe { _mm256_storeu_pd(lanes.as_mut_ptr().add(4 * k), *a) };
        }
        math::add_squares_to_lanes(&mut lanes, tail);
        *sum = math::combine_lanes(lanes);
        if SCALE {
            scalar::scale(tail, factor);
        }
    }
}

/// `dst = src`, the 32-byte-aligned part with stores that bypass the cache, then a store fence.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn copy_streaming(dst: &mut [f32], src: &[f32]) {
    let n = dst.len().min(src.len());
    let head = dst.as_ptr().align_offset(32).min(n);
    dst[..head].copy_from_slice(&src[..head]);
    let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
    let mut i = head;
    while i + LANES <= n {
        // SAFETY: i + LANES <= n, so i..i + LANES is in both slices; d + i is 32-byte aligned
        // (head aligned it, and LANES f32s are 32 bytes).
        unsafe { _mm256_stream_ps(d.add(i), _mm256_loadu_ps(s.add(i))) };
        i += LANES;
    }
    dst[i..n].copy_from_slice(&src[i..n]);
    _mm_sfence();
}
