//! The CUDA backend with its objects on different streams and devices, against the CPU backend,
//! bit for bit: a scaler and accumulators each on a stream of its own (updates between windows
//! that other accumulators' adds still read, the scaler destroyed right after adds, a boundary
//! rewritten before the scaler's stream has read it, an accumulator dropped right after its early
//! bucket reductions), two ranks of one process on two devices with stream-ordered masters, and
//! the per-thread default stream refused; and the caller's current context, as it was, after
//! every call.
//!
//! Nothing here waits for the scaler's stream between the steps that need ordering, so on the
//! software GPU (whose race detector sees every access of every stream) a missing event is a
//! reported race, not a lucky timing. Skips without a GPU; GRADACC_REQUIRE_GPU=1 fails instead.

mod common;

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use common::cuda::{gpu_or_skip, masters_equal, nccl_or_skip};
use common::{to_bf16, to_f16, Rng};
use gradacc::backend::cuda::driver::{self, Context, DeviceBuffer, OwnedStream};
use gradacc::backend::cuda::nccl::{self, NcclComm};
use gradacc::{
    Accumulator, AccumulatorConfig, Device, Dtype, ErrorKind, Grad, Scaler, ScalerConfig,
    TensorDesc,
};
use gradacc_capi as ffi;

/// Tensors of every dtype; 37 elements leave the next tensor's master unaligned.
const TENSORS: [TensorDesc; 3] = [
    TensorDesc { numel: 3000, dtype: Dtype::F16 },
    TensorDesc { numel: 37, dtype: Dtype::Bf16 },
    TensorDesc { numel: 1025, dtype: Dtype::F32 },
];

/// Scale changes often: growth every second finite step, backoff on an overflow.
fn scaler_config() -> ScalerConfig {
    ScalerConfig { init_scale: 1024.0, growth_interval: 2, ..Default::default() }
}

/// Device 0 with `stream` ordering its objects' work.
fn on(stream: &OwnedStream) -> Device {
    Device::Cuda { ordinal: 0, stream: stream.stream.cast() }
}

/// One micro-batch's gradients: host values for the CPU backend, device copies for the CUDA one.
struct Batch {
    host: Vec<(Vec<f32>, Vec<u16>)>,
    device: Vec<DeviceBuffer>,
}

impl Batch {
    /// Random gradients of about `scale` / 100 (one inf in tensor 0 with `poison`), copied to the
    /// device on `stream`, the stream that reads them.
    fn new(
        rng: &mut Rng,
        ctx: &Arc<Context>,
        stream: driver::CUstream,
        scale: f32,
        poison: bool,
    ) -> Batch {
        let mut host = Vec::new();
        let mut device = Vec::new();
        for (i, d) in TENSORS.iter().enumerate() {
            let mut f32s: Vec<f32> = (0..d.numel)
                .map(|_| (rng.uniform(-1.0, 1.0) * scale as f64 * 0.01) as f32)
                .collect();
            if poison && i == 0 {
                f32s[rng.range(0, d.numel as u64 - 1) as usize] = f32::INFINITY;
            }
            let u16s: Vec<u16> = match d.dtype {
                Dtype::F16 => f32s.iter().map(|&v| to_f16(v)).collect(),
                Dtype::Bf16 => f32s.iter().map(|&v| to_bf16(v)).collect(),
                Dtype::F32 => Vec::new(),
            };
            device.push(match d.dtype {
                Dtype::F32 => DeviceBuffer::from_slice(ctx, stream, &f32s).unwrap(),
                _ => DeviceBuffer::from_slice(ctx, stream, &u16s).unwrap(),
            });
            host.push((f32s, u16s));
        }
        Batch { host, device }
    }

    fn views(&self) -> Vec<Grad<'_>> {
        TENSORS
            .iter()
            .zip(&self.host)
            .map(|(d, (f, h))| match d.dtype {
                Dtype::F32 => Grad::F32(f),
                Dtype::F16 => Grad::f16_bits(h),
                Dtype::Bf16 => Grad::bf16_bits(h),
            })
            .collect()
    }

    fn ptrs(&self) -> Vec<u64> {
        self.device.iter().map(DeviceBuffer::ptr).collect()
    }

    /// The micro-batch through both backends: all at once, or tensor by tensor in reverse (as
    /// backward hooks deliver them).
    fn add(
        &self,
        cpu: (&Accumulator, &Scaler),
        gpu: (&Accumulator, &Scaler),
        count: u64,
        hooks: bool,
    ) {
        let (views, ptrs) = (self.views(), self.ptrs());
        if hooks {
            cpu.0.begin_microbatch(count).unwrap();
            gpu.0.begin_microbatch(count).unwrap();
            for i in (0..TENSORS.len()).rev() {
                cpu.0.add_tensor(cpu.1, i, views[i]).unwrap();
                gpu.0.add_tensor(gpu.1, i, ptrs[i]).unwrap();
            }
            cpu.0.end_microbatch().unwrap();
            gpu.0.end_microbatch().unwrap();
        } else {
            cpu.0.add(cpu.1, &views, count).unwrap();
            gpu.0.add(gpu.1, &ptrs, count).unwrap();
        }
    }
}

/// Ends an optimizer step on both backends from one accumulator's window.
fn step(cpu: (&Accumulator, &Scaler), gpu: (&Accumulator, &Scaler)) {
    let info = cpu.0.sync(None).unwrap();
    gpu.0.sync_enqueue(None).unwrap();
    cpu.1.update(info.found_inf).unwrap();
    assert_eq!(gpu.1.update_from(&[gpu.0], false).unwrap(), None);
}

/// Scaler and two accumulators on three streams, six windows. Accumulator `a`'s step ends (its
/// update changes the scale) while `b`'s adds that read the old scale are still queued on `b`'s
/// stream; the next window's boundary of each accumulator is written while the scaler's stream
/// may not have gathered the last one yet.
#[test]
fn an_update_waits_for_adds_of_accumulators_not_passed_to_it() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("an_update_waits_for_adds_of_accumulators_not_passed_to_it");
    let ctx = Context::get(0).unwrap();
    let (ss, sa, sb) = (
        OwnedStream::new(&ctx).unwrap(),
        OwnedStream::new(&ctx).unwrap(),
        OwnedStream::new(&ctx).unwrap(),
    );
    let config = AccumulatorConfig::default();
    let (cs, gs) =
        (Scaler::new(scaler_config()).unwrap(), Scaler::on(on(&ss), scaler_config()).unwrap());
    let (ca, cb) =
        (Accumulator::new(config, &TENSORS).unwrap(), Accumulator::new(config, &TENSORS).unwrap());
    let ga = Accumulator::builder(&TENSORS).device(on(&sa)).config(config).build().unwrap();
    let gb = Accumulator::builder(&TENSORS).device(on(&sb)).config(config).build().unwrap();
    let mut batches = Vec::new();
    for window in 0..6 {
        for m in 0..2 {
            let (count, scale) = (rng.range(1, 5), cs.scale().unwrap());
            let a = Batch::new(&mut rng, &ctx, sa.stream, scale, false);
            let b = Batch::new(&mut rng, &ctx, sb.stream, scale, window == 2 && m == 1);
            a.add((&ca, &cs), (&ga, &gs), count, m == 1);
            b.add((&cb, &cs), (&gb, &gs), count, m == 0);
            batches.extend([a, b]);
        }
        step((&ca, &cs), (&ga, &gs));
        step((&cb, &cs), (&gb, &gs));
        if window % 2 == 1 {
            masters_equal(&ca, &ga, &format!("window {window} a"));
            masters_equal(&cb, &gb, &format!("window {window} b"));
        }
    }
    assert_eq!(cs.scale().unwrap(), gs.scale().unwrap());
    let stats = cs.stats().unwrap();
    assert_eq!(stats, gs.stats().unwrap());
    assert!(stats.backoffs == 1 && stats.growths > 0, "{stats:?}");
}

/// The scaler is destroyed as soon as adds on other streams that read its state are enqueued:
/// its state must be freed after them.
#[test]
fn the_scaler_destroyed_right_after_adds_on_other_streams() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("the_scaler_destroyed_right_after_adds_on_other_streams");
    let ctx = Context::get(0).unwrap();
    let (ss, sa, sb) = (
        OwnedStream::new(&ctx).unwrap(),
        OwnedStream::new(&ctx).unwrap(),
        OwnedStream::new(&ctx).unwrap(),
    );
    let config = AccumulatorConfig::default();
    let (ca, cb) =
        (Accumulator::new(config, &TENSORS).unwrap(), Accumulator::new(config, &TENSORS).unwrap());
    let ga = Accumulator::builder(&TENSORS).device(on(&sa)).config(config).build().unwrap();
    let gb = Accumulator::builder(&TENSORS).device(on(&sb)).config(config).build().unwrap();
    for round in 0..3 {
        let (cs, gs) =
            (Scaler::new(scaler_config()).unwrap(), Scaler::on(on(&ss), scaler_config()).unwrap());
        let a = Batch::new(&mut rng, &ctx, sa.stream, cs.scale().unwrap(), false);
        let b = Batch::new(&mut rng, &ctx, sb.stream, cs.scale().unwrap(), false);
        a.add((&ca, &cs), (&ga, &gs), 2, round == 1);
        b.add((&cb, &cs), (&gb, &gs), 3, round != 1);
        drop(gs);
        ca.sync(None).unwrap();
        cb.sync(None).unwrap();
        ga.sync_enqueue(None).unwrap();
        gb.sync_enqueue(None).unwrap();
        masters_equal(&ca, &ga, &format!("round {round} a"));
        masters_equal(&cb, &gb, &format!("round {round} b"));
    }
}

/// Windows back to back with nothing but a scaler's queued gather between them: each sync
/// rewrites the boundary that a scaler's stream reads for the update before it. Two scalers on
/// two streams take turns, so a window's adds wait for the other scaler's stream, never for the
/// one still to read the last boundary.
#[test]
fn a_boundary_is_rewritten_only_after_the_scaler_stream_read_it() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("a_boundary_is_rewritten_only_after_the_scaler_stream_read_it");
    let ctx = Context::get(0).unwrap();
    let streams = [OwnedStream::new(&ctx).unwrap(), OwnedStream::new(&ctx).unwrap()];
    let sa = OwnedStream::new(&ctx).unwrap();
    let config = AccumulatorConfig::default();
    let cpu = [Scaler::new(scaler_config()).unwrap(), Scaler::new(scaler_config()).unwrap()];
    let gpu = [
        Scaler::on(on(&streams[0]), scaler_config()).unwrap(),
        Scaler::on(on(&streams[1]), scaler_config()).unwrap(),
    ];
    let ca = Accumulator::new(config, &TENSORS).unwrap();
    let ga = Accumulator::builder(&TENSORS).device(on(&sa)).config(config).build().unwrap();
    let mut batches = Vec::new();
    for window in 0..8 {
        let (cs, gs) = (&cpu[window % 2], &gpu[window % 2]);
        let a = Batch::new(&mut rng, &ctx, sa.stream, cs.scale().unwrap(), window % 3 == 1);
        a.add((&ca, cs), (&ga, gs), 1 + window as u64, window % 4 == 3);
        batches.push(a);
        step((&ca, cs), (&ga, gs));
        // A second sync at once closes an empty window: refused at world size 1, and the
        // boundary the scaler gathers from is left as it was.
        assert_eq!(ga.sync_enqueue(None).unwrap_err().kind, ErrorKind::EmptyWindow);
        assert_eq!(ca.sync(None).unwrap_err().kind, ErrorKind::EmptyWindow);
    }
    masters_equal(&ca, &ga, "last window");
    for (cs, gs) in cpu.iter().zip(&gpu) {
        assert_eq!(cs.scale().unwrap(), gs.scale().unwrap());
        assert_eq!(cs.stats().unwrap(), gs.stats().unwrap());
    }
}

/// The accumulator's master is all-reduced bucket by bucket on its communication stream as the
/// final micro-batch arrives; dropped right after, the master is freed only after those
/// reductions. A second accumulator then runs the same window to the end against the CPU.
#[test]
fn an_accumulator_dropped_right_after_early_reductions() {
    if !gpu_or_skip() || !nccl_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("an_accumulator_dropped_right_after_early_reductions");
    let ctx = Context::get(0).unwrap();
    let (ss, sa) = (OwnedStream::new(&ctx).unwrap(), OwnedStream::new(&ctx).unwrap());
    let comm = Arc::new(NcclComm::new(&nccl::unique_id().unwrap(), 0, 1, 0).unwrap());
    let config = AccumulatorConfig { bucket_numel: 1000, ..Default::default() };
    let (cs, gs) =
        (Scaler::new(scaler_config()).unwrap(), Scaler::on(on(&ss), scaler_config()).unwrap());
    for keep in [false, false, true] {
        let ca = Accumulator::new(config, &TENSORS).unwrap();
        let ga = Accumulator::builder(&TENSORS).device(on(&sa)).config(config).build().unwrap();
        let first = Batch::new(&mut rng, &ctx, sa.stream, cs.scale().unwrap(), false);
        first.add((&ca, &cs), (&ga, &gs), 2, false);
        let last = Batch::new(&mut rng, &ctx, sa.stream, cs.scale().unwrap(), false);
        let (views, ptrs) = (last.views(), last.ptrs());
        ga.begin_final_microbatch(3, comm.clone()).unwrap();
        ca.begin_microbatch(3).unwrap();
        for i in (0..TENSORS.len()).rev() {
            ga.add_tensor(&gs, i, ptrs[i]).unwrap();
            ca.add_tensor(&cs, i, views[i]).unwrap();
        }
        ga.end_microbatch().unwrap();
        ca.end_microbatch().unwrap();
        if !keep {
            drop(ga);
            continue;
        }
        let want = ca.sync(None).unwrap();
        let got = ga.sync(Some(&*comm)).unwrap();
        assert_eq!(want.grad_norm.to_bits(), got.grad_norm.to_bits());
        masters_equal(&ca, &ga, "after the final micro-batch");
    }
}

/// Two ranks of one process on devices 0 and 1 over NCCL, each with its scaler and accumulator
/// on streams of their own and stream-ordered masters (pool allocations, which the other
/// device's NCCL kernels reach only once the pool grants it access; without memory pools,
/// plain allocations freed after their stream). Windows with an overflow, with early bucket
/// reductions, a sync right after a sync, and an accumulator dropped right after early
/// reductions; every rank bitwise equal to the CPU backend over the local communicator.
#[test]
fn two_ranks_in_one_process_with_stream_ordered_masters() {
    if !gpu_or_skip() || !nccl_or_skip() {
        return;
    }
    if !common::cuda::enough_devices(2, driver::device_count()) {
        return;
    }
    let id = nccl::unique_id().unwrap();
    let local = gradacc::LocalComm::group(2).unwrap();
    let config = AccumulatorConfig { bucket_numel: 1000, max_grad_norm: 0.5, ..Default::default() };
    std::thread::scope(|s| {
        for (rank, lc) in local.into_iter().enumerate() {
            let id = &id;
            s.spawn(move || {
                let mut rng = Rng::seeded(7 + rank as u64);
                let ordinal = rank as i32;
                let ctx = Context::get(ordinal).unwrap();
                // The software GPU's switch for a device without memory pools: the fallback ran.
                if std::env::var("SIMGPU_MEMORY_POOLS").as_deref() == Ok("0") {
                    assert!(!ctx.memory_pools());
                }
                let comm = Arc::new(NcclComm::new(id, rank, 2, ordinal).unwrap());
                let (ss, sa) = (OwnedStream::new(&ctx).unwrap(), OwnedStream::new(&ctx).unwrap());
                let (cs, gs) = (
                    Scaler::new(scaler_config()).unwrap(),
                    Scaler::on(Device::Cuda { ordinal, stream: ss.stream.cast() }, scaler_config())
                        .unwrap(),
                );
                let mut batches = Vec::new();
                for window in 0..4 {
                    let ca = Accumulator::new(config, &TENSORS).unwrap();
                    let ga = Accumulator::builder(&TENSORS)
                        .device(Device::Cuda { ordinal, stream: sa.stream.cast() })
                        .config(config)
                        .build()
                        .unwrap();
                    let first = Batch::new(
                        &mut rng,
                        &ctx,
                        sa.stream,
                        cs.scale().unwrap(),
                        window == 1 && rank == 1,
                    );
                    first.add((&ca, &cs), (&ga, &gs), 2 + rank as u64, window % 2 == 0);
                    let last = Batch::new(&mut rng, &ctx, sa.stream, cs.scale().unwrap(), false);
                    let (views, ptrs) = (last.views(), last.ptrs());
                    ga.begin_final_microbatch(1, comm.clone()).unwrap();
                    ca.begin_microbatch(1).unwrap();
                    for i in (0..TENSORS.len()).rev() {
                        ga.add_tensor(&gs, i, ptrs[i]).unwrap();
                        ca.add_tensor(&cs, i, views[i]).unwrap();
                    }
                    ga.end_microbatch().unwrap();
                    ca.end_microbatch().unwrap();
                    batches.extend([first, last]);
                    if window == 2 {
                        // Dropped right after its buckets went out (on both ranks alike, so no
                        // rank waits for a collective the other never issues).
                        drop(ga);
                        continue;
                    }
                    let info = ca.sync(Some(&lc)).unwrap();
                    ga.sync_enqueue(Some(&*comm)).unwrap();
                    cs.update(info.found_inf).unwrap();
                    gs.update_from(&[&ga], false).unwrap();
                    masters_equal(&ca, &ga, &format!("rank {rank} window {window}"));
                    // A sync right after the sync: an empty window on every rank, whose boundary
                    // overwrites the one the scaler's stream gathered; its update is no step.
                    // (The master then reads zero on the device, while the CPU, which refuses
                    // the empty window before touching it, keeps the last result.)
                    ga.sync_enqueue(Some(&*comm)).unwrap();
                    assert_eq!(ca.sync(Some(&lc)).unwrap_err().kind, ErrorKind::EmptyWindow);
                    gs.update_from(&[&ga], false).unwrap();
                }
                assert_eq!(cs.scale().unwrap(), gs.scale().unwrap(), "rank {rank}");
                assert_eq!(cs.stats().unwrap(), gs.stats().unwrap(), "rank {rank}");
            });
        }
    });
}

/// `CU_STREAM_PER_THREAD` (0x2) is another stream on every calling thread: refused wherever a
/// stream enters, naming the argument and the value. The legacy stream (NULL, 0x1) is accepted.
#[test]
fn the_per_thread_default_stream_is_refused() {
    if !gpu_or_skip() {
        return;
    }
    let per_thread = 0x2 as driver::CUstream;
    let device = Device::Cuda { ordinal: 0, stream: per_thread.cast() };
    let err =
        Scaler::on(device, ScalerConfig::default()).expect_err("a scaler on the per-thread stream");
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    assert!(err.message.contains("`stream` = 0x2"), "{}", err.message);
    let err = Accumulator::builder(&TENSORS)
        .device(device)
        .build()
        .expect_err("an accumulator on the per-thread stream");
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    assert!(err.message.contains("`stream` = 0x2"), "{}", err.message);

    let device = ffi::gradacc_device_t {
        kind: ffi::GRADACC_DEVICE_CUDA,
        ordinal: 0,
        stream: 0x2 as *mut c_void,
    };
    let last_error =
        || unsafe { CStr::from_ptr(ffi::gradacc_last_error()) }.to_string_lossy().into_owned();
    let mut scaler = std::ptr::null_mut();
    assert_eq!(
        unsafe { ffi::gradacc_scaler_create(std::ptr::null(), &device, &mut scaler) },
        ffi::GRADACC_STATUS_INVALID_ARGUMENT
    );
    assert!(scaler.is_null() && last_error().contains("`device`.stream = 0x2"), "{}", last_error());
    let descs: Vec<ffi::gradacc_tensor_desc_t> = TENSORS
        .iter()
        .map(|t| ffi::gradacc_tensor_desc_t { numel: t.numel as u64, dtype: t.dtype.code() })
        .collect();
    let mut acc = std::ptr::null_mut();
    assert_eq!(
        unsafe {
            ffi::gradacc_accumulator_create(
                std::ptr::null(),
                descs.as_ptr(),
                descs.len(),
                &device,
                &mut acc,
            )
        },
        ffi::GRADACC_STATUS_INVALID_ARGUMENT
    );
    assert!(acc.is_null() && last_error().contains("`device`.stream = 0x2"), "{}", last_error());

    for legacy in [std::ptr::null_mut(), 0x1 as driver::CUstream] {
        let device = Device::Cuda { ordinal: 0, stream: legacy.cast() };
        let scaler = Scaler::on(device, ScalerConfig::default()).unwrap();
        let acc = Accumulator::builder(&TENSORS).device(device).build().unwrap();
        assert_eq!(scaler.scale().unwrap(), ScalerConfig::default().init_scale);
        drop((acc, scaler));
    }
}

/// The caller's current context on this thread, or null.
fn current_context() -> cudarc::driver::sys::CUcontext {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: the driver loaded (gpu_or_skip); it writes one CUcontext to a live local.
    unsafe { cudarc::driver::sys::cuCtxGetCurrent(&mut ctx) };
    ctx
}

/// Every kind of call on device 0, each followed by a check that the current context is the one
/// current before it.
fn calls_keep_the_context(what: &str, seed: u64) {
    let expected = current_context();
    let check = |call: &str| {
        assert_eq!(current_context(), expected, "{what}: {call} changed the current context")
    };
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    check("a stream of the test");
    let device = on(&stream);
    let scaler = Scaler::on(device, scaler_config()).unwrap();
    check("Scaler::on");
    let acc = Accumulator::builder(&TENSORS)
        .device(device)
        .config(AccumulatorConfig { max_grad_norm: 1.0, ..Default::default() })
        .build()
        .unwrap();
    check("Accumulator::on");
    let batch = Batch::new(&mut Rng::seeded(seed), &ctx, stream.stream, 1024.0, false);
    let ptrs = batch.ptrs();
    check("the test's upload");
    acc.add(&scaler, &ptrs, 3).unwrap();
    check("add");
    assert!(acc.add(&scaler, &ptrs[..1], 3).is_err());
    check("a refused add");
    acc.begin_microbatch(2).unwrap();
    check("begin_microbatch");
    for (i, &p) in ptrs.iter().enumerate().rev() {
        acc.add_tensor(&scaler, i, p).unwrap();
        check("add_tensor");
    }
    acc.end_microbatch().unwrap();
    check("end_microbatch");
    let bytes = acc.save_window().unwrap();
    check("save_window");
    acc.load_window(&bytes).unwrap();
    check("load_window");
    acc.sync(None).unwrap();
    check("sync");
    scaler.update_from(&[&acc], true).unwrap();
    check("the scaler's update");
    scaler.scale().unwrap();
    check("scale");
    acc.read_master(2, &mut vec![0.0; TENSORS[2].numel]).unwrap();
    check("read_master");
    let state = scaler.save().unwrap();
    check("the scaler's save");
    scaler.load(&state).unwrap();
    check("the scaler's load");
    drop(acc);
    check("dropping the accumulator");
    drop(scaler);
    check("dropping the scaler");
    drop((batch, stream));
}

/// gradacc works in the device's primary context and leaves the caller's current context as it
/// found it after every call, failing ones included (docs/cuda.md): with no context current, and
/// with another device's current (where there is one).
#[test]
fn every_call_leaves_the_callers_context_current() {
    if !gpu_or_skip() {
        return;
    }
    let seed = Rng::fresh("every_call_leaves_the_callers_context_current").next_u64();
    // A thread of its own starts with no context current.
    std::thread::spawn(move || {
        assert!(current_context().is_null());
        calls_keep_the_context("no context current", seed);
    })
    .join()
    .unwrap();
    let mut devices = 0;
    // SAFETY: the driver loaded (gpu_or_skip); it writes one `int` to a live local.
    unsafe { cudarc::driver::sys::cuDeviceGetCount(&mut devices) };
    if devices >= 2 {
        let _current = Context::get(1).unwrap().enter().unwrap();
        assert!(!current_context().is_null());
        calls_keep_the_context("device 1's context current", seed);
    }
}
