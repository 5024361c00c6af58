//! The optimizer's smaller state formats on CUDA accumulators (bf16 moments rounded
//! stochastically, masters as the bf16 weight plus a remainder, no masters): AdamW and SGD, with both
//! roundings where the format allows, bitwise equal to the CPU optimizer step after step (a
//! skipped step included), saved state moving between the devices, and sharded steps at two
//! ranks (ZeRO-1 and ZeRO-2 over NCCL) writing the unsharded run's weights bit for bit.
//!
//! Skips without a GPU; the software GPU (scripts/sim-gpu-check) and `scripts/gpu-check` run it.

mod common;

use std::sync::Arc;

use common::cuda::{enough_devices, gpu_or_skip, nccl_or_skip};
use common::cuda_optimizer::{
    exact_gradient, fixed_scaler, layout, DeviceWeights, Gradient, HostWeights,
};
use common::Rng;
use gradacc::backend::cuda::driver::{Context, DeviceBuffer, OwnedStream};
use gradacc::backend::cuda::nccl::{self, NcclComm};
use gradacc::{
    Accumulator, AccumulatorConfig, Algorithm, Communicator, Device, Dtype, ErrorKind, Grad,
    GradMut, MasterFormat, MomentFormat, Optimizer, OptimizerConfig, Rounding, Sharding,
    StateFormat, TensorDesc, WeightFormat,
};

/// Every format with AdamW and SGD with momentum, both roundings where the format takes them,
/// f16 and f32 weights beside bf16 ones where it takes them: six steps with a learning rate that
/// changes each time and a skipped one, the model's weights and the saved state (every master,
/// remainder and moment) bitwise the CPU optimizer's after every step.
#[test]
fn cuda_formats_match_the_cpu_optimizer_bitwise() {
    if !gpu_or_skip() {
        return;
    }
    let mut rng = Rng::fresh("cuda_formats_match_the_cpu_optimizer_bitwise");
    let ctx = Context::get(0).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: 0, stream: stream.stream.cast() };
    let descs = layout();
    let numel: Vec<usize> = descs.iter().map(|d| d.numel).collect();
    let algorithms = [
        Algorithm::adamw(),
        Algorithm::Sgd { momentum: 0.9, dampening: 0.0, nesterov: true, weight_decay: 1e-2 },
    ];
    let formats = [
        StateFormat { masters: MasterFormat::Bf16Remainder, moments: MomentFormat::F32 },
        StateFormat { masters: MasterFormat::F32, moments: MomentFormat::Bf16 { seed: 11 } },
        StateFormat {
            masters: MasterFormat::Bf16Remainder,
            moments: MomentFormat::Bf16 { seed: rng.next_u64() },
        },
        StateFormat { masters: MasterFormat::None, moments: MomentFormat::F32 },
        StateFormat { masters: MasterFormat::None, moments: MomentFormat::Bf16 { seed: 12 } },
    ];
    for algorithm in algorithms {
        for format in formats {
            let remainders = format.masters == MasterFormat::Bf16Remainder;
            let roundings: &[Rounding] = match format.masters {
                MasterFormat::Bf16Remainder => &[Rounding::NearestEven],
                // 16-bit weights without masters are rounded stochastically.
                MasterFormat::None => &[Rounding::Stochastic { seed: 5 }],
                MasterFormat::F32 => &[Rounding::NearestEven, Rounding::Stochastic { seed: 5 }],
            };
            for &rounding in roundings {
                let what = format!("{algorithm:?} {format:?} {rounding:?}");
                let config = AccumulatorConfig::default();
                let cpu_acc = Accumulator::new(config, &descs).unwrap();
                let gpu_acc =
                    Accumulator::builder(&descs).device(device).config(config).build().unwrap();
                let (sc, sg) = (fixed_scaler(Device::Cpu), fixed_scaler(device));
                let all = [Dtype::F32, Dtype::F16, Dtype::Bf16];
                let weight_dtypes: Vec<Dtype> = (0..descs.len())
                    .map(|i| if remainders { Dtype::Bf16 } else { all[i % 3] })
                    .collect();
                let mut host: Vec<HostWeights> = weight_dtypes
                    .iter()
                    .zip(&numel)
                    .map(|(&d, &n)| HostWeights::random(&mut rng, d, n))
                    .collect();
                let dev = DeviceWeights::upload(&ctx, stream.stream, &host);
                let oc = OptimizerConfig { algorithm, lr: 1e-2, rounding };
                let views: Vec<Grad<'_>> = host.iter().map(HostWeights::grad).collect();
                let cpu = Optimizer::builder(&cpu_acc)
                    .config(oc)
                    .state(format)
                    .weights(&views)
                    .build()
                    .unwrap();
                let gpu = Optimizer::builder(&gpu_acc)
                    .config(oc)
                    .state(format)
                    .device_weights(&dev.ptrs, &weight_dtypes)
                    .build()
                    .unwrap();
                assert_eq!(cpu.save().unwrap(), gpu.save().unwrap(), "{what}: created");
                for step in 0..6 {
                    let what = format!("{what} step {step}");
                    let lr = rng.uniform(1e-4, 5e-2) as f32;
                    cpu.set_lr(lr).unwrap();
                    gpu.set_lr(lr).unwrap();
                    let skipped = step == 2;
                    for m in 0..2 {
                        let g = Gradient::random(&mut rng, &descs, skipped && m == 1);
                        let up = g.upload(&ctx, stream.stream, &descs);
                        let ptrs: Vec<u64> = up.iter().map(DeviceBuffer::ptr).collect();
                        cpu_acc.add(&sc, &g.views(&descs), 3).unwrap();
                        gpu_acc.add(&sg, &ptrs, 3).unwrap();
                    }
                    cpu_acc.sync(None).unwrap();
                    gpu_acc.sync(None).unwrap();
                    let stepped = gpu.step_device(&gpu_acc, &dev.ptrs, None).unwrap();
                    let mut muts: Vec<GradMut<'_>> =
                        host.iter_mut().map(HostWeights::grad_mut).collect();
                    assert_eq!(cpu.step(&cpu_acc, &mut muts, None).unwrap(), !skipped, "{what}");
                    assert_eq!(stepped, Some(!skipped), "{what}");
                    let got = dev.bits(&weight_dtypes, &numel);
                    for (i, (w, g)) in host.iter().map(HostWeights::bits).zip(&got).enumerate() {
                        if let Some(k) = (0..w.len()).find(|&k| w[k] != g[k]) {
                            panic!(
                                "{what}: tensor {i} weight {k}: cpu {:#x} gpu {:#x}",
                                w[k], g[k]
                            );
                        }
                    }
                    assert_eq!(cpu.save().unwrap(), gpu.save().unwrap(), "{what}: state");
                }
                // Saved state moves between the devices.
                let fresh = Optimizer::builder(&gpu_acc)
                    .config(oc)
                    .state(format)
                    .device_weights(&dev.ptrs, &weight_dtypes)
                    .build()
                    .unwrap();
                fresh.load(&[&cpu.save().unwrap()]).unwrap();
                assert_eq!(fresh.save().unwrap(), cpu.save().unwrap(), "{what}: loaded");
                assert_eq!(fresh.steps(), 5, "{what}: loaded step count");
            }
        }
    }
    // 8-bit blockwise moments are the host's alone: refused by name.
    let acc = Accumulator::builder(&descs).device(device).build().unwrap();
    let dtypes = vec![Dtype::Bf16; descs.len()];
    let host: Vec<HostWeights> =
        numel.iter().map(|&n| HostWeights::random(&mut rng, Dtype::Bf16, n)).collect();
    let dev = DeviceWeights::upload(&ctx, stream.stream, &host);
    let int8 = StateFormat { moments: MomentFormat::Int8Blockwise, ..Default::default() };
    let e = Optimizer::builder(&acc)
        .state(int8)
        .device_weights(&dev.ptrs, &dtypes)
        .build()
        .unwrap_err();
    assert!(e.kind == ErrorKind::InvalidArgument && e.message.contains("`moments`"), "{e:?}");
    // So are FP8 weights, even under the sharded boundary they are made for.
    let one = AccumulatorConfig {
        sharding: Sharding::ReduceScatter { shards: 1, rank: 0 },
        ..Default::default()
    };
    let acc = Accumulator::builder(&descs).config(one).device(device).build().unwrap();
    let mut formats = vec![WeightFormat::Model; descs.len()];
    formats[1] = WeightFormat::E4m3Tensorwise;
    let e = Optimizer::builder(&acc)
        .weight_formats(&formats)
        .device_weights(&dev.ptrs, &dtypes)
        .build()
        .unwrap_err();
    assert!(
        e.kind == ErrorKind::InvalidArgument && e.message.contains("`weight_formats[1]`"),
        "{e:?}"
    );
}

/// One rank of two: an all-reduce optimizer and a sharded one (`accumulate`: ZeRO-2, else
/// ZeRO-1) in `format` over the same windows of exact sums; after each step (the third
/// overflowing) the sharded one's all-gathered weights are the all-reduce one's bit for bit.
fn sharded_rank(ids: [[u8; nccl::UNIQUE_ID_BYTES]; 2], rank: usize, accumulate: bool, seed: u64) {
    let world = 2;
    let ctx = Context::get(rank as i32).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: rank as i32, stream: stream.stream.cast() };
    let plain_comm: Arc<dyn Communicator> =
        Arc::new(NcclComm::new(&ids[0], rank, world, rank as i32).unwrap());
    let shard_comm: Arc<dyn Communicator> =
        Arc::new(NcclComm::new(&ids[1], rank, world, rank as i32).unwrap());
    let mut rng = Rng::seeded(seed);
    let descs: Vec<TensorDesc> = [(Dtype::F16, 5000), (Dtype::F32, 3), (Dtype::Bf16, 12289)]
        .into_iter()
        .map(|(dtype, numel)| TensorDesc { numel, dtype })
        .collect();
    let numel: Vec<usize> = descs.iter().map(|d| d.numel).collect();
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
    let formats = [
        StateFormat { masters: MasterFormat::Bf16Remainder, moments: MomentFormat::Bf16 { seed } },
        StateFormat { masters: MasterFormat::F32, moments: MomentFormat::Bf16 { seed: 3 } },
        StateFormat { masters: MasterFormat::None, moments: MomentFormat::Bf16 { seed: 4 } },
    ];
    for (k, format) in formats.into_iter().enumerate() {
        let weight_dtypes =
            if k == 0 { [Dtype::Bf16; 3] } else { [Dtype::F16, Dtype::F32, Dtype::Bf16] };
        let host: Vec<HostWeights> = weight_dtypes
            .iter()
            .zip(&numel)
            .map(|(&d, &n)| HostWeights::random(&mut rng, d, n))
            .collect();
        let (wp, ws) = (
            DeviceWeights::upload(&ctx, stream.stream, &host),
            DeviceWeights::upload(&ctx, stream.stream, &host),
        );
        let rounding = if k == 0 { Rounding::NearestEven } else { Rounding::Stochastic { seed } };
        let oc = OptimizerConfig { algorithm: Algorithm::adamw(), lr: 1e-2, rounding };
        let make = |acc: &Accumulator, w: &DeviceWeights| {
            Optimizer::builder(acc)
                .config(oc)
                .state(format)
                .device_weights(&w.ptrs, &weight_dtypes)
                .build()
                .unwrap()
        };
        let (op, os) = (make(&plain, &wp), make(&sharded, &ws));
        let scaler = fixed_scaler(device);
        for step in 0..4 {
            let what = format!("rank {rank} {sharding:?} {format:?} step {step}");
            for m in 0..2 {
                // Every rank draws every rank's gradients and adds its own.
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
            plain.sync(Some(&*plain_comm)).unwrap();
            let sharded_comm = if accumulate { None } else { Some(&*shard_comm) };
            sharded.sync(sharded_comm).unwrap();
            assert_eq!(op.step_device(&plain, &wp.ptrs, None).unwrap(), Some(step != 2), "{what}");
            let stepped = os.step_device(&sharded, &ws.ptrs, sharded_comm).unwrap();
            assert_eq!(stepped, Some(step != 2), "{what}");
            let (a, b) = (wp.bits(&weight_dtypes, &numel), ws.bits(&weight_dtypes, &numel));
            assert_eq!(a, b, "{what}: weights");
            assert_eq!(os.steps(), op.steps(), "{what}");
        }
    }
}

/// ZeRO-1 and ZeRO-2 at two ranks over NCCL, in the smaller formats.
#[test]
fn sharded_formats_write_the_unsharded_weights() {
    if !gpu_or_skip() || !nccl_or_skip() {
        return;
    }
    let mut count = 0;
    // SAFETY: the driver loads (gpu_or_skip); a valid out-pointer.
    unsafe { cudarc::driver::sys::cuDeviceGetCount(&mut count) };
    if !enough_devices(2, count) {
        return;
    }
    let mut rng = Rng::fresh("sharded_formats_write_the_unsharded_weights");
    for accumulate in [false, true] {
        let ids = [nccl::unique_id().unwrap(), nccl::unique_id().unwrap()];
        let seed = rng.range(0, u64::MAX >> 1);
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2)
                .map(|rank| s.spawn(move || sharded_rank(ids, rank, accumulate, seed)))
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        });
    }
}
