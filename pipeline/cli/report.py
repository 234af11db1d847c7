"""``report``, ``size`` and ``engines``: an output's summary and drift gate, the GPUs a target rate needs, and the
engines this cluster would run."""

from __future__ import annotations

import json
from typing import Any, Callable

import click

from pipeline.cli.command import ConfigDefault, LibraryCommand, catalog_option, catalog_values, key_values, storage_option
from pipeline.cli.output import echo


def _report_options() -> tuple[Callable, ...]:
    from pipeline.io.iceberg_output import ICEBERG_SCHEME
    from pipeline.quality.statistics import DriftThresholds

    drift = DriftThresholds()
    return (
        click.argument("dest"),
        storage_option("fsspec option for DEST and --against; repeatable."),
        catalog_option(f"Iceberg catalog property for an {ICEBERG_SCHEME}NAMESPACE.TABLE[@SNAPSHOT_ID|@parent] DEST or PREV; repeatable."),
        click.option("--against", default=None, metavar="PREV", help="Compare DEST with an earlier output PREV ('previous': the night DEST's nightly run compared itself with); exits 3 on drift."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table."),
        click.option("--html", "html_file", default=None, metavar="FILE", help="With --against: write a self-contained page (charts, no network) to FILE."),
        click.option("--psi-max", type=float, cls=ConfigDefault, default=None, show_default=str(drift.psi_max), help="Largest PSI of the top-1 confidence histogram that passes."),
        click.option("--js-max", type=float, cls=ConfigDefault, default=None, show_default=str(drift.js_max), help="Largest Jensen-Shannon divergence (bits) of top-1 labels that passes."),
        click.option("--error-rate-max-increase", type=float, cls=ConfigDefault, default=None, show_default=str(drift.error_rate_max_increase), help="Largest rise of an error kind's share of rows that passes."),
        click.option("--min-rows", type=int, cls=ConfigDefault, default=None, show_default=str(drift.min_rows), help="Fewer rows on either side: report, never fail."),
    )


@click.command(cls=LibraryCommand, options=_report_options)
def report(dest: str, storage_options: tuple[str, ...], catalog_options: tuple[str, ...], against: str | None,
           as_json: bool, html_file: str | None, **thresholds: Any) -> None:
    """Summarise a finished output, or with --against gate it on drift from an earlier one.

    \b
    Exit status with --against: 0 no threshold crossed, 3 drift (a threshold crossed),
    1 an output cannot be read, 2 a bad option.
    """
    from pipeline.errors import BulkClassifyError
    from pipeline.quality.report import format_summary, summarize_output

    options = key_values(storage_options)
    catalog = catalog_values(catalog_options)
    if against is None:
        if html_file:
            raise click.UsageError("--html needs --against PREV: the page compares two outputs")
        summary = summarize_output(dest, options, catalog)
        echo(json.dumps(summary, indent=2) if as_json else format_summary(summary))
        return

    from pipeline.quality.statistics import DRIFT_EXIT_CODE, DriftThresholds, compare_outputs, format_comparison

    try:
        limits = DriftThresholds(**{k: v for k, v in thresholds.items() if v is not None})
    except BulkClassifyError as err:
        raise click.UsageError(str(err)) from None
    result = compare_outputs(dest, against, limits, options, catalog)
    if html_file:
        from pipeline.quality.html import write_html

        write_html(result, html_file)
    echo(json.dumps(result, indent=2) if as_json else format_comparison(result))
    if html_file and not as_json:
        echo(f"page: {html_file}")
    if not result["passed"]:
        click.get_current_context().exit(DRIFT_EXIT_CODE)


def _size_options() -> tuple[Callable, ...]:
    from pipeline.sizing import DEFAULT_SPARE, DEFAULT_UTILIZATION

    return (
        click.argument("curve"),
        click.option("--target-rate", type=float, required=True, help="Images per second the fleet must sustain."),
        click.option("--utilization", type=float, default=DEFAULT_UTILIZATION, show_default=True, help="Fraction of the plateau to plan for."),
        click.option("--spare", type=int, default=DEFAULT_SPARE, show_default=True, help="Spare GPUs on top."),
    )


@click.command(cls=LibraryCommand, options=_size_options)
def size(curve: str, target_rate: float, utilization: float, spare: int) -> None:
    """GPUs needed for a target rate, from a measured throughput/p99 curve (CSV or JSON)."""
    from pipeline.sizing import format_sizing, size_fleet

    result = size_fleet(curve, target_rate, utilization=utilization, spare=spare)
    echo(format_sizing(result))


@click.command("engines", cls=LibraryCommand)
def engines_command() -> None:
    """The registered engines, what each needs, their --engine-option names, and what auto picks here."""
    from pipeline.engines.auto import choose
    from pipeline.engines.registry import AUTO_ENGINE, REGISTRY

    try:
        choice = choose()
        echo(f"{AUTO_ENGINE} (the default) -> {choice.engine} here: {choice.reason}")
    except Exception as err:  # noqa: BLE001 - a cluster that cannot be reached: say so, list the engines anyway
        echo(f"{AUTO_ENGINE} (the default): could not count the cluster's GPUs ({err})")
    for spec in REGISTRY.values():
        echo(f"{spec.name}: {spec.summary}{' (takes a GPU per actor where the cluster has GPUs)' if spec.needs_gpu else ''}")
        echo(f"  {spec.int8}")
        for option in spec.options:
            echo(f"  {option.name}={option.kind}  {option.help}")
