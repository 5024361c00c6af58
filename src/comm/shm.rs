//! The reduction in shares through memory that every rank of a group maps: the ranks of one host.
//! Each rank stages the pieces it sends in an outbox of its own, and the other ranks read them
//! there, in place: no copy into a transport's buffers, no system call, no MPI progress engine.
//! The ranks meet at barriers, one per exchange, one per gather and one at the end, each a
//! counter per rank in the shared header that its rank raises (Release) and the others poll
//! (Acquire): every write before a rank's arrival is seen by every rank that passed the barrier.
//!
//! Why two outboxes per rank, used by step parity, and one barrier each for exchange and gather
//! are enough: a rank writes step `k`'s outbox again only at step `k + 2`, after it passed the
//! exchange barrier of step `k + 1`, which every other rank reached only after its last read of
//! step `k`'s outboxes (its sum of step `k`, or the copy-back of step `k`'s gather). With the
//! clipping pass the gathers run after every exchange, each step once more with its own barrier,
//! and the same argument holds between gathers. The barrier at the end keeps the next reduction
//! from writing an outbox that a slower rank still reads.
//!
//! No rank waits forever: a barrier polls, spinning for a while, then yielding the core, then
//! sleeping, until its peers arrive, the timeout passes (TIMEOUT), the communicator or a peer
//! aborted, or a peer died or stays stopped (`liveness`; COMM_FAILURE). A rank that fails raises the shared abort word, so its peers stop at
//! once instead of waiting for their own timeouts. The memory stays mapped as long as any rank
//! maps it, so a late rank never touches freed memory.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::liveness::Peers;
use super::shares::{self, ShareTransport, Step, PAGE, SHARE_NUMEL, SKEW};
use crate::error::{Error, ErrorKind, Result};
use crate::math::NORM_BLOCK;

/// One cache line and its neighbour (the adjacent-line prefetcher pairs them): the abort word and
/// each rank's counter get their own, so a rank polling one never slows the rank raising another.
const LINE: usize = 128;

/// At most this many bytes of outboxes for a whole group (two per rank): pieces shrink with the
/// square of the group's size to stay within it, down to one block of the norm; a larger group
/// reduces through its transport's own collectives.
const BUDGET: usize = 32 << 20;

/// Polls between two looks at the clock and the communicator's abort flag.
const SPINS: u32 = 64;
/// How long a barrier spins before it yields the core between polls: giving the core away at
/// once would let other work take it for a whole time slice while the peers are microseconds away.
/// Only when the group has a core per rank: with more ranks than cores, the rank a barrier waits
/// for may be the one that needs this core, so it yields at once (4 processes on 2 cores, sharded
/// accumulation at 16M: 1.31x add plus MPI's reduce-scatter spinning, 0.66x yielding).
const SPIN_FOR: Duration = Duration::from_micros(200);
/// How long a barrier yields the core between polls before it sleeps between them.
const YIELD_FOR: Duration = Duration::from_millis(2);
const FIRST_PAUSE: Duration = Duration::from_micros(5);
const MAX_PAUSE: Duration = Duration::from_micros(500);

/// The most elements of one rank's piece per step for a group of `world` ranks: whole blocks,
/// [`SHARE_NUMEL`] at most, shrunk so every outbox of the group fits [`BUDGET`]; `None` when not
/// even one block per piece fits.
pub(crate) fn piece_for(world: usize) -> Option<usize> {
    let most = BUDGET / (2 * world * world * 4);
    let piece = most.min(SHARE_NUMEL) / NORM_BLOCK * NORM_BLOCK;
    (piece > 0 && world > 1).then_some(piece)
}

/// The shared memory of one group: the header (the abort word, each rank's barrier counter) and
/// two outboxes per rank, each room for one step's pieces of every rank as FP32.
pub(crate) struct Region {
    base: *mut u8,
    world: usize,
    piece: usize,
    /// [`SPIN_FOR`], or nothing when the group has more ranks than this process has cores.
    spin_for: Duration,
}

// SAFETY: the region is plain memory that every rank's process maps; within a process the
// threads that use it go through the atomics of the header, and the outboxes are written and
// read only between barriers, as the module's protocol says (one collective at a time per
// communicator, which holds the region).
unsafe impl Send for Region {}
// SAFETY: as for Send: `&Region` hands out only atomics and the outboxes, whose use the barriers
// order.
unsafe impl Sync for Region {}

impl Region {
    /// Bytes from one outbox to the next: room for one piece of every rank, as FP32, past the
    /// skew.
    fn outbox_stride(world: usize, piece: usize) -> usize {
        (SKEW + world * piece * 4).next_multiple_of(PAGE)
    }

    fn header_bytes(world: usize) -> usize {
        (LINE * (1 + world)).next_multiple_of(PAGE)
    }

    /// The bytes a region for `world` ranks and pieces of `piece` elements takes.
    pub(crate) fn size(world: usize, piece: usize) -> usize {
        Self::header_bytes(world) + 2 * world * Self::outbox_stride(world, piece)
    }

    /// A region over `base`.
    ///
    /// # Safety
    /// `base` is aligned to 8 bytes and points to [`Region::size`]`(world, piece)` bytes, all zero
    /// before any rank of the group used them, that stay valid for as long as the region lives,
    /// and that no one touches but the group's ranks through regions of the same `world` and
    /// `piece`, each rank through one region at a time.
    pub(crate) unsafe fn new(base: *mut u8, world: usize, piece: usize) -> Region {
        assert!(base.cast::<AtomicU64>().is_aligned() && world > 0 && piece > 0);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let spin_for = if world <= cores { SPIN_FOR } else { Duration::ZERO };
        Region { base, world, piece, spin_for }
    }

    fn word(&self, line: usize) -> &AtomicU64 {
        assert!(line <= self.world);
        // SAFETY: line `line` of the header lies inside the region (`header_bytes` holds
        // `1 + world` lines), 8-byte aligned (`new` checked the base; LINE is a multiple of 8);
        // the bytes started as zero, a valid AtomicU64, and are only ever used as this atomic.
        unsafe { &*self.base.add(line * LINE).cast::<AtomicU64>() }
    }

    /// Raised by any rank that stopped in the middle of a reduction.
    fn abort_word(&self) -> &AtomicU64 {
        self.word(0)
    }

    /// Rank `q`'s barrier counter: how many barriers it arrived at.
    fn counter(&self, q: usize) -> &AtomicU64 {
        self.word(1 + q)
    }

    /// Tells every rank of the group that this one stopped: their barriers fail at once.
    pub(crate) fn abort(&self) {
        self.abort_word().store(1, Ordering::Release);
    }

    /// Rank `q`'s outbox for step parity `parity`, in words.
    fn outbox(&self, q: usize, parity: usize) -> *mut u16 {
        assert!(q < self.world && parity < 2);
        let at = Self::header_bytes(self.world)
            + (2 * q + parity) * Self::outbox_stride(self.world, self.piece)
            + SKEW;
        // SAFETY: outbox `2q + parity` of `2 * world` lies inside the region (see `size`).
        unsafe { self.base.add(at).cast() }
    }

    /// Words in one outbox.
    fn outbox_words(&self) -> usize {
        self.world * self.piece * 2
    }
}

/// The reduction in shares over a [`Region`]: the data moves through the region, and `inner`
/// (the group's own transport) gathers the block values.
pub(crate) struct Shm<'a, T: ShareTransport + ?Sized> {
    inner: &'a mut T,
    region: &'a Region,
    /// Barriers this rank passed over the region's life: every rank passes the same ones.
    passed: &'a mut u64,
    timeout: Option<Duration>,
    /// The communicator's own abort flag.
    stopped: &'a AtomicBool,
    /// The group's ranks on this host: a wait fails as soon as one died or stays stopped.
    peers: &'a Peers,
    /// Says which communicator waits, in error messages.
    label: &'a str,
    /// The step whose outboxes `incoming` and `finished` read, and its ranges.
    parity: usize,
    on_wire: Vec<Range<usize>>,
    packed: Vec<Range<usize>>,
}

impl<'a, T: ShareTransport + ?Sized> Shm<'a, T> {
    pub(crate) fn new(
        inner: &'a mut T,
        region: &'a Region,
        passed: &'a mut u64,
        timeout: Option<Duration>,
        stopped: &'a AtomicBool,
        peers: &'a Peers,
        label: &'a str,
    ) -> Self {
        assert_eq!(region.world, inner.world(), "a region per group");
        Shm {
            inner,
            region,
            passed,
            timeout,
            stopped,
            peers,
            label,
            parity: 0,
            on_wire: Vec::new(),
            packed: Vec::new(),
        }
    }

    /// Arrives at the next barrier and waits for every rank of the group to arrive.
    fn barrier(&mut self, step: Step) -> Result<()> {
        *self.passed += 1;
        let (region, target) = (self.region, *self.passed);
        let rank = self.inner.rank();
        region.counter(rank).store(target, Ordering::Release);
        let start = Instant::now();
        let mut watch = self.peers.watch(start);
        let (mut polls, mut pause) = (0u32, FIRST_PAUSE);
        loop {
            if (0..region.world).all(|q| region.counter(q).load(Ordering::Acquire) >= target) {
                return Ok(());
            }
            let failed = |kind, why: String| {
                region.abort();
                Err(Error::new(
                    kind,
                    format!(
                        "{} {step} stopped on rank {rank} of {}: {why}",
                        self.label, region.world
                    ),
                ))
            };
            if region.abort_word().load(Ordering::Acquire) != 0 {
                return failed(
                    ErrorKind::CommFailure,
                    "another rank of the group failed, timed out or was aborted".into(),
                );
            }
            polls += 1;
            if polls % SPINS != 0 {
                std::hint::spin_loop();
                continue;
            }
            if self.stopped.load(Ordering::Acquire) {
                return failed(
                    ErrorKind::CommFailure,
                    format!("the communicator was aborted (after {:.3?})", start.elapsed()),
                );
            }
            if let Err(why) = watch.check(Instant::now()) {
                return failed(ErrorKind::CommFailure, why);
            }
            let waited = start.elapsed();
            if let Some(t) = self.timeout.filter(|&t| waited >= t) {
                return failed(
                    ErrorKind::Timeout,
                    format!(
                        "it did not complete within the timeout of {t:?} (waited {waited:.3?}): a rank failed, is late, or did not call it; the communicator was aborted"
                    ),
                );
            }
            if waited < region.spin_for {
                std::hint::spin_loop();
            } else if waited < YIELD_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(pause);
                pause = (pause * 2).min(MAX_PAUSE);
            }
        }
    }

    /// Rank `q`'s outbox of the current step, as words.
    fn theirs(&self, q: usize) -> &[u16] {
        // SAFETY: the outbox lies inside the region (see `Region::outbox`), `outbox_words` long,
        // 4-byte aligned (SKEW past a page boundary); rank q wrote it before the barrier this rank
        // passed and writes it again only after every rank passed a later barrier (the module's
        // protocol), so nothing writes it while this borrow of `self` lasts.
        unsafe {
            std::slice::from_raw_parts(
                self.region.outbox(q, self.parity),
                self.region.outbox_words(),
            )
        }
    }
}

impl<T: ShareTransport + ?Sized> ShareTransport for Shm<'_, T> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world(&self) -> usize {
        self.region.world
    }

    fn piece_limit(&self) -> usize {
        self.region.piece
    }

    fn outbox(&mut self, k: usize, words: usize) -> &mut [u16] {
        let n = self.region.outbox_words();
        assert!(words <= n, "a step of {words} words exceeds the outbox of {n}");
        // SAFETY: this rank's outbox for step k's parity, inside the region, `n` words; no other
        // rank reads it until this rank arrives at the next barrier, and none still reads it from
        // step k - 2 (the module's protocol); `&mut self` keeps `theirs` from reading it now.
        unsafe { std::slice::from_raw_parts_mut(self.region.outbox(self.inner.rank(), k % 2), n) }
    }

    fn exchange(&mut self, step: Step, k: usize, packed: &[Range<usize>]) -> Result<()> {
        self.parity = k % 2;
        self.on_wire = packed.to_vec();
        self.barrier(step)
    }

    fn incoming(&self, q: usize) -> &[u16] {
        &self.theirs(q)[self.on_wire[self.inner.rank()].clone()]
    }

    fn gather(&mut self, step: Step, k: usize, packed: &[Range<usize>]) -> Result<()> {
        self.parity = k % 2;
        self.packed = packed.to_vec();
        self.barrier(step)
    }

    fn finished(&self, q: usize) -> &[f32] {
        &shares::values(self.theirs(q))[self.packed[q].clone()]
    }

    fn gather_values(&mut self, mine: &[f64], counts: &[usize]) -> Result<&[f64]> {
        self.inner.gather_values(mine, counts)
    }

    fn finish(&mut self) -> Result<()> {
        self.barrier(Step::Done)
    }
}

/// Shared memory for a [`Region`]: one rank creates it and names it to the others, every rank
/// maps it, and then the name goes, so the memory goes when the last rank unmaps it.
///
/// On Linux the memory is a memfd: it never has a name in a file system, the others open it
/// through the creator's `/proc/<pid>/fd/<fd>` while the creator holds it open, and a crash at
/// any moment (during creation included) leaves nothing behind. Elsewhere it is a POSIX shared
/// memory object whose name is removed once every rank mapped it; a crash in between leaves it.
#[cfg(feature = "mpi")]
pub(crate) mod posix {
    use std::ffi::CString;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// A mapping of shared memory, unmapped on drop.
    pub(crate) struct Mapping {
        base: *mut u8,
        len: usize,
    }

    // SAFETY: the mapping is an address range owned by this value; `Region` orders its use.
    unsafe impl Send for Mapping {}
    // SAFETY: as for Send; `&Mapping` only hands out the base address.
    unsafe impl Sync for Mapping {}

    /// What the creator holds while the others open the memory: dropping it removes the way to
    /// reach the memory (closes the memfd, or unlinks the name), never the memory.
    pub(crate) struct Offer {
        /// What the others pass to [`Mapping::open`].
        name: String,
        #[cfg(target_os = "linux")]
        fd: libc::c_int,
    }

    impl Offer {
        pub(crate) fn name(&self) -> &str {
            &self.name
        }
    }

    impl Drop for Offer {
        fn drop(&mut self) {
            #[cfg(target_os = "linux")]
            {
                // SAFETY: `fd` is the memfd `create` opened, closed only here, once; the mappings
                // keep the memory alive without it.
                unsafe { libc::close(self.fd) };
            }
            #[cfg(not(target_os = "linux"))]
            unlink(&self.name);
        }
    }

    /// A fresh tag: the process, a counter and the time, so two groups never meet by chance.
    fn fresh_tag() -> String {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        format!("gradacc-{}-{}-{nanos:x}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
    }

    fn last_error(what: &str) -> String {
        format!("{what}: {}", std::io::Error::last_os_error())
    }

    /// Gives `fd` `len` zero bytes with their pages reserved now (a full /dev/shm fails here, not
    /// with SIGBUS on first touch), and maps it.
    fn size_and_map(fd: libc::c_int, len: usize) -> Result<Mapping, String> {
        // SAFETY: `fd` is a new, empty object; the sizes fit an off_t (a region is at most tens
        // of MB).
        let sized = unsafe {
            libc::ftruncate(fd, len as libc::off_t) == 0
                && libc::posix_fallocate(fd, 0, len as libc::off_t) == 0
        };
        if sized {
            Mapping::map(fd, len)
        } else {
            Err(last_error("reserving shared memory"))
        }
    }

    /// Whether `fd` is `len` bytes long.
    fn has_len(fd: libc::c_int, len: usize) -> bool {
        // SAFETY: an all-zero `stat` is a valid value for fstat to overwrite.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open; fstat writes one `stat`.
        let rc = unsafe { libc::fstat(fd, &mut st) };
        rc == 0 && st.st_size as usize == len
    }

    impl Mapping {
        /// Creates `len` bytes of zeroed shared memory, maps it, and offers it to the others.
        #[cfg(target_os = "linux")]
        pub(crate) fn create(len: usize) -> Result<(Mapping, Offer), String> {
            let tag = fresh_tag();
            let c = CString::new(tag.as_str()).map_err(|e| e.to_string())?;
            // SAFETY: `c` is a NUL-terminated name (a label only: memfds live in no file system).
            let fd = unsafe { libc::memfd_create(c.as_ptr(), libc::MFD_CLOEXEC) };
            if fd < 0 {
                return Err(last_error("memfd_create"));
            }
            let offer = Offer { name: format!("/proc/{}/fd/{fd} {tag}", std::process::id()), fd };
            Ok((size_and_map(fd, len)?, offer))
        }

        /// Creates `len` bytes of zeroed shared memory, maps it, and offers it to the others.
        #[cfg(not(target_os = "linux"))]
        pub(crate) fn create(len: usize) -> Result<(Mapping, Offer), String> {
            let name = format!("/{}", fresh_tag());
            let c = CString::new(name.as_str()).map_err(|e| e.to_string())?;
            // SAFETY: `c` is a NUL-terminated name; the flags make a new object or fail.
            let fd = unsafe {
                libc::shm_open(c.as_ptr(), libc::O_CREAT | libc::O_EXCL | libc::O_RDWR, 0o600)
            };
            if fd < 0 {
                return Err(last_error("shm_open"));
            }
            let offer = Offer { name };
            let mapped = size_and_map(fd, len);
            // SAFETY: `fd` is ours; the mapping (if any) keeps the object alive without it.
            unsafe { libc::close(fd) };
            Ok((mapped?, offer))
        }

        /// Maps the memory another rank offered under `name`, which must be `len` bytes long.
        pub(crate) fn open(name: &str, len: usize) -> Result<Mapping, String> {
            let fd = Self::open_offer(name)?;
            let mapped = if has_len(fd, len) {
                Self::map(fd, len)
            } else {
                Err(format!("shared memory {name} is not {len} bytes"))
            };
            // SAFETY: `fd` is ours; the mapping keeps the memory alive without it.
            unsafe { libc::close(fd) };
            mapped
        }

        /// Opens the creator's memfd through its `/proc` entry, and checks it is the memfd of
        /// that tag: on another host the same path may name something else, or nothing.
        #[cfg(target_os = "linux")]
        fn open_offer(name: &str) -> Result<libc::c_int, String> {
            let (path, tag) = name.split_once(' ').ok_or_else(|| format!("bad offer {name}"))?;
            let c = CString::new(path).map_err(|e| e.to_string())?;
            // SAFETY: `c` is a NUL-terminated path; opening changes nothing.
            let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
            if fd < 0 {
                return Err(last_error("open"));
            }
            let target = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap_or_default();
            if target.to_string_lossy().starts_with(&format!("/memfd:{tag} ")) {
                Ok(fd)
            } else {
                // SAFETY: `fd` is ours, closed once.
                unsafe { libc::close(fd) };
                Err(format!("{path} is not the shared memory {tag}"))
            }
        }

        #[cfg(not(target_os = "linux"))]
        fn open_offer(name: &str) -> Result<libc::c_int, String> {
            let c = CString::new(name).map_err(|e| e.to_string())?;
            // SAFETY: `c` is a NUL-terminated name; opening an existing object changes nothing.
            let fd = unsafe { libc::shm_open(c.as_ptr(), libc::O_RDWR, 0) };
            if fd < 0 {
                return Err(last_error("shm_open"));
            }
            Ok(fd)
        }

        fn map(fd: libc::c_int, len: usize) -> Result<Mapping, String> {
            // SAFETY: maps `len` bytes of the object behind `fd`, which is at least that long, at
            // an address the kernel picks; nothing else is affected.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(last_error("mmap"));
            }
            Ok(Mapping { base: p.cast(), len })
        }

        /// The first byte, page-aligned.
        pub(crate) fn base(&self) -> *mut u8 {
            self.base
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: `base`..`base + len` is the mapping `map` made, unmapped only here, once;
            // its users (the region) are gone with the owner of this value.
            unsafe { libc::munmap(self.base.cast(), self.len) };
        }
    }

    /// Removes the name `name`; the memory stays until the last mapping goes.
    #[cfg(not(target_os = "linux"))]
    fn unlink(name: &str) {
        if let Ok(c) = CString::new(name) {
            // SAFETY: `c` is a NUL-terminated name; a name already gone is not an error here.
            unsafe { libc::shm_unlink(c.as_ptr()) };
        }
    }
}
