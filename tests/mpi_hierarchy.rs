//! The hierarchical boundary over MPI, each rank a process: `mpirun` starts this binary's
//! `rank` test on every rank, with `GRADACC_MPI_HIERARCHY` making consecutive ranks one host
//! (or, from `scripts/sim-hosts`, with ranks on simulated hosts). Each rank reduces random
//! buffers of odd sizes, FP32 and bf16 wire, with and without a rescaling pass, checks every
//! element and block value against an f64 reference and prints a hash of its bits; the harness
//! checks that every rank printed the same. Needs the `mpi` feature and Open MPI's `mpirun`
//! (skipped without it): `cargo test --release --features mpi --test mpi_hierarchy`.
#![cfg(feature = "mpi")]

mod common;

use std::sync::atomic::{AtomicU32, Ordering};

use common::{fnv1a, from_bf16, mpirun, to_bf16, Rng};
use gradacc::comm::BlockPass;
use gradacc::math::NORM_BLOCK;
use gradacc::{Communicator, Dtype, MpiComm};

/// The seed and the number of hosts each rank expects.
const ENV: &str = "GRADACC_HIERARCHY_TEST";

/// Ranks, `GRADACC_MPI_HIERARCHY`, and the hosts the reduction then spans.
const CASES: &[(usize, &str, usize)] =
    &[(4, "2", 2), (6, "3", 2), (6, "2", 3), (4, "flat", 1), (4, "auto", 1), (4, "", 1)];

#[test]
fn hierarchical_boundary_over_mpi() {
    if !mpirun::available() {
        return;
    }
    let mut rng = Rng::fresh("hierarchical_boundary_over_mpi");
    for &(np, hierarchy, hosts) in CASES {
        let seed = rng.next_u64();
        let what = format!("{np} ranks, hierarchy {hierarchy}, seed {seed:#x}");
        // The last case leaves the variable unset: the default.
        let vars = [
            (ENV, Some(format!("{seed} {hosts}"))),
            ("GRADACC_MPI_HIERARCHY", (!hierarchy.is_empty()).then(|| hierarchy.to_string())),
        ];
        let text = mpirun::run(np, "rank", None, &vars, &what);
        let reports: Vec<&str> =
            text.lines().filter_map(|l| l.split_once("hierarchy report ").map(|r| r.1)).collect();
        assert_eq!(reports.len(), np, "{what}:\n{text}");
        assert!(reports.iter().all(|r| *r == reports[0]), "{what}: {reports:?}");
    }
}

/// Sums of squares per block; with `rescale`, a factor from all of them, recorded.
struct Pass {
    wire: Dtype,
    rescale: bool,
    factor: AtomicU32,
}

impl BlockPass for Pass {
    fn run(&self, run: &mut [f32], values: &mut [f64]) {
        for (block, v) in run.chunks(NORM_BLOCK).zip(values) {
            *v = block.iter().map(|&x| x as f64 * x as f64).sum();
        }
    }

    fn rescales(&self) -> bool {
        self.rescale
    }

    fn rescale(&self, values: &[f64]) -> Option<f32> {
        let factor = (1.0 / (1.0 + values.iter().sum::<f64>().sqrt())) as f32;
        self.factor.store(factor.to_bits(), Ordering::Relaxed);
        Some(factor)
    }

    fn wire(&self) -> Dtype {
        self.wire
    }
}

/// Rank `q`'s contribution to case `case` of `len` elements.
fn contribution(seed: u64, case: usize, q: usize, len: usize) -> Vec<f32> {
    let mut rng = Rng::seeded(seed ^ ((case as u64) << 32) ^ q as u64);
    (0..len).map(|_| rng.uniform(-4.0, 4.0) as f32).collect()
}

/// One rank under `mpirun` (does nothing when run by the harness itself).
#[test]
fn rank() {
    let Ok(args) = std::env::var(ENV) else { return };
    let (seed, hosts) = args.split_once(' ').unwrap();
    let (seed, hosts): (u64, usize) = (seed.parse().unwrap(), hosts.parse().unwrap());
    let comm = MpiComm::world().unwrap();
    let (rank, world) = (comm.rank(), comm.world_size());
    assert_eq!(comm.hosts(), hosts, "rank {rank}");
    let host = comm.host().unwrap();
    let mut rng = Rng::seeded(seed);
    let mut report = Vec::new();
    for case in 0..8 {
        // Odd sizes: below one block, a few blocks and a tail, more than one chunk.
        let len = match case % 4 {
            0 => rng.range(1, 4095),
            1 => rng.range(4097, 50_000),
            2 => rng.range(300_000, 700_000),
            _ => rng.range(0, 3) * NORM_BLOCK as u64 + rng.range(0, 1),
        } as usize;
        let wire = if case % 2 == 0 { Dtype::F32 } else { Dtype::Bf16 };
        let pass =
            Pass { wire, rescale: case / 2 % 2 == 1, factor: AtomicU32::new(1f32.to_bits()) };
        let mut buf = contribution(seed, case, rank, len);
        let values =
            host.allreduce_with_pass(&mut buf, std::slice::from_ref(&(0..len)), &pass).unwrap();
        let factor = f32::from_bits(pass.factor.load(Ordering::Relaxed)) as f64;
        // The f64 sum of every rank's contribution as it travels, and of their magnitudes.
        let (mut want, mut mag) = (vec![0f64; len], vec![0f64; len]);
        for q in 0..world {
            for (i, &c) in contribution(seed, case, q, len).iter().enumerate() {
                let c = if wire == Dtype::Bf16 { from_bf16(to_bf16(c)) } else { c as f64 };
                want[i] += c;
                mag[i] += c.abs();
            }
        }
        // FP32 sums in any order; on a bf16 wire each contribution is rounded (within 2^-8 of
        // it) and, across hosts, each host's partial sum once more: twice that bound.
        let bf16 = match (wire, hosts) {
            (Dtype::Bf16, 1) => 2f64.powi(-8),
            (Dtype::Bf16, _) => 2f64.powi(-7),
            _ => 0.0,
        };
        let rel = world as f64 * 2f64.powi(-23) + bf16;
        let what = format!("rank {rank} case {case} len {len} {wire:?}");
        for i in 0..len {
            let tol = rel * mag[i] * factor + 1e-30;
            assert!(
                (buf[i] as f64 - want[i] * factor).abs() <= tol,
                "{what} element {i}: {} against {}",
                buf[i],
                want[i] * factor
            );
        }
        assert_eq!(values.len(), len.div_ceil(NORM_BLOCK), "{what}");
        for (b, &v) in values.iter().enumerate() {
            let block = b * NORM_BLOCK..((b + 1) * NORM_BLOCK).min(len);
            let exact: f64 = want[block.clone()].iter().map(|x| x * x).sum();
            // Each sum off by at most `rel * mag`, its square by that much more.
            let tol: f64 =
                block.map(|i| (2.0 * want[i].abs() + rel * mag[i]) * rel * mag[i]).sum::<f64>()
                    + 2f64.powi(-40) * exact
                    + 1e-30;
            assert!((v - exact).abs() <= tol, "{what} block {b}: {v} against {exact}");
        }
        report.extend(buf.iter().flat_map(|x| x.to_bits().to_le_bytes()));
        report.extend(values.iter().flat_map(|x| x.to_bits().to_le_bytes()));
    }
    // On a line of its own: the test harness's own output may not have ended one.
    println!("\nhierarchy report {:#x}", fnv1a(&report));
}
