//! The aligned master layout: every tensor's master starts at a multiple of MASTER_ALIGN bytes
//! under every sharding policy and dtype, the padding stays zero and never enters a result, the
//! results are the f64 reference's, and windows saved by 0.2 (tensors packed) still load.

mod common;

use common::*;
use gradacc::accumulator::MASTER_ALIGN;
use gradacc::{
    Accumulator, AccumulatorConfig, Communicator, Dtype, ErrorKind, Grad, LocalComm, LossReduction,
    Normalize, Scaler, ScalerConfig, Sharding, TensorDesc,
};

/// Odd sizes, every dtype, and a tensor that crosses a norm block.
fn odd_tensors() -> Vec<TensorDesc> {
    [(3, Dtype::F16), (4097, Dtype::Bf16), (1, Dtype::F32), (65, Dtype::F16), (5003, Dtype::F32)]
        .iter()
        .map(|&(numel, dtype)| TensorDesc { numel, dtype })
        .collect()
}

fn unit_scaler() -> Scaler {
    Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap()
}

/// Small integers in every dtype: every sum is exact, in any order, so the reference is exact.
fn values(rank: usize, micro: usize, t: usize, numel: usize) -> Vec<f32> {
    (0..numel).map(|i| ((i * 7 + t * 3 + rank * 5 + micro) % 13) as f32 - 6.0).collect()
}

fn add_micro(acc: &Accumulator, scaler: &Scaler, rank: usize, micro: usize) {
    let tensors = acc.tensors().to_vec();
    let encoded: Vec<(Vec<f32>, Vec<u16>)> = tensors
        .iter()
        .enumerate()
        .map(|(t, d)| encode(d.dtype, &values(rank, micro, t, d.numel), 1.0))
        .collect();
    let grads: Vec<Grad> =
        tensors.iter().zip(&encoded).map(|(d, e)| grad_of(d.dtype, &e.0, &e.1)).collect();
    acc.add(scaler, &grads, 1).unwrap();
}

#[test]
fn every_tensor_master_starts_aligned_and_the_padding_stays_zero() {
    let tensors = odd_tensors();
    let world = 3;
    let policies = |rank| {
        [
            Sharding::None,
            Sharding::ReduceScatter { shards: world, rank },
            Sharding::Accumulate { shards: world, rank },
        ]
    };
    for policy in 0..3 {
        let comms = LocalComm::group(world).unwrap();
        let results: Vec<(std::ops::Range<usize>, Vec<f32>, f64)> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let tensors = &tensors;
                    s.spawn(move || {
                        let rank = comm.rank();
                        let config = AccumulatorConfig {
                            sharding: policies(rank)[policy],
                            loss_reduction: LossReduction::Sum,
                            normalize: Normalize::None,
                            bucket_numel: 4096,
                            ..Default::default()
                        };
                        let comm = std::sync::Arc::new(comm);
                        let acc = match config.sharding {
                            Sharding::Accumulate { .. } => Accumulator::builder(tensors)
                                .config(config)
                                .communicator(comm.clone())
                                .build()
                                .unwrap(),
                            _ => Accumulator::new(config, tensors).unwrap(),
                        };
                        assert_eq!(acc.len(), Accumulator::master_len(tensors).unwrap());
                        let base = acc.shard().1 as usize - 4 * acc.shard().0.start;
                        for i in 0..tensors.len() {
                            let offset = acc.offset(i).unwrap();
                            assert_eq!(offset * 4 % MASTER_ALIGN, 0, "tensor {i} at {offset}");
                            assert_eq!((base + 4 * offset) % MASTER_ALIGN, 0, "tensor {i}");
                        }
                        let scaler = unit_scaler();
                        add_micro(&acc, &scaler, rank, 0);
                        // Tensor by tensor, in the backward's order.
                        acc.begin_microbatch(1).unwrap();
                        let encoded: Vec<(Vec<f32>, Vec<u16>)> = tensors
                            .iter()
                            .enumerate()
                            .map(|(t, d)| encode(d.dtype, &values(rank, 1, t, d.numel), 1.0))
                            .collect();
                        for t in (0..tensors.len()).rev() {
                            let g = grad_of(tensors[t].dtype, &encoded[t].0, &encoded[t].1);
                            acc.add_tensor(&scaler, t, g).unwrap();
                        }
                        acc.end_microbatch().unwrap();
                        let info = acc.sync(Some(&*comm)).unwrap();
                        let (range, ptr) = acc.shard();
                        // SAFETY: the live accumulator's shard, unwritten until its next
                        // micro-batch.
                        let shard = unsafe { std::slice::from_raw_parts(ptr, range.len()) };
                        (range, shard.to_vec(), info.grad_norm)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let layout = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
        // The reference: the exact sum over ranks and micro-batches, tensor by tensor.
        let want: Vec<Vec<f32>> = tensors
            .iter()
            .enumerate()
            .map(|(t, d)| {
                (0..d.numel)
                    .map(|i| {
                        let mut sum = 0f64;
                        for r in 0..world {
                            for m in 0..2 {
                                sum += decoded(d.dtype, values(r, m, t, d.numel)[i], 1.0);
                            }
                        }
                        sum as f32
                    })
                    .collect()
            })
            .collect();
        let want_flat = flat_master(&layout, &want);
        let norm = want.iter().flatten().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt();
        for (rank, (range, shard, grad_norm)) in results.iter().enumerate() {
            let what = format!("policy {policy} rank {rank} shard {range:?}");
            assert!(
                shard
                    .iter()
                    .zip(&want_flat[range.clone()])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: not the reference's bits (or the padding is not zero)"
            );
            assert_eq!(grad_norm.to_bits(), results[0].2.to_bits(), "{what}: the norm differs");
            assert!((grad_norm - norm).abs() <= 1e-12 * norm, "{what}: norm {grad_norm} vs {norm}");
        }
    }
}

/// A whole window saved by 0.2 (tensors packed back to back) loads into the aligned layout, and
/// syncs as the same window added here.
#[test]
fn a_window_saved_by_0_2_loads_into_the_aligned_layout() {
    let tensors = odd_tensors();
    let config = AccumulatorConfig {
        loss_reduction: LossReduction::Sum,
        normalize: Normalize::ByCount,
        ..Default::default()
    };
    let scaler = unit_scaler();
    let direct = Accumulator::new(config, &tensors).unwrap();
    add_micro(&direct, &scaler, 0, 0);
    let packed: Vec<f32> =
        (0..tensors.len()).flat_map(|t| direct.with_master(t, |m| m.to_vec()).unwrap()).collect();
    let written = vec![true; tensors.len()];
    let old =
        window_saved_by_0_2(&tensors, config.bucket_numel, None, (1, 1, false), &written, &packed);
    let want = direct.save_window().unwrap();
    let loaded = Accumulator::new(config, &tensors).unwrap();
    loaded.load_window(&old).unwrap();
    assert_eq!(loaded.save_window().unwrap(), want);
    let merged = Accumulator::new(config, &tensors).unwrap();
    merged.merge_window(&old).unwrap();
    assert_eq!(merged.save_window().unwrap(), want);
    assert_eq!(loaded.sync(None).unwrap(), direct.sync(None).unwrap());
    for t in 0..tensors.len() {
        let (a, b) = (loaded.with_master(t, |m| m.to_vec()), direct.with_master(t, |m| m.to_vec()));
        assert_eq!(a.unwrap(), b.unwrap(), "tensor {t}");
    }
}

/// A shard saved by 0.2 loads when it holds the same elements in both layouts (one shard), and
/// is refused, leaving the accumulator as it was, when the padding moves its boundary.
#[test]
fn a_shard_saved_by_0_2_loads_where_it_holds_the_same_elements() {
    let tensors = odd_tensors();
    let config = |shards, rank| AccumulatorConfig {
        sharding: Sharding::Accumulate { shards, rank },
        loss_reduction: LossReduction::Sum,
        ..Default::default()
    };
    let packed_len: usize = tensors.iter().map(|t| t.numel).sum();
    let written = vec![true; tensors.len()];
    let masters: Vec<f32> = (0..packed_len).map(|i| (i % 11) as f32).collect();
    let old = window_saved_by_0_2(
        &tensors,
        config(1, 0).bucket_numel,
        Some((1, 0)),
        (2, 1, false),
        &written,
        &masters,
    );
    let one = Accumulator::new(config(1, 0), &tensors).unwrap();
    one.load_window(&old).unwrap();
    let offsets = packed_offsets(&tensors);
    for t in 0..tensors.len() {
        let got = one.with_master(t, |m| m.to_vec()).unwrap();
        assert_eq!(got, masters[offsets[t]..offsets[t + 1]], "tensor {t}");
    }

    // Shard 1 of 2: packed it starts at element 8192, aligned the padding moves the tensors.
    let comms = LocalComm::group(2).unwrap();
    let shard = packed_len.div_ceil(2).next_multiple_of(4096);
    let old = window_saved_by_0_2(
        &tensors,
        config(2, 1).bucket_numel,
        Some((2, 1)),
        (2, 1, false),
        &written,
        &masters[shard..],
    );
    let comm = std::sync::Arc::new(comms.into_iter().nth(1).unwrap());
    let acc =
        Accumulator::builder(&tensors).config(config(2, 1)).communicator(comm).build().unwrap();
    let before = acc.save_window().unwrap();
    let e = acc.load_window(&old).unwrap_err();
    assert_eq!(e.kind, ErrorKind::SizeMismatch, "{e}");
    assert!(e.message.contains("saved by 0.2") && e.message.contains("aligned"), "{e}");
    assert_eq!(acc.save_window().unwrap(), before, "a refused load changed the window");
}
