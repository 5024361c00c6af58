//! The mesh step against a float64 single-device reference (tests/common/mesh_model.rs): the
//! synthetic model distributed onto every mesh of at most 8 ranks, in-process on the CPU. Every
//! rank's synced gradient equals the reference's slice within the model's bound, the norm is the
//! f64 global norm, the clip coefficient is the same bits everywhere, and an inf on one rank
//! skips the step on all (or, dropping micro-batches, drops it on every peer that shares it). The anchors' mistakes are computed beside gradacc's answer; bad input
//! fails on every rank.

mod common;

use std::sync::Arc;

use common::mesh_model::{
    a_poisoned_microbatch_drops_on_its_peers, matches_the_reference, one_inf_skips_everywhere,
    reference, run, schedule, Case, Host, Kind, MESHES, SCALE,
};
use common::Rng;
use gradacc::{
    Accumulator, AccumulatorConfig, Axis, Communicator, Dtype, ErrorKind, LocalComm, LossReduction,
    Mesh, MeshShape, Part, Replicated, Scaler, ScalerConfig, Sharding, TensorDesc,
};

#[test]
fn every_mesh_matches_the_f64_reference() {
    let mut rng = Rng::fresh("every_mesh_matches_the_f64_reference");
    for case in &MESHES {
        matches_the_reference(&mut rng, case, Host::new);
    }
}

#[test]
fn an_inf_on_one_rank_skips_the_step_everywhere() {
    let mut rng = Rng::fresh("an_inf_on_one_rank_skips_the_step_everywhere");
    for case in &MESHES {
        one_inf_skips_everywhere(&mut rng, case, true, Host::new);
    }
}

#[test]
fn a_poisoned_microbatch_drops_on_every_peer_that_shares_it() {
    let mut rng = Rng::fresh("a_poisoned_microbatch_drops_on_every_peer_that_shares_it");
    for case in &MESHES {
        a_poisoned_microbatch_drops_on_its_peers(&mut rng, case, Host::new);
    }
}

/// The anchors' scenarios on dp 2 x tp 2 with ep 2: what each got wrong, against gradacc's
/// answer and the reference.
#[test]
fn the_anchors_mistakes_beside_the_mesh_answer() {
    let mut rng = Rng::fresh("the_anchors_mistakes_beside_the_mesh_answer");
    let case = Case { world: 4, tp: 2, pp: 1, cp: 1, ep: 2, etp: 1 };
    let mut s = schedule(&mut rng, &case, None);
    s.dtype = Dtype::F32;
    s.counts = vec![vec![3, 4], vec![2, 5]];
    let reference = reference(&case, &s);
    let sq = |pred: &dyn Fn(Kind) -> bool| -> f64 {
        reference.iter().filter(|(k, _)| pred(*k)).flat_map(|(_, v)| v).map(|(g, _)| g * g).sum()
    };
    let norm = sq(&|_| true).sqrt();
    let out = run(&case, &s, 0.0, Host::new);
    let got = out[0].info.info.grad_norm;
    assert!((got - norm).abs() <= 1e-6 * norm, "{got} against {norm}");
    // Megatron-LM #5916: with EP > 1 and TP > 1 the norm skipped the experts.
    let without_experts = sq(&|k| !matches!(k, Kind::Expert(_))).sqrt();
    // DeepSpeed #8478: expert squares summed over the expert-data-parallel replicas as well
    // (each group's norm counted on every member), the rest once.
    let experts_per_member = (sq(&|k| !matches!(k, Kind::Expert(_)))
        + 2.0 * sq(&|k| matches!(k, Kind::Expert(_))))
    .sqrt();
    // The replicated layer norm counted on each tensor-parallel rank.
    let norm_twice = (norm * norm + sq(&|k| k == Kind::Norm)).sqrt();
    for wrong in [without_experts, experts_per_member, norm_twice] {
        assert!((wrong - norm).abs() > 1e-3 * norm, "{wrong} should differ from {norm}");
    }
    // PyTorch #160285: expert gradients normalised by their own group's items (the two data
    // ranks of an expert-data-parallel group see all tokens, but a per-group normaliser of one
    // rank's count doubles them); gradacc divides by the job's count.
    let expert0 = &reference.iter().find(|(k, _)| *k == Kind::Expert(0)).unwrap().1;
    let held = out
        .iter()
        .flat_map(|o| &o.held)
        .find(|(k, j, _)| *k == Kind::Expert(0) && *j == 0)
        .unwrap();
    assert!(
        (held.2 as f64 - expert0[0].0).abs() <= 1e-6 * expert0[0].1,
        "{} vs {}",
        held.2,
        expert0[0].0
    );
    eprintln!(
        "global norm: gradacc {got:.6}, f64 {norm:.6}; without experts (Megatron-LM #5916) \
         {without_experts:.6}; experts per member (DeepSpeed #8478) {experts_per_member:.6}; \
         replicated norm twice {norm_twice:.6}"
    );
}

/// `f(rank, world, data)` on two ranks on threads: a world of two and a data group of two.
fn on_two_ranks<T: Send>(f: impl Fn(usize, LocalComm, LocalComm) -> T + Sync) -> Vec<T> {
    let (world, data) = (LocalComm::group(2).unwrap(), LocalComm::group(2).unwrap());
    std::thread::scope(|scope| {
        let f = &f;
        let handles: Vec<_> = world
            .into_iter()
            .zip(data)
            .enumerate()
            .map(|(rank, (w, d))| scope.spawn(move || f(rank, w, d)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// An accumulator of one tensor of 5 elements with one micro-batch of `items` added.
fn fed(config: AccumulatorConfig, items: u64) -> Accumulator {
    let t = [TensorDesc { numel: 5, dtype: Dtype::F32 }];
    let acc = Accumulator::new(config, &t).unwrap();
    let scaler = Scaler::new(ScalerConfig::default()).unwrap();
    acc.add(&scaler, &[gradacc::Grad::F32(&[1.0; 5])][..], items).unwrap();
    acc
}

/// Bad input fails on every rank with the same kind, naming the ranks; the windows are intact.
#[test]
fn peers_that_count_differently_fail_on_every_rank() {
    // dp 1 x tp 2: both ranks at data rank 0, one counting an extra item.
    let shape = MeshShape::new(2, 2, 1, 1, 1, 1).unwrap();
    let results = on_two_ranks(|rank, w, _| {
        let acc = fed(AccumulatorConfig::default(), 3 + rank as u64);
        let mesh = Mesh::of_shape(Arc::new(w), &shape).unwrap();
        let e = mesh.sync(&[Part::new(&acc, None)]).unwrap_err();
        // The window is intact: a plain sync still sees its micro-batch.
        (e, acc.sync(None).unwrap().total_count)
    });
    for (rank, (e, count)) in results.iter().enumerate() {
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
        assert!(e.message.contains("world ranks 0 and 1 share data-parallel rank 0"), "{e}");
        assert_eq!(*count, 3 + rank as u64);
    }
}

/// A rank whose accumulator does not drop micro-batches fails `end_microbatch` on every rank;
/// every micro-batch stays open, and ends by itself.
#[test]
fn an_invalid_end_microbatch_fails_every_rank_and_leaves_it_open() {
    let shape = MeshShape::new(2, 2, 1, 1, 1, 1).unwrap();
    let results = on_two_ranks(|rank, w, _| {
        let overflow = [gradacc::Overflow::DropMicrobatch, gradacc::Overflow::SkipStep][rank];
        let t = [TensorDesc { numel: 5, dtype: Dtype::F32 }];
        let acc =
            Accumulator::new(AccumulatorConfig { overflow, ..Default::default() }, &t).unwrap();
        let scaler = Scaler::new(ScalerConfig::default()).unwrap();
        acc.begin_microbatch(3).unwrap();
        acc.add_tensor(&scaler, 0, gradacc::Grad::F32(&[1.0; 5])).unwrap();
        let mesh = Mesh::of_shape(Arc::new(w), &shape).unwrap();
        let e = mesh.end_microbatch(&[&acc]).unwrap_err();
        acc.end_microbatch().unwrap();
        (e, acc.sync(None).unwrap().total_count)
    });
    assert_eq!(results[1].0.kind, ErrorKind::InvalidArgument, "{}", results[1].0);
    assert!(results[1].0.message.contains("does not drop micro-batches"), "{}", results[1].0);
    assert_eq!(results[0].0.kind, ErrorKind::PeerFailure, "{}", results[0].0);
    assert!(results[0].0.message.contains("world rank 1; every rank's micro-batch is still open"));
    assert!(results.iter().all(|r| r.1 == 3));
}

#[test]
fn a_replicated_tensor_undeclared_on_a_peer_fails_on_every_rank() {
    let shape = MeshShape::new(2, 2, 1, 1, 1, 1).unwrap();
    let errors = on_two_ranks(|rank, w, _| {
        let acc = fed(AccumulatorConfig { tensor_stats: true, ..Default::default() }, 3);
        let r = [Replicated { tensor: 0, key: 7, copies: 2 }];
        let replicated: &[Replicated] = if rank == 0 { &r } else { &[] };
        let mesh = Mesh::of_shape(Arc::new(w), &shape).unwrap();
        mesh.sync(&[Part { replicated, ..Part::new(&acc, None) }]).unwrap_err()
    });
    for e in &errors {
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{e}");
        let want = "key 0x7 is declared with 2 copies, but 1 group holds it (world rank 0)";
        assert!(e.message.contains(want), "{e}");
    }
}

#[test]
fn a_part_invalid_on_one_rank_fails_every_rank_without_waiting() {
    let shape = MeshShape::new(2, 1, 1, 1, 1, 1).unwrap();
    let errors = on_two_ranks(|rank, w, d| {
        // Rank 1's accumulator clips by itself: refused there, told to rank 0.
        let acc = fed(AccumulatorConfig { max_grad_norm: rank as f32, ..Default::default() }, 3);
        let mesh = Mesh::of_shape(Arc::new(w), &shape).unwrap();
        mesh.sync(&[Part::new(&acc, Some(&d))]).unwrap_err()
    });
    assert_eq!(errors[1].kind, ErrorKind::InvalidArgument, "{}", errors[1]);
    let want = "clips by itself (max_grad_norm 1): in a mesh step the norm is the job's";
    assert!(errors[1].message.contains(want), "{}", errors[1]);
    assert_eq!(errors[0].kind, ErrorKind::PeerFailure, "{}", errors[0]);
}

/// A rank that never calls the step: its peer ends at the communicators' timeout, with its window
/// intact (a plain sync alone still sees its micro-batch).
#[test]
fn a_rank_that_does_not_call_ends_its_peer_at_the_timeout() {
    let mut world = LocalComm::group(2).unwrap();
    let mut data = LocalComm::group(2).unwrap();
    let (w, d) = (world.remove(0), data.remove(0));
    for c in [&w, &d] {
        c.set_timeout(Some(std::time::Duration::from_millis(300))).unwrap();
    }
    let acc = fed(AccumulatorConfig::default(), 3);
    let mesh = Mesh::new(Arc::new(w), 0, 1).unwrap();
    let start = std::time::Instant::now();
    let e = mesh.sync(&[Part::new(&acc, Some(&d))]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
    assert!(e.message.contains("intact"), "{e}");
    // The bound is the timeout; the slack is for a busy machine.
    assert!(start.elapsed() < std::time::Duration::from_secs(30), "{:?}", start.elapsed());
    drop((world, data));
    assert_eq!(acc.sync(None).unwrap().total_count, 3);
}

/// A rank that never ends its micro-batch through the mesh: its peer ends at the world's timeout
/// with its micro-batch still open (it ends by itself, and a plain sync sees it).
#[test]
fn a_rank_that_does_not_end_its_microbatch_ends_its_peer_at_the_timeout() {
    let mut world = LocalComm::group(2).unwrap();
    let w = world.remove(0);
    w.set_timeout(Some(std::time::Duration::from_millis(300))).unwrap();
    let config =
        AccumulatorConfig { overflow: gradacc::Overflow::DropMicrobatch, ..Default::default() };
    let acc = Accumulator::new(config, &[TensorDesc { numel: 5, dtype: Dtype::F32 }]).unwrap();
    let scaler = Scaler::new(ScalerConfig::default()).unwrap();
    acc.begin_microbatch(3).unwrap();
    acc.add_tensor(&scaler, 0, gradacc::Grad::F32(&[1.0; 5])).unwrap();
    let mesh = Mesh::new(Arc::new(w), 0, 1).unwrap();
    let e = mesh.end_microbatch(&[&acc]).unwrap_err();
    assert_eq!(e.kind, ErrorKind::Timeout, "{e}");
    assert!(e.message.contains("every micro-batch is still open"), "{e}");
    drop(world);
    acc.end_microbatch().unwrap();
    assert_eq!(acc.sync(None).unwrap().total_count, 3);
}

/// A rank whose arguments were refused before the step (the C ABI's) tells its part's group and
/// the world; the others fail naming it, and their windows are intact.
#[test]
fn a_refused_step_fails_every_rank_without_waiting() {
    use gradacc::mesh::RefusedPart;
    let world = LocalComm::group(4).unwrap();
    // dp 2 x tp 2: data groups {0, 2} and {1, 3}.
    let shape = MeshShape::new(4, 2, 1, 1, 1, 1).unwrap();
    let mut data: Vec<Option<LocalComm>> = Vec::new();
    data.resize_with(4, || None);
    for group in [[0, 2], [1, 3]] {
        for (c, r) in LocalComm::group(2).unwrap().into_iter().zip(group) {
            data[r] = Some(c);
        }
    }
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = world
            .into_iter()
            .zip(data)
            .enumerate()
            .map(|(rank, (w, d))| {
                let shape = &shape;
                scope.spawn(move || {
                    let d = d.unwrap();
                    let t = [TensorDesc { numel: 5, dtype: Dtype::F32 }];
                    let acc = Accumulator::new(AccumulatorConfig::default(), &t).unwrap();
                    let scaler = Scaler::new(ScalerConfig::default()).unwrap();
                    acc.add(&scaler, &[gradacc::Grad::F32(&[1.0; 5])][..], 3).unwrap();
                    let mesh = Mesh::of_shape(Arc::new(w), shape).unwrap();
                    if rank == 2 {
                        let comm: &dyn Communicator = &d;
                        let part = RefusedPart { comm: Some(comm), ..Default::default() };
                        mesh.refuse(&[part]);
                        return None;
                    }
                    let e = mesh.sync(&[Part::new(&acc, Some(&d))]).unwrap_err();
                    Some((e, acc.sync(None).unwrap().total_count))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, r) in results.iter().enumerate() {
        let Some((e, count)) = r else { continue };
        assert_eq!(e.kind, ErrorKind::PeerFailure, "rank {rank}: {e}");
        assert_eq!(*count, 3, "rank {rank}: the window is intact");
    }
    // Rank 0, rank 2's data-parallel peer, failed in its group's step; 1 and 3 learn both.
    let e = &results[1].as_ref().unwrap().0;
    assert!(e.message.contains("world ranks 0 and 2"), "{e}");
}

/// Two ranks that give their two shared parts in different orders: each waits in the group the
/// other has not reached, so both end at the groups' timeout (or the second at its peer's
/// refusal, which comes first), with both windows intact. (Which
/// parts a rank has, and where, legitimately differ between ranks: an expert part on the last
/// stage only; so an order is checked only by the groups' meeting.)
#[test]
fn parts_in_different_orders_end_at_the_timeout_with_windows_intact() {
    let timeout = Some(std::time::Duration::from_millis(300));
    let (a, b) = (LocalComm::group(2).unwrap(), LocalComm::group(2).unwrap());
    let world = LocalComm::group(2).unwrap();
    let results: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = world
            .into_iter()
            .zip(a.into_iter().zip(b))
            .enumerate()
            .map(|(rank, (w, (a, b)))| {
                scope.spawn(move || {
                    for c in [&w, &a, &b] {
                        c.set_timeout(timeout).unwrap();
                    }
                    let (x, y) = (
                        fed(AccumulatorConfig::default(), 3),
                        fed(AccumulatorConfig::default(), 3),
                    );
                    let mesh = Mesh::new(Arc::new(w), rank, 2).unwrap();
                    let (px, py) = (Part::new(&x, Some(&a)), Part::new(&y, Some(&b)));
                    let parts = if rank == 0 { [px, py] } else { [py, px] };
                    let start = std::time::Instant::now();
                    let e = mesh.sync(&parts).unwrap_err();
                    (
                        e,
                        start.elapsed(),
                        x.sync(None).unwrap().total_count,
                        y.sync(None).unwrap().total_count,
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // The first to time out refuses its other group, so its peer may learn of it there first.
    assert!(results.iter().any(|r| r.0.kind == ErrorKind::Timeout));
    for (e, took, x, y) in results {
        assert!(matches!(e.kind, ErrorKind::Timeout | ErrorKind::PeerFailure), "{e}");
        assert!(e.message.contains("intact") || e.message.contains("no rank reduced"), "{e}");
        // The bound is the timeout; the slack is for a busy machine.
        assert!(took < std::time::Duration::from_secs(30), "{took:?}");
        assert_eq!((x, y), (3, 3));
    }
}

/// The optimizer over each accumulator's group follows the mesh: on dp 2 x tp 2 with ZeRO-1
/// (each accumulator reduce-scattered over its data group, the optimizer stepping its shard and
/// all-gathering the weights over it), a clipped step moves every weight by the job's clipped
/// gradient (SGD: w - lr * g, against the f64 reference), the same bits on both data replicas;
/// then an inf on one rank makes every optimizer skip, weights unchanged.
#[test]
fn the_optimizer_steps_and_skips_with_the_mesh() {
    use gradacc::{Algorithm, GradMut, Optimizer, OptimizerConfig};
    const N: usize = 10;
    const LR: f32 = 0.5;
    let counts = [[3u64, 5], [2, 4]];
    let value = |d: usize, mb: usize, tp: usize, j: usize| {
        ((d * 7 + mb * 3 + tp * 5 + j) % 9) as f64 / 8.0 - 0.5
    };
    let total: u64 = counts.iter().flatten().sum();
    let reference = |tp: usize, j: usize| {
        (0..2)
            .flat_map(|d| (0..2).map(move |mb| (d, mb)))
            .map(|(d, mb)| value(d, mb, tp, j))
            .sum::<f64>()
            / total as f64
    };
    let norm = (0..2)
        .flat_map(|tp| (0..N).map(move |j| (tp, j)))
        .map(|(tp, j)| reference(tp, j).powi(2))
        .sum::<f64>()
        .sqrt();
    let max_norm = (norm / 2.0) as f32;
    let coef = (max_norm as f64 / (norm + 1e-6)).min(1.0);
    let shape = &MeshShape::new(4, 2, 1, 1, 1, 1).unwrap();
    let data = shape.local_groups(&[Axis::Cp, Axis::Dp]).unwrap();
    let out: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = LocalComm::group(4)
            .unwrap()
            .into_iter()
            .zip(data)
            .enumerate()
            .map(|(rank, (world, data))| {
                scope.spawn(move || {
                    let (d, tp) = (shape.data_rank(rank), shape.coord(rank, Axis::Tp));
                    let config = AccumulatorConfig {
                        loss_reduction: LossReduction::Sum,
                        sharding: Sharding::ReduceScatter { shards: 2, rank: d },
                        ..Default::default()
                    };
                    let acc =
                        Accumulator::new(config, &[TensorDesc { numel: N, dtype: Dtype::F32 }])
                            .unwrap();
                    let scaler =
                        Scaler::new(ScalerConfig { init_scale: SCALE, ..Default::default() })
                            .unwrap();
                    let mut w = vec![1.0f32; N];
                    let sgd = OptimizerConfig {
                        algorithm: Algorithm::sgd(),
                        lr: LR,
                        ..Default::default()
                    };
                    let opt = Optimizer::new(&acc, sgd, &[], &[gradacc::Grad::F32(&w)]).unwrap();
                    let mesh = Mesh::of_shape(Arc::new(world), shape)
                        .unwrap()
                        .max_grad_norm(max_norm)
                        .unwrap();
                    let mut stepped = Vec::new();
                    for poison in [false, true] {
                        for (mb, &count) in counts[d].iter().enumerate() {
                            // The gradient of the scaled loss (eighths times 64: exact).
                            let mut g: Vec<f32> =
                                (0..N).map(|j| value(d, mb, tp, j) as f32 * SCALE).collect();
                            if poison && rank == 3 {
                                g[4] = f32::INFINITY;
                            }
                            acc.add(&scaler, &[gradacc::Grad::F32(&g)][..], count).unwrap();
                        }
                        let info = mesh.sync(&[Part::new(&acc, Some(&data))]).unwrap();
                        assert_eq!(info.info.found_inf, poison);
                        scaler.update_from(&[&acc], true).unwrap();
                        stepped.push(
                            opt.step(&acc, &mut [GradMut::F32(&mut w)], Some(&data)).unwrap(),
                        );
                    }
                    (tp, w, stepped)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (tp, w, stepped)) in out.iter().enumerate() {
        // Stepped on the clean window, skipped on the poisoned one, on every rank.
        assert_eq!(stepped, &[true, false], "rank {rank}");
        for (j, &got) in w.iter().enumerate() {
            let want = 1.0 - LR as f64 * reference(*tp, j) * coef;
            assert!(
                (got as f64 - want).abs() <= 1e-6,
                "rank {rank} weight {j}: {got} against {want}"
            );
        }
        // The data replicas (world ranks r and r + 2) hold the same bits.
        let replica = &out[(rank + 2) % 4].1;
        assert!(w.iter().zip(replica).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {rank}");
    }
}

/// The same meshes over MPI, each rank a process: `mpirun` starts this binary's `over_mpi::rank`
/// test on every rank of a mesh, whose groups are split from MPI_COMM_WORLD by the mesh's
/// shape. Each rank checks its own step against the reference and prints its report; the
/// harness checks that every rank printed the same. Needs the `mpi` feature and Open MPI's
/// `mpirun` (skipped without it):
/// `cargo test --release --features mpi --test mesh over_mpi -- --test-threads 1`.
#[cfg(feature = "mpi")]
mod over_mpi {
    use super::*;
    use common::mesh_model::{check_clean, check_poisoned, groups_of, norm_and_clip, run_rank};
    use common::mpirun;
    use gradacc::{Device, MpiComm};

    /// The case's index, the schedule's seed, and the poisoned world rank or `-`.
    const ENV: &str = "GRADACC_MESH_MPI";
    /// The command that starts the ranks instead of `mpirun`: e.g. tests/simhosts/ctl's, which
    /// spreads them over simulated hosts (tests/simhosts/mesh).
    const LAUNCHER: &str = "GRADACC_MESH_MPIRUN";

    #[test]
    fn every_mesh_over_mpi() {
        if !mpirun::available() {
            return;
        }
        let mut rng = Rng::fresh("every_mesh_over_mpi");
        // Half the meshes clean, half with an inf on a random rank, alternating from a random
        // start.
        let flip = rng.range(0, 1) as usize;
        for (i, case) in MESHES.iter().enumerate() {
            let poison = ((i + flip) % 2 == 1).then(|| rng.range(0, case.world as u64 - 1));
            let seed = rng.next_u64();
            let what = format!("{case:?} seed {seed:#x} poison {poison:?}");
            let reports = launch(case, i, seed, poison, &what);
            assert_eq!(reports.len(), case.world, "{what}: {reports:?}");
            assert!(reports.iter().all(|r| *r == reports[0]), "{what}: {reports:?}");
        }
    }

    /// Runs `case` under `mpirun`; each rank's printed report, in rank order. LAUNCHER, when
    /// set, replaces `mpirun` by a command line and its leading arguments (split at spaces).
    fn launch(case: &Case, i: usize, seed: u64, poison: Option<u64>, what: &str) -> Vec<String> {
        let poison = poison.map_or("-".to_string(), |r| r.to_string());
        let launcher = std::env::var(LAUNCHER).ok();
        let vars = [(ENV, Some(format!("{i} {seed} {poison}")))];
        let text = mpirun::run(case.world, "over_mpi::rank", launcher.as_deref(), &vars, what);
        let mut reports: Vec<(usize, String)> = text
            .lines()
            .filter_map(|l| l.split_once("mesh report ").map(|(_, r)| r))
            .map(|l| {
                let (rank, report) = l.split_once(' ').unwrap();
                (rank.parse().unwrap(), report.to_string())
            })
            .collect();
        reports.sort();
        reports.into_iter().map(|(_, r)| r).collect()
    }

    /// One rank of a mesh under `mpirun` (does nothing when run by the harness itself).
    #[test]
    fn rank() {
        let Ok(args) = std::env::var(ENV) else { return };
        let args: Vec<&str> = args.split(' ').collect();
        let case = &MESHES[args[0].parse::<usize>().unwrap()];
        let seed: u64 = args[1].parse().unwrap();
        let poison = args[2].parse::<usize>().ok();
        let shape = case.shape();
        let world = MpiComm::world().unwrap();
        let rank = world.rank();
        // Every rank makes every kind of group (a split is collective over the world), and its
        // parts keep the ones they reduce over.
        let kinds: [&[Axis]; 3] =
            [&[Axis::Cp, Axis::Dp], &[Axis::Edp], &[Axis::Cp, Axis::Dp, Axis::Pp]];
        let split: Vec<Arc<dyn Communicator>> =
            kinds.iter().map(|axes| shape.split(&world, axes).unwrap()).collect();
        let comms =
            groups_of(case, &shape, rank).iter().map(|(kind, _)| split[*kind].clone()).collect();
        let s = schedule(&mut Rng::seeded(seed), case, poison.map(|r| (r, 0)));
        let reference = reference(case, &s);
        let max_norm = if poison.is_some() { 0.0 } else { norm_and_clip(&reference).1 };
        let o = run_rank(case, &s, &shape, rank, Arc::new(world), (Device::Cpu, comms), max_norm);
        let what = format!("{case:?} seed {seed:#x} rank {rank}");
        match poison {
            None => check_clean(case, &s, &reference, &o, &what),
            Some(r) => check_poisoned(&o, r, true, &what),
        }
        let coef_bits = o.info.info.clip_coef.to_bits();
        // On a line of its own: the test harness's own output may not have ended one.
        println!("\nmesh report {rank} {:?} clip bits {coef_bits:#x}", o.info);
    }
}
