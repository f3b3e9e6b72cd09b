"""A sharded optimizer's (``process_group=``, 2 gloo ranks) ``state_dict()`` saved by rank 0
alone and loaded on every rank, as the HF Trainer and accelerate's ``save_state`` do under DDP:
rank 1's parameters silently restarted from step 0 with zero moments (a tryout's resumed run
drifted by 1e-2, no error, no warning). Now the dict names the rank it came from and the
parameters it holds whole: loading it where other parameters are updated raises before anything
changes, saving it warns once, and each rank's own dict still loads on that rank."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from spawned import gloo_group, spawn_ranks

LIMIT_S = 240


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    with gloo_group(rank, world, port, timeout_s=60):
        Path(out, f"rank{rank}.json").write_text(json.dumps(_round_trips(rank, Path(out))))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _steps(model: torch.nn.Module, opt: Any, rank: int, count: int) -> None:
    for step in range(count):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        for p in model.parameters():  # (the average DDP would write)
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()


def _round_trips(rank: int, out: Path) -> dict[str, Any]:
    from tierstore.optim import TieredAdamW

    result: dict[str, Any] = {}
    model = _model()
    opt = TieredAdamW(model.parameters(), lr=1e-2, process_group=True)
    _steps(model, opt, rank, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = opt.state_dict()
        opt.state_dict()
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    torch.save(saved, out / f"optim{rank}.pt")
    opt.close()
    dist.barrier()

    fresh = _model()
    again = TieredAdamW(fresh.parameters(), lr=1e-2, process_group=True)
    try:
        again.load_state_dict(torch.load(out / "optim0.pt", weights_only=True))  # rank 0's file, on every rank
        result["rank0_file"] = "loaded"
    except ValueError as error:
        result["rank0_file"] = str(error)
    untouched = again.state_dict()["state"]
    result["untouched"] = all(not entry or float(entry["step"]) == 0.0 for entry in untouched.values())
    again.load_state_dict(torch.load(out / f"optim{rank}.pt", weights_only=True))  # each rank's own
    result["own_steps"] = sorted({float(entry["step"]) for entry in again.state_dict()["state"].values() if entry})
    # each rank's own dict through DCP: the record has one key on every rank, and one rank's comes back to all
    import torch.distributed.checkpoint as dcp

    dcp.save({"optim": again.state_dict()}, checkpoint_id=out / "dcp")
    template = {"optim": again.state_dict()}
    dcp.load(template, checkpoint_id=out / "dcp")
    again.load_state_dict(template["optim"])
    result["dcp_steps"] = sorted({float(entry["step"]) for entry in again.state_dict()["state"].values() if entry})
    again.close()

    if rank == 0:  # one process, no process group: a rank's dict lacks the other's parameters
        single = TieredAdamW(_model().parameters(), lr=1e-2)
        try:
            single.load_state_dict(torch.load(out / "optim0.pt", weights_only=True))
            result["single"] = "loaded"
        except ValueError as error:
            result["single"] = str(error)
        single.close()
        merged = torch.load(out / "optim0.pt", weights_only=True)  # both ranks' entries in one dict (a consolidation)
        other = torch.load(out / "optim1.pt", weights_only=True)
        merged["state"].update({index: entry for index, entry in other["state"].items() if entry})
        whole = TieredAdamW(_model().parameters(), lr=1e-2)
        whole.load_state_dict(merged)
        result["merged_steps"] = sorted({float(entry["step"]) for entry in whole.state_dict()["state"].values()})
        whole.close()
        reference = torch.optim.AdamW(_model().parameters(), lr=1e-2)
        reference.load_state_dict(torch.load(out / "optim0.pt", weights_only=True))  # (torch ignores the rank's record)
        result["torch_loads"] = True
    return result


def test_one_ranks_state_dict_loaded_on_another_rank_is_refused(tmp_path: Path) -> None:
    ranks = spawn_ranks(__file__, tmp_path, LIMIT_S)
    for result in ranks:
        assert len(result["warnings"]) == 1 and "holds this rank's state only" in result["warnings"][0], result
        assert result["own_steps"] == [2.0] and result["dcp_steps"] == [2.0], result
    assert ranks[0]["rank0_file"] == "loaded"  # its own
    said = ranks[1]["rank0_file"]
    assert said.startswith("this state dict is rank 0's of 2 under process_group=") and "Nothing was loaded" in said, said
    assert "which rank 1 of 2 updates" in said and "save_optimizer" in said
    assert ranks[1]["untouched"]
    assert "which this optimizer (no process_group=) updates" in ranks[0]["single"], ranks[0]["single"]
    assert ranks[0]["torch_loads"]
    assert ranks[0]["merged_steps"] == [2.0]  # (a complete dict loads, its record notwithstanding)
