"""Torch networks for the GPU paths: EfficientNet-Lite0 from the default checkpoint, a folder's ONNX or TorchScript,
and the networks a caller registers (``register_network``).

The default model is rebuilt here as a plain torch module from the same checkpoint arrays that
``pipeline.model.default_model`` turns into ONNX (BatchNorm folded the same way, TF "SAME" padding for 224 px), so the
GPU and the ONNX reference compute the same function; the ``efficientnet-lite-pytorch`` package's code is not used.
It computes TF's padding inside the convs instead of as separate pad kernels (``pipeline.gpu.lite0``), with the same
logits; both the gpu engine and the gpu profile's Triton models run it.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pipeline.model.default_model import load_checkpoint
from pipeline.errors import ConfigError, EngineError, ModelError
from pipeline.model.folder import MODEL_FILE, TORCHSCRIPT_FILE, is_builtin

LOG = logging.getLogger(__name__)

# network=NAME -> a factory of a torch module from the model bundle (register_network); none by default.
_NETWORKS: dict[str, Callable[[Any], Any]] = {}
CONVERTER_MISSING = ("the GPU paths convert model.onnx to torch with onnx2torch and onnxslim, which are not "
                     "installed here: pip install 'bulk-classify[gpu]', or use --engine onnx")


def efficientnet_lite0(weights: dict[str, np.ndarray]):
    """EfficientNet-Lite0 as a torch module (eval only, BatchNorm folded) from the checkpoint's arrays
    (``pipeline.gpu.lite0``)."""
    from pipeline.gpu.lite0 import Lite0  # noqa: PLC0415 - torch, an optional dependency

    try:
        return Lite0(weights).eval()
    except KeyError as e:
        raise ModelError(f"the checkpoint lacks tensor {e}; is it an EfficientNet-Lite0 checkpoint?") from None


def register_network(name: str, factory: Callable[[Any], Any]) -> None:
    """Make ``network=NAME`` (the gpu engine's option, the gpu profile's ``network`` parameter) select
    ``factory(bundle)``, a torch module, instead of the model's own network.

    The library registers none: this is where a caller that runs other networks through the GPU paths (the
    benchmarks: tests/benchmarks/gpu_networks.py) adds them. A registry lives in one process; a served model's stub
    process finds a factory by a ``"module:function"`` name instead, which it imports.
    """
    _NETWORKS[name] = factory


def _named_network(name: str) -> Callable[[Any], Any] | None:
    if name in _NETWORKS:
        return _NETWORKS[name]
    module, _, attr = name.partition(":")
    if module and attr:
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise EngineError(f"network {name!r} cannot be imported here ({err}); put its module on the "
                              "PYTHONPATH, or leave network unset") from None
    return None


def load_network(bundle, network: str | None = None):
    """The torch network for a model bundle.

    ``network``: None (or "auto") picks by the bundle: the folder's ``model.torchscript`` where it has one, the
    default model's network, else the folder's ``model.onnx`` converted to torch
    (``pipeline.gpu.onnx_torch``); another name selects a network of ``register_network``'s (or a
    ``"module:function"`` factory).

    Raises:
        EngineError: torch, or the converter, is not installed (with what to do instead).
        ModelError: the converter cannot convert the model's graph (the operator, and ``--engine onnx``).
    """
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        raise EngineError("the gpu engine needs PyTorch; install torch or use --engine onnx") from None
    if network not in (None, "", "auto", "default"):
        factory = _named_network(network)
        if factory is None:
            raise EngineError(f"unknown network {network!r}; leave it unset, or use one of "
                              f"{', '.join(_NETWORKS) or 'the networks registered with register_network (none here)'}")
        return factory(bundle)
    onnx_path = Path(bundle.onnx_path) if getattr(bundle, "onnx_path", None) else None
    scripted = onnx_path.parent / TORCHSCRIPT_FILE if onnx_path else None
    if scripted is not None and scripted.is_file():
        LOG.info("loading TorchScript network %s", scripted)
        return torch.jit.load(str(scripted), map_location="cpu").eval()
    if is_builtin(bundle):  # by digest: a fine-tuned Lite0 in a folder of that name is a user's model
        return efficientnet_lite0(load_checkpoint())
    if onnx_path is None or not onnx_path.is_file():
        raise EngineError(f"model {bundle.name!r} has no {MODEL_FILE} for the GPU paths to convert; pass its folder")
    try:
        from pipeline.gpu.network_cache import checked_network  # noqa: PLC0415 - onnx2torch: the gpu extra
    except ImportError:
        raise EngineError(CONVERTER_MISSING) from None
    cached = checked_network(onnx_path, bundle.spec, fixed_batch=getattr(bundle, "fixed_batch", None))
    network = cached.conversion.network
    # What the GPU paths hold the network to, and where its per-card results go (GpuClassifier reads them).
    network.onnx_reference = cached.conversion.reference
    network.cache_entry = cached.entry
    network.load_note = (f"{'loaded from the cache' if cached.from_cache else 'converted and checked'} in "
                         f"{cached.seconds:.1f} s")
    LOG.info("network of %s %s (%s)", bundle.name, network.load_note, cached.entry)
    return network


def check_runnable(bundle, engine: str) -> None:
    """In the driver, before anything is written: ModelError in one line where the gpu paths cannot run ``bundle``
    (``engine`` names the choice in the message): a layout other than NCHW, an operator of its ``model.onnx`` that
    the ONNX-to-torch converter lacks, or a converted network whose outputs differ from ONNX Runtime's (the built-in
    model and a folder's ``model.torchscript`` are not converted). The checked conversion is cached for the actors.

    Raises:
        ConfigError: the converter is not installed here.
    """
    onnx_path = Path(bundle.onnx_path) if getattr(bundle, "onnx_path", None) else None
    if bundle.spec.layout != "NCHW":
        raise ModelError(f"{engine} feeds NCHW networks and {bundle.name!r} is {bundle.spec.layout}; run it with "
                         "--engine onnx")
    if is_builtin(bundle) or (onnx_path is not None and (onnx_path.parent / TORCHSCRIPT_FILE).is_file()):
        return
    if importlib.util.find_spec("onnx2torch") is None:
        raise ConfigError(CONVERTER_MISSING)
    from pipeline.gpu.network_cache import checked_network, find_entry  # noqa: PLC0415

    fixed_batch = getattr(bundle, "fixed_batch", None)
    record = find_entry(bundle.onnx_path, bundle.spec, fixed_batch=fixed_batch)
    if record is not None:  # converted and checked on this node before: nothing to import or convert
        LOG.info("model %s: its network for the GPU found in the cache (%s)", bundle.name, record.get("note", ""))
        return
    from pipeline.gpu.onnx_torch import check_convertible  # noqa: PLC0415 - onnx2torch: the gpu extra

    check_convertible(bundle)
    # Converted and compared with ONNX Runtime here, in the driver, so a conversion that changes the model's answers
    # is refused before anything is written; the checked network is cached for the node's GPU instances.
    cached = checked_network(bundle.onnx_path, bundle.spec, fixed_batch=fixed_batch)
    LOG.info("model %s: its network for the GPU %s: %s", bundle.name,
             "found in the cache" if cached.from_cache else f"converted in {cached.seconds:.1f} s",
             cached.conversion.agreement.describe())
