package gradacc

// #include <stdlib.h>
// #include <gradacc.h>
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// Algorithm is an optimizer's update rule.
type Algorithm int32

const (
	// AdamW is torch.optim.AdamW (amsgrad off): Beta1, Beta2, Eps, WeightDecay.
	AdamW Algorithm = C.GRADACC_OPTIMIZER_ADAMW
	// SGD is torch.optim.SGD: Momentum, Dampening, Nesterov, WeightDecay.
	SGD Algorithm = C.GRADACC_OPTIMIZER_SGD
)

// Rounding is how the FP32 master weights become the model's 16-bit weights.
type Rounding int32

const (
	RoundNearestEven Rounding = C.GRADACC_ROUNDING_NEAREST_EVEN
	// RoundStochastic is keyed by the config's Seed, the step and the element.
	RoundStochastic Rounding = C.GRADACC_ROUNDING_STOCHASTIC
)

// Masters is how the FP32 master weights are kept between steps.
type Masters int32

const (
	// MastersFP32 keeps them as FP32: 4 bytes per parameter beside the model's weight.
	MastersFP32 Masters = C.GRADACC_MASTERS_FP32
	// MastersBF16Remainder keeps each as the model's bf16 weight plus a 16-bit remainder, the
	// FP32 master exactly (bf16 weights only; docs/optimizer.md, "Smaller state").
	MastersBF16Remainder Masters = C.GRADACC_MASTERS_BF16_REMAINDER
	// MastersNone keeps none: each step reads the master from the model's weight and writes it
	// back with the weights' rounding, which must be stochastic for 16-bit weights.
	MastersNone Masters = C.GRADACC_MASTERS_NONE
)

// Moments is how AdamW's moments (SGD's momentum buffer) are kept between steps.
type Moments int32

const (
	// MomentsFP32 keeps them as FP32: 4 bytes per moment.
	MomentsFP32 Moments = C.GRADACC_MOMENTS_FP32
	// MomentsBF16 keeps them as bf16, 2 bytes each, rounded stochastically keyed by MomentSeed,
	// the step and the element.
	MomentsBF16 Moments = C.GRADACC_MOMENTS_BF16
	// MomentsInt8Blockwise keeps them in 8-bit blocks: 1 byte each plus one f32 scale per block
	// of 64 elements (CPU optimizers only).
	MomentsInt8Blockwise Moments = C.GRADACC_MOMENTS_INT8_BLOCKWISE
)

// WeightFormat is what the step writes for a tensor's weights (docs/optimizer.md, "FP8 weights
// on the all-gather").
type WeightFormat int32

const (
	// WeightsModel writes the tensor in its model dtype. The default.
	WeightsModel WeightFormat = C.GRADACC_WEIGHTS_MODEL
	// WeightsE4M3Tensorwise writes E4M3 codes with one float32 scale per tensor (Step takes
	// WeightE4M3), under a sharded boundary only, with FP32 masters, on the CPU.
	WeightsE4M3Tensorwise WeightFormat = C.GRADACC_WEIGHTS_E4M3_TENSORWISE
	// WeightsMXFP8 writes E4M3 codes with one E8M0 byte per block of 32 (Step takes
	// WeightMXFP8), where WeightsE4M3Tensorwise may be used.
	WeightsMXFP8 WeightFormat = C.GRADACC_WEIGHTS_MXFP8
)

// OptimizerConfig is gradacc_optimizer_config_t; start from DefaultOptimizerConfig (AdamW with
// PyTorch's defaults, LR 1e-3, WeightDecay 0.01: set it to 0 for SGD without decay).
type OptimizerConfig struct {
	Algorithm   Algorithm
	LR          float32
	Beta1       float32
	Beta2       float32
	Eps         float32
	WeightDecay float32
	Momentum    float32
	Dampening   float32
	Nesterov    bool
	Rounding    Rounding
	Seed        uint64
	Masters     Masters
	Moments     Moments
	MomentSeed  uint64
	// WeightFormats is one entry per tensor, or nil for every tensor in its model dtype; the
	// weights given to NewOptimizer are then the initial values in the model dtypes.
	WeightFormats []WeightFormat
}

// DefaultOptimizerConfig is gradacc_optimizer_config_default.
func DefaultOptimizerConfig() OptimizerConfig {
	var c C.gradacc_optimizer_config_t
	if err := call(func() C.enum_gradacc_status_t { return C.gradacc_optimizer_config_default(&c) }); err != nil {
		panic(err) // cannot fail: a non-NULL output is its only requirement
	}
	return OptimizerConfig{
		Algorithm: Algorithm(c.algorithm), LR: float32(c.lr), Beta1: float32(c.beta1),
		Beta2: float32(c.beta2), Eps: float32(c.eps), WeightDecay: float32(c.weight_decay),
		Momentum: float32(c.momentum), Dampening: float32(c.dampening), Nesterov: bool(c.nesterov),
		Rounding: Rounding(c.rounding), Seed: uint64(c.seed), Masters: Masters(c.masters),
		Moments: Moments(c.moments), MomentSeed: uint64(c.moment_seed),
	}
}

func (o *OptimizerConfig) c() C.gradacc_optimizer_config_t {
	var c C.gradacc_optimizer_config_t
	C.gradacc_optimizer_config_default(&c) // struct_size, and any field this binding does not know yet
	c.algorithm = C.gradacc_optimizer_algorithm_t(o.Algorithm)
	c.lr = C.float(o.LR)
	c.beta1 = C.float(o.Beta1)
	c.beta2 = C.float(o.Beta2)
	c.eps = C.float(o.Eps)
	c.weight_decay = C.float(o.WeightDecay)
	c.momentum = C.float(o.Momentum)
	c.dampening = C.float(o.Dampening)
	c.nesterov = cBool(o.Nesterov)
	c.rounding = C.gradacc_rounding_t(o.Rounding)
	c.seed = C.uint64_t(o.Seed)
	c.masters = C.gradacc_masters_t(o.Masters)
	c.moments = C.gradacc_moments_t(o.Moments)
	c.moment_seed = C.uint64_t(o.MomentSeed)
	return c
}

// TensorGroup is one tensor's options: weight decay on or off, and a learning-rate factor.
type TensorGroup struct {
	WeightDecay bool
	LRScale     float32
}

// Weight is one model weight handed to NewOptimizer and Optimizer.Step: build it with
// WeightF32, WeightF16, WeightBF16 or WeightPointer, or for Step of an FP8 tensor WeightE4M3 or
// WeightMXFP8. It borrows the memory for the call only.
type Weight struct {
	ptr    unsafe.Pointer
	numel  int
	dtype  DType
	raw    bool
	format WeightFormat
	scales unsafe.Pointer // an FP8 tensor's scales
	nscale int
}

// WeightE4M3 is an E4M3 tensor's codes and its scale, which Step writes.
func WeightE4M3(codes []uint8, scale *float32) Weight {
	return Weight{ptr: bytesAt(codes), numel: len(codes), format: WeightsE4M3Tensorwise,
		scales: unsafe.Pointer(scale), nscale: 1}
}

// WeightMXFP8 is an MXFP8 tensor's codes and its E8M0 scales (one per block of 32), which Step
// writes.
func WeightMXFP8(codes []uint8, scales []uint8) Weight {
	return Weight{ptr: bytesAt(codes), numel: len(codes), format: WeightsMXFP8,
		scales: bytesAt(scales), nscale: len(scales)}
}

func bytesAt(b []uint8) unsafe.Pointer {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Pointer(&b[0])
}

func words(w []uint16) unsafe.Pointer {
	if len(w) == 0 {
		return nil
	}
	return unsafe.Pointer(&w[0])
}

// WeightF32 is an f32 weight.
func WeightF32(w []float32) Weight {
	var p unsafe.Pointer
	if len(w) > 0 {
		p = unsafe.Pointer(&w[0])
	}
	return Weight{ptr: p, numel: len(w), dtype: F32}
}

// WeightF16 is an fp16 weight as raw 16-bit words.
func WeightF16(w []uint16) Weight { return Weight{ptr: words(w), numel: len(w), dtype: F16} }

// WeightBF16 is a bf16 weight as raw 16-bit words.
func WeightBF16(w []uint16) Weight { return Weight{ptr: words(w), numel: len(w), dtype: BF16} }

// WeightPointer is numel values of dtype at p: C memory, or for an optimizer over a CUDA
// accumulator the weight's device address (unsafe.Pointer(uintptr(addr))); gradacc cannot check
// what lies in host memory, and checks a device address with the driver.
func WeightPointer(p unsafe.Pointer, numel int, dtype DType) Weight {
	return Weight{ptr: p, numel: numel, dtype: dtype, raw: true}
}

// Optimizer keeps FP32 master weights and AdamW or SGD state for an accumulator's tensors and
// steps them after each Sync. The contract (one step per synced window, a skipped window changes
// nothing, the all-gather under sharding) is gradacc_optimizer_create's and
// gradacc_optimizer_step's, and docs/optimizer.md. Calls on one optimizer must not overlap.
type Optimizer struct {
	ptr    *C.gradacc_optimizer_t
	dtypes []DType
	// What Step writes for each tensor (nil: every tensor in its model dtype).
	formats []WeightFormat
	// Adopted masters: pinned while the optimizer may write them (until Close).
	masters []float32
	pin     runtime.Pinner
}

// pinWeights checks one weight per tensor of tensors (of dtypes, when given), pins their Go
// memory into pin and returns their addresses, a Go slice C may read while they stay pinned.
func pinWeights(weights []Weight, tensors []TensorDesc, dtypes []DType, pin *runtime.Pinner) ([]unsafe.Pointer, error) {
	ptrs, _, err := pinStepWeights(weights, tensors, dtypes, nil, pin)
	return ptrs, err
}

// pinStepWeights is pinWeights for a step whose tensors are written as formats says (nil: each
// in its model dtype): it also returns the scales, each FP8 tensor's, nil when no tensor is FP8.
func pinStepWeights(weights []Weight, tensors []TensorDesc, dtypes []DType, formats []WeightFormat, pin *runtime.Pinner) ([]unsafe.Pointer, []unsafe.Pointer, error) {
	if len(weights) != len(tensors) {
		return nil, nil, &Error{Status: StatusSizeMismatch, Message: fmt.Sprintf("argument `weights`: %d weights for %d tensors", len(weights), len(tensors))}
	}
	ptrs := make([]unsafe.Pointer, len(weights)+1)
	var scales []unsafe.Pointer
	for i, w := range weights {
		format := WeightsModel
		if formats != nil {
			format = formats[i]
		}
		if w.format != format {
			return nil, nil, &Error{Status: StatusDTypeMismatch, Message: fmt.Sprintf("weights[%d] is of weight format %d, but the optimizer writes %d", i, w.format, format)}
		}
		if uint64(w.numel) != tensors[i].Numel {
			return nil, nil, &Error{Status: StatusSizeMismatch, Message: fmt.Sprintf("weights[%d] has %d elements, but the tensor has %d", i, w.numel, tensors[i].Numel)}
		}
		if format == WeightsModel && dtypes != nil && w.dtype != dtypes[i] {
			return nil, nil, &Error{Status: StatusDTypeMismatch, Message: fmt.Sprintf("weights[%d] has dtype %d, but the optimizer was created with %d", i, w.dtype, dtypes[i])}
		}
		if format != WeightsModel {
			want := 1
			if format == WeightsMXFP8 {
				want = (w.numel + 31) / 32
			}
			if w.nscale != want {
				return nil, nil, &Error{Status: StatusSizeMismatch, Message: fmt.Sprintf("weights[%d] has %d scales, but takes %d", i, w.nscale, want)}
			}
			if scales == nil {
				scales = make([]unsafe.Pointer, len(weights)+1)
			}
			if w.scales != nil {
				pin.Pin(w.scales)
			}
			scales[i] = w.scales
		}
		if w.ptr != nil && !w.raw {
			pin.Pin(w.ptr)
		}
		ptrs[i] = w.ptr
	}
	return ptrs, scales, nil
}

// NewOptimizer creates an optimizer over acc's tensors whose FP32 masters start as the model's
// weights (one per tensor, whole); a nil config means the defaults, nil groups weight decay on
// and LRScale 1 for every tensor.
func NewOptimizer(acc *Accumulator, weights []Weight, config *OptimizerConfig, groups []TensorGroup) (*Optimizer, error) {
	return newOptimizer(acc, weights, config, groups, nil)
}

// NewOptimizerWithMasters is NewOptimizer over the caller's FP32 master weights
// (gradacc_optimizer_create_with_masters): masters holds this rank's range of the flat layout
// (Shard's length; tensor i at Offset(i) minus the shard's offset), and its values are the
// masters, not overwritten from the weights. Every Step updates it in place and Load writes into
// it. It stays pinned until Close; do not write it while a call on the optimizer runs. For a CPU
// accumulator only (a CUDA one's masters are device memory: use the C API).
func NewOptimizerWithMasters(acc *Accumulator, weights []Weight, masters []float32, config *OptimizerConfig, groups []TensorGroup) (*Optimizer, error) {
	return newOptimizer(acc, weights, config, groups, masters)
}

func newOptimizer(acc *Accumulator, weights []Weight, config *OptimizerConfig, groups []TensorGroup, masters []float32) (*Optimizer, error) {
	ap, err := acc.handle()
	if err != nil {
		return nil, err
	}
	if config == nil {
		d := DefaultOptimizerConfig()
		config = &d
	}
	cfg := config.c()
	var pin runtime.Pinner
	defer pin.Unpin()
	ptrs, err := pinWeights(weights, acc.tensors, nil, &pin)
	if err != nil {
		return nil, err
	}
	var formats []WeightFormat
	if len(config.WeightFormats) > 0 {
		if len(config.WeightFormats) != len(weights) {
			return nil, &Error{Status: StatusSizeMismatch, Message: fmt.Sprintf("`config`.WeightFormats has %d entries for %d tensors", len(config.WeightFormats), len(weights))}
		}
		formats = append([]WeightFormat(nil), config.WeightFormats...)
		cf := make([]C.gradacc_weight_format_t, len(formats))
		for i, f := range formats {
			cf[i] = C.gradacc_weight_format_t(f)
		}
		pin.Pin(&cf[0]) // the config holds its address through the creation
		cfg.weight_formats = &cf[0]
	}
	dtypes := make([]DType, len(weights))
	codes := make([]C.gradacc_dtype_t, len(weights)+1)
	for i, w := range weights {
		dtypes[i] = w.dtype
		codes[i] = C.gradacc_dtype_t(w.dtype)
	}
	var grp *C.gradacc_tensor_group_t
	if groups != nil {
		if len(groups) != len(weights) {
			return nil, &Error{Status: StatusSizeMismatch, Message: fmt.Sprintf("argument `groups`: %d groups for %d tensors", len(groups), len(weights))}
		}
		cg := make([]C.gradacc_tensor_group_t, len(groups)+1)
		for i, g := range groups {
			cg[i].weight_decay = cBool(g.WeightDecay)
			cg[i].lr_scale = C.float(g.LRScale)
		}
		grp = &cg[0]
	}
	o := &Optimizer{dtypes: dtypes, masters: masters, formats: formats}
	var p *C.gradacc_optimizer_t
	if masters == nil {
		err = call(func() C.enum_gradacc_status_t {
			return C.gradacc_optimizer_create(ap, &cfg, grp, &ptrs[0], &codes[0], C.size_t(len(weights)), &p)
		})
	} else {
		var m *C.float
		if len(masters) > 0 {
			o.pin.Pin(&masters[0]) // gradacc keeps the address: pinned until Close
			m = (*C.float)(unsafe.Pointer(&masters[0]))
		}
		err = call(func() C.enum_gradacc_status_t {
			return C.gradacc_optimizer_create_with_masters(ap, &cfg, grp, &ptrs[0], &codes[0], C.size_t(len(weights)), m, C.size_t(len(masters)), &p)
		})
	}
	runtime.KeepAlive(acc)
	runtime.KeepAlive(weights)
	if err != nil {
		o.pin.Unpin()
		return nil, err
	}
	o.ptr = p
	runtime.SetFinalizer(o, (*Optimizer).Close)
	return o, nil
}

// Close destroys the optimizer. Calling it again does nothing.
func (o *Optimizer) Close() error {
	if o.ptr == nil {
		return nil
	}
	runtime.SetFinalizer(o, nil)
	p := o.ptr
	o.ptr = nil
	err := call(func() C.enum_gradacc_status_t { return C.gradacc_optimizer_destroy(p) })
	o.pin.Unpin()
	o.masters = nil
	return err
}

func (o *Optimizer) handle() (*C.gradacc_optimizer_t, error) {
	if o == nil || o.ptr == nil {
		return nil, &Error{Status: StatusInvalidHandle, Message: "the Optimizer is closed"}
	}
	return o.ptr, nil
}

// Step is the step after acc.Sync: it writes the model's weights (the dtypes given to
// NewOptimizer) and reports stepped, or changes nothing when the window held a non-finite value.
// Under a sharded boundary every rank calls it with the communicator its Sync took (nil: a
// sharded accumulation's own).
func (o *Optimizer) Step(acc *Accumulator, weights []Weight, comm *Comm) (stepped bool, err error) {
	p, err := o.handle()
	if err != nil {
		return false, err
	}
	ap, err := acc.handle()
	if err != nil {
		return false, err
	}
	var cp *C.gradacc_comm_t
	if comm != nil {
		if cp, err = comm.handle(); err != nil {
			return false, err
		}
	}
	var pin runtime.Pinner
	defer pin.Unpin()
	ptrs, scales, err := pinStepWeights(weights, acc.tensors, o.dtypes, o.formats, &pin)
	if err != nil {
		// The library refuses a call without weights, and under a sharded boundary tells the
		// other ranks, which fail at once instead of waiting in the step's agreement.
		_ = call(func() C.enum_gradacc_status_t {
			return C.gradacc_optimizer_step(p, ap, nil, C.size_t(len(weights)), cp, nil)
		})
		runtime.KeepAlive(o)
		runtime.KeepAlive(acc)
		runtime.KeepAlive(comm)
		return false, err
	}
	var out C.bool
	var sp *unsafe.Pointer
	if scales != nil {
		sp = &scales[0]
	}
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_optimizer_step_scaled(p, ap, &ptrs[0], sp, C.size_t(len(weights)), cp, &out)
	})
	runtime.KeepAlive(o)
	runtime.KeepAlive(acc)
	runtime.KeepAlive(comm)
	runtime.KeepAlive(weights)
	return bool(out), err
}

// SetLR sets the learning rate of the steps from the next one on.
func (o *Optimizer) SetLR(lr float32) error {
	p, err := o.handle()
	if err != nil {
		return err
	}
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_optimizer_set_lr(p, C.float(lr)) })
	runtime.KeepAlive(o)
	return err
}

// LRDevicePtr is, on a CUDA accumulator, the device address of the learning rate every step
// reads when it runs, for a schedule on the device (see gradacc_optimizer_lr_device_ptr); a
// DEVICE_MISMATCH error on a CPU accumulator.
func (o *Optimizer) LRDevicePtr() (uintptr, error) {
	p, err := o.handle()
	if err != nil {
		return 0, err
	}
	var out unsafe.Pointer
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_optimizer_lr_device_ptr(p, &out) })
	runtime.KeepAlive(o)
	return uintptr(out), err
}

// Steps is the number of steps taken (a skipped step is not one).
func (o *Optimizer) Steps() (uint64, error) {
	p, err := o.handle()
	if err != nil {
		return 0, err
	}
	var out C.uint64_t
	err = call(func() C.enum_gradacc_status_t { return C.gradacc_optimizer_steps(p, &out) })
	runtime.KeepAlive(o)
	return uint64(out), err
}

// Save returns this rank's optimizer state as versioned bytes.
func (o *Optimizer) Save() ([]byte, error) {
	p, err := o.handle()
	if err != nil {
		return nil, err
	}
	var n C.size_t
	if err = call(func() C.enum_gradacc_status_t { return C.gradacc_optimizer_save(p, nil, 0, &n) }); err != nil {
		return nil, err
	}
	buf := make([]byte, int(n)+1) // +1: never a zero-length slice to index
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_optimizer_save(p, (*C.uint8_t)(unsafe.Pointer(&buf[0])), n, &n)
	})
	runtime.KeepAlive(o)
	return buf[:n], err
}

// Load restores the state from the parts Save wrote on any number of ranks (together covering
// this rank's elements, each rank's once). Bad parts fail with StatusCorruptState, a part given
// twice with StatusInvalidArgument; either way nothing changes.
func (o *Optimizer) Load(parts ...[]byte) error {
	p, err := o.handle()
	if err != nil {
		return err
	}
	var pin runtime.Pinner
	defer pin.Unpin()
	ptrs := make([]*C.uint8_t, len(parts)+1)
	lens := make([]C.size_t, len(parts)+1)
	for k, part := range parts {
		ptrs[k] = bytesArg(part)
		if ptrs[k] != nil {
			pin.Pin(ptrs[k])
		}
		lens[k] = C.size_t(len(part))
	}
	err = call(func() C.enum_gradacc_status_t {
		return C.gradacc_optimizer_load(p, &ptrs[0], &lens[0], C.size_t(len(parts)))
	})
	runtime.KeepAlive(o)
	runtime.KeepAlive(parts)
	return err
}
