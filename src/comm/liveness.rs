//! Whether the peers of a group that share this host are still running, so a rank waiting for
//! them fails in milliseconds when one died instead of at the communicator's timeout. Each rank
//! names its process (process id and start time, and where it runs: boot and pid namespace) at
//! creation; a waiting rank then reads its same-host peers' `/proc/<pid>/stat` every few
//! milliseconds. A peer is dead when that entry is gone, is a zombie, or belongs to a newer
//! process (the id was reused); it is not progressing when it stays stopped by a signal
//! (SIGSTOP, SIGTSTP) for [`STOPPED_FOR`]. A peer that is alive but stuck is left to the timeout.
//! Linux only: elsewhere nothing is watched.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How long a peer may stay stopped by a signal before a waiting rank gives up on it: long
/// enough for a job suspended and resumed as a whole, where ranks wake a few ms apart.
pub(crate) const STOPPED_FOR: Duration = Duration::from_millis(200);

/// A peer of some group of this process was seen ended.
static ENDED: AtomicBool = AtomicBool::new(false);

/// Whether a wait of this process found a peer's process ended: the MPI job lost a process, and
/// MPI_Finalize may wait for it (see `mpi::finalize_at_exit`).
pub(crate) fn a_peer_ended() -> bool {
    ENDED.load(Ordering::Relaxed)
}

/// Records that a peer's process ended (seen some other way than through `/proc`).
#[cfg(feature = "mpi")]
pub(crate) fn mark_ended() {
    ENDED.store(true, Ordering::Relaxed);
}

/// How often a waiting rank looks at its peers, at least.
const LOOK_EVERY: Duration = Duration::from_millis(5);
/// Added to [`LOOK_EVERY`] per peer watched: a look reads one small file per peer.
const LOOK_PER_PEER: Duration = Duration::from_micros(100);
/// Waits shorter than this never look: the peers are usually microseconds away.
const LOOK_AFTER: Duration = Duration::from_millis(1);

/// One process of a group: what [`Process::mine`] tells the others at creation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Process {
    /// Boot and pid namespace: equal on two ranks exactly when their process ids mean the same
    /// processes. 0 where unknown (never watched).
    pub(crate) place: u64,
    pub(crate) pid: u64,
    /// Clock ticks after boot at which the process started: tells a reused id apart.
    pub(crate) start: u64,
}

impl Process {
    /// This process.
    pub(crate) fn mine() -> Process {
        let pid = std::process::id();
        let start = read_stat(pid).map_or(0, |s| s.start);
        Process { place: place(), pid: pid as u64, start }
    }

    /// As three words, for a collective.
    pub(crate) fn words(self) -> [u64; 3] {
        [self.place, self.pid, self.start]
    }

    pub(crate) fn from_words(w: &[u64]) -> Process {
        Process { place: w[0], pid: w[1], start: w[2] }
    }
}

/// Where this process's ids are meaningful: a hash of the boot id and the pid namespace. 0 when
/// the `/proc` mounted here is another pid namespace's (a process started in a namespace of its
/// own without a `/proc` of its own): there `/proc/<pid>` of a peer's id names some other
/// process, so nothing may be watched or opened through it.
fn place() -> u64 {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let ns = std::fs::read_link("/proc/self/ns/pid").unwrap_or_default();
    let own = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    if boot.is_empty() || ns.as_os_str().is_empty() || !proc_is_ours(&own, std::process::id()) {
        return 0;
    }
    let text = format!("{}|{}", boot.trim(), ns.to_string_lossy());
    crate::state::checksum(text.as_bytes()) | 1
}

/// Whether `/proc/self/stat` (its text `stat`) numbers this process `pid`, as `/proc` does for
/// the pid namespace it belongs to.
fn proc_is_ours(stat: &str, pid: u32) -> bool {
    stat.split_ascii_whitespace().next().and_then(|f| f.parse::<u32>().ok()) == Some(pid)
}

/// The fields of `/proc/<pid>/stat` a look needs.
struct Stat {
    state: u8,
    start: u64,
}

fn read_stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: the fields after it start past
    // the last ')'. There the state is field 3 and the start time field 22.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = *fields.next()?.as_bytes().first()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some(Stat { state, start })
}

/// A rank's view of its same-host peers while it waits.
pub(crate) struct Peers {
    /// (rank, process) of each watched peer.
    watched: Vec<(usize, Process)>,
    every: Duration,
    /// When each watched peer was first seen stopped, in this run of stops.
    stopped_since: Mutex<Vec<Option<Instant>>>,
}

impl Peers {
    /// The peers among `group` (every rank's process, in rank order) that run where this rank
    /// does, except `rank` itself.
    pub(crate) fn new(rank: usize, group: &[Process]) -> Peers {
        let me = group[rank];
        let watched: Vec<(usize, Process)> = if cfg!(target_os = "linux") && me.place != 0 {
            group
                .iter()
                .copied()
                .enumerate()
                .filter(|&(q, p)| q != rank && p.place == me.place && p.start != 0)
                .collect()
        } else {
            Vec::new()
        };
        let every = LOOK_EVERY + LOOK_PER_PEER * watched.len() as u32;
        let stopped_since = Mutex::new(vec![None; watched.len()]);
        Peers { watched, every, stopped_since }
    }

    /// Watches nobody.
    pub(crate) fn none() -> Peers {
        Peers::new(0, &[Process { place: 0, pid: 0, start: 0 }])
    }

    /// How many peers are watched.
    pub(crate) fn len(&self) -> usize {
        self.watched.len()
    }

    /// A watch for one wait that started at `start`.
    pub(crate) fn watch(&self, start: Instant) -> Watch<'_> {
        Watch { peers: self, next: start + LOOK_AFTER }
    }

    /// Looks at every watched peer: why the first that died or stays stopped cannot take part.
    fn look(&self) -> Result<(), String> {
        let mut since = self.stopped_since.lock();
        for (i, &(q, p)) in self.watched.iter().enumerate() {
            let pid = p.pid as u32;
            let ended = || {
                ENDED.store(true, Ordering::Relaxed);
                Err(format!("rank {q} (process {pid}) ended"))
            };
            match read_stat(pid) {
                None => return ended(),
                Some(s) if s.start != p.start || matches!(s.state, b'Z' | b'X' | b'x') => {
                    return ended();
                }
                Some(s) if s.state == b'T' => {
                    let first = *since[i].get_or_insert_with(Instant::now);
                    if first.elapsed() >= STOPPED_FOR {
                        return Err(format!(
                            "rank {q} (process {pid}) is stopped by a signal (for {:.3?} at least)",
                            first.elapsed()
                        ));
                    }
                }
                Some(_) => since[i] = None,
            }
        }
        Ok(())
    }
}

/// One wait's looks at the peers, spaced by the group's interval.
pub(crate) struct Watch<'a> {
    peers: &'a Peers,
    next: Instant,
}

impl Watch<'_> {
    /// Looks at the peers when a look is due: `Err` names a peer that died or stays stopped.
    pub(crate) fn check(&mut self, now: Instant) -> Result<(), String> {
        if self.peers.watched.is_empty() || now < self.next {
            return Ok(());
        }
        self.next = now + self.peers.every;
        self.peers.look()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_reads_as_running_and_a_gone_one_as_ended() {
        let me = Process::mine();
        if me.place == 0 {
            return; // no /proc here
        }
        let alive = Peers::new(1, &[me, me]);
        assert_eq!(alive.len(), 1);
        assert_eq!(alive.look(), Ok(()));
        // A process id that was reused: same id, another start time.
        let reused = Process { start: me.start + 1, ..me };
        let e = Peers::new(0, &[me, reused]).look().unwrap_err();
        assert!(e.contains("rank 1") && e.contains("ended"), "{e}");
        // Elsewhere: never watched.
        let far = Process { place: me.place ^ 2, ..me };
        assert_eq!(Peers::new(0, &[me, far]).len(), 0);
    }

    #[test]
    fn a_proc_of_another_pid_namespace_is_not_ours() {
        assert!(proc_is_ours("4242 (gradacc rank) S 1 4242", 4242));
        // A pid namespace without a /proc of its own: /proc/self is this process under the id
        // the parent namespace gives it.
        assert!(!proc_is_ours("98713 (gradacc rank) S 1 98713", 7));
        assert!(!proc_is_ours("", 7));
        if Process::mine().place != 0 {
            let own = std::fs::read_to_string("/proc/self/stat").unwrap();
            assert!(proc_is_ours(&own, std::process::id()));
        }
    }

    // Signals through libc, which comes with the MPI feature.
    #[cfg(feature = "mpi")]
    #[test]
    fn a_child_that_exits_is_seen_ended_and_a_stopped_one_stopped() {
        let me = Process::mine();
        if me.place == 0 {
            return;
        }
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        let start = read_stat(pid).unwrap().start;
        let peer = Process { place: me.place, pid: pid as u64, start };
        let peers = Peers::new(0, &[me, peer]);
        assert_eq!(peers.look(), Ok(()));
        // SAFETY: signals a child process this test started and still owns.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        let t = Instant::now();
        let e = loop {
            std::thread::sleep(Duration::from_millis(10));
            if let Err(e) = peers.look() {
                break e;
            }
            assert!(t.elapsed() < Duration::from_secs(20), "a stopped child never reported");
        };
        assert!(e.contains("stopped"), "{e}");
        assert!(t.elapsed() >= STOPPED_FOR, "reported after {:?}", t.elapsed());
        child.kill().unwrap();
        // A zombie (not reaped yet) counts as ended, and so does a reaped one.
        let t = Instant::now();
        let e = loop {
            match peers.look() {
                Err(e) if e.contains("ended") => break e,
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
            assert!(t.elapsed() < Duration::from_secs(20), "a killed child never reported");
        };
        assert!(e.contains("ended"), "{e}");
        child.wait().unwrap();
        assert!(peers.look().unwrap_err().contains("ended"));
    }
}
