//! An overflow of the reduction itself: every rank's window is finite, their sum is not. Under
//! every sharding policy and wire dtype, every rank must report `found_inf`, skip the step and
//! back off alike, and clipping must never turn the infinite gradient into a finite one; a random
//! differential places values near the float maximum on several ranks and compares with an f64
//! reference of the sum.

mod common;

use std::sync::Arc;

use common::{to_bf16, Rng};
use gradacc::*;

/// How the ranks of a `shards` × `replicas` grid reduce.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Policy {
    /// An all-reduce over each shard group (`replicas` must be 1).
    AllReduce,
    ReduceScatter,
    Accumulate,
    /// A reduce-scatter over the shard group, then an all-reduce of the shard over the replicas.
    HybridReduceScatter,
    HybridAccumulate,
}

const POLICIES: [(Policy, usize, usize); 5] = [
    (Policy::AllReduce, 3, 1),
    (Policy::ReduceScatter, 3, 1),
    (Policy::Accumulate, 3, 1),
    (Policy::HybridReduceScatter, 2, 2),
    (Policy::HybridAccumulate, 2, 2),
];

/// What one rank saw at the boundary.
#[derive(Debug)]
struct Outcome {
    info: SyncInfo,
    skipped: bool,
    scale: f32,
    /// This rank's part of the reduced gradient: its element range and values.
    range: std::ops::Range<usize>,
    values: Vec<f32>,
}

/// Rank `g` of the grid adds `grads[g]` (one f32 value list per tensor, encoded in the tensor's
/// dtype) as one micro-batch at scale 1, syncs under `policy`, and updates its scaler.
fn boundary(
    policy: Policy,
    shards: usize,
    replicas: usize,
    config: AccumulatorConfig,
    tensors: &[TensorDesc],
    grads: &[Vec<Vec<f32>>],
) -> Vec<Outcome> {
    let shard_groups: Vec<Vec<Arc<dyn Communicator>>> = (0..replicas)
        .map(|_| {
            LocalComm::group(shards)
                .unwrap()
                .into_iter()
                .map(|c| Arc::new(c) as Arc<dyn Communicator>)
                .collect()
        })
        .collect();
    let replica_groups: Vec<Vec<LocalComm>> =
        (0..shards).map(|_| LocalComm::group(replicas).unwrap()).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..shards * replicas)
            .map(|g| {
                let (a, i) = (g / shards, g % shards);
                let (shard_comm, replica_comm) = (&shard_groups[a][i], &replica_groups[i][a]);
                s.spawn(move || {
                    let acc = match policy {
                        Policy::AllReduce => Accumulator::new(config, tensors).unwrap(),
                        Policy::ReduceScatter | Policy::HybridReduceScatter => {
                            let sharding = Sharding::ReduceScatter { shards, rank: i };
                            Accumulator::new(AccumulatorConfig { sharding, ..config }, tensors)
                                .unwrap()
                        }
                        Policy::Accumulate | Policy::HybridAccumulate => {
                            let sharding = Sharding::Accumulate { shards, rank: i };
                            Accumulator::builder(tensors)
                                .config(AccumulatorConfig { sharding, ..config })
                                .communicator(shard_comm.clone())
                                .build()
                                .unwrap()
                        }
                    };
                    let scaler = Scaler::new(ScalerConfig {
                        init_scale: 1.0,
                        min_scale: 2f32.powi(-20),
                        ..Default::default()
                    })
                    .unwrap();
                    let encoded: Vec<(Vec<f32>, Vec<u16>)> = tensors
                        .iter()
                        .zip(&grads[g])
                        .map(|(d, v)| match d.dtype {
                            Dtype::Bf16 => (vec![], v.iter().map(|&x| to_bf16(x)).collect()),
                            _ => (v.clone(), vec![]),
                        })
                        .collect();
                    let views: Vec<Grad<'_>> = tensors
                        .iter()
                        .zip(&encoded)
                        .map(|(d, (f, h))| common::grad_of(d.dtype, f, h))
                        .collect();
                    acc.add(&scaler, &views, 1).unwrap();
                    let info = match policy {
                        Policy::HybridReduceScatter | Policy::HybridAccumulate => {
                            acc.sync_hybrid(&**shard_comm, replica_comm).unwrap()
                        }
                        _ => acc.sync(Some(&**shard_comm)).unwrap(),
                    };
                    let skipped = scaler.update_from(&[&acc], true).unwrap().unwrap();
                    let (range, ptr) = acc.shard();
                    // SAFETY: the live accumulator's shard, unwritten until its next micro-batch.
                    let values = unsafe { std::slice::from_raw_parts(ptr, range.len()) }.to_vec();
                    Outcome { info, skipped, scale: scaler.scale().unwrap(), range, values }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Every rank reports the overflow, skips, and backs off to the same scale; no rank's part of the
/// gradient became finite; the norm says so too.
fn check_overflow_agreed(outcomes: &[Outcome], what: &str) {
    for (g, o) in outcomes.iter().enumerate() {
        assert!(o.info.found_inf, "{what}: rank {g} missed the overflow: {:?}", o.info);
        assert!(o.skipped, "{what}: rank {g} stepped on an overflowing gradient");
        assert_eq!(o.scale, 0.5, "{what}: rank {g} did not back off");
        assert!(
            !o.info.grad_norm.is_finite(),
            "{what}: rank {g}: a finite norm {} for an infinite gradient",
            o.info.grad_norm
        );
        assert_eq!(o.info.clip_coef, 1.0, "{what}: rank {g}: clipping an overflowing gradient");
    }
    let non_finite = outcomes.iter().flat_map(|o| &o.values).filter(|v| !v.is_finite()).count();
    assert!(non_finite > 0, "{what}: no rank holds the non-finite values");
}

/// The reproduction on every policy and wire dtype, with and without clipping and with
/// every normalisation: [3e38, 1, 1, 1] on every rank is finite on each and infinite in the sum.
#[test]
fn an_overflowing_sum_skips_on_every_rank_under_every_policy() {
    let tensors = [
        TensorDesc { numel: 4, dtype: Dtype::F32 },
        TensorDesc { numel: 5000, dtype: Dtype::Bf16 },
    ];
    for (policy, shards, replicas) in POLICIES {
        for wire in [Dtype::F32, Dtype::Bf16] {
            for (normalize, max_grad_norm) in
                [(Normalize::None, 0.0), (Normalize::ByCount, 1.0), (Normalize::ByWorld, 0.0)]
            {
                let config = AccumulatorConfig {
                    normalize,
                    loss_reduction: LossReduction::Sum,
                    max_grad_norm,
                    wire,
                    bucket_numel: 1000,
                    ..Default::default()
                };
                let grads: Vec<Vec<Vec<f32>>> = (0..shards * replicas)
                    .map(|_| vec![vec![3e38, 1.0, 1.0, 1.0], vec![0.25; 5000]])
                    .collect();
                let what = format!("{policy:?} {shards}x{replicas} wire {wire:?} {normalize:?} clip {max_grad_norm}");
                check_overflow_agreed(
                    &boundary(policy, shards, replicas, config, &tensors, &grads),
                    &what,
                );
            }
        }
    }
}

/// A NaN made by the reduction is found as well: in a hybrid boundary one shard group's sum
/// overflows to +inf, the other's to −inf, and the replicas add them. (A sum in rank order over
/// one group cannot make a NaN from finite values: it holds one infinity at most.)
#[test]
fn a_nan_made_by_the_reduction_skips_on_every_rank() {
    let tensors = [TensorDesc { numel: 3, dtype: Dtype::F32 }];
    for (policy, shards, replicas) in POLICIES.into_iter().filter(|p| p.2 > 1) {
        let config = AccumulatorConfig {
            normalize: Normalize::None,
            loss_reduction: LossReduction::Sum,
            max_grad_norm: 2.0,
            ..Default::default()
        };
        // Rank g is in shard group g / shards: the first group brings +3e38 twice, the second
        // −3e38.
        let grads: Vec<Vec<Vec<f32>>> = (0..shards * replicas)
            .map(|g| vec![vec![if g < shards { 3e38 } else { -3e38 }, 0.0, 1.0]])
            .collect();
        let outcomes = boundary(policy, shards, replicas, config, &tensors, &grads);
        check_overflow_agreed(&outcomes, &format!("{policy:?} NaN"));
        assert!(
            outcomes.iter().flat_map(|o| &o.values).any(|v| v.is_nan()),
            "{policy:?}: the sum holds a NaN"
        );
    }
}

/// Random windows with values near the float maximum on several ranks: the ranks agree on
/// `found_inf`, which is set exactly when the reduced gradient holds a non-finite value; against
/// an f64 reference of the sum, an element whose exact sum is beyond the float maximum always
/// sets it, and a window whose every partial sum stays well inside the range never does.
#[test]
fn random_sums_near_the_float_maximum_match_the_f64_reference() {
    let mut rng = Rng::fresh("random_sums_near_the_float_maximum_match_the_f64_reference");
    let max = f32::MAX as f64;
    let (mut overflowed, mut finite) = (0, 0);
    for round in 0..40 {
        let (policy, shards, replicas) = POLICIES[round % POLICIES.len()];
        let world = shards * replicas;
        let numel = rng.range(1, 9000) as usize;
        let dtype = if rng.range(0, 1) == 0 { Dtype::F32 } else { Dtype::Bf16 };
        let tensors = [TensorDesc { numel, dtype }];
        let wire = if rng.range(0, 1) == 0 { Dtype::F32 } else { Dtype::Bf16 };
        let config = AccumulatorConfig {
            normalize: Normalize::None,
            loss_reduction: LossReduction::Sum,
            max_grad_norm: if rng.range(0, 1) == 0 { 1.0 } else { 0.0 },
            wire,
            bucket_numel: rng.range(1, 10_000) as usize,
            ..Default::default()
        };
        // A few elements carry large values on several ranks; the rest are small.
        let hot: Vec<usize> =
            (0..rng.range(1, 3)).map(|_| rng.range(0, numel as u64 - 1) as usize).collect();
        let spread = rng.uniform(0.2, 0.7);
        let grads: Vec<Vec<Vec<f32>>> = (0..world)
            .map(|_| {
                let mut v: Vec<f32> = (0..numel).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
                for &h in &hot {
                    v[h] = (rng.uniform(spread * 0.8, spread) * max) as f32;
                }
                vec![v]
            })
            .collect();
        // The values the library adds (a bf16 gradient rounds once), then their f64 reference.
        let added = |g: usize, k: usize| match dtype {
            Dtype::Bf16 => common::from_bf16(to_bf16(grads[g][0][k])),
            _ => grads[g][0][k] as f64,
        };
        let exact_beyond =
            (0..numel).any(|k| (0..world).map(|g| added(g, k)).sum::<f64>() > max * 1.01);
        let well_inside =
            (0..numel).all(|k| (0..world).map(|g| added(g, k).abs()).sum::<f64>() < max * 0.99);
        let outcomes = boundary(policy, shards, replicas, config, &tensors, &grads);
        let what = format!("round {round}: {policy:?} {shards}x{replicas} {dtype:?} wire {wire:?} spread {spread:.3}");
        let found = outcomes[0].info.found_inf;
        for (g, o) in outcomes.iter().enumerate() {
            assert_eq!(o.info.found_inf, found, "{what}: rank {g} disagrees");
            assert_eq!(o.skipped, found, "{what}: rank {g}");
            assert_eq!(o.scale.to_bits(), outcomes[0].scale.to_bits(), "{what}: rank {g}'s scale");
        }
        // Every part of the reduced gradient, each element once (replicas hold the same parts).
        let mut parts: Vec<&Outcome> = outcomes.iter().collect();
        parts.sort_by_key(|o| o.range.start);
        parts.dedup_by_key(|o| o.range.clone());
        let non_finite = parts.iter().flat_map(|o| &o.values).any(|v| !v.is_finite());
        assert_eq!(
            found, non_finite,
            "{what}: found_inf {found}, a non-finite element {non_finite}"
        );
        assert_eq!(
            found,
            !outcomes[0].info.grad_norm.is_finite(),
            "{what}: the norm {}",
            outcomes[0].info.grad_norm
        );
        if exact_beyond {
            assert!(found, "{what}: an element's exact sum is beyond the float maximum");
        }
        if well_inside {
            assert!(!found, "{what}: every partial sum is inside the range");
        }
        if found {
            overflowed += 1;
        } else {
            finite += 1;
        }
    }
    assert!(
        overflowed >= 5 && finite >= 5,
        "the draws must reach both sides: {overflowed} overflowed, {finite} finite"
    );
}
