//! Array conversions between f32 and the 16-bit formats, for callers whose language has no 16-bit
//! float type (C, Go): rounding to nearest even on the way down, exact on the way up. The f16
//! ones are `half`'s slice conversions (F16C where the CPU has it); the bf16 rounding is the bf16
//! wire's (`simd::to_bf16_bits`), and the widening a loop the compiler turns into vectors.

use std::ops::Range;

use gradacc::half::f16;
use gradacc::half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use gradacc::error::Error;

use crate::status::{gradacc_status_t, guard, null, CallResult};
use crate::types::read_slice;

/// The byte addresses of `n` values of `T` at `p`.
fn bytes<T>(p: *const T, n: usize) -> Range<usize> {
    p as usize..p as usize + n * std::mem::size_of::<T>()
}

/// Borrows the `n` values at `src` to read and the `n` at `dst` to write, each checked for
/// NULL, alignment and length, and refused if they overlap. With `n` 0 nothing is read or
/// written, so either pointer may be NULL.
///
/// # Safety
/// A non-null `src` must point to `n` readable values and a non-null `dst` to `n` writable
/// ones, nothing else writing them during the call.
unsafe fn arrays<'a, S, D>(
    src: *const S,
    dst: *mut D,
    n: usize,
) -> CallResult<(&'a [S], &'a mut [D])> {
    if n == 0 {
        return Ok((&[], &mut []));
    }
    // SAFETY: read_slice checks NULL, alignment and length; `src` holds `n` readable values (the
    // caller's contract).
    let from = unsafe { read_slice(src, n, "src", "n") }?;
    if dst.is_null() {
        return Err(null("dst"));
    }
    // SAFETY: as above, for `dst` read as its own type (checked only, not read).
    unsafe { read_slice(dst.cast_const(), n, "dst", "n") }?;
    let (s, d) = (bytes(src, n), bytes(dst.cast_const(), n));
    if s.start < d.end && d.start < s.end {
        return Err(Error::invalid(format!(
            "`src` = {src:p} and `dst` = {dst:p} overlap: {n} values need {} and {} bytes",
            s.len(),
            d.len()
        ))
        .into());
    }
    // SAFETY: non-null, aligned and at most isize::MAX bytes (checked above), apart from `src`
    // (checked above), and writable for `n` values and unshared by the caller's contract.
    Ok((from, unsafe { std::slice::from_raw_parts_mut(dst, n) }))
}

/// `dst[i]` = the f32 value of the bfloat16 bits `src[i]`: baseline x86-64 vectors already keep
/// up with memory here (AVX2 measured no faster).
fn from_bf16(src: &[u16], dst: &mut [f32]) {
    dst.iter_mut().zip(src).for_each(|(d, &s)| *d = f32::from_bits((s as u32) << 16));
}

/// Converts the `n` f32 values at `src` to IEEE binary16 bits at `dst`, rounding to nearest
/// even: a value past the largest finite f16 (65504) rounds to infinity from 65520 up, a value
/// below the smallest subnormal (2^-24) to a signed zero from 2^-25 down; a NaN stays NaN, quiet,
/// with the upper bits of its payload. Uses F16C where the CPU has it (the same bits without).
///
/// `src` and `dst` must not overlap. With `n` 0 nothing is read or written and either pointer may
/// be NULL; otherwise a NULL one fails with GRADACC_STATUS_NULL_ARGUMENT, and a pointer not
/// aligned to its element or an `n` past the address space with GRADACC_STATUS_INVALID_ARGUMENT,
/// writing nothing.
///
/// Thread safety: any thread, at any time; it touches only `src` and `dst`.
#[no_mangle]
pub unsafe extern "C" fn gradacc_f32_to_f16(
    src: *const f32,
    dst: *mut u16,
    n: usize,
) -> gradacc_status_t {
    guard("gradacc_f32_to_f16", || {
        // SAFETY: `src` holds `n` readable and `dst` `n` writable values (API contract); checked.
        let (src, dst) = unsafe { arrays(src, dst, n) }?;
        dst.reinterpret_cast_mut::<f16>().convert_from_f32_slice(src);
        Ok(())
    })
}

/// Converts the `n` IEEE binary16 bit patterns at `src` to f32 values at `dst`, exactly (every
/// f16 value is an f32 value, subnormals included); a NaN stays NaN with its payload, and a
/// signalling one comes back quiet, as F16C's conversion gives it (the same bits without F16C).
///
/// Arguments and failures as gradacc_f32_to_f16's.
///
/// Thread safety: any thread, at any time; it touches only `src` and `dst`.
#[no_mangle]
pub unsafe extern "C" fn gradacc_f16_to_f32(
    src: *const u16,
    dst: *mut f32,
    n: usize,
) -> gradacc_status_t {
    guard("gradacc_f16_to_f32", || {
        // SAFETY: `src` holds `n` readable and `dst` `n` writable values (API contract); checked.
        let (src, dst) = unsafe { arrays(src, dst, n) }?;
        src.reinterpret_cast::<f16>().convert_to_f32_slice(dst);
        Ok(())
    })
}

/// Converts the `n` f32 values at `src` to bfloat16 bits at `dst`, rounding to nearest even (a
/// value past the largest finite bf16 rounds to infinity); a NaN stays NaN, quiet, with the upper
/// bits of its payload. These are the bits a bf16 gradient of gradacc holds and its bf16 wire
/// rounds to.
///
/// Arguments and failures as gradacc_f32_to_f16's.
///
/// Thread safety: any thread, at any time; it touches only `src` and `dst`.
#[no_mangle]
pub unsafe extern "C" fn gradacc_f32_to_bf16(
    src: *const f32,
    dst: *mut u16,
    n: usize,
) -> gradacc_status_t {
    guard("gradacc_f32_to_bf16", || {
        // SAFETY: `src` holds `n` readable and `dst` `n` writable values (API contract); checked.
        let (src, dst) = unsafe { arrays(src, dst, n) }?;
        gradacc::simd::to_bf16_bits(src, dst);
        Ok(())
    })
}

/// Converts the `n` bfloat16 bit patterns at `src` to f32 values at `dst`, exactly: each pattern
/// becomes the upper half of an f32, a NaN's payload as it is (a signalling one stays
/// signalling), as gradacc reads a bf16 gradient.
///
/// Arguments and failures as gradacc_f32_to_f16's.
///
/// Thread safety: any thread, at any time; it touches only `src` and `dst`.
#[no_mangle]
pub unsafe extern "C" fn gradacc_bf16_to_f32(
    src: *const u16,
    dst: *mut f32,
    n: usize,
) -> gradacc_status_t {
    guard("gradacc_bf16_to_f32", || {
        // SAFETY: `src` holds `n` readable and `dst` `n` writable values (API contract); checked.
        let (src, dst) = unsafe { arrays(src, dst, n) }?;
        from_bf16(src, dst);
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{gradacc_last_error, GRADACC_STATUS_NULL_ARGUMENT, GRADACC_STATUS_OK};
    use gradacc::half::bf16;

    fn last_error() -> String {
        // SAFETY: gradacc_last_error returns a valid C string owned by this thread.
        unsafe { std::ffi::CStr::from_ptr(gradacc_last_error()) }.to_string_lossy().into_owned()
    }

    /// f32 bit patterns every 65,521 over all of them, and for every 7th upper half the low halves
    /// at the two formats' ties and their neighbours (f16 at 0x1000, bf16 at 0x8000).
    fn values() -> Vec<f32> {
        let mut v: Vec<f32> = (0..=u32::MAX).step_by(65_521).map(f32::from_bits).collect();
        for hi in (0..=0xffffu32).step_by(7) {
            for lo in [0x0fff, 0x1000, 0x1001, 0x7fff, 0x8000, 0x8001, 0xffff] {
                v.push(f32::from_bits(hi << 16 | lo));
            }
        }
        v
    }

    #[test]
    fn the_rounding_is_halfs_bit_for_bit() {
        let src = values();
        let mut got = vec![0u16; src.len()];
        // SAFETY: both arrays hold `src.len()` values.
        let s = unsafe { gradacc_f32_to_bf16(src.as_ptr(), got.as_mut_ptr(), src.len()) };
        assert_eq!(s, GRADACC_STATUS_OK);
        for (&x, &g) in src.iter().zip(&got) {
            assert_eq!(g, bf16::from_f32(x).to_bits(), "bf16 of {:#010x}", x.to_bits());
        }
        // SAFETY: as above.
        let s = unsafe { gradacc_f32_to_f16(src.as_ptr(), got.as_mut_ptr(), src.len()) };
        assert_eq!(s, GRADACC_STATUS_OK);
        for (&x, &g) in src.iter().zip(&got) {
            assert_eq!(g, f16::from_f32_const(x).to_bits(), "f16 of {:#010x}", x.to_bits());
        }
    }

    #[test]
    fn widening_is_exact_on_every_pattern() {
        let bits: Vec<u16> = (0..=0xffff).collect();
        let mut got = vec![0f32; bits.len()];
        // SAFETY: both arrays hold 65536 values.
        let s = unsafe { gradacc_bf16_to_f32(bits.as_ptr(), got.as_mut_ptr(), bits.len()) };
        assert_eq!(s, GRADACC_STATUS_OK);
        assert!(bits.iter().zip(&got).all(|(&b, g)| g.to_bits() == (b as u32) << 16));
        // SAFETY: as above.
        let s = unsafe { gradacc_f16_to_f32(bits.as_ptr(), got.as_mut_ptr(), bits.len()) };
        assert_eq!(s, GRADACC_STATUS_OK);
        for (&b, g) in bits.iter().zip(&got) {
            let exact = gradacc::math::f16_to_f32(b);
            let quiet =
                if exact.is_nan() { exact.to_bits() | 0x0040_0000 } else { exact.to_bits() };
            assert_eq!(g.to_bits(), quiet, "f16 {b:#06x}");
        }
    }

    #[test]
    fn bad_arrays_are_refused_naming_the_argument() {
        // Sentinels any conversion would change: 0x1111 is no f16 or bf16 of 1.0.
        let (src, mut dst) = ([1.0f32; 4], [0x1111u16; 4]);
        // SAFETY: n = 0 reads and writes nothing.
        let s = unsafe { gradacc_f32_to_f16(std::ptr::null(), std::ptr::null_mut(), 0) };
        assert_eq!(s, GRADACC_STATUS_OK);
        // SAFETY: a NULL `src` is refused before anything is read.
        let s = unsafe { gradacc_f32_to_bf16(std::ptr::null(), dst.as_mut_ptr(), 4) };
        assert_eq!(
            (s, last_error()),
            (GRADACC_STATUS_NULL_ARGUMENT, "gradacc_f32_to_bf16: argument `src` is NULL".into())
        );
        // SAFETY: a NULL `dst` is refused before anything is read.
        let s = unsafe { gradacc_f32_to_f16(src.as_ptr(), std::ptr::null_mut(), 4) };
        assert_eq!(
            (s, last_error()),
            (GRADACC_STATUS_NULL_ARGUMENT, "gradacc_f32_to_f16: argument `dst` is NULL".into())
        );
        assert_eq!(dst, [0x1111; 4], "a refused call wrote dst");
        // bf16 0x3f80 widens to 1.0 (0x3f80_0000): a write through the overlap would change it.
        let mut both = [0x3f80u16; 8];
        // SAFETY: overlapping arrays are refused before anything is read.
        let s = unsafe { gradacc_bf16_to_f32(both.as_ptr(), both.as_mut_ptr().cast(), 4) };
        assert_eq!(s, crate::status::GRADACC_STATUS_INVALID_ARGUMENT);
        let message = last_error();
        assert!(
            message.contains("`src`") && message.contains("`dst`") && message.contains("overlap"),
            "{message}"
        );
        assert_eq!(both, [0x3f80; 8], "a refused call wrote through the overlap");
    }
}
