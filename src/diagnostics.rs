//! What this installation is and what it found, as text for a bug report: [`diagnostics`] (also
//! `gradacc_diagnostics` in C, the `gradacc-info` program and `python -m gradacc`), and the one
//! list of the environment variables the library reads ([`ENVIRONMENT`]).

use std::ffi::c_void;
use std::fmt::Write;

use crate::backend::cuda::{compile, driver, library, nccl};
use crate::simd::{self, Isa};

/// Every environment variable the library reads, with what it does. Each is read once, when
/// its part is first used.
pub const ENVIRONMENT: &[(&str, &str)] = &[
    (
        "GRADACC_CPU_ISA",
        "the host's SIMD path (scalar, avx2, avx512), narrowed to what the CPU supports; \
         default the widest it supports",
    ),
    (
        "GRADACC_NVRTC_LIBRARY",
        "the NVRTC library to load (a path, or a name the loader searches for), tried alone; \
         default libnvrtc.so.13, libnvrtc.so.12, libnvrtc.so",
    ),
    (
        "GRADACC_NCCL_LIBRARY",
        "the NCCL library to load, tried alone; default libnccl.so.2, libnccl.so",
    ),
    (
        "GRADACC_MPI_HIERARCHY",
        "the hierarchical MPI boundary across hosts: auto (hosts are where the processes run), \
         n (every n consecutive ranks one host), flat (never); default flat",
    ),
    (
        "GRADACC_LOG",
        "the C library's messages at this level and above (error, warn, info, debug) go to \
         stderr while no log callback is set; default none",
    ),
];

/// Variables read by what gradacc loads (the dynamic loader, the CUDA driver), reported beside
/// gradacc's own.
const LOADERS: &[&str] = &["LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES"];

/// The report: the version and the library's file, the host and its SIMD path, each backend
/// available or why not, the CUDA driver, NVRTC and NCCL found (version and file) or why not, and
/// the environment variables. Never fails: what does not load is reported with the loader's
/// reason.
pub fn diagnostics() -> String {
    let mut out = String::new();
    let file = library::file_of(diagnostics as *const c_void)
        .map_or_else(|| "its file unknown".into(), |f| f.display().to_string());
    let _ = writeln!(out, "gradacc {} ({file})", crate::VERSION);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let _ =
        writeln!(out, "host: {} {}, {cores} cores", std::env::consts::OS, std::env::consts::ARCH);
    let _ = writeln!(out, "SIMD path: {}", simd_path());
    let _ = writeln!(out, "backends:");
    for (name, status) in backends() {
        let _ = writeln!(out, "  {name}: {status}");
    }
    let _ = writeln!(out, "libraries:");
    for (name, status) in libraries() {
        let _ = writeln!(out, "  {name}: {status}");
    }
    let _ = writeln!(out, "environment:");
    let names = ENVIRONMENT.iter().map(|(name, _)| *name).chain(LOADERS.iter().copied());
    for name in names {
        let _ = match std::env::var_os(name) {
            Some(v) => writeln!(out, "  {name}={}", v.to_string_lossy()),
            None => writeln!(out, "  {name} not set"),
        };
    }
    out
}

/// The path the kernels take, what the CPU supports, and what `GRADACC_CPU_ISA` asked for.
fn simd_path() -> String {
    let active = simd::active_isa();
    let supported: Vec<&str> = simd::supported_isas().iter().map(|i| i.name()).collect();
    let asked = match std::env::var("GRADACC_CPU_ISA") {
        Err(_) => String::new(),
        Ok(name) => match Isa::from_name(&name) {
            Some(isa) if isa == active => format!(", as GRADACC_CPU_ISA={name} asks"),
            Some(_) => format!(", narrowed from GRADACC_CPU_ISA={name}"),
            None => format!(", GRADACC_CPU_ISA={name} ignored: not a path's name"),
        },
    };
    format!("{} (this CPU supports {}{asked})", active.name(), supported.join(", "))
}

/// Each backend, available or the library's reason why not.
fn backends() -> Vec<(&'static str, String)> {
    let status = |r: crate::Result<()>| {
        r.map_or_else(|e| format!("unavailable: {e}"), |()| "available".into())
    };
    let mpi = if cfg!(feature = "mpi") {
        "available".into()
    } else {
        "unavailable: not in this build (build with CMake -DGRADACC_WITH_MPI=ON or cargo \
         --features mpi)"
            .into()
    };
    let cuda = driver::require_driver().and_then(|()| compile::require_nvrtc());
    let nccl = driver::require_driver().and_then(|()| nccl::require_nccl());
    vec![
        ("local", "available".into()),
        ("MPI", mpi),
        ("CUDA", status(cuda)),
        ("NCCL", status(nccl)),
    ]
}

/// The CUDA driver, NVRTC and NCCL: version and file, or why they do not load.
fn libraries() -> Vec<(&'static str, String)> {
    let driver = match driver::driver_version() {
        Some(v) => format!(
            "CUDA {}.{}, {} devices visible",
            v / 1000,
            v % 1000 / 10,
            driver::device_count()
        ),
        None => format!(
            "not found: {}",
            driver::require_driver().err().map_or_else(String::new, |e| e.message)
        ),
    };
    let nvrtc = compile::nvrtc_version()
        .and_then(|(major, minor)| Ok(format!("{major}.{minor}, {}", compile::nvrtc_file()?)));
    let nccl = nccl::nccl_library()
        .map(|((major, minor, patch), file)| format!("{major}.{minor}.{patch}, {file}"));
    let found = |r: crate::Result<String>| r.unwrap_or_else(|e| format!("not found: {e}"));
    #[cfg(feature = "mpi")]
    let mpi = library::file_of(mpi::ffi::MPI_Init as *const c_void)
        .map_or_else(|| "linked, its file unknown".into(), |f| f.display().to_string());
    #[cfg(not(feature = "mpi"))]
    let mpi = "not linked (only a build with MPI links it)".to_string();
    vec![("CUDA driver", driver), ("NVRTC", found(nvrtc)), ("NCCL", found(nccl)), ("MPI", mpi)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_names_every_part_and_every_variable() {
        let report = diagnostics();
        assert!(report.starts_with(&format!("gradacc {} (", crate::VERSION)), "{report}");
        for part in ["host: ", "SIMD path: ", "backends:", "  MPI: ", "  CUDA: ", "  NCCL: "] {
            assert!(report.contains(part), "no {part:?} in {report}");
        }
        for part in ["libraries:", "  CUDA driver: ", "  NVRTC: ", "environment:"] {
            assert!(report.contains(part), "no {part:?} in {report}");
        }
        for (name, _) in ENVIRONMENT {
            assert!(report.contains(&format!("  {name}")), "no {name} in {report}");
        }
        let active = simd::active_isa().name();
        assert!(report.contains(&format!("SIMD path: {active} (")), "{report}");
    }

    #[test]
    fn every_variable_the_sources_read_is_listed() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut read = Vec::new();
        let mut dirs = vec![root.join("src"), root.join("capi/src")];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let file = std::fs::read_to_string(&path).unwrap();
                    // The library's code, not its tests' (which name libraries of their own).
                    let text = file.split("#[cfg(test)]").next().unwrap();
                    for (at, _) in text
                        .match_indices("env: \"GRADACC_")
                        .chain(text.match_indices("var(\"GRADACC_"))
                    {
                        let name = text[at..].split('"').nth(1).unwrap().to_string();
                        read.push(name);
                    }
                }
            }
        }
        assert!(read.len() >= 3, "the reads were not found: {read:?}");
        for name in &read {
            assert!(ENVIRONMENT.iter().any(|(n, _)| n == name), "{name} is read but not listed");
        }
    }
}
