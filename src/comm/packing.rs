//! The control values as two small u64 arrays, so a transport with only element-wise SUM and MAX
//! (MPI, NCCL) reduces them in two collectives: SUM for counts and flags, MAX for the rest, where
//! a minimum is the complement of the maximum of complements.

use super::ControlSum;

/// Words reduced with SUM: count, micro-batches, found_inf (0/1), error (0/1), ranks, dropped.
pub const SUM_WORDS: usize = 6;
/// Words reduced with MAX: numel, !numel, layout, !layout, count, micro-batches, ranks, dropped,
/// !first_bad.
pub const MAX_WORDS: usize = 9;

/// One rank's control values (or a group's reduction) as the SUM words and the MAX words.
pub fn pack(c: &ControlSum) -> ([u64; SUM_WORDS], [u64; MAX_WORDS]) {
    (
        [c.count, c.microbatches, c.found_inf as u64, c.error as u64, c.ranks, c.dropped],
        [
            c.max_numel,
            !c.min_numel,
            c.max_layout,
            !c.min_layout,
            c.count,
            c.microbatches,
            c.ranks,
            c.dropped,
            !c.first_bad,
        ],
    )
}

/// The reduction from the element-wise SUM and MAX over every rank's words. A sum that wrapped
/// is smaller than the largest term and saturates, as [`ControlSum::merge`] does.
pub fn unpack(sum: &[u64; SUM_WORDS], max: &[u64; MAX_WORDS]) -> ControlSum {
    let saturate = |s: u64, m: u64| if s < m { u64::MAX } else { s };
    ControlSum {
        min_numel: !max[1],
        max_numel: max[0],
        min_layout: !max[3],
        max_layout: max[2],
        count: saturate(sum[0], max[4]),
        microbatches: saturate(sum[1], max[5]),
        found_inf: sum[2] != 0,
        error: sum[3] != 0,
        ranks: saturate(sum[4], max[6]),
        dropped: saturate(sum[5], max[7]),
        first_bad: !max[8],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::Control;

    /// What SUM and MAX collectives would compute over `ranks`.
    fn reduce(ranks: &[Control]) -> ControlSum {
        reduce_sums(&ranks.iter().map(ControlSum::of).collect::<Vec<_>>())
    }

    /// The same over ranks that each bring a group's reduction.
    fn reduce_sums(ranks: &[ControlSum]) -> ControlSum {
        let mut sum = [0u64; SUM_WORDS];
        let mut max = [0u64; MAX_WORDS];
        for c in ranks {
            let (s, m) = pack(c);
            for i in 0..SUM_WORDS {
                sum[i] = sum[i].wrapping_add(s[i]);
            }
            for i in 0..MAX_WORDS {
                max[i] = max[i].max(m[i]);
            }
        }
        unpack(&sum, &max)
    }

    fn fold(ranks: &[Control]) -> ControlSum {
        ranks[1..].iter().fold(ControlSum::of(&ranks[0]), |acc, c| acc.merge(&ControlSum::of(c)))
    }

    #[test]
    fn matches_the_in_process_fold() {
        let c = |numel, layout, count, microbatches, found_inf, error| Control {
            numel,
            layout,
            count,
            microbatches,
            ranks: 1 + microbatches,
            found_inf,
            dropped: count % 3,
            first_bad: if found_inf { count ^ layout } else { u64::MAX },
            error,
        };
        let cases: Vec<Vec<Control>> = vec![
            vec![c(10, 7, 3, 1, false, false)],
            vec![c(10, 7, 3, 1, false, false), c(10, 7, 0, 0, false, false)],
            vec![
                c(10, 7, 3, 1, false, false),
                c(12, 7, 5, 2, true, false),
                c(10, 9, 1, 1, false, true),
            ],
            vec![c(0, 0, 0, 0, false, false), c(u64::MAX, u64::MAX, 4, 4, true, true)],
            vec![
                c(5, 5, u64::MAX / 2, 1, false, false),
                c(5, 5, u64::MAX / 2 + 7, 1, false, false),
            ],
            vec![
                c(5, 5, 1, u64::MAX / 2, false, false),
                c(5, 5, 1, u64::MAX / 2 + 7, false, false),
            ],
        ];
        for ranks in &cases {
            assert_eq!(reduce(ranks), fold(ranks), "{ranks:?}");
        }
    }

    #[test]
    fn pseudo_random_groups() {
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            state >> 11
        };
        for _ in 0..1000 {
            let n = 1 + (next() % 6) as usize;
            let ranks: Vec<Control> = (0..n)
                .map(|_| Control {
                    numel: next() % 4,
                    layout: next() % 3,
                    count: next() % 1000,
                    microbatches: next() % 5,
                    ranks: 1 + next() % 4,
                    found_inf: next() % 5 == 0,
                    dropped: next() % 3,
                    first_bad: if next() % 2 == 0 { next() } else { u64::MAX },
                    error: next() % 7 == 0,
                })
                .collect();
            assert_eq!(reduce(&ranks), fold(&ranks), "{ranks:?}");
            // In two levels, as a hybrid boundary reduces: groups first, then their reductions.
            let groups: Vec<ControlSum> =
                ranks.chunks(1 + (next() % 3) as usize).map(reduce).collect();
            assert_eq!(reduce_sums(&groups), fold(&ranks), "{ranks:?} in groups");
        }
    }

    #[test]
    fn overflow_keys_order_as_their_places() {
        use crate::comm::OverflowKey;
        let mut state = 0x9e37_79b9u64;
        let mut next = |n: u64| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 20) % n
        };
        for _ in 0..10_000 {
            let a = (next(1 << 20), next(1 << 24) as usize, next(1 << 20) as usize);
            let b = (next(3), next(3) as usize, next(3) as usize);
            for (x, y) in [(a, b), (b, a), (a, a)] {
                let (kx, ky) = (OverflowKey::of(x.0, x.1, x.2), OverflowKey::of(y.0, y.1, y.2));
                if x.0 < (1 << 20) - 1 {
                    assert_eq!(OverflowKey::parts(kx), Some(x));
                    assert_eq!(kx.cmp(&ky), x.cmp(&y), "{x:?} {y:?}");
                }
                assert!(kx > OverflowKey::UNLOCATED, "the unlocated sorts before every place");
                assert!(kx < OverflowKey::NONE);
            }
        }
        // Past their widths the fields saturate, and never reach the two reserved words.
        let huge = OverflowKey::of(u64::MAX, usize::MAX, usize::MAX);
        assert!(huge < OverflowKey::NONE);
        assert!(OverflowKey::of(0, 0, 0) > OverflowKey::UNLOCATED);
        assert_eq!(OverflowKey::parts(huge), Some(((1 << 20) - 2, (1 << 24) - 1, (1 << 20) - 1)));
        assert_eq!(OverflowKey::parts(OverflowKey::NONE), None);
        assert_eq!(OverflowKey::parts(OverflowKey::UNLOCATED), None);
    }
}
