//! The NCCL entry points gradacc calls, resolved from the library `library::NCCL` loads, and
//! typed to return a plain integer. cudarc declares them returning its `ncclResult_t` enum, and a
//! code outside that enum (from a newer NCCL, or a broken one) would be undefined behaviour before
//! any check could look at it. The data type and operation stay cudarc's enums: gradacc only passes
//! values it made.

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

use cudarc::nccl::sys::{
    cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId,
};
use libloading::Library;

use crate::backend::cuda::library::{self, Opened};
use crate::error::Result;

pub(super) const SUCCESS: c_int = 0;
pub(super) const IN_PROGRESS: c_int = 7;

/// The name of a result code this version of gradacc knows (nccl.h, up to NCCL 2.30).
pub(super) fn result_name(code: c_int) -> Option<&'static str> {
    Some(match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => return None,
    })
}

pub(super) struct Api {
    pub get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> c_int,
    pub comm_init_rank_config: unsafe extern "C" fn(
        *mut ncclComm_t,
        c_int,
        ncclUniqueId,
        c_int,
        *mut ncclConfig_t,
    ) -> c_int,
    pub comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
    pub comm_user_rank: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
    pub comm_count: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
    pub comm_cu_device: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int,
    /// Since NCCL 2.18: absent before, where only a split fails.
    pub comm_split: Option<
        unsafe extern "C" fn(ncclComm_t, c_int, c_int, *mut ncclComm_t, *mut ncclConfig_t) -> c_int,
    >,
    pub all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> c_int,
    pub reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        ncclComm_t,
        cudaStream_t,
    ) -> c_int,
    pub all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        cudaStream_t,
    ) -> c_int,
    pub reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclRedOp_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> c_int,
    pub send: unsafe extern "C" fn(
        *const c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> c_int,
    pub recv: unsafe extern "C" fn(
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> c_int,
    pub group_start: unsafe extern "C" fn() -> c_int,
    pub group_end: unsafe extern "C" fn() -> c_int,
    pub comm_finalize: unsafe extern "C" fn(ncclComm_t) -> c_int,
    pub comm_destroy: unsafe extern "C" fn(ncclComm_t) -> c_int,
    pub comm_abort: unsafe extern "C" fn(ncclComm_t) -> c_int,
    pub get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    pub get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
    /// NCCL's version code (ncclGetVersion: 22105 for 2.21.5) and the file it was loaded from
    /// (links resolved), or the name it was loaded by where the dynamic loader does not say.
    pub version: c_int,
    pub file: String,
    /// Kept open for the entry points above.
    _library: Library,
}

/// Loads NCCL and resolves every entry point, once per process: the first candidate of
/// `library::NCCL` that has them all, or BACKEND_UNAVAILABLE listing each tried and why
/// (one without an entry point is named with the first it lacks).
pub(super) fn get() -> Result<&'static Api> {
    static API: OnceLock<Result<Api>> = OnceLock::new();
    API.get_or_init(|| library::load(&library::NCCL, resolve)).as_ref().map_err(Clone::clone)
}

fn resolve(opened: Opened) -> std::result::Result<Api, String> {
    macro_rules! resolve {
        ($name:literal) => {
            // SAFETY: each field's type is the C prototype of the symbol in nccl.h, with
            // ncclResult_t (a C enum, an int) as c_int.
            unsafe { opened.symbol($name) }
                .map_err(|e| format!("{e} (gradacc needs NCCL 2.14 or newer)"))?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> c_int = resolve!("ncclGetVersion");
    let mut version = 0;
    // SAFETY: ncclGetVersion's prototype; it writes one `int` to `version`, a live local.
    if unsafe { get_version(&mut version) } != SUCCESS {
        return Err("ncclGetVersion failed".into());
    }
    let file = opened.path.clone().or_else(|| library::file_of(get_version as *const c_void));
    Ok(Api {
        version,
        file: file.map_or_else(|| opened.candidate.clone(), |f| f.display().to_string()),
        get_unique_id: resolve!("ncclGetUniqueId"),
        comm_init_rank_config: resolve!("ncclCommInitRankConfig"),
        comm_get_async_error: resolve!("ncclCommGetAsyncError"),
        comm_user_rank: resolve!("ncclCommUserRank"),
        comm_count: resolve!("ncclCommCount"),
        comm_cu_device: resolve!("ncclCommCuDevice"),
        // SAFETY: ncclCommSplit's prototype in nccl.h, with ncclResult_t as c_int.
        comm_split: unsafe { opened.symbol("ncclCommSplit") }.ok(),
        all_reduce: resolve!("ncclAllReduce"),
        reduce_scatter: resolve!("ncclReduceScatter"),
        all_gather: resolve!("ncclAllGather"),
        reduce: resolve!("ncclReduce"),
        // Since NCCL 2.7.
        send: resolve!("ncclSend"),
        recv: resolve!("ncclRecv"),
        group_start: resolve!("ncclGroupStart"),
        group_end: resolve!("ncclGroupEnd"),
        comm_finalize: resolve!("ncclCommFinalize"),
        comm_destroy: resolve!("ncclCommDestroy"),
        comm_abort: resolve!("ncclCommAbort"),
        get_error_string: resolve!("ncclGetErrorString"),
        get_last_error: resolve!("ncclGetLastError"),
        _library: opened.library,
    })
}
