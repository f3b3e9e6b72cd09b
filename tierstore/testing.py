"""The conformance suite every tier (and every stack of tiers) passes.

Subclass ``TierTests`` in a test module and implement ``make_tiers``; pytest collects the
inherited tests (they are async, marked for pytest-asyncio -- ``pip install pytest-asyncio``,
in the ``dev`` extra -- so they run in any project, whatever its ``asyncio_mode``). The raw helpers (``raw_bytes``) read a value straight from the tier's memory or
file, bypassing the store's read path, so a test can tell a store that reads back what it wrote
from one that stores it right.
"""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from .errors import InvalidKeyError, InvalidTensorError, KeyNotFoundError, UnknownTierError
from .store import TierStore
from .tensors import as_bytes, supported_dtypes
from .tiers import DiskTier, Tier

ODD_KEYS = [
    "a/b/c",
    "../../etc/passwd",
    "/absolute",
    "..",
    ".",
    "nul\x00inside",
    "trailing-nul\x00",
    "ключ-ünïcødé-🔑",
    "x" * 10_000,
    " spaces and\ttabs\n",
    "C:\\windows\\path",
    "%2F-escaped",
]


#: Every file name a store folder may contain (the test's tmp_path holds nothing else).
STORE_FILE = re.compile(r"disk|data|catalog|lock|data\.mdb|lock\.mdb|segment-\d{6}\.bin")


def block_io() -> tuple[int, int]:
    """``(read_bytes, write_bytes)`` this process has sent to block devices so far (Linux's
    ``/proc/self/io``: what I/O that bypasses the page cache, as the disk tier's ``O_DIRECT``
    transfers do, costs the drive). Raises ``OSError`` (or ``KeyError``/``ValueError`` on an
    unexpected format) where it cannot be read."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/io").read_text().splitlines() if ":" in line)
    return int(fields["read_bytes"]), int(fields["write_bytes"])


def sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (every bit pattern, NaNs included)."""
    generator = torch.Generator().manual_seed(seed)
    nbytes = torch.empty(shape, dtype=dtype).nbytes
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape) if nbytes else torch.empty(shape, dtype=dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of value, dtype and shape (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(as_bytes(a.cpu().contiguous()), as_bytes(b.cpu().contiguous())))


def raw_bytes(store: TierStore, key: str, tier: int) -> bytes:
    """The bytes of ``key`` as they lie on tier ``tier``, read past the store's read path."""
    entry = store._engine.entries[key]
    copy = entry.copies[tier]
    nbytes = entry.meta.nbytes
    if copy.buffer is not None:
        return bytes(copy.buffer[:nbytes].cpu().numpy().tobytes())
    target = store.tiers[tier]
    if isinstance(target, DiskTier) and copy.inline is not None:
        data = target.read_raw_inline(key)
        if data is not None:
            return data
    if not isinstance(target, DiskTier) or copy.extent is None:
        raise TypeError(f"tier {tier} holds neither a buffer nor an extent for {key!r}")
    return target.read_raw(copy.extent, nbytes)


def _refused_values() -> list[object]:
    import warnings

    with warnings.catch_warnings():  # sparse CSR and quantized tensors warn that they are beta/deprecated
        warnings.simplefilter("ignore")
        return [
            [1.0, 2.0],
            "tensor",
            torch.ones(3).to_sparse(),
            torch.empty(3, device="meta"),
            torch.sparse_csr_tensor(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([1.0])),
            torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
        ]


class TierTests:
    """Conformance tests. Subclasses implement ``make_tiers(tmp_path)``."""

    pytestmark = pytest.mark.asyncio  # (the project running them may not set asyncio_mode = "auto")

    def make_tiers(self, tmp_path: Path) -> list[Tier]:
        raise NotImplementedError

    @pytest_asyncio.fixture(loop_scope="function")
    async def store(self, tmp_path: Path):
        async with TierStore(self.make_tiers(tmp_path)) as store:
            yield store

    # -- values ------------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", supported_dtypes(), ids=str)
    async def test_roundtrip_every_dtype(self, store: TierStore, dtype: torch.dtype) -> None:
        value = sample(dtype, (3, 5, 7), seed=1)
        await store.put("t", value)
        assert same_bytes(await store.get("t"), value)
        info = store.info("t")
        assert info["dtype"] == dtype and info["shape"] == (3, 5, 7)

    @pytest.mark.parametrize("shape", [(), (0,), (4, 0, 3), (1,), (1024 * 1024 + 3,)], ids=str)
    async def test_shapes(self, store: TierStore, shape: tuple[int, ...]) -> None:
        value = sample(torch.float32, shape, seed=2)
        await store.put("s", value)
        got = await store.get("s")
        assert same_bytes(got, value)

    async def test_get_into_out(self, store: TierStore) -> None:
        from .tensors import empty

        value = sample(torch.float32, (3, 5000), seed=5)
        await store.put("o", value)
        for out in (torch.empty(3, 5000), empty((3, 5000))):
            got = await store.get("o", out=out)
            assert got is out and same_bytes(out, value)
        with pytest.raises(InvalidTensorError):
            await store.get("o", out=torch.empty(3, 5000, dtype=torch.float64))
        with pytest.raises(InvalidTensorError):
            await store.get("o", out=torch.empty(5000, 3).t())
        assert same_bytes(await store.get("o"), value)

    async def test_value_lands_on_a_tier_as_written(self, store: TierStore) -> None:
        value = sample(torch.float32, (257,), seed=3)
        await store.put("raw", value)
        entry = store._engine.entries["raw"]
        for tier in entry.valid_tiers():
            assert raw_bytes(store, "raw", tier) == as_bytes(value).numpy().tobytes()

    async def test_get_returns_a_copy(self, store: TierStore) -> None:
        value = torch.arange(10, dtype=torch.float32)
        await store.put("c", value)
        value.zero_()  # the store kept its own copy
        got = await store.get("c")
        assert torch.equal(got, torch.arange(10, dtype=torch.float32))
        got.fill_(-1)  # and hands out copies
        assert torch.equal(await store.get("c"), torch.arange(10, dtype=torch.float32))

    async def test_overwrite_changes_dtype_and_shape(self, store: TierStore) -> None:
        await store.put("o", torch.zeros(100, dtype=torch.float64))
        await store.put("o", torch.ones(2, 3, dtype=torch.bfloat16))
        got = await store.get("o")
        assert got.dtype == torch.bfloat16 and got.shape == (2, 3) and bool((got == 1).all())
        assert len(store) == 1

    async def test_delete(self, store: TierStore) -> None:
        await store.put("d", torch.ones(3))
        await store.put("keep", torch.full((3,), 7.0))
        await store.delete("d")
        assert "d" not in store and store.keys() == ["keep"]
        with pytest.raises(KeyNotFoundError):
            await store.get("d")
        with pytest.raises(KeyNotFoundError):
            await store.delete("d")
        assert torch.equal(await store.get("keep"), torch.full((3,), 7.0))

    async def test_non_contiguous_is_stored_contiguous(self, store: TierStore) -> None:
        base = torch.arange(24, dtype=torch.int32).reshape(4, 6)
        view = base.t()[1:, ::2]
        await store.put("nc", view)
        got = await store.get("nc")
        assert torch.equal(got, view) and got.is_contiguous()

    async def test_requires_grad_is_dropped(self, store: TierStore) -> None:
        param = torch.nn.Parameter(torch.randn(5))
        await store.put("p", param)
        got = await store.get("p")
        assert not got.requires_grad and torch.equal(got, param.detach())

    async def test_hold_gives_the_stored_value(self, store: TierStore) -> None:
        memory = [i for i, t in enumerate(store.tiers) if t.kind == "memory"]
        if not memory:
            pytest.skip("no memory tier to hold on")
        await store.put("h", torch.arange(6.0))
        async with store.hold("h", memory[0], write=True) as buffer:
            assert torch.equal(buffer, torch.arange(6.0))
            buffer.mul_(2)
        assert torch.equal(await store.get("h"), torch.arange(6.0) * 2)

    # -- concurrency --------------------------------------------------------------------------

    async def test_concurrent_puts_and_gets_of_one_key(self, store: TierStore) -> None:
        values = [torch.full((4096,), float(i)) for i in range(12)]
        await store.put("same", values[0])

        async def read() -> torch.Tensor:
            return await store.get("same")

        jobs = [store.put("same", v) for v in values] + [read() for _ in range(12)]
        random.Random(4).shuffle(jobs)
        results = await asyncio.gather(*jobs)
        for result in results:
            if result is not None:  # each read is one whole written value, never a mix
                assert bool((result == result[0]).all()) and 0 <= int(result[0]) < 12
        final = await store.get("same")
        assert any(torch.equal(final, v) for v in values)

    async def test_concurrent_different_keys(self, store: TierStore) -> None:
        values = {f"k{i}": sample(torch.float16, (300 + i,), seed=i) for i in range(24)}
        await asyncio.gather(*(store.put(k, v) for k, v in values.items()))
        got = await asyncio.gather(*(store.get(k) for k in values))
        assert all(same_bytes(g, v) for g, v in zip(got, values.values(), strict=True))
        assert sorted(store.keys()) == sorted(values)

    # -- keys and bad input ---------------------------------------------------------------------

    @pytest.mark.parametrize("key", ODD_KEYS, ids=lambda k: repr(k)[:24])
    async def test_odd_keys(self, store: TierStore, key: str, tmp_path: Path) -> None:
        outside = sorted(p.name for p in tmp_path.parent.iterdir())
        await store.put(key, torch.tensor([1.5, 2.5]))
        assert key in store and store.keys() == [key]
        assert torch.equal(await store.get(key), torch.tensor([1.5, 2.5]))
        # Keys never become paths: only the store's own file names exist, nothing escaped.
        names = {p.name for p in tmp_path.rglob("*")}
        assert all(STORE_FILE.fullmatch(name) for name in names), names
        assert sorted(p.name for p in tmp_path.parent.iterdir()) == outside
        await store.delete(key)
        assert key not in store

    @pytest.mark.parametrize("key", [b"bytes", 3, None, "", "\udc80lone-surrogate", "x" * 70_000], ids=repr)
    async def test_bad_keys(self, store: TierStore, key: object) -> None:
        with pytest.raises(InvalidKeyError):
            await store.put(key, torch.ones(1))  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError):
            await store.get(key)  # type: ignore[arg-type]
        assert len(store) == 0

    @pytest.mark.parametrize("value", _refused_values(), ids=["list", "str", "sparse_coo", "meta", "sparse_csr", "quantized"])
    async def test_bad_values(self, store: TierStore, value: object) -> None:
        await store.put("fine", torch.ones(2))
        with pytest.raises(InvalidTensorError):
            await store.put("bad", value)  # type: ignore[arg-type]
        assert store.keys() == ["fine"] and torch.equal(await store.get("fine"), torch.ones(2))

    async def test_unknown_key_and_tier(self, store: TierStore) -> None:
        with pytest.raises(KeyNotFoundError):
            await store.get("missing")
        with pytest.raises(KeyError):  # also a KeyError, as zarr does
            await store.get("missing")
        await store.put("x", torch.ones(1))
        with pytest.raises(UnknownTierError):
            await store.get("x", tier="nvme")
        with pytest.raises(UnknownTierError):
            await store.get("x", tier=17)


def check_consistency(store: TierStore) -> None:
    """Assert the store's invariants at a quiet moment (no operation in flight):

    - each tier's accounting equals the bytes of the copies it holds, and never exceeds capacity;
    - every visible entry has a valid copy somewhere; no copy is in use or retired;
    - each eviction policy knows exactly the evictable copies of its tier.
    """
    from .tiers import MemoryTier

    for index, tier in enumerate(store.tiers):
        copies = [e.copies[index] for e in store._engine.entries.values() if index in e.copies]
        assert tier.used <= tier.capacity, f"{tier.name}: {tier.used} used > {tier.capacity} capacity"
        held = sum(c.nbytes for c in copies)
        if isinstance(tier, MemoryTier):
            assert tier.live_bytes == held, f"{tier.name}: accounting {tier.live_bytes} != copies {held}"
        else:
            assert tier.used == held, f"{tier.name}: accounting {tier.used} != extents {held}"
        for copy in copies:
            assert copy.users == 0 and copy.holds == 0 and not copy.retired
        policy = store._engine.policies[index]
        if policy is not None and hasattr(policy, "__len__"):
            evictable = [e.key for e in store._engine.entries.values() if index in e.copies and e.copies[index].in_policy]
            tracked = len(policy)  # type: ignore[arg-type]
            assert tracked == len(evictable), f"{tier.name}: policy tracks {tracked}, {len(evictable)} evictable"
    for entry in store._engine.entries.values():
        assert entry.visible and entry.valid_tiers(), f"{entry.key!r} has no valid copy"
        assert not entry.loading
        for index, copy in entry.copies.items():
            if isinstance(store.tiers[index], MemoryTier):
                assert copy.version == entry.version, f"{entry.key!r} keeps a stale copy on {store.tiers[index].name}"
                assert copy.in_policy == (store._engine.policies[index] is not None)


async def settle(store: TierStore, timeout: float = 10.0) -> None:
    """Wait until nothing is in flight in ``store`` (background prefetches, demotions, loads)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        busy = (
            [t for t in store._engine.background if not t.done()]
            + [t for t in store._engine.writes if not t.done()]
            + [t for tasks in store._engine.demotions for t in tasks if not t.done()]
            + [f for e in store._engine.entries.values() for f in e.loading.values()]
        )
        if not busy and not any(c.users for e in store._engine.entries.values() for c in e.copies.values()):
            return
        if loop.time() > deadline:
            raise TimeoutError(f"store still busy after {timeout}s: {busy[:5]}")
        await asyncio.sleep(0.005)


def watch_capacity(store: TierStore) -> list[str]:
    """Check every allocation of ``store``'s memory tiers from now on; returns the list the
    breaches (a tier past its capacity) are appended to."""
    from .tiers import MemoryTier

    breaches: list[str] = []
    for tier in store.tiers:
        if isinstance(tier, MemoryTier):
            allocate = tier.allocate

            def checked(nbytes: int, tier: MemoryTier = tier, allocate: Any = allocate) -> torch.Tensor:
                buffer = allocate(nbytes)
                if tier.used > tier.capacity:
                    breaches.append(f"{tier.name}: {tier.used} > {tier.capacity}")
                return buffer

            tier.allocate = checked  # type: ignore[method-assign]
    return breaches
