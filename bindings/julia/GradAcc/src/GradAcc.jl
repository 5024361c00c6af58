"""
    GradAcc

Julia binding of gradacc: correct mixed-precision gradient accumulation behind a stable C ABI.
`libgradacc.jl` (generated from include/gradacc.h by bindings/julia/gen_wrap.py) is the ccall
layer; this module owns the handles (`mutable struct`, idempotent `close`, a finalizer where
destroying is local) and turns statuses into [`GradAccError`](@ref).

The library is found when the package is loaded (not when it is precompiled): the file named
by `ENV["GRADACC_LIBRARY"]`, else `target/release` of the repository this package sits in (a
checkout or `Pkg.develop`), else `libgradacc` (`gradacc.dll` on Windows) on the system's library
path. Loading fails if the library's version does not match the header the ccall layer was
generated from.

Exported: the types, [`local_group`](@ref), [`add!`](@ref), [`add_tensor!`](@ref),
[`begin_microbatch!`](@ref), [`end_microbatch!`](@ref), [`sync!`](@ref), [`sync_for_step!`](@ref),
[`sync_hybrid!`](@ref). Names that other
packages also use (`update!`, `reset!`, `step!`, `scale`, `master`, `save`, `load!`, ...) are public but
not exported: call them qualified, `GradAcc.update!(scaler, acc)`.
"""
module GradAcc

using Libdl

export Scaler, Accumulator, Optimizer, Communicator, GradAccError, local_group
export add!, add_final!, add_tensor!, begin_microbatch!, end_microbatch!, sync!, sync_for_step!, sync_hybrid!

# `public` is a keyword from Julia 1.11; parsing it here keeps 1.10 able to load the module.
if VERSION >= v"1.11.0-DEV.469"
    eval(Meta.parse("""public update!, reset!, scale, scale_loss!, master, overflow, tensor_stats, stats, save, load!,
        save_window, load_window!, merge_window!, num_tensors, tensor, shard, offset, master_numel,
        backend_available, diagnostics, Mesh, MeshPart, MeshInfo,
        mpi_communicator, nccl_unique_id, nccl_communicator, adopt_nccl, abort!, timeout,
        set_timeout!, rank, world_size, version, step!, set_lr!, lr_device_ptr, steps,
        f32_to_f16, f32_to_f16!, f16_to_f32, f16_to_f32!, f32_to_bf16, f32_to_bf16!, bf16_to_f32,
        bf16_to_f32!"""))
end

# Set by __init__ when the package loads, so GRADACC_LIBRARY is read then, not frozen into the
# precompiled image.
const LIBRARY = Ref{String}("")
const HANDLE = Ref{Ptr{Cvoid}}(C_NULL)
libgradacc() = LIBRARY[]
libgradacc_handle() = HANDLE[]

include("libgradacc.jl")

# Rust names the library gradacc.dll on Windows, libgradacc.{so,dylib} elsewhere.
const LIBNAME = (Sys.iswindows() ? "gradacc." : "libgradacc.") * Libdl.dlext

function find_library_path()
    path = get(ENV, "GRADACC_LIBRARY", "")
    isempty(path) || return path
    dev = normpath(joinpath(@__DIR__, "..", "..", "..", "..", "target", "release", LIBNAME))
    isfile(dev) && return dev
    found = Libdl.find_library(["libgradacc", "gradacc"])
    isempty(found) || return found
    error("GradAcc: libgradacc not found: set ENV[\"GRADACC_LIBRARY\"] to its path before loading GradAcc")
end

function __init__()
    path = find_library_path()
    HANDLE[] = Libdl.dlopen(path)
    LIBRARY[] = path
    lib = Int(gradacc_version_number())  # MAJOR * 10000 + MINOR * 100 + PATCH
    major, minor = lib ÷ 10000, lib % 10000 ÷ 100
    # Below 1.0 a minor release may break the ABI; from 1.0 a newer minor only adds.
    ok = major == GRADACC_VERSION_MAJOR &&
         (major == 0 ? minor == GRADACC_VERSION_MINOR : minor >= GRADACC_VERSION_MINOR)
    ok || error("GradAcc: $path is version $(unsafe_string(gradacc_version_string())), " *
                "but this package was generated from the header of version $GRADACC_VERSION_STRING")
    return nothing
end

"""
    GradAccError(status, message)

A failed gradacc call: `status` is the `GRADACC_STATUS_*` code, `message` the calling thread's
`gradacc_last_error()` (it names the function, the argument and the wrong value).
"""
struct GradAccError <: Exception
    status::Int32
    message::String
end

function Base.showerror(io::IO, e::GradAccError)
    print(io, "GradAccError: ", unsafe_string(gradacc_status_string(e.status)), ": ", e.message)
end

# The message is per OS thread: it is read by the next ccall, with no yield point in between, so
# the task cannot have moved to another thread.
@inline function check(status)
    status == GRADACC_STATUS_OK && return nothing
    throw(GradAccError(status, unsafe_string(gradacc_last_error())))
end

"""
    GradAcc.version() -> VersionNumber

The loaded library's version.
"""
version() = VersionNumber(unsafe_string(gradacc_version_string()))

include("convert.jl")

const BACKENDS = Dict(:local => GRADACC_BACKEND_LOCAL, :mpi => GRADACC_BACKEND_MPI,
                      :nccl => GRADACC_BACKEND_NCCL, :cuda => GRADACC_BACKEND_CUDA)

"""
    GradAcc.backend_available(backend) -> Bool

Whether `backend` (`:local`, `:mpi`, `:nccl` or `:cuda`) can be used by this build on this
machine; a constructor of an unavailable one throws `GRADACC_STATUS_BACKEND_UNAVAILABLE`.
"""
function backend_available(backend::Symbol)
    haskey(BACKENDS, backend) || throw(ArgumentError("unknown backend :$backend; use one of $(keys(BACKENDS))"))
    out = Ref{Bool}(false)
    check(gradacc_backend_available(BACKENDS[backend], out))
    return out[]
end

"""
    GradAcc.diagnostics() -> String

The library's report for a bug report (`gradacc_diagnostics`, what `gradacc-info` prints): its
version and file, the host's SIMD path, each backend available or why not, the CUDA driver, NVRTC
and NCCL found or why not, and every environment variable the library reads. The library's
messages (docs/diagnostics.md) reach stderr with `ENV["GRADACC_LOG"] = "info"` set before it loads.
"""
function diagnostics()
    needed = Ref{Csize_t}(0)
    check(gradacc_diagnostics(C_NULL, 0, needed))
    buf = Vector{UInt8}(undef, needed[])
    check(gradacc_diagnostics(buf, needed[], C_NULL))
    return String(resize!(buf, needed[] - 1))
end

# ---- dtypes ----------------------------------------------------------------------------------

# The dtype code of a tensor description: an element type or :f32/:f16/:bf16. bf16 element types
# get methods below (Core.BFloat16) and in the BFloat16s.jl extension.
dtype_code(::Type{Float32}) = GRADACC_DTYPE_F32
dtype_code(::Type{Float16}) = GRADACC_DTYPE_F16
function dtype_code(s::Symbol)
    s === :f32 && return GRADACC_DTYPE_F32
    s === :f16 && return GRADACC_DTYPE_F16
    s === :bf16 && return GRADACC_DTYPE_BF16
    throw(ArgumentError("unknown dtype :$s; use :f32, :f16 or :bf16"))
end
dtype_code(x) = throw(ArgumentError("unsupported dtype $x; use Float32, Float16, a BFloat16 type, " *
                                    "or :f32, :f16, :bf16"))

# Element types whose bits are a bf16: raw UInt16 words, and the BFloat16 types.
isbf16(::Type) = false
isbf16(::Type{UInt16}) = true

@static if isdefined(Core, :BFloat16)  # Julia 1.11 and later
    dtype_code(::Type{Core.BFloat16}) = GRADACC_DTYPE_BF16
    isbf16(::Type{Core.BFloat16}) = true
end

# A dtype code as the library's messages name it.
dtype_name(dt) = dt == GRADACC_DTYPE_F32 ? "f32" : dt == GRADACC_DTYPE_F16 ? "f16" :
                 dt == GRADACC_DTYPE_BF16 ? "bf16" : "dtype $dt"

# The element types a gradient or loss buffer of this dtype code may have.
function eltype_matches(dt, T::Type)
    dt == GRADACC_DTYPE_F32 && return T === Float32
    dt == GRADACC_DTYPE_F16 && return (T === Float16 || T === UInt16)
    return isbf16(T)
end

# ---- config structs ----------------------------------------------------------------------------

const NORMALIZE = Dict(:by_count => GRADACC_NORMALIZE_BY_COUNT, :by_microbatches => GRADACC_NORMALIZE_BY_MICROBATCHES,
                       :by_world => GRADACC_NORMALIZE_BY_WORLD, :none => GRADACC_NORMALIZE_NONE)
const REDUCTION = Dict(:mean => GRADACC_LOSS_REDUCTION_MEAN, :sum => GRADACC_LOSS_REDUCTION_SUM)
const SHARDING = Dict(:none => GRADACC_SHARDING_NONE, :reduce_scatter => GRADACC_SHARDING_REDUCE_SCATTER,
                      :accumulate => GRADACC_SHARDING_ACCUMULATE)
const OVERFLOW = Dict(:skip_step => GRADACC_OVERFLOW_SKIP_STEP, :drop_microbatch => GRADACC_OVERFLOW_DROP_MICROBATCH)

function enum_value(table, field, v)
    v isa Symbol || return v
    haskey(table, v) || throw(ArgumentError("unknown $field :$v; use one of $(keys(table))"))
    return table[v]
end

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
        v = f === :normalize ? enum_value(NORMALIZE, f, v) : v
        v = f === :loss_reduction ? enum_value(REDUCTION, f, v) : v
        v = f === :sharding ? enum_value(SHARDING, f, v) : v
        v = f === :overflow ? enum_value(OVERFLOW, f, v) : v
        v = f === :wire_dtype && !(v isa Integer) ? dtype_code(v) : v  # the C API validates codes
        convert(fieldtype(T, f), v)
    end
    return T(values...)
end

# `device`: :cpu, (:cuda, ordinal) or (:cuda, ordinal, stream::Ptr{Cvoid}) (CUDA.jl's
# `CUDA.stream().handle`); NULL stream means the device's default stream.
device_struct(d::Symbol) = d === :cpu ? gradacc_device_t(GRADACC_DEVICE_CPU, 0, C_NULL) :
                           d === :cuda ? device_struct((:cuda, 0)) :
                           throw(ArgumentError("unknown device :$d; use :cpu or (:cuda, ordinal[, stream])"))
function device_struct(d::Tuple)
    length(d) in (2, 3) && d[1] === :cuda ||
        throw(ArgumentError("a device tuple is (:cuda, ordinal[, stream]), not $d"))
    stream = length(d) == 3 ? convert(Ptr{Cvoid}, d[3]) : C_NULL
    return gradacc_device_t(GRADACC_DEVICE_CUDA, d[2], stream)
end

# ---- handles -----------------------------------------------------------------------------------

# Each handle type's pointer field is atomic: `close` swaps it to NULL, so two tasks (or a task
# and the finalizer) closing one object destroy it once. A call racing a close gets a handle the
# library already destroyed, which it reports (GRADACC_STATUS_INVALID_HANDLE) without touching it.
# The finalizer: never throws (an exception in a finalizer is only printed, and the status has
# nobody to go to), and does nothing after an explicit close.
function destroy_quietly(x, destroy)
    p = @atomicswap x.ptr = C_NULL
    p == C_NULL || destroy(p)
    return nothing
end

# ---- communicator ------------------------------------------------------------------------------

"""
One rank's endpoint of a data-parallel group: [`local_group`](@ref) (ranks are threads of this
process), [`GradAcc.mpi_communicator`](@ref), [`GradAcc.nccl_communicator`](@ref),
[`GradAcc.adopt_nccl`](@ref).

In-process communicators are destroyed by the GC if not closed. MPI and NCCL ones are not: their
destroy is collective, and the GC would run it at a different time on each rank, so close them
explicitly, on every rank in the same order (`close(comm)`, before `MPI.Finalize()`).
"""
mutable struct Communicator
    @atomic ptr::Ptr{gradacc_comm_t}
    const backend::Symbol
    function Communicator(ptr::Ptr{gradacc_comm_t}, backend::Symbol)
        c = new(ptr, backend)
        backend === :local && finalizer(c -> destroy_quietly(c, gradacc_comm_destroy), c)
        return c
    end
end

Base.isopen(x::Communicator) = (@atomic x.ptr) != C_NULL
function handle(x::Communicator)
    p = @atomic x.ptr
    p == C_NULL && throw(ArgumentError("the Communicator is closed"))
    return p
end
# ccall keeps the object alive through the call and passes its C handle.
Base.cconvert(::Type{Ptr{gradacc_comm_t}}, x::Communicator) = x
Base.unsafe_convert(::Type{Ptr{gradacc_comm_t}}, x::Communicator) = handle(x)

"""
    close(comm::Communicator)

Destroys the handle; calling it again, from any task, does nothing. For MPI and NCCL every rank
must close its communicator (a healthy NCCL one waits for its pending collectives).
"""
function Base.close(c::Communicator)
    p = @atomicswap c.ptr = C_NULL
    p == C_NULL || check(gradacc_comm_destroy(p))
    return nothing
end

function Base.show(io::IO, c::Communicator)
    if isopen(c)
        print(io, "GradAcc.Communicator(:", c.backend, ", rank ", rank(c), " of ", world_size(c), ")")
    else
        print(io, "GradAcc.Communicator(:", c.backend, ", closed)")
    end
end

"""
    local_group(n) -> Vector{Communicator}

An in-process group of `n` ranks, rank 0 first. Run each rank in its own task on its own thread
(`Threads.@spawn`, Julia started with at least `n` threads); every rank takes part in every sync.
"""
function local_group(n::Integer)
    n >= 1 || throw(ArgumentError("a group has at least one rank, not $n"))
    raw = Vector{Ptr{gradacc_comm_t}}(undef, n)
    check(gradacc_comm_create_local(n, raw))
    return [Communicator(p, :local) for p in raw]
end

"""
    GradAcc.rank(comm) -> Int

This endpoint's rank, 0-based.
"""
function rank(c::Communicator)
    out = Ref{Int32}(0)
    check(gradacc_comm_rank(c, out))
    return Int(out[])
end

"""
    GradAcc.world_size(comm) -> Int

The group's number of ranks.
"""
function world_size(c::Communicator)
    out = Ref{Int32}(0)
    check(gradacc_comm_world_size(c, out))
    return Int(out[])
end

"""
    GradAcc.mpi_communicator([fortran_comm]) -> Communicator

This process's rank of an MPI communicator, collectively on every rank: MPI_COMM_WORLD by
default, else the communicator whose *Fortran* handle is `fortran_comm` (`MPI_Comm_c2f`). With
MPI.jl loaded, pass an `MPI.Comm` directly: `GradAcc.mpi_communicator(MPI.COMM_WORLD)`. Keywords
set fields of `gradacc_mpi_config_t`: `shared_memory=0` sends the boundary's data as MPI messages
even when every rank is on one host (by default it goes through shared memory there). Close it
explicitly on every rank, before `MPI.Finalize()`.
"""
function mpi_communicator(fortran_comm::Integer=GRADACC_MPI_COMM_WORLD; kw...)
    cfg = Ref(config(gradacc_mpi_config_t, gradacc_mpi_config_default; kw...))
    out = Ref{Ptr{gradacc_comm_t}}(C_NULL)
    check(gradacc_comm_create_mpi(fortran_comm, cfg, out))
    return Communicator(out[], :mpi)
end

"""
    GradAcc.nccl_unique_id() -> Vector{UInt8}

A new NCCL unique id (128 bytes): rank 0 makes it and sends it to every rank (`MPI.Bcast!`, a
file) before they call [`GradAcc.nccl_communicator`](@ref).
"""
function nccl_unique_id()
    out = Ref{gradacc_nccl_unique_id_t}()
    check(gradacc_nccl_unique_id(out))
    return collect(out[].internal)
end

"""
    GradAcc.nccl_communicator(id, rank, world_size, device_ordinal) -> Communicator

Rank `rank` (0-based) of the NCCL group named by `id` (from [`GradAcc.nccl_unique_id`](@ref)),
on CUDA device `device_ordinal`; returns when every rank has called it. Close it explicitly on
every rank, or [`GradAcc.abort!`](@ref) it first after a peer failed.
"""
function nccl_communicator(id::AbstractVector{UInt8}, rank::Integer, world_size::Integer, device_ordinal::Integer)
    length(id) == 128 || throw(ArgumentError("an NCCL unique id has 128 bytes, not $(length(id))"))
    uid = Ref(gradacc_nccl_unique_id_t(NTuple{128,UInt8}(id)))
    out = Ref{Ptr{gradacc_comm_t}}(C_NULL)
    check(gradacc_comm_create_nccl(uid, rank, world_size, device_ordinal, out))
    return Communicator(out[], :nccl)
end

"""
    GradAcc.adopt_nccl(nccl_comm::Ptr{Cvoid}) -> Communicator

Wraps the caller's `ncclComm_t` (NCCL.jl's `comm.handle`), which stays the caller's: close the
returned Communicator before destroying it.
"""
function adopt_nccl(nccl_comm::Ptr{Cvoid})
    out = Ref{Ptr{gradacc_comm_t}}(C_NULL)
    check(gradacc_comm_adopt_nccl(nccl_comm, out))
    return Communicator(out[], :nccl)
end

"""
    GradAcc.abort!(comm) -> comm

Aborts this rank's communicator, of any backend, after a peer died: a sync blocked in it on
another task, and every later one, throws `GRADACC_STATUS_COMM_FAILURE`. In a
[`local_group`](@ref) every rank fails; with MPI this rank stops waiting (MPI itself is not
aborted). An adopted NCCL communicator throws `GRADACC_STATUS_WRONG_STATE`. The communicator
still has to be closed.
"""
function abort!(c::Communicator)
    check(gradacc_comm_abort(c))
    return c
end

# The name before abort!; kept so that existing callers still work.
Base.@deprecate abort(c::Communicator) abort!(c) false

"""
    GradAcc.timeout(comm) -> Union{Float64,Nothing}

How long a collective on `comm` may wait for the other ranks, in seconds (600 by default);
`nothing` when it waits forever. See [`GradAcc.set_timeout!`](@ref).
"""
function timeout(c::Communicator)
    out = Ref{Cdouble}(0)
    check(gradacc_comm_timeout(c, out))
    return out[] == 0 ? nothing : out[]
end

"""
    GradAcc.set_timeout!(comm, seconds) -> comm

Sets how long a collective on `comm` may wait for the other ranks; `nothing` (or 0) waits
forever. Past it, the sync throws `GRADACC_STATUS_TIMEOUT` and the communicator is aborted.
Applies to the collectives that start later; a negative, NaN or infinite value throws
`GRADACC_STATUS_INVALID_ARGUMENT`.
"""
function set_timeout!(c::Communicator, seconds::Union{Real,Nothing})
    check(gradacc_comm_set_timeout(c, seconds === nothing ? 0.0 : Float64(seconds)))
    return c
end

# ---- scaler ------------------------------------------------------------------------------------

"""
    Scaler(; init_scale=65536, growth_interval=2000, hysteresis=1, ..., device=:cpu)

A dynamic loss scaler; keywords replace fields of `gradacc_scaler_config_default`. `device` is
`:cpu` or `(:cuda, ordinal[, stream])`. Destroyed by `close` or the GC.
"""
mutable struct Scaler
    @atomic ptr::Ptr{gradacc_scaler_t}
    function Scaler(; device=:cpu, kw...)
        cfg = Ref(config(gradacc_scaler_config_t, gradacc_scaler_config_default; kw...))
        out = Ref{Ptr{gradacc_scaler_t}}(C_NULL)
        check(gradacc_scaler_create(cfg, Ref(device_struct(device)), out))
        return finalizer(s -> destroy_quietly(s, gradacc_scaler_destroy), new(out[]))
    end
end

Base.isopen(x::Scaler) = (@atomic x.ptr) != C_NULL
function handle(x::Scaler)
    p = @atomic x.ptr
    p == C_NULL && throw(ArgumentError("the Scaler is closed"))
    return p
end
# ccall keeps the object alive through the call and passes its C handle.
Base.cconvert(::Type{Ptr{gradacc_scaler_t}}, x::Scaler) = x
Base.unsafe_convert(::Type{Ptr{gradacc_scaler_t}}, x::Scaler) = handle(x)

"""
    close(scaler::Scaler)

Destroys the scaler; calling it again, from any task, does nothing.
"""
function Base.close(s::Scaler)
    p = @atomicswap s.ptr = C_NULL
    p == C_NULL || check(gradacc_scaler_destroy(p))
    return nothing
end

Base.show(io::IO, s::Scaler) =
    isopen(s) ? print(io, "GradAcc.Scaler(scale=", scale(s), ")") : print(io, "GradAcc.Scaler(closed)")

"""
    GradAcc.scale(scaler) -> Float32

The current loss scale.
"""
function scale(s::Scaler)
    out = Ref{Cfloat}(0)
    check(gradacc_scaler_scale(s, out))
    return out[]
end

"""
    GradAcc.scale_loss!(scaler, loss::AbstractVector) -> loss

Multiplies the loss values (Float32, Float16, or bf16: `UInt16` words or a BFloat16 type) in
place by the current scale, before the backward pass.

    GradAcc.scale_loss!(scaler, ptr::Ptr, numel, dtype)

The same for a device buffer of a CUDA scaler (`dtype` as in [`Accumulator`](@ref)).
"""
function scale_loss!(s::Scaler, loss::AbstractVector)
    T = eltype(loss)
    dt = T === Float32 ? GRADACC_DTYPE_F32 : T === Float16 ? GRADACC_DTYPE_F16 :
         isbf16(T) ? GRADACC_DTYPE_BF16 : throw(ArgumentError("unsupported loss element type $T"))
    contiguous(loss) || throw(ArgumentError("the loss must be a contiguous vector"))
    GC.@preserve loss check(gradacc_scaler_scale_loss(s, pointer(loss), length(loss), dt))
    return loss
end

function scale_loss!(s::Scaler, ptr::Ptr, numel::Integer, dtype)
    check(gradacc_scaler_scale_loss(s, Ptr{Cvoid}(ptr), numel, dtype_code(dtype)))
    return nothing
end

# An output struct with its struct_size set: the library writes only the fields that size covers.
out_struct(::Type{T}) where {T} = Ref(T(sizeof(T), (zero(fieldtype(T, i)) for i in 2:fieldcount(T))...))
# The same with struct_size 0, which every call that takes it refuses.
refused_struct(::Type{T}) where {T} = Ref(T((zero(fieldtype(T, i)) for i in 1:fieldcount(T))...))

"""
    GradAcc.stats(scaler) -> gradacc_scaler_stats_t

The scaler's statistics (fields `steps`, `skipped_steps`, `growths`, ...).
"""
function stats(s::Scaler)
    out = out_struct(gradacc_scaler_stats_t)
    check(gradacc_scaler_stats(s, out))
    return out[]
end

# Both save functions: ask for the size, then fill a buffer of it.
function saved_bytes(f, x)
    n = Ref{Csize_t}(0)
    check(f(x, Ptr{UInt8}(C_NULL), 0, n))
    buf = Vector{UInt8}(undef, n[])
    check(f(x, buf, length(buf), n))
    return resize!(buf, n[])
end

"""
    GradAcc.save(scaler) -> Vector{UInt8}

The scaler's complete state as versioned bytes, for a checkpoint; see [`GradAcc.load!`](@ref).
"""
save(s::Scaler) = saved_bytes(gradacc_scaler_save, s)

"""
    GradAcc.load!(scaler, bytes) -> scaler

Restores a state written by [`GradAcc.save`](@ref); corrupt or foreign bytes throw
`GRADACC_STATUS_CORRUPT_STATE`.
"""
function load!(s::Scaler, bytes::AbstractVector{UInt8})
    b = Vector{UInt8}(bytes)
    check(gradacc_scaler_load(s, b, length(b)))
    return s
end

# ---- accumulator -------------------------------------------------------------------------------

"""
    Accumulator(tensors[, buffer]; normalize=:by_count, loss_reduction=:mean, max_grad_norm=0, ..., device=:cpu, comm=nothing)

FP32 master gradients of `tensors`, a vector of `(numel, dtype)`; dtype is `Float32`, `Float16`,
a BFloat16 type (`Core.BFloat16` from Julia 1.11, `BFloat16s.BFloat16` with BFloat16s.jl
loaded) or `:f32`/`:f16`/`:bf16` (bf16 gradients may then also be passed as `UInt16` words).
With `buffer`, a `Vector{Float32}` of the tensors' total length, the masters live in it (the
accumulator keeps it referenced). Destroyed by `close` or the GC.

`sharding=:reduce_scatter, shard_count=n, shard_rank=r` makes the boundary a reduce-scatter:
[`sync!`](@ref) takes a communicator of `n` ranks on which this is rank `r` (0-based, as
[`GradAcc.rank`](@ref)), and after it only [`GradAcc.shard`](@ref) holds the reduced gradient
(the bits an unsharded sync leaves in that range); the norm and clipping are still the whole
gradient's; [`sync_hybrid!`](@ref) takes such a shard group and a replica group (HSDP).
`wire_dtype` (`Float32` or `:f32`, the default, or `:bf16`) is what the reductions send.
`overflow` is what a non-finite gradient costs: `:skip_step` (the default) skips the window's
step; `:drop_microbatch` drops only the micro-batch that held it, on the rank that fed it, and
[`GradAcc.overflow`](@ref) reads where from the report. An unknown symbol throws an
`ArgumentError`, an unknown code `GRADACC_STATUS_INVALID_ARGUMENT`. `tensor_stats=true` has every
boundary also measure each tensor, read with [`GradAcc.tensor_stats`](@ref) (a value other than 0
or 1 throws `GRADACC_STATUS_INVALID_ARGUMENT`); both on every device and sharding policy. docs/overflow.md states the contract.

`sharding=:accumulate, shard_count=n, shard_rank=r, comm=c` is sharded accumulation (ZeRO-2) over
`c`, a communicator of `n` ranks on which this is rank `r`: the accumulator holds only its shard
([`GradAcc.shard`](@ref) on the CPU), and every micro-batch ([`add!`](@ref), or
[`begin_microbatch!`](@ref) / [`add_tensor!`](@ref) / [`end_microbatch!`](@ref)) and [`sync!`](@ref)
is a collective over `c`, each rank calling from its own task and thread. docs/sharding.md ("Sharded
accumulation (ZeRO-2)") states the contract: what each rank holds, the calls every rank makes, how a
failure ends and what the result equals. In Julia a failure the library reports throws a
[`GradAccError`](@ref) with the page's status; the binding's own checks in `add!` and `sync!` throw
here and still fail the other ranks at once. The accumulator keeps `c` referenced, and the library
keeps the group: `close(c)` releases only `c`'s handle, and `sync!` without a communicator goes on.
It adopts no `buffer`.
"""
mutable struct Accumulator
    @atomic ptr::Ptr{gradacc_accumulator_t}
    const tensors::Vector{gradacc_tensor_desc_t}
    const device::gradacc_device_t
    const buffer::Union{Nothing,Vector{Float32}}
    # A sharded accumulation's communicator, referenced for as long as the accumulator (the C
    # accumulator holds its own reference to the group, so closing it is harmless).
    const comm::Union{Nothing,Communicator}
    function Accumulator(tensors::AbstractVector, buffer::Union{Nothing,Vector{Float32}}=nothing;
                         device=:cpu, comm::Union{Nothing,Communicator}=nothing, kw...)
        cfg = Ref(config(gradacc_accumulator_config_t, gradacc_accumulator_config_default; kw...))
        descs = [gradacc_tensor_desc_t(n, dtype_code(d)) for (n, d) in tensors]
        dev = device_struct(device)
        out = Ref{Ptr{gradacc_accumulator_t}}(C_NULL)
        if comm !== nothing
            buffer === nothing ||
                throw(ArgumentError("a sharded accumulation (comm=) owns its shard: it cannot adopt a buffer"))
            check(gradacc_accumulator_create_sharded(cfg, descs, length(descs), Ref(dev), comm, out))
        elseif buffer === nothing
            check(gradacc_accumulator_create(cfg, descs, length(descs), Ref(dev), out))
        else
            check(gradacc_accumulator_create_with_buffer(cfg, descs, length(descs), Ref(dev), buffer,
                                                         length(buffer), out))
        end
        acc = new(out[], descs, dev, buffer, comm)
        return finalizer(a -> destroy_quietly(a, gradacc_accumulator_destroy), acc)
    end
end

Base.isopen(x::Accumulator) = (@atomic x.ptr) != C_NULL
function handle(x::Accumulator)
    p = @atomic x.ptr
    p == C_NULL && throw(ArgumentError("the Accumulator is closed"))
    return p
end
# ccall keeps the object alive through the call and passes its C handle.
Base.cconvert(::Type{Ptr{gradacc_accumulator_t}}, x::Accumulator) = x
Base.unsafe_convert(::Type{Ptr{gradacc_accumulator_t}}, x::Accumulator) = handle(x)

"""
    close(acc::Accumulator)

Destroys the accumulator; calling it again, from any task, does nothing. Arrays from
[`GradAcc.master`](@ref) and [`GradAcc.shard`](@ref) must not be used after it (the GC alone
never frees them early).
"""
function Base.close(a::Accumulator)
    p = @atomicswap a.ptr = C_NULL
    p == C_NULL || check(gradacc_accumulator_destroy(p))
    return nothing
end

function Base.show(io::IO, a::Accumulator)
    print(io, "GradAcc.Accumulator(", length(a.tensors), " tensors", isopen(a) ? "" : ", closed", ")")
end

"""
    GradAcc.num_tensors(acc) -> Int

The number of tensors.
"""
num_tensors(a::Accumulator) = length(a.tensors)

"""
    GradAcc.tensor(acc, i) -> (numel, dtype_code)

Tensor `i`'s (1-based) element count and `GRADACC_DTYPE_*` code.
"""
function tensor(a::Accumulator, i::Integer)
    check_index(a, i)
    out = Ref{gradacc_tensor_desc_t}()
    check(gradacc_accumulator_tensor(a, i - 1, out))
    return (Int(out[].numel), out[].dtype)
end

check_index(a::Accumulator, i::Integer) =
    1 <= i <= length(a.tensors) || throw(BoundsError(a, i))

contiguous(g::AbstractVector) = g isa DenseVector || (g isa StridedVector && stride(g, 1) == 1)

# A gradient must be contiguous and of an element type its tensor's dtype arrives in (the C call
# takes a pointer and cannot tell): the exception that says why not, or nothing.
function grad_error(a::Accumulator, i::Integer, g::AbstractVector)
    1 <= i <= length(a.tensors) || return BoundsError(a, i)
    contiguous(g) || return ArgumentError("gradient $i must be a contiguous vector")
    dt = a.tensors[i].dtype
    eltype_matches(dt, eltype(g)) ||
        return ArgumentError("gradient $i has element type $(eltype(g)), but tensor $i was declared $(dtype_name(dt))")
    return nothing
end

# What add! refuses before the C call (the exception), or nothing.
function add_error(a::Accumulator, s::Scaler, grads::AbstractVector)
    length(grads) == length(a.tensors) ||
        return ArgumentError("$(length(grads)) gradients for $(length(a.tensors)) tensors")
    for (i, g) in enumerate(grads)
        err = grad_error(a, i, g)
        err === nothing || return err
        length(g) == a.tensors[i].numel ||  # add takes no lengths: check before C reads past the end
            return DimensionMismatch("gradient $i has $(length(g)) elements, tensor $i has $(a.tensors[i].numel)")
    end
    # A closed accumulator is the C call's to report.
    isopen(s) || !isopen(a) || return ArgumentError("the Scaler is closed")
    return nothing
end

# Throws add!'s own refusal `err` after a C add that the library refuses on every rank (no
# gradients): a sharded accumulation's other ranks, already in this micro-batch's reduction, fail
# at once instead of at their timeout. Elsewhere that call only fails here.
function refuse_add(a::Accumulator, s::Scaler, err::Exception)
    p = @atomic a.ptr
    if p != C_NULL
        sp = @atomic s.ptr  # C_NULL once closed
        GC.@preserve a s gradacc_accumulator_add(p, sp, Ptr{Ptr{Cvoid}}(C_NULL), 0, 0)
    end
    throw(err)
end

"""
    add!(acc, scaler, grads, count) -> acc

One micro-batch of `count` items: `grads[i]` is tensor `i`'s gradient, a contiguous vector of
its dtype (`Float32`; `Float16`; for bf16 a BFloat16 type or `UInt16` words).
"""
add!(a::Accumulator, s::Scaler, grads::AbstractVector, count::Integer) =
    add_with!(gradacc_accumulator_add, a, s, grads, count)

"""
    add_final!(acc, scaler, grads, count) -> acc

`add!` of the window's last micro-batch, which the boundary follows: on the CPU the add also
measures the norm, so a boundary that reduces nothing between ranks reads the master no more.
The same bits as `add!` (docs/optimizer.md, "The norm inside the last add").
"""
add_final!(a::Accumulator, s::Scaler, grads::AbstractVector, count::Integer) =
    add_with!(gradacc_accumulator_add_final, a, s, grads, count)

function add_with!(add, a::Accumulator, s::Scaler, grads::AbstractVector, count::Integer)
    err = add_error(a, s, grads)
    err === nothing || refuse_add(a, s, err)
    GC.@preserve grads begin
        ptrs = Ptr{Cvoid}[pointer(g) for g in grads]
        check(add(a, s, ptrs, length(ptrs), count))
    end
    return a
end

"""
    begin_microbatch!(acc, count[, comm]; final=false) -> acc

Opens a micro-batch of `count` items whose gradients arrive through [`add_tensor!`](@ref).
`final=true` (with `comm`) marks the last micro-batch of the window, whose buckets are reduced
as they fill; every rank calls it.
"""
function begin_microbatch!(a::Accumulator, count::Integer, comm::Union{Nothing,Communicator}=nothing;
                           final::Bool=false)
    if final
        check(gradacc_accumulator_begin_final_microbatch(a, count, something(comm, Ptr{gradacc_comm_t}(C_NULL))))
    else
        comm === nothing || throw(ArgumentError("a communicator is only passed with final=true"))
        check(gradacc_accumulator_begin_microbatch(a, count))
    end
    return a
end

"""
    add_tensor!(acc, scaler, i, grad) -> acc

One contribution to tensor `i` (1-based) of the open micro-batch.
"""
function add_tensor!(a::Accumulator, s::Scaler, i::Integer, g::AbstractVector)
    err = grad_error(a, i, g)
    # A closed accumulator is the C call's to report.
    err === nothing && !isopen(s) && isopen(a) && (err = ArgumentError("the Scaler is closed"))
    err === nothing || refuse_tensor(a, s, err)
    GC.@preserve g check(gradacc_accumulator_add_tensor(a, s, i - 1, pointer(g), length(g)))
    return a
end

# Throws add_tensor!'s own refusal `err` after a C add_tensor that the library refuses (no
# gradient): a sharded accumulation's micro-batch then fails on every rank when it ends, instead
# of summing this tensor as zeros on the others. Elsewhere that call only fails here.
function refuse_tensor(a::Accumulator, s::Scaler, err::Exception)
    p = @atomic a.ptr
    if p != C_NULL
        sp = @atomic s.ptr  # C_NULL once closed
        GC.@preserve a s gradacc_accumulator_add_tensor(p, sp, 0, C_NULL, 0)
    end
    throw(err)
end

"""
    end_microbatch!(acc) -> acc

Closes the open micro-batch.
"""
function end_microbatch!(a::Accumulator)
    check(gradacc_accumulator_end_microbatch(a))
    return a
end

"""
    sync!(acc[, comm]) -> gradacc_sync_info_t

The boundary: with `comm`, every rank of its group calls it from its own task and thread.
The result has fields `found_inf`, `total_count`, `microbatches`, `grad_norm`, `clip_coef`,
`dropped_microbatches` and the C place fields (`overflow_at`, ...), which
[`GradAcc.overflow`](@ref) reads.
A sharded accumulator needs the group of its `shard_count` ranks, on which it is `shard_rank`;
otherwise every rank throws. A sharded accumulation (`comm=` at creation) syncs over its own
communicator: `comm` is that one or omitted (another throws `GRADACC_STATUS_INVALID_ARGUMENT`
there and `GRADACC_STATUS_PEER_FAILURE` on the other ranks).
"""
sync!(a::Accumulator, comm::Union{Nothing,Communicator}=nothing) = sync_with!(gradacc_accumulator_sync, a, comm)

"""
    sync_for_step!(acc[, comm]) -> gradacc_sync_info_t

[`sync!`](@ref) for an [`Optimizer`](@ref) that steps right after: the clip coefficient is
applied inside the step's pass (bitwise as after `sync!`), saving a pass over the gradient, so
[`master`](@ref) and [`shard`](@ref) then hold the sum before normalisation and clipping
(the step applies both as one factor): read the
reduced gradient yourself only after `sync!` (gradacc_accumulator_sync_for_step).
"""
sync_for_step!(a::Accumulator, comm::Union{Nothing,Communicator}=nothing) =
    sync_with!(gradacc_accumulator_sync_for_step, a, comm)

function sync_with!(call, a::Accumulator, comm::Union{Nothing,Communicator})
    info = out_struct(gradacc_sync_info_t)
    if comm !== nothing && !isopen(comm)
        p = @atomic a.ptr
        if p != C_NULL
            # A sharded accumulation's other ranks are already in the boundary: a C sync with
            # struct_size 0 is refused on every rank, so they fail at once.
            refused = refused_struct(gradacc_sync_info_t)
            GC.@preserve a call(p, Ptr{gradacc_comm_t}(C_NULL), refused)
        end
        handle(comm)  # throws the binding's error
    end
    check(call(a, something(comm, Ptr{gradacc_comm_t}(C_NULL)), info))
    return info[]
end

"""
    sync_hybrid!(acc, shard, replicas) -> gradacc_sync_info_t

The hybrid boundary (HSDP) of an accumulator with `sharding=:reduce_scatter` or `:accumulate`:
a reduce-scatter over `shard` (its shard group: `shard_count` ranks, this one `shard_rank`; for
a sharded accumulation, its own communicator, which reduced every micro-batch already), then an
all-reduce of the shard over `replicas`, the ranks that hold the same shard in the other shard
groups. Every
rank of both groups calls it from its own task and thread. Counts, overflow and the norm are the
whole grid's, the same on every rank, and replicas hold the same bits ([`GradAcc.shard`](@ref)).
Replica groups pairing different shards throw `GRADACC_STATUS_SIZE_MISMATCH`, and an unsharded
accumulator `GRADACC_STATUS_INVALID_ARGUMENT`, on every rank with the window intact. Which
communicators a device takes: `gradacc_accumulator_sync_hybrid` and docs/sharding.md ("Hybrid
groups").
"""
function sync_hybrid!(a::Accumulator, shard::Communicator, replicas::Communicator)
    info = out_struct(gradacc_sync_info_t)
    if !(isopen(a) && isopen(shard) && isopen(replicas))
        # The C call still takes part in the open groups' exchange, so their ranks fail at once.
        p, sp, rp = (@atomic a.ptr), (@atomic shard.ptr), (@atomic replicas.ptr)
        GC.@preserve a shard replicas gradacc_accumulator_sync_hybrid(p, sp, rp, info)
        foreach(handle, (a, shard, replicas))  # throws the binding's error
    end
    check(gradacc_accumulator_sync_hybrid(a, shard, replicas, info))
    return info[]
end

"""
    GradAcc.overflow(info) -> Union{Nothing, Symbol, NamedTuple}

Where the window of `info` (from [`sync!`](@ref) or [`sync_hybrid!`](@ref)) first went
non-finite, first in the order micro-batch, then tensor, then rank: `nothing` (it stayed finite),
`:reduction` (every rank's window was finite, their sum was not), or
`(rank=r, microbatch=m, tensor=t)` for a gradient value. As elsewhere in this package, `rank` is
0-based ([`GradAcc.rank`](@ref)) and `tensor` 1-based ([`GradAcc.master`](@ref)); `microbatch`
is 1-based too, counting the rank's window's micro-batches, dropped ones included. The struct's
own `overflow_*` fields are the C API's, all 0-based. docs/overflow.md states the contract.
"""
function overflow(info::gradacc_sync_info_t)
    info.overflow_at == GRADACC_OVERFLOW_AT_REDUCTION && return :reduction
    info.overflow_at == GRADACC_OVERFLOW_AT_GRADIENT || return nothing
    return (rank=Int(info.overflow_rank), microbatch=Int(info.overflow_microbatch) + 1,
            tensor=Int(info.overflow_tensor) + 1)
end

"""
    GradAcc.tensor_stats(acc) -> Vector{@NamedTuple{grad_norm::Float64, nonfinite_microbatches::Int}}

Each tensor's telemetry of the last boundary, the same on every rank, indexed by tensor as
[`GradAcc.master`](@ref) (1-based): `grad_norm`, the L2 norm of its reduced, normalised gradient
before clipping, and `nonfinite_microbatches`, the micro-batches over every rank in which it held
a non-finite value (dropped ones included). Needs `tensor_stats=true` at creation
([`Accumulator`](@ref)); the stats last until the next window's first micro-batch. Throws
`GRADACC_STATUS_WRONG_STATE` when the accumulator was created without it, and before a sync.
docs/overflow.md states the contract.
"""
function tensor_stats(a::Accumulator)
    n = length(a.tensors)
    norms = Vector{Cdouble}(undef, n)
    counts = Vector{UInt64}(undef, n)
    check(gradacc_accumulator_tensor_stats(a, norms, counts, n))
    return [(grad_norm=norms[i], nonfinite_microbatches=Int(counts[i])) for i in 1:n]
end

"""
    GradAcc.master(acc, i) -> Vector{Float32}

Tensor `i`'s (1-based) FP32 master gradient, an array over gradacc's memory (no copy) that keeps
`acc` alive while it is reachable. It is invalid after an explicit `close(acc)`. CPU only. A
sharded accumulation holds only its shard: a tensor not wholly inside it throws
`GRADACC_STATUS_INVALID_ARGUMENT` (use [`GradAcc.shard`](@ref)).
"""
function master(a::Accumulator, i::Integer)
    check_index(a, i)
    a.device.kind == GRADACC_DEVICE_CPU ||
        throw(ArgumentError("the masters of a CUDA accumulator are device memory; use the C API's pointer"))
    p = Ref{Ptr{Cfloat}}(C_NULL)
    n = Ref{Csize_t}(0)
    check(gradacc_accumulator_master(a, i - 1, p, n))
    arr = unsafe_wrap(Array, p[], Int(n[]); own=false)
    # The finalizer closure references `a`, so `a` (and its memory) lives as long as `arr`.
    finalizer(_ -> (a; nothing), arr)
    return arr
end

"""
    GradAcc.offset(acc, i) -> Int

How many elements of the flat FP32 master precede tensor `i`: a multiple of
`GRADACC_MASTER_ALIGN ÷ 4`, as every tensor starts at a multiple of `GRADACC_MASTER_ALIGN` (256)
bytes with zeros between. With [`GradAcc.shard`](@ref)'s `offset` it tells which tensors a shard
holds.
"""
function offset(a::Accumulator, i::Integer)
    out = Ref{Csize_t}(0)
    check(gradacc_accumulator_offset(a, i - 1, out))
    return Int(out[])
end

"""
    GradAcc.master_numel(tensors) -> Int

The flat FP32 master's length, in elements, of an accumulator over `tensors` (`(numel, type)`
pairs, as [`Accumulator`](@ref) takes them): each tensor at a multiple of
`GRADACC_MASTER_ALIGN` bytes, zeros between and after the last. What a caller's `buffer` must
hold.
"""
function master_numel(tensors::AbstractVector)
    descs = [gradacc_tensor_desc_t(n, dtype_code(d)) for (n, d) in tensors]
    out = Ref{Csize_t}(0)
    check(gradacc_accumulator_master_numel(descs, length(descs), out))
    return Int(out[])
end

"""
    GradAcc.shard(acc) -> (; offset, numel, data)

This rank's shard of the flat FP32 master (the tensors one after another, each at
[`GradAcc.offset`](@ref), zeros between): `offset` elements
precede it, it has `numel`, and `data` is a `Vector{Float32}` over them in gradacc's memory (no
copy), valid as [`GradAcc.master`](@ref)'s arrays are. Without sharding it is the whole master.
With `sharding=:reduce_scatter`, after a sync only the shard holds the reduced gradient; the
rest of the master is unspecified until the next window's first micro-batch. With
`sharding=:accumulate` the shard is all the accumulator holds: the window's sum over the ranks
while accumulating, the reduced gradient after a sync. Shards are cut in whole blocks of 4096
elements, so the last ones may be shorter or empty. CPU only.
"""
function shard(a::Accumulator)
    a.device.kind == GRADACC_DEVICE_CPU ||
        throw(ArgumentError("the shard of a CUDA accumulator is device memory; use the C API's pointer"))
    offset = Ref{Csize_t}(0)
    n = Ref{Csize_t}(0)
    p = Ref{Ptr{Cfloat}}(C_NULL)
    check(gradacc_accumulator_shard(a, offset, n, p))
    data = unsafe_wrap(Array, p[], Int(n[]); own=false)
    finalizer(_ -> (a; nothing), data)  # as in `master`: the array keeps `a` alive
    return (; offset=Int(offset[]), numel=Int(n[]), data)
end

"""
    GradAcc.reset!(acc) -> acc

Discards the window in progress.
"""
function reset!(a::Accumulator)
    check(gradacc_accumulator_reset(a))
    return a
end

"""
    GradAcc.update!(scaler, accs...) -> Bool

Ends an optimizer step from the synced accumulators; `true` means: skip the step.
"""
function update!(s::Scaler, accs::Accumulator...)
    skipped = Ref{Bool}(false)
    GC.@preserve accs begin
        ptrs = Ptr{gradacc_accumulator_t}[handle(a) for a in accs]
        check(gradacc_scaler_update(s, ptrs, length(ptrs), skipped))
    end
    return skipped[]
end

"""
    GradAcc.save_window(acc) -> Vector{UInt8}

The window in progress as versioned bytes, for a checkpoint in the middle of accumulation (not
inside a micro-batch nor after sync); see [`GradAcc.load_window!`](@ref). A sharded accumulation
saves its shard: the bytes load only into the same shard of an accumulation over as many ranks
(anything else throws `GRADACC_STATUS_CORRUPT_STATE`).
"""
save_window(a::Accumulator) = saved_bytes(gradacc_accumulator_save_window, a)

"""
    GradAcc.load_window!(acc, bytes) -> acc

Restores a window written by [`GradAcc.save_window`](@ref) from an accumulator with the same
tensors.
"""
function load_window!(a::Accumulator, bytes::AbstractVector{UInt8})
    b = Vector{UInt8}(bytes)
    check(gradacc_accumulator_load_window(a, b, length(b)))
    return a
end

"""
    GradAcc.merge_window!(acc, bytes) -> acc

Adds a window written by [`GradAcc.save_window`](@ref) (of an accumulator with the same tensors,
on any rank or device) into the window in progress: masters, counts and micro-batches add,
overflow flags OR, so windows saved on N ranks resume on M. Corrupt or foreign bytes throw
`GRADACC_STATUS_CORRUPT_STATE` and leave the window unchanged.
"""
function merge_window!(a::Accumulator, bytes::AbstractVector{UInt8})
    b = Vector{UInt8}(bytes)
    check(gradacc_accumulator_merge_window(a, b, length(b)))
    return a
end

# ---- mesh --------------------------------------------------------------------------------------

include("mesh.jl")

# ---- optimizer ---------------------------------------------------------------------------------

const ALGORITHM = Dict(:adamw => GRADACC_OPTIMIZER_ADAMW, :sgd => GRADACC_OPTIMIZER_SGD)
const ROUNDING = Dict(:nearest => GRADACC_ROUNDING_NEAREST_EVEN, :nearest_even => GRADACC_ROUNDING_NEAREST_EVEN,
                      :stochastic => GRADACC_ROUNDING_STOCHASTIC)
const MASTER_FORMAT = Dict(
    :fp32 => GRADACC_MASTERS_FP32,
    :bf16_remainder => GRADACC_MASTERS_BF16_REMAINDER,
    :none => GRADACC_MASTERS_NONE,
)
const MOMENTS = Dict(
    :fp32 => GRADACC_MOMENTS_FP32,
    :bf16 => GRADACC_MOMENTS_BF16,
    :int8_blockwise => GRADACC_MOMENTS_INT8_BLOCKWISE,
)

# The dtype code of model weight `i` of tensor dtype `declared`: from its element type, and
# `UInt16` words as the tensor's gradient dtype when that is 16-bit.
function weight_dtype(w::AbstractVector, declared, i::Integer)
    T = eltype(w)
    T === UInt16 && declared != GRADACC_DTYPE_F32 && return declared
    T === Float32 && return GRADACC_DTYPE_F32
    T === Float16 && return GRADACC_DTYPE_F16
    isbf16(T) && T !== UInt16 && return GRADACC_DTYPE_BF16
    throw(ArgumentError("weight $i has element type $T; use Float32, Float16, a BFloat16 type or UInt16 words"))
end

tensor_group(g::gradacc_tensor_group_t) = g
tensor_group(g::Tuple) = gradacc_tensor_group_t(g[1], g[2])
tensor_group(g::NamedTuple) = gradacc_tensor_group_t(get(g, :weight_decay, true), get(g, :lr_scale, 1.0f0))

"""
    Optimizer(acc, weights; algorithm=:adamw, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, rounding=:nearest, seed=0, master_format=:fp32, moments=:fp32, moment_seed=0, groups=nothing)
    Optimizer(acc, weights; algorithm=:sgd, lr, momentum=0, dampening=0, nesterov=false, weight_decay=0, ...)

FP32 master weights and AdamW or SGD state for the tensors of `acc`, stepped by
[`GradAcc.step!`](@ref) after each [`sync!`](@ref), which writes the model's `weights` (one
contiguous vector per tensor: `Float32`, `Float16`, a BFloat16 type or `UInt16` words) in place.
Keywords replace fields of `gradacc_optimizer_config_default`; SGD's `weight_decay` is 0 unless
given, as in `torch.optim.SGD`. `rounding` is `:nearest` or `:stochastic` (keyed by `seed`).
`master_format` is `:fp32`, `:bf16_remainder` (the bf16 weight plus a 16-bit remainder, the
FP32 master exactly, bf16 weights only) or `:none` (no masters: the weights are, rounded
stochastically when 16-bit, so `rounding=:stochastic`) and `moments` `:fp32`, `:bf16` (rounded stochastically,
keyed by `moment_seed`) or `:int8_blockwise` (8-bit blocks, CPU only): docs/optimizer.md,
"Smaller state".
`groups` gives each tensor `(weight_decay, lr_scale)` (or a named tuple of those). The masters
start as the weights' values (this rank's shard under a sharded boundary). The optimizer keeps
`acc` and the weights referenced. Destroyed by `close` or the GC.

`masters` (a `Vector{Float32}`) adopts the caller's FP32 master weights
(`gradacc_optimizer_create_with_masters`): this rank's range of the flat layout, `shard(acc)`'s
length (tensor i at `offset(acc, i) - shard.offset`). Its values are the masters, not overwritten
from the weights; every step updates it in place and `load!` writes into it. The optimizer keeps
it referenced; do not write it while a call on the optimizer runs.

`fp8 = Dict(i => (format, codes, scales))` makes the step write tensor `i` as FP8 for the
all-gather of a sharded boundary (docs/optimizer.md, "FP8 weights on the all-gather"): `format`
`:e4m3` (`scales` a `Vector{Float32}` of 1) or `:mxfp8` (`scales` a `Vector{UInt8}` of one per
block of 32), `codes` a `Vector{UInt8}` of the tensor's length, both written by every step;
`weights[i]` then gives only the initial values.

The contract is `gradacc_optimizer_create`'s and `gradacc_optimizer_step`'s (include/gradacc.h)
and docs/optimizer.md: one step per synced window, a skipped window changes nothing, and under
sharding every rank steps and all-gathers the weights.
"""
mutable struct Optimizer
    @atomic ptr::Ptr{gradacc_optimizer_t}
    const acc::Accumulator
    const weights::Vector{Any}
    const masters::Union{Nothing,Vector{Float32}}
    # Each FP8 tensor's scales (`nothing` for a model-dtype tensor); `nothing` when none is FP8.
    const scales::Union{Nothing,Vector{Any}}
    function Optimizer(acc::Accumulator, weights::AbstractVector; groups=nothing,
                       masters::Union{Nothing,Vector{Float32}}=nothing, fp8=nothing, kw...)
        n = length(acc.tensors)
        length(weights) == n || throw(ArgumentError("$(length(weights)) weights for $n tensors"))
        groups === nothing || length(groups) == n ||
            throw(ArgumentError("$(length(groups)) groups for $n tensors"))
        kw = Dict{Symbol,Any}(kw)
        haskey(kw, :algorithm) && (kw[:algorithm] = enum_value(ALGORITHM, :algorithm, kw[:algorithm]))
        haskey(kw, :rounding) && (kw[:rounding] = enum_value(ROUNDING, :rounding, kw[:rounding]))
        haskey(kw, :moments) && (kw[:moments] = enum_value(MOMENTS, :moments, kw[:moments]))
        # The config's `masters` field; the `masters` keyword adopts a buffer.
        haskey(kw, :master_format) && (kw[:masters] = enum_value(MASTER_FORMAT, :master_format, pop!(kw, :master_format)))
        if get(kw, :algorithm, GRADACC_OPTIMIZER_ADAMW) == GRADACC_OPTIMIZER_SGD && !haskey(kw, :weight_decay)
            kw[:weight_decay] = 0.0f0  # torch.optim.SGD's default, not AdamW's 0.01
        end
        formats, steps, scales = fp8_buffers(acc, fp8)
        scales === nothing || (kw[:weight_formats] = pointer(formats))
        cfg = Ref(config(gradacc_optimizer_config_t, gradacc_optimizer_config_default; kw...))
        codes = Vector{gradacc_dtype_t}(undef, n)
        for (i, w) in enumerate(weights)
            contiguous(w) || throw(ArgumentError("weight $i must be a contiguous vector"))
            length(w) == acc.tensors[i].numel ||  # the C API takes no lengths
                throw(DimensionMismatch("weight $i has $(length(w)) elements, tensor $i has $(acc.tensors[i].numel)"))
            codes[i] = weight_dtype(w, acc.tensors[i].dtype, i)
        end
        grp = groups === nothing ? Ptr{gradacc_tensor_group_t}(C_NULL) : [tensor_group(g) for g in groups]
        ws = Vector{Any}(weights)
        ptrs = [Ptr{Cvoid}(pointer(w)) for w in ws]
        out = Ref{Ptr{gradacc_optimizer_t}}(C_NULL)
        if masters === nothing
            GC.@preserve ws formats check(gradacc_optimizer_create(acc, cfg, grp, ptrs, codes, n, out))
        else
            GC.@preserve ws formats check(gradacc_optimizer_create_with_masters(acc, cfg, grp, ptrs, codes, n, masters,
                                                                                length(masters), out))
        end
        # From now on the step writes an FP8 tensor's codes, not its initial weights.
        for (i, c) in steps
            ws[i] = c
        end
        return finalizer(o -> destroy_quietly(o, gradacc_optimizer_destroy), new(out[], acc, ws, masters, scales))
    end
end

const FP8_FORMAT = Dict(:e4m3 => (GRADACC_WEIGHTS_E4M3_TENSORWISE, Float32, n -> 1),
                        :mxfp8 => (GRADACC_WEIGHTS_MXFP8, UInt8, n -> cld(n, 32)))

# The `fp8` keyword checked: the config's weight formats, the codes each FP8 tensor's step
# writes, and every tensor's scales (`nothing` throughout when no tensor is FP8).
function fp8_buffers(acc::Accumulator, fp8)
    n = length(acc.tensors)
    formats = zeros(gradacc_weight_format_t, n)
    (fp8 === nothing || isempty(fp8)) && return formats, Pair{Int,Any}[], nothing
    scales = Vector{Any}(nothing, n)
    steps = Pair{Int,Any}[]
    for (i, (format, codes, sc)) in fp8
        1 <= i <= n || throw(ArgumentError("fp8: $i is not a tensor index (1 to $n)"))
        haskey(FP8_FORMAT, format) || throw(ArgumentError("fp8[$i]: format $format is not one of $(keys(FP8_FORMAT))"))
        value, scale_type, scales_of = FP8_FORMAT[format]
        numel = acc.tensors[i].numel
        codes isa Vector{UInt8} && length(codes) == numel ||
            throw(DimensionMismatch("fp8[$i]: the codes must be a Vector{UInt8} of $numel elements"))
        sc isa Vector{scale_type} && length(sc) == scales_of(numel) ||
            throw(DimensionMismatch("fp8[$i]: the scales must be a Vector{$scale_type} of $(scales_of(numel)) elements"))
        formats[i] = value
        scales[i] = sc
        push!(steps, i => codes)
    end
    return formats, steps, scales
end

Base.isopen(x::Optimizer) = (@atomic x.ptr) != C_NULL
function handle(x::Optimizer)
    p = @atomic x.ptr
    p == C_NULL && throw(ArgumentError("the Optimizer is closed"))
    return p
end
# ccall keeps the object alive through the call and passes its C handle.
Base.cconvert(::Type{Ptr{gradacc_optimizer_t}}, x::Optimizer) = x
Base.unsafe_convert(::Type{Ptr{gradacc_optimizer_t}}, x::Optimizer) = handle(x)

"""
    close(opt::Optimizer)

Destroys the optimizer; calling it again, from any task, does nothing.
"""
function Base.close(o::Optimizer)
    p = @atomicswap o.ptr = C_NULL
    p == C_NULL || check(gradacc_optimizer_destroy(p))
    return nothing
end

Base.show(io::IO, o::Optimizer) =
    print(io, "GradAcc.Optimizer(", length(o.weights), " tensors", isopen(o) ? "" : ", closed", ")")

"""
    GradAcc.step!(opt[, comm]) -> Bool

The step after [`sync!`](@ref) of the optimizer's accumulator: writes the weights in place and
returns `true`, or returns `false` and changes nothing when the window held a non-finite value.
Under a sharded boundary every rank calls it with the communicator its sync took (omitted: a
sharded accumulation's own).
"""
function step!(o::Optimizer, comm::Union{Nothing,Communicator}=nothing)
    ws, ss = o.weights, o.scales
    ptrs = [Ptr{Cvoid}(pointer(w)) for w in ws]
    sptrs = ss === nothing ? Ptr{Ptr{Cvoid}}(C_NULL) : [s === nothing ? C_NULL : Ptr{Cvoid}(pointer(s)) for s in ss]
    stepped = Ref{Bool}(false)
    GC.@preserve ws ss check(gradacc_optimizer_step_scaled(o, o.acc, ptrs, sptrs, length(ptrs),
                                                           something(comm, Ptr{gradacc_comm_t}(C_NULL)), stepped))
    return stepped[]
end

"""
    GradAcc.set_lr!(opt, lr) -> opt

Sets the learning rate of the steps from the next one on.
"""
function set_lr!(o::Optimizer, lr::Real)
    check(gradacc_optimizer_set_lr(o, lr))
    return o
end

"""
    GradAcc.lr_device_ptr(opt) -> Ptr{Cvoid}

On a CUDA accumulator, the device address of the learning rate every step reads when it runs, for
a schedule on the device (see `gradacc_optimizer_lr_device_ptr`); throws DEVICE_MISMATCH on a CPU
accumulator.
"""
function lr_device_ptr(o::Optimizer)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(gradacc_optimizer_lr_device_ptr(o, out))
    return out[]
end

"""
    GradAcc.steps(opt) -> Int

The number of steps taken (a skipped step is not one).
"""
function steps(o::Optimizer)
    out = Ref{UInt64}(0)
    check(gradacc_optimizer_steps(o, out))
    return Int(out[])
end

"""
    GradAcc.save(opt::Optimizer) -> Vector{UInt8}

This rank's optimizer state as versioned bytes, for a checkpoint.
"""
save(o::Optimizer) = saved_bytes(gradacc_optimizer_save, o)

"""
    GradAcc.load!(opt::Optimizer, parts) -> opt

Restores the state from what [`GradAcc.save`](@ref) returned: one byte vector, or a vector of
the parts saved on any number of ranks (together covering this rank's elements, each rank's
once). Corrupt, foreign or insufficient parts throw `GRADACC_STATUS_CORRUPT_STATE`, a part given
twice `GRADACC_STATUS_INVALID_ARGUMENT`; either way nothing changes.
"""
load!(o::Optimizer, bytes::AbstractVector{UInt8}) = load!(o, [bytes])
function load!(o::Optimizer, parts::AbstractVector{<:AbstractVector{UInt8}})
    bufs = [Vector{UInt8}(p) for p in parts]
    ptrs = [pointer(b) for b in bufs]
    lens = Csize_t[length(b) for b in bufs]
    GC.@preserve bufs check(gradacc_optimizer_load(o, ptrs, lens, length(bufs)))
    return o
end

end # module
