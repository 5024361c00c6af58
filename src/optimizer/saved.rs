//! The optimizer's saved state: what it was made with (tensors, model dtypes, algorithm,
//! rounding), the learning rate and step count, and per tensor the elements this rank holds
//! with their values. Elements are named by their place in the tensor, not in the flat layout or
//! a shard, so the parts of any shard count re-cut into any other. Version 2 adds the state's
//! formats; a part of one format loads into an optimizer of another where the conversion is
//! exact or a rounding (see `convert`). 8-bit blockwise moments are saved as their codes and
//! their blocks' scales: a part's elements of a tensor start at a block boundary (every shard
//! boundary is one), so blocks re-cut whole. With no masters ([`MasterFormat::None`](super::MasterFormat::None)) a part
//! holds no master column: the model's weights are the masters.

use std::ops::Range;

use super::blockwise::{self, BLOCK};
use super::format::{remainder_of_nearest, MomentFormat, StateFormat};
use super::store::{Column, Values};
use super::{piece, Optimizer};
use crate::error::{Error, ErrorKind, Result};
use crate::math::{bf16_to_f32, f32_to_bf16};
use crate::state::{Reader, Writer};

const MAGIC: [u8; 4] = *b"GAOP";
const VERSION: u32 = 2;
/// Version 1: FP32 state, saved before the formats were.
const FP32_VERSION: u32 = 1;
const WHAT: &str = "optimizer state";

/// What identifies the optimizer a part must come from, in saved order.
fn identity(o: &Optimizer) -> Vec<u64> {
    let mut id = vec![o.dtypes.len() as u64];
    for (d, dtype) in o.plan.descs.iter().zip(&o.dtypes) {
        id.extend([d.numel as u64, dtype.code() as u64]);
    }
    let (code, params) = o.algorithm.encode();
    id.push(code);
    id.extend(params.map(|p| p.to_bits() as u64));
    let (rounding, seed) = o.rounding.code();
    id.extend([rounding, seed]);
    id
}

/// The saved bytes of this rank's state `s`.
pub(super) fn encode(o: &Optimizer, s: &Values<'_>) -> Vec<u8> {
    let mut w = Writer::new(MAGIC, VERSION);
    for v in identity(o) {
        w.u64(v);
    }
    let (masters, moments, _) = o.format.codes();
    w.u64(masters).u64(moments);
    w.f32(s.lr).u64(s.steps);
    let column = |w: &mut Writer, c: &Column<'_>, r: Range<usize>| match c {
        Column::F32(v) => drop(w.f32s(&v[r])),
        Column::U16(v) => drop(w.u16s(&v[r])),
        Column::Blocks { codes, scales, .. } => {
            let blocks = r.start / BLOCK..blockwise::blocks(r.end);
            w.u8s(&codes[r]).f32s(&scales[blocks]);
        }
    };
    for i in 0..o.dtypes.len() {
        let p = piece(&o.plan, i, &o.held);
        w.u64(p.tensor.start as u64).u64(p.tensor.end as u64);
        if !o.format.no_masters() {
            column(&mut w, &s.master, p.held.clone());
        }
        column(&mut w, &s.first, p.held.clone());
        if o.algorithm.second_moment() {
            column(&mut w, &s.second, p.held);
        }
    }
    w.finish()
}

/// A column read back, in a format.
#[derive(Clone, Debug)]
pub(super) enum Owned {
    F32(Vec<f32>),
    U16(Vec<u16>),
    /// 8-bit blockwise moments, from a block boundary; the first moment's are `signed`.
    Blocks {
        codes: Vec<u8>,
        scales: Vec<f32>,
        signed: bool,
    },
    /// No masters: the model's weights are.
    Absent,
}

/// The format of a column: f32, 16-bit words, 8-bit blocks, or none (no masters).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    F32,
    U16,
    Blocks,
    Absent,
}

/// The kind of column `slot` (0: masters, 1 and 2: moments) of `format`.
fn kind(format: &StateFormat, slot: usize) -> Kind {
    match (slot, format.moments) {
        (0, _) if format.remainders() => Kind::U16,
        (0, _) if format.no_masters() => Kind::Absent,
        (0, _) | (_, MomentFormat::F32) => Kind::F32,
        (_, MomentFormat::Bf16 { .. }) => Kind::U16,
        (_, MomentFormat::Int8Blockwise) => Kind::Blocks,
    }
}

impl Owned {
    fn column(&self) -> Column<'_> {
        match self {
            Owned::F32(v) => Column::F32(v),
            Owned::U16(v) => Column::U16(v),
            Owned::Blocks { codes, scales, signed } => {
                Column::Blocks { codes, scales, signed: *signed }
            }
            Owned::Absent => Column::F32(&[]),
        }
    }

    fn zeros(kind: Kind, slot: usize, len: usize) -> Owned {
        match kind {
            Kind::F32 => Owned::F32(vec![0.0; len]),
            Kind::U16 => Owned::U16(vec![0; len]),
            Kind::Blocks => {
                let codes = vec![blockwise::map(slot - 1).zero; len];
                Owned::Blocks {
                    codes,
                    scales: vec![0.0; blockwise::blocks(len)],
                    signed: slot == 1,
                }
            }
            Kind::Absent => Owned::Absent,
        }
    }

    /// Element `at` takes `from`'s element `e`; with blocks, `at`'s block takes `e`'s scale
    /// (both at the same place in their blocks).
    fn set(&mut self, at: usize, from: &Owned, e: usize) {
        match (self, from) {
            (Owned::F32(to), Owned::F32(from)) => to[at] = from[e],
            (Owned::U16(to), Owned::U16(from)) => to[at] = from[e],
            (Owned::Blocks { codes, scales, .. }, Owned::Blocks { codes: c, scales: s, .. }) => {
                codes[at] = c[e];
                scales[at / BLOCK] = s[e / BLOCK];
            }
            (Owned::Absent, Owned::Absent) => {}
            _ => unreachable!("columns are converted to the optimizer's formats first"),
        }
    }

    /// The values as f32 (bf16 widened exactly, blocks decoded), for a moment.
    fn moments_f32(self) -> Vec<f32> {
        match self {
            Owned::F32(v) => v,
            Owned::U16(v) => v.iter().map(|&b| bf16_to_f32(b)).collect(),
            Owned::Blocks { codes, scales, signed } => {
                blockwise::dequantise_all(blockwise::map(!signed as usize), &codes, &scales)
            }
            Owned::Absent => unreachable!("moments are never absent"),
        }
    }
}

/// A part's column `c` (slot 0: masters, else moments) in the optimizer's format `to`, or why it
/// cannot be: FP32 masters become remainders of their nearest-even bf16 weights (exact but at
/// ties of even upper halves, where the master moves one f32 unit toward its weight), and FP32
/// moments bf16 by rounding to nearest even; bf16 moments widen exactly. Moments of any other
/// format become 8-bit blocks by quantising their values block by block, and 8-bit blocks
/// decode to FP32 (and round to nearest even for bf16). Remainders need their weights, so they
/// load only as remainders, or as no masters. Masters of any format load into no masters by
/// being dropped: the model's weights, which the saving optimizer wrote from them, are the
/// masters from then on. A part without masters loads only into no masters: the others would
/// need the weights.
fn convert(c: Owned, slot: usize, to: &StateFormat, index: usize) -> Result<Owned> {
    let want = kind(to, slot);
    let c = match (c, want) {
        (_, Kind::Absent) => return Ok(Owned::Absent),
        (Owned::Absent, _) => {
            return Err(corrupt(format!(
                "part {index} holds no masters (MasterFormat::None: the model's weights are its masters), which kept masters cannot take without the weights: load it into an optimizer with MasterFormat::None"
            )))
        }
        (c @ Owned::Blocks { .. }, Kind::Blocks) => return Ok(c),
        (c, Kind::Blocks) => {
            let (codes, scales) =
                blockwise::quantise_all(blockwise::map(slot - 1), &c.moments_f32());
            return Ok(Owned::Blocks { codes, scales, signed: slot == 1 });
        }
        (c @ Owned::Blocks { .. }, _) => Owned::F32(c.moments_f32()),
        (c, _) => c,
    };
    let u16s = want == Kind::U16;
    Ok(match (c, u16s) {
        (c @ Owned::F32(_), false) | (c @ Owned::U16(_), true) => c,
        (Owned::F32(v), true) if slot == 0 => {
            let rem: Option<Vec<u16>> = v.iter().map(|&x| remainder_of_nearest(x)).collect();
            Owned::U16(rem.ok_or_else(|| {
                corrupt(format!("part {index} holds a non-finite master, which bf16-remainder masters cannot take from FP32 state"))
            })?)
        }
        (Owned::F32(v), true) => Owned::U16(v.iter().map(|&x| f32_to_bf16(x)).collect()),
        (Owned::U16(_), false) if slot == 0 => {
            return Err(corrupt(format!(
                "part {index} holds bf16-remainder masters, which need their bf16 weights: load it into an optimizer with MasterFormat::Bf16Remainder"
            )))
        }
        (Owned::U16(v), false) => Owned::F32(v.iter().map(|&b| bf16_to_f32(b)).collect()),
        (Owned::Blocks { .. } | Owned::Absent, _) => unreachable!("handled above"),
    })
}

/// One part, read whole.
struct Part {
    lr: f32,
    steps: u64,
    /// Per tensor: the elements held (counted from the tensor's start) and their values, in
    /// the optimizer's formats.
    tensors: Vec<(Range<usize>, [Owned; 3])>,
}

fn corrupt(message: String) -> Error {
    Error::new(ErrorKind::CorruptState, format!("{WHAT}: {message}"))
}

fn read_part(o: &Optimizer, index: usize, bytes: &[u8]) -> Result<Part> {
    let (mut r, version) = Reader::open_versions(WHAT, bytes, MAGIC, FP32_VERSION..=VERSION)?;
    for (k, expected) in identity(o).into_iter().enumerate() {
        if r.u64()? != expected {
            return Err(corrupt(format!(
                "part {index} is from an optimizer with other tensors, model dtypes, algorithm or rounding (field {k})"
            )));
        }
    }
    let (masters, moments) = if version == FP32_VERSION { (0, 0) } else { (r.u64()?, r.u64()?) };
    if masters > 2 || moments > 2 {
        return Err(corrupt(format!(
            "part {index} names state formats {masters} and {moments}, which this version does not know"
        )));
    }
    let (lr, steps) = (r.f32()?, r.u64()?);
    let mut tensors = Vec::with_capacity(o.dtypes.len());
    for (i, d) in o.plan.descs.iter().enumerate() {
        let (start, end) = (r.u64()?, r.u64()?);
        if start > end || end > d.numel as u64 {
            return Err(corrupt(format!(
                "part {index} holds elements {start}..{end} of tensor {i}, which has {}",
                d.numel
            )));
        }
        let n = (end - start) as usize;
        let mut values: [Owned; 3] = [Owned::F32(vec![]), Owned::F32(vec![]), Owned::F32(vec![])];
        let slots = if o.algorithm.second_moment() { 3 } else { 2 };
        for (slot, v) in values[..slots].iter_mut().enumerate() {
            // A length that disagrees with the part's own range is damage, not another object.
            let damaged = |e: Error| corrupt(format!("part {index}: {}", e.message));
            let u16s = if slot == 0 { masters == 1 } else { moments == 1 };
            let saved = if slot == 0 && masters == 2 {
                Owned::Absent
            } else if slot > 0 && moments == 2 {
                let (mut codes, mut scales) = (Vec::new(), Vec::new());
                r.u8s_into(&mut codes, n).map_err(damaged)?;
                r.f32s_into(&mut scales, blockwise::blocks(n)).map_err(damaged)?;
                if !(start as usize).is_multiple_of(BLOCK) {
                    return Err(corrupt(format!(
                        "part {index} holds 8-bit blockwise moments of tensor {i} from element {start}, inside a block of {BLOCK}"
                    )));
                }
                if let Some(s) = scales.iter().find(|s| !(s.is_finite() && **s >= 0.0)) {
                    return Err(corrupt(format!(
                        "part {index} holds a block scale {s} of tensor {i}, not finite and non-negative"
                    )));
                }
                Owned::Blocks { codes, scales, signed: slot == 1 }
            } else if u16s {
                let mut b = Vec::new();
                r.u16s_into(&mut b, n).map_err(damaged)?;
                Owned::U16(b)
            } else {
                let mut b = Vec::new();
                r.f32s_into(&mut b, n).map_err(damaged)?;
                Owned::F32(b)
            };
            // Blocks are counted from the tensor's start: values cut elsewhere would quantise
            // in other blocks than the optimizer's.
            let in_block = |x: u64| !(x as usize).is_multiple_of(BLOCK) && x != d.numel as u64;
            let quantised = slot > 0 && moments != 2 && kind(&o.format, slot) == Kind::Blocks;
            if quantised && (in_block(start) || in_block(end)) {
                return Err(corrupt(format!(
                    "part {index} holds elements {start}..{end} of tensor {i}, cut inside a block of {BLOCK}: its moments convert to 8-bit blocks only from parts cut on blocks"
                )));
            }
            *v = convert(saved, slot, &o.format, index)?;
        }
        tensors.push((start as usize..end as usize, values));
    }
    r.finish()?;
    Ok(Part { lr, steps, tensors })
}

/// Refuses two parts that hold the same element of a tensor: the element would take whichever
/// came last. Parts that hold nothing (the parts of empty shards) never meet.
fn check_disjoint(parts: &[Part], bytes: &[&[u8]]) -> Result<()> {
    for i in 0..parts.first().map_or(0, |p| p.tensors.len()) {
        let mut held: Vec<(Range<usize>, usize)> = (parts.iter().enumerate())
            .map(|(k, p)| (p.tensors[i].0.clone(), k))
            .filter(|(r, _)| !r.is_empty())
            .collect();
        held.sort_by_key(|(r, k)| (r.start, *k));
        // Sorted by start, any overlap shows between neighbours.
        for pair in held.windows(2) {
            let ((a, j), (b, k)) = (&pair[0], &pair[1]);
            if b.start < a.end {
                let (first, second) = ((*j).min(*k), (*j).max(*k));
                let shared = b.start..a.end.min(b.end);
                return Err(Error::invalid(if bytes[first] == bytes[second] {
                    format!("part {second} is part {first} given twice (both hold elements {shared:?} of tensor {i}): pass each rank's part once")
                } else {
                    format!("parts {first} and {second} both hold elements {shared:?} of tensor {i}: pass the parts of one save, each once")
                }));
            }
        }
    }
    Ok(())
}

/// A state read back: the learning rate, the step count, and the held masters and moments.
pub(super) struct Restored {
    lr: f32,
    steps: u64,
    values: [Owned; 3],
}

impl Restored {
    pub(super) fn values(&self) -> Values<'_> {
        let [master, first, second] = &self.values;
        let (master, first, second) = (master.column(), first.column(), second.column());
        Values { lr: self.lr, steps: self.steps, master, first, second }
    }
}

/// The state of the range this rank holds from the parts saved as `bytes`, or an error naming
/// what is wrong; nothing is changed.
pub(super) fn decode(o: &Optimizer, bytes: &[&[u8]]) -> Result<Restored> {
    let held = &o.held;
    if bytes.is_empty() {
        return Err(Error::invalid("`parts` is empty: load needs the saved state".to_string()));
    }
    let parts: Vec<Part> =
        bytes.iter().enumerate().map(|(k, b)| read_part(o, k, b)).collect::<Result<_>>()?;
    let (lr, steps) = (parts[0].lr, parts[0].steps);
    if let Some(k) = parts.iter().position(|p| (p.lr.to_bits(), p.steps) != (lr.to_bits(), steps)) {
        return Err(corrupt(format!(
            "part {k} was saved at step {} (lr {}), part 0 at step {steps} (lr {lr})",
            parts[k].steps, parts[k].lr
        )));
    }
    if super::config::check_lr(lr).is_err() {
        return Err(corrupt(format!(
            "the saved learning rate {lr} is not finite and non-negative"
        )));
    }
    if steps == u64::MAX {
        return Err(corrupt(format!("the saved step count {steps} leaves no step to take")));
    }
    check_disjoint(&parts, bytes)?;
    let second = if o.algorithm.second_moment() { held.len() } else { 0 };
    let lens = [held.len(), held.len(), second];
    let mut values: [Owned; 3] =
        std::array::from_fn(|slot| Owned::zeros(kind(&o.format, slot), slot, lens[slot]));
    let slots = if second > 0 { 3 } else { 2 };
    let mut covered = vec![false; held.len()];
    for i in 0..o.dtypes.len() {
        let p = piece(&o.plan, i, held);
        let (want, base) = (p.tensor.clone(), p.held.start);
        for part in &parts {
            let (have, saved) = &part.tensors[i];
            let (lo, hi) = (want.start.max(have.start), want.end.min(have.end));
            for e in lo..hi {
                let at = base + e - want.start;
                for (slot, v) in values[..slots].iter_mut().enumerate() {
                    v.set(at, &saved[slot], e - have.start);
                }
                covered[at] = true;
            }
        }
        if let Some(e) = want.clone().find(|&e| !covered[base + e - want.start]) {
            return Err(corrupt(format!(
                "no part holds element {e} of tensor {i}: pass the parts every rank saved"
            )));
        }
    }
    Ok(Restored { lr, steps, values })
}
