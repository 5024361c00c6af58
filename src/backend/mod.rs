//! Compute backends. Each backend implements the same per-element contract (see `cpu::math`),
//! so every device produces bitwise-identical master gradients.

pub mod cpu;
pub mod cuda;
