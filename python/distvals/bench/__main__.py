"""``python -m distvals.bench``: see ``python -m distvals.bench --help``."""

import sys

from .cli import main

if __name__ == "__main__":
    if "--mpi" in sys.argv[1:]:  # under mpirun: the multi-worker all-reduce against mpi4py
        from .mpi import main as mpi_main

        sys.exit(mpi_main([a for a in sys.argv[1:] if a != "--mpi"]))
    sys.exit(main())
