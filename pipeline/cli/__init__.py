"""The command line, ``bulk-classify``: the group, its global options, and where each command lives.

Each command module parses its options, calls one library function and writes its result through
``pipeline.cli.output``, whose one table turns the library's exceptions into exit statuses. A command is imported
when it is asked for, and its library modules when it runs (or shows its help), so ``bulk-classify --help`` imports
none of them.
"""

from __future__ import annotations

import logging

import click

from pipeline import __version__
from pipeline.cli.command import LibraryGroup
from pipeline.terminal import quiet_ray

# Each command -> where it is defined.
COMMANDS = {
    "run": "pipeline.cli.run:run",
    "nightly": "pipeline.cli.run:nightly",
    "model": "pipeline.cli.model:model_group",
    "repo": "pipeline.cli.repo:repo",
    "report": "pipeline.cli.report:report",
    "size": "pipeline.cli.report:size",
    "engines": "pipeline.cli.report:engines_command",
}


@click.group(cls=LibraryGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="bulk-classify")
@click.option("-v", "--verbose", is_flag=True, help="Log the library's progress to stderr.")
def main(verbose: bool) -> None:
    """Classify every image under a folder or bucket prefix into a Parquet table."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        quiet_ray()
