"""Millions of keys: small values against raw LMDB, memory per key, flush, reopen, hit latency
(see tierstore/bench/keys.py).

Reproduce:  python benchmarks/bench_keys.py [--quick] [--only threshold|rates|scale|hits] [--keys N ...] [--dir DIR]
"""

import sys

from tierstore.bench.keys import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
