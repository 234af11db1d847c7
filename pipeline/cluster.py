"""Where the job's Ray runs: the cluster ``RAY_ADDRESS`` names, or a local Ray the job starts (the one reader of it)."""

from __future__ import annotations

import os

RAY_ADDRESS_ENV = "RAY_ADDRESS"


def ray_address() -> str | None:
    """The address of the Ray cluster the job joins, or None: the job starts a local Ray on this machine."""
    return os.environ.get(RAY_ADDRESS_ENV) or None
