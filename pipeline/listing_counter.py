"""The listing counter actor: listed and already-committed objects, summed as the read tasks stream.

A module of its own so that the actor's worker process imports only this (the class is unpickled there by module):
defined in ``pipeline.job`` it pulled in Ray Data, pandas and pyarrow, ~0.5 CPU-s more of every job's start-up.
"""

from __future__ import annotations


class ListingCounter:
    """Counts listed and already-committed objects as read tasks stream, for the progress total and the report."""

    def __init__(self):
        self.listed = 0
        self.skipped = 0
        self.seconds = 0.0

    def add(self, listed: int, skipped: int, seconds: float) -> None:
        self.listed += listed
        self.skipped += skipped
        self.seconds += seconds

    def get(self) -> tuple[int, int, float]:
        return self.listed, self.skipped, self.seconds
