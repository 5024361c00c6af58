//! Gives libgradacc.so its SONAME.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../../Cargo.toml");
    soname();
}

/// ELF targets: the cdylib's SONAME names the ABI it keeps: `libgradacc.so.<major>` from 1.0, and
/// `libgradacc.so.0.<minor>` before (a 0.x minor release may break the ABI, CHANGELOG.md), so
/// programs record the ABI they were linked against instead of the bare `libgradacc.so`. cargo
/// only writes `libgradacc.so`: a link by the SONAME next to it makes programs linked against the
/// build tree (CMake's gradacc::gradacc, the Go binding) load there too.
fn soname() {
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let family = std::env::var("CARGO_CFG_TARGET_FAMILY").unwrap_or_default();
    if family != "unix" || matches!(os.as_str(), "macos" | "ios" | "tvos" | "watchos" | "visionos")
    {
        return;
    }
    let version = |part: &str| {
        let name = format!("CARGO_PKG_VERSION_{part}");
        std::env::var(&name).unwrap_or_else(|_| panic!("cargo sets {name}"))
    };
    let abi = abi_version(&version("MAJOR"), &version("MINOR"));
    let soname = format!("libgradacc.so.{abi}");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,{soname}");

    // OUT_DIR is <profile dir>/build/<package>-<hash>/out; the library lands in <profile dir>.
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    if let Some(profile_dir) = out_dir.ancestors().nth(3) {
        link_soname(&profile_dir.join(&soname));
    }
}

/// The part of the version that the SONAME carries: `<major>`, or `0.<minor>` while the major is 0.
/// CMakeLists.txt, the Python build hook and the scripts apply the same rule.
fn abi_version(major: &str, minor: &str) -> String {
    if major == "0" {
        format!("0.{minor}")
    } else {
        major.to_string()
    }
}

/// Makes `link` a symbolic link to `libgradacc.so` in its folder (a dangling one until the library
/// is linked). A failure only costs the build-tree convenience, so it is a warning.
fn link_soname(link: &Path) {
    let target = Path::new("libgradacc.so");
    if std::fs::read_link(link).is_ok_and(|t| t == target) {
        return;
    }
    let _ = std::fs::remove_file(link);
    #[cfg(unix)]
    if let Err(e) = std::os::unix::fs::symlink(target, link) {
        println!("cargo:warning=cannot create {}: {e}", link.display());
    }
}
