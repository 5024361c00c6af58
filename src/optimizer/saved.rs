//! The optimizer's saved state: what it was made with (tensors, model dtypes, algorithm,
//! rounding), the learning rate and step count, and per tensor the elements this rank holds
//! with their values. Elements are named by their place in the tensor, not in the flat layout or
//! a shard, so the parts of any shard count re-cut into any other.

use std::ops::Range;

use super::store::Values;
use super::{piece, Optimizer};
use crate::error::{Error, ErrorKind, Result};
use crate::state::{Reader, Writer};

const MAGIC: [u8; 4] = *b"GAOP";
const VERSION: u32 = 1;
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
    w.f32(s.lr).u64(s.steps);
    for i in 0..o.dtypes.len() {
        let p = piece(&o.plan, i, &o.held);
        w.u64(p.tensor.start as u64).u64(p.tensor.end as u64);
        w.f32s(&s.master[p.held.clone()]).f32s(&s.first[p.held.clone()]);
        if o.algorithm.second_moment() {
            w.f32s(&s.second[p.held]);
        }
    }
    w.finish()
}

/// One part, read whole.
struct Part {
    lr: f32,
    steps: u64,
    /// Per tensor: the elements held (counted from the tensor's start) and their values.
    tensors: Vec<(Range<usize>, [Vec<f32>; 3])>,
}

fn corrupt(message: String) -> Error {
    Error::new(ErrorKind::CorruptState, format!("{WHAT}: {message}"))
}

fn read_part(o: &Optimizer, index: usize, bytes: &[u8]) -> Result<Part> {
    let mut r = Reader::open(WHAT, bytes, MAGIC, VERSION)?;
    for (k, expected) in identity(o).into_iter().enumerate() {
        if r.u64()? != expected {
            return Err(corrupt(format!(
                "part {index} is from an optimizer with other tensors, model dtypes, algorithm or rounding (field {k})"
            )));
        }
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
        let mut values: [Vec<f32>; 3] = Default::default();
        let slots = if o.algorithm.second_moment() { 3 } else { 2 };
        for v in &mut values[..slots] {
            // A length that disagrees with the part's own range is damage, not another object.
            r.f32s_into(v, n).map_err(|e| corrupt(format!("part {index}: {}", e.message)))?;
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
    values: [Vec<f32>; 3],
}

impl Restored {
    pub(super) fn values(&self) -> Values<'_> {
        let [master, first, second] = &self.values;
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
    let mut values = [vec![0.0f32; held.len()], vec![0.0; held.len()], vec![]];
    if o.algorithm.second_moment() {
        values[2] = vec![0.0; held.len()];
    }
    let mut covered = vec![false; held.len()];
    for i in 0..o.dtypes.len() {
        let p = piece(&o.plan, i, held);
        let (want, base) = (p.tensor.clone(), p.held.start);
        for part in &parts {
            let (have, saved) = &part.tensors[i];
            let (lo, hi) = (want.start.max(have.start), want.end.min(have.end));
            for e in lo..hi {
                let at = base + e - want.start;
                for (slot, v) in values.iter_mut().enumerate().filter(|(_, v)| !v.is_empty()) {
                    v[at] = saved[slot][e - have.start];
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
