"""A run that added parameter groups as it went, resumed from its named namespace and rebuilt
the same way (the constructor with the first group, ``add_param_group`` for the others). The
constructor saw fewer parameters than were saved and started every one of them over, its
state deleted; now the saved state waits for the groups added before the first ``step()``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tierstore import DiskTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes


def sync_store(folder: Path) -> SyncTierStore:
    """A host tier smaller than the state: it pages to disk and back."""
    return SyncTierStore([HostTier("16KiB"), DiskTier(folder, "64MiB", chunk_size="64KiB")]).open()


def models(seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed)
    return torch.nn.Linear(8, 32), torch.nn.Linear(32, 4)


def train(head: torch.nn.Module, body: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        data = torch.Generator().manual_seed(step)
        opt.zero_grad()
        body(torch.tanh(head(torch.randn(8, 8, generator=data)))).pow(2).mean().backward()
        opt.step()


def make(params: list[torch.nn.Parameter], store: SyncTierStore) -> TieredAdamW:
    return TieredAdamW(params, lr=1e-2, store=store, namespace="run", min_offload_numel=1)


def first_run(folder: Path) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module, torch.nn.Module, torch.optim.Optimizer]:
    """Two steps with the first group, a second group added, two more; closed. Returns the
    models, and torch's twins trained alongside with its optimizer (the reference)."""
    head, body = models()
    twins = copy.deepcopy(head), copy.deepcopy(body)
    reference = torch.optim.AdamW(twins[0].parameters(), lr=1e-2, fused=True)
    store = sync_store(folder)
    opt = make(list(head.parameters()), store)
    body.requires_grad_(False)
    twins[1].requires_grad_(False)
    train(head, body, opt, range(2))
    train(*twins, reference, range(2))
    body.requires_grad_(True)
    twins[1].requires_grad_(True)
    opt.add_param_group({"params": list(body.parameters()), "lr": 3e-3})
    reference.add_param_group({"params": list(twins[1].parameters()), "lr": 3e-3})
    train(head, body, opt, range(2, 4))
    train(*twins, reference, range(2, 4))
    opt.close()
    store.close()
    return head, body, *twins, reference


def assert_same(models: tuple[torch.nn.Module, ...], twins: tuple[torch.nn.Module, ...]) -> None:
    for model, twin in zip(models, twins, strict=True):
        for a, b in zip(model.parameters(), twin.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def assert_fresh(opt: torch.optim.Optimizer, param: torch.nn.Parameter) -> None:
    """``param`` has no state carried from an earlier run."""
    state = opt.state[param]
    assert not state or (float(state["step"]) == 0 and not state["exp_avg"].any()), state


@pytest.mark.parametrize("closed_first", [False, True])
def test_a_group_added_again_continues_from_its_saved_state(tmp_path: Path, device_mode: str, closed_first: bool) -> None:
    """``closed_first``: a run in between closed before adding the group (an evaluation, never
    stepped); it keeps the group's state for the next."""
    head, body, twin_head, twin_body, reference = first_run(tmp_path / "store")
    store = sync_store(tmp_path / "store")
    if closed_first:
        make(list(head.parameters()), store).close()
    opt = make(list(head.parameters()), store)  # (no warning: the rest waits for its group)
    opt.add_param_group({"params": list(body.parameters()), "lr": 3e-3})
    train(head, body, opt, range(4, 7))
    train(twin_head, twin_body, reference, range(4, 7))
    assert_same((head, body), (twin_head, twin_body))
    opt.close()
    store.close()


def test_state_no_group_took_up_by_the_first_step_is_deleted_with_a_warning(tmp_path: Path, device_mode: str) -> None:
    head, body, twin_head, twin_body, reference = first_run(tmp_path / "store")
    store = sync_store(tmp_path / "store")
    opt = make(list(head.parameters()), store)
    keys_before = len(list(opt.namespace.keys()))
    body.requires_grad_(False)
    twin_body.requires_grad_(False)
    reference.param_groups.pop()  # (torch's twin: the head alone, its state as saved)
    with pytest.warns(UserWarning, match=r"holds optimizer state for 4 parameters; 2 were given .* parameters \[2, 3\] is deleted"):
        train(head, body, opt, range(4, 5))
    train(twin_head, twin_body, reference, range(4, 5))
    assert_same((head,), (twin_head,))  # (the head's state was taken up)
    assert len(list(opt.namespace.keys())) < keys_before
    opt.close()
    store.close()
    store = sync_store(tmp_path / "store")  # the next run finds the head's state alone, and no warning
    opt = make(list(head.parameters()), store)
    train(head, body, opt, range(5, 6))
    train(twin_head, twin_body, reference, range(5, 6))
    assert_same((head,), (twin_head,))
    opt.close()
    store.close()


def test_more_parameters_than_were_saved_still_start_over_at_construction(tmp_path: Path, device_mode: str) -> None:
    head, body = models()
    store = sync_store(tmp_path / "store")
    opt = make(list(head.parameters()), store)
    train(head, body, opt, range(1))
    opt.close()
    with pytest.warns(UserWarning, match="holds optimizer state for 2 parameters, not 4"):
        opt = make([*head.parameters(), *body.parameters()], store)
    opt.close()
    store.close()


def test_the_constructors_parameters_are_not_a_prefix_of_another_model(tmp_path: Path, device_mode: str) -> None:
    """A reviewer: a run of [a, b] resumed with [b] alone took a's state for b (same size), with
    no word until the first step. The saved groups are recorded; [b] is not the saved run's
    first group, so it starts over, with the warning, at construction."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(64))
    store = sync_store(tmp_path / "store")
    opt = make([a, b], store)
    for _ in range(2):
        a.grad, b.grad = torch.full_like(a, 5.0), torch.full_like(b, 1e-3)
        opt.step()
    opt.close()
    with pytest.warns(UserWarning, match=r"holds optimizer state for 2 parameters, not 1: .* its groups held \[2\] parameters, these \[1\]"):
        opt = make([b], store)
    assert_fresh(opt, b)
    opt.close()
    store.close()


@pytest.mark.parametrize("other", ["sizes", "count"])
def test_a_group_added_with_other_parameters_than_the_saved_one_starts_over(tmp_path: Path, device_mode: str, other: str) -> None:
    head, body, *_ = first_run(tmp_path / "store")
    store = sync_store(tmp_path / "store")
    opt = make(list(head.parameters()), store)
    if other == "sizes":  # (as many parameters, of other sizes)
        added, match = list(torch.nn.Linear(32, 8).parameters()), r"parameters \[2, 3\] is laid out for other settings"
    else:
        added, match = [body.weight], r"param group 1 has 1 parameter; the saved run's group 1 had 2: .* \[2, 3\] \(of its groups 1 to 1\) starts over"
    with pytest.warns(UserWarning, match=match):
        opt.add_param_group({"params": added})
    assert_fresh(opt, added[0])
    opt.close()
    store.close()


def test_a_resume_whose_chunks_changed_takes_the_added_groups_state(tmp_path: Path, device_mode: str) -> None:
    """A reviewer: with another host capacity the added group's state is re-chunked; its old
    keys, deleted by the relayout, were deleted again (KeyNotFoundError), the group refused with
    its step counts kept, and close() then failed and lost every count."""
    torch.manual_seed(0)
    head, body = torch.nn.Linear(8, 64), torch.nn.Linear(64, 512)  # (the body's state: 400 KiB, chunked)
    twins = copy.deepcopy(head), copy.deepcopy(body)
    reference = torch.optim.AdamW([*twins[0].parameters(), *twins[1].parameters()], lr=1e-2, fused=True)

    def optimizer(chunks: str) -> TieredAdamW:
        opt = TieredAdamW(head.parameters(), lr=1e-2, offload="disk", disk_root=tmp_path / "d", namespace="run",
                          host_capacity="4MiB", chunk_bytes=chunks, min_offload_numel=1)
        opt.add_param_group({"params": list(body.parameters())})
        return opt

    for chunks, steps in (("64KiB", range(2)), ("256KiB", range(2, 4)), ("64KiB", range(4, 5))):
        opt = optimizer(chunks)
        train(head, body, opt, steps)
        opt.close()
    train(*twins, reference, range(5))
    assert_same((head, body), twins)


def test_a_failed_load_keeps_the_saved_state_and_a_load_drops_it(tmp_path: Path, device_mode: str) -> None:
    """A reviewer: load_state_dict deleted the saved state of the groups still to come before
    torch refused the dict; and load_optimizer (DCP) kept it, so a group added after loading
    an older checkpoint took the state of a later run."""
    from tierstore.optim.dcp import load_optimizer, save_optimizer

    head, body, twin_head, twin_body, reference = first_run(tmp_path / "store")
    store = sync_store(tmp_path / "store")
    opt = make(list(head.parameters()), store)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        opt.load_state_dict(reference.state_dict())
    opt.add_param_group({"params": list(body.parameters()), "lr": 3e-3})
    train(head, body, opt, range(4, 5))
    train(twin_head, twin_body, reference, range(4, 5))
    assert_same((head, body), (twin_head, twin_body))
    alone = TieredAdamW(head.parameters(), lr=1e-2, offload="host")  # (a checkpoint of the head alone)
    save_optimizer(alone, tmp_path / "ckpt")
    alone.close()
    opt.close()
    store.close()
    store = sync_store(tmp_path / "store")
    opt = make(list(head.parameters()), store)
    load_optimizer(opt, tmp_path / "ckpt")
    opt.add_param_group({"params": list(body.parameters()), "lr": 3e-3})
    assert_fresh(opt, body.weight)  # (the loaded checkpoint had no group for it: it starts over)
    opt.close()
    store.close()



def test_an_empty_group_is_a_group_too(tmp_path: Path, device_mode: str) -> None:
    """A reviewer: a group added with no parameters skipped the check of its size, and the
    next group took the skipped group's saved state, without a word."""
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(4)) for _ in range(3))
    store = sync_store(tmp_path / "store")
    opt = make([a], store)
    opt.add_param_group({"params": [b]})
    opt.add_param_group({"params": [c]})
    a.grad, b.grad, c.grad = torch.full_like(a, 1.0), torch.full_like(b, 2.0), torch.full_like(c, 200.0)
    opt.step()
    opt.close()
    opt = make([a], store)
    with pytest.warns(UserWarning, match=r"param group 1 has 0 parameters; the saved run's group 1 had 1"):
        opt.add_param_group({"params": []})
    opt.add_param_group({"params": [c]})
    assert_fresh(opt, c)
    opt.close()
    store.close()


KILLED_IN_LOAD = """
import os, sys, torch
from tierstore import DiskTier, HostTier, SyncTierStore
from tierstore.optim import TieredAdamW
a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
store = SyncTierStore([HostTier("16KiB"), DiskTier(sys.argv[1], "64MiB", chunk_size="64KiB")]).open()
opt = TieredAdamW([a], lr=1e-2, store=store, namespace="run", min_offload_numel=1)
loaded = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.full((4,), 7.0), "exp_avg_sq": torch.ones(4)}},
          "param_groups": [{**opt.state_dict()["param_groups"][0], "params": [0]}]}
import tierstore.optim.adam as adam
written = adam.adam_load_state_dict


def killed(*args):  # (killed once the state is written, before the load returns)
    written(*args)
    store.flush()
    os._exit(9)


adam.adam_load_state_dict = killed
opt.load_state_dict(loaded)
"""


def test_a_run_killed_in_a_load_is_not_taken_for_a_closed_one(tmp_path: Path, device_mode: str) -> None:
    """A reviewer: with state waiting for groups, the saved step counts stayed in the store
    while load_state_dict wrote the loaded state; killed there, the next run adopted the
    loaded moments under the old counts, without a word."""
    import os
    import subprocess
    import sys

    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    store = sync_store(tmp_path / "store")
    opt = make([a], store)
    opt.add_param_group({"params": [b]})
    for _ in range(3):
        a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
        opt.step()
    opt.close()
    store.close()
    env = {**os.environ, "TIERSTORE_EMULATE_DEVICE": "1" if device_mode == "emulated" else "0"}
    done = subprocess.run([sys.executable, "-c", KILLED_IN_LOAD, str(tmp_path / "store")], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 9, done.stderr[-2000:]
    store = sync_store(tmp_path / "store")
    with pytest.warns(UserWarning, match="no step counts"):
        opt = make([a], store)
    assert_fresh(opt, a)
    opt.close()
    store.close()
