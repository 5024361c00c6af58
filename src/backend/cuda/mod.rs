//! The CUDA backend: kernels written in CUDA C (kernels/), compiled at first use by NVRTC
//! (compile.rs) for the device's exact architecture, and launched on the caller's stream in the
//! device's primary context through the driver API (driver/). The driver, NVRTC and NCCL are
//! loaded at run time (NVRTC and NCCL by library.rs), so the library builds and loads on machines
//! without CUDA; every entry point then reports BACKEND_UNAVAILABLE.

pub mod compile;
pub mod driver;
mod driver_api;
mod kernels;
pub mod layout;
pub(crate) mod library;
/// NCCL, the CUDA devices' transport: its collectives run on device buffers, enqueued on
/// streams, and the CUDA stores drive it.
pub mod nccl;
mod optimizer;
mod scaler;
mod sharded;
mod store;
mod wire;

pub(crate) use optimizer::DeviceOptimizer;
pub(crate) use scaler::CudaScaler;
pub(crate) use store::DeviceStore;

/// Whether CUDA objects can be created here: a driver with a device, and NVRTC to compile the
/// kernels. Never panics.
pub fn available() -> bool {
    driver::driver_available() && compile::nvrtc_available()
}

/// The sizes of the structs shared with the kernels as the device compiler lays them out (the
/// `ga_layout_sizes` kernel), to compare with [`layout::SIZES`]. Waits for the device.
pub fn device_layout_sizes(ordinal: i32) -> crate::Result<[u64; layout::SIZES.len()]> {
    let ctx = driver::Context::get(ordinal)?;
    let k = kernels::Kernels::of(&ctx)?;
    let stream = std::ptr::null_mut();
    let out = driver::DeviceBuffer::zeroed(&ctx, stream, layout::SIZES.len() * 8)?;
    let ptr = out.ptr();
    let mut args = driver::launch_args!(ptr);
    // SAFETY: ga_layout_sizes takes one `ga_u64 *` and writes one u64 per entry of
    // layout::SIZES through it; `ptr` is a CUdeviceptr (a u64 address) of `out`, that many u64s
    // in this context, which lives past the read.
    unsafe { k.layout_sizes.launch(&ctx, 1, 1, stream, &mut args)? };
    let mut sizes = [0u64; layout::SIZES.len()];
    out.read(&mut sizes)?;
    Ok(sizes)
}
