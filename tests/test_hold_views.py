"""A hold yields the store's buffer viewed as the value; the typed view is kept with the buffer
(``Copy.typed``) and each holder gets its own alias of it. What a holder does to the tensor it
got, and what the store does to the value, never shows through a kept view. Values of 4 KiB or
more (not packed in a slab, where nothing is kept) are the ones that reach the kept view."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from tierstore import HostTier, TierStore


def test_a_view_changed_in_place_by_a_holder_is_made_again() -> None:
    async def main() -> None:
        async with TierStore([HostTier("4MiB")]) as store:
            await store.put("k", torch.arange(12.0).view(3, 4))
            async with store.hold("k") as held:
                held.t_()  # (the holder's view only)
            async with store.hold("k") as held:
                assert held.shape == (3, 4)
                held.unsqueeze_(0)
            async with store.hold("k") as held:
                assert held.shape == (3, 4)
                assert torch.equal(held, torch.arange(12.0).view(3, 4))

    asyncio.run(main())


def test_a_hold_after_a_put_of_another_shape_sees_the_new_value() -> None:
    async def main() -> None:
        async with TierStore([HostTier("4MiB")]) as store:
            await store.put("k", torch.zeros(4, 4))
            async with store.hold("k") as held:
                assert held.shape == (4, 4)
            await store.put("k", torch.ones(2, 8, dtype=torch.float64))
            async with store.hold("k", write=True) as held:
                assert held.shape == (2, 8) and held.dtype == torch.float64
                held.mul_(3)
            async with store.hold("k") as held:
                assert torch.equal(held, torch.full((2, 8), 3.0, dtype=torch.float64))

    asyncio.run(main())


def test_writes_through_a_kept_view_are_the_value() -> None:
    async def main() -> None:
        async with TierStore([HostTier("4MiB")]) as store:
            await store.put("k", torch.zeros(1000))
            for _ in range(3):
                async with store.hold("k", write=True) as held:
                    held.add_(1)
            assert torch.equal(await store.get("k"), torch.full((1000,), 3.0))

    asyncio.run(main())


def test_what_a_holder_does_to_its_tensor_stays_with_it() -> None:
    """A reader's ``t_()`` on a square value, a dtype swap through ``.data``, ``as_strided_`` and
    ``requires_grad_`` on its tensor: the next holder gets the value as stored, and a writer's
    copy lands untransposed."""
    async def main() -> None:
        async with TierStore([HostTier("4MiB")]) as store:
            await store.put("w", torch.zeros(64, 64))  # (16 KiB: a buffer of its own)
            async with store.hold("w") as held:
                held.t_()
            async with store.hold("w") as held:
                held.data = held.data.view(torch.int32)
            async with store.hold("w") as held:
                held.as_strided_((4,), (0,))
            async with store.hold("w") as held:
                held.requires_grad_()
            new = torch.arange(4096.0).view(64, 64)
            async with store.hold("w", write=True) as held:
                assert held.shape == (64, 64) and held.stride() == (64, 1) and held.dtype == torch.float32
                assert not held.requires_grad
                held.copy_(new)
            assert torch.equal(await store.get("w"), new)

    asyncio.run(main())


def test_concurrent_holders_get_tensors_of_their_own() -> None:
    async def main() -> None:
        async with TierStore([HostTier("4MiB")]) as store:
            await store.put("k", torch.arange(4096.0))
            async with store.hold("k") as a, store.hold("k") as b:
                assert a is not b
                a.resize_(2)
                assert b.shape == (4096,) and torch.equal(b, torch.arange(4096.0))

    asyncio.run(main())


def test_a_hold_set_on_the_instance_is_asked_in_the_resident_step() -> None:
    """A fault injector may wrap ``store.hold`` on the instance: the optimizer's resident step,
    which holds all its entries in one block, still asks it for each."""
    from tierstore.optim import TieredAdamW
    from tierstore.sync import run

    store = TierStore([HostTier("16MiB")])
    asked: list[str] = []
    real = store.hold

    def counting(key: str, tier: object = None, write: bool = False) -> object:
        asked.append(key)
        return real(key, tier, write)

    store.hold = counting  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = TieredAdamW(model.parameters(), store=store, min_offload_numel=10, emulate_device=False)  # (the resident step: the plain CPU)
    try:
        for _step in range(3):
            model(torch.randn(4, 64)).square().mean().backward()
            before = len(asked)
            opt.step()
            opt.zero_grad()
        assert len(asked) - before >= 2  # (the last step: both entries, resident)
        assert any(event[0].startswith("resident update") for event in opt.last_timeline())
    finally:
        opt.close()
        run(store.aclose())


def test_get_into_the_buffer_of_a_read_hold_is_refused(tmp_path: Path) -> None:
    """``get(key, out=<another key's read-held buffer>)`` wrote into the store's own copy of that
    value: it read the new bytes in memory and the old ones from disk after a reopen. It is an
    ``InvalidTensorError`` now, nothing written; reading into a write hold's buffer (the
    holder's to change) still works, and so does ``out=`` once the hold has ended."""
    from tierstore import DiskTier, InvalidTensorError, SyncTierStore

    def open_store() -> SyncTierStore:
        return SyncTierStore([HostTier("1MiB"), DiskTier(tmp_path / "s", "64MiB")]).open()

    store = open_store()
    store.put("a", torch.arange(1024.0))
    store.put("b", torch.zeros(1024))
    store.put("small", torch.arange(4.0))  # (packed in a slab beside others)
    store.flush()
    with store.hold("b", "host") as held, store.hold("small", "host") as small:
        with pytest.raises(InvalidTensorError, match="read hold of 'b'"):
            store.get("a", out=held)
        with pytest.raises(InvalidTensorError, match="read hold of 'b'"):
            store.get("a", out=held[:1024])
        with pytest.raises(InvalidTensorError, match="read hold of 'small'"):
            store.get("small", out=small)
    assert torch.equal(store.get("b"), torch.zeros(1024))
    with store.hold("b", "host", write=True) as writable:
        store.get("a", out=writable)
    assert torch.equal(store.get("b"), torch.arange(1024.0))
    kept = store.get("b")
    store.get("a", out=kept)  # (no hold: an ordinary tensor of the caller's)
    store.close()
    store = open_store()
    assert torch.equal(store.get("b"), torch.arange(1024.0))
    store.close()
