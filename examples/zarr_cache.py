"""A zarr array larger than the memory tiers, read in epochs through the tiers.

A data loader reads the same array every epoch, in the same (shuffled once) order of batches.
Through ``TierZarrStore`` its chunks are cached on the host tier, evicted by Belady's MIN over
the order the ``ScheduleLearned`` policy learned in the first epoch (``mark_step()`` at the end of
each), and prefetched along that order; the rest stays on the disk tier. The same array is also
read from a plain ``zarr.storage.LocalStore`` in the same run, for comparison.

Run:  python examples/zarr_cache.py [--host-mib 32]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr

from policies import MIN, ScheduleLearned
from tierstore import DiskTier, HostTier, SyncTierStore
from tierstore.zarr import TierZarrStore


def read_epoch(array: zarr.Array, order: list[int], batch: int) -> float:
    """Read every batch in ``order``; return the seconds it took."""
    started = time.perf_counter()
    for start in order:
        array[start : start + batch]
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host-mib", type=int, default=32, help="host tier size; the array is 3x this")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    rows, columns, batch = 3 * args.host_mib * 1024, 256, 2048  # a row is 1 KiB of float32
    data = np.random.default_rng(0).standard_normal((rows, columns), dtype=np.float32)
    order = list(np.random.default_rng(1).permutation(np.arange(0, rows, batch)))

    with tempfile.TemporaryDirectory() as folder:
        local = zarr.create_array(zarr.storage.LocalStore(Path(folder) / "plain.zarr"), shape=data.shape, chunks=(1024, columns), dtype="f4")
        local[:] = data

        schedule = ScheduleLearned()
        tiers = [HostTier(f"{args.host_mib}MiB"), DiskTier(Path(folder) / "tiers", "1GiB")]
        with SyncTierStore(tiers, eviction=lambda: MIN(schedule.next_use), prefetch=schedule) as store:
            zstore = TierZarrStore(store, prefix="zarr/")
            array = zarr.create_array(zstore, name="train", shape=data.shape, chunks=(1024, columns), dtype="f4")
            array[:] = data
            store.flush()
            print(f"array {data.nbytes >> 20} MiB, host tier {args.host_mib} MiB, {len(order)} batches an epoch")
            print("epoch  hit rate  tiers s  LocalStore s")
            for epoch in range(1, args.epochs + 1):
                before = store.stats()["tiers"]["host"]
                tiered = read_epoch(array, order, batch)
                zstore.mark_step()  # the schedule learns the epoch's order
                after = store.stats()["tiers"]["host"]
                hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
                plain = read_epoch(local, order, batch)
                print(f"{epoch:5d}  {hits / max(1, hits + misses):8.1%}  {tiered:7.2f}  {plain:12.2f}")
            np.testing.assert_array_equal(array[:batch], data[:batch])


if __name__ == "__main__":
    main()
