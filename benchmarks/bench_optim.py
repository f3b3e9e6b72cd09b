"""Host update throughput and paged training steps vs torch.optim.AdamW (see tierstore/bench/optim.py).

Reproduce:  python benchmarks/bench_optim.py [--quick] [--json FILE] [--dir FOLDER]
            python benchmarks/bench_optim.py --parts f [--f-steps 1000] [--f-long-steps 3000]
                (compressed state, tierstore/bench/precision.py: bench_optim_f.json, convergence.png)
            python benchmarks/bench_optim.py --parts g --dir FOLDER
                (disk-bound step per state_precision, tierstore/bench/compressed_step.py: bench_optim_g.json)
"""

import sys

from tierstore.bench.optim import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
