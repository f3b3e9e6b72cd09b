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
        _train_once(store, [1000])
        params = [torch.nn.Parameter(torch.randn(1000)), torch.nn.Parameter(torch.randn(2000))]
        with pytest.warns(UserWarning, match="holds optimizer state for 1 parameter, not 2") as record:
            line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
            opt = TieredAdamW(params, store=store, namespace="run")
        opt.close()
    warning = next(w for w in record if "holds optimizer state" in str(w.message))
    assert (Path(warning.filename).resolve(), warning.lineno) == (Path(__file__).resolve(), line)


def test_a_filter_on_the_users_module_applies_to_it(tmp_path: Path) -> None:
    with SyncTierStore([HostTier("4MiB"), DiskTier(tmp_path / "d", "16MiB", durable=False)]) as store:
        _train_once(store, [1000])
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="namespace", module=re.escape(__name__))
            with pytest.raises(UserWarning, match="holds optimizer state for 1 parameter, not 2"):
                TieredAdamW([torch.nn.Parameter(torch.randn(1000)), torch.nn.Parameter(torch.randn(2000))], store=store, namespace="run")



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

    store = SyncTierStore([HostTier("16KiB"), DiskTier(tmp_path / "d", "8MiB")], prefetch=Raising())
    with store, pytest.warns(RuntimeWarning, match="a policy bug") as record:
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


def test_a_warning_from_python_c_is_shown() -> None:
    """A tryout: code run with ``python -c`` (or stdin, or exec of a string) got ImportError from
    every tierstore warning: the source line was looked up through __main__'s loader."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from tierstore import SyncTierStore, HostTier\n"
        "from tierstore.optim import TieredAdamW\n"
        "s = SyncTierStore([HostTier('4MiB')]).open()\n"
        "p = [torch.nn.Parameter(torch.randn(100)) for _ in range(2)]\n"
        "o = TieredAdamW(p[:1], store=s, namespace='x')\n"
        "for q in p: q.grad = torch.randn(100)\n"
        "o.step(); o.close()\n"
        "TieredAdamW(p, store=s, namespace='x').close(); s.close(); print('constructed')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "constructed" in done.stdout and "<string>:9: UserWarning: namespace 'x/' holds optimizer state" in done.stderr


@pytest.mark.parametrize("change", ["count", "layout"])
def test_a_namespace_warning_made_an_error_leaves_the_saved_state(tmp_path: Path, change: str) -> None:
    """A tryout: a filter that made the namespace warning an error refused the constructor,
    but the saved step counts were deleted already, so the state was lost."""
    with SyncTierStore([HostTier("4MiB"), DiskTier(tmp_path / "d", "16MiB", durable=False)]) as store:
        params = [torch.nn.Parameter(torch.randn(n)) for n in (1000, 2000)]
        opt = TieredAdamW(params, store=store, namespace="run", min_offload_numel=1)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        expected = opt.state_dict()["state"]
        opt.close()
        other = [*params, torch.nn.Parameter(torch.randn(10))] if change == "count" else params
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="namespace", module=re.escape(__name__))
            with pytest.raises(UserWarning, match="namespace 'run/'"):
                TieredAdamW(other, store=store, namespace="run", min_offload_numel=1, state_precision="bf16" if change == "layout" else "fp32")
        again = TieredAdamW(params, store=store, namespace="run", min_offload_numel=1)  # (as the first was made)
        state = again.state_dict()["state"]
        for index in (0, 1):
            for name, value in expected[index].items():
                assert torch.equal(state[index][name], value), (index, name)
        again.close()


def test_a_step_warning_made_an_error_then_step_again_trains_as_if_ignored() -> None:
    """A tryout: the 'parameter N is bfloat16 now' warning made an error failed the step after
    the state's layout changed and before its rows were kept: step() again trained on state
    never moved."""

    def train(as_error: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 16)
        opt = TieredAdamW(model.parameters(), offload="host", min_offload_numel=1)
        try:
            torch.manual_seed(1)
            for _ in range(2):
                model(torch.randn(4, 32)).square().sum().backward()
                opt.step()
                opt.zero_grad()
            model.to(torch.bfloat16)
            for _ in range(2):
                model(torch.randn(4, 32, dtype=torch.bfloat16)).square().sum().backward()
                with warnings.catch_warnings():
                    warnings.filterwarnings("error" if as_error else "ignore", message="parameter")
                    try:
                        opt.step()
                    except Exception:  # noqa: BLE001 - the warning, as the error of the step
                        assert as_error
                        warnings.simplefilter("ignore")
                        opt.step()  # (as the error says: step() again)
                opt.zero_grad()
            state = opt.state_dict()["state"]
            return [p.detach().clone() for p in model.parameters()] + [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        finally:
            opt.close()

    for ours, ignored in zip(train(True), train(False), strict=True):
        assert torch.equal(ours, ignored)
