"""The model contract that ``run`` and ``model check`` both enforce, in the driver before Ray starts or the output is
touched: the folder's own checks (``pipeline.model.folder.load_model``), then the network run by the reference (ONNX
Runtime) on a few synthetic images made by the spec. It must take the spec's input (a fully dynamic input in the
other layout fails here, named), give finite outputs, outputs of the kind the spec's ``output`` declares, and, where
the spec declares an embedding, finite embeddings of its width."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pipeline.errors import ModelError
from pipeline.model.folder import SPEC_FILE, ModelBundle, load_model
from pipeline.model.imaging import preprocess_image
from pipeline.model.onnx_graph import network_outputs, runtime_graph
from pipeline.model.spec import OUTPUT_LOGITS, OUTPUT_PROBABILITIES, OUTPUT_SIGMOID, PreprocessSpec

LOG = logging.getLogger(__name__)

# The synthetic images the network runs on: (width, height) each, landscape and portrait, so that the resize and
# the crop run as for photos; two, since each costs the driver a forward pass (ResNet-50: about 0.2 s on 2 cores).
SAMPLE_SIZES = ((320, 240), (240, 320))
SAMPLE_SEED = 49
# A row of non-negative outputs within this of 1 is a probability distribution; a row of log-probabilities has a
# log-sum-exp within it of 0.
SUMS_TO_ONE_TOLERANCE = 1e-3
# ONNX Runtime's own log level for the reference session: fatal only, so a failing run is our one line, not its too.
ORT_QUIET = 4


def check_contract(ref: str | os.PathLike | None = None, *, cache_dir: Path | None = None,
                   engine_check: Callable[[ModelBundle], None] | None = None) -> ModelBundle:
    """The model ``ref`` (a folder, or None/"default") loaded and checked: the folder's contract, then
    ``engine_check`` (a run's engine's own refusals, which need no network run), then the network on the synthetic
    sample (``contract_sample``) through ONNX Runtime (``check_outputs``).

    Raises:
        ModelError: one line naming the file, the value and the fix (``engine_check`` raises its own).
    """
    started = time.perf_counter()
    bundle = load_model(ref, cache_dir=cache_dir)
    if engine_check is not None:
        engine_check(bundle)
    session = reference_session(bundle)
    raw, embedding = reference_run(bundle, contract_sample(bundle.spec), session)
    check_outputs(bundle, raw)
    if embedding is not None:
        check_embedding(bundle, embedding)
    LOG.info("model %s: contract checked in %.2f s", bundle.name, time.perf_counter() - started)
    return bundle


def contract_sample(spec: PreprocessSpec) -> np.ndarray:
    """The spec's input tensors of SAMPLE_SIZES synthetic RGB images (colour ramps over smooth seeded noise), made by
    the reference preprocessing: [len(SAMPLE_SIZES), *spec.input_shape] float32."""
    from PIL import Image

    rng = np.random.default_rng(SAMPLE_SEED)
    arrays = []
    for i, (width, height) in enumerate(SAMPLE_SIZES):
        noise = Image.fromarray(rng.integers(0, 256, (height // 16, width // 16, 3), dtype=np.uint8))
        smooth = np.asarray(noise.resize((width, height), Image.Resampling.BILINEAR), dtype=np.float32)
        ramp = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
        channel = np.array([1.0, 0.6, 0.3], np.float32)[[(i + c) % 3 for c in range(3)]]
        pixels = np.clip(0.5 * smooth + 0.4 * ramp * channel, 0, 255).astype(np.uint8)
        arrays.append(preprocess_image(Image.fromarray(pixels), spec))
    return np.stack(arrays)


def reference_session(bundle: ModelBundle) -> Any:
    """An ONNX Runtime CPU session of ``bundle``'s network (its external data read from beside it), with the
    embedding tensor among its outputs where the spec declares one (``runtime_graph``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = ORT_QUIET
    try:
        return ort.InferenceSession(runtime_graph(bundle), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as err:  # ORT's own types
        raise ModelError(f"ONNX Runtime cannot load {bundle.onnx_path}: {_first_line(err)}; check the file with "
                         "onnx.checker") from None


def reference_outputs(bundle: ModelBundle, batch: np.ndarray, session: Any = None) -> np.ndarray:
    """The network's raw class outputs on ``batch`` by ONNX Runtime (``reference_run``)."""
    return reference_run(bundle, batch, session)[0]


def reference_run(bundle: ModelBundle, batch: np.ndarray, session: Any = None
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """The network's raw class outputs on ``batch`` by ONNX Runtime, and its embedding tensor's values where the spec
    declares one (else None), run in the fixed batch size where it has one; a failure names the layout to set where
    the network runs the other one."""
    session = session or reference_session(bundle)
    names = list(network_outputs(bundle))
    runner = _runner(session, bundle, names)
    forward = fixed_batches(runner, bundle.fixed_batch) if bundle.fixed_batch else runner
    try:
        joined = forward(batch)
    except Exception as err:  # ORT's own types: the model cannot run the spec's input
        raise ModelError(_input_problem(bundle, batch, forward, err)) from None
    out, embedding = joined if len(names) > 1 else (joined, None)
    if out.ndim != 2 or out.shape[1] != bundle.num_classes:
        raise ModelError(f"{bundle.onnx_path} returns shape {list(out.shape)} for {len(batch)} images; "
                         f"expected [{len(batch)}, {bundle.num_classes}] (one column per line of labels.txt)")
    return out, embedding


def check_embedding(bundle: ModelBundle, values: np.ndarray) -> None:
    """ModelError where the sample's embedding tensor is not [images, dim] or not finite for every image."""
    spec = bundle.spec.embedding
    where = f"{Path(bundle.onnx_path).parent / SPEC_FILE} declares embedding {spec.output!r}"
    if values.ndim != 2 or values.shape[1] != spec.dim:
        width = f"set \"dim\": {values.shape[1]}" if values.ndim == 2 else (
            "pool and flatten it in the graph (GlobalAveragePool + Flatten) or name the pooled tensor after it")
        raise ModelError(f"{where} of dim {spec.dim}, but the network returns shape {list(values.shape)} for "
                         f"{len(values)} images; {width}")
    bad = int((~np.isfinite(values).all(axis=1)).sum())
    if bad:
        raise ModelError(f"{where}, but the network's embedding is NaN or infinite for {bad} of the {len(values)} "
                         "sample images; check its weights and its export (an FP16 export that overflows?), or name "
                         "another tensor")


def check_outputs(bundle: ModelBundle, raw: np.ndarray) -> None:
    """ModelError where the sample's outputs contradict the spec's ``output``, or none of them is finite: rows of
    probabilities declared as logits (they would get a second softmax), declared probabilities that are not, or
    log-probabilities declared as probabilities or as a multi-label model's logits."""
    where = Path(bundle.onnx_path).parent / SPEC_FILE
    finite = raw[np.isfinite(raw).all(axis=1)].astype(np.float64)
    if not len(finite):
        raise ModelError(f"{bundle.onnx_path} returns NaN or infinity for every one of the {len(raw)} sample images; "
                         "check its weights and its export (an FP16 export that overflows?)")
    sums = finite.sum(axis=1)
    sums_to_one = bool((finite >= 0).all() and np.abs(sums - 1).max() <= SUMS_TO_ONE_TOLERANCE)
    peak = finite.max(axis=1, keepdims=True)
    log_sum_exp = peak[:, 0] + np.log(np.exp(finite - peak).sum(axis=1))
    log_probabilities = bool((finite <= 0).all() and np.abs(log_sum_exp).max() <= SUMS_TO_ONE_TOLERANCE)
    output = bundle.spec.output
    if sums_to_one and output != OUTPUT_PROBABILITIES:
        default = " (the default)" if output == OUTPUT_LOGITS else ""
        raise ModelError(f"{bundle.onnx_path}: every output row is non-negative and sums to 1 (probabilities), but "
                         f'{where} declares {output}{default}; set "output": "probabilities" in it so that they are '
                         "written as the model gives them")
    if output == OUTPUT_PROBABILITIES and not sums_to_one:
        if log_probabilities:
            fix = "they are log-probabilities (a LogSoftmax): drop the field, and the softmax of logits scores them"
        elif ((finite >= 0) & (finite <= 1)).all():
            fix = ('they are independent per-class probabilities (a sigmoid?): export the network without its final '
                   'sigmoid and set "output": "sigmoid"')
        else:
            fix = "drop the field if they are logits"
        raise ModelError(f'{where} declares "output": "probabilities" but {bundle.onnx_path}\'s rows are not (min '
                         f"{float(finite.min()):.3g}, a row sum off 1 by {float(np.abs(sums - 1).max()):.3g}); {fix}")
    if output == OUTPUT_SIGMOID and log_probabilities:
        raise ModelError(f'{where} declares "output": "sigmoid" but {bundle.onnx_path} returns log-probabilities '
                         "of one class out of many (a LogSoftmax); drop the field (logits, scored by a softmax)")


def fixed_batches(forward: Callable[[np.ndarray], np.ndarray], size: int) -> Callable[[np.ndarray], np.ndarray]:
    """``forward`` for a network whose batch axis is fixed at ``size``: any batch runs in runs of exactly ``size``,
    the last one padded with zeros whose rows are dropped. A ``forward`` that returns a tuple of arrays (several
    outputs) gives a tuple, each array joined on its own."""

    def run(batch: np.ndarray) -> Any:
        outs = []
        for start in range(0, len(batch), size):
            part = batch[start : start + size]
            if len(part) < size:
                part = np.concatenate([part, np.zeros((size - len(part), *part.shape[1:]), part.dtype)])
            got = forward(part)
            keep = len(batch) - start
            outs.append(tuple(g[:keep] for g in got) if isinstance(got, tuple) else got[:keep])
        if outs and isinstance(outs[0], tuple):
            return tuple(np.concatenate(parts) for parts in zip(*outs))
        return np.concatenate(outs)

    return run


def _runner(session: Any, bundle: ModelBundle, names: list[str]) -> Callable[[np.ndarray], Any]:
    """The session as a function of a batch: the one output ``names`` holds, or a tuple of them."""
    if len(names) == 1:
        return lambda x: session.run(names, {bundle.input_name: x})[0]
    return lambda x: tuple(session.run(names, {bundle.input_name: x}))


def _input_problem(bundle: ModelBundle, batch: np.ndarray, forward: Callable[[np.ndarray], np.ndarray], err: Exception) -> str:
    """The one line of a network that cannot run the spec's input: the layout to set where it runs the other."""
    layout = bundle.spec.layout
    other = "NHWC" if layout == "NCHW" else "NCHW"
    swapped = np.ascontiguousarray(batch.transpose(0, 2, 3, 1) if layout == "NCHW" else batch.transpose(0, 3, 1, 2))
    try:
        forward(swapped)
    except Exception:  # noqa: BLE001 - the other layout fails too: the spec's input is wrong some other way
        return (f"{bundle.onnx_path} fails on the spec's input {[len(batch), *batch.shape[1:]]} ({layout}) in ONNX "
                f"Runtime: {_first_line(err)}; check crop and layout in {SPEC_FILE} against the network's input")
    return (f"{bundle.onnx_path} fails on the spec's {layout} input and runs on {other}: the network is "
            f"{'channels last' if other == 'NHWC' else 'channels first'}; set \"layout\": \"{other}\" in {SPEC_FILE}")


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
