"""Faults for the Ray tests, put into the Ray workers of one driver's job, as tests/fault_runner.py puts them into a
child: by wrapping a real seam of klpipe (which has no test hooks), here WorkDir.write_chunk.

Ray runs `install` in every worker process it starts for the job (its `worker_process_setup_hook`); the test sets
the hook and the fault through RAY_JOB_CONFIG_JSON_ENV_VAR, the job config `ray job submit` hands its driver.
KLPIPE_RAY_FAULT is JSON: {"shard": I, "action": "pause" | "raise", "dir": DIR}.
  pause  once the shard's first chunk is checkpointed, on its first attempt only: write this worker's pid to
         DIR/pid and sleep, for the test to kill the worker (SIGKILL) mid-shard.
  raise  on every attempt, before the shard's first chunk is written: a RuntimeError, as a bug would raise.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

FAULT_VARIABLE = "KLPIPE_RAY_FAULT"


def job_config(fault: dict) -> str:
    """The value of RAY_JOB_CONFIG_JSON_ENV_VAR that makes the driver's workers inject `fault`."""
    return json.dumps({"runtime_env": {"worker_process_setup_hook": f"{__name__}.install",
                                       "env_vars": {FAULT_VARIABLE: json.dumps(fault)}}})


def install() -> None:
    spec = json.loads(os.environ.get(FAULT_VARIABLE) or "null")
    if not spec:
        return
    from klpipe.precompute import workdir

    original = workdir.WorkDir.write_chunk
    part = f"part-{spec['shard']:05d}-of-"
    marker = Path(spec["dir"]) / "pid"

    def write_chunk(self, *args, **kwargs):
        if not self.output.name.startswith(part):
            return original(self, *args, **kwargs)
        if spec["action"] == "raise":
            raise RuntimeError(f"injected fault in shard {spec['shard']}")
        result = original(self, *args, **kwargs)
        if spec["action"] == "pause" and not marker.exists():
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(str(os.getpid()))
            tmp.rename(marker)
            time.sleep(600)  # until the test kills this worker
        return result

    workdir.WorkDir.write_chunk = write_chunk
