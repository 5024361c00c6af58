//! The collectives, enqueued on the caller's CUDA streams: each one issued alone or inside a
//! group of this communicator, which launches its collectives as one.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclRedOp_t};

use super::api::{IN_PROGRESS, SUCCESS};
use super::calls::{check, thread_token};
use super::{lock, NcclComm};
use crate::backend::cuda::driver::{CUdeviceptr, CUstream};
use crate::error::{Error, Result};

impl NcclComm {
    /// Enqueues an in-place sum of `count` values at `ptr` on `stream`. Inside [`NcclComm::group`],
    /// several are launched together.
    pub fn allreduce_sum_f32(
        &self,
        ptr: CUdeviceptr,
        count: usize,
        stream: CUstream,
    ) -> Result<()> {
        self.allreduce(ptr, count, ncclDataType_t::ncclFloat32, ncclRedOp_t::ncclSum, stream)
    }

    /// Enqueues an in-place u64 reduction (`max` false: sum) of `count` values at `ptr`.
    pub fn allreduce_u64(
        &self,
        ptr: CUdeviceptr,
        count: usize,
        max: bool,
        stream: CUstream,
    ) -> Result<()> {
        let op = if max { ncclRedOp_t::ncclMax } else { ncclRedOp_t::ncclSum };
        self.allreduce(ptr, count, ncclDataType_t::ncclUint64, op, stream)
    }

    fn allreduce(
        &self,
        ptr: CUdeviceptr,
        count: usize,
        dtype: ncclDataType_t,
        op: ncclRedOp_t,
        stream: CUstream,
    ) -> Result<()> {
        let (api, buf) = (self.api, ptr as *mut c_void);
        // SAFETY: a live communicator (`issue`); NCCL reads and writes `count` elements at `buf`
        // on `stream`, the caller's device buffer.
        self.issue("ncclAllReduce", |comm| unsafe {
            (api.all_reduce)(buf, buf, count, dtype, op, comm, stream as _)
        })
    }

    /// Enqueues an in-place reduce-scatter (sum) of f32: `ptr` holds `world_size * recv_count`
    /// values, and rank r's part, `recv_count` values from `ptr + r * recv_count` (NCCL's in-place
    /// layout), receives the sum of every rank's part r.
    pub fn reduce_scatter_sum_f32(
        &self,
        ptr: CUdeviceptr,
        recv_count: usize,
        stream: CUstream,
    ) -> Result<()> {
        let (api, send) = (self.api, ptr as *const c_void);
        let recv = (ptr + (4 * self.rank * recv_count) as u64) as *mut c_void;
        // SAFETY: a live communicator (`issue`); NCCL reads `world_size * recv_count` f32 at
        // `send` and writes the `recv_count` at `recv`, inside it, on `stream` (the caller's
        // buffer of that size).
        self.issue("ncclReduceScatter", |comm| unsafe {
            (api.reduce_scatter)(
                send,
                recv,
                recv_count,
                ncclDataType_t::ncclFloat32,
                ncclRedOp_t::ncclSum,
                comm,
                stream as _,
            )
        })
    }

    /// Enqueues an in-place sum of `count` f32 at `ptr` into rank `root`'s buffer; the other
    /// ranks' buffers are only read.
    pub fn reduce_sum_f32(
        &self,
        ptr: CUdeviceptr,
        count: usize,
        root: usize,
        stream: CUstream,
    ) -> Result<()> {
        let (api, buf) = (self.api, ptr as *mut c_void);
        let root = c_int::try_from(root)
            .map_err(|_| Error::invalid(format!("NCCL root {root} is out of range")))?;
        // SAFETY: a live communicator (`issue`); NCCL reads `count` f32 at `buf` and, on the
        // root, writes them, on `stream` (the caller's buffer of that size).
        self.issue("ncclReduce", |comm| unsafe {
            (api.reduce)(
                buf,
                buf,
                count,
                ncclDataType_t::ncclFloat32,
                ncclRedOp_t::ncclSum,
                root,
                comm,
                stream as _,
            )
        })
    }

    /// Enqueues an in-place all-gather of f64: `ptr` holds `world_size * send_count` values, and
    /// every rank's part r, `send_count` values from `ptr + r * send_count`, receives rank r's.
    pub fn allgather_f64(
        &self,
        ptr: CUdeviceptr,
        send_count: usize,
        stream: CUstream,
    ) -> Result<()> {
        let (api, recv) = (self.api, ptr as *mut c_void);
        let send = (ptr + (8 * self.rank * send_count) as u64) as *const c_void;
        // SAFETY: a live communicator (`issue`); NCCL reads the `send_count` f64 at `send` and
        // writes `world_size * send_count` at `recv`, which holds them, on `stream`.
        self.issue("ncclAllGather", |comm| unsafe {
            (api.all_gather)(send, recv, send_count, ncclDataType_t::ncclFloat64, comm, stream as _)
        })
    }

    /// Enqueues, as one NCCL group, this rank's part of an exchange of bf16 words (16-bit values
    /// bit for bit): `sends[q]` (an address and a count) goes to rank `q`, and `recvs[q]` receives
    /// rank `q`'s message to this rank; an empty one is neither sent nor received. Every pair
    /// of ranks must agree on each message's count. A rank may send to itself.
    pub fn exchange_bf16(
        &self,
        sends: &[(CUdeviceptr, usize)],
        recvs: &[(CUdeviceptr, usize)],
        stream: CUstream,
    ) -> Result<()> {
        if sends.len() != self.world_size || recvs.len() != self.world_size {
            return Err(Error::invalid(format!(
                "an exchange over {} ranks got {} sends and {} receives",
                self.world_size,
                sends.len(),
                recvs.len()
            )));
        }
        let api = self.api;
        let dtype = ncclDataType_t::ncclBfloat16;
        self.group(|| {
            for (q, (&(send, s), &(recv, r))) in sends.iter().zip(recvs).enumerate() {
                let peer = q as c_int;
                if s > 0 {
                    // SAFETY: a live communicator (`issue`); NCCL reads `s` 16-bit words at
                    // `send` on `stream` (the caller's device buffer of that size).
                    self.issue("ncclSend", |comm| unsafe {
                        (api.send)(send as *const c_void, s, dtype, peer, comm, stream as _)
                    })?;
                }
                if r > 0 {
                    // SAFETY: as above; NCCL writes `r` words at `recv`.
                    self.issue("ncclRecv", |comm| unsafe {
                        (api.recv)(recv as *mut c_void, r, dtype, peer, comm, stream as _)
                    })?;
                }
            }
            Ok(())
        })
    }

    /// Enqueues an in-place all-gather of f32: `ptr` holds `world_size * send_count` values, and
    /// every rank's part r receives rank r's.
    pub fn allgather_f32(
        &self,
        ptr: CUdeviceptr,
        send_count: usize,
        stream: CUstream,
    ) -> Result<()> {
        let (api, recv) = (self.api, ptr as *mut c_void);
        let send = (ptr + (4 * self.rank * send_count) as u64) as *const c_void;
        // SAFETY: a live communicator (`issue`); NCCL reads the `send_count` f32 at `send` and
        // writes `world_size * send_count` at `recv`, which holds them, on `stream`.
        self.issue("ncclAllGather", |comm| unsafe {
            (api.all_gather)(send, recv, send_count, ncclDataType_t::ncclFloat32, comm, stream as _)
        })
    }

    /// Issues one collective: inside this thread's [`NcclComm::group`] NCCL collects it (the
    /// group checked the communicator and holds it), otherwise it is enqueued at once.
    fn issue(&self, what: &str, call: impl FnOnce(ncclComm_t) -> c_int) -> Result<()> {
        if self.in_own_group() {
            // This thread holds `serial` and `call` for the group, which checked the
            // communicator: NCCL collects the call, and ncclGroupEnd launches and waits for it.
            let _g = self.ctx.enter()?;
            let code = call(self.comm);
            return if code == SUCCESS || code == IN_PROGRESS {
                Ok(())
            } else {
                self.finish(code, what)
            };
        }
        let _serial = lock(&self.serial);
        let code = self.call(call)?;
        self.finish(code, what)
    }

    /// Runs `f` between ncclGroupStart and ncclGroupEnd, so the collectives it issues on this
    /// communicator launch as one; returns once they are enqueued. No other thread uses the
    /// communicator meanwhile, and `abort` waits until ncclGroupEnd has returned (not for the
    /// wait after it), since the group refers to the communicator until then.
    pub fn group<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let api = self.api;
        if self.in_own_group() {
            // Nested: NCCL counts the depth, and the outermost ncclGroupEnd launches.
            // SAFETY: group calls take no communicator.
            check(api, unsafe { (api.group_start)() }, "ncclGroupStart", self.comm)?;
            let result = f();
            // SAFETY: as above.
            let end = unsafe { (api.group_end)() };
            let r = result?;
            return if end == SUCCESS || end == IN_PROGRESS {
                Ok(r)
            } else {
                Err(self.error(end, "ncclGroupEnd"))
            };
        }
        let _serial = lock(&self.serial);
        let end = {
            let call = lock(&self.call);
            self.usable()?;
            let _g = self.ctx.enter()?;
            // SAFETY: group calls take no communicator.
            check(api, unsafe { (api.group_start)() }, "ncclGroupStart", self.comm)?;
            let owner = GroupOwner::enter(&self.group_thread);
            let result = f();
            drop(owner);
            // SAFETY: as above; the communicator the group refers to is live (`call`).
            let end = unsafe { (api.group_end)() };
            drop(call);
            (result, end)
        };
        let (result, end) = end;
        let end = self.finish(end, "ncclGroupEnd");
        let r = result?;
        end.map(|_| r)
    }
}

/// Marks the calling thread as inside a communicator's group, until dropped (also on unwind).
struct GroupOwner<'a>(&'a AtomicU64);

impl<'a> GroupOwner<'a> {
    fn enter(owner: &'a AtomicU64) -> Self {
        owner.store(thread_token(), Ordering::Relaxed);
        GroupOwner(owner)
    }
}

impl Drop for GroupOwner<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Relaxed);
    }
}
