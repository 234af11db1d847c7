"""How a network's raw outputs become a row's scores, per the spec's ``output``: a softmax over logits, a sigmoid per
class (a multi-label model), or probabilities as given; a row holding NaN or infinity scores NaN (no answer). And its
embedding tensor a row's embedding, per the spec's ``embedding``."""

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
    """(N, spec.dim) float32 embeddings of an embedding tensor's values (N, dim), each row scaled to unit L2 norm
    where ``spec.normalize`` (in float64, so that tiny and huge rows normalise too). A zero row stays zero; a row
    holding NaN or infinity stays non-finite, for the caller to write as an error row."""
    x = np.asarray(values)
    if x.ndim != 2 or x.shape[1] != spec.dim:
        raise ValueError(f"embedding {spec.output!r} must be (batch, {spec.dim}), got shape {x.shape}")
    if not spec.normalize:
        return x.astype(np.float32)
    x = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        # inf/inf would be NaN, x/0 would be NaN for a zero row: divide only finite, non-zero rows
        scale = np.where(np.isfinite(norms) & (norms > 0), norms, 1.0)
        out = x / scale
    out[~np.isfinite(norms[:, 0])] = np.nan
    return out.astype(np.float32)
