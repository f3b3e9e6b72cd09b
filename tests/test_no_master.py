"""On the plain CPU an fp32 parameter is its own fp32 master: its state is the moments only and
the update runs in place on the parameter, as torch's AdamW does (bit for bit with it)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    twin.load_state_dict(model.state_dict())
    return model, twin


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        model(torch.randn(16, 64, generator=generator)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _assert_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("chunk_bytes", [None, "16KiB"])
def test_bit_for_bit_with_torch_fused_adamw(tmp_path: Path, device_mode: str, chunk_bytes: str | None) -> None:
    reference, model = _models()
    exact = torch.optim.AdamW(reference.parameters(), lr=3e-3, fused=True)
    host = "64KiB" if chunk_bytes else "512KiB"  # chunked: pages through the disk tier
    store = SyncTierStore([HostTier(host), DiskTier(tmp_path / "store", "16MiB")]).open()
    opt = TieredAdamW(model.parameters(), lr=3e-3, store=store, min_offload_numel=100, chunk_bytes=chunk_bytes, fused=True)
    try:
        _steps(reference, exact, range(4))
        _steps(model, opt, range(4))
        _assert_equal(reference, model)
        for p, q in zip(reference.parameters(), model.parameters(), strict=True):
            theirs, ours = exact.state[p], opt.state[q]
            assert "master" not in ours
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(theirs[name], ours[name])
    finally:
        opt.close()
        store.close()


@pytest.mark.parametrize("chunk_bytes", [None, "16KiB"])
def test_state_is_the_moments_only_on_the_plain_cpu(device_mode: str, chunk_bytes: str | None) -> None:
    model = torch.nn.Linear(256, 64, bias=False)
    opt = TieredAdamW(model.parameters(), chunk_bytes=chunk_bytes)
    try:
        model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        keys = [k for k in opt.namespace.keys() if not k.endswith("/grad")]
        assert len(keys) == 1 if chunk_bytes is None else len(keys) > 1
        per_param = 8 if device_mode == "plain" else 12
        assert sum(opt.store.info(k)["nbytes"] for k in keys) == per_param * model.weight.numel()
        assert opt.memory_report().state_by_tier["host"] == per_param * model.weight.numel()
    finally:
        opt.close()


# Each run's layout follows its own link: a state saved with the master row (under a device
# link) continues without it on the plain CPU, and the other way round.
@pytest.mark.parametrize("first, second", [("plain", "plain"), ("emulated", "plain"), ("plain", "emulated")])
@pytest.mark.parametrize("chunk_bytes", [None, "16KiB"])
def test_restart_through_a_named_namespace(tmp_path: Path, first: str, second: str, chunk_bytes: str | None) -> None:
    reference, model = _models()
    exact = torch.optim.AdamW(reference.parameters(), lr=3e-3, fused=True)

    def run_with(mode: str, seeds: range) -> None:
        store = SyncTierStore([HostTier("64KiB" if chunk_bytes else "512KiB"), DiskTier(tmp_path / "store", "16MiB")]).open()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing of the saved state may be dropped
            opt = TieredAdamW(model.parameters(), lr=3e-3, store=store, namespace="run", min_offload_numel=100,
                              chunk_bytes=chunk_bytes, fused=True, emulate_device=mode == "emulated")
        try:
            _steps(model, opt, seeds)
        finally:
            opt.close()
            store.close()

    run_with(first, range(2))
    run_with(second, range(2, 4))
    _steps(reference, exact, range(4))
    _assert_equal(reference, model)


def test_checkpoint_round_trip_through_torch(device_mode: str) -> None:
    reference, model = _models()
    opt = TieredAdamW(model.parameters(), lr=3e-3, min_offload_numel=100, fused=True)
    try:
        _steps(model, opt, range(2))
        torch_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, fused=True)
        reference.load_state_dict(model.state_dict())
        torch_opt.load_state_dict(opt.state_dict())
        _steps(model, opt, range(2, 4))
        _steps(reference, torch_opt, range(2, 4))
        _assert_equal(reference, model)
        opt.load_state_dict(torch_opt.state_dict())  # and back: the moments, the weight stays the parameter's
        _steps(model, opt, range(4, 5))
        _steps(reference, torch_opt, range(4, 5))
        _assert_equal(reference, model)
    finally:
        opt.close()


EXIT_SCRIPT = r"""
import atexit, sys, torch
from tierstore.optim import TieredAdamW

torch.manual_seed(0)
model = torch.nn.ModuleList([torch.nn.Linear(512, 64, bias=False) for _ in range(16)])
opt = TieredAdamW(model.parameters(), lr=1e-3, offload="disk", disk_root=sys.argv[1], host_capacity="1MiB")
sum(layer(torch.randn(2, 512)).sum() for layer in model).backward()
opt.step()  # leaves prefetches and write-backs of the next step's state running on daemon threads
# atexit runs after threading's exit hooks, still before the interpreter is finalized
atexit.register(lambda: print("store open at exit:", opt.store.is_open))
"""


def test_an_optimizer_left_open_is_closed_before_the_interpreter_finalizes(tmp_path: Path, device_mode: str) -> None:
    """Its store's I/O threads are daemons: one still freeing a tensor when the interpreter
    finalizes is ended inside a C++ destructor, which aborts the process (std::terminate)."""
    env = dict(os.environ, TIERSTORE_EMULATE_DEVICE="1" if device_mode == "emulated" else "0")
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "store open at exit: False"
