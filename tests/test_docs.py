"""The docs document every option and environment variable of the three commands, with its default.

The list comes from the typer app itself (click's parameters), as sqlite-utils checks its docs
against its commands: a new option, a renamed environment variable or a changed default fails
here until the tables on docs/cli.md say so, and so does a row for an option that no longer exists.
The README stays one screen that starts with a command on one's own data, every page of docs/ is
in mkdocs.yml's nav, and no page calls the original controller by a nickname.
"""

import re

import pytest
import typer.main

from klpipe.cli import app
from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
CLI = (DOCS / "cli.md").read_text()
COMMANDS = typer.main.get_command(app).commands


def option_table(command: str) -> dict[str, list[str]]:
    """docs/cli.md's option table for `klpipe COMMAND`: each name in a row's first cell → that row's cells."""
    section = CLI.split(f"## `klpipe {command}`\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]  # `\|` is a pipe inside a cell
        for quoted in re.findall(r"`([^`]+)`", cells[0]):
            for name in quoted.removesuffix("…").split("/"):
                rows[name] = cells
    return rows


def names(param) -> list[str]:
    """How the docs name a parameter: its option strings, or an argument's name in capitals."""
    if param.param_type_name == "argument":
        return [param.name.upper()]
    return param.opts + param.secondary_opts


def params():
    return [pytest.param(command, param, id=f"{command}-{param.name}")
            for command, click_command in COMMANDS.items() for param in click_command.params]


def test_the_reference_page_is_written_from_the_commands():
    from klpipe.cli import reference

    assert reference.markdown() == CLI, "docs/cli.md is stale: run `make cli-docs`"


@pytest.mark.parametrize("command, param", params())
def test_every_option_is_in_the_docs_with_its_env_var_and_default(command, param):
    table = option_table(command)
    for name in names(param):
        assert name in table, f"docs/cli.md: the `klpipe {command}` table has no row for {name}"
    option, env_var, default = table[names(param)[0]][:3]
    assert env_var == f"`{param.envvar}`", f"docs/cli.md: {option} reads {param.envvar}, the table says {env_var!r}"
    if param.required:
        assert default == "required", f"docs/cli.md: {option} is required, the table says {default!r}"
    elif getattr(param, "is_flag", False):
        assert default == ("on" if param.default else "off"), f"docs/cli.md: {option} defaults to {param.default}"
    elif param.default is not None:  # None: the default is worked out at run time, which the cell describes
        shown = re.fullmatch(r"`([^`]+)`", default)
        assert shown, f"docs/cli.md: {option}'s default should be `{param.default}`, the table says {default!r}"
        if isinstance(param.default, str):
            assert shown.group(1) == param.default
        else:
            assert float(shown.group(1)) == param.default, f"docs/cli.md: {option} defaults to {param.default}"


@pytest.mark.parametrize("command", COMMANDS)
def test_the_docs_document_no_option_that_does_not_exist(command):
    known = {name for param in COMMANDS[command].params for name in names(param)}
    assert set(option_table(command)) - known == set()


def test_the_debug_variable_is_documented():
    assert "KLPIPE_DEBUG=1" in README
    assert "KLPIPE_DEBUG=1" in (DOCS / "operations.md").read_text()  # beside the exit codes


def test_the_readme_is_one_screen_that_opens_with_a_run_on_ones_own_data():
    lines = README.splitlines()
    assert len(lines) <= 60, f"README.md has {len(lines)} lines, more than a screen: move the detail into docs/"
    assert any(re.match(r"\s*klpipe precompute .*--model ", line) for line in lines[:40]), (
        "README.md: a `klpipe precompute --model ...` command on one's own data within the first 40 lines")


# Names that hold the word and are no nickname: an environment variable, a path and a benchmark flag that name the
# original controller's file, and a model family of transformers' registry.
SEED_NAMES = ("shared/seed/", "seedoss", "seed_oss")  # a directory beside the clone; a registry family


@pytest.mark.parametrize("path", ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))])
def test_the_original_controller_has_no_nickname(path):
    """The controller klpipe grew out of is "the original controller" (docs/controller.md names it once)."""
    text = (ROOT / path).read_text().lower()
    for name in SEED_NAMES:
        text = text.replace(name, "")
    assert "seed" not in text, f"{path}: say \"the original controller\" ({text[text.index('seed') - 40:][:80]!r})"


def test_every_docs_page_is_in_the_nav():
    """mkdocs.yml's nav lists every page (mkdocs build --strict says so too, where the docs extra is installed)."""
    config = (ROOT / "mkdocs.yml").read_text()
    nav = config.split("\nnav:\n", 1)[1].split("\n\n", 1)[0]
    nav = re.split(r"\n(?=\S)", nav, maxsplit=1)[0]  # up to the next top-level key
    listed = re.findall(r"^\s+- (?:[^:\n]+: )?(\S+\.md)\s*$", nav, re.M)
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(listed) == pages
    assert re.search(r"^docs_dir: docs$", config, re.M)


def test_the_license_is_an_spdx_expression():
    # The old `license = { text = ... }` table made every install print a deprecation wall.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
