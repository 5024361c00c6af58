package gradacc

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"
)

// 18003 elements at 0, 7040, 12096 and 18112 (each tensor at a multiple of MasterAlign bytes): a
// flat master of 18176, 2 shards of 12288 and 5888, 3 of 8192, 8192 and 1792 (blocks of 4096).
var shardTensors = []TensorDesc{{7000, F16}, {5000, F32}, {6000, BF16}, {3, F32}}

var shardOffsets = []int{0, 7040, 12096, 18112}

const shardTotal = 18176

// flatMaster is a copy of acc's flat master over shardTensors: each tensor's master at its
// Offset, zeros in the padding.
func flatMaster(acc *Accumulator) ([]float32, error) {
	flat := make([]float32, shardTotal)
	for i := range shardTensors {
		m, err := acc.CopyMaster(i)
		if err != nil {
			return nil, err
		}
		at, err := acc.Offset(i)
		if err != nil {
			return nil, err
		}
		copy(flat[at:], m)
	}
	return flat, nil
}

func TestEachTensorStartsAtAnAlignedOffset(t *testing.T) {
	if MasterAlign != 256 {
		t.Fatalf("MasterAlign %d", MasterAlign)
	}
	if n, err := MasterNumel(shardTensors); err != nil || n != shardTotal {
		t.Fatalf("MasterNumel: %d, %v", n, err)
	}
	acc := must(NewAccumulator(shardTensors, nil, nil))
	defer acc.Close()
	for i, want := range shardOffsets {
		if at, err := acc.Offset(i); err != nil || at != want {
			t.Fatalf("Offset(%d): %d, %v; want %d", i, at, err, want)
		}
	}
	if _, err := acc.Offset(len(shardTensors)); !errors.Is(err, &Error{Status: StatusInvalidArgument}) {
		t.Fatalf("Offset past the end: %v", err)
	}
}

// f16Trunc is x as fp16 bits by truncation; magnitudes below 2^-14 flush to zero, so every
// word is finite for the |x| < 2^15 drawn here.
func f16Trunc(x float32) uint16 {
	bits := math.Float32bits(x)
	sign := uint16(bits>>16) & 0x8000
	e := int(bits>>23&0xff) - 127 + 15
	if e <= 0 {
		return sign
	}
	return sign | uint16(min(e, 29))<<10 | uint16(bits>>13&0x3ff)
}

// randomGrads is one micro-batch of loss-scaled random gradients in each tensor's dtype.
func randomGrads(rng *rand.Rand) []Grad {
	grads := make([]Grad, len(shardTensors))
	for i, t := range shardTensors {
		g := make([]float32, t.Numel)
		for j := range g {
			g[j] = float32(rng.NormFloat64() * 64)
		}
		switch t.DType {
		case F32:
			grads[i] = Float32s(g)
		case F16:
			w := make([]uint16, len(g))
			for j, x := range g {
				w[j] = f16Trunc(x)
			}
			grads[i] = Words16(w)
		default:
			w := make([]uint16, len(g))
			for j, x := range g {
				w[j] = bf16(x)
			}
			grads[i] = Words16(w)
		}
	}
	return grads
}

// onRanks runs body(r) for every rank of a world, each in its own goroutine locked to its own
// OS thread, and fails the test if a rank has not returned within a minute.
func onRanks(t *testing.T, world int, body func(r int)) {
	t.Helper()
	var wg sync.WaitGroup
	for r := 0; r < world; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			body(r)
		}(r)
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("a rank hangs")
	}
}

func closeAll(comms []*Comm) {
	for _, c := range comms {
		c.Close()
	}
}

func microbatchCount(r, m int) uint64 { return 1 + uint64((3*r+m)%5) }

type shardResult struct {
	err                   error
	sharded, plain        SyncInfo
	offset                int
	shard, flat           []float32
	addressIsFlatAtOffset bool
}

// Every rank adds the same random micro-batches to a sharded and an unsharded accumulator and
// syncs each on its own group: the shard must be the unsharded master's range, bit for bit.
func TestShardedSyncMatchesTheUnshardedMaster(t *testing.T) {
	for _, world := range []int{2, 3} {
		for _, maxNorm := range []float32{0, 0.25} {
			t.Run(fmt.Sprintf("world%d/maxnorm%g", world, maxNorm), func(t *testing.T) {
				checkShardedSync(t, world, maxNorm)
			})
		}
	}
}

func checkShardedSync(t *testing.T, world int, maxNorm float32) {
	shardedComms, plainComms := must(NewLocalGroup(world)), must(NewLocalGroup(world))
	defer closeAll(shardedComms)
	defer closeAll(plainComms)
	res := make([]shardResult, world)
	onRanks(t, world, func(r int) {
		res[r].err = func() error {
			scaler := scalerWithScale(t, 1024)
			defer scaler.Close()
			pc := DefaultAccumulatorConfig()
			pc.MaxGradNorm = maxNorm
			sc := pc
			sc.Sharding, sc.ShardCount, sc.ShardRank = ShardingReduceScatter, uint32(world), uint32(r)
			sharded, err := NewAccumulator(shardTensors, &sc, nil)
			if err != nil {
				return err
			}
			defer sharded.Close()
			plain, err := NewAccumulator(shardTensors, &pc, nil)
			if err != nil {
				return err
			}
			defer plain.Close()
			rng := rand.New(rand.NewSource(int64(100*world + r)))
			for m := 0; m < 3; m++ {
				g := randomGrads(rng)
				if err := sharded.Add(scaler, g, microbatchCount(r, m)); err != nil {
					return err
				}
				if err := plain.Add(scaler, g, microbatchCount(r, m)); err != nil {
					return err
				}
			}
			if res[r].sharded, err = sharded.Sync(shardedComms[r]); err != nil {
				return err
			}
			if res[r].plain, err = plain.Sync(plainComms[r]); err != nil {
				return err
			}
			offset, view, err := sharded.Shard()
			if err != nil {
				return err
			}
			m0, err := sharded.Master(0)
			if err != nil {
				return err
			}
			res[r].offset, res[r].shard = offset, append([]float32(nil), view...)
			res[r].addressIsFlatAtOffset = len(view) > 0 &&
				unsafe.Pointer(&view[0]) == unsafe.Add(unsafe.Pointer(&m0[0]), 4*offset)
			if res[r].flat, err = flatMaster(plain); err != nil {
				return err
			}
			runtime.KeepAlive(sharded)
			return nil
		}()
	})

	var count uint64
	for r := 0; r < world; r++ {
		for m := 0; m < 3; m++ {
			count += microbatchCount(r, m)
		}
	}
	next := 0 // the shards tile the layout in rank order
	for r, x := range res {
		if x.err != nil {
			t.Fatalf("rank %d: %v", r, x.err)
		}
		if x.offset != next || len(x.shard) == 0 || len(x.shard) >= shardTotal {
			t.Fatalf("rank %d: shard %d..%d, the previous ended at %d", r, x.offset, x.offset+len(x.shard), next)
		}
		next = x.offset + len(x.shard)
		if !x.addressIsFlatAtOffset {
			t.Errorf("rank %d: the shard's address is not the flat master's at offset %d", r, x.offset)
		}
		if x.sharded != x.plain || x.sharded != res[0].sharded {
			t.Errorf("rank %d: sharded %+v, unsharded %+v, rank 0 %+v", r, x.sharded, x.plain, res[0].sharded)
		}
		if x.sharded.TotalCount != count || x.sharded.Microbatches != uint64(3*world) || x.sharded.FoundInf {
			t.Errorf("rank %d: %+v", r, x.sharded)
		}
		if (x.sharded.ClipCoef < 1) != (maxNorm > 0) {
			t.Errorf("rank %d: clip_coef %v with max_grad_norm %v", r, x.sharded.ClipCoef, maxNorm)
		}
		if len(x.flat) != shardTotal {
			t.Fatalf("rank %d: %d elements in the unsharded masters", r, len(x.flat))
		}
		nonzero := false
		for i, v := range x.shard {
			if math.Float32bits(v) != math.Float32bits(x.flat[x.offset+i]) {
				t.Fatalf("rank %d: element %d of the shard (%d of the layout) is %v, unsharded %v",
					r, i, x.offset+i, v, x.flat[x.offset+i])
			}
			nonzero = nonzero || v != 0
		}
		if !nonzero {
			t.Errorf("rank %d: an all-zero shard", r)
		}
		for i := range x.flat {
			if math.Float32bits(x.flat[i]) != math.Float32bits(res[0].flat[i]) {
				t.Fatalf("rank %d: the unsharded masters differ from rank 0's at %d", r, i)
			}
		}
	}
	if next != shardTotal {
		t.Fatalf("the shards end at %d of %d", next, shardTotal)
	}
}

func TestUnshardedShardIsTheWholeMaster(t *testing.T) {
	scaler := scalerWithScale(t, 1024)
	defer scaler.Close()
	acc := must(NewAccumulator(shardTensors, nil, nil))
	defer acc.Close()
	if err := acc.Add(scaler, randomGrads(rand.New(rand.NewSource(7))), 4); err != nil {
		t.Fatal(err)
	}
	must(acc.Sync(nil))
	offset, shard, err := acc.Shard()
	if err != nil {
		t.Fatal(err)
	}
	if offset != 0 || len(shard) != shardTotal {
		t.Fatalf("shard %d..%d, want 0..%d", offset, offset+len(shard), shardTotal)
	}
	for i, at := range shardOffsets {
		m := must(acc.Master(i))
		if &m[0] != &shard[at] {
			t.Fatalf("tensor %d is not at element %d of the shard", i, at)
		}
		end := shardTotal
		if i+1 < len(shardOffsets) {
			end = shardOffsets[i+1]
		}
		for k := at + len(m); k < end; k++ {
			if math.Float32bits(shard[k]) != 0 {
				t.Fatalf("padding element %d is %v", k, shard[k])
			}
		}
	}
	if off, c, err := acc.CopyShard(); err != nil || off != 0 || len(c) != shardTotal || c[5] != shard[5] {
		t.Fatalf("CopyShard: %d, %d elements, %v", off, len(c), err)
	}
	runtime.KeepAlive(acc)
	acc.Close()
	if _, _, err := acc.Shard(); !errors.Is(err, &Error{Status: StatusInvalidHandle}) {
		t.Fatalf("closed: %v", err)
	}
}

func TestDefaultConfigIsUnshardedWithF32Wire(t *testing.T) {
	c := DefaultAccumulatorConfig()
	if c.Sharding != ShardingNone || c.ShardCount != 1 || c.ShardRank != 0 || c.WireDType != F32 {
		t.Fatalf("%+v", c)
	}
	c.Sharding, c.ShardCount, c.ShardRank = ShardingReduceScatter, 3, 2
	acc := must(NewAccumulator(shardTensors, &c, nil))
	defer acc.Close()
	if offset, shard, err := acc.Shard(); err != nil || offset != 16384 || len(shard) != shardTotal-16384 {
		t.Fatalf("rank 2 of 3: %d, %d elements, %v", offset, len(shard), err)
	}
}

// refused checks that creating an accumulator with c fails with StatusInvalidArgument and a
// message naming word.
func refused(t *testing.T, what string, c AccumulatorConfig, word string) {
	t.Helper()
	acc, err := NewAccumulator(shardTensors, &c, nil)
	var e *Error
	if !errors.As(err, &e) || e.Status != StatusInvalidArgument || !strings.Contains(e.Message, word) {
		if acc != nil {
			acc.Close()
		}
		t.Errorf("%s: got %v, want INVALID_ARGUMENT naming %s", what, err, word)
	}
}

func TestBadShardingConfigsAreRefused(t *testing.T) {
	for _, cr := range [][2]uint32{{2, 2}, {3, 7}, {0, 0}} {
		c := DefaultAccumulatorConfig()
		c.Sharding, c.ShardCount, c.ShardRank = ShardingReduceScatter, cr[0], cr[1]
		refused(t, fmt.Sprintf("rank %d of %d", cr[1], cr[0]), c, "shard_rank")
	}
	c := DefaultAccumulatorConfig()
	c.ShardCount, c.ShardRank = 2, 1
	refused(t, "no policy", c, "sharding")
	c = DefaultAccumulatorConfig()
	c.Sharding = 7
	refused(t, "policy 7", c, "sharding")
	c = DefaultAccumulatorConfig()
	c.WireDType = F16
	refused(t, "f16 wire", c, "wire_dtype")
}

// shardedSyncErrors has each rank of a local group of world sync an accumulator holding shard
// shardRank[r] of shardCount, and returns each rank's error.
func shardedSyncErrors(t *testing.T, world int, shardCount uint32, shardRank []uint32) []error {
	comms := must(NewLocalGroup(world))
	defer closeAll(comms)
	for _, c := range comms {
		if err := c.SetTimeout(30 * time.Second); err != nil { // a rank left waiting fails, not hangs
			t.Fatal(err)
		}
	}
	errs := make([]error, world)
	onRanks(t, world, func(r int) {
		c := DefaultAccumulatorConfig()
		c.Sharding, c.ShardCount, c.ShardRank = ShardingReduceScatter, shardCount, shardRank[r]
		acc, err := NewAccumulator([]TensorDesc{{2, F32}}, &c, nil)
		if err != nil {
			errs[r] = fmt.Errorf("create: %w", err)
			return
		}
		defer acc.Close()
		oneMicrobatch(t, acc)
		_, errs[r] = acc.Sync(comms[r])
	})
	return errs
}

func TestShardedSyncOnTheWrongGroupFailsEveryRank(t *testing.T) {
	for r, err := range shardedSyncErrors(t, 2, 3, []uint32{0, 1}) {
		var e *Error
		if !errors.As(err, &e) || e.Status != StatusInvalidArgument ||
			!strings.Contains(e.Message, "of 3") || !strings.Contains(e.Message, "of 2") {
			t.Errorf("3 shards on 2 ranks, rank %d: %v", r, err)
		}
	}
	errs := shardedSyncErrors(t, 2, 2, []uint32{0, 0}) // rank 1 claims shard 0 too
	var e *Error
	if !errors.As(errs[1], &e) || e.Status != StatusInvalidArgument || !strings.Contains(e.Message, "shard 0 of 2") {
		t.Errorf("rank 1: %v", errs[1])
	}
	if !errors.Is(errs[0], &Error{Status: StatusPeerFailure}) {
		t.Errorf("rank 0, whose shard is right: %v", errs[0])
	}

	c := DefaultAccumulatorConfig()
	c.Sharding, c.ShardCount = ShardingReduceScatter, 2
	acc := must(NewAccumulator([]TensorDesc{{2, F32}}, &c, nil))
	defer acc.Close()
	oneMicrobatch(t, acc)
	if _, err := acc.Sync(nil); !errors.Is(err, &Error{Status: StatusInvalidArgument}) {
		t.Fatalf("a sharded sync with no communicator: %v", err)
	}
}

// ---- the hybrid boundary (HSDP) --------------------------------------------------------------

// hybridGrid is the communicators of a 2x2 grid: rank a*2 + i is rank i of shard group a and
// rank a of replica group i. Crosswise, shard group 1 joins the replica groups the other way
// round, so each replica group holds shards 0 and 1.
type hybridGrid struct {
	shard, replica [2][]*Comm // shard[a][i], replica[i][a]
	crosswise      bool
}

const hybridS, hybridR = 2, 2

func newHybridGrid(t *testing.T, crosswise bool, timeout time.Duration) *hybridGrid {
	g := &hybridGrid{crosswise: crosswise}
	for k := 0; k < 2; k++ {
		g.shard[k] = must(NewLocalGroup(hybridS))
		g.replica[k] = must(NewLocalGroup(hybridR))
		for _, c := range append(append([]*Comm(nil), g.shard[k]...), g.replica[k]...) {
			if err := c.SetTimeout(timeout); err != nil { // a rank left waiting fails, not hangs
				t.Fatal(err)
			}
		}
	}
	return g
}

func (g *hybridGrid) of(rank int) (shard, replicas *Comm) {
	a, i := rank/hybridS, rank%hybridS
	j := i
	if g.crosswise && a == 1 {
		j = hybridS - 1 - i
	}
	return g.shard[a][i], g.replica[j][a]
}

func (g *hybridGrid) Close() {
	for k := 0; k < 2; k++ {
		closeAll(g.shard[k])
		closeAll(g.replica[k])
	}
}

type hybridResult struct {
	err               error
	hybrid, ddp       SyncInfo
	offset            int
	shard, ddpMasters []float32
}

// Every rank of a 2x2 grid adds the same random micro-batches to a sharded accumulator synced
// with SyncHybrid and to an unsharded one synced over all 4 ranks (DDP): shard group 0's shards
// tile the gradient and match the DDP master within the rounding of another summation order,
// replicas hold the same bits, and every rank reports the same info.
func TestSyncHybridOnA2x2GridMatchesDDP(t *testing.T) {
	for _, maxNorm := range []float32{0, 0.25} {
		t.Run(fmt.Sprintf("maxnorm%g", maxNorm), func(t *testing.T) {
			const world = hybridS * hybridR
			grid := newHybridGrid(t, false, time.Minute)
			defer grid.Close()
			ddpComms := must(NewLocalGroup(world))
			defer closeAll(ddpComms)
			res := make([]hybridResult, world)
			onRanks(t, world, func(r int) {
				res[r].err = func() error {
					scaler := scalerWithScale(t, 1024)
					defer scaler.Close()
					dc := DefaultAccumulatorConfig()
					dc.MaxGradNorm = maxNorm
					hc := dc
					hc.Sharding, hc.ShardCount, hc.ShardRank = ShardingReduceScatter, hybridS, uint32(r%hybridS)
					hybrid, err := NewAccumulator(shardTensors, &hc, nil)
					if err != nil {
						return err
					}
					defer hybrid.Close()
					ddp, err := NewAccumulator(shardTensors, &dc, nil)
					if err != nil {
						return err
					}
					defer ddp.Close()
					rng := rand.New(rand.NewSource(int64(500 + r)))
					for m := 0; m < 3; m++ {
						g := randomGrads(rng)
						if err := hybrid.Add(scaler, g, microbatchCount(r, m)); err != nil {
							return err
						}
						if err := ddp.Add(scaler, g, microbatchCount(r, m)); err != nil {
							return err
						}
					}
					if res[r].hybrid, err = hybrid.SyncHybrid(grid.of(r)); err != nil {
						return err
					}
					if res[r].ddp, err = ddp.Sync(ddpComms[r]); err != nil {
						return err
					}
					if res[r].offset, res[r].shard, err = hybrid.CopyShard(); err != nil {
						return err
					}
					res[r].ddpMasters, err = flatMaster(ddp)
					return err
				}()
			})

			var count uint64
			for r := 0; r < world; r++ {
				for m := 0; m < 3; m++ {
					count += microbatchCount(r, m)
				}
			}
			for r, x := range res {
				if x.err != nil {
					t.Fatalf("rank %d: %v", r, x.err)
				}
			}
			ddp := res[0].ddpMasters
			largest := 0.0
			for _, v := range ddp {
				largest = math.Max(largest, math.Abs(float64(v)))
			}
			next := 0
			for r, x := range res {
				h, d := x.hybrid, x.ddp
				if h != res[0].hybrid {
					t.Errorf("rank %d: %+v, rank 0 %+v", r, h, res[0].hybrid)
				}
				if h.TotalCount != count || d.TotalCount != count || h.Microbatches != 3*world || h.FoundInf {
					t.Errorf("rank %d: %+v (DDP %+v)", r, h, d)
				}
				if math.Abs(h.GradNorm-d.GradNorm) > 1e-5*d.GradNorm || math.Abs(h.ClipCoef-d.ClipCoef) > 1e-5*d.ClipCoef {
					t.Errorf("rank %d: norm %v clip %v, DDP norm %v clip %v", r, h.GradNorm, h.ClipCoef, d.GradNorm, d.ClipCoef)
				}
				if (h.ClipCoef < 1) != (maxNorm > 0) {
					t.Errorf("rank %d: clip_coef %v with max_grad_norm %v", r, h.ClipCoef, maxNorm)
				}
				if r >= hybridS { // a replica: the bits of shard group 0's rank holding its shard
					twin := res[r%hybridS]
					if x.offset != twin.offset || len(x.shard) != len(twin.shard) {
						t.Fatalf("rank %d: shard %d+%d, its replica's %d+%d", r, x.offset, len(x.shard), twin.offset, len(twin.shard))
					}
					for i := range x.shard {
						if math.Float32bits(x.shard[i]) != math.Float32bits(twin.shard[i]) {
							t.Fatalf("rank %d: element %d differs from its replica, rank %d", r, x.offset+i, r%hybridS)
						}
					}
					continue
				}
				if x.offset != next || len(x.shard) == 0 {
					t.Fatalf("rank %d: shard %d..%d, the previous ended at %d", r, x.offset, x.offset+len(x.shard), next)
				}
				next = x.offset + len(x.shard)
				for i, v := range x.shard {
					if math.Abs(float64(v)-float64(ddp[x.offset+i])) > 1e-5*largest {
						t.Fatalf("rank %d: element %d is %v, DDP %v", r, x.offset+i, v, ddp[x.offset+i])
					}
				}
			}
			if next != shardTotal {
				t.Fatalf("the shards end at %d of %d", next, shardTotal)
			}
		})
	}
}

// hybridErrors has every rank of a 2x2 grid add one micro-batch to a sharded accumulator and call
// SyncHybrid on grid (with rank nilRank's replica communicator nil, if in range); it returns
// each rank's error and the info of a SyncHybrid on fresh, right groups afterwards.
func hybridErrors(t *testing.T, grid *hybridGrid, nilRank int) ([]error, []SyncInfo) {
	right := newHybridGrid(t, false, time.Minute)
	defer right.Close()
	errs := make([]error, hybridS*hybridR)
	after := make([]SyncInfo, hybridS*hybridR)
	onRanks(t, hybridS*hybridR, func(r int) {
		c := DefaultAccumulatorConfig()
		c.Sharding, c.ShardCount, c.ShardRank = ShardingReduceScatter, hybridS, uint32(r%hybridS)
		acc, err := NewAccumulator([]TensorDesc{{2, F32}}, &c, nil)
		if err != nil {
			errs[r] = fmt.Errorf("create: %w", err)
			return
		}
		defer acc.Close()
		oneMicrobatch(t, acc)
		shard, replicas := grid.of(r)
		if r == nilRank {
			replicas = nil
		}
		_, errs[r] = acc.SyncHybrid(shard, replicas)
		var err2 error
		if after[r], err2 = acc.SyncHybrid(right.of(r)); err2 != nil {
			after[r] = SyncInfo{}
		}
	})
	return errs, after
}

// Replica groups that pair different shards fail with StatusSizeMismatch on every rank, and the
// windows stay intact.
func TestSyncHybridWithCrosswiseReplicasFailsEveryRank(t *testing.T) {
	grid := newHybridGrid(t, true, 30*time.Second)
	defer grid.Close()
	errs, after := hybridErrors(t, grid, -1)
	for r, err := range errs {
		var e *Error
		if !errors.As(err, &e) || e.Status != StatusSizeMismatch || !strings.Contains(e.Message, "replica groups") {
			t.Errorf("rank %d: %v, want SIZE_MISMATCH naming the replica groups", r, err)
		}
		if after[r].Microbatches != hybridS*hybridR {
			t.Errorf("rank %d: the window was not intact: %+v afterwards", r, after[r])
		}
	}
}

// A nil replica Comm still reaches the C call: that rank fails naming the argument, and the
// others fail too (within their timeouts) instead of waiting for it.
func TestSyncHybridWithANilCommFailsEveryRank(t *testing.T) {
	grid := newHybridGrid(t, false, 2*time.Second)
	defer grid.Close()
	errs, after := hybridErrors(t, grid, 1)
	for r, err := range errs {
		var e *Error
		switch {
		case r == 1 && (!errors.As(err, &e) || e.Status != StatusNullArgument || !strings.Contains(e.Message, "`replica_comm`")):
			t.Errorf("rank 1, with a nil replica Comm: %v", err)
		case r != 1 && err == nil:
			t.Errorf("rank %d synced beside a rank with a nil Comm", r)
		}
		if after[r].Microbatches != hybridS*hybridR {
			t.Errorf("rank %d: the window was not intact: %+v afterwards", r, after[r])
		}
	}
}

// ---- sharded accumulation (ZeRO-2) -----------------------------------------------------------

// accumulateConfig is rank r of world's sharded accumulation, with buckets small enough that
// every micro-batch is reduced in several pieces.
func accumulateConfig(world, r int, maxNorm float32) AccumulatorConfig {
	c := DefaultAccumulatorConfig()
	c.Sharding, c.ShardCount, c.ShardRank = ShardingAccumulate, uint32(world), uint32(r)
	c.MaxGradNorm, c.BucketNumel = maxNorm, 4096
	return c
}

// setTimeouts makes a rank left waiting fail instead of hanging the test.
func setTimeouts(t *testing.T, d time.Duration, groups ...[]*Comm) {
	for _, g := range groups {
		for _, c := range g {
			if err := c.SetTimeout(d); err != nil {
				t.Fatal(err)
			}
		}
	}
}

type accumulateResult struct {
	err                   error
	byAdd, byTensor, ddp  SyncInfo
	offset                int
	shard, tensorShard    []float32
	ddpMasters            []float32
	readable, viewOfShard []bool // Master(i) succeeds; and is the shard's memory
}

// Every rank adds the same random micro-batches to two sharded accumulations, one through Add
// and one tensor by tensor in backward order through AddTensor, and to an unsharded one synced
// over the whole group (DDP). The two ways give the same bits, and the shards tile the gradient
// and match DDP's within the rounding of another summation order.
func TestShardedAccumulationMatchesDDP(t *testing.T) {
	for _, world := range []int{2, 3} {
		for _, maxNorm := range []float32{0, 0.25} {
			t.Run(fmt.Sprintf("world%d/maxnorm%g", world, maxNorm), func(t *testing.T) {
				checkShardedAccumulation(t, world, maxNorm)
			})
		}
	}
}

func checkShardedAccumulation(t *testing.T, world int, maxNorm float32) {
	addComms, tensorComms, ddpComms := must(NewLocalGroup(world)), must(NewLocalGroup(world)), must(NewLocalGroup(world))
	defer closeAll(addComms)
	defer closeAll(tensorComms)
	defer closeAll(ddpComms)
	setTimeouts(t, time.Minute, addComms, tensorComms)
	res := make([]accumulateResult, world)
	onRanks(t, world, func(r int) {
		x := &res[r]
		x.err = func() error {
			scaler := scalerWithScale(t, 1024)
			defer scaler.Close()
			c := accumulateConfig(world, r, maxNorm)
			byAdd, err := NewShardedAccumulator(shardTensors, &c, addComms[r], nil)
			if err != nil {
				return err
			}
			defer byAdd.Close()
			byTensor, err := NewShardedAccumulator(shardTensors, &c, tensorComms[r], nil)
			if err != nil {
				return err
			}
			defer byTensor.Close()
			dc := DefaultAccumulatorConfig()
			dc.MaxGradNorm = maxNorm
			ddp, err := NewAccumulator(shardTensors, &dc, nil)
			if err != nil {
				return err
			}
			defer ddp.Close()
			rng := rand.New(rand.NewSource(int64(900 + 10*world + r)))
			for m := 0; m < 3; m++ {
				g, count := randomGrads(rng), microbatchCount(r, m)
				if err := byAdd.Add(scaler, g, count); err != nil {
					return err
				}
				if err := byTensor.BeginMicrobatch(count); err != nil {
					return err
				}
				for i := len(g) - 1; i >= 0; i-- { // as a backward pass produces them
					if err := byTensor.AddTensor(scaler, i, g[i]); err != nil {
						return err
					}
				}
				if err := byTensor.EndMicrobatch(); err != nil {
					return err
				}
				if err := ddp.Add(scaler, g, count); err != nil {
					return err
				}
			}
			if x.byAdd, err = byAdd.Sync(nil); err != nil { // nil: its own communicator
				return err
			}
			if x.byTensor, err = byTensor.Sync(tensorComms[r]); err != nil { // or the same one
				return err
			}
			if x.ddp, err = ddp.Sync(ddpComms[r]); err != nil {
				return err
			}
			offset, view, err := byAdd.Shard()
			if err != nil {
				return err
			}
			x.offset, x.shard = offset, append([]float32(nil), view...)
			if _, x.tensorShard, err = byTensor.CopyShard(); err != nil {
				return err
			}
			if x.ddpMasters, err = flatMaster(ddp); err != nil {
				return err
			}
			for i, at := range shardOffsets {
				own, err := byAdd.Master(i)
				var e *Error
				if err != nil && (!errors.As(err, &e) || e.Status != StatusInvalidArgument) {
					return fmt.Errorf("Master(%d): %w", i, err)
				}
				x.readable = append(x.readable, err == nil)
				x.viewOfShard = append(x.viewOfShard, err == nil && len(own) > 0 &&
					unsafe.Pointer(&own[0]) == unsafe.Pointer(&view[at-offset]))
			}
			runtime.KeepAlive(byAdd)
			return nil
		}()
	})

	var count uint64
	for r := 0; r < world; r++ {
		for m := 0; m < 3; m++ {
			count += microbatchCount(r, m)
		}
	}
	for r, x := range res {
		if x.err != nil {
			t.Fatalf("rank %d: %v", r, x.err)
		}
	}
	ddp := res[0].ddpMasters
	largest := 0.0
	for _, v := range ddp {
		largest = math.Max(largest, math.Abs(float64(v)))
	}
	next := 0
	for r, x := range res {
		h, d := x.byAdd, x.ddp
		if x.byTensor != h || len(x.tensorShard) != len(x.shard) {
			t.Fatalf("rank %d: AddTensor %+v, Add %+v", r, x.byTensor, h)
		}
		for i := range x.shard {
			if math.Float32bits(x.shard[i]) != math.Float32bits(x.tensorShard[i]) {
				t.Fatalf("rank %d: element %d is %v through Add, %v through AddTensor", r, x.offset+i, x.shard[i], x.tensorShard[i])
			}
		}
		if h != res[0].byAdd {
			t.Errorf("rank %d: %+v, rank 0 %+v", r, h, res[0].byAdd)
		}
		if h.TotalCount != count || d.TotalCount != count || h.Microbatches != uint64(3*world) || h.FoundInf {
			t.Errorf("rank %d: %+v (DDP %+v)", r, h, d)
		}
		if math.Abs(h.GradNorm-d.GradNorm) > 1e-5*d.GradNorm || math.Abs(h.ClipCoef-d.ClipCoef) > 1e-5*d.ClipCoef {
			t.Errorf("rank %d: norm %v clip %v, DDP norm %v clip %v", r, h.GradNorm, h.ClipCoef, d.GradNorm, d.ClipCoef)
		}
		if (h.ClipCoef < 1) != (maxNorm > 0) {
			t.Errorf("rank %d: clip_coef %v with max_grad_norm %v", r, h.ClipCoef, maxNorm)
		}
		if x.offset != next || len(x.shard) == 0 || len(x.shard) >= shardTotal {
			t.Fatalf("rank %d: shard %d..%d, the previous ended at %d", r, x.offset, x.offset+len(x.shard), next)
		}
		next = x.offset + len(x.shard)
		for i, v := range x.shard {
			want := float64(ddp[x.offset+i])
			if math.Abs(float64(v)-want) > 1e-5*math.Abs(want)+1e-6*largest {
				t.Fatalf("rank %d: element %d is %v, DDP %v", r, x.offset+i, v, want)
			}
		}
		// Master gives exactly the tensors wholly inside the shard, over the shard's memory.
		for i, d := range shardTensors {
			at := shardOffsets[i]
			inside := x.offset <= at && at+int(d.Numel) <= next
			if x.readable[i] != inside || x.viewOfShard[i] != inside {
				t.Errorf("rank %d: Master(%d) readable %v, over the shard %v; inside the shard %v", r, i, x.readable[i], x.viewOfShard[i], inside)
			}
		}
	}
	if next != shardTotal {
		t.Fatalf("the shards end at %d of %d", next, shardTotal)
	}
}

// One shard of one, created without a communicator, is the unsharded accumulator bit for bit.
func TestOneShardOfOneIsTheUnshardedAccumulator(t *testing.T) {
	scaler := scalerWithScale(t, 1024)
	defer scaler.Close()
	oc := accumulateConfig(1, 0, 0)
	pc := DefaultAccumulatorConfig()
	pc.BucketNumel = oc.BucketNumel
	one := must(NewAccumulator(shardTensors, &oc, nil))
	defer one.Close()
	plain := must(NewAccumulator(shardTensors, &pc, nil))
	defer plain.Close()
	rng := rand.New(rand.NewSource(11))
	for m := 0; m < 3; m++ {
		g := randomGrads(rng)
		for _, acc := range []*Accumulator{one, plain} {
			if err := acc.Add(scaler, g, uint64(1+m)); err != nil {
				t.Fatal(err)
			}
		}
	}
	if a, b := must(one.Sync(nil)), must(plain.Sync(nil)); a != b {
		t.Fatalf("one shard %+v, unsharded %+v", a, b)
	}
	offset, a, err := one.CopyShard()
	if err != nil || offset != 0 || len(a) != shardTotal {
		t.Fatalf("one shard of one: %d, %d elements, %v", offset, len(a), err)
	}
	_, b, _ := plain.CopyShard()
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			t.Fatalf("element %d: %v, unsharded %v", i, a[i], b[i])
		}
	}
}

func TestShardedCreationIsChecked(t *testing.T) {
	comms := must(NewLocalGroup(2))
	defer closeAll(comms)
	refusedWith := func(what string, c AccumulatorConfig, comm *Comm, want Status, word string) {
		t.Helper()
		acc, err := NewShardedAccumulator(shardTensors, &c, comm, nil)
		var e *Error
		if !errors.As(err, &e) || e.Status != want || !strings.Contains(e.Message, word) {
			if acc != nil {
				acc.Close()
			}
			t.Errorf("%s: got %v, want %v naming %q", what, err, want, word)
		}
	}
	refusedWith("rank 1 on rank 0's communicator", accumulateConfig(2, 1, 0), comms[0], StatusInvalidArgument, "shard 1 of 2")
	refusedWith("3 shards on 2 ranks", accumulateConfig(3, 0, 0), comms[0], StatusInvalidArgument, "shard 0 of 3")
	rs := accumulateConfig(2, 0, 0)
	rs.Sharding = ShardingReduceScatter
	refusedWith("another policy", rs, comms[0], StatusInvalidArgument, "GRADACC_SHARDING_ACCUMULATE")
	refusedWith("no communicator", accumulateConfig(2, 0, 0), nil, StatusNullArgument, "comm")
	// Over several ranks, the plain constructor has no communicator for the micro-batches.
	refused(t, "NewAccumulator", accumulateConfig(2, 0, 0), "communicator")
	comms[1].Close()
	refusedWith("a closed communicator", accumulateConfig(2, 1, 0), comms[1], StatusInvalidHandle, "closed")
}

// The accumulator references its communicator: with every other reference gone and the
// collector run, the Comm's finalizer must not have destroyed the handle it reduces over, and
// Sync takes that handle. Close lets it go.
func TestShardedAccumulatorKeepsItsCommAlive(t *testing.T) {
	accs := make([]*Accumulator, 2)
	func() {
		comms := must(NewLocalGroup(2))
		setTimeouts(t, 30*time.Second, comms)
		for r := range accs {
			c := accumulateConfig(2, r, 0)
			accs[r] = must(NewShardedAccumulator([]TensorDesc{{2, F32}}, &c, comms[r], nil))
		}
	}()
	for i := 0; i < 3; i++ {
		runtime.GC()
		time.Sleep(10 * time.Millisecond) // finalizers run on their own goroutine
	}
	infos, shards, errs := make([]SyncInfo, 2), make([][]float32, 2), make([]error, 2)
	onRanks(t, 2, func(r int) {
		s := scalerWithScale(t, 1)
		defer s.Close()
		if errs[r] = accs[r].Add(s, []Grad{Float32s([]float32{float32(r + 1), float32(r + 1)})}, 1); errs[r] != nil {
			return
		}
		if accs[r].comm == nil {
			errs[r] = errors.New("the accumulator dropped its Comm")
			return
		}
		if infos[r], errs[r] = accs[r].Sync(accs[r].comm); errs[r] == nil { // a destroyed handle would fail here
			_, shards[r], errs[r] = accs[r].CopyShard()
		}
	})
	for r := range accs {
		if errs[r] != nil {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
		if infos[r].TotalCount != 2 || infos[r].Microbatches != 2 {
			t.Errorf("rank %d: %+v", r, infos[r])
		}
		accs[r].Close()
		if accs[r].comm != nil {
			t.Errorf("rank %d: the closed accumulator still holds its Comm", r)
		}
	}
	// The two elements, padded to 64, lie in shard 0: (1 + 2) / 2 items, then zeros.
	if len(shards[0]) != 64 || shards[0][0] != 1.5 || shards[0][1] != 1.5 || len(shards[1]) != 0 {
		t.Fatalf("shards %v", shards)
	}
	for k, v := range shards[0][2:] {
		if math.Float32bits(v) != 0 {
			t.Fatalf("padding element %d is %v", 2+k, v)
		}
	}
}

// Rank 1's micro-batch is invalid (no items for a mean loss): it fails there and with
// StatusPeerFailure on rank 0, nothing added on either. Then rank 0 syncs on a stranger
// communicator: StatusInvalidArgument there, StatusPeerFailure on rank 1. The windows survive.
func TestShardedMisuseOnOneRankFailsEveryRank(t *testing.T) {
	comms, stranger := must(NewLocalGroup(2)), must(NewLocalGroup(1))
	defer closeAll(comms)
	defer closeAll(stranger)
	setTimeouts(t, 30*time.Second, comms)
	addErrs, syncErrs, after, errs := make([]error, 2), make([]error, 2), make([]SyncInfo, 2), make([]error, 2)
	unchanged := make([]bool, 2)
	onRanks(t, 2, func(r int) {
		errs[r] = func() error {
			s := scalerWithScale(t, 1)
			defer s.Close()
			c := accumulateConfig(2, r, 0)
			acc, err := NewShardedAccumulator(shardTensors, &c, comms[r], nil)
			if err != nil {
				return err
			}
			defer acc.Close()
			g := randomGrads(rand.New(rand.NewSource(int64(40 + r))))
			if err := acc.Add(s, g, 2); err != nil {
				return err
			}
			_, before, err := acc.CopyShard()
			if err != nil {
				return err
			}
			count := uint64(2)
			if r == 1 {
				count = 0
			}
			addErrs[r] = acc.Add(s, g, count)
			var comm *Comm
			if r == 0 {
				comm = stranger[0]
			}
			_, syncErrs[r] = acc.Sync(comm)
			_, now, err := acc.CopyShard()
			if err != nil {
				return err
			}
			unchanged[r] = len(now) == len(before)
			for i := range now {
				unchanged[r] = unchanged[r] && math.Float32bits(now[i]) == math.Float32bits(before[i])
			}
			after[r], err = acc.Sync(comms[r])
			return err
		}()
	})
	for r := range errs {
		if errs[r] != nil {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
		if !unchanged[r] {
			t.Errorf("rank %d: a failed call changed the shard", r)
		}
		if after[r].Microbatches != 2 || after[r].TotalCount != 4 {
			t.Errorf("rank %d: %+v afterwards", r, after[r])
		}
	}
	var e *Error
	if !errors.As(addErrs[1], &e) || e.Status != StatusInvalidArgument || !strings.Contains(e.Message, "count") {
		t.Errorf("rank 1's Add of 0 items: %v", addErrs[1])
	}
	if !errors.Is(addErrs[0], &Error{Status: StatusPeerFailure}) {
		t.Errorf("rank 0's valid Add: %v", addErrs[0])
	}
	if !errors.Is(syncErrs[0], &Error{Status: StatusInvalidArgument}) {
		t.Errorf("rank 0's Sync on a stranger: %v", syncErrs[0])
	}
	if !errors.Is(syncErrs[1], &Error{Status: StatusPeerFailure}) {
		t.Errorf("rank 1's Sync: %v", syncErrs[1])
	}
}

// Arguments the binding refuses itself (a gradient count or length that does not fit, a closed
// Scaler or Comm, another accumulator's BoundGrads) fail there at once and with
// StatusPeerFailure on the other rank, promptly rather than at the communicator's timeout; both
// ranks then add and sync as if nothing had happened.
func TestShardedBindingRefusalFailsThePeerAtOnce(t *testing.T) {
	comms := must(NewLocalGroup(2))
	defer closeAll(comms)
	setTimeouts(t, 5*time.Second, comms)
	closedComm := must(NewLocalGroup(1))[0]
	closedComm.Close()
	steps := []struct {
		what string
		want Status // rank 1's error
		bad  func(acc *Accumulator, s *Scaler, g []Grad) error
	}{
		{"3 of 4 gradients", StatusSizeMismatch, func(acc *Accumulator, s *Scaler, g []Grad) error { return acc.Add(s, g[:3], 2) }},
		{"a short gradient", StatusSizeMismatch, func(acc *Accumulator, s *Scaler, g []Grad) error {
			short := append([]Grad(nil), g...)
			short[1] = Float32s(make([]float32, shardTensors[1].Numel-1))
			return acc.Add(s, short, 2)
		}},
		{"a closed Scaler", StatusInvalidHandle, func(acc *Accumulator, _ *Scaler, g []Grad) error {
			closed := scalerWithScale(t, 1)
			closed.Close()
			return acc.Add(closed, g, 2)
		}},
		{"another accumulator's BoundGrads", StatusInvalidArgument, func(acc *Accumulator, s *Scaler, g []Grad) error {
			other := must(NewAccumulator(shardTensors, nil, nil))
			defer other.Close()
			b := must(other.Bind(g))
			defer b.Close()
			return acc.AddBound(s, b, 2)
		}},
		{"Sync on a closed Comm", StatusInvalidHandle, func(acc *Accumulator, _ *Scaler, _ []Grad) error {
			_, err := acc.Sync(closedComm)
			return err
		}},
	}
	errs, took := make([][2]error, len(steps)), make([]time.Duration, len(steps))
	final, failed := make([]SyncInfo, 2), make([]error, 2)
	onRanks(t, 2, func(r int) {
		failed[r] = func() error {
			s := scalerWithScale(t, 1)
			defer s.Close()
			c := accumulateConfig(2, r, 0)
			acc, err := NewShardedAccumulator(shardTensors, &c, comms[r], nil)
			if err != nil {
				return err
			}
			defer acc.Close()
			g := randomGrads(rand.New(rand.NewSource(int64(60 + r))))
			if err := acc.Add(s, g, 2); err != nil {
				return err
			}
			for i, step := range steps {
				start := time.Now()
				if r == 1 {
					errs[i][r] = step.bad(acc, s, g)
				} else if strings.HasPrefix(step.what, "Sync") {
					_, errs[i][r] = acc.Sync(nil)
				} else {
					errs[i][r] = acc.Add(s, g, 2)
				}
				if r == 0 {
					took[i] = time.Since(start)
				}
			}
			if err := acc.Add(s, g, 2); err != nil {
				return err
			}
			final[r], err = acc.Sync(nil)
			return err
		}()
	})
	for i, step := range steps {
		if !errors.Is(errs[i][1], &Error{Status: step.want}) {
			t.Errorf("%s: rank 1 got %v, want status %d", step.what, errs[i][1], step.want)
		}
		if !errors.Is(errs[i][0], &Error{Status: StatusPeerFailure}) || took[i] > 2*time.Second {
			t.Errorf("%s: rank 0 got %v after %v, want StatusPeerFailure at once", step.what, errs[i][0], took[i])
		}
	}
	for r := range failed {
		if failed[r] != nil {
			t.Fatalf("rank %d: %v", r, failed[r])
		}
		if final[r].Microbatches != 4 || final[r].TotalCount != 8 {
			t.Errorf("rank %d: %+v afterwards, want 4 micro-batches of 8 items", r, final[r])
		}
	}
}

// An AddTensor the binding refuses before the C call (16-bit words for an F32 tensor, a closed
// Scaler) fails there, and the micro-batch then fails on every rank at EndMicrobatch (the windows
// are discarded) instead of summing the refused tensor as zeros on the other rank.
func TestShardedAddTensorRefusedByTheBindingFailsEveryRank(t *testing.T) {
	comms := must(NewLocalGroup(2))
	defer closeAll(comms)
	setTimeouts(t, 30*time.Second, comms)
	steps := []struct {
		what string
		bad  func(acc *Accumulator, s *Scaler) error
	}{
		{"16-bit words for an F32 tensor", func(acc *Accumulator, s *Scaler) error {
			return acc.AddTensor(s, 1, Words16(make([]uint16, shardTensors[1].Numel)))
		}},
		{"a closed Scaler", func(acc *Accumulator, _ *Scaler) error {
			closed := scalerWithScale(t, 1)
			closed.Close()
			return acc.AddTensor(closed, 1, Float32s(make([]float32, shardTensors[1].Numel)))
		}},
	}
	refused, ended := make([][2]error, len(steps)), make([][2]error, len(steps))
	final, failed := make([]SyncInfo, 2), make([]error, 2)
	onRanks(t, 2, func(r int) {
		failed[r] = func() error {
			s := scalerWithScale(t, 1)
			defer s.Close()
			c := accumulateConfig(2, r, 0)
			acc, err := NewShardedAccumulator(shardTensors, &c, comms[r], nil)
			if err != nil {
				return err
			}
			defer acc.Close()
			g := randomGrads(rand.New(rand.NewSource(int64(70 + r))))
			for i, step := range steps {
				if err := acc.BeginMicrobatch(2); err != nil {
					return err
				}
				for k := range shardTensors {
					var err error
					if r == 1 && k == 1 {
						err = step.bad(acc, s)
					} else {
						err = acc.AddTensor(s, k, g[k])
					}
					if err != nil {
						refused[i][r] = err
					}
				}
				ended[i][r] = acc.EndMicrobatch()
			}
			if err := acc.Add(s, g, 2); err != nil {
				return err
			}
			final[r], err = acc.Sync(nil)
			return err
		}()
	})
	for i, step := range steps {
		if refused[i][0] != nil || refused[i][1] == nil {
			t.Errorf("%s: add_tensor errors %v, %v; want only rank 1's", step.what, refused[i][0], refused[i][1])
		}
		if !errors.Is(ended[i][1], &Error{Status: StatusWrongState}) {
			t.Errorf("%s: rank 1's EndMicrobatch got %v, want StatusWrongState", step.what, ended[i][1])
		}
		if !errors.Is(ended[i][0], &Error{Status: StatusPeerFailure}) {
			t.Errorf("%s: rank 0's EndMicrobatch got %v, want StatusPeerFailure", step.what, ended[i][0])
		}
	}
	for r := range failed {
		if failed[r] != nil {
			t.Fatalf("rank %d: %v", r, failed[r])
		}
		// Only the last micro-batch of each rank: the failed ones' windows were discarded.
		if final[r].Microbatches != 2 || final[r].TotalCount != 4 {
			t.Errorf("rank %d: %+v afterwards, want 2 micro-batches of 4 items", r, final[r])
		}
	}
}
