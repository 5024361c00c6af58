//! The mesh step with CUDA parts: the conformance model of tests/mesh.rs (its float64 reference,
//! tests/common/mesh_model.rs) with every rank's accumulators and scaler on its own device and
//! every group an NCCL communicator, the world a host one. Every rank's gradient matches the
//! reference within the CPU runs' bound, the report is the same bits everywhere, an inf on one
//! rank skips the step and backs every device scaler off alike, and bad input on one rank fails
//! every rank with the windows intact, and a part refused on one rank fails its NCCL peers at
//! once. Groups split from one NCCL communicator of the world
//! (ncclCommSplit, colored as by `MeshShape::color`) run the same model.
//!
//! Skips without a GPU and NCCL; GRADACC_REQUIRE_GPU=1 makes that a failure. On the software GPU
//! the meshes run in a child process with a device per rank.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use common::cuda::nccl_devices;
use common::mesh_model::{
    a_poisoned_microbatch_drops_on_its_peers, matches_the_reference, one_inf_skips_everywhere,
    Group, Rig, MESHES,
};
use common::Rng;
use gradacc::backend::cuda::driver::{Context, DeviceBuffer, OwnedStream};
use gradacc::backend::cuda::nccl::{self, NcclComm};
use gradacc::{
    Accumulator, AccumulatorConfig, Communicator, Device, Dtype, ErrorKind, LocalComm, Mesh,
    MeshShape, Part, Scaler, ScalerConfig, TensorDesc,
};

/// Long enough for a loaded machine; a hang fails instead of waiting forever.
const TIMEOUT: Duration = Duration::from_secs(60);

/// Rank r on device r, with a stream of its own that outlives its accumulators (the test's
/// process ends soon after), every group an NCCL communicator.
struct Nccl {
    ids: BTreeMap<Group, [u8; nccl::UNIQUE_ID_BYTES]>,
}

impl Nccl {
    fn new(groups: &[Group]) -> Nccl {
        let mut ids = BTreeMap::new();
        for g in groups {
            ids.entry(g.clone()).or_insert_with(|| nccl::unique_id().unwrap());
        }
        Nccl { ids }
    }
}

/// Rank `rank`'s device: its context and a stream of its own, kept for the process.
fn rank_device(rank: usize) -> (Arc<Context>, Device) {
    let ctx = Context::get(rank as i32).unwrap();
    let stream = Box::leak(Box::new(OwnedStream::new(&ctx).unwrap()));
    (ctx, Device::Cuda { ordinal: rank as i32, stream: stream.stream.cast() })
}

fn nccl_comm(id: &[u8; nccl::UNIQUE_ID_BYTES], at: usize, size: usize, ordinal: usize) -> NcclComm {
    let comm = NcclComm::new(id, at, size, ordinal as i32).unwrap();
    Communicator::set_timeout(&comm, Some(TIMEOUT)).unwrap();
    comm
}

impl Rig for Nccl {
    fn rank(&self, rank: usize, groups: &[Group]) -> (Device, Vec<Arc<dyn Communicator>>) {
        let (_, device) = rank_device(rank);
        let comms = groups
            .iter()
            .map(|g| {
                let at = g.1.iter().position(|&r| r == rank).unwrap();
                Arc::new(nccl_comm(&self.ids[g], at, g.1.len(), rank)) as Arc<dyn Communicator>
            })
            .collect();
        (device, comms)
    }
}

/// Every group split from one NCCL communicator of the world (ncclCommSplit), as a framework
/// makes its mesh groups: each kind of group in turn, colored by the group's first member
/// (`MeshShape::color`), keyed by the rank's place in it; a rank without a group of that kind
/// takes part with no color.
struct Split {
    id: [u8; nccl::UNIQUE_ID_BYTES],
    world: usize,
    kinds: BTreeSet<usize>,
}

impl Split {
    fn new(groups: &[Group]) -> Split {
        let world = groups.iter().flat_map(|g| &g.1).max().unwrap() + 1;
        let kinds = groups.iter().map(|g| g.0).collect();
        Split { id: nccl::unique_id().unwrap(), world, kinds }
    }
}

impl Rig for Split {
    fn rank(&self, rank: usize, groups: &[Group]) -> (Device, Vec<Arc<dyn Communicator>>) {
        let (_, device) = rank_device(rank);
        let world = nccl_comm(&self.id, rank, self.world, rank);
        let comms = self
            .kinds
            .iter()
            .filter_map(|&kind| {
                let mine = groups.iter().find(|g| g.0 == kind);
                let color = mine.map(|g| g.1[0]);
                let key = mine.map_or(0, |g| g.1.iter().position(|&r| r == rank).unwrap());
                let comm = world.split(color, key).unwrap()?;
                let g = mine.unwrap();
                assert_eq!(
                    (comm.rank(), comm.world_size()),
                    (key, g.1.len()),
                    "rank {rank}: {g:?}"
                );
                Some(Arc::new(comm) as Arc<dyn Communicator>)
            })
            .collect();
        (device, comms)
    }
}

/// `f(test)` where there is a device per rank of the largest mesh.
fn on_devices(test: &str, f: impl FnOnce(&str)) {
    let count = nccl_devices();
    let devices = MESHES.iter().map(|c| c.world).max().unwrap() as i32;
    common::cuda::at_devices(devices, count, test, f);
}

#[test]
fn every_mesh_of_cuda_parts_matches_the_f64_reference() {
    on_devices("every_mesh_of_cuda_parts_matches_the_f64_reference", |test| {
        let mut rng = Rng::fresh(test);
        for case in &MESHES {
            matches_the_reference(&mut rng, case, Nccl::new);
        }
    });
}

#[test]
fn groups_split_from_an_nccl_world_run_the_mesh() {
    on_devices("groups_split_from_an_nccl_world_run_the_mesh", |test| {
        let mut rng = Rng::fresh(test);
        for case in &MESHES {
            matches_the_reference(&mut rng, case, Split::new);
        }
    });
}

/// `MeshShape::split` of an NCCL world (the `Communicator::split` every transport answers, and
/// `gradacc_mesh_shape_split`'s path): dp 2 x tp 2 in Megatron-Core's order, each rank's data
/// group and tensor-parallel group of the right ranks and sizes.
#[test]
fn a_shape_splits_an_nccl_world() {
    on_devices("a_shape_splits_an_nccl_world", |_| {
        let shape = MeshShape::new(4, 2, 1, 1, 1, 1).unwrap();
        let id = nccl::unique_id().unwrap();
        std::thread::scope(|scope| {
            for rank in 0..4 {
                let (shape, id) = (&shape, &id);
                scope.spawn(move || {
                    let _device = rank_device(rank);
                    let world = nccl_comm(id, rank, 4, rank);
                    let data =
                        shape.split(&world, &[gradacc::Axis::Cp, gradacc::Axis::Dp]).unwrap();
                    let tp = shape.split(&world, &[gradacc::Axis::Tp]).unwrap();
                    assert_eq!((data.rank(), data.world_size()), (rank / 2, 2), "rank {rank}");
                    assert_eq!((tp.rank(), tp.world_size()), (rank % 2, 2), "rank {rank}");
                    assert!(matches!(data.device(), Device::Cuda { .. }), "rank {rank}");
                });
            }
        });
    });
}

#[test]
fn an_inf_on_one_cuda_rank_skips_the_step_everywhere() {
    on_devices("an_inf_on_one_cuda_rank_skips_the_step_everywhere", |test| {
        let mut rng = Rng::fresh(test);
        for case in &MESHES {
            // The device keeps its window's flag under SKIP_STEP: the place is not reported.
            one_inf_skips_everywhere(&mut rng, case, false, Nccl::new);
        }
    });
}

#[test]
fn a_poisoned_cuda_microbatch_drops_on_every_peer_that_shares_it() {
    on_devices("a_poisoned_cuda_microbatch_drops_on_every_peer_that_shares_it", |test| {
        let mut rng = Rng::fresh(test);
        for case in &MESHES {
            a_poisoned_microbatch_drops_on_its_peers(&mut rng, case, Nccl::new);
        }
    });
}

/// An accumulator of one tensor of 5 elements on `device` (clipping by itself to `max_norm`,
/// 0: off) with one micro-batch of `items`.
fn fed(ctx: &Arc<Context>, device: Device, items: u64, max_norm: f32) -> Accumulator {
    let t = [TensorDesc { numel: 5, dtype: Dtype::F32 }];
    let config = AccumulatorConfig { max_grad_norm: max_norm, ..Default::default() };
    let acc = Accumulator::builder(&t).device(device).config(config).build().unwrap();
    let scaler = Scaler::on(device, ScalerConfig::default()).unwrap();
    let Device::Cuda { stream, .. } = device else { unreachable!() };
    let grad = DeviceBuffer::from_slice(ctx, stream.cast(), &[1.0f32; 5]).unwrap();
    acc.add(&scaler, &[grad.ptr()][..], items).unwrap();
    // The add is read before the buffer goes.
    acc.read_master(0, &mut [0.0; 5]).unwrap();
    acc
}

/// dp 2: both ranks' accumulators over one NCCL group; rank 1 also brings an accumulator alone
/// whose window holds other counts. Rank 1 fails with its own error after its group's control
/// step, rank 0 naming it; nothing was reduced, and a plain sync on the group still sees both
/// windows.
#[test]
fn bad_input_on_one_cuda_rank_fails_every_rank_with_the_windows_intact() {
    let count = nccl_devices();
    let test = "bad_input_on_one_cuda_rank_fails_every_rank_with_the_windows_intact";
    common::cuda::at_devices(2, count, test, |_| {
        let id = nccl::unique_id().unwrap();
        let shape = MeshShape::new(2, 1, 1, 1, 1, 1).unwrap();
        let results: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = LocalComm::group(2)
                .unwrap()
                .into_iter()
                .enumerate()
                .map(|(rank, world)| {
                    let (id, shape) = (&id, &shape);
                    scope.spawn(move || {
                        let (ctx, device) = rank_device(rank);
                        let comm = nccl_comm(id, rank, 2, rank);
                        let acc = fed(&ctx, device, 3 + rank as u64, 0.0);
                        let other = fed(&ctx, device, 9, 0.0);
                        let mesh = Mesh::of_shape(Arc::new(world), shape).unwrap();
                        let mut parts = vec![Part::new(&acc, Some(&comm))];
                        if rank == 1 {
                            parts.push(Part::new(&other, None));
                        }
                        let e = mesh.sync(&parts).unwrap_err();
                        (e, acc.sync(Some(&comm)).unwrap().total_count)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (e0, e1) = (&results[0].0, &results[1].0);
        assert_eq!(e1.kind, ErrorKind::InvalidArgument, "{e1}");
        assert!(e1.message.contains("parts[1]'s window holds 9 items"), "{e1}");
        assert_eq!(e0.kind, ErrorKind::PeerFailure, "{e0}");
        assert!(e0.message.contains("world rank 1"), "{e0}");
        for (rank, (_, count)) in results.iter().enumerate() {
            assert_eq!(*count, 7, "rank {rank}: both windows are intact");
        }
    });
}

/// dp 2 over one NCCL group: rank 1's accumulator clips by itself, so its step is refused before
/// it opens. It still takes part in its group's control step, flagged: on a new group in the
/// layout check, on a checked one (`warm`: after a step that succeeded) in the control words'
/// sum. Rank 0 fails at once, not at the communicator's timeout.
fn refused_on_one_rank(warm: bool) -> Vec<(gradacc::Error, Duration)> {
    let id = nccl::unique_id().unwrap();
    let shape = MeshShape::new(2, 1, 1, 1, 1, 1).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = LocalComm::group(2)
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(rank, world)| {
                let (id, shape) = (&id, &shape);
                scope.spawn(move || {
                    let (ctx, device) = rank_device(rank);
                    let comm = nccl_comm(id, rank, 2, rank);
                    let mesh = Mesh::of_shape(Arc::new(world), shape).unwrap();
                    if warm {
                        let acc = fed(&ctx, device, 3, 0.0);
                        mesh.sync(&[Part::new(&acc, Some(&comm))]).unwrap();
                    }
                    let acc = fed(&ctx, device, 3, rank as f32);
                    let start = std::time::Instant::now();
                    let e = mesh.sync(&[Part::new(&acc, Some(&comm))]).unwrap_err();
                    (e, start.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn a_cuda_part_refused_on_one_rank_fails_every_rank_without_waiting() {
    let count = nccl_devices();
    let test = "a_cuda_part_refused_on_one_rank_fails_every_rank_without_waiting";
    common::cuda::at_devices(2, count, test, |_| {
        for warm in [false, true] {
            let results = refused_on_one_rank(warm);
            let ((e0, t0), (e1, _)) = (&results[0], &results[1]);
            assert_eq!(e1.kind, ErrorKind::InvalidArgument, "warm {warm}: {e1}");
            assert!(e1.message.contains("clips by itself"), "warm {warm}: {e1}");
            assert_eq!(e0.kind, ErrorKind::PeerFailure, "warm {warm}: {e0}");
            assert!(*t0 < TIMEOUT / 4, "warm {warm}: rank 0 waited {t0:?}");
        }
    });
}

/// A part's accumulator on one device and a mesh step's other part on the CPU: one step, one
/// report (the mesh's agreement does not depend on where a part lives).
#[test]
fn a_rank_may_mix_cpu_and_cuda_parts() {
    let count = nccl_devices();
    common::cuda::at_devices(2, count, "a_rank_may_mix_cpu_and_cuda_parts", |_| {
        let id = nccl::unique_id().unwrap();
        let shape = MeshShape::new(2, 1, 1, 1, 1, 1).unwrap();
        let hosts = LocalComm::group(2).unwrap();
        let infos: Vec<_> = std::thread::scope(|scope| {
            let handles: Vec<_> = LocalComm::group(2)
                .unwrap()
                .into_iter()
                .zip(hosts)
                .enumerate()
                .map(|(rank, (world, host))| {
                    let (id, shape) = (&id, &shape);
                    scope.spawn(move || {
                        let (ctx, device) = rank_device(rank);
                        let comm = nccl_comm(id, rank, 2, rank);
                        let gpu = fed(&ctx, device, 2, 0.0);
                        let t = [TensorDesc { numel: 5, dtype: Dtype::F32 }];
                        let cpu = Accumulator::new(AccumulatorConfig::default(), &t).unwrap();
                        let scaler = Scaler::new(ScalerConfig::default()).unwrap();
                        cpu.add(&scaler, &[gradacc::Grad::F32(&[1.0; 5])][..], 2).unwrap();
                        let mesh = Mesh::of_shape(Arc::new(world), shape).unwrap();
                        let parts = [Part::new(&gpu, Some(&comm)), Part::new(&cpu, Some(&host))];
                        let info = mesh.sync(&parts).unwrap();
                        let mut g = [0.0f32; 5];
                        gpu.read_master(0, &mut g).unwrap();
                        let mut c = [0.0f32; 5];
                        cpu.read_master(0, &mut c).unwrap();
                        (info, g, c)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (info, g, c) in &infos {
            assert_eq!(info.info.total_count, 4);
            assert!(!info.info.found_inf);
            // The same gradients, normalised by the job's items: the same bits on both devices.
            assert_eq!(g.map(f32::to_bits), c.map(f32::to_bits), "{g:?} against {c:?}");
            assert!(g[0] > 0.0);
            assert_eq!(info, &infos[0].0);
        }
    });
}
