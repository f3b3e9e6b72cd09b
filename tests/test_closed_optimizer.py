"""An optimizer used after ``close()`` says so, instead of blaming a store the user never opened."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstore import OptimizerClosedError, StoreClosedError
from tierstore.optim import TieredAdamW


def test_a_closed_optimizer_says_it_is_closed(tmp_path: Path) -> None:
    model = torch.nn.Linear(80, 70)
    opt = TieredAdamW(model.parameters(), offload="disk", disk_root=tmp_path / "s", host_capacity="256KiB")
    model(torch.randn(2, 80)).sum().backward()
    opt.step()
    opt.close()
    for verb, call in (("step", opt.step), ("state_dict", opt.state_dict), ("memory_report", opt.memory_report),
                       ("load_state_dict", lambda: opt.load_state_dict({"state": {}, "param_groups": []}))):
        with pytest.raises(OptimizerClosedError, match=rf"{verb}\(\): this optimizer was closed") as raised:
            call()
        assert isinstance(raised.value, StoreClosedError)  # (what code catching the store's error expects)
        assert "open()" not in str(raised.value)
    assert dict(opt.state) == {}  # (Lightning's teardown reads it after the README's opt.close())
    opt.zero_grad()  # clears the gradients, as torch's does
    assert model.weight.grad is None
    opt.close()  # twice: nothing more to do
