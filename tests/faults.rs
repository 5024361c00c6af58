//! Peer failures on the in-process communicator: ranks that leave, never arrive, or are aborted,
//! before and in the middle of the boundary; later calls on a failed group; and an elastic resume
//! of saved windows on fewer ranks (fresh seed each run).

mod common;

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use gradacc::comm::{BlockPass, HostCollectives};
use gradacc::{
    Accumulator, AccumulatorConfig, Communicator, Dtype, Error, ErrorKind, Grad, LocalComm,
    LossReduction, Normalize, Scaler, ScalerConfig, Sharding, TensorDesc,
};

/// How long a waiting rank may take to notice a failure that has happened.
const PROMPT: Duration = Duration::from_secs(1);

/// A group whose handles give up after `timeout`, so a broken wake-up fails the test instead of
/// hanging it.
fn group(world: usize, timeout: Duration) -> Vec<LocalComm> {
    let comms = LocalComm::group(world).unwrap();
    for c in &comms {
        c.set_timeout(Some(timeout)).unwrap();
    }
    comms
}

fn unit_scaler() -> Scaler {
    Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap()
}

/// One f32 tensor of small integers: every sum below is exact.
fn add_integers(
    acc: &Accumulator,
    rank: usize,
    microbatches: usize,
    numel: usize,
) -> (Vec<f32>, u64) {
    let scaler = unit_scaler();
    let mut want = vec![0f32; numel];
    let mut count = 0;
    for k in 0..microbatches {
        let n = (k + rank + 1) as u64;
        let g: Vec<f32> = (0..numel).map(|i| ((i * 3 + rank * 5 + k) % 7) as f32 - 3.0).collect();
        acc.add(&scaler, &[Grad::F32(&g)], n).unwrap();
        // Mean-reduced micro-batches normalised by count are weighted by their count.
        want.iter_mut().zip(&g).for_each(|(w, v)| *w += v * n as f32);
        count += n;
    }
    (want, count)
}

fn assert_comm_failure(e: &Error, naming: &str) {
    assert_eq!(e.kind, ErrorKind::CommFailure, "{}", e.message);
    assert!(e.message.contains(naming), "`{}` does not name `{naming}`", e.message);
}

#[test]
fn a_rank_that_exits_before_the_boundary_fails_the_others_with_their_windows_intact() {
    let numel = 1001;
    let tensors = [TensorDesc { numel, dtype: Dtype::F32 }];
    let comms = group(3, Duration::from_secs(5));
    std::thread::scope(|s| {
        for comm in comms {
            s.spawn(move || {
                let rank = comm.rank();
                let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                let (want, count) = add_integers(&acc, rank, 2 + rank, numel);
                if rank == 2 {
                    // This rank exits before the boundary: its communicator and window go away.
                    std::thread::sleep(Duration::from_millis(100));
                    drop(comm);
                    drop(acc);
                    return;
                }
                let before = acc.save_window().unwrap();
                let t = Instant::now();
                let e = acc.sync(Some(&comm)).unwrap_err();
                assert!(
                    t.elapsed() < PROMPT,
                    "rank {rank} noticed the exit after {:?}",
                    t.elapsed()
                );
                assert_comm_failure(&e, "rank 2 left the group");
                assert!(e.message.contains("control exchange"), "{}", e.message);
                assert!(e.message.contains("window is intact"), "{}", e.message);

                // The window is intact: the same bytes, the same master, and it still syncs alone.
                let after = acc.save_window().unwrap();
                assert_eq!(before, after, "rank {rank}: the failed boundary changed the window");
                acc.with_master(0, |m| assert_eq!(m, &want[..], "rank {rank}")).unwrap();
                let alone = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                alone.load_window(&after).unwrap();
                let info = alone.sync(None).unwrap();
                assert_eq!((info.total_count, info.microbatches), (count, 2 + rank as u64));

                // Every later collective fails the same way.
                let e = acc.sync(Some(&comm)).unwrap_err();
                assert_comm_failure(&e, "rank 2 left the group");
            });
        }
    });
}

#[test]
fn a_rank_that_never_arrives_times_out_the_waiting_ranks() {
    let timeout = Duration::from_millis(300);
    let tensors = [TensorDesc { numel: 77, dtype: Dtype::F32 }];
    let comms = group(3, Duration::from_secs(5));
    // Rank 0 gives up first; rank 1 would wait longer, but learns of the timeout at once.
    comms[0].set_timeout(Some(timeout)).unwrap();
    assert_eq!(comms[0].timeout(), Some(timeout));
    let start = Instant::now();
    std::thread::scope(|s| {
        for comm in &comms {
            s.spawn(move || {
                let rank = comm.rank();
                let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                add_integers(&acc, rank, 1, 77);
                if rank == 2 {
                    // Keeps its handle, but arrives long after the others gave up.
                    std::thread::sleep(timeout * 3);
                    let e = acc.sync(Some(comm)).unwrap_err();
                    assert_comm_failure(&e, "rank 0 timed out");
                    return;
                }
                let e = acc.sync(Some(comm)).unwrap_err();
                let waited = start.elapsed();
                assert!(waited < timeout + PROMPT, "rank {rank} returned after {waited:?}");
                if rank == 0 {
                    assert_eq!(e.kind, ErrorKind::Timeout, "{}", e.message);
                    assert!(waited >= timeout, "rank 0 gave up after {waited:?}");
                    for part in [
                        "control exchange",
                        "did not complete within the timeout of 300ms (waited 3",
                        "rank 2 had not arrived",
                        "window is intact",
                    ] {
                        assert!(e.message.contains(part), "`{}` does not say `{part}`", e.message);
                    }
                } else {
                    assert_comm_failure(&e, "rank 0 timed out");
                    assert!(e.message.contains("waiting for rank 2"), "{}", e.message);
                }
                acc.save_window().unwrap();
            });
        }
    });
}

#[test]
fn abort_from_another_thread_wakes_every_waiting_rank() {
    let tensors = [TensorDesc { numel: 4096, dtype: Dtype::F16 }];
    let comms = group(4, Duration::from_secs(5));
    let start = Instant::now();
    std::thread::scope(|s| {
        // Ranks 0..3 wait at the boundary for rank 3, which never comes.
        for comm in &comms[..3] {
            s.spawn(move || {
                let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                let scaler = Scaler::new(ScalerConfig::default()).unwrap();
                acc.add(&scaler, &[Grad::f16_bits(&[to_f16(0.5); 4096])], 3).unwrap();
                let e = acc.sync(Some(comm)).unwrap_err();
                assert!(
                    start.elapsed() < Duration::from_millis(100) + PROMPT,
                    "returned after {:?}",
                    start.elapsed()
                );
                assert_comm_failure(&e, "aborted by rank 3");
            });
        }
        // A thread that is no rank aborts rank 3's handle.
        let comm = &comms[3];
        s.spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            comm.abort().unwrap();
            comm.abort().unwrap(); // idempotent
        });
    });
    // Rank 3 itself, and every rank again, fail the same way.
    for c in &comms {
        assert_comm_failure(
            &c.reduce_control(&Default::default()).unwrap_err(),
            "aborted by rank 3",
        );
    }
}

/// Wraps a rank's communicator and aborts the group in the middle of the boundary's reduction:
/// just before the pass over its `at`-th share (counted from 0), with peers reading its buffer.
struct AbortAt {
    inner: LocalComm,
    at: usize,
    calls: AtomicUsize,
}

impl Communicator for AbortAt {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn host(&self) -> Option<&dyn HostCollectives> {
        Some(self)
    }
    fn abort(&self) -> gradacc::Result<()> {
        self.inner.abort()
    }
}

impl HostCollectives for AbortAt {
    fn reduce_control(
        &self,
        mine: &gradacc::comm::ControlSum,
    ) -> gradacc::Result<gradacc::comm::ControlSum> {
        self.inner.reduce_control(mine)
    }
    fn allreduce_sum(&self, buf: &mut [f32]) -> gradacc::Result<()> {
        self.inner.allreduce_sum(buf)
    }
    fn allreduce_with_pass(
        &self,
        buf: &mut [f32],
        buckets: &[Range<usize>],
        pass: &dyn BlockPass,
    ) -> gradacc::Result<Vec<f64>> {
        self.inner.allreduce_with_pass(buf, buckets, &AbortingPass { at: self, inner: pass })
    }
    fn reduce_scatter_with_pass(
        &self,
        buf: &mut [f32],
        shards: &[Range<usize>],
        pass: &dyn BlockPass,
    ) -> gradacc::Result<Vec<f64>> {
        self.inner.reduce_scatter_with_pass(buf, shards, &AbortingPass { at: self, inner: pass })
    }
    fn allgather_values(&self, mine: &[f64], counts: &[usize]) -> gradacc::Result<Vec<f64>> {
        self.inner.allgather_values(mine, counts)
    }
}

/// The boundary's pass, counting its calls on the wrapper and aborting at the wrapper's `at`.
struct AbortingPass<'a> {
    at: &'a AbortAt,
    inner: &'a dyn BlockPass,
}

impl AbortingPass<'_> {
    fn count(&self) {
        if self.at.calls.fetch_add(1, Ordering::Relaxed) == self.at.at {
            self.at.inner.abort().unwrap();
        }
    }
}

impl BlockPass for AbortingPass<'_> {
    fn run(&self, run: &mut [f32], values: &mut [f64]) {
        self.count();
        self.inner.run(run, values)
    }
    fn add_and_run(&self, run: &mut [f32], addend: &[f32], values: &mut [f64]) {
        self.count();
        self.inner.add_and_run(run, addend, values)
    }
    fn rescales(&self) -> bool {
        self.inner.rescales()
    }
    fn rescale(&self, values: &[f64]) -> Option<f32> {
        self.inner.rescale(values)
    }
    fn wire(&self) -> Dtype {
        self.inner.wire()
    }
}

/// 64 tensors of 16K mixed-precision elements, one bucket each.
fn big_layout() -> (Vec<TensorDesc>, AccumulatorConfig) {
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    let tensors =
        (0..64).map(|i| TensorDesc { numel: (16 << 10) + i % 3, dtype: dtypes[i % 3] }).collect();
    (tensors, AccumulatorConfig { bucket_numel: 16 << 10, ..Default::default() })
}

fn add_big(acc: &Accumulator, tensors: &[TensorDesc], rank: usize) {
    try_add_big(acc, tensors, rank).unwrap()
}

fn try_add_big(acc: &Accumulator, tensors: &[TensorDesc], rank: usize) -> gradacc::Result<()> {
    let scaler = unit_scaler();
    let f32s: Vec<Vec<f32>> = tensors
        .iter()
        .map(|t| (0..t.numel).map(|i| (i % 13) as f32 * 0.25 + rank as f32).collect())
        .collect();
    let halves: Vec<Vec<u16>> = tensors
        .iter()
        .zip(&f32s)
        .map(|(t, v)| {
            v.iter().map(|&x| if t.dtype == Dtype::F16 { to_f16(x) } else { to_bf16(x) }).collect()
        })
        .collect();
    let grads: Vec<Grad> =
        tensors.iter().enumerate().map(|(i, t)| grad_of(t.dtype, &f32s[i], &halves[i])).collect();
    acc.add(&scaler, &grads, 2)
}

#[test]
fn abort_in_the_middle_of_the_boundary_reduction_discards_every_window() {
    let (tensors, config) = big_layout();
    let mut comms = group(3, Duration::from_secs(5));
    let plain: Vec<LocalComm> = comms.split_off(1);
    let faulty = AbortAt { inner: comms.pop().unwrap(), at: 3, calls: AtomicUsize::new(0) };
    let ranks: Vec<&dyn Communicator> = std::iter::once(&faulty as &dyn Communicator)
        .chain(plain.iter().map(|c| c as &dyn Communicator))
        .collect();
    std::thread::scope(|s| {
        for comm in ranks {
            let tensors = &tensors;
            s.spawn(move || {
                let rank = comm.rank();
                let acc = Accumulator::new(config, tensors).unwrap();
                add_big(&acc, tensors, rank);
                let t = Instant::now();
                let e = acc.sync(Some(comm)).unwrap_err();
                assert!(t.elapsed() < PROMPT, "rank {rank} returned after {:?}", t.elapsed());
                assert_comm_failure(&e, "aborted by rank 0");
                assert!(e.message.contains("all-reduce of"), "{}", e.message);
                assert!(e.message.ends_with(" (the window was discarded)"), "{}", e.message);
                // The window is gone: nothing is left to sync, and the accumulator works on.
                assert_eq!(acc.sync(None).unwrap_err().kind, ErrorKind::EmptyWindow);
                add_big(&acc, tensors, rank);
                let info = acc.sync(None).unwrap();
                assert_eq!((info.total_count, info.microbatches), (2, 1));
                assert_comm_failure(&acc.sync(Some(comm)).unwrap_err(), "aborted by rank 0");
            });
        }
    });
    // The abort came in the middle of the reduction: rank 0 passed every share it owns (it only
    // meets the failure at its next barrier), and at least one of them after the abort.
    assert!(
        faulty.calls.load(Ordering::Relaxed) > faulty.at + 1,
        "the abort came with rank 0's last share"
    );
}

#[test]
fn abort_in_the_middle_of_a_sharded_micro_batch_discards_every_window() {
    // Sharded accumulation reduces every micro-batch bucket by bucket: a failure after the
    // micro-batch's control step leaves part of it in the shards, so every rank discards its
    // window.
    let (tensors, base) = big_layout();
    let world = 3;
    let mut comms = group(world, Duration::from_secs(5));
    let plain = comms.split_off(1);
    // One pass call per bucket: 64 per micro-batch.
    let faulty =
        Arc::new(AbortAt { inner: comms.pop().unwrap(), at: 70, calls: AtomicUsize::new(0) });
    let ranks: Vec<Arc<dyn Communicator>> =
        std::iter::once(faulty.clone() as Arc<dyn Communicator>)
            .chain(plain.into_iter().map(|c| Arc::new(c) as Arc<dyn Communicator>))
            .collect();
    let saved: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|comm| {
                let tensors = &tensors;
                s.spawn(move || {
                    let rank = comm.rank();
                    let config = AccumulatorConfig {
                        sharding: Sharding::Accumulate { shards: world, rank },
                        ..base
                    };
                    let acc = Accumulator::builder(tensors)
                        .config(config)
                        .communicator(comm.clone())
                        .build()
                        .unwrap();
                    // 64 buckets a micro-batch: the first passes, the second fails at its 7th.
                    add_big(&acc, tensors, rank);
                    let e = try_add_big(&acc, tensors, rank).unwrap_err();
                    assert_comm_failure(&e, "aborted by rank 0");
                    assert!(e.message.ends_with(" (the window was discarded)"), "{}", e.message);
                    assert_comm_failure(&acc.sync(None).unwrap_err(), "aborted by rank 0");
                    acc.save_window().unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let calls = faulty.calls.load(Ordering::Relaxed);
    assert!(
        (71..128).contains(&calls),
        "the abort came in the second micro-batch, not after {calls} passes"
    );
    // The saved windows are empty: on a healthy group they hold nothing to sync.
    let healthy: Vec<Arc<dyn Communicator>> = group(world, Duration::from_secs(5))
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect();
    std::thread::scope(|s| {
        for (comm, saved) in healthy.iter().zip(&saved) {
            let tensors = &tensors;
            s.spawn(move || {
                let config = AccumulatorConfig {
                    sharding: Sharding::Accumulate { shards: world, rank: comm.rank() },
                    ..base
                };
                let acc = Accumulator::builder(tensors)
                    .config(config)
                    .communicator(comm.clone())
                    .build()
                    .unwrap();
                acc.load_window(saved).unwrap();
                assert_eq!(acc.sync(None).unwrap_err().kind, ErrorKind::EmptyWindow);
            });
        }
    });
}

/// A failed boundary never updates a scaler, whether it left the window intact (a peer aborted
/// before the boundary) or discarded it (an abort in the middle of the reduction): the update
/// needs a synced window and finds none, and the scaler's state is unchanged.
#[test]
fn a_failed_boundary_never_updates_the_scaler() {
    let (tensors, config) = big_layout();
    for in_the_middle in [false, true] {
        let mut comms = group(2, Duration::from_secs(5));
        let plain = comms.pop().unwrap();
        let faulty = AbortAt {
            inner: comms.pop().unwrap(),
            at: if in_the_middle { 3 } else { usize::MAX },
            calls: AtomicUsize::new(0),
        };
        let ranks: [&dyn Communicator; 2] = [&faulty, &plain];
        std::thread::scope(|s| {
            for comm in ranks {
                let tensors = &tensors;
                s.spawn(move || {
                    let rank = comm.rank();
                    let scaler = Scaler::new(ScalerConfig {
                        init_scale: 1024.0,
                        growth_interval: 1,
                        ..Default::default()
                    })
                    .unwrap();
                    let acc = Accumulator::new(config, tensors).unwrap();
                    add_big(&acc, tensors, rank);
                    if !in_the_middle && rank == 0 {
                        comm.abort().unwrap();
                    }
                    let before = scaler.save().unwrap();
                    let e = acc.sync(Some(comm)).unwrap_err();
                    assert_eq!(
                        e.message.ends_with(" (the window was discarded)"),
                        in_the_middle,
                        "rank {rank}: {}",
                        e.message
                    );
                    let refused = scaler.update_from(&[&acc], true).unwrap_err();
                    assert_eq!(
                        refused.kind,
                        ErrorKind::WrongState,
                        "rank {rank}: {}",
                        refused.message
                    );
                    assert_eq!(
                        scaler.save().unwrap(),
                        before,
                        "rank {rank}: a failed boundary changed the scaler"
                    );
                    assert_eq!(scaler.scale().unwrap(), 1024.0, "rank {rank}");
                });
            }
        });
    }
}

#[test]
fn abort_at_a_random_moment_fails_every_rank_alike() {
    let mut rng = Rng::fresh("abort_at_a_random_moment_fails_every_rank_alike");
    let (tensors, config) = big_layout();
    let (mut failed, mut completed) = (0, 0);
    // Round 0 is not aborted: it measures how long a round takes, so that the later aborts land
    // anywhere from before the boundary to after it.
    let mut healthy = Duration::ZERO;
    for round in 0..13 {
        let comms = group(2, Duration::from_secs(5));
        let delay = Duration::from_micros(rng.range(0, healthy.as_micros() as u64 * 3 / 2));
        let start = Instant::now();
        let outcomes: Vec<gradacc::Result<Vec<f32>>> = std::thread::scope(|s| {
            let hs: Vec<_> = comms
                .iter()
                .map(|comm| {
                    let tensors = &tensors;
                    s.spawn(move || {
                        let acc = Accumulator::new(config, tensors).unwrap();
                        add_big(&acc, tensors, comm.rank());
                        acc.sync(Some(comm))?;
                        Ok(acc.with_master(37, |m| m.to_vec()).unwrap())
                    })
                })
                .collect();
            let comm = &comms[1];
            if round > 0 {
                s.spawn(move || {
                    std::thread::sleep(delay);
                    comm.abort().unwrap();
                });
            }
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        if round == 0 {
            healthy = start.elapsed();
            assert!(outcomes.iter().all(|o| o.is_ok()));
            continue;
        }
        match (&outcomes[0], &outcomes[1]) {
            (Ok(a), Ok(b)) => {
                assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "round {round}");
                completed += 1;
            }
            (Err(a), Err(b)) => {
                assert_comm_failure(a, "aborted by rank 1");
                assert_comm_failure(b, "aborted by rank 1");
                failed += 1;
            }
            _ => panic!(
                "round {round} (abort after {delay:?}): the ranks disagree: {:?}",
                outcomes.iter().map(|o| o.as_ref().map(drop)).collect::<Vec<_>>()
            ),
        }
    }
    eprintln!("a round takes {healthy:?}; aborts that failed the boundary: {failed}, boundaries that completed first: {completed}");
}

#[test]
fn a_failed_group_stays_failed_and_a_new_group_works() {
    let tensors = [TensorDesc { numel: 33, dtype: Dtype::Bf16 }];
    let comms = group(2, Duration::from_secs(5));
    let scaler = &unit_scaler();
    std::thread::scope(|s| {
        for comm in &comms {
            s.spawn(move || {
                let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                acc.add(scaler, &[Grad::bf16_bits(&[to_bf16(1.0); 33])], 1).unwrap();
                if comm.rank() == 1 {
                    comm.abort().unwrap();
                }
                for _ in 0..3 {
                    let t = Instant::now();
                    assert_comm_failure(&acc.sync(Some(comm)).unwrap_err(), "aborted by rank 1");
                    assert!(t.elapsed() < PROMPT, "a failed group waited {:?}", t.elapsed());
                }
                let mut buf = [1.0f32; 5];
                assert_comm_failure(
                    &comm.allreduce_sum(&mut buf).unwrap_err(),
                    "aborted by rank 1",
                );
                assert_eq!(buf, [1.0; 5]);
            });
        }
    });
    // A new group of the same size works, and dropping its handles after use is silent.
    let comms = LocalComm::group(2).unwrap();
    let infos: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors).unwrap();
                    acc.add(scaler, &[Grad::bf16_bits(&[to_bf16(1.0); 33])], 1).unwrap();
                    let info = acc.sync(Some(&comm)).unwrap();
                    acc.with_master(0, |m| assert!(m.iter().all(|&v| v == 1.0))).unwrap();
                    info
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(infos.iter().all(|i| i.total_count == 2 && i.microbatches == 2));
}

/// A 2 × 2 grid where rank 0 calls a plain `sync` on its shard group while ranks 1 to 3 call
/// `sync_hybrid`. Rank 0 holds no replica communicator, so nothing reaches rank 2, its replica
/// partner, which waits in the replica control exchange until its timeout (docs/reliability.md:
/// the cases that end only at the timeout). Every window stays intact, and the groups rank 2's
/// timeout aborted are replaced for the next, correct boundary.
#[test]
fn a_plain_sync_beside_hybrid_ones_ends_its_replica_partner_at_the_timeout() {
    let timeout = Duration::from_millis(500);
    // Far above any healthy wait: a rank that waits for nothing but a timeout shows up here.
    let generous = Duration::from_secs(20);
    let tensors = [
        TensorDesc { numel: 3 * 4096 + 5, dtype: Dtype::F32 },
        TensorDesc { numel: 77, dtype: Dtype::F16 },
    ];
    let numel: usize = tensors.iter().map(|t| t.numel).sum();
    // Small integers and no normalisation: every sum is exact.
    let value = |g: usize, k: usize, at: usize| ((at * 3 + g * 5 + k) % 7) as f32 - 3.0;
    let config = |i: usize| AccumulatorConfig {
        sharding: Sharding::ReduceScatter { shards: 2, rank: i },
        normalize: Normalize::None,
        loss_reduction: LossReduction::Sum,
        ..Default::default()
    };
    // Rank a * 2 + i is shard i of shard group a and replica a of replica group i.
    let shard_groups = [group(2, generous + generous), group(2, generous + generous)];
    let replica_groups = [group(2, timeout), group(2, generous + generous)];
    let accs: Vec<Accumulator> =
        (0..4).map(|g| Accumulator::new(config(g % 2), &tensors).unwrap()).collect();
    let scaler = &unit_scaler();
    for (g, acc) in accs.iter().enumerate() {
        for k in 0..2 {
            let flat: Vec<f32> = (0..numel).map(|at| value(g, k, at)).collect();
            let halves: Vec<u16> = flat[tensors[0].numel..].iter().map(|&v| to_f16(v)).collect();
            acc.add(
                scaler,
                &[Grad::F32(&flat[..tensors[0].numel]), Grad::f16_bits(&halves)],
                1 + k as u64,
            )
            .unwrap();
        }
    }
    let before: Vec<Vec<u8>> = accs.iter().map(|a| a.save_window().unwrap()).collect();

    let start = Instant::now();
    let failures: Vec<(Error, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|g| {
                let (a, i) = (g / 2, g % 2);
                let (acc, sc, rc) = (&accs[g], &shard_groups[a][i], &replica_groups[i][a]);
                s.spawn(move || {
                    let e = if g == 0 { acc.sync(Some(sc)) } else { acc.sync_hybrid(sc, rc) }
                        .unwrap_err();
                    (e, start.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (g, (e, waited)) in failures.iter().enumerate() {
        if g == 2 {
            assert_eq!(e.kind, ErrorKind::Timeout, "rank 2: {}", e.message);
            assert!(
                *waited >= timeout && *waited < timeout + generous,
                "rank 2 gave up after {waited:?}"
            );
            for part in [
                "control exchange",
                "did not complete within the timeout of 500ms",
                "rank 0 had not arrived",
                "window is intact",
            ] {
                assert!(e.message.contains(part), "rank 2: `{}` does not say `{part}`", e.message);
            }
        } else {
            // Found by the control values themselves, with no timeout involved.
            assert_eq!(e.kind, ErrorKind::SizeMismatch, "rank {g}: {}", e.message);
            assert!(*waited < generous, "rank {g} failed after {waited:?}");
        }
    }
    for (g, acc) in accs.iter().enumerate() {
        assert_eq!(
            acc.save_window().unwrap(),
            before[g],
            "rank {g}: the failed boundary changed the window"
        );
    }

    // Rank 2's timeout aborted both of its groups: its shard group with rank 3 and its replica
    // group with rank 0. The other two groups still work; new ones replace the aborted two.
    // (Rank 2 is rank 0 of its shard group and rank 1 of its replica group.)
    for (what, comm, naming) in [
        ("rank 3's shard group", &shard_groups[1][1], "aborted by rank 0"),
        ("rank 0's replica group", &replica_groups[0][0], "rank 1 timed out"),
    ] {
        let mut buf = [1.0f32; 5];
        let t = Instant::now();
        assert_comm_failure(&comm.allreduce_sum(&mut buf).unwrap_err(), naming);
        assert!(t.elapsed() < generous, "{what} waited {:?}", t.elapsed());
    }
    let (shard_1, replica_0) = (group(2, generous), group(2, generous));
    let results: Vec<(Range<usize>, Vec<f32>, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|g| {
                let (a, i) = (g / 2, g % 2);
                let sc = if a == 0 { &shard_groups[0][i] } else { &shard_1[i] };
                let rc = if i == 0 { &replica_0[a] } else { &replica_groups[1][a] };
                let acc = &accs[g];
                s.spawn(move || {
                    let info = acc.sync_hybrid(sc, rc).unwrap();
                    let (range, ptr) = acc.shard();
                    // SAFETY: the live accumulator's shard, unwritten until its next micro-batch.
                    let shard = unsafe { std::slice::from_raw_parts(ptr, range.len()) }.to_vec();
                    (range, shard, info.total_count)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (g, (range, shard, count)) in results.iter().enumerate() {
        assert_eq!(
            *count,
            4 * 3,
            "rank {g}: two micro-batches of 1 and 2 items on each of 4 ranks"
        );
        // `value` is of the tensors' elements packed back to back; the master pads them.
        let packed: Vec<f32> = (0..numel)
            .map(|at| (0..4).map(|r| (0..2).map(|k| value(r, k, at)).sum::<f32>()).sum())
            .collect();
        let (first, second) = packed.split_at(tensors[0].numel);
        let want = flat_master(&accs[0], &[first.to_vec(), second.to_vec()]);
        assert_eq!(*shard, want[range.clone()], "rank {g}: shard {range:?}");
    }
}

/// One micro-batch of a rank's window: item count, loss scale, and per tensor the true gradient.
struct Micro {
    count: u64,
    scale: f32,
    grads: Vec<Vec<f32>>,
}

fn add_micro(acc: &Accumulator, tensors: &[TensorDesc], m: &Micro) {
    let scaler =
        Scaler::new(ScalerConfig { init_scale: m.scale, min_scale: 1.0, ..Default::default() })
            .unwrap();
    let encoded: Vec<(Vec<f32>, Vec<u16>)> = tensors
        .iter()
        .zip(&m.grads)
        .map(|(t, g)| match t.dtype {
            Dtype::F32 => (g.iter().map(|v| v * m.scale).collect(), vec![]),
            Dtype::F16 => (vec![], g.iter().map(|v| to_f16(v * m.scale)).collect()),
            Dtype::Bf16 => (vec![], g.iter().map(|v| to_bf16(v * m.scale)).collect()),
        })
        .collect();
    let grads: Vec<Grad> =
        tensors.iter().zip(&encoded).map(|(t, e)| grad_of(t.dtype, &e.0, &e.1)).collect();
    acc.add(&scaler, &grads, m.count).unwrap();
}

#[test]
fn elastic_resume_of_four_ranks_windows_on_two() {
    let mut rng = Rng::fresh("elastic_resume_of_four_ranks_windows_on_two");
    let sizes = [1usize, 3, 7, 33, 1001, 4099];
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    let tensors: Vec<TensorDesc> = (0..rng.range(2, 6))
        .map(|_| TensorDesc {
            numel: sizes[rng.range(0, 5) as usize],
            dtype: dtypes[rng.range(0, 2) as usize],
        })
        .collect();
    let config =
        AccumulatorConfig { bucket_numel: rng.range(1, 5000) as usize, ..Default::default() };
    let windows: Vec<Vec<Micro>> = (0..4)
        .map(|_| {
            (0..rng.range(1, 4))
                .map(|_| Micro {
                    count: rng.range(1, 9),
                    scale: 2f32.powi(rng.range(0, 10) as i32),
                    grads: tensors
                        .iter()
                        .map(|t| (0..t.numel).map(|_| rng.uniform(-1.0, 1.0) as f32).collect())
                        .collect(),
                })
                .collect()
        })
        .collect();

    // Four ranks accumulate; rank 3 saves its window and fails before the boundary.
    let comms = group(4, Duration::from_secs(5));
    let saved: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .zip(&windows)
            .map(|(comm, window)| {
                let tensors = &tensors;
                s.spawn(move || {
                    let acc = Accumulator::new(config, tensors).unwrap();
                    for m in window {
                        add_micro(&acc, tensors, m);
                    }
                    if comm.rank() == 3 {
                        let bytes = acc.save_window().unwrap();
                        drop(comm);
                        return bytes;
                    }
                    assert_comm_failure(
                        &acc.sync(Some(&comm)).unwrap_err(),
                        "rank 3 left the group",
                    );
                    acc.save_window().unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });

    // Two new ranks resume: each loads one survivor's window and merges one more.
    let comms = group(2, Duration::from_secs(5));
    let results: Vec<(gradacc::SyncInfo, Vec<Vec<f32>>)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter()
            .map(|comm| {
                let (tensors, saved) = (&tensors, &saved);
                s.spawn(move || {
                    let r = comm.rank();
                    let acc = Accumulator::new(config, tensors).unwrap();
                    acc.load_window(&saved[r]).unwrap();
                    acc.merge_window(&saved[r + 2]).unwrap();
                    let info = acc.sync(Some(comm)).unwrap();
                    (
                        info,
                        (0..tensors.len())
                            .map(|t| acc.with_master(t, |m| m.to_vec()).unwrap())
                            .collect(),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });

    // The f64 reference of all four ranks' work, normalised by the total count.
    let total_count: u64 = windows.iter().flatten().map(|m| m.count).sum();
    let total_micro = windows.iter().map(|w| w.len() as u64).sum::<u64>();
    let (info, masters) = &results[0];
    assert_eq!(results[1].0, *info);
    assert!(masters
        .iter()
        .flatten()
        .zip(results[1].1.iter().flatten())
        .all(|(a, b)| a.to_bits() == b.to_bits()));
    assert_eq!((info.total_count, info.microbatches), (total_count, total_micro));
    assert!(!info.found_inf);
    for (t, (desc, master)) in tensors.iter().zip(masters).enumerate() {
        assert_eq!(master.len(), desc.numel);
        for (i, &got) in master.iter().enumerate() {
            let (mut want, mut magnitude) = (0f64, 0f64);
            for m in windows.iter().flatten() {
                let x = decoded(desc.dtype, m.grads[t][i], m.scale) * m.count as f64;
                want += x;
                magnitude += x.abs();
            }
            let (want, tol) =
                (want / total_count as f64, 2e-6 * magnitude / total_count as f64 + 1e-30);
            let got = got as f64;
            assert!(
                (got - want).abs() <= tol,
                "tensor {t} ({:?}) element {i}: {got} vs {want} (tol {tol})",
                desc.dtype
            );
        }
    }
}
