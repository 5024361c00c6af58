//! The CUDA kernels compile, without a GPU: NVRTC turns the kernel source into CUBIN for each of
//! sm_70, 75, 80, 86, 90, 100 and 120 that it supports (one per generation from Volta to
//! Blackwell) and into PTX, with no warning and no
//! error, and every kernel the backend launches is in the image. CI runs this with NVRTC 12 and
//! NVRTC 13 and sets GRADACC_REQUIRE_NVRTC=1 (scripts/test installs both from PyPI), so a missing
//! NVRTC fails there instead of skipping.

use std::path::{Path, PathBuf};
use std::process::Command;

use gradacc::backend::cuda::compile::{self, Target, KERNELS, SOURCE};

fn nvrtc_or_skip() -> bool {
    if compile::nvrtc_available() {
        return true;
    }
    assert!(
        std::env::var("GRADACC_REQUIRE_NVRTC").as_deref() != Ok("1"),
        "GRADACC_REQUIRE_NVRTC=1 but NVRTC does not load: {}",
        compile::require_nvrtc().unwrap_err()
    );
    eprintln!("NVRTC is not installed: skipping the kernel compilation check");
    false
}

#[test]
fn every_kernel_compiles_for_every_target_without_warnings() {
    if !nvrtc_or_skip() {
        return;
    }
    let targets = targets();
    eprintln!(
        "NVRTC {:?} from {}: {targets:?}",
        compile::nvrtc_version().unwrap(),
        compile::nvrtc_file().unwrap()
    );
    for target in targets {
        let compiled = compile::compile(target).unwrap_or_else(|e| panic!("{target:?}: {e}"));
        assert!(
            compiled.warnings.is_empty(),
            "{target:?} compiled with warnings:\n{}",
            compiled.warnings.join("\n")
        );
        assert!(compiled.image.len() > 1000, "{target:?}: image of {} bytes", compiled.image.len());
        match target {
            // CUBIN is ELF; its symbol table names every kernel.
            Target::Cubin(_) => {
                assert_eq!(&compiled.image[..4], b"\x7fELF", "{target:?} is not an ELF image");
                for k in KERNELS {
                    assert!(
                        compiled
                            .image
                            .windows(k.len() + 1)
                            .any(|w| &w[..k.len()] == k.as_bytes() && w[k.len()] == 0),
                        "{target:?} lacks {k}"
                    );
                }
            }
            Target::Ptx(_) => {
                let ptx = String::from_utf8_lossy(&compiled.image);
                for k in KERNELS {
                    assert!(ptx.contains(&format!(".entry {k}(")), "PTX lacks kernel {k}");
                }
                // Explicitly rounded arithmetic only: a fused multiply-add in the accumulation
                // would change bits against the CPU backend.
                assert!(!ptx.contains("fma.rn.f32"), "the PTX contains an f32 fused multiply-add");
                // Division and square root correctly rounded, as the CPU's (the optimizer's
                // AdamW step divides and takes square roots in f32): never an approximation.
                for op in ["div.approx", "div.full", "sqrt.approx", "rsqrt.approx", "rcp.approx"] {
                    assert!(!ptx.contains(op), "the PTX contains {op}");
                }
                for op in ["div.rn.f32", "sqrt.rn.f32"] {
                    assert!(
                        ptx.contains(op),
                        "the PTX lacks {op}, which the optimizer's step needs"
                    );
                }
            }
        }
    }
}

/// CUBIN for each architecture of a spread from Volta to Blackwell that this NVRTC supports
/// (NVRTC 13 dropped sm_70), and PTX for the oldest of them.
fn targets() -> Vec<Target> {
    let supported = compile::supported_architectures().unwrap();
    let archs: Vec<u32> =
        [70, 75, 80, 86, 90, 100, 120].into_iter().filter(|a| supported.contains(a)).collect();
    assert!(
        archs.contains(&80) && archs.contains(&90),
        "NVRTC supports {supported:?}: no sm_80 or sm_90"
    );
    archs.iter().map(|&a| Target::Cubin(a)).chain([Target::Ptx(archs[0])]).collect()
}

#[test]
fn the_device_target_is_exact_cubin_when_known_and_ptx_otherwise() {
    if !nvrtc_or_skip() {
        return;
    }
    assert_eq!(Target::for_device(8, 0).unwrap(), Target::Cubin(80));
    assert_eq!(Target::for_device(9, 0).unwrap(), Target::Cubin(90));
    // A future architecture this NVRTC does not know runs the newest PTX it can make.
    match Target::for_device(99, 9).unwrap() {
        Target::Ptx(arch) => assert!(arch >= 90, "{arch}"),
        t => panic!("{t:?}"),
    }
}

#[test]
fn a_compile_error_comes_back_with_the_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let broken = SOURCE.replace("ga_add_multi(", "ga_add_multi(undeclared_type t, ");
    let e = compile::compile_source(&broken, Target::Cubin(80))
        .err()
        .expect("the broken source must not compile");
    assert!(e.message.contains("undeclared_type"), "the log names the error: {}", e.message);
}

/// Set in the child processes of the test below: how NVRTC was named to them.
const LINK_CHILD: &str = "GRADACC_TEST_NVRTC_LINK";

/// NVRTC named through a link in a folder of links, as GRADACC_NVRTC_LIBRARY and as a name found
/// on LD_LIBRARY_PATH: it still finds its builtins library, which sits only beside the real file
/// (NVRTC 13 fails with NVRTC_ERROR_BUILTIN_OPERATION_FAILURE when it does not). Runs where
/// GRADACC_NVRTC_LIBRARY names NVRTC by path, as CI does for each NVRTC it tests.
#[test]
fn nvrtc_named_through_a_link_in_another_folder_compiles() {
    if let Some(how) = std::env::var_os(LINK_CHILD) {
        let real = std::env::var_os("GRADACC_TEST_NVRTC_REAL").map(PathBuf::from).unwrap();
        assert_eq!(
            Path::new(&compile::nvrtc_file().unwrap()),
            real,
            "{how:?} loaded another NVRTC"
        );
        let target =
            Target::Cubin(*compile::supported_architectures().unwrap().iter().max().unwrap());
        let compiled = compile::compile(target)
            .unwrap_or_else(|e| panic!("NVRTC named through a link ({how:?}): {e}"));
        assert_eq!(&compiled.image[..4], b"\x7fELF");
        return;
    }
    let Some(named) =
        std::env::var_os("GRADACC_NVRTC_LIBRARY").filter(|v| Path::new(v).is_absolute())
    else {
        eprintln!(
            "GRADACC_NVRTC_LIBRARY does not name NVRTC by path: skipping the check through a link"
        );
        return;
    };
    if !nvrtc_or_skip() {
        return;
    }
    let real = std::fs::canonicalize(&named).unwrap();
    let links = std::env::temp_dir().join(format!("gradacc-nvrtc-links-{}", std::process::id()));
    std::fs::create_dir_all(&links).unwrap();
    let link = links.join(real.file_name().unwrap());
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let child = |how: &str, env: &[(&str, &Path)]| {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command.args([
            "--exact",
            "nvrtc_named_through_a_link_in_another_folder_compiles",
            "--nocapture",
            "--test-threads=1",
        ]);
        // Nothing else may lead NVRTC to its real folder.
        command
            .env_remove("LD_LIBRARY_PATH")
            .env_remove("GRADACC_NVRTC_LIBRARY")
            .env(LINK_CHILD, how)
            .env("GRADACC_TEST_NVRTC_REAL", &real);
        for (key, value) in env {
            command.env(key, value);
        }
        command.output().unwrap()
    };
    let outputs = [
        ("GRADACC_NVRTC_LIBRARY", child("by path", &[("GRADACC_NVRTC_LIBRARY", &link)])),
        ("LD_LIBRARY_PATH", child("by name", &[("LD_LIBRARY_PATH", &links)])),
    ];
    std::fs::remove_dir_all(&links).unwrap();
    for (how, output) in outputs {
        let text = String::from_utf8_lossy(&output.stdout).into_owned()
            + &String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success() && text.contains("1 passed"),
            "NVRTC named through a link by {how}:\n{text}"
        );
    }
}
