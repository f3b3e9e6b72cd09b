"""``offload_parameters`` on torch's attention and transformer layers: ``nn.MultiheadAttention``
reads ``out_proj.weight`` in its own forward (never calling ``out_proj``), and the layers' eval
fast path reads every weight; their children's weights stayed zero-size placeholders there
(a cryptic size error from torch's math, and placeholders in ``state_dict()``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tierstore import DeviceTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW
from tierstore.swap import offload_parameters

pytestmark = pytest.mark.device_modes

_MODELS = {
    "attention": lambda: nn.MultiheadAttention(32, 4, batch_first=True),
    "encoder layer": lambda: nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0),
    "decoder in a model": lambda: nn.Sequential(nn.Linear(32, 32), nn.TransformerDecoderLayer(32, 4, 64, batch_first=True, dropout=0.0)),
}


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(model, nn.MultiheadAttention):
        return model(x, x, x)[0].square().mean()
    if isinstance(model, nn.Sequential):
        return model[1](model[0](x), x).square().mean()
    return model(x).square().mean()


@pytest.mark.parametrize("kind", list(_MODELS))
def test_torch_attention_layers_train_and_save_as_torch(device_mode: str, kind: str) -> None:
    torch.manual_seed(0)
    reference = _MODELS[kind]()
    model = copy.deepcopy(reference)
    x = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(1))
    exact = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    with SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("8MiB")]) as store:
        params = offload_parameters(model, store)
        opt = TieredAdamW(model.parameters(), store=store, lr=1e-2)
        try:
            for _ in range(3):
                expected = _loss(reference, x)
                expected.backward()
                exact.step()
                exact.zero_grad()
                got = _loss(model, x)
                got.backward()
                opt.step()
                opt.zero_grad()
                params.mark_step()
                assert torch.equal(got, expected)
            ours, theirs = model.state_dict(), reference.state_dict()
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
            reference.eval()
            model.eval()
            with torch.no_grad():  # (the layers' fast path reads every weight itself)
                assert torch.equal(_loss(model, x), _loss(reference, x))
            model.load_state_dict(_MODELS[kind]().state_dict())  # (a load reaches the children's weights too)
            fresh = model.state_dict()
            assert all(fresh[k].shape == theirs[k].shape and not torch.equal(fresh[k], theirs[k]) for k in theirs if theirs[k].numel() > 1)
        finally:
            opt.close()
            params.detach()


class _ReadsItsChildsWeight(nn.Module):
    """As transformers' ``CLIPTextEmbeddings``: its forward reads a child's weight itself
    (``position_embedding.weight.shape[0]``), outside the child's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Embedding(50, 16)
        self.position = nn.Embedding(12, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.position.weight.shape[0]:
            raise ValueError(f"sequence length {ids.shape[1]} is more than {self.position.weight.shape[0]} positions")
        return self.token(ids) + self.position(torch.arange(ids.shape[1]))


def test_whole_units_makes_a_module_reading_its_childs_weight_one_unit(device_mode: str) -> None:
    """A tryout: an HF CLIPTextModel failed every forward under offload_parameters (its
    embeddings read a child's weight shape: the placeholder's, 0). ``whole_units=`` names such
    classes; their children's weights are held with them."""
    torch.manual_seed(0)
    reference = nn.Sequential(_ReadsItsChildsWeight(), nn.Linear(16, 1))
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    with SyncTierStore([DeviceTier("cpu", "1MiB"), HostTier("8MiB")]) as store:
        offload = offload_parameters(copy.deepcopy(reference), store)
        with pytest.raises(ValueError, match="more than 0 positions"):
            offload.module(ids)
        offload.detach()
        offload = offload_parameters(model, store, whole_units=[_ReadsItsChildsWeight])
        exact = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
        opt = TieredAdamW(model.parameters(), store=store, lr=1e-2)
        try:
            for _ in range(3):
                reference(ids).square().mean().backward()
                exact.step()
                exact.zero_grad()
                model(ids).square().mean().backward()
                opt.step()
                opt.zero_grad()
        finally:
            opt.close()
        offload.detach()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    with SyncTierStore([HostTier("1MiB")]) as store, pytest.raises(TypeError, match="whole_units must be nn.Module classes"):
        offload_parameters(nn.Linear(2, 2), store, whole_units=["CLIPTextEmbeddings"])  # type: ignore[list-item]
