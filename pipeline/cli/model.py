"""``model quantize|check|import``: build and check the model folders that --model loads."""

from __future__ import annotations

from typing import Any, Callable

import click

from pipeline.cli.command import ConfigDefault, LibraryGroup, key_values, model_option, storage_option
from pipeline.cli.output import Failure, echo

SOURCE_STORAGE_HELP = "fsspec option for SOURCE; repeatable."


@click.group("model", cls=LibraryGroup)
def model_group() -> None:
    """Build and check model folders that --model loads."""


def _quantize_options() -> tuple[Callable, ...]:
    from pipeline.int8.gate import GateThresholds
    from pipeline.int8.quantize import (
        CALIBRATION_METHODS, DEFAULT_SAMPLES, DEFAULT_SEED, EXCLUDE_KEYWORDS, QUANT_FORMATS, QUANT_TYPES, SIDE_SUFFIX,
        QuantizeOptions,
    )

    q, g = QuantizeOptions(), GateThresholds()  # the defaults the help shows
    return (
        click.option("--calibration", "source", required=True, metavar="SOURCE", help="Folder or URL (s3://bucket/prefix) of images like the job's; sampled up to --samples."),
        click.option("--output", required=True, metavar="DIR", help="The INT8 model folder to write (new or empty)."),
        model_option("The FP32 model folder."),
        click.option("--samples", type=int, default=DEFAULT_SAMPLES, show_default=True, help="Images sampled from SOURCE (calibration + held-out)."),
        click.option("--calibration-images", type=int, default=q.calibration_images, show_default=True, help="Images of the sample that calibrate; the rest are held out for the gate."),
        click.option("--seed", type=int, default=DEFAULT_SEED, show_default=True, help="Seed of the sampling (the report records it)."),
        click.option("--method", type=click.Choice(CALIBRATION_METHODS), default=q.method, show_default=True, help="Calibration method."),
        click.option("--percentile", type=float, default=q.percentile, show_default=True, help="The percentile method's cut."),
        click.option("--per-channel/--per-tensor", default=q.per_channel, show_default=True, help="Weight scales per output channel or per tensor."),
        click.option("--exclude", default=",".join(q.exclude), show_default=True, help=f"Comma-separated nodes left in float: node names, or {', '.join(EXCLUDE_KEYWORDS)}; '' for none."),
        click.option("--format", "quant_format", type=click.Choice(QUANT_FORMATS), default=q.quant_format, show_default=True, help="QDQ (QuantizeLinear/DequantizeLinear pairs) or QOperator (QLinearConv...)."),
        click.option("--types", type=click.Choice(tuple(QUANT_TYPES)), default=q.types, show_default=True, help="Activation and weight integer types."),
        click.option("--min-decisive-agreement", type=float, default=g.min_decisive_agreement, show_default=True, help="Top-1 agreement with FP32 on held-out images whose FP32 margin is at least 0.1."),
        click.option("--min-class-agreement", type=float, default=g.min_class_agreement, show_default=True, help="Top-1 agreement every FP32 top-1 class with --min-class-images images must reach."),
        click.option("--min-class-images", type=int, default=g.min_class_images, show_default=True, help="Held-out images a class needs to be gated on its own."),
        click.option("--min-top1-agreement", type=float, default=g.min_top1_agreement, show_default=True, help="Top-1 agreement with FP32 over all held-out images."),
        click.option("--min-top5-overlap", type=float, default=g.min_top5_overlap, show_default=True, help="Mean share of FP32's top-5 that INT8's top-5 holds."),
        click.option("--force", is_flag=True, help="Write the model even when the gate fails, marked failed in its report."),
        click.option("--report", "report_path", cls=ConfigDefault, default=None, show_default=f"DIR{SIDE_SUFFIX} beside DIR", metavar="FILE", help="Where a refused model's report goes."),
        storage_option(SOURCE_STORAGE_HELP),
    )


@model_group.command("quantize", options=_quantize_options)
def model_quantize(source: str, output: str, model: str | None, samples: int, calibration_images: int, seed: int,
                   method: str, percentile: float, per_channel: bool, exclude: str, quant_format: str, types: str,
                   force: bool, report_path: str | None, storage_options: tuple[str, ...], **gate: Any) -> None:
    """INT8 (QDQ) model calibrated on SOURCE, written only if it passes the gate against FP32 on held-out images.

    \b
    Exit status: 0 written, 3 the gate failed (no model written; the report goes to a side file), 1 an error.
    """
    from pipeline.int8.gate import GateThresholds
    from pipeline.int8.quantize import QuantizeOptions, format_gate, quantize_model

    options = QuantizeOptions(method=method, percentile=percentile, per_channel=per_channel,
                              exclude=tuple(exclude.split(",")), quant_format=quant_format, types=types,
                              calibration_images=calibration_images)
    thresholds = GateThresholds(**gate)
    result = quantize_model(source, output, model=model, samples=samples, seed=seed, options=options,
                            thresholds=thresholds, force=force, storage_options=key_values(storage_options),
                            report_path=report_path)
    echo(format_gate(result.report))
    state = "passed" if result.passed else "FAILED (written with --force, marked failed)"
    echo(f"INT8 model {state}: {result.model_dir} (report {result.report_path.name})")


def _check_options() -> tuple[Callable, ...]:
    from pipeline.model_check import DEFAULT_MAX_SCORE_DIFF, DEFAULT_MIN_AGREEMENT, DEFAULT_SAMPLE

    return (
        click.argument("folder", metavar="DIR"),
        click.option("--images", default=None, metavar="SOURCE", help="Folder or URL of sample images (default: the repository's tests/data/photos)."),
        click.option("--engine", "engines", multiple=True, metavar="NAME", help="An engine to compare (repeatable; default: every engine available here)."),
        click.option("--sample", type=int, default=DEFAULT_SAMPLE, show_default=True, help="Images of SOURCE to run."),
        click.option("--min-agreement", type=float, default=DEFAULT_MIN_AGREEMENT, show_default=True, help="Top-1 agreement with the reference each engine needs."),
        click.option("--max-score-diff", type=float, default=DEFAULT_MAX_SCORE_DIFF, show_default=True, help="Largest score difference from the reference allowed."),
        storage_option(SOURCE_STORAGE_HELP),
    )


@model_group.command("check", options=_check_options)
def model_check(folder: str, images: str | None, engines: tuple[str, ...], sample: int, min_agreement: float,
                max_score_diff: float, storage_options: tuple[str, ...]) -> None:
    """Check a model folder: its contract, then sample images through the reference and every engine here.

    \b
    Exit status: 0 every engine agrees with the reference, 1 a broken contract, an error, or an engine below the
    thresholds.
    """
    from pipeline.model_check import check_model_folder, format_report

    report = check_model_folder(folder, images=images, engines=engines, sample=sample,
                                min_agreement=min_agreement, max_score_diff=max_score_diff,
                                storage_options=key_values(storage_options))
    echo(format_report(report))
    if not report.passed:
        failed = [e.engine for e in report.engines if not e.passed]
        raise Failure(f"model check failed for {', '.join(failed)}; see the lines above")


def _import_options() -> tuple[Callable, ...]:
    from pipeline.model_import.core import (
        DEFAULT_MAX_LOGIT_DIFF, DEFAULT_MIN_AGREEMENT, DEFAULT_MIN_EMBEDDING_COSINE, DEFAULT_SAMPLE, SOURCES,
    )
    from pipeline.model.folder import ONNX_EMBEDDING

    return (
        click.argument("source", type=click.Choice(tuple(SOURCES))),
        click.argument("name"),
        click.option("--output", required=True, metavar="DIR", help="The model folder to write (new or empty)."),
        click.option("--checkpoint", metavar="FILE", help="timm: a state dict, train.py checkpoint or safetensors file; torchvision: a state dict."),
        click.option("--labels", metavar="FILE", help="Class names, one a line in output order (default: the checkpoint's, ImageNet-1k's for an ImageNet timm architecture, torchvision's categories, id2label)."),
        click.option("--preset", metavar="ENTRY", help="torchvision: the weights entry whose transforms and categories apply, e.g. IMAGENET1K_V2 (default: DEFAULT)."),
        click.option("--use-ema", is_flag=True, help="timm: take a train.py checkpoint's EMA weights (state_dict_ema) instead of its state_dict."),
        click.option("--embedding", is_flag=True, help=f"Also export the pooled pre-logits features as a second ONNX output {ONNX_EMBEDDING!r}, declared in preprocess.json (L2-normalised), and check them against the framework's."),
        click.option("--images", metavar="SOURCE", cls=ConfigDefault, default=None, show_default="the repository's tests/data/photos", help="Folder or URL of sample photos for the parity check."),
        click.option("--sample", type=int, default=DEFAULT_SAMPLE, show_default=True, help="Sample photos compared."),
        click.option("--min-agreement", type=float, default=DEFAULT_MIN_AGREEMENT, show_default=True, help="Top-1 agreement with the framework needed on the clearly decided photos."),
        click.option("--max-logit-diff", type=float, default=DEFAULT_MAX_LOGIT_DIFF, show_default=True, help="Largest median over the photos of the logit difference from the framework, as a share of the photo's logit range."),
        click.option("--min-embedding-cosine", type=float, default=DEFAULT_MIN_EMBEDDING_COSINE, show_default=True, help="With --embedding: the median over the photos of the cosine with the framework's features needed."),
    )


@model_group.command("import", options=_import_options)
def model_import(source: str, name: str, output: str, checkpoint: str | None, labels: str | None, preset: str | None,
                 use_ema: bool, embedding: bool, images: str | None, sample: int, min_agreement: float,
                 max_logit_diff: float, min_embedding_cosine: float) -> None:
    """Write a model folder from a trained network, kept only if it classifies like its framework.

    \b
    SOURCE NAME: timm ARCHITECTURE --checkpoint FILE; torchvision MODEL --checkpoint FILE; huggingface FOLDER.
    Nothing is downloaded. The written folder runs through pipeline.model.imaging and ONNX Runtime on the sample photos,
    against the framework's own transform and forward.
    Exit status: 0 written, 3 parity failed (nothing written), 1 an error.
    """
    from pipeline.model_import.core import ImportOptions, format_result, import_model

    options = ImportOptions(images=images, sample=sample, min_agreement=min_agreement, max_logit_diff=max_logit_diff,
                            min_embedding_cosine=min_embedding_cosine)
    result = import_model(source, name, output, checkpoint=checkpoint, labels=labels, preset=preset, use_ema=use_ema,
                          embedding=embedding, options=options)
    echo(format_result(result))
