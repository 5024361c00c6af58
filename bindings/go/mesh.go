package gradacc

// The mesh step (gradacc_mesh_*): one boundary over every accumulator of a rank and every rank
// of a job with tensor, pipeline, context or expert parallelism beside data parallelism.
// docs/model-parallelism.md states the rules; this file only carries them across cgo.

// #include <stdlib.h>
// #include <gradacc.h>
import "C"

import (
	"math"
	"runtime"
	"unsafe"
)

// Replicated is gradacc_replicated_t: a tensor that Copies model-parallel ranks hold alike at
// one data-parallel rank (a layer norm replicated over tensor-parallel ranks, a tied embedding
// on the first and last pipeline stage). It enters the global norm once, from one copy.
type Replicated struct {
	// Tensor is its index in the part's accumulator (0-based).
	Tensor uint32
	// Copies is how many model-parallel ranks hold it (at least 1): the step checks that exactly
	// that many declare it.
	Copies uint32
	// Key is the same on every copy and different for different tensors (a hash of the
	// parameter's name, say).
	Key uint64
}

// MeshPart is gradacc_mesh_part_t: one accumulator of a mesh step and the group it reduces over.
type MeshPart struct {
	// Accumulator is on the CPU, created with MaxGradNorm 0 (the mesh clips), and with
	// TensorStats when the part declares Replicated tensors.
	Accumulator *Accumulator
	// Comm is its group, as Accumulator.Sync's: nil when it is alone, or for a sharded
	// accumulation's own communicator.
	Comm *Comm
	// Replicas is a hybrid boundary's replica group, as Accumulator.SyncHybrid's (Comm is then
	// the shard group); nil otherwise.
	Replicas *Comm
	// Replicated lists its replicated tensors.
	Replicated []Replicated
}

// MeshInfo is a mesh step's report, the same on every rank: SyncInfo with the totals over the
// data axes, the job's global norm and clip coefficient, and OverflowRank a world rank.
type MeshInfo struct {
	SyncInfo
	// OverflowPart is the part, in OverflowRank's parts, where the job first went non-finite;
	// -1 when no place is reported.
	OverflowPart int
}

// Mesh is one boundary over a job's accumulators: a world communicator of every rank of the job
// and this rank's place on the data axes (gradacc_mesh_t). Close must come after every Sync on
// it has returned.
type Mesh struct {
	ptr *C.gradacc_mesh_t
}

// NewMesh creates a mesh over world, a host communicator (in-process or MPI) of every rank of
// the job, where this rank is data-parallel rank dataRank of dataSize: the ranks that see
// different data (data-parallel x context-parallel). In Megatron-Core's rank order, tensor-
// parallel fastest, then context, data and pipeline, dataSize = CP*DP and dataRank = cp + CP*dp.
// dataSize divides world's size. maxGradNorm clips the global norm (0: off). The mesh holds its
// own reference to world's group: closing world first releases only its handle. A nil world
// reaches the C call, which names it (StatusNullArgument); a closed one fails with
// StatusInvalidHandle.
func NewMesh(world *Comm, dataRank, dataSize uint32, maxGradNorm float32) (*Mesh, error) {
	var wp *C.gradacc_comm_t
	if world != nil {
		var err error
		if wp, err = world.handle(); err != nil {
			return nil, err
		}
	}
	var p *C.gradacc_mesh_t
	err := call(func() C.enum_gradacc_status_t {
		return C.gradacc_mesh_create(wp, C.uint32_t(dataRank), C.uint32_t(dataSize), C.float(maxGradNorm), &p)
	})
	runtime.KeepAlive(world)
	if err != nil {
		return nil, err
	}
	m := &Mesh{ptr: p}
	runtime.SetFinalizer(m, (*Mesh).Close)
	return m, nil
}

// Close destroys the mesh. Calling it again does nothing.
func (m *Mesh) Close() error {
	if m.ptr == nil {
		return nil
	}
	runtime.SetFinalizer(m, nil)
	p := m.ptr
	m.ptr = nil
	return call(func() C.enum_gradacc_status_t { return C.gradacc_mesh_destroy(p) })
}

func (m *Mesh) handle() (*C.gradacc_mesh_t, error) {
	if m == nil || m.ptr == nil {
		return nil, &Error{Status: StatusInvalidHandle, Message: "the Mesh is closed"}
	}
	return m.ptr, nil
}

// Sync is the mesh step over this rank's parts: every rank of the world calls it, each from its
// own goroutine, and the ranks of each part's group give that part at the same position. Each
// part is reduced over its group and normalised by the job's totals (item counts summed over the
// data axes only; ranks at one data-parallel rank must count alike, or the step fails on every
// rank naming them); the norm counts every distinct element once and one clip coefficient
// applies everywhere. A non-finite value on any rank skips the step on every rank, and the
// report names the world rank and its part. Every part's window reports the same info, so
// Scaler.Update and each optimizer's step follow it.
//
// An invalid part on one rank (no parts, a nil accumulator, a bad Replicated entry) fails that
// rank naming it and the others with StatusPeerFailure. A closed Accumulator, Comm or Replicas in
// a part goes in as a nil accumulator, so the step is refused on every rank too, and this rank
// returns StatusInvalidHandle naming the closed object; but a closed Comm's group can no longer
// be named, so its peers wait until their communicator's timeout. A closed Mesh fails here alone
// (the peers wait until their timeout). A failure before the reductions leaves every window
// intact.
func (m *Mesh) Sync(parts []MeshPart) (MeshInfo, error) {
	p, err := m.handle()
	if err != nil {
		return MeshInfo{}, err
	}
	// Go memory passed to C may hold Go pointers only while their objects are pinned: the
	// Replicated arrays are pinned, the handles are C pointers.
	var pin runtime.Pinner
	defer pin.Unpin()
	raw := make([]C.gradacc_mesh_part_t, max(len(parts), 1))
	var closed error
	for i, part := range parts {
		r := &raw[i]
		r.struct_size = C.size_t(unsafe.Sizeof(*r))
		r.comm, r.replicas = part.Comm.orNil(), part.Replicas.orNil()
		r.accumulator = part.Accumulator.orNil()
		for _, bad := range []error{part.Accumulator.closedErr(), part.Comm.closedErr(), part.Replicas.closedErr()} {
			if closed == nil {
				closed = bad
			}
		}
		if closed != nil {
			r.accumulator = nil // refused on every rank: its groups are still told
		}
		if len(part.Replicated) > 0 {
			reps := make([]C.gradacc_replicated_t, len(part.Replicated))
			for j, rep := range part.Replicated {
				reps[j].tensor = C.uint32_t(rep.Tensor)
				reps[j].copies = C.uint32_t(rep.Copies)
				reps[j].key = C.uint64_t(rep.Key)
			}
			pin.Pin(&reps[0])
			r.replicated = &reps[0]
			r.replicated_count = C.size_t(len(reps))
		}
	}
	var arr *C.gradacc_mesh_part_t // NULL for no parts: the library names it on this rank
	if len(parts) > 0 {
		arr = &raw[0]
	}
	var c C.gradacc_sync_info_t
	c.struct_size = C.size_t(unsafe.Sizeof(c)) // the library writes only what struct_size covers
	var part C.uint32_t
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_mesh_sync(p, arr, C.size_t(len(parts)), &c, &part)
	})
	runtime.KeepAlive(m)
	runtime.KeepAlive(parts)
	if closed != nil {
		return MeshInfo{}, closed
	}
	if err != nil {
		return MeshInfo{}, err
	}
	info := MeshInfo{SyncInfo: syncInfo(&c), OverflowPart: -1}
	if part != math.MaxUint32 {
		info.OverflowPart = int(part)
	}
	return info, nil
}

// EndMicrobatch ends the open micro-batch of each of this rank's accumulators (DROP_MICROBATCH,
// fed tensor by tensor), its drop agreed over the world first (gradacc_mesh_end_microbatch):
// every rank calls it once per micro-batch. kept reports whether this rank kept it. A closed
// accumulator is passed on as NULL, so that the library fails every rank; its error is returned.
func (m *Mesh) EndMicrobatch(accumulators ...*Accumulator) (kept bool, err error) {
	p, err := m.handle()
	if err != nil {
		return false, err
	}
	// The handles are C pointers, so a Go slice of them may be passed to C as is.
	raw := make([]*C.gradacc_accumulator_t, max(len(accumulators), 1))
	var closed error
	for i, a := range accumulators {
		raw[i] = a.orNil()
		if closed == nil {
			closed = a.closedErr()
		}
	}
	var out C.uint32_t
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_mesh_end_microbatch(p, &raw[0], C.size_t(len(accumulators)), &out)
	})
	runtime.KeepAlive(m)
	runtime.KeepAlive(accumulators)
	if closed != nil {
		return false, closed
	}
	return out == 1, err
}

// orNil is the handle, or nil for a nil or closed Accumulator.
func (a *Accumulator) orNil() *C.gradacc_accumulator_t {
	if a == nil {
		return nil
	}
	return a.ptr
}

// closedErr is the binding's error for a closed Accumulator; nil for an open or a nil one.
func (a *Accumulator) closedErr() error {
	if a == nil || a.ptr != nil {
		return nil
	}
	_, err := a.handle()
	return err
}

// closedErr is the binding's error for a closed Comm; nil for an open or a nil one.
func (c *Comm) closedErr() error {
	if c == nil || c.ptr != nil {
		return nil
	}
	_, err := c.handle()
	return err
}

// MeshGroup is where a rank sits in its group over some axes: the group's smallest world rank
// (Color, a split's color), the rank's index in it (Key: its rank there) and the group's Size.
type MeshGroup struct {
	Color, Key, Size uint32
}

// MeshShape is a mesh's shape (gradacc_mesh_shape_t), for frameworks without their own parallel
// state: each rank's groups in Megatron-Core's rank order or any other. Axis lists are names
// joined by '-': "cp-dp" (the data axes), "tp", "edp".
type MeshShape struct {
	ptr *C.gradacc_mesh_shape_t
}

// NewMeshShape creates the shape of a mesh of worldSize ranks: tp, pp and cp ranks on those axes
// (data parallel takes the rest), the experts of each pipeline stage over ep x etp of its ranks.
// order is the dense axes' rank order, fastest first ("" for Megatron-Core's "tp-cp-dp-pp").
func NewMeshShape(worldSize, tp, pp, cp, ep, etp uint32, order string) (*MeshShape, error) {
	var corder *C.char
	if order != "" {
		corder = C.CString(order)
		defer C.free(unsafe.Pointer(corder))
	}
	var p *C.gradacc_mesh_shape_t
	err := call(func() C.enum_gradacc_status_t {
		return C.gradacc_mesh_shape_create(C.uint32_t(worldSize), C.uint32_t(tp), C.uint32_t(pp), C.uint32_t(cp),
			C.uint32_t(ep), C.uint32_t(etp), corder, &p)
	})
	if err != nil {
		return nil, err
	}
	s := &MeshShape{ptr: p}
	runtime.SetFinalizer(s, (*MeshShape).Close)
	return s, nil
}

// Close destroys the shape. Calling it again does nothing.
func (s *MeshShape) Close() error {
	if s.ptr == nil {
		return nil
	}
	runtime.SetFinalizer(s, nil)
	p := s.ptr
	s.ptr = nil
	return call(func() C.enum_gradacc_status_t { return C.gradacc_mesh_shape_destroy(p) })
}

func (s *MeshShape) handle() (*C.gradacc_mesh_shape_t, error) {
	if s == nil || s.ptr == nil {
		return nil, &Error{Status: StatusInvalidHandle, Message: "the MeshShape is closed"}
	}
	return s.ptr, nil
}

// Group is world rank rank's group over axes. For NewMesh, dataRank and dataSize are the Key and
// the Size over "cp-dp".
func (s *MeshShape) Group(rank uint32, axes string) (MeshGroup, error) {
	p, err := s.handle()
	if err != nil {
		return MeshGroup{}, err
	}
	caxes := C.CString(axes)
	defer C.free(unsafe.Pointer(caxes))
	var color, key, size C.uint32_t
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_mesh_shape_group(p, C.uint32_t(rank), caxes, &color, &key, &size)
	})
	runtime.KeepAlive(s)
	return MeshGroup{Color: uint32(color), Key: uint32(key), Size: uint32(size)}, err
}

// Split is this rank's group over axes, split from world (an MPI communicator of every rank of
// the mesh, ranked as the world). Collective: every rank calls it with the same axes.
func (s *MeshShape) Split(world *Comm, axes string) (*Comm, error) {
	p, err := s.handle()
	if err != nil {
		return nil, err
	}
	wp, err := world.handle()
	if err != nil {
		return nil, err
	}
	caxes := C.CString(axes)
	defer C.free(unsafe.Pointer(caxes))
	var out *C.gradacc_comm_t
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_mesh_shape_split(p, wp, caxes, &out) })
	runtime.KeepAlive(s)
	runtime.KeepAlive(world)
	if err != nil {
		return nil, err
	}
	return newComm(out), nil
}
