"""The Triton hop alone: the gpu profile's served models with no DALI and no torch, each answer derived from its
bytes, so that every answer can be checked against its own image.

``serve_hop(repo)`` points a built gpu repository's python models at this module's subclasses of theirs (``HopModel``
for the library's single model, ``HopPreprocessModel`` and ``HopNetworkModel`` for gpu_ensemble.py's ensemble shape):
the server side (execute(), the request stream, the ensemble's wiring, every ECHO) then runs on a machine without a
GPU. The integration tests check the served path with it, and tests/benchmarks/bench_hop.py and bench_gpu.py time the hop.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from pipeline.errors import ImageError  # noqa: E402
from pipeline.gpu.classifier import STOP, triage  # noqa: E402
from pipeline.gpu.defaults import GPU_DEFAULT_BATCH_SIZE  # noqa: E402
from pipeline.model.imaging import DecodeLimits  # noqa: E402
from pipeline.schema import DEFAULT_TOP_K  # noqa: E402
from pipeline.triton import contract as tn  # noqa: E402
from pipeline.triton.repository import SHIM_FILE, VERSION  # noqa: E402
from pipeline.triton.serve.backend import as_numpy  # noqa: E402
from pipeline.triton.serve.gpu_model import TritonPythonModel  # noqa: E402
from pipeline.triton.server import STUB_PATH_ENV  # noqa: E402

from gpu_ensemble import NETWORK_MODEL, NetworkModel, Preprocessed, PreprocessModel  # noqa: E402

HOP = "hop"  # the decoder name the hop's stream reports
HOP_ERROR = "unsupported: not a JPEG the gpu path decodes (the hop)"
CLASSES = 1000
# echo_ids reads this much of each end of a file: hashing whole files would weigh on the hop it stands in for, and
# the two ends and the length tell any two of the tests' and benchmarks' files apart.
ECHO_SAMPLE_BYTES = 2048
_SHIM = '''"""Triton python-backend entry of the hop: tests/benchmarks/hop_model.{cls} (written by serve_hop)."""

import os
import sys

sys.path[:0] = [p for p in os.environ.get("{env}", "").split(os.pathsep) if p and p not in sys.path]

from hop_model import {cls} as TritonPythonModel  # noqa: E402,F401
'''


def echo_ids(blobs: list[bytes], top_k: int) -> np.ndarray:
    """The hop's answer for each image: k ids from a CRC-32 of its length and both ends."""
    k = ECHO_SAMPLE_BYTES
    base = np.array([zlib.crc32(b[-k:], zlib.crc32(b[:k], len(b))) % CLASSES for b in blobs],
                    dtype=np.int32).reshape(-1, 1)
    return ids_from(base, top_k)


def ids_from(base: np.ndarray, top_k: int) -> np.ndarray:
    """k consecutive class ids from each row's ``base`` id."""
    return ((base.reshape(-1, 1) + np.arange(top_k, dtype=np.int32)) % CLASSES).astype(np.int32)


def hop_scores(n: int, top_k: int) -> np.ndarray:
    """The hop's descending scores, the same for every image."""
    return np.tile(np.linspace(0.5, 0.1, top_k, dtype=np.float32), (n, 1))


class NullClassifier:
    """A ``GpuClassifier`` that does no work, for ``RequestStream``: JPEGs get their ``echo_ids``, the rest an error."""

    decoder_name = HOP

    def __init__(self, *, batch_size: int = GPU_DEFAULT_BATCH_SIZE, top_k: int = DEFAULT_TOP_K,
                 in_flight: int = 4):
        self.batch_size = batch_size
        self.top_k = top_k
        self.in_flight = in_flight
        self.limits = DecodeLimits()

    def warmup(self) -> None:
        pass

    def run_stream(self, source, sink) -> None:
        window: list = []
        while True:
            chunk = source(not window)
            if chunk is not None and chunk is not STOP:
                # what DALI would not take is an error here (nothing decodes it), the rest "classified"
                chunk.ok = [p for p, it in enumerate(chunk.items) if it.info is not None]
                chunk.errors = {it.index: HOP_ERROR for it in chunk.items if it.info is None}
                window.append(chunk)
            if window and (chunk is None or chunk is STOP or len(window) >= self.in_flight):
                done = window.pop(0)
                ok = [done.items[p].data for p in done.ok]
                sink(done, echo_ids(ok, self.top_k), hop_scores(len(ok), self.top_k), None)
            if chunk is STOP and not window:
                return

    def close(self) -> None:
        pass


class HopPreparer:
    """The ensemble's preprocess under the hop: triage, and each JPEG's echo id in its tensor's first value."""

    def __init__(self, shape, half: bool):
        self.shape, self.half = shape, half

    def preprocess(self, blobs: list[bytes], limits: DecodeLimits) -> Preprocessed:
        """(tensors [n, *shape], width [n], height [n], errors) as ``GpuPreparer.preprocess`` gives them."""
        n = len(blobs)
        x = np.zeros((n, *self.shape), dtype=np.float16 if self.half else np.float32)
        width, height, errors, ok = np.zeros(n, np.int32), np.zeros(n, np.int32), [""] * n, []
        for i, data in enumerate(blobs):
            try:
                item = triage(i, data, limits)
            except ImageError as err:
                errors[i] = str(err)
                continue
            if item.info is None:
                errors[i] = HOP_ERROR
                continue
            ok.append(i)
            width[i], height[i] = item.width, item.height
        if ok:
            x[ok, 0, 0, 0] = echo_ids([blobs[i] for i in ok], 1)[:, 0]
        return Preprocessed(x, width, height, errors)

    def close(self) -> None:
        pass


class HopModel(TritonPythonModel):
    """The single shape's model with ``NullClassifier`` behind its request stream."""

    def _build_classifier(self, config, folder, spec, device, net_name, batch_size):
        return NullClassifier(batch_size=batch_size, top_k=self.top_k)


class HopPreprocessModel(PreprocessModel):
    """The ensemble's preprocess model with ``HopPreparer`` in place of DALI."""

    def _build_classifier(self, config, spec, device, batch_size):
        return HopPreparer(self.shape, self.half)


class HopNetworkModel(NetworkModel):
    """The ensemble's network model turning each row's echo id into that image's classes, torch-free."""

    def _load_network(self, args, config, folder, spec, tensor, shape) -> None:
        self.network = None

    def _classify(self, inputs, status):
        parts = [as_numpy(t) for t in inputs]
        x = np.concatenate(parts)
        ids, scores = ids_from(x.reshape(len(x), -1)[:, 0].astype(np.int32), self.top_k), hop_scores(len(x), self.top_k)
        failed = np.concatenate([as_numpy(t).reshape(-1) for t in status]) != 0
        return ids, scores, failed, [len(p) for p in parts]

    def finalize(self):
        pass


def serve_hop(repo) -> Path:
    """Points the python models of a gpu repository (either shape) at the hop's, and puts this folder on the
    PYTHONPATH a server started from this process passes to its stubs. Returns the repository."""
    folders = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(HERE) not in folders:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, folders)])
    repo = Path(repo)
    for name, cls in ((tn.MODEL_NAME, "HopModel"), (tn.PREPROCESS_MODEL, "HopPreprocessModel"),
                      (NETWORK_MODEL, "HopNetworkModel")):
        shim = repo / name / VERSION / SHIM_FILE
        if shim.is_file():
            shim.write_text(_SHIM.format(cls=cls, env=STUB_PATH_ENV), encoding="utf-8")
    return repo
