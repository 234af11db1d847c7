"""``bulk-classify model check``: a model folder's contract, then sample images through the reference and each engine.

The contract is ``pipeline.model.contract.check_contract``, the same function ``run`` calls in its driver (the
folder's checks, then the network on a synthetic sample: its input layout and its output kind), and each engine's
``model_check``. Then every engine available here classifies the sample images, and its top-1 and scores (and the
embedding, where the model declares one) are compared with the CPU reference (pipeline.model.imaging + ONNX Runtime,
scored per the spec).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from pipeline.engines.registry import ENGINE_NAMES, engine_spec, make_engine
from pipeline.errors import BulkClassifyError, ConfigError, ImageError
from pipeline.model.contract import check_contract, reference_run
from pipeline.model.folder import fixed_batch_note
from pipeline.model.imaging import load_and_preprocess
from pipeline.model.onnx_graph import intermediate_outputs
from pipeline.model.scores import embeddings_of, scores_of
from pipeline.node import node_gpus
from pipeline.schema import DEFAULT_EXTENSIONS
from pipeline.storage import open_fs

if TYPE_CHECKING:
    import numpy as np

    from pipeline.engines.base import EngineSpec
    from pipeline.model.folder import ModelBundle

LOG = logging.getLogger(__name__)

# The sample when no --images is given: the repository's photos (a checkout or an sdist has them).
DEFAULT_IMAGES = Path(__file__).resolve().parents[1] / "tests" / "data" / "photos"
DEFAULT_SAMPLE = 16
DEFAULT_MIN_AGREEMENT = 0.9  # top-1 agreement with the reference an engine needs over the sample
DEFAULT_MAX_SCORE_DIFF = 0.05  # the largest |engine score - reference probability| of the same class allowed
CHECK_TOP_K = 5  # classes compared per image (the model's all where it has fewer)
# The least cosine of an engine's embedding with the reference's: FP16 networks on the GPU stay far above it.
MIN_EMBEDDING_COSINE = 0.999


@dataclass
class EngineCheck:
    """One engine's line: agreement with the reference, or why it did not run."""

    engine: str
    images: int = 0
    agreement: float | None = None
    max_score_diff: float | None = None
    min_cosine: float | None = None  # the least cosine of an embedding with the reference's (a model with one)
    problem: str = ""  # the engine refused the model, or failed
    skipped: str = ""  # not available on this machine

    @property
    def passed(self) -> bool:
        return not self.problem


@dataclass
class CheckReport:
    """What ``check_model_folder`` found."""

    model: str
    notes: list[str] = field(default_factory=list)
    images: int = 0
    embedding: str = ""  # the model's embedding as one line, where its spec declares one
    engines: list[EngineCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.engines)


def check_model_folder(folder: str, *, images: str | None = None, engines: Sequence[str] = (),
                       sample: int = DEFAULT_SAMPLE, min_agreement: float = DEFAULT_MIN_AGREEMENT,
                       max_score_diff: float = DEFAULT_MAX_SCORE_DIFF,
                       storage_options: Mapping[str, Any] | None = None) -> CheckReport:
    """Checks ``folder``'s contract (ModelError, one line, on the first problem), then runs the sample.

    Args:
        images: folder or URL of sample images (default: DEFAULT_IMAGES).
        engines: the engines to compare (default: every registered engine available here).
        sample: at most this many images.
        min_agreement, max_score_diff: an engine below / above these fails the check.

    Raises:
        ModelError: the contract is broken. ConfigError: no usable sample images, or an unknown engine.
    """
    import numpy as np  # noqa: PLC0415 - numpy only when the command runs

    bundle = check_contract(folder)
    report = CheckReport(model=str(folder), embedding=embedding_line(bundle))
    if bundle.fixed_batch:
        report.notes.append(fixed_batch_note(bundle))
    blobs = read_sample(images, sample, storage_options)
    arrays = []
    for name, data in blobs:
        try:
            arrays.append(_reference_input(data, bundle))
        except ImageError as err:
            raise ConfigError(f"sample image {name} cannot be used ({err}); pass --images with ordinary photos")
    logits, embedding = reference_run(bundle, np.stack(arrays))
    probs = scores_of(logits, bundle.spec.output)
    vectors = None if embedding is None else embeddings_of(embedding, bundle.spec.embedding)
    report.images = len(blobs)
    for name in engines or ENGINE_NAMES:
        spec = engine_spec(name)
        line = EngineCheck(name)
        report.engines.append(line)
        reason = _unavailable(spec)
        if reason:
            if engines:  # asked for by name: not running it is a failure
                line.problem = reason
            else:
                line.skipped = reason
            continue
        try:
            spec.check_model(bundle, {})
            results = _classify(name, bundle, [data for _, data in blobs])
        except BulkClassifyError as err:
            line.problem = str(err)
            continue
        _compare(line, results, probs, min_agreement, max_score_diff)
        if vectors is not None and line.passed:
            _compare_embeddings(line, results, vectors)
    report.engines = [e for e in report.engines if not e.skipped] + [e for e in report.engines if e.skipped]
    return report


def embedding_line(bundle: ModelBundle) -> str:
    """``embedding: tensor 'NAME' (a graph output | an intermediate tensor), dim D, L2-normalised | as given``, or ""
    for a model without one."""
    spec = bundle.spec.embedding
    if spec is None:
        return ""
    kind = "an intermediate tensor" if spec.output in intermediate_outputs(bundle) else "a graph output"
    return (f"embedding: tensor {spec.output!r} ({kind}), dim {spec.dim}, "
            f"{'L2-normalised' if spec.normalize else 'as given (not normalised)'}")


def read_sample(images: str | None, sample: int, storage_options: Mapping[str, Any] | None = None
                ) -> list[tuple[str, bytes]]:
    """(name, bytes) of up to ``sample`` images under ``images``, in name order."""

    source = str(images) if images else str(DEFAULT_IMAGES)
    fs, root = open_fs(source, storage_options)
    try:
        suffixes = tuple(f".{e}" for e in DEFAULT_EXTENSIONS)
        paths = sorted(p for p in fs.find(root) if p.lower().endswith(suffixes))[:sample]
        blobs = [(p.rsplit("/", 1)[-1], fs.cat_file(p)) for p in paths]
    except OSError as err:
        raise ConfigError(f"cannot read sample images under {source}: {err}; pass --images FOLDER") from None
    if not blobs:
        raise ConfigError(f"no images ({', '.join(DEFAULT_EXTENSIONS)}) under {source}; pass --images FOLDER")
    return blobs


def _reference_input(data: bytes, bundle: ModelBundle) -> np.ndarray:
    return load_and_preprocess(data, bundle.spec)[0]


def _unavailable(spec: EngineSpec) -> str:
    """Why engine ``spec`` cannot run on this machine, or ""."""
    if spec.gpu_only:
        if node_gpus() == 0:
            return "needs a GPU"
    try:
        spec.check({})
    except BulkClassifyError as err:
        return str(err)
    return ""


def _classify(name: str, bundle: ModelBundle, blobs: list[bytes]) -> list[Any]:
    engine = make_engine(name, bundle, top_k=min(CHECK_TOP_K, bundle.num_classes))
    try:
        return engine.classify(blobs)
    finally:
        engine.close()


def _compare(line: EngineCheck, results: list[Any], probs: np.ndarray, min_agreement: float,
             max_score_diff: float) -> None:
    """Fills ``line`` from an engine's results against the reference probabilities."""
    ok = [(i, r) for i, r in enumerate(results) if r.status == "ok" and r.class_ids]
    line.images = len(results)
    if len(ok) < len(results):
        bad = next(r for r in results if not (r.status == "ok" and r.class_ids))
        line.problem = f"{len(results) - len(ok)} of {len(results)} images failed: {bad.error}"
        return
    agree = sum(int(r.class_ids[0] == int(probs[i].argmax())) for i, r in ok)
    line.agreement = agree / len(ok)
    line.max_score_diff = max(abs(s - probs[i][c]) for i, r in ok for c, s in zip(r.class_ids, r.scores))
    if line.agreement < min_agreement:
        line.problem = f"top-1 agrees with the reference on {line.agreement:.0%} of the images (< {min_agreement:.0%})"
    elif line.max_score_diff > max_score_diff:
        line.problem = f"a score differs from the reference by {line.max_score_diff:.3g} (> {max_score_diff:g})"


def _compare_embeddings(line: EngineCheck, results: list[Any], reference: np.ndarray) -> None:
    """Fills ``line``'s least cosine of each image's embedding with the reference's, a problem below
    MIN_EMBEDDING_COSINE or where the engine gave none."""
    import numpy as np  # noqa: PLC0415

    missing = sum(r.embedding is None for r in results)
    if missing:
        line.problem = f"{missing} of {len(results)} images came back without the model's embedding"
        return
    got = np.asarray([r.embedding for r in results], np.float64)
    ref = reference.astype(np.float64)
    cosines = (got * ref).sum(1) / np.maximum(np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1), 1e-30)
    line.min_cosine = float(cosines.min())
    if line.min_cosine < MIN_EMBEDDING_COSINE:
        line.problem = (f"an embedding's cosine with the reference's is {line.min_cosine:.6f} "
                        f"(< {MIN_EMBEDDING_COSINE})")


def format_report(report: CheckReport) -> str:
    """The table the CLI prints: one line per engine."""
    lines = [f"model {report.model}: contract ok; {report.images} sample images"]
    if report.embedding:
        lines.append(report.embedding)
    lines += [f"note: {n}" for n in report.notes]
    cos = f" {'embedding cos':>13s}" if report.embedding else ""
    lines.append(f"{'engine':10s} {'images':>6s} {'top-1 agree':>11s} {'max score diff':>14s}{cos}  result")
    for e in report.engines:
        cos = (f" {'-' if e.min_cosine is None else f'{e.min_cosine:.6f}':>13s}") if report.embedding else ""
        if e.skipped:
            lines.append(f"{e.engine:10s} {'-':>6s} {'-':>11s} {'-':>14s}{cos}  skipped: {e.skipped}")
            continue
        agree = "-" if e.agreement is None else f"{e.agreement:.1%}"
        diff = "-" if e.max_score_diff is None else f"{e.max_score_diff:.2e}"
        result = "ok" if e.passed else "FAIL: " + e.problem
        lines.append(f"{e.engine:10s} {e.images:6d} {agree:>11s} {diff:>14s}{cos}  {result}")
    return "\n".join(lines)
