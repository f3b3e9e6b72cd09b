"""Host update throughput and paged training steps vs torch.optim.AdamW (see tierstore/bench/optim.py).

Reproduce:  python benchmarks/bench_optim.py [--quick] [--json FILE] [--dir FOLDER]
"""

import sys

from tierstore.bench.optim import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
