package gradacc

import (
	"errors"
	"math"
	"runtime"
	"sync"
	"testing"
)

// f16 words of the small integers the seeds use (exact in fp16).
var f16 = map[float32]uint16{1: 0x3c00, 2: 0x4000}

// bf16 words: the upper half of the f32.
func bf16(x float32) uint16 { return uint16(math.Float32bits(x) >> 16) }

// must panics on an error, which fails the test with the error and its stack.
func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

func scalerWithScale(t *testing.T, scale float32) *Scaler {
	cfg := DefaultScalerConfig()
	cfg.InitScale = scale
	return must(NewScaler(&cfg, nil))
}

type rankResult struct {
	info         SyncInfo
	weight, bias float32
	err          error
}

// Seed apex-o2: Linear(1,1), loss = mean(output), inputs 1.0 and 2.0 on two ranks (goroutines on
// a local group), two micro-batches each, loss scale 1. Apex O2 steps with 2.5 and 3.5.
func runApex(t *testing.T, normalize Normalize, dtype DType) [2]rankResult {
	comms := must(NewLocalGroup(2))
	defer func() {
		for _, c := range comms {
			c.Close()
		}
	}()
	var res [2]rankResult
	var wg sync.WaitGroup
	for r := 0; r < 2; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			runtime.LockOSThread() // one OS thread per rank, as the C API's threads expect
			defer runtime.UnlockOSThread()
			res[r].err = func() error {
				cfg := DefaultScalerConfig()
				cfg.InitScale = 1
				scaler, err := NewScaler(&cfg, nil)
				if err != nil {
					return err
				}
				defer scaler.Close()
				ac := DefaultAccumulatorConfig()
				ac.Normalize = normalize
				acc, err := NewAccumulator([]TensorDesc{{1, dtype}, {1, dtype}}, &ac, nil)
				if err != nil {
					return err
				}
				defer acc.Close()
				x := float32(r + 1)
				var grads []Grad
				switch dtype {
				case F16:
					grads = []Grad{Words16([]uint16{f16[x]}), Words16([]uint16{f16[1]})}
				case BF16:
					grads = []Grad{Words16([]uint16{bf16(x)}), Words16([]uint16{bf16(1)})}
				default:
					grads = []Grad{Float32s([]float32{x}), Float32s([]float32{1})}
				}
				for m := 0; m < 2; m++ {
					if err := acc.Add(scaler, grads, 1); err != nil {
						return err
					}
				}
				if res[r].info, err = acc.Sync(comms[r]); err != nil {
					return err
				}
				w, err := acc.CopyMaster(0)
				if err != nil {
					return err
				}
				b, err := acc.Master(1)
				if err != nil {
					return err
				}
				res[r].weight, res[r].bias = w[0], b[0]
				runtime.KeepAlive(acc)
				skipped, err := scaler.Update(acc)
				if err == nil && skipped {
					err = errors.New("step skipped")
				}
				return err
			}()
		}(r)
	}
	wg.Wait()
	return res
}

func TestApexO2TwoRanks(t *testing.T) {
	cases := []struct {
		normalize    Normalize
		weight, bias float32
	}{{ByWorld, 3.0, 2.0}, {ByMicrobatches, 1.5, 1.0}}
	for _, c := range cases {
		for _, dtype := range []DType{F16, BF16, F32} {
			res := runApex(t, c.normalize, dtype)
			for r, got := range res {
				if got.err != nil {
					t.Fatalf("normalize %d dtype %d rank %d: %v", c.normalize, dtype, r, got.err)
				}
				if got.weight != c.weight || got.bias != c.bias {
					t.Errorf("normalize %d dtype %d rank %d: weight %g bias %g, want %g %g", c.normalize, dtype, r, got.weight, got.bias, c.weight, c.bias)
				}
				if got.info.FoundInf || got.info.TotalCount != 4 || got.info.Microbatches != 4 {
					t.Errorf("rank %d info %+v", r, got.info)
				}
			}
			if math.Float32bits(res[0].weight) != math.Float32bits(res[1].weight) || res[0].info != res[1].info {
				t.Errorf("ranks differ: %+v", res)
			}
		}
	}
}

// Seed accelerate: x = 1..8, y = 2x, w = 0, MSE, 4 micro-batches of 2, SGD lr 0.02: w = 2.04.
func TestAccelerate(t *testing.T) {
	scaler := scalerWithScale(t, 1)
	defer scaler.Close()
	acc := must(NewAccumulator([]TensorDesc{{1, F32}}, nil, nil)) // BY_COUNT, mean losses
	defer acc.Close()
	var w float32
	for m := 0; m < 4; m++ {
		var g float64
		for i := 2 * m; i < 2*m+2; i++ {
			x := float64(i + 1)
			g += 2 * (float64(w)*x - 2*x) * x
		}
		if err := acc.Add(scaler, []Grad{Float32s([]float32{float32(g / 2)})}, 2); err != nil {
			t.Fatal(err)
		}
	}
	info := must(acc.Sync(nil))
	if info.TotalCount != 8 || info.Microbatches != 4 {
		t.Errorf("info %+v", info)
	}
	if skipped := must(scaler.Update(acc)); skipped {
		t.Fatal("skipped")
	}
	g := must(acc.CopyMaster(0))
	if g[0] != -102 {
		t.Fatalf("gradient %g, want -102", g[0])
	}
	w = float32(float64(w) - 0.02*float64(g[0]))
	if math.Abs(float64(w)-2.04) > 2.04*1.2e-7 {
		t.Fatalf("weight %.9g, want 2.04", w)
	}
}

// Seed fastai: a batch of 32 split into 4 micro-batches of 8, mean- or sum-reduced, equals the
// full-batch mean gradient computed in f64.
func TestFastaiSumVsMean(t *testing.T) {
	const in, out, batch = 5, 3, 32
	seed := uint64(12345)
	rnd := func() float64 { // splitmix64, in [-1, 1)
		seed += 0x9e3779b97f4a7c15
		z := seed
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
		z = (z ^ (z >> 27)) * 0x94d049bb133111eb
		return float64((z^(z>>31))>>11)/(1<<52) - 1
	}
	var W [out * in]float64
	var X [batch][in]float64
	var T [batch][out]float64
	for i := range W {
		W[i] = rnd()
	}
	for i := range X {
		for j := range X[i] {
			X[i][j] = rnd()
		}
		for o := range T[i] {
			T[i][o] = rnd()
		}
	}
	gradSum := func(lo, hi int) []float64 {
		g := make([]float64, out*in)
		for i := lo; i < hi; i++ {
			for o := 0; o < out; o++ {
				r := -T[i][o]
				for j := 0; j < in; j++ {
					r += W[o*in+j] * X[i][j]
				}
				for j := 0; j < in; j++ {
					g[o*in+j] += r * X[i][j]
				}
			}
		}
		return g
	}
	full := gradSum(0, batch)
	for _, red := range []LossReduction{LossMean, LossSum} {
		scaler := scalerWithScale(t, 1)
		cfg := DefaultAccumulatorConfig()
		cfg.LossReduction = red
		acc := must(NewAccumulator([]TensorDesc{{out * in, F32}}, &cfg, nil))
		for m := 0; m < 4; m++ {
			g := gradSum(8*m, 8*m+8)
			g32 := make([]float32, len(g))
			for k := range g {
				if red == LossMean {
					g[k] /= 8
				}
				g32[k] = float32(g[k])
			}
			if err := acc.Add(scaler, []Grad{Float32s(g32)}, 8); err != nil {
				t.Fatal(err)
			}
		}
		must(acc.Sync(nil))
		got := must(acc.CopyMaster(0))
		for k := range got {
			want := full[k] / batch
			if math.Abs(float64(got[k])-want) > 1e-6+1e-5*math.Abs(want) {
				t.Errorf("reduction %d element %d: %g, want %g", red, k, got[k], want)
			}
		}
		acc.Close()
		scaler.Close()
	}
}

func TestErrorCarriesStatusAndMessage(t *testing.T) {
	scaler := scalerWithScale(t, 1)
	defer scaler.Close()
	acc := must(NewAccumulator([]TensorDesc{{4, F16}}, nil, nil))
	defer acc.Close()
	if err := acc.BeginMicrobatch(1); err != nil {
		t.Fatal(err)
	}
	err := acc.AddTensor(scaler, 0, Words16(make([]uint16, 8)))
	var e *Error
	if !errors.As(err, &e) || e.Status != StatusSizeMismatch {
		t.Fatalf("got %v, want a size mismatch", err)
	}
	if e.Message == "" || !errors.Is(err, &Error{Status: StatusSizeMismatch}) {
		t.Fatalf("message %q", e.Message)
	}
	if _, err := acc.Sync(nil); !errors.Is(err, &Error{Status: StatusWrongState}) {
		t.Fatalf("sync inside a micro-batch: %v", err)
	}
	cfg := DefaultAccumulatorConfig()
	cfg.Normalize = 99
	if _, err := NewAccumulator([]TensorDesc{{1, F32}}, &cfg, nil); !errors.Is(err, &Error{Status: StatusInvalidArgument}) {
		t.Fatalf("bad config: %v", err)
	}
	if err := acc.Add(scaler, []Grad{Float32s(make([]float32, 4))}, 1); !errors.Is(err, &Error{Status: StatusDTypeMismatch}) {
		t.Fatalf("[]float32 for an f16 tensor: %v", err)
	}
}

// AddTensor checks a typed gradient against its tensor before the C call, which cannot tell what
// a pointer holds: a []float32 for an F16 or BF16 tensor and a []uint16 for an F32 one fail with
// StatusDTypeMismatch, a wrong length with StatusSizeMismatch, and none adds anything: the
// micro-batch ends as it does without them.
func TestAddTensorChecksTheGradientsType(t *testing.T) {
	scaler := scalerWithScale(t, 1)
	defer scaler.Close()
	tensors := []TensorDesc{{4, F16}, {2, BF16}, {3, F32}}
	refused := must(NewAccumulator(tensors, nil, nil))
	defer refused.Close()
	clean := must(NewAccumulator(tensors, nil, nil))
	defer clean.Close()
	good := []Grad{
		Words16([]uint16{f16[1], f16[2], f16[1], f16[2]}),
		Words16([]uint16{bf16(1), bf16(2)}),
		Float32s([]float32{0.5, -1, 2}),
	}
	// Read as the declared dtype, each would change the sum; the words for the f32 tensor have
	// the memory behind them that 3 f32 values take.
	words := []uint16{f16[1], f16[2], f16[1], f16[2], f16[1], f16[2]}
	bad := []struct {
		what   string
		index  int
		g      Grad
		status Status
	}{
		{"[]float32 for an f16 tensor", 0, Float32s([]float32{1, 1, 1, 1}), StatusDTypeMismatch},
		{"[]float32 for a bf16 tensor", 1, Float32s([]float32{1, 1}), StatusDTypeMismatch},
		{"[]uint16 for an f32 tensor", 2, Words16(words[:3]), StatusDTypeMismatch},
		{"too short", 2, Float32s([]float32{1, 1}), StatusSizeMismatch},
		{"too long", 0, Words16(words[:5]), StatusSizeMismatch},
	}
	for _, acc := range []*Accumulator{refused, clean} {
		if err := acc.BeginMicrobatch(2); err != nil {
			t.Fatal(err)
		}
	}
	for _, b := range bad {
		if err := refused.AddTensor(scaler, b.index, b.g); !errors.Is(err, &Error{Status: b.status}) {
			t.Errorf("%s: %v, want status %s", b.what, err, b.status)
		}
	}
	for _, acc := range []*Accumulator{refused, clean} {
		for i, g := range good {
			if err := acc.AddTensor(scaler, i, g); err != nil {
				t.Fatal(err)
			}
		}
		if err := acc.EndMicrobatch(); err != nil {
			t.Fatal(err)
		}
		if _, err := acc.Sync(nil); err != nil {
			t.Fatal(err)
		}
	}
	for i := range tensors {
		got, want := must(refused.CopyMaster(i)), must(clean.CopyMaster(i))
		for k := range want {
			if math.Float32bits(got[k]) != math.Float32bits(want[k]) {
				t.Errorf("tensor %d element %d: %v after the refused calls, %v without them", i, k, got[k], want[k])
			}
		}
	}
}

func TestCloseIsIdempotent(t *testing.T) {
	s := scalerWithScale(t, 8)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Scale(); !errors.Is(err, &Error{Status: StatusInvalidHandle}) {
		t.Fatalf("closed scaler: %v", err)
	}
	comms := must(NewLocalGroup(3))
	for r, c := range comms {
		if got := must(c.Rank()); got != r {
			t.Errorf("rank %d", got)
		}
		c.Close()
		c.Close()
	}
}

// Objects left to the finalizers, under many collections (run this under GOGC=1 too).
func TestFinalizers(t *testing.T) {
	for i := 0; i < 200; i++ {
		s := scalerWithScale(t, 2)
		a := must(NewAccumulator([]TensorDesc{{64, F32}}, nil, nil))
		g := make([]float32, 64)
		for k := range g {
			g[k] = float32(k)
		}
		if err := a.Add(s, []Grad{Float32s(g)}, 1); err != nil {
			t.Fatal(err)
		}
		must(a.Sync(nil))
		m := must(a.CopyMaster(0))
		if m[63] != 31.5 {
			t.Fatalf("master %g", m[63])
		}
		st := must(s.Save())
		if err := s.Load(st); err != nil {
			t.Fatal(err)
		}
		if i%20 == 0 {
			runtime.GC()
		}
	}
	runtime.GC()
}

// Many goroutines, one per rank, several windows, tensor-by-tensor adds from helper goroutines.
func TestLocalGroupManyGoroutines(t *testing.T) {
	const world, windows = 4, 5
	comms := must(NewLocalGroup(world))
	var wg sync.WaitGroup
	results := make([][]float32, world)
	errs := make([]error, world)
	for r := 0; r < world; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			errs[r] = func() error {
				s, err := NewScaler(nil, nil)
				if err != nil {
					return err
				}
				defer s.Close()
				scale, err := s.Scale()
				if err != nil {
					return err
				}
				acc, err := NewAccumulator([]TensorDesc{{16, F32}, {8, F32}}, nil, nil)
				if err != nil {
					return err
				}
				defer acc.Close()
				for w := 0; w < windows; w++ {
					if err := acc.BeginMicrobatch(uint64(r + 1)); err != nil {
						return err
					}
					var inner sync.WaitGroup
					addErr := make([]error, 2)
					for ti, n := range []int{16, 8} {
						inner.Add(1)
						go func(ti, n int) {
							defer inner.Done()
							g := make([]float32, n)
							for k := range g {
								g[k] = float32(r+1) * scale
							}
							addErr[ti] = acc.AddTensor(s, ti, Float32s(g))
						}(ti, n)
					}
					inner.Wait()
					for _, e := range addErr {
						if e != nil {
							return e
						}
					}
					if err := acc.EndMicrobatch(); err != nil {
						return err
					}
					if _, err := acc.Sync(comms[r]); err != nil {
						return err
					}
				}
				results[r], err = acc.CopyMaster(1)
				return err
			}()
		}(r)
	}
	wg.Wait()
	for r := 0; r < world; r++ {
		if errs[r] != nil {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
		// BY_COUNT of mean losses: sum_r count_r * g_r / sum_r count_r = (1+4+9+16)/10 = 3
		if results[r][0] != 3 {
			t.Errorf("rank %d master %g, want 3", r, results[r][0])
		}
	}
	for _, c := range comms {
		c.Close()
	}
}
