"""``tierstore.optim.pipeline.Places``: the update pipeline's places (a semaphore whose size, the
pipeline's ``inflight``, a re-plan during a step may lower). Each release woke every waiter, so
a step with hundreds of chunk runs waiting paid for all of them at every release, and a
newcomer could take a place ahead of those waiting."""

from __future__ import annotations

import asyncio

from tierstore.optim.pipeline import Places


async def _take(places: Places, name: str, order: list[str], hold: asyncio.Event | None = None) -> None:
    async with places:
        order.append(name)
        if hold is not None:
            await hold.wait()  # (and lets go at once)
        else:
            await asyncio.sleep(0)


async def test_first_come_first_served_and_a_newcomer_waits_behind() -> None:
    places, order, release = Places(lambda: 1), [], asyncio.Event()
    tasks = [asyncio.create_task(_take(places, "H", order, release))]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(_take(places, name, order)) for name in "AB"]
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # (A and B wait)
    # in one turn of the loop: new takers start (a bucket launched), then the holder lets go
    asyncio.get_running_loop().call_soon(lambda: tasks.extend(asyncio.create_task(_take(places, n, order)) for n in "CD"))
    release.set()
    for _ in range(3):
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == ["H", "A", "B", "C", "D"]


async def test_a_lowered_limit_lets_no_new_holder_in_until_enough_left() -> None:
    limit = [3]
    places, order = Places(lambda: limit[0]), []
    gates = [asyncio.Event() for _ in range(3)]
    holders = [asyncio.create_task(_take(places, f"h{i}", order, gates[i])) for i in range(3)]
    await asyncio.sleep(0)
    limit[0] = 1
    newcomer = asyncio.create_task(_take(places, "new", order))
    gates[0].set()
    await asyncio.sleep(0.01)
    assert "new" not in order  # two still held: more than the new limit
    gates[1].set()
    await asyncio.sleep(0.01)
    assert "new" not in order
    gates[2].set()
    await asyncio.gather(*holders, newcomer)
    assert order[-1] == "new"


async def test_a_waiter_cancelled_after_its_turn_came_passes_the_place_on() -> None:
    places, order, release = Places(lambda: 1), [], asyncio.Event()
    holder = asyncio.create_task(_take(places, "H", order, release))
    await asyncio.sleep(0)
    first = asyncio.create_task(_take(places, "A", order))
    second = asyncio.create_task(_take(places, "B", order))
    await asyncio.sleep(0)
    release.set()
    await asyncio.sleep(0)  # (H releases: A's turn)
    first.cancel()
    await asyncio.gather(holder, second, return_exceptions=True)
    assert order == ["H", "B"] and first.cancelled()
    async with places:  # nothing leaked: the place is free
        pass
