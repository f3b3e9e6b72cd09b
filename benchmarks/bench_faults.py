"""Long variants of the reliability tests, with a table (see tierstore/bench/faults.py).

Reproduce:  python benchmarks/bench_faults.py [--quick] [--kills N] [--corruptions N] [--examples N] [--power-cuts N]
            [--power-cuts N]
"""

import sys

from tierstore.bench.faults import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
