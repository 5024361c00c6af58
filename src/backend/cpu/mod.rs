//! CPU kernels: the fused unscale-check-accumulate pass and the boundary passes over FP32 masters.
//! Public entry points pick the widest SIMD path the CPU has at run time (see [`isa`]) and split
//! large buffers over threads; every path computes the same per-element arithmetic, so results are
//! bitwise identical for any ISA and any thread count.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod isa;
pub mod math;
mod scalar;

pub use isa::{active_isa, supported_isas, with_isa, Isa};

use crate::dtype::Grad;

/// Fewest elements worth a thread of their own: a scoped thread costs tens of microseconds to
/// start, about what one core needs to stream a quarter million elements.
pub const MIN_ELEMENTS_PER_THREAD: usize = 256 * 1024;

/// How far ahead of the current element (in bytes of the buffer being read) the SIMD loops
/// prefetch, into L2. A core keeps only as many cache-line misses in flight as its out-of-order
/// window reaches: from DRAM that made the fused pass take 1.10-1.15 times as long as a plain
/// `dst += widen(src)` loop, and the sum of squares 1.55-2 times as long as a plain f32 sum. A
/// prefetch retires at once and lets the misses run further ahead. 4 KiB into L2 measured best
/// among 1-8 KiB into L1 or L2 on a Xeon (see docs/kernels.md).
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 4096;

/// Prefetches the cache line `PREFETCH_BYTES` past element `i` of `p`. A hint: it never faults,
/// and `wrapping_add` keeps the address arithmetic defined past the end of the buffer.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch<T>(p: *const T, i: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    let ahead = p.wrapping_add(i).cast::<i8>().wrapping_add(PREFETCH_BYTES);
    // SAFETY: prefetching reads nothing architecturally and cannot fault, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T1>(ahead) }
}

// Thread parts start at multiples of NORM_BLOCK, so every sum-of-squares block lies in one part;
// being multiples of 64 elements also keeps each part's start aligned like the buffer's start.
const _: () = assert!(math::NORM_BLOCK.is_multiple_of(64) && math::NORM_BLOCK.is_multiple_of(math::NORM_LANES));

/// Fused pass for one tensor of one micro-batch:
/// `master[i] = (assign ? 0 : master[i]) + to_f32(grad[i]) * factor` (a rounded multiply, then a
/// rounded add: never a fused multiply-add). Returns `true` if any written value is not finite.
///
/// `factor` is `weight / scale`, computed once by [`math::unscale_factor`]. `threads <= 1` runs on
/// the calling thread only; buffers shorter than `threads * MIN_ELEMENTS_PER_THREAD` use fewer.
pub fn accumulate(master: &mut [f32], grad: Grad<'_>, factor: f32, assign: bool, threads: usize) -> bool {
    assert_eq!(master.len(), grad.len(), "master and gradient lengths differ");
    let isa = active_isa();
    // The common case of a model's many small tensors goes straight to the kernel: planning parts
    // costs a division and a closure per call, which showed over a thousand tiny tensors.
    if threads <= 1 || grad.len() < 2 * MIN_ELEMENTS_PER_THREAD {
        return accumulate_part(isa, master, grad, factor, assign);
    }
    run_parts(master, part_ends(grad.len(), threads), |start, m| {
        accumulate_part(isa, m, grad.slice(start, start + m.len()), factor, assign)
    })
}

/// `buf[i] *= factor` (the boundary's normalise-and-clip pass).
pub fn scale(buf: &mut [f32], factor: f32, threads: usize) {
    let isa = active_isa();
    run_parts(buf, part_ends(buf.len(), threads), |_, part| {
        scale_part(isa, part, factor);
        false
    });
}

/// Sum of squares in f64. Each block of [`math::NORM_BLOCK`] elements is summed by
/// [`math::block_sum_squares`] and the block sums are added in block order, starting from `0.0`,
/// so the result does not depend on the thread count or the SIMD path.
pub fn sum_squares(buf: &[f32], threads: usize) -> f64 {
    let isa = active_isa();
    let mut sums = vec![0.0; buf.len().div_ceil(math::NORM_BLOCK)];
    run_parts(&mut sums, part_block_ends(buf.len(), threads), |first_block, out| {
        let start = first_block * math::NORM_BLOCK;
        let end = (start + out.len() * math::NORM_BLOCK).min(buf.len());
        block_sums_part(isa, &buf[start..end], out);
        false
    });
    sums.iter().fold(0.0, |total, &block| total + block)
}

/// [`sum_squares`] of `buf` as it is on entry, and `buf[i] *= factor`, in one pass over memory:
/// each block is summed and then scaled while it is still in L1. Same bits as calling
/// `sum_squares` and then `scale`. The boundary uses it to normalise and measure at once.
pub fn scale_and_sum_squares(buf: &mut [f32], factor: f32, threads: usize) -> f64 {
    let isa = active_isa();
    let len = buf.len();
    let mut sums = vec![0.0; len.div_ceil(math::NORM_BLOCK)];
    let ends: Vec<usize> = part_ends(len, threads).collect();
    // Cut the block sums at the same places as the buffer, then run each pair of parts together.
    let mut parts: Vec<(&mut [f32], &mut [f64])> = Vec::with_capacity(ends.len());
    let (mut rest, mut rest_sums, mut start) = (buf, sums.as_mut_slice(), 0);
    for &end in &ends {
        let (part, tail) = std::mem::take(&mut rest).split_at_mut(end - start);
        let (part_sums, tail_sums) = std::mem::take(&mut rest_sums).split_at_mut((end - start).div_ceil(math::NORM_BLOCK));
        parts.push((part, part_sums));
        (rest, rest_sums, start) = (tail, tail_sums, end);
    }
    run_parts(&mut parts, 1..=ends.len(), |_, group| {
        for (part, out) in group.iter_mut() {
            for (block, sum) in part.chunks_mut(math::NORM_BLOCK).zip(out.iter_mut()) {
                block_sums_part(isa, block, std::slice::from_mut(sum));
                scale_part(isa, block, factor);
            }
        }
        false
    });
    sums.iter().fold(0.0, |total, &block| total + block)
}

/// `dst[i] += src[i]`, the reduction step of the in-process communicator.
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len());
    match active_isa() {
        // SAFETY: `active_isa` only returns paths the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::add_assign(dst, src) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::add_assign(dst, src) },
        _ => scalar::add_assign(dst, src),
    }
}

fn accumulate_part(isa: Isa, master: &mut [f32], grad: Grad<'_>, factor: f32, assign: bool) -> bool {
    match isa {
        // SAFETY: `isa` comes from `active_isa`, which only returns paths the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::accumulate(master, grad, factor, assign) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::accumulate(master, grad, factor, assign) },
        _ => scalar::accumulate(master, grad, factor, assign),
    }
}

fn scale_part(isa: Isa, buf: &mut [f32], factor: f32) {
    match isa {
        // SAFETY: as in `accumulate_part`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::scale(buf, factor) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::scale(buf, factor) },
        _ => scalar::scale(buf, factor),
    }
}

fn block_sums_part(isa: Isa, buf: &[f32], out: &mut [f64]) {
    match isa {
        // SAFETY: as in `accumulate_part`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::block_sums(buf, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::block_sums(buf, out) },
        _ => scalar::block_sums(buf, out),
    }
}

/// Where the parts for `threads` threads end, counted in `NORM_BLOCK`s: part `k` covers the
/// blocks from the previous end to its own. Small buffers get fewer parts, at least one.
fn part_block_ends(len: usize, threads: usize) -> impl Iterator<Item = usize> {
    let parts = threads.min(len / MIN_ELEMENTS_PER_THREAD).max(1);
    let blocks = len.div_ceil(math::NORM_BLOCK);
    (1..=parts).map(move |k| blocks * k / parts)
}

/// Element parts of a buffer of `len` elements: ends at whole blocks, the last at `len`.
fn part_ends(len: usize, threads: usize) -> impl Iterator<Item = usize> {
    part_block_ends(len, threads).map(move |block| (block * math::NORM_BLOCK).min(len))
}

/// Cuts `buf` at `ends` (increasing, the last one `buf.len()`) and runs `work(first_index, part)`
/// on every part: the first on the calling thread, the others on scoped threads. Returns whether
/// any call returned `true`. A single part runs directly, with no thread and no allocation.
fn run_parts<T: Send>(
    buf: &mut [T],
    ends: impl Iterator<Item = usize>,
    work: impl Fn(usize, &mut [T]) -> bool + Sync,
) -> bool {
    let mut ends = ends.peekable();
    let first_end = ends.next().unwrap_or(buf.len());
    if ends.peek().is_none() {
        return work(0, buf);
    }
    let (first, mut rest) = buf.split_at_mut(first_end);
    let mut start = first_end;
    let work = &work;
    std::thread::scope(|scope| {
        let handles: Vec<_> = ends
            .map(|end| {
                let (part, tail) = std::mem::take(&mut rest).split_at_mut(end - start);
                let part_start = std::mem::replace(&mut start, end);
                rest = tail;
                scope.spawn(move || work(part_start, part))
            })
            .collect();
        let mut any = work(0, first);
        for handle in handles {
            any |= handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        }
        any
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_whole_blocks_covering_the_buffer() {
        let block = math::NORM_BLOCK;
        for len in [0, 1, block, 2 * MIN_ELEMENTS_PER_THREAD - 1, 2 * MIN_ELEMENTS_PER_THREAD, 10_000_019] {
            for threads in [0, 1, 2, 3, 7, 64] {
                let ends: Vec<usize> = part_ends(len, threads).collect();
                assert_eq!(ends.last(), Some(&len));
                assert!(ends.len() <= threads.max(1) && ends.len() <= (len / MIN_ELEMENTS_PER_THREAD).max(1));
                let mut start = 0usize;
                for &end in &ends {
                    assert!(
                        start.is_multiple_of(block) && end > start || len == 0,
                        "len {len} threads {threads}: {ends:?}"
                    );
                    start = end;
                }
                let block_ends: Vec<usize> = part_block_ends(len, threads).collect();
                assert_eq!(block_ends.last(), Some(&len.div_ceil(block)));
            }
        }
    }

    #[test]
    fn run_parts_visits_every_part_once_and_ors_the_results() {
        let mut buf = vec![0u32; 3 * MIN_ELEMENTS_PER_THREAD + 5];
        let len = buf.len();
        let flagged = run_parts(&mut buf, part_ends(len, 3), |start, part| {
            for (i, v) in part.iter_mut().enumerate() {
                *v += (start + i) as u32;
            }
            start > 0
        });
        assert!(flagged);
        assert!(buf.iter().enumerate().all(|(i, &v)| v == i as u32));
        assert!(!run_parts(&mut buf, part_ends(len, 1), |_, _| false));
    }
}
