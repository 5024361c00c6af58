//! What the ranks of a job exchange at a mesh step, and the verdicts every rank reads from the
//! same gathered words: the claims before anything is reduced ([`Claim`], [`Verdict::of`]), the
//! norm's parts after ([`Measure`], [`global_norm`]). Pure functions over the gathered arrays, so
//! every rank reaches the same verdict and the same bits.

use std::collections::BTreeMap;

use crate::error::{Error, ErrorKind, Result};

/// No place: the rank's windows stayed finite.
const NONE: u64 = u64::MAX;

/// What one rank brings to the step before anything is reduced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Claim {
    /// This rank's call is invalid (its own error is kept on the rank).
    pub error: bool,
    /// Its index along the data axes (data-parallel × context-parallel), and their size.
    pub data_rank: u64,
    pub data_size: u64,
    /// What every rank must share to step alike (the mesh's clipping norm).
    pub setup: u64,
    /// This rank's window: items, micro-batches, rank-windows and dropped micro-batches (the
    /// same in every accumulator of the rank).
    pub count: u64,
    pub microbatches: u64,
    pub ranks: u64,
    pub dropped: u64,
    /// Which micro-batches the window dropped ([`crate::accumulator`]'s drop signature).
    pub drops: u64,
    /// Some accumulator's group saw a non-finite value.
    pub found_inf: bool,
    /// Where this rank's windows first went non-finite: (micro-batch, part, tensor); `unlocated`
    /// when a window went non-finite where no place is known.
    pub first_bad: Option<(u64, u64, u64)>,
    pub unlocated: bool,
    /// The replicated tensors this rank declares ([`Declared`] copies follow in a second gather).
    pub copies: u64,
}

/// A declared copy of a replicated tensor, in a rank's part order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Declared {
    pub key: u64,
    pub copies: u64,
    pub numel: u64,
    /// The copy is in an accumulator whose group this rank leads (rank 0): its group's value of
    /// the tensor is this rank's to count.
    pub leader: bool,
}

pub(super) const CLAIM_WORDS: usize = 15;
pub(super) const COPY_WORDS: usize = 4;

impl Claim {
    pub(super) fn words(&self) -> [u64; CLAIM_WORDS] {
        let (mb, part, tensor) = self.first_bad.unwrap_or((NONE, NONE, NONE));
        [
            self.error as u64,
            self.data_rank,
            self.data_size,
            self.setup,
            self.count,
            self.microbatches,
            self.ranks,
            self.dropped,
            self.found_inf as u64,
            mb,
            part,
            tensor,
            self.unlocated as u64,
            self.copies,
            self.drops,
        ]
    }

    pub(super) fn from_words(w: &[u64]) -> Self {
        Claim {
            error: w[0] != 0,
            data_rank: w[1],
            data_size: w[2],
            setup: w[3],
            count: w[4],
            microbatches: w[5],
            ranks: w[6],
            dropped: w[7],
            found_inf: w[8] != 0,
            first_bad: (w[9] != NONE).then_some((w[9], w[10], w[11])),
            unlocated: w[12] != 0,
            copies: w[13],
            drops: w[14],
        }
    }
}

impl Declared {
    pub(super) fn words(&self) -> [u64; COPY_WORDS] {
        [self.key, self.copies, self.numel, self.leader as u64]
    }

    pub(super) fn from_words(w: &[u64]) -> Self {
        Declared { key: w[0], copies: w[1], numel: w[2], leader: w[3] != 0 }
    }
}

/// The job's totals: what every accumulator normalises by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Totals {
    pub count: u64,
    pub microbatches: u64,
    pub ranks: u64,
    pub dropped: u64,
}

/// Where the job first went non-finite (a dropped micro-batch's place included), or why no
/// place is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Overflow {
    /// Every window stayed finite and dropped nothing (a sum may still overflow: the norm tells).
    None,
    /// (micro-batch, part, tensor, world rank) of the first non-finite value.
    At(u64, u64, u64, u64),
    /// Some window went non-finite where no place is known: it may precede every located one.
    Unlocated,
    /// Ranks that saw the same data dropped different micro-batches: their gradients are of
    /// different batches.
    DropsDiffer,
}

/// The verdict on the gathered claims: the same on every rank.
#[derive(Debug)]
pub(super) struct Verdict {
    pub totals: Totals,
    pub overflow: Overflow,
    /// The step is skipped on every rank: a window kept a non-finite value, or peers dropped
    /// differently. A micro-batch dropped alike by every peer that saw it skips nothing.
    pub skip: bool,
    /// Per declared copy (in gather order: ranks, then each rank's copies), whether it is the
    /// one that enters the norm.
    pub counted: Vec<bool>,
}

impl Verdict {
    /// The verdict on every rank's claim (`claims`, in world rank order) and declared copies
    /// (`copies`, in the same order). A rank whose own call is invalid gets its error back
    /// (`own`); the others fail naming it.
    pub(super) fn of(
        claims: &[Claim],
        copies: &[Declared],
        own: Option<&Error>,
    ) -> Result<Verdict> {
        if let Some(e) = own {
            return Err(e.clone());
        }
        let ranks = |pred: &dyn Fn(&Claim) -> bool| -> Vec<usize> {
            claims.iter().enumerate().filter(|(_, c)| pred(c)).map(|(r, _)| r).collect()
        };
        let failed = ranks(&|c| c.error);
        if !failed.is_empty() {
            return Err(Error::new(
                ErrorKind::PeerFailure,
                format!(
                    "the mesh step failed on world rank{} {}; no rank reduced",
                    if failed.len() == 1 { "" } else { "s" },
                    list(&failed)
                ),
            ));
        }
        check_setup(claims)?;
        let data = data_indices(claims)?;
        let (totals, overflow) = totals(claims, &data)?;
        let counted = owners(claims, copies)?;
        let skip =
            overflow == Overflow::DropsDiffer || claims.iter().any(|c| c.found_inf || c.unlocated);
        Ok(Verdict { totals, overflow, skip, counted })
    }
}

/// Every rank clips alike.
fn check_setup(claims: &[Claim]) -> Result<()> {
    if let Some(r) = claims.iter().position(|c| c.setup != claims[0].setup) {
        return Err(Error::invalid(format!(
            "world ranks 0 and {r} configure the mesh step differently (max_grad_norm); no rank \
             reduced"
        )));
    }
    Ok(())
}

/// The world ranks at each data index, checked: every rank names the same number of data
/// indices, each index below it, and each index held by as many ranks (the model-parallel
/// ranks that see that index's data).
fn data_indices(claims: &[Claim]) -> Result<Vec<Vec<usize>>> {
    let size = claims[0].data_size;
    if let Some(r) = claims.iter().position(|c| c.data_size != size) {
        return Err(Error::invalid(format!(
            "world ranks 0 and {r} name {size} and {} data-parallel ranks: the world does not \
             hold one data-parallel layout; no rank reduced",
            claims[r].data_size
        )));
    }
    let world = claims.len() as u64;
    if size == 0 || !world.is_multiple_of(size) {
        return Err(Error::invalid(format!(
            "{size} data-parallel ranks do not divide the world of {world} ranks; no rank reduced"
        )));
    }
    let mut at = vec![Vec::new(); size as usize];
    for (r, c) in claims.iter().enumerate() {
        at[c.data_rank.min(size - 1) as usize].push(r);
    }
    let per = (world / size) as usize;
    if let Some(d) = at.iter().position(|ranks| ranks.len() != per) {
        return Err(Error::invalid(format!(
            "data-parallel rank {d} is held by world rank{} {} where each of the {size} must be \
             held by {per} (the world's size over the data-parallel size): the data-parallel \
             ranks do not tile the world; no rank reduced",
            if at[d].len() == 1 { "" } else { "s" },
            list(&at[d])
        )));
    }
    Ok(at)
}

/// The job's totals (each data index's window counted once) and its overflow verdict. Ranks at
/// one data index saw the same data: they must count alike, unless they dropped different
/// micro-batches (the step is then skipped).
fn totals(claims: &[Claim], data: &[Vec<usize>]) -> Result<(Totals, Overflow)> {
    let mut totals = Totals::default();
    let mut drops_differ = false;
    for ranks in data {
        let first = &claims[ranks[0]];
        for &r in &ranks[1..] {
            let c = &claims[r];
            if (c.dropped, c.drops) != (first.dropped, first.drops) {
                drops_differ = true;
            } else if (c.count, c.microbatches, c.ranks)
                != (first.count, first.microbatches, first.ranks)
            {
                return Err(Error::invalid(format!(
                    "world ranks {} and {r} share data-parallel rank {} but their windows differ \
                     ({} items in {} micro-batches over {} rank-windows against {} in {} over \
                     {}): ranks that see the same data (tensor-, pipeline- and expert-tensor-\
                     parallel peers) count alike; no rank reduced",
                    ranks[0],
                    first.data_rank,
                    first.count,
                    first.microbatches,
                    first.ranks,
                    c.count,
                    c.microbatches,
                    c.ranks
                )));
            }
        }
        totals.count += first.count;
        totals.microbatches += first.microbatches;
        totals.ranks += first.ranks;
        totals.dropped += first.dropped;
    }
    let overflow = if drops_differ {
        Overflow::DropsDiffer
    } else if claims.iter().any(|c| c.unlocated) {
        Overflow::Unlocated
    } else {
        let located = claims.iter().enumerate().filter_map(|(r, c)| {
            c.first_bad.map(|(mb, part, tensor)| (mb, part, tensor, r as u64))
        });
        match located.min() {
            Some((mb, part, tensor, rank)) => Overflow::At(mb, part, tensor, rank),
            None if claims.iter().any(|c| c.found_inf) => Overflow::Unlocated,
            None => Overflow::None,
        }
    };
    Ok((totals, overflow))
}

/// Which declared copies enter the norm: of each key's copies in accumulators whose groups
/// their ranks lead, the first in world rank order. Every declaration of a key must name the
/// same number of copies and elements, and the leading copies must be that many: a peer that
/// forgot to declare its copy (it would be counted twice) fails the step.
fn owners(claims: &[Claim], copies: &[Declared]) -> Result<Vec<bool>> {
    let mut rank_of = Vec::with_capacity(copies.len());
    for (r, c) in claims.iter().enumerate() {
        rank_of.extend(std::iter::repeat_n(r, c.copies as usize));
    }
    let mut keys: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, c) in copies.iter().enumerate() {
        keys.entry(c.key).or_default().push(i);
    }
    let mut counted = vec![false; copies.len()];
    for (key, all) in &keys {
        let first = &copies[all[0]];
        if let Some(&i) = all
            .iter()
            .find(|&&i| (copies[i].copies, copies[i].numel) != (first.copies, first.numel))
        {
            return Err(Error::invalid(format!(
                "replicated tensor key {key:#x}: world rank {} declares {} copies of {} elements, \
                 world rank {} {} of {}; no rank reduced",
                rank_of[all[0]],
                first.copies,
                first.numel,
                rank_of[i],
                copies[i].copies,
                copies[i].numel
            )));
        }
        let leading: Vec<usize> = all.iter().copied().filter(|&i| copies[i].leader).collect();
        if leading.len() as u64 != first.copies {
            let ranks: Vec<usize> = leading.iter().map(|&i| rank_of[i]).collect();
            return Err(Error::invalid(format!(
                "replicated tensor key {key:#x} is declared with {} copies, but {} group{} hold{} \
                 it (world rank{} {}): a model-parallel peer holds it without declaring it \
                 replicated, or declares another number of copies; no rank reduced",
                first.copies,
                leading.len(),
                if leading.len() == 1 { "" } else { "s" },
                if leading.len() == 1 { "s" } else { "" },
                if ranks.len() == 1 { "" } else { "s" },
                list(&ranks)
            )));
        }
        if let Some(&i) = leading.first() {
            counted[i] = true;
        }
    }
    Ok(counted)
}

/// What one rank measured after its reductions: a sum overflowed, the squares of what it counts
/// itself, and the squares of each copy it declared.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Measure {
    pub found_inf: bool,
    pub squares: f64,
    pub copies: Vec<f64>,
}

impl Measure {
    pub(super) fn words(&self) -> Vec<u64> {
        let mut w = vec![self.found_inf as u64, self.squares.to_bits()];
        w.extend(self.copies.iter().map(|s| s.to_bits()));
        w
    }
}

/// The job's overflow after its reductions, and the global norm (every distinct element once):
/// each rank's own squares in world rank order, then each counted copy in gather order. Every
/// rank folds the same words in the same order: the same bits.
pub(super) fn global_norm(gathered: &[Vec<u64>], counted: &[bool]) -> (bool, f64) {
    let mut found_inf = false;
    let mut sum = 0.0f64;
    for w in gathered {
        found_inf |= w[0] != 0;
        sum += f64::from_bits(w[1]);
    }
    let copies = gathered.iter().flat_map(|w| w[2..].iter());
    for (bits, &counted) in copies.zip(counted) {
        if counted {
            sum += f64::from_bits(*bits);
        }
    }
    (found_inf, sum.sqrt())
}

/// The words each rank brings to [`crate::Mesh::end_microbatch`]: its call is invalid, its
/// micro-batch holds a non-finite gradient, and its drop class (the ranks that computed from
/// the same data share one).
pub(super) const MICROBATCH_WORDS: usize = 3;

/// Whether this rank (of drop class `class`) drops the micro-batch, from every rank's words in
/// world rank order: some rank of its class found it poisoned. A rank whose own call is invalid
/// gets its error back (`own`); the others fail naming it, and no rank ends its micro-batch.
pub(super) fn drops_microbatch(
    gathered: &[Vec<u64>],
    class: u64,
    own: Option<&Error>,
) -> Result<bool> {
    if let Some(e) = own {
        return Err(e.clone());
    }
    let failed: Vec<usize> =
        gathered.iter().enumerate().filter(|(_, w)| w[0] != 0).map(|(r, _)| r).collect();
    if !failed.is_empty() {
        return Err(Error::new(
            ErrorKind::PeerFailure,
            format!(
                "end_microbatch failed on world rank{} {}; every rank's micro-batch is still open",
                if failed.len() == 1 { "" } else { "s" },
                list(&failed)
            ),
        ));
    }
    Ok(gathered.iter().any(|w| w[1] != 0 && w[2] == class))
}

/// The drop class of each data-parallel rank of `shape`: the smallest data rank whose data a
/// chain of ranks' computations joins to it. An expert's gradient holds the tokens of every
/// data rank its expert group (expert-tensor x expert axes) spans, so a micro-batch dropped at
/// one of them is dropped at all; without experts each data rank is its own class.
pub(super) fn drop_classes(data: &[usize], experts: &[Vec<usize>]) -> Vec<usize> {
    let size = data.iter().max().map_or(0, |&d| d + 1);
    let mut class: Vec<usize> = (0..size).collect();
    // Classes only fall, to the smallest data rank joined: at most `size` rounds.
    loop {
        let mut changed = false;
        for group in experts {
            let low = group.iter().map(|&r| class[data[r]]).min().unwrap_or(0);
            for &r in group {
                let c = &mut class[data[r]];
                if *c != low {
                    *c = low;
                    changed = true;
                }
            }
        }
        if !changed {
            return class;
        }
    }
}

/// `0, 2 and 5`.
fn list(ranks: &[usize]) -> String {
    match ranks {
        [] => "none".into(),
        [one] => one.to_string(),
        [init @ .., last] => {
            let init: Vec<String> = init.iter().map(|r| r.to_string()).collect();
            format!("{} and {last}", init.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claim(data_rank: u64, data_size: u64, count: u64) -> Claim {
        Claim { data_rank, data_size, count, microbatches: 2, ranks: 1, ..Default::default() }
    }

    #[test]
    fn counts_sum_over_data_ranks_only() {
        // dp 2 x tp 2: world ranks 0,1 at data rank 0, ranks 2,3 at data rank 1.
        let claims = [claim(0, 2, 7), claim(0, 2, 7), claim(1, 2, 5), claim(1, 2, 5)];
        let v = Verdict::of(&claims, &[], None).unwrap();
        assert_eq!(v.totals, Totals { count: 12, microbatches: 4, ranks: 2, dropped: 0 });
        assert_eq!(v.overflow, Overflow::None);
    }

    #[test]
    fn peers_that_count_differently_fail_naming_both() {
        let claims = [claim(0, 2, 7), claim(0, 2, 8), claim(1, 2, 5), claim(1, 2, 5)];
        let e = Verdict::of(&claims, &[], None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.message.contains("world ranks 0 and 1 share data-parallel rank 0"), "{e}");
        assert!(e.message.contains("7 items") && e.message.contains("against 8"), "{e}");
    }

    #[test]
    fn a_world_without_one_data_layout_fails() {
        let e = Verdict::of(&[claim(0, 2, 1), claim(0, 2, 1)], &[], None).unwrap_err();
        assert!(e.message.contains("data-parallel rank 0 is held by world ranks 0 and 1"), "{e}");
        let e = Verdict::of(&[claim(0, 2, 1), claim(1, 1, 1)], &[], None).unwrap_err();
        assert!(e.message.contains("name 2 and 1 data-parallel ranks"), "{e}");
        let e = Verdict::of(&[claim(0, 3, 1), claim(1, 3, 1)], &[], None).unwrap_err();
        assert!(e.message.contains("do not divide"), "{e}");
    }

    #[test]
    fn the_first_place_is_by_microbatch_part_tensor_then_rank() {
        let mut claims = [claim(0, 2, 1), claim(0, 2, 1), claim(1, 2, 1), claim(1, 2, 1)];
        claims[3].first_bad = Some((0, 1, 4));
        claims[2].first_bad = Some((0, 1, 4));
        claims[1].first_bad = Some((1, 0, 0));
        let v = Verdict::of(&claims, &[], None).unwrap();
        assert_eq!(v.overflow, Overflow::At(0, 1, 4, 2));
        claims[0].unlocated = true;
        assert_eq!(Verdict::of(&claims, &[], None).unwrap().overflow, Overflow::Unlocated);
    }

    #[test]
    fn peers_that_dropped_differently_skip() {
        let mut claims = [claim(0, 1, 3), claim(0, 1, 2)];
        claims[1].dropped = 1;
        claims[1].drops = 0x51;
        claims[1].first_bad = Some((1, 0, 0));
        let v = Verdict::of(&claims, &[], None).unwrap();
        assert_eq!(v.overflow, Overflow::DropsDiffer);
        assert!(v.skip);
        // As many drops, but of other micro-batches (the same counts by chance).
        let (mut a, mut b) = (claim(0, 1, 2), claim(0, 1, 2));
        (a.dropped, a.drops, b.dropped, b.drops) = (1, 0x51, 1, 0x77);
        let v = Verdict::of(&[a, b], &[], None).unwrap();
        assert!(v.skip && v.overflow == Overflow::DropsDiffer);
    }

    #[test]
    fn peers_that_dropped_alike_step_by_the_survivors() {
        // dp 2 x tp 2: data rank 0 dropped one micro-batch on both peers, only rank 1 names
        // the place; data rank 1 kept everything.
        let mut claims = [claim(0, 2, 4), claim(0, 2, 4), claim(1, 2, 5), claim(1, 2, 5)];
        for c in &mut claims[..2] {
            (c.dropped, c.drops, c.microbatches) = (1, 0x51, 1);
        }
        claims[1].first_bad = Some((1, 0, 3));
        let v = Verdict::of(&claims, &[], None).unwrap();
        assert!(!v.skip);
        assert_eq!(v.totals, Totals { count: 9, microbatches: 3, ranks: 2, dropped: 1 });
        assert_eq!(v.overflow, Overflow::At(1, 0, 3, 1));
        // A kept non-finite value still skips.
        claims[3].found_inf = true;
        assert!(Verdict::of(&claims, &[], None).unwrap().skip);
    }

    #[test]
    fn a_microbatch_drops_on_every_rank_of_the_poisoned_class() {
        let w = |error: u64, bad: u64, class: u64| vec![error, bad, class];
        // Classes 0, 0, 2, 2: rank 1 is poisoned.
        let gathered = [w(0, 0, 0), w(0, 1, 0), w(0, 0, 2), w(0, 0, 2)];
        assert!(drops_microbatch(&gathered, 0, None).unwrap());
        assert!(!drops_microbatch(&gathered, 2, None).unwrap());
        let failed = [w(0, 0, 0), w(1, 0, 0), w(0, 0, 2), w(1, 1, 2)];
        let e = drops_microbatch(&failed, 2, None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::PeerFailure);
        assert!(e.message.contains("world ranks 1 and 3"), "{e}");
        let own = Error::invalid("mine");
        assert_eq!(drops_microbatch(&failed, 0, Some(&own)).unwrap_err(), own);
    }

    #[test]
    fn experts_join_the_data_ranks_they_span() {
        // Data ranks of world ranks 0..6: 0, 1, 2, 3, 0, 1 (say); expert groups {0, 1} and
        // {3, 5}: data ranks 0 and 1 join, 3 joins 1's class, 2 stays alone.
        let data = [0, 1, 2, 3, 0, 1];
        assert_eq!(drop_classes(&data, &[]), [0, 1, 2, 3]);
        assert_eq!(drop_classes(&data, &[vec![0, 1], vec![3, 5]]), [0, 0, 2, 0]);
        // A chain joined in the other order.
        assert_eq!(drop_classes(&data, &[vec![2, 3], vec![1, 2], vec![0, 1]]), [0, 0, 0, 0]);
    }

    #[test]
    fn an_invalid_rank_fails_everyone_and_keeps_its_own_error() {
        let mut claims = [claim(0, 1, 1), claim(0, 1, 1), claim(0, 1, 1)];
        claims[1].error = true;
        claims[2].error = true;
        let e = Verdict::of(&claims, &[], None).unwrap_err();
        assert_eq!(e.kind, ErrorKind::PeerFailure);
        assert!(e.message.contains("world ranks 1 and 2"), "{e}");
        let own = Error::invalid("mine");
        assert_eq!(Verdict::of(&claims, &[], Some(&own)).unwrap_err(), own);
    }

    fn copy(key: u64, copies: u64, leader: bool) -> Declared {
        Declared { key, copies, numel: 10, leader }
    }

    #[test]
    fn a_replicated_tensor_counts_once_at_its_first_leading_copy() {
        // tp 2: ranks 0 and 1 each hold key 7 and lead their groups; key 9 (a tied tensor)
        // on rank 1 only leads there.
        let mut claims = [claim(0, 1, 1), claim(0, 1, 1)];
        claims[0].copies = 1;
        claims[1].copies = 2;
        let copies = [copy(7, 2, true), copy(7, 2, true), copy(9, 1, true)];
        let v = Verdict::of(&claims, &copies, None).unwrap();
        assert_eq!(v.counted, [true, false, true]);
        // A non-leading copy never counts, and only leading ones are tallied.
        let copies = [copy(7, 2, false), copy(7, 2, true), copy(9, 1, true)];
        let e = Verdict::of(&claims, &copies, None).unwrap_err();
        assert!(
            e.message
                .contains("key 0x7 is declared with 2 copies, but 1 group holds it (world rank 1)"),
            "{e}"
        );
    }

    #[test]
    fn copies_that_disagree_fail() {
        let mut claims = [claim(0, 1, 1), claim(0, 1, 1)];
        claims[0].copies = 1;
        claims[1].copies = 1;
        let e = Verdict::of(&claims, &[copy(7, 2, true), copy(7, 3, true)], None).unwrap_err();
        assert!(e.message.contains("world rank 0 declares 2 copies"), "{e}");
    }

    #[test]
    fn the_norm_folds_every_rank_then_the_counted_copies() {
        let m = |sq: f64, copies: &[f64]| {
            Measure { found_inf: false, squares: sq, copies: copies.to_vec() }.words()
        };
        let gathered = [m(9.0, &[4.0]), m(0.0, &[4.0, 3.0])];
        let (inf, norm) = global_norm(&gathered, &[true, false, true]);
        assert!(!inf);
        assert_eq!(norm, 4.0);
    }

    #[test]
    fn claims_round_trip_their_words() {
        let c = Claim {
            error: true,
            first_bad: Some((3, 1, 2)),
            unlocated: true,
            found_inf: true,
            copies: 4,
            setup: 99,
            drops: 0xdead,
            ..claim(1, 4, 17)
        };
        assert_eq!(Claim::from_words(&c.words()), c);
        let d = Declared { key: u64::MAX, copies: 2, numel: 5, leader: true };
        assert_eq!(Declared::from_words(&d.words()), d);
    }
}
