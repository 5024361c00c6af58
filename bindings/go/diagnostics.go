package gradacc

// #include <stdlib.h>
// #include <gradacc.h>
// extern void gradaccGoLogMessage(void *user, int32_t level, char *message);
// static void gradacc_go_log(void *user, gradacc_log_level_t level, const char *message) {
//     gradaccGoLogMessage(user, level, (char *)message);
// }
// static enum gradacc_status_t gradacc_go_set_log(int on, gradacc_log_level_t level) {
//     return gradacc_set_log_callback(on ? gradacc_go_log : NULL, NULL, level);
// }
import "C"

import "unsafe"

// SetLogCallback sends the library's messages at level and more severe ones to fn, on the
// goroutine whose call produced them: a skipped step and its new loss scale, a dropped
// micro-batch, a CUDA library loaded or not, a SIMD path other than the one asked for
// (docs/diagnostics.md). fn nil, or LogOff, turns them off, back to the default (nothing, or
// stderr at the level the environment variable GRADACC_LOG names). fn must not call
// SetLogCallback.
func SetLogCallback(fn func(level LogLevel, message string), level LogLevel) error {
	setMu.Lock()
	defer setMu.Unlock()
	on, previous := C.int(0), logFn.Load()
	if fn != nil {
		// In place before the library can call it; put back if the library refuses.
		on = 1
		logFn.Store(&fn)
	}
	err := call(func() C.enum_gradacc_status_t { return C.gradacc_go_set_log(on, C.gradacc_log_level_t(level)) })
	switch {
	case err != nil:
		logFn.Store(previous)
	case fn == nil:
		logFn.Store(nil)
	}
	return err
}

// Diagnostics is the library's report for a bug report (gradacc_diagnostics, what the
// gradacc-info program prints): its version and file, the host's SIMD path, each backend
// available or why not, the CUDA driver, NVRTC and NCCL found or why not, and every environment
// variable the library reads.
func Diagnostics() (string, error) {
	var needed C.size_t
	if err := call(func() C.enum_gradacc_status_t { return C.gradacc_diagnostics(nil, 0, &needed) }); err != nil {
		return "", err
	}
	buf := (*C.char)(C.malloc(needed))
	defer C.free(unsafe.Pointer(buf))
	if err := call(func() C.enum_gradacc_status_t { return C.gradacc_diagnostics(buf, needed, nil) }); err != nil {
		return "", err
	}
	return C.GoString(buf), nil
}
