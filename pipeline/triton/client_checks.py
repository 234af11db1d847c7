"""The Triton client's checks before it sends: the triton engine's preflight (a repository, a tritonserver, the gpu
profile's stack) and model check in the driver, each input's byte and pixel caps by its header; and the error row of an input whose
request the server refused. The answers' own check (each image's TAG echoed) is ``pipeline.triton.wire``'s."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any, Mapping

from pipeline.errors import ERROR_KINDS, ConfigError, ImageError, ModelError, TritonError
from pipeline.gpu.defaults import GPU_EXTRA_HINT, NO_INT8, missing_gpu_stack
from pipeline.model.imaging import DecodeLimits, decode_image, follow_pixel_cap
from pipeline.triton import contract as tn
from pipeline.triton.profiles import AUTO, GPU, PORTABLE, choose_profile, visible_gpus
from pipeline.triton.server import find_tritonserver


def check_requirements(options: Mapping[str, Any]) -> None:
    """The triton engine's preflight (its ``EngineSpec.preflight``): a repository that exists, the gpu profile's
    stack where the actor gets that profile, and a tritonserver unless ``url`` is given."""
    from pipeline.triton.repository import CONFIG_FILE  # noqa: PLC0415 - the layout's names, only to check one

    repository = options.get("repository")
    if repository is not None:
        path = Path(str(repository)).expanduser()
        if not (path / tn.MODEL_NAME / CONFIG_FILE).is_file():
            what = "does not exist" if not path.exists() else f"has no {tn.MODEL_NAME}/{CONFIG_FILE}"
            raise ConfigError(f"--engine-option repository={repository} {what}; build one with "
                              f"'bulk-classify repo build --profile {PORTABLE} --output DIR' and pass that DIR")
    if options.get("url"):
        return
    if repository is None and options.get("profile") == GPU and not visible_gpus():
        raise ConfigError(f"--engine-option profile={GPU} serves DALI and the network on a GPU and this machine has "
                          f"none; use --engine onnx, or --engine-option profile={PORTABLE}")
    if repository is None and choose_profile(options.get("profile", AUTO)).needs_gpu:
        missing = missing_gpu_stack()
        if missing:
            raise ConfigError(f"--engine triton serves the gpu profile on this GPU machine, which needs "
                              f"{' and '.join(missing)}: {GPU_EXTRA_HINT}, or pass --engine-option profile={PORTABLE}")
    try:
        find_tritonserver()
    except TritonError as err:
        raise ConfigError(f"--engine triton: {err}") from None


def check_model(bundle, options: Mapping[str, Any], gpus: tuple[int, str]) -> None:
    """The triton engine's ``EngineSpec.model_check``, in the driver: where its actors will serve the gpu profile
    from a repository built for the model, the gpu paths must be able to run it (``gpus``: the cluster's count, and
    where it was taken)."""
    served = "url" if options.get("url") else "repository" if options.get("repository") is not None else None
    if options.get("half") is not None and served:
        raise ConfigError(f"--engine-option half sets the precision of a repository the engine builds, and {served}= "
                          "serves one built already, whose precision holds; leave half out")
    if served:
        return  # a server or repository of the user's: its model is checked where it was built
    profile = options.get("profile", AUTO)
    gpus, where = gpus
    if profile == AUTO:
        profile = GPU if gpus > 0 else PORTABLE
    elif profile == GPU and gpus <= 0:  # on a cluster too, where the preflight is skipped
        raise ConfigError(f"--engine-option profile={GPU} serves DALI and the network on a GPU and {where} has none; "
                          f"use --engine onnx, or --engine-option profile={PORTABLE}")
    if options.get("half") is not None and profile != GPU:
        raise ConfigError(f"--engine-option half is the gpu profile's, and this run serves the {profile} profile "
                          f"(ONNX Runtime in FP32); leave half out")
    if profile == GPU:
        from pipeline.gpu.networks import check_runnable  # noqa: PLC0415 - cheap: torch loads inside
        from pipeline.model.folder import PRECISION_INT8  # noqa: PLC0415

        if bundle.precision == PRECISION_INT8:
            raise ModelError(f"model {bundle.name!r} is INT8 and the triton engine's gpu profile has {NO_INT8}; "
                             f"pass --engine-option profile={PORTABLE}, or the FP32 model")
        check_runnable(bundle, "--engine triton with the gpu profile")


def check_models(bundles, options: Mapping[str, Any], gpus: tuple[int, str] | None) -> None:
    """The triton engine's ``EngineSpec.models_check``, in the driver: a ``repository`` of the user's that this
    machine can read must declare the outputs of every model of the run (a set's ``CLASS_IDS_i``/``SCORES_i``, and each
    declared embedding's ``EMBEDDING(_i)``); a production repository (one model, no embedding) is refused for a set.
    The engine's own repositories are built for the run's models; a ``url`` server's is checked by each actor."""
    from pipeline.triton.repository import CONFIG_FILE  # noqa: PLC0415 - the layout's names, only to check one

    repository = options.get("repository")
    path = Path(str(repository)).expanduser() / tn.MODEL_NAME / CONFIG_FILE if repository is not None else None
    if options.get("url") or path is None or not path.is_file():
        return  # on a cluster the repository is the nodes': their actors check it
    from google.protobuf import text_format  # noqa: PLC0415
    from pipeline.triton.configs import model_config  # noqa: PLC0415 - protobuf: only with a repository

    config = text_format.Parse(path.read_text(encoding="utf-8"), model_config().ModelConfig())
    declared = {o.name for o in config.output}
    wanted = [tn.set_output(name, i) for i in range(1, len(bundles)) for name in tn.SET_OUTPUTS]
    wanted += [tn.set_output(tn.OUTPUT_EMBEDDING, i) for i, b in enumerate(bundles) if b.spec.embedding is not None]
    missing = [name for name in wanted if name not in declared]
    if missing:
        what = f"a set of {len(bundles)} models" if len(bundles) > 1 else f"model {bundles[0].name!r}'s embedding"
        raise ConfigError(f"--engine-option repository={repository} lacks {', '.join(missing)} for {what}; leave "
                          f"repository out (the engine builds its {PORTABLE} or {GPU} repository for it), or run "
                          + ("one --model" if len(bundles) > 1 else "a model without an embedding"))


def check_caps(data: bytes, limits: DecodeLimits, pixels: bool = True) -> None:
    """Raises the reference's own ImageError for empty, too large, or (``pixels``) too many pixels by the header.

    decode_image raises those before decoding any pixel, so calling it only when a cap is exceeded costs
    nothing and gives the exact error text of ``--engine onnx``. The pixel check opens the header with Pillow
    (a cost on every file): skipped for a model that checks the caps itself (``checks_caps``).
    """
    if len(data) == 0 or len(data) > limits.max_bytes:
        decode_image(data, limits)
    if not pixels:
        return
    from PIL import Image  # noqa: PLC0415

    follow_pixel_cap(limits.max_pixels)
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except Image.DecompressionBombError:
        decode_image(data, limits)
        return
    except Exception:  # noqa: BLE001 - not readable here: the server reports the precise error for this input
        return
    if width * height > limits.max_pixels:
        decode_image(data, limits)


# Triton puts this before an ensemble's composing model's error: the kind follows it.
ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")


def error_text(reason: str) -> str:
    """The error row of an input whose one-image request failed: the server's "kind: detail" when it gives one
    (python-backend profiles without the ERROR output), else decode_error/engine_error with its message."""
    reason = ENSEMBLE_PREFIX.sub("", reason, count=1)
    kind = reason.split(":", 1)[0].strip()
    if kind in ERROR_KINDS and ":" in reason:
        return reason[:1000]
    kind = "decode_error" if "decod" in reason.lower() else "engine_error"
    return str(ImageError(kind, f"server: {reason[:500]}"))
