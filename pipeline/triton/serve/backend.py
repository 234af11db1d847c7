"""What every python-backend model shares: config parameters, tensors in and out of the stub, caps and errors."""

from __future__ import annotations

import json

import numpy as np

from pipeline.model.imaging import DecodeLimits
from pipeline.triton import contract as tn


def config_param(config: dict, key: str, default: str) -> str:
    """A config.pbtxt ``parameters`` string value, ``default`` when absent or blank."""
    value = config.get("parameters", {}).get(key, {}).get("string_value", "")
    return value.strip() or default


def as_numpy(tensor) -> np.ndarray:
    """A ``pb_utils.Tensor`` as numpy: through DLPack, since ``as_numpy()`` mis-reads tensors under numpy 2."""
    try:
        return np.from_dlpack(tensor)
    except (AttributeError, TypeError, RuntimeError, BufferError):
        return tensor.as_numpy()


def config_limits(config: dict) -> DecodeLimits:
    """The caps a model's config.pbtxt parameters set (the defaults where absent)."""
    return DecodeLimits(
        max_bytes=int(config_param(config, tn.PARAM_MAX_BYTES, str(DecodeLimits().max_bytes))),
        max_pixels=int(config_param(config, tn.PARAM_MAX_PIXELS, str(DecodeLimits().max_pixels))),
    )


def request_limits(request, default: DecodeLimits) -> DecodeLimits:
    """The caps of one request: its parameters' max_bytes/max_pixels, else ``default``."""
    try:
        params = json.loads(request.parameters() or "{}")
    except (AttributeError, ValueError):
        params = {}
    return DecodeLimits(
        max_bytes=int(params.get(tn.PARAM_MAX_BYTES, default.max_bytes)),
        max_pixels=int(params.get(tn.PARAM_MAX_PIXELS, default.max_pixels)),
    )


def bad_input(pb, message: str):
    """An INVALID_ARG error (not INTERNAL, which clients read as a failing server)."""
    code = getattr(pb.TritonError, "INVALID_ARG", None)
    return pb.TritonError(message, code) if code is not None else pb.TritonError(message)
