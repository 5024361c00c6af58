//! The software GPU (tests/simgpu/) catches what it exists to catch: each case below misuses the
//! driver or NCCL the way a bug in the CUDA backend would, in a child process, and the child must
//! die with the software GPU's report. A stand-in that let these pass would make every green run
//! of the GPU suite meaningless.
//!
//! Runs only on the software GPU (`scripts/sim-gpu-check` sets GRADACC_SIMGPU=1).

use std::ffi::{c_void, CString};
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cudarc::driver::sys as cu;
use gradacc::backend::cuda::compile::{self, Target};
use gradacc::backend::cuda::driver::{Context, DeviceBuffer, Module, OwnedStream, THREADS};
use gradacc::backend::cuda::nccl::{self, NcclComm};

const CASE: &str = "GRADACC_SIMGPU_CASE";

/// Runs `misuse` in a child process and requires it to die with a report containing `expect`.
fn expect_caught(case: &str, expect: &str, misuse: impl FnOnce()) {
    if std::env::var("GRADACC_SIMGPU").as_deref() != Ok("1") {
        eprintln!("not on the software GPU: nothing to check");
        return;
    }
    if std::env::var(CASE).as_deref() == Ok(case) {
        misuse();
        // Let stream workers run what was enqueued before declaring that nothing was caught.
        std::thread::sleep(Duration::from_secs(2));
        println!("NOT CAUGHT");
        std::process::exit(0);
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", case, "--nocapture", "--test-threads=1"])
        .env(CASE, case)
        .env("SIMGPU_TIMEOUT_S", "3")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A child that neither dies nor ends is a failure of this test, not a hang of the suite.
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("{case}: the child neither was stopped nor finished within 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "{case}: the child was not stopped\n{}{stderr}",
        String::from_utf8_lossy(&out.stdout)
    );
    let report = stderr
        .lines()
        .find(|l| l.starts_with("simgpu: "))
        .unwrap_or_else(|| panic!("{case}: no report\n{stderr}"));
    assert!(report.contains(expect), "{case}: the report does not say `{expect}`: {report}");
    eprintln!("{case}: {report}");
}

fn kernel(
    ctx: &Context,
    source: &str,
    name: &str,
) -> (Module, gradacc::backend::cuda::driver::Function) {
    let (major, minor) = ctx.capability;
    let image =
        compile::compile_source(source, Target::for_device(major, minor).unwrap()).unwrap().image;
    let module = Module::load(ctx, &image).unwrap();
    let _current = ctx.enter().unwrap();
    let f = module.function(&CString::new(name).unwrap()).unwrap();
    (module, f)
}

/// `ga_add_one` with its master and gradient arguments swapped: the kernel would write 4-byte
/// values over a buffer of 2-byte ones.
#[test]
fn swapped_launch_argument() {
    expect_caught("swapped_launch_argument", "past the end", || {
        let ctx = Context::get(0).unwrap();
        let stream = OwnedStream::new(&ctx).unwrap();
        let (_m, add_one) = kernel(&ctx, compile::SOURCE, "ga_add_one");
        let n = 1000u64;
        let master = DeviceBuffer::zeroed(&ctx, stream.stream, n as usize * 4).unwrap();
        let grad = DeviceBuffer::zeroed(&ctx, stream.stream, n as usize * 2).unwrap();
        let scaler = DeviceBuffer::zeroed(&ctx, stream.stream, 256).unwrap();
        let found = DeviceBuffer::zeroed(&ctx, stream.stream, 4).unwrap();
        let (m, g, s, f) = (master.ptr(), grad.ptr(), scaler.ptr(), found.ptr());
        let (dtype, weight, assign) = (1i32, 1.0f64, 1u32);
        let mut args: [*mut c_void; 8] = [
            &g as *const _ as *mut c_void, // swapped
            &m as *const _ as *mut c_void, // swapped
            &n as *const _ as *mut c_void,
            &dtype as *const _ as *mut c_void,
            &s as *const _ as *mut c_void,
            &weight as *const _ as *mut c_void,
            &assign as *const _ as *mut c_void,
            &f as *const _ as *mut c_void,
        ];
        // SAFETY: deliberately wrong: the software GPU must refuse it.
        unsafe { add_one.launch(&ctx, 1, THREADS, stream.stream, &mut args).unwrap() };
        let mut out = [0f32; 1];
        master.read(&mut out).unwrap();
    });
}

/// A buffer written on one stream and then on another with no event between them.
#[test]
fn missing_event() {
    expect_caught("missing_event", "race on", || {
        let ctx = Context::get(0).unwrap();
        let (a, b) = (OwnedStream::new(&ctx).unwrap(), OwnedStream::new(&ctx).unwrap());
        let buf = DeviceBuffer::zeroed(&ctx, a.stream, 4096).unwrap();
        let _current = ctx.enter().unwrap();
        // SAFETY: a valid range of a live buffer; only its ordering is wrong.
        unsafe { cu::cuMemsetD8Async(buf.ptr(), 7, 4096, b.stream) };
        unsafe { cu::cuStreamSynchronize(b.stream) };
    });
}

/// A buffer used after its stream-ordered free.
#[test]
fn use_after_free() {
    expect_caught("use_after_free", "freed", || {
        let ctx = Context::get(0).unwrap();
        let stream = OwnedStream::new(&ctx).unwrap();
        let stale = DeviceBuffer::zeroed(&ctx, stream.stream, 64).unwrap().ptr();
        let _current = ctx.enter().unwrap();
        // SAFETY: deliberately wrong: the address was freed.
        unsafe { cu::cuMemsetD8Async(stale, 0, 64, stream.stream) };
    });
}

/// A kernel whose parameter list the host build and the image disagree on (a signature changed
/// in one place only).
#[test]
fn kernel_signature_drift() {
    expect_caught("kernel_signature_drift", "parameter sizes differ", || {
        let ctx = Context::get(0).unwrap();
        let drifted = compile::SOURCE
            .replace("ga_scale_by(float *buf, ga_u64 n,", "ga_scale_by(float *buf, ga_u32 n,");
        assert_ne!(drifted, compile::SOURCE, "the signature to drift was not found");
        kernel(&ctx, &drifted, "ga_scale_by");
    });
}

/// Runs `rank(r, comm, ctx, ready)` for ranks 0 and 1 of a new NCCL group on devices 0 and 1,
/// each on a thread of its own; `ready` is a barrier of the two.
fn two_ranks(rank: impl Fn(usize, &NcclComm, &Arc<Context>, &Barrier) + Sync) {
    let id = nccl::unique_id().unwrap();
    let ready = Barrier::new(2);
    std::thread::scope(|s| {
        for r in 0..2usize {
            let (id, ready, rank) = (&id, &ready, &rank);
            s.spawn(move || {
                let ctx = Context::get(r as i32).unwrap();
                let comm = NcclComm::new(id, r, 2, r as i32).unwrap();
                rank(r, &comm, &ctx, ready);
            });
        }
    });
}

/// Two ranks whose n-th collectives differ (a boundary that reduced another bucket list).
#[test]
fn collective_sequence_mismatch() {
    expect_caught("collective_sequence_mismatch", "differs between ranks", || {
        two_ranks(|rank, comm, ctx, _| {
            let stream = OwnedStream::new(ctx).unwrap();
            let buf = DeviceBuffer::zeroed(ctx, stream.stream, 64).unwrap();
            comm.allreduce_sum_f32(buf.ptr(), 4 + rank, stream.stream).unwrap();
            std::thread::sleep(Duration::from_secs(5));
        });
    });
}

/// A collective that one rank never joins: reported after the timeout, not a hang.
#[test]
fn collective_without_peer() {
    expect_caught("collective_without_peer", "a hang", || {
        two_ranks(|rank, comm, ctx, ready| {
            ready.wait();
            if rank == 0 {
                let stream = OwnedStream::new(ctx).unwrap();
                let buf = DeviceBuffer::zeroed(ctx, stream.stream, 64).unwrap();
                comm.allreduce_sum_f32(buf.ptr(), 16, stream.stream).unwrap();
                let mut out = [0f32; 1];
                buf.read(&mut out).unwrap();
            }
            std::thread::sleep(Duration::from_secs(8));
        });
    });
}

/// A send whose receive has another count (a BF16 wire whose ranks cut a bucket differently).
#[test]
fn send_receive_mismatch() {
    expect_caught("send_receive_mismatch", "does not match", || {
        two_ranks(|rank, comm, ctx, _| {
            let stream = OwnedStream::new(ctx).unwrap();
            let buf = DeviceBuffer::zeroed(ctx, stream.stream, 64).unwrap();
            let (mut sends, mut recvs) = (vec![(buf.ptr(), 0); 2], vec![(buf.ptr(), 0); 2]);
            if rank == 0 {
                sends[1].1 = 4;
            } else {
                recvs[0].1 = 5;
            }
            comm.exchange_bf16(&sends, &recvs, stream.stream).unwrap();
            std::thread::sleep(Duration::from_secs(5));
        });
    });
}

/// A send that its peer never receives: reported after the timeout, not a hang.
#[test]
fn send_without_receive() {
    expect_caught("send_without_receive", "a hang", || {
        two_ranks(|rank, comm, ctx, ready| {
            ready.wait();
            if rank == 0 {
                let stream = OwnedStream::new(ctx).unwrap();
                let buf = DeviceBuffer::zeroed(ctx, stream.stream, 64).unwrap();
                let (mut sends, recvs) = (vec![(buf.ptr(), 0); 2], vec![(buf.ptr(), 0); 2]);
                sends[1].1 = 4;
                comm.exchange_bf16(&sends, &recvs, stream.stream).unwrap();
                // The buffer and the stream stay: without memory pools a free waits for the stream.
                std::thread::sleep(Duration::from_secs(8));
            }
            std::thread::sleep(Duration::from_secs(8));
        });
    });
}

/// A rank's stream-ordered master handed to NCCL while its pool denies the peer device: the
/// access several ranks in one process need (cuMemPoolSetAccess).
#[test]
fn pool_access_not_granted() {
    if std::env::var("SIMGPU_MEMORY_POOLS").as_deref() == Ok("0") {
        eprintln!("no memory pools: nothing to grant");
        return;
    }
    expect_caught("pool_access_not_granted", "did not grant it access", || {
        two_ranks(|rank, comm, ctx, ready| {
            if rank == 0 {
                let _current = ctx.enter().unwrap();
                let mut pool = std::ptr::null_mut();
                let deny = cu::CUmemAccessDesc {
                    location: cu::CUmemLocation {
                        type_: cu::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                        id: 1,
                    },
                    flags: cu::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
                };
                // SAFETY: device 0's default pool; one valid descriptor.
                unsafe {
                    assert_eq!(
                        cu::cuDeviceGetDefaultMemPool(&mut pool, 0),
                        cu::CUresult::CUDA_SUCCESS
                    );
                    assert_eq!(cu::cuMemPoolSetAccess(pool, &deny, 1), cu::CUresult::CUDA_SUCCESS);
                }
            }
            ready.wait();
            let stream = OwnedStream::new(ctx).unwrap();
            let buf = DeviceBuffer::zeroed(ctx, stream.stream, 64).unwrap();
            comm.allreduce_sum_f32(buf.ptr(), 16, stream.stream).unwrap();
            let mut out = [0f32; 1];
            buf.read(&mut out).unwrap();
        });
    });
}
