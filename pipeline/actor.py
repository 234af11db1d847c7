"""The Ray actor: loads the model and its engine once, then turns batches of bytes into result columns."""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any, Mapping, Sequence

import pyarrow as pa

from pipeline.columns import model_columns, row_answers, row_status
from pipeline.engines.base import EngineSpec
from pipeline.schema import (
    CALLS, CLASSIFIED_AT, DATA, DECODE_S, ENGINE, ENGINE_EVENTS, ERROR, HEIGHT, INFER_S, MODEL, MODEL_DIGEST,
    STAGE_DECODE, STAGE_INFER, STATUS, STATUS_ERROR, STATUS_OK, WIDTH,
)

LOG = logging.getLogger(__name__)


class ClassifyActor:
    """Callable class for ``map_batches``: heavy set-up in ``__init__``, a plain column transform per call."""

    def __init__(
        self,
        *,
        model: str | None,
        engine: EngineSpec,
        top_k: int,
        max_bytes: int,
        max_pixels: int,
        engine_options: Mapping[str, Any] | None = None,
        model_digest: str | None = None,
        models: Sequence[tuple[str, str, str]] = (),
    ):
        """``model``/``model_digest``: one unnamed model and the digest the driver checked; ``models``: a model set
        instead, as (name, folder, digest) each, written to one struct column per name."""
        from pipeline.errors import ModelError
        from pipeline.model.imaging import DecodeLimits
        from pipeline.model.folder import load_model
        from pipeline.model.model_set import ModelSet, NamedModel
        from pipeline.node import follow_driver_logging

        follow_driver_logging()
        started = time.perf_counter()
        refs = [(ref, digest) for _name, ref, digest in models] or [(model, model_digest)]
        bundles = []
        for ref, digest in refs:
            bundle = load_model(ref)
            if digest is not None and bundle.digest != digest:
                # The folder changed after the driver checked it: rows of two models must never mix in one output.
                raise ModelError(f"model {ref!r} changed during the run (digest {bundle.short_digest}, the run "
                                 f"started with {digest[:12]}); rerun once the model folder stays unchanged")
            bundles.append(bundle)
        self.bundle = bundles[0]
        self.names = tuple(name for name, _ref, _digest in models)  # empty: one unnamed model's columns
        self.bundles = tuple(bundles)
        self.identity = ModelSet(tuple(map(NamedModel, self.names, bundles))) if models else self.bundle
        # ``engine`` and ``engine_options`` as the driver decided them: the spec looked up, the options parsed.
        limits = DecodeLimits(max_bytes=max_bytes, max_pixels=max_pixels)
        self.engine = engine.build(self.bundle, top_k=top_k, limits=limits, options=engine_options or {},
                                   more=self.bundles[1:])
        self.engine_name = engine.name
        self._reported: dict[str, int] = {}  # the engine's ``events`` as far as rows carry them already
        self._events_lock = threading.Lock()
        # Ray Data ends a finished pool's actors by dropping their handles, which exits the worker without
        # calling __del__; atexit still runs, so a local tritonserver and its shared memory go with us.
        atexit.register(self.close)
        LOG.info("actor ready in %.1f s: model=%s engine=%s", time.perf_counter() - started, self.identity.name,
                 engine.name)

    def __call__(self, batch: pa.Table) -> pa.Table:
        data, status, error, width, height = (batch.column(c).to_pylist() for c in (DATA, STATUS, ERROR, WIDTH, HEIGHT))
        todo = [i for i in range(len(data)) if status[i] is None and data[i] is not None]
        n = len(data)
        answers: list[list[Any]] = [[None] * n for _ in self.bundles]  # each model's Result per row
        infer_s = [0.0] * n
        decode_s: list[float | None] = [None] * n
        calls = [0.0] * n
        if todo:
            before = dict(self.engine.stage_seconds)
            started = time.perf_counter()
            results = self.engine.classify([data[i] for i in todo])
            wall = time.perf_counter() - started
            after = self.engine.stage_seconds
            # Engines that can split decode from inference report both stages; the others report only "infer",
            # which is this call's wall time (calls may overlap: --calls-per-actor).
            decode = after[STAGE_DECODE] - before[STAGE_DECODE] if STAGE_DECODE in after else None
            infer = after[STAGE_INFER] - before[STAGE_INFER] if decode is not None else wall
            share = infer / len(todo)
            if len(results) != len(todo):
                raise RuntimeError(f"engine {self.engine_name} returned {len(results)} results for {len(todo)} images")
            for i, r in zip(todo, results):
                status[i], error[i] = row_status(r, self.names)
                for m, answer in enumerate(row_answers(r, len(self.bundles), self.engine_name)):
                    answers[m][i] = answer
                width[i], height[i] = r.width, r.height
                infer_s[i], calls[i] = share, 1.0 / len(todo)
                decode_s[i] = None if decode is None else decode / len(todo)
        events = [self._new_events() if i == 0 else None for i in range(n)]  # on one row of the call
        for i in range(n):
            if status[i] is None:  # no bytes and no error: cannot happen, but never emit a row without status
                status[i], error[i] = STATUS_ERROR, "fetch_error: no bytes were fetched for this object"
            if status[i] == STATUS_OK:
                error[i] = None
        out = batch
        for name, values in (
            (STATUS, status), (ERROR, error), *model_columns(self.names, self.bundles, answers, batch), (WIDTH, width),
            (HEIGHT, height), (MODEL, [self.identity.name] * n), (MODEL_DIGEST, [self.identity.digest] * n),
            (ENGINE, [self.engine_name] * n), (CLASSIFIED_AT, [datetime.now(timezone.utc)] * n), (DECODE_S, decode_s),
            (INFER_S, infer_s), (CALLS, calls), (ENGINE_EVENTS, events),
        ):
            idx = out.schema.get_field_index(name)
            kind = out.schema.field(idx).type
            if not isinstance(values, pa.Array):
                column = pa.array(values, kind)
            else:  # model_columns' struct and embedding columns, built as arrays already
                column = values if values.type == kind else values.cast(kind)
            out = out.set_column(idx, out.schema.field(idx), column)
        return out.set_column(out.schema.get_field_index(DATA), DATA, pa.nulls(n, pa.binary()))

    def _new_events(self) -> str | None:
        """JSON of the engine's counters (``events``, if it keeps any) not yet carried by a row, or None."""
        counters = getattr(self.engine, "events", None)
        if not counters:
            return None
        with self._events_lock:
            now = dict(counters)
            delta = {k: v - self._reported.get(k, 0) for k, v in now.items() if v != self._reported.get(k, 0)}
            self._reported = now
        return json.dumps(delta, sort_keys=True) if delta else None

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            try:
                engine.close()
            except Exception:  # noqa: BLE001 - best effort at interpreter exit
                LOG.warning("closing the %s engine failed", self.engine_name, exc_info=True)

    __del__ = close
