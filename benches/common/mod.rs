//! What the benchmarks share: 64-byte-aligned buffers, the memory-bandwidth floors (plain SIMD
//! loops that move the same bytes as a kernel, with none of its arithmetic or with the plainest
//! form of it), and timing by the median of repeats taken in turns.
// Each benchmark uses a part of this module.
#![allow(dead_code)]

use std::time::Instant;

use gradacc::half::{bf16, f16};
use gradacc::simd;
use gradacc::Grad;

/// What a floor loop writes into `dst[i]`, given the widened gradient `g`.
pub mod kind {
    /// `dst = g`: reads the gradient and writes the master. The store allocates the master's
    /// lines in the cache, which on most x86 cores first reads them from memory.
    pub const COPY: u8 = 0;
    /// `dst += g`: the fused pass's explicit traffic (read gradient and master, write master).
    pub const ADD: u8 = 1;
    /// `dst += g * TRIAD_FACTOR` (a multiply, then an add): the fused pass without its non-finite
    /// check, STREAM's triad with the output aliasing an input.
    pub const TRIAD: u8 = 2;
}

pub const TRIAD_FACTOR: f32 = 1.0 / 1024.0;

/// Cheap deterministic values in 0..16384 (hash of the index).
pub fn pattern(i: usize) -> u32 {
    ((i as u32).wrapping_mul(0x9e37_79b9) >> 18) & 0x3fff
}

/// f32, f16 and bf16 gradients of `len` elements in [-0.5, 0.5).
pub fn gradients(len: usize) -> (Vec<f32>, Vec<f16>, Vec<bf16>) {
    let f32_grad: Vec<f32> = (0..len).map(|i| pattern(i) as f32 / 16384.0 - 0.5).collect();
    let f16_grad = f32_grad.iter().map(|&v| f16::from_f32(v)).collect();
    let bf16_grad = f32_grad.iter().map(|&v| bf16::from_f32(v)).collect();
    (f32_grad, f16_grad, bf16_grad)
}

/// An f32 buffer whose first element is 64-byte aligned, so the kernels and the floor loops see the
/// same alignment and no vector access straddles a cache line.
pub struct AlignedF32 {
    storage: Vec<f32>,
    start: usize,
    len: usize,
}

impl AlignedF32 {
    pub fn new(len: usize) -> Self {
        let storage = vec![0.0f32; len + 16];
        let start = storage.as_ptr().align_offset(64);
        AlignedF32 { storage, start, len }
    }

    pub fn slice(&mut self) -> &mut [f32] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median, fastest and slowest of a set of timings.
#[derive(Clone, Copy, Debug)]
pub struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Stats {
    pub fn of(v: &[f64]) -> Stats {
        let mut s = v.to_vec();
        s.sort_by(f64::total_cmp);
        Stats { median: s[s.len() / 2], min: s[0], max: s[s.len() - 1], n: s.len() }
    }
}

/// The rounds of variants that took turns: `turns[i]` is variant `i`'s seconds per call.
pub struct Turns {
    stats: Vec<Stats>,
    times: Vec<Vec<f64>>,
}

impl Turns {
    pub fn new(times: Vec<Vec<f64>>) -> Turns {
        Turns { stats: times.iter().map(|t| Stats::of(t)).collect(), times }
    }

    /// Variant `a`'s time over variant `b`'s, round by round. The two ran in the same round, so a
    /// change of machine state between rounds (another process, a frequency step) moves both and
    /// cancels in the ratio, where it does not cancel in a ratio of medians.
    pub fn ratio(&self, a: usize, b: usize) -> Stats {
        Stats::of(&self.times[a].iter().zip(&self.times[b]).map(|(x, y)| x / y).collect::<Vec<_>>())
    }
}

impl std::ops::Index<usize> for Turns {
    type Output = Stats;

    fn index(&self, i: usize) -> &Stats {
        &self.stats[i]
    }
}

/// Runs `variants` in turns, `rounds` times after one untimed round, and returns each one's
/// seconds per call. A variant whose call is shorter than `min_sample` seconds is called as many
/// times per sample as it takes to reach that, so clock resolution and the loop do not count.
/// Taking turns makes every variant see the same machine state (other processes, frequency).
pub fn interleaved(rounds: usize, min_sample: f64, variants: &mut [&mut dyn FnMut()]) -> Turns {
    let calls: Vec<usize> = variants
        .iter_mut()
        .map(|run| {
            let t = Instant::now();
            run();
            let once = t.elapsed().as_secs_f64().max(1e-9);
            ((min_sample / once).ceil() as usize).clamp(1, 1_000_000)
        })
        .collect();
    let mut times = vec![Vec::with_capacity(rounds); variants.len()];
    for _ in 0..rounds {
        for ((run, &k), times) in variants.iter_mut().zip(&calls).zip(&mut times) {
            let t = Instant::now();
            for _ in 0..k {
                run();
            }
            times.push(t.elapsed().as_secs_f64() / k as f64);
        }
    }
    Turns::new(times)
}

/// Contiguous parts of whole 4096-element blocks, one per thread, the first on the calling thread.
/// Like the kernels, a part has at least `MIN_ELEMENTS_PER_THREAD` elements, so a floor and a
/// kernel of the same size run on the same number of threads.
pub fn parallel<T: Send>(buf: &mut [T], threads: usize, work: impl Fn(usize, &mut [T]) + Sync) {
    let threads = threads.min(buf.len() / simd::MIN_ELEMENTS_PER_THREAD).max(1);
    if threads == 1 {
        return work(0, buf);
    }
    let part = buf.len().div_ceil(threads).div_ceil(4096) * 4096;
    std::thread::scope(|scope| {
        let mut parts = buf.chunks_mut(part.max(1)).enumerate();
        let first = parts.next();
        for (k, chunk) in parts {
            let work = &work;
            scope.spawn(move || work(k * part, chunk));
        }
        if let Some((_, chunk)) = first {
            work(0, chunk);
        }
    });
}

/// A floor loop of kind `K` (see [`kind`]) over `dst` and `src`, with the ISA the kernels use. An
/// empty `src` adds 1.0 instead (`ADD` only): the floor for `scale`, which has no second input.
pub fn floor<const K: u8>(isa: simd::Isa, dst: &mut [f32], src: Grad<'_>, threads: usize) {
    parallel(dst, threads, |start, part| {
        let src = if src.is_empty() { src } else { src.slice(start, start + part.len()) };
        match isa {
            // SAFETY: `active_isa` only reports paths the CPU supports.
            #[cfg(target_arch = "x86_64")]
            simd::Isa::Avx512 => unsafe { x86::avx512::<K>(part, src) },
            #[cfg(target_arch = "x86_64")]
            simd::Isa::Avx2 => unsafe { x86::avx2::<K>(part, src) },
            _ => floor_scalar::<K>(part, src),
        }
    });
}

fn floor_scalar<const K: u8>(dst: &mut [f32], src: Grad<'_>) {
    let op = |d: &mut f32, g: f32| {
        *d = match K {
            kind::COPY => g,
            kind::ADD => *d + g,
            _ => *d + g * TRIAD_FACTOR,
        }
    };
    match src {
        Grad::F32([]) => dst.iter_mut().for_each(|d| op(d, 1.0)),
        Grad::F32(s) => dst.iter_mut().zip(s).for_each(|(d, &s)| op(d, s)),
        Grad::F16(s) => {
            dst.iter_mut().zip(s).for_each(|(d, &s)| op(d, gradacc::math::f16_to_f32(s.to_bits())))
        }
        Grad::Bf16(s) => {
            dst.iter_mut().zip(s).for_each(|(d, &s)| op(d, gradacc::math::bf16_to_f32(s.to_bits())))
        }
    }
}

/// The floor for `sum_squares`: a plain f32 sum, no widening, per-part results added.
pub fn floor_sum(isa: simd::Isa, buf: &mut [f32], threads: usize) -> f64 {
    let total = std::sync::Mutex::new(0.0);
    parallel(buf, threads, |_, part| {
        let s = match isa {
            // SAFETY: as in `floor`.
            #[cfg(target_arch = "x86_64")]
            simd::Isa::Avx512 => unsafe { x86::sum_avx512(part) },
            #[cfg(target_arch = "x86_64")]
            simd::Isa::Avx2 => unsafe { x86::sum_avx2(part) },
            _ => part.iter().sum::<f32>(),
        };
        *total.lock().unwrap() += s as f64;
    });
    total.into_inner().unwrap()
}

/// The plainest fused loop a user could write instead of `add`, one call per tensor over the
/// caller's own per-tensor masters: load a vector of the gradient, widen it, multiply by `factor`,
/// add it to the master, store, and keep the largest exponent field written (the non-finite
/// check). No prefetch, no alignment peeling, no unrolling. With `threads > 1` the tensors'
/// elements, taken in order, are cut into that many runs of about equal length (at multiples of
/// 64 elements), as `accumulate_many` cuts them. Returns whether some written value is not finite.
pub fn fused(
    isa: simd::Isa,
    masters: &mut [&mut [f32]],
    grads: &[Grad<'_>],
    factor: f32,
    threads: usize,
) -> bool {
    let total: usize = masters.iter().map(|m| m.len()).sum();
    let parts = threads.min(total / simd::MIN_ELEMENTS_PER_THREAD).max(1);
    let one = |m: &mut [f32], g: Grad<'_>| match isa {
        // SAFETY: `active_isa` only reports paths the CPU supports.
        #[cfg(target_arch = "x86_64")]
        simd::Isa::Avx512 => unsafe { x86::fused_avx512(m, g, factor) },
        #[cfg(target_arch = "x86_64")]
        simd::Isa::Avx2 => unsafe { x86::fused_avx2(m, g, factor) },
        _ => fused_scalar(m, g, factor),
    };
    if parts == 1 {
        return masters.iter_mut().zip(grads).fold(false, |bad, (m, &g)| one(m, g) | bad);
    }
    let mut runs: Vec<Vec<(&mut [f32], Grad<'_>)>> = (0..parts).map(|_| Vec::new()).collect();
    let end_of = |k: usize| {
        if k == parts {
            total
        } else {
            (total * k / parts).next_multiple_of(64).min(total)
        }
    };
    let (mut k, mut pos) = (0, 0);
    for (m, &g) in masters.iter_mut().zip(grads) {
        let (mut m, mut g) = (&mut **m, g);
        while !m.is_empty() {
            let take = (end_of(k + 1) - pos).min(m.len());
            if take == 0 {
                k += 1;
                continue;
            }
            let (head, rest) = m.split_at_mut(take);
            runs[k].push((head, g.slice(0, take)));
            (m, g, pos) = (rest, g.slice(take, g.len()), pos + take);
        }
    }
    let run = |run: Vec<(&mut [f32], Grad<'_>)>| {
        run.into_iter().fold(false, |bad, (m, g)| one(m, g) | bad)
    };
    let mut runs = runs.into_iter();
    let first = runs.next().unwrap_or_default();
    std::thread::scope(|scope| {
        let handles: Vec<_> = runs.map(|r| scope.spawn(move || run(r))).collect();
        handles.into_iter().fold(run(first), |bad, h| h.join().unwrap() | bad)
    })
}

fn fused_scalar(m: &mut [f32], g: Grad<'_>, factor: f32) -> bool {
    let mut bad = false;
    for (i, d) in m.iter_mut().enumerate() {
        let v = match g {
            Grad::F32(s) => s[i],
            Grad::F16(s) => gradacc::math::f16_to_f32(s[i].to_bits()),
            Grad::Bf16(s) => gradacc::math::bf16_to_f32(s[i].to_bits()),
        };
        *d += v * factor;
        bad |= !d.is_finite();
    }
    bad
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use gradacc::Grad;

    use super::{floor_scalar, kind, TRIAD_FACTOR};

    /// 64 elements per iteration; `$body` handles the `$lanes` elements from `$j`.
    macro_rules! floor_loop {
        ($k:ident, $dst:ident, $src:ident, $lanes:expr, |$d:ident, $j:ident| $body:expr) => {{
            let n = $dst.len() / 64 * 64;
            let $d = $dst.as_mut_ptr();
            let mut i = 0;
            while i < n {
                for $j in (i..i + 64).step_by($lanes) {
                    $body;
                }
                i += 64;
            }
            let tail = if $src.is_empty() { $src } else { $src.slice(n, $src.len()) };
            floor_scalar::<$k>(&mut $dst[n..], tail);
        }};
    }

    /// Stores `op(dst, g)` at `$p` for floor kind `$k`; for COPY the master is never loaded.
    macro_rules! store {
        ($k:ident, $load:ident, $add:ident, $mul:ident, $set1:ident, $store:ident, $p:expr, $g:expr) => {{
            let g = $g;
            let v = match $k {
                kind::COPY => g,
                kind::ADD => $add($load($p), g),
                _ => $add($load($p), $mul(g, $set1(TRIAD_FACTOR))),
            };
            $store($p, v)
        }};
    }

    macro_rules! store512 {
        ($k:ident, $p:expr, $g:expr) => {
            store!(
                $k,
                _mm512_loadu_ps,
                _mm512_add_ps,
                _mm512_mul_ps,
                _mm512_set1_ps,
                _mm512_storeu_ps,
                $p,
                $g
            )
        };
    }

    macro_rules! store256 {
        ($k:ident, $p:expr, $g:expr) => {
            store!(
                $k,
                _mm256_loadu_ps,
                _mm256_add_ps,
                _mm256_mul_ps,
                _mm256_set1_ps,
                _mm256_storeu_ps,
                $p,
                $g
            )
        };
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512<const K: u8>(dst: &mut [f32], src: Grad<'_>) {
        match src {
            Grad::F32([]) => {
                floor_loop!(K, dst, src, 16, |d, i| store512!(K, d.add(i), _mm512_set1_ps(1.0)))
            }
            Grad::F32(s) => floor_loop!(K, dst, src, 16, |d, i| store512!(
                K,
                d.add(i),
                _mm512_loadu_ps(s.as_ptr().add(i))
            )),
            Grad::F16(s) => {
                floor_loop!(K, dst, src, 16, |d, i| store512!(
                    K,
                    d.add(i),
                    _mm512_cvtph_ps(_mm256_loadu_si256(s.as_ptr().add(i).cast()))
                ))
            }
            Grad::Bf16(s) => floor_loop!(K, dst, src, 16, |d, i| store512!(
                K,
                d.add(i),
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                    _mm256_loadu_si256(s.as_ptr().add(i).cast())
                )))
            )),
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn avx2<const K: u8>(dst: &mut [f32], src: Grad<'_>) {
        match src {
            Grad::F32([]) => {
                floor_loop!(K, dst, src, 8, |d, i| store256!(K, d.add(i), _mm256_set1_ps(1.0)))
            }
            Grad::F32(s) => floor_loop!(K, dst, src, 8, |d, i| store256!(
                K,
                d.add(i),
                _mm256_loadu_ps(s.as_ptr().add(i))
            )),
            Grad::F16(s) => {
                floor_loop!(K, dst, src, 8, |d, i| store256!(
                    K,
                    d.add(i),
                    _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr().add(i).cast()))
                ))
            }
            Grad::Bf16(s) => floor_loop!(K, dst, src, 8, |d, i| store256!(
                K,
                d.add(i),
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(s.as_ptr().add(i).cast())
                )))
            )),
        }
    }

    /// The body of `fused` for one tensor: `$widen` loads vector `$i` of the gradient as f32s;
    /// the remainder goes to the scalar loop.
    macro_rules! fused_loop {
        ($v:ident, $m:ident, $g:ident, $factor:ident, |$i:ident| $widen:expr) => {{
            let n = $m.len() / $v::LANES * $v::LANES;
            let (d, f, exp) = ($m.as_mut_ptr(), $v::set1($factor), $v::set1i(0x7f80_0000));
            let mut seen = $v::zero();
            for $i in (0..n).step_by($v::LANES) {
                let r = $v::add($v::load(d.add($i)), $v::mul($widen, f));
                $v::store(d.add($i), r);
                seen = $v::max_exponent(seen, r, exp);
            }
            super::fused_scalar(&mut $m[n..], $g.slice(n, $g.len()), $factor)
                | $v::any_eq(seen, exp)
        }};
    }

    /// `fused` for one tensor, 16 lanes.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fused_avx512(m: &mut [f32], g: Grad<'_>, factor: f32) -> bool {
        use v512 as v;
        match g {
            Grad::F32(s) => fused_loop!(v, m, g, factor, |i| _mm512_loadu_ps(s.as_ptr().add(i))),
            Grad::F16(s) => fused_loop!(v, m, g, factor, |i| _mm512_cvtph_ps(_mm256_loadu_si256(
                s.as_ptr().add(i).cast()
            ))),
            Grad::Bf16(s) => {
                fused_loop!(v, m, g, factor, |i| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(s.as_ptr().add(i).cast()))
                )))
            }
        }
    }

    /// `fused` for one tensor, 8 lanes.
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn fused_avx2(m: &mut [f32], g: Grad<'_>, factor: f32) -> bool {
        use v256 as v;
        match g {
            Grad::F32(s) => fused_loop!(v, m, g, factor, |i| _mm256_loadu_ps(s.as_ptr().add(i))),
            Grad::F16(s) => fused_loop!(v, m, g, factor, |i| _mm256_cvtph_ps(_mm_loadu_si128(
                s.as_ptr().add(i).cast()
            ))),
            Grad::Bf16(s) => {
                fused_loop!(v, m, g, factor, |i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(s.as_ptr().add(i).cast()))
                )))
            }
        }
    }

    /// The vector operations `fused_loop` uses, 16 lanes.
    mod v512 {
        use std::arch::x86_64::*;
        pub const LANES: usize = 16;
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn set1(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn set1i(x: i32) -> __m512i {
            _mm512_set1_epi32(x)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn zero() -> __m512i {
            _mm512_setzero_si512()
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn add(a: __m512, b: __m512) -> __m512 {
            _mm512_add_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn mul(a: __m512, b: __m512) -> __m512 {
            _mm512_mul_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn max_exponent(seen: __m512i, r: __m512, exp: __m512i) -> __m512i {
            _mm512_max_epu32(seen, _mm512_and_si512(_mm512_castps_si512(r), exp))
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn any_eq(seen: __m512i, exp: __m512i) -> bool {
            _mm512_cmpeq_epi32_mask(seen, exp) != 0
        }
    }

    /// The vector operations `fused_loop` uses, 8 lanes.
    mod v256 {
        use std::arch::x86_64::*;
        pub const LANES: usize = 8;
        #[inline]
        #[target_feature(enable = "avx2")]
        pub unsafe fn set1(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        pub unsafe fn set1i(x: i32) -> __m256i {
            _mm256_set1_epi32(x)
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        pub unsafe fn zero() -> __m256i {
            _mm256_setzero_si256()
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        pub unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        pub unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        pub unsafe fn add(a: __m256, b: __m256) -> __m256 {
            _mm256_add_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        pub unsafe fn mul(a: __m256, b: __m256) -> __m256 {
            _mm256_mul_ps(a, b)
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        pub unsafe fn max_exponent(seen: __m256i, r: __m256, exp: __m256i) -> __m256i {
            _mm256_max_epu32(seen, _mm256_and_si256(_mm256_castps_si256(r), exp))
        }
        #[inline]
        #[target_feature(enable = "avx2")]
        pub unsafe fn any_eq(seen: __m256i, exp: __m256i) -> bool {
            _mm256_movemask_epi8(_mm256_cmpeq_epi32(seen, exp)) != 0
        }
    }

    /// Four independent accumulators, so the sum runs at load speed rather than add latency.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn sum_avx512(buf: &[f32]) -> f32 {
        let n = buf.len() / 64 * 64;
        let p = buf.as_ptr();
        let mut acc = [_mm512_setzero_ps(); 4];
        for i in (0..n).step_by(64) {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm512_add_ps(*a, _mm512_loadu_ps(p.add(i + 16 * k)));
            }
        }
        let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_reduce_add_ps(v) + buf[n..].iter().sum::<f32>()
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn sum_avx2(buf: &[f32]) -> f32 {
        let n = buf.len() / 32 * 32;
        let p = buf.as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in (0..n).step_by(32) {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm256_add_ps(*a, _mm256_loadu_ps(p.add(i + 8 * k)));
            }
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut lanes = [0.0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), v);
        lanes.iter().sum::<f32>() + buf[n..].iter().sum::<f32>()
    }
}
