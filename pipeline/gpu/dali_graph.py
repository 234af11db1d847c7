"""The DALI preprocessing graph (decode, resize, crop, normalize per a PreprocessSpec) that every GPU path runs: GPU
"mixed" for the gpu engine, the gpu profile and the production profile's DALI model, CPU for tests and parity checks
against the reference (pipeline.model.imaging).

The geometry is the reference's exactly: the shorter side scaled to ``resize_shorter`` by an exact factor and the
centred ``crop`` taken (with ``resize`` "squash", the whole image resized to ``crop``), resampled straight from the
source region of interest (no rounded intermediate size), with the same interpolation and antialiasing, in the
reference's two passes (horizontal, rounded to 8 bits, then vertical), with the reference's weights at the image's
edge where the crop box reaches it (``reaches_edge``).
EXIF orientation is applied by the decoder (``adjust_orientation``), and the GPU decoder uses libjpeg-turbo's "fancy"
chroma upsampling, as Pillow does.

A model set's graph (``preprocess_graphs``) decodes each file once and runs one such branch per distinct spec
(``branch_plan``: equal specs share one), so each model gets its own preprocessing of the one decode.

Known differences from the reference (measured in tests/integration/test_dali_parity.py, listed in docs/engines.md):
JPEG decoders round the IDCT differently (a few levels on edges); transparent pixels are not composited on white
(DALI drops alpha); GIF is not decoded. One corrupt file fails a whole DALI batch: callers isolate it (the gpu
paths decode that batch with the reference; the Triton engine splits the request).
"""

from __future__ import annotations

import re
from typing import Sequence

from pipeline.model.imaging import FILTER_SUPPORT, RESIZE_SQUASH, PreprocessSpec

ENCODED = "ENCODED"  # the external source of the gpu paths' DALI pipelines: one encoded file per sample, unpadded
# The spec's fields a branch reads; the rest (``output``, ``embedding``) are the network's.
BRANCH_FIELDS = ("resize", "resize_shorter", "interpolation", "antialias", "crop", "channel_order", "scale", "mean",
                 "std", "layout")
_INTERP = {"nearest": "INTERP_NN", "bilinear": "INTERP_LINEAR", "bicubic": "INTERP_CUBIC", "lanczos": "INTERP_LANCZOS3"}


def preprocess_graph(encoded, spec: PreprocessSpec, *, device: str = "mixed", hw_decoder_load: float | None = None,
                     half: bool = False, layout: str | None = None, fancy_upsampling: bool = True):
    """Decode + resize + crop + normalize of a DataNode of encoded files; returns (PREPROCESSED, WIDTH, HEIGHT).

    The one definition shared by the production ensemble's DALI model (``pipeline.triton.dali_pipeline``, which
    feeds the contract's padded files) and the gpu paths (``pipeline.gpu.dali``, which feed unpadded files).
    ``hw_decoder_load``: the share of each batch the "mixed" decoder gives the hardware JPEG engines (DALI's default
    when None). ``half``: FP16 output. ``layout``: "CHW" or "HWC" (default: the spec's layout). ``fancy_upsampling``:
    the reference's chroma upsampling on the GPU (False only to measure what it costs)."""
    (normalized,), out_w, out_h = preprocess_graphs(encoded, (spec,), device=device, hw_decoder_load=hw_decoder_load,
                                                    half=half, layout=layout, fancy_upsampling=fancy_upsampling)
    return normalized, out_w, out_h


def branch_key(spec: PreprocessSpec) -> tuple:
    """What a branch of the graph computes from the decoded image: specs with equal keys share one branch."""
    return tuple(getattr(spec, name) for name in BRANCH_FIELDS)


def branch_plan(specs: Sequence[PreprocessSpec]) -> tuple[list[PreprocessSpec], list[int]]:
    """The distinct branches of a model set's specs, first seen first, and each spec's branch index."""
    keys: dict[tuple, int] = {}
    branches: list[PreprocessSpec] = []
    index = []
    for spec in specs:
        key = branch_key(spec)
        if key not in keys:
            keys[key] = len(branches)
            branches.append(spec)
        index.append(keys[key])
    return branches, index


def preprocess_graphs(encoded, specs: Sequence[PreprocessSpec], *, device: str = "mixed",
                      hw_decoder_load: float | None = None, half: bool = False, layout: str | None = None,
                      fancy_upsampling: bool = True):
    """One decode of a DataNode of encoded files, then one resize + crop + normalize branch per distinct spec of
    ``specs`` (``branch_plan``); returns ([PREPROCESSED per branch], WIDTH, HEIGHT). The decoder gives the first
    spec's channel order; a branch in the other order swaps its channels after the resize (exact on 8-bit pixels).
    Arguments as ``preprocess_graph``'s, for every branch."""
    import nvidia.dali.fn as fn  # noqa: PLC0415 - DALI is an optional, heavy dependency
    import nvidia.dali.types as types  # noqa: PLC0415

    branches, _ = branch_plan(specs)
    decoded = branches[0].channel_order
    decoder_args = {"output_type": types.BGR if decoded == "BGR" else types.RGB, "adjust_orientation": True}
    if device == "mixed":
        decoder_args["jpeg_fancy_upsampling"] = fancy_upsampling  # libjpeg-turbo's (and so Pillow's) chroma upsampling
        if hw_decoder_load is not None:
            decoder_args["hw_decoder_load"] = float(hw_decoder_load)
    image = fn.decoders.image(encoded, device=device, **decoder_args)
    outputs = [_branch(image, spec, decoded, half=half, layout=layout) for spec in branches]
    int_shape = image.shape(dtype=types.INT32)
    out_h = fn.reshape(int_shape[0], shape=[1])
    out_w = fn.reshape(int_shape[1], shape=[1])
    if device == "mixed":
        out_w, out_h = out_w.gpu(), out_h.gpu()
    return outputs, out_w, out_h


def _branch(image, spec: PreprocessSpec, decoded: str, *, half: bool, layout: str | None):
    """Resize + crop + normalize of a decoded uint8 HWC DataNode in channel order ``decoded``, per ``spec``."""
    import nvidia.dali.fn as fn  # noqa: PLC0415
    import nvidia.dali.math as dmath  # noqa: PLC0415
    import nvidia.dali.types as types  # noqa: PLC0415

    shape = image.shape(dtype=types.FLOAT)
    height, width = shape[0], shape[1]
    crop_h, crop_w = spec.crop
    # The crop box in source pixels, exact as in pipeline.model.imaging.crop_box: squashing takes the whole image.
    if spec.resize == RESIZE_SQUASH:
        box_h, box_w, top, left = height, width, 0.0 * height, 0.0 * width
    else:
        shorter = dmath.min(height, width)
        box_h = crop_h * shorter / float(spec.resize_shorter)
        box_w = crop_w * shorter / float(spec.resize_shorter)
        top = (height - box_h) / 2.0
        left = (width - box_w) / 2.0
    resample = {"roi_relative": False, "interp_type": getattr(types, _INTERP[spec.interpolation]),
                "antialias": spec.antialias, "dtype": types.UINT8}
    if spec.interpolation == "nearest":
        resized = fn.resize(image, size=[crop_h, crop_w], roi_start=fn.stack(top, left),
                            roi_end=fn.stack(top + box_h, left + box_w), **resample)
    else:
        # Two passes as the reference makes them (pipeline.model.imaging._resample): horizontal, rounded to 8 bits, then
        # vertical. One fn.resize keeps the intermediate in float and picks its own pass order; on the parity set
        # that moved pixels by up to 16 levels and cost 2.3 points of top-1 agreement.
        if not reaches_edge(spec):
            mid = fn.resize(image, size=fn.stack(height, float(crop_w)), roi_start=fn.stack(0.0, left),
                            roi_end=fn.stack(height, left + box_w), **resample)
            resized = fn.resize(mid, size=[crop_h, crop_w], roi_start=fn.stack(top, 0.0),
                                roi_end=fn.stack(top + box_h, float(crop_w)), **resample)
        else:
            support = FILTER_SUPPORT[spec.interpolation]
            mid = _edge_pass(image, 1, fn.stack(height, float(crop_w)), left, box_w, width, crop_w, support, resample)
            resized = _edge_pass(mid, 0, [crop_h, crop_w], top, box_h, height, crop_h, support, resample)
    if spec.channel_order != decoded:
        order = {"RGB": types.RGB, "BGR": types.BGR}
        resized = fn.color_space_conversion(resized, image_type=order[decoded], output_type=order[spec.channel_order])
    # reference: (v * scale - mean) / std  ==  (v - mean / scale) / (std / scale)
    normalized = fn.crop_mirror_normalize(
        resized,
        mean=[m / spec.scale for m in spec.mean],
        std=[s / spec.scale for s in spec.std],
        output_layout=layout or ("CHW" if spec.layout == "NCHW" else "HWC"),
        dtype=types.FLOAT16 if half else types.FLOAT,
    )
    return normalized


def reaches_edge(spec: PreprocessSpec) -> bool:
    """Whether the filter reaches past the image's edge for ordinary image sizes: the whole image squashed, or a crop
    within the filter's reach of ``resize_shorter``. There Pillow shortens the filter and renormalizes its weights,
    while ``fn.resize`` repeats the edge pixel, so those specs take ``_edge_pass``."""
    if spec.interpolation == "nearest":
        return False
    return spec.resize == RESIZE_SQUASH or (spec.resize_shorter - max(spec.crop)) / 2 <= FILTER_SUPPORT[
        spec.interpolation]


def _edge_pass(src, axis: int, size, start, length, extent, out_len: int, support: float, resample: dict):
    """One resampling pass along ``axis`` (0 rows, 1 columns) of uint8 HWC ``src`` over [start, start + length),
    weighted as Pillow weighs at the image's edge: ``src`` with a channel of ones beside each channel, zeros past
    the edge, resampled in float; each value divided by its ones channel is the filter renormalized over the pixels
    that exist. Rounded to 8 bits, as the reference's passes are."""
    import nvidia.dali.fn as fn  # noqa: PLC0415
    import nvidia.dali.math as dmath  # noqa: PLC0415
    import nvidia.dali.types as types  # noqa: PLC0415

    # The filter's reach in source pixels, with room to spare: zeros beyond it are never read.
    margin = fn.cast(dmath.floor(support * (extent / float(out_len) + 1.0) + 2.0), dtype=types.INT32)
    shape = src.shape(dtype=types.INT32)
    zero = margin * 0
    both = fn.cat(src, fn.cast(src * 0 + 1, dtype=types.UINT8), axis=2)
    anchor = fn.stack(zero, -margin) if axis == 1 else fn.stack(-margin, zero)
    grown = fn.stack(shape[0], shape[1] + 2 * margin) if axis == 1 else fn.stack(shape[0] + 2 * margin, shape[1])
    padded = fn.slice(both, anchor, grown, axes=[0, 1], out_of_bounds_policy="pad", fill_values=0)
    offset = fn.cast(margin, dtype=types.FLOAT)
    other = fn.cast(shape[1 - axis], dtype=types.FLOAT)
    lo, hi = start + offset, start + length + offset
    roi_start, roi_end = (fn.stack(0.0 * offset, lo), fn.stack(other, hi)) if axis == 1 else \
        (fn.stack(lo, 0.0 * offset), fn.stack(hi, other))
    out = fn.resize(padded, size=size, roi_start=roi_start, roi_end=roi_end,
                    **{**resample, "dtype": types.FLOAT})
    return fn.cast(dmath.clamp(out[:, :, 0:3] / out[:, :, 3:6], 0.0, 255.0), dtype=types.UINT8)


def first_line(err: Exception) -> str:
    """DALI's reason in one line: "<operator>: <what it encountered>"."""
    text = str(err)
    operator = re.search(r"Error in \w+ operator `([^`]+)`", text)
    reason = ""
    if "encountered:" in text:
        after = [line.strip() for line in text.split("encountered:", 1)[1].splitlines() if line.strip()]
        reason = next((line for line in after if "no longer valid" not in line), "")
    if not reason:
        lines = [line.strip() for line in text.splitlines() if line.strip() and "Critical error" not in line]
        reason = lines[0] if lines else type(err).__name__
    reason = reason.rstrip(" :")
    return (f"{operator.group(1)}: {reason}" if operator else reason)[:300]
