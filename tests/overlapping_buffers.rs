//! Gradients that share memory with the accumulator's master, on the CPU: refused with
//! INVALID_ARGUMENT (nothing changes) at every shift that overlaps the master, the tensor's own
//! master included (see `common::check_overlapping_gradients`; the CUDA twin is in
//! tests/cuda_gpu.rs).

mod common;

use common::{check_overlapping_gradients, OVERLAP_MARGIN, OVERLAP_TENSORS};
use gradacc::*;

#[test]
fn gradients_overlapping_the_master_are_refused() {
    let len = Accumulator::master_len(&OVERLAP_TENSORS).unwrap();
    let mut backing: Vec<f32> = (0..2 * OVERLAP_MARGIN + len).map(|i| i as f32).collect();
    let base = backing.as_mut_ptr();
    let config = AccumulatorConfig {
        loss_reduction: LossReduction::Sum,
        normalize: Normalize::None,
        threads: 3,
        ..Default::default()
    };
    // SAFETY: the master lies inside `backing`, which outlives the accumulator and is read below
    // only through raw pointers while no call runs.
    let acc = unsafe {
        Accumulator::builder(&OVERLAP_TENSORS)
            .config(config)
            .master_buffer(base.add(OVERLAP_MARGIN), len)
            .build()
    }
    .unwrap();
    let scaler = Scaler::new(ScalerConfig { init_scale: 2.0, ..Default::default() }).unwrap();
    let (first, third) = (vec![1.5f32; 8192], vec![common::to_f16(3.0); 50]);
    let read = |at: usize, n: usize| {
        (0..n).map(|k| unsafe { base.add(at + k).read() }).collect::<Vec<f32>>()
    };
    let tried = check_overlapping_gradients(
        &acc,
        &scaler,
        base as usize,
        [first.as_ptr() as usize, third.as_ptr() as usize],
        &|| read(OVERLAP_MARGIN, len),
        &read,
    );
    assert!(tried > 24_000, "{tried} shifts");
    drop(acc);
    drop(backing);
}
