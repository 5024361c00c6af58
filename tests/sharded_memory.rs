//! Sharded accumulation's memory, measured: every allocation of the process is counted, and a
//! window on four in-process ranks must peak at their shards plus one staging bucket each, a
//! quarter of what four unsharded accumulators hold. Alone in its binary, so that nothing else
//! allocates while it measures.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::*;
use gradacc::*;

/// The system allocator, counting the bytes live and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let now = LIVE.fetch_add(bytes, Ordering::SeqCst) + bytes;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every call is passed to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::SeqCst);
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The peak of live bytes above those live when it starts, while `f` runs.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.load(Ordering::SeqCst);
    PEAK.store(base, Ordering::SeqCst);
    let out = f();
    (out, PEAK.load(Ordering::SeqCst) - base)
}

#[test]
fn a_sharded_window_holds_its_shard_and_one_bucket() {
    const WORLD: usize = 4;
    const BUCKET: usize = 256 << 10;
    // 64 tensors of 64K + 3 elements (16.8M bytes of FP32 master), in buckets of 256K elements.
    let tensors: Vec<TensorDesc> = (0..64)
        .map(|i| TensorDesc { numel: (64 << 10) + 3, dtype: [Dtype::F16, Dtype::Bf16][i % 2] })
        .collect();
    let numel: usize = tensors.iter().map(|t| t.numel).sum();
    let halves: Vec<Vec<u16>> = tensors.iter().map(|t| vec![to_f16(0.5); t.numel]).collect();
    let none: Vec<f32> = Vec::new();
    let grads: Vec<Grad> =
        tensors.iter().zip(&halves).map(|(t, h)| grad_of(t.dtype, &none, h)).collect();
    let scaler = Scaler::new(ScalerConfig { init_scale: 1.0, ..Default::default() }).unwrap();
    let config = AccumulatorConfig { bucket_numel: BUCKET, ..Default::default() };
    let comms: Vec<Arc<dyn Communicator>> = LocalComm::group(WORLD)
        .unwrap()
        .into_iter()
        .map(|c| Arc::new(c) as Arc<dyn Communicator>)
        .collect();

    // A window of two micro-batches on every rank: `add`, then the tensors one by one in the
    // backward's order (the last first), then the boundary.
    let window = |sharded: bool| {
        std::thread::scope(|s| {
            for comm in &comms {
                let (tensors, grads, scaler) = (&tensors, &grads, &scaler);
                s.spawn(move || {
                    let acc = if sharded {
                        let sharding = Sharding::Accumulate { shards: WORLD, rank: comm.rank() };
                        Accumulator::builder(tensors)
                            .config(AccumulatorConfig { sharding, ..config })
                            .communicator(comm.clone())
                            .build()
                            .unwrap()
                    } else {
                        Accumulator::new(config, tensors).unwrap()
                    };
                    acc.add(scaler, grads, 1).unwrap();
                    acc.begin_microbatch(1).unwrap();
                    for i in (0..tensors.len()).rev() {
                        acc.add_tensor(scaler, i, grads[i]).unwrap();
                    }
                    acc.end_microbatch().unwrap();
                    let info = acc.sync(Some(&**comm)).unwrap();
                    assert_eq!(info.microbatches, 2 * WORLD as u64);
                });
            }
        })
    };
    let ((), sharded) = peak_during(|| window(true));
    let ((), unsharded) = peak_during(|| window(false));

    // What the ranks hold by design: their shards (a quarter of the master, rounded to norm
    // blocks) and one staging bucket each (the largest bucket, from the norm block it starts in).
    let f32s = std::mem::size_of::<f32>();
    let largest_bucket = 4 * ((64 << 10) + 3) + 4096;
    let designed = (numel + WORLD * largest_bucket) * f32s;
    println!("sharded peak {sharded} B, designed {designed} B, unsharded peak {unsharded} B ({numel} elements, {WORLD} ranks)");
    // The rest (layouts, the collectives' block values, thread stacks' heap) is small.
    let slack = 512 << 10;
    assert!(
        sharded <= designed + slack,
        "sharded accumulation peaked at {sharded} B, its shards and buckets are {designed} B"
    );
    assert!(
        sharded >= numel * f32s,
        "the shards alone are {} B: the count missed them ({sharded} B)",
        numel * f32s
    );
    assert!(
        unsharded >= WORLD * numel * f32s,
        "each unsharded rank holds the whole master ({unsharded} B)"
    );
    assert!(
        sharded * 3 < unsharded,
        "a quarter of the master plus a bucket per rank: {sharded} B against {unsharded} B"
    );
}
