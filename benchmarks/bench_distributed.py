"""1 rank against 2 ranks sharing one disk: state bytes per tier, step time, disk bytes and
throughput per rank, DCP save/load (standard and streaming: time and RSS growth) against torch's
AdamW (see tierstore/bench/distributed.py).

Reproduce:  python benchmarks/bench_distributed.py [--quick] [--width W --depth D --steps K] [--buffer-bytes B]
            [--mmap-threshold N] [--dir DIR]
"""

import sys

from tierstore.bench.distributed import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
