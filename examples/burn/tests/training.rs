//! The Burn example against Burn itself: the accumulated gradient against Burn's FP32 full-batch
//! gradient, replicas bitwise identical after training, and an overflow on one rank skipping the
//! step on both.

use burn::tensor::{DType, Tensor, TensorData};
use gradacc::{Dtype, LocalComm, ScalerConfig};
use gradacc_burn::adapter;
use gradacc_burn::train::{self, Batch, Mlp, Replica, IN};

const RANKS: usize = 2;

fn scaler() -> ScalerConfig {
    ScalerConfig { init_scale: 1024.0, ..Default::default() }
}

/// Runs `f(rank, comm)` on one thread per rank and returns the results in rank order.
fn on_ranks<T: Send>(f: impl Fn(usize, &LocalComm) -> T + Sync) -> Vec<T> {
    let comms = LocalComm::group(RANKS).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .enumerate()
            .map(|(r, c)| {
                let f = &f;
                s.spawn(move || f(r, c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// FP32 initial masters, already representable in `dtype`: the half-precision model then holds
/// the masters' exact values, and Burn's FP32 model of the same weights is the reference.
///
/// Burn's initialiser is seeded (under a lock: the seed is the backend's, shared by the tests'
/// threads). With arbitrary weights no rounding bound holds: a hidden unit whose pre-activation
/// rounds across zero in 16 bits flips its ReLU, and moves the gradient by O(1), not O(u).
fn init(dtype: DType) -> Mlp {
    static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let mlp = {
        let _one = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
        train::device().seed(0x5eed);
        Mlp::new()
    };
    adapter::cast(&adapter::cast(&mlp, dtype), DType::F32)
}

fn f64s(t: Tensor<1>) -> Vec<f64> {
    let v = t.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap();
    v.into_iter().map(f64::from).collect()
}

fn norm(v: impl Iterator<Item = f64>) -> f64 {
    v.map(|x| x * x).sum::<f64>().sqrt()
}

/// The gradient of each float parameter of `model` in `grads`, flattened, in visiting order.
fn grads_of(model: &Mlp, loss: Tensor<1>) -> Vec<Vec<f64>> {
    let grads = loss.backward();
    struct G<'a>(&'a burn::tensor::Gradients, Vec<Vec<f64>>);
    impl burn::module::ModuleVisitor for G<'_> {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            let g = p.val().grad(self.0).expect("every parameter has a gradient");
            let n = g.shape().num_elements();
            self.1.push(f64s(g.reshape([n])));
        }
    }
    let mut v = G(&grads, Vec::new());
    burn::module::Module::visit(model, &mut v);
    v.1
}

/// The boundary's master gradient against two references, for one step of 6 micro-batches
/// (sizes 4, 6, 3 on rank 0 and 5, 2, 1 on rank 1) of a model in `dtype`:
///
/// 1. gradacc's arithmetic: the f64 sum of the very 16-bit gradients Burn's backward produced,
///    unscaled and weighted by count / 21; each master element is within 11 f32 roundings of it
///    (as the candle example derives: 6 weighted terms, 3 additions per rank, the sum over 2
///    ranks and the normalisation).
/// 2. Burn's own FP32 gradient of the mean loss over the 21 items with the same weights and
///    inputs: within 37 roundings of the 16-bit unit u per tensor, in L2 norm relative to the
///    items' gradient magnitudes (the longest rounding path through this MLP's half-precision
///    forward and backward, as derived for the candle example, whose model is the same).
fn check_gradient(dtype: DType, unit: f64) {
    let init = init(dtype);
    let results = on_ranks(|rank, comm| {
        let rep = Replica::new(dtype, &init, scaler()).unwrap();
        let want = if dtype == DType::F16 { Dtype::F16 } else { Dtype::Bf16 };
        assert!(rep.acc.tensors().iter().all(|t| t.dtype == want), "the model runs in {dtype:?}");
        let scale = rep.scaler.scale().unwrap() as f64;
        let mut terms: Vec<Vec<Vec<f64>>> = Vec::new();
        for b in train::batches(0, rank, dtype) {
            rep.microbatch(&b).unwrap();
            // The same backward again: the 16-bit gradients the accumulator just read.
            let loss = rep.model.loss(&b.x, &b.y).mul_scalar(scale);
            let per = grads_of(&rep.model, loss);
            terms.push(
                per.into_iter()
                    .map(|g| g.into_iter().map(|v| v / scale * b.items as f64).collect())
                    .collect(),
            );
        }
        let info = rep.acc.sync(Some(comm)).unwrap();
        let n = rep.acc.tensors().len();
        let masters: Vec<Vec<f32>> =
            (0..n).map(|i| rep.acc.with_master(i, |g| g.to_vec()).unwrap()).collect();
        (info, masters, terms)
    });
    let (info, masters, _) = &results[0];
    assert_eq!(info.total_count, 21);
    assert!(!info.found_inf);
    assert_eq!(masters, &results[1].1, "both ranks hold the same master bits");

    let total = info.total_count as f64;
    let all_terms: Vec<&Vec<Vec<f64>>> = results.iter().flat_map(|r| r.2.iter()).collect();
    for (i, master) in masters.iter().enumerate() {
        let mut worst = 0.0f64;
        for (e, &m) in master.iter().enumerate() {
            let exact: f64 = all_terms.iter().map(|t| t[i][e]).sum::<f64>() / total;
            let magnitude: f64 = all_terms.iter().map(|t| t[i][e].abs()).sum::<f64>() / total;
            let bound = 11.0 * f64::powi(2.0, -24) * magnitude;
            assert!(
                (m as f64 - exact).abs() <= bound,
                "{dtype:?} tensor {i}[{e}]: master {m} vs {exact} (bound {bound})"
            );
            worst = worst.max((m as f64 - exact).abs() / magnitude.max(f64::MIN_POSITIVE));
        }
        eprintln!(
            "{dtype:?} tensor {i}: master vs f64 sum of the 16-bit gradients: {:.2} units of 2^-24",
            worst * 2f64.powi(24)
        );
    }

    // Burn's FP32 full-batch gradient of the same weights over all 21 items.
    let reference = adapter::cast(&init, DType::F32);
    let all: Vec<Batch> = (0..RANKS).flat_map(|r| train::batches(0, r, DType::F32)).collect();
    let x = Tensor::cat(all.iter().map(|b| b.x.clone()).collect(), 0);
    let y = Tensor::cat(all.iter().map(|b| b.y.clone()).collect(), 0);
    let full = grads_of(&reference, reference.loss(&x, &y));
    for (i, (master, g)) in masters.iter().zip(&full).enumerate() {
        let diff = norm(master.iter().zip(g).map(|(&m, &r)| m as f64 - r));
        // Relative to the items' gradients before they cancel: each item's 16-bit gradient is
        // within its rounding path of its FP32 one, so the sum's error scales with the sum of
        // their magnitudes, not with the sum itself (with Burn's random initial weights the
        // items can cancel to a small gradient).
        let magnitude =
            (0..g.len()).map(|e| all_terms.iter().map(|t| t[i][e].abs()).sum::<f64>() / total);
        let rel = diff / norm(magnitude);
        eprintln!(
            "{dtype:?} tensor {i}: L2 distance to the FP32 full-batch gradient {rel:.2e} = {:.2} u",
            rel / unit
        );
        assert!(rel <= 37.0 * unit, "{dtype:?} tensor {i}: relative distance {rel} exceeds 37 u");
    }
}

#[test]
fn f16_gradient_matches_fp32_full_batch() {
    check_gradient(DType::F16, f64::powi(2.0, -11));
}

#[test]
fn bf16_gradient_matches_fp32_full_batch() {
    check_gradient(DType::BF16, f64::powi(2.0, -8));
}

/// One rank's state after one step.
struct Step {
    masters: Vec<Vec<f32>>,
    skipped: bool,
    /// Mean of the micro-batches' losses.
    loss: f32,
    scale: f32,
}

/// Trains `steps` steps on both ranks; `poison(step, rank, k, batch)` may change a micro-batch.
fn train(
    dtype: DType,
    steps: usize,
    poison: impl Fn(usize, usize, usize, &mut Batch) + Sync,
) -> Vec<Vec<Step>> {
    let init = init(dtype);
    on_ranks(|rank, comm| {
        let mut rep = Replica::new(dtype, &init, scaler()).unwrap();
        (0..steps)
            .map(|step| {
                let mut loss = 0.0;
                for (k, mut b) in train::batches(step, rank, dtype).into_iter().enumerate() {
                    poison(step, rank, k, &mut b);
                    loss += rep.microbatch(&b).unwrap() / 3.0;
                }
                let info = rep.step(comm).unwrap();
                let masters = adapter::values(&rep.masters);
                let half: Vec<Vec<f32>> = masters
                    .iter()
                    .map(|m| m.iter().map(|&v| half_round(dtype, v)).collect())
                    .collect();
                assert_eq!(
                    adapter::values(&rep.model),
                    half,
                    "the {dtype:?} model is the masters rounded"
                );
                Step { masters, skipped: info.found_inf, loss, scale: rep.scaler.scale().unwrap() }
            })
            .collect()
    })
}

fn half_round(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => half::bf16::from_f32(v).to_f32(),
    }
}

#[test]
fn ranks_stay_bitwise_identical_and_learn() {
    for dtype in [DType::F16, DType::BF16] {
        let steps = 30;
        let runs = train(dtype, steps, |_, _, _, _| {});
        for (step, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
            assert_eq!(a.masters, b.masters, "{dtype:?} step {step}: ranks differ");
            assert!(!a.skipped && !b.skipped);
        }
        let mean = |s: usize| (runs[0][s].loss + runs[1][s].loss) / 2.0;
        let (first, last) = (mean(0), mean(steps - 1));
        eprintln!("{dtype:?}: mean loss {first:.4} -> {last:.4} in {steps} steps");
        assert!(last < 0.5 * first, "{dtype:?}: loss {first} -> {last}");
    }
}

#[test]
fn inf_on_one_rank_skips_the_step_on_both() {
    let dtype = DType::F16;
    let runs = train(dtype, 4, |step, rank, k, b| {
        if step == 2 && rank == 1 && k == 1 {
            let mut mask = vec![0f32; b.items * IN];
            mask[IN - 1] = f32::INFINITY;
            let mask =
                Tensor::<2>::from_data(TensorData::new(mask, [b.items, IN]), &train::device());
            b.x = b.x.clone() + mask.cast(dtype);
        }
    });
    for run in &runs {
        let skipped: Vec<bool> = run.iter().map(|s| s.skipped).collect();
        assert_eq!(skipped, [false, false, true, false]);
        assert_eq!(run[2].masters, run[1].masters, "the skipped step changed nothing");
        assert_eq!((run[1].scale, run[2].scale), (1024.0, 512.0), "the scale backs off");
        assert_ne!(run[3].masters, run[2].masters, "the next step trains");
    }
    for (step, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
        assert_eq!(a.masters, b.masters, "step {step}: ranks differ");
    }
}
