//! The CUDA backend: kernels written in CUDA C (kernels/), compiled at first use by NVRTC
//! (compile.rs) for the device's exact architecture, and launched on the caller's stream in the
//! device's primary context through the driver API (driver.rs). The driver, NVRTC and NCCL are
//! loaded at run time, so the library builds and loads on machines without CUDA; every entry
//! point then reports BACKEND_UNAVAILABLE.

pub mod accumulator;
pub mod compile;
pub mod driver;
mod kernels;
pub mod layout;
pub mod scaler;

pub use accumulator::CudaAccumulator;
pub use scaler::CudaScaler;

/// Whether CUDA objects can be created here: a driver with a device, and NVRTC to compile the
/// kernels. Never panics.
pub fn available() -> bool {
    driver::driver_available() && compile::nvrtc_available()
}
