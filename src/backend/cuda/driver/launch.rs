//! Kernels: compiled modules loaded into a context, their functions, and launches with the
//! argument array `launch_args!` makes.

use std::ffi::{c_void, CStr};

use cudarc::driver::sys;

use super::{check, CUstream, Context};
use crate::backend::cuda::driver_api::Api;
use crate::error::Result;

/// A compiled kernel module loaded into a context, with its functions looked up by name.
pub struct Module {
    api: &'static Api,
    module: sys::CUmodule,
}

// SAFETY: a CUmodule handle is usable from any thread while its context is current; modules
// are never unloaded, and `api` is `&'static`.
unsafe impl Send for Module {}
// SAFETY: the handle never changes after `load`; `function` only passes it to
// cuModuleGetFunction, which is thread-safe.
unsafe impl Sync for Module {}

impl Module {
    /// Loads a CUBIN or NUL-terminated PTX image into `ctx` (never unloaded: cached per process).
    pub fn load(ctx: &Context, image: &[u8]) -> Result<Self> {
        let _g = ctx.enter()?;
        let mut module = std::ptr::null_mut();
        ctx.check(
            // SAFETY: `_g` made `ctx` current; `image` is a whole CUBIN, or PTX with its NUL, from
            // NVRTC (every caller passes `Compiled::image`), so the driver reads only inside the
            // slice;
            // `module` is a live out-pointer.
            unsafe { (ctx.api.cuModuleLoadData)(&mut module, image.as_ptr() as *const c_void) },
            "cuModuleLoadData",
        )?;
        Ok(Module { api: ctx.api, module })
    }

    pub fn function(&self, name: &CStr) -> Result<Function> {
        let mut f = std::ptr::null_mut();
        check(
            self.api,
            // SAFETY: `self.module` was loaded in `load` and is never unloaded; `name` is a `CStr`,
            // so NUL-terminated; `f` is a live out-pointer.
            unsafe { (self.api.cuModuleGetFunction)(&mut f, self.module, name.as_ptr()) },
            "cuModuleGetFunction",
        )?;
        Ok(Function(f))
    }
}

#[derive(Clone, Copy)]
pub struct Function(sys::CUfunction);

// SAFETY: a CUfunction is a handle into a module that is never unloaded; the driver launches
// it from any thread once its context is current (`launch` enters it).
unsafe impl Send for Function {}
// SAFETY: the handle is immutable and only copied into cuLaunchKernel, which is thread-safe.
unsafe impl Sync for Function {}

/// Threads per block of every launch (the kernels' __launch_bounds__).
pub const THREADS: u32 = 256;

impl Function {
    /// [`Function::launch`] with THREADS per block and the grid [`Context::grid_for`] gives
    /// `work_items` (a grid-stride kernel's chunks or elements).
    ///
    /// # Safety
    /// As for [`Function::launch`].
    pub unsafe fn launch_over(
        &self,
        ctx: &Context,
        stream: CUstream,
        work_items: u64,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller's contract, which is `launch`'s.
        unsafe { self.launch(ctx, ctx.grid_for(work_items), THREADS, stream, args) }
    }

    /// Enqueues the kernel on `stream`. `args` holds one pointer per kernel parameter, each to a
    /// value of exactly the parameter's type (the caller's `launch_args!` makes them).
    ///
    /// # Safety
    /// The argument types and device addresses must match the kernel's signature and be valid
    /// for the kernel's accesses.
    pub unsafe fn launch(
        &self,
        ctx: &Context,
        grid: u32,
        threads: u32,
        stream: CUstream,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let _g = ctx.enter()?;
        let api = ctx.api;
        ctx.check(
            // SAFETY: `self.0` came from cuModuleGetFunction on a module never unloaded, and `_g`
            // made its context current; `args` holds one pointer per kernel parameter to a value
            // of its type, valid for the kernel's accesses (this function's `# Safety` contract);
            // `extra` is null, as the driver requires when `kernelParams` is given.
            unsafe {
                (api.cuLaunchKernel)(
                    self.0,
                    grid.max(1),
                    1,
                    1,
                    threads,
                    1,
                    1,
                    0,
                    stream,
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }
}

/// The argument array of a launch: a pointer to each local variable, in parameter order. Takes
/// names only, so no pointer can outlive a temporary.
macro_rules! launch_args {
    ($($value:ident),* $(,)?) => {
        [$(&$value as *const _ as *mut std::ffi::c_void),*]
    };
}
pub(crate) use launch_args;
