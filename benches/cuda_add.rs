//! The CUDA `add` and the one-GPU boundary against the device's copy bandwidth, measured in the
//! same run. For each layout and dtype, one fused `add` pass reads the gradient (2 or 4 B) and the
//! master (4 B) and writes the master (4 B); the boundary with clipping (a `sync` whose norm
//! clips) reads the master for the norm, then reads and writes it to scale (12 B); each floor is a
//! device-to-device copy moving the same bytes. Layouts: one flat tensor of 16M to 1G elements,
//! and a 500-tensor GPT-style layout (embeddings, then per layer two norms, QKV, output and MLP
//! projections with biases). Median of 15 after a warm-up. Prints Markdown tables; without a GPU
//! it says so and exits 0.
//!
//! `cargo bench --bench cuda_add` (scripts/gpu-check runs it, and the GPU bundle's `run`).
//! GRADACC_CUDA_ADD_SIZES (comma-separated element counts) and GRADACC_CUDA_ADD_HIDDEN (the
//! transformer's hidden size, 1024) shrink the run: the software GPU runs kernels on the host.

use std::time::Instant;

use gradacc::backend::cuda;
use gradacc::backend::cuda::driver::{self, Context, DeviceBuffer, OwnedStream};
use gradacc::{Accumulator, AccumulatorConfig, Device, Dtype, Scaler, ScalerConfig, TensorDesc};

const REPEATS: usize = 15;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Seconds per call of `f` (after `before`, untimed, each time), each call waited for.
fn time(
    ctx: &Context,
    stream: driver::CUstream,
    mut before: impl FnMut(),
    mut f: impl FnMut(),
) -> f64 {
    before();
    f();
    driver::synchronize(ctx, stream).unwrap();
    median(
        (0..REPEATS)
            .map(|_| {
                before();
                driver::synchronize(ctx, stream).unwrap();
                let t = Instant::now();
                f();
                driver::synchronize(ctx, stream).unwrap();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// Flat element counts: 16M, 64M, 256M and 1G, or GRADACC_CUDA_ADD_SIZES.
fn sizes() -> Vec<usize> {
    match std::env::var("GRADACC_CUDA_ADD_SIZES") {
        Ok(list) => list
            .split(',')
            .map(|n| n.trim().parse().expect("GRADACC_CUDA_ADD_SIZES: element counts"))
            .collect(),
        Err(_) => vec![1 << 24, 1 << 26, 1 << 28, 1 << 30],
    }
}

/// A GPT-style layout of 500 tensors (31 layers of hidden size GRADACC_CUDA_ADD_HIDDEN, 1024 by
/// default: 444M elements): the token and position embeddings, per layer two norms (weight and
/// bias), QKV and output projections and the MLP's two (weights and biases), then the final norm.
fn transformer() -> Vec<usize> {
    let h: usize = std::env::var("GRADACC_CUDA_ADD_HIDDEN")
        .map(|v| v.trim().parse().expect("GRADACC_CUDA_ADD_HIDDEN: a hidden size"))
        .unwrap_or(1024);
    let mut sizes = vec![50257 * h, 2048 * h];
    for _ in 0..31 {
        sizes.extend([h, h, 3 * h * h, 3 * h, h * h, h, h, h]);
        sizes.extend([4 * h * h, 4 * h, 4 * h * h, h, h, h, h, h]);
    }
    sizes.extend([h, h]);
    sizes
}

/// The copy floor: seconds to copy `bytes / 2` bytes (a copy reads and writes its size).
fn copy_floor(ctx: &std::sync::Arc<Context>, s: driver::CUstream, bytes: usize) -> f64 {
    let (src, dst) = (
        DeviceBuffer::zeroed(ctx, s, bytes / 2).unwrap(),
        DeviceBuffer::zeroed(ctx, s, bytes / 2).unwrap(),
    );
    time(ctx, s, || {}, || driver::copy(ctx, s, dst.ptr(), src.ptr(), bytes / 2).unwrap())
}

fn main() {
    if !cuda::available() {
        println!("no CUDA device (or no NVRTC): nothing to measure");
        return;
    }
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let s = stream.stream;
    let device = Device::Cuda { ordinal: 0, stream: s.cast() };
    let layouts: Vec<(String, Vec<usize>)> = sizes()
        .into_iter()
        .map(|n| (format!("{n} flat"), vec![n]))
        .chain(
            std::iter::once(transformer())
                .map(|t| (format!("{} tensors, {} elements", t.len(), t.iter().sum::<usize>()), t)),
        )
        .collect();
    println!(
        "| layout | dtype | add (ms) | copy floor, same bytes (ms) | floor / add | add GB/s |"
    );
    println!("|---|---|---|---|---|---|");
    let mut boundary = Vec::new();
    for (name, numels) in &layouts {
        let n: usize = numels.iter().sum();
        for dtype in [Dtype::F16, Dtype::Bf16, Dtype::F32] {
            let descs: Vec<TensorDesc> =
                numels.iter().map(|&numel| TensorDesc { numel, dtype }).collect();
            // Clipping at a norm every window exceeds: the boundary's second pass always runs.
            let config = AccumulatorConfig { max_grad_norm: 1e-30, ..Default::default() };
            let acc = Accumulator::builder(&descs).device(device).config(config).build().unwrap();
            let scaler = Scaler::on(device, ScalerConfig::default()).unwrap();
            let grads: Vec<DeviceBuffer> = numels
                .iter()
                .map(|&numel| DeviceBuffer::zeroed(&ctx, s, numel * dtype.size()).unwrap())
                .collect();
            let pointers: Vec<u64> = grads.iter().map(DeviceBuffer::ptr).collect();
            let add = time(&ctx, s, || {}, || acc.add(&scaler, &pointers, 1).unwrap());
            let bytes = n * (dtype.size() + 8);
            let floor = copy_floor(&ctx, s, bytes);
            println!(
                "| {name} | {} | {:.3} | {:.3} | {:.2} | {:.0} |",
                dtype.name(),
                add * 1e3,
                floor * 1e3,
                floor / add,
                bytes as f64 / add / 1e9
            );
            if dtype == Dtype::F32 {
                let sync = time(
                    &ctx,
                    s,
                    || acc.add(&scaler, &pointers, 1).unwrap(),
                    || acc.sync_enqueue(None).unwrap(),
                );
                boundary.push((name.clone(), n, sync));
            }
        }
    }
    println!();
    println!(
        "| layout (f32 master) | boundary: normalise, norm, clip (ms) | copy floor, same bytes (ms) | floor / boundary |"
    );
    println!("|---|---|---|---|");
    for (name, n, sync) in boundary {
        let floor = copy_floor(&ctx, s, n * 12);
        println!("| {name} | {:.3} | {:.3} | {:.2} |", sync * 1e3, floor * 1e3, floor / sync);
    }
}
