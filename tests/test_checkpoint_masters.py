"""Loading a checkpoint's master across ``master_weights`` settings, and entries that lack what
Adam needs. An fp32 master's checkpoint comes with weights rounded from it, a lossless one's
with weights truncated from it: either loads into either kind of optimizer exactly, in either
order of loading the model and the optimizer."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes


def _trained(master_weights: str, numel: int = 5003, steps: int = 4) -> tuple[dict[str, torch.Tensor], dict]:
    """A bf16 weight trained a few steps with ``master_weights``: the model's state, and the
    optimizer's (whose ``master`` is exact), some masters forced onto a rounding tie."""
    torch.manual_seed(0)
    model = torch.nn.Linear(numel, 1, bias=False).bfloat16()
    opt = TieredAdamW(model.parameters(), lr=1e-2, master_weights=master_weights, offload="host")
    for _ in range(steps):
        model.weight.grad = torch.randn_like(model.weight)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    opt.close()
    master = saved["state"][0]["master"].reshape(-1)
    # Ties (a low half of exactly 0x8000) round to the even high half: up from an odd one only.
    words = master.view(torch.int32)
    words[::97] = (words[::97] & -65536) | 0x8000
    weight = master.bfloat16() if master_weights == "fp32" else (words & -65536).view(torch.float32).bfloat16()
    return {"weight": weight.reshape(1, numel)}, saved


def _resumed(model_state: dict, saved: dict, master_weights: str, optimizer_first: bool, **kwargs: object) -> tuple[torch.nn.Linear, TieredAdamW]:
    model = torch.nn.Linear(model_state["weight"].shape[1], 1, bias=False).bfloat16()
    opt = TieredAdamW(model.parameters(), lr=1e-2, master_weights=master_weights, offload="host", **kwargs)  # type: ignore[arg-type]
    if optimizer_first:
        opt.load_state_dict(copy.deepcopy(saved))
        model.load_state_dict(model_state)
    else:
        model.load_state_dict(model_state)
        opt.load_state_dict(copy.deepcopy(saved))
    return model, opt


@pytest.mark.parametrize("optimizer_first", [False, True])
@pytest.mark.parametrize(("saved_with", "loaded_into"), [("fp32", "lossless"), ("lossless", "fp32"), ("lossless", "lossless")])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_master_loads_exactly_across_master_weights(device_mode: str, saved_with: str, loaded_into: str, optimizer_first: bool,
                                                      chunked: bool) -> None:
    """An fp32 master's checkpoint loaded into a lossless master lost one bf16 step on about half
    the elements (the rounded weight taken as the master's high half); a lossless checkpoint
    loaded into an fp32 master restarted from the weight with a warning blaming the user."""
    model_state, saved = _trained(saved_with)
    master = saved["state"][0]["master"].clone()
    extra = {"chunk_bytes": 4096} if chunked else {}
    model, opt = _resumed(model_state, saved, loaded_into, optimizer_first, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(opt.state_dict()["state"][0]["master"].view(torch.int32), master.view(torch.int32))
        model.weight.grad = torch.zeros_like(model.weight)
        opt.param_groups[0]["lr"] = 0.0
        opt.step()  # (lr 0, zero gradient: the master stays what was saved)
        assert torch.equal(opt.state_dict()["state"][0]["master"].view(torch.int32), master.view(torch.int32))
    expected = master.reshape(-1).view(torch.int32).bitwise_and(-65536).view(torch.float32) if loaded_into == "lossless" else master.reshape(-1)
    assert torch.equal(model.weight.detach().reshape(-1), expected.bfloat16())
    opt.close()


def test_a_lossless_master_whose_weight_is_not_the_checkpoints_restarts_with_a_warning(device_mode: str) -> None:
    model_state, saved = _trained("fp32")
    moved = {"weight": (model_state["weight"].float() * 1.5).bfloat16()}
    model, opt = _resumed(moved, saved, "lossless", optimizer_first=False)
    model.weight.grad = torch.zeros_like(model.weight)
    opt.param_groups[0]["lr"] = 0.0
    with pytest.warns(RuntimeWarning, match="neither the loaded master truncated"):
        opt.step()
    master = opt.state_dict()["state"][0]["master"].reshape(-1)
    assert torch.equal(master, moved["weight"].reshape(-1).float())  # (from the weight, low halves zero)
    opt.close()


@pytest.mark.parametrize("master_weights", ["fp32", "lossless"])
def test_each_master_that_restarts_from_its_weight_is_named(device_mode: str, master_weights: str) -> None:
    """A lossless master warned once per optimizer, naming the first parameter only: the others
    restarted silently. Each one that restarts is named, once (as an fp32 master's is), also
    when its state is paged in chunks."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (300, 300, 5000)]
    opt = TieredAdamW(params, lr=1e-2, master_weights=master_weights, offload="host")
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    opt.close()
    with torch.no_grad():
        params[1].add_(1.0)  # (no longer the checkpoint's weights)
        params[2].add_(1.0)
    again = TieredAdamW(params, lr=1e-2, master_weights=master_weights, offload="host", chunk_bytes=4096)
    for load in range(2):  # (a second load restarts them again: warned again)
        again.load_state_dict(saved)
        for step in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                again.step()
            named = sorted(str(w.message).split(":")[0] for w in caught if issubclass(w.category, RuntimeWarning))
            expected = ["parameter 0", "parameter 1", "parameter 2"] if load else ["parameter 1", "parameter 2"]
            assert named == (expected if step == 0 else []), [str(w.message) for w in caught]
    again.close()


@pytest.mark.parametrize("missing", ["step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"])
def test_an_entry_lacking_what_adam_needs_is_refused_and_nothing_changes(device_mode: str, missing: str) -> None:
    """A missing ``step`` or moment was filled with zeros: the next update 2x (step) to 36x
    (``exp_avg_sq``) too large, where torch's AdamW raises ``KeyError``."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(300))
    opt = TieredAdamW([weight], lr=1e-2, amsgrad=True, offload="host")
    for _ in range(3):
        weight.grad = torch.randn(300)
        opt.step()
    before = copy.deepcopy(opt.state_dict())
    broken = copy.deepcopy(before)
    del broken["state"][0][missing]
    broken["param_groups"][0]["lr"] = 0.5
    with pytest.raises(KeyError, match=f"parameter 0 lacks '{missing}'"):
        opt.load_state_dict(broken)
    after = opt.state_dict()
    assert after["param_groups"][0]["lr"] == 1e-2
    assert all(torch.equal(after["state"][0][k], v) for k, v in before["state"][0].items())
    weight.grad = torch.randn(300)
    opt.step()  # (still usable)
    opt.close()


@pytest.mark.parametrize("precision", ["fp32", "8bit"])
@pytest.mark.parametrize("name", ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"])
def test_an_entry_of_the_wrong_size_is_refused_before_anything_loads(device_mode: str, precision: str, name: str) -> None:
    """A state dict whose last parameter's entry has the wrong number of elements (another
    model's) was refused with ``ValueError`` only once the parameters before it had loaded: the
    optimizer was left half its own state, half the checkpoint's (a tryout). Now every entry's
    size is checked first: nothing changes."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (100, 5000)]
    opt = TieredAdamW(params, lr=1e-2, amsgrad=True, state_precision=precision, offload="host")
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    broken = copy.deepcopy(opt.state_dict())
    broken["state"][0]["step"] = torch.tensor(7.0)
    broken["state"][0]["exp_avg"] = broken["state"][0]["exp_avg"] * 2
    broken["state"][1][name] = torch.zeros(4999)
    broken["param_groups"][0]["lr"] = 0.5
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"parameter 1: saved '{name}' has 4999 elements, the parameter 5000.*nothing was loaded"):
        opt.load_state_dict(broken)
    after = opt.state_dict()
    assert after["param_groups"][0]["lr"] == 1e-2
    for i in range(2):
        assert all(torch.equal(after["state"][i][k], v) for k, v in before["state"][i].items()), i
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # (still usable)
    opt.close()


def _lr0_zero_grad_step(model: torch.nn.Linear, opt: TieredAdamW) -> None:
    model.weight.grad = torch.zeros_like(model.weight)
    opt.param_groups[0]["lr"] = 0.0
    opt.step()


def _master_bits(opt: TieredAdamW) -> torch.Tensor:
    return opt.state_dict()["state"][0]["master"].reshape(-1).view(torch.int32)


def test_a_read_before_the_weights_load_decides_nothing(device_mode: str) -> None:
    """A read of the state (``opt.state[p]``) before the model's weights were loaded (through
    ``p.data``, which no version counter sees) decided "neither" for good: the first update warned
    and restarted every master from the weight."""
    model_state, saved = _trained("fp32")
    model = torch.nn.Linear(5003, 1, bias=False).bfloat16()
    opt = TieredAdamW(model.parameters(), lr=1e-2, master_weights="lossless", offload="host")
    opt.load_state_dict(copy.deepcopy(saved))
    assert opt.state[model.weight]["exp_avg"].shape == model_state["weight"].shape
    with torch.no_grad():
        model.weight.data.copy_(model_state["weight"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _lr0_zero_grad_step(model, opt)
    assert torch.equal(_master_bits(opt), saved["state"][0]["master"].reshape(-1).view(torch.int32))
    opt.close()


def test_a_later_load_without_state_forgets_the_earlier_master(device_mode: str) -> None:
    model_state, saved = _trained("fp32")
    model = torch.nn.Linear(5003, 1, bias=False).bfloat16()
    model.load_state_dict(model_state)
    opt = TieredAdamW(model.parameters(), lr=1e-2, master_weights="lossless", offload="host")
    opt.load_state_dict(copy.deepcopy(saved))
    opt.load_state_dict({"state": {}, "param_groups": copy.deepcopy(saved["param_groups"])})
    before = model.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _lr0_zero_grad_step(model, opt)
    assert torch.equal(model.weight.detach(), before)  # (19 weights moved a bf16 step: the old master's ties)
    opt.close()


def test_a_first_step_that_failed_takes_the_master_back_when_retried(device_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierstore.errors import StepIncompleteError
    from tierstore.optim.pipeline import UpdatePipeline

    model_state, saved = _trained("fp32")
    model = torch.nn.Linear(5003, 1, bias=False).bfloat16()
    model.load_state_dict(model_state)
    opt = TieredAdamW(model.parameters(), lr=1e-2, master_weights="lossless", offload="host")
    opt.load_state_dict(copy.deepcopy(saved))
    real, failures = UpdatePipeline.grad_for_update, [OSError("injected: the gradient could not be read")]

    def fails_once(self: UpdatePipeline, slot: object) -> object:
        if failures:
            raise failures.pop()
        return real(self, slot)  # type: ignore[arg-type]

    monkeypatch.setattr(UpdatePipeline, "grad_for_update", fails_once)
    with pytest.raises(StepIncompleteError, match="injected"):
        _lr0_zero_grad_step(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # (the retry: half the masters were off a bf16 step)
    assert torch.equal(_master_bits(opt), saved["state"][0]["master"].reshape(-1).view(torch.int32))
    opt.close()


_DTENSOR_ENTRY = r"""
import copy, os, socket, sys, torch, warnings
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from tierstore.optim import TieredAdamW
warnings.simplefilter("ignore")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(n)) for n in (100, 5000)]
opt = TieredAdamW(params, lr=1e-2, offload="host")
for _ in range(3):
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
broken = copy.deepcopy(opt.state_dict())
broken["state"][0]["exp_avg"] = broken["state"][0]["exp_avg"] * 2
# global shape (5000,), local part 4999 elements: what _local takes, and refuses
broken["state"][1]["exp_avg"] = DTensor.from_local(torch.zeros(4999), mesh, [Shard(0)], run_check=False, shape=(5000,), stride=(1,))
before = opt.state_dict()["state"][0]["exp_avg"].clone()
try:
    opt.load_state_dict(broken)
    print("LOADED")
except ValueError as e:
    print("REFUSED", "nothing was loaded" in str(e))
print("UNCHANGED", torch.equal(before, opt.state_dict()["state"][0]["exp_avg"]))
opt.close()
dist.destroy_process_group()
"""


def test_a_dtensor_entry_is_checked_by_the_size_loading_would_take() -> None:
    """A reviewer: the pre-check took a DTensor by its global size, and loading by its local
    part: one of the right global size but another local size passed the check and was refused
    after parameter 0 had loaded, with the message saying nothing was."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _DTENSOR_ENTRY], capture_output=True, text=True, timeout=300)
    assert "REFUSED True" in result.stdout and "UNCHANGED True" in result.stdout, result.stdout + result.stderr[-2000:]


_UNEVEN_SHARDS = r"""
import torch, torch.distributed as dist, warnings
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from tierstore.optim import TieredAdamW
warnings.simplefilter("ignore")
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)  # rank 0 of 4, no peers
mesh = init_device_mesh("cpu", (4,))

def param(shape, rows):
    local = torch.randn(rows, *shape[1:])
    return torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=torch.empty(shape).stride()))

torch.manual_seed(0)
params = [param((8, 4), 2), param((10, 3), 3)]
opt = TieredAdamW(params, lr=1e-2, offload="host")
for _ in range(2):
    for p in params:
        p.grad = DTensor.from_local(torch.randn_like(p._local_tensor), mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
    opt.step()
saved = opt.state_dict()
before = saved["state"][0]["exp_avg"]._local_tensor.clone()
rep = lambda shape: DTensor.from_local(torch.ones(shape), mesh, [Replicate()], run_check=False)
broken = {"param_groups": saved["param_groups"], "state": {
    0: {"step": torch.tensor(7.0), "exp_avg": rep((8, 4)) * 5, "exp_avg_sq": rep((8, 4))},
    1: {"step": torch.tensor(7.0), "exp_avg": rep((5, 6)), "exp_avg_sq": rep((5, 6))}}}  # as many elements, other shape
try:
    opt.load_state_dict(broken)
    print("LOADED")
except ValueError as e:
    print("REFUSED", "nothing was loaded" in str(e))
print("UNCHANGED", torch.equal(before, opt.state_dict()["state"][0]["exp_avg"]._local_tensor))
opt.close()
"""


def test_a_dtensor_of_another_shape_is_refused_before_a_shard_loads() -> None:
    """A reviewer: a replicated DTensor of as many elements as a sharded parameter but another
    shape passed the pre-check by its global size; redistributed to the parameter's shards
    (uneven over 4 ranks) it had another local size, refused after parameter 0 had loaded."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _UNEVEN_SHARDS], capture_output=True, text=True, timeout=300)
    assert "REFUSED True" in result.stdout and "UNCHANGED True" in result.stdout, result.stdout + result.stderr[-2000:]
