//! The creation's link to the group's ranks on other hosts (see `beacon`): a second all-gather,
//! only when the group spans hosts, of each process's beacon address, a serial and its host name.

use std::ffi::c_int;

use mpi::ffi;

use super::init::check;
use super::MpiComm;
use crate::comm::beacon::{self, Far, WORDS};
use crate::comm::liveness::Process;
use crate::error::Result;

impl MpiComm {
    /// The peers on other hosts this rank watches through the beacon (collective when `group`,
    /// every rank's process, spans hosts, which every rank sees alike).
    pub(super) fn far_peers(&self, group: &[Process]) -> Result<Option<Far>> {
        if group.iter().all(|p| p.place == group[0].place) {
            return Ok(None);
        }
        let me = group[self.rank];
        let service = beacon::global(me.words());
        let mine = service.map_or(vec![0; WORDS], |s| s.words(&beacon::host_name()));
        let mut all = vec![0u64; WORDS * self.world];
        // SAFETY: WORDS u64 in, WORDS per rank out into `all` (WORDS * world), a blocking
        // all-gather on the communicator's own duplicate that every rank calls here (each sees
        // the same `group`); RSMPI_UINT64_T is rsmpi's constant, set at load and never written.
        let rc = unsafe {
            let words = ffi::RSMPI_UINT64_T;
            let n = WORDS as c_int;
            ffi::MPI_Allgather(
                mine.as_ptr().cast(),
                n,
                words,
                all.as_mut_ptr().cast(),
                n,
                words,
                self.comm,
            )
        };
        check(rc, "MPI_Allgather (beacons)")?;
        let Some(service) = service else { return Ok(None) };
        // The same bytes on every rank, and a serial of each process: one id per communicator.
        let bytes: Vec<u8> = all
            .iter()
            .chain(group.iter().flat_map(|p| p.words().to_vec()).collect::<Vec<_>>().iter())
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let id = crate::state::checksum(&bytes);
        let mut peers = Vec::new();
        for (q, w) in all.chunks_exact(WORDS).enumerate() {
            if q == self.rank || group[q].place == me.place || w[0] == 0 {
                continue;
            }
            let key = group[q].words();
            service.link(key, w);
            let host = beacon::host_of(w);
            peers.push((
                q,
                key,
                if host.is_empty() { format!("{:#x}", group[q].place) } else { host },
            ));
        }
        Ok((!peers.is_empty()).then(|| Far::new(service, id, peers)))
    }
}
