//! The NCCL communicator's contract on CUDA devices (the software GPU in CI): an abort from
//! another thread ends a sync that waits for a rank that never comes, and nothing hangs after
//! it; one communicator used by several threads at once is serialised; two ranks of a group on
//! one device are refused; a non-blocking communicator the caller made and gradacc adopted syncs;
//! the reduce-scatter boundary leaves each rank its shard of the all-reduce's result (the CPU
//! backend's and an f64 reference's), and a sharded sync on the wrong group fails on every rank.
//!
//! Skips without a GPU and NCCL; GRADACC_REQUIRE_GPU=1 makes that a failure.

mod common;

use std::ffi::c_int;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

use common::cuda::{nccl_devices, ApexSeed, HostGrad};
use common::{aligned_offsets, from_bf16, from_f16, Rng};
use cudarc::nccl::sys as nccl_sys;
use gradacc::backend::cuda::driver::{self, Context, DeviceBuffer, OwnedStream};
use gradacc::backend::cuda::nccl::{self, NcclComm};
use gradacc::{
    Accumulator, AccumulatorConfig, Communicator, Device, Dtype, ErrorKind, Grad, LocalComm,
    LossReduction, Normalize, Overflow, OverflowAt, Scaler, ScalerConfig, Sharding, SyncInfo,
    TensorDesc,
};

/// Whether CUDA, NCCL and `devices` devices are usable; without CUDA or NCCL the test skips,
/// unless GRADACC_REQUIRE_GPU=1, which makes it fail; with fewer devices it is not run
/// ([`common::cuda::enough_devices`]).
fn gpus_or_skip(devices: i32) -> bool {
    let count = nccl_devices();
    count > 0 && common::cuda::enough_devices(devices, count)
}

/// Runs `f` on its own thread and fails if it takes longer than `limit`: a hang is a failure, not
/// a test run that never ends.
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what} did not finish within {limit:?}: it hangs")
        }
        // The closure panicked: report its panic.
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(worker.join().unwrap_err())
        }
    }
}

/// The device of rank `rank` (every rank of these tests runs on the device of its number): its
/// context, a stream of its own, and the `Device` that names them.
fn rank_device(rank: usize) -> (Arc<Context>, OwnedStream, Device) {
    let ctx = Context::get(rank as i32).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: rank as i32, stream: stream.stream.cast() };
    (ctx, stream, device)
}

/// Rank `rank` of the two-rank group `id`, on its own device, waiting at most `timeout`.
fn pair_comm(
    id: &[u8; nccl::UNIQUE_ID_BYTES],
    rank: usize,
    timeout: Duration,
) -> Arc<dyn Communicator> {
    let comm: Arc<dyn Communicator> = Arc::new(NcclComm::new(id, rank, 2, rank as i32).unwrap());
    comm.set_timeout(Some(timeout)).unwrap();
    comm
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
                assert!(
                    !returned.load(Ordering::SeqCst),
                    "sync returned although rank 1 never reached the boundary"
                );
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
        assert_eq!(
            comm.allreduce_sum_f32(rank.grad.ptr(), 1, rank.stream.stream).unwrap_err().kind,
            ErrorKind::CommFailure
        );
        comm.abort().unwrap();

        let start = Instant::now();
        drop(rank);
        drop(comm);
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "dropping rank 0 took {:?}",
            start.elapsed()
        );
        rank0_done.wait();
        let dropped_in = rank1.join().unwrap();
        assert!(
            dropped_in < Duration::from_secs(5),
            "dropping rank 1 after its peer aborted took {dropped_in:?}"
        );
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
                    assert!(
                        Instant::now() < deadline,
                        "the abort never reached the issuing thread"
                    );
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
        let err = NcclComm::with_timeout(&id, 0, 2, 0, Duration::from_secs(2))
            .err()
            .expect("a group of 2 was created by one rank");
        assert_eq!(err.kind, ErrorKind::Timeout, "{err}");
        assert!(err.message.contains("did not complete within"), "{err}");
        let took = start.elapsed();
        assert!(
            took >= Duration::from_secs(2) && took < Duration::from_secs(10),
            "gave up after {took:?}"
        );
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
                assert!(
                    out.iter().all(|&v| v == 1.5),
                    "a world-size-1 sum changed the data: {:?}",
                    &out[..4]
                );
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
        assert_eq!(
            finished.iter().filter(|&&f| f).count(),
            1,
            "exactly one rank should be refused at once: {finished:?}"
        );
        let refused = ranks.iter().position(|h| h.is_finished()).unwrap();
        let mut ranks: Vec<_> = ranks.into_iter().map(Some).collect();
        let (rank, err) =
            ranks[refused].take().unwrap().join().unwrap().err().expect("the refused rank");
        assert_eq!(err.kind, ErrorKind::InvalidArgument, "{err}");
        assert!(
            err.message.contains("ranks 0 and 1") || err.message.contains("ranks 1 and 0"),
            "the error does not name both ranks: {err}"
        );
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

/// `ncclSuccess` and `ncclInProgress`.
const NCCL_SUCCESS: c_int = 0;
const NCCL_IN_PROGRESS: c_int = 7;

/// The NCCL calls a caller makes to create and end its own communicator, from the library gradacc
/// loads (GRADACC_NCCL_LIBRARY, else `libnccl.so.2`, else `libnccl.so`): NCCL's packages and wheels
/// ship `libnccl.so.2`, a name cudarc's loader never tries.
struct CallerNccl {
    init_rank_config: unsafe extern "C" fn(
        *mut nccl_sys::ncclComm_t,
        c_int,
        nccl_sys::ncclUniqueId,
        c_int,
        *mut nccl_sys::ncclConfig_t,
    ) -> c_int,
    get_async_error: unsafe extern "C" fn(nccl_sys::ncclComm_t, *mut c_int) -> c_int,
    finalize: unsafe extern "C" fn(nccl_sys::ncclComm_t) -> c_int,
    destroy: unsafe extern "C" fn(nccl_sys::ncclComm_t) -> c_int,
    _library: libloading::Library,
}

fn caller_nccl() -> &'static CallerNccl {
    static NCCL: OnceLock<CallerNccl> = OnceLock::new();
    NCCL.get_or_init(|| {
        let names = match std::env::var("GRADACC_NCCL_LIBRARY") {
            Ok(file) if !file.is_empty() => vec![file],
            _ => vec!["libnccl.so.2".to_string(), "libnccl.so".to_string()],
        };
        // SAFETY: NCCL, which gradacc has loaded already (the tests ask nccl_available first).
        let library = names
            .iter()
            .find_map(|name| unsafe { libloading::Library::new(name) }.ok())
            .expect("NCCL loads");
        macro_rules! resolve {
            ($name:literal) => {
                // SAFETY: each field's type is the symbol's prototype in nccl.h, with
                // ncclResult_t as c_int.
                *unsafe { library.get($name) }.unwrap_or_else(|e| panic!("{}: {e:?}", $name))
            };
        }
        CallerNccl {
            init_rank_config: resolve!("ncclCommInitRankConfig"),
            get_async_error: resolve!("ncclCommGetAsyncError"),
            finalize: resolve!("ncclCommFinalize"),
            destroy: resolve!("ncclCommDestroy"),
            _library: library,
        }
    })
}

/// Polls a non-blocking communicator until its last operation is done.
fn wait_ready(comm: nccl_sys::ncclComm_t) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut state = NCCL_IN_PROGRESS;
        // SAFETY: a live communicator; valid out-pointer.
        assert_eq!(unsafe { (caller_nccl().get_async_error)(comm, &mut state) }, NCCL_SUCCESS);
        match state {
            NCCL_SUCCESS => return,
            NCCL_IN_PROGRESS => {
                assert!(Instant::now() < deadline, "the communicator stayed in progress")
            }
            other => panic!("the communicator failed: NCCL result {other}"),
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
            let r =
                unsafe { (caller_nccl().init_rank_config)(&mut raw, 1, unique, 0, &mut config) };
            assert!(matches!(r, NCCL_SUCCESS | NCCL_IN_PROGRESS), "ncclCommInitRankConfig: {r}");
            wait_ready(raw);
        }
        // SAFETY: `raw` is live until destroyed below, after the adopted object is gone.
        let comm = unsafe { NcclComm::adopt(raw.cast()) }.unwrap();
        assert_eq!((comm.rank(), comm.world_size(), comm.ordinal()), (0, 1, 0));
        let stream = OwnedStream::new(&ctx).unwrap();
        let ApexSeed { scaler, acc, first: [w1, b1], second: [w2, b2] } =
            ApexSeed::new(&ctx, stream.stream);
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
            assert!(matches!((caller_nccl().finalize)(raw), NCCL_SUCCESS | NCCL_IN_PROGRESS));
            wait_ready(raw);
            assert_eq!((caller_nccl().destroy)(raw), NCCL_SUCCESS);
        }
    });
}

/// Rank 1 of a group of two on device 1 that joins but never syncs: it waits until rank 0 passes
/// the returned barrier, then leaves, and reports how long dropping its communicator took.
fn absent_rank1(
    id: [u8; nccl::UNIQUE_ID_BYTES],
) -> (Arc<Barrier>, std::thread::JoinHandle<Duration>) {
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
    let device = Device::Cuda { ordinal, stream: stream.stream.cast() };
    let scaler = Scaler::on(device, ScalerConfig::default()).unwrap();
    let acc = Accumulator::builder(&[TensorDesc { numel: 1000, dtype: Dtype::F32 }])
        .device(device)
        .build()
        .unwrap();
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
        assert!(
            waited >= timeout && waited < timeout + Duration::from_secs(1),
            "sync returned after {waited:?}"
        );
        assert!(comm.is_failed());
        assert_eq!(
            rank.acc.sync(Some(&comm)).unwrap_err().kind,
            ErrorKind::CommFailure,
            "a later sync fails at once"
        );
        let start = Instant::now();
        drop(rank);
        drop(comm);
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "dropping rank 0 took {:?}",
            start.elapsed()
        );
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
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "sync returned after {:?}",
            start.elapsed()
        );
        let start = Instant::now();
        drop(rank);
        drop(comm);
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "dropping rank 0 took {:?}",
            start.elapsed()
        );
    });
}

/// How a rank adds one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Style {
    /// `add`: every tensor in one call.
    Add,
    /// `begin_microbatch` + `add_tensor` in reverse, the last tensor in two contributions.
    Hooks,
    /// The window's last, through `begin_final_microbatch`: buckets reduce as their tensors land.
    Final,
}

/// One rank's micro-batch: its loss scale, item count, gradients (already scaled) and style.
struct Micro {
    scale: f32,
    count: u64,
    grads: Vec<HostGrad>,
    style: Style,
}

/// One round of the sharded test: a layout and config, and per window, per rank, micro-batches.
struct ShardRound {
    descs: Vec<TensorDesc>,
    config: AccumulatorConfig,
    /// The sharded accumulator adopts a master buffer of the layout's length.
    adopt: bool,
    windows: Vec<Vec<Vec<Micro>>>,
}

/// The tensor that takes two contributions in a micro-batch added tensor by tensor in reverse:
/// the last one, unless it would start its bucket's early reduction alone (a final micro-batch
/// refuses a second contribution after that); then one that shares its bucket with the tensor
/// before it.
fn twice_added(buckets: &[Range<usize>], descs: &[TensorDesc], style: Style) -> Option<usize> {
    if style != Style::Final {
        return Some(descs.len() - 1);
    }
    let starts = aligned_offsets(descs);
    let bucket = |i: usize| buckets.iter().position(|b| b.contains(&starts[i]));
    (1..descs.len()).rev().find(|&i| bucket(i) == bucket(i - 1))
}

fn random_round(rng: &mut Rng, world: usize, round: usize) -> ShardRound {
    // Lengths around the 4096-element norm blocks, so shards end mid-tensor, the last shard is
    // short, and a small layout leaves the last ranks' shards empty.
    let sizes = [1usize, 3, 64, 4095, 4097, 5000, 12289, 40_000];
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    let modes =
        [Normalize::ByCount, Normalize::ByMicrobatches, Normalize::ByWorld, Normalize::None];
    let descs: Vec<TensorDesc> = if round == 0 {
        // Exactly `world` full shards once each tensor is aligned (padded to world × 4096 - 128
        // and 128): a caller's master needs no padding for the in-place reduce-scatter.
        vec![
            TensorDesc { numel: world * 4096 - 150, dtype: Dtype::F16 },
            TensorDesc { numel: 100, dtype: Dtype::Bf16 },
        ]
    } else {
        (0..rng.range(1, 5))
            .map(|_| TensorDesc {
                numel: sizes[rng.range(0, 7) as usize],
                dtype: dtypes[rng.range(0, 2) as usize],
            })
            .collect()
    };
    let config = AccumulatorConfig {
        normalize: modes[round % 4],
        loss_reduction: if rng.range(0, 1) == 0 { LossReduction::Mean } else { LossReduction::Sum },
        // Small enough that clipping acts in most windows where it is on.
        max_grad_norm: if round % 3 == 2 { 1e-4 } else { 0.0 },
        bucket_numel: rng.range(1, 30_000) as usize,
        wire: if round % 4 == 1 { Dtype::Bf16 } else { Dtype::F32 },
        ..AccumulatorConfig::default()
    };
    let windows = (0..rng.range(2, 3))
        .map(|window| {
            let last = if rng.range(0, 2) == 0 { Style::Final } else { Style::Hooks };
            let poison = round % 5 == 3 && window == 1;
            (0..world)
                .map(|rank| {
                    let n = rng.range(1, 3) as usize;
                    (0..n)
                        .map(|m| {
                            let scale = 2f32.powi(rng.range(0, 14) as i32);
                            let style = if m + 1 == n {
                                last
                            } else if rng.range(0, 1) == 0 {
                                Style::Add
                            } else {
                                Style::Hooks
                            };
                            let bad = poison && rank == world - 1 && m == 0;
                            let grads = descs
                                .iter()
                                .map(|d| HostGrad::random(rng, d.dtype, d.numel, scale, bad))
                                .collect();
                            Micro { scale, count: rng.range(1, 9), grads, style }
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    ShardRound { descs, config, adopt: round.is_multiple_of(3), windows }
}

/// The f64 reference of one window over the flat layout: the sum over ranks and micro-batches,
/// normalised; with the norm and clipping coefficient, and each element's sum of magnitudes.
struct Reference {
    values: Vec<f64>,
    magnitude: Vec<f64>,
    norm: f64,
    /// The norm of the normalised magnitudes: what a BF16 wire may move the norm by, times
    /// (2^-8 + (W - 1) 2^-24).
    magnitude_norm: f64,
    coef: f64,
    divisor: f64,
}

fn reference(r: &ShardRound, window: &[Vec<Micro>], buckets: &[Range<usize>]) -> Reference {
    // Each tensor at its aligned offset; the padding's sum and magnitude stay 0: exactly 0.
    let offsets = aligned_offsets(&r.descs);
    let len = *offsets.last().unwrap();
    let (mut values, mut magnitude) = (vec![0f64; len], vec![0f64; len]);
    let (mut items, mut micro) = (0u64, 0u64);
    for m in window.iter().flatten() {
        items += m.count;
        micro += 1;
        let weight = r.config.weight(m.count);
        let twice = twice_added(buckets, &r.descs, m.style);
        for (i, (d, g)) in r.descs.iter().zip(&m.grads).enumerate() {
            let at = offsets[i];
            let times = if m.style != Style::Add && Some(i) == twice { 2.0 } else { 1.0 };
            for k in 0..d.numel {
                let v = match d.dtype {
                    Dtype::F32 => g.f32s[k] as f64,
                    Dtype::F16 => from_f16(g.u16s[k]),
                    Dtype::Bf16 => from_bf16(g.u16s[k]),
                };
                let x = v / m.scale as f64 * weight * times;
                values[at + k] += x;
                magnitude[at + k] += x.abs();
            }
        }
    }
    let divisor = r.config.normalize.divisor(items, micro, window.len() as u64) as f64;
    values.iter_mut().for_each(|v| *v /= divisor);
    let norm = values.iter().map(|v| v * v).sum::<f64>().sqrt();
    let magnitude_norm =
        magnitude.iter().map(|m| (m / divisor) * (m / divisor)).sum::<f64>().sqrt();
    let max = r.config.max_grad_norm as f64;
    let coef = if max > 0.0 { (max / (norm + 1e-6)).min(1.0) } else { 1.0 };
    Reference { values, magnitude, norm, magnitude_norm, coef, divisor }
}

/// Bit equality of two infos (NaN norms match any NaN).
fn same_info(a: &SyncInfo, b: &SyncInfo) -> bool {
    let same = |x: f64, y: f64| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
    (a.found_inf, a.total_count, a.microbatches) == (b.found_inf, b.total_count, b.microbatches)
        && same(a.grad_norm, b.grad_norm)
        && same(a.clip_coef, b.clip_coef)
}

/// Whether `got` is `want` bit for bit (NaN matching any NaN) or, off the software GPU, where
/// NCCL's summation order is its own, within a relative 1e-5.
fn close(got: f32, want: f32, exact: bool) -> bool {
    got.to_bits() == want.to_bits()
        || (got.is_nan() && want.is_nan())
        || (!exact && (got - want).abs() <= 1e-5 * want.abs().max(1e-6))
}

/// What one rank's sharded boundary left, per window: its info and its shard.
type RankResult = Vec<(SyncInfo, Range<usize>, Vec<f32>)>;

/// One rank of a round: an unsharded and a sharded CUDA accumulator over NCCL, and a sharded CPU
/// accumulator over the in-process communicator, fed the same micro-batches.
fn run_rank(
    r: &ShardRound,
    rank: usize,
    world: usize,
    id: &[u8; nccl::UNIQUE_ID_BYTES],
    lc: &LocalComm,
    exact: bool,
) -> RankResult {
    let (ctx, stream, device) = rank_device(rank);
    let comm = Arc::new(NcclComm::new(id, rank, world, rank as i32).unwrap());
    Communicator::set_timeout(&*comm, Some(Duration::from_secs(30))).unwrap();
    let sharded_config =
        AccumulatorConfig { sharding: Sharding::ReduceScatter { shards: world, rank }, ..r.config };
    let len = Accumulator::master_len(&r.descs).unwrap();
    // Declared before the accumulator that adopts it, so it outlives it.
    let adopted = DeviceBuffer::zeroed(&ctx, stream.stream, len * 4).unwrap();
    let plain = Accumulator::builder(&r.descs).device(device).config(r.config).build().unwrap();
    let sharded = if r.adopt {
        // SAFETY: `adopted` holds `len` f32 and outlives the accumulator; nothing else uses it.
        unsafe {
            Accumulator::builder(&r.descs)
                .device(device)
                .config(sharded_config)
                .master_buffer(adopted.ptr() as *mut f32, len)
                .build()
        }
        .unwrap()
    } else {
        Accumulator::builder(&r.descs).device(device).config(sharded_config).build().unwrap()
    };
    let cpu = Accumulator::new(sharded_config, &r.descs).unwrap();
    let (range, ptr) = sharded.shard();
    assert_eq!(range, cpu.shard().0, "rank {rank}: the shard is not the CPU accumulator's");
    let mut results = Vec::new();
    for (w, window) in r.windows.iter().enumerate() {
        for m in &window[rank] {
            let gs = Scaler::on(device, ScalerConfig { init_scale: m.scale, ..Default::default() })
                .unwrap();
            let cs =
                Scaler::new(ScalerConfig { init_scale: m.scale, ..Default::default() }).unwrap();
            let uploads: Vec<(DeviceBuffer, u64)> =
                m.grads.iter().map(|g| g.upload(&ctx, stream.stream, (w + rank) % 3)).collect();
            let addresses: Vec<u64> = uploads.iter().map(|u| u.1).collect();
            let views: Vec<Grad<'_>> = m.grads.iter().map(HostGrad::view).collect();
            if m.style == Style::Add {
                plain.add(&gs, &addresses, m.count).unwrap();
                sharded.add(&gs, &addresses, m.count).unwrap();
                cpu.add(&cs, &views, m.count).unwrap();
                continue;
            }
            if m.style == Style::Final {
                plain.begin_final_microbatch(m.count, comm.clone()).unwrap();
                sharded.begin_final_microbatch(m.count, comm.clone()).unwrap();
            } else {
                plain.begin_microbatch(m.count).unwrap();
                sharded.begin_microbatch(m.count).unwrap();
            }
            cpu.begin_microbatch(m.count).unwrap();
            let twice = twice_added(plain.buckets(), &r.descs, m.style);
            for i in (0..r.descs.len()).rev() {
                for _ in 0..if Some(i) == twice { 2 } else { 1 } {
                    plain.add_tensor(&gs, i, addresses[i]).unwrap();
                    sharded.add_tensor(&gs, i, addresses[i]).unwrap();
                    cpu.add_tensor(&cs, i, views[i]).unwrap();
                }
            }
            for a in [&plain, &sharded, &cpu] {
                a.end_microbatch().unwrap();
            }
            if m.style == Style::Final {
                assert_eq!(
                    sharded.add(&gs, &addresses, 1).unwrap_err().kind,
                    ErrorKind::WrongState,
                    "an add after the final micro-batch"
                );
            }
        }
        let what = format!("rank {rank} window {w} {:?} {:?} adopt {}", r.descs, r.config, r.adopt);
        let want = plain.sync(Some(&*comm)).unwrap();
        let got = sharded.sync(Some(&*comm)).unwrap();
        let on_cpu = cpu.sync(Some(lc)).unwrap();
        assert!(same_info(&got, &want), "{what}: sharded {got:?}, all-reduce {want:?}");
        assert_eq!(
            (got.found_inf, got.total_count, got.microbatches),
            (on_cpu.found_inf, on_cpu.total_count, on_cpu.microbatches),
            "{what}"
        );
        assert!(same_info(&got, &on_cpu) || !exact, "{what}: CUDA {got:?}, CPU {on_cpu:?}");
        // The all-reduce's master in the flat layout, zeros in the padding.
        let mut flat = vec![0f32; len];
        for (i, (d, &at)) in r.descs.iter().zip(&aligned_offsets(&r.descs)).enumerate() {
            plain.read_master(i, &mut flat[at..at + d.numel]).unwrap();
        }
        let mut shard = vec![0f32; range.len()];
        if !shard.is_empty() {
            // The shard's device address, read on the accumulator's stream after its sync.
            DeviceBuffer::adopt(&ctx, stream.stream, ptr as u64, range.len() * 4)
                .read(&mut shard)
                .unwrap();
        }
        // SAFETY: the CPU accumulator's shard, unwritten until its next micro-batch.
        let cpu_shard = unsafe { std::slice::from_raw_parts(cpu.shard().1, range.len()) };
        for (k, (&s, i)) in shard.iter().zip(range.clone()).enumerate() {
            assert!(
                close(s, flat[i], exact),
                "{what}: shard element {k} (master {i}): {s:e}, the all-reduce has {:e}",
                flat[i]
            );
            assert!(
                close(s, cpu_shard[k], exact),
                "{what}: shard element {k} (master {i}): {s:e}, the CPU has {:e}",
                cpu_shard[k]
            );
        }
        results.push((got, range.clone(), shard));
    }
    results
}

/// Random layouts, dtypes, normalisations and clipping over several windows, each rank's last
/// micro-batch through `add`, hooks or the final micro-batch's early reductions, with owned and
/// adopted masters: every rank's shard holds the unsharded CUDA sync's bits in its range (on the
/// software GPU also the sharded CPU accumulator's, whose sums are in rank order too) and the f64
/// reference's values; the info is the all-reduce's on every rank.
fn sharded_rounds(world: usize, test: &str) {
    let mut rng = Rng::fresh(test);
    let exact = std::env::var("GRADACC_SIMGPU").as_deref() == Ok("1");
    for round in 0..12 {
        let r = random_round(&mut rng, world, round);
        let id = nccl::unique_id().unwrap();
        let locals = LocalComm::group(world).unwrap();
        let results: Vec<RankResult> =
            within(Duration::from_secs(300), "a sharded round", move || {
                let r = &r;
                let results = std::thread::scope(|s| {
                    let handles: Vec<_> = locals
                        .iter()
                        .enumerate()
                        .map(|(rank, lc)| s.spawn(move || run_rank(r, rank, world, &id, lc, exact)))
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
                });
                check_against_reference(r, &results, world, round);
                results
            });
        assert_eq!(results.len(), world);
    }
}

/// The ranks' infos agree, their shards tile the layout, and each value is the f64 reference's.
fn check_against_reference(r: &ShardRound, results: &[RankResult], world: usize, round: usize) {
    let len = Accumulator::master_len(&r.descs).unwrap();
    let buckets = Accumulator::new(r.config, &r.descs).unwrap().buckets().to_vec();
    for (w, window) in r.windows.iter().enumerate() {
        let what = format!("round {round} window {w} {:?} {:?}", r.descs, r.config);
        let info = results[0][w].0;
        for (rank, rr) in results.iter().enumerate() {
            assert!(
                same_info(&rr[w].0, &info),
                "{what}: rank {rank} reports {:?}, rank 0 {info:?}",
                rr[w].0
            );
        }
        let covered: usize = results.iter().map(|rr| rr[w].1.len()).sum();
        assert_eq!(covered, len, "{what}: the shards do not cover the layout");
        if info.found_inf {
            continue;
        }
        let want = reference(r, window, &buckets);
        assert_eq!(
            info.total_count,
            window.iter().flatten().map(|m| m.count).sum::<u64>(),
            "{what}"
        );
        // The BF16 wire rounds each contribution once: each element moves by at most
        // (2^-8 + (W - 1) 2^-24) of its magnitude, and the norm by as much of the magnitudes' norm.
        let bf16 = if r.config.wire == Dtype::Bf16 {
            2f64.powi(-8) + (world as f64 - 1.0) * 2f64.powi(-24)
        } else {
            0.0
        };
        let norm_tol = 1e-5 * want.norm + 1e-12 + bf16 * want.magnitude_norm;
        assert!(
            (info.grad_norm - want.norm).abs() <= norm_tol,
            "{what}: norm {} vs {}",
            info.grad_norm,
            want.norm
        );
        let clip_tol = (1e-5 + norm_tol / want.norm.max(1e-30)) * want.coef;
        assert!(
            (info.clip_coef - want.coef).abs() <= clip_tol,
            "{what}: clip {} vs {}",
            info.clip_coef,
            want.coef
        );
        for rr in results {
            let (_, range, shard) = &rr[w];
            for (&got, i) in shard.iter().zip(range.clone()) {
                let expect = want.values[i] * want.coef;
                let tol = (4e-6 + bf16) * want.magnitude[i] / want.divisor * want.coef
                    + want.values[i].abs() * (info.clip_coef - want.coef).abs()
                    + 1e-30;
                assert!(
                    (got as f64 - expect).abs() <= tol,
                    "{what}: element {i}: {got} vs {expect} (tol {tol}), world {world}"
                );
            }
        }
    }
}

/// Two tests of `rounds`: `$two` at two ranks, where there are two devices, and `$three` at three
/// (see [`at_three_ranks`]).
macro_rules! at_two_and_three_ranks {
    ($two:ident, $three:ident, $rounds:ident) => {
        #[test]
        fn $two() {
            if !gpus_or_skip(2) {
                return;
            }
            $rounds(2, stringify!($two));
        }

        #[test]
        fn $three() {
            at_three_ranks(stringify!($three), $rounds);
        }
    };
}

at_two_and_three_ranks!(
    sharded_boundary_holds_the_all_reduce_shard_at_two_ranks,
    sharded_boundary_holds_the_all_reduce_shard_at_three_ranks,
    sharded_rounds
);

/// Runs `rounds(3, test)` where there are three devices: on real GPUs only where there are; on
/// the software GPU, whose device count is fixed when it loads, in a child process with three.
fn at_three_ranks(test: &str, rounds: fn(usize, &str)) {
    at_devices(3, test, |test| rounds(3, test));
}

/// [`common::cuda::at_devices`] with this machine's device count.
fn at_devices(devices: i32, test: &str, f: impl FnOnce(&str)) {
    common::cuda::at_devices(devices, nccl_devices(), test, f);
}

/// A sharded CUDA accumulator synced (or its final micro-batch begun) on an NCCL group of another
/// size or rank fails on every rank, never hanging and keeping every window; so does a group whose
/// ranks disagree on sharding; and a sync without a communicator fails alone.
#[test]
fn sharded_sync_on_a_mismatched_nccl_group_fails_on_every_rank() {
    if !gpus_or_skip(2) {
        return;
    }
    let rs = |shards, rank| Sharding::ReduceScatter { shards, rank };
    // (shards, rank) per rank, and the error each rank sees; the last case gives each rank a
    // group of its own.
    let cases: [([(Sharding, ErrorKind); 2], bool); 5] = [
        ([(rs(3, 0), ErrorKind::InvalidArgument), (rs(3, 1), ErrorKind::InvalidArgument)], true),
        ([(rs(2, 1), ErrorKind::InvalidArgument), (rs(2, 0), ErrorKind::InvalidArgument)], true),
        ([(rs(2, 0), ErrorKind::PeerFailure), (rs(2, 0), ErrorKind::InvalidArgument)], true),
        ([(rs(2, 0), ErrorKind::SizeMismatch), (Sharding::None, ErrorKind::SizeMismatch)], true),
        ([(rs(2, 0), ErrorKind::InvalidArgument), (rs(2, 1), ErrorKind::InvalidArgument)], false),
    ];
    within(Duration::from_secs(240), "syncs on mismatched groups", move || {
        for (case, (ranks, shared)) in cases.into_iter().enumerate() {
            let ids = [nccl::unique_id().unwrap(), nccl::unique_id().unwrap()];
            std::thread::scope(|s| {
                for (rank, (sharding, want)) in ranks.into_iter().enumerate() {
                    let ids = &ids;
                    s.spawn(move || {
                        let (id, at, world) =
                            if shared { (&ids[0], rank, 2) } else { (&ids[rank], 0, 1) };
                        let (ctx, stream, device) = rank_device(rank);
                        let comm = Arc::new(NcclComm::new(id, at, world, rank as i32).unwrap());
                        Communicator::set_timeout(&*comm, Some(Duration::from_secs(20))).unwrap();
                        let tensors = [TensorDesc { numel: 10_000, dtype: Dtype::F32 }];
                        let acc = Accumulator::builder(&tensors)
                            .device(device)
                            .config(AccumulatorConfig { sharding, ..Default::default() })
                            .build()
                            .unwrap();
                        let one = Scaler::on(
                            device,
                            ScalerConfig { init_scale: 1.0, ..Default::default() },
                        )
                        .unwrap();
                        let grad = DeviceBuffer::from_slice(&ctx, stream.stream, &[2.0f32; 10_000])
                            .unwrap();
                        acc.add(&one, &[grad.ptr()], 1).unwrap();
                        let what = format!("case {case} rank {rank} {sharding:?}");
                        let e = acc.begin_final_microbatch(1, comm.clone()).unwrap_err();
                        assert_eq!(e.kind, want, "{what}: begin_final_microbatch: {e}");
                        let e = acc.sync(Some(&*comm)).unwrap_err();
                        assert_eq!(e.kind, want, "{what}: sync: {e}");
                        let mut m = vec![0f32; 10_000];
                        acc.read_master(0, &mut m).unwrap();
                        assert!(m.iter().all(|&v| v == 2.0), "{what}: the window changed");
                        if let Sharding::ReduceScatter { shards: 2, .. } = sharding {
                            assert_eq!(
                                acc.sync(None).unwrap_err().kind,
                                ErrorKind::InvalidArgument,
                                "{what}: a sync with no communicator"
                            );
                        }
                    });
                }
            });
        }
    });
}

/// A round of sharded accumulation: every rank adds the same number of whole micro-batches per
/// window (every micro-batch is a collective), with random layouts, dtypes, normalisations and
/// clipping. Round 0 has hundreds of small tensors, so a stripe needs several launches; in every
/// fifth round from the fourth, one rank's first micro-batch of window 1 holds an inf or NaN.
fn accumulate_round(rng: &mut Rng, world: usize, round: usize) -> ShardRound {
    let sizes = [1usize, 3, 64, 4095, 4097, 5000, 12289, 40_000];
    let dtypes = [Dtype::F32, Dtype::F16, Dtype::Bf16];
    let modes =
        [Normalize::ByCount, Normalize::ByMicrobatches, Normalize::ByWorld, Normalize::None];
    let descs: Vec<TensorDesc> = if round == 0 {
        (0..600)
            .map(|i| TensorDesc { numel: rng.range(3, 64) as usize, dtype: dtypes[i % 3] })
            .collect()
    } else {
        (0..rng.range(1, 5))
            .map(|_| TensorDesc {
                numel: sizes[rng.range(0, 7) as usize],
                dtype: dtypes[rng.range(0, 2) as usize],
            })
            .collect()
    };
    let config = AccumulatorConfig {
        normalize: modes[round % 4],
        loss_reduction: if rng.range(0, 1) == 0 { LossReduction::Mean } else { LossReduction::Sum },
        max_grad_norm: if round % 3 == 2 { 1e-4 } else { 0.0 },
        bucket_numel: if round == 0 { 8192 * world } else { rng.range(1, 30_000) as usize },
        wire: if round % 4 == 1 || round % 4 == 2 { Dtype::Bf16 } else { Dtype::F32 },
        ..AccumulatorConfig::default()
    };
    let windows = (0..rng.range(2, 3))
        .map(|window| {
            let n = rng.range(1, 3) as usize;
            let poison = round % 5 == 3 && window == 1;
            (0..world)
                .map(|rank| {
                    (0..n)
                        .map(|m| {
                            let scale = 2f32.powi(rng.range(0, 14) as i32);
                            let bad = poison && rank == world - 1 && m == 0;
                            let grads = descs
                                .iter()
                                .map(|d| HostGrad::random(rng, d.dtype, d.numel, scale, bad))
                                .collect();
                            Micro { scale, count: rng.range(1, 9), grads, style: Style::Add }
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    ShardRound { descs, config, adopt: false, windows }
}

/// One rank of a sharded accumulation: a CUDA accumulator over NCCL and a CPU one over the
/// in-process communicator, fed the same micro-batches. Each window's shard and info must be the
/// CPU's (bit for bit where NCCL sums in rank order, as the software GPU does). In window 1 the
/// window is saved after its first micro-batch (the CPU's bytes on the software GPU), reset,
/// overwritten by another micro-batch, reset and loaded back; in window 2 merged back instead.
fn run_accumulate_rank(
    r: &ShardRound,
    rank: usize,
    world: usize,
    id: &[u8; nccl::UNIQUE_ID_BYTES],
    lc: Arc<dyn Communicator>,
    exact: bool,
) -> RankResult {
    let (ctx, stream, device) = rank_device(rank);
    let comm: Arc<dyn Communicator> =
        Arc::new(NcclComm::new(id, rank, world, rank as i32).unwrap());
    comm.set_timeout(Some(Duration::from_secs(30))).unwrap();
    let config =
        AccumulatorConfig { sharding: Sharding::Accumulate { shards: world, rank }, ..r.config };
    let acc = Accumulator::builder(&r.descs)
        .device(device)
        .config(config)
        .communicator(comm.clone())
        .build()
        .unwrap();
    let cpu = Accumulator::builder(&r.descs).config(config).communicator(lc).build().unwrap();
    let (range, ptr) = acc.shard();
    assert_eq!(range, cpu.shard().0, "rank {rank}: the shard is not the CPU accumulator's");
    let mut results = Vec::new();
    for (w, window) in r.windows.iter().enumerate() {
        let what = format!("rank {rank} window {w} {} tensors {:?}", r.descs.len(), r.config);
        for (m, micro) in window[rank].iter().enumerate() {
            let gs =
                Scaler::on(device, ScalerConfig { init_scale: micro.scale, ..Default::default() })
                    .unwrap();
            let cs = Scaler::new(ScalerConfig { init_scale: micro.scale, ..Default::default() })
                .unwrap();
            let uploads: Vec<(DeviceBuffer, u64)> = micro
                .grads
                .iter()
                .map(|g| g.upload(&ctx, stream.stream, (w + rank + m) % 3))
                .collect();
            let addresses: Vec<u64> = uploads.iter().map(|u| u.1).collect();
            let views: Vec<Grad<'_>> = micro.grads.iter().map(HostGrad::view).collect();
            acc.add(&gs, &addresses, micro.count).unwrap();
            cpu.add(&cs, &views, micro.count).unwrap();
            if m == 0 && (w == 1 || w == 2) {
                let bytes = acc.save_window().unwrap();
                assert!(
                    bytes == cpu.save_window().unwrap() || !exact,
                    "{what}: the saved window is not the CPU's"
                );
                // Another micro-batch (on every rank) overwrites the shard; then the saved window
                // comes back.
                acc.reset().unwrap();
                let other = Scaler::on(
                    device,
                    ScalerConfig { init_scale: micro.scale * 2.0, ..Default::default() },
                )
                .unwrap();
                acc.add(&other, &addresses, micro.count).unwrap();
                acc.reset().unwrap();
                if w == 1 {
                    acc.load_window(&bytes).unwrap();
                } else {
                    acc.merge_window(&bytes).unwrap();
                }
                assert_eq!(
                    acc.save_window().unwrap(),
                    bytes,
                    "{what}: the window did not come back"
                );
            }
        }
        // Through the creation communicator, named or not.
        let got = acc.sync(if w % 2 == 0 { None } else { Some(&*comm) }).unwrap();
        let on_cpu = cpu.sync(None).unwrap();
        assert_eq!(
            (got.found_inf, got.total_count, got.microbatches),
            (on_cpu.found_inf, on_cpu.total_count, on_cpu.microbatches),
            "{what}"
        );
        assert!(same_info(&got, &on_cpu) || !exact, "{what}: CUDA {got:?}, CPU {on_cpu:?}");
        if window
            .iter()
            .flatten()
            .any(|m| m.grads.iter().any(|g| g.f32s.iter().any(|v| !v.is_finite())))
        {
            assert!(
                got.found_inf,
                "{what}: a rank's gradient overflowed, but the info says {got:?}"
            );
        }
        let mut shard = vec![0f32; range.len()];
        if !shard.is_empty() {
            DeviceBuffer::adopt(&ctx, stream.stream, ptr as u64, range.len() * 4)
                .read(&mut shard)
                .unwrap();
        }
        // SAFETY: the CPU accumulator's shard, unwritten until its next micro-batch.
        let cpu_shard = unsafe { std::slice::from_raw_parts(cpu.shard().1, range.len()) };
        for (k, (&s, &c)) in shard.iter().zip(cpu_shard).enumerate() {
            assert!(
                close(s, c, exact),
                "{what}: shard element {k} (master {}): {s:e}, the CPU has {c:e}",
                range.start + k
            );
        }
        // A tensor inside the shard reads as its part of the shard; any other is refused.
        let offsets = aligned_offsets(&r.descs);
        for (i, d) in r.descs.iter().enumerate() {
            let t = offsets[i]..offsets[i] + d.numel;
            assert_eq!(acc.offset(i).unwrap(), t.start, "{what}: tensor {i}'s offset");
            let mut out = vec![0f32; d.numel];
            if t.start >= range.start && t.end <= range.end {
                acc.read_master(i, &mut out).unwrap();
                assert!(
                    out.iter()
                        .zip(&shard[t.start - range.start..t.end - range.start])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: tensor {i}"
                );
            } else {
                assert_eq!(
                    acc.read_master(i, &mut out).unwrap_err().kind,
                    ErrorKind::InvalidArgument,
                    "{what}: tensor {i} {t:?}"
                );
            }
        }
        results.push((got, range.clone(), shard));
    }
    results
}

/// Sharded accumulation on CUDA at `world` ranks, round after round: every rank's shard and info
/// are the sharded CPU accumulation's and the f64 reference's, and the info is every rank's.
fn accumulate_rounds(world: usize, test: &str) {
    let mut rng = Rng::fresh(test);
    let exact = std::env::var("GRADACC_SIMGPU").as_deref() == Ok("1");
    for round in 0..10 {
        let r = accumulate_round(&mut rng, world, round);
        let id = nccl::unique_id().unwrap();
        let locals: Vec<Arc<dyn Communicator>> = LocalComm::group(world)
            .unwrap()
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        within(Duration::from_secs(300), "a sharded accumulation round", move || {
            let r = &r;
            let results: Vec<RankResult> = std::thread::scope(|s| {
                let handles: Vec<_> = locals
                    .into_iter()
                    .enumerate()
                    .map(|(rank, lc)| {
                        s.spawn(move || run_accumulate_rank(r, rank, world, &id, lc, exact))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            check_against_reference(r, &results, world, round);
        });
    }
}

at_two_and_three_ranks!(
    sharded_accumulation_matches_the_cpu_at_two_ranks,
    sharded_accumulation_matches_the_cpu_at_three_ranks,
    accumulate_rounds
);

/// What a sharded CUDA accumulation refuses: a host communicator, an NCCL communicator on another
/// device, and a hybrid boundary whose replica group is the shard group. After the refusals whole
/// micro-batches still add, and a CUDA scaler's update reads the boundary's overflow flag.
#[test]
fn sharded_accumulation_on_cuda_refuses_what_it_cannot_do() {
    if !gpus_or_skip(2) {
        return;
    }
    within(Duration::from_secs(120), "sharded accumulation's refusals", || {
        let id = nccl::unique_id().unwrap();
        let locals: Vec<Arc<dyn Communicator>> = LocalComm::group(2)
            .unwrap()
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        std::thread::scope(|s| {
            for (rank, local) in locals.into_iter().enumerate() {
                s.spawn(move || {
                    let (ctx, stream, device) = rank_device(rank);
                    let comm = pair_comm(&id, rank, Duration::from_secs(20));
                    let tensors = [TensorDesc { numel: 10_000, dtype: Dtype::F32 }];
                    let config = AccumulatorConfig {
                        sharding: Sharding::Accumulate { shards: 2, rank },
                        ..Default::default()
                    };
                    let e = Accumulator::builder(&tensors)
                        .device(device)
                        .config(config)
                        .communicator(local.clone())
                        .build()
                        .unwrap_err();
                    assert_eq!(e.kind, ErrorKind::DeviceMismatch, "a host communicator: {e}");
                    let other =
                        Device::Cuda { ordinal: 1 - rank as i32, stream: std::ptr::null_mut() };
                    let e = Accumulator::builder(&tensors)
                        .device(other)
                        .config(config)
                        .communicator(comm.clone())
                        .build()
                        .unwrap_err();
                    assert_eq!(
                        e.kind,
                        ErrorKind::DeviceMismatch,
                        "a communicator on another device: {e}"
                    );

                    let acc = Accumulator::builder(&tensors)
                        .device(device)
                        .config(config)
                        .communicator(comm.clone())
                        .build()
                        .unwrap();
                    let scaler =
                        Scaler::on(device, ScalerConfig { init_scale: 4.0, ..Default::default() })
                            .unwrap();
                    // The shard group as its own replica group: its ranks hold different shards.
                    let e = acc.sync_hybrid(&*comm, &*comm).unwrap_err();
                    assert_eq!(
                        e.kind,
                        ErrorKind::SizeMismatch,
                        "rank {rank}: a hybrid boundary over one group: {e}"
                    );

                    let mut values = vec![2.0f32 + rank as f32; 10_000];
                    values[rank * 7000] = f32::INFINITY;
                    let grad = DeviceBuffer::from_slice(&ctx, stream.stream, &values).unwrap();
                    acc.add(&scaler, &[grad.ptr()], 1).unwrap();
                    let info = acc.sync(None).unwrap();
                    assert_eq!(
                        (info.found_inf, info.total_count, info.microbatches),
                        (true, 2, 2),
                        "rank {rank}"
                    );
                    assert_eq!(
                        scaler.update_from(&[&acc], true).unwrap(),
                        Some(true),
                        "rank {rank}: the scaler's update"
                    );
                    assert_eq!(
                        scaler.scale().unwrap(),
                        2.0,
                        "rank {rank}: the scale did not back off"
                    );

                    // A window without overflow, each rank's gradient unscaled by 2, summed over
                    // the ranks and normalised by the 2 items: (2 / 2 + 3 / 2) / 2 everywhere.
                    let grad = DeviceBuffer::from_slice(
                        &ctx,
                        stream.stream,
                        &vec![2.0f32 + rank as f32; 10_000],
                    )
                    .unwrap();
                    acc.add(&scaler, &[grad.ptr()], 1).unwrap();
                    let info = acc.sync(Some(&*comm)).unwrap();
                    assert!(!info.found_inf, "rank {rank}: {info:?}");
                    let (range, _) = acc.shard();
                    // The tensor padded to 10_048 elements (a multiple of 64).
                    assert_eq!(range, if rank == 0 { 0..8192 } else { 8192..10_048 });
                    let mut shard = vec![0f32; range.len()];
                    let e = acc.read_master(0, &mut vec![0f32; 10_000]).unwrap_err();
                    assert_eq!(
                        e.kind,
                        ErrorKind::InvalidArgument,
                        "rank {rank}: a tensor outside the shard: {e}"
                    );
                    DeviceBuffer::adopt(&ctx, stream.stream, acc.shard().1 as u64, range.len() * 4)
                        .read(&mut shard)
                        .unwrap();
                    for (at, &v) in range.clone().zip(&shard) {
                        let want = if at < 10_000 { 1.25f32 } else { 0.0 };
                        assert_eq!(v.to_bits(), want.to_bits(), "rank {rank}: element {at}");
                    }
                });
            }
        });
    });
}

/// The ranks of a sharded CUDA accumulation check each other once, at the first micro-batch: an
/// invalid add on one rank fails there and with PEER_FAILURE on the other; ranks with different
/// layouts, or one adding while the other syncs, fail together; nothing is added, and the ranks
/// then accumulate together.
#[test]
fn sharded_accumulation_on_cuda_checks_the_ranks_at_the_first_micro_batch() {
    if !gpus_or_skip(2) {
        return;
    }
    within(Duration::from_secs(120), "the first micro-batch's check", || {
        // Per case, per rank: its tensor's length, whether its add is invalid, whether it syncs
        // first, and the error it sees.
        let cases = [
            [
                (10_000, false, false, ErrorKind::PeerFailure),
                (10_000, true, false, ErrorKind::SizeMismatch),
            ],
            [
                (10_000, false, false, ErrorKind::SizeMismatch),
                (10_001, false, false, ErrorKind::SizeMismatch),
            ],
            [
                (10_000, false, false, ErrorKind::SizeMismatch),
                (10_000, false, true, ErrorKind::SizeMismatch),
            ],
        ];
        for (case, ranks) in cases.into_iter().enumerate() {
            let id = nccl::unique_id().unwrap();
            std::thread::scope(|s| {
                for (rank, (numel, invalid, syncs, want)) in ranks.into_iter().enumerate() {
                    s.spawn(move || {
                        let (ctx, stream, device) = rank_device(rank);
                        let comm = pair_comm(&id, rank, Duration::from_secs(20));
                        let config = AccumulatorConfig {
                            sharding: Sharding::Accumulate { shards: 2, rank },
                            ..Default::default()
                        };
                        let acc = Accumulator::builder(&[TensorDesc { numel, dtype: Dtype::F32 }])
                            .device(device)
                            .config(config)
                            .communicator(comm.clone())
                            .build()
                            .unwrap();
                        let scaler = Scaler::on(
                            device,
                            ScalerConfig { init_scale: 1.0, ..Default::default() },
                        )
                        .unwrap();
                        let grad =
                            DeviceBuffer::from_slice(&ctx, stream.stream, &vec![1.0f32; numel])
                                .unwrap();
                        let what = format!("case {case} rank {rank}");
                        let e = if syncs {
                            acc.sync(None).unwrap_err()
                        } else if invalid {
                            acc.add(&scaler, &[grad.ptr(), grad.ptr()], 1).unwrap_err()
                        } else {
                            acc.add(&scaler, &[grad.ptr()], 1).unwrap_err()
                        };
                        assert_eq!(e.kind, want, "{what}: {e}");
                        if case == 0 {
                            acc.add(&scaler, &[grad.ptr()], 1).unwrap();
                            let info = acc.sync(None).unwrap();
                            assert_eq!(
                                (info.total_count, info.microbatches, info.grad_norm),
                                (2, 2, 10_000f64.sqrt()),
                                "{what}"
                            );
                        }
                    });
                }
            });
        }
    });
}

#[test]
fn sharded_accumulation_on_cuda_never_pairs_a_refused_call_with_the_peers() {
    if !gpus_or_skip(2) {
        return;
    }
    within(Duration::from_secs(120), "a refused call after the first micro-batch", || {
        let id = nccl::unique_id().unwrap();
        let numel = 10_000;
        // Both first micro-batches are in before rank 1 refuses: its abort could otherwise reach
        // rank 0 while rank 0's first add is still enqueuing (a busy machine delays it), and that
        // add would rightly fail.
        let first_added = Barrier::new(2);
        std::thread::scope(|s| {
            for rank in 0..2usize {
                let first_added = &first_added;
                s.spawn(move || {
                    let (ctx, stream, device) = rank_device(rank);
                    let comm = pair_comm(&id, rank, Duration::from_secs(5));
                    let config = AccumulatorConfig {
                        sharding: Sharding::Accumulate { shards: 2, rank },
                        ..Default::default()
                    };
                    let acc = Accumulator::builder(&[TensorDesc { numel, dtype: Dtype::F32 }])
                        .device(device)
                        .config(config)
                        .communicator(comm.clone())
                        .build()
                        .unwrap();
                    let scaler =
                        Scaler::on(device, ScalerConfig { init_scale: 1.0, ..Default::default() })
                            .unwrap();
                    let grad = DeviceBuffer::from_slice(&ctx, stream.stream, &vec![1.0f32; numel])
                        .unwrap();
                    // The first micro-batch checks the layouts.
                    let first = acc.add(&scaler, &[grad.ptr()], 1);
                    first_added.wait();
                    first.unwrap();
                    let t = std::time::Instant::now();
                    if rank == 1 {
                        // Refused after the check: this rank aborts its communicator rather than
                        // ever pairing a later collective with rank 0's reduce-scatter.
                        let e = acc.add(&scaler, &[grad.ptr(), grad.ptr()], 1).unwrap_err();
                        assert_eq!(e.kind, ErrorKind::SizeMismatch, "{e}");
                        assert_eq!(acc.sync(None).unwrap_err().kind, ErrorKind::CommFailure);
                        // Its own window is intact and saves (the stream drained on the abort).
                        assert!(acc.save_window().is_ok());
                    } else {
                        // The second micro-batch's reduce-scatter never meets its peer: it fails
                        // when enqueued after the peer's abort, or reading the window waits no
                        // longer than the communicator's timeout; either way the window is lost.
                        match acc.add(&scaler, &[grad.ptr()], 1) {
                            Err(e) => assert!(
                                e.kind == ErrorKind::CommFailure
                                    && e.message.ends_with("(the window was discarded)"),
                                "{e}"
                            ),
                            Ok(()) => {
                                let e = acc.save_window().unwrap_err();
                                assert!(
                                    matches!(e.kind, ErrorKind::Timeout | ErrorKind::CommFailure),
                                    "{e}"
                                );
                            }
                        }
                        assert!(acc.sync(None).is_err());
                    }
                    // The 5 s timeout bounds the wait; the margin is for a busy machine.
                    assert!(
                        t.elapsed() < Duration::from_secs(30),
                        "rank {rank} waited {:?}",
                        t.elapsed()
                    );
                });
            }
        });
    });
}

/// The groups of one rank of a hybrid grid, on NCCL and on the in-process communicators: rank
/// `g = a * shards + i` is shard `i` of shard group `a` and replica `a` of replica group `i`.
struct GridRank {
    g: usize,
    shards: usize,
    replicas: usize,
    shard_id: [u8; nccl::UNIQUE_ID_BYTES],
    replica_id: [u8; nccl::UNIQUE_ID_BYTES],
    shard_local: Arc<dyn Communicator>,
    replica_local: Arc<dyn Communicator>,
}

/// Every rank's groups of a `shards` × `replicas` grid.
fn grid(shards: usize, replicas: usize) -> Vec<GridRank> {
    let shard_ids: Vec<_> = (0..replicas).map(|_| nccl::unique_id().unwrap()).collect();
    let replica_ids: Vec<_> = (0..shards).map(|_| nccl::unique_id().unwrap()).collect();
    let group = |n| {
        LocalComm::group(n)
            .unwrap()
            .into_iter()
            .map(|c| Some(Arc::new(c) as Arc<dyn Communicator>))
            .collect::<Vec<_>>()
    };
    let mut shard_locals: Vec<_> = (0..replicas).map(|_| group(shards)).collect();
    let mut replica_locals: Vec<_> = (0..shards).map(|_| group(replicas)).collect();
    (0..shards * replicas)
        .map(|g| {
            let (a, i) = (g / shards, g % shards);
            GridRank {
                g,
                shards,
                replicas,
                shard_id: shard_ids[a],
                replica_id: replica_ids[i],
                shard_local: shard_locals[a][i].take().unwrap(),
                replica_local: replica_locals[i][a].take().unwrap(),
            }
        })
        .collect()
}

impl GridRank {
    /// This rank's NCCL shard and replica groups on its device.
    fn nccl(&self) -> (Arc<dyn Communicator>, Arc<dyn Communicator>) {
        let (a, i, g) = (self.g / self.shards, self.g % self.shards, self.g as i32);
        let comm: Arc<dyn Communicator> =
            Arc::new(NcclComm::new(&self.shard_id, i, self.shards, g).unwrap());
        let reps: Arc<dyn Communicator> =
            Arc::new(NcclComm::new(&self.replica_id, a, self.replicas, g).unwrap());
        for c in [&comm, &reps] {
            c.set_timeout(Some(Duration::from_secs(30))).unwrap();
        }
        (comm, reps)
    }
}

/// One micro-batch of one rank, added alike to a CUDA and a CPU accumulator in its style; hooks
/// arrive in `order` (tensor `twice` in two contributions), and a final micro-batch reduces
/// early over `comm`.
#[allow(clippy::too_many_arguments)]
fn add_alike(
    gpu: &Accumulator,
    cpu: &Accumulator,
    m: &Micro,
    gs: &Scaler,
    cs: &Scaler,
    addresses: &[u64],
    views: &[Grad<'_>],
    order: &[usize],
    twice: Option<usize>,
    comm: &Arc<dyn Communicator>,
) {
    if m.style == Style::Add {
        gpu.add(gs, addresses, m.count).unwrap();
        cpu.add(cs, views, m.count).unwrap();
        return;
    }
    if m.style == Style::Final {
        gpu.begin_final_microbatch(m.count, comm.clone()).unwrap();
    } else {
        gpu.begin_microbatch(m.count).unwrap();
    }
    cpu.begin_microbatch(m.count).unwrap();
    for &i in order {
        for _ in 0..if Some(i) == twice { 2 } else { 1 } {
            gpu.add_tensor(gs, i, addresses[i]).unwrap();
            cpu.add_tensor(cs, i, views[i]).unwrap();
        }
    }
    gpu.end_microbatch().unwrap();
    cpu.end_microbatch().unwrap();
}

/// The shard a CUDA accumulator holds, read back to the host.
fn read_shard(acc: &Accumulator, ctx: &Arc<Context>, stream: driver::CUstream) -> Vec<f32> {
    let (range, ptr) = acc.shard();
    let mut shard = vec![0f32; range.len()];
    if !shard.is_empty() {
        DeviceBuffer::adopt(ctx, stream, ptr as u64, range.len() * 4).read(&mut shard).unwrap();
    }
    shard
}

/// One rank of a hybrid round: a CUDA accumulator over its NCCL groups and a CPU accumulator over
/// the in-process ones, fed the same micro-batches; every boundary's info and shard must be the
/// CPU's (bit for bit where NCCL sums in rank order, as on the software GPU).
fn run_hybrid_rank(
    r: &ShardRound,
    rank: &GridRank,
    accumulate: bool,
    exact: bool,
) -> Vec<SyncInfo> {
    let (g, shards) = (rank.g, rank.shards);
    let ctx = Context::get(g as i32).unwrap();
    let stream = OwnedStream::new(&ctx).unwrap();
    let device = Device::Cuda { ordinal: g as i32, stream: stream.stream.cast() };
    let (comm, reps) = rank.nccl();
    let len = Accumulator::master_len(&r.descs).unwrap();
    let adopted = DeviceBuffer::zeroed(&ctx, stream.stream, len * 4).unwrap();
    let (gpu, cpu) = if accumulate {
        let config = AccumulatorConfig {
            sharding: Sharding::Accumulate { shards, rank: g % shards },
            ..r.config
        };
        (
            Accumulator::builder(&r.descs)
                .device(device)
                .config(config)
                .communicator(comm.clone())
                .build()
                .unwrap(),
            Accumulator::builder(&r.descs)
                .config(config)
                .communicator(rank.shard_local.clone())
                .build()
                .unwrap(),
        )
    } else {
        let config = AccumulatorConfig {
            sharding: Sharding::ReduceScatter { shards, rank: g % shards },
            ..r.config
        };
        let gpu = if r.adopt {
            // SAFETY: `adopted` holds `len` f32 and outlives the accumulator; nothing else uses it.
            unsafe {
                Accumulator::builder(&r.descs)
                    .device(device)
                    .config(config)
                    .master_buffer(adopted.ptr() as *mut f32, len)
                    .build()
            }
            .unwrap()
        } else {
            Accumulator::builder(&r.descs).device(device).config(config).build().unwrap()
        };
        (gpu, Accumulator::new(config, &r.descs).unwrap())
    };
    let mut infos = Vec::new();
    for (w, window) in r.windows.iter().enumerate() {
        for m in &window[g] {
            let gs = Scaler::on(device, ScalerConfig { init_scale: m.scale, ..Default::default() })
                .unwrap();
            let cs =
                Scaler::new(ScalerConfig { init_scale: m.scale, ..Default::default() }).unwrap();
            let uploads: Vec<(DeviceBuffer, u64)> =
                m.grads.iter().map(|h| h.upload(&ctx, stream.stream, (w + g) % 3)).collect();
            let addresses: Vec<u64> = uploads.iter().map(|u| u.1).collect();
            let views: Vec<Grad<'_>> = m.grads.iter().map(HostGrad::view).collect();
            let order: Vec<usize> = (0..r.descs.len()).rev().collect();
            let twice =
                if accumulate { None } else { twice_added(gpu.buckets(), &r.descs, m.style) };
            add_alike(&gpu, &cpu, m, &gs, &cs, &addresses, &views, &order, twice, &comm);
        }
        let what = format!(
            "grid {shards}x{} rank {g} window {w} {:?} {:?} adopt {}",
            rank.replicas, r.descs, r.config, r.adopt
        );
        let got = gpu.sync_hybrid(&*comm, &*reps).unwrap();
        let want = cpu.sync_hybrid(&*rank.shard_local, &*rank.replica_local).unwrap();
        assert_eq!(
            (got.found_inf, got.total_count, got.microbatches),
            (want.found_inf, want.total_count, want.microbatches),
            "{what}"
        );
        assert!(same_info(&got, &want) || !exact, "{what}: CUDA {got:?}, CPU {want:?}");
        let (range, cpu_ptr) = cpu.shard();
        assert_eq!(range, gpu.shard().0, "{what}");
        let shard = read_shard(&gpu, &ctx, stream.stream);
        // SAFETY: the CPU accumulator's shard, unwritten until its next micro-batch.
        let cpu_shard = unsafe { std::slice::from_raw_parts(cpu_ptr, range.len()) };
        for (k, (&s, &c)) in shard.iter().zip(cpu_shard).enumerate() {
            assert!(
                close(s, c, exact),
                "{what}: shard element {k} (master {}): {s:e}, the CPU has {c:e}",
                range.start + k
            );
        }
        infos.push(got);
    }
    infos
}

/// Hybrid boundaries on a `shards` × `replicas` grid of CUDA devices, under both sharded
/// policies: every rank's shard and info are the CPU's, and every rank of the grid reports the
/// same info.
fn hybrid_rounds(shards: usize, replicas: usize, test: &str) {
    let mut rng = Rng::fresh(test);
    let exact = std::env::var("GRADACC_SIMGPU").as_deref() == Ok("1");
    let world = shards * replicas;
    for round in 0..8 {
        // Odd rounds accumulate sharded; round 0's layout (hundreds of tiny tensors) is an even
        // round's, so the accumulation's rounds start at 1.
        let accumulate = round % 2 == 1;
        let mut r = if accumulate {
            accumulate_round(&mut rng, world, round)
        } else {
            random_round(&mut rng, world, round)
        };
        // The BF16 wire on both policies: the shard group's, or the replicas' after a shard
        // group of one.
        r.config.wire = if round % 4 < 2 { Dtype::Bf16 } else { Dtype::F32 };
        let ranks = grid(shards, replicas);
        within(Duration::from_secs(300), "a hybrid round", move || {
            let r = &r;
            let infos: Vec<Vec<SyncInfo>> = std::thread::scope(|s| {
                let handles: Vec<_> = ranks
                    .iter()
                    .map(|rank| s.spawn(move || run_hybrid_rank(r, rank, accumulate, exact)))
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (g, i) in infos.iter().enumerate() {
                for (w, (a, b)) in i.iter().zip(&infos[0]).enumerate() {
                    assert!(
                        same_info(a, b),
                        "round {round} window {w}: rank {g} reports {a:?}, rank 0 {b:?}"
                    );
                }
            }
        });
    }
}

#[test]
fn hybrid_boundaries_match_the_cpu_at_two_devices() {
    if !gpus_or_skip(2) {
        return;
    }
    hybrid_rounds(1, 2, "hybrid_boundaries_match_the_cpu_at_two_devices (1x2)");
    hybrid_rounds(2, 1, "hybrid_boundaries_match_the_cpu_at_two_devices (2x1)");
}

#[test]
fn hybrid_boundaries_match_the_cpu_at_three_devices() {
    at_devices(3, "hybrid_boundaries_match_the_cpu_at_three_devices", |test| {
        hybrid_rounds(3, 1, &format!("{test} (3x1)"));
        hybrid_rounds(1, 3, &format!("{test} (1x3)"));
    });
}

#[test]
fn hybrid_boundaries_match_the_cpu_on_a_two_by_two_grid() {
    at_devices(4, "hybrid_boundaries_match_the_cpu_on_a_two_by_two_grid", |test| {
        hybrid_rounds(2, 2, test)
    });
}

/// A "replica group" whose ranks hold different shards (both ranks of a shard group, once more)
/// fails the hybrid boundary on every rank with nothing reduced, under both policies; the
/// windows stay whole and sync over the shard group afterwards.
#[test]
fn a_hybrid_sync_over_ranks_of_different_shards_fails_on_every_rank() {
    if !gpus_or_skip(2) {
        return;
    }
    within(Duration::from_secs(120), "a hybrid sync on a stray replica group", || {
        for accumulate in [false, true] {
            let ids = [nccl::unique_id().unwrap(), nccl::unique_id().unwrap()];
            std::thread::scope(|s| {
                for rank in 0..2usize {
                    let ids = &ids;
                    s.spawn(move || {
                        let (ctx, stream, device) = rank_device(rank);
                        let comm: Arc<dyn Communicator> =
                            Arc::new(NcclComm::new(&ids[0], rank, 2, rank as i32).unwrap());
                        let stray: Arc<dyn Communicator> =
                            Arc::new(NcclComm::new(&ids[1], rank, 2, rank as i32).unwrap());
                        comm.set_timeout(Some(Duration::from_secs(20))).unwrap();
                        stray.set_timeout(Some(Duration::from_secs(20))).unwrap();
                        let tensors = [TensorDesc { numel: 10_000, dtype: Dtype::F32 }];
                        let acc = if accumulate {
                            let config = AccumulatorConfig {
                                sharding: Sharding::Accumulate { shards: 2, rank },
                                ..Default::default()
                            };
                            Accumulator::builder(&tensors)
                                .device(device)
                                .config(config)
                                .communicator(comm.clone())
                                .build()
                                .unwrap()
                        } else {
                            let config = AccumulatorConfig {
                                sharding: Sharding::ReduceScatter { shards: 2, rank },
                                ..Default::default()
                            };
                            Accumulator::builder(&tensors)
                                .device(device)
                                .config(config)
                                .build()
                                .unwrap()
                        };
                        let one = Scaler::on(
                            device,
                            ScalerConfig { init_scale: 1.0, ..Default::default() },
                        )
                        .unwrap();
                        let grad = DeviceBuffer::from_slice(&ctx, stream.stream, &[2.0f32; 10_000])
                            .unwrap();
                        acc.add(&one, &[grad.ptr()], 1).unwrap();
                        let what = format!("rank {rank}, accumulate {accumulate}");
                        let e = acc.sync_hybrid(&*comm, &*stray).unwrap_err();
                        assert_eq!(e.kind, ErrorKind::SizeMismatch, "{what}: {e}");
                        let info = acc.sync(Some(&*comm)).unwrap();
                        assert_eq!((info.total_count, info.microbatches), (2, 2), "{what}");
                        // (2 + 2) / 2 items everywhere, zeros in the padding (to 10_048).
                        let shard = read_shard(&acc, &ctx, stream.stream);
                        for (at, &v) in acc.shard().0.zip(&shard) {
                            let want = if at < 10_000 { 2.0f32 } else { 0.0 };
                            assert_eq!(v.to_bits(), want.to_bits(), "{what}: element {at}");
                        }
                    });
                }
            });
        }
    });
}

/// The order a rank's hooks deliver its tensors in one micro-batch: the backward's, the
/// forward's or shuffled, with some tensors left out (they contribute zeros).
fn hook_order(rng: &mut Rng, n: usize, kind: usize) -> Vec<usize> {
    let mut order: Vec<usize> = match kind {
        0 => (0..n).rev().collect(),
        1 => (0..n).collect(),
        _ => {
            let mut v: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                v.swap(i, rng.range(0, i as u64) as usize);
            }
            v
        }
    };
    if n > 1 {
        order.retain(|_| rng.range(0, 4) != 0);
    }
    order
}

/// One rank of a round of hooks under sharded accumulation: a CUDA accumulation fed tensor by
/// tensor in each rank's `orders`, a second fed the same micro-batches whole through `add` (an
/// absent tensor as a zero gradient), and a CPU accumulation fed the same hooks. Every boundary's
/// shard and info must be the same bits on all three (CPU: where NCCL sums in rank order).
fn run_hooks_rank(
    r: &ShardRound,
    orders: &[Vec<Vec<usize>>],
    rank: usize,
    world: usize,
    ids: [[u8; nccl::UNIQUE_ID_BYTES]; 2],
    lc: Arc<dyn Communicator>,
    exact: bool,
) {
    let (ctx, stream, device) = rank_device(rank);
    let comms: Vec<Arc<dyn Communicator>> = ids
        .iter()
        .map(|id| {
            let c: Arc<dyn Communicator> =
                Arc::new(NcclComm::new(id, rank, world, rank as i32).unwrap());
            c.set_timeout(Some(Duration::from_secs(30))).unwrap();
            c
        })
        .collect();
    let config =
        AccumulatorConfig { sharding: Sharding::Accumulate { shards: world, rank }, ..r.config };
    let hooks = Accumulator::builder(&r.descs)
        .device(device)
        .config(config)
        .communicator(comms[0].clone())
        .build()
        .unwrap();
    let whole = Accumulator::builder(&r.descs)
        .device(device)
        .config(config)
        .communicator(comms[1].clone())
        .build()
        .unwrap();
    let cpu = Accumulator::builder(&r.descs).config(config).communicator(lc).build().unwrap();
    for (w, window) in r.windows.iter().enumerate() {
        for (m, micro) in window[rank].iter().enumerate() {
            let order = &orders[w][m];
            let gs =
                Scaler::on(device, ScalerConfig { init_scale: micro.scale, ..Default::default() })
                    .unwrap();
            let cs = Scaler::new(ScalerConfig { init_scale: micro.scale, ..Default::default() })
                .unwrap();
            let uploads: Vec<(DeviceBuffer, u64)> =
                micro.grads.iter().map(|g| g.upload(&ctx, stream.stream, (w + m) % 3)).collect();
            let addresses: Vec<u64> = uploads.iter().map(|u| u.1).collect();
            let views: Vec<Grad<'_>> = micro.grads.iter().map(HostGrad::view).collect();
            let zeros: Vec<DeviceBuffer> = r
                .descs
                .iter()
                .map(|d| DeviceBuffer::zeroed(&ctx, stream.stream, d.numel * 4).unwrap())
                .collect();
            let present: Vec<u64> = (0..r.descs.len())
                .map(|i| if order.contains(&i) { addresses[i] } else { zeros[i].ptr() })
                .collect();
            whole.add(&gs, &present, micro.count).unwrap();
            // One accumulation after the other: each rank's issue of an NCCL reduction waits for
            // its peers to issue it, and the CPU's for its peers to reach it.
            hooks.begin_microbatch(micro.count).unwrap();
            for &i in order {
                hooks.add_tensor(&gs, i, addresses[i]).unwrap();
            }
            hooks.end_microbatch().unwrap();
            cpu.begin_microbatch(micro.count).unwrap();
            for &i in order {
                cpu.add_tensor(&cs, i, views[i]).unwrap();
            }
            cpu.end_microbatch().unwrap();
        }
        let what =
            format!("rank {rank} window {w} {:?} {:?} orders {:?}", r.descs, r.config, orders[w]);
        let by_hooks = hooks.sync(None).unwrap();
        let by_add = whole.sync(None).unwrap();
        let on_cpu = cpu.sync(None).unwrap();
        assert!(same_info(&by_hooks, &by_add), "{what}: hooks {by_hooks:?}, add {by_add:?}");
        assert_eq!(
            (by_hooks.found_inf, by_hooks.total_count, by_hooks.microbatches),
            (on_cpu.found_inf, on_cpu.total_count, on_cpu.microbatches),
            "{what}"
        );
        assert!(
            same_info(&by_hooks, &on_cpu) || !exact,
            "{what}: CUDA {by_hooks:?}, CPU {on_cpu:?}"
        );
        let (a, b) =
            (read_shard(&hooks, &ctx, stream.stream), read_shard(&whole, &ctx, stream.stream));
        let (range, cpu_ptr) = cpu.shard();
        // SAFETY: the CPU accumulator's shard, unwritten until its next micro-batch.
        let cpu_shard = unsafe { std::slice::from_raw_parts(cpu_ptr, range.len()) };
        for (k, ((&h, &w), &c)) in a.iter().zip(&b).zip(cpu_shard).enumerate() {
            assert!(close(h, w, true), "{what}: shard element {k}: hooks {h:e}, add {w:e}");
            assert!(
                close(h, c, exact),
                "{what}: shard element {k} (master {}): {h:e}, the CPU has {c:e}",
                range.start + k
            );
        }
    }
}

/// Hooks under sharded accumulation on CUDA at `world` ranks, round after round (see
/// [`run_hooks_rank`]): random layouts, dtypes, normalisations, clipping and overflow; buckets
/// of one tensor and of many; tensors in the backward's, the forward's and shuffled orders, each
/// rank its own, some left out.
fn hooks_rounds(world: usize, test: &str) {
    let mut rng = Rng::fresh(test);
    let exact = std::env::var("GRADACC_SIMGPU").as_deref() == Ok("1");
    for round in 0..10 {
        let mut r = accumulate_round(&mut rng, world, round);
        if round == 0 {
            // Fewer of the tiny tensors (each add_tensor is a launch), still over several buckets.
            r.descs.truncate(60);
            r.config.bucket_numel = 300;
            for window in r.windows.iter_mut().flatten().flatten() {
                window.grads.truncate(60);
            }
        }
        let orders: Vec<Vec<Vec<Vec<usize>>>> = (0..world)
            .map(|_| {
                r.windows
                    .iter()
                    .enumerate()
                    .map(|(w, window)| {
                        (0..window[0].len())
                            .map(|m| hook_order(&mut rng, r.descs.len(), round + w + m))
                            .collect()
                    })
                    .collect()
            })
            .collect();
        let ids = [nccl::unique_id().unwrap(), nccl::unique_id().unwrap()];
        let locals: Vec<Arc<dyn Communicator>> = LocalComm::group(world)
            .unwrap()
            .into_iter()
            .map(|c| Arc::new(c) as Arc<dyn Communicator>)
            .collect();
        within(Duration::from_secs(300), "a round of hooks", move || {
            let (r, orders) = (&r, &orders);
            std::thread::scope(|s| {
                for (rank, lc) in locals.into_iter().enumerate() {
                    s.spawn(move || run_hooks_rank(r, &orders[rank], rank, world, ids, lc, exact));
                }
            });
        });
    }
}

at_two_and_three_ranks!(
    sharded_hooks_on_cuda_match_add_and_the_cpu_at_two_ranks,
    sharded_hooks_on_cuda_match_add_and_the_cpu_at_three_ranks,
    hooks_rounds
);

/// Hooks under sharded accumulation on CUDA: a first micro-batch that one rank adds whole and the
/// other tensor by tensor fails on both; a refused add_tensor on one rank (a second contribution,
/// then a gradient of the wrong length) fails the micro-batch on every rank at end_microbatch and
/// discards both windows, and the ranks then accumulate together again; a sum that overflows is
/// caught.
#[test]
fn sharded_hooks_on_cuda_fail_every_rank_together() {
    if !gpus_or_skip(2) {
        return;
    }
    within(Duration::from_secs(120), "refused hooks", || {
        let id = nccl::unique_id().unwrap();
        // Four tensors of two buckets each.
        let tensors = [TensorDesc { numel: 3000, dtype: Dtype::F32 }; 4];
        std::thread::scope(|s| {
            for rank in 0..2usize {
                s.spawn(move || {
                    let (ctx, stream, device) = rank_device(rank);
                    let comm = pair_comm(&id, rank, Duration::from_secs(20));
                    let config = AccumulatorConfig {
                        sharding: Sharding::Accumulate { shards: 2, rank },
                        bucket_numel: 6000,
                        ..Default::default()
                    };
                    let acc = Accumulator::builder(&tensors)
                        .device(device)
                        .config(config)
                        .communicator(comm.clone())
                        .build()
                        .unwrap();
                    assert_eq!(acc.buckets().len(), 2);
                    let scaler =
                        Scaler::on(device, ScalerConfig { init_scale: 1.0, ..Default::default() })
                            .unwrap();
                    let grad = DeviceBuffer::from_slice(
                        &ctx,
                        stream.stream,
                        &vec![1.0f32 + rank as f32; 3000],
                    )
                    .unwrap();
                    let grads = [grad.ptr(); 4];

                    // The first micro-batch: whole on rank 0, by hooks on rank 1.
                    let e = if rank == 0 {
                        acc.add(&scaler, &grads, 1).unwrap_err()
                    } else {
                        acc.begin_microbatch(1).unwrap_err()
                    };
                    assert_eq!(
                        e.kind,
                        ErrorKind::SizeMismatch,
                        "rank {rank}: add and hooks at the first micro-batch: {e}"
                    );

                    for (case, want) in [
                        (0, [ErrorKind::PeerFailure, ErrorKind::WrongState]),
                        (1, [ErrorKind::PeerFailure, ErrorKind::SizeMismatch]),
                    ] {
                        acc.add(&scaler, &grads, 1).unwrap();
                        acc.begin_microbatch(1).unwrap();
                        for i in (0..4).rev() {
                            acc.add_tensor(&scaler, i, grad.ptr()).unwrap();
                            if rank == 1 && i == 2 {
                                let e = if case == 0 {
                                    acc.add_tensor(&scaler, 2, grad.ptr()).unwrap_err()
                                } else {
                                    // SAFETY: a device address; the call refuses its length first.
                                    unsafe {
                                        acc.add_tensor_raw(&scaler, 1, grad.ptr() as *const _, 2999)
                                    }
                                    .unwrap_err()
                                };
                                assert_eq!(
                                    e.kind, want[1],
                                    "case {case}: the refused add_tensor: {e}"
                                );
                            }
                        }
                        let e = acc.end_microbatch().unwrap_err();
                        let kind = if rank == 1 { ErrorKind::WrongState } else { want[0] };
                        assert_eq!(e.kind, kind, "case {case} rank {rank}: end_microbatch: {e}");
                        assert!(
                            e.message.ends_with("(the window was discarded)"),
                            "case {case} rank {rank}: {e}"
                        );
                        assert_eq!(
                            acc.sync(None).unwrap_err().kind,
                            ErrorKind::EmptyWindow,
                            "case {case} rank {rank}: the window was discarded"
                        );
                    }

                    // Together again.
                    acc.begin_microbatch(1).unwrap();
                    for i in (0..4).rev() {
                        acc.add_tensor(&scaler, i, grad.ptr()).unwrap();
                    }
                    acc.end_microbatch().unwrap();
                    let info = acc.sync(None).unwrap();
                    assert_eq!(
                        (info.found_inf, info.total_count, info.microbatches),
                        (false, 2, 2),
                        "rank {rank}"
                    );
                    // (1 + 2) / 2 items; each tensor padded to 3008 elements, zeros after it.
                    assert_eq!(acc.offset(3).unwrap(), 3 * 3008);
                    let shard = read_shard(&acc, &ctx, stream.stream);
                    for (at, &v) in acc.shard().0.zip(&shard) {
                        let want = if at % 3008 < 3000 { 1.5f32 } else { 0.0 };
                        assert_eq!(v.to_bits(), want.to_bits(), "rank {rank}: element {at}");
                    }

                    // Finite gradients whose sum overflows: caught where the owner adds it into
                    // its shard, on the communication stream.
                    let big =
                        DeviceBuffer::from_slice(&ctx, stream.stream, &[3e38f32; 3000]).unwrap();
                    acc.begin_microbatch(1).unwrap();
                    for i in (0..4).rev() {
                        acc.add_tensor(&scaler, i, big.ptr()).unwrap();
                    }
                    acc.end_microbatch().unwrap();
                    assert!(acc.sync(None).unwrap().found_inf, "rank {rank}: an overflowing sum");
                });
            }
        });
    });
}

/// The reductions of a micro-batch added by hooks are enqueued without a host wait: on the
/// software GPU with every stream operation delayed (up to 200 ms, in a child process), the
/// add_tensor calls of eight one-tensor buckets return long before the device has run them, and
/// only end_microbatch waits for them.
#[test]
fn sharded_hooks_on_cuda_never_wait_for_the_device_per_bucket() {
    const TEST: &str = "sharded_hooks_on_cuda_never_wait_for_the_device_per_bucket";
    if !gpus_or_skip(2) {
        return;
    }
    let slow = std::env::var("SIMGPU_DELAY_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|us| us >= 100_000);
    if std::env::var("GRADACC_SIMGPU").as_deref() == Ok("1") && !slow {
        common::rerun(TEST, &[("SIMGPU_DELAY_US", "200000")], "the run with slow streams");
        return;
    }
    within(Duration::from_secs(300), "hooks on slow streams", || {
        let id = nccl::unique_id().unwrap();
        let tensors = [TensorDesc { numel: 1000, dtype: Dtype::F16 }; 8];
        std::thread::scope(|s| {
            for rank in 0..2usize {
                s.spawn(move || {
                    let (ctx, stream, device) = rank_device(rank);
                    let comm = pair_comm(&id, rank, Duration::from_secs(120));
                    let config = AccumulatorConfig { sharding: Sharding::Accumulate { shards: 2, rank }, bucket_numel: 1000, ..Default::default() };
                    let acc = Accumulator::builder(&tensors).device(device).config(config).communicator(comm).build().unwrap();
                    assert_eq!(acc.buckets().len(), 8);
                    let scaler = Scaler::on(device, ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
                    // 1.0 in f16.
                    let grad = DeviceBuffer::from_slice(&ctx, stream.stream, &[0x3c00u16; 1000]).unwrap();
                    acc.begin_microbatch(1).unwrap();
                    let start = Instant::now();
                    for i in (0..8).rev() {
                        acc.add_tensor(&scaler, i, grad.ptr()).unwrap();
                    }
                    let issued = start.elapsed();
                    acc.end_microbatch().unwrap();
                    let done = start.elapsed();
                    assert!(
                        issued < Duration::from_millis(1000) && issued * 2 < done,
                        "rank {rank}: the add_tensor calls took {issued:?}, the micro-batch {done:?}: a host wait per bucket"
                    );
                    let info = acc.sync(None).unwrap();
                    assert_eq!((info.total_count, info.microbatches), (2, 2), "rank {rank}");
                });
            }
        });
    });
}

/// The bfloat16 bits of `v`, rounded to nearest even (NaN stays NaN), widened back.
fn bf16_round(v: f32) -> f32 {
    let x = v.to_bits();
    if v.is_nan() {
        return f32::from_bits((x | 0x0040_0000) & 0xffff_0000);
    }
    f32::from_bits((x.wrapping_add(0x7fff + ((x >> 16) & 1))) & 0xffff_0000)
}

/// The BF16 wire at `world` ranks: an all-reduce, a reduce-scatter at the boundary, and sharded
/// accumulations by `add` and by hooks, each over its own NCCL group, of contributions from
/// 1e-3 to 1e3 in magnitude, unnormalised: every rank's result holds exactly the bits of
/// `fl(...(b(x_0) + b(x_1)) + ... + b(x_{W-1}))` (each contribution rounded to bf16 once, the
/// sum in FP32 in rank order), and is within `(2^-8 + (W - 1) 2^-24) sum |x_r|` of the f64 sum.
fn bf16_wire_rounds(world: usize, test: &str) {
    let mut rng = Rng::fresh(test);
    let descs = [
        TensorDesc { numel: 7000, dtype: Dtype::F32 },
        TensorDesc { numel: 5003, dtype: Dtype::F32 },
        TensorDesc { numel: 8000, dtype: Dtype::F32 },
    ];
    // Each rank's contributions in their places in the flat master, zeros in the padding (whose
    // recipe is then exactly 0).
    let offsets = aligned_offsets(&descs);
    let len = *offsets.last().unwrap();
    let x: Vec<Vec<f32>> = (0..world)
        .map(|_| {
            let mut v = vec![0f32; len];
            for (d, &at) in descs.iter().zip(&offsets) {
                for e in &mut v[at..at + d.numel] {
                    *e = (if rng.range(0, 1) == 0 { -1.0 } else { 1.0 })
                        * 10f64.powf(rng.uniform(-3.0, 3.0)) as f32;
                }
            }
            v
        })
        .collect();
    let recipe: Vec<f32> = (0..len)
        .map(|i| (1..world).fold(bf16_round(x[0][i]), |s, q| s + bf16_round(x[q][i])))
        .collect();
    let bound = 2f64.powi(-8) + (world as f64 - 1.0) * 2f64.powi(-24);
    let config = AccumulatorConfig {
        normalize: Normalize::None,
        loss_reduction: LossReduction::Sum,
        bucket_numel: 6000,
        wire: Dtype::Bf16,
        ..AccumulatorConfig::default()
    };
    let ids: Vec<_> = (0..4).map(|_| nccl::unique_id().unwrap()).collect();
    let worst = std::sync::Mutex::new(0f64);
    within(Duration::from_secs(300), "the BF16 wire", move || {
        let (x, recipe, ids, worst, offsets) = (&x, &recipe, &ids, &worst, &offsets);
        std::thread::scope(|s| {
            for rank in 0..world {
                s.spawn(move || {
                    let (ctx, stream, device) = rank_device(rank);
                    let comms: Vec<Arc<dyn Communicator>> = ids
                        .iter()
                        .map(|id| {
                            let c: Arc<dyn Communicator> = Arc::new(NcclComm::new(id, rank, world, rank as i32).unwrap());
                            c.set_timeout(Some(Duration::from_secs(30))).unwrap();
                            c
                        })
                        .collect();
                    let plain = Accumulator::builder(&descs).device(device).config(config).build().unwrap();
                    let scatter =
                        Accumulator::builder(&descs).device(device).config(AccumulatorConfig { sharding: Sharding::ReduceScatter { shards: world, rank }, ..config }).build()
                            .unwrap();
                    let accumulate = AccumulatorConfig { sharding: Sharding::Accumulate { shards: world, rank }, ..config };
                    let by_add = Accumulator::builder(&descs).device(device).config(accumulate).communicator(comms[2].clone()).build().unwrap();
                    let by_hooks = Accumulator::builder(&descs).device(device).config(accumulate).communicator(comms[3].clone()).build().unwrap();
                    let scaler = Scaler::on(device, ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
                    let grads: Vec<DeviceBuffer> = descs
                        .iter()
                        .zip(offsets)
                        .map(|(d, &at)| DeviceBuffer::from_slice(&ctx, stream.stream, &x[rank][at..at + d.numel]).unwrap())
                        .collect();
                    let addresses: Vec<u64> = grads.iter().map(DeviceBuffer::ptr).collect();
                    for a in [&plain, &scatter, &by_add] {
                        a.add(&scaler, &addresses, 1).unwrap();
                    }
                    by_hooks.begin_microbatch(1).unwrap();
                    for i in (0..descs.len()).rev() {
                        by_hooks.add_tensor(&scaler, i, addresses[i]).unwrap();
                    }
                    by_hooks.end_microbatch().unwrap();
                    plain.sync(Some(&*comms[0])).unwrap();
                    scatter.sync(Some(&*comms[1])).unwrap();
                    by_add.sync(None).unwrap();
                    by_hooks.sync(None).unwrap();
                    let mut whole = vec![0f32; len];
                    for (i, (d, &at)) in descs.iter().zip(offsets).enumerate() {
                        plain.read_master(i, &mut whole[at..at + d.numel]).unwrap();
                    }
                    let results = [
                        ("all-reduce", 0..len, whole),
                        ("reduce-scatter", scatter.shard().0, read_shard(&scatter, &ctx, stream.stream)),
                        ("sharded accumulation by add", by_add.shard().0, read_shard(&by_add, &ctx, stream.stream)),
                        ("sharded accumulation by hooks", by_hooks.shard().0, read_shard(&by_hooks, &ctx, stream.stream)),
                    ];
                    for (what, range, got) in results {
                        for (&g, i) in got.iter().zip(range) {
                            assert_eq!(g.to_bits(), recipe[i].to_bits(), "rank {rank} {what}: element {i}: {g:e}, the recipe gives {:e}", recipe[i]);
                            let exact: f64 = x.iter().map(|v| v[i] as f64).sum();
                            let magnitude: f64 = x.iter().map(|v| (v[i] as f64).abs()).sum();
                            if magnitude == 0.0 {
                                continue; // the padding: its bits are the recipe's 0, checked above
                            }
                            let error = (g as f64 - exact).abs() / magnitude;
                            assert!(error <= bound, "rank {rank} {what}: element {i}: error {error:e} of the magnitudes, bound {bound:e}");
                            let mut w = worst.lock().unwrap();
                            *w = w.max(error);
                        }
                    }
                });
            }
        });
        eprintln!(
            "{world} ranks: the largest error is {:.3} of the bound",
            *worst.lock().unwrap() / bound
        );
    });
}

at_two_and_three_ranks!(
    a_bf16_wire_on_cuda_rounds_each_contribution_once_at_two_ranks,
    a_bf16_wire_on_cuda_rounds_each_contribution_once_at_three_ranks,
    bf16_wire_rounds
);

/// How a rank of [`reduction_overflow_on_grid`] adds and syncs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum OverflowPolicy {
    /// An all-reduce over the shard group, of a whole micro-batch.
    AllReduce,
    /// An all-reduce over the shard group whose final micro-batch reduces its buckets early.
    AllReduceEarly,
    /// A reduce-scatter over the shard group, then the shard over the replicas.
    HybridReduceScatter,
    /// Sharded accumulation (by `add`, or by hooks), then the shard over the replicas.
    HybridAccumulate,
    HybridAccumulateHooks,
}

/// Every rank of a `shards` × `replicas` grid adds [3e38, 1, 1, 1] (and a bf16 tensor of small
/// values): finite on each rank, infinite in the sum. Under every policy and wire dtype every rank
/// reports `found_inf`, its CUDA scaler skips and backs off, the norm is not finite, clipping
/// stays off, and the reduced gradient holds the infinity.
fn reduction_overflow_on_grid(shards: usize, replicas: usize, test: &str) {
    use OverflowPolicy::*;
    let descs = [
        TensorDesc { numel: 4, dtype: Dtype::F32 },
        TensorDesc { numel: 5000, dtype: Dtype::Bf16 },
    ];
    for policy in
        [AllReduce, AllReduceEarly, HybridReduceScatter, HybridAccumulate, HybridAccumulateHooks]
    {
        // Under DROP_MICROBATCH a sum's overflow is named: the reduction's.
        let overflows = [(Dtype::F32, false), (Dtype::Bf16, false), (Dtype::F32, true)];
        for (wire, drops) in overflows {
            let config = AccumulatorConfig {
                normalize: Normalize::ByCount,
                loss_reduction: LossReduction::Sum,
                max_grad_norm: 1.0,
                bucket_numel: 1000,
                wire,
                overflow: if drops { Overflow::DropMicrobatch } else { Overflow::SkipStep },
                ..Default::default()
            };
            let ranks = grid(shards, replicas);
            let what = format!("{test}: {policy:?} wire {wire:?} drops {drops}");
            within(Duration::from_secs(300), "an overflowing reduction", move || {
                let (what, descs) = (&what, &descs);
                let results: Vec<(SyncInfo, bool, f32, Vec<f32>)> = std::thread::scope(|s| {
                    let handles: Vec<_> = ranks
                        .iter()
                        .map(|rank| {
                            s.spawn(move || {
                                let (g, i) = (rank.g, rank.g % shards);
                                let (ctx, stream, device) = rank_device(g);
                                let (comm, reps) = rank.nccl();
                                let acc = match policy {
                                    AllReduce | AllReduceEarly => Accumulator::builder(descs)
                                        .device(device)
                                        .config(config)
                                        .build()
                                        .unwrap(),
                                    HybridReduceScatter => {
                                        let sharding = Sharding::ReduceScatter { shards, rank: i };
                                        Accumulator::builder(descs)
                                            .device(device)
                                            .config(AccumulatorConfig { sharding, ..config })
                                            .build()
                                            .unwrap()
                                    }
                                    HybridAccumulate | HybridAccumulateHooks => {
                                        let sharding = Sharding::Accumulate { shards, rank: i };
                                        Accumulator::builder(descs)
                                            .device(device)
                                            .config(AccumulatorConfig { sharding, ..config })
                                            .communicator(comm.clone())
                                            .build()
                                            .unwrap()
                                    }
                                };
                                let scaler_config = ScalerConfig {
                                    init_scale: 1.0,
                                    min_scale: 2f32.powi(-20),
                                    ..Default::default()
                                };
                                let scaler = Scaler::on(device, scaler_config).unwrap();
                                let big = DeviceBuffer::from_slice(
                                    &ctx,
                                    stream.stream,
                                    &[3e38f32, 1.0, 1.0, 1.0],
                                )
                                .unwrap();
                                let small = DeviceBuffer::from_slice(
                                    &ctx,
                                    stream.stream,
                                    &[common::to_bf16(0.25); 5000],
                                )
                                .unwrap();
                                let addresses = [big.ptr(), small.ptr()];
                                match policy {
                                    AllReduce | HybridReduceScatter | HybridAccumulate => {
                                        acc.add(&scaler, &addresses, 1).unwrap()
                                    }
                                    AllReduceEarly | HybridAccumulateHooks => {
                                        if policy == AllReduceEarly {
                                            acc.begin_final_microbatch(1, comm.clone()).unwrap();
                                        } else {
                                            acc.begin_microbatch(1).unwrap();
                                        }
                                        acc.add_tensor(&scaler, 1, addresses[1]).unwrap();
                                        acc.add_tensor(&scaler, 0, addresses[0]).unwrap();
                                        acc.end_microbatch().unwrap();
                                    }
                                }
                                let info = match policy {
                                    AllReduce | AllReduceEarly => acc.sync(Some(&*comm)).unwrap(),
                                    _ => acc.sync_hybrid(&*comm, &*reps).unwrap(),
                                };
                                let skipped = scaler.update_from(&[&acc], true).unwrap().unwrap();
                                let values = match policy {
                                    AllReduce | AllReduceEarly => {
                                        let mut first = vec![0f32; 4];
                                        acc.read_master(0, &mut first).unwrap();
                                        first
                                    }
                                    _ => read_shard(&acc, &ctx, stream.stream),
                                };
                                (info, skipped, scaler.scale().unwrap(), values)
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (g, (info, skipped, scale, _)) in results.iter().enumerate() {
                    assert!(info.found_inf, "{what}: rank {g} missed the overflow: {info:?}");
                    if drops {
                        assert_eq!(info.overflow, Some(OverflowAt::Reduction), "{what}: rank {g}");
                    }
                    assert!(
                        *skipped && *scale == 0.5,
                        "{what}: rank {g} skipped {skipped}, scale {scale}"
                    );
                    assert!(
                        !info.grad_norm.is_finite() && info.clip_coef == 1.0,
                        "{what}: rank {g}: {info:?}"
                    );
                }
                assert!(
                    results.iter().flat_map(|r| &r.3).any(|v| !v.is_finite()),
                    "{what}: no rank holds the infinity"
                );
            });
        }
    }
}

#[test]
fn an_overflowing_reduction_skips_on_every_rank_at_two_devices() {
    if !gpus_or_skip(2) {
        return;
    }
    reduction_overflow_on_grid(2, 1, "an_overflowing_reduction_skips_on_every_rank_at_two_devices");
}

#[test]
fn an_overflowing_reduction_skips_on_every_rank_on_a_two_by_two_grid() {
    at_devices(4, "an_overflowing_reduction_skips_on_every_rank_on_a_two_by_two_grid", |test| {
        reduction_overflow_on_grid(2, 2, test)
    });
}

/// Windows saved on 4 CPU ranks, merged two by two into 2 CUDA ranks over NCCL: under every
/// normalisation the gradient and the info are the 4-rank CPU group's (BY_WORLD divides by the 4
/// rank-windows the device sums in its control words, not by the 2 ranks).
#[test]
fn merged_windows_normalise_as_the_group_that_produced_them_on_cuda() {
    if !gpus_or_skip(2) {
        return;
    }
    let mut rng = Rng::fresh("merged_windows_normalise_as_the_group_that_produced_them_on_cuda");
    let descs = [TensorDesc { numel: 3000, dtype: Dtype::F32 }];
    for normalize in [Normalize::ByWorld, Normalize::ByCount, Normalize::ByMicrobatches] {
        let config = AccumulatorConfig {
            normalize,
            loss_reduction: LossReduction::Sum,
            ..Default::default()
        };
        let saved = common::four_saved_windows(&mut rng, &descs, config);
        let cpu: Vec<Accumulator> = saved
            .iter()
            .map(|b| {
                let a = Accumulator::new(config, &descs).unwrap();
                a.load_window(b).unwrap();
                a
            })
            .collect();
        let comms = LocalComm::group(4).unwrap();
        let want: Vec<(SyncInfo, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = cpu
                .iter()
                .zip(&comms)
                .map(|(a, c)| {
                    s.spawn(move || {
                        (a.sync(Some(c)).unwrap(), a.with_master(0, |m| m.to_vec()).unwrap())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let id = nccl::unique_id().unwrap();
        let moved = saved.clone();
        let got: Vec<(SyncInfo, Vec<f32>)> =
            within(Duration::from_secs(300), "merged windows on CUDA", move || {
                let saved = &moved;
                std::thread::scope(|s| {
                    let handles: Vec<_> = (0..2)
                        .map(|rank| {
                            s.spawn(move || {
                                let (_ctx, _stream, device) = rank_device(rank);
                                let comm = pair_comm(&id, rank, Duration::from_secs(30));
                                let acc = Accumulator::builder(&descs)
                                    .device(device)
                                    .config(config)
                                    .build()
                                    .unwrap();
                                acc.merge_window(&saved[2 * rank]).unwrap();
                                acc.merge_window(&saved[2 * rank + 1]).unwrap();
                                let info = acc.sync(Some(&*comm)).unwrap();
                                let mut master = vec![0f32; 3000];
                                acc.read_master(0, &mut master).unwrap();
                                (info, master)
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                })
            });
        for (rank, (info, master)) in got.iter().enumerate() {
            assert_eq!(
                (info.total_count, info.microbatches),
                (want[0].0.total_count, want[0].0.microbatches),
                "{normalize:?} rank {rank}"
            );
            assert!(
                same_info(info, &want[0].0),
                "{normalize:?} rank {rank}: {info:?}, the CPU's {:?}",
                want[0].0
            );
            for (k, (g, w)) in master.iter().zip(&want[0].1).enumerate() {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "{normalize:?} rank {rank} element {k}: {g} vs {w}"
                );
            }
        }
    }
}
