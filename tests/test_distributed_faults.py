"""Sharded TieredAdamW (gloo, 2 processes) when something goes wrong on one rank: a store error
in one rank's ``step()`` makes every rank raise promptly (not wait in the weight broadcast until
gloo's timeout), ``step()`` again completes the step as if nothing happened, and ``zero_grad()``
abandons it with the ranks still agreeing; GradScaler's inf/NaN steps are skipped on every rank.
Each against an uninterrupted run or DDP + ``torch.optim.AdamW(fused=True)``, in both device
modes. One spawned job runs every case; the ranks run ``run_rank`` below."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from spawned import gloo_group, spawn_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from tierstore import HostTier, TierStore
from tierstore.errors import ChecksumError, StepIncompleteError

LIMIT_S = 90  # the whole spawned job: both device modes, every case
PG_TIMEOUT_S = 60  # gloo's timeout: a rank left waiting in a broadcast would take this long
STEPS, FAIL_AT, LR = 3, 1, 1e-2


class FlakyStore(TierStore):
    """A store whose write holds of one state entry (the first one an update asks for once
    armed) raise ``ChecksumError`` while it stays armed, as a corrupted record read from disk
    would: the resident step's hold and the pipeline's after it fail alike."""

    armed = False
    failing: str | None = None

    def hold(self, key: str, tier: Any = None, write: bool = False) -> Any:
        if not self.armed:
            self.failing = None
        elif write and not key.endswith("/grad") and self.failing in (None, key):
            self.failing = key
            return self._fail(key)
        return super().hold(key, tier, write)

    @asynccontextmanager
    async def _fail(self, key: str) -> AsyncIterator[torch.Tensor]:
        raise ChecksumError(f"injected: the record of {key!r} does not match its checksum")
        yield torch.empty(0)  # pragma: no cover


def base_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x.detach(), y.detach()) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def _same_on_all_ranks(model: torch.nn.Module) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(torch.equal(low, high))


def _tiered(model: torch.nn.Module, **options: Any) -> Any:
    from tierstore.optim import TieredAdamW

    store = FlakyStore([HostTier("8MiB")])
    return TieredAdamW(model.parameters(), lr=LR, fused=True, min_offload_numel=64, process_group=True, store=store, **options)


def faults(rank: int, zero_stage: int) -> dict[str, Any]:
    """Rank 1's store fails once in step ``FAIL_AT``: both ranks raise within seconds; step()
    again gives the uninterrupted run's weights; with ZeRO-1 those are DDP + AdamW's."""
    ddp = zero_stage == 1
    data = torch.randn(STEPS, 4, 16, generator=torch.Generator().manual_seed(rank))
    wrap = (lambda m: DDP(m)) if ddp else (lambda m: m)
    options = {"zero_stage": zero_stage, "max_grad_norm": 0.05}
    ref = wrap(base_model())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, fused=True) if ddp else _tiered(ref, **options)
    ours = wrap(base_model())
    opt = _tiered(ours, **options)
    result: dict[str, Any] = {}
    for step in range(STEPS):
        for model, o in ((ref, ref_opt), (ours, opt)):
            o.zero_grad()
            model(data[step]).pow(2).mean().backward()
            if ddp and o is ref_opt:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            if o is opt and step == FAIL_AT:
                opt.store.armed = rank == 1
                started = time.monotonic()
                try:
                    o.step()
                except StepIncompleteError as exc:
                    result["raised_after_s"] = time.monotonic() - started
                    result["error"] = type(exc).__name__
                    result["message"] = str(exc)
                    result["failed"] = getattr(exc, "failed", None)
                result["agree_before_retry"] = _same_on_all_ranks(model)
                opt.store.armed = False
                o.step()  # completes the step: rank 1 applies the rest, every rank the new weights
            else:
                o.step()
    result["equal"] = _equal(ours, ref)
    result["same_on_all_ranks"] = _same_on_all_ranks(ours)
    # abandoned: zero_grad() on every rank after the failure leaves the ranks agreeing
    model = wrap(base_model())
    opt2 = _tiered(model, zero_stage=zero_stage)
    model(data[0]).pow(2).mean().backward()
    opt2.store.armed = rank == 0
    with suppress(StepIncompleteError):
        opt2.step()
    opt2.store.armed = False
    opt2.zero_grad()
    result["abandoned_agree"] = _same_on_all_ranks(model)
    model(data[1]).pow(2).mean().backward()
    opt2.step()  # and the next step runs normally
    result["after_abandon_agree"] = _same_on_all_ranks(model)
    for o in (opt, opt2, ref_opt):
        if hasattr(o, "close"):
            o.close()
    return result


def scaler(rank: int) -> dict[str, Any]:
    """GradScaler on CPU: a step whose gradients hold an inf (one rank's batch; DDP's all-reduce
    spreads it) is skipped on both ranks, and the scale backs off, exactly as with AdamW."""
    data = torch.randn(STEPS, 4, 16, generator=torch.Generator().manual_seed(10 + rank))
    if rank == 1:
        data[1, 0, 0] = float("inf")
    runs = {}
    for name in ("torch", "ours"):
        model = DDP(base_model())
        if name == "torch":
            opt: Any = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        else:
            opt = _tiered(model)
        scale = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        scales = []
        for step in range(STEPS):
            opt.zero_grad()
            scale.scale(model(data[step]).pow(2).mean()).backward()
            scale.step(opt)
            scale.update()
            scales.append(scale.get_scale())
        runs[name] = (model, opt, scales)
    result = {"equal": _equal(runs["ours"][0], runs["torch"][0]), "scales": runs["ours"][2], "torch_scales": runs["torch"][2]}
    result["finite"] = all(bool(p.isfinite().all()) for p in runs["ours"][0].parameters())
    result["same_on_all_ranks"] = _same_on_all_ranks(runs["ours"][0])
    runs["ours"][1].close()
    # ZeRO-2: refused clearly (each rank's scaler checks its own unreduced gradients)
    model = base_model()
    opt = _tiered(model, zero_stage=2)
    scale = torch.amp.GradScaler("cpu")
    scale.scale(model(data[0]).pow(2).mean()).backward()
    try:
        scale.step(opt)
        result["zero2_refused"] = ""
    except ValueError as exc:
        result["zero2_refused"] = str(exc)
    opt.close()
    return result


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    from tierstore.device import emulate_device

    with gloo_group(rank, world, port, PG_TIMEOUT_S):
        result = {}
        for mode in ("plain", "emulated"):
            with emulate_device(mode == "emulated"):
                result[mode] = {"zero1": faults(rank, 1), "zero2": faults(rank, 2), "scaler": scaler(rank)}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_a_rank_failing_in_step_and_grad_scaler(tmp_path: Path) -> None:
    ranks = spawn_ranks(__file__, tmp_path, LIMIT_S)
    for mode in ("plain", "emulated"):
        for stage in ("zero1", "zero2"):
            failing, other = ranks[1][mode][stage], ranks[0][mode][stage]
            # both raise, promptly (a rank waiting in the broadcast would take gloo's 60 s)
            assert failing["error"] == "StepIncompleteError" and "ChecksumError" in failing["message"], failing
            assert other["error"] == "PeerStepError" and other["failed"] == {"1": "StepIncompleteError: " + failing["message"]}, other
            assert "rank 1" in other["message"] and "ChecksumError" in other["message"], other
            assert failing["raised_after_s"] < 10 and other["raised_after_s"] < 10, (failing, other)
            for r in (failing, other):
                # step() again: the uninterrupted run's weights (ZeRO-1: DDP + AdamW's), bit for bit
                assert r["equal"] and r["same_on_all_ranks"], (mode, stage, r)
                assert r["abandoned_agree"] and r["after_abandon_agree"], (mode, stage, r)
        for r in ranks:
            s = r[mode]["scaler"]
            assert s["equal"] and s["finite"] and s["same_on_all_ranks"], (mode, s)
            assert s["scales"] == s["torch_scales"] and s["scales"][1] < s["scales"][0], (mode, s)  # step 1 skipped: backoff
            assert "zero_stage=2" in s["zero2_refused"], s
