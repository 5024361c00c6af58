//! The optimizer step's throughput next to its floor measured in the same run: a plain loop over
//! the same bytes (read the FP32 gradient, read and write the master and the state, write the
//! model's weight) with one add per value and nothing else. AdamW moves 30 bytes per element with
//! bf16 weights (gradient 4, master and two moments 24, weight 2), SGD with momentum 22.
//!
//! A second table times AdamW (nearest rounding) in each state format against the FP32 step of
//! the same run: bf16 moments move 22 bytes per element, remainder masters 28 (the weight is read
//! back as well as written), both 20.
//!
//! A third table times the boundary plus the step, clipping every window: `sync` then the step
//! (norm 4 + clip 8 + step 30 = 42 bytes per element), `sync_for_step` then the step (the clip
//! applied inside the step: 34), and that after `add_final` (the norm measured in the last add:
//! 30), in turns, next to the floors of 34 bytes (a plain read of the gradient, then the step's
//! floor) and of 30 (the step's floor alone), on 1 and 2 threads, with each way's last add timed
//! apart; with bf16 moments the bytes are 34, 26 and 22, the floors' moments bf16 too.
//!
//! A fourth table times a ZeRO step over one in-process rank (no all-gather: the step's own
//! cost) and two (AdamW, FP32 state, each rank stepping its half and all-gathering) with bf16 weights against FP8 weights (E4M3 with a
//! scale per tensor, and MXFP8), in turns: the FP8 step first steps copies of its state to find
//! the new masters' amax (reading the gradient and the state once more), exchanges one word per
//! tensor, then steps and quantises, and its all-gather moves 1 (MXFP8: 1 + 1/32) bytes per
//! element instead of 2.
//!
//! `cargo bench --bench optimizer` (`-- fp8`: the fourth table only).

mod common;

use std::hint::black_box;
use std::time::Instant;

use common::{gradients, median};
use gradacc::half::slice::HalfFloatSliceExt;
use gradacc::simd::{self, Isa};
use gradacc::{
    Accumulator, AccumulatorConfig, Algorithm, Dtype, Grad, GradMut, MasterFormat, MomentFormat,
    Optimizer, OptimizerConfig, Rounding, Scaler, ScalerConfig, StateFormat, TensorDesc,
    WeightFormat, WeightMut,
};

const LEN: usize = 16 << 20;
const REPEATS: usize = 7;

/// The floor: the step's traffic, one add per value, on `isa`. At the baseline x86-64 width the
/// loop does not keep the memory busy (on the AVX-512 machine the AdamW traffic took 1.6 times
/// as long with SSE2 as with AVX-512), so it would be no floor for a step compiled wider.
fn floor(
    isa: Isa,
    g: &[f32],
    master: &mut [f32],
    m: &mut [f32],
    v: Option<&mut [f32]>,
    w: &mut [u16],
) {
    match isa {
        // SAFETY: `active_isa` only reports paths the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { floor_avx512(g, master, m, v, w) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { floor_avx2(g, master, m, v, w) },
        _ => traffic(g, master, m, v, w),
    }
}

/// [`traffic`] at AVX-512's width.
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn floor_avx512(
    g: &[f32],
    master: &mut [f32],
    m: &mut [f32],
    v: Option<&mut [f32]>,
    w: &mut [u16],
) {
    traffic(g, master, m, v, w)
}

/// [`traffic`] at AVX2's width.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn floor_avx2(
    g: &[f32],
    master: &mut [f32],
    m: &mut [f32],
    v: Option<&mut [f32]>,
    w: &mut [u16],
) {
    traffic(g, master, m, v, w)
}

/// The step's traffic, one add per value.
#[inline(always)]
fn traffic(g: &[f32], master: &mut [f32], m: &mut [f32], v: Option<&mut [f32]>, w: &mut [u16]) {
    match v {
        Some(v) => {
            for ((((g, x), m), v), w) in g.iter().zip(master).zip(m).zip(v).zip(w) {
                *m += g;
                *v += g;
                *x += *m + *v;
                *w = (x.to_bits() >> 16) as u16;
            }
        }
        None => {
            for (((g, x), m), w) in g.iter().zip(master).zip(m).zip(w) {
                *m += g;
                *x += *m;
                *w = (x.to_bits() >> 16) as u16;
            }
        }
    }
}

fn main() {
    if std::env::args().any(|a| a == "fp8") {
        return fp8_gather();
    }
    let isa = simd::active_isa();
    println!(
        "gradacc optimizer step, {LEN} elements, bf16 weights, one thread, {} path, median of {REPEATS} after a warm-up\n",
        isa.name()
    );
    println!("| algorithm | rounding | bytes/element | ns/element | GB/s | floor ns/element | ratio to floor |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    let tensors = [TensorDesc { numel: LEN, dtype: Dtype::Bf16 }];
    let (_, _, bf16_grad) = gradients(LEN);
    let scaler =
        Scaler::new(ScalerConfig { init_scale: 1.0, dynamic: false, ..Default::default() })
            .unwrap();
    let cases = [
        (Algorithm::adamw(), 30usize),
        (Algorithm::Sgd { momentum: 0.9, dampening: 0.0, nesterov: false, weight_decay: 0.0 }, 22),
    ];
    for (algorithm, bytes) in cases {
        for rounding in [Rounding::NearestEven, Rounding::Stochastic { seed: 7 }] {
            let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
            let mut weights = bf16_grad.clone();
            let config = OptimizerConfig { algorithm, lr: 1e-4, rounding };
            let opt = Optimizer::new(&acc, config, &[], &[Grad::Bf16(&weights)]).unwrap();
            let (mut g, mut x, mut m, mut v) =
                (vec![0.1f32; LEN], vec![0.5f32; LEN], vec![0.0f32; LEN], vec![0.0f32; LEN]);
            let adam = matches!(algorithm, Algorithm::AdamW { .. });
            let mut times = Vec::new();
            let mut floors = Vec::new();
            for r in 0..=REPEATS {
                acc.add(&scaler, &[Grad::Bf16(&bf16_grad)][..], 1).unwrap();
                acc.sync(None).unwrap();
                let t = Instant::now();
                opt.step(&acc, &mut [GradMut::Bf16(&mut weights)], None).unwrap();
                let step = t.elapsed().as_secs_f64();
                g[r] += 1.0;
                let t = Instant::now();
                floor(
                    isa,
                    &g,
                    &mut x,
                    &mut m,
                    adam.then_some(&mut v[..]),
                    weights.reinterpret_cast_mut(),
                );
                let f = t.elapsed().as_secs_f64();
                black_box((&x, &m, &v));
                if r > 0 {
                    times.push(step);
                    floors.push(f);
                }
            }
            let (t, f) = (median(times) / LEN as f64 * 1e9, median(floors) / LEN as f64 * 1e9);
            let name = if adam { "AdamW" } else { "SGD, momentum" };
            let rounding = if rounding == Rounding::NearestEven { "nearest" } else { "stochastic" };
            println!(
                "| {name} | {rounding} | {bytes} | {t:.3} | {:.1} | {f:.3} | {:.2} |",
                bytes as f64 / t,
                t / f
            );
        }
    }
    formats(&tensors, &bf16_grad, &scaler);
    boundary_and_step(&tensors, &bf16_grad, &scaler, isa);
    fp8_gather();
}

/// The ZeRO step over one rank (no all-gather: the FP8 step's own cost) and two, with bf16
/// against FP8 weights, rank 0's times, in turns.
fn fp8_gather() {
    println!("\n| ranks | weights on the all-gather | gathered bytes/element | ns/element | ratio to bf16 |");
    println!("|---:|---|---:|---:|---:|");
    for ranks in [1, 2] {
        fp8_gather_over(ranks);
    }
}

fn fp8_gather_over(ranks: usize) {
    let tensors = [TensorDesc { numel: LEN, dtype: Dtype::Bf16 }];
    let (_, _, grad) = gradients(LEN);
    let formats = [WeightFormat::Model, WeightFormat::E4m3Tensorwise, WeightFormat::Mxfp8];
    let comms = gradacc::LocalComm::group(ranks).unwrap();
    let times: Vec<Vec<Vec<f64>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let grad = &grad;
                let tensors = &tensors;
                scope.spawn(move || {
                    let scaler = Scaler::new(ScalerConfig {
                        init_scale: 1.0,
                        dynamic: false,
                        ..Default::default()
                    })
                    .unwrap();
                    let sharding = gradacc::Sharding::ReduceScatter { shards: ranks, rank };
                    let cfg = AccumulatorConfig { sharding, threads: 1, ..Default::default() };
                    let config = OptimizerConfig { lr: 1e-4, ..Default::default() };
                    let runs: Vec<_> = formats
                        .iter()
                        .map(|f| {
                            let acc = Accumulator::new(cfg, tensors).unwrap();
                            let views = [Grad::Bf16(grad)];
                            let b = Optimizer::builder(&acc).config(config).weights(&views);
                            let opt = b.weight_formats(std::slice::from_ref(f)).build().unwrap();
                            (acc, opt)
                        })
                        .collect();
                    let mut w = grad.clone();
                    let (mut codes, mut scale, mut scales) =
                        (vec![0u8; LEN], vec![0f32; 1], vec![0u8; LEN.div_ceil(32)]);
                    let mut times = vec![Vec::new(); formats.len()];
                    for r in 0..=REPEATS {
                        for (k, (acc, opt)) in runs.iter().enumerate() {
                            acc.add(&scaler, &[Grad::Bf16(grad)][..], 1).unwrap();
                            acc.sync(Some(&comm)).unwrap();
                            let mut weights = [match formats[k] {
                                WeightFormat::Model => WeightMut::Model(GradMut::Bf16(&mut w)),
                                WeightFormat::E4m3Tensorwise => {
                                    WeightMut::E4m3 { codes: &mut codes, scale: &mut scale }
                                }
                                WeightFormat::Mxfp8 => {
                                    WeightMut::Mxfp8 { codes: &mut codes, scales: &mut scales }
                                }
                            }];
                            let t = Instant::now();
                            opt.step_weights(acc, &mut weights, Some(&comm)).unwrap();
                            if r > 0 {
                                times[k].push(t.elapsed().as_secs_f64());
                            }
                        }
                    }
                    times
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ns = |k: usize| median(times[0][k].clone()) / LEN as f64 * 1e9;
    for (k, (name, bytes)) in
        [("bf16", "2"), ("E4M3, a scale per tensor", "1"), ("MXFP8", "1.03")].iter().enumerate()
    {
        println!("| {ranks} | {name} | {bytes} | {:.3} | {:.2} |", ns(k), ns(k) / ns(0));
    }
}

/// The boundary with clipping plus the AdamW step three ways, each timed in turn: clip-then-step,
/// the clip inside the step, and that after a last add that measured the norm (`add_final`),
/// with the floors of 34 bytes (a read of the gradient, then the step's floor) and of 30 (the
/// step's floor alone). The adds are timed apart: `add_final`'s measuring is in cache, but not
/// free.
fn boundary_and_step(
    tensors: &[TensorDesc],
    grad: &[gradacc::half::bf16],
    scaler: &Scaler,
    isa: Isa,
) {
    println!("\n| threads | AdamW state | bytes/element (sync + step, fused, folded) | sync + step ns/element | sync_for_step + step ns/element | add_final, sync_for_step + step ns/element | floor ns/element | step floor ns/element | add ns/element | add_final ns/element | fused / floor | folded / step floor |");
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let moments = MomentFormat::Bf16 { seed: 3 };
    let formats = [
        ("FP32", StateFormat::default(), "42, 34, 30"),
        ("bf16 moments", StateFormat { moments, ..Default::default() }, "34, 26, 22"),
    ];
    /// The three ways: whether the last add measures, whether the clip waits for the step.
    const WAYS: [(bool, bool); 3] = [(false, false), (false, true), (true, true)];
    for threads in [1, 2] {
        for (name, format, bytes) in formats {
            let half = format.moments != MomentFormat::F32;
            let cfg = AccumulatorConfig { max_grad_norm: 1e-3, threads, ..Default::default() };
            let config = OptimizerConfig { lr: 1e-4, ..Default::default() };
            let make = |weights: &[gradacc::half::bf16]| {
                let acc = Accumulator::new(cfg, tensors).unwrap();
                let views = [Grad::Bf16(weights)];
                let opt = Optimizer::builder(&acc).config(config).state(format).weights(&views);
                let opt = opt.build().unwrap();
                (acc, opt)
            };
            let mut weights = [grad.to_vec(), grad.to_vec(), grad.to_vec()];
            let runs: Vec<_> = weights.iter().map(|w| make(w)).collect();
            let (mut g, mut state) = (vec![0.1f32; LEN], FloorState::new());
            let mut steps: [Vec<f64>; 3] = Default::default();
            let mut adds: [Vec<f64>; 3] = Default::default();
            let (mut floors, mut step_floors) = (Vec::new(), Vec::new());
            for r in 0..=REPEATS {
                for (k, ((acc, opt), w)) in runs.iter().zip(&mut weights).enumerate() {
                    let (last, for_step) = WAYS[k];
                    let grads = [Grad::Bf16(grad)];
                    let t = Instant::now();
                    match last {
                        true => acc.add_final(scaler, &grads[..], 1).unwrap(),
                        false => acc.add(scaler, &grads[..], 1).unwrap(),
                    }
                    let added = t.elapsed().as_secs_f64();
                    let t = Instant::now();
                    match for_step {
                        true => acc.sync_for_step(None).unwrap(),
                        false => acc.sync(None).unwrap(),
                    };
                    opt.step(acc, &mut [GradMut::Bf16(w)], None).unwrap();
                    if r > 0 {
                        steps[k].push(t.elapsed().as_secs_f64());
                        adds[k].push(added);
                    }
                }
                g[r] += 1.0;
                for (norm, out) in [(true, &mut floors), (false, &mut step_floors)] {
                    let t = Instant::now();
                    state.run(isa, threads, &g, half, norm);
                    if r > 0 {
                        out.push(t.elapsed().as_secs_f64());
                    }
                }
            }
            let ns = |t: &[f64]| median(t.to_vec()) / LEN as f64 * 1e9;
            let [p, f, d] = [ns(&steps[0]), ns(&steps[1]), ns(&steps[2])];
            let (fl, sf) = (ns(&floors), ns(&step_floors));
            let (a, af) = (ns(&adds[1]), ns(&adds[2]));
            println!(
                "| {threads} | {name} | {bytes} | {p:.3} | {f:.3} | {d:.3} | {fl:.3} | {sf:.3} | {a:.3} | {af:.3} | {:.2} | {:.2} |",
                f / fl,
                d / sf
            );
        }
    }
}

/// What the fused boundary's floor moves besides the gradient: the masters, FP32 and bf16
/// moments (one pair is used), the weights.
struct FloorState {
    x: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    m16: Vec<u16>,
    v16: Vec<u16>,
    w: Vec<u16>,
}

impl FloorState {
    fn new() -> Self {
        let (f, h) = (vec![0.0f32; LEN], vec![0u16; LEN]);
        FloorState { x: vec![0.5; LEN], m: f.clone(), v: f, m16: h.clone(), v16: h.clone(), w: h }
    }

    /// The floor on `threads` threads, each over its part: read the gradient once (the norm)
    /// when `norm`, then the step's floor, with bf16 moments when `half`.
    fn run(&mut self, isa: Isa, threads: usize, g: &[f32], half: bool, norm: bool) {
        let part = g.len().div_ceil(threads);
        let FloorState { x, m, v, m16, v16, w } = self;
        std::thread::scope(|s| {
            let parts = g
                .chunks(part)
                .zip(x.chunks_mut(part))
                .zip(m.chunks_mut(part).zip(v.chunks_mut(part)))
                .zip(m16.chunks_mut(part).zip(v16.chunks_mut(part)))
                .zip(w.chunks_mut(part));
            for ((((g, x), (m, v)), (m16, v16)), w) in parts {
                s.spawn(move || {
                    if norm {
                        let mut sums = vec![0.0; simd::blocks(g.len())];
                        simd::block_sum_squares(g, &mut sums, 1);
                        black_box(&sums);
                    }
                    match half {
                        true => floor16(isa, g, x, m16, v16, w),
                        false => floor(isa, g, x, m, Some(v), w),
                    }
                });
            }
        });
        black_box(&*self);
    }
}

/// [`floor`] with bf16 moments (their bits): 22 bytes per element.
fn floor16(isa: Isa, g: &[f32], x: &mut [f32], m: &mut [u16], v: &mut [u16], w: &mut [u16]) {
    match isa {
        // SAFETY: `active_isa` only reports paths the CPU supports.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { floor16_avx512(g, x, m, v, w) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { floor16_avx2(g, x, m, v, w) },
        _ => traffic16(g, x, m, v, w),
    }
}

/// [`traffic16`] at AVX-512's width.
///
/// # Safety
/// The CPU must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn floor16_avx512(g: &[f32], x: &mut [f32], m: &mut [u16], v: &mut [u16], w: &mut [u16]) {
    traffic16(g, x, m, v, w)
}

/// [`traffic16`] at AVX2's width.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn floor16_avx2(g: &[f32], x: &mut [f32], m: &mut [u16], v: &mut [u16], w: &mut [u16]) {
    traffic16(g, x, m, v, w)
}

/// [`traffic`] with bf16 moments: one add per value, on the moments' bits.
#[inline(always)]
fn traffic16(g: &[f32], x: &mut [f32], m: &mut [u16], v: &mut [u16], w: &mut [u16]) {
    for ((((g, x), m), v), w) in g.iter().zip(x).zip(m).zip(v).zip(w) {
        let top = (g.to_bits() >> 16) as u16;
        *m = m.wrapping_add(top);
        *v = v.wrapping_add(top);
        *x += f32::from_bits(((*m as u32) << 16) | *v as u32);
        *w = (x.to_bits() >> 16) as u16;
    }
}

/// AdamW in each state format, each step timed in turn with the FP32 one.
fn formats(tensors: &[TensorDesc], grad: &[gradacc::half::bf16], scaler: &Scaler) {
    println!("\n| AdamW state | bytes/element | ns/element | GB/s | ratio to the FP32 step |");
    println!("|---|---:|---:|---:|---:|");
    let moments = MomentFormat::Bf16 { seed: 3 };
    let cases = [
        ("bf16 moments", 22usize, StateFormat { masters: MasterFormat::F32, moments }),
        (
            "remainder masters",
            28,
            StateFormat { masters: MasterFormat::Bf16Remainder, ..Default::default() },
        ),
        ("both", 20, StateFormat { masters: MasterFormat::Bf16Remainder, moments }),
    ];
    let config = OptimizerConfig { lr: 1e-4, ..Default::default() };
    for (name, bytes, format) in cases {
        let make = |weights: &[gradacc::half::bf16], format| {
            let acc = Accumulator::new(AccumulatorConfig::default(), tensors).unwrap();
            let views = [Grad::Bf16(weights)];
            let opt = Optimizer::builder(&acc).config(config).state(format).weights(&views);
            let opt = opt.build().unwrap();
            (acc, opt)
        };
        let (mut w0, mut w1) = (grad.to_vec(), grad.to_vec());
        let ((a0, o0), (a1, o1)) = (make(&w0, StateFormat::default()), make(&w1, format));
        let (mut base, mut times) = (Vec::new(), Vec::new());
        for r in 0..=REPEATS {
            for (acc, opt, w, out) in
                [(&a0, &o0, &mut w0, &mut base), (&a1, &o1, &mut w1, &mut times)]
            {
                acc.add(scaler, &[Grad::Bf16(grad)][..], 1).unwrap();
                acc.sync(None).unwrap();
                let t = Instant::now();
                opt.step(acc, &mut [GradMut::Bf16(w)], None).unwrap();
                if r > 0 {
                    out.push(t.elapsed().as_secs_f64());
                }
            }
        }
        let (b, t) = (median(base) / LEN as f64 * 1e9, median(times) / LEN as f64 * 1e9);
        println!("| {name} | {bytes} | {t:.3} | {:.1} | {:.2} |", bytes as f64 / t, t / b);
    }
}
