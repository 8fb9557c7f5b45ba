"""Each command-line option written once: beside its config field, as that field's metadata.

A config dataclass (precompute/config.py, score/config.py, ...) holds a field's default; `option()` adds what the
command line shows of it: the help text, the flags, the panel and the metavar. klpipe/cli/fields.py builds the
typer options from these fields, and docs/cli.md is generated from the options, so nothing about an option is
written twice. The environment variable is the command's prefix and the option's name (KLPIPE_SCORE_KL_TARGET).
Library callers build the configs directly and never need this: no typer here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any

KEY = "klpipe.option"  # the key of a field's metadata under which its Option sits


@dataclass(frozen=True)
class Option:
    """What the command line shows of one config field."""

    help: str
    flags: tuple[str, ...] = ()  # ("--output", "-o"), ("--clamp/--no-clamp",); (): --the-field-name
    panel: str | None = None  # the --help panel it is listed in; None: the command's main options
    metavar: str | None = None
    name: str | None = None  # the command line's name for the field where that differs (an argument's: caches)
    show_default: bool = True  # False where the default is worked out at run time (the help says how)
    # The command line's value → the field's: a file read (--tools), `ROLE=NAME` pairs split (--column).
    parse: Callable[[Any], Any] | None = None
    cli_type: Any = None  # the type typer parses, where `parse` makes the field's type out of another
    argument: bool = False  # positional

    def names(self, field_name: str) -> tuple[str, ...]:
        """The option's flags: as given, else --field-name."""
        return self.flags or (f"--{field_name.replace('_', '-')}",)

    def env(self, prefix: str, field_name: str) -> str:
        """prefix + the option's long name (or an argument's metavar) in capitals: KLPIPE_SCORE_KL_TARGET."""
        name = (self.name or field_name) if self.argument else self.names(field_name)[0].split("/")[0]
        return prefix + name.lstrip("-").upper().replace("-", "_")


def option(default: Any = MISSING, *, default_factory: Any = MISSING, **shown: Any) -> Any:
    """A dataclass field with a default (or none: required) and how the command line shows it (Option's fields)."""
    return field(default=default, default_factory=default_factory, metadata={KEY: Option(**shown)})


# `--column` of precompute and score. The roles are klpipe.columns.ROLES, written out so that `--help` need not
# import pyarrow (tests/test_columns.py holds the two together).
COLUMN_HELP = ("Read role ROLE from column NAME, e.g. `--column response_ids=completion_ids`; repeatable. "
               "Roles: id, step, prompt, response, prompt_ids, response_ids, policy_logprobs, sampler_logprobs, "
               "reward, ref_logprobs, mask, tools. The mask is found as tool_mask or env_mask when not mapped. In the "
               "environment variable, separate mappings with spaces.")


def parse_columns(specs: list[str] | None) -> dict[str, str]:
    """--column's `ROLE=NAME` pairs as {role: column}; klpipe.columns reads them (pyarrow, so only when run)."""
    from klpipe.columns import parse_columns

    return parse_columns(specs)
