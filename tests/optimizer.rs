//! The optimizer step: AdamW and SGD against exact (f64) arithmetic one step at a time, skipped
//! steps that change nothing, every sharding policy writing the unsharded run's weights bit for
//! bit, every instruction-set path and thread count writing the same bits, saved state re-cut
//! onto other shard counts, and bad input refused with nothing changed.

mod common;

use std::sync::Arc;

use common::step_reference::{assert_within, bounds, check_element};
use common::weights::{add, fixed_scaler, grads_of, model, muts_of, rank_accumulator, Weights};
use common::*;
use gradacc::simd::{self, Isa};
use gradacc::{
    Accumulator, AccumulatorConfig, Algorithm, Communicator, Dtype, ErrorKind, Grad, GradMut,
    LocalComm, MasterFormat, MomentFormat, Optimizer, OptimizerConfig, Rounding, Sharding, Slot,
    StateFormat, TensorDesc, TensorGroup,
};

/// Odd sizes, every dtype, tensors that straddle shards.
fn layout(rng: &mut Rng) -> Vec<TensorDesc> {
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    (0..5)
        .map(|i| TensorDesc { numel: rng.range(1, 3000) as usize, dtype: dtypes[i % 3] })
        .collect()
}

/// A gradient of magnitudes in [1e-4, 4), random signs, each value one its tensor's dtype holds;
/// with `inf`, one element infinite.
fn gradient(rng: &mut Rng, tensors: &[TensorDesc], inf: bool) -> Vec<Vec<f32>> {
    let mut g: Vec<Vec<f32>> = tensors
        .iter()
        .map(|d| {
            (0..d.numel)
                .map(|_| {
                    let m = 10f64.powf(rng.uniform(-4.0, 0.6));
                    let v = (if rng.range(0, 1) == 1 { m } else { -m }) as f32;
                    decoded(d.dtype, v, 1.0) as f32
                })
                .collect()
        })
        .collect();
    if inf {
        let t = rng.range(0, tensors.len() as u64 - 1) as usize;
        let e = rng.range(0, tensors[t].numel as u64 - 1) as usize;
        g[t][e] = f32::INFINITY;
    }
    g
}

/// One tensor's state before or after a step.
#[derive(Clone, PartialEq)]
struct TensorState {
    w: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

fn state(opt: &Optimizer, i: usize, adam: bool) -> TensorState {
    let read = |slot| opt.read(i, slot).unwrap().1;
    TensorState {
        w: read(Slot::Weights),
        m: read(Slot::FirstMoment),
        v: if adam { read(Slot::SecondMoment) } else { vec![] },
    }
}

fn algorithms() -> Vec<Algorithm> {
    vec![
        Algorithm::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
        Algorithm::AdamW { beta1: 0.5, beta2: 0.9, eps: 1e-3, weight_decay: 0.3 },
        Algorithm::sgd(),
        Algorithm::Sgd { momentum: 0.9, dampening: 0.0, nesterov: true, weight_decay: 1e-2 },
        Algorithm::Sgd { momentum: 0.8, dampening: 0.3, nesterov: false, weight_decay: 0.0 },
    ]
}

/// 100 steps of each algorithm with learning rates that change every step, groups, every weight
/// dtype and skipped steps: every quantity of every element within its bound (`bounds`) of the
/// exact step, the model's weights the masters rounded to nearest even, and a skipped step
/// changing nothing at all.
#[test]
fn each_step_is_the_exact_step_within_the_bound() {
    let mut rng = Rng::fresh("each_step_is_the_exact_step_within_the_bound");
    for algorithm in algorithms() {
        let tensors = layout(&mut rng);
        let adam = matches!(algorithm, Algorithm::AdamW { .. });
        let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
        let scaler = fixed_scaler();
        let mut weights = model(&mut rng, &tensors);
        let groups: Vec<TensorGroup> = (0..tensors.len())
            .map(|_| TensorGroup {
                weight_decay: rng.range(0, 1) == 1,
                lr_scale: rng.uniform(0.1, 2.0) as f32,
            })
            .collect();
        let config = OptimizerConfig { algorithm, lr: 0.01, rounding: Rounding::NearestEven };
        let opt = Optimizer::new(&acc, config, &groups, &grads_of(&weights)).unwrap();
        let mut worst = [0.0f64; 3];
        for step in 0..100 {
            let skip = step % 9 == 4;
            let g = gradient(&mut rng, &tensors, skip);
            add(&acc, &scaler, &tensors, &g);
            let info = acc.sync(None).unwrap();
            assert_eq!(info.found_inf, skip);
            let lr = rng.uniform(1e-4, 0.05) as f32;
            opt.set_lr(lr).unwrap();
            let before: Vec<TensorState> =
                (0..tensors.len()).map(|i| state(&opt, i, adam)).collect();
            let (weights_before, steps_before) = (weights.clone(), opt.steps());
            let stepped = opt.step(&acc, &mut muts_of(&mut weights), None).unwrap();
            assert_eq!(stepped, !skip);
            let after: Vec<TensorState> =
                (0..tensors.len()).map(|i| state(&opt, i, adam)).collect();
            if skip {
                assert!(
                    before == after && weights == weights_before,
                    "a skipped step changed state"
                );
                assert_eq!(opt.steps(), steps_before);
                continue;
            }
            let t = opt.steps() as i32;
            for (i, gi) in g.iter().enumerate() {
                let lr_i = lr as f64 * groups[i].lr_scale as f64;
                for (e, &ge) in gi.iter().enumerate() {
                    let b = &before[i];
                    let a = &after[i];
                    let v = |s: &[f32]| s.get(e).map_or(0.0, |&x| x as f64);
                    let dist = check_element(
                        algorithm,
                        lr_i,
                        groups[i].weight_decay,
                        t,
                        ge as f64,
                        (b.w[e] as f64, v(&b.m), v(&b.v)),
                        (a.w[e], a.m[e], a.v.get(e).copied().unwrap_or(0.0)),
                    );
                    assert_within(algorithm, dist, &|| format!("step {t} tensor {i} element {e}"));
                    worst = std::array::from_fn(|q| worst[q].max(dist[q]));
                    assert_eq!(
                        weights[i].bits(e),
                        weights[i].nearest(a.w[e]),
                        "tensor {i} element {e}"
                    );
                }
            }
        }
        eprintln!("{algorithm:?}: worst {worst:.2?} roundings (bounds {:?})", bounds(algorithm));
    }
}

/// The smallest f32 from `x` up whose 1 - beta1 lies halfway between two f32 values: where
/// rounding it to f32 misstates it most (by 2^-25).
fn halfway_from(x: f32) -> f32 {
    let mut beta1 = x;
    loop {
        let w = 1.0 - beta1 as f64;
        if ((w as f32) as f64 - w).abs() == (0.5f64).powi(25) {
            return beta1;
        }
        beta1 = f32::from_bits(beta1.to_bits() + 1);
    }
}

/// AdamW's first moment at its bound's worst case: a gradient of 0 (the moment is beta1 m, its
/// only term) and, below 0.5, a beta1 whose 1 - beta1 rounds by half a unit, the most. Then the
/// lerp's first moment is 1 / (2 beta1) roundings off, within [`bounds`] and, for beta1 < 0.1,
/// past 8. Also a gradient far smaller than the moment, and the other quantities within 8.
#[test]
fn the_first_moment_meets_its_bound_at_its_worst() {
    let mut rng = Rng::fresh("the_first_moment_meets_its_bound_at_its_worst");
    let tensors = [TensorDesc { numel: 4096, dtype: Dtype::F32 }];
    for target in [0.9f32, 0.5, 0.3, 0.1, 0.05, 0.01] {
        let beta1 = if target < 0.5 { halfway_from(target) } else { target };
        let algorithm = Algorithm::AdamW { beta1, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
        let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
        let scaler = fixed_scaler();
        let mut weights = model(&mut rng, &tensors);
        let config = OptimizerConfig { algorithm, lr: 0.01, rounding: Rounding::NearestEven };
        let opt = Optimizer::new(&acc, config, &[], &grads_of(&weights)).unwrap();
        let mut worst = [0.0f64; 3];
        for step in 0..4 {
            let before = state(&opt, 0, true);
            let g: Vec<Vec<f32>> = match step {
                0 => gradient(&mut rng, &tensors, false),
                // Far smaller than the moment, then 0: the moment's own term dominates.
                1 => vec![before.m.iter().map(|m| m * rng.uniform(0.0, 1e-6) as f32).collect()],
                _ => vec![vec![0.0; tensors[0].numel]],
            };
            add(&acc, &scaler, &tensors, &g);
            acc.sync(None).unwrap();
            assert!(opt.step(&acc, &mut muts_of(&mut weights), None).unwrap());
            let after = state(&opt, 0, true);
            let t = opt.steps() as i32;
            for (e, &ge) in g[0].iter().enumerate() {
                let dist = check_element(
                    algorithm,
                    0.01f32 as f64,
                    true,
                    t,
                    ge as f64,
                    (before.w[e] as f64, before.m[e] as f64, before.v[e] as f64),
                    (after.w[e], after.m[e], after.v[e]),
                );
                assert_within(algorithm, dist, &|| format!("step {t} element {e}"));
                worst = std::array::from_fn(|q| worst[q].max(dist[q]));
            }
        }
        eprintln!("beta1 {beta1}: worst {worst:.2?} roundings (bounds {:?})", bounds(algorithm));
        if target < 0.1 {
            let reached = 0.5 / beta1 as f64 - 1.0;
            assert!(worst[1] > reached.max(8.0), "beta1 {beta1}: worst {} roundings", worst[1]);
        }
    }
}

/// What every rank of a group brings to each window: per rank, per step, a gradient.
fn group_data(
    rng: &mut Rng,
    tensors: &[TensorDesc],
    ranks: usize,
    steps: usize,
) -> Vec<Vec<Vec<Vec<f32>>>> {
    (0..ranks).map(|_| (0..steps).map(|s| gradient(rng, tensors, s == 2)).collect()).collect()
}

/// Runs `ranks` ranks under `sharding` (its rank filled in per rank) for the data's steps; each
/// rank adds one micro-batch per window, syncs and steps, on the calling thread's instruction
/// set, with `groups` (none: the defaults). Returns every rank's model weights after every step, and each rank's saved optimizer
/// state at the end.
fn run_group(
    tensors: &[TensorDesc],
    sharding: fn(usize, usize) -> Sharding,
    initial: &[Weights],
    data: &[Vec<Vec<Vec<f32>>>],
    config: OptimizerConfig,
    groups: &[TensorGroup],
) -> (Vec<Vec<Vec<Weights>>>, Vec<Vec<u8>>) {
    let plain = Boundary { max_grad_norm: 0.0, for_step: false, state: StateFormat::default() };
    let (weights, saved, _) =
        run_group_with(tensors, sharding, initial, data, config, groups, plain);
    (weights, saved)
}

/// How [`run_group_with`]'s boundaries run: the clipping norm, `sync_for_step` or `sync`, and
/// the optimizer's state formats.
#[derive(Clone, Copy, Debug)]
struct Boundary {
    max_grad_norm: f32,
    for_step: bool,
    state: StateFormat,
}

/// [`run_group`] with `boundary`; also returns each rank's reduced gradient (`with_shard`'s
/// bits) of every window, read after the step on even steps and before it on odd ones.
#[allow(clippy::type_complexity)]
fn run_group_with(
    tensors: &[TensorDesc],
    sharding: fn(usize, usize) -> Sharding,
    initial: &[Weights],
    data: &[Vec<Vec<Vec<f32>>>],
    config: OptimizerConfig,
    groups: &[TensorGroup],
    boundary: Boundary,
) -> (Vec<Vec<Vec<Weights>>>, Vec<Vec<u8>>, Vec<Vec<Vec<u32>>>) {
    let ranks = data.len();
    let comms = LocalComm::group(ranks).unwrap();
    let isa = simd::active_isa();
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                scope.spawn(move || {
                    simd::with_isa(isa, || {
                        let comm: Arc<dyn Communicator> = Arc::new(comm);
                        let cfg = AccumulatorConfig {
                            sharding: sharding(ranks, rank),
                            max_grad_norm: boundary.max_grad_norm,
                            ..Default::default()
                        };
                        let (acc, on) = rank_accumulator(tensors, cfg, &comm);
                        let scaler = fixed_scaler();
                        let mut weights = initial.to_vec();
                        let opt = Optimizer::builder(&acc)
                            .config(config)
                            .groups(groups)
                            .state(boundary.state)
                            .weights(&grads_of(&weights))
                            .build()
                            .unwrap();
                        let (mut seen, mut reduced) = (Vec::new(), Vec::new());
                        let read = || acc.with_shard(|g| g.iter().map(|x| x.to_bits()).collect());
                        for (step, g) in data[rank].iter().enumerate() {
                            add(&acc, &scaler, tensors, g);
                            match boundary.for_step {
                                true => acc.sync_for_step(on).unwrap(),
                                false => acc.sync(on).unwrap(),
                            };
                            if step % 2 == 1 {
                                reduced.push(read().unwrap());
                            }
                            opt.step(&acc, &mut muts_of(&mut weights), on).unwrap();
                            if step % 2 == 0 {
                                reduced.push(read().unwrap());
                            }
                            seen.push(weights.clone());
                        }
                        (seen, opt.save().unwrap(), reduced)
                    })
                })
            })
            .collect();
        let mut out = (Vec::new(), Vec::new(), Vec::new());
        for h in handles {
            let (seen, saved, reduced) = h.join().unwrap();
            out.0.push(seen);
            out.1.push(saved);
            out.2.push(reduced);
        }
        out
    })
}

/// The clipping coefficient applied inside the step (`sync_for_step`) steps every sharding
/// policy, algorithm and state format to the bits of clip-then-step (`sync`): the weights after
/// every step, the saved state, and the reduced gradient read before or after the step. The
/// norms clip every window (a tiny one) or only some (one near the gradients' own).
#[test]
fn the_clip_inside_the_step_is_clip_then_step() {
    let mut rng = Rng::fresh("the_clip_inside_the_step_is_clip_then_step");
    let policies: [fn(usize, usize) -> Sharding; 3] = [
        |_, _| Sharding::None,
        |shards, rank| Sharding::ReduceScatter { shards, rank },
        |shards, rank| Sharding::Accumulate { shards, rank },
    ];
    let moments = MomentFormat::Bf16 { seed: rng.next_u64() };
    let int8 = MomentFormat::Int8Blockwise;
    let formats = [
        StateFormat::default(),
        StateFormat { moments, ..Default::default() },
        StateFormat { moments: int8, ..Default::default() },
        StateFormat { moments, masters: MasterFormat::Bf16Remainder },
        StateFormat { moments: int8, masters: MasterFormat::Bf16Remainder },
    ];
    // The last round has bf16 weights only, which remainder masters take.
    for (round, ranks) in [1, 2, 3, 2].into_iter().enumerate() {
        let remainders = round == 3;
        let mut tensors = layout(&mut rng);
        if remainders {
            tensors.iter_mut().for_each(|t| t.dtype = Dtype::Bf16);
        }
        let initial = model(&mut rng, &tensors);
        let data = group_data(&mut rng, &tensors, ranks, 4);
        for (a, algorithm) in algorithms().into_iter().enumerate() {
            let policy = policies[a % 3];
            let state = if remainders { formats[3 + a % 2] } else { formats[a % 3] };
            let max_grad_norm = [1e-3, 30.0][(a / 2) % 2];
            let config = OptimizerConfig { algorithm, lr: 0.01, rounding: Rounding::NearestEven };
            let run = |for_step| {
                let b = Boundary { max_grad_norm, for_step, state };
                run_group_with(&tensors, policy, &initial, &data, config, &[], b)
            };
            let (want, got) = (run(false), run(true));
            let what = format!("{:?}, {ranks} ranks, {algorithm:?}, {state:?}", policy(ranks, 0));
            for rank in 0..ranks {
                for (step, (w, g)) in want.0[rank].iter().zip(&got.0[rank]).enumerate() {
                    assert!(bits_of(w) == bits_of(g), "{what}: rank {rank}'s weights, step {step}");
                }
                assert!(want.2[rank] == got.2[rank], "{what}: rank {rank}'s reduced gradient");
            }
            assert!(want.1 == got.1, "{what}: the saved state");
        }
    }
}

/// ZeRO-1 (reduce-scatter) and ZeRO-2 (sharded accumulation): after every step every rank's
/// model weights are bitwise the unsharded group's, with both roundings.
#[test]
fn sharded_steps_write_the_unsharded_weights() {
    let mut rng = Rng::fresh("sharded_steps_write_the_unsharded_weights");
    for ranks in [2, 3] {
        let tensors = layout(&mut rng);
        let initial = model(&mut rng, &tensors);
        let data = group_data(&mut rng, &tensors, ranks, 5);
        for rounding in [Rounding::NearestEven, Rounding::Stochastic { seed: rng.next_u64() }] {
            let config = OptimizerConfig { algorithm: Algorithm::adamw(), lr: 0.01, rounding };
            let (unsharded, _) =
                run_group(&tensors, |_, _| Sharding::None, &initial, &data, config, &[]);
            for r in &unsharded {
                assert!(r == &unsharded[0], "unsharded ranks differ");
            }
            let policies: [fn(usize, usize) -> Sharding; 2] = [
                |shards, rank| Sharding::ReduceScatter { shards, rank },
                |shards, rank| Sharding::Accumulate { shards, rank },
            ];
            for policy in policies {
                let (sharded, _) = run_group(&tensors, policy, &initial, &data, config, &[]);
                for (rank, r) in sharded.iter().enumerate() {
                    for (step, w) in r.iter().enumerate() {
                        assert!(
                            w == &unsharded[0][step],
                            "{:?}, {ranks} ranks, {rounding:?}: rank {rank} differs at step {step}",
                            policy(ranks, rank)
                        );
                    }
                }
            }
        }
    }
}

/// The hybrid boundary likewise: `sync_hybrid_for_step` then the step (all-gathered over the
/// shard group) writes `sync_hybrid`'s weights and reads its reduced gradient, on every rank of
/// a grid of shards by replicas.
#[test]
fn the_clip_inside_the_step_is_clip_then_step_across_replicas() {
    let mut rng = Rng::fresh("the_clip_inside_the_step_is_clip_then_step_across_replicas");
    for (shards, replicas) in [(2, 2), (3, 2), (2, 3)] {
        let tensors = layout(&mut rng);
        let initial = model(&mut rng, &tensors);
        let data = group_data(&mut rng, &tensors, shards * replicas, 3);
        let algorithm = algorithms()[rng.range(0, 4) as usize];
        let config = OptimizerConfig { algorithm, lr: 0.01, rounding: Rounding::NearestEven };
        let run = |for_step: bool| {
            hybrid_grid(shards, replicas, |g, sc, rc| {
                let sharding = Sharding::ReduceScatter { shards, rank: sc.rank() };
                let cfg = AccumulatorConfig { sharding, max_grad_norm: 1e-2, ..Default::default() };
                let acc = Accumulator::new(cfg, &tensors).unwrap();
                let mut weights = initial.to_vec();
                let opt = Optimizer::new(&acc, config, &[], &grads_of(&weights)).unwrap();
                let mut seen = Vec::new();
                for grads in &data[g] {
                    add(&acc, &fixed_scaler(), &tensors, grads);
                    match for_step {
                        true => acc.sync_hybrid_for_step(sc, rc).unwrap(),
                        false => acc.sync_hybrid(sc, rc).unwrap(),
                    };
                    opt.step(&acc, &mut muts_of(&mut weights), Some(sc)).unwrap();
                    let reduced: Vec<u32> =
                        acc.with_shard(|s| s.iter().map(|x| x.to_bits()).collect()).unwrap();
                    seen.push((bits_of(&weights), reduced));
                }
                seen
            })
        };
        assert!(run(false) == run(true), "{shards} shards x {replicas} replicas, {algorithm:?}");
    }
}

/// The model weights' bits: f32 compared by their bits, not as numbers.
fn bits_of(w: &[Weights]) -> Vec<Vec<u32>> {
    w.iter()
        .map(|t| match t {
            Weights::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            Weights::Half(_, v) => v.iter().map(|&x| x as u32).collect(),
        })
        .collect()
}

/// Every instruction-set path steps the same state to the same bits: both algorithms (with and
/// without decay, each branch of the lerp), every weight dtype, both roundings, odd lengths up to
/// thousands, every remainder modulo 32 in every dtype, and, under three shards, pieces that start
/// inside a tensor, so that the weights written and the random draws start at odd offsets.
#[test]
fn every_isa_steps_the_same_bits() {
    let mut rng = Rng::fresh("every_isa_steps_the_same_bits");
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    let odd = 2 * rng.range(1000, 3000) as usize + 1;
    let long = [1, 17, 63, 131, 1027, 4099, 5003, 2049, odd].into_iter().enumerate();
    let tensors: Vec<TensorDesc> = long
        .map(|(i, numel)| TensorDesc { numel, dtype: dtypes[i % 3] })
        .chain((33..=64).flat_map(|numel| dtypes.map(|dtype| TensorDesc { numel, dtype })))
        .collect();
    let isas = simd::supported_isas();
    eprintln!("paths: {isas:?}");
    for algorithm in algorithms() {
        let initial = model(&mut rng, &tensors);
        let groups: Vec<TensorGroup> = (0..tensors.len())
            .map(|i| TensorGroup {
                weight_decay: i % 2 == 0,
                lr_scale: rng.uniform(0.5, 2.0) as f32,
            })
            .collect();
        for ranks in [1, 3] {
            let data = group_data(&mut rng, &tensors, ranks, 4);
            for rounding in [Rounding::NearestEven, Rounding::Stochastic { seed: rng.next_u64() }] {
                let config = OptimizerConfig { algorithm, lr: 0.01, rounding };
                let run = |isa| {
                    let sharding = |shards, rank| match shards {
                        1 => Sharding::None,
                        _ => Sharding::ReduceScatter { shards, rank },
                    };
                    let (weights, saved) = simd::with_isa(isa, || {
                        run_group(&tensors, sharding, &initial, &data, config, &groups)
                    });
                    let weights: Vec<Vec<Vec<Vec<u32>>>> = weights
                        .iter()
                        .map(|rank| rank.iter().map(|step| bits_of(step)).collect())
                        .collect();
                    (weights, saved)
                };
                let scalar = run(Isa::Scalar);
                for &isa in &isas[1..] {
                    assert!(
                        run(isa) == scalar,
                        "{} against scalar: {algorithm:?}, {ranks} ranks, {rounding:?}",
                        isa.name()
                    );
                }
            }
        }
    }
}

/// Stochastic rounding draws per element and step: the same weights from a rerun, other weights
/// from another seed, and on average the master (the test of the rule itself is in the crate).
#[test]
fn stochastic_rounding_is_reproducible_and_keyed_by_the_seed() {
    let mut rng = Rng::fresh("stochastic_rounding_is_reproducible_and_keyed_by_the_seed");
    let tensors = [TensorDesc { numel: 4099, dtype: Dtype::Bf16 }];
    let initial = model(&mut rng, &tensors);
    let data = group_data(&mut rng, &tensors, 1, 3);
    let run = |seed| {
        let config = OptimizerConfig {
            algorithm: Algorithm::sgd(),
            lr: 1e-3,
            rounding: Rounding::Stochastic { seed },
        };
        run_group(&tensors, |_, _| Sharding::None, &initial, &data, config, &[]).0
    };
    let seed = rng.next_u64();
    assert!(run(seed) == run(seed));
    assert!(run(seed) != run(seed ^ 1));
}

/// State saved by 2 shards loads onto 3 shards and onto one: every element's master and moments
/// where the new cut puts them, bit for bit, with the step count and learning rate.
#[test]
fn saved_state_recuts_onto_other_shard_counts() {
    let mut rng = Rng::fresh("saved_state_recuts_onto_other_shard_counts");
    let tensors = layout(&mut rng);
    let initial = model(&mut rng, &tensors);
    let data = group_data(&mut rng, &tensors, 2, 4);
    let config = OptimizerConfig::default();
    let (_, saved) = run_group(
        &tensors,
        |shards, rank| Sharding::ReduceScatter { shards, rank },
        &initial,
        &data,
        config,
        &[],
    );
    let parts: Vec<&[u8]> = saved.iter().map(Vec::as_slice).collect();
    let whole = {
        let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
        let opt = Optimizer::new(&acc, config, &[], &grads_of(&initial)).unwrap();
        opt.load(&parts).unwrap();
        assert_eq!(opt.steps(), 3, "one of the 4 steps was skipped");
        (0..tensors.len()).map(|i| state(&opt, i, true)).collect::<Vec<_>>()
    };
    for rank in 0..3 {
        let cfg = AccumulatorConfig {
            sharding: Sharding::ReduceScatter { shards: 3, rank },
            ..Default::default()
        };
        let acc = Accumulator::new(cfg, &tensors).unwrap();
        let opt = Optimizer::new(&acc, config, &[], &grads_of(&initial)).unwrap();
        opt.load(&parts).unwrap();
        assert_eq!(opt.steps(), 3);
        for (i, w) in whole.iter().enumerate() {
            let (r, master) = opt.read(i, Slot::Weights).unwrap();
            let (_, m) = opt.read(i, Slot::FirstMoment).unwrap();
            let (_, v) = opt.read(i, Slot::SecondMoment).unwrap();
            let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&master), bits(&w.w[r.clone()]), "rank {rank} tensor {i}");
            assert_eq!(bits(&m), bits(&w.m[r.clone()]));
            assert_eq!(bits(&v), bits(&w.v[r.clone()]));
        }
        // Parts that leave this rank's elements uncovered are refused: rank 0's are all in the
        // first of the two parts.
        if rank == 0 {
            let e = opt.load(&parts[1..]).unwrap_err();
            assert!(
                e.kind == ErrorKind::CorruptState && e.message.contains("no part holds"),
                "{e:?}"
            );
        }
    }
}

/// Parts that hold an element twice are refused with `InvalidArgument`, changing nothing: the
/// same part given twice (named so), and the parts of two saves. The parts of ranks whose
/// shards are empty hold nothing, so their identical bytes still load.
#[test]
fn a_part_given_twice_is_refused() {
    let mut rng = Rng::fresh("a_part_given_twice_is_refused");
    let tensors = layout(&mut rng);
    let initial = model(&mut rng, &tensors);
    let config = OptimizerConfig::default();
    let scatter = |shards, rank| Sharding::ReduceScatter { shards, rank };
    let (_, halves) =
        run_group(&tensors, scatter, &initial, &group_data(&mut rng, &tensors, 2, 2), config, &[]);
    let (_, whole) = run_group(
        &tensors,
        |_, _| Sharding::None,
        &initial,
        &group_data(&mut rng, &tensors, 1, 2),
        config,
        &[],
    );
    let (h0, h1, w) = (&halves[0][..], &halves[1][..], &whole[0][..]);

    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let opt = Optimizer::new(&acc, config, &[], &grads_of(&initial)).unwrap();
    let before = opt.save().unwrap();
    let refused: [(&[&[u8]], &str); 4] = [
        (&[h0, h1, h0], "part 2 is part 0 given twice"),
        (&[h1, h0, h0], "part 2 is part 1 given twice"),
        (&[w, w], "part 1 is part 0 given twice"),
        (&[h0, h1, w], "parts 0 and 2 both hold elements"),
    ];
    for (parts, message) in refused {
        let e = opt.load(parts).unwrap_err();
        assert!(
            e.kind == ErrorKind::InvalidArgument && e.message.contains(message),
            "{message}: {e:?}"
        );
        assert_eq!(opt.save().unwrap(), before, "{message}: the refused load changed the state");
        assert_eq!(opt.steps(), 0);
    }
    opt.load(&[h1, h0]).unwrap();
    assert_eq!(opt.steps(), 2);

    // One element over 3 ranks: ranks 1 and 2 hold nothing, and save the same bytes.
    let tiny = [TensorDesc { numel: 1, dtype: Dtype::F32 }];
    let one = model(&mut rng, &tiny);
    let (_, thirds) =
        run_group(&tiny, scatter, &one, &group_data(&mut rng, &tiny, 3, 1), config, &[]);
    assert_eq!(thirds[1], thirds[2], "empty shards save the same bytes");
    let acc = Accumulator::new(AccumulatorConfig::default(), &tiny).unwrap();
    let opt = Optimizer::new(&acc, config, &[], &grads_of(&one)).unwrap();
    opt.load(&thirds.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
    assert_eq!(opt.steps(), 1);
}

/// Bad input: each refused with the status and a message naming the argument, and the optimizer,
/// accumulator and weights unchanged.
#[test]
fn bad_input_changes_nothing() {
    let mut rng = Rng::fresh("bad_input_changes_nothing");
    let tensors = layout(&mut rng);
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let other = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let scaler = fixed_scaler();
    let mut weights = model(&mut rng, &tensors);
    let config = OptimizerConfig::default();

    let bad_configs = [
        (Algorithm::AdamW { beta1: f32::NAN, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }, "beta1"),
        (Algorithm::AdamW { beta1: 0.9, beta2: 1.0, eps: 1e-8, weight_decay: 0.0 }, "beta2"),
        (Algorithm::AdamW { beta1: 0.9, beta2: 0.999, eps: 0.0, weight_decay: 0.0 }, "eps"),
        (
            Algorithm::Sgd { momentum: -1.0, dampening: 0.0, nesterov: false, weight_decay: 0.0 },
            "momentum",
        ),
        (
            Algorithm::Sgd { momentum: 0.9, dampening: 0.0, nesterov: false, weight_decay: -1.0 },
            "weight_decay",
        ),
        (
            Algorithm::Sgd { momentum: 0.0, dampening: 0.0, nesterov: true, weight_decay: 0.0 },
            "Nesterov",
        ),
    ];
    for (algorithm, name) in bad_configs {
        let e =
            Optimizer::new(&acc, OptimizerConfig { algorithm, ..config }, &[], &grads_of(&weights))
                .unwrap_err();
        assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains(name), "{e:?}");
    }
    let e = Optimizer::new(&acc, OptimizerConfig { lr: -1.0, ..config }, &[], &grads_of(&weights))
        .unwrap_err();
    assert!(e.message.contains("`lr`"), "{e:?}");
    let short = Weights::F32(vec![0.0; tensors[0].numel + 1]);
    let mut bad = grads_of(&weights);
    bad[0] = short.grad();
    let e = Optimizer::new(&acc, config, &[], &bad).unwrap_err();
    assert!(e.kind == ErrorKind::SizeMismatch && e.message.contains("`weights[0]`"), "{e:?}");

    let opt = Optimizer::new(&acc, config, &[], &grads_of(&weights)).unwrap();
    let unchanged = |opt: &Optimizer, weights: &[Weights], saved: &[u8], kept: &[Weights]| {
        assert_eq!(opt.save().unwrap(), saved);
        assert!(weights == kept);
    };
    let (saved, kept) = (opt.save().unwrap(), weights.clone());

    let e = opt.step(&acc, &mut muts_of(&mut weights), None).unwrap_err();
    assert!(e.kind == ErrorKind::WrongState && e.message.contains("sync"), "{e:?}");
    unchanged(&opt, &weights, &saved, &kept);

    add(&acc, &scaler, &tensors, &gradient(&mut rng, &tensors, false));
    acc.sync(None).unwrap();
    add(&other, &scaler, &tensors, &gradient(&mut rng, &tensors, false));
    other.sync(None).unwrap();
    let e = opt.step(&other, &mut muts_of(&mut weights), None).unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("`acc`"), "{e:?}");
    let e = opt.step(&acc, &mut muts_of(&mut weights)[1..], None).unwrap_err();
    assert!(e.kind == ErrorKind::SizeMismatch && e.message.contains("`weights`"), "{e:?}");
    let mut wrong_dtype = weights.clone();
    wrong_dtype[1] = Weights::F32(vec![0.0; tensors[1].numel]);
    let e = opt.step(&acc, &mut muts_of(&mut wrong_dtype), None).unwrap_err();
    assert!(e.kind == ErrorKind::DtypeMismatch && e.message.contains("`weights[1]`"), "{e:?}");
    let e = opt.set_lr(f32::NAN).unwrap_err();
    assert!(e.message.contains("`lr`"), "{e:?}");
    let e = opt.lr_device_ptr().unwrap_err();
    assert!(e.kind == ErrorKind::DeviceMismatch && e.message.contains("set_lr"), "{e:?}");
    unchanged(&opt, &weights, &saved, &kept);

    assert!(opt.step(&acc, &mut muts_of(&mut weights), None).unwrap());
    let (saved, kept) = (opt.save().unwrap(), weights.clone());
    let e = opt.step(&acc, &mut muts_of(&mut weights), None).unwrap_err();
    assert!(e.kind == ErrorKind::WrongState && e.message.contains("already stepped"), "{e:?}");
    unchanged(&opt, &weights, &saved, &kept);

    // Saved state: every flipped byte, a truncation and an optimizer of another algorithm.
    for at in (0..saved.len()).step_by(saved.len() / 40 + 1) {
        let mut forged = saved.clone();
        forged[at] ^= 0x10;
        let e = opt.load(&[&forged]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::CorruptState, "byte {at}: {e:?}");
    }
    let e = opt.load(&[&saved[..saved.len() - 3]]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::CorruptState);
    let sgd = Optimizer::new(
        &acc,
        OptimizerConfig { algorithm: Algorithm::sgd(), ..config },
        &[],
        &grads_of(&kept),
    )
    .unwrap();
    let e = opt.load(&[&sgd.save().unwrap()]).unwrap_err();
    assert!(e.kind == ErrorKind::CorruptState && e.message.contains("algorithm"), "{e:?}");
    unchanged(&opt, &weights, &saved, &kept);
}

/// Under a sharded boundary a step refused on one rank fails on every rank (no rank waits in the
/// all-gather, none steps), and the next, valid, step succeeds on all.
#[test]
fn a_step_refused_on_one_rank_fails_on_every_rank() {
    let mut rng = Rng::fresh("a_step_refused_on_one_rank_fails_on_every_rank");
    let tensors = layout(&mut rng);
    let initial = model(&mut rng, &tensors);
    let data = group_data(&mut rng, &tensors, 2, 1);
    let comms = LocalComm::group(2).unwrap();
    for c in &comms {
        // Without the agreement a rank would wait in the all-gather: fail, not hang.
        c.set_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
    }
    std::thread::scope(|scope| {
        for (rank, comm) in comms.into_iter().enumerate() {
            let (tensors, initial, g) = (&tensors, &initial, &data[rank][0]);
            scope.spawn(move || {
                let sharding = Sharding::ReduceScatter { shards: 2, rank };
                let acc =
                    Accumulator::new(AccumulatorConfig { sharding, ..Default::default() }, tensors)
                        .unwrap();
                let mut weights = initial.clone();
                let opt =
                    Optimizer::new(&acc, OptimizerConfig::default(), &[], &grads_of(&weights))
                        .unwrap();
                add(&acc, &fixed_scaler(), tensors, g);
                acc.sync(Some(&comm)).unwrap();
                let saved = opt.save().unwrap();
                let e = if rank == 1 {
                    opt.step(&acc, &mut muts_of(&mut weights)[1..], Some(&comm)).unwrap_err()
                } else {
                    opt.step(&acc, &mut muts_of(&mut weights), Some(&comm)).unwrap_err()
                };
                let expected =
                    if rank == 1 { ErrorKind::SizeMismatch } else { ErrorKind::PeerFailure };
                assert_eq!(e.kind, expected, "rank {rank}: {e:?}");
                assert!(opt.save().unwrap() == saved && weights == *initial, "rank {rank} changed");
                assert!(opt.step(&acc, &mut muts_of(&mut weights), Some(&comm)).unwrap());
                assert!(weights != *initial);
            });
        }
    });
}

/// Under a sharded boundary, ranks whose optimizers differ (a rounding, a hyperparameter, a
/// tensor's weight dtype or group) fail together before anything is stepped or gathered: they
/// would otherwise step their shards by different rules, or all-gather pieces of different sizes.
#[test]
fn ranks_whose_optimizers_differ_fail_together() {
    let mut rng = Rng::fresh("ranks_whose_optimizers_differ_fail_together");
    let tensors = layout(&mut rng);
    let initial = model(&mut rng, &tensors);
    let data = group_data(&mut rng, &tensors, 2, 1);
    let base = OptimizerConfig::default();
    let variants: Vec<(&str, OptimizerConfig, Vec<TensorGroup>, Option<usize>)> = vec![
        (
            "rounding",
            OptimizerConfig { rounding: Rounding::Stochastic { seed: 3 }, ..base },
            vec![],
            None,
        ),
        ("algorithm", OptimizerConfig { algorithm: algorithms()[1], ..base }, vec![], None),
        (
            "group",
            base,
            (0..tensors.len())
                .map(|i| TensorGroup { weight_decay: i != 2, ..TensorGroup::default() })
                .collect(),
            None,
        ),
        ("weight dtype", base, vec![], Some(1)),
    ];
    for (what, config, groups, f32_weight) in variants {
        let comms = LocalComm::group(2).unwrap();
        std::thread::scope(|scope| {
            for (rank, comm) in comms.into_iter().enumerate() {
                let (tensors, initial, g) = (&tensors, &initial, &data[rank][0]);
                let (groups, config) = (groups.clone(), config);
                scope.spawn(move || {
                    let sharding = Sharding::ReduceScatter { shards: 2, rank };
                    let config_acc = AccumulatorConfig { sharding, ..Default::default() };
                    let acc = Accumulator::new(config_acc, tensors).unwrap();
                    let mut weights = initial.clone();
                    // Rank 1 differs: another config or groups, or one tensor's weights in f32.
                    let (config, groups) =
                        if rank == 1 { (config, groups) } else { (base, vec![]) };
                    if let (1, Some(t)) = (rank, f32_weight) {
                        weights[t] = Weights::F32(vec![0.5; tensors[t].numel]);
                    }
                    let opt = Optimizer::new(&acc, config, &groups, &grads_of(&weights)).unwrap();
                    add(&acc, &fixed_scaler(), tensors, g);
                    acc.sync(Some(&comm)).unwrap();
                    let (saved, kept) = (opt.save().unwrap(), weights.clone());
                    let e = opt.step(&acc, &mut muts_of(&mut weights), Some(&comm)).unwrap_err();
                    assert!(
                        e.kind == ErrorKind::SizeMismatch
                            && e.message.contains("optimizers differ"),
                        "{what}, rank {rank}: {e:?}"
                    );
                    assert!(
                        opt.save().unwrap() == saved && weights == kept,
                        "{what}: rank {rank} changed"
                    );
                });
            }
        });
    }
}

/// Ranks whose learning rates (set after creation) or step counts differ fail their sharded step
/// together and change nothing, under reduce-scatter and sharded accumulation: their shards would
/// otherwise be stepped by different rates and all-gathered into one model.
#[test]
fn ranks_whose_schedules_differ_fail_together() {
    let mut rng = Rng::fresh("ranks_whose_schedules_differ_fail_together");
    let tensors = layout(&mut rng);
    let initial = model(&mut rng, &tensors);
    let data = group_data(&mut rng, &tensors, 2, 2);
    let shardings: [fn(usize, usize) -> Sharding; 2] = [
        |shards, rank| Sharding::ReduceScatter { shards, rank },
        |shards, rank| Sharding::Accumulate { shards, rank },
    ];
    for (sharding, what) in shardings.into_iter().flat_map(|s| [(s, "learning rate"), (s, "steps")])
    {
        let comms = LocalComm::group(2).unwrap();
        std::thread::scope(|scope| {
            for (rank, comm) in comms.into_iter().enumerate() {
                let (tensors, initial, data) = (&tensors, &initial, &data[rank]);
                scope.spawn(move || {
                    let comm: Arc<dyn Communicator> = Arc::new(comm);
                    let cfg =
                        AccumulatorConfig { sharding: sharding(2, rank), ..Default::default() };
                    let (acc, on) = rank_accumulator(tensors, cfg, &comm);
                    let mut weights = initial.clone();
                    let opt =
                        Optimizer::new(&acc, OptimizerConfig::default(), &[], &grads_of(&weights))
                            .unwrap();
                    let before_first = opt.save().unwrap();
                    // A first step together; then rank 1 either sets another learning rate or
                    // goes back to its state before that step (one step fewer).
                    add(&acc, &fixed_scaler(), tensors, &data[0]);
                    acc.sync(on).unwrap();
                    assert!(opt.step(&acc, &mut muts_of(&mut weights), on).unwrap());
                    if rank == 1 {
                        match what {
                            "learning rate" => opt.set_lr(opt.lr() * 0.5).unwrap(),
                            _ => opt.load(&[&before_first[..]]).unwrap(),
                        }
                    }
                    add(&acc, &fixed_scaler(), tensors, &data[1]);
                    acc.sync(on).unwrap();
                    let (saved, kept) = (opt.save().unwrap(), weights.clone());
                    let e = opt.step(&acc, &mut muts_of(&mut weights), on).unwrap_err();
                    assert!(
                        e.kind == ErrorKind::SizeMismatch
                            && e.message.contains("optimizers differ"),
                        "{what}, rank {rank}: {e:?}"
                    );
                    assert!(
                        opt.save().unwrap() == saved && weights == kept,
                        "{what}: rank {rank} changed"
                    );
                });
            }
        });
    }
}

/// The step over several threads, on every instruction-set path, gives the scalar one-thread
/// bits (each element's arithmetic and random draw are its own); the threads' parts start at odd
/// elements of the state.
#[test]
fn threads_and_paths_do_not_change_the_bits() {
    let mut rng = Rng::fresh("threads_and_paths_do_not_change_the_bits");
    let tensors = [
        TensorDesc { numel: 1_300_001, dtype: Dtype::Bf16 },
        TensorDesc { numel: 700_003, dtype: Dtype::F16 },
    ];
    let initial = model(&mut rng, &tensors);
    let g = gradient(&mut rng, &tensors, false);
    let run = |isa, threads, algorithm| {
        let acc = Accumulator::new(AccumulatorConfig { threads, ..Default::default() }, &tensors)
            .unwrap();
        let rounding = Rounding::Stochastic { seed: 99 };
        let config = OptimizerConfig { algorithm, lr: 1e-3, rounding };
        let mut weights = initial.clone();
        let opt = Optimizer::new(&acc, config, &[], &grads_of(&weights)).unwrap();
        simd::with_isa(isa, || {
            for _ in 0..2 {
                add(&acc, &fixed_scaler(), &tensors, &g);
                acc.sync(None).unwrap();
                assert!(opt.step(&acc, &mut muts_of(&mut weights), None).unwrap());
            }
        });
        (weights, opt.save().unwrap())
    };
    for algorithm in [Algorithm::adamw(), algorithms()[3]] {
        let one = run(Isa::Scalar, 1, algorithm);
        for isa in simd::supported_isas() {
            for threads in [1, 2, 3] {
                assert!(
                    run(isa, threads, algorithm) == one,
                    "{}, {threads} threads, {algorithm:?}",
                    isa.name()
                );
            }
        }
    }
}

/// A saved state rewritten with a fresh checksum (the checksum catches damage, not a forger):
/// a step count that cannot advance, and an array whose length disagrees with its range, are
/// refused as corrupt, and the optimizer is unchanged.
#[test]
fn a_forged_state_is_refused_as_corrupt() {
    let mut rng = Rng::fresh("a_forged_state_is_refused_as_corrupt");
    let tensors = layout(&mut rng);
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let scaler = fixed_scaler();
    let mut weights = model(&mut rng, &tensors);
    let opt = Optimizer::new(&acc, OptimizerConfig::default(), &[], &grads_of(&weights)).unwrap();
    for _ in 0..3 {
        add(&acc, &scaler, &tensors, &gradient(&mut rng, &tensors, false));
        acc.sync(None).unwrap();
        assert!(opt.step(&acc, &mut muts_of(&mut weights), None).unwrap());
    }
    let saved = opt.save().unwrap();
    // The learning rate and the step count, then tensor 0's range and its masters' length.
    let mut pattern = opt.lr().to_le_bytes().to_vec();
    pattern.extend(3u64.to_le_bytes());
    let at = saved.windows(pattern.len()).position(|w| w == pattern).expect("lr and steps") + 4;
    let reseal = |mut bytes: Vec<u8>| {
        let body = bytes.len() - 8;
        let sum = fnv1a(&bytes[..body]);
        bytes[body..].copy_from_slice(&sum.to_le_bytes());
        bytes
    };
    let mut at_max = saved.clone();
    at_max[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut longer = saved.clone();
    let len_at = at + 8 + 16;
    let n = u64::from_le_bytes(longer[len_at..len_at + 8].try_into().unwrap());
    longer[len_at..len_at + 8].copy_from_slice(&(n + 1).to_le_bytes());
    for (forged, what) in [(at_max, "step count"), (longer, "holds")] {
        let e = opt.load(&[&reseal(forged)]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::CorruptState, "{what}: {e:?}");
        assert!(e.message.contains(what), "{e:?}");
        assert_eq!(opt.save().unwrap(), saved, "{what}: a refused load changed the state");
    }
}

/// The padding of an adopted buffer: a NaN the optimizer must neither read nor write.
const PADDING: u32 = 0x7fc0_1234;

/// A buffer of the masters this accumulator's rank holds, laid out as its flat layout over the
/// shard (tensor i at `offset(i) - shard.start`), each element `value(tensor, element)`; padding
/// PADDING.
fn held_buffer(
    acc: &Accumulator,
    tensors: &[TensorDesc],
    mut value: impl FnMut(usize, usize) -> f32,
) -> Vec<f32> {
    let (held, _) = acc.shard();
    let mut buffer = vec![f32::from_bits(PADDING); held.len()];
    for (i, d) in tensors.iter().enumerate() {
        let start = acc.offset(i).unwrap();
        for e in 0..d.numel {
            if (held.start..held.end).contains(&(start + e)) {
                buffer[start + e - held.start] = value(i, e);
            }
        }
    }
    buffer
}

/// The model's weights as FP32 values: what an owned optimizer starts its masters from.
fn widened(w: &Weights, e: usize) -> f32 {
    match w {
        Weights::F32(v) => v[e],
        Weights::Half(Dtype::F16, v) => from_f16(v[e]) as f32,
        Weights::Half(_, v) => from_bf16(v[e]) as f32,
    }
}

/// Checks that `buffer` holds `opt`'s masters of every tensor, its padding untouched.
fn check_buffer_holds_masters(acc: &Accumulator, opt: &Optimizer, buffer: &[f32], what: &str) {
    let (held, _) = acc.shard();
    let mut covered = vec![false; buffer.len()];
    for i in 0..acc.tensors().len() {
        let (r, masters) = opt.read(i, Slot::Weights).unwrap();
        if masters.is_empty() {
            continue; // none of the tensor is held
        }
        let at = acc.offset(i).unwrap() + r.start;
        for (k, m) in masters.iter().enumerate() {
            let b = buffer[at + k - held.start];
            assert_eq!(b.to_bits(), m.to_bits(), "{what}: tensor {i} element {}", r.start + k);
            covered[at + k - held.start] = true;
        }
    }
    for (k, b) in buffer.iter().enumerate().filter(|(k, _)| !covered[*k]) {
        assert_eq!(b.to_bits(), PADDING, "{what}: padding element {k} was written");
    }
}

/// What a rank saw after each step: the model's weights and the optimizer's values per tensor
/// (masters, moments) as bits.
type Seen = (Vec<Weights>, Vec<Vec<Vec<u32>>>);

/// Runs `data` as `run_group` does, with owned masters or (`adopt`) a buffer of the held
/// masters the test keeps, checked after every step to hold the optimizer's masters.
fn run_masters(
    tensors: &[TensorDesc],
    sharding: Sharding,
    comm: Option<Arc<dyn Communicator>>,
    initial: &[Weights],
    data: &[Vec<Vec<f32>>],
    config: OptimizerConfig,
    adopt: bool,
) -> Vec<Seen> {
    let accumulate = matches!(sharding, Sharding::Accumulate { .. });
    let mut b =
        Accumulator::builder(tensors).config(AccumulatorConfig { sharding, ..Default::default() });
    if let (true, Some(c)) = (accumulate, &comm) {
        b = b.communicator(c.clone());
    }
    let acc = b.build().unwrap();
    let scaler = fixed_scaler();
    let mut weights = initial.to_vec();
    let mut buffer = held_buffer(&acc, tensors, |i, e| widened(&initial[i], e));
    let opt = if adopt {
        // SAFETY: `buffer` outlives `opt` (dropped after it, below) and is only read between
        // the optimizer's calls.
        unsafe {
            let len = buffer.len();
            Optimizer::with_masters(
                &acc,
                config,
                &[],
                &grads_of(&weights),
                buffer.as_mut_ptr(),
                len,
            )
        }
        .unwrap()
    } else {
        Optimizer::new(&acc, config, &[], &grads_of(&weights)).unwrap()
    };
    let adam = matches!(config.algorithm, Algorithm::AdamW { .. });
    let mut seen = Vec::new();
    for (step, g) in data.iter().enumerate() {
        add(&acc, &scaler, tensors, g);
        let on = if accumulate { None } else { comm.as_deref() };
        acc.sync(on).unwrap();
        opt.step(&acc, &mut muts_of(&mut weights), on).unwrap();
        if adopt {
            check_buffer_holds_masters(&acc, &opt, &buffer, &format!("{sharding:?} step {step}"));
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let values = (0..tensors.len())
            .map(|i| {
                let s = state(&opt, i, adam);
                vec![bits(&s.w), bits(&s.m), bits(&s.v)]
            })
            .collect();
        seen.push((weights.clone(), values));
    }
    drop(opt);
    seen
}

/// Adopted masters step exactly as owned ones: the masters, moments and model weights bitwise
/// equal after every step, the caller's buffer holding the masters (its padding untouched), for
/// AdamW and SGD, every weight dtype, unsharded and at 2 and 3 ranks under both sharded policies.
#[test]
fn adopted_masters_step_as_owned_ones() {
    let mut rng = Rng::fresh("adopted_masters_step_as_owned_ones");
    let algorithms = [Algorithm::adamw(), algorithms()[3], algorithms()[4]];
    for (k, algorithm) in algorithms.into_iter().enumerate() {
        let tensors = layout(&mut rng);
        let initial = model(&mut rng, &tensors);
        let rounding = if k == 1 {
            Rounding::Stochastic { seed: rng.next_u64() }
        } else {
            Rounding::NearestEven
        };
        let config = OptimizerConfig { algorithm, lr: 0.01, rounding };
        let data = group_data(&mut rng, &tensors, 3, 12);
        let both =
            |adopt| run_masters(&tensors, Sharding::None, None, &initial, &data[0], config, adopt);
        assert!(both(true) == both(false), "{algorithm:?} unsharded: adopted differs from owned");
        for ranks in [2, 3] {
            let policies: [fn(usize, usize) -> Sharding; 2] = [
                |shards, rank| Sharding::ReduceScatter { shards, rank },
                |shards, rank| Sharding::Accumulate { shards, rank },
            ];
            for policy in policies {
                let group = |adopt: bool| -> Vec<Vec<Seen>> {
                    let comms = LocalComm::group(ranks).unwrap();
                    std::thread::scope(|scope| {
                        let handles: Vec<_> = comms
                            .into_iter()
                            .enumerate()
                            .map(|(rank, comm)| {
                                let (tensors, initial, data) = (&tensors, &initial, &data);
                                scope.spawn(move || {
                                    let comm: Arc<dyn Communicator> = Arc::new(comm);
                                    let sharding = policy(ranks, rank);
                                    let d = &data[rank];
                                    run_masters(
                                        tensors,
                                        sharding,
                                        Some(comm),
                                        initial,
                                        d,
                                        config,
                                        adopt,
                                    )
                                })
                            })
                            .collect();
                        handles.into_iter().map(|h| h.join().unwrap()).collect()
                    })
                };
                let (adopted, owned) = (group(true), group(false));
                assert!(
                    adopted == owned,
                    "{algorithm:?} {:?}: adopted differs from owned",
                    policy(ranks, 0)
                );
            }
        }
    }
}

/// Adopted masters are the masters: creation keeps the caller's values (here FP32 values that the
/// 16-bit weights cannot hold), and each step from them is the exact step within the bound, the
/// buffer updated in place and the model's weights its values rounded to nearest even.
#[test]
fn adopted_values_are_the_masters() {
    let mut rng = Rng::fresh("adopted_values_are_the_masters");
    for algorithm in algorithms() {
        let tensors = layout(&mut rng);
        let adam = matches!(algorithm, Algorithm::AdamW { .. });
        let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
        let scaler = fixed_scaler();
        let mut weights = model(&mut rng, &tensors);
        let mut buffer = held_buffer(&acc, &tensors, |_, _| rng.uniform(-2.0, 2.0) as f32);
        let kept = buffer.clone();
        let config = OptimizerConfig { algorithm, lr: 0.01, rounding: Rounding::NearestEven };
        let len = buffer.len();
        // SAFETY: `buffer` outlives `opt` (declared before it) and is only read between the
        // optimizer's calls.
        let opt = unsafe {
            Optimizer::with_masters(
                &acc,
                config,
                &[],
                &grads_of(&weights),
                buffer.as_mut_ptr(),
                len,
            )
        }
        .unwrap();
        assert!(buffer.iter().zip(&kept).all(|(a, b)| a.to_bits() == b.to_bits()));
        check_buffer_holds_masters(&acc, &opt, &buffer, "created");
        let mut worst = [0.0f64; 3];
        for step in 0..20 {
            let g = gradient(&mut rng, &tensors, step == 7);
            add(&acc, &scaler, &tensors, &g);
            acc.sync(None).unwrap();
            let lr = rng.uniform(1e-4, 0.05) as f32;
            opt.set_lr(lr).unwrap();
            let before: Vec<TensorState> =
                (0..tensors.len()).map(|i| state(&opt, i, adam)).collect();
            let stepped = opt.step(&acc, &mut muts_of(&mut weights), None).unwrap();
            assert_eq!(stepped, step != 7);
            check_buffer_holds_masters(&acc, &opt, &buffer, &format!("step {step}"));
            let t = opt.steps() as i32;
            for (i, gi) in g.iter().enumerate().filter(|_| stepped) {
                let (b, a) = (&before[i], state(&opt, i, adam));
                for (e, &ge) in gi.iter().enumerate() {
                    let v = |s: &[f32]| s.get(e).map_or(0.0, |&x| x as f64);
                    let dist = check_element(
                        algorithm,
                        lr as f64,
                        true,
                        t,
                        ge as f64,
                        (b.w[e] as f64, v(&b.m), v(&b.v)),
                        (a.w[e], a.m[e], a.v.get(e).copied().unwrap_or(0.0)),
                    );
                    assert_within(algorithm, dist, &|| format!("step {t} tensor {i} element {e}"));
                    worst = std::array::from_fn(|q| worst[q].max(dist[q]));
                    assert_eq!(weights[i].bits(e), weights[i].nearest(a.w[e]));
                }
            }
        }
        eprintln!(
            "{algorithm:?} on adopted masters: worst {worst:.2?} roundings (bounds {:?})",
            bounds(algorithm)
        );
    }
}

/// Saved state loads into adopted masters (the caller's buffer then holds the saved masters, and
/// the next steps are the saving optimizer's bit for bit); a refused load leaves the buffer bit
/// for bit. Bad masters at creation (null, misaligned, too short or long, the whole layout under
/// sharding) are refused naming `masters`, creating nothing and writing nothing.
#[test]
fn adopted_masters_load_and_refuse_bad_input() {
    let mut rng = Rng::fresh("adopted_masters_load_and_refuse_bad_input");
    let tensors = layout(&mut rng);
    let config = OptimizerConfig::default();
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let twin = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let scaler = fixed_scaler();
    let (mut weights, initial) = {
        let w = model(&mut rng, &tensors);
        (w.clone(), w)
    };
    let mut twin_weights = initial.clone();
    let owned = Optimizer::new(&twin, config, &[], &grads_of(&initial)).unwrap();
    let mut buffer = held_buffer(&acc, &tensors, |_, _| rng.uniform(-1.0, 1.0) as f32);
    let len = buffer.len();

    // Bad masters, each refused before anything is made or written.
    let kept = buffer.clone();
    let base = buffer.as_mut_ptr();
    let bad: [(*mut f32, usize, ErrorKind, &str); 4] = [
        (std::ptr::null_mut(), len, ErrorKind::InvalidArgument, "NULL"),
        (base.cast::<u8>().wrapping_add(2).cast(), len - 1, ErrorKind::InvalidArgument, "aligned"),
        (base, len - 1, ErrorKind::SizeMismatch, "holds"),
        (base, len + 1, ErrorKind::SizeMismatch, "holds"),
    ];
    for (ptr, n, kind, says) in bad {
        // SAFETY: refused before the buffer is used (the test's point); a valid one is `buffer`.
        let e = unsafe { Optimizer::with_masters(&acc, config, &[], &grads_of(&weights), ptr, n) }
            .unwrap_err();
        assert!(
            e.kind == kind && e.message.contains("masters") && e.message.contains(says),
            "{e:?}"
        );
    }
    let sharded = Accumulator::new(
        AccumulatorConfig {
            sharding: Sharding::ReduceScatter { shards: 2, rank: 1 },
            ..Default::default()
        },
        &tensors,
    )
    .unwrap();
    // SAFETY: refused (the whole layout is not rank 1's shard) before the buffer is used.
    let e =
        unsafe { Optimizer::with_masters(&sharded, config, &[], &grads_of(&weights), base, len) }
            .unwrap_err();
    assert!(e.kind == ErrorKind::SizeMismatch && e.message.contains("`masters`"), "{e:?}");
    let mut short = grads_of(&weights);
    let one = Weights::F32(vec![0.0; tensors[0].numel + 1]);
    short[0] = one.grad();
    // SAFETY: refused (a weight of the wrong length) before the buffer is used.
    let e = unsafe { Optimizer::with_masters(&acc, config, &[], &short, base, len) }.unwrap_err();
    assert!(e.kind == ErrorKind::SizeMismatch && e.message.contains("`weights[0]`"), "{e:?}");
    assert!(buffer.iter().zip(&kept).all(|(a, b)| a.to_bits() == b.to_bits()), "written");

    // SAFETY: `buffer` outlives `opt` (declared before it) and is only read between its calls.
    let opt = unsafe {
        Optimizer::with_masters(&acc, config, &[], &grads_of(&weights), buffer.as_mut_ptr(), len)
    }
    .unwrap();
    let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for step in 0..6 {
        let g = gradient(&mut rng, &tensors, false);
        add(&twin, &scaler, &tensors, &g);
        twin.sync(None).unwrap();
        owned.step(&twin, &mut muts_of(&mut twin_weights), None).unwrap();
        if step > 2 {
            add(&acc, &scaler, &tensors, &g);
            acc.sync(None).unwrap();
            opt.step(&acc, &mut muts_of(&mut weights), None).unwrap();
        }
        if step == 2 {
            // A refused load writes nothing; a load puts the saved masters in the buffer.
            let saved = owned.save().unwrap();
            let before = bits(&buffer);
            let mut forged = saved.clone();
            forged[saved.len() / 2] ^= 0x40;
            assert_eq!(opt.load(&[&forged]).unwrap_err().kind, ErrorKind::CorruptState);
            assert_eq!(opt.load(&[&saved[..10]]).unwrap_err().kind, ErrorKind::CorruptState);
            assert!(bits(&buffer) == before, "a refused load wrote");
            opt.load(&[&saved]).unwrap();
            weights.clone_from(&twin_weights);
        }
        if step >= 2 {
            assert_eq!(opt.save().unwrap(), owned.save().unwrap(), "step {step}");
            assert!(weights == twin_weights, "step {step}");
            for i in 0..tensors.len() {
                let (_, m) = owned.read(i, Slot::Weights).unwrap();
                let at = acc.offset(i).unwrap();
                assert_eq!(bits(&buffer[at..at + m.len()]), bits(&m), "step {step} tensor {i}");
            }
        }
    }
}

/// Adopted masters that share memory with a model weight are refused, at creation and at each
/// step: a step writes both, so the result would depend on the order of its writes.
#[test]
fn adopted_masters_that_overlap_a_weight_are_refused() {
    let tensors = [TensorDesc { numel: 100, dtype: Dtype::F32 }];
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let len = acc.shard().0.len();
    let mut buffer = vec![0.5f32; len];
    let base = buffer.as_mut_ptr();
    let config = OptimizerConfig::default();
    // SAFETY: `base` holds `len` f32 values; the view is only read, and the call refuses it.
    let inside = unsafe { std::slice::from_raw_parts(base.add(len - 100), 100) };
    // SAFETY: refused before the buffer is used (the test's point).
    let e = unsafe { Optimizer::with_masters(&acc, config, &[], &[Grad::F32(inside)], base, len) }
        .unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("overlaps"), "{e:?}");
    let weights = vec![0.25f32; 100];
    // SAFETY: `buffer` outlives `opt` and is touched only through it below.
    let opt =
        unsafe { Optimizer::with_masters(&acc, config, &[], &[Grad::F32(&weights)], base, len) }
            .unwrap();
    add(&acc, &fixed_scaler(), &tensors, &[vec![1.0; 100]]);
    acc.sync(None).unwrap();
    // SAFETY: the first 100 masters, a view the step refuses before it writes anything.
    let aliased = unsafe { std::slice::from_raw_parts_mut(base, 100) };
    let e = opt.step(&acc, &mut [GradMut::F32(aliased)], None).unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("`weights[0]`"), "{e:?}");
    let mut weights = weights;
    assert!(opt.step(&acc, &mut [GradMut::F32(&mut weights)], None).unwrap());
    // SAFETY: no call of `opt` runs; the buffer holds the stepped masters.
    let masters = unsafe { std::slice::from_raw_parts(base, 100) };
    assert!(masters.iter().all(|&m| m != 0.5), "the step wrote the adopted masters");
}

#[test]
fn the_builder_makes_what_the_shorthands_make() {
    let tensors = [TensorDesc { numel: 100, dtype: Dtype::F32 }];
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let weights = vec![0.25f32; 100];
    let config = OptimizerConfig { lr: 1e-2, ..OptimizerConfig::default() };
    let groups = [TensorGroup { weight_decay: false, lr_scale: 0.5 }];
    let built = Optimizer::builder(&acc)
        .config(config)
        .groups(&groups)
        .weights(&[Grad::F32(&weights)])
        .build()
        .unwrap();
    let shorthand = Optimizer::new(&acc, config, &groups, &[Grad::F32(&weights)]).unwrap();
    assert_eq!(built.save().unwrap(), shorthand.save().unwrap());
    assert_eq!(built.lr(), 1e-2);

    let e = Optimizer::builder(&acc).build().unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("weights"), "{e:?}");
    let e = Optimizer::builder(&acc).device_weights(&[0x1000], &[Dtype::F32]).build().unwrap_err();
    assert!(e.kind == ErrorKind::DeviceMismatch && e.message.contains("host weights"), "{e:?}");
    let mut masters = vec![0.0f32; acc.shard().0.len()];
    // SAFETY: refused before the address is used (the memories differ).
    let e = unsafe {
        Optimizer::builder(&acc)
            .weights(&[Grad::F32(&weights)])
            .device_masters(masters.as_mut_ptr() as u64, masters.len())
    }
    .build()
    .unwrap_err();
    assert!(e.kind == ErrorKind::DeviceMismatch && e.message.contains("`masters`"), "{e:?}");
}
