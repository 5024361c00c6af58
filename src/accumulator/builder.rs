//! Making an accumulator: [`AccumulatorBuilder`] (device, config, an adopted master, the
//! communicator of a sharded accumulation), the checks made before anything is created, and the
//! plan, store and window it is built from.

use std::sync::Arc;

use super::window::Window;
use super::{Accumulator, AccumulatorConfig, Layout, Plan, Sharding, TensorDesc, MASTER_ALIGN};
use crate::comm::Communicator;
use crate::device::Device;
use crate::error::{Error, ErrorKind, Result};

/// Builds an [`Accumulator`]: [`Accumulator::builder`].
#[derive(Clone)]
#[must_use = "an accumulator is made by `build`"]
pub struct AccumulatorBuilder<'a> {
    tensors: &'a [TensorDesc],
    device: Device,
    config: AccumulatorConfig,
    master: Option<(*mut f32, usize)>,
    comm: Option<Arc<dyn Communicator>>,
}

impl AccumulatorBuilder<'_> {
    /// Where the master lives and the work runs: on CUDA the master is allocated on the
    /// device's stream, and every later call's work is ordered on that stream.
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    pub fn config(mut self, config: AccumulatorConfig) -> Self {
        self.config = config;
        self
    }

    /// The communicator of a sharded accumulation ([`Sharding::Accumulate`] in the config, whose
    /// doc is the contract: what each rank holds, the calls every rank makes, how a failure
    /// ends). It has `shards` ranks, of which this is `rank`: a host communicator (in-process or
    /// MPI) on the CPU, an NCCL communicator on the same device on CUDA; the accumulator keeps a
    /// reference to it. `build` fails with `InvalidArgument` when the config does not shard or
    /// the communicator has another size or rank, and `DeviceMismatch` for a communicator of
    /// another kind or device.
    ///
    /// On CUDA the shard and the staging are device memory: `add` enqueues each stripe's
    /// conversion, reduce-scatter and shard add on the device's stream without waiting; hooks
    /// convert on that stream and reduce each bucket on a communication stream as soon as its
    /// turn comes, and `end_microbatch` waits for the micro-batch's closing control step.
    pub fn communicator(mut self, comm: Arc<dyn Communicator>) -> Self {
        self.comm = Some(comm);
        self
    }

    /// Adopts the caller's FP32 buffer (host memory for the CPU, a device address for CUDA) of
    /// exactly [`Accumulator::master_len`] elements (the tensors and the padding that aligns
    /// each one) as the master. The padding is zeroed by `build` and must stay untouched; tensor
    /// `i` starts at element [`Accumulator::offset`]`(i)`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` f32 values in the device's memory, and
    /// used by nothing else while the accumulator is alive except through the accumulator's own
    /// accessors.
    pub unsafe fn master_buffer(mut self, ptr: *mut f32, len: usize) -> Self {
        self.master = Some((ptr, len));
        self
    }

    /// Makes the accumulator, or fails creating nothing.
    pub fn build(self) -> Result<Accumulator> {
        if let Some((ptr, _)) = self.master {
            if ptr.is_null() {
                return Err(Error::invalid("master buffer is null"));
            }
            if ptr.align_offset(std::mem::align_of::<f32>()) != 0 {
                return Err(Error::invalid(format!("master buffer {ptr:p} is not 4-byte aligned")));
            }
        }
        if let Some(comm) = &self.comm {
            let Sharding::Accumulate { shards, rank } = self.config.sharding else {
                return Err(Error::invalid(
                    "a communicator at creation is for sharded accumulation (Sharding::Accumulate); this config does not shard it",
                ));
            };
            if (comm.world_size(), comm.rank()) != (shards, rank) {
                return Err(Error::invalid(format!(
                    "the accumulator holds shard {rank} of {shards}, but the communicator is rank {} of {}",
                    comm.rank(),
                    comm.world_size()
                )));
            }
        }
        Accumulator::build(self.device, self.config, self.tensors, self.master, self.comm)
    }
}

impl Accumulator {
    /// A CPU accumulator that owns its master buffer: the common case. Everything else (another
    /// device, a caller's master buffer, sharded accumulation) is [`Accumulator::builder`]'s.
    pub fn new(config: AccumulatorConfig, tensors: &[TensorDesc]) -> Result<Self> {
        Self::builder(tensors).config(config).build()
    }

    /// An accumulator over `tensors`, configured step by step: on the CPU, with
    /// `AccumulatorConfig::default()`, owning its master, unless told otherwise.
    ///
    /// ```
    /// use gradacc::{Accumulator, AccumulatorConfig, Device, Dtype, TensorDesc};
    ///
    /// let tensors = [
    ///     TensorDesc { numel: 1000, dtype: Dtype::F16 },
    ///     TensorDesc { numel: 10, dtype: Dtype::F32 },
    /// ];
    /// let acc = Accumulator::builder(&tensors)
    ///     .device(Device::Cpu)
    ///     .config(AccumulatorConfig { max_grad_norm: 1.0, ..Default::default() })
    ///     .build()?;
    /// assert_eq!(acc.tensors().len(), 2);
    /// # Ok::<(), gradacc::Error>(())
    /// ```
    pub fn builder(tensors: &[TensorDesc]) -> AccumulatorBuilder<'_> {
        AccumulatorBuilder {
            tensors,
            device: Device::Cpu,
            config: AccumulatorConfig::default(),
            master: None,
            comm: None,
        }
    }

    fn build(
        device: Device,
        config: AccumulatorConfig,
        tensors: &[TensorDesc],
        adopt: Option<(*mut f32, usize)>,
        comm: Option<Arc<dyn Communicator>>,
    ) -> Result<Self> {
        config.validate()?;
        let layout = Layout::new(tensors, config.bucket_numel)?;
        if let Some((_, len)) = adopt {
            if len != layout.len() {
                return Err(Error::new(
                    ErrorKind::SizeMismatch,
                    format!(
                        "master buffer holds {len} elements, the tensors need {} (each starts at a multiple of {MASTER_ALIGN} bytes: \
                         gradacc_accumulator_master_numel; Accumulator::master_len in Rust)",
                        layout.len()
                    ),
                ));
            }
        }
        if let Sharding::Accumulate { shards, .. } = config.sharding {
            if adopt.is_some() {
                return Err(Error::invalid(
                    "sharded accumulation owns its shard: it cannot adopt a whole master buffer",
                ));
            }
            if comm.is_none() && shards > 1 {
                return Err(Error::invalid(format!(
                    "sharded accumulation over {shards} ranks reduces every micro-batch: create it with its communicator \
                     (gradacc_accumulator_create_sharded; AccumulatorBuilder::communicator in Rust)"
                )));
            }
        }
        let plan = Arc::new(Plan { config, descs: tensors.to_vec(), layout });
        let store = crate::backend::store_for(device.check()?, &plan, adopt.map(|(p, _)| p), comm)?;
        let window = Window::new((0..tensors.len()).map(|i| plan.layout.range(i)));
        Ok(Accumulator { window, plan, store })
    }
}
