//! Destroys while another thread is blocked in a sync on an in-process group that waits forever
//! (timeout 0): the accumulator's destroy is refused with WRONG_STATE and leaves it usable; the
//! communicator's destroy fails the sync with COMM_FAILURE (as an abort does) and waits until
//! the sync is done with it, the window intact. A broken fix fails the test instead of hanging it:
//! the blocked sync is freed by the peer's abort after a bounded wait.

use std::ffi::CStr;
use std::ptr::{null, null_mut};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use gradacc_capi::*;

/// How long a failed sync may take to return; far more than it needs, far less than forever.
const PROMPT: Duration = Duration::from_secs(2);

#[derive(Clone, Copy)]
struct H(usize);
// SAFETY: a handle is a number the library looks up; any thread may pass it.
unsafe impl Send for H {}

fn last_error() -> String {
    // SAFETY: gradacc_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(gradacc_last_error()) }.to_string_lossy().into_owned()
}

fn ok(status: gradacc_status_t) {
    assert_eq!(status, GRADACC_STATUS_OK, "{}", last_error());
}

/// An accumulator holding one micro-batch of 3 items, and the scaler that added it.
fn window() -> (*mut gradacc_accumulator_t, *mut gradacc_scaler_t) {
    let (mut a, mut s) = (null_mut(), null_mut());
    let t = [gradacc_tensor_desc_t { numel: 64, dtype: GRADACC_DTYPE_F32 }];
    let g = vec![1.5f32; 64];
    let grads = [g.as_ptr().cast()];
    // SAFETY: valid arguments; the gradient outlives the call.
    unsafe {
        ok(gradacc_accumulator_create(null(), t.as_ptr(), 1, null(), &mut a));
        ok(gradacc_scaler_create(null(), null(), &mut s));
        ok(gradacc_accumulator_add(a, s, grads.as_ptr(), 1, 3));
    }
    (a, s)
}

/// Starts rank 0's sync on another thread; its status, message and return moment come back.
fn sync_on_thread(
    a: *mut gradacc_accumulator_t,
    c: *mut gradacc_comm_t,
) -> mpsc::Receiver<(gradacc_status_t, String, Instant)> {
    let (tx, rx) = mpsc::channel();
    let (a, c) = (H(a as usize), H(c as usize));
    std::thread::spawn(move || {
        let mut info = std::mem::MaybeUninit::<gradacc_sync_info_t>::zeroed();
        // SAFETY: a zeroed struct with its size set is a valid sync info to write.
        unsafe { (*info.as_mut_ptr()).struct_size = size_of::<gradacc_sync_info_t>() };
        // SAFETY: live handles (or ones the test destroys, which the library reports).
        let st = unsafe {
            gradacc_accumulator_sync(
                a.0 as *mut gradacc_accumulator_t,
                c.0 as *mut gradacc_comm_t,
                info.as_mut_ptr(),
            )
        };
        let _ = tx.send((st, last_error(), Instant::now()));
    });
    // Let it reach the wait for rank 1, which never syncs.
    std::thread::sleep(Duration::from_millis(200));
    rx
}

fn saved_items(a: *mut gradacc_accumulator_t) -> u64 {
    let mut len = 0;
    // SAFETY: a live accumulator; a NULL buffer asks for the size.
    ok(unsafe { gradacc_accumulator_save_window(a, null_mut(), 0, &mut len) });
    let mut bytes = vec![0u8; len];
    // SAFETY: `bytes` holds `len` writable bytes.
    ok(unsafe { gradacc_accumulator_save_window(a, bytes.as_mut_ptr(), len, &mut len) });
    // The item count follows magic, version, layout and alignment.
    u64::from_le_bytes(bytes[24..32].try_into().unwrap())
}

/// Runs `scenario` until its sync thread got into the sync before the destroy did (a loaded
/// machine may start the thread late): `false` from it means it did not, and it cleaned up.
fn until_the_sync_came_first(scenario: impl Fn() -> bool) {
    for _ in 0..5 {
        if scenario() {
            return;
        }
        eprintln!("the sync thread started after the destroy; again");
    }
    panic!("the sync thread never started within 200 ms of its spawn, 5 times");
}

#[test]
fn destroying_the_communicator_fails_the_blocked_sync_first() {
    until_the_sync_came_first(communicator_destroyed_during_sync);
}

fn communicator_destroyed_during_sync() -> bool {
    let mut comms = [null_mut(); 2];
    // SAFETY: room for two handles.
    ok(unsafe { gradacc_comm_create_local(2, comms.as_mut_ptr()) });
    // SAFETY: live handles.
    unsafe {
        ok(gradacc_comm_set_timeout(comms[0], 0.0));
        ok(gradacc_comm_set_timeout(comms[1], 0.0));
    }
    let (a, s) = window();
    let rx = sync_on_thread(a, comms[0]);
    assert!(rx.try_recv().is_err(), "the sync returned with no peer");
    let t0 = Instant::now();
    // SAFETY: a live handle, destroyed once.
    ok(unsafe { gradacc_comm_destroy(comms[0]) });
    let destroyed = Instant::now();
    let got = rx.recv_timeout(PROMPT);
    if got.is_err() {
        // Free the blocked sync as only a peer could before, then fail.
        // SAFETY: rank 1's handle is live.
        unsafe { gradacc_comm_abort(comms[1]) };
        let _ = rx.recv_timeout(PROMPT);
        panic!("the sync still waits {PROMPT:?} after its communicator was destroyed");
    }
    let (st, message, returned) = got.unwrap();
    if st == GRADACC_STATUS_INVALID_HANDLE && message.contains("`comm`") {
        // SAFETY: live handles, destroyed once.
        unsafe {
            ok(gradacc_comm_destroy(comms[1]));
            ok(gradacc_accumulator_destroy(a));
            ok(gradacc_scaler_destroy(s));
        }
        return false;
    }
    assert_eq!(st, GRADACC_STATUS_COMM_FAILURE, "{message}");
    assert!(message.contains("aborted"), "{message}");
    assert!(returned - t0 < PROMPT, "the sync returned {:?} after the destroy", returned - t0);
    eprintln!("destroy took {:?}; the sync returned: {message}", destroyed - t0);
    assert_eq!(saved_items(a), 3, "the window is not intact");
    // The handle is gone, and the group failed for rank 1 too.
    // SAFETY: a destroyed handle is reported, never dereferenced.
    assert_eq!(unsafe { gradacc_comm_abort(comms[0]) }, GRADACC_STATUS_INVALID_HANDLE);
    // SAFETY: live handles, destroyed once.
    unsafe {
        ok(gradacc_comm_destroy(comms[1]));
        ok(gradacc_accumulator_destroy(a));
        ok(gradacc_scaler_destroy(s));
    }
    true
}

#[test]
fn destroying_the_accumulator_of_a_blocked_sync_is_refused() {
    until_the_sync_came_first(accumulator_destroyed_during_sync);
}

fn accumulator_destroyed_during_sync() -> bool {
    let mut comms = [null_mut(); 2];
    // SAFETY: room for two handles.
    ok(unsafe { gradacc_comm_create_local(2, comms.as_mut_ptr()) });
    // SAFETY: a live handle.
    ok(unsafe { gradacc_comm_set_timeout(comms[0], 0.0) });
    let (a, s) = window();
    let rx = sync_on_thread(a, comms[0]);
    // SAFETY: a live handle.
    let st = unsafe { gradacc_accumulator_destroy(a) };
    let message = last_error();
    let mut n = 0;
    // SAFETY: the handle must still be live.
    let usable = unsafe { gradacc_accumulator_num_tensors(a, &mut n) };
    // Free the sync (before any assertion, so a failure never leaves it waiting).
    // SAFETY: a live handle.
    ok(unsafe { gradacc_comm_abort(comms[1]) });
    let (sync_status, sync_message, _) =
        rx.recv_timeout(PROMPT).expect("the aborted sync returned");
    if st == GRADACC_STATUS_OK && sync_status == GRADACC_STATUS_INVALID_HANDLE {
        // SAFETY: live handles, destroyed once (the accumulator is gone already).
        unsafe {
            ok(gradacc_comm_destroy(comms[0]));
            ok(gradacc_comm_destroy(comms[1]));
            ok(gradacc_scaler_destroy(s));
        }
        return false;
    }
    assert_eq!(st, GRADACC_STATUS_WRONG_STATE, "{message}");
    assert!(message.contains("in a sync on another thread"), "{message}");
    assert_eq!((usable, n), (GRADACC_STATUS_OK, 1), "{}", last_error());
    assert_eq!(sync_status, GRADACC_STATUS_COMM_FAILURE, "{sync_message}");
    assert_eq!(saved_items(a), 3, "the window is not intact");
    // SAFETY: live handles, destroyed once.
    unsafe {
        ok(gradacc_accumulator_destroy(a));
        ok(gradacc_comm_destroy(comms[0]));
        ok(gradacc_comm_destroy(comms[1]));
        ok(gradacc_scaler_destroy(s));
    }
    true
}
