"""Checking Triton repositories: every config.pbtxt parsed with Triton's schema, ensembles' wiring, the contract."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from pipeline.errors import ModelError
from pipeline.triton import contract as tn
from pipeline.triton.configs import triton_dtype, model_config
from pipeline.triton.plans import find_plan, local_plan_key
from pipeline.triton.repository import CONFIG_FILE, REPOSITORY_PROFILES, build_repository

LOG = logging.getLogger(__name__)


def _parse(path: Path):
    from google.protobuf import text_format  # noqa: PLC0415

    config = model_config().ModelConfig()
    try:
        text_format.Parse(path.read_text(encoding="utf-8"), config)
    except text_format.ParseError as err:
        raise ModelError(f"{path}: not a valid Triton model config: {err}") from None
    return config


def _dims_match(a, b) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


def _describe(dtype: int, dims) -> str:
    return f"{model_config().DataType.Name(dtype)} {list(dims)}"


def check_repository(path: str | os.PathLike | None = None) -> list[str]:
    """Parses every config.pbtxt with Triton's schema and checks ensembles' wiring and the engine contract.

    ``path`` is a repository, or a folder of repositories (one per profile, like the project's
    ``model_repository/``); with no path, the configs this package generates for every profile are checked.

    Returns:
        the names of the models checked (``profile/model`` when checking all profiles).

    Raises:
        ModelError: the first problem, naming the file, the tensor and what was expected.
    """
    if path is None:
        with tempfile.TemporaryDirectory(prefix="bulk-classify-check-") as tmp:
            for profile in REPOSITORY_PROFILES:
                build_repository(profile, None, str(Path(tmp) / profile), artifacts=False)
            return check_repository(tmp)
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ModelError(f"repository {root} is not a folder; pass a folder of <model>/{CONFIG_FILE}")
    if not any(root.glob(f"*/{CONFIG_FILE}")) and any(root.glob(f"*/*/{CONFIG_FILE}")):
        return [f"{folder.name}/{name}" for folder in sorted(p for p in root.iterdir() if p.is_dir())
                for name in check_repository(folder)]
    configs = {}
    for config_path in sorted(root.glob(f"*/{CONFIG_FILE}")):
        config = _parse(config_path)
        folder = config_path.parent.name
        if config.name and config.name != folder:
            raise ModelError(f"{config_path}: name {config.name!r} differs from its folder {folder!r}; make them equal")
        if not (config.backend or config.platform):
            raise ModelError(f"{config_path}: set backend or platform")
        configs[folder] = config
    if not configs:
        raise ModelError(f"repository {root} has no <model>/{CONFIG_FILE}")
    for name, config in configs.items():
        if config.platform == "ensemble":
            _check_ensemble(root, name, config, configs)
    if tn.MODEL_NAME in configs:
        _check_contract(root / tn.MODEL_NAME / CONFIG_FILE, configs[tn.MODEL_NAME])
    return sorted(configs)


def _check_ensemble(root: Path, name: str, ens, configs) -> None:
    where = root / name / CONFIG_FILE
    tensors = {t.name: (t.data_type, list(t.dims)) for t in ens.input}
    outputs = {t.name: (t.data_type, list(t.dims)) for t in ens.output}
    if not ens.ensemble_scheduling.step:
        raise ModelError(f"{where}: ensemble has no ensemble_scheduling steps")
    for i, step in enumerate(ens.ensemble_scheduling.step):
        model = configs.get(step.model_name)
        if model is None:
            raise ModelError(f"{where}: step {i} uses model {step.model_name!r}, which is not in {root}")
        if ens.max_batch_size > 0 and model.max_batch_size == 0:
            raise ModelError(f"{where}: step {step.model_name!r} does not batch but the ensemble does")
        model_inputs = {t.name: (t.data_type, list(t.dims)) for t in model.input}
        for model_input, tensor in step.input_map.items():
            if model_input not in model_inputs:
                raise ModelError(f"{where}: step {step.model_name!r} maps input {model_input!r}, which the model does "
                                 f"not have (it has {sorted(model_inputs)})")
            if tensor not in tensors:
                raise ModelError(f"{where}: step {step.model_name!r} reads {tensor!r} before any step produces it "
                                 "and it is not an ensemble input")
            if tensors[tensor][0] != model_inputs[model_input][0] or not _dims_match(tensors[tensor][1],
                                                                                    model_inputs[model_input][1]):
                raise ModelError(f"{where}: {tensor!r} is {_describe(*tensors[tensor])} but {step.model_name!r} input "
                                 f"{model_input!r} wants {_describe(*model_inputs[model_input])}")
        missing = sorted(set(model_inputs) - set(step.input_map))
        if missing:
            raise ModelError(f"{where}: step {step.model_name!r} leaves input(s) {', '.join(missing)} unmapped")
        model_outputs = {t.name: (t.data_type, list(t.dims)) for t in model.output}
        for model_output, tensor in step.output_map.items():
            if model_output not in model_outputs:
                raise ModelError(f"{where}: step {step.model_name!r} maps output {model_output!r}, which the model "
                                 f"does not have (it has {sorted(model_outputs)})")
            produced = model_outputs[model_output]
            if tensor in outputs and (outputs[tensor][0] != produced[0] or not _dims_match(outputs[tensor][1],
                                                                                         produced[1])):
                raise ModelError(f"{where}: ensemble output {tensor!r} is {_describe(*outputs[tensor])} but step "
                                 f"{step.model_name!r} produces {_describe(*produced)}")
            tensors[tensor] = produced
    unproduced = sorted(set(outputs) - set(tensors))
    if unproduced:
        raise ModelError(f"{where}: no step produces ensemble output(s) {', '.join(unproduced)}")


def _check_contract(where: Path, config) -> None:
    """The model the engine calls must serve pipeline.triton.contract' inputs and outputs."""
    if config.max_batch_size < 1:
        raise ModelError(f"{where}: max_batch_size must be positive (the engine sends batches)")
    inputs = {t.name: t for t in config.input}
    outputs = {t.name: t for t in config.output}
    for name, dtype in tn.INPUTS.items():
        want = [-1] if name == tn.INPUT_IMAGE else [1]
        got = inputs.get(name)
        if got is None or got.data_type != triton_dtype(dtype) or list(got.dims) != want:
            raise ModelError(f"{where}: input {name} must be {_describe(triton_dtype(dtype), want)}"
                             + (f", got {_describe(got.data_type, got.dims)}" if got else ", missing"))
    for name in tn.OUTPUTS:
        got = outputs.get(name)
        if got is None:
            if name in tn.REQUIRED_OUTPUTS:
                raise ModelError(f"{where}: output {name} is missing")
            continue
        if got.data_type != triton_dtype(tn.OUTPUTS[name]):
            raise ModelError(f"{where}: output {name} must be {model_config().DataType.Name(triton_dtype(tn.OUTPUTS[name]))}, "
                             f"got {model_config().DataType.Name(got.data_type)}")
    k_ids, k_scores = list(outputs[tn.OUTPUT_CLASS_IDS].dims), list(outputs[tn.OUTPUT_SCORES].dims)
    if k_ids != k_scores or len(k_ids) != 1 or k_ids[0] < 1:
        raise ModelError(f"{where}: {tn.OUTPUT_CLASS_IDS} {k_ids} and {tn.OUTPUT_SCORES} {k_scores} must both be [k]")


def preflight(path: str | os.PathLike) -> None:
    """Fails fast on a repository this machine cannot serve: a TensorRT plan built for another GPU/TensorRT."""
    trt_dir = Path(path) / tn.CLASSIFIER_TRT_MODEL
    if not trt_dir.is_dir():
        return
    key = local_plan_key()
    if key is None:
        LOG.warning("cannot tell this machine's GPU or TensorRT version; not checking %s's plans", trt_dir)
        return
    find_plan(trt_dir, key)
