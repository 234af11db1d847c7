"""Importing a trained network: the ONNX export, the model folder, and the parity check against its framework.

A source module (``SOURCES``) turns what the user trained into a ``SourceModel``: the torch network, the framework's
own eval transform, the labels and the preprocess.json fields that should make the same input tensor. This module
exports the network, writes the folder beside ``output``, loads it like every engine does, and runs the sample
images both ways: the framework's transform and forward against ``pipeline.model.imaging`` and ONNX Runtime on the written
folder. Below the thresholds the folder is removed and nothing is written. With ``embedding`` the network's pooled
pre-logits features become a second ONNX output, declared in the spec, and are compared too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pipeline.errors import ConfigError, ImageError, ModelError, ParityFailed
from pipeline.model.onnx_graph import faithful_slim
from pipeline.model.imaging import PreprocessSpec, decode_image, load_and_preprocess
from pipeline.model_check import read_sample
from pipeline.model.folder import (
    LABELS_FILE, MODEL_FILE, ONNX_EMBEDDING, ONNX_INPUT, ONNX_OUTPUT, SPEC_FILE, ModelBundle, check_unique_labels, load_model_folder,
    read_labels,
)
from pipeline.model.scores import scores_of
from pipeline.model.spec import OUTPUT_LOGITS, EmbeddingSpec
from pipeline.model_import.base import SourceModel

LOG = logging.getLogger(__name__)

# Where each source's loader lives (name -> "module:function"); the CLI's choices come from here.
SOURCES = {
    "timm": "pipeline.model_import.timm_source:load",
    "torchvision": "pipeline.model_import.torchvision_source:load",
    "huggingface": "pipeline.model_import.huggingface_source:load",
}
EXTRA = "import"  # the pyproject extra that brings torch, timm, torchvision, transformers and onnxslim
OPSET = 17
DEFAULT_SAMPLE = 16
# Top-1 agreement needed on the images the framework decides clearly (top-1 minus top-2 probability at least
# DECISIVE_MARGIN), and the median over the images of the largest logit difference, as a share of the image's logit
# range. pipeline.model.imaging crops an exact box where torchvision-style transforms round the resized size and the crop
# offset: up to half a pixel apart, which moves a random-weight network's nearly flat logits by a median 1-3 % of the
# range (single images up to 25 % on a random ConvNeXt); a wrong mean or std moves the median 20 % or more
# (tests/benchmarks/bench_model_import.py measures them).
DEFAULT_MIN_AGREEMENT = 0.99
DEFAULT_MAX_LOGIT_DIFF = 0.08
# The exported network alone, on the framework's own input tensors: float32 rounding only.
EXPORT_TOLERANCE = 1e-3
DECISIVE_MARGIN = 0.1
FORWARD_BATCH = 16
# The embedding (--embedding): the median over the photos of the cosine between ONNX Runtime's features on this
# folder's preprocessing and the framework's on its own transform (half a pixel apart, as for the logits), and the
# exported network alone on the framework's tensors, which only float32 rounding separates.
DEFAULT_MIN_EMBEDDING_COSINE = 0.99
EMBEDDING_EXPORT_MIN_COSINE = 0.9999


@dataclass(frozen=True, kw_only=True)
class ImportOptions:
    """How the written folder is checked against the source framework."""

    images: str | None = None  # a folder or URL of sample images; model_check.DEFAULT_IMAGES when None
    sample: int = DEFAULT_SAMPLE
    min_agreement: float = DEFAULT_MIN_AGREEMENT
    max_logit_diff: float = DEFAULT_MAX_LOGIT_DIFF
    min_embedding_cosine: float = DEFAULT_MIN_EMBEDDING_COSINE

    def __post_init__(self) -> None:
        if self.sample < 1:
            raise ConfigError(f"--sample must be at least 1, got {self.sample}")
        if not 0 <= self.min_agreement <= 1:
            raise ConfigError(f"--min-agreement must be within 0..1, got {self.min_agreement}")
        if not -1 <= self.min_embedding_cosine <= 1:
            raise ConfigError(f"--min-embedding-cosine must be within -1..1, got {self.min_embedding_cosine}")
        if self.max_logit_diff <= 0:
            raise ConfigError(f"--max-logit-diff must be positive (a share of the logit range), got "
                              f"{self.max_logit_diff}")


@dataclass(frozen=True)
class Parity:
    """The written folder (pipeline.model.imaging + ONNX Runtime) against the framework's transform and forward."""

    images: int
    top1_agreement: float
    decisive: int  # images whose framework top-1 leads by DECISIVE_MARGIN or more
    decisive_agreement: float | None
    max_logit_diff: float  # the largest |ONNX - framework| logit over an image's framework logit range
    median_logit_diff: float  # the median over the images of that
    max_abs_logit_diff: float
    export_diff: float = 0.0  # the same maximum with ONNX Runtime fed the framework's own tensors
    embedding: "EmbeddingParity | None" = None  # with --embedding

    def problems(self, options: ImportOptions) -> list[str]:
        found = []
        if self.decisive_agreement is not None and self.decisive_agreement < options.min_agreement:
            found.append(f"top-1 agreement {self.decisive_agreement:.1%} on the {self.decisive} clearly decided "
                         f"images is below {options.min_agreement:.1%}")
        if self.median_logit_diff > options.max_logit_diff:
            found.append(f"logits differ by a median {self.median_logit_diff:.1%} of their range (allowed "
                         f"{options.max_logit_diff:.1%})")
        if self.export_diff > EXPORT_TOLERANCE:
            found.append(f"the exported network alone differs by {self.export_diff:.1e} of the logit range on the "
                         f"framework's own tensors (allowed {EXPORT_TOLERANCE:.0e}): the ONNX export is wrong")
        if self.embedding is not None:
            found += self.embedding.problems(options)
        return found


@dataclass(frozen=True)
class EmbeddingParity:
    """ONNX Runtime's embedding tensor against the framework's pooled pre-logits features, per image."""

    dim: int
    min_cosine: float
    median_cosine: float
    max_abs_diff: float  # the largest |ONNX - framework| feature
    export_min_cosine: float  # with ONNX Runtime fed the framework's own tensors
    export_diff: float  # the largest |ONNX - framework| feature there, over the largest |framework| feature

    def problems(self, options: ImportOptions) -> list[str]:
        found = []
        if not self.median_cosine >= options.min_embedding_cosine:  # NaN (features not finite) fails too
            found.append(f"the embedding's median cosine with the framework's features is {self.median_cosine:.4f} "
                         f"(needed {options.min_embedding_cosine})")
        if not (self.export_min_cosine >= EMBEDDING_EXPORT_MIN_COSINE and self.export_diff <= EXPORT_TOLERANCE):
            found.append(f"the exported embedding alone differs from the framework's features on its own tensors "
                         f"(cosine {self.export_min_cosine:.6f}, needed {EMBEDDING_EXPORT_MIN_COSINE}; difference "
                         f"{self.export_diff:.1e} of the largest feature, allowed {EXPORT_TOLERANCE:.0e}): the ONNX "
                         "export is wrong")
        return found


@dataclass(frozen=True)
class ImportResult:
    folder: Path
    description: str
    classes: int
    spec: PreprocessSpec
    parity: Parity
    notes: tuple[str, ...]


def import_model(source: str, name: str, output: str | os.PathLike, *, checkpoint: str | None = None,
                 labels: str | None = None, preset: str | None = None, use_ema: bool = False,
                 embedding: bool = False, options: ImportOptions = ImportOptions()) -> ImportResult:
    """Writes the model folder ``output`` from ``name`` of ``source`` (a key of SOURCES), if it passes parity.

    Args:
        name: timm architecture, torchvision model name, or a Hugging Face model folder.
        checkpoint: the weights file (timm, torchvision).
        labels: a labels file (one class a line) instead of the source's own class names.
        preset: torchvision's weights entry whose transforms and categories apply (e.g. IMAGENET1K_V2).
        use_ema: timm: a train.py checkpoint's EMA weights (``state_dict_ema``) instead of its ``state_dict``.
        embedding: also export the pooled pre-logits features as the output ``ONNX_EMBEDDING`` and declare it in the
            spec (L2-normalised), checked against the framework's features.

    Raises:
        ConfigError: a bad argument, or ``output`` holds files. ModelError: the source cannot be loaded, its
        preprocessing cannot be written as a spec, or the folder breaks the contract. ParityFailed: below the
        thresholds. Nothing is written on any of them.
    """
    if source not in SOURCES:
        raise ConfigError(f"unknown source {source!r}; use one of {', '.join(SOURCES)}")
    out = Path(output).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty folder; pass a new --output folder")
    samples = read_sample(options.images, options.sample)  # before the slow part, so a bad --images fails at once
    label_names = read_labels(Path(labels).expanduser()) if labels else None
    loader = _loader(source)
    model = loader(name, checkpoint=Path(checkpoint).expanduser() if checkpoint else None, labels=label_names,
                   preset=preset, use_ema=use_ema)
    check_unique_labels(model.labels, f"the {LABELS_FILE} of {model.description}",
                        fix="pass --labels FILE with one name per class, each once")
    try:
        spec = PreprocessSpec.from_dict(model.spec)
    except ModelError as e:
        raise ModelError(f"{model.description}: its preprocessing cannot be written as {SPEC_FILE} ({e})") from None
    network = model.network
    if embedding:
        if model.embedder is None:
            raise ModelError(f"{model.description} has no final Linear layer whose input is its pooled features, so "
                             "--embedding cannot find them; import it without --embedding and declare a tensor of its "
                             f'{MODEL_FILE} as "embedding" in {SPEC_FILE}')
        network = model.embedder
        spec = dataclasses.replace(spec, embedding=EmbeddingSpec(output=ONNX_EMBEDDING,
                                                                 dim=embedding_width(network, spec)))
    created = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # removed again on a refusal
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.import-", dir=out.parent))
    try:
        onnx_bytes, export_note = export_onnx(network, spec)
        model.notes.append(export_note)
        (tmp / MODEL_FILE).write_bytes(onnx_bytes)
        (tmp / LABELS_FILE).write_text("".join(f"{label}\n" for label in model.labels), encoding="utf-8")
        (tmp / SPEC_FILE).write_text(spec.to_json(), encoding="utf-8")
        bundle = load_model_folder(tmp, name=out.name)
        parity = compare(model, bundle, samples)
        problems = parity.problems(options)
        if problems:
            raise ParityFailed(f"{model.description}: the written folder does not classify like the framework on "
                             f"{parity.images} images: {'; '.join(problems)}; nothing written"
                             + (f" ({'; '.join(model.notes)})" if model.notes else ""))
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            for folder in created:
                with contextlib.suppress(OSError):
                    folder.rmdir()
    return ImportResult(out, model.description, len(model.labels), spec, parity, tuple(model.notes))


def _loader(source: str) -> Callable[..., SourceModel]:
    module, _, function = SOURCES[source].partition(":")
    try:
        return getattr(importlib.import_module(module), function)
    except ImportError as e:
        raise ConfigError(f"model import from {source} needs {e.name or 'its packages'}: pip install "
                          f"'bulk-classify[{EXTRA}]'") from None


def embedding_width(embedder: Any, spec: PreprocessSpec) -> int:
    """The width of the features ``embedder`` (a module returning (logits, features)) gives for the spec's input."""
    import torch

    with torch.no_grad():
        _, features = embedder(torch.zeros(1, *spec.input_shape))
    return int(features.shape[1])


def export_onnx(network: Any, spec: PreprocessSpec) -> tuple[bytes, str]:
    """``network`` as ONNX bytes (one float32 input ``ONNX_INPUT`` with a dynamic batch axis, one output
    ``ONNX_OUTPUT``, and where the spec declares an embedding, ``network`` returning (logits, features), a second
    output of that name) and a note on the simplification.

    onnxslim folds the constants torch's TorchScript exporter leaves and the Identity aliases of shared weights that
    other ONNX readers trip on; its graph is kept only where ONNX Runtime gives the exporter's numbers on a random
    batch, since it has changed the outputs of some graphs (timm's TF-padded EfficientNets).
    """
    import onnx
    import torch

    buffer = io.BytesIO()
    dummy = torch.zeros(2, *spec.input_shape)
    outputs = [ONNX_OUTPUT] + ([spec.embedding.output] if spec.embedding is not None else [])
    try:
        # The TorchScript exporter warns that it is deprecated and that traced Python conditions became constants:
        # both expected here (the new exporter needs onnxscript and gives the same graph for these networks).
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(network, (dummy,), buffer, input_names=[ONNX_INPUT], output_names=outputs,
                              dynamic_axes={name: {0: "batch"} for name in (ONNX_INPUT, *outputs)},
                              opset_version=OPSET, dynamo=False)
    except ModelError:
        raise  # the embedder's own refusal, while tracing
    except Exception as e:  # noqa: BLE001 - the exporter raises many types; one line says which operator failed
        raise ModelError(f"torch.onnx.export failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    exported = buffer.getvalue()
    probe = np.random.default_rng(0).standard_normal((2, *spec.input_shape)).astype(np.float32)
    slim, note = faithful_slim(onnx.load_from_string(exported), probe)
    if slim is None:
        return exported, f"onnx: the exporter's graph ({note})"
    return slim.SerializeToString(), f"onnx: {note}"


def compare(model: SourceModel, bundle: ModelBundle, samples: list[tuple[str, bytes]]) -> Parity:
    """Both sides on each sample image, decoded once (upright, RGB) so that only the preprocessing and the network
    differ."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(bundle.onnx_path), providers=["CPUExecutionProvider"])
    embedding = bundle.spec.embedding
    names = [bundle.output_name] + ([embedding.output] if embedding is not None else [])
    network = model.embedder if embedding is not None else model.network
    framework, ours, exported = [], [], []
    for start in range(0, len(samples), FORWARD_BATCH):
        chunk = samples[start:start + FORWARD_BATCH]
        tensors, arrays = [], []
        for name, data in chunk:
            try:
                tensors.append(model.transform(decode_image(data)))
                arrays.append(load_and_preprocess(data, bundle.spec)[0])
            except ImageError as e:
                raise ConfigError(f"sample image {name} cannot be used ({e}); pass --images with ordinary "
                                  "photos") from None
        batch = torch.stack(tensors)
        with torch.no_grad():
            got = network(batch)
        framework.append([t.float().numpy() for t in (got if isinstance(got, tuple) else (got,))])
        ours.append(session.run(names, {bundle.input_name: np.stack(arrays)}))
        exported.append(session.run(names, {bundle.input_name: batch.float().numpy()}))
    framework_logits, ours_logits, exported_logits = (np.concatenate([part[0] for part in side])
                                                      for side in (framework, ours, exported))
    output = bundle.spec.output
    export_diff = parity_of(framework_logits, exported_logits, output).max_logit_diff
    parity = dataclasses.replace(parity_of(framework_logits, ours_logits, output), export_diff=export_diff)
    if embedding is None:
        return parity
    features, ours_features, exported_features = (np.concatenate([part[1] for part in side])
                                                  for side in (framework, ours, exported))
    return dataclasses.replace(parity, embedding=embedding_parity_of(features, ours_features, exported_features))


def embedding_parity_of(framework: np.ndarray, ours: np.ndarray, exported: np.ndarray) -> EmbeddingParity:
    """The agreement of [images, dim] feature arrays: ``ours`` (this folder's preprocessing) and ``exported`` (the
    framework's tensors) against the framework's."""
    cosine, export_cosine = _cosines(framework, ours), _cosines(framework, exported)
    framework = framework.astype(np.float64)
    scale = max(float(np.abs(framework).max()), 1e-12)
    return EmbeddingParity(
        dim=int(framework.shape[1]),
        min_cosine=float(cosine.min()),
        median_cosine=float(np.median(cosine)),
        max_abs_diff=float(np.abs(framework - ours).max()),
        export_min_cosine=float(export_cosine.min()),
        export_diff=float(np.abs(framework - exported).max() / scale),
    )


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, the cosine of two [rows, dim] arrays (1 for two zero rows, 0 for one; NaN where one is not finite)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    both_zero = (np.linalg.norm(a, axis=1) == 0) & (np.linalg.norm(b, axis=1) == 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine = np.where(norms > 0, (a * b).sum(axis=1) / np.where(norms > 0, norms, 1.0), 0.0)
    return np.where(both_zero, 1.0, cosine)


def parity_of(framework: np.ndarray, ours: np.ndarray, output: str = OUTPUT_LOGITS) -> Parity:
    """The agreement of two [images, classes] logit arrays; ``output``: how the spec scores them (which images the
    framework decides clearly)."""
    framework, ours = framework.astype(np.float64), ours.astype(np.float64)
    diff = np.abs(framework - ours).max(axis=1)
    spread = np.maximum(framework.max(axis=1) - framework.min(axis=1), 1e-12)
    relative = diff / spread
    probs = scores_of(framework, output)
    top2 = np.sort(probs, axis=1)[:, -2:] if probs.shape[1] > 1 else np.hstack([np.zeros_like(probs), probs])
    decisive = (top2[:, 1] - top2[:, 0]) >= DECISIVE_MARGIN
    same = framework.argmax(axis=1) == ours.argmax(axis=1)
    return Parity(
        images=len(framework),
        top1_agreement=float(same.mean()),
        decisive=int(decisive.sum()),
        decisive_agreement=float(same[decisive].mean()) if decisive.any() else None,
        max_logit_diff=float(relative.max()),
        median_logit_diff=float(np.median(relative)),
        max_abs_logit_diff=float(diff.max()),
    )


def format_result(result: ImportResult) -> str:
    """The lines the CLI prints after a written import."""
    p = result.parity
    decisive = "none" if p.decisive_agreement is None else f"{p.decisive_agreement:.1%} of {p.decisive}"
    lines = [
        f"imported {result.description}: {result.classes} classes, {SPEC_FILE} "
        + ", ".join(f"{k} {v}" for k, v in result.spec.to_dict().items() if k in ("resize_shorter", "resize", "crop",
                                                                                   "interpolation")),
        f"parity on {p.images} images (framework transform and forward vs this folder in ONNX Runtime): top-1 "
        f"{p.top1_agreement:.1%}, clearly decided {decisive}, logit difference max {p.max_logit_diff:.2%} / median "
        f"{p.median_logit_diff:.2%} of the range ({p.max_abs_logit_diff:.2g} absolute); the network alone "
        f"{p.export_diff:.1e}",
    ]
    e = p.embedding
    if e is not None:
        lines.append(f"embedding {ONNX_EMBEDDING!r} ({e.dim} features, L2-normalised in the output): cosine with the "
                     f"framework's median {e.median_cosine:.5f} / min {e.min_cosine:.5f}, largest difference "
                     f"{e.max_abs_diff:.2g}; the network alone cosine min {e.export_min_cosine:.6f}")
    lines += [f"note: {note}" for note in result.notes]
    lines.append(f"written: {result.folder} (bulk-classify model check {result.folder} runs it through every engine "
                 "available here)")
    return "\n".join(lines)
