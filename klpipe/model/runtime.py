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


def device_identity(device: str) -> dict[str, str]:
    """The device a verdict was reached on, as far as it could change one (storage/verdicts.py): its name and
    capability (a CUDA device's compute capability; a CPU's model and the instructions torch's kernels use), and the
    machine's name, so that a verdict never crosses machines."""
    import platform

    if str(device).startswith("cuda"):
        index = torch.device(device).index or 0
        major, minor = torch.cuda.get_device_capability(index)
        name, capability = torch.cuda.get_device_name(index), f"sm_{major}{minor}"
    else:
        name, capability = _cpu_name(), torch.backends.cpu.get_cpu_capability()
    return {"name": name, "capability": capability, "host": platform.node()}


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor() or platform.machine()


def verdict_parts(reference) -> dict:
    """What of a loaded model could change the load-time checks' verdict, beyond what the run's options say: the
    versions, the device, the dtype and the attention implementation transformers loaded it with."""
    return {**library_versions(), "device": device_identity(str(reference.device)),
            "dtype": str(reference.dtype).removeprefix("torch."), "attention": str(reference.own_attention),
            "class": type(reference.model).__name__, "streamed": reference.streamer is not None}
