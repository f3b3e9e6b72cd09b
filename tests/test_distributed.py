"""TieredAdamW under torch.distributed with gloo: DDP, sharded state (ZeRO-1 with 2 and 3 ranks,
ZeRO-2), FSDP2, clipping and accumulation under each, and DCP checkpoints (save, load, continue;
to and from torch's AdamW; resharded 2 -> 1 and 2 -> 3), against DDP/FSDP2 with
``torch.optim.AdamW(fused=True)``, in both device modes. The ranks run ``run_rank`` below,
in processes the tests spawn."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from spawned import gloo_group
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from tierstore.optim.distributed import free_port

STEPS, MORE, ACCUM, CLIP, LR = 3, 2, 2, 0.05, 1e-2


def base_model() -> torch.nn.Module:
    torch.manual_seed(0)  # uneven sizes: 680, 984 and 125 elements
    return torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def batches(rank: int, steps: int, seed: int) -> torch.Tensor:
    return torch.randn(steps, ACCUM, 4, 16, generator=torch.Generator().manual_seed(1000 * seed + rank))


def train(model: torch.nn.Module, opt: Any, data: torch.Tensor, clip: str) -> None:
    """``ACCUM`` micro-batches a step (DDP syncs the last); clipping to ``CLIP`` by ``clip``:
    "user" (torch's clip_grad_norm_), "opt" (opt.clip_grad_norm_) or "max" (max_grad_norm=)."""
    for step in range(data.shape[0]):
        opt.zero_grad()
        for micro in range(ACCUM):
            quiet = isinstance(model, DDP) and micro < ACCUM - 1
            with model.no_sync() if quiet else nullcontext():
                model(data[step, micro]).pow(2).mean().backward()
        if clip == "user":
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        elif clip == "opt":
            opt.clip_grad_norm_(CLIP)
        opt.step()


def whole(t: torch.Tensor) -> torch.Tensor:
    """A state tensor as torch's AdamW holds it (a split parameter's state is a DTensor)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t.detach()  # type: ignore[no-any-return]


def rel_error(a: torch.nn.Module, b: torch.nn.Module) -> float:
    worst = 0.0
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        x, y = local(x), local(y)
        worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)))
    return worst


def equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(local(x), local(y)) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def fsdp(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def save(path: Path, model: torch.nn.Module, opt: Any) -> None:
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(path))


def load(path: Path, model: torch.nn.Module, opt: Any) -> None:
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])


def run_rank(rank: int, world: int, port: int, mode: str, out: str, job: str) -> None:
    from tierstore.device import emulate_device

    with gloo_group(rank, world, port), emulate_device(mode == "emulated"):
        result = (train_and_save if job == "train" else reshard)(rank, world, Path(out))
        Path(out, f"{job}{world}-rank{rank}.json").write_text(json.dumps(result))


def _tiered(params: Any, root: Path, **options: Any) -> Any:
    from tierstore.optim import TieredAdamW

    return TieredAdamW(params, lr=LR, fused=True, min_offload_numel=64, **options)


def train_and_save(rank: int, world: int, out: Path) -> dict[str, Any]:
    from tierstore.optim.distributed import rank_summary

    result: dict[str, Any] = {}
    data, more = batches(rank, STEPS, 1), batches(rank, MORE, 2)
    root = out / "disk"

    def ddp() -> torch.nn.Module:
        return DDP(base_model(), bucket_cap_mb=0.001)

    # -- DDP, sharded (ZeRO-1 and 2), against DDP + fused AdamW with torch's clipping ----------
    reference = ddp()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, fused=True)
    train(reference, ref_opt, data, "user")
    runs: dict[str, tuple[torch.nn.Module, Any, str]] = {}
    model = ddp()
    runs["ddp"] = (model, _tiered(model.parameters(), root, max_grad_norm=CLIP), "max")
    model = ddp()
    runs["zero1"] = (model, _tiered(model.parameters(), root, process_group=True, offload="disk", disk_root=root), "opt")
    model = ddp()
    runs["zero1_max"] = (model, _tiered(model.parameters(), root, process_group=True, max_grad_norm=CLIP), "max")
    model = base_model()  # ZeRO-2: the optimizer reduces the gradients itself
    runs["zero2"] = (model, _tiered(model.parameters(), root, process_group=True, zero_stage=2, max_grad_norm=CLIP), "max")
    model = base_model()  # ZeRO-2 with torch's clip_grad_norm_: a clip by this rank's norm (warned)
    runs["zero2_user"] = (model, _tiered(model.parameters(), root, process_group=True, zero_stage=2), "user")
    for name, (model, opt, clip) in runs.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(model, opt, data, clip)
        result[f"{name}_equal"] = equal(model, reference)
        result[f"{name}_error"] = rel_error(model, reference)
        result[f"{name}_warned_local_clip"] = sum("clips by this rank's norm" in str(w.message) for w in caught)
    zero1 = runs["zero1"][1]
    result["zero1_state_bytes"] = sum(zero1.memory_report().state_by_tier.values())
    result["ddp_state_bytes"] = sum(runs["ddp"][1].memory_report().state_by_tier.values())
    result["zero1_folder"] = (root / f"rank{rank}").is_dir()
    result["summary"] = rank_summary(zero1)
    result["dominating"] = dominating(rank, world, out)
    # opt.state reads on access: what torch's AdamW holds
    result["state_equal"] = all(
        torch.equal(whole(zero1.state[p]["exp_avg"]), ref_opt.state[q]["exp_avg"]) and torch.equal(zero1.state[p]["step"], ref_opt.state[q]["step"])
        for p, q in zip(runs["zero1"][0].parameters(), reference.parameters(), strict=True)
        if zero1.state[p]
    )
    result["state_owned"] = sum(1 for p in runs["zero1"][0].parameters() if zero1.state[p])

    # -- FSDP2 against FSDP2 + fused AdamW ------------------------------------------------------
    fsdp_ref = fsdp(base_model())
    fsdp_ref_opt = torch.optim.AdamW(fsdp_ref.parameters(), lr=LR, fused=True)
    train(fsdp_ref, fsdp_ref_opt, data, "user")
    fsdp_runs = {}
    for name, clip, options in (("fsdp_user", "user", {}), ("fsdp_max", "max", {"max_grad_norm": CLIP})):
        model = fsdp(base_model())
        fsdp_runs[name] = (model, _tiered(model.parameters(), root, **options))
        train(model, fsdp_runs[name][1], data, clip)
        result[f"{name}_equal"] = equal(model, fsdp_ref)
        result[f"{name}_error"] = rel_error(model, fsdp_ref)
    fsdp_model, fsdp_opt = fsdp_runs["fsdp_user"]
    first = next(iter(fsdp_model.parameters()))
    state = fsdp_opt.state[first]["exp_avg"]
    result["fsdp_state_dtensor"] = type(state).__name__ == "DTensor" and state.placements == first.placements

    # -- DCP: save, load, continue ---------------------------------------------------------------
    fresh_model = ddp()
    fresh = _tiered(fresh_model.parameters(), root, process_group=True)
    get_optimizer_state_dict(fresh_model, fresh)  # DCP's _init_optim_state must not step
    result["init_wrote_nothing"] = len(list(fresh.namespace.keys())) == 0 and equal(fresh_model, ddp())
    fresh.close()
    save(out / "tiered", runs["zero1"][0], zero1)
    save(out / "torch", reference, ref_opt)
    save(out / "fsdp", fsdp_model, fsdp_opt)
    train(reference, ref_opt, more, "user")  # the uninterrupted runs
    train(runs["zero1"][0], zero1, more, "opt")
    result["uninterrupted_equal"] = equal(runs["zero1"][0], reference)
    train(fsdp_ref, fsdp_ref_opt, more, "user")
    loads: dict[str, tuple[str, Callable[[torch.nn.Module], Any], str]] = {
        "tiered_to_tiered": ("tiered", lambda m: _tiered(m.parameters(), root, process_group=True), "opt"),
        "torch_to_tiered": ("torch", lambda m: _tiered(m.parameters(), root, max_grad_norm=CLIP), "max"),
        "tiered_to_torch": ("tiered", lambda m: torch.optim.AdamW(m.parameters(), lr=LR, fused=True), "user"),
    }
    for name, (source, make, clip) in loads.items():
        model = ddp()
        opt = make(model)
        load(out / source, model, opt)
        train(model, opt, more, clip)
        result[f"{name}_equal"] = equal(model, reference)
    for name, make_fsdp in (
        ("fsdp_tiered", lambda m: _tiered(m.parameters(), root)),
        ("fsdp_to_torch", lambda m: torch.optim.AdamW(m.parameters(), lr=LR, fused=True)),
    ):
        model = fsdp(base_model())
        opt = make_fsdp(model)
        load(out / "fsdp", model, opt)
        train(model, opt, more, "user")
        result[f"{name}_equal"] = equal(model, fsdp_ref)
    for _, opt, _ in runs.values():
        opt.close()
    for _, opt in fsdp_runs.values():
        opt.close()
    return result


def dominating(rank: int, world: int, out: Path) -> dict[str, Any]:
    """An embedding holding ~97% of the elements: its state is split by rows across the ranks
    (in chunks of ``chunk_bytes`` on each), so every rank holds about 1/world of the state;
    ZeRO-1 (with clipping) bit for bit against DDP + fused AdamW, ZeRO-2 within rounding; DCP
    saves the split state and torch's AdamW loads it."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Embedding(600, 16), torch.nn.Linear(16, 12), torch.nn.Linear(12, 4))
    data = torch.randint(0, 600, (STEPS, 8), generator=torch.Generator().manual_seed(rank))

    def loss(model: torch.nn.Module, step: int) -> torch.Tensor:
        return model(data[step]).pow(2).mean()

    ref = DDP(copy.deepcopy(base))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True)
    runs = {"zero1": DDP(copy.deepcopy(base)), "zero2": copy.deepcopy(base)}
    opts = {
        name: _tiered(model.parameters(), out, process_group=True, zero_stage=int(name[-1]), max_grad_norm=CLIP, chunk_bytes=4096 * 6)
        for name, model in runs.items()
    }
    for step in range(STEPS):
        for model, opt in ((ref, ref_opt), *((runs[n], opts[n]) for n in runs)):
            opt.zero_grad()
            loss(model, step).backward()
            if opt is ref_opt:
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
    result: dict[str, Any] = {"zero1_equal": equal(runs["zero1"], ref), "zero2_error": rel_error(runs["zero2"], ref)}
    result["state_bytes"] = sum(opts["zero1"].memory_report().state_by_tier.values())
    result["total_state_bytes"] = 12 * sum(p.numel() for p in base.parameters() if p.numel() >= 64)  # (paged ones)
    result["chunks"] = max(len(slot.chunks or []) for slot in opts["zero1"]._slots)
    embedding = runs["zero1"].module[0].weight
    result["state_equal"] = torch.equal(whole(opts["zero1"].state[embedding]["exp_avg_sq"]), ref_opt.state[ref.module[0].weight]["exp_avg_sq"])
    save(out / f"dominating{world}", runs["zero1"], opts["zero1"])
    theirs = DDP(copy.deepcopy(base))
    theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=LR, fused=True)
    load(out / f"dominating{world}", theirs, theirs_opt)
    result["loaded_equal"] = all(
        torch.equal(theirs_opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"]) for p, q in zip(theirs.parameters(), ref.parameters(), strict=True)
    )
    for opt in opts.values():
        opt.close()
    return result


def reshard(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Load the 2-rank checkpoints into ``world`` ranks and continue: ours (sharded again, by
    ``world``) and torch's AdamW from torch's checkpoint must go on identically."""
    root = out / "disk"
    more = batches(rank, MORE, 3)
    ours = DDP(base_model(), bucket_cap_mb=0.001)
    opt = _tiered(ours.parameters(), root, process_group=True, offload="disk", disk_root=root)
    load(out / "tiered", ours, opt)
    theirs = DDP(base_model(), bucket_cap_mb=0.001)
    ref = torch.optim.AdamW(theirs.parameters(), lr=LR, fused=True)
    load(out / "torch", theirs, ref)
    loaded_equal = all(
        torch.equal(whole(opt.state[p]["exp_avg_sq"]), ref.state[q]["exp_avg_sq"])
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True)
        if opt.state[p]
    )
    train(ours, opt, more, "opt")
    train(theirs, ref, more, "user")
    result = {"loaded_equal": loaded_equal, "continued_equal": equal(ours, theirs), "owned": sum(1 for p in ours.parameters() if opt.state[p])}
    opt.close()
    if world > 1:
        result["dominating"] = dominating(rank, world, out)
    return result




pytestmark = pytest.mark.device_modes

LIMIT_S = 120  # per spawned job (a 2-core machine, both device modes)



def _spawn(job: str, world: int, mode: str, out: Path) -> list[dict]:
    script = (
        "import sys, torch.multiprocessing as mp; sys.path.insert(0, sys.argv[1]); import test_distributed as j; "
        "mp.spawn(j.run_rank, args=(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]), nprocs=int(sys.argv[2]), join=True)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent), str(world), str(free_port()), mode, str(out), job],
        capture_output=True, text=True, timeout=LIMIT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"{job}{world}-rank{r}.json").read_text()) for r in range(world)]


def test_ddp_sharded_fsdp2_and_dcp(tmp_path: Path, device_mode: str) -> None:
    ranks = _spawn("train", 2, device_mode, tmp_path)
    for r in ranks:
        # bit for bit against DDP + fused AdamW with torch's clip_grad_norm_, 2 micro-batches a step
        assert r["ddp_equal"] and r["zero1_equal"] and r["zero1_max_equal"], r
        assert r["zero2_error"] <= 1e-6, r  # reduce-scatter sums in another order than all-reduce
        # torch's clip_grad_norm_ before ZeRO-2's reduce-scatter clips by each rank's own norm:
        # warned once (it went by silently), and never where the gradients were only accumulated
        assert r["zero2_user_warned_local_clip"] == 1 and r["zero2_user_error"] > 1e-6, r
        assert not any(r[f"{name}_warned_local_clip"] for name in ("ddp", "zero1", "zero1_max", "zero2")), r
        assert r["fsdp_user_equal"] and r["fsdp_max_error"] <= 1e-6 and r["fsdp_state_dtensor"], r
        assert r["state_equal"] and r["zero1_folder"], r
        # DCP: no zero-gradient step to create state; save -> load -> continue == uninterrupted
        assert r["init_wrote_nothing"] and r["uninterrupted_equal"], r
        assert r["tiered_to_tiered_equal"] and r["torch_to_tiered_equal"] and r["tiered_to_torch_equal"], r
        assert r["fsdp_tiered_equal"] and r["fsdp_to_torch_equal"], r
    # each rank owns part of the parameters and about half of the state bytes
    assert sum(r["state_owned"] for r in ranks) == 6 and all(r["state_owned"] for r in ranks)
    assert sum(r["zero1_state_bytes"] for r in ranks) == ranks[0]["ddp_state_bytes"]
    assert max(r["zero1_state_bytes"] for r in ranks) <= 0.6 * ranks[0]["ddp_state_bytes"]
    assert "rank" in ranks[0]["summary"] and ranks[1]["summary"] is None
    # resharded: the 2-rank checkpoints into 1 and 3 ranks, continued like torch's AdamW
    for world in (1, 3):
        resharded = _spawn("reshard", world, device_mode, tmp_path)
        assert all(r["loaded_equal"] and r["continued_equal"] for r in resharded), resharded
        assert sum(r["owned"] for r in resharded) == 6 + (4 if world == 3 else 0)  # 3 ranks: both weights split by rows
    _dominating_balanced([r["dominating"] for r in ranks])
    _dominating_balanced([r["dominating"] for r in resharded])


def _dominating_balanced(ranks: list[dict[str, Any]]) -> None:
    """One parameter with 97% of the elements: each rank holds ~1/N of the state, in chunks."""
    total = ranks[0]["total_state_bytes"]
    state = [r["state_bytes"] for r in ranks]
    # 12 B per element with a master row, 8 B without (an fp32 parameter on the plain CPU is its
    # own master; a split one keeps the row)
    assert total * 8 // 12 <= sum(state) <= total and max(state) <= 1.05 * sum(state) / len(ranks), (state, total)
    for r in ranks:
        assert r["zero1_equal"] and r["state_equal"] and r["loaded_equal"] and r["chunks"] > 1, r
        assert r["zero2_error"] <= 1e-6, r
