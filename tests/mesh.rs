//! The mesh step against a float64 single-device reference (tests/common/mesh_model.rs): the
//! synthetic model distributed onto every mesh of at most 8 ranks, in-process on the CPU. Every
//! rank's synced gradient equals the reference's slice within the model's bound, the norm is the
//! f64 global norm, the clip coefficient is the same bits everywhere, and an inf on one rank
//! skips the step on all. The anchors' mistakes are computed beside gradacc's answer; bad input
//! fails on every rank.

mod common;

use std::sync::Arc;

use common::mesh_model::{
    matches_the_reference, one_inf_skips_everywhere, reference, run, schedule, Case, Host, Kind,
    MESHES,
};
use common::Rng;
use gradacc::{
    Accumulator, AccumulatorConfig, Communicator, Dtype, ErrorKind, LocalComm, Mesh, MeshShape,
    Part, Replicated, Scaler, ScalerConfig, TensorDesc,
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
    assert!(errors[1].message.contains("clips by itself"), "{}", errors[1]);
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
