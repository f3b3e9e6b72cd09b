"""A new user's tryout of swapping: an offloader whose arguments had a typo kept its namespace
claimed (the corrected retry was refused), weights in ``nn.ParameterList``/``nn.ParameterDict``
stayed zero-size placeholders in the forward that reads them (torch's cryptic size error), and a
forward hook registered after ``offload_parameters`` read the placeholder with no word said."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from tierstore import DeviceTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_activations, offload_parameters

pytestmark = pytest.mark.device_modes


def _store() -> SyncTierStore:
    return SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("16MiB")]).open()


@pytest.mark.parametrize("argument", ["min_bytes", "max_in_flight", "ahead"])
def test_an_activation_offloader_refused_for_a_typo_leaves_its_namespace_free(device_mode: str, argument: str) -> None:
    with _store() as store:
        with pytest.raises(ValueError, match="byte size"):
            offload_activations(store, namespace="acts", **{argument: "1 MiB?"})
        assert store.namespaces() == []
        offload_activations(store, namespace="acts", **{argument: "1MiB"}).close()


def test_a_parameter_offloader_refused_for_a_typo_leaves_its_namespace_free(device_mode: str) -> None:
    model = nn.Linear(8, 8)
    with _store() as store:
        with pytest.raises(ValueError, match="byte size"):
            offload_parameters(model, store, ahead="64 MB!", namespace="params")
        assert store.namespaces() == []
        offload_parameters(model, store, namespace="params").detach()


class _Lists(nn.Module):
    """Weights in containers with no forward of their own, read by this module's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ParameterList([nn.Parameter(torch.randn(16, 16) / 4) for _ in range(3)])
        self.extra = nn.ParameterDict({"bias": nn.Parameter(torch.randn(16)), "scale": nn.Parameter(torch.ones(16))})
        self.nested = nn.ModuleList([nn.ParameterList([nn.Parameter(torch.randn(16) / 4)]), nn.Linear(16, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight in self.layers:
            x = torch.tanh(x @ weight)
        x = self.nested[1](x * self.extra["scale"] + self.extra["bias"] + self.nested[0][0])
        return x.square().mean()


def test_weights_in_parameter_lists_and_dicts_train_as_without_offloading(device_mode: str) -> None:
    torch.manual_seed(0)
    reference = _Lists()
    model = copy.deepcopy(reference)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    exact = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    with _store() as store:
        params = offload_parameters(model, store)
        opt = TieredAdamW(model.parameters(), store=store, lr=1e-2)
        try:
            for _ in range(3):
                expected = reference(x)
                expected.backward()
                exact.step()
                exact.zero_grad()
                got = model(x)
                got.backward()
                opt.step()
                opt.zero_grad()
                params.mark_step()
                assert torch.equal(got, expected)
            ours, theirs = model.state_dict(), reference.state_dict()
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
        finally:
            opt.close()
            params.detach()


def test_a_forward_hook_registered_after_offloading_is_warned_of_once(device_mode: str) -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    model[2].register_forward_hook(lambda module, args, output: None)  # (before: it sees the weights, no warning)
    x = torch.randn(4, 16)
    seen: list[float] = []
    with _store() as store:
        params = offload_parameters(model, store)
        try:
            # (prepended: it runs before the weights are let go, and sees them)
            model[0].register_forward_hook(lambda module, args, output: seen.append(float(module.weight.detach().norm())), prepend=True)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                model(x).sum().backward()
            model[0].register_forward_hook(lambda module, args, output: None)
            with pytest.warns(UserWarning, match=r"forward hook was registered on 0 \(Linear\) after its weights were offloaded") as caught:
                model(x).sum().backward()
            assert caught[0].filename == __file__
            assert seen and all(norm > 0 for norm in seen)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                model(x).sum().backward()
        finally:
            params.detach()
