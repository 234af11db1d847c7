"""Walk one small local run's configuration: every attribute read of the run's options (``RunConfig``) and of the
plan made of them (``RunPlan``), with the module that read it, in order.

    python tests/support/config_walk.py [ENGINE] [-v]

It runs ``run_job`` in process on a local Ray over two sample photos and prints the reads, the stays (maximal runs
of consecutive reads from one room; rooms and floors as ``tests/support/import_graph.py`` defines them), the number
of distinct rooms, the climbs back (a read in a room on a higher floor right after a read in a lower one) and the
visits per module (maximal runs of consecutive reads from one module); ``-v`` prints every stay.

Only the driver is seen: the reads inside Ray workers (the listing, fetch, classify and write tasks and actors) are
in other processes, where the classes are not wrapped. Reads in a class's own ``__post_init__`` (validation of every
copy) and reads by modules outside ``pipeline`` (``dataclasses.replace``, ``asdict``) are not counted: they are the
object's machinery, not a step of the run reading it.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "support"))

from import_graph import FLOORS, room  # noqa: E402
from trace_run import sample_folder  # noqa: E402

# (module, class) of the objects walked; a class missing from the tree is skipped.
WATCHED = (("pipeline.config", "RunConfig"), ("pipeline.job.plan", "RunPlan"))


@dataclass
class Walk:
    """The reads of one run, in order: (reading module, ``Class.attribute``)."""

    reads: list[tuple[str, str]] = field(default_factory=list)

    def stays(self) -> list[tuple[str, int]]:
        """(room, reads) of each maximal run of consecutive reads from one room."""
        out: list[tuple[str, int]] = []
        for module, _name in self.reads:
            r = room(module)
            if out and out[-1][0] == r:
                out[-1] = (r, out[-1][1] + 1)
            else:
                out.append((r, 1))
        return out

    def climbs_back(self) -> int:
        """Stays on a higher floor right after a stay on a lower one."""
        floors = [FLOORS.get(r, -1) for r, _ in self.stays()]
        return sum(1 for a, b in zip(floors, floors[1:]) if b > a)

    def visits(self) -> Counter:
        """Per module, its maximal runs of consecutive reads."""
        visits: Counter = Counter()
        last = None
        for module, _name in self.reads:
            if module != last:
                visits[module] += 1
            last = module
        return visits


def watch(walk: Walk) -> list[tuple[type, object]]:
    """Wrap each WATCHED class's ``__getattribute__`` to record its public attribute reads; the originals, to undo."""
    undo = []
    for module_name, class_name in WATCHED:
        cls = getattr(importlib.import_module(module_name), class_name, None)
        if cls is None:
            continue
        original = cls.__getattribute__

        def read(self, name, _original=original, _cls=class_name):
            if not name.startswith("_"):
                caller = sys._getframe(1)
                module = caller.f_globals.get("__name__", "")
                if module.startswith("pipeline") and caller.f_code.co_name != "__post_init__":
                    walk.reads.append((module, f"{_cls}.{name}"))
            return _original(self, name)

        undo.append((cls, original))
        cls.__getattribute__ = read
    return undo


def main(engine: str | None = None) -> Walk:
    from pipeline.node import local_ray_env

    local_ray_env()
    import ray

    from pipeline.config import RunConfig
    from pipeline.job import run_job

    tmp, src, out = sample_folder("config-walk-")
    walk = Walk()
    config = RunConfig(source=str(src), output=str(out), **({"engine": engine} if engine else {}))
    undo = watch(walk)  # from the config run_job is given on
    try:
        summary = run_job(config)
    finally:
        for cls, original in undo:
            cls.__getattribute__ = original
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    assert summary.counts.get("ok") == 2, summary.counts
    return walk


def report(walk: Walk, verbose: bool = False) -> str:
    stays = walk.stays()
    lines = [f"reads: {len(walk.reads)}", f"stays: {len(stays)}", f"rooms: {len({r for r, _ in stays})}",
             f"climbs back: {walk.climbs_back()}", "visits per module:"]
    lines += [f"  {n:3d}  {m}" for m, n in sorted(walk.visits().items(), key=lambda kv: (-kv[1], kv[0]))]
    if verbose:
        lines.append("stays in order:")
        lines += [f"  {FLOORS.get(r, '?'):>2} {r} x{n}" for r, n in stays]
    return "\n".join(lines)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "-v"]
    print(report(main(args[0] if args else None), verbose="-v" in sys.argv[1:]))
