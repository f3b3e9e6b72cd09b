"""Record libCacheSim's misses on the small shared traces of tests/test_policies_workbench.py.

Run once (needs ``pip install 'tierstore[libcachesim]'``):  python tests/data/make_libcachesim_results.py
It writes tests/data/libcachesim_results.json, which the tests read when libCacheSim is absent.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tierstore.sim import Trace, loop_trace, save_oracle_general, zipf_trace  # noqa: E402

#: Our policy names and libCacheSim's class names.
POLICIES = {"lru": "LRU", "fifo": "FIFO", "sieve": "Sieve", "clock": "Clock", "slru": "SLRU", "2q": "TwoQ",
            "lirs": "LIRS", "tinylfu": "WTinyLFU", "s3fifo": "S3FIFO", "arc": "ARC"}
FRACTIONS = (0.05, 0.1, 0.3)


def shared_traces() -> dict[str, Trace]:
    """The traces both simulators replay (deterministic)."""
    uniform = zipf_trace(keys=1000, accesses=30_000, alpha=0.9, size=4096, seed=7)
    sized = zipf_trace(keys=1000, accesses=30_000, alpha=0.8, size=1, seed=8)
    sized.sizes = (1024 * (1 + (sized.ids * 7919) % 32)).astype(np.int64)  # 1-32 KiB, one size per key
    loop = loop_trace(keys=300, loops=20, size=4096)
    return {"zipf_uniform": uniform, "zipf_sized": sized, "loop": loop}


def fingerprint(trace: Trace) -> int:
    """A checksum of the accesses, so a changed generator is noticed rather than misread."""
    n = np.arange(len(trace), dtype=np.int64)
    return int(((trace.ids + 1) * (n % 9973 + 1) + trace.sizes).sum())


def main() -> int:
    import libcachesim as lcs

    records = {"libcachesim": lcs.__version__, "fractions": list(FRACTIONS), "traces": {}}
    with tempfile.TemporaryDirectory() as folder:
        for name, trace in shared_traces().items():
            path = save_oracle_general(trace, Path(folder) / f"{name}.oracleGeneral.bin")
            rows = {}
            for fraction in FRACTIONS:
                capacity = int(fraction * trace.working_set)
                for ours, theirs in POLICIES.items():
                    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
                    miss_ratio, _ = getattr(lcs, theirs)(capacity).process_trace(reader)
                    rows[f"{ours}@{capacity}"] = round(miss_ratio * len(trace))
            records["traces"][name] = {"requests": len(trace), "fingerprint": fingerprint(trace), "misses": rows}
    out = Path(__file__).with_name("libcachesim_results.json")
    out.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
