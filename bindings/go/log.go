package gradacc

// #include <stdint.h>
import "C"

import (
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"
)

// LogLevel is a GRADACC_LOG_* level: of a message, or the least severe one a callback receives.
type LogLevel int32

const (
	LogOff   LogLevel = 0
	LogError LogLevel = 1
	LogWarn  LogLevel = 2
	LogInfo  LogLevel = 3
	LogDebug LogLevel = 4
)

// String is the level's name: off, error, warn, info or debug.
func (l LogLevel) String() string {
	names := [...]string{"off", "error", "warn", "info", "debug"}
	if l >= 0 && int(l) < len(names) {
		return names[l]
	}
	return fmt.Sprintf("LogLevel(%d)", int32(l))
}

var (
	// setMu serialises SetLogCallback; the library's calls into Go never take it, so a message
	// being delivered while the callback changes cannot wait for it.
	setMu sync.Mutex
	logFn atomic.Pointer[func(LogLevel, string)]
)

//export gradaccGoLogMessage
func gradaccGoLogMessage(_ unsafe.Pointer, level C.int32_t, message *C.char) {
	if fn := logFn.Load(); fn != nil {
		(*fn)(LogLevel(level), C.GoString(message))
	}
}
