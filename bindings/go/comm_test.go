package gradacc

import (
	"errors"
	"runtime"
	"testing"
	"time"
)

// savedWindow is the window of one rank that added one f32 micro-batch of count items.
func savedWindow(t *testing.T, grad []float32, count uint64) []byte {
	s := scalerWithScale(t, 1)
	defer s.Close()
	acc := must(NewAccumulator([]TensorDesc{{uint64(len(grad)), F32}}, nil, nil))
	defer acc.Close()
	if err := acc.Add(s, []Grad{Float32s(grad)}, count); err != nil {
		t.Fatal(err)
	}
	return must(acc.SaveWindow())
}

func oneMicrobatch(t *testing.T, acc *Accumulator) {
	s := scalerWithScale(t, 1)
	defer s.Close()
	if err := acc.Add(s, []Grad{Float32s([]float32{1, 1})}, 1); err != nil {
		t.Fatal(err)
	}
}

// Two ranks' saved windows resume on one: merged into a fresh accumulator, they sync as one.
func TestMergeWindowsOfTwoRanksIntoOne(t *testing.T) {
	a := savedWindow(t, []float32{1, 2}, 1)
	b := savedWindow(t, []float32{3, 5}, 3)
	comms := must(NewLocalGroup(1))
	defer comms[0].Close()
	acc := must(NewAccumulator([]TensorDesc{{2, F32}}, nil, nil))
	defer acc.Close()
	for _, w := range [][]byte{a, b} {
		if err := acc.MergeWindow(w); err != nil {
			t.Fatal(err)
		}
	}
	info := must(acc.Sync(comms[0]))
	if info.TotalCount != 4 || info.Microbatches != 2 || info.FoundInf {
		t.Fatalf("info %+v", info)
	}
	// Mean losses over 1 and 3 items, normalised by the 4 items: (1*a + 3*b) / 4.
	if got := must(acc.CopyMaster(0)); got[0] != 2.5 || got[1] != 4.25 {
		t.Fatalf("master %v, want [2.5 4.25]", got)
	}
}

func TestMergeWindowRefusesCorruptBytes(t *testing.T) {
	w := savedWindow(t, []float32{4, 8}, 2)
	acc := must(NewAccumulator([]TensorDesc{{2, F32}}, nil, nil))
	defer acc.Close()
	for _, bad := range [][]byte{{0}, []byte("not a window"), w[:len(w)-1]} {
		if err := acc.MergeWindow(bad); !errors.Is(err, &Error{Status: StatusCorruptState}) {
			t.Fatalf("%d bytes: %v", len(bad), err)
		}
	}
	if err := acc.MergeWindow(w); err != nil {
		t.Fatal(err)
	}
	info := must(acc.Sync(nil))
	if info.TotalCount != 2 || info.Microbatches != 1 { // the failed merges added nothing
		t.Fatalf("info %+v", info)
	}
	if got := must(acc.CopyMaster(0)); got[0] != 4 || got[1] != 8 {
		t.Fatalf("master %v", got)
	}
}

func TestTimeoutRoundTrip(t *testing.T) {
	comms := must(NewLocalGroup(2))
	defer comms[0].Close()
	defer comms[1].Close()
	c := comms[0]
	if got := must(c.Timeout()); got != 10*time.Minute {
		t.Fatalf("default %v", got)
	}
	if err := c.SetTimeout(2500 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	if got := must(c.Timeout()); got != 2500*time.Millisecond {
		t.Fatalf("got %v", got)
	}
	if got := must(comms[1].Timeout()); got != 10*time.Minute {
		t.Fatalf("the other rank's handle: %v", got)
	}
	if err := c.SetTimeout(0); err != nil {
		t.Fatal(err)
	}
	if got := must(c.Timeout()); got != 0 {
		t.Fatalf("forever: %v", got)
	}
	var e *Error
	if err := c.SetTimeout(-time.Second); !errors.As(err, &e) || e.Status != StatusInvalidArgument || e.Message == "" {
		t.Fatalf("negative: %v", err)
	}
	if got := must(c.Timeout()); got != 0 {
		t.Fatalf("a refused value changed it: %v", got)
	}
	comms[1].Close()
	if err := comms[1].SetTimeout(time.Second); !errors.Is(err, &Error{Status: StatusInvalidHandle}) {
		t.Fatalf("closed: %v", err)
	}
}

func TestAbortThenSyncFails(t *testing.T) {
	comms := must(NewLocalGroup(1))
	defer comms[0].Close()
	acc := must(NewAccumulator([]TensorDesc{{2, F32}}, nil, nil))
	defer acc.Close()
	oneMicrobatch(t, acc)
	if err := comms[0].Abort(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if _, err := acc.Sync(comms[0]); !errors.Is(err, &Error{Status: StatusCommFailure}) {
			t.Fatalf("sync %d after abort: %v", i, err)
		}
	}
}

func TestAbortWakesAPeerBlockedInSync(t *testing.T) {
	comms := must(NewLocalGroup(2))
	defer comms[0].Close()
	defer comms[1].Close()
	if err := comms[0].SetTimeout(time.Minute); err != nil { // a broken abort fails, not hangs
		t.Fatal(err)
	}
	acc := must(NewAccumulator([]TensorDesc{{2, F32}}, nil, nil))
	defer acc.Close()
	oneMicrobatch(t, acc)
	done := make(chan error)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		_, err := acc.Sync(comms[0]) // rank 1 never syncs
		done <- err
	}()
	time.Sleep(200 * time.Millisecond)
	if err := comms[1].Abort(); err != nil { // rank 1 gives up: the whole group fails
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, &Error{Status: StatusCommFailure}) {
		t.Fatalf("blocked sync: %v", err)
	}
}

func TestTimeoutFailsTheSyncAndAborts(t *testing.T) {
	comms := must(NewLocalGroup(2))
	defer comms[0].Close()
	defer comms[1].Close()
	if err := comms[0].SetTimeout(200 * time.Millisecond); err != nil {
		t.Fatal(err)
	}
	acc := must(NewAccumulator([]TensorDesc{{2, F32}}, nil, nil))
	defer acc.Close()
	oneMicrobatch(t, acc)
	if _, err := acc.Sync(comms[0]); !errors.Is(err, &Error{Status: StatusTimeout}) { // rank 1 never syncs
		t.Fatalf("got %v, want a timeout", err)
	}
	if _, err := acc.Sync(comms[0]); !errors.Is(err, &Error{Status: StatusCommFailure}) {
		t.Fatalf("after the timeout: %v", err)
	}
}
