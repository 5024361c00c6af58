//! The CUDA `add` against the device's copy bandwidth, measured in the same run: for each size
//! and dtype, one fused pass reads the gradient (2 or 4 B) and the master (4 B) and writes the
//! master (4 B); the floor is a device-to-device copy moving the same bytes. Median of 15 after a
//! warm-up. Prints a Markdown table; without a GPU it says so and exits 0.
//!
//! `cargo bench --bench cuda_add` (scripts/gpu-check runs it, and the GPU bundle's `run`).

use std::time::Instant;

use gradacc::backend::cuda;
use gradacc::backend::cuda::driver::{self, Context, DeviceBuffer, OwnedStream};
use gradacc::{Accumulator, AccumulatorConfig, Device, Dtype, Scaler, ScalerConfig, TensorDesc};

const REPEATS: usize = 15;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds per call of `f`, each call waited for.
fn time(ctx: &Context, stream: driver::CUstream, mut f: impl FnMut()) -> f64 {
    f();
    driver::synchronize(ctx, stream).unwrap();
    median(
        (0..REPEATS)
            .map(|_| {
                let t = Instant::now();
                f();
                driver::synchronize(ctx, stream).unwrap();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// Element counts: 16M, 64M and 256M, or GRADACC_CUDA_ADD_SIZES (a comma-separated list; the
/// software GPU runs kernels on the host, and measures small sizes only).
fn sizes() -> Vec<usize> {
    match std::env::var("GRADACC_CUDA_ADD_SIZES") {
        Ok(list) => list
            .split(',')
            .map(|n| n.trim().parse().expect("GRADACC_CUDA_ADD_SIZES: element counts"))
            .collect(),
        Err(_) => vec![1 << 24, 1 << 26, 1 << 28],
    }
}

fn main() {
    if !cuda::available() {
        println!("no CUDA device (or no NVRTC): nothing to measure");
        return;
    }
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let s = stream.stream;
    let device = Device::Cuda { ordinal: 0, stream: s };
    println!("| elements | dtype | add (ms) | copy floor, same bytes (ms) | floor / add | GB/s |");
    println!("|---|---|---|---|---|---|");
    for n in sizes() {
        for dtype in [Dtype::F16, Dtype::Bf16, Dtype::F32] {
            let descs = [TensorDesc { numel: n, dtype }];
            let acc = Accumulator::on(device, AccumulatorConfig::default(), &descs).unwrap();
            let scaler = Scaler::on(device, ScalerConfig::default()).unwrap();
            let grad = DeviceBuffer::zeroed(&ctx, s, n * dtype.size()).unwrap();
            let bytes = n * (dtype.size() + 8);
            // A copy reads and writes its size: half the fused pass's traffic each way.
            let (src, dst) = (
                DeviceBuffer::zeroed(&ctx, s, bytes / 2).unwrap(),
                DeviceBuffer::zeroed(&ctx, s, bytes / 2).unwrap(),
            );
            let add = time(&ctx, s, || acc.add(&scaler, &[grad.ptr()], 1).unwrap());
            let floor =
                time(&ctx, s, || driver::copy(&ctx, s, dst.ptr(), src.ptr(), bytes / 2).unwrap());
            println!(
                "| {n} | {} | {:.3} | {:.3} | {:.2} | {:.0} |",
                dtype.name(),
                add * 1e3,
                floor * 1e3,
                floor / add,
                bytes as f64 / add / 1e9
            );
        }
    }
}
