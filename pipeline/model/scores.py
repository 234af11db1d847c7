"""How a network's raw outputs become a row's scores, per the spec's ``output``: a softmax over logits, a sigmoid per
class (a multi-label model), or probabilities as given; a row holding NaN or infinity scores NaN (no answer)."""

from __future__ import annotations

import numpy as np

from pipeline.model.spec import OUTPUT_LOGITS, OUTPUT_PROBABILITIES, OUTPUT_SIGMOID, EmbeddingSpec


def scores_of(raw: np.ndarray, output: str = OUTPUT_LOGITS) -> np.ndarray:
    """(N, C) float64 scores of raw outputs (N, C): rows with any non-finite value are all NaN."""
    x = np.asarray(raw, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"outputs must be (batch, classes), got shape {x.shape}")
    finite = np.isfinite(x).all(axis=1, keepdims=True)
    x = np.where(finite, x, 0.0)
    if output == OUTPUT_PROBABILITIES:
        scores = x
    elif output == OUTPUT_SIGMOID:
        scores = 0.5 * (1.0 + np.tanh(0.5 * x))  # the logistic function, without exp's overflow
    elif output == OUTPUT_LOGITS:
        e = np.exp(x - x.max(axis=1, keepdims=True))
        scores = e / e.sum(axis=1, keepdims=True)
    else:
        raise ValueError(f"unknown output kind {output!r}")
    return np.where(finite, scores, np.nan)


def top_scores(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (N, k) int64, scores (N, k) float32) of the k highest scores per row, descending; ``k`` capped at C. A
    NaN row's scores stay NaN."""
    k = max(1, min(int(k), scores.shape[1]))
    order = np.where(np.isnan(scores), -np.inf, scores)  # a NaN row keeps some ids, its scores stay NaN
    if k < scores.shape[1]:
        part = np.argpartition(-order, k - 1, axis=1)[:, :k]
    else:
        part = np.tile(np.arange(scores.shape[1]), (scores.shape[0], 1))
    ranked = np.argsort(-np.take_along_axis(order, part, axis=1), axis=1, kind="stable")
    ids = np.take_along_axis(part, ranked, axis=1).astype(np.int64)
    return ids, np.take_along_axis(scores, ids, axis=1).astype(np.float32)


def embeddings_of(values: np.ndarray, spec: EmbeddingSpec) -> np.ndarray:
    """(N, dim) float32 embeddings of a network's embedding tensor, each row L2-normalised where ``spec`` says (a
    zero row stays zero; a row holding NaN or infinity stays so)."""
    vectors = np.asarray(values, np.float32).reshape(len(values), -1)
    if not spec.normalize:
        return vectors
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(norms == 0, np.float32(0), vectors / norms).astype(np.float32)
