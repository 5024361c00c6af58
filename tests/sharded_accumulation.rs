//! Sharded accumulation (ZeRO-2): each rank keeps only its shard and reduce-scatters every
//! micro-batch. Checked against an independent f64 reference on random windows, against itself
//! across the ways a micro-batch arrives, and on the seed scenarios and misuse.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use gradacc::*;

/// A group of `world` in-process ranks, as the accumulator holds them.
fn group(world: usize) -> Vec<Arc<dyn Communicator>> {
    LocalComm::group(world)
        .unwrap()
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect()
}

/// Runs `f(rank, comm)` on one thread per rank of a new group; returns the results in rank order.
fn on_ranks<T: Send>(
    world: usize,
    f: impl Fn(usize, &Arc<dyn Communicator>) -> T + Sync,
) -> Vec<T> {
    let comms = group(world);
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> =
            comms.iter().enumerate().map(|(r, c)| s.spawn(move || f(r, c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn sharded(
    config: AccumulatorConfig,
    tensors: &[TensorDesc],
    comm: &Arc<dyn Communicator>,
) -> Accumulator {
    let sharding = Sharding::Accumulate { shards: comm.world_size(), rank: comm.rank() };
    Accumulator::builder(tensors)
        .config(AccumulatorConfig { sharding, ..config })
        .communicator(comm.clone())
        .build()
        .unwrap()
}

fn scaler(scale: f32) -> Scaler {
    Scaler::new(ScalerConfig { init_scale: scale, min_scale: 1.0, ..Default::default() }).unwrap()
}

/// The shard's bits, read safely; the same as at the address `shard()` gives.
fn shard_bits(acc: &Accumulator) -> Vec<u32> {
    let bits: Vec<u32> = acc.with_shard(|s| s.iter().map(|v| v.to_bits()).collect()).unwrap();
    let (range, ptr) = acc.shard();
    // SAFETY: the live accumulator's shard, unwritten until its next micro-batch.
    let raw = unsafe { std::slice::from_raw_parts(ptr, range.len()) };
    assert!(
        raw.iter().map(|v| v.to_bits()).eq(bits.iter().copied()),
        "with_shard and shard() differ"
    );
    bits
}

/// One micro-batch of one rank, encoded: per tensor the buffer the caller holds, or none (a
/// tensor that received nothing through `add_tensor`).
struct Micro {
    count: u64,
    scale: f32,
    grads: Vec<Option<(Vec<f32>, Vec<u16>)>>,
}

impl Micro {
    fn views<'a>(&'a self, tensors: &[TensorDesc]) -> Vec<Option<Grad<'a>>> {
        self.grads
            .iter()
            .zip(tensors)
            .map(|(g, t)| g.as_ref().map(|e| grad_of(t.dtype, &e.0, &e.1)))
            .collect()
    }
}

/// Adds `m` whole (`add`, every tensor present) or tensor by tensor in `order`, from `threads`
/// threads.
fn add_micro(
    acc: &Accumulator,
    tensors: &[TensorDesc],
    m: &Micro,
    hook: Option<(&[usize], usize)>,
) {
    let s = scaler(m.scale);
    let views = m.views(tensors);
    match hook {
        None => {
            let grads: Vec<Grad> =
                views.iter().map(|v| v.expect("add takes every tensor")).collect();
            acc.add(&s, &grads, m.count).unwrap();
        }
        Some((order, threads)) => {
            acc.begin_microbatch(m.count).unwrap();
            std::thread::scope(|sc| {
                for part in order.chunks(order.len().div_ceil(threads).max(1)) {
                    let (s, views) = (&s, &views);
                    sc.spawn(move || {
                        for &i in part {
                            if let Some(g) = views[i] {
                                acc.add_tensor(s, i, g).unwrap();
                            }
                        }
                    });
                }
            });
            acc.end_microbatch().unwrap();
        }
    }
}

fn random_layout(rng: &mut Rng) -> Vec<TensorDesc> {
    let sizes = [1usize, 3, 64, 1000, 4095, 4097, 9000];
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    (0..rng.range(1, 7))
        .map(|_| TensorDesc {
            numel: sizes[rng.range(0, 6) as usize],
            dtype: dtypes[rng.range(0, 2) as usize],
        })
        .collect()
}

fn sharded_config(rng: &mut Rng) -> AccumulatorConfig {
    AccumulatorConfig {
        bucket_numel: rng.range(1, 12000) as usize,
        threads: rng.range(1, 2) as usize,
        wire: if rng.range(0, 2) == 0 { Dtype::Bf16 } else { Dtype::F32 },
        ..random_config(rng)
    }
}

fn random_micro(
    rng: &mut Rng,
    tensors: &[TensorDesc],
    hook: bool,
) -> (Micro, Vec<Option<Vec<f32>>>) {
    let scale = (2f32).powi(rng.range(0, 14) as i32);
    let values: Vec<Option<Vec<f32>>> = tensors
        .iter()
        .map(|t| {
            (!hook || rng.range(0, 4) != 0)
                .then(|| (0..t.numel).map(|_| rng.uniform(-1.0, 1.0) as f32).collect())
        })
        .collect();
    let grads = values
        .iter()
        .zip(tensors)
        .map(|(v, t)| v.as_ref().map(|v| encode(t.dtype, v, scale)))
        .collect();
    (Micro { count: rng.range(1, 9), scale, grads }, values)
}

#[test]
fn random_windows_match_the_f64_reference_on_every_rank() {
    let mut rng =
        Rng::fresh("sharded_accumulation::random_windows_match_the_f64_reference_on_every_rank");
    for case in 0..30 {
        let world = rng.range(1, 5) as usize;
        let tensors = random_layout(&mut rng);
        let config = sharded_config(&mut rng);
        // Every rank adds the same micro-batches: whole, or tensor by tensor in its own order.
        let hooks: Vec<bool> = (0..rng.range(1, 4)).map(|_| rng.range(0, 1) == 0).collect();
        let mut windows = Vec::new();
        let mut values = Vec::new();
        let mut orders = Vec::new();
        for _ in 0..world {
            let (mut w, mut v, mut o) = (Vec::new(), Vec::new(), Vec::new());
            for &hook in &hooks {
                let (m, vals) = random_micro(&mut rng, &tensors, hook);
                let mut order: Vec<usize> = (0..tensors.len()).collect();
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.range(0, i as u64) as usize);
                }
                w.push(m);
                v.push(vals);
                o.push(hook.then_some((order, rng.range(1, 2) as usize)));
            }
            windows.push(w);
            values.push(v);
            orders.push(o);
        }

        let want = Reference::of(&tensors, &config, &windows, &values, world);
        let flat_len = want.sum.len();
        let results = on_ranks(world, |r, comm| {
            let acc = sharded(config, &tensors, comm);
            for (m, hook) in windows[r].iter().zip(&orders[r]) {
                add_micro(&acc, &tensors, m, hook.as_ref().map(|(o, t)| (&o[..], *t)));
            }
            let info = acc.sync(None).unwrap();
            let (range, ptr) = acc.shard();
            // SAFETY: the live accumulator's shard, unwritten until its next micro-batch.
            (info, range.clone(), unsafe { std::slice::from_raw_parts(ptr, range.len()) }.to_vec())
        });
        let shards: Vec<(std::ops::Range<usize>, Vec<f32>)> =
            results.iter().map(|(_, r, s)| (r.clone(), s.clone())).collect();
        for (r, (other, _, _)) in results.iter().enumerate() {
            assert_eq!(*other, results[0].0, "case {case}: rank {r} reports differently");
        }
        want.check(&results[0].0, &shards, &format!("case {case}: world {world}, {config:?}"));
        assert_eq!(
            shards.last().unwrap().0.end,
            flat_len,
            "case {case}: the shards cover the layout"
        );
    }
}

/// The f64 reference of a window over ranks: the sum and the sum of magnitudes per element, and
/// what the boundary must report.
struct Reference {
    sum: Vec<f64>,
    magnitude: Vec<f64>,
    divisor: f64,
    total_count: u64,
    microbatches: u64,
    norm: f64,
    coef: f64,
    /// Relative error of the library's sums: FP32 sums of this many terms in another order,
    /// plus the bf16 wire's rounding of each contribution.
    error: f64,
}

impl Reference {
    fn of(
        tensors: &[TensorDesc],
        config: &AccumulatorConfig,
        windows: &[Vec<Micro>],
        values: &[Vec<Vec<Option<Vec<f32>>>>],
        world: usize,
    ) -> Self {
        let total_count: u64 = windows.iter().flatten().map(|m| m.count).sum();
        let microbatches = windows.iter().map(|w| w.len() as u64).sum::<u64>();
        let divisor = match config.normalize {
            Normalize::ByCount => total_count as f64,
            Normalize::ByMicrobatches => microbatches as f64,
            Normalize::ByWorld => world as f64,
            Normalize::None => 1.0,
        };
        // The flat master: each tensor at its aligned offset, zeros (sum and magnitude 0, so
        // exactly 0 expected) in the padding between.
        let offsets = aligned_offsets(tensors);
        let flat_len = *offsets.last().unwrap();
        let (mut sum, mut magnitude) = (vec![0f64; flat_len], vec![0f64; flat_len]);
        for (m, vals) in windows.iter().flatten().zip(values.iter().flatten()) {
            let weight = if config.weights_by_count() { m.count as f64 } else { 1.0 };
            for ((t, v), &at) in tensors.iter().zip(vals).zip(&offsets) {
                for i in 0..t.numel {
                    let x = v.as_ref().map_or(0.0, |v| decoded(t.dtype, v[i], m.scale)) * weight;
                    sum[at + i] += x;
                    magnitude[at + i] += x.abs();
                }
            }
        }
        let norm = sum.iter().map(|v| (v / divisor).powi(2)).sum::<f64>().sqrt();
        let max = config.max_grad_norm as f64;
        let coef = if max > 0.0 { (max / (norm + 1e-6)).min(1.0) } else { 1.0 };
        let wire_error =
            if config.wire == Dtype::Bf16 && world > 1 { (2f64).powi(-8) } else { 0.0 };
        let error = 1.2e-7 * (microbatches + 2) as f64 + wire_error;
        Reference { sum, magnitude, divisor, total_count, microbatches, norm, coef, error }
    }

    /// Checks a boundary's info and the shards (range, values) against the reference.
    fn check(&self, info: &SyncInfo, shards: &[(std::ops::Range<usize>, Vec<f32>)], what: &str) {
        let d = self.divisor;
        let norm_tol = 1e-5 * self.norm
            + 1e-12
            + self.error * self.magnitude.iter().map(|m| (m / d).powi(2)).sum::<f64>().sqrt();
        let coef = self.coef;
        let coef_tol = if coef < 1.0 {
            1e-5 * coef + coef * norm_tol / (self.norm - norm_tol).max(f64::MIN_POSITIVE)
        } else {
            1e-5
        };
        assert_eq!(
            (info.total_count, info.microbatches, info.found_inf),
            (self.total_count, self.microbatches, false),
            "{what}"
        );
        assert!(
            (info.grad_norm - self.norm).abs() <= norm_tol,
            "{what}: norm {} vs {}",
            info.grad_norm,
            self.norm
        );
        assert!(
            (info.clip_coef - coef).abs() <= coef_tol,
            "{what}: clip {} vs {coef}",
            info.clip_coef
        );
        let mut covered = 0;
        for (r, (range, shard)) in shards.iter().enumerate() {
            assert_eq!(range.start, covered, "{what}: shards in rank order");
            covered = range.end;
            for (i, &got) in range.clone().zip(shard) {
                let want = self.sum[i] / d * coef;
                let tol = self.error * self.magnitude[i] / d * coef
                    + (self.sum[i] / d).abs() * (info.clip_coef - coef).abs()
                    + 1e-30;
                assert!(
                    (got as f64 - want).abs() <= tol,
                    "{what}: element {i} of shard {r}: {got} vs {want} (tol {tol})"
                );
            }
        }
        assert_eq!(covered, self.sum.len(), "{what}: the shards tile the flat master");
    }
}

#[test]
fn every_way_of_adding_gives_the_same_bits() {
    // `add`, and `add_tensor` in forward, backward and shuffled order from one or two threads,
    // run the same conversions and the same reductions in the same order.
    let mut rng = Rng::fresh("sharded_accumulation::every_way_of_adding_gives_the_same_bits");
    let world = 3;
    let tensors = random_layout(&mut rng);
    let config = AccumulatorConfig { bucket_numel: 5000, ..sharded_config(&mut rng) };
    let micros: Vec<Vec<Micro>> = (0..world)
        .map(|_| (0..3).map(|_| random_micro(&mut rng, &tensors, false).0).collect())
        .collect();
    let n = tensors.len();
    let mut shuffled: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        shuffled.swap(i, rng.range(0, i as u64) as usize);
    }
    let orders: Vec<Option<(Vec<usize>, usize)>> = vec![
        None,
        Some(((0..n).collect(), 1)),
        Some(((0..n).rev().collect(), 1)),
        Some((shuffled.clone(), 1)),
        Some((shuffled, 2)),
    ];
    let results = on_ranks(world, |r, comm| {
        orders
            .iter()
            .map(|order| {
                let acc = sharded(config, &tensors, comm);
                for m in &micros[r] {
                    add_micro(&acc, &tensors, m, order.as_ref().map(|(o, t)| (&o[..], *t)));
                }
                (acc.sync(Some(&**comm)).unwrap(), shard_bits(&acc))
            })
            .collect::<Vec<_>>()
    });
    for (r, ways) in results.iter().enumerate() {
        for (k, way) in ways.iter().enumerate().skip(1) {
            assert_eq!(way, &ways[0], "rank {r}: way {k} ({:?}) differs from add", orders[k]);
        }
    }
}

#[test]
fn a_single_shard_is_the_unsharded_boundary() {
    let mut rng = Rng::fresh("sharded_accumulation::a_single_shard_is_the_unsharded_boundary");
    let tensors = random_layout(&mut rng);
    let config = sharded_config(&mut rng);
    let plain = Accumulator::new(config, &tensors).unwrap();
    let one = Accumulator::new(
        AccumulatorConfig { sharding: Sharding::Accumulate { shards: 1, rank: 0 }, ..config },
        &tensors,
    )
    .unwrap();
    for _ in 0..3 {
        let (m, _) = random_micro(&mut rng, &tensors, false);
        for acc in [&plain, &one] {
            add_micro(acc, &tensors, &m, None);
        }
    }
    assert_eq!(plain.sync(None).unwrap(), one.sync(None).unwrap());
    assert_eq!(shard_bits(&plain), shard_bits(&one));
}

#[test]
fn one_rank_overflowing_skips_the_window_on_every_rank() {
    let tensors = [
        TensorDesc { numel: 5000, dtype: Dtype::F16 },
        TensorDesc { numel: 300, dtype: Dtype::Bf16 },
    ];
    let infos = on_ranks(3, |r, comm| {
        let acc =
            sharded(AccumulatorConfig { bucket_numel: 1000, ..Default::default() }, &tensors, comm);
        let s = scaler(1024.0);
        let mut halves = vec![to_f16(0.5); 5000];
        if r == 1 {
            halves[4321] = 0x7c00; // +inf in rank 1's first micro-batch only
        }
        let small = vec![to_bf16(0.25); 300];
        acc.add(&s, &[Grad::f16_bits(&halves), Grad::bf16_bits(&small)], 2).unwrap();
        halves[4321] = to_f16(0.5);
        acc.add(&s, &[Grad::f16_bits(&halves), Grad::bf16_bits(&small)], 2).unwrap();
        let overflowed = acc.sync(None).unwrap();
        // The next window is clean again: its first micro-batch assigns.
        acc.add(&s, &[Grad::f16_bits(&halves), Grad::bf16_bits(&small)], 2).unwrap();
        (overflowed, acc.sync(None).unwrap())
    });
    for (r, (overflowed, clean)) in infos.iter().enumerate() {
        assert!(overflowed.found_inf, "rank {r} must skip the window");
        assert!(!clean.found_inf, "rank {r}: the overflow must not leak into the next window");
        assert_eq!((clean.total_count, clean.microbatches), (6, 3));
    }
}

#[test]
fn token_weighted_unequal_counts_and_a_changing_micro_batch_count() {
    // Seed: per-token losses averaged per micro-batch with unequal token counts must be weighted
    // by count; and a window with another micro-batch count is normalised by its own totals.
    let tensors = [TensorDesc { numel: 4099, dtype: Dtype::F32 }];
    let results = on_ranks(2, |r, comm| {
        let acc =
            sharded(AccumulatorConfig { bucket_numel: 4096, ..Default::default() }, &tensors, comm);
        let s = scaler(1.0);
        let mut out = Vec::new();
        for window in [&[(3u64, 1.0f32), (1, 5.0)][..], &[(2, 2.0), (2, 4.0), (4, 1.0)][..]] {
            for &(count, mean) in window {
                let g = vec![mean * (r + 1) as f32; 4099];
                acc.add(&s, &[Grad::F32(&g)], count).unwrap();
            }
            acc.sync(None).unwrap();
            let (range, ptr) = acc.shard();
            // SAFETY: the live accumulator's shard, unwritten until its next micro-batch.
            out.push((
                range.clone(),
                unsafe { std::slice::from_raw_parts(ptr, range.len()) }.to_vec(),
            ));
        }
        out
    });
    // Per item, rank r's gradient is mean × (r + 1): sums over ranks weigh (1 + 2) per item.
    // Window 1: (3·1 + 1·5)·3 / (4·2) = 3; window 2: (2·2 + 2·4 + 4·1)·3 / (8·2) = 3.
    // The master pads the tensor to 4160 elements: zeros after element 4099.
    let len = Accumulator::master_len(&tensors).unwrap();
    assert_eq!(len, 4160);
    for (r, shards) in results.iter().enumerate() {
        for (w, (range, shard)) in shards.iter().enumerate() {
            assert_eq!(*range, [0..4096, 4096..len][r], "rank {r}: whole norm blocks");
            for (at, &v) in range.clone().zip(shard) {
                let want = if at < 4099 { 3.0 } else { 0.0 };
                assert_eq!(v.to_bits(), f32::to_bits(want), "rank {r}, window {w}: element {at}");
            }
        }
    }
}

#[test]
fn misuse_fails_on_every_rank_and_leaves_the_windows() {
    let tensors = [
        TensorDesc { numel: 6000, dtype: Dtype::F16 },
        TensorDesc { numel: 10, dtype: Dtype::F32 },
    ];
    let config = AccumulatorConfig { bucket_numel: 4096, ..Default::default() };
    let comms = group(2);
    // Created on a communicator of another size or rank, or without one.
    let wrong = Sharding::Accumulate { shards: 3, rank: 0 };
    let e = Accumulator::builder(&tensors)
        .config(AccumulatorConfig { sharding: wrong, ..config })
        .communicator(comms[0].clone())
        .build()
        .unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
    let swapped = Sharding::Accumulate { shards: 2, rank: 1 };
    assert!(Accumulator::builder(&tensors)
        .config(AccumulatorConfig { sharding: swapped, ..config })
        .communicator(comms[0].clone())
        .build()
        .is_err());
    assert!(Accumulator::new(AccumulatorConfig { sharding: swapped, ..config }, &tensors).is_err());
    assert!(
        Accumulator::builder(&tensors)
            .config(config)
            .communicator(comms[0].clone())
            .build()
            .is_err(),
        "a communicator for an unsharded accumulator"
    );

    on_ranks(2, |r, comm| {
        comm.set_timeout(Some(Duration::from_secs(20))).unwrap();
        let acc = sharded(config, &tensors, comm);
        let s = scaler(1.0);
        let big = vec![to_f16(1.0); 6000];
        let small = vec![1.0f32; 10];
        acc.add(&s, &[Grad::f16_bits(&big), Grad::F32(&small)], 1).unwrap();
        let before = shard_bits(&acc);
        // Rank 1's call is invalid (a wrong dtype): both fail, nothing is added.
        let bad = vec![to_bf16(1.0); 6000];
        let grads = if r == 1 {
            [Grad::bf16_bits(&bad), Grad::F32(&small)]
        } else {
            [Grad::f16_bits(&big), Grad::F32(&small)]
        };
        let e = acc.add(&s, &grads, 1).unwrap_err();
        assert_eq!(
            e.kind,
            if r == 1 { ErrorKind::DtypeMismatch } else { ErrorKind::PeerFailure },
            "rank {r}: {e}"
        );
        assert_eq!(shard_bits(&acc), before, "rank {r}: the window is as it was");
        // Rank 0 at the boundary while rank 1 adds: both fail with nothing reduced.
        let e = if r == 0 {
            acc.sync(None).unwrap_err()
        } else {
            acc.add(&s, &[Grad::f16_bits(&big), Grad::F32(&small)], 1).unwrap_err()
        };
        assert_eq!(e.kind, ErrorKind::SizeMismatch, "rank {r}: {e}");
        assert_eq!(shard_bits(&acc), before, "rank {r}: the window is as it was");
        // Rank 0 adds a whole micro-batch while rank 1 opens one tensor by tensor: the two cut
        // the micro-batch differently, so both fail with nothing reduced.
        let e = if r == 0 {
            acc.add(&s, &[Grad::f16_bits(&big), Grad::F32(&small)], 1).unwrap_err()
        } else {
            acc.begin_microbatch(1).unwrap_err()
        };
        assert_eq!(e.kind, ErrorKind::SizeMismatch, "rank {r}: {e}");
        assert_eq!(shard_bits(&acc), before, "rank {r}: the window is as it was");
        // A micro-batch tensor by tensor, whole.
        acc.begin_microbatch(1).unwrap();
        acc.add_tensor(&s, 1, Grad::F32(&small)).unwrap();
        acc.add_tensor(&s, 0, Grad::f16_bits(&big)).unwrap();
        acc.end_microbatch().unwrap();
        // Another communicator at the boundary on rank 0.
        let stranger = LocalComm::group(1).unwrap();
        let e = acc
            .sync(if r == 0 { Some(&stranger[0] as &dyn Communicator) } else { None })
            .unwrap_err();
        assert_eq!(
            e.kind,
            if r == 0 { ErrorKind::InvalidArgument } else { ErrorKind::PeerFailure },
            "rank {r}: {e}"
        );
        // The window survived all of it: two micro-batches on each rank.
        let info = acc.sync(None).unwrap();
        assert_eq!((info.total_count, info.microbatches), (4, 4), "rank {r}");
        // Only a tensor inside the shard can be read: shard 0 is elements 0..4096, shard 1 the
        // rest, which holds tensor 1 (at 6016, after the padding that aligns it; 64 with its own).
        assert_eq!(acc.offset(1).unwrap(), 6016);
        assert_eq!(acc.shard().0, if r == 0 { 0..4096 } else { 4096..6080 });
        assert_eq!(acc.read_master(1, &mut [0.0; 10]).is_ok(), r == 1, "rank {r}");
        assert_eq!(acc.master_ptr(0).unwrap_err().kind, ErrorKind::InvalidArgument, "rank {r}");

        // A second contribution to a tensor in one micro-batch (rank 1's) is refused, and the
        // micro-batch then fails on every rank, its window discarded.
        acc.begin_microbatch(1).unwrap();
        acc.add_tensor(&s, 1, Grad::F32(&small)).unwrap();
        if r == 1 {
            assert_eq!(
                acc.add_tensor(&s, 1, Grad::F32(&small)).unwrap_err().kind,
                ErrorKind::WrongState
            );
        }
        let e = acc.end_microbatch().unwrap_err();
        assert_eq!(
            e.kind,
            if r == 1 { ErrorKind::WrongState } else { ErrorKind::PeerFailure },
            "rank {r}: {e}"
        );
        assert_eq!(acc.sync(None).unwrap_err().kind, ErrorKind::EmptyWindow, "rank {r}");
    });
}

#[test]
fn a_window_saved_on_n_ranks_resumes_on_n_ranks() {
    let mut rng = Rng::fresh("sharded_accumulation::a_window_saved_on_n_ranks_resumes_on_n_ranks");
    let tensors = random_layout(&mut rng);
    let config = AccumulatorConfig { max_grad_norm: 0.5, ..sharded_config(&mut rng) };
    let micros: Vec<Vec<Micro>> = (0..3)
        .map(|_| (0..2).map(|_| random_micro(&mut rng, &tensors, false).0).collect())
        .collect();
    on_ranks(3, |r, comm| {
        let whole = sharded(config, &tensors, comm);
        for m in &micros[r] {
            add_micro(&whole, &tensors, m, None);
        }
        let info = whole.sync(None).unwrap();

        let before = sharded(config, &tensors, comm);
        add_micro(&before, &tensors, &micros[r][0], None);
        let saved = before.save_window().unwrap();
        let after = sharded(config, &tensors, comm);
        after.load_window(&saved).unwrap();
        add_micro(&after, &tensors, &micros[r][1], None);
        assert_eq!(after.sync(None).unwrap(), info, "rank {r}");
        assert_eq!(shard_bits(&after), shard_bits(&whole), "rank {r}: restored window");

        // Merged into a window that holds the second micro-batch: the same sums.
        let merged = sharded(config, &tensors, comm);
        add_micro(&merged, &tensors, &micros[r][1], None);
        merged.merge_window(&saved).unwrap();
        let m = merged.sync(None).unwrap();
        assert_eq!(
            (m.total_count, m.microbatches),
            (info.total_count, info.microbatches),
            "rank {r}"
        );

        // Another shard, or a whole window, is refused and changes nothing.
        let unsharded = Accumulator::new(config, &tensors).unwrap();
        let e = unsharded.load_window(&saved).unwrap_err();
        assert_eq!(e.kind, ErrorKind::CorruptState, "rank {r}: {e}");
        add_micro(&unsharded, &tensors, &micros[r][0], None);
        let whole_window = unsharded.save_window().unwrap();
        let fresh = sharded(config, &tensors, comm);
        assert_eq!(
            fresh.load_window(&whole_window).unwrap_err().kind,
            ErrorKind::CorruptState,
            "rank {r}"
        );
        assert_eq!(
            fresh.merge_window(&whole_window).unwrap_err().kind,
            ErrorKind::CorruptState,
            "rank {r}"
        );
        saved
    });
    // Rank 0's shard loaded on rank 1.
    let saved = on_ranks(3, |r, comm| {
        let acc = sharded(config, &tensors, comm);
        add_micro(&acc, &tensors, &micros[r][0], None);
        acc.save_window().unwrap()
    });
    on_ranks(3, |r, comm| {
        let acc = sharded(config, &tensors, comm);
        let e = acc.load_window(&saved[(r + 1) % 3]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::CorruptState, "rank {r}: {e}");
        assert!(e.message.contains("shard"), "{e}");
    });
}

#[test]
fn hybrid_boundaries_match_the_reference_on_every_rank() {
    // Shard groups of 2 and 3 ranks, each replicated twice: the replicas all-reduce their shard
    // at the boundary. Every replica holds the same bits, and the shards the f64 reference over
    // every rank.
    let mut rng =
        Rng::fresh("sharded_accumulation::hybrid_boundaries_match_the_reference_on_every_rank");
    for (shards, replicas) in [(2, 2), (3, 2), (1, 3)] {
        let tensors = random_layout(&mut rng);
        let config = sharded_config(&mut rng);
        let world = shards * replicas;
        let (mut windows, mut values) = (Vec::new(), Vec::new());
        for _ in 0..world {
            let (w, v): (Vec<Micro>, Vec<_>) =
                (0..2).map(|_| random_micro(&mut rng, &tensors, false)).unzip();
            windows.push(w);
            values.push(v);
        }
        let want = Reference::of(&tensors, &config, &windows, &values, world);
        let shard_groups: Vec<Vec<Arc<dyn Communicator>>> =
            (0..replicas).map(|_| group(shards)).collect();
        let replica_groups: Vec<Vec<LocalComm>> =
            (0..shards).map(|_| LocalComm::group(replicas).unwrap()).collect();
        let results: Vec<(SyncInfo, std::ops::Range<usize>, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|g| {
                    let (a, i) = (g / shards, g % shards);
                    let (comm, replica) = (&shard_groups[a][i], &replica_groups[i][a]);
                    let (tensors, windows) = (&tensors, &windows);
                    s.spawn(move || {
                        let acc = sharded(config, tensors, comm);
                        for m in &windows[g] {
                            add_micro(&acc, tensors, m, None);
                        }
                        let info = acc.sync_hybrid(&**comm, replica).unwrap();
                        let (range, ptr) = acc.shard();
                        // SAFETY: the live accumulator's shard, unwritten until its next
                        // micro-batch.
                        (
                            info,
                            range.clone(),
                            unsafe { std::slice::from_raw_parts(ptr, range.len()) }.to_vec(),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let what = format!("{shards}×{replicas}, {config:?}");
        for (g, r) in results.iter().enumerate() {
            assert_eq!(r.0, results[0].0, "{what}: rank {g}'s info");
            let replica_0 = &results[g % shards];
            assert!(
                r.2.iter().zip(&replica_0.2).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: rank {g} differs from its replica"
            );
        }
        let first_group: Vec<_> =
            results[..shards].iter().map(|(_, r, s)| (r.clone(), s.clone())).collect();
        want.check(&results[0].0, &first_group, &what);
    }
}

#[test]
fn short_and_empty_shards_and_one_huge_bucket() {
    // Stripes past the end of a short (or empty) shard, and a bucket_numel that would overflow
    // its rounding: 24577 elements padded to 24640 over 3 ranks are shards of 12288 (whole norm
    // blocks), the last 64 elements long; over 5 ranks, of 8192, the last is empty. With
    // bucket_numel 1 every stripe is one block.
    let tensors = [TensorDesc { numel: 24577, dtype: Dtype::F32 }];
    let len = Accumulator::master_len(&tensors).unwrap();
    assert_eq!(len, 24640);
    for (world, last) in [(3, 24576..24640), (5, 24640..24640)] {
        for bucket_numel in [1, 4096, usize::MAX] {
            let config = AccumulatorConfig { bucket_numel, ..Default::default() };
            let shards = on_ranks(world, |r, comm| {
                let acc = sharded(config, &tensors, comm);
                let g = vec![(r + 1) as f32; 24577];
                acc.add(&scaler(1.0), &[Grad::F32(&g)], 1).unwrap();
                acc.add(&scaler(1.0), &[Grad::F32(&g)], 1).unwrap();
                acc.sync(None).unwrap();
                (acc.shard().0, shard_bits(&acc))
            });
            let what = format!("{world} ranks, bucket_numel {bucket_numel}");
            assert_eq!(shards.last().unwrap().0, last, "{what}");
            // (1 + ... + world) x 2 items / (2 x world) items = (world + 1) / 2 in the tensor,
            // zeros in the padding after it.
            let mean = (world + 1) as f32 / 2.0;
            let mut covered = 0;
            for (r, (range, bits)) in shards.iter().enumerate() {
                assert_eq!(range.start, covered, "{what}: shard {r}");
                covered = range.end;
                for (at, &b) in range.clone().zip(bits) {
                    let want = if at < 24577 { mean } else { 0.0 };
                    assert_eq!(b, want.to_bits(), "{what}: shard {r}, element {at}");
                }
            }
            assert_eq!(covered, len, "{what}: the shards tile the master");
        }
    }
    let one = Sharding::Accumulate { shards: 1, rank: 0 };
    let acc = Accumulator::new(
        AccumulatorConfig { sharding: one, bucket_numel: usize::MAX, ..Default::default() },
        &tensors,
    )
    .unwrap();
    acc.add(&scaler(1.0), &[Grad::F32(&[0.5; 24577])], 1).unwrap();
    assert_eq!(acc.sync(None).unwrap().total_count, 1);
}

#[test]
fn an_overflowing_sum_is_found_as_the_unsharded_accumulator_finds_it() {
    // Each contribution is finite; their sum over micro-batches (one rank) or over ranks is not.
    let tensors = [TensorDesc { numel: 5000, dtype: Dtype::F32 }];
    let big = vec![3e38f32; 5000];
    let config = AccumulatorConfig {
        normalize: Normalize::None,
        loss_reduction: LossReduction::Sum,
        ..Default::default()
    };
    let plain = Accumulator::new(config, &tensors).unwrap();
    let one = Accumulator::new(
        AccumulatorConfig { sharding: Sharding::Accumulate { shards: 1, rank: 0 }, ..config },
        &tensors,
    )
    .unwrap();
    for acc in [&plain, &one] {
        acc.add(&scaler(1.0), &[Grad::F32(&big)], 1).unwrap();
        acc.add(&scaler(1.0), &[Grad::F32(&big)], 1).unwrap();
    }
    let (a, b) = (plain.sync(None).unwrap(), one.sync(None).unwrap());
    assert!(a.found_inf && b.found_inf, "{a:?} {b:?}");
    assert_eq!(shard_bits(&plain), shard_bits(&one));
    let infos = on_ranks(2, |_, comm| {
        let acc = sharded(config, &tensors, comm);
        acc.add(&scaler(1.0), &[Grad::F32(&big)], 1).unwrap();
        acc.sync(None).unwrap()
    });
    assert!(infos.iter().all(|i| i.found_inf), "a sum over ranks overflowing: {infos:?}");
}

#[test]
fn a_refused_call_on_one_rank_never_leaves_the_others_waiting() {
    let tensors = [
        TensorDesc { numel: 5000, dtype: Dtype::F16 },
        TensorDesc { numel: 3000, dtype: Dtype::F32 },
    ];
    let config = AccumulatorConfig { bucket_numel: 4096, ..Default::default() };
    let quick = Duration::from_secs(2);
    on_ranks(3, |r, comm| {
        comm.set_timeout(Some(Duration::from_secs(30))).unwrap();
        let acc = sharded(config, &tensors, comm);
        let s = scaler(1.0);
        let (halves, floats) = (vec![to_f16(1.0); 5000], vec![1.0f32; 3000]);
        acc.add(&s, &[Grad::f16_bits(&halves), Grad::F32(&floats)], 1).unwrap();
        let before = shard_bits(&acc);

        // A contribution refused on rank 1 (a wrong length): every rank's micro-batch fails when
        // it ends, and every window is discarded.
        let t = std::time::Instant::now();
        acc.begin_microbatch(1).unwrap();
        acc.add_tensor(&s, 1, Grad::F32(&floats)).unwrap();
        let short = vec![to_f16(1.0); 4999];
        let e = acc.add_tensor(
            &s,
            0,
            if r == 1 { Grad::f16_bits(&short) } else { Grad::f16_bits(&halves) },
        );
        assert_eq!(e.is_err(), r == 1, "rank {r}");
        let e = acc.end_microbatch().unwrap_err();
        assert_eq!(
            e.kind,
            if r == 1 { ErrorKind::WrongState } else { ErrorKind::PeerFailure },
            "rank {r}: {e}"
        );
        assert!(e.message.ends_with("(the window was discarded)"), "rank {r}: {e}");
        assert_eq!(
            acc.sync(None).unwrap_err().kind,
            ErrorKind::EmptyWindow,
            "rank {r}: the window is gone"
        );
        assert!(t.elapsed() < quick, "rank {r} waited {:?}", t.elapsed());

        // end_microbatch without a micro-batch on rank 2, while the others open and close one:
        // they fail at once, nothing is reduced.
        acc.add(&s, &[Grad::f16_bits(&halves), Grad::F32(&floats)], 1).unwrap();
        let t = std::time::Instant::now();
        if r == 2 {
            assert_eq!(acc.end_microbatch().unwrap_err().kind, ErrorKind::WrongState);
        } else {
            assert_eq!(
                acc.begin_microbatch(1).unwrap_err().kind,
                ErrorKind::PeerFailure,
                "rank {r}"
            );
        }
        assert!(t.elapsed() < quick, "rank {r} waited {:?}", t.elapsed());
        assert_eq!(shard_bits(&acc), before, "rank {r}: the window is as it was");
        let info = acc.sync(None).unwrap();
        assert_eq!((info.total_count, info.microbatches), (3, 3), "rank {r}");
    });
}

#[test]
fn a_hybrid_boundary_on_a_stray_shard_group_fails_every_rank_at_once() {
    let tensors = [TensorDesc { numel: 9000, dtype: Dtype::F32 }];
    let (shards, replicas) = (2, 2);
    let shard_groups: Vec<Vec<Arc<dyn Communicator>>> =
        (0..replicas).map(|_| group(shards)).collect();
    let replica_groups: Vec<Vec<LocalComm>> =
        (0..shards).map(|_| LocalComm::group(replicas).unwrap()).collect();
    let stray = LocalComm::group(2).unwrap();
    std::thread::scope(|s| {
        for g in 0..shards * replicas {
            let (a, i) = (g / shards, g % shards);
            let (comm, replica, stray, tensors) =
                (&shard_groups[a][i], &replica_groups[i][a], &stray, &tensors);
            s.spawn(move || {
                comm.set_timeout(Some(Duration::from_secs(30))).unwrap();
                replica.set_timeout(Some(Duration::from_secs(30))).unwrap();
                let acc = sharded(AccumulatorConfig::default(), tensors, comm);
                acc.add(&scaler(1.0), &[Grad::F32(&[1.0; 9000])], 1).unwrap();
                let t = std::time::Instant::now();
                let e = acc
                    .sync_hybrid(
                        if g == 0 { &stray[0] as &dyn Communicator } else { &**comm },
                        replica,
                    )
                    .unwrap_err();
                assert_eq!(
                    e.kind,
                    if g == 0 { ErrorKind::InvalidArgument } else { ErrorKind::PeerFailure },
                    "rank {g}: {e}"
                );
                assert!(t.elapsed() < Duration::from_secs(2), "rank {g} waited {:?}", t.elapsed());
                // Nothing was reduced: the boundary on the right groups works.
                assert_eq!(acc.sync_hybrid(&**comm, replica).unwrap().total_count, 4, "rank {g}");
            });
        }
    });
}
