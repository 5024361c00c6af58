//! A 2-layer MLP trained data-parallel: each rank (a thread) runs candle's forward and backward
//! in half precision on micro-batches of different sizes, gradacc accumulates the 16-bit
//! gradients into FP32 masters and all-reduces them once per step, and AdamW steps FP32 master
//! Vars, from which the half-precision weights are refreshed: candle's AdamW over master Vars, or
//! gradacc's, which keeps the masters itself and writes the half-precision weights in its pass.

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{linear, AdamW, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use gradacc::{
    join_master, split_master, Accumulator, AccumulatorConfig, Algorithm, Communicator, Grad,
    GradMut, MasterFormat, MomentFormat, OptimizerConfig, Scaler, ScalerConfig, Slot, StateFormat,
    SyncInfo,
};

use crate::adapter::{self, err};

pub const IN: usize = 8;
pub const HIDDEN: usize = 16;
pub const OUT: usize = 4;

pub struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    pub fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Mlp { fc1: linear(IN, HIDDEN, vb.pp("fc1"))?, fc2: linear(HIDDEN, OUT, vb.pp("fc2"))? })
    }

    /// The mean squared error over the batch, computed in f32 whatever the model's dtype.
    pub fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Tensor> {
        let pred = self.fc2.forward(&self.fc1.forward(x)?.relu()?)?.to_dtype(DType::F32)?;
        (pred - y)?.sqr()?.mean_all()
    }
}

/// A freshly initialised model of `dtype` and its Vars, sorted by name.
pub fn build(dtype: DType) -> Result<(Mlp, Vec<Var>)> {
    let map = VarMap::new();
    let mlp = Mlp::new(VarBuilder::from_varmap(&map, dtype, &Device::Cpu))?;
    Ok((mlp, adapter::sorted_vars(&map)))
}

/// One micro-batch: inputs in the model's dtype, f32 targets, and its item count.
pub struct Batch {
    pub x: Tensor,
    pub y: Tensor,
    pub items: usize,
}

/// Deterministic data: `items` rows of a fixed smooth teacher, inputs representable in f16 and
/// bf16 (multiples of 1/64 in [-1, 1)), so half-precision and f32 models see the same inputs.
pub fn batch(seed: u64, items: usize, dtype: DType) -> Result<Batch> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) % 128) as f32 / 64.0 - 1.0
    };
    let x: Vec<f32> = (0..items * IN).map(|_| next()).collect();
    let y: Vec<f32> = (0..items * OUT)
        .map(|k| {
            let (r, o) = (k / OUT, k % OUT);
            (0..IN).map(|j| x[r * IN + j] * (((j + o) % 5) as f32 - 2.0) * 0.25).sum::<f32>().sin()
        })
        .collect();
    let x = Tensor::from_vec(x, (items, IN), &Device::Cpu)?.to_dtype(dtype)?;
    Ok(Batch { x, y: Tensor::from_vec(y, (items, OUT), &Device::Cpu)?, items })
}

/// Micro-batch sizes of `rank` at `step`: they differ between micro-batches, ranks and steps.
pub fn sizes(step: usize, rank: usize) -> Vec<usize> {
    let base = [[3, 5, 2], [4, 1, 6]][rank % 2];
    base.iter().map(|b| 1 + (b + step) % 6).collect()
}

/// The micro-batches of `rank` at `step`.
pub fn batches(step: usize, rank: usize, dtype: DType) -> Result<Vec<Batch>> {
    let seeds = sizes(step, rank).into_iter().enumerate();
    seeds.map(|(k, n)| batch((step * 1000 + rank * 100 + k) as u64, n, dtype)).collect()
}

/// Which optimizer steps the FP32 masters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stepper {
    /// candle_nn's AdamW over FP32 master Vars; the half-precision weights copied from them.
    Candle,
    /// gradacc's AdamW: the masters inside gradacc, the half-precision weights written by its
    /// pass, its state kept in the format given (FP32 masters and moments, or smaller ones).
    Gradacc(StateFormat),
}

impl Stepper {
    /// gradacc's AdamW with FP32 masters and moments.
    pub const GRADACC: Stepper =
        Stepper::Gradacc(StateFormat { masters: MasterFormat::F32, moments: MomentFormat::F32 });

    /// The half-precision weight this stepper writes for the master `v`: its rounding to nearest
    /// even, or under remainder masters the weight half of the master's split.
    pub fn weight_of(self, dtype: DType, v: f32) -> f32 {
        match (self, dtype) {
            (Stepper::Gradacc(f), DType::BF16) if f.masters == MasterFormat::Bf16Remainder => {
                half::bf16::from_bits(split_master(v).0).to_f32()
            }
            (_, DType::F16) => half::f16::from_f32(v).to_f32(),
            _ => half::bf16::from_f32(v).to_f32(),
        }
    }
}

/// The AdamW both steppers use: candle_nn's defaults at learning rate 1e-2.
fn adamw() -> ParamsAdamW {
    ParamsAdamW { lr: 1e-2, ..Default::default() }
}

enum Masters {
    Candle {
        vars: Vec<Var>,
        opt: AdamW,
    },
    /// Boxed: the optimizer holds its device state too, far larger than the other variant.
    Gradacc(Box<gradacc::Optimizer>),
}

/// One data-parallel replica: the half-precision model, its FP32 masters and their optimizer,
/// and gradacc's accumulator and scaler.
pub struct Replica {
    pub model: Mlp,
    pub weights: Vec<Var>,
    pub acc: Accumulator,
    pub scaler: Scaler,
    masters: Masters,
}

impl Replica {
    /// A replica whose masters are copied from `init` (the same start on every rank), stepped by
    /// candle's AdamW.
    pub fn new(dtype: DType, init: &[Var], scaler: ScalerConfig) -> Result<Self> {
        Self::with_stepper(dtype, init, scaler, Stepper::Candle)
    }

    /// As [`Replica::new`], stepped by `stepper`. gradacc's masters start as the half-precision
    /// weights, so `init` should be representable in `dtype` for the two to start alike.
    pub fn with_stepper(
        dtype: DType,
        init: &[Var],
        scaler: ScalerConfig,
        stepper: Stepper,
    ) -> Result<Self> {
        let (_, vars) = build(DType::F32)?;
        adapter::copy_weights(init, &vars)?;
        let (model, weights) = build(dtype)?;
        adapter::copy_weights(&vars, &weights)?;
        let acc = Accumulator::new(AccumulatorConfig::default(), &adapter::descs(&weights)?)
            .map_err(err)?;
        let masters = match stepper {
            Stepper::Candle => Masters::Candle { opt: AdamW::new(vars.clone(), adamw())?, vars },
            Stepper::Gradacc(format) => {
                let p = adamw();
                let config = OptimizerConfig {
                    algorithm: Algorithm::AdamW {
                        beta1: p.beta1 as f32,
                        beta2: p.beta2 as f32,
                        eps: p.eps as f32,
                        weight_decay: p.weight_decay as f32,
                    },
                    lr: p.lr as f32,
                    ..Default::default()
                };
                let current = weights.iter().map(HalfValues::of).collect::<Result<Vec<_>>>()?;
                let grads: Vec<Grad<'_>> = current.iter().map(HalfValues::grad).collect();
                let opt = gradacc::Optimizer::builder(&acc)
                    .config(config)
                    .state(format)
                    .weights(&grads)
                    .build()
                    .map_err(err)?;
                Masters::Gradacc(Box::new(opt))
            }
        };
        Ok(Replica { model, weights, acc, scaler: Scaler::new(scaler).map_err(err)?, masters })
    }

    /// Adds one micro-batch: backward of the loss scaled by the current scale.
    pub fn microbatch(&self, b: &Batch) -> Result<f32> {
        let scale = self.scaler.scale().map_err(err)?;
        let loss = self.model.loss(&b.x, &b.y)?;
        let grads = (&loss * scale as f64)?.backward()?;
        adapter::add_microbatch(&self.acc, &self.scaler, &grads, &self.weights, b.items as u64)?;
        loss.to_scalar::<f32>()
    }

    /// The boundary and the step: sync over `comm`, update the scale, and unless the window
    /// overflowed (on any rank) step the masters and refresh the half-precision weights.
    pub fn step(&mut self, comm: &dyn Communicator) -> Result<SyncInfo> {
        let info = self.acc.sync(Some(comm)).map_err(err)?;
        let skip = self.scaler.update_from(&[&self.acc], true).map_err(err)?.unwrap_or(true);
        match &mut self.masters {
            Masters::Candle { vars, opt } => {
                if !skip {
                    opt.step(&adapter::master_grads(&self.acc, vars)?)?;
                    adapter::copy_weights(vars, &self.weights)?;
                }
            }
            Masters::Gradacc(opt) => {
                // gradacc decides the skip itself, from the same agreed overflow flag.
                let mut current =
                    self.weights.iter().map(HalfValues::of).collect::<Result<Vec<_>>>()?;
                let mut out: Vec<GradMut<'_>> =
                    current.iter_mut().map(HalfValues::grad_mut).collect();
                let stepped = opt.step(&self.acc, &mut out, None).map_err(err)?;
                assert_eq!(stepped, !skip, "the optimizer and the scaler agree on the skip");
                drop(out);
                for (var, values) in self.weights.iter().zip(current) {
                    var.set(&values.into_tensor(var)?)?;
                }
            }
        }
        Ok(info)
    }

    /// The masters' values, flattened in order (remainder masters joined from the weights).
    pub fn master_values(&self) -> Result<Vec<Vec<f32>>> {
        match &self.masters {
            Masters::Candle { vars, .. } => {
                vars.iter().map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>()).collect()
            }
            Masters::Gradacc(opt) if opt.state_format().masters == MasterFormat::Bf16Remainder => {
                (self.weights.iter().enumerate())
                    .map(|(i, w)| {
                        let weight = w.as_tensor().flatten_all()?.to_vec1::<half::bf16>()?;
                        let (_, rem) = opt.read(i, Slot::Remainders).map_err(err)?;
                        Ok(weight
                            .iter()
                            .zip(rem)
                            .map(|(b, r)| join_master(b.to_bits(), r as u16))
                            .collect())
                    })
                    .collect()
            }
            Masters::Gradacc(opt) => (0..self.weights.len())
                .map(|i| Ok(opt.read(i, Slot::Weights).map_err(err)?.1))
                .collect(),
        }
    }
}

/// A half-precision Var's values in their own type, which gradacc takes as they are.
enum HalfValues {
    F16(Vec<half::f16>),
    Bf16(Vec<half::bf16>),
}

impl HalfValues {
    fn of(var: &Var) -> Result<HalfValues> {
        let t = var.as_tensor().flatten_all()?;
        Ok(match var.dtype() {
            DType::F16 => HalfValues::F16(t.to_vec1()?),
            DType::BF16 => HalfValues::Bf16(t.to_vec1()?),
            d => candle_core::bail!("gradacc's stepper writes f16 or bf16 weights, not {d:?}"),
        })
    }

    fn grad(&self) -> Grad<'_> {
        match self {
            HalfValues::F16(v) => Grad::F16(v),
            HalfValues::Bf16(v) => Grad::Bf16(v),
        }
    }

    fn grad_mut(&mut self) -> GradMut<'_> {
        match self {
            HalfValues::F16(v) => GradMut::F16(v),
            HalfValues::Bf16(v) => GradMut::Bf16(v),
        }
    }

    /// A tensor of `var`'s shape and dtype holding these values.
    fn into_tensor(self, var: &Var) -> Result<Tensor> {
        match self {
            HalfValues::F16(v) => Tensor::from_vec(v, var.shape(), var.device()),
            HalfValues::Bf16(v) => Tensor::from_vec(v, var.shape(), var.device()),
        }
    }
}
