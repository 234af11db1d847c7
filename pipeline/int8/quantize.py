"""INT8 models: a calibration sample from a source, ONNX Runtime's static QDQ quantization, and the gate against FP32.

``quantize_model`` lists SOURCE like a run does, samples up to ``samples`` images by a seeded hash of their URIs,
splits them into a calibration part and a held-out part (never used for calibration), quantizes the model with
``onnxruntime.quantization.quantize_static`` fed by the calibration part, then compares INT8 with FP32 on the
held-out part (``gate``). A model that passes is written as a model folder ``--model DIR`` loads; one that fails is
not written unless forced, and its report goes to a side file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, NoReturn, Sequence

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from pipeline.errors import ConfigError, GateFailed, ImageError, ModelError
from pipeline.int8.gate import (
    GateThresholds, class_noise, gate, held_out_figures, noise_summary, pixel_noise, sample_failures,
)
from pipeline.int8.quantize_nodes import CALIBRATION_BATCH, EXCLUDE_KEYWORDS, calibration_reader, resolve_exclusions
from pipeline.io.fetch import read_with_retries
from pipeline.io.keys import uri_path
from pipeline.io.source import check_source, list_unit, plan_listing
from pipeline.model.default_model import file_sha256
from pipeline.model.folder import LABELS_FILE, MODEL_FILE, SPEC_FILE, load_model
from pipeline.model.imaging import load_and_preprocess
from pipeline.schema import DEFAULT_EXTENSIONS
from pipeline.storage import open_fs

LOG = logging.getLogger(__name__)

GATE_REPORT_FILE = "int8_gate.json"  # in the model folder; beside it as <output>.int8_gate.json when refused
SIDE_SUFFIX = ".int8_gate.json"
REPORT_FORMAT = "bulk-classify-int8-gate/1"
DEFAULT_SAMPLES = 1000
DEFAULT_CALIBRATION_IMAGES = 192  # twelve calibration batches
DEFAULT_SEED = 0
# Min-max: entropy gave the same scales at 5.6x the calibration time, percentile 99.99 lost decisive images (98.3 %
# against 98.95 %) at 5.3x (docs/int8.md).
DEFAULT_METHOD = "minmax"
DEFAULT_PERCENTILE = 99.999
# Only the classifier in float: through an AMX Xeon's integer kernels the depthwise convs in float as well fell to
# 62 % top-1 agreement against 89 % (though float simulation rated them higher), at 1.24x FP32 against 1.81x
# (docs/int8.md).
DEFAULT_EXCLUDE = ("classifier",)
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
QUANT_FORMATS = ("qdq", "qoperator")
# Activation and weight integer types. u8s8 is what VNNI multiplies natively: on an AVX512-VNNI Xeon it ran 2x FP32
# where s8s8 ran 1.1x, at the same agreement; on x86 CPUs without VNNI every type either saturates (agreement lost)
# or runs slower than FP32 (docs/int8.md), so the gate and bench_int8.py decide on the CPU that will run the model.
QUANT_TYPES = {"s8s8": ("QInt8", "QInt8"), "u8s8": ("QUInt8", "QInt8"), "u8u8": ("QUInt8", "QUInt8")}
DEFAULT_TYPES = "u8s8"
EVAL_BATCH = 16
DECODE_THREADS = 4
MIN_CALIBRATION_IMAGES = CALIBRATION_BATCH


@dataclass(frozen=True, kw_only=True)
class QuantizeOptions:
    """How the model is quantized (each choice measured: docs/int8.md).

    Attributes:
        method: the calibration method, one of CALIBRATION_METHODS.
        percentile: the percentile method's cut, e.g. 99.999.
        per_channel: one weight scale per output channel instead of one per tensor.
        exclude: nodes left in float: ONNX node names, or "stem" / "pool" / "classifier" (EXCLUDE_KEYWORDS).
        quant_format: "qdq" (QuantizeLinear/DequantizeLinear pairs) or "qoperator" (QLinearConv and friends).
        types: activation and weight integer types, a key of QUANT_TYPES.
        reduce_range: 7-bit weights (ONNX Runtime's remedy for VPMADDUBSW saturation on AVX2; on EfficientNet-Lite0
            without VNNI it lifted top-1 agreement from 54 to 66 %, far under the gate: docs/int8.md).
        calibration_images: images of the sample used for calibration; the rest are held out.
    """

    method: str = DEFAULT_METHOD
    percentile: float = DEFAULT_PERCENTILE
    per_channel: bool = True
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    quant_format: str = "qdq"
    types: str = DEFAULT_TYPES
    reduce_range: bool = False
    calibration_images: int = DEFAULT_CALIBRATION_IMAGES

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude", tuple(e for e in (x.strip() for x in self.exclude) if e))
        if self.method not in CALIBRATION_METHODS:
            raise ConfigError(f"--method {self.method!r} is not one of {', '.join(CALIBRATION_METHODS)}")
        if self.quant_format not in QUANT_FORMATS:
            raise ConfigError(f"--format {self.quant_format!r} is not one of {', '.join(QUANT_FORMATS)}")
        if self.types not in QUANT_TYPES:
            raise ConfigError(f"--types {self.types!r} is not one of {', '.join(QUANT_TYPES)}")
        if not 90 < self.percentile < 100:
            raise ConfigError(f"--percentile {self.percentile!r} must be within (90, 100), e.g. 99.999")
        if not isinstance(self.calibration_images, int) or self.calibration_images < MIN_CALIBRATION_IMAGES:
            raise ConfigError(f"--calibration-images {self.calibration_images!r} must be at least "
                              f"{MIN_CALIBRATION_IMAGES}; about 200 images calibrate well")


# ---- the sample ----------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """The sampled images: URIs with their listing identity, split into calibration and held-out parts."""

    source: str
    listed: int
    calibration: list[tuple[str, int | None, str | None]] = field(default_factory=list)
    held_out: list[tuple[str, int | None, str | None]] = field(default_factory=list)

    def identity(self, seed: int, requested: int) -> dict[str, Any]:
        """What the report records to name this sample again: counts, seed, and a digest of each part."""
        return {"source": self.source, "listed": self.listed, "requested": requested, "seed": seed,
                "calibration_images": len(self.calibration), "held_out_images": len(self.held_out),
                "calibration_sha256": _digest(self.calibration), "held_out_sha256": _digest(self.held_out),
                "rule": "images ranked by sha256(seed:uri); the first N of the ranking are the sample, its first "
                        "calibration_images the calibration part"}


def _digest(entries: Sequence[tuple[str, int | None, str | None]]) -> str:
    h = hashlib.sha256()
    for uri, size, version in sorted(entries):
        h.update(f"{uri}\t{size}\t{version}\n".encode())
    return h.hexdigest()


def draw_sample(source: str, storage_options: Mapping[str, Any], *, samples: int, calibration_images: int,
                seed: int, extensions: tuple[str, ...]) -> Sample:
    """List ``source`` and draw the sample: the first ``samples`` images ranked by sha256(seed:uri).

    Raises:
        SourceError: the source cannot be listed. ConfigError: it has too few images for a calibration part and
        a held-out part.
    """

    fs, root = open_fs(source, storage_options)
    check_source(fs, root, source)
    entries = []
    for group in plan_listing(fs, root, extensions, 1):
        for unit in group:
            for uri, size, etag, mtime in list_unit(fs, unit, extensions):
                entries.append((uri, size, etag or (None if mtime is None else str(mtime))))
    ranked = sorted(entries, key=lambda e: hashlib.sha256(f"{seed}:{e[0]}".encode()).digest())[:samples]
    if len(ranked) <= calibration_images:
        raise ConfigError(f"{source} has {len(entries)} images ({len(ranked)} sampled), not more than "
                          f"--calibration-images {calibration_images}: a held-out part is needed too; give a folder "
                          f"of at least {calibration_images + 100} ordinary photos")
    return Sample(source=source, listed=len(entries), calibration=ranked[:calibration_images],
                  held_out=ranked[calibration_images:])


def load_tensors(uris: Sequence[str], storage_options: Mapping[str, Any], spec: Any, *, retries: int = 3
                 ) -> tuple[np.ndarray, list[str], dict[str, str]]:
    """The model inputs of ``uris`` (read and preprocessed like the onnx engine does), the URIs kept, and the
    error of each image that could not be used (``{uri: "kind: detail"}``)."""
    import numpy as np  # noqa: PLC0415 - numpy only when the command runs, not for every CLI call


    if not uris:
        return np.zeros((0, *spec.input_shape), np.float32), [], {}
    fs, _root = open_fs(uris[0], storage_options)

    def one(uri: str) -> np.ndarray | str:
        try:
            return load_and_preprocess(read_with_retries(fs, fs._strip_protocol(uri_path(uri)), retries), spec)[0]
        except ImageError as err:
            return str(err)

    with ThreadPoolExecutor(DECODE_THREADS) as pool:
        done = list(pool.map(one, uris))
    kept = [u for u, d in zip(uris, done) if not isinstance(d, str)]
    errors = {u: d for u, d in zip(uris, done) if isinstance(d, str)}
    arrays = [d for d in done if not isinstance(d, str)]
    return (np.stack(arrays) if arrays else np.zeros((0, *spec.input_shape), np.float32)), kept, errors


# ---- quantization --------------------------------------------------------------------------------------------


def quantize_onnx(model_path: Path, output_path: Path, input_name: str, calibration: np.ndarray,
                  options: QuantizeOptions, *, extra_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Quantize ``model_path`` into ``output_path`` with ONNX Runtime's tooling; the method as the report keeps it.

    ``extra_options``: entries of ONNX Runtime's ``quantize_static(extra_options=...)`` passed as given, for a search
    of choices beyond ``QuantizeOptions`` (the command never passes any).
    """
    import onnxruntime

    nodes = resolve_exclusions(model_path, options.exclude)
    extra = _quantize_static(model_path, output_path, input_name, calibration, options, nodes, extra_options or {})
    activation, weight = QUANT_TYPES[options.types]
    return {"tool": "onnxruntime.quantization.quantize_static", "onnxruntime": onnxruntime.__version__,
            "format": options.quant_format.upper(), "calibrate_method": options.method,
            "percentile": options.percentile if options.method == "percentile" else None,
            "per_channel": options.per_channel, "types": options.types, "activation_type": activation,
            "weight_type": weight, "reduce_range": options.reduce_range,
            "nodes_to_exclude": nodes, "exclude": list(options.exclude), "extra_options": extra}


def _quantize_static(model_path: Path, output_path: Path, input_name: str, calibration: np.ndarray,
                     options: QuantizeOptions, nodes: Sequence[str],
                     extra_options: Mapping[str, Any]) -> dict[str, Any]:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    reader = calibration_reader(input_name, calibration)
    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[options.method]
    activation, weight = QUANT_TYPES[options.types]
    extra: dict[str, Any] = dict(extra_options)
    if options.method == "percentile":
        extra["CalibPercentile"] = options.percentile
    with _without_preprocess_advice():
        quantize_static(
            str(model_path), str(output_path), reader,
            quant_format=QuantFormat.QDQ if options.quant_format == "qdq" else QuantFormat.QOperator,
            per_channel=options.per_channel,
            activation_type=getattr(QuantType, activation),
            weight_type=getattr(QuantType, weight),
            reduce_range=options.reduce_range,
            calibrate_method=method,
            nodes_to_exclude=list(nodes),
            extra_options=extra,
            calibration_providers=["CPUExecutionProvider"],
        )
    return extra


class _PreprocessAdvice(logging.Filter):
    """Drops ONNX Runtime's "Please consider (to run) pre-processing before quantization" warnings: its
    ``quant_pre_process`` gave this model exactly the same figures (docs/int8.md), so to our users they are noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Please consider")


@contextlib.contextmanager
def _without_preprocess_advice() -> Iterator[None]:
    root, advice = logging.getLogger(), _PreprocessAdvice()
    root.addFilter(advice)
    try:
        yield
    finally:
        root.removeFilter(advice)


def run_logits(model_path: Path, input_name: str, output_name: str, tensors: np.ndarray, *,
               threads: int | None = None) -> np.ndarray:
    """Logits of ``tensors`` through ONNX Runtime on the CPU, EVAL_BATCH at a time."""
    import numpy as np  # noqa: PLC0415 - numpy only when the command runs, not for every CLI call

    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(model_path), sess_options=options, providers=["CPUExecutionProvider"])
    out = [session.run([output_name], {input_name: tensors[i:i + EVAL_BATCH]})[0]
           for i in range(0, len(tensors), EVAL_BATCH)]
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


# ---- the command ---------------------------------------------------------------------------------------------


@dataclass
class QuantizeResult:
    """What ``quantize_model`` did: whether the gate passed, where the model and the report went."""

    passed: bool
    written: bool
    report: dict[str, Any]
    report_path: Path
    model_dir: Path | None


def side_report_path(output: str | os.PathLike) -> Path:
    """Where a refused model's report goes: beside the output folder, never inside it."""
    out = Path(output).expanduser()
    return out.with_name(out.name + SIDE_SUFFIX)


def check_output(output: str | os.PathLike) -> Path:
    """The output folder, refused before any work when it would overwrite something."""
    out = Path(output).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--output {output} already exists and is not an empty folder; remove it or choose "
                          "another folder")
    if not out.parent.exists():
        raise ConfigError(f"--output {output}: its parent folder {out.parent} does not exist; create it first")
    return out


def quantize_model(source: str, output: str, *, model: str | None = None, samples: int = DEFAULT_SAMPLES,
                   seed: int = DEFAULT_SEED, options: QuantizeOptions = QuantizeOptions(),
                   thresholds: GateThresholds = GateThresholds(), force: bool = False,
                   storage_options: Mapping[str, Any] | None = None, extensions: tuple[str, ...] | None = None,
                   report_path: str | os.PathLike | None = None) -> QuantizeResult:
    """Quantize ``model`` calibrated on ``source``, gate it on the held-out images, and write it if it passes.

    Raises:
        ConfigError / SourceError / ModelError: bad arguments, storage or model, before anything is written.
        GateFailed: the gate failed and ``force`` is off; the full report is at ``.result.report_path``.
    """

    if not isinstance(samples, int) or samples < 1:
        raise ConfigError(f"--samples {samples!r} must be a positive number of images, e.g. {DEFAULT_SAMPLES}")
    out = check_output(output)
    side = Path(report_path).expanduser() if report_path else side_report_path(out)
    bundle = load_model(model)
    resolve_exclusions(bundle.onnx_path, options.exclude)  # a bad --exclude fails before the sample is read
    storage_options = dict(storage_options or {})
    started = time.perf_counter()
    sample = draw_sample(source, storage_options, samples=samples, calibration_images=options.calibration_images,
                         seed=seed, extensions=extensions or DEFAULT_EXTENSIONS)
    cal_x, cal_kept, cal_errors = load_tensors([e[0] for e in sample.calibration], storage_options, bundle.spec)
    held_x, held_kept, held_errors = load_tensors([e[0] for e in sample.held_out], storage_options, bundle.spec)
    if len(cal_x) < MIN_CALIBRATION_IMAGES:
        raise ConfigError(f"only {len(cal_x)} of the {len(sample.calibration)} calibration images could be read "
                          f"(at least {MIN_CALIBRATION_IMAGES}); first error: {next(iter(cal_errors.values()), '-')}")
    whole = len(cal_x) // CALIBRATION_BATCH * CALIBRATION_BATCH
    cal_x, cal_kept = cal_x[:whole], cal_kept[:whole]
    read_s = time.perf_counter() - started

    report: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "fp32_model": {"name": bundle.name, "sha256": file_sha256(bundle.onnx_path)},
        "sample": {**sample.identity(seed, samples), "calibration_used": len(cal_kept),
                   "held_out_used": len(held_kept), "unreadable": {**cal_errors, **held_errors}},
        "thresholds": asdict(thresholds),
    }
    t0 = time.perf_counter()
    fp32 = run_logits(bundle.onnx_path, bundle.input_name, bundle.output_name, held_x)
    narrow = sample_failures(held_out_figures(fp32, thresholds, bundle.labels), thresholds) if len(held_x) else [
        f"none of the {len(sample.held_out)} held-out images could be read"]
    if narrow and not force:  # the sample cannot judge any model: refuse before spending the quantization
        report.update(passed=False, forced=False, failures=narrow,
                      figures=held_out_figures(fp32, thresholds, bundle.labels) if len(held_x) else {})
        return _refuse(report, side)
    with tempfile.TemporaryDirectory(prefix=".quantize-", dir=out.parent) as tmp:
        tmp_dir = Path(tmp) / "model"
        tmp_dir.mkdir()
        t1 = time.perf_counter()
        report["method"] = quantize_onnx(bundle.onnx_path, tmp_dir / MODEL_FILE, bundle.input_name, cal_x, options)
        quantize_s = time.perf_counter() - t1
        int8 = run_logits(tmp_dir / MODEL_FILE, bundle.input_name, bundle.output_name, held_x)
        noisy = run_logits(bundle.onnx_path, bundle.input_name, bundle.output_name,
                           pixel_noise(held_x, bundle.spec, seed=seed))
        verdict = gate(fp32, int8, thresholds, bundle.labels, noisy)
        report.update(passed=verdict["passed"], forced=bool(force and not verdict["passed"]),
                      failures=verdict["failures"], figures=verdict["figures"],
                      seconds={"read": round(read_s, 2), "quantize": round(quantize_s, 2),
                               "evaluate": round(time.perf_counter() - t0 - quantize_s, 2)})
        if not (verdict["passed"] or force):
            return _refuse(report, side)
        report["int8_sha256"] = file_sha256(tmp_dir / MODEL_FILE)
        (tmp_dir / LABELS_FILE).write_text("\n".join(bundle.labels) + "\n", encoding="utf-8")
        (tmp_dir / SPEC_FILE).write_text(bundle.spec.to_json(), encoding="utf-8")
        (tmp_dir / GATE_REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty (check_output): the finished folder takes its place in one rename
        os.replace(tmp_dir, out)
    return QuantizeResult(passed=verdict["passed"], written=True, report=report, report_path=out / GATE_REPORT_FILE,
                          model_dir=out)


def _refuse(report: dict[str, Any], side: Path) -> NoReturn:
    side.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    result = QuantizeResult(passed=False, written=False, report=report, report_path=side, model_dir=None)
    floor = (report.get("figures") or {}).get("fp32_pixel_noise")
    context = f"; {noise_summary(floor)}" if floor else ""
    # A refused sample is fixed by other images; a refused model can still be written, marked failed.
    fix = "; --force writes it anyway, marked failed" if report.get("method") else ""
    raise GateFailed(f"INT8 gate failed, no model written: {'; '.join(report['failures'])}{context} "
                     f"(report: {side}){fix}", result)


def _float_nodes(method: Mapping[str, Any]) -> str:
    nodes = method["nodes_to_exclude"]
    if len(nodes) <= 4:
        return ", ".join(nodes) or "-"
    return f"{len(nodes)} ({', '.join(method['exclude']) or '-'})"


def format_gate(report: Mapping[str, Any]) -> str:
    """A few lines of the report's figures for the terminal."""
    f = report.get("figures") or {}
    if not f:
        return "no figures"
    m = report["method"]
    lines = [
        f"held-out images {f['images']} (calibration {report['sample']['calibration_used']}), "
        f"method {m['calibrate_method']} {m['format']} {m['types']} per-channel {m['per_channel']}, float nodes "
        f"{_float_nodes(m)}",
        f"top-1 agreement {f['top1_agreement']:.2%}; decisive (margin >= {report['thresholds']['decisive_margin']}) "
        f"{f['decisive_agreement']:.2%} of {f['decisive_images']}; top-5 overlap {f['top5_overlap']:.2%}",
        f"classes with >= {report['thresholds']['min_class_images']} images: {f['classes_gated']}; worst: "
        + (", ".join(f"{c['label']} {c['agreement']:.0%} of {c['images']}" + class_noise(c)
                     for c in f["worst_classes"]) or "-"),
    ]
    floor = f.get("fp32_pixel_noise")
    if floor:
        lines.append(f"{noise_summary(floor)}, top-5 {floor['top5_overlap']:.2%} (what the images' near-ties alone "
                     "flip)")
    return "\n".join(lines)
