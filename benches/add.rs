//! Throughput of the CPU kernels next to two floors measured in the same run: a plain SIMD loop
//! with the same traffic (read the gradient and the master, write the master) but no multiply and
//! no non-finite check, and the plainest fused loop (`common::fused`: widen, multiply, add, store,
//! check, one vector at a time). The first ratio says what the fused pass costs beyond moving
//! bytes, the second what gradacc's loop costs beyond the one anybody would write.
//!
//! `cargo bench --bench add`; `GRADACC_CPU_ISA=avx2` (or `scalar`) benchmarks a narrower path.

mod common;

use std::time::Instant;

use common::{floor, floor_sum, fused, interleaved, kind, median, pattern, AlignedF32};
use gradacc::half::{bf16, f16};
use gradacc::simd;
use gradacc::Grad;

const SIZES: [usize; 2] = [16 << 20, 64 << 20];
const THREADS: [usize; 2] = [1, 2];
const REPEATS: usize = 7;
const FACTOR: f32 = 1.0 / 1024.0;

fn main() {
    let isa = simd::active_isa();
    println!(
        "gradacc CPU kernels, {} path, median of {REPEATS} runs after a warm-up\n",
        isa.name()
    );
    println!("| size | dtype | threads | ns/element | GB/s | floor ns/element | ratio to floor | plain fused ns/element | ratio to it |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    for &len in &SIZES {
        let mut master = AlignedF32::new(len);
        let f32_grad: Vec<f32> = (0..len).map(|i| pattern(i) as f32 / 8192.0 - 0.5).collect();
        let f16_grad: Vec<f16> = f32_grad.iter().map(|&v| f16::from_f32(v)).collect();
        let bf16_grad: Vec<bf16> = f32_grad.iter().map(|&v| bf16::from_f32(v)).collect();
        let grads = [
            ("f16", Grad::F16(&f16_grad)),
            ("bf16", Grad::Bf16(&bf16_grad)),
            ("f32", Grad::F32(&f32_grad)),
        ];
        for (name, grad) in grads {
            let bytes = (grad.dtype().size() + 8) as f64;
            for threads in THREADS {
                let times = compare(
                    &mut master,
                    |m| assert!(!simd::accumulate(m, grad, FACTOR, false, threads)),
                    |m| floor::<{ kind::ADD }>(isa, m, grad, threads),
                    |m| assert!(!fused(isa, &mut [m], &[grad], FACTOR, threads)),
                );
                row(len, name, threads, bytes, times);
            }
        }
        if len == *SIZES.last().unwrap() {
            for threads in THREADS {
                let times = compare(
                    &mut master,
                    |m| simd::scale(m, 0.999, threads),
                    |m| floor::<{ kind::ADD }>(isa, m, Grad::F32(&[]), threads),
                    |m| floor::<{ kind::ADD }>(isa, m, Grad::F32(&[]), threads),
                );
                row(len, "scale (f32)", threads, 8.0, times);
            }
            for threads in THREADS {
                let times = compare(
                    &mut master,
                    |m| assert!(simd::sum_squares(m, threads).is_finite()),
                    |m| assert!(floor_sum(isa, m, threads).is_finite()),
                    |m| assert!(floor_sum(isa, m, threads).is_finite()),
                );
                row(len, "sum_squares (f32)", threads, 4.0, times);
            }
            // The boundary's sweep over a rank's share, on one thread, as the communicators run it.
            let addend = vec![0.25f32; len];
            let times = compare(
                &mut master,
                |m| {
                    in_pieces(m, &addend, |m, a, sums| {
                        simd::add_and_block_sum_squares(m, a, Some(0.5), sums)
                    })
                },
                |m| in_pieces(m, &addend, |m, a, _| simd::add_assign(m, a)),
                |m| {
                    in_pieces(m, &addend, |m, a, sums| {
                        for ((m, a), sum) in m
                            .chunks_mut(gradacc::math::NORM_BLOCK)
                            .zip(a.chunks(gradacc::math::NORM_BLOCK))
                            .zip(sums)
                        {
                            simd::add_assign(m, a);
                            simd::block_sum_squares(m, std::slice::from_mut(sum), 1);
                            simd::scale(m, 0.5, 1);
                        }
                    })
                },
            );
            row(len, "boundary sweep (f32 + f32)", 1, 12.0, times);
        }
    }
    println!("\nGB/s counts the bytes each element moves once: the gradient (2 or 4 B) plus the master read");
    println!("and written (8 B); scale moves 8 B, sum_squares reads 4 B. The floor is a plain SIMD loop with");
    println!("the same traffic and no multiply or check (`dst += widen(src)`); the plain fused loop adds the");
    println!("multiply and the check, one vector at a time. The scale floor is the plain loop with no second");
    println!("input; the sum_squares floor is an f32 sum with no conversion to f64 (its two floor columns are");
    println!("two samples of the same loop). The boundary sweep (`add_and_block_sum_squares`: add a peer's");
    println!("FP32 share, sum the squares, normalise, in pieces as the communicators run it) moves 12 B; its");
    println!("floor is `add_assign` alone, and its third column is the three sweeps per block it replaces.");
    placement(isa);
}

/// Where the gradient lies below the master modulo 4 KiB, in bytes: inside the window where the
/// f32 SIMD loops run backward (16, 48, 144; 48 is a 64-byte-aligned master beside an `mmap`ed
/// `Vec`'s data, which starts 16 B into its page) and outside it (see `docs/kernels.md`, "Where
/// the buffers lie").
const DISTANCES: [usize; 6] = [0, 16, 48, 144, 1024, 4048];

/// `simd::accumulate` and the plain fused loop over the same master and gradient, placed at each of
/// `DISTANCES`, at sizes that live in L2, in L3, on both sides of `REVERSE_MAX` and from DRAM
/// (1 thread).
fn placement(isa: simd::Isa) {
    println!("\n| size | dtype | gradient below master (B, mod 4 KiB) | ns/element | plain fused ns/element | ratio to it (median of rounds) |");
    println!("|---:|---|---:|---:|---:|---:|");
    let mut worst = (0.0f64, String::new());
    for len in [64 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20] {
        for distance in DISTANCES {
            // The master 64 bytes into a page, as a 64-byte-aligned allocation of its own lands.
            let (mut master, m0) = placed(0.0f32, 64, len);
            let (mut f32_grad, g32) = placed(0.0f32, (64 + 4096 - distance) % 4096, len);
            let (mut f16_grad, g16) = placed(f16::ZERO, (64 + 4096 - distance) % 4096, len);
            for i in 0..len {
                f32_grad[g32 + i] = pattern(i) as f32 / 8192.0 - 0.5;
                f16_grad[g16 + i] = f16::from_f32(f32_grad[g32 + i]);
            }
            for (name, grad) in [
                ("f32", Grad::F32(&f32_grad[g32..g32 + len])),
                ("f16", Grad::F16(&f16_grad[g16..g16 + len])),
            ] {
                let mp = master[m0..].as_mut_ptr();
                // SAFETY: `mp` points at `len` f32s of `master`, and the two variants take turns.
                let m = || unsafe { std::slice::from_raw_parts_mut(mp, len) };
                let t = interleaved(
                    15,
                    0.005,
                    &mut [
                        &mut || assert!(!simd::accumulate(m(), grad, FACTOR, false, 1)),
                        &mut || assert!(!fused(isa, &mut [m()], &[grad], FACTOR, 1)),
                    ],
                );
                let ratio = t.ratio(0, 1).median;
                let size = if len >= 1 << 20 {
                    format!("{}M", len >> 20)
                } else {
                    format!("{}K", len >> 10)
                };
                println!(
                    "| {size} | {name} | {distance} | {:.3} | {:.3} | {ratio:.2} |",
                    t[0].median * 1e9 / len as f64,
                    t[1].median * 1e9 / len as f64
                );
                if ratio > worst.0 {
                    worst = (ratio, format!("{size} {name} at {distance} B"));
                }
            }
        }
    }
    println!(
        "\nWorst ratio to the plain fused loop over these placements: {:.2} ({}).",
        worst.0, worst.1
    );
}

/// A buffer with room for `len` elements that start `offset` bytes past a 4 KiB boundary, and the
/// index of that start.
fn placed<T: Copy>(fill: T, offset: usize, len: usize) -> (Vec<T>, usize) {
    let size = std::mem::size_of::<T>();
    let buf = vec![fill; (offset + 2 * 4096) / size + len];
    let start = buf.as_ptr().align_offset(4096) + offset / size;
    (buf, start)
}

/// `f(piece of master, piece of addend, its block sums)` over pieces of the communicators' share
/// size (`comm::shares::SHARE_NUMEL`, 64K elements), in order.
fn in_pieces(
    master: &mut [f32],
    addend: &[f32],
    mut f: impl FnMut(&mut [f32], &[f32], &mut [f64]),
) {
    const PIECE: usize = 64 * 1024;
    let mut sums = vec![0.0; simd::blocks(PIECE)];
    for (m, a) in master.chunks_mut(PIECE).zip(addend.chunks(PIECE)) {
        f(m, a, &mut sums[..simd::blocks(m.len())]);
    }
}

/// Median seconds of each of `runs` on `buf`: the kernel and two floors.
/// They take turns, so all see the same machine state, after one untimed run of each.
fn compare(
    buf: &mut AlignedF32,
    mut kernel: impl FnMut(&mut [f32]),
    mut plain: impl FnMut(&mut [f32]),
    mut fused: impl FnMut(&mut [f32]),
) -> [f64; 3] {
    let mut runs = [&mut kernel as &mut dyn FnMut(&mut [f32]), &mut plain, &mut fused];
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

fn row(len: usize, what: &str, threads: usize, bytes: f64, seconds: [f64; 3]) {
    let [ns, plain, fused] = seconds.map(|s| s * 1e9 / len as f64);
    println!(
        "| {}M | {what} | {threads} | {ns:.3} | {:.1} | {plain:.3} | {:.2} | {fused:.3} | {:.2} |",
        len >> 20,
        bytes / ns,
        ns / plain,
        ns / fused
    );
}
