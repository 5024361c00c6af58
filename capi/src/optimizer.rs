//! C API of the FP32-master optimizer.

use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, LazyLock};

use crate::accumulator::{gradacc_accumulator_t, ACCUMULATORS};
use crate::comm::{gradacc_comm_t, COMMS};
use crate::handle::Registry;
use crate::status::{gradacc_status_t, guard, null, CallResult};
use crate::types::*;
use gradacc::dtype::{Dtype, Grad, GradMut};
use gradacc::error::{Error, ErrorKind};
use gradacc::{
    Algorithm, Device, MasterFormat, MomentFormat, Optimizer, OptimizerConfig, Rounding,
    StateFormat, TensorGroup, WeightFormat, WeightMut,
};

/// FP32 master weights and AdamW or SGD state for an accumulator's tensors (opaque). Create with
/// gradacc_optimizer_create, free with gradacc_optimizer_destroy.
pub struct gradacc_optimizer_t {
    _private: [u8; 0],
}

pub(crate) static OPTIMIZERS: LazyLock<Registry<Optimizer>> =
    LazyLock::new(|| Registry::new("optimizer"));

/// An optimizer's update rule.
pub type gradacc_optimizer_algorithm_t = i32;
/// `torch.optim.AdamW` (amsgrad off): beta1, beta2, eps, weight_decay.
pub const GRADACC_OPTIMIZER_ADAMW: gradacc_optimizer_algorithm_t = 0;
/// `torch.optim.SGD`: momentum, dampening, nesterov, weight_decay.
pub const GRADACC_OPTIMIZER_SGD: gradacc_optimizer_algorithm_t = 1;

/// How the FP32 master weights become the model's 16-bit weights.
pub type gradacc_rounding_t = i32;
/// Round to nearest, ties to even.
pub const GRADACC_ROUNDING_NEAREST_EVEN: gradacc_rounding_t = 0;
/// Stochastic rounding keyed by `seed`, the step and the element (the same on every rank).
pub const GRADACC_ROUNDING_STOCHASTIC: gradacc_rounding_t = 1;

/// How the FP32 master weights are kept between steps.
pub type gradacc_masters_t = i32;
/// FP32 masters: 4 bytes per parameter beside the model's weight.
pub const GRADACC_MASTERS_FP32: gradacc_masters_t = 0;
/// The master is the model's bf16 weight plus a 16-bit remainder the optimizer keeps: 2 bytes
/// per parameter, the FP32 master exactly. Only for bf16 weights rounded to nearest, without
/// adopted masters (else INVALID_ARGUMENT). The weight rounds ties away from zero instead of to
/// even (docs/optimizer.md, "Smaller state"); only the optimizer may write the weights.
pub const GRADACC_MASTERS_BF16_REMAINDER: gradacc_masters_t = 1;
/// No masters: each step reads the master from the model's weight, steps it in f32 and writes it
/// back with the weights' rounding: 0 bytes per parameter. 16-bit weights need
/// GRADACC_ROUNDING_STOCHASTIC (else INVALID_ARGUMENT: an update below half a 16-bit spacing
/// would be lost); over f32 weights it is FP32 masters bit for bit. Not with adopted masters;
/// only the optimizer may write the weights (docs/optimizer.md, "Smaller state").
pub const GRADACC_MASTERS_NONE: gradacc_masters_t = 2;

/// How AdamW's moments (SGD's momentum buffer) are kept between steps.
pub type gradacc_moments_t = i32;
/// FP32 moments: 4 bytes per moment.
pub const GRADACC_MOMENTS_FP32: gradacc_moments_t = 0;
/// bf16 moments, 2 bytes each, rounded stochastically keyed by `moment_seed`, the step and the
/// element (the same on every rank and shard count).
pub const GRADACC_MOMENTS_BF16: gradacc_moments_t = 1;
/// 8-bit blockwise moments: 1 byte each plus one f32 scale per block of 64 elements of a tensor,
/// coded as the nearest entry of a dynamic quantisation map times the block's largest magnitude.
/// CPU optimizers only (CUDA refuses them with GRADACC_STATUS_INVALID_ARGUMENT).
pub const GRADACC_MOMENTS_INT8_BLOCKWISE: gradacc_moments_t = 2;

/// What the step writes for a tensor's weights (docs/optimizer.md, "FP8 weights on the
/// all-gather").
pub type gradacc_weight_format_t = i32;
/// The model's dtype given at creation (f32, f16 or bf16). The default.
pub const GRADACC_WEIGHTS_MODEL: gradacc_weight_format_t = 0;
/// E4M3 codes (`float8_e4m3fn`) with one f32 scale per tensor: `scale = 448 / max(amax,
/// 1e-12)` from the amax of the tensor's new FP32 masters over all ranks, each code
/// E4M3(clamp(master * scale, ±448)) rounded to nearest even; the weight is `code / scale`. Only
/// under a sharded boundary (GRADACC_SHARDING_REDUCE_SCATTER, _ACCUMULATE), with FP32 masters,
/// on the CPU.
pub const GRADACC_WEIGHTS_E4M3_TENSORWISE: gradacc_weight_format_t = 1;
/// MXFP8: E4M3 codes of `master / 2^e` (saturated at ±448, nearest even) with one E8M0 byte
/// `e + 127` per block of 32 elements, `e = floor(log2(block amax)) - 8` clamped to -127..=127;
/// the weight is `code * 2^e`. As GRADACC_WEIGHTS_E4M3_TENSORWISE, where it may be used.
pub const GRADACC_WEIGHTS_MXFP8: gradacc_weight_format_t = 2;

/// Optimizer configuration. Initialise with gradacc_optimizer_config_default, then change fields.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_optimizer_config_t {
    /// sizeof(gradacc_optimizer_config_t); set by gradacc_optimizer_config_default.
    pub struct_size: usize,
    /// GRADACC_OPTIMIZER_* (default ADAMW).
    pub algorithm: gradacc_optimizer_algorithm_t,
    /// Learning rate of the first step (default 1e-3); gradacc_optimizer_set_lr changes it.
    pub lr: f32,
    /// AdamW's betas (default 0.9 and 0.999) and eps (default 1e-8).
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Weight decay: decoupled for AdamW, L2 for SGD (default 0.01, AdamW's; set 0 for none).
    pub weight_decay: f32,
    /// SGD's momentum (default 0: none), dampening (default 0) and Nesterov (default false).
    pub momentum: f32,
    pub dampening: f32,
    pub nesterov: bool,
    /// GRADACC_ROUNDING_* (default NEAREST_EVEN).
    pub rounding: gradacc_rounding_t,
    /// The seed of stochastic rounding (default 0).
    pub seed: u64,
    /// GRADACC_MASTERS_* (default FP32; a caller built before this field gets FP32).
    pub masters: gradacc_masters_t,
    /// GRADACC_MOMENTS_* (default FP32; a caller built before this field gets FP32).
    pub moments: gradacc_moments_t,
    /// The seed of the bf16 moments' stochastic rounding (default 0).
    pub moment_seed: u64,
    /// NULL (the default): every tensor's weights in its model dtype. Else `n` entries (the
    /// creation's tensor count), GRADACC_WEIGHTS_*, read during the creation only: tensor i's
    /// weights are what entry i says, and gradacc_optimizer_step_scaled takes their scales.
    pub weight_formats: *const gradacc_weight_format_t,
}

/// One tensor's options (PyTorch's parameter groups, per tensor).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_tensor_group_t {
    /// Whether weight decay applies to the tensor (biases and norms commonly take none).
    pub weight_decay: bool,
    /// The tensor's learning rate is the optimizer's times this (finite, >= 0).
    pub lr_scale: f32,
}

/// Fills `*out` with the default optimizer configuration (AdamW with PyTorch's defaults, lr
/// 1e-3) and its struct_size.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_optimizer_config_default(
    out: *mut gradacc_optimizer_config_t,
) -> gradacc_status_t {
    guard("gradacc_optimizer_config_default", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        let d = OptimizerConfig::default();
        let Algorithm::AdamW { beta1, beta2, eps, weight_decay } = d.algorithm else {
            unreachable!("the default is AdamW")
        };
        *out = gradacc_optimizer_config_t {
            struct_size: size_of::<gradacc_optimizer_config_t>(),
            algorithm: GRADACC_OPTIMIZER_ADAMW,
            lr: d.lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            momentum: 0.0,
            dampening: 0.0,
            nesterov: false,
            rounding: GRADACC_ROUNDING_NEAREST_EVEN,
            seed: 0,
            masters: GRADACC_MASTERS_FP32,
            moments: GRADACC_MOMENTS_FP32,
            moment_seed: 0,
            weight_formats: std::ptr::null(),
        };
        Ok(())
    })
}

fn weight_format_from_c(f: gradacc_weight_format_t, i: usize) -> CallResult<WeightFormat> {
    Ok(match f {
        GRADACC_WEIGHTS_MODEL => WeightFormat::Model,
        GRADACC_WEIGHTS_E4M3_TENSORWISE => WeightFormat::E4m3Tensorwise,
        GRADACC_WEIGHTS_MXFP8 => WeightFormat::Mxfp8,
        v => {
            return Err(Error::invalid(format!(
                "`config`.weight_formats[{i}] = {v} is not a GRADACC_WEIGHTS_* value"
            ))
            .into())
        }
    })
}

fn config_from_c(c: &gradacc_optimizer_config_t) -> CallResult<(OptimizerConfig, StateFormat)> {
    let algorithm = match c.algorithm {
        GRADACC_OPTIMIZER_ADAMW => Algorithm::AdamW {
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
        },
        GRADACC_OPTIMIZER_SGD => Algorithm::Sgd {
            momentum: c.momentum,
            dampening: c.dampening,
            nesterov: c.nesterov,
            weight_decay: c.weight_decay,
        },
        v => {
            return Err(Error::invalid(format!(
                "`config`.algorithm = {v} is not a GRADACC_OPTIMIZER_* value"
            ))
            .into())
        }
    };
    let rounding = match c.rounding {
        GRADACC_ROUNDING_NEAREST_EVEN => Rounding::NearestEven,
        GRADACC_ROUNDING_STOCHASTIC => Rounding::Stochastic { seed: c.seed },
        v => {
            return Err(Error::invalid(format!(
                "`config`.rounding = {v} is not a GRADACC_ROUNDING_* value"
            ))
            .into())
        }
    };
    let masters = match c.masters {
        GRADACC_MASTERS_FP32 => MasterFormat::F32,
        GRADACC_MASTERS_BF16_REMAINDER => MasterFormat::Bf16Remainder,
        GRADACC_MASTERS_NONE => MasterFormat::None,
        v => {
            return Err(Error::invalid(format!(
                "`config`.masters = {v} is not a GRADACC_MASTERS_* value"
            ))
            .into())
        }
    };
    let moments = match c.moments {
        GRADACC_MOMENTS_FP32 => MomentFormat::F32,
        GRADACC_MOMENTS_BF16 => MomentFormat::Bf16 { seed: c.moment_seed },
        GRADACC_MOMENTS_INT8_BLOCKWISE => MomentFormat::Int8Blockwise,
        v => {
            return Err(Error::invalid(format!(
                "`config`.moments = {v} is not a GRADACC_MOMENTS_* value"
            ))
            .into())
        }
    };
    Ok((OptimizerConfig { algorithm, lr: c.lr, rounding }, StateFormat { masters, moments }))
}

/// Borrows the tensors' buffers at `ptrs` as the model's weights of `dtypes` and the tensors'
/// lengths `numel`, each checked for null, alignment and length.
///
/// # Safety
/// Each non-null `ptrs[i]` points to `numel[i]` values of `dtypes[i]`, readable and writable and
/// used by nothing else during `'a`.
unsafe fn weight_buffers<'a>(
    ptrs: &[*const c_void],
    dtypes: &[Dtype],
    numel: &[usize],
) -> CallResult<Vec<GradMut<'a>>> {
    let each = ptrs.iter().zip(dtypes).zip(numel).enumerate();
    // SAFETY: as this function's contract, tensor by tensor.
    each.map(|(i, ((&p, &dtype), &n))| unsafe { weight_buffer(i, p, dtype, n) }).collect()
}

/// Tensor `i`'s buffer at `p` as its model weights of `dtype`, `n` of them, checked for null,
/// alignment and length.
///
/// # Safety
/// A non-null `p` points to `n` values of `dtype`, readable and writable and used by nothing
/// else during `'a`.
unsafe fn weight_buffer<'a>(
    i: usize,
    p: *const c_void,
    dtype: Dtype,
    n: usize,
) -> CallResult<GradMut<'a>> {
    let what = format!("weights[{i}]");
    Ok(match dtype {
        // SAFETY: the values are the caller's to lend mutably for the call (this function's
        // contract); `lend` checks null, alignment and length.
        Dtype::F32 => GradMut::F32(unsafe { lend(p as *mut f32, n, &what)? }),
        Dtype::F16 => GradMut::f16_bits(unsafe { lend(p as *mut u16, n, &what)? }),
        Dtype::Bf16 => GradMut::bf16_bits(unsafe { lend(p as *mut u16, n, &what)? }),
    })
}

/// The `n` values at `p`, checked for null, alignment and length, lent mutably.
///
/// # Safety
/// A non-null `p` points to `n` values of `T`, readable and writable and used by nothing else
/// during `'a`.
unsafe fn lend<'a, T>(p: *mut T, n: usize, what: &str) -> CallResult<&'a mut [T]> {
    // SAFETY: read_slice checks null, alignment and length; the caller lends the values
    // mutably (this function's contract).
    let s = unsafe { read_slice(p as *const T, n, what, "numel")? };
    // SAFETY: the same values, which the caller lends mutably.
    Ok(unsafe { std::slice::from_raw_parts_mut(s.as_ptr() as *mut T, n) })
}

/// The step's buffers: tensor i's model weights at `ptrs[i]`, or for an FP8 tensor
/// (`formats[i]`) its codes there and its scales at `scales[i]` (NULL `scales`: no FP8 tensor).
///
/// # Safety
/// As [`weight_buffer`] for each model tensor; for an FP8 tensor, `ptrs[i]` holds `numel[i]`
/// bytes and a non-null `scales[i]` its scales (one f32 for E4M3, one byte per block of 32
/// elements for MXFP8), all lent mutably for `'a`.
unsafe fn step_buffers<'a>(
    ptrs: &[*const c_void],
    scales: Option<&[*const c_void]>,
    formats: &[WeightFormat],
    dtypes: &[Dtype],
    numel: &[usize],
) -> CallResult<Vec<WeightMut<'a>>> {
    let mut out = Vec::with_capacity(ptrs.len());
    // Zipped, not indexed: `numel` is the accumulator's, which may not be the optimizer's (the
    // step refuses it); the buffers stop at the shorter.
    let each = ptrs.iter().zip(formats).zip(dtypes).zip(numel).enumerate();
    for (i, (((&p, &format), &dtype), &n)) in each {
        let scale = scales.map(|s| s[i]);
        let what = |name: &str| format!("{name}[{i}]");
        // SAFETY: the buffers are the caller's to lend for the call (this function's contract),
        // each checked for null, alignment and length.
        out.push(unsafe {
            match (format, scale) {
                (WeightFormat::Model, Some(s)) if !s.is_null() => {
                    return Err(Error::invalid(format!(
                        "`scales[{i}]` = {s:p}: tensor {i}'s weights are in its model dtype, which takes no scale (pass NULL)"
                    ))
                    .into())
                }
                (WeightFormat::Model, _) => WeightMut::Model(weight_buffer(i, p, dtype, n)?),
                (fp8, None) => {
                    return Err(Error::invalid(format!(
                        "`scales` is NULL, but tensor {i}'s weights are FP8 codes ({}, `config`.weight_formats[{i}]): step with gradacc_optimizer_step_scaled and their scales",
                        fp8.name()
                    ))
                    .into())
                }
                (WeightFormat::E4m3Tensorwise, Some(s)) => WeightMut::E4m3 {
                    codes: lend(p as *mut u8, n, &what("weights"))?,
                    scale: lend(s as *mut f32, 1, &what("scales"))?,
                },
                (WeightFormat::Mxfp8, Some(s)) => WeightMut::Mxfp8 {
                    codes: lend(p as *mut u8, n, &what("weights"))?,
                    scales: lend(s as *mut u8, format.scales(n), &what("scales"))?,
                },
            }
        });
    }
    Ok(out)
}

/// Creates an optimizer over `acc`'s tensors, device and sharding: its FP32 master weights (for
/// this rank's shard under GRADACC_SHARDING_REDUCE_SCATTER or _ACCUMULATE) initialised from the
/// model's weights `weights[i]` (pointers to each whole tensor, of `weight_dtypes[i]`, or of
/// the tensors' gradient dtypes when `weight_dtypes` is NULL), each tensor in `groups[i]` (NULL:
/// weight decay on, lr_scale 1). `config` NULL means the defaults
/// (gradacc_optimizer_config_default). `n` is the accumulator's tensor count. The semantics are the
/// Rust API's `Optimizer` (its documentation is the contract: one step per synced window, a
/// skipped window changes nothing, the all-gather under sharding); docs/optimizer.md.
///
/// On a CPU accumulator the weights are host pointers. On a CUDA accumulator they are device
/// addresses on its device, and the masters, the state and the step count are allocated in
/// device memory on its stream; creation reads the weights (it waits for the stream).
///
/// Fails, creating nothing, on a configuration out of range (the message names the field), a
/// wrong count, a NULL or misaligned weight, or, on a CUDA accumulator, a weight that is not one
/// device allocation of its tensor's length (GRADACC_STATUS_DEVICE_MISMATCH).
///
/// Thread safety: any thread. Destroy with gradacc_optimizer_destroy.
#[no_mangle]
pub unsafe extern "C" fn gradacc_optimizer_create(
    acc: *const gradacc_accumulator_t,
    config: *const gradacc_optimizer_config_t,
    groups: *const gradacc_tensor_group_t,
    weights: *const *const c_void,
    weight_dtypes: *const gradacc_dtype_t,
    n: usize,
    out: *mut *mut gradacc_optimizer_t,
) -> gradacc_status_t {
    guard("gradacc_optimizer_create", || {
        // SAFETY: the caller's arguments, as documented above (API contract).
        unsafe { create(acc, config, groups, weights, weight_dtypes, n, None, out) }
    })
}

/// Like gradacc_optimizer_create, but adopts the caller's FP32 master weights `masters`, of
/// exactly `masters_numel` elements, instead of allocating them: e.g. a framework's own FP32
/// master weights (Apex O2, Megatron's contiguous FP32 buffer). They are laid out as the
/// accumulator's flat layout over the range this rank holds (gradacc_accumulator_shard: the whole
/// layout unsharded, gradacc_accumulator_master_numel elements): element k is flat element
/// `shard.start + k`, so tensor i's masters start at element gradacc_accumulator_offset(i) -
/// `shard.start`. Host memory on a CPU accumulator, one device allocation on the accumulator's
/// device on a CUDA one.
///
/// The values in `masters` ARE the master weights: creation does not overwrite them from
/// `weights` (which still give the model's dtypes and lengths, and which every step writes);
/// each gradacc_optimizer_step updates them in place (stream-ordered on CUDA), and
/// gradacc_optimizer_load writes into them (a refused load leaves them bit for bit). The
/// padding between tensors is never read; a load writes zeros there. Creation does not read the
/// weights, and on CUDA does not wait for the stream.
///
/// Fails, creating nothing, as gradacc_optimizer_create does, and with
/// GRADACC_STATUS_NULL_ARGUMENT for a NULL `masters`, GRADACC_STATUS_INVALID_ARGUMENT for a
/// misaligned one (not 4-byte aligned), GRADACC_STATUS_SIZE_MISMATCH for a `masters_numel`
/// other than the shard's length, GRADACC_STATUS_INVALID_ARGUMENT for `masters` that overlap a
/// weight (a step writes both; gradacc_optimizer_step refuses such weights too), or, on a CUDA
/// accumulator, GRADACC_STATUS_DEVICE_MISMATCH for `masters` that are not one device allocation
/// of `masters_numel` floats on its device.
///
/// Ownership: `*out` is the caller's; free it with gradacc_optimizer_destroy. `masters` stays the
/// caller's and must outlive the optimizer; gradacc never frees it. The caller must not write
/// `masters` while a call on the optimizer runs, nor (on CUDA) while a step enqueued on the
/// stream has not finished.
/// Thread safety: as gradacc_optimizer_create.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gradacc_optimizer_create_with_masters(
    acc: *const gradacc_accumulator_t,
    config: *const gradacc_optimizer_config_t,
    groups: *const gradacc_tensor_group_t,
    weights: *const *const c_void,
    weight_dtypes: *const gradacc_dtype_t,
    n: usize,
    masters: *mut f32,
    masters_numel: usize,
    out: *mut *mut gradacc_optimizer_t,
) -> gradacc_status_t {
    guard("gradacc_optimizer_create_with_masters", || {
        if masters.is_null() {
            return Err(null("masters"));
        }
        let adopt = Some((masters, masters_numel));
        // SAFETY: the caller's arguments, as documented above (API contract).
        unsafe { create(acc, config, groups, weights, weight_dtypes, n, adopt, out) }
    })
}

/// The body of gradacc_optimizer_create and gradacc_optimizer_create_with_masters: reads and
/// checks the arguments, makes the optimizer (adopting `adopt`'s masters, if any), writes `*out`.
///
/// # Safety
/// The arguments are the entry points' (their API contract); `adopt`'s buffer, if any, holds its
/// length of f32 values in the accumulator's memory for the optimizer's lifetime.
#[allow(clippy::too_many_arguments)]
unsafe fn create(
    acc: *const gradacc_accumulator_t,
    config: *const gradacc_optimizer_config_t,
    groups: *const gradacc_tensor_group_t,
    weights: *const *const c_void,
    weight_dtypes: *const gradacc_dtype_t,
    n: usize,
    adopt: Option<(*mut f32, usize)>,
    out: *mut *mut gradacc_optimizer_t,
) -> CallResult<()> {
    // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
    let out = unsafe { out_ptr(out, "out") }?;
    let a = ACCUMULATORS.get(acc, "acc")?;
    let raw = if config.is_null() {
        None
    } else {
        // SAFETY: a non-null `config` points to a config of its struct_size (API contract).
        Some(unsafe { read_config(config, "config") }?)
    };
    let (config, format) = match &raw {
        None => (OptimizerConfig::default(), StateFormat::default()),
        Some(c) => config_from_c(c)?,
    };
    let tensors = a.tensors();
    if n != tensors.len() {
        return Err(Error::new(
            ErrorKind::SizeMismatch,
            format!("`n` = {n}, but the accumulator has {} tensors", tensors.len()),
        )
        .into());
    }
    let weight_formats = match raw.map(|c| c.weight_formats).filter(|p| !p.is_null()) {
        None => vec![],
        // SAFETY: a non-null `weight_formats` holds `n` entries (API contract).
        Some(p) => unsafe { read_slice(p, n, "config.weight_formats", "n")? }
            .iter()
            .enumerate()
            .map(|(i, &f)| weight_format_from_c(f, i))
            .collect::<CallResult<_>>()?,
    };
    let groups: Vec<TensorGroup> = if groups.is_null() {
        vec![]
    } else {
        // SAFETY: a non-null `groups` holds `n` entries (API contract).
        unsafe { read_slice(groups, n, "groups", "n")? }
            .iter()
            .map(|g| TensorGroup { weight_decay: g.weight_decay, lr_scale: g.lr_scale })
            .collect()
    };
    let dtypes: Vec<Dtype> = if weight_dtypes.is_null() {
        tensors.iter().map(|t| t.dtype).collect()
    } else {
        // SAFETY: a non-null `weight_dtypes` holds `n` entries (API contract).
        let codes = unsafe { read_slice(weight_dtypes, n, "weight_dtypes", "n")? };
        codes
            .iter()
            .enumerate()
            .map(|(i, &c)| dtype_from_c(c, &format!("weight_dtypes[{i}]")))
            .collect::<CallResult<_>>()?
    };
    // SAFETY: the caller passes `n` addresses at `weights` (API contract).
    let ptrs = unsafe { read_slice(weights, n, "weights", "n")? };
    let builder = Optimizer::builder(&a)
        .config(config)
        .state(format)
        .groups(&groups)
        .weight_formats(&weight_formats);
    let opt = if matches!(a.device(), Device::Cuda { .. }) {
        // Device addresses: checked by the driver, never dereferenced on the host.
        let addresses: Vec<u64> = ptrs.iter().map(|&p| p as u64).collect();
        let builder = builder.device_weights(&addresses, &dtypes);
        match adopt {
            // SAFETY: the caller lends the device buffer for the optimizer's lifetime (API
            // contract); its allocation is checked with the driver before it is used.
            Some((m, len)) => unsafe { builder.device_masters(m as u64, len) }.build()?,
            None => builder.build()?,
        }
    } else {
        let numel: Vec<usize> = tensors.iter().map(|t| t.numel).collect();
        // SAFETY: each weight holds its tensor's numel values of its dtype (API contract);
        // they are only read here.
        let buffers = unsafe { weight_buffers(ptrs, &dtypes, &numel)? };
        let grads: Vec<Grad<'_>> = buffers.iter().map(GradMut::as_grad).collect();
        match adopt {
            // SAFETY: the caller lends `len` host f32 values for the optimizer's lifetime and
            // writes none while one of its calls runs (API contract).
            Some((m, len)) => unsafe { builder.weights(&grads).masters(m, len) }.build()?,
            None => builder.weights(&grads).build()?,
        }
    };
    *out = OPTIMIZERS.insert(Arc::new(opt));
    Ok(())
}

/// Destroys an optimizer. NULL is accepted and does nothing; a second call on one handle is
/// reported as GRADACC_STATUS_INVALID_HANDLE.
///
/// Thread safety: any thread, once no other call uses the optimizer.
#[no_mangle]
pub unsafe extern "C" fn gradacc_optimizer_destroy(
    opt: *mut gradacc_optimizer_t,
) -> gradacc_status_t {
    guard("gradacc_optimizer_destroy", || {
        if !opt.is_null() {
            OPTIMIZERS.remove(opt, "opt")?;
        }
        Ok(())
    })
}

/// Sets the learning rate of the steps from the next one on (finite, >= 0). On a CUDA
/// accumulator the value is copied to the device on the accumulator's stream: steps enqueued
/// before this call keep theirs.
///
/// Thread safety: any thread; serialised with the optimizer's other calls.
#[no_mangle]
pub unsafe extern "C" fn gradacc_optimizer_set_lr(
    opt: *mut gradacc_optimizer_t,
    lr: f32,
) -> gradacc_status_t {
    guard("gradacc_optimizer_set_lr", || Ok(OPTIMIZERS.get(opt, "opt")?.set_lr(lr)?))
}

/// On a CUDA accumulator, writes to `*out` the device address of the learning rate (one
/// `float`) that every step reads when it runs on the stream. A schedule on the device (a
/// kernel, or a memcpy node of a captured CUDA graph) writes it there, so a captured step replays
/// with the schedule and without the host. The value is used as written, unchecked.
/// GRADACC_STATUS_DEVICE_MISMATCH on a CPU accumulator (use gradacc_optimizer_set_lr).
///
/// Thread safety: any thread. The address stays valid until the optimizer is destroyed.
#[no_mangle]
pub unsafe extern "C" fn gradacc_optimizer_lr_device_ptr(
    opt: *const gradacc_optimizer_t,
    out: *mut *mut c_void,
) -> gradacc_status_t {
    guard("gradacc_optimizer_lr_device_ptr", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        *out = OPTIMIZERS.get(opt, "opt")?.lr_device_ptr()? as usize as *mut c_void;
        Ok(())
    })
}

/// Writes the number of steps taken (a skipped step is not one) to `*out`. On a CUDA accumulator
/// the count is in device memory: this waits for the stream when a step since the last call
/// followed a gradacc_accumulator_sync whose `out_info` was NULL.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_optimizer_steps(
    opt: *const gradacc_optimizer_t,
    out: *mut u64,
) -> gradacc_status_t {
    guard("gradacc_optimizer_steps", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out, "out") }?;
        *out = OPTIMIZERS.get(opt, "opt")?.steps();
        Ok(())
    })
}

/// The step after gradacc_accumulator_sync of `acc` (the accumulator the optimizer was made
/// over): steps the FP32 masters and the state from the reduced gradient and writes the model's
/// weights `weights[i]` (pointers to each whole tensor, in the dtypes given at creation), or,
/// when the boundary found a non-finite value, changes nothing; `*out_stepped` (may be NULL) says
/// which. Under a sharded boundary every rank calls it, and the ranks agree first (a call invalid
/// on one rank fails on all: its own error there, GRADACC_STATUS_PEER_FAILURE elsewhere; ranks
/// whose optimizers differ, the learning rate and step count included, all fail with
/// GRADACC_STATUS_SIZE_MISMATCH) and then all-gather the weights over `comm`: the communicator
/// sync took (NULL for a sharded accumulation's own). WRONG_STATE before a sync or a
/// second time after one. A call whose `weights` are refused here still takes part in the
/// agreement, so the other ranks fail at once.
///
/// On a CUDA accumulator the weights are device addresses, and the step is enqueued on the
/// accumulator's stream and returns without waiting (a sharded step's agreement waits for the
/// stream, except while the stream is captured into a CUDA graph: there the first sharded step
/// over a communicator fails with WRONG_STATE, and after it a call invalid on this rank aborts the
/// communicator, so the other ranks' all-gather fails; docs/optimizer.md). Whether the boundary
/// overflowed is read by the kernels on the device, so the step
/// may also follow a gradacc_accumulator_sync whose `out_info` was NULL (a sync that does not
/// wait); `out_stepped` must then be NULL (the host does not know; WRONG_STATE otherwise, before
/// anything runs). A weight that is not one device
/// allocation of its tensor's length fails with GRADACC_STATUS_DEVICE_MISMATCH.
///
/// Thread safety: serialised with the optimizer's other calls and with every call on `acc`; the
/// weights are read and written during the call only (on CUDA: by the work it enqueues).
#[no_mangle]
pub unsafe extern "C" fn gradacc_optimizer_step(
    opt: *mut gradacc_optimizer_t,
    acc: *mut gradacc_accumulator_t,
    weights: *const *mut c_void,
    n: usize,
    comm: *mut gradacc_comm_t,
    out_stepped: *mut bool,
) -> gradacc_status_t {
    guard("gradacc_optimizer_step", || {
        // SAFETY: the caller's arguments, as documented above (API contract).
        unsafe { step(opt, acc, weights, None, n, comm, out_stepped) }
    })
}

/// gradacc_optimizer_step of an optimizer whose `config.weight_formats` makes some tensors FP8:
/// for such a tensor i, `weights[i]` holds its `numel` E4M3 codes (bytes) and `scales[i]` its
/// scales, which the step writes with the codes: one float for GRADACC_WEIGHTS_E4M3_TENSORWISE,
/// one E8M0 byte per block of 32 elements (the last block shorter) for GRADACC_WEIGHTS_MXFP8.
/// `scales[i]` is NULL for a tensor in its model dtype; `scales` may be NULL when no tensor is
/// FP8 (gradacc_optimizer_step is this with a NULL `scales`). After the step, every rank holds
/// every tensor's codes and scales, bitwise those of quantising the whole tensor's FP32 masters
/// once. When a new master of an FP8 tensor is infinite or NaN on any rank, no broken scale is
/// applied: every rank fails with GRADACC_STATUS_INVALID_ARGUMENT naming the tensor, and the
/// weights, the state and the step count stay as they were (docs/optimizer.md, "FP8 weights on
/// the all-gather"). A scale buffer of the wrong kind is refused as a weight is: NULL
/// (GRADACC_STATUS_NULL_ARGUMENT), misaligned, or given for a model-dtype tensor
/// (GRADACC_STATUS_INVALID_ARGUMENT).
///
/// Thread safety: as gradacc_optimizer_step.
#[no_mangle]
pub unsafe extern "C" fn gradacc_optimizer_step_scaled(
    opt: *mut gradacc_optimizer_t,
    acc: *mut gradacc_accumulator_t,
    weights: *const *mut c_void,
    scales: *const *mut c_void,
    n: usize,
    comm: *mut gradacc_comm_t,
    out_stepped: *mut bool,
) -> gradacc_status_t {
    guard("gradacc_optimizer_step_scaled", || {
        let scales = (!scales.is_null()).then_some(scales);
        // SAFETY: the caller's arguments, as documented above (API contract).
        unsafe { step(opt, acc, weights, scales, n, comm, out_stepped) }
    })
}

/// gradacc_optimizer_step and _step_scaled (`scales`, when given, holds `n` entries).
///
/// # Safety
/// The entry points' arguments (their API contract).
unsafe fn step(
    opt: *mut gradacc_optimizer_t,
    acc: *mut gradacc_accumulator_t,
    weights: *const *mut c_void,
    scales: Option<*const *mut c_void>,
    n: usize,
    comm: *mut gradacc_comm_t,
    out_stepped: *mut bool,
) -> CallResult<()> {
    let o = OPTIMIZERS.get(opt, "opt")?;
    let a = ACCUMULATORS.get(acc, "acc")?;
    let comm = (!comm.is_null()).then(|| COMMS.get(comm, "comm")).transpose()?;
    if matches!(a.device(), Device::Cuda { .. }) {
        // FP8 weights are refused at a CUDA optimizer's creation, so no tensor takes a scale.
        // SAFETY: the caller passes `n` device addresses at `weights` (API contract).
        let stepped = unsafe { step_on_device(&o, &a, weights, n, comm.as_deref(), out_stepped) }?;
        if let Some(stepped) = stepped {
            // SAFETY: `step_on_device` returns a value only for a non-null `out_stepped`,
            // which points to writable storage of its type (API contract).
            unsafe { *out_stepped = stepped };
        }
        return Ok(());
    }
    let args = || {
        let dtypes = o.weight_dtypes();
        if n != dtypes.len() {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("`n` = {n}, but the optimizer has {} tensors", dtypes.len()),
            )
            .into());
        }
        // SAFETY: the caller passes `n` addresses at `weights`, and at a non-null `scales`
        // (API contract).
        let ptrs = unsafe { read_slice(weights as *const *const c_void, n, "weights", "n")? };
        let scales = match scales {
            // SAFETY: as above.
            Some(s) => Some(unsafe { read_slice(s as *const *const c_void, n, "scales", "n")? }),
            None => None,
        };
        let numel: Vec<usize> = a.tensors().iter().map(|t| t.numel).collect();
        // SAFETY: each weight (and scale) holds what its tensor's format says, writable and
        // used by nothing else during the call (API contract).
        unsafe { step_buffers(ptrs, scales, o.weight_formats(), dtypes, &numel) }
    };
    let mut buffers = match args() {
        Ok(m) => m,
        Err(e) => {
            // The other ranks of a sharded boundary are in the step's agreement.
            o.refuse_step(&a, comm.as_deref());
            return Err(e);
        }
    };
    let stepped = o.step_weights(&a, &mut buffers, comm.as_deref())?;
    if !out_stepped.is_null() {
        // SAFETY: a non-null output pointer points to writable storage of its type.
        unsafe { *out_stepped = stepped };
    }
    Ok(())
}

/// The step of a CUDA accumulator's optimizer: the device addresses at `weights`, checked by the
/// Rust API; what to write to a non-null `out_stepped`, which needs the boundary's result on the
/// host (a refusal here still takes part in a sharded step's agreement).
///
/// # Safety
/// A non-null `weights` points to `n` addresses.
unsafe fn step_on_device(
    o: &Optimizer,
    a: &gradacc::Accumulator,
    weights: *const *mut c_void,
    n: usize,
    comm: Option<&dyn gradacc::Communicator>,
    out_stepped: *mut bool,
) -> CallResult<Option<bool>> {
    let args = || -> CallResult<Vec<u64>> {
        if n != o.weight_dtypes().len() {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!("`n` = {n}, but the optimizer has {} tensors", o.weight_dtypes().len()),
            )
            .into());
        }
        if !out_stepped.is_null() && a.synced_info().is_none() {
            return Err(Error::wrong_state(
                "`out_stepped` is not NULL, but the boundary's result is not on the host: after gradacc_accumulator_sync with a NULL `out_info` (or before any sync) the step is decided on the device; pass NULL",
            )
            .into());
        }
        // SAFETY: the caller passes `n` addresses at `weights` (this function's contract).
        let ptrs = unsafe { read_slice(weights as *const *const c_void, n, "weights", "n")? };
        Ok(ptrs.iter().map(|&p| p as u64).collect())
    };
    let addresses = match args() {
        Ok(a) => a,
        Err(e) => {
            o.refuse_step(a, comm);
            return Err(e);
        }
    };
    let stepped = o.step_device(a, &addresses, comm)?;
    Ok(if out_stepped.is_null() { None } else { stepped })
}

/// Writes this rank's optimizer state (versioned, checksummed) into `buf` (NULL: only reports
/// the size) and its length to `*out_len`. The format is the same on every device: on a CUDA
/// accumulator the state is copied to the host (this waits for the stream).
///
/// Thread safety: any thread; serialised with the optimizer's other calls.
#[no_mangle]
pub unsafe extern "C" fn gradacc_optimizer_save(
    opt: *const gradacc_optimizer_t,
    buf: *mut u8,
    capacity: usize,
    out_len: *mut usize,
) -> gradacc_status_t {
    // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
    guard("gradacc_optimizer_save", || unsafe {
        write_bytes(&OPTIMIZERS.get(opt, "opt")?.save()?, buf, capacity, out_len)
    })
}

/// Restores the state from `n` saved parts (`parts[k]`, `lens[k]` bytes each): what
/// gradacc_optimizer_save wrote on any number of ranks, together covering this rank's elements,
/// so a state saved over one shard count loads over another. Corrupt, foreign or insufficient
/// parts fail with GRADACC_STATUS_CORRUPT_STATE, and two parts that hold the same element (the
/// same part given twice, or parts of two saves) with GRADACC_STATUS_INVALID_ARGUMENT, naming
/// them; either way the optimizer is unchanged.
///
/// Thread safety: any thread; serialised with the optimizer's other calls.
#[no_mangle]
pub unsafe extern "C" fn gradacc_optimizer_load(
    opt: *mut gradacc_optimizer_t,
    parts: *const *const u8,
    lens: *const usize,
    n: usize,
) -> gradacc_status_t {
    guard("gradacc_optimizer_load", || {
        let o = OPTIMIZERS.get(opt, "opt")?;
        // SAFETY: the caller passes `n` pointers at `parts` and `n` lengths at `lens`.
        let (ptrs, lens) =
            unsafe { (read_slice(parts, n, "parts", "n")?, read_slice(lens, n, "lens", "n")?) };
        let parts = ptrs
            .iter()
            .zip(lens)
            .enumerate()
            // SAFETY: each non-null part points to its length's readable bytes (API contract).
            .map(|(k, (&p, &len))| unsafe { read_bytes(p, len, &format!("parts[{k}]")) })
            .collect::<CallResult<Vec<&[u8]>>>()?;
        Ok(o.load(&parts)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_config_is_the_rust_default() {
        let mut c = std::mem::MaybeUninit::uninit();
        // SAFETY: a writable config.
        let status = unsafe { gradacc_optimizer_config_default(c.as_mut_ptr()) };
        assert_eq!(status, crate::status::GRADACC_STATUS_OK);
        // SAFETY: filled on success.
        let c = unsafe { c.assume_init() };
        assert_eq!(
            config_from_c(&c).ok(),
            Some((OptimizerConfig::default(), StateFormat::default()))
        );
    }
}
