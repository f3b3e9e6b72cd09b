"""What a new user found (issue 13): checkpoints of a channels_last weight's state, entries for
parameters never updated, the saved ``fused`` choice; and the wording of the memory report, the
sync facade's not-open error, the demo's final-loss line and the tuning file."""

from __future__ import annotations

import copy
import json
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from tierstore import DiskTier, HostTier, SyncTierStore, TierStore
from tierstore.cli import main as cli_main
from tierstore.disk.tuning import TUNING_FILE, IOSettings, save_tuning
from tierstore.errors import StoreClosedError
from tierstore.optim import TieredAdamW, load_optimizer, save_optimizer

LR = 1e-2
device_modes = pytest.mark.device_modes
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process


class _ConvNet(torch.nn.Module):
    """A conv weight in channels_last (strides (36, 1, 12, 4)), a linear one, and a layer the
    loss never reaches (no gradient: no state)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3)
        self.head = torch.nn.Linear(8 * 4 * 4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).flatten(1))


def _convnet() -> torch.nn.Module:
    torch.manual_seed(0)
    return _ConvNet().to(memory_format=torch.channels_last)


def _train(model: torch.nn.Module, opt: Any, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(2, 4, 6, 6, generator=generator).to(memory_format=torch.channels_last)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _tiered(model: torch.nn.Module, tmp_path: Path, host: str = "16KiB", **options: Any) -> TieredAdamW:
    """State paged to a disk below a host tier too small for all of it."""
    store = TierStore([HostTier(host), DiskTier(tmp_path / "d", "16MiB", chunk_size="4KiB", inline_max=0)])
    return TieredAdamW(model.parameters(), lr=LR, weight_decay=0.1, min_offload_numel=64, store=store, **options)


def _adamw(model: torch.nn.Module, **options: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, **options)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


# -- 1. state tensors take the parameter's layout; loading lands element by element ---------------


@device_modes
def test_state_has_the_parameters_strides_and_continues_in_torchs_fused_adamw(tmp_path: Path) -> None:
    model, reference = _convnet(), _convnet()
    opt, ref_opt = _tiered(model, tmp_path, fused=True), _adamw(reference, fused=True)
    _train(model, opt, 3)
    _train(reference, ref_opt, 3)
    assert _same(model, reference)
    conv = model.conv.weight
    saved, expected = opt.state_dict(), ref_opt.state_dict()
    for name in ("exp_avg", "exp_avg_sq"):
        assert saved["state"][0][name].stride() == expected["state"][0][name].stride() == conv.stride() == (36, 1, 12, 4)
        assert torch.equal(saved["state"][0][name], expected["state"][0][name])
        assert opt.state[conv][name].stride() == conv.stride()  # opt.state's tensors too
    # torch's fused kernel reads the state's memory in the parameter's order: it must be laid out alike
    loaded = _adamw(model, fused=True)
    loaded.load_state_dict(saved)
    opt.close()
    _train(model, loaded, 2, seed=2)
    _train(reference, ref_opt, 2, seed=2)
    assert _same(model, reference)


@device_modes
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_a_state_of_other_strides_loads_value_by_value(tmp_path: Path, layout: torch.memory_format) -> None:
    model, reference = _convnet(), _convnet()
    ref_opt = _adamw(reference, fused=True)
    _train(model, _adamw(model, fused=True), 3)
    _train(reference, ref_opt, 3)
    saved = copy.deepcopy(ref_opt.state_dict())
    for entry in saved["state"].values():
        for name, value in entry.items():
            if value.dim() == 4:
                entry[name] = value.contiguous(memory_format=layout)
    opt = _tiered(model, tmp_path, fused=True)
    opt.load_state_dict(saved)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], ref_opt.state_dict()["state"][0]["exp_avg"])
    _train(model, opt, 2, seed=2)
    _train(reference, ref_opt, 2, seed=2)
    assert _same(model, reference)
    opt.close()


@device_modes
def test_dcp_streaming_save_and_load_keep_a_channels_last_states_values(tmp_path: Path) -> None:
    def convnet() -> torch.nn.Module:
        # (torch's AdamW saves nothing for a trainable parameter never updated, and DCP's load
        # wants an entry for each: the layer without gradients is frozen here)
        model = _convnet()
        model.unused.requires_grad_(False)
        return model

    model, reference = convnet(), convnet()
    opt, ref_opt = _tiered(model, tmp_path, fused=True), _adamw(reference, fused=True)
    _train(model, opt, 3)
    _train(reference, ref_opt, 3)
    # ours streamed out -> torch's AdamW through DCP's standard path
    save_optimizer(opt, tmp_path / "ours", model)
    target = convnet()
    target.load_state_dict(model.state_dict())
    target_opt = _adamw(target, fused=True)
    state = {"optim": get_optimizer_state_dict(target, target_opt)}
    dcp.load(state, checkpoint_id=str(tmp_path / "ours"))
    set_optimizer_state_dict(target, target_opt, state["optim"])
    # torch's, saved through DCP -> ours streamed in
    dcp.save({"optim": get_optimizer_state_dict(reference, ref_opt)}, checkpoint_id=str(tmp_path / "torch"))
    opt.close()
    again = convnet()
    again.load_state_dict(reference.state_dict())
    again_opt = _tiered(again, tmp_path / "again", fused=True)
    load_optimizer(again_opt, tmp_path / "torch", again)
    assert again_opt.state_dict()["state"][0]["exp_avg"].stride() == again.conv.weight.stride()
    for m, o in ((target, target_opt), (again, again_opt), (reference, ref_opt)):
        _train(m, o, 2, seed=2)
    assert _same(target, reference) and _same(again, reference)
    again_opt.close()


# -- 2. no entry for a parameter never updated (DCP's template keeps one) ----------------------------


@device_modes
def test_state_dict_has_no_entry_for_a_parameter_never_updated(tmp_path: Path) -> None:
    model, reference = _convnet(), _convnet()
    opt, ref_opt = _tiered(model, tmp_path), _adamw(reference)
    assert opt.state_dict()["state"] == ref_opt.state_dict()["state"] == {}
    _train(model, opt, 2)
    _train(reference, ref_opt, 2)
    assert sorted(opt.state_dict()["state"]) == sorted(ref_opt.state_dict()["state"]) == [0, 1, 2, 3]
    # DCP: its state dict is the template dcp.load fills; every trainable parameter has an entry
    names = set(get_optimizer_state_dict(model, opt)["state"])
    assert names == {name for name, _ in model.named_parameters()}
    save_optimizer(opt, tmp_path / "ck", model)
    opt.close()
    # ... so a fresh optimizer (no state yet) loads it through DCP's standard path
    fresh_model = _convnet()
    fresh = _tiered(fresh_model, tmp_path / "fresh")
    state = {"optim": get_optimizer_state_dict(fresh_model, fresh)}
    dcp.load(state, checkpoint_id=str(tmp_path / "ck"))
    set_optimizer_state_dict(fresh_model, fresh, state["optim"])
    assert sorted(fresh.state_dict()["state"]) == [0, 1, 2, 3]
    fresh.close()


# -- 3. param groups save the implementation the update uses -------------------------------------


@device_modes
@pytest.mark.parametrize("foreach", [None, True])
def test_saved_fused_is_the_implementation_used_and_torch_continues_bit_for_bit(tmp_path: Path, foreach: bool | None) -> None:
    model, reference = _convnet(), _convnet()
    opt, ref_opt = _tiered(model, tmp_path, foreach=foreach), _adamw(reference, fused=not foreach, foreach=foreach)
    _train(model, opt, 2)
    _train(reference, ref_opt, 2)
    saved = opt.state_dict()
    assert saved["param_groups"][0]["fused"] is (not foreach)
    loaded = _adamw(model)  # torch's defaults: the saved choice replaces them
    loaded.load_state_dict(saved)
    opt.close()
    _train(model, loaded, 3, seed=2)
    _train(reference, ref_opt, 3, seed=2)
    assert _same(model, reference)


# -- 4. the memory report says what is stored ----------------------------------------------------------


@device_modes
def test_memory_report_says_what_each_setting_stores(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(torch.bfloat16)
    opt = _tiered(model, tmp_path, host="256KiB", state_precision="8bit", master_weights="lossless")
    report = opt.memory_report()
    text = str(report)
    assert "fp32 master + moments" not in text
    assert "low 16 bits of the master" in text and "8-bit moments" in text
    assert report.state_contents == {"low 16 bits of the master + 8-bit moments": 64 * 64 * 2 + 128}
    opt.close()
    plain = _tiered(model, tmp_path / "plain", host="256KiB")
    assert "(fp32 master + fp32 moments)" in str(plain.memory_report())
    plain.close()


# -- 5-7. small wording and files ---------------------------------------------------------------------


def test_unopened_sync_store_says_how_to_open_it() -> None:
    store = SyncTierStore([HostTier("1MiB")])
    with pytest.raises(StoreClosedError, match=r"with SyncTierStore\(\.\.\.\)"):
        store.put("k", torch.zeros(4))


def test_demo_says_the_final_loss_is_the_last_tenths_mean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--steps", "20", "--layers", "1", "--dim", "32", "--seq", "16", "--vocab", "32", "--batch", "2",
            "--host-capacity", "512KiB", "--root", str(tmp_path / "store"), "--compare"]
    assert cli_main(args) == 0
    assert "final loss (mean of the last 2 steps)" in capsys.readouterr().out


def test_tuning_file_is_private_and_its_queue_depth_bounded_by_the_threads_given(tmp_path: Path) -> None:
    path = save_tuning(tmp_path, IOSettings(chunk_size=1 << 20, io_threads=16, queue_depth=8))
    assert path.name == TUNING_FILE and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text())["settings"]["queue_depth"] == 8
    disk = DiskTier(tmp_path, "1MiB", io_threads=2)
    assert (disk.io_threads, disk.queue_depth) == (2, 2)
    assert disk.io_settings.sources["queue_depth"] == "tuning file, capped at io_threads"
    assert DiskTier(tmp_path, "1MiB", io_threads=2, queue_depth=4).queue_depth == 4  # asked for: kept
    assert DiskTier(tmp_path, "1MiB").queue_depth == 8
