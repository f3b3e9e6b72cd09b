"""A researcher's policy in 30 lines, compared with SIEVE and LRU (and, if installed, with
libCacheSim's LHD and its own SIEVE) on one trace: miss-ratio curves in one plot.

Run:  python examples/policy_workbench.py [TRACE] [--plot FILE]
TRACE: a key,size CSV, a libCacheSim oracleGeneral file, or e.g. zipf:keys=20000,accesses=300000,alpha=0.9
"""

import argparse
from collections import OrderedDict
from pathlib import Path

from tierstore.sim import simulate
from tierstore.sim.external import available
from tierstore.sim.links import LinkModel
from tierstore.sim.report import format_table, open_trace, plot_curves, run_all


class ProbationLRU:
    """New keys wait in a small FIFO (10% of the bytes); only a key hit there joins the LRU main
    part, so one-hit wonders leave quickly (quick demotion, as in S3-FIFO and SIEVE)."""

    name = "probation-lru"

    def __init__(self):
        self.capacity = None
        self.reset()

    def set_capacity(self, nbytes):
        self.capacity = nbytes

    def reset(self):  # forgets the keys, keeps the capacity
        self.probation, self.main, self.probation_bytes = OrderedDict(), OrderedDict(), 0

    def on_insert(self, key, nbytes):
        self.on_remove(key)
        self.probation[key] = nbytes
        self.probation_bytes += nbytes

    def on_hit(self, key):
        if key in self.probation:
            self.probation_bytes -= self.probation[key]
            self.main[key] = self.probation.pop(key)
        elif key in self.main:
            self.main.move_to_end(key)

    def on_remove(self, key):
        if key in self.probation:
            self.probation_bytes -= self.probation.pop(key)
        self.main.pop(key, None)

    def victim(self, evictable=None):
        first = self.probation if self.probation_bytes > 0.1 * (self.capacity or 0) or not self.main else self.main
        for queue in (first, self.main if first is self.probation else self.probation):
            key = next((k for k in queue if evictable is None or evictable(k)), None)
            if key is not None:
                self.on_remove(key)
                return key
        return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="?", default="zipf:keys=20000,accesses=300000,alpha=0.9")
    parser.add_argument("--plot", default="examples/policy_workbench.png")
    args = parser.parse_args(argv)
    trace = open_trace(args.trace)
    capacities = {"host": trace.working_set // 10}
    ours = run_all(trace, capacities, ["lru", "sieve"], ["none"], LinkModel(), sweep=True)
    mine = [simulate(trace, {"host": size}, ProbationLRU) for size in sorted({r.capacity for r in ours})]
    theirs = run_all(trace, capacities, ["lhd", "sieve"], ["none"], LinkModel(), sweep=True, engines=("libcachesim",)) if available() else []
    results = mine + ours + theirs
    print(format_table([r for r in results if r.capacity == round(0.1 * trace.working_set)], trace))  # at 10%
    plot_curves(results, trace, Path(args.plot))
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
