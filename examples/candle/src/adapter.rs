//! candle ⇄ gradacc: copy this file into a candle training loop. It pairs a model's
//! low-precision Vars with FP32 master Vars, feeds each micro-batch's `GradStore` to an
//! [`Accumulator`] without copying, and hands the boundary's master gradient back as a `GradStore`
//! keyed by the master Vars, for any candle_nn optimizer.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Storage, Tensor, Var};
use candle_nn::VarMap;
use gradacc::{Accumulator, Dtype, Grad, Scaler, TensorDesc};

/// A gradacc error as a candle error.
pub fn err(e: gradacc::Error) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// The Vars of `map`, sorted by name: `VarMap` iterates a `HashMap`, whose order differs between
/// processes, and every rank must declare the same tensors in the same order.
pub fn sorted_vars(map: &VarMap) -> Vec<Var> {
    let data = map.data().lock().unwrap();
    let mut named: Vec<_> = data.iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    named.into_iter().map(|(_, v)| v.clone()).collect()
}

/// One `TensorDesc` per Var, in the Vars' dtype (f32, f16 or bf16).
pub fn descs(vars: &[Var]) -> Result<Vec<TensorDesc>> {
    let dtype = |d| match d {
        DType::F32 => Ok(Dtype::F32),
        DType::F16 => Ok(Dtype::F16),
        DType::BF16 => Ok(Dtype::Bf16),
        d => candle_core::bail!("gradacc takes f32, f16 or bf16 gradients, not {d:?}"),
    };
    vars.iter()
        .map(|v| Ok(TensorDesc { numel: v.elem_count(), dtype: dtype(v.dtype())? }))
        .collect()
}

/// Adds one micro-batch of `count` items: the gradients of `vars` in `grads` (of a loss scaled by
/// `scaler.scale()`), read in place from candle's CPU storage. A Var without a gradient adds
/// nothing (its master stays zero if no micro-batch reaches it).
pub fn add_microbatch(
    acc: &Accumulator,
    scaler: &Scaler,
    grads: &GradStore,
    vars: &[Var],
    count: u64,
) -> Result<()> {
    acc.begin_microbatch(count).map_err(err)?;
    for (i, g) in vars.iter().enumerate().filter_map(|(i, v)| grads.get(v).map(|g| (i, g))) {
        let (storage, layout) = g.storage_and_layout();
        let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("gradient {i} is not a contiguous CPU tensor")
        };
        let grad = match g.dtype() {
            DType::F32 => Grad::F32(&cpu.as_slice::<f32>()?[start..end]),
            DType::F16 => Grad::F16(&cpu.as_slice::<half::f16>()?[start..end]),
            DType::BF16 => Grad::Bf16(&cpu.as_slice::<half::bf16>()?[start..end]),
            d => candle_core::bail!("gradient {i} has dtype {d:?}"),
        };
        acc.add_tensor(scaler, i, grad).map_err(err)?;
    }
    acc.end_microbatch().map_err(err)
}

/// The synced FP32 master gradients as candle tensors, keyed by the master Vars (in the
/// accumulator's tensor order) for `Optimizer::step`.
pub fn master_grads(acc: &Accumulator, masters: &[Var]) -> Result<GradStore> {
    let mut store = GradStore::default();
    for (i, m) in masters.iter().enumerate() {
        let g =
            acc.with_master(i, |g| Tensor::from_slice(g, m.shape(), m.device())).map_err(err)??;
        store.insert(m, g);
    }
    Ok(store)
}

/// Sets every Var of `to` from the same-index Var of `from`, cast to `to`'s dtype: the model's
/// low-precision weights from the FP32 masters after a step, or one replica from another.
pub fn copy_weights(from: &[Var], to: &[Var]) -> Result<()> {
    from.iter().zip(to).try_for_each(|(f, t)| t.set(&f.as_tensor().to_dtype(t.dtype())?))
}
