"""The listing counter actor: listed and already-committed objects, and the identities to carry over.

A module of its own so that the actor's worker process imports only this (the class is unpickled there by module):
defined in ``pipeline.job`` it pulled in Ray Data, pandas and pyarrow, ~0.5 CPU-s more of every job's start-up.
"""

from __future__ import annotations

import asyncio


class ListingCounter:
    """Sums the read tasks' counts as they stream (progress total, report) and gathers the carried identities.

    An asyncio actor, so that ``carried_keys`` can wait for the end of the listing while the listing tasks' calls go
    on: the carry tasks take its result as an argument, so Ray starts them the moment the last listing task ends,
    while the new objects are still being classified. Calls are not ordered in an asyncio actor, so each listing
    task waits for its own calls to be done before it calls ``finish``.
    """

    def __init__(self, tasks: int):
        self.tasks = tasks  # listing tasks planned; carried_keys waits for a finish from each
        self.finished: set[int] = set()
        self.listed = 0
        self.skipped = 0
        self.seconds = 0.0
        self.carried: list = []  # int64 arrays of identity hashes: 8 bytes per object to carry
        self._all_listed: asyncio.Event | None = None
        self.claimed: set[tuple[int, int]] = set()  # folders out of the source that a listing task walks

    def add(self, listed: int, skipped: int, seconds: float) -> None:
        self.listed += listed
        self.skipped += skipped
        self.seconds += seconds

    def add_carried(self, identities) -> None:
        self.carried.append(identities)

    def finish(self, task: int) -> None:
        """Listing task ``task`` is done and every call it made before this one has run (a retry finishes again)."""
        self.finished.add(task)
        if len(self.finished) >= self.tasks:
            self._event().set()

    def claim(self, folder: tuple[int, int]) -> bool:
        """True for the first listing task that asks to walk this folder (device, inode) through a followed link."""
        if folder in self.claimed:
            return False
        self.claimed.add(folder)
        return True

    def progress(self) -> tuple[int, bool]:
        """(objects listed so far, whether every listing task has finished)."""
        return self.listed, len(self.finished) >= self.tasks

    def get(self) -> tuple[int, int, float]:
        return self.listed, self.skipped, self.seconds

    async def carried_keys(self):
        """The sorted identities of every object the listing matched to a carryable previous row, once every
        listing task has finished."""
        import numpy as np

        await self._event().wait()
        keys = np.unique(np.concatenate(self.carried)) if self.carried else np.empty(0, np.int64)
        self.carried = [keys]
        return keys

    def _event(self) -> asyncio.Event:
        # Made on first use, inside the actor's event loop (asyncio objects bind to the loop that runs them).
        if self._all_listed is None:
            self._all_listed = asyncio.Event()
            if len(self.finished) >= self.tasks:
                self._all_listed.set()
        return self._all_listed
