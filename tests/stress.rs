//! Concurrency stress through the C ABI: many threads adding distinct tensors of one accumulator
//! at once, accumulators and scalers driven from different threads, handles destroyed while other
//! threads are calling on them, and several in-process groups syncing at the same time. Every
//! result is compared bit for bit with the same work done serially; every racing call must return
//! OK or GRADACC_STATUS_INVALID_HANDLE, never crash. Sizes keep the whole file to a few seconds.

#![allow(clippy::needless_range_loop)] // grads[w][m][c] read as the window, micro-batch and chunk they are
mod common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Barrier;

use common::{to_bf16, to_f16, Rng};
use gradacc_capi::*;

/// Handles cross threads as plain numbers (they are ids, never addresses).
#[derive(Clone, Copy)]
struct H(usize);
unsafe impl Send for H {}

fn ok(status: gradacc_status_t) {
    assert_eq!(
        status,
        GRADACC_STATUS_OK,
        "{}",
        unsafe { std::ffi::CStr::from_ptr(gradacc_last_error()) }.to_string_lossy()
    );
}

fn scaler(init: f32, growth_interval: u32) -> *mut gradacc_scaler_t {
    let mut c = std::mem::MaybeUninit::uninit();
    ok(unsafe { gradacc_scaler_config_default(c.as_mut_ptr()) });
    let mut c = unsafe { c.assume_init() };
    c.init_scale = init;
    c.growth_interval = growth_interval;
    let mut s = null_mut();
    ok(unsafe { gradacc_scaler_create(&c, null(), &mut s) });
    s
}

fn accumulator(descs: &[gradacc_tensor_desc_t], threads: u32) -> *mut gradacc_accumulator_t {
    accumulator_clipped_at(descs, threads, 10.0)
}

fn accumulator_clipped_at(
    descs: &[gradacc_tensor_desc_t],
    threads: u32,
    max_grad_norm: f32,
) -> *mut gradacc_accumulator_t {
    let mut c = std::mem::MaybeUninit::uninit();
    ok(unsafe { gradacc_accumulator_config_default(c.as_mut_ptr()) });
    let mut c = unsafe { c.assume_init() };
    c.threads = threads;
    c.max_grad_norm = max_grad_norm;
    c.bucket_numel = 5000;
    let mut a = null_mut();
    ok(unsafe { gradacc_accumulator_create(&c, descs.as_ptr(), descs.len(), null(), &mut a) });
    a
}

/// One tensor's gradient in its dtype, as 32-bit words (aligned for every dtype).
struct Buf {
    words: Vec<u32>,
}

impl Buf {
    fn new(rng: &mut Rng, d: &gradacc_tensor_desc_t, scale: f32, overflow: bool) -> Buf {
        let n = d.numel as usize;
        let mut words = vec![0u32; n];
        let bytes = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, n * 4) };
        for i in 0..n {
            let v = rng.uniform(-2.0, 2.0) as f32 * scale;
            match d.dtype {
                GRADACC_DTYPE_F32 => bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
                GRADACC_DTYPE_F16 => {
                    bytes[2 * i..2 * i + 2].copy_from_slice(&to_f16(v).to_le_bytes())
                }
                _ => bytes[2 * i..2 * i + 2].copy_from_slice(&to_bf16(v).to_le_bytes()),
            }
        }
        if overflow {
            match d.dtype {
                GRADACC_DTYPE_F32 => bytes[..4].copy_from_slice(&f32::NAN.to_le_bytes()),
                _ => bytes[..2].copy_from_slice(&0x7c00u16.to_le_bytes()),
            }
        }
        Buf { words }
    }
    /// Every element `v`, in `d`'s dtype.
    fn of(d: &gradacc_tensor_desc_t, v: f32) -> Buf {
        let n = d.numel as usize;
        let words = match d.dtype {
            GRADACC_DTYPE_F32 => vec![v.to_bits(); n],
            GRADACC_DTYPE_F16 => vec![to_f16(v) as u32 * 0x1_0001; n.div_ceil(2)],
            _ => vec![to_bf16(v) as u32 * 0x1_0001; n.div_ceil(2)],
        };
        Buf { words }
    }
    fn ptr(&self) -> *const c_void {
        self.words.as_ptr() as *const c_void
    }
}

fn masters(a: *mut gradacc_accumulator_t, n: usize) -> Vec<u32> {
    let mut out = vec![];
    for i in 0..n {
        let (mut p, mut len) = (null_mut(), 0);
        ok(unsafe { gradacc_accumulator_master(a, i, &mut p, &mut len) });
        out.extend(unsafe { std::slice::from_raw_parts(p, len) }.iter().map(|v| v.to_bits()));
    }
    out
}

fn descs(rng: &mut Rng, n: usize, max: u64) -> Vec<gradacc_tensor_desc_t> {
    (0..n)
        .map(|i| gradacc_tensor_desc_t { numel: rng.range(1, max), dtype: (i % 3) as i32 })
        .collect()
}

/// 16 threads add the distinct tensors of one accumulator at once (each tensor in two chunks-worth
/// of contributions), over several micro-batches and windows; the result equals one thread doing
/// the same calls in order, bit for bit.
#[test]
fn concurrent_add_tensor_matches_serial() {
    let mut rng = Rng::fresh("concurrent_add_tensor_matches_serial");
    let ds = descs(&mut rng, 48, 20_000);
    let scale = 1024.0;
    let windows = 3;
    let micro = 3;
    // grads[w][m][t][c]: two contributions per tensor per micro-batch
    let grads: Vec<Vec<Vec<Vec<Buf>>>> = (0..windows)
        .map(|w| {
            (0..micro)
                .map(|m| {
                    ds.iter()
                        .enumerate()
                        .map(|(t, d)| {
                            (0..2)
                                .map(|c| {
                                    Buf::new(
                                        &mut rng,
                                        d,
                                        scale,
                                        w == 1 && m == 2 && t == 7 && c == 1,
                                    )
                                })
                                .collect()
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let run = |threads: usize, kernel_threads: u32| -> Vec<(Vec<u32>, bool)> {
        let s = scaler(scale, 1_000_000);
        let a = accumulator(&ds, kernel_threads);
        let (sh, ah) = (H(s as usize), H(a as usize));
        let mut results = vec![];
        for w in 0..windows {
            for m in 0..micro {
                ok(unsafe { gradacc_accumulator_begin_microbatch(a, 4 + m as u64) });
                let next = AtomicUsize::new(0);
                std::thread::scope(|sc| {
                    for _ in 0..threads {
                        sc.spawn(|| {
                            let (s, a) = (
                                sh.0 as *const gradacc_scaler_t,
                                ah.0 as *mut gradacc_accumulator_t,
                            );
                            loop {
                                // Work items: (tensor, contribution), a tensor's two in order on
                                // one thread.
                                let t = next.fetch_add(1, Ordering::Relaxed);
                                if t >= ds.len() {
                                    break;
                                }
                                for c in 0..2 {
                                    let g = &grads[w][m][t][c];
                                    ok(unsafe {
                                        gradacc_accumulator_add_tensor(
                                            a,
                                            s,
                                            t,
                                            g.ptr(),
                                            ds[t].numel as usize,
                                        )
                                    });
                                }
                            }
                        });
                    }
                });
                ok(unsafe { gradacc_accumulator_end_microbatch(a) });
            }
            let mut info = gradacc_sync_info_t::default();
            ok(unsafe { gradacc_accumulator_sync(a, null_mut(), &mut info) });
            results.push((masters(a, ds.len()), info.found_inf));
        }
        ok(unsafe { gradacc_accumulator_destroy(a) });
        ok(unsafe { gradacc_scaler_destroy(s) });
        results
    };
    let serial = run(1, 1);
    assert!(serial[1].1 && !serial[0].1, "window 1 carries the injected overflow");
    for (threads, kernel_threads) in [(16, 1), (16, 2), (4, 3)] {
        let got = run(threads, kernel_threads);
        for (w, (g, s)) in got.iter().zip(&serial).enumerate() {
            assert!(g == s, "{threads} threads (kernel threads {kernel_threads}): window {w} differs from the serial run");
        }
    }
}

/// Many threads give one tensor its contributions of a micro-batch at once, the first of each
/// window racing (a chunked backward): every contribution is counted, each round checked exactly
/// against the serial sum (small integers, so any order of addition gives the same bits).
#[test]
fn racing_contributions_to_one_tensor_are_all_counted() {
    const THREADS: usize = 16;
    let ds: Vec<gradacc_tensor_desc_t> = [GRADACC_DTYPE_F32, GRADACC_DTYPE_F16, GRADACC_DTYPE_BF16]
        .iter()
        .map(|&dtype| gradacc_tensor_desc_t { numel: 33, dtype })
        .collect();
    let s = scaler(4.0, 1_000_000);
    let a = accumulator_clipped_at(&ds, 1, 0.0);
    // Thread k's contribution to every element: (k + 1) × 4 (the scale), exact in every dtype.
    let contributions: Vec<Vec<Buf>> = (0..THREADS)
        .map(|k| ds.iter().map(|d| Buf::of(d, (4 * (k + 1)) as f32)).collect())
        .collect();
    let want = (THREADS * (THREADS + 1) / 2) as f32;
    let (sh, ah) = (H(s as usize), H(a as usize));
    let lost = common::race_rounds(
        THREADS,
        10_000,
        |_| ok(unsafe { gradacc_accumulator_begin_microbatch(ah.0 as *mut _, 1) }),
        |k, round| {
            ok(unsafe {
                gradacc_accumulator_add_tensor(
                    ah.0 as *mut _,
                    sh.0 as *const _,
                    round % 3,
                    contributions[k][round % 3].ptr(),
                    33,
                )
            })
        },
        |round| {
            ok(unsafe { gradacc_accumulator_end_microbatch(a) });
            let mut info = gradacc_sync_info_t::default();
            ok(unsafe { gradacc_accumulator_sync(a, null_mut(), &mut info) });
            let got = masters(a, 3);
            let wrong = (0..got.len()).find(|&i| {
                f32::from_bits(got[i]) != if i / 33 == round % 3 { want } else { 0.0 }
            })?;
            Some(format!(
                "round {round}: tensor {} element {} is {}, not {want}",
                wrong / 33,
                wrong % 33,
                f32::from_bits(got[wrong])
            ))
        },
    );
    assert!(lost.is_none(), "a contribution was lost: {}", lost.unwrap());
    ok(unsafe { gradacc_accumulator_destroy(a) });
    ok(unsafe { gradacc_scaler_destroy(s) });
}

/// Training loops of 6 accumulator+scaler pairs run at once on 6 threads, with overflow steps and
/// scale growth, all reading one shared fixed scaler too; each ends exactly as when run alone.
#[test]
fn independent_objects_on_threads_match_serial() {
    let mut rng = Rng::fresh("independent_objects_on_threads_match_serial");
    let pairs = 6;
    let steps = 40;
    let setups: Vec<(Vec<gradacc_tensor_desc_t>, u64)> =
        (0..pairs).map(|_| (descs(&mut rng, 5, 3000), rng.next_u64())).collect();
    let shared = scaler(8.0, 1);
    let shared_h = H(shared as usize);
    let train = |p: usize| -> (Vec<u32>, f32, [u64; 4]) {
        let (ds, seed) = &setups[p];
        let mut rng = Rng::seeded(*seed);
        let s = scaler(256.0, 3);
        let a = accumulator(ds, 1);
        let mut all = vec![];
        for step in 0..steps {
            for m in 0..2 {
                let mut scale = 0.0;
                ok(unsafe { gradacc_scaler_scale(s, &mut scale) });
                let mut shared_scale = 0.0;
                ok(unsafe { gradacc_scaler_scale(shared_h.0 as *const _, &mut shared_scale) });
                assert_eq!(shared_scale, 8.0);
                let bufs: Vec<Buf> = ds
                    .iter()
                    .map(|d| Buf::new(&mut rng, d, scale, step % 7 == 3 && m == 1))
                    .collect();
                let ptrs: Vec<*const c_void> = bufs.iter().map(|b| b.ptr()).collect();
                ok(unsafe { gradacc_accumulator_add(a, s, ptrs.as_ptr(), ptrs.len(), 2) });
            }
            ok(unsafe { gradacc_accumulator_sync(a, null_mut(), null_mut()) });
            all.extend(masters(a, ds.len()));
            let list = [a as *const gradacc_accumulator_t];
            ok(unsafe { gradacc_scaler_update(s, list.as_ptr(), 1, null_mut()) });
        }
        let mut scale = 0.0;
        ok(unsafe { gradacc_scaler_scale(s, &mut scale) });
        let mut st = gradacc_scaler_stats_t::default();
        ok(unsafe { gradacc_scaler_stats(s, &mut st) });
        ok(unsafe { gradacc_accumulator_destroy(a) });
        ok(unsafe { gradacc_scaler_destroy(s) });
        (all, scale, [st.steps, st.skipped_steps, st.growths, st.backoffs])
    };
    let serial: Vec<_> = (0..pairs).map(train).collect();
    assert!(
        serial[0].2[1] > 0 && serial[0].2[2] > 0,
        "overflows and growths happened: {:?}",
        serial[0].2
    );
    for round in 0..3 {
        let concurrent: Vec<_> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..pairs).map(|p| sc.spawn(move || train(p))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for p in 0..pairs {
            assert!(
                concurrent[p] == serial[p],
                "round {round}: pair {p} differs from its serial run"
            );
        }
    }
    ok(unsafe { gradacc_scaler_destroy(shared) });
}

/// One thread destroys accumulators, scalers and communicators while 6 others keep calling on the
/// same handles: each call returns OK (it ran before the destroy, or on a live object) or
/// INVALID_HANDLE (after it), and never anything else.
#[test]
fn destroy_races_report_invalid_handle() {
    let rounds = 1000;
    let callers = 6;
    let ds = [
        gradacc_tensor_desc_t { numel: 4096, dtype: GRADACC_DTYPE_F16 },
        gradacc_tensor_desc_t { numel: 33, dtype: GRADACC_DTYPE_F32 },
    ];
    let g0 = vec![0x3c00u16; 4096];
    let g1 = vec![1.0f32; 33];
    let (mut seen_ok, mut seen_invalid) = (0usize, 0usize);
    for round in 0..rounds {
        let s = scaler(1.0, 10);
        let a = accumulator(&ds, 1);
        let mut comms = [null_mut(); 2];
        ok(unsafe { gradacc_comm_create_local(2, comms.as_mut_ptr()) });
        let (sh, ah, ch) = (H(s as usize), H(a as usize), H(comms[0] as usize));
        let barrier = Barrier::new(callers + 1);
        let stop = AtomicBool::new(false);
        let counts: Vec<(usize, usize)> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..callers)
                .map(|k| {
                    let (barrier, stop, g0, g1) = (&barrier, &stop, &g0, &g1);
                    sc.spawn(move || {
                        let (s, a, c) = (
                            sh.0 as *mut gradacc_scaler_t,
                            ah.0 as *mut gradacc_accumulator_t,
                            ch.0 as *mut gradacc_comm_t,
                        );
                        let grads = [g0.as_ptr() as *const c_void, g1.as_ptr() as *const c_void];
                        let (mut oks, mut invalid) = (0, 0);
                        barrier.wait();
                        for i in 0.. {
                            let st = match (k + i) % 8 {
                                0 => unsafe { gradacc_accumulator_add(a, s, grads.as_ptr(), 2, 3) },
                                1 => {
                                    let (mut p, mut n) = (null_mut(), 0);
                                    unsafe { gradacc_accumulator_master(a, 0, &mut p, &mut n) }
                                }
                                2 => {
                                    let mut v = 0.0;
                                    unsafe { gradacc_scaler_scale(s, &mut v) }
                                }
                                3 => {
                                    let mut n = 0;
                                    unsafe { gradacc_accumulator_num_tensors(a, &mut n) }
                                }
                                4 => {
                                    let mut r = 0;
                                    unsafe { gradacc_comm_rank(c, &mut r) }
                                }
                                5 => {
                                    let mut len = 0;
                                    unsafe { gradacc_scaler_save(s, null_mut(), 0, &mut len) }
                                }
                                6 => {
                                    let mut loss = [1.5f32; 4];
                                    unsafe {
                                        gradacc_scaler_scale_loss(
                                            s,
                                            loss.as_mut_ptr() as *mut c_void,
                                            4,
                                            GRADACC_DTYPE_F32,
                                        )
                                    }
                                }
                                _ => {
                                    let mut st = gradacc_scaler_stats_t::default();
                                    unsafe { gradacc_scaler_stats(s, &mut st) }
                                }
                            };
                            match st {
                                GRADACC_STATUS_OK => oks += 1,
                                GRADACC_STATUS_INVALID_HANDLE => {
                                    invalid += 1;
                                    let msg =
                                        unsafe { std::ffi::CStr::from_ptr(gradacc_last_error()) }
                                            .to_string_lossy()
                                            .into_owned();
                                    assert!(msg.contains("not a live"), "{msg}");
                                }
                                other => panic!(
                                    "round {round}: a racing call returned {other:?}: {}",
                                    unsafe {
                                        std::ffi::CStr::from_ptr(gradacc_last_error())
                                            .to_string_lossy()
                                    }
                                ),
                            }
                            if stop.load(Ordering::Acquire) && i % 8 == 7 {
                                break;
                            }
                        }
                        (oks, invalid)
                    })
                })
                .collect();
            barrier.wait();
            // Let the callers get going, then pull every handle from under them.
            for _ in 0..(round % 5) * 200 {
                std::hint::spin_loop();
            }
            ok(unsafe { gradacc_accumulator_destroy(a) });
            ok(unsafe { gradacc_scaler_destroy(s) });
            ok(unsafe { gradacc_comm_destroy(comms[0]) });
            ok(unsafe { gradacc_comm_destroy(comms[1]) });
            stop.store(true, Ordering::Release);
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (o, i) in counts {
            seen_ok += o;
            seen_invalid += i;
        }
        assert_eq!(unsafe { gradacc_accumulator_destroy(a) }, GRADACC_STATUS_INVALID_HANDLE);
    }
    eprintln!("destroy races: {seen_ok} calls succeeded, {seen_invalid} reported INVALID_HANDLE");
    assert!(seen_invalid > 0 && seen_ok > 0);
}

/// Five in-process groups of 4 ranks sync at once (20 threads), windows with overflow included;
/// every group's every rank ends bitwise equal to the same group run alone.
#[test]
fn concurrent_local_groups_match_serial() {
    let mut rng = Rng::fresh("concurrent_local_groups_match_serial");
    let world = 4;
    let groups = 5;
    let windows = 4;
    let ds = descs(&mut rng, 6, 5000);
    // grads[r][w][m][t]
    let grads: Vec<Vec<Vec<Vec<Buf>>>> = (0..world)
        .map(|r| {
            (0..windows)
                .map(|w| {
                    (0..2)
                        .map(|m| {
                            ds.iter()
                                .enumerate()
                                .map(|(t, d)| {
                                    Buf::new(
                                        &mut rng,
                                        d,
                                        512.0,
                                        r == 2 && w == 2 && m == 0 && t == 1,
                                    )
                                })
                                .collect()
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let group_run = || -> Vec<Vec<u32>> {
        let mut comms = vec![null_mut(); world];
        ok(unsafe { gradacc_comm_create_local(world as i32, comms.as_mut_ptr()) });
        let hs: Vec<H> = comms.iter().map(|&c| H(c as usize)).collect();
        let out = std::thread::scope(|sc| {
            let joins: Vec<_> = (0..world)
                .map(|r| {
                    let (c, grads, ds) = (hs[r], &grads, &ds);
                    sc.spawn(move || {
                        let s = scaler(512.0, 1_000_000);
                        let a = accumulator(ds, 1);
                        let mut got = vec![];
                        for w in 0..windows {
                            for m in 0..2 {
                                let ptrs: Vec<*const c_void> =
                                    grads[r][w][m].iter().map(|b| b.ptr()).collect();
                                ok(unsafe {
                                    gradacc_accumulator_add(
                                        a,
                                        s,
                                        ptrs.as_ptr(),
                                        ptrs.len(),
                                        1 + r as u64,
                                    )
                                });
                            }
                            let mut info = gradacc_sync_info_t::default();
                            ok(unsafe {
                                gradacc_accumulator_sync(a, c.0 as *mut gradacc_comm_t, &mut info)
                            });
                            got.extend(masters(a, ds.len()));
                            got.push(info.found_inf as u32);
                        }
                        ok(unsafe { gradacc_accumulator_destroy(a) });
                        ok(unsafe { gradacc_scaler_destroy(s) });
                        got
                    })
                })
                .collect();
            joins.into_iter().map(|j| j.join().unwrap()).collect::<Vec<_>>()
        });
        for c in comms {
            ok(unsafe { gradacc_comm_destroy(c) });
        }
        out
    };
    let serial = group_run();
    for r in 1..world {
        assert!(serial[r] == serial[0], "rank {r} differs from rank 0");
    }
    let concurrent: Vec<Vec<Vec<u32>>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..groups).map(|_| sc.spawn(group_run)).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (g, ranks) in concurrent.iter().enumerate() {
        for (r, got) in ranks.iter().enumerate() {
            assert!(*got == serial[0], "group {g} rank {r} differs from the serial run");
        }
    }
}
