"""Distributed tests' processes: ``spawn_ranks`` runs a test module's ``run_rank(rank, world,
port, out)`` in ``world`` spawned processes (each writes ``rank{r}.json`` into ``out``) with a
time limit on the whole job; ``gloo_group`` is the process group each of them joins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierstore.optim.distributed import free_port


def spawn_ranks(test_file: str, out: Path, limit_s: float, world: int = 2) -> list[dict[str, Any]]:
    """Spawn ``world`` processes running ``run_rank`` of the module at ``test_file`` and return
    each rank's JSON result; fail with the job's stderr if it fails or outlives ``limit_s``."""
    module = Path(test_file)
    script = (
        f"import sys, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); import {module.stem} as j; "
        f"mp.spawn(j.run_rank, args=({world}, int(sys.argv[2]), sys.argv[3]), nprocs={world}, join=True)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(module.parent), str(free_port()), str(out)],
        capture_output=True, text=True, timeout=limit_s,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@contextmanager
def gloo_group(rank: int, world: int, port: int, timeout_s: float | None = None) -> Iterator[None]:
    """Join this spawned rank to a gloo process group on ``127.0.0.1:port`` (torch on one
    thread: the ranks share the machine's cores), and leave it at the end."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", rank=rank, world_size=world, **timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()
