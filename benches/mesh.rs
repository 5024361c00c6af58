//! The mesh step against the plain syncs of the same accumulators: two ranks on threads (dp 2),
//! each with a dense accumulator of 90M elements and an expert one of 10M (100M in all), bf16
//! gradients, no clipping triggered and with clipping (which the plain syncs cannot do across
//! accumulators: the mesh then makes one more pass over the gradient). The time of the boundary
//! only (the micro-batch is added before each repeat), median of repeats after a warm-up, taken
//! in turns. `cargo bench --bench mesh [-- ELEMENTS]`.

mod common;

use std::sync::{Arc, Barrier};
use std::time::Instant;

use common::{gradients, median};
use gradacc::{
    Accumulator, AccumulatorConfig, Communicator, Dtype, Grad, LocalComm, Mesh, Part, Scaler,
    ScalerConfig, TensorDesc,
};

const REPEATS: usize = 7;

/// Rank `rank`'s boundary times: plain syncs, mesh steps without and with clipping.
fn rank_times(
    dense: usize,
    expert: usize,
    world: LocalComm,
    groups: [LocalComm; 2],
    barrier: &Barrier,
) -> [Vec<f64>; 3] {
    let scaler =
        Scaler::new(ScalerConfig { init_scale: 1.0, dynamic: false, ..Default::default() })
            .unwrap();
    let (_, _, grad) = gradients(dense.max(expert));
    let accs: Vec<Accumulator> = [dense, expert]
        .iter()
        .map(|&n| {
            let t = [TensorDesc { numel: n, dtype: Dtype::Bf16 }];
            Accumulator::new(AccumulatorConfig::default(), &t).unwrap()
        })
        .collect();
    let world: Arc<dyn Communicator> = Arc::new(world);
    let plain = Mesh::new(world.clone(), world.rank(), world.world_size()).unwrap();
    let clipping = Mesh::new(world.clone(), world.rank(), world.world_size())
        .unwrap()
        .max_grad_norm(1e-3)
        .unwrap();
    let parts: Vec<Part<'_>> =
        accs.iter().zip(&groups).map(|(a, g)| Part::new(a, Some(g as &dyn Communicator))).collect();
    let mut times: [Vec<f64>; 3] = Default::default();
    for r in 0..=REPEATS {
        for (way, t) in times.iter_mut().enumerate() {
            for (a, n) in accs.iter().zip([dense, expert]) {
                a.add(&scaler, &[Grad::Bf16(&grad[..n])][..], 1).unwrap();
            }
            barrier.wait();
            let start = Instant::now();
            match way {
                0 => {
                    for (a, g) in accs.iter().zip(&groups) {
                        a.sync(Some(g)).unwrap();
                    }
                }
                1 => drop(plain.sync(&parts).unwrap()),
                _ => drop(clipping.sync(&parts).unwrap()),
            }
            let elapsed = start.elapsed().as_secs_f64();
            if r > 0 {
                t.push(elapsed);
            }
        }
    }
    times
}

fn main() {
    let total: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(100_000_000);
    let (dense, expert) = (total / 10 * 9, total / 10);
    println!(
        "gradacc mesh step, dp 2 on threads, {dense} + {expert} elements per rank, bf16 gradients, \
         median of {REPEATS} after a warm-up\n"
    );
    let world = LocalComm::group(2).unwrap();
    let (d, e) = (LocalComm::group(2).unwrap(), LocalComm::group(2).unwrap());
    let barrier = Barrier::new(2);
    let per_rank: Vec<[Vec<f64>; 3]> = std::thread::scope(|s| {
        let handles: Vec<_> = world
            .into_iter()
            .zip(d.into_iter().zip(e))
            .map(|(w, (d, e))| {
                let barrier = &barrier;
                s.spawn(move || rank_times(dense, expert, w, [d, e], barrier))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let [plain, mesh, clipped] = per_rank.into_iter().next().unwrap().map(median);
    println!("| boundary | ms | ratio to the plain syncs |");
    println!("|---|---:|---:|");
    println!("| two plain syncs | {:.1} | 1.000 |", plain * 1e3);
    println!("| mesh step, no clipping | {:.1} | {:.3} |", mesh * 1e3, mesh / plain);
    println!("| mesh step, clipped | {:.1} | {:.3} |", clipped * 1e3, clipped / plain);
}
