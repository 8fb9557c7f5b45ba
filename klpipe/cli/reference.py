"""docs/cli.md, the option reference, written from the commands themselves: `python -m klpipe.cli.reference`.

Each option's help, default and environment variable come from its config field (klpipe/options.py) through the
typer command, so the page says what `--help` says; tests/test_docs.py fails when the page is out of date.
"""

from __future__ import annotations

import sys

import typer.main
from typer.core import TyperGroup

from klpipe.cli import app

HEADER = """# Command-line reference

Every option of the three commands, with the environment variable that sets it and its default. The subject pages
say what the options do: [precompute](precompute.md), [score](score.md), [inspect](inspect.md). `klpipe precompute`
reads `KLPIPE_<OPTION>`, `klpipe score` reads `KLPIPE_SCORE_<OPTION>` and `klpipe inspect` `KLPIPE_INSPECT_<OPTION>`,
so one command's environment never leaks into another's.

This page is written from the commands themselves (`make cli-docs`): it says what `klpipe COMMAND --help` says.
"""

def _cell(text: str) -> str:
    """Markdown table cell text: one line, its pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(param) -> str:
    if param.required:
        return "required"
    if getattr(param, "is_flag", False):
        return "on" if param.default else "off"
    if param.default is None or param.default == ():
        return "—"  # worked out at run time, or empty: the help says which
    return f"`{param.default}`"


def _names(param) -> str:
    if param.param_type_name == "argument":
        return f"`{param.name.upper()}`"
    return "/".join(f"`{name}`" for name in param.opts + param.secondary_opts)


def _row(param) -> str:
    return f"| {_names(param)} | `{param.envvar}` | {_default(param)} | {_cell(param.help or '')} |"


def markdown() -> str:
    """The whole page."""
    lines = [HEADER]
    group = typer.main.get_command(app)
    assert isinstance(group, TyperGroup), "klpipe has subcommands"
    for name, command in group.commands.items():
        lines += [f"## `klpipe {name}`", "", _cell((command.help or "").split("\n\n")[0]), ""]
        panels: dict[str | None, list] = {}
        for param in command.params:
            panels.setdefault(getattr(param, "rich_help_panel", None), []).append(param)
        for panel, params in panels.items():
            if panel is not None:
                lines += [f"### {panel}", ""]
            lines += ["| Option | Environment variable | Default | What it does |", "| --- | --- | --- | --- |"]
            lines += [_row(param) for param in params] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
