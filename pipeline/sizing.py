"""Fleet sizing: GPUs needed for a target rate, read off a measured throughput/p99 curve of one GPU.

Rule: plan each GPU at ``utilization`` (65 %) of the curve's plateau, the highest throughput measured,
so queues stay short and p99 stays near the knee; round up, then add ``spare`` GPUs (one) so a lost node
does not miss the window.

Curves it reads (one GPU, one row per load level):
    * perf_analyzer's CSV (``perf_analyzer ... -f curve.csv``): ``Concurrency``, ``Inferences/Second``,
      ``p99 latency`` in microseconds. With ``-b N`` an inference is one image, as this model takes one
      image per batch row.
    * any CSV or JSON (a list of objects, or ``{"points": [...]}``) with a throughput column named like
      ``img_per_s`` / ``images_per_s`` / ``throughput``, optionally a load column (``concurrency``,
      ``batch_size``, ``load``) and a p99 column whose name gives its unit (``p99_ms``, ``p99_us``, ``p99_s``;
      bare ``p99`` is milliseconds). The GPU benchmark writes its curves in this form.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError

DEFAULT_UTILIZATION = 0.65
DEFAULT_SPARE = 1

# Normalised column name (lower case, alphanumerics only) -> role; the first match in a file wins.
THROUGHPUT_NAMES = ("inferencessecond", "imgpers", "imagespers", "imgspers", "imgs", "imagespersecond",
                    "imgpersec", "inferpersec", "inferencespersecond", "throughput", "throughputimgs",
                    "throughputimgpers")
LOAD_NAMES = ("concurrency", "requestrate", "imagesinflight", "batchsize", "batch", "load", "clients")
# p99 column -> factor to milliseconds.
P99_NAMES = {"p99latency": 1e-3, "p99us": 1e-3, "p99latencyus": 1e-3, "p99usec": 1e-3, "p99ms": 1.0,
             "p99latencyms": 1.0, "p99": 1.0, "p99s": 1e3, "p99latencys": 1e3}


def load_curve(curve_path: str) -> dict[str, Any]:
    """Read a curve file into ``{"points": [{"load", "img_per_s", "p99_ms"}], "load_name": str}``.

    Raises:
        ConfigError: the file is missing, empty, or has no recognisable throughput column.
    """
    path = Path(curve_path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"cannot read curve {curve_path!r}: {err.strerror or err}; give the CSV from "
                          "perf_analyzer -f or the GPU benchmark's output") from None
    rows = _json_rows(text, curve_path) if text.lstrip()[:1] in ("[", "{") else _csv_rows(text)
    if not rows:
        raise ConfigError(f"curve {curve_path!r} has no data rows; run the benchmark over a few load levels")
    columns = {_norm(k): k for k in rows[0]}
    thr_col = next((columns[n] for n in THROUGHPUT_NAMES if n in columns), None)
    if thr_col is None:
        raise ConfigError(
            f"curve {curve_path!r} has no throughput column (saw {sorted(rows[0])}); expected perf_analyzer's "
            "'Inferences/Second' or a column named img_per_s / throughput")
    load_col = next((columns[n] for n in LOAD_NAMES if n in columns), None)
    p99_col, p99_factor = next(((columns[n], f) for n, f in P99_NAMES.items() if n in columns), (None, 1.0))
    points = []
    for i, row in enumerate(rows, start=1):
        thr = _number(row.get(thr_col), f"{curve_path!r} row {i} {thr_col}")
        if thr is None:
            continue
        load = _number(row.get(load_col), f"{curve_path!r} row {i} {load_col}") if load_col else None
        p99 = _number(row.get(p99_col), f"{curve_path!r} row {i} {p99_col}") if p99_col else None
        points.append({"load": load if load is not None else i, "img_per_s": thr,
                       "p99_ms": None if p99 is None else p99 * p99_factor})
    if not points or max(p["img_per_s"] for p in points) <= 0:
        raise ConfigError(f"curve {curve_path!r} has no positive throughput; check the benchmark ran")
    points.sort(key=lambda p: p["load"])
    return {"points": points, "load_name": (load_col or "point").strip()}


def size_fleet(curve_path: str, target_rate: float, utilization: float = DEFAULT_UTILIZATION,
               spare: int = DEFAULT_SPARE) -> dict[str, Any]:
    """GPUs needed to sustain ``target_rate`` images/s, planning each at ``utilization`` of its plateau.

    Returns:
        A JSON-safe dict: ``plateau_img_per_s`` (and the load and p99 where it was measured),
        ``per_gpu_img_per_s`` (= utilization x plateau), ``operating_point`` (the lightest measured load that
        reaches the per-GPU rate, with its p99: what latency to expect), ``gpus_for_target``, ``spare`` and
        ``gpus`` (the total to provision).
    """
    if not isinstance(target_rate, (int, float)) or not target_rate > 0 or math.isinf(target_rate):
        raise ConfigError(f"--target-rate {target_rate!r} must be a positive number of images per second")
    if not 0 < utilization <= 1:
        raise ConfigError(f"--utilization {utilization!r} must be in (0, 1]; {DEFAULT_UTILIZATION} keeps p99 near the knee")
    if not isinstance(spare, int) or spare < 0:
        raise ConfigError(f"--spare {spare!r} must be 0 or more GPUs")
    curve = load_curve(curve_path)
    points = curve["points"]
    best = max(points, key=lambda p: p["img_per_s"])
    plateau = best["img_per_s"]
    per_gpu = utilization * plateau
    # Small epsilon: 2 GPUs plus float noise is 2, not 3.
    needed = max(1, math.ceil(target_rate / per_gpu - 1e-9))
    operating = next((p for p in points if p["img_per_s"] >= per_gpu), best)
    return {
        "curve": str(curve_path),
        "load_name": curve["load_name"],
        "points": points,
        "plateau_img_per_s": round(plateau, 2),
        "plateau_load": best["load"],
        "plateau_p99_ms": _round(best["p99_ms"]),
        "utilization": utilization,
        "per_gpu_img_per_s": round(per_gpu, 2),
        "operating_point": {"load": operating["load"], "img_per_s": round(operating["img_per_s"], 2),
                            "p99_ms": _round(operating["p99_ms"])},
        "target_rate": target_rate,
        "gpus_for_target": needed,
        "spare": spare,
        "gpus": needed + spare,
        "capacity_img_per_s": round(needed * per_gpu, 2),
        "images_per_hour": round(needed * per_gpu * 3600),
    }


def format_sizing(result: dict[str, Any]) -> str:
    """The table ``bulk-classify size`` prints: the curve, the plateau, the operating point and the fleet."""
    load_name = result.get("load_name", "load")
    per_gpu = result["per_gpu_img_per_s"]
    lines = [f"{load_name:>14}{'img/s':>12}{'p99 ms':>10}"]
    for p in result["points"]:
        mark = []
        if p["img_per_s"] == result["plateau_img_per_s"] or round(p["img_per_s"], 2) == result["plateau_img_per_s"]:
            mark.append("plateau")
        if p["load"] == result["operating_point"]["load"]:
            mark.append(f"first >= {result['utilization']:.0%}")
        lines.append(f"{_fmt(p['load']):>14}{p['img_per_s']:>12,.1f}{_ms(p['p99_ms']):>10}  {', '.join(mark)}".rstrip())
    op = result["operating_point"]
    lines += [
        "",
        f"plateau      {result['plateau_img_per_s']:,.1f} img/s per GPU ({load_name} {_fmt(result['plateau_load'])})",
        f"plan at {result['utilization']:.0%}  {per_gpu:,.1f} img/s per GPU, p99 about {_ms(op['p99_ms'])} ms "
        f"(measured at {load_name} {_fmt(op['load'])})",
        f"target       {result['target_rate']:,.1f} img/s -> {result['gpus_for_target']} GPU(s) "
        f"+ {result['spare']} spare = {result['gpus']} GPU(s)",
        f"capacity     {result['capacity_img_per_s']:,.1f} img/s without the spare "
        f"({result['images_per_hour']:,} images/hour; "
        f"{result['capacity_img_per_s'] / result['target_rate']:.2f}x the target)",
    ]
    return "\n".join(lines)


def _csv_rows(text: str) -> list[dict[str, str]]:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        return []
    try:
        dialect = csv.Sniffer().sniff(lines[0], delimiters=",\t;")
    except csv.Error:
        dialect = csv.excel
    # perf_analyzer appends a blank line and extra sections (server-side metrics) after the table.
    return [r for r in csv.DictReader(io.StringIO("\n".join(lines)), dialect=dialect)
            if any(v not in (None, "") for v in r.values())]


def _json_rows(text: str, curve_path: str) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"curve {curve_path!r} is not valid JSON: {err}") from None
    if isinstance(data, dict):
        data = next((data[k] for k in ("points", "curve", "results", "rows") if isinstance(data.get(k), list)), None)
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ConfigError(f"curve {curve_path!r}: expected a list of objects or {{\"points\": [...]}}")
    return data


def _norm(name: Any) -> str:
    return re.sub(r"[^a-z0-9]", "", str(name).lower())


def _number(value: Any, where: str) -> float | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} = {value!r} is not a number; fix or drop that row") from None
    if math.isnan(x) or math.isinf(x) or x < 0:
        raise ConfigError(f"{where} = {value!r} must be a finite number >= 0")
    return x


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer():
        return f"{int(value)}"
    return f"{value:,.2f}" if isinstance(value, float) else str(value)
