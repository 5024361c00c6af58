//! The mesh conformance model, shared by the CPU and CUDA suites (tests/mesh.rs,
//! tests/cuda_mesh.rs): a synthetic model with a tied, vocabulary-sharded embedding (first and
//! last pipeline stage), a column-sharded weight, a layer norm replicated over tensor-parallel
//! ranks, and experts fed by tokens routed from every data-parallel rank, distributed onto a
//! mesh, with random micro-batch sizes (some empty), dtypes and sharding policies; its float64
//! single-device reference, and the checks every backend's run passes against it. Where the
//! parts live and how their groups are made is a [`Rig`]'s.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use super::{encode, grad_of, Rng};
use gradacc::backend::cuda::driver::{Context, DeviceBuffer};
use gradacc::{
    Accumulator, AccumulatorConfig, Axis, Communicator, Device, Dtype, LocalComm, LossReduction,
    Mesh, MeshInfo, MeshShape, Overflow, OverflowAt, Part, Replicated, Scaler, ScalerConfig,
    Sharding, TensorDesc,
};

pub const SCALE: f32 = 64.0;

/// The model's tensors, over the whole model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// Vocabulary-sharded over tp, used on the first and the last stage.
    Embed,
    /// Column-sharded over tp, on the first stage.
    Col,
    /// Replicated over tp, on the last stage.
    Norm,
    /// Expert `e`, sliced over etp, on the last stage.
    Expert(usize),
}

pub const SLICE: usize = 37; // elements per tp (or etp) slice
pub const NORM: usize = 19;

#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub world: usize,
    pub tp: usize,
    pub pp: usize,
    pub cp: usize,
    pub ep: usize,
    pub etp: usize,
}

impl Case {
    pub fn shape(&self) -> MeshShape {
        MeshShape::new(self.world, self.tp, self.pp, self.cp, self.ep, self.etp).unwrap()
    }
    pub fn experts(&self) -> usize {
        2 * self.ep
    }
}

/// The schedule every rank knows: each data rank's item counts per micro-batch, and a seed.
pub struct Schedule {
    pub counts: Vec<Vec<u64>>,
    pub seed: u64,
    pub dtype: Dtype,
    pub sharding: u8,
    pub poison: Option<(usize, usize)>,
    /// The parts drop a poisoned micro-batch (`Overflow::DropMicrobatch`, each micro-batch
    /// ended by the mesh), and the (data rank, micro-batch) pairs the job then drops.
    pub drop: bool,
    pub dropped: Vec<(usize, usize)>,
}

impl Schedule {
    /// The items of the micro-batches the job keeps.
    pub fn total(&self) -> u64 {
        let mut total = 0;
        for (d, mbs) in self.counts.iter().enumerate() {
            total += (0..mbs.len()).filter(|&mb| self.kept(d, mb)).map(|mb| mbs[mb]).sum::<u64>();
        }
        total
    }

    pub fn kept(&self, d: usize, mb: usize) -> bool {
        !self.dropped.contains(&(d, mb))
    }

    /// Item `i` of micro-batch `mb` at data rank `d`: a global id.
    pub fn item(&self, d: usize, mb: usize, i: u64) -> u64 {
        ((d as u64) << 40) | ((mb as u64) << 20) | i
    }

    pub fn routed(&self, case: &Case, item: u64) -> usize {
        (mix(item ^ self.seed ^ 0xe) % case.experts() as u64) as usize
    }

    /// One item's gradient of element `j` of `kind` through use `u` (the embedding has two).
    pub fn value(&self, kind: Kind, j: usize, item: u64, u: u64) -> f64 {
        let k = match kind {
            Kind::Embed => 1,
            Kind::Col => 2,
            Kind::Norm => 3,
            Kind::Expert(e) => 10 + e as u64,
        };
        let h = mix(self.seed ^ k << 56 ^ (j as u64) << 40 ^ item.wrapping_mul(0x9e37) ^ u << 62);
        (h >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
}

pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A rank's local tensor: its kind, the global elements it holds, and the uses it computes.
#[derive(Clone, Debug)]
pub struct Local {
    pub kind: Kind,
    pub global: std::ops::Range<usize>,
    pub uses: Vec<u64>,
}

/// The rank's parts: dense, experts (last stage), the tied embedding (pp 2, its own group).
pub fn layout(case: &Case, shape: &MeshShape, rank: usize) -> Vec<Vec<Local>> {
    let (tp, pp) = (shape.coord(rank, Axis::Tp), shape.coord(rank, Axis::Pp));
    let last = case.pp - 1;
    let sliced = |t: usize| t * SLICE..(t + 1) * SLICE;
    let embed_uses: Vec<u64> =
        [(0, 1), (last, 2)].iter().filter(|(s, _)| *s == pp).map(|p| p.1).collect();
    let mut dense = Vec::new();
    if case.pp == 1 {
        dense.push(Local { kind: Kind::Embed, global: sliced(tp), uses: embed_uses.clone() });
    }
    if pp == 0 {
        dense.push(Local { kind: Kind::Col, global: sliced(tp), uses: vec![0] });
    }
    if pp == last {
        dense.push(Local { kind: Kind::Norm, global: 0..NORM, uses: vec![0] });
    }
    let mut parts = vec![dense];
    if pp == last {
        let (ep, etp) = (shape.coord(rank, Axis::Ep), shape.coord(rank, Axis::Etp));
        let per = case.experts() / case.ep;
        parts.push(
            (ep * per..(ep + 1) * per)
                .map(|e| Local { kind: Kind::Expert(e), global: sliced(etp), uses: vec![0] })
                .collect(),
        );
    }
    if case.pp > 1 {
        parts.push(vec![Local { kind: Kind::Embed, global: sliced(tp), uses: embed_uses }]);
    }
    parts
}

/// The f64 reference: every element of every tensor, its gradient and the sum of the absolute
/// values that went into it, each over the global item count.
pub fn reference(case: &Case, s: &Schedule) -> Vec<(Kind, Vec<(f64, f64)>)> {
    let n = s.total() as f64;
    let mut kinds =
        vec![(Kind::Embed, case.tp * SLICE), (Kind::Col, case.tp * SLICE), (Kind::Norm, NORM)];
    kinds.extend((0..case.experts()).map(|e| (Kind::Expert(e), case.etp * SLICE)));
    kinds
        .into_iter()
        .map(|(kind, numel)| {
            let uses: &[u64] = if kind == Kind::Embed { &[1, 2] } else { &[0] };
            let values = (0..numel)
                .map(|j| {
                    let (mut sum, mut abs) = (0.0, 0.0);
                    for (d, mbs) in s.counts.iter().enumerate() {
                        for (mb, &count) in mbs.iter().enumerate() {
                            let count = if s.kept(d, mb) { count } else { 0 };
                            for i in 0..count {
                                let item = s.item(d, mb, i);
                                if let Kind::Expert(e) = kind {
                                    if s.routed(case, item) != e {
                                        continue;
                                    }
                                }
                                for &u in uses {
                                    let v = s.value(kind, j, item, u);
                                    sum += v;
                                    abs += v.abs();
                                }
                            }
                        }
                    }
                    (sum / n, abs / n)
                })
                .collect();
            (kind, values)
        })
        .collect()
}

pub fn tensors(locals: &[Local], dtype: Dtype) -> Vec<TensorDesc> {
    locals.iter().map(|l| TensorDesc { numel: l.global.len(), dtype }).collect()
}

/// Which routed tokens a rank's experts process: a token from data rank `d` reaches the ranks
/// of the expert model-parallel groups (expert-tensor x expert peers) that hold data rank `d`;
/// where several such ranks hold the same expert slice (tensor-parallel peers beyond the
/// expert-tensor ones), they split the tokens by index. Each token meets each expert slice once.
pub struct ExpertTokens {
    /// Per source data rank: this rank's position among the candidates, and their number.
    at: Vec<Option<(u64, u64)>>,
}

impl ExpertTokens {
    pub fn new(case: &Case, shape: &MeshShape, rank: usize) -> Self {
        let stage = shape.coord(rank, Axis::Pp);
        let key = |r: usize| {
            (shape.coord(r, Axis::Ep), shape.coord(r, Axis::Etp), shape.coord(r, Axis::Pp))
        };
        let covers = |r: usize, d: usize| {
            shape
                .members(r, &[Axis::Etp, Axis::Ep])
                .unwrap()
                .iter()
                .any(|&m| shape.data_rank(m) == d)
        };
        let at = (0..shape.data_size())
            .map(|d| {
                let candidates: Vec<usize> = (0..case.world)
                    .filter(|&r| {
                        shape.coord(r, Axis::Pp) == stage && key(r) == key(rank) && covers(r, d)
                    })
                    .collect();
                let pos = candidates.iter().position(|&r| r == rank)?;
                Some((pos as u64, candidates.len() as u64))
            })
            .collect();
        ExpertTokens { at }
    }

    pub fn processes(&self, d: usize, item: u64) -> bool {
        self.at[d].is_some_and(|(pos, n)| item % n == pos)
    }
}

/// What one rank reports: its step's info, each part's held gradient as (kind, global element,
/// value), and its scale after the update.
pub struct Outcome {
    pub info: MeshInfo,
    pub held: Vec<(Kind, usize, f32)>,
    pub scale: f32,
}

pub fn config(s: &Schedule, comm: &dyn Communicator, stats: bool) -> AccumulatorConfig {
    let (shards, rank) = (comm.world_size(), comm.rank());
    let sharding = match (s.sharding, shards) {
        (_, 1) | (0, _) => Sharding::None,
        (1, _) => Sharding::ReduceScatter { shards, rank },
        _ => Sharding::Accumulate { shards, rank },
    };
    AccumulatorConfig {
        loss_reduction: LossReduction::Sum,
        sharding,
        tensor_stats: stats,
        bucket_numel: 50,
        overflow: if s.drop { Overflow::DropMicrobatch } else { Overflow::SkipStep },
        ..Default::default()
    }
}

/// A group of a part: its kind (0 data, 1 expert data, 2 embedding: two kinds may have the same
/// members) and its members' world ranks, in group rank order.
pub type Group = (usize, Vec<usize>);

/// Where a rank's parts live and how its groups are made.
pub trait Rig: Sync {
    /// The device of rank `rank`'s parts and one communicator per group in `groups`, made on the
    /// rank's own thread.
    fn rank(&self, rank: usize, groups: &[Group]) -> (Device, Vec<Arc<dyn Communicator>>);
}

/// The CPU with in-process groups.
pub struct Host {
    comms: Mutex<BTreeMap<(Group, usize), LocalComm>>,
}

impl Host {
    /// Every group of `groups` (each listed by each of its members).
    pub fn new(groups: &[Group]) -> Host {
        let mut comms = BTreeMap::new();
        for g in groups {
            if comms.contains_key(&(g.clone(), 0)) {
                continue;
            }
            for (i, c) in LocalComm::group(g.1.len()).unwrap().into_iter().enumerate() {
                comms.insert((g.clone(), i), c);
            }
        }
        Host { comms: Mutex::new(comms) }
    }
}

impl Rig for Host {
    fn rank(&self, rank: usize, groups: &[Group]) -> (Device, Vec<Arc<dyn Communicator>>) {
        let mut comms = self.comms.lock().unwrap();
        let mine = groups
            .iter()
            .map(|g| {
                let at = g.1.iter().position(|&r| r == rank).unwrap();
                Arc::new(comms.remove(&(g.clone(), at)).unwrap()) as Arc<dyn Communicator>
            })
            .collect();
        (Device::Cpu, mine)
    }
}

/// Rank `rank`'s groups, one per part: data (dense), expert data (last stage), embedding (pp 2).
pub fn groups_of(case: &Case, shape: &MeshShape, rank: usize) -> Vec<Group> {
    let mut groups = vec![(0, shape.members(rank, &[Axis::Cp, Axis::Dp]).unwrap())];
    if shape.coord(rank, Axis::Pp) == case.pp - 1 {
        groups.push((1, shape.members(rank, &[Axis::Edp]).unwrap()));
    }
    if case.pp > 1 {
        groups.push((2, shape.members(rank, &[Axis::Cp, Axis::Dp, Axis::Pp]).unwrap()));
    }
    groups
}

/// A gradient where a part's device reads it: the host's view, or a device copy.
enum Upload {
    Host(Vec<(Vec<f32>, Vec<u16>)>),
    Device(Vec<DeviceBuffer>),
}

fn upload(device: Device, dtype: Dtype, grads: Vec<(Vec<f32>, Vec<u16>)>) -> Upload {
    let Device::Cuda { ordinal, stream } = device else { return Upload::Host(grads) };
    let ctx = Context::get(ordinal).unwrap();
    let stream = stream.cast();
    Upload::Device(
        grads
            .iter()
            .map(|(f, h)| match dtype {
                Dtype::F32 => DeviceBuffer::from_slice(&ctx, stream, f).unwrap(),
                _ => DeviceBuffer::from_slice(&ctx, stream, h).unwrap(),
            })
            .collect(),
    )
}

/// One rank's step: each part fed its micro-batches, then the mesh step and the scaler update.
pub fn run_rank(
    case: &Case,
    s: &Schedule,
    shape: &MeshShape,
    rank: usize,
    world: Arc<dyn Communicator>,
    (device, comms): (Device, Vec<Arc<dyn Communicator>>),
    max_norm: f32,
) -> Outcome {
    let parts_layout = layout(case, shape, rank);
    let accs: Vec<Accumulator> = parts_layout
        .iter()
        .zip(&comms)
        .map(|(locals, comm)| {
            let stats = locals.iter().any(|l| l.kind == Kind::Norm);
            let config = config(s, &**comm, stats);
            let descs = tensors(locals, s.dtype);
            let b = Accumulator::builder(&descs).device(device).config(config);
            let b = match config.sharding {
                Sharding::Accumulate { .. } => b.communicator(comm.clone()),
                _ => b,
            };
            b.build().unwrap()
        })
        .collect();
    let scaler =
        Scaler::on(device, ScalerConfig { init_scale: SCALE, ..Default::default() }).unwrap();
    let d = shape.data_rank(rank);
    let experts = ExpertTokens::new(case, shape, rank);
    let mesh = Mesh::of_shape(world, shape).unwrap().max_grad_norm(max_norm).unwrap();
    let refs: Vec<&Accumulator> = accs.iter().collect();
    // Every upload lives until the step is read.
    let mut uploads = Vec::new();
    for (mb, &count) in s.counts[d].iter().enumerate() {
        for (locals, acc) in parts_layout.iter().zip(&accs) {
            let grads: Vec<(Vec<f32>, Vec<u16>)> = locals
                .iter()
                .map(|l| {
                    let mut values: Vec<f32> = l
                        .global
                        .clone()
                        .map(|j| {
                            let mut sum = 0.0f64;
                            for src in 0..s.counts.len() {
                                for i in 0..s.counts[src][mb] {
                                    let item = s.item(src, mb, i);
                                    let mine = match l.kind {
                                        Kind::Expert(e) => {
                                            s.routed(case, item) == e && experts.processes(src, i)
                                        }
                                        _ => src == d,
                                    };
                                    if mine {
                                        sum += l
                                            .uses
                                            .iter()
                                            .map(|&u| s.value(l.kind, j, item, u))
                                            .sum::<f64>();
                                    }
                                }
                            }
                            sum as f32
                        })
                        .collect();
                    if s.poison == Some((rank, mb)) && l.kind != Kind::Norm {
                        values[0] = f32::INFINITY;
                    }
                    encode(s.dtype, &values, SCALE)
                })
                .collect();
            // Dropping, a micro-batch is fed tensor by tensor and ended by the mesh.
            if s.drop {
                acc.begin_microbatch(count).unwrap();
            }
            match upload(device, s.dtype, grads) {
                Upload::Host(grads) => {
                    let views: Vec<_> = grads.iter().map(|(f, h)| grad_of(s.dtype, f, h)).collect();
                    match s.drop {
                        true => {
                            views.iter().enumerate().for_each(|(i, g)| {
                                acc.add_tensor(&scaler, i, *g).unwrap();
                            });
                        }
                        false => acc.add(&scaler, &views[..], count).unwrap(),
                    }
                }
                Upload::Device(bufs) => {
                    let addresses: Vec<u64> = bufs.iter().map(DeviceBuffer::ptr).collect();
                    match s.drop {
                        true => {
                            addresses.iter().enumerate().for_each(|(i, &g)| {
                                acc.add_tensor(&scaler, i, g).unwrap();
                            });
                        }
                        false => acc.add(&scaler, &addresses[..], count).unwrap(),
                    }
                    uploads.push(bufs);
                }
            }
        }
        if s.drop {
            let kept = mesh.end_microbatch(&refs).unwrap();
            assert_eq!(kept, s.kept(d, mb), "rank {rank} micro-batch {mb}");
        }
    }
    let replicated: Vec<Vec<Replicated>> = parts_layout
        .iter()
        .map(|locals| {
            locals
                .iter()
                .enumerate()
                .filter(|(_, l)| l.kind == Kind::Norm)
                .map(|(tensor, _)| Replicated { tensor, key: 0x4e04, copies: case.tp })
                .collect()
        })
        .collect();
    let parts: Vec<Part<'_>> = accs
        .iter()
        .zip(&comms)
        .zip(&replicated)
        .map(|((acc, comm), replicated)| {
            let bound = matches!(acc.config().sharding, Sharding::Accumulate { .. });
            Part { replicated, ..Part::new(acc, (!bound).then_some(&**comm)) }
        })
        .collect();
    let info = mesh.sync(&parts).unwrap();
    let skipped = scaler.update_from(&refs, true).unwrap().unwrap();
    assert_eq!(skipped, info.info.found_inf);
    let mut held = Vec::new();
    for (locals, acc) in parts_layout.iter().zip(&accs) {
        let (range, _) = acc.shard();
        acc.with_shard(|shard| {
            for (t, l) in locals.iter().enumerate() {
                let start = acc.offset(t).unwrap();
                for (k, j) in l.global.clone().enumerate() {
                    let at = start + k;
                    if range.contains(&at) {
                        held.push((l.kind, j, shard[at - range.start]));
                    }
                }
            }
        })
        .unwrap();
    }
    Outcome { info, held, scale: scaler.scale().unwrap() }
}

/// Runs `case` on every rank of its mesh, in threads, the parts where `rig` puts them (made from
/// every rank's groups, in rank order).
pub fn run<R: Rig>(
    case: &Case,
    s: &Schedule,
    max_norm: f32,
    rig: impl FnOnce(&[Group]) -> R,
) -> Vec<Outcome> {
    let shape = case.shape();
    let groups: Vec<Vec<Group>> = (0..case.world).map(|r| groups_of(case, &shape, r)).collect();
    let rig = rig(&groups.concat());
    std::thread::scope(|scope| {
        let handles: Vec<_> = LocalComm::group(case.world)
            .unwrap()
            .into_iter()
            .zip(&groups)
            .enumerate()
            .map(|(rank, (world, groups))| {
                let (shape, rig) = (&shape, &rig);
                scope.spawn(move || {
                    let parts = rig.rank(rank, groups);
                    run_rank(case, s, shape, rank, Arc::new(world), parts, max_norm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

pub fn schedule(rng: &mut Rng, case: &Case, poison: Option<(usize, usize)>) -> Schedule {
    let data = case.shape().data_size();
    let microbatches = rng.range(1, 3) as usize;
    let mut counts: Vec<Vec<u64>> =
        (0..data).map(|_| (0..microbatches).map(|_| rng.range(0, 4)).collect()).collect();
    counts[0][0] = counts[0][0].max(1);
    let dtype = [Dtype::F32, Dtype::F16, Dtype::Bf16][rng.range(0, 2) as usize];
    let sharding = rng.range(0, 2) as u8;
    Schedule { counts, seed: rng.next_u64(), dtype, sharding, poison, drop: false, dropped: vec![] }
}

/// The data ranks whose micro-batch is dropped when world rank `rank` poisons it: its own, and,
/// until nothing changes, every data rank whose tokens reach the experts of a rank at a dropped
/// one (their expert gradients hold the micro-batch's tokens of every data rank they process).
pub fn dropped_data_ranks(case: &Case, shape: &MeshShape, rank: usize) -> Vec<usize> {
    let touched: Vec<Vec<usize>> = (0..case.world)
        .map(|r| {
            let experts = ExpertTokens::new(case, shape, r);
            let has_experts =
                layout(case, shape, r).iter().flatten().any(|l| matches!(l.kind, Kind::Expert(_)));
            (0..shape.data_size())
                .filter(|&d| d == shape.data_rank(r) || has_experts && experts.at[d].is_some())
                .collect()
        })
        .collect();
    let mut dropped = vec![shape.data_rank(rank)];
    loop {
        let more: Vec<usize> = touched
            .iter()
            .filter(|t| t.iter().any(|d| dropped.contains(d)))
            .flatten()
            .filter(|d| !dropped.contains(d))
            .copied()
            .collect();
        if more.is_empty() {
            dropped.sort_unstable();
            return dropped;
        }
        dropped.extend(more);
        dropped.dedup();
    }
}

/// Half an ulp of `dtype`, relative.
pub fn unit(dtype: Dtype) -> f64 {
    match dtype {
        Dtype::F32 => 2f64.powi(-24),
        Dtype::F16 => 2f64.powi(-11),
        Dtype::Bf16 => 2f64.powi(-8),
    }
}

pub const MESHES: [Case; 8] = [
    Case { world: 4, tp: 2, pp: 1, cp: 1, ep: 1, etp: 1 }, // dp 2 x tp 2
    Case { world: 4, tp: 1, pp: 2, cp: 1, ep: 1, etp: 1 }, // dp 2 x pp 2
    Case { world: 4, tp: 1, pp: 1, cp: 1, ep: 2, etp: 1 }, // dp 4, ep 2
    Case { world: 8, tp: 2, pp: 2, cp: 1, ep: 1, etp: 1 }, // dp 2 x tp 2 x pp 2
    Case { world: 4, tp: 1, pp: 1, cp: 2, ep: 1, etp: 1 }, // cp 2 x dp 2
    Case { world: 4, tp: 2, pp: 1, cp: 1, ep: 1, etp: 2 }, // expert-tp 2
    Case { world: 4, tp: 2, pp: 1, cp: 1, ep: 2, etp: 1 }, // dp 2 x tp 2, ep 2 (EP x TP)
    Case { world: 8, tp: 2, pp: 2, cp: 1, ep: 2, etp: 1 }, // dp 2 x tp 2 x pp 2, ep 2
];

/// The reference's norm, and a clipping norm of half of it (so the coefficient is applied too).
pub fn norm_and_clip(reference: &[(Kind, Vec<(f64, f64)>)]) -> (f64, f32) {
    let norm = reference.iter().flat_map(|(_, v)| v).map(|(g, _)| g * g).sum::<f64>().sqrt();
    (norm, (norm / 2.0) as f32)
}

/// One rank's clean step of `case` against the reference: the job's total, the f64 norm, a clip,
/// and every gradient the rank holds, clipped.
pub fn check_clean(
    case: &Case,
    s: &Schedule,
    reference: &[(Kind, Vec<(f64, f64)>)],
    o: &Outcome,
    what: &str,
) {
    let (norm, _) = norm_and_clip(reference);
    let info = &o.info.info;
    assert!(!info.found_inf, "{what}");
    assert_eq!(info.total_count, s.total(), "{what}");
    let rel = (info.grad_norm - norm).abs() / norm;
    assert!(rel <= 2.0 * unit(s.dtype) + 1e-6, "{what}: norm {} against {norm}", info.grad_norm);
    let coef = info.clip_coef;
    assert!(coef < 1.0, "{what}");
    for &(kind, j, got) in &o.held {
        let (g, abs) = reference.iter().find(|(k, _)| *k == kind).unwrap().1[j];
        let micro = s.counts[0].len() as f64 * case.world as f64;
        let tol = abs * coef * (unit(s.dtype) + (micro + 4.0) * 2f64.powi(-23)) + 1e-30;
        assert!(
            (got as f64 - g * coef).abs() <= tol,
            "{what}: {kind:?}[{j}] = {got}, reference {} (tol {tol})",
            g * coef
        );
    }
}

/// One rank's step of a schedule with an inf on world rank `rank`: skipped, its scaler backed
/// off, and that rank named (where the parts can `located` it).
pub fn check_poisoned(o: &Outcome, rank: usize, located: bool, what: &str) {
    assert!(o.info.info.found_inf, "{what}");
    // One scaler per rank, and the same state on each.
    assert_eq!(o.scale, SCALE / 2.0, "{what}");
    match o.info.info.overflow {
        Some(OverflowAt::Gradient { rank: r, microbatch: 0, tensor: _ }) => {
            assert_eq!(r, rank, "{what}")
        }
        // A device under SKIP_STEP keeps its flag on the device: no place to report.
        None if !located => {}
        other => panic!("{what}: {other:?}"),
    }
}

/// `case` run where `rig` puts it matches the f64 reference: the norm, the clip coefficient (the
/// same bits on every rank), every held element; every element is held somewhere.
pub fn matches_the_reference<R: Rig>(rng: &mut Rng, case: &Case, rig: impl FnOnce(&[Group]) -> R) {
    let s = schedule(rng, case, None);
    let reference = reference(case, &s);
    let out = run(case, &s, norm_and_clip(&reference).1, rig);
    let what = format!("{case:?} {:?} sharding {} counts {:?}", s.dtype, s.sharding, s.counts);
    for o in &out {
        check_clean(case, &s, &reference, o, &what);
        // Bitwise the same report on every rank, the clip coefficient included.
        let (mine, first) = (o.info.info.clip_coef, out[0].info.info.clip_coef);
        assert_eq!(mine.to_bits(), first.to_bits(), "{what}");
        assert_eq!(o.info, out[0].info, "{what}");
    }
    // Every element of the model is held somewhere.
    let held: std::collections::HashSet<(String, usize)> =
        out.iter().flat_map(|o| o.held.iter().map(|(k, j, _)| (format!("{k:?}"), *j))).collect();
    let all: usize = reference.iter().map(|(_, v)| v.len()).sum();
    assert_eq!(held.len(), all, "{what}");
}

/// An inf on one rank of `case`, where `rig` puts it, skips the step on every rank and backs
/// every scaler off alike; the report names the rank (where the parts can `located` it).
pub fn one_inf_skips_everywhere<R: Rig>(
    rng: &mut Rng,
    case: &Case,
    located: bool,
    rig: impl FnOnce(&[Group]) -> R,
) {
    let rank = rng.range(0, case.world as u64 - 1) as usize;
    let s = schedule(rng, case, Some((rank, 0)));
    let out = run(case, &s, 0.0, rig);
    let what = format!("{case:?} rank {rank}");
    for o in &out {
        check_poisoned(o, rank, located, &what);
        assert_eq!(o.info, out[0].info, "{what}");
    }
}

/// An inf in one micro-batch on one random rank of `case` under DROP_MICROBATCH, where `rig`
/// puts it: every rank that computed from that micro-batch's data drops it, and the step goes
/// ahead. Every rank's gradient matches the f64 reference without those micro-batches (the
/// norm, the clip, every held element, the surviving items), the drops are counted once per data
/// rank, the poisoned rank is named, every scaler backs off alike, and the report is the same
/// on every rank.
pub fn a_poisoned_microbatch_drops_on_its_peers<R: Rig>(
    rng: &mut Rng,
    case: &Case,
    rig: impl FnOnce(&[Group]) -> R,
) {
    let shape = case.shape();
    let rank = rng.range(0, case.world as u64 - 1) as usize;
    let mut s = schedule(rng, case, None);
    // Sharded accumulation drops over its own group: here the parts reduce at the boundary.
    s.sharding = rng.range(0, 1) as u8;
    if s.counts[0].len() < 2 {
        s.counts.iter_mut().for_each(|mbs| mbs.push(rng.range(0, 4)));
    }
    let microbatches = s.counts[0].len();
    let mb = rng.range(0, microbatches as u64 - 1) as usize;
    // Something survives on data rank 0.
    s.counts[0][(mb + 1) % microbatches] = s.counts[0][(mb + 1) % microbatches].max(1);
    s.poison = Some((rank, mb));
    s.drop = true;
    s.dropped = dropped_data_ranks(case, &shape, rank).into_iter().map(|d| (d, mb)).collect();
    let reference = reference(case, &s);
    let out = run(case, &s, norm_and_clip(&reference).1, rig);
    let what = format!(
        "{case:?} {:?} sharding {} counts {:?} poisoned rank {rank} micro-batch {mb}, dropped {:?}",
        s.dtype, s.sharding, s.counts, s.dropped
    );
    for o in &out {
        check_clean(case, &s, &reference, o, &what);
        let info = &o.info.info;
        assert_eq!(info.dropped_microbatches, s.dropped.len() as u64, "{what}");
        assert_eq!(info.microbatches, (microbatches * s.counts.len() - s.dropped.len()) as u64);
        match info.overflow {
            Some(OverflowAt::Gradient { rank: r, microbatch, .. }) => {
                assert_eq!((r, microbatch), (rank, mb as u64), "{what}")
            }
            other => panic!("{what}: {other:?}"),
        }
        // A drop backs the scale off, though the step is taken.
        assert_eq!(o.scale, SCALE / 2.0, "{what}");
        assert_eq!(o.info, out[0].info, "{what}");
    }
}
