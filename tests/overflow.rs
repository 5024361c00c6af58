//! The overflow policies against an independent f64 reference: random windows on 1 to 4 ranks,
//! every dtype, normalisation and loss reduction, all-reduce and reduce-scatter boundaries and
//! sharded accumulation, whole and tensor-by-tensor (chunked) micro-batches, with non-finite
//! values placed at random (micro-batch, tensor, contribution, element, rank). Under
//! `DropMicrobatch` the gradient is the f64 gradient of exactly the kept micro-batches; under
//! either policy the report names exactly the first non-finite place, and the ranks agree bitwise
//! (fresh seed each run).
//!
//! The random windows and the scaler's rule run on CUDA devices too, one per rank over NCCL (the
//! software GPU in CI), where they also equal the CPU's results bit for bit; they skip without a
//! GPU and NCCL, unless GRADACC_REQUIRE_GPU=1.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use gradacc::backend::cuda::driver::{Context, DeviceBuffer, OwnedStream};
use gradacc::*;

/// Where a group runs: the CPU over the in-process communicator, or a CUDA device per rank over
/// NCCL.
#[derive(Clone, Copy, Debug, PartialEq)]
enum On {
    Cpu,
    Cuda,
}

/// One rank's device: the CPU, or its CUDA device (rank r on device r) with a stream of its own.
enum Dev {
    Cpu,
    Cuda(Arc<Context>, OwnedStream),
}

impl Dev {
    fn of(on: On, rank: usize) -> Dev {
        match on {
            On::Cpu => Dev::Cpu,
            On::Cuda => {
                let ctx = Context::get(rank as i32).unwrap();
                let stream = OwnedStream::new(&ctx).unwrap();
                Dev::Cuda(ctx, stream)
            }
        }
    }

    fn device(&self) -> Device {
        match self {
            Dev::Cpu => Device::Cpu,
            Dev::Cuda(ctx, s) => Device::Cuda { ordinal: ctx.ordinal, stream: s.stream.cast() },
        }
    }

    fn accumulator(&self, config: AccumulatorConfig, tensors: &[TensorDesc]) -> Accumulator {
        Accumulator::builder(tensors).device(self.device()).config(config).build().unwrap()
    }

    /// [`Dev::accumulator`], over `comm` under sharded accumulation.
    fn accumulator_over(
        &self,
        config: AccumulatorConfig,
        tensors: &[TensorDesc],
        comm: &Arc<dyn Communicator>,
    ) -> Accumulator {
        let builder = Accumulator::builder(tensors).device(self.device()).config(config);
        match config.sharding {
            Sharding::Accumulate { .. } => builder.communicator(comm.clone()),
            _ => builder,
        }
        .build()
        .unwrap()
    }

    fn scaler(&self, config: ScalerConfig) -> Scaler {
        Scaler::on(self.device(), config).unwrap()
    }

    /// Runs `f` on the gradients in `buffers` (the f32 values, or the 16-bit bits, of each
    /// tensor's dtype) as this device takes them: host slices, or device copies.
    fn with_grads<R>(
        &self,
        dtypes: &[Dtype],
        buffers: &[&(Vec<f32>, Vec<u16>)],
        f: impl FnOnce(Grads<'_>) -> R,
    ) -> R {
        match self {
            Dev::Cpu => {
                let views: Vec<Grad> =
                    dtypes.iter().zip(buffers).map(|(&d, b)| grad_of(d, &b.0, &b.1)).collect();
                f((&views).into())
            }
            Dev::Cuda(..) => {
                // Freed on the stream after the work that reads them.
                let copies: Vec<DeviceBuffer> =
                    dtypes.iter().zip(buffers).map(|(&d, b)| self.upload(d, b)).collect();
                let addresses: Vec<DevicePtr> = copies.iter().map(DeviceBuffer::ptr).collect();
                f((&addresses).into())
            }
        }
    }

    /// A device copy of a gradient of `dtype` (a CUDA device's).
    fn upload(&self, dtype: Dtype, buffer: &(Vec<f32>, Vec<u16>)) -> DeviceBuffer {
        let Dev::Cuda(ctx, s) = self else { unreachable!("only a device uploads") };
        match dtype {
            Dtype::F32 => DeviceBuffer::from_slice(ctx, s.stream, &buffer.0),
            _ => DeviceBuffer::from_slice(ctx, s.stream, &buffer.1),
        }
        .unwrap()
    }

    /// `add` of one micro-batch.
    fn add(
        &self,
        acc: &Accumulator,
        scaler: &Scaler,
        dtypes: &[Dtype],
        buffers: &[&(Vec<f32>, Vec<u16>)],
        count: u64,
    ) {
        self.with_grads(dtypes, buffers, |g| acc.add(scaler, g, count)).unwrap();
    }

    /// `add_tensor` of one contribution.
    fn add_tensor(
        &self,
        acc: &Accumulator,
        scaler: &Scaler,
        index: usize,
        dtype: Dtype,
        buffer: &(Vec<f32>, Vec<u16>),
    ) {
        match self {
            Dev::Cpu => acc.add_tensor(scaler, index, grad_of(dtype, &buffer.0, &buffer.1)),
            Dev::Cuda(..) => acc.add_tensor(scaler, index, self.upload(dtype, buffer).ptr()),
        }
        .unwrap();
    }

    /// This rank's shard of the synced gradient.
    fn shard(&self, acc: &Accumulator) -> Vec<f32> {
        let (range, ptr) = acc.shard();
        match self {
            // SAFETY: the shard's address and length come from the live accumulator, which
            // nothing writes until the next micro-batch.
            Dev::Cpu => unsafe { std::slice::from_raw_parts(ptr, range.len()) }.to_vec(),
            Dev::Cuda(ctx, s) => {
                let mut shard = vec![0f32; range.len()];
                if !shard.is_empty() {
                    DeviceBuffer::adopt(ctx, s.stream, ptr as u64, range.len() * 4)
                        .read(&mut shard)
                        .unwrap();
                }
                shard
            }
        }
    }
}

/// Runs `f(rank, device, communicator)` on every rank of a group of `world`, each on its own
/// thread: the in-process communicator on the CPU, NCCL on CUDA.
fn in_group<T: Send>(
    on: On,
    world: usize,
    f: impl Fn(usize, &Dev, &Arc<dyn Communicator>) -> T + Sync,
) -> Vec<T> {
    let f = &f;
    match on {
        On::Cpu => {
            let comms: Vec<Arc<dyn Communicator>> = LocalComm::group(world)
                .unwrap()
                .into_iter()
                .map(|c| Arc::new(c) as Arc<dyn Communicator>)
                .collect();
            std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .iter()
                    .enumerate()
                    .map(|(rank, comm)| s.spawn(move || f(rank, &Dev::Cpu, comm)))
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            })
        }
        On::Cuda => {
            let id = nccl_unique_id().unwrap();
            std::thread::scope(|s| {
                let handles: Vec<_> = (0..world)
                    .map(|rank| {
                        s.spawn(move || {
                            let dev = Dev::of(On::Cuda, rank);
                            let comm = NcclComm::new(&id, rank, world, rank as i32).unwrap();
                            Communicator::set_timeout(&comm, Some(Duration::from_secs(120)))
                                .unwrap();
                            f(rank, &dev, &(Arc::new(comm) as Arc<dyn Communicator>))
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            })
        }
    }
}

/// How many ranks a CUDA test may run here (a device each), or `None` to skip it: no GPU or NCCL
/// (a failure with GRADACC_REQUIRE_GPU=1).
fn cuda_ranks() -> Option<usize> {
    if !common::cuda::gpu_or_skip() || !common::cuda::nccl_or_skip() {
        return None;
    }
    let mut count = 0;
    // SAFETY: the driver loads (gpu_or_skip); a valid out-pointer.
    unsafe { cudarc::driver::sys::cuDeviceGetCount(&mut count) };
    Some(count.max(0) as usize)
}

/// One micro-batch on one rank: per tensor, its contributions (true, unscaled gradients), and
/// which (tensor, contribution, element) hold a non-finite value instead.
struct Micro {
    count: u64,
    scale: f32,
    hook: bool,
    contributions: Vec<Vec<Vec<f32>>>,
    poison: Vec<(usize, usize, usize, f32)>,
}

impl Micro {
    /// The smallest tensor holding a non-finite value: where the micro-batch goes bad.
    fn bad_tensor(&self) -> Option<usize> {
        self.poison.iter().map(|p| p.0).min()
    }
}

fn random_window(rng: &mut Rng, tensors: &[TensorDesc], poison: bool) -> Vec<Micro> {
    (0..rng.range(0, 4))
        .map(|_| {
            let hook = rng.range(0, 1) == 0;
            random_micro(rng, tensors, poison, hook, &|rng| rng.range(0, 3) as usize)
        })
        .collect()
}

/// One micro-batch, fed by hooks or whole; a hook feeds tensor t `contributions(rng)` times.
fn random_micro(
    rng: &mut Rng,
    tensors: &[TensorDesc],
    poison: bool,
    hook: bool,
    contributions: &dyn Fn(&mut Rng) -> usize,
) -> Micro {
    let contributions: Vec<Vec<Vec<f32>>> = tensors
        .iter()
        .map(|t| {
            let k = if hook { contributions(rng) } else { 1 };
            (0..k).map(|_| (0..t.numel).map(|_| rng.uniform(-1.0, 1.0) as f32).collect()).collect()
        })
        .collect();
    let mut m = Micro {
        count: rng.range(1, 9),
        scale: (2f32).powi(rng.range(0, 15) as i32),
        hook,
        contributions,
        poison: Vec::new(),
    };
    if poison && rng.range(0, 2) == 0 {
        for _ in 0..rng.range(1, 2) {
            let fed: Vec<usize> =
                (0..tensors.len()).filter(|&t| !m.contributions[t].is_empty()).collect();
            if fed.is_empty() {
                break;
            }
            let t = fed[rng.range(0, fed.len() as u64 - 1) as usize];
            let c = rng.range(0, m.contributions[t].len() as u64 - 1) as usize;
            let e = rng.range(0, tensors[t].numel as u64 - 1) as usize;
            let v = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN][rng.range(0, 2) as usize];
            m.poison.push((t, c, e, v));
        }
    }
    m
}

/// Every rank's window of one shape (its micro-batches, whole or fed by hooks, a hook feeding each
/// tensor at most once), as sharded accumulation's collectives need; the values, counts, scales
/// and poison are each rank's own.
fn aligned_windows(rng: &mut Rng, tensors: &[TensorDesc], world: usize) -> Vec<Vec<Micro>> {
    let hooks: Vec<bool> = (0..rng.range(1, 4)).map(|_| rng.range(0, 1) == 0).collect();
    (0..world)
        .map(|_| {
            let window = hooks.iter().map(|&hook| {
                random_micro(rng, tensors, true, hook, &|rng| rng.range(0, 4).min(1) as usize)
            });
            window.collect()
        })
        .collect()
}

/// The buffers one contribution is fed from: the scaled values in the tensor's dtype, with the
/// micro-batch's poison in place.
fn encoded(m: &Micro, tensors: &[TensorDesc], t: usize, c: usize) -> (Vec<f32>, Vec<u16>) {
    let mut values: Vec<f32> = m.contributions[t][c].iter().map(|v| v * m.scale).collect();
    for &(pt, pc, e, v) in &m.poison {
        if (pt, pc) == (t, c) {
            values[e] = v;
        }
    }
    encode(tensors[t].dtype, &values, 1.0)
}

/// Feeds `window` into `acc` on `dev`, every micro-batch at its own scale.
fn feed(dev: &Dev, acc: &Accumulator, window: &[Micro], tensors: &[TensorDesc]) {
    let dtypes: Vec<Dtype> = tensors.iter().map(|t| t.dtype).collect();
    for m in window {
        let scaler =
            dev.scaler(ScalerConfig { init_scale: m.scale, min_scale: 1.0, ..Default::default() });
        let buffers: Vec<Vec<(Vec<f32>, Vec<u16>)>> = (0..tensors.len())
            .map(|t| (0..m.contributions[t].len()).map(|c| encoded(m, tensors, t, c)).collect())
            .collect();
        if m.hook {
            acc.begin_microbatch(m.count).unwrap();
            for (t, cs) in buffers.iter().enumerate() {
                for c in cs {
                    dev.add_tensor(acc, &scaler, t, dtypes[t], c);
                }
            }
            acc.end_microbatch().unwrap();
        } else {
            let firsts: Vec<&(Vec<f32>, Vec<u16>)> = buffers.iter().map(|b| &b[0]).collect();
            dev.add(acc, &scaler, &dtypes, &firsts, m.count);
        }
    }
}

/// One rank's boundary: its report, its shard of the gradient (the whole master without sharding)
/// and, with `tensor_stats`, the per-tensor stats.
type RankResult = (SyncInfo, Vec<Vec<f32>>, Option<Vec<TensorStats>>);

/// Every rank's (info, masters) after its window and the boundary, each rank on its own thread,
/// after a first window of garbage that must not leak.
fn run_group(
    on: On,
    config: AccumulatorConfig,
    tensors: &[TensorDesc],
    windows: &[Vec<Micro>],
) -> Vec<RankResult> {
    in_group(on, windows.len(), |rank, dev, comm| {
        let shards = comm.world_size();
        let sharding = match config.sharding {
            Sharding::None => Sharding::None,
            Sharding::Accumulate { .. } => Sharding::Accumulate { shards, rank },
            _ => Sharding::ReduceScatter { shards, rank },
        };
        let acc = dev.accumulator_over(AccumulatorConfig { sharding, ..config }, tensors, comm);
        let junk: Vec<(Vec<f32>, Vec<u16>)> =
            tensors.iter().map(|t| (vec![1e3; t.numel], vec![to_bf16(7.0); t.numel])).collect();
        let dtypes: Vec<Dtype> = tensors.iter().map(|t| t.dtype).collect();
        let one = dev.scaler(ScalerConfig { init_scale: 1.0, ..Default::default() });
        dev.add(&acc, &one, &dtypes, &junk.iter().collect::<Vec<_>>(), 1);
        acc.sync(Some(&**comm)).unwrap();
        feed(dev, &acc, &windows[rank], tensors);
        let info = acc.sync(Some(&**comm)).unwrap();
        let stats = config.tensor_stats.then(|| acc.tensor_stats().unwrap());
        (info, vec![dev.shard(&acc)], stats)
    })
}

/// The first non-finite place of the group: in the order micro-batch, then tensor, then rank.
fn first_place(windows: &[Vec<Micro>]) -> Option<OverflowAt> {
    windows
        .iter()
        .enumerate()
        .filter_map(|(rank, w)| {
            w.iter().enumerate().find_map(|(i, m)| m.bad_tensor().map(|t| (i as u64, t, rank)))
        })
        .min()
        .map(|(microbatch, tensor, rank)| OverflowAt::Gradient { rank, microbatch, tensor })
}

/// One random case on `on`, with up to `max_world` ranks; on CUDA the CPU's results too, which
/// the software GPU (whose NCCL sums in rank order) must equal bit for bit.
fn run_case(rng: &mut Rng, case: usize, on: On, max_world: usize) {
    let world = (rng.range(1, 4) as usize).min(max_world);
    let tensors = random_tensors(rng);
    // `run_group` gives each rank its shard of "reduce-scatter" or "accumulate".
    let sharding = [
        Sharding::None,
        Sharding::ReduceScatter { shards: 1, rank: 0 },
        Sharding::Accumulate { shards: 1, rank: 0 },
    ][rng.range(0, 2) as usize];
    let accumulate = matches!(sharding, Sharding::Accumulate { .. });
    let config = AccumulatorConfig {
        sharding,
        overflow: Overflow::DropMicrobatch,
        tensor_stats: rng.range(0, 3) != 0,
        ..random_config(rng)
    };
    let (normalize, loss_reduction) = (config.normalize, config.loss_reduction);
    let mut windows: Vec<Vec<Micro>> = if accumulate {
        aligned_windows(rng, &tensors, world)
    } else {
        (0..world).map(|_| random_window(rng, &tensors, true)).collect()
    };
    // Something to drop, or at least a micro-batch.
    while !accumulate
        && windows.iter().flatten().all(|m| m.poison.is_empty())
        && windows[0].len() < 2
    {
        windows[0].extend(random_window(rng, &tensors, true));
    }
    // Which micro-batches are kept: a poisoned one is dropped on its rank; under sharded
    // accumulation one fed by hooks is dropped on every rank (its buckets were reduced as they
    // filled).
    let keeps: Vec<Vec<bool>> = windows
        .iter()
        .map(|w| {
            w.iter()
                .enumerate()
                .map(|(i, m)| {
                    if accumulate && m.hook {
                        windows.iter().all(|w| w[i].poison.is_empty())
                    } else {
                        m.poison.is_empty()
                    }
                })
                .collect()
        })
        .collect();
    let kept = || {
        windows.iter().zip(&keeps).flat_map(|(w, k)| w.iter().zip(k)).filter(|p| *p.1).map(|p| p.0)
    };
    let dropped = windows.iter().flatten().count() - kept().count();
    let place = first_place(&windows);
    let what = format!(
        "case {case} on {on:?}: world {world}, {normalize:?}, {loss_reduction:?}, {:?}, dropped {dropped}",
        config.sharding
    );

    // Per tensor, the micro-batches (over every rank) in which it held a non-finite value.
    let nonfinite: Vec<u64> = (0..tensors.len())
        .map(|t| windows.iter().flatten().filter(|m| m.poison.iter().any(|p| p.0 == t)).count())
        .map(|c| c as u64)
        .collect();
    let counts = |stats: &Option<Vec<TensorStats>>| {
        stats.as_ref().map(|s| s.iter().map(|s| s.nonfinite_microbatches).collect::<Vec<_>>())
    };

    // Skipping the step: the same place and counts, every micro-batch counted, the step skipped.
    if dropped > 0 {
        let skip = run_group(
            on,
            AccumulatorConfig { overflow: Overflow::SkipStep, ..config },
            &tensors,
            &windows,
        );
        // On CUDA the flag stays on the device under SkipStep: the place is not located.
        let skip_place = if on == On::Cpu { place } else { None };
        for (rank, (info, _, stats)) in skip.iter().enumerate() {
            assert!(info.found_inf, "{what}: SkipStep on rank {rank}");
            assert_eq!(info.overflow, skip_place, "{what}: SkipStep's place on rank {rank}");
            assert_eq!(info.dropped_microbatches, 0, "{what}");
            assert_eq!(info.microbatches, windows.iter().flatten().count() as u64, "{what}");
            if config.tensor_stats {
                assert_eq!(counts(stats), Some(nonfinite.clone()), "{what}: SkipStep's counts");
            }
        }
    }

    let results = run_group(on, config, &tensors, &windows);
    if on == On::Cuda && std::env::var("GRADACC_SIMGPU").as_deref() == Ok("1") {
        let cpu = run_group(On::Cpu, config, &tensors, &windows);
        for (rank, ((a, ma, sa), (b, mb, sb))) in results.iter().zip(&cpu).enumerate() {
            let same = |x: f64, y: f64| x.to_bits() == y.to_bits() || x.is_nan() && y.is_nan();
            let stats = |s: &Option<Vec<TensorStats>>| {
                s.as_ref().map(|s| {
                    s.iter().map(|s| (s.grad_norm.to_bits(), s.nonfinite_microbatches)).collect()
                })
            };
            let (ca, cb): (Option<Vec<_>>, Option<Vec<_>>) = (stats(sa), stats(sb));
            assert_eq!(
                ca, cb,
                "{what}: rank {rank}'s tensor stats differ between CUDA and the CPU"
            );
            assert!(
                same(a.grad_norm, b.grad_norm) && same(a.clip_coef, b.clip_coef),
                "{what}: rank {rank}: CUDA {a:?}, CPU {b:?}"
            );
            assert_eq!(
                (a.found_inf, a.total_count, a.microbatches, a.dropped_microbatches, a.overflow),
                (b.found_inf, b.total_count, b.microbatches, b.dropped_microbatches, b.overflow),
                "{what}: rank {rank}"
            );
            assert!(
                ma[0].iter().zip(&mb[0]).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{what}: rank {rank}'s gradient differs between CUDA and the CPU"
            );
        }
    }
    let (info, _, stats) = &results[0];
    let bits = |s: &Option<Vec<TensorStats>>| {
        s.as_ref().map(|s| {
            s.iter().map(|s| (s.grad_norm.to_bits(), s.nonfinite_microbatches)).collect::<Vec<_>>()
        })
    };
    for (rank, (other, _, other_stats)) in results.iter().enumerate() {
        assert_eq!(other, info, "{what}: rank {rank} reports differently");
        assert_eq!(bits(other_stats), bits(stats), "{what}: rank {rank}'s tensor stats differ");
    }
    if config.tensor_stats {
        assert_eq!(counts(stats), Some(nonfinite.clone()), "{what}: the counts");
    }
    assert_eq!(info.dropped_microbatches, dropped as u64, "{what}");
    assert_eq!(info.overflow, place, "{what}");
    assert_eq!(info.microbatches, kept().count() as u64, "{what}");
    assert_eq!(info.total_count, kept().map(|m| m.count).sum::<u64>(), "{what}");
    if kept().count() == 0 {
        assert!(info.found_inf, "{what}: nothing kept, the step is skipped");
        return;
    }
    assert!(!info.found_inf, "{what}");

    // The f64 reference over exactly the kept micro-batches.
    let weights_by_count = config.weights_by_count();
    let divisor = match normalize {
        Normalize::ByCount => info.total_count as f64,
        Normalize::ByMicrobatches => info.microbatches as f64,
        Normalize::ByWorld => world as f64,
        Normalize::None => 1.0,
    };
    let mut reference: Vec<Vec<f64>> = tensors.iter().map(|t| vec![0.0; t.numel]).collect();
    let mut magnitude = reference.clone();
    for m in kept() {
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
    // A norm moves by at most the norm of the elements' errors, each within the accumulation's
    // bound of its magnitude (a sum that cancels is far smaller than its error bound's scale).
    let norm_tol = |t: std::ops::Range<usize>| {
        let errors: f64 =
            t.flat_map(|t| magnitude[t].iter()).map(|m| (2e-6 * m / divisor).powi(2)).sum();
        errors.sqrt() + 1e-12
    };
    let tol = 1e-5 * norm + norm_tol(0..tensors.len());
    assert!((info.grad_norm - norm).abs() <= tol, "{what}: norm {} vs {norm}", info.grad_norm);
    for (t, s) in stats.iter().flatten().enumerate() {
        let want = reference[t].iter().map(|v| (v / divisor).powi(2)).sum::<f64>().sqrt();
        let tol = 1e-5 * want + norm_tol(t..t + 1);
        assert!(
            (s.grad_norm - want).abs() <= tol,
            "{what}: tensor {t}'s norm {} vs {want} (tol {tol})",
            s.grad_norm
        );
    }

    // Every rank's shard (the whole master without sharding) against the reference.
    let flat: Vec<(f64, f64)> = {
        let acc =
            Accumulator::new(AccumulatorConfig { sharding: Sharding::None, ..config }, &tensors)
                .unwrap();
        let mut flat = vec![(0.0, 0.0); acc.shard().0.len()];
        for t in 0..tensors.len() {
            let at = acc.offset(t).unwrap();
            for i in 0..tensors[t].numel {
                flat[at + i] = (reference[t][i], magnitude[t][i]);
            }
        }
        flat
    };
    for (rank, (other, shards, _)) in results.iter().enumerate() {
        let range = if world > 1 && config.sharding != Sharding::None {
            let acc = Accumulator::new(
                AccumulatorConfig {
                    sharding: Sharding::ReduceScatter { shards: world, rank },
                    ..config
                },
                &tensors,
            )
            .unwrap();
            acc.shard().0
        } else {
            0..flat.len()
        };
        for (k, &got) in shards[0].iter().enumerate() {
            let (sum, mag) = flat[range.start + k];
            let want = sum / divisor * coef;
            let tol = 2e-6 * mag / divisor * coef
                + (sum / divisor).abs() * (other.clip_coef - coef).abs()
                + 1e-5 * (sum / divisor).abs() * coef
                + 1e-30;
            assert!(
                (got as f64 - want).abs() <= tol,
                "{what}: rank {rank} element {}: {got} vs {want} (tol {tol})",
                range.start + k
            );
        }
    }
    for (rank, (_, shards, _)) in results.iter().enumerate().skip(1) {
        if config.sharding == Sharding::None {
            assert!(
                shards[0].iter().zip(&results[0].1[0]).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{what}: rank {rank}'s gradient differs from rank 0's"
            );
        }
    }
}

#[test]
fn dropped_microbatches_leave_the_f64_gradient_of_the_kept_ones() {
    let mut rng = Rng::fresh("dropped_microbatches_leave_the_f64_gradient_of_the_kept_ones");
    for case in 0..60 {
        run_case(&mut rng, case, On::Cpu, 4);
    }
}

#[test]
fn dropped_microbatches_leave_the_f64_gradient_of_the_kept_ones_on_cuda() {
    let Some(devices) = cuda_ranks() else { return };
    let name = "dropped_microbatches_leave_the_f64_gradient_of_the_kept_ones_on_cuda";
    let cases = |name: &str| {
        let mut rng = Rng::fresh(name);
        for case in 0..24 {
            run_case(&mut rng, case, On::Cuda, devices);
        }
    };
    // Up to 3 ranks, as many as there are devices; the software GPU runs 3 in a child process.
    match std::env::var("GRADACC_SIMGPU").as_deref() {
        Ok("1") => common::cuda::at_devices(3, devices as i32, name, cases),
        _ => cases(name),
    }
}

/// Without a non-finite value, dropping is skipping bit for bit: `add` checks and then adds as
/// before, and a tensor's one contribution per micro-batch goes through the staging exactly.
#[test]
fn a_clean_window_is_the_same_under_both_policies() {
    clean_windows(On::Cpu, 3, "a_clean_window_is_the_same_under_both_policies");
}

#[test]
fn a_clean_window_is_the_same_under_both_policies_on_cuda() {
    let Some(devices) = cuda_ranks() else { return };
    clean_windows(On::Cuda, devices, "a_clean_window_is_the_same_under_both_policies_on_cuda");
}

fn clean_windows(on: On, max_world: usize, name: &str) {
    let mut rng = Rng::fresh(name);
    for case in 0..20 {
        let tensors: Vec<TensorDesc> = (0..rng.range(1, 5))
            .map(|_| TensorDesc {
                numel: rng.range(1, 3000) as usize,
                dtype: [Dtype::F32, Dtype::F16, Dtype::Bf16][rng.range(0, 2) as usize],
            })
            .collect();
        let world = (rng.range(1, 3) as usize).min(max_world);
        let mut windows: Vec<Vec<Micro>> =
            (0..world).map(|_| random_window(&mut rng, &tensors, false)).collect();
        windows[0].extend(random_window(&mut rng, &tensors, false));
        windows[0].push(random_window(&mut rng, &tensors, false).pop().unwrap_or(Micro {
            count: 2,
            scale: 4.0,
            hook: false,
            contributions: tensors.iter().map(|t| vec![vec![0.25; t.numel]]).collect(),
            poison: Vec::new(),
        }));
        for m in windows.iter_mut().flatten() {
            for c in &mut m.contributions {
                c.truncate(1);
            }
        }
        let config = AccumulatorConfig {
            max_grad_norm: if case % 2 == 0 { 0.5 } else { 0.0 },
            threads: rng.range(1, 2) as usize,
            ..Default::default()
        };
        let skip = run_group(on, config, &tensors, &windows);
        let drop = run_group(
            on,
            AccumulatorConfig { overflow: Overflow::DropMicrobatch, ..config },
            &tensors,
            &windows,
        );
        for (rank, ((a, ma, _), (b, mb, _))) in skip.iter().zip(&drop).enumerate() {
            assert_eq!(a, b, "case {case}: rank {rank}'s report");
            assert_eq!(a.overflow, None);
            assert!(
                ma[0].iter().zip(&mb[0]).all(|(x, y)| x.to_bits() == y.to_bits()),
                "case {case}: rank {rank}'s gradient differs between the policies"
            );
        }
    }
}

/// The scaler after a window that dropped micro-batches: it backs off though the step is taken,
/// grows only after clean steps, keeps the minimum scale rather than failing, and every rank's
/// scaler moves alike (each rank dropped something different).
#[test]
fn a_drop_backs_the_scale_off_on_every_rank() {
    drops_back_off(On::Cpu);
}

/// The same rule on CUDA, where the scaler's kernel reads the drops from the boundary.
#[test]
fn a_drop_backs_the_scale_off_on_every_rank_on_cuda() {
    if cuda_ranks().is_some_and(|d| common::cuda::enough_devices(2, d as i32)) {
        drops_back_off(On::Cuda);
    }
}

/// The scaler's rule after windows that kept everything, dropped some or dropped everything, on
/// CUDA (the update kernel, from the boundary's drops) against the CPU's, over random hysteresis
/// and growth settings down to the minimum scale: the same scales, skips and errors.
#[test]
fn the_scale_after_drops_follows_the_cpu_on_cuda() {
    if cuda_ranks().is_none() {
        return;
    }
    let mut rng = Rng::fresh("the_scale_after_drops_follows_the_cpu_on_cuda");
    let tensors = [TensorDesc { numel: 3, dtype: Dtype::F32 }];
    let config = AccumulatorConfig { overflow: Overflow::DropMicrobatch, ..Default::default() };
    let (good, bad) = ((vec![1.0f32; 3], Vec::new()), (vec![1.0, f32::NAN, 1.0], Vec::new()));
    for case in 0..8 {
        let scaler_config = ScalerConfig {
            init_scale: (2f32).powi(rng.range(0, 5) as i32),
            min_scale: 1.0,
            growth_interval: rng.range(1, 3) as u32,
            hysteresis: rng.range(1, 3) as u32,
            consecutive_hysteresis: rng.range(0, 1) == 1,
            ..Default::default()
        };
        // Per window: 0 keeps both micro-batches, 1 drops one, 2 drops both.
        let windows: Vec<u64> = (0..30).map(|_| rng.range(0, 2)).collect();
        let [cpu, cuda] = [On::Cpu, On::Cuda].map(|on| {
            let dev = Dev::of(on, 0);
            let acc = dev.accumulator(config, &tensors);
            let scaler = dev.scaler(scaler_config);
            let mut seen = Vec::new();
            for &kind in &windows {
                for m in 0..2 {
                    let poisoned = kind == 2 || kind == 1 && m == 1;
                    dev.add(
                        &acc,
                        &scaler,
                        &[Dtype::F32],
                        &[if poisoned { &bad } else { &good }],
                        1,
                    );
                }
                acc.sync(None).unwrap();
                let skipped = scaler.update_from(&[&acc], true).map_err(|e| e.kind);
                let stats = scaler.stats().unwrap();
                seen.push((scaler.scale().unwrap(), skipped, stats.backoffs, stats.skipped_steps));
            }
            seen
        });
        assert_eq!(cuda, cpu, "case {case}: {scaler_config:?}, windows {windows:?}");
    }
}

fn drops_back_off(on: On) {
    let tensors = [TensorDesc { numel: 5, dtype: Dtype::F16 }];
    let config = AccumulatorConfig { overflow: Overflow::DropMicrobatch, ..Default::default() };
    let scalers: Vec<Vec<(f32, bool)>> = in_group(on, 2, |rank, dev, comm| {
        let acc = dev.accumulator(config, &tensors);
        let scaler = dev.scaler(ScalerConfig {
            init_scale: 4.0,
            min_scale: 1.0,
            growth_interval: 2,
            ..Default::default()
        });
        let good = (Vec::new(), vec![to_f16(1.0); 5]);
        let mut bad = good.clone();
        bad.1[3] = to_f16(f32::INFINITY);
        let mut seen = Vec::new();
        // Step k: rank r drops a micro-batch when `drops[k]` says so for it.
        let drops = [[true, false], [false, false], [false, false], [false, true]];
        let drops = drops.iter().chain(&[[true, true], [true, false]]);
        for (k, step) in drops.enumerate() {
            let mine = step[rank];
            dev.add(&acc, &scaler, &[Dtype::F16], &[&good], 1);
            dev.add(&acc, &scaler, &[Dtype::F16], &[if mine { &bad } else { &good }], 1);
            let info = acc.sync(Some(&**comm)).unwrap();
            let drops = step.iter().filter(|&&d| d).count() as u64;
            assert_eq!(info.dropped_microbatches, drops, "step {k}");
            assert!(!info.found_inf, "step {k}: something was kept");
            let skipped = scaler.update_from(&[&acc], true).unwrap();
            seen.push((scaler.scale().unwrap(), skipped.unwrap()));
        }
        seen
    });
    assert_eq!(scalers[0], scalers[1], "the ranks' scalers differ");
    let scales: Vec<f32> = scalers[0].iter().map(|s| s.0).collect();
    // Back off, clean, clean (grown), back off, back off to the minimum, stay at the minimum.
    assert_eq!(scales, [2.0, 2.0, 4.0, 2.0, 1.0, 1.0]);
    assert!(scalers[0].iter().all(|s| !s.1), "a window that kept something is not skipped");
}

/// Every micro-batch of every rank dropped: the step is skipped, nothing is normalised by zero,
/// and the master reads as zeros; the next window starts clean.
#[test]
fn nothing_kept_anywhere_skips_the_step() {
    let tensors =
        [TensorDesc { numel: 3, dtype: Dtype::Bf16 }, TensorDesc { numel: 2, dtype: Dtype::F32 }];
    let config = AccumulatorConfig {
        overflow: Overflow::DropMicrobatch,
        tensor_stats: true,
        ..Default::default()
    };
    let acc = Accumulator::new(config, &tensors).unwrap();
    let scaler = Scaler::new(ScalerConfig { init_scale: 2.0, ..Default::default() }).unwrap();
    let e = acc.tensor_stats().unwrap_err();
    assert_eq!(e.kind, ErrorKind::WrongState, "before any sync: {e:?}");
    let a = [to_bf16(1.0); 3];
    let b = [1.0f32, f32::NAN];
    acc.add(&scaler, &[Grad::bf16_bits(&a), Grad::F32(&b)], 4).unwrap();
    acc.begin_microbatch(2).unwrap();
    acc.add_tensor(&scaler, 1, Grad::F32(&[f32::INFINITY, 0.0])).unwrap();
    acc.add_tensor(&scaler, 0, Grad::bf16_bits(&a)).unwrap();
    acc.end_microbatch().unwrap();
    let info = acc.sync(None).unwrap();
    assert!(info.found_inf);
    assert_eq!((info.total_count, info.microbatches, info.dropped_microbatches), (0, 0, 2));
    assert_eq!(info.overflow, Some(OverflowAt::Gradient { rank: 0, microbatch: 0, tensor: 1 }));
    assert_eq!(acc.with_master(0, |m| m.to_vec()).unwrap(), [0.0; 3]);
    let stats = acc.tensor_stats().unwrap();
    assert_eq!(
        stats.iter().map(|s| (s.grad_norm, s.nonfinite_microbatches)).collect::<Vec<_>>(),
        [(0.0, 0), (0.0, 2)]
    );
    assert!(scaler.update_from(&[&acc], true).unwrap().unwrap(), "the step is skipped");
    // The next window: clean, normalised by its own count.
    acc.add(&scaler, &[Grad::bf16_bits(&a), Grad::F32(&[1.0, 1.0])], 4).unwrap();
    let info = acc.sync(None).unwrap();
    assert!(!info.found_inf);
    assert_eq!((info.total_count, info.dropped_microbatches, info.overflow), (4, 0, None));
    assert_eq!(acc.with_master(1, |m| m.to_vec()).unwrap(), [1.0, 1.0]);
    let stats = acc.tensor_stats().unwrap();
    assert_eq!(stats[1], TensorStats { grad_norm: 2f64.sqrt(), nonfinite_microbatches: 0 });
    // Off in the config: nothing was measured.
    let off = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    off.add(&scaler, &[Grad::bf16_bits(&a), Grad::F32(&[1.0, 1.0])], 4).unwrap();
    off.sync(None).unwrap();
    assert_eq!(off.tensor_stats().unwrap_err().kind, ErrorKind::WrongState);
}

/// The same on CUDA, alone (the host knows the totals) and in a group of two (the device sums
/// them): the boundary that kept nothing is finished on the device, where the scaler reads it.
#[test]
fn nothing_kept_anywhere_skips_the_step_on_cuda() {
    let Some(devices) = cuda_ranks() else { return };
    let tensors =
        [TensorDesc { numel: 3, dtype: Dtype::Bf16 }, TensorDesc { numel: 2, dtype: Dtype::F32 }];
    let dtypes = [Dtype::Bf16, Dtype::F32];
    let config = AccumulatorConfig {
        overflow: Overflow::DropMicrobatch,
        tensor_stats: true,
        ..Default::default()
    };
    for world in (1..=2).filter(|&w| w <= devices) {
        let results = in_group(On::Cuda, world, |rank, dev, comm| {
            let acc = dev.accumulator(config, &tensors);
            let scaler = dev.scaler(ScalerConfig { init_scale: 2.0, ..Default::default() });
            let a = (Vec::new(), vec![to_bf16(1.0); 3]);
            let b = (vec![1.0f32, f32::NAN], Vec::new());
            dev.add(&acc, &scaler, &dtypes, &[&a, &b], 4);
            acc.begin_microbatch(2).unwrap();
            dev.add_tensor(&acc, &scaler, 1, Dtype::F32, &(vec![f32::INFINITY, 0.0], Vec::new()));
            dev.add_tensor(&acc, &scaler, 0, Dtype::Bf16, &a);
            acc.end_microbatch().unwrap();
            let info = acc.sync(Some(&**comm)).unwrap();
            let stats: Vec<(f64, u64)> = acc
                .tensor_stats()
                .unwrap()
                .iter()
                .map(|s| (s.grad_norm, s.nonfinite_microbatches))
                .collect();
            assert_eq!(stats, [(0.0, 0), (0.0, 2 * world as u64)], "world {world}, rank {rank}");
            let mut master = [1.0f32; 3];
            acc.read_master(0, &mut master).unwrap();
            let skipped = scaler.update_from(&[&acc], true).unwrap().unwrap();
            let scale = scaler.scale().unwrap();
            // The next window: clean, normalised by its own count.
            let ones = (vec![1.0f32, 1.0], Vec::new());
            dev.add(&acc, &scaler, &dtypes, &[&a, &ones], 4);
            let next = acc.sync(Some(&**comm)).unwrap();
            let mut second = [0.0f32; 2];
            acc.read_master(1, &mut second).unwrap();
            (rank, info, master, skipped, scale, next, second)
        });
        for (rank, info, master, skipped, scale, next, second) in results {
            let what = format!("world {world}, rank {rank}");
            assert!(info.found_inf, "{what}");
            assert_eq!(
                (info.total_count, info.microbatches, info.dropped_microbatches),
                (0, 0, 2 * world as u64),
                "{what}"
            );
            let place = OverflowAt::Gradient { rank: 0, microbatch: 0, tensor: 1 };
            assert_eq!(info.overflow, Some(place), "{what}");
            assert_eq!((info.grad_norm, info.clip_coef), (0.0, 1.0), "{what}");
            assert_eq!(master, [0.0; 3], "{what}");
            assert!(skipped, "{what}: the step is skipped");
            assert_eq!(scale, 1.0, "{what}: the scale backs off once");
            assert!(!next.found_inf, "{what}");
            assert_eq!((next.total_count, next.dropped_microbatches), (4 * world as u64, 0));
            assert_eq!((next.overflow, second), (None, [1.0, 1.0]), "{what}");
        }
    }
}

/// The tensors of the window that drops everything: shards of 2 and 3 ranks cut through them.
const DROPPED_TENSORS: [TensorDesc; 3] = [
    TensorDesc { numel: 5000, dtype: Dtype::Bf16 },
    TensorDesc { numel: 3, dtype: Dtype::F32 },
    TensorDesc { numel: 9000, dtype: Dtype::F16 },
];

/// A rank's FP32 model weights, host vectors or device copies of them.
enum Model {
    Host(Vec<Vec<f32>>),
    Device(Vec<DeviceBuffer>),
}

impl Dev {
    fn model(&self, tensors: &[TensorDesc]) -> Model {
        let values = tensors.iter().map(|t| (0..t.numel).map(|i| 0.5 + i as f32 / 4096.0));
        let values: Vec<Vec<f32>> = values.map(Iterator::collect).collect();
        match self {
            Dev::Cpu => Model::Host(values),
            Dev::Cuda(..) => Model::Device(
                values.into_iter().map(|v| self.upload(Dtype::F32, &(v, Vec::new()))).collect(),
            ),
        }
    }

    fn optimizer(&self, acc: &Accumulator, model: &Model) -> Optimizer {
        let config = OptimizerConfig::default();
        match model {
            Model::Host(w) => {
                let weights: Vec<Grad> = w.iter().map(|v| Grad::F32(v)).collect();
                Optimizer::new(acc, config, &[], &weights).unwrap()
            }
            Model::Device(w) => {
                let ptrs: Vec<DevicePtr> = w.iter().map(DeviceBuffer::ptr).collect();
                Optimizer::new_device(acc, config, &[], &ptrs, &vec![Dtype::F32; w.len()]).unwrap()
            }
        }
    }

    /// The optimizer's step; whether it stepped, where the host knows it.
    fn step(
        &self,
        opt: &Optimizer,
        acc: &Accumulator,
        model: &mut Model,
        comm: Option<&dyn Communicator>,
    ) -> Option<bool> {
        match model {
            Model::Host(w) => {
                let mut weights: Vec<GradMut> = w.iter_mut().map(|v| GradMut::F32(v)).collect();
                Some(opt.step(acc, &mut weights, comm).unwrap())
            }
            Model::Device(w) => {
                let ptrs: Vec<DevicePtr> = w.iter().map(DeviceBuffer::ptr).collect();
                opt.step_device(acc, &ptrs, comm).unwrap()
            }
        }
    }

    /// The model's weights' bits (on a device a host read).
    fn weight_bits(&self, model: &Model) -> Vec<u32> {
        let values: Vec<Vec<f32>> = match model {
            Model::Host(w) => w.clone(),
            Model::Device(w) => w
                .iter()
                .map(|b| {
                    let mut v = vec![0f32; b.bytes() / 4];
                    b.read(&mut v).unwrap();
                    v
                })
                .collect(),
        };
        values.iter().flatten().map(|v| v.to_bits()).collect()
    }
}

/// One rank's view of the window that dropped everything.
struct Dropped {
    info: SyncInfo,
    /// The shard's bits and, unless sharded accumulation, every tensor's whole master's.
    master_bits: Vec<u32>,
    stats: Vec<TensorStats>,
    /// Per scaler: its update from the accumulator, its state before and after it.
    scalers: Vec<(std::result::Result<Option<bool>, ErrorKind>, ScalerState, ScalerState)>,
    stepped: Option<bool>,
    /// The optimizer's saved state, step count and the model's weights kept their bits.
    optimizer_kept: bool,
    /// The report of the clean window that follows.
    next: SyncInfo,
}

/// A group of `world` ranks under `sharding` (each rank's shard filled in) steps a clean window,
/// then drops every micro-batch of the next one on every rank: an `add` with a non-finite value
/// on every rank (the last rank's in tensor 1, the others' in tensor 2), a micro-batch fed
/// tensor by tensor with one in tensor 0 (on rank 0 only under sharded accumulation, which
/// drops it on every rank all the same), and an `add` with one in tensor 2.
fn drop_everything(on: On, world: usize, sharding: Sharding) -> Vec<Dropped> {
    let tensors = &DROPPED_TENSORS;
    let dtypes: Vec<Dtype> = tensors.iter().map(|t| t.dtype).collect();
    in_group(on, world, |rank, dev, comm| {
        let sharding = match sharding {
            Sharding::None => Sharding::None,
            Sharding::ReduceScatter { .. } => Sharding::ReduceScatter { shards: world, rank },
            Sharding::Accumulate { .. } => Sharding::Accumulate { shards: world, rank },
        };
        let accumulate = matches!(sharding, Sharding::Accumulate { .. });
        let config = AccumulatorConfig {
            overflow: Overflow::DropMicrobatch,
            tensor_stats: true,
            max_grad_norm: 0.5,
            sharding,
            ..Default::default()
        };
        let acc = dev.accumulator_over(config, tensors, comm);
        let step_comm = match sharding {
            Sharding::ReduceScatter { .. } => Some(&**comm),
            _ => None,
        };
        // One that backs off on the first overflow, one that tolerates one, one at its minimum.
        let scalers = [(8.0, 1), (8.0, 2), (1.0, 1)].map(|(init_scale, hysteresis)| {
            dev.scaler(ScalerConfig {
                init_scale,
                hysteresis,
                growth_interval: 3,
                min_scale: 1.0,
                ..Default::default()
            })
        });
        let grads = |poison: Option<usize>| -> Vec<(Vec<f32>, Vec<u16>)> {
            (0..tensors.len())
                .map(|t| {
                    let mut values: Vec<f32> =
                        (0..tensors[t].numel).map(|i| (i % 7) as f32 + 1.0).collect();
                    if poison == Some(t) {
                        values[rank % tensors[t].numel] = [f32::INFINITY, f32::NAN][t % 2];
                    }
                    encode(tensors[t].dtype, &values, 8.0)
                })
                .collect()
        };
        let whole = |poison: Option<usize>, count: u64| {
            let g = grads(poison);
            dev.add(&acc, &scalers[0], &dtypes, &g.iter().collect::<Vec<_>>(), count);
        };

        let mut model = dev.model(tensors);
        let opt = dev.optimizer(&acc, &model);
        whole(None, 4);
        assert!(!acc.sync(Some(&**comm)).unwrap().found_inf);
        for s in &scalers {
            assert_eq!(s.update_from(&[&acc], true).unwrap(), Some(false));
        }
        assert_ne!(dev.step(&opt, &acc, &mut model, step_comm), Some(false));
        let (saved, steps, weights) = (opt.save().unwrap(), opt.steps(), dev.weight_bits(&model));

        whole(Some(if rank + 1 == world { 1 } else { 2 }), 2);
        acc.begin_microbatch(3).unwrap();
        let g = grads((!accumulate || rank == 0).then_some(0));
        for t in (0..tensors.len()).rev() {
            dev.add_tensor(&acc, &scalers[0], t, dtypes[t], &g[t]);
        }
        acc.end_microbatch().unwrap();
        whole(Some(2), 1);
        let info = acc.sync(Some(&**comm)).unwrap();

        let mut master_bits: Vec<u32> = dev.shard(&acc).iter().map(|v| v.to_bits()).collect();
        if !accumulate {
            for (t, d) in tensors.iter().enumerate() {
                let mut m = vec![1.0f32; d.numel];
                acc.read_master(t, &mut m).unwrap();
                master_bits.extend(m.iter().map(|v| v.to_bits()));
            }
        }
        let stats = acc.tensor_stats().unwrap();
        let scalers = scalers
            .iter()
            .map(|s| {
                let before = s.state().unwrap();
                let update = s.update_from(&[&acc], true).map_err(|e| e.kind);
                (update, before, s.state().unwrap())
            })
            .collect();
        let stepped = dev.step(&opt, &acc, &mut model, step_comm);
        let optimizer_kept = opt.save().unwrap() == saved
            && opt.steps() == steps
            && dev.weight_bits(&model) == weights;

        whole(None, 5);
        let next = acc.sync(Some(&**comm)).unwrap();
        Dropped { info, master_bits, stats, scalers, stepped, optimizer_kept, next }
    })
}

/// What every rank must see after [`drop_everything`].
fn check_dropped_everything(on: On, world: usize, sharding: Sharding) {
    let accumulate = matches!(sharding, Sharding::Accumulate { .. });
    let w = world as u64;
    for (rank, d) in drop_everything(on, world, sharding).iter().enumerate() {
        let what = format!("{on:?}, world {world}, {sharding:?}, rank {rank}");
        // Nothing kept: no items, no micro-batches, a norm of 0 and no clipping, every drop
        // counted, the first place named.
        let place = OverflowAt::Gradient { rank: world - 1, microbatch: 0, tensor: 1 };
        let info = SyncInfo {
            found_inf: true,
            total_count: 0,
            microbatches: 0,
            grad_norm: 0.0,
            clip_coef: 1.0,
            dropped_microbatches: 3 * w,
            overflow: Some(place),
        };
        assert_eq!(d.info, info, "{what}");
        assert!(d.master_bits.iter().all(|&b| b == 0), "{what}: the master is not +0.0 throughout");
        let nonfinite = [if accumulate { 1 } else { w }, 1, 2 * w - 1];
        let stats: Vec<(f64, u64)> =
            d.stats.iter().map(|s| (s.grad_norm, s.nonfinite_microbatches)).collect();
        assert_eq!(stats, nonfinite.map(|n| (0.0, n)), "{what}: tensor stats");

        // One update per window, whatever the number of drops: a skipped step, one overflow.
        let [backs_off, tolerates, at_minimum] = &d.scalers[..] else { unreachable!() };
        let after = |before: &ScalerState, scale, hysteresis_tracker, backoffs| ScalerState {
            scale,
            growth_tracker: 0,
            hysteresis_tracker,
            stats: ScalerStats {
                steps: before.stats.steps + 1,
                skipped_steps: before.stats.skipped_steps + 1,
                backoffs: before.stats.backoffs + backoffs,
                ..before.stats
            },
        };
        assert_eq!(backs_off.0, Ok(Some(true)), "{what}");
        assert_eq!(backs_off.2, after(&backs_off.1, 4.0, 0, 1), "{what}: backs off once");
        assert_eq!(tolerates.0, Ok(Some(true)), "{what}");
        assert_eq!(tolerates.2, after(&tolerates.1, 8.0, 1, 0), "{what}: one overflow tolerated");
        assert_eq!(at_minimum.0, Err(ErrorKind::ScaleAtMinimum), "{what}");
        assert_eq!(at_minimum.2, at_minimum.1, "{what}: a refused update changes nothing");

        assert_ne!(d.stepped, Some(true), "{what}: the optimizer stepped");
        assert!(d.optimizer_kept, "{what}: the skipped step changed the optimizer or the model");
        assert_eq!(
            (d.next.found_inf, d.next.total_count, d.next.microbatches),
            (false, 5 * w, w),
            "{what}: the next window"
        );
        assert_eq!((d.next.dropped_microbatches, d.next.overflow), (0, None), "{what}");
    }
}

const POLICIES: [Sharding; 3] = [
    Sharding::None,
    Sharding::ReduceScatter { shards: 1, rank: 0 },
    Sharding::Accumulate { shards: 1, rank: 0 },
];

/// A window that drops every micro-batch on every rank, on 1 to 3 ranks under every sharding
/// policy: docs/overflow.md's "A window that drops everything", field by field.
#[test]
fn a_window_that_drops_everything_is_one_skipped_step() {
    for world in 1..=3 {
        for sharding in POLICIES {
            check_dropped_everything(On::Cpu, world, sharding);
        }
    }
}

/// The same on CUDA, one device per rank over NCCL (3 ranks in a child process on the software
/// GPU).
#[test]
fn a_window_that_drops_everything_is_one_skipped_step_on_cuda() {
    let Some(devices) = cuda_ranks() else { return };
    let name = "a_window_that_drops_everything_is_one_skipped_step_on_cuda";
    let run = |max_world: usize| {
        for world in 1..=max_world {
            for sharding in POLICIES {
                check_dropped_everything(On::Cuda, world, sharding);
            }
        }
    };
    match std::env::var("GRADACC_SIMGPU").as_deref() {
        Ok("1") => common::cuda::at_devices(3, devices as i32, name, |_| run(3)),
        _ => run(devices.min(3)),
    }
}

/// A finite gradient that overflows once unscaled and weighted is non-finite too: the check uses
/// the add's own multiply.
#[test]
fn a_value_that_overflows_when_weighted_is_dropped() {
    let tensors = [TensorDesc { numel: 2, dtype: Dtype::F32 }];
    let config = AccumulatorConfig { overflow: Overflow::DropMicrobatch, ..Default::default() };
    let acc = Accumulator::new(config, &tensors).unwrap();
    let scaler = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
    acc.add(&scaler, &[Grad::F32(&[1.0, 3.0e38])], 1).unwrap();
    // Weighted by its count of 8 (a mean-reduced loss normalised by the count), 3e38 overflows.
    acc.add(&scaler, &[Grad::F32(&[1.0, 3.0e38])], 8).unwrap();
    let info = acc.sync(None).unwrap();
    assert_eq!((info.microbatches, info.dropped_microbatches, info.found_inf), (1, 1, false));
    assert_eq!(info.overflow, Some(OverflowAt::Gradient { rank: 0, microbatch: 1, tensor: 0 }));
    assert_eq!(acc.with_master(0, |m| m.to_vec()).unwrap(), [1.0, 3.0e38]);
}

/// A hybrid boundary (2 shard groups of 2 ranks) drops, reports and measures as one group of the
/// four ranks does: the place's rank is replica rank times 2 plus shard rank.
const HYBRID_TENSORS: [TensorDesc; 3] = [
    TensorDesc { numel: 5000, dtype: Dtype::Bf16 },
    TensorDesc { numel: 3, dtype: Dtype::F32 },
    TensorDesc { numel: 9000, dtype: Dtype::F16 },
];

/// Rank `g`'s two micro-batches of the hybrid tests: rank 3's second holds a NaN in tensor 1.
fn hybrid_feed(g: usize, dev: &Dev, acc: &Accumulator) {
    let scaler = dev.scaler(ScalerConfig { init_scale: 4.0, ..Default::default() });
    let dtypes: Vec<Dtype> = HYBRID_TENSORS.iter().map(|t| t.dtype).collect();
    for m in 0..2 {
        let value = |i: usize| ((g * 7 + m * 3 + i) % 11) as f32 - 5.0;
        let a = (Vec::new(), (0..5000).map(|i| to_bf16(value(i))).collect());
        let mut b: (Vec<f32>, Vec<u16>) = ((0..3).map(value).collect(), Vec::new());
        let c = (Vec::new(), (0..9000).map(|i| to_f16(value(i) * 0.5)).collect());
        if (g, m) == (3, 1) {
            b.0[2] = f32::NAN;
        }
        dev.add(acc, &scaler, &dtypes, &[&a, &b, &c], 1 + m as u64);
    }
}

/// A hybrid boundary on CUDA (NCCL shard and replica groups, 2 x 2) drops, reports and measures
/// as the CPU's does, under reduce-scatter and under sharded accumulation: the same place, counts
/// and, on the software GPU, the same bits.
#[test]
fn a_hybrid_boundary_drops_on_cuda_as_on_the_cpu() {
    let Some(devices) = cuda_ranks() else { return };
    let name = "a_hybrid_boundary_drops_on_cuda_as_on_the_cpu";
    common::cuda::at_devices(4, devices as i32, name, |_| {
        hybrid_on_cuda(false);
        hybrid_on_cuda(true);
    });
}

/// Every rank's (report, shard, stats) of the hybrid window of `hybrid_feed` on `on`, rank g on
/// its own thread as replica `g / 2` of shard `g % 2`, in `groups(g)`: its shard group and its
/// replica group.
fn hybrid_ranks(
    on: On,
    config: AccumulatorConfig,
    accumulate: bool,
    groups: &(dyn Fn(usize) -> (Arc<dyn Communicator>, Arc<dyn Communicator>) + Sync),
) -> Vec<(SyncInfo, Vec<f32>, Vec<TensorStats>)> {
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|g| {
                s.spawn(move || {
                    let dev = Dev::of(on, g);
                    let (shard, replicas) = groups(g);
                    let sharding = match accumulate {
                        true => Sharding::Accumulate { shards: 2, rank: g % 2 },
                        false => Sharding::ReduceScatter { shards: 2, rank: g % 2 },
                    };
                    let config = AccumulatorConfig { sharding, ..config };
                    let acc = dev.accumulator_over(config, &HYBRID_TENSORS, &shard);
                    hybrid_feed(g, &dev, &acc);
                    let info = acc.sync_hybrid(&*shard, &*replicas).unwrap();
                    (info, dev.shard(&acc), acc.tensor_stats().unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// [`hybrid_ranks`] on the CPU, over in-process groups.
fn cpu_hybrid(
    config: AccumulatorConfig,
    accumulate: bool,
) -> Vec<(SyncInfo, Vec<f32>, Vec<TensorStats>)> {
    let arcs = |group: Vec<LocalComm>| {
        group.into_iter().map(|c| Some(Arc::new(c) as Arc<dyn Communicator>)).collect()
    };
    // Shard group a holds replica a's two shards; replica group 2 + i every replica of shard i.
    type Handles = Mutex<Vec<Option<Arc<dyn Communicator>>>>;
    let local: Vec<Handles> =
        (0..4).map(|_| Mutex::new(arcs(LocalComm::group(2).unwrap()))).collect();
    hybrid_ranks(On::Cpu, config, accumulate, &|g| {
        let take = |k: usize, at: usize| local[k].lock().unwrap()[at].take().unwrap();
        (take(g / 2, g % 2), take(2 + g % 2, g / 2))
    })
}

fn hybrid_on_cuda(accumulate: bool) {
    let config = AccumulatorConfig {
        overflow: Overflow::DropMicrobatch,
        tensor_stats: true,
        max_grad_norm: 1.0,
        ..Default::default()
    };
    let cpu = cpu_hybrid(config, accumulate);
    let shard_ids: Vec<_> = (0..2).map(|_| nccl_unique_id().unwrap()).collect();
    let replica_ids: Vec<_> = (0..2).map(|_| nccl_unique_id().unwrap()).collect();
    let cuda = hybrid_ranks(On::Cuda, config, accumulate, &|g| {
        let (a, i) = (g / 2, g % 2);
        let shard = NcclComm::new(&shard_ids[a], i, 2, g as i32).unwrap();
        let replicas = NcclComm::new(&replica_ids[i], a, 2, g as i32).unwrap();
        for c in [&shard, &replicas] {
            Communicator::set_timeout(c, Some(Duration::from_secs(120))).unwrap();
        }
        (Arc::new(shard) as Arc<dyn Communicator>, Arc::new(replicas) as Arc<dyn Communicator>)
    });
    let exact = std::env::var("GRADACC_SIMGPU").as_deref() == Ok("1");
    for (g, ((got, got_shard, got_stats), (want, want_shard, want_stats))) in
        cuda.iter().zip(&cpu).enumerate()
    {
        assert_eq!(got.overflow, Some(OverflowAt::Gradient { rank: 3, microbatch: 1, tensor: 1 }));
        assert_eq!(
            (got.dropped_microbatches, got.microbatches, got.total_count, got.found_inf),
            (want.dropped_microbatches, want.microbatches, want.total_count, want.found_inf),
            "rank {g}"
        );
        assert_eq!((got.dropped_microbatches, got.found_inf), (1, false), "rank {g}");
        let close = |a: f64, b: f64| a == b || !exact && (a - b).abs() <= 1e-6 * b.abs();
        assert!(close(got.grad_norm, want.grad_norm), "rank {g}: {got:?} vs {want:?}");
        assert!(close(got.clip_coef, want.clip_coef), "rank {g}: {got:?} vs {want:?}");
        assert_eq!(got_shard.len(), want_shard.len(), "rank {g}");
        for (t, (a, b)) in got_stats.iter().zip(want_stats).enumerate() {
            assert_eq!(a.nonfinite_microbatches, b.nonfinite_microbatches, "rank {g} tensor {t}");
            assert_eq!(a.nonfinite_microbatches, (t == 1) as u64, "rank {g} tensor {t}");
            assert!(close(a.grad_norm, b.grad_norm), "rank {g} tensor {t}: {a:?} vs {b:?}");
        }
        for (k, (a, b)) in got_shard.iter().zip(want_shard).enumerate() {
            assert!(
                close(*a as f64, *b as f64),
                "rank {g} shard element {k}: CUDA {a:e}, CPU {b:e}"
            );
        }
    }
}

#[test]
fn a_hybrid_boundary_reports_and_measures_as_the_whole_group() {
    let tensors = HYBRID_TENSORS;
    let feed_rank = |g: usize, acc: &Accumulator| hybrid_feed(g, &Dev::Cpu, acc);
    let config = AccumulatorConfig {
        overflow: Overflow::DropMicrobatch,
        tensor_stats: true,
        max_grad_norm: 1.0,
        ..Default::default()
    };
    let comms = LocalComm::group(4).unwrap();
    let whole: Vec<(SyncInfo, Vec<TensorStats>)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(g, comm)| {
                s.spawn(move || {
                    let acc = Accumulator::new(config, &tensors).unwrap();
                    feed_rank(g, &acc);
                    (acc.sync(Some(comm)).unwrap(), acc.tensor_stats().unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (info, stats) = &whole[0];
    assert_eq!(info.overflow, Some(OverflowAt::Gradient { rank: 3, microbatch: 1, tensor: 1 }));
    assert_eq!((info.dropped_microbatches, info.microbatches, info.found_inf), (1, 7, false));
    // Under reduce-scatter and under sharded accumulation, whose replicas all-reduce the shard
    // share by share.
    for accumulate in [false, true] {
        let hybrid = cpu_hybrid(config, accumulate);
        for (g, (h, _, hs)) in hybrid.iter().enumerate() {
            let what = format!("rank {g}, accumulate {accumulate}");
            assert_eq!((h.overflow, h.dropped_microbatches), (info.overflow, 1), "{what}");
            assert_eq!((h.total_count, h.microbatches), (info.total_count, info.microbatches));
            assert_eq!(hs, &hybrid[0].2, "{what}: the stats differ from rank 0's");
            for (t, (a, b)) in hs.iter().zip(stats).enumerate() {
                assert_eq!(a.nonfinite_microbatches, b.nonfinite_microbatches, "tensor {t}");
                assert_eq!(a.nonfinite_microbatches, (t == 1) as u64, "tensor {t}");
                assert!(
                    (a.grad_norm - b.grad_norm).abs() <= 1e-6 * b.grad_norm,
                    "{what}, tensor {t}: hybrid {} vs the whole group {}",
                    a.grad_norm,
                    b.grad_norm
                );
            }
        }
    }
}

/// A loaded window replaces the drops, places and counts of the one it replaces; a window saved
/// with a non-finite value comes back with its place unknown, not blamed on a later clean
/// micro-batch.
#[test]
fn a_loaded_window_carries_its_own_overflow_state_only() {
    let tensors = [TensorDesc { numel: 3, dtype: Dtype::F32 }];
    let scaler = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
    let (clean, bad) = ([1.0f32, 2.0, 3.0], [1.0f32, f32::NAN, 3.0]);
    for overflow in [Overflow::SkipStep, Overflow::DropMicrobatch] {
        let config = AccumulatorConfig { overflow, tensor_stats: true, ..Default::default() };
        let saver = Accumulator::new(config, &tensors).unwrap();
        saver.add(&scaler, &[Grad::F32(&clean)], 1).unwrap();
        let clean_window = saver.save_window().unwrap();
        let acc = Accumulator::new(config, &tensors).unwrap();
        acc.add(&scaler, &[Grad::F32(&bad)], 1).unwrap();
        acc.load_window(&clean_window).unwrap();
        let info = acc.sync(None).unwrap();
        assert_eq!((info.found_inf, info.dropped_microbatches, info.overflow), (false, 0, None));
        assert_eq!(acc.tensor_stats().unwrap()[0].nonfinite_microbatches, 0, "{overflow:?}");
        // The same after a synced window that dropped or skipped.
        acc.add(&scaler, &[Grad::F32(&bad)], 1).unwrap();
        acc.add(&scaler, &[Grad::F32(&clean)], 1).unwrap();
        assert!(acc.sync(None).unwrap().overflow.is_some());
        acc.load_window(&clean_window).unwrap();
        let info = acc.sync(None).unwrap();
        assert_eq!((info.dropped_microbatches, info.overflow), (0, None), "{overflow:?}");
    }
    // Saved non-finite (the default policy keeps the NaN in the master): unlocated after a load
    // and after a merge, whatever clean micro-batch follows.
    let saver = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    saver.add(&scaler, &[Grad::F32(&bad)], 1).unwrap();
    let poisoned = saver.save_window().unwrap();
    for merge in [false, true] {
        let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
        if merge {
            acc.merge_window(&poisoned).unwrap();
        } else {
            acc.load_window(&poisoned).unwrap();
        }
        acc.add(&scaler, &[Grad::F32(&clean)], 1).unwrap();
        let info = acc.sync(None).unwrap();
        assert_eq!((info.found_inf, info.overflow), (true, None), "merge {merge}");
    }
}

/// After `load_window`, the place of a micro-batch fed since counts the restored window's kept
/// micro-batches first (its drops were not saved), then every micro-batch fed since the load,
/// dropped ones included; a merged window's kept micro-batches count likewise, after those fed
/// before the merge.
#[test]
fn a_restored_window_counts_its_kept_microbatches_in_later_places() {
    restored_places(On::Cpu, &[Overflow::SkipStep, Overflow::DropMicrobatch]);
}

/// The same on CUDA, under DROP_MICROBATCH (under SKIP_STEP the flag stays on the device).
#[test]
fn a_restored_window_counts_its_kept_microbatches_in_later_places_on_cuda() {
    if cuda_ranks().is_some() {
        restored_places(On::Cuda, &[Overflow::DropMicrobatch]);
    }
}

fn restored_places(on: On, policies: &[Overflow]) {
    let tensors =
        [TensorDesc { numel: 3, dtype: Dtype::F32 }, TensorDesc { numel: 2, dtype: Dtype::F16 }];
    let dtypes = [Dtype::F32, Dtype::F16];
    let dev = Dev::of(on, 0);
    let scaler = dev.scaler(ScalerConfig { init_scale: 1.0, ..Default::default() });
    let clean = [(vec![1.0f32; 3], Vec::new()), (Vec::new(), vec![to_f16(1.0); 2])];
    let mut bad = clean.clone();
    bad[1].1[1] = to_f16(f32::INFINITY);
    // Feeds one micro-batch of one item per entry, poisoned (in tensor 1) where it says so.
    let feed = |acc: &Accumulator, poisoned: &[bool]| {
        for &p in poisoned {
            let g = if p { &bad } else { &clean };
            dev.add(acc, &scaler, &dtypes, &g.iter().collect::<Vec<_>>(), 1);
        }
    };
    for &overflow in policies {
        let drop = overflow == Overflow::DropMicrobatch;
        let config = AccumulatorConfig { overflow, ..Default::default() };
        // Two kept micro-batches, and under DROP_MICROBATCH a dropped one between them.
        let saver = dev.accumulator(config, &tensors);
        feed(&saver, if drop { &[false, true, false] } else { &[false, false] });
        let saved = saver.save_window().unwrap();
        let place = |microbatch| Some(OverflowAt::Gradient { rank: 0, microbatch, tensor: 1 });

        // Restored (2 kept), then a clean and a poisoned one: the poisoned one is micro-batch 3.
        let acc = dev.accumulator(config, &tensors);
        feed(&acc, &[true]);
        acc.load_window(&saved).unwrap();
        feed(&acc, &[false, true]);
        let info = acc.sync(None).unwrap();
        assert_eq!(info.overflow, place(3), "{overflow:?}, after load_window");
        let (microbatches, dropped) = if drop { (3, 1) } else { (4, 0) };
        assert_eq!((info.microbatches, info.dropped_microbatches), (microbatches, dropped));

        // One clean, merged (2 kept), then a clean and a poisoned one: micro-batch 4.
        let acc = dev.accumulator(config, &tensors);
        feed(&acc, &[false]);
        acc.merge_window(&saved).unwrap();
        feed(&acc, &[false, true]);
        let info = acc.sync(None).unwrap();
        assert_eq!(info.overflow, place(4), "{overflow:?}, after merge_window");
        assert_eq!(info.dropped_microbatches, dropped, "{overflow:?}, after merge_window");
    }
}

/// A restored window's unknown place may be the group's first, so it is never beaten by a later,
/// located one: rank 0 restores a window saved with an inf in tensor 0 and adds a clean
/// micro-batch, rank 1 adds a clean micro-batch and then one with an inf in tensor 1. Every rank
/// reports the overflow unlocated, under all-reduce and reduce-scatter boundaries.
#[test]
fn a_restored_unknown_place_is_not_beaten_by_a_later_one() {
    let tensors =
        [TensorDesc { numel: 3, dtype: Dtype::F32 }, TensorDesc { numel: 2, dtype: Dtype::F32 }];
    let (clean, bad) = ([1.0f32, 2.0, 3.0], [1.0f32, f32::INFINITY, 3.0]);
    let (clean1, bad1) = ([4.0f32, 5.0], [f32::INFINITY, 5.0]);
    let scaler = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
    let saver = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
    saver.add(&scaler, &[Grad::F32(&bad), Grad::F32(&clean1)], 1).unwrap();
    let poisoned = saver.save_window().unwrap();
    for sharding in [Sharding::None, Sharding::ReduceScatter { shards: 2, rank: 0 }] {
        let comms = LocalComm::group(2).unwrap();
        let infos: Vec<SyncInfo> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .map(|comm| {
                    let poisoned = &poisoned;
                    s.spawn(move || {
                        let sharding = match sharding {
                            Sharding::ReduceScatter { shards, .. } => {
                                Sharding::ReduceScatter { shards, rank: comm.rank() }
                            }
                            other => other,
                        };
                        let config = AccumulatorConfig { sharding, ..Default::default() };
                        let acc = Accumulator::new(config, &tensors).unwrap();
                        let scaler =
                            Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() })
                                .unwrap();
                        if comm.rank() == 0 {
                            acc.load_window(poisoned).unwrap();
                            acc.add(&scaler, &[Grad::F32(&clean), Grad::F32(&clean1)], 1).unwrap();
                        } else {
                            acc.add(&scaler, &[Grad::F32(&clean), Grad::F32(&clean1)], 1).unwrap();
                            acc.add(&scaler, &[Grad::F32(&clean), Grad::F32(&bad1)], 1).unwrap();
                        }
                        acc.sync(Some(comm)).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, info) in infos.iter().enumerate() {
            assert_eq!((info.found_inf, info.overflow), (true, None), "{sharding:?}, rank {rank}");
        }
    }
}

/// Under DROP_MICROBATCH on CUDA the final micro-batch is staged like any other (its buckets are
/// not reduced early): a poisoned one is dropped on its rank, a clean one lands whole, and
/// `sync` over the same communicator completes the boundary.
#[test]
fn a_final_microbatch_is_staged_on_cuda() {
    if !cuda_ranks().is_some_and(|d| common::cuda::enough_devices(2, d as i32)) {
        return;
    }
    let tensors =
        [TensorDesc { numel: 5, dtype: Dtype::F32 }, TensorDesc { numel: 3, dtype: Dtype::Bf16 }];
    let config = AccumulatorConfig {
        overflow: Overflow::DropMicrobatch,
        loss_reduction: LossReduction::Sum,
        normalize: Normalize::None,
        bucket_numel: 4,
        ..Default::default()
    };
    let id = nccl_unique_id().unwrap();
    let results: Vec<(SyncInfo, Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    let dev = Dev::of(On::Cuda, rank);
                    let comm: Arc<dyn Communicator> =
                        Arc::new(NcclComm::new(&id, rank, 2, rank as i32).unwrap());
                    comm.set_timeout(Some(Duration::from_secs(120))).unwrap();
                    let acc = dev.accumulator(config, &tensors);
                    let scaler = dev.scaler(ScalerConfig { init_scale: 1.0, ..Default::default() });
                    let a = (vec![1.0f32; 5], Vec::new());
                    let b = (Vec::new(), vec![to_bf16(2.0); 3]);
                    dev.add(&acc, &scaler, &[Dtype::F32, Dtype::Bf16], &[&a, &b], 1);
                    // Rank 1's final micro-batch holds an inf in tensor 1's second chunk.
                    let last =
                        (Vec::new(), vec![to_bf16(if rank == 1 { f32::INFINITY } else { 4.0 }); 3]);
                    acc.begin_final_microbatch(1, comm.clone()).unwrap();
                    dev.add_tensor(&acc, &scaler, 0, Dtype::F32, &a);
                    dev.add_tensor(&acc, &scaler, 1, Dtype::Bf16, &b);
                    dev.add_tensor(&acc, &scaler, 1, Dtype::Bf16, &last);
                    acc.end_microbatch().unwrap();
                    let info = acc.sync(Some(&*comm)).unwrap();
                    let (mut m0, mut m1) = (vec![0f32; 5], vec![0f32; 3]);
                    acc.read_master(0, &mut m0).unwrap();
                    acc.read_master(1, &mut m1).unwrap();
                    (info, m0, m1)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (info, m0, m1)) in results.iter().enumerate() {
        assert_eq!((info.microbatches, info.dropped_microbatches, info.found_inf), (3, 1, false));
        let place = OverflowAt::Gradient { rank: 1, microbatch: 1, tensor: 1 };
        assert_eq!(info.overflow, Some(place), "rank {rank}");
        // Both first micro-batches and rank 0's final one: a + a + a, and b + b + (b + 4).
        assert_eq!(m0, &[3.0; 5], "rank {rank}");
        assert_eq!(m1, &[10.0; 3], "rank {rank}");
    }
}

/// Under SKIP_STEP on CUDA the per-tensor counts stay on the device: each micro-batch counts once
/// per tensor however many chunks went bad, and a reset or loaded window starts from none.
#[test]
fn skip_step_counts_on_cuda_follow_the_window() {
    if cuda_ranks().is_none() {
        return;
    }
    let tensors =
        [TensorDesc { numel: 3, dtype: Dtype::F32 }, TensorDesc { numel: 2, dtype: Dtype::F16 }];
    let config = AccumulatorConfig { tensor_stats: true, ..Default::default() };
    let dev = Dev::of(On::Cuda, 0);
    let scaler = dev.scaler(ScalerConfig { init_scale: 1.0, ..Default::default() });
    let acc = dev.accumulator(config, &tensors);
    let clean = [(vec![1.0f32, 2.0, 3.0], Vec::new()), (Vec::new(), vec![to_f16(1.0); 2])];
    let bad = (vec![1.0f32, f32::NAN, 3.0], Vec::new());
    let counts = |acc: &Accumulator| -> Vec<u64> {
        acc.sync(None).unwrap();
        acc.tensor_stats().unwrap().iter().map(|s| s.nonfinite_microbatches).collect()
    };
    let saver = dev.accumulator(config, &tensors);
    dev.add(&saver, &scaler, &[Dtype::F32, Dtype::F16], &[&clean[0], &clean[1]], 1);
    let clean_window = saver.save_window().unwrap();
    // Two chunks of tensor 0 go bad in one hook micro-batch: one count.
    acc.begin_microbatch(1).unwrap();
    dev.add_tensor(&acc, &scaler, 0, Dtype::F32, &bad);
    dev.add_tensor(&acc, &scaler, 0, Dtype::F32, &bad);
    dev.add_tensor(&acc, &scaler, 1, Dtype::F16, &clean[1]);
    acc.end_microbatch().unwrap();
    dev.add(&acc, &scaler, &[Dtype::F32, Dtype::F16], &[&bad, &clean[1]], 1);
    // A reset inside a micro-batch discards the window and its counts.
    acc.begin_microbatch(1).unwrap();
    dev.add_tensor(&acc, &scaler, 0, Dtype::F32, &bad);
    acc.reset().unwrap();
    dev.add(&acc, &scaler, &[Dtype::F32, Dtype::F16], &[&bad, &clean[1]], 1);
    acc.begin_microbatch(1).unwrap();
    dev.add_tensor(&acc, &scaler, 0, Dtype::F32, &bad);
    acc.end_microbatch().unwrap();
    assert_eq!(counts(&acc), [2, 0]);
    // A loaded window brings no counts; the next window starts from none.
    dev.add(&acc, &scaler, &[Dtype::F32, Dtype::F16], &[&bad, &clean[1]], 1);
    acc.load_window(&clean_window).unwrap();
    assert_eq!(counts(&acc), [0, 0]);
    dev.add(&acc, &scaler, &[Dtype::F32, Dtype::F16], &[&clean[0], &clean[1]], 1);
    assert_eq!(counts(&acc), [0, 0]);
}

/// A rank that syncs twice in a row takes part with an empty window: its last window's overflow
/// is not this one's, so a sum that overflows from finite windows is the reduction's.
#[test]
fn an_idle_rank_does_not_bring_its_last_overflow() {
    let tensors = [TensorDesc { numel: 2, dtype: Dtype::F32 }];
    let config = AccumulatorConfig {
        loss_reduction: LossReduction::Sum,
        normalize: Normalize::None,
        ..Default::default()
    };
    let comms = LocalComm::group(3).unwrap();
    let infos: Vec<(SyncInfo, SyncInfo)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .map(|comm| {
                s.spawn(move || {
                    let acc = Accumulator::new(config, &tensors).unwrap();
                    let scaler =
                        Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() })
                            .unwrap();
                    let first = if comm.rank() == 0 { f32::INFINITY } else { 1.0 };
                    acc.add(&scaler, &[Grad::F32(&[first, 1.0])], 1).unwrap();
                    let a = acc.sync(Some(comm)).unwrap();
                    if comm.rank() > 0 {
                        acc.add(&scaler, &[Grad::F32(&[3.0e38, 1.0])], 1).unwrap();
                    }
                    (a, acc.sync(Some(comm)).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (a, b)) in infos.iter().enumerate() {
        let place = Some(OverflowAt::Gradient { rank: 0, microbatch: 0, tensor: 0 });
        assert_eq!((a.found_inf, a.overflow), (true, place), "rank {rank}'s first window");
        assert_eq!((b.found_inf, b.overflow), (true, Some(OverflowAt::Reduction)), "rank {rank}");
    }
}

/// A poisoned hook micro-batch that opens a window after an overflowing one is dropped back to
/// the new window's clear flag, not to the last window's.
#[test]
fn a_drop_that_opens_a_window_keeps_its_flag_clear() {
    drop_opening_a_window(On::Cpu);
}

#[test]
fn a_drop_that_opens_a_window_keeps_its_flag_clear_on_cuda() {
    if cuda_ranks().is_some() {
        drop_opening_a_window(On::Cuda);
    }
}

fn drop_opening_a_window(on: On) {
    let tensors = [TensorDesc { numel: 2, dtype: Dtype::F32 }];
    let config = AccumulatorConfig {
        overflow: Overflow::DropMicrobatch,
        sharding: Sharding::Accumulate { shards: 1, rank: 0 },
        loss_reduction: LossReduction::Sum,
        normalize: Normalize::None,
        ..Default::default()
    };
    let dev = Dev::of(on, 0);
    let acc = dev.accumulator(config, &tensors);
    let scaler = dev.scaler(ScalerConfig { init_scale: 1.0, ..Default::default() });
    let grad = |g: [f32; 2]| (g.to_vec(), Vec::new());
    let huge = grad([3.0e38, 1.0]);
    for _ in 0..2 {
        dev.add(&acc, &scaler, &[Dtype::F32], &[&huge], 1);
    }
    // The sum overflowed the shard: the reduction's, on either device (docs/overflow.md).
    let info = acc.sync(None).unwrap();
    assert_eq!((info.found_inf, info.overflow), (true, Some(OverflowAt::Reduction)), "{on:?}");
    for g in [[f32::NAN, 1.0], [1.0, 2.0]] {
        acc.begin_microbatch(1).unwrap();
        dev.add_tensor(&acc, &scaler, 0, Dtype::F32, &grad(g));
        acc.end_microbatch().unwrap();
    }
    let info = acc.sync(None).unwrap();
    assert_eq!((info.found_inf, info.dropped_microbatches), (false, 1), "{on:?}: {info:?}");
    assert_eq!(dev.shard(&acc)[..2], [1.0, 2.0], "{on:?}");
}
