//! The optimizer step on CUDA accumulators: AdamW and SGD, every weight dtype, both roundings,
//! groups and learning-rate changes bitwise equal to the CPU optimizer step after step; a skipped
//! step (decided on the device, also after `sync_enqueue` and in a replayed CUDA graph) changing
//! nothing; saved state moving between the devices; sharded steps on 2 and 3 ranks and on a
//! 2 x 2 hybrid grid writing the unsharded run's weights bit for bit; the C ABI; and bad input
//! refused with nothing changed.
//!
//! Skips without a GPU; the software GPU (scripts/sim-gpu-check) and `scripts/gpu-check` run it.

mod common;

use std::sync::Arc;

use common::cuda::{enough_devices, gpu_or_skip, nccl_devices};
use common::cuda_optimizer::{
    exact_gradient, fixed_scaler, layout, DeviceWeights, Gradient, HostWeights,
};
use common::Rng;
use gradacc::backend::cuda::driver::{self, Context, DeviceBuffer, OwnedStream};
use gradacc::backend::cuda::nccl::{self, NcclComm};
use gradacc::{
    Accumulator, AccumulatorConfig, Algorithm, Communicator, Device, Dtype, ErrorKind, Grad,
    GradMut, Optimizer, OptimizerConfig, Rounding, ScalerConfig, Sharding, Slot, TensorDesc,
    TensorGroup,
};

fn algorithms() -> Vec<Algorithm> {
    vec![
        Algorithm::adamw(),
        Algorithm::AdamW { beta1: 0.8, beta2: 0.95, eps: 1e-6, weight_decay: 0.0 },
        Algorithm::sgd(),
        Algorithm::Sgd { momentum: 0.9, dampening: 0.0, nesterov: true, weight_decay: 1e-2 },
        Algorithm::Sgd { momentum: 0.5, dampening: 0.25, nesterov: false, weight_decay: 0.0 },
    ]
}

/// Every state value of every tensor of both optimizers, bit for bit.
fn states_equal(cpu: &Optimizer, gpu: &Optimizer, n: usize, adam: bool, what: &str) {
    let slots: &[Slot] = if adam {
        &[Slot::Weights, Slot::FirstMoment, Slot::SecondMoment]
    } else {
        &[Slot::Weights, Slot::FirstMoment]
    };
    for i in 0..n {
        for &slot in slots {
            let (r0, want) = cpu.read(i, slot).unwrap();
            let (r1, got) = gpu.read(i, slot).unwrap();
            assert_eq!(r0, r1, "{what}");
            for (k, (a, b)) in want.iter().zip(&got).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{what}: tensor {i} {slot:?} element {k}: cpu {a:e} gpu {b:e}"
                );
            }
        }
    }
}

/// The model's weights on both devices, bit for bit.
fn weights_equal(host: &[HostWeights], device: &[Vec<u32>], what: &str) {
    for (i, (w, g)) in host.iter().map(HostWeights::bits).zip(device).enumerate() {
        if let Some(k) = (0..w.len()).find(|&k| w[k] != g[k]) {
            panic!(
                "{what}: tensor {i} ({:?}) weight {k}: cpu {:#x} gpu {:#x}",
                host[i].dtype, w[k], g[k]
            );
        }
    }
}

/// The padding of adopted masters: a NaN the optimizer must neither read nor write.
const PADDING: u32 = 0x7fc0_4321;

/// Device masters for `acc`'s held range laid out as its flat layout (tensor i at
/// `offset(i) - shard.start`), each element `from`'s master (an optimizer over the same layout and
/// shard), the padding PADDING.
fn adopted_masters(
    ctx: &Arc<Context>,
    stream: driver::CUstream,
    acc: &Accumulator,
    from: &Optimizer,
) -> DeviceBuffer {
    let (held, _) = acc.shard();
    let mut values = vec![f32::from_bits(PADDING); held.len()];
    for i in 0..acc.tensors().len() {
        let (r, m) = from.read(i, Slot::Weights).unwrap();
        if m.is_empty() {
            continue; // none of the tensor is held
        }
        let at = acc.offset(i).unwrap() + r.start - held.start;
        values[at..at + m.len()].copy_from_slice(&m);
    }
    DeviceBuffer::from_slice(ctx, stream, &values).unwrap()
}

/// Checks that the device buffer `masters` holds `opt`'s masters, its padding untouched (waits
/// for the stream).
fn holds_masters(acc: &Accumulator, opt: &Optimizer, masters: &DeviceBuffer, what: &str) {
    let (held, _) = acc.shard();
    let mut values = vec![0f32; held.len()];
    masters.read(&mut values).unwrap();
    let mut covered = vec![false; held.len()];
    for i in 0..acc.tensors().len() {
        let (r, m) = opt.read(i, Slot::Weights).unwrap();
        if m.is_empty() {
            continue; // none of the tensor is held
        }
        let at = acc.offset(i).unwrap() + r.start - held.start;
        for (k, v) in m.iter().enumerate() {
            assert_eq!(values[at + k].to_bits(), v.to_bits(), "{what}: tensor {i} element {k}");
            covered[at + k] = true;
        }
    }
    for (k, v) in values.iter().enumerate().filter(|(k, _)| !covered[*k]) {
        assert_eq!(v.to_bits(), PADDING, "{what}: padding element {k} was written");
    }
}

/// Every algorithm with both roundings: six steps with a learning rate that changes each time,
/// random groups, every weight dtype, a skipped step (after `sync`, and after `sync_enqueue`),
/// compared with the CPU optimizer bit for bit after each step.
#[test]
fn cuda_steps_match_the_cpu_optimizer_bitwise() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("cuda_steps_match_the_cpu_optimizer_bitwise");
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    let descs = layout();
    let numel: Vec<usize> = descs.iter().map(|d| d.numel).collect();
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    for (a, algorithm) in algorithms().into_iter().enumerate() {
        for rounding in
            [Rounding::NearestEven, Rounding::Stochastic { seed: rng.range(0, 1 << 40) }]
        {
            let what = format!("{algorithm:?} {rounding:?}");
            let config = AccumulatorConfig {
                max_grad_norm: if a % 2 == 0 { 0.5 } else { 0.0 },
                ..Default::default()
            };
            let cpu_acc = Accumulator::new(config, &descs).unwrap();
            let gpu_acc =
                Accumulator::builder(&descs).device(device).config(config).build().unwrap();
            let (sc, sg) = (fixed_scaler(Device::Cpu), fixed_scaler(device));
            let weight_dtypes: Vec<Dtype> = (0..descs.len()).map(|i| dtypes[(i + a) % 3]).collect();
            let groups: Vec<TensorGroup> = (0..descs.len())
                .map(|_| TensorGroup {
                    weight_decay: rng.range(0, 1) == 0,
                    lr_scale: rng.uniform(0.25, 2.0) as f32,
                })
                .collect();
            let mut host: Vec<HostWeights> = weight_dtypes
                .iter()
                .zip(&numel)
                .map(|(&d, &n)| HostWeights::random(&mut rng, d, n))
                .collect();
            let dev = DeviceWeights::upload(&ctx, stream.stream, &host);
            let oc = OptimizerConfig { algorithm, lr: 1e-2, rounding };
            let views: Vec<Grad<'_>> = host.iter().map(HostWeights::grad).collect();
            let cpu = Optimizer::new(&cpu_acc, oc, &groups, &views).unwrap();
            let gpu =
                Optimizer::new_device(&gpu_acc, oc, &groups, &dev.ptrs, &weight_dtypes).unwrap();
            let adam = matches!(algorithm, Algorithm::AdamW { .. });
            states_equal(&cpu, &gpu, descs.len(), adam, &format!("{what}: created"));
            for step in 0..6 {
                let what = format!("{what} step {step}");
                let lr = rng.uniform(1e-4, 5e-2) as f32;
                cpu.set_lr(lr).unwrap();
                gpu.set_lr(lr).unwrap();
                let skipped = step == 2 || step == 4;
                let enqueue = step >= 4;
                for m in 0..2 {
                    let g = Gradient::random(&mut rng, &descs, skipped && m == 1);
                    let up = g.upload(&ctx, stream.stream, &descs);
                    let ptrs: Vec<u64> = up.iter().map(DeviceBuffer::ptr).collect();
                    cpu_acc.add(&sc, &g.views(&descs), 3).unwrap();
                    gpu_acc.add(&sg, &ptrs, 3).unwrap();
                }
                cpu_acc.sync(None).unwrap();
                let before = (gpu.save().unwrap(), dev.bits(&weight_dtypes, &numel));
                let stepped = if enqueue {
                    gpu_acc.sync_enqueue(None).unwrap();
                    gpu.step_device(&gpu_acc, &dev.ptrs, None).unwrap()
                } else {
                    gpu_acc.sync(None).unwrap();
                    gpu.step_device(&gpu_acc, &dev.ptrs, None).unwrap()
                };
                let mut muts: Vec<GradMut<'_>> =
                    host.iter_mut().map(HostWeights::grad_mut).collect();
                let cpu_stepped = cpu.step(&cpu_acc, &mut muts, None).unwrap();
                assert_eq!(cpu_stepped, !skipped, "{what}");
                assert_eq!(stepped, if enqueue { None } else { Some(!skipped) }, "{what}");
                let got = dev.bits(&weight_dtypes, &numel);
                weights_equal(&host, &got, &what);
                states_equal(&cpu, &gpu, descs.len(), adam, &what);
                assert_eq!(cpu.steps(), gpu.steps(), "{what}");
                if skipped {
                    assert_eq!(
                        (gpu.save().unwrap(), got),
                        before,
                        "{what}: a skipped step changed something"
                    );
                }
            }
            // The saved state is the same bytes on both devices, and loads across them.
            assert_eq!(cpu.save().unwrap(), gpu.save().unwrap(), "{what}: saved state");
            let fresh =
                Optimizer::new_device(&gpu_acc, oc, &groups, &dev.ptrs, &weight_dtypes).unwrap();
            fresh.load(&[&cpu.save().unwrap()]).unwrap();
            assert_eq!(fresh.save().unwrap(), cpu.save().unwrap(), "{what}: loaded state");
            assert_eq!(fresh.steps(), 4, "{what}: loaded step count");
        }
    }
}

/// A CPU and a CUDA optimizer over one accumulator of each kind, and a synced window.
struct Fixture {
    _stream: OwnedStream,
    acc: Accumulator,
    opt: Optimizer,
    dev: DeviceWeights,
    dtypes: Vec<Dtype>,
    numel: Vec<usize>,
}

fn fixture(ctx: &Arc<Context>, rng: &mut Rng) -> Fixture {
    let stream = OwnedStream::new(ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    let descs = layout();
    let numel: Vec<usize> = descs.iter().map(|d| d.numel).collect();
    let dtypes: Vec<Dtype> = descs.iter().map(|d| d.dtype).collect();
    let acc = Accumulator::builder(&descs).device(device).build().unwrap();
    let host: Vec<HostWeights> =
        dtypes.iter().zip(&numel).map(|(&d, &n)| HostWeights::random(rng, d, n)).collect();
    let dev = DeviceWeights::upload(ctx, stream.stream, &host);
    let opt =
        Optimizer::new_device(&acc, OptimizerConfig::default(), &[], &dev.ptrs, &dtypes).unwrap();
    let g = Gradient::random(rng, &descs, false);
    let up = g.upload(ctx, stream.stream, &descs);
    acc.add(&fixed_scaler(device), &up.iter().map(DeviceBuffer::ptr).collect::<Vec<_>>(), 1)
        .unwrap();
    Fixture { _stream: stream, acc, opt, dev, dtypes, numel }
}

/// Wrong counts, host memory, short buffers, the wrong calls: each refused with a clear error,
/// and the masters, moments, step count and model weights keep their bits.
#[test]
fn bad_input_changes_nothing() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("cuda_optimizer_bad_input_changes_nothing");
    let ctx = Context::get(0).unwrap();
    let f = fixture(&ctx, &mut rng);
    let unchanged =
        |what: &str| (f.opt.save().unwrap(), f.dev.bits(&f.dtypes, &f.numel), what.to_string());
    // Before any sync.
    let start = unchanged("");
    let e = f.opt.step_device(&f.acc, &f.dev.ptrs, None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::WrongState, "{}", e.message);
    f.acc.sync(None).unwrap();
    let host: Vec<f32> = vec![0.0; 9001];
    let short = DeviceBuffer::zeroed(&ctx, std::ptr::null_mut(), 8).unwrap();
    let cases: Vec<(Vec<u64>, ErrorKind, &str)> = vec![
        (f.dev.ptrs[..3].to_vec(), ErrorKind::SizeMismatch, "weights"),
        (
            {
                let mut p = f.dev.ptrs.clone();
                p[2] = host.as_ptr() as u64;
                p
            },
            ErrorKind::DeviceMismatch,
            "weights[2]",
        ),
        (
            {
                let mut p = f.dev.ptrs.clone();
                p[1] = short.ptr();
                p
            },
            ErrorKind::DeviceMismatch,
            "weights[1]",
        ),
        (
            {
                let mut p = f.dev.ptrs.clone();
                p[0] = 0;
                p
            },
            ErrorKind::InvalidArgument,
            "weights[0]",
        ),
    ];
    for (ptrs, kind, names) in &cases {
        let e = f.opt.step_device(&f.acc, ptrs, None).unwrap_err();
        assert_eq!(e.kind, *kind, "{}", e.message);
        assert!(e.message.contains(names), "{}", e.message);
        let now = unchanged("");
        assert!(
            now.0 == start.0 && now.1 == start.1,
            "a refused step ({}) changed something",
            e.message
        );
    }
    // Host weights for a CUDA accumulator, at creation and at a step.
    let mut values = vec![0.5f32; 1];
    let e =
        Optimizer::new(&f.acc, OptimizerConfig::default(), &[], &[Grad::F32(&values)]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::DeviceMismatch, "{}", e.message);
    let e = f.opt.step(&f.acc, &mut [GradMut::F32(&mut values)], None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::DeviceMismatch, "{}", e.message);
    let e = Optimizer::new_device(
        &f.acc,
        OptimizerConfig::default(),
        &[],
        &[host.as_ptr() as u64; 4],
        &f.dtypes,
    )
    .unwrap_err();
    assert_eq!(e.kind, ErrorKind::DeviceMismatch, "{}", e.message);
    // Another accumulator.
    let other = fixture(&ctx, &mut rng);
    other.acc.sync(None).unwrap();
    let e = f.opt.step_device(&other.acc, &f.dev.ptrs, None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{}", e.message);
    let now = unchanged("");
    assert!(now.0 == start.0 && now.1 == start.1, "refused steps changed something");
    // Then a step works, once per window.
    assert_eq!(f.opt.step_device(&f.acc, &f.dev.ptrs, None).unwrap(), Some(true));
    assert_eq!(f.opt.steps(), 1);
    let e = f.opt.step_device(&f.acc, &f.dev.ptrs, None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::WrongState, "{}", e.message);
    assert_ne!(unchanged("").1, start.1, "the step wrote the weights");
}

/// Adopted device masters: kept at creation, stepped in place bitwise as the CPU optimizer's
/// (masters, moments, weights) for every algorithm and both roundings, loaded into (a refused
/// load leaves them bit for bit), and bad masters refused naming `masters`, creating nothing.
#[test]
fn adopted_masters_step_as_the_cpu_optimizer() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("adopted_masters_step_as_the_cpu_optimizer");
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    let descs = layout();
    let numel: Vec<usize> = descs.iter().map(|d| d.numel).collect();
    let weight_dtypes = [Dtype::Bf16, Dtype::F32, Dtype::F16, Dtype::Bf16];
    for (a, algorithm) in algorithms().into_iter().enumerate() {
        let seed = rng.range(0, 1 << 40);
        let rounding =
            if a % 2 == 0 { Rounding::NearestEven } else { Rounding::Stochastic { seed } };
        let what = format!("{algorithm:?} {rounding:?}");
        let cpu_acc = Accumulator::new(AccumulatorConfig::default(), &descs).unwrap();
        let gpu_acc = Accumulator::builder(&descs).device(device).build().unwrap();
        let (sc, sg) = (fixed_scaler(Device::Cpu), fixed_scaler(device));
        let mut host: Vec<HostWeights> = weight_dtypes
            .iter()
            .zip(&numel)
            .map(|(&d, &n)| HostWeights::random(&mut rng, d, n))
            .collect();
        let dev = DeviceWeights::upload(&ctx, stream.stream, &host);
        let len = gpu_acc.len();
        let oc = OptimizerConfig { algorithm, lr: 1e-2, rounding };
        let views: Vec<Grad<'_>> = host.iter().map(HostWeights::grad).collect();
        let cpu = Optimizer::new(&cpu_acc, oc, &[], &views).unwrap();
        let masters = adopted_masters(&ctx, stream.stream, &gpu_acc, &cpu);
        // SAFETY: `masters` outlives `gpu` (declared before it) and is only read between steps.
        let gpu = unsafe {
            Optimizer::with_masters_device(
                &gpu_acc,
                oc,
                &[],
                &dev.ptrs,
                &weight_dtypes,
                masters.ptr(),
                len,
            )
        }
        .unwrap();
        let adam = matches!(algorithm, Algorithm::AdamW { .. });
        states_equal(&cpu, &gpu, descs.len(), adam, &format!("{what}: created"));
        holds_masters(&gpu_acc, &gpu, &masters, &format!("{what}: created"));
        for step in 0..5 {
            let what = format!("{what} step {step}");
            let g = Gradient::random(&mut rng, &descs, step == 3);
            let up = g.upload(&ctx, stream.stream, &descs);
            cpu_acc.add(&sc, &g.views(&descs), 1).unwrap();
            gpu_acc.add(&sg, &up.iter().map(DeviceBuffer::ptr).collect::<Vec<_>>(), 1).unwrap();
            cpu_acc.sync(None).unwrap();
            gpu_acc.sync(None).unwrap();
            let mut muts: Vec<GradMut<'_>> = host.iter_mut().map(HostWeights::grad_mut).collect();
            assert_eq!(cpu.step(&cpu_acc, &mut muts, None).unwrap(), step != 3, "{what}");
            assert_eq!(gpu.step_device(&gpu_acc, &dev.ptrs, None).unwrap(), Some(step != 3));
            weights_equal(&host, &dev.bits(&weight_dtypes, &numel), &what);
            states_equal(&cpu, &gpu, descs.len(), adam, &what);
            holds_masters(&gpu_acc, &gpu, &masters, &what);
        }
        // A refused load leaves the masters bit for bit; a load writes the saved ones.
        let saved = cpu.save().unwrap();
        let mut before = vec![0f32; len];
        masters.read(&mut before).unwrap();
        let mut forged = saved.clone();
        forged[saved.len() / 3] ^= 8;
        assert_eq!(gpu.load(&[&forged]).unwrap_err().kind, ErrorKind::CorruptState);
        let mut after = vec![0f32; len];
        masters.read(&mut after).unwrap();
        assert!(before.iter().zip(&after).all(|(x, y)| x.to_bits() == y.to_bits()), "{what}");
        gpu.load(&[&saved]).unwrap();
        states_equal(&cpu, &gpu, descs.len(), adam, &format!("{what}: loaded"));
    }

    // Bad masters: each refused naming `masters`, nothing created.
    let acc = Accumulator::builder(&descs).device(device).build().unwrap();
    let host: Vec<HostWeights> = weight_dtypes
        .iter()
        .zip(&numel)
        .map(|(&d, &n)| HostWeights::random(&mut rng, d, n))
        .collect();
    let dev = DeviceWeights::upload(&ctx, stream.stream, &host);
    let len = acc.len();
    let good = DeviceBuffer::zeroed(&ctx, stream.stream, len * 4).unwrap();
    let short = DeviceBuffer::zeroed(&ctx, stream.stream, (len - 1) * 4).unwrap();
    let on_host = vec![0f32; len];
    let cases: [(u64, usize, ErrorKind); 6] = [
        (0, len, ErrorKind::InvalidArgument),
        (good.ptr() + 2, len - 1, ErrorKind::InvalidArgument),
        (good.ptr(), len - 1, ErrorKind::SizeMismatch),
        (good.ptr(), len + 1, ErrorKind::SizeMismatch),
        (short.ptr(), len, ErrorKind::DeviceMismatch),
        (on_host.as_ptr() as u64, len, ErrorKind::DeviceMismatch),
    ];
    let oc = OptimizerConfig::default();
    for (ptr, n, kind) in cases {
        // SAFETY: refused before the address is used (the point of the case).
        let e = unsafe {
            Optimizer::with_masters_device(&acc, oc, &[], &dev.ptrs, &weight_dtypes, ptr, n)
        }
        .unwrap_err();
        assert!(e.kind == kind && e.message.contains("masters"), "{ptr:#x} {n}: {e:?}");
    }
    // Masters that share memory with a weight: a step would write both.
    let both = DeviceBuffer::zeroed(&ctx, stream.stream, len * 4 + numel[0] * 4).unwrap();
    let mut inside = dev.ptrs.clone();
    inside[0] = both.ptr() + 4 * (len as u64 - 1);
    // SAFETY: refused before the addresses are used (the point of the case).
    let e = unsafe {
        Optimizer::with_masters_device(&acc, oc, &[], &inside, &weight_dtypes, both.ptr(), len)
    }
    .unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("overlaps"), "{e:?}");
    // Host masters for a CUDA accumulator through the host constructor: refused as ever.
    let mut values = on_host.clone();
    let views: Vec<Grad<'_>> = host.iter().map(HostWeights::grad).collect();
    // SAFETY: refused (a CUDA accumulator) before the buffer is used.
    let e = unsafe { Optimizer::with_masters(&acc, oc, &[], &views, values.as_mut_ptr(), len) }
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::DeviceMismatch, "{}", e.message);
}

/// One rank's plain (all-reduce) and sharded optimizers over the same windows of exact sums:
/// after each step the sharded one's all-gathered weights are the plain one's bit for bit.
fn sharded_rank(
    id: [u8; nccl::UNIQUE_ID_BYTES],
    ids: [u8; nccl::UNIQUE_ID_BYTES],
    world: usize,
    rank: usize,
    accumulate: bool,
    tiny: bool,
    seed: u64,
) {
    let ctx = Context::get(rank as i32).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: rank as i32, stream: stream.stream.cast() };
    let plain_comm: Arc<dyn Communicator> =
        Arc::new(NcclComm::new(&id, rank, world, rank as i32).unwrap());
    let shard_comm: Arc<dyn Communicator> =
        Arc::new(NcclComm::new(&ids, rank, world, rank as i32).unwrap());
    let mut rng = Rng::seeded(seed);
    // Tiny: under one norm block, so rank 0's shard holds every element and the others none.
    let lengths = if tiny { [20, 3, 30, 5] } else { [5000, 3, 12289, 700] };
    let descs: Vec<TensorDesc> = [Dtype::F16, Dtype::F32, Dtype::Bf16, Dtype::F16]
        .into_iter()
        .zip(lengths)
        .map(|(dtype, numel)| TensorDesc { numel, dtype })
        .collect();
    let numel: Vec<usize> = descs.iter().map(|d| d.numel).collect();
    let weight_dtypes = [Dtype::Bf16, Dtype::F32, Dtype::F16, Dtype::Bf16];
    let sharding = if accumulate {
        Sharding::Accumulate { shards: world, rank }
    } else {
        Sharding::ReduceScatter { shards: world, rank }
    };
    let config = AccumulatorConfig { max_grad_norm: 1.0, ..Default::default() };
    let plain = Accumulator::builder(&descs).device(device).config(config).build().unwrap();
    let mut builder = Accumulator::builder(&descs)
        .device(device)
        .config(AccumulatorConfig { sharding, ..config });
    if accumulate {
        builder = builder.communicator(shard_comm.clone());
    }
    let sharded = builder.build().unwrap();
    assert_eq!(sharded.shard().0.is_empty(), tiny && rank > 0, "rank {rank}'s shard");
    let host: Vec<HostWeights> = weight_dtypes
        .iter()
        .zip(&numel)
        .map(|(&d, &n)| HostWeights::random(&mut rng, d, n))
        .collect();
    let (wp, ws, wa) = (
        DeviceWeights::upload(&ctx, stream.stream, &host),
        DeviceWeights::upload(&ctx, stream.stream, &host),
        DeviceWeights::upload(&ctx, stream.stream, &host),
    );
    let seed = rng.range(0, 1 << 30);
    for (k, algorithm) in [
        Algorithm::adamw(),
        Algorithm::Sgd { momentum: 0.9, dampening: 0.0, nesterov: true, weight_decay: 1e-3 },
    ]
    .into_iter()
    .enumerate()
    {
        let rounding = if k == 0 { Rounding::Stochastic { seed } } else { Rounding::NearestEven };
        let oc = OptimizerConfig { algorithm, lr: 1e-2, rounding };
        let op = Optimizer::new_device(&plain, oc, &[], &wp.ptrs, &weight_dtypes).unwrap();
        let os = Optimizer::new_device(&sharded, oc, &[], &ws.ptrs, &weight_dtypes).unwrap();
        // The sharded optimizer again, over adopted masters of the shard.
        let masters = adopted_masters(&ctx, stream.stream, &sharded, &os);
        let len = sharded.shard().0.len();
        // SAFETY: `masters` outlives `oa` (declared before it) and is only read between steps.
        let oa = unsafe {
            Optimizer::with_masters_device(
                &sharded,
                oc,
                &[],
                &wa.ptrs,
                &weight_dtypes,
                masters.ptr(),
                len,
            )
        }
        .unwrap();
        let scaler = fixed_scaler(device);
        for step in 0..4 {
            let what = format!("world {world} rank {rank} {sharding:?} {algorithm:?} step {step}");
            op.set_lr(1e-2 / (step + 1) as f32).unwrap();
            os.set_lr(1e-2 / (step + 1) as f32).unwrap();
            oa.set_lr(1e-2 / (step + 1) as f32).unwrap();
            for m in 0..2 {
                // Every rank draws every rank's gradients, and adds its own. Their sums are
                // exact: sharded accumulation sums rank by rank each micro-batch, the all-reduce
                // micro-batch by micro-batch each rank, and NCCL in an order of its own.
                let mut own = None;
                for q in 0..world {
                    let mut g = exact_gradient(&mut rng, &descs);
                    if step == 2 && m == 1 && q == world - 1 {
                        g.f32s[1][0] = f32::INFINITY;
                    }
                    if q == rank {
                        own = Some(g);
                    }
                }
                let up = own.unwrap().upload(&ctx, stream.stream, &descs);
                let ptrs: Vec<u64> = up.iter().map(DeviceBuffer::ptr).collect();
                plain.add(&scaler, &ptrs, 2).unwrap();
                sharded.add(&scaler, &ptrs, 2).unwrap();
            }
            let ip = plain.sync(Some(&*plain_comm)).unwrap();
            let sharded_comm = if accumulate { None } else { Some(&*shard_comm) };
            let is = sharded.sync(sharded_comm).unwrap();
            assert_eq!(ip.found_inf, step == 2, "{what}");
            assert_eq!(is.found_inf, ip.found_inf, "{what}");
            assert_eq!(op.step_device(&plain, &wp.ptrs, None).unwrap(), Some(step != 2), "{what}");
            assert_eq!(
                os.step_device(&sharded, &ws.ptrs, sharded_comm).unwrap(),
                Some(step != 2),
                "{what}"
            );
            assert_eq!(
                oa.step_device(&sharded, &wa.ptrs, sharded_comm).unwrap(),
                Some(step != 2),
                "{what}"
            );
            assert_eq!(
                wp.bits(&weight_dtypes, &numel),
                ws.bits(&weight_dtypes, &numel),
                "{what}: weights"
            );
            assert_eq!(os.steps(), op.steps(), "{what}");
            let adam = matches!(algorithm, Algorithm::AdamW { .. });
            states_equal(&os, &oa, descs.len(), adam, &format!("{what}: adopted"));
            assert_eq!(wa.bits(&weight_dtypes, &numel), ws.bits(&weight_dtypes, &numel), "{what}");
            holds_masters(&sharded, &oa, &masters, &what);
        }
    }
}

fn sharded_runs(world: usize, test: &str) {
    let mut rng = Rng::fresh(test);
    for (accumulate, tiny) in [(false, false), (true, false), (false, true), (true, true)] {
        let (id, ids) = (nccl::unique_id().unwrap(), nccl::unique_id().unwrap());
        let seed = rng.range(0, u64::MAX >> 1);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    s.spawn(move || sharded_rank(id, ids, world, rank, accumulate, tiny, seed))
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        });
    }
}

#[test]
fn sharded_steps_write_the_unsharded_weights_at_two_ranks() {
    let count = nccl_devices();
    if count == 0 || !enough_devices(2, count) {
        return;
    }
    sharded_runs(2, "sharded_steps_write_the_unsharded_weights_at_two_ranks");
}

/// Three ranks: on the software GPU in a child process with three devices.
#[test]
fn sharded_steps_write_the_unsharded_weights_at_three_ranks() {
    let test = "sharded_steps_write_the_unsharded_weights_at_three_ranks";
    let count = nccl_devices();
    if count == 0 {
        return;
    }
    if count >= 3 {
        return sharded_runs(3, test);
    }
    if std::env::var("GRADACC_SIMGPU").as_deref() != Ok("1")
        || std::env::var("SIMGPU_DEVICES").is_ok()
    {
        eprintln!("not run: needs 3 devices ({count} visible)");
        return;
    }
    common::rerun(test, &[("SIMGPU_DEVICES", "3")], "the 3-device run");
}

/// The C ABI on a CUDA accumulator: created and stepped with device addresses, the same bits as
/// the Rust API; `out_stepped` after a sync that did not wait is refused before anything runs.
#[test]
fn the_c_abi_steps_cuda_accumulators() {
    use gradacc_capi as ffi;
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("the_c_abi_steps_cuda_accumulators");
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    let c_device = ffi::gradacc_device_t {
        kind: ffi::GRADACC_DEVICE_CUDA,
        ordinal: 0,
        stream: stream.stream as *mut std::ffi::c_void,
    };
    let descs = layout();
    let numel: Vec<usize> = descs.iter().map(|d| d.numel).collect();
    let dtypes: Vec<Dtype> = vec![Dtype::Bf16, Dtype::F32, Dtype::F16, Dtype::Bf16];
    let host: Vec<HostWeights> =
        dtypes.iter().zip(&numel).map(|(&d, &n)| HostWeights::random(&mut rng, d, n)).collect();
    let (rust_w, c_w) = (
        DeviceWeights::upload(&ctx, stream.stream, &host),
        DeviceWeights::upload(&ctx, stream.stream, &host),
    );
    let ok = ffi::gradacc_status_t::GRADACC_STATUS_OK;
    let c_descs: Vec<ffi::gradacc_tensor_desc_t> = descs
        .iter()
        .map(|t| ffi::gradacc_tensor_desc_t { numel: t.numel as u64, dtype: t.dtype.code() })
        .collect();
    let (mut scaler, mut acc, mut opt) =
        (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
    let config = ScalerConfig { init_scale: 1.0, dynamic: false, ..Default::default() };
    let mut sc = std::mem::MaybeUninit::uninit();
    // SAFETY: every pointer below is live for its call and of the type the function takes.
    unsafe {
        assert_eq!(ffi::gradacc_scaler_config_default(sc.as_mut_ptr()), ok);
        let mut sc = sc.assume_init();
        sc.init_scale = config.init_scale;
        sc.dynamic = false;
        assert_eq!(ffi::gradacc_scaler_create(&sc, &c_device, &mut scaler), ok);
        assert_eq!(
            ffi::gradacc_accumulator_create(
                std::ptr::null(),
                c_descs.as_ptr(),
                c_descs.len(),
                &c_device,
                &mut acc
            ),
            ok
        );
    }
    let codes: Vec<i32> = dtypes.iter().map(|d| d.code()).collect();
    let mut oc = std::mem::MaybeUninit::uninit();
    let scratch = vec![0f32; 10_000];
    let host_ptrs = [scratch.as_ptr() as *const std::ffi::c_void; 4];
    // SAFETY: as above; `host_ptrs` are host addresses, which the call must refuse untouched.
    let oc = unsafe {
        assert_eq!(ffi::gradacc_optimizer_config_default(oc.as_mut_ptr()), ok);
        let oc = oc.assume_init();
        let status = ffi::gradacc_optimizer_create(
            acc,
            &oc,
            std::ptr::null(),
            host_ptrs.as_ptr(),
            codes.as_ptr(),
            4,
            &mut opt,
        );
        assert_eq!(status, ffi::gradacc_status_t::GRADACC_STATUS_DEVICE_MISMATCH);
        assert!(opt.is_null());
        let ptrs: Vec<*const std::ffi::c_void> =
            c_w.ptrs.iter().map(|&p| p as *const std::ffi::c_void).collect();
        let status = ffi::gradacc_optimizer_create(
            acc,
            &oc,
            std::ptr::null(),
            ptrs.as_ptr(),
            codes.as_ptr(),
            4,
            &mut opt,
        );
        assert_eq!(status, ok);
        oc
    };
    let rust_acc = Accumulator::builder(&descs).device(device).build().unwrap();
    let config = OptimizerConfig { lr: oc.lr, ..OptimizerConfig::default() };
    let rust = Optimizer::new_device(&rust_acc, config, &[], &rust_w.ptrs, &dtypes).unwrap();
    let rust_scaler = fixed_scaler(device);
    let mut_ptrs: Vec<*mut std::ffi::c_void> =
        c_w.ptrs.iter().map(|&p| p as *mut std::ffi::c_void).collect();
    // A second C optimizer over adopted device masters: host masters refused, device ones taken.
    let adopted_w = DeviceWeights::upload(&ctx, stream.stream, &host);
    let masters = adopted_masters(&ctx, stream.stream, &rust_acc, &rust);
    let on_host = vec![0f32; rust_acc.len()];
    let adopted_ptrs: Vec<*mut std::ffi::c_void> =
        adopted_w.ptrs.iter().map(|&p| p as *mut std::ffi::c_void).collect();
    let mut adopted = std::ptr::null_mut();
    // SAFETY: as above; `on_host` is host memory, which the call must refuse untouched, and
    // `masters` outlives the optimizer (destroyed below).
    unsafe {
        let weights = adopted_ptrs.as_ptr() as *const *const std::ffi::c_void;
        let create = |m: *mut f32, out: &mut *mut ffi::gradacc_optimizer_t| {
            ffi::gradacc_optimizer_create_with_masters(
                acc,
                &oc,
                std::ptr::null(),
                weights,
                codes.as_ptr(),
                4,
                m,
                rust_acc.len(),
                out,
            )
        };
        let refused = create(on_host.as_ptr() as *mut f32, &mut adopted);
        assert_eq!(refused, ffi::gradacc_status_t::GRADACC_STATUS_DEVICE_MISMATCH);
        assert!(adopted.is_null());
        assert_eq!(create(masters.ptr() as *mut f32, &mut adopted), ok);
    }
    for step in 0..2 {
        let g = Gradient::random(&mut rng, &descs, false);
        let up = g.upload(&ctx, stream.stream, &descs);
        let ptrs: Vec<u64> = up.iter().map(DeviceBuffer::ptr).collect();
        let c_grads: Vec<*const std::ffi::c_void> =
            ptrs.iter().map(|&p| p as *const std::ffi::c_void).collect();
        rust_acc.add(&rust_scaler, &ptrs, 2).unwrap();
        let waits = step == 0;
        let mut stepped = false;
        // SAFETY: as above; the gradients and weights are device buffers of their tensors.
        unsafe {
            assert_eq!(ffi::gradacc_accumulator_add(acc, scaler, c_grads.as_ptr(), 4, 2), ok);
            if waits {
                let mut info = ffi::gradacc_sync_info_t {
                    struct_size: std::mem::size_of::<ffi::gradacc_sync_info_t>(),
                    ..std::mem::zeroed()
                };
                assert_eq!(ffi::gradacc_accumulator_sync(acc, std::ptr::null_mut(), &mut info), ok);
                rust_acc.sync(None).unwrap();
            } else {
                assert_eq!(
                    ffi::gradacc_accumulator_sync(acc, std::ptr::null_mut(), std::ptr::null_mut()),
                    ok
                );
                rust_acc.sync_enqueue(None).unwrap();
                let status = ffi::gradacc_optimizer_step(
                    opt,
                    acc,
                    mut_ptrs.as_ptr(),
                    4,
                    std::ptr::null_mut(),
                    &mut stepped,
                );
                assert_eq!(status, ffi::gradacc_status_t::GRADACC_STATUS_WRONG_STATE);
            }
            let out = if waits { &mut stepped as *mut bool } else { std::ptr::null_mut() };
            let status = ffi::gradacc_optimizer_step(
                opt,
                acc,
                mut_ptrs.as_ptr(),
                4,
                std::ptr::null_mut(),
                out,
            );
            assert_eq!(status, ok);
            let (no_comm, no_out) = (std::ptr::null_mut(), std::ptr::null_mut());
            let status = ffi::gradacc_optimizer_step(
                adopted,
                acc,
                adopted_ptrs.as_ptr(),
                4,
                no_comm,
                no_out,
            );
            assert_eq!(status, ok);
        }
        assert_eq!(stepped, waits, "step {step}");
        rust.step_device(&rust_acc, &rust_w.ptrs, None).unwrap();
        assert_eq!(rust_w.bits(&dtypes, &numel), c_w.bits(&dtypes, &numel), "step {step}");
        assert_eq!(rust_w.bits(&dtypes, &numel), adopted_w.bits(&dtypes, &numel), "step {step}");
        holds_masters(&rust_acc, &rust, &masters, &format!("C ABI step {step}"));
    }
    let mut steps = 0;
    // SAFETY: as above; each handle is destroyed once.
    unsafe {
        assert_eq!(ffi::gradacc_optimizer_steps(opt, &mut steps), ok);
        assert_eq!(ffi::gradacc_optimizer_destroy(opt), ok);
        assert_eq!(ffi::gradacc_optimizer_destroy(adopted), ok);
        assert_eq!(ffi::gradacc_accumulator_destroy(acc), ok);
        assert_eq!(ffi::gradacc_scaler_destroy(scaler), ok);
    }
    assert_eq!(steps, 2);
}

/// Add, boundary and step captured into one CUDA graph and replayed: each replay steps from the
/// step count in device memory and skips the replay whose gradient overflowed, with no host
/// read, bitwise as the CPU optimizer steps the same windows.
#[test]
fn a_captured_step_replays_with_the_skip_decided_on_the_device() {
    use cudarc::driver::sys as cu;
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("a_captured_step_replays_with_the_skip_decided_on_the_device");
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    let descs = layout();
    let numel: Vec<usize> = descs.iter().map(|d| d.numel).collect();
    let dtypes = vec![Dtype::F16, Dtype::Bf16, Dtype::F32, Dtype::Bf16];
    let (cpu_acc, gpu_acc) = (
        Accumulator::new(AccumulatorConfig::default(), &descs).unwrap(),
        Accumulator::builder(&descs).device(device).build().unwrap(),
    );
    let (sc, sg) = (fixed_scaler(Device::Cpu), fixed_scaler(device));
    let mut host: Vec<HostWeights> =
        dtypes.iter().zip(&numel).map(|(&d, &n)| HostWeights::random(&mut rng, d, n)).collect();
    let dev = DeviceWeights::upload(&ctx, stream.stream, &host);
    let oc = OptimizerConfig {
        algorithm: Algorithm::adamw(),
        lr: 1e-2,
        rounding: Rounding::Stochastic { seed: 7 },
    };
    let views: Vec<Grad<'_>> = host.iter().map(HostWeights::grad).collect();
    let cpu = Optimizer::new(&cpu_acc, oc, &[], &views).unwrap();
    let gpu = Optimizer::new_device(&gpu_acc, oc, &[], &dev.ptrs, &dtypes).unwrap();
    let first = Gradient::random(&mut rng, &descs, false);
    let grads = first.upload(&ctx, stream.stream, &descs);
    let addresses: Vec<u64> = grads.iter().map(DeviceBuffer::ptr).collect();
    // One step outside the graph: the captured one then opens a new window, whose clearing of
    // the overflow flag is part of the graph (the steady state of a training loop).
    gpu_acc.add(&sg, &addresses, 3).unwrap();
    gpu_acc.sync(None).unwrap();
    assert_eq!(gpu.step_device(&gpu_acc, &dev.ptrs, None).unwrap(), Some(true));
    cpu_acc.add(&sc, &first.views(&descs), 3).unwrap();
    cpu_acc.sync(None).unwrap();
    let mut muts: Vec<GradMut<'_>> = host.iter_mut().map(HostWeights::grad_mut).collect();
    assert!(cpu.step(&cpu_acc, &mut muts, None).unwrap());
    driver::synchronize(&ctx, stream.stream).unwrap();
    let _current = ctx.enter().unwrap();
    let (mut graph, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mode = cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: a stream of the current context; the capture ends right after the calls.
    assert_eq!(
        unsafe { cu::cuStreamBeginCapture_v2(stream.stream, mode) },
        cu::CUresult::CUDA_SUCCESS
    );
    let captured = gpu_acc
        .add(&sg, &addresses, 3)
        .and_then(|_| gpu_acc.sync_enqueue(None))
        .and_then(|_| gpu.step_device(&gpu_acc, &dev.ptrs, None));
    // SAFETY: ends the capture begun above; the graph is destroyed at the end.
    let ended = unsafe { cu::cuStreamEndCapture(stream.stream, &mut graph) };
    assert_eq!(captured.unwrap(), None, "no host read during the capture");
    assert_eq!(ended, cu::CUresult::CUDA_SUCCESS);
    // SAFETY: a graph from a completed capture.
    let instantiated = unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
    assert_eq!(instantiated, cu::CUresult::CUDA_SUCCESS);
    let lr_at = gpu.lr_device_ptr().unwrap();
    for replay in 0..4 {
        let what = format!("replay {replay}");
        // A schedule on the device: the replay reads the learning rate where it lies.
        let lr = rng.uniform(1e-4, 5e-2) as f32;
        let src = (&lr as *const f32).cast();
        // SAFETY: `lr_at` holds one f32 of the optimizer's context; the driver stages the
        // pageable source before returning.
        let copied = unsafe { cu::cuMemcpyHtoDAsync_v2(lr_at, src, 4, stream.stream) };
        assert_eq!(copied, cu::CUresult::CUDA_SUCCESS);
        cpu.set_lr(lr).unwrap();
        let g = Gradient::random(&mut rng, &descs, replay == 2);
        for (i, buf) in grads.iter().enumerate() {
            match descs[i].dtype {
                Dtype::F32 => buf.write(&g.f32s[i]).unwrap(),
                _ => buf.write(&g.u16s[i]).unwrap(),
            }
        }
        // SAFETY: an instantiated graph whose buffers live until the end of the test.
        let launched = unsafe { cu::cuGraphLaunch(exec, stream.stream) };
        assert_eq!(launched, cu::CUresult::CUDA_SUCCESS);
        cpu_acc.add(&sc, &g.views(&descs), 3).unwrap();
        cpu_acc.sync(None).unwrap();
        let mut muts: Vec<GradMut<'_>> = host.iter_mut().map(HostWeights::grad_mut).collect();
        assert_eq!(cpu.step(&cpu_acc, &mut muts, None).unwrap(), replay != 2, "{what}");
        weights_equal(&host, &dev.bits(&dtypes, &numel), &what);
        states_equal(&cpu, &gpu, descs.len(), true, &what);
    }
    assert_eq!((cpu.steps(), gpu.steps()), (4, 4));
    assert_eq!(gpu.lr(), cpu.lr(), "the learning rate read back from the device");
    assert_eq!(gpu.save().unwrap(), cpu.save().unwrap(), "the saved state, its learning rate too");
    // SAFETY: created above, destroyed once, after the stream ran every replay.
    unsafe {
        driver::synchronize(&ctx, stream.stream).unwrap();
        cu::cuGraphExecDestroy(exec);
        cu::cuGraphDestroy(graph);
    }
}

/// Rank `g` of a 2 x 2 grid (shard `g % 2` in shard group `g / 2`, replica group `g % 2`): a
/// hybrid boundary's optimizer, all-gathering over the shard group, against the all-reduce over
/// all four ranks, after each of three steps (the second overflowing).
fn hybrid_rank(ids: &[[u8; nccl::UNIQUE_ID_BYTES]; 5], g: usize, accumulate: bool, seed: u64) {
    let ctx = Context::get(g as i32).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: g as i32, stream: stream.stream.cast() };
    let (shard, group) = (g % 2, g / 2);
    let new = |id: &[u8; nccl::UNIQUE_ID_BYTES], rank, world| -> Arc<dyn Communicator> {
        Arc::new(NcclComm::new(id, rank, world, g as i32).unwrap())
    };
    let all = new(&ids[0], g, 4);
    let shard_comm = new(&ids[1 + group], shard, 2);
    let replicas = new(&ids[3 + shard], group, 2);
    let mut rng = Rng::seeded(seed);
    let descs = vec![
        TensorDesc { numel: 5000, dtype: Dtype::F16 },
        TensorDesc { numel: 3, dtype: Dtype::F32 },
        TensorDesc { numel: 9001, dtype: Dtype::Bf16 },
    ];
    let numel: Vec<usize> = descs.iter().map(|d| d.numel).collect();
    let dtypes = [Dtype::Bf16, Dtype::F32, Dtype::F16];
    let plain = Accumulator::builder(&descs).device(device).build().unwrap();
    let hybrid = sharded_accumulator(&descs, device, accumulate, (2, shard), &shard_comm);
    let sharding = hybrid.config().sharding;
    let host: Vec<HostWeights> =
        dtypes.iter().zip(&numel).map(|(&d, &n)| HostWeights::random(&mut rng, d, n)).collect();
    let (wp, wh) = (
        DeviceWeights::upload(&ctx, stream.stream, &host),
        DeviceWeights::upload(&ctx, stream.stream, &host),
    );
    let oc = OptimizerConfig {
        algorithm: Algorithm::adamw(),
        lr: 1e-2,
        rounding: Rounding::Stochastic { seed: 11 },
    };
    let op = Optimizer::new_device(&plain, oc, &[], &wp.ptrs, &dtypes).unwrap();
    let oh = Optimizer::new_device(&hybrid, oc, &[], &wh.ptrs, &dtypes).unwrap();
    let scaler = fixed_scaler(device);
    for step in 0..3 {
        let what = format!("grid rank {g} {sharding:?} step {step}");
        for m in 0..2 {
            let mut own = None;
            for q in 0..4 {
                let mut grad = exact_gradient(&mut rng, &descs);
                if step == 1 && m == 1 && q == 3 {
                    grad.f32s[1][0] = f32::INFINITY;
                }
                if q == g {
                    own = Some(grad);
                }
            }
            let up = own.unwrap().upload(&ctx, stream.stream, &descs);
            let ptrs: Vec<u64> = up.iter().map(DeviceBuffer::ptr).collect();
            plain.add(&scaler, &ptrs, 2).unwrap();
            hybrid.add(&scaler, &ptrs, 2).unwrap();
        }
        let ip = plain.sync(Some(&*all)).unwrap();
        let ih = hybrid.sync_hybrid(&*shard_comm, &*replicas).unwrap();
        assert_eq!((ip.found_inf, ih.found_inf), (step == 1, step == 1), "{what}");
        assert_eq!(op.step_device(&plain, &wp.ptrs, None).unwrap(), Some(step != 1), "{what}");
        let comm = if accumulate { None } else { Some(&*shard_comm) };
        assert_eq!(oh.step_device(&hybrid, &wh.ptrs, comm).unwrap(), Some(step != 1), "{what}");
        assert_eq!(wp.bits(&dtypes, &numel), wh.bits(&dtypes, &numel), "{what}: weights");
    }
}

fn hybrid_runs(test: &str) {
    let mut rng = Rng::fresh(test);
    for accumulate in [false, true] {
        let ids: [[u8; nccl::UNIQUE_ID_BYTES]; 5] =
            std::array::from_fn(|_| nccl::unique_id().unwrap());
        let seed = rng.range(0, u64::MAX >> 1);
        std::thread::scope(|s| {
            let ids = &ids;
            let handles: Vec<_> =
                (0..4).map(|g| s.spawn(move || hybrid_rank(ids, g, accumulate, seed))).collect();
            for h in handles {
                h.join().unwrap();
            }
        });
    }
}

/// A 2 x 2 grid: on the software GPU in a child process with four devices.
#[test]
fn hybrid_steps_write_the_unsharded_weights() {
    let test = "hybrid_steps_write_the_unsharded_weights";
    let count = nccl_devices();
    if count == 0 {
        return;
    }
    if count >= 4 {
        return hybrid_runs(test);
    }
    if std::env::var("GRADACC_SIMGPU").as_deref() != Ok("1")
        || std::env::var("SIMGPU_DEVICES").is_ok()
    {
        eprintln!("not run: needs 4 devices ({count} visible)");
        return;
    }
    common::rerun(test, &[("SIMGPU_DEVICES", "4")], "the 4-device run");
}

/// Begins capturing `stream` into a graph (the current thread's calls only).
fn begin_capture(stream: driver::CUstream) {
    use cudarc::driver::sys as cu;
    let mode = cu::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    // SAFETY: a stream of the current context; every caller ends the capture.
    let begun = unsafe { cu::cuStreamBeginCapture_v2(stream.cast(), mode) };
    assert_eq!(begun, cu::CUresult::CUDA_SUCCESS);
}

/// Ends the capture of `stream`: its graph, instantiated (the caller destroys both).
fn end_capture(
    stream: driver::CUstream,
) -> (cudarc::driver::sys::CUgraph, cudarc::driver::sys::CUgraphExec) {
    use cudarc::driver::sys as cu;
    let (mut graph, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: ends a capture begun by `begin_capture` on this thread.
    assert_eq!(
        unsafe { cu::cuStreamEndCapture(stream.cast(), &mut graph) },
        cu::CUresult::CUDA_SUCCESS
    );
    // SAFETY: a graph from a completed capture.
    let instantiated = unsafe { cu::cuGraphInstantiateWithFlags(&mut exec, graph, 0) };
    assert_eq!(instantiated, cu::CUresult::CUDA_SUCCESS);
    (graph, exec)
}

/// One rank of a captured sharded step: add, boundary and step (with its all-gather) captured
/// into one graph under reduce-scatter or sharded accumulation and replayed; after each replay
/// the weights are those of an unsharded optimizer stepped outside any graph, bit for bit.
fn captured_sharded_rank(
    ids: [[u8; nccl::UNIQUE_ID_BYTES]; 2],
    rank: usize,
    accumulate: bool,
    seed: u64,
    synced: &std::sync::Barrier,
) {
    use cudarc::driver::sys as cu;
    let world = 2;
    let ctx = Context::get(rank as i32).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: rank as i32, stream: stream.stream.cast() };
    let plain_comm: Arc<dyn Communicator> =
        Arc::new(NcclComm::new(&ids[0], rank, world, rank as i32).unwrap());
    let shard_comm: Arc<dyn Communicator> =
        Arc::new(NcclComm::new(&ids[1], rank, world, rank as i32).unwrap());
    let mut rng = Rng::seeded(seed);
    let descs: Vec<TensorDesc> = [(Dtype::F16, 5000), (Dtype::F32, 3), (Dtype::Bf16, 9001)]
        .into_iter()
        .map(|(dtype, numel)| TensorDesc { numel, dtype })
        .collect();
    let numel: Vec<usize> = descs.iter().map(|d| d.numel).collect();
    let dtypes = [Dtype::Bf16, Dtype::F32, Dtype::F16];
    let plain = Accumulator::builder(&descs).device(device).build().unwrap();
    let sharded = sharded_accumulator(&descs, device, accumulate, (world, rank), &shard_comm);
    let sharding = sharded.config().sharding;
    let comm = if accumulate { None } else { Some(&*shard_comm) };
    let host: Vec<HostWeights> =
        dtypes.iter().zip(&numel).map(|(&d, &n)| HostWeights::random(&mut rng, d, n)).collect();
    let (wp, ws) = (
        DeviceWeights::upload(&ctx, stream.stream, &host),
        DeviceWeights::upload(&ctx, stream.stream, &host),
    );
    let oc = OptimizerConfig { rounding: Rounding::Stochastic { seed }, ..Default::default() };
    let op = Optimizer::new_device(&plain, oc, &[], &wp.ptrs, &dtypes).unwrap();
    let os = Optimizer::new_device(&sharded, oc, &[], &ws.ptrs, &dtypes).unwrap();
    let scaler = fixed_scaler(device);
    // Every rank draws every rank's gradient and keeps its own: the same draws everywhere.
    let draw = |rng: &mut Rng| {
        let all: Vec<Gradient> = (0..world).map(|_| exact_gradient(rng, &descs)).collect();
        all.into_iter().nth(rank).unwrap()
    };
    let grads = draw(&mut rng).upload(&ctx, stream.stream, &descs);
    let addresses: Vec<u64> = grads.iter().map(DeviceBuffer::ptr).collect();
    let both = |captured: bool| {
        plain.add(&scaler, &addresses, 2).unwrap();
        plain.sync(Some(&*plain_comm)).unwrap();
        assert_eq!(op.step_device(&plain, &wp.ptrs, None).unwrap(), Some(true));
        if !captured {
            sharded.add(&scaler, &addresses, 2).unwrap();
            sharded.sync(comm).unwrap();
        }
    };
    both(false);
    let _current = ctx.enter().unwrap();
    // The first sharded step over a communicator waits for the ranks' check: never captured.
    begin_capture(stream.stream);
    let e = os.step_device(&sharded, &ws.ptrs, comm).unwrap_err();
    let (graph, exec) = end_capture(stream.stream);
    assert!(e.kind == ErrorKind::WrongState && e.message.contains("before capturing"), "{e:?}");
    // SAFETY: an empty graph, never launched.
    unsafe {
        cu::cuGraphExecDestroy(exec);
        cu::cuGraphDestroy(graph);
    }
    assert_eq!(os.step_device(&sharded, &ws.ptrs, comm).unwrap(), Some(true));
    assert_eq!(wp.bits(&dtypes, &numel), ws.bits(&dtypes, &numel), "rank {rank}: the first step");
    // The steady state: add, boundary and step in one graph.
    begin_capture(stream.stream);
    let captured = sharded
        .add(&scaler, &addresses, 2)
        .and_then(|()| sharded.sync_enqueue(comm))
        .and_then(|_| os.step_device(&sharded, &ws.ptrs, comm));
    let (graph, exec) = end_capture(stream.stream);
    assert_eq!(captured.unwrap(), None, "rank {rank}: no host read during the capture");
    for replay in 0..3 {
        let g = draw(&mut rng);
        for (i, buf) in grads.iter().enumerate() {
            match descs[i].dtype {
                Dtype::F32 => buf.write(&g.f32s[i]).unwrap(),
                _ => buf.write(&g.u16s[i]).unwrap(),
            }
        }
        // SAFETY: an instantiated graph whose buffers live until the end of the function.
        assert_eq!(unsafe { cu::cuGraphLaunch(exec, stream.stream) }, cu::CUresult::CUDA_SUCCESS);
        both(true);
        let what = format!("rank {rank} {sharding:?} replay {replay}");
        assert_eq!(wp.bits(&dtypes, &numel), ws.bits(&dtypes, &numel), "{what}");
    }
    // SAFETY: created above, destroyed once, after the stream ran every replay.
    unsafe {
        driver::synchronize(&ctx, stream.stream).unwrap();
        cu::cuGraphExecDestroy(exec);
        cu::cuGraphDestroy(graph);
    }
    // Under capture a refused step cannot tell its peers: it stops pairing on the communicator
    // (here every rank refuses alike, so none is left waiting).
    plain.add(&scaler, &addresses, 2).unwrap();
    sharded.add(&scaler, &addresses, 2).and_then(|()| sharded.sync(comm).map(drop)).unwrap();
    // No rank stops pairing before every rank's boundary is done.
    synced.wait();
    begin_capture(stream.stream);
    let e = os.step_device(&sharded, &ws.ptrs[1..], comm).unwrap_err();
    let (graph, exec) = end_capture(stream.stream);
    assert_eq!(e.kind, ErrorKind::SizeMismatch, "rank {rank}: {e:?}");
    // SAFETY: an empty graph, never launched.
    unsafe {
        cu::cuGraphExecDestroy(exec);
        cu::cuGraphDestroy(graph);
    }
    let group =
        (&*shard_comm as &dyn std::any::Any).downcast_ref::<NcclComm>().expect("an NCCL group");
    assert!(group.health().is_err(), "rank {rank}: the communicator still pairs");
}

#[test]
fn a_captured_sharded_step_replays_at_two_ranks() {
    let count = nccl_devices();
    if count == 0 || !enough_devices(2, count) {
        return;
    }
    let mut rng = Rng::fresh("a_captured_sharded_step_replays_at_two_ranks");
    for accumulate in [false, true] {
        let ids = [nccl::unique_id().unwrap(), nccl::unique_id().unwrap()];
        let seed = rng.range(0, u64::MAX >> 1);
        let synced = std::sync::Barrier::new(2);
        let synced = &synced;
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| {
                    s.spawn(move || captured_sharded_rank(ids, rank, accumulate, seed, synced))
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        });
    }
}

/// An accumulator on `device` holding shard `rank` of `shards`: under sharded accumulation over
/// `comm` with `accumulate`, else under reduce-scatter.
fn sharded_accumulator(
    descs: &[TensorDesc],
    device: Device,
    accumulate: bool,
    (shards, rank): (usize, usize),
    comm: &Arc<dyn Communicator>,
) -> Accumulator {
    let sharding = if accumulate {
        Sharding::Accumulate { shards, rank }
    } else {
        Sharding::ReduceScatter { shards, rank }
    };
    let builder = Accumulator::builder(descs)
        .device(device)
        .config(AccumulatorConfig { sharding, ..Default::default() });
    let builder = if accumulate { builder.communicator(comm.clone()) } else { builder };
    builder.build().unwrap()
}

/// One rank of [`a_sharded_step_refuses_ranks_whose_schedules_differ`]: a first sharded step
/// together, then rank 1's learning rate (set by the host, or written on the device where a
/// schedule would) or step count (its state before that step, loaded) differs, and the second
/// step fails on both ranks with nothing changed.
fn schedule_rank(id: [u8; nccl::UNIQUE_ID_BYTES], rank: usize, accumulate: bool, how: &str) {
    use cudarc::driver::sys as cu;
    let ctx = Context::get(rank as i32).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: rank as i32, stream: stream.stream.cast() };
    let comm: Arc<dyn Communicator> = Arc::new(NcclComm::new(&id, rank, 2, rank as i32).unwrap());
    let mut rng = Rng::seeded(17);
    let descs = layout();
    let numel: Vec<usize> = descs.iter().map(|d| d.numel).collect();
    let dtypes: Vec<Dtype> = descs.iter().map(|d| d.dtype).collect();
    let acc = sharded_accumulator(&descs, device, accumulate, (2, rank), &comm);
    let host: Vec<HostWeights> =
        dtypes.iter().zip(&numel).map(|(&d, &n)| HostWeights::random(&mut rng, d, n)).collect();
    let w = DeviceWeights::upload(&ctx, stream.stream, &host);
    let oc = OptimizerConfig { lr: 1e-2, ..Default::default() };
    let opt = Optimizer::new_device(&acc, oc, &[], &w.ptrs, &dtypes).unwrap();
    let before_first = opt.save().unwrap();
    let scaler = fixed_scaler(device);
    let on = if accumulate { None } else { Some(&*comm) };
    let window = |rng: &mut Rng| {
        let up = exact_gradient(rng, &descs).upload(&ctx, stream.stream, &descs);
        let ptrs: Vec<u64> = up.iter().map(DeviceBuffer::ptr).collect();
        acc.add(&scaler, &ptrs, 1).unwrap();
        acc.sync(on).unwrap();
    };
    window(&mut rng);
    assert_eq!(opt.step_device(&acc, &w.ptrs, on).unwrap(), Some(true), "{how}");
    if rank == 1 {
        match how {
            "set_lr" => opt.set_lr(5e-3).unwrap(),
            "device lr" => {
                let lr = 5e-3f32;
                let src = (&lr as *const f32).cast();
                let _current = ctx.enter().unwrap();
                // SAFETY: the address holds the optimizer's one f32 of this context; the driver
                // stages the pageable source before returning.
                let copied = unsafe {
                    cu::cuMemcpyHtoDAsync_v2(opt.lr_device_ptr().unwrap(), src, 4, stream.stream)
                };
                assert_eq!(copied, cu::CUresult::CUDA_SUCCESS);
            }
            _ => opt.load(&[&before_first[..]]).unwrap(),
        }
    }
    window(&mut rng);
    let (saved, kept) = (opt.save().unwrap(), w.bits(&dtypes, &numel));
    let e = opt.step_device(&acc, &w.ptrs, on).unwrap_err();
    let what = format!("{how}, accumulate {accumulate}, rank {rank}");
    assert!(
        e.kind == ErrorKind::SizeMismatch && e.message.contains("optimizers differ"),
        "{what}: {e:?}"
    );
    assert!(opt.save().unwrap() == saved, "{what}: the state changed");
    assert_eq!(w.bits(&dtypes, &numel), kept, "{what}: the weights changed");
}

/// Ranks whose learning rates or step counts differ, as their devices hold them, fail their
/// sharded step together under reduce-scatter and sharded accumulation: each would step its
/// shard by its own rate and the all-gather would mix them into one model.
#[test]
fn a_sharded_step_refuses_ranks_whose_schedules_differ() {
    let count = nccl_devices();
    if count == 0 || !enough_devices(2, count) {
        return;
    }
    for accumulate in [false, true] {
        for how in ["set_lr", "device lr", "steps"] {
            let id = nccl::unique_id().unwrap();
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..2)
                    .map(|rank| s.spawn(move || schedule_rank(id, rank, accumulate, how)))
                    .collect();
                handles.into_iter().for_each(|h| h.join().unwrap());
            });
        }
    }
}
