package gradacc

// #include <stdlib.h>
// #include <gradacc.h>
import "C"

import (
	"fmt"
	"math"
	"runtime"
	"time"
	"unsafe"
)

// ScalerConfig is gradacc_scaler_config_t; start from DefaultScalerConfig.
type ScalerConfig struct {
	InitScale             float32
	GrowthFactor          float32
	BackoffFactor         float32
	GrowthInterval        uint32
	Hysteresis            uint32
	ConsecutiveHysteresis bool
	MinScale              float32
	MaxScale              float32
	Dynamic               bool
}

// DefaultScalerConfig is gradacc_scaler_config_default.
func DefaultScalerConfig() ScalerConfig {
	var c C.gradacc_scaler_config_t
	if err := call(func() C.enum_gradacc_status_t { return C.gradacc_scaler_config_default(&c) }); err != nil {
		panic(err) // cannot fail: a non-NULL output is its only requirement
	}
	return ScalerConfig{
		InitScale: float32(c.init_scale), GrowthFactor: float32(c.growth_factor),
		BackoffFactor: float32(c.backoff_factor), GrowthInterval: uint32(c.growth_interval),
		Hysteresis: uint32(c.hysteresis), ConsecutiveHysteresis: bool(c.consecutive_hysteresis),
		MinScale: float32(c.min_scale), MaxScale: float32(c.max_scale), Dynamic: bool(c.dynamic),
	}
}

func (s *ScalerConfig) c() C.gradacc_scaler_config_t {
	var c C.gradacc_scaler_config_t
	C.gradacc_scaler_config_default(&c) // struct_size, and any field this binding does not know yet
	c.init_scale = C.float(s.InitScale)
	c.growth_factor = C.float(s.GrowthFactor)
	c.backoff_factor = C.float(s.BackoffFactor)
	c.growth_interval = C.uint32_t(s.GrowthInterval)
	c.hysteresis = C.uint32_t(s.Hysteresis)
	c.consecutive_hysteresis = cBool(s.ConsecutiveHysteresis)
	c.min_scale = C.float(s.MinScale)
	c.max_scale = C.float(s.MaxScale)
	c.dynamic = cBool(s.Dynamic)
	return c
}

// AccumulatorConfig is gradacc_accumulator_config_t; start from DefaultAccumulatorConfig.
type AccumulatorConfig struct {
	LossReduction LossReduction
	Normalize     Normalize
	MaxGradNorm   float32
	BucketNumel   uint64
	Threads       uint32
	// Sharding is the boundary's policy (default ShardingNone). With ShardingReduceScatter,
	// Sync takes a communicator of ShardCount ranks on which this is rank ShardRank, and
	// SyncHybrid such a shard group and a replica group. ShardingAccumulate (sharded
	// accumulation) takes that communicator at creation: NewShardedAccumulator.
	Sharding   Sharding
	ShardCount uint32 // default 1; must be 1 without sharding
	ShardRank  uint32 // default 0; below ShardCount
	// WireDType is what the reductions send (default F32, or BF16).
	WireDType DType
	// Overflow is what a non-finite gradient value costs (default OverflowSkipStep); a value
	// that is neither constant fails creation with StatusInvalidArgument.
	Overflow Overflow
	// TensorStats has every boundary also measure each tensor, read with
	// Accumulator.TensorStats (default false), on every device and sharding policy.
	// docs/overflow.md states the contract.
	TensorStats bool
}

// DefaultAccumulatorConfig is gradacc_accumulator_config_default.
func DefaultAccumulatorConfig() AccumulatorConfig {
	var c C.gradacc_accumulator_config_t
	if err := call(func() C.enum_gradacc_status_t { return C.gradacc_accumulator_config_default(&c) }); err != nil {
		panic(err)
	}
	return AccumulatorConfig{
		LossReduction: LossReduction(c.loss_reduction), Normalize: Normalize(c.normalize),
		MaxGradNorm: float32(c.max_grad_norm), BucketNumel: uint64(c.bucket_numel), Threads: uint32(c.threads),
		Sharding: Sharding(c.sharding), ShardCount: uint32(c.shard_count), ShardRank: uint32(c.shard_rank),
		WireDType: DType(c.wire_dtype), Overflow: Overflow(c.overflow), TensorStats: c.tensor_stats != 0,
	}
}

func (a *AccumulatorConfig) c() C.gradacc_accumulator_config_t {
	var c C.gradacc_accumulator_config_t
	C.gradacc_accumulator_config_default(&c)
	c.loss_reduction = C.gradacc_loss_reduction_t(a.LossReduction)
	c.normalize = C.gradacc_normalize_t(a.Normalize)
	c.max_grad_norm = C.float(a.MaxGradNorm)
	c.bucket_numel = C.uint64_t(a.BucketNumel)
	c.threads = C.uint32_t(a.Threads)
	c.sharding = C.gradacc_sharding_t(a.Sharding)
	c.shard_count = C.uint32_t(a.ShardCount)
	c.shard_rank = C.uint32_t(a.ShardRank)
	c.wire_dtype = C.gradacc_dtype_t(a.WireDType)
	c.overflow = C.gradacc_overflow_t(a.Overflow)
	c.tensor_stats = 0
	if a.TensorStats {
		c.tensor_stats = 1
	}
	return c
}

// TensorDesc declares one tensor of an accumulator.
type TensorDesc struct {
	Numel uint64
	DType DType
}

// SyncInfo is what the boundary reports; identical on every rank.
type SyncInfo struct {
	FoundInf     bool
	TotalCount   uint64
	Microbatches uint64
	GradNorm     float64
	ClipCoef     float64
	// DroppedMicrobatches counts the micro-batches dropped over all ranks under
	// OverflowDropMicrobatch; TotalCount and Microbatches leave them out.
	DroppedMicrobatches uint64
	// OverflowAt says where the window first went non-finite, first in the order micro-batch,
	// then tensor, then rank. With OverflowAtGradient, OverflowRank, OverflowMicrobatch (of
	// that rank's window, dropped ones included) and OverflowTensor say where, counted from 0;
	// they are 0 otherwise. docs/overflow.md states the contract.
	OverflowAt         OverflowAt
	OverflowRank       int
	OverflowMicrobatch uint64
	OverflowTensor     int
}

func syncInfo(c *C.gradacc_sync_info_t) SyncInfo {
	return SyncInfo{
		FoundInf: bool(c.found_inf), TotalCount: uint64(c.total_count), Microbatches: uint64(c.microbatches),
		GradNorm: float64(c.grad_norm), ClipCoef: float64(c.clip_coef),
		DroppedMicrobatches: uint64(c.dropped_microbatches), OverflowAt: OverflowAt(c.overflow_at),
		OverflowRank: int(c.overflow_rank), OverflowMicrobatch: uint64(c.overflow_microbatch),
		OverflowTensor: int(c.overflow_tensor),
	}
}

// TensorStats is one tensor's telemetry of the last boundary (Accumulator.TensorStats), the same
// on every rank.
type TensorStats struct {
	// GradNorm is the L2 norm of the tensor's reduced, normalised gradient, before clipping.
	GradNorm float64
	// NonfiniteMicrobatches counts the micro-batches, over every rank, in which the tensor held
	// a non-finite value (dropped ones included).
	NonfiniteMicrobatches uint64
}

// ScalerStats counts a scaler's steps.
type ScalerStats struct {
	Steps, SkippedSteps, Growths, Backoffs uint64
}

// Grad is one gradient buffer handed to Add, AddTensor or Bind: build it with Float32s, Words16
// or Pointer. It borrows the memory for the duration of the call only (Bind: until the
// BoundGrads is closed).
type Grad struct {
	ptr   unsafe.Pointer
	numel int
	f32   bool // a []float32; otherwise 16-bit words or a raw pointer
	raw   bool
}

// Float32s is an f32 gradient.
func Float32s(g []float32) Grad {
	var p unsafe.Pointer
	if len(g) > 0 {
		p = unsafe.Pointer(&g[0])
	}
	return Grad{ptr: p, numel: len(g), f32: true}
}

// Words16 is an fp16 or bf16 gradient as raw 16-bit words (whichever the tensor was declared).
func Words16(g []uint16) Grad {
	var p unsafe.Pointer
	if len(g) > 0 {
		p = unsafe.Pointer(&g[0])
	}
	return Grad{ptr: p, numel: len(g)}
}

// Pointer is numel elements of the tensor's declared dtype at p: C memory, or a device pointer
// for a CUDA accumulator. gradacc cannot check what lies there.
func Pointer(p unsafe.Pointer, numel int) Grad {
	return Grad{ptr: p, numel: numel, raw: true}
}

// fits is check's test alone: the hot path tests each gradient without building its name.
func (g Grad) fits(want TensorDesc) bool {
	return (g.raw || g.f32 == (want.DType == F32)) && uint64(g.numel) == want.Numel
}

func (g Grad) check(what string, want TensorDesc) error {
	if !g.raw && g.f32 != (want.DType == F32) {
		kind := "[]uint16"
		if g.f32 {
			kind = "[]float32"
		}
		return &Error{Status: StatusDTypeMismatch, Message: fmt.Sprintf("%s is a %s, but the tensor is declared %s", what, kind, want.DType)}
	}
	if uint64(g.numel) != want.Numel {
		return &Error{Status: StatusSizeMismatch, Message: fmt.Sprintf("%s has %d elements, but the tensor has %d", what, g.numel, want.Numel)}
	}
	return nil
}

// ---- Scaler ---------------------------------------------------------------------------------

// Scaler is a dynamic loss scaler. Its methods may be used from several goroutines, as the C API
// allows; Close must come after every other call has returned.
type Scaler struct {
	ptr *C.gradacc_scaler_t
}

// NewScaler creates a scaler; a nil config means the defaults, a nil device the CPU.
func NewScaler(config *ScalerConfig, device *Device) (*Scaler, error) {
	var cfg *C.gradacc_scaler_config_t
	if config != nil {
		c := config.c()
		cfg = &c
	}
	dev := device.c()
	var p *C.gradacc_scaler_t
	if err := call(func() C.enum_gradacc_status_t { return C.gradacc_scaler_create(cfg, &dev, &p) }); err != nil {
		return nil, err
	}
	s := &Scaler{ptr: p}
	runtime.SetFinalizer(s, (*Scaler).Close)
	return s, nil
}

// Close destroys the scaler. Calling it again does nothing.
func (s *Scaler) Close() error {
	if s.ptr == nil {
		return nil
	}
	runtime.SetFinalizer(s, nil)
	p := s.ptr
	s.ptr = nil
	return call(func() C.enum_gradacc_status_t { return C.gradacc_scaler_destroy(p) })
}

func (s *Scaler) handle() (*C.gradacc_scaler_t, error) {
	if s == nil || s.ptr == nil {
		return nil, &Error{Status: StatusInvalidHandle, Message: "the Scaler is closed"}
	}
	return s.ptr, nil
}

// Scale is the current loss scale.
func (s *Scaler) Scale() (float32, error) {
	p, err := s.handle()
	if err != nil {
		return 0, err
	}
	var out C.float
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_scaler_scale(p, &out) })
	runtime.KeepAlive(s)
	return float32(out), err
}

// ScaleLoss multiplies f32 loss values in place by the current scale.
func (s *Scaler) ScaleLoss(loss []float32) error {
	if len(loss) == 0 {
		return s.ScaleLossPointer(nil, 0, F32)
	}
	return s.ScaleLossPointer(unsafe.Pointer(&loss[0]), len(loss), F32)
}

// ScaleLoss16 multiplies fp16 or bf16 (dtype) loss words in place by the current scale.
func (s *Scaler) ScaleLoss16(loss []uint16, dtype DType) error {
	if len(loss) == 0 {
		return s.ScaleLossPointer(nil, 0, dtype)
	}
	return s.ScaleLossPointer(unsafe.Pointer(&loss[0]), len(loss), dtype)
}

// ScaleLossPointer multiplies numel loss values of dtype at loss in place by the current scale.
func (s *Scaler) ScaleLossPointer(loss unsafe.Pointer, numel int, dtype DType) error {
	p, err := s.handle()
	if err != nil {
		return err
	}
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_scaler_scale_loss(p, loss, C.size_t(numel), C.gradacc_dtype_t(dtype))
	})
	runtime.KeepAlive(s)
	return err
}

// Update ends an optimizer step from the synced accumulators; skipped means: skip the step.
func (s *Scaler) Update(accumulators ...*Accumulator) (skipped bool, err error) {
	p, err := s.handle()
	if err != nil {
		return false, err
	}
	// The handles are C pointers, so a Go slice of them may be passed to C as is.
	raw := make([]*C.gradacc_accumulator_t, len(accumulators))
	for i, a := range accumulators {
		if raw[i], err = a.handle(); err != nil {
			return false, err
		}
	}
	var arr **C.gradacc_accumulator_t
	if len(raw) > 0 {
		arr = &raw[0]
	}
	var out C.bool
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_scaler_update(p, arr, C.size_t(len(raw)), &out)
	})
	runtime.KeepAlive(s)
	runtime.KeepAlive(accumulators)
	return bool(out), err
}

// Stats reads the scaler's statistics.
func (s *Scaler) Stats() (ScalerStats, error) {
	p, err := s.handle()
	if err != nil {
		return ScalerStats{}, err
	}
	var c C.gradacc_scaler_stats_t
	c.struct_size = C.size_t(unsafe.Sizeof(c)) // the library writes only what struct_size covers
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_scaler_stats(p, &c) })
	runtime.KeepAlive(s)
	return ScalerStats{uint64(c.steps), uint64(c.skipped_steps), uint64(c.growths), uint64(c.backoffs)}, err
}

// Save returns the scaler's complete state as versioned bytes.
func (s *Scaler) Save() ([]byte, error) {
	p, err := s.handle()
	if err != nil {
		return nil, err
	}
	var n C.size_t
	if err = call(func() C.enum_gradacc_status_t { return C.gradacc_scaler_save(p, nil, 0, &n) }); err != nil {
		return nil, err
	}
	buf := make([]byte, int(n)+1) // +1: never a zero-length slice to index
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_scaler_save(p, (*C.uint8_t)(unsafe.Pointer(&buf[0])), n, &n)
	})
	runtime.KeepAlive(s)
	return buf[:n], err
}

// Load restores a state written by Save.
func (s *Scaler) Load(state []byte) error {
	p, err := s.handle()
	if err != nil {
		return err
	}
	ptr := bytesArg(state)
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_scaler_load(p, ptr, C.size_t(len(state))) })
	runtime.KeepAlive(s)
	return err
}

// ---- Accumulator ----------------------------------------------------------------------------

// Accumulator holds the FP32 master gradients of a list of tensors. Calls on one accumulator must
// not overlap, except AddTensor (see gradacc_accumulator_add_tensor).
type Accumulator struct {
	ptr     *C.gradacc_accumulator_t
	tensors []TensorDesc
	// comm is a sharded accumulation's communicator, referenced for as long as the accumulator
	// (the C accumulator holds its own reference to the group, so closing comm is harmless).
	comm *Comm
}

// creationArgs are the C arguments every constructor shares: the config (nil for the
// defaults), the tensor descriptions and the device.
func creationArgs(tensors []TensorDesc, config *AccumulatorConfig, device *Device) (*C.gradacc_accumulator_config_t, []C.gradacc_tensor_desc_t, C.gradacc_device_t) {
	var cfg *C.gradacc_accumulator_config_t
	if config != nil {
		c := config.c()
		cfg = &c
	}
	descs := make([]C.gradacc_tensor_desc_t, len(tensors)+1) // +1: a valid pointer even for none
	for i, t := range tensors {
		descs[i].numel = C.uint64_t(t.Numel)
		descs[i].dtype = C.gradacc_dtype_t(t.DType)
	}
	return cfg, descs, device.c()
}

// MasterAlign is the alignment, in bytes, of every tensor's FP32 master in the flat master
// (GRADACC_MASTER_ALIGN): tensor i starts at Accumulator.Offset(i), a multiple of MasterAlign / 4
// elements, with zeros between tensors.
const MasterAlign = C.GRADACC_MASTER_ALIGN

// MasterNumel returns the flat master's length, in float32 elements, of an accumulator over
// tensors: each tensor at a multiple of MasterAlign bytes, zeros between and after the last.
func MasterNumel(tensors []TensorDesc) (int, error) {
	_, descs, _ := creationArgs(tensors, nil, nil)
	var n C.size_t
	err := call(func() C.enum_gradacc_status_t {
		return C.gradacc_accumulator_master_numel(&descs[0], C.size_t(len(tensors)), &n)
	})
	if err != nil {
		return 0, err
	}
	return int(n), nil
}

// NewAccumulator creates an accumulator; a nil config means the defaults, a nil device the CPU.
func NewAccumulator(tensors []TensorDesc, config *AccumulatorConfig, device *Device) (*Accumulator, error) {
	cfg, descs, dev := creationArgs(tensors, config, device)
	var p *C.gradacc_accumulator_t
	err := call(func() C.enum_gradacc_status_t {
		return C.gradacc_accumulator_create(cfg, &descs[0], C.size_t(len(tensors)), &dev, &p)
	})
	if err != nil {
		return nil, err
	}
	return newAccumulator(p, tensors, nil), nil
}

// NewShardedAccumulator creates a sharded accumulation (ZeRO-2,
// gradacc_accumulator_create_sharded): config.Sharding is ShardingAccumulate and comm a
// communicator of config.ShardCount ranks on which this is rank config.ShardRank. The accumulator
// holds only its shard (Shard), and every micro-batch and Sync is a collective over comm, each
// rank calling from its own goroutine. docs/sharding.md ("Sharded accumulation (ZeRO-2)") states
// the contract: what each rank holds, the calls every rank makes, how a failure ends and what the
// result equals. In Go a failure the library reports is an *Error whose Status is the page's
// (StatusPeerFailure for GRADACC_STATUS_PEER_FAILURE); the binding's own checks in Add and Sync
// (gradient count or length, a closed Scaler or Comm, foreign BoundGrads) fail here and still fail
// the other ranks at once. The accumulator keeps comm referenced until Close, and the library
// keeps the group: closing comm first releases only its handle, and Sync(nil) goes on without it.
func NewShardedAccumulator(tensors []TensorDesc, config *AccumulatorConfig, comm *Comm, device *Device) (*Accumulator, error) {
	cfg, descs, dev := creationArgs(tensors, config, device)
	var cp *C.gradacc_comm_t // nil: the C call names the missing argument
	if comm != nil {
		var err error
		if cp, err = comm.handle(); err != nil {
			return nil, err
		}
	}
	var p *C.gradacc_accumulator_t
	err := call(func() C.enum_gradacc_status_t {
		return C.gradacc_accumulator_create_sharded(cfg, &descs[0], C.size_t(len(tensors)), &dev, cp, &p)
	})
	runtime.KeepAlive(comm)
	if err != nil {
		return nil, err
	}
	return newAccumulator(p, tensors, comm), nil
}

func newAccumulator(p *C.gradacc_accumulator_t, tensors []TensorDesc, comm *Comm) *Accumulator {
	a := &Accumulator{ptr: p, tensors: append([]TensorDesc(nil), tensors...), comm: comm}
	runtime.SetFinalizer(a, (*Accumulator).Close)
	return a
}

// Close destroys the accumulator; slices from Master become invalid. Calling it again does nothing.
func (a *Accumulator) Close() error {
	if a.ptr == nil {
		return nil
	}
	runtime.SetFinalizer(a, nil)
	p := a.ptr
	a.ptr = nil
	a.comm = nil
	return call(func() C.enum_gradacc_status_t { return C.gradacc_accumulator_destroy(p) })
}

func (a *Accumulator) handle() (*C.gradacc_accumulator_t, error) {
	if a == nil || a.ptr == nil {
		return nil, &Error{Status: StatusInvalidHandle, Message: "the Accumulator is closed"}
	}
	return a.ptr, nil
}

// Tensors returns the declared tensors.
func (a *Accumulator) Tensors() []TensorDesc { return append([]TensorDesc(nil), a.tensors...) }

// checkGrads checks one gradient per tensor, each against its tensor (Add and Bind).
func (a *Accumulator) checkGrads(grads []Grad) error {
	if len(grads) != len(a.tensors) {
		return &Error{Status: StatusSizeMismatch, Message: fmt.Sprintf("%d gradients for %d tensors", len(grads), len(a.tensors))}
	}
	for i, g := range grads {
		if !g.fits(a.tensors[i]) {
			return g.check(fmt.Sprintf("grads[%d]", i), a.tensors[i])
		}
	}
	return nil
}

// Add adds one micro-batch of count items: grads[i] is tensor i's gradient. It checks and pins
// every gradient on each call; a loop that passes the same buffers every micro-batch binds them
// once with Bind and calls AddBound.
func (a *Accumulator) Add(s *Scaler, grads []Grad, count uint64) error {
	return a.add(s, grads, count, false)
}

// AddFinal is Add for the window's last micro-batch, which the boundary follows: on the CPU the
// add also measures the norm, so a boundary that reduces nothing between ranks reads the master
// no more. The same bits as Add (docs/optimizer.md, "The norm inside the last add").
func (a *Accumulator) AddFinal(s *Scaler, grads []Grad, count uint64) error {
	return a.add(s, grads, count, true)
}

// add is Add, or with last AddFinal.
func (a *Accumulator) add(s *Scaler, grads []Grad, count uint64, last bool) error {
	p, err := a.handle()
	if err != nil {
		return err
	}
	sp, err := s.handle()
	if err != nil {
		return a.refuseAdd(p, s, err)
	}
	if err := a.checkGrads(grads); err != nil {
		return a.refuseAdd(p, s, err)
	}
	// The C call takes an array of pointers; Go memory passed to C may only hold pinned pointers.
	var pin runtime.Pinner
	defer pin.Unpin()
	ptrs := make([]unsafe.Pointer, len(grads)+1)
	for i, g := range grads {
		if g.ptr != nil {
			pin.Pin(g.ptr) // does nothing for C or device memory
		}
		ptrs[i] = g.ptr
	}
	err = call(func() C.enum_gradacc_status_t {
		if last {
			return C.gradacc_accumulator_add_final(p, sp, &ptrs[0], C.size_t(len(grads)), C.uint64_t(count))
		}
		return C.gradacc_accumulator_add(p, sp, &ptrs[0], C.size_t(len(grads)), C.uint64_t(count))
	})
	runtime.KeepAlive(a)
	runtime.KeepAlive(s)
	runtime.KeepAlive(grads)
	return err
}

// refuseAdd returns err, the binding's own refusal of an Add or AddBound on the open accumulator
// p, after a C add that the library refuses on every rank (no gradients): a sharded
// accumulation's other ranks are already in this micro-batch's reduction and fail at once,
// instead of waiting until their timeout. For any other accumulator that call only fails here.
func (a *Accumulator) refuseAdd(p *C.gradacc_accumulator_t, s *Scaler, err error) error {
	var sp *C.gradacc_scaler_t // the scaler's handle if it is open, else nil
	if s != nil {
		sp = s.ptr
	}
	C.gradacc_accumulator_add(p, sp, nil, 0, 0)
	runtime.KeepAlive(a)
	runtime.KeepAlive(s)
	return err
}

// BoundGrads is one gradient per tensor of an accumulator, checked once by Bind for AddBound.
// It references the buffers, never copies them: AddBound reads what they hold when it is
// called. Until Close, the buffers' Go memory stays pinned (the garbage collector neither moves
// nor frees it) and their addresses stay in C memory. Close must come after every AddBound that
// uses it has returned; like the other objects, it has a finalizer if Close is never called.
type BoundGrads struct {
	acc  *Accumulator
	ptrs *unsafe.Pointer // n addresses in C memory (C.malloc); nil once closed
	n    int
	pin  runtime.Pinner
}

// Bind checks grads against the accumulator's tensors as Add does (same errors), pins their Go
// memory and stores their addresses in C memory, once: a training loop whose backward writes
// into the same buffers every micro-batch passes the result to AddBound, which is then one C
// call. Close the result when the buffers change or are no longer used.
func (a *Accumulator) Bind(grads []Grad) (*BoundGrads, error) {
	if _, err := a.handle(); err != nil {
		return nil, err
	}
	if err := a.checkGrads(grads); err != nil {
		return nil, err
	}
	n := len(grads)
	// C memory may hold Go pointers while their objects are pinned (runtime.Pinner).
	mem := C.malloc(C.size_t(max(n, 1)) * C.size_t(unsafe.Sizeof(unsafe.Pointer(nil))))
	if mem == nil {
		return nil, &Error{Status: StatusOutOfMemory, Message: fmt.Sprintf("no memory for the addresses of %d gradients", n)}
	}
	b := &BoundGrads{acc: a, ptrs: (*unsafe.Pointer)(mem), n: n}
	addrs := unsafe.Slice(b.ptrs, n)
	for i, g := range grads {
		if g.ptr != nil {
			b.pin.Pin(g.ptr) // does nothing for C or device memory
		}
		addrs[i] = g.ptr
	}
	runtime.SetFinalizer(b, (*BoundGrads).Close)
	return b, nil
}

// Close unpins the buffers and frees the addresses. Calling it again does nothing.
func (b *BoundGrads) Close() error {
	if b.ptrs == nil {
		return nil
	}
	runtime.SetFinalizer(b, nil)
	C.free(unsafe.Pointer(b.ptrs))
	b.ptrs = nil
	b.acc = nil
	b.pin.Unpin()
	return nil
}

// AddBound adds one micro-batch of count items from the buffers bound by Bind, as Add(s, grads,
// count) with the same buffers does, in one C call. A closed BoundGrads fails with
// StatusInvalidHandle, one bound by another accumulator with StatusInvalidArgument.
func (a *Accumulator) AddBound(s *Scaler, b *BoundGrads, count uint64) error {
	p, err := a.handle()
	if err != nil {
		return err
	}
	sp, err := s.handle()
	if err != nil {
		return a.refuseAdd(p, s, err)
	}
	if b == nil || b.ptrs == nil {
		return a.refuseAdd(p, s, &Error{Status: StatusInvalidHandle, Message: "argument `b`: the BoundGrads is closed"})
	}
	if b.acc != a {
		return a.refuseAdd(p, s, &Error{Status: StatusInvalidArgument, Message: "argument `b`: the BoundGrads was bound by another Accumulator"})
	}
	ptrs, n := b.ptrs, b.n
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_accumulator_add(p, sp, ptrs, C.size_t(n), C.uint64_t(count))
	})
	runtime.KeepAlive(a)
	runtime.KeepAlive(s)
	runtime.KeepAlive(b)
	return err
}

// addBare is AddBound's C call alone: no checks, no thread lock, no message. The benchmarks
// measure the binding's overhead against it (a _test.go file cannot use cgo).
func (a *Accumulator) addBare(s *Scaler, b *BoundGrads, count uint64) Status {
	st := C.gradacc_accumulator_add(a.ptr, s.ptr, b.ptrs, C.size_t(b.n), C.uint64_t(count))
	runtime.KeepAlive(a)
	runtime.KeepAlive(s)
	runtime.KeepAlive(b)
	return Status(st)
}

// BeginMicrobatch opens a micro-batch of count items whose gradients arrive through AddTensor.
func (a *Accumulator) BeginMicrobatch(count uint64) error {
	p, err := a.handle()
	if err != nil {
		return err
	}
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_accumulator_begin_microbatch(p, C.uint64_t(count)) })
	runtime.KeepAlive(a)
	return err
}

// AddTensor adds one contribution to tensor index of the open micro-batch. It may run
// concurrently with AddTensor calls from other goroutines on the same accumulator.
func (a *Accumulator) AddTensor(s *Scaler, index int, g Grad) error {
	p, err := a.handle()
	if err != nil {
		return err
	}
	sp, err := s.handle()
	if err != nil {
		return a.refuseTensor(p, s, err)
	}
	if index >= 0 && index < len(a.tensors) && !g.raw && g.f32 != (a.tensors[index].DType == F32) {
		return a.refuseTensor(p, s, g.check("grad", a.tensors[index]))
	}
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_accumulator_add_tensor(p, sp, C.size_t(index), g.ptr, C.size_t(g.numel))
	})
	runtime.KeepAlive(a)
	runtime.KeepAlive(s)
	return err
}

// refuseTensor returns err after AddTensor's own checks refused its arguments, making first a C
// add_tensor that the library refuses (no gradient): a sharded accumulation's micro-batch then
// fails on every rank when it ends, instead of summing this tensor as zeros on the others.
// Elsewhere it only fails here (its status is dropped).
func (a *Accumulator) refuseTensor(p *C.gradacc_accumulator_t, s *Scaler, err error) error {
	var sp *C.gradacc_scaler_t // the scaler's handle if it is open, else nil
	if s != nil {
		sp = s.ptr
	}
	C.gradacc_accumulator_add_tensor(p, sp, 0, nil, 0)
	runtime.KeepAlive(a)
	runtime.KeepAlive(s)
	return err
}

// EndMicrobatch closes the open micro-batch.
func (a *Accumulator) EndMicrobatch() error {
	p, err := a.handle()
	if err != nil {
		return err
	}
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_accumulator_end_microbatch(p) })
	runtime.KeepAlive(a)
	return err
}

// Sync is the boundary. With a communicator every rank calls it, each from its own goroutine;
// nil is the single-process boundary, or for a sharded accumulation (NewShardedAccumulator) the
// boundary over its own communicator, the only other one it takes (another fails there with
// StatusInvalidArgument and on the other ranks with StatusPeerFailure).
func (a *Accumulator) Sync(comm *Comm) (SyncInfo, error) {
	return a.syncWith(comm, false)
}

// SyncForStep is Sync for an Optimizer that steps right after: the clip coefficient is applied
// inside the step's pass (bitwise as after Sync), saving a pass over the gradient, so Master and
// Shard then hold the sum before normalisation and clipping (the step applies both as one factor): read the reduced gradient yourself only
// after Sync (gradacc_accumulator_sync_for_step).
func (a *Accumulator) SyncForStep(comm *Comm) (SyncInfo, error) {
	return a.syncWith(comm, true)
}

func (a *Accumulator) syncWith(comm *Comm, forStep bool) (SyncInfo, error) {
	p, err := a.handle()
	if err != nil {
		return SyncInfo{}, err
	}
	var cp *C.gradacc_comm_t
	if comm != nil {
		if cp, err = comm.handle(); err != nil {
			// A sharded accumulation's other ranks are already in the boundary: a C sync with
			// struct_size 0 is refused on every rank, so they fail at once.
			var bad C.gradacc_sync_info_t
			C.gradacc_accumulator_sync(p, nil, &bad)
			runtime.KeepAlive(a)
			return SyncInfo{}, err
		}
	}
	var c C.gradacc_sync_info_t
	c.struct_size = C.size_t(unsafe.Sizeof(c)) // the library writes only what struct_size covers
	err = call(func() C.enum_gradacc_status_t {
		if forStep {
			return C.gradacc_accumulator_sync_for_step(p, cp, &c)
		}
		return C.gradacc_accumulator_sync(p, cp, &c)
	})
	runtime.KeepAlive(a)
	runtime.KeepAlive(comm)
	if err != nil {
		return SyncInfo{}, err
	}
	return syncInfo(&c), nil
}

// SyncHybrid is the hybrid boundary (HSDP) of an accumulator with ShardingReduceScatter or
// ShardingAccumulate: a reduce-scatter over shard (its shard group: ShardCount ranks, this one
// ShardRank; for a sharded accumulation, its own communicator, which reduced every micro-batch
// already), then an all-reduce of the shard over replicas, the ranks holding the same shard in
// the other shard groups. Every rank of both groups calls it, each from its own goroutine. Counts, overflow and
// the norm are the whole grid's, the same on every rank, and replicas hold the same bits (Shard).
// Replica groups pairing different shards fail with StatusSizeMismatch, and an unsharded
// accumulator with StatusInvalidArgument, on every rank with the window intact; which
// communicators a device takes: gradacc_accumulator_sync_hybrid. A nil or closed Accumulator or
// Comm still reaches the C call, which fails this rank (StatusNullArgument) and takes part in the
// other group's exchange, so its ranks fail too instead of waiting.
func (a *Accumulator) SyncHybrid(shard, replicas *Comm) (SyncInfo, error) {
	var p *C.gradacc_accumulator_t
	if a != nil {
		p = a.ptr
	}
	var c C.gradacc_sync_info_t
	c.struct_size = C.size_t(unsafe.Sizeof(c)) // the library writes only what struct_size covers
	sp, rp := shard.orNil(), replicas.orNil()
	err := call(func() C.enum_gradacc_status_t { return C.gradacc_accumulator_sync_hybrid(p, sp, rp, &c) })
	runtime.KeepAlive(a)
	runtime.KeepAlive(shard)
	runtime.KeepAlive(replicas)
	if err != nil {
		return SyncInfo{}, err
	}
	return syncInfo(&c), nil
}

// Master returns tensor index's FP32 master gradient as a slice over gradacc's memory (no copy;
// host accumulators only). The slice is valid until the accumulator is closed, and the
// accumulator's finalizer closes it once the *Accumulator is unreachable, which the slice does
// not prevent: keep the accumulator alive while using the slice (runtime.KeepAlive(acc) after
// the last use), or use CopyMaster. Its contents are the boundary's result after Sync. A sharded
// accumulation holds only its shard: a tensor not wholly inside it fails with
// StatusInvalidArgument (use Shard).
func (a *Accumulator) Master(index int) ([]float32, error) {
	p, err := a.handle()
	if err != nil {
		return nil, err
	}
	var ptr *C.float
	var n C.size_t
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_accumulator_master(p, C.size_t(index), &ptr, &n) })
	runtime.KeepAlive(a)
	if err != nil {
		return nil, err
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(ptr)), int(n)), nil
}

// CopyMaster returns a copy of tensor index's FP32 master gradient.
func (a *Accumulator) CopyMaster(index int) ([]float32, error) {
	view, err := a.Master(index)
	if err != nil {
		return nil, err
	}
	out := append([]float32(nil), view...)
	runtime.KeepAlive(a)
	return out, nil
}

// Offset returns where tensor index starts in the flat master, in elements (a multiple of
// MasterAlign / 4): with Shard's range it tells which tensors a shard holds.
func (a *Accumulator) Offset(index int) (int, error) {
	p, err := a.handle()
	if err != nil {
		return 0, err
	}
	var at C.size_t
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_accumulator_offset(p, C.size_t(index), &at) })
	runtime.KeepAlive(a)
	if err != nil {
		return 0, err
	}
	return int(at), nil
}

// Shard returns this rank's shard of the FP32 master: its offset in the flat layout (the
// tensors one after another, each at Offset, zeros between) and a slice over its elements in gradacc's memory (no copy; host
// accumulators only), valid as Master's slices are. Without sharding it is the whole master.
// With ShardingReduceScatter, after a Sync only the shard holds the reduced gradient (the bits
// an unsharded Sync leaves there); the rest of the master is unspecified until the next window's
// first micro-batch. With ShardingAccumulate the shard is all the accumulator holds: the
// window's sum over the ranks while accumulating, the reduced gradient after Sync. Shards are
// cut in whole blocks of 4096 elements, so the last ones may be shorter or empty. The range
// never changes.
func (a *Accumulator) Shard() (offset int, shard []float32, err error) {
	p, err := a.handle()
	if err != nil {
		return 0, nil, err
	}
	var off, n C.size_t
	var ptr *C.float
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_accumulator_shard(p, &off, &n, &ptr) })
	runtime.KeepAlive(a)
	if err != nil {
		return 0, nil, err
	}
	return int(off), unsafe.Slice((*float32)(unsafe.Pointer(ptr)), int(n)), nil
}

// CopyShard returns Shard's offset and a copy of its elements.
func (a *Accumulator) CopyShard() (offset int, shard []float32, err error) {
	offset, view, err := a.Shard()
	if err != nil {
		return 0, nil, err
	}
	out := append([]float32(nil), view...)
	runtime.KeepAlive(a)
	return offset, out, nil
}

// Reset discards the window in progress.
func (a *Accumulator) Reset() error {
	p, err := a.handle()
	if err != nil {
		return err
	}
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_accumulator_reset(p) })
	runtime.KeepAlive(a)
	return err
}

// TensorStats returns each tensor's stats of the last boundary, in tensor order
// (gradacc_accumulator_tensor_stats); they last until the next window's first micro-batch. It
// fails with StatusWrongState when the config left TensorStats off, and before a Sync.
func (a *Accumulator) TensorStats() ([]TensorStats, error) {
	p, err := a.handle()
	if err != nil {
		return nil, err
	}
	n := len(a.tensors)
	norms, counts := make([]float64, max(n, 1)), make([]uint64, max(n, 1))
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_accumulator_tensor_stats(p, (*C.double)(unsafe.Pointer(&norms[0])),
			(*C.uint64_t)(unsafe.Pointer(&counts[0])), C.size_t(n))
	})
	runtime.KeepAlive(a)
	if err != nil {
		return nil, err
	}
	stats := make([]TensorStats, n)
	for i := range stats {
		stats[i] = TensorStats{GradNorm: norms[i], NonfiniteMicrobatches: counts[i]}
	}
	return stats, nil
}

// SaveWindow returns the window in progress as versioned bytes. A sharded accumulation saves its
// shard: the bytes load only into the same shard of an accumulation over as many ranks
// (anything else fails with StatusCorruptState).
func (a *Accumulator) SaveWindow() ([]byte, error) {
	p, err := a.handle()
	if err != nil {
		return nil, err
	}
	var n C.size_t
	if err = call(func() C.enum_gradacc_status_t { return C.gradacc_accumulator_save_window(p, nil, 0, &n) }); err != nil {
		return nil, err
	}
	buf := make([]byte, int(n)+1)
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_accumulator_save_window(p, (*C.uint8_t)(unsafe.Pointer(&buf[0])), n, &n)
	})
	runtime.KeepAlive(a)
	return buf[:n], err
}

// LoadWindow restores a window written by SaveWindow.
func (a *Accumulator) LoadWindow(state []byte) error {
	p, err := a.handle()
	if err != nil {
		return err
	}
	ptr := bytesArg(state)
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_accumulator_load_window(p, ptr, C.size_t(len(state))) })
	runtime.KeepAlive(a)
	return err
}

// MergeWindow adds a window written by SaveWindow (of an accumulator with the same tensors, on
// any rank or device) into the window in progress: masters, counts and micro-batches add,
// overflow flags OR, so windows saved on N ranks resume on M. Corrupt bytes fail with
// StatusCorruptState and leave the window unchanged.
func (a *Accumulator) MergeWindow(state []byte) error {
	p, err := a.handle()
	if err != nil {
		return err
	}
	ptr := bytesArg(state)
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_accumulator_merge_window(p, ptr, C.size_t(len(state)))
	})
	runtime.KeepAlive(a)
	return err
}

// ---- Comm -----------------------------------------------------------------------------------

// Comm is one rank's endpoint of a data-parallel group.
type Comm struct {
	ptr *C.gradacc_comm_t
}

// NewLocalGroup creates an in-process group of worldSize ranks, rank 0 first. Run each rank in
// its own goroutine; every rank must take part in every Sync.
func NewLocalGroup(worldSize int) ([]*Comm, error) {
	// Ranks and world sizes are int32_t in the C API; a value outside that range goes in as -1,
	// so the library reports it rather than a truncated size passing.
	n := C.int32_t(-1)
	if worldSize >= math.MinInt32 && worldSize <= math.MaxInt32 {
		n = C.int32_t(worldSize)
	}
	raw := make([]*C.gradacc_comm_t, 1)
	if n == C.int32_t(worldSize) && worldSize > 0 {
		raw = make([]*C.gradacc_comm_t, worldSize)
	}
	if err := call(func() C.enum_gradacc_status_t { return C.gradacc_comm_create_local(n, &raw[0]) }); err != nil {
		return nil, err
	}
	comms := make([]*Comm, worldSize)
	for r := range comms {
		comms[r] = newComm(raw[r])
	}
	return comms, nil
}

// newComm owns handle p: the Comm closes it when collected.
func newComm(p *C.gradacc_comm_t) *Comm {
	c := &Comm{ptr: p}
	runtime.SetFinalizer(c, (*Comm).Close)
	return c
}

// Split is this rank's communicator of a split (gradacc_comm_split): the ranks that pass the
// same color form a group, ranked by key (MPI_Comm_split for an MPI communicator; an in-process
// one fails with StatusInvalidArgument). Collective: every rank of the group calls it.
func (c *Comm) Split(color, key uint32) (*Comm, error) {
	p, err := c.handle()
	if err != nil {
		return nil, err
	}
	var out *C.gradacc_comm_t
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_comm_split(p, C.uint32_t(color), C.uint32_t(key), &out)
	})
	runtime.KeepAlive(c)
	if err != nil {
		return nil, err
	}
	return newComm(out), nil
}

// Close destroys the handle. Calling it again does nothing.
func (c *Comm) Close() error {
	if c.ptr == nil {
		return nil
	}
	runtime.SetFinalizer(c, nil)
	p := c.ptr
	c.ptr = nil
	return call(func() C.enum_gradacc_status_t { return C.gradacc_comm_destroy(p) })
}

// orNil is the handle, or nil for a nil or closed Comm.
func (c *Comm) orNil() *C.gradacc_comm_t {
	if c == nil {
		return nil
	}
	return c.ptr
}

func (c *Comm) handle() (*C.gradacc_comm_t, error) {
	if c == nil || c.ptr == nil {
		return nil, &Error{Status: StatusInvalidHandle, Message: "the Comm is closed"}
	}
	return c.ptr, nil
}

// Rank is this handle's rank (0-based).
func (c *Comm) Rank() (int, error) {
	p, err := c.handle()
	if err != nil {
		return 0, err
	}
	var out C.int32_t
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_comm_rank(p, &out) })
	runtime.KeepAlive(c)
	return int(out), err
}

// WorldSize is the group's number of ranks.
func (c *Comm) WorldSize() (int, error) {
	p, err := c.handle()
	if err != nil {
		return 0, err
	}
	var out C.int32_t
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_comm_world_size(p, &out) })
	runtime.KeepAlive(c)
	return int(out), err
}

// SetTimeout sets how long a collective may wait for the other ranks (default 10 minutes); 0
// waits forever. Past it, Sync fails with StatusTimeout and the communicator is aborted. It
// applies to the collectives that start later; a negative duration fails with
// StatusInvalidArgument.
func (c *Comm) SetTimeout(d time.Duration) error {
	p, err := c.handle()
	if err != nil {
		return err
	}
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_comm_set_timeout(p, C.double(d.Seconds())) })
	runtime.KeepAlive(c)
	return err
}

// Timeout is the communicator's timeout; 0 means it waits forever.
func (c *Comm) Timeout() (time.Duration, error) {
	p, err := c.handle()
	if err != nil {
		return 0, err
	}
	var out C.double
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_comm_timeout(p, &out) })
	runtime.KeepAlive(c)
	return time.Duration(math.Round(float64(out) * float64(time.Second))), err
}

// Abort aborts this rank's communicator (after a peer died): a Sync blocked in it in another
// goroutine, and every later one, fails with StatusCommFailure. In a local group every rank
// fails. The handle still needs Close.
func (c *Comm) Abort() error {
	p, err := c.handle()
	if err != nil {
		return err
	}
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_comm_abort(p) })
	runtime.KeepAlive(c)
	return err
}

// bytesArg is the C pointer to b's bytes, or NULL for an empty slice.
func bytesArg(b []byte) *C.uint8_t {
	if len(b) == 0 {
		return nil
	}
	return (*C.uint8_t)(unsafe.Pointer(&b[0]))
}
