//! C API of the mesh step: one boundary over every accumulator of a rank and every rank of the
//! job, for model, pipeline, context and expert parallelism beside data parallelism. The rules
//! (what is agreed, counted and clipped) are the core's, `gradacc::Mesh`.

use std::mem::size_of;
use std::sync::{Arc, LazyLock};

use crate::accumulator::{
    gradacc_accumulator_t, gradacc_sync_info_t, write_sync_info, ACCUMULATORS,
};
use crate::comm::{gradacc_comm_t, sync_in_flight, Flight, COMMS};
use crate::handle::Registry;
use crate::status::{gradacc_status_t, guard, null, CallError, CallResult};
use crate::types::{
    check_len, check_out_struct, check_struct_size, out_ptr, read_name, read_slice,
};
use gradacc::accumulator::Accumulator;
use gradacc::comm::Communicator;
use gradacc::error::Error;
use gradacc::mesh::RefusedPart;
use gradacc::{Axis, Mesh, MeshShape, Part, Replicated};

/// One boundary over a job's accumulators (opaque): the world communicator and this rank's place
/// on the data axes. Create with gradacc_mesh_create, free with gradacc_mesh_destroy.
pub struct gradacc_mesh_t {
    _private: [u8; 0],
}

/// A tensor whose values several model-parallel ranks hold alike (a layer norm replicated over
/// tensor-parallel ranks, a tied embedding on the first and the last pipeline stage): it enters
/// the global norm once, from one copy.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_replicated_t {
    /// The tensor's index in its accumulator.
    pub tensor: u32,
    /// How many model-parallel ranks hold it at one data-parallel rank (at least 1): the step
    /// checks that exactly that many declare it.
    pub copies: u32,
    /// The same on every copy and different for different tensors (a hash of the parameter's
    /// name, say, with the tensor-parallel rank for a tied, vocabulary-sharded embedding).
    pub key: u64,
}

/// One accumulator of a mesh step and the group it reduces over. Initialise with
/// GRADACC_MESH_PART_INIT (C) or set struct_size to sizeof(gradacc_mesh_part_t), then fill in
/// the fields; every element of an array of parts has the same struct_size (the array's stride).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradacc_mesh_part_t {
    /// sizeof(gradacc_mesh_part_t).
    pub struct_size: usize,
    /// The accumulator (borrowed for the call), on the CPU or a CUDA device, created with
    /// max_grad_norm 0 (the mesh clips), and with tensor_stats 1 when it declares replicated
    /// tensors.
    pub accumulator: *mut gradacc_accumulator_t,
    /// Its group, as gradacc_accumulator_sync's `comm` (an NCCL communicator on the
    /// accumulator's device for a CUDA one): NULL when it is alone, or for a sharded
    /// accumulation's own communicator.
    pub comm: *mut gradacc_comm_t,
    /// A hybrid boundary's replica group, as gradacc_accumulator_sync_hybrid's `replica_comm`
    /// (`comm` is then the shard group); NULL otherwise.
    pub replicas: *mut gradacc_comm_t,
    /// Its replicated tensors, `replicated_count` of them (NULL when the count is 0).
    pub replicated: *const gradacc_replicated_t,
    pub replicated_count: usize,
}

/// A mesh and its world communicator's handle, which a destroy of that handle fails syncs on.
pub(crate) struct MeshHandle {
    mesh: Mesh,
    world: usize,
}

pub(crate) static MESHES: LazyLock<Registry<MeshHandle>> = LazyLock::new(|| Registry::new("mesh"));

/// Creates a mesh over `world`, a host communicator (in-process or MPI) of every rank of the job,
/// where this rank is data-parallel rank `data_rank` of `data_size`: the ranks that see different
/// data (data-parallel x context-parallel). In Megatron-Core's rank order, where the
/// tensor-parallel rank varies fastest, then the context-parallel, the data-parallel and the
/// pipeline one (rank = tp + TP*(cp + CP*(dp + DP*pp))), data_size = CP*DP and
/// data_rank = cp + CP*dp, this rank's index in its context x data-parallel group. `data_size`
/// divides the world's size. `max_grad_norm` clips the global norm (0: off), as PyTorch's
/// `clip_grad_norm_` over every parameter of the model. The mesh holds its own reference to
/// `world`'s communicator (the handle may be destroyed first; a sync in flight on it then fails).
///
/// Ownership: `*out_mesh` is the caller's; free it with gradacc_mesh_destroy.
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_mesh_create(
    world: *mut gradacc_comm_t,
    data_rank: u32,
    data_size: u32,
    max_grad_norm: f32,
    out_mesh: *mut *mut gradacc_mesh_t,
) -> gradacc_status_t {
    guard("gradacc_mesh_create", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out_mesh, "out_mesh") }?;
        let w = COMMS.get(world, "world")?;
        let mesh =
            Mesh::new(w, data_rank as usize, data_size as usize)?.max_grad_norm(max_grad_norm)?;
        *out = MESHES.insert(Arc::new(MeshHandle { mesh, world: world as usize }));
        Ok(())
    })
}

/// Destroys a mesh. NULL is accepted and does nothing; must not be called twice on one handle (a
/// second call is detected and reported as GRADACC_STATUS_INVALID_HANDLE). A sync on another
/// thread keeps the mesh until it returns.
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_mesh_destroy(mesh: *mut gradacc_mesh_t) -> gradacc_status_t {
    guard("gradacc_mesh_destroy", || {
        if !mesh.is_null() {
            MESHES.remove(mesh, "mesh")?;
        }
        Ok(())
    })
}

/// A mesh's shape (opaque), for frameworks without their own parallel state: each rank's
/// coordinates and groups in Megatron-Core's rank order or any other. Create with
/// gradacc_mesh_shape_create, free with gradacc_mesh_shape_destroy.
pub struct gradacc_mesh_shape_t {
    _private: [u8; 0],
}

pub(crate) static SHAPES: LazyLock<Registry<MeshShape>> =
    LazyLock::new(|| Registry::new("mesh shape"));

/// Creates the shape of a mesh of `world_size` ranks: `tp`, `pp` and `cp` ranks on the
/// tensor-, pipeline- and context-parallel axes (data parallel takes the rest), and the experts
/// of each pipeline stage over `ep` x `etp` of its ranks (expert data parallel takes the rest of
/// the stage), as Megatron-Core's parallel state makes them. Every size is at least 1, and the
/// products divide the world and the stage. `order` is the dense axes' rank order, fastest
/// first, their names joined by '-': NULL for Megatron-Core's "tp-cp-dp-pp" (rank =
/// tp + TP*(cp + CP*(dp + DP*pp))), or any permutation of tp, cp, dp and pp. Experts number
/// the ranks of each stage in world order, expert-tensor fastest, then ep, then edp.
///
/// Ownership: `*out_shape` is the caller's; free it with gradacc_mesh_shape_destroy.
/// Thread safety: any thread.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gradacc_mesh_shape_create(
    world_size: u32,
    tp: u32,
    pp: u32,
    cp: u32,
    ep: u32,
    etp: u32,
    order: *const std::ffi::c_char,
    out_shape: *mut *mut gradacc_mesh_shape_t,
) -> gradacc_status_t {
    guard("gradacc_mesh_shape_create", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out_shape, "out_shape") }?;
        let [world, tp, pp, cp, ep, etp] = [world_size, tp, pp, cp, ep, etp].map(|v| v as usize);
        let mut shape = MeshShape::new(world, tp, pp, cp, ep, etp)?;
        if !order.is_null() {
            // SAFETY: a non-null `order` is a NUL-terminated string (API contract).
            let order = unsafe { read_name(order, "order") }?;
            let axes: [Axis; 4] = Axis::parse_list(&order)?.try_into().map_err(|_| {
                Error::invalid(format!(
                    "`order` = \"{order}\": a permutation of tp, cp, dp and pp, fastest first"
                ))
            })?;
            shape = shape.with_order(axes)?;
        }
        *out = SHAPES.insert(Arc::new(shape));
        Ok(())
    })
}

/// Destroys a mesh shape. NULL is accepted and does nothing; must not be called twice on one
/// handle (a second call is detected and reported as GRADACC_STATUS_INVALID_HANDLE).
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_mesh_shape_destroy(
    shape: *mut gradacc_mesh_shape_t,
) -> gradacc_status_t {
    guard("gradacc_mesh_shape_destroy", || {
        if !shape.is_null() {
            SHAPES.remove(shape, "shape")?;
        }
        Ok(())
    })
}

/// Where world rank `rank` sits in its group over `axes`: the axes' names joined by '-', all of
/// the dense view (tp, cp, dp, pp) or all of the expert one (etp, ep, edp, pp). The group is the
/// ranks whose other coordinates are `rank`'s, in world rank order. `*color_out` is its smallest
/// world rank (the color of a split: the same for all its members, different between groups),
/// `*key_out` the rank's index in it (its rank there; its coordinate when `axes` names one
/// axis), `*size_out` how many ranks it has; each may be NULL. For gradacc_mesh_create,
/// `data_rank` and `data_size` are the key and the size over "cp-dp".
///
/// Thread safety: any thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_mesh_shape_group(
    shape: *const gradacc_mesh_shape_t,
    rank: u32,
    axes: *const std::ffi::c_char,
    color_out: *mut u32,
    key_out: *mut u32,
    size_out: *mut u32,
) -> gradacc_status_t {
    guard("gradacc_mesh_shape_group", || {
        let shape = SHAPES.get(shape, "shape")?;
        // SAFETY: `axes` is NULL (refused) or a NUL-terminated string (API contract).
        let axes = Axis::parse_list(&unsafe { read_name(axes, "axes") }?)?;
        let world = shape.world();
        if rank as usize >= world {
            return Err(Error::invalid(format!(
                "`rank` = {rank} is not below the mesh's {world} ranks"
            ))
            .into());
        }
        let members = shape.members(rank as usize, &axes)?;
        let key = shape.key(rank as usize, &axes)?;
        for (out, value, name) in [
            (color_out, members[0], "color_out"),
            (key_out, key, "key_out"),
            (size_out, members.len(), "size_out"),
        ] {
            if !out.is_null() {
                // SAFETY: non-null, so it points to writable storage of its type (API contract).
                *unsafe { out_ptr(out, name) }? = value as u32;
            }
        }
        Ok(())
    })
}

/// This rank's group over `axes` (as gradacc_mesh_shape_group), split from `world`: an MPI or
/// NCCL communicator of every rank of the mesh, whose ranks are the world ranks (see
/// gradacc_comm_split). Collective over `world`: every rank calls it with the same axes.
///
/// Ownership: `*out_comm` is the caller's; free it with gradacc_comm_destroy.
/// Thread safety: as gradacc_comm_split.
#[no_mangle]
pub unsafe extern "C" fn gradacc_mesh_shape_split(
    shape: *const gradacc_mesh_shape_t,
    world: *mut gradacc_comm_t,
    axes: *const std::ffi::c_char,
    out_comm: *mut *mut gradacc_comm_t,
) -> gradacc_status_t {
    guard("gradacc_mesh_shape_split", || {
        // SAFETY: a non-null output pointer points to writable storage of its type (API contract).
        let out = unsafe { out_ptr(out_comm, "out_comm") }?;
        let shape = SHAPES.get(shape, "shape")?;
        let world = COMMS.get(world, "world")?;
        // SAFETY: `axes` is NULL (refused) or a NUL-terminated string (API contract).
        let axes = Axis::parse_list(&unsafe { read_name(axes, "axes") }?)?;
        *out = COMMS.insert(shape.split(&*world, &axes)?);
        Ok(())
    })
}

/// A part as read from the caller: what of it is valid.
#[derive(Default)]
struct ReadPart {
    accumulator: Option<Arc<Accumulator>>,
    comm: Option<Arc<dyn Communicator>>,
    replicas: Option<Arc<dyn Communicator>>,
    replicated: Vec<Replicated>,
    handles: [usize; 3],
}

/// The mesh step: the boundary of every accumulator of this rank's step (`parts[0..count]`), and
/// one agreement over the mesh's world for all. Every rank of the world calls it, each with its
/// own parts; the ranks of each part's group give that part at the same position of the parts
/// they share. Each part is reduced over its group and normalised by the job's totals: the item
/// counts summed over the data axes only (each data-parallel rank's window once; ranks at one
/// data-parallel rank must count alike, or the step fails on every rank naming them). The norm
/// is the job's: every distinct element once (each group's reduced gradient once; a replicated
/// tensor once over its copies), clipped by the mesh's max_grad_norm with one coefficient, the
/// same bits on every rank. A non-finite value on any rank in any part skips the step on every
/// rank: `*info_out` (may be NULL) reports it with the world rank, and `*overflow_part_out` (may
/// be NULL; UINT32_MAX when none) that rank's part. Every part's window reports the same info, so
/// gradacc_scaler_update_from and each optimizer's step follow it.
///
/// A CUDA part's group is an NCCL communicator; the world stays a host one. Its control step and
/// its measures are read back to the host (the call waits for each CUDA part's stream), and the
/// job's report is written where the device's scaler and optimizer read it. A rank may mix CPU and
/// CUDA parts. A refused part whose accumulator is known takes part in its group's control step
/// on NCCL too; one with a NULL accumulator cannot tell an NCCL group (its peers wait until their
/// communicator's timeout).
///
/// An invalid argument on one rank (a NULL or wrong handle, a struct_size, a replicated array)
/// fails that rank naming it, and the others with GRADACC_STATUS_PEER_FAILURE: the rank still
/// takes part, flagged invalid, in the control step of each part's group it can name and in the
/// world's agreement. A part whose group it cannot name (parts NULL, or parts[0].struct_size
/// wrong, so no element can be read; a NULL accumulator with a NULL comm under sharded
/// accumulation) leaves that group's peers waiting until their communicator's timeout. A failure
/// before the reductions leaves every window intact; one after them discards every window.
///
/// Thread safety: serialised with every other call on each part's accumulator; one call per
/// rank, each on its rank's thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_mesh_sync(
    mesh: *mut gradacc_mesh_t,
    parts: *const gradacc_mesh_part_t,
    count: usize,
    info_out: *mut gradacc_sync_info_t,
    overflow_part_out: *mut u32,
) -> gradacc_status_t {
    guard("gradacc_mesh_sync", || {
        let m = MESHES.get(mesh, "mesh")?;
        // SAFETY: a non-null `parts` points to `count` parts of the stride parts[0].struct_size
        // (API contract).
        let (read, error) = unsafe { read_parts(parts, count) };
        let error = error.or_else(|| check_out_struct(info_out, "info_out").err());
        if let Some(e) = error {
            let known: Vec<RefusedPart<'_>> = read
                .iter()
                .map(|p| RefusedPart {
                    accumulator: p.accumulator.as_deref(),
                    comm: p.comm.as_deref(),
                    replicas: p.replicas.as_deref(),
                })
                .collect();
            m.mesh.refuse(&known);
            return Err(e);
        }
        let _flights: Vec<Flight> = read
            .iter()
            .map(|p| sync_in_flight(p.handles[0], &[p.handles[1], p.handles[2], m.world]))
            .collect();
        let parts: Vec<Part<'_>> = read
            .iter()
            .map(|p| Part {
                accumulator: p.accumulator.as_deref().expect("checked"),
                comm: p.comm.as_deref(),
                replicas: p.replicas.as_deref(),
                replicated: &p.replicated,
            })
            .collect();
        let result = m.mesh.sync(&parts)?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API
        // contract); a NULL one is skipped.
        unsafe { write_sync_info(info_out, &result.info) };
        // SAFETY: as above.
        if let Some(out) = unsafe { overflow_part_out.as_mut() } {
            *out = result.overflow_part.map_or(u32::MAX, |p| p as u32);
        }
        Ok(())
    })
}

/// Ends the open micro-batch of each of `accumulators` (`count` handles, this rank's, each under
/// GRADACC_OVERFLOW_DROP_MICROBATCH and fed tensor by tensor since
/// gradacc_accumulator_begin_microbatch; not sharded accumulation), agreeing its drop over the
/// world first (one all-gather of 24 bytes per rank): if any rank at this data-parallel rank
/// (its tensor-, pipeline- and expert-tensor-parallel peers, which computed from the same data)
/// found a non-finite gradient in any of its accumulators, every one of them drops the
/// micro-batch in every accumulator; the others keep theirs. Every rank of the world calls it
/// once per micro-batch, before its peers' gradients of the next one. `*kept_out` (may be NULL)
/// is 1 when this rank kept the micro-batch, 0 when it dropped it. An invalid argument on one
/// rank fails it naming the argument, and the others with GRADACC_STATUS_PEER_FAILURE; every
/// micro-batch then stays open (end it again, or with gradacc_accumulator_end_microbatch).
///
/// Thread safety: serialised with every other call on each accumulator; one call per rank, each
/// on its rank's thread.
#[no_mangle]
pub unsafe extern "C" fn gradacc_mesh_end_microbatch(
    mesh: *mut gradacc_mesh_t,
    accumulators: *const *mut gradacc_accumulator_t,
    count: usize,
    kept_out: *mut u32,
) -> gradacc_status_t {
    guard("gradacc_mesh_end_microbatch", || {
        let m = MESHES.get(mesh, "mesh")?;
        // SAFETY: a non-null `accumulators` points to `count` handles (API contract).
        let read = unsafe { read_slice(accumulators, count, "accumulators", "count") }.and_then(
            |handles| {
                let accs = handles
                    .iter()
                    .enumerate()
                    .map(|(i, &h)| ACCUMULATORS.get(h, &format!("accumulators[{i}]")))
                    .collect::<CallResult<Vec<_>>>()?;
                Ok((handles, accs))
            },
        );
        let (handles, accs) = match read {
            Ok(r) => r,
            Err(e) => {
                m.mesh.refuse_microbatch();
                return Err(e);
            }
        };
        let _flights: Vec<Flight> =
            handles.iter().map(|&h| sync_in_flight(h as usize, &[m.world])).collect();
        let refs: Vec<&Accumulator> = accs.iter().map(|a| &**a).collect();
        let kept = m.mesh.end_microbatch(&refs)?;
        // SAFETY: a non-null output pointer points to writable storage of its type (API
        // contract); a NULL one is skipped.
        if let Some(out) = unsafe { kept_out.as_mut() } {
            *out = kept as u32;
        }
        Ok(())
    })
}

/// Reads the caller's parts: what is valid of each (for a refusal) and the first error.
///
/// # Safety
/// A non-null `parts` points to `count` readable elements of parts[0].struct_size bytes each.
unsafe fn read_parts(
    parts: *const gradacc_mesh_part_t,
    count: usize,
) -> (Vec<ReadPart>, Option<CallError>) {
    if parts.is_null() {
        return (Vec::new(), Some(null("parts")));
    }
    if count == 0 {
        let e = Error::invalid("`count` = 0: a mesh step needs at least one part");
        return (Vec::new(), Some(e.into()));
    }
    // SAFETY: non-null, and every part starts with a readable `size_t struct_size`.
    let stride = unsafe { std::ptr::read_unaligned(parts as *const usize) };
    let fields = match check_stride(parts, count, stride) {
        Ok(f) => f,
        Err(e) => return (Vec::new(), Some(e)),
    };
    let mut error = None;
    let read = (0..count)
        .map(|i| {
            // SAFETY: element i starts `i * stride` bytes in and holds `stride` >= `fields`
            // readable bytes (the caller's array); the product fits (checked).
            let at = unsafe { (parts as *const u8).add(i * stride) } as *const gradacc_mesh_part_t;
            // SAFETY: as above.
            let (p, read) = unsafe { read_part(i, at, stride, fields) };
            if let (None, Err(e)) = (&error, p) {
                error = Some(e);
            }
            read
        })
        .collect();
    (read, error)
}

/// parts[0]'s struct_size as the array's stride, checked; returns the bytes of fields it covers.
fn check_stride(
    parts: *const gradacc_mesh_part_t,
    count: usize,
    stride: usize,
) -> CallResult<usize> {
    let fields = check_struct_size::<gradacc_mesh_part_t>(stride, "parts[0]")?;
    check_len::<gradacc_mesh_part_t>(count, "count")?;
    if count.checked_mul(stride).is_none_or(|b| b > isize::MAX as usize) {
        return Err(
            Error::invalid(format!("`count` = {count} parts exceed the address space")).into()
        );
    }
    if !parts.is_aligned() {
        return Err(Error::invalid(format!(
            "argument `parts` = {parts:p} is not aligned to {} bytes",
            std::mem::align_of::<gradacc_mesh_part_t>()
        ))
        .into());
    }
    Ok(fields)
}

/// Reads part `i` at `at`: its handles and replicated tensors, what of them is valid, and its
/// first error.
///
/// # Safety
/// `at` points to `fields` readable bytes of a part (at least its struct_size).
unsafe fn read_part(
    i: usize,
    at: *const gradacc_mesh_part_t,
    stride: usize,
    fields: usize,
) -> (CallResult<()>, ReadPart) {
    let mut p = gradacc_mesh_part_t {
        struct_size: 0,
        accumulator: std::ptr::null_mut(),
        comm: std::ptr::null_mut(),
        replicas: std::ptr::null_mut(),
        replicated: std::ptr::null(),
        replicated_count: 0,
    };
    // SAFETY: `at` holds `fields` readable bytes (the caller's contract), and `p` is a whole
    // part, at least `fields` bytes (checked against its field ends).
    unsafe { std::ptr::copy_nonoverlapping(at as *const u8, &mut p as *mut _ as *mut u8, fields) };
    let name = |field: &str| format!("parts[{i}].{field}");
    let accumulator = ACCUMULATORS.get(p.accumulator, &name("accumulator"));
    let optional = |h: *mut gradacc_comm_t, field: &str| {
        (!h.is_null()).then(|| COMMS.get(h, &name(field))).transpose()
    };
    let (comm, replicas) = (optional(p.comm, "comm"), optional(p.replicas, "replicas"));
    let replicated = if p.replicated_count == 0 {
        Ok(Vec::new())
    } else {
        // SAFETY: a non-null `replicated` points to `replicated_count` entries (API contract).
        unsafe {
            read_slice(
                p.replicated,
                p.replicated_count,
                &name("replicated"),
                &name("replicated_count"),
            )
        }
        .map(|r| {
            r.iter()
                .map(|r| Replicated {
                    tensor: r.tensor as usize,
                    key: r.key,
                    copies: r.copies as usize,
                })
                .collect()
        })
    };
    let size = (p.struct_size != stride).then(|| {
        CallError::from(Error::invalid(format!(
            "`parts[{i}]`.struct_size = {} differs from parts[0]'s {stride}: every part of the \
             array has the same size (sizeof(gradacc_mesh_part_t))",
            p.struct_size
        )))
    });
    let read = ReadPart {
        accumulator: accumulator.as_ref().ok().cloned(),
        comm: comm.as_ref().ok().cloned().flatten(),
        replicas: replicas.as_ref().ok().cloned().flatten(),
        replicated: replicated.as_ref().ok().cloned().unwrap_or_default(),
        handles: [p.accumulator as usize, p.comm as usize, p.replicas as usize],
    };
    let first = match size {
        Some(e) => Err(e),
        None => accumulator.and(comm).and(replicas).and(replicated).map(|_| ()),
    };
    (first, read)
}

const _: () = assert!(size_of::<gradacc_replicated_t>() == 16);
