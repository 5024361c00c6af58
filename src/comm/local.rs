//! The in-process communicator: N ranks as threads of one process, one handle per rank. Buffers
//! are reduced in place without a scratch copy: rank r sums slice r over all ranks in rank order
//! (so the bits are the same whoever computes them), then every rank copies the other slices.

use std::sync::{Arc, Barrier, Mutex};

use super::{Busy, BusyGuard, Collectives, Communicator, Control, ControlSum, HostCollectives};
use crate::backend::cpu;
use crate::error::{Error, ErrorKind, Result};

/// Elements summed per step of the reduction (fits in cache, and on the stack).
const SUM_BLOCK: usize = 2048;

/// A rank's published buffer during a reduction.
#[derive(Clone, Copy)]
struct Published {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: a published pointer is only dereferenced between the barriers of one collective, while
// its owner is blocked inside the same collective and keeps the buffer alive and untouched.
unsafe impl Send for Published {}

struct Group {
    world: usize,
    barrier: Barrier,
    buffers: Mutex<Vec<Published>>,
    controls: Mutex<Vec<Control>>,
}

/// One rank of an in-process group. Each handle is meant for one thread (one replica); the
/// handles of a group must all take part in every collective.
pub struct LocalComm {
    rank: usize,
    group: Arc<Group>,
    /// Set while this handle is inside a collective: a second concurrent use is refused, not raced.
    busy: Busy,
}

impl LocalComm {
    /// Creates the `world` handles of a new group, rank 0 first.
    pub fn group(world: usize) -> Result<Vec<LocalComm>> {
        if world == 0 {
            return Err(Error::invalid("world_size must be >= 1, got 0"));
        }
        let group = Arc::new(Group {
            world,
            barrier: Barrier::new(world),
            buffers: Mutex::new(vec![Published { ptr: std::ptr::null_mut(), len: 0 }; world]),
            controls: Mutex::new(vec![Control::default(); world]),
        });
        Ok((0..world).map(|rank| LocalComm { rank, group: group.clone(), busy: Busy::default() }).collect())
    }

    fn enter(&self) -> Result<BusyGuard<'_>> {
        self.busy.enter(|| format!("local communicator rank {}", self.rank))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn collectives(&self) -> Collectives<'_> {
        Collectives::Host(self)
    }
}

impl HostCollectives for LocalComm {
    fn reduce_control(&self, mine: &Control) -> Result<ControlSum> {
        let _busy = self.enter()?;
        let g = &*self.group;
        lock(&g.controls)[self.rank] = *mine;
        g.barrier.wait();
        let sum = {
            let all = lock(&g.controls);
            all[1..].iter().fold(ControlSum::of(&all[0]), |acc, c| acc.fold(c))
        };
        // Nobody may publish the next round's values before everyone has read this one.
        g.barrier.wait();
        Ok(sum)
    }

    fn allreduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let _busy = self.enter()?;
        let g = &*self.group;
        let (rank, world) = (self.rank, g.world);
        lock(&g.buffers)[rank] = Published { ptr: buf.as_mut_ptr(), len: buf.len() };
        g.barrier.wait();
        let peers: Vec<Published> = lock(&g.buffers).clone();
        if peers.iter().any(|p| p.len != buf.len()) {
            g.barrier.wait();
            let lens: Vec<usize> = peers.iter().map(|p| p.len).collect();
            return Err(Error::new(ErrorKind::SizeMismatch, format!("all-reduce buffer lengths differ across ranks: {lens:?}")));
        }
        let len = buf.len();
        let slice_of = |r: usize| (len * r / world)..(len * (r + 1) / world);

        // Phase 1: rank r owns slice r of every buffer; it sums that slice over ranks 0..world in
        // order and writes the result into its own buffer. No other rank touches slice r now.
        let mine = slice_of(rank);
        let mut acc = [0f32; SUM_BLOCK];
        let mut start = mine.start;
        while start < mine.end {
            let n = SUM_BLOCK.min(mine.end - start);
            // SAFETY: every peer published its live buffer before the barrier above and cannot
            // return before the barrier below; all lengths equal `len` (checked above), so
            // start..start + n, inside slice `rank`, is in bounds; in this phase only this rank
            // touches slice `rank` of any buffer, and only reads the peers' copies.
            unsafe {
                acc[..n].copy_from_slice(std::slice::from_raw_parts(peers[0].ptr.add(start), n));
                for p in &peers[1..] {
                    cpu::add_assign(&mut acc[..n], std::slice::from_raw_parts(p.ptr.add(start), n));
                }
            }
            buf[start..start + n].copy_from_slice(&acc[..n]);
            start += n;
        }
        g.barrier.wait();

        // Phase 2: copy every other slice from the rank that owns it; buffers are only read now.
        for (r, p) in peers.iter().enumerate() {
            if r != rank {
                let s = slice_of(r);
                // SAFETY: rank r's buffer is `len` long and alive until the last barrier; slice r of
                // it was finished in phase 1, and in this phase each rank writes only the slices of
                // its own buffer that other ranks own, never slice r of rank r's.
                let src = unsafe { std::slice::from_raw_parts(p.ptr.add(s.start), s.len()) };
                buf[s].copy_from_slice(src);
            }
        }
        // Nobody may return (and reuse its buffer) while others still read it.
        g.barrier.wait();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_exact_and_identical_on_every_rank() {
        for world in [1usize, 2, 3, 5] {
            let comms = LocalComm::group(world).unwrap();
            let len = 10_007;
            let results: Vec<Vec<f32>> = std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .iter()
                    .map(|c| {
                        s.spawn(move || {
                            let r = c.rank();
                            let mut buf: Vec<f32> = (0..len).map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.37 + r as f32).collect();
                            c.allreduce_sum(&mut buf).unwrap();
                            buf
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for i in 0..len {
                // The reference: the same f32 sum in rank order.
                let mut want = 0f32;
                for r in 0..world {
                    let v = ((i * 7 + r * 13) % 101) as f32 * 0.37 + r as f32;
                    want = if r == 0 { v } else { want + v };
                }
                for res in &results {
                    assert_eq!(res[i].to_bits(), want.to_bits(), "world {world} element {i}");
                }
            }
        }
    }

    #[test]
    fn control_reduction_and_length_mismatch() {
        let comms = LocalComm::group(3).unwrap();
        std::thread::scope(|s| {
            for c in &comms {
                s.spawn(move || {
                    let r = c.rank() as u64;
                    let sum = c
                        .reduce_control(&Control { numel: 10 + r, layout: 5, count: r + 1, microbatches: 1, found_inf: r == 2, error: false })
                        .unwrap();
                    assert_eq!(
                        sum,
                        ControlSum {
                            min_numel: 10,
                            max_numel: 12,
                            min_layout: 5,
                            max_layout: 5,
                            count: 6,
                            microbatches: 3,
                            found_inf: true,
                            error: false
                        }
                    );
                    let mut buf = vec![1.0f32; 4 + c.rank()];
                    let err = c.allreduce_sum(&mut buf).unwrap_err();
                    assert_eq!(err.kind, ErrorKind::SizeMismatch);
                    assert!(buf.iter().all(|&v| v == 1.0), "a failed reduction must leave the buffer as it was");
                });
            }
        });
    }
}
