//! What the library tells its caller: the messages of the `log` facade (a skipped step, a scale
//! change, a dropped micro-batch, a fallback of the SIMD path or of library loading) forwarded to
//! the callback `gradacc_set_log_callback` sets, else to stderr at the level `GRADACC_LOG` names,
//! else nowhere, which is the default; and the diagnostic report, `gradacc_diagnostics`.

use std::ffi::{c_char, c_void, CString};
use std::sync::OnceLock;

use gradacc::Error;
use log::{Level, LevelFilter, Log, Metadata, Record};
use parking_lot::RwLock;

use crate::status::{gradacc_status_t, guard, null};

/// A message's level, or the least severe level a callback receives.
pub type gradacc_log_level_t = i32;
/// No messages.
pub const GRADACC_LOG_OFF: gradacc_log_level_t = 0;
/// A call failed in a way its status alone does not tell.
pub const GRADACC_LOG_ERROR: gradacc_log_level_t = 1;
/// A setting was not honoured (an unknown or unsupported GRADACC_CPU_ISA).
pub const GRADACC_LOG_WARN: gradacc_log_level_t = 2;
/// What a training run wants to know: a skipped step and the loss scale it backed off to, a
/// dropped micro-batch, a CUDA library loaded (and from where) or not.
pub const GRADACC_LOG_INFO: gradacc_log_level_t = 3;
/// The rest: a grown loss scale, each library candidate that did not load, the SIMD path chosen.
pub const GRADACC_LOG_DEBUG: gradacc_log_level_t = 4;

/// A log callback: `message` (NUL-terminated, valid only during the call) at `level`, with the
/// `user` pointer given to gradacc_set_log_callback. It is called on the thread whose call
/// produced the message, possibly from several threads at once, and must not call
/// gradacc_set_log_callback.
pub type gradacc_log_fn = Option<
    unsafe extern "C" fn(user: *mut c_void, level: gradacc_log_level_t, message: *const c_char),
>;

/// The caller's callback and its user pointer (an address: the caller vouches for its use from
/// any thread).
#[derive(Clone, Copy)]
struct Callback {
    call: unsafe extern "C" fn(*mut c_void, gradacc_log_level_t, *const c_char),
    user: usize,
}

static CALLBACK: RwLock<Option<Callback>> = RwLock::new(None);

/// `GRADACC_LOG`'s level: where messages go while no callback is set.
fn stderr_level() -> LevelFilter {
    static LEVEL: OnceLock<LevelFilter> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        std::env::var("GRADACC_LOG")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(LevelFilter::Off)
    })
}

struct Forward;

impl Log for Forward {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        // Read recursively: a callback that makes a call which logs must not wait for a writer.
        match *CALLBACK.read_recursive() {
            Some(cb) => {
                let text =
                    CString::new(record.args().to_string().replace('\0', "?")).unwrap_or_default();
                // SAFETY: the caller's callback, with the user pointer it gave and a
                // NUL-terminated message that lives through the call (the header's contract).
                unsafe {
                    (cb.call)(cb.user as *mut c_void, level_to_c(record.level()), text.as_ptr())
                };
            }
            None => {
                eprintln!("gradacc {}: {}", record.level().as_str().to_lowercase(), record.args())
            }
        }
    }

    fn flush(&self) {}
}

/// Installs the forwarding logger once per process (every entry point's guard calls this), at
/// `GRADACC_LOG`'s level until a callback is set.
pub(crate) fn install() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        if log::set_logger(&Forward).is_ok() {
            log::set_max_level(stderr_level());
        }
    });
}

fn level_to_c(level: Level) -> gradacc_log_level_t {
    match level {
        Level::Error => GRADACC_LOG_ERROR,
        Level::Warn => GRADACC_LOG_WARN,
        Level::Info => GRADACC_LOG_INFO,
        Level::Debug | Level::Trace => GRADACC_LOG_DEBUG,
    }
}

fn level_from_c(level: gradacc_log_level_t) -> Result<LevelFilter, Error> {
    Ok(match level {
        GRADACC_LOG_OFF => LevelFilter::Off,
        GRADACC_LOG_ERROR => LevelFilter::Error,
        GRADACC_LOG_WARN => LevelFilter::Warn,
        GRADACC_LOG_INFO => LevelFilter::Info,
        GRADACC_LOG_DEBUG => LevelFilter::Debug,
        v => return Err(Error::invalid(format!("`level` = {v} is not a GRADACC_LOG_* value"))),
    })
}

/// Sends the library's messages at `level` and more severe ones (GRADACC_LOG_WARN: warnings and
/// errors) to `callback`, with `user` passed back unchanged; NULL `callback` (or
/// GRADACC_LOG_OFF) turns them off, back to the default: nothing, or stderr at the level the
/// environment variable `GRADACC_LOG` names (error, warn, info, debug). The messages say what
/// the statuses do not: a skipped step and its new loss scale, a dropped micro-batch, a CUDA
/// library loaded or not, a SIMD path other than the one asked for. Fails with INVALID_ARGUMENT
/// on an unknown `level`, changing nothing.
///
/// Thread safety: any thread, but not from inside the callback.
#[no_mangle]
pub unsafe extern "C" fn gradacc_set_log_callback(
    callback: gradacc_log_fn,
    user: *mut c_void,
    level: gradacc_log_level_t,
) -> gradacc_status_t {
    guard("gradacc_set_log_callback", || {
        let filter = level_from_c(level)?;
        let mut slot = CALLBACK.write();
        let on = callback.filter(|_| filter != LevelFilter::Off);
        *slot = on.map(|call| Callback { call, user: user as usize });
        log::set_max_level(if slot.is_some() { filter } else { stderr_level() });
        Ok(())
    })
}

/// Writes the diagnostic report into `buf`, NUL-terminated, as snprintf does: the library's
/// version and file, the host and its SIMD path, each backend available or why not, the CUDA
/// driver, NVRTC and NCCL found (version and file) or why not, and every environment variable
/// the library reads. At most `size - 1` characters are written; `*needed` (when `needed` is not
/// NULL) receives the report's whole size, terminating NUL included, so a call with `buf` NULL
/// and `size` 0 asks for it. The `gradacc-info` program prints it. Fails with NULL_ARGUMENT when
/// `buf` is NULL and `size` is not 0.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_diagnostics(
    buf: *mut c_char,
    size: usize,
    needed: *mut usize,
) -> gradacc_status_t {
    guard("gradacc_diagnostics", || {
        if buf.is_null() && size != 0 {
            return Err(null("buf"));
        }
        let report = gradacc::diagnostics();
        let bytes = report.as_bytes();
        // SAFETY: a non-null `needed` points to a writable size_t (API contract).
        if let Some(needed) = unsafe { needed.as_mut() } {
            *needed = bytes.len() + 1;
        }
        if size > 0 {
            let n = bytes.len().min(size - 1);
            // SAFETY: `buf` holds `size` writable bytes (API contract) and `n + 1 <= size`; the
            // report is a separate allocation.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.cast::<u8>(), n);
                *buf.add(n) = 0;
            }
        }
        Ok(())
    })
}
