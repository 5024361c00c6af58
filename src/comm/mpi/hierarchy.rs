//! The hierarchical boundary (asked for by `GRADACC_MPI_HIERARCHY`): when the group spans hosts
//! and each host runs several of its ranks, the boundary's reduction goes host by host. Each host
//! reduces through its shared memory into host partial sums split into one shard per rank of the
//! host; the ranks with the same index on their host (one per host) all-reduce their shard over
//! MPI; each host then gathers the finished shards through its shared memory again. Every rank
//! takes part in the creation's gather of host keys, whatever its environment says, so ranks
//! that disagree stay flat together instead of waiting for each other. Only the hosts' partial sums cross between hosts:
//! `2 (hosts - 1) / hosts` of the buffer out of each host, the least an all-reduce between hosts
//! can send.

use std::ffi::c_int;

use mpi::ffi;

use super::init::check;
use super::MpiComm;
use crate::comm::liveness::Process;
use crate::comm::shares;
use crate::comm::{BlockPass, HostCollectives};
use crate::dtype::Dtype;
use crate::error::Result;
use crate::simd;

/// The environment variable that overrides how the group finds its hosts (see [`host_key`]).
const HIERARCHY_ENV: &str = "GRADACC_MPI_HIERARCHY";

/// The two communicators a hierarchical reduction runs over.
pub(super) struct Hierarchy {
    /// This rank's host, in rank order: the intra-host reduction and gather (shared memory).
    local: MpiComm,
    /// The ranks with this rank's index on their host, one per host, in host order.
    cross: MpiComm,
}

/// This rank's host key, or `None` when the group stays flat. `GRADACC_MPI_HIERARCHY` chooses:
/// `auto`, the host is where the process runs (`liveness::Process::place`; unknown keeps it
/// flat); `n` (a positive count), every `n` consecutive ranks are one host as far as the
/// reduction is concerned (for tests and benchmarks on one machine); unset or anything else
/// (`flat`), flat. Flat is the default because the hierarchy's bits differ from the flat path's,
/// which the reduce-scatter boundary and the single-process boundary share (docs/mpi.md).
fn host_key(rank: usize, place: u64) -> Option<u64> {
    match std::env::var(HIERARCHY_ENV).ok().as_deref().map(str::trim) {
        Some("auto") => (place != 0).then_some(place),
        Some(n) => n.parse::<usize>().ok().filter(|&n| n > 0).map(|n| (rank / n) as u64 + 1),
        None => None,
    }
}

/// Where this rank lies in the hosts given every rank's key: its host's index and its own index
/// on that host, when the hierarchy applies: every key known, two hosts or more, every host with
/// the same number of ranks, two or more.
fn position(keys: &[u64], rank: usize) -> Option<(usize, usize)> {
    if keys.contains(&0) {
        return None;
    }
    let mut hosts: Vec<u64> = Vec::new();
    for &k in keys {
        if !hosts.contains(&k) {
            hosts.push(k);
        }
    }
    let per = |h: u64| keys.iter().filter(|&&k| k == h).count();
    let size = per(hosts[0]);
    if hosts.len() < 2 || size < 2 || hosts.iter().any(|&h| per(h) != size) {
        return None;
    }
    let mine = keys[rank];
    let host = hosts.iter().position(|&h| h == mine)?;
    let local = keys[..rank].iter().filter(|&&k| k == mine).count();
    Some((host, local))
}

impl MpiComm {
    /// Sets up the hierarchy (collective, at creation) where it applies and every host shares
    /// memory; `None` leaves the group flat.
    pub(super) fn hierarchy(&self) -> Result<Option<Box<Hierarchy>>> {
        let mine = host_key(self.rank, Process::mine().place).unwrap_or(0);
        let mut keys = vec![0u64; self.world];
        // SAFETY: one u64 in, one per rank out into `keys` (`world` long), a blocking
        // all-gather on the communicator's own duplicate that every rank calls here.
        let rc = unsafe {
            let word = ffi::RSMPI_UINT64_T;
            ffi::MPI_Allgather(
                (&mine as *const u64).cast(),
                1,
                word,
                keys.as_mut_ptr().cast(),
                1,
                word,
                self.comm,
            )
        };
        check(rc, "MPI_Allgather (hosts)")?;
        let Some((host, index)) = position(&keys, self.rank) else { return Ok(None) };
        let local = self.split_comm(host, self.rank, false)?;
        let cross = self.split_comm(index, self.rank, false)?;
        let (shared, mut all): (c_int, c_int) = (c_int::from(local.shares_memory()), 0);
        // SAFETY: one int in, one int out, a blocking all-reduce every rank calls here.
        let rc = unsafe {
            ffi::MPI_Allreduce(
                (&shared as *const c_int).cast(),
                (&mut all as *mut c_int).cast(),
                1,
                ffi::RSMPI_INT32_T,
                ffi::RSMPI_MIN,
                self.comm,
            )
        };
        check(rc, "MPI_Allreduce (hosts)")?;
        Ok((all == 1).then(|| Box::new(Hierarchy { local, cross })))
    }

    /// How many hosts the boundary reduces across in its hierarchy; 1 when it is flat.
    pub fn hosts(&self) -> usize {
        self.hierarchy.as_ref().map_or(1, |h| h.cross.world)
    }

    /// The hierarchical reduction: see the module and docs/mpi.md. A failure aborts this
    /// communicator and both of the hierarchy's.
    pub(super) fn reduce_by_hosts(
        &self,
        h: &Hierarchy,
        buf: &mut [f32],
        pass: &dyn BlockPass,
    ) -> Result<Vec<f64>> {
        self.check_live()?;
        let _busy = self.busy.enter(|| format!("MPI communicator rank {}", self.rank))?;
        let result = h.reduce(buf, pass);
        if let Err(e) = &result {
            self.set_aborted(format!(" after: {}", e.message));
        }
        result
    }
}

impl Hierarchy {
    pub(super) fn set_aborted(&self, reason: &str) {
        self.local.set_aborted(reason.to_string());
        self.cross.set_aborted(reason.to_string());
    }

    pub(super) fn set_timeout(&self, ns: u64) {
        for c in [&self.local, &self.cross] {
            c.timeout_ns.store(ns, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn reduce(&self, buf: &mut [f32], pass: &dyn BlockPass) -> Result<Vec<f64>> {
        let shards = shares::shard_ranges(buf.len(), self.local.world);
        let own = shards[self.local.rank].clone();
        self.local.reduce_scatter_with_pass(buf, &shards, &Partial(pass.wire()))?;
        // The buckets were checked on the whole buffer; the reduction does not depend on them.
        let mine = self.cross.allreduce_with_pass(&mut buf[own.clone()], &[], &Unscaled(pass))?;
        let values = if pass.writes_values() {
            let counts: Vec<usize> = shards.iter().map(|s| simd::blocks(s.len())).collect();
            self.local.allgather_values(&mine, &counts)?
        } else {
            vec![0.0; simd::blocks(buf.len())]
        };
        if pass.rescales() {
            if let Some(factor) = pass.rescale(&values) {
                simd::scale(&mut buf[own], factor, 1);
            }
        }
        self.local.gather_shards(buf, &shards)?;
        Ok(values)
    }
}

/// The intra-host reduction's pass: the host's partial sums stay as they are; its wire is the
/// boundary's, so on a bf16 wire each rank's contribution is rounded once here and the host's
/// partial sum once more on the cross-host wire (the bound in docs/mpi.md).
struct Partial(Dtype);

impl BlockPass for Partial {
    fn run(&self, _run: &mut [f32], _values: &mut [f64]) {}

    fn writes_values(&self) -> bool {
        false
    }

    fn wire(&self) -> Dtype {
        self.0
    }
}

/// The boundary's pass without its second step, for the reduction between hosts of one shard:
/// the factor needs every shard's values, so the hierarchy applies it once they are gathered.
struct Unscaled<'a>(&'a dyn BlockPass);

impl BlockPass for Unscaled<'_> {
    fn run(&self, run: &mut [f32], values: &mut [f64]) {
        self.0.run(run, values);
    }

    fn add_and_run(&self, run: &mut [f32], addend: &[f32], values: &mut [f64]) {
        self.0.add_and_run(run, addend, values);
    }

    fn writes_values(&self) -> bool {
        self.0.writes_values() || self.0.rescales()
    }

    fn wire(&self) -> Dtype {
        self.0.wire()
    }
}

#[cfg(test)]
mod tests {
    use super::position;

    #[test]
    fn hosts_apply_only_when_every_host_has_the_same_ranks() {
        assert_eq!(position(&[5, 5, 7, 7], 2), Some((1, 0)));
        assert_eq!(position(&[5, 7, 5, 7], 3), Some((1, 1)));
        // One host, one rank per host, unequal hosts, an unknown place.
        assert_eq!(position(&[5, 5, 5, 5], 0), None);
        assert_eq!(position(&[5, 7], 0), None);
        assert_eq!(position(&[5, 5, 7], 0), None);
        assert_eq!(position(&[5, 5, 0, 0], 0), None);
    }
}
