"""Typer options built from config fields, and the configs built back from what they were given.

Each option is written once, as a config field with its Option (klpipe/options.py). `options(...)` turns a
command function taking one dict into a function whose signature lists those fields as typer options; `build`
makes a config out of that dict. A field without an Option (a library-only knob) is not on the command line.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from klpipe.options import KEY, Option

# Names the configs only import for type checkers: what typer parses in their place.
TYPE_CHECKING_NAMES = {"Location": str}


def option_fields(config_class: type) -> list[tuple[dataclasses.Field[Any], Option]]:
    """The fields of a config dataclass that are command-line options, in their order."""
    return [(f, f.metadata[KEY]) for f in dataclasses.fields(config_class) if KEY in f.metadata]


def _annotation(config_class: type, f: dataclasses.Field[Any]) -> Any:
    """A field's type as an object (the configs write `from __future__ import annotations`: it is a string), read in
    its config's module. This field's alone: another may name a type its module imports only for type checkers."""
    if not isinstance(f.type, str):
        return f.type
    one = types.SimpleNamespace(__annotations__={f.name: f.type})
    namespace = vars(sys.modules[config_class.__module__])
    return typing.get_type_hints(one, namespace, TYPE_CHECKING_NAMES, include_extras=True)[f.name]


def _parameter(config_class: type, f: dataclasses.Field[Any], shown: Option, env_prefix: str) -> inspect.Parameter:
    kind = shown.cli_type or _annotation(config_class, f)
    said: dict[str, Any] = dict(help=shown.help, envvar=shown.env(env_prefix, f.name), show_default=shown.show_default,
                                rich_help_panel=shown.panel, metavar=shown.metavar)
    info = typer.Argument(**said) if shown.argument else typer.Option(*shown.names(f.name), **said)
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = None  # not given: the field's factory makes it (an empty mapping, an empty list)
    else:
        default = inspect.Parameter.empty  # required
    return inspect.Parameter(shown.name or f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, info])


def options(*config_classes: type, env_prefix: str) -> Callable[[Callable[[dict], Any]], Callable[..., Any]]:
    """Decorate `command(given: dict)`: typer sees every option field of `config_classes`, by the field's name."""

    def decorate(command: Callable[[dict], Any]) -> Callable[..., Any]:
        parameters = [_parameter(config_class, f, shown, env_prefix)
                      for config_class in config_classes for f, shown in option_fields(config_class)]
        names = [parameter.name for parameter in parameters]
        assert len(names) == len(set(names)), f"two configs name the same option: {names}"

        @functools.wraps(command)
        def typer_command(**given: Any) -> Any:
            return command(given)

        typer_command.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # typer reads it
        typer_command.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
        del typer_command.__wrapped__  # typer reads the signature above, not the command's own
        return typer_command

    return decorate


def build(config_class: type, given: dict, **others: Any) -> Any:
    """`config_class` from the options given (parsed where the field says how) and `others` (fields not options)."""
    values = {}
    for f, shown in option_fields(config_class):
        value = given[shown.name or f.name]
        if value is None and (f.default is None or f.default_factory is not dataclasses.MISSING):
            continue  # left out: the field's own default
        values[f.name] = shown.parse(value) if shown.parse is not None else value
    return config_class(**values, **others)
