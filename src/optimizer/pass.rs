//! One tensor's piece stepped in one pass: the update rule of `update.rs` over the FP32 gradient,
//! masters and state, each new master written into the model's weight as it is made. The loop is
//! instantiated per rule and per way of writing (f32, nearest even to f16 or bf16, stochastic), so
//! it holds no branch the compiler cannot lift out of it, and compiled once per instruction set
//! (`simd::isa`): the same scalar code, vectorized by the compiler at that width.

use half::slice::HalfFloatSliceExt;

use super::rounding::{self, Rounding};
use super::update::Scalars;
use crate::dtype::{Dtype, GradMut};
use crate::math::{f32_to_bf16, f32_to_f16};
use crate::simd::{active_isa, Isa, MIN_ELEMENTS_PER_THREAD};

/// How a master weight becomes the model's weight, element after element of a piece.
trait Write {
    type Out;
    fn write(&mut self, master: f32) -> Self::Out;
}

struct Exact;

impl Write for Exact {
    type Out = f32;
    #[inline(always)]
    fn write(&mut self, master: f32) -> f32 {
        master
    }
}

struct Nearest<const BF16: bool>;

impl<const BF16: bool> Write for Nearest<BF16> {
    type Out = u16;
    #[inline(always)]
    fn write(&mut self, master: f32) -> u16 {
        if BF16 {
            f32_to_bf16(master)
        } else {
            f32_to_f16(master)
        }
    }
}

/// Stochastic rounding to bf16 (`BF16`) or f16: the dtype is part of the type, so that the bf16
/// loop holds only integer arithmetic and vectorizes.
struct Stochastic<const BF16: bool> {
    /// The random counter of the next element (`rounding::counter`).
    counter: u64,
}

impl<const BF16: bool> Write for Stochastic<BF16> {
    type Out = u16;
    #[inline(always)]
    fn write(&mut self, master: f32) -> u16 {
        let r = rounding::draw_at(self.counter);
        self.counter = rounding::next(self.counter);
        rounding::stochastic(master, if BF16 { Dtype::Bf16 } else { Dtype::F16 }, r)
    }
}

/// The state of one piece: gradient, masters, first and (AdamW) second state values.
pub(crate) struct Piece<'a> {
    pub grad: &'a [f32],
    pub master: &'a mut [f32],
    pub first: &'a mut [f32],
    /// Empty for SGD.
    pub second: &'a mut [f32],
}

impl<'a> Piece<'a> {
    fn split_at(self, mid: usize) -> (Piece<'a>, Piece<'a>) {
        let (g0, g1) = self.grad.split_at(mid);
        let (x0, x1) = self.master.split_at_mut(mid);
        let (f0, f1) = self.first.split_at_mut(mid);
        let (s0, s1) = if self.second.is_empty() {
            (&mut [][..], &mut [][..])
        } else {
            self.second.split_at_mut(mid)
        };
        let piece = |grad, master, first, second| Piece { grad, master, first, second };
        (piece(g0, x0, f0, s0), piece(g1, x1, f1, s1))
    }
}

/// What a step does to every piece: the scalars, the rounding with its step, and the path.
#[derive(Clone, Copy)]
struct Job<'a> {
    k: &'a Scalars,
    rounding: Rounding,
    step: u64,
    /// Read once on the calling thread: [`crate::simd::with_isa`] is per thread.
    isa: Isa,
}

/// Steps `piece` by `k` and writes its model weights `out` (the piece's part of the tensor),
/// `rounding` keyed by `step` and the flat index `base` of the piece's first element, on up to
/// `threads` threads, each taking a contiguous part: every element's arithmetic and random draw
/// are its own, so the bits depend neither on the thread count nor on the instruction set.
pub(crate) fn step_threads(
    k: &Scalars,
    piece: Piece<'_>,
    out: GradMut<'_>,
    rounding: Rounding,
    step: u64,
    base: usize,
    threads: usize,
) {
    split(Job { k, rounding, step, isa: active_isa() }, piece, out, base, threads);
}

/// [`step_threads`] with the job fixed: halves of the threads on halves of the piece.
fn split(job: Job<'_>, piece: Piece<'_>, out: GradMut<'_>, base: usize, threads: usize) {
    let n = piece.grad.len();
    if threads <= 1 || n < 2 * MIN_ELEMENTS_PER_THREAD {
        return one(job, piece, out, base);
    }
    let left = threads / 2;
    let mid = n * left / threads;
    let ((p0, p1), (o0, o1)) = (piece.split_at(mid), out.split_at_mut(mid));
    std::thread::scope(|s| {
        s.spawn(move || split(job, p0, o0, base, left));
        split(job, p1, o1, base + mid, threads - left);
    });
}

/// [`step_threads`] on the calling thread.
fn one(job: Job<'_>, piece: Piece<'_>, out: GradMut<'_>, base: usize) {
    let (k, isa) = (job.k, job.isa);
    let counter = |seed| rounding::counter(rounding::key(seed, job.step), base as u64);
    match (out, job.rounding) {
        (GradMut::F32(o), _) => run(isa, k, piece, o, Exact),
        (GradMut::F16(o), Rounding::NearestEven) => {
            run(isa, k, piece, o.reinterpret_cast_mut(), Nearest::<false>)
        }
        (GradMut::Bf16(o), Rounding::NearestEven) => {
            run(isa, k, piece, o.reinterpret_cast_mut(), Nearest::<true>)
        }
        (GradMut::F16(o), Rounding::Stochastic { seed }) => {
            let w = Stochastic::<false> { counter: counter(seed) };
            run(isa, k, piece, o.reinterpret_cast_mut(), w)
        }
        (GradMut::Bf16(o), Rounding::Stochastic { seed }) => {
            let w = Stochastic::<true> { counter: counter(seed) };
            run(isa, k, piece, o.reinterpret_cast_mut(), w)
        }
    }
}

/// [`rows`] compiled for `isa`. The AVX-512 build also takes AVX-512DQ, whose 64-bit multiply
/// the stochastic rounding's hash needs (every AVX-512 CPU has it but the Xeon Phi, which runs
/// the AVX2 build).
fn run<W: Write>(isa: Isa, k: &Scalars, p: Piece<'_>, out: &mut [W::Out], w: W) {
    match isa {
        // SAFETY: `active_isa` reports Avx512 only after detecting AVX-512F, AVX2 and F16C, and
        // `with_isa` only narrows it; AVX-512DQ is detected here.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if std::arch::is_x86_feature_detected!("avx512dq") => unsafe {
            rows_avx512(k, p, out, w)
        },
        // SAFETY: `active_isa` reports Avx2 or wider only after detecting AVX2 and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { rows_avx2(k, p, out, w) },
        _ => rows(k, p, out, w),
    }
}

/// [`rows`] at AVX-512's width.
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512DQ, AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx2,f16c")]
unsafe fn rows_avx512<W: Write>(k: &Scalars, p: Piece<'_>, out: &mut [W::Out], w: W) {
    rows(k, p, out, w)
}

/// [`rows`] at AVX2's width.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn rows_avx2<W: Write>(k: &Scalars, p: Piece<'_>, out: &mut [W::Out], w: W) {
    rows(k, p, out, w)
}

/// The loop itself, inlined into each path so that it is compiled for the path's instructions.
#[inline(always)]
fn rows<W: Write>(k: &Scalars, p: Piece<'_>, out: &mut [W::Out], mut w: W) {
    let n = p.grad.len();
    assert!(p.master.len() == n && p.first.len() == n && out.len() == n, "a piece's slices");
    let rows = p.grad.iter().zip(p.master.iter_mut()).zip(p.first.iter_mut()).zip(out.iter_mut());
    match k {
        Scalars::AdamW(a) => {
            assert_eq!(p.second.len(), n, "AdamW's second moments");
            for ((((g, x), m), o), v) in rows.zip(p.second.iter_mut()) {
                a.step(*g, x, m, v);
                *o = w.write(*x);
            }
        }
        Scalars::Sgd(s) => {
            for (((g, x), b), o) in rows {
                s.step(*g, x, b);
                *o = w.write(*x);
            }
        }
    }
}
