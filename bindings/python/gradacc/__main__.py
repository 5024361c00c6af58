"""`python -m gradacc` prints the version, the library loaded, the backends available and the CUDA,
NVRTC, NCCL and MPI libraries found (or why not): what a bug report needs."""
import sys

from ._diagnose import main

sys.exit(main())
