"""A live store whose eviction policy breaks the protocol fails the request with a clear
``PolicyError`` and stays usable: a policy naming a key the tier does not hold (one it never
had, or one it returned before without forgetting it) kept the loop asking it forever, the
store hung with it (every verb, and close)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

_SCENARIO = textwrap.dedent("""
    import sys, torch
    from tierstore import SyncTierStore, HostTier, DiskTier, PolicyError
    mode, root = sys.argv[1], sys.argv[2]

    class Broken:
        name = "broken"
        def __init__(self): self.keys = []
        def on_insert(self, key, nbytes): self.keys.append(key)
        def on_hit(self, key): pass
        def on_remove(self, key):
            if key in self.keys: self.keys.remove(key)
        def victim(self, evictable=None):
            if mode == "unknown": return "never-put"
            return self.keys[0] if self.keys else None  # (returned, never forgotten)
        def reset(self): self.keys.clear()

    with SyncTierStore([HostTier("64KiB"), DiskTier(root, "16MiB")], eviction=Broken) as store:
        put = 0
        try:
            for put in range(40):
                store.put(f"k{put}", torch.full((1024,), float(put)))
            print("no error")
        except PolicyError as error:
            assert "broken" in str(error) and "victim()" in str(error), error
            print("PolicyError at put", put)
        assert 0 < put < 40
        store.delete("k0")  # (usable: a verb needing no room)
        assert "k1" in store and "k0" not in store
    print("closed")
""")


@pytest.mark.parametrize("mode", ["unknown", "not_forgotten"])
def test_a_policy_naming_a_key_the_tier_lacks_fails_the_request(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "scenario.py"
    script.write_text(_SCENARIO)
    done = subprocess.run([sys.executable, str(script), mode, str(tmp_path / "store")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "PolicyError at put" in done.stdout and "closed" in done.stdout


_PREFETCH_SCENARIO = textwrap.dedent("""
    import sys, warnings, torch
    from tierstore import SyncTierStore, HostTier, DiskTier
    mode, root = sys.argv[1], sys.argv[2]

    class Broken:
        name = "broken"
        def on_access(self, key, nbytes, tier, hit):
            if mode == "access": raise ValueError("boom")
        def on_step(self):
            if mode == "step": raise ValueError("boom")
        def reset(self): pass
        def suggest(self):
            if mode == "suggest": raise ValueError("boom")
            if mode == "garbage": return [("k1", "host"), "k2", None]
            if mode == "unhashable": return [(["k1"], "host")]
            return self.endless()
        def endless(self):
            i = 0
            while True:
                yield (f"k{i % 5}", "host"); i += 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SyncTierStore([HostTier("16KiB"), DiskTier(root, "8MiB")], prefetch=Broken()) as store:
            for i in range(8):
                store.put(f"k{i}", torch.full((1024,), float(i)))
                store.mark_step()
            assert all(store.get(f"k{i}")[0].item() == i for i in range(8))
    warned = [w for w in caught if issubclass(w.category, RuntimeWarning) and "prefetch policy broken" in str(w.message)]
    assert len(warned) == (0 if mode == "endless" else 1), [str(w.message) for w in caught]
    print("done")
""")


@pytest.mark.parametrize("mode", ["access", "suggest", "garbage", "unhashable", "endless", "step"])
def test_a_prefetch_policy_that_fails_costs_prefetches_not_requests(tmp_path: Path, mode: str) -> None:
    """Prefetching is advice: a policy whose hooks raise made every put and get raise (the put
    having taken effect; an on_step that raised, mark_step), and one whose suggestions never end
    hung the store."""
    script = tmp_path / "scenario.py"
    script.write_text(_PREFETCH_SCENARIO)
    done = subprocess.run([sys.executable, str(script), mode, str(tmp_path / "store")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout


@pytest.mark.parametrize("hook", ["on_insert", "on_hit", "on_remove"])
def test_an_eviction_policy_hook_that_raises_leaves_requests_whole(tmp_path: Path, hook: str) -> None:
    """A hook raising inside the store's bookkeeping made a put that took effect raise (and a
    hold keep a use of its copy): the request goes on, a RuntimeWarning says so once."""
    import warnings

    import torch

    from policies import LRU
    from tierstore import DiskTier, HostTier, SyncTierStore

    class Failing(LRU):
        def on_insert(self, key: str, nbytes: int) -> None:
            super().on_insert(key, nbytes)
            if hook == "on_insert" and key.startswith("k"):
                raise ValueError("boom")

        def on_hit(self, key: str) -> None:
            super().on_hit(key)
            if hook == "on_hit":
                raise ValueError("boom")

        def on_remove(self, key: str) -> None:
            super().on_remove(key)
            if hook == "on_remove":
                raise ValueError("boom")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with SyncTierStore([HostTier("16KiB"), DiskTier(tmp_path / "d", "8MiB")], eviction=Failing) as store:
            for i in range(8):
                store.put(f"k{i}", torch.full((1024,), float(i)))  # 4 KiB each: the host fills, values move down
            for i in range(8):
                assert store.get(f"k{i}")[0].item() == i
                with store.hold(f"k{i}", "host", write=True) as held:
                    held.add_(1)
            for i in range(8):  # overwrites: the host copies of the old values go (on_remove)
                store.put(f"k{i}", torch.full((1024,), float(10 * i)))
            assert [store.get(f"k{i}")[0].item() for i in range(8)] == [float(10 * i) for i in range(8)]
            for i in range(8):  # (those on the host: on_remove)
                store.delete(f"k{i}")
            assert len(store) == 0
    warned = [w for w in caught if issubclass(w.category, RuntimeWarning) and f"raised ValueError('boom') in {hook}" in str(w.message)]
    assert len(warned) == 1, [str(w.message) for w in caught]


async def test_a_victim_that_raises_part_way_leaves_no_copy_pinned(tmp_path: Path) -> None:
    """victim() raising on the second call of one round of eviction kept the first victim's
    use for good: a write hold of its key then waited for ever."""
    import asyncio

    import torch

    from policies import LRU
    from tierstore import DiskTier, HostTier, PolicyError, TierStore

    class Flaky(LRU):
        calls = 0

        def victim(self, evictable=None):  # type: ignore[no-untyped-def]
            Flaky.calls += 1
            if Flaky.calls == 2:
                raise ValueError("boom")
            return super().victim(evictable)

    async with TierStore([HostTier("16KiB"), DiskTier(tmp_path / "d", "8MiB")], eviction=Flaky) as store:
        for i in range(4):
            await store.put(f"k{i}", torch.full((1024,), float(i)))  # 4 KiB each: the host is full
        with pytest.raises(PolicyError, match="raised ValueError\\('boom'\\) in victim\\(\\)"):
            await store.put("big", torch.zeros(2048), tier="host")  # 8 KiB: two victims
        assert "big" not in store
        for i in range(4):
            async with asyncio.timeout(10):
                async with store.hold(f"k{i}", "host", write=True) as held:
                    held.add_(1)
        await store.put("big", torch.zeros(2048), tier="host")  # the policy works again
        assert [(await store.get(f"k{i}"))[0].item() for i in range(4)] == [1.0, 2.0, 3.0, 4.0]


async def test_a_victim_that_is_not_a_key_is_a_policy_error(tmp_path: Path) -> None:
    """An unhashable victim raised a bare TypeError from the store's lookup."""
    import torch

    from policies import LRU
    from tierstore import HostTier, PolicyError, TierStore

    class ListVictim(LRU):
        def victim(self, evictable=None):  # type: ignore[no-untyped-def]
            return [super().victim(evictable)]

    async with TierStore([HostTier("12KiB"), HostTier("1MiB", name="slow")], eviction=ListVictim) as store:
        for i in range(3):
            await store.put(f"k{i}", torch.full((1024,), float(i)))
        with pytest.raises(PolicyError, match="which is not a key"):
            await store.put("k3", torch.zeros(1024))
        assert [(await store.get(f"k{i}", tier="slow"))[0].item() for i in range(3)] == [0.0, 1.0, 2.0]


async def test_a_victim_of_none_while_values_could_go_is_warned_of_once(tmp_path: Path) -> None:
    """A policy that never evicts sent every put to the tier below without a word."""
    import warnings

    import torch

    from policies import LRU
    from tierstore import HostTier, TierStore

    class NeverEvicts(LRU):
        def victim(self, evictable=None):  # type: ignore[no-untyped-def]
            return None

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with TierStore([HostTier("12KiB"), HostTier("1MiB", name="slow")], eviction=NeverEvicts) as store:
            for i in range(6):
                await store.put(f"k{i}", torch.full((1024,), float(i)))
            assert store.where("k5") == ["slow"]  # (still served: the request goes on)
        async with TierStore([HostTier("12KiB"), HostTier("1MiB", name="slow")], eviction=LRU) as store:
            for i in range(6):
                await store.put(f"k{i}", torch.full((1024,), float(i)))
    said = [str(w.message) for w in caught if "returned None from victim()" in str(w.message)]
    assert len(said) == 1 and "NeverEvicts of tier 'host'" in said[0] and "3 value(s)" in said[0], said


async def test_min_writes_back_what_is_needed_last_once_the_last_tier_has_room_again() -> None:
    """The review: MIN set aside the keys the store refused because the last memory tier (no
    policy there) was full; no use ended, so nothing brought them back when room came, and
    MIN evicted a key needed sooner instead of the one needed last."""
    import torch

    from policies import MIN
    from tierstore import DeviceTier, HostTier, TierStore

    later = {"far": 1000.0, "mid": 500.0}

    def next_use(key: str) -> float:
        return later.get(key, 1.0 if key.startswith("soon") else 10.0)

    def value(x: float) -> torch.Tensor:
        return torch.full((1024,), float(x))  # 4 KiB

    async with TierStore([DeviceTier("cpu", "16KiB"), HostTier("16KiB")], eviction=lambda: MIN(next_use)) as store:
        for i in range(4):
            await store.put(f"h{i}", value(i), tier="host")  # the host, the last tier, full
        await store.put("far", value(9), tier="device")
        await store.put("mid", value(8), tier="device")
        await store.get("h0", tier="device")
        await store.get("h1", tier="device")
        later["h0"] = later["h1"] = 2.0
        await store.put("soon0", value(7), tier="device")  # (far and mid cannot go: no room below)
        await store.delete("h3")
        await store.delete("h2")  # room below again
        await store.put("soon1", value(6), tier="device")
        assert store.where("far") == ["host"] and "device" in store.where("h1")
