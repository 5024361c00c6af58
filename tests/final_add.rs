//! `add_final`, the window's last micro-batch measured as it is added: every report, per-tensor
//! stat, reduced gradient and stepped weight is bitwise what `add` gives, whatever follows the
//! declaration (more adds, tensor-by-tensor micro-batches, a drop, an overflow, a write through
//! the master's address), under every policy that holds the master whole or in one shard, and
//! between ranks.

mod common;

use common::{encode, grad_of, random_tensors, Rng};
use std::sync::Arc;

use gradacc::{
    Accumulator, AccumulatorConfig, Algorithm, Communicator, Grad, GradMut, LocalComm, Normalize,
    Optimizer, OptimizerConfig, Overflow, Scaler, ScalerConfig, Sharding, SyncInfo, TensorDesc,
};

/// What a micro-batch of a window does.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    /// `add`, or `add_final` where the run declares it (`add` in the reference run).
    Add { last: bool, poisoned: bool },
    /// Tensor by tensor: the tensors of the mask (bit i: tensor i), each with one contribution.
    Tensors { mask: u64 },
    /// A write of one master element through `master_ptr`.
    WritePtr,
}

/// One micro-batch's gradients, in each tensor's dtype (values times the scaler's scale of 1).
struct Batch {
    encoded: Vec<(Vec<f32>, Vec<u16>)>,
}

impl Batch {
    fn random(rng: &mut Rng, tensors: &[TensorDesc], poisoned: bool) -> Batch {
        let magnitude = 10f64.powi(rng.range(0, 4) as i32 - 2);
        let encoded = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut values: Vec<f32> =
                    (0..t.numel).map(|_| (rng.uniform(-1.0, 1.0) * magnitude) as f32).collect();
                if poisoned && i == tensors.len() - 1 {
                    values[rng.range(0, t.numel as u64 - 1) as usize] = f32::INFINITY;
                }
                encode(t.dtype, &values, 1.0)
            })
            .collect();
        Batch { encoded }
    }

    fn grads<'a>(&'a self, tensors: &[TensorDesc]) -> Vec<Grad<'a>> {
        tensors.iter().zip(&self.encoded).map(|(t, (f, h))| grad_of(t.dtype, f, h)).collect()
    }
}

/// Everything a run shows, as bits.
#[derive(Debug, PartialEq)]
struct Seen {
    infos: Vec<String>,
    stats: Vec<String>,
    masters: Vec<Vec<u32>>,
    weights: Vec<Vec<u32>>,
}

fn info_bits(info: &SyncInfo) -> String {
    format!("{info:?} {:#x} {:#x}", info.grad_norm.to_bits(), info.clip_coef.to_bits())
}

fn scaler() -> Scaler {
    Scaler::new(ScalerConfig { init_scale: 1.0, dynamic: false, ..Default::default() }).unwrap()
}

/// Runs the windows of `script` (each micro-batch with its batch), every window synced (with
/// `sync_for_step` when `for_step`) over `comm` and stepped with AdamW; `declare` makes the
/// declared adds `add_final`.
#[allow(clippy::too_many_arguments)]
fn run(
    tensors: &[TensorDesc],
    cfg: AccumulatorConfig,
    script: &[Vec<(Op, Batch)>],
    declare: bool,
    for_step: bool,
    comm: Option<&Arc<dyn Communicator>>,
) -> Seen {
    let mut builder = Accumulator::builder(tensors).config(cfg);
    if let (Sharding::Accumulate { .. }, Some(c)) = (cfg.sharding, comm) {
        builder = builder.communicator(c.clone());
    }
    let acc = builder.build().unwrap();
    let scaler = scaler();
    let mut weights: Vec<Vec<f32>> = tensors.iter().map(|t| vec![0.25; t.numel]).collect();
    let views: Vec<Grad<'_>> = weights.iter().map(|w| Grad::F32(w)).collect();
    let config = OptimizerConfig { algorithm: Algorithm::adamw(), lr: 0.01, ..Default::default() };
    let opt = Optimizer::builder(&acc).config(config).weights(&views).build().unwrap();
    drop(views);
    let mut seen = Seen { infos: vec![], stats: vec![], masters: vec![], weights: vec![] };
    for window in script {
        for (op, batch) in window {
            match *op {
                Op::Add { last, .. } => {
                    let grads = batch.grads(tensors);
                    match last && declare {
                        true => acc.add_final(&scaler, &grads[..], 2).unwrap(),
                        false => acc.add(&scaler, &grads[..], 2).unwrap(),
                    }
                }
                Op::Tensors { mask } => {
                    acc.begin_microbatch(3).unwrap();
                    let grads = batch.grads(tensors);
                    for (i, g) in grads.into_iter().enumerate().filter(|(i, _)| mask >> i & 1 == 1)
                    {
                        acc.add_tensor(&scaler, i, g).unwrap();
                    }
                    acc.end_microbatch().unwrap();
                }
                Op::WritePtr => {
                    let (ptr, _) = acc.master_ptr(0).unwrap();
                    // SAFETY: the master of tensor 0 has at least one element, and nothing
                    // else uses the accumulator meanwhile.
                    unsafe { *ptr += 0.5 };
                }
            }
        }
        let c = comm.map(|c| &**c);
        let info = match for_step {
            true => acc.sync_for_step(c).unwrap(),
            false => acc.sync(c).unwrap(),
        };
        seen.infos.push(info_bits(&info));
        if cfg.tensor_stats {
            seen.stats.push(format!("{:?}", acc.tensor_stats().unwrap()));
        }
        let mut muts: Vec<GradMut<'_>> = weights.iter_mut().map(|w| GradMut::F32(w)).collect();
        opt.step(&acc, &mut muts, c).unwrap();
        let (range, _) = acc.shard();
        seen.masters.push(acc.with_shard(|s| s.iter().map(|v| v.to_bits()).collect()).unwrap());
        assert_eq!(seen.masters.last().unwrap().len(), range.len());
        seen.weights
            .push(weights.iter().flat_map(|w| w.iter().map(|v| v.to_bits())).collect::<Vec<_>>());
    }
    seen
}

/// A configuration the fold serves (clipping, or a plain sum), or one it does not (a divisor
/// without clipping), with stats and the drop policy at random.
fn config(rng: &mut Rng) -> AccumulatorConfig {
    let (normalize, max_grad_norm) = match rng.range(0, 3) {
        0 => (Normalize::None, 0.0),
        1 => (Normalize::ByCount, 0.0),
        _ => (
            [Normalize::ByCount, Normalize::ByMicrobatches, Normalize::None]
                [rng.range(0, 2) as usize],
            1e-3,
        ),
    };
    AccumulatorConfig {
        normalize,
        max_grad_norm,
        threads: rng.range(1, 3) as usize,
        tensor_stats: rng.range(0, 1) == 1,
        overflow: [Overflow::SkipStep, Overflow::DropMicrobatch][rng.range(0, 1) as usize],
        ..Default::default()
    }
}

/// The scripts of one round: a window ending in a declared add, then one of the cases, then a
/// clean declared window.
fn scripts(tensors: &[TensorDesc]) -> Vec<Vec<Vec<Op>>> {
    let add = Op::Add { last: false, poisoned: false };
    let last = Op::Add { last: true, poisoned: false };
    let poisoned = Op::Add { last: true, poisoned: true };
    let all = (1u64 << tensors.len()) - 1;
    let some = all & 0b101;
    let cases = [
        vec![last],
        vec![last, add],
        vec![last, last],
        vec![add, last, add, last],
        vec![Op::Tensors { mask: some }, last],
        vec![last, Op::Tensors { mask: some }],
        vec![last, Op::Tensors { mask: all }],
        vec![add, poisoned],
        vec![last, poisoned],
        vec![poisoned],
        vec![last, Op::WritePtr],
        vec![Op::WritePtr, last],
    ];
    cases.into_iter().map(|case| vec![vec![add, add, last], case, vec![last]]).collect()
}

fn batches(rng: &mut Rng, tensors: &[TensorDesc], script: &[Vec<Op>]) -> Vec<Vec<(Op, Batch)>> {
    script
        .iter()
        .map(|window| {
            window
                .iter()
                .map(|&op| {
                    let poisoned = matches!(op, Op::Add { poisoned: true, .. });
                    (op, Batch::random(rng, tensors, poisoned))
                })
                .collect()
        })
        .collect()
}

/// Tensors of odd sizes and every dtype, sometimes with one long enough for the threads' parts.
fn tensors(rng: &mut Rng) -> Vec<TensorDesc> {
    let mut tensors = random_tensors(rng);
    if rng.range(0, 2) == 0 {
        let dtype = tensors[0].dtype;
        tensors.insert(
            rng.range(0, tensors.len() as u64) as usize,
            TensorDesc { numel: 600_001, dtype },
        );
    }
    tensors
}

#[test]
fn a_declared_last_add_changes_no_bit_of_the_boundary_or_the_step() {
    let mut rng = Rng::fresh("a_declared_last_add_changes_no_bit_of_the_boundary_or_the_step");
    for round in 0..6 {
        let tensors = tensors(&mut rng);
        let mut cfg = config(&mut rng);
        // A group of one: the shard is the whole master, under each policy.
        cfg.sharding = [
            Sharding::None,
            Sharding::ReduceScatter { shards: 1, rank: 0 },
            Sharding::Accumulate { shards: 1, rank: 0 },
        ][round % 3];
        let comm: Option<Arc<dyn Communicator>> =
            (round % 2 == 1).then(|| Arc::new(LocalComm::group(1).unwrap().remove(0)) as _);
        for script in scripts(&tensors) {
            let script = batches(&mut rng, &tensors, &script);
            for for_step in [false, true] {
                let what = format!(
                    "{tensors:?} {cfg:?} {:?} for_step {for_step}",
                    script
                        .iter()
                        .map(|w| w.iter().map(|(op, _)| *op).collect())
                        .collect::<Vec<Vec<_>>>()
                );
                let want = run(&tensors, cfg, &script, false, for_step, comm.as_ref());
                let got = run(&tensors, cfg, &script, true, for_step, comm.as_ref());
                assert!(want == got, "{what}:\nwant {want:?}\ngot {got:?}");
            }
        }
    }
}

/// Between ranks the boundary measures the reduced sum: a declared add changes nothing.
#[test]
fn a_declared_last_add_between_ranks_is_add() {
    let mut rng = Rng::fresh("a_declared_last_add_between_ranks_is_add");
    for sharding in [0, 1, 2] {
        let tensors = tensors(&mut rng);
        let cfg = config(&mut rng);
        let ranks = 2;
        let scripts: Vec<_> =
            (0..ranks).map(|_| batches(&mut rng, &tensors, &scripts(&tensors)[1])).collect();
        let runs = |declare: bool| {
            let comms: Vec<Arc<dyn Communicator>> =
                LocalComm::group(ranks).unwrap().into_iter().map(|c| Arc::new(c) as _).collect();
            std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .iter()
                    .enumerate()
                    .map(|(rank, comm)| {
                        let mut cfg = cfg;
                        cfg.sharding = [
                            Sharding::None,
                            Sharding::ReduceScatter { shards: ranks, rank },
                            Sharding::Accumulate { shards: ranks, rank },
                        ][sharding];
                        let (tensors, script) = (&tensors, &scripts[rank]);
                        s.spawn(move || run(tensors, cfg, script, declare, true, Some(comm)))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
            })
        };
        assert!(runs(false) == runs(true), "{tensors:?} {cfg:?}, sharding {sharding}");
    }
}
