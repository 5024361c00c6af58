# examples/quickstart.c in Julia: two ranks (tasks on two threads) fit y = x.w with Float16 weights
# and gradients, the dynamic loss scale (its first steps overflow Float16 and are skipped while it
# backs off), FP32 accumulation of micro-batches of 3 and 5 items, one all-reduce per step, and SGD
# on FP32 masters. Exits non-zero unless both ranks end with the same weights, skipped the same
# steps, and the loss fell 100-fold.
#
#     cargo build --release
#     julia -t 2 --project=bindings/julia/GradAcc bindings/julia/examples/quickstart.jl
#
# CI has no Julia: scripts/lint-julia parses and lints this file, nothing runs it.

# Each rank's thread blocks in sync! until the other rank arrives: the ranks need two threads.
Threads.nthreads() >= 2 || error("start Julia with two threads or more: julia -t 2 ...")

using GradAcc
using GradAcc: update!, scale, step!, abort!

const W_TRUE = Float32[1, -2, 0.5, 3]

# Feature j (1-based) of item i in [-1, 1): a hash, the same in every language's quickstart.
function feature(i, j)
    h = UInt32(4i + j - 1) * 0x9e3779b1
    return Float32(h ⊻ (h >> 15)) / 2.0f0^31 - 1.0f0
end

# Mean loss 0.5 (x.w - x.w_true)^2 over n items from `first`, and its gradient times `s` in
# Float16 (an overflow becomes Inf16, which the scaler handles).
function loss_grad(w, first, n, s=1.0f0)
    loss, g = 0.0f0, zeros(Float32, 4)
    for i in first:first+n-1
        x = [feature(i, j) for j in 1:4]
        err = sum(x .* (Float32.(w) .- W_TRUE))
        loss += 0.5f0 * err^2 / n
        g .+= err .* x ./ n
    end
    return loss, Float16.(g .* s)
end

function train(comm, rank, w)
    scaler = Scaler()                                  # GradScaler's defaults, on the CPU
    acc = Accumulator([(4, Float16)])                  # mean losses, normalised by count
    opt = Optimizer(acc, [w]; algorithm=:sgd, lr=0.5)  # FP32 masters from w, which it writes
    skipped = 0
    for step in 0:39
        for (k, n) in enumerate((3, 5))                # other items on each rank
            _, g = loss_grad(w, 100000 * (rank + 1) + 8step + 3(k - 1), n, scale(scaler))
            add!(acc, scaler, [g], n)                  # the backward of loss * scale
        end
        sync!(acc, comm)                               # the all-reduce; the mean over 16 items
        skipped += update!(scaler, acc)                # every rank decides alike
        step!(opt, comm)                               # a no-op on overflow
    end
    close(opt); close(acc); close(scaler)
    return skipped
end

function main()
    comms = local_group(2)                             # an in-process group: one per rank
    w = [zeros(Float16, 4) for _ in comms]
    tasks = map(0:1) do r
        Threads.@spawn try
            train(comms[r+1], r, w[r+1])
        catch
            abort!(comms[r+1])                         # so the other rank stops waiting
            rethrow()
        end
    end
    skipped = fetch.(tasks)
    foreach(close, comms)
    loss0, loss = first(loss_grad(zeros(Float16, 4), 0, 64)), first(loss_grad(w[1], 0, 64))
    same = reinterpret(UInt16, w[1]) == reinterpret(UInt16, w[2])
    println("loss $loss0 -> $loss, w $(w[1]), skipped steps $skipped, ranks $(same ? "equal" : "DIFFER")")
    return same && loss < loss0 / 100 && skipped[1] == skipped[2]
end

main() || error("the ranks' weights differ, or the loss did not fall 100-fold")
