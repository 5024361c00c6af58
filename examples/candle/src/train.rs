//! A 2-layer MLP trained data-parallel: each rank (a thread) runs candle's forward and backward
//! in half precision on micro-batches of different sizes, gradacc accumulates the 16-bit
//! gradients into FP32 masters and all-reduces them once per step, and AdamW steps FP32 master
//! Vars, from which the half-precision weights are refreshed.

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::{linear, AdamW, Linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use gradacc::{Accumulator, AccumulatorConfig, Communicator, Scaler, ScalerConfig, SyncInfo};

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

/// One data-parallel replica: the half-precision model, its FP32 masters and their optimizer,
/// and gradacc's accumulator and scaler.
pub struct Replica {
    pub model: Mlp,
    pub weights: Vec<Var>,
    pub masters: Vec<Var>,
    pub acc: Accumulator,
    pub scaler: Scaler,
    opt: AdamW,
}

impl Replica {
    /// A replica whose masters are copied from `init` (the same start on every rank).
    pub fn new(dtype: DType, init: &[Var], scaler: ScalerConfig) -> Result<Self> {
        let (_, masters) = build(DType::F32)?;
        adapter::copy_weights(init, &masters)?;
        let (model, weights) = build(dtype)?;
        adapter::copy_weights(&masters, &weights)?;
        let acc = Accumulator::new(AccumulatorConfig::default(), &adapter::descs(&weights)?)
            .map_err(err)?;
        let opt = AdamW::new(masters.clone(), ParamsAdamW { lr: 1e-2, ..Default::default() })?;
        Ok(Replica { model, weights, masters, acc, scaler: Scaler::new(scaler).map_err(err)?, opt })
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
        if !skip {
            self.opt.step(&adapter::master_grads(&self.acc, &self.masters)?)?;
            adapter::copy_weights(&self.masters, &self.weights)?;
        }
        Ok(info)
    }

    /// The masters' values, flattened in order.
    pub fn master_values(&self) -> Result<Vec<Vec<f32>>> {
        self.masters.iter().map(|v| v.as_tensor().flatten_all()?.to_vec1::<f32>()).collect()
    }
}
