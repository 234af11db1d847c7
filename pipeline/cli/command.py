"""The commands' shape: a command declares its options when click first asks for them, a group imports a command
when it is first asked for, and the options and KEY=VALUE parsing several commands share."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Sequence

import click

from pipeline.cli.output import failure

BUILT_IN_MODEL = "built-in EfficientNet-Lite0"  # what --model means when it is not given


class LibraryCommand(click.Command):
    """A command whose library errors leave through EXIT_STATUSES.

    ``options`` is a function returning the command's ``click.option``/``click.argument`` decorators, top to bottom;
    it runs the first time click asks for the parameters (to parse or to show help). Their defaults, choices and help
    come from the library's modules, so a command that is only listed (``bulk-classify --help``) imports none of them.
    """

    def __init__(self, *args: Any, options: Callable[[], Sequence[Callable]] | None = None, **kwargs: Any):
        self._declare = options
        super().__init__(*args, **kwargs)

    @property
    def params(self) -> list[click.Parameter]:
        if self._declare is not None:
            declare, self._declare = self._declare, None
            for add in declare():  # click's decorators append to a Command's params
                add(self)
        return self._params

    @params.setter
    def params(self, value: list[click.Parameter]) -> None:
        self._params = value

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as err:  # noqa: BLE001 - mapped by the table, or raised again as it was
            names = []
            while ctx.parent is not None:
                names.append(ctx.info_name)
                ctx = ctx.parent
            mapped = failure(" ".join(reversed(names)), err)
            if mapped is None:
                raise
            raise mapped from None


class LibraryGroup(click.Group):
    """The command line's groups: their commands are LibraryCommands, their subgroups LibraryGroups.

    ``lazy`` maps a command's name to where it is defined (``"pipeline.cli.run:run"``), imported the first time click
    asks for that command.
    """

    command_class = LibraryCommand
    group_class = type

    def __init__(self, *args: Any, lazy: dict[str, str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            module, _, name = self.lazy[cmd_name].partition(":")
            self.add_command(getattr(importlib.import_module(module), name), cmd_name)
        return self.commands.get(cmd_name)


class ConfigDefault(click.Option):
    """An option that is None when not given, so that the library fills in its default (RunConfig merges it over the
    environment); the help shows that default as the module that owns it writes it: ``[default: 5]``, not ``(5)``."""

    def get_help_extra(self, ctx: click.Context) -> Any:
        extra = super().get_help_extra(ctx)
        if isinstance(self.show_default, str):
            extra["default"] = self.show_default
        return extra


def model_option(help: str, **kwargs: Any) -> Callable:  # noqa: A002 - click's name
    """``--model``: a model folder, the built-in model when not given."""
    return click.option("--model", cls=ConfigDefault, default=None, show_default=BUILT_IN_MODEL, help=help, **kwargs)


def storage_option(help: str) -> Callable:  # noqa: A002
    """``--storage-option KEY=VALUE``, repeatable; ``key_values`` parses it."""
    return click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE", help=help)


def catalog_option(help: str) -> Callable:  # noqa: A002
    """``--catalog-option KEY=VALUE``, repeatable; ``catalog_values`` parses it."""
    return click.option("--catalog-option", "catalog_options", multiple=True, metavar="KEY=VALUE", help=help)


def key_values(items: Sequence[str], flag: str = "--storage-option", example: str = "anon=true") -> dict[str, Any]:
    """Repeated ``flag KEY=VALUE`` values as a dict (the value typed as the config reads it); a bad one is a usage
    error naming ``example``."""
    from pipeline.config import parse_option
    from pipeline.errors import BulkClassifyError

    try:
        return dict(parse_option(i, flag, example) for i in items)
    except BulkClassifyError as err:
        raise click.BadParameter(str(err)) from None


def catalog_values(items: Sequence[str]) -> dict[str, Any]:
    """``--catalog-option`` values as a dict."""
    return key_values(items, "--catalog-option", "warehouse=DIR")
