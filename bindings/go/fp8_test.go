package gradacc

import (
	"math"
	"sync"
	"testing"
)

// e4m3Value is the value of E4M3 code c (float8_e4m3fn; 0x7f and 0xff are NaN).
func e4m3Value(c int) float64 {
	e, m := (c>>3)&15, c&7
	v := math.Ldexp(float64(8+m), e-10)
	if e == 0 {
		v = math.Ldexp(float64(m), -9)
	}
	if c>>7 == 1 {
		return -v
	}
	return v
}

// e4m3Of is E4M3 of x saturated at ±448, the nearest code, ties to the even one.
func e4m3Of(x float64) uint8 {
	x = math.Max(math.Min(x, 448), -448)
	best, bestD := -1, math.Inf(1)
	for c := 0; c < 256; c++ {
		if c&0x7f == 0x7f || math.Signbit(x) != (c>>7 == 1) {
			continue
		}
		d := math.Abs(e4m3Value(c) - x)
		if d < bestD || (d == bestD && c&1 == 0) {
			best, bestD = c, d
		}
	}
	return uint8(best)
}

const fp8N0, fp8N1, fp8N2 = 5000, 3001, 4133

// fp8Rank steps rank r of two under ShardingReduceScatter twice: with fp8, tensor 1 as E4M3 and
// tensor 2 as MXFP8, returning after each step tensor 1's codes and scale and tensor 2's codes
// and scales; without, every tensor as f32 weights, which are then the masters.
func fp8Rank(t *testing.T, comm *Comm, r int, fp8 bool) [][]any {
	scaler := scalerWithScale(t, 1)
	defer scaler.Close()
	cfg := DefaultAccumulatorConfig()
	cfg.Sharding, cfg.ShardCount, cfg.ShardRank = ShardingReduceScatter, 2, uint32(r)
	acc := must(NewAccumulator([]TensorDesc{{fp8N0, F32}, {fp8N1, F32}, {fp8N2, F32}}, &cfg, nil))
	defer acc.Close()
	w := [][]float32{make([]float32, fp8N0), make([]float32, fp8N1), make([]float32, fp8N2)}
	for i := range w {
		for e := range w[i] {
			w[i][e] = float32(math.Ldexp(math.Sin(float64(e*(i+3))), e%24-12))
		}
	}
	oc := DefaultOptimizerConfig()
	oc.LR = 0.05
	if fp8 {
		oc.WeightFormats = []WeightFormat{WeightsModel, WeightsE4M3Tensorwise, WeightsMXFP8}
	}
	opt := must(NewOptimizer(acc, []Weight{WeightF32(w[0]), WeightF32(w[1]), WeightF32(w[2])}, &oc, nil))
	defer opt.Close()
	codes1, codes2, scales2 := make([]uint8, fp8N1), make([]uint8, fp8N2), make([]uint8, (fp8N2+31)/32)
	var scale1 float32
	step := []Weight{WeightF32(w[0]), WeightF32(w[1]), WeightF32(w[2])}
	if fp8 {
		step[1], step[2] = WeightE4M3(codes1, &scale1), WeightMXFP8(codes2, scales2)
	}
	var seen [][]any
	for s := 0; s < 2; s++ {
		g := [][]float32{make([]float32, fp8N0), make([]float32, fp8N1), make([]float32, fp8N2)}
		for i := range g {
			for e := range g[i] {
				g[i][e] = float32(math.Cos(float64(e*(s+1) + r*7 + i)))
			}
		}
		if err := acc.Add(scaler, []Grad{Float32s(g[0]), Float32s(g[1]), Float32s(g[2])}, 1); err != nil {
			t.Error(err)
			return nil
		}
		if _, err := acc.Sync(comm); err != nil {
			t.Error(err)
			return nil
		}
		if ok, err := opt.Step(acc, step, comm); err != nil || !ok {
			t.Errorf("rank %d, step %d: stepped %v, %v", r, s, ok, err)
			return nil
		}
		if fp8 {
			seen = append(seen, []any{append([]uint8(nil), codes1...), scale1, append([]uint8(nil), codes2...), append([]uint8(nil), scales2...)})
		} else {
			seen = append(seen, []any{append([]float32(nil), w[1]...), append([]float32(nil), w[2]...)})
		}
	}
	return seen
}

func runFP8(t *testing.T, fp8 bool) [][][]any {
	comms := must(NewLocalGroup(2))
	out := make([][][]any, 2)
	var wg sync.WaitGroup
	for r := 0; r < 2; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			out[r] = fp8Rank(t, comms[r], r, fp8)
		}(r)
	}
	wg.Wait()
	for _, c := range comms {
		c.Close()
	}
	return out
}

// Two ranks write tensor 1 as E4M3 and tensor 2 as MXFP8: after each step both hold the codes
// and scales of quantising the same run's masters (its f32 weights) by this file's reference.
func TestFP8WeightsAreTheWholeMastersQuantisedOnce(t *testing.T) {
	masters, codes := runFP8(t, false), runFP8(t, true)
	if t.Failed() {
		return
	}
	for s := 0; s < 2; s++ {
		m1, m2 := masters[0][s][0].([]float32), masters[0][s][1].([]float32)
		amax := 0.0
		for _, v := range m1 {
			amax = math.Max(amax, math.Abs(float64(v)))
		}
		scale := float32(448 / math.Max(amax, 1e-12))
		for r := 0; r < 2; r++ {
			c1, s1, c2, s2 := codes[r][s][0].([]uint8), codes[r][s][1].(float32), codes[r][s][2].([]uint8), codes[r][s][3].([]uint8)
			if math.Float32bits(s1) != math.Float32bits(scale) {
				t.Fatalf("step %d, rank %d: scale %g, want %g", s, r, s1, scale)
			}
			for e, v := range m1 {
				if c1[e] != e4m3Of(float64(v*scale)) {
					t.Fatalf("step %d, rank %d: E4M3 code %d is %#x, want %#x", s, r, e, c1[e], e4m3Of(float64(v*scale)))
				}
			}
			for b := 0; b*32 < fp8N2; b++ {
				end := min((b+1)*32, fp8N2)
				bmax := 0.0
				for _, v := range m2[b*32 : end] {
					bmax = math.Max(bmax, math.Abs(float64(v)))
				}
				x := -127
				if bmax > 0 {
					x = max(-127, min(127, int(math.Floor(math.Log2(bmax)))-8))
				}
				if s2[b] != uint8(x+127) {
					t.Fatalf("step %d, rank %d: MXFP8 scale %d is %d, want %d", s, r, b, s2[b], x+127)
				}
				for e := b * 32; e < end; e++ {
					if want := e4m3Of(math.Ldexp(float64(m2[e]), -x)); c2[e] != want {
						t.Fatalf("step %d, rank %d: MXFP8 code %d is %#x, want %#x", s, r, e, c2[e], want)
					}
				}
			}
		}
	}
}

// Step of an FP8 optimizer with the tensor's model weight instead of its codes, or with the
// wrong number of scales, is refused naming it.
func TestFP8WeightsOfTheWrongKindAreRefused(t *testing.T) {
	cfg := DefaultAccumulatorConfig()
	cfg.Sharding, cfg.ShardCount = ShardingReduceScatter, 1
	acc := must(NewAccumulator([]TensorDesc{{40, F32}}, &cfg, nil))
	defer acc.Close()
	oc := DefaultOptimizerConfig()
	oc.WeightFormats = []WeightFormat{WeightsMXFP8}
	w := make([]float32, 40)
	opt := must(NewOptimizer(acc, []Weight{WeightF32(w)}, &oc, nil))
	defer opt.Close()
	scaler := scalerWithScale(t, 1)
	defer scaler.Close()
	comms := must(NewLocalGroup(1))
	defer comms[0].Close()
	if err := acc.Add(scaler, []Grad{Float32s(make([]float32, 40))}, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := acc.Sync(comms[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := opt.Step(acc, []Weight{WeightF32(w)}, comms[0]); err == nil || err.(*Error).Status != StatusDTypeMismatch {
		t.Fatalf("a model weight for an MXFP8 tensor: %v", err)
	}
	codes := make([]uint8, 40)
	if _, err := opt.Step(acc, []Weight{WeightMXFP8(codes, make([]uint8, 1))}, comms[0]); err == nil || err.(*Error).Status != StatusSizeMismatch {
		t.Fatalf("1 scale for 40 elements: %v", err)
	}
	if ok, err := opt.Step(acc, []Weight{WeightMXFP8(codes, make([]uint8, 2))}, comms[0]); err != nil || !ok {
		t.Fatalf("the step after the refusals: %v, %v", ok, err)
	}
}
