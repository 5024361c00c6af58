//! The boundary protocol: how the ranks of a group agree before anything is reduced, once for
//! every device and sharding policy.
//!
//! Before a step whose collectives must pair (a boundary; under sharded accumulation, a
//! micro-batch opening and a hook micro-batch closing), every rank brings its claim: the layout
//! it holds (element count and [`Plan::fingerprint`]) tagged with the [`Step`] it is at, its
//! counts, and whether its own call is invalid. A control exchange reduces the claims over a
//! [`Channel`] (a host communicator's control reduction, or a few words all-reduced on a device),
//! and the verdict is the same on every rank: all go on, or all fail with the
//! same kind. A rank whose call is invalid still takes part, flagged, so that no peer waits for a
//! collective it never makes ([`refuse`]). A hybrid boundary exchanges over the shard group and
//! then over the replicas, the claim tagged with the shard it holds ([`exchange`]).
//!
//! The messages of the verdicts live here too, so every device says the same words.

use std::sync::Arc;

use super::{Accumulator, Plan};
use crate::comm::{Communicator, Control, ControlSum, HostCollectives};
use crate::error::{Error, ErrorKind, Result};

/// The step a control exchange belongs to. Its tag is mixed into the fingerprint, so that ranks
/// at different steps (whose next collectives differ) never agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// The accumulation boundary (`sync`).
    Boundary,
    /// A micro-batch of a sharded accumulation opens: a whole one (`add`, cut by stripes) or one
    /// whose tensors arrive one by one (hooks, cut by buckets).
    Microbatch { whole: bool },
    /// A hook micro-batch of a sharded accumulation closes.
    Closing,
    /// An optimizer steps its shard and all-gathers the weights; `setup` fingerprints what every
    /// rank's optimizer must share (its algorithm, hyperparameters, rounding, each tensor's
    /// weight dtype and group: the all-gather's sizes follow the dtypes; and its learning rate and
    /// step count, which a device mixes into the claim from its own memory).
    Optimizer { setup: u64 },
}

impl Step {
    fn tag(self) -> u64 {
        match self {
            Step::Boundary => 0x1405_7b7e_f767_814f,
            Step::Microbatch { whole: true } => 0x5851_f42d_4c95_7f2d,
            Step::Microbatch { whole: false } => 0x2545_f491_4f6c_dd1d,
            Step::Closing => 0x9fb2_1c65_1e98_df25,
            Step::Optimizer { setup } => 0x3c6e_f372_fe94_f82b ^ setup,
        }
    }

    /// What this rank claims at the step: its layout tagged with the step (and, at a hybrid
    /// boundary, with the replica group's size: the grid has one shape everywhere), its window's
    /// counts, and whether its call is invalid.
    pub(crate) fn claim(self, plan: &Plan, replicas: Option<usize>, invalid: bool) -> Control {
        let grid = replicas.map_or(0, |r| (r as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f));
        Control {
            numel: plan.layout.len() as u64,
            layout: plan.fingerprint() ^ self.tag() ^ grid,
            error: invalid,
            ..Default::default()
        }
    }

    /// The verdict on an exchange: a rank whose call is invalid (`own`, flagged in its claim)
    /// gets its error back; every other rank the same verdict on the reduced claims.
    pub(crate) fn judge(
        self,
        total: Result<ControlSum>,
        own: Option<&Error>,
    ) -> Result<ControlSum> {
        if let Some(e) = own {
            return Err(e.clone());
        }
        let total = total?;
        self.verdict(&total)?;
        Ok(total)
    }

    fn verdict(self, total: &ControlSum) -> Result<()> {
        if total.error {
            return Err(Error::new(ErrorKind::PeerFailure, self.peer_invalid()));
        }
        if total.min_numel != total.max_numel || total.min_layout != total.max_layout {
            return Err(match self {
                Step::Boundary => ranks_differ(total.min_numel, total.max_numel),
                Step::Optimizer { .. } => Error::new(
                    ErrorKind::SizeMismatch,
                    "the ranks' optimizers differ (learning rate, step count, algorithm, \
                     hyperparameters, rounding, or a tensor's weight dtype or group) or their \
                     accumulators do; no rank stepped",
                ),
                _ => Error::new(
                    ErrorKind::SizeMismatch,
                    "the ranks are not at the same step (a micro-batch on some, the boundary on \
                     others; or add on some, add_tensor on others) or their accumulators differ; \
                     no rank reduced",
                ),
            });
        }
        Ok(())
    }

    fn peer_invalid(self) -> &'static str {
        match self {
            Step::Boundary => "another rank's sync call was invalid; no rank reduced",
            Step::Microbatch { .. } => {
                "another rank's micro-batch call was invalid; no rank reduced this micro-batch"
            }
            Step::Closing => {
                "an add_tensor call of this micro-batch was refused on another rank, so the sums \
                 lack its tensor"
            }
            Step::Optimizer { .. } => "another rank's optimizer step was invalid; no rank stepped",
        }
    }
}

/// The closing step's error on a rank whose `add_tensor` was refused: it left its tensor out of
/// every rank's sums, so every rank fails.
pub(crate) fn refused_here() -> Error {
    Error::wrong_state(
        "an add_tensor call of this micro-batch was refused on this rank: the micro-batch fails \
         on every rank",
    )
}

/// The error when the ranks' fingerprints or element counts differ.
pub(crate) fn ranks_differ(min_numel: u64, max_numel: u64) -> Error {
    Error::new(
        ErrorKind::SizeMismatch,
        format!(
            "ranks' accumulators differ (element counts from {min_numel} to {max_numel}, or a \
             different tensor layout, loss reduction, normalisation, max_grad_norm, shard count, \
             wire dtype or replica groups); no rank reduced"
        ),
    )
}

/// Whether a hook of a sharded accumulation's micro-batch may contribute tensor `index`: the
/// micro-batch is `open` (its reductions have not failed), and the tensor has not `landed` (a
/// bucket is reduced once its tensors have landed).
pub(crate) fn check_contribution(open: bool, landed: bool, index: usize) -> Result<()> {
    if !open {
        return Err(Error::wrong_state(
            "the micro-batch's reductions failed; end_microbatch discards the window",
        ));
    }
    if landed {
        return Err(Error::wrong_state(format!(
            "tensor {index} already has its contribution to this micro-batch: under sharded \
             accumulation a bucket is reduced once all of its tensors have landed, so each tensor \
             takes one contribution per micro-batch"
        )));
    }
    Ok(())
}

/// A hybrid boundary's replica reduction failed on another rank of the shard group.
pub(crate) fn replica_failed() -> Error {
    Error::new(
        ErrorKind::PeerFailure,
        "the replica reduction failed on another rank of the shard group",
    )
}

/// Where the ranks' claims are reduced: a host communicator's control reduction, or a device
/// all-reduce of the layout words and the error flag (a device's boundary reduces its counts on
/// the device, so its channel carries no counts).
pub(crate) trait Channel {
    fn exchange(&self, mine: &ControlSum) -> Result<ControlSum>;
}

/// A host communicator's control reduction as a channel.
pub(crate) struct HostChannel<'a>(pub &'a dyn HostCollectives);

impl Channel for HostChannel<'_> {
    fn exchange(&self, mine: &ControlSum) -> Result<ControlSum> {
        self.0.reduce_control(mine)
    }
}

/// The claim as the words a device all-reduces with MAX (a minimum is the complement of the
/// maximum of complements): element count, layout, their complements, the error flag, and the
/// dropped count (whose MAX says only whether a rank dropped: a device's counts are summed by its
/// boundary).
pub(crate) const CLAIM_WORDS: usize = 6;

pub(crate) fn claim_words(c: &ControlSum) -> [u64; CLAIM_WORDS] {
    [c.max_numel, c.max_layout, !c.min_numel, !c.min_layout, c.error as u64, c.dropped]
}

/// The reduced claim from the MAX of every rank's [`claim_words`].
pub(crate) fn from_claim_words(max: &[u64; CLAIM_WORDS]) -> ControlSum {
    ControlSum {
        max_numel: max[0],
        max_layout: max[1],
        min_numel: !max[2],
        min_layout: !max[3],
        error: max[4] != 0,
        dropped: max[5],
        ..Default::default()
    }
}

/// The control step at `step`: [`exchange`], then [`Step::judge`]. Returns the reduced claims
/// (the world's totals on a host channel).
pub(crate) fn agree(
    step: Step,
    group: Option<&dyn Channel>,
    replicas: Option<(&dyn Channel, usize)>,
    mine: &ControlSum,
    own: Option<&Error>,
) -> Result<ControlSum> {
    step.judge(exchange(group, replicas, mine), own)
}

/// This rank's claim `mine` reduced over `group` (none: this rank alone) and, at a hybrid
/// boundary, over `replicas` as well, where the claims are tagged with the shard this rank holds:
/// the replicas of a shard hold the same one, so ranks holding different shards differ in it. A
/// group that already differs stays different whatever the tags (a tag could reorder a minimum
/// and a maximum into agreement). If the group's exchange fails, the replicas' still runs,
/// flagged, so that no replica waits for this rank.
pub(crate) fn exchange(
    group: Option<&dyn Channel>,
    replicas: Option<(&dyn Channel, usize)>,
    mine: &ControlSum,
) -> Result<ControlSum> {
    let total = group.map_or(Ok(*mine), |c| c.exchange(mine));
    let Some((replicas, shard)) = replicas else { return total };
    let tag = (shard as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let tagged = match &total {
        Ok(t) if t.min_layout == t.max_layout => {
            ControlSum { min_layout: t.min_layout ^ tag, max_layout: t.max_layout ^ tag, ..*t }
        }
        Ok(t) => ControlSum { min_layout: 0, max_layout: u64::MAX, ..*t },
        Err(_) => ControlSum { error: true, ..*mine },
    };
    let grid = replicas.exchange(&tagged);
    total.and(grid)
}

/// Takes part in a boundary this rank cannot run (its arguments are invalid), so the other ranks
/// fail instead of waiting: a host communicator's control reduction carries the error. A device
/// communicator cannot carry it; its peers wait until they are aborted or time out.
pub(crate) fn refuse(comm: &dyn Communicator) {
    refuse_with(comm, &Control { error: true, ..Default::default() });
}

/// [`refuse`] with the claim `claim` (flagged invalid) of the step the peers are in.
pub(crate) fn refuse_with(comm: &dyn Communicator, claim: &Control) {
    if let Some(c) = comm.host() {
        let _ = c.reduce_control(&ControlSum::of(claim));
    }
}

/// What a call owes the peers of its collective while its arguments are converted: dropped
/// unsettled (an argument was refused), it tells them that this rank's call failed, so they fail
/// instead of waiting: over the call's groups that are known, else through the accumulator (its
/// own communicator under sharded accumulation; for an `add_tensor`, the micro-batch fails on
/// every rank when it closes). [`Owed::settle`] once the call reaches the accumulator, which
/// tells the peers itself from there.
#[must_use = "dropping it tells the peers that this rank's call failed"]
pub struct Owed {
    accumulator: Option<(Arc<Accumulator>, bool)>,
    groups: Vec<Arc<dyn Communicator>>,
    settled: bool,
}

impl Owed {
    /// A call whose collective is the accumulator's own: a micro-batch (or, under sharded
    /// accumulation, a boundary) on its communicator.
    pub fn collective(accumulator: &Arc<Accumulator>) -> Self {
        Owed { accumulator: Some((accumulator.clone(), false)), groups: Vec::new(), settled: false }
    }

    /// An `add_tensor`.
    pub fn tensor(accumulator: &Arc<Accumulator>) -> Self {
        Owed { accumulator: Some((accumulator.clone(), true)), groups: Vec::new(), settled: false }
    }

    /// A boundary over `groups`, those of its communicators that are valid: owed over them, or
    /// through the accumulator (when valid) if none is.
    pub fn boundary<'a>(
        accumulator: Option<&Arc<Accumulator>>,
        groups: impl IntoIterator<Item = &'a Arc<dyn Communicator>>,
    ) -> Self {
        Owed {
            accumulator: accumulator.map(|a| (a.clone(), false)),
            groups: groups.into_iter().cloned().collect(),
            settled: false,
        }
    }

    /// The call reached the accumulator: nothing is owed from here.
    pub fn settle(mut self) {
        self.settled = true;
    }
}

impl Drop for Owed {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        if !self.groups.is_empty() {
            self.groups.iter().for_each(|g| refuse(&**g));
        } else if let Some((a, tensor)) = &self.accumulator {
            if *tensor {
                a.refuse_tensor();
            } else {
                a.refuse_collective();
            }
        }
    }
}
