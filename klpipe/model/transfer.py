"""Host ↔ device copies off the critical path: pinned and non-blocking on CUDA, plain on CPU.

A pageable copy to the GPU blocks the host until it is done, and a copy back blocks until every
kernel before it is: the host then waits where it could be gathering the next batch. Pinned memory
lets both run asynchronously; it is asked for only where CUDA is, since pinning needs a driver.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(array: np.ndarray, device) -> torch.Tensor:
    """`array` on `device`: on CUDA through pinned memory without blocking the host (ordered on the stream)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(values: torch.Tensor) -> torch.Tensor:
    """`values` on the CPU: on CUDA into pinned memory without blocking, then one synchronize (the caller's one
    sync)."""
    if values.device.type != "cuda":
        return values
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    torch.cuda.current_stream(values.device).synchronize()
    return host
