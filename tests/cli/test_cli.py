"""cli/app.py: the one place errors become an `Error: …` line and an exit code."""

import pytest
import typer

from klpipe.cli.app import handle_errors
from klpipe.errors import InputError, Preempted


def fails_with(exc: BaseException):
    @handle_errors
    def command():
        raise exc

    return command


@pytest.mark.parametrize("exc, code, line", [
    (InputError("a.parquet: row 3: reward is NaN"), 2, "Error: a.parquet: row 3: reward is NaN"),
    (Preempted("stopped by SIGTERM"), 75, "Error: stopped by SIGTERM"),
    (ValueError("first line\nsecond line"), 1,
     "Error: unexpected ValueError: first line (rerun with KLPIPE_DEBUG=1 for the traceback)"),
    (AssertionError(), 1, "Error: unexpected AssertionError (rerun with KLPIPE_DEBUG=1 for the traceback)"),
])
def test_errors_become_one_line_and_an_exit_code(capsys, monkeypatch, exc, code, line):
    monkeypatch.delenv("KLPIPE_DEBUG", raising=False)
    with pytest.raises(typer.Exit) as excinfo:
        fails_with(exc)()
    assert excinfo.value.exit_code == code
    assert capsys.readouterr().err == line + "\n"


def test_klpipe_debug_lets_the_traceback_through(monkeypatch):
    monkeypatch.setenv("KLPIPE_DEBUG", "1")
    with pytest.raises(ValueError, match="boom"):
        fails_with(ValueError("boom"))()
