# The mesh step (gradacc_mesh_*), included by GradAcc.jl: one boundary over every accumulator of a
# rank and every rank of a job with tensor, pipeline, context or expert parallelism beside data
# parallelism. docs/model-parallelism.md states the rules; this file only carries them across.

"""
    GradAcc.Mesh(world, data_rank, data_size; max_grad_norm=0)

One boundary over a job's accumulators, for tensor, pipeline, context or expert parallelism
beside data parallelism: `world`, a host [`Communicator`](@ref) of every rank of the job, and
this rank's data-parallel rank `data_rank` (0-based, as [`GradAcc.rank`](@ref)) of `data_size`:
the ranks that see different data (data-parallel x context-parallel; in Megatron-Core's order,
tensor-parallel fastest, then context, data, pipeline: `data_rank = cp + CP * dp`).
`max_grad_norm` clips the global norm (0: off). The mesh holds its own reference to `world`'s
group: `close(world)` first releases only the handle. Destroyed by `close` or the GC.
[`sync!`](@ref) with its parts is the step; docs/model-parallelism.md states the rules. Public,
not exported (other packages name a `Mesh` too).
"""
mutable struct Mesh
    @atomic ptr::Ptr{gradacc_mesh_t}
    function Mesh(world::Communicator, data_rank::Integer, data_size::Integer; max_grad_norm::Real=0)
        out = Ref{Ptr{gradacc_mesh_t}}(C_NULL)
        check(gradacc_mesh_create(world, u32(data_rank, "data_rank"), u32(data_size, "data_size"),
                                  max_grad_norm, out))
        return finalizer(m -> destroy_quietly(m, gradacc_mesh_destroy), new(out[]))
    end
end

Base.isopen(x::Mesh) = (@atomic x.ptr) != C_NULL
function handle(x::Mesh)
    p = @atomic x.ptr
    p == C_NULL && throw(ArgumentError("the Mesh is closed"))
    return p
end
# ccall keeps the object alive through the call and passes its C handle.
Base.cconvert(::Type{Ptr{gradacc_mesh_t}}, x::Mesh) = x
Base.unsafe_convert(::Type{Ptr{gradacc_mesh_t}}, x::Mesh) = handle(x)

"""
    close(mesh::Mesh)

Destroys the mesh; calling it again, from any task, does nothing.
"""
function Base.close(m::Mesh)
    p = @atomicswap m.ptr = C_NULL
    p == C_NULL || check(gradacc_mesh_destroy(p))
    return nothing
end

Base.show(io::IO, m::Mesh) = print(io, "GradAcc.Mesh(", isopen(m) ? "open" : "closed", ")")

# A C uint32_t from a Julia integer, or the binding's error naming the argument.
function u32(v::Integer, what)
    0 <= v <= typemax(UInt32) || throw(ArgumentError("`$what` = $v: from 0 to $(typemax(UInt32))"))
    return UInt32(v)
end

"""
    GradAcc.MeshPart(acc[, comm]; replicas=nothing, replicated=())

One accumulator of a mesh step and the group it reduces over: `comm` as [`sync!`](@ref)'s
(omitted when it is alone, or for a sharded accumulation's own communicator), `replicas` a hybrid
boundary's replica group (`comm` is then the shard group), `replicated` its replicated tensors as
`(tensor, key, copies)`: tensor `tensor` (1-based, as [`GradAcc.master`](@ref)) is held alike by
`copies` model-parallel ranks at one data-parallel rank, with the same `key` on every copy (a
hash of the parameter's name), and enters the global norm once. The accumulator is on the CPU,
created with `max_grad_norm=0` (the mesh clips), and with `tensor_stats=true` when the part
declares replicated tensors.
"""
struct MeshPart
    accumulator::Union{Nothing,Accumulator}
    comm::Union{Nothing,Communicator}
    replicas::Union{Nothing,Communicator}
    replicated::Vector{Tuple{Int,UInt64,Int}}
end
MeshPart(acc::Union{Nothing,Accumulator}, comm::Union{Nothing,Communicator}=nothing; replicas=nothing,
         replicated=()) =
    MeshPart(acc, comm, replicas, [(Int(t), k % UInt64, Int(c)) for (t, k, c) in replicated])

"""
    GradAcc.MeshInfo

A mesh step's report, the same on every rank: `info`, the `gradacc_sync_info_t` of the job (the
totals over the data axes, the global norm and clip coefficient, an overflow's world rank), whose
fields it also has (`m.total_count`, ...), and `overflow_part`, the part (1-based) of that rank's
step where the job first went non-finite, `nothing` when none. [`GradAcc.overflow`](@ref) reads
the place.
"""
struct MeshInfo
    info::gradacc_sync_info_t
    overflow_part::Union{Nothing,Int}
end
Base.getproperty(m::MeshInfo, f::Symbol) =
    f === :info || f === :overflow_part ? getfield(m, f) : getfield(getfield(m, :info), f)
Base.propertynames(::MeshInfo) = (:info, :overflow_part, fieldnames(gradacc_sync_info_t)...)

"""
    GradAcc.overflow(m::MeshInfo) -> Union{Nothing, Symbol, NamedTuple}

As `GradAcc.overflow(m.info)`, with the part: `(rank=r, part=p, microbatch=m, tensor=t)`, the
world rank 0-based and the part, micro-batch and tensor 1-based.
"""
function overflow(m::MeshInfo)
    o = overflow(m.info)
    o isa NamedTuple || return o
    return (rank=o.rank, part=m.overflow_part, microbatch=o.microbatch, tensor=o.tensor)
end

# An object's C handle, NULL when it is `nothing` or closed (the caller preserves the object).
raw_handle(::Nothing) = C_NULL
raw_handle(o::Union{Accumulator,Communicator}) = @atomic o.ptr

# Part i's replicated tensors as C entries, or the binding's error for a bad one.
function replicated_entries(p::MeshPart, i)
    entries = gradacc_replicated_t[]
    for (j, (t, k, c)) in enumerate(p.replicated)
        1 <= t <= Int(typemax(UInt32)) + 1 && 0 <= c <= typemax(UInt32) ||
            return entries, ArgumentError("parts[$i].replicated[$j] = $((t, k, c)): the tensor is 1-based " *
                                          "and below 2^32 + 1, the copies below 2^32")
        push!(entries, gradacc_replicated_t(t - 1, c, k))
    end
    return entries, nothing
end

"""
    sync!(mesh::GradAcc.Mesh, parts) -> GradAcc.MeshInfo

The mesh step over this rank's parts (a vector of [`GradAcc.MeshPart`](@ref), or of tuples of
its positional arguments): every rank of the world calls it from its own task and thread, and
the ranks of each part's group give that part at the same position. Each part is reduced over
its group and normalised by the job's totals (item counts summed over the data axes only; ranks
at one data-parallel rank must count alike, or every rank throws naming them); the norm counts
every distinct element once and one clip coefficient applies everywhere. A non-finite value on
any rank skips the step on every rank, and the report names the world rank and its part. Every
part's window reports it, so [`GradAcc.update!`](@ref) and each optimizer's step follow it.

An invalid part on one rank (no parts, a `nothing` accumulator, a bad replicated entry) throws
there naming it and `GRADACC_STATUS_PEER_FAILURE` on the other ranks. A closed accumulator or
communicator, or a replicated entry the binding refuses, goes in as a NULL accumulator, so the
step is refused on every rank too, and this rank throws the binding's `ArgumentError`; a closed
communicator's group can no longer be named, so its peers wait until their timeout, as they do
for a closed mesh. A failure before the reductions leaves every window intact. The library's
messages count parts and entries from 0, as the C API does (`parts[0]`); the binding's from 1.
"""
function sync!(m::Mesh, parts::AbstractVector)
    mp = handle(m)
    ps = MeshPart[p isa MeshPart ? p : MeshPart(p...) for p in parts]
    entries = Vector{Vector{gradacc_replicated_t}}(undef, length(ps))
    raw = Vector{gradacc_mesh_part_t}(undef, max(length(ps), 1))
    refused = nothing
    for (i, p) in enumerate(ps)
        entries[i], bad = replicated_entries(p, i)
        objs = (p.accumulator, p.comm, p.replicas)
        closed = findfirst(o -> o !== nothing && !isopen(o), objs)
        if bad === nothing && closed !== nothing
            bad = ArgumentError("parts[$i]: the $(nameof(typeof(objs[closed]))) is closed")
        end
        refused === nothing && (refused = bad)
        # A part the binding refuses goes in with a NULL accumulator: the library refuses the
        # step on every rank, and its groups are still told.
        acc = bad === nothing ? raw_handle(p.accumulator) : Ptr{gradacc_accumulator_t}(C_NULL)
        raw[i] = gradacc_mesh_part_t(sizeof(gradacc_mesh_part_t), acc, raw_handle(p.comm), raw_handle(p.replicas),
                                     isempty(entries[i]) ? C_NULL : pointer(entries[i]), length(entries[i]))
    end
    info = out_struct(gradacc_sync_info_t)
    part = Ref{UInt32}(typemax(UInt32))
    status = GC.@preserve m ps entries raw begin
        arr = isempty(ps) ? Ptr{gradacc_mesh_part_t}(C_NULL) : pointer(raw)
        gradacc_mesh_sync(mp, arr, length(ps), info, part)
    end
    refused === nothing || throw(refused)
    check(status)
    return MeshInfo(info[], part[] == typemax(UInt32) ? nothing : Int(part[]) + 1)
end

"""
    end_microbatch!(mesh::GradAcc.Mesh, accs::Accumulator...) -> Bool

Ends the open micro-batch of each of this rank's accumulators (`overflow = :drop_microbatch`, fed
tensor by tensor), its drop agreed over the world first: if any rank at this data-parallel rank
found a non-finite gradient in any of its accumulators, every one of them drops it. Every rank
calls it once per micro-batch; `true` when this rank kept the micro-batch. A closed accumulator
goes in as NULL, so every rank fails, and this rank throws the binding's `ArgumentError`.
"""
function end_microbatch!(m::Mesh, accs::Accumulator...)
    mp = handle(m)
    closed = findfirst(a -> !isopen(a), accs)
    ptrs = Ptr{gradacc_accumulator_t}[raw_handle(a) for a in accs]
    closed === nothing || (ptrs[closed] = C_NULL)
    kept = Ref{UInt32}(0)
    status = GC.@preserve m accs ptrs gradacc_mesh_end_microbatch(mp, isempty(ptrs) ? C_NULL : pointer(ptrs),
                                                                   length(ptrs), kept)
    closed === nothing || throw(ArgumentError("accumulators[$closed]: the Accumulator is closed"))
    check(status)
    return kept[] == 1
end

"""
    GradAcc.MeshShape(world_size; tp=1, pp=1, cp=1, ep=1, etp=1, order=nothing)

A mesh's shape, for frameworks without their own parallel state: `world_size` ranks, `tp`, `pp`
and `cp` ranks on those axes (data parallel takes the rest), the experts of each pipeline stage
over `ep` x `etp` of its ranks; `order` the dense axes' rank order, fastest first, as
Megatron-Core writes it (`nothing`: its `"tp-cp-dp-pp"`). Axis lists are names joined by '-':
`"cp-dp"` (the data axes), `"tp"`, `"edp"`. [`GradAcc.mesh_group`](@ref) gives a rank's place
in a group, [`GradAcc.mesh_split`](@ref) splits the group from an MPI world. Destroyed by `close`
or the GC. Public, not exported.
"""
mutable struct MeshShape
    @atomic ptr::Ptr{gradacc_mesh_shape_t}
    function MeshShape(world_size::Integer; tp::Integer=1, pp::Integer=1, cp::Integer=1, ep::Integer=1,
                       etp::Integer=1, order::Union{Nothing,AbstractString}=nothing)
        out = Ref{Ptr{gradacc_mesh_shape_t}}(C_NULL)
        corder = order === nothing ? Ptr{Cchar}(C_NULL) : order
        GC.@preserve corder check(gradacc_mesh_shape_create(u32(world_size, "world_size"), u32(tp, "tp"),
                                                            u32(pp, "pp"), u32(cp, "cp"), u32(ep, "ep"),
                                                            u32(etp, "etp"), corder, out))
        return finalizer(s -> destroy_quietly(s, gradacc_mesh_shape_destroy), new(out[]))
    end
end

Base.isopen(x::MeshShape) = (@atomic x.ptr) != C_NULL
function handle(x::MeshShape)
    p = @atomic x.ptr
    p == C_NULL && throw(ArgumentError("the MeshShape is closed"))
    return p
end
Base.cconvert(::Type{Ptr{gradacc_mesh_shape_t}}, x::MeshShape) = x
Base.unsafe_convert(::Type{Ptr{gradacc_mesh_shape_t}}, x::MeshShape) = handle(x)

"""
    close(shape::MeshShape)

Destroys the shape; calling it again, from any task, does nothing.
"""
function Base.close(s::MeshShape)
    p = @atomicswap s.ptr = C_NULL
    p == C_NULL || check(gradacc_mesh_shape_destroy(p))
    return nothing
end

"""
    GradAcc.mesh_group(shape, rank, axes) -> (; color, key, size)

World rank `rank`'s (0-based) group over `axes`: its smallest world rank (`color`, a split's
color), the rank's index in it (`key`: its rank there, 0-based) and its `size`. For
[`GradAcc.Mesh`](@ref), `data_rank` and `data_size` are the key and the size over `"cp-dp"`.
"""
function mesh_group(shape::MeshShape, rank::Integer, axes::AbstractString)
    color, key, size = Ref{UInt32}(0), Ref{UInt32}(0), Ref{UInt32}(0)
    check(gradacc_mesh_shape_group(shape, u32(rank, "rank"), axes, color, key, size))
    return (; color=Int(color[]), key=Int(key[]), size=Int(size[]))
end

"""
    GradAcc.mesh_split(shape, world, axes) -> Communicator

This rank's group over `axes`, split from `world` (an MPI [`Communicator`](@ref) of every rank of
the mesh, ranked as the world). Collective: every rank calls it with the same axes; close the
result explicitly on every rank, as any MPI communicator.
"""
function mesh_split(shape::MeshShape, world::Communicator, axes::AbstractString)
    out = Ref{Ptr{gradacc_comm_t}}(C_NULL)
    check(gradacc_mesh_shape_split(shape, world, axes, out))
    return Communicator(out[], world.backend)
end
