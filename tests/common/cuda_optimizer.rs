//! The CUDA optimizer suites' fixtures (tests/cuda_optimizer.rs, tests/cuda_optimizer_formats.rs):
//! a model's weights on the host and in device memory as bits of their dtypes, a fixed scaler,
//! random and exactly representable gradients, and the tensor layout both suites step.

use std::sync::Arc;

use super::{to_bf16, to_f16, Rng};
use gradacc::backend::cuda::driver::{self, Context, DeviceBuffer};
use gradacc::{Device, Dtype, Grad, GradMut, Scaler, ScalerConfig, TensorDesc};

/// A model's weights of one tensor on the host, as bits of its dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct HostWeights {
    pub dtype: Dtype,
    pub f32s: Vec<f32>,
    pub u16s: Vec<u16>,
}

impl HostWeights {
    pub fn random(rng: &mut Rng, dtype: Dtype, n: usize) -> HostWeights {
        let v: Vec<f32> = (0..n).map(|_| rng.uniform(-2.0, 2.0) as f32).collect();
        match dtype {
            Dtype::F32 => HostWeights { dtype, f32s: v, u16s: vec![] },
            Dtype::F16 => {
                HostWeights { dtype, f32s: vec![], u16s: v.iter().map(|&x| to_f16(x)).collect() }
            }
            Dtype::Bf16 => {
                HostWeights { dtype, f32s: vec![], u16s: v.iter().map(|&x| to_bf16(x)).collect() }
            }
        }
    }

    pub fn grad(&self) -> Grad<'_> {
        match self.dtype {
            Dtype::F32 => Grad::F32(&self.f32s),
            Dtype::F16 => Grad::f16_bits(&self.u16s),
            Dtype::Bf16 => Grad::bf16_bits(&self.u16s),
        }
    }

    pub fn grad_mut(&mut self) -> GradMut<'_> {
        match self.dtype {
            Dtype::F32 => GradMut::F32(&mut self.f32s),
            Dtype::F16 => GradMut::f16_bits(&mut self.u16s),
            Dtype::Bf16 => GradMut::bf16_bits(&mut self.u16s),
        }
    }

    pub fn bits(&self) -> Vec<u32> {
        match self.dtype {
            Dtype::F32 => self.f32s.iter().map(|v| v.to_bits()).collect(),
            _ => self.u16s.iter().map(|&v| v as u32).collect(),
        }
    }
}

/// The model's weights in device memory.
pub struct DeviceWeights {
    pub bufs: Vec<DeviceBuffer>,
    pub ptrs: Vec<u64>,
}

impl DeviceWeights {
    pub fn upload(
        ctx: &Arc<Context>,
        stream: driver::CUstream,
        w: &[HostWeights],
    ) -> DeviceWeights {
        let bufs: Vec<DeviceBuffer> = w
            .iter()
            .map(|w| match w.dtype {
                Dtype::F32 => DeviceBuffer::from_slice(ctx, stream, &w.f32s).unwrap(),
                _ => DeviceBuffer::from_slice(ctx, stream, &w.u16s).unwrap(),
            })
            .collect();
        let ptrs = bufs.iter().map(DeviceBuffer::ptr).collect();
        DeviceWeights { bufs, ptrs }
    }

    /// Every tensor's weights as bits (waits for the stream).
    pub fn bits(&self, dtypes: &[Dtype], numel: &[usize]) -> Vec<Vec<u32>> {
        self.bufs
            .iter()
            .zip(dtypes.iter().zip(numel))
            .map(|(b, (&d, &n))| match d {
                Dtype::F32 => {
                    let mut v = vec![0f32; n];
                    b.read(&mut v).unwrap();
                    v.iter().map(|x| x.to_bits()).collect()
                }
                _ => {
                    let mut v = vec![0u16; n];
                    b.read(&mut v).unwrap();
                    v.iter().map(|&x| x as u32).collect()
                }
            })
            .collect()
    }
}

pub fn fixed_scaler(device: Device) -> Scaler {
    let config = ScalerConfig { init_scale: 1.0, dynamic: false, ..Default::default() };
    Scaler::on(device, config).unwrap()
}

/// One micro-batch's gradient of every tensor, in the tensor's dtype; `inf` poisons one value.
pub struct Gradient {
    pub f32s: Vec<Vec<f32>>,
    pub u16s: Vec<Vec<u16>>,
}

impl Gradient {
    pub fn random(rng: &mut Rng, descs: &[TensorDesc], inf: bool) -> Gradient {
        let scale = 10f64.powi(rng.range(0, 4) as i32 - 2);
        let mut f32s: Vec<Vec<f32>> = descs
            .iter()
            .map(|d| (0..d.numel).map(|_| (rng.uniform(-1.0, 1.0) * scale) as f32).collect())
            .collect();
        if inf {
            let t = rng.range(0, descs.len() as u64 - 1) as usize;
            let at = rng.range(0, descs[t].numel as u64 - 1) as usize;
            f32s[t][at] = f32::INFINITY;
        }
        Gradient::of(descs, f32s)
    }

    /// `f32s` with each 16-bit tensor's words beside them.
    pub fn of(descs: &[TensorDesc], f32s: Vec<Vec<f32>>) -> Gradient {
        let u16s = descs
            .iter()
            .zip(&f32s)
            .map(|(d, v)| match d.dtype {
                Dtype::F16 => v.iter().map(|&x| to_f16(x)).collect(),
                Dtype::Bf16 => v.iter().map(|&x| to_bf16(x)).collect(),
                Dtype::F32 => vec![],
            })
            .collect();
        Gradient { f32s, u16s }
    }

    pub fn views<'a>(&'a self, descs: &[TensorDesc]) -> Vec<Grad<'a>> {
        descs
            .iter()
            .enumerate()
            .map(|(i, d)| match d.dtype {
                Dtype::F32 => Grad::F32(&self.f32s[i]),
                Dtype::F16 => Grad::f16_bits(&self.u16s[i]),
                Dtype::Bf16 => Grad::bf16_bits(&self.u16s[i]),
            })
            .collect()
    }

    pub fn upload(
        &self,
        ctx: &Arc<Context>,
        stream: driver::CUstream,
        descs: &[TensorDesc],
    ) -> Vec<DeviceBuffer> {
        descs
            .iter()
            .enumerate()
            .map(|(i, d)| match d.dtype {
                Dtype::F32 => DeviceBuffer::from_slice(ctx, stream, &self.f32s[i]).unwrap(),
                _ => DeviceBuffer::from_slice(ctx, stream, &self.u16s[i]).unwrap(),
            })
            .collect()
    }
}

/// Tensors of every gradient dtype, one longer than a launch's chunk.
pub fn layout() -> Vec<TensorDesc> {
    vec![
        TensorDesc { numel: 1, dtype: Dtype::F32 },
        TensorDesc { numel: 4097, dtype: Dtype::F16 },
        TensorDesc { numel: 9001, dtype: Dtype::Bf16 },
        TensorDesc { numel: 3, dtype: Dtype::F16 },
    ]
}

/// Gradients whose every sum is exact (small multiples of 2^-10, added with count 2 and divided
/// by a power of two), so that any reduction order gives the same reduced gradient.
pub fn exact_gradient(rng: &mut Rng, descs: &[TensorDesc]) -> Gradient {
    let f32s: Vec<Vec<f32>> = descs
        .iter()
        .map(|d| (0..d.numel).map(|_| (rng.range(0, 128) as f32 - 64.0) / 1024.0).collect())
        .collect();
    Gradient::of(descs, f32s)
}
