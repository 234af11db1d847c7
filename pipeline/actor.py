"""The Ray actor: loads the model and its engine once, then turns batches of bytes into result columns."""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any, Mapping

import pyarrow as pa

from pipeline.engines.base import EngineSpec
from pipeline.schema import (
    CALLS, CLASSIFIED_AT, CLASS_IDS, DATA, DECODE_S, ENGINE, ENGINE_EVENTS, ERROR, HEIGHT, INFER_S, LABELS,
    MODEL, MODEL_DIGEST, SCORES, STAGE_DECODE, STAGE_INFER, STATUS, STATUS_ERROR, STATUS_OK, WIDTH,
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
    ):
        from pipeline.errors import ModelError
        from pipeline.model.imaging import DecodeLimits
        from pipeline.model.folder import load_model
        from pipeline.node import follow_driver_logging

        follow_driver_logging()
        started = time.perf_counter()
        self.bundle = load_model(model)
        if model_digest is not None and self.bundle.digest != model_digest:
            # The folder changed after the driver checked it: rows of two models must never mix in one output.
            raise ModelError(f"model {model!r} changed during the run (digest {self.bundle.short_digest}, the run "
                             f"started with {model_digest[:12]}); rerun once the model folder stays unchanged")
        # ``engine`` and ``engine_options`` as the driver decided them: the spec looked up, the options parsed.
        spec = engine
        limits = DecodeLimits(max_bytes=max_bytes, max_pixels=max_pixels)
        self.engine = spec.build(self.bundle, top_k=top_k, limits=limits, options=engine_options or {})
        self.engine_name = spec.name
        self._reported: dict[str, int] = {}  # the engine's ``events`` as far as rows carry them already
        self._events_lock = threading.Lock()
        # Ray Data ends a finished pool's actors by dropping their handles, which exits the worker without
        # calling __del__; atexit still runs, so a local tritonserver and its shared memory go with us.
        atexit.register(self.close)
        LOG.info("actor ready in %.1f s: model=%s engine=%s", time.perf_counter() - started, self.bundle.name, spec.name)

    def __call__(self, batch: pa.Table) -> pa.Table:
        data = batch.column(DATA).to_pylist()
        status = batch.column(STATUS).to_pylist()
        error = batch.column(ERROR).to_pylist()
        todo = [i for i in range(len(data)) if status[i] is None and data[i] is not None]
        n = len(data)
        class_ids = batch.column(CLASS_IDS).to_pylist()
        labels = batch.column(LABELS).to_pylist()
        scores = batch.column(SCORES).to_pylist()
        width = batch.column(WIDTH).to_pylist()
        height = batch.column(HEIGHT).to_pylist()
        model = batch.column(MODEL).to_pylist()
        digest = batch.column(MODEL_DIGEST).to_pylist()
        engine = batch.column(ENGINE).to_pylist()
        when = batch.column(CLASSIFIED_AT).to_pylist()
        now = datetime.now(timezone.utc)
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
                status[i], error[i] = r.status, r.error
                class_ids[i], labels[i], scores[i] = r.class_ids, r.labels, r.scores
                width[i], height[i] = r.width, r.height
                infer_s[i], calls[i] = share, 1.0 / len(todo)
                decode_s[i] = None if decode is None else decode / len(todo)
        events: list[str | None] = [None] * n
        if n:
            events[0] = self._new_events()
        for i in range(n):
            model[i], digest[i], engine[i], when[i] = self.bundle.name, self.bundle.digest, self.engine_name, now
            if status[i] is None:  # no bytes and no error: cannot happen, but never emit a row without status
                status[i], error[i] = STATUS_ERROR, "fetch_error: no bytes were fetched for this object"
            if status[i] == STATUS_OK:
                error[i] = None
        out = batch
        for name, values in (
            (STATUS, status), (ERROR, error), (CLASS_IDS, class_ids), (LABELS, labels),
            (SCORES, scores), (WIDTH, width), (HEIGHT, height), (MODEL, model), (MODEL_DIGEST, digest),
            (ENGINE, engine),
            (CLASSIFIED_AT, when), (DECODE_S, decode_s), (INFER_S, infer_s), (CALLS, calls),
            (ENGINE_EVENTS, events),
        ):
            idx = out.schema.get_field_index(name)
            out = out.set_column(idx, out.schema.field(idx), pa.array(values, out.schema.field(idx).type))
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
