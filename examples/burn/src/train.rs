//! A 2-layer MLP trained data-parallel: each rank (a thread) runs Burn's forward and backward in
//! half precision on micro-batches of different sizes, gradacc accumulates the 16-bit gradients
//! into FP32 masters and all-reduces them once per step, and AdamW steps the FP32 master module,
//! from which the half-precision model is cast again.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn::tensor::activation::relu;
use burn::tensor::{DType, Device, Tensor, TensorData};
use gradacc::{Accumulator, AccumulatorConfig, Communicator, Scaler, ScalerConfig, SyncInfo};

use crate::adapter::{self, Error};

pub const IN: usize = 8;
pub const HIDDEN: usize = 16;
pub const OUT: usize = 4;

#[derive(Module, Debug)]
pub struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Mlp {
    /// A freshly initialised FP32 model on Burn's CPU backend, recording gradients.
    pub fn new() -> Self {
        let device = device();
        Mlp {
            fc1: LinearConfig::new(IN, HIDDEN).init(&device),
            fc2: LinearConfig::new(HIDDEN, OUT).init(&device),
        }
    }

    /// The mean squared error over the batch, computed in f32 whatever the model's dtype.
    pub fn loss(&self, x: &Tensor<2>, y: &Tensor<2>) -> Tensor<1> {
        let pred = self.fc2.forward(relu(self.fc1.forward(x.clone()))).cast(DType::F32);
        (pred - y.clone()).powi_scalar(2).mean()
    }
}

impl Default for Mlp {
    fn default() -> Self {
        Self::new()
    }
}

/// Burn's CPU backend (Flex) with autodiff.
pub fn device() -> Device {
    Device::default().autodiff()
}

/// One micro-batch: inputs in the model's dtype, f32 targets, and its item count.
pub struct Batch {
    pub x: Tensor<2>,
    pub y: Tensor<2>,
    pub items: usize,
}

/// Deterministic data: `items` rows of a fixed smooth teacher, inputs representable in f16 and
/// bf16 (multiples of 1/64 in [-1, 1)), so half-precision and f32 models see the same inputs.
pub fn batch(seed: u64, items: usize, dtype: DType) -> Batch {
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
    let device = device();
    let x = Tensor::<2>::from_data(TensorData::new(x, [items, IN]), &device).cast(dtype);
    Batch { x, y: Tensor::from_data(TensorData::new(y, [items, OUT]), &device), items }
}

/// Micro-batch sizes of `rank` at `step`: they differ between micro-batches, ranks and steps.
pub fn sizes(step: usize, rank: usize) -> Vec<usize> {
    let base = [[3, 5, 2], [4, 1, 6]][rank % 2];
    base.iter().map(|b| 1 + (b + step) % 6).collect()
}

/// The micro-batches of `rank` at `step`.
pub fn batches(step: usize, rank: usize, dtype: DType) -> Vec<Batch> {
    let seeds = sizes(step, rank).into_iter().enumerate();
    seeds.map(|(k, n)| batch((step * 1000 + rank * 100 + k) as u64, n, dtype)).collect()
}

/// One data-parallel replica: the FP32 master module and its optimizer, the half-precision
/// model cast from it, and gradacc's accumulator and scaler.
pub struct Replica {
    pub masters: Mlp,
    pub model: Mlp,
    pub dtype: DType,
    pub acc: Accumulator,
    pub scaler: Scaler,
    opt: ModuleOptimizer,
}

impl Replica {
    /// A replica whose masters are `init` (the same start on every rank).
    pub fn new(dtype: DType, init: &Mlp, scaler: ScalerConfig) -> Result<Self, Error> {
        let masters = init.clone();
        let model = adapter::cast(&masters, dtype);
        let acc = Accumulator::new(AccumulatorConfig::default(), &adapter::descs(&model)?)?;
        let opt = AdamWConfig::new().init();
        Ok(Replica { masters, model, dtype, acc, scaler: Scaler::new(scaler)?, opt })
    }

    /// Adds one micro-batch: backward of the loss scaled by the current scale; returns the loss.
    pub fn microbatch(&self, b: &Batch) -> Result<f32, Error> {
        let scale = self.scaler.scale()?;
        let loss = self.model.loss(&b.x, &b.y);
        let grads = loss.clone().mul_scalar(scale).backward();
        adapter::add_microbatch(&self.acc, &self.scaler, &grads, &self.model, b.items as u64)?;
        Ok(loss.into_scalar_f32())
    }

    /// The boundary and the step: sync over `comm`, update the scale, and unless the window
    /// overflowed (on any rank) step the masters and cast the half-precision model again.
    pub fn step(&mut self, comm: &dyn Communicator) -> Result<SyncInfo, Error> {
        let info = self.acc.sync(Some(comm))?;
        let skip = self.scaler.update_from(&[&self.acc], true)?.unwrap_or(true);
        if !skip {
            let grads = adapter::master_grads(&self.acc, &self.masters)?;
            self.masters = self.opt.step(1e-2, self.masters.clone(), grads);
            self.model = adapter::cast(&self.masters, self.dtype);
        }
        Ok(info)
    }
}

/// The scalar of a one-element tensor, as f32.
trait ScalarF32 {
    fn into_scalar_f32(self) -> f32;
}

impl ScalarF32 for Tensor<1> {
    fn into_scalar_f32(self) -> f32 {
        self.cast(DType::F32).into_data().try_to_vec::<f32>().expect("an f32 tensor")[0]
    }
}
