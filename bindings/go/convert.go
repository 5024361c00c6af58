package gradacc

// #include <gradacc.h>
import "C"

import (
	"fmt"
	"unsafe"
)

// Go has no 16-bit float type: fp16 and bf16 values travel as their bits in []uint16 (what
// Words16 and ScaleLoss16 take). These convert whole slices through the C library's vectorised
// loops: rounding to nearest even on the way down, exact on the way up.

// F32ToF16 is src rounded to IEEE binary16 bits (gradacc_f32_to_f16).
func F32ToF16(src []float32) []uint16 {
	dst := make([]uint16, len(src))
	mustConvert(F32ToF16Into(dst, src))
	return dst
}

// F16ToF32 is the float32 value of each binary16 word of src (gradacc_f16_to_f32).
func F16ToF32(src []uint16) []float32 {
	dst := make([]float32, len(src))
	mustConvert(F16ToF32Into(dst, src))
	return dst
}

// F32ToBF16 is src rounded to bfloat16 bits (gradacc_f32_to_bf16).
func F32ToBF16(src []float32) []uint16 {
	dst := make([]uint16, len(src))
	mustConvert(F32ToBF16Into(dst, src))
	return dst
}

// BF16ToF32 is the float32 value of each bfloat16 word of src (gradacc_bf16_to_f32).
func BF16ToF32(src []uint16) []float32 {
	dst := make([]float32, len(src))
	mustConvert(BF16ToF32Into(dst, src))
	return dst
}

// F32ToF16Into writes the binary16 bits of src into dst, which must be as long and must not
// overlap it.
func F32ToF16Into(dst []uint16, src []float32) error {
	return convert(len(dst), len(src), unsafe.Pointer(unsafe.SliceData(src)), unsafe.Pointer(unsafe.SliceData(dst)),
		func(s, d unsafe.Pointer, n C.size_t) C.enum_gradacc_status_t {
			return C.gradacc_f32_to_f16((*C.float)(s), (*C.uint16_t)(d), n)
		})
}

// F16ToF32Into writes the float32 values of the binary16 words of src into dst, which must be as
// long and must not overlap it.
func F16ToF32Into(dst []float32, src []uint16) error {
	return convert(len(dst), len(src), unsafe.Pointer(unsafe.SliceData(src)), unsafe.Pointer(unsafe.SliceData(dst)),
		func(s, d unsafe.Pointer, n C.size_t) C.enum_gradacc_status_t {
			return C.gradacc_f16_to_f32((*C.uint16_t)(s), (*C.float)(d), n)
		})
}

// F32ToBF16Into writes the bfloat16 bits of src into dst, which must be as long and must not
// overlap it.
func F32ToBF16Into(dst []uint16, src []float32) error {
	return convert(len(dst), len(src), unsafe.Pointer(unsafe.SliceData(src)), unsafe.Pointer(unsafe.SliceData(dst)),
		func(s, d unsafe.Pointer, n C.size_t) C.enum_gradacc_status_t {
			return C.gradacc_f32_to_bf16((*C.float)(s), (*C.uint16_t)(d), n)
		})
}

// BF16ToF32Into writes the float32 values of the bfloat16 words of src into dst, which must be
// as long and must not overlap it.
func BF16ToF32Into(dst []float32, src []uint16) error {
	return convert(len(dst), len(src), unsafe.Pointer(unsafe.SliceData(src)), unsafe.Pointer(unsafe.SliceData(dst)),
		func(s, d unsafe.Pointer, n C.size_t) C.enum_gradacc_status_t {
			return C.gradacc_bf16_to_f32((*C.uint16_t)(s), (*C.float)(d), n)
		})
}

// convert checks the lengths and runs one conversion over Go memory, which the C call only
// reads and writes during the call (cgo's pointer rules allow it: the slices hold no pointers).
func convert(dstLen, srcLen int, src, dst unsafe.Pointer, f func(s, d unsafe.Pointer, n C.size_t) C.enum_gradacc_status_t) error {
	if dstLen != srcLen {
		return &Error{Status: StatusSizeMismatch, Message: fmt.Sprintf("dst has %d elements, src %d", dstLen, srcLen)}
	}
	return call(func() C.enum_gradacc_status_t { return f(src, dst, C.size_t(srcLen)) })
}

// mustConvert panics on an error that a freshly made destination cannot cause.
func mustConvert(err error) {
	if err != nil {
		panic("gradacc: " + err.Error())
	}
}
