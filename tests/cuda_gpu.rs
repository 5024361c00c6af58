//! The CUDA backend on a real GPU, against the CPU backend: bitwise-equal masters, norms and
//! scaler traces on random data (every dtype, odd sizes, unaligned addresses, scale changes,
//! both adding styles, every normalisation, clipping), the NCCL boundary (world size 1 on one GPU,
//! every GPU as a rank when there are several), the final micro-batch's early bucket reductions,
//! loss scaling, and the struct layouts shared with the kernels.
//!
//! Skips without a GPU; `scripts/gpu-check` sets GRADACC_REQUIRE_GPU=1 so it fails instead.

mod common;

use std::ffi::c_void;
use std::sync::Arc;

use common::cuda::{gpu_or_skip, masters_equal, nccl_or_skip, ApexSeed, HostGrad};
use common::Rng;
use gradacc::backend::cuda::driver::{self, Context, DeviceBuffer, OwnedStream};
use gradacc::backend::cuda::nccl::{self, NcclComm};
use gradacc::backend::cuda::{self, layout};
use gradacc::{
    Accumulator, AccumulatorConfig, Device, Dtype, Grad, LossReduction, Normalize, Scaler,
    ScalerConfig, TensorDesc,
};

fn random_layout(rng: &mut Rng) -> Vec<TensorDesc> {
    let sizes = [1usize, 3, 7, 64, 4097, 65536, 65537, 1_000_003];
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    (0..rng.range(1, 6))
        .map(|_| TensorDesc {
            numel: sizes[rng.range(0, 7) as usize],
            dtype: dtypes[rng.range(0, 2) as usize],
        })
        .collect()
}

/// Random windows through both backends, bit for bit.
#[test]
fn random_windows_match_the_cpu_backend_bitwise() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("random_windows_match_the_cpu_backend_bitwise");
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    let modes =
        [Normalize::ByCount, Normalize::ByMicrobatches, Normalize::ByWorld, Normalize::None];
    for round in 0..24 {
        let descs = random_layout(&mut rng);
        let config = AccumulatorConfig {
            normalize: modes[round % 4],
            loss_reduction: if rng.range(0, 1) == 0 {
                LossReduction::Mean
            } else {
                LossReduction::Sum
            },
            max_grad_norm: if round % 3 == 0 { 1e-3 } else { 0.0 },
            bucket_numel: rng.range(1, 2_000_000) as usize,
            ..AccumulatorConfig::default()
        };
        let cpu = Accumulator::new(config, &descs).unwrap();
        let gpu = Accumulator::builder(&descs).device(device).config(config).build().unwrap();
        // Two windows on the same objects: the second starts by assigning, may leave a tensor
        // untouched (it must read zero), and follows a reset on even rounds.
        for window in 0..2 {
            if window == 1 && round % 2 == 0 {
                cpu.reset().unwrap();
                gpu.reset().unwrap();
            }
            let skipped = if window == 1 {
                Some(rng.range(0, descs.len() as u64 - 1) as usize)
            } else {
                None
            };
            let poison = round % 5 == 4 && window == 0;
            for m in 0..rng.range(1, 4) {
                // Each micro-batch with its own scale: a scale change inside a window.
                let scale = 2f32.powi(rng.range(0, 16) as i32);
                let sc =
                    Scaler::new(ScalerConfig { init_scale: scale, ..Default::default() }).unwrap();
                let sg =
                    Scaler::on(device, ScalerConfig { init_scale: scale, ..Default::default() })
                        .unwrap();
                let count = rng.range(1, 9);
                let grads: Vec<HostGrad> = descs
                    .iter()
                    .map(|d| HostGrad::random(&mut rng, d.dtype, d.numel, scale, poison && m == 0))
                    .collect();
                let uploads: Vec<(DeviceBuffer, u64)> = grads
                    .iter()
                    .map(|g| g.upload(&ctx, stream.stream, rng.range(0, 3) as usize))
                    .collect();
                let views: Vec<Grad<'_>> = grads.iter().map(HostGrad::view).collect();
                if skipped.is_none() && rng.range(0, 1) == 0 {
                    cpu.add(&sc, &views, count).unwrap();
                    gpu.add(&sg, &uploads.iter().map(|d| d.1).collect::<Vec<_>>(), count).unwrap();
                } else {
                    // Hook style, tensors in reverse; the last one gets two contributions (a
                    // chunked backward), the skipped one none.
                    cpu.begin_microbatch(count).unwrap();
                    gpu.begin_microbatch(count).unwrap();
                    for i in (0..descs.len()).rev().filter(|&i| Some(i) != skipped) {
                        let times = if i + 1 == descs.len() { 2 } else { 1 };
                        for _ in 0..times {
                            cpu.add_tensor(&sc, i, views[i]).unwrap();
                            gpu.add_tensor(&sg, i, uploads[i].1).unwrap();
                        }
                    }
                    cpu.end_microbatch().unwrap();
                    gpu.end_microbatch().unwrap();
                }
            }
            let want = cpu.sync(None).unwrap();
            let got = gpu.sync(None).unwrap();
            let what = format!("round {round} window {window} {descs:?} {config:?}");
            assert_eq!(want.found_inf, got.found_inf, "{what}");
            assert_eq!(
                (want.total_count, want.microbatches),
                (got.total_count, got.microbatches),
                "{what}"
            );
            assert!(
                want.grad_norm.to_bits() == got.grad_norm.to_bits()
                    || (want.grad_norm.is_nan() && got.grad_norm.is_nan()),
                "{what}: norm {} vs {}",
                want.grad_norm,
                got.grad_norm
            );
            assert_eq!(want.clip_coef.to_bits(), got.clip_coef.to_bits(), "{what}");
            masters_equal(&cpu, &gpu, &what);
        }
    }
}

#[test]
fn scaler_trace_matches_the_cpu_scaler() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("scaler_trace_matches_the_cpu_scaler");
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let configs = [
        ScalerConfig { growth_interval: 3, ..Default::default() },
        ScalerConfig { growth_interval: 2, hysteresis: 3, ..Default::default() },
        ScalerConfig {
            growth_interval: 2,
            hysteresis: 2,
            consecutive_hysteresis: true,
            max_scale: 1e6,
            ..Default::default()
        },
        ScalerConfig { dynamic: false, ..Default::default() },
        ScalerConfig { init_scale: 4.0, min_scale: 1.0, growth_interval: 50, ..Default::default() },
    ];
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    // The overflow flag reaches the device scaler through an accumulator's boundary: a window of
    // one element, infinite on an overflow step.
    let one = [TensorDesc { numel: 1, dtype: Dtype::F32 }];
    let (inf, finite) = (
        DeviceBuffer::from_slice(&ctx, stream.stream, &[f32::INFINITY]).unwrap(),
        DeviceBuffer::from_slice(&ctx, stream.stream, &[0f32]).unwrap(),
    );
    for config in configs {
        let cpu = Scaler::new(config).unwrap();
        let gpu = Scaler::on(device, config).unwrap();
        let acc = Accumulator::builder(&one).device(device).build().unwrap();
        for step in 0..300 {
            let overflow = rng.range(0, 9) < 3;
            let want = cpu.update(overflow);
            acc.add(&gpu, &[if overflow { inf.ptr() } else { finite.ptr() }], 1).unwrap();
            acc.sync_enqueue(None).unwrap();
            let got = gpu.update_from(&[&acc], true);
            match (want, got) {
                (Ok(w), Ok(g)) => assert_eq!(Some(w.skipped), g, "{config:?} step {step}"),
                (Err(w), Err(g)) => assert_eq!(w.kind, g.kind, "{config:?} step {step}"),
                (w, g) => panic!("{config:?} step {step}: cpu {w:?}, gpu {g:?}"),
            }
            assert_eq!(cpu.scale().unwrap(), gpu.scale().unwrap(), "{config:?} step {step}");
            assert_eq!(cpu.stats().unwrap(), gpu.stats().unwrap(), "{config:?} step {step}");
        }
        // The device state saves the CPU scaler's bytes and loads them back.
        assert_eq!(cpu.save().unwrap(), gpu.save().unwrap());
        gpu.load(&cpu.save().unwrap()).unwrap();
        assert_eq!(cpu.scale().unwrap(), gpu.scale().unwrap());
    }
}

#[test]
fn loss_scaling_matches_the_cpu_scaler() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("loss_scaling_matches_the_cpu_scaler");
    let ctx = Context::get(0).unwrap();
    let config = ScalerConfig { init_scale: 1024.0, ..Default::default() };
    let (cpu, gpu) = (
        Scaler::new(config).unwrap(),
        Scaler::on(Device::Cuda { ordinal: 0, stream: std::ptr::null_mut() }, config).unwrap(),
    );
    for dtype in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
        let loss = HostGrad::random(&mut rng, dtype, 1001, 1000.0, false);
        let (buf, addr) = loss.upload(&ctx, std::ptr::null_mut(), 1);
        // SAFETY: `addr` holds 1001 values of `dtype` in `buf`, alive until the end of the
        // iteration.
        unsafe { gpu.scale_loss_raw(addr as *mut c_void, 1001, dtype, "loss") }.unwrap();
        let (mut f, mut h) = (loss.f32s.clone(), loss.u16s.clone());
        cpu.scale_loss(match dtype {
            Dtype::F32 => gradacc::GradMut::F32(&mut f),
            Dtype::F16 => gradacc::GradMut::f16_bits(&mut h),
            Dtype::Bf16 => gradacc::GradMut::bf16_bits(&mut h),
        })
        .unwrap();
        if dtype == Dtype::F32 {
            let mut got = vec![0f32; 1002];
            buf.read(&mut got).unwrap();
            assert!(got[1..].iter().zip(&f).all(|(a, b)| a.to_bits() == b.to_bits()), "{dtype:?}");
        } else {
            let mut got = vec![0u16; 1002];
            buf.read(&mut got).unwrap();
            assert_eq!(&got[1..], &h[..], "{dtype:?}");
        }
    }
}

#[test]
fn shared_struct_layouts_agree_with_the_device_compiler() {
    if !gpu_or_skip() {
        return;
    }
    let sizes = cuda::device_layout_sizes(0).unwrap();
    assert_eq!(sizes.map(|s| s as usize), layout::SIZES);
}

/// The seed of the Apex O2 report on one GPU with NCCL at world size 1: weight 3.0, bias 2.0.
#[test]
fn nccl_boundary_at_world_size_one_and_the_final_microbatch() {
    if !gpu_or_skip() || !nccl_or_skip() {
        return;
    }
    let id = nccl::unique_id().unwrap();
    let comm = Arc::new(NcclComm::new(&id, 0, 1, 0).unwrap());
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    // Rank 0 of the seed: micro-batches with weight grads 0.5 and 2.5, bias 1.0 and 1.0.
    let ApexSeed { scaler, acc, first: [w1, b1], second: [w2, b2] } =
        ApexSeed::new(&ctx, stream.stream);
    acc.add(&scaler, &[w1.ptr(), b1.ptr()], 1).unwrap();
    acc.begin_final_microbatch(1, comm.clone()).unwrap();
    acc.add_tensor(&scaler, 1, b2.ptr()).unwrap();
    acc.add_tensor(&scaler, 0, w2.ptr()).unwrap();
    acc.end_microbatch().unwrap();
    let info = acc.sync(Some(&*comm)).unwrap();
    let (mut w, mut b) = ([0f32], [0f32]);
    acc.read_master(0, &mut w).unwrap();
    acc.read_master(1, &mut b).unwrap();
    assert_eq!((w[0], b[0]), (3.0, 2.0));
    assert_eq!((info.microbatches, info.found_inf), (2, false));
    // A second contribution after its bucket left is refused.
    acc.begin_final_microbatch(1, comm.clone()).unwrap();
    acc.add_tensor(&scaler, 1, b2.ptr()).unwrap();
    assert!(acc.add_tensor(&scaler, 1, b2.ptr()).is_err());
}

/// A tensor that may take two contributions in a final micro-batch added in reverse order: one
/// whose bucket also holds the tensor before it, still missing when the second contribution
/// comes (a tensor alone in its bucket starts the bucket's all-reduce with its first).
fn twice_added(buckets: &[std::ops::Range<usize>], descs: &[TensorDesc]) -> Option<usize> {
    let starts = common::aligned_offsets(descs);
    let bucket = |i: usize| buckets.iter().position(|b| b.contains(&starts[i]));
    (1..descs.len()).rev().find(|&i| bucket(i) == bucket(i - 1))
}

/// Every GPU a rank (when there are at least two): masters identical on every rank and equal
/// to the CPU backend's local communicator result.
#[test]
fn nccl_boundary_across_gpus_matches_the_local_communicator() {
    if !gpu_or_skip() || !nccl::nccl_available() {
        return;
    }
    let mut count = 0;
    unsafe { cudarc::driver::sys::cuDeviceGetCount(&mut count) };
    if count < 2 {
        eprintln!("one GPU: the multi-rank NCCL test needs two");
        return;
    }
    let world = count as usize;
    let mut rng = Rng::fresh("nccl_boundary_across_gpus_matches_the_local_communicator");
    let descs = random_layout(&mut rng);
    let config =
        AccumulatorConfig { bucket_numel: 70_000, max_grad_norm: 0.5, ..Default::default() };
    let grads: Vec<Vec<HostGrad>> = (0..world)
        .map(|_| {
            descs.iter().map(|d| HostGrad::random(&mut rng, d.dtype, d.numel, 1.0, false)).collect()
        })
        .collect();
    let local = gradacc::LocalComm::group(world).unwrap();
    let id = nccl::unique_id().unwrap();
    let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
        let handles: Vec<_> = local
            .into_iter()
            .enumerate()
            .map(|(rank, lc)| {
                let (descs, grads, id) = (&descs, &grads[rank], &id);
                s.spawn(move || {
                    let ctx = Context::get(rank as i32).unwrap();
                    let comm = Arc::new(NcclComm::new(id, rank, world, rank as i32).unwrap());
                    let device =
                        Device::Cuda { ordinal: rank as i32, stream: std::ptr::null_mut() };
                    let scaler = Scaler::on(device, ScalerConfig::default()).unwrap();
                    let acc =
                        Accumulator::builder(descs).device(device).config(config).build().unwrap();
                    let uploads: Vec<(DeviceBuffer, u64)> =
                        grads.iter().map(|g| g.upload(&ctx, std::ptr::null_mut(), 0)).collect();
                    let cpu = Accumulator::new(config, descs).unwrap();
                    let sc = Scaler::new(ScalerConfig::default()).unwrap();
                    let views: Vec<Grad<'_>> = grads.iter().map(HostGrad::view).collect();
                    acc.add(&scaler, &uploads.iter().map(|d| d.1).collect::<Vec<_>>(), 3).unwrap();
                    cpu.add(&sc, &views, 3).unwrap();
                    // The final micro-batch, tensor by tensor in reverse (buckets reduce early);
                    // one tensor comes in two contributions before its bucket is complete.
                    let twice = twice_added(acc.buckets(), descs);
                    acc.begin_final_microbatch(2, comm.clone()).unwrap();
                    cpu.begin_microbatch(2).unwrap();
                    for i in (0..descs.len()).rev() {
                        let times = if Some(i) == twice { 2 } else { 1 };
                        for _ in 0..times {
                            acc.add_tensor(&scaler, i, uploads[i].1).unwrap();
                            cpu.add_tensor(&sc, i, views[i]).unwrap();
                        }
                    }
                    acc.end_microbatch().unwrap();
                    cpu.end_microbatch().unwrap();
                    // Its buckets are reduced: nothing more may join the window before the sync.
                    let refused = acc
                        .add(&scaler, &uploads.iter().map(|d| d.1).collect::<Vec<_>>(), 1)
                        .unwrap_err();
                    assert_eq!(refused.kind, gradacc::ErrorKind::WrongState);
                    acc.sync(Some(&*comm)).unwrap();
                    cpu.sync(Some(&lc)).unwrap();
                    let mut out = Vec::new();
                    for (i, d) in descs.iter().enumerate() {
                        let mut m = vec![0f32; d.numel];
                        acc.read_master(i, &mut m).unwrap();
                        let want = cpu.with_master(i, |w| w.to_vec()).unwrap();
                        // Sums over ranks may be ordered differently by NCCL and the local ring.
                        for (a, b) in m.iter().zip(&want) {
                            assert!(
                                (a - b).abs() <= 1e-5 * b.abs().max(1e-3),
                                "rank {rank} tensor {i}: {a} vs {b}"
                            );
                        }
                        out.push(m);
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in &results[1..] {
        assert!(
            r.iter()
                .flatten()
                .zip(results[0].iter().flatten())
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "ranks differ"
        );
    }
}

/// A training step's `add` and `sync` (no host read) captured into a CUDA graph and replayed on
/// new gradient values in the same buffers: every replay equals the CPU backend's window. Capture
/// forbids pageable host-to-device copies, so `add` may not stage a table per call.
#[test]
fn add_and_sync_can_be_captured_into_a_graph() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("add_and_sync_can_be_captured_into_a_graph");
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let descs = [
        TensorDesc { numel: 4097, dtype: Dtype::F16 },
        TensorDesc { numel: 3, dtype: Dtype::Bf16 },
        TensorDesc { numel: 65537, dtype: Dtype::F32 },
    ];
    let config = AccumulatorConfig { max_grad_norm: 0.5, ..Default::default() };
    let scale = 1024.0;
    let (sc, sg) = (
        Scaler::new(ScalerConfig { init_scale: scale, ..Default::default() }).unwrap(),
        Scaler::on(
            Device::Cuda { ordinal: 0, stream: stream.stream.cast() },
            ScalerConfig { init_scale: scale, ..Default::default() },
        )
        .unwrap(),
    );
    let cpu = Accumulator::new(config, &descs).unwrap();
    let gpu = Accumulator::builder(&descs)
        .device(Device::Cuda { ordinal: 0, stream: stream.stream.cast() })
        .config(config)
        .build()
        .unwrap();
    let first: Vec<HostGrad> =
        descs.iter().map(|d| HostGrad::random(&mut rng, d.dtype, d.numel, scale, false)).collect();
    let uploads: Vec<(DeviceBuffer, u64)> =
        first.iter().map(|g| g.upload(&ctx, stream.stream, 0)).collect();
    let addresses: Vec<u64> = uploads.iter().map(|d| d.1).collect();
    driver::synchronize(&ctx, stream.stream).unwrap();

    let step = CapturedStep::new(&ctx, stream.stream, &gpu, &sg, &addresses);
    let _current = ctx.enter().unwrap();

    for replay in 0..3 {
        let grads: Vec<HostGrad> = descs
            .iter()
            .map(|d| HostGrad::random(&mut rng, d.dtype, d.numel, scale, replay == 2))
            .collect();
        rewrite(&grads, &uploads);
        step.launch(stream.stream);
        let views: Vec<Grad<'_>> = grads.iter().map(HostGrad::view).collect();
        cpu.add(&sc, &views, 3).unwrap();
        let want = cpu.sync(None).unwrap();
        masters_equal(&cpu, &gpu, &format!("replay {replay}"));
        assert_eq!(want.found_inf, replay == 2);
    }
}

/// A graph captured from an accumulator's `add` of 3 items and its boundary (no host read) on
/// `stream`, instantiated; destroyed on drop.
struct CapturedStep {
    graph: cudarc::driver::sys::CUgraph,
    exec: cudarc::driver::sys::CUgraphExec,
}

impl CapturedStep {
    fn new(
        ctx: &Context,
        stream: driver::CUstream,
        gpu: &Accumulator,
        scaler: &Scaler,
        addresses: &[u64],
    ) -> Self {
        use cudarc::driver::sys as cu;
        let (mut graph, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
        let _current = ctx.enter().unwrap();
        // SAFETY: a stream of this context; the capture ends below on every path that returns.
        let begun = unsafe {
            cu::cuStreamBeginCapture_v2(
                stream,
                cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        };
        assert_eq!(begun, cu::CUresult::CUDA_SUCCESS);
        let added = gpu.add(scaler, addresses, 3);
        let synced = added.as_ref().ok().map(|_| gpu.sync_enqueue(None));
        // SAFETY: ends the capture begun above; the graph is destroyed on drop.
        let ended = unsafe { cu::cuStreamEndCapture(stream, &mut graph) };
        added.expect("add during a capture");
        synced.unwrap().expect("sync without a host read during a capture");
        assert_eq!(ended, cu::CUresult::CUDA_SUCCESS);
        // SAFETY: a graph from a completed capture.
        let instantiated = unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
        assert_eq!(instantiated, cu::CUresult::CUDA_SUCCESS);
        CapturedStep { graph, exec }
    }

    /// One replay on `stream` (its context current).
    fn launch(&self, stream: driver::CUstream) {
        // SAFETY: an instantiated graph whose buffers the test keeps alive.
        let launched = unsafe { cudarc::driver::sys::cuGraphLaunch(self.exec, stream) };
        assert_eq!(launched, cudarc::driver::sys::CUresult::CUDA_SUCCESS);
    }
}

impl Drop for CapturedStep {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            cudarc::driver::sys::cuGraphExecDestroy(self.exec);
            cudarc::driver::sys::cuGraphDestroy(self.graph);
        }
    }
}

/// New gradient values in the device buffers a captured step reads.
fn rewrite(grads: &[HostGrad], uploads: &[(DeviceBuffer, u64)]) {
    for (g, (buf, _)) in grads.iter().zip(uploads) {
        match g.dtype {
            Dtype::F32 => buf.write(&g.f32s).unwrap(),
            _ => buf.write(&g.u16s).unwrap(),
        }
    }
}

/// A capture may not wait on work recorded outside it: the driver refuses the wait
/// (CUDA_ERROR_STREAM_CAPTURE_ISOLATION) and invalidates the capture, unless the wait is an
/// external event node (CU_EVENT_WAIT_EXTERNAL). The software GPU does as the driver.
#[test]
fn a_capture_refuses_a_plain_wait_on_work_recorded_outside_it() {
    use cudarc::driver::sys as cu;
    if !gpu_or_skip() {
        return;
    }
    let ctx = Context::get(0).unwrap();
    let (capturing, other) = (OwnedStream::new(&ctx).unwrap(), OwnedStream::new(&ctx).unwrap());
    let _current = ctx.enter().unwrap();
    let mut event = std::ptr::null_mut();
    // SAFETY: plain driver calls on live streams of the current context, with live out-pointers;
    // every capture begun here is ended here, and the event and graph are destroyed at the end.
    unsafe {
        assert_eq!(cu::cuEventCreate(&mut event, 2), cu::CUresult::CUDA_SUCCESS);
        assert_eq!(cu::cuEventRecord(event, other.stream), cu::CUresult::CUDA_SUCCESS);
        for (flags, waited, ended) in [
            (
                0,
                cu::CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
                cu::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            ),
            (1, cu::CUresult::CUDA_SUCCESS, cu::CUresult::CUDA_SUCCESS),
        ] {
            let mode = cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            assert_eq!(
                cu::cuStreamBeginCapture_v2(capturing.stream, mode),
                cu::CUresult::CUDA_SUCCESS
            );
            assert_eq!(cu::cuStreamWaitEvent(capturing.stream, event, flags), waited, "{flags}");
            let mut graph = std::ptr::null_mut();
            assert_eq!(cu::cuStreamEndCapture(capturing.stream, &mut graph), ended, "{flags}");
            assert_eq!(graph.is_null(), ended != cu::CUresult::CUDA_SUCCESS);
            if !graph.is_null() {
                cu::cuGraphDestroy(graph);
            }
        }
        // Outside a capture the external flag is invalid.
        assert_eq!(
            cu::cuStreamWaitEvent(capturing.stream, event, 1),
            cu::CUresult::CUDA_ERROR_INVALID_VALUE
        );
        cu::cuEventDestroy_v2(event);
    }
}

/// A training step captured on the accumulator's stream while the scaler lives on another
/// stream, outside the graph: the add reads the scale the scaler's last update wrote, the
/// scaler's gather reads the boundary the last replay wrote, and neither side overtakes the
/// other. Every replay, and the scaler's updates between them (a poisoned replay backs off),
/// equal the CPU backend's step.
#[test]
fn a_step_captured_on_the_accumulators_stream_orders_with_the_scalers_stream() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng =
        Rng::fresh("a_step_captured_on_the_accumulators_stream_orders_with_the_scalers_stream");
    let ctx = Context::get(0).unwrap();
    let (acc_stream, scaler_stream) =
        (OwnedStream::new(&ctx).unwrap(), OwnedStream::new(&ctx).unwrap());
    let descs = [
        TensorDesc { numel: 4097, dtype: Dtype::F16 },
        TensorDesc { numel: 3, dtype: Dtype::Bf16 },
        TensorDesc { numel: 65537, dtype: Dtype::F32 },
    ];
    let config = AccumulatorConfig { max_grad_norm: 0.5, ..Default::default() };
    let scaler_config =
        ScalerConfig { init_scale: 1024.0, growth_interval: 2, ..Default::default() };
    let sc = Scaler::new(scaler_config).unwrap();
    let sg =
        Scaler::on(Device::Cuda { ordinal: 0, stream: scaler_stream.stream.cast() }, scaler_config)
            .unwrap();
    let cpu = Accumulator::new(config, &descs).unwrap();
    let gpu = Accumulator::builder(&descs)
        .device(Device::Cuda { ordinal: 0, stream: acc_stream.stream.cast() })
        .config(config)
        .build()
        .unwrap();
    let first: Vec<HostGrad> =
        descs.iter().map(|d| HostGrad::random(&mut rng, d.dtype, d.numel, 1024.0, false)).collect();
    let uploads: Vec<(DeviceBuffer, u64)> =
        first.iter().map(|g| g.upload(&ctx, acc_stream.stream, 0)).collect();
    let addresses: Vec<u64> = uploads.iter().map(|d| d.1).collect();
    // One step outside the graph first: the capture then starts with reads and writes pending
    // on both sides.
    let views: Vec<Grad<'_>> = first.iter().map(HostGrad::view).collect();
    cpu.add(&sc, &views, 3).unwrap();
    gpu.add(&sg, &addresses, 3).unwrap();
    let want = cpu.sync(None).unwrap();
    gpu.sync_enqueue(None).unwrap();
    sc.update(want.found_inf).unwrap();
    sg.update_from(&[&gpu], false).unwrap();

    // The scaler on another stream.
    let step = CapturedStep::new(&ctx, acc_stream.stream, &gpu, &sg, &addresses);
    let _current = ctx.enter().unwrap();

    for replay in 0..5 {
        let scale = sc.scale().unwrap();
        let grads: Vec<HostGrad> = descs
            .iter()
            .map(|d| HostGrad::random(&mut rng, d.dtype, d.numel, scale, replay == 2))
            .collect();
        rewrite(&grads, &uploads);
        step.launch(acc_stream.stream);
        sg.update_from(&[&gpu], false).unwrap();
        let views: Vec<Grad<'_>> = grads.iter().map(HostGrad::view).collect();
        cpu.add(&sc, &views, 3).unwrap();
        let want = cpu.sync(None).unwrap();
        sc.update(want.found_inf).unwrap();
        masters_equal(&cpu, &gpu, &format!("replay {replay}"));
        assert_eq!(want.found_inf, replay == 2);
        assert_eq!(sg.state().unwrap(), sc.state().unwrap(), "replay {replay}");
    }
    assert_ne!(sc.scale().unwrap(), 1024.0, "the trace never moved");
}

/// A host program that resets the device's primary context (`cudaDeviceReset`) destroys every
/// object made in it, gradacc's kernels included. Objects made after the reset work (the kernels
/// are loaded again), and a call of an object made before it fails with a status that says why.
/// The reset ends every context user in the process, so the test runs in a child process.
#[test]
fn a_primary_context_reset_reloads_the_kernels_and_refuses_old_objects() {
    const CHILD: &str = "GRADACC_TEST_RESET_CHILD";
    if !gpu_or_skip() {
        return;
    }
    let test = "a_primary_context_reset_reloads_the_kernels_and_refuses_old_objects";
    if std::env::var(CHILD).is_err() {
        // On the software GPU also with a driver that refuses to push the reset context until
        // it is retained again (the real driver's choice is not documented).
        for refuses_push in ["0", "1"] {
            common::rerun(
                test,
                &[(CHILD, "1"), ("SIMGPU_RESET_REFUSES_PUSH", refuses_push)],
                &format!("the child (SIMGPU_RESET_REFUSES_PUSH={refuses_push})"),
            );
        }
        return;
    }
    let descs = [
        TensorDesc { numel: 4097, dtype: Dtype::F16 },
        TensorDesc { numel: 65537, dtype: Dtype::F32 },
    ];
    let config = AccumulatorConfig::default();
    // One step on the device, the same gradients every time.
    let step = |acc: &Accumulator, scaler: &Scaler, ctx: &Arc<Context>, stream| {
        let grads: Vec<HostGrad> = descs
            .iter()
            .map(|d| HostGrad::random(&mut Rng::seeded(7), d.dtype, d.numel, 1024.0, false))
            .collect();
        let uploads: Vec<(DeviceBuffer, u64)> =
            grads.iter().map(|g| g.upload(ctx, stream, 0)).collect();
        acc.add(scaler, &uploads.iter().map(|d| d.1).collect::<Vec<_>>(), 1)?;
        acc.sync(None)
    };
    let ctx = Context::get(0).unwrap();
    let old_stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: old_stream.stream.cast() };
    let old_scaler = Scaler::on(device, ScalerConfig::default()).unwrap();
    let old_acc = Accumulator::builder(&descs).device(device).config(config).build().unwrap();
    let before = step(&old_acc, &old_scaler, &ctx, old_stream.stream).unwrap();

    {
        use cudarc::driver::sys as cu;
        let mut dev = 0;
        // SAFETY: plain driver calls with a live out-pointer; the reset is what the test is about.
        unsafe {
            assert_eq!(cu::cuDeviceGet(&mut dev, 0), cu::CUresult::CUDA_SUCCESS);
            assert_eq!(cu::cuDevicePrimaryCtxReset_v2(dev), cu::CUresult::CUDA_SUCCESS);
        }
    }
    assert!(ctx.was_reset());
    // Addresses that were never memory: the call must fail before any kernel could touch them.
    let e = old_acc.add(&old_scaler, &[0x1000, 0x2000], 1).unwrap_err();
    assert_eq!(e.kind, gradacc::ErrorKind::DeviceFailure, "{e:?}");
    assert!(e.message.contains("primary context was reset"), "{}", e.message);

    let ctx = Context::get(0).unwrap();
    assert!(!ctx.was_reset());
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    let scaler = Scaler::on(device, ScalerConfig::default()).unwrap();
    let acc = Accumulator::builder(&descs).device(device).config(config).build().unwrap();
    let after = step(&acc, &scaler, &ctx, stream.stream).unwrap();
    assert_eq!(after.grad_norm.to_bits(), before.grad_norm.to_bits());
    // The old objects' memory went with the reset: dropping them frees nothing and fails nothing.
    drop((old_acc, old_scaler, old_stream));
}

/// The library's kernels compiled for `ctx`'s device and loaded apart from the library's own
/// cache, so a test can launch one directly.
fn kernels_of(ctx: &Context) -> driver::Module {
    let (major, minor) = ctx.capability;
    let target = cuda::compile::Target::for_device(major, minor).unwrap();
    driver::Module::load(ctx, &cuda::compile::compile(target).unwrap().image).unwrap()
}

/// Kernel `name` of `module` (looked up with `ctx` current).
fn kernel(ctx: &Context, module: &driver::Module, name: &std::ffi::CStr) -> driver::Function {
    let _current = ctx.enter().unwrap();
    module.function(name).unwrap()
}

/// The single-thread kernels (control words, scaler state) do their work once whatever the launch
/// geometry: `ga_scaler_update` launched with two blocks of 256 threads is one optimizer step.
#[test]
fn single_thread_kernels_run_once_on_a_wide_launch() {
    if !gpu_or_skip() {
        return;
    }
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let module = kernels_of(&ctx);
    let update = kernel(&ctx, &module, c"ga_scaler_update");
    let state = DeviceBuffer::from_slice(
        &ctx,
        stream.stream,
        &[layout::GaScalerState { scale: 8.0, ..Default::default() }],
    )
    .unwrap();
    let rule = layout::GaScalerRule {
        growth_factor: 2.0,
        backoff_factor: 0.5,
        min_scale: 1.0,
        max_scale: 1e9,
        growth_interval: 1000,
        hysteresis: 1,
        dynamic: 1,
        ..Default::default()
    };
    let ptr = state.ptr();
    let mut args =
        [&ptr as *const _ as *mut std::ffi::c_void, &rule as *const _ as *mut std::ffi::c_void];
    // SAFETY: the arguments follow ga_scaler_update(ga_scaler_state *, ga_scaler_rule).
    unsafe { update.launch(&ctx, 2, driver::THREADS, stream.stream, &mut args).unwrap() };
    let mut out = [layout::GaScalerState::default()];
    state.read(&mut out).unwrap();
    assert_eq!((out[0].steps, out[0].growth_tracker), (1, 1), "one step, not one per thread");
}

/// `ga_finish_norm` folds the block sums in parallel with exactly the CPU backend's order
/// (`simd::fold_block_sums`): from one sum to several rows of `FOLD_LANES`, at every width where
/// the halving moves from registers to shared memory, with sums of similar size so that any
/// other order changes the bits.
#[test]
fn finish_norm_folds_block_sums_like_the_cpu_backend() {
    use gradacc::math::FOLD_LANES;
    use gradacc::simd;
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("finish_norm_folds_block_sums_like_the_cpu_backend");
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let module = kernels_of(&ctx);
    let finish = kernel(&ctx, &module, c"ga_finish_norm");
    let threads = driver::THREADS as usize;
    let lengths = [
        1,
        2,
        3,
        threads - 1,
        threads,
        threads + 1,
        2 * threads + 3,
        FOLD_LANES / 2 + 1,
        FOLD_LANES,
        FOLD_LANES + 1,
        3 * FOLD_LANES + 1234,
    ];
    let mut differs_from_block_order = false;
    for n in lengths {
        let sums: Vec<f64> = (0..n).map(|_| rng.uniform(1.0, 2.0)).collect();
        let want = simd::fold_block_sums(&sums);
        differs_from_block_order |= want != sums.iter().fold(0.0, |t, &s| t + s);
        let partials = DeviceBuffer::from_slice(&ctx, stream.stream, &sums).unwrap();
        let start = layout::GaBoundary { divisor: 1, clip_coef: 1.0, ..Default::default() };
        let boundary = DeviceBuffer::from_slice(&ctx, stream.stream, &[start]).unwrap();
        let (b, p, blocks, max_norm) = (boundary.ptr(), partials.ptr(), n as u64, 0.0f64);
        let mut args = [
            &b as *const _ as *mut c_void,
            &p as *const _ as *mut c_void,
            &blocks as *const _ as *mut c_void,
            &max_norm as *const _ as *mut c_void,
        ];
        // SAFETY: the arguments follow ga_finish_norm(ga_boundary *, const double *, ga_u64,
        // double), over a boundary and `n` block sums allocated above.
        unsafe { finish.launch(&ctx, 1, driver::THREADS, stream.stream, &mut args).unwrap() };
        let mut out = [layout::GaBoundary::default()];
        boundary.read(&mut out).unwrap();
        assert_eq!(
            out[0].grad_norm.to_bits(),
            want.sqrt().to_bits(),
            "{n} block sums: device {:e}, CPU {:e}",
            out[0].grad_norm,
            want.sqrt()
        );
    }
    assert!(differs_from_block_order, "the sums do not tell the fold's order from block order");
}

/// A model of more tensors than one launch carries (`SOURCES_PER_LAUNCH`): `add` splits them over
/// several launches, bit for bit the CPU backend's result.
#[test]
fn many_tensors_span_several_add_launches() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("many_tensors_span_several_add_launches");
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    let descs: Vec<TensorDesc> = (0..2 * layout::SOURCES_PER_LAUNCH + 17)
        .map(|_| TensorDesc {
            numel: [1, 5, 64, 300, 8193][rng.range(0, 4) as usize],
            dtype: dtypes[rng.range(0, 2) as usize],
        })
        .collect();
    let config = AccumulatorConfig::default();
    let cpu = Accumulator::new(config, &descs).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    let gpu = Accumulator::builder(&descs).device(device).config(config).build().unwrap();
    let (sc, sg) = (
        Scaler::new(ScalerConfig::default()).unwrap(),
        Scaler::on(device, ScalerConfig::default()).unwrap(),
    );
    for _ in 0..2 {
        let grads: Vec<HostGrad> = descs
            .iter()
            .map(|d| HostGrad::random(&mut rng, d.dtype, d.numel, 65536.0, false))
            .collect();
        let uploads: Vec<(DeviceBuffer, u64)> =
            grads.iter().map(|g| g.upload(&ctx, stream.stream, 1)).collect();
        let views: Vec<Grad<'_>> = grads.iter().map(HostGrad::view).collect();
        cpu.add(&sc, &views, 2).unwrap();
        gpu.add(&sg, &uploads.iter().map(|d| d.1).collect::<Vec<_>>(), 2).unwrap();
    }
    let (want, got) = (cpu.sync(None).unwrap(), gpu.sync(None).unwrap());
    assert_eq!(want.grad_norm.to_bits(), got.grad_norm.to_bits());
    masters_equal(&cpu, &gpu, "many tensors");
}

/// A window saved mid-accumulation moves between devices: saved on CUDA and loaded on the CPU
/// (and back), the windows finish with the same bits as one that never stopped; the overflow
/// flag and the untouched tensors travel too, and a save inside a micro-batch is refused.
#[test]
fn window_checkpoints_move_between_devices() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("window_checkpoints_move_between_devices");
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    for round in 0..6 {
        let descs = random_layout(&mut rng);
        let config = AccumulatorConfig {
            bucket_numel: rng.range(1, 2_000_000) as usize,
            ..AccumulatorConfig::default()
        };
        let scale = 2f32.powi(rng.range(0, 12) as i32);
        let sc = Scaler::new(ScalerConfig { init_scale: scale, ..Default::default() }).unwrap();
        let sg =
            Scaler::on(device, ScalerConfig { init_scale: scale, ..Default::default() }).unwrap();
        let reference = Accumulator::new(config, &descs).unwrap();
        let gpu = Accumulator::builder(&descs).device(device).config(config).build().unwrap();
        let cpu = Accumulator::new(config, &descs).unwrap();
        let gpu_again = Accumulator::builder(&descs).device(device).config(config).build().unwrap();
        // One tensor left out of the first micro-batch, when there are several.
        let untouched = (descs.len() > 1).then(|| rng.range(0, descs.len() as u64 - 1) as usize);
        let poison = round % 3 == 2;
        // One micro-batch before the checkpoint, the tensor `untouched` left out.
        let first: Vec<HostGrad> = descs
            .iter()
            .map(|d| HostGrad::random(&mut rng, d.dtype, d.numel, scale, poison))
            .collect();
        let uploads: Vec<(DeviceBuffer, u64)> =
            first.iter().map(|g| g.upload(&ctx, stream.stream, 0)).collect();
        for a in [&reference, &gpu] {
            a.begin_microbatch(3).unwrap();
        }
        for i in (0..descs.len()).filter(|&i| Some(i) != untouched) {
            reference.add_tensor(&sc, i, first[i].view()).unwrap();
            gpu.add_tensor(&sg, i, uploads[i].1).unwrap();
        }
        assert_eq!(
            gpu.save_window().unwrap_err().kind,
            gradacc::ErrorKind::WrongState,
            "inside a micro-batch"
        );
        for a in [&reference, &gpu] {
            a.end_microbatch().unwrap();
        }
        // CUDA -> CPU -> CUDA, then one more micro-batch everywhere.
        cpu.load_window(&gpu.save_window().unwrap()).unwrap();
        gpu_again.load_window(&cpu.save_window().unwrap()).unwrap();
        // Merging the same window twice on either device gives the same bits (each master added
        // to itself) and twice the counts.
        let saved = gpu.save_window().unwrap();
        let (cpu_merged, gpu_merged) = (
            Accumulator::new(config, &descs).unwrap(),
            Accumulator::builder(&descs).device(device).config(config).build().unwrap(),
        );
        for a in [&cpu_merged, &gpu_merged] {
            a.merge_window(&saved).unwrap();
            a.merge_window(&saved).unwrap();
        }
        let (want, got) = (cpu_merged.sync(None).unwrap(), gpu_merged.sync(None).unwrap());
        assert_eq!(
            (want.total_count, want.microbatches, want.found_inf),
            (6, 2, poison),
            "round {round} merged"
        );
        assert_eq!(
            (got.total_count, got.microbatches, got.found_inf),
            (6, 2, poison),
            "round {round} merged"
        );
        masters_equal(&cpu_merged, &gpu_merged, &format!("round {round} merged"));
        let second: Vec<HostGrad> = descs
            .iter()
            .map(|d| HostGrad::random(&mut rng, d.dtype, d.numel, scale, false))
            .collect();
        let views: Vec<Grad<'_>> = second.iter().map(HostGrad::view).collect();
        let uploads: Vec<(DeviceBuffer, u64)> =
            second.iter().map(|g| g.upload(&ctx, stream.stream, 1)).collect();
        let addresses: Vec<u64> = uploads.iter().map(|u| u.1).collect();
        reference.add(&sc, &views, 5).unwrap();
        cpu.add(&sc, &views, 5).unwrap();
        gpu_again.add(&sg, &addresses, 5).unwrap();
        let want = reference.sync(None).unwrap();
        for (name, got) in
            [("cpu", cpu.sync(None).unwrap()), ("gpu", gpu_again.sync(None).unwrap())]
        {
            let what = format!("round {round} {name} {descs:?}");
            assert_eq!(
                (want.found_inf, want.total_count, want.microbatches),
                (got.found_inf, got.total_count, got.microbatches),
                "{what}"
            );
            assert_eq!(want.found_inf, poison, "{what}");
        }
        masters_equal(&reference, &cpu, &format!("round {round} cpu"));
        masters_equal(&reference, &gpu_again, &format!("round {round} gpu"));
    }
}

/// Eight threads give one tensor their contributions of a micro-batch at once, the first of each
/// window racing: on the device too every contribution is counted, checked exactly against the
/// serial sum (small integers, so any order gives the same bits).
#[test]
fn racing_contributions_to_one_tensor_are_all_counted() {
    if !gpu_or_skip() {
        return;
    }
    const THREADS: usize = 8;
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    let descs: Vec<TensorDesc> = [Dtype::F32, Dtype::F16, Dtype::Bf16]
        .iter()
        .map(|&dtype| TensorDesc { numel: 33, dtype })
        .collect();
    let acc = Accumulator::builder(&descs).device(device).build().unwrap();
    let scaler =
        Scaler::on(device, ScalerConfig { init_scale: 4.0, ..Default::default() }).unwrap();
    // Thread k's contribution to every element: (k + 1) × 4 (the scale), exact in every dtype.
    let uploads: Vec<Vec<(DeviceBuffer, u64)>> = (0..THREADS)
        .map(|k| {
            descs
                .iter()
                .map(|d| {
                    HostGrad::constant(d.dtype, d.numel, (4 * (k + 1)) as f32).upload(
                        &ctx,
                        stream.stream,
                        k % 3,
                    )
                })
                .collect()
        })
        .collect();
    let want = (THREADS * (THREADS + 1) / 2) as f32;
    let lost = common::race_rounds(
        THREADS,
        300,
        |_| acc.begin_microbatch(1).unwrap(),
        |k, round| acc.add_tensor(&scaler, round % 3, uploads[k][round % 3].1).unwrap(),
        |round| {
            acc.end_microbatch().unwrap();
            acc.sync(None).unwrap();
            (0..3).find_map(|t| {
                let mut got = vec![0f32; 33];
                acc.read_master(t, &mut got).unwrap();
                let expected = if t == round % 3 { want } else { 0.0 };
                let wrong = got.iter().position(|&v| v != expected)?;
                Some(format!(
                    "round {round}: tensor {t} element {wrong} is {}, not {expected}",
                    got[wrong]
                ))
            })
        },
    );
    assert!(lost.is_none(), "a contribution was lost: {}", lost.unwrap());
}

/// Gradients that share device memory with an adopted master: refused at every overlapping
/// shift, the tensor's own master included (see `common::check_overlapping_gradients`).
#[test]
fn gradients_overlapping_the_master_are_refused() {
    if !gpu_or_skip() {
        return;
    }
    use common::{check_overlapping_gradients, OVERLAP_MARGIN, OVERLAP_TENSORS};
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    let len = Accumulator::master_len(&OVERLAP_TENSORS).unwrap();
    let values: Vec<f32> = (0..2 * OVERLAP_MARGIN + len).map(|i| i as f32).collect();
    let backing = DeviceBuffer::from_slice(&ctx, stream.stream, &values).unwrap();
    let config = AccumulatorConfig {
        loss_reduction: LossReduction::Sum,
        normalize: Normalize::None,
        ..Default::default()
    };
    let master = backing.ptr() + 4 * OVERLAP_MARGIN as u64;
    // SAFETY: the master lies inside `backing`, which outlives the accumulator.
    let acc = unsafe {
        Accumulator::builder(&OVERLAP_TENSORS)
            .device(device)
            .config(config)
            .master_buffer(master as *mut f32, len)
            .build()
    }
    .unwrap();
    let scaler =
        Scaler::on(device, ScalerConfig { init_scale: 2.0, ..Default::default() }).unwrap();
    let first = DeviceBuffer::from_slice(&ctx, stream.stream, &[1.5f32; 8192]).unwrap();
    let third = DeviceBuffer::from_slice(&ctx, stream.stream, &[common::to_f16(3.0); 50]).unwrap();
    let read = |at: usize, n: usize| {
        let mut out = vec![0f32; n];
        DeviceBuffer::adopt(&ctx, stream.stream, backing.ptr() + 4 * at as u64, 4 * n)
            .read(&mut out)
            .unwrap();
        out
    };
    let tried = check_overlapping_gradients(
        &acc,
        &scaler,
        backing.ptr() as usize,
        [first.ptr() as usize, third.ptr() as usize],
        &|| read(OVERLAP_MARGIN, len),
        &read,
    );
    assert!(tried > 24_000, "{tried} shifts");
}
