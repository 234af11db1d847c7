"""The production profile's DALI model: the contract's padded IMAGE, LENGTH and TAG inputs into the gpu paths'
preprocessing graph (``pipeline.gpu.dali_graph``), its outputs PREPROCESSED, WIDTH, HEIGHT and, with the TAG, ECHO.

The repository's ``dali.py`` serializes ``pipeline_graph``; the CPU parity tests run the same graph.
"""

from __future__ import annotations

import numpy as np

from pipeline.gpu.dali_graph import preprocess_graph
from pipeline.model.imaging import PreprocessSpec
from pipeline.triton import contract as tn


def pipeline_graph(spec: PreprocessSpec, *, device: str = "mixed", with_tag: bool = False):
    """The graph, to be called inside a ``pipeline_def``: external inputs IMAGE (UINT8, padded) and LENGTH (INT32),
    outputs (PREPROCESSED, WIDTH, HEIGHT) in that order. ``device`` is "mixed" (GPU decode) or "cpu". ``with_tag``
    (the production model): a third input TAG (INT64), passed through as a fourth output, ECHO, sample by sample."""
    import nvidia.dali.fn as fn  # noqa: PLC0415 - DALI is an optional, heavy dependency
    import nvidia.dali.types as types  # noqa: PLC0415

    raw = fn.external_source(name=tn.INPUT_IMAGE, dtype=types.UINT8, ndim=1, device="cpu")
    length = fn.external_source(name=tn.INPUT_LENGTH, dtype=types.INT32, ndim=1, device="cpu")
    # Requests are zero-padded to their longest image; LENGTH gives each file its own bytes back.
    encoded = fn.slice(raw, np.array([0], dtype=np.int32), length, axes=[0],
                       normalized_anchor=False, normalized_shape=False)
    outputs = preprocess_graph(encoded, spec, device=device)
    if not with_tag:
        return outputs
    tag = fn.external_source(name=tn.INPUT_TAG, dtype=types.INT64, ndim=1, device="cpu")
    return (*outputs, tag.gpu() if device == "mixed" else tag)
