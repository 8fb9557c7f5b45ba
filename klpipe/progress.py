"""Progress for people and for logs: a bar on a terminal, plain periodic lines under cron or Slurm."""

from __future__ import annotations

import resource
import sys
import time

PROGRESS_MODES = ("auto", "bar", "log", "none")  # auto: bar on a terminal, log lines otherwise


class Progress:
    def __init__(self, mode: str, total_rows: int, initial_rows: int = 0, log=print, interval: float = 30.0):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
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
