//! One tensor's piece stepped in one pass: the update rule of `update.rs` over the FP32 gradient,
//! masters and state, each new master written into the model's weight as it is made. The loop is
//! instantiated per rule and per way of writing (f32, nearest even to f16 or bf16, stochastic), so
//! it holds no branch the compiler cannot lift out of it, and compiled once per instruction set
//! (`simd::isa`): the same scalar code, vectorized by the compiler at that width.

use half::slice::HalfFloatSliceExt;

use super::blockwise::{self, Blocks, BLOCK};
use super::format::{join_master, split_master, MomentFormat};
use super::fp8;
use super::rounding::{self, Rounding};
use super::update::Scalars;
use crate::dtype::{Dtype, GradMut};
use crate::math::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::simd::{active_isa, Isa, MIN_ELEMENTS_PER_THREAD};

/// How a master weight becomes the model's weight, element after element of a piece, and
/// (with no masters) how the weight reads back as the master: widened exactly.
trait Write {
    type Out;
    fn write(&mut self, master: f32) -> Self::Out;
    fn read(weight: &Self::Out) -> f32;
}

/// A 16-bit weight widened: bf16 (`BF16`) or f16.
#[inline(always)]
fn widen<const BF16: bool>(weight: u16) -> f32 {
    if BF16 {
        bf16_to_f32(weight)
    } else {
        f16_to_f32(weight)
    }
}

struct Exact;

/// No model weight: the pass writes the masters only (FP8 weights are quantised after it).
struct Discard;

impl Write for Discard {
    type Out = ();
    #[inline(always)]
    fn write(&mut self, _: f32) {}
    fn read(_: &()) -> f32 {
        unreachable!("FP8 weights (a pass of masters only) are checked to have FP32 masters")
    }
}

impl Write for Exact {
    type Out = f32;
    #[inline(always)]
    fn write(&mut self, master: f32) -> f32 {
        master
    }
    #[inline(always)]
    fn read(weight: &f32) -> f32 {
        *weight
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
    #[inline(always)]
    fn read(weight: &u16) -> f32 {
        widen::<BF16>(*weight)
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
    #[inline(always)]
    fn read(weight: &u16) -> f32 {
        widen::<BF16>(*weight)
    }
}

/// A column of held values: f32, or 16-bit words (bf16 moments, or the masters' remainders),
/// or 8-bit blockwise moments (from a block boundary); for the masters, `InWeights` when there
/// are none (the model's weights are the masters).
pub(crate) enum Cells<'a> {
    F32(&'a mut [f32]),
    U16(&'a mut [u16]),
    Blocks(Blocks<'a>),
    InWeights,
}

impl<'a> Cells<'a> {
    fn split_at(self, mid: usize) -> (Cells<'a>, Cells<'a>) {
        match self {
            Cells::F32(v) if !v.is_empty() => {
                let (a, b) = v.split_at_mut(mid);
                (Cells::F32(a), Cells::F32(b))
            }
            Cells::U16(v) if !v.is_empty() => {
                let (a, b) = v.split_at_mut(mid);
                (Cells::U16(a), Cells::U16(b))
            }
            Cells::Blocks(Blocks { codes, scales }) if !codes.is_empty() => {
                let (c0, c1) = codes.split_at_mut(mid);
                let (s0, s1) = scales.split_at_mut(mid / BLOCK);
                let blocks = |codes, scales| Cells::Blocks(Blocks { codes, scales });
                (blocks(c0, s0), blocks(c1, s1))
            }
            Cells::InWeights => (Cells::InWeights, Cells::InWeights),
            empty => (empty, Cells::F32(&mut [])),
        }
    }
}

/// Where a pass writes the model's weights: a piece of them, or nowhere (`MastersOnly`, of the
/// piece's length: the masters alone are the result).
pub(crate) enum Out<'a> {
    Weights(GradMut<'a>),
    MastersOnly(usize),
}

impl<'a> Out<'a> {
    fn split_at_mut(self, mid: usize) -> (Out<'a>, Out<'a>) {
        match self {
            Out::Weights(w) => {
                let (a, b) = w.split_at_mut(mid);
                (Out::Weights(a), Out::Weights(b))
            }
            Out::MastersOnly(n) => (Out::MastersOnly(mid), Out::MastersOnly(n - mid)),
        }
    }
}

/// The state of one piece: gradient, masters (or remainders), first and (AdamW) second state
/// values.
pub(crate) struct Piece<'a> {
    pub grad: &'a [f32],
    pub master: Cells<'a>,
    pub first: Cells<'a>,
    /// Empty for SGD.
    pub second: Cells<'a>,
}

impl<'a> Piece<'a> {
    fn empty() -> Piece<'a> {
        let none = || Cells::F32(&mut []);
        Piece { grad: &[], master: none(), first: none(), second: none() }
    }

    fn split_at(self, mid: usize) -> (Piece<'a>, Piece<'a>) {
        let (g0, g1) = self.grad.split_at(mid);
        let (x0, x1) = self.master.split_at(mid);
        let (f0, f1) = self.first.split_at(mid);
        let (s0, s1) = self.second.split_at(mid);
        let piece = |grad, master, first, second| Piece { grad, master, first, second };
        (piece(g0, x0, f0, s0), piece(g1, x1, f1, s1))
    }
}

/// What a step does to every piece: the scalars, the rounding with its step, and the path.
#[derive(Clone, Copy)]
struct Job<'a> {
    k: &'a Scalars,
    rounding: Rounding,
    /// The moments' seed when they are bf16.
    moments: MomentFormat,
    step: u64,
    /// Read once on the calling thread: [`crate::simd::with_isa`] is per thread.
    isa: Isa,
}

/// Steps `piece` by `k` and writes its model weights `out` (the piece's part of the tensor),
/// `rounding` keyed by `step` and the flat index `base` of the piece's first element, on up to
/// `threads` threads, each taking a contiguous part: every element's arithmetic and random draw
/// are its own, so the bits depend neither on the thread count nor on the instruction set.
#[allow(clippy::too_many_arguments)]
pub(crate) fn step_threads(
    k: &Scalars,
    piece: Piece<'_>,
    out: Out<'_>,
    rounding: Rounding,
    moments: MomentFormat,
    step: u64,
    base: usize,
    threads: usize,
) {
    split(Job { k, rounding, moments, step, isa: active_isa() }, piece, out, base, threads);
}

/// Elements of a piece [`new_masters_amax`] steps at a time: whole blocks of blockwise moments.
const DRY_CHUNK: usize = 16 * BLOCK;

/// The largest magnitude ([`fp8::amax`]) of the masters that [`step_threads`] would write over
/// `piece` with the same arguments, changing nothing: the piece stepped [`DRY_CHUNK`] elements
/// at a time on copies of its state, on up to `threads` threads as [`step_threads`] splits it.
/// Every element's arithmetic and draws are its own, so the copies' masters are bitwise those
/// the step will write.
#[allow(clippy::too_many_arguments)]
pub(crate) fn new_masters_amax(
    k: &Scalars,
    piece: Piece<'_>,
    rounding: Rounding,
    moments: MomentFormat,
    step: u64,
    base: usize,
    threads: usize,
) -> f32 {
    dry_split(Job { k, rounding, moments, step, isa: active_isa() }, piece, base, threads)
}

/// [`new_masters_amax`] with the job fixed: halves of the threads on halves of the piece.
fn dry_split(job: Job<'_>, piece: Piece<'_>, base: usize, threads: usize) -> f32 {
    let n = piece.grad.len();
    if threads <= 1 || n < 2 * MIN_ELEMENTS_PER_THREAD {
        return dry(job, piece, base);
    }
    let left = threads / 2;
    let mid = (n * left / threads).next_multiple_of(BLOCK).min(n);
    let (p0, p1) = piece.split_at(mid);
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(move || dry_split(job, p0, base, left));
        let b = dry_split(job, p1, base + mid, threads - left);
        (a.join().expect("a dry pass does not panic"), b)
    });
    fp8::amax(&[a, b])
}

/// [`new_masters_amax`] on the calling thread.
fn dry(job: Job<'_>, piece: Piece<'_>, base: usize) -> f32 {
    let (mut rest, mut at, mut amax) = (piece, 0, 0.0f32);
    while !rest.grad.is_empty() {
        let n = rest.grad.len().min(DRY_CHUNK);
        // The last chunk whole: a cut at its end would drop its partial block's scale.
        let (head, tail) = if n < DRY_CHUNK { (rest, Piece::empty()) } else { rest.split_at(n) };
        let mut copy = [head.master.copied(), head.first.copied(), head.second.copied()];
        let [master, first, second] = copy.each_mut().map(Owned::cells);
        one(job, Piece { grad: head.grad, master, first, second }, Out::MastersOnly(n), base + at);
        let Owned::F32(x) = &copy[0] else { unreachable!("FP8 weights' masters are FP32") };
        amax = fp8::amax(&[amax, fp8::amax(x)]);
        (rest, at) = (tail, at + n);
    }
    amax
}

/// A copy of a piece's [`Cells`].
enum Owned {
    F32(Vec<f32>),
    U16(Vec<u16>),
    Blocks(Vec<u8>, Vec<f32>),
    InWeights,
}

impl Owned {
    fn cells(&mut self) -> Cells<'_> {
        match self {
            Owned::F32(v) => Cells::F32(v),
            Owned::U16(v) => Cells::U16(v),
            Owned::Blocks(codes, scales) => Cells::Blocks(Blocks { codes, scales }),
            Owned::InWeights => Cells::InWeights,
        }
    }
}

impl Cells<'_> {
    fn copied(&self) -> Owned {
        match self {
            Cells::F32(v) => Owned::F32(v.to_vec()),
            Cells::U16(v) => Owned::U16(v.to_vec()),
            Cells::Blocks(b) => Owned::Blocks(b.codes.to_vec(), b.scales.to_vec()),
            Cells::InWeights => Owned::InWeights,
        }
    }
}

/// [`step_threads`] with the job fixed: halves of the threads on halves of the piece.
fn split(job: Job<'_>, piece: Piece<'_>, out: Out<'_>, base: usize, threads: usize) {
    let n = piece.grad.len();
    if threads <= 1 || n < 2 * MIN_ELEMENTS_PER_THREAD {
        return one(job, piece, out, base);
    }
    let left = threads / 2;
    // Whole blocks of blockwise moments on each side.
    let mid = (n * left / threads).next_multiple_of(BLOCK).min(n);
    let ((p0, p1), (o0, o1)) = (piece.split_at(mid), out.split_at_mut(mid));
    std::thread::scope(|s| {
        s.spawn(move || split(job, p0, o0, base, left));
        split(job, p1, o1, base + mid, threads - left);
    });
}

/// [`step_threads`] on the calling thread: FP32 state over the vectorized loop, the smaller
/// formats over [`formats`].
fn one(job: Job<'_>, piece: Piece<'_>, out: Out<'_>, base: usize) {
    let counter = |seed| rounding::counter(rounding::key(seed, job.step), base as u64);
    let Piece { grad, master, first, second } = piece;
    let (master, first, second) = match (master, first, second) {
        (Cells::F32(master), Cells::F32(first), Cells::F32(second)) => {
            let pass =
                FlatPass { isa: job.isa, k: job.k, piece: Flat { grad, master, first, second } };
            return with_writer(out, job.rounding, counter, pass);
        }
        other => other,
    };
    let keys = match job.moments {
        MomentFormat::Bf16 { seed } => {
            rounding::counter(rounding::moment_key(seed, job.step), base as u64)
        }
        MomentFormat::F32 | MomentFormat::Int8Blockwise => 0,
    };
    let (k, isa) = (job.k, job.isa);
    match (master, out) {
        (Cells::U16(rem), Out::Weights(GradMut::Bf16(o))) => {
            let x = Split { rem, out: o.reinterpret_cast_mut() };
            moments_on(isa, k, grad, x, first, second, keys)
        }
        (Cells::F32(x), out) => {
            let pass = StatePass { isa, k, grad, x, first, second, keys };
            with_writer(out, job.rounding, counter, pass)
        }
        (Cells::InWeights, out) => {
            let pass = WeightPass { isa, k, grad, first, second, keys };
            with_writer(out, job.rounding, counter, pass)
        }
        (Cells::U16(_), _) => {
            unreachable!("remainder masters are checked to be over bf16 weights")
        }
        (Cells::Blocks(_), _) => unreachable!("masters are never blocks"),
    }
}

/// A pass over a piece, given how its masters become the model's weights.
trait WithWriter {
    fn run<W: Write>(self, out: &mut [W::Out], w: W);
}

/// Runs `pass` with the writer of `out`'s dtype under `rounding` (`counter` keys a stochastic
/// one by its seed): one instantiation per way of writing, each branch-free inside.
fn with_writer(
    out: Out<'_>,
    rounding: Rounding,
    counter: impl Fn(u64) -> u64,
    pass: impl WithWriter,
) {
    let out = match out {
        // A slice of `()` takes no memory.
        Out::MastersOnly(n) => return pass.run(&mut vec![(); n], Discard),
        Out::Weights(w) => w,
    };
    match (out, rounding) {
        (GradMut::F32(o), _) => pass.run(o, Exact),
        (GradMut::F16(o), Rounding::NearestEven) => {
            pass.run(o.reinterpret_cast_mut(), Nearest::<false>)
        }
        (GradMut::Bf16(o), Rounding::NearestEven) => {
            pass.run(o.reinterpret_cast_mut(), Nearest::<true>)
        }
        (GradMut::F16(o), Rounding::Stochastic { seed }) => {
            pass.run(o.reinterpret_cast_mut(), Stochastic::<false> { counter: counter(seed) })
        }
        (GradMut::Bf16(o), Rounding::Stochastic { seed }) => {
            pass.run(o.reinterpret_cast_mut(), Stochastic::<true> { counter: counter(seed) })
        }
    }
}

/// A piece whose state is all FP32.
struct Flat<'a> {
    grad: &'a [f32],
    master: &'a mut [f32],
    first: &'a mut [f32],
    second: &'a mut [f32],
}

/// The vectorized FP32 loop over a flat piece.
struct FlatPass<'a, 'k> {
    isa: Isa,
    k: &'k Scalars,
    piece: Flat<'a>,
}

impl WithWriter for FlatPass<'_, '_> {
    fn run<W: Write>(self, out: &mut [W::Out], w: W) {
        run(self.isa, self.k, self.piece, out, w)
    }
}

/// The smaller formats' loop over FP32 masters (the moments in any format).
struct StatePass<'a, 'k> {
    isa: Isa,
    k: &'k Scalars,
    grad: &'a [f32],
    x: &'a mut [f32],
    first: Cells<'a>,
    second: Cells<'a>,
    keys: u64,
}

impl WithWriter for StatePass<'_, '_> {
    fn run<W: Write>(self, out: &mut [W::Out], w: W) {
        let x = Plain { x: self.x, out, w };
        moments_on(self.isa, self.k, self.grad, x, self.first, self.second, self.keys)
    }
}

/// The loop with no masters: each read from its model weight, which `W` writes back.
struct WeightPass<'a, 'k> {
    isa: Isa,
    k: &'k Scalars,
    grad: &'a [f32],
    first: Cells<'a>,
    second: Cells<'a>,
    keys: u64,
}

impl WithWriter for WeightPass<'_, '_> {
    fn run<W: Write>(self, out: &mut [W::Out], w: W) {
        let x = InWeight { out, w };
        moments_on(self.isa, self.k, self.grad, x, self.first, self.second, self.keys)
    }
}

/// Where a step reads a master and writes it, with its model weight.
pub(super) trait Master {
    fn len(&self) -> usize;
    fn get(&mut self, i: usize) -> f32;
    fn set(&mut self, i: usize, x: f32);
}

/// An FP32 master beside the model's weight, which `W` writes.
struct Plain<'a, W: Write> {
    x: &'a mut [f32],
    out: &'a mut [W::Out],
    w: W,
}

impl<W: Write> Master for Plain<'_, W> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.x.len().min(self.out.len())
    }
    #[inline(always)]
    fn get(&mut self, i: usize) -> f32 {
        self.x[i]
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32) {
        self.x[i] = x;
        self.out[i] = self.w.write(x);
    }
}

/// No master: the model's weight widened, written back by `W` (rounded stochastically for a
/// 16-bit weight, as `StateFormat::check` demands).
struct InWeight<'a, W: Write> {
    out: &'a mut [W::Out],
    w: W,
}

impl<W: Write> Master for InWeight<'_, W> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.out.len()
    }
    #[inline(always)]
    fn get(&mut self, i: usize) -> f32 {
        W::read(&self.out[i])
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32) {
        self.out[i] = self.w.write(x);
    }
}

/// A master that is the bf16 weight plus a remainder (`format::split_master`).
struct Split<'a> {
    rem: &'a mut [u16],
    out: &'a mut [u16],
}

impl Master for Split<'_> {
    #[inline(always)]
    fn len(&self) -> usize {
        self.rem.len().min(self.out.len())
    }
    #[inline(always)]
    fn get(&mut self, i: usize) -> f32 {
        join_master(self.out[i], self.rem[i])
    }
    #[inline(always)]
    fn set(&mut self, i: usize, x: f32) {
        (self.out[i], self.rem[i]) = split_master(x);
    }
}

/// [`moments`] compiled for `isa`, as [`run`] compiles the FP32 loop (the same scalar code, so
/// the same bits on every path).
fn moments_on<X: Master>(
    isa: Isa,
    k: &Scalars,
    grad: &[f32],
    x: X,
    first: Cells<'_>,
    second: Cells<'_>,
    keys: u64,
) {
    match isa {
        // SAFETY: as in `run`: Avx512 is reported only after detecting AVX-512F, AVX2 and F16C,
        // and AVX-512DQ is detected here.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if std::arch::is_x86_feature_detected!("avx512dq") => unsafe {
            moments_avx512(k, grad, x, first, second, keys)
        },
        // SAFETY: `active_isa` reports Avx2 or wider only after detecting AVX2 and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 => unsafe { moments_avx2(k, grad, x, first, second, keys) },
        _ => moments(k, grad, x, first, second, keys),
    }
}

/// [`moments`] at AVX-512's width.
///
/// # Safety
/// The CPU must have AVX-512F, AVX-512DQ, AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx2,f16c")]
unsafe fn moments_avx512<X: Master>(
    k: &Scalars,
    grad: &[f32],
    x: X,
    first: Cells<'_>,
    second: Cells<'_>,
    keys: u64,
) {
    moments(k, grad, x, first, second, keys)
}

/// [`moments`] at AVX2's width.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn moments_avx2<X: Master>(
    k: &Scalars,
    grad: &[f32],
    x: X,
    first: Cells<'_>,
    second: Cells<'_>,
    keys: u64,
) {
    moments(k, grad, x, first, second, keys)
}

/// [`formats`] with the moments' cells typed.
#[inline(always)]
fn moments<X: Master>(
    k: &Scalars,
    grad: &[f32],
    x: X,
    first: Cells<'_>,
    second: Cells<'_>,
    keys: u64,
) {
    match (first, second) {
        (Cells::F32(m), Cells::F32(v)) => formats::<X, F32Cell>(k, grad, x, m, v, keys),
        (Cells::U16(m), Cells::U16(v)) => formats::<X, Bf16Cell>(k, grad, x, m, v, keys),
        // SGD keeps no second moment.
        (Cells::U16(m), Cells::F32([])) => formats::<X, Bf16Cell>(k, grad, x, m, &mut [], keys),
        (Cells::Blocks(m), Cells::Blocks(v)) => blockwise::step(k, grad, x, m, v),
        (Cells::Blocks(m), Cells::F32([])) => {
            blockwise::step(k, grad, x, m, Blocks { codes: &mut [], scales: &mut [] })
        }
        _ => unreachable!("both moments have one format"),
    }
}

/// How a moment is stored.
trait Cell {
    type Cell: Copy;
    /// Whether storing takes random bits.
    const DRAWS: bool;
    fn load(c: Self::Cell) -> f32;
    fn store(v: f32, r: u32) -> Self::Cell;
}

struct F32Cell;

impl Cell for F32Cell {
    type Cell = f32;
    const DRAWS: bool = false;
    #[inline(always)]
    fn load(c: f32) -> f32 {
        c
    }
    #[inline(always)]
    fn store(v: f32, _: u32) -> f32 {
        v
    }
}

/// A bf16 moment, rounded stochastically.
struct Bf16Cell;

impl Cell for Bf16Cell {
    type Cell = u16;
    const DRAWS: bool = true;
    #[inline(always)]
    fn load(c: u16) -> f32 {
        bf16_to_f32(c)
    }
    #[inline(always)]
    fn store(v: f32, r: u32) -> u16 {
        rounding::stochastic_bf16(v, r)
    }
}

/// The loop over a piece with a smaller format: each element's master and moments loaded,
/// stepped in f32 by the FP32 loop's rule, and stored, the moments rounded with the draws of
/// the counter `keys` (which steps with the element).
#[inline(always)]
fn formats<X: Master, C: Cell>(
    k: &Scalars,
    grad: &[f32],
    mut x: X,
    first: &mut [C::Cell],
    second: &mut [C::Cell],
    keys: u64,
) {
    let n = grad.len();
    assert!(first.len() == n && x.len() == n, "a piece's slices");
    let mut c = keys;
    let draws = |c: u64| if C::DRAWS { rounding::draws_at(c) } else { (0, 0) };
    match k {
        Scalars::AdamW(a) => {
            assert_eq!(second.len(), n, "AdamW's second moments");
            for i in 0..n {
                let (mut w, mut m, mut v) = (x.get(i), C::load(first[i]), C::load(second[i]));
                a.step(grad[i], &mut w, &mut m, &mut v);
                let (rm, rv) = draws(c);
                (first[i], second[i]) = (C::store(m, rm), C::store(v, rv));
                x.set(i, w);
                c = rounding::next(c);
            }
        }
        Scalars::Sgd(s) => {
            for i in 0..n {
                let (mut w, mut b) = (x.get(i), C::load(first[i]));
                s.step(grad[i], &mut w, &mut b);
                first[i] = C::store(b, draws(c).0);
                x.set(i, w);
                c = rounding::next(c);
            }
        }
    }
}

/// [`rows`] compiled for `isa`. The AVX-512 build also takes AVX-512DQ, whose 64-bit multiply
/// the stochastic rounding's hash needs (every AVX-512 CPU has it but the Xeon Phi, which runs
/// the AVX2 build).
fn run<W: Write>(isa: Isa, k: &Scalars, p: Flat<'_>, out: &mut [W::Out], w: W) {
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
unsafe fn rows_avx512<W: Write>(k: &Scalars, p: Flat<'_>, out: &mut [W::Out], w: W) {
    rows(k, p, out, w)
}

/// [`rows`] at AVX2's width.
///
/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn rows_avx2<W: Write>(k: &Scalars, p: Flat<'_>, out: &mut [W::Out], w: W) {
    rows(k, p, out, w)
}

/// The loop itself, inlined into each path so that it is compiled for the path's instructions.
#[inline(always)]
fn rows<W: Write>(k: &Scalars, p: Flat<'_>, out: &mut [W::Out], mut w: W) {
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
