package gradacc_test

import (
	"fmt"
	"math"
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

// bf16 is the top half of an f32, rounded to nearest even.
func toBF16(f float32) uint16 {
	return uint16((math.Float32bits(f) + 0x7fff + math.Float32bits(f)>>16&1) >> 16)
}
func fromBF16(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// grad is the gradient of the mean loss 0.5 (x.w - x.wTrue)^2 over n items from first, times
// scale, in bf16; feature j of item i is a hash in [-1, 1), the same in every language's quickstart.
func grad(w []uint16, first, n int, scale float32) []uint16 {
	wTrue, x, sum := []float32{1, -2, 0.5, 3}, make([]float32, 4), make([]float32, 4)
	for i := first; i < first+n; i++ {
		var e float32
		for j := range x {
			h := uint32(4*i+j) * 2654435761
			x[j] = float32(h^(h>>15))/2147483648 - 1
			e += x[j] * (fromBF16(w[j]) - wTrue[j])
		}
		for j := range sum {
			sum[j] += e * x[j] / float32(n)
		}
	}
	return []uint16{toBF16(sum[0] * scale), toBF16(sum[1] * scale), toBF16(sum[2] * scale), toBF16(sum[3] * scale)}
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
	fmt.Printf("ranks equal %v, w = [%.1f %.1f %.1f %.1f]\n", fmt.Sprint(w[0]) == fmt.Sprint(w[1]),
		fromBF16(w[0][0]), fromBF16(w[0][1]), fromBF16(w[0][2]), fromBF16(w[0][3]))
	// Output: ranks equal true, w = [1.0 -2.0 0.5 3.0]
}
