"""Benchmark: a model set's columns in the actor, embeddings as Python lists against numpy arrays, side by side.

    python tests/benchmarks/bench_columns.py [--rows 2048] [--dim 2048] [--rounds 5]

Two named models (one without an embedding, one with a ``--dim``-wide one), ``--rows`` ok rows, from the engine's
answer rows to Arrow struct columns: each embedding a list of Python floats (``tolist()`` per row) and each row's
struct a dict given to Arrow row by row, against the numpy vectors the engines give and
``pipeline.columns.model_columns`` (one numpy block per embedding column). Printed: microseconds per row, the median of ``--rounds`` after a warm one.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipeline.columns import model_columns, output_schema, work_schema  # noqa: E402
from pipeline.engines.base import Result  # noqa: E402
from pipeline.model.spec import EmbeddingSpec  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    n, dim = args.rows, args.dim
    vectors = np.random.default_rng(0).standard_normal((n, dim)).astype(np.float32)
    bundles = [SimpleNamespace(name=name, digest="0" * 64, spec=SimpleNamespace(
        embedding=EmbeddingSpec(output="features", dim=d) if d else None)) for name, d in (("first", 0), ("second", dim))]
    schema = work_schema(output_schema((("first", None), ("second", dim))))
    batch = pa.table({f.name: pa.nulls(n, f.type) for f in schema}, schema=schema)

    def rows(embedding):
        return [[Result("ok", class_ids=[1, 2, 3, 4, 5], labels=list("abcde"), scores=[0.5, 0.2, 0.1, 0.1, 0.1],
                        embedding=embedding(i)) for i in range(n)] for embedding in (lambda i: None, embedding)]

    def per_row(make, build) -> float:
        times = []
        for _ in range(args.rounds + 1):
            started = time.perf_counter()
            answers = rows(make)  # the engine's side: a list per row, or a view of its array
            build(answers)
            times.append((time.perf_counter() - started) / n * 1e6)
        return statistics.median(times[1:])

    def row_by_row(answers, *_):  # each row's struct as a dict of Python values, then Arrow row by row
        return [(name, pa.array([{"class_ids": r.class_ids, "labels": r.labels, "scores": r.scores, "model": b.name,
                                  "model_digest": b.digest, **({"embedding": r.embedding} if b.spec.embedding else {})}
                                 for r in rows], schema.field(name).type))
                for name, b, rows in zip(("first", "second"), bundles, answers)]

    lists = per_row(lambda i: vectors[i].tolist(), row_by_row)
    arrays = per_row(lambda i: vectors[i], lambda answers, *_: model_columns(("first", "second"), bundles, answers,
                                                                              batch))
    print(f"{n} rows, an embedding {dim} wide; microseconds per row (median of {args.rounds})")
    print(f"{'embedding as':<22} {'us/row':>8}")
    print(f"{'Python floats, by row':<22} {lists:>8.1f}")
    print(f"{'numpy, one block':<22} {arrays:>8.1f}")
    print(f"{'ratio':<22} {lists / arrays:>7.1f}x")


if __name__ == "__main__":
    main()
