"""Every error klpipe expects a user to see. The CLI renders them as one `Error: ...` line."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message: libraries' errors run to paragraphs, ours are one line."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class KlpipeError(Exception):
    """Base class: a problem with the user's input, model or environment, not a bug in klpipe."""

    exit_code = 2


class InputError(KlpipeError):
    """An input file is missing, unreadable, or has bad columns or values."""


class ModelError(KlpipeError):
    """The reference model or tokenizer cannot be loaded or used safely."""


class ProvenanceError(KlpipeError):
    """Caches or work directories that disagree about how they were made."""


class StateError(KlpipeError):
    """A controller state file that cannot be used with this run."""


class OutputError(KlpipeError):
    """An output cannot be written (disk full, permissions, another run holds it)."""


class StoreError(KlpipeError):
    """A store (S3 or another) is missing the bucket, refuses the credentials or the request, or cannot be reached."""


class RerunLater(KlpipeError):
    """Stopped with nothing lost and nothing half-written; the same command, run again later, goes on."""

    exit_code = 75  # EX_TEMPFAIL: "try again later", distinct from bad input (2) and bugs (1)


class Preempted(RerunLater):
    """Stopped by SIGTERM or SIGUSR1 after flushing finished work; rerun the same command to resume."""


class StateBusy(RerunLater):
    """Another run holds the controller state, or saved it while this one ran: this run did not advance it."""
