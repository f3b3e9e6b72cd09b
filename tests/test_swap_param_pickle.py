"""A module under offload_parameters pickled whole (``torch.save(model)``) or deep-copied: its
parameters hold size-0 placeholders, so a copy would carry no weights. Refused with a way out
(``torch.save`` failed with "Can't pickle local object ...", and ``copy.deepcopy``, as
``torch.optim.swa_utils.AveragedModel`` makes one, gave a model whose forward failed);
``state_dict()`` and ``detach()`` then work."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from tierstore import SyncTierStore
from tierstore.swap import offload_parameters

pytestmark = pytest.mark.device_modes


@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_an_offloaded_module_pickled_whole_is_refused_with_a_way_out(swap_store: SyncTierStore, device_mode: str, how: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    expected = {name: value.clone() for name, value in model.state_dict().items()}
    params = offload_parameters(model, swap_store)
    with pytest.raises(TypeError, match=r"state_dict\(\).*detach\(\)"):
        if how == "torch.save":
            torch.save(model, io.BytesIO())
        else:
            copy.deepcopy(model)
    state = model.state_dict()  # (the way out: the stored weights)
    assert all(torch.equal(state[name], value) for name, value in expected.items())
    assert model(torch.ones(1, 4)).shape == (1, 2)  # (the module still works)
    params.detach()
    buffer = io.BytesIO()
    torch.save(model, buffer)  # (the other way out: detached, its weights are in place)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert all(torch.equal(loaded.state_dict()[name], value) for name, value in expected.items())
