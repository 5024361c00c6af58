package gradacc

import (
	"errors"
	"math"
	"math/rand"
	"testing"
)

// format is a 16-bit float format written out from its definition, independently of the library.
type format struct {
	name  string
	mant  uint // mantissa bits
	bias  int
	round func([]float32) []uint16
	widen func([]uint16) []float32
}

var formats = []format{
	{"f16", 10, 15, F32ToF16, F16ToF32},
	{"bf16", 7, 127, F32ToBF16, BF16ToF32},
}

func (f format) infinity() uint16 { return uint16(2*f.bias+1) << f.mant }

// value of a non-negative pattern up to infinity(), which reads as the power of two overflow
// rounds to.
func (f format) value(p uint16) float64 {
	e, m := int(p>>f.mant), float64(p&(1<<f.mant-1))
	if e == 0 {
		return math.Ldexp(m, 1-f.bias-int(f.mant))
	}
	return math.Ldexp(m+math.Ldexp(1, int(f.mant)), e-f.bias-int(f.mant))
}

// want is x rounded to nearest even by bisection and an exact comparison with the midpoint; a
// NaN keeps its sign and the upper bits of its payload, with the quiet bit set.
func (f format) want(x float32) uint16 {
	b := math.Float32bits(x)
	sign := uint16(b>>16) & 0x8000
	if x != x {
		return sign | f.infinity() | 1<<(f.mant-1) | uint16((b&0x7fffff)>>(23-f.mant))
	}
	a := math.Abs(float64(x))
	lo, hi := uint16(0), f.infinity()
	if a >= f.value(hi) {
		return sign | hi
	}
	for hi-lo > 1 {
		if mid := lo + (hi-lo)/2; f.value(mid) <= a {
			lo = mid
		} else {
			hi = mid
		}
	}
	mid := (f.value(lo) + f.value(hi)) / 2
	if a > mid || (a == mid && lo&1 == 1) {
		return sign | hi
	}
	return sign | lo
}

// widened is the float32 bits of pattern p: its value, or a NaN's sign and payload (quieted for
// f16, as F16C does; as it is for bf16).
func (f format) widened(p uint16) uint32 {
	sign := uint32(p&0x8000) << 16
	mag := p & 0x7fff
	switch {
	case mag > f.infinity() && f.mant == 7:
		return uint32(p) << 16
	case mag > f.infinity():
		return sign | 0x7fc00000 | uint32(mag&(1<<f.mant-1))<<(23-f.mant)
	case mag == f.infinity():
		return sign | 0x7f800000
	}
	return sign | math.Float32bits(float32(f.value(mag)))
}

func TestConversionsRoundToNearestEven(t *testing.T) {
	rng := rand.New(rand.NewSource(45))
	for _, f := range formats {
		var xs []float32
		for p := uint16(0); p < f.infinity(); p++ {
			for _, v := range []float64{f.value(p), (f.value(p) + f.value(p+1)) / 2} {
				b := math.Float32bits(float32(v))
				for _, n := range []uint32{b, b + 1, b - 1, b | 0x80000000} {
					xs = append(xs, math.Float32frombits(n))
				}
			}
		}
		for i := 0; i < 200000; i++ {
			xs = append(xs, math.Float32frombits(rng.Uint32()), math.Float32frombits(rng.Uint32()|0x7f800000))
		}
		got := f.round(xs)
		bad := 0
		for i, x := range xs {
			if want := f.want(x); got[i] != want {
				if bad++; bad <= 5 {
					t.Errorf("%s of %g (%#08x): got %#04x, want %#04x", f.name, x, math.Float32bits(x), got[i], want)
				}
			}
		}
		if bad > 0 {
			t.Errorf("%s: %d of %d values differ", f.name, bad, len(xs))
		}
	}
}

func TestConversionsWidenEveryPatternExactly(t *testing.T) {
	all := make([]uint16, 1<<16)
	for i := range all {
		all[i] = uint16(i)
	}
	for _, f := range formats {
		got := f.widen(all)
		for p, g := range got {
			if want := f.widened(uint16(p)); math.Float32bits(g) != want {
				t.Fatalf("%s %#04x: got %#08x, want %#08x", f.name, p, math.Float32bits(g), want)
			}
		}
	}
}

func TestConversionsOfEmptyAndMismatchedSlices(t *testing.T) {
	if got := F32ToF16(nil); len(got) != 0 {
		t.Fatalf("F32ToF16(nil) = %v", got)
	}
	if got := BF16ToF32([]uint16{}); len(got) != 0 {
		t.Fatalf("BF16ToF32([]) = %v", got)
	}
	err := F32ToBF16Into(make([]uint16, 2), []float32{1, 2, 3})
	if !errors.Is(err, &Error{Status: StatusSizeMismatch}) {
		t.Fatalf("a short dst: %v", err)
	}
	dst := []float32{7, 7}
	if err := F16ToF32Into(dst, []uint16{0x3c00, 0xc000}); err != nil || dst[0] != 1 || dst[1] != -2 {
		t.Fatalf("F16ToF32Into: %v, %v", dst, err)
	}
}
