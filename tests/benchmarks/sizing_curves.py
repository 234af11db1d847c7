"""The GPU benchmark's Triton runs as curves ``bulk-classify size`` reads: one JSON file per network and image set.

Usage:
    python tests/benchmarks/sizing_curves.py bench_gpu_out/bench_gpu.json OUTDIR

bench_gpu.py's JSON holds ``triton_<net>_<set>_r<batch>_c<conc>`` entries (``{"img_s": ...}``); each
``triton_<net>_<set>`` becomes ``OUTDIR/curve_triton_<net>_<set>.json``, ``{"points": [{"images_in_flight",
"img_s"}, ...]}`` (the load is request batch x concurrency; no p99). bench_gpu.py writes them beside its own JSON.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

RUN_KEY = re.compile(r"(triton_.+)_r(\d+)_c(\d+)")


def sizing_curves(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """bench_gpu.py's results as one list of points per ``triton_<net>_<set>``, in the order they were measured."""
    curves: dict[str, list[dict[str, Any]]] = {}
    for key, value in results.items():
        m = RUN_KEY.fullmatch(key)
        if m and isinstance(value, dict) and "img_s" in value:
            curves.setdefault(m.group(1), []).append(
                {"images_in_flight": int(m.group(2)) * int(m.group(3)), "img_s": value["img_s"]})
    return curves


def write_curves(results: dict[str, Any], out: Path) -> list[Path]:
    """Write each curve of ``results`` as ``out/curve_<prefix>.json``; the paths written."""
    paths = []
    for prefix, points in sorted(sizing_curves(results).items()):
        path = out / f"curve_{prefix}.json"
        path.write_text(json.dumps({"points": points}, indent=1))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", type=Path, help="bench_gpu.py's bench_gpu.json")
    p.add_argument("out", type=Path, help="folder for the curve files")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in write_curves(json.loads(args.results.read_text()), args.out):
        print(path)


if __name__ == "__main__":
    main()
