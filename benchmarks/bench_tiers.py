"""Tier and link throughput vs a raw pread/pwrite baseline, and DeepSpeed's AIO op where it is
installed (same as `tierstore bench`; `--help` says how to add DeepSpeed); `--tune DIR` measures
and saves the disk tier's I/O settings for DIR's device.

Reproduce:  python benchmarks/bench_tiers.py [--quick] [--dir FOLDER] [--json FILE]
            python benchmarks/bench_tiers.py --disk-only --sizes-mib 4,16,64 --reps 7 --volume-mib 192
            python benchmarks/bench_tiers.py --tune FOLDER --json benchmarks/results/bench_tune.json
"""

import sys

from tierstore.bench.tiers import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
