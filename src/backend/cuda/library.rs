//! Loads the run-time libraries of the CUDA path other than the driver (NVRTC, NCCL): the file
//! an environment variable names, or else the names real installs have, in order. Installs name
//! them differently (CUDA 13 ships only `libnvrtc.so.13`, the NCCL wheels only `libnccl.so.2`),
//! so a loader that tries one name misses most of them. When nothing loads, the error lists every
//! candidate and why it failed. The callers keep what they load in a `OnceLock`, so each library
//! is loaded once per process.

use std::ffi::{c_char, c_int, c_void, CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use libloading::Library;

use crate::error::{Error, ErrorKind};

/// A library to load.
pub(crate) struct Spec {
    /// What it is, for messages ("NVRTC").
    pub what: &'static str,
    /// The environment variable that names its file (a path, or a name the loader searches for);
    /// when set, it is the only candidate.
    pub env: &'static str,
    /// The names installs give it, in the order they are tried.
    pub names: &'static [&'static str],
    /// How to get it, appended to the error.
    pub hint: &'static str,
}

/// NVRTC: CUDA 13's first, then CUDA 12's, then the development link.
pub(crate) const NVRTC: Spec = Spec {
    what: "NVRTC",
    env: "GRADACC_NVRTC_LIBRARY",
    names: &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
    hint: "install the CUDA toolkit or the `nvidia-cuda-nvrtc` (CUDA 13) or `nvidia-cuda-nvrtc-cu12` wheel, \
           and put its lib folder on LD_LIBRARY_PATH or name the file in GRADACC_NVRTC_LIBRARY",
};

/// NCCL 2: the name its packages and wheels ship, then the development link.
pub(crate) const NCCL: Spec = Spec {
    what: "NCCL",
    env: "GRADACC_NCCL_LIBRARY",
    names: &["libnccl.so.2", "libnccl.so"],
    hint: "install NCCL or the `nvidia-nccl-cu13` or `nvidia-nccl-cu12` wheel, \
           and put its lib folder on LD_LIBRARY_PATH or name the file in GRADACC_NCCL_LIBRARY",
};

/// A candidate that opened.
pub(crate) struct Opened {
    pub library: Library,
    /// How it was asked for: the environment variable's value or a name, for messages.
    pub candidate: String,
    /// The real file (links resolved) when the candidate was a path; for a name, see [`file_of`].
    pub path: Option<PathBuf>,
}

impl Opened {
    /// Entry point `name` of the opened library, or why not ("it lacks nvrtcVersion: ...").
    ///
    /// # Safety
    /// `T` is the function-pointer type of `name`'s C prototype.
    pub(crate) unsafe fn symbol<T: Copy>(&self, name: &str) -> Result<T, String> {
        // SAFETY: the caller's contract: `T` is the symbol's type.
        unsafe { self.library.get::<T>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("it lacks {name}: {}", reason(&e, &self.candidate)))
    }
}

/// Loads `spec` from the candidates the environment gives it, see [`load_from`].
pub(crate) fn load<T>(
    spec: &Spec,
    accept: impl FnMut(Opened) -> Result<T, String>,
) -> Result<T, Error> {
    let value = std::env::var_os(spec.env).filter(|v| !v.is_empty());
    load_from(spec, value.as_deref(), accept)
}

/// Opens the candidates in order — `value` (the environment variable's) alone when given, else
/// `spec.names` — and hands each that opens to `accept`, which makes what the caller keeps
/// or says why this one does not do (the next is then tried). BACKEND_UNAVAILABLE when none
/// does, listing every candidate with its reason. A value with a `/` is a path: it is opened by
/// its real file, links resolved, so libraries it loads from its own folder are found there.
pub(crate) fn load_from<T>(
    spec: &Spec,
    value: Option<&OsStr>,
    mut accept: impl FnMut(Opened) -> Result<T, String>,
) -> Result<T, Error> {
    let candidates: Vec<(String, &OsStr)> = match value {
        Some(value) => vec![(format!("{}={}", spec.env, value.to_string_lossy()), value)],
        None => spec.names.iter().map(|&name| (name.to_string(), OsStr::new(name))).collect(),
    };
    let mut tried = Vec::with_capacity(candidates.len());
    for (label, file) in candidates {
        match open(file).and_then(|(library, path)| {
            accept(Opened { library, candidate: file.to_string_lossy().into_owned(), path })
        }) {
            Ok(kept) => {
                log::info!("{} loaded: {label}", spec.what);
                return Ok(kept);
            }
            Err(why) => {
                log::debug!("{} not loaded from {label}: {why}", spec.what);
                tried.push(format!("{label} ({why})"));
            }
        }
    }
    log::info!("{} could not be loaded: the CUDA path is unavailable", spec.what);
    Err(Error::new(
        ErrorKind::BackendUnavailable,
        format!(
            "{} could not be loaded; tried {}. To fix: {}",
            spec.what,
            tried.join(", "),
            spec.hint
        ),
    ))
}

/// Opens `file` (a path, by its real file, or a name the dynamic loader searches for).
fn open(file: &OsStr) -> Result<(Library, Option<PathBuf>), String> {
    if file.as_bytes().contains(&b'/') {
        let real = std::fs::canonicalize(file).map_err(|e| format!("cannot open it: {e}"))?;
        // SAFETY: loading runs the library's initialisers. The file is the one the user named for
        // this library (NVRTC or NCCL), whose initialisers have no preconditions on the caller.
        let library =
            unsafe { Library::new(&real) }.map_err(|e| reason(&e, &real.to_string_lossy()))?;
        Ok((library, Some(real)))
    } else {
        // SAFETY: as above, for a library the dynamic loader finds by one of its install names.
        let library =
            unsafe { Library::new(file) }.map_err(|e| reason(&e, &file.to_string_lossy()))?;
        Ok((library, None))
    }
}

/// Opens `path` with its symbols global (RTLD_NOW | RTLD_GLOBAL), so a later `dlopen` of its
/// name, from another library, finds it loaded.
pub(crate) fn open_global(path: &Path) -> Result<Library, String> {
    use libloading::os::unix::{Library as UnixLibrary, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading runs the library's initialisers; the callers open only companion libraries
    // of a library already loaded (NVRTC's builtins), whose initialisers have no preconditions.
    let library = unsafe { UnixLibrary::open(Some(path), RTLD_NOW | RTLD_GLOBAL) }
        .map_err(|e| reason(&e, &path.to_string_lossy()))?;
    Ok(library.into())
}

/// Why a libloading call failed: the dynamic loader's own message (libloading's `Display` says
/// only "dlopen failed"), without the file name it starts with, which the caller already gives.
pub(crate) fn reason(error: &libloading::Error, file: &str) -> String {
    let text = std::error::Error::source(error)
        .map(ToString::to_string)
        .unwrap_or_else(|| error.to_string());
    text.strip_prefix(file).and_then(|t| t.strip_prefix(": ")).map(str::to_string).unwrap_or(text)
}

/// `Dl_info` of dlfcn.h.
#[repr(C)]
struct DlInfo {
    fname: *const c_char,
    fbase: *mut c_void,
    sname: *const c_char,
    saddr: *mut c_void,
}

extern "C" {
    // In libdl (glibc before 2.34) or libc; libloading links libdl already.
    fn dladdr(address: *const c_void, info: *mut DlInfo) -> c_int;
}

/// The real file (links resolved) of the loaded object that holds `address`, such as one of its
/// functions; None if the dynamic loader does not know it.
pub(crate) fn file_of(address: *const c_void) -> Option<PathBuf> {
    let mut info = DlInfo {
        fname: std::ptr::null(),
        fbase: std::ptr::null_mut(),
        sname: std::ptr::null(),
        saddr: std::ptr::null_mut(),
    };
    // SAFETY: dladdr only reads the loader's tables for `address` (any value is allowed) and
    // writes `info`, a live local of the `Dl_info` layout.
    if unsafe { dladdr(address, &mut info) } == 0 || info.fname.is_null() {
        return None;
    }
    // SAFETY: non-null, so the loader's NUL-terminated name of that object, copied at once.
    let name = unsafe { CStr::from_ptr(info.fname) };
    std::fs::canonicalize(OsStr::from_bytes(name.to_bytes())).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MISSING: Spec = Spec {
        what: "Gradacc-missing",
        env: "GRADACC_NOTHING_LIBRARY",
        names: &["libgradacc-missing-a.so.1", "libgradacc-missing-b.so"],
        hint: "it does not exist",
    };

    fn fails(spec: &Spec, value: Option<&OsStr>) -> Error {
        load_from(spec, value, |_| Ok(())).expect_err("nothing should load")
    }

    #[test]
    fn an_override_naming_a_missing_file_fails_naming_it() {
        let e = fails(&NVRTC, Some(OsStr::new("/nonexistent/folder/libnvrtc.so.13")));
        assert_eq!(e.kind, ErrorKind::BackendUnavailable);
        assert!(e.message.contains("GRADACC_NVRTC_LIBRARY=/nonexistent/folder/libnvrtc.so.13 (cannot open it: No such file"), "{}", e.message);
        // The override is the only candidate: the install names are not tried behind its back.
        assert!(
            !e.message.contains("tried libnvrtc.so.12") && !e.message.contains(", libnvrtc.so.12"),
            "{}",
            e.message
        );
        let e = fails(&NCCL, Some(OsStr::new("libgradacc-no-such-nccl.so.2")));
        assert!(
            e.message.contains(
                "GRADACC_NCCL_LIBRARY=libgradacc-no-such-nccl.so.2 (cannot open shared object file"
            ),
            "{}",
            e.message
        );
    }

    #[test]
    fn an_override_naming_a_file_that_is_no_library_fails_saying_why() {
        let path =
            std::env::temp_dir().join(format!("gradacc-not-a-library-{}.so", std::process::id()));
        std::fs::write(&path, "this is text, not an ELF shared object\n").unwrap();
        let e = fails(&NCCL, Some(path.as_os_str()));
        std::fs::remove_file(&path).unwrap();
        let expected = format!("GRADACC_NCCL_LIBRARY={} (", path.display());
        assert!(e.message.contains(&expected), "{}", e.message);
        assert!(
            e.message.contains("invalid ELF header") || e.message.contains("file too short"),
            "{}",
            e.message
        );
    }

    #[test]
    fn with_nothing_to_load_the_error_lists_every_candidate() {
        let e = fails(&MISSING, None);
        assert_eq!(e.kind, ErrorKind::BackendUnavailable);
        assert!(
            e.message.starts_with(
                "Gradacc-missing could not be loaded; tried libgradacc-missing-a.so.1 (cannot open shared object file: No such file or directory), \
                 libgradacc-missing-b.so (cannot open shared object file: No such file or directory). To fix: it does not exist"
            ),
            "{}",
            e.message
        );
        // The real lists, where the libraries are not installed (the CPU suite runs without them).
        for spec in [&NVRTC, &NCCL] {
            if let Err(e) = load_from(spec, None, |_| Ok(())) {
                for name in spec.names {
                    assert!(
                        e.message.contains(&format!("{name} (")),
                        "{name} is not listed: {}",
                        e.message
                    );
                }
                assert!(e.message.contains(spec.env), "{}", e.message);
            }
        }
    }

    #[test]
    fn a_candidate_the_caller_refuses_is_listed_with_its_reason_and_the_next_one_tried() {
        // libc loads everywhere: refused first under one name, kept under the next.
        let spec = Spec {
            what: "C",
            env: "GRADACC_C_LIBRARY",
            names: &["libc.so.6", "libc.so.6"],
            hint: "",
        };
        let mut calls = 0;
        let kept = load_from(&spec, None, |opened| {
            calls += 1;
            assert_eq!(opened.candidate, "libc.so.6");
            assert!(opened.path.is_none());
            if calls == 1 {
                return Err("too old".into());
            }
            // SAFETY: getpid has no preconditions and this is its C prototype.
            let getpid = unsafe { opened.library.get::<unsafe extern "C" fn() -> c_int>("getpid") }
                .map_err(|e| reason(&e, "libc"))?;
            let file = file_of(*getpid as *const c_void).ok_or("no file")?;
            Ok(file)
        })
        .unwrap();
        assert_eq!(calls, 2);
        assert!(
            kept.is_absolute() && kept.file_name().unwrap().to_string_lossy().starts_with("libc"),
            "{}",
            kept.display()
        );
    }
}
