//! gradacc's C ABI, written in Rust over the `gradacc` crate: the only code that knows about C.
//! Every exported function checks its arguments, runs inside the panic boundary
//! (`status::guard`) and reports failures as a status plus a per-thread message; handles are
//! resolved through `handle::Registry`. Each function converts its arguments and makes one call
//! into the Rust API; the semantics, and the contracts the header points to, are stated there.
//!
//! Who owns what: this crate owns the C types and statuses, the header (made from this crate by
//! `scripts/gen-header` with `capi/cbindgen.toml` and `include/fragments/`) and the ABI promise;
//! `capi/cdylib` builds it as libgradacc.so (with its SONAME) and libgradacc.a. A new C entry
//! point is a function here, and nothing else.

#![allow(non_camel_case_types)]
// Exported functions that take pointers are `unsafe extern "C"`: a Rust caller must uphold the
// pointer contracts that each function's documentation (and the header) states, which is where
// a C caller reads them; a separate `# Safety` section would only repeat that text.
#![allow(clippy::missing_safety_doc)]
// Small functions: at most 80 lines each (clippy.toml).
#![warn(clippy::too_many_lines)]

mod accumulator;
mod comm;
mod convert;
mod handle;
mod logging;
mod mesh;
mod optimizer;
mod scaler;
mod status;
mod types;
mod version;

pub use accumulator::*;
pub use comm::*;
pub use convert::*;
pub use logging::*;
pub use mesh::*;
pub use optimizer::*;
pub use scaler::*;
pub use status::*;
pub use types::{
    gradacc_device_kind_t, gradacc_device_t, gradacc_dtype_t, gradacc_grad_t,
    gradacc_tensor_desc_t, GRADACC_DEVICE_CPU, GRADACC_DEVICE_CUDA, GRADACC_DTYPE_BF16,
    GRADACC_DTYPE_F16, GRADACC_DTYPE_F32,
};
pub use version::*;
