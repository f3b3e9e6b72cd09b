"""``torch.compile``d models with ``TieredAdamW``: the post-accumulate-grad hooks fire on the
compiled module's parameters and the update is torch's. Inductor and eager round differently, so
a compiled model + ``TieredAdamW`` is compared with the same compiled model + ``torch.optim.AdamW``,
bit for bit: ``aot_eager`` (fast: AOTAutograd's graphs run eagerly), compiled autograd, and one
inductor run. Both device modes."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tierstore.optim import TieredAdamW

pytestmark = [
    pytest.mark.device_modes,
    # dynamo cannot trace the hook's hand-over to the store's loop: compiled autograd breaks the graph there
    pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

STEPS = 3
PASSES = 2


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))


def train(backend: str, tiered: bool, *, compiled_autograd: bool = False, **options: Any) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """``STEPS`` steps of ``PASSES`` accumulated backward passes through ``torch.compile(model)``,
    clipped to a global norm (torch's ``clip_grad_norm_`` for AdamW; ours on the host copies)."""
    torch._dynamo.reset()
    model = make_model()
    compiled = torch.compile(model, backend=backend)
    if tiered:
        opt: Any = TieredAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True, min_offload_numel=64, max_grad_norm=0.5, **options)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(STEPS):
            opt.zero_grad()
            for _ in range(PASSES):
                loss = compiled(torch.randn(8, 16, generator=g)).pow(2).mean()
                if compiled_autograd:
                    with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
                        loss.backward()
                else:
                    loss.backward()
                losses.append(loss.detach())
            if not tiered:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
    finally:
        if tiered:
            opt.close()
    return model, losses


def assert_same(backend: str, **options: Any) -> None:
    reference, reference_losses = train(backend, tiered=False, **options)
    model, losses = train(backend, tiered=True, **options)
    assert torch.equal(torch.stack(losses), torch.stack(reference_losses))
    for x, y in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_compiled_aot_eager(device_mode: str) -> None:
    assert_same("aot_eager")


def test_compiled_autograd(device_mode: str) -> None:
    """Compiled autograd traces backward; our hooks run as Python at a graph break."""
    assert_same("aot_eager", compiled_autograd=True)


@pytest.mark.skipif(os.environ.get("TIERSTORE_SKIP_INDUCTOR") == "1", reason="TIERSTORE_SKIP_INDUCTOR=1")
def test_compiled_inductor(device_mode: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Inductor generates C++ kernels for the forward and backward (the first compile takes a while)."""
    assert_same("inductor")


def test_compiled_model_with_both_offloads(device_mode: str) -> None:
    """``offload_parameters`` and ``offload_activations`` together under ``torch.compile``: dynamo
    traced the parameters' saved-tensor hook into the activations' one and on into the store,
    and the first forward raised its internal 'Cannot generate resume function for ...
    coroutine'. The hooks now run as Python (a graph break): the same gradients as without."""
    from tierstore import HostTier, SyncTierStore
    from tierstore.swap import offload_activations, offload_parameters

    def grads(swapped: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        compiled = torch.compile(model, backend="aot_eager")
        inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
        if not swapped:
            compiled(inputs).pow(2).mean().backward()
            return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        with SyncTierStore([HostTier("16MiB")]) as store:
            weights = offload_parameters(model, store)
            with offload_activations(store, min_bytes=1):
                loss = compiled(inputs).pow(2).mean()
            loss.backward()
            weights.detach()
            return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    for ours, theirs in zip(grads(True), grads(False), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
