//! Whether the peers of a group on other hosts are still there, so a rank waiting for them fails
//! within about a round trip (a killed peer, a peer's abort) or [`GRACE`] (a stopped host, a cut
//! link) instead of at the communicator's timeout. `/proc` (see `liveness`) sees only this host.
//!
//! One process-wide service, started when the first MPI communicator with a rank on another host
//! is created: a thread with a TCP listener on an ephemeral port, whose addresses (this host's
//! non-loopback IPv4 ones, [`MAX_ADDRS`] at most) go to the other ranks in the creation's
//! all-gather. Each pair of processes on different hosts shares one connection, whichever
//! communicators join them; the process with the lower identity (boot and pid namespace, process
//! id, start time) connects and names itself first ([`HELLO`] bytes). No MPI call is made
//! outside the caller's own (the application may run MPI below MPI_THREAD_MULTIPLE), and the
//! thread beats while the caller computes. On each connection the thread writes a heartbeat byte
//! every [`BEAT_EVERY`] and reads what arrives: heartbeats, news that a communicator was aborted,
//! and "bye" (the peer exits normally: not a death). A waiting rank then reads, per peer on
//! another host: the communicator aborted there, the connection closed without a bye (the
//! process ended: its kernel closed it), or nothing heard for [`GRACE`] (stopped, or the link cut
//! or all but cut). A link that is slow but still carries the beats is left to the timeout.
//! `GRADACC_BEACON=0` turns the service off in a process (its peers then watch nothing of it).

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How often the thread writes a heartbeat on each connection. Each beat costs a write here and
/// a read at the peer, so the thread's cost grows with the peers on other hosts: 250 ms keeps it
/// at about 0.12 % of a core for 16 peers (`the_beacon_costs_a_small_share_of_a_core`; 0.64 % at
/// 100 ms without the wake gap) while a stopped peer is still seen within the grace plus a beat.
pub(crate) const BEAT_EVERY: Duration = Duration::from_millis(250);
/// The least time between two wake-ups of the thread. Waking for each beat that arrives would
/// cost a wake-up per peer per beat (about 30 µs of CPU each on a loaded virtual machine);
/// reading them together costs at most 1 / `WAKE_GAP` wake-ups a second, whatever the number of
/// peers, and delays news of a death or an abort by at most this much.
const WAKE_GAP: Duration = Duration::from_millis(20);
/// How long a peer may stay silent before a waiting rank gives up on it: 8 beats, so a thread
/// woken late on a loaded host (tens of milliseconds) is never taken for a stopped one.
pub(crate) const GRACE: Duration = Duration::from_secs(2);
/// How long a connect to one advertised address may take, at creation.
const CONNECT_WITHIN: Duration = Duration::from_millis(300);
/// Addresses advertised per process, at most.
pub(crate) const MAX_ADDRS: usize = 3;
/// Words per rank in the creation's second all-gather: port, addresses, a serial, host name.
pub(crate) const WORDS: usize = 2 + MAX_ADDRS + HOST_WORDS;
const HOST_WORDS: usize = 8;
/// Bytes of the connector's first message: its identity, three little-endian words.
const HELLO: usize = 24;
/// Aborted-communicator ids kept per connection, newest last.
const KEEP_ABORTED: usize = 1024;

const BEAT: u8 = b'H';
const BYE: u8 = b'B';
/// Followed by the communicator's id, eight little-endian bytes.
const ABORTED: u8 = b'A';

/// A process's identity: the words of `liveness::Process`.
pub(crate) type Key = [u64; 3];

/// What a connection's peer said last, as its reader saw it.
const OPEN: u8 = 0;
const SAID_BYE: u8 = 1;
const CLOSED: u8 = 2;
/// It sent bytes of another protocol: nothing it says can be read, so it is no longer watched
/// (the timeout stays its backstop), neither alive nor dead.
const FOREIGN: u8 = 3;

/// One peer process, as the service hears it.
struct Link {
    /// Milliseconds after the service's epoch at which bytes last arrived.
    heard: AtomicU64,
    end: AtomicU8,
    aborted: Mutex<Vec<u64>>,
}

impl Link {
    fn new(now: u64) -> Arc<Link> {
        Arc::new(Link {
            heard: AtomicU64::new(now),
            end: AtomicU8::new(OPEN),
            aborted: Mutex::default(),
        })
    }
}

/// One connection, which only the service's lock touches.
struct Conn {
    stream: TcpStream,
    /// The peer's identity: known at once on the connecting side, after its hello on the other.
    key: Option<Key>,
    link: Arc<Link>,
    inbuf: Vec<u8>,
    /// Bytes not written yet: a message is queued whole, and written in order.
    out: Vec<u8>,
    dead: bool,
}

impl Conn {
    /// Writes what is queued, as far as the socket takes it now.
    fn flush(&mut self) {
        while !self.out.is_empty() && !self.dead {
            match self.stream.write(&self.out) {
                Ok(0) => self.closed(),
                Ok(n) => drop(self.out.drain(..n)),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // Reset by the peer's kernel: as an end of file.
                Err(_) => self.closed(),
            }
        }
    }

    /// The connection closed: the peer ended, unless it said bye first.
    fn closed(&mut self) {
        self.dead = true;
        let _ = self.link.end.compare_exchange(OPEN, CLOSED, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Reads what arrived; `now` is when the reading started. What arrived is parsed before an
    /// end of file counts, so that a bye followed by the close reads as a bye, never as a death.
    fn read(&mut self, now: u64) {
        let mut buf = [0u8; 512];
        let ended = loop {
            match self.stream.read(&mut buf) {
                Ok(0) => break true,
                Ok(n) => {
                    self.inbuf.extend_from_slice(&buf[..n]);
                    self.link.heard.fetch_max(now, Ordering::AcqRel);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break false,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break true,
            }
        };
        self.parse();
        if ended {
            self.closed();
        }
    }

    /// Takes the whole messages out of `inbuf`.
    fn parse(&mut self) {
        let mut at = 0;
        if self.key.is_none() {
            if self.inbuf.len() < HELLO {
                return;
            }
            let w = |i: usize| u64::from_le_bytes(self.inbuf[8 * i..8 * i + 8].try_into().unwrap());
            self.key = Some([w(0), w(1), w(2)]);
            at = HELLO;
        }
        while at < self.inbuf.len() {
            match self.inbuf[at] {
                BEAT => at += 1,
                BYE => {
                    self.link.end.store(SAID_BYE, Ordering::Release);
                    at += 1;
                }
                ABORTED if self.inbuf.len() - at >= 9 => {
                    let id = u64::from_le_bytes(self.inbuf[at + 1..at + 9].try_into().unwrap());
                    let mut a = self.link.aborted.lock();
                    if a.len() == KEEP_ABORTED {
                        a.remove(0);
                    }
                    a.push(id);
                    at += 9;
                }
                ABORTED => break,
                _ => {
                    // Not this protocol: stop listening to it, and blame it for nothing.
                    self.dead = true;
                    let _ = self.link.end.compare_exchange(
                        OPEN,
                        FOREIGN,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                    at = self.inbuf.len();
                }
            }
        }
        self.inbuf.drain(..at);
    }
}

struct Inner {
    conns: Vec<Conn>,
    /// Every peer process linked, by identity.
    links: HashMap<Key, Arc<Link>>,
}

/// The process's beacon service.
pub(crate) struct Service {
    me: Key,
    /// The process that started it: a child forked later shares its sockets, and must not say
    /// bye for it.
    pid: u32,
    port: u16,
    addrs: Vec<Ipv4Addr>,
    epoch: Instant,
    /// When the thread last polled and read every connection that had bytes, in ms after `epoch`.
    polled: AtomicU64,
    inner: Mutex<Inner>,
    /// Held while connecting, so two creations never link one pair twice.
    connecting: Mutex<()>,
    listener: TcpListener,
    stop: AtomicBool,
    /// Tests: the thread writes no heartbeat (a stopped process).
    mute: AtomicBool,
    serial: AtomicU64,
    /// Tests: the thread, whose CPU time measures the service's cost.
    #[cfg(test)]
    thread: OnceLock<libc::pthread_t>,
}

impl Service {
    /// A service named `me`, listening on every address, with its thread started; `addrs` are
    /// the addresses to advertise (this host's by default).
    pub(crate) fn start(me: Key, addrs: Option<Vec<Ipv4Addr>>) -> std::io::Result<Arc<Service>> {
        let listener = TcpListener::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let service = Arc::new(Service {
            me,
            pid: std::process::id(),
            port,
            addrs: addrs.unwrap_or_else(host_addresses),
            epoch: Instant::now(),
            polled: AtomicU64::new(0),
            inner: Mutex::new(Inner { conns: Vec::new(), links: HashMap::new() }),
            connecting: Mutex::new(()),
            listener,
            stop: AtomicBool::new(false),
            mute: AtomicBool::new(false),
            serial: AtomicU64::new(0),
            #[cfg(test)]
            thread: OnceLock::new(),
        });
        let s = Arc::clone(&service);
        let _thread =
            std::thread::Builder::new().name("gradacc-beacon".into()).spawn(move || s.run())?;
        #[cfg(test)]
        let _ = service.thread.set(std::os::unix::thread::JoinHandleExt::as_pthread_t(&_thread));
        Ok(service)
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// This process's words for the creation's all-gather ([`WORDS`]).
    pub(crate) fn words(&self, host: &str) -> Vec<u64> {
        let mut w = vec![0u64; WORDS];
        w[0] = self.port as u64;
        for (slot, a) in w[1..1 + MAX_ADDRS].iter_mut().zip(&self.addrs) {
            *slot = u32::from(*a) as u64;
        }
        w[1 + MAX_ADDRS] = self.serial.fetch_add(1, Ordering::Relaxed);
        put_host(&mut w[2 + MAX_ADDRS..], host);
        w
    }

    /// Links this process to `peer` (its all-gather words `w`) unless it is linked already:
    /// the lower identity connects; the other waits for its hello.
    pub(crate) fn link(&self, peer: Key, w: &[u64]) {
        let port = w[0] as u16;
        if port == 0 || peer <= self.me {
            return;
        }
        let _one = self.connecting.lock();
        if self.inner.lock().links.get(&peer).is_some_and(|l| l.end.load(Ordering::Acquire) == OPEN)
        {
            return;
        }
        // An address this host has too (a container bridge's, the same on every host) is tried
        // last: connected there, this process would watch a listener of its own host.
        let mut addrs: Vec<Ipv4Addr> = w[1..1 + MAX_ADDRS]
            .iter()
            .filter(|&&a| a != 0)
            .map(|&a| Ipv4Addr::from(a as u32))
            .collect();
        addrs.sort_by_key(|a| self.addrs.contains(a));
        for a in addrs {
            let to = SocketAddrV4::new(a, port).into();
            let Ok(stream) = TcpStream::connect_timeout(&to, CONNECT_WITHIN) else { continue };
            if stream.set_nonblocking(true).is_err() || stream.set_nodelay(true).is_err() {
                continue;
            }
            let mut out = Vec::with_capacity(HELLO);
            self.me.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
            let link = Link::new(self.now());
            let mut conn = Conn {
                stream,
                key: Some(peer),
                link: Arc::clone(&link),
                inbuf: Vec::new(),
                out,
                dead: false,
            };
            conn.flush();
            let mut inner = self.inner.lock();
            inner.links.insert(peer, link);
            inner.conns.push(conn);
            return;
        }
    }

    /// Why `peer` cannot take part in communicator `id`, if it cannot: it aborted `id`, its
    /// connection closed, or it has been silent for [`GRACE`]. `None` also for a peer not linked,
    /// or whose connection carried another protocol.
    pub(crate) fn why(&self, peer: &Key, id: u64) -> Option<String> {
        let link = Arc::clone(self.inner.lock().links.get(peer)?);
        if link.aborted.lock().contains(&id) {
            return Some("aborted the communicator".into());
        }
        match link.end.load(Ordering::Acquire) {
            CLOSED => return Some("ended (its connection closed)".into()),
            SAID_BYE | FOREIGN => return None,
            _ => {}
        }
        let silent =
            self.polled.load(Ordering::Acquire).saturating_sub(link.heard.load(Ordering::Acquire));
        (silent >= GRACE.as_millis() as u64).then(|| {
            format!("sent no heartbeat for {:.1} s (stopped, or unreachable)", silent as f64 / 1e3)
        })
    }

    /// Tells `peers` that communicator `id` was aborted here.
    pub(crate) fn aborted(&self, peers: &[Key], id: u64) {
        let mut inner = self.inner.lock();
        for c in inner.conns.iter_mut().filter(|c| c.key.is_some_and(|k| peers.contains(&k))) {
            c.out.push(ABORTED);
            c.out.extend_from_slice(&id.to_le_bytes());
            c.flush();
        }
    }

    /// Says bye on every connection (this process exits normally). Nothing in a forked child:
    /// the connections are its parent's (and the child may have been forked while another
    /// thread held the lock, which no thread of the child will release).
    pub(crate) fn bye(&self) {
        if std::process::id() != self.pid {
            return;
        }
        let mut inner = self.inner.lock();
        for c in &mut inner.conns {
            c.out.push(BYE);
            c.flush();
        }
    }

    /// The thread: heartbeats out, whatever arrives in, until [`Service::stop`].
    fn run(&self) {
        let mut next_beat = Instant::now();
        // After an accept failed (out of descriptors: the listener stays readable), the listener
        // rests until the next beat instead of waking the thread at once, again and again.
        let mut listen_after = Instant::now();
        let mut woke = Instant::now();
        while !self.stop.load(Ordering::Acquire) {
            if let Some(rest) = WAKE_GAP.checked_sub(woke.elapsed()) {
                std::thread::sleep(rest);
            }
            let listen = Instant::now() >= listen_after;
            let mut fds = vec![libc::pollfd {
                fd: if listen { self.listener.as_raw_fd() } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            }];
            {
                let mut inner = self.inner.lock();
                let beat = Instant::now() >= next_beat;
                if beat {
                    next_beat = Instant::now() + BEAT_EVERY;
                }
                let mute = self.mute.load(Ordering::Relaxed);
                for c in &mut inner.conns {
                    if beat && !mute && c.out.is_empty() {
                        c.out.push(BEAT);
                    }
                    c.flush();
                    fds.push(libc::pollfd {
                        fd: c.stream.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                }
            }
            let wait = next_beat.saturating_duration_since(Instant::now()).as_millis() as i32 + 1;
            // SAFETY: `fds` is a live array of `fds.len()` pollfd, the descriptors of the listener
            // and of connections this service owns (closed only by this thread, below).
            unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
            woke = Instant::now();
            let now = self.now();
            let mut inner = self.inner.lock();
            // Only what poll found ready is read: with many peers beating at their own times,
            // most wake-ups are for one connection.
            let ready = |fd: &libc::pollfd| fd.revents != 0;
            let mut accepting = listen && ready(&fds[0]);
            while accepting {
                let stream = match self.listener.accept() {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        if e.kind() != ErrorKind::WouldBlock {
                            listen_after = Instant::now() + BEAT_EVERY;
                        }
                        accepting = false;
                        continue;
                    }
                };
                if stream.set_nonblocking(true).is_ok() && stream.set_nodelay(true).is_ok() {
                    let link = Link::new(now);
                    inner.conns.push(Conn {
                        stream,
                        key: None,
                        link,
                        inbuf: Vec::new(),
                        out: Vec::new(),
                        dead: false,
                    });
                }
            }
            let Inner { conns, links } = &mut *inner;
            // The connections polled are the first ones, in order (the others are new since:
            // linked meanwhile, or just accepted), and every one of them is read.
            for (i, c) in conns.iter_mut().enumerate() {
                if fds.get(i + 1).is_some_and(|fd| !ready(fd)) {
                    continue;
                }
                let known = c.key.is_some();
                c.read(now);
                if let (false, Some(k)) = (known, c.key) {
                    links.insert(k, Arc::clone(&c.link));
                }
            }
            conns.retain(|c| !c.dead);
            self.polled.store(now, Ordering::Release);
        }
    }

    /// Stops the thread; its connections close as the service is dropped (tests).
    #[cfg(test)]
    fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }
}

static GLOBAL: OnceLock<Option<Arc<Service>>> = OnceLock::new();

/// The process's service: started on the first call unless `GRADACC_BEACON=0` (or it cannot
/// listen); `None` then, and ever after.
pub(crate) fn global(me: Key) -> Option<&'static Service> {
    let s = GLOBAL.get_or_init(|| {
        if !cfg!(target_os = "linux") || std::env::var("GRADACC_BEACON").is_ok_and(|v| v == "0") {
            return None;
        }
        let s = Service::start(me, None).ok()?;
        // SAFETY: `say_bye` is an `extern "C" fn()` that cannot unwind, as atexit requires; this
        // runs once (`OnceLock`).
        unsafe { libc::atexit(say_bye) };
        Some(s)
    });
    s.as_deref()
}

/// At exit: a normal end, not a death.
extern "C" fn say_bye() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(Some(s)) = GLOBAL.get() {
            s.bye();
        }
    });
}

/// This host's name, as [`Service::words`] packs it.
pub(crate) fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is 256 writable bytes; gethostname writes at most that many.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) } != 0 {
        return String::new();
    }
    let n = buf.iter().position(|&b| b == 0).unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

fn put_host(w: &mut [u64], host: &str) {
    let mut bytes = [0u8; 8 * HOST_WORDS];
    let n = host.len().min(bytes.len());
    bytes[..n].copy_from_slice(&host.as_bytes()[..n]);
    for (slot, c) in w.iter_mut().zip(bytes.chunks_exact(8)) {
        *slot = u64::from_le_bytes(c.try_into().unwrap());
    }
}

/// The host name in a rank's all-gather words.
pub(crate) fn host_of(w: &[u64]) -> String {
    let bytes: Vec<u8> = w[2 + MAX_ADDRS..].iter().flat_map(|v| v.to_le_bytes()).collect();
    let n = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..n]).into_owned()
}

/// This host's up, non-loopback IPv4 addresses, [`MAX_ADDRS`] at most.
fn host_addresses() -> Vec<Ipv4Addr> {
    let mut out = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list it allocated to `list`, freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return out;
    }
    let mut at = list;
    while !at.is_null() && out.len() < MAX_ADDRS {
        // SAFETY: `at` is a node of the list getifaddrs returned, not freed yet.
        let ifa = unsafe { &*at };
        let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0
            && ifa.ifa_flags & libc::IFF_LOOPBACK as u32 == 0;
        let inet = !ifa.ifa_addr.is_null() && {
            // SAFETY: a non-null `ifa_addr` points to a sockaddr, whose family says its type.
            let family = unsafe { (*ifa.ifa_addr).sa_family };
            family as i32 == libc::AF_INET
        };
        if up && inet {
            // SAFETY: checked just above: an AF_INET address, so a sockaddr_in.
            let sin = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
            out.push(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
        }
        at = ifa.ifa_next;
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    out
}

/// A communicator's peers on other hosts, watched through the service.
pub(crate) struct Far {
    service: &'static Service,
    /// The communicator's id, the same on every rank.
    id: u64,
    /// (rank, identity, host) of each peer on another host.
    peers: Vec<(usize, Key, String)>,
    keys: Vec<Key>,
}

impl Far {
    pub(crate) fn new(service: &'static Service, id: u64, peers: Vec<(usize, Key, String)>) -> Far {
        let keys = peers.iter().map(|p| p.1).collect();
        Far { service, id, peers, keys }
    }

    /// Why the first peer that cannot take part cannot: "rank r on host h ...".
    fn check(&self) -> Result<(), String> {
        for (q, k, host) in &self.peers {
            if let Some(why) = self.service.why(k, self.id) {
                if why.starts_with("ended") {
                    super::liveness::mark_ended();
                }
                return Err(format!("rank {q} on host {host} {why}"));
            }
        }
        Ok(())
    }

    /// Tells the peers that this communicator was aborted here.
    pub(crate) fn aborted(&self) {
        self.service.aborted(&self.keys, self.id);
    }
}

/// Waits shorter than this never look, and a wait looks every [`LOOK_EVERY`].
const LOOK_AFTER: Duration = Duration::from_millis(1);
const LOOK_EVERY: Duration = Duration::from_millis(5);

/// One wait's looks at the peers on other hosts (none for a group on one host).
pub(crate) struct FarWatch<'a> {
    far: Option<&'a Far>,
    next: Instant,
}

impl<'a> FarWatch<'a> {
    /// A watch for one wait that started at `start`.
    pub(crate) fn new(far: Option<&'a Far>, start: Instant) -> FarWatch<'a> {
        FarWatch { far, next: start + LOOK_AFTER }
    }

    /// Looks when a look is due: `Err` names a peer that cannot take part.
    pub(crate) fn check(&mut self, now: Instant) -> Result<(), String> {
        let Some(far) = self.far.filter(|_| now >= self.next) else { return Ok(()) };
        self.next = now + LOOK_EVERY;
        far.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Arc<Service>, Arc<Service>) {
        let lo = Some(vec![Ipv4Addr::LOCALHOST]);
        let a = Service::start([1, 1, 1], lo.clone()).unwrap();
        let b = Service::start([1, 2, 1], lo).unwrap();
        a.link(b.me, &b.words("b"));
        (a, b)
    }

    /// Waits until `f` holds, for 10 s at most.
    fn until(what: &str, f: impl Fn() -> bool) -> Duration {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(10), "never: {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
        t.elapsed()
    }

    fn heard(s: &Service, k: &Key) -> Option<u64> {
        s.inner.lock().links.get(k).map(|l| l.heard.load(Ordering::Acquire))
    }

    #[test]
    fn heartbeats_flow_both_ways_and_an_abort_is_news() {
        let (a, b) = pair();
        until("b hears a's hello", || heard(&b, &a.me).is_some());
        let (ha, hb) = (heard(&a, &b.me).unwrap(), heard(&b, &a.me).unwrap());
        until("both hear heartbeats", || {
            heard(&a, &b.me).unwrap() > ha + 150 && heard(&b, &a.me).unwrap() > hb + 150
        });
        assert_eq!(a.why(&b.me, 7), None);
        assert_eq!(b.why(&a.me, 7), None);
        a.aborted(&[b.me], 7);
        until("b hears the abort", || b.why(&a.me, 7).is_some());
        assert_eq!(b.why(&a.me, 7).unwrap(), "aborted the communicator");
        assert_eq!(b.why(&a.me, 8), None, "only that communicator");
        assert_eq!(a.why(&[9, 9, 9], 7), None, "a peer never linked is not watched");
    }

    #[test]
    fn a_closed_connection_reads_as_ended_and_a_bye_does_not() {
        let (a, b) = pair();
        until("b hears a", || heard(&b, &a.me).is_some());
        b.bye();
        until("a hears the bye", || {
            a.inner.lock().links[&b.me].end.load(Ordering::Acquire) == SAID_BYE
        });
        b.stop();
        drop(b);
        std::thread::sleep(GRACE + BEAT_EVERY * 3);
        assert_eq!(a.why(&[1, 2, 1], 1), None, "a peer that said bye is never dead");

        let (a, b) = pair();
        let key = b.me;
        until("b hears a", || heard(&b, &a.me).is_some());
        // Killed: its kernel closes the connection, no bye.
        b.stop();
        drop(b);
        let took = until("a sees b end", || a.why(&key, 1).is_some());
        assert_eq!(a.why(&key, 1).unwrap(), "ended (its connection closed)");
        assert!(took < Duration::from_secs(1), "{took:?}");
    }

    #[test]
    fn a_silent_peer_reads_as_stopped_after_the_grace() {
        let (a, b) = pair();
        until("b hears a", || heard(&b, &a.me).is_some());
        b.mute.store(true, Ordering::Relaxed);
        let t = Instant::now();
        until("a gives up on b", || a.why(&b.me, 1).is_some());
        let why = a.why(&b.me, 1).unwrap();
        assert!(
            why.starts_with("sent no heartbeat for 2.")
                && why.ends_with("(stopped, or unreachable)"),
            "{why}"
        );
        assert!(t.elapsed() >= GRACE - BEAT_EVERY * 2, "{:?}", t.elapsed());
        b.mute.store(false, Ordering::Relaxed);
        until("beats again", || a.why(&b.me, 1).is_none());
    }

    /// The CPU time, in ns, of the clock `clock`.
    fn cpu_ns(clock: libc::clockid_t) -> u64 {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: `ts` is a valid timespec to write; a clock that does not exist fails, checked.
        assert_eq!(unsafe { libc::clock_gettime(clock, &mut ts) }, 0);
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }

    /// The CPU time of `s`'s thread, in ns.
    fn thread_cpu_ns(s: &Service) -> u64 {
        let mut clock: libc::clockid_t = 0;
        // SAFETY: the thread runs until its service stops (never, here), so its handle is live.
        assert_eq!(unsafe { libc::pthread_getcpuclockid(*s.thread.get().unwrap(), &mut clock) }, 0);
        cpu_ns(clock)
    }

    /// The beacon's cost in CPU time, which a busy machine does not inflate as it scatters wall
    /// time: the thread of a process linked to 16 peers on other hosts, and one look at them all
    /// from a waiting rank, as shares of the time they are spent in. Each bounds what the beacon
    /// can take from a boundary: the thread's share of a core, and the look's share of the
    /// `LOOK_EVERY` of waiting that it comes after (docs/reliability.md).
    #[test]
    fn the_beacon_costs_a_small_share_of_a_core() {
        let lo = Some(vec![Ipv4Addr::LOCALHOST]);
        let a = Service::start([1, 1, 1], lo.clone()).unwrap();
        let peers: Vec<_> =
            (0..16).map(|i| Service::start([1, 3, i], lo.clone()).unwrap()).collect();
        for b in &peers {
            a.link(b.me, &b.words("b"));
        }
        for b in &peers {
            until("b hears a", || heard(b, &a.me).is_some());
        }
        let (cpu, wall) = (thread_cpu_ns(&a), Instant::now());
        std::thread::sleep(Duration::from_secs(3));
        let thread = (thread_cpu_ns(&a) - cpu) as f64 / wall.elapsed().as_nanos() as f64;

        let keys: Vec<Key> = peers.iter().map(|b| b.me).collect();
        let looks = 2000;
        let cpu = cpu_ns(libc::CLOCK_THREAD_CPUTIME_ID);
        for _ in 0..looks {
            assert!(keys.iter().all(|k| a.why(k, 1).is_none()));
        }
        let look = (cpu_ns(libc::CLOCK_THREAD_CPUTIME_ID) - cpu) as f64 / looks as f64;
        let look_share = look / LOOK_EVERY.as_nanos() as f64;
        println!(
            "beacon, 16 peers: thread {:.4} % of a core; one look {:.0} ns, {:.4} % of the wait",
            thread * 100.0,
            look,
            look_share * 100.0
        );
        // Half the 1 % a healthy boundary may lose, for the busiest machine.
        assert!(thread < 5e-3, "the thread takes {:.3} % of a core", thread * 100.0);
        assert!(look_share < 5e-3, "a look takes {look:.0} ns");
    }

    #[test]
    fn a_connection_of_another_protocol_is_not_watched() {
        let a = Service::start([1, 1, 1], Some(vec![Ipv4Addr::LOCALHOST])).unwrap();
        let mut stranger = TcpStream::connect((Ipv4Addr::LOCALHOST, a.port)).unwrap();
        let key: Key = [7, 7, 7];
        let hello: Vec<u8> = key.iter().flat_map(|w| w.to_le_bytes()).collect();
        stranger.write_all(&hello).unwrap();
        until("a links the stranger", || heard(&a, &key).is_some());
        stranger.write_all(b"GET / HTTP/1.0\r\n").unwrap();
        until("a stops listening", || {
            a.inner.lock().links[&key].end.load(Ordering::Acquire) == FOREIGN
        });
        // Silent from now on, but never declared dead for it.
        std::thread::sleep(GRACE + BEAT_EVERY * 3);
        assert_eq!(a.why(&key, 1), None);
        drop(stranger);
        std::thread::sleep(BEAT_EVERY * 3);
        assert_eq!(a.why(&key, 1), None, "nor when it closes");
    }
}
