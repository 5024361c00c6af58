// Package gradacc is the Go binding of gradacc, correct mixed-precision gradient accumulation
// behind a stable C ABI (include/gradacc.h, whose comments are the reference for every call).
//
// Every object owns one C handle (a BoundGrads: C memory and pins): Close frees it (calling it
// again does nothing), and a finalizer frees it if Close was never called. Failing calls return
// an *Error with the status and the message gradacc recorded for the calling OS thread; the
// binding locks the goroutine to its thread for the call and the message read, so the message
// is always the call's own.
//
// Accumulator.Add checks and pins every gradient on each call. A training loop whose backward
// writes into the same buffers every micro-batch binds them once with Accumulator.Bind, which
// checks them, pins their Go memory and keeps their addresses in C memory; AddBound is then one
// C call, and reads what the buffers hold when it is called.
//
// This file is the only one with cgo directives: it links target/release/libgradacc.so of the
// repository this package sits in (build it with `cargo build --release`), with an rpath to it.
// To link an installed gradacc instead, found by pkg-config, build with -tags gradacc_pkgconfig.
package gradacc

/*
#cgo CFLAGS: -I${SRCDIR}/../../include
#cgo !gradacc_pkgconfig LDFLAGS: -L${SRCDIR}/../../target/release -lgradacc -Wl,-rpath,${SRCDIR}/../../target/release
#cgo gradacc_pkgconfig pkg-config: gradacc
#include <gradacc.h>
#include <stdlib.h>
*/
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// Status is a GRADACC_STATUS_* code.
type Status int32

const (
	StatusOK                 Status = C.GRADACC_STATUS_OK
	StatusNullArgument       Status = C.GRADACC_STATUS_NULL_ARGUMENT
	StatusInvalidArgument    Status = C.GRADACC_STATUS_INVALID_ARGUMENT
	StatusInvalidHandle      Status = C.GRADACC_STATUS_INVALID_HANDLE
	StatusDTypeMismatch      Status = C.GRADACC_STATUS_DTYPE_MISMATCH
	StatusSizeMismatch       Status = C.GRADACC_STATUS_SIZE_MISMATCH
	StatusDeviceMismatch     Status = C.GRADACC_STATUS_DEVICE_MISMATCH
	StatusWrongState         Status = C.GRADACC_STATUS_WRONG_STATE
	StatusEmptyWindow        Status = C.GRADACC_STATUS_EMPTY_WINDOW
	StatusScaleAtMinimum     Status = C.GRADACC_STATUS_SCALE_AT_MINIMUM
	StatusBackendUnavailable Status = C.GRADACC_STATUS_BACKEND_UNAVAILABLE
	StatusCommFailure        Status = C.GRADACC_STATUS_COMM_FAILURE
	StatusPeerFailure        Status = C.GRADACC_STATUS_PEER_FAILURE
	StatusTimeout            Status = C.GRADACC_STATUS_TIMEOUT
	StatusCorruptState       Status = C.GRADACC_STATUS_CORRUPT_STATE
	StatusOutOfMemory        Status = C.GRADACC_STATUS_OUT_OF_MEMORY
	StatusInternal           Status = C.GRADACC_STATUS_INTERNAL
	StatusDeviceFailure      Status = C.GRADACC_STATUS_DEVICE_FAILURE
)

// String is gradacc_status_string: the code's name and a description.
func (s Status) String() string {
	return C.GoString(C.gradacc_status_string(C.int32_t(s)))
}

// DType is the element type gradients of a tensor arrive in.
type DType int32

const (
	F32  DType = C.GRADACC_DTYPE_F32
	F16  DType = C.GRADACC_DTYPE_F16
	BF16 DType = C.GRADACC_DTYPE_BF16
)

// String is the dtype's name: f32, f16 or bf16 (or its code, for a value that is none).
func (d DType) String() string {
	switch d {
	case F32:
		return "f32"
	case F16:
		return "f16"
	case BF16:
		return "bf16"
	}
	return fmt.Sprintf("DType(%d)", int32(d))
}

// LossReduction says how the caller reduced its loss over a micro-batch's items.
type LossReduction int32

const (
	LossMean LossReduction = C.GRADACC_LOSS_REDUCTION_MEAN
	LossSum  LossReduction = C.GRADACC_LOSS_REDUCTION_SUM
)

// Normalize says what the summed gradient is divided by at the boundary.
type Normalize int32

const (
	ByCount        Normalize = C.GRADACC_NORMALIZE_BY_COUNT
	ByMicrobatches Normalize = C.GRADACC_NORMALIZE_BY_MICROBATCHES
	ByWorld        Normalize = C.GRADACC_NORMALIZE_BY_WORLD
	NormalizeNone  Normalize = C.GRADACC_NORMALIZE_NONE
)

// Sharding says what each rank holds of the reduced gradient after the boundary.
type Sharding int32

const (
	// ShardingNone: every rank holds the whole reduced gradient (an all-reduce, as DDP).
	ShardingNone Sharding = C.GRADACC_SHARDING_NONE
	// ShardingReduceScatter: rank ShardRank of ShardCount holds only its shard of the reduced
	// gradient (Accumulator.Shard), through a reduce-scatter, as a distributed optimizer needs;
	// Accumulator.SyncHybrid then also all-reduces the shard over a replica group (HSDP).
	ShardingReduceScatter Sharding = C.GRADACC_SHARDING_REDUCE_SCATTER
	// ShardingAccumulate: sharded accumulation (ZeRO-2). Rank ShardRank of ShardCount holds only
	// its shard of the FP32 gradient and one bucket of staging, and every micro-batch is
	// reduce-scattered over the communicator given to NewShardedAccumulator.
	ShardingAccumulate Sharding = C.GRADACC_SHARDING_ACCUMULATE
)

// Overflow is what a non-finite gradient value costs the window (AccumulatorConfig.Overflow);
// docs/overflow.md states the contract.
type Overflow int32

const (
	// OverflowSkipStep: the window's step is skipped on every rank, as PyTorch's GradScaler does.
	OverflowSkipStep Overflow = C.GRADACC_OVERFLOW_SKIP_STEP
	// OverflowDropMicrobatch: only the micro-batch that held it is dropped, on the rank that fed
	// it; the boundary normalises by what every rank kept, and skips the step only when nothing
	// was kept or the sum overflows. Every device and sharding policy. A drop backs the scale off
	// at the next Scaler.Update.
	OverflowDropMicrobatch Overflow = C.GRADACC_OVERFLOW_DROP_MICROBATCH
)

// OverflowAt says where a window first went non-finite (SyncInfo.OverflowAt).
type OverflowAt int32

const (
	// OverflowAtNone: the window stayed finite (or, on CUDA, the place is not located).
	OverflowAtNone OverflowAt = C.GRADACC_OVERFLOW_AT_NONE
	// OverflowAtGradient: a gradient value, at SyncInfo's OverflowRank, OverflowMicrobatch and
	// OverflowTensor.
	OverflowAtGradient OverflowAt = C.GRADACC_OVERFLOW_AT_GRADIENT
	// OverflowAtReduction: every rank's window was finite; their sum overflowed.
	OverflowAtReduction OverflowAt = C.GRADACC_OVERFLOW_AT_REDUCTION
)

// HeaderVersion is the version of the header this package was compiled against.
const HeaderVersion = C.GRADACC_VERSION_STRING

// Version is the loaded library's version.
func Version() string { return C.GoString(C.gradacc_version_string()) }

// call runs one C call and, on failure, reads the thread's last error before anything else can
// run on that thread: the goroutine stays on its OS thread for both.
// gradacc_status_t is a C enum: cgo types the functions that return it as C.enum_gradacc_status_t.
func call(f func() C.enum_gradacc_status_t) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	st := f()
	if st == C.GRADACC_STATUS_OK {
		return nil
	}
	return &Error{Status: Status(st), Message: C.GoString(C.gradacc_last_error())}
}

// cBool avoids cgo's lack of a bool conversion.
func cBool(b bool) C.bool {
	if b {
		return C.bool(true)
	}
	return C.bool(false)
}

// Device is the device an object is bound to; a nil *Device means the CPU.
type Device struct {
	CUDA    bool
	Ordinal int32
	// Stream is the caller's cudaStream_t / CUstream (borrowed, never destroyed by gradacc).
	Stream unsafe.Pointer
}

func (d *Device) c() C.gradacc_device_t {
	var out C.gradacc_device_t
	out.kind = C.GRADACC_DEVICE_CPU
	if d != nil && d.CUDA {
		out.kind = C.GRADACC_DEVICE_CUDA
		out.ordinal = C.int32_t(d.Ordinal)
		out.stream = d.Stream
	}
	return out
}
