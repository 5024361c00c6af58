//! The driver entry points gradacc calls, resolved from the library cudarc loaded but typed to
//! return the raw `CUresult` number. cudarc's wrappers return a Rust enum, so a code its bindings
//! do not list (a newer driver's, or a stand-in's) would be undefined behaviour; a `u32` is not.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys::{
    self, CUcontext, CUdevice, CUdeviceptr, CUevent, CUfunction, CUmemoryPool, CUmodule, CUstream,
};

/// `CUmemAccessDesc`: one device's access to a memory pool (`CUmemLocation` then the flags).
#[repr(C)]
pub struct MemAccessDesc {
    pub location_type: c_int,
    pub location_id: c_int,
    pub flags: c_int,
}

/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub const MEM_LOCATION_TYPE_DEVICE: c_int = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub const MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;

macro_rules! driver_api {
    ($($name:ident($($arg:ty),* $(,)?);)*) => {
        /// One function pointer per driver entry point gradacc uses, each returning the raw code.
        #[allow(non_snake_case)]
        pub struct Api {
            $(pub $name: unsafe extern "C" fn($($arg),*) -> u32,)*
        }

        impl Api {
            /// Resolves every entry point at once, so a driver that lacks one is reported as
            /// unusable up front instead of failing in the middle of an object's life.
            fn load() -> Result<Api, String> {
                // SAFETY: only called after `is_culib_present` found the library, so culib
                // opens it instead of panicking; the library is kept open for the process.
                let lib = unsafe { sys::culib() };
                Ok(Api {
                    $($name: {
                        // SAFETY: the type is the entry point's C prototype from cuda.h with
                        // `CUresult` as `u32`, which has the same size and ABI as that C enum.
                        let symbol = unsafe { lib.get::<unsafe extern "C" fn($($arg),*) -> u32>(stringify!($name)) }
                            .map_err(|e| format!("the CUDA driver library lacks {}: {e}", stringify!($name)))?;
                        *symbol
                    },)*
                })
            }
        }
    };
}

driver_api! {
    cuInit(c_uint);
    cuDriverGetVersion(*mut c_int);
    cuGetErrorString(u32, *mut *const c_char);
    cuDeviceGetCount(*mut c_int);
    cuDeviceGet(*mut CUdevice, c_int);
    cuDeviceGetAttribute(*mut c_int, c_int, CUdevice);
    cuDevicePrimaryCtxRetain(*mut CUcontext, CUdevice);
    cuDeviceGetDefaultMemPool(*mut CUmemoryPool, CUdevice);
    cuMemPoolSetAccess(CUmemoryPool, *const MemAccessDesc, usize);
    cuCtxPushCurrent_v2(CUcontext);
    cuCtxPopCurrent_v2(*mut CUcontext);
    cuMemAllocAsync(*mut CUdeviceptr, usize, CUstream);
    cuMemFreeAsync(CUdeviceptr, CUstream);
    cuMemAlloc_v2(*mut CUdeviceptr, usize);
    cuMemFree_v2(CUdeviceptr);
    cuPointerGetAttribute(*mut c_void, c_int, CUdeviceptr);
    cuMemsetD8Async(CUdeviceptr, u8, usize, CUstream);
    cuMemsetD32Async(CUdeviceptr, c_uint, usize, CUstream);
    cuMemcpyHtoDAsync_v2(CUdeviceptr, *const c_void, usize, CUstream);
    cuMemcpyDtoHAsync_v2(*mut c_void, CUdeviceptr, usize, CUstream);
    cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, usize, CUstream);
    cuStreamCreate(*mut CUstream, c_uint);
    cuStreamDestroy_v2(CUstream);
    cuStreamSynchronize(CUstream);
    cuStreamQuery(CUstream);
    cuStreamWaitEvent(CUstream, CUevent, c_uint);
    cuStreamIsCapturing(CUstream, *mut c_int);
    cuEventCreate(*mut CUevent, c_uint);
    cuEventRecord(CUevent, CUstream);
    cuEventRecordWithFlags(CUevent, CUstream, c_uint);
    cuEventDestroy_v2(CUevent);
    cuModuleLoadData(*mut CUmodule, *const c_void);
    cuModuleGetFunction(*mut CUfunction, CUmodule, *const c_char);
    cuLaunchKernel(CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CUstream, *mut *mut c_void, *mut *mut c_void);
}

/// The entry points, or why they cannot be had (no driver library, or one without a symbol).
/// Loaded once; never panics.
pub fn get() -> Result<&'static Api, &'static str> {
    static API: OnceLock<Result<Api, String>> = OnceLock::new();
    API.get_or_init(|| {
        // SAFETY: only tries to dlopen the library by the names cudarc uses.
        if !unsafe { sys::is_culib_present() } {
            return Err("the CUDA driver library (libcuda.so) could not be loaded".into());
        }
        Api::load()
    })
    .as_ref()
    .map_err(String::as_str)
}

/// `CUDA_SUCCESS`.
pub const SUCCESS: u32 = 0;
/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const ERROR_OUT_OF_MEMORY: u32 = 2;
/// `CU_POINTER_ATTRIBUTE_BUFFER_ID`: an allocation's id, unique for the life of the process.
pub const POINTER_ATTRIBUTE_BUFFER_ID: c_int = 7;
/// `CU_EVENT_RECORD_EXTERNAL`: a record during stream capture becomes an event record node.
pub const EVENT_RECORD_EXTERNAL: c_uint = 1;
/// `CU_EVENT_WAIT_EXTERNAL`: a wait during stream capture becomes an event wait node.
pub const EVENT_WAIT_EXTERNAL: c_uint = 1;
