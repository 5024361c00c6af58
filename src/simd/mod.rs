//! The host's SIMD kernels: the fused unscale-check-accumulate pass and the passes over FP32
//! buffers that the CPU store and the host transports share (scale, sums of squares by block,
//! bf16 rounding, adds between ranks' buffers). Public entry points pick the widest SIMD path the
//! CPU has at run time (see `isa`) and split large buffers over threads; every path computes the
//! same per-element arithmetic, so results are bitwise identical for any ISA and any thread count.

#[cfg(target_arch = "x86_64")]
mod alias;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub(crate) mod check;
mod isa;
mod scalar;

pub use isa::{active_isa, stream_to_peers, supported_isas, with_isa, Isa};

use crate::dtype::Grad;
use crate::math;

/// Fewest elements worth a thread of their own: a scoped thread costs tens of microseconds to
/// start, about what one core needs to stream a quarter million elements.
pub const MIN_ELEMENTS_PER_THREAD: usize = 256 * 1024;

// Thread parts start at multiples of NORM_BLOCK, so every sum-of-squares block lies in one part;
// being multiples of 64 elements also keeps each part's start aligned like the buffer's start.
const _: () = assert!(
    math::NORM_BLOCK.is_multiple_of(64) && math::NORM_BLOCK.is_multiple_of(math::NORM_LANES)
);

/// Fused pass for one tensor of one micro-batch:
/// `master[i] = (assign ? 0 : master[i]) + to_f32(grad[i]) * factor` (a rounded multiply, then a
/// rounded add: never a fused multiply-add). Returns `true` if any written value is not finite.
///
/// `factor` is `weight / scale`, computed once by [`math::unscale_factor`]. `threads <= 1` runs on
/// the calling thread only; buffers shorter than `threads * MIN_ELEMENTS_PER_THREAD` use fewer.
pub fn accumulate(
    master: &mut [f32],
    grad: Grad<'_>,
    factor: f32,
    assign: bool,
    threads: usize,
) -> bool {
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

/// One tensor's fused pass in [`accumulate_many`]: its master, its gradient (same length) and
/// whether the pass assigns instead of accumulating.
#[derive(Debug)]
pub struct TensorPass<'a> {
    pub master: &'a mut [f32],
    pub grad: Grad<'a>,
    pub assign: bool,
}

/// [`accumulate`] over every tensor of a micro-batch, with one factor: the same bits as calling it
/// on each tensor. With `threads > 1` the tensors' elements, taken in order as one sequence, are
/// cut into runs of about equal length (at least [`MIN_ELEMENTS_PER_THREAD`] each), one per thread:
/// a model's many mid-sized tensors then use every thread, and threads start once per call rather
/// than once per large tensor. Returns `true` if any written value is not finite.
pub fn accumulate_many(tensors: Vec<TensorPass<'_>>, factor: f32, threads: usize) -> bool {
    for t in &tensors {
        assert_eq!(t.master.len(), t.grad.len(), "master and gradient lengths differ");
    }
    let isa = active_isa();
    let total: usize = tensors.iter().map(|t| t.master.len()).sum();
    let parts = threads.min(total / MIN_ELEMENTS_PER_THREAD).max(1);
    let run = |group: Vec<TensorPass<'_>>| {
        group
            .into_iter()
            .fold(false, |bad, t| accumulate_part(isa, t.master, t.grad, factor, t.assign) | bad)
    };
    if parts == 1 {
        return run(tensors);
    }
    // Run k ends at element `total * k / parts` of the sequence, rounded to a multiple of 64
    // elements so that a cut inside a tensor keeps both halves' vector loops whole.
    let end_of = |k: usize| {
        if k == parts {
            total
        } else {
            (total * k / parts).next_multiple_of(64).min(total)
        }
    };
    let mut groups: Vec<Vec<TensorPass<'_>>> = (0..parts).map(|_| Vec::new()).collect();
    let (mut k, mut pos) = (0, 0);
    for t in tensors {
        let (mut master, mut grad) = (t.master, t.grad);
        while !master.is_empty() {
            let room = end_of(k + 1) - pos;
            if room == 0 {
                k += 1;
                continue;
            }
            let take = room.min(master.len());
            let (head, rest) = master.split_at_mut(take);
            groups[k].push(TensorPass {
                master: head,
                grad: grad.slice(0, take),
                assign: t.assign,
            });
            (master, grad, pos) = (rest, grad.slice(take, grad.len()), pos + take);
        }
    }
    let mut groups = groups.into_iter();
    let first = groups.next().unwrap_or_default();
    std::thread::scope(|scope| {
        let handles: Vec<_> = groups.map(|group| scope.spawn(move || run(group))).collect();
        let mut bad = run(first);
        for handle in handles {
            bad |= handle.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        }
        bad
    })
}

/// One tensor of [`accumulate_and_block_sum_squares`]: where its master starts in the buffer, its
/// gradient (the master's length) and whether the pass assigns instead of accumulating.
#[derive(Clone, Copy, Debug)]
pub struct PlacedPass<'a> {
    pub start: usize,
    pub grad: Grad<'a>,
    pub assign: bool,
}

/// Elements [`accumulate_and_block_sum_squares`] adds before it measures them: one norm block,
/// whose master (16 KiB) and gradient stay in L1 between the two.
const FOLD_PIECE: usize = math::NORM_BLOCK;

/// [`accumulate`] of every tensor of a micro-batch into `buf`, where the tensors lie at their
/// starts (increasing, disjoint; the rest of `buf` is left as it is), and `out[b]` = the
/// [`block_sum_squares`] of block `b` of `buf` after the add: the same bits as
/// [`accumulate_many`] and then [`block_sum_squares`], in one pass over memory. Each piece of
/// [`FOLD_PIECE`] elements is added to, measured, and handed to `measured` (with its position in
/// `buf`) while it is in cache. Threads take parts of whole blocks. Returns `true` if any written
/// value is not finite.
pub fn accumulate_and_block_sum_squares(
    buf: &mut [f32],
    tensors: &[PlacedPass<'_>],
    factor: f32,
    out: &mut [f64],
    threads: usize,
    measured: &(dyn Fn(usize, &[f32]) + Sync),
) -> bool {
    assert_eq!(out.len(), blocks(buf.len()), "one block sum per block");
    let mut end = 0;
    for t in tensors {
        assert!(t.start >= end, "tensors overlap or are out of order");
        end = t.start + t.grad.len();
        assert!(end <= buf.len(), "a tensor past the buffer");
    }
    let isa = active_isa();
    let ends: Vec<usize> = part_ends(buf.len(), threads).collect();
    let mut parts = block_parts(buf, out, &ends);
    run_parts(&mut parts, 1..=ends.len(), |_, group| {
        let mut bad = false;
        for (start, part, sums) in group.iter_mut() {
            // The first tensor that ends inside or after this part.
            let mut next = tensors.partition_point(|t| t.start + t.grad.len() <= *start);
            let pieces =
                part.chunks_mut(FOLD_PIECE).zip(sums.chunks_mut(FOLD_PIECE / math::NORM_BLOCK));
            for (p, (piece, sums)) in pieces.enumerate() {
                let at = *start + p * FOLD_PIECE;
                let end = at + piece.len();
                for t in tensors[next..].iter().take_while(|t| t.start < end) {
                    let (from, to) = (t.start.max(at), (t.start + t.grad.len()).min(end));
                    let grad = t.grad.slice(from - t.start, to - t.start);
                    bad |= accumulate_part(
                        isa,
                        &mut piece[from - at..to - at],
                        grad,
                        factor,
                        t.assign,
                    );
                }
                next +=
                    tensors[next..].iter().take_while(|t| t.start + t.grad.len() <= end).count();
                block_sums_part(isa, piece, sums);
                measured(at, piece);
            }
        }
        bad
    })
}

/// `buf` and its block sums `out` cut at `ends` (element ends at whole blocks, the last
/// `buf.len()`), each part with its start.
fn block_parts<'a>(
    buf: &'a mut [f32],
    out: &'a mut [f64],
    ends: &[usize],
) -> Vec<(usize, &'a mut [f32], &'a mut [f64])> {
    let mut parts = Vec::with_capacity(ends.len());
    let (mut rest, mut rest_sums, mut start) = (buf, out, 0);
    for &end in ends {
        let (part, tail) = std::mem::take(&mut rest).split_at_mut(end - start);
        let (part_sums, tail_sums) =
            std::mem::take(&mut rest_sums).split_at_mut(blocks(end - start));
        parts.push((start, part, part_sums));
        (rest, rest_sums, start) = (tail, tail_sums, end);
    }
    parts
}

/// `buf[i] *= factor` (the boundary's normalise-and-clip pass).
pub fn scale(buf: &mut [f32], factor: f32, threads: usize) {
    let isa = active_isa();
    run_parts(buf, part_ends(buf.len(), threads), |_, part| {
        scale_part(isa, part, factor);
        false
    });
}

/// `buf[i]` rounded to the nearest bfloat16 value, ties to even (NaN stays NaN): what a
/// contribution becomes when it travels in bf16. Rounding twice changes nothing.
pub fn round_to_bf16(buf: &mut [f32], threads: usize) {
    run_parts(buf, part_ends(buf.len(), threads), |_, part| {
        for v in part {
            *v = f32::from_bits(rounded_bf16(*v) & 0xffff_0000);
        }
        false
    });
}

/// `dst[i]` = the bfloat16 bits of `src[i]`, rounded as [`round_to_bf16`] rounds: the bf16 wire's
/// words and the C ABI's `gradacc_f32_to_bf16`. On the AVX2 path or a wider one the loop is
/// compiled for AVX2 (0.18 against 0.32 ns per element with baseline vectors, in L2).
pub fn to_bf16_bits(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if active_isa() >= Isa::Avx2 {
        // SAFETY: the active path is never wider than what the CPU supports (`isa`), so the CPU
        // has AVX2 here.
        return unsafe { to_bf16_bits_avx2(src, dst) };
    }
    to_bf16_bits_loop(src, dst);
}

#[inline(always)]
fn to_bf16_bits_loop(src: &[f32], dst: &mut [u16]) {
    for (d, &v) in dst.iter_mut().zip(src) {
        *d = (rounded_bf16(v) >> 16) as u16;
    }
}

/// [`to_bf16_bits_loop`] compiled for AVX2.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn to_bf16_bits_avx2(src: &[f32], dst: &mut [u16]) {
    to_bf16_bits_loop(src, dst);
}

/// [`math::f32_to_bf16`] (`half`'s rounding) in the upper half of an f32's bits, without its
/// branch, so that loops over it vectorise: in place over f32 twice as fast as through `half`
/// (0.27 against 0.54 ns per element), and into bits 1.5 times as fast as `half`'s slice
/// conversion, a plain loop for bf16.
#[inline(always)]
fn rounded_bf16(v: f32) -> u32 {
    let x = v.to_bits();
    if v.is_nan() {
        x | 0x0040_0000
    } else {
        x.wrapping_add(0x7fff + ((x >> 16) & 1))
    }
}

/// Sum of squares in f64. Each block of [`math::NORM_BLOCK`] elements is summed by
/// [`math::block_sum_squares`] and the block sums are folded by [`fold_block_sums`], so the result
/// does not depend on the thread count or the SIMD path.
pub fn sum_squares(buf: &[f32], threads: usize) -> f64 {
    let mut sums = vec![0.0; blocks(buf.len())];
    block_sum_squares(buf, &mut sums, threads);
    fold_block_sums(&sums)
}

/// [`sum_squares`] of `buf` as it is on entry, and `buf[i] *= factor`, in one pass over memory:
/// each block is summed and then scaled while it is still in L1. Same bits as calling
/// `sum_squares` and then `scale`. The boundary uses it to normalise and measure at once.
pub fn scale_and_sum_squares(buf: &mut [f32], factor: f32, threads: usize) -> f64 {
    let mut sums = vec![0.0; blocks(buf.len())];
    scale_and_block_sum_squares(buf, factor, &mut sums, threads);
    fold_block_sums(&sums)
}

/// Blocks of [`math::NORM_BLOCK`] elements in a buffer of `len` elements, the last one possibly
/// short.
pub fn blocks(len: usize) -> usize {
    len.div_ceil(math::NORM_BLOCK)
}

/// The sum of squares from its block sums, in a fixed shape that a GPU adds in parallel: sum `b`
/// goes to lane `b % math::FOLD_LANES`, each lane adds its sums in block order starting from
/// `0.0`, and the lanes combine by halving (lane `j += lane j + w` for `w` from
/// [`math::fold_first_width`] of the lanes that hold a sum, down to 1; a lane without a sum is
/// `0.0`). The CUDA backend's `ga_finish_norm` adds in exactly this order.
pub fn fold_block_sums(sums: &[f64]) -> f64 {
    let used = sums.len().min(math::FOLD_LANES);
    let mut lanes = vec![0.0; used.next_power_of_two()];
    for row in sums.chunks(math::FOLD_LANES) {
        lanes.iter_mut().zip(row).for_each(|(lane, &sum)| *lane += sum);
    }
    let mut width = math::fold_first_width(used);
    while width > 0 {
        let (low, high) = lanes.split_at_mut(width);
        low.iter_mut().zip(&high[..width]).for_each(|(lane, &other)| *lane += other);
        width /= 2;
    }
    lanes[0]
}

/// `out[b]` = [`math::block_sum_squares`] of block `b` of `buf` (`out.len()` =
/// `blocks(buf.len())`). A block's sum depends on its elements only, so a buffer may be measured in
/// pieces that start at multiples of `NORM_BLOCK`, by any thread or process, and its block sums are
/// the same bits.
pub fn block_sum_squares(buf: &[f32], out: &mut [f64], threads: usize) {
    assert_eq!(out.len(), blocks(buf.len()), "one block sum per block");
    let isa = active_isa();
    run_parts(out, part_block_ends(buf.len(), threads), |first_block, out| {
        let start = first_block * math::NORM_BLOCK;
        let end = (start + out.len() * math::NORM_BLOCK).min(buf.len());
        block_sums_part(isa, &buf[start..end], out);
        false
    });
}

/// [`block_sum_squares`] of `buf` as it is on entry, and `buf[i] *= factor`, in one pass: each
/// block is summed and then scaled while it is still in L1.
pub fn scale_and_block_sum_squares(buf: &mut [f32], factor: f32, out: &mut [f64], threads: usize) {
    assert_eq!(out.len(), blocks(buf.len()), "one block sum per block");
    let isa = active_isa();
    let ends: Vec<usize> = part_ends(buf.len(), threads).collect();
    // Cut the block sums at the same places as the buffer, then run each pair of parts together.
    let mut parts = block_parts(buf, out, &ends);
    run_parts(&mut parts, 1..=ends.len(), |_, group| {
        for (_, part, out) in group.iter_mut() {
            for (block, sum) in part.chunks_mut(math::NORM_BLOCK).zip(out.iter_mut()) {
                block_sums_part(isa, block, std::slice::from_mut(sum));
                scale_part(isa, block, factor);
            }
        }
        false
    });
}

/// `buf[i] += addend[i]`, then `out[b]` = the sum of squares of block `b` of the result, then
/// `buf[i] *= factor` when there is a factor: block by block, so each block is added to, measured
/// and scaled while it is in L1 (on AVX2 and AVX-512 in one sweep, see `docs/kernels.md`). Same
/// bits as [`add_assign`], then [`block_sum_squares`], then [`scale`]. One thread: the boundary
/// runs it on one rank's share of a chunk, a few hundred KB.
pub fn add_and_block_sum_squares(
    buf: &mut [f32],
    addend: &[f32],
    factor: Option<f32>,
    out: &mut [f64],
) {
    assert_eq!(buf.len(), addend.len(), "buffer and addend lengths differ");
    assert_eq!(out.len(), blocks(buf.len()), "one block sum per block");
    let isa = active_isa();
    match (isa, factor) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2 | Isa::Avx512, Some(factor)) => {
            // SAFETY: `active_isa` reports Avx2 or wider only after detecting AVX2 and F16C.
            return unsafe { avx2::add_and_block_sums::<true>(buf, addend, factor, out) };
        }
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2 | Isa::Avx512, None) => {
            // SAFETY: as above.
            return unsafe { avx2::add_and_block_sums::<false>(buf, addend, 1.0, out) };
        }
        _ => {}
    }
    for ((block, add), sum) in
        buf.chunks_mut(math::NORM_BLOCK).zip(addend.chunks(math::NORM_BLOCK)).zip(out)
    {
        add_assign_part(isa, block, add);
        block_sums_part(isa, block, std::slice::from_mut(sum));
        if let Some(factor) = factor {
            scale_part(isa, block, factor);
        }
    }
}

/// `dst = src` for data another core reads next: with [`copy_streaming`] where
/// [`isa::stream_to_peers`] says so, with the plain copy elsewhere.
pub fn copy_for_peer(dst: &mut [f32], src: &[f32]) {
    if isa::stream_to_peers() {
        copy_streaming(dst, src)
    } else {
        dst.copy_from_slice(src)
    }
}

/// `dst = src` with stores that bypass the cache where the CPU has them (AVX2), then a store
/// fence.
pub fn copy_streaming(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len());
    match active_isa() {
        // SAFETY: `active_isa` reports Avx2 or wider only after detecting AVX2 and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { avx2::copy_streaming(dst, src) },
        _ => dst.copy_from_slice(src),
    }
}

/// `dst[i] += src[i]`, the reduction step of the communicators.
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len());
    add_assign_part(active_isa(), dst, src);
}

fn add_assign_part(isa: Isa, dst: &mut [f32], src: &[f32]) {
    match isa {
        // SAFETY: every caller passes `active_isa()`, which `Isa::clamp` keeps within what `probe`
        // detected, so Avx512 here means the CPU has AVX-512F (hence AVX2 and F16C) as the kernel
        // needs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::add_assign(dst, src) },
        // SAFETY: likewise, `probe` reports Avx2 or wider only after detecting AVX2 and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::add_assign(dst, src) },
        _ => scalar::add_assign(dst, src),
    }
}

fn accumulate_part(
    isa: Isa,
    master: &mut [f32],
    grad: Grad<'_>,
    factor: f32,
    assign: bool,
) -> bool {
    match isa {
        // SAFETY: every caller passes `active_isa()`, which `Isa::clamp` keeps within what `probe`
        // detected, so Avx512 here means the CPU has AVX-512F (hence AVX2 and F16C) as the kernel
        // needs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::accumulate(master, grad, factor, assign) },
        // SAFETY: likewise, `probe` reports Avx2 or wider only after detecting AVX2 and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::accumulate(master, grad, factor, assign) },
        _ => scalar::accumulate(master, grad, factor, assign),
    }
}

fn scale_part(isa: Isa, buf: &mut [f32], factor: f32) {
    match isa {
        // SAFETY: every caller passes `active_isa()`, which `Isa::clamp` keeps within what `probe`
        // detected, so Avx512 here means the CPU has AVX-512F (hence AVX2 and F16C) as the kernel
        // needs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::scale(buf, factor) },
        // SAFETY: likewise, `probe` reports Avx2 or wider only after detecting AVX2 and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::scale(buf, factor) },
        _ => scalar::scale(buf, factor),
    }
}

fn block_sums_part(isa: Isa, buf: &[f32], out: &mut [f64]) {
    match isa {
        // SAFETY: every caller passes `active_isa()`, which `Isa::clamp` keeps within what `probe`
        // detected, so Avx512 here means the CPU has AVX-512F (hence AVX2 and F16C) as the kernel
        // needs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::block_sums(buf, out) },
        // SAFETY: likewise, `probe` reports Avx2 or wider only after detecting AVX2 and F16C.
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
    fn round_to_bf16_is_the_scalar_conversion_and_back() {
        let mut values = vec![
            0.0,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        values.extend(
            [0x3f80_8000u32, 0x3f81_8000, 0x3f80_7fff, 0x7f7f_ffff, 0xffc0_0001, 0x7f80_0001]
                .map(f32::from_bits),
        );
        let mut state = 0x9e37_79b9u32;
        values.extend((0..10_000).map(|_| {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            f32::from_bits(state)
        }));
        let mut rounded = values.clone();
        round_to_bf16(&mut rounded, 2);
        let mut bits = vec![0u16; values.len()];
        to_bf16_bits(&values, &mut bits);
        for ((&v, &r), &b) in values.iter().zip(&rounded).zip(&bits) {
            assert_eq!(b, math::f32_to_bf16(v), "{v:e}");
            let want = math::bf16_to_f32(math::f32_to_bf16(v));
            assert_eq!(
                r.to_bits(),
                want.to_bits(),
                "{v:e} ({:#x}): {r:e} vs {want:e}",
                v.to_bits()
            );
        }
    }

    #[test]
    fn parts_are_whole_blocks_covering_the_buffer() {
        let block = math::NORM_BLOCK;
        for len in
            [0, 1, block, 2 * MIN_ELEMENTS_PER_THREAD - 1, 2 * MIN_ELEMENTS_PER_THREAD, 10_000_019]
        {
            for threads in [0, 1, 2, 3, 7, 64] {
                let ends: Vec<usize> = part_ends(len, threads).collect();
                assert_eq!(ends.last(), Some(&len));
                assert!(
                    ends.len() <= threads.max(1)
                        && ends.len() <= (len / MIN_ELEMENTS_PER_THREAD).max(1)
                );
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
    fn accumulate_many_matches_accumulate_per_tensor_for_any_thread_count() {
        // Sizes around the thread and vector cuts, and a large tensor among small ones.
        let sizes = [
            1,
            63,
            64,
            4097,
            3 * MIN_ELEMENTS_PER_THREAD + 5,
            17,
            MIN_ELEMENTS_PER_THREAD - 1,
            100_003,
            2,
        ];
        let total: usize = sizes.iter().sum();
        let grad: Vec<u16> = (0..total)
            .map(|i| math::f32_to_f16(((i * 7919) % 2003) as f32 / 97.0 - 10.0))
            .collect();
        let start: Vec<f32> =
            (0..total).map(|i| ((i * 104_729) % 1009) as f32 / 13.0 - 38.0).collect();
        for bad_at in [None, Some(total - 1), Some(sizes[..4].iter().sum::<usize>() + 12_345)] {
            let mut grad = grad.clone();
            if let Some(i) = bad_at {
                grad[i] = 0x7c00; // +inf
            }
            let mut want = start.clone();
            let (mut at, mut want_bad) = (0, false);
            for (k, &n) in sizes.iter().enumerate() {
                want_bad |= accumulate(
                    &mut want[at..at + n],
                    Grad::f16_bits(&grad[at..at + n]),
                    0.375,
                    k % 3 == 1,
                    1,
                );
                at += n;
            }
            for threads in [1, 2, 3, 7] {
                let mut got = start.clone();
                let mut passes = Vec::new();
                let (mut rest, mut at) = (got.as_mut_slice(), 0);
                for (k, &n) in sizes.iter().enumerate() {
                    let (master, tail) = std::mem::take(&mut rest).split_at_mut(n);
                    passes.push(TensorPass {
                        master,
                        grad: Grad::f16_bits(&grad[at..at + n]),
                        assign: k % 3 == 1,
                    });
                    (rest, at) = (tail, at + n);
                }
                let bad = accumulate_many(passes, 0.375, threads);
                assert_eq!(bad, want_bad, "threads {threads}, inf at {bad_at:?}");
                assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "threads {threads}"
                );
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
