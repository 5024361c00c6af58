"""
    GradAcc

Julia binding of gradacc: correct mixed-precision gradient accumulation behind a stable C ABI.
`libgradacc.jl` (generated from include/gradacc.h by bindings/julia/gen_wrap.py) is the ccall
layer; this module owns the handles (`mutable struct` + `finalizer` + idempotent `close`) and
turns statuses into [`GradAccError`](@ref).

The library is the file named by `ENV["GRADACC_LIBRARY"]` when the package is loaded, otherwise
`target/release/libgradacc.so` of the repository this package sits in.
"""
module GradAcc

using Libdl

export Scaler, Accumulator, Communicator, GradAccError, local_group
export add!, add_tensor!, begin_microbatch!, end_microbatch!, sync!, master, update!, scale, reset!

const libgradacc = get(ENV, "GRADACC_LIBRARY",
                       joinpath(@__DIR__, "..", "..", "..", "..", "target", "release", "libgradacc." * Libdl.dlext))

include("libgradacc.jl")

"""
    GradAccError(status, message)

A failed gradacc call: `status` is the `GRADACC_STATUS_*` code, `message` the calling thread's
`gradacc_last_error()` (it names the function, the argument and the wrong value).
"""
struct GradAccError <: Exception
    status::Int32
    message::String
end

Base.showerror(io::IO, e::GradAccError) =
    print(io, "GradAccError: ", unsafe_string(gradacc_status_string(e.status)), ": ", e.message)

# The message is per OS thread: it is read by the next ccall, with no yield point in between, so
# the task cannot have moved to another thread.
@inline function check(status)
    status == GRADACC_STATUS_OK && return nothing
    throw(GradAccError(status, unsafe_string(gradacc_last_error())))
end

"The loaded library's version."
version() = VersionNumber(unsafe_string(gradacc_version_string()))

const DTYPES = Dict{Any,Int32}(Float32 => GRADACC_DTYPE_F32, Float16 => GRADACC_DTYPE_F16,
                               :f32 => GRADACC_DTYPE_F32, :f16 => GRADACC_DTYPE_F16, :bf16 => GRADACC_DTYPE_BF16)
const NORMALIZE = Dict(:by_count => GRADACC_NORMALIZE_BY_COUNT, :by_microbatches => GRADACC_NORMALIZE_BY_MICROBATCHES,
                       :by_world => GRADACC_NORMALIZE_BY_WORLD, :none => GRADACC_NORMALIZE_NONE)
const REDUCTION = Dict(:mean => GRADACC_LOSS_REDUCTION_MEAN, :sum => GRADACC_LOSS_REDUCTION_SUM)

# A config struct from its C default with some fields replaced (keywords; symbols for enums).
function config(::Type{T}, default_fn; kw...) where {T}
    ref = Ref{T}()
    check(default_fn(ref))
    c = ref[]
    for k in keys(kw)
        k in fieldnames(T) && k !== :struct_size || throw(ArgumentError("$T has no field $k"))
    end
    values = map(fieldnames(T)) do f
        v = haskey(kw, f) ? kw[f] : getfield(c, f)
        v = f === :normalize && v isa Symbol ? NORMALIZE[v] : v
        v = f === :loss_reduction && v isa Symbol ? REDUCTION[v] : v
        convert(fieldtype(T, f), v)
    end
    return T(values...)
end

cpu_device() = gradacc_device_t(GRADACC_DEVICE_CPU, 0, C_NULL)

# ---- communicator ----------------------------------------------------------------------------

"One rank's endpoint of a data-parallel group; see [`local_group`](@ref)."
mutable struct Communicator
    ptr::Ptr{gradacc_comm_t}
    function Communicator(ptr::Ptr{gradacc_comm_t})
        c = new(ptr)
        finalizer(close, c)
    end
end

"Destroys the handle; calling it again does nothing."
function Base.close(c::Communicator)
    ptr, c.ptr = c.ptr, C_NULL
    ptr == C_NULL || check(gradacc_comm_destroy(ptr))
    return nothing
end

handle(c::Communicator) = c.ptr == C_NULL ? throw(ArgumentError("the Communicator is closed")) : c.ptr

"""
    local_group(n) -> Vector{Communicator}

An in-process group of `n` ranks, rank 0 first. Run each rank in its own task on its own thread
(`Threads.@spawn`, Julia started with at least `n` threads); every rank takes part in every sync.
"""
function local_group(n::Integer)
    raw = Vector{Ptr{gradacc_comm_t}}(undef, n)
    check(gradacc_comm_create_local(n, raw))
    return [Communicator(p) for p in raw]
end

function rank(c::Communicator)
    out = Ref{Csize_t}(0)
    GC.@preserve c check(gradacc_comm_rank(handle(c), out))
    return Int(out[])
end

function world_size(c::Communicator)
    out = Ref{Csize_t}(0)
    GC.@preserve c check(gradacc_comm_world_size(handle(c), out))
    return Int(out[])
end

# ---- scaler ----------------------------------------------------------------------------------

"""
    Scaler(; init_scale=65536, growth_interval=2000, hysteresis=1, ...)

A dynamic loss scaler; keywords replace fields of `gradacc_scaler_config_default`.
"""
mutable struct Scaler
    ptr::Ptr{gradacc_scaler_t}
    function Scaler(; kw...)
        cfg = Ref(config(gradacc_scaler_config_t, gradacc_scaler_config_default; kw...))
        out = Ref{Ptr{gradacc_scaler_t}}(C_NULL)
        check(gradacc_scaler_create(cfg, Ref(cpu_device()), out))
        finalizer(close, new(out[]))
    end
end

"Destroys the scaler; calling it again does nothing."
function Base.close(s::Scaler)
    ptr, s.ptr = s.ptr, C_NULL
    ptr == C_NULL || check(gradacc_scaler_destroy(ptr))
    return nothing
end

handle(s::Scaler) = s.ptr == C_NULL ? throw(ArgumentError("the Scaler is closed")) : s.ptr

"The current loss scale."
function scale(s::Scaler)
    out = Ref{Cfloat}(0)
    GC.@preserve s check(gradacc_scaler_get_scale(handle(s), out))
    return out[]
end

# ---- accumulator -----------------------------------------------------------------------------

"""
    Accumulator(tensors; normalize=:by_count, loss_reduction=:mean, max_grad_norm=0, ...)

FP32 master gradients of `tensors`, a vector of `(numel, dtype)` with dtype `Float32`, `Float16`
or `:bf16` (bf16 gradients are passed as `Vector{UInt16}` words).
"""
mutable struct Accumulator
    ptr::Ptr{gradacc_accumulator_t}
    tensors::Vector{gradacc_tensor_desc_t}
    function Accumulator(tensors::AbstractVector; kw...)
        cfg = Ref(config(gradacc_accumulator_config_t, gradacc_accumulator_config_default; kw...))
        descs = [gradacc_tensor_desc_t(n, DTYPES[d]) for (n, d) in tensors]
        out = Ref{Ptr{gradacc_accumulator_t}}(C_NULL)
        check(gradacc_accumulator_create(cfg, descs, length(descs), Ref(cpu_device()), out))
        finalizer(close, new(out[], descs))
    end
end

"Destroys the accumulator (arrays from [`master`](@ref) become invalid); calling it again does nothing."
function Base.close(a::Accumulator)
    ptr, a.ptr = a.ptr, C_NULL
    ptr == C_NULL || check(gradacc_accumulator_destroy(ptr))
    return nothing
end

handle(a::Accumulator) = a.ptr == C_NULL ? throw(ArgumentError("the Accumulator is closed")) : a.ptr

# The element type a gradient array must have for a tensor of this dtype.
function check_grad(a::Accumulator, i::Integer, g::AbstractVector)
    g isa DenseVector || throw(ArgumentError("gradient $i must be a dense vector"))
    dt = a.tensors[i].dtype
    ok = dt == GRADACC_DTYPE_F32 ? eltype(g) == Float32 :
         dt == GRADACC_DTYPE_F16 ? eltype(g) in (Float16, UInt16) : eltype(g) == UInt16
    ok || throw(ArgumentError("gradient $i has element type $(eltype(g)), which does not match tensor $i's dtype"))
    return nothing
end

"""
    add!(acc, scaler, grads, count)

One micro-batch of `count` items: `grads[i]` is tensor `i`'s gradient (`Vector{Float32}`,
`Vector{Float16}`, or `Vector{UInt16}` for bf16).
"""
function add!(a::Accumulator, s::Scaler, grads::AbstractVector, count::Integer)
    length(grads) == length(a.tensors) ||
        throw(ArgumentError("$(length(grads)) gradients for $(length(a.tensors)) tensors"))
    for (i, g) in enumerate(grads)
        check_grad(a, i, g)
        length(g) == a.tensors[i].numel ||  # add takes no lengths: check before C reads past the end
            throw(DimensionMismatch("gradient $i has $(length(g)) elements, tensor $i has $(a.tensors[i].numel)"))
    end
    GC.@preserve a s grads begin
        ptrs = Ptr{Cvoid}[pointer(g) for g in grads]
        check(gradacc_accumulator_add(handle(a), handle(s), ptrs, length(ptrs), count))
    end
    return a
end

"Opens a micro-batch of `count` items whose gradients arrive through [`add_tensor!`](@ref)."
function begin_microbatch!(a::Accumulator, count::Integer)
    GC.@preserve a check(gradacc_accumulator_begin_microbatch(handle(a), count))
    return a
end

"One contribution to tensor `i` (1-based) of the open micro-batch."
function add_tensor!(a::Accumulator, s::Scaler, i::Integer, g::AbstractVector)
    1 <= i <= length(a.tensors) && check_grad(a, i, g)
    GC.@preserve a s g check(gradacc_accumulator_add_tensor(handle(a), handle(s), i - 1, pointer(g), length(g)))
    return a
end

"Closes the open micro-batch."
function end_microbatch!(a::Accumulator)
    GC.@preserve a check(gradacc_accumulator_end_microbatch(handle(a)))
    return a
end

"""
    sync!(acc[, comm]) -> gradacc_sync_info_t

The boundary: with `comm`, every rank of its group calls it from its own task and thread.
The result has fields `found_inf`, `total_count`, `microbatches`, `grad_norm`, `clip_coef`.
"""
function sync!(a::Accumulator, comm::Union{Nothing,Communicator}=nothing)
    info = Ref{gradacc_sync_info_t}()
    c = comm === nothing ? Ptr{gradacc_comm_t}(C_NULL) : handle(comm)
    GC.@preserve a comm check(gradacc_accumulator_sync(handle(a), c, info))
    return info[]
end

"""
    master(acc, i) -> Vector{Float32}

Tensor `i`'s (1-based) FP32 master gradient, an array over gradacc's memory (no copy). It does
not keep `acc` alive: it is valid until `acc` is closed or finalized, so keep `acc` referenced
(`GC.@preserve acc ...`) while using it, or `copy` it.
"""
function master(a::Accumulator, i::Integer)
    p = Ref{Ptr{Cfloat}}(C_NULL)
    n = Ref{Csize_t}(0)
    GC.@preserve a check(gradacc_accumulator_master(handle(a), i - 1, p, n))
    return unsafe_wrap(Array, p[], Int(n[]); own=false)
end

"Discards the window in progress."
function reset!(a::Accumulator)
    GC.@preserve a check(gradacc_accumulator_reset(handle(a)))
    return a
end

"""
    update!(scaler, accs...) -> Bool

Ends an optimizer step from the synced accumulators; `true` means: skip the step.
"""
function update!(s::Scaler, accs::Accumulator...)
    skipped = Ref{Bool}(false)
    GC.@preserve s accs begin
        ptrs = Ptr{gradacc_accumulator_t}[handle(a) for a in accs]
        check(gradacc_scaler_update(handle(s), ptrs, length(ptrs), skipped))
    end
    return skipped[]
end

end # module
