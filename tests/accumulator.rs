//! The accumulator against an independent f64 reference, on random layouts, dtypes, scales,
//! micro-batch counts and sizes, normalisation modes and rank counts (fresh seed each run).

mod common;

use common::*;
use gradacc::*;

/// One micro-batch on one rank: per tensor, the contributions it receives (possibly none, possibly
/// several for a chunked backward), as 16- or 32-bit scaled values.
struct Micro {
    count: u64,
    scale: f32,
    /// `hook` micro-batches go through begin/add_tensor/end, others through `add`.
    hook: bool,
    contributions: Vec<Vec<Vec<f32>>>, // [tensor][contribution][element] = true (unscaled) gradient
}

fn run_case(rng: &mut Rng, case: usize) {
    let world = rng.range(1, 4) as usize;
    let tensors = random_tensors(rng);
    let config = AccumulatorConfig {
        wire: if rng.range(0, 2) == 0 { Dtype::Bf16 } else { Dtype::F32 },
        ..random_config(rng)
    };
    let (normalize, loss_reduction) = (config.normalize, config.loss_reduction);
    let weights_by_count = config.weights_by_count();

    // Each rank's window; at least one micro-batch somewhere.
    let mut windows: Vec<Vec<Micro>> = (0..world)
        .map(|_| {
            (0..rng.range(0, 4))
                .map(|_| {
                    let hook = rng.range(0, 1) == 0;
                    let contributions = tensors
                        .iter()
                        .map(|t| {
                            let k = if hook { rng.range(0, 3) } else { 1 };
                            (0..k)
                                .map(|_| {
                                    (0..t.numel).map(|_| rng.uniform(-1.0, 1.0) as f32).collect()
                                })
                                .collect()
                        })
                        .collect();
                    Micro {
                        count: rng.range(1, 9),
                        scale: (2f32).powi(rng.range(0, 15) as i32),
                        hook,
                        contributions,
                    }
                })
                .collect()
        })
        .collect();
    if windows.iter().all(|w| w.is_empty()) {
        windows[0].push(Micro {
            count: 3,
            scale: 8.0,
            hook: false,
            contributions: tensors.iter().map(|t| vec![vec![0.5; t.numel]]).collect(),
        });
    }

    // The f64 reference.
    let total_count: u64 = windows.iter().flatten().map(|m| m.count).sum();
    let total_micro = windows.iter().map(|w| w.len() as u64).sum::<u64>();
    let divisor = match normalize {
        Normalize::ByCount => total_count as f64,
        Normalize::ByMicrobatches => total_micro as f64,
        Normalize::ByWorld => world as f64,
        Normalize::None => 1.0,
    };
    let mut reference: Vec<Vec<f64>> = tensors.iter().map(|t| vec![0.0; t.numel]).collect();
    let mut magnitude: Vec<Vec<f64>> = reference.clone();
    for m in windows.iter().flatten() {
        let w = if weights_by_count { m.count as f64 } else { 1.0 };
        for (t, contribs) in m.contributions.iter().enumerate() {
            for c in contribs {
                for (i, &v) in c.iter().enumerate() {
                    let x = decoded(tensors[t].dtype, v, m.scale) * w;
                    reference[t][i] += x;
                    magnitude[t][i] += x.abs();
                }
            }
        }
    }
    let norm: f64 = reference.iter().flatten().map(|v| (v / divisor).powi(2)).sum::<f64>().sqrt();
    let max = config.max_grad_norm as f64;
    let coef = if max > 0.0 { (max / (norm + 1e-6)).min(1.0) } else { 1.0 };
    // A bf16 wire between ranks rounds each rank's FP32 contribution once: at most 2^-8 of it, so
    // at most 2^-8 of the element's magnitude in all, whatever the number of ranks (the FP32
    // summation's (W - 1) 2^-24 is within the 2e-6 below at these rank counts). The norm then
    // moves by at most the norm of those errors, and the clipping coefficient with it.
    let wire_error = if config.wire == Dtype::Bf16 && world > 1 { (2f64).powi(-8) } else { 0.0 };
    let norm_tol = 1e-5 * norm
        + 1e-12
        + wire_error
            * magnitude.iter().flatten().map(|m| (m / divisor).powi(2)).sum::<f64>().sqrt();
    let coef_tol = if coef < 1.0 {
        1e-5 * coef + coef * norm_tol / (norm - norm_tol).max(f64::MIN_POSITIVE)
    } else {
        1e-5
    };

    // Run every rank on its own thread, after a first window of garbage that must not leak.
    let comms = LocalComm::group(world).unwrap();
    let results: Vec<(SyncInfo, Vec<Vec<f32>>)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .zip(&windows)
            .map(|(comm, window)| {
                let tensors = &tensors;
                s.spawn(move || {
                    // The same window into an accumulator that keeps only this rank's shard.
                    let sharding =
                        Sharding::ReduceScatter { shards: comm.world_size(), rank: comm.rank() };
                    let accs = [
                        Accumulator::new(config, tensors).unwrap(),
                        Accumulator::new(AccumulatorConfig { sharding, ..config }, tensors)
                            .unwrap(),
                    ];
                    let junk: Vec<Vec<f32>> = tensors.iter().map(|t| vec![1e3; t.numel]).collect();
                    let junk_grads: Vec<Vec<u16>> =
                        tensors.iter().map(|t| vec![to_bf16(7.0); t.numel]).collect();
                    let views: Vec<Grad> = tensors
                        .iter()
                        .enumerate()
                        .map(|(i, t)| grad_of(t.dtype, &junk[i], &junk_grads[i]))
                        .collect();
                    let one = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() })
                        .unwrap();
                    for acc in &accs {
                        acc.add(&one, &views, 1).unwrap();
                        acc.sync(Some(comm)).unwrap();
                    }

                    for (m, acc) in window.iter().flat_map(|m| accs.iter().map(move |acc| (m, acc)))
                    {
                        let scaler = Scaler::new(ScalerConfig {
                            init_scale: m.scale,
                            min_scale: 1.0,
                            ..Default::default()
                        })
                        .unwrap();
                        let encoded: Vec<Vec<(Vec<f32>, Vec<u16>)>> = m
                            .contributions
                            .iter()
                            .zip(tensors)
                            .map(|(cs, t)| cs.iter().map(|c| encode(t.dtype, c, m.scale)).collect())
                            .collect();
                        fn view<'a>(dtype: Dtype, e: &'a (Vec<f32>, Vec<u16>)) -> Grad<'a> {
                            grad_of(dtype, &e.0, &e.1)
                        }
                        if m.hook {
                            acc.begin_microbatch(m.count).unwrap();
                            for (t, cs) in encoded.iter().enumerate() {
                                for e in cs {
                                    acc.add_tensor(&scaler, t, view(tensors[t].dtype, e)).unwrap();
                                }
                            }
                            acc.end_microbatch().unwrap();
                        } else {
                            let grads: Vec<Grad> = encoded
                                .iter()
                                .enumerate()
                                .map(|(t, cs)| view(tensors[t].dtype, &cs[0]))
                                .collect();
                            acc.add(&scaler, &grads, m.count).unwrap();
                        }
                    }
                    let [acc, sharded] = &accs;
                    let info = acc.sync(Some(comm)).unwrap();
                    let masters: Vec<Vec<f32>> = (0..tensors.len())
                        .map(|t| acc.with_master(t, |m| m.to_vec()).unwrap())
                        .collect();
                    // The shard holds the all-reduce's bits for its range, with the same info.
                    assert_eq!(
                        sharded.sync(Some(comm)).unwrap(),
                        info,
                        "case {case}: the sharded boundary reports differently"
                    );
                    let (range, ptr) = sharded.shard();
                    let flat = flat_master(acc, &masters);
                    // SAFETY: the shard's address and length come from the live accumulator, which
                    // nothing writes until the next micro-batch.
                    let shard = unsafe { std::slice::from_raw_parts(ptr, range.len()) };
                    assert!(
                        shard
                            .iter()
                            .zip(&flat[range.clone()])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "case {case}: rank {}'s shard {range:?} differs from the all-reduce",
                        comm.rank()
                    );
                    (info, masters)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });

    let (info, masters) = &results[0];
    for (r, (other_info, other)) in results.iter().enumerate().skip(1) {
        assert_eq!(other_info, info, "case {case}: rank {r} reports differently");
        for (a, b) in masters.iter().flatten().zip(other.iter().flatten()) {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "case {case}: rank {r} master differs from rank 0"
            );
        }
    }
    assert_eq!(info.total_count, total_count, "case {case}");
    assert_eq!(info.microbatches, total_micro, "case {case}");
    assert!(!info.found_inf, "case {case}");
    assert!(
        (info.grad_norm - norm).abs() <= norm_tol,
        "case {case}: norm {} vs {norm} ({:?} wire)",
        info.grad_norm,
        config.wire
    );
    assert!(
        (info.clip_coef - coef).abs() <= coef_tol,
        "case {case}: clip {} vs {coef} ({:?} wire)",
        info.clip_coef,
        config.wire
    );
    for t in 0..tensors.len() {
        for i in 0..tensors[t].numel {
            let want = reference[t][i] / divisor * coef;
            let tol = (2e-6 + wire_error) * magnitude[t][i] / divisor * coef
                + (reference[t][i] / divisor).abs() * (info.clip_coef - coef).abs()
                + 1e-30;
            let got = masters[t][i] as f64;
            assert!(
                (got - want).abs() <= tol,
                "case {case}: tensor {t} ({:?}) element {i}: {got} vs {want} (tol {tol}); world {world}, {normalize:?}, {loss_reduction:?}, {:?} wire",
                tensors[t].dtype,
                config.wire
            );
        }
    }
}

#[test]
fn random_windows_match_the_f64_reference_on_every_rank() {
    let mut rng = Rng::fresh("random_windows_match_the_f64_reference_on_every_rank");
    for case in 0..40 {
        run_case(&mut rng, case);
    }
}

#[test]
fn single_process_boundary_without_communicator() {
    let scaler = Scaler::new(ScalerConfig { init_scale: 4.0, ..Default::default() }).unwrap();
    let acc = Accumulator::new(
        AccumulatorConfig::default(),
        &[TensorDesc { numel: 3, dtype: Dtype::F32 }],
    )
    .unwrap();
    acc.add(&scaler, &[Grad::F32(&[4.0, 8.0, -4.0])], 2).unwrap(); // mean grads 1, 2, -1 over 2 items
    acc.add(&scaler, &[Grad::F32(&[0.0, 4.0, 4.0])], 1).unwrap(); // 0, 1, 1 over 1 item
    let info = acc.sync(None).unwrap();
    assert_eq!((info.total_count, info.microbatches, info.found_inf), (3, 2, false));
    let want = [2.0 / 3.0, 5.0 / 3.0, -1.0 / 3.0];
    acc.with_master(0, |m| {
        for (g, w) in m.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-7);
        }
    })
    .unwrap();
}

#[test]
fn overflow_is_sticky_and_agreed() {
    let comms = LocalComm::group(2).unwrap();
    let tensors = [TensorDesc { numel: 5, dtype: Dtype::F16 }];
    let infos: Vec<SyncInfo> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let scaler = Scaler::new(ScalerConfig::default()).unwrap();
                    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                    let mut g = [to_f16(1.0); 5];
                    if c.rank() == 1 {
                        g[4] = 0x7c00; // +inf
                    }
                    acc.add(&scaler, &[Grad::f16_bits(&g)], 1).unwrap();
                    acc.add(&scaler, &[Grad::f16_bits(&[to_f16(1.0); 5])], 1).unwrap();
                    let info = acc.sync(Some(c)).unwrap();
                    assert!(scaler.update(info.found_inf).unwrap().skipped);
                    assert_eq!(scaler.scale().unwrap(), 32768.0);
                    info
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(infos.iter().all(|i| i.found_inf));
}

#[test]
fn invalid_sync_on_one_rank_fails_every_rank_without_reducing() {
    let comms = LocalComm::group(2).unwrap();
    let tensors = [TensorDesc { numel: 4, dtype: Dtype::F32 }];
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let scaler =
                    Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
                let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                acc.add(&scaler, &[Grad::F32(&[1.0; 4])], 1).unwrap();
                if c.rank() == 0 {
                    acc.begin_microbatch(1).unwrap(); // sync inside a micro-batch is invalid
                }
                let e = acc.sync(Some(c)).unwrap_err();
                let want =
                    if c.rank() == 0 { ErrorKind::WrongState } else { ErrorKind::PeerFailure };
                assert_eq!(e.kind, want);
                if c.rank() == 0 {
                    acc.end_microbatch().unwrap();
                }
                // Nothing was reduced or normalised, and both ranks can retry.
                acc.with_master(0, |m| assert_eq!(m, [1.0; 4])).unwrap();
                let info = acc.sync(Some(c)).unwrap();
                assert_eq!(info.microbatches, 3); // two on rank 0 (the add and the hook micro-batch), one on rank 1
            });
        }
    });
}

#[test]
fn ranks_with_different_layouts_fail_together() {
    let comms = LocalComm::group(2).unwrap();
    std::thread::scope(|s| {
        for c in &comms {
            s.spawn(move || {
                let numel = if c.rank() == 0 { 8 } else { 9 };
                let tensors = [TensorDesc { numel, dtype: Dtype::F32 }];
                let scaler =
                    Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
                let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                acc.add(&scaler, &[Grad::F32(&vec![1.0; numel])], 1).unwrap();
                assert_eq!(acc.sync(Some(c)).unwrap_err().kind, ErrorKind::SizeMismatch);
                // The same total in another order of tensors must fail as well.
                let sizes = if c.rank() == 0 { [3, 2] } else { [2, 3] };
                let tensors = sizes.map(|numel| TensorDesc { numel, dtype: Dtype::F32 });
                let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                acc.add(&scaler, &sizes.map(|n| Grad::F32(&[1.0; 3][..n])), 1).unwrap();
                assert_eq!(acc.sync(Some(c)).unwrap_err().kind, ErrorKind::SizeMismatch);
            });
        }
    });
}

/// Ranks that would compute different gradients from the same sums (another loss reduction,
/// normalisation or clipping norm) fail together before anything is reduced, and keep their
/// windows; with clipping on one rank only they would also run different collectives.
#[test]
fn ranks_with_different_boundary_settings_fail_together() {
    let variants: [fn(&mut AccumulatorConfig); 3] = [
        |c| c.max_grad_norm = 1.0,
        |c| c.normalize = Normalize::ByWorld,
        |c| c.loss_reduction = LossReduction::Sum,
    ];
    for change in variants {
        let comms = LocalComm::group(2).unwrap();
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    let mut config = AccumulatorConfig::default();
                    if c.rank() == 1 {
                        change(&mut config);
                    }
                    let tensors = [TensorDesc { numel: 300, dtype: Dtype::F32 }];
                    let scaler =
                        Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() })
                            .unwrap();
                    let acc = Accumulator::new(config, &tensors).unwrap();
                    acc.add(&scaler, &[Grad::F32(&[2.0; 300])], 1).unwrap();
                    let e = acc.sync(Some(c)).unwrap_err();
                    assert_eq!(e.kind, ErrorKind::SizeMismatch);
                    assert!(e.message.contains("max_grad_norm"), "{e}");
                    acc.with_master(0, |m| assert!(m.iter().all(|&v| v == 2.0))).unwrap();
                });
            }
        });
    }
}

#[test]
fn window_checkpoint_resumes_bitwise() {
    let mut rng = Rng::fresh("window_checkpoint_resumes_bitwise");
    let tensors = [
        TensorDesc { numel: 1001, dtype: Dtype::Bf16 },
        TensorDesc { numel: 17, dtype: Dtype::F32 },
    ];
    let scaler = Scaler::new(ScalerConfig { init_scale: 256.0, ..Default::default() }).unwrap();
    let batches: Vec<(Vec<u16>, Vec<f32>, u64)> = (0..4)
        .map(|_| {
            let a = (0..1001).map(|_| to_bf16(rng.uniform(-100.0, 100.0) as f32)).collect();
            let b = (0..17).map(|_| rng.uniform(-100.0, 100.0) as f32).collect();
            (a, b, rng.range(1, 5))
        })
        .collect();
    let feed = |acc: &Accumulator, range: std::ops::Range<usize>| {
        for (a, b, n) in &batches[range] {
            acc.add(&scaler, &[Grad::bf16_bits(a), Grad::F32(b)], *n).unwrap();
        }
    };
    let straight = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    feed(&straight, 0..4);
    straight.sync(None).unwrap();

    let first = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    feed(&first, 0..2);
    let bytes = first.save_window().unwrap();
    let resumed = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let mut corrupt = bytes.clone();
    corrupt[20] ^= 1;
    assert_eq!(resumed.load_window(&corrupt).unwrap_err().kind, ErrorKind::CorruptState);
    // A window of other tensors with the same total length is refused.
    let swapped =
        Accumulator::new(AccumulatorConfig::default(), &[tensors[1], tensors[0]]).unwrap();
    assert_eq!(swapped.load_window(&bytes).unwrap_err().kind, ErrorKind::SizeMismatch);
    resumed.load_window(&bytes).unwrap();
    feed(&resumed, 2..4);
    assert_eq!(resumed.sync(None).unwrap(), straight.synced_info().unwrap());
    for t in 0..2 {
        let a = straight.with_master(t, |m| m.to_vec()).unwrap();
        let b = resumed.with_master(t, |m| m.to_vec()).unwrap();
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    }
}

/// Elastic resume: windows saved on 4 ranks, merged into 2 survivors (each merges one lost
/// rank's window, one of them after a sync, one mid-window, one tensor never written on some
/// ranks), give the f64 reference of all 4 ranks' work; the overflow flag ORs; corrupt, foreign
/// and mid-micro-batch merges change nothing.
#[test]
fn merged_windows_from_four_ranks_resume_on_two() {
    let mut rng = Rng::fresh("merged_windows_from_four_ranks_resume_on_two");
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    let tensors: Vec<TensorDesc> = (0..rng.range(2, 5))
        .map(|_| TensorDesc {
            numel: rng.range(1, 3000) as usize,
            dtype: dtypes[rng.range(0, 2) as usize],
        })
        .collect();
    let config = AccumulatorConfig {
        bucket_numel: rng.range(1, 4000) as usize,
        ..AccumulatorConfig::default()
    };
    let scale = 2f32.powi(rng.range(0, 10) as i32);
    let scaler = Scaler::new(ScalerConfig { init_scale: scale, ..Default::default() }).unwrap();
    // Rank r's micro-batches: (count, per-tensor true gradients or None for a tensor left out).
    let skipped = rng.range(0, tensors.len() as u64 - 1) as usize;
    let mut sum = vec![vec![0f64; 0]; tensors.len()];
    for (t, d) in tensors.iter().enumerate() {
        sum[t] = vec![0.0; d.numel];
    }
    let mut total = 0u64;
    let mut saved = Vec::new();
    for rank in 0..4 {
        let acc = Accumulator::new(config, &tensors).unwrap();
        for _ in 0..rng.range(1, 3) {
            let count = rng.range(1, 9);
            total += count;
            let values: Vec<Vec<f32>> = tensors
                .iter()
                .map(|d| (0..d.numel).map(|_| rng.uniform(-1.0, 1.0) as f32).collect())
                .collect();
            let encoded: Vec<(Vec<f32>, Vec<u16>)> =
                tensors.iter().zip(&values).map(|(d, v)| encode(d.dtype, v, scale)).collect();
            acc.begin_microbatch(count).unwrap();
            for (t, d) in tensors.iter().enumerate() {
                if rank % 2 == 1 && t == skipped {
                    continue;
                }
                let grad = grad_of(d.dtype, &encoded[t].0, &encoded[t].1);
                acc.add_tensor(&scaler, t, grad).unwrap();
                // Mean-reduced micro-batches are weighted by their count.
                for (s, v) in sum[t].iter_mut().zip(&values[t]) {
                    *s += decoded(d.dtype, *v, scale) * count as f64;
                }
            }
            acc.end_microbatch().unwrap();
        }
        saved.push(acc.save_window().unwrap());
    }
    // Two survivors resume: the first from its own save after a fresh start, then merges rank 2's;
    // the second merges rank 1's into a window that was synced before (it starts anew), then 3's.
    let comms = LocalComm::group(2).unwrap();
    let survivors =
        [Accumulator::new(config, &tensors).unwrap(), Accumulator::new(config, &tensors).unwrap()];
    survivors[0].load_window(&saved[0]).unwrap();
    let mut corrupt = saved[2].clone();
    corrupt[30] ^= 1;
    assert_eq!(survivors[0].merge_window(&corrupt).unwrap_err().kind, ErrorKind::CorruptState);
    let other = Accumulator::new(config, &[TensorDesc { numel: 5, dtype: Dtype::F32 }]).unwrap();
    assert_eq!(other.merge_window(&saved[2]).unwrap_err().kind, ErrorKind::SizeMismatch);
    survivors[0].merge_window(&saved[2]).unwrap();
    // The second survivor finished an earlier step: its synced window must not leak into the merge.
    survivors[1].load_window(&saved[0]).unwrap();
    survivors[1].sync(None).unwrap();
    survivors[1].merge_window(&saved[1]).unwrap();
    survivors[1].begin_microbatch(1).unwrap();
    assert_eq!(survivors[1].merge_window(&saved[3]).unwrap_err().kind, ErrorKind::WrongState);
    survivors[1].reset().unwrap();
    survivors[1].merge_window(&saved[1]).unwrap();
    survivors[1].merge_window(&saved[3]).unwrap();
    let infos: Vec<SyncInfo> = std::thread::scope(|s| {
        let handles: Vec<_> = survivors
            .iter()
            .zip(&comms)
            .map(|(a, c)| s.spawn(move || a.sync(Some(c)).unwrap()))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(infos[0], infos[1]);
    assert_eq!(infos[0].total_count, total);
    assert!(!infos[0].found_inf);
    for (t, d) in tensors.iter().enumerate() {
        let got = survivors[0].with_master(t, |m| m.to_vec()).unwrap();
        for (k, (g, s)) in got.iter().zip(&sum[t]).enumerate() {
            let want = s / total as f64;
            // f32 adds of at most ~20 terms of |x| <= 8 (weights up to 8), then one division.
            assert!(
                (*g as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "tensor {t} ({:?}) element {k}: {g} vs {want}",
                d.dtype
            );
        }
    }
    // An overflow in one saved window ORs into the merged one.
    let poisoned = Accumulator::new(config, &tensors).unwrap();
    let inf: Vec<Vec<f32>> = tensors.iter().map(|d| vec![f32::INFINITY; d.numel]).collect();
    let enc: Vec<(Vec<f32>, Vec<u16>)> =
        tensors.iter().zip(&inf).map(|(d, v)| encode(d.dtype, v, 1.0)).collect();
    let grads: Vec<Grad> =
        tensors.iter().zip(&enc).map(|(d, e)| grad_of(d.dtype, &e.0, &e.1)).collect();
    poisoned.add(&scaler, &grads, 1).unwrap();
    let clean = Accumulator::new(config, &tensors).unwrap();
    clean.load_window(&saved[0]).unwrap();
    clean.merge_window(&poisoned.save_window().unwrap()).unwrap();
    assert!(clean.sync(None).unwrap().found_inf);
}

/// Syncs each accumulator as a rank of one in-process group; the infos and tensor 0's masters.
fn sync_group(accs: &[Accumulator]) -> Vec<(SyncInfo, Vec<u32>)> {
    let comms = LocalComm::group(accs.len()).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = accs
            .iter()
            .zip(&comms)
            .map(|(a, c)| {
                s.spawn(move || {
                    (
                        a.sync(Some(c)).unwrap(),
                        a.with_master(0, |m| m.iter().map(|v| v.to_bits()).collect()).unwrap(),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Windows saved on 4 ranks and merged into 2 (or 1) normalise as the 4 ranks would have, under
/// every normalisation: BY_WORLD divides by the 4 rank-windows, not the 2 ranks that sync. The
/// gradient and the info are the 4-rank group's bit for bit, whether the survivors merge into
/// fresh windows, keep their own and merge one lost rank's, or merge windows that were merges
/// themselves; windows in the 0.2 format count as one rank's each.
#[test]
fn merged_windows_normalise_as_the_group_that_produced_them() {
    let mut rng = Rng::fresh("merged_windows_normalise_as_the_group_that_produced_them");
    let tensors = [
        TensorDesc { numel: rng.range(1, 5000) as usize, dtype: Dtype::F32 },
        TensorDesc { numel: 7, dtype: Dtype::F32 },
    ];
    for normalize in
        [Normalize::ByWorld, Normalize::ByCount, Normalize::ByMicrobatches, Normalize::None]
    {
        let config = AccumulatorConfig {
            normalize,
            loss_reduction: LossReduction::Sum,
            ..Default::default()
        };
        let w = four_saved_windows(&mut rng, &tensors, config);
        let fresh = || Accumulator::new(config, &tensors).unwrap();
        let loaded = |i: usize| {
            let a = fresh();
            a.load_window(&w[i]).unwrap();
            a
        };
        let want = sync_group(&[loaded(0), loaded(1), loaded(2), loaded(3)]).remove(0);
        let merged = |a: Accumulator, windows: &[&[u8]]| {
            windows.iter().for_each(|b| a.merge_window(b).unwrap());
            a
        };
        // The tensors have odd sizes: the 0.2 windows hold them packed, and load aligned.
        let layout = fresh();
        let old = |w: &[u8]| as_saved_by_0_2(&layout, w);
        let scenarios: Vec<(&str, Vec<Accumulator>)> = vec![
            (
                "two fresh survivors merge two each",
                vec![merged(fresh(), &[&w[0], &w[1]]), merged(fresh(), &[&w[2], &w[3]])],
            ),
            (
                "survivors keep their own and merge one",
                vec![merged(loaded(0), &[&w[2]]), merged(loaded(1), &[&w[3]])],
            ),
            (
                "one merges three, the other one",
                vec![merged(loaded(0), &[&w[1], &w[2]]), merged(fresh(), &[&w[3]])],
            ),
            ("one rank merges all four", vec![merged(fresh(), &[&w[0], &w[1], &w[2], &w[3]])]),
            (
                "0.2 windows, one rank's each",
                vec![
                    merged(fresh(), &[&old(&w[0]), &old(&w[1])]),
                    merged(loaded(2), &[&old(&w[3])]),
                ],
            ),
        ];
        for (what, accs) in scenarios {
            for (rank, got) in sync_group(&accs).iter().enumerate() {
                assert_eq!(got, &want, "{normalize:?}: {what}: rank {rank}");
            }
        }
        // Merges of merges: two 2-rank merges saved, then merged into one fresh window.
        let halves = [
            merged(fresh(), &[&w[0], &w[1]]).save_window().unwrap(),
            merged(loaded(2), &[&w[3]]).save_window().unwrap(),
        ];
        let got = sync_group(&[merged(fresh(), &[&halves[0], &halves[1]])]).remove(0);
        assert_eq!(got, want, "{normalize:?}: merges of merges");
    }
}

/// Reduce-scatter at the boundary on buffers of many pieces per shard, 1 to 5 ranks, with and
/// without clipping: the shards tile the layout in rank order on block boundaries, and each holds
/// the all-reduce's bits and reports its info.
#[test]
fn reduce_scatter_shards_hold_the_all_reduce_bits() {
    let mut rng = Rng::fresh("reduce_scatter_shards_hold_the_all_reduce_bits");
    for world in 1..=5usize {
        let tensors: Vec<TensorDesc> = (0..3)
            .map(|i| TensorDesc {
                numel: rng.range(1, 150_000) as usize,
                dtype: [Dtype::F32, Dtype::F16, Dtype::Bf16][i],
            })
            .collect();
        let total = Accumulator::master_len(&tensors).unwrap();
        let clip = rng.range(0, 1) == 0;
        let config = AccumulatorConfig {
            max_grad_norm: if clip { 1e-3 } else { 0.0 },
            normalize: Normalize::ByCount,
            ..Default::default()
        };
        let grads: Vec<Vec<Vec<f32>>> = (0..world)
            .map(|_| {
                tensors
                    .iter()
                    .map(|t| (0..t.numel).map(|_| rng.uniform(-1.0, 1.0) as f32).collect())
                    .collect()
            })
            .collect();
        let comms = LocalComm::group(world).unwrap();
        let shards: Vec<std::ops::Range<usize>> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .map(|comm| {
                    let (tensors, grads) = (&tensors, &grads[comm.rank()]);
                    s.spawn(move || {
                        let sharding = Sharding::ReduceScatter { shards: world, rank: comm.rank() };
                        let plain = Accumulator::new(config, tensors).unwrap();
                        let sharded =
                            Accumulator::new(AccumulatorConfig { sharding, ..config }, tensors)
                                .unwrap();
                        assert_eq!(plain.shard().0, 0..plain.len(), "unsharded: the whole master");
                        let encoded: Vec<(Vec<f32>, Vec<u16>)> = tensors
                            .iter()
                            .zip(grads)
                            .map(|(t, g)| encode(t.dtype, g, 1.0))
                            .collect();
                        let views: Vec<Grad> = tensors
                            .iter()
                            .zip(&encoded)
                            .map(|(t, e)| grad_of(t.dtype, &e.0, &e.1))
                            .collect();
                        let one =
                            Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() })
                                .unwrap();
                        plain.add(&one, &views, 2).unwrap();
                        sharded.add(&one, &views, 2).unwrap();
                        let info = plain.sync(Some(comm)).unwrap();
                        assert_eq!(sharded.sync(Some(comm)).unwrap(), info);
                        assert_eq!(info.clip_coef < 1.0, clip);
                        let masters: Vec<Vec<f32>> = (0..tensors.len())
                            .map(|t| plain.with_master(t, |m| m.to_vec()).unwrap())
                            .collect();
                        let flat = flat_master(&plain, &masters);
                        let (range, ptr) = sharded.shard();
                        // SAFETY: the live accumulator's shard, unwritten until its next
                        // micro-batch.
                        let shard = unsafe { std::slice::from_raw_parts(ptr, range.len()) };
                        assert!(
                            shard
                                .iter()
                                .zip(&flat[range.clone()])
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "world {world} shard {range:?}"
                        );
                        range
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut end = 0;
        for s in &shards {
            assert_eq!(
                s.start, end,
                "world {world}: shards {shards:?} do not tile the layout in rank order"
            );
            assert!(s.start.is_multiple_of(4096) || s.is_empty(), "world {world}: {shards:?}");
            end = s.end;
        }
        assert_eq!(end, total);
    }
}

/// A sharded accumulator synced on a communicator of another size or rank, or on none, fails on
/// every rank (never a hang, never a wrong shard) and keeps its window; so does a group whose
/// ranks disagree on sharding.
#[test]
fn sharded_sync_on_a_mismatched_group_fails_on_every_rank() {
    let tensors = [TensorDesc { numel: 10_000, dtype: Dtype::F32 }];
    assert_eq!(
        Accumulator::new(
            AccumulatorConfig {
                sharding: Sharding::ReduceScatter { shards: 2, rank: 2 },
                ..Default::default()
            },
            &tensors
        )
        .unwrap_err()
        .kind,
        ErrorKind::InvalidArgument
    );
    // (shards, rank) per rank of a 2-rank group, and the error each rank sees.
    let cases: [[(Sharding, ErrorKind); 2]; 4] = [
        [
            (Sharding::ReduceScatter { shards: 3, rank: 0 }, ErrorKind::InvalidArgument),
            (Sharding::ReduceScatter { shards: 3, rank: 1 }, ErrorKind::InvalidArgument),
        ],
        [
            (Sharding::ReduceScatter { shards: 2, rank: 1 }, ErrorKind::InvalidArgument),
            (Sharding::ReduceScatter { shards: 2, rank: 0 }, ErrorKind::InvalidArgument),
        ],
        [
            (Sharding::ReduceScatter { shards: 2, rank: 0 }, ErrorKind::PeerFailure),
            (Sharding::ReduceScatter { shards: 2, rank: 0 }, ErrorKind::InvalidArgument),
        ],
        [
            (Sharding::ReduceScatter { shards: 2, rank: 0 }, ErrorKind::SizeMismatch),
            (Sharding::None, ErrorKind::SizeMismatch),
        ],
    ];
    for case in cases {
        let comms = LocalComm::group(2).unwrap();
        std::thread::scope(|s| {
            for (comm, (sharding, want)) in comms.iter().zip(case) {
                let tensors = &tensors;
                s.spawn(move || {
                    let acc = Accumulator::new(
                        AccumulatorConfig { sharding, ..Default::default() },
                        tensors,
                    )
                    .unwrap();
                    let one = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() })
                        .unwrap();
                    acc.add(&one, &[Grad::F32(&[2.0; 10_000])], 1).unwrap();
                    let e = acc.sync(Some(comm)).unwrap_err();
                    assert_eq!(e.kind, want, "{sharding:?}: {e}");
                    acc.with_master(0, |m| {
                        assert!(m.iter().all(|&v| v == 2.0), "{sharding:?}: the window changed")
                    })
                    .unwrap();
                    if let Sharding::ReduceScatter { shards: 2, .. } = sharding {
                        assert_eq!(
                            acc.sync(None).unwrap_err().kind,
                            ErrorKind::InvalidArgument,
                            "a sync with no communicator"
                        );
                    }
                });
            }
        });
    }
}

/// A bf16 wire rounds each rank's FP32 contribution to bf16 once and sums the contributions in
/// FP32 in rank order: exactly those bits, on every rank and in every shard, and an error within
/// (2^-8 + (W - 1) 2^-24) of the magnitude (summing in bf16 would add a rounding of up to 2^-8
/// per rank).
#[test]
fn a_bf16_wire_rounds_each_contribution_once() {
    let mut rng = Rng::fresh("a_bf16_wire_rounds_each_contribution_once");
    let numel = 3 * 4096 + 5;
    for world in [2, 3, 8] {
        let grads: Vec<Vec<f32>> = (0..world)
            .map(|r| {
                (0..numel)
                    .map(|_| (rng.uniform(-1.0, 1.0) * [1.0, 1e3, 1e-3][r % 3]) as f32)
                    .collect()
            })
            .collect();
        let rounded = |r: usize, i: usize| from_bf16(to_bf16(grads[r][i])) as f32;
        let want: Vec<f32> =
            (0..numel).map(|i| (1..world).fold(rounded(0, i), |s, r| s + rounded(r, i))).collect();
        let config = AccumulatorConfig {
            loss_reduction: LossReduction::Sum,
            normalize: Normalize::None,
            wire: Dtype::Bf16,
            ..Default::default()
        };
        let tensors = [TensorDesc { numel, dtype: Dtype::F32 }];
        let comms = LocalComm::group(world).unwrap();
        std::thread::scope(|s| {
            for comm in &comms {
                let (grads, want, tensors) = (&grads[comm.rank()], &want, &tensors);
                s.spawn(move || {
                    let sharding = Sharding::ReduceScatter { shards: world, rank: comm.rank() };
                    let one = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() })
                        .unwrap();
                    let plain = Accumulator::new(config, tensors).unwrap();
                    let sharded =
                        Accumulator::new(AccumulatorConfig { sharding, ..config }, tensors)
                            .unwrap();
                    for acc in [&plain, &sharded] {
                        acc.add(&one, &[Grad::F32(grads)], 1).unwrap();
                        acc.sync(Some(comm)).unwrap();
                    }
                    let got = plain.with_master(0, |m| m.to_vec()).unwrap();
                    assert!(
                        got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "world {world}: not the recipe's bits"
                    );
                    let (range, ptr) = sharded.shard();
                    // SAFETY: the live accumulator's shard, unwritten until its next micro-batch.
                    let shard = unsafe { std::slice::from_raw_parts(ptr, range.len()) };
                    let want = flat_master(&plain, std::slice::from_ref(want));
                    assert!(
                        shard
                            .iter()
                            .zip(&want[range.clone()])
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "world {world}: shard {range:?}"
                    );
                });
            }
        });
        for (i, &got) in want.iter().enumerate() {
            let exact: f64 = (0..world).map(|r| grads[r][i] as f64).sum();
            let magnitude: f64 = (0..world).map(|r| (grads[r][i] as f64).abs()).sum();
            let bound = ((2f64).powi(-8) + (world - 1) as f64 * (2f64).powi(-24)) * magnitude;
            assert!(
                (got as f64 - exact).abs() <= bound,
                "world {world} element {i}: {got} vs {exact}, bound {bound}"
            );
        }
    }
}

/// The BF16 wire's bound, `(2^-8 + (W - 1) 2^-24)` of the magnitude (docs/sharding.md), reached:
/// rank 0 sends `(1 + 2^-8) 2^e`, which rounds to `2^e` (a tie, to even), and each other rank
/// `(1 + 2^-8) 2^(e-24)`, which rounds to `2^(e-24)`, half an FP32 ulp of `2^e`, so each FP32 sum
/// ties back to `2^e`. Every element and the norm come within 1% of the bound, and at 300 ranks
/// past `2^-8` of the magnitude: a bound without the FP32 summation term would fail here.
#[test]
fn a_bf16_wire_reaches_its_error_bound() {
    // Exponents spread over the range where every contribution is normal in FP32 and bf16.
    let exponents = [0, -60, 100, 7];
    let signs = [1.0, 1.0, 1.0, -1.0];
    let numel = exponents.len();
    let tiny = 1.0 + 2f64.powi(-8);
    for world in [2usize, 300] {
        let contribution = |r: usize, i: usize| {
            signs[i] * tiny * 2f64.powi(if r == 0 { exponents[i] } else { exponents[i] - 24 })
        };
        let config = AccumulatorConfig {
            loss_reduction: LossReduction::Sum,
            normalize: Normalize::None,
            wire: Dtype::Bf16,
            ..Default::default()
        };
        let tensors = [TensorDesc { numel, dtype: Dtype::F32 }];
        let comms = LocalComm::group(world).unwrap();
        let results: Vec<(SyncInfo, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .map(|comm| {
                    let tensors = &tensors;
                    s.spawn(move || {
                        let grad: Vec<f32> =
                            (0..numel).map(|i| contribution(comm.rank(), i) as f32).collect();
                        let one =
                            Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() })
                                .unwrap();
                        let acc = Accumulator::new(config, tensors).unwrap();
                        acc.add(&one, &[Grad::F32(&grad)], 1).unwrap();
                        let info = acc.sync(Some(comm)).unwrap();
                        (info, acc.with_master(0, |m| m.to_vec()).unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let unit = 2f64.powi(-8) + (world - 1) as f64 * 2f64.powi(-24);
        let (mut exact_norm, mut magnitude_norm) = (0.0, 0.0);
        for i in 0..numel {
            // The contributions are exact in f32 and f64: the sum and magnitude below are exact
            // up to f64 rounding, far below the margins checked.
            let exact: f64 = (0..world).map(|r| contribution(r, i)).sum();
            let magnitude: f64 = (0..world).map(|r| contribution(r, i).abs()).sum();
            exact_norm += exact * exact;
            magnitude_norm += magnitude * magnitude;
            let got = results[0].1[i] as f64;
            assert_eq!(
                got,
                signs[i] * 2f64.powi(exponents[i]),
                "world {world} element {i}: not the rounded recipe"
            );
            let ratio = (got - exact).abs() / (unit * magnitude);
            assert!(
                (0.99..=1.0).contains(&ratio),
                "world {world} element {i}: error {ratio} of the bound"
            );
            if world == 300 {
                let past = (got - exact).abs() / (2f64.powi(-8) * magnitude);
                assert!(
                    past > 1.0,
                    "world {world} element {i}: error {past} of 2^-8 of the magnitude"
                );
            }
        }
        let norm_ratio =
            (results[0].0.grad_norm - exact_norm.sqrt()).abs() / (unit * magnitude_norm.sqrt());
        assert!(
            (0.99..=1.0).contains(&norm_ratio),
            "world {world}: the norm moved by {norm_ratio} of its bound"
        );
        for (r, (info, master)) in results.iter().enumerate() {
            assert_eq!(*info, results[0].0, "world {world}: rank {r}'s info");
            assert!(
                master.iter().zip(&results[0].1).all(|(a, b)| a.to_bits() == b.to_bits()),
                "world {world}: rank {r}'s master"
            );
        }
    }
}

/// The hybrid boundary (HSDP) against the f64 reference over every rank of both groups, with
/// random settings: replicas hold the same bits, the shards tile the gradient, every rank reports
/// the same info; with one replica it is the plain reduce-scatter, with one shard DDP over the
/// replicas, bit for bit.
#[test]
fn hybrid_boundaries_match_the_reference_on_every_rank() {
    let mut rng = Rng::fresh("hybrid_boundaries_match_the_reference_on_every_rank");
    for (case, (shards, replicas)) in
        [(2, 2), (3, 2), (2, 3), (1, 3), (3, 1), (2, 2), (4, 2)].into_iter().enumerate()
    {
        let world = shards * replicas;
        let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
        let tensors: Vec<TensorDesc> = (0..rng.range(1, 5))
            .map(|_| TensorDesc {
                numel: [1, 33, 4097, 9000][rng.range(0, 3) as usize],
                dtype: dtypes[rng.range(0, 2) as usize],
            })
            .collect();
        let config = AccumulatorConfig {
            loss_reduction: if rng.range(0, 1) == 0 {
                LossReduction::Mean
            } else {
                LossReduction::Sum
            },
            normalize: [
                Normalize::ByCount,
                Normalize::ByMicrobatches,
                Normalize::ByWorld,
                Normalize::None,
            ][rng.range(0, 3) as usize],
            max_grad_norm: if rng.range(0, 1) == 0 { 0.05 } else { 0.0 },
            wire: if rng.range(0, 2) == 0 { Dtype::Bf16 } else { Dtype::F32 },
            ..Default::default()
        };
        // Per rank: micro-batches of (count, gradient per tensor).
        let windows: Vec<Vec<(u64, Vec<Vec<f32>>)>> = (0..world)
            .map(|_| {
                (0..rng.range(1, 2))
                    .map(|_| {
                        (
                            rng.range(1, 9),
                            tensors
                                .iter()
                                .map(|t| {
                                    (0..t.numel).map(|_| rng.uniform(-1.0, 1.0) as f32).collect()
                                })
                                .collect(),
                        )
                    })
                    .collect()
            })
            .collect();
        // `hybrid`: sync_hybrid; otherwise the plain boundary on the group of more than one rank,
        // sharded when that is the shard group, DDP over the replicas when there is one shard.
        let run = |g: usize, sc: &LocalComm, rc: &LocalComm, hybrid: bool| {
            let sharding = if hybrid || shards > 1 {
                Sharding::ReduceScatter { shards, rank: sc.rank() }
            } else {
                Sharding::None
            };
            let acc = Accumulator::new(AccumulatorConfig { sharding, ..config }, &tensors).unwrap();
            let one = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
            for (count, grads) in &windows[g] {
                let encoded: Vec<(Vec<f32>, Vec<u16>)> =
                    tensors.iter().zip(grads).map(|(t, v)| encode(t.dtype, v, 1.0)).collect();
                let views: Vec<Grad> = tensors
                    .iter()
                    .zip(&encoded)
                    .map(|(t, e)| grad_of(t.dtype, &e.0, &e.1))
                    .collect();
                acc.add(&one, &views, *count).unwrap();
            }
            let info = match (hybrid, shards) {
                (true, _) => acc.sync_hybrid(sc, rc).unwrap(),
                (false, 1) => acc.sync(Some(rc)).unwrap(),
                (false, _) => acc.sync(Some(sc)).unwrap(),
            };
            let (range, ptr) = acc.shard();
            // SAFETY: the live accumulator's shard, unwritten until its next micro-batch.
            (info, range.clone(), unsafe { std::slice::from_raw_parts(ptr, range.len()) }.to_vec())
        };
        let results = hybrid_grid(shards, replicas, |g, sc, rc| run(g, sc, rc, true));

        let what = format!("case {case}: {shards} shards x {replicas} replicas, {config:?}");
        let info = results[0].0;
        assert!(results.iter().all(|r| r.0 == info), "{what}: ranks report differently");
        for (g, r) in results.iter().enumerate() {
            let twin = &results[g % shards];
            assert!(
                r.1 == twin.1 && r.2.iter().zip(&twin.2).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: rank {g} differs from its replica"
            );
        }
        let padded: Vec<f32> = results[..shards].iter().flat_map(|r| r.2.clone()).collect();
        // The shards tile the master, and its padding stays zero.
        let flat = packed_of(&Accumulator::new(config, &tensors).unwrap(), &padded);

        // The f64 reference over every rank.
        let weights_by_count = config.weights_by_count();
        let (mut reference, mut magnitude) = (vec![0f64; flat.len()], vec![0f64; flat.len()]);
        for (count, grads) in windows.iter().flatten() {
            let w = if weights_by_count { *count as f64 } else { 1.0 };
            for (i, v) in tensors
                .iter()
                .zip(grads)
                .flat_map(|(t, g)| g.iter().map(move |&v| decoded(t.dtype, v, 1.0)))
                .enumerate()
            {
                reference[i] += v * w;
                magnitude[i] += (v * w).abs();
            }
        }
        let total_count: u64 = windows.iter().flatten().map(|m| m.0).sum();
        let microbatches = windows.iter().map(|w| w.len() as u64).sum::<u64>();
        assert_eq!((info.total_count, info.microbatches), (total_count, microbatches), "{what}");
        let divisor = config.normalize.divisor(total_count, microbatches, world as u64) as f64;
        let norm = reference.iter().map(|v| (v / divisor).powi(2)).sum::<f64>().sqrt();
        let wire_error =
            if config.wire == Dtype::Bf16 && world > 1 { (2f64).powi(-8) } else { 0.0 };
        let norm_tol = 1e-5 * norm
            + wire_error * magnitude.iter().map(|m| (m / divisor).powi(2)).sum::<f64>().sqrt();
        assert!(
            (info.grad_norm - norm).abs() <= norm_tol,
            "{what}: norm {} vs {norm}",
            info.grad_norm
        );
        let coef = if config.max_grad_norm > 0.0 {
            (config.max_grad_norm as f64 / (norm + 1e-6)).min(1.0)
        } else {
            1.0
        };
        for (i, &got) in flat.iter().enumerate() {
            let want = reference[i] / divisor * coef;
            let tol = (2e-6 + wire_error) * magnitude[i] / divisor * coef
                + (reference[i] / divisor).abs() * (info.clip_coef - coef).abs()
                + 1e-30;
            assert!(
                (got as f64 - want).abs() <= tol,
                "{what}: element {i}: {got} vs {want} (tol {tol})"
            );
        }

        // Degenerate grids are the plain boundaries, bit for bit.
        if replicas == 1 || shards == 1 {
            let plain = hybrid_grid(shards, replicas, |g, sc, rc| run(g, sc, rc, false));
            for (g, (a, b)) in results.iter().zip(&plain).enumerate() {
                assert!(
                    a.0 == b.0 && a.2.iter().zip(&b.2).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{what}: rank {g} differs from the plain boundary"
                );
            }
        }
    }
}

/// Hybrid misuse fails on every rank, never hangs: replica groups whose ranks hold different
/// shards, an unsharded accumulator, and shard groups whose replica groups differ in size.
#[test]
fn hybrid_misuse_fails_on_every_rank() {
    let tensors = [TensorDesc { numel: 3 * 4096 + 5, dtype: Dtype::F32 }];
    let grads = vec![0.5f32; tensors[0].numel];
    let one = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
    // The error of a hybrid sync; with `recover`, a plain sync on the shard group then reduces
    // the window, which the failure left intact.
    let sync = |config: AccumulatorConfig, sc: &LocalComm, rc: &LocalComm, recover: bool| {
        for c in [sc, rc] {
            c.set_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
        }
        let acc = Accumulator::new(config, &tensors).unwrap();
        acc.add(&one, &[Grad::F32(&grads)], 1).unwrap();
        let e = acc.sync_hybrid(sc, rc).unwrap_err();
        if recover {
            acc.sync(Some(sc)).unwrap();
        }
        e.kind
    };
    let sharded = |rank: usize| AccumulatorConfig {
        sharding: Sharding::ReduceScatter { shards: 2, rank },
        ..Default::default()
    };
    // 2 x 2, but shard group 1 joins the replica groups crosswise: replica group j pairs shard j
    // of shard group 0 with shard 1 - j of shard group 1. Every shard check passes.
    let shard_groups: Vec<Vec<LocalComm>> = (0..2).map(|_| LocalComm::group(2).unwrap()).collect();
    let replica_groups: Vec<Vec<LocalComm>> =
        (0..2).map(|_| LocalComm::group(2).unwrap()).collect();
    let kinds: Vec<ErrorKind> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|g| {
                let (a, i) = (g / 2, g % 2);
                let (sc, rc) =
                    (&shard_groups[a][i], &replica_groups[if a == 1 { 1 - i } else { i }][a]);
                s.spawn(move || sync(sharded(i), sc, rc, true))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(kinds.iter().all(|&k| k == ErrorKind::SizeMismatch), "{kinds:?}");
    // One rank of shard group 0 clips and the others do not: its group differs before the replica
    // tags, and must stay different whatever they are.
    for norm in [0.125, 2.5, 0.3, 7.0, 1e-3] {
        let kinds = hybrid_grid(2, 2, |g, sc, rc| {
            sync(
                AccumulatorConfig {
                    max_grad_norm: if g == 1 { norm } else { 0.0 },
                    ..sharded(sc.rank())
                },
                sc,
                rc,
                false,
            )
        });
        assert!(
            kinds.iter().all(|&k| k == ErrorKind::SizeMismatch),
            "max_grad_norm {norm} on one rank: {kinds:?}"
        );
    }
    // Replica groups of two sizes: ranks 0 and 2 are replicas, ranks 1 and 3 each alone.
    let shard_groups: Vec<Vec<LocalComm>> = (0..2).map(|_| LocalComm::group(2).unwrap()).collect();
    let pair = LocalComm::group(2).unwrap();
    let alone: Vec<Vec<LocalComm>> = (0..2).map(|_| LocalComm::group(1).unwrap()).collect();
    let kinds: Vec<ErrorKind> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|g| {
                let (a, i) = (g / 2, g % 2);
                let (sc, rc) = (&shard_groups[a][i], if i == 0 { &pair[a] } else { &alone[a][0] });
                s.spawn(move || sync(sharded(i), sc, rc, true))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(kinds.iter().all(|&k| k == ErrorKind::SizeMismatch), "{kinds:?}");
    // An unsharded accumulator cannot take a hybrid boundary.
    let kinds = hybrid_grid(2, 2, |_, sc, rc| sync(AccumulatorConfig::default(), sc, rc, false));
    assert!(kinds.iter().all(|&k| k == ErrorKind::InvalidArgument), "{kinds:?}");
}

/// A window saved mid-accumulation on sharded ranks restores on as many new sharded ranks (and
/// merges into others): the synced shards are those of the uninterrupted window, bit for bit.
#[test]
fn sharded_windows_survive_a_checkpoint() {
    let mut rng = Rng::fresh("sharded_windows_survive_a_checkpoint");
    let world = 3;
    let tensors = [
        TensorDesc { numel: 5000, dtype: Dtype::F16 },
        TensorDesc { numel: 7001, dtype: Dtype::F32 },
    ];
    let grads: Vec<Vec<Vec<f32>>> = (0..world * 2)
        .map(|_| {
            tensors
                .iter()
                .map(|t| (0..t.numel).map(|_| rng.uniform(-1.0, 1.0) as f32).collect())
                .collect()
        })
        .collect();
    let comms = LocalComm::group(world).unwrap();
    std::thread::scope(|s| {
        for comm in &comms {
            let (grads, tensors) = (&grads, &tensors);
            s.spawn(move || {
                let r = comm.rank();
                let config = AccumulatorConfig {
                    sharding: Sharding::ReduceScatter { shards: world, rank: r },
                    max_grad_norm: 0.5,
                    ..Default::default()
                };
                let one =
                    Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
                let add = |acc: &Accumulator, k: usize| {
                    let encoded: Vec<(Vec<f32>, Vec<u16>)> = tensors
                        .iter()
                        .zip(&grads[k])
                        .map(|(t, g)| encode(t.dtype, g, 1.0))
                        .collect();
                    let views: Vec<Grad> = tensors
                        .iter()
                        .zip(&encoded)
                        .map(|(t, e)| grad_of(t.dtype, &e.0, &e.1))
                        .collect();
                    acc.add(&one, &views, 1 + k as u64).unwrap();
                };
                let shard_of = |acc: &Accumulator| {
                    let (range, ptr) = acc.shard();
                    // SAFETY: the live accumulator's shard, unwritten until its next micro-batch.
                    unsafe { std::slice::from_raw_parts(ptr, range.len()) }
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<u32>>()
                };
                // Uninterrupted: two micro-batches, then the boundary.
                let whole = Accumulator::new(config, tensors).unwrap();
                add(&whole, 2 * r);
                add(&whole, 2 * r + 1);
                let info = whole.sync(Some(comm)).unwrap();
                // Interrupted after the first micro-batch: saved, restored into a new accumulator.
                let before = Accumulator::new(config, tensors).unwrap();
                add(&before, 2 * r);
                let saved = before.save_window().unwrap();
                let after = Accumulator::new(config, tensors).unwrap();
                after.load_window(&saved).unwrap();
                add(&after, 2 * r + 1);
                assert_eq!(after.sync(Some(comm)).unwrap(), info);
                assert_eq!(shard_of(&after), shard_of(&whole), "rank {r}: restored window");
                // Merged into a window that holds the second micro-batch.
                let merged = Accumulator::new(config, tensors).unwrap();
                add(&merged, 2 * r + 1);
                merged.merge_window(&saved).unwrap();
                let merged_info = merged.sync(Some(comm)).unwrap();
                assert_eq!(
                    (merged_info.total_count, merged_info.microbatches),
                    (info.total_count, info.microbatches)
                );
            });
        }
    });
}

#[test]
fn an_empty_window_says_whether_it_was_synced_already() {
    let tensors = [TensorDesc { numel: 3, dtype: Dtype::F32 }];
    let scaler = Scaler::new(ScalerConfig::default()).unwrap();
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let e = acc.sync(None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::EmptyWindow);
    assert!(e.message.ends_with("sync on an empty window: no rank added a micro-batch"), "{e}");
    acc.add(&scaler, &[Grad::F32(&[1.0; 3])][..], 1).unwrap();
    acc.sync(None).unwrap();
    let e = acc.sync(None).unwrap_err();
    assert_eq!(e.kind, ErrorKind::EmptyWindow);
    assert!(e.message.contains("the window was synced already, and no rank added"), "{e}");
}

#[test]
fn a_count_past_two_to_the_63_is_named_as_a_negative_one() {
    let tensors = [TensorDesc { numel: 3, dtype: Dtype::F32 }];
    let scaler = Scaler::new(ScalerConfig::default()).unwrap();
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    let e = acc.add(&scaler, &[Grad::F32(&[1.0; 3])][..], -3i64 as u64).unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.message.contains("(as a signed integer -3: a negative count?)"), "{e}");
    let e = acc.add(&scaler, &[Grad::F32(&[1.0; 3])][..], 1 << 48).unwrap_err();
    assert!(!e.message.contains("negative"), "{e}");
}
