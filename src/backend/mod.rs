//! Devices: what differs between the CPU and CUDA, and nothing else. Each backend supplies an
//! accumulator's store (its master memory and the kernels over it: `cpu::HostStore`,
//! `cuda::DeviceStore`, behind `accumulator::Store`) and a scaler's state on the device; the
//! semantics (windows, counts, normalisation, the boundary's order, checks and errors) live once
//! in `accumulator` and `scaler`. Every backend implements the same per-element contract (see
//! `cpu::math` and its CUDA twin `cuda/kernels/math.cuh`), so every device produces
//! bitwise-identical master gradients.

pub mod cpu;
pub mod cuda;
