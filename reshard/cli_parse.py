"""How the command line becomes values: the typer parameters built from the option table, and a parse
that pays only for what the line needs.

`takes_options` gives ``plan``, ``convert`` and ``inspect`` their options from
`reshard.model.option_table` (one row per flag, in ``--help`` order), so a flag is declared once;
`click_command` is the parse `reshard.cli.main` runs (issue 33), kept apart from the verbs so
that `cli.py` reads as parse, call, render. Nothing here imports torch or a layer below the CLI
but the model's option table.
"""
from __future__ import annotations

import functools
import inspect
import os
import re
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from reshard.model import option_table
from reshard.model.option_table import OptionSpec

FLAGS = "flags"
"""The parameter of a verb that stands for its table options: they take its place in the signature,
and the verb receives their values as one dict under this name."""


def choice(choices: tuple[str, ...]) -> dict:
    """An option's ``parser`` and ``metavar`` for a fixed set of values: checked by typer, listed in --help."""
    def parse(value: str) -> str:
        if value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return {"parser": parse, "metavar": "[" + "|".join(choices) + "]"}


def option(spec: OptionSpec, verb: str = "") -> Any:
    """The typer option of a table row (``verb``: whose help and default, where a verb has its own)."""
    extra: dict[str, Any] = dict(choice(spec.choices)) if spec.choices else {}
    if spec.min is not None:
        extra["min"] = spec.min
    return typer.Option(spec.default_for(verb), spec.flag, help=spec.help_for(verb), **extra)


def named_option(name: str) -> Any:
    """The typer option of the table row ``name``, for a verb that takes it beside the table's three."""
    return option(option_table.BY_NAME[name])


def annotation(spec: OptionSpec, verb: str = "") -> Any:
    """The type typer reads for a table row (it names it in --help: ``<list[Path]>``, ``<path>``)."""
    kind: Any = list[spec.type] if spec.repeatable else spec.type
    return Optional[kind] if spec.default_for(verb) is None else kind


def takes_options(verb: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A verb's signature with its table options in place of its ``flags`` parameter; the verb is
    called with their values as ``flags`` (a dict by option name), the rest as typer parses them.

    Typer reads ``__signature__`` and ``__annotations__``, so ``--help`` lists the options where
    the ``flags`` parameter stands, in table order, exactly as if they were written out.
    """
    specs = option_table.for_verb(verb)

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(fn, eval_str=True)
        params: list[inspect.Parameter] = []
        for p in own.parameters.values():
            if p.name != FLAGS:
                params.append(p)
                continue
            params += [inspect.Parameter(s.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=option(s, verb),
                                         annotation=annotation(s, verb)) for s in specs]

        @functools.wraps(fn)
        def command(**values: Any) -> Any:
            flags = {s.name: values.pop(s.name) for s in specs}
            return fn(**values, flags=flags)

        command.__signature__ = own.replace(parameters=params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def click_command(app: typer.Typer, line: list[str]):
    """The click command typer builds from ``app``, built for this line only, with cheap coercion.

    The same parse as ``app(...)`` (which is ``typer.main.get_command(app)(...)`` with typer's
    exception hook, a no-op here since pretty exceptions are off), minus two costs that a
    missing path or a typo used to pay before its one-line answer (issue 33: under 0.3 s):

    * when the line names a command right away (``[--debug] CMD ...``), the group holds that
      command only: typer builds every command's parameters from its signature otherwise, and
      nothing else of them is read on such a line (``-h`` or ``--version`` before the command,
      or no command, gets the whole group);
    * each parameter coerces its value by `coercion` below, which answers as typer does for
      the values whose outcome is plain and hands every other value to typer's own coercion
      (pydantic, imported and built only then).
    """
    import copy

    from typer.main import get_command

    view = app
    head = line[1:] if line[:1] == ["--debug"] else line
    if head and not head[0].startswith("-"):
        named = [c for c in app.registered_commands
                 if (c.name or (c.callback.__name__ if c.callback else "")).replace("_", "-") == head[0]]
        if len(named) == 1:
            view = copy.copy(app)  # the same settings and callback, one command
            view.registered_commands = named
    command = get_command(view)
    if view is not app and head[0] not in getattr(command, "commands", {}):
        command = get_command(app)  # typer named it otherwise: the whole group, as before
    for cmd in [command, *getattr(command, "commands", {}).values()]:
        for param in cmd.params:
            _coerce_cheaply(param)
        if callable(getattr(cmd, "get_help_option", None)):  # made on first use, coerced like the others
            cmd.get_help_option = _with_cheap_coercion(cmd.get_help_option)
    return command


def _with_cheap_coercion(get_help_option):
    def wrapped(ctx):
        help_option = get_help_option(ctx)
        _coerce_cheaply(help_option)
        return help_option

    return wrapped


def _coerce_cheaply(param) -> None:
    """Give a typer parameter `coercion` (nothing for another kind of parameter, or a typer without it)."""
    if (hasattr(param, "type_descriptor") and callable(getattr(type(param), "get_runtime_param", None))
            and "get_runtime_param" not in vars(param)):
        param.get_runtime_param = coercion(param)


_DIGITS = re.compile(r"[0-9]{1,15}")
_DECIMAL = re.compile(r"[0-9]{1,15}(\.[0-9]{1,15})?")
_TYPER_DECIDES = object()  # a value `coercion` leaves to typer's own coercion


def coercion(param):
    """``param``'s value coercion (typer's ``get_runtime_param``): the same result as typer's for the
    values whose outcome is plain, typer's own coercion (a pydantic adapter, ~0.1 s to import and
    build) for every other value and for every error, so each message stays typer's.

    Plain: None; a str for str; digits for int and float (at or above ``min=``); a value one of
    `choice`'s parsers accepts; a path that does not exist or is readable; a list of those.
    tests/test_cli_fast_parse.py checks the results against typer's own for every parameter.
    """
    from types import SimpleNamespace

    real = []

    def typer_coercion():
        if not real:
            real.append(type(param).get_runtime_param(param))
        return real[0]

    info = param.type_descriptor.parameter_info
    annotation = param.type_descriptor.annotation
    multi = param.multiple or param.nargs == -1
    item_type = annotation
    if multi:
        item_type = getattr(annotation, "__args__", (None,))[0] if getattr(annotation, "__origin__", None) is list else None

    def item(value):
        """The coerced value, or `_TYPER_DECIDES` when it is not plain."""
        if info.parser is not None:
            try:
                return info.parser(value)
            except Exception:  # noqa: BLE001 - typer's coercion raises it as typer does
                return _TYPER_DECIDES
        if type(value) is str and item_type is str:
            return value
        if item_type in (int, float) and info.max is None and not info.clamp:
            if type(value) is str and (_DIGITS if item_type is int else _DECIMAL).fullmatch(value):
                value = item_type(value)
            if type(value) is item_type and (info.min is None or value >= info.min):
                return value
            return _TYPER_DECIDES
        if item_type is Path and info.path_type is None and not (info.exists or info.resolve_path or info.writable
                                                                 or info.allow_dash or not info.file_okay
                                                                 or not info.dir_okay):
            if type(value) is str and value:
                value = Path(value)
            if isinstance(value, Path):
                try:
                    os.stat(value)
                except OSError:
                    return value
                except Exception:  # noqa: BLE001 - e.g. a NUL byte: typer decides
                    return _TYPER_DECIDES
                if not info.readable or os.access(value, os.R_OK):
                    return value
        return _TYPER_DECIDES

    def coerce(value, param, ctx):  # typer's RuntimeParam.coerce, keywords and all
        if value is None:
            return () if multi else None
        if not multi:
            out = item(value)
            return out if out is not _TYPER_DECIDES else typer_coercion().coerce(value, param=param, ctx=ctx)
        if isinstance(value, (list, tuple)) and item_type is not None:
            out = [item(v) for v in value]
            if not any(v is _TYPER_DECIDES for v in out):
                return out
        return typer_coercion().coerce(value, param=param, ctx=ctx)

    fast = SimpleNamespace(coerce=coerce)
    return lambda: fast
