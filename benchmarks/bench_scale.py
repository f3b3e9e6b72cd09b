"""GPT-2 124M with its optimizer state on disk against torch's AdamW in memory (see tierstore/bench/scale.py).

Reproduce:  python benchmarks/bench_scale.py [--quick] [--steps N] [--json FILE] [--dir FOLDER]
"""

import sys

from tierstore.bench.scale import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
