"""ctypes declarations of the gradacc C API.

Generated from include/gradacc.h by bindings/python/gen_ffi.py. Do not edit by hand:
change capi/src/, run scripts/gen-header, then bindings/python/gen_ffi.py.
"""
# fmt: off
import ctypes

from ._lib import dll

GRADACC_VERSION_MAJOR = 0  # Major version of this header (from Cargo.toml).
GRADACC_VERSION_MINOR = 2  # Minor version of this header (from Cargo.toml).
GRADACC_VERSION_PATCH = 0  # Patch version of this header (from Cargo.toml).
GRADACC_VERSION_STRING = "0.2.0"  # Full version of this header, as a string (from Cargo.toml).
GRADACC_VERSION_NUMBER = 200  # Version of this header as one number, MAJOR * 10000 + MINOR * 100 + PATCH (as NCCL_VERSION_CODE), for `#if GRADACC_VERSION_NUMBER >= GRADACC_VERSION(0, 2, 0)`; equal to gradacc_version_number() of the library it came with.
GRADACC_MASTER_ALIGN = 256  # Bytes to which every tensor's FP32 master is aligned in the flat master: tensor `i` starts at an element offset that is a multiple of GRADACC_MASTER_ALIGN / 4 (gradacc_accumulator_offset), with zeros between tensors.
GRADACC_MPI_COMM_WORLD = -1  # The `fortran_comm` value of gradacc_comm_create_mpi that means MPI_COMM_WORLD.
GRADACC_STATUS_OK = 0  # Success.
GRADACC_STATUS_NULL_ARGUMENT = 1  # A required pointer argument was NULL.
GRADACC_STATUS_INVALID_ARGUMENT = 2  # An argument's value is outside its domain (a count, an index, an enum value, a config field).
GRADACC_STATUS_INVALID_HANDLE = 3  # A handle that was destroyed, never created, or is of another object type.
GRADACC_STATUS_DTYPE_MISMATCH = 4  # A gradient's dtype differs from its tensor's declared dtype.
GRADACC_STATUS_SIZE_MISMATCH = 5  # A buffer's length, or an accumulator's layout across ranks, differs from what is expected.
GRADACC_STATUS_DEVICE_MISMATCH = 6  # Objects bound to different devices or backends were combined.
GRADACC_STATUS_WRONG_STATE = 7  # The call is not allowed in the object's current state (e.g. sync inside a micro-batch).
GRADACC_STATUS_EMPTY_WINDOW = 8  # The accumulation window holds no micro-batch (on any rank), or its global item count is 0.
GRADACC_STATUS_SCALE_AT_MINIMUM = 9  # An overflow needed a backoff while the loss scale was already at min_scale.
GRADACC_STATUS_BACKEND_UNAVAILABLE = 10  # The requested backend (CUDA, NCCL, MPI) is not in this build or not on this machine.
GRADACC_STATUS_COMM_FAILURE = 11  # The communicator failed.
GRADACC_STATUS_PEER_FAILURE = 12  # Another rank's call failed, so this rank stopped the collective too (nothing was reduced).
GRADACC_STATUS_CORRUPT_STATE = 13  # Saved state bytes are corrupt, truncated, foreign, or of an unsupported version.
GRADACC_STATUS_OUT_OF_MEMORY = 14  # An allocation failed.
GRADACC_STATUS_INTERNAL = 15  # An internal error (a bug in gradacc); the message says where.
GRADACC_STATUS_DEVICE_FAILURE = 16  # The CUDA driver reported an error (a failed launch or copy, an invalid device address, a device that fell off the bus); the message carries the driver's own text.
GRADACC_STATUS_TIMEOUT = 17  # A collective did not complete within the communicator's timeout (gradacc_comm_set_timeout); the communicator was aborted, and the message names the phase and how long it waited.
GRADACC_LOSS_REDUCTION_MEAN = 0  # The loss is the mean over the micro-batch's items (default).
GRADACC_LOSS_REDUCTION_SUM = 1  # The loss is the sum over the micro-batch's items.
GRADACC_NORMALIZE_BY_COUNT = 0  # The global item count over micro-batches and ranks (default): the gradient of the mean loss over every item of the effective batch.
GRADACC_NORMALIZE_BY_MICROBATCHES = 1  # The global number of micro-batches (`loss / steps` with a DDP mean): a mean of means.
GRADACC_NORMALIZE_BY_WORLD = 2  # The number of ranks: sum over micro-batches, mean over ranks (DDP with no_sync).
GRADACC_NORMALIZE_NONE = 3  # No division: the plain sum.
GRADACC_SHARDING_NONE = 0  # Every rank holds the whole reduced gradient: an all-reduce, as DDP (default).
GRADACC_SHARDING_REDUCE_SCATTER = 1  # Rank `shard_rank` of `shard_count` holds only its shard of the reduced gradient, a contiguous range of the flat layout (gradacc_accumulator_shard): a reduce-scatter, half an all-reduce's traffic, as a distributed optimizer (ZeRO-1) needs.
GRADACC_SHARDING_ACCUMULATE = 2  # Sharded accumulation (ZeRO-2): rank `shard_rank` of `shard_count` holds only its shard of the FP32 gradient, and every micro-batch is reduce-scattered as it is added.
GRADACC_OVERFLOW_SKIP_STEP = 0  # The window's step is skipped on every rank, as PyTorch's GradScaler does (default).
GRADACC_OVERFLOW_DROP_MICROBATCH = 1  # Only the micro-batch that held it is dropped, on the rank that fed it; the boundary normalises by what every rank kept, and the step is skipped only when nothing was kept or the sum overflows.
GRADACC_OVERFLOW_AT_NONE = 0  # Nowhere: the window stayed finite, or found_inf is set and the first place is unknown (a rank's window went non-finite where nothing recorded it, which may come before any other place, so no rank names one).
GRADACC_OVERFLOW_AT_GRADIENT = 1  # A gradient: `overflow_rank`, `overflow_microbatch` and `overflow_tensor` say where.
GRADACC_OVERFLOW_AT_REDUCTION = 2  # Every rank's window was finite; their sum overflowed.
GRADACC_BACKEND_LOCAL = 0  # The in-process communicator (gradacc_comm_create_local); in every build.
GRADACC_BACKEND_MPI = 1  # The MPI communicator (gradacc_comm_create_mpi); in builds with the `mpi` feature (CMake option GRADACC_WITH_MPI).
GRADACC_BACKEND_NCCL = 2  # The NCCL communicator (gradacc_comm_create_nccl): in every build; available where the CUDA driver and NCCL (GRADACC_NCCL_LIBRARY, else libnccl.so.2 or libnccl.so) load.
GRADACC_BACKEND_CUDA = 3  # CUDA devices (GRADACC_DEVICE_CUDA): in every build; available where the CUDA driver sees a device and NVRTC (GRADACC_NVRTC_LIBRARY, else libnvrtc.so.13, .so.12 or .so) loads.
GRADACC_LOG_OFF = 0  # No messages.
GRADACC_LOG_ERROR = 1  # A call failed in a way its status alone does not tell.
GRADACC_LOG_WARN = 2  # A setting was not honoured (an unknown or unsupported GRADACC_CPU_ISA).
GRADACC_LOG_INFO = 3  # What a training run wants to know: a skipped step and the loss scale it backed off to, a dropped micro-batch, a CUDA library loaded (and from where) or not.
GRADACC_LOG_DEBUG = 4  # The rest: a grown loss scale, each library candidate that did not load, the SIMD path chosen.
GRADACC_OPTIMIZER_ADAMW = 0  # `torch.optim.AdamW` (amsgrad off): beta1, beta2, eps, weight_decay.
GRADACC_OPTIMIZER_SGD = 1  # `torch.optim.SGD`: momentum, dampening, nesterov, weight_decay.
GRADACC_ROUNDING_NEAREST_EVEN = 0  # Round to nearest, ties to even.
GRADACC_ROUNDING_STOCHASTIC = 1  # Stochastic rounding keyed by `seed`, the step and the element (the same on every rank).
GRADACC_MASTERS_FP32 = 0  # FP32 masters: 4 bytes per parameter beside the model's weight.
GRADACC_MASTERS_BF16_REMAINDER = 1  # The master is the model's bf16 weight plus a 16-bit remainder the optimizer keeps: 2 bytes per parameter, the FP32 master exactly.
GRADACC_MASTERS_NONE = 2  # No masters: each step reads the master from the model's weight, steps it in f32 and writes it back with the weights' rounding: 0 bytes per parameter. 16-bit weights need GRADACC_ROUNDING_STOCHASTIC (else INVALID_ARGUMENT: an update below half a 16-bit spacing would be lost); over f32 weights it is FP32 masters bit for bit.
GRADACC_MOMENTS_FP32 = 0  # FP32 moments: 4 bytes per moment.
GRADACC_MOMENTS_BF16 = 1  # bf16 moments, 2 bytes each, rounded stochastically keyed by `moment_seed`, the step and the element (the same on every rank and shard count).
GRADACC_MOMENTS_INT8_BLOCKWISE = 2  # 8-bit blockwise moments: 1 byte each plus one f32 scale per block of 64 elements of a tensor, coded as the nearest entry of a dynamic quantisation map times the block's largest magnitude.
GRADACC_WEIGHTS_MODEL = 0  # The model's dtype given at creation (f32, f16 or bf16).
GRADACC_WEIGHTS_E4M3_TENSORWISE = 1  # E4M3 codes (`float8_e4m3fn`) with one f32 scale per tensor: `scale = 448 / max(amax, 1e-12)` from the amax of the tensor's new FP32 masters over all ranks, each code E4M3(clamp(master * scale, ±448)) rounded to nearest even; the weight is `code / scale`.
GRADACC_WEIGHTS_MXFP8 = 2  # MXFP8: E4M3 codes of `master / 2^e` (saturated at ±448, nearest even) with one E8M0 byte `e + 127` per block of 32 elements, `e = floor(log2(block amax)) - 8` clamped to -127..=127; the weight is `code * 2^e`.
GRADACC_DTYPE_F32 = 0  # IEEE 754 binary32.
GRADACC_DTYPE_F16 = 1  # IEEE 754 binary16 (`_Float16`, `__half`, numpy `float16`).
GRADACC_DTYPE_BF16 = 2  # bfloat16 (`__nv_bfloat16`, the upper 16 bits of an f32).
GRADACC_DEVICE_CPU = 0  # Host memory; buffers are host pointers.
GRADACC_DEVICE_CUDA = 1  # A CUDA device; buffers are device pointers and work is ordered on the given stream.


# Result of every gradacc function: `GRADACC_STATUS_OK` (0) or an error code.
gradacc_status_t = ctypes.c_int32

# A gradient accumulator (opaque).
class gradacc_accumulator_t(ctypes.Structure):
    pass

# One rank's endpoint of a data-parallel group (opaque).
class gradacc_comm_t(ctypes.Structure):
    pass

# A mesh's shape (opaque), for frameworks without their own parallel state: each rank's coordinates and groups in Megatron-Core's rank order or any other.
class gradacc_mesh_shape_t(ctypes.Structure):
    pass

# One boundary over a job's accumulators (opaque): the world communicator and this rank's place on the data axes.
class gradacc_mesh_t(ctypes.Structure):
    pass

# FP32 master weights and AdamW or SGD state for an accumulator's tensors (opaque).
class gradacc_optimizer_t(ctypes.Structure):
    pass

# A dynamic loss scaler (opaque).
class gradacc_scaler_t(ctypes.Structure):
    pass

# How the caller reduced its loss over the `count` items of a micro-batch.
gradacc_loss_reduction_t = ctypes.c_int32

# What the summed gradient is divided by at the boundary.
gradacc_normalize_t = ctypes.c_int32

# What each rank holds of the reduced gradient after the boundary.
gradacc_sharding_t = ctypes.c_int32

# Element type of a model gradient buffer.
gradacc_dtype_t = ctypes.c_int32

# What a non-finite gradient value costs the window (the Rust API's `Overflow`, whose doc is the contract; docs/overflow.md states it for every language).
gradacc_overflow_t = ctypes.c_int32

# Accumulator configuration.
class gradacc_accumulator_config_t(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("loss_reduction", gradacc_loss_reduction_t),
        ("normalize", gradacc_normalize_t),
        ("max_grad_norm", ctypes.c_float),
        ("bucket_numel", ctypes.c_uint64),
        ("threads", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("sharding", gradacc_sharding_t),
        ("shard_count", ctypes.c_uint32),
        ("shard_rank", ctypes.c_uint32),
        ("wire_dtype", gradacc_dtype_t),
        ("overflow", gradacc_overflow_t),
        ("tensor_stats", ctypes.c_uint32),
    ]

# One tensor of an accumulator: element count and the dtype its gradients arrive in.
class gradacc_tensor_desc_t(ctypes.Structure):
    _fields_ = [
        ("numel", ctypes.c_uint64),
        ("dtype", gradacc_dtype_t),
    ]

# Kind of device an object is bound to.
gradacc_device_kind_t = ctypes.c_int32

# The device an object is bound to.
class gradacc_device_t(ctypes.Structure):
    _fields_ = [
        ("kind", gradacc_device_kind_t),
        ("ordinal", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
    ]

# One gradient with what it holds: `numel` values of `dtype` at `data` (a host address for a CPU accumulator, a device address for a CUDA one).
class gradacc_grad_t(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("numel", ctypes.c_uint64),
        ("dtype", gradacc_dtype_t),
    ]

# Where a window first went non-finite (gradacc_sync_info_t's `overflow_at`).
gradacc_overflow_at_t = ctypes.c_int32

# What the boundary reports; identical on every rank.
class gradacc_sync_info_t(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("found_inf", ctypes.c_bool),
        ("total_count", ctypes.c_uint64),
        ("microbatches", ctypes.c_uint64),
        ("grad_norm", ctypes.c_double),
        ("clip_coef", ctypes.c_double),
        ("dropped_microbatches", ctypes.c_uint64),
        ("overflow_at", gradacc_overflow_at_t),
        ("overflow_rank", ctypes.c_uint64),
        ("overflow_microbatch", ctypes.c_uint64),
        ("overflow_tensor", ctypes.c_uint64),
    ]

# A backend gradacc may be built with: a communicator transport or a device kind.
gradacc_backend_t = ctypes.c_int32

# MPI communicator options.
class gradacc_mpi_config_t(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("shared_memory", ctypes.c_uint32),
    ]

# An NCCL unique id: rank 0 makes it with gradacc_nccl_unique_id and sends its bytes to every rank (MPI_Bcast, a file, a TCP store) before they call gradacc_comm_create_nccl.
class gradacc_nccl_unique_id_t(ctypes.Structure):
    _fields_ = [
        ("internal", (ctypes.c_uint8 * 128)),
    ]

# A message's level, or the least severe level a callback receives.
gradacc_log_level_t = ctypes.c_int32

# A log callback: `message` (NUL-terminated, valid only during the call) at `level`, with the `user` pointer given to gradacc_set_log_callback.
gradacc_log_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, gradacc_log_level_t, ctypes.c_char_p)

# A tensor whose values several model-parallel ranks hold alike (a layer norm replicated over tensor-parallel ranks, a tied embedding on the first and the last pipeline stage): it enters the global norm once, from one copy.
class gradacc_replicated_t(ctypes.Structure):
    _fields_ = [
        ("tensor", ctypes.c_uint32),
        ("copies", ctypes.c_uint32),
        ("key", ctypes.c_uint64),
    ]

# One accumulator of a mesh step and the group it reduces over.
class gradacc_mesh_part_t(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("accumulator", ctypes.POINTER(gradacc_accumulator_t)),
        ("comm", ctypes.POINTER(gradacc_comm_t)),
        ("replicas", ctypes.POINTER(gradacc_comm_t)),
        ("replicated", ctypes.POINTER(gradacc_replicated_t)),
        ("replicated_count", ctypes.c_size_t),
    ]

# An optimizer's update rule.
gradacc_optimizer_algorithm_t = ctypes.c_int32

# How the FP32 master weights become the model's 16-bit weights.
gradacc_rounding_t = ctypes.c_int32

# How the FP32 master weights are kept between steps.
gradacc_masters_t = ctypes.c_int32

# How AdamW's moments (SGD's momentum buffer) are kept between steps.
gradacc_moments_t = ctypes.c_int32

# What the step writes for a tensor's weights (docs/optimizer.md, "FP8 weights on the all-gather").
gradacc_weight_format_t = ctypes.c_int32

# Optimizer configuration.
class gradacc_optimizer_config_t(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("algorithm", gradacc_optimizer_algorithm_t),
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("momentum", ctypes.c_float),
        ("dampening", ctypes.c_float),
        ("nesterov", ctypes.c_bool),
        ("rounding", gradacc_rounding_t),
        ("seed", ctypes.c_uint64),
        ("masters", gradacc_masters_t),
        ("moments", gradacc_moments_t),
        ("moment_seed", ctypes.c_uint64),
        ("weight_formats", ctypes.POINTER(gradacc_weight_format_t)),
    ]

# One tensor's options (PyTorch's parameter groups, per tensor).
class gradacc_tensor_group_t(ctypes.Structure):
    _fields_ = [
        ("weight_decay", ctypes.c_bool),
        ("lr_scale", ctypes.c_float),
    ]

# Scaler configuration.
class gradacc_scaler_config_t(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("init_scale", ctypes.c_float),
        ("growth_factor", ctypes.c_float),
        ("backoff_factor", ctypes.c_float),
        ("growth_interval", ctypes.c_uint32),
        ("hysteresis", ctypes.c_uint32),
        ("consecutive_hysteresis", ctypes.c_bool),
        ("min_scale", ctypes.c_float),
        ("max_scale", ctypes.c_float),
        ("dynamic", ctypes.c_bool),
    ]

# Statistics of a scaler since creation or since its state was loaded.
class gradacc_scaler_stats_t(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("steps", ctypes.c_uint64),
        ("skipped_steps", ctypes.c_uint64),
        ("growths", ctypes.c_uint64),
        ("backoffs", ctypes.c_uint64),
    ]


# Fills `*out` with the default accumulator configuration (and its struct_size).
gradacc_accumulator_config_default = dll.gradacc_accumulator_config_default
gradacc_accumulator_config_default.restype = gradacc_status_t
gradacc_accumulator_config_default.argtypes = [ctypes.POINTER(gradacc_accumulator_config_t)]
# arguments: out

# Creates an accumulator over `n` tensors, owning a zero-initialised FP32 master buffer laid out tensor after tensor, each tensor starting at a multiple of GRADACC_MASTER_ALIGN bytes (the buffer's start included), with zeros between.
gradacc_accumulator_create = dll.gradacc_accumulator_create
gradacc_accumulator_create.restype = gradacc_status_t
gradacc_accumulator_create.argtypes = [ctypes.POINTER(gradacc_accumulator_config_t), ctypes.POINTER(gradacc_tensor_desc_t), ctypes.c_size_t, ctypes.POINTER(gradacc_device_t), ctypes.POINTER(ctypes.POINTER(gradacc_accumulator_t))]
# arguments: config, tensors, n, device, out

# Like gradacc_accumulator_create, but adopts the caller's FP32 buffer `master` of exactly `master_numel` elements as the master buffer, e.g. a framework's own contiguous gradient buffer: the tensors with the padding that starts each at a multiple of GRADACC_MASTER_ALIGN bytes (gradacc_accumulator_master_numel gives the count; tensor i starts at gradacc_accumulator_offset).
gradacc_accumulator_create_with_buffer = dll.gradacc_accumulator_create_with_buffer
gradacc_accumulator_create_with_buffer.restype = gradacc_status_t
gradacc_accumulator_create_with_buffer.argtypes = [ctypes.POINTER(gradacc_accumulator_config_t), ctypes.POINTER(gradacc_tensor_desc_t), ctypes.c_size_t, ctypes.POINTER(gradacc_device_t), ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.POINTER(ctypes.POINTER(gradacc_accumulator_t))]
# arguments: config, tensors, n, device, master, master_numel, out

# Creates a sharded accumulation (GRADACC_SHARDING_ACCUMULATE, whose contract is in docs/sharding.md, "Sharded accumulation (ZeRO-2)").
gradacc_accumulator_create_sharded = dll.gradacc_accumulator_create_sharded
gradacc_accumulator_create_sharded.restype = gradacc_status_t
gradacc_accumulator_create_sharded.argtypes = [ctypes.POINTER(gradacc_accumulator_config_t), ctypes.POINTER(gradacc_tensor_desc_t), ctypes.c_size_t, ctypes.POINTER(gradacc_device_t), ctypes.POINTER(gradacc_comm_t), ctypes.POINTER(ctypes.POINTER(gradacc_accumulator_t))]
# arguments: config, tensors, n, device, comm, out

# Destroys an accumulator.
gradacc_accumulator_destroy = dll.gradacc_accumulator_destroy
gradacc_accumulator_destroy.restype = gradacc_status_t
gradacc_accumulator_destroy.argtypes = [ctypes.POINTER(gradacc_accumulator_t)]
# arguments: acc

# Adds one micro-batch of `count` items (a window holds at most 2^47 items per rank, so sums over ranks stay exact): `grads[i]` is tensor i's gradient (numel and dtype as declared), produced from a loss scaled by `scaler`'s current scale.
gradacc_accumulator_add = dll.gradacc_accumulator_add
gradacc_accumulator_add.restype = gradacc_status_t
gradacc_accumulator_add.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(gradacc_scaler_t), ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint64]
# arguments: acc, scaler, grads, n, count

# gradacc_accumulator_add of the window's last micro-batch, which the boundary follows: on the CPU, where the boundary only measures the sum (with clipping, or GRADACC_NORMALIZE_NONE), the add also sums the norm's blocks of the master while each piece is in cache, so that a boundary that reduces nothing between ranks (no communicator, or a group of one) needs no read of its own: the report, the gradient and every step's bits are gradacc_accumulator_add's.
gradacc_accumulator_add_final = dll.gradacc_accumulator_add_final
gradacc_accumulator_add_final.restype = gradacc_status_t
gradacc_accumulator_add_final.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(gradacc_scaler_t), ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint64]
# arguments: acc, scaler, grads, n, count

# gradacc_accumulator_add with each gradient's element type and length: `grads[i]` must hold exactly tensor i's declared numel values of its declared dtype, else the call fails, adding nothing, with GRADACC_STATUS_DTYPE_MISMATCH (another dtype) or GRADACC_STATUS_SIZE_MISMATCH (another numel), naming the tensor and both values.
gradacc_accumulator_add_grads = dll.gradacc_accumulator_add_grads
gradacc_accumulator_add_grads.restype = gradacc_status_t
gradacc_accumulator_add_grads.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(gradacc_scaler_t), ctypes.POINTER(gradacc_grad_t), ctypes.c_size_t, ctypes.c_uint64]
# arguments: acc, scaler, grads, n, count

# Opens a micro-batch of `count` items whose gradients arrive tensor by tensor through gradacc_accumulator_add_tensor (as a framework's backward hooks produce them).
gradacc_accumulator_begin_microbatch = dll.gradacc_accumulator_begin_microbatch
gradacc_accumulator_begin_microbatch.restype = gradacc_status_t
gradacc_accumulator_begin_microbatch.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.c_uint64]
# arguments: acc, count

# Opens the window's last micro-batch of `count` items, arriving tensor by tensor, and names the communicator its boundary will use: on CUDA with NCCL, each bucket's all-reduce starts on a communication stream as soon as every tensor of the bucket has arrived (one contribution each; buckets start in reverse tensor order, as backward produces them), overlapping the rest of the backward pass. gradacc_accumulator_sync with the same `comm` completes the boundary.
gradacc_accumulator_begin_final_microbatch = dll.gradacc_accumulator_begin_final_microbatch
gradacc_accumulator_begin_final_microbatch.restype = gradacc_status_t
gradacc_accumulator_begin_final_microbatch.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.c_uint64, ctypes.POINTER(gradacc_comm_t)]
# arguments: acc, count, comm

# Adds one contribution to tensor `index` of the open micro-batch: `numel` elements of the tensor's declared dtype at `grad`.
gradacc_accumulator_add_tensor = dll.gradacc_accumulator_add_tensor
gradacc_accumulator_add_tensor.restype = gradacc_status_t
gradacc_accumulator_add_tensor.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(gradacc_scaler_t), ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
# arguments: acc, scaler, index, grad, numel

# gradacc_accumulator_add_tensor with the gradient's element type and length: `grad` must hold exactly tensor `index`'s declared numel values of its declared dtype, else the call fails, adding nothing, with GRADACC_STATUS_DTYPE_MISMATCH or GRADACC_STATUS_SIZE_MISMATCH, naming the tensor and both values.
gradacc_accumulator_add_tensor_grad = dll.gradacc_accumulator_add_tensor_grad
gradacc_accumulator_add_tensor_grad.restype = gradacc_status_t
gradacc_accumulator_add_tensor_grad.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(gradacc_scaler_t), ctypes.c_size_t, ctypes.POINTER(gradacc_grad_t)]
# arguments: acc, scaler, index, grad

# Closes the open micro-batch.
gradacc_accumulator_end_microbatch = dll.gradacc_accumulator_end_microbatch
gradacc_accumulator_end_microbatch.restype = gradacc_status_t
gradacc_accumulator_end_microbatch.argtypes = [ctypes.POINTER(gradacc_accumulator_t)]
# arguments: acc

# The accumulation boundary; every rank of `comm`'s group calls it (`comm` NULL: one process).
gradacc_accumulator_sync = dll.gradacc_accumulator_sync
gradacc_accumulator_sync.restype = gradacc_status_t
gradacc_accumulator_sync.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(gradacc_comm_t), ctypes.POINTER(gradacc_sync_info_t)]
# arguments: acc, comm, out_info

# gradacc_accumulator_sync for an optimizer that steps right after (gradacc_optimizer_step): with clipping, the gradient in memory stays the sum before normalisation and clipping, whose one factor the step applies inside its own pass, bitwise as after gradacc_accumulator_sync, and the boundary saves a pass over the gradient.
gradacc_accumulator_sync_for_step = dll.gradacc_accumulator_sync_for_step
gradacc_accumulator_sync_for_step.restype = gradacc_status_t
gradacc_accumulator_sync_for_step.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(gradacc_comm_t), ctypes.POINTER(gradacc_sync_info_t)]
# arguments: acc, comm, out_info

# The hybrid boundary (HSDP) of an accumulator created with GRADACC_SHARDING_REDUCE_SCATTER or GRADACC_SHARDING_ACCUMULATE: the master is reduce-scattered over `shard_comm` (its shard group: shard_count ranks, this one rank shard_rank; for ACCUMULATE, the communicator it was created with, which reduced every micro-batch already), and each shard is then all-reduced over `replica_comm`, the ranks holding the same shard in the other shard groups (rank a*shard_count + i is shard i of shard group a and replica a of replica group i, say).
gradacc_accumulator_sync_hybrid = dll.gradacc_accumulator_sync_hybrid
gradacc_accumulator_sync_hybrid.restype = gradacc_status_t
gradacc_accumulator_sync_hybrid.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(gradacc_comm_t), ctypes.POINTER(gradacc_comm_t), ctypes.POINTER(gradacc_sync_info_t)]
# arguments: acc, shard_comm, replica_comm, out_info

# Writes a pointer to tensor `index`'s FP32 master gradient and its element count (a device address on CUDA, whose contents are ready in the accumulator's stream order).
gradacc_accumulator_master = dll.gradacc_accumulator_master
gradacc_accumulator_master.restype = gradacc_status_t
gradacc_accumulator_master.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.c_size_t, ctypes.POINTER(ctypes.POINTER(ctypes.c_float)), ctypes.POINTER(ctypes.c_size_t)]
# arguments: acc, index, out_data, out_numel

# This rank's shard of the master: `*out_offset` and `*out_numel` give its element range in the flat layout (tensor after tensor, each at gradacc_accumulator_offset, zeros between), `*out_data` the address of its first element (a device address on CUDA).
gradacc_accumulator_shard = dll.gradacc_accumulator_shard
gradacc_accumulator_shard.restype = gradacc_status_t
gradacc_accumulator_shard.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.POINTER(ctypes.c_float))]
# arguments: acc, out_offset, out_numel, out_data

# Each tensor's telemetry of the last boundary, the same on every rank (`config`.tensor_stats = 1): into `grad_norms[i]` the L2 norm of tensor i's reduced, normalised gradient before clipping, into `nonfinite_microbatches[i]` the micro-batches over every rank in which it held a non-finite value (docs/overflow.md).
gradacc_accumulator_tensor_stats = dll.gradacc_accumulator_tensor_stats
gradacc_accumulator_tensor_stats.restype = gradacc_status_t
gradacc_accumulator_tensor_stats.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
# arguments: acc, grad_norms, nonfinite_microbatches, n

# Writes to `*out_numel` the length, in f32 elements, of the flat master of an accumulator over the `n` tensors `tensors`: each tensor starts at a multiple of GRADACC_MASTER_ALIGN bytes, with zeros between and after the last.
gradacc_accumulator_master_numel = dll.gradacc_accumulator_master_numel
gradacc_accumulator_master_numel.restype = gradacc_status_t
gradacc_accumulator_master_numel.argtypes = [ctypes.POINTER(gradacc_tensor_desc_t), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
# arguments: tensors, n, out_numel

# Writes to `*out_offset` where tensor `index` starts in the flat master, in elements: a multiple of GRADACC_MASTER_ALIGN / 4.
gradacc_accumulator_offset = dll.gradacc_accumulator_offset
gradacc_accumulator_offset.restype = gradacc_status_t
gradacc_accumulator_offset.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
# arguments: acc, index, out_offset

# Writes the number of tensors to `*out`.
gradacc_accumulator_num_tensors = dll.gradacc_accumulator_num_tensors
gradacc_accumulator_num_tensors.restype = gradacc_status_t
gradacc_accumulator_num_tensors.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(ctypes.c_size_t)]
# arguments: acc, out

# Writes tensor `index`'s descriptor (element count and dtype) to `*out`, so a caller that did not create the accumulator can still size its buffers.
gradacc_accumulator_tensor = dll.gradacc_accumulator_tensor
gradacc_accumulator_tensor.restype = gradacc_status_t
gradacc_accumulator_tensor.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.c_size_t, ctypes.POINTER(gradacc_tensor_desc_t)]
# arguments: acc, index, out

# Discards the window in progress (or the synced result); the next micro-batch starts a new one.
gradacc_accumulator_reset = dll.gradacc_accumulator_reset
gradacc_accumulator_reset.restype = gradacc_status_t
gradacc_accumulator_reset.argtypes = [ctypes.POINTER(gradacc_accumulator_t)]
# arguments: acc

# Saves the window in progress (masters, counts, micro-batches, overflow flag) as versioned bytes, for a checkpoint in the middle of accumulation.
gradacc_accumulator_save_window = dll.gradacc_accumulator_save_window
gradacc_accumulator_save_window.restype = gradacc_status_t
gradacc_accumulator_save_window.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
# arguments: acc, buf, capacity, out_len

# Restores a window written by gradacc_accumulator_save_window from an accumulator with the same tensors, saved on any device.
gradacc_accumulator_load_window = dll.gradacc_accumulator_load_window
gradacc_accumulator_load_window.restype = gradacc_status_t
gradacc_accumulator_load_window.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t]
# arguments: acc, bytes, len

# Adds a window written by gradacc_accumulator_save_window (of an accumulator with the same tensors, on any device or rank) into `acc`'s current window: masters add, item counts and micro-batches add, overflow flags OR.
gradacc_accumulator_merge_window = dll.gradacc_accumulator_merge_window
gradacc_accumulator_merge_window.restype = gradacc_status_t
gradacc_accumulator_merge_window.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t]
# arguments: acc, bytes, len

# Creates an in-process group of `world_size` ranks (1 to 4096; one per thread, e.g. one replica per socket or per device) and writes its handles, rank 0 first, to `out_comms[0..world_size]`.
gradacc_comm_create_local = dll.gradacc_comm_create_local
gradacc_comm_create_local.restype = gradacc_status_t
gradacc_comm_create_local.argtypes = [ctypes.c_int32, ctypes.POINTER(ctypes.POINTER(gradacc_comm_t))]
# arguments: world_size, out_comms

# Destroys a communicator handle.
gradacc_comm_destroy = dll.gradacc_comm_destroy
gradacc_comm_destroy.restype = gradacc_status_t
gradacc_comm_destroy.argtypes = [ctypes.POINTER(gradacc_comm_t)]
# arguments: comm

# Writes this handle's rank (0-based) to `*out`.
gradacc_comm_rank = dll.gradacc_comm_rank
gradacc_comm_rank.restype = gradacc_status_t
gradacc_comm_rank.argtypes = [ctypes.POINTER(gradacc_comm_t), ctypes.POINTER(ctypes.c_int32)]
# arguments: comm, out

# Writes the group's number of ranks to `*out`.
gradacc_comm_world_size = dll.gradacc_comm_world_size
gradacc_comm_world_size.restype = gradacc_status_t
gradacc_comm_world_size.argtypes = [ctypes.POINTER(gradacc_comm_t), ctypes.POINTER(ctypes.c_int32)]
# arguments: comm, out

# Writes to `*out` whether `backend` (GRADACC_BACKEND_*) can be used: MPI when the library was built with it; CUDA and NCCL when their libraries load on this machine (checked without ever failing: a machine with no driver just answers false).
gradacc_backend_available = dll.gradacc_backend_available
gradacc_backend_available.restype = gradacc_status_t
gradacc_backend_available.argtypes = [gradacc_backend_t, ctypes.POINTER(ctypes.c_bool)]
# arguments: backend, out

# Fills `*out` with the default MPI communicator options (and their struct_size).
gradacc_mpi_config_default = dll.gradacc_mpi_config_default
gradacc_mpi_config_default.restype = gradacc_status_t
gradacc_mpi_config_default.argtypes = [ctypes.POINTER(gradacc_mpi_config_t)]
# arguments: out

# Creates this process's rank of an MPI communicator: MPI_COMM_WORLD when `fortran_comm` is GRADACC_MPI_COMM_WORLD (-1), otherwise the caller's communicator given by its Fortran handle: `MPI_Comm_c2f(comm)` in C, `comm.py2f()` in mpi4py, `MPI.API.MPI_Comm_c2f(comm.val)` in MPI.jl (`comm.val` alone is MPI.jl's C handle, not this one).
gradacc_comm_create_mpi = dll.gradacc_comm_create_mpi
gradacc_comm_create_mpi.restype = gradacc_status_t
gradacc_comm_create_mpi.argtypes = [ctypes.c_int64, ctypes.POINTER(gradacc_mpi_config_t), ctypes.POINTER(ctypes.POINTER(gradacc_comm_t))]
# arguments: fortran_comm, config, out_comm

# Writes a new NCCL unique id to `*out` (rank 0 calls it, then shares the bytes).
gradacc_nccl_unique_id = dll.gradacc_nccl_unique_id
gradacc_nccl_unique_id.restype = gradacc_status_t
gradacc_nccl_unique_id.argtypes = [ctypes.POINTER(gradacc_nccl_unique_id_t)]
# arguments: out

# Creates rank `rank` of `world_size` of the NCCL group named by `id`, on CUDA device `device_ordinal` (one rank per GPU).
gradacc_comm_create_nccl = dll.gradacc_comm_create_nccl
gradacc_comm_create_nccl.restype = gradacc_status_t
gradacc_comm_create_nccl.argtypes = [ctypes.POINTER(gradacc_nccl_unique_id_t), ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.POINTER(gradacc_comm_t))]
# arguments: id, rank, world_size, device_ordinal, out_comm

# Wraps the caller's `ncclComm_t` (passed as `void*`); its rank, size and device are read from it. gradacc never destroys or aborts an adopted communicator.
gradacc_comm_adopt_nccl = dll.gradacc_comm_adopt_nccl
gradacc_comm_adopt_nccl.restype = gradacc_status_t
gradacc_comm_adopt_nccl.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.POINTER(gradacc_comm_t))]
# arguments: nccl_comm, out_comm

# Creates this rank's communicator of a split of `comm`: the ranks that pass the same `color` form a group, ranked by `key` (ties by their rank in `comm`), on the same transport with the same options: MPI_Comm_split for an MPI communicator, ncclCommSplit for an NCCL one (NCCL 2.18 or newer; before, GRADACC_STATUS_BACKEND_UNAVAILABLE).
gradacc_comm_split = dll.gradacc_comm_split
gradacc_comm_split.restype = gradacc_status_t
gradacc_comm_split.argtypes = [ctypes.POINTER(gradacc_comm_t), ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.POINTER(gradacc_comm_t))]
# arguments: comm, color, key, out_comm

# Sets how long a collective on `comm` may wait for the other ranks: after `seconds` it fails with GRADACC_STATUS_TIMEOUT, naming the phase and the wait, and aborts the communicator. 0 waits forever; the default is 600 (10 minutes).
gradacc_comm_set_timeout = dll.gradacc_comm_set_timeout
gradacc_comm_set_timeout.restype = gradacc_status_t
gradacc_comm_set_timeout.argtypes = [ctypes.POINTER(gradacc_comm_t), ctypes.c_double]
# arguments: comm, seconds

# Writes `comm`'s timeout in seconds to `*out` (0: it waits forever).
gradacc_comm_timeout = dll.gradacc_comm_timeout
gradacc_comm_timeout.restype = gradacc_status_t
gradacc_comm_timeout.argtypes = [ctypes.POINTER(gradacc_comm_t), ctypes.POINTER(ctypes.c_double)]
# arguments: comm, out

# Aborts this rank's communicator, of any backend: a sync waiting in it on any thread, and every later one, fails with GRADACC_STATUS_COMM_FAILURE (use it when a peer died).
gradacc_comm_abort = dll.gradacc_comm_abort
gradacc_comm_abort.restype = gradacc_status_t
gradacc_comm_abort.argtypes = [ctypes.POINTER(gradacc_comm_t)]
# arguments: comm

# Converts the `n` f32 values at `src` to IEEE binary16 bits at `dst`, rounding to nearest even: a value past the largest finite f16 (65504) rounds to infinity from 65520 up, a value below the smallest subnormal (2^-24) to a signed zero from 2^-25 down; a NaN stays NaN, quiet, with the upper bits of its payload.
gradacc_f32_to_f16 = dll.gradacc_f32_to_f16
gradacc_f32_to_f16.restype = gradacc_status_t
gradacc_f32_to_f16.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_uint16), ctypes.c_size_t]
# arguments: src, dst, n

# Converts the `n` IEEE binary16 bit patterns at `src` to f32 values at `dst`, exactly (every f16 value is an f32 value, subnormals included); a NaN stays NaN with its payload, and a signalling one comes back quiet, as F16C's conversion gives it (the same bits without F16C).
gradacc_f16_to_f32 = dll.gradacc_f16_to_f32
gradacc_f16_to_f32.restype = gradacc_status_t
gradacc_f16_to_f32.argtypes = [ctypes.POINTER(ctypes.c_uint16), ctypes.POINTER(ctypes.c_float), ctypes.c_size_t]
# arguments: src, dst, n

# Converts the `n` f32 values at `src` to bfloat16 bits at `dst`, rounding to nearest even (a value past the largest finite bf16 rounds to infinity); a NaN stays NaN, quiet, with the upper bits of its payload.
gradacc_f32_to_bf16 = dll.gradacc_f32_to_bf16
gradacc_f32_to_bf16.restype = gradacc_status_t
gradacc_f32_to_bf16.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_uint16), ctypes.c_size_t]
# arguments: src, dst, n

# Converts the `n` bfloat16 bit patterns at `src` to f32 values at `dst`, exactly: each pattern becomes the upper half of an f32, a NaN's payload as it is (a signalling one stays signalling), as gradacc reads a bf16 gradient.
gradacc_bf16_to_f32 = dll.gradacc_bf16_to_f32
gradacc_bf16_to_f32.restype = gradacc_status_t
gradacc_bf16_to_f32.argtypes = [ctypes.POINTER(ctypes.c_uint16), ctypes.POINTER(ctypes.c_float), ctypes.c_size_t]
# arguments: src, dst, n

# Sends the library's messages at `level` and more severe ones (GRADACC_LOG_WARN: warnings and errors) to `callback`, with `user` passed back unchanged; NULL `callback` (or GRADACC_LOG_OFF) turns them off, back to the default: nothing, or stderr at the level the environment variable `GRADACC_LOG` names (error, warn, info, debug).
gradacc_set_log_callback = dll.gradacc_set_log_callback
gradacc_set_log_callback.restype = gradacc_status_t
gradacc_set_log_callback.argtypes = [gradacc_log_fn, ctypes.c_void_p, gradacc_log_level_t]
# arguments: callback, user, level

# Writes the diagnostic report into `buf`, NUL-terminated, as snprintf does: the library's version and file, the host and its SIMD path, each backend available or why not, the CUDA driver, NVRTC and NCCL found (version and file) or why not, and every environment variable the library reads.
gradacc_diagnostics = dll.gradacc_diagnostics
gradacc_diagnostics.restype = gradacc_status_t
gradacc_diagnostics.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
# arguments: buf, size, needed

# Creates a mesh over `world`, a host communicator (in-process or MPI) of every rank of the job, where this rank is data-parallel rank `data_rank` of `data_size`: the ranks that see different data (data-parallel x context-parallel).
gradacc_mesh_create = dll.gradacc_mesh_create
gradacc_mesh_create.restype = gradacc_status_t
gradacc_mesh_create.argtypes = [ctypes.POINTER(gradacc_comm_t), ctypes.c_uint32, ctypes.c_uint32, ctypes.c_float, ctypes.POINTER(ctypes.POINTER(gradacc_mesh_t))]
# arguments: world, data_rank, data_size, max_grad_norm, out_mesh

# Destroys a mesh.
gradacc_mesh_destroy = dll.gradacc_mesh_destroy
gradacc_mesh_destroy.restype = gradacc_status_t
gradacc_mesh_destroy.argtypes = [ctypes.POINTER(gradacc_mesh_t)]
# arguments: mesh

# Creates the shape of a mesh of `world_size` ranks: `tp`, `pp` and `cp` ranks on the tensor-, pipeline- and context-parallel axes (data parallel takes the rest), and the experts of each pipeline stage over `ep` x `etp` of its ranks (expert data parallel takes the rest of the stage), as Megatron-Core's parallel state makes them.
gradacc_mesh_shape_create = dll.gradacc_mesh_shape_create
gradacc_mesh_shape_create.restype = gradacc_status_t
gradacc_mesh_shape_create.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(gradacc_mesh_shape_t))]
# arguments: world_size, tp, pp, cp, ep, etp, order, out_shape

# Destroys a mesh shape.
gradacc_mesh_shape_destroy = dll.gradacc_mesh_shape_destroy
gradacc_mesh_shape_destroy.restype = gradacc_status_t
gradacc_mesh_shape_destroy.argtypes = [ctypes.POINTER(gradacc_mesh_shape_t)]
# arguments: shape

# Where world rank `rank` sits in its group over `axes`: the axes' names joined by '-', all of the dense view (tp, cp, dp, pp) or all of the expert one (etp, ep, edp, pp).
gradacc_mesh_shape_group = dll.gradacc_mesh_shape_group
gradacc_mesh_shape_group.restype = gradacc_status_t
gradacc_mesh_shape_group.argtypes = [ctypes.POINTER(gradacc_mesh_shape_t), ctypes.c_uint32, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32)]
# arguments: shape, rank, axes, color_out, key_out, size_out

# This rank's group over `axes` (as gradacc_mesh_shape_group), split from `world`: an MPI or NCCL communicator of every rank of the mesh, whose ranks are the world ranks (see gradacc_comm_split).
gradacc_mesh_shape_split = dll.gradacc_mesh_shape_split
gradacc_mesh_shape_split.restype = gradacc_status_t
gradacc_mesh_shape_split.argtypes = [ctypes.POINTER(gradacc_mesh_shape_t), ctypes.POINTER(gradacc_comm_t), ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(gradacc_comm_t))]
# arguments: shape, world, axes, out_comm

# The mesh step: the boundary of every accumulator of this rank's step (`parts[0..count]`), and one agreement over the mesh's world for all.
gradacc_mesh_sync = dll.gradacc_mesh_sync
gradacc_mesh_sync.restype = gradacc_status_t
gradacc_mesh_sync.argtypes = [ctypes.POINTER(gradacc_mesh_t), ctypes.POINTER(gradacc_mesh_part_t), ctypes.c_size_t, ctypes.POINTER(gradacc_sync_info_t), ctypes.POINTER(ctypes.c_uint32)]
# arguments: mesh, parts, count, info_out, overflow_part_out

# Ends the open micro-batch of each of `accumulators` (`count` handles, this rank's, each under GRADACC_OVERFLOW_DROP_MICROBATCH and fed tensor by tensor since gradacc_accumulator_begin_microbatch; not sharded accumulation), agreeing its drop over the world first (one all-gather of 24 bytes per rank): if any rank at this data-parallel rank (its tensor-, pipeline- and expert-tensor-parallel peers, which computed from the same data) found a non-finite gradient in any of its accumulators, every one of them drops the micro-batch in every accumulator; the others keep theirs.
gradacc_mesh_end_microbatch = dll.gradacc_mesh_end_microbatch
gradacc_mesh_end_microbatch.restype = gradacc_status_t
gradacc_mesh_end_microbatch.argtypes = [ctypes.POINTER(gradacc_mesh_t), ctypes.POINTER(ctypes.POINTER(gradacc_accumulator_t)), ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint32)]
# arguments: mesh, accumulators, count, kept_out

# Fills `*out` with the default optimizer configuration (AdamW with PyTorch's defaults, lr 1e-3) and its struct_size.
gradacc_optimizer_config_default = dll.gradacc_optimizer_config_default
gradacc_optimizer_config_default.restype = gradacc_status_t
gradacc_optimizer_config_default.argtypes = [ctypes.POINTER(gradacc_optimizer_config_t)]
# arguments: out

# Creates an optimizer over `acc`'s tensors, device and sharding: its FP32 master weights (for this rank's shard under GRADACC_SHARDING_REDUCE_SCATTER or _ACCUMULATE) initialised from the model's weights `weights[i]` (pointers to each whole tensor, of `weight_dtypes[i]`, or of the tensors' gradient dtypes when `weight_dtypes` is NULL), each tensor in `groups[i]` (NULL: weight decay on, lr_scale 1).
gradacc_optimizer_create = dll.gradacc_optimizer_create
gradacc_optimizer_create.restype = gradacc_status_t
gradacc_optimizer_create.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(gradacc_optimizer_config_t), ctypes.POINTER(gradacc_tensor_group_t), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(gradacc_dtype_t), ctypes.c_size_t, ctypes.POINTER(ctypes.POINTER(gradacc_optimizer_t))]
# arguments: acc, config, groups, weights, weight_dtypes, n, out

# Like gradacc_optimizer_create, but adopts the caller's FP32 master weights `masters`, of exactly `masters_numel` elements, instead of allocating them: e.g. a framework's own FP32 master weights (Apex O2, Megatron's contiguous FP32 buffer).
gradacc_optimizer_create_with_masters = dll.gradacc_optimizer_create_with_masters
gradacc_optimizer_create_with_masters.restype = gradacc_status_t
gradacc_optimizer_create_with_masters.argtypes = [ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(gradacc_optimizer_config_t), ctypes.POINTER(gradacc_tensor_group_t), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(gradacc_dtype_t), ctypes.c_size_t, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.POINTER(ctypes.POINTER(gradacc_optimizer_t))]
# arguments: acc, config, groups, weights, weight_dtypes, n, masters, masters_numel, out

# Destroys an optimizer.
gradacc_optimizer_destroy = dll.gradacc_optimizer_destroy
gradacc_optimizer_destroy.restype = gradacc_status_t
gradacc_optimizer_destroy.argtypes = [ctypes.POINTER(gradacc_optimizer_t)]
# arguments: opt

# Sets the learning rate of the steps from the next one on (finite, >= 0).
gradacc_optimizer_set_lr = dll.gradacc_optimizer_set_lr
gradacc_optimizer_set_lr.restype = gradacc_status_t
gradacc_optimizer_set_lr.argtypes = [ctypes.POINTER(gradacc_optimizer_t), ctypes.c_float]
# arguments: opt, lr

# On a CUDA accumulator, writes to `*out` the device address of the learning rate (one `float`) that every step reads when it runs on the stream.
gradacc_optimizer_lr_device_ptr = dll.gradacc_optimizer_lr_device_ptr
gradacc_optimizer_lr_device_ptr.restype = gradacc_status_t
gradacc_optimizer_lr_device_ptr.argtypes = [ctypes.POINTER(gradacc_optimizer_t), ctypes.POINTER(ctypes.c_void_p)]
# arguments: opt, out

# Writes the number of steps taken (a skipped step is not one) to `*out`.
gradacc_optimizer_steps = dll.gradacc_optimizer_steps
gradacc_optimizer_steps.restype = gradacc_status_t
gradacc_optimizer_steps.argtypes = [ctypes.POINTER(gradacc_optimizer_t), ctypes.POINTER(ctypes.c_uint64)]
# arguments: opt, out

# The step after gradacc_accumulator_sync of `acc` (the accumulator the optimizer was made over): steps the FP32 masters and the state from the reduced gradient and writes the model's weights `weights[i]` (pointers to each whole tensor, in the dtypes given at creation), or, when the boundary found a non-finite value, changes nothing; `*out_stepped` (may be NULL) says which.
gradacc_optimizer_step = dll.gradacc_optimizer_step
gradacc_optimizer_step.restype = gradacc_status_t
gradacc_optimizer_step.argtypes = [ctypes.POINTER(gradacc_optimizer_t), ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.POINTER(gradacc_comm_t), ctypes.POINTER(ctypes.c_bool)]
# arguments: opt, acc, weights, n, comm, out_stepped

# gradacc_optimizer_step of an optimizer whose `config.weight_formats` makes some tensors FP8: for such a tensor i, `weights[i]` holds its `numel` E4M3 codes (bytes) and `scales[i]` its scales, which the step writes with the codes: one float for GRADACC_WEIGHTS_E4M3_TENSORWISE, one E8M0 byte per block of 32 elements (the last block shorter) for GRADACC_WEIGHTS_MXFP8.
gradacc_optimizer_step_scaled = dll.gradacc_optimizer_step_scaled
gradacc_optimizer_step_scaled.restype = gradacc_status_t
gradacc_optimizer_step_scaled.argtypes = [ctypes.POINTER(gradacc_optimizer_t), ctypes.POINTER(gradacc_accumulator_t), ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.POINTER(gradacc_comm_t), ctypes.POINTER(ctypes.c_bool)]
# arguments: opt, acc, weights, scales, n, comm, out_stepped

# Writes this rank's optimizer state (versioned, checksummed) into `buf` (NULL: only reports the size) and its length to `*out_len`.
gradacc_optimizer_save = dll.gradacc_optimizer_save
gradacc_optimizer_save.restype = gradacc_status_t
gradacc_optimizer_save.argtypes = [ctypes.POINTER(gradacc_optimizer_t), ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
# arguments: opt, buf, capacity, out_len

# Restores the state from `n` saved parts (`parts[k]`, `lens[k]` bytes each): what gradacc_optimizer_save wrote on any number of ranks, together covering this rank's elements, so a state saved over one shard count loads over another.
gradacc_optimizer_load = dll.gradacc_optimizer_load
gradacc_optimizer_load.restype = gradacc_status_t
gradacc_optimizer_load.argtypes = [ctypes.POINTER(gradacc_optimizer_t), ctypes.POINTER(ctypes.POINTER(ctypes.c_uint8)), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
# arguments: opt, parts, lens, n

# Fills `*out` with the default scaler configuration (and its struct_size).
gradacc_scaler_config_default = dll.gradacc_scaler_config_default
gradacc_scaler_config_default.restype = gradacc_status_t
gradacc_scaler_config_default.argtypes = [ctypes.POINTER(gradacc_scaler_config_t)]
# arguments: out

# Creates a scaler.
gradacc_scaler_create = dll.gradacc_scaler_create
gradacc_scaler_create.restype = gradacc_status_t
gradacc_scaler_create.argtypes = [ctypes.POINTER(gradacc_scaler_config_t), ctypes.POINTER(gradacc_device_t), ctypes.POINTER(ctypes.POINTER(gradacc_scaler_t))]
# arguments: config, device, out

# Destroys a scaler.
gradacc_scaler_destroy = dll.gradacc_scaler_destroy
gradacc_scaler_destroy.restype = gradacc_status_t
gradacc_scaler_destroy.argtypes = [ctypes.POINTER(gradacc_scaler_t)]
# arguments: scaler

# Reads the current loss scale into `*out`.
gradacc_scaler_scale = dll.gradacc_scaler_scale
gradacc_scaler_scale.restype = gradacc_status_t
gradacc_scaler_scale.argtypes = [ctypes.POINTER(gradacc_scaler_t), ctypes.POINTER(ctypes.c_float)]
# arguments: scaler, out

# Multiplies `numel` loss values of `dtype` at `loss` in place by the current scale (16-bit values round to nearest even).
gradacc_scaler_scale_loss = dll.gradacc_scaler_scale_loss
gradacc_scaler_scale_loss.restype = gradacc_status_t
gradacc_scaler_scale_loss.argtypes = [ctypes.POINTER(gradacc_scaler_t), ctypes.c_void_p, ctypes.c_size_t, gradacc_dtype_t]
# arguments: scaler, loss, numel, dtype

# Ends an optimizer step: reads the agreed overflow flag of each of the `n` accumulators (each must have completed gradacc_accumulator_sync for its current window), and updates the scale once.
gradacc_scaler_update = dll.gradacc_scaler_update
gradacc_scaler_update.restype = gradacc_status_t
gradacc_scaler_update.argtypes = [ctypes.POINTER(gradacc_scaler_t), ctypes.POINTER(ctypes.POINTER(gradacc_accumulator_t)), ctypes.c_size_t, ctypes.POINTER(ctypes.c_bool)]
# arguments: scaler, accumulators, n, out_skipped

# Writes the scaler's statistics to `*out`.
gradacc_scaler_stats = dll.gradacc_scaler_stats
gradacc_scaler_stats.restype = gradacc_status_t
gradacc_scaler_stats.argtypes = [ctypes.POINTER(gradacc_scaler_t), ctypes.POINTER(gradacc_scaler_stats_t)]
# arguments: scaler, out

# Saves the scaler's complete state (config, scale, trackers, statistics) as versioned bytes.
gradacc_scaler_save = dll.gradacc_scaler_save
gradacc_scaler_save.restype = gradacc_status_t
gradacc_scaler_save.argtypes = [ctypes.POINTER(gradacc_scaler_t), ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]
# arguments: scaler, buf, capacity, out_len

# Restores a state written by gradacc_scaler_save.
gradacc_scaler_load = dll.gradacc_scaler_load
gradacc_scaler_load.restype = gradacc_status_t
gradacc_scaler_load.argtypes = [ctypes.POINTER(gradacc_scaler_t), ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t]
# arguments: scaler, bytes, len

# A static description of a status code (never NULL; unknown codes get a generic text).
gradacc_status_string = dll.gradacc_status_string
gradacc_status_string.restype = ctypes.c_char_p
gradacc_status_string.argtypes = [ctypes.c_int32]
# arguments: status

# The message of the most recent failed gradacc call on the calling thread ("" if none yet).
gradacc_last_error = dll.gradacc_last_error
gradacc_last_error.restype = ctypes.c_char_p
gradacc_last_error.argtypes = []

# The loaded library's version as "MAJOR.MINOR.PATCH" (static storage, never NULL).
gradacc_version_string = dll.gradacc_version_string
gradacc_version_string.restype = ctypes.c_char_p
gradacc_version_string.argtypes = []

# The loaded library's version as MAJOR * 10000 + MINOR * 100 + PATCH.
gradacc_version_number = dll.gradacc_version_number
gradacc_version_number.restype = ctypes.c_uint32
gradacc_version_number.argtypes = []
