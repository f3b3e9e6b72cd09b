"""Warnings the store's loop thread emits for a user's call name the user's line (a tryout: they
named asyncio/events.py, so a filter on the user's module missed them)."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path

import pytest
import torch

from tierstore import HostTier, SyncTierStore
from tierstore.optim import TieredAdamW
from tierstore.tiers import DiskTier

pytestmark = pytest.mark.device_modes


def _train_once(store: SyncTierStore, sizes: list[int]) -> None:
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = TieredAdamW(params, store=store, namespace="run", min_offload_numel=1)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.close()


def test_a_warning_from_the_loop_names_the_users_line(tmp_path: Path) -> None:
    with SyncTierStore([HostTier("4MiB"), DiskTier(tmp_path / "d", "16MiB", durable=False)]) as store:
        _train_once(store, [1000, 2000])
        params = [torch.nn.Parameter(torch.randn(1000))]
        with pytest.warns(UserWarning, match="holds optimizer state for 2 parameters") as record:
            line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
            opt = TieredAdamW(params, store=store, namespace="run")
        opt.close()
    warning = next(w for w in record if "holds optimizer state" in str(w.message))
    assert (Path(warning.filename).resolve(), warning.lineno) == (Path(__file__).resolve(), line)


def test_a_filter_on_the_users_module_applies_to_it(tmp_path: Path) -> None:
    with SyncTierStore([HostTier("4MiB"), DiskTier(tmp_path / "d", "16MiB", durable=False)]) as store:
        _train_once(store, [1000, 2000])
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="namespace", module=re.escape(__name__))
            with pytest.raises(UserWarning, match="holds optimizer state for 2 parameters"):
                TieredAdamW([torch.nn.Parameter(torch.randn(1000))], store=store, namespace="run")



def test_a_policy_that_raises_is_reported_at_the_users_call(tmp_path: Path) -> None:
    """A reviewer: a policy's warning was sent from a loop callback, still named asyncio's."""

    class Raising:
        def on_access(self, key: str, nbytes: int, tier: str, hit: bool) -> None:
            raise ValueError("a policy bug")

        def on_step(self) -> None:
            pass

        def suggest(self) -> list[tuple[str, str]]:
            return []

        def reset(self) -> None:
            pass

    with SyncTierStore([HostTier("16KiB"), DiskTier(tmp_path / "d", "8MiB")], prefetch=Raising()) as store:
        with pytest.warns(RuntimeWarning, match="a policy bug") as record:
            line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
            store.put("x", torch.zeros(16))
            store.mark_step()  # (the warning is sent after the request that raised)
    warning = next(w for w in record if "a policy bug" in str(w.message))
    assert (Path(warning.filename).resolve(), warning.lineno) == (Path(__file__).resolve(), line)


def test_a_warning_in_step_names_the_step_call() -> None:
    """A reviewer: step() reached the loop without the sync facade, so its warnings were not
    marked with the caller's line."""
    param = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    opt = TieredAdamW([param], offload="host", min_offload_numel=1)
    try:
        param.grad = torch.randn_like(param)
        opt.step()
        with torch.no_grad():
            param.add_(1)  # (written from outside the optimizer: its fp32 master is reloaded, with a warning)
        param.grad = torch.randn_like(param)
        with pytest.warns(UserWarning, match="written from outside the optimizer") as record:
            line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
            opt.step()
    finally:
        opt.close()
    warning = next(w for w in record if "written from outside" in str(w.message))
    assert (Path(warning.filename).resolve(), warning.lineno) == (Path(__file__).resolve(), line)
