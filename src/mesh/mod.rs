//! The mesh step: one boundary over every accumulator of a rank and every rank of the job, for
//! model, pipeline, context and expert parallelism beside data parallelism.
//!
//! Each accumulator ([`Part`]) is reduced over its own group (dense weights over the
//! data-parallel group, experts over the expert-data-parallel one, under any sharding policy),
//! and one agreement over the world communicator (every rank of the job) decides for all:
//! - **overflow**: a non-finite value on any rank in any accumulator skips the step on every
//!   rank; each accumulator's window reports it, so each rank's scaler updates alike and each
//!   optimizer skips; under [`crate::Overflow::DropMicrobatch`], [`Mesh::end_microbatch`]
//!   instead drops a poisoned micro-batch on every rank that computed from its data, and a
//!   micro-batch dropped alike by those peers skips nothing;
//! - **item counts**: the gradient is normalised by the job's totals, summed over the data axes
//!   only (each data-parallel rank's window once): ranks at one data-parallel rank saw the same
//!   data and must count alike, or the step fails on every rank naming them;
//! - **the global norm**: every distinct gradient element once (each group's reduced gradient
//!   once, by its rank 0; a tensor declared [`Replicated`] once over its copies), and one clip
//!   coefficient, the same bits on every rank;
//! - **where** the job first went non-finite, in world ranks.
//!
//! The order of a step: each part's group agrees its control step, in the order given (nothing
//! changes yet); the world gathers every rank's claim and every rank reads the same verdict
//! ([`agreement`]); each part reduces, normalised by the job's totals; the world gathers what
//! each rank measured, and every rank folds the same norm and clips. A failure before the
//! reductions leaves every window intact; one after them discards every part's window.

mod agreement;
mod shape;

pub use shape::{Axis, MeshShape};

use std::sync::Arc;

use agreement::{
    Claim, Declared, Measure, Overflow, Totals, Verdict, CLAIM_WORDS, COPY_WORDS, MICROBATCH_WORDS,
};

use crate::accumulator::boundary::Opened;
use crate::accumulator::protocol;
use crate::accumulator::{Accumulator, OverflowAt, SyncInfo};
use crate::comm::{Communicator, HostCollectives};
use crate::error::{Error, ErrorKind, Result};
use crate::math;

/// A tensor whose values several model-parallel ranks hold alike (a layer norm replicated over
/// tensor-parallel ranks, a tied embedding on the first and last pipeline stage): it enters the
/// global norm once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replicated {
    /// The tensor's index in its accumulator.
    pub tensor: usize,
    /// The same on every copy, and different for different tensors (a hash of the parameter's
    /// name, say, with the tensor-parallel rank for a tied, vocabulary-sharded embedding).
    pub key: u64,
    /// How many model-parallel ranks hold it (at one data-parallel rank): the step checks that
    /// exactly that many declare it.
    pub copies: usize,
}

/// One accumulator of a mesh step and the group it reduces over.
#[derive(Clone, Copy)]
pub struct Part<'a> {
    pub accumulator: &'a Accumulator,
    /// Its group (as [`Accumulator::sync`]'s; `None`: alone, or a sharded accumulation's own).
    pub comm: Option<&'a dyn Communicator>,
    /// A hybrid boundary's replica group ([`Accumulator::sync_hybrid`]).
    pub replicas: Option<&'a dyn Communicator>,
    /// Its replicated tensors; the accumulator must measure its tensors (`tensor_stats`).
    pub replicated: &'a [Replicated],
}

impl<'a> Part<'a> {
    /// `accumulator`, reduced over `comm`.
    pub fn new(accumulator: &'a Accumulator, comm: Option<&'a dyn Communicator>) -> Self {
        Part { accumulator, comm, replicas: None, replicated: &[] }
    }
}

/// What is known of a part of a step whose arguments were refused before [`Mesh::sync`] (by the
/// C ABI): the groups it can still tell, so that their peers fail instead of waiting.
#[cfg(feature = "internal")]
#[derive(Clone, Copy, Default)]
pub struct RefusedPart<'a> {
    pub accumulator: Option<&'a Accumulator>,
    pub comm: Option<&'a dyn Communicator>,
    pub replicas: Option<&'a dyn Communicator>,
}

/// What a mesh step reports, the same on every rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MeshInfo {
    /// The job's report: the totals are the job's (over the data axes), the norm is the global
    /// norm, and an overflow's rank is a world rank. Every part's window reports it too.
    pub info: SyncInfo,
    /// The part of the world rank's step that [`SyncInfo::overflow`] names.
    pub overflow_part: Option<usize>,
}

/// One boundary over a job's accumulators: the world communicator and this rank's place on the
/// data axes. See the module's documentation for what it agrees.
pub struct Mesh {
    world: Arc<dyn Communicator>,
    data_rank: usize,
    data_size: usize,
    /// The ranks that computed from the same data share it ([`Mesh::end_microbatch`]).
    drop_class: usize,
    max_grad_norm: f32,
}

impl Mesh {
    /// A mesh over `world`, a host communicator of every rank of the job, where this rank is
    /// data-parallel rank `data_rank` of `data_size` (data-parallel × context-parallel: the
    /// ranks that see different data). Clipping is off until [`Mesh::max_grad_norm`].
    pub fn new(world: Arc<dyn Communicator>, data_rank: usize, data_size: usize) -> Result<Self> {
        if world.host().is_none() {
            return Err(Error::new(
                ErrorKind::DeviceMismatch,
                "a mesh's world communicator is a host one (in-process or MPI): its agreement is \
                 a few words on the host",
            ));
        }
        if data_size == 0 || data_rank >= data_size {
            return Err(Error::invalid(format!(
                "`data_rank` = {data_rank} is not below `data_size` = {data_size}"
            )));
        }
        let size = world.world_size();
        if !size.is_multiple_of(data_size) {
            return Err(Error::invalid(format!(
                "`data_size` = {data_size} does not divide `world`'s {size} ranks"
            )));
        }
        Ok(Mesh { world, data_rank, data_size, drop_class: data_rank, max_grad_norm: 0.0 })
    }

    /// A mesh whose place on the data axes `shape` names. Its micro-batch drops
    /// ([`Mesh::end_microbatch`]) also join the data ranks that an expert group spans.
    pub fn of_shape(world: Arc<dyn Communicator>, shape: &MeshShape) -> Result<Self> {
        let rank = world.rank();
        let mut mesh = Self::new(world, shape.data_rank(rank), shape.data_size())?;
        let data: Vec<usize> = (0..shape.world()).map(|r| shape.data_rank(r)).collect();
        let experts = (0..shape.world())
            .map(|r| shape.members(r, &[Axis::Etp, Axis::Ep]))
            .collect::<Result<Vec<_>>>()?;
        mesh.drop_class = agreement::drop_classes(&data, &experts)[mesh.data_rank];
        Ok(mesh)
    }

    /// Ends the open micro-batch of each of `accumulators` (this rank's, under
    /// [`crate::Overflow::DropMicrobatch`], each fed tensor by tensor since `begin_microbatch`),
    /// agreeing its drop over the world first: if any rank that computed from the same data
    /// (the ranks at this data-parallel rank, and under [`Mesh::of_shape`] the data ranks an
    /// expert group spans) found a non-finite gradient in any of its accumulators, every one of
    /// them drops the micro-batch in every accumulator; the others keep theirs. Every rank of
    /// the world calls it once per micro-batch. Returns whether this rank kept the micro-batch.
    /// On an invalid call on any rank, or a failed gather, every micro-batch stays open.
    pub fn end_microbatch(&self, accumulators: &[&Accumulator]) -> Result<bool> {
        self.end_microbatches(accumulators, None)
    }

    /// Takes part in a micro-batch's agreement this rank cannot make (its arguments were refused
    /// before [`Mesh::end_microbatch`]), flagged invalid: every other rank fails with
    /// PeerFailure instead of waiting. Changes nothing.
    #[cfg(feature = "internal")]
    pub fn refuse_microbatch(&self) {
        let _ = self.end_microbatches(&[], Some(Error::invalid("refused")));
    }

    fn end_microbatches(&self, accumulators: &[&Accumulator], own: Option<Error>) -> Result<bool> {
        let world = self.world.host().expect("checked at creation");
        let poisoned =
            own.map_or(Ok(()), Err).and_then(|()| check_microbatch(accumulators)).and_then(|()| {
                accumulators.iter().try_fold(false, |bad, a| Ok(a.microbatch_poisoned()? || bad))
            });
        let bad = matches!(poisoned, Ok(true));
        let words = [poisoned.is_err() as u64, bad as u64, self.drop_class as u64];
        let gathered =
            gather_words(world, &words, &vec![MICROBATCH_WORDS; self.world.world_size()]).map_err(
                |e| {
                    // A gather past its deadline ends this rank's use of the world, as a step's.
                    if e.kind == ErrorKind::Timeout {
                        let _ = self.world.abort();
                    }
                    Error::new(e.kind, format!("{}; every micro-batch is still open", e.message))
                },
            )?;
        let drop = agreement::drops_microbatch(
            &gathered,
            self.drop_class as u64,
            poisoned.as_ref().err(),
        )?;
        // Every accumulator ends its micro-batch, whatever one of them says: the ranks agreed.
        let ended: Vec<Result<()>> =
            accumulators.iter().map(|a| a.end_microbatch_with(drop)).collect();
        ended.into_iter().collect::<Result<()>>()?;
        Ok(!drop)
    }

    /// Clips the global norm to `max_norm` (0: off), as PyTorch's `clip_grad_norm_` over every
    /// parameter of the model. The accumulators themselves do not clip.
    pub fn max_grad_norm(mut self, max_norm: f32) -> Result<Self> {
        if !(max_norm.is_finite() && max_norm >= 0.0) {
            return Err(Error::invalid(format!(
                "`max_grad_norm` = {max_norm} is not a finite value at least 0 (0: off)"
            )));
        }
        self.max_grad_norm = max_norm;
        Ok(self)
    }

    pub fn world(&self) -> &Arc<dyn Communicator> {
        &self.world
    }

    /// The boundary of every part of this rank's step. Every rank of the world calls it, each
    /// with its own parts; the ranks of each part's group give that part at the same position
    /// of the parts they share. Returns the job's report; every part's window is synced with
    /// it, so the scaler's `update_from` and each optimizer's step follow it.
    pub fn sync(&self, parts: &[Part<'_>]) -> Result<MeshInfo> {
        let result = self.step(parts);
        if let Err(e) = &result {
            // A step past its deadline ends this rank's use of its groups.
            if e.kind == ErrorKind::Timeout {
                let _ = self.world.abort();
                for p in parts {
                    for c in p.comm.iter().chain(&p.replicas) {
                        let _ = c.abort();
                    }
                }
            }
        }
        result
    }

    /// Takes part in a step this rank cannot make (its arguments were refused before
    /// [`Mesh::sync`]): each known part's control step, in order, and the world's gather, flagged
    /// invalid, so that every other rank fails with PeerFailure instead of waiting. A part whose
    /// groups are unknown (no communicator and no accumulator) leaves its group's peers waiting
    /// until their timeout. Changes nothing.
    #[cfg(feature = "internal")]
    pub fn refuse(&self, parts: &[RefusedPart<'_>]) {
        for p in parts {
            refuse_groups(p.accumulator, p.comm, p.replicas);
        }
        let world = self.world.host().expect("checked at creation");
        let claim = self.claim(&[], &[], true);
        let _ = gather_claims(world, self.world.world_size(), &claim, &[]);
    }

    fn step(&self, parts: &[Part<'_>]) -> Result<MeshInfo> {
        let world = self.world.host().expect("checked at creation");
        let size = self.world.world_size();
        let own = check_parts(parts).err();
        let (mut opened, own) = open(parts, own);
        let own = own.or_else(|| same_windows(&opened).err());
        let claim = self.claim(parts, &opened, own.is_some());
        let copies = declared(parts, &opened);
        let gathered = gather_claims(world, size, &claim, &copies);
        let (claims, verdict) = match gathered
            .and_then(|(claims, copies)| Ok((Verdict::of(&claims, &copies, own.as_ref())?, claims)))
        {
            Ok((verdict, claims)) => (claims, verdict),
            // Nothing was reduced: every window is as it was.
            Err(e) => return Err(intact(e)),
        };
        let result = reduce(&mut opened, &verdict.totals).and_then(|infos| {
            let mine = measure(parts, &opened, &infos).words();
            let counts: Vec<usize> = claims.iter().map(|c| 2 + c.copies as usize).collect();
            let all = gather_words(world, &mine, &counts)?;
            self.conclude(&mut opened, &verdict, &all)
        });
        if result.is_err() {
            opened.iter_mut().for_each(Opened::discard);
        }
        result.map_err(|e| {
            Error::new(e.kind, format!("{} (every part's window was discarded)", e.message))
        })
    }

    /// This rank's claim: its place, its windows' counts (those of its first part: the others
    /// were checked alike) and where they first went non-finite.
    fn claim(&self, parts: &[Part<'_>], opened: &[Opened<'_>], error: bool) -> Claim {
        let mut claim = Claim {
            error,
            data_rank: self.data_rank as u64,
            data_size: self.data_size as u64,
            setup: u64::from(self.max_grad_norm.to_bits()) ^ 0x6d65_7368_0000_0000,
            copies: parts.iter().map(|p| p.replicated.len() as u64).sum(),
            ..Claim::default()
        };
        if error || opened.len() != parts.len() {
            return claim;
        }
        let p = &opened[0].proposal;
        (claim.count, claim.microbatches, claim.ranks, claim.dropped) =
            (p.count, p.microbatches, p.ranks, p.dropped);
        claim.drops = opened[0].drops();
        for (i, o) in opened.iter().enumerate() {
            let group_inf = o.agreed.totals.is_some_and(|t| t.found_inf);
            claim.found_inf |= group_inf;
            let place = o.proposal.first_bad.map(|(mb, tensor)| (mb, i as u64, tensor as u64));
            claim.first_bad = match (claim.first_bad, place) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            claim.unlocated |= o.proposal.unlocated;
        }
        claim
    }

    /// The job's report from the verdict and every rank's measures; each part's window is
    /// concluded with it, and clipped by the job's coefficient.
    fn conclude(
        &self,
        opened: &mut [Opened<'_>],
        verdict: &Verdict,
        measures: &[Vec<u64>],
    ) -> Result<MeshInfo> {
        let (sum_inf, grad_norm) = agreement::global_norm(measures, &verdict.counted);
        let found_inf = sum_inf || verdict.skip || !grad_norm.is_finite();
        let clip_coef = math::clip_coef(grad_norm, self.max_grad_norm as f64);
        let (overflow, overflow_part) = match verdict.overflow {
            Overflow::At(microbatch, part, tensor, rank) => (
                Some(OverflowAt::Gradient {
                    rank: rank as usize,
                    microbatch,
                    tensor: tensor as usize,
                }),
                Some(part as usize),
            ),
            Overflow::None if found_inf => (Some(OverflowAt::Reduction), None),
            _ => (None, None),
        };
        let Totals { count, microbatches, dropped, .. } = verdict.totals;
        let info = SyncInfo {
            found_inf,
            total_count: count,
            microbatches,
            grad_norm,
            clip_coef,
            dropped_microbatches: dropped,
            overflow,
        };
        // The coefficient rounded to f32 once, applied to the normalised gradient.
        let factor = clip_coef as f32;
        for o in opened.iter_mut() {
            if !found_inf && factor != 1.0 {
                o.scale(factor)?;
            }
        }
        opened.iter_mut().try_for_each(|o| o.conclude(info))?;
        Ok(MeshInfo { info, overflow_part })
    }
}

/// `Mesh::end_microbatch`'s own checks: at least one accumulator, each once.
fn check_microbatch(accumulators: &[&Accumulator]) -> Result<()> {
    if accumulators.is_empty() {
        return Err(Error::invalid("end_microbatch needs at least one accumulator"));
    }
    for (i, a) in accumulators.iter().enumerate() {
        if let Some(j) = accumulators[..i].iter().position(|b| std::ptr::eq(*a, *b)) {
            return Err(Error::invalid(format!(
                "accumulators[{j}] and accumulators[{i}] are the same accumulator: each ends its \
                 micro-batch once"
            )));
        }
    }
    Ok(())
}

/// This rank's own checks of its parts: at least one, each accumulator once, not clipping by
/// itself, and its replicated tensors measured and named once.
fn check_parts(parts: &[Part<'_>]) -> Result<()> {
    if parts.is_empty() {
        return Err(Error::invalid("a mesh step needs at least one part"));
    }
    for (i, p) in parts.iter().enumerate() {
        let acc = p.accumulator;
        if let Some(j) = parts[..i].iter().position(|q| std::ptr::eq(q.accumulator, acc)) {
            return Err(Error::invalid(format!(
                "parts[{j}] and parts[{i}] are the same accumulator: each is synced once"
            )));
        }
        let max = acc.config().max_grad_norm;
        if max != 0.0 {
            return Err(Error::invalid(format!(
                "parts[{i}]'s accumulator clips by itself (max_grad_norm {max}): in a mesh step \
                 the norm is the job's, so the mesh clips (Mesh::max_grad_norm); create the \
                 accumulator with max_grad_norm 0"
            )));
        }
        check_replicated(i, p)?;
    }
    Ok(())
}

fn check_replicated(i: usize, p: &Part<'_>) -> Result<()> {
    let n = p.accumulator.tensors().len();
    if !p.replicated.is_empty() && !p.accumulator.config().tensor_stats {
        return Err(Error::invalid(format!(
            "parts[{i}] declares replicated tensors, but its accumulator does not measure its \
             tensors: create it with tensor_stats on, whose per-tensor norms count each copy once"
        )));
    }
    for (j, r) in p.replicated.iter().enumerate() {
        if r.tensor >= n || r.copies == 0 {
            return Err(Error::invalid(format!(
                "parts[{i}].replicated[{j}]: tensor {} of {n} with {} copies (a tensor of the                  accumulator, at least 1 copy)",
                r.tensor, r.copies
            )));
        }
        if p.replicated[..j].iter().any(|q| q.tensor == r.tensor) {
            return Err(Error::invalid(format!(
                "parts[{i}].replicated[{j}]: tensor {} is declared twice",
                r.tensor
            )));
        }
    }
    Ok(())
}

/// Opens each part's boundary in order (its group's control step). After a failure (or with
/// this rank's own error `own`), the remaining parts' groups are told, so that no peer waits for
/// a control step this rank does not make. Returns the opened boundaries and the first error.
fn open<'a>(parts: &[Part<'a>], own: Option<Error>) -> (Vec<Opened<'a>>, Option<Error>) {
    let mut opened = Vec::with_capacity(parts.len());
    let mut error = own;
    for p in parts {
        if error.is_some() {
            refuse_groups(Some(p.accumulator), p.comm, p.replicas);
            continue;
        }
        match p.accumulator.open_boundary(p.comm, p.replicas, true, None) {
            Ok(o) => opened.push(o),
            Err(e) => error = Some(e),
        }
    }
    (opened, error)
}

/// Takes part, flagged invalid, in the control steps of a part's groups that are known: through
/// its accumulator (its boundary's control step, as the peers run it, also on NCCL), else on
/// `comm` and the replicas directly (a host communicator's step carries the flag).
fn refuse_groups(
    accumulator: Option<&Accumulator>,
    comm: Option<&dyn Communicator>,
    replicas: Option<&dyn Communicator>,
) {
    if let Some(a) = accumulator {
        let refused = Error::invalid("this rank's mesh step was refused");
        let _ = a.open_boundary(comm, replicas, true, Some(refused));
        return;
    }
    comm.into_iter().chain(replicas).for_each(protocol::refuse);
}

/// Every accumulator of a rank holds the same window: the same micro-batches, with the
/// micro-batch's item count.
fn same_windows(opened: &[Opened<'_>]) -> Result<()> {
    let counts = |o: &Opened<'_>| {
        let p = &o.proposal;
        (p.count, p.microbatches, p.ranks, p.dropped)
    };
    let first = counts(&opened[0]);
    let drops = opened[0].drops();
    if let Some(i) = opened.iter().position(|o| counts(o) != first || o.drops() != drops) {
        let (c, m, _, d) = counts(&opened[i]);
        return Err(Error::invalid(format!(
            "parts[{i}]'s window holds {c} items in {m} micro-batches ({d} dropped), parts[0]'s \
             {} in {} ({} dropped), or they dropped different micro-batches: every accumulator \
             of a rank is fed the same micro-batches, each with the micro-batch's item count \
             (not the tokens an expert received), and drops alike (Mesh::end_microbatch)",
            first.0, first.1, first.3
        )));
    }
    Ok(())
}

/// The copies of replicated tensors this rank declares, in part order.
fn declared(parts: &[Part<'_>], opened: &[Opened<'_>]) -> Vec<Declared> {
    let complete = opened.len() == parts.len();
    parts
        .iter()
        .flat_map(|p| {
            let leader = complete && leads(p);
            p.replicated.iter().map(move |r| Declared {
                key: r.key,
                copies: r.copies as u64,
                numel: p.accumulator.tensors().get(r.tensor).map_or(0, |t| t.numel as u64),
                leader,
            })
        })
        .collect()
}

/// Whether this rank counts `p`'s group's gradient: it is rank 0 of the group (and of the
/// replicas), whose reduced gradient and norm every member holds alike.
fn leads(p: &Part<'_>) -> bool {
    let comm = p.comm.or(p.accumulator.bound());
    comm.is_none_or(|c| c.rank() == 0) && p.replicas.is_none_or(|r| r.rank() == 0)
}

/// Every rank's claim and declared copies, in world rank order.
fn gather_claims(
    world: &dyn HostCollectives,
    size: usize,
    claim: &Claim,
    copies: &[Declared],
) -> Result<(Vec<Claim>, Vec<Declared>)> {
    let all = gather_words(world, &claim.words(), &vec![CLAIM_WORDS; size])?;
    let claims: Vec<Claim> = all.iter().map(|w| Claim::from_words(w)).collect();
    if claims.iter().all(|c| c.copies == 0) {
        return Ok((claims, Vec::new()));
    }
    let mine: Vec<u64> = copies.iter().flat_map(Declared::words).collect();
    let counts: Vec<usize> = claims.iter().map(|c| c.copies as usize * COPY_WORDS).collect();
    let all = gather_words(world, &mine, &counts)?;
    let copies = all.iter().flat_map(|w| w.chunks(COPY_WORDS).map(Declared::from_words)).collect();
    Ok((claims, copies))
}

/// `mine` gathered over the world, rank `r` bringing `counts[r]` words.
fn gather_words(
    world: &dyn HostCollectives,
    mine: &[u64],
    counts: &[usize],
) -> Result<Vec<Vec<u64>>> {
    let bytes: Vec<u8> = mine.iter().flat_map(|w| w.to_le_bytes()).collect();
    let byte_counts: Vec<usize> = counts.iter().map(|c| c * 8).collect();
    let all = world.allgather_bytes(&bytes, &byte_counts)?;
    let mut at = 0;
    Ok(counts
        .iter()
        .map(|&c| {
            let words = all[at..at + c * 8]
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect();
            at += c * 8;
            words
        })
        .collect())
}

/// Each part reduced over its group and normalised by the job's totals.
fn reduce(opened: &mut [Opened<'_>], totals: &Totals) -> Result<Vec<SyncInfo>> {
    opened
        .iter_mut()
        .map(|o| {
            if let Some(t) = &mut o.agreed.totals {
                (t.count, t.microbatches, t.ranks, t.dropped) =
                    (totals.count, totals.microbatches, totals.ranks, totals.dropped);
            }
            o.finish(true)?
                .ok_or_else(|| Error::new(ErrorKind::Internal, "a read boundary returned no info"))
        })
        .collect()
}

/// What this rank counts of the global norm: the squares of each group it leads (without its
/// replicated tensors, whose squares are listed apart), and whether a sum overflowed.
fn measure(parts: &[Part<'_>], opened: &[Opened<'_>], infos: &[SyncInfo]) -> Measure {
    let mut m = Measure { found_inf: false, squares: 0.0, copies: Vec::new() };
    for ((p, o), info) in parts.iter().zip(opened).zip(infos) {
        m.found_inf |= info.found_inf;
        let lead = leads(p);
        if p.replicated.is_empty() {
            if lead {
                m.squares += info.grad_norm * info.grad_norm;
            }
            continue;
        }
        let stats = o.tensor_stats().unwrap_or_default();
        let square = |t: usize| stats.get(t).map_or(0.0, |s| s.grad_norm * s.grad_norm);
        if lead {
            let own = (0..stats.len()).filter(|t| p.replicated.iter().all(|r| r.tensor != *t));
            m.squares += own.map(square).sum::<f64>();
        }
        m.copies.extend(p.replicated.iter().map(|r| if lead { square(r.tensor) } else { 0.0 }));
    }
    m
}

/// An error before any reduction: every window is intact.
fn intact(e: Error) -> Error {
    match e.kind {
        ErrorKind::CommFailure | ErrorKind::Timeout => Error::new(
            e.kind,
            format!(
                "{}; every part's window is intact (save_window them, or sync again)",
                e.message
            ),
        ),
        _ => e,
    }
}
