//! This test binary's ranks under Open MPI's `mpirun`: the harness test starts the binary's rank
//! test on every rank, passes it its case through environment variables, and reads what the
//! ranks printed.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Far above a run's time on a busy machine; a hang fails here, not at CI's limit.
pub const WITHIN: Duration = Duration::from_secs(300);

/// Whether `mpirun` runs here; says so when it does not (the tests then skip).
pub fn available() -> bool {
    let ok = Command::new("mpirun").arg("--version").output().is_ok();
    if !ok {
        eprintln!("no mpirun; skipped");
    }
    ok
}

/// Runs this binary's test `test` on `np` ranks under `launcher` (a command line and its leading
/// arguments, split at spaces; `mpirun` when None), with `vars` set on every rank (forwarded to
/// remote ranks; None: removed), and returns the ranks' standard output. Fails the test, naming
/// `what`, when the job fails or runs past [`WITHIN`].
pub fn run(
    np: usize,
    test: &str,
    launcher: Option<&str>,
    vars: &[(&str, Option<String>)],
    what: &str,
) -> String {
    let mut words = launcher.unwrap_or("mpirun").split_whitespace();
    let mut job = Command::new(words.next().expect("a launcher"));
    job.args(words).args(["-np", &np.to_string(), "--oversubscribe"]);
    for (name, value) in vars {
        match value {
            Some(v) => job.args(["-x", name]).env(name, v),
            None => job.env_remove(name),
        };
    }
    let mut child = job
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > WITHIN {
            let _ = child.kill();
            panic!("{what}: mpirun still running after {WITHIN:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{what}: mpirun failed ({}):\n{text}", out.status);
    text
}
