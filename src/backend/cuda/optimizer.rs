//! The optimizer step on a CUDA device: FP32 masters and state in device memory, stepped by one
//! fused launch (per SOURCES_PER_LAUNCH tensors) from the accumulator's reduced gradient, the
//! model's weights written in the same pass, then a one-thread launch that advances the step
//! count, which lives in device memory. Both read the boundary's overflow flag, so a skip is
//! decided on the device, with no host round trip. Under sharding the ranks then all-gather the
//! new weights over NCCL through a staging buffer. The per-element math is kernels/math.cuh's,
//! the CPU's `update.rs` and `rounding.rs` bit for bit.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use parking_lot::Mutex;

use super::driver::{self, capturing, launch_args, CUdeviceptr, CUstream, Context, DeviceBuffer};
use super::kernels::Kernels;
use super::layout::{GaOptChunk, GaOptRule, GaOptTensor, GaWeights, SOURCES_PER_LAUNCH};
use super::store::nccl;
use super::store::{Claims, Schedule, CHUNK};
use crate::accumulator::protocol::Step;
use crate::accumulator::{Accumulator, Plan, Reduced};
use crate::backend::cuda::nccl::NcclComm;
use crate::comm::Communicator;
use crate::device::DevicePtr;
use crate::dtype::{self, Dtype};
use crate::error::{Error, ErrorKind, Result};
use crate::optimizer::store::{
    Column, Fingerprint, Gather as ShardGather, Init, OptimizerStore, Setup, Span, Values, Weights,
};
use crate::optimizer::{Algorithm, Rounding, StateFormat};

/// One launch over a table: tensors `first..first + count`, whose chunks are consecutive.
struct Launch {
    first: usize,
    count: usize,
    first_chunk: usize,
    num_chunks: u64,
}

/// A chunk table in device memory, tensor after tensor, and its launches.
struct Table {
    chunks: DeviceBuffer,
    launches: Vec<Launch>,
}

impl Table {
    /// The chunks of `pieces` (at most CHUNK elements each; `unit` is the size in `at`'s units of
    /// one element of tensor i), in tensor order.
    fn new(
        ctx: &Arc<Context>,
        stream: CUstream,
        pieces: &[Span],
        tensors: usize,
        unit: impl Fn(usize) -> usize,
    ) -> Result<Table> {
        let mut chunks: Vec<GaOptChunk> = Vec::new();
        for p in pieces {
            for start in p.elements.clone().step_by(CHUNK) {
                let len = (p.elements.end - start).min(CHUNK);
                let at = p.at + (start - p.elements.start) * unit(p.tensor);
                chunks.push(GaOptChunk {
                    tensor: p.tensor as u64,
                    start: start as u64,
                    len: len as u64,
                    at: at as u64,
                });
            }
        }
        chunks.sort_by_key(|c| c.tensor);
        let launches = (0..tensors)
            .step_by(SOURCES_PER_LAUNCH)
            .filter_map(|first| {
                let count = SOURCES_PER_LAUNCH.min(tensors - first);
                let first_chunk = chunks.partition_point(|c| (c.tensor as usize) < first);
                let num_chunks = chunks[first_chunk..]
                    .partition_point(|c| (c.tensor as usize) < first + count)
                    as u64;
                (num_chunks > 0).then_some(Launch { first, count, first_chunk, num_chunks })
            })
            .collect();
        Ok(Table { chunks: DeviceBuffer::from_slice(ctx, stream, &chunks)?, launches })
    }

    /// Runs `f` once per launch with its chunks' address, their count and its weights.
    fn each(
        &self,
        weights: &[DevicePtr],
        mut f: impl FnMut(CUdeviceptr, u64, GaWeights) -> Result<()>,
    ) -> Result<()> {
        for l in &self.launches {
            let mut w = GaWeights {
                first_tensor: l.first as u64,
                count: l.count as u64,
                w: [0; SOURCES_PER_LAUNCH],
            };
            w.w[..l.count].copy_from_slice(&weights[l.first..l.first + l.count]);
            let chunks =
                self.chunks.ptr() + (l.first_chunk * std::mem::size_of::<GaOptChunk>()) as u64;
            f(chunks, l.num_chunks, w)?;
        }
        Ok(())
    }
}

/// The all-gather of a sharded step: every rank's weights of its shard in a slot of the
/// staging, this rank's packed in, the others' unpacked after the gather.
struct Gather {
    staging: DeviceBuffer,
    /// f32 words per rank's slot (NCCL gathers equal counts).
    slot_words: usize,
    pack: Table,
    unpack: Table,
}

impl Gather {
    /// The all-gather of rank `rank` among `all` ranks' pieces (each rank's in its shard): one
    /// slot per rank, as large as the largest rank's weights, and the tables that pack this
    /// rank's pieces into its slot and unpack the others'.
    fn new(
        ctx: &Arc<Context>,
        stream: CUstream,
        all: &[Vec<Span>],
        rank: usize,
        dtypes: &[Dtype],
    ) -> Result<Gather> {
        let unit = |i: usize| dtypes[i].size();
        let bytes =
            |q: &[Span]| -> usize { q.iter().map(|p| p.elements.len() * unit(p.tensor)).sum() };
        let slot_words = all.iter().map(|q| bytes(q)).max().unwrap_or(0).div_ceil(4);
        let slot = |q: usize, p: &Span| Span {
            tensor: p.tensor,
            elements: p.elements.clone(),
            at: q * slot_words * 4 + p.at,
        };
        let own: Vec<Span> = all[rank].iter().map(|p| slot(rank, p)).collect();
        let others: Vec<Span> = (0..all.len())
            .filter(|&q| q != rank)
            .flat_map(|q| all[q].iter().map(move |p| (q, p)))
            .map(|(q, p)| slot(q, p))
            .collect();
        let n = dtypes.len();
        Ok(Gather {
            staging: DeviceBuffer::zeroed(ctx, stream, all.len() * slot_words * 4)?,
            slot_words,
            pack: Table::new(ctx, stream, &own, n, unit)?,
            unpack: Table::new(ctx, stream, &others, n, unit)?,
        })
    }
}

/// An optimizer's masters, state, step count and tables on one device, every launch on the
/// accumulator's stream.
pub(crate) struct DeviceOptimizer {
    ctx: Arc<Context>,
    kernels: Arc<Kernels>,
    stream: CUstream,
    tensors: DeviceBuffer,
    step_table: Table,
    /// The held range of the flat layout: index 0 of the buffers below is its first element.
    held: Range<usize>,
    master: DeviceBuffer,
    first: DeviceBuffer,
    /// AdamW's second moments; none for SGD.
    second: Option<DeviceBuffer>,
    /// One u64: the steps taken.
    steps: DeviceBuffer,
    /// One f32: the learning rate every step reads when it runs.
    lr: DeviceBuffer,
    gather: Option<Gather>,
    claims: Claims,
    /// The communicators over which every rank's optimizer was checked to agree.
    checked: Mutex<Vec<u64>>,
    /// The caller's masters and their length, when adopted.
    adopted: Option<(CUdeviceptr, usize)>,
    /// The kernels' update rule; per tensor the model weights' dtype and element count.
    rule: GaOptRule,
    format: StateFormat,
    dtypes: Vec<Dtype>,
    numel: Vec<usize>,
    /// The learning rate the host last set, and the steps taken as far as the host knows:
    /// `steps_known` while every step since the count was last read was stepped after a `sync`,
    /// whose result the host has.
    host_lr: f32,
    host_steps: u64,
    steps_known: bool,
}

impl fmt::Debug for DeviceOptimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceOptimizer")
            .field("ordinal", &self.ctx.ordinal)
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

// SAFETY: as DeviceStore: device addresses and the stream handle are used only through driver
// calls that take them from any thread once the context is current, which each call makes it.
unsafe impl Send for DeviceOptimizer {}
// SAFETY: as Send; the optimizer's calls are serialised by its lock.
unsafe impl Sync for DeviceOptimizer {}

impl DeviceOptimizer {
    /// Checks the weights (and adopted masters) on the device, then uploads the tables and the
    /// masters, read from the model's weights (this waits for the stream: creation is once per
    /// run), or adopts the caller's.
    pub(crate) fn new(setup: &Setup<'_>, ordinal: i32, stream: CUstream) -> Result<Self> {
        let Init::Device(weights) = setup.weights else {
            return Err(Error::invalid("host weights for a device optimizer"));
        };
        let ctx = Context::get(ordinal)?;
        let (dtypes, numel) = (setup.dtypes, setup.numel());
        check_weights(&ctx, weights, dtypes, &numel)?;
        setup.check_adopted(|ptr, len| {
            check_allocation(&ctx, ptr, len, Dtype::F32, "`masters`", "masters")
        })?;
        let kernels = Kernels::of(&ctx)?;
        let held = setup.held();
        let pieces = setup.pieces(&held, false);
        let tensors: Vec<GaOptTensor> = dtypes
            .iter()
            .zip(setup.groups)
            .map(|(d, g)| GaOptTensor {
                lr_scale: g.lr_scale,
                decays: g.weight_decay as u32,
                dtype: d.code(),
                pad: 0,
            })
            .collect();
        let adopted = setup.masters.map(|(ptr, len)| (ptr as CUdeviceptr, len));
        let (rem, bf16) = (setup.format.remainders(), setup.format.bf16_moments());
        let master = match adopted {
            Some((ptr, _)) => DeviceBuffer::adopt(&ctx, stream, ptr, held.len() * 4),
            // A widened bf16 weight's remainder is zero.
            None if rem => DeviceBuffer::zeroed(&ctx, stream, held.len() * 2)?,
            // No masters: the model's weights are.
            None if setup.format.no_masters() => DeviceBuffer::zeroed(&ctx, stream, 0)?,
            None => {
                let values = masters_from(&ctx, stream, &pieces, dtypes, weights, held.len())?;
                DeviceBuffer::from_slice(&ctx, stream, &values)?
            }
        };
        let step_table = Table::new(&ctx, stream, &pieces, dtypes.len(), |_| 1)?;
        let gather = match setup.shards() {
            Some((all, rank)) if all.len() > 1 => {
                Some(Gather::new(&ctx, stream, &all, rank, dtypes)?)
            }
            _ => None,
        };
        let len = held.len();
        let moment_bytes = len * if bf16 { 2 } else { 4 };
        let steps = DeviceBuffer::zeroed(&ctx, stream, 8)?;
        let lr = DeviceBuffer::from_slice(&ctx, stream, &[setup.lr])?;
        Ok(DeviceOptimizer {
            tensors: DeviceBuffer::from_slice(&ctx, stream, &tensors)?,
            step_table,
            master,
            first: DeviceBuffer::zeroed(&ctx, stream, moment_bytes)?,
            second: (setup.algorithm.second_moment())
                .then(|| DeviceBuffer::zeroed(&ctx, stream, moment_bytes))
                .transpose()?,
            claims: Claims::scheduled(
                &ctx,
                stream,
                Schedule { kernels: kernels.clone(), lr: lr.ptr(), steps: steps.ptr() },
            )?,
            steps,
            lr,
            checked: Mutex::new(Vec::new()),
            adopted,
            rule: rule(&setup.algorithm, setup.rounding, &setup.format),
            format: setup.format,
            dtypes: dtypes.to_vec(),
            numel,
            host_lr: setup.lr,
            host_steps: 0,
            steps_known: true,
            held,
            gather,
            ctx,
            kernels,
            stream,
        })
    }

    /// The agreement of a sharded step over `comm`: every rank's claim at `step`, this one's
    /// flagged invalid with `own`, in a blocking exchange (it waits for the stream), the first
    /// time over `comm` and whenever the stream is not being captured.
    ///
    /// While the stream is captured into a CUDA graph nothing may wait, so after that first
    /// check nothing is exchanged: a rank whose call is invalid stops pairing on `comm` instead,
    /// so that its peers' all-gather fails (at their timeout, or when they see the abort)
    /// rather than pairing with a later call. A first step over `comm` under capture is refused
    /// (WRONG_STATE) on every rank alike, before anything is enqueued.
    fn agree_over(
        &self,
        step: Step,
        plan: &Plan,
        comm: &NcclComm,
        own: Option<&Error>,
    ) -> Result<()> {
        let mut checked = self.checked.lock();
        if !capturing(&self.ctx, self.stream)? {
            self.claims.agree(step, plan, Some(comm), None, own)?;
            if !checked.contains(&comm.id()) {
                checked.push(comm.id());
            }
            return Ok(());
        }
        if !checked.contains(&comm.id()) {
            return Err(Error::wrong_state(
                "the first sharded optimizer step over a communicator checks that every rank's \
                 optimizer agrees, which waits for the stream: take it before capturing a graph",
            ));
        }
        match own {
            Some(e) => {
                comm.stop_pairing();
                Err(e.clone())
            }
            None => Ok(()),
        }
    }

    /// Enqueues one step from `reduced` on the stream: the fused pass, the step count's advance
    /// and, with `gather`, the all-gather of the model weights. Nothing waits.
    fn enqueue_step(
        &self,
        reduced: Reduced,
        weights: &[DevicePtr],
        rule: GaOptRule,
        gather: Option<&NcclComm>,
    ) -> Result<()> {
        let (ctx, stream) = (&*self.ctx, self.stream);
        let tensors = self.tensors.ptr();
        let (grad, boundary) = (reduced.grad, reduced.boundary);
        let (master, first) = (self.master.ptr(), self.first.ptr());
        let second: CUdeviceptr = self.second.as_ref().map_or(0, DeviceBuffer::ptr);
        let (held_start, steps, lr) = (self.held.start as u64, self.steps.ptr(), self.lr.ptr());
        self.step_table.each(weights, |chunks, num_chunks, w| {
            let mut args = launch_args!(
                tensors, chunks, num_chunks, w, grad, master, first, second, held_start, boundary,
                steps, lr, rule
            );
            // SAFETY: the arguments follow ga_opt_step's signature (`w` and `rule` by value); the
            // chunks lie inside the held range, which the masters, moments and the reduced
            // gradient hold, and inside their tensors, whose weights hold numel values of their
            // dtypes (checked by `check_weights`); the boundary, the step count and the learning
            // rate are live buffers of this context.
            unsafe { self.kernels.opt_step.launch_over(ctx, stream, num_chunks, &mut args) }
        })?;
        let mut args = launch_args!(boundary, steps);
        // SAFETY: ga_opt_advance takes the boundary and the u64 step count, both live buffers.
        unsafe { self.kernels.opt_advance.launch(ctx, 1, 1, stream, &mut args)? };
        if let (Some(g), Some(c)) = (&self.gather, gather) {
            self.copy(&g.pack, weights, g.staging.ptr(), true)?;
            c.allgather_f32(g.staging.ptr(), g.slot_words, stream)?;
            self.copy(&g.unpack, weights, g.staging.ptr(), false)?;
        }
        Ok(())
    }

    fn copy(
        &self,
        table: &Table,
        weights: &[DevicePtr],
        staging: CUdeviceptr,
        to: bool,
    ) -> Result<()> {
        let (ctx, stream, tensors) = (&*self.ctx, self.stream, self.tensors.ptr());
        let to_staging = to as u32;
        table.each(weights, |chunks, num_chunks, w| {
            let mut args = launch_args!(tensors, chunks, num_chunks, w, staging, to_staging);
            // SAFETY: the arguments follow ga_opt_copy's signature; every chunk lies inside its
            // tensor's weights and inside its rank's slot of the staging, sized for the largest
            // slot.
            unsafe { self.kernels.opt_copy.launch_over(ctx, stream, num_chunks, &mut args) }
        })
    }

    /// The learning rate in device memory (waits for the stream).
    fn read_lr(&self) -> Result<f32> {
        let mut lr = [0f32];
        self.lr.read(&mut lr)?;
        Ok(lr[0])
    }

    /// The steps taken (waits for the stream).
    fn read_steps(&self) -> Result<u64> {
        let mut steps = [0u64];
        self.steps.read(&mut steps)?;
        Ok(steps[0])
    }

    /// The step count, the masters (or remainders) and the moments, each in its format (waits
    /// for the stream).
    fn read_state(&self) -> Result<(u64, [Held; 3])> {
        let len = self.held.len();
        let read = |b: &DeviceBuffer, u16s: bool| -> Result<Held> {
            Ok(if u16s {
                let mut v = vec![0u16; len];
                b.read(&mut v)?;
                Held::U16(v)
            } else {
                let mut v = vec![0f32; len];
                b.read(&mut v)?;
                Held::F32(v)
            })
        };
        let (rem, bf16) = (self.format.remainders(), self.format.bf16_moments());
        let second = match &self.second {
            Some(b) => read(b, bf16)?,
            None => Held::F32(vec![]),
        };
        let master = match self.format.no_masters() {
            true => Held::F32(vec![]),
            false => read(&self.master, rem)?,
        };
        let values = [master, read(&self.first, bf16)?, second];
        Ok((self.read_steps()?, values))
    }

    /// Enqueues overwriting the step count, learning rate, masters and moments (`second` ignored
    /// for SGD), given in this optimizer's formats.
    fn write_state(&self, v: &Values<'_>) -> Result<()> {
        let write = |b: &DeviceBuffer, c: &Column<'_>| match c {
            Column::F32(x) => b.write(x),
            Column::U16(x) => b.write(x),
            Column::Blocks { .. } => Err(Error::invalid("blockwise moments on a device")),
        };
        self.steps.write(&[v.steps])?;
        self.lr.write(&[v.lr])?;
        write(&self.master, &v.master)?;
        write(&self.first, &v.first)?;
        if let Some(s) = &self.second {
            write(s, &v.second)?;
        }
        Ok(())
    }
}

impl OptimizerStore for DeviceOptimizer {
    fn lr(&self) -> f32 {
        self.read_lr().unwrap_or(self.host_lr)
    }

    fn set_lr(&mut self, lr: f32) -> Result<()> {
        // Enqueued: the steps enqueued before keep theirs.
        self.lr.write(&[lr])?;
        self.host_lr = lr;
        Ok(())
    }

    fn lr_address(&self) -> Option<DevicePtr> {
        Some(self.lr.ptr())
    }

    fn steps(&mut self) -> u64 {
        if !self.steps_known {
            if let Ok(steps) = self.read_steps() {
                (self.host_steps, self.steps_known) = (steps, true);
            }
        }
        self.host_steps
    }

    fn view(&self, f: &mut dyn FnMut(&Values<'_>)) -> Result<()> {
        let (steps, [master, first, second]) = self.read_state()?;
        let lr = self.read_lr()?;
        let (master, first, second) = (master.column(), first.column(), second.column());
        f(&Values { lr, steps, master, first, second });
        Ok(())
    }

    fn restore(&mut self, v: &Values<'_>) -> Result<()> {
        // Stream-ordered; a failed copy leaves the device's state unknown, and is reported.
        let written = self.write_state(v);
        (self.host_lr, self.host_steps, self.steps_known) = (v.lr, v.steps, true);
        written
    }

    fn adopted(&self) -> Option<(DevicePtr, usize)> {
        self.adopted
    }

    fn takes(&self, comm: &dyn Communicator) -> Result<()> {
        nccl_of(comm).map(drop)
    }

    fn check_weights(&self, weights: &Weights<'_, '_>) -> Result<()> {
        let Weights::Device(weights) = weights else {
            return Err(Error::invalid("host weights for a device optimizer"));
        };
        check_weights(&self.ctx, weights, &self.dtypes, &self.numel)
    }

    fn agree(
        &self,
        kind: &Fingerprint,
        plan: &Plan,
        comm: &dyn Communicator,
        own: Option<&Error>,
    ) -> Result<()> {
        self.agree_over(kind.step(None), plan, nccl_of(comm)?, own)
    }

    fn refuse(&self, kind: &Fingerprint, plan: &Plan, comm: &dyn Communicator) {
        if let Ok(c) = nccl(comm) {
            let refused = Error::invalid("this rank's step was refused");
            let _ = self.agree_over(kind.step(None), plan, c, Some(&refused));
        }
    }

    fn step(
        &mut self,
        acc: &Accumulator,
        weights: Weights<'_, '_>,
        gather: Option<&ShardGather<'_>>,
        consumed: &mut Option<u64>,
    ) -> Result<Option<bool>> {
        let weights = weights.device()?;
        let comm = gather.map(|g| nccl_of(g.comm)).transpose()?;
        acc.with_reduced_on_device("the optimizer step", |window, info, reduced| {
            *consumed = Some(window);
            self.enqueue_step(reduced, weights, self.rule, comm)?;
            match info {
                Some(info) if !info.found_inf => self.host_steps += 1,
                Some(_) => {}
                None => self.steps_known = false,
            }
            Ok(info.map(|i| !i.found_inf))
        })
    }
}

/// The NCCL communicator of a step's all-gather.
fn nccl_of(comm: &dyn Communicator) -> Result<&NcclComm> {
    nccl(comm).map_err(|_| {
        Error::new(
            ErrorKind::DeviceMismatch,
            "`comm`: a CUDA accumulator's optimizer all-gathers over an NCCL communicator",
        )
    })
}

/// The held masters read from the model's weights (waits for the stream): `len` values, zeros
/// in the padding.
fn masters_from(
    ctx: &Arc<Context>,
    stream: CUstream,
    pieces: &[Span],
    dtypes: &[Dtype],
    weights: &[DevicePtr],
    len: usize,
) -> Result<Vec<f32>> {
    let mut master = vec![0.0f32; len];
    for p in pieces {
        let dtype = dtypes[p.tensor];
        let weight =
            DeviceBuffer::adopt(ctx, stream, weights[p.tensor], p.elements.end * dtype.size());
        let out = &mut master[p.at..p.at + p.elements.len()];
        let offset = p.elements.start * dtype.size();
        match dtype {
            Dtype::F32 => weight.read_at(offset, out)?,
            _ => {
                let mut bits = vec![0u16; out.len()];
                weight.read_at(offset, &mut bits)?;
                let widen = if dtype == Dtype::F16 {
                    crate::math::f16_to_f32
                } else {
                    crate::math::bf16_to_f32
                };
                out.iter_mut().zip(bits).for_each(|(m, b)| *m = widen(b));
            }
        }
    }
    Ok(master)
}

fn check_weights(
    ctx: &Context,
    weights: &[DevicePtr],
    dtypes: &[Dtype],
    numel: &[usize],
) -> Result<()> {
    for (i, ((&w, &dtype), &n)) in weights.iter().zip(dtypes).zip(numel).enumerate() {
        check_allocation(ctx, w, n, dtype, &format!("`weights[{i}]`"), "weights")?;
    }
    Ok(())
}

/// Fails unless `w` (named `what`) is one device allocation of `n` values of `dtype` on `ctx`'s
/// device; `role` says what the optimizer takes there.
fn check_allocation(
    ctx: &Context,
    w: DevicePtr,
    n: usize,
    dtype: Dtype,
    what: &str,
    role: &str,
) -> Result<()> {
    dtype::check_buffer(w as *const std::ffi::c_void, n, dtype, what)?;
    if n == 0 {
        return Ok(());
    }
    let last = w + (n * dtype.size() - 1) as u64;
    let (start, end) = (driver::buffer_id(ctx, w)?, driver::buffer_id(ctx, last)?);
    if start.is_none() || start != end {
        return Err(Error::new(
            ErrorKind::DeviceMismatch,
            format!(
                "{what} = {w:#x} is not one device allocation of {n} {} values (bytes {w:#x}..={last:#x}): the optimizer of a CUDA accumulator takes its {role} as device addresses",
                dtype.name()
            ),
        ));
    }
    Ok(())
}

/// A state column read from the device.
enum Held {
    F32(Vec<f32>),
    U16(Vec<u16>),
}

impl Held {
    fn column(&self) -> Column<'_> {
        match self {
            Held::F32(v) => Column::F32(v),
            Held::U16(v) => Column::U16(v),
        }
    }
}

/// The kernels' rule for `algorithm`, rounding with `rounding`, keeping the state in `format`.
fn rule(algorithm: &Algorithm, rounding: Rounding, format: &StateFormat) -> GaOptRule {
    let (rounding, seed) = match rounding {
        Rounding::NearestEven => (0, 0),
        Rounding::Stochastic { seed } => (1, seed),
    };
    let (masters, moments, moment_seed) = format.codes();
    let (masters, moments) = (masters as u32, moments as u32);
    let base = GaOptRule { rounding, seed, masters, moments, moment_seed, ..Default::default() };
    match *algorithm {
        Algorithm::AdamW { beta1, beta2, eps, weight_decay } => {
            GaOptRule { algorithm: 1, beta1, beta2, eps, weight_decay, ..base }
        }
        Algorithm::Sgd { momentum, dampening, nesterov, weight_decay } => GaOptRule {
            algorithm: 2,
            nesterov: nesterov as u32,
            momentum,
            dampening,
            weight_decay,
            ..base
        },
    }
}
