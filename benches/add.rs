//! Throughput of the CPU kernels next to a memory-bandwidth floor measured in the same run: a plain
//! SIMD loop with the same traffic (read the gradient and the master, write the master) but no
//! multiply and no non-finite check. The ratio says what the fused pass costs beyond moving bytes.
//!
//! `cargo bench --bench add`; `GRADACC_CPU_ISA=avx2` (or `scalar`) benchmarks a narrower path.

use std::time::Instant;

use gradacc::backend::cpu;
use gradacc::Grad;

const SIZES: [usize; 2] = [16 << 20, 64 << 20];
const THREADS: [usize; 2] = [1, 2];
const REPEATS: usize = 7;
const FACTOR: f32 = 1.0 / 1024.0;

fn main() {
    let isa = cpu::active_isa();
    println!("gradacc CPU kernels, {} path, median of {REPEATS} runs after a warm-up\n", isa.name());
    println!("| size | dtype | threads | ns/element | GB/s | floor ns/element | ratio to floor | prefetching floor ns/element | ratio to it |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for &len in &SIZES {
        let mut master = AlignedF32::new(len);
        let f32_grad: Vec<f32> = (0..len).map(|i| pattern(i) as f32 / 8192.0 - 0.5).collect();
        let f16_grad: Vec<u16> = f32_grad.iter().map(|&v| cpu::math::f32_to_f16(v)).collect();
        let bf16_grad: Vec<u16> = f32_grad.iter().map(|&v| cpu::math::f32_to_bf16(v)).collect();
        let grads = [("f16", Grad::F16(&f16_grad)), ("bf16", Grad::Bf16(&bf16_grad)), ("f32", Grad::F32(&f32_grad))];
        for (name, grad) in grads {
            let bytes = (grad.dtype().size() + 8) as f64;
            for threads in THREADS {
                let times = compare(
                    &mut master,
                    |m| assert!(!cpu::accumulate(m, grad, FACTOR, false, threads)),
                    |m| floor_add::<false>(isa, m, grad, threads),
                    |m| floor_add::<true>(isa, m, grad, threads),
                );
                row(len, name, threads, bytes, times);
            }
        }
        if len == *SIZES.last().unwrap() {
            for threads in THREADS {
                let times = compare(
                    &mut master,
                    |m| cpu::scale(m, 0.999, threads),
                    |m| floor_add::<false>(isa, m, Grad::F32(&[]), threads),
                    |m| floor_add::<true>(isa, m, Grad::F32(&[]), threads),
                );
                row(len, "scale (f32)", threads, 8.0, times);
            }
            for threads in THREADS {
                let times = compare(
                    &mut master,
                    |m| assert!(cpu::sum_squares(m, threads).is_finite()),
                    |m| assert!(floor_sum::<false>(isa, m, threads).is_finite()),
                    |m| assert!(floor_sum::<true>(isa, m, threads).is_finite()),
                );
                row(len, "sum_squares (f32)", threads, 4.0, times);
            }
        }
    }
    println!("\nGB/s counts the bytes each element moves once: the gradient (2 or 4 B) plus the master read");
    println!("and written (8 B); scale moves 8 B, sum_squares reads 4 B. The floor is a plain SIMD loop with");
    println!("the same traffic and no multiply or check (`dst += widen(src)`); the prefetching floor is the");
    println!("same loop with the kernels' software prefetch. The scale floor is that loop with no second");
    println!("input; the sum_squares floors are f32 sums with no conversion to f64.");
}

/// Median seconds of each of `runs` on `buf`: the kernel, the plain floor, the prefetching floor.
/// They take turns, so all see the same machine state, after one untimed run of each.
fn compare(
    buf: &mut AlignedF32,
    mut kernel: impl FnMut(&mut [f32]),
    mut plain: impl FnMut(&mut [f32]),
    mut prefetching: impl FnMut(&mut [f32]),
) -> [f64; 3] {
    let mut runs = [&mut kernel as &mut dyn FnMut(&mut [f32]), &mut plain, &mut prefetching];
    let mut times: [Vec<f64>; 3] = Default::default();
    for round in 0..=REPEATS {
        for (run, times) in runs.iter_mut().zip(&mut times) {
            let t = Instant::now();
            run(buf.slice());
            if round > 0 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
    }
    times.map(median)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn row(len: usize, what: &str, threads: usize, bytes: f64, seconds: [f64; 3]) {
    let [ns, plain, prefetching] = seconds.map(|s| s * 1e9 / len as f64);
    println!(
        "| {}M | {what} | {threads} | {ns:.3} | {:.1} | {plain:.3} | {:.2} | {prefetching:.3} | {:.2} |",
        len >> 20,
        bytes / ns,
        ns / plain,
        ns / prefetching
    );
}

/// Cheap deterministic values in 0..16384 (hash of the index).
fn pattern(i: usize) -> u32 {
    ((i as u32).wrapping_mul(0x9e37_79b9) >> 18) & 0x3fff
}

/// An f32 buffer whose first element is 64-byte aligned, so the kernels and the floor loops see the
/// same alignment and no vector access straddles a cache line.
struct AlignedF32 {
    storage: Vec<f32>,
    start: usize,
    len: usize,
}

impl AlignedF32 {
    fn new(len: usize) -> Self {
        let storage = vec![0.0f32; len + 16];
        let start = storage.as_ptr().align_offset(64);
        AlignedF32 { storage, start, len }
    }

    fn slice(&mut self) -> &mut [f32] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// Contiguous parts of whole 4096-element blocks, one per thread, the first on the calling thread.
fn parallel<T: Send>(buf: &mut [T], threads: usize, work: impl Fn(usize, &mut [T]) + Sync) {
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

/// The floor for the fused pass: `dst[i] += widen(src[i])`, plain (`PF = false`) or prefetching
/// like the kernels (`PF = true`). An empty `src` adds 1.0 instead: the floor for `scale`.
fn floor_add<const PF: bool>(isa: cpu::Isa, dst: &mut [f32], src: Grad<'_>, threads: usize) {
    parallel(dst, threads, |start, part| {
        let src = if src.is_empty() { src } else { src.slice(start, start + part.len()) };
        match isa {
            // SAFETY: `active_isa` only reports paths the CPU supports.
            #[cfg(target_arch = "x86_64")]
            cpu::Isa::Avx512 => unsafe { x86::add_avx512::<PF>(part, src) },
            #[cfg(target_arch = "x86_64")]
            cpu::Isa::Avx2 => unsafe { x86::add_avx2::<PF>(part, src) },
            _ => add_scalar(part, src),
        }
    });
}

fn add_scalar(dst: &mut [f32], src: Grad<'_>) {
    match src {
        Grad::F32([]) => dst.iter_mut().for_each(|d| *d += 1.0),
        Grad::F32(s) => dst.iter_mut().zip(s).for_each(|(d, &s)| *d += s),
        Grad::F16(s) => dst.iter_mut().zip(s).for_each(|(d, &s)| *d += cpu::math::f16_to_f32(s)),
        Grad::Bf16(s) => dst.iter_mut().zip(s).for_each(|(d, &s)| *d += cpu::math::bf16_to_f32(s)),
    }
}

/// The floor for `sum_squares`: a plain f32 sum, no widening, per-part results added.
fn floor_sum<const PF: bool>(isa: cpu::Isa, buf: &mut [f32], threads: usize) -> f64 {
    let total = std::sync::Mutex::new(0.0);
    parallel(buf, threads, |_, part| {
        let s = match isa {
            // SAFETY: as in `floor_add`.
            #[cfg(target_arch = "x86_64")]
            cpu::Isa::Avx512 => unsafe { x86::sum_avx512::<PF>(part) },
            #[cfg(target_arch = "x86_64")]
            cpu::Isa::Avx2 => unsafe { x86::sum_avx2::<PF>(part) },
            _ => part.iter().sum::<f32>(),
        };
        *total.lock().unwrap() += s as f64;
    });
    total.into_inner().unwrap()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use gradacc::Grad;

    use super::add_scalar;

    /// The kernels' prefetch distance and level (`PREFETCH_BYTES` in `src/backend/cpu/mod.rs`).
    const PREFETCH_BYTES: usize = 4096;

    #[inline(always)]
    unsafe fn prefetch<T>(p: *const T, i: usize) {
        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(i).cast::<i8>().wrapping_add(PREFETCH_BYTES));
    }

    /// 64 elements per iteration: four lines of `dst`, two or four of `src`, each prefetched once
    /// when `$pf`; `$body` handles the `$lanes` elements from `$j`.
    macro_rules! add_loop {
        ($pf:ident, $dst:ident, $src:ident, $lanes:expr, |$d:ident, $j:ident| $body:expr) => {{
            let n = $dst.len() / 64 * 64;
            let $d = $dst.as_mut_ptr();
            let (s, src_bytes) = match $src {
                Grad::F32(s) => (s.as_ptr().cast::<u8>(), 4 * s.len().min(1)),
                Grad::F16(s) | Grad::Bf16(s) => (s.as_ptr().cast::<u8>(), 2),
            };
            let mut i = 0;
            while i < n {
                if $pf {
                    for line in 0..4 {
                        prefetch($d, i + 16 * line);
                    }
                    for line in 0..src_bytes {
                        prefetch(s, i * src_bytes + 64 * line);
                    }
                }
                for $j in (i..i + 64).step_by($lanes) {
                    $body;
                }
                i += 64;
            }
            let tail = if $src.is_empty() { $src } else { $src.slice(n, $src.len()) };
            add_scalar(&mut $dst[n..], tail);
        }};
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn add_avx512<const PF: bool>(dst: &mut [f32], src: Grad<'_>) {
        match src {
            Grad::F32([]) => add_loop!(PF, dst, src, 16, |d, i| _mm512_storeu_ps(
                d.add(i),
                _mm512_add_ps(_mm512_loadu_ps(d.add(i)), _mm512_set1_ps(1.0))
            )),
            Grad::F32(s) => add_loop!(PF, dst, src, 16, |d, i| {
                _mm512_storeu_ps(d.add(i), _mm512_add_ps(_mm512_loadu_ps(d.add(i)), _mm512_loadu_ps(s.as_ptr().add(i))))
            }),
            Grad::F16(s) => add_loop!(PF, dst, src, 16, |d, i| {
                let g = _mm512_cvtph_ps(_mm256_loadu_si256(s.as_ptr().add(i).cast()));
                _mm512_storeu_ps(d.add(i), _mm512_add_ps(_mm512_loadu_ps(d.add(i)), g))
            }),
            Grad::Bf16(s) => add_loop!(PF, dst, src, 16, |d, i| {
                let g = _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(s.as_ptr().add(i).cast())));
                _mm512_storeu_ps(d.add(i), _mm512_add_ps(_mm512_loadu_ps(d.add(i)), _mm512_castsi512_ps(g)))
            }),
        }
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn add_avx2<const PF: bool>(dst: &mut [f32], src: Grad<'_>) {
        match src {
            Grad::F32([]) => add_loop!(PF, dst, src, 8, |d, i| _mm256_storeu_ps(
                d.add(i),
                _mm256_add_ps(_mm256_loadu_ps(d.add(i)), _mm256_set1_ps(1.0))
            )),
            Grad::F32(s) => add_loop!(PF, dst, src, 8, |d, i| {
                _mm256_storeu_ps(d.add(i), _mm256_add_ps(_mm256_loadu_ps(d.add(i)), _mm256_loadu_ps(s.as_ptr().add(i))))
            }),
            Grad::F16(s) => add_loop!(PF, dst, src, 8, |d, i| {
                let g = _mm256_cvtph_ps(_mm_loadu_si128(s.as_ptr().add(i).cast()));
                _mm256_storeu_ps(d.add(i), _mm256_add_ps(_mm256_loadu_ps(d.add(i)), g))
            }),
            Grad::Bf16(s) => add_loop!(PF, dst, src, 8, |d, i| {
                let g = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(s.as_ptr().add(i).cast())));
                _mm256_storeu_ps(d.add(i), _mm256_add_ps(_mm256_loadu_ps(d.add(i)), _mm256_castsi256_ps(g)))
            }),
        }
    }

    /// Four independent accumulators, so the sum runs at load speed rather than add latency.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn sum_avx512<const PF: bool>(buf: &[f32]) -> f32 {
        let n = buf.len() / 64 * 64;
        let p = buf.as_ptr();
        let mut acc = [_mm512_setzero_ps(); 4];
        for i in (0..n).step_by(64) {
            for (k, a) in acc.iter_mut().enumerate() {
                if PF {
                    prefetch(p, i + 16 * k);
                }
                *a = _mm512_add_ps(*a, _mm512_loadu_ps(p.add(i + 16 * k)));
            }
        }
        let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
        _mm512_reduce_add_ps(v) + buf[n..].iter().sum::<f32>()
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn sum_avx2<const PF: bool>(buf: &[f32]) -> f32 {
        let n = buf.len() / 32 * 32;
        let p = buf.as_ptr();
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in (0..n).step_by(32) {
            if PF {
                prefetch(p, i);
                prefetch(p, i + 16);
            }
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
