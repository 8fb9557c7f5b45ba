"""Progress for people and for logs: a bar on a terminal, plain periodic lines under cron or Slurm.

Both stages take `--progress` and `--log-interval`, each field written once here and meaning the same on both.
"""

from __future__ import annotations

import importlib.util
import resource
import sys
import time
from typing import Any

from klpipe.errors import InputError
from klpipe.options import option

PROGRESS_MODES = ("auto", "bar", "log", "none")  # auto: bar on a terminal, log lines otherwise


def progress_field(panel: str) -> Any:
    """A config's `progress` field: the --progress option, listed in `panel`."""
    return option("auto", panel=panel,
                  help="auto | bar | log | none. auto: a bar on a terminal, log lines under cron or Slurm.")


def log_interval_field(panel: str) -> Any:
    """A config's `log_interval` field: the --log-interval option, listed in `panel`."""
    return option(30.0, panel=panel, help="Seconds between progress log lines.")


def check_progress(mode: str) -> None:
    """Refuse a mode that is none of PROGRESS_MODES, and a bar where tqdm, which draws it, is not installed."""
    if mode not in PROGRESS_MODES:
        raise InputError(f"--progress must be {', '.join(PROGRESS_MODES[:-1])} or {PROGRESS_MODES[-1]}, not {mode!r}")
    if mode == "bar" and not _has_tqdm():
        raise InputError("--progress bar draws with tqdm, which is not installed: pip install tqdm "
                         "(klpipe[precompute] brings it), or --progress log")


def _has_tqdm() -> bool:
    # klpipe[precompute] installs tqdm; a scoring host (`pip install klpipe`) may not have it.
    return importlib.util.find_spec("tqdm") is not None


class Progress:
    def __init__(self, mode: str, total_rows: int, initial_rows: int = 0, log=print, interval: float = 30.0):
        if mode == "auto":  # where tqdm is missing, log lines on a terminal too
            mode = "bar" if sys.stderr.isatty() and _has_tqdm() else "log"
        self.mode = mode
        self.total_rows = total_rows
        self.rows = initial_rows
        self.tokens = 0
        self.log = log
        self.interval = interval
        self.started = time.perf_counter()
        self.last_log = self.started
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total_rows, initial=initial_rows, unit="row", file=sys.stderr, dynamic_ncols=True)

    def update(self, rows: int, tokens: int, detail: str = "") -> None:
        """`detail`: more to show after the rate (a Ray run's shards and nodes)."""
        self.rows += rows
        self.tokens += tokens
        elapsed = time.perf_counter() - self.started
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        if self.bar is not None:
            self.bar.update(rows)
            self.bar.set_postfix_str(f"{rate:,.0f} tok/s" + (f", {detail}" if detail else ""), refresh=False)
        elif self.mode == "log" and (time.perf_counter() - self.last_log >= self.interval):
            self.last_log = time.perf_counter()
            self.log(f"progress: {self.rows}/{self.total_rows} rows "
                     f"({100 * self.rows / max(self.total_rows, 1):.1f}%), {rate:,.0f} tokens/s"
                     + (f"; {detail}" if detail else ""))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def peak_memory() -> dict:
    """Peak resident memory of this process, and peak CUDA memory where torch has touched a GPU."""
    peak = {"rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        peak["cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return peak
