"""Simulator speed and learned-prefetch effectiveness (see tierstore/bench/policies.py).

Reproduce:  python benchmarks/bench_policies.py [--quick] [--json FILE] [--plot FILE]
"""

import sys

from tierstore.bench.policies import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
