package gradacc

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"testing"
)

// The overflow policies on 2 ranks (goroutines on a local group): 4 bf16 tensors of 3, 3
// micro-batches per rank of 2 + m items (a mean-reduced loss), and one inf in rank 1's
// micro-batch 1, tensor 2; with TensorStats, each tensor's norm and non-finite micro-batches.
// docs/overflow.md states the contract.
const (
	ovRanks, ovTensors, ovN, ovMicrobatches = 2, 4, 3, 3
	ovBadRank, ovBadMicrobatch, ovBadTensor = 1, 1, 2
	ovScale                                 = 1024
)

func ovItems(m int) int { return 2 + m }

// ovGrad is the true gradient of rank r's micro-batch m, tensor t, element i: exact in bf16,
// also scaled.
func ovGrad(r, m, t, i int) float64 {
	g := (float64(r+1)*0.25 + float64(m+1)*0.125 + float64(t)*0.0625) / 8
	if i%2 == 1 {
		return -g
	}
	return g
}

type overflowResult struct {
	info    SyncInfo
	skipped bool
	scale   float32
	master  []float32
	stats   []TensorStats
	err     error
}

// runOverflow runs the 2 ranks under policy; with tensorStats, each also reads its TensorStats.
func runOverflow(t *testing.T, policy Overflow, tensorStats bool) [ovRanks]overflowResult {
	comms := must(NewLocalGroup(ovRanks))
	defer func() {
		for _, c := range comms {
			c.Close()
		}
	}()
	var res [ovRanks]overflowResult
	var wg sync.WaitGroup
	for r := 0; r < ovRanks; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			res[r].err = func() error {
				scaler := scalerWithScale(t, ovScale)
				defer scaler.Close()
				ac := DefaultAccumulatorConfig()
				ac.Overflow = policy
				ac.TensorStats = tensorStats
				tensors := make([]TensorDesc, ovTensors)
				for k := range tensors {
					tensors[k] = TensorDesc{ovN, BF16}
				}
				acc, err := NewAccumulator(tensors, &ac, nil)
				if err != nil {
					return err
				}
				defer acc.Close()
				for m := 0; m < ovMicrobatches; m++ {
					grads := make([]Grad, ovTensors)
					for k := range grads {
						words := make([]uint16, ovN)
						for i := range words {
							words[i] = bf16(float32(ovGrad(r, m, k, i) * ovScale))
						}
						if r == ovBadRank && m == ovBadMicrobatch && k == ovBadTensor {
							words[1] = 0x7f80 // +inf
						}
						grads[k] = Words16(words)
					}
					if err := acc.Add(scaler, grads, uint64(ovItems(m))); err != nil {
						return err
					}
				}
				if res[r].info, err = acc.Sync(comms[r]); err != nil {
					return err
				}
				for k := 0; k < ovTensors; k++ {
					g, err := acc.CopyMaster(k)
					if err != nil {
						return err
					}
					res[r].master = append(res[r].master, g...)
				}
				if tensorStats {
					if res[r].stats, err = acc.TensorStats(); err != nil {
						return err
					}
				}
				if res[r].skipped, err = scaler.Update(acc); err != nil {
					return err
				}
				res[r].scale, err = scaler.Scale()
				return err
			}()
		}(r)
	}
	wg.Wait()
	for r := range res {
		if res[r].err != nil {
			t.Fatalf("rank %d: %v", r, res[r].err)
		}
	}
	return res
}

func checkOverflowReport(t *testing.T, policy Overflow, res [ovRanks]overflowResult) {
	t.Helper()
	drop := policy == OverflowDropMicrobatch
	var dropped, microbatches, items uint64 = 0, 6, 18
	if drop {
		dropped, microbatches, items = 1, 5, 15
	}
	for r, got := range res {
		info := got.info
		if info.OverflowAt != OverflowAtGradient || info.OverflowRank != ovBadRank ||
			info.OverflowMicrobatch != ovBadMicrobatch || info.OverflowTensor != ovBadTensor {
			t.Errorf("policy %d, rank %d: overflow at %d (rank %d, micro-batch %d, tensor %d)", policy, r,
				info.OverflowAt, info.OverflowRank, info.OverflowMicrobatch, info.OverflowTensor)
		}
		if info.FoundInf == drop || got.skipped == drop {
			t.Errorf("policy %d, rank %d: found_inf %v, skipped %v", policy, r, info.FoundInf, got.skipped)
		}
		if info.DroppedMicrobatches != dropped || info.Microbatches != microbatches || info.TotalCount != items {
			t.Errorf("policy %d, rank %d: %d dropped, %d micro-batches, %d items", policy, r,
				info.DroppedMicrobatches, info.Microbatches, info.TotalCount)
		}
		if got.scale != ovScale/2 {
			t.Errorf("policy %d, rank %d: scale %g after the update, want %g", policy, r, got.scale, ovScale/2.0)
		}
	}
}

func TestDropMicrobatchKeepsTheRestAndNamesThePlace(t *testing.T) {
	res := runOverflow(t, OverflowDropMicrobatch, false)
	checkOverflowReport(t, OverflowDropMicrobatch, res)
	for k := 0; k < ovTensors; k++ {
		for i := 0; i < ovN; i++ {
			sum := 0.0
			for r := 0; r < ovRanks; r++ {
				for m := 0; m < ovMicrobatches; m++ {
					if r != ovBadRank || m != ovBadMicrobatch {
						sum += ovGrad(r, m, k, i) * float64(ovItems(m))
					}
				}
			}
			want := sum / 15 // the mean over the 15 kept items
			for r := range res {
				if got := float64(res[r].master[k*ovN+i]); math.Abs(got-want) > 1e-6*math.Abs(want) {
					t.Errorf("rank %d, tensor %d element %d: %.9g, want %.9g", r, k, i, got, want)
				}
			}
		}
	}
}

func TestSkipStepNamesTheSamePlace(t *testing.T) {
	if DefaultAccumulatorConfig().Overflow != OverflowSkipStep {
		t.Errorf("the default policy is %d", DefaultAccumulatorConfig().Overflow)
	}
	checkOverflowReport(t, OverflowSkipStep, runOverflow(t, OverflowSkipStep, false))
}

func TestCleanWindowReportsNoPlace(t *testing.T) {
	scaler := scalerWithScale(t, 1)
	defer scaler.Close()
	ac := DefaultAccumulatorConfig()
	ac.Overflow = OverflowDropMicrobatch
	acc := must(NewAccumulator([]TensorDesc{{2, F32}}, &ac, nil))
	defer acc.Close()
	if err := acc.Add(scaler, []Grad{Float32s([]float32{1, 2})}, 1); err != nil {
		t.Fatal(err)
	}
	info := must(acc.Sync(nil))
	if info.OverflowAt != OverflowAtNone || info.DroppedMicrobatches != 0 || info.FoundInf {
		t.Errorf("clean window: %+v", info)
	}
}

func TestBadOverflowPoliciesAreRefused(t *testing.T) {
	ac := DefaultAccumulatorConfig()
	ac.Overflow = 7
	acc, err := NewAccumulator([]TensorDesc{{4, F32}}, &ac, nil)
	var e *Error
	if acc != nil || !errors.As(err, &e) || e.Status != StatusInvalidArgument ||
		!strings.Contains(e.Message, "`config`.overflow = 7") {
		t.Errorf("overflow 7: %v", err)
	}
	comms := must(NewLocalGroup(1))
	defer comms[0].Close()
	ac = DefaultAccumulatorConfig()
	ac.Overflow = OverflowDropMicrobatch
	ac.Sharding = ShardingAccumulate
	acc, err = NewShardedAccumulator([]TensorDesc{{4, F32}}, &ac, comms[0], nil)
	if err != nil {
		t.Fatalf("DropMicrobatch with sharded accumulation: %v", err)
	}
	acc.Close()
}

func TestTensorStatsCountThePoisonedTensorOnEveryRank(t *testing.T) {
	for _, policy := range []Overflow{OverflowDropMicrobatch, OverflowSkipStep} {
		res := runOverflow(t, policy, true)
		checkOverflowReport(t, policy, res)
		for r, got := range res {
			if len(got.stats) != ovTensors {
				t.Fatalf("policy %d, rank %d: %d tensor stats", policy, r, len(got.stats))
			}
			for k, s := range got.stats {
				want := uint64(0)
				if k == ovBadTensor {
					want = 1
				}
				if s.NonfiniteMicrobatches != want {
					t.Errorf("policy %d, rank %d: tensor %d non-finite in %d micro-batches", policy, r, k,
						s.NonfiniteMicrobatches)
				}
				// The same bits on every rank (an infinite norm included).
				first := res[0].stats[k]
				if math.Float64bits(s.GradNorm) != math.Float64bits(first.GradNorm) ||
					s.NonfiniteMicrobatches != first.NonfiniteMicrobatches {
					t.Errorf("policy %d, rank %d: tensor %d's stats %+v, rank 0's %+v", policy, r, k, s, first)
				}
			}
		}
		stats := res[0].stats
		if policy == OverflowSkipStep { // the skipped window's sum holds the inf
			if !math.IsInf(stats[ovBadTensor].GradNorm, 1) {
				t.Errorf("skip step: tensor %d's norm %g", ovBadTensor, stats[ovBadTensor].GradNorm)
			}
			continue
		}
		for k, s := range stats { // no clipping: each norm is its master's
			sq := 0.0
			for _, v := range res[0].master[k*ovN : (k+1)*ovN] {
				sq += float64(v) * float64(v)
			}
			if want := math.Sqrt(sq); math.Abs(s.GradNorm-want) > 1e-12*want {
				t.Errorf("tensor %d's norm %.17g, want %.17g", k, s.GradNorm, want)
			}
		}
	}
}

func TestTensorStatsRefusals(t *testing.T) {
	wantStatus := func(what string, err error, status Status) {
		t.Helper()
		var e *Error
		if !errors.As(err, &e) || e.Status != status {
			t.Errorf("%s: %v, want status %d", what, err, status)
		}
	}
	if DefaultAccumulatorConfig().TensorStats {
		t.Errorf("tensor stats are on by default")
	}
	scaler := scalerWithScale(t, 1)
	defer scaler.Close()
	for _, on := range []bool{false, true} {
		ac := DefaultAccumulatorConfig()
		ac.TensorStats = on
		acc := must(NewAccumulator([]TensorDesc{{2, F32}}, &ac, nil))
		stats, err := acc.TensorStats()
		wantStatus("before the sync", err, StatusWrongState)
		if stats != nil {
			t.Errorf("a refused call returned %v", stats)
		}
		add := func() {
			if err := acc.Add(scaler, []Grad{Float32s([]float32{3, 4})}, 1); err != nil {
				t.Fatal(err)
			}
		}
		add()
		must(acc.Sync(nil))
		if on {
			stats = must(acc.TensorStats())
			if len(stats) != 1 || stats[0] != (TensorStats{GradNorm: 5, NonfiniteMicrobatches: 0}) {
				t.Errorf("one process, [3 4]: %+v", stats)
			}
			add() // the next window began
		}
		_, err = acc.TensorStats()
		wantStatus(fmt.Sprintf("tensor stats %v, after the sync", on), err, StatusWrongState)
		acc.Close()
		_, err = acc.TensorStats()
		wantStatus("closed", err, StatusInvalidHandle)
	}
	comms := must(NewLocalGroup(1))
	defer comms[0].Close()
	ac := DefaultAccumulatorConfig()
	ac.TensorStats = true
	ac.Sharding = ShardingAccumulate
	acc, err := NewShardedAccumulator([]TensorDesc{{4, F32}}, &ac, comms[0], nil)
	if err != nil {
		t.Fatalf("tensor stats with sharded accumulation: %v", err)
	}
	acc.Close()
}
