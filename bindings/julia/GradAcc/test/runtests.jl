# The seed scenarios through the Julia binding. Ranks run as tasks on separate threads (up to 4
# ranks), so this file re-runs itself with 4 threads when started with fewer.
using Test

if Threads.nthreads() < 4
    cmd = `$(Base.julia_cmd()) --project=$(Base.active_project()) -t 4 $(@__FILE__)`
    @test success(pipeline(cmd; stdout, stderr))
    exit()
end

using GradAcc
using GradAcc: GRADACC_STATUS_SIZE_MISMATCH, GRADACC_STATUS_CORRUPT_STATE, GRADACC_DTYPE_BF16,
               GRADACC_STATUS_INVALID_ARGUMENT, GRADACC_STATUS_COMM_FAILURE, GRADACC_STATUS_TIMEOUT,
               GRADACC_STATUS_PEER_FAILURE, GRADACC_SHARDING_REDUCE_SCATTER, GRADACC_DTYPE_F16,
               GRADACC_SHARDING_ACCUMULATE, GRADACC_STATUS_BACKEND_UNAVAILABLE, GRADACC_STATUS_WRONG_STATE,
               rank, world_size, update!, scale, master, reset!
using BFloat16s: BFloat16s

bf16(x::Float32) = UInt16(reinterpret(UInt32, x) >> 16)

# The GradAccError a call throws (nothing when it returns).
function thrown(f)
    try
        f()
        return nothing
    catch e
        e isa GradAccError || rethrow()
        return e
    end
end

# The window of one rank that added one Float32 micro-batch of `count` items.
function saved_window(grad, count)
    s = Scaler(init_scale=1.0)
    acc = Accumulator([(length(grad), Float32)])
    add!(acc, s, [Float32.(grad)], count)
    window = GradAcc.save_window(acc)
    close(acc); close(s)
    return window
end

function one_microbatch!(acc)
    s = Scaler(init_scale=1.0)
    add!(acc, s, [Float32[1, 1]], 1)
    close(s)
    return acc
end

# 18003 elements at 0, 7040, 12096 and 18112 (each tensor at a multiple of GRADACC_MASTER_ALIGN
# bytes): a flat master of 18176, 2 shards of 12288 and 5888, 3 of 8192, 8192 and 1792 (blocks of
# 4096).
const SHARD_TENSORS = [(7000, Float16), (5000, Float32), (6000, :bf16), (3, Float32)]
const SHARD_OFFSETS = [0, 7040, 12096, 18112]
const SHARD_TOTAL = 18176

# The flat master of `acc` over SHARD_TENSORS: each tensor's master at its offset, zeros in the
# padding.
function flat_master(acc)
    flat = zeros(Float32, SHARD_TOTAL)
    for (i, (n, _)) in enumerate(SHARD_TENSORS)
        at = GradAcc.offset(acc, i)
        flat[at+1:at+n] = master(acc, i)
    end
    return flat
end

# One micro-batch of loss-scaled random gradients in each tensor's dtype (bf16 as UInt16 words).
function random_grads()
    return map(SHARD_TENSORS) do (n, T)
        g = randn(Float32, n) .* 64f0
        T === Float16 ? Float16.(g) : T === :bf16 ? bf16.(g) : g
    end
end

microbatch_count(r, m) = 1 + (3r + m) % 5

# The collectives of a rank run on their own thread. While one is blocked in the C call, that
# thread cannot reach a GC safepoint, so the accumulators are filled beforehand, on this task,
# and the ranks' tasks only sync; the timeout turns a hang into a failure.
function on_ranks(f, comms_per_rank...; timeout=60)
    for comms in comms_per_rank
        foreach(c -> GradAcc.set_timeout!(c, timeout), comms)
    end
    return fetch.([Threads.@spawn f(r) for r in 0:length(first(comms_per_rank))-1])
end

# Rank r of `world`: a sharded and an unsharded accumulator with the same three random
# micro-batches added.
function sharded_and_unsharded(world, r, max_grad_norm)
    s = Scaler(init_scale=1024.0)
    sharded = Accumulator(SHARD_TENSORS; sharding=:reduce_scatter, shard_count=world, shard_rank=r,
                          max_grad_norm=max_grad_norm)
    plain = Accumulator(SHARD_TENSORS; max_grad_norm=max_grad_norm)
    for m in 0:2
        g = random_grads()
        add!(sharded, s, g, microbatch_count(r, m))
        add!(plain, s, g, microbatch_count(r, m))
    end
    close(s)
    return sharded, plain
end

# The communicators of a 2x2 grid, per rank: rank g = 2a + i is rank i of shard group a and rank a
# of replica group i. `crosswise` joins shard group 1 to the replica groups the other way round,
# so each replica group holds shards 0 and 1.
function hybrid_grid(; crosswise=false)
    shard_groups, replica_groups = [local_group(2) for _ in 1:2], [local_group(2) for _ in 1:2]
    shard = [shard_groups[g ÷ 2 + 1][g % 2 + 1] for g in 0:3]
    replicas = [replica_groups[(crosswise && g ÷ 2 == 1 ? 1 - g % 2 : g % 2) + 1][g ÷ 2 + 1] for g in 0:3]
    return shard, replicas
end

# Rank g of a 2x2 grid: a sharded accumulator (shard g % 2 of 2) and an unsharded one with the
# same three random micro-batches added.
function hybrid_and_ddp(g, max_grad_norm)
    s = Scaler(init_scale=1024.0)
    hybrid = Accumulator(SHARD_TENSORS; sharding=:reduce_scatter, shard_count=2, shard_rank=g % 2,
                         max_grad_norm=max_grad_norm)
    ddp = Accumulator(SHARD_TENSORS; max_grad_norm=max_grad_norm)
    for m in 0:2
        grads = random_grads()
        add!(hybrid, s, grads, microbatch_count(g, m))
        add!(ddp, s, grads, microbatch_count(g, m))
    end
    close(s)
    return hybrid, ddp
end

# Each rank of a local group of `world` syncs an accumulator holding shard `ranks[r + 1]` of
# `count`: the GradAccError each rank's sync threw (nothing if none).
function sharded_sync_errors(world, count, ranks)
    comms = local_group(world)
    accs = [one_microbatch!(Accumulator([(2, Float32)]; sharding=:reduce_scatter, shard_count=count,
                                        shard_rank=ranks[r + 1])) for r in 0:world-1]
    errs = on_ranks(r -> thrown(() -> sync!(accs[r + 1], comms[r + 1])), comms; timeout=30)
    close.(accs); close.(comms)
    return errs
end

# Rank r of `world`'s sharded accumulation over `comm`, with buckets small enough that every
# micro-batch is reduced in several pieces. Each add is a collective: the ranks' tasks add.
sharded_accumulation(world, r, comm; kw...) =
    Accumulator(SHARD_TENSORS; sharding=:accumulate, shard_count=world, shard_rank=r, comm, bucket_numel=4096, kw...)

@testset "GradAcc" begin
    @testset "version" begin
        @test GradAcc.version() == VersionNumber(GradAcc.GRADACC_VERSION_STRING)
        @test pkgversion(GradAcc) == GradAcc.version()  # Project.toml follows Cargo.toml
    end

    # Seed apex-o2: Linear(1,1), loss = mean(output), inputs 1 and 2 on two ranks, two
    # micro-batches each, loss scale 1. Apex O2 gives rank 0 2.5 and rank 1 3.5.
    @testset "apex-o2 $normalize $T" for (normalize, w, b) in ((:by_world, 3.0f0, 2.0f0),
                                                               (:by_microbatches, 1.5f0, 1.0f0)),
                                         T in (Float16, Float32, :bf16)
        comms = local_group(2)
        results = fetch.([Threads.@spawn begin
            s = Scaler(init_scale=1.0)
            acc = Accumulator([(1, T), (1, T)]; normalize)
            x = Float32(r)
            grads = T === :bf16 ? [[bf16(x)], [bf16(1f0)]] : [T[x], T[1]]
            for _ in 1:2
                add!(acc, s, grads, 1)
            end
            info = sync!(acc, comms[r])
            out = (info, copy(master(acc, 1)), copy(master(acc, 2)), update!(s, acc), rank(comms[r]),
                   world_size(comms[r]))
            close(acc); close(acc); close(s)
            out
        end for r in 1:2])
        for (r, (info, gw, gb, skipped, rk, ws)) in enumerate(results)
            @test rk == r - 1 && ws == 2
            @test !skipped && !info.found_inf
            @test info.total_count == 4 && info.microbatches == 4
            @test gw == [w] && gb == [b]
        end
        @test results[1][2] == results[2][2]
        close.(comms)
    end

    # Seed accelerate: x = 1..8, y = 2x, w = 0, MSE, 4 micro-batches of 2, SGD lr 0.02: w = 2.04.
    @testset "accelerate" begin
        x = Float64.(1:8); y = 2 .* x
        s = Scaler(init_scale=1.0)
        acc = Accumulator([(1, Float32)])
        w = 0f0
        for m in 0:3
            xb, yb = x[2m+1:2m+2], y[2m+1:2m+2]
            g = sum(2 .* (w .* xb .- yb) .* xb) / 2
            add!(acc, s, [Float32[g]], 2)
        end
        info = sync!(acc)
        @test info.total_count == 8
        @test !update!(s, acc)
        m = master(acc, 1)  # keeps acc alive while it is used
        @test m[1] == -102
        w = Float32(w - 0.02 * m[1])
        @test isapprox(w, 2.04; rtol=2e-7)
    end

    # Seed fastai: 32 items as 4 micro-batches of 8 equal the full batch, mean or sum losses.
    @testset "fastai $reduction" for reduction in (:mean, :sum)
        W = [sin(i + j) for i in 1:3, j in 1:5]
        X = [cos(3i + j) for i in 1:32, j in 1:5]
        Y = [sin(2i - j) for i in 1:32, j in 1:3]
        gradsum(rows) = ((X[rows, :] * W' .- Y[rows, :])' * X[rows, :])
        full = gradsum(1:32) ./ 32
        s = Scaler(init_scale=1.0)
        acc = Accumulator([(15, Float32)]; loss_reduction=reduction)
        for m in 0:3
            g = gradsum(8m+1:8m+8)
            reduction === :mean && (g = g ./ 8)
            add!(acc, s, [Float32.(vec(g))], 8)
        end
        sync!(acc)
        @test isapprox(copy(master(acc, 1)), vec(full); rtol=1e-5, atol=1e-6)
        # Float16 gradients at loss scale 1024
        s16 = Scaler(init_scale=1024.0)
        acc16 = Accumulator([(15, Float16)]; loss_reduction=reduction)
        for m in 0:3
            g = gradsum(8m+1:8m+8)
            reduction === :mean && (g = g ./ 8)
            add!(acc16, s16, [Float16.(vec(g) .* 1024)], 8)
        end
        sync!(acc16)
        @test isapprox(copy(master(acc16, 1)), vec(full); rtol=2e-3, atol=2e-3)
    end

    # Seed unequal counts: mean-reduced losses over micro-batches of 3, 7, 1 items on rank 0 and
    # 5, 2, 9 on rank 1. :by_count gives the gradient of the mean loss over all 27 items,
    # :by_microbatches the mean of the 6 micro-batch means, a different vector.
    @testset "unequal counts" begin
        sizes = ([3, 7, 1], [5, 2, 9])
        W = [sin(o + j) / 2 for o in 1:2, j in 1:4]
        b = [0.1, -0.2]
        X = [cos(3i + j) for i in 1:27, j in 1:4]
        Y = [sin(2i - o) + i % 5 for i in 1:27, o in 1:2]
        function gsum(rows)  # summed gradient of 0.5 |W x + b - y|^2 over the rows, W then b
            R = X[rows, :] * W' .+ b' .- Y[rows, :]
            return vcat(vec(R' * X[rows, :]), vec(sum(R; dims=1)))
        end
        per_item = gsum(1:27) ./ 27
        starts = (0, sum(sizes[1]))
        batches = [starts[r] .+ (1:n) .+ sum(sizes[r][1:m-1]) for r in 1:2 for (m, n) in enumerate(sizes[r])]
        mean_of_means = sum(gsum(rows) ./ length(rows) for rows in batches) ./ 6
        @test maximum(abs.(per_item .- mean_of_means)) > 0.01
        for (normalize, truth) in ((:by_count, per_item), (:by_microbatches, mean_of_means))
            comms = local_group(2)
            results = fetch.([Threads.@spawn begin
                s = Scaler(init_scale=1.0)
                acc = Accumulator([(10, Float32)]; normalize)
                first = starts[r]
                for n in sizes[r]
                    rows = first+1:first+n
                    first += n
                    add!(acc, s, [Float32.(gsum(rows) ./ n)], n)
                end
                info = sync!(acc, comms[r])
                (info, copy(master(acc, 1)))
            end for r in 1:2])
            for (info, m) in results
                @test info.total_count == 27 && info.microbatches == 6
                @test isapprox(m, truth; rtol=1e-5)
            end
            @test results[1][2] == results[2][2]
            close.(comms)
        end
    end

    # Seed overflow on one rank: an inf or NaN in one rank's gradient makes both ranks report
    # found_inf, skip, and back off alike; the next, clean window steps at the backed-off scale.
    @testset "overflow on rank $bad: $T $what" for bad in 1:2,
                                                   (T, what, poison) in ((Float16, "+inf", Inf16), (Float16, "NaN", NaN16),
                                                                         (Float32, "inf", Inf32), (Float32, "NaN", NaN32))
        comms = local_group(2)
        results = fetch.([Threads.@spawn begin
            s = Scaler()  # 65536, backoff 0.5
            acc = Accumulator([(6, T), (1, Float32)])
            infos, skipped, scales = GradAcc.gradacc_sync_info_t[], Bool[], Float32[]
            for window in 1:2
                for m in 1:3
                    sc = scale(s)
                    g = T[r * 0.001 * i * m * sc for i in 1:6]
                    window == 1 && r == bad && m == 1 && (g[3] = poison)
                    add!(acc, s, [g, Float32[sc * 0.25f0]], 2)
                end
                push!(infos, sync!(acc, comms[r]))
                push!(skipped, update!(s, acc))
                push!(scales, scale(s))
            end
            out = (infos, skipped, scales, copy(master(acc, 1)), GradAcc.stats(s))
            close(acc); close(s)
            out
        end for r in 1:2])
        for (infos, skipped, scales, _, st) in results
            @test infos[1].found_inf && skipped[1] && scales[1] == 32768
            @test !infos[2].found_inf && !skipped[2] && scales[2] == 32768
            @test st.steps == 2 && st.skipped_steps == 1 && st.backoffs == 1 && st.growths == 0
        end
        @test results[1][4] == results[2][4]
        want = [sum(2 * r * 0.001 * i * m for r in 1:2, m in 1:3) / 12 for i in 1:6]
        @test isapprox(results[1][4], want; rtol=T === Float16 ? 1e-3 : 1e-6)
        close.(comms)
    end

    # The overflow policies on docs/overflow.md's worked example (ctests/api_overflow.c): 4 ranks,
    # 20 Float16 tensors of 3, 4 micro-batches per rank of 3 + m items, and one inf in tensor 18
    # of rank 2's third micro-batch (the C API's tensor 17 and micro-batch 2). :skip_step skips;
    # :drop_microbatch drops that micro-batch only and leaves the mean over the other 82 items.
    # Both name the place on every rank and back the scale off. With tensor_stats, every rank
    # reports tensor 18 non-finite in one micro-batch and the others in none, the same bits; under
    # :drop_microbatch each tensor's norm is its master's, under :skip_step tensor 18's is infinite.
    @testset "overflow policy $policy, tensor_stats=$ts" for policy in (:skip_step, :drop_microbatch), ts in (false, true)
        ranks, ntensors, n, nmb = 4, 20, 3, 4
        bad = (rank=2, microbatch=3, tensor=18)
        items(m) = 3 + m
        # The true gradient of rank r (0-based), micro-batch m, tensor t, element i (1-based).
        gv(r, m, t, i) = ((r + 1) * 0.25 + m * 0.125 + (t - 1) * 0.0625) * (iseven(i) ? -1 : 1) / 8
        comms = local_group(ranks)
        results = fetch.([Threads.@spawn begin
            s = Scaler(init_scale=1024.0)
            acc = Accumulator(fill((n, Float16), ntensors); overflow=policy, tensor_stats=ts)
            for m in 1:nmb
                grads = [Float16[gv(r, m, t, i) * 1024 for i in 1:n] for t in 1:ntensors]
                (r, m) == (bad.rank, bad.microbatch) && (grads[bad.tensor][2] = Inf16)
                add!(acc, s, grads, items(m))
            end
            info = sync!(acc, comms[r+1])
            flat = reduce(vcat, [copy(master(acc, t)) for t in 1:ntensors])
            stats = ts ? GradAcc.tensor_stats(acc) : nothing
            out = (info, flat, update!(s, acc), scale(s), stats)
            close(acc); close(s)
            out
        end for r in 0:ranks-1])
        drop = policy === :drop_microbatch
        for (info, flat, skipped, sc, stats) in results
            @test GradAcc.overflow(info) == bad
            @test (info.overflow_rank, info.overflow_microbatch, info.overflow_tensor) == (2, 2, 17)
            @test info.found_inf == !drop && skipped == !drop
            @test info.dropped_microbatches == (drop ? 1 : 0)
            @test (info.microbatches, info.total_count) == (drop ? (15, 82) : (16, 88))
            @test sc == 512
            @test flat == results[1][2]
            ts || continue
            @test length(stats) == ntensors
            @test [st.nonfinite_microbatches for st in stats] == [Int(t == bad.tensor) for t in 1:ntensors]
            @test all(map(===, stats, results[1][5]))  # the same bits on every rank, an inf included
        end
        # Names assigned at this level would be shared by the tasks above that assign them too.
        if ts
            first_stats = results[1][5]
            @test isinf(first_stats[bad.tensor].grad_norm) == !drop
            if drop  # no clipping: each norm is its master's
                for t in 1:ntensors
                    norm_want = sqrt(sum(Float64(x)^2 for x in results[1][2][(t-1)*n+1:t*n]))
                    @test isapprox(first_stats[t].grad_norm, norm_want; rtol=1e-12)
                end
            end
        end
        if drop
            want = [sum(Float64(Float16(gv(r, m, t, i) * 1024)) / 1024 * items(m)
                        for r in 0:ranks-1, m in 1:nmb if (r, m) != (bad.rank, bad.microbatch)) / 82
                    for t in 1:ntensors for i in 1:n]
            @test isapprox(results[1][2], want; rtol=1e-6)
        end
        close.(comms)
    end

    @testset "overflow: clean window, overflowing sum, refused policies" begin
        s = Scaler(init_scale=1.0)
        acc = Accumulator([(2, Float32)]; overflow=:drop_microbatch)
        add!(acc, s, [Float32[1, 2]], 1)
        info = sync!(acc)
        @test GradAcc.overflow(info) === nothing && info.dropped_microbatches == 0 && !info.found_inf
        close(acc); close(s)
        comms = local_group(2)
        # `local`: `s` and `info` are this testset's too, which the tasks would otherwise share.
        infos = fetch.([Threads.@spawn begin  # each rank finite, their sum not
            local s = Scaler(init_scale=1.0)
            a = Accumulator([(2, Float32)]; normalize=:none, loss_reduction=:sum, overflow=:drop_microbatch)
            add!(a, s, [Float32[3f38, 1]], 1)
            local info = sync!(a, comms[r])
            close(a); close(s)
            info
        end for r in 1:2])
        @test all(i -> GradAcc.overflow(i) === :reduction && i.found_inf && i.dropped_microbatches == 0, infos)
        close.(comms)
        err = thrown(() -> Accumulator([(4, Float32)]; overflow=7))
        @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT &&
              occursin("`config`.overflow = 7", err.message)
        @test_throws ArgumentError Accumulator([(4, Float32)]; overflow=:drop_everything)
        comm = only(local_group(1))
        acc = Accumulator([(4, Float32)]; sharding=:accumulate, overflow=:drop_microbatch, comm)
        @test acc isa Accumulator
        close(acc)
        close(comm)
    end

    @testset "tensor_stats: off, outside a synced window, refused values" begin
        s = Scaler(init_scale=1.0)
        for on in (false, true)
            acc = Accumulator([(2, Float32)]; tensor_stats=on)
            err = thrown(() -> GradAcc.tensor_stats(acc))  # before the sync
            @test err isa GradAccError && err.status == GRADACC_STATUS_WRONG_STATE
            add!(acc, s, [Float32[3, 4]], 1)
            sync!(acc)
            if on
                @test GradAcc.tensor_stats(acc) == [(grad_norm=5.0, nonfinite_microbatches=0)]
                add!(acc, s, [Float32[3, 4]], 1)  # the next window began
            end
            err = thrown(() -> GradAcc.tensor_stats(acc))
            @test err isa GradAccError && err.status == GRADACC_STATUS_WRONG_STATE &&
                  occursin("tensor_stats", err.message)
            close(acc)
        end
        close(s)
        err = thrown(() -> Accumulator([(4, Float32)]; tensor_stats=2))
        @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT &&
              occursin("`config`.tensor_stats = 2", err.message)
        comm = only(local_group(1))
        acc = Accumulator([(4, Float32)]; sharding=:accumulate, tensor_stats=true, comm)
        @test acc isa Accumulator
        close(acc)
        close(comm)
    end

    # Seed partial window: after a full window, the last window of an epoch has 3 of 4 planned
    # micro-batches (4, 6, 5 items); it is normalised by what was added, nothing carries over.
    @testset "partial window $normalize" for normalize in (:by_count, :by_microbatches)
        s = Scaler(init_scale=1.0)
        acc = Accumulator([(3, Float32)]; normalize)
        for n in 1:4
            add!(acc, s, [Float32[n, -n, 100]], n)
        end
        sync!(acc)
        counts = (4, 6, 5)
        gs = [Float32[m, 2m, -m / 4] for m in 1:3]
        for (g, n) in zip(gs, counts)
            add!(acc, s, [g], n)
        end
        info = sync!(acc)
        @test info.total_count == 15 && info.microbatches == 3
        want = normalize === :by_count ? sum(n .* g for (g, n) in zip(gs, counts)) ./ 15 : sum(gs) ./ 3
        @test isapprox(master(acc, 1), want; rtol=1e-6)
    end

    # Seed partial chunks: one micro-batch's gradient of a tensor arrives in chunks through
    # add_tensor!; the chunks' partial gradients add up to the micro-batch's.
    @testset "partial chunks" begin
        s = Scaler(init_scale=1.0)
        acc = Accumulator([(4, Float32), (2, Float16)])
        full = [Float32[1, 2, 3, 4], Float32[0.5, -0.25]]
        for m in 1:2
            begin_microbatch!(acc, 4)
            for _ in 1:4  # four chunks of tensor 1, each a quarter of its gradient
                add_tensor!(acc, s, 1, full[1] .* m ./ 4)
            end
            add_tensor!(acc, s, 2, Float16.(full[2] .* m))
            end_microbatch!(acc)
        end
        info = sync!(acc)
        @test info.total_count == 8 && info.microbatches == 2
        @test isapprox(master(acc, 1), full[1] .* 1.5f0; rtol=1e-6)  # (1 + 2) / 2
        @test master(acc, 2) == full[2] .* 1.5f0
    end

    # Seed scale change: micro-batches scaled by two different scalers (one scale not a power of
    # two) in one window; each is unscaled by its own scale as it is added.
    @testset "scale change" begin
        s1, s2 = Scaler(init_scale=1024.0), Scaler(init_scale=3.0)
        acc = Accumulator([(3, Float32)])
        g1, g2 = Float32[1, 2, 4], Float32[0.5, -1, 3]
        add!(acc, s1, [g1 .* 1024], 2)
        add!(acc, s2, [g2 .* 3], 2)
        sync!(acc)
        @test isapprox(master(acc, 1), (g1 .+ g2) ./ 2; rtol=1e-6)
    end

    # Seed two optimizers: one scaler, two accumulators. An inf in either skips both and backs
    # off once; clipping sees the unscaled gradient (clip_coef = max / (norm + 1e-6)).
    @testset "two optimizers" begin
        s = Scaler(init_scale=256.0)
        a = Accumulator([(2, Float16)]; max_grad_norm=1)
        b = Accumulator([(1, Float32)])
        add!(a, s, [Float16[3 * 256, 4 * 256]], 1)
        add!(b, s, [Float32[Inf]], 1)
        info = sync!(a)
        @test !info.found_inf && isapprox(info.grad_norm, 5) && isapprox(info.clip_coef, 1 / (5 + 1e-6))
        @test sync!(b).found_inf
        @test GradAcc.update!(s, a, b)
        @test scale(s) == 128
        @test GradAcc.stats(s).backoffs == 1
    end

    @testset "errors carry status and message" begin
        s = Scaler()
        acc = Accumulator([(4, Float16)])
        begin_microbatch!(acc, 1)
        err = try
            add_tensor!(acc, s, 1, zeros(Float16, 8)); nothing
        catch e
            e
        end
        @test err isa GradAccError
        @test err.status == GRADACC_STATUS_SIZE_MISMATCH
        @test occursin("numel", err.message)
        @test_throws GradAccError Accumulator([(1, Float32)]; normalize=99)
        @test_throws ArgumentError add!(acc, s, [zeros(Float32, 4)], 1)
        close(acc); close(s)
        @test_throws ArgumentError scale(s)
        @test !isopen(acc) && !isopen(s)
    end

    @testset "index and type checks" begin
        s = Scaler()
        acc = Accumulator([(2, Float32)])
        begin_microbatch!(acc, 1)
        @test_throws BoundsError add_tensor!(acc, s, 0, zeros(Float32, 2))
        @test_throws BoundsError add_tensor!(acc, s, 2, zeros(Float32, 2))
        @test_throws BoundsError master(acc, 0)
        @test_throws BoundsError master(acc, 2)
        @test_throws ArgumentError add_tensor!(acc, s, 1, zeros(Float64, 2))
        @test_throws ArgumentError Accumulator([(1, Float64)])
        @test_throws ArgumentError Accumulator([(1, :f64)])
        @test_throws ArgumentError Accumulator([(1, Float32)]; normalize=:by_nothing)
        close(acc); close(s)
    end

    # The C calls take pointers and cannot tell what they point at: add_tensor! and add! refuse a
    # gradient of another element type than its tensor's dtype, and add nothing.
    @testset "gradients of the wrong element type add nothing" begin
        s = Scaler(init_scale=1.0)
        tensors = [(4, Float16), (2, :bf16), (3, Float32)]
        refused, clean = Accumulator(tensors), Accumulator(tensors)
        good = [fill(Float16(2), 4), fill(bf16(1f0), 2), Float32[0.5, -1, 2]]
        begin_microbatch!(refused, 2)
        begin_microbatch!(clean, 2)
        for (i, g, declared) in ((1, ones(Float32, 4), "f16"), (2, ones(Float32, 2), "bf16"),
                                 (3, ones(UInt16, 3), "f32"))
            err = try
                add_tensor!(refused, s, i, g); nothing
            catch e
                e
            end
            @test err isa ArgumentError && occursin("tensor $i was declared $declared", err.msg)
        end
        for acc in (refused, clean)
            for (i, g) in enumerate(good)
                add_tensor!(acc, s, i, g)
            end
            end_microbatch!(acc)
        end
        @test_throws ArgumentError add!(refused, s, [ones(Float32, 4), good[2], good[3]], 1)
        @test_throws ArgumentError add!(refused, s, [good[1], good[2], ones(UInt16, 3)], 1)
        info = sync!(refused)
        sync!(clean)
        @test info.microbatches == 1 && info.total_count == 2
        for i in 1:3
            @test reinterpret(UInt32, master(refused, i)) == reinterpret(UInt32, master(clean, i))
        end
        close(refused); close(clean); close(s)
    end

    # bf16 gradients as raw words, as BFloat16s.jl's type (the extension), as Core.BFloat16
    # (Julia 1.11+), and as a reinterpreted view of either.
    @testset "bf16 as $name" for (name, conv) in (("UInt16", x -> bf16(x)),
                                                  ("BFloat16s.BFloat16", BFloat16s.BFloat16),
                                                  ("reinterpret(UInt16, ...)", x -> bf16(x)))
        s = Scaler(init_scale=1.0)
        acc = Accumulator([(2, :bf16)])
        g = [conv(1.5f0), conv(-2f0)]
        name == "reinterpret(UInt16, ...)" && (g = reinterpret(UInt16, BFloat16s.BFloat16.([1.5f0, -2f0])))
        add!(acc, s, [g], 1)
        sync!(acc)
        @test master(acc, 1) == Float32[1.5, -2]
    end
    if isdefined(Core, :BFloat16)
        @testset "Core.BFloat16" begin
            s = Scaler(init_scale=1.0)
            acc = Accumulator([(1, Core.BFloat16)])
            add!(acc, s, [Core.BFloat16[0.5f0]], 1)
            sync!(acc)
            @test master(acc, 1) == Float32[0.5]
        end
    end

    @testset "introspection" begin
        @test GradAcc.backend_available(:local)
        @test GradAcc.backend_available(:cuda) isa Bool
        @test_throws ArgumentError GradAcc.backend_available(:gloo)
        report = GradAcc.diagnostics()
        @test startswith(report, "gradacc $(GradAcc.version()) (") && occursin("\nbackends:\n", report)
        @test endswith(report, "\n") && !occursin('\0', report)
        acc = Accumulator([(3, Float32), (5, :bf16)])
        @test GradAcc.num_tensors(acc) == 2
        @test GradAcc.tensor(acc, 2) == (5, GRADACC_DTYPE_BF16)
        @test occursin("2 tensors", sprint(show, acc))
        comms = local_group(2)
        @test occursin("rank 1 of 2", sprint(show, comms[2]))
        close.(comms); close(comms[1])
        @test occursin("closed", sprint(show, comms[1]))
    end

    @testset "caller's buffer" begin
        buf = fill(7f0, 128) # each tensor starts at a multiple of 256 bytes
        s = Scaler(init_scale=1.0)
        acc = Accumulator([(1, Float32), (2, Float32)], buf)
        add!(acc, s, [Float32[1], Float32[2, 3]], 1)
        sync!(acc)
        @test buf[[1, 65, 66]] == Float32[1, 2, 3]
        @test all(iszero, buf[2:64]) && all(iszero, buf[67:end])
        close(acc)
    end

    @testset "scale_loss!" begin
        s = Scaler(init_scale=1024.0)
        @test GradAcc.scale_loss!(s, Float32[0.5, 2]) == Float32[512, 2048]
        @test GradAcc.scale_loss!(s, Float16[1]) == Float16[1024]
        @test_throws ArgumentError GradAcc.scale_loss!(s, [1.0])
    end

    @testset "16-bit conversions" begin
        x = Float32[1, -2, 65520, 1 + 2.0f0^-11, 2.0f0^-25, 1 + 2.0f0^-8]
        # Julia's own Float16 rounds to nearest even too: the same bits.
        @test GradAcc.f32_to_f16(x) == reinterpret(UInt16, Float16.(x))
        @test GradAcc.f16_to_f32(GradAcc.f32_to_f16(x))[1:2] == Float32[1, -2]
        @test GradAcc.f32_to_bf16(x) == UInt16[0x3f80, 0xc000, 0x4780, 0x3f80, 0x3300, 0x3f80]
        @test GradAcc.bf16_to_f32(UInt16[0x3f80, 0x7f80]) == Float32[1, Inf]
        dst = zeros(UInt16, 5)
        err = try GradAcc.f32_to_bf16!(dst, x); nothing catch e; e end
        @test err isa GradAccError && err.status == GradAcc.GRADACC_STATUS_SIZE_MISMATCH
        @test all(iszero, dst)
        @test isempty(GradAcc.bf16_to_f32(UInt16[]))
    end

    @testset "save and load" begin
        s = Scaler(init_scale=1.0)
        acc = Accumulator([(2, Float32)])
        add!(acc, s, [Float32[1, 2]], 1)
        window = GradAcc.save_window(acc)
        reset!(acc)
        GradAcc.load_window!(acc, window)
        add!(acc, s, [Float32[3, 4]], 1)
        sync!(acc)
        @test master(acc, 1) == Float32[2, 3]  # (1 + 3) / 2, (2 + 4) / 2: the saved micro-batch counts
        @test !update!(s, acc)
        @test GradAcc.stats(s).steps == 1
        state = GradAcc.save(s)
        s2 = Scaler(init_scale=4.0)
        GradAcc.load!(s2, state)
        @test scale(s2) == scale(s) == 1
        err = try
            GradAcc.load!(s2, UInt8[1, 2, 3]); nothing
        catch e
            e
        end
        @test err isa GradAccError && err.status == GRADACC_STATUS_CORRUPT_STATE
    end

    # Two ranks' saved windows resume on one: merged into a fresh accumulator, they sync as one.
    @testset "merge windows of two ranks into one" begin
        a, b = saved_window([1, 2], 1), saved_window([3, 5], 3)
        comm = only(local_group(1))
        acc = Accumulator([(2, Float32)])
        @test GradAcc.merge_window!(acc, a) === acc
        GradAcc.merge_window!(acc, b)
        info = sync!(acc, comm)
        @test info.total_count == 4 && info.microbatches == 2 && !info.found_inf
        @test master(acc, 1) == Float32[2.5, 4.25]  # (1 * a + 3 * b) / 4 items
        close(acc); close(comm)
    end

    @testset "merge_window! refuses corrupt bytes" begin
        window = saved_window([4, 8], 2)
        acc = Accumulator([(2, Float32)])
        for bad in (UInt8[0], Vector{UInt8}("not a window"), window[1:end-1])
            err = thrown(() -> GradAcc.merge_window!(acc, bad))
            @test err isa GradAccError && err.status == GRADACC_STATUS_CORRUPT_STATE
        end
        GradAcc.merge_window!(acc, window)
        info = sync!(acc)
        @test info.total_count == 2 && info.microbatches == 1  # the failed merges added nothing
        @test master(acc, 1) == Float32[4, 8]
        close(acc)
    end

    @testset "timeout round trip" begin
        comms = local_group(2)
        c = comms[1]
        @test GradAcc.timeout(c) == 600
        @test GradAcc.set_timeout!(c, 2.5) === c
        @test GradAcc.timeout(c) == 2.5
        @test GradAcc.timeout(comms[2]) == 600  # per handle
        GradAcc.set_timeout!(c, nothing)
        @test GradAcc.timeout(c) === nothing  # waits forever
        GradAcc.set_timeout!(c, 7)
        GradAcc.set_timeout!(c, 0)  # the C API's "forever"
        @test GradAcc.timeout(c) === nothing
        for bad in (-1.0, NaN, Inf)
            err = thrown(() -> GradAcc.set_timeout!(c, bad))
            @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT
        end
        @test GradAcc.timeout(c) === nothing  # a refused value changes nothing
        close.(comms)
        @test_throws ArgumentError GradAcc.set_timeout!(c, 1)
    end

    @testset "abort! then sync fails" begin
        comm = only(local_group(1))
        acc = one_microbatch!(Accumulator([(2, Float32)]))
        @test GradAcc.abort!(comm) === comm
        for _ in 1:2
            err = thrown(() -> sync!(acc, comm))
            @test err isa GradAccError && err.status == GRADACC_STATUS_COMM_FAILURE
        end
        close(acc); close(comm)
    end

    @testset "abort! wakes a peer blocked in sync" begin
        comms = local_group(2)
        GradAcc.set_timeout!(comms[1], 60)  # a broken abort fails the test instead of hanging it
        acc = one_microbatch!(Accumulator([(2, Float32)]))
        # Rank 0 syncs, rank 1 never does: it gives up, which fails the whole in-process group.
        blocked = Threads.@spawn thrown(() -> sync!(acc, comms[1]))
        aborter = Threads.@spawn (sleep(0.2); GradAcc.abort!(comms[2]))
        err = fetch(blocked)
        @test fetch(aborter) === comms[2]
        @test err isa GradAccError && err.status == GRADACC_STATUS_COMM_FAILURE
        close(acc); close.(comms)
    end

    # Reduce-scatter sharding: every shard is the unsharded master's range, bit for bit.
    @testset "sharded sync on $world ranks, max_grad_norm $max_grad_norm" for world in (2, 3),
                                                                             max_grad_norm in (0.0, 0.25)
        sharded_comms, plain_comms = local_group(world), local_group(world)
        accs = [sharded_and_unsharded(world, r, max_grad_norm) for r in 0:world-1]
        infos = on_ranks(sharded_comms, plain_comms) do r
            sharded, plain = accs[r + 1]
            return (sync!(sharded, sharded_comms[r + 1]), sync!(plain, plain_comms[r + 1]))
        end
        close.(sharded_comms); close.(plain_comms)
        total = sum(microbatch_count(r, m) for r in 0:world-1, m in 0:2)
        flat0 = flat_master(accs[1][2])
        @test length(flat0) == SHARD_TOTAL
        next = 0
        for ((sharded, plain), (info, plain_info)) in zip(accs, infos)
            offset, numel, data = GradAcc.shard(sharded)
            @test offset == next  # the shards tile the layout in rank order
            @test 0 < numel < SHARD_TOTAL && length(data) == numel
            next = offset + numel
            @test pointer(data) == pointer(master(sharded, 1)) + sizeof(Float32) * offset
            @test info == plain_info == infos[1][1]
            @test info.total_count == total && info.microbatches == 3world && !info.found_inf
            @test (info.clip_coef < 1) == (max_grad_norm > 0)
            flat = flat_master(plain)
            @test reinterpret(UInt32, data) == reinterpret(UInt32, flat[offset+1:offset+numel])
            @test any(!iszero, data)
            @test reinterpret(UInt32, flat) == reinterpret(UInt32, flat0)
        end
        @test next == SHARD_TOTAL
        for (sharded, plain) in accs
            close(sharded); close(plain)
        end
    end

    @testset "an unsharded accumulator's shard is the whole master" begin
        s = Scaler(init_scale=1024.0)
        acc = Accumulator(SHARD_TENSORS)
        add!(acc, s, random_grads(), 4)
        sync!(acc)
        offset, numel, data = GradAcc.shard(acc)
        @test (offset, numel) == (0, SHARD_TOTAL)
        @test pointer(data) == pointer(master(acc, 1))
        @test reinterpret(UInt32, data) == reinterpret(UInt32, flat_master(acc))  # +0 in the padding
        @test [GradAcc.offset(acc, i) for i in 1:length(SHARD_TENSORS)] == SHARD_OFFSETS
        @test GradAcc.master_numel(SHARD_TENSORS) == SHARD_TOTAL
        @test_throws GradAccError GradAcc.offset(acc, length(SHARD_TENSORS) + 1)
        close(acc); close(s)
        acc = Accumulator(SHARD_TENSORS; sharding=GRADACC_SHARDING_REDUCE_SCATTER, shard_count=3, shard_rank=2,
                          wire_dtype=Float32)
        sh = GradAcc.shard(acc)
        @test (sh.offset, sh.numel, length(sh.data)) == (16384, SHARD_TOTAL - 16384, SHARD_TOTAL - 16384)
        close(acc)
    end

    @testset "bad sharding configs are refused" begin
        for (kw, word) in (((sharding=:reduce_scatter, shard_count=2, shard_rank=2), "shard_rank"),
                           ((sharding=:reduce_scatter, shard_count=3, shard_rank=7), "shard_rank"),
                           ((sharding=:reduce_scatter, shard_count=0, shard_rank=0), "shard_rank"),
                           ((shard_count=2, shard_rank=1), "sharding"),
                           ((sharding=7,), "sharding"),
                           ((wire_dtype=Float16,), "wire_dtype"),
                           ((wire_dtype=GRADACC_DTYPE_F16,), "wire_dtype"))
            err = thrown(() -> Accumulator(SHARD_TENSORS; kw...))
            @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT && occursin(word, err.message)
        end
        @test_throws ArgumentError Accumulator(SHARD_TENSORS; sharding=:zero3)
    end

    @testset "a sharded sync on the wrong group fails on every rank" begin
        for err in sharded_sync_errors(2, 3, (0, 1))  # 3 shards on 2 ranks
            @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT &&
                  occursin("of 3", err.message) && occursin("of 2", err.message)
        end
        errs = sharded_sync_errors(2, 2, (0, 0))  # rank 1 claims shard 0 too
        @test errs[2] isa GradAccError && errs[2].status == GRADACC_STATUS_INVALID_ARGUMENT &&
              occursin("shard 0 of 2", errs[2].message)
        @test errs[1] isa GradAccError && errs[1].status == GRADACC_STATUS_PEER_FAILURE
        acc = one_microbatch!(Accumulator([(2, Float32)]; sharding=:reduce_scatter, shard_count=2))
        err = thrown(() -> sync!(acc))
        @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT
        close(acc)
    end

    # The hybrid boundary on a 2x2 grid against a 4-rank unsharded sync of the same micro-batches:
    # the same info everywhere, replicas with the same bits, and shard group 0's shards within the
    # rounding of another summation order of the DDP master.
    @testset "hybrid sync on a 2x2 grid, max_grad_norm $max_grad_norm" for max_grad_norm in (0.0, 0.25)
        shard, replicas = hybrid_grid()
        ddp_comms = local_group(4)
        accs = [hybrid_and_ddp(g, max_grad_norm) for g in 0:3]
        infos = on_ranks(shard, replicas, ddp_comms) do g
            hybrid, ddp = accs[g + 1]
            return (sync_hybrid!(hybrid, shard[g + 1], replicas[g + 1]), sync!(ddp, ddp_comms[g + 1]))
        end
        foreach(close, [shard; replicas; ddp_comms])
        total = sum(microbatch_count(g, m) for g in 0:3, m in 0:2)
        ddp = flat_master(accs[1][2])
        tol = 1f-5 * maximum(abs, ddp)
        next = 0
        for (g, ((hybrid, _), (info, ddp_info))) in enumerate(zip(accs, infos))
            offset, numel, data = GradAcc.shard(hybrid)
            @test info == infos[1][1]
            @test info.total_count == ddp_info.total_count == total && info.microbatches == 12 && !info.found_inf
            @test isapprox(info.grad_norm, ddp_info.grad_norm; rtol=1e-5)
            @test isapprox(info.clip_coef, ddp_info.clip_coef; rtol=1e-5)
            @test (info.clip_coef < 1) == (max_grad_norm > 0)
            if g > 2  # a replica: the bits of shard group 0's rank holding the same shard
                twin = GradAcc.shard(accs[g - 2][1])
                @test (offset, numel) == (twin.offset, twin.numel)
                @test reinterpret(UInt32, data) == reinterpret(UInt32, twin.data)
            else
                @test offset == next && numel > 0
                next = offset + numel
                @test all(abs.(data .- ddp[offset+1:offset+numel]) .<= tol)
            end
        end
        @test next == SHARD_TOTAL
        for (hybrid, plain) in accs
            close(hybrid); close(plain)
        end
    end

    @testset "crosswise replica groups fail on every rank" begin
        shard, replicas = hybrid_grid(crosswise=true)
        accs = [one_microbatch!(Accumulator([(2, Float32)]; sharding=:reduce_scatter, shard_count=2,
                                            shard_rank=g % 2)) for g in 0:3]
        errs = on_ranks(shard, replicas; timeout=30) do g
            return thrown(() -> sync_hybrid!(accs[g + 1], shard[g + 1], replicas[g + 1]))
        end
        for err in errs
            @test err isa GradAccError && err.status == GRADACC_STATUS_SIZE_MISMATCH &&
                  occursin("replica groups", err.message)
        end
        close.(accs); foreach(close, [shard; replicas])
    end

    # Sharded accumulation against a DDP sync of the same micro-batches: add and add_tensor! give
    # the same bits, and the shards tile the gradient within the rounding of another summation
    # order of the DDP master.
    @testset "sharded accumulation on $world ranks, max_grad_norm $max_grad_norm" for world in (2, 3),
                                                                                     max_grad_norm in (0.0, 0.25)
        add_comms, tensor_comms, ddp_comms = local_group(world), local_group(world), local_group(world)
        grads = [[random_grads() for _ in 0:2] for _ in 0:world-1]
        results = on_ranks(add_comms, tensor_comms, ddp_comms) do r
            s = Scaler(init_scale=1024.0)
            by_add = sharded_accumulation(world, r, add_comms[r + 1]; max_grad_norm)
            by_tensor = sharded_accumulation(world, r, tensor_comms[r + 1]; max_grad_norm)
            plain = Accumulator(SHARD_TENSORS; max_grad_norm)
            for m in 0:2
                g, items = grads[r + 1][m + 1], microbatch_count(r, m)
                add!(by_add, s, g, items)
                begin_microbatch!(by_tensor, items)
                for i in length(g):-1:1  # as a backward pass produces them
                    add_tensor!(by_tensor, s, i, g[i])
                end
                end_microbatch!(by_tensor)
                add!(plain, s, g, items)
            end
            infos = (sync!(by_add), sync!(by_tensor, tensor_comms[r + 1]), sync!(plain, ddp_comms[r + 1]))
            close(s)
            return by_add, by_tensor, plain, infos
        end
        total = sum(microbatch_count(r, m) for r in 0:world-1, m in 0:2)
        ddp = flat_master(results[1][3])
        largest = maximum(abs, ddp)
        starts = SHARD_OFFSETS
        next = 0
        for (acc, tensor_acc, _, (info, tensor_info, ddp_info)) in results
            offset, numel, data = GradAcc.shard(acc)
            @test offset == next && 0 < numel < SHARD_TOTAL  # the shards tile the layout in rank order
            next = offset + numel
            @test info == tensor_info == results[1][4][1]
            @test reinterpret(UInt32, data) == reinterpret(UInt32, GradAcc.shard(tensor_acc).data)
            @test info.total_count == ddp_info.total_count == total && info.microbatches == 3world && !info.found_inf
            @test isapprox(info.grad_norm, ddp_info.grad_norm; rtol=1e-5)
            @test isapprox(info.clip_coef, ddp_info.clip_coef; rtol=1e-5)
            @test (info.clip_coef < 1) == (max_grad_norm > 0)
            want = ddp[offset+1:offset+numel]
            @test all(abs.(data .- want) .<= 1f-5 .* abs.(want) .+ 1f-6 * largest)
            # master gives exactly the tensors wholly inside the shard, as views of it.
            for (i, (n, _)) in enumerate(SHARD_TENSORS)
                err = thrown(() -> master(acc, i))
                if offset <= starts[i] && starts[i] + n <= offset + numel
                    @test err === nothing &&
                          pointer(master(acc, i)) == pointer(data) + sizeof(Float32) * (starts[i] - offset)
                else
                    @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT
                end
            end
        end
        @test next == SHARD_TOTAL
        for (acc, tensor_acc, plain_acc, _) in results
            close(acc); close(tensor_acc); close(plain_acc)
        end
        foreach(close, [add_comms; tensor_comms; ddp_comms])
    end

    @testset "one shard of one is the unsharded accumulator" begin
        s = Scaler(init_scale=1024.0)
        single = Accumulator(SHARD_TENSORS; sharding=GRADACC_SHARDING_ACCUMULATE, bucket_numel=4096)
        plain = Accumulator(SHARD_TENSORS; bucket_numel=4096)
        for m in 0:2
            g = random_grads()
            add!(single, s, g, 1 + m)
            add!(plain, s, g, 1 + m)
        end
        @test sync!(single) == sync!(plain)
        sh = GradAcc.shard(single)
        @test (sh.offset, sh.numel) == (0, SHARD_TOTAL)
        @test reinterpret(UInt32, sh.data) == reinterpret(UInt32, GradAcc.shard(plain).data)
        close(single); close(plain); close(s)
    end

    @testset "sharded creation is checked" begin
        comms = local_group(2)
        for (kw, word) in (((sharding=:accumulate, shard_count=2, shard_rank=1), "shard 1 of 2"),
                           ((sharding=:accumulate, shard_count=3, shard_rank=0), "shard 0 of 3"),
                           ((sharding=:reduce_scatter, shard_count=2, shard_rank=0), "GRADACC_SHARDING_ACCUMULATE"))
            err = thrown(() -> Accumulator(SHARD_TENSORS; comm=comms[1], kw...))  # rank 0 of 2
            @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT && occursin(word, err.message)
        end
        # Over several ranks, micro-batches need the communicator from the start.
        err = thrown(() -> Accumulator(SHARD_TENSORS; sharding=:accumulate, shard_count=2, shard_rank=0))
        @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT && occursin("communicator", err.message)
        @test_throws ArgumentError Accumulator(SHARD_TENSORS, zeros(Float32, SHARD_TOTAL); sharding=:accumulate,
                                               shard_count=2, shard_rank=0, comm=comms[1])
        close(comms[2])
        @test_throws ArgumentError Accumulator(SHARD_TENSORS; sharding=:accumulate, shard_count=2, shard_rank=1,
                                               comm=comms[2])
        close(comms[1])
    end

    @testset "a sharded accumulation keeps its communicator" begin
        accs = let comms = local_group(2)
            [Accumulator([(2, Float32)]; sharding=:accumulate, shard_count=2, shard_rank=r, comm=comms[r + 1])
             for r in 0:1]
        end
        GC.gc(); GC.gc()  # the group's finalizers would destroy unreferenced handles
        @test all(a -> a.comm !== nothing && isopen(a.comm), accs)
        infos = on_ranks([a.comm for a in accs]; timeout=30) do r
            one_microbatch!(accs[r + 1])
            return sync!(accs[r + 1], accs[r + 1].comm)
        end
        @test all(info -> (info.total_count, info.microbatches) == (2, 2), infos)
        # Both elements, padded to 64, in shard 0: (1 + 1) / 2 items, then zeros.
        @test GradAcc.shard(accs[1]).data == [Float32[1, 1]; zeros(Float32, 62)]
        close.(accs)
    end

    # Rank 1's micro-batch is invalid (no items for a mean loss): it throws there and PEER_FAILURE
    # on rank 0, nothing added on either. Then rank 0 syncs on a stranger communicator:
    # INVALID_ARGUMENT there, PEER_FAILURE on rank 1. The windows survive both.
    @testset "a bad call on one sharded rank fails on every rank" begin
        comms, stranger = local_group(2), local_group(1)
        grads = [random_grads() for _ in 1:2]
        results = on_ranks(comms; timeout=30) do r
            s = Scaler(init_scale=1.0)
            acc = sharded_accumulation(2, r, comms[r + 1])
            add!(acc, s, grads[r + 1], 2)
            before = copy(GradAcc.shard(acc).data)
            bad_add = thrown(() -> add!(acc, s, grads[r + 1], r == 1 ? 0 : 2))
            bad_sync = thrown(() -> r == 0 ? sync!(acc, stranger[1]) : sync!(acc))
            unchanged = reinterpret(UInt32, GradAcc.shard(acc).data) == reinterpret(UInt32, before)
            after = sync!(acc, comms[r + 1])
            close(acc); close(s)
            return bad_add, bad_sync, unchanged, after
        end
        (add0, sync0, _, _), (add1, sync1, _, _) = results
        @test add1 isa GradAccError && add1.status == GRADACC_STATUS_INVALID_ARGUMENT && occursin("count", add1.message)
        @test add0 isa GradAccError && add0.status == GRADACC_STATUS_PEER_FAILURE
        @test sync0 isa GradAccError && sync0.status == GRADACC_STATUS_INVALID_ARGUMENT
        @test sync1 isa GradAccError && sync1.status == GRADACC_STATUS_PEER_FAILURE
        for (_, _, same, info) in results
            @test same && (info.microbatches, info.total_count) == (2, 4)
        end
        foreach(close, [comms; stranger])
    end

    # Calls add! and sync! refuse before the C call (a gradient count or length that does not fit,
    # a closed scaler or communicator) throw there and PEER_FAILURE on the other rank at once, not
    # at the communicator's timeout; both ranks then add and sync as before.
    @testset "a call the binding refuses on one sharded rank fails the other at once" begin
        comms, (closed_comm,) = local_group(2), local_group(1)
        close(closed_comm)
        closed_scaler = Scaler()
        close(closed_scaler)
        grads = [random_grads() for _ in 1:2]
        steps = [  # (what, rank 1's call, the exception type it throws)
            ("3 of 4 gradients", (acc, s, g) -> add!(acc, s, g[1:3], 2), ArgumentError),
            ("a short gradient", (acc, s, g) -> add!(acc, s, [g[1], g[2][1:end-1], g[3], g[4]], 2), DimensionMismatch),
            ("a closed scaler", (acc, _, g) -> add!(acc, closed_scaler, g, 2), ArgumentError),
            ("sync! on a closed communicator", (acc, _, _) -> sync!(acc, closed_comm), ArgumentError),
        ]
        results = on_ranks(comms; timeout=5) do r  # without the refusal rank 0 would wait 5 s
            s = Scaler(init_scale=1.0)
            acc = sharded_accumulation(2, r, comms[r + 1])
            g = grads[r + 1]
            add!(acc, s, g, 2)
            caught = map(steps) do (what, bad, _)
                start = time()
                err = try
                    r == 1 ? bad(acc, s, g) : startswith(what, "sync!") ? sync!(acc) : add!(acc, s, g, 2)
                    nothing
                catch e
                    e
                end
                return err, time() - start
            end
            add!(acc, s, g, 2)
            after = sync!(acc)
            close(acc); close(s)
            return caught, after
        end
        (caught0, after0), (caught1, after1) = results
        for ((_, _, T), (err0, took0), (err1, _)) in zip(steps, caught0, caught1)
            @test err1 isa T
            @test err0 isa GradAccError && err0.status == GRADACC_STATUS_PEER_FAILURE
            @test took0 < 2
        end
        for info in (after0, after1)
            @test (info.microbatches, info.total_count) == (4, 8)
        end
        foreach(close, comms)
    end

    @testset "a timeout throws and aborts" begin
        comms = local_group(2)
        GradAcc.set_timeout!(comms[1], 0.2)
        acc = one_microbatch!(Accumulator([(2, Float32)]))
        err = thrown(() -> sync!(acc, comms[1]))  # rank 1 never syncs
        @test err isa GradAccError && err.status == GRADACC_STATUS_TIMEOUT
        err = thrown(() -> sync!(acc, comms[1]))
        @test err isa GradAccError && err.status == GRADACC_STATUS_COMM_FAILURE
        close(acc); close.(comms)
    end

    # The smaller state formats by keyword: remainder masters and bf16 moments step bf16 words,
    # save and load their state; remainder masters over Float32 weights are refused naming the
    # weight, an unknown format by the binding.
    @testset "optimizer state formats" begin
        acc = Accumulator([(16, :bf16)])
        w = [UInt16(reinterpret(UInt32, Float32(0.1 * i - 1)) >> 16) for i in 1:16]
        opt = Optimizer(acc, [w]; lr=0.05, master_format=:bf16_remainder, moments=:bf16, moment_seed=7)
        saved = save(opt)
        @test !isempty(saved)
        load!(opt, saved)
        close(opt); close(acc)
        acc = Accumulator([(4, Float32)])
        err = thrown(() -> Optimizer(acc, [zeros(Float32, 4)]; master_format=:bf16_remainder))
        @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT && occursin("`weights[0]` is f32", err.message)
        @test thrown(() -> Optimizer(acc, [zeros(Float32, 4)]; moments=:int8)) isa ArgumentError
        close(acc)
        # No masters: 16-bit weights rounded to nearest are refused naming `rounding`.
        acc = Accumulator([(4, Float16)])
        err = thrown(() -> Optimizer(acc, [zeros(Float16, 4)]; master_format=:none))
        @test err isa GradAccError && err.status == GRADACC_STATUS_INVALID_ARGUMENT && occursin("`rounding`", err.message)
        close(Optimizer(acc, [zeros(Float16, 4)]; master_format=:none, rounding=:stochastic))
        close(acc)
    end

    # FP8 weights: one rank under a reduce-scatter boundary writes tensor 2 as E4M3; its scale is
    # 448 over the amax of the same run's masters (its Float32 weights), and a code of the wrong
    # length is refused.
    @testset "FP8 weights on the all-gather" begin
        function run(fp8)
            s = Scaler(init_scale=1.0)
            acc = Accumulator([(5, Float32), (1001, Float32)]; sharding=:reduce_scatter, shard_count=1, shard_rank=0)
            comm = local_group(1)[1]
            w = [fill(0.5f0, 5), Float32[3 * sin(i) for i in 1:1001]]
            codes, scale = zeros(UInt8, 1001), zeros(Float32, 1)
            opt = Optimizer(acc, w; lr=0.05, fp8=fp8 ? Dict(2 => (:e4m3, codes, scale)) : nothing)
            add!(acc, s, [fill(0.25f0, 5), Float32[cos(i) for i in 1:1001]], 1)
            sync!(acc, comm)
            @test GradAcc.step!(opt, comm)
            close(opt); close(comm); close(acc); close(s)
            return w[2], scale[1]
        end
        masters, _ = run(false)
        _, scale = run(true)
        @test scale === Float32(448 / maximum(abs.(Float64.(masters))))
        acc = Accumulator([(8, Float32)]; sharding=:reduce_scatter, shard_count=1, shard_rank=0)
        @test thrown(() -> Optimizer(acc, [zeros(Float32, 8)]; fp8=Dict(1 => (:e4m3, zeros(UInt8, 7), zeros(Float32, 1))))) isa DimensionMismatch
        close(acc)
    end

    # Adopted masters: the caller's values (not the weights') are the masters, each SGD step
    # updates them in place as w - lr * g in Float32, a short buffer is refused naming `masters`,
    # a refused load leaves them bit for bit and a load writes the saved ones back.
    @testset "optimizer over the caller's masters" begin
        s = Scaler(init_scale=1.0, dynamic=false)
        acc = Accumulator([(301, Float32), (7, Float32)])
        at2 = GradAcc.offset(acc, 2)
        masters = zeros(Float32, GradAcc.shard(acc).numel)
        w1, w2 = Float32[0.01f0 * i - 1 for i in 1:301], Float32[0.5f0 * i for i in 1:7]
        masters[1:301] .= w1 .+ 1f0 / 3
        masters[at2+1:at2+7] .= w2 .- 1f0 / 3
        expected = copy(masters)
        err = thrown(() -> Optimizer(acc, [w1, w2]; masters=masters[1:end-1], algorithm=:sgd, lr=0.125))
        @test err isa GradAccError && err.status == GradAcc.GRADACC_STATUS_SIZE_MISMATCH &&
              occursin("masters", err.message)
        opt = Optimizer(acc, [w1, w2]; masters, algorithm=:sgd, lr=0.125)
        @test masters == expected  # creation keeps the caller's values
        for step in 1:3
            g1, g2 = Float32[(i % 5) * 0.25f0 - 0.5f0 for i in 1:301], fill(0.75f0, 7)
            add!(acc, s, [g1, g2], 1)
            sync!(acc)
            @test GradAcc.step!(opt)
            expected[1:301] .= expected[1:301] .+ (-0.125f0) .* g1
            expected[at2+1:at2+7] .= expected[at2+1:at2+7] .+ (-0.125f0) .* g2
            @test reinterpret(UInt32, masters) == reinterpret(UInt32, expected)
            @test w1 == masters[1:301] && w2 == masters[at2+1:at2+7]
        end
        saved = GradAcc.save(opt)
        fill!(masters, -3f0)
        forged = copy(saved)
        forged[length(forged) ÷ 2] ⊻= 0x02
        err = thrown(() -> GradAcc.load!(opt, forged))
        @test err isa GradAccError && err.status == GradAcc.GRADACC_STATUS_CORRUPT_STATE
        @test all(==(-3f0), masters)
        GradAcc.load!(opt, saved)
        @test masters[1:301] == expected[1:301] && masters[at2+1:at2+7] == expected[at2+1:at2+7]
        close(opt); close(acc); close(s)
    end

    include("mesh.jl")
end
