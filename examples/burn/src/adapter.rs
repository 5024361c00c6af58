//! Burn ⇄ gradacc: copy this file into a Burn training loop. It declares a module's float
//! parameters as gradacc tensors (in the module's own visiting order, the same on every rank),
//! feeds each micro-batch's `Gradients` to an [`Accumulator`], and hands the boundary's master
//! gradient back as `GradientsParams` keyed by an FP32 master module, for any Burn optimizer.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Gradients, Tensor, TensorData};
use gradacc::{Accumulator, Dtype, Grad, Scaler, TensorDesc};

/// What can go wrong between Burn and gradacc.
#[derive(Debug)]
pub enum Error {
    Gradacc(gradacc::Error),
    /// A parameter or gradient Burn holds in a dtype gradacc does not take, or cannot read.
    Burn(String),
}

impl From<gradacc::Error> for Error {
    fn from(e: gradacc::Error) -> Self {
        Error::Gradacc(e)
    }
}

/// Every float parameter's tensor (with autodiff, the tracked leaf), in visiting order.
struct Leaves(Vec<Tensor<1>>);

impl ModuleVisitor for Leaves {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let t = param.val();
        let n = t.shape().num_elements();
        self.0.push(t.reshape([n]));
    }
}

fn dtype(d: DType) -> Result<Dtype, Error> {
    match d {
        DType::F32 => Ok(Dtype::F32),
        DType::F16 => Ok(Dtype::F16),
        DType::BF16 => Ok(Dtype::Bf16),
        d => Err(Error::Burn(format!("gradacc takes f32, f16 or bf16 gradients, not {d:?}"))),
    }
}

/// One `TensorDesc` per float parameter of `module`, in its dtype (f32, f16 or bf16).
pub fn descs<M: Module>(module: &M) -> Result<Vec<TensorDesc>, Error> {
    let mut leaves = Leaves(Vec::new());
    module.visit(&mut leaves);
    let desc = |t: &Tensor<1>| {
        Ok(TensorDesc { numel: t.shape().num_elements(), dtype: dtype(t.dtype())? })
    };
    leaves.0.iter().map(desc).collect()
}

/// The gradient of every float parameter of `module` in `grads`, in visiting order (None: the
/// parameter took no part in the loss).
struct GradData<'a> {
    grads: &'a Gradients,
    out: Vec<Option<TensorData>>,
}

impl ModuleVisitor for GradData<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.out.push(param.val().grad(self.grads).map(|g| g.into_data()));
    }
}

/// Adds one micro-batch of `count` items: the gradients of `module`'s parameters in `grads` (of
/// a loss scaled by `scaler.scale()`), each read from Burn's host copy without conversion. A
/// parameter without a gradient adds nothing (its master stays zero if no micro-batch reaches it).
pub fn add_microbatch<M: Module>(
    acc: &Accumulator,
    scaler: &Scaler,
    grads: &Gradients,
    module: &M,
    count: u64,
) -> Result<(), Error> {
    let mut data = GradData { grads, out: Vec::new() };
    module.visit(&mut data);
    let bad = |i: usize, e| Error::Burn(format!("gradient {i}: {e:?}"));
    acc.begin_microbatch(count)?;
    for (i, d) in data.out.iter().enumerate().filter_map(|(i, d)| d.as_ref().map(|d| (i, d))) {
        let grad = match d.dtype() {
            DType::F32 => Grad::F32(d.as_slice::<f32>().map_err(|e| bad(i, e))?),
            DType::F16 => Grad::F16(d.as_slice::<half::f16>().map_err(|e| bad(i, e))?),
            DType::BF16 => Grad::Bf16(d.as_slice::<half::bf16>().map_err(|e| bad(i, e))?),
            other => return Err(Error::Burn(format!("gradient {i} has dtype {other:?}"))),
        };
        acc.add_tensor(scaler, i, grad)?;
    }
    acc.end_microbatch()?;
    Ok(())
}

/// Registers the accumulator's master `i` under the `i`-th float parameter's id.
struct MasterGrads<'a> {
    acc: &'a Accumulator,
    grads: GradientsParams,
    index: usize,
    error: Option<Error>,
}

impl ModuleVisitor for MasterGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let shape = param.val().shape();
        let device = param.val().device().inner();
        match self.acc.with_master(self.index, |g| TensorData::new(g.to_vec(), shape)) {
            Ok(data) => self.grads.register(param.id, Tensor::<D>::from_data(data, &device)),
            Err(e) => self.error = self.error.take().or(Some(e.into())),
        }
        self.index += 1;
    }
}

/// The synced FP32 master gradients as `GradientsParams` keyed by `masters`' parameter ids (in
/// the accumulator's tensor order), for `Optimizer::step` on the FP32 master module.
pub fn master_grads<M: Module>(acc: &Accumulator, masters: &M) -> Result<GradientsParams, Error> {
    let mut v = MasterGrads { acc, grads: GradientsParams::new(), index: 0, error: None };
    masters.visit(&mut v);
    v.error.map_or(Ok(v.grads), Err)
}

/// Every float parameter cast to `dtype`, detached, and a leaf that records its gradient again:
/// the model's low-precision copy of the FP32 masters after a step, with the masters' ids.
pub struct CastTo(pub DType);

impl ModuleMapper for CastTo {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = self.0;
        param.map(|t| t.cast(dtype).detach().require_grad())
    }
}

/// `masters` cast to `dtype`: the model a micro-batch's forward and backward run on.
pub fn cast<M: Module>(masters: &M, dtype: DType) -> M {
    masters.clone().map(&mut CastTo(dtype))
}

/// The float parameters' values in visiting order, flattened to f32 (for checks and logs).
pub fn values<M: Module>(module: &M) -> Vec<Vec<f32>> {
    let mut leaves = Leaves(Vec::new());
    module.visit(&mut leaves);
    leaves
        .0
        .into_iter()
        .map(|t| t.cast(DType::F32).into_data().try_to_vec::<f32>().unwrap())
        .collect()
}
