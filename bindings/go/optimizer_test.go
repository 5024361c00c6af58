package gradacc

import (
	"bytes"
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

// f16Bits is the fp16 word of a finite float32, rounded to nearest even (the values here stay
// below 65504).
func f16Bits(x float32) uint16 {
	sign := uint16(0)
	if math.Signbit(float64(x)) {
		sign = 0x8000
	}
	a := math.Abs(float64(x))
	if a < 0x1p-14 { // subnormal: a multiple of 2^-24
		return sign | uint16(math.RoundToEven(a*0x1p24))
	}
	_, e := math.Frexp(a) // a in [2^(e-1), 2^e)
	q := uint16(math.RoundToEven(math.Ldexp(a, 11-e)))
	return sign | (uint16(e+14)<<10 + q - 1024)
}

const optN0, optN1 = 300, 7

func optGrad0(i int) float32 { return float32(float64(i%7)*0.25 - 0.5) }

// One micro-batch of the gradients times scale (+inf in g0[3] when poison), then the sync.
func addAndSync(t *testing.T, acc *Accumulator, s *Scaler, poison bool) SyncInfo {
	scale := must(s.Scale())
	g0, g1 := make([]uint16, optN0), make([]float32, optN1)
	for i := range g0 {
		g0[i] = f16Bits(optGrad0(i) * scale)
	}
	for i := range g1 {
		g1[i] = 0.75 * scale
	}
	if poison {
		g0[3] = 0x7c00
	}
	if err := acc.Add(s, []Grad{Words16(g0), Float32s(g1)}, 1); err != nil {
		t.Fatal(err)
	}
	return must(acc.Sync(nil))
}

// SGD steps write w + (-lr)*g in f32, rounded once to fp16, bit for bit; a step whose window
// held an inf changes nothing; save and load restore the state.
func TestOptimizerSGDBitForBit(t *testing.T) {
	scaler := scalerWithScale(t, 1024)
	defer scaler.Close()
	acc := must(NewAccumulator([]TensorDesc{{optN0, F16}, {optN1, F32}}, nil, nil))
	defer acc.Close()
	w0, w1 := make([]uint16, optN0), make([]float32, optN1)
	for i := range w0 {
		w0[i] = f16Bits(float32(0.01*float64(i) - 1))
	}
	for i := range w1 {
		w1[i] = float32(i) * 0.5
	}
	weights := []Weight{WeightF16(w0), WeightF32(w1)}
	cfg := DefaultOptimizerConfig()
	cfg.Algorithm, cfg.LR, cfg.WeightDecay = SGD, 0.125, 0
	opt := must(NewOptimizer(acc, weights, &cfg, nil))
	defer opt.Close()
	m0, m1 := make([]float32, optN0), append([]float32(nil), w1...)
	for i := range m0 {
		m0[i] = float32(f16Value(w0[i])) // exact
	}
	const lr = float32(0.125)
	for step := 0; step < 4; step++ {
		poison := step == 2
		before0, before1 := append([]uint16(nil), w0...), append([]float32(nil), w1...)
		info := addAndSync(t, acc, scaler, poison)
		if skipped := must(scaler.Update(acc)); skipped != poison || info.FoundInf != poison {
			t.Fatalf("step %d: skipped %v, found_inf %v", step, skipped, info.FoundInf)
		}
		if stepped := must(opt.Step(acc, weights, nil)); stepped == poison {
			t.Fatalf("step %d: stepped %v", step, stepped)
		}
		if poison {
			for i := range w0 {
				if w0[i] != before0[i] {
					t.Fatalf("a skipped step changed w0[%d]", i)
				}
			}
			for i := range w1 {
				if w1[i] != before1[i] {
					t.Fatalf("a skipped step changed w1[%d]", i)
				}
			}
			continue
		}
		for i := range m0 {
			m0[i] = m0[i] + float32(-lr*optGrad0(i)) // the conversion rounds: no fused multiply-add
			if w0[i] != f16Bits(m0[i]) {
				t.Fatalf("step %d: w0[%d] = %#x, expected %#x", step, i, w0[i], f16Bits(m0[i]))
			}
		}
		for i := range m1 {
			m1[i] = m1[i] + float32(-lr*0.75)
			if w1[i] != m1[i] {
				t.Fatalf("step %d: w1[%d] = %g, expected %g", step, i, w1[i], m1[i])
			}
		}
	}
	if n := must(opt.Steps()); n != 3 {
		t.Fatalf("steps = %d", n)
	}

	saved := must(opt.Save())
	corrupt := append([]byte(nil), saved...)
	corrupt[len(corrupt)/2] ^= 1
	if err := opt.Load(corrupt); !errors.Is(err, &Error{Status: StatusCorruptState}) {
		t.Fatalf("corrupt state: %v", err)
	}
	if err := opt.Load(saved); err != nil {
		t.Fatal(err)
	}
	if again := must(opt.Save()); !bytes.Equal(again, saved) {
		t.Fatal("the loaded state differs from the saved one")
	}
}

func TestOptimizerErrors(t *testing.T) {
	acc := must(NewAccumulator([]TensorDesc{{optN0, F16}, {optN1, F32}}, nil, nil))
	defer acc.Close()
	w0, w1 := make([]uint16, optN0), make([]float32, optN1)
	weights := []Weight{WeightF16(w0), WeightF32(w1)}
	cfg := DefaultOptimizerConfig()
	cfg.Beta1 = 1.5
	_, err := NewOptimizer(acc, weights, &cfg, nil)
	var e *Error
	if !errors.As(err, &e) || e.Status != StatusInvalidArgument || !strings.Contains(e.Message, "beta1") {
		t.Fatalf("beta1 = 1.5: %v", err)
	}
	if _, err := NewOptimizer(acc, weights[:1], nil, nil); !errors.As(err, &e) || e.Status != StatusSizeMismatch || !strings.Contains(e.Message, "weights") {
		t.Fatalf("one weight: %v", err)
	}
	if _, err := NewOptimizer(acc, []Weight{WeightF16(w0[:10]), WeightF32(w1)}, nil, nil); !errors.As(err, &e) || !strings.Contains(e.Message, "weights[0]") {
		t.Fatalf("short weight: %v", err)
	}
	opt := must(NewOptimizer(acc, weights, nil, []TensorGroup{{true, 1}, {false, 0.5}}))
	if err := opt.SetLR(-1); !errors.As(err, &e) || e.Status != StatusInvalidArgument || !strings.Contains(e.Message, "`lr`") {
		t.Fatalf("lr = -1: %v", err)
	}
	if _, err := opt.LRDevicePtr(); !errors.As(err, &e) || e.Status != StatusDeviceMismatch || !strings.Contains(e.Message, "set_lr") {
		t.Fatalf("a device learning rate on the CPU: %v", err)
	}
	if _, err := opt.Step(acc, []Weight{WeightBF16(w0), WeightF32(w1)}, nil); !errors.As(err, &e) || e.Status != StatusDTypeMismatch || !strings.Contains(e.Message, "weights[0]") {
		t.Fatalf("another dtype: %v", err)
	}
	if _, err := opt.Step(acc, weights, nil); !errors.Is(err, &Error{Status: StatusWrongState}) {
		t.Fatalf("a step before any sync: %v", err)
	}
	opt.Close()
	if err := opt.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := opt.Steps(); !errors.Is(err, &Error{Status: StatusInvalidHandle}) {
		t.Fatalf("closed: %v", err)
	}
}

// Under a reduce-scatter boundary a step the binding refuses on one rank (one weight too few)
// fails on every rank at once: that rank with its own error, the other with PEER_FAILURE; then
// both step.
func TestOptimizerStepRefusedOnOneRankFailsEveryRank(t *testing.T) {
	comms := must(NewLocalGroup(2))
	defer closeAll(comms)
	for _, c := range comms {
		if err := c.SetTimeout(30 * time.Second); err != nil { // a rank left waiting fails, not hangs
			t.Fatal(err)
		}
	}
	errs := make([]error, 2)
	onRanks(t, 2, func(r int) {
		scaler := scalerWithScale(t, 1)
		defer scaler.Close()
		c := DefaultAccumulatorConfig()
		c.Sharding, c.ShardCount, c.ShardRank = ShardingReduceScatter, 2, uint32(r)
		acc := must(NewAccumulator([]TensorDesc{{optN0, F16}, {optN1, F32}}, &c, nil))
		defer acc.Close()
		w0, w1 := make([]uint16, optN0), make([]float32, optN1)
		weights := []Weight{WeightF16(w0), WeightF32(w1)}
		opt := must(NewOptimizer(acc, weights, nil, nil))
		defer opt.Close()
		g0, g1 := make([]uint16, optN0), make([]float32, optN1)
		for i := range g0 {
			g0[i] = f16Bits(optGrad0(i))
		}
		if err := acc.Add(scaler, []Grad{Words16(g0), Float32s(g1)}, 1); err != nil {
			t.Error(err)
			return
		}
		if _, err := acc.Sync(comms[r]); err != nil {
			t.Error(err)
			return
		}
		given := weights
		if r == 1 {
			given = weights[:1]
		}
		_, errs[r] = opt.Step(acc, given, comms[r])
		if stepped, err := opt.Step(acc, weights, comms[r]); err != nil || !stepped {
			t.Errorf("rank %d: the valid step after the refused one: %v, %v", r, stepped, err)
		}
	})
	for r, want := range []Status{StatusPeerFailure, StatusSizeMismatch} {
		var e *Error
		if !errors.As(errs[r], &e) || e.Status != want {
			t.Errorf("rank %d: got %v, want status %v", r, errs[r], want)
		}
	}
}

// Adopted masters: the caller's values (not the weights') are the masters, each SGD step updates
// them in place as w + (-lr)*g in f32, a wrong length is refused naming `masters`, a refused
// Load leaves them bit for bit and a Load writes the saved ones back.
func TestOptimizerWithMasters(t *testing.T) {
	scaler := scalerWithScale(t, 1024)
	defer scaler.Close()
	acc := must(NewAccumulator([]TensorDesc{{optN0, F16}, {optN1, F32}}, nil, nil))
	defer acc.Close()
	_, shard, err := acc.Shard()
	if err != nil {
		t.Fatal(err)
	}
	at1 := must(acc.Offset(1))
	masters := make([]float32, len(shard))
	w0, w1 := make([]uint16, optN0), make([]float32, optN1)
	for i := range w0 {
		masters[i] = float32(0.01*float64(i)-1) + 1.0/1024
		w0[i] = f16Bits(masters[i])
	}
	for i := range w1 {
		masters[at1+i] = float32(i)*0.5 + 1.0/3
		w1[i] = 42 // not the master: creation must keep the caller's
	}
	weights := []Weight{WeightF16(w0), WeightF32(w1)}
	cfg := DefaultOptimizerConfig()
	cfg.Algorithm, cfg.LR, cfg.WeightDecay = SGD, 0.125, 0
	var e *Error
	if _, err := NewOptimizerWithMasters(acc, weights, masters[1:], &cfg, nil); !errors.As(err, &e) ||
		e.Status != StatusSizeMismatch || !strings.Contains(e.Message, "masters") {
		t.Fatalf("a short masters buffer: %v", err)
	}
	expected := append([]float32(nil), masters...)
	opt := must(NewOptimizerWithMasters(acc, weights, masters, &cfg, nil))
	defer opt.Close()
	const lr = float32(0.125)
	for step := 0; step < 3; step++ {
		addAndSync(t, acc, scaler, false)
		must(scaler.Update(acc))
		if stepped := must(opt.Step(acc, weights, nil)); !stepped {
			t.Fatalf("step %d skipped", step)
		}
		for i := range w0 {
			expected[i] = expected[i] + (-lr)*optGrad0(i)
			if masters[i] != expected[i] || w0[i] != f16Bits(expected[i]) {
				t.Fatalf("step %d: master %d = %v, expected %v", step, i, masters[i], expected[i])
			}
		}
		for i := range w1 {
			expected[at1+i] = expected[at1+i] + (-lr)*0.75
			if masters[at1+i] != expected[at1+i] || w1[i] != expected[at1+i] {
				t.Fatalf("step %d: w1[%d] = %v, master %v, expected %v", step, i, w1[i], masters[at1+i], expected[at1+i])
			}
		}
	}
	saved := must(opt.Save())
	for i := range masters {
		masters[i] = -3
	}
	forged := append([]byte(nil), saved...)
	forged[len(forged)/2] ^= 2
	if err := opt.Load(forged); !errors.As(err, &e) || e.Status != StatusCorruptState {
		t.Fatalf("a forged state: %v", err)
	}
	for i, m := range masters {
		if m != -3 {
			t.Fatalf("a refused Load wrote master %d = %v", i, m)
		}
	}
	if err := opt.Load(saved); err != nil {
		t.Fatal(err)
	}
	for i := range w0 {
		if masters[i] != expected[i] || masters[at1+i%optN1] != expected[at1+i%optN1] {
			t.Fatalf("loaded master %d = %v, expected %v", i, masters[i], expected[i])
		}
	}
}

// The smaller state formats through the config: bf16 remainder masters and bf16 moments step
// bf16 weights within one bf16 unit of the FP32 state's, save and load their state, and refuse
// remainder masters over f16 weights, naming the tensor.
func TestOptimizerSmallerState(t *testing.T) {
	if d := DefaultOptimizerConfig(); d.Masters != MastersFP32 || d.Moments != MomentsFP32 {
		t.Fatalf("default formats %v %v", d.Masters, d.Moments)
	}
	scaler := scalerWithScale(t, 1024)
	defer scaler.Close()
	run := func(masters Masters, moments Moments) ([]uint16, []byte) {
		acc := must(NewAccumulator([]TensorDesc{{optN0, BF16}}, nil, nil))
		defer acc.Close()
		w0 := make([]uint16, optN0)
		for i := range w0 {
			w0[i] = uint16(math.Float32bits(float32(0.01*float64(i)-1)) >> 16)
		}
		weights := []Weight{WeightBF16(w0)}
		cfg := DefaultOptimizerConfig()
		// A rate large enough that three steps move the bf16 weights by many units.
		cfg.LR, cfg.Masters, cfg.Moments, cfg.MomentSeed = 0.05, masters, moments, 7
		opt := must(NewOptimizer(acc, weights, &cfg, nil))
		defer opt.Close()
		for step := 0; step < 3; step++ {
			g0 := make([]uint16, optN0)
			for i := range g0 {
				g0[i] = uint16(math.Float32bits(optGrad0(i)*1024) >> 16) // exact in bf16
			}
			if err := acc.Add(scaler, []Grad{Words16(g0)}, 1); err != nil {
				t.Fatal(err)
			}
			must(acc.Sync(nil))
			if !must(opt.Step(acc, weights, nil)) {
				t.Fatalf("step %d skipped", step)
			}
		}
		saved := must(opt.Save())
		if err := opt.Load(saved); err != nil {
			t.Fatal(err)
		}
		return w0, saved
	}
	want, _ := run(MastersFP32, MomentsFP32)
	// 8-bit blockwise moments step, save and load through the config too.
	run(MastersFP32, MomentsInt8Blockwise)
	if moved := bf16Value(want[0]) - bf16Value(uint16(math.Float32bits(-1)>>16)); math.Abs(moved) < 0.1 {
		t.Fatalf("w0[0] moved by %g only", moved)
	}
	for _, f := range []struct {
		masters Masters
		moments Moments
	}{{MastersBF16Remainder, MomentsFP32}, {MastersFP32, MomentsBF16}, {MastersBF16Remainder, MomentsBF16}} {
		got, saved := run(f.masters, f.moments)
		// One bf16 unit of the weight, plus what bf16 moments may move each step's update
		// (lr times a few bf16 roundings of the moments' ratio).
		for i := range got {
			tol := math.Abs(bf16Value(want[i]))*0x1p-7 + 3*0.05*0x1p-6
			if d := math.Abs(bf16Value(got[i]) - bf16Value(want[i])); d > tol {
				t.Fatalf("%v %v: w0[%d] = %g, FP32 state %g", f.masters, f.moments, i, bf16Value(got[i]), bf16Value(want[i]))
			}
		}
		if len(saved) == 0 {
			t.Fatal("empty saved state")
		}
	}
	acc := must(NewAccumulator([]TensorDesc{{4, F16}}, nil, nil))
	defer acc.Close()
	cfg := DefaultOptimizerConfig()
	cfg.Masters = MastersBF16Remainder
	if _, err := NewOptimizer(acc, []Weight{WeightF16(make([]uint16, 4))}, &cfg, nil); !errorWith(err, StatusInvalidArgument, "`weights[0]` is f16") {
		t.Fatalf("remainders over f16 weights: %v", err)
	}
	// No masters: 16-bit weights rounded to nearest are refused naming `rounding`, and taken
	// rounded stochastically.
	cfg.Masters = MastersNone
	if _, err := NewOptimizer(acc, []Weight{WeightF16(make([]uint16, 4))}, &cfg, nil); !errorWith(err, StatusInvalidArgument, "`rounding`") {
		t.Fatalf("no masters rounded to nearest: %v", err)
	}
	cfg.Rounding = RoundStochastic
	opt := must(NewOptimizer(acc, []Weight{WeightF16(make([]uint16, 4))}, &cfg, nil))
	opt.Close()
}

// clipped is an AdamW optimizer over an f16 and an f32 tensor whose accumulator clips the norm
// to 0.5, with its unit scaler and its weights.
type clipped struct {
	scaler  *Scaler
	acc     *Accumulator
	opt     *Optimizer
	w0      []uint16
	weights []Weight
}

func newClipped(t *testing.T) *clipped {
	scaler := scalerWithScale(t, 1)
	cfg := DefaultAccumulatorConfig()
	cfg.MaxGradNorm = 0.5
	acc := must(NewAccumulator([]TensorDesc{{optN0, F16}, {optN1, F32}}, &cfg, nil))
	w0, w1 := make([]uint16, optN0), make([]float32, optN1)
	for i := range w0 {
		w0[i] = f16Bits(float32(0.01*float64(i) - 1))
	}
	weights := []Weight{WeightF16(w0), WeightF32(w1)}
	opt := must(NewOptimizer(acc, weights, nil, nil))
	return &clipped{scaler: scaler, acc: acc, opt: opt, w0: w0, weights: weights}
}

func (c *clipped) close() {
	c.opt.Close()
	c.acc.Close()
	c.scaler.Close()
}

// SyncForStep then Step against Sync then Step, with a norm that clips every window: the same
// weights and state bit for bit; in memory, SyncForStep's gradient is the sum before
// normalisation and clipping, which the step applies (one item per window: the normalisation
// divides by 1).
func TestSyncForStepIsSyncThenStepBitForBit(t *testing.T) {
	type run struct {
		w0    []uint16
		state []byte
		grad  []float32
		coef  float64
	}
	do := func(forStep bool) run {
		c := newClipped(t)
		defer c.close()
		scaler, acc, opt, w0, weights := c.scaler, c.acc, c.opt, c.w0, c.weights
		var r run
		for step := 0; step < 3; step++ {
			g0, g1 := make([]uint16, optN0), make([]float32, optN1)
			for i := range g0 {
				g0[i] = f16Bits(optGrad0(i) + float32(step)*0.125)
			}
			for i := range g1 {
				g1[i] = 0.75
			}
			if err := acc.Add(scaler, []Grad{Words16(g0), Float32s(g1)}, 1); err != nil {
				t.Fatal(err)
			}
			sync := acc.Sync
			if forStep {
				sync = acc.SyncForStep
			}
			info := must(sync(nil))
			if info.ClipCoef >= 1 {
				t.Fatalf("step %d: clip coefficient %g does not clip", step, info.ClipCoef)
			}
			if step == 0 {
				r.grad, r.coef = append([]float32(nil), must(acc.Master(1))...), info.ClipCoef
			}
			if !must(opt.Step(acc, weights, nil)) {
				t.Fatalf("step %d did not step", step)
			}
		}
		r.w0, r.state = w0, must(opt.Save())
		return r
	}
	plain, fused := do(false), do(true)
	if !bytes.Equal(u16Bytes(plain.w0), u16Bytes(fused.w0)) || !bytes.Equal(plain.state, fused.state) {
		t.Fatal("SyncForStep then Step differs from Sync then Step")
	}
	for i, g := range fused.grad {
		if plain.grad[i] != g*float32(fused.coef) || plain.grad[i] == g {
			t.Fatalf("grad[%d]: %g after Sync, %g before the coefficient %g", i, plain.grad[i], g, fused.coef)
		}
	}
}

func u16Bytes(w []uint16) []byte {
	b := make([]byte, 0, 2*len(w))
	for _, x := range w {
		b = append(b, byte(x), byte(x>>8))
	}
	return b
}

// AddFinal for each window's last micro-batch against Add, both before SyncForStep and Step with
// a norm that clips every window: the same report, weights and state bit for bit.
func TestAddFinalChangesNoBit(t *testing.T) {
	type run struct {
		w0    []uint16
		state []byte
		norms []float64
	}
	do := func(final bool) run {
		c := newClipped(t)
		defer c.close()
		scaler, acc, opt, w0, weights := c.scaler, c.acc, c.opt, c.w0, c.weights
		var r run
		for step := 0; step < 3; step++ {
			for mb := 0; mb < 2; mb++ {
				g0, g1 := make([]uint16, optN0), make([]float32, optN1)
				for i := range g0 {
					g0[i] = f16Bits(optGrad0(i) + float32(2*step+mb)*0.125)
				}
				for i := range g1 {
					g1[i] = 0.75 - float32(mb)*0.5
				}
				add := acc.Add
				if final && mb == 1 {
					add = acc.AddFinal
				}
				if err := add(scaler, []Grad{Words16(g0), Float32s(g1)}, 1); err != nil {
					t.Fatal(err)
				}
			}
			info := must(acc.SyncForStep(nil))
			if info.ClipCoef >= 1 {
				t.Fatalf("step %d: clip coefficient %g does not clip", step, info.ClipCoef)
			}
			r.norms = append(r.norms, info.GradNorm, info.ClipCoef)
			if !must(opt.Step(acc, weights, nil)) {
				t.Fatalf("step %d did not step", step)
			}
		}
		r.w0, r.state = w0, must(opt.Save())
		return r
	}
	plain, final := do(false), do(true)
	if !bytes.Equal(u16Bytes(plain.w0), u16Bytes(final.w0)) || !bytes.Equal(plain.state, final.state) {
		t.Fatal("AddFinal then SyncForStep and Step differs from Add")
	}
	for i := range plain.norms {
		if plain.norms[i] != final.norms[i] {
			t.Fatalf("report value %d: %v with Add, %v with AddFinal", i, plain.norms[i], final.norms[i])
		}
	}
}
