"""Review of the distributed optimizer and its streaming DCP checkpoints (``tierstore.optim.dcp``):
each test here failed before the fix it names.

- A streaming save reads each parameter's state from the store once, whatever order the writer
  asks for its tensors in (DCP's overlapping loader, used wherever CUDA is available, sorts them
  by size: every ``step`` scalar first, which re-read every parameter's whole state).
- A streaming load that fails part-way loses nothing: each parameter holds either its loaded
  state or its state from before the call (the step counts of the parameters not yet loaded
  were cleared up front, so their moments were silently restarted from zero); the same for
  ``load_state_dict``.
- The sharded step's flags and norms cross on a device the group's backend serves (CPU tensors
  failed every step under ``init_process_group("nccl")`` alone); a GPU test runs the step there.
- ``rank_summary`` of a group without global rank 0 gives its table on the group's first rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan
from torch.futures import Future

import tierstore.optim.dcp as dcp_module
from tierstore.optim import TieredAdamW, load_optimizer, save_optimizer
from tierstore.optim.dcp import StreamingFileSystemWriter

LR = 1e-2


def base_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def train(model: torch.nn.Module, opt: Any, steps: int, seed: int) -> None:
    data = torch.randn(steps, 4, 16, generator=torch.Generator().manual_seed(seed))
    for x in data:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def tiered(model: torch.nn.Module) -> TieredAdamW:
    return TieredAdamW(model.parameters(), lr=LR, fused=True, min_offload_numel=64)


def snapshot(opt: TieredAdamW, model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class SizeSortedWriter(StreamingFileSystemWriter):
    """Asks for a file's tensors smallest first, as DCP's ``_OverlappingCpuLoader`` does on any
    machine where CUDA is available."""

    def write_data(self, plan: SavePlan, planner: Any) -> Future[Any]:
        import dataclasses

        from torch.distributed.checkpoint.filesystem import _item_size

        items = sorted(plan.items, key=lambda item: _item_size(item) if item.tensor_data is not None else 0)
        return super().write_data(dataclasses.replace(plan, items=items), planner)


def _fail_third_load(monkeypatch: pytest.MonkeyPatch, module: Any) -> None:
    """The third parameter ``module`` loads into the tiers fails as a full disk would."""
    calls = 0
    real = module.adam_load_entry

    async def failing(optimizer: Any, slot: Any, entry: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError(28, "No space left on device (injected)")
        await real(optimizer, slot, entry)

    monkeypatch.setattr(module, "adam_load_entry", failing)


@pytest.mark.device_modes
def test_streaming_save_reads_each_parameter_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device_mode: str) -> None:
    model = base_model()
    opt = tiered(model)
    train(model, opt, 2, seed=1)
    reads: list[int] = []
    real = dcp_module.adam_entry

    async def counting(optimizer: Any, slot: Any) -> Any:
        reads.append(slot.index)
        return await real(optimizer, slot)

    monkeypatch.setattr(dcp_module, "adam_entry", counting)
    path = tmp_path / "ckpt"
    save_optimizer(opt, path, model, storage_writer=SizeSortedWriter(path, buffer_bytes=1 << 20))
    params = len(list(model.parameters()))
    assert sorted(reads) == list(range(params)), f"state read per parameter: {reads}"
    # and the checkpoint is right: it loads back to the same state
    monkeypatch.undo()
    copy = base_model()
    with torch.no_grad():
        for p, q in zip(copy.parameters(), model.parameters(), strict=True):
            p.copy_(q)
    loaded = tiered(copy)
    load_optimizer(loaded, path, copy)
    assert all(same(a, b) for a, b in zip(snapshot(loaded, copy), snapshot(opt, model), strict=True))
    opt.close()
    loaded.close()


@pytest.mark.device_modes
def test_failed_streaming_load_loses_no_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device_mode: str) -> None:
    saved_model = base_model()
    saved_opt = tiered(saved_model)
    train(saved_model, saved_opt, 2, seed=1)
    save_optimizer(saved_opt, tmp_path / "ckpt", saved_model)
    checkpoint = snapshot(saved_opt, saved_model)
    saved_opt.close()

    model = base_model()
    opt = tiered(model)
    train(model, opt, 3, seed=2)  # its own state, at step 3
    before = snapshot(opt, model)
    _fail_third_load(monkeypatch, dcp_module)
    with pytest.raises(CheckpointException, match="No space left"):  # (DCP's wrapper of the rank's error)
        load_optimizer(opt, tmp_path / "ckpt", model, buffer_bytes=1)  # one parameter a pass
    after = snapshot(opt, model)
    for index, (now, old, new) in enumerate(zip(after, before, checkpoint, strict=True)):
        assert same(now, new) or same(now, old), f"parameter {index}: neither its old nor its loaded state: step {now['step']}"
    assert sum(same(now, new) for now, new in zip(after, checkpoint, strict=True)) == 2
    # loading again finishes the job
    monkeypatch.undo()
    load_optimizer(opt, tmp_path / "ckpt", model, buffer_bytes=1)
    assert all(same(a, b) for a, b in zip(snapshot(opt, model), checkpoint, strict=True))
    opt.close()


# -- collectives under NCCL alone -------------------------------------------------------------------
#
# ``init_process_group("nccl")`` (README's recipe on GPUs) registers no CPU backend, so the sharded
# step's flags and norms, made on the CPU, raised "No backend type associated with device type cpu"
# at every step. ``"cuda:gloo"`` registers gloo for CUDA tensors only: the same situation on a
# machine without a GPU, as far as choosing the device goes.

_NCCL_STEP = """
import os, torch, torch.distributed as dist
from tierstore.optim import TieredAdamW
from tierstore.optim.distributed import free_port
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5)).cuda()
ref, ours = model(), model()
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
opt = TieredAdamW(ours.parameters(), lr=1e-2, fused=True, min_offload_numel=64, process_group=True, max_grad_norm=0.05)
for step in range(3):
    x = torch.randn(4, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
    for m, o in ((ref, ref_opt), (ours, opt)):
        o.zero_grad()
        m(x).pow(2).mean().backward()
        if o is ref_opt:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        o.step()
assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), ours.parameters())), "differs from AdamW"
opt.close()
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.gpu
def test_sharded_step_under_nccl_alone() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _NCCL_STEP], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.device_modes
def test_failed_load_state_dict_loses_no_state(monkeypatch: pytest.MonkeyPatch, device_mode: str) -> None:
    """The same for ``load_state_dict`` (what ``set_optimizer_state_dict`` calls): a failure
    part-way leaves each parameter its loaded or its old state."""
    import tierstore.optim.checkpoint as checkpoint_module

    saved_model = base_model()
    saved_opt = tiered(saved_model)
    train(saved_model, saved_opt, 2, seed=1)
    state_dict = saved_opt.state_dict()
    checkpoint = snapshot(saved_opt, saved_model)
    saved_opt.close()
    model = base_model()
    opt = tiered(model)
    train(model, opt, 3, seed=2)
    before = snapshot(opt, model)
    _fail_third_load(monkeypatch, checkpoint_module)
    with pytest.raises(OSError, match="No space left"):
        opt.load_state_dict(state_dict)
    after = snapshot(opt, model)
    for index, (now, old, new) in enumerate(zip(after, before, checkpoint, strict=True)):
        assert same(now, new) or same(now, old), f"parameter {index}: neither its old nor its loaded state: step {now['step']}"
    opt.close()


_SUMMARY = """
import os, sys, torch, torch.distributed as dist
from tierstore.optim import TieredAdamW
from tierstore.optim.distributed import comm_device, rank_summary
rank = int(sys.argv[1])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=rank, world_size=2)
group = dist.new_group([1])  # a group without global rank 0
cuda_only = dist.new_group([0, 1], backend="cuda:gloo")  # as NCCL alone: no CPU backend
print(comm_device().type, comm_device(dist.new_group([0, 1], backend="cpu:gloo,cuda:gloo")).type, comm_device(cuda_only).type)
model = torch.nn.Linear(16, 8)
opt = TieredAdamW(model.parameters(), lr=1e-2, min_offload_numel=64)
model(torch.randn(4, 16)).sum().backward()
opt.step()
if rank == 1:
    print("summary" if rank_summary(opt, group) is not None else "none")
opt.close()
dist.destroy_process_group()
"""


def test_collective_devices_and_a_summary_of_a_group_without_rank_0() -> None:
    """The sharded step's collectives take tensors on a device the group's backend serves
    (``comm_device``: the CPU where a CPU backend is registered, else the accelerator; see
    above); ``rank_summary(opt, group)`` gives its table on the group's first rank: it looked
    for global rank 0, so a group without it had no summary anywhere."""
    import subprocess
    import sys

    from tierstore.optim.distributed import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _SUMMARY, str(r), port], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=60))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(proc.returncode == 0 for proc in procs), [err[-1500:] for _, err in outs]
    assert outs[0][0].split() == ["cpu", "cpu", "cuda"]
    assert outs[1][0].split() == ["cpu", "cpu", "cuda", "summary"]
