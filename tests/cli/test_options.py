"""Each option is written once: its default, help and panel on a config field, the typer option built from it."""

import ast
import dataclasses

import pytest
import typer.main
from typer.testing import CliRunner

import klpipe.cli
from klpipe.cli import app
from klpipe.cli.fields import build, option_fields
from klpipe.inspect.config import InspectConfig
from klpipe.precompute.config import PrecomputeConfig, RayConfig, ShardOptions
from klpipe.score.config import ScoreConfig
from klpipe.score.controller import ControllerConfig
from tests.helpers import ROOT

COMMANDS = typer.main.get_command(app).commands
CONFIGS = {"precompute": (PrecomputeConfig, ShardOptions, RayConfig), "score": (ScoreConfig, ControllerConfig),
           "inspect": (InspectConfig,)}
CLI = ROOT / "klpipe" / "cli"


def typer_calls(path) -> list[ast.Call]:
    """The calls of typer.Option / typer.Argument in a module's source."""
    return [node for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("Option", "Argument") and getattr(node.func.value, "id", None) == "typer"]


def test_no_command_writes_an_option_of_its_own():
    # fields.py builds every option from a field; app.py's --version is the app's, and configures nothing.
    writers = {path.name: typer_calls(path) for path in sorted(CLI.glob("*.py")) if typer_calls(path)}
    assert set(writers) == {"fields.py", "app.py"}, writers
    [version] = writers["app.py"]
    assert [arg.value for arg in version.args[1:]] == ["--version"]


@pytest.mark.parametrize("command", CONFIGS)
def test_every_option_is_a_field_with_the_same_default_and_help(command):
    fields = {(shown.name or f.name): (f, shown) for config in CONFIGS[command] for f, shown in option_fields(config)}
    params = {param.name: param for param in COMMANDS[command].params}
    assert set(params) == set(fields)
    for name, param in params.items():
        f, shown = fields[name]
        assert param.help == shown.help
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            assert param.required
        elif f.default_factory is not dataclasses.MISSING:
            assert param.default in (None, ())  # the field's factory makes the value
        else:
            assert param.default == f.default, name


def test_the_environment_variables_keep_their_names():
    # Users' job scripts set these: the names derived from the fields are the ones documented before them.
    envvars = {f"{command} {param.name}": param.envvar for command, click in COMMANDS.items() for param in click.params}
    assert envvars["precompute inputs"] == "KLPIPE_INPUTS"
    assert envvars["precompute columns"] == "KLPIPE_COLUMN"
    assert envvars["precompute address"] == "KLPIPE_RAY"
    assert envvars["precompute gpus_per_shard"] == "KLPIPE_RAY_GPUS_PER_SHARD"
    assert envvars["precompute shard_index"] == "KLPIPE_SHARD_INDEX"
    assert envvars["score caches"] == "KLPIPE_SCORE_CACHES"
    assert envvars["score kl_target"] == "KLPIPE_SCORE_KL_TARGET"
    assert envvars["score clamp"] == "KLPIPE_SCORE_CLAMP"
    assert envvars["inspect scored"] == "KLPIPE_INSPECT_SCORED"
    assert envvars["inspect rows"] == "KLPIPE_INSPECT_ROW"


def test_a_config_built_from_the_defaults_is_the_librarys_own():
    given = {param.name: param.default for param in COMMANDS["score"].params}
    given["caches"] = ["a.parquet"]
    built = build(ScoreConfig, given, controller=build(ControllerConfig, given))
    assert built == ScoreConfig(inputs=["a.parquet"])
    given = {param.name: param.default for param in COMMANDS["precompute"].params}
    given.update(inputs=["r.parquet"], model="m", columns=["reward=score"])
    assert build(PrecomputeConfig, given) == PrecomputeConfig(inputs=["r.parquet"], model="m",
                                                                 columns={"reward": "score"})


def test_help_never_names_the_original_controller_by_a_nickname():
    runner = CliRunner()
    for command in COMMANDS:
        result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0 and "--help" in result.output
        assert "seed" not in result.output.lower(), command


def test_the_commands_are_the_three_documented():
    assert set(COMMANDS) == {"precompute", "score", "inspect"} and klpipe.cli.app is app
