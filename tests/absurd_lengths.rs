//! Lengths no buffer can have (their byte size exceeds isize::MAX, usually a negative value or a
//! wrapped multiplication in the caller) and configurations no communicator can match are refused
//! with INVALID_ARGUMENT naming the argument, before anything is read: never a crash, never a
//! wrapped length read as another value.

use std::ffi::CStr;
use std::ptr::{null, null_mut};

use gradacc_capi::*;

/// Lengths of `size`-byte values whose byte size exceeds isize::MAX: the smallest one, the ones
/// a wrapped length gives, and the largest.
fn absurd(size: usize) -> [usize; 4] {
    [isize::MAX as usize / size + 1, usize::MAX / size, 1 << 63, usize::MAX]
}

fn last_error() -> String {
    // SAFETY: gradacc_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(gradacc_last_error()) }.to_string_lossy().into_owned()
}

fn assert_refused(status: gradacc_status_t, argument: &str, value: usize) {
    let message = last_error();
    assert_eq!(status, GRADACC_STATUS_INVALID_ARGUMENT, "{argument} = {value}: {message}");
    assert!(message.contains(&format!("{argument} = {value}")), "{message}");
}

fn one_tensor() -> [gradacc_tensor_desc_t; 1] {
    [gradacc_tensor_desc_t { numel: 8, dtype: GRADACC_DTYPE_F32 }]
}

fn accumulator() -> *mut gradacc_accumulator_t {
    let mut a = null_mut();
    let t = one_tensor();
    // SAFETY: valid arguments.
    let st = unsafe { gradacc_accumulator_create(null(), t.as_ptr(), 1, null(), &mut a) };
    assert_eq!(st, GRADACC_STATUS_OK);
    a
}

fn scaler() -> *mut gradacc_scaler_t {
    let mut s = null_mut();
    // SAFETY: valid arguments.
    assert_eq!(unsafe { gradacc_scaler_create(null(), null(), &mut s) }, GRADACC_STATUS_OK);
    s
}

#[test]
fn a_tensor_count_beyond_the_address_space_is_refused_at_create() {
    let t = one_tensor();
    // 2^59 and 2^60 descriptors of 16 bytes: what a negative count or a wrap gives.
    for n in [1 << 59, 1 << 60].into_iter().chain(absurd(16)) {
        let mut out = null_mut();
        // SAFETY: the length is the point of the test; a correct library never reads past t.
        let st = unsafe { gradacc_accumulator_create(null(), t.as_ptr(), n, null(), &mut out) };
        assert_refused(st, "`n`", n);
        assert!(out.is_null());
        let mut master = [0f32; 8];
        // SAFETY: as above.
        let st = unsafe {
            gradacc_accumulator_create_with_buffer(
                null(),
                t.as_ptr(),
                n,
                null(),
                master.as_mut_ptr(),
                8,
                &mut out,
            )
        };
        assert_refused(st, "`n`", n);
    }
}

#[test]
fn a_master_length_beyond_the_address_space_is_refused() {
    let t = one_tensor();
    let mut master = [0f32; 8];
    for numel in absurd(4) {
        let mut out = null_mut();
        // SAFETY: as above: the library must refuse before using the buffer.
        let st = unsafe {
            gradacc_accumulator_create_with_buffer(
                null(),
                t.as_ptr(),
                1,
                null(),
                master.as_mut_ptr(),
                numel,
                &mut out,
            )
        };
        assert_refused(st, "`master_numel`", numel);
    }
}

#[test]
fn saved_state_lengths_beyond_the_address_space_are_refused() {
    let (a, s) = (accumulator(), scaler());
    let bytes = [0u8; 64];
    for len in absurd(1) {
        // SAFETY: as above.
        let st = unsafe { gradacc_accumulator_load_window(a, bytes.as_ptr(), len) };
        assert_refused(st, "`len`", len);
        // SAFETY: as above.
        let st = unsafe { gradacc_accumulator_merge_window(a, bytes.as_ptr(), len) };
        assert_refused(st, "`len`", len);
        // SAFETY: as above.
        let st = unsafe { gradacc_scaler_load(s, bytes.as_ptr(), len) };
        assert_refused(st, "`len`", len);
    }
    // SAFETY: live handles, destroyed once.
    unsafe {
        gradacc_accumulator_destroy(a);
        gradacc_scaler_destroy(s);
    }
}

#[test]
fn an_accumulator_list_beyond_the_address_space_is_refused() {
    let (a, s) = (accumulator(), scaler());
    let list = [a.cast_const()];
    for n in absurd(8) {
        // SAFETY: as above.
        let st = unsafe { gradacc_scaler_update(s, list.as_ptr(), n, null_mut()) };
        assert_refused(st, "`n`", n);
    }
    // SAFETY: live handles, destroyed once.
    unsafe {
        gradacc_accumulator_destroy(a);
        gradacc_scaler_destroy(s);
    }
}

#[test]
fn a_misaligned_tensor_list_is_refused() {
    let t = [one_tensor()[0]; 2];
    let misaligned = (t.as_ptr() as usize + 4) as *const gradacc_tensor_desc_t;
    let mut out = null_mut();
    // SAFETY: the library must refuse the address before reading through it.
    let st = unsafe { gradacc_accumulator_create(null(), misaligned, 1, null(), &mut out) };
    assert_eq!(st, GRADACC_STATUS_INVALID_ARGUMENT, "{}", last_error());
    assert!(last_error().contains("`tensors`"), "{}", last_error());
}

#[test]
fn a_shard_count_no_communicator_can_have_is_refused_at_create() {
    let mut c = std::mem::MaybeUninit::uninit();
    // SAFETY: writes a whole config.
    assert_eq!(unsafe { gradacc_accumulator_config_default(c.as_mut_ptr()) }, GRADACC_STATUS_OK);
    // SAFETY: initialised just above.
    let mut c = unsafe { c.assume_init() };
    let t = one_tensor();
    for sharding in [GRADACC_SHARDING_REDUCE_SCATTER, GRADACC_SHARDING_ACCUMULATE] {
        for count in [u32::MAX, (1 << 16) + 1] {
            (c.sharding, c.shard_count, c.shard_rank) = (sharding, count, 0);
            let mut out = null_mut();
            // SAFETY: valid pointers.
            let st = unsafe { gradacc_accumulator_create(&c, t.as_ptr(), 1, null(), &mut out) };
            assert_refused(st, "`config`.shard_count", count as usize);
        }
    }
    // The largest count still passes creation.
    (c.sharding, c.shard_count, c.shard_rank) = (GRADACC_SHARDING_REDUCE_SCATTER, 1 << 16, 5);
    let mut out = null_mut();
    // SAFETY: valid pointers.
    let st = unsafe { gradacc_accumulator_create(&c, t.as_ptr(), 1, null(), &mut out) };
    assert_eq!(st, GRADACC_STATUS_OK, "{}", last_error());
    // SAFETY: a live handle, destroyed once.
    unsafe { gradacc_accumulator_destroy(out) };
}
