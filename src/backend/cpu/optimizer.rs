//! The optimizer's state in host memory: the FP32 masters (owned, or the caller's buffer adopted),
//! the moments, the learning rate and step count; the fused pass over them (`optimizer::pass`),
//! and the all-gather of the weights over a host communicator.

use std::ops::Range;
use std::sync::Arc;

use crate::accumulator::{Accumulator, Plan};
use crate::comm::{Communicator, HostCollectives};
use crate::device::DevicePtr;
use crate::dtype::{Dtype, Grad, GradMut};
use crate::error::{Error, ErrorKind, Result};
use crate::math::{bf16_to_f32, f16_to_f32};
use crate::optimizer::blockwise::{self, Blocks};
use crate::optimizer::fp8::{self, WeightFormat, WeightMut};
use crate::optimizer::pass::{self, Cells, Out};
use crate::optimizer::store::{
    agree_on_host, Column, Fingerprint, Gather, Init, OptimizerStore, Setup, Values, Weights,
};
use crate::optimizer::update::Scalars;
use crate::optimizer::{piece, Algorithm, MomentFormat, Piece, Rounding, TensorGroup};

/// A host optimizer's masters: a vector it owns, the caller's buffer it adopted (a
/// framework's own FP32 master weights, updated in place so that no second copy exists), or the
/// remainders that make the model's bf16 weights the masters, or none (the model's weights are
/// the masters).
#[derive(Debug)]
enum Masters {
    Owned(Vec<f32>),
    /// The caller's `len` values at `ptr`, never freed here.
    Adopted {
        ptr: *mut f32,
        len: usize,
    },
    Remainders(Vec<u16>),
    InWeights,
}

// SAFETY: an adopted buffer is plain f32 memory that the caller lends for the optimizer's
// lifetime (`Optimizer::with_masters`' contract); it is reached only through the optimizer's
// state, whose lock serialises every access.
unsafe impl Send for Masters {}

impl Masters {
    fn column(&self) -> Column<'_> {
        match self {
            Masters::Owned(v) => Column::F32(v),
            Masters::Adopted { ptr, len } => {
                // SAFETY: the caller lends `len` initialised f32 values at the non-null, aligned
                // `ptr` (checked at creation) for the optimizer's lifetime, and writes none of
                // them while the optimizer reads (`Optimizer::with_masters`' contract).
                Column::F32(unsafe { std::slice::from_raw_parts(*ptr, *len) })
            }
            Masters::Remainders(v) => Column::U16(v),
            Masters::InWeights => Column::F32(&[]),
        }
    }

    fn cells(&mut self, range: Range<usize>) -> Cells<'_> {
        match self {
            Masters::Owned(v) => Cells::F32(&mut v[range]),
            Masters::Adopted { ptr, len } => {
                // SAFETY: as `column`; `&mut self`, held under the optimizer's lock, excludes
                // every other access through the optimizer, and the caller makes none while it
                // writes.
                let all = unsafe { std::slice::from_raw_parts_mut(*ptr, *len) };
                Cells::F32(&mut all[range])
            }
            Masters::Remainders(v) => Cells::U16(&mut v[range]),
            Masters::InWeights => Cells::InWeights,
        }
    }

    /// Overwrites the values with `values`, of this format (adopted ones in place).
    fn restore(&mut self, values: Column<'_>) -> Result<()> {
        let n = values.len();
        match (self.cells(0..n), values) {
            (Cells::F32(to), Column::F32(from)) => to.copy_from_slice(from),
            (Cells::U16(to), Column::U16(from)) => to.copy_from_slice(from),
            (Cells::InWeights, _) if n == 0 => {}
            _ => return Err(Error::invalid("saved masters of another format")),
        }
        Ok(())
    }
}

/// A host optimizer's moments (one column): f32, bf16 bits, or 8-bit blocks (first moments
/// `signed`); empty for SGD's second.
#[derive(Debug)]
enum Moments {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
    Blocks { codes: Vec<u8>, scales: Vec<f32>, signed: bool },
}

impl Moments {
    /// Zero moments of `format`, the first (`signed`) or the second.
    fn zeros(format: MomentFormat, signed: bool, len: usize) -> Moments {
        match format {
            MomentFormat::F32 => Moments::F32(vec![0.0; len]),
            MomentFormat::Bf16 { .. } => Moments::Bf16(vec![0; len]),
            MomentFormat::Int8Blockwise => {
                let zero = blockwise::map(!signed as usize).zero;
                let (codes, scales) = (vec![zero; len], vec![0.0; blockwise::blocks(len)]);
                Moments::Blocks { codes, scales, signed }
            }
        }
    }

    fn column(&self) -> Column<'_> {
        match self {
            Moments::F32(v) => Column::F32(v),
            Moments::Bf16(v) => Column::U16(v),
            Moments::Blocks { codes, scales, signed } => {
                Column::Blocks { codes, scales, signed: *signed }
            }
        }
    }

    /// The cells of `range`, which starts at a block boundary.
    fn cells(&mut self, range: Range<usize>) -> Cells<'_> {
        match self {
            Moments::F32(v) if v.is_empty() => Cells::F32(&mut []),
            Moments::Bf16(v) if v.is_empty() => Cells::F32(&mut []),
            Moments::Blocks { codes, .. } if codes.is_empty() => Cells::F32(&mut []),
            Moments::F32(v) => Cells::F32(&mut v[range]),
            Moments::Bf16(v) => Cells::U16(&mut v[range]),
            Moments::Blocks { codes, scales, .. } => {
                let blocks = range.start / blockwise::BLOCK..blockwise::blocks(range.end);
                Cells::Blocks(Blocks { codes: &mut codes[range], scales: &mut scales[blocks] })
            }
        }
    }

    fn from_column(c: Column<'_>) -> Moments {
        match c {
            Column::F32(v) => Moments::F32(v.to_vec()),
            Column::U16(v) => Moments::Bf16(v.to_vec()),
            Column::Blocks { codes, scales, signed } => {
                Moments::Blocks { codes: codes.to_vec(), scales: scales.to_vec(), signed }
            }
        }
    }
}

/// An optimizer's masters and state in host memory.
#[derive(Debug)]
pub(crate) struct HostOptimizer {
    plan: Arc<Plan>,
    algorithm: Algorithm,
    rounding: Rounding,
    moments: MomentFormat,
    groups: Vec<TensorGroup>,
    dtypes: Vec<Dtype>,
    /// How the step writes each tensor's model weights.
    formats: Vec<WeightFormat>,
    lr: f32,
    /// Steps taken; skipped ones do not count (bias correction counts the steps taken).
    steps: u64,
    /// The flat layout's range held, and its values (zeros in the padding when owned; an
    /// adopted buffer's padding is not read, and written only by `restore`, with zeros).
    held: Range<usize>,
    master: Masters,
    first: Moments,
    /// Empty for SGD.
    second: Moments,
}

impl HostOptimizer {
    /// The masters widened from the model's weights, or the caller's adopted.
    pub(crate) fn new(setup: &Setup<'_>) -> Result<Self> {
        let Init::Host(weights) = setup.weights else {
            return Err(Error::invalid("device weights for a host optimizer"));
        };
        setup.check_adopted(|_, _| Ok(()))?;
        let held = setup.held();
        let master = match setup.masters {
            Some((ptr, len)) => Masters::Adopted { ptr, len },
            // A widened bf16 weight's lower half is zero.
            None if setup.format.remainders() => Masters::Remainders(vec![0; held.len()]),
            None if setup.format.no_masters() => Masters::InWeights,
            None => Masters::Owned(masters_from(setup.plan, &held, weights)),
        };
        let second_moment = setup.algorithm.second_moment();
        let format = setup.format.moments;
        Ok(HostOptimizer {
            plan: setup.plan.clone(),
            algorithm: setup.algorithm,
            rounding: setup.rounding,
            moments: setup.format.moments,
            groups: setup.groups.to_vec(),
            dtypes: setup.dtypes.to_vec(),
            formats: setup.weight_formats.to_vec(),
            lr: setup.lr,
            steps: 0,
            first: Moments::zeros(format, true, held.len()),
            second: Moments::zeros(format, false, if second_moment { held.len() } else { 0 }),
            master,
            held,
        })
    }

    /// The scalars of tensor `i`'s update in step `t`.
    fn scalars(&self, i: usize, t: u64, factor: f32) -> Scalars {
        let group = self.groups[i];
        let lr = self.lr as f64 * group.lr_scale as f64;
        Scalars::new(&self.algorithm, lr, group.weight_decay, t).grad_factor(factor)
    }

    /// Tensor `i`'s held piece of the gradient and the state.
    fn state_of<'s>(&'s mut self, grad: &'s [f32], p: &Piece) -> pass::Piece<'s> {
        pass::Piece {
            grad: &grad[p.held.clone()],
            master: self.master.cells(p.held.clone()),
            first: self.first.cells(p.held.clone()),
            second: self.second.cells(p.held.clone()),
        }
    }

    /// One step of every held element, its model weight written as it goes (FP8 weights'
    /// tensors: their masters only, quantised by `quantise`); each gradient is multiplied by
    /// `factor` (rounded to f32) before the update uses it.
    fn update(&mut self, grad: &[f32], factor: f32, weights: &mut [WeightMut<'_>]) {
        let t = self.steps + 1;
        for (i, w) in weights.iter_mut().enumerate() {
            let p = piece(&self.plan, i, &self.held);
            let k = self.scalars(i, t, factor);
            let (threads, flat, rounding, moments) =
                (self.plan.config.threads, p.flat.start, self.rounding, self.moments);
            let out = match w {
                WeightMut::Model(w) => Out::Weights(w.slice_mut(p.tensor.clone())),
                WeightMut::E4m3 { .. } | WeightMut::Mxfp8 { .. } => Out::MastersOnly(p.held.len()),
            };
            let state = self.state_of(grad, &p);
            pass::step_threads(&k, state, out, rounding, moments, t, flat, threads);
        }
        self.steps = t;
    }

    /// The amax of each FP8 tensor's new masters on this rank (0 where it holds none), in
    /// tensor order, from a pass that changes nothing.
    fn new_amax(&mut self, grad: &[f32], factor: f32) -> Vec<f32> {
        let t = self.steps + 1;
        let fp8: Vec<usize> =
            (0..self.formats.len()).filter(|&i| self.formats[i].is_fp8()).collect();
        fp8.into_iter()
            .map(|i| {
                let p = piece(&self.plan, i, &self.held);
                let k = self.scalars(i, t, factor);
                let (rounding, moments, threads) =
                    (self.rounding, self.moments, self.plan.config.threads);
                let state = self.state_of(grad, &p);
                pass::new_masters_amax(&k, state, rounding, moments, t, p.flat.start, threads)
            })
            .collect()
    }

    /// Each FP8 tensor's held piece quantised from its new masters, with the per-tensor scales
    /// of `amax` (every rank's, agreed).
    fn quantise(&self, amax: &[f32], weights: &mut [WeightMut<'_>]) {
        let Column::F32(masters) = self.master.column() else {
            unreachable!("FP8 weights' masters are FP32")
        };
        let mut agreed = amax.iter();
        for (i, w) in weights.iter_mut().enumerate() {
            let p = piece(&self.plan, i, &self.held);
            let x = &masters[p.held];
            match w {
                WeightMut::Model(_) => {}
                WeightMut::E4m3 { codes, scale } => {
                    scale[0] = fp8::e4m3_scale(*agreed.next().expect("an amax per FP8 tensor"));
                    fp8::quantise_tensorwise(x, scale[0], &mut codes[p.tensor]);
                }
                WeightMut::Mxfp8 { codes, scales } => {
                    agreed.next();
                    let blocks = mx_blocks(&p.tensor);
                    fp8::quantise_mx(x, &mut codes[p.tensor], &mut scales[blocks]);
                }
            }
        }
    }

    /// Every rank's part of the model weights to every rank, bit for bit: a piece's elements
    /// in their dtype, or its FP8 codes and, for MXFP8, its blocks' scales (a per-tensor
    /// E4M3 scale every rank computed alike).
    fn all_gather(
        &self,
        h: &dyn HostCollectives,
        shards: &[Range<usize>],
        rank: usize,
        weights: &mut [WeightMut<'_>],
    ) -> Result<()> {
        let pieces = |q: usize| {
            (0..self.dtypes.len()).filter_map(move |i| {
                let p = piece(&self.plan, i, &shards[q]);
                (!p.tensor.is_empty()).then_some((i, p.tensor))
            })
        };
        let bytes = |q: usize| -> usize { pieces(q).map(|(i, r)| self.gathered(i, &r)).sum() };
        let counts: Vec<usize> = (0..shards.len()).map(bytes).collect();
        let mut mine = Vec::with_capacity(counts[rank]);
        for (i, r) in pieces(rank) {
            append_bytes(&weights[i], r, &mut mine);
        }
        let all = h.allgather_bytes(&mine, &counts)?;
        let mut at = 0;
        for q in 0..shards.len() {
            for (i, r) in pieces(q) {
                let n = self.gathered(i, &r);
                if q != rank {
                    set_bytes(&mut weights[i], r, &all[at..at + n]);
                }
                at += n;
            }
        }
        Ok(())
    }

    /// The bytes tensor `i`'s elements `r` take on the all-gather.
    fn gathered(&self, i: usize, r: &Range<usize>) -> usize {
        match self.formats[i] {
            WeightFormat::Model => r.len() * self.dtypes[i].size(),
            WeightFormat::E4m3Tensorwise => r.len(),
            WeightFormat::Mxfp8 => r.len() + mx_blocks(r).len(),
        }
    }

    /// Steps from `grad` (the boundary did not overflow), quantising the FP8 weights of the
    /// held pieces: first the FP8 tensors' new amax, agreed over `gather`'s ranks, and nothing
    /// changes when one is not finite (the error says which).
    fn step_from(
        &mut self,
        grad: &[f32],
        factor: f32,
        weights: &mut [WeightMut<'_>],
        gather: Option<&Gather<'_>>,
    ) -> Result<()> {
        if !self.formats.iter().any(|f| f.is_fp8()) {
            self.update(grad, factor, weights);
            return Ok(());
        }
        let mine = self.new_amax(grad, factor);
        let agreed = match gather {
            Some(g) => agree_max(host_of(g.comm)?, &mine, g.shards.len())?,
            None => mine,
        };
        self.check_amax(&agreed)?;
        self.update(grad, factor, weights);
        self.quantise(&agreed, weights);
        Ok(())
    }

    /// Fails, naming the tensor, unless every FP8 tensor's agreed amax is finite.
    fn check_amax(&self, agreed: &[f32]) -> Result<()> {
        let fp8 = (0..self.formats.len()).filter(|&i| self.formats[i].is_fp8());
        match fp8.zip(agreed).find(|(_, a)| !a.is_finite()) {
            None => Ok(()),
            Some((i, a)) => Err(Error::invalid(format!(
                "tensor {i}'s new masters reach a magnitude of {a} ({}): no FP8 scale applies, so the step is skipped on every rank, its weights and state unchanged (step again, with a lower learning rate say)",
                self.formats[i].name()
            ))),
        }
    }
}

/// The MXFP8 blocks of a tensor's elements `r`, which start at a block boundary.
fn mx_blocks(r: &Range<usize>) -> Range<usize> {
    debug_assert_eq!(r.start % fp8::MX_BLOCK, 0, "pieces start at whole blocks");
    r.start / fp8::MX_BLOCK..r.end.div_ceil(fp8::MX_BLOCK)
}

/// The largest of every rank's `mine` (magnitudes, NaN above infinity), on every rank: one
/// all-gather of 4 bytes per value.
fn agree_max(h: &dyn HostCollectives, mine: &[f32], ranks: usize) -> Result<Vec<f32>> {
    let bytes: Vec<u8> = mine.iter().flat_map(|a| a.to_le_bytes()).collect();
    let all = h.allgather_bytes(&bytes, &vec![bytes.len(); ranks])?;
    let value = |c: &[u8]| f32::from_le_bytes(c.try_into().expect("4 bytes"));
    let mut max = vec![0.0f32; mine.len()];
    for (j, c) in all.chunks_exact(4).enumerate() {
        let m = &mut max[j % mine.len()];
        *m = fp8::amax(&[*m, value(c)]);
    }
    Ok(max)
}

impl OptimizerStore for HostOptimizer {
    fn lr(&self) -> f32 {
        self.lr
    }

    fn set_lr(&mut self, lr: f32) -> Result<()> {
        self.lr = lr;
        Ok(())
    }

    fn steps(&mut self) -> u64 {
        self.steps
    }

    fn view(&self, f: &mut dyn FnMut(&Values<'_>)) -> Result<()> {
        f(&Values {
            lr: self.lr,
            steps: self.steps,
            master: self.master.column(),
            first: self.first.column(),
            second: self.second.column(),
        });
        Ok(())
    }

    fn restore(&mut self, values: &Values<'_>) -> Result<()> {
        // Into the masters in place: adopted ones stay the caller's buffer.
        self.master.restore(values.master)?;
        self.first = Moments::from_column(values.first);
        self.second = Moments::from_column(values.second);
        (self.lr, self.steps) = (values.lr, values.steps);
        Ok(())
    }

    fn adopted(&self) -> Option<(DevicePtr, usize)> {
        match self.master {
            Masters::Adopted { ptr, len } => Some((ptr as DevicePtr, len)),
            Masters::Owned(_) | Masters::Remainders(_) | Masters::InWeights => None,
        }
    }

    fn takes(&self, comm: &dyn Communicator) -> Result<()> {
        host_of(comm).map(drop)
    }

    fn agree(
        &self,
        kind: &Fingerprint,
        plan: &Plan,
        comm: &dyn Communicator,
        own: Option<&Error>,
    ) -> Result<()> {
        agree_on_host(host_of(comm)?, kind, (self.lr, self.steps), plan, own)
    }

    fn step(
        &mut self,
        acc: &Accumulator,
        weights: Weights<'_, '_>,
        gather: Option<&Gather<'_>>,
        consumed: &mut Option<u64>,
    ) -> Result<Option<bool>> {
        let weights = weights.host()?;
        let stepped = acc.with_reduced("the optimizer step", |window, info, grad, factor| {
            if !info.found_inf {
                self.step_from(grad, factor, weights, gather)?;
            }
            *consumed = Some(window);
            Ok::<_, Error>(!info.found_inf)
        })??;
        if let (true, Some(g)) = (stepped, gather) {
            self.all_gather(host_of(g.comm)?, &g.shards, g.rank, weights)?;
        }
        Ok(Some(stepped))
    }
}

/// The host collectives of a step's all-gather.
fn host_of(comm: &dyn Communicator) -> Result<&dyn HostCollectives> {
    comm.host().ok_or_else(|| {
        Error::new(
            ErrorKind::DeviceMismatch,
            "`comm`: a CPU accumulator's optimizer all-gathers over host communicators (in-process, MPI)",
        )
    })
}

/// The held masters of an owned optimizer: the model's weights widened, zeros in the padding.
fn masters_from(plan: &Plan, held: &Range<usize>, weights: &[Grad<'_>]) -> Vec<f32> {
    let mut master = vec![0.0f32; held.len()];
    for (i, w) in weights.iter().enumerate() {
        let p = piece(plan, i, held);
        let values = w.slice(p.tensor.start, p.tensor.end);
        for (m, v) in master[p.held].iter_mut().zip(0..) {
            *m = value_at(&values, v);
        }
    }
    master
}

fn value_at(g: &Grad<'_>, at: usize) -> f32 {
    match g {
        Grad::F32(b) => b[at],
        Grad::F16(b) => f16_to_f32(b[at].to_bits()),
        Grad::Bf16(b) => bf16_to_f32(b[at].to_bits()),
    }
}

fn append_bytes(w: &WeightMut<'_>, r: Range<usize>, out: &mut Vec<u8>) {
    match w {
        WeightMut::Model(GradMut::F32(b)) => b[r].iter().for_each(|v| out.extend(v.to_le_bytes())),
        WeightMut::Model(GradMut::F16(b)) => b[r].iter().for_each(|v| out.extend(v.to_le_bytes())),
        WeightMut::Model(GradMut::Bf16(b)) => b[r].iter().for_each(|v| out.extend(v.to_le_bytes())),
        WeightMut::E4m3 { codes, .. } => out.extend_from_slice(&codes[r]),
        WeightMut::Mxfp8 { codes, scales } => {
            out.extend_from_slice(&codes[r.clone()]);
            out.extend_from_slice(&scales[mx_blocks(&r)]);
        }
    }
}

fn set_bytes(w: &mut WeightMut<'_>, r: Range<usize>, bytes: &[u8]) {
    let two = |c: &[u8]| -> [u8; 2] { c.try_into().expect("2 bytes") };
    match w {
        WeightMut::Model(GradMut::F32(b)) => {
            b[r].iter_mut().zip(bytes.chunks_exact(4)).for_each(|(v, c)| {
                *v = f32::from_bits(u32::from_le_bytes(c.try_into().expect("4 bytes")))
            })
        }
        WeightMut::Model(GradMut::F16(b)) => b[r]
            .iter_mut()
            .zip(bytes.chunks_exact(2))
            .for_each(|(v, c)| *v = half::f16::from_le_bytes(two(c))),
        WeightMut::Model(GradMut::Bf16(b)) => b[r]
            .iter_mut()
            .zip(bytes.chunks_exact(2))
            .for_each(|(v, c)| *v = half::bf16::from_le_bytes(two(c))),
        WeightMut::E4m3 { codes, .. } => codes[r].copy_from_slice(bytes),
        WeightMut::Mxfp8 { codes, scales } => {
            let (c, s) = bytes.split_at(r.len());
            scales[mx_blocks(&r)].copy_from_slice(s);
            codes[r].copy_from_slice(c);
        }
    }
}
