# Communicators from MPI.jl's MPI.Comm.
module GradAccMPIExt

using GradAcc: GradAcc
using MPI: MPI

# gradacc takes the Fortran handle of the communicator. MPI.jl's `comm.val` is the C handle
# (MPI_Comm: a pointer under Open MPI, an integer under MPICH), so it is converted with
# MPI_Comm_c2f. MPI.API defines MPI_Comm_c2f(::MPI_Comm) as the plain conversion; its generic
# method (given the MPI.Comm itself) would treat the returned handle as an error code, hence
# `comm.val`. The MPI.Comm is preserved until gradacc has duplicated it (its finalizer would
# free the handle).
function GradAcc.mpi_communicator(comm::MPI.Comm; kw...)
    c = GC.@preserve comm GradAcc.mpi_communicator(Int64(MPI.API.MPI_Comm_c2f(comm.val)); kw...)
    return c
end

end # module
