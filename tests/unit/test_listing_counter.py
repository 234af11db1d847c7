"""The listing counter without Ray: carried identities are handed over only once every listing task has finished."""

from __future__ import annotations

import asyncio

import numpy as np

from pipeline.io.listing_counter import ListingCounter


def test_carried_keys_wait_for_every_planned_listing_task():
    async def scenario() -> tuple[list[bool], list[int]]:
        counter = ListingCounter(2)
        keys = asyncio.ensure_future(counter.carried_keys())
        seen = []
        counter.add_carried(np.array([9, 3], np.int64))
        counter.finish(0)
        counter.finish(0)  # a retried task finishes again: still one task of two
        await asyncio.sleep(0.01)
        seen.append(keys.done())
        counter.add(10, 2, 0.5)
        counter.add_carried(np.array([3, 5], np.int64))
        counter.finish(1)
        out = await asyncio.wait_for(keys, 5)
        seen.append(keys.done())
        return seen, out.tolist()

    seen, keys = asyncio.run(scenario())
    assert seen == [False, True]
    assert keys == [3, 5, 9]  # sorted and unique: what the carry tasks search


def test_carried_keys_of_a_finished_listing_come_at_once_and_again():
    async def scenario() -> tuple[list[int], list[int], tuple]:
        counter = ListingCounter(1)
        counter.add(4, 0, 0.1)
        counter.finish(0)
        first = await asyncio.wait_for(counter.carried_keys(), 5)
        second = await asyncio.wait_for(counter.carried_keys(), 5)
        return first.tolist(), second.tolist(), counter.get()

    first, second, counts = asyncio.run(scenario())
    assert first == second == [] and counts == (4, 0, 0.1)
