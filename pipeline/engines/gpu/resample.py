"""Pillow's resampling coefficients (numpy and torch) and crop boxes, so the GPU resize matches the reference."""

from __future__ import annotations

import math

import numpy as np

from pipeline.imaging import PreprocessSpec

# Pillow's filter supports (Resample.c); "nearest" is a one-tap special case.
FILTER_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0, "lanczos": 3.0}
BICUBIC_A = -0.5  # Pillow's bicubic uses a = -0.5


def _filter(name: str, x: np.ndarray) -> np.ndarray:
    ax = np.abs(x)
    if name == "bilinear":
        return np.where(ax < 1.0, 1.0 - ax, 0.0)
    if name == "bicubic":
        a = BICUBIC_A
        near = ((a + 2.0) * ax - (a + 3.0)) * ax * ax + 1.0
        far = (((ax - 5.0) * ax + 8.0) * ax - 4.0) * a
        return np.where(ax < 1.0, near, np.where(ax < 2.0, far, 0.0))
    if name == "lanczos":
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(ax < 3.0, np.sinc(x) * np.sinc(x / 3.0), 0.0)
    raise ValueError(f"no resampling filter {name!r}")


def resample_coefficients(
    in_sizes: np.ndarray, box_starts: np.ndarray, box_lengths: np.ndarray, out_size: int, interpolation: str
) -> tuple[np.ndarray, np.ndarray]:
    """Pillow's resampling coefficients (``precompute_coeffs`` in Resample.c) for many images along one axis.

    Output pixel ``j`` of image ``i`` is ``sum_k weights[i, j, k] * src[starts[i, j] + k]``; taps past the image
    edge have weight 0. Computing them as Pillow does (box in source pixels, kernel widened by the downscale
    factor, edge taps dropped and renormalised) is what makes the GPU resize match the CPU reference.

    Returns:
        (starts int64 [N, out], weights float32 [N, out, taps])
    """
    in_sizes = np.asarray(in_sizes, dtype=np.float64)
    box_starts = np.asarray(box_starts, dtype=np.float64)
    scale = np.asarray(box_lengths, dtype=np.float64) / out_size
    centers = box_starts[:, None] + (np.arange(out_size, dtype=np.float64)[None, :] + 0.5) * scale[:, None]
    if interpolation == "nearest":
        # Pillow resizes NEAREST through an affine transform that samples floor(center).
        starts = np.clip(np.floor(centers), 0, in_sizes[:, None] - 1).astype(np.int64)
        return starts, np.ones(starts.shape + (1,), dtype=np.float32)
    support0 = FILTER_SUPPORT[interpolation]
    filterscale = np.maximum(scale, 1.0)
    support = support0 * filterscale
    taps = int(math.ceil(float(support.max()))) * 2 + 1
    xmin = np.maximum(np.trunc(centers - support[:, None] + 0.5), 0.0)
    xmax = np.minimum(np.trunc(centers + support[:, None] + 0.5), in_sizes[:, None]) - xmin
    k = np.arange(taps, dtype=np.float64)
    arg = (k[None, None, :] + xmin[..., None] - centers[..., None] + 0.5) / filterscale[:, None, None]
    weights = _filter(interpolation, arg)
    weights = np.where(k[None, None, :] < xmax[..., None], weights, 0.0)
    total = weights.sum(axis=-1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total != 0)
    return xmin.astype(np.int64), weights.astype(np.float32)


def resample_coefficients_torch(in_sizes, box_starts, box_lengths, out_size: int, interpolation: str, device):
    """``resample_coefficients`` computed on the device with torch (float64), same results; tensors out."""
    import torch  # noqa: PLC0415

    f64 = torch.float64
    in_sizes = torch.as_tensor(np.asarray(in_sizes, dtype=np.float64), device=device)
    box_starts = torch.as_tensor(np.asarray(box_starts, dtype=np.float64), device=device)
    scale = torch.as_tensor(np.asarray(box_lengths, dtype=np.float64), device=device) / out_size
    j = torch.arange(out_size, dtype=f64, device=device)
    centers = box_starts[:, None] + (j[None, :] + 0.5) * scale[:, None]
    if interpolation == "nearest":
        starts = torch.minimum(torch.clamp(torch.floor(centers), min=0), in_sizes[:, None] - 1).to(torch.int64)
        return starts, torch.ones(starts.shape + (1,), dtype=torch.float32, device=device)
    filterscale = torch.clamp(scale, min=1.0)
    support = FILTER_SUPPORT[interpolation] * filterscale
    taps = int(math.ceil(float(support.max()))) * 2 + 1
    xmin = torch.clamp(torch.trunc(centers - support[:, None] + 0.5), min=0.0)
    xmax = torch.minimum(torch.trunc(centers + support[:, None] + 0.5), in_sizes[:, None]) - xmin
    k = torch.arange(taps, dtype=f64, device=device)
    x = (k[None, None, :] + xmin[..., None] - centers[..., None] + 0.5) / filterscale[:, None, None]
    ax = x.abs()
    if interpolation == "bilinear":
        w = torch.clamp(1.0 - ax, min=0.0)
    elif interpolation == "bicubic":
        a = BICUBIC_A
        near = ((a + 2.0) * ax - (a + 3.0)) * ax * ax + 1.0
        far = (((ax - 5.0) * ax + 8.0) * ax - 4.0) * a
        w = torch.where(ax < 1.0, near, torch.where(ax < 2.0, far, torch.zeros_like(ax)))
    elif interpolation == "lanczos":
        w = torch.where(ax < 3.0, torch.sinc(x) * torch.sinc(x / 3.0), torch.zeros_like(ax))
    else:
        raise ValueError(f"no resampling filter {interpolation!r}")
    w = torch.where(k[None, None, :] < xmax[..., None], w, torch.zeros_like(w))
    total = w.sum(dim=-1, keepdim=True)
    w = torch.where(total != 0, w / torch.where(total != 0, total, torch.ones_like(total)), w)
    return xmin.to(torch.int64), w.to(torch.float32)


def crop_boxes(widths: np.ndarray, heights: np.ndarray, spec: PreprocessSpec) -> tuple[np.ndarray, ...]:
    """The source-pixel box each image's crop covers (as ``pipeline.imaging.preprocess_image`` computes it).

    Returns:
        (left, top, box_width, box_height), float64 arrays.
    """
    widths = np.asarray(widths, dtype=np.float64)
    heights = np.asarray(heights, dtype=np.float64)
    crop_h, crop_w = spec.crop
    factor = spec.resize_shorter / np.minimum(widths, heights)
    box_w, box_h = crop_w / factor, crop_h / factor
    return (widths - box_w) / 2.0, (heights - box_h) / 2.0, box_w, box_h
