//! Which instruction-set path the CPU kernels take. The CPU is probed once; the environment
//! variable `GRADACC_CPU_ISA` (`scalar`, `avx2`, `avx512`) and [`with_isa`] can only narrow the
//! choice to a path the CPU supports, so a kernel never runs instructions the CPU lacks. Also
//! probed once: whether data for another core is written with streaming stores
//! ([`stream_to_peers`]).

use std::cell::Cell;
use std::sync::OnceLock;

/// A CPU kernel path, from narrowest to widest. Every path gives bitwise-identical results.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust, the only path on CPUs other than x86-64.
    Scalar,
    /// AVX2 with F16C: 8 lanes.
    Avx2,
    /// AVX-512F: 16 lanes.
    Avx512,
}

impl Isa {
    /// Every path, narrowest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// The name `GRADACC_CPU_ISA` accepts.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The path called `name`, if any.
    pub fn from_name(name: &str) -> Option<Isa> {
        Isa::ALL.into_iter().find(|isa| isa.name().eq_ignore_ascii_case(name.trim()))
    }

    /// The widest supported path no wider than `self`.
    fn clamp(self) -> Isa {
        self.min(widest_supported())
    }
}

/// The widest path this CPU can run, probed once. AVX-512 also requires the AVX2 path's features,
/// so the paths a CPU supports are always a prefix of [`Isa::ALL`].
fn widest_supported() -> Isa {
    static WIDEST: OnceLock<Isa> = OnceLock::new();
    *WIDEST.get_or_init(probe)
}

#[cfg(target_arch = "x86_64")]
fn probe() -> Isa {
    let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
    if avx2 && is_x86_feature_detected!("avx512f") {
        Isa::Avx512
    } else if avx2 {
        Isa::Avx2
    } else {
        Isa::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn probe() -> Isa {
    Isa::Scalar
}

/// Whether data handed to another core (a communicator's outbox, read by a peer right after) is
/// best written with streaming stores, which send it to memory, rather than left in this core's
/// cache for the other core to fetch. Decided once, by the CPU's vendor (AMD, and Hygon, whose
/// cores are AMD's), from the machines measured (`docs/mpi.md`, "Staging for the peer"): on AMD
/// EPYC (Zen 3) the peer read freshly written lines more slowly than memory, on an Intel Xeon
/// (Cascade Lake) faster, from the L3. The streaming stores need the AVX2 path or a wider one.
pub fn stream_to_peers() -> bool {
    static STREAM: OnceLock<bool> = OnceLock::new();
    *STREAM.get_or_init(|| matches!(&vendor(), b"AuthenticAMD" | b"HygonGenuine"))
}

/// The CPU's vendor string (CPUID leaf 0).
#[cfg(target_arch = "x86_64")]
fn vendor() -> [u8; 12] {
    // `__cpuid` is a safe function from Rust 1.94 on, an unsafe one in the older releases this
    // crate supports.
    #[allow(unused_unsafe)]
    // SAFETY: every x86-64 CPU has the CPUID instruction, and leaf 0 always exists.
    let id = unsafe { std::arch::x86_64::__cpuid(0) };
    vendor_from(id.ebx, id.edx, id.ecx)
}

#[cfg(not(target_arch = "x86_64"))]
fn vendor() -> [u8; 12] {
    [0; 12]
}

/// The vendor string CPUID leaf 0 spells in EBX, EDX, ECX, in that order, four bytes each.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn vendor_from(ebx: u32, edx: u32, ecx: u32) -> [u8; 12] {
    let mut name = [0; 12];
    for (bytes, reg) in name.chunks_exact_mut(4).zip([ebx, edx, ecx]) {
        bytes.copy_from_slice(&reg.to_le_bytes());
    }
    name
}

/// The process default: the widest supported path, or the one `GRADACC_CPU_ISA` names (clamped).
/// An unknown name is ignored.
fn process_default() -> Isa {
    static DEFAULT: OnceLock<Isa> = OnceLock::new();
    *DEFAULT.get_or_init(|| {
        let asked = std::env::var("GRADACC_CPU_ISA").ok();
        let requested = asked.as_deref().and_then(Isa::from_name);
        let isa = requested.unwrap_or(Isa::Avx512).clamp();
        match (asked, requested) {
            (Some(name), None) => log::warn!(
                "GRADACC_CPU_ISA={name} is not a SIMD path (scalar, avx2, avx512): using {}",
                isa.name()
            ),
            (Some(name), Some(r)) if r != isa => log::warn!(
                "GRADACC_CPU_ISA={name}: this CPU does not support it, using {}",
                isa.name()
            ),
            _ => log::debug!("the host's SIMD path: {}", isa.name()),
        }
        isa
    })
}

thread_local! {
    static OVERRIDE: Cell<Option<Isa>> = const { Cell::new(None) };
}

/// The paths this CPU supports, narrowest first.
pub fn supported_isas() -> Vec<Isa> {
    Isa::ALL.into_iter().filter(|&isa| isa <= widest_supported()).collect()
}

/// The path kernel calls made from this thread take now.
pub fn active_isa() -> Isa {
    OVERRIDE.with(Cell::get).unwrap_or_else(process_default)
}

/// Runs `f` with kernel calls from this thread (and the worker threads they start) on `isa`,
/// clamped to what the CPU supports. Meant for tests and benchmarks that compare paths.
pub fn with_isa<R>(isa: Isa, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Isa>);
    impl Drop for Restore {
        fn drop(&mut self) {
            OVERRIDE.with(|cell| cell.set(self.0));
        }
    }
    let _restore = Restore(OVERRIDE.with(|cell| cell.replace(Some(isa.clamp()))));
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for isa in Isa::ALL {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
        }
        assert_eq!(Isa::from_name(" AVX2 "), Some(Isa::Avx2));
        assert_eq!(Isa::from_name("sse"), None);
    }

    #[test]
    fn override_is_clamped_and_restored() {
        let before = active_isa();
        with_isa(Isa::Scalar, || {
            assert_eq!(active_isa(), Isa::Scalar);
            with_isa(Isa::Avx512, || assert_eq!(active_isa(), widest_supported()));
            assert_eq!(active_isa(), Isa::Scalar);
        });
        assert_eq!(active_isa(), before);
        assert_eq!(supported_isas().first(), Some(&Isa::Scalar));
        assert_eq!(supported_isas().last(), Some(&widest_supported()));
    }

    #[test]
    fn the_vendor_is_spelled_by_ebx_edx_ecx() {
        // The registers of CPUID leaf 0 on an Intel and an AMD CPU.
        assert_eq!(&vendor_from(0x756e_6547, 0x4965_6e69, 0x6c65_746e), b"GenuineIntel");
        assert_eq!(&vendor_from(0x6874_7541, 0x6974_6e65, 0x444d_4163), b"AuthenticAMD");
        // This CPU's, where Linux names it too.
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        if let Some(line) = std::fs::read_to_string("/proc/cpuinfo")
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("vendor_id"))
        {
            let vendor = vendor();
            assert!(
                line.ends_with(String::from_utf8_lossy(&vendor).trim()),
                "{line} against {vendor:?}"
            );
        }
    }
}
