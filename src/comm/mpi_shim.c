/* MPI_IN_PLACE is a macro ((void *)1 in Open MPI, (void *)-1 in MPICH): the MPI communicator asks
 * the C compiler for the value of the MPI it is built against. Not exported from the library. */
#include <mpi.h>

void *gradacc_internal_mpi_in_place(void)
{
    return MPI_IN_PLACE;
}
