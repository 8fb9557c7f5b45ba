"""The typer app and the one place where errors become `Error: ...` lines and exit codes."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable

import typer

from klpipe.errors import KlpipeError, first_line

app = typer.Typer(
    name="klpipe",
    help="Offline reference logprobs and adaptive KL penalties for RL fine-tuning.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def _print_version(value: bool) -> None:
    if value:
        from klpipe import __version__

        print(f"klpipe {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print klpipe's version and exit."),
) -> None:
    """Offline reference logprobs and adaptive KL penalties for RL fine-tuning."""


# Exit codes, documented in docs/operations.md. A KlpipeError carries its own (errors.py: 2, or 75 when stopped).
EXIT_INTERNAL = 1  # a bug: an exception klpipe did not expect


def debug_enabled() -> bool:
    return os.environ.get("KLPIPE_DEBUG", "") not in ("", "0", "false", "no")


def handle_errors(func: Callable) -> Callable:
    """Turn expected errors into one stderr line and an exit code; tracebacks only with KLPIPE_DEBUG=1."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except KlpipeError as exc:
            if debug_enabled():
                raise
            _error_line(str(exc))
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            if debug_enabled():
                raise
            _error_line("interrupted")
            raise typer.Exit(130) from None
        except Exception as exc:  # the last line of defence for a 3 a.m. cron job
            if debug_enabled():
                raise
            what = type(exc).__name__
            detail = first_line(exc)  # the type's name when the message is empty
            what += "" if detail == what else f": {detail}"
            _error_line(f"unexpected {what} (rerun with KLPIPE_DEBUG=1 for the traceback)")
            raise typer.Exit(EXIT_INTERNAL) from None

    return wrapper


def _error_line(message: str) -> None:
    # One line, always: a message with newlines would break log parsers downstream.
    print(f"Error: {' '.join(message.split())}", file=sys.stderr, flush=True)
