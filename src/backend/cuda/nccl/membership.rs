//! One rank per group and device in a process: a second rank of one NCCL group on a device is
//! refused before NCCL is entered.

use parking_lot::Mutex;

use super::{lock, UNIQUE_ID_BYTES};
use crate::error::{Error, Result};

/// The ranks of communicators gradacc created that are alive in this process, by unique id and
/// device: NCCL needs a device per rank, and finds two on one device only once every rank of the
/// group has arrived; gradacc refuses the second before it enters NCCL.
struct Member {
    id: [u8; UNIQUE_ID_BYTES],
    ordinal: i32,
    rank: usize,
}

static MEMBERS: Mutex<Vec<Member>> = Mutex::new(Vec::new());

/// A rank's entry in [`MEMBERS`], removed when the communicator (or its failed creation) ends.
pub(super) struct Membership {
    id: [u8; UNIQUE_ID_BYTES],
    rank: usize,
}

impl Membership {
    pub(super) fn claim(id: &[u8; UNIQUE_ID_BYTES], rank: usize, ordinal: i32) -> Result<Self> {
        let mut members = lock(&MEMBERS);
        for m in members.iter().filter(|m| m.id == *id) {
            if m.rank == rank {
                return Err(Error::invalid(format!("rank {rank} of this NCCL group already exists in this process (on CUDA device {})", m.ordinal)));
            }
            if m.ordinal == ordinal {
                return Err(Error::invalid(format!(
                    "ranks {} and {rank} of one NCCL group are both on CUDA device {ordinal} in this process: NCCL needs a device per rank",
                    m.rank
                )));
            }
        }
        members.push(Member { id: *id, ordinal, rank });
        Ok(Membership { id: *id, rank })
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        lock(&MEMBERS).retain(|m| m.id != self.id || m.rank != self.rank);
    }
}
