"""DDP with gloo, three processes (a world size that is not a power of two, where averaging by a
division and by DDP's multiplication by 1/world round differently): TieredAdamW with ``attach_ddp`` (gradients taken after their
all-reduce, in the communication hook) and without it (DDP's averaging seen at ``step()`` by the
version check) against torch's fused AdamW, bit for bit, in both device modes."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierstore.optim.distributed import free_port

pytestmark = pytest.mark.device_modes

STEPS = 4


def _worker(rank: int, world: int, port: int, mode: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tierstore.device import emulate_device
    from tierstore.optim import TieredAdamW, attach_ddp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with emulate_device(mode == "emulated"):
            torch.manual_seed(0)
            base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
            # small buckets: several all-reduces per backward, so copies start while it runs
            models = {name: DDP(copy.deepcopy(base), bucket_cap_mb=0.001) for name in ("torch", "attached", "plain")}
            opts = {
                "torch": torch.optim.AdamW(models["torch"].parameters(), lr=1e-2, fused=True),
                "attached": TieredAdamW(models["attached"].parameters(), lr=1e-2, fused=True, min_offload_numel=64),
                "plain": TieredAdamW(models["plain"].parameters(), lr=1e-2, fused=True, min_offload_numel=64),
            }
            attach_ddp(opts["attached"], models["attached"])
            result: dict[str, object] = {"rank": rank, "retakes": {}, "hook_error": ""}
            other = DDP(copy.deepcopy(base))
            other.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
            try:
                attach_ddp(opts["plain"], other)
            except ValueError as exc:
                result["hook_error"] = str(exc)
            data = torch.randn(STEPS, 4, 16, generator=torch.Generator().manual_seed(rank))  # each rank its own
            retakes = {name: 0 for name in ("attached", "plain")}
            for step in range(STEPS):
                for name, model in models.items():
                    opt = opts[name]
                    opt.zero_grad()
                    model(data[step]).pow(2).mean().backward()
                    opt.step()
                    if name in retakes:
                        retakes[name] += opt.time_report().grad_retakes  # type: ignore[union-attr]
            reference = list(models["torch"].parameters())
            for name in ("attached", "plain"):
                result[f"{name}_equal"] = all(torch.equal(a, b) for a, b in zip(models[name].parameters(), reference, strict=True))
            result["retakes"] = retakes
            result["params"] = len(reference)
            for name in ("attached", "plain"):
                opts[name].close()  # type: ignore[union-attr]
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()



def test_ddp_bit_for_bit_with_and_without_attach(tmp_path: Path, device_mode: str) -> None:
    script = (
        "import sys, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); import test_ddp_optim as t; "
        "mp.spawn(t._worker, args=(3, int(sys.argv[2]), sys.argv[3], sys.argv[4]), nprocs=3, join=True)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(free_port()), device_mode, str(tmp_path)],
        capture_output=True, text=True, timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    for result in results:
        assert result["attached_equal"] and result["plain_equal"]
        assert "pass yours to attach_ddp" in result["hook_error"]
        # attached: every gradient was taken after its all-reduce, never again at step()
        assert result["retakes"]["attached"] == 0
        # not attached: DDP wrote the averages into p.grad after the hooks; on the emulated device
        # step() saw it (versions moved) and took every gradient again (lent on the plain CPU)
        assert result["retakes"]["plain"] == (STEPS * result["params"] if device_mode == "emulated" else 0)
