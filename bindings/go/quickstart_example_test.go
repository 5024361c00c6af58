package gradacc_test

import (
	"fmt"
	"sync"

	gradacc "github.com/gradacc/gradacc/bindings/go"
)

// must ends the program on an error: a failing rank must not leave the other one waiting.
func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// grad is the gradient of the mean loss 0.5 (x.w - x.wTrue)^2 over n items from first, times
// scale, in bf16; feature j of item i is a hash in [-1, 1), the same in every language's quickstart.
func grad(w []uint16, first, n int, scale float32) []uint16 {
	wTrue, x, sum, wf := []float32{1, -2, 0.5, 3}, make([]float32, 4), make([]float32, 4), gradacc.BF16ToF32(w)
	for i := first; i < first+n; i++ {
		var e float32
		for j := range x {
			h := uint32(4*i+j) * 2654435761
			x[j] = float32(h^(h>>15))/2147483648 - 1
			e += x[j] * (wf[j] - wTrue[j])
		}
		for j := range sum {
			sum[j] += e * x[j] / float32(n)
		}
	}
	for j := range sum {
		sum[j] *= scale
	}
	return gradacc.F32ToBF16(sum)
}

// train is one rank: 40 steps of two micro-batches (3 and 5 items, other items on each rank).
func train(comm *gradacc.Comm, rank int, w []uint16) {
	scaler := must(gradacc.NewScaler(nil, nil)) // GradScaler's defaults, on the CPU
	acc := must(gradacc.NewAccumulator([]gradacc.TensorDesc{{Numel: 4, DType: gradacc.BF16}}, nil, nil))
	cfg := gradacc.DefaultOptimizerConfig()
	cfg.Algorithm, cfg.LR, cfg.WeightDecay = gradacc.SGD, 0.5, 0
	weights := []gradacc.Weight{gradacc.WeightBF16(w)} // the FP32 masters start from w
	opt := must(gradacc.NewOptimizer(acc, weights, &cfg, nil))
	defer func() { opt.Close(); acc.Close(); scaler.Close() }()
	for step := 0; step < 40; step++ {
		for k, n := range []int{3, 5} {
			g := grad(w, 100000*(rank+1)+8*step+3*k, n, must(scaler.Scale())) // backward of loss * scale
			must(0, acc.Add(scaler, []gradacc.Grad{gradacc.Words16(g)}, uint64(n)))
		}
		must(acc.Sync(comm))               // the all-reduce; the mean over all 16 items
		must(scaler.Update(acc))           // every rank decides alike
		must(opt.Step(acc, weights, comm)) // a no-op on overflow
	}
}

// A whole mixed-precision loop on two in-process ranks (goroutines): bf16 weights and gradients, the
// scaler, FP32 accumulation, one all-reduce per step, SGD on FP32 masters; equal weights, near the true ones.
func Example_quickstart() {
	comms := must(gradacc.NewLocalGroup(2)) // an in-process group: one communicator per rank
	defer func() { comms[0].Close(); comms[1].Close() }()
	w := [][]uint16{make([]uint16, 4), make([]uint16, 4)}
	var wg sync.WaitGroup
	wg.Add(len(comms))
	for r := range comms {
		go func(r int) { defer wg.Done(); train(comms[r], r, w[r]) }(r)
	}
	wg.Wait()
	wf := gradacc.BF16ToF32(w[0])
	fmt.Printf("ranks equal %v, w = [%.1f %.1f %.1f %.1f]\n", fmt.Sprint(w[0]) == fmt.Sprint(w[1]),
		wf[0], wf[1], wf[2], wf[3])
	// Output: ranks equal true, w = [1.0 -2.0 0.5 3.0]
}
