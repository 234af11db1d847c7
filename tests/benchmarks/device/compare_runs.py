"""Top-1 agreement of two runs' Parquet outputs over the same inputs, with the reference's margins where they differ.

    python tests/benchmarks/device/compare_runs.py REFERENCE_OUT OTHER_OUT

REFERENCE_OUT is e.g. ``--engine onnx`` (ONNX Runtime FP32 on the CPU); each disagreement is listed with the
reference's top-1 and top-2 probabilities (a near-tie has a small margin) and the other run's top-1 probability.
"""

from __future__ import annotations

import sys

import pyarrow.dataset as pads


def rows(out: str) -> dict[str, dict]:
    table = pads.dataset(out, format="parquet").to_table(columns=["uri", "status", "class_ids", "scores"])
    return {r["uri"].rsplit("/", 1)[-1]: r for r in table.to_pylist()}


def main() -> None:
    ref, other = rows(sys.argv[1]), rows(sys.argv[2])
    both = sorted(k for k in ref if k in other and ref[k]["status"] == other[k]["status"] == "ok")
    differ = [k for k in both if ref[k]["class_ids"][0] != other[k]["class_ids"][0]]
    print(f"top-1 agreement {len(both) - len(differ)}/{len(both)} = {(len(both) - len(differ)) / max(1, len(both)):.2%}"
          f" ({len(ref)} and {len(other)} rows)")
    for k in differ:
        r, o = ref[k], other[k]
        print(f"  {k}: reference {r['class_ids'][0]} p={r['scores'][0]:.4f} vs {r['class_ids'][1]} "
              f"p={r['scores'][1]:.4f} (margin {r['scores'][0] - r['scores'][1]:.4f}); "
              f"other {o['class_ids'][0]} p={o['scores'][0]:.4f}")


if __name__ == "__main__":
    main()
