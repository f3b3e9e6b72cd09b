"""A new user's tryout of DCP checkpoints through ``load_optimizer`` (one process): a checkpoint
``torch.optim.AdamW`` wrote for a bf16 model failed ("Missing key ... master": torch keeps no
fp32 master), and one saved with ``amsgrad=True`` loaded into an ``amsgrad=False`` optimizer
returned normally, having set the group's ``amsgrad`` and dropped ``max_exp_avg_sq``: every
later ``step()`` raised, blaming the user for changing ``param_groups``."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from tierstore.optim import TieredAdamW, load_optimizer, save_optimizer

pytestmark = pytest.mark.device_modes


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).dtype)
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("model_first", [True, False], ids=["model first", "optimizer first"])
def test_a_checkpoint_torch_wrote_for_a_bf16_model_loads_with_the_master_from_the_weight(
    tmp_path: Path, device_mode: str, model_first: bool
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 8)).to(torch.bfloat16)
    theirs = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for seed in range(2):
        _step(model, theirs, seed)
    dcp.save({"optim": get_optimizer_state_dict(model, theirs)}, checkpoint_id=tmp_path / "ckpt")
    saved = copy.deepcopy(theirs.state_dict())
    whole = copy.deepcopy(model)
    # (review) loaded before the model's weights, the master was the weight at the load: the
    # first step wrote the pre-load weights back into the model, with no word
    streamed = copy.deepcopy(model) if model_first else nn.Sequential(nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 8)).to(torch.bfloat16)
    opt = TieredAdamW(streamed.parameters(), lr=1e-2)
    reference = TieredAdamW(whole.parameters(), lr=1e-2)  # (load_state_dict of the same state)
    try:
        load_optimizer(opt, tmp_path / "ckpt", streamed)
        if not model_first:
            with torch.no_grad():
                for mine, loaded in zip(streamed.parameters(), model.parameters(), strict=True):
                    mine.data.copy_(loaded)
        reference.load_state_dict(copy.deepcopy(saved))
        got = opt.state_dict()["state"]
        for index, param in enumerate(streamed.parameters()):
            for name in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got[index][name], saved["state"][index][name]), name
            # (review: taken before the first update, it was the weight at the load)
            assert torch.equal(got[index]["master"], param.detach().float())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (the master taken from the weight is no restart to warn of)
            for seed in range(2, 4):
                _step(streamed, opt, seed)
                _step(whole, reference, seed)
        assert all(torch.equal(a, b) for a, b in zip(streamed.parameters(), whole.parameters(), strict=True))
    finally:
        opt.close()
        reference.close()


def test_a_checkpoint_of_another_amsgrad_is_refused_before_anything_is_loaded(tmp_path: Path, device_mode: str) -> None:
    torch.manual_seed(0)
    saver_model, model = nn.Linear(32, 8), nn.Linear(32, 8)
    saver = TieredAdamW(saver_model.parameters(), amsgrad=True)
    opt = TieredAdamW(model.parameters(), amsgrad=False)
    try:
        _step(saver_model, saver, 0)
        _step(model, opt, 1)
        save_optimizer(saver, tmp_path / "ckpt", saver_model)
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(ValueError, match=r"saved with amsgrad=True and is amsgrad=False here.*nothing was loaded"):
            load_optimizer(opt, tmp_path / "ckpt", model)
        after = opt.state_dict()
        assert after["param_groups"] == before["param_groups"]
        assert all(torch.equal(after["state"][i][k], before["state"][i][k]) for i in before["state"] for k in before["state"][i])
        _step(model, opt, 2)  # (usable: the group was left as it was)
    finally:
        saver.close()
        opt.close()
