//! The shared-memory path, set up at creation: rank 0 offers a mapping, every rank maps it, and
//! the group uses it only when every rank could.

use std::ffi::c_int;

use mpi::ffi;

use super::init::check;
use super::{MpiComm, Shared};
use crate::comm::shm::{self, posix, Region};
use crate::error::Result;

/// Bytes of the broadcast that tells the ranks how to reach the shared memory (`shm::posix`).
const OFFER_BYTES: usize = 128;

impl MpiComm {
    /// Maps shared memory for the group, when every rank can (collective, at creation): rank 0
    /// creates it and broadcasts how to reach it, every rank maps it, and all agree whether all
    /// could; then rank 0 withdraws the offer (see `shm::posix`: on Linux nothing of it is ever
    /// left in a file system, whenever a rank dies). `None` where any rank could not (another
    /// host or pid namespace, which a rank knows from the processes' places and then does not
    /// even try; no /dev/shm, too little room there) or the group is too large or a single rank.
    pub(super) fn share_memory(&self) -> Result<Option<Shared>> {
        let Some(piece) = shm::piece_for(self.world) else { return Ok(None) };
        let size = Region::size(self.world, piece);
        let mut name = [0u8; OFFER_BYTES];
        let created = if self.rank == 0 { posix::Mapping::create(size).ok() } else { None };
        if let Some((_, offer)) = &created {
            let text = offer.name().as_bytes();
            if text.len() < OFFER_BYTES {
                name[..text.len()].copy_from_slice(text);
            }
        }
        let (buf, len) = (name.as_mut_ptr().cast(), OFFER_BYTES as c_int);
        // SAFETY: `name` is OFFER_BYTES writable bytes on every rank, the count given; rank 0 is
        // the root of a blocking broadcast on the communicator's own duplicate, which every rank
        // calls here.
        let rc = unsafe { ffi::MPI_Bcast(buf, len, ffi::RSMPI_UINT8_T, 0, self.comm) };
        check(rc, "MPI_Bcast (shared memory)")?;
        let name = String::from_utf8_lossy(
            &name[..name.iter().position(|&b| b == 0).unwrap_or(OFFER_BYTES)],
        )
        .into_owned();
        let (mapping, offer) = match created {
            Some((m, offer)) => (Some(m), Some(offer)),
            None if !name.is_empty() && self.near_root => {
                (posix::Mapping::open(&name, size).ok(), None)
            }
            None => (None, None),
        };
        let (mine, mut all): (c_int, c_int) = (c_int::from(mapping.is_some()), 0);
        // SAFETY: one int in, one int out, a blocking all-reduce every rank calls here.
        let agreed = check(
            unsafe {
                ffi::MPI_Allreduce(
                    (&mine as *const c_int).cast(),
                    (&mut all as *mut c_int).cast(),
                    1,
                    ffi::RSMPI_INT32_T,
                    ffi::RSMPI_MIN,
                    self.comm,
                )
            },
            "MPI_Allreduce (shared memory)",
        );
        drop(offer);
        agreed?;
        Ok(match mapping {
            Some(m) if all == 1 => Some(Shared {
                // SAFETY: the mapping is `size` bytes, page-aligned, zero-filled at creation, mapped
                // by every rank of the group (all agreed) and used only through this region, which
                // lives beside it in `Shared` and goes first.
                region: unsafe { Region::new(m.base(), self.world, piece) },
                _mapping: m,
            }),
            _ => None,
        })
    }
}
