"""Command line: a thin layer that maps options onto typed configs and calls one library function.

Each command lives in its own module. None of them imports torch at module level, so
`klpipe score` starts fast and works where torch is not installed. docs/development.md maps the modules.
"""

# The order the commands register in is the order `klpipe --help` and docs/cli.md list them: the pipeline's.
# isort: off
from klpipe.cli import precompute as _precompute  # noqa: F401 - importing it registers the command
from klpipe.cli import score as _score  # noqa: F401 - importing it registers the command
from klpipe.cli import inspect as _inspect  # noqa: F401 - importing it registers the command
# isort: on
from klpipe.cli.app import app


def main() -> None:
    app()


__all__ = ["app", "main"]
