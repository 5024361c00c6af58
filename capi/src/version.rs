//! Run-time version query; the header's GRADACC_VERSION_* macros come from the same Cargo.toml.

use std::ffi::c_char;
use std::sync::LazyLock;

static VERSION_C: LazyLock<std::ffi::CString> =
    LazyLock::new(|| std::ffi::CString::new(gradacc::VERSION).unwrap());

/// The loaded library's version as "MAJOR.MINOR.PATCH" (static storage, never NULL). Compare with
/// GRADACC_VERSION_STRING to detect a header/library mismatch.
///
/// Thread safety: any thread.
#[no_mangle]
pub extern "C" fn gradacc_version_string() -> *const c_char {
    VERSION_C.as_ptr()
}

/// The loaded library's version as MAJOR * 10000 + MINOR * 100 + PATCH.
///
/// Thread safety: any thread.
#[no_mangle]
pub extern "C" fn gradacc_version_number() -> u32 {
    let mut parts = gradacc::VERSION.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor, patch) =
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    major * 10000 + minor * 100 + patch
}
