# Communicators from MPI.jl's MPI.Comm.
module GradAccMPIExt

using GradAcc: GradAcc
using MPI: MPI

# gradacc takes the Fortran handle of the communicator. MPI.jl's `comm.val` is the C handle
# (MPI_Comm, a pointer under Open MPI), so it is converted with MPI_Comm_c2f, which MPI.jl's raw
# API exposes; the MPI.Comm itself is passed so that it stays alive through the call.
function GradAcc.mpi_communicator(comm::MPI.Comm; kw...)
    return GradAcc.mpi_communicator(Int64(MPI.API.MPI_Comm_c2f(comm)); kw...)
end

end # module
