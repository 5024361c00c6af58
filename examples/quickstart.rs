//! examples/quickstart.c in Rust: two ranks (threads) fit y = x.w with bf16 weights and gradients,
//! a dynamic loss scale, FP32 accumulation of micro-batches of 3 and 5 items, one all-reduce per
//! step and SGD on FP32 masters. `cargo run --release --example quickstart`; it fails unless the
//! ranks end with the same weights and the loss fell 100-fold.
use gradacc::half::bf16;
use gradacc::{Accumulator, AccumulatorConfig, Algorithm, Communicator, Dtype, Grad, GradMut};
use gradacc::{LocalComm, Optimizer, OptimizerConfig, Scaler, ScalerConfig, TensorDesc};

const DIM: usize = 4;
const STEPS: usize = 40;
const W_TRUE: [f32; DIM] = [1.0, -2.0, 0.5, 3.0];

/// Feature j of item i in [-1, 1): a hash, the same in every language's quickstart.
fn feature(i: usize, j: usize) -> f32 {
    let h = ((DIM * i + j) as u32).wrapping_mul(2654435761);
    (h ^ (h >> 15)) as f32 / 2147483648.0 - 1.0
}

/// Mean loss 0.5 (x.w - x.w_true)^2 over `n` items from `first`, and its gradient times `scale`
/// in bf16 (the gradients and weights the accumulator takes).
fn loss_grad(w: &[bf16; DIM], first: usize, n: usize, scale: f32) -> (f32, [bf16; DIM]) {
    let (mut loss, mut sum) = (0.0f32, [0.0f32; DIM]);
    for i in first..first + n {
        let x: Vec<f32> = (0..DIM).map(|j| feature(i, j)).collect();
        let err: f32 = (0..DIM).map(|j| x[j] * (w[j].to_f32() - W_TRUE[j])).sum();
        loss += 0.5 * err * err / n as f32;
        (0..DIM).for_each(|j| sum[j] += err * x[j] / n as f32);
    }
    (loss, sum.map(|g| bf16::from_f32(g * scale)))
}

fn train(comm: &dyn Communicator, rank: usize) -> gradacc::Result<[bf16; DIM]> {
    let scaler = Scaler::new(ScalerConfig::default())?; // GradScaler's defaults, on the CPU
    let tensors = [TensorDesc { numel: DIM, dtype: Dtype::Bf16 }];
    let acc = Accumulator::new(AccumulatorConfig::default(), &tensors)?; // mean losses, by count
    let mut w = [bf16::ZERO; DIM];
    let config = OptimizerConfig { algorithm: Algorithm::sgd(), lr: 0.5, ..Default::default() };
    let opt = Optimizer::new(&acc, config, &[], &[Grad::Bf16(&w)])?; // FP32 masters from w
    for step in 0..STEPS {
        for (k, n) in [(0, 3), (1, 5)] {
            let first = 100_000 * (rank + 1) + 8 * step + 3 * k; // other items on each rank
            let (_, g) = loss_grad(&w, first, n, scaler.scale()?); // the backward of loss * scale
            acc.add(&scaler, &[Grad::Bf16(&g)], n as u64)?;
        }
        let info = acc.sync(Some(comm))?; // the all-reduce; the mean over all 16 items
        scaler.update(info.found_inf)?; // every rank decides alike
        opt.step(&acc, &mut [GradMut::Bf16(&mut w)], Some(comm))?; // a no-op on overflow
    }
    Ok(w)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let comms = LocalComm::group(2)?; // an in-process group: one communicator per rank
    let results: Vec<gradacc::Result<[bf16; DIM]>> = std::thread::scope(|s| {
        let ranks: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(rank, comm)| {
                s.spawn(move || {
                    // A failed rank aborts the group, so the other one stops waiting for it.
                    train(comm, rank).inspect_err(|_| {
                        let _ = comm.abort(); // its own failure adds nothing to the error returned
                    })
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    });
    let w: Vec<[bf16; DIM]> = results.into_iter().collect::<gradacc::Result<_>>()?;
    let (loss0, _) = loss_grad(&[bf16::ZERO; DIM], 0, 64, 1.0);
    let (loss, _) = loss_grad(&w[0], 0, 64, 1.0);
    let same = w[0].map(bf16::to_bits) == w[1].map(bf16::to_bits); // bit for bit
    let (w3, same) = (w[0][3], if same { "equal" } else { "DIFFER" });
    println!("loss {loss0:.4} -> {loss:.6}, w[3] {w3} (true 3), ranks {same}");
    if same != "equal" || loss >= loss0 / 100.0 {
        return Err("the ranks differ or the loss did not fall 100-fold".into());
    }
    Ok(())
}
