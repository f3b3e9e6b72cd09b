"""How a step's updates are grouped: many parameters in one bucket on a host-only store, and a
chunked parameter's chunks updated in runs (one math call for several chunks), exact against torch's AdamW in both device modes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tierstore import DiskTier, HostTier, TierStore
from tierstore.optim import TieredAdamW

pytestmark = pytest.mark.device_modes  # tests taking ``device_mode`` run in both modes


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 4000, (64,), generator=generator)
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(4000, 33), torch.nn.Linear(33, 16))


def _updates(opt: TieredAdamW) -> list[str]:
    return [name for name, track, *_ in opt.last_timeline() if track == "host update"]


@pytest.mark.parametrize("where", ["host", "disk"])
def test_chunk_runs_are_exact_and_fewer_than_chunks(tmp_path: Path, device_mode: str, where: str) -> None:
    reference, paged = _model(), _model()
    expected = torch.optim.AdamW(reference.parameters(), fused=True)
    options: dict = {"chunk_bytes": "256KiB", "fused": True}
    if where == "disk":
        options.update(offload="disk", disk_root=tmp_path / "state", host_capacity="4MiB")
    opt = TieredAdamW(paged.parameters(), **options)
    try:
        chunks = opt._slots[0].chunks
        assert chunks is not None and len(chunks) >= 3
        assert chunks[-1].numel < chunks[0].numel  # a short last chunk
        _steps(reference, expected, 3)
        _steps(paged, opt, 3)
        for got, want in zip(paged.parameters(), reference.parameters(), strict=True):
            assert torch.equal(got, want)
        runs = [name for name in _updates(opt) if name.startswith(f"update {opt._slots[0].index}/")]
        if device_mode == "plain":  # all state resident: one math call (tierstore.optim.resident)
            assert _updates(opt) == [f"resident update x{len(opt._slots)}"]
        else:
            assert 1 <= len(runs) < len(chunks)  # several chunks a math call
    finally:
        opt.close()


def test_many_parameters_on_a_host_store_are_exact(device_mode: str) -> None:
    torch.manual_seed(0)
    reference = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(40)))
    paged = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(40)))
    paged.load_state_dict(reference.state_dict())
    expected = torch.optim.AdamW(reference.parameters(), fused=True)
    opt = TieredAdamW(paged.parameters(), fused=True, min_offload_numel=0)
    try:
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            for model, optimizer in ((reference, expected), (paged, opt)):
                model(x).square().mean().backward()
                if step == 1:  # one gradient dropped: that parameter is not updated, as in torch
                    model[3].bias.grad = None
                optimizer.step()
                optimizer.zero_grad()
        for got, want in zip(paged.parameters(), reference.parameters(), strict=True):
            assert torch.equal(got, want)
    finally:
        opt.close()


# -- the update order alternates each step (state on disk) --------------------------------------------


class _Recording:
    """An eviction policy that records the keys it gives up (those of the host tier go to disk)."""

    def __init__(self, inner: object, victims: list[str]) -> None:
        self._inner, self._victims = inner, victims

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def victim(self, evictable: object = None) -> str | None:
        key = self._inner.victim(evictable)  # type: ignore[attr-defined]
        if key is not None:
            self._victims.append(key)
        return key


def _disk_store(root: Path, host: str, victims: list[str]) -> TierStore:
    from policies import MIN, ScheduleLearned

    schedule = ScheduleLearned()
    tiers = [HostTier(host), DiskTier(root, "64MiB", durable=False)]
    return TierStore(tiers, eviction=lambda: _Recording(MIN(schedule), victims), prefetch=schedule)


def _chunk_runs(opt: TieredAdamW) -> list[tuple[int, int, int]]:
    """(parameter, first chunk, last chunk) of each run of chunks last step, in math order."""
    runs = []
    for name in _updates(opt):
        if "/c" in name:
            index, chunks = name.removeprefix("update ").split("/c")
            first, last = chunks.split("-")
            runs.append((int(index), int(first), int(last)))
    return runs


def _alternating(tmp_path: Path) -> list[str]:
    """Five steps with most state on disk, bit for bit against torch's fused AdamW; the order
    of parameters and of a parameter's chunks alternates. Returns the keys pushed out of the
    host tier."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(4)))
    paged = torch.nn.Sequential(*(torch.nn.Linear(128, 128) for _ in range(4)))
    paged.load_state_dict(reference.state_dict())
    expected = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    victims: list[str] = []
    store = _disk_store(tmp_path / "disk", "320KiB", victims)  # 0.8 MB of state: most of it on disk
    opt = TieredAdamW(paged.parameters(), lr=1e-2, fused=True, store=store, chunk_bytes="48KiB")
    try:
        orders = []
        for step in range(5):
            x = torch.randn(16, 128, generator=torch.Generator().manual_seed(step))
            for model, optimizer in ((reference, expected), (paged, opt)):
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            runs = _chunk_runs(opt)
            assert runs, "the weights are paged in chunks"
            orders.append(runs)
            for got, want in zip(paged.parameters(), reference.parameters(), strict=True):
                assert torch.equal(got, want), f"step {step}"
        for step, runs in enumerate(orders):
            params = list(dict.fromkeys(index for index, _, _ in runs))
            chunks_rise = all(first <= last for _, first, last in runs)
            if step % 2 == 0:  # arrival order (backward: the last layer first), chunks first to last
                assert params == sorted(params, reverse=True) and chunks_rise, (step, runs)
            else:  # reversed
                assert params == sorted(params) and all(first >= last for _, first, last in runs), (step, runs)
        assert any(not key.endswith("/grad") for key in victims)  # the state did page through the disk
        # A chunk's gradient (across a link: copied into a scratch buffer for its update) never
        # went to the disk.
        assert not [key for key in victims if "/c" in key and key.endswith("/grad")]
        assert opt.store.prefetch_policy.period == 2  # type: ignore[attr-defined]
        return victims
    finally:
        opt.close()
        store_close(store)


def test_the_order_alternates_exactly_with_state_on_disk(tmp_path: Path, device_mode: str) -> None:
    _alternating(tmp_path)


def test_whole_gradients_that_fit_never_reach_the_disk(tmp_path: Path, device_mode: str) -> None:
    victims = _alternating(tmp_path)
    assert not [key for key in victims if key.endswith("/grad")]


def store_close(store: TierStore) -> None:
    from tierstore.sync import run

    if store.is_open:
        run(store.aclose(flush=False))


def _learned_alternation(ahead: int) -> tuple[Any, list[str], list[str]]:
    """A ``ScheduleLearned`` shown a forward, backward, forward order of six keys (a step each),
    with the two orders."""
    from policies import ScheduleLearned

    policy = ScheduleLearned(ahead=ahead, max_keys=10)
    forward, backward = list("abcdef"), list("fedcba")
    for phase in (forward, backward, forward):
        for key in phase:
            policy.on_access(key, 1, "host", False)
        policy.on_step()
    return policy, forward, backward


def test_the_schedule_learns_an_order_that_alternates() -> None:
    policy, forward, backward = _learned_alternation(ahead=2)
    assert policy.period == 2 and policy.schedule == backward  # the coming phase: reversed
    changes = policy.changes  # (the first reversal was a change; it was learned from there)
    for key in backward[:5]:
        policy.on_access(key, 1, "host", True)
    assert [key for key, _ in policy.suggest()] == ["a", "b"]  # the end of this phase, then the next's start
    assert policy.next_use("b") < policy.next_use("c") < policy.next_use("f")  # f: used first, next at the end
    policy.on_access("a", 1, "host", True)
    policy.on_step()
    assert policy.period == 2 and policy.schedule == forward and policy.changes == changes == 1


def test_a_finished_phase_looks_ahead_to_the_next_one_not_back_to_its_own_start() -> None:
    """Once the last access of a phase is seen (before ``on_step``), the schedule is at its end:
    what comes next is the following phase (reversed), not this phase again from its start.
    Wrapping round here prefetched the state just updated and evicted what the next step
    needs first."""
    policy, forward, backward = _learned_alternation(ahead=3)
    for key in backward:  # the whole phase, no on_step yet
        policy.on_access(key, 1, "host", True)
    assert [key for key, _ in policy.suggest()] == ["a", "b", "c"]  # the next phase's start
    assert policy.next_use("a") < policy.next_use("c") < policy.next_use("f")  # f: updated first here, last next
