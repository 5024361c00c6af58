//! NVRTC: the kernels' CUDA C source compiled at run time, to CUBIN for the device's exact
//! architecture (PTX when NVRTC does not know the device yet), once per device per process.
//! Also what CI runs, without a GPU, to prove every kernel compiles for every target.

use std::ffi::{c_char, CString};
use std::sync::OnceLock;

use cudarc::nvrtc::sys::{self, nvrtcResult};

use crate::error::{Error, ErrorKind, Result};

/// The kernels: the per-element math (also compiled on the host by the tests), then the kernels.
pub const SOURCE: &str = concat!(include_str!("kernels/math.cuh"), "\n", include_str!("kernels/kernels.cu"));

/// Every kernel the backend launches, as `extern "C"` names.
pub const KERNELS: [&str; 14] = [
    "ga_add_multi",
    "ga_add_one",
    "ga_pack_control",
    "ga_or_flag",
    "ga_to_bf16",
    "ga_sum_bf16",
    "ga_begin_boundary",
    "ga_scale_sum_squares",
    "ga_finish_norm",
    "ga_scale_by",
    "ga_scaler_gather",
    "ga_scaler_update",
    "ga_scale_loss",
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
        known
            .iter()
            .copied()
            .filter(|&a| a <= arch)
            .max()
            .map(Target::Ptx)
            .ok_or_else(|| Error::new(ErrorKind::BackendUnavailable, format!("NVRTC cannot compile for sm_{arch} (it knows {known:?})")))
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

/// Whether the NVRTC library can be loaded (never panics). Probed once: the probe opens and
/// closes the library, and every CUDA entry point asks.
pub fn nvrtc_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries to dlopen the library by its usual names and closes
    // it again; it calls no NVRTC entry point, so it is sound whether or not NVRTC exists.
    *AVAILABLE.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// NVRTC's version, as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: `require_nvrtc` checked that NVRTC loads, so cudarc's lazily resolved stub finds it
    // instead of panicking; both out-pointers are live locals of the `int` type the prototype names.
    check(unsafe { sys::nvrtcVersion(&mut major, &mut minor) }, "nvrtcVersion")?;
    Ok((major, minor))
}

/// The architectures this NVRTC can compile for (as 70, 80, 90, ...).
pub fn supported_architectures() -> Result<Vec<u32>> {
    require_nvrtc()?;
    let mut n = 0;
    // SAFETY: `require_nvrtc` checked that NVRTC loads; `n` is a live local `int` for the count.
    check(unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }, "nvrtcGetNumSupportedArchs")?;
    let mut archs = vec![0; n.max(0) as usize];
    // SAFETY: NVRTC writes as many `int`s as it just counted, and `archs` holds exactly `n` of them.
    check(unsafe { sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }, "nvrtcGetSupportedArchs")?;
    Ok(archs.into_iter().map(|a| a as u32).collect())
}

/// Compiles [`SOURCE`] for `target`. Errors carry NVRTC's log.
pub fn compile(target: Target) -> Result<Compiled> {
    compile_source(SOURCE, target)
}

/// Compiles `source` (the kernels, or a test's variant of them) for `target` with the kernels'
/// options. Errors carry NVRTC's log.
pub fn compile_source(source: &str, target: Target) -> Result<Compiled> {
    require_nvrtc()?;
    let source = CString::new(source).map_err(|_| Error::invalid("the CUDA source contains a NUL byte"))?;
    let name = c"gradacc_kernels.cu";
    let mut program = std::ptr::null_mut();
    check(
        // SAFETY: `require_nvrtc` checked that NVRTC loads; `source` and `name` are NUL-terminated
        // and outlive the call (NVRTC copies them); zero headers, so both header arrays may be null.
        unsafe { sys::nvrtcCreateProgram(&mut program, source.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null()) },
        "nvrtcCreateProgram",
    )?;
    let result = compile_program(program, target);
    // SAFETY: `program` was created above (the `?` returned before this if creation failed), and
    // `compile_program` has returned, so nothing uses it after it is destroyed here, once.
    unsafe { sys::nvrtcDestroyProgram(&mut program) };
    result
}

fn compile_program(program: sys::nvrtcProgram, target: Target) -> Result<Compiled> {
    // The launch geometry the Rust side uses, so kernels and launches cannot disagree.
    let geometry = [format!("-DGA_THREADS={}", super::driver::THREADS), format!("-DGA_CHUNK={}", super::store::CHUNK)];
    let options: Vec<CString> =
        OPTIONS.iter().map(|o| o.to_string()).chain(geometry).chain([target.option()]).map(|o| CString::new(o).expect("option has no NUL")).collect();
    let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: `program` is live (created by the only caller, `compile_source`, which destroys it
    // after this returns); `pointers` holds `pointers.len()` NUL-terminated strings owned by
    // `options`, which outlives the call.
    let status = unsafe { sys::nvrtcCompileProgram(program, pointers.len() as i32, pointers.as_ptr()) };
    let log = program_log(program)?;
    if status != nvrtcResult::NVRTC_SUCCESS {
        return Err(Error::new(ErrorKind::Internal, format!("NVRTC could not compile the kernels for {target:?}: {status:?}\n{log}")));
    }
    let warnings = log.lines().map(str::trim).filter(|l| !l.is_empty() && !l.contains(PRE_TURING_NOTICE)).map(String::from).collect();
    let image = match target {
        Target::Cubin(_) => {
            let mut size = 0;
            // SAFETY: a live program (see `nvrtcCompileProgram` above) and a live `size_t` out-pointer.
            check(unsafe { sys::nvrtcGetCUBINSize(program, &mut size) }, "nvrtcGetCUBINSize")?;
            let mut image = vec![0u8; size];
            // SAFETY: NVRTC writes the CUBIN's `size` bytes, the length `image` was just given.
            check(unsafe { sys::nvrtcGetCUBIN(program, image.as_mut_ptr() as *mut c_char) }, "nvrtcGetCUBIN")?;
            image
        }
        Target::Ptx(_) => {
            let mut size = 0;
            // SAFETY: a live program (see `nvrtcCompileProgram` above) and a live `size_t` out-pointer.
            check(unsafe { sys::nvrtcGetPTXSize(program, &mut size) }, "nvrtcGetPTXSize")?;
            let mut image = vec![0u8; size];
            // SAFETY: NVRTC writes the PTX's `size` bytes (NUL included), the length `image` was just given.
            check(unsafe { sys::nvrtcGetPTX(program, image.as_mut_ptr() as *mut c_char) }, "nvrtcGetPTX")?;
            image
        }
    };
    Ok(Compiled { image, warnings })
}

fn program_log(program: sys::nvrtcProgram) -> Result<String> {
    let mut size = 0;
    // SAFETY: `program` is live: the only caller, `compile_program`, has it from `compile_source`,
    // which destroys it later; `size` is a live `size_t` out-pointer.
    check(unsafe { sys::nvrtcGetProgramLogSize(program, &mut size) }, "nvrtcGetProgramLogSize")?;
    let mut log = vec![0u8; size.max(1)];
    // SAFETY: NVRTC writes `size` bytes (NUL included); `log` holds at least that many.
    check(unsafe { sys::nvrtcGetProgramLog(program, log.as_mut_ptr() as *mut c_char) }, "nvrtcGetProgramLog")?;
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    Ok(String::from_utf8_lossy(&log[..end]).into_owned())
}

fn require_nvrtc() -> Result<()> {
    if nvrtc_available() {
        Ok(())
    } else {
        Err(Error::new(
            ErrorKind::BackendUnavailable,
            "NVRTC (libnvrtc.so.12) could not be loaded: install the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12` and put its lib folder on LD_LIBRARY_PATH",
        ))
    }
}

fn check(result: nvrtcResult, what: &str) -> Result<()> {
    if result == nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::Internal, format!("{what} failed: {result:?}")))
    }
}
