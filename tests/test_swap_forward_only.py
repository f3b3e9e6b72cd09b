"""A forward under grad mode whose graph is dropped without backward (an evaluation loss
without no_grad, a skipped step, a forward that raised) is freed under either offload (a
tryout: the pack hooks kept the tensors they did not store as themselves, and an output a
backward formula saves, ReLU's, then held itself through torch's graph, out of the cycle
collector's sight: 320 MiB over 20 forwards)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from tierstore import DeviceTier, HostTier, SyncTierStore
from tierstore.swap import offload_activations, offload_parameters

pytestmark = pytest.mark.device_modes


@pytest.mark.parametrize("offload", ["parameters", "activations"])
def test_a_graph_dropped_without_backward_is_freed(offload: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    with SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("8MiB")]) as store:
        handle = offload_parameters(model, store) if offload == "parameters" else offload_activations(store, min_bytes="1GiB")
        hidden: list[weakref.ref[torch.Tensor]] = []  # (the outputs ReLU and Tanh save for their backward)
        for index in (1, 3):
            model[index].register_forward_hook(lambda _, args, output: hidden.append(weakref.ref(output)))
        with handle if offload == "activations" else _nothing():
            for _ in range(5):
                out = model(torch.randn(8, 16))  # (grad mode: a graph is recorded, then dropped)
                del out
        gc.collect()
        assert len(hidden) == 10 and [ref for ref in hidden if ref() is not None] == []
        if offload == "parameters":
            handle.detach()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
