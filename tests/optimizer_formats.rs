//! The optimizer's smaller state formats (bf16 moments rounded stochastically, masters as the
//! bf16 weight plus a 16-bit remainder, no masters): every step against exact (f64) arithmetic,
//! remainder masters bitwise the FP32 masters, no masters over f32 weights bitwise the FP32
//! masters, every sharding policy bitwise the unsharded run, saved state re-cut and converted on
//! load, and what the formats cannot keep refused.

mod common;

use std::sync::Arc;

use common::step_reference::{assert_within, check_element, ulps, U};
use common::weights::{add, fixed_scaler, grads_of, model, muts_of, rank_accumulator, Weights};
use common::*;
use gradacc::{
    join_master, split_master, Accumulator, AccumulatorConfig, Algorithm, Communicator, Dtype,
    ErrorKind, LocalComm, MasterFormat, MomentFormat, Optimizer, OptimizerConfig, Rounding,
    Sharding, Slot, StateFormat, TensorDesc, MOMENT_BLOCK,
};

/// Odd sizes of bf16 tensors (remainder masters take only bf16), with one f16 and one f32
/// tensor when `mixed`.
fn layout(rng: &mut Rng, mixed: bool) -> Vec<TensorDesc> {
    (0..5)
        .map(|i| {
            let dtype = match (mixed, i) {
                (true, 1) => Dtype::F16,
                (true, 3) => Dtype::F32,
                _ => Dtype::Bf16,
            };
            TensorDesc { numel: rng.range(1, 2500) as usize, dtype }
        })
        .collect()
}

/// A gradient of magnitudes in [1e-4, 4), random signs, values each tensor's dtype holds; with
/// `inf`, one element infinite.
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
        g[0][0] = f32::INFINITY;
    }
    g
}

fn remainders() -> StateFormat {
    StateFormat { masters: MasterFormat::Bf16Remainder, moments: MomentFormat::F32 }
}

fn bf16_moments(seed: u64) -> StateFormat {
    StateFormat { masters: MasterFormat::F32, moments: MomentFormat::Bf16 { seed } }
}

fn both(seed: u64) -> StateFormat {
    StateFormat { masters: MasterFormat::Bf16Remainder, moments: MomentFormat::Bf16 { seed } }
}

fn int8(masters: MasterFormat) -> StateFormat {
    StateFormat { masters, moments: MomentFormat::Int8Blockwise }
}

/// Every smaller format: remainder masters, bf16 moments (seeded), both, and 8-bit blockwise
/// moments with either master.
fn smaller_formats(rng: &mut Rng) -> [StateFormat; 5] {
    [
        remainders(),
        bf16_moments(rng.next_u64()),
        both(rng.next_u64()),
        int8(MasterFormat::F32),
        int8(MasterFormat::Bf16Remainder),
    ]
}

/// No masters with each moment format (seeded).
fn no_masters_formats(rng: &mut Rng) -> [StateFormat; 3] {
    [MomentFormat::F32, MomentFormat::Bf16 { seed: rng.next_u64() }, MomentFormat::Int8Blockwise]
        .map(|moments| StateFormat { masters: MasterFormat::None, moments })
}

/// The weights' stochastic rounding of optimizers without masters (`make`).
const NO_MASTERS_ROUNDING: Rounding = Rounding::Stochastic { seed: 0x5eed };

/// An optimizer of `format` over the model `w`; without masters (which round 16-bit weights
/// stochastically only) `config`'s nearest rounding becomes [`NO_MASTERS_ROUNDING`].
fn make(
    acc: &Accumulator,
    config: OptimizerConfig,
    format: StateFormat,
    w: &[Weights],
) -> Optimizer {
    let config = match (format.masters, config.rounding) {
        (MasterFormat::None, Rounding::NearestEven) => {
            OptimizerConfig { rounding: NO_MASTERS_ROUNDING, ..config }
        }
        _ => config,
    };
    Optimizer::builder(acc).config(config).state(format).weights(&grads_of(w)).build().unwrap()
}

/// Tensor `i`'s masters as this rank holds them: read, joined from the weights and the
/// remainders, or (no masters) the weights widened.
fn masters(opt: &Optimizer, i: usize, w: &Weights) -> Vec<f32> {
    match opt.state_format().masters {
        MasterFormat::Bf16Remainder => {
            let (r, rem) = opt.read(i, Slot::Remainders).unwrap();
            r.zip(rem).map(|(e, x)| join_master(w.bf16()[e], x as u16)).collect()
        }
        MasterFormat::None => {
            let (r, _) = opt.read(i, Slot::FirstMoment).unwrap();
            r.map(|e| widened(w, e) as f32).collect()
        }
        MasterFormat::F32 => opt.read(i, Slot::Weights).unwrap().1,
    }
}

/// Element `e` of the model's weights, widened exactly.
fn widened(w: &Weights, e: usize) -> f64 {
    match w {
        Weights::F32(v) => v[e] as f64,
        Weights::Half(Dtype::F16, v) => from_f16(v[e]),
        Weights::Half(_, v) => from_bf16(v[e]),
    }
}

/// Masters, first and second moments of every tensor.
fn state(opt: &Optimizer, w: &[Weights], adam: bool) -> Vec<[Vec<f32>; 3]> {
    (0..w.len())
        .map(|i| {
            let read = |s| opt.read(i, s).unwrap().1;
            [
                masters(opt, i, &w[i]),
                read(Slot::FirstMoment),
                if adam { read(Slot::SecondMoment) } else { vec![] },
            ]
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The spacing of bf16 values at `x`.
fn bf16_spacing(x: f64) -> f64 {
    let e = (x.abs().max(f32::MIN_POSITIVE as f64)).log2().floor();
    2f64.powf(e - 7.0)
}

/// Half the widest gap between neighbouring entries of the dynamic map (signed or unsigned) at
/// `q` (in [-1, 1]) or one decade up, from the map's definition: decade d (0..7) of magnitudes
/// 10^(d-6) · [0.1, 1] has 2^d equal steps per sign (2^(d+1) unsigned), and the gaps between
/// decades and down to 0 are no wider than the next decade's.
fn map_spacing(q: f64, signed: bool) -> f64 {
    let d = (q.abs().max(1e-8).log10().floor() + 8.0).clamp(0.0, 6.0);
    let count = 2f64.powf(d) * if signed { 1.0 } else { 2.0 };
    0.5 * 10f64.powf(d - 6.0) * 0.9 / count
}

/// Every step of every format against exact arithmetic, from the state it started from: FP32
/// quantities within the FP32 state's bound; a bf16 moment within one bf16 spacing of exact plus
/// the FP32 bound (8 roundings of its terms), unbiased over the elements; an 8-bit blockwise
/// moment within half the map's gap at its magnitude (times its block's scale) plus that bound; the weight, which the step makes from its
/// f32 moments before they are rounded, within 24 roundings of the update made from the exact
/// moments. The model's weights are the masters' splits with remainders, else rounded to nearest.
#[test]
fn each_format_steps_within_the_bound_of_exact() {
    let mut rng = Rng::fresh("each_format_steps_within_the_bound_of_exact");
    let algorithms = [
        Algorithm::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
        Algorithm::AdamW { beta1: 0.5, beta2: 0.9, eps: 1e-6, weight_decay: 0.0 },
        Algorithm::Sgd { momentum: 0.9, dampening: 0.1, nesterov: false, weight_decay: 0.01 },
    ];
    for algorithm in algorithms {
        for format in smaller_formats(&mut rng) {
            let mixed = !format_has_remainders(format);
            let blocks = format.moments == MomentFormat::Int8Blockwise;
            let tensors = layout(&mut rng, mixed);
            let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
            let scaler = fixed_scaler();
            let mut w = model(&mut rng, &tensors);
            let config = OptimizerConfig { algorithm, lr: 0.01, rounding: Rounding::NearestEven };
            let opt = make(&acc, config, format, &w);
            let adam = matches!(algorithm, Algorithm::AdamW { .. });
            let (mut bias, mut count) = (0.0f64, 0usize);
            for step in 1..=6 {
                let g = gradient(&mut rng, &tensors, false);
                let before = state(&opt, &w, adam);
                add(&acc, &scaler, &tensors, &g);
                acc.sync(None).unwrap();
                assert!(opt.step(&acc, &mut muts_of(&mut w), None).unwrap());
                let after = state(&opt, &w, adam);
                let t = step;
                for i in 0..tensors.len() {
                    for e in 0..tensors[i].numel {
                        let b = |q: usize| before[i][q].get(e).copied().unwrap_or(0.0) as f64;
                        let a = |q: usize| after[i][q].get(e).copied().unwrap_or(0.0);
                        let gi = g[i][e] as f64;
                        let what = || format!("{format:?} step {step} tensor {i} element {e}");
                        let model_bits = |x: f32| match &w[i] {
                            Weights::F32(v) => (v[e].to_bits(), x.to_bits()),
                            Weights::Half(Dtype::F16, v) => (v[e] as u32, to_f16(x) as u32),
                            Weights::Half(_, v) if format_has_remainders(format) => {
                                (v[e] as u32, split_master(x).0 as u32)
                            }
                            Weights::Half(_, v) => (v[e] as u32, to_bf16(x) as u32),
                        };
                        let (got, want) = model_bits(a(0));
                        assert_eq!(got, want, "{}: the model's weight", what());
                        if !format.bf16_moments_on() {
                            let dist = check_element(
                                algorithm,
                                0.01,
                                true,
                                t,
                                gi,
                                (b(0), b(1), b(2)),
                                (a(0), a(1), a(2)),
                            );
                            assert_within(algorithm, dist, &what);
                            continue;
                        }
                        let (exact, terms, w_exact, w_terms) =
                            exact_step(algorithm, t, gi, (b(0), b(1), b(2)));
                        for q in 1..if adam { 3 } else { 2 } {
                            let (got, x) = (a(q) as f64, exact[q - 1]);
                            let spacing = if blocks {
                                // The block's scale is its largest new moment.
                                let first = e / MOMENT_BLOCK * MOMENT_BLOCK;
                                let end = (first + MOMENT_BLOCK).min(tensors[i].numel);
                                let scale = (first..end)
                                    .map(|j| {
                                        let b = |q: usize| {
                                            before[i][q].get(j).map_or(0.0, |&x| x as f64)
                                        };
                                        let gj = g[i][j] as f64;
                                        exact_step(algorithm, t, gj, (b(0), b(1), b(2))).0[q - 1]
                                            .abs()
                                    })
                                    .fold(0.0, f64::max);
                                map_spacing(x / scale, q == 1) * scale * (1.0 + 1e-5)
                            } else {
                                bf16_spacing(x)
                            };
                            let err = (got - x).abs();
                            assert!(
                                err <= spacing + 8.0 * U * terms[q - 1],
                                "{}: moment {q} {got} is {err} from exact {x} (spacing {spacing})",
                                what()
                            );
                            if x.abs() > 1e-30 && step > 1 && !blocks {
                                bias += (got - x) / spacing;
                                count += 1;
                            }
                        }
                        let dist = ulps(a(0), w_exact, w_terms);
                        assert!(
                            dist <= 24.0,
                            "{}: the master is {dist} roundings from exact",
                            what()
                        );
                    }
                }
            }
            if count > 0 {
                // Stochastic rounding is unbiased: the mean error, in spacings, shrinks as 1/sqrt(n)
                // (each error is within one spacing).
                let mean = bias / count as f64;
                assert!(mean.abs() < 5.0 / (count as f64).sqrt() + 0.02, "{format:?}: bias {mean}");
            }
        }
    }
}

fn format_has_remainders(f: StateFormat) -> bool {
    f.masters == MasterFormat::Bf16Remainder
}

trait Bf16Moments {
    fn bf16_moments_on(&self) -> bool;
}

impl Bf16Moments for StateFormat {
    fn bf16_moments_on(&self) -> bool {
        self.moments != MomentFormat::F32
    }
}

/// The exact moments (first, second) of one step from `before` (weight, m, v), the exact master
/// from them, and the magnitude of its terms: the weight's own, and what the f32 moments' errors
/// (within 8 roundings of their terms) carry into the update.
fn exact_step(
    algorithm: Algorithm,
    t: i32,
    g: f64,
    before: (f64, f64, f64),
) -> ([f64; 2], [f64; 2], f64, f64) {
    let (w, m, v) = before;
    let lr = 0.01;
    match algorithm {
        Algorithm::AdamW { beta1, beta2, eps, weight_decay } => {
            let (b1, b2, eps, wd) = (beta1 as f64, beta2 as f64, eps as f64, weight_decay as f64);
            let m1 = m + (1.0 - b1) * (g - m);
            let v1 = b2 * v + (1.0 - b2) * g * g;
            let denom = v1.sqrt() / (1.0 - b2.powi(t)).sqrt() + eps;
            let step = lr / (1.0 - b1.powi(t));
            let update = step * m1 / denom;
            let (m_terms, v_terms) =
                (b1 * m.abs() + (1.0 - b1) * g.abs(), b2 * v + (1.0 - b2) * g * g);
            let carried =
                step * m_terms / denom + if v1 > 0.0 { update.abs() * v_terms / v1 } else { 0.0 };
            (
                [m1, v1],
                [m_terms, v_terms],
                w * (1.0 - lr * wd) - update,
                w.abs() + update.abs() + carried,
            )
        }
        Algorithm::Sgd { momentum, dampening, weight_decay, .. } => {
            let (mo, keep, wd) = (momentum as f64, 1.0 - dampening as f64, weight_decay as f64);
            let d = g + wd * w;
            let b1 = if t == 1 { d } else { m * mo + keep * d };
            let b_terms = mo * m.abs() + keep * (g.abs() + (wd * w).abs());
            ([b1, 0.0], [b_terms, 0.0], w - lr * b1, w.abs() + lr * (b1.abs() + b_terms))
        }
    }
}

/// Remainder masters are the FP32 masters bit for bit, step after step (a skipped step
/// included), with the same moments; the model's weights are the masters' splits, which differ
/// from round to nearest even only at ties of even upper halves.
#[test]
fn remainder_masters_are_the_fp32_masters_bit_for_bit() {
    let mut rng = Rng::fresh("remainder_masters_are_the_fp32_masters_bit_for_bit");
    let tensors = layout(&mut rng, false);
    let initial = model(&mut rng, &tensors);
    for seed in [None, Some(rng.next_u64())] {
        let moments = seed.map_or(MomentFormat::F32, |seed| MomentFormat::Bf16 { seed });
        let fp32 = StateFormat { masters: MasterFormat::F32, moments };
        let rem = StateFormat { masters: MasterFormat::Bf16Remainder, moments };
        let runs: Vec<_> = [fp32, rem]
            .iter()
            .map(|&format| {
                let mut rng = Rng::seeded(7);
                let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                let scaler = fixed_scaler();
                let mut w = initial.clone();
                let opt =
                    make(&acc, OptimizerConfig { lr: 0.05, ..Default::default() }, format, &w);
                let mut seen = Vec::new();
                for step in 0..8 {
                    add(&acc, &scaler, &tensors, &gradient(&mut rng, &tensors, step == 3));
                    acc.sync(None).unwrap();
                    opt.step(&acc, &mut muts_of(&mut w), None).unwrap();
                    seen.push((state(&opt, &w, true), w.clone()));
                }
                assert_eq!(opt.steps(), 7);
                seen
            })
            .collect();
        for (step, ((s0, w0), (s1, w1))) in runs[0].iter().zip(&runs[1]).enumerate() {
            for i in 0..tensors.len() {
                for q in 0..3 {
                    assert_eq!(bits(&s0[i][q]), bits(&s1[i][q]), "step {step} tensor {i} slot {q}");
                }
                for (e, (&a, &b)) in w0[i].bf16().iter().zip(w1[i].bf16()).enumerate() {
                    let x = s0[i][0][e].to_bits();
                    let tie_of_even = x & 0xffff == 0x8000 && (x >> 16) & 1 == 0;
                    assert_eq!(
                        b,
                        a.wrapping_add(tie_of_even as u16),
                        "step {step} tensor {i} element {e}"
                    );
                }
            }
        }
    }
}

/// Runs `ranks` ranks under `sharding` (none: unsharded over one rank's data summed exactly,
/// see the gradients) for the data's steps, with `format`; returns each rank's weights after
/// every step and its saved state at the end.
fn run_group(
    tensors: &[TensorDesc],
    sharding: fn(usize, usize) -> Sharding,
    initial: &[Weights],
    data: &[Vec<Vec<Vec<f32>>>],
    config: OptimizerConfig,
    format: StateFormat,
) -> (Vec<Vec<Vec<Weights>>>, Vec<Vec<u8>>) {
    let ranks = data.len();
    let comms = LocalComm::group(ranks).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                scope.spawn(move || {
                    let comm: Arc<dyn Communicator> = Arc::new(comm);
                    let cfg =
                        AccumulatorConfig { sharding: sharding(ranks, rank), ..Default::default() };
                    let (acc, on) = rank_accumulator(tensors, cfg, &comm);
                    let scaler = fixed_scaler();
                    let mut weights = initial.to_vec();
                    let opt = make(&acc, config, format, &weights);
                    let mut seen = Vec::new();
                    for g in &data[rank] {
                        add(&acc, &scaler, tensors, g);
                        acc.sync(on).unwrap();
                        opt.step(&acc, &mut muts_of(&mut weights), on).unwrap();
                        seen.push(weights.clone());
                    }
                    (seen, opt.save().unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).unzip()
    })
}

/// Per rank, per step, a gradient (step 2 overflows).
fn group_data(
    rng: &mut Rng,
    tensors: &[TensorDesc],
    ranks: usize,
    steps: usize,
) -> Vec<Vec<Vec<Vec<f32>>>> {
    (0..ranks).map(|_| (0..steps).map(|s| gradient(rng, tensors, s == 2)).collect()).collect()
}

/// ZeRO-1 and ZeRO-2 at 2 and 3 ranks and a 2 x 2 hybrid grid: every format writes the
/// unsharded run's weights after every step, and its saved parts load onto one rank as the
/// unsharded state, bit for bit.
#[test]
fn every_format_sharded_is_the_unsharded_run() {
    let mut rng = Rng::fresh("every_format_sharded_is_the_unsharded_run");
    for ranks in [2, 3] {
        let tensors = layout(&mut rng, false);
        let initial = model(&mut rng, &tensors);
        let data = group_data(&mut rng, &tensors, ranks, 5);
        let formats: Vec<StateFormat> =
            smaller_formats(&mut rng).into_iter().chain(no_masters_formats(&mut rng)).collect();
        for format in formats {
            let config = OptimizerConfig { lr: 0.01, ..Default::default() };
            let (unsharded, saved) =
                run_group(&tensors, |_, _| Sharding::None, &initial, &data, config, format);
            let policies: [fn(usize, usize) -> Sharding; 2] = [
                |shards, rank| Sharding::ReduceScatter { shards, rank },
                |shards, rank| Sharding::Accumulate { shards, rank },
            ];
            for policy in policies {
                let (sharded, parts) = run_group(&tensors, policy, &initial, &data, config, format);
                for (rank, r) in sharded.iter().enumerate() {
                    for (step, w) in r.iter().enumerate() {
                        assert!(
                            w == &unsharded[0][step],
                            "{format:?} {:?}: rank {rank} differs at step {step}",
                            policy(ranks, rank)
                        );
                    }
                }
                let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
                let last = &unsharded[0][4];
                let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                let recut = make(&acc, config, format, last);
                recut.load(&parts).unwrap();
                let whole = make(&acc, config, format, last);
                whole.load(&[&saved[0]]).unwrap();
                assert_eq!(recut.save().unwrap(), whole.save().unwrap(), "{format:?} re-cut");
            }
        }
        // A 2 x 2 hybrid grid over the first two ranks' data, each replica the same data.
        let none =
            StateFormat { masters: MasterFormat::None, moments: MomentFormat::Bf16 { seed: 3 } };
        for format in [both(rng.next_u64()), none] {
            let config = OptimizerConfig { lr: 0.01, ..Default::default() };
            let two = [data[0].clone(), data[1].clone()];
            let (unsharded, _) =
                run_group(&tensors, |_, _| Sharding::None, &initial, &two, config, format);
            let results = hybrid_grid(2, 2, |g, shard, replica| {
                let cfg = AccumulatorConfig {
                    sharding: Sharding::ReduceScatter { shards: 2, rank: g % 2 },
                    ..Default::default()
                };
                let acc = Accumulator::new(cfg, &tensors).unwrap();
                let scaler = fixed_scaler();
                let mut w = initial.clone();
                let opt = make(&acc, config, format, &w);
                let mut seen = Vec::new();
                // Each replica adds the data of its shard's rank: twice the sum over twice the items,
                // which is the same mean, exactly.
                for g in &two[g % 2] {
                    add(&acc, &scaler, &tensors, g);
                    acc.sync_hybrid(shard, replica).unwrap();
                    opt.step(&acc, &mut muts_of(&mut w), Some(shard)).unwrap();
                    seen.push(w.clone());
                }
                seen
            });
            for (g, seen) in results.iter().enumerate() {
                assert_eq!(seen, &results[0], "hybrid rank {g} differs from rank 0");
            }
            assert_eq!(results[0], unsharded[0], "{format:?}: hybrid against the unsharded run");
        }
    }
}

/// A 2-rank ZeRO-1 run of FP32 state over `tensors` rounding with `rounding`: its model, data
/// (4 steps, one skipped) and config, the weights it ended with, and its saved parts.
struct Fp32Run {
    initial: Vec<Weights>,
    data: Vec<Vec<Vec<Vec<f32>>>>,
    config: OptimizerConfig,
    weights: Vec<Weights>,
    parts: Vec<Vec<u8>>,
}

fn fp32_run(rng: &mut Rng, tensors: &[TensorDesc], rounding: Rounding) -> Fp32Run {
    let initial = model(rng, tensors);
    let data = group_data(rng, tensors, 2, 4);
    let config = OptimizerConfig { lr: 0.02, rounding, ..Default::default() };
    let rs = |shards, rank| Sharding::ReduceScatter { shards, rank };
    let (seen, parts) = run_group(tensors, rs, &initial, &data, config, StateFormat::default());
    Fp32Run { weights: seen[0][3].clone(), initial, data, config, parts }
}

/// Saved state of each format loads into the same format (re-cut), FP32 state converts into each
/// smaller format, remainders refuse to load without their weights, and damaged parts are refused
/// with the optimizer unchanged.
#[test]
fn saved_formats_recut_convert_and_refuse() {
    let mut rng = Rng::fresh("saved_formats_recut_convert_and_refuse");
    let tensors = layout(&mut rng, false);
    let Fp32Run { initial, data, config, weights, parts } =
        fp32_run(&mut rng, &tensors, Rounding::NearestEven);
    let rs = |shards, rank| Sharding::ReduceScatter { shards, rank };
    let fp32_parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let reference = make(&acc, config, StateFormat::default(), &weights);
    reference.load(&fp32_parts).unwrap();
    let want = state(&reference, &weights, true);
    let formats = [
        remainders(),
        bf16_moments(5),
        both(6),
        int8(MasterFormat::F32),
        int8(MasterFormat::Bf16Remainder),
    ];
    for format in formats {
        // FP32 state into the smaller format: moments rounded to nearest even (bf16) or to the
        // nearest entry of the map, each block's largest magnitude kept exactly (8-bit blocks),
        // remainders of the nearest-even weights (the master one f32 unit toward its weight at
        // ties of even upper halves).
        for shards in [1, 3] {
            for rank in 0..shards {
                let cfg = AccumulatorConfig { sharding: rs(shards, rank), ..Default::default() };
                let sharded = Accumulator::new(cfg, &tensors).unwrap();
                let opt = make(&sharded, config, format, &weights);
                opt.load(&fp32_parts).unwrap();
                assert_eq!(opt.steps(), 3);
                let got = state(&opt, &weights, true);
                for i in 0..tensors.len() {
                    let (r, _) = opt.read(i, Slot::FirstMoment).unwrap();
                    for (k, e) in r.enumerate() {
                        let x = want[i][0][e].to_bits();
                        let tie_of_even = x & 0xffff == 0x8000 && (x >> 16) & 1 == 0;
                        let master =
                            if format_has_remainders(format) && tie_of_even { x - 1 } else { x };
                        assert_eq!(
                            got[i][0][k].to_bits(),
                            master,
                            "{format:?} tensor {i} element {e}"
                        );
                        for q in (1..3).filter(|_| format.moments == MomentFormat::Int8Blockwise) {
                            let first = e / MOMENT_BLOCK * MOMENT_BLOCK;
                            let end = (first + MOMENT_BLOCK).min(tensors[i].numel);
                            let block = &want[i][q][first..end];
                            let scale = block.iter().fold(0.0f32, |a, x| a.max(x.abs())) as f64;
                            let (got, x) = (got[i][q][k] as f64, want[i][q][e] as f64);
                            let bound = map_spacing(x / scale, q == 1) * scale * (1.0 + 1e-5);
                            assert!((got - x).abs() <= bound, "{format:?} slot {q}: {got} for {x}");
                            // The signed map holds 1 but not -1 (bitsandbytes' map).
                            if x == scale {
                                assert_eq!(got, x, "a block's largest value is kept exactly");
                            }
                        }
                        for q in (1..3).filter(|_| format.moments != MomentFormat::Int8Blockwise) {
                            let moment = if format.bf16_moments_on() {
                                from_bf16(to_bf16(want[i][q][e])) as f32
                            } else {
                                want[i][q][e]
                            };
                            assert_eq!(
                                got[i][q][k].to_bits(),
                                moment.to_bits(),
                                "{format:?} slot {q}"
                            );
                        }
                    }
                }
            }
        }
        // The format's own state re-cut from 2 parts onto 3, and, for bf16 moments, widened
        // into FP32 moments.
        let (seen, parts) = run_group(&tensors, rs, &initial, &data, config, format);
        let w = seen[0][3].clone();
        let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let whole = make(&acc, config, format, &w);
        whole.load(&parts).unwrap();
        let whole_state = state(&whole, &w, true);
        for rank in 0..3 {
            let cfg = AccumulatorConfig { sharding: rs(3, rank), ..Default::default() };
            let sharded = Accumulator::new(cfg, &tensors).unwrap();
            let opt = make(&sharded, config, format, &w);
            opt.load(&parts).unwrap();
            let got = state(&opt, &w, true);
            for i in 0..tensors.len() {
                let (r, _) = opt.read(i, Slot::FirstMoment).unwrap();
                for q in 0..3 {
                    assert_eq!(
                        bits(&got[i][q]),
                        bits(&whole_state[i][q][r.clone()]),
                        "{format:?} rank {rank}"
                    );
                }
            }
        }
        let into_fp32 = make(
            &acc,
            config,
            StateFormat { moments: MomentFormat::F32, ..StateFormat::default() },
            &w,
        );
        let loaded = into_fp32.load(&parts);
        if format_has_remainders(format) {
            let e = loaded.unwrap_err();
            assert!(
                e.kind == ErrorKind::CorruptState && e.message.contains("need their bf16 weights"),
                "{e:?}"
            );
        } else {
            loaded.unwrap();
            let got = state(&into_fp32, &w, true);
            for i in 0..tensors.len() {
                for q in 0..3 {
                    assert_eq!(bits(&got[i][q]), bits(&whole_state[i][q]), "widened {format:?}");
                }
            }
        }
        // Damaged or foreign parts change nothing.
        let before = whole.save().unwrap();
        let mut damaged = parts[0].to_vec();
        let at = damaged.len() / 2;
        damaged[at] ^= 0x40;
        let e = whole.load(&[&damaged, parts[1]]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::CorruptState, "{e:?}");
        let e = whole.load(&[&parts[0][..parts[0].len() - 1], parts[1]]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::CorruptState, "{e:?}");
        assert_eq!(whole.save().unwrap(), before, "{format:?}: a refused load changed the state");
    }
}

/// Remainder masters over f16 or f32 weights, with stochastic rounding of the weights, or with
/// adopted masters are refused with InvalidArgument naming the tensor and its dtype; reading
/// the masters of remainders asks for the remainders.
#[test]
fn what_a_format_cannot_keep_is_refused() {
    let mut rng = Rng::fresh("what_a_format_cannot_keep_is_refused");
    let tensors = layout(&mut rng, true);
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let w = model(&mut rng, &tensors);
    let build = |config: OptimizerConfig, format| {
        Optimizer::builder(&acc).config(config).state(format).weights(&grads_of(&w)).build()
    };
    let e = build(OptimizerConfig::default(), remainders()).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.message.contains("`weights[1]` is f16"), "{}", e.message);
    let bf16: Vec<TensorDesc> =
        tensors.iter().map(|d| TensorDesc { dtype: Dtype::Bf16, ..*d }).collect();
    let acc16 = Accumulator::new(AccumulatorConfig::default(), &bf16).unwrap();
    let w16 = model(&mut rng, &bf16);
    let sr = OptimizerConfig { rounding: Rounding::Stochastic { seed: 1 }, ..Default::default() };
    let e = Optimizer::builder(&acc16)
        .config(sr)
        .state(remainders())
        .weights(&grads_of(&w16))
        .build()
        .unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("stochastic"), "{e:?}");
    let mut masters = vec![0f32; acc16.plan_numel()];
    let g16 = grads_of(&w16);
    let builder = Optimizer::builder(&acc16).state(remainders()).weights(&g16);
    // SAFETY: `masters` outlives the (refused) optimizer and nothing else touches it.
    let e = unsafe { builder.masters(masters.as_mut_ptr(), masters.len()) }.build().unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("adopted"), "{e:?}");
    let opt = make(&acc16, OptimizerConfig::default(), remainders(), &w16);
    assert_eq!(opt.read(0, Slot::Weights).unwrap_err().kind, ErrorKind::InvalidArgument);
    assert!(opt.read(0, Slot::Remainders).unwrap().1.iter().all(|&r| r == 0.0));
    // bf16 and 8-bit blockwise moments take any weights.
    build(OptimizerConfig::default(), bf16_moments(3)).unwrap();
    build(OptimizerConfig::default(), int8(MasterFormat::F32)).unwrap();
}

trait Numel {
    fn plan_numel(&self) -> usize;
}

impl Numel for Accumulator {
    fn plan_numel(&self) -> usize {
        self.shard().0.len()
    }
}

/// State saved before the formats were (format version 1, FP32 state) still loads, into FP32
/// state as it was and into the smaller formats as FP32 state converts.
#[test]
fn state_saved_by_version_1_still_loads() {
    let mut rng = Rng::fresh("state_saved_by_version_1_still_loads");
    let tensors = layout(&mut rng, false);
    let initial = model(&mut rng, &tensors);
    let data = group_data(&mut rng, &tensors, 1, 3);
    let config = OptimizerConfig { lr: 0.02, ..Default::default() };
    let (seen, saved) =
        run_group(&tensors, |_, _| Sharding::None, &initial, &data, config, StateFormat::default());
    // Version 1 is version 2 without the two format words after the identity (the tensor count,
    // two words per tensor, the algorithm's five and the rounding's two).
    let v2 = &saved[0];
    let at = 8 + (2 * tensors.len() + 8) * 8;
    let mut v1 = [&v2[..4], &1u32.to_le_bytes(), &v2[8..at], &v2[at + 16..v2.len() - 8]].concat();
    v1.extend(fnv1a(&v1).to_le_bytes());
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let w = &seen[0][2];
    for format in [StateFormat::default(), both(9)] {
        let (old, new) = (make(&acc, config, format, w), make(&acc, config, format, w));
        old.load(&[&v1]).unwrap();
        new.load(&[v2]).unwrap();
        assert_eq!(old.save().unwrap(), new.save().unwrap(), "{format:?}");
    }
}

/// Ranks whose state formats differ fail a sharded step together (SIZE_MISMATCH), changing
/// nothing, instead of stepping their shards by different rules.
#[test]
fn ranks_whose_formats_differ_fail_together() {
    let mut rng = Rng::fresh("ranks_whose_formats_differ_fail_together");
    let tensors = layout(&mut rng, false);
    let initial = model(&mut rng, &tensors);
    let g = gradient(&mut rng, &tensors, false);
    let comms = LocalComm::group(2).unwrap();
    let results: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let (tensors, initial, g) = (&tensors, &initial, &g);
                s.spawn(move || {
                    let cfg = AccumulatorConfig {
                        sharding: Sharding::ReduceScatter { shards: 2, rank },
                        ..Default::default()
                    };
                    let acc = Accumulator::new(cfg, tensors).unwrap();
                    let format = if rank == 0 { StateFormat::default() } else { bf16_moments(1) };
                    let mut w = initial.clone();
                    let opt = make(&acc, OptimizerConfig::default(), format, &w);
                    add(&acc, &fixed_scaler(), tensors, g);
                    acc.sync(Some(&comm)).unwrap();
                    let before = opt.save().unwrap();
                    let e = opt.step(&acc, &mut muts_of(&mut w), Some(&comm)).unwrap_err();
                    (e.kind, opt.save().unwrap() == before && &w == initial)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (kind, unchanged)) in results.into_iter().enumerate() {
        assert_eq!(kind, ErrorKind::SizeMismatch, "rank {rank}");
        assert!(unchanged, "rank {rank} changed");
    }
}

/// Every instruction-set path and thread count steps every format to the same bits: one tensor
/// large enough to split over 3 threads, 3 steps, the weights and saved state compared.
#[test]
fn every_path_and_thread_count_steps_the_same_bits() {
    use gradacc::simd::{self, Isa};
    let mut rng = Rng::fresh("every_path_and_thread_count_steps_the_same_bits");
    let n = 3 * gradacc::simd::MIN_ELEMENTS_PER_THREAD + 17;
    let tensors =
        [TensorDesc { numel: n, dtype: Dtype::Bf16 }, TensorDesc { numel: 5, dtype: Dtype::Bf16 }];
    let initial = model(&mut rng, &tensors);
    let data: Vec<_> = (0..3).map(|_| gradient(&mut rng, &tensors, false)).collect();
    let formats = [
        remainders(),
        bf16_moments(rng.next_u64()),
        both(rng.next_u64()),
        int8(MasterFormat::Bf16Remainder),
    ]
    .into_iter()
    .chain(no_masters_formats(&mut rng));
    for format in formats {
        let run = |isa: Isa, threads: usize| {
            simd::with_isa(isa, || {
                let cfg = AccumulatorConfig { threads, ..Default::default() };
                let acc = Accumulator::new(cfg, &tensors).unwrap();
                let scaler = fixed_scaler();
                let mut w = initial.clone();
                let opt = make(&acc, OptimizerConfig::default(), format, &w);
                for g in &data {
                    add(&acc, &scaler, &tensors, g);
                    acc.sync(None).unwrap();
                    opt.step(&acc, &mut muts_of(&mut w), None).unwrap();
                }
                (w, opt.save().unwrap())
            })
        };
        let want = run(Isa::Scalar, 1);
        for (isa, threads) in [(simd::active_isa(), 1), (simd::active_isa(), 3), (Isa::Avx2, 2)] {
            assert!(run(isa, threads) == want, "{format:?} {isa:?} {threads} threads");
        }
    }
}

/// A part whose format words name a format this version does not know is refused as corrupt,
/// even with a fresh checksum, and the optimizer is unchanged.
#[test]
fn an_unknown_saved_format_is_refused() {
    let mut rng = Rng::fresh("an_unknown_saved_format_is_refused");
    let tensors = layout(&mut rng, false);
    let initial = model(&mut rng, &tensors);
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let opt = make(&acc, OptimizerConfig::default(), both(2), &initial);
    let saved = opt.save().unwrap();
    // The moments' format word follows the identity and the masters' word.
    let at = 8 + (2 * tensors.len() + 8) * 8 + 8;
    let mut forged = saved[..saved.len() - 8].to_vec();
    forged[at] = 7;
    forged.extend(fnv1a(&forged).to_le_bytes());
    let e = opt.load(&[&forged]).unwrap_err();
    assert!(e.kind == ErrorKind::CorruptState && e.message.contains("does not know"), "{e:?}");
    assert_eq!(opt.save().unwrap(), saved);
}

/// Saved FP32 moments cut inside an 8-bit block would quantise in other blocks than the
/// optimizer's: a part forged to start at element 1 (fresh checksum) is refused, naming the cut,
/// and the optimizer is unchanged; the same part aligned loads.
#[test]
fn fp32_moments_cut_inside_a_block_are_refused_by_8_bit_blocks() {
    let mut rng = Rng::fresh("fp32_moments_cut_inside_a_block_are_refused_by_8_bit_blocks");
    let tensors = [TensorDesc { numel: 200, dtype: Dtype::Bf16 }];
    let initial = model(&mut rng, &tensors);
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let fp32 = make(&acc, OptimizerConfig::default(), StateFormat::default(), &initial);
    let saved = fp32.save().unwrap();
    let blocks = make(&acc, OptimizerConfig::default(), int8(MasterFormat::F32), &initial);
    let before = blocks.save().unwrap();
    blocks.load(&[&saved]).unwrap();
    blocks.load(&[&before]).unwrap();
    // After the identity and the two format words: lr (4 bytes), steps, then start and end.
    let at = 8 + (2 * tensors.len() + 8) * 8 + 16 + 4 + 8;
    let values = at + 16;
    let mut forged = saved[..at].to_vec();
    forged.extend(1u64.to_le_bytes());
    forged.extend(200u64.to_le_bytes());
    // Each column: its length, then its values.
    for column in 0..3 {
        let first = values + column * (8 + 200 * 4) + 8;
        forged.extend(199u64.to_le_bytes());
        forged.extend(&saved[first + 4..first + 200 * 4]);
    }
    forged.extend(fnv1a(&forged).to_le_bytes());
    let e = blocks.load(&[&forged]).unwrap_err();
    assert!(e.kind == ErrorKind::CorruptState && e.message.contains("cut inside a block"), "{e:?}");
    assert_eq!(blocks.save().unwrap(), before);
}

/// The spacing of `dtype`'s values at `x` (16-bit: bf16 with 8 significant bits, f16 with 11 and
/// subnormals below 2^-14).
fn spacing_of(dtype: Dtype, x: f64) -> f64 {
    let e = x.abs().max(f64::MIN_POSITIVE).log2().floor();
    match dtype {
        Dtype::F16 => 2f64.powf(e.max(-14.0) - 10.0),
        _ => 2f64.powf(e - 7.0),
    }
}

/// Without masters, each step is the FP32 rule from the widened weight, rounded stochastically
/// into the weight: against exact (f64) arithmetic from the state the step started from, a
/// 16-bit weight is within one spacing of the exact update (plus the FP32 rule's 24 roundings),
/// one of the two neighbours of it, and unbiased over the elements; an f32 weight is within the
/// FP32 bound. Every moment format, AdamW and SGD, bf16, f16 and f32 weights.
#[test]
fn no_masters_step_the_fp32_rule_rounded_unbiased() {
    let mut rng = Rng::fresh("no_masters_step_the_fp32_rule_rounded_unbiased");
    let algorithms = [
        Algorithm::AdamW { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 },
        Algorithm::Sgd { momentum: 0.9, dampening: 0.1, nesterov: false, weight_decay: 0.01 },
    ];
    for algorithm in algorithms {
        for format in no_masters_formats(&mut rng) {
            let tensors = layout(&mut rng, true);
            let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
            let scaler = fixed_scaler();
            let mut w = model(&mut rng, &tensors);
            let rounding = Rounding::Stochastic { seed: rng.next_u64() };
            let config = OptimizerConfig { algorithm, lr: 0.01, rounding };
            let opt = make(&acc, config, format, &w);
            let adam = matches!(algorithm, Algorithm::AdamW { .. });
            let (mut bias, mut count, mut moved) = (0.0f64, 0usize, 0usize);
            // Elements whose exact update lies 5% to 45% of a spacing above the grid point below
            // its magnitude: how many rounded up, and how many should have (nearest rounds none
            // up).
            let (mut up, mut expected, mut near) = (0.0f64, 0.0f64, 0usize);
            for step in 1..=6 {
                let g = gradient(&mut rng, &tensors, false);
                let before = state(&opt, &w, adam);
                add(&acc, &scaler, &tensors, &g);
                acc.sync(None).unwrap();
                assert!(opt.step(&acc, &mut muts_of(&mut w), None).unwrap());
                for (i, d) in tensors.iter().enumerate() {
                    for (e, &ge) in g[i].iter().enumerate() {
                        let b = |q: usize| before[i][q].get(e).copied().unwrap_or(0.0) as f64;
                        let what = || {
                            format!("{format:?} {algorithm:?} step {step} tensor {i} element {e}")
                        };
                        let (_, _, exact, terms) =
                            exact_step(algorithm, step, ge as f64, (b(0), b(1), b(2)));
                        let got = widened(&w[i], e);
                        let err = (got - exact).abs();
                        let rule = 24.0 * U * terms;
                        if d.dtype == Dtype::F32 {
                            assert!(err <= rule, "{}: {got} is {err} from exact {exact}", what());
                            continue;
                        }
                        let spacing = spacing_of(d.dtype, exact);
                        assert!(
                            err <= spacing + rule,
                            "{}: {got} is {err} from exact {exact} (spacing {spacing})",
                            what()
                        );
                        moved += (got != b(0)) as usize;
                        // In magnitudes: rounding up is away from zero.
                        let lo = (exact.abs() / spacing).floor() * spacing;
                        let frac = (exact.abs() - lo) / spacing;
                        if (0.05..0.45).contains(&frac) {
                            up += (got.abs() - lo > spacing / 2.0) as u64 as f64;
                            expected += frac;
                            near += 1;
                        }
                        bias += (got - exact) / spacing;
                        count += 1;
                    }
                }
            }
            // Unbiased: the mean error in spacings shrinks as 1/sqrt(n) (each within one).
            let mean = bias / count as f64;
            assert!(mean.abs() < 5.0 / (count as f64).sqrt() + 0.01, "{format:?}: bias {mean}");
            assert!(moved > count / 4, "{format:?}: only {moved} of {count} weights moved");
            // Each rounds up with probability `frac`: a binomial count, within 5 deviations.
            assert!(
                (up - expected).abs() < 5.0 * (near as f64).sqrt() * 0.5 && near > 1000,
                "{format:?}: {up} of {near} rounded up, {expected} expected"
            );
        }
    }
}

/// Updates far below half a bf16 spacing, which round to nearest back to the same weight, move
/// the weights without masters by their expected value: 2,000 steps of SGD at a constant
/// gradient, against f64 and against FP32 masters rounded to nearest.
#[test]
fn no_masters_keep_updates_below_the_spacing() {
    let tensors = [TensorDesc { numel: 4096, dtype: Dtype::Bf16 }];
    let sgd = Algorithm::Sgd { momentum: 0.0, dampening: 0.0, nesterov: false, weight_decay: 0.0 };
    // Weights at 1.0 (bf16 spacing 2^-7 above), steps of lr * g = 2^-7 / 64.
    let (lr, steps) = (1.0f32 / 1024.0, 2000);
    let g = vec![vec![-1.0f32 / 8.0; tensors[0].numel]];
    let want = 1.0 + steps as f64 * (lr as f64 / 8.0);
    for format in
        [StateFormat::default(), StateFormat { masters: MasterFormat::None, ..Default::default() }]
    {
        let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
        let mut w = vec![Weights::Half(Dtype::Bf16, vec![to_bf16(1.0); tensors[0].numel])];
        let config = OptimizerConfig { algorithm: sgd, lr, rounding: Rounding::NearestEven };
        let opt = make(&acc, config, format, &w);
        for _ in 0..steps {
            add(&acc, &fixed_scaler(), &tensors, &g);
            acc.sync(None).unwrap();
            opt.step(&acc, &mut muts_of(&mut w), None).unwrap();
        }
        let mean =
            (0..tensors[0].numel).map(|e| widened(&w[0], e)).sum::<f64>() / tensors[0].numel as f64;
        if format.masters == MasterFormat::None {
            // Each step's expected move is exact; the mean of 4096 weights is within a few
            // standard errors (each step's draw moves a weight by at most one spacing).
            let sd = (steps as f64).sqrt() * 2f64.powi(-7) / (tensors[0].numel as f64).sqrt();
            assert!((mean - want).abs() < 5.0 * sd, "no masters: mean {mean}, want {want}");
        } else {
            // FP32 masters keep the sum; their nearest-even weights are within half a spacing.
            assert!((mean - want).abs() <= 2f64.powi(-7), "FP32 masters: {mean}, want {want}");
        }
    }
}

/// Over f32 weights the weight is the master: without masters every step (a skipped one
/// included) writes the FP32 masters' weights and moments bit for bit, with either rounding and
/// every moment format. Over 16-bit weights the first step, whose FP32 master is the widened
/// weight too, writes the same stochastically rounded weights.
#[test]
fn no_masters_over_f32_weights_are_the_fp32_masters_bit_for_bit() {
    let mut rng = Rng::fresh("no_masters_over_f32_weights_are_the_fp32_masters_bit_for_bit");
    let f32s: Vec<TensorDesc> = (0..4)
        .map(|_| TensorDesc { numel: rng.range(1, 3000) as usize, dtype: Dtype::F32 })
        .collect();
    let halves = layout(&mut rng, true);
    for format in no_masters_formats(&mut rng) {
        for rounding in [Rounding::NearestEven, Rounding::Stochastic { seed: rng.next_u64() }] {
            let tensors = if rounding == Rounding::NearestEven { &f32s } else { &halves };
            let steps = if rounding == Rounding::NearestEven { 8 } else { 1 };
            let initial = model(&mut rng, tensors);
            let fp32 = StateFormat { masters: MasterFormat::F32, ..format };
            let data: Vec<_> = (0..steps).map(|s| gradient(&mut rng, tensors, s == 3)).collect();
            let runs: Vec<_> = [fp32, format]
                .iter()
                .map(|&format| {
                    let acc = Accumulator::new(AccumulatorConfig::default(), tensors).unwrap();
                    let mut w = initial.clone();
                    let config = OptimizerConfig { lr: 0.05, rounding, ..Default::default() };
                    let opt = make(&acc, config, format, &w);
                    let mut seen = Vec::new();
                    for g in &data {
                        add(&acc, &fixed_scaler(), tensors, g);
                        acc.sync(None).unwrap();
                        opt.step(&acc, &mut muts_of(&mut w), None).unwrap();
                        let moments: Vec<Vec<u32>> = (0..tensors.len())
                            .flat_map(|i| {
                                let read = |s| bits(&opt.read(i, s).unwrap().1);
                                [read(Slot::FirstMoment), read(Slot::SecondMoment)]
                            })
                            .collect();
                        seen.push((w.clone(), moments));
                    }
                    seen
                })
                .collect();
            for (step, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
                assert!(a == b, "{format:?} {rounding:?}: step {step} differs");
            }
        }
    }
}

/// Saved state without masters holds no master column and re-cuts onto another shard count;
/// FP32 state converts into it by dropping the masters (the weights the FP32 optimizer wrote
/// are the masters from then on); a part without masters is refused, naming it, by an optimizer
/// that keeps masters; what no masters cannot do is refused by name; damaged parts change
/// nothing.
#[test]
fn saved_state_without_masters_converts_and_refuses() {
    let mut rng = Rng::fresh("saved_state_without_masters_converts_and_refuses");
    let tensors = layout(&mut rng, true);
    let run = fp32_run(&mut rng, &tensors, NO_MASTERS_ROUNDING);
    let (initial, config, w) = (run.initial, run.config, run.weights);
    let rs = |shards, rank| Sharding::ReduceScatter { shards, rank };
    let fp32_parts: Vec<&[u8]> = run.parts.iter().map(Vec::as_slice).collect();
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let fp32 = make(&acc, config, StateFormat::default(), &w);
    fp32.load(&fp32_parts).unwrap();
    let numel: usize = tensors.iter().map(|d| d.numel).sum();
    for format in no_masters_formats(&mut rng) {
        // FP32 state into no masters: the moments as FP32 moments convert, the masters dropped.
        let none = make(&acc, config, format, &w);
        none.load(&fp32_parts).unwrap();
        assert_eq!(none.steps(), 4 - 1, "{format:?}: the step count (one step skipped)");
        let moments = StateFormat { masters: MasterFormat::F32, ..format };
        let converted = make(&acc, config, moments, &w);
        converted.load(&fp32_parts).unwrap();
        for i in 0..tensors.len() {
            for s in [Slot::FirstMoment, Slot::SecondMoment] {
                let (a, b) = (none.read(i, s).unwrap().1, converted.read(i, s).unwrap().1);
                assert_eq!(bits(&a), bits(&b), "{format:?} tensor {i} {s:?}");
            }
        }
        let saved = none.save().unwrap();
        assert!(
            saved.len() + 4 * numel <= converted.save().unwrap().len(),
            "{format:?}: a part without masters holds no master column"
        );
        // Re-cut onto 3 shards and back: the same state.
        let parts: Vec<Vec<u8>> = (0..3)
            .map(|rank| {
                let cfg = AccumulatorConfig { sharding: rs(3, rank), ..Default::default() };
                let sharded = Accumulator::new(cfg, &tensors).unwrap();
                let opt = make(&sharded, config, format, &w);
                opt.load(&[&saved]).unwrap();
                opt.save().unwrap()
            })
            .collect();
        let back = make(&acc, config, format, &w);
        back.load(&parts.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
        assert_eq!(back.save().unwrap(), saved, "{format:?} re-cut");
        // Into FP32 masters: refused, naming the part; the optimizer unchanged.
        let before = fp32.save().unwrap();
        let e = fp32.load(&[&parts[0], &parts[1], &parts[2]]).unwrap_err();
        assert!(
            e.kind == ErrorKind::CorruptState
                && e.message.contains("part 0 holds no masters")
                && e.message.contains("MasterFormat::None"),
            "{e:?}"
        );
        assert_eq!(fp32.save().unwrap(), before);
        // Damaged: refused, unchanged.
        let mut damaged = saved.clone();
        let at = damaged.len() / 2;
        damaged[at] ^= 0x10;
        assert_eq!(back.load(&[&damaged]).unwrap_err().kind, ErrorKind::CorruptState);
        assert_eq!(back.save().unwrap(), saved);
        // The masters are the weights: neither master slot is kept.
        for s in [Slot::Weights, Slot::Remainders] {
            let e = none.read(0, s).unwrap_err();
            assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("no masters"));
        }
    }
    // 16-bit weights rounded to nearest, and adopted masters, are refused by name.
    let none = StateFormat { masters: MasterFormat::None, ..Default::default() };
    let nearest = OptimizerConfig::default();
    let g = grads_of(&initial);
    let e = Optimizer::builder(&acc).config(nearest).state(none).weights(&g).build().unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("`rounding`"), "{e:?}");
    let mut masters = vec![0f32; acc.plan_numel()];
    let builder = Optimizer::builder(&acc).config(config).state(none).weights(&g);
    // SAFETY: `masters` outlives the (refused) optimizer and nothing else touches it.
    let e = unsafe { builder.masters(masters.as_mut_ptr(), masters.len()) }.build().unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("adopted"), "{e:?}");
}
