//! The error study of the optimizer's state formats (docs/optimizer.md, "Smaller state"): AdamW
//! over bf16 weights for 2,000 steps of two problems, with FP32 state, bf16 or 8-bit moments,
//! remainder masters, no masters (the weights rounded stochastically) and their combinations,
//! beside an AdamW in float64 throughout (f64 weights, gradients and state).
//! Prints, per problem and format, the final loss (at the model's bf16 weights) and the relative
//! distance of the FP32 masters to the FP32 state's run and to the float64 run's weights, over
//! several seeds.
//!
//! `cargo run --release --example optimizer_formats [steps] [seeds]` (default 2000 and 3).
//!
//! The problems: the demo's MLP (16 -> 448 tanh -> 1, 8,065 parameters) on a synthetic regression
//! task, and a linear least-squares fit whose 256 features span six decades of scale, so that its
//! gradients (and AdamW's second moments) span six (twelve) decades. Each gradient is computed in
//! f64 from the model's weights (bf16, widened) and handed to the accumulator in f32.

use gradacc::{
    join_master, Accumulator, AccumulatorConfig, Algorithm, Dtype, Grad, GradMut, MasterFormat,
    MomentFormat, Optimizer, OptimizerConfig, Rounding, Scaler, ScalerConfig, Slot, StateFormat,
    TensorDesc,
};

/// SplitMix64, for data that is the same in every run of a seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * ((self.next() >> 11) as f64 / (1u64 << 53) as f64)
    }

    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(1e-12, 1.0), self.uniform(0.0, 1.0));
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

/// A problem: its tensors' sizes, initial weights, and the loss and gradient of a batch.
trait Problem {
    fn sizes(&self) -> Vec<usize>;
    fn init(&self, rng: &mut Rng) -> Vec<f64>;
    /// Loss and gradient (flat, tensor after tensor) at `w` over the items `batch`.
    fn grad(&self, w: &[f64], batch: &[usize]) -> (f64, Vec<f64>);
    fn items(&self) -> usize;
    fn lr(&self) -> f64;
}

const IN: usize = 16;
const HIDDEN: usize = 448;

/// The demo's MLP on a regression task from a fixed teacher.
struct Mlp {
    x: Vec<[f64; IN]>,
    y: Vec<f64>,
}

impl Mlp {
    fn new(rng: &mut Rng) -> Mlp {
        let a: Vec<f64> = (0..IN).map(|_| rng.normal() * 0.5).collect();
        let x: Vec<[f64; IN]> =
            (0..512).map(|_| std::array::from_fn(|_| rng.uniform(-1.0, 1.0))).collect();
        let y = x
            .iter()
            .map(|x| {
                let s: f64 = x.iter().zip(&a).map(|(x, a)| x * a).sum();
                s.sin() + 0.5 * (x[0] * x[1]).tanh()
            })
            .collect();
        Mlp { x, y }
    }
}

impl Problem for Mlp {
    fn sizes(&self) -> Vec<usize> {
        vec![HIDDEN * IN, HIDDEN, HIDDEN, 1]
    }

    fn init(&self, rng: &mut Rng) -> Vec<f64> {
        let mut w: Vec<f64> = (0..HIDDEN * IN).map(|_| rng.normal() / (IN as f64).sqrt()).collect();
        w.extend((0..HIDDEN).map(|_| 0.0));
        w.extend((0..HIDDEN).map(|_| rng.normal() / (HIDDEN as f64).sqrt()));
        w.push(0.0);
        w
    }

    fn grad(&self, w: &[f64], batch: &[usize]) -> (f64, Vec<f64>) {
        let (w1, rest) = w.split_at(HIDDEN * IN);
        let (b1, rest) = rest.split_at(HIDDEN);
        let (w2, b2) = rest.split_at(HIDDEN);
        let mut g = vec![0.0; w.len()];
        let mut loss = 0.0;
        let scale = 1.0 / batch.len() as f64;
        let mut h = [0.0f64; HIDDEN];
        for &k in batch {
            let x = &self.x[k];
            for j in 0..HIDDEN {
                let z: f64 = (0..IN).map(|i| w1[j * IN + i] * x[i]).sum::<f64>() + b1[j];
                h[j] = z.tanh();
            }
            let out: f64 = (0..HIDDEN).map(|j| w2[j] * h[j]).sum::<f64>() + b2[0];
            let d = out - self.y[k];
            loss += 0.5 * d * d * scale;
            let dy = d * scale;
            for j in 0..HIDDEN {
                let dz = dy * w2[j] * (1.0 - h[j] * h[j]);
                for i in 0..IN {
                    g[j * IN + i] += dz * x[i];
                }
                g[HIDDEN * IN + j] += dz;
                g[HIDDEN * IN + HIDDEN + j] += dy * h[j];
            }
            g[HIDDEN * IN + 2 * HIDDEN] += dy;
        }
        (loss, g)
    }

    fn items(&self) -> usize {
        self.x.len()
    }

    fn lr(&self) -> f64 {
        2e-3
    }
}

const FEATURES: usize = 256;

/// Least squares over features whose scales span 10^-3 .. 10^3: the gradient of feature j scales
/// as its feature.
struct WideRange {
    scale: Vec<f64>,
    x: Vec<Vec<f64>>,
    y: Vec<f64>,
}

impl WideRange {
    fn new(rng: &mut Rng) -> WideRange {
        let scale: Vec<f64> = (0..FEATURES)
            .map(|j| 10f64.powf(-3.0 + 6.0 * j as f64 / (FEATURES - 1) as f64))
            .collect();
        let teacher: Vec<f64> = scale.iter().map(|_| rng.normal()).collect();
        let x: Vec<Vec<f64>> =
            (0..1024).map(|_| scale.iter().map(|s| rng.normal() * s).collect()).collect();
        let y = x
            .iter()
            .map(|x| x.iter().zip(&teacher).map(|(x, t)| x * t).sum::<f64>() + 0.1 * rng.normal())
            .collect();
        WideRange { scale, x, y }
    }
}

impl Problem for WideRange {
    fn sizes(&self) -> Vec<usize> {
        vec![FEATURES]
    }

    fn init(&self, rng: &mut Rng) -> Vec<f64> {
        self.scale.iter().map(|_| 0.1 * rng.normal()).collect()
    }

    fn grad(&self, w: &[f64], batch: &[usize]) -> (f64, Vec<f64>) {
        let mut g = vec![0.0; FEATURES];
        let mut loss = 0.0;
        let scale = 1.0 / batch.len() as f64;
        for &k in batch {
            let d = self.x[k].iter().zip(w).map(|(x, w)| x * w).sum::<f64>() - self.y[k];
            loss += 0.5 * d * d * scale;
            for (g, x) in g.iter_mut().zip(&self.x[k]) {
                *g += d * scale * x;
            }
        }
        (loss, g)
    }

    fn items(&self) -> usize {
        self.x.len()
    }

    fn lr(&self) -> f64 {
        1e-2
    }
}

const BATCH: usize = 32;
const BETAS: (f64, f64) = (0.9, 0.999);
const EPS: f64 = 1e-8;
const WEIGHT_DECAY: f64 = 0.01;

/// The items of step `t`'s batch (the same in every run of a seed).
fn batch(seed: u64, t: usize, items: usize) -> Vec<usize> {
    let mut rng = Rng(seed ^ (t as u64).wrapping_mul(0x2545_f491_4f6c_dd1d));
    (0..BATCH).map(|_| (rng.next() % items as u64) as usize).collect()
}

fn bf16(x: f64) -> u16 {
    gradacc::half::bf16::from_f32(x as f32).to_bits()
}

fn widen(b: u16) -> f64 {
    gradacc::half::bf16::from_bits(b).to_f64()
}

/// One run through gradacc with `format`: the final bf16 weights, widened, and the FP32 masters
/// (joined from the weights and the remainders with remainder masters; the weights without
/// masters, whose weights are rounded stochastically).
fn run(
    p: &dyn Problem,
    init: &[f64],
    seed: u64,
    steps: usize,
    format: StateFormat,
) -> (Vec<f64>, Vec<f64>) {
    let sizes = p.sizes();
    let descs: Vec<TensorDesc> =
        sizes.iter().map(|&numel| TensorDesc { numel, dtype: Dtype::F32 }).collect();
    let acc = Accumulator::new(AccumulatorConfig::default(), &descs).unwrap();
    let scaler =
        Scaler::new(ScalerConfig { init_scale: 1.0, dynamic: false, ..Default::default() })
            .unwrap();
    let mut weights: Vec<Vec<u16>> = Vec::new();
    let mut at = 0;
    for &n in &sizes {
        weights.push(init[at..at + n].iter().map(|&x| bf16(x)).collect());
        at += n;
    }
    let (beta1, beta2) = (BETAS.0 as f32, BETAS.1 as f32);
    let algorithm =
        Algorithm::AdamW { beta1, beta2, eps: EPS as f32, weight_decay: WEIGHT_DECAY as f32 };
    let rounding = match format.masters {
        MasterFormat::None => Rounding::Stochastic { seed: 1 },
        _ => Rounding::NearestEven,
    };
    let config = OptimizerConfig { algorithm, lr: p.lr() as f32, rounding };
    let views: Vec<Grad<'_>> = weights.iter().map(|w| Grad::bf16_bits(w)).collect();
    let opt =
        Optimizer::builder(&acc).config(config).state(format).weights(&views).build().unwrap();
    for t in 0..steps {
        let w: Vec<f64> = weights.iter().flatten().map(|&b| widen(b)).collect();
        let (_, g) = p.grad(&w, &batch(seed, t, p.items()));
        let g: Vec<f32> = g.iter().map(|&x| x as f32).collect();
        let mut at = 0;
        let parts: Vec<&[f32]> = sizes
            .iter()
            .map(|&n| {
                at += n;
                &g[at - n..at]
            })
            .collect();
        let grads: Vec<Grad<'_>> = parts.iter().map(|p| Grad::F32(p)).collect();
        acc.add(&scaler, &grads[..], 1).unwrap();
        acc.sync(None).unwrap();
        let mut muts: Vec<GradMut<'_>> =
            weights.iter_mut().map(|w| GradMut::bf16_bits(w)).collect();
        opt.step(&acc, &mut muts, None).unwrap();
    }
    let mut masters = Vec::new();
    for (i, w) in weights.iter().enumerate() {
        match format.masters {
            MasterFormat::Bf16Remainder => {
                let (_, rem) = opt.read(i, Slot::Remainders).unwrap();
                masters.extend(w.iter().zip(rem).map(|(&b, r)| join_master(b, r as u16) as f64));
            }
            MasterFormat::None => masters.extend(w.iter().map(|&b| widen(b))),
            MasterFormat::F32 => {
                masters.extend(opt.read(i, Slot::Weights).unwrap().1.iter().map(|&x| x as f64))
            }
        }
    }
    (weights.iter().flatten().map(|&b| widen(b)).collect(), masters)
}

/// AdamW (torch.optim.AdamW's rule) in float64 throughout.
fn reference(p: &dyn Problem, init: &[f64], seed: u64, steps: usize) -> Vec<f64> {
    let mut w = init.to_vec();
    let (mut m, mut v) = (vec![0.0; w.len()], vec![0.0; w.len()]);
    let (b1, b2) = (BETAS.0 as f32 as f64, BETAS.1 as f32 as f64);
    let lr = p.lr() as f32 as f64;
    for t in 0..steps {
        let (_, g) = p.grad(&w, &batch(seed, t, p.items()));
        let n = (t + 1) as i32;
        let (c1, c2) = (1.0 - b1.powi(n), (1.0 - b2.powi(n)).sqrt());
        for k in 0..w.len() {
            w[k] *= 1.0 - lr * (WEIGHT_DECAY as f32 as f64);
            m[k] = b1 * m[k] + (1.0 - b1) * g[k];
            v[k] = b2 * v[k] + (1.0 - b2) * g[k] * g[k];
            w[k] -= lr / c1 * m[k] / (v[k].sqrt() / c2 + EPS as f32 as f64);
        }
    }
    w
}

fn distance(a: &[f64], b: &[f64]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(a, b)| (a - b) * (a - b)).sum();
    let n: f64 = b.iter().map(|b| b * b).sum();
    (d / n).sqrt()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let steps: usize = args.next().map_or(2000, |s| s.parse().expect("steps"));
    let seeds: u64 = args.next().map_or(3, |s| s.parse().expect("seeds"));
    let formats = [
        ("FP32 masters, FP32 moments", StateFormat::default()),
        (
            "FP32 masters, bf16 moments",
            StateFormat { masters: MasterFormat::F32, moments: MomentFormat::Bf16 { seed: 1 } },
        ),
        (
            "remainder masters, FP32 moments",
            StateFormat { masters: MasterFormat::Bf16Remainder, moments: MomentFormat::F32 },
        ),
        (
            "remainder masters, bf16 moments",
            StateFormat {
                masters: MasterFormat::Bf16Remainder,
                moments: MomentFormat::Bf16 { seed: 1 },
            },
        ),
        (
            "FP32 masters, 8-bit blockwise moments",
            StateFormat { masters: MasterFormat::F32, moments: MomentFormat::Int8Blockwise },
        ),
        (
            "remainder masters, 8-bit blockwise moments",
            StateFormat {
                masters: MasterFormat::Bf16Remainder,
                moments: MomentFormat::Int8Blockwise,
            },
        ),
        (
            "no masters, FP32 moments",
            StateFormat { masters: MasterFormat::None, moments: MomentFormat::F32 },
        ),
        (
            "no masters, bf16 moments",
            StateFormat { masters: MasterFormat::None, moments: MomentFormat::Bf16 { seed: 1 } },
        ),
        (
            "no masters, 8-bit blockwise moments",
            StateFormat { masters: MasterFormat::None, moments: MomentFormat::Int8Blockwise },
        ),
    ];
    println!("{steps} steps of AdamW, bf16 weights, {seeds} seeds: mean (worst) over the seeds");
    println!("| problem | state | B/param of state | final loss | distance to FP32 state | distance to float64 |");
    println!("|---|---|---:|---:|---:|---:|");
    for name in ["MLP", "wide range"] {
        let mut rows = vec![(Vec::new(), Vec::new(), Vec::new()); formats.len()];
        let mut ref_loss = Vec::new();
        for s in 0..seeds {
            let mut rng = Rng(1000 + s);
            let p: Box<dyn Problem> = if name == "MLP" {
                Box::new(Mlp::new(&mut rng))
            } else {
                Box::new(WideRange::new(&mut rng))
            };
            let init = p.init(&mut rng);
            let all: Vec<usize> = (0..p.items()).collect();
            let exact = reference(&*p, &init, s, steps);
            ref_loss.push(p.grad(&exact, &all).0);
            let fp32 = run(&*p, &init, s, steps, formats[0].1);
            for (f, (_, format)) in formats.iter().enumerate() {
                let (w, masters) =
                    if f == 0 { fp32.clone() } else { run(&*p, &init, s, steps, *format) };
                rows[f].0.push(p.grad(&w, &all).0);
                rows[f].1.push(distance(&masters, &fp32.1));
                rows[f].2.push(distance(&masters, &exact));
            }
        }
        let stat = |v: &[f64]| {
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            let worst = v.iter().cloned().fold(f64::MIN, f64::max);
            format!("{mean:.4e} ({worst:.4e})")
        };
        println!("| {name} | float64 reference | — | {} | — | — |", stat(&ref_loss));
        for (f, (label, format)) in formats.iter().enumerate() {
            let (loss, to_fp32, to_ref) = &rows[f];
            println!(
                "| {name} | {label} | {:.3} | {} | {} | {} |",
                format.state_bytes(2),
                stat(loss),
                stat(to_fp32),
                stat(to_ref)
            );
        }
    }
}
