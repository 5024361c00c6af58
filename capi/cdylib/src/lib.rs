//! libgradacc.so and libgradacc.a: every `gradacc_*` function of [`gradacc_capi`], exported
//! under the library name C callers link. Nothing else lives here; see `gradacc_capi` for the
//! C ABI and `build.rs` for the SONAME.

pub use gradacc_capi::*;
