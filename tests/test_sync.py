"""The blocking facade: plain scripts, other threads, autograd hooks, and fork."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tierstore import DeviceTier, DiskTier, HostTier, KeyNotFoundError, SyncTierStore
from tierstore.sync import run


def make(tmp_path: Path) -> SyncTierStore:
    return SyncTierStore([DeviceTier("cpu", "64KiB"), HostTier("128KiB"), DiskTier(tmp_path / "d", "16MiB")])


def test_the_verbs(tmp_path: Path) -> None:
    with make(tmp_path) as store:
        store.put("a", torch.arange(4.0))
        assert "a" in store and store.keys() == ["a"] and len(store) == 1
        assert torch.equal(store.get("a"), torch.arange(4.0))
        with store.hold("a", write=True) as buffer:
            buffer += 1
        assert torch.equal(store.get("a", "host"), torch.arange(4.0) + 1)
        result = store.prefetch(["a"], "device").wait()
        assert result.already_there == ["a"] or result.fetched == ["a"]
        assert store.info("a")["shape"] == (4,)
        assert store.stats()["keys"] == 1
        store.mark_step()
        store.delete("a")
        with pytest.raises(KeyNotFoundError):
            store.get("a")


def test_an_error_inside_hold_releases_it(tmp_path: Path) -> None:
    with make(tmp_path) as store:
        store.put("a", torch.zeros(2))
        with pytest.raises(ValueError), store.hold("a"):
            raise ValueError("boom")
        store.delete("a")  # would raise EntryHeldError if the hold had leaked


def test_many_threads_at_once(tmp_path: Path) -> None:
    with make(tmp_path) as store:
        def work(i: int) -> bool:
            value = torch.full((1024,), float(i))
            store.put(f"k{i}", value)
            return torch.equal(store.get(f"k{i}"), value)

        with ThreadPoolExecutor(8) as pool:
            assert all(pool.map(work, range(64)))
        assert len(store) == 64


def test_usable_from_autograd_hooks(tmp_path: Path) -> None:
    with make(tmp_path) as store:
        param = torch.nn.Parameter(torch.randn(16))
        seen: list[str] = []

        def hook(p: torch.Tensor) -> None:
            store.put("grad", p.grad)
            seen.append(threading.current_thread().name)

        param.register_post_accumulate_grad_hook(hook)
        (param * 3).sum().backward()
        assert seen and torch.equal(store.get("grad"), torch.full((16,), 3.0))


def test_calling_from_the_loop_thread_is_an_error(tmp_path: Path) -> None:
    with make(tmp_path) as store:

        async def inner() -> None:
            store.get("x")

        with pytest.raises(RuntimeError, match="loop thread"):
            run(inner())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_loop(tmp_path: Path) -> None:
    with make(tmp_path) as store:
        store.put("a", torch.ones(1))
        pid = os.fork()
        if pid == 0:  # child: the parent's loop thread is gone; a new store works
            code = 1
            try:
                with SyncTierStore([HostTier("1MiB")]) as child:
                    child.put("b", torch.ones(2))
                    code = 0 if torch.equal(child.get("b"), torch.ones(2)) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert torch.equal(store.get("a"), torch.ones(1))
