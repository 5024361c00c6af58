//! The optimizer suites' model weights (tests/optimizer.rs, tests/optimizer_formats.rs): each
//! tensor's weights in its dtype, a fixed scaler, and one micro-batch added exactly.

use super::{encode, grad_of, to_bf16, to_f16, Rng};
use std::sync::Arc;

use gradacc::{
    Accumulator, AccumulatorConfig, Communicator, Dtype, Grad, GradMut, Scaler, ScalerConfig,
    Sharding, TensorDesc,
};

pub fn fixed_scaler() -> Scaler {
    Scaler::new(ScalerConfig { init_scale: 1.0, dynamic: false, ..Default::default() }).unwrap()
}

/// A model's weights of each tensor, in its dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Weights {
    F32(Vec<f32>),
    Half(Dtype, Vec<u16>),
}

impl Weights {
    pub fn random(rng: &mut Rng, d: &TensorDesc) -> Weights {
        let v: Vec<f32> = (0..d.numel).map(|_| rng.uniform(-2.0, 2.0) as f32).collect();
        match d.dtype {
            Dtype::F32 => Weights::F32(v),
            Dtype::F16 => Weights::Half(Dtype::F16, v.iter().map(|&x| to_f16(x)).collect()),
            Dtype::Bf16 => Weights::Half(Dtype::Bf16, v.iter().map(|&x| to_bf16(x)).collect()),
        }
    }

    pub fn grad(&self) -> Grad<'_> {
        match self {
            Weights::F32(v) => Grad::F32(v),
            Weights::Half(Dtype::F16, v) => Grad::f16_bits(v),
            Weights::Half(_, v) => Grad::bf16_bits(v),
        }
    }

    pub fn grad_mut(&mut self) -> GradMut<'_> {
        match self {
            Weights::F32(v) => GradMut::F32(v),
            Weights::Half(Dtype::F16, v) => GradMut::f16_bits(v),
            Weights::Half(_, v) => GradMut::bf16_bits(v),
        }
    }

    /// `master` written as the model's weight, rounded to nearest even by the `half` crate.
    pub fn nearest(&self, master: f32) -> u32 {
        match self {
            Weights::F32(_) => master.to_bits(),
            Weights::Half(Dtype::F16, _) => to_f16(master) as u32,
            Weights::Half(_, _) => to_bf16(master) as u32,
        }
    }

    pub fn bf16(&self) -> &[u16] {
        match self {
            Weights::Half(Dtype::Bf16, v) => v,
            _ => panic!("not bf16"),
        }
    }

    pub fn bits(&self, at: usize) -> u32 {
        match self {
            Weights::F32(v) => v[at].to_bits(),
            Weights::Half(_, v) => v[at] as u32,
        }
    }
}

pub fn model(rng: &mut Rng, tensors: &[TensorDesc]) -> Vec<Weights> {
    tensors.iter().map(|d| Weights::random(rng, d)).collect()
}

pub fn grads_of(w: &[Weights]) -> Vec<Grad<'_>> {
    w.iter().map(Weights::grad).collect()
}

pub fn muts_of(w: &mut [Weights]) -> Vec<GradMut<'_>> {
    w.iter_mut().map(Weights::grad_mut).collect()
}

/// Adds `g` (values in its tensors' dtypes) as one micro-batch of one item.
pub fn add(acc: &Accumulator, scaler: &Scaler, tensors: &[TensorDesc], g: &[Vec<f32>]) {
    let held: Vec<(Vec<f32>, Vec<u16>)> =
        tensors.iter().zip(g).map(|(d, v)| encode(d.dtype, v, 1.0)).collect();
    let grads: Vec<Grad<'_>> =
        tensors.iter().zip(&held).map(|(d, (f, h))| grad_of(d.dtype, f, h)).collect();
    acc.add(scaler, &grads[..], 1).unwrap();
}

/// An accumulator with `cfg` over `tensors` for one rank of `comm`'s group, and the communicator
/// its boundary takes: a sharded accumulation is built with the communicator and syncs with none.
pub fn rank_accumulator<'c>(
    tensors: &[TensorDesc],
    cfg: AccumulatorConfig,
    comm: &'c Arc<dyn Communicator>,
) -> (Accumulator, Option<&'c dyn Communicator>) {
    let accumulate = matches!(cfg.sharding, Sharding::Accumulate { .. });
    let mut b = Accumulator::builder(tensors).config(cfg);
    if accumulate {
        b = b.communicator(comm.clone());
    }
    (b.build().unwrap(), (!accumulate).then_some(&**comm))
}
