//! Helpers of the CUDA test suites (tests/cuda_*.rs): skipping without a device unless
//! GRADACC_REQUIRE_GPU=1, gradients in every representation both backends take, and the bitwise
//! comparison of masters.

use std::sync::Arc;

use gradacc::backend::cuda;
use gradacc::backend::cuda::driver::{self, Context, DeviceBuffer};
use gradacc::backend::cuda::nccl;
use gradacc::{
    Accumulator, AccumulatorConfig, Device, Dtype, Grad, LossReduction, Normalize, Scaler,
    ScalerConfig, TensorDesc,
};

use super::{to_bf16, to_f16, Rng};

/// Whether CUDA objects can be made here; with GRADACC_REQUIRE_GPU=1 a missing device fails.
pub fn gpu_or_skip() -> bool {
    if cuda::available() {
        return true;
    }
    let why = driver::require_driver()
        .and(cuda::compile::require_nvrtc())
        .err()
        .map_or_else(String::new, |e| e.message);
    assert!(
        std::env::var("GRADACC_REQUIRE_GPU").as_deref() != Ok("1"),
        "GRADACC_REQUIRE_GPU=1 but no CUDA device and NVRTC are usable: {why}"
    );
    eprintln!("no CUDA device: skipping");
    false
}

/// Whether `devices` CUDA devices are visible (`count` of them are). A real machine with fewer
/// does not run the test, also under GRADACC_REQUIRE_GPU=1: it prints "not run: needs N devices",
/// the line the GPU bundle counts. The software GPU (GRADACC_SIMGPU=1) always has the devices a
/// test asks for, so there a shortfall fails.
pub fn enough_devices(devices: i32, count: i32) -> bool {
    if count >= devices {
        return true;
    }
    assert!(
        std::env::var("GRADACC_SIMGPU").as_deref() != Ok("1"),
        "the software GPU shows {count} device(s), the test needs {devices}"
    );
    eprintln!("not run: needs {devices} devices ({count} visible)");
    false
}

/// Runs `f(test)` where there are `devices` devices (`count` are visible): on real GPUs only
/// where there are; on the software GPU, whose device count is fixed when it loads, in a child
/// process with that many.
pub fn at_devices(devices: i32, count: i32, test: &str, f: impl FnOnce(&str)) {
    if count >= devices {
        return f(test);
    }
    if count == 0 {
        return;
    }
    if std::env::var("GRADACC_SIMGPU").as_deref() != Ok("1")
        || std::env::var("SIMGPU_DEVICES").is_ok()
    {
        eprintln!("not run: needs {devices} devices ({count} visible)");
        return;
    }
    let text = super::rerun(
        test,
        &[("SIMGPU_DEVICES", &devices.to_string())],
        &format!("the {devices}-device run"),
    );
    eprintln!(
        "{}",
        text.lines()
            .filter(
                |l| l.contains("SEED") || l.starts_with("test ") && !l.starts_with("test result")
            )
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Whether NCCL loads; with GRADACC_REQUIRE_GPU=1 a missing NCCL fails.
pub fn nccl_or_skip() -> bool {
    if nccl::nccl_available() {
        return true;
    }
    assert!(
        std::env::var("GRADACC_REQUIRE_GPU").as_deref() != Ok("1"),
        "GRADACC_REQUIRE_GPU=1 but NCCL does not load: {}",
        nccl::require_nccl().err().map_or_else(String::new, |e| e.message)
    );
    eprintln!("no NCCL: skipping");
    false
}

/// The visible CUDA devices where CUDA and NCCL are usable, else 0 (the test skips, or fails
/// under GRADACC_REQUIRE_GPU=1).
pub fn nccl_devices() -> i32 {
    if !gpu_or_skip() || !nccl_or_skip() {
        return 0;
    }
    let mut count = 0;
    // SAFETY: the driver loads (gpu_or_skip); a valid out-pointer.
    unsafe { cudarc::driver::sys::cuDeviceGetCount(&mut count) };
    count
}

/// One tensor's gradient in every representation the two backends need.
pub struct HostGrad {
    pub dtype: Dtype,
    pub f32s: Vec<f32>,
    pub u16s: Vec<u16>,
}

impl HostGrad {
    pub fn random(rng: &mut Rng, dtype: Dtype, n: usize, scale: f32, poison: bool) -> HostGrad {
        let mut f32s: Vec<f32> =
            (0..n).map(|_| (rng.uniform(-1.0, 1.0) * scale as f64 * 0.01) as f32).collect();
        if poison && n > 0 {
            let at = rng.range(0, n as u64 - 1) as usize;
            f32s[at] = if rng.range(0, 1) == 0 { f32::INFINITY } else { f32::NAN };
        }
        let u16s = match dtype {
            Dtype::F16 => f32s.iter().map(|&v| to_f16(v)).collect(),
            Dtype::Bf16 => f32s.iter().map(|&v| to_bf16(v)).collect(),
            Dtype::F32 => Vec::new(),
        };
        HostGrad { dtype, f32s, u16s }
    }

    /// Every element `v`.
    pub fn constant(dtype: Dtype, n: usize, v: f32) -> HostGrad {
        let u16s = match dtype {
            Dtype::F16 => vec![to_f16(v); n],
            Dtype::Bf16 => vec![to_bf16(v); n],
            Dtype::F32 => Vec::new(),
        };
        HostGrad { dtype, f32s: vec![v; n], u16s }
    }

    pub fn view(&self) -> Grad<'_> {
        match self.dtype {
            Dtype::F32 => Grad::F32(&self.f32s),
            Dtype::F16 => Grad::f16_bits(&self.u16s),
            Dtype::Bf16 => Grad::bf16_bits(&self.u16s),
        }
    }

    /// A device copy, starting `shift` elements into its allocation (an unaligned address).
    pub fn upload(
        &self,
        ctx: &Arc<Context>,
        stream: driver::CUstream,
        shift: usize,
    ) -> (DeviceBuffer, u64) {
        let buf = match self.dtype {
            Dtype::F32 => {
                let mut v = vec![0f32; shift];
                v.extend_from_slice(&self.f32s);
                DeviceBuffer::from_slice(ctx, stream, &v).unwrap()
            }
            _ => {
                let mut v = vec![0u16; shift];
                v.extend_from_slice(&self.u16s);
                DeviceBuffer::from_slice(ctx, stream, &v).unwrap()
            }
        };
        let addr = buf.ptr() + (shift * self.dtype.size()) as u64;
        (buf, addr)
    }
}

/// Every tensor's master bit for bit (NaN matching any NaN).
pub fn masters_equal(cpu: &Accumulator, gpu: &Accumulator, what: &str) {
    for (i, d) in cpu.tensors().iter().enumerate() {
        let mut got = vec![0f32; d.numel];
        gpu.read_master(i, &mut got).unwrap();
        cpu.with_master(i, |want| {
            for (k, (a, b)) in want.iter().zip(&got).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{what}: tensor {i} element {k}: cpu {a:e} gpu {b:e}"
                );
            }
        })
        .unwrap();
    }
}

/// Rank 0 of the Apex O2 seed on device 0: weight and bias (f32, a bucket each) summed over
/// micro-batches and averaged over ranks (DDP without loss division), at loss scale 1; the
/// micro-batches' gradients are weight 0.5 then 2.5, bias 1.0 then 1.0.
pub struct ApexSeed {
    pub scaler: Scaler,
    pub acc: Accumulator,
    pub first: [DeviceBuffer; 2],
    pub second: [DeviceBuffer; 2],
}

impl ApexSeed {
    pub fn new(ctx: &Arc<Context>, stream: driver::CUstream) -> ApexSeed {
        let descs = [
            TensorDesc { numel: 1, dtype: Dtype::F32 },
            TensorDesc { numel: 1, dtype: Dtype::F32 },
        ];
        let config = AccumulatorConfig {
            normalize: Normalize::ByWorld,
            loss_reduction: LossReduction::Sum,
            bucket_numel: 1,
            ..Default::default()
        };
        let g = |v: f32| DeviceBuffer::from_slice(ctx, stream, &[v]).unwrap();
        let device = Device::Cuda { ordinal: 0, stream: stream.cast() };
        ApexSeed {
            scaler: Scaler::on(device, ScalerConfig { init_scale: 1.0, ..Default::default() })
                .unwrap(),
            acc: Accumulator::builder(&descs).device(device).config(config).build().unwrap(),
            first: [g(0.5), g(1.0)],
            second: [g(2.5), g(1.0)],
        }
    }
}
