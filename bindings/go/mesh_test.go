package gradacc

import (
	"errors"
	"math"
	"runtime"
	"strings"
	"testing"
	"time"
)

// The mesh step on dp 2 x tp 2 goroutines in Megatron-Core's order (world rank = tp + 2*dp): one
// accumulator per rank reduced over its data-parallel group, with tensor 0 sharded over tp and
// tensor 1 replicated over tp. The gradients are eighths, so every sum is exact in f32 and the
// float64 reference below is the exact result before the one division by the job's count.

const meshTP, meshDP = 2, 2

// meshCounts is each data rank's micro-batch item counts: the job's count is their sum (14),
// the tensor-parallel peers' windows counted once.
var meshCounts = [meshDP][]uint64{{3, 5}, {2, 4}}

const meshTotal = 14

// meshKey is the replicated tensor's key, the same on both tensor-parallel copies.
const meshKey = 0x6e6f726d

var meshTensors = []TensorDesc{{6, F32}, {3, F32}}

// meshGrad is tensor t's gradient at data rank d, micro-batch mb, tensor-parallel rank tp; the
// replicated tensor 1 has no tp term.
func meshGrad(d, mb, tp, t int) []float32 {
	n, off := 6, tp*5
	if t == 1 {
		n, off = 3, 11
	}
	g := make([]float32, n)
	for j := range g {
		g[j] = float32((d*7+mb*3+off+j)%9-4) / 8
	}
	return g
}

// meshReference is tensor t's reduced gradient at tensor-parallel rank tp, normalised by the
// job's count, in float64.
func meshReference(tp, t int) []float64 {
	want := make([]float64, len(meshGrad(0, 0, tp, t)))
	for d := 0; d < meshDP; d++ {
		for mb := range meshCounts[d] {
			for j, v := range meshGrad(d, mb, tp, t) {
				want[j] += float64(v)
			}
		}
	}
	for j := range want {
		want[j] /= meshTotal
	}
	return want
}

// meshReferenceNorm is the job's norm: both shards of tensor 0, the replicated tensor 1 once.
func meshReferenceNorm() float64 {
	var squares float64
	for tp := 0; tp < meshTP; tp++ {
		for t := 0; t < 2; t++ {
			if t == 1 && tp > 0 {
				continue
			}
			for _, v := range meshReference(tp, t) {
				squares += v * v
			}
		}
	}
	return math.Sqrt(squares)
}

// meshRank is one rank's objects: its world and data-parallel endpoints, a scaler, an
// accumulator and its mesh.
type meshRank struct {
	r, dp, tp int
	world     *Comm
	data      *Comm
	scaler    *Scaler
	acc       *Accumulator
	mesh      *Mesh
}

// part is the rank's one part: its accumulator over its data-parallel group, tensor 1 replicated
// over the tensor-parallel ranks.
func (m *meshRank) part() MeshPart {
	return MeshPart{Accumulator: m.acc, Comm: m.data, Replicated: []Replicated{{Tensor: 1, Copies: meshTP, Key: meshKey}}}
}

// addWindow adds the rank's micro-batches; poison puts an inf into tensor 0 of micro-batch 1,
// extra adds to the count of micro-batch 0.
func (m *meshRank) addWindow(t *testing.T, poison bool, extra uint64) {
	for mb, n := range meshCounts[m.dp] {
		g0, g1 := meshGrad(m.dp, mb, m.tp, 0), meshGrad(m.dp, mb, m.tp, 1)
		if poison && mb == 1 {
			g0[2] = float32(math.Inf(1))
		}
		if mb == 0 {
			n += extra
		}
		if err := m.acc.Add(m.scaler, []Grad{Float32s(g0), Float32s(g1)}, n); err != nil {
			t.Error(err)
		}
	}
}

// runMesh runs body on every rank of a dp 2 x tp 2 world, each with its own goroutine and a
// mesh clipping at maxNorm; a rank left waiting fails with StatusTimeout instead of hanging.
func runMesh(t *testing.T, maxNorm float32, body func(m *meshRank)) {
	world := must(NewLocalGroup(meshTP * meshDP))
	defer closeAll(world)
	var data [meshTP][]*Comm
	for tp := range data {
		data[tp] = must(NewLocalGroup(meshDP))
		defer closeAll(data[tp])
	}
	onRanks(t, meshTP*meshDP, func(r int) {
		m := &meshRank{r: r, dp: r / meshTP, tp: r % meshTP, world: world[r]}
		m.data = data[m.tp][m.dp]
		for _, c := range []*Comm{m.world, m.data} {
			if err := c.SetTimeout(10 * time.Second); err != nil {
				t.Error(err)
				return
			}
		}
		sc := DefaultScalerConfig()
		sc.InitScale, sc.MinScale = 1, 0x1p-10 // scale 1: the gradients go in as they are
		m.scaler = must(NewScaler(&sc, nil))
		defer m.scaler.Close()
		cfg := DefaultAccumulatorConfig()
		cfg.LossReduction, cfg.TensorStats = LossSum, true
		m.acc = must(NewAccumulator(meshTensors, &cfg, nil))
		defer m.acc.Close()
		m.mesh = must(NewMesh(m.world, uint32(m.dp), meshDP, maxNorm))
		defer m.mesh.Close()
		body(m)
	})
}

// checkMasters compares the rank's masters with the reference times coef, within the rounding of
// the normalisation and the clip.
func checkMasters(t *testing.T, m *meshRank, coef float64) {
	for ti := range meshTensors {
		got := must(m.acc.CopyMaster(ti))
		for j, w := range meshReference(m.tp, ti) {
			w *= coef
			if d := math.Abs(float64(got[j]) - w); d > 0x1p-21*math.Abs(w) {
				t.Errorf("rank %d tensor %d [%d]: %g, want %g", m.r, ti, j, got[j], w)
			}
		}
	}
}

type meshOutcome struct {
	good, inf MeshInfo
	skipped   bool
	scale     float32
}

// The job's count is the data ranks' only, its norm has the replicated tensor once, every rank
// gets the same report (the norm's and clip coefficient's bits included), and an inf on rank 3
// skips the step on every rank, naming world rank 3 and its part 0.
func TestMeshCountsDataRanksOnceAndSkipsEverywhere(t *testing.T) {
	norm := meshReferenceNorm()
	for _, maxNorm := range []float32{0, float32(norm / 2)} {
		out := make([]meshOutcome, meshTP*meshDP)
		runMesh(t, maxNorm, func(m *meshRank) {
			o := &out[m.r]
			m.addWindow(t, false, 0)
			var err error
			if o.good, err = m.mesh.Sync([]MeshPart{m.part()}); err != nil {
				t.Errorf("rank %d: %v", m.r, err)
				return
			}
			coef := 1.0
			if maxNorm > 0 {
				coef = o.good.ClipCoef
			}
			checkMasters(t, m, coef)
			m.addWindow(t, m.r == 3, 0)
			if o.inf, err = m.mesh.Sync([]MeshPart{m.part()}); err != nil {
				t.Errorf("rank %d: %v", m.r, err)
				return
			}
			o.skipped = must(m.scaler.Update(m.acc))
			o.scale = must(m.scaler.Scale())
		})
		for r, o := range out {
			g := o.good
			if g.TotalCount != meshTotal || g.Microbatches != 4 || g.FoundInf || g.OverflowPart != -1 ||
				g.OverflowAt != OverflowAtNone {
				t.Errorf("max norm %g, rank %d: %+v", maxNorm, r, g)
			}
			if math.Abs(g.GradNorm-norm) > 1e-6*norm {
				t.Errorf("max norm %g, rank %d: norm %.17g, want %.17g", maxNorm, r, g.GradNorm, norm)
			}
			if want := float64(maxNorm) / (g.GradNorm + 1e-6); maxNorm > 0 && math.Abs(g.ClipCoef-want) > 1e-6 {
				t.Errorf("rank %d: clip %g, want %g", r, g.ClipCoef, want)
			}
			if g != out[0].good {
				t.Errorf("max norm %g, rank %d: %+v, rank 0 %+v", maxNorm, r, g, out[0].good)
			}
			f := o.inf
			if !f.FoundInf || f.OverflowAt != OverflowAtGradient || f.OverflowRank != 3 || f.OverflowPart != 0 ||
				f.OverflowMicrobatch != 1 || f.OverflowTensor != 0 || f != out[0].inf {
				t.Errorf("max norm %g, rank %d: inf step %+v", maxNorm, r, f)
			}
			if !o.skipped || o.scale != out[0].scale || o.scale >= 1 {
				t.Errorf("max norm %g, rank %d: skipped %v, scale %g", maxNorm, r, o.skipped, o.scale)
			}
		}
	}
}

// errorWith reports whether err is an *Error of status whose message holds text.
func errorWith(err error, status Status, text string) bool {
	var e *Error
	return errors.As(err, &e) && e.Status == status && strings.Contains(e.Message, text)
}

// Tensor-parallel peers 0 and 1 share data-parallel rank 0; rank 1 counts one item more. The
// step fails on every rank, naming both world ranks, and leaves every window intact: once rank
// 1 adds its window again, the step succeeds.
func TestMeshCountMismatchBetweenPeersFailsEveryRank(t *testing.T) {
	errs := make([]error, meshTP*meshDP)
	counts := make([]uint64, meshTP*meshDP)
	runMesh(t, 0, func(m *meshRank) {
		extra := uint64(0)
		if m.r == 1 {
			extra = 1
		}
		m.addWindow(t, false, extra)
		_, errs[m.r] = m.mesh.Sync([]MeshPart{m.part()})
		if m.r == 1 {
			if err := m.acc.Reset(); err != nil {
				t.Error(err)
			}
			m.addWindow(t, false, 0)
		}
		if info, err := m.mesh.Sync([]MeshPart{m.part()}); err != nil {
			t.Errorf("rank %d: %v", m.r, err)
		} else {
			counts[m.r] = info.TotalCount
		}
		checkMasters(t, m, 1)
	})
	for r, err := range errs {
		if !errorWith(err, StatusInvalidArgument, "world ranks 0 and 1 share data-parallel rank 0") {
			t.Errorf("rank %d: %v", r, err)
		}
		if counts[r] != meshTotal {
			t.Errorf("rank %d: count %d after the failed step", r, counts[r])
		}
	}
}

// Bad arguments on one rank fail it naming the argument and every other rank with
// StatusPeerFailure, the windows intact: no parts (on every rank), a nil accumulator on rank 1,
// a replicated tensor out of range on rank 2, a closed accumulator on rank 0.
func TestMeshBadArgumentsFailEveryRank(t *testing.T) {
	const steps = 4
	errs := make([][steps]error, meshTP*meshDP)
	counts := make([]uint64, meshTP*meshDP)
	runMesh(t, 0, func(m *meshRank) {
		m.addWindow(t, false, 0)
		closed := must(NewAccumulator(meshTensors, nil, nil))
		closed.Close()
		for step := 0; step < steps; step++ {
			parts := []MeshPart{m.part()}
			switch {
			case step == 0:
				parts = nil
			case step == 1 && m.r == 1:
				parts[0].Accumulator = nil
			case step == 2 && m.r == 2:
				parts[0].Replicated = []Replicated{{Tensor: 9, Copies: meshTP, Key: 1}}
			case step == 3 && m.r == 0:
				parts[0].Accumulator = closed
			}
			_, errs[m.r][step] = m.mesh.Sync(parts)
		}
		if info, err := m.mesh.Sync([]MeshPart{m.part()}); err != nil {
			t.Errorf("rank %d: %v", m.r, err)
		} else {
			counts[m.r] = info.TotalCount
		}
	})
	for r, e := range errs {
		if !errorWith(e[0], StatusNullArgument, "`parts` is NULL") {
			t.Errorf("rank %d, no parts: %v", r, e[0])
		}
		for step, at := range map[int]int{1: 1, 2: 2, 3: 0} {
			var ok bool
			switch {
			case r != at:
				ok = errors.Is(e[step], &Error{Status: StatusPeerFailure})
			case step == 1:
				ok = errorWith(e[step], StatusNullArgument, "`parts[0].accumulator` is NULL")
			case step == 2:
				ok = errorWith(e[step], StatusInvalidArgument, "parts[0].replicated[0]")
			case step == 3:
				ok = errorWith(e[step], StatusInvalidHandle, "the Accumulator is closed")
			}
			if !ok {
				t.Errorf("rank %d, step %d: %v", r, step, e[step])
			}
		}
		if counts[r] != meshTotal {
			t.Errorf("rank %d: count %d after the failed steps", r, counts[r])
		}
	}
}

func TestMeshArgumentsAreChecked(t *testing.T) {
	comms := must(NewLocalGroup(1))
	comm := comms[0]
	defer comm.Close()
	if _, err := NewMesh(comm, 1, 1, 0); !errorWith(err, StatusInvalidArgument, "`data_rank` = 1 is not below `data_size` = 1") {
		t.Errorf("data rank 1 of 1: %v", err)
	}
	if _, err := NewMesh(nil, 0, 1, 0); !errors.Is(err, &Error{Status: StatusNullArgument}) {
		t.Errorf("nil world: %v", err)
	}
	mesh := must(NewMesh(comm, 0, 1, 1))
	if err := mesh.Close(); err != nil {
		t.Fatal(err)
	}
	if err := mesh.Close(); err != nil { // idempotent
		t.Fatal(err)
	}
	if _, err := mesh.Sync(nil); !errorWith(err, StatusInvalidHandle, "the Mesh is closed") {
		t.Errorf("closed mesh: %v", err)
	}
	closedComms := must(NewLocalGroup(1))
	closedComms[0].Close()
	if _, err := NewMesh(closedComms[0], 0, 1, 0); !errorWith(err, StatusInvalidHandle, "the Comm is closed") {
		t.Errorf("closed world: %v", err)
	}
}

// Meshes left to the finalizers, with their world closed first, under many collections (run
// this under GOGC=1 too): each still steps on its own reference to the group.
func TestMeshFinalizers(t *testing.T) {
	s := scalerWithScale(t, 1)
	defer s.Close()
	for i := 0; i < 100; i++ {
		comms := must(NewLocalGroup(1))
		mesh := must(NewMesh(comms[0], 0, 1, 0))
		comms[0].Close()
		acc := must(NewAccumulator([]TensorDesc{{4, F32}}, nil, nil))
		if err := acc.Add(s, []Grad{Float32s([]float32{1, 2, 3, 4})}, 2); err != nil {
			t.Fatal(err)
		}
		info := must(mesh.Sync([]MeshPart{{Accumulator: acc}}))
		if info.TotalCount != 2 || info.FoundInf {
			t.Fatalf("info %+v", info)
		}
		if i%20 == 0 {
			runtime.GC()
		}
	}
	runtime.GC()
}

// The shape gives Megatron-Core's groups (world 16, tp 2, pp 2: tp groups {0, 1}, {2, 3}, ...;
// dp groups {1, 3, 5, 7}, ...; pp groups {5, 13}) or those of another order, and refuses what
// it cannot hold; an in-process communicator is not split.
func TestMeshShapeGroups(t *testing.T) {
	shape := must(NewMeshShape(16, 2, 2, 1, 1, 1, ""))
	defer shape.Close()
	for _, c := range []struct {
		axes string
		want MeshGroup
	}{{"tp", MeshGroup{4, 1, 2}}, {"dp", MeshGroup{1, 2, 4}}, {"pp", MeshGroup{5, 0, 2}}, {"cp-dp", MeshGroup{1, 2, 4}}} {
		if got := must(shape.Group(5, c.axes)); got != c.want {
			t.Errorf("rank 5 over %s: %+v, want %+v", c.axes, got, c.want)
		}
	}
	if _, err := shape.Group(0, "tp-xp"); !errorWith(err, StatusInvalidArgument, `"xp" is none of`) {
		t.Errorf("unknown axis: %v", err)
	}
	if _, err := shape.Group(16, "tp"); !errorWith(err, StatusInvalidArgument, "`rank` = 16 is not below") {
		t.Errorf("rank outside: %v", err)
	}
	dpFirst := must(NewMeshShape(4, 2, 1, 1, 1, 1, "dp-tp-cp-pp"))
	defer dpFirst.Close()
	if g := must(dpFirst.Group(3, "tp")); g != (MeshGroup{1, 1, 2}) {
		t.Errorf("dp-first order: %+v", g)
	}
	if _, err := NewMeshShape(4, 2, 1, 1, 1, 1, "tp-dp"); !errorWith(err, StatusInvalidArgument, "a permutation of tp, cp, dp and pp") {
		t.Errorf("bad order: %v", err)
	}
	comms := must(NewLocalGroup(1))
	defer comms[0].Close()
	if _, err := comms[0].Split(0, 0); !errorWith(err, StatusInvalidArgument, "cannot be split") {
		t.Errorf("in-process split: %v", err)
	}
	if _, err := must(NewMeshShape(1, 1, 1, 1, 1, 1, "")).Split(comms[0], "dp"); !errorWith(err, StatusInvalidArgument, "cannot be split") {
		t.Errorf("in-process shape split: %v", err)
	}
	shape.Close()
	if _, err := shape.Group(0, "tp"); !errorWith(err, StatusInvalidHandle, "the MeshShape is closed") {
		t.Errorf("closed shape: %v", err)
	}
}

// Under OverflowDropMicrobatch with each micro-batch ended by the mesh, an inf in micro-batch 1
// on rank 3 drops it on its tensor-parallel peer, rank 2, too: the step goes ahead on 10 items in
// 3 micro-batches, normalised by them, the same report everywhere.
func TestMeshDropsAPoisonedMicrobatchOnBothPeers(t *testing.T) {
	out := make([]MeshInfo, meshTP*meshDP)
	kept := make([][]bool, meshTP*meshDP)
	runMesh(t, 0, func(m *meshRank) {
		cfg := DefaultAccumulatorConfig()
		cfg.LossReduction, cfg.TensorStats, cfg.Overflow = LossSum, true, OverflowDropMicrobatch
		m.acc.Close()
		m.acc = must(NewAccumulator(meshTensors, &cfg, nil))
		for mb, n := range meshCounts[m.dp] {
			g0, g1 := meshGrad(m.dp, mb, m.tp, 0), meshGrad(m.dp, mb, m.tp, 1)
			if m.r == 3 && mb == 1 {
				g0[2] = float32(math.Inf(1))
			}
			if err := m.acc.BeginMicrobatch(n); err != nil {
				t.Error(err)
				return
			}
			for i, g := range [][]float32{g0, g1} {
				if err := m.acc.AddTensor(m.scaler, i, Float32s(g)); err != nil {
					t.Error(err)
				}
			}
			kept[m.r] = append(kept[m.r], must(m.mesh.EndMicrobatch(m.acc)))
		}
		var err error
		if out[m.r], err = m.mesh.Sync([]MeshPart{m.part()}); err != nil {
			t.Errorf("rank %d: %v", m.r, err)
		}
	})
	for r, o := range out {
		if len(kept[r]) != 2 || !kept[r][0] || kept[r][1] != (r < 2) {
			t.Errorf("rank %d kept %v", r, kept[r])
		}
		if o.TotalCount != 10 || o.Microbatches != 3 || o.DroppedMicrobatches != 1 || o.FoundInf ||
			o.OverflowRank != 3 || o.OverflowMicrobatch != 1 {
			t.Errorf("rank %d: %+v", r, o)
		}
		if o != out[0] {
			t.Errorf("rank %d: %+v, rank 0 %+v", r, o, out[0])
		}
	}
}
