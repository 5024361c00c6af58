//! With feature `mpi`, compiles src/comm/mpi_shim.c: MPI_IN_PLACE is a cast macro whose value
//! differs between MPI implementations, so only a C compiler can hand it to Rust. (The C
//! library's SONAME is set by capi/cdylib/build.rs.)

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "mpi")]
    mpi_shim();
}

#[cfg(feature = "mpi")]
fn mpi_shim() {
    println!("cargo:rerun-if-changed=src/comm/mpi_shim.c");
    let lib = build_probe_mpi::probe()
        .unwrap_or_else(|errs| panic!("feature `mpi`: no MPI library found: {errs:?}"));
    let mut build = cc::Build::new();
    build.file("src/comm/mpi_shim.c");
    match lib.mpicc {
        Some(mpicc) => {
            build.compiler(mpicc);
        }
        None => {
            for dir in &lib.include_paths {
                build.include(dir);
            }
        }
    }
    build.compile("gradacc_mpi_shim");
}
