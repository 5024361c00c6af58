//! C API of the accumulator: its handle and registry here; its C types, constructors, the
//! micro-batch's calls, the boundary, its views and the window's state in the modules below.

// cbindgen writes the functions in the order it reads them, module by module: these names sort
// in the header's order.
mod config;
mod create;
mod microbatch;
mod sync;
mod view;
mod window;

pub use config::*;
pub use create::*;
pub use microbatch::*;
pub use sync::*;
pub use view::*;
pub use window::*;

use std::sync::LazyLock;

use crate::handle::Registry;
use gradacc::accumulator::Accumulator;

/// Bytes to which every tensor's FP32 master is aligned in the flat master: tensor `i` starts at
/// an element offset that is a multiple of GRADACC_MASTER_ALIGN / 4 (gradacc_accumulator_offset),
/// with zeros between tensors. An owned master starts at such an address too.
pub const GRADACC_MASTER_ALIGN: usize = 256;
const _: () = assert!(GRADACC_MASTER_ALIGN == gradacc::accumulator::MASTER_ALIGN);

/// A gradient accumulator (opaque). Create with gradacc_accumulator_create, free with
/// gradacc_accumulator_destroy.
pub struct gradacc_accumulator_t {
    _private: [u8; 0],
}

pub(crate) static ACCUMULATORS: LazyLock<Registry<Accumulator>> =
    LazyLock::new(|| Registry::new("accumulator"));
