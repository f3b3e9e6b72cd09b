"""Steps/s of transformers' Trainer with TieredAdamW (state in host, on disk) against
optim="adamw_torch_fused", same model, same run (see tierstore/bench/trainer.py).
Needs: pip install -e '.[hf]'

Reproduce:  python benchmarks/bench_trainer.py [--quick] [--json FILE] [--dir FOLDER]
"""

import sys

from tierstore.bench.trainer import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
