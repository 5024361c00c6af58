//! FP8 weights on the all-gather: the E4M3 conversion over every class of f32 against a
//! reference built from the format's definition, the quantisers against f64 references, the
//! gathered codes and scales on every rank bitwise the whole tensor's masters quantised on one
//! rank (2 and 3 ranks, every sharding policy, odd sizes, every state format), the bytes the
//! all-gather moves, a non-finite amax skipped on every rank, and what is refused.

mod common;

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::weights::{add, fixed_scaler, grads_of, model, rank_accumulator, Weights};
use common::*;
use gradacc::comm::{BlockPass, ControlSum, HostCollectives};
use gradacc::fp8::{self, MX_BLOCK};
use gradacc::{
    Accumulator, AccumulatorConfig, Algorithm, Communicator, Dtype, ErrorKind, LocalComm,
    MasterFormat, MomentFormat, Optimizer, OptimizerConfig, Rounding, Sharding, Slot, StateFormat,
    TensorDesc, WeightFormat, WeightMut,
};

// ---- The reference quantisers, from the formats' definitions, in f64 ----

/// Every finite non-negative E4M3 value with its code: subnormals m * 2^-9, normals
/// (1 + m/8) * 2^(e - 7); 0x7F is NaN.
fn e4m3_table() -> Vec<(f64, u8)> {
    (0u8..0x7F)
        .map(|c| {
            let (e, m) = ((c >> 3) as i32, (c & 7) as f64);
            let v = if e == 0 { m * 2f64.powi(-9) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
            (v, c)
        })
        .collect()
}

/// `x` (not NaN) to E4M3: the nearest value of the table to `min(|x|, 448)`, a tie to the even
/// code, with `x`'s sign.
fn ref_e4m3(table: &[(f64, u8)], x: f64) -> u8 {
    assert!(!x.is_nan());
    let a = x.abs().min(448.0);
    let mut best = table[0];
    for &(v, c) in table {
        let (d, db) = ((a - v).abs(), (a - best.0).abs());
        if d < db || (d == db && c & 1 == 0) {
            best = (v, c);
        }
    }
    best.1 | if x.is_sign_negative() { 0x80 } else { 0 }
}

/// The reference of [`fp8::f32_to_e4m3`], NaN included (its sign kept).
fn ref_f32(table: &[(f64, u8)], x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F | ((x.to_bits() >> 24) & 0x80) as u8;
    }
    ref_e4m3(table, x as f64)
}

/// A tensor's FP32 masters quantised with one scale: 448 / max(amax, 1e-12) rounded to f32,
/// each product rounded to f32 (exact in f64 first), then to E4M3.
fn ref_tensorwise(table: &[(f64, u8)], x: &[f32]) -> (Vec<u8>, f32) {
    let amax = x.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
    let scale = (448.0 / amax.max(1e-12)) as f32;
    let codes = x.iter().map(|&v| ref_e4m3(table, (v as f64 * scale as f64) as f32 as f64));
    (codes.collect(), scale)
}

/// A tensor's FP32 masters as MXFP8: per block of 32, e = floor(log2(amax)) - 8 clamped to
/// -127..=127 (-127 for an amax of 0), the byte e + 127, the elements x / 2^e to E4M3.
fn ref_mx(table: &[(f64, u8)], x: &[f32]) -> (Vec<u8>, Vec<u8>) {
    let (mut codes, mut scales) = (Vec::new(), Vec::new());
    for block in x.chunks(32) {
        let amax = block.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
        let e = if amax == 0.0 { -127 } else { (amax.log2().floor() as i32 - 8).clamp(-127, 127) };
        scales.push((e + 127) as u8);
        codes.extend(block.iter().map(|&v| ref_e4m3(table, v as f64 * 2f64.powi(-e))));
    }
    (codes, scales)
}

fn next_up(x: f32) -> f32 {
    f32::from_bits(if x == 0.0 { 1 } else { x.to_bits() + 1 })
}

fn next_down(x: f32) -> f32 {
    if x == 0.0 {
        -f32::from_bits(1)
    } else {
        f32::from_bits(x.to_bits() - 1)
    }
}

/// Every E4M3 value, every tie between neighbours and the f32 on either side of each, the
/// saturation boundary, f32 subnormals, ±0, infinities, NaNs and random bit patterns, both
/// signs: the conversion is the reference's.
#[test]
fn e4m3_conversion_is_the_definition_on_every_class() {
    let table = e4m3_table();
    let mut inputs: Vec<f32> = vec![0.0, f32::from_bits(1), f32::MIN_POSITIVE, 1e-30];
    for w in table.windows(2) {
        let (a, b) = (w[0].0 as f32, w[1].0 as f32);
        let tie = ((w[0].0 + w[1].0) / 2.0) as f32;
        assert_eq!(tie as f64, (w[0].0 + w[1].0) / 2.0, "ties are f32 values");
        inputs.extend([a, next_up(a), next_down(a), tie, next_up(tie), next_down(tie), b]);
    }
    inputs.extend([448.0, next_up(448.0), 464.0, next_down(464.0), next_up(464.0), 480.0]);
    inputs.extend([1e10, f32::MAX, f32::INFINITY]);
    let mut rng = Rng::fresh("e4m3_conversion_is_the_definition_on_every_class");
    inputs.extend((0..200_000).map(|_| f32::from_bits(rng.next_u64() as u32)));
    // Magnitudes in E4M3's range, where random bit patterns seldom fall.
    inputs.extend((0..200_000).map(|_| 2f64.powf(rng.uniform(-12.0, 9.5)) as f32));
    let negated: Vec<f32> = inputs.iter().map(|x| -x).collect();
    inputs.extend(negated);
    inputs.extend([f32::NAN, -f32::NAN, f32::from_bits(0x7F80_0001), f32::from_bits(0xFFC0_1234)]);
    for x in inputs {
        assert_eq!(fp8::f32_to_e4m3(x), ref_f32(&table, x), "{x:e} ({:#010x})", x.to_bits());
    }
    // The halfway point between 0 and the smallest subnormal rounds to the even 0, with its
    // sign; just above it to the smallest subnormal.
    assert_eq!(fp8::f32_to_e4m3(2f32.powi(-10)), 0);
    assert_eq!(fp8::f32_to_e4m3(-2f32.powi(-10)), 0x80);
    assert_eq!(fp8::f32_to_e4m3(next_up(2f32.powi(-10))), 1);
    assert_eq!(fp8::f32_to_e4m3(f32::INFINITY), 0x7E);
    assert_eq!(fp8::f32_to_e4m3(f32::NEG_INFINITY), 0xFE);
    for (v, c) in table {
        assert_eq!(fp8::e4m3_to_f32(c) as f64, v);
        assert_eq!(fp8::e4m3_to_f32(c | 0x80) as f64, -v);
    }
    assert!(fp8::e4m3_to_f32(0x7F).is_nan() && fp8::e4m3_to_f32(0xFF).is_nan());
}

/// The quantisers of a whole tensor on their edge cases: all zeros (the scale of 1e-12), f32
/// subnormals, powers of two at every MXFP8 exponent, f32's largest, an odd tail block.
#[test]
fn quantisers_are_the_references_at_their_edges() {
    let table = e4m3_table();
    let mut rng = Rng::fresh("quantisers_are_the_references_at_their_edges");
    let mut tensors: Vec<Vec<f32>> = vec![vec![0.0; 45], vec![-0.0, f32::from_bits(3), 0.0]];
    tensors.push((-149..128).map(|k| 2f64.powi(k) as f32).collect());
    tensors.push(vec![f32::MAX, -f32::MAX, 1.0, f32::MIN_POSITIVE]);
    for _ in 0..50 {
        let n = rng.range(1, 300) as usize;
        let decades = rng.uniform(0.0, 30.0);
        let centre = rng.uniform(-30.0, 30.0);
        let t = (0..n).map(|_| {
            // Finite: a step never quantises an infinite amax.
            let m = 10f64.powf((centre + rng.uniform(-decades, decades) / 2.0).min(38.0)) as f32;
            if rng.range(0, 1) == 1 {
                m
            } else {
                -m
            }
        });
        tensors.push(t.collect());
    }
    for x in &tensors {
        let (codes, scale) = ref_tensorwise(&table, x);
        assert_eq!(fp8::e4m3_scale(fp8::amax(x)).to_bits(), scale.to_bits(), "{x:?}");
        let mut got = vec![0u8; x.len()];
        fp8::quantise_tensorwise(x, scale, &mut got);
        assert_eq!(got, codes, "tensorwise {x:?}");
        let (codes, scales) = ref_mx(&table, x);
        let (mut got, mut got_scales) = (vec![0u8; x.len()], vec![0u8; x.len().div_ceil(32)]);
        fp8::quantise_mx(x, &mut got, &mut got_scales);
        assert_eq!((got, got_scales), (codes, scales), "MXFP8 {x:?}");
    }
    assert_eq!(fp8::e4m3_scale(0.0), (448.0 / 1e-12f64) as f32);
}

// ---- The sharded step ----

/// One tensor's weights as a step writes them.
#[derive(Clone, Debug, PartialEq)]
enum Buf {
    Model(Weights),
    E4m3(Vec<u8>, Vec<u32>),
    Mx(Vec<u8>, Vec<u8>),
}

impl Buf {
    fn new(format: WeightFormat, initial: &Weights, numel: usize) -> Buf {
        match format {
            WeightFormat::Model => Buf::Model(initial.clone()),
            WeightFormat::E4m3Tensorwise => Buf::E4m3(vec![0; numel], vec![0]),
            WeightFormat::Mxfp8 => Buf::Mx(vec![0; numel], vec![0; numel.div_ceil(MX_BLOCK)]),
        }
    }

    fn weight(&mut self) -> WeightMut<'_> {
        match self {
            Buf::Model(w) => WeightMut::Model(w.grad_mut()),
            Buf::E4m3(codes, scale) => {
                // The scale's bits, kept as u32 so that the buffers compare bitwise.
                let scale: &mut [f32] = bytemuck_f32(scale);
                WeightMut::E4m3 { codes, scale }
            }
            Buf::Mx(codes, scales) => WeightMut::Mxfp8 { codes, scales },
        }
    }
}

/// `u32` bits seen as the f32 values they encode.
fn bytemuck_f32(v: &mut [u32]) -> &mut [f32] {
    // SAFETY: u32 and f32 have the same size and alignment, and every bit pattern is an f32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len()) }
}

fn weights_of(bufs: &mut [Buf]) -> Vec<WeightMut<'_>> {
    bufs.iter_mut().map(Buf::weight).collect()
}

/// What a rank saw after a step: its weights, and the masters it holds (range and values).
type Seen = (Vec<Buf>, Vec<(Range<usize>, Vec<f32>)>);

fn held_masters(opt: &Optimizer, n: usize) -> Vec<(Range<usize>, Vec<f32>)> {
    (0..n).map(|i| opt.read(i, Slot::Weights).unwrap()).collect()
}

/// Sizes that straddle the 4096-element shard boundaries at 2 and 3 ranks, each odd, one of a
/// single element, one below a block.
fn layout() -> Vec<TensorDesc> {
    [4097, 9001, 1, 7777, 33, 5003]
        .into_iter()
        .map(|numel| TensorDesc { numel, dtype: Dtype::Bf16 })
        .collect()
}

fn formats() -> Vec<WeightFormat> {
    use WeightFormat::*;
    vec![E4m3Tensorwise, Mxfp8, E4m3Tensorwise, Mxfp8, Model, E4m3Tensorwise]
}

/// Gradients in [1e-4, 4) of random signs, per rank and step; step 1 overflows on rank 0 (the
/// last tensor's first element).
fn data(
    rng: &mut Rng,
    tensors: &[TensorDesc],
    ranks: usize,
    steps: usize,
) -> Vec<Vec<Vec<Vec<f32>>>> {
    (0..ranks)
        .map(|rank| {
            (0..steps)
                .map(|s| {
                    let mut g: Vec<Vec<f32>> = tensors
                        .iter()
                        .map(|d| {
                            (0..d.numel)
                                .map(|_| {
                                    let m = 10f64.powf(rng.uniform(-4.0, 0.6));
                                    let v = if rng.range(0, 1) == 1 { m } else { -m };
                                    decoded(Dtype::Bf16, v as f32, 1.0) as f32
                                })
                                .collect()
                        })
                        .collect();
                    if s == 1 && rank == 0 {
                        let last = g.len() - 1;
                        g[last][0] = f32::INFINITY;
                    }
                    g
                })
                .collect()
        })
        .collect()
}

/// The optimizer of one rank.
fn make(
    acc: &Accumulator,
    config: OptimizerConfig,
    state: StateFormat,
    formats: &[WeightFormat],
    w: &[Weights],
) -> Optimizer {
    let b = Optimizer::builder(acc).config(config).state(state).weight_formats(formats);
    b.weights(&grads_of(w)).build().unwrap()
}

/// Runs the data's ranks under `sharding`, each step's weights and held masters per rank.
fn run_group(
    tensors: &[TensorDesc],
    sharding: fn(usize, usize) -> Sharding,
    formats: &[WeightFormat],
    initial: &[Weights],
    data: &[Vec<Vec<Vec<f32>>>],
    (config, state): (OptimizerConfig, StateFormat),
) -> Vec<Vec<Seen>> {
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
                    let opt = make(&acc, config, state, formats, initial);
                    let mut bufs: Vec<Buf> = (0..tensors.len())
                        .map(|i| Buf::new(formats[i], &initial[i], tensors[i].numel))
                        .collect();
                    let scaler = fixed_scaler();
                    let mut seen = Vec::new();
                    for g in &data[rank] {
                        add(&acc, &scaler, tensors, g);
                        acc.sync(on).unwrap();
                        opt.step_weights(&acc, &mut weights_of(&mut bufs), on).unwrap();
                        seen.push((bufs.clone(), held_masters(&opt, tensors.len())));
                    }
                    seen
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Tensor i's whole masters, joined from every rank's held ranges.
fn whole_masters(ranks: &[&Seen], i: usize, numel: usize) -> Vec<f32> {
    let mut x = vec![f32::NAN; numel];
    for (_, held) in ranks {
        let (r, v) = &held[i];
        x[r.clone()].copy_from_slice(v);
    }
    assert!(x.iter().all(|v| !v.is_nan()), "tensor {i}'s masters are covered");
    x
}

/// Every rank's FP8 buffers after every step are the references of the whole tensor's
/// masters, and every rank's buffers are the same.
fn check_seen(tensors: &[TensorDesc], formats: &[WeightFormat], seen: &[Vec<Seen>], what: &str) {
    let table = e4m3_table();
    for step in 0..seen[0].len() {
        let at: Vec<&Seen> = seen.iter().map(|r| &r[step]).collect();
        for (i, f) in formats.iter().enumerate() {
            let x = whole_masters(&at, i, tensors[i].numel);
            let want = match f {
                WeightFormat::Model => None,
                WeightFormat::E4m3Tensorwise => {
                    let (codes, scale) = ref_tensorwise(&table, &x);
                    Some(Buf::E4m3(codes, vec![scale.to_bits()]))
                }
                WeightFormat::Mxfp8 => {
                    let (codes, scales) = ref_mx(&table, &x);
                    Some(Buf::Mx(codes, scales))
                }
            };
            for (rank, s) in at.iter().enumerate() {
                let got = &s.0[i];
                assert_eq!(got, &at[0].0[i], "{what}: rank {rank} tensor {i} step {step}");
                if let Some(want) = &want {
                    assert!(got == want, "{what}: tensor {i} ({f:?}) step {step} on rank {rank}");
                }
            }
        }
    }
}

/// 2 and 3 ranks under ZeRO-1 and ZeRO-2, with FP32, bf16 and 8-bit blockwise moments and
/// stochastic rounding of the bf16 tensor: after every step every rank's FP8 codes and scales
/// are the whole tensor quantised on one rank, and the masters are those of a run with bf16
/// weights only (the FP8 path steps the same bits).
#[test]
fn gathered_fp8_weights_are_the_whole_tensor_quantised() {
    let mut rng = Rng::fresh("gathered_fp8_weights_are_the_whole_tensor_quantised");
    let tensors = layout();
    let formats = formats();
    let initial = model(&mut rng, &tensors);
    let states = [
        StateFormat::default(),
        StateFormat {
            masters: MasterFormat::F32,
            moments: MomentFormat::Bf16 { seed: rng.next_u64() },
        },
        StateFormat { masters: MasterFormat::F32, moments: MomentFormat::Int8Blockwise },
    ];
    let policies: [fn(usize, usize) -> Sharding; 2] = [
        |shards, rank| Sharding::ReduceScatter { shards, rank },
        |shards, rank| Sharding::Accumulate { shards, rank },
    ];
    for ranks in [2, 3] {
        let data = data(&mut rng, &tensors, ranks, 4);
        for (s, state) in states.into_iter().enumerate() {
            let algorithm = match s {
                2 => Algorithm::Sgd {
                    momentum: 0.9,
                    dampening: 0.0,
                    nesterov: false,
                    weight_decay: 1e-4,
                },
                _ => Algorithm::adamw(),
            };
            let rounding = Rounding::Stochastic { seed: rng.next_u64() };
            let config = OptimizerConfig { lr: 0.01, algorithm, rounding };
            let plain = vec![WeightFormat::Model; tensors.len()];
            let bf16 = run_group(&tensors, policies[0], &plain, &initial, &data, (config, state));
            for policy in policies {
                let what = format!("{ranks} ranks, {state:?}, {:?}", policy(ranks, 0));
                let seen = run_group(&tensors, policy, &formats, &initial, &data, (config, state));
                check_seen(&tensors, &formats, &seen, &what);
                for (rank, r) in seen.iter().enumerate() {
                    for (step, s) in r.iter().enumerate() {
                        assert!(
                            s.1 == bf16[rank][step].1,
                            "{what}: masters, rank {rank} step {step}"
                        );
                        // The tensor in its model dtype is the bf16 run's.
                        assert_eq!(s.0[4], bf16[rank][step].0[4], "{what}: bf16 tensor");
                    }
                    assert!(r[1].0 == r[0].0, "{what}: the overflowed step 1 changes nothing");
                }
            }
        }
    }
}

/// A 2 x 2 hybrid grid (ZeRO inside a replica, all-reduce across): every rank's FP8 weights are
/// the whole tensor quantised.
#[test]
fn hybrid_fp8_weights_are_the_whole_tensor_quantised() {
    let mut rng = Rng::fresh("hybrid_fp8_weights_are_the_whole_tensor_quantised");
    let tensors = layout();
    let formats = formats();
    let initial = model(&mut rng, &tensors);
    let data = data(&mut rng, &tensors, 2, 3);
    let config = OptimizerConfig { lr: 0.01, ..Default::default() };
    let results = hybrid_grid(2, 2, |g, shard, replica| {
        let sharding = Sharding::ReduceScatter { shards: 2, rank: g % 2 };
        let acc = Accumulator::new(AccumulatorConfig { sharding, ..Default::default() }, &tensors)
            .unwrap();
        let opt = make(&acc, config, StateFormat::default(), &formats, &initial);
        let mut bufs: Vec<Buf> = (0..tensors.len())
            .map(|i| Buf::new(formats[i], &initial[i], tensors[i].numel))
            .collect();
        let scaler = fixed_scaler();
        let mut seen = Vec::new();
        for d in &data[g % 2] {
            add(&acc, &scaler, &tensors, d);
            acc.sync_hybrid(shard, replica).unwrap();
            opt.step_weights(&acc, &mut weights_of(&mut bufs), Some(shard)).unwrap();
            seen.push((bufs.clone(), held_masters(&opt, tensors.len())));
        }
        seen
    });
    check_seen(&tensors, &formats, &results[..2], "hybrid, replica 0");
    check_seen(&tensors, &formats, &results[2..], "hybrid, replica 1");
    for (g, r) in results.iter().enumerate() {
        for (step, s) in r.iter().enumerate() {
            assert_eq!(s.0, results[0][step].0, "hybrid rank {g} step {step}");
        }
    }
}

// ---- Bytes ----

/// A communicator that counts the bytes each rank brings to each all-gather.
struct Counting {
    inner: LocalComm,
    gathers: Mutex<Vec<usize>>,
    values: AtomicUsize,
}

impl Communicator for Counting {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn host(&self) -> Option<&dyn HostCollectives> {
        Some(self)
    }
}

impl HostCollectives for Counting {
    fn reduce_control(&self, mine: &ControlSum) -> gradacc::Result<ControlSum> {
        self.inner.reduce_control(mine)
    }
    fn allreduce_sum(&self, buf: &mut [f32]) -> gradacc::Result<()> {
        self.inner.allreduce_sum(buf)
    }
    fn allreduce_with_pass(
        &self,
        buf: &mut [f32],
        buckets: &[Range<usize>],
        pass: &dyn BlockPass,
    ) -> gradacc::Result<Vec<f64>> {
        self.inner.allreduce_with_pass(buf, buckets, pass)
    }
    fn reduce_scatter_with_pass(
        &self,
        buf: &mut [f32],
        shards: &[Range<usize>],
        pass: &dyn BlockPass,
    ) -> gradacc::Result<Vec<f64>> {
        self.inner.reduce_scatter_with_pass(buf, shards, pass)
    }
    fn allgather_values(&self, mine: &[f64], counts: &[usize]) -> gradacc::Result<Vec<f64>> {
        self.values.fetch_add(mine.len(), Ordering::Relaxed);
        self.inner.allgather_values(mine, counts)
    }
    fn allgather_bytes(&self, mine: &[u8], counts: &[usize]) -> gradacc::Result<Vec<u8>> {
        self.gathers.lock().unwrap().push(mine.len());
        self.inner.allgather_bytes(mine, counts)
    }
}

/// The bytes each rank brings to a step's all-gathers: 1 per element for E4M3 plus its
/// 4-byte amax per tensor (an exchange of its own, before the pass), 1 + 1/32 for MXFP8,
/// 2 for bf16.
#[test]
fn the_all_gather_moves_one_byte_per_element() {
    let mut rng = Rng::fresh("the_all_gather_moves_one_byte_per_element");
    let tensors = layout();
    let initial = model(&mut rng, &tensors);
    let numel: usize = tensors.iter().map(|d| d.numel).sum();
    let blocks: usize = tensors.iter().map(|d| d.numel.div_ceil(MX_BLOCK)).sum();
    let k = tensors.len();
    let cases = [
        (WeightFormat::Model, vec![2 * numel]),
        (WeightFormat::E4m3Tensorwise, vec![4 * k * 2, numel]),
        (WeightFormat::Mxfp8, vec![4 * k * 2, numel + blocks]),
    ];
    for (format, want) in cases {
        let formats = vec![format; k];
        let d = data(&mut rng, &tensors, 2, 1);
        let comms = LocalComm::group(2).unwrap();
        let gathers: Vec<Vec<usize>> = std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, inner)| {
                    let (formats, initial, tensors, d) = (&formats, &initial, &tensors, &d);
                    scope.spawn(move || {
                        let counting = Counting {
                            inner,
                            gathers: Mutex::default(),
                            values: AtomicUsize::new(0),
                        };
                        let sharding = Sharding::ReduceScatter { shards: 2, rank };
                        let cfg = AccumulatorConfig { sharding, ..Default::default() };
                        let acc = Accumulator::new(cfg, tensors).unwrap();
                        let config = OptimizerConfig { lr: 0.01, ..Default::default() };
                        let opt = make(&acc, config, StateFormat::default(), formats, initial);
                        let mut bufs: Vec<Buf> = (0..k)
                            .map(|i| Buf::new(formats[i], &initial[i], tensors[i].numel))
                            .collect();
                        add(&acc, &fixed_scaler(), tensors, &d[rank][0]);
                        acc.sync(Some(&counting.inner)).unwrap();
                        opt.step_weights(&acc, &mut weights_of(&mut bufs), Some(&counting))
                            .unwrap();
                        counting.gathers.into_inner().unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // The amax exchange carries every rank's words; the weights' carries each rank's shard.
        let brought: Vec<usize> =
            (0..want.len())
                .map(|c| {
                    if c + 1 < want.len() {
                        gathers[0][c] * 2
                    } else {
                        gathers[0][c] + gathers[1][c]
                    }
                })
                .collect();
        assert_eq!(brought, want, "{format:?}: bytes brought to each all-gather by both ranks");
    }
}

// ---- A non-finite amax, and what is refused ----

/// A gradient that drives one element of an E4M3 tensor's new masters to infinity, on rank 1's
/// shard: every rank fails naming the tensor, with weights and state unchanged, and the same
/// window steps after the learning rate is lowered.
#[test]
fn a_non_finite_amax_skips_the_step_on_every_rank() {
    let mut rng = Rng::fresh("a_non_finite_amax_skips_the_step_on_every_rank");
    let tensors = layout();
    let formats = formats();
    let initial = model(&mut rng, &tensors);
    let mut d = data(&mut rng, &tensors, 2, 1);
    // Tensor 1 starts after tensor 0's 4097 elements (padded to 4160): its element 8000 is
    // flat element 12160, in rank 1's shard (8192..).
    d[0][0][1][8000] = 3e38;
    let comms = LocalComm::group(2).unwrap();
    std::thread::scope(|scope| {
        for (rank, comm) in comms.into_iter().enumerate() {
            let (formats, initial, tensors, d) = (&formats, &initial, &tensors, &d);
            scope.spawn(move || {
                let sharding = Sharding::ReduceScatter { shards: 2, rank };
                let acc =
                    Accumulator::new(AccumulatorConfig { sharding, ..Default::default() }, tensors)
                        .unwrap();
                let config = OptimizerConfig {
                    lr: 100.0,
                    algorithm: Algorithm::sgd(),
                    ..Default::default()
                };
                let opt = make(&acc, config, StateFormat::default(), formats, initial);
                let mut bufs: Vec<Buf> = (0..tensors.len())
                    .map(|i| Buf::new(formats[i], &initial[i], tensors[i].numel))
                    .collect();
                add(&acc, &fixed_scaler(), tensors, &d[rank][0]);
                acc.sync(Some(&comm)).unwrap();
                let (before, saved) = (bufs.clone(), opt.save().unwrap());
                let e =
                    opt.step_weights(&acc, &mut weights_of(&mut bufs), Some(&comm)).unwrap_err();
                assert_eq!(e.kind, ErrorKind::InvalidArgument, "rank {rank}: {e}");
                assert!(e.message.contains("tensor 1's new masters"), "rank {rank}: {e}");
                assert!(bufs == before && opt.save().unwrap() == saved, "rank {rank}: unchanged");
                assert_eq!(opt.steps(), 0);
                opt.set_lr(1e-3).unwrap();
                assert!(opt.step_weights(&acc, &mut weights_of(&mut bufs), Some(&comm)).unwrap());
                assert_eq!(opt.steps(), 1);
            });
        }
    });
}

/// FP8 weights without a sharded boundary or FP32 masters, a wrong count, and at the step a
/// weight of another format or codes or scales of the wrong length: each refused naming the
/// argument, and the step after them is whole.
#[test]
fn what_fp8_weights_cannot_take_is_refused() {
    let mut rng = Rng::fresh("what_fp8_weights_cannot_take_is_refused");
    let tensors = layout();
    let formats = formats();
    let initial = model(&mut rng, &tensors);
    let config = OptimizerConfig::default();
    let build_with = |config, sharding, state, formats: &[WeightFormat]| {
        let acc = Accumulator::new(AccumulatorConfig { sharding, ..Default::default() }, &tensors)
            .unwrap();
        let b = Optimizer::builder(&acc).config(config).state(state).weight_formats(formats);
        b.weights(&grads_of(&initial)).build().map(drop)
    };
    let build =
        |sharding, state, formats: &[WeightFormat]| build_with(config, sharding, state, formats);
    let one = Sharding::ReduceScatter { shards: 1, rank: 0 };
    let e = build(Sharding::None, StateFormat::default(), &formats).unwrap_err();
    assert!(
        e.kind == ErrorKind::InvalidArgument && e.message.contains("`weight_formats[0]`"),
        "{e}"
    );
    let remainders =
        StateFormat { masters: MasterFormat::Bf16Remainder, moments: MomentFormat::F32 };
    let e = build(one, remainders, &formats).unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("FP32 masters"), "{e}");
    // No masters, with the stochastic rounding they need over 16-bit weights.
    let stochastic = OptimizerConfig { rounding: Rounding::Stochastic { seed: 3 }, ..config };
    let none = StateFormat { masters: MasterFormat::None, moments: MomentFormat::F32 };
    let e = build_with(stochastic, one, none, &formats).unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("keeps no masters"), "{e}");
    let e = build(one, StateFormat::default(), &formats[1..]).unwrap_err();
    assert!(e.kind == ErrorKind::SizeMismatch && e.message.contains("`weight_formats`"), "{e}");
    build(one, StateFormat::default(), &formats).unwrap();

    let acc = Accumulator::new(AccumulatorConfig { sharding: one, ..Default::default() }, &tensors)
        .unwrap();
    let opt = make(&acc, config, StateFormat::default(), &formats, &initial);
    assert_eq!(opt.weight_formats(), &formats[..]);
    let comm = LocalComm::group(1).unwrap().pop().unwrap();
    add(&acc, &fixed_scaler(), &tensors, &data(&mut rng, &tensors, 1, 1)[0][0]);
    acc.sync(Some(&comm)).unwrap();
    let good: Vec<Buf> =
        (0..tensors.len()).map(|i| Buf::new(formats[i], &initial[i], tensors[i].numel)).collect();
    let saved = opt.save().unwrap();
    let refuse = |edit: &dyn Fn(&mut Vec<Buf>), kind: ErrorKind, says: &str| {
        let mut bufs = good.clone();
        edit(&mut bufs);
        let before = bufs.clone();
        let e = opt.step_weights(&acc, &mut weights_of(&mut bufs), Some(&comm)).unwrap_err();
        assert!(e.kind == kind && e.message.contains(says), "{says}: {e}");
        assert!(bufs == before && opt.save().unwrap() == saved, "{says}: unchanged");
    };
    refuse(
        &|b| b[0].clone_from(&Buf::E4m3(vec![0; 4097], vec![0, 0])),
        ErrorKind::SizeMismatch,
        "`weights[0]`'s scales hold 2",
    );
    refuse(
        &|b| b[1] = Buf::Mx(vec![0; 9001], vec![0; 281]),
        ErrorKind::SizeMismatch,
        "`weights[1]`'s scales hold 281",
    );
    refuse(
        &|b| b[3] = Buf::Mx(vec![0; 7776], vec![0; 244]),
        ErrorKind::SizeMismatch,
        "`weights[3]` holds 7776",
    );
    refuse(
        &|b| b[2] = Buf::Model(initial[2].clone()),
        ErrorKind::DtypeMismatch,
        "`weights[2]` is the model's dtype",
    );
    refuse(
        &|b| b[4] = Buf::E4m3(vec![0; 33], vec![0]),
        ErrorKind::DtypeMismatch,
        "`weights[4]` is E4M3",
    );
    let mut plain = initial.clone();
    let e = opt.step(&acc, &mut common::weights::muts_of(&mut plain), Some(&comm)).unwrap_err();
    assert!(e.kind == ErrorKind::DtypeMismatch && e.message.contains("`weights[0]`"), "{e}");
    let mut bufs = good.clone();
    assert!(opt.step_weights(&acc, &mut weights_of(&mut bufs), Some(&comm)).unwrap());
    check_seen(&tensors, &formats, &[vec![(bufs, held_masters(&opt, tensors.len()))]], "one shard");
}

/// A tensor large enough to be stepped on several threads: the FP8 weights (the amax found on
/// threads too) are the one-thread run's and the reference's, at 1, 2 and 3 threads.
#[test]
fn every_thread_count_writes_the_same_fp8_weights() {
    let mut rng = Rng::fresh("every_thread_count_writes_the_same_fp8_weights");
    let tensors = [TensorDesc { numel: 600_001, dtype: Dtype::Bf16 }];
    let formats = [WeightFormat::E4m3Tensorwise];
    let mut initial = model(&mut rng, &tensors);
    // The amax in the first thread's half, so that a half's amax lost would show.
    if let Weights::Half(_, v) = &mut initial[0] {
        v[7] = to_bf16(8.0);
    }
    let d = data(&mut rng, &tensors, 1, 3);
    let config = OptimizerConfig { lr: 0.01, ..Default::default() };
    let runs: Vec<Vec<Seen>> = [1, 2, 3]
        .into_iter()
        .map(|threads| {
            let sharding = Sharding::ReduceScatter { shards: 1, rank: 0 };
            let cfg = AccumulatorConfig { sharding, threads, ..Default::default() };
            let acc = Accumulator::new(cfg, &tensors).unwrap();
            let opt = make(&acc, config, StateFormat::default(), &formats, &initial);
            let comm = LocalComm::group(1).unwrap().pop().unwrap();
            let mut bufs = vec![Buf::new(formats[0], &initial[0], tensors[0].numel)];
            let mut seen = Vec::new();
            for g in &d[0] {
                add(&acc, &fixed_scaler(), &tensors, g);
                acc.sync(Some(&comm)).unwrap();
                opt.step_weights(&acc, &mut weights_of(&mut bufs), Some(&comm)).unwrap();
                seen.push((bufs.clone(), held_masters(&opt, 1)));
            }
            seen
        })
        .collect();
    for (t, run) in runs.iter().enumerate() {
        check_seen(&tensors, &formats, std::slice::from_ref(run), "threads");
        assert!(run == &runs[0], "{} threads against one", t + 1);
    }
}
