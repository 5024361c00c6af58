# The mesh step (GradAcc.Mesh, included by runtests.jl) on dp 2 x tp 2 ranks in Megatron-Core's
# order (world rank = tp + 2 * dp): one accumulator per rank reduced over its data-parallel group,
# tensor 1 sharded over tp and tensor 2 replicated over tp. The gradients are eighths, so every
# sum is exact in Float32 and the Float64 reference is the exact result before the one division
# by the job's count.

const MESH_TP, MESH_DP = 2, 2
const MESH_COUNTS = ([3, 5], [2, 4])  # per data rank, per micro-batch: the job's count is 14
const MESH_TOTAL = 14
const MESH_KEY = 0x6e6f726d           # the replicated tensor's key, the same on both copies
const MESH_TENSORS = [(6, Float32), (3, Float32)]

# Tensor t's gradient at data rank d, micro-batch mb (0-based) and tp rank tp; the replicated
# tensor 2 has no tp term.
function mesh_grad(d, mb, tp, t)
    n, off = t == 1 ? (6, 5tp) : (3, 11)
    return Float32[((d * 7 + mb * 3 + off + j) % 9 - 4) / 8 for j in 0:n-1]
end

# Tensor t's reduced gradient at tp rank tp, normalised by the job's count, in Float64.
mesh_reference(tp, t) =
    sum(Float64.(mesh_grad(d, mb, tp, t)) for d in 0:MESH_DP-1 for mb in 0:length(MESH_COUNTS[d + 1])-1) ./
    MESH_TOTAL

# The job's norm: both shards of tensor 1, the replicated tensor 2 once.
mesh_norm() = sqrt(sum(sum(abs2, mesh_reference(tp, 1)) for tp in 0:MESH_TP-1) + sum(abs2, mesh_reference(0, 2)))

# Rank r's window added to acc (on the calling task, before the ranks' tasks sync): `poison` puts
# an inf into tensor 1 of micro-batch 2, `extra` adds to the count of micro-batch 1.
function mesh_window!(acc, s, r; poison=false, extra=0)
    d, tp = divrem(r, MESH_TP)
    for (mb, n) in enumerate(MESH_COUNTS[d + 1])
        g1, g2 = mesh_grad(d, mb - 1, tp, 1), mesh_grad(d, mb - 1, tp, 2)
        poison && mb == 2 && (g1[3] = Inf32)
        add!(acc, s, [g1, g2], n + (mb == 1 ? extra : 0))
    end
    return acc
end

mesh_scaler() = Scaler(init_scale=1.0, min_scale=2.0^-10)  # scale 1: the gradients go in as they are
mesh_accumulator() = Accumulator(MESH_TENSORS; loss_reduction=:sum, tensor_stats=true)

# A dp 2 x tp 2 world: its world communicators, each rank's data-parallel one, and each rank's mesh.
function mesh_world(; max_grad_norm=0.0)
    world, data = local_group(MESH_TP * MESH_DP), [local_group(MESH_DP) for _ in 1:MESH_TP]
    dp = [data[r % MESH_TP + 1][r ÷ MESH_TP + 1] for r in 0:MESH_TP*MESH_DP-1]
    meshes = [GradAcc.Mesh(world[r + 1], r ÷ MESH_TP, MESH_DP; max_grad_norm) for r in 0:MESH_TP*MESH_DP-1]
    return world, dp, meshes
end

mesh_part(acc, comm) = GradAcc.MeshPart(acc, comm; replicated=[(2, MESH_KEY, MESH_TP)])

# The exception f throws, GradAccError or not (nothing when it returns).
function mesh_caught(f)
    try
        f()
        return nothing
    catch e
        return e
    end
end

# The job's count is the data ranks' only, its norm has the replicated tensor once, every rank
# gets the same report, and an inf on rank 3 skips the step on every rank, naming world rank 3
# and its part 1.
@testset "mesh step on dp 2 x tp 2, max_grad_norm $(max_grad_norm)" for max_grad_norm in (0.0, mesh_norm() / 2)
    norm = mesh_norm()
    world, dp, meshes = mesh_world(; max_grad_norm)
    scalers = [mesh_scaler() for _ in 0:3]
    good = [mesh_window!(mesh_accumulator(), scalers[r + 1], r) for r in 0:3]
    bad = [mesh_window!(mesh_accumulator(), scalers[r + 1], r; poison=r == 3) for r in 0:3]
    infos = on_ranks(world, dp) do r
        return (sync!(meshes[r + 1], [mesh_part(good[r + 1], dp[r + 1])]),
                sync!(meshes[r + 1], [mesh_part(bad[r + 1], dp[r + 1])]))
    end
    for r in 0:3
        g, f = infos[r + 1]
        @test g isa GradAcc.MeshInfo && g == infos[1][1]  # the norm's and the coefficient's bits too
        @test (g.total_count, g.microbatches, g.found_inf) == (MESH_TOTAL, 4, false)
        @test g.overflow_part === nothing && GradAcc.overflow(g) === nothing
        @test isapprox(g.grad_norm, norm; rtol=1e-6)
        coef = max_grad_norm > 0 ? g.clip_coef : 1.0
        max_grad_norm > 0 && @test isapprox(g.clip_coef, max_grad_norm / (g.grad_norm + 1e-6); rtol=1e-6)
        for t in 1:2
            want = mesh_reference(r % MESH_TP, t) .* coef
            @test all(abs.(master(good[r + 1], t) .- want) .<= 2.0^-21 .* abs.(want))
        end
        @test f == infos[1][2] && f.found_inf && f.overflow_part == 1
        @test GradAcc.overflow(f) == (rank=3, part=1, microbatch=2, tensor=1)
        @test update!(scalers[r + 1], bad[r + 1])  # skipped, on every rank
        @test scale(scalers[r + 1]) == 0.5f0
    end
    foreach(close, [good; bad; scalers; meshes; world; dp])
end

# Tp peers 0 and 1 share data rank 0; rank 1 counts one item more. Every rank throws, naming both
# world ranks, and every window is intact: once rank 1 adds its window again, the step succeeds.
@testset "a count mismatch between tp peers fails on every rank" begin
    world, dp, meshes = mesh_world()
    s = mesh_scaler()
    accs = [mesh_window!(mesh_accumulator(), s, r; extra=r == 1 ? 1 : 0) for r in 0:3]
    errs = on_ranks(world, dp; timeout=30) do r
        return thrown(() -> sync!(meshes[r + 1], [mesh_part(accs[r + 1], dp[r + 1])]))
    end
    for err in errs
        @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT &&
              occursin("world ranks 0 and 1 share data-parallel rank 0", err.message)
    end
    mesh_window!(reset!(accs[2]), s, 1)
    infos = on_ranks(world, dp; timeout=30) do r
        return sync!(meshes[r + 1], [mesh_part(accs[r + 1], dp[r + 1])])
    end
    @test all(info -> info.total_count == MESH_TOTAL, infos)
    foreach(close, [accs; [s]; meshes; world; dp])
end

# A bad part on one rank throws there naming it and PEER_FAILURE on every other rank, the windows
# intact: no parts (every rank), `nothing` for rank 1's accumulator, a replicated tensor out of
# range on rank 2, a closed accumulator on rank 0 and a tensor 0 on rank 3 (both refused by the
# binding, which still tells the other ranks).
@testset "bad mesh parts fail on every rank" begin
    world, dp, meshes = mesh_world()
    s = mesh_scaler()
    accs = [mesh_window!(mesh_accumulator(), s, r) for r in 0:3]
    closed = mesh_accumulator()
    close(closed)
    steps = [  # (the rank that passes a bad part, its parts, the check of its exception)
        (nothing, _ -> GradAcc.MeshPart[],
         e -> e isa GradAccError && e.status == GradAcc.GRADACC_STATUS_NULL_ARGUMENT && occursin("`parts` is NULL", e.message)),
        (1, r -> [GradAcc.MeshPart(nothing, dp[r + 1])],
         e -> e isa GradAccError && e.status == GradAcc.GRADACC_STATUS_NULL_ARGUMENT &&
              occursin("`parts[0].accumulator` is NULL", e.message)),
        (2, r -> [GradAcc.MeshPart(accs[r + 1], dp[r + 1]; replicated=[(10, 1, MESH_TP)])],
         e -> e isa GradAccError && e.status == GRADACC_STATUS_INVALID_ARGUMENT && occursin("parts[0].replicated[0]", e.message)),
        (0, r -> [mesh_part(closed, dp[r + 1])],
         e -> e isa ArgumentError && occursin("the Accumulator is closed", e.msg)),
        (3, r -> [GradAcc.MeshPart(accs[r + 1], dp[r + 1]; replicated=[(0, MESH_KEY, MESH_TP)])],
         e -> e isa ArgumentError && occursin("parts[1].replicated[1]", e.msg)),
    ]
    results = on_ranks(world, dp; timeout=30) do r
        errs = map(steps) do (at, parts, _)
            mine = at === nothing || at == r ? parts(r) : [mesh_part(accs[r + 1], dp[r + 1])]
            return mesh_caught(() -> sync!(meshes[r + 1], mine))
        end
        return errs, sync!(meshes[r + 1], [mesh_part(accs[r + 1], dp[r + 1])])
    end
    for (r, (errs, after)) in zip(0:3, results)
        for ((at, _, ok), err) in zip(steps, errs)
            if at === nothing || at == r
                @test ok(err)
            else
                @test err isa GradAccError && err.status == GRADACC_STATUS_PEER_FAILURE
            end
        end
        @test after.total_count == MESH_TOTAL
    end
    foreach(close, [accs; [s]; meshes; world; dp])
end

@testset "mesh arguments are checked" begin
    (comm,) = local_group(1)
    err = thrown(() -> GradAcc.Mesh(comm, 1, 1))
    @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT &&
          occursin("`data_rank` = 1 is not below `data_size` = 1", err.message)
    @test mesh_caught(() -> GradAcc.Mesh(comm, -1, 1)) isa ArgumentError
    mesh = GradAcc.Mesh(comm, 0, 1; max_grad_norm=1.0)
    @test isopen(mesh)
    close(mesh)
    close(mesh)  # idempotent
    @test !isopen(mesh) && occursin("closed", sprint(show, mesh))
    @test mesh_caught(() -> sync!(mesh, GradAcc.MeshPart[])) isa ArgumentError
    # The mesh keeps its own reference to the world's group.
    mesh = GradAcc.Mesh(comm, 0, 1)
    close(comm)
    s = mesh_scaler()
    acc = mesh_window!(mesh_accumulator(), s, 0)
    info = sync!(mesh, [(acc,)])  # a tuple of MeshPart's arguments
    @test info.total_count == 8 && !info.found_inf
    foreach(close, (acc, s, mesh))
end

@testset "mesh shape" begin
    # World 16, tp 2, pp 2 in Megatron-Core's order: tp groups {0, 1}, {2, 3}, ...; dp groups
    # {1, 3, 5, 7}, ...; pp groups {5, 13}.
    shape = GradAcc.MeshShape(16; tp=2, pp=2)
    @test GradAcc.mesh_group(shape, 5, "tp") == (; color=4, key=1, size=2)
    @test GradAcc.mesh_group(shape, 5, "dp") == (; color=1, key=2, size=4)
    @test GradAcc.mesh_group(shape, 5, "pp") == (; color=5, key=0, size=2)
    err = thrown(() -> GradAcc.mesh_group(shape, 0, "tp-xp"))
    @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT && occursin("\"xp\" is none of", err.message)
    close(shape)
    close(shape)  # idempotent
    @test !isopen(shape)
    dp_first = GradAcc.MeshShape(4; tp=2, order="dp-tp-cp-pp")
    @test [GradAcc.mesh_group(dp_first, r, "tp").color for r in 0:3] == [0, 1, 0, 1]
    close(dp_first)
    err = thrown(() -> GradAcc.MeshShape(4; tp=2, order="tp-dp"))
    @test err isa GradAccError && occursin("a permutation of tp, cp, dp and pp", err.message)
    # An in-process world is not split.
    (comm,) = local_group(1)
    one = GradAcc.MeshShape(1)
    err = thrown(() -> GradAcc.mesh_split(one, comm, "dp"))
    @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT && occursin("cannot be split", err.message)
    foreach(close, (one, comm))
end
