# ccall declarations of the gradacc C API.
#
# Generated from include/gradacc.h by bindings/julia/gen_wrap.py. Do not edit by hand:
# change capi/src/, run scripts/gen-header, then bindings/julia/gen_wrap.py.
# `libgradacc()` (the library path) and `libgradacc_handle()` (its dlopen handle) are
# defined by the including module and set when it loads. Functions marked "blocks" can
# wait on other ranks: they convert their arguments first, then call with the thread in the
# GC-safe state (jl_gc_safe_enter/leave around the call, as CUDA.jl's @gcsafe_ccall), so that
# a collection started by another thread does not wait for them (JuliaLang/julia#51574).
# The library never calls back into Julia, which the GC-safe state requires.

const GRADACC_VERSION_MAJOR = 0  # Major version of this header (from Cargo.toml).
const GRADACC_VERSION_MINOR = 2  # Minor version of this header (from Cargo.toml).
const GRADACC_VERSION_PATCH = 0  # Patch version of this header (from Cargo.toml).
const GRADACC_VERSION_STRING = "0.2.0"  # Full version of this header, as a string (from Cargo.toml).
const GRADACC_VERSION_NUMBER = 200  # Version of this header as one number, MAJOR * 10000 + MINOR * 100 + PATCH (as NCCL_VERSION_CODE), for `#if GRADACC_VERSION_NUMBER >= GRADACC_VERSION(0, 2, 0)`; equal to gradacc_version_number() of the library it came with.
const GRADACC_MASTER_ALIGN = 256  # Bytes to which every tensor's FP32 master is aligned in the flat master: tensor `i` starts at an element offset that is a multiple of GRADACC_MASTER_ALIGN / 4 (gradacc_accumulator_offset), with zeros between tensors.
const GRADACC_MPI_COMM_WORLD = -1  # The `fortran_comm` value of gradacc_comm_create_mpi that means MPI_COMM_WORLD.
const GRADACC_STATUS_OK = 0  # Success.
const GRADACC_STATUS_NULL_ARGUMENT = 1  # A required pointer argument was NULL.
const GRADACC_STATUS_INVALID_ARGUMENT = 2  # An argument's value is outside its domain (a count, an index, an enum value, a config field).
const GRADACC_STATUS_INVALID_HANDLE = 3  # A handle that was destroyed, never created, or is of another object type.
const GRADACC_STATUS_DTYPE_MISMATCH = 4  # A gradient's dtype differs from its tensor's declared dtype.
const GRADACC_STATUS_SIZE_MISMATCH = 5  # A buffer's length, or an accumulator's layout across ranks, differs from what is expected.
const GRADACC_STATUS_DEVICE_MISMATCH = 6  # Objects bound to different devices or backends were combined.
const GRADACC_STATUS_WRONG_STATE = 7  # The call is not allowed in the object's current state (e.g. sync inside a micro-batch).
const GRADACC_STATUS_EMPTY_WINDOW = 8  # The accumulation window holds no micro-batch (on any rank), or its global item count is 0.
const GRADACC_STATUS_SCALE_AT_MINIMUM = 9  # An overflow needed a backoff while the loss scale was already at min_scale.
const GRADACC_STATUS_BACKEND_UNAVAILABLE = 10  # The requested backend (CUDA, NCCL, MPI) is not in this build or not on this machine.
const GRADACC_STATUS_COMM_FAILURE = 11  # The communicator failed.
const GRADACC_STATUS_PEER_FAILURE = 12  # Another rank's call failed, so this rank stopped the collective too (nothing was reduced).
const GRADACC_STATUS_CORRUPT_STATE = 13  # Saved state bytes are corrupt, truncated, foreign, or of an unsupported version.
const GRADACC_STATUS_OUT_OF_MEMORY = 14  # An allocation failed.
const GRADACC_STATUS_INTERNAL = 15  # An internal error (a bug in gradacc); the message says where.
const GRADACC_STATUS_DEVICE_FAILURE = 16  # The CUDA driver reported an error (a failed launch or copy, an invalid device address, a device that fell off the bus); the message carries the driver's own text.
const GRADACC_STATUS_TIMEOUT = 17  # A collective did not complete within the communicator's timeout (gradacc_comm_set_timeout); the communicator was aborted, and the message names the phase and how long it waited.
const GRADACC_LOSS_REDUCTION_MEAN = 0  # The loss is the mean over the micro-batch's items (default).
const GRADACC_LOSS_REDUCTION_SUM = 1  # The loss is the sum over the micro-batch's items.
const GRADACC_NORMALIZE_BY_COUNT = 0  # The global item count over micro-batches and ranks (default): the gradient of the mean loss over every item of the effective batch.
const GRADACC_NORMALIZE_BY_MICROBATCHES = 1  # The global number of micro-batches (`loss / steps` with a DDP mean): a mean of means.
const GRADACC_NORMALIZE_BY_WORLD = 2  # The number of ranks: sum over micro-batches, mean over ranks (DDP with no_sync).
const GRADACC_NORMALIZE_NONE = 3  # No division: the plain sum.
const GRADACC_SHARDING_NONE = 0  # Every rank holds the whole reduced gradient: an all-reduce, as DDP (default).
const GRADACC_SHARDING_REDUCE_SCATTER = 1  # Rank `shard_rank` of `shard_count` holds only its shard of the reduced gradient, a contiguous range of the flat layout (gradacc_accumulator_shard): a reduce-scatter, half an all-reduce's traffic, as a distributed optimizer (ZeRO-1) needs.
const GRADACC_SHARDING_ACCUMULATE = 2  # Sharded accumulation (ZeRO-2): rank `shard_rank` of `shard_count` holds only its shard of the FP32 gradient, and every micro-batch is reduce-scattered as it is added.
const GRADACC_OVERFLOW_SKIP_STEP = 0  # The window's step is skipped on every rank, as PyTorch's GradScaler does (default).
const GRADACC_OVERFLOW_DROP_MICROBATCH = 1  # Only the micro-batch that held it is dropped, on the rank that fed it; the boundary normalises by what every rank kept, and the step is skipped only when nothing was kept or the sum overflows.
const GRADACC_OVERFLOW_AT_NONE = 0  # Nowhere: the window stayed finite, or found_inf is set and the first place is unknown (a rank's window went non-finite where nothing recorded it, which may come before any other place, so no rank names one).
const GRADACC_OVERFLOW_AT_GRADIENT = 1  # A gradient: `overflow_rank`, `overflow_microbatch` and `overflow_tensor` say where.
const GRADACC_OVERFLOW_AT_REDUCTION = 2  # Every rank's window was finite; their sum overflowed.
const GRADACC_BACKEND_LOCAL = 0  # The in-process communicator (gradacc_comm_create_local); in every build.
const GRADACC_BACKEND_MPI = 1  # The MPI communicator (gradacc_comm_create_mpi); in builds with the `mpi` feature (CMake option GRADACC_WITH_MPI).
const GRADACC_BACKEND_NCCL = 2  # The NCCL communicator (gradacc_comm_create_nccl): in every build; available where the CUDA driver and NCCL (GRADACC_NCCL_LIBRARY, else libnccl.so.2 or libnccl.so) load.
const GRADACC_BACKEND_CUDA = 3  # CUDA devices (GRADACC_DEVICE_CUDA): in every build; available where the CUDA driver sees a device and NVRTC (GRADACC_NVRTC_LIBRARY, else libnvrtc.so.13, .so.12 or .so) loads.
const GRADACC_LOG_OFF = 0  # No messages.
const GRADACC_LOG_ERROR = 1  # A call failed in a way its status alone does not tell.
const GRADACC_LOG_WARN = 2  # A setting was not honoured (an unknown or unsupported GRADACC_CPU_ISA).
const GRADACC_LOG_INFO = 3  # What a training run wants to know: a skipped step and the loss scale it backed off to, a dropped micro-batch, a CUDA library loaded (and from where) or not.
const GRADACC_LOG_DEBUG = 4  # The rest: a grown loss scale, each library candidate that did not load, the SIMD path chosen.
const GRADACC_OPTIMIZER_ADAMW = 0  # `torch.optim.AdamW` (amsgrad off): beta1, beta2, eps, weight_decay.
const GRADACC_OPTIMIZER_SGD = 1  # `torch.optim.SGD`: momentum, dampening, nesterov, weight_decay.
const GRADACC_ROUNDING_NEAREST_EVEN = 0  # Round to nearest, ties to even.
const GRADACC_ROUNDING_STOCHASTIC = 1  # Stochastic rounding keyed by `seed`, the step and the element (the same on every rank).
const GRADACC_MASTERS_FP32 = 0  # FP32 masters: 4 bytes per parameter beside the model's weight.
const GRADACC_MASTERS_BF16_REMAINDER = 1  # The master is the model's bf16 weight plus a 16-bit remainder the optimizer keeps: 2 bytes per parameter, the FP32 master exactly.
const GRADACC_MASTERS_NONE = 2  # No masters: each step reads the master from the model's weight, steps it in f32 and writes it back with the weights' rounding: 0 bytes per parameter. 16-bit weights need GRADACC_ROUNDING_STOCHASTIC (else INVALID_ARGUMENT: an update below half a 16-bit spacing would be lost); over f32 weights it is FP32 masters bit for bit.
const GRADACC_MOMENTS_FP32 = 0  # FP32 moments: 4 bytes per moment.
const GRADACC_MOMENTS_BF16 = 1  # bf16 moments, 2 bytes each, rounded stochastically keyed by `moment_seed`, the step and the element (the same on every rank and shard count).
const GRADACC_MOMENTS_INT8_BLOCKWISE = 2  # 8-bit blockwise moments: 1 byte each plus one f32 scale per block of 64 elements of a tensor, coded as the nearest entry of a dynamic quantisation map times the block's largest magnitude.
const GRADACC_WEIGHTS_MODEL = 0  # The model's dtype given at creation (f32, f16 or bf16).
const GRADACC_WEIGHTS_E4M3_TENSORWISE = 1  # E4M3 codes (`float8_e4m3fn`) with one f32 scale per tensor: `scale = 448 / max(amax, 1e-12)` from the amax of the tensor's new FP32 masters over all ranks, each code E4M3(clamp(master * scale, ±448)) rounded to nearest even; the weight is `code / scale`.
const GRADACC_WEIGHTS_MXFP8 = 2  # MXFP8: E4M3 codes of `master / 2^e` (saturated at ±448, nearest even) with one E8M0 byte `e + 127` per block of 32 elements, `e = floor(log2(block amax)) - 8` clamped to -127..=127; the weight is `code * 2^e`.
const GRADACC_DTYPE_F32 = 0  # IEEE 754 binary32.
const GRADACC_DTYPE_F16 = 1  # IEEE 754 binary16 (`_Float16`, `__half`, numpy `float16`).
const GRADACC_DTYPE_BF16 = 2  # bfloat16 (`__nv_bfloat16`, the upper 16 bits of an f32).
const GRADACC_DEVICE_CPU = 0  # Host memory; buffers are host pointers.
const GRADACC_DEVICE_CUDA = 1  # A CUDA device; buffers are device pointers and work is ordered on the given stream.

"Result of every gradacc function: `GRADACC_STATUS_OK` (0) or an error code."
const gradacc_status_t = Int32

"A gradient accumulator (opaque)."
mutable struct gradacc_accumulator_t end

"One rank's endpoint of a data-parallel group (opaque)."
mutable struct gradacc_comm_t end

"A mesh's shape (opaque), for frameworks without their own parallel state: each rank's coordinates and groups in Megatron-Core's rank order or any other."
mutable struct gradacc_mesh_shape_t end

"One boundary over a job's accumulators (opaque): the world communicator and this rank's place on the data axes."
mutable struct gradacc_mesh_t end

"FP32 master weights and AdamW or SGD state for an accumulator's tensors (opaque)."
mutable struct gradacc_optimizer_t end

"A dynamic loss scaler (opaque)."
mutable struct gradacc_scaler_t end

"How the caller reduced its loss over the `count` items of a micro-batch."
const gradacc_loss_reduction_t = Int32

"What the summed gradient is divided by at the boundary."
const gradacc_normalize_t = Int32

"What each rank holds of the reduced gradient after the boundary."
const gradacc_sharding_t = Int32

"Element type of a model gradient buffer."
const gradacc_dtype_t = Int32

"What a non-finite gradient value costs the window (the Rust API's `Overflow`, whose doc is the contract; docs/overflow.md states it for every language)."
const gradacc_overflow_t = Int32

"Accumulator configuration."
struct gradacc_accumulator_config_t
    struct_size::Csize_t
    loss_reduction::gradacc_loss_reduction_t
    normalize::gradacc_normalize_t
    max_grad_norm::Cfloat
    bucket_numel::UInt64
    threads::UInt32
    reserved::UInt32
    sharding::gradacc_sharding_t
    shard_count::UInt32
    shard_rank::UInt32
    wire_dtype::gradacc_dtype_t
    overflow::gradacc_overflow_t
    tensor_stats::UInt32
end

"One tensor of an accumulator: element count and the dtype its gradients arrive in."
struct gradacc_tensor_desc_t
    numel::UInt64
    dtype::gradacc_dtype_t
end

"Kind of device an object is bound to."
const gradacc_device_kind_t = Int32

"The device an object is bound to."
struct gradacc_device_t
    kind::gradacc_device_kind_t
    ordinal::Int32
    stream::Ptr{Cvoid}
end

"One gradient with what it holds: `numel` values of `dtype` at `data` (a host address for a CPU accumulator, a device address for a CUDA one)."
struct gradacc_grad_t
    data::Ptr{Cvoid}
    numel::UInt64
    dtype::gradacc_dtype_t
end

"Where a window first went non-finite (gradacc_sync_info_t's `overflow_at`)."
const gradacc_overflow_at_t = Int32

"What the boundary reports; identical on every rank."
struct gradacc_sync_info_t
    struct_size::Csize_t
    found_inf::Bool
    total_count::UInt64
    microbatches::UInt64
    grad_norm::Cdouble
    clip_coef::Cdouble
    dropped_microbatches::UInt64
    overflow_at::gradacc_overflow_at_t
    overflow_rank::UInt64
    overflow_microbatch::UInt64
    overflow_tensor::UInt64
end

"A backend gradacc may be built with: a communicator transport or a device kind."
const gradacc_backend_t = Int32

"MPI communicator options."
struct gradacc_mpi_config_t
    struct_size::Csize_t
    shared_memory::UInt32
end

"An NCCL unique id: rank 0 makes it with gradacc_nccl_unique_id and sends its bytes to every rank (MPI_Bcast, a file, a TCP store) before they call gradacc_comm_create_nccl."
struct gradacc_nccl_unique_id_t
    internal::NTuple{128, UInt8}
end

"A message's level, or the least severe level a callback receives."
const gradacc_log_level_t = Int32

"A log callback: `message` (NUL-terminated, valid only during the call) at `level`, with the `user` pointer given to gradacc_set_log_callback."
const gradacc_log_fn = Ptr{Cvoid}

"A tensor whose values several model-parallel ranks hold alike (a layer norm replicated over tensor-parallel ranks, a tied embedding on the first and the last pipeline stage): it enters the global norm once, from one copy."
struct gradacc_replicated_t
    tensor::UInt32
    copies::UInt32
    key::UInt64
end

"One accumulator of a mesh step and the group it reduces over."
struct gradacc_mesh_part_t
    struct_size::Csize_t
    accumulator::Ptr{gradacc_accumulator_t}
    comm::Ptr{gradacc_comm_t}
    replicas::Ptr{gradacc_comm_t}
    replicated::Ptr{gradacc_replicated_t}
    replicated_count::Csize_t
end

"An optimizer's update rule."
const gradacc_optimizer_algorithm_t = Int32

"How the FP32 master weights become the model's 16-bit weights."
const gradacc_rounding_t = Int32

"How the FP32 master weights are kept between steps."
const gradacc_masters_t = Int32

"How AdamW's moments (SGD's momentum buffer) are kept between steps."
const gradacc_moments_t = Int32

"What the step writes for a tensor's weights (docs/optimizer.md, \"FP8 weights on the all-gather\")."
const gradacc_weight_format_t = Int32

"Optimizer configuration."
struct gradacc_optimizer_config_t
    struct_size::Csize_t
    algorithm::gradacc_optimizer_algorithm_t
    lr::Cfloat
    beta1::Cfloat
    beta2::Cfloat
    eps::Cfloat
    weight_decay::Cfloat
    momentum::Cfloat
    dampening::Cfloat
    nesterov::Bool
    rounding::gradacc_rounding_t
    seed::UInt64
    masters::gradacc_masters_t
    moments::gradacc_moments_t
    moment_seed::UInt64
    weight_formats::Ptr{gradacc_weight_format_t}
end

"One tensor's options (PyTorch's parameter groups, per tensor)."
struct gradacc_tensor_group_t
    weight_decay::Bool
    lr_scale::Cfloat
end

"Scaler configuration."
struct gradacc_scaler_config_t
    struct_size::Csize_t
    init_scale::Cfloat
    growth_factor::Cfloat
    backoff_factor::Cfloat
    growth_interval::UInt32
    hysteresis::UInt32
    consecutive_hysteresis::Bool
    min_scale::Cfloat
    max_scale::Cfloat
    dynamic::Bool
end

"Statistics of a scaler since creation or since its state was loaded."
struct gradacc_scaler_stats_t
    struct_size::Csize_t
    steps::UInt64
    skipped_steps::UInt64
    growths::UInt64
    backoffs::UInt64
end

"Fills `*out` with the default accumulator configuration (and its struct_size)."
function gradacc_accumulator_config_default(out)
    ccall((:gradacc_accumulator_config_default, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_config_t},), out)
end

"Creates an accumulator over `n` tensors, owning a zero-initialised FP32 master buffer laid out tensor after tensor, each tensor starting at a multiple of GRADACC_MASTER_ALIGN bytes (the buffer's start included), with zeros between."
function gradacc_accumulator_create(config, tensors, n, device, out)
    ccall((:gradacc_accumulator_create, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_config_t}, Ptr{gradacc_tensor_desc_t}, Csize_t, Ptr{gradacc_device_t}, Ptr{Ptr{gradacc_accumulator_t}}), config, tensors, n, device, out)
end

"Like gradacc_accumulator_create, but adopts the caller's FP32 buffer `master` of exactly `master_numel` elements as the master buffer, e.g. a framework's own contiguous gradient buffer: the tensors with the padding that starts each at a multiple of GRADACC_MASTER_ALIGN bytes (gradacc_accumulator_master_numel gives the count; tensor i starts at gradacc_accumulator_offset)."
function gradacc_accumulator_create_with_buffer(config, tensors, n, device, master, master_numel, out)
    ccall((:gradacc_accumulator_create_with_buffer, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_config_t}, Ptr{gradacc_tensor_desc_t}, Csize_t, Ptr{gradacc_device_t}, Ptr{Cfloat}, Csize_t, Ptr{Ptr{gradacc_accumulator_t}}), config, tensors, n, device, master, master_numel, out)
end

"Creates a sharded accumulation (GRADACC_SHARDING_ACCUMULATE, whose contract is in docs/sharding.md, \"Sharded accumulation (ZeRO-2)\")."
function gradacc_accumulator_create_sharded(config, tensors, n, device, comm, out)
    ccall((:gradacc_accumulator_create_sharded, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_config_t}, Ptr{gradacc_tensor_desc_t}, Csize_t, Ptr{gradacc_device_t}, Ptr{gradacc_comm_t}, Ptr{Ptr{gradacc_accumulator_t}}), config, tensors, n, device, comm, out)
end

"Destroys an accumulator."
function gradacc_accumulator_destroy(acc)
    ccall((:gradacc_accumulator_destroy, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t},), acc)
end

"Adds one micro-batch of `count` items (a window holds at most 2^47 items per rank, so sums over ranks stay exact): `grads[i]` is tensor i's gradient (numel and dtype as declared), produced from a loss scaled by `scaler`'s current scale."
function gradacc_accumulator_add(acc, scaler, grads, n, count)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_accumulator_add)
    c_acc = Base.cconvert(Ptr{gradacc_accumulator_t}, acc)
    c_scaler = Base.cconvert(Ptr{gradacc_scaler_t}, scaler)
    c_grads = Base.cconvert(Ptr{Ptr{Cvoid}}, grads)
    c_n = Base.cconvert(Csize_t, n)
    c_count = Base.cconvert(UInt64, count)
    GC.@preserve c_acc c_scaler c_grads c_n c_count begin
        p_acc = Base.unsafe_convert(Ptr{gradacc_accumulator_t}, c_acc)
        p_scaler = Base.unsafe_convert(Ptr{gradacc_scaler_t}, c_scaler)
        p_grads = Base.unsafe_convert(Ptr{Ptr{Cvoid}}, c_grads)
        p_n = Base.unsafe_convert(Csize_t, c_n)
        p_count = Base.unsafe_convert(UInt64, c_count)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{gradacc_scaler_t}, Ptr{Ptr{Cvoid}}, Csize_t, UInt64), p_acc, p_scaler, p_grads, p_n, p_count)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"gradacc_accumulator_add of the window's last micro-batch, which the boundary follows: on the CPU, where the boundary only measures the sum (with clipping, or GRADACC_NORMALIZE_NONE), the add also sums the norm's blocks of the master while each piece is in cache, so that a boundary that reduces nothing between ranks (no communicator, or a group of one) needs no read of its own: the report, the gradient and every step's bits are gradacc_accumulator_add's."
function gradacc_accumulator_add_final(acc, scaler, grads, n, count)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_accumulator_add_final)
    c_acc = Base.cconvert(Ptr{gradacc_accumulator_t}, acc)
    c_scaler = Base.cconvert(Ptr{gradacc_scaler_t}, scaler)
    c_grads = Base.cconvert(Ptr{Ptr{Cvoid}}, grads)
    c_n = Base.cconvert(Csize_t, n)
    c_count = Base.cconvert(UInt64, count)
    GC.@preserve c_acc c_scaler c_grads c_n c_count begin
        p_acc = Base.unsafe_convert(Ptr{gradacc_accumulator_t}, c_acc)
        p_scaler = Base.unsafe_convert(Ptr{gradacc_scaler_t}, c_scaler)
        p_grads = Base.unsafe_convert(Ptr{Ptr{Cvoid}}, c_grads)
        p_n = Base.unsafe_convert(Csize_t, c_n)
        p_count = Base.unsafe_convert(UInt64, c_count)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{gradacc_scaler_t}, Ptr{Ptr{Cvoid}}, Csize_t, UInt64), p_acc, p_scaler, p_grads, p_n, p_count)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"gradacc_accumulator_add with each gradient's element type and length: `grads[i]` must hold exactly tensor i's declared numel values of its declared dtype, else the call fails, adding nothing, with GRADACC_STATUS_DTYPE_MISMATCH (another dtype) or GRADACC_STATUS_SIZE_MISMATCH (another numel), naming the tensor and both values."
function gradacc_accumulator_add_grads(acc, scaler, grads, n, count)
    ccall((:gradacc_accumulator_add_grads, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{gradacc_scaler_t}, Ptr{gradacc_grad_t}, Csize_t, UInt64), acc, scaler, grads, n, count)
end

"Opens a micro-batch of `count` items whose gradients arrive tensor by tensor through gradacc_accumulator_add_tensor (as a framework's backward hooks produce them)."
function gradacc_accumulator_begin_microbatch(acc, count)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_accumulator_begin_microbatch)
    c_acc = Base.cconvert(Ptr{gradacc_accumulator_t}, acc)
    c_count = Base.cconvert(UInt64, count)
    GC.@preserve c_acc c_count begin
        p_acc = Base.unsafe_convert(Ptr{gradacc_accumulator_t}, c_acc)
        p_count = Base.unsafe_convert(UInt64, c_count)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_accumulator_t}, UInt64), p_acc, p_count)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Opens the window's last micro-batch of `count` items, arriving tensor by tensor, and names the communicator its boundary will use: on CUDA with NCCL, each bucket's all-reduce starts on a communication stream as soon as every tensor of the bucket has arrived (one contribution each; buckets start in reverse tensor order, as backward produces them), overlapping the rest of the backward pass. gradacc_accumulator_sync with the same `comm` completes the boundary."
function gradacc_accumulator_begin_final_microbatch(acc, count, comm)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_accumulator_begin_final_microbatch)
    c_acc = Base.cconvert(Ptr{gradacc_accumulator_t}, acc)
    c_count = Base.cconvert(UInt64, count)
    c_comm = Base.cconvert(Ptr{gradacc_comm_t}, comm)
    GC.@preserve c_acc c_count c_comm begin
        p_acc = Base.unsafe_convert(Ptr{gradacc_accumulator_t}, c_acc)
        p_count = Base.unsafe_convert(UInt64, c_count)
        p_comm = Base.unsafe_convert(Ptr{gradacc_comm_t}, c_comm)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_accumulator_t}, UInt64, Ptr{gradacc_comm_t}), p_acc, p_count, p_comm)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Adds one contribution to tensor `index` of the open micro-batch: `numel` elements of the tensor's declared dtype at `grad`."
function gradacc_accumulator_add_tensor(acc, scaler, index, grad, numel)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_accumulator_add_tensor)
    c_acc = Base.cconvert(Ptr{gradacc_accumulator_t}, acc)
    c_scaler = Base.cconvert(Ptr{gradacc_scaler_t}, scaler)
    c_index = Base.cconvert(Csize_t, index)
    c_grad = Base.cconvert(Ptr{Cvoid}, grad)
    c_numel = Base.cconvert(Csize_t, numel)
    GC.@preserve c_acc c_scaler c_index c_grad c_numel begin
        p_acc = Base.unsafe_convert(Ptr{gradacc_accumulator_t}, c_acc)
        p_scaler = Base.unsafe_convert(Ptr{gradacc_scaler_t}, c_scaler)
        p_index = Base.unsafe_convert(Csize_t, c_index)
        p_grad = Base.unsafe_convert(Ptr{Cvoid}, c_grad)
        p_numel = Base.unsafe_convert(Csize_t, c_numel)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{gradacc_scaler_t}, Csize_t, Ptr{Cvoid}, Csize_t), p_acc, p_scaler, p_index, p_grad, p_numel)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"gradacc_accumulator_add_tensor with the gradient's element type and length: `grad` must hold exactly tensor `index`'s declared numel values of its declared dtype, else the call fails, adding nothing, with GRADACC_STATUS_DTYPE_MISMATCH or GRADACC_STATUS_SIZE_MISMATCH, naming the tensor and both values."
function gradacc_accumulator_add_tensor_grad(acc, scaler, index, grad)
    ccall((:gradacc_accumulator_add_tensor_grad, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{gradacc_scaler_t}, Csize_t, Ptr{gradacc_grad_t}), acc, scaler, index, grad)
end

"Closes the open micro-batch."
function gradacc_accumulator_end_microbatch(acc)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_accumulator_end_microbatch)
    c_acc = Base.cconvert(Ptr{gradacc_accumulator_t}, acc)
    GC.@preserve c_acc begin
        p_acc = Base.unsafe_convert(Ptr{gradacc_accumulator_t}, c_acc)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_accumulator_t},), p_acc)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"The accumulation boundary; every rank of `comm`'s group calls it (`comm` NULL: one process)."
function gradacc_accumulator_sync(acc, comm, out_info)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_accumulator_sync)
    c_acc = Base.cconvert(Ptr{gradacc_accumulator_t}, acc)
    c_comm = Base.cconvert(Ptr{gradacc_comm_t}, comm)
    c_out_info = Base.cconvert(Ptr{gradacc_sync_info_t}, out_info)
    GC.@preserve c_acc c_comm c_out_info begin
        p_acc = Base.unsafe_convert(Ptr{gradacc_accumulator_t}, c_acc)
        p_comm = Base.unsafe_convert(Ptr{gradacc_comm_t}, c_comm)
        p_out_info = Base.unsafe_convert(Ptr{gradacc_sync_info_t}, c_out_info)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{gradacc_comm_t}, Ptr{gradacc_sync_info_t}), p_acc, p_comm, p_out_info)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"gradacc_accumulator_sync for an optimizer that steps right after (gradacc_optimizer_step): with clipping, the gradient in memory stays the sum before normalisation and clipping, whose one factor the step applies inside its own pass, bitwise as after gradacc_accumulator_sync, and the boundary saves a pass over the gradient."
function gradacc_accumulator_sync_for_step(acc, comm, out_info)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_accumulator_sync_for_step)
    c_acc = Base.cconvert(Ptr{gradacc_accumulator_t}, acc)
    c_comm = Base.cconvert(Ptr{gradacc_comm_t}, comm)
    c_out_info = Base.cconvert(Ptr{gradacc_sync_info_t}, out_info)
    GC.@preserve c_acc c_comm c_out_info begin
        p_acc = Base.unsafe_convert(Ptr{gradacc_accumulator_t}, c_acc)
        p_comm = Base.unsafe_convert(Ptr{gradacc_comm_t}, c_comm)
        p_out_info = Base.unsafe_convert(Ptr{gradacc_sync_info_t}, c_out_info)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{gradacc_comm_t}, Ptr{gradacc_sync_info_t}), p_acc, p_comm, p_out_info)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"The hybrid boundary (HSDP) of an accumulator created with GRADACC_SHARDING_REDUCE_SCATTER or GRADACC_SHARDING_ACCUMULATE: the master is reduce-scattered over `shard_comm` (its shard group: shard_count ranks, this one rank shard_rank; for ACCUMULATE, the communicator it was created with, which reduced every micro-batch already), and each shard is then all-reduced over `replica_comm`, the ranks holding the same shard in the other shard groups (rank a*shard_count + i is shard i of shard group a and replica a of replica group i, say)."
function gradacc_accumulator_sync_hybrid(acc, shard_comm, replica_comm, out_info)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_accumulator_sync_hybrid)
    c_acc = Base.cconvert(Ptr{gradacc_accumulator_t}, acc)
    c_shard_comm = Base.cconvert(Ptr{gradacc_comm_t}, shard_comm)
    c_replica_comm = Base.cconvert(Ptr{gradacc_comm_t}, replica_comm)
    c_out_info = Base.cconvert(Ptr{gradacc_sync_info_t}, out_info)
    GC.@preserve c_acc c_shard_comm c_replica_comm c_out_info begin
        p_acc = Base.unsafe_convert(Ptr{gradacc_accumulator_t}, c_acc)
        p_shard_comm = Base.unsafe_convert(Ptr{gradacc_comm_t}, c_shard_comm)
        p_replica_comm = Base.unsafe_convert(Ptr{gradacc_comm_t}, c_replica_comm)
        p_out_info = Base.unsafe_convert(Ptr{gradacc_sync_info_t}, c_out_info)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{gradacc_comm_t}, Ptr{gradacc_comm_t}, Ptr{gradacc_sync_info_t}), p_acc, p_shard_comm, p_replica_comm, p_out_info)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Writes a pointer to tensor `index`'s FP32 master gradient and its element count (a device address on CUDA, whose contents are ready in the accumulator's stream order)."
function gradacc_accumulator_master(acc, index, out_data, out_numel)
    ccall((:gradacc_accumulator_master, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Csize_t, Ptr{Ptr{Cfloat}}, Ptr{Csize_t}), acc, index, out_data, out_numel)
end

"This rank's shard of the master: `*out_offset` and `*out_numel` give its element range in the flat layout (tensor after tensor, each at gradacc_accumulator_offset, zeros between), `*out_data` the address of its first element (a device address on CUDA)."
function gradacc_accumulator_shard(acc, out_offset, out_numel, out_data)
    ccall((:gradacc_accumulator_shard, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{Csize_t}, Ptr{Csize_t}, Ptr{Ptr{Cfloat}}), acc, out_offset, out_numel, out_data)
end

"Each tensor's telemetry of the last boundary, the same on every rank (`config`.tensor_stats = 1): into `grad_norms[i]` the L2 norm of tensor i's reduced, normalised gradient before clipping, into `nonfinite_microbatches[i]` the micro-batches over every rank in which it held a non-finite value (docs/overflow.md)."
function gradacc_accumulator_tensor_stats(acc, grad_norms, nonfinite_microbatches, n)
    ccall((:gradacc_accumulator_tensor_stats, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{Cdouble}, Ptr{UInt64}, Csize_t), acc, grad_norms, nonfinite_microbatches, n)
end

"Writes to `*out_numel` the length, in f32 elements, of the flat master of an accumulator over the `n` tensors `tensors`: each tensor starts at a multiple of GRADACC_MASTER_ALIGN bytes, with zeros between and after the last."
function gradacc_accumulator_master_numel(tensors, n, out_numel)
    ccall((:gradacc_accumulator_master_numel, libgradacc()), gradacc_status_t, (Ptr{gradacc_tensor_desc_t}, Csize_t, Ptr{Csize_t}), tensors, n, out_numel)
end

"Writes to `*out_offset` where tensor `index` starts in the flat master, in elements: a multiple of GRADACC_MASTER_ALIGN / 4."
function gradacc_accumulator_offset(acc, index, out_offset)
    ccall((:gradacc_accumulator_offset, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Csize_t, Ptr{Csize_t}), acc, index, out_offset)
end

"Writes the number of tensors to `*out`."
function gradacc_accumulator_num_tensors(acc, out)
    ccall((:gradacc_accumulator_num_tensors, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{Csize_t}), acc, out)
end

"Writes tensor `index`'s descriptor (element count and dtype) to `*out`, so a caller that did not create the accumulator can still size its buffers."
function gradacc_accumulator_tensor(acc, index, out)
    ccall((:gradacc_accumulator_tensor, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Csize_t, Ptr{gradacc_tensor_desc_t}), acc, index, out)
end

"Discards the window in progress (or the synced result); the next micro-batch starts a new one."
function gradacc_accumulator_reset(acc)
    ccall((:gradacc_accumulator_reset, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t},), acc)
end

"Saves the window in progress (masters, counts, micro-batches, overflow flag) as versioned bytes, for a checkpoint in the middle of accumulation."
function gradacc_accumulator_save_window(acc, buf, capacity, out_len)
    ccall((:gradacc_accumulator_save_window, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{UInt8}, Csize_t, Ptr{Csize_t}), acc, buf, capacity, out_len)
end

"Restores a window written by gradacc_accumulator_save_window from an accumulator with the same tensors, saved on any device."
function gradacc_accumulator_load_window(acc, bytes, len)
    ccall((:gradacc_accumulator_load_window, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{UInt8}, Csize_t), acc, bytes, len)
end

"Adds a window written by gradacc_accumulator_save_window (of an accumulator with the same tensors, on any device or rank) into `acc`'s current window: masters add, item counts and micro-batches add, overflow flags OR."
function gradacc_accumulator_merge_window(acc, bytes, len)
    ccall((:gradacc_accumulator_merge_window, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{UInt8}, Csize_t), acc, bytes, len)
end

"Creates an in-process group of `world_size` ranks (1 to 4096; one per thread, e.g. one replica per socket or per device) and writes its handles, rank 0 first, to `out_comms[0..world_size]`."
function gradacc_comm_create_local(world_size, out_comms)
    ccall((:gradacc_comm_create_local, libgradacc()), gradacc_status_t, (Int32, Ptr{Ptr{gradacc_comm_t}}), world_size, out_comms)
end

"Destroys a communicator handle."
function gradacc_comm_destroy(comm)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_comm_destroy)
    c_comm = Base.cconvert(Ptr{gradacc_comm_t}, comm)
    GC.@preserve c_comm begin
        p_comm = Base.unsafe_convert(Ptr{gradacc_comm_t}, c_comm)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_comm_t},), p_comm)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Writes this handle's rank (0-based) to `*out`."
function gradacc_comm_rank(comm, out)
    ccall((:gradacc_comm_rank, libgradacc()), gradacc_status_t, (Ptr{gradacc_comm_t}, Ptr{Int32}), comm, out)
end

"Writes the group's number of ranks to `*out`."
function gradacc_comm_world_size(comm, out)
    ccall((:gradacc_comm_world_size, libgradacc()), gradacc_status_t, (Ptr{gradacc_comm_t}, Ptr{Int32}), comm, out)
end

"Writes to `*out` whether `backend` (GRADACC_BACKEND_*) can be used: MPI when the library was built with it; CUDA and NCCL when their libraries load on this machine (checked without ever failing: a machine with no driver just answers false)."
function gradacc_backend_available(backend, out)
    ccall((:gradacc_backend_available, libgradacc()), gradacc_status_t, (gradacc_backend_t, Ptr{Bool}), backend, out)
end

"Fills `*out` with the default MPI communicator options (and their struct_size)."
function gradacc_mpi_config_default(out)
    ccall((:gradacc_mpi_config_default, libgradacc()), gradacc_status_t, (Ptr{gradacc_mpi_config_t},), out)
end

"Creates this process's rank of an MPI communicator: MPI_COMM_WORLD when `fortran_comm` is GRADACC_MPI_COMM_WORLD (-1), otherwise the caller's communicator given by its Fortran handle: `MPI_Comm_c2f(comm)` in C, `comm.py2f()` in mpi4py, `MPI.API.MPI_Comm_c2f(comm.val)` in MPI.jl (`comm.val` alone is MPI.jl's C handle, not this one)."
function gradacc_comm_create_mpi(fortran_comm, config, out_comm)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_comm_create_mpi)
    c_fortran_comm = Base.cconvert(Int64, fortran_comm)
    c_config = Base.cconvert(Ptr{gradacc_mpi_config_t}, config)
    c_out_comm = Base.cconvert(Ptr{Ptr{gradacc_comm_t}}, out_comm)
    GC.@preserve c_fortran_comm c_config c_out_comm begin
        p_fortran_comm = Base.unsafe_convert(Int64, c_fortran_comm)
        p_config = Base.unsafe_convert(Ptr{gradacc_mpi_config_t}, c_config)
        p_out_comm = Base.unsafe_convert(Ptr{Ptr{gradacc_comm_t}}, c_out_comm)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Int64, Ptr{gradacc_mpi_config_t}, Ptr{Ptr{gradacc_comm_t}}), p_fortran_comm, p_config, p_out_comm)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Writes a new NCCL unique id to `*out` (rank 0 calls it, then shares the bytes)."
function gradacc_nccl_unique_id(out)
    ccall((:gradacc_nccl_unique_id, libgradacc()), gradacc_status_t, (Ptr{gradacc_nccl_unique_id_t},), out)
end

"Creates rank `rank` of `world_size` of the NCCL group named by `id`, on CUDA device `device_ordinal` (one rank per GPU)."
function gradacc_comm_create_nccl(id, rank, world_size, device_ordinal, out_comm)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_comm_create_nccl)
    c_id = Base.cconvert(Ptr{gradacc_nccl_unique_id_t}, id)
    c_rank = Base.cconvert(Int32, rank)
    c_world_size = Base.cconvert(Int32, world_size)
    c_device_ordinal = Base.cconvert(Int32, device_ordinal)
    c_out_comm = Base.cconvert(Ptr{Ptr{gradacc_comm_t}}, out_comm)
    GC.@preserve c_id c_rank c_world_size c_device_ordinal c_out_comm begin
        p_id = Base.unsafe_convert(Ptr{gradacc_nccl_unique_id_t}, c_id)
        p_rank = Base.unsafe_convert(Int32, c_rank)
        p_world_size = Base.unsafe_convert(Int32, c_world_size)
        p_device_ordinal = Base.unsafe_convert(Int32, c_device_ordinal)
        p_out_comm = Base.unsafe_convert(Ptr{Ptr{gradacc_comm_t}}, c_out_comm)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_nccl_unique_id_t}, Int32, Int32, Int32, Ptr{Ptr{gradacc_comm_t}}), p_id, p_rank, p_world_size, p_device_ordinal, p_out_comm)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Wraps the caller's `ncclComm_t` (passed as `void*`); its rank, size and device are read from it. gradacc never destroys or aborts an adopted communicator."
function gradacc_comm_adopt_nccl(nccl_comm, out_comm)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_comm_adopt_nccl)
    c_nccl_comm = Base.cconvert(Ptr{Cvoid}, nccl_comm)
    c_out_comm = Base.cconvert(Ptr{Ptr{gradacc_comm_t}}, out_comm)
    GC.@preserve c_nccl_comm c_out_comm begin
        p_nccl_comm = Base.unsafe_convert(Ptr{Cvoid}, c_nccl_comm)
        p_out_comm = Base.unsafe_convert(Ptr{Ptr{gradacc_comm_t}}, c_out_comm)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{Cvoid}, Ptr{Ptr{gradacc_comm_t}}), p_nccl_comm, p_out_comm)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Creates this rank's communicator of a split of `comm`: the ranks that pass the same `color` form a group, ranked by `key` (ties by their rank in `comm`), on the same transport with the same options: MPI_Comm_split for an MPI communicator, ncclCommSplit for an NCCL one (NCCL 2.18 or newer; before, GRADACC_STATUS_BACKEND_UNAVAILABLE)."
function gradacc_comm_split(comm, color, key, out_comm)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_comm_split)
    c_comm = Base.cconvert(Ptr{gradacc_comm_t}, comm)
    c_color = Base.cconvert(UInt32, color)
    c_key = Base.cconvert(UInt32, key)
    c_out_comm = Base.cconvert(Ptr{Ptr{gradacc_comm_t}}, out_comm)
    GC.@preserve c_comm c_color c_key c_out_comm begin
        p_comm = Base.unsafe_convert(Ptr{gradacc_comm_t}, c_comm)
        p_color = Base.unsafe_convert(UInt32, c_color)
        p_key = Base.unsafe_convert(UInt32, c_key)
        p_out_comm = Base.unsafe_convert(Ptr{Ptr{gradacc_comm_t}}, c_out_comm)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_comm_t}, UInt32, UInt32, Ptr{Ptr{gradacc_comm_t}}), p_comm, p_color, p_key, p_out_comm)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Sets how long a collective on `comm` may wait for the other ranks: after `seconds` it fails with GRADACC_STATUS_TIMEOUT, naming the phase and the wait, and aborts the communicator. 0 waits forever; the default is 600 (10 minutes)."
function gradacc_comm_set_timeout(comm, seconds)
    ccall((:gradacc_comm_set_timeout, libgradacc()), gradacc_status_t, (Ptr{gradacc_comm_t}, Cdouble), comm, seconds)
end

"Writes `comm`'s timeout in seconds to `*out` (0: it waits forever)."
function gradacc_comm_timeout(comm, out)
    ccall((:gradacc_comm_timeout, libgradacc()), gradacc_status_t, (Ptr{gradacc_comm_t}, Ptr{Cdouble}), comm, out)
end

"Aborts this rank's communicator, of any backend: a sync waiting in it on any thread, and every later one, fails with GRADACC_STATUS_COMM_FAILURE (use it when a peer died)."
function gradacc_comm_abort(comm)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_comm_abort)
    c_comm = Base.cconvert(Ptr{gradacc_comm_t}, comm)
    GC.@preserve c_comm begin
        p_comm = Base.unsafe_convert(Ptr{gradacc_comm_t}, c_comm)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_comm_t},), p_comm)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Converts the `n` f32 values at `src` to IEEE binary16 bits at `dst`, rounding to nearest even: a value past the largest finite f16 (65504) rounds to infinity from 65520 up, a value below the smallest subnormal (2^-24) to a signed zero from 2^-25 down; a NaN stays NaN, quiet, with the upper bits of its payload."
function gradacc_f32_to_f16(src, dst, n)
    ccall((:gradacc_f32_to_f16, libgradacc()), gradacc_status_t, (Ptr{Cfloat}, Ptr{UInt16}, Csize_t), src, dst, n)
end

"Converts the `n` IEEE binary16 bit patterns at `src` to f32 values at `dst`, exactly (every f16 value is an f32 value, subnormals included); a NaN stays NaN with its payload, and a signalling one comes back quiet, as F16C's conversion gives it (the same bits without F16C)."
function gradacc_f16_to_f32(src, dst, n)
    ccall((:gradacc_f16_to_f32, libgradacc()), gradacc_status_t, (Ptr{UInt16}, Ptr{Cfloat}, Csize_t), src, dst, n)
end

"Converts the `n` f32 values at `src` to bfloat16 bits at `dst`, rounding to nearest even (a value past the largest finite bf16 rounds to infinity); a NaN stays NaN, quiet, with the upper bits of its payload."
function gradacc_f32_to_bf16(src, dst, n)
    ccall((:gradacc_f32_to_bf16, libgradacc()), gradacc_status_t, (Ptr{Cfloat}, Ptr{UInt16}, Csize_t), src, dst, n)
end

"Converts the `n` bfloat16 bit patterns at `src` to f32 values at `dst`, exactly: each pattern becomes the upper half of an f32, a NaN's payload as it is (a signalling one stays signalling), as gradacc reads a bf16 gradient."
function gradacc_bf16_to_f32(src, dst, n)
    ccall((:gradacc_bf16_to_f32, libgradacc()), gradacc_status_t, (Ptr{UInt16}, Ptr{Cfloat}, Csize_t), src, dst, n)
end

"Sends the library's messages at `level` and more severe ones (GRADACC_LOG_WARN: warnings and errors) to `callback`, with `user` passed back unchanged; NULL `callback` (or GRADACC_LOG_OFF) turns them off, back to the default: nothing, or stderr at the level the environment variable `GRADACC_LOG` names (error, warn, info, debug)."
function gradacc_set_log_callback(callback, user, level)
    ccall((:gradacc_set_log_callback, libgradacc()), gradacc_status_t, (gradacc_log_fn, Ptr{Cvoid}, gradacc_log_level_t), callback, user, level)
end

"Writes the diagnostic report into `buf`, NUL-terminated, as snprintf does: the library's version and file, the host and its SIMD path, each backend available or why not, the CUDA driver, NVRTC and NCCL found (version and file) or why not, and every environment variable the library reads."
function gradacc_diagnostics(buf, size, needed)
    ccall((:gradacc_diagnostics, libgradacc()), gradacc_status_t, (Ptr{Cchar}, Csize_t, Ptr{Csize_t}), buf, size, needed)
end

"Creates a mesh over `world`, a host communicator (in-process or MPI) of every rank of the job, where this rank is data-parallel rank `data_rank` of `data_size`: the ranks that see different data (data-parallel x context-parallel)."
function gradacc_mesh_create(world, data_rank, data_size, max_grad_norm, out_mesh)
    ccall((:gradacc_mesh_create, libgradacc()), gradacc_status_t, (Ptr{gradacc_comm_t}, UInt32, UInt32, Cfloat, Ptr{Ptr{gradacc_mesh_t}}), world, data_rank, data_size, max_grad_norm, out_mesh)
end

"Destroys a mesh."
function gradacc_mesh_destroy(mesh)
    ccall((:gradacc_mesh_destroy, libgradacc()), gradacc_status_t, (Ptr{gradacc_mesh_t},), mesh)
end

"Creates the shape of a mesh of `world_size` ranks: `tp`, `pp` and `cp` ranks on the tensor-, pipeline- and context-parallel axes (data parallel takes the rest), and the experts of each pipeline stage over `ep` x `etp` of its ranks (expert data parallel takes the rest of the stage), as Megatron-Core's parallel state makes them."
function gradacc_mesh_shape_create(world_size, tp, pp, cp, ep, etp, order, out_shape)
    ccall((:gradacc_mesh_shape_create, libgradacc()), gradacc_status_t, (UInt32, UInt32, UInt32, UInt32, UInt32, UInt32, Ptr{Cchar}, Ptr{Ptr{gradacc_mesh_shape_t}}), world_size, tp, pp, cp, ep, etp, order, out_shape)
end

"Destroys a mesh shape."
function gradacc_mesh_shape_destroy(shape)
    ccall((:gradacc_mesh_shape_destroy, libgradacc()), gradacc_status_t, (Ptr{gradacc_mesh_shape_t},), shape)
end

"Where world rank `rank` sits in its group over `axes`: the axes' names joined by '-', all of the dense view (tp, cp, dp, pp) or all of the expert one (etp, ep, edp, pp)."
function gradacc_mesh_shape_group(shape, rank, axes, color_out, key_out, size_out)
    ccall((:gradacc_mesh_shape_group, libgradacc()), gradacc_status_t, (Ptr{gradacc_mesh_shape_t}, UInt32, Ptr{Cchar}, Ptr{UInt32}, Ptr{UInt32}, Ptr{UInt32}), shape, rank, axes, color_out, key_out, size_out)
end

"This rank's group over `axes` (as gradacc_mesh_shape_group), split from `world`: an MPI or NCCL communicator of every rank of the mesh, whose ranks are the world ranks (see gradacc_comm_split)."
function gradacc_mesh_shape_split(shape, world, axes, out_comm)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_mesh_shape_split)
    c_shape = Base.cconvert(Ptr{gradacc_mesh_shape_t}, shape)
    c_world = Base.cconvert(Ptr{gradacc_comm_t}, world)
    c_axes = Base.cconvert(Ptr{Cchar}, axes)
    c_out_comm = Base.cconvert(Ptr{Ptr{gradacc_comm_t}}, out_comm)
    GC.@preserve c_shape c_world c_axes c_out_comm begin
        p_shape = Base.unsafe_convert(Ptr{gradacc_mesh_shape_t}, c_shape)
        p_world = Base.unsafe_convert(Ptr{gradacc_comm_t}, c_world)
        p_axes = Base.unsafe_convert(Ptr{Cchar}, c_axes)
        p_out_comm = Base.unsafe_convert(Ptr{Ptr{gradacc_comm_t}}, c_out_comm)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_mesh_shape_t}, Ptr{gradacc_comm_t}, Ptr{Cchar}, Ptr{Ptr{gradacc_comm_t}}), p_shape, p_world, p_axes, p_out_comm)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"The mesh step: the boundary of every accumulator of this rank's step (`parts[0..count]`), and one agreement over the mesh's world for all."
function gradacc_mesh_sync(mesh, parts, count, info_out, overflow_part_out)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_mesh_sync)
    c_mesh = Base.cconvert(Ptr{gradacc_mesh_t}, mesh)
    c_parts = Base.cconvert(Ptr{gradacc_mesh_part_t}, parts)
    c_count = Base.cconvert(Csize_t, count)
    c_info_out = Base.cconvert(Ptr{gradacc_sync_info_t}, info_out)
    c_overflow_part_out = Base.cconvert(Ptr{UInt32}, overflow_part_out)
    GC.@preserve c_mesh c_parts c_count c_info_out c_overflow_part_out begin
        p_mesh = Base.unsafe_convert(Ptr{gradacc_mesh_t}, c_mesh)
        p_parts = Base.unsafe_convert(Ptr{gradacc_mesh_part_t}, c_parts)
        p_count = Base.unsafe_convert(Csize_t, c_count)
        p_info_out = Base.unsafe_convert(Ptr{gradacc_sync_info_t}, c_info_out)
        p_overflow_part_out = Base.unsafe_convert(Ptr{UInt32}, c_overflow_part_out)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_mesh_t}, Ptr{gradacc_mesh_part_t}, Csize_t, Ptr{gradacc_sync_info_t}, Ptr{UInt32}), p_mesh, p_parts, p_count, p_info_out, p_overflow_part_out)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Ends the open micro-batch of each of `accumulators` (`count` handles, this rank's, each under GRADACC_OVERFLOW_DROP_MICROBATCH and fed tensor by tensor since gradacc_accumulator_begin_microbatch; not sharded accumulation), agreeing its drop over the world first (one all-gather of 24 bytes per rank): if any rank at this data-parallel rank (its tensor-, pipeline- and expert-tensor-parallel peers, which computed from the same data) found a non-finite gradient in any of its accumulators, every one of them drops the micro-batch in every accumulator; the others keep theirs."
function gradacc_mesh_end_microbatch(mesh, accumulators, count, kept_out)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_mesh_end_microbatch)
    c_mesh = Base.cconvert(Ptr{gradacc_mesh_t}, mesh)
    c_accumulators = Base.cconvert(Ptr{Ptr{gradacc_accumulator_t}}, accumulators)
    c_count = Base.cconvert(Csize_t, count)
    c_kept_out = Base.cconvert(Ptr{UInt32}, kept_out)
    GC.@preserve c_mesh c_accumulators c_count c_kept_out begin
        p_mesh = Base.unsafe_convert(Ptr{gradacc_mesh_t}, c_mesh)
        p_accumulators = Base.unsafe_convert(Ptr{Ptr{gradacc_accumulator_t}}, c_accumulators)
        p_count = Base.unsafe_convert(Csize_t, c_count)
        p_kept_out = Base.unsafe_convert(Ptr{UInt32}, c_kept_out)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_mesh_t}, Ptr{Ptr{gradacc_accumulator_t}}, Csize_t, Ptr{UInt32}), p_mesh, p_accumulators, p_count, p_kept_out)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Fills `*out` with the default optimizer configuration (AdamW with PyTorch's defaults, lr 1e-3) and its struct_size."
function gradacc_optimizer_config_default(out)
    ccall((:gradacc_optimizer_config_default, libgradacc()), gradacc_status_t, (Ptr{gradacc_optimizer_config_t},), out)
end

"Creates an optimizer over `acc`'s tensors, device and sharding: its FP32 master weights (for this rank's shard under GRADACC_SHARDING_REDUCE_SCATTER or _ACCUMULATE) initialised from the model's weights `weights[i]` (pointers to each whole tensor, of `weight_dtypes[i]`, or of the tensors' gradient dtypes when `weight_dtypes` is NULL), each tensor in `groups[i]` (NULL: weight decay on, lr_scale 1)."
function gradacc_optimizer_create(acc, config, groups, weights, weight_dtypes, n, out)
    ccall((:gradacc_optimizer_create, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{gradacc_optimizer_config_t}, Ptr{gradacc_tensor_group_t}, Ptr{Ptr{Cvoid}}, Ptr{gradacc_dtype_t}, Csize_t, Ptr{Ptr{gradacc_optimizer_t}}), acc, config, groups, weights, weight_dtypes, n, out)
end

"Like gradacc_optimizer_create, but adopts the caller's FP32 master weights `masters`, of exactly `masters_numel` elements, instead of allocating them: e.g. a framework's own FP32 master weights (Apex O2, Megatron's contiguous FP32 buffer)."
function gradacc_optimizer_create_with_masters(acc, config, groups, weights, weight_dtypes, n, masters, masters_numel, out)
    ccall((:gradacc_optimizer_create_with_masters, libgradacc()), gradacc_status_t, (Ptr{gradacc_accumulator_t}, Ptr{gradacc_optimizer_config_t}, Ptr{gradacc_tensor_group_t}, Ptr{Ptr{Cvoid}}, Ptr{gradacc_dtype_t}, Csize_t, Ptr{Cfloat}, Csize_t, Ptr{Ptr{gradacc_optimizer_t}}), acc, config, groups, weights, weight_dtypes, n, masters, masters_numel, out)
end

"Destroys an optimizer."
function gradacc_optimizer_destroy(opt)
    ccall((:gradacc_optimizer_destroy, libgradacc()), gradacc_status_t, (Ptr{gradacc_optimizer_t},), opt)
end

"Sets the learning rate of the steps from the next one on (finite, >= 0)."
function gradacc_optimizer_set_lr(opt, lr)
    ccall((:gradacc_optimizer_set_lr, libgradacc()), gradacc_status_t, (Ptr{gradacc_optimizer_t}, Cfloat), opt, lr)
end

"On a CUDA accumulator, writes to `*out` the device address of the learning rate (one `float`) that every step reads when it runs on the stream."
function gradacc_optimizer_lr_device_ptr(opt, out)
    ccall((:gradacc_optimizer_lr_device_ptr, libgradacc()), gradacc_status_t, (Ptr{gradacc_optimizer_t}, Ptr{Ptr{Cvoid}}), opt, out)
end

"Writes the number of steps taken (a skipped step is not one) to `*out`."
function gradacc_optimizer_steps(opt, out)
    ccall((:gradacc_optimizer_steps, libgradacc()), gradacc_status_t, (Ptr{gradacc_optimizer_t}, Ptr{UInt64}), opt, out)
end

"The step after gradacc_accumulator_sync of `acc` (the accumulator the optimizer was made over): steps the FP32 masters and the state from the reduced gradient and writes the model's weights `weights[i]` (pointers to each whole tensor, in the dtypes given at creation), or, when the boundary found a non-finite value, changes nothing; `*out_stepped` (may be NULL) says which."
function gradacc_optimizer_step(opt, acc, weights, n, comm, out_stepped)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_optimizer_step)
    c_opt = Base.cconvert(Ptr{gradacc_optimizer_t}, opt)
    c_acc = Base.cconvert(Ptr{gradacc_accumulator_t}, acc)
    c_weights = Base.cconvert(Ptr{Ptr{Cvoid}}, weights)
    c_n = Base.cconvert(Csize_t, n)
    c_comm = Base.cconvert(Ptr{gradacc_comm_t}, comm)
    c_out_stepped = Base.cconvert(Ptr{Bool}, out_stepped)
    GC.@preserve c_opt c_acc c_weights c_n c_comm c_out_stepped begin
        p_opt = Base.unsafe_convert(Ptr{gradacc_optimizer_t}, c_opt)
        p_acc = Base.unsafe_convert(Ptr{gradacc_accumulator_t}, c_acc)
        p_weights = Base.unsafe_convert(Ptr{Ptr{Cvoid}}, c_weights)
        p_n = Base.unsafe_convert(Csize_t, c_n)
        p_comm = Base.unsafe_convert(Ptr{gradacc_comm_t}, c_comm)
        p_out_stepped = Base.unsafe_convert(Ptr{Bool}, c_out_stepped)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_optimizer_t}, Ptr{gradacc_accumulator_t}, Ptr{Ptr{Cvoid}}, Csize_t, Ptr{gradacc_comm_t}, Ptr{Bool}), p_opt, p_acc, p_weights, p_n, p_comm, p_out_stepped)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"gradacc_optimizer_step of an optimizer whose `config.weight_formats` makes some tensors FP8: for such a tensor i, `weights[i]` holds its `numel` E4M3 codes (bytes) and `scales[i]` its scales, which the step writes with the codes: one float for GRADACC_WEIGHTS_E4M3_TENSORWISE, one E8M0 byte per block of 32 elements (the last block shorter) for GRADACC_WEIGHTS_MXFP8."
function gradacc_optimizer_step_scaled(opt, acc, weights, scales, n, comm, out_stepped)
    ccall((:gradacc_optimizer_step_scaled, libgradacc()), gradacc_status_t, (Ptr{gradacc_optimizer_t}, Ptr{gradacc_accumulator_t}, Ptr{Ptr{Cvoid}}, Ptr{Ptr{Cvoid}}, Csize_t, Ptr{gradacc_comm_t}, Ptr{Bool}), opt, acc, weights, scales, n, comm, out_stepped)
end

"Writes this rank's optimizer state (versioned, checksummed) into `buf` (NULL: only reports the size) and its length to `*out_len`."
function gradacc_optimizer_save(opt, buf, capacity, out_len)
    ccall((:gradacc_optimizer_save, libgradacc()), gradacc_status_t, (Ptr{gradacc_optimizer_t}, Ptr{UInt8}, Csize_t, Ptr{Csize_t}), opt, buf, capacity, out_len)
end

"Restores the state from `n` saved parts (`parts[k]`, `lens[k]` bytes each): what gradacc_optimizer_save wrote on any number of ranks, together covering this rank's elements, so a state saved over one shard count loads over another."
function gradacc_optimizer_load(opt, parts, lens, n)
    ccall((:gradacc_optimizer_load, libgradacc()), gradacc_status_t, (Ptr{gradacc_optimizer_t}, Ptr{Ptr{UInt8}}, Ptr{Csize_t}, Csize_t), opt, parts, lens, n)
end

"Fills `*out` with the default scaler configuration (and its struct_size)."
function gradacc_scaler_config_default(out)
    ccall((:gradacc_scaler_config_default, libgradacc()), gradacc_status_t, (Ptr{gradacc_scaler_config_t},), out)
end

"Creates a scaler."
function gradacc_scaler_create(config, device, out)
    ccall((:gradacc_scaler_create, libgradacc()), gradacc_status_t, (Ptr{gradacc_scaler_config_t}, Ptr{gradacc_device_t}, Ptr{Ptr{gradacc_scaler_t}}), config, device, out)
end

"Destroys a scaler."
function gradacc_scaler_destroy(scaler)
    ccall((:gradacc_scaler_destroy, libgradacc()), gradacc_status_t, (Ptr{gradacc_scaler_t},), scaler)
end

"Reads the current loss scale into `*out`."
function gradacc_scaler_scale(scaler, out)
    ccall((:gradacc_scaler_scale, libgradacc()), gradacc_status_t, (Ptr{gradacc_scaler_t}, Ptr{Cfloat}), scaler, out)
end

"Multiplies `numel` loss values of `dtype` at `loss` in place by the current scale (16-bit values round to nearest even)."
function gradacc_scaler_scale_loss(scaler, loss, numel, dtype)
    ccall((:gradacc_scaler_scale_loss, libgradacc()), gradacc_status_t, (Ptr{gradacc_scaler_t}, Ptr{Cvoid}, Csize_t, gradacc_dtype_t), scaler, loss, numel, dtype)
end

"Ends an optimizer step: reads the agreed overflow flag of each of the `n` accumulators (each must have completed gradacc_accumulator_sync for its current window), and updates the scale once."
function gradacc_scaler_update(scaler, accumulators, n, out_skipped)
    # blocks: GC-safe call
    fptr = Libdl.dlsym(libgradacc_handle(), :gradacc_scaler_update)
    c_scaler = Base.cconvert(Ptr{gradacc_scaler_t}, scaler)
    c_accumulators = Base.cconvert(Ptr{Ptr{gradacc_accumulator_t}}, accumulators)
    c_n = Base.cconvert(Csize_t, n)
    c_out_skipped = Base.cconvert(Ptr{Bool}, out_skipped)
    GC.@preserve c_scaler c_accumulators c_n c_out_skipped begin
        p_scaler = Base.unsafe_convert(Ptr{gradacc_scaler_t}, c_scaler)
        p_accumulators = Base.unsafe_convert(Ptr{Ptr{gradacc_accumulator_t}}, c_accumulators)
        p_n = Base.unsafe_convert(Csize_t, c_n)
        p_out_skipped = Base.unsafe_convert(Ptr{Bool}, c_out_skipped)
        gc_state = ccall(:jl_gc_safe_enter, Int8, ())
        ret = ccall(fptr, gradacc_status_t, (Ptr{gradacc_scaler_t}, Ptr{Ptr{gradacc_accumulator_t}}, Csize_t, Ptr{Bool}), p_scaler, p_accumulators, p_n, p_out_skipped)
        ccall(:jl_gc_safe_leave, Cvoid, (Int8,), gc_state)
        ret
    end
end

"Writes the scaler's statistics to `*out`."
function gradacc_scaler_stats(scaler, out)
    ccall((:gradacc_scaler_stats, libgradacc()), gradacc_status_t, (Ptr{gradacc_scaler_t}, Ptr{gradacc_scaler_stats_t}), scaler, out)
end

"Saves the scaler's complete state (config, scale, trackers, statistics) as versioned bytes."
function gradacc_scaler_save(scaler, buf, capacity, out_len)
    ccall((:gradacc_scaler_save, libgradacc()), gradacc_status_t, (Ptr{gradacc_scaler_t}, Ptr{UInt8}, Csize_t, Ptr{Csize_t}), scaler, buf, capacity, out_len)
end

"Restores a state written by gradacc_scaler_save."
function gradacc_scaler_load(scaler, bytes, len)
    ccall((:gradacc_scaler_load, libgradacc()), gradacc_status_t, (Ptr{gradacc_scaler_t}, Ptr{UInt8}, Csize_t), scaler, bytes, len)
end

"A static description of a status code (never NULL; unknown codes get a generic text)."
function gradacc_status_string(status)
    ccall((:gradacc_status_string, libgradacc()), Cstring, (Int32,), status)
end

"The message of the most recent failed gradacc call on the calling thread (\"\" if none yet)."
function gradacc_last_error()
    ccall((:gradacc_last_error, libgradacc()), Cstring, ())
end

"The loaded library's version as \"MAJOR.MINOR.PATCH\" (static storage, never NULL)."
function gradacc_version_string()
    ccall((:gradacc_version_string, libgradacc()), Cstring, ())
end

"The loaded library's version as MAJOR * 10000 + MINOR * 100 + PATCH."
function gradacc_version_number()
    ccall((:gradacc_version_number, libgradacc()), UInt32, ())
end
