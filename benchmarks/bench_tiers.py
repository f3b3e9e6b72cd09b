"""Tier and link throughput vs a raw pread/pwrite baseline (same as `tierstore bench`).

Reproduce:  python benchmarks/bench_tiers.py [--quick] [--dir FOLDER] [--json FILE]
"""

import sys

from tierstore.bench.tiers import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
