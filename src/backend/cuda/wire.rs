//! The BF16 wire on NCCL: each rank rounds its FP32 contribution to bfloat16 once (`ga_to_bf16`,
//! round to nearest even, the CPU's `to_bf16_bits`), sends each rank the words of its piece
//! (ncclSend / ncclRecv in one NCCL group), and the owner of a piece widens the words it received
//! and sums them in FP32 in rank order (`ga_sum_bf16`), as the CPU's communicators do: every
//! contribution is rounded once, so the rounding's share of the error does not grow with the
//! number of ranks (the bound: docs/sharding.md). An
//! all-reduce then all-gathers the FP32 sums (ncclAllGather). An NCCL reduction in bf16 would
//! round every partial sum instead.

use std::ops::Range;
use std::sync::Arc;

use parking_lot::Mutex;

use super::driver::{
    copy, launch_args, CUdeviceptr, CUstream, Context, DeviceBuffer, Event, THREADS,
};
use super::kernels::Kernels;
use crate::backend::cuda::nccl::NcclComm;
use crate::error::Result;

/// The wire's device buffers, grown on demand.
#[derive(Default)]
struct Buffers {
    /// This rank's values rounded to bf16 words.
    out: Option<DeviceBuffer>,
    /// Every rank's words of this rank's piece, rank after rank.
    incoming: Option<DeviceBuffer>,
    /// An all-reduce's FP32 pieces, every rank's at its full size.
    gathered: Option<DeviceBuffer>,
    /// Buffers a larger one replaced: freed with the store, after every stream that used them.
    retired: Vec<DeviceBuffer>,
    /// A buffer was allocated since the last use on another stream, which must wait for it.
    fresh: bool,
}

/// The staging of a store's BF16 wire: allocated on the store's stream at first use, and used on
/// it or on a stream ordered after it (and before its drop) with events.
pub(super) struct Wire {
    ctx: Arc<Context>,
    kernels: Arc<Kernels>,
    /// The store's stream, which allocates and frees the buffers.
    stream: CUstream,
    buffers: Mutex<Buffers>,
    /// Orders another stream's use after an allocation on the store's.
    event: Mutex<Event>,
}

/// A buffer of at least `bytes` bytes: `slot`'s, or a new one (the old one retired).
fn at_least(
    ctx: &Arc<Context>,
    stream: CUstream,
    slot: &mut Option<DeviceBuffer>,
    retired: &mut Vec<DeviceBuffer>,
    fresh: &mut bool,
    bytes: usize,
) -> Result<CUdeviceptr> {
    if slot.as_ref().is_none_or(|b| b.bytes() < bytes) {
        let new = DeviceBuffer::zeroed(ctx, stream, bytes.max(4))?;
        retired.extend(slot.replace(new));
        *fresh = true;
    }
    Ok(slot.as_ref().expect("allocated above").ptr())
}

impl Wire {
    pub(super) fn new(ctx: Arc<Context>, kernels: Arc<Kernels>, stream: CUstream) -> Result<Wire> {
        let event = Mutex::new(Event::new(&ctx)?);
        Ok(Wire { ctx, kernels, stream, buffers: Mutex::new(Buffers::default()), event })
    }

    /// After the buffers are sized for a use on `stream`: a stream other than the store's waits
    /// for their allocation.
    fn ready_on(&self, b: &mut Buffers, stream: CUstream) -> Result<()> {
        if std::mem::take(&mut b.fresh) && stream != self.stream {
            self.event.lock().order(self.stream, stream)?;
        }
        Ok(())
    }

    /// Enqueues on `stream` the reduction of the `len` FP32 values at `data` over `c`, cut into
    /// `pieces` (one per rank, in rank order, tiling `0..len`): every rank's piece q goes to rank
    /// q, and the sums of this rank's piece are written at `out` (which may be its place in
    /// `data`). Every rank must pass the same cut.
    pub(super) fn reduce_to_owners(
        &self,
        c: &NcclComm,
        data: CUdeviceptr,
        pieces: &[Range<usize>],
        out: CUdeviceptr,
        stream: CUstream,
    ) -> Result<()> {
        let (world, rank) = (c.world_size(), c.rank());
        let len = pieces.last().map_or(0, |p| p.end) as u64;
        let own = pieces[rank].len();
        let (words, incoming) = {
            let mut b = self.buffers.lock();
            let b = &mut *b;
            let words = at_least(
                &self.ctx,
                self.stream,
                &mut b.out,
                &mut b.retired,
                &mut b.fresh,
                2 * len as usize,
            )?;
            let incoming = at_least(
                &self.ctx,
                self.stream,
                &mut b.incoming,
                &mut b.retired,
                &mut b.fresh,
                2 * world * own,
            )?;
            self.ready_on(b, stream)?;
            (words, incoming)
        };
        if len > 0 {
            let mut args = launch_args!(words, data, len);
            // SAFETY: argument types follow ga_to_bf16; `words` holds `len` u16 (sized above) and
            // `data` the caller's `len` f32 of this context.
            unsafe {
                self.kernels.to_bf16.launch_over(
                    &self.ctx,
                    stream,
                    len.div_ceil(THREADS as u64),
                    &mut args,
                )?
            };
        }
        let sends: Vec<(CUdeviceptr, usize)> =
            pieces.iter().map(|p| (words + 2 * p.start as u64, p.len())).collect();
        let recvs: Vec<(CUdeviceptr, usize)> =
            (0..world).map(|q| (incoming + (2 * q * own) as u64, own)).collect();
        c.exchange_bf16(&sends, &recvs, stream)?;
        if own > 0 {
            let (n, world) = (own as u64, world as u64);
            let mut args = launch_args!(out, incoming, n, world);
            // SAFETY: argument types follow ga_sum_bf16; `incoming` holds `world * n` u16 (sized
            // above) and `out` the caller's `n` f32 of this context.
            unsafe {
                self.kernels.sum_bf16.launch_over(
                    &self.ctx,
                    stream,
                    n.div_ceil(THREADS as u64),
                    &mut args,
                )?
            };
        }
        Ok(())
    }

    /// Enqueues on `stream` the all-reduce of the `len` FP32 values at `data` over `c`: reduced
    /// in equal pieces on the wire, and the pieces' FP32 sums all-gathered back into `data`.
    pub(super) fn allreduce(
        &self,
        c: &NcclComm,
        data: CUdeviceptr,
        len: usize,
        stream: CUstream,
    ) -> Result<()> {
        let (world, rank) = (c.world_size(), c.rank());
        let p = len.div_ceil(world);
        let pieces: Vec<Range<usize>> =
            (0..world).map(|q| (q * p).min(len)..((q + 1) * p).min(len)).collect();
        let gathered = {
            let mut b = self.buffers.lock();
            let b = &mut *b;
            let gathered = at_least(
                &self.ctx,
                self.stream,
                &mut b.gathered,
                &mut b.retired,
                &mut b.fresh,
                4 * world * p,
            )?;
            self.ready_on(b, stream)?;
            gathered
        };
        self.reduce_to_owners(c, data, &pieces, gathered + (4 * rank * p) as u64, stream)?;
        if p > 0 {
            c.allgather_f32(gathered, p, stream)?;
            copy(&self.ctx, stream, data, gathered, 4 * len)?;
        }
        Ok(())
    }
}
