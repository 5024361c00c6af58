//! Ranks of an MPI group killed at random moments, each run in its own `mpirun`: a kill during
//! creation leaves no shared memory behind. Needs `mpirun` (Open MPI; skipped without it) and the
//! `mpi` feature: `cargo test --release --features mpi --test mpi_kills -- --test-threads 1`.
//!
//! The test binary is also the rank program: under `mpirun` it runs the `rank` test with
//! `GRADACC_KILLS_ROLE` set. The ranks write their process ids into a folder for the harness.
#![cfg(feature = "mpi")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::Rng;
use gradacc::comm::{MpiComm, MpiOptions};
use gradacc::Communicator;

fn mpirun() -> Option<PathBuf> {
    let out = Command::new("mpirun").arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.contains("Open MPI").then(|| PathBuf::from("mpirun"))
}

/// Starts `mpirun -np 2` of this binary's `rank` test in `role`, its ids written to `dir`.
fn launch(role: &str, dir: &Path, shared_memory: bool) -> Child {
    let exe = std::env::current_exe().unwrap();
    Command::new(mpirun().unwrap())
        .args(["-np", "2", "--oversubscribe", "--mca", "orte_abort_on_non_zero_status", "0"])
        // Without recovery, mpirun ends every rank as soon as one is killed.
        .args(["--enable-recovery"])
        .arg(exe)
        .args(["--exact", "rank", "--nocapture", "--test-threads", "1"])
        .env("GRADACC_KILLS_ROLE", role)
        .env("GRADACC_KILLS_DIR", dir)
        .env("GRADACC_KILLS_SHM", if shared_memory { "1" } else { "0" })
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits (bounded) until `dir/name` exists and returns its text.
fn wait_for(dir: &Path, name: &str, within: Duration) -> Option<String> {
    let t = Instant::now();
    while t.elapsed() < within {
        if let Ok(s) = std::fs::read_to_string(dir.join(name)) {
            if s.ends_with('\n') {
                return Some(s);
            }
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// Waits for `child` up to `within`, then kills it; whether it ended by itself.
fn reap(child: &mut Child, within: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < within {
        if child.try_wait().unwrap().is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    false
}

fn fresh_dir(what: &str, i: usize) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gradacc-kills-{}-{what}-{i}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: signals a rank process this test started (its id read from the rank's own file).
    unsafe { libc::kill(pid, sig) };
}

/// What the rank program does, by role.
#[test]
fn rank() {
    let Ok(role) = std::env::var("GRADACC_KILLS_ROLE") else { return };
    let dir = PathBuf::from(std::env::var("GRADACC_KILLS_DIR").unwrap());
    let shared_memory = std::env::var("GRADACC_KILLS_SHM").as_deref() == Ok("1");
    let options = MpiOptions { shared_memory };
    match role.as_str() {
        "create" => {
            // Creations one after another; the harness kills a rank somewhere among them.
            let comm = MpiComm::world_with(options).unwrap();
            let rank = comm.rank();
            std::fs::write(dir.join(format!("pid.{rank}")), format!("{}\n", std::process::id()))
                .unwrap();
            drop(comm);
            // Until killed (bounded, should the harness be gone).
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(60) {
                drop(MpiComm::world_with(options));
            }
        }
        r => panic!("unknown role {r}"),
    }
    // Leave without MPI_Finalize: with a peer gone it may wait for it.
    // SAFETY: ends this process at once; nothing needs to run after the test's own checks.
    unsafe { libc::_exit(0) };
}

/// Segments in /dev/shm whose name says one of `pids` made them.
fn leftovers(pids: &[i32]) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/dev/shm") else { return Vec::new() };
    entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| pids.iter().any(|p| n.starts_with(&format!("gradacc-{p}-"))))
        .collect()
}

/// How many random moments each kill test tries (GRADACC_KILLS_RUNS overrides).
fn runs() -> usize {
    std::env::var("GRADACC_KILLS_RUNS").ok().and_then(|s| s.parse().ok()).unwrap_or(6)
}

#[test]
fn a_kill_during_creation_leaves_no_shared_memory_behind() {
    if mpirun().is_none() {
        eprintln!("no Open MPI mpirun; skipped");
        return;
    }
    let mut rng = Rng::fresh("kill during creation");
    for i in 0..runs() {
        let dir = fresh_dir("create", i);
        let mut child = launch("create", &dir, true);
        let pids: Vec<i32> = (0..2)
            .map(|q| wait_for(&dir, &format!("pid.{q}"), Duration::from_secs(60)))
            .collect::<Option<Vec<_>>>()
            .expect("the ranks did not start")
            .iter()
            .map(|s| s.trim().parse().unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(rng.range(1, 300)));
        let victim = rng.range(0, 1) as usize;
        signal(pids[victim], libc::SIGKILL);
        // The survivor may wait in a creation's collective for its peer: end it too.
        std::thread::sleep(Duration::from_millis(200));
        signal(pids[1 - victim], libc::SIGKILL);
        reap(&mut child, Duration::from_secs(30));
        let _ = std::fs::remove_dir_all(&dir);
        let left = leftovers(&pids);
        for name in &left {
            let _ = std::fs::remove_file(Path::new("/dev/shm").join(name));
        }
        assert!(left.is_empty(), "run {i}: rank {victim} killed, left behind: {left:?}");
    }
}
