"""Graceful stop on SIGTERM / SIGUSR1, the signals Slurm sends before preemption or the time limit.

The first signal asks the run to stop at the next batch boundary: finished chunks are already on
disk, the current chunk is abandoned, and the process exits with Preempted.exit_code (75) so a
requeued job resumes. A second signal exits at once; atomic writes mean nothing under a final
name is partial either way.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from klpipe.errors import Preempted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopOnSignal:
    def __init__(self, log=print):
        self.log = log
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():  # signals can only be set there
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            # Second signal: the user (or Slurm) means it. Finished chunks are safe on disk.
            print(f"Error: received {name} again; exiting now", file=sys.stderr, flush=True)
            os._exit(Preempted.exit_code)
        self.received = signum
        self.log(f"received {name}: stopping after the current batch (send it again to exit at once)")

    def check(self) -> None:
        """Raise Preempted if a stop was asked for; called between batches."""
        if self.received is not None:
            name = signal.Signals(self.received).name
            raise Preempted(f"stopped by {name}; finished chunks are saved, rerun the same command to resume")
