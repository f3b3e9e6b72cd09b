"""Activation and parameter offload vs none, save_on_cpu and resident (see tierstore/bench/swap.py).

Reproduce:  python benchmarks/bench_swap.py [--quick] [--json FILE] [--dir FOLDER]
"""

import sys

from tierstore.bench.swap import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
