//! How an optimizer is made: one builder for every device, over an accumulator, with the model's
//! weights as host values or device addresses, and optionally the caller's FP32 masters adopted.

use super::config::{OptimizerConfig, TensorGroup};
use super::format::StateFormat;
use super::fp8::WeightFormat;
use super::Optimizer;
use crate::accumulator::Accumulator;
use crate::device::DevicePtr;
use crate::dtype::{Dtype, Grad};
use crate::error::{Error, ErrorKind, Result};

/// The model's weights given to the builder.
#[derive(Clone, Copy, Debug)]
enum Given<'a> {
    Host(&'a [Grad<'a>]),
    Device(&'a [DevicePtr], &'a [Dtype]),
}

/// The caller's masters given to the builder: host memory, or a device address.
#[derive(Clone, Copy, Debug)]
enum Adopted {
    Host(*mut f32, usize),
    Device(DevicePtr, usize),
}

/// Makes an [`Optimizer`] over an accumulator ([`Optimizer::builder`]): its configuration
/// (default [`OptimizerConfig::default`]), the tensors' groups (default: every tensor in the
/// default group), the model's weights (required: [`OptimizerBuilder::weights`] on a CPU
/// accumulator, [`OptimizerBuilder::device_weights`] on a CUDA one) and, optionally, the
/// caller's FP32 masters to adopt instead of allocating them.
#[derive(Debug)]
#[must_use = "an optimizer is made by `build`"]
pub struct OptimizerBuilder<'a> {
    acc: &'a Accumulator,
    config: OptimizerConfig,
    format: StateFormat,
    weight_formats: &'a [WeightFormat],
    groups: &'a [TensorGroup],
    weights: Option<Given<'a>>,
    masters: Option<Adopted>,
}

impl Optimizer {
    /// A builder of an optimizer over `acc`'s tensors, device and sharding.
    pub fn builder(acc: &Accumulator) -> OptimizerBuilder<'_> {
        OptimizerBuilder {
            acc,
            config: OptimizerConfig::default(),
            format: StateFormat::default(),
            weight_formats: &[],
            groups: &[],
            weights: None,
            masters: None,
        }
    }
}

impl<'a> OptimizerBuilder<'a> {
    /// The algorithm, the learning rate of the first step and the rounding.
    pub fn config(mut self, config: OptimizerConfig) -> Self {
        self.config = config;
        self
    }

    /// How the masters and moments are kept (default: FP32 both): bf16 moments rounded
    /// stochastically, masters as the bf16 weights plus remainders ([`StateFormat`]). Formats
    /// that cannot be kept exactly (remainders over f16 or f32 weights, or with stochastic
    /// rounding of the weights, or adopted masters), and no masters over 16-bit weights rounded
    /// to nearest or with adopted masters, make `build` fail with `InvalidArgument`.
    pub fn state(mut self, format: StateFormat) -> Self {
        self.format = format;
        self
    }

    /// How the step writes each tensor's model weights (empty, the default: every tensor in
    /// its model dtype). [`WeightFormat::E4m3Tensorwise`] and [`WeightFormat::Mxfp8`] make the
    /// step write FP8 codes and scales ([`Optimizer::step_weights`]), so that a sharded
    /// boundary's all-gather moves one byte per element; `build` refuses them (`InvalidArgument`
    /// naming `weight_formats[i]`) without a sharded boundary, without FP32 masters, and on a
    /// CUDA accumulator. The weights given to [`OptimizerBuilder::weights`] for such a tensor
    /// are its initial values, from which the masters start.
    pub fn weight_formats(mut self, formats: &'a [WeightFormat]) -> Self {
        self.weight_formats = formats;
        self
    }

    /// Each tensor in `groups[i]` (empty, the default: every tensor in the default group).
    pub fn groups(mut self, groups: &'a [TensorGroup]) -> Self {
        self.groups = groups;
        self
    }

    /// The model's weights on a CPU accumulator: one whole tensor per accumulator tensor, of any
    /// dtype (the model's, which a step writes). The masters start as their values, unless
    /// adopted ([`OptimizerBuilder::masters`]).
    pub fn weights(mut self, weights: &'a [Grad<'a>]) -> Self {
        self.weights = Some(Given::Host(weights));
        self
    }

    /// The model's weights on a CUDA accumulator: `weights[i]` is the device address of tensor
    /// i's numel values of `dtypes[i]`, on the accumulator's device. Unless the masters are
    /// adopted ([`OptimizerBuilder::device_masters`]), `build` reads them (it waits for the
    /// stream).
    pub fn device_weights(mut self, weights: &'a [DevicePtr], dtypes: &'a [Dtype]) -> Self {
        self.weights = Some(Given::Device(weights, dtypes));
        self
    }

    /// Adopts the caller's FP32 masters in host memory (a CPU accumulator): `len` values laid out
    /// as the accumulator's flat layout over the range this rank holds
    /// ([`Accumulator::shard`]: element k is flat element `shard.start + k`, so tensor i's masters
    /// start at [`Accumulator::offset`]`(i) - shard.start`; a step neither reads nor writes the
    /// padding between tensors, and [`Optimizer::load`] writes zeros there). Their values ARE the
    /// masters: `build` does not overwrite them from the weights (which give the model's dtypes
    /// and lengths), every step updates them in place, `load` writes into them, and no copy is
    /// kept. `build` then also fails on a null or misaligned `masters`, or one that overlaps a
    /// weight (`InvalidArgument`: a step writes both; `step` refuses such weights too), or a
    /// `len` other than the shard's (`SizeMismatch`).
    ///
    /// # Safety
    /// `masters` must be valid for reads and writes of `len` f32 values in host memory for the
    /// optimizer's lifetime, and neither read nor written by anything else while one of its
    /// calls runs.
    pub unsafe fn masters(mut self, masters: *mut f32, len: usize) -> Self {
        self.masters = Some(Adopted::Host(masters, len));
        self
    }

    /// [`OptimizerBuilder::masters`] on a CUDA accumulator: the caller's FP32 masters at the
    /// device address `masters`, `len` values laid out as the held range of the flat layout,
    /// adopted: never overwritten from the weights, updated in place by every step
    /// (stream-ordered on the accumulator's stream), never freed. `build` then does not read the
    /// weights and does not wait for the stream, and also fails on a null or misaligned
    /// `masters` (`InvalidArgument`), a `len` other than the shard's (`SizeMismatch`), or a
    /// `masters` that is not one device allocation of `len` f32 values on the accumulator's
    /// device (`DeviceMismatch`).
    ///
    /// # Safety
    /// `masters` must stay allocated for the optimizer's lifetime, and nothing else may read or
    /// write it while a step enqueued on the stream runs.
    pub unsafe fn device_masters(mut self, masters: DevicePtr, len: usize) -> Self {
        self.masters = Some(Adopted::Device(masters, len));
        self
    }

    /// The optimizer. Fails, making nothing, on a config out of range, no weights, a wrong
    /// count, a weight of the wrong length, weights or masters in the other device's memory
    /// (`DeviceMismatch`: host weights for a CUDA accumulator, device addresses for a CPU one,
    /// a device weight that is not one device allocation of its tensor's length), and on
    /// adopted masters as [`OptimizerBuilder::masters`] and
    /// [`OptimizerBuilder::device_masters`] say.
    pub fn build(self) -> Result<Optimizer> {
        let OptimizerBuilder { acc, config, format, weight_formats, groups, weights, masters } =
            self;
        let format = (format, weight_formats);
        let Some(weights) = weights else {
            return Err(Error::invalid(
                "the optimizer needs the model's weights: OptimizerBuilder::weights (host) or device_weights (CUDA)",
            ));
        };
        match (weights, masters) {
            (Given::Host(w), None) => Optimizer::new_host(acc, config, format, groups, w, None),
            (Given::Host(w), Some(Adopted::Host(ptr, len))) => {
                Optimizer::new_host(acc, config, format, groups, w, Some((ptr, len)))
            }
            (Given::Device(w, d), None) => Optimizer::new_on_device(acc, config, format, groups, w, d, None),
            (Given::Device(w, d), Some(Adopted::Device(ptr, len))) => {
                Optimizer::new_on_device(acc, config, format, groups, w, d, Some((ptr, len)))
            }
            (Given::Host(_), Some(Adopted::Device(..))) | (Given::Device(..), Some(Adopted::Host(..))) => {
                Err(Error::new(
                    ErrorKind::DeviceMismatch,
                    "`masters` and the weights are in different memories: host masters (masters) go with host weights (weights), device masters (device_masters) with device weights (device_weights)",
                ))
            }
        }
    }
}
