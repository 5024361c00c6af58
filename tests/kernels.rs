//! The CPU kernels against an independent reference: 16-bit values decoded by the `half` crate,
//! the contract's f32 arithmetic written out here, and f64 math. Every ISA path the CPU supports
//! and several thread counts must give the same bits. Data is random with a fresh seed each run; a
//! failing run prints its seed, and `GRADACC_TEST_SEED=<seed>` replays it.

use gradacc::math;
use gradacc::simd::{self, Isa};
use gradacc::Grad;
use half::{bf16, f16};

const THREADS: [usize; 3] = [1, 2, 3];
const SIZES: [usize; 5] = [0, 1, 7, 4097, (1 << 20) + 3];

// ---------------------------------------------------------------------------------------------
// Random data

/// splitmix64: small, fast, and good enough to spread test values over every bit pattern.
struct Rng(u64);

impl Rng {
    /// A generator for one test: the run's seed (printed, so a failure can be replayed) mixed with
    /// the test's name, so tests draw different values from one seed.
    fn for_test(name: &str) -> Rng {
        let seed = match std::env::var("GRADACC_TEST_SEED") {
            Ok(s) => s.trim().parse().expect("GRADACC_TEST_SEED must be an unsigned integer"),
            Err(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64,
        };
        eprintln!("{name}: replay with GRADACC_TEST_SEED={seed}");
        let mut rng = Rng(seed);
        for b in name.bytes() {
            rng.0 ^= b as u64;
            rng.next();
        }
        rng
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A finite f32 with a random sign, mantissa and an exponent in `[-exp_range, exp_range]`.
    fn f32_in(&mut self, exp_range: i32) -> f32 {
        let exp = (127 - exp_range + self.below(2 * exp_range as u64 + 1) as i32) as u32;
        f32::from_bits(((self.next() as u32) & 0x807f_ffff) | (exp << 23))
    }

    /// A finite gradient value of `dtype`, as bits: f16 over its whole finite range (subnormals
    /// included), bf16 and f32 with exponents in `[-spread, spread]`.
    fn grad_bits(&mut self, dtype: Dtype, spread: i32) -> u32 {
        match dtype {
            Dtype::F16 => loop {
                let b = self.next() as u16;
                if b & 0x7c00 != 0x7c00 {
                    return b as u32;
                }
            },
            Dtype::Bf16 => self.f32_in(spread).to_bits() >> 16,
            Dtype::F32 => self.f32_in(spread).to_bits(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Gradient buffers of each dtype, stored as raw bits so one type serves all three

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dtype {
    F32,
    F16,
    Bf16,
}

const DTYPES: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];

enum Buf {
    F32(Vec<f32>),
    U16(Dtype, Vec<u16>),
}

impl Buf {
    fn from_bits(dtype: Dtype, bits: impl Iterator<Item = u32>) -> Buf {
        match dtype {
            Dtype::F32 => Buf::F32(bits.map(f32::from_bits).collect()),
            _ => Buf::U16(dtype, bits.map(|b| b as u16).collect()),
        }
    }

    fn random(rng: &mut Rng, dtype: Dtype, len: usize, spread: i32) -> Buf {
        Buf::from_bits(dtype, (0..len).map(|_| rng.grad_bits(dtype, spread)))
    }

    fn grad(&self, start: usize) -> Grad<'_> {
        match self {
            Buf::F32(v) => Grad::F32(&v[start..]),
            Buf::U16(Dtype::F16, v) => Grad::f16_bits(&v[start..]),
            Buf::U16(_, v) => Grad::bf16_bits(&v[start..]),
        }
    }

    /// Element `i` as f32, decoded by the `half` crate, not by gradacc.
    fn value(&self, i: usize) -> f32 {
        match self {
            Buf::F32(v) => v[i],
            Buf::U16(Dtype::F16, v) => f16::from_bits(v[i]).to_f32(),
            Buf::U16(_, v) => bf16::from_bits(v[i]).to_f32(),
        }
    }

    fn set(&mut self, i: usize, value: f32) {
        match self {
            Buf::F32(v) => v[i] = value,
            Buf::U16(Dtype::F16, v) => v[i] = f16::from_f32(value).to_bits(),
            Buf::U16(_, v) => v[i] = bf16::from_f32(value).to_bits(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// Equal bits, or both NaN (NaN payloads may differ between paths; NaN-ness may not).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn assert_same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| !same(got[i], want[i])) {
        panic!(
            "{what}: element {i} of {}: got {:e} ({:#010x}), want {:e} ({:#010x})",
            got.len(),
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// Every (ISA, thread count) pair to run, scalar on one thread first.
fn paths() -> Vec<(Isa, usize)> {
    simd::supported_isas().into_iter().flat_map(|isa| THREADS.map(|t| (isa, t))).collect()
}

/// The contract's arithmetic, written out in f32: a rounded multiply, then a rounded add.
fn reference(master: &[f32], grad: &Buf, g0: usize, factor: f32, assign: bool) -> Vec<f32> {
    (0..master.len())
        .map(|i| {
            let v = grad.value(g0 + i) * factor;
            if assign {
                v
            } else {
                master[i] + v
            }
        })
        .collect()
}

/// The f32 reference is within rounding of the exact result: a multiply and an add each round
/// once by at most half an ulp, so the error is at most 2^-23 (|m| + |g·f|), plus the
/// absolute error of a subnormal result.
fn assert_close_to_exact(
    what: &str,
    master: &[f32],
    grad: &Buf,
    g0: usize,
    factor: f32,
    assign: bool,
    result: &[f32],
) {
    for (i, &r) in result.iter().enumerate() {
        let m = if assign { 0.0 } else { master[i] as f64 };
        let p = grad.value(g0 + i) as f64 * factor as f64;
        let exact = m + p;
        if !r.is_finite() {
            assert!(
                exact.abs() >= f32::MAX as f64,
                "{what}: element {i}: {r} from finite {exact:e}"
            );
            continue;
        }
        let bound = f64::powi(2.0, -23) * (m.abs() + p.abs()) + f64::powi(2.0, -149);
        assert!((r as f64 - exact).abs() <= bound, "{what}: element {i}: {r:e} vs exact {exact:e}");
    }
}

/// Runs `accumulate` on copies of `master[m0..]` with the gradient from `g0`.
fn run_accumulate(
    isa: Isa,
    threads: usize,
    master: &[f32],
    grad: &Buf,
    g0: usize,
    factor: f32,
    assign: bool,
) -> (Vec<f32>, bool) {
    let mut out = master.to_vec();
    let bad =
        simd::with_isa(isa, || simd::accumulate(&mut out, grad.grad(g0), factor, assign, threads));
    (out, bad)
}

// ---------------------------------------------------------------------------------------------
// Accumulate

#[test]
fn accumulate_matches_reference_on_every_path() {
    let mut rng = Rng::for_test("accumulate_matches_reference_on_every_path");
    for dtype in DTYPES {
        for len in SIZES {
            for offset in 0..=7 {
                // Master and gradient start at different element offsets, so their alignments
                // differ.
                let (m0, g0) = (offset, (offset * 3 + 1) % 8);
                // Narrow exponent ranges make master and update comparable, so the add rounds
                // often.
                let spread = [2, 40][offset % 2];
                let grad = Buf::random(&mut rng, dtype, g0 + len, spread);
                let master_buf: Vec<f32> = (0..m0 + len).map(|_| rng.f32_in(spread)).collect();
                let master = &master_buf[m0..];
                let factor = rng.f32_in(spread.min(12)).abs();
                for assign in [false, true] {
                    let want = reference(master, &grad, g0, factor, assign);
                    let want_bad = want.iter().any(|v| !v.is_finite());
                    let what = format!(
                        "{dtype:?} len {len} offsets {m0}/{g0} assign {assign} factor {factor:e}"
                    );
                    assert_close_to_exact(&what, master, &grad, g0, factor, assign, &want);
                    let mut scalar_result = None;
                    for (isa, threads) in paths() {
                        let what = format!("{what} {} threads {threads}", isa.name());
                        let (got, bad) =
                            run_accumulate(isa, threads, master, &grad, g0, factor, assign);
                        assert_same(&what, &got, &want);
                        assert_eq!(bad, want_bad, "{what}: non-finite flag");
                        let scalar = scalar_result.get_or_insert(got.clone());
                        assert!(
                            got.iter().zip(scalar.iter()).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{what}: differs from scalar"
                        );
                    }
                }
            }
        }
    }
}

/// A buffer with room for `len` elements that start `offset` bytes past a 4 KiB boundary, filled
/// with `fill`, and the index of that start: the kernels choose their loop by where the master and
/// the gradient lie modulo 4 KiB.
fn at_page_offset<T: Copy>(fill: T, offset: usize, len: usize) -> (Vec<T>, usize) {
    let size = std::mem::size_of::<T>();
    assert_eq!(offset % size, 0, "offset {offset} is not a whole number of elements");
    let buf = vec![fill; (offset + 2 * 4096) / size + len];
    let start = buf.as_ptr().align_offset(4096) + offset / size;
    (buf, start)
}

#[test]
fn accumulate_gives_the_same_bits_wherever_the_buffers_lie() {
    let mut rng = Rng::for_test("accumulate_gives_the_same_bits_wherever_the_buffers_lie");
    // Master minus gradient modulo 4 KiB, in bytes: inside the window where the f32 kernel runs
    // backward (1..256) and on both sides of it, at several alignments.
    let distances = [0, 4, 16, 48, 128, 252, 256, 1028, 4048, 4092];
    for len in [1, 7, 31, 33, 100, 4097, 70_001, (1 << 20) + 3] {
        for distance in distances {
            let master_offset = 4 * rng.below(1024) as usize;
            let grad_offset = (master_offset + 4096 - distance) % 4096;
            let (grad_buf, g0) = at_page_offset(0.0f32, grad_offset, len);
            let grad_at = grad_buf[g0..].as_ptr() as usize;
            let mut grad = Buf::F32(grad_buf);
            for i in 0..len {
                grad.set(g0 + i, f32::from_bits(rng.grad_bits(Dtype::F32, 2)));
            }
            // One non-finite value, in the first, last or some vector, for half the placements.
            let planted = (distance % 8 == 0)
                .then(|| [0, len - 1, rng.below(len as u64) as usize][rng.below(3) as usize]);
            if let Some(pos) = planted {
                grad.set(g0 + pos, f32::INFINITY);
            }
            let master: Vec<f32> = (0..len).map(|_| rng.f32_in(2)).collect();
            let factor = rng.f32_in(2).abs();
            // Every run writes into the same placed buffer; the guard value around it must survive.
            let guard = -1.5f32;
            let (mut out, m0) = at_page_offset(guard, master_offset, len);
            assert_eq!(
                (out[m0..].as_ptr() as usize).wrapping_sub(grad_at) % 4096,
                distance,
                "placement"
            );
            for assign in [false, true] {
                let want = reference(&master, &grad, g0, factor, assign);
                for (isa, threads) in paths() {
                    let what = format!(
                        "len {len} distance {distance} assign {assign} {} threads {threads}",
                        isa.name()
                    );
                    out[m0..m0 + len].copy_from_slice(&master);
                    let bad = simd::with_isa(isa, || {
                        simd::accumulate(
                            &mut out[m0..m0 + len],
                            grad.grad(g0).slice(0, len),
                            factor,
                            assign,
                            threads,
                        )
                    });
                    assert_same(&what, &out[m0..m0 + len], &want);
                    assert_eq!(bad, planted.is_some(), "{what}: non-finite flag");
                    assert!(
                        out[..m0].iter().chain(&out[m0 + len..]).all(|&v| v == guard),
                        "{what}: wrote outside the slice"
                    );
                }
            }
        }
    }
}

/// Sizes for the non-finite tests: long ones split over threads, with the bad value also at a
/// thread boundary.
const FLAG_SIZES: [usize; 4] = [1, 7, 4097, (1 << 20) + 3];

#[test]
fn accumulate_flags_non_finite_inputs_anywhere() {
    let mut rng = Rng::for_test("accumulate_flags_non_finite_inputs_anywhere");
    for dtype in DTYPES {
        for len in FLAG_SIZES {
            let clean = Buf::random(&mut rng, dtype, len, 40);
            let master: Vec<f32> = (0..len).map(|_| rng.f32_in(20)).collect();
            for (isa, threads) in paths() {
                for assign in [false, true] {
                    let (_, bad) = run_accumulate(isa, threads, &master, &clean, 0, 0.5, assign);
                    assert!(
                        !bad,
                        "{dtype:?} len {len} {} threads {threads}: flag on clean data",
                        isa.name()
                    );
                }
            }
            let mut positions = vec![0, len / 2, len - 1];
            if len > 2 * math::NORM_BLOCK {
                positions.extend([math::NORM_BLOCK * (len / math::NORM_BLOCK / 2), len - 1 - 63]);
            }
            let specials = [f32::INFINITY, f32::NAN, f32::NEG_INFINITY];
            for (k, pos) in positions.into_iter().enumerate() {
                // Two of the three specials at each position, NaN among them at the first and the
                // last.
                for bad_value in [specials[k % 3], specials[(k + 1) % 3]] {
                    let mut grad = Buf::random(&mut rng, dtype, len, 40);
                    grad.set(pos, bad_value);
                    for (isa, threads) in paths() {
                        for assign in [false, true] {
                            let what = format!("{dtype:?} len {len} {bad_value} at {pos} {} threads {threads} assign {assign}", isa.name());
                            let (got, bad) =
                                run_accumulate(isa, threads, &master, &grad, 0, 0.5, assign);
                            assert!(bad, "{what}: flag not raised");
                            assert!(
                                !got[pos].is_finite() && (got[pos].is_nan() == bad_value.is_nan()),
                                "{what}: wrote {}",
                                got[pos]
                            );
                            assert_same(&what, &got, &reference(&master, &grad, 0, 0.5, assign));
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn accumulate_flags_overflow_from_the_factor_or_the_sum_only() {
    // (dtype, bits of 1.0, largest finite value, a factor it survives, a factor it overflows with)
    let cases = [
        (Dtype::F32, 1.0f32.to_bits(), f32::MAX, 1.0, 2.0),
        (Dtype::F16, 0x3c00, 65504.0, 1e33, 1e34),
        (Dtype::Bf16, 0x3f80, bf16::MAX.to_f32(), 1.0, 1.5),
    ];
    for (dtype, one, big, fine, overflows) in cases {
        for len in FLAG_SIZES {
            for pos in [0, len / 2, len - 1] {
                let mut grad =
                    Buf::from_bits(dtype, (0..len).map(|i| if i % 2 == 0 { one } else { 0 }));
                grad.set(pos, big);
                assert_eq!(grad.value(pos), big);
                let zeros = vec![0.0f32; len];
                let mut big_master = zeros.clone();
                big_master[pos] = f32::MAX;
                for (isa, threads) in paths() {
                    let what = format!(
                        "{dtype:?} len {len} big at {pos} {} threads {threads}",
                        isa.name()
                    );
                    let (got, bad) = run_accumulate(isa, threads, &zeros, &grad, 0, fine, false);
                    assert!(!bad && got[pos].is_finite(), "{what}: flag raised by factor {fine}");
                    let (got, bad) =
                        run_accumulate(isa, threads, &zeros, &grad, 0, overflows, true);
                    assert!(
                        bad && got[pos] == f32::INFINITY,
                        "{what}: overflow by factor {overflows} not flagged"
                    );
                    // Finite after the multiply (half of f32::MAX), infinite only after the add.
                    let (got, bad) = run_accumulate(
                        isa,
                        threads,
                        &big_master,
                        &grad,
                        0,
                        f32::MAX / 2.0 / big,
                        false,
                    );
                    assert!(
                        bad && got[pos] == f32::INFINITY,
                        "{what}: overflow in the add not flagged"
                    );
                }
            }
        }
    }
}

fn half_f16(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

fn half_bf16(bits: u16) -> f32 {
    bf16::from_bits(bits).to_f32()
}

#[test]
fn f16_and_bf16_decode_every_bit_pattern_on_every_path() {
    for (dtype, decode) in [(Dtype::F16, half_f16 as fn(u16) -> f32), (Dtype::Bf16, half_bf16)] {
        let grad = Buf::from_bits(dtype, 0..=0xffff);
        let want: Vec<f32> = (0..=0xffff).map(decode).collect();
        for (isa, threads) in paths() {
            let what = format!("{dtype:?} decode {}", isa.name());
            // Multiplying by 1 is exact, so the pass writes the decoded values themselves.
            let (got, bad) = run_accumulate(isa, threads, &vec![7.0; 1 << 16], &grad, 0, 1.0, true);
            assert_same(&what, &got, &want);
            assert!(bad, "{what}: infinities and NaNs not flagged");
        }
    }
}

#[test]
#[should_panic(expected = "lengths differ")]
fn accumulate_rejects_length_mismatch() {
    simd::accumulate(&mut [0.0; 3], Grad::F32(&[1.0; 4]), 1.0, false, 1);
}

// ---------------------------------------------------------------------------------------------
// Per-element conversions in `math`, against `half`

#[test]
fn f16_decoder_matches_half_on_all_65536_patterns() {
    for bits in 0..=0xffffu16 {
        let (got, want) = (math::f16_to_f32(bits), f16::from_bits(bits).to_f32());
        assert!(
            same(got, want),
            "f16 {bits:#06x}: got {got:e} ({:#010x}), want {want:e}",
            got.to_bits()
        );
        assert!(same(math::bf16_to_f32(bits), bf16::from_bits(bits).to_f32()), "bf16 {bits:#06x}");
    }
}

// ---------------------------------------------------------------------------------------------
// scale, sum_squares, add_assign

#[test]
fn scale_is_a_rounded_multiply_on_every_path() {
    let mut rng = Rng::for_test("scale_is_a_rounded_multiply_on_every_path");
    for len in SIZES {
        for offset in 0..=7 {
            let buf: Vec<f32> = (0..offset + len).map(|_| rng.f32_in(60)).collect();
            let factor = rng.f32_in(60);
            let want: Vec<f32> = buf[offset..].iter().map(|&v| v * factor).collect();
            for (isa, threads) in paths() {
                let mut got = buf.clone();
                simd::with_isa(isa, || simd::scale(&mut got[offset..], factor, threads));
                assert_same(
                    &format!("scale len {len} offset {offset} {} threads {threads}", isa.name()),
                    &got[offset..],
                    &want,
                );
                assert_eq!(got[..offset], buf[..offset], "scale wrote before its slice");
            }
        }
    }
}

/// The documented fold of the block sums, written out independently: sum `b` into lane
/// `b % 8192`, each lane in block order from 0; then, over the smallest power of two of lanes
/// that covers the used ones (the rest 0), lane `j += lane j + w` for `w` halving down to 1.
fn fold_by_definition(sums: &[f64]) -> f64 {
    let used = sums.len().min(8192);
    let mut covering = 1;
    while covering < used {
        covering *= 2;
    }
    let mut lanes = vec![0.0f64; covering];
    for (b, &sum) in sums.iter().enumerate() {
        lanes[b % 8192] += sum;
    }
    let mut width = covering / 2;
    while width > 0 {
        for j in 0..width {
            lanes[j] += lanes[j + width];
        }
        width /= 2;
    }
    lanes[0]
}

#[test]
fn block_sums_fold_in_the_documented_shape() {
    let mut rng = Rng::for_test("block_sums_fold_in_the_documented_shape");
    assert_eq!(math::FOLD_LANES, 8192);
    assert_eq!(simd::fold_block_sums(&[]).to_bits(), 0.0f64.to_bits());
    for n in [1, 2, 3, 5, 255, 256, 257, 4097, 8191, 8192, 8193, 3 * 8192 + 1234] {
        // Sums of similar size: every change of order changes the bits.
        let sums: Vec<f64> = (0..n).map(|_| 1.0 + rng.f32_in(1).abs() as f64).collect();
        let (got, want) = (simd::fold_block_sums(&sums), fold_by_definition(&sums));
        assert_eq!(got.to_bits(), want.to_bits(), "{n} sums: {got:e} vs {want:e}");
        // Trailing zero sums (a sharded layout's padding) change nothing.
        let mut padded = sums.clone();
        padded.resize(n + 5000, 0.0);
        assert_eq!(simd::fold_block_sums(&padded).to_bits(), want.to_bits(), "{n} padded");
    }
}

/// The documented definition of the sum of squares, written out independently: per block, lane
/// `j` sums the squares of elements `j, j + 16, …` in order; lanes combine by halving; block sums
/// fold as [`fold_by_definition`].
fn sum_squares_by_definition(buf: &[f32]) -> f64 {
    let mut sums = Vec::new();
    for block in buf.chunks(math::NORM_BLOCK) {
        let mut lanes = [0.0f64; 16];
        for (i, &v) in block.iter().enumerate() {
            lanes[i % 16] += v as f64 * v as f64;
        }
        for width in [8, 4, 2, 1] {
            for j in 0..width {
                lanes[j] += lanes[j + width];
            }
        }
        sums.push(lanes[0]);
    }
    fold_by_definition(&sums)
}

#[test]
fn sum_squares_has_the_same_bits_on_every_path_and_thread_count() {
    let mut rng = Rng::for_test("sum_squares_has_the_same_bits_on_every_path_and_thread_count");
    // Last blocks that are full, shorter than a lane group, or whole lane groups plus a remainder.
    // A remainder's rounding only shows in the bits when its block is the first or only one.
    let extra = [
        89,
        math::NORM_BLOCK - 1,
        math::NORM_BLOCK,
        3 * math::NORM_BLOCK + 15,
        (1 << 21) + 4096 * 5 + 1000,
    ];
    for len in SIZES.into_iter().chain(extra) {
        for offset in [0, 1, 5] {
            // Squares of similar size, so every change of summation order changes the bits.
            let spread = [2, 60][(offset == 5) as usize];
            let buf: Vec<f32> = (0..offset + len).map(|_| rng.f32_in(spread)).collect();
            let buf = &buf[offset..];
            let want = sum_squares_by_definition(buf);
            let exact: f64 = buf.iter().map(|&v| v as f64 * v as f64).sum();
            assert!(
                (want - exact).abs() <= 1e-12 * exact,
                "definition {want:e} vs naive {exact:e}"
            );
            for (isa, threads) in paths() {
                let got = simd::with_isa(isa, || simd::sum_squares(buf, threads));
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "sum_squares len {len} offset {offset} {} threads {threads}: {got:e} vs {want:e}",
                    isa.name()
                );
            }
        }
    }
    for (isa, threads) in paths() {
        let with = |v: f32| {
            let mut buf = vec![1.0f32; 4097];
            buf[4096] = v;
            simd::with_isa(isa, || simd::sum_squares(&buf, threads))
        };
        assert!(with(f32::NAN).is_nan());
        assert_eq!(with(f32::NEG_INFINITY), f64::INFINITY);
        assert_eq!(with(f32::MAX), 4096.0 + f32::MAX as f64 * f32::MAX as f64);
        assert_eq!(
            simd::with_isa(isa, || simd::sum_squares(&[], threads)).to_bits(),
            0.0f64.to_bits()
        );
    }
}

#[test]
fn scale_and_sum_squares_equals_the_two_passes_on_every_path() {
    let mut rng = Rng::for_test("scale_and_sum_squares_equals_the_two_passes_on_every_path");
    let extra = [math::NORM_BLOCK - 1, 3 * math::NORM_BLOCK + 15, (1 << 21) + 4096 * 5 + 1000];
    for len in SIZES.into_iter().chain(extra) {
        let offset = rng.below(8) as usize;
        let buf: Vec<f32> = (0..offset + len).map(|_| rng.f32_in(2)).collect();
        let factor = rng.f32_in(10);
        let want_sum = sum_squares_by_definition(&buf[offset..]);
        let want: Vec<f32> = buf[offset..].iter().map(|&v| v * factor).collect();
        for (isa, threads) in paths() {
            let mut got = buf.clone();
            let sum = simd::with_isa(isa, || {
                simd::scale_and_sum_squares(&mut got[offset..], factor, threads)
            });
            let what = format!(
                "scale_and_sum_squares len {len} offset {offset} {} threads {threads}",
                isa.name()
            );
            assert_eq!(sum.to_bits(), want_sum.to_bits(), "{what}: {sum:e} vs {want_sum:e}");
            assert_same(&what, &got[offset..], &want);
        }
    }
}

/// The block sums written out by the definition, one per block.
fn block_sums_by_definition(buf: &[f32]) -> Vec<f64> {
    buf.chunks(math::NORM_BLOCK).map(sum_squares_by_definition).collect()
}

fn assert_same_f64(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!("{what}: block {i} of {}: got {:e}, want {:e}", got.len(), got[i], want[i]);
    }
}

#[test]
fn block_sums_are_the_definition_per_block_and_fold_to_sum_squares() {
    let mut rng = Rng::for_test("block_sums_are_the_definition_per_block_and_fold_to_sum_squares");
    let extra = [math::NORM_BLOCK - 1, 3 * math::NORM_BLOCK + 15, (1 << 21) + 4096 * 5 + 1000];
    for len in SIZES.into_iter().chain(extra) {
        let buf: Vec<f32> = (0..len).map(|_| rng.f32_in(2)).collect();
        let factor = rng.f32_in(10);
        let want = block_sums_by_definition(&buf);
        assert_eq!(
            simd::fold_block_sums(&want).to_bits(),
            sum_squares_by_definition(&buf).to_bits()
        );
        let want_scaled: Vec<f32> = buf.iter().map(|&v| v * factor).collect();
        for (isa, threads) in paths() {
            let what = format!("len {len} {} threads {threads}", isa.name());
            let mut got = vec![0.0; simd::blocks(len)];
            simd::with_isa(isa, || simd::block_sum_squares(&buf, &mut got, threads));
            assert_same_f64(&format!("block_sum_squares {what}"), &got, &want);
            let mut scaled = buf.clone();
            got.fill(-1.0);
            simd::with_isa(isa, || {
                simd::scale_and_block_sum_squares(&mut scaled, factor, &mut got, threads)
            });
            assert_same_f64(&format!("scale_and_block_sum_squares {what}"), &got, &want);
            assert_same(&format!("scale_and_block_sum_squares {what}"), &scaled, &want_scaled);
        }
    }
}

#[test]
fn add_and_block_sum_squares_equals_the_separate_passes_on_every_path() {
    let mut rng =
        Rng::for_test("add_and_block_sum_squares_equals_the_separate_passes_on_every_path");
    // Blocks that end in a whole vector group, exactly or after a partial last block.
    let extra = [
        math::NORM_BLOCK - 1,
        2 * math::NORM_BLOCK,
        math::NORM_BLOCK + 32,
        3 * math::NORM_BLOCK + 15,
        (1 << 20) + 4096 * 5 + 1000,
    ];
    for len in SIZES.into_iter().chain(extra) {
        let (offset, addend_offset) = (rng.below(8) as usize, rng.below(8) as usize);
        // GUARD elements after the slice catch a write past its end.
        const GUARD: usize = 24;
        let mut buf: Vec<f32> = (0..offset + len + GUARD).map(|_| rng.f32_in(2)).collect();
        let mut addend: Vec<f32> = (0..addend_offset + len).map(|_| rng.f32_in(2)).collect();
        if len > 1 {
            // One NaN (a single one, so no two payloads meet) and one sum that overflows to inf.
            let (nan, big) = (rng.below(len as u64) as usize, rng.below(len as u64) as usize);
            buf[offset + nan] = f32::NAN;
            if big != nan {
                (buf[offset + big], addend[addend_offset + big]) = (3e38, 3e38);
            }
        }
        let addend = &addend[addend_offset..];
        let factor = rng.f32_in(10);
        let sum: Vec<f32> =
            buf[offset..offset + len].iter().zip(addend).map(|(&a, &b)| a + b).collect();
        let want_sums = block_sums_by_definition(&sum);
        for (scale, want) in
            [(None, sum.clone()), (Some(factor), sum.iter().map(|&v| v * factor).collect())]
        {
            for isa in simd::supported_isas() {
                let what = format!(
                    "add_and_block_sum_squares len {len} offset {offset} scale {scale:?} {}",
                    isa.name()
                );
                let mut got = buf.clone();
                let mut sums = vec![-1.0; simd::blocks(len)];
                simd::with_isa(isa, || {
                    simd::add_and_block_sum_squares(
                        &mut got[offset..offset + len],
                        addend,
                        scale,
                        &mut sums,
                    )
                });
                assert_same_f64(&what, &sums, &want_sums);
                assert_same(&what, &got[offset..offset + len], &want);
                assert_eq!(got[..offset], buf[..offset], "{what}: wrote before its slice");
                assert_eq!(
                    got[offset + len..],
                    buf[offset + len..],
                    "{what}: wrote after its slice"
                );
            }
        }
    }
}

#[test]
fn add_assign_is_a_rounded_add_on_every_path() {
    let mut rng = Rng::for_test("add_assign_is_a_rounded_add_on_every_path");
    for len in SIZES {
        for offset in 0..=7 {
            let dst: Vec<f32> = (0..offset + len).map(|_| rng.f32_in(30)).collect();
            let src: Vec<f32> = (0..len + 3).map(|_| rng.f32_in(30)).collect();
            let src = &src[3..];
            let want: Vec<f32> = dst[offset..].iter().zip(src).map(|(&d, &s)| d + s).collect();
            for isa in simd::supported_isas() {
                let mut got = dst.clone();
                simd::with_isa(isa, || simd::add_assign(&mut got[offset..], src));
                assert_same(
                    &format!("add_assign len {len} offset {offset} {}", isa.name()),
                    &got[offset..],
                    &want,
                );
            }
        }
    }
}

/// A copy kernel: `dst = src`.
type CopyFn = fn(&mut [f32], &[f32]);

#[test]
fn copies_for_a_peer_copy_every_bit_on_every_path() {
    let mut rng = Rng::for_test("copies_for_a_peer_copy_every_bit_on_every_path");
    for len in SIZES {
        for offset in 0..=7 {
            let dst: Vec<f32> = (0..offset + len + 5).map(|_| rng.f32_in(30)).collect();
            // NaN payloads and negative zeros travel as bits.
            let src: Vec<f32> = (0..len + 3)
                .map(|i| {
                    if i % 11 == 0 {
                        f32::from_bits(0x7fc0_1234 ^ i as u32)
                    } else if i % 13 == 0 {
                        -0.0
                    } else {
                        rng.f32_in(30)
                    }
                })
                .collect();
            let src = &src[3..];
            // The streaming copy, and the copy the communicators stage with (one of the two).
            let copies: [(&str, CopyFn); 2] =
                [("copy_streaming", simd::copy_streaming), ("copy_for_peer", simd::copy_for_peer)];
            for (isa, (name, copy)) in
                simd::supported_isas().into_iter().flat_map(|isa| copies.map(|c| (isa, c)))
            {
                let mut got = dst.clone();
                simd::with_isa(isa, || copy(&mut got[offset..offset + len], src));
                let what = format!("{name} len {len} offset {offset} {}", isa.name());
                assert!(
                    got[offset..offset + len]
                        .iter()
                        .zip(src)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: bits differ"
                );
                assert_eq!(got[..offset], dst[..offset], "{what}: wrote before its slice");
                assert!(
                    got[offset + len..]
                        .iter()
                        .zip(&dst[offset + len..])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: wrote past it"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Choosing the path

#[test]
fn the_widest_path_is_the_default_and_every_path_can_be_forced() {
    let supported = simd::supported_isas();
    assert_eq!(supported[0], Isa::Scalar);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("f16c")
    {
        assert_eq!(supported.last(), Some(&Isa::Avx512));
    }
    if std::env::var_os("GRADACC_CPU_ISA").is_none() {
        assert_eq!(simd::active_isa(), *supported.last().unwrap());
    }
    for isa in Isa::ALL {
        let active = simd::with_isa(isa, simd::active_isa);
        assert_eq!(active, supported.iter().copied().filter(|&s| s <= isa).max().unwrap());
    }
}

/// Runs this test binary again with `GRADACC_CPU_ISA` set and checks the path it reports.
#[test]
fn gradacc_cpu_isa_selects_the_path_clamped_to_the_cpu() {
    let widest = *simd::supported_isas().last().unwrap();
    for (name, want) in [
        ("scalar", Isa::Scalar),
        ("avx2", Isa::Avx2.min(widest)),
        ("AVX512", widest),
        ("no-such-isa", widest),
    ] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "report_active_isa", "--nocapture", "--test-threads=1"])
            .env("GRADACC_CPU_ISA", name)
            .env("GRADACC_TEST_REPORT_ISA", "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "child failed: {stdout}");
        assert!(
            stdout.contains(&format!("active isa: {}\n", want.name())),
            "GRADACC_CPU_ISA={name}: {stdout}"
        );
    }
}

/// Helper for the test above; does nothing in a normal run.
#[test]
fn report_active_isa() {
    if std::env::var_os("GRADACC_TEST_REPORT_ISA").is_some() {
        println!("active isa: {}", simd::active_isa().name());
    }
}

/// The last micro-batch's add with the norm's blocks measured as it goes: bitwise the contract's
/// add of each tensor, then the blocks by definition over the whole buffer (padding and gaps
/// untouched and measured), with every piece handed on exactly once, on every path.
#[test]
fn accumulate_and_block_sum_squares_is_the_add_then_the_blocks() {
    let mut rng = Rng::for_test("accumulate_and_block_sum_squares_is_the_add_then_the_blocks");
    // Tensors sharing blocks, spanning blocks, and a run long enough for three threads' parts.
    let sizes = [1, 7, 64, 4095, 4097, 9000, 3 * (1 << 18) + 5];
    for round in 0..8 {
        let count = 1 + rng.below(5) as usize;
        let mut placed = Vec::new();
        let mut at = rng.below(3) as usize * 64;
        for k in 0..count {
            let len = match (round, k) {
                // At least one run that the threads cut.
                (1, 0) => sizes[sizes.len() - 1],
                _ => sizes[rng.below(sizes.len() as u64 - u64::from(round % 2 == 0)) as usize],
            };
            let dtype = DTYPES[rng.below(3) as usize];
            placed.push((at, Buf::random(&mut rng, dtype, len, 8), rng.below(2) == 0));
            // Gaps as the layout's padding leaves them, sometimes wider.
            at = (at + len).next_multiple_of(64) + 64 * rng.below(2) as usize;
        }
        if round == 3 {
            // A non-finite gradient: the flag, and an infinite block.
            placed[0].1.set(0, f32::INFINITY);
        }
        let len = at + rng.below(100) as usize;
        let master: Vec<f32> = (0..len).map(|_| rng.f32_in(8)).collect();
        let factor = rng.f32_in(4);
        let mut want = master.clone();
        for (start, grad, assign) in &placed {
            let n = grad_len(grad);
            let added = reference(&master[*start..start + n], grad, 0, factor, *assign);
            want[*start..start + n].copy_from_slice(&added);
        }
        let want_sums = block_sums_by_definition(&want);
        let want_bad = want.iter().any(|v| !v.is_finite());
        let tensors: Vec<simd::PlacedPass<'_>> = placed
            .iter()
            .map(|(start, grad, assign)| simd::PlacedPass {
                start: *start,
                grad: grad.grad(0),
                assign: *assign,
            })
            .collect();
        for (isa, threads) in paths() {
            let what = format!("round {round}, {} threads {threads}", isa.name());
            let mut got = master.clone();
            let mut sums = vec![-1.0; simd::blocks(len)];
            let seen = std::sync::Mutex::new(vec![0u32; len]);
            let measured = |at: usize, piece: &[f32]| {
                let mut seen = seen.lock().unwrap();
                assert!(at.is_multiple_of(math::NORM_BLOCK), "{what}: a piece at {at}");
                seen[at..at + piece.len()].iter_mut().for_each(|s| *s += 1);
            };
            let bad = simd::with_isa(isa, || {
                let (buf, out) = (&mut got, &mut sums);
                simd::accumulate_and_block_sum_squares(
                    buf, &tensors, factor, out, threads, &measured,
                )
            });
            assert_same(&what, &got, &want);
            assert_same_f64(&what, &sums, &want_sums);
            assert_eq!(bad, want_bad, "{what}: the non-finite flag");
            assert!(seen.into_inner().unwrap().iter().all(|&s| s == 1), "{what}: pieces");
        }
    }
}

fn grad_len(buf: &Buf) -> usize {
    match buf {
        Buf::F32(v) => v.len(),
        Buf::U16(_, v) => v.len(),
    }
}
