package gradacc

import (
	"errors"
	"math"
	"math/rand"
	"runtime"
	"strings"
	"testing"
)

// f16Value decodes an fp16 word exactly.
func f16Value(w uint16) float64 {
	sign := 1.0
	if w&0x8000 != 0 {
		sign = -1
	}
	exp, frac := int(w>>10&0x1f), float64(w&0x3ff)
	if exp == 0 {
		return sign * math.Ldexp(frac, -24)
	}
	return sign * math.Ldexp(1024+frac, exp-25)
}

// bf16Value decodes a bf16 word exactly: the upper half of an f32.
func bf16Value(w uint16) float64 { return float64(math.Float32frombits(uint32(w) << 16)) }

// boundCase is one tensor list of every dtype and its buffers, which fill rewrites in place.
type boundCase struct {
	tensors []TensorDesc
	f32     map[int][]float32
	w16     map[int][]uint16
	grads   []Grad
}

func newBoundCase() *boundCase {
	c := &boundCase{
		tensors: []TensorDesc{{3, F32}, {1001, F16}, {17, BF16}, {64, F32}, {5, F16}},
		f32:     map[int][]float32{},
		w16:     map[int][]uint16{},
	}
	for i, t := range c.tensors {
		if t.DType == F32 {
			c.f32[i] = make([]float32, t.Numel)
			c.grads = append(c.grads, Float32s(c.f32[i]))
		} else {
			c.w16[i] = make([]uint16, t.Numel)
			c.grads = append(c.grads, Words16(c.w16[i]))
		}
	}
	return c
}

// fill writes random gradients into the buffers and returns their exact values. The exponents
// stay within [-8, 8], so neither the scale nor the sums leave f32's normal range.
func (c *boundCase) fill(rng *rand.Rand) [][]float64 {
	vals := make([][]float64, len(c.tensors))
	for i, t := range c.tensors {
		vals[i] = make([]float64, t.Numel)
		for k := range vals[i] {
			sign := uint16(rng.Intn(2)) << 15
			switch t.DType {
			case F16:
				w := sign | uint16(15+rng.Intn(17)-8)<<10 | uint16(rng.Intn(1<<10))
				c.w16[i][k], vals[i][k] = w, f16Value(w)
			case BF16:
				w := sign | uint16(127+rng.Intn(17)-8)<<7 | uint16(rng.Intn(1<<7))
				c.w16[i][k], vals[i][k] = w, bf16Value(w)
			default:
				x := float32(math.Ldexp(rng.Float64()+0.5, rng.Intn(17)-8))
				if sign != 0 {
					x = -x
				}
				c.f32[i][k], vals[i][k] = x, float64(x)
			}
		}
	}
	return vals
}

// AddBound adds what the buffers hold at each call, bit for bit as Add does, and both match the
// f64 reference: mean losses normalised by the count, sum_m count_m * g_m / scale / sum_m count_m.
func TestAddBoundMatchesAddAndTheReference(t *testing.T) {
	const scale = 1024
	rng := rand.New(rand.NewSource(20261124))
	c := newBoundCase()
	scaler := scalerWithScale(t, scale)
	defer scaler.Close()
	plain := must(NewAccumulator(c.tensors, nil, nil))
	defer plain.Close()
	acc := must(NewAccumulator(c.tensors, nil, nil))
	defer acc.Close()
	bound := must(acc.Bind(c.grads))
	defer bound.Close()

	sum := make([][]float64, len(c.tensors)) // sum_m count_m * g_m / scale
	mag := make([][]float64, len(c.tensors)) // the same over |g_m|: the rounding's scale
	for i, t := range c.tensors {
		sum[i], mag[i] = make([]float64, t.Numel), make([]float64, t.Numel)
	}
	var total uint64
	for _, count := range []uint64{3, 5, 1, 8} {
		vals := c.fill(rng)
		for i := range vals {
			for k, v := range vals[i] {
				sum[i][k] += float64(count) * v / scale
				mag[i][k] += float64(count) * math.Abs(v) / scale
			}
		}
		total += count
		if err := plain.Add(scaler, c.grads, count); err != nil {
			t.Fatal(err)
		}
		if err := acc.AddBound(scaler, bound, count); err != nil {
			t.Fatal(err)
		}
	}
	want, got := must(plain.Sync(nil)), must(acc.Sync(nil))
	if got != want || got.TotalCount != total || got.Microbatches != 4 || got.FoundInf {
		t.Fatalf("bound %+v, plain %+v", got, want)
	}
	for i := range c.tensors {
		p, b := must(plain.CopyMaster(i)), must(acc.CopyMaster(i))
		for k := range b {
			if math.Float32bits(b[k]) != math.Float32bits(p[k]) {
				t.Fatalf("tensor %d element %d: bound %g, plain %g", i, k, b[k], p[k])
			}
			ref := sum[i][k] / float64(total)
			if math.Abs(float64(b[k])-ref) > 1e-6*mag[i][k]/float64(total) {
				t.Fatalf("tensor %d element %d: %.9g, want %.9g", i, k, b[k], ref)
			}
		}
	}
}

// A bound set references the buffers: each AddBound reads what they hold then.
func TestAddBoundReadsTheBuffersAtEachCall(t *testing.T) {
	scaler := scalerWithScale(t, 1)
	defer scaler.Close()
	cfg := DefaultAccumulatorConfig()
	cfg.LossReduction = LossSum
	cfg.Normalize = NormalizeNone
	acc := must(NewAccumulator([]TensorDesc{{2, F32}, {1, F16}}, &cfg, nil))
	defer acc.Close()
	g32, g16 := []float32{1, 2}, []uint16{f16[1]}
	bound := must(acc.Bind([]Grad{Float32s(g32), Words16(g16)}))
	defer bound.Close()
	for _, x := range []float32{1, 2} {
		g32[0], g32[1], g16[0] = 10*x, 100*x, f16[x]
		if err := acc.AddBound(scaler, bound, 1); err != nil {
			t.Fatal(err)
		}
	}
	must(acc.Sync(nil))
	if m := must(acc.CopyMaster(0)); m[0] != 30 || m[1] != 300 {
		t.Fatalf("master 0 %v, want [30 300]", m)
	}
	if m := must(acc.CopyMaster(1)); m[0] != 3 {
		t.Fatalf("master 1 %v, want [3]", m)
	}
}

// Every misuse fails with its status, and the accumulator keeps the one good micro-batch alone.
func TestBindAndAddBoundMisuse(t *testing.T) {
	scaler := scalerWithScale(t, 1)
	defer scaler.Close()
	tensors := []TensorDesc{{2, F32}, {3, F16}}
	acc := must(NewAccumulator(tensors, nil, nil))
	defer acc.Close()
	other := must(NewAccumulator(tensors, nil, nil))
	defer other.Close()
	grads := []Grad{Float32s([]float32{4, 8}), Words16([]uint16{f16[1], f16[2], f16[1]})}
	good := must(acc.Bind(grads))
	defer good.Close()
	if err := acc.AddBound(scaler, good, 2); err != nil {
		t.Fatal(err)
	}

	foreign := must(other.Bind(grads))
	defer foreign.Close()
	closed := must(acc.Bind(grads))
	if err := closed.Close(); err != nil {
		t.Fatal(err)
	}
	if err := closed.Close(); err != nil { // idempotent
		t.Fatal(err)
	}
	bindCases := []struct {
		name  string
		grads []Grad
		want  Status
	}{
		{"one gradient for two tensors", grads[:1], StatusSizeMismatch},
		{"three gradients for two tensors", append(grads[:2:2], grads[0]), StatusSizeMismatch},
		{"[]uint16 for an f32 tensor", []Grad{Words16([]uint16{1, 2}), grads[1]}, StatusDTypeMismatch},
		{"[]float32 for an f16 tensor", []Grad{grads[0], Float32s([]float32{1, 2, 3})}, StatusDTypeMismatch},
		{"too short", []Grad{grads[0], Words16([]uint16{1, 2})}, StatusSizeMismatch},
		{"too long", []Grad{Float32s([]float32{1, 2, 3}), grads[1]}, StatusSizeMismatch},
	}
	for _, c := range bindCases {
		b, err := acc.Bind(c.grads)
		var e *Error
		if b != nil || !errors.As(err, &e) || e.Status != c.want || e.Message == "" {
			t.Errorf("Bind, %s: %v, %v", c.name, b, err)
			continue
		}
		// The same message as Add.
		if err2 := acc.Add(scaler, c.grads, 1); err2 == nil || err2.Error() != err.Error() {
			t.Errorf("Bind, %s: %q; Add: %v", c.name, err, err2)
		}
	}
	addCases := []struct {
		name string
		b    *BoundGrads
		want Status
	}{{"closed", closed, StatusInvalidHandle}, {"nil", nil, StatusInvalidHandle}, {"another accumulator's", foreign, StatusInvalidArgument}}
	for _, c := range addCases {
		err := acc.AddBound(scaler, c.b, 1)
		var e *Error
		if !errors.As(err, &e) || e.Status != c.want || !strings.Contains(e.Message, "`b`") {
			t.Errorf("AddBound, %s: %v", c.name, err)
		}
	}
	closedScaler := scalerWithScale(t, 1)
	closedScaler.Close()
	if err := acc.AddBound(closedScaler, good, 1); !errors.Is(err, &Error{Status: StatusInvalidHandle}) {
		t.Errorf("closed scaler: %v", err)
	}
	gone := must(NewAccumulator(tensors, nil, nil))
	stale := must(gone.Bind(grads))
	gone.Close()
	if err := gone.AddBound(scaler, stale, 1); !errors.Is(err, &Error{Status: StatusInvalidHandle}) {
		t.Errorf("closed accumulator: %v", err)
	}
	if _, err := gone.Bind(grads); !errors.Is(err, &Error{Status: StatusInvalidHandle}) {
		t.Errorf("Bind on a closed accumulator: %v", err)
	}
	stale.Close()

	info := must(acc.Sync(nil))
	if info.TotalCount != 2 || info.Microbatches != 1 || info.FoundInf {
		t.Fatalf("info %+v", info)
	}
	if m := must(acc.CopyMaster(0)); m[0] != 4 || m[1] != 8 {
		t.Fatalf("master 0 %v", m)
	}
	if m := must(acc.CopyMaster(1)); m[0] != 1 || m[1] != 2 || m[2] != 1 {
		t.Fatalf("master 1 %v", m)
	}
}

// Bound sets left to the finalizers (run this under GOGC=1 too): the pinned buffers outlive
// every other reference to them, and an unclosed set is unpinned and freed.
func TestBoundGradsFinalizers(t *testing.T) {
	scaler := scalerWithScale(t, 1)
	defer scaler.Close()
	for i := 0; i < 100; i++ {
		acc := must(NewAccumulator([]TensorDesc{{64, F32}, {64, F16}}, nil, nil))
		bound := func() *BoundGrads { // the only references to the buffers are the set's
			g32, g16 := make([]float32, 64), make([]uint16, 64)
			for k := range g32 {
				g32[k], g16[k] = 3, f16[2]
			}
			return must(acc.Bind([]Grad{Float32s(g32), Words16(g16)}))
		}()
		runtime.GC()
		garbage := make([][]float32, 64)
		for k := range garbage {
			garbage[k] = make([]float32, 64)
			for j := range garbage[k] {
				garbage[k][j] = -1
			}
		}
		if err := acc.AddBound(scaler, bound, 1); err != nil {
			t.Fatal(err)
		}
		must(acc.Sync(nil))
		if m0, m1 := must(acc.CopyMaster(0)), must(acc.CopyMaster(1)); m0[63] != 3 || m1[63] != 2 {
			t.Fatalf("masters %g %g", m0[63], m1[63])
		}
		if i%2 == 0 {
			bound.Close()
		}
		runtime.KeepAlive(garbage)
	}
	runtime.GC()
	runtime.GC()
}

// One micro-batch of 1,000 tensors of 4 fp16 elements, so that the C work is small and the
// binding's cost shows: the plain Add, AddBound, and the bare C call under AddBound. Most of the
// plain Add is the runtime's pinning, the more as two 8-byte buffers share one 16-byte block of
// Go's tiny allocator, which is then pinned twice (a slower path in the runtime).
func BenchmarkAdd(b *testing.B) {
	const tensors, numel = 1000, 4
	descs := make([]TensorDesc, tensors)
	grads := make([]Grad, tensors)
	for i := range descs {
		descs[i] = TensorDesc{numel, F16}
		w := make([]uint16, numel)
		for k := range w {
			w[k] = f16[1]
		}
		grads[i] = Words16(w)
	}
	scaler := must(NewScaler(nil, nil))
	defer scaler.Close()
	acc := must(NewAccumulator(descs, nil, nil))
	defer acc.Close()
	b.Run("plain", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			if err := acc.Add(scaler, grads, 1); err != nil {
				b.Fatal(err)
			}
		}
	})
	// Bound last: pinned buffers make Add's own pins take the runtime's slower path for objects
	// pinned twice.
	bound := must(acc.Bind(grads))
	defer bound.Close()
	b.Run("bound", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			if err := acc.AddBound(scaler, bound, 1); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("bare", func(b *testing.B) {
		b.ReportAllocs()
		for i := 0; i < b.N; i++ {
			if st := acc.addBare(scaler, bound, 1); st != StatusOK {
				b.Fatal(st)
			}
		}
	})
}
