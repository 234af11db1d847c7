"""The gpu profile's ``network: "none"``: the Triton hop alone, no DALI, no torch, each answer derived from its bytes.

It ships because tritonserver's stubs import only this package: it is how the gpu profile's server side (execute(),
the request stream, the ensemble's wiring, every ECHO) runs and is tested on a machine without a GPU, and how the hop
is benchmarked (tests/benchmarks/bench_hop.py).
"""

from __future__ import annotations

import zlib

import numpy as np

from pipeline.gpu.classifier import STOP, triage
from pipeline.errors import ImageError
from pipeline.model.imaging import DecodeLimits
from pipeline.triton import contract as tn

NETWORK_NONE = "none"  # the gpu profile's network parameter that selects the hop
HOP_ERROR = "unsupported: not a JPEG the gpu path decodes (network none)"
CLASSES = 1000
# echo_ids reads this much of each end of a file: hashing whole files would weigh on the hop it stands in for, and
# the two ends and the length tell any two of the tests' and benchmarks' files apart.
ECHO_SAMPLE_BYTES = 2048


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

    decoder_name = NETWORK_NONE

    def __init__(self, *, batch_size: int = tn.GPU_DEFAULT_BATCH_SIZE, top_k: int = tn.DEFAULT_TOP_K,
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


def hop_preprocess(blobs: list[bytes], limits: DecodeLimits, shape, half: bool):
    """The ensemble's preprocess model under the hop: triage, and each JPEG's echo id in its tensor's first value.

    Returns:
        (tensors [n, *shape], width [n], height [n], errors) as ``GpuClassifier.preprocess`` gives them.
    """
    n = len(blobs)
    x = np.zeros((n, *shape), dtype=np.float16 if half else np.float32)
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
    return x, width, height, errors


def hop_classes(x: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ensemble's network model under the hop: the classes of each row's echo id."""
    base = x.reshape(len(x), -1)[:, 0].astype(np.int32)
    return ids_from(base, top_k), hop_scores(len(x), top_k)
