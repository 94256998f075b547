"""One rank of the benchmark's MPI side: ``mpirun ... python -m aiodist.bench._mpi_rank``
(started by ``aiodist.bench.collectives.MpiSide``, never by hand)."""

from __future__ import annotations

import sys

from aiodist.bench.collectives import mpi_rank_main

if __name__ == "__main__":
    sys.exit(mpi_rank_main())
