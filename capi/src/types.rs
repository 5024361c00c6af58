//! The plain C types shared by several objects (dtype, device, tensor descriptor) and the
//! argument-checking helpers every exported function uses. Enum-like values are plain `int32_t`
//! with named constants, so a caller's out-of-range value is a status, never undefined behaviour.

use std::ffi::c_void;
use std::mem::size_of;

use crate::status::{null, CallResult};
use gradacc::device::Device;
use gradacc::dtype::Dtype;
use gradacc::error::{Error, ErrorKind};
use gradacc::TensorDesc;

/// Element type of a model gradient buffer.
pub type gradacc_dtype_t = i32;
/// IEEE 754 binary32.
pub const GRADACC_DTYPE_F32: gradacc_dtype_t = 0;
/// IEEE 754 binary16 (`_Float16`, `__half`, numpy `float16`).
pub const GRADACC_DTYPE_F16: gradacc_dtype_t = 1;
/// bfloat16 (`__nv_bfloat16`, the upper 16 bits of an f32).
pub const GRADACC_DTYPE_BF16: gradacc_dtype_t = 2;

/// Kind of device an object is bound to.
pub type gradacc_device_kind_t = i32;
/// Host memory; buffers are host pointers.
pub const GRADACC_DEVICE_CPU: gradacc_device_kind_t = 0;
/// A CUDA device; buffers are device pointers and work is ordered on the given stream.
pub const GRADACC_DEVICE_CUDA: gradacc_device_kind_t = 1;

/// The device an object is bound to. Pass NULL where a `const gradacc_device_t*` is taken to
/// mean the CPU.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_device_t {
    /// GRADACC_DEVICE_CPU or GRADACC_DEVICE_CUDA.
    pub kind: gradacc_device_kind_t,
    /// CUDA device ordinal; 0 for the CPU.
    pub ordinal: i32,
    /// The caller's `cudaStream_t` / `CUstream` (borrowed, never destroyed; it must outlive every
    /// object created on it, whose device memory is freed on it); NULL for the CPU. On CUDA, NULL
    /// or `CU_STREAM_LEGACY` is the legacy default stream; `CU_STREAM_PER_THREAD` (0x2) is refused
    /// (it names another stream on every thread).
    pub stream: *mut c_void,
}

/// One tensor of an accumulator: element count and the dtype its gradients arrive in.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_tensor_desc_t {
    /// Number of elements (at least 1).
    pub numel: u64,
    /// GRADACC_DTYPE_*.
    pub dtype: gradacc_dtype_t,
}

/// One gradient with what it holds: `numel` values of `dtype` at `data` (a host address for a
/// CPU accumulator, a device address for a CUDA one). What the typed adds
/// (gradacc_accumulator_add_grads, gradacc_accumulator_add_tensor_grad) take, so that the library
/// can refuse a buffer of another element type or length, which a `void *` does not tell it.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_grad_t {
    pub data: *const c_void,
    /// Elements at `data`.
    pub numel: u64,
    /// GRADACC_DTYPE_* of the elements.
    pub dtype: gradacc_dtype_t,
}

impl gradacc_grad_t {
    /// The address of a gradient that holds tensor `desc`'s values (`what` names it in errors):
    /// DTYPE_MISMATCH on another dtype, SIZE_MISMATCH on another length, NULL_ARGUMENT on NULL.
    pub(crate) fn checked(
        &self,
        desc: &TensorDesc,
        index: usize,
        what: &str,
    ) -> CallResult<*const c_void> {
        let dtype = dtype_from_c(self.dtype, &format!("{what}.dtype"))?;
        if dtype != desc.dtype {
            return Err(Error::new(
                ErrorKind::DtypeMismatch,
                format!(
                    "`{what}.dtype` is {}, but tensor {index} is declared {}",
                    dtype.name(),
                    desc.dtype.name()
                ),
            )
            .into());
        }
        if self.numel != desc.numel as u64 {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!(
                    "`{what}.numel` = {}, but tensor {index} has {} elements",
                    self.numel, desc.numel
                ),
            )
            .into());
        }
        if self.data.is_null() {
            return Err(null(&format!("{what}.data")));
        }
        Ok(self.data)
    }
}

pub(crate) fn dtype_from_c(value: gradacc_dtype_t, argument: &str) -> CallResult<Dtype> {
    match value {
        GRADACC_DTYPE_F32 => Ok(Dtype::F32),
        GRADACC_DTYPE_F16 => Ok(Dtype::F16),
        GRADACC_DTYPE_BF16 => Ok(Dtype::Bf16),
        v => {
            Err(Error::invalid(format!("`{argument}` = {v} is not a GRADACC_DTYPE_* value")).into())
        }
    }
}

pub(crate) fn dtype_to_c(dtype: Dtype) -> gradacc_dtype_t {
    dtype.code()
}

/// Reads the device argument: NULL or a CPU device, or a CUDA device where a driver and NVRTC
/// are present (else BACKEND_UNAVAILABLE).
pub(crate) fn parse_device(device: *const gradacc_device_t) -> CallResult<Device> {
    if device.is_null() {
        return Ok(Device::Cpu);
    }
    // SAFETY: non-null and, by the API contract, points to a gradacc_device_t.
    let d = unsafe { *device };
    match d.kind {
        GRADACC_DEVICE_CPU => {
            if d.ordinal != 0 || !d.stream.is_null() {
                return Err(Error::invalid(format!(
                    "a CPU `device` takes ordinal 0 and a NULL stream, got ordinal {} and stream {:p}",
                    d.ordinal, d.stream
                ))
                .into());
            }
            Ok(Device::Cpu)
        }
        GRADACC_DEVICE_CUDA => {
            if d.ordinal < 0 {
                return Err(Error::invalid(format!(
                    "`device`.ordinal = {} is negative",
                    d.ordinal
                ))
                .into());
            }
            gradacc::backend::cuda::driver::check_stream(d.stream as _, "`device`.stream")?;
            Ok(Device::Cuda { ordinal: d.ordinal, stream: d.stream as _ }.check()?)
        }
        k => {
            Err(Error::invalid(format!("`device`.kind = {k} is not a GRADACC_DEVICE_* value"))
                .into())
        }
    }
}

/// Checks an output pointer up front, so a call fails before it changes anything.
pub(crate) unsafe fn out_ptr<'a, T>(ptr: *mut T, argument: &str) -> CallResult<&'a mut T> {
    // SAFETY: non-null, and by the API contract points to writable storage for a T.
    unsafe { ptr.as_mut() }.ok_or_else(|| null(argument))
}

/// A C struct that starts with `size_t struct_size` and only ever grows by appending fields, so a
/// caller compiled against an older header passes a shorter struct. The sizes accepted are those
/// of the struct cut after one of its fields: the field's end, or that end rounded up to the
/// struct's alignment (what `sizeof` gives for the shorter struct); the fields read are those
/// that end within the size. This is NCCL's rule for `ncclConfig_t` (`parseCommConfig`): read the
/// prefix the caller has, default the rest. It stays unambiguous as long as a field appended in a
/// release starts at or past the previous release's `sizeof` (pad explicitly when it would not),
/// so an older caller's padding is never read as a field.
pub(crate) trait Versioned: Copy {
    /// The C name, for messages.
    const NAME: &'static str;
    /// What sets a caller's `struct_size`: the struct's `*_config_default` function, or its
    /// `*_INIT` macro (output structs), for messages.
    const SETS_SIZE: &'static str;
    /// The end offset of each field in declaration order (struct_size's first).
    fn field_ends() -> Vec<usize>;
}

/// A versioned config struct: the fields an older caller does not have take these values.
pub(crate) trait ConfigDefaults: Versioned {
    fn defaults() -> Self;
}

fn pointee_size<F>(_: *const F) -> usize {
    size_of::<F>()
}

/// Implements [`Versioned`] (and, given its `*_config_default` function, [`ConfigDefaults`]) for a
/// struct from its field list. The list must name every field in declaration order: a field added
/// to the struct but not here fails to compile (the destructuring pattern below has no `..`).
macro_rules! versioned {
    ($t:ident { $($field:ident),+ $(,)? }, defaults: $default_fn:path) => {
        versioned!(@fields $t { $($field),+ } concat!(stringify!($default_fn), "()"));
        impl ConfigDefaults for $t {
            fn defaults() -> Self {
                let mut out = std::mem::MaybeUninit::<$t>::uninit();
                // SAFETY: the pointer is to writable storage for one struct.
                let status = unsafe { $default_fn(out.as_mut_ptr()) };
                assert!(status == crate::status::GRADACC_STATUS_OK, "{} failed", stringify!($default_fn));
                // SAFETY: the default function fills every field on success.
                unsafe { out.assume_init() }
            }
        }
    };
    ($t:ident { $($field:ident),+ $(,)? }, init: $init:literal) => {
        versioned!(@fields $t { $($field),+ } $init);
    };
    (@fields $t:ident { $($field:ident),+ } $sets_size:expr) => {
        impl Versioned for $t {
            const NAME: &'static str = stringify!($t);
            const SETS_SIZE: &'static str = $sets_size;
            fn field_ends() -> Vec<usize> {
                #[allow(dead_code)]
                fn every_field_is_listed(v: $t) {
                    let $t { $($field: _),+ } = v;
                }
                let u = std::mem::MaybeUninit::<$t>::uninit();
                let base = u.as_ptr();
                // SAFETY: addr_of! only computes field addresses inside the (uninitialised) value.
                vec![$(std::mem::offset_of!($t, $field) + pointee_size(unsafe { std::ptr::addr_of!((*base).$field) })),+]
            }
        }
    };
}

use crate::accumulator::{
    gradacc_accumulator_config_default, gradacc_accumulator_config_t, gradacc_sync_info_t,
};
use crate::comm::{gradacc_mpi_config_default, gradacc_mpi_config_t};
use crate::mesh::gradacc_mesh_part_t;
use crate::optimizer::{gradacc_optimizer_config_default, gradacc_optimizer_config_t};
use crate::scaler::{
    gradacc_scaler_config_default, gradacc_scaler_config_t, gradacc_scaler_stats_t,
};

versioned!(
    gradacc_accumulator_config_t {
        struct_size,
        loss_reduction,
        normalize,
        max_grad_norm,
        bucket_numel,
        threads,
        reserved,
        sharding,
        shard_count,
        shard_rank,
        wire_dtype,
        overflow,
        tensor_stats,
    },
    defaults: gradacc_accumulator_config_default
);
versioned!(
    gradacc_scaler_config_t {
        struct_size,
        init_scale,
        growth_factor,
        backoff_factor,
        growth_interval,
        hysteresis,
        consecutive_hysteresis,
        min_scale,
        max_scale,
        dynamic,
    },
    defaults: gradacc_scaler_config_default
);
versioned!(gradacc_mpi_config_t { struct_size, shared_memory }, defaults: gradacc_mpi_config_default);
versioned!(
    gradacc_optimizer_config_t {
        struct_size,
        algorithm,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        momentum,
        dampening,
        nesterov,
        rounding,
        seed,
        masters,
        moments,
        moment_seed,
        weight_formats,
    },
    defaults: gradacc_optimizer_config_default
);
versioned!(
    gradacc_sync_info_t {
        struct_size,
        found_inf,
        total_count,
        microbatches,
        grad_norm,
        clip_coef,
        dropped_microbatches,
        overflow_at,
        overflow_rank,
        overflow_microbatch,
        overflow_tensor
    },
    init: "GRADACC_SYNC_INFO_INIT"
);
versioned!(
    gradacc_scaler_stats_t { struct_size, steps, skipped_steps, growths, backoffs },
    init: "GRADACC_SCALER_STATS_INIT"
);

versioned!(
    gradacc_mesh_part_t { struct_size, accumulator, comm, replicas, replicated, replicated_count },
    init: "GRADACC_MESH_PART_INIT"
);

/// The Rust twin of the header's GRADACC_SYNC_INFO_INIT: zeros, with this version's struct_size.
impl Default for gradacc_sync_info_t {
    fn default() -> Self {
        gradacc_sync_info_t {
            struct_size: size_of::<Self>(),
            found_inf: false,
            total_count: 0,
            microbatches: 0,
            grad_norm: 0.0,
            clip_coef: 0.0,
            dropped_microbatches: 0,
            overflow_at: 0,
            overflow_rank: 0,
            overflow_microbatch: 0,
            overflow_tensor: 0,
        }
    }
}

/// The Rust twin of the header's GRADACC_SCALER_STATS_INIT.
impl Default for gradacc_scaler_stats_t {
    fn default() -> Self {
        gradacc_scaler_stats_t {
            struct_size: size_of::<Self>(),
            steps: 0,
            skipped_steps: 0,
            growths: 0,
            backoffs: 0,
        }
    }
}

/// The sizes of `T` this library accepts: one per field, as its end and as that end rounded up
/// to `T`'s alignment, in increasing order.
pub(crate) fn accepted_sizes<T: Versioned>() -> Vec<usize> {
    let align = std::mem::align_of::<T>();
    let mut sizes: Vec<usize> =
        T::field_ends().into_iter().flat_map(|end| [end, end.next_multiple_of(align)]).collect();
    sizes.dedup();
    sizes
}

/// Checks a caller's `struct_size` for `T` and returns how many bytes of it hold fields (the end
/// of the last field it covers: the bytes past it up to `struct_size` are the caller's padding,
/// and may lie inside the next field of the current struct); 0, a size inside a field, or a size
/// larger than this library's `T` (a caller built against a newer header) fails, naming
/// `argument` and the value.
pub(crate) fn check_struct_size<T: Versioned>(
    declared: usize,
    argument: &str,
) -> CallResult<usize> {
    let current = size_of::<T>();
    if declared == 0 {
        return Err(Error::invalid(format!(
            "`{argument}`.struct_size = 0: set it to sizeof({}) before the call ({} does)",
            T::NAME,
            T::SETS_SIZE
        ))
        .into());
    }
    if declared > current {
        return Err(Error::invalid(format!(
            "`{argument}`.struct_size = {declared} is larger than this library's sizeof({}) = {current}: the caller was built \
             against a newer gradacc.h than the library loaded ({})",
            T::NAME,
            gradacc::VERSION
        ))
        .into());
    }
    let sizes = accepted_sizes::<T>();
    if !sizes.contains(&declared) {
        return Err(Error::invalid(format!(
            "`{argument}`.struct_size = {declared} does not end on a field of {} (sizes accepted: {sizes:?})",
            T::NAME
        ))
        .into());
    }
    Ok(T::field_ends().into_iter().filter(|&end| end <= declared).max().unwrap_or(0))
}

/// Reads a config struct that starts with `size_t struct_size`: the prefix its caller's size
/// covers over the defaults, so a caller built against an older header keeps working.
///
/// # Safety
/// A non-null `ptr` must point to at least `struct_size` readable bytes.
pub(crate) unsafe fn read_config<T: ConfigDefaults>(
    ptr: *const T,
    argument: &str,
) -> CallResult<T> {
    if ptr.is_null() {
        return Err(null(argument));
    }
    // SAFETY: non-null, and every config struct starts with a readable `size_t struct_size`.
    let fields =
        check_struct_size::<T>(unsafe { std::ptr::read_unaligned(ptr as *const usize) }, argument)?;
    let mut out = T::defaults();
    // SAFETY: the caller's struct holds `struct_size` >= `fields` readable bytes, and `out` is a
    // whole T, which is at least `fields` bytes long (checked against the field ends).
    unsafe {
        std::ptr::copy_nonoverlapping(ptr as *const u8, &mut out as *mut T as *mut u8, fields)
    };
    Ok(out)
}

/// Checks an output struct's `struct_size` up front, so a call fails before it changes anything;
/// NULL passes (for optional outputs).
pub(crate) fn check_out_struct<T: Versioned>(ptr: *const T, argument: &str) -> CallResult<()> {
    if !ptr.is_null() {
        // SAFETY: non-null, and by the API contract points to a struct that starts with
        // struct_size.
        check_struct_size::<T>(unsafe { std::ptr::read_unaligned(ptr as *const usize) }, argument)?;
    }
    Ok(())
}

/// Writes `value` into the part of `*ptr` its caller's `struct_size` covers, leaving struct_size
/// as the caller set it; NULL does nothing. The size was checked by [`check_out_struct`] (a size
/// that fails the check now writes nothing).
pub(crate) unsafe fn write_out_struct<T: Versioned>(ptr: *mut T, value: T) {
    if ptr.is_null() {
        return;
    }
    // SAFETY: non-null, and by the API contract points to `struct_size` writable bytes.
    let declared = unsafe { std::ptr::read_unaligned(ptr as *const usize) };
    if let Ok(fields) = check_struct_size::<T>(declared, "out") {
        let head = size_of::<usize>();
        // SAFETY: `declared` >= `fields` bytes of *ptr are writable, and `value` has
        // size_of::<T>() >= `fields` bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&value as *const T as *const u8).add(head),
                (ptr as *mut u8).add(head),
                fields - head,
            )
        };
    }
}

/// A required output struct: NULL and struct_size checked, then written as [`write_out_struct`].
pub(crate) unsafe fn write_out<T: Versioned>(
    ptr: *mut T,
    argument: &str,
    value: T,
) -> CallResult<()> {
    if ptr.is_null() {
        return Err(null(argument));
    }
    check_out_struct(ptr, argument)?;
    // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
    unsafe { write_out_struct(ptr, value) };
    Ok(())
}

/// A rank or world size as the C API's `int32_t`. Every communicator's ranks come from an `int`
/// (MPI, NCCL) or from gradacc_comm_create_local's 1..=4096, so they always fit.
pub(crate) fn rank_to_c(rank: usize) -> i32 {
    i32::try_from(rank).unwrap_or(i32::MAX)
}

/// Copies `bytes` into a caller's buffer; with a NULL buffer only reports the size needed.
pub(crate) unsafe fn write_bytes(
    bytes: &[u8],
    buf: *mut u8,
    capacity: usize,
    out_len: *mut usize,
) -> CallResult<()> {
    // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
    let len_out = unsafe { out_ptr(out_len, "out_len") }?;
    if !buf.is_null() {
        if capacity < bytes.len() {
            return Err(Error::new(
                ErrorKind::SizeMismatch,
                format!(
                    "`capacity` = {capacity} is too small: the state needs {} bytes",
                    bytes.len()
                ),
            )
            .into());
        }
        // SAFETY: buf holds at least `capacity` >= bytes.len() writable bytes (API contract).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf, bytes.len()) };
    }
    *len_out = bytes.len();
    Ok(())
}

/// Borrows input bytes.
///
/// # Safety
/// A non-null `ptr` must point to `len` readable bytes.
pub(crate) unsafe fn read_bytes<'a>(
    ptr: *const u8,
    len: usize,
    argument: &str,
) -> CallResult<&'a [u8]> {
    // SAFETY: the caller's contract, passed on.
    unsafe { read_slice(ptr, len, argument, "len") }
}

/// The longest name argument read ([`read_name`]), without its terminator.
const NAME_MAX: usize = 64;

/// A short NUL-terminated ASCII name at `ptr` (an axis list, a rank order): at most
/// [`NAME_MAX`] bytes are read, so an unterminated buffer is refused instead of overrun.
///
/// # Safety
/// A non-null `ptr` must point to a NUL-terminated string or to at least `NAME_MAX + 1` readable
/// bytes.
pub(crate) unsafe fn read_name(ptr: *const std::ffi::c_char, argument: &str) -> CallResult<String> {
    if ptr.is_null() {
        return Err(null(argument));
    }
    let mut bytes = Vec::new();
    for i in 0..=NAME_MAX {
        // SAFETY: bytes up to the terminator, and at most NAME_MAX + 1, are readable (above).
        match unsafe { *ptr.add(i) } as u8 {
            0 => break,
            b if bytes.len() == NAME_MAX || !b.is_ascii_graphic() => {
                return Err(Error::invalid(format!(
                    "`{argument}` is not a name of at most {NAME_MAX} printable ASCII characters \
                     (byte {i} is {b:#04x})"
                ))
                .into());
            }
            b => bytes.push(b),
        }
    }
    Ok(String::from_utf8(bytes).expect("ASCII"))
}

/// Borrows `len` values of `T` at `ptr` (a pointer-and-length pair of the C API). No object is
/// larger than `isize::MAX` bytes, so a longer length is the caller's mistake (often a negative
/// value or a wrapped multiplication) and is refused before a slice is formed: such a slice would
/// be undefined behaviour even before it is read.
///
/// # Safety
/// A non-null `ptr` must point to `len` readable values of `T` that stay alive and unchanged for
/// `'a`.
pub(crate) unsafe fn read_slice<'a, T>(
    ptr: *const T,
    len: usize,
    argument: &str,
    len_argument: &str,
) -> CallResult<&'a [T]> {
    if ptr.is_null() {
        return Err(null(argument));
    }
    check_len::<T>(len, len_argument)?;
    if !ptr.is_aligned() {
        return Err(Error::invalid(format!(
            "argument `{argument}` = {ptr:p} is not aligned to {} bytes",
            std::mem::align_of::<T>()
        ))
        .into());
    }
    // SAFETY: non-null, aligned, at most isize::MAX bytes (checked), and readable for `len`
    // values by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// An optional output array of `len` values of `T`: `None` for NULL, else checked for alignment
/// and size.
///
/// # Safety
/// A non-null `ptr` must point to `len` writable values of `T`, unaliased for `'a`.
pub(crate) unsafe fn out_array<'a, T>(
    ptr: *mut T,
    len: usize,
    argument: &str,
) -> CallResult<Option<&'a mut [T]>> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, and readable as the caller's writable array (read_slice only checks).
    unsafe { read_slice(ptr.cast_const(), len, argument, "n") }?;
    // SAFETY: checked above (non-null, aligned, at most isize::MAX bytes); writable for `len`
    // values and unaliased by the caller's contract.
    Ok(Some(unsafe { std::slice::from_raw_parts_mut(ptr, len) }))
}

/// Refuses a length of `T` values whose size in bytes exceeds `isize::MAX`: no buffer can hold
/// it.
pub(crate) fn check_len<T>(len: usize, len_argument: &str) -> CallResult<()> {
    let size = std::mem::size_of::<T>();
    if len.checked_mul(size).is_none_or(|bytes| bytes > isize::MAX as usize) {
        return Err(Error::invalid(format!(
            "argument `{len_argument}` = {len} is impossible: {len} values of {size} bytes exceed \
             the address space (isize::MAX bytes)"
        ))
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<T: Versioned>() {
        let ends = T::field_ends();
        assert_eq!(ends[0], size_of::<usize>(), "{}: struct_size comes first", T::NAME);
        assert!(ends.windows(2).all(|w| w[0] < w[1]), "{}: fields in declaration order", T::NAME);
        assert_eq!(
            ends.last().unwrap().next_multiple_of(std::mem::align_of::<T>()),
            size_of::<T>(),
            "{}",
            T::NAME
        );
        assert!(check_struct_size::<T>(size_of::<T>(), "x").is_ok());
        for bad in [0, 1, size_of::<usize>() - 1, size_of::<T>() + 1, size_of::<T>() + 8] {
            assert!(check_struct_size::<T>(bad, "x").is_err(), "{}: size {bad}", T::NAME);
        }
    }

    #[test]
    fn versioned_structs_accept_field_boundaries_only() {
        check::<gradacc_accumulator_config_t>();
        check::<gradacc_scaler_config_t>();
        check::<gradacc_mpi_config_t>();
        check::<gradacc_sync_info_t>();
        check::<gradacc_scaler_stats_t>();
        check::<gradacc_mesh_part_t>();
        // 8 struct_size, 4 loss_reduction, 4 normalize, 4 max_grad_norm (+4 padding), 8
        // bucket_numel, 4 threads (0.1 ended here, padded to 40), 4 reserved, 4 sharding, 4
        // shard_count, 4 shard_rank, 4 wire_dtype (0.2 ended here), 4 overflow, 4 tensor_stats.
        assert_eq!(
            accepted_sizes::<gradacc_accumulator_config_t>(),
            [8, 12, 16, 20, 24, 32, 36, 40, 44, 48, 52, 56, 60, 64]
        );
        let e = check_struct_size::<gradacc_accumulator_config_t>(22, "config").unwrap_err();
        assert!(e.message().contains("`config`.struct_size = 22"), "{}", e.message());
    }

    #[test]
    fn fields_appended_after_0_1_start_past_its_padding() {
        assert_eq!(
            std::mem::offset_of!(gradacc_accumulator_config_t, sharding),
            40,
            "0.1's config was 40 bytes"
        );
        let mut c = gradacc_accumulator_config_t::defaults();
        (c.reserved, c.sharding, c.shard_count, c.shard_rank, c.wire_dtype) =
            (u32::MAX, 7, 9, 9, 7);
        c.struct_size = 40;
        // SAFETY: `c` is a whole struct, at least `struct_size` bytes.
        let read = unsafe { read_config(&c, "config") }.unwrap();
        let d = gradacc_accumulator_config_t::defaults();
        assert_eq!(
            (read.sharding, read.shard_count, read.shard_rank, read.wire_dtype),
            (d.sharding, d.shard_count, d.shard_rank, d.wire_dtype)
        );
    }

    #[test]
    fn an_older_config_takes_the_defaults_past_its_size() {
        let mut c = gradacc_scaler_config_t::defaults();
        c.init_scale = 8.0;
        c.growth_interval = 7;
        c.struct_size = std::mem::offset_of!(gradacc_scaler_config_t, growth_interval);
        // SAFETY: `c` is a whole struct, at least `struct_size` bytes.
        let read = unsafe { read_config(&c, "config") }.unwrap();
        assert_eq!(read.init_scale, 8.0);
        assert_eq!(read.growth_interval, gradacc_scaler_config_t::defaults().growth_interval);
        // Cut after init_scale without padding: 12 bytes, growth_factor not read.
        c.growth_factor = 0.0;
        c.struct_size = 12;
        // SAFETY: `c` is a whole struct, at least `struct_size` bytes.
        let read = unsafe { read_config(&c, "config") }.unwrap();
        assert_eq!(read.init_scale, 8.0);
        assert_eq!(read.growth_factor, gradacc_scaler_config_t::defaults().growth_factor);
        // Cut after consecutive_hysteresis and padded to 32: the padding is not min_scale's.
        c.min_scale = 0.0;
        c.struct_size = 32;
        // SAFETY: `c` is a whole struct, at least `struct_size` bytes.
        let read = unsafe { read_config(&c, "config") }.unwrap();
        assert_eq!(read.min_scale, gradacc_scaler_config_t::defaults().min_scale);
    }
}
