package gradacc_test

import (
	"errors"
	"fmt"

	gradacc "github.com/gradacc/gradacc/bindings/go"
)

// The accelerate seed: x = 1..8, y = 2x, w = 0, mean-reduced MSE over 4 micro-batches of 2, one
// SGD step with lr 0.02 gives the full-batch result, 2.04.
func Example() {
	cfg := gradacc.DefaultScalerConfig()
	cfg.InitScale = 1
	scaler, err := gradacc.NewScaler(&cfg, nil)
	if err != nil {
		panic(err)
	}
	defer scaler.Close()
	acc, err := gradacc.NewAccumulator([]gradacc.TensorDesc{{Numel: 1, DType: gradacc.F32}}, nil, nil)
	if err != nil {
		panic(err)
	}
	defer acc.Close()

	w := float32(0)
	for m := 0; m < 4; m++ {
		var g float32
		for i := 2 * m; i < 2*m+2; i++ {
			x := float32(i + 1)
			g += 2 * (w*x - 2*x) * x / 2
		}
		if err := acc.Add(scaler, []gradacc.Grad{gradacc.Float32s([]float32{g})}, 2); err != nil {
			panic(err)
		}
	}
	info, err := acc.Sync(nil)
	if err != nil {
		panic(err)
	}
	if skipped, _ := scaler.Update(acc); !skipped {
		grad, _ := acc.CopyMaster(0)
		w -= 0.02 * grad[0]
	}
	fmt.Printf("items %d, w = %.2f\n", info.TotalCount, w)

	// A failing call: the error carries the status and the message.
	_, err = acc.Sync(nil)
	var e *gradacc.Error
	fmt.Println(errors.As(err, &e), e.Status == gradacc.StatusEmptyWindow)
	// Output:
	// items 8, w = 2.04
	// true true
}
