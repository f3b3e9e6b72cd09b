"""Write an eviction policy, compare it with the built-ins in the simulator, use it in a store.

Run:  python examples/custom_policy.py
"""

from collections import OrderedDict

import torch

from tierstore import HostTier, SyncTierStore, TierStore  # noqa: F401  (TierStore for the async API)
from tierstore.sim import simulate, zipf_trace


class Clock:
    """Second chance: a FIFO where a key hit since its last turn gets one more round.

    ``victim(evictable)`` only takes keys the store lets go (copies in use or held are not);
    a key it may not take keeps its place and its reference bit."""

    name = "clock"

    def __init__(self) -> None:
        self.queue: OrderedDict[str, bool] = OrderedDict()  # key -> referenced

    def on_insert(self, key, nbytes):
        self.queue[key] = False

    def on_hit(self, key):
        if key in self.queue:
            self.queue[key] = True

    def on_remove(self, key):
        self.queue.pop(key, None)

    def victim(self, evictable=None):
        skipped, chosen = [], None
        for _ in range(2 * len(self.queue)):  # two sweeps: the first clears every bit
            if not self.queue:
                break
            key, referenced = self.queue.popitem(last=False)
            if evictable is not None and not evictable(key):
                skipped.append((key, referenced))  # in use: it keeps its place and its bit
            elif referenced:
                self.queue[key] = False  # second chance: back of the queue
            else:
                chosen = key
                break
        for key, referenced in reversed(skipped):
            self.queue[key] = referenced
            self.queue.move_to_end(key, last=False)
        return chosen

    def reset(self):
        self.queue.clear()


if __name__ == "__main__":
    # 1. Simulate: the same trace and capacity for Clock and the built-ins.
    trace = zipf_trace(keys=5000, accesses=200_000, alpha=0.8, size=4096, seed=0)
    capacity = trace.working_set // 10
    for eviction in (Clock, "lru", "fifo", "arc", "s3fifo", "min"):
        result = simulate(trace, {"host": capacity}, eviction=eviction)
        print(f"{result.eviction:>7}: miss ratio {result.miss_ratio:.4f}")

    # 2. Use it in a live store: one instance per tier, so pass the class.
    with SyncTierStore([HostTier("64KiB"), HostTier("1MiB", name="spill")], eviction=Clock) as store:
        for i in range(40):
            store.put(f"k{i}", torch.full((1024,), float(i)))
        print("resident on the first tier:", [k for k in store.keys() if store.info(k)["tiers"][0] == "host"])
