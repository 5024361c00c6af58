package gradacc

import (
	"math"
	"strings"
	"testing"
)

func TestLogCallbackReceivesASkippedStep(t *testing.T) {
	var got []string
	if err := SetLogCallback(func(level LogLevel, message string) {
		if level == LogInfo {
			got = append(got, message)
		}
	}, LogInfo); err != nil {
		t.Fatal(err)
	}
	defer SetLogCallback(nil, LogOff)
	cfg := DefaultScalerConfig()
	cfg.InitScale = 4096
	scaler, err := NewScaler(&cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer scaler.Close()
	acc, err := NewAccumulator([]TensorDesc{{Numel: 2, DType: F32}}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer acc.Close()
	if err := acc.Add(scaler, []Grad{Float32s([]float32{1, float32(math.Inf(1))})}, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := acc.Sync(nil); err != nil {
		t.Fatal(err)
	}
	if _, err := scaler.Update(acc); err != nil {
		t.Fatal(err)
	}
	want := "step 1 skipped: a gradient was not finite; loss scale 4096 -> 2048"
	if len(got) == 0 || got[0] != want {
		t.Fatalf("messages %q, want %q first", got, want)
	}
	if err := SetLogCallback(nil, 9); err == nil {
		t.Fatal("an unknown level was accepted")
	}
}

func TestDiagnosticsNamesEveryPart(t *testing.T) {
	report, err := Diagnostics()
	if err != nil {
		t.Fatal(err)
	}
	for _, part := range []string{"gradacc " + Version() + " (", "SIMD path: ", "backends:", "  NCCL: ", "GRADACC_LOG"} {
		if !strings.Contains(report, part) {
			t.Errorf("no %q in\n%s", part, report)
		}
	}
}

func TestDTypeAndLogLevelPrintTheirNames(t *testing.T) {
	for _, c := range []struct{ got, want string }{
		{F16.String(), "f16"}, {BF16.String(), "bf16"}, {F32.String(), "f32"}, {DType(7).String(), "DType(7)"},
		{LogInfo.String(), "info"}, {LogOff.String(), "off"}, {LogLevel(9).String(), "LogLevel(9)"},
	} {
		if c.got != c.want {
			t.Errorf("%q, want %q", c.got, c.want)
		}
	}
}
