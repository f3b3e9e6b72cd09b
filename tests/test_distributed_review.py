"""Sharded TieredAdamW (gloo, 2 processes) at the edges a review found: a NaN gradient norm
across ranks, frozen parameters (ownership balance, ``opt.state[p]``), each against DDP +
``torch.optim.AdamW(fused=True)`` or torch's own behaviour. The ranks run ``run_rank`` below."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from spawned import gloo_group, spawn_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

LIMIT_S = 60  # the whole spawned job


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x.detach(), y.detach()) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def nan_norm(rank: int) -> dict[str, Any]:
    """One rank's batch holds a NaN: clip_grad_norm_ returns NaN and the update spreads it."""
    from tierstore.optim import TieredAdamW

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    ref, ours = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = TieredAdamW(ours.parameters(), lr=1e-2, fused=True, min_offload_numel=4, process_group=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        x[0, 0] = float("nan")
    ref(x).sum().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    ours(x).sum().backward()
    norm = opt.clip_grad_norm_(1.0)
    opt.step()
    same_nans = all(torch.equal(p.isnan(), q.isnan()) for p, q in zip(ours.parameters(), ref.parameters(), strict=True))
    opt.close()
    return {"ref_norm": str(float(ref_norm)), "norm": str(float(norm)), "same_nans": same_nans}


def frozen(rank: int) -> dict[str, Any]:
    """A frozen layer larger than the trainable ones: state split evenly, ``opt.state`` as torch's."""
    from tierstore.optim import TieredAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 16), torch.nn.Linear(16, 16))
    model[0].requires_grad_(False)
    ref, ours = DDP(copy.deepcopy(model)), DDP(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = TieredAdamW(ours.parameters(), lr=1e-2, fused=True, min_offload_numel=4, process_group=True)
    frozen_state = [opt.state[p] for p in ours.module[0].parameters()]
    data = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(rank))
    for step in range(2):
        for m, o in ((ref, ref_opt), (ours, opt)):
            o.zero_grad()
            m(data[step]).pow(2).mean().backward()
            o.step()
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    # elements whose state this rank holds (a split parameter's state is a DTensor of its rows)
    owned = sum(local(opt.state[p]["exp_avg"]).numel() for p in ours.parameters() if "exp_avg" in opt.state[p])
    result = {"owned": owned, "frozen_state": frozen_state == [{}, {}], "equal": _equal(ours, ref)}
    opt.close()
    return result


def generic(rank: int) -> dict[str, Any]:
    """TieredOptimizer(process_group=) around torch's SGD (momentum) and Adagrad: an embedding
    holding most of the elements has its rows split across the ranks; bit for bit against DDP
    + the same torch optimizer, ``opt.state`` as torch's; a non-elementwise optimizer refused."""
    from tierstore.device import emulate_device
    from tierstore.optim import TieredOptimizer

    result: dict[str, Any] = {}
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Embedding(400, 8), torch.nn.Linear(8, 4))
    data = torch.randint(0, 400, (3, 8), generator=torch.Generator().manual_seed(rank))
    for mode in ("plain", "emulated"):
        with emulate_device(mode == "emulated"):
            for cls, options in ((torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}), (torch.optim.Adagrad, {"lr": 0.1})):
                ref, ours = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
                ref_opt = cls(ref.parameters(), **options)
                opt = TieredOptimizer(ours.parameters(), cls, min_offload_numel=4, process_group=True, chunk_bytes=4096, **options)
                for step in range(3):
                    for m, o in ((ref, ref_opt), (ours, opt)):
                        o.zero_grad()
                        m(data[step]).pow(2).mean().backward()
                        o.step()
                name = next(k for k in ref_opt.state[ref.module[0].weight] if k != "step")  # momentum_buffer / sum
                mine = opt.state[ours.module[0].weight][name]
                result[f"{mode}_{cls.__name__}"] = {
                    "equal": _equal(ours, ref),
                    "split": type(mine).__name__ == "DTensor",
                    "state_equal": torch.equal(mine.full_tensor(), ref_opt.state[ref.module[0].weight][name]),
                }
                opt.close()
    try:
        TieredOptimizer(base.parameters(), torch.optim.Adafactor, process_group=True)  # (factored: not elementwise)
        result["refused"] = ""
    except ValueError as exc:
        result["refused"] = str(exc)
    return result


def hsdp(rank: int) -> dict[str, Any]:
    """FSDP2 on a 2-D mesh (HSDP: replicate x shard), as (2, 1) and (1, 2): clipping by the
    global norm (``max_grad_norm=`` and ``opt.clip_grad_norm_``) reduces over the shard dimension
    only, as torch's ``clip_grad_norm_`` on the DTensor gradients does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tierstore.optim import TieredAdamW

    result: dict[str, Any] = {}
    data = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(rank))
    for shape in ((2, 1), (1, 2)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))

        def model(mesh: Any) -> torch.nn.Module:
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
            return fully_shard(net, mesh=mesh)

        ref, ours, user = model(mesh), model(mesh), model(mesh)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        opts = {
            "max": TieredAdamW(ours.parameters(), lr=1e-2, fused=True, min_offload_numel=4, max_grad_norm=0.05),
            "opt": TieredAdamW(user.parameters(), lr=1e-2, fused=True, min_offload_numel=4),
        }
        norms = []
        for step in range(3):
            for m, o in ((ref, ref_opt), (ours, opts["max"]), (user, opts["opt"])):
                o.zero_grad()
                m(data[step]).pow(2).mean().backward()
                if o is ref_opt:
                    norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05).full_tensor()))
                elif o is opts["opt"]:
                    norms.append(float(o.clip_grad_norm_(0.05)))
                o.step()
        worst = 0.0
        for m in (ours, user):
            for x, y in zip(m.parameters(), ref.parameters(), strict=True):
                worst = max(worst, float((x.full_tensor() - y.full_tensor()).abs().max() / y.full_tensor().abs().max()))
        result[str(shape)] = {"error": worst, "norms": norms}
        for o in opts.values():
            o.close()
    return result


def fsdp_too_large(rank: int, out: str) -> str:
    """An FSDP2 parameter whose local shard's state exceeds the host tier: its shard is not paged
    in chunks, and the error said to set ``chunk_bytes`` (set or not). What it says now."""
    from torch.distributed.fsdp import fully_shard

    from tierstore.optim import TieredAdamW
    from tierstore.optim.pipeline import OptimizerCapacityError

    torch.manual_seed(0)
    net = fully_shard(torch.nn.Sequential(torch.nn.Embedding(1024, 64)))
    try:
        TieredAdamW(net.parameters(), offload="disk", disk_root=Path(out, f"too-large-{rank}"), host_capacity="256KiB", chunk_bytes="64KiB")
    except OptimizerCapacityError as exc:
        return str(exc)
    return ""


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    with gloo_group(rank, world, port, LIMIT_S):
        result = {"nan_norm": nan_norm(rank), "frozen": frozen(rank), "generic": generic(rank), "hsdp": hsdp(rank),
                  "fsdp_too_large": fsdp_too_large(rank, out)}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))



def test_sharded_edges(tmp_path: Path) -> None:
    ranks = spawn_ranks(__file__, tmp_path, LIMIT_S)
    for r in ranks:
        assert "shard it over more ranks" in r["fsdp_too_large"] and "chunk_bytes" not in r["fsdp_too_large"], r["fsdp_too_large"]
        # the NaN reaches every rank's norm (a MAX against a sentinel dropped it) and the weights
        assert r["nan_norm"]["ref_norm"] == r["nan_norm"]["norm"] == "nan" and r["nan_norm"]["same_nans"], r
        assert r["frozen"]["frozen_state"] and r["frozen"]["equal"], r
        for shape, h in r["hsdp"].items():  # clipped as torch clips DTensor gradients: fp32 rounding apart
            ref_norms, opt_norms = h["norms"][0::2], h["norms"][1::2]
            assert h["error"] <= 1e-6 and all(abs(a - b) <= 1e-6 * a for a, b in zip(ref_norms, opt_norms, strict=True)), (shape, h)
        refused = r["generic"].pop("refused")
        assert "elementwise" in refused, refused
        assert all(g["equal"] and g["split"] and g["state_equal"] for g in r["generic"].values()), r["generic"]
    # the trainable parameters (1024, 256, 16, 16 elements) are balanced by their own sizes, not
    # the frozen layer's (which left one rank owning no state at all): the 16 x 64 weight, more
    # than half of them, has 8 rows on each rank
    owned = sorted(r["frozen"]["owned"] for r in ranks)
    assert owned == [512 + 16 + 16, 512 + 256], owned
