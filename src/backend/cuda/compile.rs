//! NVRTC: the kernels' CUDA C source compiled at run time, to CUBIN for the device's exact
//! architecture (PTX when NVRTC does not know the device yet), once per device per process.
//! Also what CI runs, without a GPU, to prove every kernel compiles for every target.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::Library;

use super::library::{self, Opened};
use crate::error::{Error, ErrorKind, Result};

/// The kernels: the per-element math (also compiled on the host by the tests), then the kernels.
pub const SOURCE: &str =
    concat!(include_str!("kernels/math.cuh"), "\n", include_str!("kernels/kernels.cu"));

/// Every kernel the backend launches, as `extern "C"` names.
pub const KERNELS: [&str; 22] = [
    "ga_add_multi",
    "ga_add_one",
    "ga_check_multi",
    "ga_merge",
    "ga_count_flags",
    "ga_pack_control",
    "ga_or_flag",
    "ga_to_bf16",
    "ga_sum_bf16",
    "ga_begin_boundary",
    "ga_scale_sum_squares",
    "ga_segment_squares",
    "ga_finish_norm",
    "ga_scale_by",
    "ga_scaler_gather",
    "ga_scaler_update",
    "ga_scale_loss",
    "ga_opt_step",
    "ga_opt_advance",
    "ga_claim_schedule",
    "ga_opt_copy",
    "ga_layout_sizes",
];

/// Options of every compilation: explicitly rounded arithmetic only (math.cuh uses the `_rn`
/// intrinsics; this forbids contraction anywhere else too), and C++17.
const OPTIONS: [&str; 2] = ["--fmad=false", "--std=c++17"];

/// The one diagnostic NVRTC 12.x prints for every pre-Turing target: a notice about the
/// toolkit, not about the code, so the warning check ignores exactly this line.
const PRE_TURING_NOTICE: &str = "Architectures prior to '<compute/sm>_75' are deprecated";

/// What to compile for: machine code for one architecture, or PTX for a virtual one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// `sm_XY` machine code, loadable by a device of exactly that architecture.
    Cubin(u32),
    /// `compute_XY` PTX, compiled by the driver for any device of at least that architecture.
    Ptx(u32),
}

impl Target {
    /// The target for a device of compute capability `major.minor`: its exact CUBIN when this
    /// NVRTC knows the architecture, else PTX for the newest architecture it knows that the
    /// device runs.
    pub fn for_device(major: i32, minor: i32) -> Result<Target> {
        let arch = (major * 10 + minor) as u32;
        let known = supported_architectures()?;
        if known.contains(&arch) {
            return Ok(Target::Cubin(arch));
        }
        known.iter().copied().filter(|&a| a <= arch).max().map(Target::Ptx).ok_or_else(|| {
            Error::new(
                ErrorKind::BackendUnavailable,
                format!("NVRTC cannot compile for sm_{arch} (it knows {known:?})"),
            )
        })
    }

    fn option(self) -> String {
        match self {
            Target::Cubin(arch) => format!("--gpu-architecture=sm_{arch}"),
            Target::Ptx(arch) => format!("--gpu-architecture=compute_{arch}"),
        }
    }
}

/// A compiled image and NVRTC's diagnostics.
pub struct Compiled {
    /// CUBIN bytes, or PTX text with its terminating NUL (as cuModuleLoadData takes it).
    pub image: Vec<u8>,
    /// Warnings NVRTC printed, minus the pre-Turing notice; CI requires none.
    pub warnings: Vec<String>,
}

/// Whether NVRTC loads (never panics). Loaded once: see `nvrtc()`.
pub fn nvrtc_available() -> bool {
    nvrtc().is_ok()
}

/// BACKEND_UNAVAILABLE unless NVRTC loads, listing every library tried and why each failed.
pub fn require_nvrtc() -> Result<()> {
    nvrtc().map(|_| ())
}

/// NVRTC's version, as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    Ok(nvrtc()?.version)
}

/// The file NVRTC was loaded from (links resolved), or the name it was loaded by where the
/// dynamic loader does not say.
pub fn nvrtc_file() -> Result<String> {
    Ok(nvrtc()?.file.clone())
}

/// The architectures this NVRTC can compile for (as 75, 80, 90, ...).
pub fn supported_architectures() -> Result<Vec<u32>> {
    let api = nvrtc()?;
    let mut n = 0;
    // SAFETY: an entry point of the loaded NVRTC with its nvrtc.h prototype; `n` is a live local
    // `int` for the count.
    api.check(unsafe { (api.get_num_supported_archs)(&mut n) }, "nvrtcGetNumSupportedArchs")?;
    let mut archs = vec![0; n.max(0) as usize];
    // SAFETY: NVRTC writes as many `int`s as it just counted, and `archs` holds exactly `n` of
    // them.
    api.check(unsafe { (api.get_supported_archs)(archs.as_mut_ptr()) }, "nvrtcGetSupportedArchs")?;
    Ok(archs.into_iter().map(|a| a as u32).collect())
}

/// Compiles [`SOURCE`] for `target`. Errors carry NVRTC's log.
pub fn compile(target: Target) -> Result<Compiled> {
    compile_source(SOURCE, target)
}

/// Compiles `source` (the kernels, or a test's variant of them) for `target` with the kernels'
/// options. Errors carry NVRTC's log.
pub fn compile_source(source: &str, target: Target) -> Result<Compiled> {
    let api = nvrtc()?;
    let source =
        CString::new(source).map_err(|_| Error::invalid("the CUDA source contains a NUL byte"))?;
    let name = c"gradacc_kernels.cu";
    let mut program = std::ptr::null_mut();
    api.check(
        // SAFETY: an entry point of the loaded NVRTC with its nvrtc.h prototype; `source` and
        // `name` are NUL-terminated and outlive the call (NVRTC copies them); zero headers, so
        // both header arrays may be null.
        unsafe {
            (api.create_program)(
                &mut program,
                source.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        },
        "nvrtcCreateProgram",
    )?;
    let result = compile_program(api, program, target);
    // SAFETY: `program` was created above (the `?` returned before this if creation failed), and
    // `compile_program` has returned, so nothing uses it after it is destroyed here, once.
    unsafe { (api.destroy_program)(&mut program) };
    result
}

fn compile_program(api: &Nvrtc, program: Program, target: Target) -> Result<Compiled> {
    // The launch geometry the Rust side uses, so kernels and launches cannot disagree.
    let geometry = [
        format!("-DGA_THREADS={}", super::driver::THREADS),
        format!("-DGA_CHUNK={}", super::store::CHUNK),
    ];
    let options: Vec<CString> = OPTIONS
        .iter()
        .map(|o| o.to_string())
        .chain(geometry)
        .chain([target.option()])
        .map(|o| CString::new(o).expect("option has no NUL"))
        .collect();
    let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `program` is live (created by the only caller, `compile_source`, which destroys it
    // after this returns); `pointers` holds `pointers.len()` NUL-terminated strings owned by
    // `options`, which outlives the call.
    let status =
        unsafe { (api.compile_program)(program, pointers.len() as c_int, pointers.as_ptr()) };
    let log = program_log(api, program)?;
    if status != SUCCESS {
        return Err(Error::new(
            ErrorKind::Internal,
            format!(
                "NVRTC could not compile the kernels for {target:?}: {}\n{log}",
                api.result_name(status)
            ),
        ));
    }
    let warnings = log
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.contains(PRE_TURING_NOTICE))
        .map(String::from)
        .collect();
    let image = match target {
        Target::Cubin(_) => {
            let mut size = 0;
            // SAFETY: a live program (see `nvrtcCompileProgram` above) and a live `size_t`
            // out-pointer.
            api.check(unsafe { (api.get_cubin_size)(program, &mut size) }, "nvrtcGetCUBINSize")?;
            let mut image = vec![0u8; size];
            api.check(
                // SAFETY: NVRTC writes the CUBIN's `size` bytes, the length `image` was just given.
                unsafe { (api.get_cubin)(program, image.as_mut_ptr() as *mut c_char) },
                "nvrtcGetCUBIN",
            )?;
            image
        }
        Target::Ptx(_) => {
            let mut size = 0;
            // SAFETY: a live program (see `nvrtcCompileProgram` above) and a live `size_t`
            // out-pointer.
            api.check(unsafe { (api.get_ptx_size)(program, &mut size) }, "nvrtcGetPTXSize")?;
            let mut image = vec![0u8; size];
            api.check(
                // SAFETY: NVRTC writes the PTX's `size` bytes (NUL included), the length `image`
                // was just given.
                unsafe { (api.get_ptx)(program, image.as_mut_ptr() as *mut c_char) },
                "nvrtcGetPTX",
            )?;
            image
        }
    };
    Ok(Compiled { image, warnings })
}

fn program_log(api: &Nvrtc, program: Program) -> Result<String> {
    let mut size = 0;
    // SAFETY: `program` is live: the only caller, `compile_program`, has it from `compile_source`,
    // which destroys it later; `size` is a live `size_t` out-pointer.
    api.check(unsafe { (api.get_program_log_size)(program, &mut size) }, "nvrtcGetProgramLogSize")?;
    let mut log = vec![0u8; size.max(1)];
    api.check(
        // SAFETY: NVRTC writes `size` bytes (NUL included); `log` holds at least that many.
        unsafe { (api.get_program_log)(program, log.as_mut_ptr() as *mut c_char) },
        "nvrtcGetProgramLog",
    )?;
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    Ok(String::from_utf8_lossy(&log[..end]).into_owned())
}

/// `nvrtcProgram`: an opaque handle.
type Program = *mut c_void;

/// `NVRTC_SUCCESS`.
const SUCCESS: c_int = 0;

/// The NVRTC entry points gradacc calls, resolved from the library [`library::NVRTC`] loads and
/// typed to return the raw `nvrtcResult` number: a code outside a Rust enum (from a newer NVRTC)
/// would be undefined behaviour before any check could look at it.
struct Nvrtc {
    /// Where it was loaded from, for messages.
    file: String,
    version: (i32, i32),
    get_num_supported_archs: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_supported_archs: unsafe extern "C" fn(*mut c_int) -> c_int,
    create_program: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int,
    get_cubin_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    get_cubin: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    get_ptx_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    get_ptx: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    get_program_log_size: unsafe extern "C" fn(Program, *mut usize) -> c_int,
    get_program_log: unsafe extern "C" fn(Program, *mut c_char) -> c_int,
    destroy_program: unsafe extern "C" fn(*mut Program) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    /// Kept open for the entry points above, and the builtins NVRTC loads by name at its first
    /// compilation (see [`builtins_beside`]).
    _library: Library,
    _builtins: Option<Library>,
}

/// NVRTC, loaded once per process by [`library::NVRTC`]'s candidates: the first that resolves
/// every entry point and is not newer than the driver (where one loads), or why none would do.
fn nvrtc() -> Result<&'static Nvrtc> {
    static NVRTC: OnceLock<Result<Nvrtc>> = OnceLock::new();
    NVRTC
        .get_or_init(|| library::load(&library::NVRTC, Nvrtc::accept))
        .as_ref()
        .map_err(Clone::clone)
}

impl Nvrtc {
    /// The table of one candidate, or why it does not do: an entry point is missing, or it is
    /// newer than the driver. A CUBIN records the ELF ABI of the NVRTC that made it (CUDA 13's
    /// is v8) and an older driver refuses it, as it refuses PTX of a newer ISA; so an NVRTC of a
    /// later major version than the driver's is skipped for the next candidate.
    fn accept(opened: Opened) -> std::result::Result<Nvrtc, String> {
        macro_rules! resolve {
            ($name:literal) => {
                // SAFETY: each field's type is the C prototype of the symbol in nvrtc.h, with
                // nvrtcResult (a C enum, an int) as c_int and nvrtcProgram as a pointer.
                unsafe { opened.symbol($name) }?
            };
        }
        let version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int =
            resolve!("nvrtcVersion");
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion's prototype; both out-pointers are live locals.
        let status = unsafe { version(&mut major, &mut minor) };
        if status != SUCCESS {
            return Err(format!("nvrtcVersion failed with code {status}"));
        }
        if let Some(why) = super::driver::driver_version()
            .and_then(|driver| newer_than_driver((major, minor), driver))
        {
            return Err(why);
        }
        let file = opened.path.clone().or_else(|| library::file_of(version as *const c_void));
        let builtins = match file.as_deref().and_then(|f| builtins_beside(f, major, minor)) {
            Some(path) => Some(
                library::open_global(&path)
                    .map_err(|e| format!("its builtins {}: {e}", path.display()))?,
            ),
            None => None,
        };
        Ok(Nvrtc {
            file: file.map_or_else(|| opened.candidate.clone(), |f| f.display().to_string()),
            version: (major, minor),
            get_num_supported_archs: resolve!("nvrtcGetNumSupportedArchs"),
            get_supported_archs: resolve!("nvrtcGetSupportedArchs"),
            create_program: resolve!("nvrtcCreateProgram"),
            compile_program: resolve!("nvrtcCompileProgram"),
            get_cubin_size: resolve!("nvrtcGetCUBINSize"),
            get_cubin: resolve!("nvrtcGetCUBIN"),
            get_ptx_size: resolve!("nvrtcGetPTXSize"),
            get_ptx: resolve!("nvrtcGetPTX"),
            get_program_log_size: resolve!("nvrtcGetProgramLogSize"),
            get_program_log: resolve!("nvrtcGetProgramLog"),
            destroy_program: resolve!("nvrtcDestroyProgram"),
            get_error_string: resolve!("nvrtcGetErrorString"),
            _library: opened.library,
            _builtins: builtins,
        })
    }

    /// NVRTC's name for result `code` ("NVRTC_ERROR_COMPILATION"), with the number.
    fn result_name(&self, code: c_int) -> String {
        // SAFETY: nvrtcGetErrorString takes any code and returns a static NUL-terminated string,
        // or null.
        let text = unsafe { (self.get_error_string)(code) };
        if text.is_null() {
            return format!("code {code}");
        }
        // SAFETY: non-null, so a static NUL-terminated string.
        format!("{} (code {code})", unsafe { CStr::from_ptr(text) }.to_string_lossy())
    }

    /// Ok for NVRTC_SUCCESS, otherwise an error naming `what` and the result.
    fn check(&self, result: c_int, what: &str) -> Result<()> {
        if result == SUCCESS {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::Internal,
                format!("{what} failed: {}", self.result_name(result)),
            ))
        }
    }
}

/// Why NVRTC `version` cannot compile for a driver of CUDA version `driver` (as 12080 for 12.8),
/// if it cannot: it is of a later major version.
fn newer_than_driver(version: (i32, i32), driver: i32) -> Option<String> {
    let (major, minor) = version;
    (major > driver / 1000).then(|| {
        format!(
            "NVRTC {major}.{minor} is newer than the driver, which supports CUDA {}.{}: its CUBIN would not load",
            driver / 1000,
            driver % 1000 / 10
        )
    })
}

/// NVRTC's builtins library beside the NVRTC file `nvrtc`: `libnvrtc-builtins.so.<major>.<minor>`,
/// else a file of that version with a longer suffix (`.so.13.0.88`): NVRTC asks for its own
/// version's by name, so another version's would not be the one it finds. NVRTC loads it at its
/// first compilation, and finds it only in NVRTC's own folder as the dynamic loader sees it (CUDA
/// 13's NVRTC: not through a link in another folder) or on the search path; loaded beforehand,
/// it is found loaded.
fn builtins_beside(nvrtc: &Path, major: i32, minor: i32) -> Option<PathBuf> {
    let folder = nvrtc.parent()?;
    let exact = folder.join(format!("libnvrtc-builtins.so.{major}.{minor}"));
    if exact.is_file() {
        return Some(exact);
    }
    let prefix = format!("libnvrtc-builtins.so.{major}.{minor}.");
    std::fs::read_dir(folder)
        .ok()?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix))
        })
        .max()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_nvrtc_of_a_later_major_version_than_the_driver_is_refused() {
        assert_eq!(
            newer_than_driver((13, 0), 12080).as_deref(),
            Some("NVRTC 13.0 is newer than the driver, which supports CUDA 12.8: its CUBIN would not load")
        );
        assert_eq!(
            newer_than_driver((12, 9), 12020),
            None,
            "a later minor version is fine: the CUBIN's ABI is the major version's"
        );
        assert_eq!(newer_than_driver((12, 8), 13000), None);
        assert_eq!(newer_than_driver((13, 0), 13000), None);
    }

    #[test]
    fn the_builtins_are_found_beside_nvrtc_by_version() {
        let folder = std::env::temp_dir().join(format!("gradacc-builtins-{}", std::process::id()));
        std::fs::create_dir_all(&folder).unwrap();
        let nvrtc = folder.join("libnvrtc.so.13");
        for name in [
            "libnvrtc.so.13",
            "libnvrtc-builtins.so.13.5",
            "libnvrtc-builtins.alt.so.13.5",
            "libnvrtc-builtins.so.12.9.86",
        ] {
            std::fs::write(folder.join(name), "").unwrap();
        }
        let found = [
            builtins_beside(&nvrtc, 13, 5),
            builtins_beside(&nvrtc, 13, 0),
            builtins_beside(&nvrtc, 12, 9),
            builtins_beside(&nvrtc, 11, 8),
        ];
        std::fs::remove_dir_all(&folder).unwrap();
        let name = |p: &Option<PathBuf>| {
            p.as_ref().map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        };
        assert_eq!(name(&found[0]).as_deref(), Some("libnvrtc-builtins.so.13.5"));
        assert_eq!(found[1], None, "another minor version is not NVRTC 13.0's");
        assert_eq!(
            name(&found[2]).as_deref(),
            Some("libnvrtc-builtins.so.12.9.86"),
            "the version with a longer suffix"
        );
        assert_eq!(found[3], None);
    }
}
