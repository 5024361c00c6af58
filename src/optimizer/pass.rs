//! One tensor's piece stepped in one pass: the update rule of `update.rs` over the FP32 gradient,
//! masters and state, each new master written into the model's weight as it is made. The loop is
//! instantiated per rule and per way of writing (f32, nearest even to f16 or bf16, stochastic), so
//! it holds no branch the compiler cannot lift out of it.

use super::rounding::{self, Rounding};
use crate::backend::cpu::MIN_ELEMENTS_PER_THREAD;
use super::update::Scalars;
use crate::math::{f32_to_bf16, f32_to_f16};
use crate::dtype::{Dtype, GradMut};

/// How a master weight becomes the model's weight; `i` is its place in the piece.
trait Write {
    type Out;
    fn write(&self, master: f32, i: usize) -> Self::Out;
}

struct Exact;

impl Write for Exact {
    type Out = f32;
    #[inline(always)]
    fn write(&self, master: f32, _: usize) -> f32 {
        master
    }
}

struct Nearest<const BF16: bool>;

impl<const BF16: bool> Write for Nearest<BF16> {
    type Out = u16;
    #[inline(always)]
    fn write(&self, master: f32, _: usize) -> u16 {
        if BF16 {
            f32_to_bf16(master)
        } else {
            f32_to_f16(master)
        }
    }
}

struct Stochastic {
    dtype: Dtype,
    /// The step's key.
    key: u64,
    /// The flat index of the piece's first element.
    base: u64,
}

impl Write for Stochastic {
    type Out = u16;
    #[inline(always)]
    fn write(&self, master: f32, i: usize) -> u16 {
        let r = rounding::draw(self.key, self.base + i as u64);
        rounding::stochastic(master, self.dtype, r)
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

/// [`step`] on up to `threads` threads, each taking a contiguous part: every element's
/// arithmetic and random draw are its own, so the bits do not depend on the thread count.
pub(crate) fn step_threads(
    k: &Scalars,
    piece: Piece<'_>,
    out: GradMut<'_>,
    rounding: Rounding,
    step_count: u64,
    base: usize,
    threads: usize,
) {
    let n = piece.grad.len();
    if threads <= 1 || n < 2 * MIN_ELEMENTS_PER_THREAD {
        return step(k, piece, out, rounding, step_count, base);
    }
    let left = threads / 2;
    let mid = n * left / threads;
    let ((p0, p1), (o0, o1)) = (piece.split_at(mid), out.split_at_mut(mid));
    std::thread::scope(|s| {
        s.spawn(move || step_threads(k, p0, o0, rounding, step_count, base, left));
        step_threads(k, p1, o1, rounding, step_count, base + mid, threads - left);
    });
}

/// Steps `piece` by `k` and writes its model weights `out` (the piece's part of the tensor),
/// `rounding` keyed by `step` and the flat index `base` of the piece's first element.
pub(crate) fn step(
    k: &Scalars,
    piece: Piece<'_>,
    out: GradMut<'_>,
    rounding: Rounding,
    step: u64,
    base: usize,
) {
    let stochastic =
        |dtype, seed| Stochastic { dtype, key: rounding::key(seed, step), base: base as u64 };
    match (out, rounding) {
        (GradMut::F32(o), _) => run(k, piece, o, &Exact),
        (GradMut::F16(o), Rounding::NearestEven) => run(k, piece, o, &Nearest::<false>),
        (GradMut::Bf16(o), Rounding::NearestEven) => run(k, piece, o, &Nearest::<true>),
        (GradMut::F16(o), Rounding::Stochastic { seed }) => {
            run(k, piece, o, &stochastic(Dtype::F16, seed))
        }
        (GradMut::Bf16(o), Rounding::Stochastic { seed }) => {
            run(k, piece, o, &stochastic(Dtype::Bf16, seed))
        }
    }
}

fn run<W: Write>(k: &Scalars, p: Piece<'_>, out: &mut [W::Out], w: &W) {
    let n = p.grad.len();
    assert!(p.master.len() == n && p.first.len() == n && out.len() == n, "a piece's slices");
    let rows = p.grad.iter().zip(p.master.iter_mut()).zip(p.first.iter_mut()).zip(out.iter_mut());
    match k {
        Scalars::AdamW(a) => {
            assert_eq!(p.second.len(), n, "AdamW's second moments");
            for (i, ((((g, x), m), o), v)) in rows.zip(p.second.iter_mut()).enumerate() {
                a.step(*g, x, m, v);
                *o = w.write(*x, i);
            }
        }
        Scalars::Sgd(s) => {
            for (i, (((g, x), b), o)) in rows.enumerate() {
                s.step(*g, x, b);
                *o = w.write(*x, i);
            }
        }
    }
}
