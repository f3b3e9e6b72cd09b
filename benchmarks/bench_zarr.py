"""zarr arrays 4x the host tier read in epochs through TierZarrStore (LRU, S3-FIFO, learned
schedule + MIN) against a plain zarr LocalStore (see tierstore/bench/zarr.py).

Reproduce:  python benchmarks/bench_zarr.py [--quick] [--host-mib N] [--epochs N] [--json FILE]
"""

import sys

from tierstore.bench.zarr import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
