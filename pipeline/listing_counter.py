"""The listing counter actor: listed and already-committed objects, and the identities to carry over.

A module of its own so that the actor's worker process imports only this (the class is unpickled there by module):
defined in ``pipeline.job`` it pulled in Ray Data, pandas and pyarrow, ~0.5 CPU-s more of every job's start-up.
"""

from __future__ import annotations


class ListingCounter:
    """Sums the read tasks' counts as they stream (progress total, report) and gathers the carried identities."""

    def __init__(self):
        self.listed = 0
        self.skipped = 0
        self.seconds = 0.0
        self.carried: list = []  # int64 arrays of identity hashes: 8 bytes per object to carry

    def add(self, listed: int, skipped: int, seconds: float) -> None:
        self.listed += listed
        self.skipped += skipped
        self.seconds += seconds

    def add_carried(self, identities) -> None:
        self.carried.append(identities)

    def get(self) -> tuple[int, int, float]:
        return self.listed, self.skipped, self.seconds

    def carried_keys(self):
        """The sorted identities of every object the listing matched to a carryable previous row."""
        import numpy as np

        keys = np.unique(np.concatenate(self.carried)) if self.carried else np.empty(0, np.int64)
        self.carried = [keys]
        return keys
