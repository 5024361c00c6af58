//! The NCCL communicator's contract on CUDA devices (the software GPU in CI): an abort from
//! another thread ends a sync that waits for a rank that never comes, and nothing hangs after
//! it; one communicator used by several threads at once is serialised; two ranks of a group on
//! one device are refused; a non-blocking communicator the caller made and gradacc adopted syncs.
//!
//! Skips without a GPU and NCCL; GRADACC_REQUIRE_GPU=1 makes that a failure.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Barrier};
use std::time::{Duration, Instant};

use common::cuda::ApexSeed;
use cudarc::nccl::sys as nccl_sys;
use gradacc::backend::cuda;
use gradacc::backend::cuda::driver::{self, Context, DeviceBuffer, OwnedStream};
use gradacc::comm::nccl::{self, NcclComm};
use gradacc::{Accumulator, AccumulatorConfig, Communicator, Device, Dtype, ErrorKind, Scaler, ScalerConfig, TensorDesc};

/// Whether CUDA, NCCL and `devices` devices are usable; without them the test skips, unless
/// GRADACC_REQUIRE_GPU=1, which makes it fail.
fn gpus_or_skip(devices: i32) -> bool {
    let mut count = 0;
    let usable = cuda::available() && nccl::nccl_available() && {
        // SAFETY: the driver loads (cuda::available); valid out-pointer.
        unsafe { cudarc::driver::sys::cuDeviceGetCount(&mut count) };
        count >= devices
    };
    if usable {
        return true;
    }
    assert!(
        std::env::var("GRADACC_REQUIRE_GPU").as_deref() != Ok("1"),
        "GRADACC_REQUIRE_GPU=1 but CUDA, NCCL or {devices} device(s) are not usable (CUDA {}, NCCL {}, {count} device(s))",
        cuda::available(),
        nccl::nccl_available()
    );
    eprintln!("no CUDA with NCCL and {devices} device(s): skipping");
    false
}

/// Runs `f` on its own thread and fails if it takes longer than `limit`: a hang is a failure, not
/// a test run that never ends.
fn within<T: Send + 'static>(limit: Duration, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what} did not finish within {limit:?}: it hangs"),
        // The closure panicked: report its panic.
        Err(mpsc::RecvTimeoutError::Disconnected) => std::panic::resume_unwind(worker.join().unwrap_err()),
    }
}

/// Defect 1: rank 1 never reaches the boundary, so rank 0's sync waits for it; another thread
/// aborts rank 0's communicator. The sync must end with COMM_FAILURE soon after, and dropping
/// both ranks' communicators must not wait for anything.
#[test]
fn abort_ends_a_sync_waiting_for_a_missing_rank_and_drop_does_not_hang() {
    if !gpus_or_skip(2) {
        return;
    }
    within(Duration::from_secs(120), "the abort scenario", || {
        let id = nccl::unique_id().unwrap();
        let (rank0_done, rank1) = absent_rank1(id);
        let comm = Arc::new(NcclComm::new(&id, 0, 2, 0).unwrap());
        let rank = rank_with_a_window(0);

        let returned = Arc::new(AtomicBool::new(false));
        let aborter = {
            let (comm, returned) = (comm.clone(), returned.clone());
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(500));
                assert!(!returned.load(Ordering::SeqCst), "sync returned although rank 1 never reached the boundary");
                let aborted_at = Instant::now();
                comm.abort().unwrap();
                aborted_at
            })
        };
        let result = rank.acc.sync(Some(&*comm));
        let returned_at = Instant::now();
        returned.store(true, Ordering::SeqCst);
        let aborted_at = aborter.join().unwrap();
        let err = result.expect_err("sync succeeded without rank 1");
        assert_eq!(err.kind, ErrorKind::CommFailure, "{err}");
        let late = returned_at.saturating_duration_since(aborted_at);
        assert!(late < Duration::from_secs(5), "sync returned {late:?} after the abort");
        // Later calls fail at once; abort is idempotent.
        assert!(comm.is_failed());
        assert_eq!(comm.health().unwrap_err().kind, ErrorKind::CommFailure);
        assert_eq!(comm.allreduce_sum_f32(rank.grad.ptr(), 1, rank.stream.stream).unwrap_err().kind, ErrorKind::CommFailure);
        comm.abort().unwrap();

        let start = Instant::now();
        drop(rank);
        drop(comm);
        assert!(start.elapsed() < Duration::from_secs(5), "dropping rank 0 took {:?}", start.elapsed());
        rank0_done.wait();
        let dropped_in = rank1.join().unwrap();
        assert!(dropped_in < Duration::from_secs(5), "dropping rank 1 after its peer aborted took {dropped_in:?}");
    });
}

/// Defect 1: an abort while another thread issues groups of collectives (syncs) must not free
/// the communicator under a group, which ncclGroupEnd still uses; that thread's next call fails
/// with COMM_FAILURE.
#[test]
fn abort_beside_a_thread_issuing_groups() {
    if !gpus_or_skip(1) {
        return;
    }
    within(Duration::from_secs(120), "an abort beside groups", || {
        let id = nccl::unique_id().unwrap();
        let comm = Arc::new(NcclComm::new(&id, 0, 1, 0).unwrap());
        let ctx = Context::get(0).unwrap();
        let started = Arc::new(Barrier::new(2));
        let issuer = {
            let (comm, ctx, started) = (comm.clone(), ctx.clone(), started.clone());
            std::thread::spawn(move || {
                let stream = OwnedStream::new(&ctx).unwrap();
                let data = DeviceBuffer::from_slice(&ctx, stream.stream, &[1.0f32; 96]).unwrap();
                started.wait();
                let deadline = Instant::now() + Duration::from_secs(60);
                let mut groups = 0u64;
                let err = loop {
                    let result = comm.group(|| {
                        for part in 0..3 {
                            comm.allreduce_sum_f32(data.ptr() + 128 * part, 32, stream.stream)?;
                        }
                        Ok(())
                    });
                    match result {
                        Ok(()) => groups += 1,
                        Err(e) => break e,
                    }
                    assert!(Instant::now() < deadline, "the abort never reached the issuing thread");
                };
                driver::synchronize(&ctx, stream.stream).unwrap();
                (groups, err)
            })
        };
        started.wait();
        std::thread::sleep(Duration::from_millis(100));
        comm.abort().unwrap();
        let (groups, err) = issuer.join().unwrap();
        assert_eq!(err.kind, ErrorKind::CommFailure, "{err}");
        assert!(groups > 0, "no group ran before the abort");
    });
}

/// Defect 1: a rank that never comes makes creation fail at the deadline, and the half-made
/// communicator is aborted, not left waiting.
#[test]
fn creation_fails_at_the_deadline_when_a_rank_never_comes() {
    if !gpus_or_skip(1) {
        return;
    }
    within(Duration::from_secs(60), "creation with a missing rank", || {
        let id = nccl::unique_id().unwrap();
        let start = Instant::now();
        let err = NcclComm::with_timeout(&id, 0, 2, 0, Duration::from_secs(2)).err().expect("a group of 2 was created by one rank");
        assert_eq!(err.kind, ErrorKind::Timeout, "{err}");
        assert!(err.message.contains("did not complete within"), "{err}");
        let took = start.elapsed();
        assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(10), "gave up after {took:?}");
    });
}

/// Defect 2: a thread's grouped collectives (a sync) and another thread's single ones (bucket
/// reductions from backward hooks) on one communicator. NCCL (and the software GPU, which stops
/// the process) forbids two threads inside one communicator; gradacc must serialise them.
#[test]
fn two_threads_on_one_communicator_are_serialised() {
    if !gpus_or_skip(1) {
        return;
    }
    within(Duration::from_secs(120), "two threads on one communicator", || {
        let id = nccl::unique_id().unwrap();
        let comm = Arc::new(NcclComm::new(&id, 0, 1, 0).unwrap());
        let ctx = Context::get(0).unwrap();
        const ROUNDS: usize = 200;
        let start = Arc::new(Barrier::new(2));
        let grouped = {
            let (comm, ctx, start) = (comm.clone(), ctx.clone(), start.clone());
            std::thread::spawn(move || {
                let stream = OwnedStream::new(&ctx).unwrap();
                let words = DeviceBuffer::from_slice(&ctx, stream.stream, &[1u64, 2, 3]).unwrap();
                let data = DeviceBuffer::from_slice(&ctx, stream.stream, &[1.5f32; 64]).unwrap();
                start.wait();
                for _ in 0..ROUNDS {
                    comm.group(|| {
                        comm.allreduce_u64(words.ptr(), 3, false, stream.stream)?;
                        comm.allreduce_sum_f32(data.ptr(), 32, stream.stream)?;
                        comm.allreduce_sum_f32(data.ptr() + 128, 32, stream.stream)
                    })
                    .unwrap();
                }
                let mut out = [0f32; 64];
                data.read(&mut out).unwrap();
                assert!(out.iter().all(|&v| v == 1.5), "a world-size-1 sum changed the data: {:?}", &out[..4]);
            })
        };
        let single = {
            let (comm, ctx, start) = (comm.clone(), ctx.clone(), start.clone());
            std::thread::spawn(move || {
                let stream = OwnedStream::new(&ctx).unwrap();
                let data = DeviceBuffer::from_slice(&ctx, stream.stream, &[2.5f32; 16]).unwrap();
                start.wait();
                for _ in 0..ROUNDS * 3 {
                    comm.allreduce_sum_f32(data.ptr(), 16, stream.stream).unwrap();
                }
                driver::synchronize(&ctx, stream.stream).unwrap();
            })
        };
        grouped.join().unwrap();
        single.join().unwrap();
    });
}

/// Defect 2: two ranks of one group on one device in one process are refused before NCCL, by an
/// error naming both ranks and the device; the refused rank then joins from another device.
#[test]
fn two_ranks_on_one_device_are_refused() {
    if !gpus_or_skip(2) {
        return;
    }
    within(Duration::from_secs(120), "two ranks on one device", || {
        let id = nccl::unique_id().unwrap();
        let start = Arc::new(Barrier::new(2));
        let ranks: Vec<_> = (0..2usize)
            .map(|rank| {
                let start = start.clone();
                std::thread::spawn(move || {
                    start.wait();
                    match NcclComm::new(&id, rank, 2, 0) {
                        Ok(comm) => Ok(comm),
                        Err(e) => Err((rank, e)),
                    }
                })
            })
            .collect::<Vec<_>>();
        // One rank is refused at once; the other waits in NCCL for a rank 1 of another device.
        std::thread::sleep(Duration::from_millis(300));
        let finished: Vec<bool> = ranks.iter().map(|h| h.is_finished()).collect();
        assert_eq!(finished.iter().filter(|&&f| f).count(), 1, "exactly one rank should be refused at once: {finished:?}");
        let refused = ranks.iter().position(|h| h.is_finished()).unwrap();
        let mut ranks: Vec<_> = ranks.into_iter().map(Some).collect();
        let (rank, err) = ranks[refused].take().unwrap().join().unwrap().err().expect("the refused rank");
        assert_eq!(err.kind, ErrorKind::InvalidArgument, "{err}");
        assert!(err.message.contains("ranks 0 and 1") || err.message.contains("ranks 1 and 0"), "the error does not name both ranks: {err}");
        assert!(err.message.contains("device 0"), "the error does not name the device: {err}");
        let retried = NcclComm::new(&id, rank, 2, 1).unwrap();
        let other = ranks[1 - refused].take().unwrap().join().unwrap().map_err(|(_, e)| e).unwrap();
        assert_eq!((retried.ordinal(), other.ordinal()), (1, 0));
        assert_eq!(retried.rank() + other.rank(), 1);
    });
}

/// NCCL_CONFIG_INITIALIZER for cudarc's nccl.h (2.30) with `blocking` = 0, as a caller writes it.
fn nonblocking_config() -> nccl_sys::ncclConfig_t {
    let undef = i32::MIN;
    nccl_sys::ncclConfig_t {
        size: std::mem::size_of::<nccl_sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 23000,
        blocking: 0,
        cgaClusterSize: undef,
        minCTAs: undef,
        maxCTAs: undef,
        netName: std::ptr::null(),
        splitShare: undef,
        trafficClass: undef,
        commName: std::ptr::null(),
        collnetEnable: undef,
        CTAPolicy: undef,
        shrinkShare: undef,
        nvlsCTAs: undef,
        nChannelsPerNetPeer: undef,
        nvlinkCentricSched: undef,
        graphUsageMode: undef,
        numRmaCtx: undef,
        maxP2pPeers: undef,
    }
}

/// Polls a non-blocking communicator until its last operation is done.
fn wait_ready(comm: nccl_sys::ncclComm_t) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut state = nccl_sys::ncclResult_t::ncclInProgress;
        // SAFETY: a live communicator; valid out-pointer.
        assert_eq!(unsafe { nccl_sys::ncclCommGetAsyncError(comm, &mut state) }, nccl_sys::ncclResult_t::ncclSuccess);
        match state {
            nccl_sys::ncclResult_t::ncclSuccess => return,
            nccl_sys::ncclResult_t::ncclInProgress => assert!(Instant::now() < deadline, "the communicator stayed in progress"),
            other => panic!("the communicator failed: {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Defect 3: the caller's own non-blocking communicator answers ncclInProgress to every
/// collective; gradacc must wait for it, not fail while the collective goes on. The seed of the
/// Apex O2 report at world size 1: weight 3.0, bias 2.0.
#[test]
fn an_adopted_nonblocking_communicator_syncs() {
    if !gpus_or_skip(1) {
        return;
    }
    within(Duration::from_secs(120), "a sync over an adopted non-blocking communicator", || {
        let ctx = Context::get(0).unwrap();
        let mut raw: nccl_sys::ncclComm_t = std::ptr::null_mut();
        {
            let _g = ctx.enter().unwrap();
            let id = nccl::unique_id().unwrap();
            let unique = nccl_sys::ncclUniqueId { internal: id.map(|b| b as _) };
            let mut config = nonblocking_config();
            // SAFETY: valid out-pointer and config; device 0's context is current.
            let r = unsafe { nccl_sys::ncclCommInitRankConfig(&mut raw, 1, unique, 0, &mut config) };
            assert!(matches!(r, nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress), "{r:?}");
            wait_ready(raw);
        }
        // SAFETY: `raw` is live until destroyed below, after the adopted object is gone.
        let comm = unsafe { NcclComm::adopt(raw.cast()) }.unwrap();
        assert_eq!((comm.rank(), comm.world_size(), comm.ordinal()), (0, 1, 0));
        let stream = OwnedStream::new(&ctx).unwrap();
        let ApexSeed { scaler, acc, first: [w1, b1], second: [w2, b2] } = ApexSeed::new(&ctx, stream.stream);
        for step in 0..3 {
            acc.add(&scaler, &[w1.ptr(), b1.ptr()], 1).unwrap();
            acc.add(&scaler, &[w2.ptr(), b2.ptr()], 1).unwrap();
            let info = acc.sync(Some(&comm)).unwrap();
            let (mut w, mut b) = ([0f32], [0f32]);
            acc.read_master(0, &mut w).unwrap();
            acc.read_master(1, &mut b).unwrap();
            assert_eq!((w[0], b[0], info.microbatches), (3.0, 2.0, 2), "step {step}");
        }
        // An adopted communicator stays the caller's.
        assert_eq!(comm.abort().unwrap_err().kind, ErrorKind::WrongState);
        drop(acc);
        drop(comm);
        let _g = ctx.enter().unwrap();
        // SAFETY: the caller's communicator, no longer used by gradacc.
        unsafe {
            assert!(matches!(nccl_sys::ncclCommFinalize(raw), nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress));
            wait_ready(raw);
            assert_eq!(nccl_sys::ncclCommDestroy(raw), nccl_sys::ncclResult_t::ncclSuccess);
        }
    });
}

/// Rank 1 of a group of two on device 1 that joins but never syncs: it waits until rank 0 passes
/// the returned barrier, then leaves, and reports how long dropping its communicator took.
fn absent_rank1(id: [u8; nccl::UNIQUE_ID_BYTES]) -> (Arc<Barrier>, std::thread::JoinHandle<Duration>) {
    let rank0_done = Arc::new(Barrier::new(2));
    let rank1 = {
        let rank0_done = rank0_done.clone();
        std::thread::spawn(move || {
            let comm = NcclComm::new(&id, 1, 2, 1).unwrap();
            rank0_done.wait();
            let start = Instant::now();
            drop(comm);
            start.elapsed()
        })
    };
    (rank0_done, rank1)
}

/// One rank of two on device `ordinal`'s own stream, with a window of one micro-batch added.
/// Fields drop in order: the stream last.
struct Rank {
    acc: Accumulator,
    _scaler: Scaler,
    grad: DeviceBuffer,
    stream: OwnedStream,
}

fn rank_with_a_window(ordinal: i32) -> Rank {
    let ctx = Context::get(ordinal).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal, stream: stream.stream };
    let scaler = Scaler::on(device, ScalerConfig::default()).unwrap();
    let acc = Accumulator::on(device, AccumulatorConfig::default(), &[TensorDesc { numel: 1000, dtype: Dtype::F32 }]).unwrap();
    let grad = DeviceBuffer::from_slice(&ctx, stream.stream, &[0.5f32; 1000]).unwrap();
    acc.add(&scaler, &[grad.ptr()], 4).unwrap();
    Rank { acc, _scaler: scaler, grad, stream }
}

/// A rank that never reaches the boundary: the other's sync fails with TIMEOUT once its
/// communicator's timeout has passed (not before, and within a second after), naming the wait;
/// the communicator is aborted, and dropping everything does not hang.
#[test]
fn a_sync_times_out_when_a_rank_never_comes() {
    if !gpus_or_skip(2) {
        return;
    }
    within(Duration::from_secs(120), "the timeout scenario", || {
        let id = nccl::unique_id().unwrap();
        let (rank0_done, rank1) = absent_rank1(id);
        let comm = NcclComm::new(&id, 0, 2, 0).unwrap();
        let timeout = Duration::from_millis(700);
        Communicator::set_timeout(&comm, Some(timeout)).unwrap();
        assert_eq!(comm.timeout(), Some(timeout));
        let rank = rank_with_a_window(0);
        let start = Instant::now();
        let err = rank.acc.sync(Some(&comm)).expect_err("sync succeeded without rank 1");
        let waited = start.elapsed();
        assert_eq!(err.kind, ErrorKind::Timeout, "{err}");
        assert!(err.message.contains("700ms"), "{err}");
        assert!(waited >= timeout && waited < timeout + Duration::from_secs(1), "sync returned after {waited:?}");
        assert!(comm.is_failed());
        assert_eq!(rank.acc.sync(Some(&comm)).unwrap_err().kind, ErrorKind::CommFailure, "a later sync fails at once");
        let start = Instant::now();
        drop(rank);
        drop(comm);
        assert!(start.elapsed() < Duration::from_secs(5), "dropping rank 0 took {:?}", start.elapsed());
        rank0_done.wait();
        rank1.join().unwrap();
    });
}

/// A rank destroys its communicator before the boundary (it failed and cleaned up): the other's
/// sync does not hang; it fails within its timeout, and its own communicator drops promptly.
#[test]
fn a_sync_after_a_peer_destroyed_its_communicator_does_not_hang() {
    if !gpus_or_skip(2) {
        return;
    }
    within(Duration::from_secs(120), "the destroyed-peer scenario", || {
        let id = nccl::unique_id().unwrap();
        let rank1 = std::thread::spawn(move || drop(NcclComm::new(&id, 1, 2, 1).unwrap()));
        let comm = NcclComm::new(&id, 0, 2, 0).unwrap();
        rank1.join().unwrap();
        Communicator::set_timeout(&comm, Some(Duration::from_millis(500))).unwrap();
        let rank = rank_with_a_window(0);
        let start = Instant::now();
        let err = rank.acc.sync(Some(&comm)).expect_err("sync succeeded without rank 1");
        assert!(matches!(err.kind, ErrorKind::Timeout | ErrorKind::CommFailure), "{err}");
        assert!(start.elapsed() < Duration::from_secs(2), "sync returned after {:?}", start.elapsed());
        let start = Instant::now();
        drop(rank);
        drop(comm);
        assert!(start.elapsed() < Duration::from_secs(5), "dropping rank 0 took {:?}", start.elapsed());
    });
}
