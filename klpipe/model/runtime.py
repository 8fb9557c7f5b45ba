"""What the stage records and sizes from torch without importing it: the device's memory, the library versions."""

from __future__ import annotations

import torch
import transformers


def device_memory_bytes(device: str) -> int:
    """The total memory of CUDA device `device` (`cuda`, `cuda:N`)."""
    return torch.cuda.get_device_properties(torch.device(device)).total_memory


def device_free_bytes(device: str) -> int:
    """The memory CUDA device `device` has free now (what this process and others hold left out)."""
    return torch.cuda.mem_get_info(torch.device(device))[0]


def device_reserved_bytes(device: str) -> int:
    """What torch's caching allocator of this process holds on CUDA device `device` now."""
    return torch.cuda.memory_reserved(torch.device(device))


def library_versions() -> dict[str, str]:
    """The versions that move the numbers, as the cache's provenance records them."""
    return {"torch": torch.__version__, "transformers": transformers.__version__}
